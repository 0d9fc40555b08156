"""TFRecord files and tf.train.Example, without TensorFlow.

read_records() iterates the records of one TFRecord file (checking both CRCs), TFRecordWriter and
write_records() write one atomically, and parse_example()/encode_example() turn a tf.train.Example
into a dict of lists/arrays and back. The Example message classes are built at import time from a
descriptor written here with TensorFlow's field numbers, so the bytes on disk are TF's exactly;
_build_messages() does the same for any other FileDescriptorProto (e.g. TensorBoard's Event).
Uses numpy, torch (tensors as feature values), crc32c and protobuf.
"""
from __future__ import annotations

import dataclasses
import logging
import os
import struct
import uuid
import weakref
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any, BinaryIO

import crc32c
import numpy as np
import torch
from google.protobuf import descriptor_pb2, descriptor_pool, message, message_factory
from mirrored._files import fsync_directory

logger = logging.getLogger(__name__)

__all__ = [
    "BytesList", "CorruptRecordError", "Example", "Feature", "Features", "FloatList", "Int64List",
    "RecordStats", "TFRecordWriter", "encode_example", "parse_example", "read_records",
    "write_records",
]

# Framing of one record: uint64 length, uint32 masked crc32c(length), data, uint32 masked crc(data).
_HEADER = struct.Struct("<QI")
_CRC = struct.Struct("<I")
_FRAMING_BYTES = _HEADER.size + _CRC.size
_MASK_DELTA = 0xA282EAD8  # TF masks CRCs so a CRC stored inside CRC'd data does not cancel out
_READ_BUFFER_BYTES = 1 << 20  # records are usually small: one read() per MiB, not per record
_WRITE_BUFFER_BYTES = 1 << 20
_INT64_MIN, _INT64_MAX = -(1 << 63), (1 << 63) - 1


def _masked_crc(data: bytes) -> int:
    crc = crc32c.crc32c(data)
    return (((crc >> 15) | (crc << 17)) + _MASK_DELTA) & 0xFFFFFFFF


# --------------------------------------------------------------------------------------------
# Reading and writing records


class CorruptRecordError(ValueError):
    """A TFRecord file whose framing or CRCs do not check out; names the file and byte offset."""

    def __init__(self, path: str, offset: int, reason: str):
        self.path, self.offset, self.reason = path, offset, reason
        super().__init__(
            f"{path}: corrupt TFRecord at byte offset {offset}: {reason}. Re-create the file, or "
            f"pass skip_corrupt=True to read_records() to skip what is damaged.")


@dataclasses.dataclass
class RecordStats:
    """Counts kept by read_records(stats=...); one object may be shared by several files."""

    records: int = 0  # records yielded
    skipped_records: int = 0  # a damaged tail of a file counts as one
    skipped_bytes: int = 0


def read_records(path: str | os.PathLike, *, verify_crc: bool = True, skip_corrupt: bool = False,
                 stats: RecordStats | None = None) -> Iterator[bytes]:
    """Yields the records of one TFRecord file (uncompressed), like tf.data.TFRecordDataset.

    Args:
      verify_crc: check the length and data CRCs. Lengths are always checked against the bytes
        left in the file, so a forged length never allocates more than the file holds.
      skip_corrupt: instead of raising CorruptRecordError, skip a record whose data CRC is wrong
        and stop at a damaged length field or a truncated tail, logging a warning each time.
      stats: counts of records read and skipped are added to it.
    """
    stats = RecordStats() if stats is None else stats
    path = os.fspath(path)
    with open(path, "rb", buffering=_READ_BUFFER_BYTES) as f:
        read, unpack_header, unpack_crc = f.read, _HEADER.unpack, _CRC.unpack
        file_size = os.fstat(f.fileno()).st_size
        offset = 0
        while True:
            header = read(_HEADER.size)
            if len(header) == _HEADER.size:
                length, length_crc = unpack_header(header)
                ok = (length + _CRC.size <= file_size - offset - _HEADER.size
                      and (not verify_crc or _masked_crc(header[:8]) == length_crc))
            elif not header:
                return
            else:
                ok = False
            if not ok:
                file_size = os.fstat(f.fileno()).st_size  # the file may have grown since opened
                reason = _check_header(header, offset, file_size, verify_crc)
                if reason is not None:
                    # Past a bad length field there is no telling where the next record starts.
                    _corrupt(path, offset, reason, skip_corrupt, stats,
                             skipped_bytes=file_size - offset)
                    return
            data = read(length)
            footer = read(_CRC.size)
            if len(data) != length or len(footer) != _CRC.size:  # shrank while we read it
                _corrupt(path, offset, "the file ends inside the record", skip_corrupt, stats,
                         skipped_bytes=_HEADER.size + len(data) + len(footer))
                return
            record_offset = offset
            offset += length + _FRAMING_BYTES
            if verify_crc and unpack_crc(footer)[0] != _masked_crc(data):
                _corrupt(path, record_offset, f"data CRC mismatch in a record of {length} bytes "
                         f"(stored 0x{unpack_crc(footer)[0]:08x}, computed "
                         f"0x{_masked_crc(data):08x})", skip_corrupt, stats,
                         skipped_bytes=length + _FRAMING_BYTES)
                continue
            stats.records += 1
            yield data


