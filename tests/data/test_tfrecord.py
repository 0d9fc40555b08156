"""tfrecord.py against independent references: the bytes TFDS wrote, hand-encoded protobuf."""
from __future__ import annotations

import json
import logging
import os
import shutil
import struct
import tempfile
import tracemalloc
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


def test_build_messages_is_reusable():
    from google.protobuf import descriptor_pb2
    F = descriptor_pb2.FieldDescriptorProto
    file_proto = descriptor_pb2.FileDescriptorProto(name="test/event.proto", package="probe",
                                                    syntax="proto3")
    event = file_proto.message_type.add(name="Event")
    event.field.append(tfrecord._field("wall_time", 1, F.TYPE_DOUBLE))
    event.field.append(tfrecord._field("tags", 2, F.TYPE_STRING, repeated=True))
    classes = tfrecord._build_messages(file_proto)
    message = classes["Event"](wall_time=1.5, tags=["a"])
    assert classes["Event"].FromString(message.SerializeToString()) == message
    assert tfrecord.Example.DESCRIPTOR.full_name == "tensorflow.Example"
