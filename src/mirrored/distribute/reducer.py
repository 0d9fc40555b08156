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
- sparse gradients (nn.Embedding(sparse=True)): summed apart from the buckets into a coalesced sparse
  gradient, gathered or densified by their size (_sparse.py); a gradient sparse on some replicas and
  dense on others sums dense;

over a `Communicator`: the replica threads of this process (the step's Rendezvous and the
strategy's CrossDeviceOps), torch.distributed across worker processes (CollectiveAllReduce), or
both (HierarchicalAllReduce: the local sum, then across the workers). The strategy says which
(`Strategy._communicator`). Uses buckets.py, cross_device_ops.py, replicas.py, _replica_reduce.py,
_sparse.py and values.py; the copy watch and the communicator's ops are handed in.
"""
from __future__ import annotations

import functools
import math
import numbers
import operator
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

import torch
from torch import Tensor

from mirrored.distribute import _sparse, buckets, replicas
from mirrored.distribute._replica_reduce import _DIRECT_NUMEL, _recent
from mirrored.distribute.cross_device_ops import CrossDeviceOps, Disagreement
from mirrored.distribute.values import ReduceOp

if TYPE_CHECKING:
    from mirrored.distribute._collectives import CollectiveAllReduce
    from mirrored.distribute._copy_watch import CopyWatch
    from mirrored.distribute.context import ReplicaContext

_LAYOUTS_KEPT = 4  # gradient layouts (persistent reduction buffers) kept per optimizer and replica
_WHAT = "all_reduce (gradients)"  # how the meeting is named in errors (a replica that called something else)
_WHAT_SPARSE = "all_reduce (sparse gradients)"
_SPARSE = "sparse"  # a gradient mask's entry for a sparse gradient (True: a dense one; False: None)
_IS_SPARSE = operator.attrgetter("is_sparse")
_PRESENT = functools.partial(operator.is_not, None)
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
    recently used out), the gradient-mask unions it learned, a weighted reduction's stand-in
    parameter for the total weight, (across workers) which parameters have sparse gradients, and the
    sizes of the tensors riding with the reduction under way."""

    __slots__ = ("layouts", "unions", "count", "sparse", "riders", "weight")

    def __init__(self) -> None:
        self.weight: tuple[float, Tensor] | None = None  # the last weight sent, as a number and a tensor
        self.riders: tuple[int, ...] = ()  # the sizes of the riders of the reduction under way (reduce())
        self.layouts: dict[tuple, buckets.LayoutBuffers] = {}
        self.unions: dict[tuple, tuple] = {}
        self.count: Tensor | None = None
        self.sparse: frozenset[int] = frozenset()  # across workers: the parameters seen with sparse gradients

    def buffers(self, tensors: Sequence[Tensor | None], travel: tuple, bytes_per_pack: int) -> buckets.LayoutBuffers:
        """Buffers for `tensors`, which are present exactly where `travel` says. Keyed by that and the
        tensors' dtypes, not their shapes too (a third of the cost): torch holds each .grad to its
        parameter's shape, which does not change, while .double() or .half() changes a parameter's
        dtype in place. (A module moved to another device is not a replica any more.)"""
        key = (travel, tuple([t.dtype for t in tensors if t is not None]), self.riders)  # (riders' sizes vary)
        return _recent(self.layouts, key,
                       lambda: buckets.Layout(tensors, bytes_per_pack, _DIRECT_NUMEL).buffers(in_place=True),
                       _LAYOUTS_KEPT)

    def learn(self, mask: tuple[bool, ...], union: tuple[bool, ...]) -> None:
        if len(self.unions) >= 4 * _LAYOUTS_KEPT:
            self.unions.clear()
        if union != mask:  # (an equal one is what unions.get(mask, mask) gives: the mask itself)
            self.unions[mask] = union

    def weight_tensor(self, weight: float, count: Tensor) -> Tensor:
        """`weight` as a tensor like `count`, the one of the last call while the weight is the same (it
        travels packed, copied into the reduction's buffer, so it is never written)."""
        kept = self.weight
        if kept is None or kept[0] != weight or kept[1].dtype != count.dtype or kept[1].device != count.device:
            kept = self.weight = (weight, torch.tensor(weight, dtype=count.dtype, device=count.device))
        return kept[1]

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
    exchange, and a gradient no replica had comes back None. Sparse gradients travel apart, after
    the buckets: between threads a mask says which are sparse; across workers a second count per
    parameter does, and a parameter seen sparse once is known so on every rank from then on.

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
               weight: float | Tensor | None = None, divide: bool = True,
               riders: Sequence[Tensor] = ()) -> list[Tensor | None]:
        """Every replica's gradients of its copies of `params` combined (called on every replica at once):
        their SUM, or with `weight` (this replica's; a number or a 0-dim tensor, >= 0) the sum of each
        replica's gradients times its weight, divided by the total weight unless `divide` is False (a
        total of 0 leaves the zeros it weighed). Each result may be the given tensor, reduced in place.
        `riders` (dense tensors the replicas hold alike, between the threads of one process) are summed
        as they are in the same meeting, their sums (which the next reduction may overwrite) after the
        gradients': the optimizer's buffer average travels so, which saves it a meeting of its own."""
        # (a large rider would be reduced where it lies, as a large gradient is: it travels in a copy)
        riders = [r.clone() if r.numel() >= _DIRECT_NUMEL else r for r in riders] if self.riders_ride else []
        n = len(grads)
        self._states[ctx._replica_id].riders = tuple(r.numel() for r in riders)
        if weight is None:
            return self._sum(ctx, [*params, *riders], [*grads, *riders])
        if self.lone:  # w g / w, bitwise g (a mean over one replica's examples is one device's)
            return grads if divide or (not isinstance(weight, Tensor) and weight == 1) else _scaled(grads, weight)
        if not isinstance(weight, Tensor) and weight == 0:
            grads = [None] * len(grads)  # an empty part: its loss, a mean over nothing, is NaN
        elif isinstance(weight, Tensor) or weight != 1:
            grads = _scaled(grads, weight)
        count = self._states[ctx._replica_id].count_param(params)
        if isinstance(weight, Tensor):
            sent = weight.detach().to(device=count.device, dtype=count.dtype, non_blocking=True).reshape(())
        else:
            sent = self._states[ctx._replica_id].weight_tensor(float(weight), count)
        reduced = self._sum(ctx, [*params, count, *riders], [*grads, sent, *riders])
        if divide:  # a total of 0 (no replica weighs) divides zeros: by the smallest positive number, not 0
            total = reduced[n].clamp(min=torch.finfo(count.dtype).tiny)  # (no Python test: no device sync)
            present = [g for g in reduced[:n] if g is not None]
            if present:  # (none where no replica had an example: every gradient stays None)
                torch._foreach_div_(present, total)
        return reduced[:n] + reduced[n + 1:]

    @property
    def riders_ride(self) -> bool:
        """Whether reduce() carries riders: between the replica threads of one process (across workers
        they would travel with every parameter's presence count: the caller meets apart there)."""
        return self._threads is not None and self._workers is None

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
        mask, has_sparse = _mask_of(grads)
        union = state.unions.get(mask, mask)
        for _ in range(_MEETINGS):
            # Zeros where this replica's loss did not reach a parameter others need; sparse gradients apart.
            sent = grads if union is mask and not has_sparse else _dense_part(params, grads, union)
            layout = state.buffers(sent, union, self._threads.bytes_per_pack)
            inputs, outputs, results = layout.stage(sent, like=params)  # (a gradient laid out like its parameter)
            reduced = self._threads.all_reduce(ctx._step, rid, ReduceOp.SUM, inputs, outputs,
                                               agree=(mask, union, copies), agreed=_copies_and_union_agree, what=_WHAT)
            if not isinstance(reduced, Disagreement):
                if union is not mask or has_sparse:
                    self._sparse_over_threads(ctx, grads, union, results)
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

    def _sparse_over_threads(self, ctx: ReplicaContext, grads: list[Tensor | None], union: tuple,
                             results: list[Tensor | None]) -> None:
        """Fills in `results` the sums of the gradients the replicas agreed are sparse, in a meeting of
        their own (the last to arrive sums for everyone)."""
        columns = [i for i, kind in enumerate(union) if kind == _SPARSE]
        if not columns:
            return
        devices = self._devices

        def combine(everyone: list[list[Tensor | None]]) -> list[list[Tensor | None]]:
            totals = [_sparse.local_sum(parts, devices[0]) for parts in
                      ([e[c] for e in everyone if e[c] is not None] for c in range(len(columns)))]
            return _per_replica(totals, devices)

        summed = ctx._step.exchange(ctx._replica_id, [grads[i] for i in columns], _WHAT_SPARSE, combine)
        for i, total in zip(columns, summed[ctx._replica_id]):
            results[i] = total

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
        known = state.sparse  # (learned alike by every replica of every worker, from the counts below)
        has_sparse = any(map(_IS_SPARSE, filter(_PRESENT, grads)))
        device = params[idx[0]].device if idx else self._devices[rid]
        # Per parameter: the replicas that had a gradient, then those whose gradient was sparse.
        flags = [float(grads[i] is not None) for i in idx]
        flags += [float(grads[i] is not None and grads[i].is_sparse) for i in idx] if has_sparse else [0.0] * len(idx)
        had = torch.tensor(flags, device=device)
        travel = [i for i in idx if i not in known] if known else idx  # (sparse ones travel apart)
        if has_sparse:  # a sparse gradient not known yet sends zeros here, and its values below
            sent = [torch.zeros_like(params[i]) if grads[i] is None or grads[i].is_sparse else grads[i] for i in travel]
        else:
            sent = [grads[i] if grads[i] is not None else torch.zeros_like(params[i]) for i in travel]
        sent.append(had)
        layout = state.buffers(sent, ("workers", trained, known), self._workers.bytes_per_pack)
        inputs, outputs, results = layout.stage(sent, like=[params[i] for i in travel] + [had])
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
        counts = results[-1].tolist()
        present, sparse = counts[:len(idx)], counts[len(idx):]
        out = list(grads)
        if not known and not any(sparse):
            for j, (i, count) in enumerate(zip(idx, present)):
                out[i] = results[j] if count > 0 else None
            return out
        return self._sparse_over_workers(ctx, state, params, grads, idx, travel, results, present, sparse, out)

    def _sparse_over_workers(self, ctx: ReplicaContext, state: _ReplicaState, params: Sequence[Tensor],
                             grads: list[Tensor | None], idx: list[int], travel: list[int], results: list[Tensor],
                             present: list[float], sparse: list[float], out: list[Tensor | None]
                             ) -> list[Tensor | None]:
        """The step's sums where some parameter has (or had) sparse gradients. One seen sparse for the
        first time learns it (every replica of every worker alike: they read the same counts) and its
        sparse gradients are summed now, apart, its dense ones having travelled with the rest; from then
        on all of its gradients travel apart, as sparse ones unless one is dense."""
        at = {i: j for j, i in enumerate(idx)}
        new = {i for i, n in zip(idx, sparse) if n > 0 and i not in state.sparse}
        slots = dict(zip(travel, results))
        for i in travel:
            if i not in new:
                out[i] = slots[i] if present[at[i]] > 0 else None
        columns = [i for i in idx if (i in state.sparse or i in new) and present[at[i]] > 0]
        for i in idx:
            if i in state.sparse and present[at[i]] == 0:
                out[i] = None
        if new:
            state.sparse = state.sparse | new
        mine, dense = [], []
        for i in columns:
            g = grads[i]
            if i in new:  # its dense gradients (if any) were summed in its slot
                mine.append(g if g is not None and g.is_sparse else None)
                dense.append(False)
            else:
                mine.append(g)
                dense.append(present[at[i]] > sparse[at[i]])
        totals = self._sparse_across_workers(ctx, mine, [params[i] for i in columns], dense)
        for i, total in zip(columns, totals):
            if i in new and present[at[i]] > sparse[at[i]]:  # dense ones too: the sum is dense
                out[i] = slots[i].add_(total.to_dense())
            else:
                out[i] = total
        return out

    def _sparse_across_workers(self, ctx: ReplicaContext, mine: list[Tensor | None], like: list[Tensor],
                               dense: list[bool]) -> list[Tensor]:
        """sum_over_workers of _sparse.py, after the local replicas' sum where this worker holds several:
        the last of them to arrive crosses the workers for all (as HierarchicalAllReduce does)."""
        if not mine:
            return []
        if self._threads is None:
            return _sparse.sum_over_workers(self._workers, mine, like, dense, _WHAT_SPARSE)
        devices, workers = self._devices, self._workers

        def combine(everyone: list[list[Tensor | None]]) -> list[list[Tensor]]:
            local = []
            for c, is_dense in enumerate(dense):
                parts = [e[c] for e in everyone if e[c] is not None]
                if is_dense:
                    total = _sparse.dense_of(None, like[c])
                    for part in parts:
                        total += part.to(total.device)
                    local.append(total)
                else:
                    local.append(_sparse.local_sum(parts, devices[0]) if parts else None)
            return _per_replica(_sparse.sum_over_workers(workers, local, like, dense, _WHAT_SPARSE), devices)

        return ctx._step.exchange(ctx._replica_id, mine, _WHAT_SPARSE, combine)[ctx._replica_id]


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


