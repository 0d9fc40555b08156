"""Keras 3's losses whose value is a statistic of the whole batch: Dice, Tversky (with axis=None,
Keras's default) and Circle (each example against every other one of the batch).

Their `per_example` gives values whose mean over the batch is Keras's loss of that batch: Dice and
Tversky repeat the batch's value for every example; Circle scales its per-example values as
Keras's mask does (divided by the share of examples that have both a positive and a negative).
Under strategy.run each replica computes the statistic over its own part of the batch, as under
tf.distribute, which differs from one device: the first such call on several replicas warns.
Dice and Tversky with an `axis` that leaves the batch axis out are per-example and the same on any
number of replicas. Loaded by losses.py, which re-exports these names (import them from there).
"""
from __future__ import annotations

import warnings
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from mirrored.training.losses import _EPSILON, LossFunctionWrapper, _check_tensors, _replica_context, _shape


def _axes(what: str, axis: int | Sequence[int] | None, ndim: int) -> tuple[int, ...] | None:
    if axis is None:
        return None
    axes = (axis,) if isinstance(axis, int) else tuple(axis)
    try:
        return tuple(sorted(a % ndim for a in axes)) if ndim else None
    except TypeError:
        raise TypeError(f"{what}(axis={axis!r}): give None or ints (the axes to sum over).") from None


def _overlap_inputs(what: str, y_true: Any, y_pred: Tensor) -> tuple[Tensor, Tensor]:
    y_true, y_pred = _check_tensors(what, y_true, y_pred)
    if y_true.shape != y_pred.shape:
        raise ValueError(f"{what}: y_true has shape {_shape(y_true)} but y_pred has shape {_shape(y_pred)}; masks "
                         "and predictions must have the same shape.")
    return y_true.to(y_pred.dtype), y_pred


def _sum(values: Tensor, axes: tuple[int, ...] | None) -> Tensor:
    return values.sum() if axes is None else values.sum(dim=axes)


def dice(y_true: Any, y_pred: Tensor, axis: int | Sequence[int] | None = None) -> Tensor:
    """1 - 2 * sum(y_true * y_pred) / (sum(y_true) + sum(y_pred) + 1e-7), summed over `axis` (None: every
    value of the batch, one number, as Keras)."""
    y_true, y_pred = _overlap_inputs("dice", y_true, y_pred)
    axes = _axes("dice", axis, y_pred.ndim)
    intersection = _sum(y_true * y_pred, axes)
    return 1.0 - 2.0 * intersection / (_sum(y_true, axes) + _sum(y_pred, axes) + _EPSILON)


def tversky(y_true: Any, y_pred: Tensor, alpha: float = 0.5, beta: float = 0.5,
            axis: int | Sequence[int] | None = None) -> Tensor:
    """1 - TP / (TP + alpha * FP + beta * FN + 1e-7) of soft masks, summed over `axis` (None: the whole batch).
    Keras's formula, in which alpha weighs sum((1 - y_pred) * y_true) and beta sum(y_pred * (1 - y_true))."""
    y_true, y_pred = _overlap_inputs("tversky", y_true, y_pred)
    axes = _axes("tversky", axis, y_pred.ndim)
    intersection = _sum(y_true * y_pred, axes)
    fp = _sum((1.0 - y_pred) * y_true, axes)
    fn = _sum(y_pred * (1.0 - y_true), axes)
    return 1.0 - intersection / (intersection + fp * alpha + fn * beta + _EPSILON)


def circle(y_true: Any, y_pred: Tensor, ref_labels: Any = None, ref_embeddings: Tensor | None = None,
           remove_diagonal: bool = True, gamma: float = 80.0, margin: float = 0.4) -> Tensor:
    """Circle loss (Sun et al., 2020) of each L2-normalised embedding against the reference ones (by
    default the batch itself): softplus of the log-sum-exp of weighted positive and negative cosine
    distances; 0 for an example without a positive or a negative."""
    what = "circle"
    y_true, y_pred = _check_tensors(what, y_true, y_pred)
    if y_pred.ndim != 2:
        raise ValueError(f"{what}: y_pred has shape {_shape(y_pred)}; expected embeddings (batch, dims).")
    labels = y_true.reshape(-1).long()
    if labels.shape[0] != y_pred.shape[0]:
        raise ValueError(f"{what}: {labels.shape[0]} labels for {y_pred.shape[0]} embeddings; give one integer "
                         "label per example.")
    refs = y_pred if ref_embeddings is None else torch.as_tensor(ref_embeddings, device=y_pred.device)
    ref_labels = labels if ref_labels is None else torch.as_tensor(ref_labels, device=y_pred.device).reshape(-1).long()
    distances = (1.0 - y_pred @ refs.T).clamp(min=0.0)
    positive = labels[:, None] == ref_labels[None, :]
    negative = ~positive
    if remove_diagonal:
        positive &= ~torch.eye(labels.shape[0], ref_labels.shape[0], dtype=torch.bool, device=y_pred.device)
    pos_weights = ((margin + distances) * positive).clamp(min=0.0)
    neg_weights = ((1.0 + margin - distances) * negative).clamp(min=0.0)
    pos = -gamma * pos_weights * (margin - distances)
    neg = gamma * neg_weights * (1.0 - margin - distances)
    p_loss = torch.logsumexp(pos.masked_fill(~positive, float("-inf")), dim=1)
    n_loss = torch.logsumexp(neg.masked_fill(~negative, float("-inf")), dim=1)
    return F.softplus(p_loss + n_loss)


