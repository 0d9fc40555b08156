"""The param groups of a MirroredOptimizer, as its `param_groups` property hands them out.

Outside strategy.run a MirroredGroup is one group of every replica's optimizer: it reads replica
0's and writes all of them, so `g["lr"] = 0.01` and a torch LR scheduler set the same rate
everywhere. Inside it, with several replicas in the process, a ReplicaGroup is the calling
replica's own group, read-only: every replica's thread runs the same line, so a scheduler stepped
there would step once per replica and the replicas' rates would drift apart. Used by optimizer.py.
Uses torch.
"""
from __future__ import annotations

import sys
from collections.abc import Iterator, MutableMapping
from typing import Any

import torch


class MirroredGroup(MutableMapping):
    """One param group of every replica's optimizer: reads replica 0's, writes all of them."""

    def __init__(self, groups: list[dict[str, Any]]):
        self._groups = groups

    def __getitem__(self, key: str) -> Any:
        return self._groups[0][key]

    def __setitem__(self, key: str, value: Any) -> None:
        if key == "params":
            raise ValueError("MirroredOptimizer.param_groups[i]['params'] cannot be set: each replica's group "
                             "holds its own copy's parameters. Make a new mirror_optimizer instead.")
        for group in self._groups:
            group[key] = value

    def __delitem__(self, key: str) -> None:
        for group in self._groups:
            del group[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._groups[0])

    def __len__(self) -> int:
        return len(self._groups[0])

    def __repr__(self) -> str:
        return f"MirroredGroup({ {k: v for k, v in self._groups[0].items() if k != 'params'} })"


class ReplicaGroup(MutableMapping):
    """One param group of the calling replica's optimizer inside strategy.run, on several replicas of
    this process: reads it, refuses writes (see MirroredOptimizer.param_groups)."""

    __slots__ = ("_group", "_optimizer", "_index")

    def __init__(self, group: dict[str, Any], optimizer: Any, index: int):
        self._group = group
        self._optimizer = optimizer
        self._index = index

    def __getitem__(self, key: str) -> Any:
        return self._group[key]

    def __setitem__(self, key: str, value: Any) -> None:
        raise RuntimeError(_group_write_refused(self._optimizer, self._index, key))

    def __delitem__(self, key: str) -> None:
        raise RuntimeError(_group_write_refused(self._optimizer, self._index, key))

    def __iter__(self) -> Iterator[str]:
        return iter(self._group)

    def __len__(self) -> int:
        return len(self._group)

    def __repr__(self) -> str:
        return f"ReplicaGroup({ {k: v for k, v in self._group.items() if k != 'params'} })"


def _group_write_refused(optimizer: Any, index: int, key: str) -> str:
    scheduler = _scheduler_stepping(optimizer)
    counted = "" if scheduler is None else (
        f" {type(scheduler).__name__} has already counted this call, once per replica that made it (torch advances "
        f"its last_epoch before it sets the rate; it is {scheduler.last_epoch} now): load its state_dict() from "
        "before this step, or build it again.")
    return (f"{optimizer!r}.param_groups[{index}][{key!r}] was set inside strategy.run, where every replica's thread "
            "runs the same line: a torch LR scheduler stepped there (scheduler.step() in the step function) steps "
            f"once per replica, and the replicas' optimizers drift apart.{counted} Step the scheduler after "
            "strategy.run, once per global step (for x, y in dist_ds: strategy.run(step_fn, args=(x, y)); "
            "scheduler.step()), or with Model.fit pass mr.callbacks.TorchLRScheduler(scheduler). A value set outside "
            "strategy.run (opt.param_groups[0]['lr'] = 0.01) reaches every replica's optimizer.")


def _scheduler_stepping(optimizer: Any) -> Any:
    """The torch LR scheduler of `optimizer` whose step() is on this thread's stack, or None: what an
    error names (torch's schedulers write the groups from inside step())."""
    frame = sys._getframe(1)
    while frame is not None:
        owner = frame.f_locals.get("self")
        if isinstance(owner, torch.optim.lr_scheduler.LRScheduler) and owner.optimizer is optimizer:
            return owner
        frame = frame.f_back
    return None
