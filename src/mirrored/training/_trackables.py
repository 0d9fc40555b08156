"""What each kind of trackable of an mr.train.Checkpoint saves, and how it is checked and put back.

A kind (module, optimizer, variable, metric, state, rng) has save(obj, path) -> (tensors named
"<path>/<key>", JSON description) and check(obj, path, tensors, description, context) -> a Restore:
the values checked in full against the object (with checkpoint_checks.py), which Restore.apply()
then assigns, and what did not pair up. Checkpoint checks every entry before it applies any, so a
checkpoint that does not fit leaves every object as it was. entries() walks a trackable (a
container, an mr.Model) into (path, kind, object) entries. Values are saved once, from replica 0
or aggregated, and restored into every replica, so any replica count (and plain torch objects) can
read them. Uses checkpoint.py, checkpoint_checks.py, epochs.py, optimizers.py, metrics.py and the
public names of mirrored.distribute and mirrored.data.
"""
from __future__ import annotations

import copy
import dataclasses
import json
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
from torch import Tensor, nn

import mirrored.distribute as md
from mirrored.data import Dataset
from mirrored.training import checkpoint, checkpoint_checks, optimizers
from mirrored.training.checkpoint import CheckpointMismatchError
from mirrored.training.epochs import EpochIterator
from mirrored.training.metrics import Metric


@dataclasses.dataclass
class Context:
    """What the checks of one restore share: where it reads from (for the messages), the names of the
    parameters of the modules being restored (to name an optimizer's), and whether every value must
    pair up (BackupAndRestore) or may not (TF's semantics: the status reports it)."""

    origin: checkpoint_checks.Origin
    param_names: dict[int, str]
    complete: bool = False


@dataclasses.dataclass
class Restore:
    """One entry, checked: apply() assigns it. undo (for objects whose set_state() may still refuse a
    state that passed the checks) puts the object back as it was; such entries are applied first."""

    path: str
    apply: Callable[[], None]
    missing: list[str] = dataclasses.field(default_factory=list)
    unused: list[str] = dataclasses.field(default_factory=list)
    undo: Callable[[], None] | None = None


def _under(tensors: Mapping[str, Tensor], path: str) -> dict[str, Tensor]:
    prefix = path + "/"
    return {name[len(prefix):]: t for name, t in tensors.items() if name.startswith(prefix)}


def _replicas_of(obj: Any) -> list[nn.Module]:
    if isinstance(obj, nn.Module):
        return [obj]
    return list(obj.replicas)  # a MirroredModule, or an mr.Model


def module_names(path: str, obj: Any) -> dict[int, str]:
    """id(parameter) -> "<path>/<name>" for every copy of a module entry, to name an optimizer's parameters."""
    return {id(p): f"{path}/{name}" for copy_ in _replicas_of(obj) for name, p in copy_.named_parameters()}


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
    def check(obj: Any, path: str, tensors: Mapping[str, Tensor], meta: Mapping[str, Any], ctx: Context) -> Restore:
        copies = _replicas_of(obj)
        owner = f"the {'module' if isinstance(obj, (nn.Module, md.MirroredModule)) else 'model'} {path!r}"
        values, missing, unused = checkpoint_checks.module_state(
            ctx.origin, tensors, copies[0].state_dict(), f"{path}/", owner, ctx.complete, CheckpointMismatchError)

        def apply() -> None:
            for module in copies:
                module.load_state_dict(values, strict=False)

        return Restore(path, apply, [f"{path}/{k}" for k in missing], [f"{path}/{k}" for k in unused])


