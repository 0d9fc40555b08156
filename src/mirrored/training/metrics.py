"""Keras-style stateful metrics whose state is sync-on-read under a strategy.

A metric accumulates with `update_state(y_true, y_pred, sample_weight=None)` (Mean and Sum take
`values`), reports `result()` and starts over with `reset_state()`; calling it does both. State lives
in `mirrored` Variables created with synchronization=ON_READ and aggregation=SUM, so inside
`with strategy.scope():` each replica accumulates into its own copy (on its own device) from
inside strategy.run, and `result()` in cross-replica context computes from the copies' sum. Counts
and sums are float64, so counts stay exact to 2**53 and one step's rounding does not drift a long
epoch's mean; results are float32. `get(identifier, loss_name=None)` resolves Keras names
(snake_case class names and aliases such as "mse", "mae", "bce"), including "accuracy", whose
meaning depends on the loss. Metrics have Keras's get_config() /
from_config() (settings, not state); serialize()/deserialize() turn one into JSON and back, from
this module's classes only.

Keras 3's other metrics live in families beside this module, re-exported here:
_regression_metrics.py (MeanSquaredError, RootMeanSquaredError, R2Score, correlations, ...),
_probabilistic_metrics.py (crossentropies, KLDivergence, hinges, TopKCategoricalAccuracy),
_confusion_metrics.py (Precision, Recall, AUC, TruePositives, ..., PrecisionAtRecall, ..., F1Score) and
_iou_metrics.py (IoU, MeanIoU, BinaryIoU, OneHot*). All are built on Metric above and tested against
Keras's own objects: torchmetrics takes no sample weights in most metrics and Keras is optional.

Uses torch, the public names of mirrored.distribute (Variable and its enums) and _config.py.
"""
from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import Tensor

from mirrored.distribute import (Variable, VariableAggregation, VariableSynchronization, WithoutReplicaRandom,
                                 get_replica_context, get_strategy, has_strategy)
from mirrored.training import _config
from mirrored.training.losses import _broadcast_sample_weight

__all__ = [
    "AUC",
    "Accuracy",
    "BinaryAccuracy",
    "BinaryCrossentropy",
    "BinaryIoU",
    "CategoricalAccuracy",
    "CategoricalCrossentropy",
    "CategoricalHinge",
    "ConcordanceCorrelation",
    "CosineSimilarity",
    "F1Score",
    "FBetaScore",
    "FalseNegatives",
    "FalsePositives",
    "Hinge",
    "IoU",
    "KLDivergence",
    "LogCoshError",
    "Mean",
    "MeanAbsoluteError",
    "MeanAbsolutePercentageError",
    "MeanIoU",
    "MeanMetricWrapper",
    "MeanSquaredError",
    "MeanSquaredLogarithmicError",
    "Metric",
    "OneHotIoU",
    "OneHotMeanIoU",
    "PearsonCorrelation",
    "Poisson",
    "Precision",
    "PrecisionAtRecall",
    "R2Score",
    "Recall",
    "RecallAtPrecision",
    "RootMeanSquaredError",
    "SensitivityAtSpecificity",
    "SparseCategoricalAccuracy",
    "SparseCategoricalCrossentropy",
    "SparseTopKCategoricalAccuracy",
    "SpecificityAtSensitivity",
    "SquaredHinge",
    "Sum",
    "TopKCategoricalAccuracy",
    "TrueNegatives",
    "TruePositives",
    "accuracy",
    "binary_accuracy",
    "categorical_accuracy",
    "concordance_correlation",
    "deserialize",
    "get",
    "pearson_correlation",
    "serialize",
    "sparse_categorical_accuracy",
    "sparse_top_k_categorical_accuracy",
    "top_k_categorical_accuracy",
]

_STATE_DTYPE = torch.float64  # exact counts up to 2**53; sums that do not drift over an epoch
_RESULT_DTYPE = torch.float32


