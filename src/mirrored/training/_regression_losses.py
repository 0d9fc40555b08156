"""Keras 3's regression and distribution losses on torch: MeanAbsolutePercentageError,
MeanSquaredLogarithmicError, Huber, LogCosh, CosineSimilarity, Poisson and KLDivergence.

Each is a per-example function with Keras's formula (the mean or sum over the last axis; a 1-D input
holds one value per example) and a LossFunctionWrapper subclass with Keras's defaults. None of them
has from_logits in Keras, so none has it here: Poisson takes rates, KLDivergence probabilities.
Loaded by losses.py, which re-exports these names (import them from there): this module uses
losses.py's helpers.
"""
from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from mirrored.training.losses import _EPSILON, LossFunctionWrapper, _check_tensors, _match_rank, _mean_last_axis


def _pair(what: str, y_true: Any, y_pred: Tensor) -> tuple[Tensor, Tensor]:
    """Checked tensors of the same shape (Keras's squeeze_or_expand_to_same_rank), labels in y_pred's dtype."""
    y_true, y_pred = _match_rank(what, *_check_tensors(what, y_true, y_pred))
    return y_true.to(y_pred.dtype), y_pred


def _sum_last_axis(values: Tensor) -> Tensor:
    return values.sum(dim=-1) if values.ndim >= 2 else values


def mean_absolute_percentage_error(y_true: Any, y_pred: Tensor) -> Tensor:
    """100 * mean(|y_true - y_pred| / max(|y_true|, 1e-7)) over the last axis, per example."""
    y_true, y_pred = _pair("mean_absolute_percentage_error", y_true, y_pred)
    return 100.0 * _mean_last_axis(((y_true - y_pred) / y_true.abs().clamp(min=_EPSILON)).abs())


def mean_squared_logarithmic_error(y_true: Any, y_pred: Tensor) -> Tensor:
    """mean((log(max(y_pred, 1e-7) + 1) - log(max(y_true, 1e-7) + 1))^2) over the last axis, per example."""
    y_true, y_pred = _pair("mean_squared_logarithmic_error", y_true, y_pred)
    return _mean_last_axis((torch.log1p(y_pred.clamp(min=_EPSILON)) - torch.log1p(y_true.clamp(min=_EPSILON))).square())


def huber(y_true: Any, y_pred: Tensor, delta: float = 1.0) -> Tensor:
    """Mean over the last axis of 0.5 * e^2 where |e| <= delta, else delta * |e| - 0.5 * delta^2."""
    y_true, y_pred = _pair("huber", y_true, y_pred)
    error = y_pred - y_true
    abs_error = error.abs()
    return _mean_last_axis(torch.where(abs_error <= delta, 0.5 * error.square(), delta * abs_error - 0.5 * delta ** 2))


def log_cosh(y_true: Any, y_pred: Tensor) -> Tensor:
    """mean(log(cosh(y_pred - y_true))) over the last axis, computed as x + softplus(-2x) - log 2 (no overflow)."""
    y_true, y_pred = _pair("log_cosh", y_true, y_pred)
    x = y_pred - y_true
    return _mean_last_axis(x + F.softplus(-2.0 * x) - math.log(2.0))


def _l2_normalize(x: Tensor, dim: int) -> Tensor:
    """Keras's ops.normalize: x * min(rsqrt(sum(x^2)), 1 / 1e-7), so a zero vector stays zero."""
    return x * torch.rsqrt(x.square().sum(dim=dim, keepdim=True)).clamp(max=1.0 / _EPSILON)


def cosine_similarity(y_true: Any, y_pred: Tensor, axis: int = -1) -> Tensor:
    """-sum(l2_normalize(y_true) * l2_normalize(y_pred)) over `axis`: -1 for the same direction, 0 where
    either is a zero vector."""
    y_true, y_pred = _pair("cosine_similarity", y_true, y_pred)
    if y_pred.ndim < 2:
        raise ValueError(f"cosine_similarity: y_pred has shape {tuple(y_pred.shape)}; expected one vector per example, "
                         "shape (batch, dims).")
    return -(_l2_normalize(y_true, axis) * _l2_normalize(y_pred, axis)).sum(dim=axis)