def _check_header(header: bytes, offset: int, file_size: int, verify_crc: bool) -> str | None:
    """Why the 12 header bytes at `offset` cannot start a record, or None if they can."""
    if len(header) < _HEADER.size:
        return f"the file ends {len(header)} bytes into a record header of {_HEADER.size} bytes"
    length, stored = _HEADER.unpack(header)
    if verify_crc:
        computed = _masked_crc(header[:8])
        if stored != computed:
            return (f"length CRC mismatch (stored 0x{stored:08x}, computed 0x{computed:08x}; "
                    f"length field reads {length})")
    left = file_size - offset - _HEADER.size
    if length + _CRC.size > left:
        return (f"the record claims {length} data bytes but only {max(left - _CRC.size, 0)} are "
                f"left in the file (truncated file)")
    return None


def _corrupt(path: str, offset: int, reason: str, skip: bool, stats: RecordStats, *,
             skipped_bytes: int) -> None:
    error = CorruptRecordError(path, offset, reason)
    if not skip:
        raise error
    stats.skipped_records += 1
    stats.skipped_bytes += skipped_bytes
    logger.warning("skipping %d bytes: %s", skipped_bytes, error)


class TFRecordWriter:
    """Writes a TFRecord file atomically, like tf.io.TFRecordWriter.

    Records go to a temporary file in the same directory; close() fsyncs it and renames it onto
    `path`. Leaving a `with` block by an exception (or dropping the writer unclosed) removes the
    temporary file, so `path` is either absent, its previous content, or complete.
    """

    def __init__(self, path: str | os.PathLike):
        self.path = os.fspath(path)
        self.records_written = 0
        directory, name = os.path.split(os.path.abspath(self.path))
        self._dir = directory
        self._tmp_path = os.path.join(directory, f".{name}.{uuid.uuid4().hex[:12]}.tmp")
        # os.open with 0o666 (not mkstemp's 0o600) so the final file gets the umask's permissions.
        fd = os.open(self._tmp_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
        self._file: BinaryIO | None = os.fdopen(fd, "wb", buffering=_WRITE_BUFFER_BYTES)
        self._finalizer = weakref.finalize(self, _discard, self._file, self._tmp_path)

    def write(self, record: bytes) -> None:
        """Appends one record (bytes, bytearray or memoryview)."""
        if self._file is None:
            raise ValueError(f"TFRecordWriter({self.path!r}).write: the writer is closed.")
        if not isinstance(record, bytes):
            if not isinstance(record, (bytearray, memoryview)):
                raise TypeError(
                    f"TFRecordWriter({self.path!r}).write: a record is bytes, got "
                    f"{type(record).__name__}. Serialize it first, e.g. encode_example(features) "
                    f"or text.encode().")
            record = bytes(record)
        length = struct.pack("<Q", len(record))
        self._file.write(length + _CRC.pack(_masked_crc(length)))
        self._file.write(record)
        self._file.write(_CRC.pack(_masked_crc(record)))
        self.records_written += 1

    def flush(self) -> None:
        if self._file is not None:
            self._file.flush()

    def close(self) -> None:
        """Makes the file durable and puts it at `path`; a second call does nothing."""
        if self._file is None:
            return
        file, self._file = self._file, None
        self._finalizer.detach()
        try:
            file.flush()
            os.fsync(file.fileno())
            file.close()
            os.replace(self._tmp_path, self.path)
        except BaseException:
            _discard(file, self._tmp_path)
            raise
        fsync_directory(self._dir)  # makes the rename itself survive a crash

    def abort(self) -> None:
        """Discards what was written; `path` is left as it was."""
        if self._file is not None:
            file, self._file = self._file, None
            self._finalizer.detach()
            _discard(file, self._tmp_path)

    def __enter__(self) -> TFRecordWriter:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()

    def __repr__(self) -> str:
        state = "closed" if self._file is None else "open"
        return f"TFRecordWriter({self.path!r}, records_written={self.records_written}, {state})"


def _discard(file: BinaryIO, tmp_path: str) -> None:
    try:
        file.close()
    finally:
        try:
            os.unlink(tmp_path)
        except FileNotFoundError:
            pass


def write_records(path: str | os.PathLike, records: Iterable[bytes]) -> int:
    """Writes `records` to a new TFRecord file at `path` atomically; returns how many."""
    with TFRecordWriter(path) as writer:
        for record in records:
            writer.write(record)
    return writer.records_written


# --------------------------------------------------------------------------------------------
# Building protobuf message classes from a descriptor written in code

_F = descriptor_pb2.FieldDescriptorProto


def _field(name: str, number: int, type_: int, *, repeated: bool = False,
           type_name: str | None = None, packed: bool = False,
           oneof_index: int | None = None) -> descriptor_pb2.FieldDescriptorProto:
    """One field of a message in a FileDescriptorProto; type_ is e.g. _F.TYPE_BYTES."""
    proto = _F(name=name, number=number, type=type_,
               label=_F.LABEL_REPEATED if repeated else _F.LABEL_OPTIONAL)
    if type_name is not None:
        proto.type_name = type_name
    if packed:
        proto.options.packed = True
    if oneof_index is not None:
        proto.oneof_index = oneof_index
    return proto


def _build_messages(file_proto: descriptor_pb2.FileDescriptorProto,
                    pool: descriptor_pool.DescriptorPool | None = None) -> dict[str, type]:
    """Message classes for every message in `file_proto`, keyed by name ("Outer.Inner" if nested).

    Adds the file to `pool`, by default a new private pool, so nothing clashes with other users of
    the same proto names (e.g. TensorFlow itself, if imported). Give one pool to several calls when
    one file depends on another.
    """
    pool = descriptor_pool.DescriptorPool() if pool is None else pool
    file_descriptor = pool.AddSerializedFile(file_proto.SerializeToString())
    classes: dict[str, type] = {}

    def add(descriptor, prefix: str) -> None:
        if descriptor.GetOptions().map_entry:
            return
        classes[prefix + descriptor.name] = message_factory.GetMessageClass(descriptor)
        for nested in descriptor.nested_types:
            add(nested, f"{prefix}{descriptor.name}.")

    for descriptor in file_descriptor.message_types_by_name.values():
        add(descriptor, "")
    return classes


def _example_file_proto() -> descriptor_pb2.FileDescriptorProto:
    """tensorflow/core/example/{feature,example}.proto in one file, with TF's field numbers."""
    file_proto = descriptor_pb2.FileDescriptorProto(
        name="mirrored/tensorflow_example.proto", package="tensorflow", syntax="proto3")
    file_proto.message_type.add(name="BytesList").field.append(
        _field("value", 1, _F.TYPE_BYTES, repeated=True))
    file_proto.message_type.add(name="FloatList").field.append(
        _field("value", 1, _F.TYPE_FLOAT, repeated=True, packed=True))
    file_proto.message_type.add(name="Int64List").field.append(
        _field("value", 1, _F.TYPE_INT64, repeated=True, packed=True))
    feature = file_proto.message_type.add(name="Feature")
    feature.oneof_decl.add(name="kind")
    for number, (name, type_name) in enumerate(
            [("bytes_list", "BytesList"), ("float_list", "FloatList"),
             ("int64_list", "Int64List")], start=1):
        feature.field.append(_field(name, number, _F.TYPE_MESSAGE,
                                    type_name=f".tensorflow.{type_name}", oneof_index=0))
    features = file_proto.message_type.add(name="Features")
    entry = features.nested_type.add(name="FeatureEntry")  # how protoc spells map<string, Feature>
    entry.options.map_entry = True
    entry.field.append(_field("key", 1, _F.TYPE_STRING))
    entry.field.append(_field("value", 2, _F.TYPE_MESSAGE, type_name=".tensorflow.Feature"))
    features.field.append(_field("feature", 1, _F.TYPE_MESSAGE, repeated=True,
                                 type_name=".tensorflow.Features.FeatureEntry"))
    file_proto.message_type.add(name="Example").field.append(
        _field("features", 1, _F.TYPE_MESSAGE, type_name=".tensorflow.Features"))
    return file_proto


_EXAMPLE_CLASSES = _build_messages(_example_file_proto())
Example = _EXAMPLE_CLASSES["Example"]
Features = _EXAMPLE_CLASSES["Features"]
Feature = _EXAMPLE_CLASSES["Feature"]
BytesList = _EXAMPLE_CLASSES["BytesList"]
FloatList = _EXAMPLE_CLASSES["FloatList"]
Int64List = _EXAMPLE_CLASSES["Int64List"]


# --------------------------------------------------------------------------------------------
# tf.train.Example <-> dict


def parse_example(serialized: bytes) -> dict[str, list[bytes] | np.ndarray]:
    """Decodes a serialized tf.train.Example into {key: value}, keys sorted.

    bytes_list -> list[bytes], float_list -> float32 array, int64_list -> int64 array; a Feature
    with no list set (TF's empty feature) -> []. Malformed bytes raise ValueError.
    """
    if not isinstance(serialized, bytes):
        if not isinstance(serialized, (bytearray, memoryview)):
            raise TypeError(f"parse_example: expected the bytes of one record, got "
                            f"{type(serialized).__name__}.")
        serialized = bytes(serialized)
    try:
        example = Example.FromString(serialized)
    except message.DecodeError as e:
        raise ValueError(
            f"parse_example: {len(serialized)} bytes starting {serialized[:16]!r} are not a "
            f"serialized tf.train.Example ({e}). Pass one record from read_records() of a file "
            f"of Examples.") from e
    parsed: dict[str, list[bytes] | np.ndarray] = {}
    feature_map = example.features.feature
    for key in sorted(feature_map):
        feature = feature_map[key]
        kind = feature.WhichOneof("kind")
        if kind == "bytes_list":
            parsed[key] = list(feature.bytes_list.value)
        elif kind == "float_list":
            parsed[key] = _unpack_floats(feature.float_list)
        elif kind == "int64_list":
            values = feature.int64_list.value
            parsed[key] = np.fromiter(values, dtype=np.int64, count=len(values))
        else:
            parsed[key] = []
    return parsed


# A FloatList on the wire is field 1 (length-delimited, tag 0x0a) holding little-endian float32s,
# so whole arrays go through as one buffer instead of a Python float per element (~50x faster).
_FLOAT_LIST_TAG = b"\x0a"


def _varint(value: int) -> bytes:
    out = bytearray()
    while value > 0x7F:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def _unpack_floats(float_list) -> np.ndarray:
    # Re-serializing always yields one packed run (the field is declared packed), even if the
    # writer used the unpacked encoding.
    raw = float_list.SerializeToString()
    if not raw:
        return np.empty(0, dtype=np.float32)
    start = 1
    while raw[start] & 0x80:
        start += 1
    return np.frombuffer(raw, dtype="<f4", offset=start + 1).astype(np.float32)  # owned, writable


FeatureValue = bytes | str | int | float | Sequence[Any] | np.ndarray | torch.Tensor


def encode_example(features: Mapping[str, FeatureValue]) -> bytes:
    """Serializes {key: value} as a tf.train.Example (map entries in key order, reproducibly).

    bytes and str (as utf-8) -> bytes_list; int and bool -> int64_list; float -> float_list;
    sequences, numpy arrays and tensors by element type/dtype, flattened. An empty list becomes an
    empty Feature (parse_example gives []); use an empty typed array for an empty typed list.
    """
    if not isinstance(features, Mapping):
        raise TypeError(f"encode_example: expected a mapping of feature name to value, got "
                        f"{type(features).__name__}.")
    example = Example()
    feature_map = example.features.feature
    for key, value in features.items():
        if not isinstance(key, str):
            raise TypeError(f"encode_example: feature names are str, got {key!r} "
                            f"({type(key).__name__}).")
        _fill_feature(key, value, feature_map[key])
    return example.SerializeToString(deterministic=True)


def _fill_feature(key: str, value: Any, feature) -> None:
    if isinstance(value, torch.Tensor):
        value = _tensor_to_numpy(key, value)
    if isinstance(value, (bytes, bytearray, memoryview)):
        feature.bytes_list.value.append(bytes(value))
    elif isinstance(value, str):
        feature.bytes_list.value.append(value.encode("utf-8"))
    elif isinstance(value, (bool, int, np.integer, np.bool_)):
        feature.int64_list.value.append(_int64(key, int(value)))
    elif isinstance(value, (float, np.floating)):
        feature.float_list.value.append(float(value))
    elif isinstance(value, np.ndarray):
        _fill_from_array(key, value, feature)
    elif isinstance(value, Sequence):
        _fill_from_sequence(key, value, feature)
    else:
        raise TypeError(
            f"encode_example: feature {key!r} has type {type(value).__name__}, which a "
            f"tf.train.Example cannot hold. Use bytes/str, int, float, or a list, numpy array or "
            f"tensor of them.")


def _tensor_to_numpy(key: str, tensor: torch.Tensor) -> np.ndarray:
    tensor = tensor.detach().cpu()
    if tensor.is_complex():
        raise TypeError(f"encode_example: feature {key!r} is a complex tensor; a "
                        f"tf.train.Example holds only bytes, int64 and float32 lists.")
    if tensor.is_floating_point() and tensor.dtype != torch.float64:
        tensor = tensor.to(torch.float32)  # bfloat16 has no numpy dtype
    return tensor.numpy()


def _int64(key: str, value: int) -> int:
    if not _INT64_MIN <= value <= _INT64_MAX:
        raise ValueError(f"encode_example: feature {key!r} holds {value}, which does not fit in "
                         f"int64. Store it as a float or as bytes (str(value)).")
    return value


def _fill_from_array(key: str, array: np.ndarray, feature) -> None:
    kind = array.dtype.kind
    flat = array.ravel()
    if kind in "biu":
        if kind == "u" and flat.size and array.dtype.itemsize == 8 and flat.max() > _INT64_MAX:
            raise ValueError(f"encode_example: feature {key!r} holds uint64 values above the "
                             f"int64 range. Store them as floats or bytes.")
        feature.int64_list.SetInParent()
        feature.int64_list.value.extend(flat.astype(np.int64).tolist())
    elif kind == "f":
        feature.float_list.SetInParent()
        payload = flat.astype("<f4").tobytes()
        if payload:
            feature.float_list.MergeFromString(_FLOAT_LIST_TAG + _varint(len(payload)) + payload)
    elif kind == "S":
        feature.bytes_list.SetInParent()
        feature.bytes_list.value.extend(flat.tolist())
    elif kind == "U":
        feature.bytes_list.SetInParent()
        feature.bytes_list.value.extend(s.encode("utf-8") for s in flat.tolist())
    elif kind == "O":
        _fill_from_sequence(key, flat.tolist(), feature)
    else:
        raise TypeError(f"encode_example: feature {key!r} is an array of dtype {array.dtype}; "
                        f"a tf.train.Example holds only bytes, int64 and float32 lists.")


def _fill_from_sequence(key: str, values: Sequence[Any], feature) -> None:
    if len(values) == 0:
        return  # an empty Feature: no element says which list it should be
    kinds = {_scalar_kind(v) for v in values}
    if kinds == {"bytes"}:
        feature.bytes_list.value.extend(
            v.encode("utf-8") if isinstance(v, str) else bytes(v) for v in values)
    elif kinds == {"int"}:
        feature.int64_list.value.extend(_int64(key, int(v)) for v in values)
    elif kinds <= {"int", "float"}:
        feature.float_list.value.extend(float(v) for v in values)
    elif None in kinds:
        bad = next(v for v in values if _scalar_kind(v) is None)
        hint = (" Flatten it (np.asarray(value).ravel()) and store the shape in another feature."
                if isinstance(bad, (Sequence, np.ndarray, torch.Tensor)) else "")
        raise TypeError(f"encode_example: feature {key!r} contains a {type(bad).__name__}; a "
                        f"feature is a flat list of bytes/str, ints or floats.{hint}")
    else:
        raise TypeError(f"encode_example: feature {key!r} mixes {' and '.join(sorted(kinds))} "
                        f"values; a feature is one flat list of bytes/str, ints or floats.")


def _scalar_kind(value: Any) -> str | None:
    if isinstance(value, (bytes, bytearray, memoryview, str)):
        return "bytes"
    if isinstance(value, (bool, int, np.integer, np.bool_)):
        return "int"
    if isinstance(value, (float, np.floating)):
        return "float"
    return None
