"""Keras 3's confusion-count metrics: Precision, Recall, AUC, TruePositives, FalsePositives, TrueNegatives, FalseNegatives,
PrecisionAtRecall, RecallAtPrecision, SensitivityAtSpecificity, SpecificityAtSensitivity, F1Score
and FBetaScore.

Their state is weighted counts (per threshold, or per class), sync-on-read sums that add up across
replicas, so every result read in cross-replica context is the one-device result. As Precision and
Recall: Keras takes probabilities; pass from_logits=True for logits (a sigmoid first), which the
names given to metrics.get do. Loaded by metrics.py, which re-exports these names (import them
from there).
"""
from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from mirrored.training.losses import _broadcast_sample_weight
from mirrored.training.metrics import (
    _RESULT_DTYPE,
    _STATE_DTYPE,
    Metric,
    _check_threshold,
    _divide_no_nan,
    _probabilities,
    _same_shape,
    _tensors,
)

# Logits given where probabilities are expected show on the first batches; checking only the first
# updates keeps the per-step cost (a device sync) out of long runs.
_RANGE_CHECK_UPDATES = 10
_AUC_EPSILON = 1e-7  # the outer thresholds sit just outside [0, 1] so that 0 and 1 fall inside them
_EPSILON = 1e-7  # Keras's backend epsilon, in F-scores' denominators


# ---------------------------------------------------------------------------------------------
# Thresholded binary metrics: Precision, Recall, AUC.

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
# Confusion counts at thresholds, rates at a constraint, F-scores.

def _thresholds(cls: str, thresholds: float | Sequence[float] | None) -> list[float]:
    if thresholds is None:
        return [0.5]
    values = list(thresholds) if isinstance(thresholds, (list, tuple)) else [thresholds]
    if not values:
        raise ValueError(f"{cls}(thresholds=[]): give at least one threshold.")
    for t in values:
        _check_threshold(cls, "thresholds", t)
    return [float(t) for t in values]


class _ConditionCount(_Binary):
    """The weighted count of one cell of the confusion matrix at each of `thresholds` (prediction >
    threshold is positive); one number for one threshold, a vector for a list."""

    _cell: tuple[bool, bool]  # (predicted positive, actually positive)

    def __init__(self, thresholds: float | Sequence[float] | None = None, name: str | None = None,
                 from_logits: bool = False):
        values = _thresholds(type(self).__name__, thresholds)
        super().__init__(name or _snake(type(self).__name__), from_logits)
        self.thresholds = list(thresholds) if isinstance(thresholds, (list, tuple)) else thresholds
        self._values = torch.tensor(values, dtype=torch.float32)
        self.accumulator = self.add_state("accumulator", (len(values),))

    def update_state(self, y_true: Any, y_pred: Any, sample_weight: Any = None) -> None:
        """Adds the batch's weighted count at every threshold; y_true is positive where non-zero."""
        probs, positive, weights = self._flat_inputs(y_true, y_pred, sample_weight)
        predicted = probs[:, None] > self._values.to(probs.device)[None, :]
        want_predicted, want_positive = self._cell
        hit = (predicted if want_predicted else ~predicted) & (positive if want_positive else ~positive)[:, None]
        self.accumulator.assign_add((weights[:, None] * hit).sum(dim=0))

    def result(self) -> Tensor:
        """The count summed over replicas: a scalar for one threshold, else one per threshold."""
        counts = self.accumulator.read_value()
        return (counts[0] if counts.shape[0] == 1 else counts).to(_RESULT_DTYPE)

    def get_config(self) -> dict[str, Any]:
        """The constructor's arguments, as JSON (Keras's get_config); from_config(config) rebuilds it."""
        return {"thresholds": self.thresholds, "name": self.name, "from_logits": self.from_logits}


def _snake(name: str) -> str:
    return "".join(f"_{c.lower()}" if c.isupper() and i else c.lower() for i, c in enumerate(name))


class TruePositives(_ConditionCount):
    """Weighted count of positives predicted positive (keras.metrics.TruePositives)."""

    _cell = (True, True)


class FalsePositives(_ConditionCount):
    """Weighted count of negatives predicted positive (keras.metrics.FalsePositives)."""

    _cell = (True, False)


