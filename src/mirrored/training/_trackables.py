"""What each kind of trackable of an mr.train.Checkpoint saves, and how it is put back.

A kind (module, optimizer, variable, metric, state, rng) has save(obj, path) -> (tensors named
"<path>/<key>", JSON description) and restore(obj, path, tensors, description) -> what did not fit.
entries() walks a trackable (a container, an mr.Model) into (path, kind, object) entries. Values are
saved once, from replica 0 or aggregated, and restored into every replica, so any replica count
(and plain torch objects) can read them. Uses checkpoint.py, optimizers.py, metrics.py and the
public names of mirrored.distribute.
"""
from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from typing import Any

import torch
from torch import Tensor, nn

import mirrored.distribute as md
from mirrored.training import checkpoint, optimizers
from mirrored.training.metrics import Metric


def _under(tensors: Mapping[str, Tensor], path: str) -> dict[str, Tensor]:
    prefix = path + "/"
    return {name[len(prefix):]: t for name, t in tensors.items() if name.startswith(prefix)}


def _replicas_of(obj: Any) -> list[nn.Module]:
    if isinstance(obj, nn.Module):
        return [obj]
    return list(obj.replicas)  # a MirroredModule, or an mr.Model


class _Module:
    """A module's state_dict (replica 0's copy); restored into every copy."""

    kind = "module"

    @staticmethod
    def save(obj: Any, path: str) -> tuple[dict[str, Tensor], dict[str, Any]]:
        state = _replicas_of(obj)[0].state_dict()
        for key, value in state.items():
            if not isinstance(value, Tensor):
                raise TypeError(f"Checkpoint: {path}'s state_dict entry {key!r} is a {type(value).__name__}, not a "
                                "tensor; only tensors can be saved.")
        return {f"{path}/{k}": v.detach() for k, v in state.items()}, {"kind": "module"}

    @staticmethod
    def restore(obj: Any, path: str, tensors: Mapping[str, Tensor], meta: Mapping[str, Any]) -> Mismatch:
        saved = _under(tensors, path)
        copies = _replicas_of(obj)
        own = copies[0].state_dict()
        shapes = [f"{k}: saved {tuple(saved[k].shape)}, here {tuple(v.shape)}" for k, v in own.items()
                  if k in saved and isinstance(v, Tensor) and saved[k].shape != v.shape]
        if shapes:
            raise ValueError(f"Checkpoint.restore: {path}: shapes differ ({'; '.join(shapes[:5])}). Restore into a "
                             "module of the same architecture.")
        for module in copies:
            module.load_state_dict({k: v for k, v in saved.items() if k in own}, strict=False)
        return Mismatch(missing=[f"{path}/{k}" for k in own if k not in saved],
                         unused=[f"{path}/{k}" for k in saved if k not in own])


def _optimizers_of(obj: Any, path: str) -> list[torch.optim.Optimizer]:
    """The torch optimizers behind `obj`, one per replica (a plain torch optimizer alone)."""
    if isinstance(obj, md.MirroredOptimizer):  # (a torch Optimizer too, over its replicas' optimizers)
        return list(obj.replicas)
    if isinstance(obj, torch.optim.Optimizer):
        return [obj]
    built = obj._live()  # an mr.optimizers recipe: the torch optimizers built from it
    if not built:
        raise ValueError(f"Checkpoint: {path} is {obj!r}, which has not been built into an optimizer yet. "
                         "Compile the model (or call strategy.mirror_optimizer) before saving or restoring it.")
    return built


class _Optim:
    """A torch optimizer's state_dict (replica 0's), with mr.optimizers' step count, moving averages and
    every replica's accumulated gradients; restored into every replica's optimizer (a plain torch
    optimizer takes the torch part)."""

    kind = "optimizer"

    @staticmethod
    def save(obj: Any, path: str) -> tuple[dict[str, Tensor], dict[str, Any]]:
        state = optimizers.replicas_state_dict(_optimizers_of(obj, path))
        if isinstance(obj, md.MirroredOptimizer):  # the torch LR schedulers attached to it
            state.update(obj.lr_schedulers_state_dict())
        tensors, meta = checkpoint.optimizer_state_to_flat(state, prefix=path)
        return tensors, {"kind": "optimizer", "state": meta}

    @staticmethod
    def restore(obj: Any, path: str, tensors: Mapping[str, Tensor], meta: Mapping[str, Any]) -> Mismatch:
        state = checkpoint.optimizer_state_from_flat(tensors, meta["state"])
        try:
            schedulers = state.pop(md.MirroredOptimizer.LR_SCHEDULERS_KEY, None)
            optimizers.load_replicas_state_dict(_optimizers_of(obj, path), state)
            if isinstance(obj, md.MirroredOptimizer) and schedulers is not None:
                obj.load_lr_schedulers_state_dict({obj.LR_SCHEDULERS_KEY: schedulers})
        except (ValueError, KeyError) as e:
            raise ValueError(f"Checkpoint.restore: {path}: the saved optimizer state does not fit this optimizer "
                             f"({e}). Restore into an optimizer over the same parameters.") from e
        return Mismatch()


class _Variable:
    """A variable's value in cross-replica context: a mirrored variable's copy, a sync-on-read one's
    aggregate. Restored with assign() there, which splits a SUM total across the replicas, as TF does."""

    kind = "variable"

    @staticmethod
    def save(obj: Any, path: str) -> tuple[dict[str, Tensor], dict[str, Any]]:
        value = obj.read_value() if isinstance(obj, md.Variable) else obj
        return {f"{path}/value": value.detach()}, {"kind": "variable"}

    @staticmethod
    def restore(obj: Any, path: str, tensors: Mapping[str, Tensor], meta: Mapping[str, Any]) -> Mismatch:
        value = tensors[f"{path}/value"]
        _assign(obj, value, path)
        return Mismatch()


