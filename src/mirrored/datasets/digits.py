"""`digits`: the UCI handwritten digits, 1,797 8x8 images of 0-9, embedded so tests and examples
run offline.

The data is digits.npz beside this file: `images` uint8 (1797, 8, 8) with values 0..16 (each pixel
counts the set pixels of a 4x4 block of a 32x32 bitmap) and `labels` uint8 (1797,), in the order of
scikit-learn's copy (sklearn/datasets/data/digits.csv.gz, the test part of UCI's "Optical
Recognition of Handwritten Digits"). It is served as uint8 HWC images scaled to 0..255, in two
configs: "digits" (= "digits/8x8", images (8, 8, 1)) and "digits/32x32" (bilinear upscaling to
(32, 32, 3), gray repeated in R, G and B: ready for ResNets built for 32x32 RGB inputs).

Splits: "test" is a fixed stratified 20% (360 images), "train" the other 1,437. Each class gets its
share of 360 by largest remainder (ties to the lower digit), and within a class the examples whose
md5(f"{_SPLIT_SALT}/{index}") is smallest go to test: no random generator, so the split is the
same on every platform and numpy version. Uses mirrored.data (Dataset, images, tfds).
"""
from __future__ import annotations

import hashlib
import os
from collections.abc import Mapping
from fractions import Fraction
from typing import Any

import numpy as np
import torch

from mirrored.data.dataset import Dataset
from mirrored.data.images import resize
from mirrored.data.tfds import (ClassLabel, DatasetInfo, FeaturesDict, Image, ReadConfig, SplitDict, SplitInfo,
                                split_ranges)

__all__ = ["CONFIGS", "Digits", "held_out_indices", "load_arrays"]

DATA_FILE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "digits.npz")
CONFIGS = {"8x8": (8, 1), "32x32": (32, 3)}  # config -> (image size, channels)
VERSION = "1.0.0"
_TEST_SIZE = 360  # 20% of 1,797, rounded up as scikit-learn's train_test_split(test_size=0.2) does
_SPLIT_SALT = "mirrored.datasets.digits/split-v1"  # the split's "seed": change it and the split changes
_MAX_VALUE = 16
_CITATION = """@misc{alpaydin1998optical,
    title={Optical Recognition of Handwritten Digits},
    author={Alpaydin, E. and Kaynak, C.},
    year={1998},
    howpublished={UCI Machine Learning Repository},
    doi={10.24432/C50P49}
}"""


def load_arrays() -> tuple[np.ndarray, np.ndarray]:
    """The embedded (images, labels) as stored: uint8 (1797, 8, 8) in 0..16 and uint8 (1797,)."""
    with np.load(DATA_FILE, allow_pickle=False) as data:
        return data["images"], data["labels"]


def held_out_indices(labels: np.ndarray) -> np.ndarray:
    """The sorted indices of the "test" split (see the module docstring for the rule)."""
    counts = np.bincount(labels, minlength=10)
    shares = [Fraction(_TEST_SIZE * int(c), len(labels)) for c in counts]
    quota = [int(s) for s in shares]
    by_remainder = sorted(range(len(counts)), key=lambda c: (-(shares[c] - quota[c]), c))
    for c in by_remainder[:_TEST_SIZE - sum(quota)]:
        quota[c] += 1
    chosen = []
    for c, k in enumerate(quota):
        members = np.flatnonzero(labels == c)
        members = sorted(members, key=lambda i: hashlib.md5(f"{_SPLIT_SALT}/{i}".encode()).digest())
        chosen += members[:k]
    return np.sort(np.array(chosen, dtype=np.int64))


class Digits:
    """The embedded digits in config "8x8" or "32x32": `.info`, `.as_dataset(split)`."""

    def __init__(self, config: str | None = None):
        config = config or "8x8"
        if config not in CONFIGS:
            raise ValueError(f"digits: unknown config {config!r}; use {', '.join('digits/' + c for c in CONFIGS)} "
                             "(plain 'digits' is digits/8x8).")
        self.config = config
        size, channels = CONFIGS[config]
        images, labels = load_arrays()
        test = np.zeros(len(labels), dtype=bool)
        test[held_out_indices(labels)] = True
        # 0..16 -> 0..255, rounding half up: 16 * 255 / 16 = 255, 8 -> 127.5 -> 128
        scaled = torch.from_numpy((images.astype(np.int32) * 255 + _MAX_VALUE // 2) // _MAX_VALUE).to(torch.uint8)
        scaled = scaled.unsqueeze(-1)  # HWC
        if size != 8:
            scaled = resize(scaled, (size, size)).round().clamp(0, 255).to(torch.uint8)
        if channels == 3:
            scaled = scaled.expand(-1, -1, -1, 3).contiguous()
        label_tensor = torch.from_numpy(labels.astype(np.int64))
        self._arrays = {split: (scaled[torch.from_numpy(mask)], label_tensor[torch.from_numpy(mask)])
                        for split, mask in (("train", ~test), ("test", test))}
        self.info = DatasetInfo(
            name="digits", version=VERSION, config_name="" if config == "8x8" else config,
            features=FeaturesDict({"image": Image((size, size, channels)),
                                   "label": ClassLabel(names=[str(d) for d in range(10)])}),
            splits=SplitDict({s: SplitInfo(s, (len(y),), 0, None) for s, (_, y) in self._arrays.items()}),
            supervised_keys=("image", "label"),
            description="UCI handwritten digits: 8x8 images of 0-9 (values 0..16 scaled to 0..255), "
                        "embedded in mirrored; a fixed stratified 1,437/360 train/test split.",
            homepage="https://archive.ics.uci.edu/dataset/80/optical+recognition+of+handwritten+digits",
            citation=_CITATION)

    def as_dataset(self, split: str, *, shuffle_files: bool = False, as_supervised: bool = False,
                   read_config: ReadConfig | Mapping[str, Any] | None = None) -> Dataset:
        """The examples of `split` (a spec such as "train[:90%]") in index order. The data sits in one
        in-memory "file", so shuffle_files changes nothing (as for a one-shard TFDS split); shuffle
        with Dataset.shuffle."""
        del shuffle_files  # one shard: TFDS has no order to shuffle either
        ReadConfig.of(read_config)  # validated for the same errors as other datasets; nothing to read
        parts = [(self._arrays[name][0][start:stop], self._arrays[name][1][start:stop])
                 for name, start, stop in split_ranges(split, self.info.splits)]
        images = torch.cat([p[0] for p in parts])
        labels = torch.cat([p[1] for p in parts])
        if as_supervised:
            return Dataset.from_tensor_slices((images, labels))
        return Dataset.from_tensor_slices({"image": images, "label": labels})

    def __repr__(self) -> str:
        return f"Digits(config={self.config!r})"