def _optimizers_of(obj: Any, path: str) -> list[torch.optim.Optimizer]:
    """The torch optimizers behind `obj`, one per replica (a plain torch optimizer alone)."""
    if isinstance(obj, md.MirroredOptimizer):  # (a torch Optimizer too, over its replicas' optimizers)
        return list(obj.replicas)
    if isinstance(obj, torch.optim.Optimizer):
        return [obj]
    built = obj._live()  # an mr.optimizers recipe: the torch optimizers built from it
    if not built:
        raise ValueError(f"Checkpoint: {path} is {obj!r}, which has not been built into an optimizer yet. "
                         "Compile the model, call strategy.mirror_optimizer, or (a plain module) give "
                         f"{type(obj).__name__}(...).build(module.parameters()) before saving or restoring it.")
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
    def check(obj: Any, path: str, tensors: Mapping[str, Tensor], meta: Mapping[str, Any], ctx: Context) -> Restore:
        replicas = _optimizers_of(obj, path)
        params = [p for group in replicas[0].param_groups for p in group["params"]]
        names = [ctx.param_names.get(id(p), f"parameter {i}") for i, p in enumerate(params)]
        state = checkpoint_checks.optimizer_state(ctx.origin, tensors, meta.get("state"), replicas[0], names,
                                                  prefix=path)
        schedulers = state.pop(md.MirroredOptimizer.LR_SCHEDULERS_KEY, None)
        if schedulers is not None and not (isinstance(schedulers, list) and all(isinstance(x, dict) for x in schedulers)):
            raise ctx.origin.damaged(f"{path}: the LR schedulers' states are {schedulers!r:.60}, not a list of dicts")

        def apply() -> None:
            optimizers.load_replicas_state_dict(replicas, state)
            if isinstance(obj, md.MirroredOptimizer) and schedulers is not None:
                obj.load_lr_schedulers_state_dict({obj.LR_SCHEDULERS_KEY: schedulers})

        return Restore(path, apply)


class _Variable:
    """A variable's value in cross-replica context: a mirrored variable's copy, a sync-on-read one's
    aggregate. Restored with assign() there, which splits a SUM total across the replicas, as TF does."""

    kind = "variable"

    @staticmethod
    def save(obj: Any, path: str) -> tuple[dict[str, Tensor], dict[str, Any]]:
        value = obj.read_value() if isinstance(obj, md.Variable) else obj
        return {f"{path}/value": value.detach()}, {"kind": "variable"}

    @staticmethod
    def check(obj: Any, path: str, tensors: Mapping[str, Tensor], meta: Mapping[str, Any], ctx: Context) -> Restore:
        value = checkpoint_checks.tensor(ctx.origin, tensors, f"{path}/value", obj, f"the variable {path!r}")
        return Restore(path, lambda: _assign(obj, value))


def _assign(obj: Any, value: Tensor) -> None:
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
    def check(obj: Any, path: str, tensors: Mapping[str, Tensor], meta: Mapping[str, Any], ctx: Context) -> Restore:
        variables = obj.variables
        count = meta.get("variables")
        if not checkpoint_checks.is_count(count):
            raise ctx.origin.damaged(f"{path}'s count of state variables is {count!r:.40}, not a whole number")
        if count != len(variables):
            shapes = [tuple(tensors[f"{path}/{i}"].shape) for i in range(count) if f"{path}/{i}" in tensors]
            fits = getattr(obj, "_fits_saved_state", None)
            if len(shapes) == count and callable(fits) and fits(shapes):
                # A metric whose state its first update makes (F1Score's per-class counts), saved after it
                # and restored before any: its state is made for the file's shapes, then filled.
                return Restore(path, lambda: _made_and_filled(obj, path, tensors, count, shapes))
            raise ctx.origin.mismatch(f"{path} ({obj!r}) has {len(variables)} state variables but the file holds "
                                      f"{count}: it was saved from another kind of metric")
        values = [checkpoint_checks.tensor(ctx.origin, tensors, f"{path}/{i}", var, f"metric {obj.name!r}")
                  for i, var in enumerate(variables)]

        def apply() -> None:
            for var, value in zip(variables, values):
                _assign(var, value)

        return Restore(path, apply)


def _made_and_filled(obj: Any, path: str, tensors: Mapping[str, Tensor], count: int,
                     shapes: list[tuple[int, ...]]) -> None:
    obj._build_saved_state(shapes)
    for i, var in enumerate(obj.variables[:count]):
        _assign(var, tensors[f"{path}/{i}"])


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
    def check(obj: Any, path: str, tensors: Mapping[str, Tensor], meta: Mapping[str, Any], ctx: Context) -> Restore:
        if "state" not in meta:
            raise ctx.origin.damaged(f"the entry {path!r} holds no 'state'")
        state, now = meta["state"], obj.get_state()
        if isinstance(obj, EpochIterator):
            checkpoint_checks.epoch_state(ctx.origin, path, state, now, obj.num_batches, obj.continues_passes,
                                          obj.batches_per_pass, obj.max_learning_rate)
        else:
            # mirrored's own objects (datasets, distributed iterators) have states whose structure their
            # pipeline fixes; a user's object may keep a state that grows, so only its outline is compared.
            strict = type(obj).__module__.startswith("mirrored.")
            checkpoint_checks.object_state(ctx.origin, path, state, now, strict)
        state = copy.deepcopy(state)  # set_state may keep it; the file's metadata is not the object's
        if isinstance(obj, (EpochIterator, Dataset)):  # set_state takes any state these checks passed
            return Restore(path, lambda: obj.set_state(state))
        # Others may still refuse it (a distributed iterator replays its batches and may run out): they go
        # first, and what went before is put back if one does.
        return Restore(path, lambda: obj.set_state(state), undo=lambda: obj.set_state(now))


