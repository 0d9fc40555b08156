"""Gradient all-reduce between CPU replicas, as a ratio to the memory-bound floor, and the cost of `run`.

    .venv/bin/python benchmarks/allreduce.py                      # 1-100 MB, 2 and 4 replicas (~2 min)
    .venv/bin/python benchmarks/allreduce.py --quick              # 1 and 16 MB, 2 replicas
    .venv/bin/python benchmarks/allreduce.py --sizes 16,64 --replicas 2 --repeats 9
    .venv/bin/python benchmarks/allreduce.py --tune-malloc        # glibc keeps freed memory

The all-reduce is timed the way training does it: inside `strategy.run`, every replica reduces its
gradients, either with `opt.reduce_gradients()` of a mirrored optimizer (what `opt.step()` does
first) or with `mr.get_replica_context().all_reduce(SUM, tensors)`. The gradients are float32, one
big tensor or the 161 tensors of a ResNet-50 whose widths are scaled to the size. The cost of a
`run` doing everything but the reduction (the same function without its reduce call) is subtracted.

The floor is what summing N buffers must cost at least: N-1 passes of `torch.add(a, b, out=c)`
over the same bytes, in the main thread with all cores. Measurements alternate (floor, empty run,
reduce_gradients, all_reduce, floor, ...); each repeat gives a ratio, and the median is printed.
Target: ratio <= 2. Small sizes sit in cache, where the fixed cost of a rendezvous dominates.
reduce_gradients allocates nothing; ctx.all_reduce returns new tensors, and with glibc's default
malloc those are fresh pages (page faults) above a few MB: --tune-malloc runs everything after
`mr.tune_allocator()`, as `mirrored train` does (tensors above 32 MB are fresh pages either way).
The floor is also timed on one core, as a check: when other processes hold the cores, every
multi-threaded add waits for them, the all-core floor comes out slower than one core's, and the
row is marked * (its ratio then means little).
"""
from __future__ import annotations

import argparse
import gc
import math
import os
import platform
import queue
import statistics
import threading
import time
from collections.abc import Callable

import torch
from torch import nn

import mirrored as mr
from mirrored._cpus import usable_cores

MB = 2**20  # sizes are in MiB; "100 MB" of float32 is 26.2M values (ResNet-50 has 25.6M)
_TARGET_RATIO = 2.0
_SAMPLE_S = 0.04  # each timing sample repeats a call until it lasts this long: steadier than one call
_NOOP_CALLS = 2000
_NOISY_SPREAD = 1.5  # a row whose slowest floor or reduce_gradients sample is this much above its fastest gets a *
# ... and so does one whose all-core floor is this much slower than on one core: another process holds
# a core, and every multi-threaded add waits for it (the floor, so the ratio, is then far off).
_STALLED_FLOOR = 1.25


# ---- what is measured ---------------------------------------------------------------------------

def resnet50_like_shapes(target_bytes: int) -> list[torch.Size]:
    """ResNet-50's 161 parameter shapes with every channel count scaled by one width factor, chosen so
    the float32 total is as close to `target_bytes` as the rounding of channel counts allows."""
    with torch.device("meta"):  # shapes only: no memory, no init
        base = [p.shape for p in mr.models.resnet50(num_classes=1000).parameters()]

    def scaled(width: float) -> list[torch.Size]:
        out = []
        for s in base:
            channels = [max(1, round(d * width)) for d in s[:2]]
            out.append(torch.Size(channels + list(s[2:])))
        return out

    lo, hi = 1e-3, 8.0
    for _ in range(60):  # bisection: total size grows with the width
        mid = (lo + hi) / 2
        if 4 * sum(s.numel() for s in scaled(mid)) < target_bytes:
            lo = mid
        else:
            hi = mid
    return min((scaled(lo), scaled(hi)), key=lambda ss: abs(4 * sum(s.numel() for s in ss) - target_bytes))


class GradientHolder(nn.Module):
    """A module that is nothing but parameters of the given shapes (their gradients get reduced)."""

    def __init__(self, shapes: list[torch.Size]):
        super().__init__()
        self.weights = nn.ParameterList(nn.Parameter(torch.zeros(s)) for s in shapes)


def time_per_call(fn: Callable[[], object], calls: int) -> float:
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - start) / calls


def calls_for(fn: Callable[[], object], sample_s: float) -> int:
    """Warms `fn` up and returns how many calls make one sample of about `sample_s` seconds."""
    fn()
    one = time_per_call(fn, 2)
    return max(1, math.ceil(sample_s / max(one, 1e-7)))


