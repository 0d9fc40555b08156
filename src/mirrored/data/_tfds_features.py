"""The features of a TFDS dataset: how each feature of a tf.train.Example is typed and decoded.

Image (encoded bytes -> uint8 HWC tensor), ClassLabel (int64 -> label, with class names) and Text
(utf-8 bytes -> str), each with the features.json form TFDS writes (to_json) and reads
(_feature_from_json); FeaturesDict holds them by name. tfds.py re-exports the public names, which
users import from there. Uses images.py, numpy and torch.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch

from mirrored.data.images import decode_image

_TFDS = "tensorflow_datasets.core.features."


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
