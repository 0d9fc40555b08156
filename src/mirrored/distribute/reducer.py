"""The gradient reducer: where the replicas' gradients meet, one per MirroredOptimizer.

`GradientReducer.reduce(ctx, params, grads)` is called by every replica of every worker at once
(MirroredOptimizer.step / reduce_gradients: custom loops, fit and the Keras adapter alike) and
returns the SUM of the replicas' gradients, or with `weight=` their weighted sum, divided by the
total weight unless `divide=False`. It owns:

- the buckets: small gradients packed into flat buffers that each replica keeps between steps
  (buckets.Layout), large ones reduced where they lie, in their `.grad`, as DDP reduces them;
- the None-gradient policy: a gradient None on every replica stays None; None on some counts as
  zeros there;
- the copy check: each replica brings its module copy's CopyWatch signature to the meeting that
  reduces its gradients, and where the copies differ nothing is reduced (_copy_watch.py);

over a `Communicator`: the replica threads of this process (the step's Rendezvous and the
strategy's CrossDeviceOps), torch.distributed across worker processes (CollectiveAllReduce), or
both (HierarchicalAllReduce: the local sum, then across the workers). The strategy says which
(`Strategy._communicator`). Uses buckets.py, cross_device_ops.py, replicas.py, _replica_reduce.py
and values.py; the copy watch and the communicator's ops are handed in.
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

import torch
from torch import Tensor

from mirrored.distribute import buckets, replicas
from mirrored.distribute._replica_reduce import _DIRECT_NUMEL, _recent
from mirrored.distribute.cross_device_ops import CrossDeviceOps, Disagreement
from mirrored.distribute.values import ReduceOp

if TYPE_CHECKING:
    from mirrored.distribute._collectives import CollectiveAllReduce
    from mirrored.distribute._copy_watch import CopyWatch
    from mirrored.distribute.context import ReplicaContext

_LAYOUTS_KEPT = 4  # gradient layouts (persistent reduction buffers) kept per optimizer and replica
_WHAT = "all_reduce (gradients)"  # how the meeting is named in errors (a replica that called something else)
_MEETINGS = 3  # at most: a copy check settled, a new gradient mask learned, then the reduction itself


class Communicator(NamedTuple):
    """Who one process's replicas reduce with. `threads`: the strategy's cross-device ops, met through
    each step's Rendezvous, where this process holds several replicas (HierarchicalAllReduce where
    they also cross workers); `workers`: torch.distributed across worker processes, where there are
    several. Neither: a lone replica, whose gradients are the sum."""

    threads: CrossDeviceOps | None
    workers: CollectiveAllReduce | None


class _ReplicaState:
    """What one replica keeps between its gradient reductions: a few sets of bucket buffers (least
    recently used out), the gradient-mask unions it learned, and a weighted reduction's stand-in
    parameter for the total weight."""

    __slots__ = ("layouts", "unions", "count")

    def __init__(self) -> None:
        self.layouts: dict[tuple, buckets.LayoutBuffers] = {}
        self.unions: dict[tuple[bool, ...], tuple[bool, ...]] = {}
        self.count: Tensor | None = None

    def buffers(self, tensors: Sequence[Tensor | None], travel: tuple, bytes_per_pack: int) -> buckets.LayoutBuffers:
        """Buffers for `tensors`, which are present exactly where `travel` says. Keyed by that and the
        tensors' dtypes, not their shapes too (a third of the cost): torch holds each .grad to its
        parameter's shape, which does not change, while .double() or .half() changes a parameter's
        dtype in place. (A module moved to another device is not a replica any more.)"""
        key = (travel, tuple(t.dtype for t in tensors if t is not None))
        return _recent(self.layouts, key,
                       lambda: buckets.Layout(tensors, bytes_per_pack, _DIRECT_NUMEL).buffers(in_place=True),
                       _LAYOUTS_KEPT)

    def learn(self, mask: tuple[bool, ...], union: tuple[bool, ...]) -> None:
        if len(self.unions) >= 4 * _LAYOUTS_KEPT:
            self.unions.clear()
        self.unions[mask] = union

    def count_param(self, params: Sequence[Tensor]) -> Tensor:
        """The stand-in parameter whose "gradient" is this replica's weight: it travels as one more
        entry of the same all-reduce, on the first trained parameter's device."""
        if self.count is None:
            first = next((p for p in params if p.requires_grad), params[0])
            dtype = first.dtype if first.dtype in (torch.float32, torch.float64) else torch.float32
            self.count = torch.zeros((), dtype=dtype, device=first.device, requires_grad=True)
        return self.count


