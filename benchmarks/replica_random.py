"""What the replicas' own generators cost (issue 26): per run, per step, and per_example_random's dropout.

    .venv/bin/python benchmarks/replica_random.py            # ~2 min on 2 cores
    .venv/bin/python benchmarks/replica_random.py --quick    # a smoke run

Three comparisons on 2 CPU replicas, each pair timed in alternating samples (a busy machine hits
both alike), medians printed with the range:
  1. strategy.run(noop): with the replicas' generator mode (what every run now does) vs without it
     (the mode replaced by a null context: the cost before issue 26).
  2. A training step of resnet_cifar(depth=20) (no dropout), custom loop, global batch 64: the same
     pair; the difference is the mode's per-op dispatch through Python. 2b: the same model's forward
     and backward on one thread (batch 32), with the mode pushed or not: that cost without threads.
  3. An MLP with three nn.Dropout(0.3) on 512-wide activations, global batch 256, a training step:
     per_example_random=False (torch's bernoulli on the replica's generator, borrowed) vs True (a
     counter hash per element keyed by example).
"""
from __future__ import annotations

import argparse
import contextlib
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

import mirrored as mr
from mirrored.distribute import random as replica_random
from mirrored.distribute.random import ReplicaRandom


class _Counting(ReplicaRandom):
    """The mode, counting the calls that pass through it."""

    calls = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        _Counting.calls += 1
        return super().__torch_function__(func, types, args, kwargs)


def _median_range(samples: list[float]) -> str:
    return f"{statistics.median(samples):10.1f} ({min(samples):.1f}-{max(samples):.1f})"