class TrueNegatives(_ConditionCount):
    """Weighted count of negatives predicted negative (keras.metrics.TrueNegatives)."""

    _cell = (False, False)


class FalseNegatives(_ConditionCount):
    """Weighted count of positives predicted negative (keras.metrics.FalseNegatives)."""

    _cell = (False, True)


class _AtThreshold(_Binary):
    """The best of one rate among the thresholds where another reaches `value`, from confusion counts at
    num_thresholds evenly spaced thresholds 0, 1/(n-1), ..., 1 (Keras's SensitivitySpecificityBase)."""

    _value_name: str

    def __init__(self, value: float, num_thresholds: int = 200, class_id: int | None = None,
                 name: str | None = None, from_logits: bool = False):
        cls = type(self).__name__
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= 1:
            raise ValueError(f"{cls}({self._value_name}={value!r}): must be a number in [0, 1].")
        if isinstance(num_thresholds, bool) or not isinstance(num_thresholds, int) or num_thresholds < 2:
            raise ValueError(f"{cls}(num_thresholds={num_thresholds!r}): must be an int >= 2.")
        super().__init__(name or _snake(cls), from_logits)
        self.value, self.num_thresholds, self.class_id = float(value), num_thresholds, class_id
        shape = (num_thresholds,)
        self.true_positives = self.add_state("true_positives", shape)
        self.false_positives = self.add_state("false_positives", shape)
        self.true_negatives = self.add_state("true_negatives", shape)
        self.false_negatives = self.add_state("false_negatives", shape)

    def update_state(self, y_true: Any, y_pred: Any, sample_weight: Any = None) -> None:
        """Adds the batch to the counts at every threshold, in one pass over the examples."""
        if self.class_id is not None:
            y_true, y_pred = _tensors(y_true, y_pred)
            y_true, y_pred = y_true[..., self.class_id], y_pred[..., self.class_id]
            if sample_weight is not None:
                sample_weight = torch.as_tensor(sample_weight).reshape(-1)
        probs, positive, weights = self._flat_inputs(y_true, y_pred, sample_weight)
        # Prediction i counts as positive at thresholds 0 .. above[i] - 1, p > j / (n - 1) holding exactly
        # for j < ceil(p * (n - 1)); a histogram of `above` and a suffix sum give every threshold's count
        # (Keras's bucketing, in float32 as Keras computes it). p = 0 is above no threshold, not even 0.
        n = self.num_thresholds
        above = torch.ceil(probs.clamp(0, 1) * (n - 1))
        above = torch.where(probs.isnan(), 0, above).long()
        pos_w, neg_w = weights * positive, weights * ~positive

        def predicted_positive(w: Tensor) -> Tensor:
            return torch.bincount(above, weights=w, minlength=n + 1).flip(0).cumsum(0).flip(0)[1:]

        tp, fp = predicted_positive(pos_w), predicted_positive(neg_w)
        self.true_positives.assign_add(tp)
        self.false_positives.assign_add(fp)
        self.false_negatives.assign_add(pos_w.sum() - tp)
        self.true_negatives.assign_add(neg_w.sum() - fp)

    def _rates(self) -> tuple[Tensor, Tensor, Tensor]:
        tp, fp = self.true_positives.read_value(), self.false_positives.read_value()
        tn, fn = self.true_negatives.read_value(), self.false_negatives.read_value()
        return _divide_no_nan(tp, tp + fn), _divide_no_nan(tn, tn + fp), _divide_no_nan(tp, tp + fp)

    @staticmethod
    def _best(constrained: Tensor, dependent: Tensor, value: float) -> Tensor:
        """The largest `dependent` among thresholds whose `constrained` >= value; 0 if none."""
        return torch.where(constrained >= value, dependent, torch.zeros_like(dependent)).amax().clamp(min=0) \
            .to(_RESULT_DTYPE)

    def get_config(self) -> dict[str, Any]:
        """The constructor's arguments, as JSON (Keras's get_config); from_config(config) rebuilds it."""
        return {self._value_name: self.value, "num_thresholds": self.num_thresholds, "class_id": self.class_id,
                "name": self.name, "from_logits": self.from_logits}