def _warn_if_split(loss: LossFunctionWrapper, fix: str) -> None:
    """Warns once per loss object when its batch statistic is taken on one replica's part of the batch."""
    if getattr(loss, "_split_warned", False):
        return
    ctx = _replica_context()
    if ctx is not None and int(ctx.num_replicas_in_sync) > 1:
        loss._split_warned = True  # racy across replica threads: at worst two of them warn
        warnings.warn(f"{loss.name} on {int(ctx.num_replicas_in_sync)} replicas: the loss is a statistic of the whole "
                      "batch, and each replica computes it over its own part (as under tf.distribute), so it "
                      f"differs from one device's. {fix}", UserWarning, stacklevel=4)


_DICE_FIX = "Pass axis=(1, ...) (every axis but the batch's) for one value per example, the same on any replica count."


def _repeat_per_example(value: Tensor, y_pred: Tensor) -> Tensor:
    """One batch's value as one per example: their mean is the value, their gradient the value's."""
    return value.expand(y_pred.shape[0]) if y_pred.ndim else value.reshape(1)


class Dice(LossFunctionWrapper):
    """1 - the Dice coefficient of soft masks (keras.losses.Dice). axis=None (Keras's default) takes it over
    the whole batch; axis=(1, 2, 3) gives one value per image."""

    def __init__(self, reduction: str = "sum_over_batch_size", name: str = "dice",
                 axis: int | Sequence[int] | None = None):
        axis = list(axis) if isinstance(axis, (list, tuple)) else axis
        super().__init__(dice, reduction, name, axis=axis)
        self.axis = axis

    def _per_example(self, y_true: Any, y_pred: Tensor) -> Tensor:
        losses = dice(y_true, y_pred, self.axis)
        axes = _axes(self.name, self.axis, y_pred.ndim)
        if axes is None or 0 in axes:
            _warn_if_split(self, _DICE_FIX)
            return _repeat_per_example(losses, y_pred)
        return losses


class Tversky(LossFunctionWrapper):
    """1 - the Tversky index of soft masks, weighing false positives by alpha and false negatives by beta
    (keras.losses.Tversky; alpha = beta = 0.5 is Dice). axis as for Dice."""

    def __init__(self, alpha: float = 0.5, beta: float = 0.5, reduction: str = "sum_over_batch_size",
                 name: str = "tversky", axis: int | Sequence[int] | None = None):
        axis = list(axis) if isinstance(axis, (list, tuple)) else axis
        super().__init__(tversky, reduction, name, alpha=alpha, beta=beta, axis=axis)
        self.alpha, self.beta, self.axis = alpha, beta, axis

    def _per_example(self, y_true: Any, y_pred: Tensor) -> Tensor:
        losses = tversky(y_true, y_pred, self.alpha, self.beta, self.axis)
        axes = _axes(self.name, self.axis, y_pred.ndim)
        if axes is None or 0 in axes:
            _warn_if_split(self, _DICE_FIX)
            return _repeat_per_example(losses, y_pred)
        return losses


class Circle(LossFunctionWrapper):
    """Circle loss between integer labels and L2-normalised embeddings (keras.losses.Circle): pulls each
    embedding towards those of its class in the batch and away from the others."""

    def __init__(self, gamma: float = 80.0, margin: float = 0.4, remove_diagonal: bool = True,
                 reduction: str = "sum_over_batch_size", name: str = "circle"):
        super().__init__(circle, reduction, name, gamma=gamma, margin=margin, remove_diagonal=remove_diagonal)
        self.gamma, self.margin, self.remove_diagonal = gamma, margin, remove_diagonal

    def _per_example(self, y_true: Any, y_pred: Tensor) -> Tensor:
        _warn_if_split(self, "Use a global batch large enough for every replica's part to hold pairs of "
                                       "each class, or train on one replica.")
        losses = circle(y_true, y_pred, remove_diagonal=self.remove_diagonal, gamma=self.gamma, margin=self.margin)
        if self.reduction != "sum_over_batch_size":
            return losses
        # Keras masks the zero losses (examples without a positive or a negative): the mean is over the others.
        valid = (losses > 0).sum()
        return torch.where(valid > 0, losses * losses.shape[0] / valid.clamp(min=1), torch.zeros_like(losses))


FUNCTIONS = (dice, tversky, circle)
CLASSES = (Dice, Tversky, Circle)
