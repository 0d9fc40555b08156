"""MultiWorkerMirroredStrategy: synchronous training over worker processes, on torch.distributed.

One process per device, each holding one replica, started by torchrun (`torchrun --nproc_per_node=N
train.py`, or `--nnodes=M --node_rank=i --master_addr=...` across machines): `num_replicas_in_sync`
is the world size and `replica_id_in_sync_group` the process's rank. torchrun's environment (RANK,
WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT) is read here and nowhere else in the package;
without it the strategy is a single worker, as TF's is without TF_CONFIG. TF_CONFIG itself is not
used to join workers: one naming several tasks, without RANK, is refused with the torchrun launch
that would join them, rather than letting every task train alone as rank 0.

`CollectiveAllReduce` (defined in _collectives.py, re-exported here) does the talking: the gradient
all-reduce of a mirrored optimizer (flat buckets, one collective each), `ReplicaContext.all_reduce`,
and the cross-replica `reduce`, `gather` and `check_in_sync`. CPU workers use gloo; GPU workers a
"cpu:gloo,cuda:nccl" group, so CUDA tensors go by NCCL and CPU values (a count made with
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
import json
import logging
import math
import os
from collections.abc import Sequence
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from torch import Tensor

from mirrored.distribute import buckets, context
# (_store_gone is not used here: tests import it from this module, where it was defined before the split.)
from mirrored.distribute._collectives import (_DEFAULT_BYTES_PER_PACK, _WATCHDOG_GRACE_S, CollectiveAllReduce,
                                              _device_types_of, _shape_digest, _store_gone, _value_digest,
                                              init_default_group)
from mirrored.distribute.context import ReplicaContext
from mirrored.distribute.cross_device_ops import as_reduce_op, mean_of_sum
from mirrored.distribute.devices import Device, resolve_devices, torch_device, visible_gpus
from mirrored.distribute.modules import named_copies
from mirrored.distribute.strategy import (DEFAULT_TIMEOUT_S, OutOfSyncError, Strategy, _as_tensor,
                                          _is_mirrored_variable)
from mirrored.distribute.values import Mirrored, ReduceOp

logger = logging.getLogger(__name__)

_IMPLEMENTATIONS = ("AUTO", "RING", "NCCL")  # tf.distribute.experimental.CommunicationImplementation


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


class _Launch(NamedTuple):
    """What torchrun (or the user) put in the environment of this worker process."""

    rank: int | None
    world_size: int | None
    local_rank: int | None
    master_addr: str | None
    master_port: int | None


def _int_env(name: str) -> int | None:
    value = os.environ.get(name)
    if value is None:
        return None
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"MultiWorkerMirroredStrategy: environment variable {name}={value!r} is not an integer. "
                         "torchrun sets it; when launching workers yourself, give it a number.") from None


def _read_launch() -> _Launch:
    return _Launch(_int_env("RANK"), _int_env("WORLD_SIZE"), _int_env("LOCAL_RANK"),
                   os.environ.get("MASTER_ADDR"), _int_env("MASTER_PORT"))


def _check_launch(launch: _Launch) -> None:
    """Raises where RANK is set but the rest of a rendezvous (WORLD_SIZE, MASTER_ADDR/PORT) is not."""
    missing = [k for k, v in (("WORLD_SIZE", launch.world_size), ("MASTER_ADDR", launch.master_addr),
                              ("MASTER_PORT", launch.master_port)) if v is None]
    if missing:
        raise ValueError(
            f"MultiWorkerMirroredStrategy: RANK={launch.rank} is set but {', '.join(missing)} "
            f"{'is' if len(missing) == 1 else 'are'} not. Launch with torchrun (torchrun --nproc_per_node=N "
            "script.py sets them all), set RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT yourself, or unset "
            "RANK to train as a single worker.")
    if not (launch.world_size >= 1 and 0 <= launch.rank < launch.world_size):
        raise ValueError(f"MultiWorkerMirroredStrategy: RANK={launch.rank} is outside [0, WORLD_SIZE="
                         f"{launch.world_size}). Ranks run 0..WORLD_SIZE-1, one per worker process.")


def _check_tf_config(text: str | None) -> None:
    """Raises where TF_CONFIG (TF's cluster description) names more than one task, or is malformed:
    without torchrun's RANK this process would otherwise train alone as rank 0, the chief, however
    many workers TF_CONFIG lists. A TF_CONFIG of one task (or none) is a single worker, as in TF."""
    if text is None or not text.strip():
        return
    try:
        config = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"MultiWorkerMirroredStrategy: TF_CONFIG={text!r} is not valid JSON ({e}). Fix it, "
                         "e.g. '{\"cluster\": {\"worker\": [\"host0:port\"]}, \"task\": {\"type\": "
                         "\"worker\", \"index\": 0}}', or unset it.") from None
    cluster = config.get("cluster", {}) if isinstance(config, dict) else None
    task = config.get("task", {}) if isinstance(config, dict) else None
    if (not isinstance(cluster, dict) or not isinstance(task, dict)
            or not all(isinstance(a, list) and all(isinstance(x, str) for x in a) for a in cluster.values())):
        raise ValueError(f"MultiWorkerMirroredStrategy: TF_CONFIG={text!r} is not TF's layout, "
                         "{\"cluster\": {\"worker\": [\"host:port\", ...]}, \"task\": {\"type\": \"worker\", "
                         "\"index\": i}}. Fix it or unset it.")
    if sum(len(addresses) for addresses in cluster.values()) <= 1:
        return
    # TF numbers the chief (if any) first, then the workers: that order gives torchrun's ranks.
    workers = [("chief", i, a) for i, a in enumerate(cluster.get("chief", []))]
    workers += [("worker", i, a) for i, a in enumerate(cluster.get("worker", []))]
    me = (task.get("type"), task.get("index"))
    rank = next((r for r, (kind, i, _) in enumerate(workers) if (kind, i) == me), None)
    tasks = ", ".join(f"{kind}: {len(addresses)}" for kind, addresses in cluster.items())
    if rank is None or not workers:
        how = "launch each worker with torchrun"
    else:
        host, _, port = workers[0][2].rpartition(":")
        how = (f"for this task that is `torchrun --nnodes={len(workers)} --node_rank={rank} --nproc_per_node=1 "
               f"--master_addr={host or workers[0][2]} --master_port={port or 29500} script.py`, or "
               f"RANK={rank} WORLD_SIZE={len(workers)} MASTER_ADDR={host or workers[0][2]} "
               f"MASTER_PORT={port or 29500} with LOCAL_RANK=0")
    raise ValueError(
        f"MultiWorkerMirroredStrategy: TF_CONFIG describes a cluster of several tasks ({tasks}; this task: "
        f"{me[0]} {me[1]}), but RANK is not set. mirrored joins workers launched by torchrun, which sets RANK, "
        "WORLD_SIZE, MASTER_ADDR and MASTER_PORT; it does not read TF_CONFIG. Translate: rank = the task's "
        "position among chief then workers (its index when there is no chief), world size = the number of "
        f"workers, master = the chief's (or worker 0's) address; {how}. Unset TF_CONFIG to train as a "
        "single worker.")


def _local_device(devices: Sequence[str | torch.device] | str | torch.device | None, local_rank: int) -> Device:
    """cuda:LOCAL_RANK when GPUs are visible, else cpu:0; an explicit single device wins."""
    if devices is not None:
        resolved = resolve_devices(devices, where="MultiWorkerMirroredStrategy")
        if len(resolved) != 1:
            raise ValueError(
                f"MultiWorkerMirroredStrategy(devices={list(resolved)}): a worker process drives one device. "
                f"For {len(resolved)} devices run one process per device, "
                f"`torchrun --nproc_per_node={len(resolved)} script.py` (each takes cuda:LOCAL_RANK), or pass "
                "a single device.")
        return resolved[0]
    gpus = visible_gpus()
    if not gpus:
        return "cpu:0"
    if not 0 <= local_rank < len(gpus):
        raise ValueError(
            f"MultiWorkerMirroredStrategy: LOCAL_RANK={local_rank} but this machine shows {len(gpus)} GPU(s) "
            f"({', '.join(gpus)}). Start at most one process per GPU (torchrun --nproc_per_node={len(gpus)}), "
            "check CUDA_VISIBLE_DEVICES, or pass devices=[\"cpu:0\"].")
    return gpus[local_rank]


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
    """Whether this process was started as one of several workers (torchrun's RANK with WORLD_SIZE > 1),
    so a program such as `mirrored train` should build a MultiWorkerMirroredStrategy rather than train
    alone. Reads the environment only; nothing is joined."""
    launch = _read_launch()
    return launch.rank is not None and (launch.world_size or 1) > 1


class ClusterResolver(NamedTuple):
    """What `strategy.cluster_resolver` tells (the fields of TF's that training scripts read)."""

    task_type: str | None  # "worker" in a multi-worker run, None for a single worker (as TF without TF_CONFIG)
    task_id: int  # the rank: 0 is the chief, which logs and writes checkpoints


class MultiWorkerMirroredStrategy(Strategy):
    """Synchronous training on one device per worker process (tf.distribute.MultiWorkerMirroredStrategy).

    Launch one process per device with torchrun; each takes cuda:LOCAL_RANK, or cpu:0 without GPUs
    (`devices=[one device]` chooses). The default process group is created from torchrun's
    environment ("cpu:gloo,cuda:nccl" for GPUs, gloo for CPUs, `timeout_s` for its collectives), or an
    existing one is used (its own timeout then applies to gloo and to NCCL's watchdog; our waits on
    NCCL still time out after `timeout_s`). Without RANK in the environment this is a single worker.

    Contract, as DDP's: every worker runs the same program on the same model. `mirror(module)`
    broadcasts rank 0's parameters and buffers, so the workers start identical whatever their seeds;
    after that nothing is broadcast: each worker applies the same all-reduced gradients, which keeps
    the copies bitwise identical (check with `check_in_sync`). `experimental_distribute_dataset`
    needs the same global batches on every worker (seed any shuffle); each worker keeps its own part.
    """

    def __init__(self, communication_options: CommunicationOptions | None = None,
                 devices: Sequence[str | torch.device] | str | torch.device | None = None,
                 timeout_s: float = DEFAULT_TIMEOUT_S):
        options = CommunicationOptions() if communication_options is None else communication_options
        if not isinstance(options, CommunicationOptions):
            raise TypeError(f"MultiWorkerMirroredStrategy(communication_options={communication_options!r}): expected "
                            "mr.distribute.CommunicationOptions(bytes_per_pack=..., timeout_seconds=..., "
                            "implementation=...) or None.")
        timeout_s = options.timeout_seconds or timeout_s
        if not _positive(timeout_s):
            raise ValueError(f"MultiWorkerMirroredStrategy(timeout_s={timeout_s!r}): give a positive number of "
                             "seconds.")
        launch = _read_launch()
        joined = dist.is_available() and dist.is_initialized()
        if joined:
            rank, world = dist.get_rank(), dist.get_world_size()
        elif launch.rank is not None:
            _check_launch(launch)
            rank, world = launch.rank, launch.world_size
        else:
            _check_tf_config(os.environ.get("TF_CONFIG"))  # RANK set: torchrun's launch wins over it
            rank, world = 0, 1
        local_rank = launch.local_rank if launch.local_rank is not None else rank % max(1, len(visible_gpus()))
        device = _local_device(devices, local_rank)
        backend = _backend_for(device, options.implementation)
        if joined:
            backend = str(dist.get_backend())
            if "cpu" not in _device_types_of(backend) and not device.startswith("cuda"):
                raise ValueError(f"MultiWorkerMirroredStrategy: the existing process group uses NCCL, which cannot "
                                 f"reduce tensors on this worker's device {device}. Pass devices=[\"cuda:N\"], or "
                                 "create the group with backend=\"gloo\".")
        elif launch.rank is not None:
            if device.startswith("cuda"):
                torch.cuda.set_device(torch_device(device))  # NCCL binds the group to the current device
            nccl = "nccl" in backend
            group_timeout_s = timeout_s + (_WATCHDOG_GRACE_S if nccl else 0)  # see CollectiveAllReduce
            try:
                init_default_group(backend, init_method="env://", rank=rank, world_size=world,
                                   timeout=datetime.timedelta(seconds=group_timeout_s),
                                   device_id=torch_device(device) if nccl else None)
            except RuntimeError as e:  # the rendezvous: a worker that never starts, a wrong address
                raise RuntimeError(
                    f"MultiWorkerMirroredStrategy: rank {rank} of {world} could not join the other workers at "
                    f"{launch.master_addr}:{launch.master_port} (backend {backend}, timeout_s={timeout_s:g}): {e} "
                    "Check that every worker started, with the same MASTER_ADDR, MASTER_PORT and WORLD_SIZE, "
                    "and that rank 0's machine is reachable.") from e
        else:
            backend = None
        self._rank, self._world_size, self._backend = rank, world, backend
        store = (launch.master_addr, launch.master_port) if launch.master_addr and launch.master_port else None
        wire = torch_device(device) if backend is not None and "nccl" in backend else torch.device("cpu")
        self._collectives = CollectiveAllReduce(rank, world, wire, timeout_s,
                                                options.bytes_per_pack or _DEFAULT_BYTES_PER_PACK, store,
                                                backend or "gloo")
        super().__init__((device,), self._collectives, timeout_s)

    def _log_created(self) -> None:
        # Only the chief logs INFO, or N workers would repeat every line (nanoGPT's master_process).
        logger.log(logging.INFO if self._rank == 0 else logging.DEBUG,
                   "MultiWorkerMirroredStrategy: rank %d of %d on %s, backend %s, timeout %g s, buckets of %d bytes",
                   self._rank, self._world_size, self._devices[0], self._backend or "none (single worker)",
                   self._timeout_s, self._collectives.bytes_per_pack)

    def __repr__(self) -> str:
        return (f"MultiWorkerMirroredStrategy(rank={self._rank}, world_size={self._world_size}, "
                f"device={self._devices[0]!r}, backend={self._backend!r})")

    @property
    def num_replicas_in_sync(self) -> int:
        """The world size: one replica per worker process."""
        return self._world_size

    @property
    def cluster_resolver(self) -> ClusterResolver:
        """task_type and task_id (= rank) of this worker, as TF's strategy.cluster_resolver gives them."""
        return ClusterResolver("worker" if self._backend else None, self._rank)

    # ---- extension points (Strategy's): one replica per process, over torch.distributed ----------------
    @property
    def num_workers(self) -> int:
        """The world size (torchrun's WORLD_SIZE)."""
        return self._world_size

    @property
    def first_replica_id(self) -> int:
        """This worker's rank: its one replica's replica_id_in_sync_group."""
        return self._rank  # one replica per worker: replica_id_in_sync_group == rank

    def has_peers(self, ctx: ReplicaContext) -> bool:
        """Whether other workers exist to reduce with (world size above 1)."""
        return self._world_size > 1

    def all_reduce_tensors(self, ctx: ReplicaContext, op: ReduceOp, leaves: list[Tensor],
                           check_shapes: bool = True) -> list[Tensor]:
        """Strategy.all_reduce_tensors across the worker processes, through torch.distributed."""
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

    def all_reduce_gradients(self, ctx: ReplicaContext | None, cache: dict, params: Sequence[Tensor],
                             grads: list[Tensor | None]) -> list[Tensor | None]:
        """SUM-all-reduces this worker's gradients over the workers in persistent buckets. Every parameter
        that requires grad travels (zeros where this worker has no gradient), plus a count per parameter
        of the workers that had one, so the bucket layout is the same on every rank without a separate
        exchange, and a gradient that is None on every worker stays None."""
        if ctx is None or self._world_size == 1:
            return grads
        idx = [i for i, p in enumerate(params) if p.requires_grad]
        device = params[idx[0]].device if idx else torch_device(self._devices[0])
        had = torch.tensor([float(grads[i] is not None) for i in idx], device=device)
        sent = [grads[i] if grads[i] is not None else torch.zeros_like(params[i]) for i in idx] + [had]
        sig = ("workers", buckets.signature(sent))  # one signature: every parameter that requires grad
        cached = cache.get(sig)
        if cached is None:
            plan = buckets.plan(sent, self._collectives.bytes_per_pack)
            cached = cache[sig] = [plan, [b.new_buffer() for b in plan]]
        plan, flats = cached
        for b, flat in zip(plan, flats):
            b.pack(sent, out=flat)
        self._collectives.all_sum_(flats, "all_reduce (gradients)")
        views: list[Tensor | None] = [None] * len(sent)
        for b, flat in zip(plan, flats):
            b.unpack(flat, views)
        out = list(grads)
        for j, (i, count) in enumerate(zip(idx, views[-1].tolist())):
            out[i] = views[j] if count > 0 else None
        return out

    # ---- cross-replica context ------------------------------------------------------------------------
    def reduce(self, reduce_op: ReduceOp | str, value: Any, axis: int | Sequence[int] | None = None) -> Any:
        """Combines this worker's value (a run result or any tensor) with the other workers' (TF's reduce).
        axis=None: SUM / MEAN of the values; with axis: over those axes too, MEAN dividing by the global
        count of elements, so workers with uneven parts weigh correctly. A value to read, outside autograd."""
        context.require_cross_replica("strategy.reduce")
        with torch.no_grad():
            return self._reduce_over_workers(as_reduce_op(reduce_op, "strategy.reduce"), value, axis)

    def _reduce_over_workers(self, op: ReduceOp, value: Any, axis: int | Sequence[int] | None) -> Any:
        if self._world_size == 1:
            return super().reduce(op, value, axis)
        local = self._local_value(value, "strategy.reduce")
        if axis is not None:
            axes = tuple(axis) if isinstance(axis, (tuple, list)) else (axis,)
            total = local.sum(dim=axes)
            if op is ReduceOp.SUM:
                return self._collectives.all_reduce(ReduceOp.SUM, [total], "strategy.reduce")[0]
            count = torch.tensor(math.prod(local.shape[a] for a in axes), device=total.device)
            total, count = self._collectives.all_reduce(ReduceOp.SUM, [total, count], "strategy.reduce")
            return mean_of_sum(total, count)
        if op is ReduceOp.MEAN and (isinstance(value, Mirrored) or _is_mirrored_variable(value)):
            return local.detach().clone()  # identical on every replica: no rounding, as in TF
        return self._collectives.all_reduce(op, [local], "strategy.reduce")[0]

    def gather(self, value: Any, axis: int) -> Any:
        """Concatenates the workers' values along `axis` in rank order; their sizes along it may differ."""
        context.require_cross_replica("strategy.gather")
        if self._world_size == 1:
            return super().gather(value, axis)
        local = self._local_value(value, "strategy.gather")
        if local.dim() == 0:
            raise ValueError("strategy.gather: the per-replica values are scalars (rank 0), which have no axis to "
                             "concatenate along. Gather tensors of rank >= 1, e.g. v.reshape(1).")
        return self._collectives.gather(local, axis, "strategy.gather")

    def _local_value(self, value: Any, where: str) -> Tensor:
        parts = self.experimental_local_results(value)
        if len(parts) != 1:
            raise ValueError(f"{where}: got {len(parts)} values for this worker, which has one replica. Pass what "
                             "strategy.run returned, or this worker's own tensor.")
        return _as_tensor(parts[0], None)

    def check_in_sync(self, obj: Any) -> None:
        """Compares checksums of every tensor across the workers; raises OutOfSyncError (on every rank)
        naming the first tensor that differs, the ranks, and their largest difference from rank 0."""
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

    def mirror(self, module: torch.nn.Module) -> Any:
        """This worker's copy of `module`, overwritten with rank 0's parameters and buffers, so that every
        worker starts from the same weights whatever its seed (DDP broadcasts at construction too)."""
        mirrored = super().mirror(module)
        if self._world_size > 1:
            net = mirrored.replicas[0]
            tensors = list(net.parameters()) + list(net.buffers())
            rows = self._collectives.all_gather_row([len(tensors), _shape_digest(tensors)], "mirror (structure)")
            differ = [r for r, row in enumerate(rows) if row != rows[0]]
            if differ:
                raise ValueError(f"strategy.mirror({type(module).__name__}): rank(s) {', '.join(map(str, differ))} "
                                 "built a module with other parameter/buffer shapes than rank 0's "
                                 f"({', '.join(f'rank {r}: {row[0]} tensors' for r, row in enumerate(rows))}). "
                                 "Every worker must build the same model.")
            self._collectives.broadcast_(tensors, "mirror (broadcast of rank 0's parameters and buffers)")
        return mirrored
