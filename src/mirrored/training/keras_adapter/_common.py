"""What every part of the Keras adapter asks of Keras: whether the program imported it, whether an
object is a Keras one, and Keras's device scope on a replica. Keras is never imported here: an
object is a Keras one only if `keras` is already in sys.modules. Uses torch and keras."""
from __future__ import annotations

import contextlib
import sys
from typing import Any

import torch

import mirrored.distribute as md


def keras() -> Any:
    """The keras module if the program imported it, else None (we never import it ourselves)."""
    return sys.modules.get("keras")


def is_keras_model(obj: Any) -> bool:
    """Whether `obj` is a Keras 3 layer or model (checked without importing keras)."""
    module = keras()
    return module is not None and isinstance(obj, module.layers.Layer)


def is_keras(obj: Any, kind: str) -> bool:
    """Whether `obj` is a Keras optimizer, loss or metric (`kind`), as an instance or a class."""
    module = keras()
    if module is None:
        return False
    base = {"optimizer": module.optimizers.Optimizer, "loss": module.losses.Loss, "metric": module.metrics.Metric}[kind]
    return isinstance(obj, base) or (isinstance(obj, type) and issubclass(obj, base))


def check_model(model: Any, where: str = "mr.Model") -> None:
    """Refuses a Keras model of another backend than torch (it would not be an nn.Module), and one not
    built yet: each replica would draw its own initial weights at its first call."""
    module = keras()
    if module is not None and module.backend.backend() != "torch":
        raise ValueError(f"{where}({type(model).__name__}): Keras runs on the {module.backend.backend()!r} backend, "
                         "but mirrored trains torch modules. Set KERAS_BACKEND=torch before importing keras.")
    if not model.built or not model.variables:
        raise ValueError(f"{where}({type(model).__name__}): the Keras model is not built yet (it has no variables), "
                         "so every replica would create its own at its first call. Build it first: start it with "
                         "keras.Input(shape), call model.build(input_shape), or call it once on a sample batch.")


def device_scope(device: torch.device) -> Any:
    """Keras's device scope on a CUDA replica (Keras moves the tensors it converts to its current
    device, which is per thread); nothing on the CPU."""
    module = keras()
    if module is None or device.type == "cpu":
        return contextlib.nullcontext()
    return module.device(str(device))


def in_replica_step() -> bool:
    """Whether this thread runs a replica of a strategy's step, where torch's random ops draw from the
    replica's generator (mirrored.distribute's replica random mode)."""
    return md.has_strategy() and md.get_replica_context() is not None
