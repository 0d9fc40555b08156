"""Image-classification data kept as folders of image files: `root/<class>/<image>`.

`ImageFolder(root)` scans the tree once. Class names are the sorted names of the class folders and
every .jpg/.jpeg/.png/.bmp/.gif/.webp file in one is an example of that class (other files are
ignored). A root whose folders hold class folders instead, `root/<split>/<class>/<image>` (the
layout of tfds.ImageFolder and of the extracted Cassava archive), has one split per folder;
otherwise everything is the split "train". `.info` and `.as_dataset(split)` work as for a TFDS
directory (tfds.py) and give the same elements: {"image": uint8 HWC, "image/filename": str,
"label": int64}. Uses dataset.py, images.py and tfds.py (DatasetInfo, features, split specs).
"""
from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import torch

from mirrored.data.dataset import Dataset
from mirrored.data.images import decode_image
from mirrored.data.tfds import (ClassLabel, DatasetInfo, FeaturesDict, Image, ReadConfig, SplitDict, SplitInfo,
                                Text, split_ranges)

__all__ = ["IMAGE_EXTENSIONS", "ImageFolder"]

IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".bmp", ".gif", ".webp")


def _visible_dirs(path: str) -> list[str]:
    return sorted(e.name for e in os.scandir(path) if e.is_dir() and not e.name.startswith("."))


def _images_in(path: str) -> list[str]:
    return sorted(e.name for e in os.scandir(path)
                  if e.is_file() and not e.name.startswith(".") and e.name.lower().endswith(IMAGE_EXTENSIONS))


def _scan_classes(path: str) -> dict[str, list[str]]:
    classes = {c: _images_in(os.path.join(path, c)) for c in _visible_dirs(path)}
    classes = {c: files for c, files in classes.items() if files}
    if not classes:
        raise ValueError(f"ImageFolder: found no images under {path}. Put them in one folder per class, e.g. "
                         f"{os.path.join(path, 'cat', '0001.jpg')} (extensions: {', '.join(IMAGE_EXTENSIONS)}).")
    return classes


class ImageFolder:
    """Examples from `root/<class>/<image>` or `root/<split>/<class>/<image>`: `.info`, `.as_dataset()`."""

    def __init__(self, root: str | os.PathLike):
        self.root = os.path.abspath(os.path.expanduser(os.fspath(root)))
        if not os.path.isdir(self.root):
            raise FileNotFoundError(f"ImageFolder: {self.root} is not a directory. Give the folder that holds "
                                    "one sub-folder per class (root/<class>/*.jpg) or per split "
                                    "(root/<split>/<class>/*.jpg).")
        folders = _visible_dirs(self.root)
        if folders and not any(_images_in(os.path.join(self.root, f)) for f in folders):
            split_dirs = {f: os.path.join(self.root, f) for f in folders}  # root/<split>/<class>/
        else:
            split_dirs = {"train": self.root}
        by_split = {split: _scan_classes(path) for split, path in split_dirs.items()}
        names = sorted({c for classes in by_split.values() for c in classes})
        label = {name: i for i, name in enumerate(names)}
        # (path, label) per split, in class then file-name order
        self.files: dict[str, list[tuple[str, int]]] = {
            split: [(os.path.join(split_dirs[split], c, f), label[c]) for c in sorted(classes) for f in classes[c]]
            for split, classes in by_split.items()}
        splits = SplitDict({s: SplitInfo(s, (len(f),), sum(os.path.getsize(p) for p, _ in f), None)
                            for s, f in self.files.items()})
        self.info = DatasetInfo(
            name="image_folder", version="1.0.0",
            features=FeaturesDict({"image": Image((None, None, 3)), "image/filename": Text(),
                                   "label": ClassLabel(names=names)}),
            splits=splits, supervised_keys=("image", "label"), data_dir=self.root,
            description=f"Images from the class folders of {self.root}.")

    def as_dataset(self, split: str, *, shuffle_files: bool = False, as_supervised: bool = False,
                   read_config: ReadConfig | Mapping[str, Any] | None = None) -> Dataset:
        """The examples of `split` (a TFDS spec such as "train[:80%]"), in class then file-name order,
        or reshuffled every pass with shuffle_files=True (each image is its own file). Images are
        decoded on AUTOTUNE threads."""
        config = ReadConfig.of(read_config)
        chosen = [pair for name, start, stop in split_ranges(split, self.info.splits)
                  for pair in self.files[name][start:stop]]
        paths = [p for p, _ in chosen]
        labels = torch.tensor([label for _, label in chosen], dtype=torch.int64)
        ds = Dataset.from_tensor_slices((paths, labels))
        if shuffle_files:
            ds = ds.shuffle(max(1, len(chosen)), seed=config.shuffle_seed)
        return ds.map(_Reader(as_supervised), num_parallel_calls=config.num_parallel_calls_for_decode)

    def __repr__(self) -> str:
        return f"ImageFolder({self.root!r}, splits={dict((k, v.num_examples) for k, v in self.info.splits.items())})"


class _Reader:
    """Reads and decodes one image file; an undecodable file is named in the error."""

    def __init__(self, as_supervised: bool):
        self.as_supervised = as_supervised

    def __call__(self, path: str, label: torch.Tensor) -> Any:
        with open(path, "rb") as f:
            image = decode_image(f.read(), 3, name=path)
        if self.as_supervised:
            return image, label
        return {"image": image, "image/filename": os.path.basename(path), "label": label}
