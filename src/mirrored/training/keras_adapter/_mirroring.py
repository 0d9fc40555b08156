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

import torch
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
    memo = {id(m): m for m in list(sys.modules.values())}  # (modules a layer refers to are shared)
    copied = copy_objects(module, memo)
    copied.__dict__.pop(RECORD, None)  # (what a strategy knows of the model is not the copy's: None)
    _after_copy(memo)
    return copied


def copy_objects(obj: Any, memo: dict | None = None) -> Any:
    """copy.deepcopy of `obj` with Keras objects copied as Python objects (_as_object): a model, or
    the arguments of a compile() made again for another replica's copy."""
    from keras.src.saving.keras_saveable import KerasSaveable
    from keras.src.utils.backend_utils import DynamicBackend

    if memo is None:
        memo = {id(m): m for m in list(sys.modules.values())}
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
            return copy.deepcopy(obj, memo)
        finally:
            sys.setrecursionlimit(limit)
            del KerasSaveable.__deepcopy__
            del DynamicBackend.__deepcopy__


def _after_copy(memo: dict) -> None:
    """What a deep copy of a compiled model leaves pointing at the original: a built optimizer finds its
    variables by id() (Keras's _trainable_variables_indices, MultiOptimizer's map to its inner
    optimizers), and Keras's step functions close over the original model."""
    from keras.src.backend.torch.trainer import TorchTrainer
    from keras.src.optimizers.base_optimizer import BaseOptimizer

    for original_id, made in list(memo.items()):
        if isinstance(made, BaseOptimizer) and id(made) != original_id:
            for name in ("_trainable_variables_indices", "_var_to_optimizer_idx"):
                by_id = made.__dict__.get(name)
                if isinstance(by_id, dict) and by_id:
                    made.__dict__[name] = {id(memo[key]) if key in memo else key: i for key, i in by_id.items()}
        elif isinstance(made, TorchTrainer) and id(made) != original_id:
            for name in ("train_function", "test_function", "predict_function"):
                made.__dict__[name] = None


def move_state(model: nn.Module, device: torch.device) -> None:
    """Moves a copy's Keras variables that are not its module's (its optimizers' and metrics') to its
    device: moving the module moves only what torch knows of it."""
    from keras.src.metrics.metric import Metric
    from keras.src.optimizers.base_optimizer import BaseOptimizer

    owners = [v for v in vars(model).values() if isinstance(v, BaseOptimizer)] + list(model.metrics)
    owners += [m for m in getattr(model, "_metrics", []) if isinstance(m, Metric)]
    for owner in owners:
        for v in owner.variables:
            value = v._value
            if isinstance(value, Tensor) and value.device != device:
                v._value = nn.Parameter(value.detach().to(device), requires_grad=value.requires_grad)


def optimizer_tensors(module: nn.Module) -> list[tuple[str, Tensor]] | None:
    """The variables of a Keras model copy's optimizers (its `optimizer`, a GAN's d_optimizer, ...),
    which every replica keeps equal outside the model's state_dict; None for another module."""
    if not is_keras_model(module):
        return None
    from keras.src.optimizers.base_optimizer import BaseOptimizer

    found, seen = [], set()
    for name, value in list(vars(module).items()):
        if isinstance(value, BaseOptimizer):
            for v in value.variables:
                if id(v) not in seen:
                    seen.add(id(v))
                    found.append((f"{name} variable {v.path!r}", v.value))
    return found


RECORD = "_mirrored_keras"  # the key of what _keras_fit.py keeps on a model, in its __dict__ (copied to none)
