"""BatchNormalization over the global batch: a layer convert_sync_batchnorm flags computes its batch
statistics over every replica's part in training, as tf.keras's BatchNormalization(synchronized=True)
under MirroredStrategy (Keras on torch refuses that argument). patches() lists what install()
replaces in Keras. Uses _common.py, _replicas.py, mirrored.distribute and keras."""
from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

import mirrored.distribute as md
from mirrored.training.keras_adapter import _replicas
from mirrored.training.keras_adapter._common import is_keras_model, keras

_GLOBAL_BN = "_mirrored_global_batch"  # the flag convert_sync_batchnorm sets on a layer (copied with it)


def _global_moments(layer: Any, inputs: Tensor) -> tuple[Tensor, Tensor]:
    """Mean and (biased) variance per channel over every replica's part of the batch, by Keras's own
    formula on one device (E[x^2] - E[x]^2), differentiable through the exchange: ctx.all_reduce's
    gradient is the all-reduce of the incoming gradients, since every replica's statistics enter every
    replica's loss."""
    axes = list(layer._reduction_axes)
    channels = inputs.shape[layer.axis]
    count = inputs.numel() // channels if channels else 0
    # The exchange in float64: the sums of replicas' parts add no rounding of their own, and the count
    # stays exact past float32's 2**24.
    f64 = torch.float64
    local = torch.cat([inputs.sum(dim=axes).to(f64), inputs.square().sum(dim=axes).to(f64),
                       inputs.new_full((1,), float(count), dtype=f64)])
    step = _replicas.current()
    if step is not None:
        # A Keras model's own step weighs each replica's gradients by what its loss weighs in one device's
        # (its share of the batch): the statistics' gradient from this replica's loss is scaled by that
        # share on its way out, and what arrives here is divided by it, since the gradients it reaches are
        # weighed by it again. A padded replica (a row copied, share 0) counts in no statistic.
        share = step.loss_share
        local = _scale_gradient(local, 1 / share if share else 0.0) * (1.0 if share else 0.0)
    total = md.get_replica_context().all_reduce(md.ReduceOp.SUM, local)
    if step is not None:
        total = _scale_gradient(total, step.loss_share)
    n = total[-1].clamp_min(1)
    mean = total[:channels] / n
    variance = total[channels:2 * channels] / n - mean.square()
    return mean.to(inputs.dtype), variance.to(inputs.dtype)


def _scale_gradient(t: Tensor, factor: float) -> Tensor:
    """`t`, whose gradient is multiplied by `factor` on its way back (the value is unchanged)."""
    if factor == 1.0:
        return t
    return t.detach() + (t - t.detach()) * factor


def patches() -> list[tuple[Any, str, Any]]:
    """(owner, attribute, replacement) for BatchNormalization._moments: global-batch statistics for a
    flagged layer in a multi-replica step; Keras's own everywhere else (one replica: one device)."""
    from keras.src.layers.normalization.batch_normalization import BatchNormalization

    keras_moments = BatchNormalization._moments

    def _moments(self: Any, inputs: Any, mask: Any) -> Any:
        ctx = md.get_replica_context()
        if not getattr(self, _GLOBAL_BN, False) or ctx is None or ctx.num_replicas_in_sync < 2:
            return keras_moments(self, inputs, mask)
        if mask is not None:
            raise ValueError(f"BatchNormalization {self.name!r} (converted by mr.layers.convert_sync_batchnorm) got "
                             "a mask: masked statistics over the global batch are not supported. Leave this layer "
                             "per-replica (do not convert it), or drop the mask before it.")
        return _global_moments(self, inputs)

    _moments.__doc__ = keras_moments.__doc__
    return [(BatchNormalization, "_moments", _moments)]


def convert_sync_batchnorm(model: Any) -> Any:
    """`model` (a Keras layer or model) with every BatchNormalization computing its batch statistics
    over the global batch of all replicas in training. Changes `model` in place."""
    from mirrored.training.keras_adapter._install import install  # (_install imports this module)

    install()
    found = [layer for layer in model._flatten_layers(include_self=True, recursive=True)
             if isinstance(layer, keras().layers.BatchNormalization)]
    for layer in found:
        object.__setattr__(layer, _GLOBAL_BN, True)
    return model


def has_global_batchnorm(module: Any) -> bool:
    """True for a Keras model holding a layer convert_sync_batchnorm converted (its training forward
    joins a collective: every replica must call it, also on an empty part of the batch)."""
    if not is_keras_model(module):
        return False
    return any(getattr(layer, _GLOBAL_BN, False) for layer in module._flatten_layers(include_self=True, recursive=True))
