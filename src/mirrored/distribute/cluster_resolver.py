"""How this worker process was launched: torchrun, TF_CONFIG or SLURM (TF's cluster resolvers).

`resolve()` reads the environment once and returns a `ClusterResolver`: this process's rank among the
workers, their number, its local rank on its machine, the address and port of the rendezvous (rank 0's
host) and, under torchrun, the restart attempt. It is the one place in the package that reads these
variables. The launchers, in the order they win:

- torchrun (and `python -m torch.distributed.run`), or RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT
  set by hand: RANK is the rank.
- TF_CONFIG naming several tasks (Kubeflow's TFJob, Vertex AI, TF launchers): the chief (if any) is
  rank 0, then the workers in index order; the chief's address:port (else worker 0's) is the master.
- SLURM's `srun` (SLURM_STEP_ID set): SLURM_PROCID, SLURM_NTASKS (SLURM_STEP_NUM_TASKS where srun
  sets it), SLURM_LOCALID; the master is the first node of SLURM_STEP_NODELIST / SLURM_JOB_NODELIST
  (MASTER_ADDR overrides it), on MASTER_PORT or a port derived from SLURM_JOB_ID, the same on every task.

A process group that exists before the strategy (`from_process_group`) is joined as it is: kind "ray"
in a Ray Train worker (RAY_RAYLET_PID and RAY_JOB_ID, which Ray gives its workers; TorchTrainer sets RANK,
WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR and MASTER_PORT and creates the group before the
training function runs), "process_group" otherwise.

Without any of them the process is a single worker, as TF's strategy is without TF_CONFIG.
Uses only the standard library.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import os
import re
from collections.abc import Mapping

logger = logging.getLogger(__name__)

# SLURM gives no port: derive one from the job id, the same on every task of the job, in a range
# clear of the usual services and of Linux's ephemeral ports (32768+), so two jobs sharing a node
# rarely collide (PyTorch Lightning derives its port from the job id too).
_SLURM_PORT_BASE, _SLURM_PORT_SPAN = 15000, 15000
_TF_TASK_TYPES = ("chief", "worker")  # the tasks that train under MultiWorkerMirroredStrategy, ranks in this order


@dataclasses.dataclass(frozen=True)
class ClusterResolver:
    """What `strategy.cluster_resolver` tells: the launcher (`kind`) and this worker's place.

    task_type / task_id are TF's: ("chief", 0) or ("worker", i) under TF_CONFIG, ("worker", rank)
    under torchrun and SLURM, (None, 0) for a single worker. `rank` numbers the workers 0..num_workers-1
    (the chief is 0), and `is_chief` is what decides which worker writes files (TF's rule).
    """

    # "torchrun", "environment" (RANK set by hand), "tf_config", "slurm", "ray" (a Ray Train worker, whose
    # process group Ray made), "process_group" (one the user made), "single"
    kind: str
    task_type: str | None
    task_id: int
    rank: int
    num_workers: int
    local_rank: int = 0
    master_addr: str | None = None
    master_port: int | None = None
    restart_count: int = 0  # torchrun's TORCHELASTIC_RESTART_COUNT: which attempt of the job this is
    rpc_layer: str | None = None  # TF_CONFIG's "rpc_layer" where it gives one
    tasks: Mapping[str, tuple[str, ...]] = dataclasses.field(default_factory=dict)
    uses_agent_store: bool = False  # torchrun's agent hosts the rendezvous store (not rank 0)
    local_world_size: int | None = None  # worker processes on this machine, where the launcher tells

    @property
    def is_chief(self) -> bool:
        """Whether this worker logs and writes checkpoints: rank 0 (TF: the chief, else worker 0)."""
        return self.rank == 0

    @property
    def environment(self) -> str:
        """TF's ClusterResolver.environment: "" outside Google's internal launchers."""
        return ""

    def cluster_spec(self) -> dict[str, list[str]]:
        """TF's cluster_spec().as_dict() where the launcher names every task (TF_CONFIG, SLURM);
        torchrun names only the master, given as worker 0."""
        if self.tasks:
            return {kind: list(addresses) for kind, addresses in self.tasks.items()}
        if self.master_addr is None:
            return {}
        return {"worker": [f"{self.master_addr}:{self.master_port}"]}

    def master(self) -> str:
        """The rendezvous address as "host:port" ("" for a single worker), as TF's master() gives one."""
        return "" if self.master_addr is None else f"{self.master_addr}:{self.master_port}"


def single() -> ClusterResolver:
    return ClusterResolver("single", None, 0, 0, 1)


def from_process_group(rank: int, world_size: int, environ: Mapping[str, str] | None = None) -> ClusterResolver:
    """For a process group created before the strategy (by the user, or by Ray Train's TorchTrainer before
    the training function runs: kind "ray"): its rank and size."""
    env = os.environ if environ is None else environ
    addr, port = env.get("MASTER_ADDR"), _int(env, "MASTER_PORT", "set it to the rendezvous port")
    local_world = _int(env, "LOCAL_WORLD_SIZE", "give the number of worker processes on this machine")
    return ClusterResolver("ray" if _in_ray_worker(env) else "process_group", "worker", rank, rank, world_size,
                           _local_rank(env, rank), addr, port, _restart_count(env), uses_agent_store=_agent_store(env),
                           local_world_size=local_world)


def resolve(environ: Mapping[str, str] | None = None) -> ClusterResolver:
    """This process's launch, read from `environ` (os.environ by default); see the module docstring."""
    env = os.environ if environ is None else environ
    if env.get("RANK") is not None:
        return _from_torchrun(env)
    tf_config = env.get("TF_CONFIG")
    if tf_config is not None and tf_config.strip():
        resolver = _from_tf_config(tf_config, env)
        if resolver is not None:
            return resolver
    if env.get("SLURM_PROCID") is not None and (env.get("SLURM_STEP_ID") or env.get("SLURM_STEPID")) is not None:
        return _from_slurm(env)
    if env.get("SLURM_PROCID") is not None and (_int(env, "SLURM_NTASKS", "") or 1) > 1:
        logger.info("SLURM_NTASKS=%s but SLURM_STEP_ID is not set: this is the batch script, not a task of "
                    "`srun`; training as a single worker (launch with `srun python script.py` to join the tasks)",
                    env.get("SLURM_NTASKS"))
    return single()


# ---- torchrun ---------------------------------------------------------------------------------------
def _from_torchrun(env: Mapping[str, str]) -> ClusterResolver:
    fix = "torchrun sets it; when launching workers yourself, give it a number"
    rank, world = _int(env, "RANK", fix), _int(env, "WORLD_SIZE", fix)
    addr, port = env.get("MASTER_ADDR") or None, _int(env, "MASTER_PORT", fix)
    missing = [k for k, v in (("WORLD_SIZE", world), ("MASTER_ADDR", addr), ("MASTER_PORT", port)) if v is None]
    if missing:
        raise ValueError(
            f"MultiWorkerMirroredStrategy: RANK={rank} is set but {', '.join(missing)} "
            f"{'is' if len(missing) == 1 else 'are'} not. Launch with torchrun (torchrun --nproc_per_node=N "
            "script.py sets them all), set RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT yourself, or unset "
            "RANK to train as a single worker.")
    if not (world >= 1 and 0 <= rank < world):
        raise ValueError(f"MultiWorkerMirroredStrategy: RANK={rank} is outside [0, WORLD_SIZE={world}). Ranks run "
                         "0..WORLD_SIZE-1, one per worker process.")
    _check_port("MASTER_PORT", port)
    if env.get("TORCHELASTIC_RUN_ID") is not None:
        kind = "torchrun"
    else:  # set by hand, or by Ray Train in its workers (which also creates the group before our strategy)
        kind = "ray" if _in_ray_worker(env) else "environment"
    local_world = _int(env, "LOCAL_WORLD_SIZE", "torchrun sets it to the number of processes on this machine")
    return ClusterResolver(kind, "worker", rank, rank, world, _local_rank(env, rank), addr, port,
                           _restart_count(env), uses_agent_store=_agent_store(env), local_world_size=local_world)


def _local_rank(env: Mapping[str, str], rank: int) -> int:
    local = _int(env, "LOCAL_RANK", "torchrun sets it to the process's index on its machine")
    return rank if local is None else local


def _restart_count(env: Mapping[str, str]) -> int:
    return _int(env, "TORCHELASTIC_RESTART_COUNT", "torchrun sets it; unset it outside torchrun") or 0


def _in_ray_worker(env: Mapping[str, str]) -> bool:
    """Whether this process is a Ray worker: Ray gives each the raylet's pid and its job's id."""
    return env.get("RAY_RAYLET_PID") is not None and env.get("RAY_JOB_ID") is not None


def _agent_store(env: Mapping[str, str]) -> bool:
    return env.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true"


def uses_agent_store() -> bool:
    """Whether torchrun's agent (not rank 0) hosts the rendezvous store of this process's job."""
    return _agent_store(os.environ)


# ---- TF_CONFIG ----------------------------------------------------------------------------------------
_TF_CONFIG_EXAMPLE = ('{"cluster": {"chief": ["host0:2222"], "worker": ["host1:2222"]}, "task": {"type": "worker", '
                      '"index": 0}}')


def _from_tf_config(text: str, env: Mapping[str, str]) -> ClusterResolver | None:
    """The worker TF_CONFIG describes; None where it names one task or none (a single worker, as TF)."""
    try:
        config = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"MultiWorkerMirroredStrategy: TF_CONFIG={text!r} is not valid JSON ({e}). Fix it, e.g. "
                         f"'{_TF_CONFIG_EXAMPLE}', or unset it.") from None
    cluster = config.get("cluster", {}) if isinstance(config, dict) else None
    task = config.get("task", {}) if isinstance(config, dict) else None
    if (not isinstance(cluster, dict) or not isinstance(task, dict)
            or not all(isinstance(a, list) and all(isinstance(x, str) for x in a) for a in cluster.values())):
        raise ValueError(f"MultiWorkerMirroredStrategy: TF_CONFIG={text!r} is not TF's layout, {_TF_CONFIG_EXAMPLE} "
                         "(cluster: task type -> list of \"host:port\"). Fix it or unset it.")
    if sum(len(addresses) for addresses in cluster.values()) <= 1:
        return None
    others = sorted(set(cluster) - set(_TF_TASK_TYPES) - {"evaluator"})
    if others:
        raise ValueError(f"MultiWorkerMirroredStrategy: TF_CONFIG's cluster has {', '.join(others)} tasks "
                         f"({text!r}); MultiWorkerMirroredStrategy trains on \"chief\" and \"worker\" tasks only "
                         "(\"ps\" belongs to ParameterServerStrategy, which mirrored does not have). Remove them.")
    if len(cluster.get("chief", [])) > 1:
        raise ValueError(f"MultiWorkerMirroredStrategy: TF_CONFIG names {len(cluster['chief'])} chiefs "
                         f"({cluster['chief']}); TF allows one. Make the others \"worker\" tasks.")
    kind, index = task.get("type"), task.get("index", 0)
    if kind == "evaluator":
        raise ValueError("MultiWorkerMirroredStrategy: TF_CONFIG's task is the \"evaluator\", which TF runs outside "
                         "the training cluster as a side loop; mirrored has no such loop. Run evaluation in a "
                         "separate program without TF_CONFIG (or with a one-task TF_CONFIG).")
    workers = [("chief", i, a) for i, a in enumerate(cluster.get("chief", []))]
    workers += [("worker", i, a) for i, a in enumerate(cluster.get("worker", []))]
    rank = next((r for r, (t, i, _) in enumerate(workers) if (t, i) == (kind, index)), None)
    if rank is None or not isinstance(index, int) or isinstance(index, bool):
        tasks = ", ".join(f"{t}: {len(a)}" for t, a in cluster.items())
        raise ValueError(f"MultiWorkerMirroredStrategy: TF_CONFIG's task {task!r} is not in its cluster ({tasks}). "
                         "Set \"task\": {\"type\": \"chief\" or \"worker\", \"index\": i} with i below the number of "
                         "tasks of that type.")
    master = workers[0][2]
    host, port = _host_port(master, f"TF_CONFIG's {workers[0][0]} 0 address {master!r}")
    rpc_layer = config.get("rpc_layer") if isinstance(config.get("rpc_layer"), str) else None
    tasks = {t: tuple(cluster[t]) for t in _TF_TASK_TYPES if cluster.get(t)}
    local_world = _int(env, "LOCAL_WORLD_SIZE", "give the number of worker processes on this machine") or 1
    return ClusterResolver("tf_config", kind, index, rank, len(workers), _local_or_zero(env), host, port,
                           _restart_count(env), rpc_layer, tasks, local_world_size=local_world)


