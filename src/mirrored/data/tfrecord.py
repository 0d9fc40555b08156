"""TFRecord files, without TensorFlow.

read_records() iterates the records of one TFRecord file (checking both CRCs), TFRecordWriter and
write_records() write one atomically, each uncompressed or GZIP/ZLIB-compressed as TF's
compression_type says. The tf.train.Example messages and parse_example()/encode_example(), which
turn one into a dict of lists/arrays and back, live in _example.py and are re-exported here, the
place users import them from. Uses _example.py, crc32c and gzip/zlib.
"""
from __future__ import annotations

import dataclasses
import gzip
import io
import logging
import os
import struct
import uuid
import weakref
import zlib
from collections.abc import Iterable, Iterator
from typing import BinaryIO

import crc32c
from mirrored._files import fsync_directory
from mirrored.data._example import (BytesList, Example, Feature, Features, FloatList, Int64List,
                                    encode_example, parse_example)

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
# zlib's window bits for each compression_type, as TF's ZlibCompressionOptions: 31 = gzip wrapper.
_WBITS = {"GZIP": 31, "ZLIB": 15}
# How a compressed file starts: gzip's magic number, and the zlib headers of a 32 KiB window at each
# compression level (what TF and Python's zlib write). Checked only where the first record header
# fails, since an uncompressed file may start with the same bytes (a 35,615-byte first record).
_GZIP_MAGIC = b"\x1f\x8b"
_ZLIB_HEADERS = (b"\x78\x01", b"\x78\x5e", b"\x78\x9c", b"\x78\xda")
# What a damaged compressed stream raises (gzip.BadGzipFile for a bad header or CRC, EOFError for a
# truncated stream), as opposed to an I/O error of the disk.
_DECOMPRESS_ERRORS = (gzip.BadGzipFile, EOFError, zlib.error)


def _masked_crc(data: bytes) -> int:
    crc = crc32c.crc32c(data)
    return (((crc >> 15) | (crc << 17)) + _MASK_DELTA) & 0xFFFFFFFF


# --------------------------------------------------------------------------------------------
# Reading and writing records


class CorruptRecordError(ValueError):
    """A TFRecord file whose framing or CRCs do not check out; names the file and byte offset."""

    def __init__(self, path: str, offset: int, reason: str, compression_type: str = ""):
        self.path, self.offset, self.reason = path, offset, reason
        self.compression_type = compression_type  # "" or the stream `offset` counts bytes of
        where = f" of the decompressed {compression_type} stream" if compression_type else ""
        super().__init__(
            f"{path}: corrupt TFRecord at byte offset {offset}{where}: {reason}. Re-create the "
            f"file, or pass skip_corrupt=True to read_records() to skip what is damaged.")


@dataclasses.dataclass
class RecordStats:
    """Counts kept by read_records(stats=...); one object may be shared by several files."""

    records: int = 0  # records yielded
    skipped_records: int = 0  # a damaged tail of a file counts as one
    skipped_bytes: int = 0  # of a compressed file: the decompressed bytes read of what is damaged


def _compression_type(value: str | None, where: str) -> str:
    """TF's compression_type as "", "GZIP" or "ZLIB"; None means "" (uncompressed), as in TF."""
    if value is None or value == "":
        return ""
    if isinstance(value, str) and value.upper() in _WBITS:
        return value.upper()
    raise ValueError(f"{where}(compression_type={value!r}): use None or \"\" (uncompressed), "
                     f"\"GZIP\" or \"ZLIB\", as tf.data.TFRecordDataset and tf.io.TFRecordWriter "
                     f"take them.")


def read_records(path: str | os.PathLike, *, compression_type: str | None = None,
                 verify_crc: bool = True, skip_corrupt: bool = False,
                 stats: RecordStats | None = None) -> Iterator[bytes]:
    """Yields the records of one TFRecord file, like tf.data.TFRecordDataset.

    Args:
      compression_type: None or "" for an uncompressed file, "GZIP" or "ZLIB" for one written
        with that compression (TF's names). A compressed file is decompressed as it is read.
      verify_crc: check the length and data CRCs. Lengths are always checked against the bytes
        left in the file, so a forged length never allocates more than the file holds (in a
        compressed file, more than the stream holds).
      skip_corrupt: instead of raising CorruptRecordError, skip a record whose data CRC is wrong
        and stop at a damaged length field or a truncated tail, logging a warning each time.
      stats: counts of records read and skipped are added to it.
    """
    compression = _compression_type(compression_type, "read_records")
    stats = RecordStats() if stats is None else stats
    path = os.fspath(path)
    if compression:
        return _read_compressed(path, compression, verify_crc, skip_corrupt, stats)
    return _read_uncompressed(path, verify_crc, skip_corrupt, stats)