class Metric:
    """Base class: state Variables made by `add_state`; subclasses implement update_state and result.

    Inside a replica step of several replicas, result() is the metric over every replica (all of
    them read it at once, as tf.keras's result() does through merge_call), so a train_step that
    returns {m.name: m.result()} reports the global value; elsewhere it reads the replicas' summed
    state. The updates of mirrored's own metrics skip the replica random mode: they draw nothing."""

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if "result" in cls.__dict__:
            cls.result = _read_across_replicas(cls.__dict__["result"])
        if "update_state" in cls.__dict__ and cls.__module__.startswith("mirrored."):
            cls.update_state = _without_random_mode(cls.__dict__["update_state"])

    def _draws_nothing(self) -> bool:
        """Whether update_state runs only mirrored's own arithmetic (no function of the user's)."""
        return True

    def __init__(self, name: str):
        if not isinstance(name, str) or not name:
            raise ValueError(f"{type(self).__name__}(name={name!r}): name must be a non-empty str.")
        self.name = name
        self._state: list[Variable] = []
        # State made later (at a first update, or a restore outside the scope) is made in this one.
        self._made_in = get_strategy() if has_strategy() else None

    def add_state(self, name: str, shape: tuple[int, ...] = (), keep: bool = True) -> Variable:
        """A float64 zero-filled Variable, one copy per replica in a strategy's scope, summed on read.
        keep=False leaves it out of `variables` (a metric that makes its state at the first update
        adds it itself, once)."""
        scope = (self._made_in.scope() if getattr(self, "_made_in", None) is not None and not has_strategy()
                 else contextlib.nullcontext())
        with scope:
            var = Variable(
                torch.zeros(shape, dtype=_STATE_DTYPE),
                trainable=False,
                name=f"{self.name}/{name}",
                synchronization=VariableSynchronization.ON_READ,
                aggregation=VariableAggregation.SUM,
            )
        if keep:
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


def _read_across_replicas(result: Callable[[Metric], Tensor]) -> Callable[[Metric], Tensor]:
    @functools.wraps(result)
    def read(self: Metric) -> Tensor:
        ctx = get_replica_context() if has_strategy() else None
        if ctx is None or ctx.num_replicas_in_sync < 2:
            return result(self)
        return ctx.merge_call(lambda strategy: result(self))
    return read


def _without_random_mode(update_state: Callable[..., None]) -> Callable[..., None]:
    @functools.wraps(update_state)
    def update(self: Metric, *args: Any, **kwargs: Any) -> None:
        if not self._draws_nothing():
            return update_state(self, *args, **kwargs)
        with WithoutReplicaRandom():  # (~40 torch calls that the replica's random mode would route through Python)
            return update_state(self, *args, **kwargs)
    return update


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

    def _draws_nothing(self) -> bool:
        """A function of the user's may draw random numbers: it runs in the replica's random mode."""
        return getattr(self._fn, "__module__", "").startswith("mirrored.")

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
# Registry.

# The families beside this module build on the classes above (they import them from here).
from mirrored.training import (  # noqa: E402
    _confusion_metrics,
    _iou_metrics,
    _probabilistic_metrics,
    _regression_metrics,
)
from mirrored.training._confusion_metrics import (  # noqa: E402
    AUC,
    F1Score,
    FalseNegatives,
    FalsePositives,
    FBetaScore,
    Precision,
    PrecisionAtRecall,
    Recall,
    RecallAtPrecision,
    SensitivityAtSpecificity,
    SpecificityAtSensitivity,
    TrueNegatives,
    TruePositives,
)
from mirrored.training._iou_metrics import BinaryIoU, IoU, MeanIoU, OneHotIoU, OneHotMeanIoU  # noqa: E402
from mirrored.training._probabilistic_metrics import (  # noqa: E402
    BinaryCrossentropy,
    CategoricalCrossentropy,
    CategoricalHinge,
    Hinge,
    KLDivergence,
    Poisson,
    SparseCategoricalCrossentropy,
    SquaredHinge,
    TopKCategoricalAccuracy,
    top_k_categorical_accuracy,
)
from mirrored.training._regression_metrics import (  # noqa: E402
    ConcordanceCorrelation,
    CosineSimilarity,
    LogCoshError,
    MeanAbsoluteError,
    MeanAbsolutePercentageError,
    MeanSquaredError,
    MeanSquaredLogarithmicError,
    PearsonCorrelation,
    R2Score,
    RootMeanSquaredError,
    concordance_correlation,
    pearson_correlation,
)

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


