"""Datasets prepared by TensorFlow Datasets (TFDS): read and written without TensorFlow.

A prepared directory `<data_dir>/<name>/<version>/` holds dataset_info.json (splits and their shard
lengths), features.json (the type of each feature), `<feature>.labels.txt` (class names) and TFRecord
shards `<name>-<split>.tfrecord-00000-of-00004` of tf.train.Example records. `PreparedDataset(dir)`
reads one: `.info` (DatasetInfo: features, splits, supervised_keys) and `.as_dataset(split)`, a
Dataset of feature dicts whose images are decoded in a parallel map. `write_split` and `write_info`
write the same layout, so TFDS reads what we prepare. The feature types (Image, ClassLabel, Text) live
in _tfds_features.py and the splits and split specs (SplitInfo, parse_split: "train[:80%]+test") in
_tfds_splits.py; both are re-exported here, where users import them. Uses dataset.py, tfrecord.py,
_tfds_features.py and _tfds_splits.py.
"""
from __future__ import annotations

import collections
import dataclasses
import hashlib
import itertools
import json
import os
import re
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch

from mirrored._files import config_of
from mirrored.data import _pipeline, _sources
from mirrored.data._tfds_features import _TFDS, ClassLabel, Feature, FeaturesDict, Image, Text, _feature_from_json
from mirrored.data._tfds_splits import (DEFAULT_FILEPATH_TEMPLATE, FileInstruction, SplitDict, SplitInfo, _shard_takes,
                                        parse_split, split_ranges)
from mirrored.data.dataset import AUTOTUNE, Dataset
from mirrored.data.tfrecord import TFRecordWriter, parse_example, read_records

__all__ = [
    "ClassLabel", "DatasetInfo", "FeaturesDict", "FileInstruction", "Image", "PreparedDataset",
    "ReadConfig", "SplitDict", "SplitInfo", "Text", "default_data_dir", "find_version_dir",
    "parse_split", "shard_boundaries", "shard_count", "split_ranges", "write_info", "write_split",
]

_VERSION_RE = re.compile(r"^\d+\.\d+\.\d+$")
# TFDS' shard sizing: 64 MiB .. 1 GiB per shard, each record costing 16 bytes of framing on disk.
_MIN_SHARD_BYTES, _MAX_SHARD_BYTES, _RECORD_OVERHEAD = 64 << 20, 1 << 30, 16


def default_data_dir() -> str:
    """Where TFDS keeps prepared data: $TFDS_DATA_DIR, else ~/tensorflow_datasets."""
    return os.environ.get("TFDS_DATA_DIR") or os.path.join(os.path.expanduser("~"), "tensorflow_datasets")


def find_version_dir(dataset_dir: str | os.PathLike, version: str | None = None) -> str | None:
    """The prepared version directory under `dataset_dir` (`version`, else the newest one holding a
    dataset_info.json), or None. Half-written directories (dot-names) never count."""
    dataset_dir = os.fspath(dataset_dir)
    if version is not None:
        path = os.path.join(dataset_dir, version)
        return path if os.path.isfile(os.path.join(path, "dataset_info.json")) else None
    try:
        names = os.listdir(dataset_dir)
    except OSError:
        return None
    versions = [n for n in names if _VERSION_RE.match(n)
                and os.path.isfile(os.path.join(dataset_dir, n, "dataset_info.json"))]
    if not versions:
        return None
    return os.path.join(dataset_dir, max(versions, key=lambda v: tuple(map(int, v.split(".")))))


# ------------------------------------------------------------------------------------ info


@dataclasses.dataclass
class DatasetInfo:
    """What a dataset holds (tfds.core.DatasetInfo): features, splits, supervised keys, metadata."""

    name: str
    version: str
    features: FeaturesDict
    splits: SplitDict
    supervised_keys: tuple[str, str] | None = None
    description: str = ""
    citation: str = ""
    homepage: str = ""
    data_dir: str | None = None  # the version directory read, if any
    config_name: str = ""
    module_name: str = ""
    download_size: int = 0

    @property
    def full_name(self) -> str:
        """"name/config/version" (tfds's DatasetInfo.full_name), without the empty parts."""
        return "/".join(filter(None, [self.name, self.config_name, self.version]))

    def __repr__(self) -> str:
        splits = ", ".join(f"{k}: {v.num_examples}" for k, v in self.splits.items())
        return (f"DatasetInfo(name={self.full_name!r}, splits={{{splits}}}, supervised_keys="
                f"{self.supervised_keys}, features={dict(self.features)}, data_dir={self.data_dir!r})")


