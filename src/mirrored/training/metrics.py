"""Keras-style stateful metrics whose state is sync-on-read under a strategy.

A metric accumulates with `update_state(y_true, y_pred, sample_weight=None)` (Mean and Sum take
`values`), reports `result()` and starts over with `reset_state()`; calling it does both. State lives
in `mirrored` Variables created with synchronization=ON_READ and aggregation=SUM, so inside
`with strategy.scope():` each replica accumulates into its own copy (on its own device) from
inside strategy.run, and `result()` in cross-replica context computes from the copies' sum. Counts
and sums are float64, so counts stay exact to 2**53 and one step's rounding does not drift a long
epoch's mean; results are float32. `get(identifier, loss_name=None)` resolves Keras names,
including "accuracy", whose meaning depends on the loss. Metrics have Keras's get_config() /
from_config() (settings, not state); serialize()/deserialize() turn one into JSON and back, from
this module's classes only.

Uses torch, the public names of mirrored.distribute (Variable and its enums) and _config.py.
"""
from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import Tensor

from mirrored.distribute import Variable, VariableAggregation, VariableSynchronization
from mirrored.training import _config
from mirrored.training.losses import _broadcast_sample_weight

__all__ = [
    "AUC",
    "Accuracy",
    "BinaryAccuracy",
    "CategoricalAccuracy",
    "Mean",
    "MeanMetricWrapper",
    "Metric",
    "Precision",
    "Recall",
    "SparseCategoricalAccuracy",
    "SparseTopKCategoricalAccuracy",
    "Sum",
    "accuracy",
    "binary_accuracy",
    "categorical_accuracy",
    "deserialize",
    "get",
    "serialize",
    "sparse_categorical_accuracy",
    "sparse_top_k_categorical_accuracy",
]

_STATE_DTYPE = torch.float64  # exact counts up to 2**53; sums that do not drift over an epoch
_RESULT_DTYPE = torch.float32
# Logits given where probabilities are expected show on the first batches; checking only the first
# updates keeps the per-step cost (a device sync) out of long runs.
_RANGE_CHECK_UPDATES = 10
_AUC_EPSILON = 1e-7  # the outer thresholds sit just outside [0, 1] so that 0 and 1 fall inside them


class Metric:
    """Base class: state Variables made by `add_state`; subclasses implement update_state and result."""

    def __init__(self, name: str):
        if not isinstance(name, str) or not name:
            raise ValueError(f"{type(self).__name__}(name={name!r}): name must be a non-empty str.")
        self.name = name
        self._state: list[Variable] = []

    def add_state(self, name: str, shape: tuple[int, ...] = ()) -> Variable:
        """A float64 zero-filled Variable, one copy per replica in a strategy's scope, summed on read."""
        var = Variable(
            torch.zeros(shape, dtype=_STATE_DTYPE),
            trainable=False,
            name=f"{self.name}/{name}",
            synchronization=VariableSynchronization.ON_READ,
            aggregation=VariableAggregation.SUM,
        )
        self._state.append(var)
        return var

    @property
    def variables(self) -> list[Variable]:
        """The state Variables `add_state` made, in order (Keras's `variables`): what a checkpoint saves."""
        return list(self._state)

    def update_state(self, *args: Any, **kwargs: Any) -> None:
        """Accumulates one batch into the state; subclasses define the arguments (Keras's `update_state`).
        In a replica it updates that replica's copies, which `result` sums."""
        raise NotImplementedError

    def result(self) -> Tensor:
        """The metric over everything seen since the last `reset_state`, a float32 scalar (or tensor)
        computed from the state summed over replicas."""
        raise NotImplementedError

    def reset_state(self) -> None:
        """Zeroes the state (every replica's copy, when called in cross-replica context)."""
        for var in self._state:
            var.assign(torch.zeros(var.shape, dtype=var.dtype))

    def __call__(self, *args: Any, **kwargs: Any) -> Tensor:
        """update_state(*args, **kwargs), then result()."""
        self.update_state(*args, **kwargs)
        return self.result()

    def get_config(self) -> dict[str, Any]:
        """The constructor's arguments, as JSON (Keras's get_config); not the state."""
        return {"name": self.name}

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> Metric:
        """A new metric from `get_config()`'s dict (Keras's `from_config`): same settings, fresh state."""
        return cls(**config)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r})"


