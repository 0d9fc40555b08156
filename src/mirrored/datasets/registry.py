"""`load()` and `builder()`: datasets by name, as tfds.load and tfds.builder give them.

A name is `name[/config][:version]`. Built in: "cassava" (a TFDS-prepared directory; download=True
fetches and prepares it), "digits" and "digits/32x32" (embedded), "image_folder" (data_dir= is a
folder of class folders). Any other name is read from a directory TFDS prepared,
`<data_dir>/<name>[/<config>]/<version>/`, if its features are images, class labels and text.
Every builder has `.info` (a DatasetInfo) and `.as_dataset(split, ...)`. Uses mirrored.data and
this package's cassava.py and digits.py.
"""
from __future__ import annotations

import os
import re
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

from mirrored.data.dataset import Dataset
from mirrored.data.image_folder import ImageFolder
from mirrored.data.tfds import DatasetInfo, PreparedDataset, ReadConfig, default_data_dir, find_version_dir
from mirrored.datasets import cassava, digits

__all__ = ["builder", "image_folder", "list_builders", "load"]

_NAME_RE = re.compile(r"^(?P<name>[\w-]+)(?:/(?P<config>[\w.-]+))?(?::(?P<version>\d+\.\d+\.\d+))?$")


class Builder(Protocol):
    info: DatasetInfo

    def as_dataset(self, split: str, *, shuffle_files: bool = False, as_supervised: bool = False,
                   read_config: ReadConfig | Mapping[str, Any] | None = None) -> Dataset: ...


def list_builders() -> list[str]:
    """The names mirrored provides itself (any TFDS-prepared directory loads too)."""
    return ["cassava", *(f"digits/{c}" if c != "8x8" else "digits" for c in digits.CONFIGS), "image_folder"]


def builder(name: str, data_dir: str | os.PathLike | None = None, *, download: bool = False,
            download_config: cassava.DownloadConfig | Mapping[str, Any] | None = None) -> Builder:
    """The dataset `name` ("cassava", "cassava:0.1.0", "digits/32x32", ...), like tfds.builder: its
    `.info`, and `.as_dataset(split)` for the examples. See load() for the arguments."""
    if not isinstance(name, str) or not _NAME_RE.match(name):
        raise ValueError(f"load: cannot parse the dataset name {name!r}; write 'name', 'name:1.2.3' or "
                         f"'name/config', e.g. 'cassava', 'cassava:0.1.0' or 'digits/32x32'.")
    match = _NAME_RE.match(name)
    base, config, version = match["name"], match["config"], match["version"]
    if base == "digits":
        if version not in (None, digits.VERSION):
            raise ValueError(f"load({name!r}): digits has only version {digits.VERSION}.")
        return digits.Digits(config)
    if base == "image_folder":
        if data_dir is None:
            raise ValueError("load('image_folder') needs data_dir=, the folder that holds one sub-folder per class "
                             "(root/<class>/*.jpg) or per split (root/<split>/<class>/*.jpg).")
        return ImageFolder(data_dir)
    data_dir = os.path.expanduser(os.fspath(data_dir)) if data_dir is not None else default_data_dir()
    dataset_dir = os.path.join(data_dir, base, *([config] if config else []))
    found = find_version_dir(dataset_dir, version)
    if found is None and download:
        if base != cassava.NAME or config or version not in (None, cassava.VERSION):
            raise ValueError(f"load({name!r}, download=True): mirrored downloads only 'cassava' (version "
                             f"{cassava.VERSION}). Prepare other datasets with TFDS: `tfds build {base} "
                             f"--data_dir {data_dir}`, then load them with download=False.")
        found = cassava.download_and_prepare(data_dir, download_config)
    if found is None:
        raise FileNotFoundError(_missing_message(name, base, version, dataset_dir, data_dir))
    return PreparedDataset(found)


def _missing_message(name: str, base: str, version: str | None, dataset_dir: str, data_dir: str) -> str:
    where = os.path.join(dataset_dir, version or "<version>", "dataset_info.json")
    what = f"load({name!r}): no prepared data at {where}."
    if version is not None and os.path.isdir(dataset_dir):
        others = sorted(v for v in os.listdir(dataset_dir) if find_version_dir(dataset_dir, v))
        if others:
            what += f" Prepared versions there: {', '.join(others)}."
    tfds_cmd = f"`tfds build {base} --data_dir {data_dir}`"
    if base == cassava.NAME:
        return (f"{what} Get it with load({name!r}, download=True) (downloads 1.35 GB and prepares it there), or "
                f"with TFDS: {tfds_cmd}; or pass data_dir= (or set TFDS_DATA_DIR) to the folder that holds "
                f"cassava/{cassava.VERSION}/.")
    return (f"{what} mirrored's own datasets are {', '.join(list_builders())}; any other TFDS image-classification "
            f"dataset loads once TFDS has prepared it: {tfds_cmd}, or pass data_dir= (or set TFDS_DATA_DIR) to "
            "where it is prepared.")