def _union_of(masks: Sequence[tuple]) -> tuple:
    """Which gradients at least one replica has (masks of equal length), and of what kind: dense where
    some replica's is dense, sparse where every replica that has one has a sparse one."""
    return tuple(map(_union_entry, zip(*masks)))


def _union_entry(kinds: tuple) -> bool | str:
    return True if True in kinds else _SPARSE if _SPARSE in kinds else False


def _mask_of(grads: Sequence[Tensor | None]) -> tuple[tuple, bool]:
    """Which gradients this replica has (True: a dense one, _SPARSE, False: None), and whether any is sparse."""
    if any(map(_IS_SPARSE, filter(_PRESENT, grads))):
        return tuple(False if g is None else _SPARSE if g.is_sparse else True for g in grads), True
    return tuple([g is not None for g in grads]), False


def _dense_part(params: Sequence[Tensor], grads: Sequence[Tensor | None], union: tuple) -> list[Tensor | None]:
    """What travels in the buckets for `union`: each gradient the union says is dense (zeros where this
    replica has none, densified where its own is sparse), None elsewhere (sparse ones travel apart)."""
    return [(torch.zeros_like(p) if g is None else g.to_dense() if g.is_sparse else g) if kind is True else None
            for p, g, kind in zip(params, grads, union)]