class SensitivityAtSpecificity(_AtThreshold):
    """The best sensitivity (recall) where specificity >= `specificity` (keras.metrics.SensitivityAtSpecificity)."""

    _value_name = "specificity"

    def __init__(self, specificity: float, num_thresholds: int = 200, class_id: int | None = None,
                 name: str | None = None, from_logits: bool = False):
        super().__init__(specificity, num_thresholds, class_id, name, from_logits)

    def result(self) -> Tensor:
        """The best rate under the constraint, from the counts summed over replicas; 0 where none meets it."""
        sensitivity, specificity, _ = self._rates()
        return self._best(specificity, sensitivity, self.value)


class SpecificityAtSensitivity(_AtThreshold):
    """The best specificity where sensitivity >= `sensitivity` (keras.metrics.SpecificityAtSensitivity)."""

    _value_name = "sensitivity"

    def __init__(self, sensitivity: float, num_thresholds: int = 200, class_id: int | None = None,
                 name: str | None = None, from_logits: bool = False):
        super().__init__(sensitivity, num_thresholds, class_id, name, from_logits)

    def result(self) -> Tensor:
        """The best rate under the constraint, from the counts summed over replicas; 0 where none meets it."""
        sensitivity, specificity, _ = self._rates()
        return self._best(sensitivity, specificity, self.value)


class PrecisionAtRecall(_AtThreshold):
    """The best precision where recall >= `recall` (keras.metrics.PrecisionAtRecall)."""

    _value_name = "recall"

    def __init__(self, recall: float, num_thresholds: int = 200, class_id: int | None = None,
                 name: str | None = None, from_logits: bool = False):
        super().__init__(recall, num_thresholds, class_id, name, from_logits)

    def result(self) -> Tensor:
        """The best rate under the constraint, from the counts summed over replicas; 0 where none meets it."""
        recall, _, precision = self._rates()
        return self._best(recall, precision, self.value)


class RecallAtPrecision(_AtThreshold):
    """The best recall where precision >= `precision` (keras.metrics.RecallAtPrecision)."""

    _value_name = "precision"

    def __init__(self, precision: float, num_thresholds: int = 200, class_id: int | None = None,
                 name: str | None = None, from_logits: bool = False):
        super().__init__(precision, num_thresholds, class_id, name, from_logits)

    def result(self) -> Tensor:
        """The best rate under the constraint, from the counts summed over replicas; 0 where none meets it."""
        recall, _, precision = self._rates()
        return self._best(precision, recall, self.value)


_AVERAGES = (None, "micro", "macro", "weighted")


