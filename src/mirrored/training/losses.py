"""Losses with Keras names and PyTorch conventions, plus the distributed averaging helpers.

Models return logits, so every crossentropy here defaults to `from_logits=True`. A loss object's
`__call__(y_true, y_pred, sample_weight=None)` returns the reduced loss (Keras's reductions);
`per_example(y_true, y_pred)` returns one loss per example for a distributed loop, which sums and
divides by the GLOBAL batch size itself: `compute_average_loss` (tf.nn.compute_average_loss).
`get(identifier)` turns a name (Keras's: a loss function's name, a class name or an alias such as
"mse", "kld", "bce"), a loss object, a config, a torch.nn loss module or a function into a loss.
Keras 3's other losses live in families beside this module, re-exported here: _regression_losses.py
(Huber, LogCosh, Poisson, KLDivergence, ...), _classification_losses.py (hinges, focal
crossentropies, CTC, ...) and _batch_losses.py (Dice, Tversky, Circle: statistics of a whole
batch). Loss objects have Keras's get_config()/from_config(); serialize()/deserialize() turn one
into JSON and back, from this module's classes only.

Called inside `strategy.run` on several replicas, a loss object with the default mean reduction
averages over one replica's batch; a mirrored optimizer then SUMs the replicas' gradients, which
makes the update N times too large (TF 2.21 does so silently). The first such call warns, naming the
fix. Model.fit never calls loss objects that way: it takes `per_example` losses.

Uses torch and the families above only (and _config.py, on first use of a config); the replica
context (for the replica count and the replica id in errors) is looked up at call time in
mirrored.distribute when that package is loaded, so this module never imports it.
"""
from __future__ import annotations

import copy
import re
import sys
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = [
    "BinaryCrossentropy",
    "BinaryFocalCrossentropy",
    "CTC",
    "CategoricalCrossentropy",
    "CategoricalFocalCrossentropy",
    "CategoricalGeneralizedCrossEntropy",
    "CategoricalHinge",
    "Circle",
    "CosineSimilarity",
    "Dice",
    "Hinge",
    "Huber",
    "KLDivergence",
    "LogCosh",
    "Loss",
    "LossFunctionWrapper",
    "MeanAbsoluteError",
    "MeanAbsolutePercentageError",
    "MeanSquaredError",
    "MeanSquaredLogarithmicError",
    "Poisson",
    "SparseCategoricalCrossentropy",
    "SquaredHinge",
    "TorchLossWrapper",
    "Tversky",
    "binary_crossentropy",
    "binary_focal_crossentropy",
    "categorical_crossentropy",
    "categorical_focal_crossentropy",
    "categorical_generalized_cross_entropy",
    "categorical_hinge",
    "circle",
    "compute_average_loss",
    "cosine_similarity",
    "ctc",
    "deserialize",
    "dice",
    "get",
    "hinge",
    "huber",
    "kl_divergence",
    "log_cosh",
    "mean_absolute_error",
    "mean_absolute_percentage_error",
    "mean_squared_error",
    "mean_squared_logarithmic_error",
    "poisson",
    "scale_regularization_loss",
    "serialize",
    "sparse_categorical_crossentropy",
    "squared_hinge",
    "tversky",
]

_EPSILON = 1e-7  # Keras's backend epsilon: probabilities are clipped to [eps, 1 - eps] before log
_PROBABILITY_ROW_SUM_ATOL = 1e-3  # rows of softmax output sum to 1 up to float error
# Softmax outputs show from the first batch on; after this many calls a loss object stops checking,
# so a long run pays nothing for the warning.
_PROBABILITY_CHECK_CALLS = 10
_REDUCTIONS = ("sum_over_batch_size", "sum", "none")


# ---------------------------------------------------------------------------------------------
# Replica context, looked up lazily.

def _snake_case(name: str) -> str:
    """Keras's default name of a loss: MyHuberLoss -> my_huber_loss."""
    return re.sub(r"(?<=[a-z0-9])(?=[A-Z])|(?<=[A-Z])(?=[A-Z][a-z])", "_", name).lower()


def _context_module() -> Any:
    """mirrored.distribute if something has imported it, else None. No strategy can exist before
    that package is loaded, so looking it up (instead of importing it) is enough, and it keeps this
    module usable without mirrored.distribute."""
    return sys.modules.get("mirrored.distribute")


def _replica_context() -> Any:
    """The calling replica's ReplicaContext inside `strategy.run`; None outside any strategy and in
    cross-replica context."""
    context = _context_module()
    if context is None or not context.has_strategy():
        return None
    return context.get_replica_context()


def _in_cross_replica_context() -> bool:
    context = _context_module()
    return context is not None and context.has_strategy() and context.in_cross_replica_context()


def _num_replicas_in_sync(what: str) -> int:
    if _in_cross_replica_context():
        raise RuntimeError(
            f"{what} was called in cross-replica context (inside `with strategy.scope():` but outside "
            "strategy.run), where there is no per-replica batch. Call it inside the function given to "
            "strategy.run, or pass global_batch_size=."
        )
    ctx = _replica_context()
    return 1 if ctx is None else int(ctx.num_replicas_in_sync)


# ---------------------------------------------------------------------------------------------
# Averaging across replicas.

