"""Guards against plain torch state shared by replica threads: inside strategy.run on several
replicas of one process, stepping a torch optimizer that strategy.mirror_optimizer did not make, or
training a module that strategy.mirror did not copy, raises instead of letting every replica
update the same parameters.

Both checks use torch's process-wide hooks, so they are installed lazily, by the first strategy.run
with several replica threads, and a program that never runs one pays nothing. The optimizer check
(one call per optimizer step) stays installed. The module check runs on every module call while it
is installed, and an installed global module hook takes every module in the process off torch's
hook-free fast path (~3 us a call), so it is installed only for the first run of each replica
function of each strategy: the step function that trains a plain module does so from its first
run, and later runs cost nothing. Uses context.py only.
"""
from __future__ import annotations

import contextlib
import threading
import weakref
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
from torch import nn
from torch.nn.modules import module as torch_module
from torch.optim import optimizer as torch_optimizer

from mirrored.distribute import context

_MAX_CHECKED = 256  # replica functions remembered per strategy (one entry per step function's code)

_lock = threading.Lock()
_replica_optimizers: weakref.WeakSet = weakref.WeakSet()  # the torch optimizers of mirrored optimizers
_replica_modules: weakref.WeakSet = weakref.WeakSet()  # every module inside a mirrored module's copies
_copies: weakref.WeakSet = weakref.WeakSet()  # the copies themselves (a module added to one by hand)
_checked: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # strategy -> codes of checked functions
_optimizer_hook: Any = None
_module_hook: Any = None
_module_hook_users = 0


def allow_optimizers(optimizers: Iterable[torch.optim.Optimizer]) -> None:
    """The per-replica optimizers of a mirrored optimizer: stepping them in replica context is right."""
    for opt in optimizers:
        _replica_optimizers.add(opt)


def allow_modules(copies: Iterable[nn.Module]) -> None:
    """The copies of a mirrored module (and every module inside them) may train in replica context."""
    for copy_ in copies:
        _copies.add(copy_)
        for m in copy_.modules():
            _replica_modules.add(m)


def watch(strategy: Any, fn: Callable[..., Any]) -> contextlib.AbstractContextManager:
    """What strategy.run wraps its replica threads in: the optimizer check from now on, and the
    module check during the first run of `fn` (by its code) on `strategy`."""
    global _optimizer_hook
    code = _code_of(fn)
    with _lock:
        if _optimizer_hook is None:
            _optimizer_hook = torch_optimizer.register_optimizer_step_pre_hook(_check_optimizer_step)
        seen = _checked.setdefault(strategy, set())
        if code in seen:
            return contextlib.nullcontext()
        if len(seen) >= _MAX_CHECKED:
            seen.clear()
        seen.add(code)
    return _module_check()


def _code_of(fn: Callable[..., Any]) -> Any:
    func = getattr(fn, "__func__", fn)  # a bound method: its function's code
    return getattr(func, "__code__", type(fn))


@contextlib.contextmanager
def _module_check() -> Iterator[None]:
    global _module_hook, _module_hook_users
    with _lock:
        if _module_hook is None:
            _module_hook = torch_module.register_module_forward_pre_hook(_check_module_call)
        _module_hook_users += 1
    try:
        yield
    finally:
        with _lock:
            _module_hook_users -= 1
            if _module_hook_users == 0:
                _module_hook.remove()
                _module_hook = None


def _threads_sharing() -> int:
    """How many replica threads share this process's state with the calling one; 0 outside
    strategy.run (or in a run of one replica, or a worker's one replica)."""
    if not context.has_strategy():
        return 0
    ctx = context.get_replica_context()
    if ctx is None:
        return 0
    n = len(ctx.strategy.extended.worker_devices)
    return n if n > 1 else 0


def _check_optimizer_step(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    del args, kwargs
    n = _threads_sharing()
    if n and optimizer not in _replica_optimizers:
        name = type(optimizer).__name__
        raise RuntimeError(
            f"{name}.step() inside strategy.run on {n} replicas: this torch optimizer was not made by "
            "strategy.mirror_optimizer, so every replica would update the same parameters with its own "
            f"gradients. Make it with strategy.mirror_optimizer(torch.optim.{name}, mnet, **hyperparameters) "
            "over the module strategy.mirror() returned; its step() all-reduces the gradients first.")


def _check_module_call(module: nn.Module, args: Any) -> None:
    del args
    if not torch.is_grad_enabled():
        return
    n = _threads_sharing()
    if not n or module in _replica_modules:
        return
    if not any(p is not None and p.requires_grad for p in module._parameters.values()):
        return  # nothing to train: a parameter-free layer, or a frozen one
    if any(module is m for copy_ in list(_copies) for m in copy_.modules()):
        _replica_modules.add(module)  # added to a copy after strategy.mirror: it is a replica's own
        return
    raise RuntimeError(
        f"{type(module).__name__} was called inside strategy.run on {n} replicas with gradients on, but it is a "
        "plain torch module (strategy.mirror did not copy it): every replica would run backward into the same "
        "parameters and update them. Mirror it - mnet = strategy.mirror(net) in `with strategy.scope():` - and "
        "call mnet; a module that is not trained may run under torch.no_grad() or after requires_grad_(False).")