class FBetaScore(Metric):
    """The F-beta score of (batch, classes) one-hot or multi-label targets (keras.metrics.FBetaScore):
    per class, or averaged "micro" / "macro" / "weighted". threshold=None marks each row's highest
    score positive; a threshold marks scores above it. Its per-class counts are made at the first
    update (their size is the number of classes): inside strategy.run every replica makes that first
    update together, as fit does."""

    def __init__(self, average: str | None = None, beta: float = 1.0, threshold: float | None = None,
                 name: str = "fbeta_score", from_logits: bool = False):
        cls = type(self).__name__
        if average not in _AVERAGES:
            raise ValueError(f"{cls}(average={average!r}): expected one of {list(_AVERAGES)}.")
        if isinstance(beta, bool) or not isinstance(beta, (int, float)) or not beta > 0:
            raise ValueError(f"{cls}(beta={beta!r}): must be a number > 0.")
        if threshold is not None:
            _check_threshold(cls, "threshold", threshold)
        super().__init__(name)
        self.average, self.beta, self.threshold, self.from_logits = average, float(beta), threshold, from_logits
        self._counts: tuple[Any, ...] | None = None
        self._build_lock = threading.Lock()

    def _build(self, classes: int) -> tuple[Any, ...]:
        # Made inside strategy.run, the variables meet in a merge_call that hands every replica the same
        # objects; the lock keeps one list of them.
        shape = () if self.average == "micro" else (classes,)
        made = tuple(self.add_state(n, shape, keep=False)
                     for n in ("true_positives", "false_positives", "false_negatives", "intermediate_weights"))
        with self._build_lock:
            if self._counts is None:
                self._counts = made
                self._state.extend(made)
        return self._counts

    def _state_pending(self) -> bool:
        """Whether the per-class counts are still to be made (by the first update, or _build_state)."""
        return self._counts is None

    def _build_state(self, y_true: Any, y_pred: Any) -> None:
        """Makes the per-class counts for batches shaped like y_pred, before any update: mr.Model does so
        in cross-replica context at its first step, where a replica's part may be empty."""
        del y_true
        if self._counts is None and getattr(y_pred, "ndim", 0) == 2:
            self._build(y_pred.shape[1])

    def _fits_saved_state(self, shapes: Sequence[tuple[int, ...]]) -> bool:
        """Whether a checkpoint's state of these shapes is this metric's, before its first update made it."""
        rank = 0 if self.average == "micro" else 1
        return self._counts is None and len(shapes) == 4 and len(set(shapes)) == 1 and len(shapes[0]) == rank

    def _build_saved_state(self, shapes: Sequence[tuple[int, ...]]) -> None:
        """Makes the state _fits_saved_state accepted, for a restore to fill."""
        self._build(shapes[0][0] if shapes[0] else 1)

    def update_state(self, y_true: Any, y_pred: Any, sample_weight: Any = None) -> None:
        """Adds the batch's weighted true positives, false positives, false negatives and label mass."""
        y_true, y_pred = _tensors(y_true, y_pred)
        if y_pred.ndim != 2 or y_true.shape != y_pred.shape:
            raise ValueError(f"{self.name}: y_true of shape {tuple(y_true.shape)} and y_pred of shape "
                             f"{tuple(y_pred.shape)}; expected both (batch, classes): one-hot or multi-label targets.")
        tp, fp, fn, mass = self._counts or self._build(y_pred.shape[1])
        probs = _probabilities(y_pred, self.from_logits)
        if self.threshold is None:
            predicted = (probs >= probs.amax(dim=-1, keepdim=True)) & (probs.abs() > 1e-9)
        else:
            predicted = probs > self.threshold
        predicted, y_true = predicted.to(_STATE_DTYPE), y_true.to(_STATE_DTYPE)
        weight = None if sample_weight is None else torch.as_tensor(
            sample_weight, device=y_true.device).detach().to(_STATE_DTYPE).reshape(-1, 1)
        dims = None if self.average == "micro" else 0

        def total(values: Tensor) -> Tensor:
            values = values if weight is None else values * weight
            return values.sum() if dims is None else values.sum(dim=dims)

        tp.assign_add(total(predicted * y_true))
        fp.assign_add(total(predicted * (1 - y_true)))
        fn.assign_add(total((1 - predicted) * y_true))
        mass.assign_add(total(y_true))

    def result(self) -> Tensor:
        """The score from the counts summed over replicas (per class when average is None)."""
        if self._counts is None:
            return torch.zeros((), dtype=_RESULT_DTYPE)
        tp, fp, fn, mass = (v.read_value() for v in self._counts)
        precision = tp / (tp + fp + _EPSILON)
        recall = tp / (tp + fn + _EPSILON)
        b2 = self.beta ** 2
        score = (1 + b2) * precision * recall / (b2 * precision + recall + _EPSILON)
        if self.average == "weighted":
            score = (score * mass / (mass.sum() + _EPSILON)).sum()
        elif self.average is not None:
            score = score.mean()
        return score.to(_RESULT_DTYPE)

    def get_config(self) -> dict[str, Any]:
        """The constructor's arguments, as JSON (Keras's get_config); from_config(config) rebuilds it."""
        return {"average": self.average, "beta": self.beta, "threshold": self.threshold, "name": self.name,
                "from_logits": self.from_logits}


class F1Score(FBetaScore):
    """The F1 score, FBetaScore with beta=1 (keras.metrics.F1Score)."""

    def __init__(self, average: str | None = None, threshold: float | None = None, name: str = "f1_score",
                 from_logits: bool = False):
        super().__init__(average, 1.0, threshold, name, from_logits)

    def get_config(self) -> dict[str, Any]:
        """The constructor's arguments, as JSON (Keras's get_config); from_config(config) rebuilds it."""
        config = super().get_config()
        del config["beta"]
        return config


CLASSES = (Precision, Recall, AUC, TruePositives, FalsePositives, TrueNegatives, FalseNegatives, PrecisionAtRecall, RecallAtPrecision,
           SensitivityAtSpecificity, SpecificityAtSensitivity, F1Score, FBetaScore)