def _weighted(losses: Tensor, sample_weight: Tensor | float | None, what: str) -> Tensor:
    if sample_weight is None:
        return losses
    return losses * _broadcast_sample_weight(sample_weight, losses, what)


def _broadcast_sample_weight(sample_weight: Tensor | float, values: Tensor, what: str) -> Tensor:
    """Weights of shape (B,) or (B, ...) aligned on the leading (batch) dims of `values`, as Keras does;
    a (B, 1) weight also applies to (B,) values."""
    weight = torch.as_tensor(sample_weight, device=values.device)
    if not weight.is_floating_point():
        weight = weight.to(values.dtype if values.is_floating_point() else torch.float32)
    elif values.is_floating_point():
        weight = weight.to(values.dtype)
    if weight.ndim == values.ndim + 1 and weight.shape[-1] == 1:
        weight = weight.squeeze(-1)
    if 0 < weight.ndim < values.ndim:
        weight = weight.reshape(weight.shape + (1,) * (values.ndim - weight.ndim))
    try:
        return torch.broadcast_to(weight, values.shape)
    except RuntimeError:
        raise ValueError(
            f"{what}: sample_weight of shape {tuple(weight.shape)} does not fit values of shape "
            f"{tuple(values.shape)}. Give one weight per example (shape (batch,)) or one per value."
        ) from None


def compute_average_loss(
    per_example_loss: Tensor,
    sample_weight: Tensor | float | None = None,
    global_batch_size: int | None = None,
) -> Tensor:
    """Sum of (weighted) per-example losses / GLOBAL batch size, so gradients summed across replicas
    equal the single-device gradient. Same as tf.nn.compute_average_loss.

    Args:
      per_example_loss: losses of shape (per_replica_batch, ...), e.g. from `per_example`.
      sample_weight: optional weights, broadcast over the leading dims of per_example_loss.
      global_batch_size: the batch size over all replicas. If None: per_replica_batch *
        num_replicas_in_sync, which is only right when the global batch splits evenly; a short final
        batch (10 over 3 replicas -> 4, 4, 2) needs the true size passed here.
    """
    if not isinstance(per_example_loss, Tensor):
        raise TypeError(f"compute_average_loss: per_example_loss must be a torch.Tensor, got "
                        f"{type(per_example_loss).__name__}.")
    if per_example_loss.ndim == 0:
        raise ValueError(
            "compute_average_loss: per_example_loss is a scalar, so it was already reduced. Pass one loss "
            "per example: loss_obj.per_example(y_true, y_pred), or F.cross_entropy(..., reduction='none')."
        )
    losses = _weighted(per_example_loss, sample_weight, "compute_average_loss")
    if global_batch_size is None:
        global_batch_size = losses.shape[0] * _num_replicas_in_sync("compute_average_loss")
        if global_batch_size == 0:  # this replica's part of a short batch is empty: it adds nothing
            return losses.sum()
    else:
        _check_global_batch_size(global_batch_size)
    return losses.sum() / global_batch_size


def _check_global_batch_size(global_batch_size: Any) -> None:
    if isinstance(global_batch_size, Tensor) and global_batch_size.ndim == 0 \
            and not global_batch_size.is_floating_point():
        global_batch_size = int(global_batch_size)
    if isinstance(global_batch_size, bool) or not isinstance(global_batch_size, int):
        raise TypeError(f"compute_average_loss: global_batch_size must be an int, got "
                        f"{global_batch_size!r} ({type(global_batch_size).__name__}).")
    if global_batch_size <= 0:
        raise ValueError(f"compute_average_loss: global_batch_size={global_batch_size} must be positive: "
                         "the number of examples in one step over all replicas.")


def scale_regularization_loss(regularization_loss: Tensor | Sequence[Tensor]) -> Tensor:
    """Sum of the regularization losses / num_replicas_in_sync, so that summing across replicas
    counts them once. Same as tf.nn.scale_regularization_loss."""
    if isinstance(regularization_loss, Tensor):
        total = regularization_loss.sum()
    elif isinstance(regularization_loss, Sequence) and regularization_loss:
        total = torch.stack([torch.as_tensor(r).sum() for r in regularization_loss]).sum()
    else:
        raise TypeError("scale_regularization_loss: expected a tensor or a non-empty list of tensors, got "
                        f"{regularization_loss!r}.")
    return total / _num_replicas_in_sync("scale_regularization_loss")


# ---------------------------------------------------------------------------------------------
# Checks at the boundary.

def _shape(t: Tensor) -> str:
    return str(tuple(t.shape))


def _check_tensors(what: str, y_true: Any, y_pred: Any) -> tuple[Tensor, Tensor]:
    if not isinstance(y_pred, Tensor):
        raise TypeError(f"{what}: y_pred must be a torch.Tensor (the model's output), got {type(y_pred).__name__}.")
    if not y_pred.is_floating_point():
        raise TypeError(f"{what}: y_pred has dtype {y_pred.dtype}; predictions must be floating point.")
    if isinstance(y_true, Tensor) and y_true.device == y_pred.device:
        return y_true, y_pred  # (what as_tensor would return, without its call)
    return torch.as_tensor(y_true, device=y_pred.device), y_pred  # labels follow the logits' device


