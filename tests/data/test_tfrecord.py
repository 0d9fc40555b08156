"""tfrecord.py against independent references: the bytes TFDS wrote, hand-encoded protobuf."""
from __future__ import annotations

import gzip
import json
import logging
import os
import shutil
import struct
import tempfile
import tracemalloc
import zlib
from pathlib import Path

import crc32c
import numpy as np
import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from mirrored.data import tfrecord
from mirrored.data.tfrecord import (CorruptRecordError, RecordStats, TFRecordWriter,
                                    encode_example, parse_example, read_records, write_records)

SPLITS = {"train": 20, "test": 10, "validation": 10}


def cassava_file(fixtures_dir: Path, split: str) -> Path:
    return fixtures_dir / "tfds" / "cassava" / "0.1.0" / f"cassava-{split}.tfrecord-00000-of-00001"


def record_offsets(path: Path) -> list[tuple[int, int]]:
    """(offset, data length) of each record, read with struct alone (reference framing)."""
    raw, out, offset = path.read_bytes(), [], 0
    while offset < len(raw):
        (length,) = struct.unpack_from("<Q", raw, offset)
        out.append((offset, length))
        offset += 8 + 4 + length + 4
    return out


def copy_fixture(fixtures_dir: Path, tmp_path: Path, split: str = "train") -> Path:
    target = tmp_path / cassava_file(fixtures_dir, split).name
    shutil.copyfile(cassava_file(fixtures_dir, split), target)
    target.chmod(0o644)
    return target


# ---------------------------------------------------------------------------------------------
# Records


@settings(max_examples=60, deadline=None)
@given(st.lists(st.binary(max_size=300), max_size=20))
@example([b""])
@example([b"", b"", b"x"])
def test_write_read_round_trip(records):
    with tempfile.TemporaryDirectory() as directory:
        path = Path(directory) / "data.tfrecord"
        assert write_records(path, records) == len(records)
        stats = RecordStats()
        assert list(read_records(path, stats=stats)) == records
        assert stats == RecordStats(records=len(records))
        assert os.listdir(directory) == ["data.tfrecord"]  # no temp file left behind


def test_reads_tfds_fixture_and_examples_match_expected(fixtures_dir):
    expected = json.loads((fixtures_dir / "tfds" / "cassava_expected.json").read_text())
    for split, count in SPLITS.items():
        records = list(read_records(cassava_file(fixtures_dir, split)))
        assert len(records) == count
        rows = expected["splits"][split]
        assert len(rows) == count
        for record, row in zip(records, rows):
            features = parse_example(record)
            assert sorted(features) == ["image", "image/filename", "label"]
            assert features["image/filename"] == [row["file"].encode()]
            assert features["label"].dtype == np.int64
            assert features["label"].tolist() == [row["label"]]
            assert features["image"][0][:3] == b"\xff\xd8\xff"  # a JPEG


def test_writer_reproduces_tfds_file_bytes(fixtures_dir, tmp_path):
    # The fixture was written by TensorFlow: equal bytes mean equal framing and masked CRCs.
    source = cassava_file(fixtures_dir, "train")
    target = tmp_path / "rewritten.tfrecord"
    write_records(target, read_records(source))
    assert target.read_bytes() == source.read_bytes()