def alternate(fns: dict[str, Callable[[], object]], repeats: int, sample_s: float,
              calls: int | None = None) -> dict[str, list[float]]:
    """Seconds per call of each fn, `repeats` samples each, taken in turn (a, b, c, a, b, c, ...)
    so that a slow spell of the machine hits all of them alike. A sample is `calls` calls, or as
    many as last about `sample_s` seconds."""
    if calls is None:
        counts = {name: calls_for(fn, sample_s) for name, fn in fns.items()}
    else:
        for fn in fns.values():
            time_per_call(fn, max(1, calls // 10))  # warm-up: starts replica threads, builds buffers
        counts = {name: calls for name in fns}
    samples: dict[str, list[float]] = {name: [] for name in fns}
    gc.collect()
    gc.disable()  # a collection inside one sample would be charged to whichever fn was running
    try:
        for _ in range(repeats):
            for name, fn in fns.items():
                samples[name].append(time_per_call(fn, counts[name]))
    finally:
        gc.enable()
    return samples


def strategy_of(replicas: int) -> mr.MirroredStrategy:
    return mr.MirroredStrategy(devices=[f"cpu:{i}" for i in range(replicas)])


# ---- the two tables ------------------------------------------------------------------------------

def run_overhead(repeats: int, replica_counts: list[int]) -> None:
    """Microseconds per `strategy.run(noop)` against a bare Python call of the same function."""
    def noop() -> None:
        return None

    strategies = {n: strategy_of(n) for n in replica_counts}
    to_thread, from_thread = queue.SimpleQueue(), queue.SimpleQueue()

    def echo() -> None:
        while (item := to_thread.get()) is not None:
            from_thread.put(item)

    def round_trip() -> None:  # what one hand-off to a thread and back costs on this machine
        to_thread.put(1)
        from_thread.get()

    echo_thread = threading.Thread(target=echo, daemon=True)
    echo_thread.start()
    fns: dict[str, Callable[[], object]] = {"bare call": noop, "thread round trip": round_trip}
    for n, s in strategies.items():
        fns[f"run, {n} replica{'s' if n > 1 else ''}"] = lambda s=s: s.run(noop)
    samples = alternate(fns, repeats, 0.0, calls=_NOOP_CALLS)
    to_thread.put(None)
    echo_thread.join()
    bare = statistics.median(samples["bare call"])
    print("strategy.run(noop) per step (median of %d samples of %d calls)" % (repeats, _NOOP_CALLS))
    print(f"  {'':<20}{'us/step':>10}{'x bare call':>14}")
    for name, values in samples.items():
        t = statistics.median(values)
        print(f"  {name:<20}{t * 1e6:>10.2f}{t / bare:>14.0f}")
    print("  (thread round trip: a queue put to another Python thread and its reply, the least a hand-off costs)")
    print()


def allreduce_row(replicas: int, layout: str, size_mb: float, repeats: int, sample_s: float) -> dict:
    """Times floor, empty runs, reduce_gradients and ctx.all_reduce for one configuration."""
    target = int(size_mb * MB)
    shapes = [torch.Size([target // 4])] if layout == "one" else resnet50_like_shapes(target)
    numel = sum(s.numel() for s in shapes)
    strategy = strategy_of(replicas)
    with strategy.scope():
        mnet = strategy.mirror(GradientHolder(shapes))
        opt = strategy.mirror_optimizer(torch.optim.SGD, mnet, lr=0.0)
    gen = torch.Generator().manual_seed(0)
    # What backward would hand each replica: tensors of their own, not views of the reduction buffers.
    # Zeros, because reduce_gradients sums large gradients in place (as DDP does), so every call sums
    # the same tensors again: zeros stay zeros, where random values would double each call up to inf.
    # (A float add costs the same whatever the values; the floor adds random ones.)
    grads = [[torch.zeros(s) for s in shapes] for _ in range(replicas)]
    params = [list(m.parameters()) for m in mnet.replicas]

    def set_grads() -> None:
        rid = mr.get_replica_context().replica_id_in_sync_group
        for p, g in zip(params[rid], grads[rid]):
            p.grad = g

    def reduce_gradients() -> None:
        set_grads()
        opt.reduce_gradients()

    def pick_tensors() -> list[torch.Tensor]:
        return grads[mr.get_replica_context().replica_id_in_sync_group]

    def all_reduce() -> None:
        mr.get_replica_context().all_reduce(mr.ReduceOp.SUM, pick_tensors())

    a, b, c = (torch.randn(numel, generator=gen) for _ in range(3))

    def floor() -> None:
        for _ in range(replicas - 1):
            torch.add(a, b, out=c)

    def floor_one_thread() -> None:  # a check only: all cores must not be slower than one
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            floor()
        finally:
            torch.set_num_threads(threads)

    samples = alternate({
        "floor": floor,
        "floor_1t": floor_one_thread,
        "empty_rg": lambda: strategy.run(set_grads),
        "rg": lambda: strategy.run(reduce_gradients),
        "empty_ar": lambda: strategy.run(pick_tensors),
        "ar": lambda: strategy.run(all_reduce),
    }, repeats, sample_s)
    strategy.check_in_sync(mnet)  # lr=0: nothing moved, but the reduction must not have broken the copies
    med = {k: statistics.median(v) for k, v in samples.items()}
    ratios = {
        m: statistics.median((t - e) / f for t, e, f in zip(samples[m], samples[f"empty_{m}"], samples["floor"]))
        for m in ("rg", "ar")}
    noisy = (any(max(v) > _NOISY_SPREAD * min(v) for k, v in samples.items() if k in ("floor", "rg"))
             or med["floor"] > _STALLED_FLOOR * med["floor_1t"])
    return {"replicas": replicas, "layout": layout, "mb": 4 * numel / MB, "tensors": len(shapes), "med": med,
            "ratios": ratios, "noisy": noisy}


def print_rows(rows: list[dict]) -> None:
    # "empty us" is each method's run without its reduce call: reduce_gradients' also sets every .grad.
    head = (f"{'repl':>4} {'gradients':<17}{'MB':>7} {'floor ms':>9} {'empty us rg/ar':>15} "
            f"{'reduce_gradients ms':>20} {'ratio':>6} {'ctx.all_reduce ms':>18} {'ratio':>6}")
    print(head)
    print("-" * len(head))
    for r in rows:
        med = r["med"]
        label = "1 tensor" if r["layout"] == "one" else f"{r['tensors']} (ResNet-50)"
        net_rg, net_ar = med["rg"] - med["empty_rg"], med["ar"] - med["empty_ar"]
        empty = f"{med['empty_rg'] * 1e6:.0f}/{med['empty_ar'] * 1e6:.0f}"
        print(f"{r['replicas']:>4} {label:<17}{r['mb']:>7.2f} {med['floor'] * 1e3:>9.3f} {empty:>15} "
              f"{net_rg * 1e3:>20.3f} {r['ratios']['rg']:>6.2f} {net_ar * 1e3:>18.3f} {r['ratios']['ar']:>6.2f}"
              f"{' *' if r['noisy'] else ''}")
    if any(r["noisy"] for r in rows):
        print(f"* the machine was busy: samples of the floor or of reduce_gradients varied by more than "
              f"{_NOISY_SPREAD:g}x, or the all-core floor was over {_STALLED_FLOOR:g}x slower than one core's. "
              "Rerun on a quiet machine.")


def machine() -> str:
    model = platform.processor() or "unknown CPU"
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    model = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return (f"{model}; {usable_cores()} usable cores ({os.cpu_count()} online); torch {torch.__version__} with "
            f"{torch.get_num_threads()} intra-op threads in the main thread; python {platform.python_version()}; "
            f"mirrored {mr.__version__}")


def load() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg()) if hasattr(os, "getloadavg") else "n/a"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", help="gradient sizes in MB, comma-separated (default 1,4,16,64,100)")
    parser.add_argument("--replicas", help="replica counts, comma-separated (default 2,4)")
    parser.add_argument("--repeats", type=int, help="samples per measurement, the median is kept (default 7)")
    parser.add_argument("--quick", action="store_true",
                        help="defaults of 1,16 MB, 2 replicas, 3 repeats and shorter samples (flags still win)")
    parser.add_argument("--tune-malloc", action="store_true",
                        help="keep freed memory in glibc's heaps (mr.tune_allocator(), as `mirrored train` does)")
    args = parser.parse_args()
    if args.tune_malloc and not mr.tune_allocator():
        raise SystemExit("--tune-malloc: this is not glibc; run without it.")
    defaults = ("1,16", "2", 3) if args.quick else ("1,4,16,64,100", "2,4", 7)
    sizes = [float(s) for s in (args.sizes or defaults[0]).split(",")]
    replica_counts = [int(n) for n in (args.replicas or defaults[1]).split(",")]
    repeats = args.repeats if args.repeats is not None else defaults[2]
    sample_s = _SAMPLE_S / 2 if args.quick else _SAMPLE_S
    if repeats < 1 or any(n < 2 for n in replica_counts) or any(s <= 0 for s in sizes):
        parser.error("--repeats must be >= 1, --replicas >= 2 each, --sizes > 0 each")

    print(machine() + f"; glibc malloc {'tuned' if args.tune_malloc else 'default'}")
    print(f"load average before: {load()}  (other processes on these cores stall multi-threaded ops: "
          "compare runs on a quiet machine)")
    print()
    run_overhead(repeats, sorted({1, 2, 4} | set(replica_counts)))
    start = time.perf_counter()
    rows = []
    for replicas in replica_counts:
        for size in sizes:
            for layout in ("one", "list"):
                rows.append(allreduce_row(replicas, layout, size, repeats, sample_s))
                gc.collect()  # drops the strategy: its threads and buffers go before the next row
    print(f"All-reduce of float32 gradients inside strategy.run, net of an empty run (medians of {repeats} "
          f"alternating samples; ratio = net time / floor, target <= {_TARGET_RATIO:g})")
    print("floor: (replicas - 1) x torch.add(a, b, out=c) over the same bytes, main thread, all cores")
    print_rows(rows)
    worst = max(max(r["ratios"].values()) for r in rows)
    within = sum(r["ratios"]["rg"] <= _TARGET_RATIO for r in rows)
    flagged = sum(r["noisy"] for r in rows)
    print(f"\nreduce_gradients within {_TARGET_RATIO:g}x of the floor in {within} of {len(rows)} rows ({flagged} "
          "flagged *); "
          f"worst ratio of either method {worst:.2f}; {time.perf_counter() - start:.0f} s; load average after: "
          f"{load()}")


if __name__ == "__main__":
    main()
