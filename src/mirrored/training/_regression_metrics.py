"""Keras 3's regression and correlation metrics: MeanSquaredError, MeanAbsoluteError,
MeanAbsolutePercentageError, MeanSquaredLogarithmicError, RootMeanSquaredError, CosineSimilarity,
LogCoshError, R2Score, PearsonCorrelation and ConcordanceCorrelation.

Each keeps sums (Mean's total and count, R2Score's per-output sums) in sync-on-read state that adds up
across replicas, so a result read in cross-replica context is the one-device result. The per-example
values come from mr.losses' functions where Keras's metric and loss share one. Loaded by metrics.py,
which re-exports these names (import them from there).
"""
from __future__ import annotations

import threading
import warnings
from typing import Any

import torch
from torch import Tensor

from mirrored.training import losses
from mirrored.training.metrics import _RESULT_DTYPE, _STATE_DTYPE, Mean, MeanMetricWrapper, Metric, _tensors


class MeanSquaredError(MeanMetricWrapper):
    """The mean of (y_true - y_pred)^2 (keras.metrics.MeanSquaredError)."""

    def __init__(self, name: str = "mean_squared_error"):
        super().__init__(losses.mean_squared_error, name)


class MeanAbsoluteError(MeanMetricWrapper):
    """The mean of |y_true - y_pred| (keras.metrics.MeanAbsoluteError)."""

    def __init__(self, name: str = "mean_absolute_error"):
        super().__init__(losses.mean_absolute_error, name)


class MeanAbsolutePercentageError(MeanMetricWrapper):
    """100 * the mean of |(y_true - y_pred) / y_true| (keras.metrics.MeanAbsolutePercentageError)."""

    def __init__(self, name: str = "mean_absolute_percentage_error"):
        super().__init__(losses.mean_absolute_percentage_error, name)


class MeanSquaredLogarithmicError(MeanMetricWrapper):
    """The mean of (log(y_pred + 1) - log(y_true + 1))^2 (keras.metrics.MeanSquaredLogarithmicError)."""

    def __init__(self, name: str = "mean_squared_logarithmic_error"):
        super().__init__(losses.mean_squared_logarithmic_error, name)


class CosineSimilarity(MeanMetricWrapper):
    """The mean cosine similarity of y_true and y_pred along `axis`, in [-1, 1]
    (keras.metrics.CosineSimilarity: the loss's value with the sign turned)."""

    def __init__(self, name: str = "cosine_similarity", axis: int = -1):
        super().__init__(_cosine_similarity, name, axis=axis)


def _cosine_similarity(y_true: Any, y_pred: Any, axis: int = -1) -> Tensor:
    return -losses.cosine_similarity(*_tensors(y_true, y_pred), axis=axis)


class LogCoshError(MeanMetricWrapper):
    """The mean of log(cosh(y_pred - y_true)) (keras.metrics.LogCoshError; Keras names it "logcosh")."""

    def __init__(self, name: str = "logcosh"):
        super().__init__(losses.log_cosh, name)


class RootMeanSquaredError(Mean):
    """sqrt of the (weighted) mean of (y_pred - y_true)^2 over every sample seen
    (keras.metrics.RootMeanSquaredError): the square root is taken of the summed state, once."""

    def __init__(self, name: str = "root_mean_squared_error"):
        super().__init__(name)

    def update_state(self, y_true: Any, y_pred: Any, sample_weight: Any = None) -> None:
        """Adds the batch's squared errors (averaged per sample), weighted by `sample_weight`."""
        y_true, y_pred = _tensors(y_true, y_pred)
        y_true, y_pred = losses._match_rank(self.name, y_true.to(_STATE_DTYPE), y_pred.to(_STATE_DTYPE))
        super().update_state((y_pred - y_true).square(), sample_weight)

    def result(self) -> Tensor:
        """The root of the mean squared error over every replica's samples; 0 before any."""
        return super().result().sqrt()


def _centred(values: Tensor, axis: int) -> Tensor:
    return values - values.mean(dim=axis, keepdim=True)


