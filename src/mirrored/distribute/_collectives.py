"""CollectiveAllReduce: the cross-device op of MultiWorkerMirroredStrategy, over torch.distributed.

One collective per bucket of `bytes_per_pack` on the default process group: the gradient
all-reduce of a mirrored optimizer, ReplicaContext.all_reduce, and the cross-replica reduce,
gather and in-sync check. Small exchanged values (sizes, checksums) travel on the worker's "wire"
device, and a tensor on a device the group has no backend for goes through a copy there and back.
A collective that fails or times out raises an error naming this rank, the op and, when the
rendezvous store can tell, the ranks that did not arrive. multi_worker.py builds it and re-exports
it (mr.CollectiveAllReduce), and creates its process group with `init_default_group`, which also
destroys that group at exit (see there). HierarchicalAllReduce puts it behind the local ops of a worker
that holds several replicas (threads): local sum first, then one collective per bucket across workers.
Uses cross_device_ops.py, buckets.py, replicas.py (its errors),
values.py and torch.distributed.
"""
from __future__ import annotations

import atexit
import datetime
import hashlib
import logging
import time
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from mirrored.distribute import buckets, cluster_resolver
from mirrored.distribute.cross_device_ops import (CrossDeviceOps, Disagreement, as_reduce_op, check_same_shapes,
                                                mean_of_sum)
from mirrored.distribute.replicas import CollectiveTimeoutError
from mirrored.distribute.values import Mirrored, ReduceOp

logger = logging.getLogger(__name__)

_DEFAULT_BYTES_PER_PACK = 25 * 2**20  # DDP's bucket_cap_mb default
_PROBE_S = 2.0  # after a collective fails, how long to wait for the other ranks to report theirs
# An NCCL group's watchdog aborts the whole process when a collective outlives the group's timeout;
# ours waits timeout_s and raises an error naming the rank, so the watchdog is given this much longer.
_WATCHDOG_GRACE_S = 60.0
_MAX_DIMS = 8  # gather exchanges shapes in a fixed-size header (a collective needs equal sizes)
_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.int16,
           torch.int8, torch.uint8, torch.bool, torch.complex64, torch.complex128)  # numbered in headers


_failed = False  # a collective of this process failed: its work may still be pending in the group


def init_default_group(backend: str, **kwargs: Any) -> None:
    """dist.init_process_group for a group the strategy creates (so owns), destroyed at interpreter
    exit unless the script did so: torn down later, in C++ during finalization, gloo can abort the
    process ("terminate called without an active exception", exit -6)."""
    # torch.distributed.nn.functional binds `group=group.WORLD` defaults when first imported. Imported
    # after the group exists (the first torch optimizer imports it, through torch._dynamo), those
    # defaults keep the group alive: destroy_process_group() then frees nothing, and the group's
    # threads run on into interpreter finalization. Imported before, they bind None.
    import torch.distributed.nn.functional  # noqa: F401
    dist.init_process_group(backend, **kwargs)
    group = dist.group.WORLD
    if group is not None:
        atexit.register(_destroy_at_exit, weakref.ref(group))


def _destroy_at_exit(group: weakref.ref) -> None:
    """Destroys the default group if it is still the one init_default_group made, while the
    interpreter is whole. Not after a failed collective: its pending work would block the exit."""
    if not dist.is_initialized() or group() is None or dist.group.WORLD is not group():
        return  # the script destroyed it (and perhaps made another, which is its own)
    if _failed:
        logger.debug("a collective failed: the process group is left to process exit")
        return
    try:
        dist.destroy_process_group()
    except Exception as e:  # noqa: BLE001 - at exit, a failed cleanup must not hide the script's outcome
        logger.debug("destroying the process group at exit failed: %s", e)