_METRIC_CLASSES: dict[str, type[Metric]] = {cls.__name__: cls for cls in (
    Accuracy, SparseCategoricalAccuracy, CategoricalAccuracy, BinaryAccuracy, SparseTopKCategoricalAccuracy,
    Mean, Sum, MeanMetricWrapper, *_regression_metrics.CLASSES,
    *_probabilistic_metrics.CLASSES, *_confusion_metrics.CLASSES, *_iou_metrics.CLASSES)}
_METRIC_FUNCTIONS: dict[str, Callable[..., Tensor]] = {fn.__name__: fn for fn in (
    accuracy, sparse_categorical_accuracy, categorical_accuracy, binary_accuracy, sparse_top_k_categorical_accuracy,
    _accuracy_by_shape, *_regression_metrics.FUNCTIONS, *_probabilistic_metrics.FUNCTIONS)}

# Keras 3's names: each class's name in snake_case (Keras's to_snake_case: MeanIoU -> mean_io_u), and its
# aliases. Class names ("RootMeanSquaredError") are found too, through _METRIC_CLASSES.
_METRICS.update({
    "mean_squared_error": MeanSquaredError,
    "mse": MeanSquaredError,
    "mean_absolute_error": MeanAbsoluteError,
    "mae": MeanAbsoluteError,
    "mean_absolute_percentage_error": MeanAbsolutePercentageError,
    "mape": MeanAbsolutePercentageError,
    "mean_squared_logarithmic_error": MeanSquaredLogarithmicError,
    "msle": MeanSquaredLogarithmicError,
    "root_mean_squared_error": RootMeanSquaredError,
    "cosine_similarity": CosineSimilarity,
    "log_cosh_error": LogCoshError,
    "logcosh": LogCoshError,
    "r2_score": R2Score,
    "pearson_correlation": PearsonCorrelation,
    "concordance_correlation": ConcordanceCorrelation,
    "binary_crossentropy": BinaryCrossentropy,
    "bce": BinaryCrossentropy,
    "categorical_crossentropy": CategoricalCrossentropy,
    "sparse_categorical_crossentropy": SparseCategoricalCrossentropy,
    "kl_divergence": KLDivergence,
    "poisson": Poisson,
    "hinge": Hinge,
    "squared_hinge": SquaredHinge,
    "categorical_hinge": CategoricalHinge,
    "top_k_categorical_accuracy": TopKCategoricalAccuracy,
    "true_positives": TruePositives,
    "false_positives": FalsePositives,
    "true_negatives": TrueNegatives,
    "false_negatives": FalseNegatives,
    "f1_score": F1Score,
    "f_beta_score": FBetaScore,
    "fbeta_score": FBetaScore,
    "binary_io_u": BinaryIoU,
})
# Keras's names of metrics that cannot be made without arguments (Keras's get fails on them too): get()
# says what to pass.
_NEED_ARGUMENTS: dict[type[Metric], str] = {
    PrecisionAtRecall: "PrecisionAtRecall(recall=0.8)",
    RecallAtPrecision: "RecallAtPrecision(precision=0.8)",
    SensitivityAtSpecificity: "SensitivityAtSpecificity(specificity=0.8)",
    SpecificityAtSensitivity: "SpecificityAtSensitivity(sensitivity=0.8)",
    IoU: "IoU(num_classes=..., target_class_ids=[...])",
    MeanIoU: "MeanIoU(num_classes=...)",
    OneHotIoU: "OneHotIoU(num_classes=..., target_class_ids=[...])",
    OneHotMeanIoU: "OneHotMeanIoU(num_classes=...)",
}
_METRICS.update({"precision_at_recall": PrecisionAtRecall, "recall_at_precision": RecallAtPrecision,
                 "sensitivity_at_specificity": SensitivityAtSpecificity,
                 "specificity_at_sensitivity": SpecificityAtSensitivity, "io_u": IoU, "mean_io_u": MeanIoU,
                 "one_hot_io_u": OneHotIoU, "one_hot_mean_io_u": OneHotMeanIoU})
