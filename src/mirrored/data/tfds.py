"""Datasets prepared by TensorFlow Datasets (TFDS): read and written without TensorFlow.

A prepared directory `<data_dir>/<name>/<version>/` holds dataset_info.json (splits and their shard
lengths), features.json (the type of each feature), `<feature>.labels.txt` (class names) and TFRecord
shards `<name>-<split>.tfrecord-00000-of-00004` of tf.train.Example records. `PreparedDataset(dir)`
reads one: `.info` (DatasetInfo: features, splits, supervised_keys) and `.as_dataset(split)`, a
Dataset of feature dicts whose images are decoded in a parallel map. Split specs follow TFDS
(`parse_split`: "train[:80%]+test"). `write_split` and `write_info` write the same layout, so TFDS
reads what we prepare. Uses dataset.py, tfrecord.py and images.py.
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

import numpy as np
import torch

from mirrored._files import config_of
from mirrored.data import _pipeline
from mirrored.data.dataset import AUTOTUNE, Dataset
from mirrored.data.images import decode_image
from mirrored.data.tfrecord import TFRecordWriter, parse_example, read_records

__all__ = [
    "ClassLabel", "DatasetInfo", "FeaturesDict", "FileInstruction", "Image", "PreparedDataset",
    "ReadConfig", "SplitDict", "SplitInfo", "Text", "default_data_dir", "find_version_dir",
    "parse_split", "shard_boundaries", "shard_count", "split_ranges", "write_info", "write_split",
]

DEFAULT_FILEPATH_TEMPLATE = "{DATASET}-{SPLIT}.{FILEFORMAT}-{SHARD_X_OF_Y}"
_TFDS = "tensorflow_datasets.core.features."
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


# ------------------------------------------------------------------------------------ features


class Image:
    """An encoded image (JPEG/PNG bytes on disk), served as a uint8 HWC tensor (tfds.features.Image)."""

    def __init__(self, shape: Sequence[int | None] = (None, None, 3)):
        self.shape = tuple(None if d is None or d < 0 else int(d) for d in shape)
        self.channels = self.shape[-1] or 0  # 0: as stored

    def decode(self, value: list[bytes] | np.ndarray, where: str) -> torch.Tensor:
        """The image of one record's bytes, as a uint8 HWC tensor; `where` names the record in errors."""
        if not _is_bytes_list(value):
            raise ValueError(f"{where}: the image feature holds {_held(value)}, not encoded image bytes; the "
                             "shard is damaged or from another dataset: prepare it again.")
        return decode_image(value[0], self.channels, name=where)

    def to_json(self) -> dict[str, Any]:
        """This feature as TFDS writes it in features.json."""
        dims = [str(-1 if d is None else d) for d in self.shape]
        return {"image": {"dtype": "uint8", "shape": {"dimensions": dims}},
                "pythonClassName": _TFDS + "image_feature.Image"}

    def __repr__(self) -> str:
        return f"Image(shape={self.shape}, dtype=torch.uint8)"


class ClassLabel:
    """An int64 class id in [0, num_classes), with names (tfds.features.ClassLabel)."""

    def __init__(self, names: Sequence[str] | None = None, num_classes: int | None = None):
        if names is None and num_classes is None:
            raise ValueError("ClassLabel: give names= (e.g. ['cat', 'dog']) or num_classes=.")
        self.names = [str(n) for n in names] if names is not None else [str(i) for i in range(num_classes)]
        if num_classes is not None and num_classes != len(self.names):
            raise ValueError(f"ClassLabel: {len(self.names)} names {self.names} but num_classes={num_classes}; "
                             "give one name per class.")
        self.num_classes = len(self.names)

    def str2int(self, name: str) -> int:
        """The class id of `name` (tfds's ClassLabel.str2int); an unknown name is a ValueError listing the names."""
        try:
            return self.names.index(name)
        except ValueError:
            raise ValueError(f"ClassLabel: unknown class name {name!r}; the names are {self.names}.") from None

    def int2str(self, label: int) -> str:
        """The name of class id `label` (tfds's ClassLabel.int2str)."""
        return self.names[label]

    def decode(self, value: list[bytes] | np.ndarray, where: str) -> torch.Tensor:
        """The class id of one record's int64 value, as a 0-d int64 tensor, checked against num_classes."""
        if not (isinstance(value, np.ndarray) and value.dtype == np.int64):  # a float 2.7 or b"3" is no class id
            raise ValueError(f"{where}: the label feature holds {_held(value)}, not an int64 class id; the "
                             "shard is damaged or from another dataset: prepare it again.")
        if len(value) != 1 or not 0 <= int(value[0]) < self.num_classes:
            raise ValueError(f"{where}: label {value.tolist()} is outside [0, {self.num_classes}) (classes "
                             f"{', '.join(self.names)}). The file is damaged or belongs to another "
                             "dataset version: prepare it again.")
        return torch.tensor(int(value[0]), dtype=torch.int64)

    def to_json(self) -> dict[str, Any]:
        """This feature as TFDS writes it in features.json."""
        return {"classLabel": {"numClasses": str(self.num_classes)},
                "pythonClassName": _TFDS + "class_label_feature.ClassLabel"}

    def __repr__(self) -> str:
        return f"ClassLabel(num_classes={self.num_classes}, names={self.names})"


