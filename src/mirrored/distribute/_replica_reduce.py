"""What each replica thread keeps between its in-step all-reduces (ctx.all_reduce and a mirrored
optimizer's gradient all-reduce).

_GradientState holds one replica's persistent gradient buffers per optimizer, a few layouts kept
least recently used, and the gradient-mask unions learned; _replica_entry() and _recent() find a
replica's entry of such a cache; _union_is_exact() is how the replicas agree on which gradients
exist in the same meeting that reduces them; _AllReduceFunction makes ctx.all_reduce
differentiable. Used by strategy.py only. Uses buckets.py and replicas.py.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from mirrored.distribute import buckets, replicas
from mirrored.distribute.values import ReduceOp

if TYPE_CHECKING:
    from mirrored.distribute.context import ReplicaContext
    from mirrored.distribute.strategy import Strategy

_DIRECT_NUMEL = 1 << 16  # tensors this large are reduced where they lie; packing them would only copy
_LAYOUTS_KEPT = 4  # gradient layouts (persistent reduction buffers) kept per optimizer and replica
_VALUE_LAYOUTS_KEPT = 16  # ctx.all_reduce layouts (plans, no buffers) kept per replica


class _GradientState:
    """One replica's gradient buffers for one optimizer: a few sets, least recently used out, and
    the mask unions learned (which gradients the other replicas had when this one lacked some)."""

    def __init__(self) -> None:
        self.layouts: dict[tuple, buckets.LayoutBuffers] = {}  # by (mask union, dtypes)
        self.unions: dict[tuple[bool, ...], tuple[bool, ...]] = {}

    def buffers(self, grads: Sequence[Tensor | None], union: tuple[bool, ...],
                bytes_per_pack: int) -> buckets.LayoutBuffers:
        """Buffers for `grads`, which are present exactly where `union` says. Keyed by the union and
        the gradients' dtypes, not their shapes too (a third of the cost): torch holds each .grad to
        its parameter's shape, which does not change, while .double() or .half() changes a
        parameter's dtype in place. (A module moved to another device is not a replica any more.)"""
        key = (union, tuple(g.dtype for g in grads if g is not None))
        return _recent(self.layouts, key,
                       lambda: buckets.Layout(grads, bytes_per_pack, _DIRECT_NUMEL).buffers(in_place=True),
                       _LAYOUTS_KEPT)

    def learn(self, mask: tuple[bool, ...], union: tuple[bool, ...]) -> None:
        if len(self.unions) >= 4 * _LAYOUTS_KEPT:
            self.unions.clear()
        self.unions[mask] = union


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


def _union_is_exact(tokens: list[tuple[tuple[bool, ...], tuple[bool, ...]]]) -> bool:
    """Every replica expected the same union of gradient masks, and it is the true one."""
    expected = tokens[0][1]
    if all(mask == expected for mask, _ in tokens):  # the common case: everyone has the same gradients
        return all(union == expected for _, union in tokens)
    if any(union != expected or len(mask) != len(expected) for mask, union in tokens):
        return False
    return expected == _union_of([mask for mask, _ in tokens])


def _union_of(masks: Sequence[tuple[bool, ...]]) -> tuple[bool, ...]:
    """Which gradients at least one replica has (masks of equal length)."""
    return tuple(map(any, zip(*masks)))


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
