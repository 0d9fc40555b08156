"""Rollback of a failed step: each replica notes what its step is about to change, and puts it back
if the step fails, so that a failure leaves no trace.

Without it, the replicas that finished backward before another one failed keep their `.grad`, and
the next step silently adds them in (every replica equally, so even `check_in_sync` passes). Each
replica of a `strategy.run` gets a `StepJournal`. A mirrored module notes its copy's gradients and
buffers before the copy's first forward in the step; a variable written by one replica (a metric's
total, say) notes its copy before the first write. A mirrored optimizer commits the journal once
its update is applied on every replica: a later failure in the same run keeps that update (the
replicas passed the gradient all-reduce together, so all of them applied it) and puts back only what
changed since. If the run fails, the caller's thread rolls back every finished replica's journal,
once all the replicas have stopped, before the error reaches the caller. Uses torch only.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn


class _ModuleNote:
    """A module copy's state before its first forward in a step: its gradients (None stays None; a
    gradient that exists, which backward would add to in place, is copied) and its buffers.

    Every replica notes its copy every step, holding the GIL, so this is on the step's path: the
    walk reads torch's dicts directly (module.modules() builds a name string per module)."""

    __slots__ = ("params", "grads", "buffers", "saved")

    def __init__(self, module: nn.Module):
        params, buffers = _parameters_and_buffers(module)
        self.params = params
        self.grads = [None if p.grad is None else p.grad.detach().clone() for p in params]
        # Only a module in training mode updates its buffers in forward (BatchNorm's statistics).
        self.buffers = buffers if module.training else []
        with torch.no_grad():  # (one torch call for all of them: a call per buffer costs ~3 us)
            self.saved = list(torch._foreach_clone(self.buffers)) if self.buffers else []

    def restore(self) -> None:
        with torch.no_grad():
            for p, g in zip(self.params, self.grads):
                p.grad = g
            for b, saved in zip(self.buffers, self.saved):
                b.copy_(saved)


def modules_in_order(module: nn.Module) -> list[nn.Module]:
    """`module` and every module inside it, each once, in module.modules() order (read from torch's
    dicts: module.modules() builds a name string per module). Depth first, a child iterator per open
    module: half the cost of a stack of modules, which reversed and copied each module's children."""
    modules = [module]
    seen = {id(module)}
    open_ = [iter(module._modules.values())]
    while open_:
        for child in open_[-1]:
            if child is not None and id(child) not in seen:
                seen.add(id(child))
                modules.append(child)
                open_.append(iter(child._modules.values()))
                break
        else:
            open_.pop()
    return modules


def _parameters_and_buffers(module: nn.Module) -> tuple[list[Tensor], list[Tensor]]:
    """The parameters and buffers of `module` and of every module inside it (each module once, in
    module.modules() order)."""
    modules = modules_in_order(module)
    return ([p for m in modules for p in m._parameters.values() if p is not None],
            [b for m in modules for b in m._buffers.values() if b is not None])


class StepJournal:
    """What one replica's step changed first, to put back if the step fails."""

    __slots__ = ("_modules", "_tensors", "_grads_only", "_others", "updating", "updates", "check")

    def __init__(self) -> None:
        self.updating = False  # whether this step began to apply an update (before_update)
        self.updates = 0  # how many updates it began (several in a group of steps: steps_per_execution)
        # Called by before_update first: raising there fails the step before the weights change (the
        # watch over a step on the caller's thread without the replica random mode, strategy.py).
        self.check: Callable[[], None] | None = None
        self._modules: dict[int, _ModuleNote] = {}
        self._tensors: dict[int, tuple[Tensor, Tensor]] = {}
        self._others: dict[int, Callable[[], None]] = {}
        self._grads_only: dict[int, _ModuleNote] = {}  # gradients noted before a committed update

    def before_forward(self, module: nn.Module) -> None:
        """Notes `module`'s gradients and buffers, once per step (per commit)."""
        key = id(module)
        if key not in self._modules:
            self._modules[key] = _ModuleNote(module)
            self._grads_only.pop(key, None)  # the new note holds the gradients as they are now

    def before_write(self, tensor: Tensor) -> None:
        """Notes `tensor`'s value before its first write in this step (a metric's or variable's copy)."""
        if id(tensor) not in self._tensors:
            self._tensors[id(tensor)] = (tensor, tensor.detach().clone())

    def before_change(self, obj: Any, save: Callable[[], Callable[[], None]]) -> None:
        """Notes any other state of `obj` before its first change in this step: `save()` copies what it
        needs and returns the function that puts it back (an optimizer's accumulated gradients and
        step count, say)."""
        if id(obj) not in self._others:
            self._others[id(obj)] = save()

    def before_update(self) -> None:
        """The step is about to change what no journal notes (the weights, by an optimizer's update):
        from here a failure can roll the step back only as far as commit() says, and it cannot be run
        again (strategy.run redoes a step that drew without the replica random mode only before it)."""
        if self.check is not None and not self.updating:
            self.check()
        self.updating = True
        self.updates += 1

    def commit(self) -> None:
        """The step's update is applied (on every replica): buffers, metrics and variables changed so
        far stay. Gradients still go back to what they were before the step if the run fails later
        (the update consumed them; the next step must not add them in again)."""
        for key, note in self._modules.items():
            note.buffers, note.saved = [], []
            self._grads_only[key] = note
        self._modules.clear()
        self._tensors.clear()
        self._others.clear()

    def rollback(self) -> None:
        """Puts back everything noted, newest first (a tensor noted twice keeps its oldest value)."""
        for restore in reversed(list(self._others.values())):
            restore()
        for tensor, saved in reversed(list(self._tensors.values())):
            with torch.no_grad():
                tensor.copy_(saved)
        for note in reversed(list(self._modules.values())):
            note.restore()
        for note in self._grads_only.values():
            note.restore()
        self._modules.clear()
        self._tensors.clear()
        self._grads_only.clear()
        self._others.clear()


def saved_item(items: list[Any], i: int) -> Callable[[], None]:
    """items[i] as it is now, as a function that puts it back (for StepJournal.before_change)."""
    saved = items[i]

    def restore() -> None:
        items[i] = saved

    return restore


def current_journal() -> StepJournal | None:
    """The journal of the replica running on this thread inside strategy.run, None elsewhere: state
    that a step changes outside modules and variables notes itself here (see before_change)."""
    from mirrored.distribute import context

    return journal_of(context.get_replica_context())


def journal_of(ctx: Any) -> StepJournal | None:
    """The journal of replica context `ctx` (None outside strategy.run, or for a context that
    strategy.run did not make)."""
    return getattr(ctx, "_journal", None) if ctx is not None else None
