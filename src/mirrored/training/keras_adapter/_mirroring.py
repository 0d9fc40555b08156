"""How a Keras model is mirrored: an independent copy per replica (copy_model) and the variables its
layers assign in call, which the replicas' copies combine after every step (state_tensors). Both are
registered with mirrored.distribute by install(). Uses _common.py and keras."""
from __future__ import annotations

import copy
import copyreg
import sys
import threading
import weakref
from typing import Any

from torch import Tensor, nn

from mirrored.training.keras_adapter._common import check_model, is_keras_model

_STATE: "weakref.WeakKeyDictionary[nn.Module, tuple[int, list[tuple[Tensor, str]]]]" = weakref.WeakKeyDictionary()


def state_tensors(module: nn.Module) -> list[tuple[Tensor, str]] | None:
    """The non-trainable variables of a Keras model copy, each with how the replicas' copies combine:
    "mean" (floating point: BatchNormalization's moving statistics, as tf.keras's sync-on-read MEAN)
    or "first" (replica 0's: integer seed generator states, and aggregation="only_first_replica").
    None for a module that is not a Keras one."""
    if not is_keras_model(module):
        return None
    params = [p for p in module.parameters() if not p.requires_grad]
    key = sum(id(p) for p in params)  # (a layer frozen since: recomputed)
    cached = _STATE.get(module)
    if cached is not None and cached[0] == key:
        return cached[1]
    aggregation = {id(v.value): v.aggregation for v in module.variables}
    found = []
    for p in params:
        how = aggregation.get(id(p), "none")
        if how == "sum":
            raise ValueError(f"{type(module).__name__}: a non-trainable variable of shape {tuple(p.shape)} has "
                             "aggregation=\"sum\"; its replicas' assignments cannot be combined as one device's. "
                             "Use aggregation=\"mean\" or \"only_first_replica\" for variables a layer assigns.")
        found.append((p, "first" if how == "only_first_replica" or not p.is_floating_point() else "mean"))
    _STATE[module] = (key, found)
    return found


_COPY_LOCK = threading.Lock()
_COPY_RECURSION_LIMIT = 100_000


def _as_object(self: Any, memo: dict) -> Any:
    """copy.deepcopy of a Keras object as a Python object (its attributes copied), not through
    Keras's __reduce__, which saves and reloads the model (custom layers would have to be registered
    and a subclassed model to have a config)."""
    return copy._reconstruct(self, memo, copyreg.__newobj__, (type(self),), self.__getstate__())


def _copy_dynamic_backend(self: Any, memo: dict) -> Any:
    """copy.deepcopy of Keras's DynamicBackend: a new one for the same backend."""
    return type(self)(self._backend)


def copy_model(module: nn.Module) -> nn.Module | None:
    """An independent copy of a Keras model for another replica (None for other modules): every
    variable a new torch Parameter, the layers' graph and settings the same."""
    if not is_keras_model(module):
        return None
    check_model(module, "strategy.mirror")
    from keras.src.saving.keras_saveable import KerasSaveable
    from keras.src.utils.backend_utils import DynamicBackend

    with _COPY_LOCK:
        KerasSaveable.__deepcopy__ = _as_object  # type: ignore[attr-defined]
        # A preprocessing layer's DynamicBackend (RandomFlip.backend, ...) answers every missing attribute
        # through self._backend, so copy's probe of a bare new instance for __setstate__ recursed without
        # end (a segmentation fault under the raised limit below; found porting keras.io's "Image
        # classification from scratch"). It holds only the backend's name: a new one with that name.
        DynamicBackend.__deepcopy__ = _copy_dynamic_backend  # type: ignore[attr-defined]
        # The copy recurses along the layer graph (a ResNet50's 175 layers and their nodes go deeper
        # than Python's default limit of 1000 frames); frames of Python code, not of the C stack.
        limit = sys.getrecursionlimit()
        sys.setrecursionlimit(max(limit, _COPY_RECURSION_LIMIT))
        try:
            memo = {id(m): m for m in list(sys.modules.values())}  # (modules a layer refers to are shared)
            return copy.deepcopy(module, memo)
        finally:
            sys.setrecursionlimit(limit)
            del KerasSaveable.__deepcopy__
            del DynamicBackend.__deepcopy__
