"""keras.losses and keras.metrics objects under a strategy, computed by Keras: KerasLoss (per-example
values that mr.Model reduces over the global batch as Keras reduces one device's batch) and
KerasMetric (each replica updates a fresh copy on its part; the variables add up across replicas,
read once). loss() and metric() resolve compile()'s arguments for a Keras model: names as Keras
means them (probabilities unless from_logits=True). Uses _common.py, losses.py, metrics.py and keras.
"""
from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

import mirrored.distribute as md
from mirrored.training import losses as losses_lib, metrics as metrics_lib
from mirrored.training.keras_adapter._common import device_scope, is_keras, keras as _keras


class KerasLoss(losses_lib.Loss):
    """A Keras loss (object, function or name) computed by Keras: its per-example values, reduced
    over the GLOBAL batch by Model.fit as Keras reduces one device's batch."""

    def __init__(self, keras_loss: Any):
        keras = _keras()
        if isinstance(keras_loss, keras.losses.Loss):
            obj = keras_loss
        else:  # a name or a function: Keras's compile wraps it in a LossFunctionWrapper
            fn = keras.losses.get(keras_loss) if isinstance(keras_loss, str) else keras_loss
            name = keras_loss if isinstance(keras_loss, str) else getattr(fn, "__name__", "loss")
            from keras.src.losses.losses import LossFunctionWrapper  # (not exported; what compile uses)

            obj = LossFunctionWrapper(fn, name=name)
        reduction = {"mean": "sum_over_batch_size", None: "none"}.get(obj.reduction, obj.reduction)
        if reduction not in ("sum_over_batch_size", "sum", "none"):
            raise ValueError(f"compile(loss={keras_loss!r}): reduction={obj.reduction!r} is not supported (it divides "
                             "by the sum of the sample weights, which we do not all-reduce). Use "
                             "reduction=\"sum_over_batch_size\" (Keras's default) or \"sum\".")
        config = getattr(obj, "_fn_kwargs", None) or {}
        super().__init__(name=obj.name, reduction=reduction, from_logits=False)
        self.keras_loss = obj
        self.from_logits = bool(getattr(obj, "from_logits", config.get("from_logits", False)))
        ignore = getattr(obj, "ignore_class", config.get("ignore_class"))
        if ignore is not None:
            self.ignore_class = ignore
        self._dtype = obj.dtype

    def _per_example(self, y_true: Any, y_pred: Tensor) -> Tensor:
        keras = _keras()
        y_pred = keras.ops.convert_to_tensor(y_pred, dtype=self._dtype)
        y_true = keras.ops.convert_to_tensor(y_true, dtype=self._dtype)
        return self.keras_loss.call(y_true, y_pred)

    def get_config(self) -> dict[str, Any]:
        raise NotImplementedError(f"{self!r}: a Keras loss is recorded by Keras's own config, not ours.")

    def __repr__(self) -> str:
        return f"KerasLoss({self.keras_loss!r})"


def loss(identifier: Any) -> losses_lib.Loss:
    """compile(loss=...) for a Keras model: a name, function or keras.losses object as Keras means it
    (probabilities unless from_logits=True); an mr.losses object or torch loss as it is."""
    if isinstance(identifier, str):
        try:
            _keras().losses.get(identifier)
        except ValueError as e:
            raise ValueError(f"compile(loss={identifier!r}): Keras does not know this loss ({e}).") from None
    elif isinstance(identifier, type) and is_keras(identifier, "loss"):
        identifier = identifier()
    elif not (is_keras(identifier, "loss") or (callable(identifier) and
                                                getattr(identifier, "__module__", "").startswith("keras"))):
        return losses_lib.get(identifier)
    return KerasLoss(identifier)




class KerasMetric(metrics_lib.Metric):
    """A keras.metrics object under a strategy: each replica updates a fresh copy of it on its batch
    and adds the copy's variables (Keras creates metric variables with aggregation="sum") to this
    metric's sync-on-read state; result() sets a copy's variables to the replicas' sum and asks it."""

    def __init__(self, keras_metric: Any):
        bad = [v.path for v in keras_metric.variables if v.aggregation != "sum"]
        if bad:
            raise ValueError(f"compile(metrics=[{keras_metric!r}]): its variables {bad} are aggregated by "
                             "another rule than a sum, so replicas' parts cannot be combined. Use a metric "
                             "whose state adds up (mean, accuracy, AUC, precision, ...).")
        super().__init__(keras_metric.name)
        self.keras_metric = keras_metric
        self._config = (type(keras_metric), keras_metric.get_config())
        self._copies: dict[int, Any] = {}
        self._reader = self._fresh()
        self._totals = [self.add_state(f"v{i}", tuple(v.shape)) for i, v in enumerate(keras_metric.variables)]

    def _fresh(self) -> Any:
        cls, config = self._config
        return cls.from_config(config)

    def update_state(self, y_true: Any, y_pred: Any, sample_weight: Any = None) -> None:
        ctx = md.get_replica_context()
        rid = 0 if ctx is None else getattr(ctx, "local_replica_id", ctx.replica_id_in_sync_group)
        part = self._copies.get(rid)
        if part is None:
            part = self._copies[rid] = self._fresh()
        device = y_pred.device if isinstance(y_pred, Tensor) else torch.device("cpu")
        with device_scope(device), torch.no_grad():
            part.reset_state()
            part.update_state(y_true, y_pred, sample_weight=sample_weight)
            for total, v in zip(self._totals, part.variables):
                total.assign_add(v.value.detach().to(total.dtype))

    def result(self) -> Tensor:
        with torch.no_grad():
            for total, v in zip(self._totals, self._reader.variables):
                v.assign(total.read_value().to(v.value.device, v.value.dtype))
            return torch.as_tensor(self._reader.result()).float()

    def get_config(self) -> dict[str, Any]:
        raise NotImplementedError(f"{self!r}: a Keras metric is recorded by Keras's own config, not ours.")

    def __repr__(self) -> str:
        return f"KerasMetric({self.keras_metric!r})"


def metric(identifier: Any, loss_name: str | None) -> metrics_lib.Metric:
    """compile(metrics=[...]) for a Keras model: names as Keras means them (probabilities), a
    keras.metrics object computed by Keras (KerasMetric), anything else as for any module."""
    if is_keras(identifier, "metric"):
        return KerasMetric(identifier() if isinstance(identifier, type) else identifier)
    try:
        return metrics_lib.get(identifier, loss_name=loss_name, from_logits=False)
    except ValueError:
        if not isinstance(identifier, str):
            raise
    keras = _keras()  # a name we do not have ("f1_score", "r2_score", ...): Keras's metric of that name
    try:
        found = keras.metrics.get(identifier)
    except ValueError as e:
        raise ValueError(f"compile(metrics=[{identifier!r}]): neither mirrored nor Keras knows this metric ({e}).") \
            from None
    if not isinstance(found, keras.metrics.Metric):
        found = keras.metrics.MeanMetricWrapper(found, name=identifier)
    return KerasMetric(found)