def _local_or_zero(env: Mapping[str, str]) -> int:
    """TF_CONFIG runs one task per machine (or container); LOCAL_RANK may say otherwise."""
    return _int(env, "LOCAL_RANK", "give the process's index on its machine") or 0


def _host_port(address: str, where: str) -> tuple[str, int]:
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError(f"MultiWorkerMirroredStrategy: {where} is not \"host:port\". Give every task as "
                         "\"host:port\", e.g. \"10.0.0.1:2222\"; the first task's port is where the workers meet.")
    _check_port(where, int(port))
    return host.strip("[]"), int(port)  # "[::1]:2222" -> "::1"


# ---- SLURM -----------------------------------------------------------------------------------------------
def _from_slurm(env: Mapping[str, str]) -> ClusterResolver:
    fix = "srun sets it for each task; launch with `srun python script.py`"
    rank = _int(env, "SLURM_PROCID", fix)
    ntasks_var = "SLURM_STEP_NUM_TASKS" if env.get("SLURM_STEP_NUM_TASKS") else "SLURM_NTASKS"
    world = _int(env, ntasks_var, fix)
    if world is None:
        raise ValueError(f"MultiWorkerMirroredStrategy: SLURM_PROCID={rank} is set but SLURM_NTASKS is not; {fix} "
                         "(sbatch --ntasks=N, or srun -n N).")
    if rank is None or not (world >= 1 and 0 <= rank < world):
        raise ValueError(f"MultiWorkerMirroredStrategy: SLURM_PROCID={rank} is outside [0, {ntasks_var}={world}). "
                         "Launch the tasks with srun, which numbers them 0..N-1.")
    nodes_var = "SLURM_STEP_NODELIST" if env.get("SLURM_STEP_NODELIST") else "SLURM_JOB_NODELIST"
    nodelist = env.get(nodes_var) or env.get("SLURM_NODELIST")
    hosts = expand_hostlist(nodelist, nodes_var) if nodelist else []
    addr = env.get("MASTER_ADDR") or (hosts[0] if hosts else None)
    if addr is None:
        raise ValueError(f"MultiWorkerMirroredStrategy: SLURM task {rank} of {world}, but neither SLURM_JOB_NODELIST "
                         "nor MASTER_ADDR is set, so the first node (where the workers meet) is unknown. Launch "
                         "with srun inside an allocation, or set MASTER_ADDR to the first node's address.")
    port = _int(env, "MASTER_PORT", "give the rendezvous port")
    if port is None:
        job = _int(env, "SLURM_JOB_ID", "SLURM sets it to the job's number")
        if job is None:
            raise ValueError("MultiWorkerMirroredStrategy: under SLURM neither MASTER_PORT nor SLURM_JOB_ID is set, "
                             "so the workers cannot agree on a port. Set MASTER_PORT (e.g. 29500) for the job.")
        port = _SLURM_PORT_BASE + job % _SLURM_PORT_SPAN
    _check_port("MASTER_PORT", port)
    local = _int(env, "SLURM_LOCALID", fix)
    return ClusterResolver("slurm", "worker", rank, rank, world, 0 if local is None else local, addr, port,
                           tasks={"worker": tuple(hosts)} if hosts else {}, local_world_size=_slurm_tasks_here(env))