class GradientReducer:
    """One optimizer's gradient all-reduce over `communicator`, for this process's `devices`.

    One None-gradient policy, with two mechanisms, chosen by what the transport can carry. Between
    threads, values travel for free: each replica brings its mask (which gradients it has) to the
    meeting that reduces them, with the union of masks it expects (learned the first time it had
    this mask), and the reduction goes ahead when every expectation is the true union; only a new
    mask makes the replicas meet a second time, with the union filled in with zeros. Across
    processes only tensors travel, and an extra exchange would cost a round trip every step: every
    parameter that requires grad travels (zeros where absent) with a count per parameter of the
    replicas that had a gradient, so the buckets are alike on every rank without a separate
    exchange, and a gradient no replica had comes back None.

    Args:
      communicator: whom to reduce with (Strategy._communicator()).
      devices: this process's replicas' devices, one state per replica.
      watch: the module copies' CopyWatch (several replicas in this process), compared in the meeting.
      where: how errors name the reduction ("MirroredOptimizer(2 replicas of SGD), all-reducing ...").
    """

    def __init__(self, communicator: Communicator, devices: Sequence[torch.device], watch: CopyWatch | None,
                 where: str):
        self._threads, self._workers = communicator
        self._devices = tuple(devices)
        self._watch = watch
        self._where = where
        self._states = [_ReplicaState() for _ in self._devices]

    @property
    def lone(self) -> bool:
        """Whether this replica reduces with nobody (one replica in all): the gradients are the sum."""
        return self._threads is None and self._workers is None

    def reduce(self, ctx: ReplicaContext, params: Sequence[Tensor], grads: list[Tensor | None],
               weight: float | Tensor | None = None, divide: bool = True) -> list[Tensor | None]:
        """Every replica's gradients of its copies of `params` combined (called on every replica at once):
        their SUM, or with `weight` (this replica's; a number or a 0-dim tensor, >= 0) the sum of each
        replica's gradients times its weight, divided by the replicas' total weight unless `divide` is
        False (where the total is 0, by 1). Each result may be the given tensor, reduced in place."""
        if weight is None:
            return self._sum(ctx, params, grads)
        if self.lone:  # w g / w, bitwise g (a mean over one replica's examples is one device's)
            return grads if divide else _scaled(grads, weight)
        if not isinstance(weight, Tensor) and weight == 0:
            grads = [None] * len(grads)  # an empty part: its loss, a mean over nothing, is NaN
        elif isinstance(weight, Tensor) or weight != 1:
            grads = _scaled(grads, weight)
        count = self._states[ctx._replica_id].count_param(params)
        if isinstance(weight, Tensor):
            sent = weight.detach().to(device=count.device, dtype=count.dtype, non_blocking=True).reshape(())
        else:
            sent = torch.tensor(float(weight), dtype=count.dtype, device=count.device)
        reduced = self._sum(ctx, [*params, count], [*grads, sent])
        if divide:
            total = reduced[-1]
            # torch.where, not a Python test: no device sync in the step
            torch._foreach_div_([g for g in reduced[:-1] if g is not None], torch.where(total != 0, total, 1))
        return reduced[:-1]

    def _sum(self, ctx: ReplicaContext, params: Sequence[Tensor], grads: list[Tensor | None]) -> list[Tensor | None]:
        if self._workers is not None:
            return self._sum_over_workers(ctx, params, grads)
        if self._threads is not None:
            return self._sum_over_threads(ctx, params, grads)
        return grads

    # ---- between the replica threads of one process: the masks travel as tokens ------------------
    def _sum_over_threads(self, ctx: ReplicaContext, params: Sequence[Tensor],
                          grads: list[Tensor | None]) -> list[Tensor | None]:
        _refuse_abandoned(ctx)
        rid = ctx._replica_id
        state = self._states[rid]
        copies = None if self._watch is None else self._watch.signature(rid)
        mask = tuple(g is not None for g in grads)
        union = state.unions.get(mask, mask)
        for _ in range(_MEETINGS):
            if union != mask:  # zeros where this replica's loss did not reach a parameter others need
                sent = [torch.zeros_like(params[i]) if needed and g is None else g
                        for i, (g, needed) in enumerate(zip(grads, union))]
            else:
                sent = grads
            layout = state.buffers(sent, union, self._threads.bytes_per_pack)
            inputs, outputs, results = layout.stage(sent, like=params)  # (a gradient laid out like its parameter)
            reduced = self._threads.all_reduce(ctx._step, rid, ReduceOp.SUM, inputs, outputs,
                                               agree=(mask, union, copies), agreed=_copies_and_union_agree, what=_WHAT)
            if not isinstance(reduced, Disagreement):
                return results
            tokens = reduced.tokens
            if any(token[2] != copies for token in tokens):
                copies = self._settle(rid, [token[2] for token in tokens])
                continue
            masks = [token[0] for token in tokens]
            if any(len(m) != len(mask) for m in masks):
                raise replicas.CollectiveMismatchError(
                    f"optimizer.step: the replicas' optimizers hold different numbers of parameters "
                    f"({[len(m) for m in masks]}). Every replica must step the same mirrored optimizer.")
            union = _union_of(masks)
            state.learn(mask, union)
        raise RuntimeError("the replicas disagree on the union of their gradient masks (internal error).")

    def _settle(self, rid: int, signatures: list[Any]) -> Any:
        """The replicas' copy signatures differed: raises unless only write counts differ over equal
        values (CopyWatch.settle, the same on every replica); then the signature to meet with again."""
        self._watch.settle(rid, signatures, self._where)
        return self._watch.signature(rid)

    # ---- across worker processes: the agreement travels in the tensors -----------------------------
    def _sum_over_workers(self, ctx: ReplicaContext, params: Sequence[Tensor],
                          grads: list[Tensor | None]) -> list[Tensor | None]:
        local = self._threads  # HierarchicalAllReduce where this worker holds several replicas
        if local is not None:
            _refuse_abandoned(ctx)
        rid = ctx._replica_id
        state = self._states[rid]
        trained = tuple(p.requires_grad for p in params)
        idx = [i for i, t in enumerate(trained) if t]
        device = params[idx[0]].device if idx else self._devices[rid]
        had = torch.tensor([float(grads[i] is not None) for i in idx], device=device)
        sent = [grads[i] if grads[i] is not None else torch.zeros_like(params[i]) for i in idx] + [had]
        like = [params[i] for i in idx] + [had]
        layout = state.buffers(sent, ("workers", trained), self._workers.bytes_per_pack)
        inputs, outputs, results = layout.stage(sent, like=like)
        if local is None:
            self._workers.all_sum_(inputs, _WHAT)
        else:
            copies = None if self._watch is None else self._watch.signature(rid)
            for _ in range(_MEETINGS):
                reduced = local.all_reduce(ctx._step, rid, ReduceOp.SUM, inputs, outputs, agree=copies, what=_WHAT,
                                           check_workers=False)
                if not isinstance(reduced, Disagreement):
                    break
                copies = self._settle(rid, list(reduced.tokens))
            else:
                raise RuntimeError("the replicas' module copies disagree after settling (internal error).")
        out = list(grads)
        for j, (i, count) in enumerate(zip(idx, results[-1].tolist())):
            out[i] = results[j] if count > 0 else None
        return out


