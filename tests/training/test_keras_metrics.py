"""The metrics of _regression_metrics.py, _probabilistic_metrics.py, _confusion_metrics.py and
_iou_metrics.py against Keras 3's own metric objects (KERAS_BACKEND=torch) on the same tensors, and
on 2 and 3 replicas against one device.

Tolerances: Keras accumulates in float32, we in float64 (results float32), so values agree to float32
rounding of sums over a few dozen values: rtol 1e-5. Across replica counts the state is the same sums
taken in another order, in float64: rtol 1e-6 (the float32 result's own rounding)."""
from __future__ import annotations

import inspect
import json
import os

import pytest
import torch

os.environ.setdefault("KERAS_BACKEND", "torch")  # before keras is imported (it reads it once)
keras = pytest.importorskip("keras")

import mirrored as mr  # noqa: E402
from mirrored.training import metrics  # noqa: E402


def close(got, want, rtol=1e-5, atol=1e-6):
    torch.testing.assert_close(torch.as_tensor(got).float().cpu(), torch.as_tensor(want).float().cpu(),
                               rtol=rtol, atol=atol)


def _data():
    g = torch.Generator().manual_seed(0)
    n = 9
    labels = torch.randint(0, 5, (n,), generator=g)
    logits = torch.randn(n, 5, generator=g) * 2
    binary_logits = torch.randn(n, 3, generator=g) * 2
    return {
        "reg": (torch.randn(n, 4, generator=g), torch.randn(n, 4, generator=g)),
        "reg1": (torch.randn(n, generator=g), torch.randn(n, generator=g)),
        "pos": (torch.rand(n, 4, generator=g) * 3, torch.rand(n, 4, generator=g) * 3 + 0.1),
        "prob": (torch.softmax(torch.randn(n, 5, generator=g), -1), torch.softmax(logits, -1)),
        "binary": (torch.randint(0, 2, (n, 3), generator=g).float(), torch.sigmoid(binary_logits)),
        "binary_logits": (torch.randint(0, 2, (n, 3), generator=g).float(), binary_logits),
        "onehot": (torch.nn.functional.one_hot(labels, 5).float(), torch.softmax(logits, -1)),
        "onehot_logits": (torch.nn.functional.one_hot(labels, 5).float(), logits),
        "sparse": (labels, torch.softmax(logits, -1)),
        "sparse_logits": (labels, logits),
        "segments": (torch.randint(0, 4, (n, 6), generator=g), torch.randint(0, 4, (n, 6), generator=g)),
        "segment_scores": (torch.randint(0, 4, (n, 6), generator=g), torch.randn(n, 6, 4, generator=g)),
        "onehot_segments": (torch.nn.functional.one_hot(torch.randint(0, 4, (n, 6), generator=g), 4).float(),
                            torch.randn(n, 6, 4, generator=g)),
        "weights": torch.rand(n, generator=g) + 0.1,
    }


DATA = _data()

# (class name, keyword arguments for both, data, extra keyword arguments for ours only)
CASES = [
    ("MeanSquaredError", {}, "reg", {}),
    ("MeanAbsoluteError", {}, "reg", {}),
    ("MeanAbsolutePercentageError", {}, "reg", {}),
    ("MeanSquaredLogarithmicError", {}, "pos", {}),
    ("RootMeanSquaredError", {}, "reg", {}),
    ("CosineSimilarity", {}, "reg", {}),
    ("LogCoshError", {}, "reg", {}),
    ("R2Score", {}, "reg", {}),
    ("R2Score", {"class_aggregation": "variance_weighted_average", "num_regressors": 2}, "reg", {}),
    ("R2Score", {"class_aggregation": None}, "reg", {}),
    ("PearsonCorrelation", {}, "reg", {}),
    ("ConcordanceCorrelation", {}, "reg", {}),
    ("KLDivergence", {}, "prob", {}),
    ("Poisson", {}, "pos", {}),
    ("BinaryCrossentropy", {}, "binary", {}),
    ("BinaryCrossentropy", {"from_logits": True, "label_smoothing": 0.1}, "binary_logits", {}),
    ("CategoricalCrossentropy", {}, "onehot", {}),
    ("CategoricalCrossentropy", {"from_logits": True}, "onehot_logits", {}),
    ("SparseCategoricalCrossentropy", {}, "sparse", {}),
    ("SparseCategoricalCrossentropy", {"from_logits": True}, "sparse_logits", {}),
    ("Hinge", {}, "binary_logits", {}),
    ("SquaredHinge", {}, "binary_logits", {}),
    ("CategoricalHinge", {}, "onehot_logits", {}),
    ("TopKCategoricalAccuracy", {}, "onehot", {}),
    ("TopKCategoricalAccuracy", {"k": 2}, "onehot", {}),
    ("TruePositives", {}, "binary", {}),
    ("FalsePositives", {"thresholds": [0.2, 0.5, 0.9]}, "binary", {}),
    ("TrueNegatives", {"thresholds": 0.3}, "binary", {}),
    ("FalseNegatives", {}, "binary", {}),
    ("TruePositives", {}, "binary_logits", {"from_logits": True}),
    ("PrecisionAtRecall", {"recall": 0.6}, "binary", {}),
    ("RecallAtPrecision", {"precision": 0.5, "num_thresholds": 11}, "binary", {}),
    ("SensitivityAtSpecificity", {"specificity": 0.5}, "binary", {}),
    ("SpecificityAtSensitivity", {"sensitivity": 0.7, "class_id": 1}, "binary", {}),
    ("SensitivityAtSpecificity", {"specificity": 0.4}, "binary_logits", {"from_logits": True}),
    ("F1Score", {}, "onehot", {}),
    ("F1Score", {"average": "macro", "threshold": 0.3}, "binary", {}),
    ("F1Score", {"average": "micro"}, "onehot", {}),
    ("FBetaScore", {"average": "weighted", "beta": 2.0}, "onehot", {}),
    ("F1Score", {"average": "macro", "threshold": 0.5}, "binary_logits", {"from_logits": True}),
    ("IoU", {"num_classes": 4, "target_class_ids": [0, 2]}, "segments", {}),
    ("MeanIoU", {"num_classes": 4, "ignore_class": 1}, "segments", {}),
    ("MeanIoU", {"num_classes": 4, "sparse_y_pred": False}, "segment_scores", {}),
    ("OneHotIoU", {"num_classes": 4, "target_class_ids": [1, 3]}, "onehot_segments", {}),
    ("OneHotMeanIoU", {"num_classes": 4}, "onehot_segments", {}),
    ("BinaryIoU", {}, "binary", {}),
    ("BinaryIoU", {"target_class_ids": [1], "threshold": 0.3}, "binary", {}),
    ("BinaryIoU", {}, "binary_logits", {"from_logits": True}),
]
IDS = [f"{c[0]}-{i}" for i, c in enumerate(CASES)]