def _alternate(contestants: dict[str, Callable[[], None]], samples: int, calls: int) -> dict[str, list[float]]:
    """Microseconds per call of each contestant, sampled in turn."""
    times: dict[str, list[float]] = {name: [] for name in contestants}
    for fn in contestants.values():  # warm up
        for _ in range(max(2, calls // 10)):
            fn()
    for _ in range(samples):
        for name, fn in contestants.items():
            start = time.perf_counter()
            for _ in range(calls):
                fn()
            times[name].append((time.perf_counter() - start) / calls * 1e6)
    return times


@contextlib.contextmanager
def _without_mode(strategy: mr.MirroredStrategy):
    """The strategy's runs without the replicas' generator mode (none in its place: what a step of fit
    that draws nothing runs with)."""
    del strategy  # (every strategy's: the step's randomness is decided by random.StepRandom)
    original = replica_random.StepRandom.modes
    replica_random.StepRandom.modes = lambda self, *args: None
    try:
        yield
    finally:
        replica_random.StepRandom.modes = original


def _toggled(strategy: mr.MirroredStrategy, step: Callable[[], None], with_mode: bool) -> Callable[[], None]:
    def run() -> None:
        if with_mode:
            step()
        else:
            with _without_mode(strategy):
                step()
    return run


def _train_step(strategy: mr.MirroredStrategy, net: nn.Module, batch: int, shape: tuple[int, ...],
                classes: int) -> Callable[[], None]:
    with strategy.scope():
        mnet = strategy.mirror(net)
        opt = strategy.mirror_optimizer(torch.optim.SGD, mnet, lr=0.01)
    x, y = torch.randn(batch, *shape), torch.randint(0, classes, (batch,))
    xb, yb = next(iter(strategy.experimental_distribute_dataset(mr.data.Dataset.from_tensors((x, y)))))

    def replica(xr, yr):
        loss = F.cross_entropy(mnet(xr), yr, reduction="none")
        mr.losses.compute_average_loss(loss, global_batch_size=batch).backward()
        opt.step()
        opt.zero_grad()

    return lambda: strategy.run(replica, args=(xb, yb))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=9)
    parser.add_argument("--quick", action="store_true", help="3 samples, few calls")
    args = parser.parse_args()
    samples = 3 if args.quick else args.samples
    devices = ["cpu:0", "cpu:1"]
    print(f"torch {torch.__version__}, 2 CPU replicas; microseconds per call, median (range) of {samples} samples")

    strategy = mr.MirroredStrategy(devices=devices, seed=0)
    noop = lambda: strategy.run(lambda: None)  # noqa: E731
    t = _alternate({"with": _toggled(strategy, noop, True), "without": _toggled(strategy, noop, False)},
                   samples, 50 if args.quick else 2000)
    print("\n1. strategy.run(noop)")
    print(f"  without the generator mode {_median_range(t['without'])}")
    print(f"  with the generator mode    {_median_range(t['with'])}")
    print(f"  added per run: {statistics.median(t['with']) - statistics.median(t['without']):.1f} us")

    strategy = mr.MirroredStrategy(devices=devices, seed=0)
    torch.manual_seed(0)
    step = _train_step(strategy, mr.models.resnet_cifar(depth=20, num_classes=10), 8 if args.quick else 64,
                       (32, 32, 3), 10)
    t = _alternate({"with": _toggled(strategy, step, True), "without": _toggled(strategy, step, False)},
                   samples, 1 if args.quick else 5)
    print("\n2. resnet_cifar(20) training step, global batch 64 (no dropout)")
    print(f"  without the generator mode {_median_range(t['without'])}")
    print(f"  with the generator mode    {_median_range(t['with'])}")
    print(f"  with / without: {statistics.median(t['with']) / statistics.median(t['without']):.3f}")

    # 2b. The mode's per-op cost without threads: one forward + backward on this thread, mode pushed or not.
    torch.set_num_threads(1)
    net = mr.models.resnet_cifar(depth=20, num_classes=10)
    x, y = torch.randn(8 if args.quick else 32, 32, 32, 3), torch.randint(0, 10, (8 if args.quick else 32,))
    counted = _Counting(0, 0, 0)
    with counted:
        F.cross_entropy(net(x), y).backward()

    def plain() -> None:
        F.cross_entropy(net(x), y).backward()

    def moded() -> None:
        with ReplicaRandom(0, 0, 0):
            F.cross_entropy(net(x), y).backward()

    t = _alternate({"with": moded, "without": plain}, samples * 3, 1)
    print(f"\n2b. the same forward + backward on one thread, batch {x.shape[0]} ({counted.calls} calls pass "
          "through the mode)")
    print(f"  without the generator mode {_median_range(t['without'])}")
    print(f"  with the generator mode    {_median_range(t['with'])}")
    print(f"  with / without: median {statistics.median(t['with']) / statistics.median(t['without']):.3f}, "
          f"fastest {min(t['with']) / min(t['without']):.3f}")
    tiny = torch.ones(1)
    mode = ReplicaRandom(0, 0, 0)

    def tiny_plain() -> None:
        tiny.add(1)

    def tiny_moded() -> None:
        with mode:
            for _ in range(100):
                tiny.add(1)

    t = _alternate({"with": tiny_moded, "without": lambda: [tiny_plain() for _ in range(100)]}, samples * 3,
                   20 if args.quick else 200)
    per_call = (statistics.median(t["with"]) - statistics.median(t["without"])) / 100
    print(f"  one call through the mode (a 1-element add): +{per_call:.2f} us, so ~{per_call * counted.calls:.0f} us "
          f"for these {counted.calls} calls per forward + backward")
    torch.set_num_threads(2)

    batch = 16 if args.quick else 256
    steps = {}
    for per_example in (False, True):
        s = mr.MirroredStrategy(devices=devices, seed=0, per_example_random=per_example)
        torch.manual_seed(0)
        net = nn.Sequential(nn.Linear(256, 512), nn.ReLU(), nn.Dropout(0.3), nn.Linear(512, 512), nn.ReLU(),
                            nn.Dropout(0.3), nn.Linear(512, 512), nn.ReLU(), nn.Dropout(0.3), nn.Linear(512, 10))
        steps[per_example] = _train_step(s, net, batch, (256,), 10)
    t = _alternate({"per_replica": steps[False], "per_example": steps[True]}, samples, 2 if args.quick else 20)
    print(f"\n3. MLP with 3 x Dropout(0.3) on 512 features, global batch {batch}, training step")
    print(f"  per_example_random=False   {_median_range(t['per_replica'])}")
    print(f"  per_example_random=True    {_median_range(t['per_example'])}")
    print(f"  True / False: {statistics.median(t['per_example']) / statistics.median(t['per_replica']):.3f}")


if __name__ == "__main__":
    main()
