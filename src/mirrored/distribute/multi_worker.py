"""MultiWorkerMirroredStrategy: synchronous training over worker processes, on torch.distributed.

Worker processes, each driving one or more local devices: started by torchrun (`torchrun
--nproc_per_node=N train.py`, or `--nnodes=M --node_rank=i --master_addr=...` across machines), by a
TF_CONFIG per task, or by SLURM's srun. cluster_resolver.py reads the launch (and nothing else in the
package reads its variables); without one the strategy is a single worker, as TF's is without
TF_CONFIG. `num_replicas_in_sync` is workers x local replicas, `replica_id_in_sync_group` runs
rank x local replicas + the local index. Under torchrun the workers' process group meets in a store
that rank 0 serves anew every attempt, so `torchrun --max-restarts` brings restarted workers together.

`CollectiveAllReduce` (defined in _collectives.py, re-exported here) does the talking: the gradient
all-reduce of a mirrored optimizer (reducer.py), `ReplicaContext.all_reduce`, and the cross-replica
`reduce`, `gather` and `check_in_sync`. CPU workers use gloo; GPU workers a "cpu:gloo,cuda:nccl"
group, so CUDA tensors go by NCCL and CPU values (a count made with
torch.tensor(len(y))) by gloo; in a group that has no backend for a tensor's device (a user's plain
"nccl" group) it travels through a copy on the worker's device and back. Every worker must make the
same collective calls in the same order, as with DDP. A collective that fails or times out raises an
error naming this rank, the op and, when the rendezvous store can tell, the ranks that did not
arrive (when the store itself is gone, rank 0, its host). On NCCL, whose plain wait() does not block
the host, every wait is given `timeout_s`, which blocks it and raises that error in the caller;
NCCL's watchdog, which would instead abort the process with torch's own message, is given
_WATCHDOG_GRACE_S more (in a group the user made, its own timeout applies to the watchdog).
Builds on strategy.py (the Strategy it subclasses), _collectives.py and the rest of distribute/,
and torch.distributed.
"""
from __future__ import annotations

import dataclasses
import datetime
import logging
import math
import time
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from mirrored.distribute import cluster_resolver, context
from mirrored.distribute._collectives import (_DEFAULT_BYTES_PER_PACK, _WATCHDOG_GRACE_S, CollectiveAllReduce,
                                              HierarchicalAllReduce, _device_types_of, _shape_digest, _value_digest,
                                              init_default_group)
from mirrored.distribute._cross_replica import _as_tensor, _is_mirrored_variable
from mirrored.distribute.context import ReplicaContext
from mirrored.distribute.cross_device_ops import CrossDeviceOps, as_reduce_op, default_for, mean_of_sum
from mirrored.distribute.devices import resolve_devices, torch_device, visible_gpus
from mirrored.distribute.modules import named_copies
from mirrored.distribute.reducer import Communicator
from mirrored.distribute.strategy import DEFAULT_TIMEOUT_S, OutOfSyncError, Strategy
from mirrored.distribute.values import Device, Mirrored, ReduceOp

logger = logging.getLogger(__name__)

_IMPLEMENTATIONS = ("AUTO", "RING", "NCCL")  # tf.distribute.experimental.CommunicationImplementation
_STORE_KEY = "mirrored/store_port"  # in torchrun's agent store: where this attempt's rank 0 serves the workers' store
_STORE_CONNECT_S = 2.0  # a port rank 0 serves answers at once; a dead attempt's refuses within this
_STORE_POLL_S = 0.2


