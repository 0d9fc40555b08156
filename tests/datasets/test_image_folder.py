"""data/image_folder.py through mr.datasets: class-folder trees built here with Pillow."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image as PILImage

import mirrored as mr


def _write(path, value, fmt):
    path.parent.mkdir(parents=True, exist_ok=True)
    array = np.full((5, 6, 3), value, dtype=np.uint8)
    array[0, 0] = (value, 255 - value, 7)
    PILImage.fromarray(array).save(path, format=fmt)
    return array


@pytest.fixture
def tree(tmp_path):
    """root/<class>/<image>: classes dog, ant, cat (sorted: ant, cat, dog), PNG pixels known exactly."""
    root = tmp_path / "pets"
    pixels = {}
    for cls, names in {"dog": ["b.png", "a.png"], "ant": ["z.png"], "cat": ["m.png", "k.jpg"]}.items():
        for i, name in enumerate(names):
            fmt = "PNG" if name.endswith("png") else "JPEG"
            pixels[name] = _write(root / cls / name, 40 * i + 20 + len(cls), fmt)
    (root / "cat" / "notes.txt").write_text("not an image, ignored")
    (root / ".hidden").mkdir()
    return root, pixels


def test_classes_sorted_and_examples_in_order(tree):
    root, pixels = tree
    ds, info = mr.datasets.image_folder(root, with_info=True)
    assert info.features["label"].names == ["ant", "cat", "dog"]
    assert info.features["label"].num_classes == 3
    assert info.splits["train"].num_examples == 5 == len(ds)
    got = list(ds)
    assert [(ex["image/filename"], int(ex["label"])) for ex in got] == [
        ("z.png", 0), ("k.jpg", 1), ("m.png", 1), ("a.png", 2), ("b.png", 2)]
    for ex in got:
        assert ex["image"].dtype == torch.uint8 and ex["image"].shape == (5, 6, 3)
        assert ex["label"].dtype == torch.int64
        if ex["image/filename"].endswith("png"):  # lossless: the exact pixels
            assert np.array_equal(ex["image"].numpy(), pixels[ex["image/filename"]])


def test_load_by_name_with_split_dict_and_slices(tree):
    root, _ = tree
    splits = mr.datasets.load("image_folder", data_dir=root)
    assert list(splits) == ["train"]
    images, labels = zip(*mr.datasets.load("image_folder", "train[-2:]", root, as_supervised=True))
    assert [int(y) for y in labels] == [2, 2]


def test_split_layout_gives_one_split_per_folder(tmp_path):
    root = tmp_path / "leaves"
    for split, n in {"train": 3, "validation": 1}.items():
        for cls in ("healthy", "cmd"):
            for i in range(n):
                _write(root / split / cls / f"{split}-{cls}-{i}.png", 10 * i, "PNG")
    ds, info = mr.datasets.load("image_folder", data_dir=root, with_info=True)
    assert sorted(ds) == ["train", "validation"]
    assert info.splits["train"].num_examples == 6 and info.splits["validation"].num_examples == 2
    assert info.features["label"].names == ["cmd", "healthy"]
    assert [ex["image/filename"] for ex in ds["validation"]] == ["validation-cmd-0.png", "validation-healthy-0.png"]


def test_shuffle_files_reshuffles_reproducibly(tree):
    root, _ = tree
    torch.manual_seed(0)
    a = mr.datasets.image_folder(root, shuffle_files=True)
    torch.manual_seed(0)
    b = mr.datasets.image_folder(root, shuffle_files=True)
    first = [ex["image/filename"] for ex in a]
    assert first == [ex["image/filename"] for ex in b]
    assert sorted(first) == ["a.png", "b.png", "k.jpg", "m.png", "z.png"]


def test_undecodable_file_is_named(tmp_path):
    _write(tmp_path / "root" / "cat" / "fine.png", 3, "PNG")
    (tmp_path / "root" / "cat" / "broken.jpg").write_bytes(b"nope")
    with pytest.raises(ValueError, match="broken.jpg"):
        list(mr.datasets.image_folder(tmp_path / "root"))


def test_missing_or_empty_trees_are_explained(tmp_path):
    with pytest.raises(FileNotFoundError, match="is not a directory"):
        mr.datasets.image_folder(tmp_path / "absent")
    (tmp_path / "empty" / "cat").mkdir(parents=True)
    with pytest.raises(ValueError, match="found no images under"):
        mr.datasets.image_folder(tmp_path / "empty")
    with pytest.raises(ValueError, match="needs data_dir="):
        mr.datasets.load("image_folder")