def read_info(directory: str | os.PathLike) -> DatasetInfo:
    """Reads dataset_info.json, features.json and the labels files of a prepared directory."""
    directory = os.fspath(directory)
    info_path = os.path.join(directory, "dataset_info.json")
    raw = _read_json(info_path)
    fmt = raw.get("fileFormat", "tfrecord")
    if fmt != "tfrecord":
        raise ValueError(f"{info_path}: fileFormat is {fmt!r}; mirrored reads TFRecord shards only. Prepare the "
                         "dataset with TFDS' default file_format='tfrecord'.")
    features_path = os.path.join(directory, "features.json")
    raw_features = _read_json(features_path)
    root = raw_features.get("featuresDict", {}).get("features") or raw_features.get("content")
    if not isinstance(root, dict):
        raise ValueError(f"{features_path}: expected a FeaturesDict of features; got {raw_features!r:.200}.")
    features = FeaturesDict()
    for key in sorted(root):
        labels = os.path.join(directory, f"{key.replace('/', '-')}.labels.txt")
        names = _read_labels(labels) if os.path.isfile(labels) else None
        features[key] = _feature_from_json(key, root[key], names, features_path)
    splits = SplitDict()
    for entry in raw.get("splits", []):
        if "shardLengths" not in entry:
            raise ValueError(f"{info_path}: split {entry.get('name')!r} has no shardLengths (written by a TFDS "
                             "older than 3.0); prepare the dataset again with a current TFDS.")
        splits[entry["name"]] = SplitInfo(entry["name"], tuple(int(n) for n in entry["shardLengths"]),
                                          int(entry.get("numBytes", 0)),
                                          entry.get("filepathTemplate") or DEFAULT_FILEPATH_TEMPLATE)
    keys = raw.get("supervisedKeys", {})
    items = keys.get("tuple", {}).get("items")
    if items:
        supervised = tuple(item["featureKey"] for item in items)
    else:  # TFDS < 4.5 wrote {"input": ..., "output": ...}
        supervised = (keys["input"], keys["output"]) if "input" in keys else None
    return DatasetInfo(
        name=raw.get("name", os.path.basename(os.path.dirname(directory))), version=raw.get("version", ""),
        features=features, splits=splits, supervised_keys=supervised, description=raw.get("description", ""),
        citation=raw.get("citation", ""), homepage=(raw.get("location", {}).get("urls") or [""])[0],
        data_dir=directory, config_name=raw.get("configName", ""), module_name=raw.get("moduleName", ""),
        download_size=int(raw.get("downloadSize", 0)))


def _read_json(path: str) -> dict[str, Any]:
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not valid JSON ({e}); the directory is damaged: prepare it again.") from None


def _read_labels(path: str) -> list[str]:
    with open(path, encoding="utf-8") as f:
        return [line.rstrip("\r\n") for line in f if line.strip()]


def info_json(info: DatasetInfo) -> dict[str, Any]:
    """dataset_info.json's content for `info`: the JSON form of TFDS' DatasetInfo proto (camelCase
    names, 64-bit integers as strings), as TFDS writes it."""
    out: dict[str, Any] = {"fileFormat": "tfrecord", "name": info.name, "version": info.version,
                           "splits": [{"filepathTemplate": s.filepath_template or DEFAULT_FILEPATH_TEMPLATE,
                                       "name": s.name, "numBytes": str(s.num_bytes),
                                       "shardLengths": [str(n) for n in s.shard_lengths]}
                                      for s in info.splits.values()]}
    optional = {"citation": info.citation, "description": info.description, "moduleName": info.module_name,
                "configName": info.config_name}
    out.update({k: v for k, v in optional.items() if v})
    if info.homepage:
        out["location"] = {"urls": [info.homepage]}
    if info.download_size:
        out["downloadSize"] = str(info.download_size)
    if info.supervised_keys:
        out["supervisedKeys"] = {"tuple": {"items": [{"featureKey": k} for k in info.supervised_keys]}}
    return out


def features_json(features: Mapping[str, Feature]) -> dict[str, Any]:
    """features.json's content: TFDS' FeaturesDict proto in JSON."""
    return {"featuresDict": {"features": {k: f.to_json() for k, f in sorted(features.items())}},
            "pythonClassName": _TFDS + "features_dict.FeaturesDict"}


def write_info(directory: str | os.PathLike, info: DatasetInfo) -> None:
    """Writes dataset_info.json, features.json and `<feature>.labels.txt` as TFDS formats them."""
    directory = os.fspath(directory)
    _write_text(os.path.join(directory, "dataset_info.json"),
                json.dumps(info_json(info), indent=2, sort_keys=True, ensure_ascii=False))
    _write_text(os.path.join(directory, "features.json"),
                json.dumps(features_json(info.features), indent=4, sort_keys=True, ensure_ascii=False))
    for key, feature in info.features.items():
        if isinstance(feature, ClassLabel):
            _write_text(os.path.join(directory, f"{key.replace('/', '-')}.labels.txt"),
                        "".join(name + "\n" for name in feature.names))


