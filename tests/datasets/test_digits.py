"""datasets/digits.py: the embedded UCI digits against facts known from scikit-learn's copy."""
from __future__ import annotations

import numpy as np
import pytest
import torch

import mirrored as mr
from mirrored.datasets import digits

SKLEARN_CLASS_COUNTS = [178, 182, 177, 183, 181, 182, 181, 179, 174, 180]


def test_embedded_data_matches_known_facts():
    images, labels = digits.load_arrays()
    assert images.shape == (1797, 8, 8) and images.dtype == np.uint8
    assert labels.shape == (1797,)
    assert np.bincount(labels).tolist() == SKLEARN_CLASS_COUNTS
    assert images.min() == 0 and images.max() == 16
    # sklearn's load_digits().images[0], a 0
    assert images[0, 0].tolist() == [0, 0, 5, 13, 9, 1, 0, 0] and labels[0] == 0
    assert labels[:10].tolist() == list(range(10))


def test_split_is_fixed_stratified_and_disjoint():
    _, labels = digits.load_arrays()
    test = digits.held_out_indices(labels)
    assert len(test) == 360 and len(set(test.tolist())) == 360
    per_class = np.bincount(labels[test], minlength=10)
    shares = np.array(SKLEARN_CLASS_COUNTS) * 360 / 1797
    assert np.all(np.abs(per_class - shares) < 1)  # each class within one example of its share
    info = digits.Digits().info
    assert info.splits["train"].num_examples == 1437 and info.splits["test"].num_examples == 360


def test_load_serves_scaled_hwc_images():
    (train, test), info = mr.datasets.load("digits", split=["train", "test"], with_info=True)
    assert info.features["label"].names == [str(d) for d in range(10)]
    assert info.features["label"].num_classes == 10
    assert len(train) == 1437 and len(test) == 360
    images, labels = digits.load_arrays()
    test_index = digits.held_out_indices(labels)
    first = next(iter(test))
    assert first["image"].shape == (8, 8, 1) and first["image"].dtype == torch.uint8
    want = np.round(images[test_index[0]].astype(np.float64) * 255 / 16 + 1e-9)  # half up
    assert np.array_equal(first["image"][..., 0].numpy(), want)
    assert int(first["label"]) == labels[test_index[0]]
    values = torch.stack([ex["image"] for ex in train])
    assert values.max() == 255 and values.min() == 0


def test_supervised_slices_and_32x32_variant():
    ds = mr.datasets.load("digits", split="train[:10%]", as_supervised=True)
    assert len(ds) == 144  # round(143.7)
    x, y = next(iter(ds))
    assert x.shape == (8, 8, 1) and y.dtype == torch.int64
    big, info = mr.datasets.load("digits/32x32", split="test", as_supervised=True, with_info=True)
    x32, y32 = next(iter(big))
    x8, y8 = next(iter(mr.datasets.load("digits", split="test", as_supervised=True)))
    assert x32.shape == (32, 32, 3) and x32.dtype == torch.uint8 and int(y32) == int(y8)
    assert torch.equal(x32[..., 0], x32[..., 2])  # gray in every channel
    # a 4x4 block's mean stays close to the 8x8 pixel it came from
    blocks = x32[..., 0].double().reshape(8, 4, 8, 4).mean(dim=(1, 3))
    assert (blocks - x8[..., 0].double()).abs().mean() < 20
    assert info.features["image"].shape == (32, 32, 3)


def test_unknown_config_is_explained():
    with pytest.raises(ValueError, match="digits/8x8, digits/32x32"):
        mr.datasets.load("digits/64x64")
