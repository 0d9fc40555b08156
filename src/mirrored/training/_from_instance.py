"""compile(optimizer=torch.optim.SGD(groups, ...)): what a torch optimizer instance hands over.

compile() builds one optimizer per replica, so the user's instance is a description of them: its
class and defaults (optimizers.get takes those), every parameter group's hyperparameters (a head
with its own lr, weight decay off for biases and norms, a rate set on a group after construction),
and its state_dict when it has state (momentum buffers, Adam's moments). InstanceGroups keeps the
groups and reads the state as each replica's optimizer is built. The groups' parameters are mapped
onto the model's by identity, once, on replica 0's copy (the module given to mr.Model is that copy:
mirroring moves it, it does not copy it), and by position onto every other replica's copy. A torch LR scheduler built on the instance is moved
onto the model's mirrored optimizer by mr.callbacks.TorchLRScheduler (move_scheduler); a change to
the instance's settings after compile (a scheduler stepped by hand) would change nothing, and fit
says so (changes_since_compile). Uses torch only.
"""
from __future__ import annotations

import copy
import functools
import weakref
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import Tensor

_MISSING = object()


class InstanceGroups:
    """A torch optimizer instance's parameter groups (hyperparameters, and parameters as positions
    in the model's parameter list), as compile() took them, and its state."""

    def __init__(self, hparams: list[dict[str, Any]], positions: list[list[int]] | None,
                 num_params: int | None, name: str):
        self.hparams = hparams
        self.positions = positions  # None until resolve() maps the instance's parameters
        self.num_params = num_params
        self.name = name
        self._params: list[list[Tensor]] | None = None  # the instance's own, until resolve()
        self._source: Any = None  # weakref to the instance
        self._seen: list[dict[str, Any]] = []  # the instance's settings when last looked at
        self._reported = False  # changes_since_compile() answered once

    @classmethod
    def of(cls, instance: torch.optim.Optimizer, name: str) -> InstanceGroups:
        """`instance`'s groups as they are now (a copy: later changes to them are not taken); its state is
        read when an optimizer is built (state_dict())."""
        hparams = [_settings(g) for g in instance.param_groups]
        groups = cls(hparams, None, None, name)
        groups._params = [list(g["params"]) for g in instance.param_groups]
        groups._source = weakref.ref(instance)
        groups._seen = copy.deepcopy(hparams)
        return groups

    @classmethod
    def from_config(cls, config: Any, name: str) -> InstanceGroups:
        """From config()'s list: [{"params": [positions], **hyperparameters}, ...]."""
        if not isinstance(config, list) or not config or not all(
                isinstance(g, Mapping) and isinstance(g.get("params"), list)
                and all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in g["params"])
                for g in config):
            raise ValueError(f"{name} config: param_groups is {config!r:.120}, not a list of groups "
                             "{'params': [parameter positions], ...hyperparameters}.")
        positions = [list(g["params"]) for g in config]
        hparams = [{k: v for k, v in g.items() if k != "params"} for g in config]
        return cls(hparams, positions, None, name)

    def config(self) -> list[dict[str, Any]]:
        """The groups as JSON-able dicts, the parameters as positions (once resolve() has mapped them)."""
        if self.positions is None:
            raise NotImplementedError(f"{self.name}: the groups are not mapped onto a model's parameters yet.")
        return [{"params": list(pos), **copy.deepcopy(h)} for pos, h in zip(self.positions, self.hparams)]

    def state_dict(self) -> dict[str, Any] | None:
        """A copy of the instance's state_dict for one replica's optimizer, with the groups' settings as
        taken (or set on the recipe since); None when it holds no state. Read from the instance at
        build time rather than copied at compile's start: a copy kept for later would double the
        memory of Adam's moments for as long as the model lives."""
        instance = self.source
        if instance is None or not instance.state:
            return None
        state = copy.deepcopy(instance.state_dict())  # (its tensors are the instance's own until copied)
        for saved, settings in zip(state["param_groups"], self.hparams):
            saved.update(copy.deepcopy(settings))
        return state

    @property
    def source(self) -> torch.optim.Optimizer | None:
        """The instance these groups came from, while it lives (None for groups rebuilt from a config)."""
        return self._source() if self._source is not None else None

    # ---- building ---------------------------------------------------------------------------------
    def resolve(self, params: Sequence[Tensor]) -> list[list[int]]:
        """Each group's parameters as positions in `params`: by identity the first time (replica 0's
        copy, which holds the instance's own parameters), by position after (another replica's copy)."""
        if self.positions is None:
            index = {id(p): i for i, p in enumerate(params)}
            groups = self._params or []
            foreign = [(g, k, p) for g, group in enumerate(groups) for k, p in enumerate(group) if id(p) not in index]
            if foreign:
                raise ValueError(self._foreign_message(foreign, sum(len(g) for g in groups), len(params)))
            self.positions = [[index[id(p)] for p in group] for group in groups]
            self.num_params = len(params)
            self._params = None  # (the model holds them; the recipe need not)
        elif self.num_params is not None and len(params) != self.num_params:
            raise ValueError(f"{self.name}: its parameter groups were mapped onto a model of {self.num_params} "
                             f"parameters, but this one has {len(params)}. Pass a new optimizer for another model.")
        elif self.positions and max(max(pos, default=-1) for pos in self.positions) >= len(params):
            raise ValueError(f"{self.name}: its parameter groups name parameter "
                             f"{max(max(pos, default=-1) for pos in self.positions)} but the model has {len(params)} "
                             "parameters; it was saved from another model.")
        return self.positions

    def groups_for(self, params: Sequence[Tensor]) -> list[dict[str, Any]]:
        """torch param groups over `params` (one replica's copy) with each group's hyperparameters."""
        positions = self.resolve(params)
        return [{**copy.deepcopy(h), "params": [params[i] for i in pos]} for h, pos in zip(self.hparams, positions)]

    def _foreign_message(self, foreign: list[tuple[int, int, Tensor]], total: int, model_params: int) -> str:
        g, k, p = foreign[0]
        if len(foreign) == total:
            what = f"none of its {total} parameters is one of the model's {model_params}"
        else:
            what = (f"{len(foreign)} of its {total} parameters are not the model's (the first: group {g}'s "
                    f"parameter {k}, of shape {tuple(p.shape)})")
        return (f"compile(optimizer=<{self.name} instance>): {what}, so it cannot be carried over to the model's "
                f"replicas. Build it on the parameters of the module you give mr.Model: torch.optim.{self.name}("
                f"net.parameters(), ...) before mr.Model(net), or on model.module.parameters() after; or pass "
                f"the class and its settings: mr.optimizers.Optimizer(torch.optim.{self.name}, learning_rate=...).")

    # ---- the instance after compile -----------------------------------------------------------------
    def changes_since_compile(self) -> str | None:
        """The first setting of the instance that changed since compile (or since a scheduler was moved
        off it), e.g. "group 0's lr 0.1 -> 0.05"; None if none did. Reported once (until a scheduler is
        moved), not at every epoch of a schedule that goes on changing it."""
        instance = self.source
        if instance is None or self._reported or len(instance.param_groups) != len(self._seen):
            return None
        for g, (group, seen) in enumerate(zip(instance.param_groups, self._seen)):
            for key, value in group.items():
                before = seen.get(key, _MISSING)
                if key != "params" and not _same(value, before):
                    self._seen = [_settings(group) for group in instance.param_groups]
                    self._reported = True
                    was = "unset" if before is _MISSING else repr(before)
                    return f"group {g}'s {key} {was} -> {value!r}"
        return None

    def move_scheduler(self, scheduler: Any, optimizer: torch.optim.Optimizer) -> None:
        """Makes `scheduler`, built on the instance, drive `optimizer` (the model's mirrored optimizer):
        first the settings it changed on the instance since compile (its initial_lr, the rate it set,
        OneCycleLR's momentum) are written to `optimizer`'s groups, then it and the schedulers it
        chains (SequentialLR, ChainedScheduler) take `optimizer` as theirs. The instance keeps what it
        holds and is no longer changed by the scheduler."""
        instance = self.source
        chained = [scheduler, *getattr(scheduler, "_schedulers", [])]
        others = [s for s in chained if getattr(s, "optimizer", None) not in (instance, optimizer)]
        if instance is None or others:
            raise ValueError(f"{type(scheduler).__name__}: it, or a scheduler it chains, drives another optimizer "
                             "than the one given to compile(). Build every scheduler on the same optimizer.")
        groups = optimizer.param_groups
        if len(instance.param_groups) != len(groups):
            raise ValueError(f"{type(scheduler).__name__}: the {self.name} optimizer given to compile() has "
                             f"{len(instance.param_groups)} parameter groups now but the model's optimizer has "
                             f"{len(groups)}; a group added after compile is not the model's. Build the scheduler "
                             "on model.mirrored_optimizer.")
        for source, target, seen in zip(instance.param_groups, groups, self._seen):
            for key, value in source.items():
                if key != "params" and (key not in target or not _same(value, seen.get(key, _MISSING))):
                    target[key] = copy.deepcopy(value)
        for s in chained:
            s.optimizer = optimizer
        _mark_step_wrapped(optimizer)
        self._seen = [_settings(group) for group in instance.param_groups]
        self._reported = False