def pearson_correlation(y_true: Any, y_pred: Any, axis: int = -1) -> Tensor:
    """Pearson's correlation of y_true and y_pred along `axis`, one per example for (batch, n) inputs
    (Keras's formula: population standard deviations)."""
    y_true, y_pred = losses._match_rank("pearson_correlation", *_tensors(y_true, y_pred))
    y_true, y_pred = y_true.to(y_pred.dtype), y_pred
    t, p = _centred(y_true, axis), _centred(y_pred, axis)
    t = t / t.std(dim=axis, keepdim=True, correction=0)
    p = p / p.std(dim=axis, keepdim=True, correction=0)
    return (t * p).mean(dim=axis)


def concordance_correlation(y_true: Any, y_pred: Any, axis: int = -1) -> Tensor:
    """Lin's concordance correlation of y_true and y_pred along `axis`, computed as Keras 3.15 does
    (its covariance term centres y_true on y_pred's mean)."""
    y_true, y_pred = losses._match_rank("concordance_correlation", *_tensors(y_true, y_pred))
    y_true = y_true.to(y_pred.dtype)
    mean_t, mean_p = y_true.mean(dim=axis, keepdim=True), y_pred.mean(dim=axis, keepdim=True)
    var_t = _centred(y_true - mean_t, axis).square().mean(dim=axis, keepdim=True)
    var_p = _centred(y_pred - mean_p, axis).square().mean(dim=axis, keepdim=True)
    covariance = (y_true - mean_p) * (y_pred - mean_p)
    norm = var_t + var_p + (mean_t - mean_p).square()
    return (2 * covariance / (norm + losses._EPSILON)).mean(dim=axis)


class PearsonCorrelation(MeanMetricWrapper):
    """The mean over examples of Pearson's correlation along `axis` (keras.metrics.PearsonCorrelation).
    For 1-D inputs the correlation is over the batch, one value per update, as in Keras: under
    strategy.run that is each replica's part, so it depends on the replica count."""

    def __init__(self, name: str = "pearson_correlation", axis: int = -1):
        super().__init__(pearson_correlation, name, axis=axis)


class ConcordanceCorrelation(MeanMetricWrapper):
    """The mean over examples of the concordance correlation along `axis`
    (keras.metrics.ConcordanceCorrelation; 1-D inputs as PearsonCorrelation's)."""

    def __init__(self, name: str = "concordance_correlation", axis: int = -1):
        super().__init__(concordance_correlation, name, axis=axis)


_AGGREGATIONS = (None, "uniform_average", "variance_weighted_average")


