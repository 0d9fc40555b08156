"""Sparse gradients: gathered (indices and values concatenated, coalesced) against densified (a dense
table summed, read back at the rows touched), by the rows the replicas send against the table's rows.

    .venv/bin/python benchmarks/sparse_allreduce.py                  # threads and 2 workers (~3 min)
    .venv/bin/python benchmarks/sparse_allreduce.py --quick          # a smoke run (seconds)
    .venv/bin/python benchmarks/sparse_allreduce.py --transports workers --rows 100000 --dims 64

Each measurement is what training does: every replica sets its embedding table's sparse gradient
(`--replicas` threads of one process, or 2 worker processes on 127.0.0.1 over gloo, 1 thread each)
and calls `opt.reduce_gradients()` of a mirrored optimizer, `--reps` times, with the reducer's choice
forced one way, then the other (alternating, `--rounds` times; medians). A replica's gradient names
rows x share / replicas distinct random rows, so "share" is the rows gathered over the table's rows
(every replica's, or the workers x the most one sends: equal here), the quantity _sparse.densify()
compares with its threshold. Time is
the CPU time of the process(es) per reduction, summed over workers (a shared machine disturbs it
least; waiting is not CPU), and the wall time beside it. The ratio densified / gathered above 1 means
gathering is cheaper.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import socket
import statistics
import subprocess
import sys
import time

import torch
from torch import nn

import mirrored as mr
from mirrored._bench import machine
from mirrored.distribute import _sparse

SHARES = (0.01, 0.1, 0.3, 0.5, 0.75, 1.0, 1.5, 2.0)
MODES = ("gathered", "densified")


def force(mode: str) -> None:
    """Makes the reducer gather or densify every sparse sum, whatever the rule says."""
    at = 0.0 if mode == "densified" else math.inf
    _sparse._THREADS_DENSIFY_AT = _sparse._WORKERS_DENSIFY_AT = at


def gradient(rows: int, dim: int, named: int, seed: int) -> torch.Tensor:
    """A sparse gradient naming `named` distinct random rows of a (rows, dim) table, in random order."""
    g = torch.Generator().manual_seed(seed)
    indices = torch.randperm(rows, generator=g)[:named].unsqueeze(0)
    return torch.sparse_coo_tensor(indices, torch.randn(named, dim, generator=g), (rows, dim), check_invariants=False)


def time_reductions(strategy: mr.Strategy, rows: int, dim: int, share: float, reps: int,
                    mode: str) -> tuple[float, float]:
    """Runs reps reductions on every replica of `strategy`: the process's CPU and wall seconds for them."""
    with strategy.scope():
        table = strategy.mirror(nn.Embedding(rows, dim, sparse=True))
        opt = strategy.mirror_optimizer(torch.optim.SGD, table, lr=0.0)
    named = min(rows, max(1, round(rows * share / strategy.num_replicas_in_sync)))
    grads = [gradient(rows, dim, named, strategy.first_replica_id + r)
             for r in range(len(strategy.extended.worker_devices))]
    force(mode)

    def reduce(n: int) -> None:
        weight = table.module.weight
        mine = grads[mr.get_replica_context().local_replica_id]
        for _ in range(n):
            weight.grad = mine
            opt.reduce_gradients()
            opt.zero_grad()

    strategy.run(reduce, args=(2,))  # warm-up: buffers, the first meetings
    cpu, started = time.process_time(), time.perf_counter()
    strategy.run(reduce, args=(reps,))
    return time.process_time() - cpu, time.perf_counter() - started


def measure_threads(args: argparse.Namespace, configs: list[tuple[int, int, float]]) -> list[dict[str, list[float]]]:
    strategy = mr.MirroredStrategy(devices=[f"cpu:{i}" for i in range(args.replicas)])
    out = []
    for rows, dim, share in configs:
        got: dict[str, list[float]] = {f"{m} {k}": [] for m in MODES for k in ("cpu", "wall")}
        for _ in range(args.rounds):
            for mode in MODES:
                cpu, wall = time_reductions(strategy, rows, dim, share, args.reps, mode)
                got[f"{mode} cpu"].append(cpu / args.reps)
                got[f"{mode} wall"].append(wall / args.reps)
        out.append(got)
    return out