def _match_rank(what: str, y_true: Tensor, y_pred: Tensor) -> tuple[Tensor, Tensor]:
    """Same shapes, allowing (B,) against (B, 1) as Keras does; anything else is an error instead of a
    silent (B, B) broadcast."""
    if y_true.ndim == y_pred.ndim + 1 and y_true.shape[-1] == 1:
        y_true = y_true.squeeze(-1)
    elif y_pred.ndim == y_true.ndim + 1 and y_pred.shape[-1] == 1:
        y_pred = y_pred.squeeze(-1)
    if y_true.shape != y_pred.shape:
        raise ValueError(f"{what}: y_true has shape {_shape(y_true)} but y_pred has shape {_shape(y_pred)}; "
                         "they must match (a trailing dim of 1 on either side is allowed).")
    return y_true, y_pred


def _looks_like_probabilities(y_pred: Tensor, axis: int | None) -> bool:
    """With a class axis: every value in [0, 1] and every row summing to 1 (softmax output). Without:
    every value strictly inside (0, 1) (sigmoid output), so that the all-zero logits of a zero-initialised
    head do not count. One device sync."""
    if y_pred.numel() == 0:
        return False
    lo, hi = torch.aminmax(y_pred.detach())
    if axis is None:
        return bool((lo > 0) & (hi < 1))
    row_sums = y_pred.detach().sum(dim=axis)
    return bool((lo >= 0) & (hi <= 1) & ((row_sums - 1).abs() <= _PROBABILITY_ROW_SUM_ATOL).all())


def _check_labels_in_range(what: str, labels: Tensor, logits: Tensor, num_classes: int,
                           ignore_class: int | None) -> None:
    """Labels must be class ids in [0, num_classes). One aminmax and one device sync per call; the
    loop over examples runs only on the error path. (On GPU this sync per step could become an
    asynchronous device-side assert later; F.cross_entropy's own check kills the CUDA context.)"""
    if labels.numel() == 0:
        return
    checked = labels
    if ignore_class is not None:  # a masked select would sync on its size; zero the ignored ones instead
        checked = torch.where(labels == ignore_class, torch.zeros_like(labels), labels)
    lo, hi = torch.stack(torch.aminmax(checked)).tolist()
    if lo >= 0 and hi < num_classes:
        return
    bad = ((labels < 0) | (labels >= num_classes))
    if ignore_class is not None:
        bad &= labels != ignore_class
    index = tuple(int(i) for i in bad.nonzero()[0])
    label = int(labels[index])
    where = f"example {index[0]}" if len(index) == 1 else f"example {index[0]}, position {index[1:]}"
    ctx = _replica_context()
    if ctx is not None:
        where += f" of replica {ctx.replica_id_in_sync_group}'s batch"
    raise ValueError(
        f"{what}: label {label} ({where}) is outside [0, {num_classes}) for logits of shape {_shape(logits)}. "
        f"Labels are class ids 0..{num_classes - 1}: check the dataset's num_classes and the model's num_classes=."
    )


# ---------------------------------------------------------------------------------------------
# Per-example loss functions (reduction "none").

def _sparse_ce(y_true: Any, y_pred: Tensor, from_logits: bool, ignore_class: int | None = None,
               axis: int = -1, what: str = "sparse_categorical_crossentropy") -> Tensor:
    y_true, y_pred = _check_tensors(what, y_true, y_pred)
    if y_true.is_floating_point() or y_true.dtype == torch.bool or y_true.is_complex():
        raise TypeError(
            f"{what}: labels have dtype {y_true.dtype}; they must be integer class ids (e.g. torch.int64). "
            "If they are one-hot or probabilities, use categorical_crossentropy; if they are whole numbers "
            "stored as floats, convert them with labels.long()."
        )
    if y_pred.ndim == 0:
        raise ValueError(f"{what}: y_pred is a scalar; expected logits of shape (batch, num_classes).")
    axis = axis % y_pred.ndim
    if y_true.ndim == y_pred.ndim and y_true.shape[axis] == 1:
        y_true = y_true.squeeze(axis)  # Keras accepts labels of shape (B, 1)
    expected = y_pred.shape[:axis] + y_pred.shape[axis + 1:]
    if y_true.shape != expected:
        raise ValueError(
            f"{what}: labels of shape {_shape(y_true)} do not fit logits of shape {_shape(y_pred)}: expected "
            f"labels of shape {tuple(expected)}, one class id per example (classes on axis {axis})."
        )
    num_classes = y_pred.shape[axis]
    _check_labels_in_range(what, y_true, y_pred, num_classes, ignore_class)
    if y_true.dtype != torch.int64:
        y_true = y_true.long()
    if from_logits and y_pred.ndim == 2:
        # torch's fused op: the same log_softmax and the same values picked (every label is in range, or
        # the ignored class, which comes out 0 as the masking below gives it), one node instead of five.
        return F.cross_entropy(y_pred, y_true, reduction="none",
                               ignore_index=ignore_class if ignore_class is not None else -100)
    if ignore_class is not None:
        valid = y_true != ignore_class
        y_true = torch.where(valid, y_true, torch.zeros_like(y_true))
    log_probs = _log_probs(y_pred, from_logits, axis)
    losses = -log_probs.gather(axis, y_true.unsqueeze(axis)).squeeze(axis)
    if ignore_class is not None:
        losses = torch.where(valid, losses, torch.zeros_like(losses))
    return losses


