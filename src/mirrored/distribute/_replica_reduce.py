"""What each replica thread keeps between its in-step all-reduces, and ctx.all_reduce under autograd.

_replica_entry() and _recent() find a replica's entry of a cache of bucket layouts (the strategy's
for ctx.all_reduce, kept least recently used); _DIRECT_NUMEL is where a tensor stops being packed;
_AllReduceFunction makes ctx.all_reduce differentiable. Used by strategy.py and reducer.py (a
mirrored optimizer's gradients). Uses replicas.py.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from mirrored.distribute import replicas
from mirrored.distribute.values import ReduceOp

if TYPE_CHECKING:
    from mirrored.distribute.context import ReplicaContext
    from mirrored.distribute.strategy import Strategy

_DIRECT_NUMEL = 1 << 16  # tensors this large are reduced where they lie; packing them would only copy
_VALUE_LAYOUTS_KEPT = 16  # ctx.all_reduce layouts (plans, no buffers) kept per replica


def _replica_entry(ctx: ReplicaContext, cache: dict, make: Callable[[], Any], what: str) -> Any:
    """The calling replica's entry of `cache`, made on first use: each replica thread has its own,
    and setdefault is atomic. An abandoned replica of a failed step gets _Released instead, so it
    never touches what its replacement thread now uses."""
    if ctx._step.error is not None:
        raise replicas._Released(what)
    entry = cache.get(ctx._replica_id)
    return entry if entry is not None else cache.setdefault(ctx._replica_id, make())


def _recent(cache: dict, key: Any, make: Callable[[], Any], kept: int) -> Any:
    """cache[key], made by `make()` when missing; keeps the `kept` most recently used."""
    value = cache.pop(key, None)
    if value is None:
        while len(cache) >= kept:
            del cache[next(iter(cache))]
        value = make()
    cache[key] = value  # most recently used last
    return value


class _AllReduceFunction(torch.autograd.Function):
    """ctx.all_reduce under autograd: backward all-reduces the upstream gradients with the same op
    (d/dx_r of sum_k L_k for y = SUM_r x_r is SUM_k dL_k/dy), as TF's all-reduce gradient does."""

    @staticmethod
    def forward(fctx: Any, strategy: Strategy, rctx: ReplicaContext, op: ReduceOp, *leaves: Tensor) -> tuple:
        fctx.strategy, fctx.rctx, fctx.op = strategy, rctx, op
        return tuple(strategy._all_reduce_leaves(rctx, op, leaves))

    @staticmethod
    def backward(fctx: Any, *upstream: Tensor) -> tuple:
        reduced = fctx.strategy._all_reduce_leaves(fctx.rctx, fctx.op, upstream)
        return (None, None, None, *reduced)