def _device_types_of(backend: str) -> frozenset[str]:
    """The device types a process group of `backend` takes tensors on: "nccl" CUDA only, "gloo" the
    CPU (its CUDA support is partial), "cpu:gloo,cuda:nccl" each type it names."""
    if ":" in backend:
        return frozenset(part.split(":")[0].strip() for part in backend.split(","))
    return frozenset({"cuda"} if backend == "nccl" else {"cpu"} if backend == "gloo" else {"cpu", "cuda"})


def _digest(data: bytes) -> int:
    """A 56-bit checksum: equal on every rank for equal bytes (Python's hash() is salted per process),
    and small enough that -digest fits int64 too."""
    return int.from_bytes(hashlib.blake2b(data, digest_size=7).digest(), "little")


def _shape_digest(tensors: Sequence[Tensor]) -> int:
    return _digest(repr([(tuple(t.shape), str(t.dtype)) for t in tensors]).encode())


def _value_digest(t: Tensor) -> int:
    """The checksum of a tensor's bytes; a sparse COO one's, of its coalesced indices and values."""
    if t.is_sparse:
        t = t.detach().coalesce()
        return _digest(b"".join(_bytes(part) for part in (t.indices(), t.values())))
    return _digest(_bytes(t))


def _bytes(t: Tensor) -> bytes:
    return t.detach().contiguous().reshape(-1).cpu().view(torch.uint8).numpy().tobytes()


def _dtype_code(dtype: torch.dtype) -> int:
    return _DTYPES.index(dtype) if dtype in _DTYPES else len(_DTYPES)