def _divide_no_nan(num: Tensor, den: Tensor) -> Tensor:
    """num / den, and 0 where den == 0 (tf.math.divide_no_nan); no device sync."""
    safe = torch.where(den == 0, torch.ones_like(den), den)
    return torch.where(den == 0, torch.zeros_like(num), num / safe)


def _values_and_weights(values: Any, sample_weight: Any, what: str) -> tuple[Tensor, Tensor | None]:
    values = torch.as_tensor(values).detach()
    values = values.to(_STATE_DTYPE)
    if sample_weight is None:
        return values, None
    return values, _broadcast_sample_weight(torch.as_tensor(sample_weight).detach(), values, what)


class Mean(Metric):
    """The (weighted) mean over samples: each sample's values (a sequence's steps, a multi-label row)
    are averaged first, then sum(w * sample) / sum(w), as Keras 3's reduce_to_samplewise_values does:
    a sample counts once however many values it has, so batches of different lengths weigh by samples."""

    def __init__(self, name: str = "mean"):
        super().__init__(name)
        self.total = self.add_state("total")
        self.count = self.add_state("count")

    def update_state(self, values: Any, sample_weight: Any = None) -> None:
        """Adds a batch of `values`: each sample's values are averaged first, then weighted by
        `sample_weight` (broadcast to `values`), so a sample counts once however many values it has."""
        values = torch.as_tensor(values).detach().to(_STATE_DTYPE)
        if sample_weight is None:
            samples = values.mean(dim=tuple(range(1, values.dim()))) if values.dim() > 1 else values
            self.total.assign_add(samples.sum())
            self.count.assign_add(samples.shape[0] if samples.dim() else 1)
            return
        weights = torch.as_tensor(sample_weight, device=values.device).detach().to(_STATE_DTYPE)
        values, weights = _same_rank(values, weights)
        if values.dim() > weights.dim():  # values beyond the weights' dims are averaged first
            values = values.mean(dim=tuple(range(weights.dim(), values.dim())))
        weights = _broadcast_sample_weight(weights, values, self.name)
        values = values * weights
        if weights.dim() > 1:
            weights = weights.mean(dim=tuple(range(1, weights.dim())))
        if values.dim() > 1:
            values = values.mean(dim=tuple(range(1, values.dim())))
        self.total.assign_add(values.sum())
        self.count.assign_add(weights.sum())

    def result(self) -> Tensor:
        """sum(weight * sample) / sum(weight) over every sample seen, summed over replicas; 0 before any."""
        return _divide_no_nan(self.total.read_value(), self.count.read_value()).to(_RESULT_DTYPE)


def _same_rank(values: Tensor, weights: Tensor) -> tuple[Tensor, Tensor]:
    """Keras's squeeze_or_expand_to_same_rank: a trailing axis of 1 on the one of higher rank is
    dropped, or, where the other is 1-D, a matching axis of 1 is added to that one."""
    if values.dim() == weights.dim() + 1 and values.shape[-1] == 1:
        return (values, weights.unsqueeze(-1)) if weights.dim() == 1 else (values.squeeze(-1), weights)
    if weights.dim() == values.dim() + 1 and weights.shape[-1] == 1:
        return (values.unsqueeze(-1), weights) if values.dim() == 1 else (values, weights.squeeze(-1))
    return values, weights


class Sum(Metric):
    """The (weighted) sum of all values seen."""

    def __init__(self, name: str = "sum"):
        super().__init__(name)
        self.total = self.add_state("total")

    def update_state(self, values: Any, sample_weight: Any = None) -> None:
        """Adds sum(values), or sum(values * sample_weight) with `sample_weight` broadcast to `values`."""
        values, weights = _values_and_weights(values, sample_weight, self.name)
        self.total.assign_add(values.sum() if weights is None else (values * weights).sum())

    def result(self) -> Tensor:
        """The total over every update and replica since the last `reset_state`, as float32."""
        return self.total.read_value().to(_RESULT_DTYPE)


