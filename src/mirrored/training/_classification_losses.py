"""Keras 3's margin, focal and sequence classification losses on torch: Hinge, SquaredHinge,
CategoricalHinge, BinaryFocalCrossentropy, CategoricalFocalCrossentropy,
CategoricalGeneralizedCrossEntropy and CTC.

Per-example functions with Keras's formulas, and LossFunctionWrapper subclasses with Keras's
defaults, except that the focal crossentropies take logits by default (from_logits=True), as every
crossentropy of mr.losses does. Hinges take raw scores; CategoricalGeneralizedCrossEntropy takes
probabilities (Keras has no from_logits there); CTC takes logits, as Keras's does.
Loaded by losses.py, which re-exports these names (import them from there).
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from mirrored.training.losses import (
    _EPSILON,
    LossFunctionWrapper,
    _check_labels_in_range,
    _check_tensors,
    _match_rank,
    _mean_last_axis,
    _shape,
)


def _hinge_labels(y_true: Tensor) -> Tensor:
    """Keras's rule: labels that are all 0 or 1 become -1 or 1; others stay as given. For labels in {-1, 1}
    a batch of only 1s maps to itself, so the rule gives the same per-example values on any split."""
    binary = ((y_true == 0) | (y_true == 1)).all()
    return torch.where(binary, 2.0 * y_true - 1.0, y_true)


def hinge(y_true: Any, y_pred: Tensor) -> Tensor:
    """mean(max(1 - y_true * y_pred, 0)) over the last axis; labels -1/1 (or 0/1, converted)."""
    y_true, y_pred = _match_rank("hinge", *_check_tensors("hinge", y_true, y_pred))
    y_true = _hinge_labels(y_true.to(y_pred.dtype))
    return _mean_last_axis((1.0 - y_true * y_pred).clamp(min=0.0))


def squared_hinge(y_true: Any, y_pred: Tensor) -> Tensor:
    """mean(max(1 - y_true * y_pred, 0)^2) over the last axis; labels -1/1 (or 0/1, converted)."""
    y_true, y_pred = _match_rank("squared_hinge", *_check_tensors("squared_hinge", y_true, y_pred))
    y_true = _hinge_labels(y_true.to(y_pred.dtype))
    return _mean_last_axis((1.0 - y_true * y_pred).clamp(min=0.0).square())


def categorical_hinge(y_true: Any, y_pred: Tensor) -> Tensor:
    """max(max((1 - y_true) * y_pred) - sum(y_true * y_pred) + 1, 0) over the classes; one-hot labels."""
    what = "categorical_hinge"
    y_true, y_pred = _check_tensors(what, y_true, y_pred)
    if y_true.shape != y_pred.shape:
        raise ValueError(f"{what}: y_true has shape {_shape(y_true)} but y_pred has shape {_shape(y_pred)}; "
                         "one-hot labels must have the scores' shape.")
    y_true = y_true.to(y_pred.dtype)
    pos = (y_true * y_pred).sum(dim=-1)
    neg = ((1.0 - y_true) * y_pred).amax(dim=-1)
    return (neg - pos + 1.0).clamp(min=0.0)


def binary_focal_crossentropy(y_true: Any, y_pred: Tensor, apply_class_balancing: bool = False, alpha: float = 0.25,
                              gamma: float = 2.0, from_logits: bool = True, label_smoothing: float = 0.0,
                              axis: int = -1) -> Tensor:
    """Binary crossentropy scaled by (1 - p_t)^gamma (and by alpha / 1 - alpha with class balancing),
    averaged over `axis`. As Keras: logits go through a sigmoid, then probabilities are clipped to
    [1e-7, 1 - 1e-7] before the log."""
    what = "binary_focal_crossentropy"
    y_true, y_pred = _match_rank(what, *_check_tensors(what, y_true, y_pred))
    y_true = y_true.to(y_pred.dtype)
    if label_smoothing:
        y_true = y_true * (1.0 - label_smoothing) + 0.5 * label_smoothing
    p = torch.sigmoid(y_pred) if from_logits else y_pred
    clipped = p.clamp(_EPSILON, 1.0 - _EPSILON)
    bce = -(y_true * clipped.log() + (1.0 - y_true) * (1.0 - clipped).log())
    p_t = y_true * p + (1.0 - y_true) * (1.0 - p)
    focal = (1.0 - p_t).pow(gamma) * bce
    if apply_class_balancing:
        focal = (y_true * alpha + (1.0 - y_true) * (1.0 - alpha)) * focal
    return focal.mean(dim=axis) if focal.ndim >= 2 else focal


def categorical_focal_crossentropy(y_true: Any, y_pred: Tensor, alpha: float | Sequence[float] = 0.25,
                                   gamma: float = 2.0, from_logits: bool = True, label_smoothing: float = 0.0,
                                   axis: int = -1) -> Tensor:
    """Categorical crossentropy with each class's term scaled by alpha * (1 - p)^gamma; alpha may be one
    weight per class. As Keras: softmax of logits, rows renormalised and clipped to [1e-7, 1 - 1e-7]."""
    what = "categorical_focal_crossentropy"
    y_true, y_pred = _check_tensors(what, y_true, y_pred)
    if y_true.shape != y_pred.shape:
        hint = " Integer class ids: one-hot them first (F.one_hot)." if y_true.ndim == y_pred.ndim - 1 else ""
        raise ValueError(f"{what}: y_true has shape {_shape(y_true)} but y_pred has shape {_shape(y_pred)}; "
                         f"one-hot labels must have the logits' shape.{hint}")
    y_true = y_true.to(y_pred.dtype)
    if label_smoothing:
        y_true = y_true * (1.0 - label_smoothing) + label_smoothing / y_true.shape[-1]
    probs = F.softmax(y_pred, dim=axis) if from_logits else y_pred
    probs = (probs / probs.sum(dim=axis, keepdim=True)).clamp(_EPSILON, 1.0 - _EPSILON)
    weight = torch.as_tensor(alpha, dtype=y_pred.dtype, device=y_pred.device) * (1.0 - probs).pow(gamma)
    return (weight * -y_true * probs.log()).sum(dim=axis)


def categorical_generalized_cross_entropy(y_true: Any, y_pred: Tensor, q: float = 0.5) -> Tensor:
    """(1 - p^q) / q, p the probability of the labelled class: integer labels, probabilities y_pred."""
    what = "categorical_generalized_cross_entropy"
    y_true, y_pred = _check_tensors(what, y_true, y_pred)
    if y_true.ndim == y_pred.ndim and y_true.shape[-1] == 1:
        y_true = y_true.squeeze(-1)
    if y_true.shape != y_pred.shape[:-1]:
        raise ValueError(f"{what}: labels of shape {_shape(y_true)} do not fit probabilities of shape "
                         f"{_shape(y_pred)}: expected one class id per example, shape {tuple(y_pred.shape[:-1])}.")
    labels = y_true.long()
    _check_labels_in_range(what, labels, y_pred, y_pred.shape[-1], None)
    p = y_pred.gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    return (1.0 - p.pow(q)) / q


def ctc(y_true: Any, y_pred: Tensor) -> Tensor:
    """Connectionist temporal classification loss per sequence: labels (batch, max_label_length) of class
    ids, 0 being the blank that also pads them; y_pred logits (batch, time, classes), every step counted."""
    what = "ctc"
    y_true, y_pred = _check_tensors(what, y_true, y_pred)
    if y_true.ndim != 2 or y_pred.ndim != 3:
        raise ValueError(f"{what}: labels of shape {_shape(y_true)} and logits of shape {_shape(y_pred)}; expected "
                         "labels (batch, max_label_length) of class ids padded with 0 (the blank) and logits "
                         "(batch, time, classes).")
    labels = y_true.long()
    _check_labels_in_range(what, labels, y_pred, y_pred.shape[-1], None)
    batch, steps = y_pred.shape[0], y_pred.shape[1]
    log_probs = F.log_softmax(y_pred.float() if y_pred.dtype in (torch.float16, torch.bfloat16) else y_pred, dim=-1)
    input_lengths = torch.full((batch,), steps, dtype=torch.long, device=y_pred.device)
    return F.ctc_loss(log_probs.transpose(0, 1), labels, input_lengths, (labels != 0).sum(dim=-1), blank=0,
                      reduction="none")


def _check_smoothing(cls: str, label_smoothing: Any) -> None:
    if not 0 <= label_smoothing <= 1:
        raise ValueError(f"{cls}(label_smoothing={label_smoothing}): must be in [0, 1].")


class Hinge(LossFunctionWrapper):
    """Hinge loss of scores against -1/1 labels (0/1 converted), keras.losses.Hinge."""

    def __init__(self, reduction: str = "sum_over_batch_size", name: str = "hinge"):
        super().__init__(hinge, reduction, name)


class SquaredHinge(LossFunctionWrapper):
    """Squared hinge loss of scores against -1/1 labels (0/1 converted), keras.losses.SquaredHinge."""

    def __init__(self, reduction: str = "sum_over_batch_size", name: str = "squared_hinge"):
        super().__init__(squared_hinge, reduction, name)


class CategoricalHinge(LossFunctionWrapper):
    """Hinge loss between one-hot labels and scores, keras.losses.CategoricalHinge."""

    def __init__(self, reduction: str = "sum_over_batch_size", name: str = "categorical_hinge"):
        super().__init__(categorical_hinge, reduction, name)


class BinaryFocalCrossentropy(LossFunctionWrapper):
    """Binary crossentropy that down-weights easy examples by (1 - p_t)^gamma (Lin et al., 2018);
    keras.losses.BinaryFocalCrossentropy, on logits by default."""

    _probability_axis = None

    def __init__(self, apply_class_balancing: bool = False, alpha: float = 0.25, gamma: float = 2.0,
                 from_logits: bool = True, label_smoothing: float = 0.0, axis: int = -1,
                 reduction: str = "sum_over_batch_size", name: str = "binary_focal_crossentropy"):
        _check_smoothing("BinaryFocalCrossentropy", label_smoothing)
        super().__init__(binary_focal_crossentropy, reduction, name, apply_class_balancing=apply_class_balancing,
                         alpha=alpha, gamma=gamma, from_logits=from_logits, label_smoothing=label_smoothing, axis=axis)
        self.apply_class_balancing, self.alpha, self.gamma = apply_class_balancing, alpha, gamma
        self.label_smoothing, self.axis = label_smoothing, axis


class CategoricalFocalCrossentropy(LossFunctionWrapper):
    """Categorical crossentropy that down-weights easy examples by alpha * (1 - p)^gamma;
    keras.losses.CategoricalFocalCrossentropy, on logits by default. alpha may be a list, one per class."""

    def __init__(self, alpha: float | Sequence[float] = 0.25, gamma: float = 2.0, from_logits: bool = True,
                 label_smoothing: float = 0.0, axis: int = -1, reduction: str = "sum_over_batch_size",
                 name: str = "categorical_focal_crossentropy"):
        _check_smoothing("CategoricalFocalCrossentropy", label_smoothing)
        alpha = list(alpha) if isinstance(alpha, (list, tuple)) else alpha
        super().__init__(categorical_focal_crossentropy, reduction, name, alpha=alpha, gamma=gamma,
                         from_logits=from_logits, label_smoothing=label_smoothing, axis=axis)
        self.alpha, self.gamma, self.label_smoothing, self.axis = alpha, gamma, label_smoothing, axis
        self._probability_axis = axis


class CategoricalGeneralizedCrossEntropy(LossFunctionWrapper):
    """(1 - p^q) / q between integer labels and probabilities, robust to noisy labels (Zhang & Sabuncu,
    2018); keras.losses.CategoricalGeneralizedCrossEntropy."""

    def __init__(self, q: float = 0.5, reduction: str = "sum_over_batch_size",
                 name: str = "categorical_generalized_cross_entropy"):
        if isinstance(q, bool) or not isinstance(q, (int, float)) or not 0 < q < 1:
            raise ValueError(f"CategoricalGeneralizedCrossEntropy(q={q!r}): must be in (0, 1): near 0 it behaves as "
                             "crossentropy, near 1 as mean absolute error.")
        super().__init__(categorical_generalized_cross_entropy, reduction, name, q=q)
        self.q = q


class CTC(LossFunctionWrapper):
    """Connectionist temporal classification loss between 0-padded label sequences and per-step logits
    (keras.losses.CTC; torch's ctc_loss computes it, as Keras's torch backend does)."""

    def __init__(self, reduction: str = "sum_over_batch_size", name: str = "ctc"):
        super().__init__(ctc, reduction, name)


FUNCTIONS = (hinge, squared_hinge, categorical_hinge, binary_focal_crossentropy, categorical_focal_crossentropy,
             categorical_generalized_cross_entropy, ctc)
CLASSES = (Hinge, SquaredHinge, CategoricalHinge, BinaryFocalCrossentropy, CategoricalFocalCrossentropy,
           CategoricalGeneralizedCrossEntropy, CTC)