class _ReplicaRandom(_State):
    """A model's replicas' generators (seed, steps run). Backups written before mirrored saved them lack
    the entry; they restore without it, with a warning, rather than being refused."""

    absent = ("holds no entry {path!r} for the replicas' random generators: it was written by a mirrored that did "
              "not save them. Resuming without it: the weights, optimizer and data resume as saved, but random "
              "draws in replica steps (dropout) continue from this run's seed, not as the interrupted run would "
              "have drawn them, so the result will not match an uninterrupted run bit for bit.")


class _StrategyRandom(_ReplicaRandom):
    """A strategy's random state that a Checkpoint saves on its own, for the mirrored objects it tracks
    (else a custom loop that forgot random=strategy.random_state would resume with other dropout masks,
    silently). Marked implicit: a reader with no object of a strategy (plain torch modules) ignores it."""

    absent = ("holds no entry {path!r} for the replicas' random generators: it was written by a mirrored that did "
              "not save them, or from objects of no strategy. Resuming without it: the values restore as saved, but "
              "random draws in replica steps (dropout) continue from this run's seed and step count, not as the "
              "interrupted run would have drawn them, so the result will not match an uninterrupted run bit for bit.")

    @staticmethod
    def save(obj: Any, path: str) -> tuple[dict[str, Tensor], dict[str, Any]]:
        tensors, meta = _State.save(obj, path)
        return tensors, {**meta, "implicit": True}


def _strategy_of(obj: Any) -> Any:
    """The strategy of a mirrored module, optimizer or variable (None for other objects)."""
    if isinstance(obj, (md.MirroredModule, md.MirroredOptimizer, md.Variable)):
        return obj.distribute_strategy
    return None


def _holds_random_state(entry: Any) -> bool:
    """Whether a file's entry is a strategy's random state (StrategyRandom.get_state()), under any name."""
    state = entry.get("state") if isinstance(entry, dict) and entry.get("kind") == "state" else None
    return isinstance(state, dict) and set(state) == {"seed", "steps", "per_example_random"}


def _unclaimed_random_states(found: list[tuple[str, Any, Any]], saved: Mapping[str, Any]) -> list[str]:
    """The paths of the file's random states (`saved`: its entries) that no entry of `found` reads."""
    claimed = {path for path, _, _ in found}
    return [p for p, entry in saved.items() if p not in claimed and _holds_random_state(entry)]


def named_random_at(found: list[tuple[str, Any, Any]], saved: Mapping[str, Any]) -> list[tuple[str, Any, Any]]:
    """`found` with each random state given by name (random=strategy.random_state) that the file lacks read
    where the file holds that strategy's state instead: under "<path>.random" of one of the strategy's
    objects here (the implicit entry of a file saved without random=), else the file's one random state
    that no object here claims. Dropped where another entry here already reads it (an mr.Model's)."""
    unclaimed = _unclaimed_random_states(found, saved)
    named = [obj for path, _, obj in found if isinstance(obj, md.StrategyRandom) and path not in saved]
    out = []
    for path, kind, obj in found:
        if not isinstance(obj, md.StrategyRandom) or path in saved:
            out.append((path, kind, obj))
            continue
        if any(o is obj and p in saved for p, _, o in found):
            continue  # read by that entry
        own = [f"{p}.random" for p, _, o in sorted(found, key=lambda entry: entry[0])
               if _strategy_of(o) is not None and _strategy_of(o).random_state is obj]
        at = next((p for p in own if p in unclaimed), None)
        if at is None and len(named) == 1 and len(unclaimed) == 1:  # one each side: the same run's
            at = unclaimed[0]
        out.append((at or path, kind, obj))
    return out