class CollectiveAllReduce(CrossDeviceOps):
    """Collectives across worker processes with torch.distributed's default process group, one call
    per bucket of `bytes_per_pack` (TF's CollectiveAllReduce). MultiWorkerMirroredStrategy builds it;
    every worker must make the same calls, in the same order."""

    def __init__(self, rank: int, world_size: int, wire_device: torch.device, timeout_s: float,
                 bytes_per_pack: int = _DEFAULT_BYTES_PER_PACK, store: tuple[str, int] | None = None,
                 backend: str = "gloo", attempt: int = 0, agent_store: bool | None = None):
        super().__init__(bytes_per_pack)
        self.rank = rank
        self.attempt = attempt  # torchrun's restart count: a restarted job's errors say which attempt failed
        self._agent_store = agent_store  # whether `store` is torchrun's agent's (None: as the environment says)
        self.world_size = world_size
        self._wire = wire_device  # where small exchanged tensors (sizes, checksums) live: NCCL needs the GPU
        self._timeout_s = timeout_s
        self._store = store  # (MASTER_ADDR, MASTER_PORT): asked which ranks arrived, after a failure
        self._calls = 0
        # Whether the group takes CPU tensors as they are (gloo does; an NCCL-only group does not).
        self._takes_cpu = "cpu" in _device_types_of(backend)
        # NCCL's wait() only orders streams: a host that then reads a result whose collective never
        # completes hangs until the watchdog kills the process, and no error of ours is raised. A wait
        # with a timeout blocks the host and raises in this thread instead (the group's own watchdog
        # timeout is set longer, see _WATCHDOG_GRACE_S).
        self._wait_timeout = datetime.timedelta(seconds=timeout_s) if "nccl" in backend else None

    def __repr__(self) -> str:
        return (f"CollectiveAllReduce(rank={self.rank}, world_size={self.world_size}, "
                f"bytes_per_pack={self.bytes_per_pack})")

    # ---- the collectives ------------------------------------------------------------------------
    def _carried(self, t: Tensor) -> bool:
        """Whether the process group takes `t` where it lies; else it travels through a copy on the
        wire device (a CPU count on an NCCL-only group; a GPU tensor on gloo, whose CUDA support is
        partial, or on another GPU than the one NCCL is bound to)."""
        return t.device == self._wire or (t.device.type == "cpu" and self._takes_cpu)

    def _on_wire(self, t: Tensor) -> Tensor:
        return t if self._carried(t) else t.to(self._wire)

    def all_sum_(self, flats: Sequence[Tensor], what: str) -> None:
        """Sums each flat buffer over the workers, in place (every bucket in flight at once)."""
        sent = [self._on_wire(f) for f in flats]
        self._call(what, lambda: [dist.all_reduce(f, async_op=True) for f in sent])
        for f, wire in zip(flats, sent):
            if wire is not f:
                f.copy_(wire)

    def all_reduce(self, reduce_op: ReduceOp, tensors: Sequence[Tensor], what: str,
                   check_shapes: bool = True) -> list[Tensor]:
        """New tensors holding SUM / MEAN over the workers of `tensors`. check_shapes costs a round trip
        and turns different shapes on different ranks into a ValueError instead of an abort or a hang."""
        if check_shapes:
            self._check_same_shapes(tensors, what)
        plan = buckets.plan(tensors, self.bytes_per_pack)
        flats = [b.pack(tensors) for b in plan]
        self.all_sum_(flats, what)
        out: list[Tensor | None] = [None] * len(tensors)
        for b, flat in zip(plan, flats):
            b.unpack(mean_of_sum(flat, self.world_size) if reduce_op is ReduceOp.MEAN else flat, out)
        return out  # type: ignore[return-value]

    def all_gather_row(self, row: Sequence[int | float], what: str, dtype: torch.dtype = torch.int64) -> list[list]:
        """Every rank's `row` (the same length everywhere), in rank order."""
        mine = torch.tensor(list(row), dtype=dtype, device=self._wire)
        rows = [torch.empty_like(mine) for _ in range(self.world_size)]
        self._call(what, lambda: [dist.all_gather(rows, mine, async_op=True)])
        return [r.tolist() for r in rows]

    def all_gather_flat(self, flats: Sequence[Tensor], what: str) -> list[list[Tensor]]:
        """Every rank's copy of each 1-D tensor (of one size on every rank: pad first), in rank order, on
        the tensor's device; every gather in flight at once."""
        wires = [self._on_wire(f) for f in flats]
        gathered = [[torch.empty_like(w) for _ in range(self.world_size)] for w in wires]
        self._call(what, lambda: [dist.all_gather(g, w, async_op=True) for g, w in zip(gathered, wires)])
        return [[t if t.device == f.device else t.to(f.device) for t in g] for g, f in zip(gathered, flats)]

    def gather(self, t: Tensor, axis: int, what: str) -> Tensor:
        """The workers' tensors concatenated along `axis`; their sizes along it may differ (each part is
        padded to the longest for the all_gather, then trimmed)."""
        if t.dim() > _MAX_DIMS:
            raise ValueError(f"{what}: tensors of rank {t.dim()} > {_MAX_DIMS} are not supported across workers.")
        if not -t.dim() <= axis < t.dim():
            raise ValueError(f"{what}: axis={axis} is out of range for a tensor of shape {tuple(t.shape)}.")
        axis %= t.dim()
        header = [t.dim(), _dtype_code(t.dtype), *t.shape, *[-1] * (_MAX_DIMS - t.dim())]
        rows = self.all_gather_row(header, f"{what} (sizes)")
        masked = [row[:2 + axis] + row[3 + axis:] for row in rows]
        differ = [r for r in range(self.world_size) if masked[r] != masked[0]]
        if differ:
            shapes = "; ".join(f"rank {r}: shape {tuple(row[2:2 + row[0]])}, dtype "
                               f"{_DTYPES[row[1]] if row[1] < len(_DTYPES) else 'other'}" for r, row in enumerate(rows))
            raise ValueError(f"{what}: the workers' values differ in more than the size along axis {axis} ({shapes}). "
                             "Only the gathered axis may differ; dtypes and other dimensions must match.")
        sizes = [row[2 + axis] for row in rows]
        wire = t.view(torch.uint8) if t.dtype == torch.bool else t
        if t.shape[axis] < max(sizes):
            pad_shape = list(t.shape)
            pad_shape[axis] = max(sizes) - t.shape[axis]
            wire = torch.cat([wire, wire.new_zeros(pad_shape)], dim=axis)
        wire = self._on_wire(wire.contiguous())
        parts = [torch.empty_like(wire) for _ in range(self.world_size)]
        self._call(what, lambda: [dist.all_gather(parts, wire, async_op=True)])
        out = torch.cat([p.narrow(axis, 0, n) for p, n in zip(parts, sizes)], dim=axis).to(t.device)
        return out.view(torch.bool) if t.dtype == torch.bool else out

    def broadcast_(self, tensors: Sequence[Tensor], what: str) -> None:
        """Overwrites `tensors` with rank 0's copies (bucketed; every rank passes the same shapes)."""
        with torch.no_grad():
            plan = buckets.plan(tensors, self.bytes_per_pack)
            flats = [b.pack(tensors) for b in plan]
            wires = [self._on_wire(f.view(torch.uint8) if f.dtype == torch.bool else f) for f in flats]
            self._call(what, lambda: [dist.broadcast(w, src=0, async_op=True) for w in wires])
            if self.rank == 0:
                return
            views: list[Tensor | None] = [None] * len(tensors)
            for b, flat, wire in zip(plan, flats, wires):
                b.unpack(flat if wire.device == flat.device else wire.to(flat.device).view(flat.dtype), views)
            for t, v in zip(tensors, views):
                t.copy_(v)

    def _check_same_shapes(self, tensors: Sequence[Tensor], what: str) -> None:
        """One small all-reduce (MAX of +digest and -digest equals them only where every rank agrees)."""
        digest = _shape_digest(tensors)
        mine = torch.tensor([digest, -digest], dtype=torch.int64, device=self._wire)
        self._call(f"{what} (shape check)", lambda: [dist.all_reduce(mine, op=dist.ReduceOp.MAX, async_op=True)])
        if mine.tolist() == [digest, -digest]:
            return
        rows = self.all_gather_row([len(tensors), sum(t.numel() for t in tensors)], f"{what} (shape report)")
        per_rank = "; ".join(f"rank {r}: {n} tensor(s), {numel} element(s)" for r, (n, numel) in enumerate(rows))
        raise ValueError(
            f"{what}: the workers passed tensors of different shapes or dtypes ({per_rank}; rank {self.rank} "
            f"passed {[tuple(t.shape) for t in tensors]}). Every replica must all-reduce tensors of the same "
            "shapes (reduce per-example values to a fixed shape first, e.g. sum them).")

    # ---- CrossDeviceOps API (cross-replica context) -----------------------------------------------
    def batch_reduce(self, reduce_op: ReduceOp | str, value_destination_pairs: Sequence[tuple[Any, Any]]) -> list[Any]:
        """Reduces each value over every replica of every worker; returns Mirrored values."""
        op = as_reduce_op(reduce_op, "CollectiveAllReduce.batch_reduce")
        local, replicas = [], None
        for value, _ in value_destination_pairs:
            parts = self._components(value)
            replicas = len(parts) if replicas is None else replicas
            local.append(sum(parts[1:], parts[0].clone()))
        reduced = self.all_reduce(ReduceOp.SUM, local, "batch_reduce") if self.world_size > 1 else local
        if op is ReduceOp.MEAN:
            reduced = [mean_of_sum(t, self.world_size * (replicas or 1)) for t in reduced]
        return [self._to_destinations([t], dest) for t, (_, dest) in zip(reduced, value_destination_pairs)]

    # ---- failures ---------------------------------------------------------------------------------
    def _call(self, what: str, issue: Callable[[], list[Any]]) -> None:
        """Issues collectives (`issue` returns their works) and waits for them; a failure or timeout
        becomes an error naming this rank, `what`, and the ranks that did not arrive."""
        self._calls += 1
        started = time.monotonic()
        try:
            for work in issue():
                if self._wait_timeout is None:
                    work.wait()
                else:
                    work.wait(timeout=self._wait_timeout)
        except RuntimeError as e:  # torch.distributed's errors (DistBackendError, gloo's) are RuntimeErrors
            global _failed
            _failed = True
            failure = self._failure(what, e, time.monotonic() - started)
            if failure is e:
                raise
            raise failure from e

    def _failure(self, what: str, error: RuntimeError, elapsed_s: float) -> BaseException:
        attempt = f" (restart attempt {self.attempt})" if self.attempt else ""
        where = f"rank {self.rank} of {self.world_size}{attempt}: {what} (collective #{self._calls} of this worker)"
        text = str(error).strip()
        lowered = text.lower()
        timed_out = "timed out" in lowered or "timeout" in lowered
        lost = any(s in lowered for s in ("connection closed", "connection reset", "broken pipe", "connection refused"))
        if not (timed_out or lost):
            error.args = (f"{where}: {text}",)
            return error
        if timed_out:
            cause = (f"timed out after {elapsed_s:.1f} s (timeout_s={self._timeout_s:g}; raise it if the other "
                     "workers are merely slow)")
        else:
            cause = f"failed after {elapsed_s:.1f} s: another worker's connection closed"
        first_line = text.splitlines()[0] if text else type(error).__name__
        return CollectiveTimeoutError(f"{where} {cause}. {self._who_is_missing(what)}torch.distributed: {first_line}")

    def _who_is_missing(self, what: str) -> str:
        """Asks the rendezvous store which ranks also reached a failed collective. A rank that never
        reports within _PROBE_S exited, crashed or hangs elsewhere. Best effort: '' when unknown."""
        if self._store is None or self.world_size < 2:
            return ""
        addr, port = self._store
        grace_s = min(_PROBE_S, self._timeout_s)
        # torchrun's agent store outlives restarts of the workers: keep each attempt's keys apart.
        prefix = f"mirrored/failed/{self.attempt}/"
        try:
            store = dist.TCPStore(addr, port, is_master=False, timeout=datetime.timedelta(seconds=grace_s))
            store.set(f"{prefix}{self.rank}", what)
            deadline = time.monotonic() + grace_s
            reported = {self.rank}
            while len(reported) < self.world_size and time.monotonic() < deadline:
                reported |= {r for r in range(self.world_size) if r not in reported and store.check([f"{prefix}{r}"])}
                time.sleep(0.05)
        except (RuntimeError, OSError):  # DistStoreError / DistNetworkError are RuntimeErrors
            return _store_gone(addr, port, self._agent_store)
        missing = [r for r in range(self.world_size) if r not in reported]
        if missing:
            return (f"Rank(s) {', '.join(map(str, missing))} did not reach a collective within {grace_s:g} s of this "
                    "failure: exited, crashed or stuck elsewhere (see their logs). ")
        return ("Every rank reached a failing collective, so they may have called different collectives (run with "
                "TORCH_DISTRIBUTED_DEBUG=DETAIL to compare them). ")


