"""The losses of _regression_losses.py, _classification_losses.py and _batch_losses.py against Keras
3's own loss objects (KERAS_BACKEND=torch) on the same tensors.

Tolerance: both compute in float32 with the same formulas, in places in another order (a sum before a
division, log1p against log(1 + x)): rtol 1e-5 covers that reassociation, atol 1e-6 values near 0."""
from __future__ import annotations

import inspect
import json
import os
import warnings

import pytest
import torch

os.environ.setdefault("KERAS_BACKEND", "torch")  # before keras is imported (it reads it once)
keras = pytest.importorskip("keras")

from mirrored.training import losses  # noqa: E402


def close(got, want, rtol=1e-5, atol=1e-6):
    torch.testing.assert_close(torch.as_tensor(got).float().cpu(), torch.as_tensor(want).float().cpu(),
                               rtol=rtol, atol=atol)


def _data():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(8, 5, generator=g) * 2
    labels = torch.randint(0, 5, (8,), generator=g)
    return {
        "reg": (torch.randn(8, 4, generator=g), torch.randn(8, 4, generator=g)),
        "pos": (torch.rand(8, 4, generator=g) * 3, torch.rand(8, 4, generator=g) * 3 + 0.1),
        "prob": (torch.softmax(torch.randn(8, 5, generator=g), -1), torch.softmax(torch.randn(8, 5, generator=g), -1)),
        "binary": (torch.randint(0, 2, (8, 3), generator=g).float(), torch.randn(8, 3, generator=g) * 2),
        "signs": (torch.randint(0, 2, (8, 3), generator=g).float() * 2 - 1, torch.randn(8, 3, generator=g)),
        "onehot": (torch.nn.functional.one_hot(labels, 5).float(), logits),
        "sparse_prob": (labels, torch.softmax(logits, -1)),
        "mask": ((torch.rand(4, 6, 6, 1, generator=g) > 0.5).float(), torch.rand(4, 6, 6, 1, generator=g)),
        "embed": (torch.randint(0, 3, (8,), generator=g),
                  torch.nn.functional.normalize(torch.randn(8, 6, generator=g), dim=-1)),
    }


DATA = _data()

# (our class, Keras's class, keyword arguments for both, which data)
CASES = [
    ("MeanAbsolutePercentageError", {}, "reg"),
    ("MeanSquaredLogarithmicError", {}, "pos"),
    ("Huber", {}, "reg"),
    ("Huber", {"delta": 0.3}, "reg"),
    ("LogCosh", {}, "reg"),
    ("CosineSimilarity", {}, "reg"),
    ("Poisson", {}, "pos"),
    ("KLDivergence", {}, "prob"),
    ("Hinge", {}, "binary"),
    ("Hinge", {}, "signs"),
    ("SquaredHinge", {}, "binary"),
    ("CategoricalHinge", {}, "onehot"),
    ("BinaryFocalCrossentropy", {"from_logits": True}, "binary"),
    ("BinaryFocalCrossentropy", {"from_logits": True, "apply_class_balancing": True, "alpha": 0.4, "gamma": 1.5,
                                 "label_smoothing": 0.1}, "binary"),
    ("CategoricalFocalCrossentropy", {"from_logits": True}, "onehot"),
    ("CategoricalFocalCrossentropy", {"from_logits": True, "alpha": [0.1, 0.2, 0.3, 0.2, 0.2], "gamma": 1.0,
                                      "label_smoothing": 0.2}, "onehot"),
    ("CategoricalGeneralizedCrossEntropy", {"q": 0.7}, "sparse_prob"),
    ("Dice", {"axis": (1, 2, 3)}, "mask"),
    ("Tversky", {"alpha": 0.3, "beta": 0.7, "axis": (1, 2)}, "mask"),
]


