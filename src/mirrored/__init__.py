"""mirrored: synchronous data-parallel training on PyTorch, the tf.distribute.MirroredStrategy way.

    import mirrored as mr
    strategy = mr.MirroredStrategy()  # every GPU, or devices=["cpu:0", "cpu:1"]
    with strategy.scope():
        model = mr.Model(mr.models.resnet_cifar(num_classes=10))
        model.compile(optimizer="sgd", loss="sparse_categorical_crossentropy",
                      metrics=["accuracy"])
    model.fit(dataset_of_global_batches, epochs=5)

The distribution core is imported eagerly; the namespaces (data, datasets, models, layers, losses,
metrics, optimizers, callbacks, train, profiler, utils) and Model load on first use.
"""
from __future__ import annotations

import importlib
from typing import Any

from mirrored.distribute import (CollectiveAllReduce, CollectiveMismatchError, CollectiveTimeoutError, CrossDeviceOps,
                                 DistributedValues, HierarchicalCopyAllReduce, InMemoryAllReduce, InputContext,
                                 InputOptions, Mirrored, MirroredModule, MirroredOptimizer, MirroredStrategy,
                                 MirroredVariable, NcclAllReduce,
                                 OneDeviceStrategy, OutOfSyncError, PerReplica, ReduceOp, ReductionToOneDevice,
                                 ReplicaContext, RunOptions, Strategy, SyncOnReadVariable, ValueContext, Variable,
                                 VariableAggregation, VariableSynchronization, get_replica_context, get_strategy,
                                 has_strategy, in_cross_replica_context)
from mirrored._allocator import tune_allocator
from mirrored._files import FileWriteError
from mirrored.distribute import CommunicationOptions, MultiWorkerMirroredStrategy
from mirrored.distribute import register_adapter_loader as _register_adapter_loader
from mirrored.distribute import register_scope_hook as _register_scope_hook

__version__ = "0.1.0"

_NAMESPACES = {
    "data": "mirrored.data",
    "datasets": "mirrored.datasets",
    "models": "mirrored.models",
    "layers": "mirrored.training.layers",
    "losses": "mirrored.training.losses",
    "metrics": "mirrored.training.metrics",
    "optimizers": "mirrored.training.optimizers",
    "callbacks": "mirrored.training.callbacks",
    "train": "mirrored.training.tracking",
    "profiler": "mirrored.profiler",
    "utils": "mirrored.utils",
}
_LAZY_NAMES = {
    "Model": ("mirrored.training.model", "Model"),
}


def _install_keras_adapter() -> None:
    """Installs training/'s Keras adapter (keras_adapter.install: copier, state sync, Keras's random
    streams and BatchNormalization per replica) once the program has imported keras; distribute/ calls
    it before it mirrors a Keras model and at a scope's entry, since it may not import training/, and
    nothing here imports keras."""
    import sys

    if "keras" in sys.modules:
        importlib.import_module("mirrored.training.keras_adapter").install()


_register_adapter_loader("keras", _install_keras_adapter)
_register_scope_hook(_install_keras_adapter)


def __getattr__(name: str) -> Any:
    if name in _NAMESPACES:
        module = importlib.import_module(_NAMESPACES[name])
        globals()[name] = module
        return module
    if name in _LAZY_NAMES:
        module_name, attr = _LAZY_NAMES[name]
        value = getattr(importlib.import_module(module_name), attr)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'mirrored' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(list(globals()) + list(_NAMESPACES) + list(_LAZY_NAMES))


__all__ = [
    "CollectiveAllReduce", "CommunicationOptions", "MultiWorkerMirroredStrategy", "CollectiveMismatchError", "CollectiveTimeoutError", "CrossDeviceOps", "DistributedValues", "FileWriteError",
    "HierarchicalCopyAllReduce", "InMemoryAllReduce", "InputContext", "InputOptions", "Mirrored",
    "MirroredModule", "MirroredOptimizer", "MirroredStrategy", "MirroredVariable", "NcclAllReduce", "OneDeviceStrategy", "OutOfSyncError", "PerReplica",
    "ReduceOp", "ReductionToOneDevice", "ReplicaContext", "RunOptions", "Strategy", "SyncOnReadVariable", "ValueContext",
    "Variable", "VariableAggregation", "VariableSynchronization", "get_replica_context", "get_strategy",
    "has_strategy", "in_cross_replica_context", "tune_allocator", *_NAMESPACES, *_LAZY_NAMES,
]