def _slurm_tasks_here(env: Mapping[str, str]) -> int | None:
    """The tasks of this step on this node: SLURM_STEP_TASKS_PER_NODE ("2(x3),1": 2 on each of the first
    three nodes, 1 on the fourth) at SLURM_NODEID; None where SLURM does not say."""
    variable = "SLURM_STEP_TASKS_PER_NODE" if env.get("SLURM_STEP_TASKS_PER_NODE") else "SLURM_TASKS_PER_NODE"
    text = env.get(variable)
    if not text:
        return None
    counts: list[int] = []
    for part in text.split(","):
        m = re.fullmatch(r"\s*(\d+)(?:\(x(\d+)\))?\s*", part)
        if m is None:
            raise ValueError(f"MultiWorkerMirroredStrategy: {variable}={text!r}: cannot read {part!r}. SLURM writes "
                             "it as counts with repeats, e.g. \"2(x3),1\"; unset it or fix it.")
        counts += [int(m.group(1))] * int(m.group(2) or 1)
    node = _int(env, "SLURM_NODEID", "SLURM sets it to the node's index in the step") or 0
    return counts[node] if node < len(counts) else None


def expand_hostlist(nodelist: str, variable: str = "SLURM_JOB_NODELIST") -> list[str]:
    """SLURM's compressed host list in order: "node[01-03,07],gpu5" -> node01, node02, node03, node07, gpu5
    (zero padding kept; several bracket groups in one name expand as a product)."""
    hosts: list[str] = []
    for name in _split_outside_brackets(nodelist.strip(), variable):
        expanded = [""]
        for literal, ranges in re.findall(r"([^\[\]]*)(?:\[([^\[\]]*)\])?", name):
            options = [literal]
            if ranges:
                options = [literal + n for n in _expand_ranges(ranges, nodelist, variable)]
            expanded = [head + option for head in expanded for option in options]
        hosts.extend(expanded)
    if not hosts or any(not h for h in hosts):
        raise ValueError(f"MultiWorkerMirroredStrategy: {variable}={nodelist!r} names no host. SLURM sets it inside an "
                         "allocation; set MASTER_ADDR to the first node instead.")
    return hosts