def test_masked_crc_matches_known_crc32c_value():
    # CRC-32C("123456789") = 0xE3069283 (the standard check value); the mask is TF's formula.
    crc = 0xE3069283
    assert crc32c.crc32c(b"123456789") == crc
    masked = (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF
    assert tfrecord._masked_crc(b"123456789") == masked


def test_flipped_data_byte_names_file_and_offset(fixtures_dir, tmp_path):
    path = copy_fixture(fixtures_dir, tmp_path)
    offset, length = record_offsets(path)[3]
    raw = bytearray(path.read_bytes())
    raw[offset + 12 + length // 2] ^= 0x40
    path.write_bytes(bytes(raw))
    got = []
    with pytest.raises(CorruptRecordError) as info:
        for record in read_records(path):
            got.append(record)
    assert len(got) == 3
    message = str(info.value)
    assert str(path) in message and f"byte offset {offset}" in message
    assert "data CRC mismatch" in message
    assert info.value.offset == offset and isinstance(info.value, ValueError)
    # Without CRC checks the damaged record comes through as stored.
    assert len(list(read_records(path, verify_crc=False))) == 20


def test_truncated_file_raises(fixtures_dir, tmp_path):
    path = copy_fixture(fixtures_dir, tmp_path)
    offset, length = record_offsets(path)[-1]
    full = path.read_bytes()
    for cut, words in [(offset + 12 + length // 2, "truncated"), (offset + 5, "record header")]:
        path.write_bytes(full[:cut])
        with pytest.raises(CorruptRecordError, match=words) as info:
            list(read_records(path))
        assert info.value.offset == offset and str(path) in str(info.value)


def test_skip_corrupt_counts_what_was_skipped(fixtures_dir, tmp_path, caplog):
    path = copy_fixture(fixtures_dir, tmp_path)
    offsets = record_offsets(path)
    raw = bytearray(path.read_bytes())
    bad_offset, bad_length = offsets[3]
    raw[bad_offset + 12] ^= 0x01
    last_offset, last_length = offsets[-1]
    del raw[last_offset + 12 + last_length // 2:]
    path.write_bytes(bytes(raw))
    stats = RecordStats()
    with caplog.at_level(logging.WARNING, logger="mirrored.data.tfrecord"):
        records = list(read_records(path, skip_corrupt=True, stats=stats))
    assert len(records) == 18
    assert stats.records == 18 and stats.skipped_records == 2
    assert stats.skipped_bytes == (bad_length + 16) + (len(raw) - last_offset)
    assert len([r for r in caplog.records if r.levelno == logging.WARNING]) == 2
    assert f"byte offset {bad_offset}" in caplog.text


def test_forged_huge_length_is_rejected_without_allocating(tmp_path):
    path = tmp_path / "forged.tfrecord"
    write_records(path, [b"ok"])
    length = struct.pack("<Q", 1 << 62)
    forged = length + struct.pack("<I", tfrecord._masked_crc(length))  # a valid length CRC
    with open(path, "ab") as f:
        f.write(forged + b"\x00" * 64)
    for verify_crc in (True, False):
        tracemalloc.start()
        try:
            with pytest.raises(CorruptRecordError, match="claims 4611686018427387904 data bytes"):
                list(read_records(path, verify_crc=verify_crc))
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        assert peak < 16 << 20
    # A length with a wrong CRC is caught before its value is used.
    raw = bytearray(path.read_bytes())
    raw[18 + 8] ^= 0xFF
    path.write_bytes(bytes(raw))
    with pytest.raises(CorruptRecordError, match="length CRC mismatch"):
        list(read_records(path))


def test_empty_file_has_no_records(tmp_path):
    path = tmp_path / "empty.tfrecord"
    path.write_bytes(b"")
    assert list(read_records(path)) == []


def test_writer_is_atomic(tmp_path):
    path = tmp_path / "out.tfrecord"
    with pytest.raises(RuntimeError, match="boom"):
        with TFRecordWriter(path) as writer:
            writer.write(b"partial")
            raise RuntimeError("boom")
    assert os.listdir(tmp_path) == []

    write_records(path, [b"old"])
    with pytest.raises(RuntimeError):
        with TFRecordWriter(path) as writer:
            writer.write(b"new")
            assert list(read_records(path)) == [b"old"]  # nothing visible before close
            raise RuntimeError("boom")
    assert list(read_records(path)) == [b"old"]
    assert os.listdir(tmp_path) == ["out.tfrecord"]


def test_writer_misuse(tmp_path):
    writer = TFRecordWriter(tmp_path / "a.tfrecord")
    with pytest.raises(TypeError, match="encode_example"):
        writer.write("text")
    writer.write(bytearray(b"ab"))
    writer.write(memoryview(b"cd"))
    writer.close()
    writer.close()
    with pytest.raises(ValueError, match="closed"):
        writer.write(b"x")
    assert list(read_records(tmp_path / "a.tfrecord")) == [b"ab", b"cd"]
    dropped = TFRecordWriter(tmp_path / "b.tfrecord")
    dropped.write(b"x")
    del dropped  # never closed: nothing is committed and the temp file goes away
    assert os.listdir(tmp_path) == ["a.tfrecord"]


# ---------------------------------------------------------------------------------------------
# Compressed files (compression_type "GZIP" / "ZLIB")
#
# The references are Python's gzip/zlib and framing built with struct and crc32c here. Checked by
# hand against TensorFlow 2.21: tf.io.TFRecordWriter(path, options="GZIP" / "ZLIB") writes the same
# bytes as write_records(..., compression_type=...) for the same records, and read_records reads
# TF's files; on a stream cut short both yield the same records, then fail at the same offset.

COMPRESS = {"GZIP": gzip.compress, "ZLIB": zlib.compress}
DECOMPRESS = {"GZIP": gzip.decompress, "ZLIB": zlib.decompress}


def masked_crc(data: bytes) -> int:
    crc = crc32c.crc32c(data)
    return (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF


def framed(records: list[bytes]) -> bytes:
    """The uncompressed TFRecord bytes of `records`: reference framing, not tfrecord.py's."""
    out = b""
    for record in records:
        length = struct.pack("<Q", len(record))
        out += length + struct.pack("<I", masked_crc(length))
        out += record + struct.pack("<I", masked_crc(record))
    return out


RECORDS = [b"", b"one", bytes(range(256)) * 40, b"last"]


@pytest.mark.parametrize("compression", ["GZIP", "ZLIB"])
def test_compressed_files_are_read_and_written(compression, tmp_path):
    path = tmp_path / "data.tfrecord"
    path.write_bytes(COMPRESS[compression](framed(RECORDS)))
    assert list(read_records(path, compression_type=compression)) == RECORDS
    assert list(read_records(path, compression_type=compression.lower())) == RECORDS

    written = tmp_path / "written.tfrecord"
    assert write_records(written, RECORDS, compression_type=compression) == len(RECORDS)
    assert DECOMPRESS[compression](written.read_bytes()) == framed(RECORDS)
    assert list(read_records(written, compression_type=compression)) == RECORDS
    assert sorted(os.listdir(tmp_path)) == ["data.tfrecord", "written.tfrecord"]

    with TFRecordWriter(tmp_path / "flushed.tfrecord", compression_type=compression) as writer:
        writer.write(b"a")
        writer.flush()
        writer.write(b"b")
        assert repr(writer).startswith(f"TFRecordWriter({str(tmp_path / 'flushed.tfrecord')!r}, "
                                       f"compression_type={compression!r}, records_written=2")
    flushed = read_records(tmp_path / "flushed.tfrecord", compression_type=compression)
    assert list(flushed) == [b"a", b"b"]

    (tmp_path / "empty").write_bytes(b"")  # TF reads an empty file as no records, compressed or not
    assert list(read_records(tmp_path / "empty", compression_type=compression)) == []
    (tmp_path / "no_records").write_bytes(COMPRESS[compression](b""))
    assert list(read_records(tmp_path / "no_records", compression_type=compression)) == []


def test_concatenated_gzip_members_are_one_stream(tmp_path):
    path = tmp_path / "cat.tfrecord.gz"
    path.write_bytes(gzip.compress(framed(RECORDS[:2])) + gzip.compress(framed(RECORDS[2:])))
    assert list(read_records(path, compression_type="GZIP")) == RECORDS


@pytest.mark.parametrize("compression, start", [("GZIP", "1f 8b"), ("ZLIB", "78 9c")])
def test_compressed_file_read_as_uncompressed_says_which_compression(compression, start, tmp_path):
    """Regression (review): a GZIP/ZLIB file was reported as a length CRC mismatch at offset 0,
    advising skip_corrupt=True, which then yielded no records."""
    path = tmp_path / "data.tfrecord"
    path.write_bytes(COMPRESS[compression](framed(RECORDS)))
    for skip_corrupt in (False, True):
        with pytest.raises(ValueError) as info:
            list(read_records(path, skip_corrupt=skip_corrupt))
        message = str(info.value)
        assert not isinstance(info.value, CorruptRecordError)
        assert str(path) in message and start in message
        assert f'compression_type="{compression}"' in message and "skip_corrupt" not in message


def test_wrong_compression_type_names_the_right_one(tmp_path):
    gz, plain = tmp_path / "a.gz", tmp_path / "plain.tfrecord"
    gz.write_bytes(gzip.compress(framed(RECORDS)))
    plain.write_bytes(framed(RECORDS))
    with pytest.raises(ValueError, match='compression_type="ZLIB".*starts like a GZIP stream: pass '
                                         'compression_type="GZIP"'):
        list(read_records(gz, compression_type="ZLIB"))
    for compression in ("GZIP", "ZLIB"):
        with pytest.raises(ValueError, match="if it is uncompressed, pass compression_type=None"):
            list(read_records(plain, compression_type=compression))
    for bad in ("gz", "BZIP2", 1):
        with pytest.raises(ValueError,
                           match=rf"read_records\(compression_type={bad!r}\): use None"):
            read_records(plain, compression_type=bad)
        with pytest.raises(ValueError, match=rf"TFRecordWriter\(compression_type={bad!r}\)"):
            TFRecordWriter(tmp_path / "x", compression_type=bad)
    assert list(read_records(plain, compression_type="")) == RECORDS
    assert sorted(os.listdir(tmp_path)) == ["a.gz", "plain.tfrecord"]


@pytest.mark.parametrize("compression", ["GZIP", "ZLIB"])
def test_damaged_compressed_stream_names_the_decompressed_offset(compression, tmp_path, caplog):
    path = tmp_path / "data.tfrecord"
    stream = bytearray(framed(RECORDS))
    bad_offset = len(framed(RECORDS[:2]))  # record 2, flipped inside its data
    stream[bad_offset + 12 + 5] ^= 0x10
    path.write_bytes(COMPRESS[compression](bytes(stream)))
    with pytest.raises(CorruptRecordError) as info:
        list(read_records(path, compression_type=compression))
    assert info.value.offset == bad_offset and info.value.compression_type == compression
    assert f"byte offset {bad_offset} of the decompressed {compression} stream" in str(info.value)
    stats = RecordStats()
    assert list(read_records(path, compression_type=compression, skip_corrupt=True,
                             stats=stats)) == RECORDS[:2] + RECORDS[3:]
    assert stats == RecordStats(records=3, skipped_records=1, skipped_bytes=len(RECORDS[2]) + 16)

    # A stream cut short: the records before the cut, then an error at the decompressed offset
    # where the next record should start, as TF's "truncated record at <offset>".
    whole = COMPRESS[compression](framed(RECORDS))
    path.write_bytes(whole[:len(whole) - 12])
    got = []
    with pytest.raises(CorruptRecordError, match=f"decompressed {compression} stream") as info:
        for record in read_records(path, compression_type=compression):
            got.append(record)
    assert got == RECORDS[:len(got)] and info.value.offset == len(framed(got))
    with caplog.at_level(logging.WARNING, logger="mirrored.data.tfrecord"):
        assert list(read_records(path, compression_type=compression, skip_corrupt=True)) == got


@pytest.mark.parametrize("compression", ["GZIP", "ZLIB"])
def test_compressed_reading_memory_is_bounded(compression, tmp_path):
    # 64 MiB of records (zeros compress ~1000x) and then a forged length of 2**62 with verify_crc
    # off: neither the stream nor the length may be held or allocated at once.
    record = bytes(1 << 20)
    length = struct.pack("<Q", 1 << 62)
    forged = length + struct.pack("<I", masked_crc(length)) + b"\x00" * 64
    compressor = zlib.compressobj(wbits=31 if compression == "GZIP" else 15)
    with open(tmp_path / "big", "wb") as f:
        for _ in range(64):
            f.write(compressor.compress(framed([record])))
        f.write(compressor.compress(forged) + compressor.flush())
    tracemalloc.start()
    try:
        count = 0
        with pytest.raises(CorruptRecordError, match="ends inside the record"):
            for got in read_records(tmp_path / "big", compression_type=compression,
                                    verify_crc=False):
                count += len(got) == len(record)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert count == 64 and peak < 16 << 20


# ---------------------------------------------------------------------------------------------
# tf.train.Example


def varint(value: int) -> bytes:
    value &= (1 << 64) - 1  # negative int64s are 10-byte varints of their two's complement
    out = bytearray()
    while True:
        byte, value = value & 0x7F, value >> 7
        out.append(byte | (0x80 if value else 0))
        if not value:
            return bytes(out)


def length_delimited(field: int, payload: bytes) -> bytes:
    return varint(field << 3 | 2) + varint(len(payload)) + payload


def test_one_int64_feature_matches_hand_encoded_protobuf():
    assert encode_example({"label": 3}).hex() == "0a100a0e0a056c6162656c12051a030a0103"
    for value in [3, -1, 2**63 - 1, 300]:
        int64_list = length_delimited(1, varint(value))  # packed: one length-delimited run
        feature = length_delimited(3, int64_list)  # Feature.int64_list = 3
        entry = length_delimited(1, b"label") + length_delimited(2, feature)  # map key, value
        features = length_delimited(1, entry)  # Features.feature = 1
        expected = length_delimited(1, features)  # Example.features = 1
        assert encode_example({"label": value}) == expected
        assert parse_example(expected)["label"].tolist() == [value]


def test_float_and_bytes_features_match_hand_encoded_protobuf():
    floats = np.array([1.5, -2.25], dtype=np.float32)
    float_list = length_delimited(1, floats.astype("<f4").tobytes())
    feature = length_delimited(2, float_list)
    entry = length_delimited(1, b"x") + length_delimited(2, feature)
    assert encode_example({"x": floats}) == length_delimited(1, length_delimited(1, entry))
    bytes_list = length_delimited(1, b"ab") + length_delimited(1, b"")
    feature = length_delimited(1, bytes_list)
    entry = length_delimited(1, b"b") + length_delimited(2, feature)
    assert encode_example({"b": [b"ab", b""]}) == length_delimited(1, length_delimited(1, entry))


def test_unpacked_floats_parse_too():
    # Parsers must accept the unpacked encoding (one tagged fixed32 per value).
    values = [1.0, -0.5]
    float_list = b"".join(b"\x0d" + struct.pack("<f", v) for v in values)
    entry = length_delimited(1, b"f") + length_delimited(2, length_delimited(2, float_list))
    parsed = parse_example(length_delimited(1, length_delimited(1, entry)))
    assert parsed["f"].tolist() == values and parsed["f"].flags.writeable


def test_unknown_fields_in_lists_are_ignored_as_tf_does():
    """Regression (review): a FloatList carrying a field this descriptor does not know decoded to
    garbage floats or a numpy buffer-size error. TF 2.21's parse_single_example gives [1.5, 2.5]
    and [7, 300] for the first and the Int64List case (measured)."""
    floats = length_delimited(1, struct.pack("<2f", 1.5, 2.5))

    def example_of(kind: int, payload: bytes) -> bytes:
        entry = length_delimited(1, b"x") + length_delimited(2, length_delimited(kind, payload))
        return length_delimited(1, length_delimited(1, entry))

    for unknown in (b"\x10\x01", b"\x10\x80\x80\x01", length_delimited(3, b"abcdefg"),
                    b"\x1d" + struct.pack("<f", 9.0)):  # varints, bytes, a fixed32 of field 3
        parsed = parse_example(example_of(2, floats + unknown))["x"]
        assert parsed.dtype == np.float32 and parsed.tolist() == [1.5, 2.5]
        assert parse_example(example_of(2, unknown + floats))["x"].tolist() == [1.5, 2.5]
        assert parse_example(example_of(2, unknown))["x"].tolist() == []  # protobuf's reading
        ints = length_delimited(1, varint(7) + varint(300)) + unknown
        assert parse_example(example_of(3, ints))["x"].tolist() == [7, 300]
        strings = length_delimited(1, b"ab") + unknown + length_delimited(1, b"")
        assert parse_example(example_of(1, strings))["x"] == [b"ab", b""]


def test_example_round_trip():
    features = {
        "text": "héllo wörld ✓",
        "raw": b"\x00\xff",
        "bytes_list": [b"a", "b", b""],
        "int": -(2**63),
        "ints": [1, -2, 2**63 - 1],
        "bool": True,
        "float": 0.1,
        "floats": np.array([[0.5, -1e30], [3.25, np.inf]], dtype=np.float64),
        "tensor_ints": torch.tensor([[1, 2], [3, 4]], dtype=torch.int32),
        "tensor_half": torch.tensor([0.5, 2.0], dtype=torch.bfloat16),
        "mixed_numbers": [1, 2.5],
        "empty": [],
        "empty_int64": np.zeros(0, dtype=np.int64),
        "strings": np.array(["x", "ÿ"]),
    }
    parsed = parse_example(encode_example(features))
    assert list(parsed) == sorted(features)
    assert parsed["text"] == ["héllo wörld ✓".encode()]
    assert parsed["raw"] == [b"\x00\xff"]
    assert parsed["bytes_list"] == [b"a", b"b", b""]
    assert parsed["int"].dtype == np.int64 and parsed["int"].tolist() == [-(2**63)]
    assert parsed["ints"].tolist() == [1, -2, 2**63 - 1]
    assert parsed["bool"].tolist() == [1]
    assert parsed["float"].dtype == np.float32 and parsed["float"][0] == np.float32(0.1)
    np.testing.assert_array_equal(parsed["floats"],
                                  features["floats"].astype(np.float32).ravel())
    assert parsed["tensor_ints"].tolist() == [1, 2, 3, 4]
    assert parsed["tensor_half"].tolist() == [0.5, 2.0]
    assert parsed["mixed_numbers"].dtype == np.float32
    assert parsed["empty"] == []
    assert parsed["empty_int64"].dtype == np.int64 and parsed["empty_int64"].size == 0
    assert parsed["strings"] == [b"x", "ÿ".encode()]


def test_parse_of_reencoded_fixture_is_stable(fixtures_dir):
    record = next(read_records(cassava_file(fixtures_dir, "test")))
    parsed = parse_example(record)
    again = parse_example(encode_example(parsed))
    assert again["image"] == parsed["image"]
    assert again["image/filename"] == parsed["image/filename"]
    assert again["label"].tolist() == parsed["label"].tolist()


def test_malformed_protobuf_raises_value_error():
    with pytest.raises(ValueError, match="not a serialized tf.train.Example"):
        parse_example(b"\xff\xff\xff\xff")
    with pytest.raises(TypeError, match="bytes of one record"):
        parse_example("text")


def test_unsupported_feature_values():
    for value, error, words in [
        ({1, 2}, TypeError, "'bad' has type set"),
        (object(), TypeError, "'bad' has type object"),
        ([1, "a"], TypeError, "'bad' mixes"),
        ([[1, 2]], TypeError, "Flatten it"),
        (np.array([1 + 2j]), TypeError, "dtype complex128"),
        (torch.tensor([1 + 2j]), TypeError, "complex tensor"),
        (2**63, ValueError, "does not fit in int64"),
        (np.array([2**64 - 1], dtype=np.uint64), ValueError, "uint64"),
    ]:
        with pytest.raises(error, match=words):
            encode_example({"bad": value})
    with pytest.raises(TypeError, match="feature names are str"):
        encode_example({1: b"x"})
