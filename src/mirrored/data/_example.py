"""tf.train.Example without TensorFlow: the protobuf messages and their dict form.

Example, Features, Feature, BytesList, FloatList and Int64List are built at import time from a
descriptor written here with TensorFlow's field numbers (by mirrored/_protobuf.py), so their bytes
are TF's exactly.
parse_example() and encode_example() turn a serialized Example into a dict of lists/arrays and back
(float lists pass as one packed buffer, not a Python float per element). tfrecord.py re-exports the
public names, which users import from there. Uses numpy, torch (tensors as feature values),
protobuf and _protobuf.py.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch
from google.protobuf import descriptor_pb2, message

from mirrored._protobuf import build_messages, message_field

_INT64_MIN, _INT64_MAX = -(1 << 63), (1 << 63) - 1
_F = descriptor_pb2.FieldDescriptorProto

def _example_file_proto() -> descriptor_pb2.FileDescriptorProto:
    """tensorflow/core/example/{feature,example}.proto in one file, with TF's field numbers."""
    file_proto = descriptor_pb2.FileDescriptorProto(
        name="mirrored/tensorflow_example.proto", package="tensorflow", syntax="proto3")
    file_proto.message_type.add(name="BytesList").field.append(
        message_field("value", 1, _F.TYPE_BYTES, repeated=True))
    file_proto.message_type.add(name="FloatList").field.append(
        message_field("value", 1, _F.TYPE_FLOAT, repeated=True, packed=True))
    file_proto.message_type.add(name="Int64List").field.append(
        message_field("value", 1, _F.TYPE_INT64, repeated=True, packed=True))
    feature = file_proto.message_type.add(name="Feature")
    feature.oneof_decl.add(name="kind")
    for number, (name, type_name) in enumerate(
            [("bytes_list", "BytesList"), ("float_list", "FloatList"),
             ("int64_list", "Int64List")], start=1):
        feature.field.append(message_field(name, number, _F.TYPE_MESSAGE,
                                           type_name=f".tensorflow.{type_name}", oneof_index=0))
    features = file_proto.message_type.add(name="Features")
    entry = features.nested_type.add(name="FeatureEntry")  # how protoc spells map<string, Feature>
    entry.options.map_entry = True
    entry.field.append(message_field("key", 1, _F.TYPE_STRING))
    entry.field.append(message_field("value", 2, _F.TYPE_MESSAGE, type_name=".tensorflow.Feature"))
    features.field.append(message_field("feature", 1, _F.TYPE_MESSAGE, repeated=True,
                                        type_name=".tensorflow.Features.FeatureEntry"))
    file_proto.message_type.add(name="Example").field.append(
        message_field("features", 1, _F.TYPE_MESSAGE, type_name=".tensorflow.Features"))
    return file_proto


_EXAMPLE_CLASSES = build_messages(_example_file_proto())
Example = _EXAMPLE_CLASSES["Example"]
Features = _EXAMPLE_CLASSES["Features"]
Feature = _EXAMPLE_CLASSES["Feature"]
BytesList = _EXAMPLE_CLASSES["BytesList"]
FloatList = _EXAMPLE_CLASSES["FloatList"]
Int64List = _EXAMPLE_CLASSES["Int64List"]
# The generated classes carry no docstring; these say what each message is (as tf.train's do).
Example.__doc__ = """tf.train.Example: one record's features, `Example(features=Features(...))`; its
SerializeToString() bytes are TensorFlow's. parse_example/encode_example convert it to and from a dict."""
Features.__doc__ = """tf.train.Features: a map from feature name to Feature, `Features(feature={"label": ...})`."""
Feature.__doc__ = """tf.train.Feature: one named value, exactly one of `bytes_list`, `float_list` or `int64_list`."""
BytesList.__doc__ = """tf.train.BytesList: a list of byte strings (`value=[b"..."]`), e.g. an encoded image."""
FloatList.__doc__ = """tf.train.FloatList: a list of float32 values (`value=[0.5, ...]`), stored packed."""
Int64List.__doc__ = """tf.train.Int64List: a list of int64 values (`value=[3, ...]`), e.g. a label, stored packed."""


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
    # Re-serializing always yields one packed run first (the field is declared packed), even if the
    # writer used the unpacked encoding. Fields this descriptor does not know (from a newer or
    # foreign writer) follow it and are ignored, as TF does: only the run's own length is read.
    raw = float_list.SerializeToString()
    if raw[:1] == _FLOAT_LIST_TAG:
        length, start = _read_varint(raw, 1)
        if length % 4 == 0 and start + length <= len(raw):
            return np.frombuffer(raw, dtype="<f4", count=length // 4,
                                 offset=start).astype(np.float32)  # owned, writable
    values = float_list.value  # no packed run first: the exact per-element path
    return np.fromiter(values, dtype=np.float32, count=len(values))


def _read_varint(raw: bytes, start: int) -> tuple[int, int]:
    """(value, offset after it) of the base-128 varint at raw[start]."""
    value = shift = 0
    while True:
        byte = raw[start]
        value |= (byte & 0x7F) << shift
        start += 1
        if not byte & 0x80:
            return value, start
        shift += 7


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