def _log_probs(y_pred: Tensor, from_logits: bool, axis: int) -> Tensor:
    if from_logits:
        return F.log_softmax(y_pred, dim=axis)
    # Keras normalises probability rows and clips them away from 0 and 1 before the log.
    probs = y_pred / y_pred.sum(dim=axis, keepdim=True)
    return probs.clamp(_EPSILON, 1 - _EPSILON).log()


def sparse_categorical_crossentropy(y_true: Any, y_pred: Tensor, from_logits: bool = True,
                                    ignore_class: int | None = None, axis: int = -1) -> Tensor:
    """Per-example crossentropy between integer class ids and logits (or probabilities).

    Labels of shape y_pred.shape without `axis` (a trailing 1 is allowed); labels equal to
    ignore_class get loss 0. Raises ValueError for labels outside [0, num_classes)."""
    return _sparse_ce(y_true, y_pred, from_logits, ignore_class, axis)


def categorical_crossentropy(y_true: Any, y_pred: Tensor, from_logits: bool = True,
                             label_smoothing: float = 0.0, axis: int = -1) -> Tensor:
    """Per-example crossentropy between one-hot (or soft) labels and logits (or probabilities)."""
    what = "categorical_crossentropy"
    y_true, y_pred = _check_tensors(what, y_true, y_pred)
    if y_true.shape != y_pred.shape:
        hint = " Integer class ids need sparse_categorical_crossentropy." if y_true.ndim == y_pred.ndim - 1 else ""
        raise ValueError(f"{what}: y_true has shape {_shape(y_true)} but y_pred has shape {_shape(y_pred)}; "
                         f"one-hot labels must have the logits' shape.{hint}")
    y_true = y_true.to(y_pred.dtype)
    if label_smoothing:
        y_true = y_true * (1 - label_smoothing) + label_smoothing / y_pred.shape[axis]
    return -(y_true * _log_probs(y_pred, from_logits, axis)).sum(dim=axis)


def _mean_last_axis(values: Tensor) -> Tensor:
    """Keras averages over the last axis; 1-D inputs hold one value per example, so stay as they are."""
    return values.mean(dim=-1) if values.ndim >= 2 else values


def binary_crossentropy(y_true: Any, y_pred: Tensor, from_logits: bool = True,
                        label_smoothing: float = 0.0) -> Tensor:
    """Per-example binary crossentropy (mean over the last axis when y_pred has rank >= 2)."""
    what = "binary_crossentropy"
    y_true, y_pred = _check_tensors(what, y_true, y_pred)
    y_true, y_pred = _match_rank(what, y_true, y_pred)
    y_true = y_true.to(y_pred.dtype)
    if label_smoothing:
        y_true = y_true * (1 - label_smoothing) + 0.5 * label_smoothing
    if from_logits:
        values = F.binary_cross_entropy_with_logits(y_pred, y_true, reduction="none")
    else:
        p = y_pred.clamp(_EPSILON, 1 - _EPSILON)
        values = -(y_true * p.log() + (1 - y_true) * (1 - p).log())
    return _mean_last_axis(values)


def mean_squared_error(y_true: Any, y_pred: Tensor) -> Tensor:
    """Per-example mean squared error (mean over the last axis when y_pred has rank >= 2)."""
    y_true, y_pred = _match_rank("mean_squared_error", *_check_tensors("mean_squared_error", y_true, y_pred))
    return _mean_last_axis((y_pred - y_true.to(y_pred.dtype)).square())


def mean_absolute_error(y_true: Any, y_pred: Tensor) -> Tensor:
    """Per-example mean absolute error (mean over the last axis when y_pred has rank >= 2)."""
    y_true, y_pred = _match_rank("mean_absolute_error", *_check_tensors("mean_absolute_error", y_true, y_pred))
    return _mean_last_axis((y_pred - y_true.to(y_pred.dtype)).abs())


# ---------------------------------------------------------------------------------------------
# Loss objects.

