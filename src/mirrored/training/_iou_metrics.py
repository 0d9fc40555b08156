"""Keras 3's intersection-over-union metrics: IoU, MeanIoU, BinaryIoU, OneHotIoU and OneHotMeanIoU.

Each accumulates a (num_classes, num_classes) confusion matrix of weighted counts (rows: true class,
columns: predicted class) in sync-on-read state that adds up across replicas; the IoU of class c is
TP / (TP + FP + FN) of the summed matrix, averaged over the target classes present. Loaded by
metrics.py, which re-exports these names (import them from there).
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from mirrored.training.losses import _broadcast_sample_weight
from mirrored.training.metrics import _RESULT_DTYPE, _STATE_DTYPE, Metric, _check_threshold, _probabilities, _tensors

_EPSILON = 1e-7  # Keras's backend epsilon, added to the IoU's denominators


class IoU(Metric):
    """The mean IoU over `target_class_ids` of a segmentation or classification (keras.metrics.IoU).
    Labels (and predictions, with sparse_y_pred=True) are class ids; sparse_y_true=False /
    sparse_y_pred=False take the argmax over `axis` first. Labels equal to ignore_class, and ids
    outside [0, num_classes), are left out."""

    def __init__(self, num_classes: int, target_class_ids: Sequence[int], name: str | None = None,
                 ignore_class: int | None = None, sparse_y_true: bool = True, sparse_y_pred: bool = True,
                 axis: int = -1):
        cls = type(self).__name__
        if isinstance(num_classes, bool) or not isinstance(num_classes, int) or num_classes < 1:
            raise ValueError(f"{cls}(num_classes={num_classes!r}): must be an int >= 1.")
        target_class_ids = [int(t) for t in target_class_ids]
        bad = [t for t in target_class_ids if not 0 <= t < num_classes]
        if bad or not target_class_ids:
            raise ValueError(f"{cls}(target_class_ids={target_class_ids}): give class ids in [0, {num_classes}).")
        super().__init__(name or "io_u")
        self.num_classes, self.target_class_ids, self.ignore_class = num_classes, target_class_ids, ignore_class
        self.sparse_y_true, self.sparse_y_pred, self.axis = sparse_y_true, sparse_y_pred, axis
        self.total_cm = self.add_state("total_confusion_matrix", (num_classes, num_classes))

    def _predicted_ids(self, y_pred: Tensor) -> Tensor:
        return y_pred if self.sparse_y_pred else y_pred.argmax(dim=self.axis)

    def update_state(self, y_true: Any, y_pred: Any, sample_weight: Any = None) -> None:
        """Adds the batch's weighted (true class, predicted class) counts to the confusion matrix."""
        y_true, y_pred = _tensors(y_true, y_pred)
        if not self.sparse_y_true:
            y_true = y_true.argmax(dim=self.axis)
        predicted = self._predicted_ids(y_pred)
        if y_true.numel() != predicted.numel():
            raise ValueError(f"{self.name}: {y_true.numel()} labels for {predicted.numel()} predictions "
                             f"(y_true {tuple(y_true.shape)}, y_pred {tuple(y_pred.shape)}); they must match one to one.")
        labels = y_true.reshape(predicted.shape).long()
        n = self.num_classes
        if sample_weight is None:
            weight = torch.ones(labels.numel(), dtype=_STATE_DTYPE, device=labels.device)
        else:  # one weight per example (shape (batch,)) covers its every pixel; or one per label
            weight = _broadcast_sample_weight(torch.as_tensor(sample_weight).detach().to(_STATE_DTYPE),
                                              labels.to(_STATE_DTYPE), self.name).reshape(-1)
        labels, predicted = labels.reshape(-1), predicted.reshape(-1).long()
        kept = (labels >= 0) & (labels < n) & (predicted >= 0) & (predicted < n)
        if self.ignore_class is not None:
            kept &= labels != self.ignore_class
        weight = torch.where(kept, weight, torch.zeros_like(weight))
        cells = torch.where(kept, labels * n + predicted, torch.zeros_like(labels))
        self.total_cm.assign_add(torch.bincount(cells, weights=weight, minlength=n * n).reshape(n, n))

    def result(self) -> Tensor:
        """The IoU averaged over the target classes that occur (in labels or predictions) on any replica."""
        cm = self.total_cm.read_value()
        tp = cm.diagonal()
        denominator = cm.sum(dim=0) + cm.sum(dim=1) - tp
        ids = torch.tensor(self.target_class_ids, device=cm.device)
        tp, denominator = tp[ids], denominator[ids]
        valid = denominator > 1e-9
        iou = torch.where(valid, tp / (denominator + _EPSILON), torch.zeros_like(tp))
        return (iou.sum() / (valid.sum() + _EPSILON)).to(_RESULT_DTYPE)

    def get_config(self) -> dict[str, Any]:
        """The constructor's arguments, as JSON (Keras's get_config); from_config(config) rebuilds it."""
        return {"num_classes": self.num_classes, "target_class_ids": self.target_class_ids, "name": self.name,
                "ignore_class": self.ignore_class, "sparse_y_true": self.sparse_y_true,
                "sparse_y_pred": self.sparse_y_pred, "axis": self.axis}


