"""Images/s of `Model.fit` on N CPU replicas against a plain PyTorch loop using all cores.

    .venv/bin/python benchmarks/fit_throughput.py            # global batches 64 and 256, 2 replicas
    .venv/bin/python benchmarks/fit_throughput.py --quick

Same model (the small CIFAR ResNet, taking NCHW batches), same synthetic 32x32 data already batched
in memory (so the input pipeline is not what is timed), same global batch and optimizer. The two runs
alternate, several rounds, and the ratio of medians is printed (target: fit / plain >= 0.95).
"""
from __future__ import annotations

import argparse
import platform
import statistics
import time

import torch
import torch.nn.functional as F

import mirrored as mr
from mirrored._cpus import usable_cores


def make_data(n: int, batch: int, seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    x = torch.rand(n, 3, 32, 32, generator=g)
    y = torch.randint(0, 10, (n,), generator=g)
    return [(x[i:i + batch], y[i:i + batch]) for i in range(0, n, batch)]


def plain_loop(batches: list, threads: int) -> float:
    """Images/s of a hand-written loop: one process, `threads` intra-op threads."""
    torch.set_num_threads(threads)
    torch.manual_seed(0)
    net = mr.models.resnet_cifar(depth=20, num_classes=10, data_format="channels_first")
    opt = torch.optim.SGD(net.parameters(), lr=0.01, momentum=0.9)
    net.train()
    start = time.perf_counter()
    images = 0
    for x, y in batches:
        opt.zero_grad(set_to_none=True)
        F.cross_entropy(net(x), y).backward()
        opt.step()
        images += len(x)
    return images / (time.perf_counter() - start)


def fit_loop(batches: list, replicas: int, steps_per_execution: int) -> float:
    """Images/s of Model.fit on `replicas` logical CPU replicas over the same batches."""
    torch.manual_seed(0)
    strategy = mr.MirroredStrategy(devices=[f"cpu:{i}" for i in range(replicas)])
    with strategy.scope():
        model = mr.Model(mr.models.resnet_cifar(depth=20, num_classes=10, data_format="channels_first"))
        model.compile(optimizer=mr.optimizers.SGD(learning_rate=0.01, momentum=0.9),
                      loss="sparse_categorical_crossentropy", steps_per_execution=steps_per_execution)
    start = time.perf_counter()
    model.fit(batches, epochs=1, verbose=0)
    seconds = time.perf_counter() - start
    return sum(len(x) for x, _ in batches) / seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, nargs="+", default=[64, 256])
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--images", type=int, default=2048, help="images per timed run")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps-per-execution", type=int, default=1)
    parser.add_argument("--quick", action="store_true", help="one small round (a smoke test)")
    args = parser.parse_args()
    if args.quick:
        args.images, args.rounds = 512, 1
    cores = usable_cores()
    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")),
               platform.processor())
    print(f"machine: {cpu}, {cores} cores | python {platform.python_version()} | torch {torch.__version__}")
    print(f"model: resnet_cifar(depth=20), 32x32 inputs, {args.images} images per run, {args.rounds} rounds")
    print(f"{'global batch':>12} {'plain img/s':>12} {'fit img/s':>10} {'fit/plain':>10}")
    for batch in args.batches:
        data = make_data(args.images, batch)
        plain_loop(data[:2], cores), fit_loop(data[:2], args.replicas, args.steps_per_execution)  # warm up
        plain, ours = [], []
        for _ in range(args.rounds):
            plain.append(plain_loop(data, cores))
            ours.append(fit_loop(data, args.replicas, args.steps_per_execution))
        p, o = statistics.median(plain), statistics.median(ours)
        print(f"{batch:>12} {p:>12.1f} {o:>10.1f} {o / p:>10.3f}")


if __name__ == "__main__":
    main()