def _refuse_abandoned(ctx: ReplicaContext) -> None:
    """A replica abandoned by a failed step (its thread replaced) stops here: its state is its
    replacement's now."""
    if ctx._step.error is not None:
        raise replicas._Released(_WHAT)


def _copies_and_union_agree(tokens: list[tuple[tuple[bool, ...], tuple[bool, ...], Any]]) -> bool:
    """The replicas' module copies agree (their CopyWatch signatures) and so do their gradient masks."""
    copies = tokens[0][2]
    return all(token[2] == copies for token in tokens) and _union_is_exact([token[:2] for token in tokens])


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


def _dense(t: Tensor) -> bool:
    """Whether t can be scaled in place: no element shares memory with another (an expanded gradient does)."""
    return t.is_contiguous() or t.is_contiguous(memory_format=torch.channels_last)


def _scaled(grads: list[Tensor | None], weight: float | Tensor) -> list[Tensor | None]:
    """Each gradient times `weight`, in place where it can be. A tensor weight of 0 gives zeros even
    where the gradient is NaN (a loss averaged over nothing), without reading the weight on the host."""
    present = [g for g in grads if g is not None]
    if not present:
        return grads
    if isinstance(weight, Tensor):
        weight = weight.detach().to(present[0].device, non_blocking=True).reshape(())
    else:
        weight = float(weight)
    in_place = [g for g in present if _dense(g)]
    if in_place:
        torch._foreach_mul_(in_place, weight)
    out = [g if g is None or _dense(g) else g * weight for g in grads]
    if isinstance(weight, Tensor):
        mute = weight == 0
        for g in out:
            if g is not None:
                g.masked_fill_(mute, 0)
    return out


def check_weight(weight: Any, where: str) -> None:
    """Refuses what cannot be a replica's gradient weight, naming it; a tensor's value is not read
    (that would sync its device), only its size and dtype."""
    if isinstance(weight, Tensor):
        if weight.numel() != 1 or weight.dtype == torch.bool or weight.is_complex():
            raise ValueError(f"{where}: a tensor weight must hold one real number (a count, or a sum of example "
                             f"weights); got shape {tuple(weight.shape)}, dtype {weight.dtype}.")
        return
    if isinstance(weight, bool) or not isinstance(weight, (int, float)):
        raise TypeError(f"{where}: weight={weight!r} must be a number or a one-element tensor, such as the count "
                        "of labels this replica's loss averaged over.")
    if not math.isfinite(weight) or weight < 0:
        raise ValueError(f"{where}: weight={weight!r} must be finite and >= 0 (0: this replica's gradients do not "
                         "count).")