@pytest.mark.parametrize("name, kwargs, data", CASES, ids=[f"{c[0]}-{i}" for i, c in enumerate(CASES)])
def test_per_example_losses_equal_keras(name, kwargs, data):
    y_true, y_pred = DATA[data]
    ours = getattr(losses, name)(**kwargs)
    theirs = getattr(keras.losses, name)(**kwargs, reduction=None)
    want = theirs(y_true, y_pred)
    close(ours.per_example(y_true, y_pred), want)
    weights = torch.linspace(0.1, 1.0, y_true.shape[0])
    keras_mean = getattr(keras.losses, name)(**kwargs)
    close(ours(y_true, y_pred, sample_weight=weights), keras_mean(y_true, y_pred, sample_weight=weights))
    keras_sum = getattr(keras.losses, name)(**kwargs, reduction="sum")
    assert type(ours)(**kwargs, reduction="sum")(y_true, y_pred).shape == ()
    close(type(ours)(**kwargs, reduction="sum")(y_true, y_pred), keras_sum(y_true, y_pred))


def test_focal_losses_take_logits_by_default_and_probabilities_on_request():
    """Our convention: from_logits=True by default. from_logits=False on probabilities gives Keras's default."""
    y_true, logits = DATA["binary"]
    close(losses.BinaryFocalCrossentropy()(y_true, logits),
          keras.losses.BinaryFocalCrossentropy(from_logits=True)(y_true, logits))
    close(losses.BinaryFocalCrossentropy(from_logits=False)(y_true, torch.sigmoid(logits)),
          keras.losses.BinaryFocalCrossentropy()(y_true, torch.sigmoid(logits)))
    y_true, logits = DATA["onehot"]
    close(losses.get("categorical_focal_crossentropy")(y_true, logits),
          keras.losses.CategoricalFocalCrossentropy(from_logits=True)(y_true, logits))
    with pytest.warns(UserWarning, match="looks like probabilities"):
        losses.CategoricalFocalCrossentropy()(y_true, torch.softmax(logits, -1))


def test_ctc_equals_keras():
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(3, 12, 6, generator=g)
    labels = torch.tensor([[1, 2, 3, 0], [4, 4, 0, 0], [5, 1, 2, 3]])
    close(losses.CTC().per_example(labels, logits), keras.losses.CTC(reduction=None)(labels, logits))
    close(losses.CTC()(labels, logits), keras.losses.CTC()(labels, logits))
    with pytest.raises(ValueError, match=r"label 6 .* outside \[0, 6\)"):
        losses.ctc(torch.tensor([[6, 0]]), logits[:1])
    with pytest.raises(ValueError, match="labels .*max_label_length"):
        losses.ctc(labels[:, 0], logits)


@pytest.mark.parametrize("name, kwargs", [("Dice", {}), ("Tversky", {"alpha": 0.2, "beta": 0.8})])
def test_batch_dice_and_tversky_repeat_the_batch_value(name, kwargs):
    """axis=None (Keras's default) is one number for the batch: per_example repeats it, so the mean over
    the batch (what fit reduces) is Keras's value, with weights too."""
    y_true, y_pred = DATA["mask"]
    want = getattr(keras.losses, name)(**kwargs)(y_true, y_pred)
    ours = getattr(losses, name)(**kwargs)
    per_example = ours.per_example(y_true, y_pred)
    assert per_example.shape == (4,)
    close(per_example.mean(), want)
    close(ours(y_true, y_pred), want)
    w = torch.tensor([0.5, 1.0, 2.0, 0.0])
    close(ours(y_true, y_pred, sample_weight=w), getattr(keras.losses, name)(**kwargs)(y_true, y_pred, sample_weight=w))


@pytest.mark.parametrize("reduction", ["sum_over_batch_size", "sum"])
def test_circle_equals_keras_with_its_mask(reduction):
    """Keras masks the examples whose loss is 0 (no positive in the batch: label 2 below appears once)
    and divides by the others; per_example carries that scaling."""
    labels, emb = DATA["embed"]
    labels = torch.tensor([0, 0, 1, 1, 2, 0, 1, 0])
    ours = losses.Circle(gamma=10.0, reduction=reduction)
    close(ours(labels, emb), keras.losses.Circle(gamma=10.0, reduction=reduction)(labels, emb))
    if reduction == "sum_over_batch_size":
        close(ours.per_example(labels, emb).mean(), keras.losses.Circle(gamma=10.0)(labels, emb))
    close(losses.circle(labels, emb), keras.losses.circle(labels, emb))