def poisson(y_true: Any, y_pred: Tensor) -> Tensor:
    """mean(y_pred - y_true * log(y_pred + 1e-7)) over the last axis: y_pred are rates (positive)."""
    y_true, y_pred = _pair("poisson", y_true, y_pred)
    return _mean_last_axis(y_pred - y_true * torch.log(y_pred + _EPSILON))


def kl_divergence(y_true: Any, y_pred: Tensor) -> Tensor:
    """sum(y_true * log(y_true / y_pred)) over the last axis, both clipped to [1e-7, 1] (probabilities)."""
    y_true, y_pred = _pair("kl_divergence", y_true, y_pred)
    y_true, y_pred = y_true.clamp(_EPSILON, 1.0), y_pred.clamp(_EPSILON, 1.0)
    return _sum_last_axis(y_true * torch.log(y_true / y_pred))


class MeanAbsolutePercentageError(LossFunctionWrapper):
    """100 * mean(|(y_true - y_pred) / y_true|) per example (keras.losses.MeanAbsolutePercentageError)."""

    def __init__(self, reduction: str = "sum_over_batch_size", name: str = "mean_absolute_percentage_error"):
        super().__init__(mean_absolute_percentage_error, reduction, name)


class MeanSquaredLogarithmicError(LossFunctionWrapper):
    """mean((log(y_pred + 1) - log(y_true + 1))^2) per example (keras.losses.MeanSquaredLogarithmicError)."""

    def __init__(self, reduction: str = "sum_over_batch_size", name: str = "mean_squared_logarithmic_error"):
        super().__init__(mean_squared_logarithmic_error, reduction, name)


class Huber(LossFunctionWrapper):
    """Quadratic below `delta`, linear above (keras.losses.Huber)."""

    def __init__(self, delta: float = 1.0, reduction: str = "sum_over_batch_size", name: str = "huber_loss"):
        if isinstance(delta, bool) or not isinstance(delta, (int, float)) or not delta > 0:
            raise ValueError(f"Huber(delta={delta!r}): must be a number > 0 (where the loss turns from quadratic to "
                             "linear).")
        super().__init__(huber, reduction, name, delta=float(delta))
        self.delta = float(delta)


class LogCosh(LossFunctionWrapper):
    """log(cosh(y_pred - y_true)) averaged per example (keras.losses.LogCosh)."""

    def __init__(self, reduction: str = "sum_over_batch_size", name: str = "log_cosh"):
        super().__init__(log_cosh, reduction, name)


class CosineSimilarity(LossFunctionWrapper):
    """The negative cosine similarity of y_true and y_pred along `axis` (keras.losses.CosineSimilarity)."""

    def __init__(self, axis: int = -1, reduction: str = "sum_over_batch_size", name: str = "cosine_similarity"):
        super().__init__(cosine_similarity, reduction, name, axis=axis)
        self.axis = axis


class Poisson(LossFunctionWrapper):
    """y_pred - y_true * log(y_pred) averaged per example, y_pred being rates (keras.losses.Poisson)."""

    def __init__(self, reduction: str = "sum_over_batch_size", name: str = "poisson"):
        super().__init__(poisson, reduction, name)


class KLDivergence(LossFunctionWrapper):
    """Kullback-Leibler divergence of the probabilities y_pred from y_true, per example
    (keras.losses.KLDivergence: probabilities, not logits)."""

    def __init__(self, reduction: str = "sum_over_batch_size", name: str = "kl_divergence"):
        super().__init__(kl_divergence, reduction, name)


FUNCTIONS = (mean_absolute_percentage_error, mean_squared_logarithmic_error, huber, log_cosh, cosine_similarity,
             poisson, kl_divergence)
CLASSES = (MeanAbsolutePercentageError, MeanSquaredLogarithmicError, Huber, LogCosh, CosineSimilarity, Poisson,
           KLDivergence)