class R2Score(Metric):
    """The coefficient of determination, 1 - SS_res / SS_tot per output, aggregated over outputs
    (keras.metrics.R2Score), from sums that add up across replicas. num_regressors > 0 gives the
    adjusted score. Its state (one entry per output) is made at the first update: inside
    strategy.run every replica must make that first update together (fit does)."""

    def __init__(self, class_aggregation: str | None = "uniform_average", num_regressors: int = 0,
                 name: str = "r2_score"):
        if class_aggregation not in _AGGREGATIONS:
            raise ValueError(f"R2Score(class_aggregation={class_aggregation!r}): expected one of {list(_AGGREGATIONS)}.")
        if isinstance(num_regressors, bool) or not isinstance(num_regressors, int) or num_regressors < 0:
            raise ValueError(f"R2Score(num_regressors={num_regressors!r}): must be an int >= 0.")
        super().__init__(name)
        self.class_aggregation = class_aggregation
        self.num_regressors = num_regressors
        self.num_samples = self.add_state("num_samples")
        self._sums: tuple[Any, ...] | None = None
        self._build_lock = threading.Lock()

    def _build(self, outputs: int) -> tuple[Any, ...]:
        # Variables made inside strategy.run meet in a merge_call, which hands every replica the same
        # objects; the lock only keeps one replica's list of them.
        made = tuple(self.add_state(n, (outputs,), keep=False)
                     for n in ("squared_sum", "sum", "total_mse", "count"))
        with self._build_lock:
            if self._sums is None:
                self._sums = made
                self._state.extend(made)
        return self._sums

    def _state_pending(self) -> bool:
        """Whether the per-output sums are still to be made (by the first update, or _build_state)."""
        return self._sums is None

    def _build_state(self, y_true: Any, y_pred: Any) -> None:
        """Makes the per-output sums for batches shaped like y_pred, before any update: mr.Model does so in
        cross-replica context at its first step, where a replica's part may be empty."""
        del y_true
        ndim = getattr(y_pred, "ndim", 0)
        if self._sums is None and ndim in (1, 2):
            self._build(1 if ndim == 1 else y_pred.shape[1])

    def _fits_saved_state(self, shapes: list[tuple[int, ...]]) -> bool:
        """Whether a checkpoint's state of these shapes is this metric's, before its first update made it."""
        return (self._sums is None and len(shapes) == 5 and shapes[0] == () and len(set(shapes[1:])) == 1
                and len(shapes[1]) == 1)

    def _build_saved_state(self, shapes: list[tuple[int, ...]]) -> None:
        """Makes the state _fits_saved_state accepted, for a restore to fill."""
        self._build(shapes[1][0])

    def update_state(self, y_true: Any, y_pred: Any, sample_weight: Any = None) -> None:
        """Adds the batch's per-output sums of y, y^2, squared errors and weights."""
        y_true, y_pred = _tensors(y_true, y_pred)
        y_true, y_pred = y_true.to(_STATE_DTYPE), y_pred.to(_STATE_DTYPE)
        if y_pred.ndim == 1:
            y_true, y_pred = y_true.reshape(-1, 1), y_pred.reshape(-1, 1)
        if y_true.ndim == 1:
            y_true = y_true.reshape(-1, 1)
        if y_true.shape != y_pred.shape or y_pred.ndim != 2:
            raise ValueError(f"{self.name}: y_true of shape {tuple(y_true.shape)} and y_pred of shape "
                             f"{tuple(y_pred.shape)}; expected the same shape (batch, outputs) or (batch,).")
        squared_sum, total, total_mse, count = self._sums or self._build(y_pred.shape[1])
        if squared_sum.shape[0] != y_pred.shape[1]:
            raise ValueError(f"{self.name}: y_pred has {y_pred.shape[1]} outputs, but the metric was built for "
                             f"{squared_sum.shape[0]} by its first update.")
        weight = torch.ones_like(y_true) if sample_weight is None else torch.as_tensor(
            sample_weight, device=y_true.device).detach().to(_STATE_DTYPE)
        if weight.ndim == 1:
            weight = weight.unsqueeze(1)
        weight = torch.broadcast_to(weight, y_true.shape)
        total.assign_add((weight * y_true).sum(dim=0))
        squared_sum.assign_add((y_true * weight * y_true).sum(dim=0))
        total_mse.assign_add(((y_true - y_pred).square() * weight).sum(dim=0))
        count.assign_add(weight.sum(dim=0))
        self.num_samples.assign_add(y_true.numel())

    def result(self) -> Tensor:
        """The score over every replica's samples; 0 before any update."""
        if self._sums is None:
            return torch.zeros((), dtype=_RESULT_DTYPE)
        squared_sum, total, total_mse, count = (v.read_value() for v in self._sums)
        mean = total / count
        spread = squared_sum - total * mean
        raw = 1 - total_mse / spread
        raw = torch.where(raw.isinf(), torch.zeros_like(raw), raw)
        if self.class_aggregation == "uniform_average":
            score = raw.mean()
        elif self.class_aggregation == "variance_weighted_average":
            score = (spread * raw).sum() / spread.sum()
        else:
            score = raw
        n, p = float(self.num_samples.read_value()), self.num_regressors
        if p:
            if p >= n - 1:
                warnings.warn(f"{self.name}: num_regressors={p} needs more than {p + 1} samples (seen: {n:g}) for the "
                              "adjusted score; this is the standard R2 score.", UserWarning, stacklevel=2)
            else:
                score = 1 - (1 - score) * (n - 1) / (n - p - 1)
        return score.to(_RESULT_DTYPE)

    def get_config(self) -> dict[str, Any]:
        """The constructor's arguments, as JSON (Keras's get_config); from_config(config) rebuilds it."""
        return {"class_aggregation": self.class_aggregation, "num_regressors": self.num_regressors, "name": self.name}


CLASSES = (MeanSquaredError, MeanAbsoluteError, MeanAbsolutePercentageError, MeanSquaredLogarithmicError,
           RootMeanSquaredError, CosineSimilarity, LogCoshError, R2Score, PearsonCorrelation, ConcordanceCorrelation)
FUNCTIONS = (_cosine_similarity, pearson_correlation, concordance_correlation)