class Loss:
    """Base class (keras.losses.Loss): a subclass implements `call(y_true, y_pred)`, returning one loss
    per example, as a Keras one does; `__call__` applies sample weights and the reduction:
    "sum_over_batch_size" (sum / number of loss values), "sum", or "none". `name` defaults to the
    class name in snake_case, as Keras names it."""

    _probability_axis: int | None = None  # class axis for the probability check; None: no check

    def __init__(self, name: str | None = None, reduction: str = "sum_over_batch_size", from_logits: bool = False):
        if reduction not in _REDUCTIONS:
            raise ValueError(f"{type(self).__name__}(reduction={reduction!r}): expected one of {list(_REDUCTIONS)}.")
        self.name = name if name is not None else _snake_case(type(self).__name__)
        self.reduction = reduction
        self.from_logits = from_logits
        self._checks_left = _PROBABILITY_CHECK_CALLS if from_logits else 0
        self._mean_checked = reduction != "sum_over_batch_size"  # the replica-mean warning, once per object

    def call(self, y_true: Any, y_pred: Tensor) -> Tensor:
        """One loss per example (Keras's hook for a loss of your own); the built-in losses compute
        theirs in `_per_example`."""
        raise NotImplementedError(f"{type(self).__name__}: a subclass of mr.losses.Loss implements call(y_true, "
                                  "y_pred), returning one loss per example (as keras.losses.Loss subclasses do).")

    def _per_example(self, y_true: Any, y_pred: Tensor) -> Tensor:
        return self.call(y_true, y_pred)

    def _checked(self, y_true: Any, y_pred: Tensor) -> tuple[Tensor, str | None]:
        losses = self._per_example(y_true, y_pred)
        warning = None
        # Racy across replica threads by design: at worst a second replica checks once more.
        if self._checks_left > 0:
            self._checks_left -= 1
            if _looks_like_probabilities(y_pred, self._probability_axis):
                self._checks_left = 0
                looks = ("all values in [0, 1] and rows summing to 1" if self._probability_axis is not None
                         else "all values inside (0, 1)")
                warning = (
                    f"{self.name}: y_pred looks like probabilities ({looks}) but from_logits=True. Models here "
                    "return logits: drop the final softmax/sigmoid, or pass from_logits=False."
                )
        return losses, warning

    def per_example(self, y_true: Any, y_pred: Tensor) -> Tensor:
        """One loss per example (reduction "none"), unweighted; for compute_average_loss."""
        losses, warning = self._checked(y_true, y_pred)
        if warning:
            warnings.warn(warning, UserWarning, stacklevel=2)
        return losses

    def __call__(self, y_true: Any, y_pred: Tensor, sample_weight: Tensor | float | None = None) -> Tensor:
        """The loss reduced with `self.reduction`, after weighting each example by sample_weight."""
        if not self._mean_checked:
            self._check_replica_mean(y_pred)
        losses, warning = self._checked(y_true, y_pred)
        if warning:
            warnings.warn(warning, UserWarning, stacklevel=2)
        losses = _weighted(losses, sample_weight, self.name)
        if self.reduction == "none":
            return losses
        if self.reduction == "sum":
            return losses.sum()
        return losses.sum() / self._denominator(y_true, losses)

    def _check_replica_mean(self, y_pred: Any) -> None:
        """Warns (once per loss object) when a mean over one replica's batch is taken inside strategy.run
        on several replicas, for gradients: the gradients a mirrored optimizer sums would be N times the
        mean's. No warning without gradients (an evaluation step), nor where every mirrored optimizer
        of the strategy averages the replicas' gradients (gradient_reduction="mean", DDP's rule)."""
        ctx = _replica_context()
        if ctx is None:
            return  # outside strategy.run: the batch is the whole batch (Keras's own loops, evaluation)
        if not (torch.is_grad_enabled() and getattr(y_pred, "requires_grad", False)):
            return  # nothing to step with (checked again at the next call, which may be a training one)
        reductions = getattr(ctx.strategy, "gradient_reductions", None)
        if reductions and "sum" not in reductions:
            return
        self._mean_checked = True  # racy across replica threads: at worst two of them warn
        n = int(ctx.num_replicas_in_sync)
        if n > 1:
            warnings.warn(
                f"{self.name}: called inside strategy.run on {n} replicas with reduction=\"sum_over_batch_size\", "
                "which averages over this replica's part of the batch only. A mirrored optimizer SUMs the "
                f"replicas' gradients, so the update would be {n} times too large (TF 2.21 does this silently). "
                "Use reduction=\"none\" and mr.losses.compute_average_loss(losses, global_batch_size=GLOBAL), or "
                "reduction=\"sum\" and divide by the global batch size.", UserWarning, stacklevel=3)

    def _denominator(self, y_true: Any, losses: Tensor) -> int | Tensor:
        """The count "sum_over_batch_size" divides by; at least 1, so an empty batch gives 0."""
        return max(losses.numel(), 1)

    def kept(self, y_true: Any) -> Tensor:
        """How many labels of `y_true` count: those that are not the loss's `ignore_class` (any loss
        may have one), all of them without. What Keras's mean divides by, and what Model.fit sums
        over the replicas; 0 for an empty batch."""
        labels = torch.as_tensor(y_true)
        ignore = getattr(self, "ignore_class", None)
        return (labels != ignore).sum() if ignore is not None else torch.tensor(labels.numel(), device=labels.device)

    def get_config(self) -> dict[str, Any]:
        """The constructor's arguments, as JSON (Keras's get_config)."""
        return {"name": self.name, "reduction": self.reduction}

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> Loss:
        """A new instance from get_config()'s dict (Keras's from_config)."""
        return cls(**config)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r}, reduction={self.reduction!r})"