class MeanMetricWrapper(Mean):
    """The mean of fn(y_true, y_pred, **kwargs) over all examples seen (fn gives one value per example)."""

    def __init__(self, fn: Callable[..., Tensor], name: str | None = None, **kwargs: Any):
        super().__init__(name or getattr(fn, "__name__", type(fn).__name__))
        self._fn = fn
        self._fn_kwargs = kwargs

    def update_state(self, y_true: Any, y_pred: Any, sample_weight: Any = None) -> None:
        """Adds fn(y_true, y_pred, **kwargs), one value per example, to the mean, weighted by
        `sample_weight`."""
        super().update_state(self._fn(y_true, y_pred, **self._fn_kwargs), sample_weight)

    def get_config(self) -> dict[str, Any]:
        """Only for this module's functions, rebuilt by name; another function has no config."""
        if type(self) is not MeanMetricWrapper:  # the named wrappers take their settings, not a function
            return {"name": self.name, **self._fn_kwargs}
        name = getattr(self._fn, "__name__", None)
        if _METRIC_FUNCTIONS.get(name) is not self._fn:
            raise NotImplementedError(f"metric {self.name!r} wraps {self._fn!r}, which is not one of mr.metrics' "
                                      "functions, so no config can rebuild it.")
        return {"fn": name, "name": self.name, **self._fn_kwargs}

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> Metric:
        """Rebuilds a wrapper from `get_config()`: the function by its name among mr.metrics'
        functions (an unknown name is a ValueError); a named subclass from its settings."""
        if cls is not MeanMetricWrapper:
            return cls(**config)
        config = dict(config)
        name = config.pop("fn", None)
        if name not in _METRIC_FUNCTIONS:
            raise ValueError(f"MeanMetricWrapper config: fn={name!r} is not one of {', '.join(_METRIC_FUNCTIONS)}.")
        return cls(_METRIC_FUNCTIONS[name], **config)

    def __repr__(self) -> str:
        args = "".join(f", {k}={v!r}" for k, v in self._fn_kwargs.items())
        return f"{type(self).__name__}(name={self.name!r}{args})"


# ---------------------------------------------------------------------------------------------
# Per-example functions. Each returns 1.0 for a hit and 0.0 for a miss.

def _tensors(y_true: Any, y_pred: Any) -> tuple[Tensor, Tensor]:
    if not isinstance(y_pred, Tensor):
        y_pred = torch.as_tensor(y_pred)
    y_pred = y_pred.detach()
    return torch.as_tensor(y_true, device=y_pred.device).detach(), y_pred


def _same_shape(what: str, y_true: Tensor, y_pred: Tensor) -> tuple[Tensor, Tensor]:
    """Equal shapes, allowing (B,) against (B, 1) as Keras does, never a silent (B, B) broadcast."""
    if y_true.ndim == y_pred.ndim + 1 and y_true.shape[-1] == 1:
        y_true = y_true.squeeze(-1)
    elif y_pred.ndim == y_true.ndim + 1 and y_pred.shape[-1] == 1:
        y_pred = y_pred.squeeze(-1)
    if y_true.shape != y_pred.shape:
        raise ValueError(f"{what}: y_true has shape {tuple(y_true.shape)} but y_pred has shape "
                         f"{tuple(y_pred.shape)}; they must match (a trailing dim of 1 is allowed).")
    return y_true, y_pred


def _class_ids(what: str, y_true: Tensor, y_pred: Tensor) -> Tensor:
    """Labels of shape y_pred.shape[:-1] (a trailing 1 is allowed) for scores on the last axis."""
    if y_true.ndim == y_pred.ndim and y_true.shape[-1] == 1:
        y_true = y_true.squeeze(-1)
    if y_true.shape != y_pred.shape[:-1]:
        raise ValueError(f"{what}: labels of shape {tuple(y_true.shape)} do not fit predictions of shape "
                         f"{tuple(y_pred.shape)}: expected one class id per example, shape {tuple(y_pred.shape[:-1])}.")
    return y_true


def accuracy(y_true: Any, y_pred: Any) -> Tensor:
    """1.0 where y_true == y_pred (e.g. predicted class ids against labels)."""
    y_true, y_pred = _same_shape("accuracy", *_tensors(y_true, y_pred))
    return (y_true == y_pred).to(_STATE_DTYPE)


def sparse_categorical_accuracy(y_true: Any, y_pred: Any) -> Tensor:
    """1.0 where the class with the highest score (first on ties) equals the integer label."""
    y_true, y_pred = _tensors(y_true, y_pred)
    y_true = _class_ids("sparse_categorical_accuracy", y_true, y_pred)
    predicted = _argmax(y_pred)
    if y_true.is_floating_point():  # Keras compares float labels as floats: 2.0 hits, 1.7 never does
        return (predicted.to(y_true.dtype) == y_true).to(_STATE_DTYPE)
    return (predicted == y_true).to(_STATE_DTYPE)