def _split_outside_brackets(text: str, variable: str) -> list[str]:
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        depth += {"[": 1, "]": -1}.get(ch, 0)
        if depth not in (0, 1):
            break
        if ch == "," and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    if depth != 0:
        raise ValueError(f"MultiWorkerMirroredStrategy: {variable}={text!r} has unbalanced brackets. SLURM writes "
                         "host lists as node[01-04,07]; fix the value or set MASTER_ADDR to the first node.")
    parts.append(text[start:])
    return [p for p in parts if p]


def _expand_ranges(ranges: str, nodelist: str, variable: str) -> list[str]:
    out = []
    for part in ranges.split(","):
        lo, sep, hi = part.partition("-")
        if not lo.isdigit() or (sep and not hi.isdigit()) or (sep and int(hi) < int(lo)):
            raise ValueError(f"MultiWorkerMirroredStrategy: {variable}={nodelist!r}: cannot read the range {part!r}. "
                             "SLURM writes ranges as 01-04 (low-high) or single numbers, separated by commas; set "
                             "MASTER_ADDR to the first node instead.")
        width = len(lo)
        out += [str(n).zfill(width) for n in range(int(lo), int(hi if sep else lo) + 1)]
    return out


# ---- shared ------------------------------------------------------------------------------------------------
def _int(env: Mapping[str, str], name: str, fix: str) -> int | None:
    value = env.get(name)
    if value is None or value == "":
        return None
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"MultiWorkerMirroredStrategy: environment variable {name}={value!r} is not an integer. "
                         f"{fix[0].upper() + fix[1:] if fix else 'Give it a number'}.") from None


def _check_port(where: str, port: int) -> None:
    if not 0 < port < 2**16:
        raise ValueError(f"MultiWorkerMirroredStrategy: {where}={port} is not a TCP port. Give one in 1..65535.")