class Text:
    """A UTF-8 string, served as str (tfds.features.Text)."""

    def decode(self, value: list[bytes] | np.ndarray, where: str) -> str:
        """One record's bytes as a str (UTF-8)."""
        if isinstance(value, list) and not value:
            return ""
        if not _is_bytes_list(value):
            raise ValueError(f"{where}: the text feature holds {_held(value)}, not UTF-8 bytes; the shard is "
                             "damaged or from another dataset: prepare it again.")
        try:
            return value[0].decode("utf-8")
        except UnicodeDecodeError as e:
            raise ValueError(f"{where}: the text feature is not UTF-8 ({e}); the shard is damaged or from "
                             "another dataset: prepare it again.") from None

    def to_json(self) -> dict[str, Any]:
        """This feature as TFDS writes it in features.json."""
        return {"pythonClassName": _TFDS + "text_feature.Text", "text": {}}

    def __repr__(self) -> str:
        return "Text()"


Feature = Image | ClassLabel | Text


def _is_bytes_list(value: Any) -> bool:
    """Whether a parsed feature is one bytes value (a bytes_list of length 1), as images and text are."""
    return isinstance(value, list) and len(value) == 1 and isinstance(value[0], bytes)


def _held(value: Any) -> str:
    """What a parsed tf.train.Example feature holds, for errors: its list kind and its first values."""
    if isinstance(value, np.ndarray):
        kind = {"i": "an int64_list", "f": "a float_list"}.get(value.dtype.kind, f"a {value.dtype} array")
        return f"{kind} of {len(value)} {value[:4].tolist()}{'...' if len(value) > 4 else ''}"
    if isinstance(value, list):
        return f"a bytes_list of {len(value)}{f' starting {value[0][:16]!r}' if value else ''}"
    return f"a {type(value).__name__}"


class FeaturesDict(dict):
    """{feature name: feature} in the order TFDS serves them (sorted names)."""

    def __repr__(self) -> str:
        inner = ",\n".join(f"    {k!r}: {v!r}" for k, v in self.items())
        return f"FeaturesDict({{\n{inner}\n}})"


def _feature_from_json(key: str, spec: Mapping[str, Any], names: list[str] | None, where: str) -> Feature:
    kind = spec.get("pythonClassName") or spec.get("type", "")  # 4.x: pythonClassName; 3.x: type/content
    content = spec.get("content", {})
    short = kind.rsplit(".", 1)[-1]
    if short == "Image":
        dims = spec["image"]["shape"]["dimensions"] if "image" in spec else content.get("shape", [None, None, 3])
        return Image([None if d is None else int(d) for d in dims])
    if short == "ClassLabel":
        n = int(spec["classLabel"]["numClasses"]) if "classLabel" in spec else content.get("num_classes")
        if names is not None and n is not None and len(names) != n:
            raise ValueError(f"{where}: feature {key!r} has numClasses {n} but {key}.labels.txt lists "
                             f"{len(names)} names; the directory is inconsistent: prepare it again.")
        return ClassLabel(names=names, num_classes=None if names is not None else n)
    if short == "Text":
        return Text()
    raise ValueError(f"{where}: feature {key!r} is a {kind or spec!r}, which mirrored does not decode "
                     "(it reads Image, ClassLabel and Text features). Load an image-classification "
                     "dataset, or read the shards with mirrored.data.tfrecord.")


# -------------------------------------------------------------------------------------- splits


