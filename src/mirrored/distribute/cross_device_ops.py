"""Cross-device ops: turn one tensor per replica into the reduced tensor on every replica.

`ReductionToOneDevice` sums on one device and copies back; `HierarchicalCopyAllReduce` sums in a
tree over device pairs; `NcclAllReduce` calls NCCL across GPUs; `InMemoryAllReduce`, the default for
CPU replicas, sums straight into the replicas' output buffers on all cores, allocating nothing.
The public `reduce` and `batch_reduce` (cross-replica context, on PerReplica values) validate once
and call `_all_sum`; `all_reduce` is what replica threads call from inside a step, and it writes
the results through `_reduce_into`. Each replica's tensors stay on its device: packed buffers,
what NCCL receives (one buffer per GPU) and the results. Uses devices.py, values.py, replicas.py
(Rendezvous) and buckets.py.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import torch
from torch import Tensor

from mirrored.distribute import buckets
from mirrored._cpus import usable_cores
from mirrored.distribute.devices import canonical, torch_device
from mirrored.distribute.replicas import Rendezvous
from mirrored.distribute.values import Device, DistributedValues, Mirrored, ReduceOp

_PARALLEL_NUMEL = 1 << 19  # from 2 MB of float32 the summing thread borrows the idle replicas' cores; below,
# starting the extra intra-op threads costs more than it saves (measured: 1 MB, 77 us on one thread, 88+ on two)


def as_reduce_op(op: ReduceOp | str, where: str) -> ReduceOp:
    if isinstance(op, ReduceOp):
        return op
    if isinstance(op, str) and op.upper() in ReduceOp.__members__:
        return ReduceOp[op.upper()]
    raise ValueError(f"{where}: unknown reduce op {op!r}. Use mr.ReduceOp.SUM or mr.ReduceOp.MEAN.")


def mean_of_sum(total: Tensor, n: int | Tensor, in_place: bool = True) -> Tensor:
    """MEAN from a SUM the caller owns: floats are divided (in place unless told not to: an autograd
    Function's output must not be); integers are true-divided into a new float64 tensor, as TF 2.21
    returns their mean over replicas (7 over 3 is 2.333..., not 2)."""
    if total.is_floating_point() or total.is_complex():
        return total.div_(n) if in_place else total / n
    return total.double().div_(n)


class CrossDeviceOps:
    """Base class: subclasses implement `_all_sum`, and may override `_reduce_into` (how one
    replica writes every replica's results inside a step) for speed."""

    def __init__(self, bytes_per_pack: int = 25 * 2**20):
        if not isinstance(bytes_per_pack, int) or bytes_per_pack <= 0:
            raise ValueError(f"{type(self).__name__}(bytes_per_pack={bytes_per_pack!r}): give a positive number of "
                             "bytes, e.g. 25 * 2**20 (25 MB, DDP's bucket_cap_mb default).")
        self.bytes_per_pack = bytes_per_pack

    def __repr__(self) -> str:
        return f"{type(self).__name__}(bytes_per_pack={self.bytes_per_pack})"

    # ---- what subclasses provide -----------------------------------------------------------------
    def _all_sum(self, per_replica: list[list[Tensor]]) -> list[list[Tensor]]:
        """Given each replica's list of tensors, returns each replica's list of sums, on its device.
        Results must be bitwise identical across replicas and must not alias each other."""
        raise NotImplementedError

    def check_devices(self, devices: Sequence[Device]) -> None:
        """Raises where these ops cannot serve `devices` (NCCL needs distinct GPUs)."""
        del devices

    # ---- cross-replica API (tf.distribute.CrossDeviceOps) ----------------------------------------
    def reduce(self, reduce_op: ReduceOp | str, per_replica_value: Any, destinations: Any = None) -> Any:
        """Reduces a PerReplica tensor; returns a Mirrored on the destination devices."""
        return self.batch_reduce(reduce_op, [(per_replica_value, destinations)])[0]

    def batch_reduce(self, reduce_op: ReduceOp | str, value_destination_pairs: Sequence[tuple[Any, Any]]) -> list[Any]:
        """Reduces many PerReplica tensors at once, packed into buckets of `bytes_per_pack`."""
        op = as_reduce_op(reduce_op, f"{type(self).__name__}.batch_reduce")
        values = [self._components(v) for v, _ in value_destination_pairs]
        n = len(values[0]) if values else 0
        if any(len(v) != n for v in values):
            raise ValueError(f"{type(self).__name__}.batch_reduce: values have different numbers of replicas: "
                             f"{[len(v) for v in values]}.")
        per_replica = [[v[r] for v in values] for r in range(n)]
        shapes = [shapes_of(lst) for lst in per_replica]  # as TF refuses: packing would mix the leftovers in
        if any(sh != shapes[0] for sh in shapes[1:]):
            raise ValueError(shape_mismatch(f"{type(self).__name__}.batch_reduce", shapes))
        summed = self._sum_packed(per_replica) if n > 1 else [[t.clone() for t in per_replica[0]]]
        out = []
        for j, (_, dest) in enumerate(value_destination_pairs):
            # One value: nothing is reduced, and TF keeps its dtype (an integer stays one).
            reduced = [mean_of_sum(summed[r][j], n) if op is ReduceOp.MEAN and n > 1 else summed[r][j]
                       for r in range(n)]
            out.append(self._to_destinations(reduced, dest))
        return out

    def broadcast(self, tensor: Tensor, destinations: Any) -> Mirrored:
        """A copy of `tensor` on every destination device."""
        devices = self._destination_devices(destinations) or [str(tensor.device)]
        return Mirrored([tensor.to(torch_device(d), copy=True) for d in devices])

    @staticmethod
    def _components(value: Any) -> list[Tensor]:
        if isinstance(value, DistributedValues):
            return [torch.as_tensor(v) for v in value.values]
        if hasattr(value, "values") and isinstance(getattr(value, "values"), tuple):  # a distributed variable
            return list(value.values)
        return [torch.as_tensor(value)]

    def _destination_devices(self, destinations: Any) -> list[Device] | None:
        if destinations is None:
            return None
        if isinstance(destinations, str):
            return [canonical(destinations, where=f"{type(self).__name__}: destinations")]
        if isinstance(destinations, DistributedValues) or hasattr(destinations, "values"):
            return [canonical(str(v.device)) for v in destinations.values]
        return [canonical(str(d)) for d in destinations]

    def _to_destinations(self, reduced: list[Tensor], destinations: Any) -> Any:
        devices = self._destination_devices(destinations)
        if devices is None:
            return Mirrored(reduced)
        return Mirrored([reduced[min(i, len(reduced) - 1)].to(torch_device(d)) for i, d in enumerate(devices)])

    def _sum_packed(self, per_replica: list[list[Tensor]]) -> list[list[Tensor]]:
        """`_all_sum` over buckets instead of tensor by tensor. Each replica packs into buffers on its
        own device, so each gets its results there (and NCCL gets one buffer per GPU); a bucket
        holds tensors that lie on one device in every replica."""
        devices = [tuple(lst[j].device for lst in per_replica) for j in range(len(per_replica[0]))]
        plan = buckets.plan(per_replica[0], self.bytes_per_pack, groups=devices)
        flats = [[b.pack(tensors) for b in plan] for tensors in per_replica]
        summed_flats = self._all_sum(flats)
        out: list[list[Tensor | None]] = []
        for r, tensors in enumerate(per_replica):
            result: list[Tensor | None] = [None] * len(tensors)
            for b, flat in zip(plan, summed_flats[r]):
                b.unpack(flat, result)
            out.append(result)  # type: ignore[arg-type]
        return out  # type: ignore[return-value]

    # ---- replica context: called by every replica thread with its own tensors -------------------
    def all_reduce(self, rendezvous: Rendezvous, replica_id: int, reduce_op: ReduceOp,
                   inputs: list[Tensor], outputs: list[Tensor] | None = None,
                   agree: Any = None, agreed: Callable[[list[Any]], bool] | None = None,
                   what: str = "all_reduce") -> list[Tensor] | Disagreement:
        """Every replica passes its flat tensors (same sizes everywhere); the reduced values land in
        `outputs` (in `inputs` when None) on each replica's device, and `outputs` is returned.

        One meeting of the replicas does it all: the last to arrive reduces for everyone and writes
        every replica's outputs, so once a replica is released nobody touches its tensors again (it
        may modify its results in place at once). `agree` is a value every replica must pass alike
        (a gradient mask, say): where they differ nothing is reduced and every replica gets the same
        `Disagreement`, so a caller can fix its inputs and call again; `agreed(tokens)` replaces
        "all equal" as the test where given. `what` names the call in
        errors; replicas that make different calls get a CollectiveMismatchError naming both."""
        outputs = inputs if outputs is None else outputs

        def combine(everyone: list[tuple[list[Tensor], list[Tensor], Any]]) -> Disagreement | None:
            tokens = [e[2] for e in everyone]
            if not (agreed(tokens) if agreed is not None else all(t == tokens[0] for t in tokens[1:])):
                return Disagreement(tokens)
            check_same_shapes([e[0] for e in everyone])
            self._reduce_into([e[0] for e in everyone], [e[1] for e in everyone], reduce_op)
            return None

        disagreement = rendezvous.exchange(replica_id, (inputs, outputs, agree), what, combine)
        return outputs if disagreement is None else disagreement

    def _reduce_into(self, inputs: list[list[Tensor]], outputs: list[list[Tensor]], reduce_op: ReduceOp) -> None:
        """Writes the reduction of every replica's `inputs` into every replica's `outputs`."""
        n = len(inputs)
        for summed, outs in zip(self._all_sum(inputs), outputs):
            for out, t in zip(outs, summed):
                out.copy_(t.div_(n) if reduce_op is ReduceOp.MEAN else t)  # floats only: see _sum_into


class Disagreement(NamedTuple):
    """What `all_reduce(..., agree=...)` returns when the replicas passed different `agree` values."""

    tokens: list[Any]  # every replica's value, in replica order


class ReductionToOneDevice(CrossDeviceOps):
    """Sums every replica's tensor on one device, then copies the sum to each replica."""

    def __init__(self, reduce_to_device: str | None = None, bytes_per_pack: int = 25 * 2**20):
        super().__init__(bytes_per_pack)
        self.reduce_to_device = None if reduce_to_device is None else canonical(
            reduce_to_device, where="ReductionToOneDevice(reduce_to_device=...)")

    def _all_sum(self, per_replica: list[list[Tensor]]) -> list[list[Tensor]]:
        target = torch_device(self.reduce_to_device) if self.reduce_to_device else None
        return _sum_on_one_device(per_replica, target)


def _sum_on_one_device(per_replica: list[list[Tensor]], target: torch.device | None) -> list[list[Tensor]]:
    """Sums each column on `target` (replica 0's device when None) and gives every replica a copy."""
    sums = []
    for column in zip(*per_replica):
        acc = column[0].to(target or column[0].device, copy=True)
        for t in column[1:]:
            acc.add_(t.to(acc.device))
        sums.append(acc)
    return [[s.to(lst[j].device, copy=True) for j, s in enumerate(sums)] for lst in per_replica]


class HierarchicalCopyAllReduce(CrossDeviceOps):
    """Sums in a binary tree over replica pairs (each sum on the lower replica's device), then
    copies the total back down the tree, as TF's hierarchical copy does for GPUs without NCCL."""

    def __init__(self, num_packs: int = 1, bytes_per_pack: int = 25 * 2**20):
        super().__init__(bytes_per_pack)
        if not isinstance(num_packs, int) or num_packs < 0:
            raise ValueError(f"HierarchicalCopyAllReduce(num_packs={num_packs!r}): give a non-negative integer.")
        self.num_packs = num_packs

    def _all_sum(self, per_replica: list[list[Tensor]]) -> list[list[Tensor]]:
        n = len(per_replica)
        partial = [[t.clone() for t in per_replica[0]]] + [list(lst) for lst in per_replica[1:]]
        owned = {0}  # replicas whose partial sums are our copies; the others are still the callers' inputs
        stride = 1
        while stride < n:
            for r in range(0, n - stride, 2 * stride):
                if r not in owned:
                    partial[r] = [t.clone() for t in partial[r]]
                    owned.add(r)
                dst = partial[r]
                for j, t in enumerate(partial[r + stride]):
                    dst[j].add_(t.to(dst[j].device))
            stride *= 2
        total = partial[0]
        return [total] + [[t.to(lst[j].device, copy=True) for j, t in enumerate(total)] for lst in per_replica[1:]]


class NcclAllReduce(CrossDeviceOps):
    """All-reduce across GPUs with NCCL (torch.cuda.nccl), one call per bucket.

    NCCL takes one CUDA tensor per distinct GPU. Where a reduction's tensors are not that (a
    PerReplica of CPU values given to strategy.reduce, a dtype NCCL lacks) it sums them as
    HierarchicalCopyAllReduce does instead, so every result still lands on its replica's device."""

    def __init__(self, num_packs: int = 1, bytes_per_pack: int = 25 * 2**20):
        super().__init__(bytes_per_pack)
        self.num_packs = num_packs

    def check_devices(self, devices: Sequence[Device]) -> None:
        """Raises ValueError unless every device is a CUDA GPU and this torch build has NCCL for them, so
        a bad choice fails when the strategy is built, not at the first all-reduce."""
        if not torch.cuda.is_available():
            raise ValueError(f"NcclAllReduce needs CUDA GPUs, but torch sees none (devices={list(devices)}). "
                             "Omit cross_device_ops= to use the CPU default, or run on a GPU machine.")
        if not all(d.startswith("cuda") for d in devices):
            raise ValueError(f"NcclAllReduce reduces across GPUs only; devices={list(devices)} includes others. "
                             "Use only cuda:N devices, or HierarchicalCopyAllReduce / ReductionToOneDevice.")
        import torch.cuda.nccl as nccl

        probe = [torch.zeros(1, device=d) for d in devices]
        if not nccl.is_available(probe):
            raise ValueError("NcclAllReduce: this torch build has no NCCL support for these tensors. "
                             "Use HierarchicalCopyAllReduce() instead.")

    def _all_sum(self, per_replica: list[list[Tensor]]) -> list[list[Tensor]]:
        out = [[t.clone() for t in lst] for lst in per_replica]
        self._nccl_sum(out, out)
        return out

    def _reduce_into(self, inputs: list[list[Tensor]], outputs: list[list[Tensor]], reduce_op: ReduceOp) -> None:
        # NCCL writes each replica's output on its own GPU: no copies (in place where, as for
        # gradients, the outputs are the inputs).
        self._nccl_sum(inputs, outputs)
        if reduce_op is ReduceOp.MEAN:  # floats only: the strategy sums integers and divides into float64
            n = len(inputs)
            for outs in outputs:
                for out in outs:
                    out.div_(n)

    @staticmethod
    def _nccl_sum(inputs: list[list[Tensor]], outputs: list[list[Tensor]]) -> None:
        """outputs[r][j] = sum over r of inputs[r][j]; NCCL where column j suits it, else a tree."""
        import torch.cuda.nccl as nccl

        for j, column in enumerate(zip(*inputs)):
            outs = [lst[j] for lst in outputs]
            if nccl_can_reduce(column):
                nccl.all_reduce(list(column), outs)
            else:
                sums = HierarchicalCopyAllReduce()._all_sum([[t] for t in column])
                for out, total in zip(outs, sums):
                    out.copy_(total[0])


_NCCL_DTYPES = frozenset({torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int32, torch.int64,
                          torch.int8, torch.uint8})


def nccl_can_reduce(column: Sequence[Tensor]) -> bool:
    """Whether torch.cuda.nccl.all_reduce takes these tensors: one dense contiguous CUDA tensor per
    distinct GPU, of one dtype NCCL sums."""
    devices = [t.device for t in column]
    return (all(d.type == "cuda" for d in devices) and len(set(devices)) == len(devices)
            and all(t.dtype == column[0].dtype and t.dtype in _NCCL_DTYPES and t.is_contiguous()
                    and t.layout == torch.strided for t in column))


class InMemoryAllReduce(CrossDeviceOps):
    """The CPU default: the last replica to reach the all-reduce sums for everyone, on all cores.

    The other replica threads are idle while they wait, so the summing thread borrows their cores
    for its intra-op threads: it adds every replica's input into replica 0's output (reading large
    gradients where backward left them, without packing them first) and copies that one sum into
    the others' outputs. The memory traffic is that of a reduce-scatter/all-gather between the
    threads, but the replicas meet once per all-reduce instead of three times, which is what
    small gradient sets pay for; every replica gets the same bits, and nothing is allocated.
    Made for CPU replicas: across GPUs use NcclAllReduce (here one thread would issue every
    replica's copies on its own CUDA stream, unordered with streams the replicas made)."""

    def __init__(self, bytes_per_pack: int = 25 * 2**20):
        super().__init__(bytes_per_pack)
        self._cores = usable_cores()  # asked once: the summing thread borrows this many

    def _all_sum(self, per_replica: list[list[Tensor]]) -> list[list[Tensor]]:
        return _sum_on_one_device(per_replica, None)

    def _reduce_into(self, inputs: list[list[Tensor]], outputs: list[list[Tensor]], reduce_op: ReduceOp) -> None:
        if not outputs[0]:  # nothing to reduce (no gradients this step): foreach ops refuse empty lists
            return
        threads = torch.get_num_threads()
        borrow = self._cores > threads and sum(t.numel() for t in outputs[0]) >= _PARALLEL_NUMEL
        if borrow:
            torch.set_num_threads(self._cores)
        try:
            _sum_into(inputs, outputs[0], reduce_op)
            for outs in outputs[1:]:  # after every input was read: an output may be its own input
                torch._foreach_copy_(outs, outputs[0])  # one call for all tensors: Python costs ~5 us each
        finally:
            if borrow:
                torch.set_num_threads(threads)


def _sum_into(inputs: list[list[Tensor]], totals: list[Tensor], reduce_op: ReduceOp) -> None:
    """totals[j] = the reduction of every replica's inputs[r][j] (each replica's tensors on one
    device, moved to the totals'); a total may be replica 0's input itself (reduced in place).
    `totals` is not empty."""
    n = len(inputs)
    device = totals[0].device
    inputs = [lst if lst[0].device == device else [t.to(device) for t in lst] for lst in inputs]
    if n > 1 and inputs[0] is totals:  # in place, as gradients are: whole lists at once
        torch._foreach_add_(totals, inputs[1])
    else:
        for j, total in enumerate(totals):
            if n == 1:
                total.copy_(inputs[0][j])
            else:
                torch.add(inputs[0][j], inputs[1][j], out=total)  # total may be inputs[0][j]: in place is fine
    for lst in inputs[2:]:
        torch._foreach_add_(totals, lst)
    if reduce_op is ReduceOp.MEAN:  # floats only: the strategy sums integers and divides into float64
        for total in totals:
            total.div_(n)


def shape_mismatch(where: str, tokens: Sequence[Sequence[tuple[tuple[int, ...], torch.dtype]]]) -> str:
    """The error for replicas that passed differently shaped values to one reduction: the first
    replica and leaf that differ from replica 0's."""
    first = tokens[0]
    for r, token in enumerate(tokens[1:], start=1):
        if len(token) != len(first):
            return (f"{where}: replica {r} passed {len(token)} tensors but replica 0 passed {len(first)}. Every "
                    "replica must pass the same structure.")
        for i, (mine, theirs) in enumerate(zip(token, first)):
            if mine != theirs:
                return (f"{where}: tensor {i} has shape {list(mine[0])} ({mine[1]}) on replica {r} but "
                        f"{list(theirs[0])} ({theirs[1]}) on replica 0. Every replica must pass tensors of the "
                        "same shapes and dtypes (reduce per-example values to a fixed shape first, e.g. sum "
                        "them, or reduce along an axis).")
    return f"{where}: the replicas passed different tensors (internal error: no difference found)."


def shapes_of(tensors: Sequence[Tensor]) -> tuple[tuple[tuple[int, ...], torch.dtype], ...]:
    """What replicas must agree on before their tensors are reduced together: each one's shape and dtype."""
    return tuple((tuple(t.shape), t.dtype) for t in tensors)


def check_same_shapes(everyone: list[list[Tensor]]) -> None:
    """Raises (in every replica alike) when replicas passed different tensors to one all_reduce."""
    first = [(f.numel(), f.dtype) for f in everyone[0]]
    for r, flats in enumerate(everyone[1:], start=1):
        if [(f.numel(), f.dtype) for f in flats] != first:
            raise ValueError(
                f"all_reduce: replica {r} passed tensors of sizes/dtypes {[(f.numel(), f.dtype) for f in flats]} "
                f"but replica 0 passed {first}. Every replica must all-reduce tensors of the same shapes "
                "(reduce per-example values to a fixed shape first, e.g. sum them).")


def default_for(devices: Sequence[Device]) -> CrossDeviceOps:
    """TF's choice per device set: NCCL across GPUs when available, else hierarchical copy; CPUs in memory."""
    if all(d.startswith("cpu") for d in devices):
        return InMemoryAllReduce()
    if all(d.startswith("cuda") for d in devices) and len(devices) > 1:
        try:
            NcclAllReduce().check_devices(devices)
            return NcclAllReduce()
        except ValueError:
            return HierarchicalCopyAllReduce()
    return ReductionToOneDevice()