@dataclasses.dataclass(frozen=True)
class CommunicationOptions:
    """How the collectives run (tf.distribute.experimental.CommunicationOptions).

    Args:
      bytes_per_pack: bucket size of the gradient all-reduce; 0 means 25 MiB (DDP's bucket_cap_mb).
      timeout_seconds: when set, replaces the strategy's `timeout_s`.
      implementation: "AUTO" (NCCL for GPUs, gloo for CPUs), "RING" (gloo) or "NCCL".
    """

    bytes_per_pack: int = 0
    timeout_seconds: float | None = None
    implementation: str = "AUTO"

    def __post_init__(self) -> None:
        if not isinstance(self.bytes_per_pack, int) or self.bytes_per_pack < 0:
            raise ValueError(f"CommunicationOptions(bytes_per_pack={self.bytes_per_pack!r}): give a non-negative "
                             "number of bytes (0 for the default, 25 MiB).")
        if self.timeout_seconds is not None and not _positive(self.timeout_seconds):
            raise ValueError(f"CommunicationOptions(timeout_seconds={self.timeout_seconds!r}): give a positive "
                             "number of seconds, or None to use the strategy's timeout_s.")
        name = getattr(self.implementation, "name", self.implementation)  # TF's enum, or its name
        if not isinstance(name, str) or name.upper() not in _IMPLEMENTATIONS:
            raise ValueError(f"CommunicationOptions(implementation={self.implementation!r}): use one of "
                             f"{', '.join(map(repr, _IMPLEMENTATIONS))}.")
        object.__setattr__(self, "implementation", name.upper())  # frozen dataclass: normalise once