class SparseCategoricalCrossentropy(Loss):
    """Crossentropy between integer class ids and logits (from_logits=True) or probabilities.

    With ignore_class, those labels get loss 0 and "sum_over_batch_size" divides by the number of other
    labels (Keras, and torch's ignore_index). `per_example` keeps them as zeros, so the distributed
    average still divides by the global batch size."""

    _probability_axis = -1

    def __init__(self, from_logits: bool = True, ignore_class: int | None = None,
                 reduction: str = "sum_over_batch_size", name: str = "sparse_categorical_crossentropy",
                 axis: int = -1):
        super().__init__(name, reduction, from_logits)
        self.ignore_class = ignore_class
        self.axis = axis
        self._probability_axis = axis

    def _per_example(self, y_true: Any, y_pred: Tensor) -> Tensor:
        return _sparse_ce(y_true, y_pred, self.from_logits, self.ignore_class, self.axis, self.name)

    def _denominator(self, y_true: Any, losses: Tensor) -> int | Tensor:
        if self.ignore_class is None:
            return max(losses.numel(), 1)
        return self.kept(y_true).clamp(min=1)

    def get_config(self) -> dict[str, Any]:
        """The constructor's arguments, as JSON (Keras's get_config); from_config(config) rebuilds it."""
        return {**super().get_config(), "from_logits": self.from_logits, "ignore_class": self.ignore_class,
                "axis": self.axis}

    def __repr__(self) -> str:
        return (f"SparseCategoricalCrossentropy(from_logits={self.from_logits}, ignore_class={self.ignore_class}, "
                f"reduction={self.reduction!r})")


class CategoricalCrossentropy(Loss):
    """Crossentropy between one-hot (or soft) labels and logits; label_smoothing mixes the labels with
    the uniform distribution."""

    _probability_axis = -1

    def __init__(self, from_logits: bool = True, label_smoothing: float = 0.0,
                 reduction: str = "sum_over_batch_size", name: str = "categorical_crossentropy", axis: int = -1):
        if not 0 <= label_smoothing <= 1:
            raise ValueError(f"CategoricalCrossentropy(label_smoothing={label_smoothing}): must be in [0, 1].")
        super().__init__(name, reduction, from_logits)
        self.label_smoothing = label_smoothing
        self.axis = axis
        self._probability_axis = axis

    def _per_example(self, y_true: Any, y_pred: Tensor) -> Tensor:
        return categorical_crossentropy(y_true, y_pred, self.from_logits, self.label_smoothing, self.axis)

    def get_config(self) -> dict[str, Any]:
        """The constructor's arguments, as JSON (Keras's get_config); from_config(config) rebuilds it."""
        return {**super().get_config(), "from_logits": self.from_logits, "label_smoothing": self.label_smoothing,
                "axis": self.axis}

    def __repr__(self) -> str:
        return (f"CategoricalCrossentropy(from_logits={self.from_logits}, label_smoothing={self.label_smoothing}, "
                f"reduction={self.reduction!r})")


class BinaryCrossentropy(Loss):
    """Binary crossentropy between 0/1 labels and logits (from_logits=True) or probabilities."""

    def __init__(self, from_logits: bool = True, label_smoothing: float = 0.0,
                 reduction: str = "sum_over_batch_size", name: str = "binary_crossentropy"):
        if not 0 <= label_smoothing <= 1:
            raise ValueError(f"BinaryCrossentropy(label_smoothing={label_smoothing}): must be in [0, 1].")
        super().__init__(name, reduction, from_logits)
        self.label_smoothing = label_smoothing

    def _per_example(self, y_true: Any, y_pred: Tensor) -> Tensor:
        return binary_crossentropy(y_true, y_pred, self.from_logits, self.label_smoothing)

    def get_config(self) -> dict[str, Any]:
        """The constructor's arguments, as JSON (Keras's get_config); from_config(config) rebuilds it."""
        return {**super().get_config(), "from_logits": self.from_logits, "label_smoothing": self.label_smoothing}

    def __repr__(self) -> str:
        return (f"BinaryCrossentropy(from_logits={self.from_logits}, label_smoothing={self.label_smoothing}, "
                f"reduction={self.reduction!r})")


class MeanSquaredError(Loss):
    """Mean of squared differences over the last axis, per example."""

    def __init__(self, reduction: str = "sum_over_batch_size", name: str = "mean_squared_error"):
        super().__init__(name, reduction)

    def _per_example(self, y_true: Any, y_pred: Tensor) -> Tensor:
        return mean_squared_error(y_true, y_pred)


class MeanAbsoluteError(Loss):
    """Mean of absolute differences over the last axis, per example."""

    def __init__(self, reduction: str = "sum_over_batch_size", name: str = "mean_absolute_error"):
        super().__init__(name, reduction)

    def _per_example(self, y_true: Any, y_pred: Tensor) -> Tensor:
        return mean_absolute_error(y_true, y_pred)