_METRICS_BY_CLASS_NAME: dict[str, type[Metric]] = {
    name.lower(): cls for name, cls in _METRIC_CLASSES.items() if cls not in (MeanMetricWrapper, Metric)}

# Made from a name, these threshold sigmoid(logits) or take logits by default, since our models return
# logits (as the loss names do).
_TAKE_FROM_LOGITS = {"binary_accuracy", "precision", "recall", "auc", "binary_crossentropy", "bce",
                     "categorical_crossentropy", "sparse_categorical_crossentropy", "true_positives",
                     "false_positives", "true_negatives", "false_negatives", "f1_score", "f_beta_score", "fbeta_score",
                     "binary_io_u"}


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
    if not isinstance(identifier, type) and type(identifier).__module__.startswith("keras."):
        return _from_keras(identifier)
    if isinstance(identifier, str):
        key = identifier.lower()
        if key in ("accuracy", "acc"):
            if loss_name is not None and loss_name.lower() in _ACCURACY_FOR_LOSS:
                return _ACCURACY_FOR_LOSS[loss_name.lower()](identifier, from_logits)
            return MeanMetricWrapper(_accuracy_by_shape, identifier, from_logits=from_logits)
        cls = _METRICS.get(key)
        if cls is None and key in _METRICS_BY_CLASS_NAME:  # a class name: the class with its own default name
            cls = _METRICS_BY_CLASS_NAME[key]
            key = next((k for k, c in _METRICS.items() if c is cls), key)
            identifier = None
        if cls in _NEED_ARGUMENTS:
            raise ValueError(f"metric {identifier or key!r} needs arguments, so no name can make it: pass "
                             f"mr.metrics.{_NEED_ARGUMENTS[cls]}.")
        if cls is None:
            raise ValueError(f"unknown metric {identifier!r}. Known names: {', '.join(_METRICS)}; or pass a "
                             "Metric object or a function(y_true, y_pred) returning one value per example.")
        named = {} if identifier is None else {"name": identifier}
        if key in _TAKE_FROM_LOGITS:
            return cls(**named, from_logits=from_logits)
        return cls(**named)
    if isinstance(identifier, type) and issubclass(identifier, Metric):
        return identifier()
    if isinstance(identifier, Mapping):
        return deserialize(identifier)
    if callable(identifier):
        return MeanMetricWrapper(identifier)
    raise TypeError(f"metrics.get: cannot make a metric from {identifier!r} ({type(identifier).__name__}). "
                    f"Pass one of {', '.join(_METRICS)}, a Metric, or a function(y_true, y_pred).")


def _from_keras(keras_metric: Any) -> Metric:
    """Ours of the same class and settings for a keras.metrics object given for a torch module: the same
    values (its from_logits as the user set it), with state summed across replicas."""
    cls = _METRIC_CLASSES.get(type(keras_metric).__name__)
    if cls is None or cls in (Metric, MeanMetricWrapper) or not hasattr(keras_metric, "get_config"):
        raise TypeError(f"metrics.get: {keras_metric!r} is a Keras object that mr.metrics has no class for. Pass an "
                        "mr.metrics metric, a name, or a function(y_true, y_pred) returning one value per example.")
    config = {k: v for k, v in keras_metric.get_config().items() if k != "dtype"}
    return cls.from_config(config)