def _settings(group: Mapping[str, Any]) -> dict[str, Any]:
    return {k: copy.deepcopy(v) for k, v in group.items() if k != "params"}


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, Tensor) or isinstance(b, Tensor):
        return isinstance(a, Tensor) and isinstance(b, Tensor) and a.shape == b.shape and bool(torch.equal(a, b))
    try:
        return bool(a == b)
    except (TypeError, ValueError, RuntimeError):  # a value without a plain == (a tuple of tensors)
        return a is b


def _mark_step_wrapped(optimizer: torch.optim.Optimizer) -> None:
    """torch's schedulers wrap their optimizer's step() when they are built and, on their first step,
    warn that step() was "overridden" if the wrapper is missing. A scheduler moved onto `optimizer`
    was built on another one, so the mark is set here as its constructor would have set it."""
    if hasattr(optimizer.step, "_wrapped_by_lr_sched"):
        return
    step = type(optimizer).step  # (the function: a bound method here would keep the optimizer alive in a cycle)
    owner = weakref.ref(optimizer)

    @functools.wraps(step)
    def step_and_note(*args: Any, **kwargs: Any) -> Any:
        target = owner()
        target._opt_called = True  # what torch's schedulers read: the optimizer stepped before them
        return step(target, *args, **kwargs)

    step_and_note._wrapped_by_lr_sched = True  # type: ignore[attr-defined]
    optimizer.step = step_and_note  # type: ignore[method-assign]