@dataclasses.dataclass(frozen=True)
class SplitInfo:
    """One split: examples per shard file (tfds.core.SplitInfo). A sub-split such as
    info.splits["train[:10%]"] lists the examples it takes from each shard instead."""

    name: str
    shard_lengths: tuple[int, ...]
    num_bytes: int = 0
    filepath_template: str | None = DEFAULT_FILEPATH_TEMPLATE

    @property
    def num_examples(self) -> int:
        """The examples of the split: the sum of its shards' lengths."""
        return sum(self.shard_lengths)

    @property
    def num_shards(self) -> int:
        """How many files (shards) the split has."""
        return len(self.shard_lengths)

    def filenames(self, dataset_name: str) -> list[str]:
        """The shard file names, in shard order."""
        if self.filepath_template is None:
            raise ValueError(f"SplitInfo {self.name!r} is a sub-split; its files are those of its split.")
        n = self.num_shards
        return [self.filepath_template.replace("{DATASET}", dataset_name).replace("{SPLIT}", self.name)
                .replace("{FILEFORMAT}", "tfrecord").replace("{SHARD_X_OF_Y}", f"{i:05d}-of-{n:05d}")
                .replace("{SHARD_INDEX}", f"{i:05d}").replace("{NUM_SHARDS}", f"{n:05d}") for i in range(n)]

    def __repr__(self) -> str:
        return f"<SplitInfo {self.name!r} num_examples={self.num_examples}, num_shards={self.num_shards}>"


class SplitDict(dict):
    """{split name: SplitInfo}; a spec such as splits["train[:80%]"] gives that sub-split's SplitInfo."""

    def __getitem__(self, key: str) -> SplitInfo:
        if dict.__contains__(self, key):
            return dict.__getitem__(self, key)
        lengths: list[int] = []
        for name, start, stop in split_ranges(key, self):
            lengths += [take for _, _, take in _shard_takes(self.get(name).shard_lengths, start, stop)]
        return SplitInfo(str(key), tuple(lengths), 0, None)

    @property
    def total_num_examples(self) -> int:
        """The examples of every split together (tfds's SplitDict.total_num_examples)."""
        return sum(s.num_examples for s in self.values())


# One part of a spec: name, then an optional [from:to] with ints, floats with %, or "shard" units.
_PART_RE = re.compile(r"^\s*(?P<name>[\w-]+)\s*(?:\[(?P<slice>[^\]]*)\])?\s*$")
_BOUND_RE = re.compile(r"^\s*(?P<value>[-+]?(?:\d+(?:\.\d*)?|\.\d+))\s*(?P<unit>%|shard)?\s*$")


@dataclasses.dataclass(frozen=True)
class ReadInstruction:
    """One parsed part of a split spec: split name and slice bounds in `unit` ('abs', '%', 'shard')."""

    split: str
    start: float | None = None
    stop: float | None = None
    unit: str = "abs"


def parse_split(spec: str) -> list[ReadInstruction]:
    """Parses a TFDS split spec: parts joined by '+', each `name`, `name[a:b]` (examples, negative
    from the end), `name[a%:b%]` (percent, may be fractional), `name[a shard:b shard]` or `name[k shard]`;
    "all" is every split."""
    if not isinstance(spec, str):
        raise TypeError(f"split must be a str such as 'train[:80%]'; got {spec!r} ({type(spec).__name__}).")
    out = []
    for part in spec.split("+"):
        match = _PART_RE.match(part)
        if not match:
            raise ValueError(f"split {spec!r}: cannot parse {part.strip()!r}. Write e.g. 'train', 'train[:80%]', "
                             "'train[10:20]', 'train[-5:]' or 'train[:50%]+test'.")
        name, selector = match["name"], match["slice"]
        if selector is None:
            out.append(ReadInstruction(name))
            continue
        if name == "all":
            raise ValueError(f"split {spec!r}: 'all' cannot be sliced; slice the splits and join them with '+'.")
        out.append(_parse_slice(name, selector, spec))
    return out