def _keras_inputs(data: str, ours_extra: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """What Keras's object gets: probabilities where ours takes logits with from_logits=True."""
    y_true, y_pred = DATA[data]
    return y_true, torch.sigmoid(y_pred) if ours_extra.get("from_logits") else y_pred


def _update_twice(metric, y_true, y_pred, weights):
    """Two batches: the first 5 rows unweighted, the rest weighted. Keras's IoU takes one weight per
    label only (ours also one per example): it gets them repeated."""
    metric.update_state(y_true[:5], y_pred[:5])
    weights = weights[5:]
    if isinstance(metric, keras.metrics.IoU):
        labels = y_true[5:].argmax(-1) if y_true.ndim == 3 else y_true[5:]
        weights = weights[:, None].expand(labels.shape)
    metric.update_state(y_true[5:], y_pred[5:], sample_weight=weights)


@pytest.mark.parametrize("name, kwargs, data, extra", CASES, ids=IDS)
def test_metric_equals_keras(name, kwargs, data, extra):
    ours = getattr(metrics, name)(**kwargs, **extra)
    # Keras's IoU counts in int32 by default, which truncates float weights (it warns): ours count in
    # float64, as Keras's does with dtype="float32".
    theirs = getattr(keras.metrics, name)(**kwargs, **({"dtype": "float32"} if "IoU" in name else {}))
    weights = DATA["weights"]
    _update_twice(ours, *DATA[data], weights)
    _update_twice(theirs, *_keras_inputs(data, extra), weights)
    close(ours.result(), theirs.result())
    ours.reset_state()
    theirs.reset_state()
    ours.update_state(*DATA[data])
    theirs.update_state(*_keras_inputs(data, extra))
    close(ours.result(), theirs.result())


def _split(t: torch.Tensor, parts: int) -> mr.PerReplica:
    size = -(-t.shape[0] // parts)  # TF's split of a global batch: ceil(B/N) each, the last one short
    return mr.PerReplica([t[i * size:(i + 1) * size] for i in range(parts)])


@pytest.mark.parametrize("replicas", [2, 3])
def test_every_metric_on_replicas_equals_one_device(replicas):
    """Each metric's state is summed across replicas and read once: 9 examples over 2 (5, 4) or 3 (3, 3, 3)
    replicas give the one-device result, to float32 rounding. (PearsonCorrelation and
    ConcordanceCorrelation are per example here: (batch, 4) inputs.)"""
    strategy = mr.MirroredStrategy(devices=[f"cpu:{i}" for i in range(replicas)])
    weights = DATA["weights"]
    with strategy.scope():
        mirrored_metrics = [getattr(metrics, name)(**kwargs, **extra) for name, kwargs, _, extra in CASES]

    def step(*flat):
        for i, metric in enumerate(mirrored_metrics):
            metric.update_state(flat[3 * i], flat[3 * i + 1], sample_weight=flat[3 * i + 2])

    args = []
    for _, _, data, _ in CASES:
        args += [_split(DATA[data][0], replicas), _split(DATA[data][1], replicas), _split(weights, replicas)]
    strategy.run(step, args=tuple(args))
    for (name, kwargs, data, extra), metric in zip(CASES, mirrored_metrics):
        single = getattr(metrics, name)(**kwargs, **extra)
        single.update_state(*DATA[data], sample_weight=weights)
        close(metric.result(), single.result(), rtol=1e-6)
    del strategy, mirrored_metrics


@pytest.mark.parametrize("name, kwargs, data, extra", CASES, ids=IDS)
def test_configs_round_trip_through_json(name, kwargs, data, extra):
    ours = getattr(metrics, name)(**kwargs, **extra, name="mine")
    config = json.loads(json.dumps(metrics.serialize(ours)))
    back = metrics.deserialize(config)
    assert type(back) is type(ours) and back.name == "mine" and back.get_config() == ours.get_config()
    _update_twice(back, *DATA[data], DATA["weights"])
    _update_twice(ours, *DATA[data], DATA["weights"])
    close(back.result(), ours.result(), rtol=0, atol=0)
    # Keras's own argument names, and from_logits (ours, for logits)
    keras_names = set(inspect.signature(getattr(keras.metrics, name)).parameters) | {"from_logits"}
    assert set(ours.get_config()) <= keras_names


def test_keras_names_make_the_same_metrics():
    """Every lower-case name keras.metrics.get takes, except those needing arguments, gives ours of the same
    class, named after the string; the names of thresholded and crossentropy metrics mean logits."""
    from keras.src.metrics import ALL_OBJECTS_DICT

    names = [k for k in ALL_OBJECTS_DICT if k[0].islower() and k not in ("metric", "mean_metric_wrapper")]
    need_arguments = {"precision_at_recall", "recall_at_precision", "sensitivity_at_specificity",
                      "specificity_at_sensitivity", "io_u", "mean_io_u", "one_hot_io_u", "one_hot_mean_io_u"}
    for name in names:
        if name in need_arguments:
            with pytest.raises(ValueError, match=f"metric '{name}' needs arguments, so no name can make it: pass "
                                                 r"mr.metrics.\w+\("):
                metrics.get(name)
            continue
        ours = metrics.get(name)
        assert type(ours).__name__ == ALL_OBJECTS_DICT[name].__name__ or name == "accuracy", name
        assert ours.name == name
    assert metrics.get("bce").from_logits and metrics.get("true_positives").from_logits
    assert not metrics.get("bce", from_logits=False).from_logits
    assert type(metrics.get("RootMeanSquaredError")) is metrics.RootMeanSquaredError
    with pytest.raises(ValueError, match="unknown metric 'msee'. Known names: accuracy, .*, mse,"):
        metrics.get("msee")


def test_name_metrics_on_logits_equal_keras_on_probabilities():
    y, logits = DATA["binary_logits"]
    for name in ("bce", "true_positives", "f1_score", "binary_io_u"):
        ours, theirs = metrics.get(name), keras.metrics.get(name)
        ours.update_state(y, logits)
        theirs.update_state(y, torch.sigmoid(logits))
        close(ours.result(), theirs.result())


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match=r"PrecisionAtRecall\(recall=1.5\)"):
        metrics.PrecisionAtRecall(recall=1.5)
    with pytest.raises(ValueError, match=r"IoU\(target_class_ids=\[4\]\): give class ids in \[0, 4\)"):
        metrics.IoU(num_classes=4, target_class_ids=[4])
    with pytest.raises(ValueError, match="average="):
        metrics.F1Score(average="mean")
    with pytest.raises(ValueError, match=r"TruePositives\(thresholds=2\)"):
        metrics.TruePositives(thresholds=2)
    with pytest.raises(ValueError, match="expected both .batch, classes."):
        metrics.F1Score().update_state(torch.tensor([1, 0]), torch.rand(2, 3))
    r2 = metrics.R2Score()
    r2.update_state(torch.rand(4, 2), torch.rand(4, 2))
    with pytest.raises(ValueError, match="built for 2 by its first update"):
        r2.update_state(torch.rand(4, 3), torch.rand(4, 3))
    with pytest.raises(ValueError, match="outside .0, 1., so they are not probabilities"):
        metrics.TruePositives().update_state(torch.tensor([1.0]), torch.tensor([3.0]))


@pytest.mark.parametrize("name, kwargs, data, extra", [c for c in CASES if not c[3]], ids=[
    i for i, c in zip(IDS, CASES) if not c[3]])
def test_a_keras_metric_object_becomes_ours_with_its_settings(name, kwargs, data, extra):
    """compile(metrics=[keras.metrics.X(...)]) on a torch module: metrics.get gives ours of the same class
    and settings (before, the Keras object was taken for a function, a silent wrong value)."""
    del extra
    theirs = getattr(keras.metrics, name)(**kwargs, **({"dtype": "float32"} if "IoU" in name else {}))
    ours = metrics.get(theirs)
    assert type(ours) is getattr(metrics, name) and ours.name == theirs.name
    _update_twice(ours, *DATA[data], DATA["weights"])
    _update_twice(theirs, *DATA[data], DATA["weights"])
    close(ours.result(), theirs.result())


def test_a_keras_object_without_a_class_here_is_refused():
    with pytest.raises(TypeError, match="a Keras object that mr.metrics has no class for"):
        metrics.get(keras.metrics.MeanMetricWrapper(keras.metrics.mean_squared_error))
