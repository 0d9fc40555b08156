"""What one `strategy.run` costs beyond its function: a no-op on 1, 2 and 4 CPU replicas, and its pieces.

    .venv/bin/python benchmarks/run_overhead.py                 # ~1 min on 2 cores
    .venv/bin/python benchmarks/run_overhead.py --quick         # a few seconds (a smoke run)
    .venv/bin/python benchmarks/run_overhead.py --samples 41 --calls 2000

Whole calls: `strategy.run(noop)`, timed in samples of `--calls` calls, the configurations taken in
turn (1, 2, 4 replicas, the floors, 1, 2, 4, ...) so that a slow spell of a shared machine hits them
all alike; printed as the median and the range (fastest-slowest sample) in microseconds per call.

Floors, in the same rotation: a bare Python call of the no-op; the hand-off floor, the least any
design with one thread per replica pays (the caller opens a raw lock per thread, each thread takes
its lock and the last one done opens the caller's; no Python beyond that); and `ReplicaPool.run` of
a task that does nothing (hand-off plus the pool's bookkeeping, without the strategy's checks).

Pieces: each part of the strategy's side of a run, timed alone on the caller's thread (they run
under the GIL, so on the replica threads they add up in series): the entry checks (nesting, PerReplica
lengths, how arguments are split), the per-step rendezvous and rollback journals, the caller's
grad/autocast modes, the guard against shared torch state, one replica's wrapper around fn (its
context, modes, arguments, finish), and regrouping the results; measured on 2 replicas. Last, a
2-replica run's median is split into wake-ups (the floor), the pool's bookkeeping (ReplicaPool.run
less the floor) and the strategy's share (run less ReplicaPool.run).
"""
from __future__ import annotations

import _thread
import argparse
import gc
import os
import platform
import statistics
import threading
import time
import warnings
from collections.abc import Callable

import torch

import mirrored as mr
from mirrored.distribute import _run_path, context, replicas, rollback

_TARGET_US = 50.0  # issue 15: a no-op run on 2 replicas


def noop() -> None:
    return None


def strategy_of(replicas_: int) -> mr.MirroredStrategy:
    with warnings.catch_warnings():  # 4 CPU replicas on 2 cores warn; measuring them is the point
        warnings.simplefilter("ignore")
        return mr.MirroredStrategy(devices=[f"cpu:{i}" for i in range(replicas_)])


class HandOffFloor:
    """N threads woken by raw locks, the last to finish wakes the caller: the least a fan-out costs.
    With caller_is_replica_0, the caller does replica 0's part itself and wakes N - 1 threads (the
    design strategy.run does not use: see RESULTS.md)."""

    def __init__(self, n: int, caller_is_replica_0: bool = False):
        self.n = n
        self.caller_part = caller_is_replica_0
        if caller_is_replica_0:
            n -= 1
        self.go = [self._closed() for _ in range(n)]
        self.done = self._closed()
        self.mutex = _thread.allocate_lock()
        self.pending = 0
        self.threads = [threading.Thread(target=self._loop, args=(i,), daemon=True) for i in range(n)]
        self.stopping = False
        for t in self.threads:
            t.start()

    @staticmethod
    def _closed() -> object:
        lock = _thread.allocate_lock()
        lock.acquire()
        return lock

    def _loop(self, i: int) -> None:
        while True:
            self.go[i].acquire()
            if self.stopping:
                return
            self._finish()

    def _finish(self) -> None:
        with self.mutex:
            self.pending -= 1
            if self.pending == 0:
                self.done.release()

    def __call__(self) -> None:
        self.pending = self.n
        for g in self.go:
            g.release()
        if self.caller_part:
            self._finish()
        self.done.acquire()

    def stop(self) -> None:
        self.stopping = True
        for g in self.go:
            g.release()
        for t in self.threads:
            t.join(timeout=5)


def time_per_call(fn: Callable[[], object], calls: int) -> float:
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - start) / calls


