"""Keras 3's probabilistic, hinge and top-k metrics: BinaryCrossentropy, CategoricalCrossentropy,
SparseCategoricalCrossentropy, KLDivergence, Poisson, Hinge, SquaredHinge, CategoricalHinge and
TopKCategoricalAccuracy.

Each is the (weighted) mean of a per-example function, mr.losses' where the loss is the same, kept in
Mean's sync-on-read sums. The crossentropies take Keras's from_logits=False by default, as Keras's
metric classes do; made from a name (metrics.get) they take logits, as the loss names do. Loaded by
metrics.py, which re-exports these names (import them from there).
"""
from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from mirrored.training import losses
from mirrored.training.metrics import (
    _STATE_DTYPE,
    Mean,
    MeanMetricWrapper,
    _class_ids,
    _tensors,
    sparse_top_k_categorical_accuracy,
)


class BinaryCrossentropy(MeanMetricWrapper):
    """The mean binary crossentropy (keras.metrics.BinaryCrossentropy); from_logits=True for logits."""

    def __init__(self, name: str = "binary_crossentropy", from_logits: bool = False, label_smoothing: float = 0.0):
        super().__init__(losses.binary_crossentropy, name, from_logits=from_logits, label_smoothing=label_smoothing)
        self.from_logits = from_logits


class CategoricalCrossentropy(MeanMetricWrapper):
    """The mean crossentropy of one-hot labels (keras.metrics.CategoricalCrossentropy)."""

    def __init__(self, name: str = "categorical_crossentropy", from_logits: bool = False,
                 label_smoothing: float = 0.0, axis: int = -1):
        super().__init__(losses.categorical_crossentropy, name, from_logits=from_logits,
                         label_smoothing=label_smoothing, axis=axis)
        self.from_logits = from_logits


class SparseCategoricalCrossentropy(MeanMetricWrapper):
    """The mean crossentropy of integer labels (keras.metrics.SparseCategoricalCrossentropy); labels equal
    to ignore_class are left out of the mean, as Keras's mask leaves them out."""

    def __init__(self, name: str = "sparse_categorical_crossentropy", from_logits: bool = False,
                 ignore_class: int | None = None, axis: int = -1):
        super().__init__(losses.sparse_categorical_crossentropy, name, from_logits=from_logits,
                         ignore_class=ignore_class, axis=axis)
        self.from_logits = from_logits

    def update_state(self, y_true: Any, y_pred: Any, sample_weight: Any = None) -> None:
        """Adds the batch's crossentropies, weighted by `sample_weight`; ignored labels weigh 0."""
        ignore = self._fn_kwargs["ignore_class"]
        if ignore is None:
            super().update_state(y_true, y_pred, sample_weight)
            return
        y_true, y_pred = _tensors(y_true, y_pred)
        values = self._fn(y_true, y_pred, **self._fn_kwargs)
        kept = (y_true.reshape(values.shape) != ignore).to(_STATE_DTYPE)
        weight = kept if sample_weight is None else kept * torch.as_tensor(
            sample_weight, device=kept.device).detach().to(_STATE_DTYPE).reshape(kept.shape)
        Mean.update_state(self, values, weight)


class KLDivergence(MeanMetricWrapper):
    """The mean Kullback-Leibler divergence of probabilities (keras.metrics.KLDivergence)."""

    def __init__(self, name: str = "kl_divergence"):
        super().__init__(losses.kl_divergence, name)


class Poisson(MeanMetricWrapper):
    """The mean Poisson loss of rates (keras.metrics.Poisson)."""

    def __init__(self, name: str = "poisson"):
        super().__init__(losses.poisson, name)


class Hinge(MeanMetricWrapper):
    """The mean hinge loss (keras.metrics.Hinge)."""

    def __init__(self, name: str = "hinge"):
        super().__init__(losses.hinge, name)


class SquaredHinge(MeanMetricWrapper):
    """The mean squared hinge loss (keras.metrics.SquaredHinge)."""

    def __init__(self, name: str = "squared_hinge"):
        super().__init__(losses.squared_hinge, name)


class CategoricalHinge(MeanMetricWrapper):
    """The mean categorical hinge loss (keras.metrics.CategoricalHinge)."""

    def __init__(self, name: str = "categorical_hinge"):
        super().__init__(losses.categorical_hinge, name)


def top_k_categorical_accuracy(y_true: Any, y_pred: Any, k: int = 5) -> Tensor:
    """1.0 where the class of the largest one-hot label entry is among the k highest scores (ties with
    the k-th score count, as tf.math.in_top_k)."""
    y_true, y_pred = _tensors(y_true, y_pred)
    if y_true.shape != y_pred.shape:
        raise ValueError(f"top_k_categorical_accuracy: y_true has shape {tuple(y_true.shape)} but y_pred has shape "
                         f"{tuple(y_pred.shape)}; one-hot labels must match (integer labels need "
                         "sparse_top_k_categorical_accuracy).")
    labels = y_true.argmax(dim=-1)
    _class_ids("top_k_categorical_accuracy", labels, y_pred)
    return sparse_top_k_categorical_accuracy(labels, y_pred, k=k)


class TopKCategoricalAccuracy(MeanMetricWrapper):
    """How often the one-hot label's class is among the k highest scores (keras.metrics.TopKCategoricalAccuracy)."""

    def __init__(self, k: int = 5, name: str = "top_k_categorical_accuracy"):
        if isinstance(k, bool) or not isinstance(k, int) or k < 1:
            raise ValueError(f"TopKCategoricalAccuracy(k={k!r}): k must be a positive int.")
        super().__init__(top_k_categorical_accuracy, name, k=k)


CLASSES = (BinaryCrossentropy, CategoricalCrossentropy, SparseCategoricalCrossentropy, KLDivergence, Poisson, Hinge,
           SquaredHinge, CategoricalHinge, TopKCategoricalAccuracy)
FUNCTIONS = (top_k_categorical_accuracy,)