def categorical_accuracy(y_true: Any, y_pred: Any) -> Tensor:
    """1.0 where the highest score and the largest one-hot label entry are at the same class."""
    y_true, y_pred = _tensors(y_true, y_pred)
    if y_true.shape != y_pred.shape:
        raise ValueError(f"categorical_accuracy: y_true has shape {tuple(y_true.shape)} but y_pred has shape "
                         f"{tuple(y_pred.shape)}; one-hot labels must match (integer labels need "
                         "sparse_categorical_accuracy).")
    return (y_true.argmax(dim=-1) == _argmax(y_pred)).to(_STATE_DTYPE)


def _argmax(y_pred: Tensor) -> Tensor:
    """The class of the highest score, NaN scores skipped as TF's argmax skips them (torch's picks a
    NaN): Keras counts [0.1, nan, 0.5] with label 2 as a hit."""
    if y_pred.is_floating_point():
        y_pred = torch.where(y_pred.isnan(), float("-inf"), y_pred)
    return y_pred.argmax(dim=-1)


def _probabilities(y_pred: Tensor, from_logits: bool) -> Tensor:
    """float32, as Keras compares predictions with thresholds: a float32 0.3 is not above the threshold
    0.3 there, where in float64 it is (0.3f is 0.30000001...)."""
    y_pred = y_pred.float()
    return torch.sigmoid(y_pred) if from_logits else y_pred


def binary_accuracy(y_true: Any, y_pred: Any, threshold: float = 0.5, from_logits: bool = False) -> Tensor:
    """1.0 where (prediction > threshold) equals the 0/1 label; from_logits applies a sigmoid first."""
    y_true, y_pred = _same_shape("binary_accuracy", *_tensors(y_true, y_pred))
    predicted = (_probabilities(y_pred, from_logits) > threshold).to(_STATE_DTYPE)
    return (predicted == y_true.to(_STATE_DTYPE)).to(_STATE_DTYPE)


def sparse_top_k_categorical_accuracy(y_true: Any, y_pred: Any, k: int = 5) -> Tensor:
    """1.0 where the label's score is among the k highest. As tf.math.in_top_k, classes tied with the
    k-th score all count as in the top k; a non-finite label score or a label outside the classes misses."""
    y_true, y_pred = _tensors(y_true, y_pred)
    y_true = _class_ids("sparse_top_k_categorical_accuracy", y_true, y_pred).long()
    num_classes = y_pred.shape[-1]
    valid = (y_true >= 0) & (y_true < num_classes)
    index = y_true.clamp(0, max(num_classes - 1, 0)).unsqueeze(-1)
    label_score = y_pred.gather(-1, index)
    higher = (y_pred > label_score).sum(dim=-1)
    hit = (higher < k) & valid & torch.isfinite(label_score.squeeze(-1))
    return hit.to(_STATE_DTYPE)


def _accuracy_by_shape(y_true: Any, y_pred: Any, from_logits: bool = True) -> Tensor:
    """Keras 3's reading of "accuracy" from shapes: one score per example is binary, integer labels
    (one dim fewer, or a trailing 1) are sparse, else one-hot."""
    y_true, y_pred = _tensors(y_true, y_pred)
    if y_pred.ndim <= 1 or y_pred.shape[-1] == 1:
        return binary_accuracy(y_true, y_pred, from_logits=from_logits)
    if y_true.ndim == y_pred.ndim - 1 or (y_true.ndim == y_pred.ndim and y_true.shape[-1] == 1):
        return sparse_categorical_accuracy(y_true, y_pred)
    return categorical_accuracy(y_true, y_pred)


class Accuracy(MeanMetricWrapper):
    """How often y_pred equals y_true (predictions already turned into labels)."""

    def __init__(self, name: str = "accuracy"):
        super().__init__(accuracy, name)


class SparseCategoricalAccuracy(MeanMetricWrapper):
    """How often the argmax of the scores (logits or probabilities) equals the integer label."""

    def __init__(self, name: str = "sparse_categorical_accuracy"):
        super().__init__(sparse_categorical_accuracy, name)


class CategoricalAccuracy(MeanMetricWrapper):
    """How often the argmax of the scores equals the argmax of the one-hot label."""

    def __init__(self, name: str = "categorical_accuracy"):
        super().__init__(categorical_accuracy, name)


class BinaryAccuracy(MeanMetricWrapper):
    """How often (prediction > threshold) equals the 0/1 label. Keras takes probabilities; for our
    logit models pass from_logits=True (a sigmoid first: logit > 0 at the default threshold)."""

    def __init__(self, name: str = "binary_accuracy", threshold: float = 0.5, from_logits: bool = False):
        _check_threshold(type(self).__name__, "threshold", threshold)
        super().__init__(binary_accuracy, name, threshold=threshold, from_logits=from_logits)