def _write_text(path: str, text: str) -> None:
    tmp = f"{path}.tmp"
    with open(tmp, "w", encoding="utf-8", newline="\n") as f:
        f.write(text)
    os.replace(tmp, path)


# -------------------------------------------------------------------------------------- writing


def shard_count(total_bytes: int, num_examples: int) -> int:
    """TFDS' rule for the number of shards of a split: the largest power of two up to 512 that puts
    64 MiB to 1 GiB in each shard (more for splits over 1 TiB), never more shards than examples."""
    size = total_bytes + num_examples * _RECORD_OVERHEAD
    fewest, most = max(1, size // _MAX_SHARD_BYTES), max(1, size // _MIN_SHARD_BYTES)
    if fewest > 1024:
        n = 1024 * -(-fewest // 1024)
        return n if num_examples >= n else 1
    for n in (1024, 512, 256, 128, 64, 32, 16, 8, 4, 2):
        if fewest <= n <= most and num_examples >= n:
            return n
    return 1


def shard_boundaries(num_examples: int, num_shards: int) -> list[int]:
    """The end of each shard, round(num_examples * (i + 1) / num_shards), as TFDS splits them."""
    return [round(num_examples * (i + 1) / num_shards) for i in range(num_shards)]


def _key_order(split: str, key: str) -> int:
    # TFDS orders a split's records by md5(split name + key): a fixed pseudo-random order that
    # does not depend on how the source lists its files (checked against TFDS' own files in tests).
    return int(hashlib.md5(split.encode() + key.replace("\\", "/").encode()).hexdigest(), 16)


def write_split(directory: str | os.PathLike, dataset_name: str, split: str, keys: Sequence[str],
                encode: Callable[[str], bytes], *, total_bytes: int, num_shards: int | None = None) -> SplitInfo:
    """Writes one split's shards into `directory` and returns its SplitInfo.

    Args:
      keys: one unique key per example (e.g. its file name); records go in TFDS' order of keys.
      encode: key -> the serialized tf.train.Example; called once per key, in write order.
      total_bytes: about how many bytes the records hold, to choose the shard count (shard_count).
      num_shards: overrides that choice.
    """
    order = sorted(keys, key=lambda k: _key_order(split, k))
    if len(set(order)) != len(order):
        dup = next(k for k, n in collections.Counter(order).items() if n > 1)
        raise ValueError(f"write_split({split!r}): key {dup!r} appears more than once; keys identify "
                         "examples and must be unique (use e.g. the path relative to the split).")
    if not order:
        raise ValueError(f"write_split({split!r}): no examples; a split needs at least one.")
    num_shards = num_shards or shard_count(total_bytes, len(order))
    names = SplitInfo(split, (0,) * num_shards).filenames(dataset_name)
    lengths, num_bytes, start = [], 0, 0
    for name, stop in zip(names, shard_boundaries(len(order), num_shards)):
        with TFRecordWriter(os.path.join(os.fspath(directory), name)) as writer:
            for key in order[start:stop]:
                record = encode(key)
                num_bytes += len(record)
                writer.write(record)
        lengths.append(stop - start)
        start = stop
    return SplitInfo(split, tuple(lengths), num_bytes)


# -------------------------------------------------------------------------------------- reading


@dataclasses.dataclass(frozen=True)
class ReadConfig:
    """How shards are read (tfds.ReadConfig's names and defaults where it has them).

    With shuffle_files=True the shard order is shuffled anew each pass, seeded by shuffle_seed
    (None: drawn from torch's global generator when the dataset is built). Shards are interleaved
    as tf.data.Dataset.interleave does it, `interleave_cycle_length` open at once and
    `interleave_block_length` records from each in turn, so with shuffle_files=False a split of
    several shards comes in TFDS' own order; set interleave_cycle_length=1 to read shard after shard.
    """

    shuffle_seed: int | None = None
    interleave_cycle_length: int = 16
    interleave_block_length: int = 16
    num_parallel_calls_for_decode: int | None = AUTOTUNE
    # Reading records is cheap next to decoding JPEGs, so shards are read by the decoding map's
    # threads as they pull input; AUTOTUNE (TFDS' default) adds a read-ahead thread per open shard.
    num_parallel_calls_for_interleave_files: int | None = None
    verify_crc: bool = True

    @classmethod
    def of(cls, value: ReadConfig | Mapping[str, Any] | None) -> ReadConfig:
        """`value` as a ReadConfig: None gives the defaults, a dict sets the fields it names."""
        return config_of(cls, value, "read_config")


class _KnownCardinality(_pipeline.Node):
    """Passes its input through and reports `count` as its cardinality (tf.data's
    assert_cardinality): interleave cannot know it, the shard lengths do. The readers check the
    count shard by shard, so a short shard raises rather than silently ending early."""

    kind = "assert_cardinality"

    def __init__(self, input: _pipeline.Node, count: int):
        super().__init__(input)
        self.count = count

    def iterate(self, probe: bool) -> Iterator[Any]:
        return self.inputs[0].iterate(probe)

    def cardinality(self) -> int:
        return self.count

    def describe(self) -> str:
        return f"assert_cardinality({self.count})"


def _shard_reader(instruction: FileInstruction, verify_crc: bool) -> Callable[[], Iterator[tuple[bytes, str, int]]]:
    """A generator function for Dataset.from_generator: (record, shard path, record index) tuples."""
    path, skip, take = instruction.path, instruction.skip, instruction.take

    def records() -> Iterator[tuple[bytes, str, int]]:
        reader = read_records(path, verify_crc=verify_crc)
        count = 0
        try:
            # Records before `skip` are framed and CRC-checked, never parsed or decoded.
            for count, record in enumerate(itertools.islice(reader, skip, skip + take), 1):
                yield record, path, skip + count - 1
        finally:
            reader.close()
        if count < take:
            raise ValueError(f"{path}: has fewer records than the {skip + take} that dataset_info.json's "
                             "shardLengths promise; the shard is truncated: delete the dataset directory and "
                             "prepare it again.")
    return records


class _Decoder:
    """Parses one record into the feature dict (or the supervised pair), naming the record on error."""

    def __init__(self, features: FeaturesDict, supervised_keys: tuple[str, str] | None):
        self.features, self.supervised_keys = features, supervised_keys

    def __call__(self, record: bytes, path: str, index: int) -> Any:
        where = f"record {index} of {path}"
        try:
            parsed = parse_example(record)
        except ValueError as e:
            raise ValueError(f"{where}: not a tf.train.Example ({e}); the shard is damaged: prepare it again.") from None
        keys = self.supervised_keys or self.features
        out = {}
        for key in keys:
            if key not in parsed:
                raise ValueError(f"{where}: has no feature {key!r} (it has {sorted(parsed)}); features.json "
                                 "does not describe this file: prepare the dataset again.")
            out[key] = self.features[key].decode(parsed[key], where)
        return tuple(out.values()) if self.supervised_keys else out


class PreparedDataset:
    """A TFDS-prepared version directory: `.info` and `.as_dataset(split)`."""

    def __init__(self, directory: str | os.PathLike):
        self.directory = os.fspath(directory)
        self.info = read_info(self.directory)

    def file_instructions(self, split: str) -> list[FileInstruction]:
        """The shard reads `split` (a spec) needs; shards outside its ranges are never opened."""
        out = []
        for name, start, stop in split_ranges(split, self.info.splits):
            info = self.info.splits[name]
            files = info.filenames(self.info.name)
            out += [FileInstruction(os.path.join(self.directory, files[i]), skip, take)
                    for i, skip, take in _shard_takes(info.shard_lengths, start, stop)]
        missing = [f.path for f in out if not os.path.isfile(f.path)]
        if missing:
            raise FileNotFoundError(f"{self.info.name}: shard {missing[0]} is missing ({len(missing)} of "
                                    f"{len(out)} needed); the directory {self.directory} is incomplete: delete "
                                    "it and prepare the dataset again.")
        return out

    def as_dataset(self, split: str, *, shuffle_files: bool = False, as_supervised: bool = False,
                   read_config: ReadConfig | Mapping[str, Any] | None = None) -> Dataset:
        """The examples of `split` (a spec), decoded on AUTOTUNE threads, in TFDS' order."""
        config = ReadConfig.of(read_config)
        instructions = self.file_instructions(split)
        if as_supervised and not self.info.supervised_keys:
            raise ValueError(f"{self.info.name}: as_supervised=True but dataset_info.json names no supervised "
                             f"keys; use the feature dicts (features: {list(self.info.features)}).")
        decoder = _Decoder(self.info.features, self.info.supervised_keys if as_supervised else None)
        # The shards as a Files source: a multi-worker strategy's FILE auto-sharding gives each worker whole shards.
        order = Dataset(_sources.Files(list(torch.arange(len(instructions), dtype=torch.int64).unbind()), "shard"))
        if shuffle_files:
            order = order.shuffle(max(1, len(instructions)), seed=config.shuffle_seed)
        readers = [_shard_reader(f, config.verify_crc) for f in instructions]
        records = order.interleave(lambda i: Dataset.from_generator(readers[int(i)]),
                                   cycle_length=config.interleave_cycle_length,
                                   block_length=config.interleave_block_length,
                                   num_parallel_calls=config.num_parallel_calls_for_interleave_files)
        records = Dataset(_KnownCardinality(records._node, sum(f.take for f in instructions)))
        return records.map(decoder, num_parallel_calls=config.num_parallel_calls_for_decode)

    def __repr__(self) -> str:
        return f"PreparedDataset({self.directory!r})"