def _store_gone(addr: str, port: int, agent_store: bool | None = None) -> str:
    """What a survivor can tell when the rendezvous store no longer answers: its host is gone, and
    that host is rank 0 (torch.distributed's env:// rendezvous), or under torchrun the agent of rank
    0's machine, which outlives a crashed worker but not a lost machine."""
    if cluster_resolver.uses_agent_store() if agent_store is None else agent_store:
        return (f"Rank 0's machine is likely what is missing: the rendezvous store at {addr}:{port}, which "
                "torchrun's agent there hosts, does not answer (the machine or its torchrun exited, or the "
                "network to it failed). ")
    return (f"Rank 0 is likely the missing worker: it hosts the rendezvous store at {addr}:{port}, which does "
            "not answer (rank 0 exited or crashed; see its log). ")


class HierarchicalAllReduce(CrossDeviceOps):
    """Several replicas per worker: the local replicas (threads) sum with `local` (as
    MirroredStrategy's ops), then the local sum crosses the workers with `workers` (one collective
    per bucket, issued once per worker by the last replica to arrive), and every local replica gets
    the total. TF's MultiWorkerMirroredStrategy reduces the same way: within a worker, then across."""

    def __init__(self, local: CrossDeviceOps, workers: CollectiveAllReduce, local_replicas: int):
        super().__init__(workers.bytes_per_pack)
        self.local = local
        self.workers = workers
        self._replicas = local_replicas * workers.world_size  # every replica of every worker: MEAN divides by it

    def __repr__(self) -> str:
        return f"HierarchicalAllReduce(local={self.local!r}, workers={self.workers!r})"

    def check_devices(self, devices: Sequence[str]) -> None:
        self.local.check_devices(devices)

    def all_reduce(self, rendezvous: Any, replica_id: int, reduce_op: ReduceOp, inputs: list[Tensor],
                   outputs: list[Tensor] | None = None, agree: Any = None,
                   agreed: Callable[[list[Any]], bool] | None = None, what: str = "all_reduce",
                   check_workers: bool | None = None) -> Any:
        """CrossDeviceOps.all_reduce, across the workers too. check_workers (default: where `agree` is
        given, i.e. the caller asked the local replicas to compare shapes) compares the shapes across
        the workers as well, at the cost of a round trip."""
        outputs = inputs if outputs is None else outputs
        check = agree is not None if check_workers is None else check_workers

        def combine(everyone: list[tuple[list[Tensor], list[Tensor], Any]]) -> Any:
            tokens = [e[2] for e in everyone]
            if not (agreed(tokens) if agreed is not None else all(t == tokens[0] for t in tokens[1:])):
                return Disagreement(tokens)
            check_same_shapes([e[0] for e in everyone])
            self._reduce_across([e[0] for e in everyone], [e[1] for e in everyone], reduce_op, what, check)
            return None

        disagreement = rendezvous.exchange(replica_id, (inputs, outputs, agree), what, combine)
        return outputs if disagreement is None else disagreement

    def _reduce_across(self, inputs: list[list[Tensor]], outputs: list[list[Tensor]], reduce_op: ReduceOp,
                       what: str, check_workers: bool) -> None:
        self.local._reduce_into(inputs, outputs, ReduceOp.SUM)  # every local replica's outputs: the local sum
        totals = outputs[0]
        if check_workers:
            self.workers._check_same_shapes(totals, what)
        if totals:
            self.workers.all_sum_(totals, what)
        for outs in outputs[1:]:
            for out, total in zip(outs, totals):
                out.copy_(total)
        if reduce_op is ReduceOp.MEAN:  # floats only: the strategy sums integers and divides into float64
            for outs in outputs:
                for out in outs:
                    out.div_(self._replicas)

    def _reduce_into(self, inputs: list[list[Tensor]], outputs: list[list[Tensor]], reduce_op: ReduceOp) -> None:
        self._reduce_across(inputs, outputs, reduce_op, "all_reduce", check_workers=False)

    def _all_sum(self, per_replica: list[list[Tensor]]) -> list[list[Tensor]]:
        summed = self.local._all_sum(per_replica)
        self.workers.all_sum_(summed[0], "batch_reduce")
        return [summed[0]] + [[t.to(x.device, copy=True) for t, x in zip(summed[0], lst)] for lst in summed[1:]]

    def batch_reduce(self, reduce_op: ReduceOp | str, value_destination_pairs: Sequence[tuple[Any, Any]]) -> list[Any]:
        """Reduces each value over every replica of every worker; returns Mirrored values."""
        op = as_reduce_op(reduce_op, "HierarchicalAllReduce.batch_reduce")
        summed = super().batch_reduce(ReduceOp.SUM, value_destination_pairs)
        if op is ReduceOp.SUM:
            return summed
        return [Mirrored([mean_of_sum(t, self._replicas) for t in m.values]) for m in summed]