class LossFunctionWrapper(Loss):
    """A function fn(y_true, y_pred, **kwargs) -> per-example losses, as a loss object (Keras's
    LossFunctionWrapper); the named losses of mr.losses are its subclasses, as in Keras."""

    def __init__(self, fn: Callable[..., Tensor], reduction: str = "sum_over_batch_size",
                 name: str | None = None, **kwargs: Any):
        super().__init__(name or getattr(fn, "__name__", type(fn).__name__), reduction,
                         bool(kwargs.get("from_logits", False)))
        self.fn = fn
        self._fn_kwargs = kwargs

    def _per_example(self, y_true: Any, y_pred: Tensor) -> Tensor:
        losses = self.fn(y_true, y_pred, **self._fn_kwargs)
        if not isinstance(losses, Tensor) or losses.ndim == 0:
            got = "a scalar" if isinstance(losses, Tensor) else type(losses).__name__
            raise ValueError(f"loss function {self.name!r} returned {got}; a loss function must return one loss "
                             "per example (shape (batch, ...)).")
        return losses

    def get_config(self) -> dict[str, Any]:
        """A named subclass: its settings. This class itself: only for mr.losses' functions, which are
        rebuilt by name; another function has no config."""
        if type(self) is not LossFunctionWrapper:
            return {**super().get_config(), **self._fn_kwargs}
        name = getattr(self.fn, "__name__", None)
        if _LOSS_FUNCTIONS.get(name) is not self.fn:
            raise NotImplementedError(f"loss {self.name!r} wraps {self.fn!r}, which is not one of mr.losses' "
                                      "functions, so no config can rebuild it.")
        return {**super().get_config(), "fn": name, **self._fn_kwargs}

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> Loss:
        """A new instance from get_config()'s dict (Keras's from_config)."""
        if cls is not LossFunctionWrapper:
            return cls(**config)
        config = dict(config)
        name = config.pop("fn", None)
        if name not in _LOSS_FUNCTIONS:
            raise ValueError(f"LossFunctionWrapper config: fn={name!r} is not one of {', '.join(_LOSS_FUNCTIONS)}.")
        return cls(_LOSS_FUNCTIONS[name], **config)

    def __repr__(self) -> str:
        if type(self) is LossFunctionWrapper:
            return f"LossFunctionWrapper({getattr(self.fn, '__name__', self.fn)!r}, reduction={self.reduction!r})"
        args = "".join(f"{k}={v!r}, " for k, v in self._fn_kwargs.items())
        return f"{type(self).__name__}({args}reduction={self.reduction!r})"


class TorchLossWrapper(Loss):
    """A torch.nn loss module (nn.CrossEntropyLoss(), nn.MSELoss(), ...) as a loss object.

    A copy of the module with reduction='none' gives the per-example losses, called in torch's order
    module(y_pred, y_true); the original is left untouched. The reduction is then Keras's: with
    "sum_over_batch_size" the module's weight=/ignore_index= options give sum(w_i * l_i) / batch, not
    torch's weighted mean sum(w_i * l_i) / sum(w_i)."""

    def __init__(self, module: nn.Module, reduction: str = "sum_over_batch_size", name: str | None = None):
        super().__init__(name or _snake_case(type(module).__name__), reduction)
        self.module = copy.copy(module)  # shallow: shares weight= tensors, owns its reduction
        self.module.reduction = "none"

    def _per_example(self, y_true: Any, y_pred: Tensor) -> Tensor:
        if isinstance(self.module, (nn.CrossEntropyLoss, nn.NLLLoss)) and isinstance(y_true, Tensor) \
                and not y_true.is_floating_point() and y_pred.ndim >= 2:
            # torch's own check raises an IndexError on CPU and a device-side assert on CUDA.
            _check_labels_in_range(self.name, y_true, y_pred, y_pred.shape[1], self.module.ignore_index)
        return self.module(y_pred, y_true)

    def get_config(self) -> dict[str, Any]:
        """The constructor's arguments, as JSON (Keras's get_config); from_config(config) rebuilds it."""
        raise NotImplementedError(f"{self!r}: a torch.nn loss module has no config; load with compile=False and "
                                  "compile(...) with it again.")

    def __repr__(self) -> str:
        return f"TorchLossWrapper({self.module!r}, reduction={self.reduction!r})"


# The families beside this module build on the classes and helpers above (they import them from here).
from mirrored.training import _batch_losses, _classification_losses, _regression_losses  # noqa: E402
from mirrored.training._batch_losses import Circle, Dice, Tversky, circle, dice, tversky  # noqa: E402
from mirrored.training._classification_losses import (  # noqa: E402
    CTC,
    BinaryFocalCrossentropy,
    CategoricalFocalCrossentropy,
    CategoricalGeneralizedCrossEntropy,
    CategoricalHinge,
    Hinge,
    SquaredHinge,
    binary_focal_crossentropy,
    categorical_focal_crossentropy,
    categorical_generalized_cross_entropy,
    categorical_hinge,
    ctc,
    hinge,
    squared_hinge,
)
from mirrored.training._regression_losses import (  # noqa: E402
    CosineSimilarity,
    Huber,
    KLDivergence,
    LogCosh,
    MeanAbsolutePercentageError,
    MeanSquaredLogarithmicError,
    Poisson,
    cosine_similarity,
    huber,
    kl_divergence,
    log_cosh,
    mean_absolute_percentage_error,
    mean_squared_logarithmic_error,
    poisson,
)

_LOSS_CLASSES: dict[str, type[Loss]] = {cls.__name__: cls for cls in (
    SparseCategoricalCrossentropy, CategoricalCrossentropy, BinaryCrossentropy, MeanSquaredError, MeanAbsoluteError,
    *_regression_losses.CLASSES, *_classification_losses.CLASSES, *_batch_losses.CLASSES, LossFunctionWrapper)}
_LOSS_FUNCTIONS: dict[str, Callable[..., Tensor]] = {fn.__name__: fn for fn in (
    sparse_categorical_crossentropy, categorical_crossentropy, binary_crossentropy, mean_squared_error,
    mean_absolute_error, *_regression_losses.FUNCTIONS, *_classification_losses.FUNCTIONS,
    *_batch_losses.FUNCTIONS)}