def alternate(fns: dict[str, Callable[[], object]], samples: int, calls: int) -> dict[str, list[float]]:
    """Seconds per call of each fn: `samples` samples of `calls` calls each, taken in turn."""
    for fn in fns.values():
        time_per_call(fn, max(1, calls // 5))  # warm-up: starts replica threads
    out: dict[str, list[float]] = {name: [] for name in fns}
    gc.collect()
    gc.disable()  # a collection inside one sample would be charged to whichever fn was running
    try:
        for _ in range(samples):
            for name, fn in fns.items():
                out[name].append(time_per_call(fn, calls))
    finally:
        gc.enable()
    return out


# ---- the pieces of a run, each alone on the caller's thread -------------------------------------------
def pieces(strategy: mr.MirroredStrategy) -> dict[str, Callable[[], object]]:
    """One callable per piece of `strategy.run(noop)`'s own work (2 replicas), calling what run() calls."""
    devices = strategy.extended.worker_devices
    args: tuple = ()
    kwargs: dict = {}
    step = replicas.Rendezvous(devices, 300.0)
    journals = [rollback.StepJournal() for _ in devices]

    def entry_checks() -> None:  # before handing out: nesting (no frame here), PerReplica lengths
        context._current()
        _run_path._argument_split(args, kwargs, len(devices))

    def rendezvous() -> None:
        replicas.Rendezvous(devices, 300.0)

    def journals_() -> None:
        [rollback.StepJournal() for _ in devices]

    def guard() -> None:
        with strategy._guard(noop):
            pass

    random_modes = strategy._begin_random(noop, mr.RunOptions()).modes(0, len(devices), None)
    task = strategy._replica_task(noop, args, kwargs, _run_path._SHARED, step, journals, (), random_modes)

    def replica_wrapper() -> None:  # the task a replica thread runs around fn, with fn a no-op
        step._done.clear()  # (as if a new step: finish() refuses a replica that finished already)
        task(0)

    def results() -> None:
        _run_path._run_result([None] * len(devices))

    return {"entry checks, arguments": entry_checks, "rendezvous": rendezvous, "rollback journals": journals_,
            "caller modes": _run_path._caller_modes, "shared-state guard": guard,
            "replica wrapper (x1)": replica_wrapper, "regroup results": results}


def pool_floor(n: int) -> tuple[Callable[[], object], Callable[[], None]]:
    pool = replicas.ReplicaPool([f"cpu:{i}" for i in range(n)], 1)

    def call() -> None:
        pool.run(lambda replica_id: None, grace_s=300.0)
    return call, pool.shutdown


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=41, help="samples per configuration (default 41)")
    parser.add_argument("--calls", type=int, default=500, help="calls per sample (default 500)")
    parser.add_argument("--replicas", default="1,2,4", help="replica counts (default 1,2,4)")
    parser.add_argument("--quick", action="store_true", help="5 samples of 200 calls")
    parser.add_argument("--no-pieces", action="store_true",
                        help="whole calls only (they use only public names: the way to time an older checkout)")
    args = parser.parse_args()
    samples, calls = (5, 200) if args.quick else (args.samples, args.calls)
    counts = [int(c) for c in args.replicas.split(",")]

    load = os.getloadavg() if hasattr(os, "getloadavg") else (float("nan"),) * 3
    print(f"{platform.node()}: {os.cpu_count()} CPUs, Python {platform.python_version()}, torch {torch.__version__}, "
          f"load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}")
    torch.set_num_threads(1)
    strategies = {n: strategy_of(n) for n in counts}
    floors = {n: HandOffFloor(n) for n in counts if n > 1}
    inline_floors = {n: HandOffFloor(n, caller_is_replica_0=True) for n in counts if n > 1}
    pools = {n: pool_floor(n) for n in counts if n > 1}
    fns: dict[str, Callable[[], object]] = {"bare call": noop}
    for n in counts:
        fns[f"run, {n} replica{'s' if n > 1 else ''}"] = (lambda s=strategies[n]: s.run(noop))
        if n > 1:
            fns[f"hand-off floor, {n} threads"] = floors[n]
            fns[f"hand-off floor, caller + {n - 1}"] = inline_floors[n]
            fns[f"ReplicaPool.run, {n} threads"] = pools[n][0]
    measured = alternate(fns, samples, calls)
    for floor in [*floors.values(), *inline_floors.values()]:
        floor.stop()
    for _, stop in pools.values():
        stop()

    print(f"\nWhole calls: us per call, {samples} samples of {calls} calls, configurations in turn")
    print(f"  {'':<28}{'median':>9}{'fastest':>9}{'slowest':>9}")
    for name, values in measured.items():
        us = [v * 1e6 for v in values]
        print(f"  {name:<28}{statistics.median(us):>9.1f}{min(us):>9.1f}{max(us):>9.1f}")
    if 2 in counts:
        two = statistics.median(measured["run, 2 replicas"]) * 1e6
        print(f"  run on 2 replicas: median {two:.1f} us, target < {_TARGET_US:g} us: "
              f"{'met' if two < _TARGET_US else 'NOT met'}")

    if 2 in counts and not args.no_pieces:
        parts = alternate(pieces(strategies[2]), samples, calls * 10)
        print(f"\nPieces of a 2-replica run, each alone on the caller's thread (us per call, median of {samples})")
        for name, values in parts.items():
            print(f"  {name:<28}{statistics.median(values) * 1e6:>9.2f}")
        wrapper = statistics.median(parts["replica wrapper (x1)"])
        total = sum(statistics.median(v) for k, v in parts.items() if k != "replica wrapper (x1)") + 2 * wrapper
        print(f"  {'sum (wrapper x2)':<28}{total * 1e6:>9.2f}")
        # The fastest samples: on a shared machine a median also holds the time the threads waited for
        # a core (whatever else runs decides it), which a subtraction of medians cannot attribute.
        run, pool, floor = (min(measured[k]) * 1e6 for k in (
            "run, 2 replicas", "ReplicaPool.run, 2 threads", "hand-off floor, 2 threads"))
        print("Where a 2-replica run's time goes (fastest samples of the whole calls above)")
        print(f"  {'wake-ups (hand-off floor)':<28}{floor:>9.1f}")
        print(f"  {'pool bookkeeping':<28}{pool - floor:>9.1f}   (ReplicaPool.run - floor)")
        print(f"  {'strategy (pieces, GIL)':<28}{run - pool:>9.1f}   (run - ReplicaPool.run; the pieces sum above)")
    if hasattr(os, "getloadavg"):
        print(f"\nload average after: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