def _per_replica(totals: list[Tensor | None], devices: Sequence[torch.device]) -> list[list[Tensor | None]]:
    """Each replica's own copy of `totals`, on its device (the first replica takes them as they are)."""
    return [totals] + [[None if t is None else t.to(d, copy=True) for t in totals] for d in devices[1:]]


def _dense(t: Tensor) -> bool:
    """Whether t can be scaled in place: no element shares memory with another (an expanded gradient does)."""
    return t.is_contiguous() or t.is_contiguous(memory_format=torch.channels_last)


def _scaled(grads: list[Tensor | None], weight: float | Tensor) -> list[Tensor | None]:
    """Each gradient times `weight`, in place where it can be. A tensor weight of 0 gives zeros even
    where the gradient is NaN (a loss averaged over nothing), without reading the weight on the host."""
    first = next(filter(_PRESENT, grads), None)
    if first is None:
        return grads
    if isinstance(weight, Tensor):
        weight = weight.detach().to(first.device, non_blocking=True).reshape(())
    else:
        weight = float(weight)
    out, in_place = list(grads), []
    for k, g in enumerate(grads):
        if g is None:
            continue
        if not g.is_sparse and _dense(g):
            in_place.append(g)
        else:  # a sparse gradient stays sparse; an expanded one (its elements share memory) gets its own
            out[k] = g * weight
    if in_place:
        torch._foreach_mul_(in_place, weight)
    if isinstance(weight, Tensor):
        mute = weight == 0
        for g in filter(_PRESENT, out):
            (g._values() if g.is_sparse else g).masked_fill_(mute, 0)
    return out


def check_weight(weight: Any, where: str) -> None:
    """Refuses what cannot be a replica's gradient weight, naming it; a tensor's value is not read
    (that would sync its device), only its size and dtype."""
    if isinstance(weight, Tensor):
        if weight.numel() != 1 or weight.dtype == torch.bool or weight.is_complex():
            raise ValueError(f"{where}: a tensor weight must hold one real number (a count, or a sum of example "
                             f"weights); got shape {tuple(weight.shape)}, dtype {weight.dtype}.")
        return
    if isinstance(weight, bool) or not isinstance(weight, numbers.Real):
        raise TypeError(f"{where}: weight={weight!r} must be a number or a one-element tensor, such as the count "
                        "of labels this replica's loss averaged over.")
    if not math.isfinite(weight) or weight < 0:
        raise ValueError(f"{where}: weight={weight!r} must be finite and >= 0 (0: this replica's gradients do not "
                         "count).")