def _positive(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and x > 0


def _local_devices(devices: Sequence[str | torch.device] | str | torch.device | None,
                   resolver: cluster_resolver.ClusterResolver) -> tuple[Device, ...]:
    """The devices of this worker's replicas: those given; else its share of the machine's GPUs (all of
    them for one process per machine, cuda:LOCAL_RANK for one process per GPU), else one CPU."""
    if devices is not None:
        return resolve_devices(devices, where="MultiWorkerMirroredStrategy")
    gpus = visible_gpus()
    if not gpus:
        return ("cpu:0",)
    per_machine, local_rank = resolver.local_world_size, resolver.local_rank
    if per_machine is None:  # a single worker takes every GPU (as TF); RANK set by hand: one GPU each
        per_machine = 1 if resolver.num_workers == 1 else len(gpus)
    if per_machine > len(gpus) and resolver.kind == "slurm" and len(gpus) >= 1:
        return tuple(gpus)  # srun --gpus-per-task (or --gpu-bind) showed each task only its own GPUs
    if not 0 <= local_rank < per_machine <= len(gpus):
        raise ValueError(
            f"MultiWorkerMirroredStrategy: local rank {local_rank} of {per_machine} process(es) on this machine, but it "
            f"shows {len(gpus)} GPU(s) ({', '.join(gpus)}). Start at most one process per GPU (torchrun "
            f"--nproc_per_node={len(gpus)}), check CUDA_VISIBLE_DEVICES, or pass devices=[...].")
    share = len(gpus) // per_machine
    if share * per_machine != len(gpus) and local_rank == 0:
        logger.warning("MultiWorkerMirroredStrategy: %d GPUs for %d processes on this machine: each takes %d, and "
                       "%d stay idle. Start a number of processes that divides the GPUs.", len(gpus), per_machine,
                       share, len(gpus) - share * per_machine)
    return tuple(gpus[local_rank * share:(local_rank + 1) * share])


def _rendezvous_store(resolver: cluster_resolver.ClusterResolver, timeout: datetime.timedelta) -> dist.TCPStore:
    """The store the workers' process group meets in: a new one every attempt, served by rank 0.

    torchrun's agent keeps its store across restarts of the workers, and torch's env:// rendezvous
    writes the same keys in it every attempt, so restarted workers read the dead ones' addresses and
    fail to connect ("Gloo connectFullMesh failed ... Connection refused", pytorch/pytorch#135712),
    or wait for keys written under another attempt's number (an agent that restarts its workers
    because another machine re-joined does not count a restart). So rank 0 serves a store of its own
    on a free port and leaves its port in the agent's store; the others take the port they find
    there and connect, and a port left by a dead attempt refuses them until rank 0 replaces it."""
    addr, port, world = resolver.master_addr, resolver.master_port, resolver.num_workers
    if not resolver.uses_agent_store:  # rank 0 hosts the store at MASTER_PORT: new with every attempt
        return dist.TCPStore(addr, port, world, is_master=resolver.rank == 0, timeout=timeout, multi_tenant=True)
    agent = dist.TCPStore(addr, port, world, is_master=False, timeout=timeout)
    if resolver.rank == 0:
        own = dist.TCPStore(addr, 0, world, is_master=True, timeout=timeout, wait_for_workers=False)
        agent.set(_STORE_KEY, str(own.port))
        return own
    deadline = time.monotonic() + timeout.total_seconds()
    while True:
        agent.wait([_STORE_KEY])
        own_port = int(agent.get(_STORE_KEY))
        try:
            store = dist.TCPStore(addr, own_port, world, is_master=False,
                                  timeout=datetime.timedelta(seconds=_STORE_CONNECT_S))
            store.set_timeout(timeout)
            return store
        except (RuntimeError, OSError):  # a dead attempt's port: rank 0 of this one has not replaced it yet
            if time.monotonic() > deadline:
                raise
            time.sleep(_STORE_POLL_S)


def _backend_for(device: Device, implementation: str) -> str:
    """The process group's backend. On GPUs it is NCCL for CUDA tensors and gloo for CPU ones: a
    training step reduces CPU values too (a count made with torch.tensor(len(y))), which NCCL alone
    refuses."""
    if implementation == "NCCL" and not device.startswith("cuda"):
        raise ValueError(f"MultiWorkerMirroredStrategy: implementation NCCL needs a GPU, but this worker's device "
                         f"is {device}. Use implementation \"AUTO\" or \"RING\" (gloo) on CPUs.")
    if implementation == "RING":
        return "gloo"
    return "cpu:gloo,cuda:nccl" if device.startswith("cuda") else "gloo"


def launched_as_worker() -> bool:
    """Whether this process was started as one of several workers (torchrun, TF_CONFIG or SLURM's srun),
    so a program such as `mirrored train` should build a MultiWorkerMirroredStrategy rather than train
    alone. Reads the environment only (cluster_resolver.resolve); nothing is joined."""
    return cluster_resolver.resolve().num_workers > 1


class MultiWorkerMirroredStrategy(Strategy):
    """Synchronous training over worker processes, each driving one or more local devices
    (tf.distribute.MultiWorkerMirroredStrategy).

    The workers come from the launch (cluster_resolver.py: torchrun, TF_CONFIG or SLURM); without one
    this is a single worker. Each worker runs its local replicas as MirroredStrategy does (threads)
    and all-reduces across the workers after the local sum: `num_replicas_in_sync` is workers x local
    replicas, and worker r's replicas are r*L .. r*L+L-1. Devices: `devices=[...]` (the same number
    on every worker), else the worker's share of its machine's GPUs (every GPU for one process per
    machine, cuda:LOCAL_RANK under `torchrun --nproc_per_node=<GPUs>`), else one CPU. The default
    process group is created from the launch ("cpu:gloo,cuda:nccl" for GPUs, gloo for CPUs,
    `timeout_s` for its collectives) in a store rank 0 serves anew every attempt, or an
    existing one is used (its own timeout then applies to gloo and to NCCL's watchdog; our waits on
    NCCL still time out after `timeout_s`).

    Contract, as DDP's: every worker runs the same program on the same model. `mirror(module)`
    broadcasts rank 0's parameters and buffers, so the workers start identical whatever their seeds;
    after that nothing is broadcast: each worker applies the same all-reduced gradients, which keeps
    the copies bitwise identical (check with `check_in_sync`). `experimental_distribute_dataset`
    needs the same global batches on every worker (seed any shuffle); each worker keeps its own part.
    `seed` is MirroredStrategy's (replica r of the 4 of 2 workers x 2 draws as replica r of 4 in one
    process); None takes the chief's torch.initial_seed() at the first step, on every worker.
    per_example_random=True is refused across workers.
    """

    def __init__(self, communication_options: CommunicationOptions | None = None,
                 devices: Sequence[str | torch.device] | str | torch.device | None = None,
                 timeout_s: float = DEFAULT_TIMEOUT_S, seed: int | None = None, per_example_random: bool = False):
        options = CommunicationOptions() if communication_options is None else communication_options
        if not isinstance(options, CommunicationOptions):
            raise TypeError(f"MultiWorkerMirroredStrategy(communication_options={communication_options!r}): expected "
                            "mr.distribute.CommunicationOptions(bytes_per_pack=..., timeout_seconds=..., "
                            "implementation=...) or None.")
        timeout_s = options.timeout_seconds or timeout_s
        if not _positive(timeout_s):
            raise ValueError(f"MultiWorkerMirroredStrategy(timeout_s={timeout_s!r}): give a positive number of "
                             "seconds.")
        joined = dist.is_available() and dist.is_initialized()
        if joined:
            resolver = cluster_resolver.from_process_group(dist.get_rank(), dist.get_world_size())
        else:
            resolver = cluster_resolver.resolve()  # validates the launch before any rendezvous starts
        if per_example_random is True and resolver.num_workers > 1:
            raise ValueError(f"MultiWorkerMirroredStrategy(per_example_random=True) on {resolver.num_workers} workers: "
                             "keying draws by the example's place in the global batch is implemented within one "
                             "process only. Use per_example_random=False (each replica draws from its own "
                             "generators, seeded by seed, step and global replica id), or MirroredStrategy on one "
                             "machine.")
        local = _local_devices(devices, resolver)
        backend = _backend_for(local[0], options.implementation)
        if joined:
            backend = str(dist.get_backend())
            if "cpu" not in _device_types_of(backend) and not local[0].startswith("cuda"):
                raise ValueError(f"MultiWorkerMirroredStrategy: the existing process group uses NCCL, which cannot "
                                 f"reduce tensors on this worker's device {local[0]}. Pass devices=[\"cuda:N\"], or "
                                 "create the group with backend=\"gloo\".")
        elif resolver.num_workers > 1:
            store_at = self._join(resolver, local[0], backend, timeout_s)
        else:
            backend = None
        self._resolver = resolver
        self._rank, self._world_size, self._backend = resolver.rank, resolver.num_workers, backend
        store = (resolver.master_addr, resolver.master_port) if resolver.master_addr and resolver.master_port else None
        if not joined and resolver.num_workers > 1:
            store = store_at  # (rank 0's own store under torchrun: the agent's outlives the attempt)
        wire = torch_device(local[0]) if backend is not None and "nccl" in backend else torch.device("cpu")
        self._collectives = CollectiveAllReduce(resolver.rank, resolver.num_workers, wire, timeout_s,
                                                options.bytes_per_pack or _DEFAULT_BYTES_PER_PACK, store,
                                                backend or "gloo", resolver.restart_count,
                                                agent_store=None if joined else False)  # (ours: rank 0 serves it)
        ops: CrossDeviceOps = self._collectives
        if len(local) > 1:  # threads within the worker, as MirroredStrategy's, then across the workers
            ops = default_for(local)
            if resolver.num_workers > 1:
                ops = HierarchicalAllReduce(ops, self._collectives, len(local))
        super().__init__(local, ops, timeout_s, seed=seed, per_example_random=per_example_random)
        if self._world_size > 1:
            counts = [row[0] for row in self._collectives.all_gather_row([len(local)], "MultiWorkerMirroredStrategy "
                                                                                         "(replicas per worker)")]
            if len(set(counts)) > 1:
                raise ValueError(f"MultiWorkerMirroredStrategy: the workers hold different numbers of replicas "
                                 f"({', '.join(f'rank {r}: {n}' for r, n in enumerate(counts))}). Every worker must "
                                 "drive as many devices: pass the same number in devices=[...] on each, or give "
                                 "every machine the same GPUs.")

    def _join(self, resolver: cluster_resolver.ClusterResolver, device: Device, backend: str,
              timeout_s: float) -> tuple[str, int]:
        """Creates the default process group of the launch in a store of this attempt; its address."""
        if device.startswith("cuda"):
            torch.cuda.set_device(torch_device(device))  # NCCL binds the group to the current device
        nccl = "nccl" in backend
        group_timeout = datetime.timedelta(seconds=timeout_s + (_WATCHDOG_GRACE_S if nccl else 0))  # see _collectives
        attempt = f", restart attempt {resolver.restart_count}" if resolver.restart_count else ""
        try:
            store = _rendezvous_store(resolver, group_timeout)
            init_default_group(backend, store=store, rank=resolver.rank, world_size=resolver.num_workers,
                               timeout=group_timeout, device_id=torch_device(device) if nccl else None)
            return resolver.master_addr, getattr(store, "port", resolver.master_port)
        except (RuntimeError, ValueError) as e:  # a worker that never starts, a wrong address, a port in use
            raise RuntimeError(
                f"MultiWorkerMirroredStrategy: rank {resolver.rank} of {resolver.num_workers} could not join the other "
                f"workers at {resolver.master_addr}:{resolver.master_port} (launched by {resolver.kind}{attempt}; "
                f"backend {backend}, timeout_s={timeout_s:g}): {e} Check that every worker started, with the same "
                "address, port and number of workers, and that rank 0's machine is reachable.") from e

    def _log_created(self) -> None:
        # Only the chief logs INFO, or N workers would repeat every line (nanoGPT's master_process).
        logger.log(logging.INFO if self._rank == 0 else logging.DEBUG,
                   "MultiWorkerMirroredStrategy: rank %d of %d (%s) on %s, backend %s, timeout %g s, buckets of %d "
                   "bytes", self._rank, self._world_size, self._resolver.kind, ", ".join(self._devices),
                   self._backend or "none (single worker)", self._timeout_s, self._collectives.bytes_per_pack)

    def __repr__(self) -> str:
        where = f"device={self._devices[0]!r}" if len(self._devices) == 1 else f"devices={list(self._devices)}"
        return (f"MultiWorkerMirroredStrategy(rank={self._rank}, world_size={self._world_size}, {where}, "
                f"backend={self._backend!r})")

    @property
    def num_replicas_in_sync(self) -> int:
        """Every replica of every worker: workers x local replicas."""
        return self._world_size * len(self._devices)

    @property
    def cluster_resolver(self) -> cluster_resolver.ClusterResolver:
        """How this worker was launched (kind: torchrun, tf_config, slurm...) and its place: task_type,
        task_id, rank, num_workers, is_chief, cluster_spec(), as TF's strategy.cluster_resolver."""
        return self._resolver

    # ---- extension points (Strategy's): local replicas, then across the workers over torch.distributed ---
    @property
    def num_workers(self) -> int:
        """The number of worker processes (torchrun's WORLD_SIZE)."""
        return self._world_size

    @property
    def first_replica_id(self) -> int:
        """replica_id_in_sync_group of this worker's first replica: rank x local replicas."""
        return self._rank * len(self._devices)

    def has_peers(self, ctx: ReplicaContext) -> bool:
        """Whether other replicas exist to reduce with: other workers, or local replicas in this step."""
        return self._world_size > 1 or ctx._step is not None

    def all_reduce_tensors(self, ctx: ReplicaContext, op: ReduceOp, leaves: list[Tensor],
                           check_shapes: bool = True) -> list[Tensor]:
        """Strategy.all_reduce_tensors across every replica of every worker."""
        if len(self._devices) > 1:  # the local meeting's last replica crosses the workers (HierarchicalAllReduce)
            return super().all_reduce_tensors(ctx, op, leaves, check_shapes)
        return self._collectives.all_reduce(op, leaves, "ReplicaContext.all_reduce", check_shapes=check_shapes)

    def sum_over_workers(self, count: int) -> int:
        """`count` summed over every worker (one all-reduce; `count` itself on one worker)."""
        if self._world_size == 1:
            return count
        n = torch.tensor([count], dtype=torch.int64, device=self._collectives._wire)
        self._collectives.all_sum_([n], "distributed input (batches left)")
        return int(n.item())

    def gather_over_workers(self, row: Sequence[int], what: str) -> list[list[int]]:
        """Strategy.gather_over_workers through torch.distributed (an all-gather of int64)."""
        if self._world_size == 1:
            return [list(row)]
        return self._collectives.all_gather_row(row, what)

    def chief_ints(self, values: Sequence[int], what: str) -> list[int]:
        """Strategy.chief_ints through torch.distributed (a broadcast from rank 0)."""
        if self._world_size == 1 or not values:
            return list(values)
        shared = torch.tensor(list(values), dtype=torch.int64)
        self._collectives.broadcast_([shared], what)
        return shared.tolist()

    def _communicator(self) -> Communicator:
        """Strategy._communicator across the workers too: this worker's replica threads (their local
        sum crosses the workers in HierarchicalAllReduce) and the workers' collectives."""
        return Communicator(self._cross_device_ops if len(self._devices) > 1 else None,
                            self._collectives if self._world_size > 1 else None)

    # ---- cross-replica context ------------------------------------------------------------------------
    def reduce(self, reduce_op: ReduceOp | str, value: Any, axis: int | Sequence[int] | None = None) -> Any:
        """Combines this worker's values (a run result or any tensor) with the other workers' (TF's reduce).
        axis=None: SUM / MEAN of the values; with axis: over those axes too, MEAN dividing by the global
        count of elements, so workers with uneven parts weigh correctly. A value to read, outside autograd."""
        context.require_cross_replica("strategy.reduce")
        with torch.no_grad():
            return self._reduce_over_workers(as_reduce_op(reduce_op, "strategy.reduce"), value, axis)

    def _reduce_over_workers(self, op: ReduceOp, value: Any, axis: int | Sequence[int] | None) -> Any:
        if self._world_size == 1:
            return super().reduce(op, value, axis)
        parts = self._local_values(value, "strategy.reduce")
        if axis is not None:
            axes = tuple(axis) if isinstance(axis, (tuple, list)) else (axis,)
            total = _local_sum([p.sum(dim=axes) for p in parts])
            if op is ReduceOp.SUM:
                return self._collectives.all_reduce(ReduceOp.SUM, [total], "strategy.reduce")[0]
            count = torch.tensor(sum(math.prod(p.shape[a] for a in axes) for p in parts), device=total.device)
            total, count = self._collectives.all_reduce(ReduceOp.SUM, [total, count], "strategy.reduce")
            return mean_of_sum(total, count)
        if op is ReduceOp.MEAN and (isinstance(value, Mirrored) or _is_mirrored_variable(value)):
            return parts[0].detach().clone()  # identical on every replica: no rounding, as in TF
        if len(parts) == 1:
            return self._collectives.all_reduce(op, parts, "strategy.reduce")[0]
        total = self._collectives.all_reduce(ReduceOp.SUM, [_local_sum(parts)], "strategy.reduce")[0]
        return mean_of_sum(total, self.num_replicas_in_sync) if op is ReduceOp.MEAN else total

    def gather(self, value: Any, axis: int) -> Any:
        """Concatenates every replica's values along `axis` in replica order; their sizes along it may differ."""
        context.require_cross_replica("strategy.gather")
        if self._world_size == 1:
            return super().gather(value, axis)
        parts = self._local_values(value, "strategy.gather")
        if any(p.dim() == 0 for p in parts):
            raise ValueError("strategy.gather: the per-replica values are scalars (rank 0), which have no axis to "
                             "concatenate along. Gather tensors of rank >= 1, e.g. v.reshape(1).")
        local = parts[0] if len(parts) == 1 else torch.cat([p.to(parts[0].device) for p in parts], dim=axis)
        return self._collectives.gather(local, axis, "strategy.gather")

    def _local_values(self, value: Any, where: str) -> list[Tensor]:
        parts = self.experimental_local_results(value)
        if len(parts) != len(self._devices):
            raise ValueError(f"{where}: got {len(parts)} values for this worker, which has {len(self._devices)} "
                             "replica(s). Pass what strategy.run returned, or this worker's own tensor.")
        return [_as_tensor(p, None) for p in parts]

    def check_in_sync(self, obj: Any) -> None:
        """Compares this worker's copies bitwise, then checksums of every tensor across the workers; raises
        OutOfSyncError (on every rank) naming the first tensor that differs, the ranks, and their largest
        difference from rank 0."""
        if len(self._devices) > 1:
            super().check_in_sync(obj)
        named = [(name, copies[0]) for name, copies in named_copies(obj)]
        if self._world_size == 1:
            return
        ops = self._collectives
        counts = [row[0] for row in ops.all_gather_row([len(named)], "check_in_sync (tensor count)")]
        if len(set(counts)) > 1:
            raise OutOfSyncError(f"check_in_sync: the workers hold different numbers of tensors "
                                 f"({', '.join(f'rank {r}: {n}' for r, n in enumerate(counts))}): they built "
                                 "different models or optimizers.")
        if not named:
            return
        mine = [d for _, t in named for d in (_shape_digest([t]), _value_digest(t))]
        table = ops.all_gather_row(mine, "check_in_sync (checksums)")
        for j, (name, t) in enumerate(named):
            keys = [tuple(row[2 * j:2 * j + 2]) for row in table]
            differ = [r for r in range(self._world_size) if keys[r] != keys[0]]
            if not differ:
                continue
            if any(k[0] != keys[0][0] for k in keys):
                detail = " (different shapes or dtypes)"
            else:
                ref = t.detach().clone()
                ops.broadcast_([ref], "check_in_sync (rank 0's copy)")
                gap = (t.detach().double() - ref.double()).abs().max().item() if t.numel() else 0.0
                gaps = [row[0] for row in ops.all_gather_row([gap], "check_in_sync (differences)", torch.float64)]
                detail = f" (max abs difference from rank 0: {', '.join(f'rank {r}: {gaps[r]:.3g}' for r in differ)})"
            raise OutOfSyncError(f"{name}: rank 0 and rank(s) {', '.join(map(str, differ))} hold different values"
                                 f"{detail}; the copies must be bitwise identical after every step.")

    def mirror(self, module: torch.nn.Module, memory_format: str = "auto") -> Any:
        """This worker's copies of `module`, with rank 0's parameters and buffers, so that every worker
        starts from the same weights whatever its seed (DDP broadcasts at construction too): they are
        broadcast into `module` before it is copied to the local replicas."""
        if self._world_size > 1 and isinstance(module, torch.nn.Module):
            tensors = list(module.parameters()) + list(module.buffers())
            rows = self._collectives.all_gather_row([len(tensors), _shape_digest(tensors)], "mirror (structure)")
            differ = [r for r, row in enumerate(rows) if row != rows[0]]
            if differ:
                raise ValueError(f"strategy.mirror({type(module).__name__}): rank(s) {', '.join(map(str, differ))} "
                                 "built a module with other parameter/buffer shapes than rank 0's "
                                 f"({', '.join(f'rank {r}: {row[0]} tensors' for r, row in enumerate(rows))}). "
                                 "Every worker must build the same model.")
            self._collectives.broadcast_(tensors, "mirror (broadcast of rank 0's parameters and buffers)")
        return super().mirror(module, memory_format)


def _local_sum(parts: list[Tensor]) -> Tensor:
    """The sum of a worker's replicas' values, on the first one's device (a new tensor)."""
    total = parts[0].clone()
    for p in parts[1:]:
        total += p.to(total.device)
    return total