def _read_uncompressed(path: str, verify_crc: bool, skip_corrupt: bool,
                       stats: RecordStats) -> Iterator[bytes]:
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
                reason = _check_header(header, verify_crc, file_size - offset - _HEADER.size)
                if reason is not None:
                    if offset == 0:
                        _refuse_compressed(path, header)
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
                _corrupt(path, record_offset, _data_crc_reason(data, footer), skip_corrupt, stats,
                         skipped_bytes=length + _FRAMING_BYTES)
                continue
            stats.records += 1
            yield data


def _looks_compressed(start: bytes) -> str | None:
    """"GZIP" or "ZLIB" if a file starting with `start` looks like that stream, else None."""
    return "GZIP" if start[:2] == _GZIP_MAGIC else "ZLIB" if start[:2] in _ZLIB_HEADERS else None


def _refuse_compressed(path: str, header: bytes) -> None:
    """Raises if a file read as uncompressed starts like a GZIP or ZLIB stream: it is no damage, and
    skip_corrupt would silently yield nothing."""
    kind = _looks_compressed(header)
    if kind is not None:
        raise ValueError(
            f"{path}: starts with the bytes {header[:2].hex(' ')} of a {kind} stream, and read as "
            f"an uncompressed TFRecord file its first record header does not check out: it was "
            f"written with compression. Pass compression_type=\"{kind}\" to read_records() (as to "
            f"tf.data.TFRecordDataset).")


def _read_compressed(path: str, compression: str, verify_crc: bool, skip_corrupt: bool,
                     stats: RecordStats) -> Iterator[bytes]:
    """The records of a GZIP or ZLIB file: the same framing inside the decompressed stream, which is
    read in pieces, so memory stays bounded whatever a length field claims."""
    with open(path, "rb", buffering=_READ_BUFFER_BYTES) as raw, \
            _decompressed(raw, compression) as stream:
        read, offset = stream.read, 0
        while True:
            header = data = footer = b""
            try:
                header = read(_HEADER.size)
                if not header:
                    return
                reason = _check_header(header, verify_crc, None, "decompressed stream")
                if reason is None:
                    length = _HEADER.unpack(header)[0]
                    data = _read_up_to(read, length)
                    footer = read(_CRC.size)
                    if len(data) != length or len(footer) != _CRC.size:
                        reason = "the decompressed stream ends inside the record"
            except _DECOMPRESS_ERRORS as e:
                if offset == 0 and not header:
                    _refuse_mismatched(path, compression, e)
                reason = f"the {compression} stream is damaged or truncated ({e})"
            if reason is not None:
                _corrupt(path, offset, reason, skip_corrupt, stats, compression_type=compression,
                         skipped_bytes=len(header) + len(data) + len(footer))
                return
            record_offset = offset
            offset += length + _FRAMING_BYTES
            if verify_crc and _CRC.unpack(footer)[0] != _masked_crc(data):
                _corrupt(path, record_offset, _data_crc_reason(data, footer), skip_corrupt, stats,
                         compression_type=compression, skipped_bytes=length + _FRAMING_BYTES)
                continue
            stats.records += 1
            yield data


def _refuse_mismatched(path: str, compression: str, error: Exception) -> None:
    """Raises where a file that does not start like a `compression` stream was read as one (the
    wrong compression_type, not damage)."""
    with open(path, "rb") as f:
        start = f.read(2)
    kind = _looks_compressed(start)
    if kind == compression:
        return
    hint = (f"it starts like a {kind} stream: pass compression_type=\"{kind}\"" if kind else
            "if it is uncompressed, pass compression_type=None")
    raise ValueError(f"{path}: cannot be read with compression_type=\"{compression}\" ({error}); "
                     f"{hint}.") from error


def _decompressed(raw: BinaryIO, compression: str) -> BinaryIO:
    """A reader of the decompressed bytes of `raw`. GzipFile also reads concatenated gzip members
    (`cat a.gz b.gz`); the stdlib has no streaming reader of a bare zlib stream: _ZlibReader."""
    if compression == "GZIP":
        return gzip.GzipFile(fileobj=raw, mode="rb")
    return io.BufferedReader(_ZlibReader(raw), _READ_BUFFER_BYTES)