def _assign(obj: Any, value: Tensor, path: str) -> None:
    if tuple(value.shape) != tuple(obj.shape):
        raise ValueError(f"Checkpoint.restore: {path} has shape {tuple(obj.shape)} but the checkpoint holds "
                         f"{tuple(value.shape)}.")
    if isinstance(obj, md.Variable):
        obj.assign(value.to(obj.dtype))
    else:
        with torch.no_grad():
            obj.copy_(value)


class _Metric:
    """A metric's state variables, as variables (aggregated over the replicas)."""

    kind = "metric"

    @staticmethod
    def save(obj: Any, path: str) -> tuple[dict[str, Tensor], dict[str, Any]]:
        variables = obj.variables
        return ({f"{path}/{i}": v.read_value().detach() for i, v in enumerate(variables)},
                {"kind": "metric", "variables": len(variables)})

    @staticmethod
    def restore(obj: Any, path: str, tensors: Mapping[str, Tensor], meta: Mapping[str, Any]) -> Mismatch:
        variables = obj.variables
        if meta.get("variables") != len(variables):
            raise ValueError(f"Checkpoint.restore: {path} ({obj!r}) has {len(variables)} state variables but the "
                             f"checkpoint holds {meta.get('variables')}; restore into the same kind of metric.")
        for i, var in enumerate(variables):
            _assign(var, tensors[f"{path}/{i}"], f"{path} variable {i}")
        return Mismatch()


class _State:
    """An object's get_state() (JSON), given back to its set_state()."""

    kind = "state"

    @staticmethod
    def save(obj: Any, path: str) -> tuple[dict[str, Tensor], dict[str, Any]]:
        state = obj.get_state()
        try:
            json.dumps(state)
        except (TypeError, ValueError) as e:
            raise TypeError(f"Checkpoint: {path}.get_state() returned something JSON cannot hold ({e}).") from e
        return {}, {"kind": "state", "state": state}

    @staticmethod
    def restore(obj: Any, path: str, tensors: Mapping[str, Tensor], meta: Mapping[str, Any]) -> Mismatch:
        obj.set_state(meta["state"])
        return Mismatch()


class RandomState:
    """The process's global random generators (torch's CPU and CUDA ones, numpy's, Python's) as a
    trackable, for runs that must resume bit for bit (fit's BackupAndRestore saves it)."""

    def __repr__(self) -> str:
        return "RandomState()"


class _Rng:
    kind = "rng"

    @staticmethod
    def save(obj: Any, path: str) -> tuple[dict[str, Tensor], dict[str, Any]]:
        tensors, meta = checkpoint.capture_rng_state()
        return {f"{path}/{k}": v for k, v in tensors.items()}, {"kind": "rng", "rng": meta}

    @staticmethod
    def restore(obj: Any, path: str, tensors: Mapping[str, Tensor], meta: Mapping[str, Any]) -> Mismatch:
        checkpoint.restore_rng_state(_under(tensors, path), meta["rng"])
        return Mismatch()


class Mismatch:
    """What a restore left out: parts of the objects without a saved value, saved values without a place."""

    def __init__(self, missing: list[str] | None = None, unused: list[str] | None = None):
        self.missing = missing or []
        self.unused = unused or []


def _kind(obj: Any) -> Any:
    if isinstance(obj, (md.MirroredModule, nn.Module)):
        return _Module
    if isinstance(obj, (md.MirroredOptimizer, torch.optim.Optimizer, optimizers.Optimizer)):
        return _Optim
    if isinstance(obj, (md.Variable, Tensor)):
        return _Variable
    if isinstance(obj, Metric):
        return _Metric
    if isinstance(obj, RandomState):
        return _Rng
    if callable(getattr(obj, "get_state", None)) and callable(getattr(obj, "set_state", None)):
        return _State
    return None


def check_name(name: Any, where: str) -> None:
    if not isinstance(name, str) or not name or "/" in name or "." in name:
        raise ValueError(f"Checkpoint: {where} name {name!r}: use a non-empty str without '/' or '.', e.g. 'model'.")


def entries(path: str, obj: Any) -> Iterator[tuple[str, Any, Any]]:
    """(path, kind, object) for `obj` and, for containers and models, what is inside it."""
    from mirrored.training.model import Model  # (model.py imports callbacks.py, which imports this module)

    if isinstance(obj, Model):  # its weights, and its optimizer once compiled
        yield path, _Module, obj
        if obj.mirrored_optimizer is not None:
            yield f"{path}.optimizer", _Optim, obj.mirrored_optimizer
        return
    kind = _kind(obj)
    if kind is None and isinstance(obj, (list, tuple)):
        for i, item in enumerate(obj):
            yield from entries(f"{path}.{i}", item)
        return
    if kind is None and isinstance(obj, Mapping):
        for key, item in obj.items():
            check_name(key, f"{path}: the dict key")
            yield from entries(f"{path}.{key}", item)
        return
    if kind is None:
        raise TypeError(f"Checkpoint: {path} is a {type(obj).__name__}, which a checkpoint cannot save. Give "
                        "mirrored modules or optimizers (strategy.mirror, strategy.mirror_optimizer), an mr.Model, "
                        "mr.optimizers optimizers, mr.Variable, metrics, objects with get_state()/set_state() (a "
                        "distributed iterator, an mr.data.Dataset), torch modules, optimizers or tensors, or lists "
                        "and dicts of them.")
    yield path, kind, obj