def test_batch_statistics_warn_once_on_several_replicas():
    """Under strategy.run on 2 replicas, Dice over the batch is each replica's own batch: warned, once."""
    import mirrored as mr

    y_true, y_pred = DATA["mask"]
    strategy = mr.MirroredStrategy(devices=["cpu:0", "cpu:1"])
    loss = losses.Dice()
    per_axis = losses.Dice(axis=(1, 2, 3))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):
            strategy.run(lambda: (loss.per_example(y_true, y_pred), per_axis.per_example(y_true, y_pred)))
    messages = [str(w.message) for w in caught if "statistic of the whole batch" in str(w.message)]
    assert len(messages) == 1 and "axis=(1, ...)" in messages[0]
    del strategy


def test_names_as_keras_resolves_them():
    for name, cls in [("huber", "Huber"), ("Huber", "Huber"), ("log_cosh", "LogCosh"), ("logcosh", "LogCosh"),
                      ("kld", "KLDivergence"), ("kl_divergence", "KLDivergence"), ("mape", "MeanAbsolutePercentageError"),
                      ("msle", "MeanSquaredLogarithmicError"), ("bce", "BinaryCrossentropy"), ("hinge", "Hinge"),
                      ("categorical_hinge", "CategoricalHinge"), ("dice", "Dice"), ("tversky", "Tversky"),
                      ("circle", "Circle"), ("ctc", "CTC"), ("CTC", "CTC"), ("poisson", "Poisson"),
                      ("binary_focal_crossentropy", "BinaryFocalCrossentropy"), ("cosine_similarity", "CosineSimilarity"),
                      ("categorical_generalized_cross_entropy", "CategoricalGeneralizedCrossEntropy")]:
        assert type(losses.get(name)).__name__ == cls, name
        if name not in ("categorical_generalized_cross_entropy", "logcosh"):  # (not in Keras 3.15's get)
            keras.losses.get(name)  # a name Keras takes too
    with pytest.raises(ValueError, match="unknown loss 'hubber'. Known names: .*huber"):
        losses.get("hubber")


@pytest.mark.parametrize("name, kwargs, data", CASES, ids=[f"{c[0]}-{i}" for i, c in enumerate(CASES)])
def test_configs_round_trip_through_json(name, kwargs, data):
    ours = getattr(losses, name)(**kwargs, name="mine")
    config = json.loads(json.dumps(losses.serialize(ours)))
    back = losses.deserialize(config)
    assert type(back) is type(ours) and back.name == "mine" and back.get_config() == ours.get_config()
    y_true, y_pred = DATA[data]
    close(back(y_true, y_pred), ours(y_true, y_pred))
    # Keras's own names (Huber's and CosineSimilarity's configs in Keras 3.15 leave out delta and axis;
    # ours keep them, so that they rebuild the same loss).
    keras_args = inspect.signature(getattr(keras.losses, name)).parameters
    assert set(ours.get_config()) <= set(keras_args), "our config keys are Keras's constructor arguments"


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match=r"Huber\(delta=0\)"):
        losses.Huber(delta=0)
    with pytest.raises(ValueError, match=r"q=1"):
        losses.CategoricalGeneralizedCrossEntropy(q=1)
    with pytest.raises(ValueError, match="label_smoothing"):
        losses.BinaryFocalCrossentropy(label_smoothing=2)
    with pytest.raises(ValueError, match="one-hot labels"):
        losses.categorical_hinge(torch.tensor([0, 1]), torch.randn(2, 3))
    with pytest.raises(ValueError, match="same shape"):
        losses.dice(torch.ones(2, 3), torch.ones(2, 4))


@pytest.mark.parametrize("name, kwargs, data", CASES, ids=[f"{c[0]}-{i}" for i, c in enumerate(CASES)])
def test_a_keras_loss_object_becomes_ours_with_its_settings(name, kwargs, data):
    """compile(loss=keras.losses.X(...)) on a torch module: losses.get gives ours of the same class and
    settings, Keras's from_logits included (Huber's delta too, which Keras's config leaves out)."""
    theirs = getattr(keras.losses, name)(**kwargs)
    ours = losses.get(theirs)
    assert type(ours) is getattr(losses, name)
    y_true, y_pred = DATA[data]
    close(ours(y_true, y_pred), theirs(y_true, y_pred))
    with pytest.raises(ValueError, match="mean_with_sample_weight"):
        losses.get(keras.losses.Huber(reduction="mean_with_sample_weight"))