class SparseTopKCategoricalAccuracy(MeanMetricWrapper):
    """How often the integer label is among the k highest scores."""

    def __init__(self, k: int = 5, name: str = "sparse_top_k_categorical_accuracy"):
        if isinstance(k, bool) or not isinstance(k, int) or k < 1:
            raise ValueError(f"SparseTopKCategoricalAccuracy(k={k!r}): k must be a positive int.")
        super().__init__(sparse_top_k_categorical_accuracy, name, k=k)


def _check_threshold(cls: str, arg: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= 1:
        raise ValueError(f"{cls}({arg}={value!r}): expected one number in [0, 1] (a probability threshold; "
                         "with from_logits=True it applies after the sigmoid).")


# ---------------------------------------------------------------------------------------------
# Thresholded binary metrics.

class _Binary(Metric):
    """Shared input handling of Precision, Recall and AUC: flattened probabilities (a sigmoid of logits
    when from_logits=True), boolean labels (non-zero is positive) and per-element weights."""

    def __init__(self, name: str, from_logits: bool):
        super().__init__(name)
        self.from_logits = from_logits
        self._range_checks_left = 0 if from_logits else _RANGE_CHECK_UPDATES

    def _flat_inputs(self, y_true: Any, y_pred: Any, sample_weight: Any) -> tuple[Tensor, Tensor, Tensor]:
        y_true, y_pred = _same_shape(self.name, *_tensors(y_true, y_pred))
        if self._range_checks_left > 0 and y_pred.numel():
            self._range_checks_left -= 1
            lo, hi = torch.stack(torch.aminmax(y_pred.to(_STATE_DTYPE))).tolist()
            if lo < 0 or hi > 1:
                raise ValueError(
                    f"{self.name}: predictions range over [{lo:.4g}, {hi:.4g}], outside [0, 1], so they are not "
                    f"probabilities. Our models return logits: pass {type(self).__name__}(from_logits=True)."
                )
        probs = _probabilities(y_pred, self.from_logits).reshape(-1)
        positive = (y_true != 0).reshape(-1)
        if sample_weight is None:
            weights = torch.ones_like(probs, dtype=_STATE_DTYPE)  # counts summed exactly
        else:
            weights = _broadcast_sample_weight(torch.as_tensor(sample_weight).detach(), y_pred.to(_STATE_DTYPE),
                                               self.name).reshape(-1)
        return probs, positive, weights


class Precision(_Binary):
    """True positives / predicted positives, where "predicted positive" is probability > thresholds.

    Keras takes probabilities; our models return logits, so pass from_logits=True for them. One
    threshold only (Keras also takes a list)."""

    def __init__(self, thresholds: float = 0.5, name: str = "precision", from_logits: bool = False):
        _check_threshold("Precision", "thresholds", thresholds)
        super().__init__(name, from_logits)
        self.thresholds = float(thresholds)
        self.true_positives = self.add_state("true_positives")
        self.false_positives = self.add_state("false_positives")

    def update_state(self, y_true: Any, y_pred: Any, sample_weight: Any = None) -> None:
        """Counts the batch's true and false positives (probability > thresholds), weighted by
        `sample_weight`; y_true is positive where non-zero."""
        probs, positive, weights = self._flat_inputs(y_true, y_pred, sample_weight)
        predicted = probs > self.thresholds
        self.true_positives.assign_add((weights * (predicted & positive)).sum())
        self.false_positives.assign_add((weights * (predicted & ~positive)).sum())

    def get_config(self) -> dict[str, Any]:
        """The constructor's arguments (thresholds, name, from_logits), as JSON; not the counts."""
        return {"thresholds": self.thresholds, "name": self.name, "from_logits": self.from_logits}

    def result(self) -> Tensor:
        """true positives / (true + false positives) over all replicas, 0 when nothing was predicted positive."""
        tp = self.true_positives.read_value()
        return _divide_no_nan(tp, tp + self.false_positives.read_value()).to(_RESULT_DTYPE)


class Recall(_Binary):
    """True positives / actual positives, where "predicted positive" is probability > thresholds.

    Keras takes probabilities; our models return logits, so pass from_logits=True for them."""

    def __init__(self, thresholds: float = 0.5, name: str = "recall", from_logits: bool = False):
        _check_threshold("Recall", "thresholds", thresholds)
        super().__init__(name, from_logits)
        self.thresholds = float(thresholds)
        self.true_positives = self.add_state("true_positives")
        self.false_negatives = self.add_state("false_negatives")

    def update_state(self, y_true: Any, y_pred: Any, sample_weight: Any = None) -> None:
        """Counts the batch's true positives and false negatives (probability > thresholds is predicted
        positive), weighted by `sample_weight`; y_true is positive where non-zero."""
        probs, positive, weights = self._flat_inputs(y_true, y_pred, sample_weight)
        predicted = probs > self.thresholds
        self.true_positives.assign_add((weights * (predicted & positive)).sum())
        self.false_negatives.assign_add((weights * (~predicted & positive)).sum())

    def get_config(self) -> dict[str, Any]:
        """The constructor's arguments (thresholds, name, from_logits), as JSON; not the counts."""
        return {"thresholds": self.thresholds, "name": self.name, "from_logits": self.from_logits}

    def result(self) -> Tensor:
        """true positives / (true positives + false negatives) over all replicas, 0 when no example was positive."""
        tp = self.true_positives.read_value()
        return _divide_no_nan(tp, tp + self.false_negatives.read_value()).to(_RESULT_DTYPE)


_CURVES = ("ROC", "PR")
_SUMMATION_METHODS = ("interpolation", "minoring", "majoring")


class AUC(_Binary):
    """Area under the ROC or precision-recall curve of a binary classifier, approximated from
    confusion matrices at `num_thresholds` evenly spaced thresholds (Keras's method).

    The thresholds are i / (num_thresholds - 1) for the inner ones, plus -1e-7 and 1 + 1e-7 so the
    curve reaches both corners. summation_method="interpolation" is the trapezoid rule for ROC and,
    for PR, the interpolation of Davis & Goadrich (2006): precision along a segment follows the
    straight line between its end points in (true positives, false positives) space. "minoring" and
    "majoring" take the lower and upper end of each segment. Keras takes probabilities; pass
    from_logits=True for logits."""

    def __init__(self, num_thresholds: int = 200, curve: str = "ROC", summation_method: str = "interpolation",
                 name: str = "auc", from_logits: bool = False):
        if isinstance(num_thresholds, bool) or not isinstance(num_thresholds, int) or num_thresholds < 2:
            raise ValueError(f"AUC(num_thresholds={num_thresholds!r}): must be an int >= 2.")
        if not isinstance(curve, str) or curve.upper() not in _CURVES:
            raise ValueError(f"AUC(curve={curve!r}): expected one of {list(_CURVES)}.")
        if summation_method not in _SUMMATION_METHODS:
            raise ValueError(f"AUC(summation_method={summation_method!r}): expected one of {list(_SUMMATION_METHODS)}.")
        super().__init__(name, from_logits)
        self.num_thresholds = num_thresholds
        self.curve = curve.upper()
        self.summation_method = summation_method
        inner = [i / (num_thresholds - 1) for i in range(1, num_thresholds - 1)]
        self.thresholds = torch.tensor([-_AUC_EPSILON, *inner, 1 + _AUC_EPSILON], dtype=torch.float32)
        shape = (num_thresholds,)
        self.true_positives = self.add_state("true_positives", shape)
        self.false_positives = self.add_state("false_positives", shape)
        self.true_negatives = self.add_state("true_negatives", shape)
        self.false_negatives = self.add_state("false_negatives", shape)

    def update_state(self, y_true: Any, y_pred: Any, sample_weight: Any = None) -> None:
        """Adds the batch to the confusion matrices at every threshold (weighted by `sample_weight`), in one
        pass over the examples rather than one per threshold."""
        probs, positive, weights = self._flat_inputs(y_true, y_pred, sample_weight)
        # above[i] = how many thresholds prediction i exceeds, so it counts as positive at thresholds
        # 0 .. above[i] - 1. A histogram of `above` and a suffix sum give every threshold's count in
        # O(examples + thresholds) instead of comparing every prediction with every threshold. With the
        # thresholds evenly spaced, it is Keras's bucket, computed as Keras does in float32:
        # ceil(p * (n - 1)) for p clipped to [0, 1], at least 1 (every p is above -1e-7).
        above = torch.ceil(probs.clamp(0, 1) * (self.num_thresholds - 1)).clamp(min=1)
        above = torch.where(probs.isnan(), 0, above).long()  # NaN > t is false: a NaN counts as negative
        n = self.num_thresholds
        pos_w = weights * positive
        neg_w = weights * ~positive

        def predicted_positive(w: Tensor) -> Tensor:
            hist = torch.bincount(above, weights=w, minlength=n + 1)
            return hist.flip(0).cumsum(0).flip(0)[1:]  # [t] = weight with above > t

        tp, fp = predicted_positive(pos_w), predicted_positive(neg_w)
        self.true_positives.assign_add(tp)
        self.false_positives.assign_add(fp)
        self.false_negatives.assign_add(pos_w.sum() - tp)
        self.true_negatives.assign_add(neg_w.sum() - fp)

    def result(self) -> Tensor:
        """The area under the ROC or PR curve of the counts so far (all replicas), by `summation_method`."""
        tp, fp = self.true_positives.read_value(), self.false_positives.read_value()
        tn, fn = self.true_negatives.read_value(), self.false_negatives.read_value()
        if self.curve == "PR" and self.summation_method == "interpolation":
            return _pr_auc_interpolated(tp, fp, fn).to(_RESULT_DTYPE)
        if self.curve == "ROC":
            x, y = _divide_no_nan(fp, fp + tn), _divide_no_nan(tp, tp + fn)  # FPR, TPR
        else:
            x, y = _divide_no_nan(tp, tp + fn), _divide_no_nan(tp, tp + fp)  # recall, precision
        # Thresholds rise along the index, so x falls: the widths are x[t] - x[t + 1].
        widths = x[:-1] - x[1:]
        if self.summation_method == "interpolation":
            heights = (y[:-1] + y[1:]) / 2
        elif self.summation_method == "minoring":
            heights = torch.minimum(y[:-1], y[1:])
        else:
            heights = torch.maximum(y[:-1], y[1:])
        return (widths * heights).sum().to(_RESULT_DTYPE)

    def get_config(self) -> dict[str, Any]:
        """The constructor's arguments (num_thresholds, curve, summation_method, name, from_logits), as JSON."""
        return {"num_thresholds": self.num_thresholds, "curve": self.curve, "summation_method": self.summation_method,
                "name": self.name, "from_logits": self.from_logits}

    def __repr__(self) -> str:
        return (f"AUC(num_thresholds={self.num_thresholds}, curve={self.curve!r}, summation_method="
                f"{self.summation_method!r}, name={self.name!r}, from_logits={self.from_logits})")


def _pr_auc_interpolated(tp: Tensor, fp: Tensor, fn: Tensor) -> Tensor:
    """Area under the PR curve, with precision interpolated as Davis & Goadrich (2006) do.

    Between thresholds t and t+1, true positives grow linearly with predicted positives p = tp + fp:
    tp(p) = slope * p + intercept. Recall is tp / P, so d(recall) = slope * dp / P and the segment's
    area is the integral of (slope + intercept / p) * slope / P over p, which is
    slope * (dtp + intercept * ln(p_t / p_t+1)) / P."""
    predicted = tp + fp
    dtp = tp[:-1] - tp[1:]
    dp = predicted[:-1] - predicted[1:]
    slope = _divide_no_nan(dtp, dp)
    intercept = tp[1:] - slope * predicted[1:]
    both_positive = (predicted[:-1] > 0) & (predicted[1:] > 0)
    # Where p_t+1 is 0, tp_t+1 and so the intercept are 0: the log term vanishes (ratio 1).
    ratio = torch.where(both_positive, predicted[:-1] / torch.where(both_positive, predicted[1:], 1.0), 1.0)
    area = slope * (dtp + intercept * torch.log(ratio))
    positives = tp[1:] + fn[1:]
    return _divide_no_nan(area, positives).sum()


# ---------------------------------------------------------------------------------------------
# Registry.

_METRICS: dict[str, Callable[..., Metric]] = {
    "accuracy": Accuracy,  # resolved by get() from the loss or the shapes; see _ACCURACY_FOR_LOSS
    "acc": Accuracy,
    "sparse_categorical_accuracy": SparseCategoricalAccuracy,
    "categorical_accuracy": CategoricalAccuracy,
    "binary_accuracy": BinaryAccuracy,
    "sparse_top_k_categorical_accuracy": SparseTopKCategoricalAccuracy,
    "precision": Precision,
    "recall": Recall,
    "auc": AUC,
    "mean": Mean,
    "sum": Sum,
}

# "accuracy" follows the loss, as in Keras: with sparse crossentropy it is sparse_categorical_accuracy.
# Keys are loss names (losses.get(...).name); the torch ones are losses.TorchLossWrapper's names.
# A binary loss from logits thresholds the sigmoid; nn.CrossEntropyLoss is assumed to get class ids.
_ACCURACY_FOR_LOSS: dict[str, Callable[[str, bool], Metric]] = {
    "sparse_categorical_crossentropy": lambda name, logits: SparseCategoricalAccuracy(name),
    "categorical_crossentropy": lambda name, logits: CategoricalAccuracy(name),
    "binary_crossentropy": lambda name, logits: BinaryAccuracy(name, from_logits=logits),
    "cross_entropy_loss": lambda name, logits: SparseCategoricalAccuracy(name),
    "nll_loss": lambda name, logits: SparseCategoricalAccuracy(name),
    "bce_with_logits_loss": lambda name, logits: BinaryAccuracy(name, from_logits=True),
    "bce_loss": lambda name, logits: BinaryAccuracy(name, from_logits=False),
}


# Made from a name, these threshold sigmoid(logits) by default, since our models return logits.
_TAKE_FROM_LOGITS = ("binary_accuracy", "precision", "recall", "auc")

_METRIC_CLASSES: dict[str, type[Metric]] = {cls.__name__: cls for cls in (
    Accuracy, SparseCategoricalAccuracy, CategoricalAccuracy, BinaryAccuracy, SparseTopKCategoricalAccuracy,
    Precision, Recall, AUC, Mean, Sum, MeanMetricWrapper)}
_METRIC_FUNCTIONS: dict[str, Callable[..., Tensor]] = {fn.__name__: fn for fn in (
    accuracy, sparse_categorical_accuracy, categorical_accuracy, binary_accuracy, sparse_top_k_categorical_accuracy,
    _accuracy_by_shape)}


def serialize(metric: Metric) -> dict[str, Any] | None:
    """{"class_name": ..., "config": ...} (JSON), or None for a metric no config can rebuild (a subclass of
    yours, a function of your own)."""
    return _config.to_config(metric, _METRIC_CLASSES)


def deserialize(config: Mapping[str, Any]) -> Metric:
    """The metric serialize() described, rebuilt from this module's classes by name (its state starts empty)."""
    return _config.from_config(config, _METRIC_CLASSES, "metric")


def get(identifier: str | Metric | Callable[..., Tensor], loss_name: str | None = None,
        from_logits: bool = True) -> Metric:
    """A metric from a name in _METRICS (named after the string, as Keras does), a Metric (returned as
    is) or a function fn(y_true, y_pred) -> per-example values (averaged by MeanMetricWrapper).

    "accuracy"/"acc" follow the loss named `loss_name` (Keras's rule): sparse crossentropy gives
    SparseCategoricalAccuracy, categorical crossentropy CategoricalAccuracy, binary crossentropy
    BinaryAccuracy (on sigmoid(logits) when from_logits). For any other loss they follow the shapes of
    each batch: one score per example is binary, integer labels are sparse, otherwise categorical.
    from_logits also goes to "binary_accuracy", "precision", "recall" and "auc": the names mean
    from_logits=True, as the loss names do.
    """
    if isinstance(identifier, Metric):
        return identifier
    if isinstance(identifier, str):
        key = identifier.lower()
        if key in ("accuracy", "acc"):
            if loss_name is not None and loss_name.lower() in _ACCURACY_FOR_LOSS:
                return _ACCURACY_FOR_LOSS[loss_name.lower()](identifier, from_logits)
            return MeanMetricWrapper(_accuracy_by_shape, identifier, from_logits=from_logits)
        if key not in _METRICS:
            raise ValueError(f"unknown metric {identifier!r}. Known names: {', '.join(_METRICS)}; or pass a "
                             "Metric object or a function(y_true, y_pred) returning one value per example.")
        if key in _TAKE_FROM_LOGITS:
            return _METRICS[key](name=identifier, from_logits=from_logits)
        return _METRICS[key](name=identifier)
    if isinstance(identifier, type) and issubclass(identifier, Metric):
        return identifier()
    if isinstance(identifier, Mapping):
        return deserialize(identifier)
    if callable(identifier):
        return MeanMetricWrapper(identifier)
    raise TypeError(f"metrics.get: cannot make a metric from {identifier!r} ({type(identifier).__name__}). "
                    f"Pass one of {', '.join(_METRICS)}, a Metric, or a function(y_true, y_pred).")