class MeanIoU(IoU):
    """The IoU averaged over every class (keras.metrics.MeanIoU)."""

    def __init__(self, num_classes: int, name: str | None = None, ignore_class: int | None = None,
                 sparse_y_true: bool = True, sparse_y_pred: bool = True, axis: int = -1):
        super().__init__(num_classes, list(range(num_classes)), name or "mean_io_u", ignore_class, sparse_y_true,
                         sparse_y_pred, axis)

    def get_config(self) -> dict[str, Any]:
        """The constructor's arguments, as JSON (Keras's get_config); from_config(config) rebuilds it."""
        config = super().get_config()
        del config["target_class_ids"]
        return config


class OneHotIoU(IoU):
    """IoU for one-hot labels and per-class scores (keras.metrics.OneHotIoU)."""

    def __init__(self, num_classes: int, target_class_ids: Sequence[int], name: str | None = None,
                 ignore_class: int | None = None, sparse_y_pred: bool = False, axis: int = -1):
        super().__init__(num_classes, target_class_ids, name or "one_hot_io_u", ignore_class, False, sparse_y_pred,
                         axis)

    def get_config(self) -> dict[str, Any]:
        """The constructor's arguments, as JSON (Keras's get_config); from_config(config) rebuilds it."""
        config = super().get_config()
        del config["sparse_y_true"]
        return config


class OneHotMeanIoU(IoU):
    """MeanIoU for one-hot labels and per-class scores (keras.metrics.OneHotMeanIoU)."""

    def __init__(self, num_classes: int, name: str | None = None, ignore_class: int | None = None,
                 sparse_y_pred: bool = False, axis: int = -1):
        super().__init__(num_classes, list(range(num_classes)), name or "one_hot_mean_io_u", ignore_class, False,
                         sparse_y_pred, axis)

    def get_config(self) -> dict[str, Any]:
        """The constructor's arguments, as JSON (Keras's get_config); from_config(config) rebuilds it."""
        config = super().get_config()
        del config["sparse_y_true"], config["target_class_ids"]
        return config


class BinaryIoU(IoU):
    """IoU of a binary segmentation (keras.metrics.BinaryIoU): a prediction >= threshold is class 1.
    Keras takes probabilities; from_logits=True applies a sigmoid first."""

    def __init__(self, target_class_ids: Sequence[int] = (0, 1), threshold: float = 0.5, name: str | None = None,
                 from_logits: bool = False):
        _check_threshold("BinaryIoU", "threshold", threshold)
        super().__init__(2, target_class_ids, name or "binary_io_u")
        self.threshold, self.from_logits = float(threshold), from_logits

    def _predicted_ids(self, y_pred: Tensor) -> Tensor:
        return (_probabilities(y_pred, self.from_logits) >= self.threshold).long()

    def get_config(self) -> dict[str, Any]:
        """The constructor's arguments, as JSON (Keras's get_config); from_config(config) rebuilds it."""
        return {"target_class_ids": self.target_class_ids, "threshold": self.threshold, "name": self.name,
                "from_logits": self.from_logits}


CLASSES = (IoU, MeanIoU, BinaryIoU, OneHotIoU, OneHotMeanIoU)
