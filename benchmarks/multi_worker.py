"""2 workers x 1 CPU replica vs 1 worker x 2 replicas vs PyTorch DDP, on the same global batches.

    .venv/bin/python benchmarks/multi_worker.py                   # resnet_cifar(20), batch 64, 3 rounds
    .venv/bin/python benchmarks/multi_worker.py --batch 256 --steps 10 --rounds 5

Each contestant trains resnet_cifar (32x32 inputs, SGD with momentum) in a custom loop for `--steps`
timed steps after 3 warm-up steps, on the same global batch, with 2 intra-op threads in all:
- `2 workers x 1`: MultiWorkerMirroredStrategy in 2 processes on 127.0.0.1 (gloo), 1 thread each;
- `1 worker x 2`: MultiWorkerMirroredStrategy(devices=["cpu:0", "cpu:1"]) in one process: two
  replica threads, 1 intra-op thread each, summed in memory (no launch: a single worker);
- `DDP`: torch's DistributedDataParallel in 2 processes (gloo), 1 thread each, the plain recipe.
Contestants alternate within each round (a loaded machine slows them alike); the median images/s
over rounds is printed with each one's ratio to DDP.
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

WARMUP_STEPS = 3
CONTESTANTS = ("2 workers x 1", "1 worker x 2", "DDP")


def batches(global_batch: int, steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(global_batch, 32, 32, 3, generator=g)  # NHWC, resnet_cifar's default layout
    y = torch.randint(0, 10, (global_batch,), generator=g)
    return [(x, y)] * steps


def run_mirrored(global_batch: int, steps: int, depth: int, devices: list[str]) -> float:
    """Seconds for `steps` steps of the custom loop under MultiWorkerMirroredStrategy."""
    import mirrored as mr

    strategy = mr.MultiWorkerMirroredStrategy(devices=devices)
    with strategy.scope():
        net = strategy.mirror(mr.models.resnet_cifar(depth=depth))
        opt = strategy.mirror_optimizer(torch.optim.SGD, net, lr=0.1, momentum=0.9)

    def step(x, y):
        loss = F.cross_entropy(net(x), y, reduction="sum") / global_batch
        loss.backward()
        opt.step()
        opt.zero_grad()

    data = list(strategy.experimental_distribute_dataset(batches(global_batch, WARMUP_STEPS + steps)))
    for x, y in data[:WARMUP_STEPS]:
        strategy.run(step, args=(x, y))
    barrier = lambda: strategy.reduce("sum", strategy.run(lambda: torch.ones(1)))  # noqa: E731
    barrier()  # every worker starts the clock together
    started = time.perf_counter()
    for x, y in data[WARMUP_STEPS:]:
        strategy.run(step, args=(x, y))
    barrier()
    return time.perf_counter() - started


def run_ddp(global_batch: int, steps: int, depth: int) -> float:
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    import mirrored as mr

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    net = DistributedDataParallel(mr.models.resnet_cifar(depth=depth))
    opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    part = global_batch // world
    data = [(x[rank * part:(rank + 1) * part], y[rank * part:(rank + 1) * part])
            for x, y in batches(global_batch, WARMUP_STEPS + steps)]

    def step(x, y):
        F.cross_entropy(net(x), y).backward()
        opt.step()
        opt.zero_grad()

    for x, y in data[:WARMUP_STEPS]:
        step(x, y)
    dist.barrier()
    started = time.perf_counter()
    for x, y in data[WARMUP_STEPS:]:
        step(x, y)
    dist.barrier()
    return time.perf_counter() - started


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(role: str, args: argparse.Namespace, processes: int, threads: int) -> float:
    """Runs this script as `role` in `processes` processes; rank 0's seconds."""
    port = free_port()
    base = {k: v for k, v in os.environ.items()
            if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "TF_CONFIG")
            and not k.startswith(("TORCHELASTIC_", "SLURM_"))}
    procs = []
    for rank in range(processes):
        env = {**base, "OMP_NUM_THREADS": str(threads), "CUDA_VISIBLE_DEVICES": ""}
        if processes > 1:
            env.update(RANK=str(rank), WORLD_SIZE=str(processes), LOCAL_RANK=str(rank),
                       LOCAL_WORLD_SIZE=str(processes), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        procs.append(subprocess.Popen([sys.executable, __file__, "--role", role, "--batch", str(args.batch),
                                       "--steps", str(args.steps), "--depth", str(args.depth)], env=env,
                                      stdout=subprocess.PIPE, text=True))
    outputs = [p.communicate(timeout=600)[0] for p in procs]
    if any(p.returncode for p in procs):
        raise SystemExit(f"{role} failed: exit codes {[p.returncode for p in procs]}")
    return json.loads(outputs[0].strip().splitlines()[-1])["seconds"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=64, help="the global batch")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--depth", type=int, default=20, help="resnet_cifar's depth (6n+2)")
    parser.add_argument("--role", choices=("mw", "local", "ddp"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.role is not None:  # one contestant's process
        torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
        if args.role == "ddp":
            seconds = run_ddp(args.batch, args.steps, args.depth)
        else:
            devices = ["cpu:0"] if args.role == "mw" else ["cpu:0", "cpu:1"]
            seconds = run_mirrored(args.batch, args.steps, args.depth, devices)
        print(json.dumps({"seconds": seconds}))
        return
    roles = {"2 workers x 1": ("mw", 2, 1), "1 worker x 2": ("local", 1, 2), "DDP": ("ddp", 2, 1)}
    rates: dict[str, list[float]] = {name: [] for name in CONTESTANTS}
    for r in range(args.rounds):
        for name in CONTESTANTS:
            seconds = launch(*roles[name][:1], args, *roles[name][1:])
            rates[name].append(args.batch * args.steps / seconds)
        print(f"round {r + 1}: " + ", ".join(f"{n} {rates[n][-1]:.1f} img/s" for n in CONTESTANTS), flush=True)
    ddp = statistics.median(rates["DDP"])
    print(f"\nresnet_cifar({args.depth}), global batch {args.batch}, {args.steps} steps, {args.rounds} rounds "
          f"(medians), torch {torch.__version__}, {os.cpu_count()} CPUs")
    print(f"{'contestant':<16} {'img/s':>8} {'/ DDP':>7}")
    for name in CONTESTANTS:
        median = statistics.median(rates[name])
        print(f"{name:<16} {median:>8.1f} {median / ddp:>7.3f}")


if __name__ == "__main__":
    main()