def random_entries(found: list[tuple[str, Any, Any]], saved: Mapping[str, Any] | None = None
                   ) -> list[tuple[str, Any, Any]]:
    """An entry for the random state of each strategy whose mirrored objects are among `found`, unless one
    is there already (an mr.Model's, or random=strategy.random_state). It goes under "<path>.random" of
    the strategy's object whose path sorts first; reading (`saved`: the file's entries), the first such
    path the file holds, or, where both sides have one strategy, the file's one random state that no
    object here claims (a file of (model, optimizer) read into the optimizer alone, or one saved with
    random=strategy.random_state read without it). A strategy none of whose objects the file holds (a
    warm start from other weights) keeps its own seed: its random state is read only with its objects."""
    covered = {id(obj) for _, _, obj in found if isinstance(obj, md.StrategyRandom)}
    paths: dict[int, list[str]] = {}
    states: dict[int, md.StrategyRandom] = {}
    in_file: set[int] = set()
    for path, _, obj in sorted(found, key=lambda entry: entry[0]):
        strategy = _strategy_of(obj)
        if strategy is None or id(strategy.random_state) in covered:
            continue
        states[id(strategy.random_state)] = strategy.random_state
        paths.setdefault(id(strategy.random_state), []).append(f"{path}.random")
        if saved is not None and path in saved:
            in_file.add(id(strategy.random_state))
    if saved is not None:
        paths = {key: candidates for key, candidates in paths.items() if key in in_file}
    unclaimed = _unclaimed_random_states(found, saved or {})
    entries = []
    for key, candidates in paths.items():
        path = next((p for p in candidates if p in unclaimed), candidates[0])
        if path not in unclaimed and len(paths) == 1 and len(unclaimed) == 1:  # one strategy each side: the same run
            path = unclaimed[0]
        entries.append((path, _StrategyRandom, states[key]))
    return entries


class LossScale:
    """The replicas' GradScalers, which hold the same scale (they see the same reduced gradients), as
    one trackable: get_state() is the first's state_dict, set_state() loads it into every one."""

    def __init__(self, scalers: list[Any]):
        self._scalers = list(scalers)

    def get_state(self) -> dict[str, Any]:
        """The first scaler's state_dict (scale, growth factors, steps since the last growth)."""
        return dict(self._scalers[0].state_dict())

    def set_state(self, state: dict[str, Any]) -> None:
        """Loads `state` (get_state()'s) into every replica's scaler."""
        for scaler in self._scalers:
            scaler.load_state_dict(dict(state))

    def __repr__(self) -> str:
        return f"LossScale({self._scalers[0].get_scale()})"


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
    def check(obj: Any, path: str, tensors: Mapping[str, Tensor], meta: Mapping[str, Any], ctx: Context) -> Restore:
        own = _under(tensors, path)
        checkpoint_checks.rng_state(ctx.origin, own, meta.get("rng"), prefix=path)
        return Restore(path, lambda: checkpoint.restore_rng_state(own, meta["rng"]))


def kind_of(obj: Any) -> Any:
    """The kind of trackable `obj` is (module, optimizer, variable, metric, rng, state), or None."""
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
        if obj.loss_scale is not None:  # fp16's loss scale: a resumed run goes on with it
            yield f"{path}.loss_scale", _State, obj.loss_scale
        # The replicas' generators (seed, steps run): a resumed run draws the dropout masks the first would have.
        yield f"{path}.random", _ReplicaRandom, obj.distribute_strategy.random_state
        return
    kind = kind_of(obj)
    if kind is None and isinstance(obj, (torch.optim.lr_scheduler.LRScheduler,
                                         torch.optim.lr_scheduler.ReduceLROnPlateau)):
        # One place holds a schedule's state, next to the rates it set: its optimizer's entry.
        raise TypeError(f"Checkpoint: {path} is a torch LR scheduler ({type(obj).__name__}), whose state is saved "
                        "with its optimizer's. Attach it to the mirrored optimizer it drives - "
                        "mirrored_optimizer.attach_lr_scheduler(scheduler) - and give that optimizer to the "
                        "checkpoint instead (optimizer=mirrored_optimizer); Model.save and BackupAndRestore then "
                        "keep the schedule too. (A scheduler of a plain torch optimizer: build both with "
                        "strategy.mirror_optimizer(...).)")
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