class _ZlibReader(io.RawIOBase):
    """The decompressed bytes of a ZLIB stream (RFC 1950), in pieces the size of the caller's
    buffer at most."""

    def __init__(self, raw: BinaryIO):
        super().__init__()
        self._raw = raw
        self._inflater = zlib.decompressobj(_WBITS["ZLIB"])
        self._empty = True  # an empty file holds no records, as in TF (and as GzipFile reads it)

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        inflater = self._inflater
        while not inflater.eof:
            chunk = inflater.unconsumed_tail or self._raw.read(_READ_BUFFER_BYTES)
            if not chunk:
                if self._empty:
                    return 0
                raise EOFError("the ZLIB stream ends before its end-of-stream marker")
            self._empty = False
            out = inflater.decompress(chunk, len(buffer))
            if out:
                buffer[:len(out)] = out
                return len(out)
        return 0  # bytes after the stream's end are ignored


def _read_up_to(read, n: int) -> bytes:
    """n bytes, or fewer where the stream ends, read in pieces: a forged length costs only what is
    really there."""
    if n <= _READ_BUFFER_BYTES:
        return read(n)
    parts = []
    while n > 0:
        part = read(min(n, _READ_BUFFER_BYTES))
        if not part:
            break
        parts.append(part)
        n -= len(part)
    return b"".join(parts)


def _data_crc_reason(data: bytes, footer: bytes) -> str:
    return (f"data CRC mismatch in a record of {len(data)} bytes (stored "
            f"0x{_CRC.unpack(footer)[0]:08x}, computed 0x{_masked_crc(data):08x})")


def _check_header(header: bytes, verify_crc: bool, left: int | None,
                  container: str = "file") -> str | None:
    """Why `header` cannot start a record, or None if it can; `left` is how many bytes follow it
    (None where unknown: a compressed stream)."""
    if len(header) < _HEADER.size:
        return (f"the {container} ends {len(header)} bytes into a record header of "
                f"{_HEADER.size} bytes")
    length, stored = _HEADER.unpack(header)
    if verify_crc:
        computed = _masked_crc(header[:8])
        if stored != computed:
            return (f"length CRC mismatch (stored 0x{stored:08x}, computed 0x{computed:08x}; "
                    f"length field reads {length})")
    if left is not None and length + _CRC.size > left:
        return (f"the record claims {length} data bytes but only {max(left - _CRC.size, 0)} are "
                f"left in the file (truncated file)")
    return None


def _corrupt(path: str, offset: int, reason: str, skip: bool, stats: RecordStats, *,
             skipped_bytes: int, compression_type: str = "") -> None:
    error = CorruptRecordError(path, offset, reason, compression_type)
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
    compression_type "GZIP" or "ZLIB" compresses the file as TF's writer does (zlib's default
    level, a gzip header without name or time), so TF and read_records read it with that type.
    """

    def __init__(self, path: str | os.PathLike, *, compression_type: str | None = None):
        self.path = os.fspath(path)
        self.compression_type = _compression_type(compression_type, "TFRecordWriter")
        self._compressor = (zlib.compressobj(wbits=_WBITS[self.compression_type])
                            if self.compression_type else None)
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
        framed = (length + _CRC.pack(_masked_crc(length)), record, _CRC.pack(_masked_crc(record)))
        if self._compressor is not None:
            framed = tuple(self._compressor.compress(part) for part in framed)
        for part in framed:
            self._file.write(part)
        self.records_written += 1

    def flush(self) -> None:
        """Pushes what was written into the temporary file (a compressed stream is sync-flushed, so
        it decodes up to here); `path` changes only at close()."""
        if self._file is not None:
            if self._compressor is not None:
                self._file.write(self._compressor.flush(zlib.Z_SYNC_FLUSH))
            self._file.flush()

    def close(self) -> None:
        """Makes the file durable and puts it at `path`; a second call does nothing."""
        if self._file is None:
            return
        file, self._file = self._file, None
        self._finalizer.detach()
        try:
            if self._compressor is not None:
                file.write(self._compressor.flush())  # the stream's end (and gzip's CRC and size)
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
        compression = (f", compression_type={self.compression_type!r}"
                       if self.compression_type else "")
        return (f"TFRecordWriter({self.path!r}{compression}, "
                f"records_written={self.records_written}, {state})")


def _discard(file: BinaryIO, tmp_path: str) -> None:
    try:
        file.close()
    finally:
        try:
            os.unlink(tmp_path)
        except FileNotFoundError:
            pass


def write_records(path: str | os.PathLike, records: Iterable[bytes], *,
                  compression_type: str | None = None) -> int:
    """Writes `records` to a new TFRecord file at `path` atomically (compressed if
    compression_type is "GZIP" or "ZLIB"); returns how many."""
    with TFRecordWriter(path, compression_type=compression_type) as writer:
        for record in records:
            writer.write(record)
    return writer.records_written