def load(name: str, split: str | Sequence[str] | None = None, data_dir: str | os.PathLike | None = None, *,
         as_supervised: bool = False, with_info: bool = False, shuffle_files: bool = False,
         download: bool = False, read_config: ReadConfig | Mapping[str, Any] | None = None,
         download_config: cassava.DownloadConfig | Mapping[str, Any] | None = None) -> Any:
    """Loads a dataset by name as a Dataset of examples, like tfds.load.

        # (image, label) pairs
        ds = mr.datasets.load("cassava", split="train", as_supervised=True)
        # {"train": ds, "test": ds}
        splits, info = mr.datasets.load("digits", with_info=True)
        ds = mr.datasets.load("cassava", split="train[:80%]+validation",
                              data_dir="/data/tfds")
        info.features["label"].names, info.features["label"].num_classes
        info.splits["train"].num_examples

    Examples are feature dicts, {"image": uint8 HWC tensor, "image/filename": str, "label": int64
    scalar tensor} for cassava, or (image, label) pairs with as_supervised=True. Images are decoded
    in a map with num_parallel_calls=AUTOTUNE; batch, shuffle and prefetch the result as needed.

    Args:
      name: "cassava", "cassava:0.1.0" (a version), "digits", "digits/32x32" (32x32 RGB for ResNets),
        "image_folder" (data_dir= is the root of class folders), or any dataset TFDS prepared in
        data_dir with image, class-label and text features. Without a version, the newest prepared.
      split: a TFDS split spec: "train", "train[:80%]", "train[80%:]", "train[10:20]", "train[-5:]",
        "train+validation", "train[:50%]+test", "all". Percent bounds are rounded to the closest
        example as TFDS does (Python's round(): ties to even). None: a dict {split: Dataset}; a list:
        a list of Datasets.
      data_dir: where prepared datasets live: `<data_dir>/<name>/<version>/`. Default: $TFDS_DATA_DIR,
        else ~/tensorflow_datasets (TFDS' own, so data TFDS prepared is found).
      shuffle_files: False reads examples in TFDS' order (record order within shards; shards
        interleaved as TFDS does, read_config.interleave_cycle_length=1 for one after another).
        True shuffles the shard order each pass, seeded from torch's global generator when the
        dataset is built (or read_config.shuffle_seed). It does not shuffle examples: use ds.shuffle.
      download: for cassava, fetch (resumably, sha256-checked) and prepare it if it is missing.
        Off by default, unlike tfds.load: a 1.35 GB download is never a surprise.
      read_config: a data.tfds.ReadConfig or a dict of its fields (shuffle_seed, interleave lengths,
        decode threads, verify_crc).
      download_config: a cassava.DownloadConfig or a dict of its fields (url, size_bytes, sha256, ...).

    Returns:
      The Dataset (or dict / list of them); with with_info=True, (that, info) with info a DatasetInfo.
    """
    source = builder(name, data_dir, download=download, download_config=download_config)
    kwargs = {"shuffle_files": shuffle_files, "as_supervised": as_supervised, "read_config": read_config}
    try:
        if split is None:
            result: Any = {s: source.as_dataset(s, **kwargs) for s in source.info.splits}
        elif isinstance(split, (list, tuple)):
            result = [source.as_dataset(s, **kwargs) for s in split]
        else:
            result = source.as_dataset(split, **kwargs)
    except ValueError as e:  # name the dataset: "split 'trian': unknown split" alone does not
        raise ValueError(f"load({name!r}): {e}") from None
    return (result, source.info) if with_info else result


def image_folder(root: str | os.PathLike, split: str | Sequence[str] | None = "train", *,
                 as_supervised: bool = False, with_info: bool = False, shuffle_files: bool = False,
                 read_config: ReadConfig | Mapping[str, Any] | None = None) -> Any:
    """The images of `root/<class>/*.jpg|png` (classes: sorted folder names) as load() gives a
    dataset: split "train" by default; a `root/<split>/<class>/` tree has one split per folder.
    Same as load("image_folder", split, data_dir=root, ...)."""
    return load("image_folder", split, root, as_supervised=as_supervised, with_info=with_info,
                shuffle_files=shuffle_files, read_config=read_config)