# Keras's names: each loss function's name (which get() turns into its class, crossentropies on logits) and
# Keras's short aliases. Class names ("Huber") are found too, through _LOSS_CLASSES.
_LOSSES: dict[str, type[Loss]] = {
    "sparse_categorical_crossentropy": SparseCategoricalCrossentropy,
    "categorical_crossentropy": CategoricalCrossentropy,
    "binary_crossentropy": BinaryCrossentropy,
    "mean_squared_error": MeanSquaredError,
    "mean_absolute_error": MeanAbsoluteError,
    **{fn.__name__: cls for fn, cls in zip(
        (*_regression_losses.FUNCTIONS, *_classification_losses.FUNCTIONS, *_batch_losses.FUNCTIONS),
        (*_regression_losses.CLASSES, *_classification_losses.CLASSES, *_batch_losses.CLASSES))},
    "mse": MeanSquaredError,
    "mae": MeanAbsoluteError,
    "mape": MeanAbsolutePercentageError,
    "msle": MeanSquaredLogarithmicError,
    "bce": BinaryCrossentropy,
    "kld": KLDivergence,
    "kullback_leibler_divergence": KLDivergence,
    "logcosh": LogCosh,
}
_LOSSES_BY_CLASS_NAME: dict[str, type[Loss]] = {
    name.lower(): cls for name, cls in _LOSS_CLASSES.items() if cls is not LossFunctionWrapper}


def serialize(loss: Loss) -> dict[str, Any] | None:
    """{"class_name": ..., "config": ...} (JSON), or None for a loss no config can rebuild (a subclass of
    yours, a torch.nn module, a function of your own)."""
    from mirrored.training import _config  # here: this module imports without the rest of mirrored

    return _config.to_config(loss, _LOSS_CLASSES)


def deserialize(config: Mapping[str, Any]) -> Loss:
    """The loss serialize() described, rebuilt from this module's classes by name."""
    from mirrored.training import _config

    return _config.from_config(config, _LOSS_CLASSES, "loss")


def get(identifier: str | Loss | Mapping[str, Any] | nn.Module | Callable[[Any, Tensor], Tensor]) -> Loss:
    """A loss object from a name in _LOSSES (crossentropies with from_logits=True), a Loss (returned
    as is), a serialize() config, a torch.nn loss module (wrapped, see TorchLossWrapper), or a function
    fn(y_true, y_pred) -> per-example losses."""
    if isinstance(identifier, Loss):
        return identifier
    if _is_keras_object(identifier):
        return _from_keras(identifier)
    if isinstance(identifier, str):
        try:
            return (_LOSSES.get(identifier.lower()) or _LOSSES_BY_CLASS_NAME[identifier.lower()])()
        except KeyError:
            raise ValueError(f"unknown loss {identifier!r}. Known names: {', '.join(_LOSSES)}; or pass a loss "
                             "object, a torch.nn loss module, or a function(y_true, y_pred).") from None
    if isinstance(identifier, Mapping):
        return deserialize(identifier)
    if isinstance(identifier, nn.Module):
        if not hasattr(identifier, "reduction"):
            raise TypeError(
                f"losses.get: {type(identifier).__name__} is an nn.Module without a `reduction` attribute, so its "
                "argument order and reduction are unknown. Pass a function instead: "
                "lambda y_true, y_pred: per-example losses."
            )
        return TorchLossWrapper(identifier)
    if isinstance(identifier, type) and issubclass(identifier, Loss):
        return identifier()
    if callable(identifier):
        return LossFunctionWrapper(identifier)
    raise TypeError(f"losses.get: cannot make a loss from {identifier!r} ({type(identifier).__name__}). "
                    f"Pass one of {', '.join(_LOSSES)}, a loss object, a torch.nn loss module, or a function.")


def _is_keras_object(identifier: Any) -> bool:
    return not isinstance(identifier, type) and type(identifier).__module__.startswith("keras.")


_KERAS_REDUCTIONS = {"sum_over_batch_size": "sum_over_batch_size", "mean": "sum_over_batch_size", "sum": "sum",
                     "none": "none", None: "none"}


def _from_keras(keras_loss: Any) -> Loss:
    """Ours of the same class and settings for a keras.losses object given for a torch module, so that it
    computes what Keras's would (its from_logits as the user set it, Keras's default False)."""
    cls = _LOSS_CLASSES.get(type(keras_loss).__name__)
    if cls is None or cls is LossFunctionWrapper or not hasattr(keras_loss, "get_config"):
        raise TypeError(f"losses.get: {keras_loss!r} is a Keras object that mr.losses has no class for. Pass an "
                        "mr.losses loss, a name, or a function(y_true, y_pred) returning one loss per example.")
    # Keras's configs leave out some arguments (Huber's delta, CosineSimilarity's axis) that its wrapper keeps.
    config = {**getattr(keras_loss, "_fn_kwargs", {}), **keras_loss.get_config()}
    config.pop("dtype", None)
    reduction = config.get("reduction")
    if reduction not in _KERAS_REDUCTIONS:
        raise ValueError(f"losses.get({keras_loss!r}): reduction={reduction!r} divides by the sum of the sample "
                         "weights, which is not supported. Use \"sum_over_batch_size\" (Keras's default) or \"sum\".")
    config["reduction"] = _KERAS_REDUCTIONS[reduction]
    return cls.from_config(config)