def _parse_slice(name: str, selector: str, spec: str) -> ReadInstruction:
    pieces = selector.split(":")
    bounds = [None if not p.strip() else _BOUND_RE.match(p) for p in pieces]
    bad = len(pieces) > 2 or any(p.strip() and b is None for p, b in zip(pieces, bounds)) or not any(bounds)
    if bad:
        raise ValueError(f"split {spec!r}: cannot parse the slice [{selector}]. Write [from:to] with ints "
                         "(examples), percents such as [:80%] or [10%:], or shards such as [:2shard].")
    units = {b["unit"] for b in bounds if b is not None and b["unit"]}
    if len(units) > 1:
        raise ValueError(f"split {spec!r}: the slice [{selector}] mixes units {sorted(units)}; use one unit.")
    unit = {"%": "%", "shard": "shard"}.get(units.pop() if units else "", "abs")
    if len(pieces) == 1:  # name[k shard]: one shard
        if unit != "shard":
            raise ValueError(f"split {spec!r}: [{selector}] needs a colon, e.g. [{selector}:] or [:{selector}]; "
                             "only shards can be picked by a single index ([3shard]).")
        k = int(bounds[0]["value"])
        return ReadInstruction(name, k, k + 1 if k != -1 else None, unit)
    values = []
    for b in bounds:
        if b is None:
            values.append(None)
        elif unit == "%":
            values.append(float(b["value"]))
        elif re.fullmatch(r"[-+]?\d+", b["value"].strip()):
            values.append(int(b["value"]))
        else:
            raise ValueError(f"split {spec!r}: {b['value']} is not a whole number; only percents may be "
                             "fractional ([:33.3%]).")
    if unit == "%" and any(v is not None and abs(v) > 100 for v in values):
        raise ValueError(f"split {spec!r}: percent bounds must be within [-100%, 100%].")
    return ReadInstruction(name, values[0], values[1], unit)


def _percent_to_index(percent: float, num_examples: int) -> int:
    # TFDS' default "closest" rounding: Python's round() (ties to even) of the float product, so
    # train[:50%] of 5 examples has 2 and train[:50%] of 7 has 4, exactly as tfds.load gives them.
    return int(round(percent * num_examples / 100.0))


def split_ranges(spec: str, splits: Mapping[str, SplitInfo | int]) -> list[tuple[str, int, int]]:
    """`spec` as (split, start, stop) example ranges, given each split's SplitInfo or size.
    An unknown split is a ValueError listing the available ones."""
    out = []
    for instr in parse_split(spec):
        names = list(splits) if instr.split == "all" else [instr.split]
        for name in names:
            if name not in splits:
                raise ValueError(f"split {spec!r}: unknown split {name!r}; the dataset has "
                                 f"{', '.join(map(repr, splits))}. Use one of those (sliced if you like, e.g. "
                                 f"'{next(iter(splits), 'train')}[:80%]'), or 'all'.")
            info = splits[name]
            n = info if isinstance(info, int) else info.num_examples
            start, stop = _absolute(instr, n, info, spec)
            out.append((name, start, max(start, stop)))
    return out


def _absolute(instr: ReadInstruction, n: int, info: SplitInfo | int, spec: str) -> tuple[int, int]:
    start, stop = instr.start, instr.stop
    if instr.unit == "%":
        start = 0 if start is None else _percent_to_index(start, n)
        stop = n if stop is None else _percent_to_index(stop, n)
    elif instr.unit == "shard":
        lengths = list(info.shard_lengths) if isinstance(info, SplitInfo) else [n]
        if any(abs(b) > len(lengths) for b in (start, stop) if b is not None):
            raise ValueError(f"split {spec!r}: shard bound out of range; split {instr.split!r} has "
                             f"{len(lengths)} shard(s).")
        start = 0 if start is None else sum(lengths[:start])
        stop = n if stop is None else sum(lengths[:stop]) if stop > 0 else sum(lengths[:len(lengths) + stop])
    else:
        start, stop = (0 if start is None else start), (n if stop is None else stop)
        if abs(start) > n or abs(stop) > n:
            raise ValueError(f"split {spec!r}: slice [{instr.start if instr.start is not None else ''}:"
                             f"{instr.stop if instr.stop is not None else ''}] is out of range for split "
                             f"{instr.split!r} of {n} examples; use bounds within [-{n}, {n}], or percents.")
    return (n + start if start < 0 else start), (n + stop if stop < 0 else stop)


@dataclasses.dataclass(frozen=True)
class FileInstruction:
    """Read `take` records of shard `path` after skipping `skip` (tfds' FileInstruction)."""

    path: str
    skip: int
    take: int


def _shard_takes(shard_lengths: Sequence[int], start: int, stop: int) -> list[tuple[int, int, int]]:
    """(shard index, skip, take) covering examples [start, stop) of shards of these lengths."""
    out, first = [], 0
    for index, length in enumerate(shard_lengths):
        lo, hi = max(start, first), min(stop, first + length)
        if lo < hi:
            out.append((index, lo - first, hi - lo))
        first += length
    return out


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
        order = Dataset.from_tensor_slices(torch.arange(len(instructions), dtype=torch.int64))
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