def worker_main(plan: str) -> None:
    """One worker process of the 2-worker measurement: every (rows, dim, share, reps, mode) of `plan`
    (JSON) in order on one strategy; prints its CPU and wall seconds for each as JSON."""
    torch.set_num_threads(1)
    strategy = mr.MultiWorkerMirroredStrategy()
    print(json.dumps([time_reductions(strategy, *config) for config in json.loads(plan)]))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def measure_workers(args: argparse.Namespace, configs: list[tuple[int, int, float]]) -> list[dict[str, list[float]]]:
    """Every config in one pair of worker processes (started once: a start costs seconds), the modes
    alternating within each round."""
    plan = [(rows, dim, share, args.reps, mode) for _ in range(args.rounds) for rows, dim, share in configs
            for mode in MODES]
    base = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR",
                                                              "MASTER_PORT", "TF_CONFIG")}
    port = free_port()
    procs = [subprocess.Popen(
        [sys.executable, __file__, "--worker", json.dumps(plan)],
        env={**base, "RANK": str(rank), "WORLD_SIZE": "2", "LOCAL_RANK": str(rank), "LOCAL_WORLD_SIZE": "2",
             "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1",
             "CUDA_VISIBLE_DEVICES": ""},
        stdout=subprocess.PIPE, text=True) for rank in range(2)]
    results = [json.loads(p.communicate(timeout=3600)[0].strip().splitlines()[-1]) for p in procs]
    if any(p.returncode for p in procs):
        raise SystemExit(f"a worker failed: exit codes {[p.returncode for p in procs]}")
    out = [{f"{m} {k}": [] for m in MODES for k in ("cpu", "wall")} for _ in configs]
    for n, (rows, dim, share, reps, mode) in enumerate(plan):
        got = out[configs.index((rows, dim, share))]
        got[f"{mode} cpu"].append(sum(r[n][0] for r in results) / reps)  # both workers' CPU
        got[f"{mode} wall"].append(max(r[n][1] for r in results) / reps)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--transports", nargs="+", default=["threads", "workers"], choices=["threads", "workers"])
    parser.add_argument("--rows", type=int, nargs="+", default=[10_000, 100_000], help="table rows")
    parser.add_argument("--dims", type=int, nargs="+", default=[16, 128], help="values per row")
    parser.add_argument("--shares", type=float, nargs="+", default=list(SHARES),
                        help="rows gathered (all replicas together) / table rows")
    parser.add_argument("--replicas", type=int, default=2, help="replica threads of the threads transport")
    parser.add_argument("--reps", type=int, default=10, help="reductions per timed run")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="tiny settings: checks the script runs")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker_main(args.worker)
        return
    if args.quick:
        args.rows, args.dims, args.shares, args.reps, args.rounds = [2000], [8], [0.1, 1.0], 2, 1
    print(machine())
    for transport in args.transports:
        measure = measure_threads if transport == "threads" else measure_workers
        who = f"{args.replicas} replica threads" if transport == "threads" else "2 workers (gloo, 1 thread each)"
        print(f"\n{who}: ms of CPU per reduction (wall), medians of {args.rounds} round(s) of {args.reps}; "
              f"load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
        print(f"  {'rows':>7} {'dim':>4} {'share':>6} {'gathered':>17} {'densified':>17} {'densified / gathered':>21}")
        configs = [(rows, dim, share) for rows in args.rows for dim in args.dims for share in args.shares]
        for (rows, dim, share), times in zip(configs, measure(args, configs)):
            got = {k: statistics.median(v) * 1e3 for k, v in times.items()}
            ratio = got["densified cpu"] / got["gathered cpu"]
            print(f"  {rows:>7} {dim:>4} {share:>6.2f} {got['gathered cpu']:>8.3f} ({got['gathered wall']:>6.2f})"
                  f" {got['densified cpu']:>8.3f} ({got['densified wall']:>6.2f}) {ratio:>21.2f}", flush=True)


if __name__ == "__main__":
    main()
