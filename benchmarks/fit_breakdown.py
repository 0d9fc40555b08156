"""Where the time of one `Model.fit` step on N CPU replicas goes, against one replica's step alone.

    .venv/bin/python benchmarks/fit_breakdown.py                    # global batch 64, 2 replicas
    .venv/bin/python benchmarks/fit_breakdown.py --batch 256 --rounds 5

Three runs alternate, each round, on the same synthetic batches as fit_throughput.py's:
  alone    one replica's work (its per-replica batch, 1 intra-op thread, a plain torch loop)
  threads  N plain torch loops, one per Python thread (1 intra-op thread each), never meeting: what
           the GIL and shared cores cost by themselves
  fit      mr.Model.fit on N CPU replicas, its parts timed by wrapping the methods named below
Each replica thread's step time is split into time on a CPU, time runnable but waiting for one
(the machine's other load), and time asleep (the GIL, or a meeting of the replicas), from Linux's
/proc/thread-self/schedstat. Printed: medians over rounds of ms per step per replica thread.
The wrappers cost a few us per call; the unwrapped fit step is printed beside the wrapped one.
"""
from __future__ import annotations

import argparse
import collections
import functools
import statistics
import threading
import time
from typing import Any

import torch
import torch.nn.functional as F

import mirrored as mr
from mirrored.distribute import cross_device_ops, optimizer as mirrored_optimizer, replicas, rollback
from mirrored._bench import load, machine, make_data, make_net
from mirrored.training import losses, model as model_lib

_WARMUP_STEPS = 2
_PLAIN_PARTS = ("forward + loss", "backward", "optimizer step", "zero_grad")  # the plain loop's timed parts


def _schedstat() -> tuple[float, float]:
    """(seconds on a CPU, seconds runnable but waiting for one) of the calling thread."""
    with open("/proc/thread-self/schedstat") as f:
        on_cpu, waiting, _ = f.read().split()
    return int(on_cpu) / 1e9, int(waiting) / 1e9


class Timers:
    """Wall and thread-CPU seconds per (thread kind, part), summed over the timed steps."""

    def __init__(self) -> None:
        self.total: dict[tuple[str, str], float] = collections.defaultdict(float)
        self.cpu: dict[tuple[str, str], float] = collections.defaultdict(float)  # thread CPU seconds
        self.on = False
        self._undo: list[tuple[Any, str, Any]] = []

    def add(self, part: str, seconds: float, cpu_seconds: float | None = None) -> None:
        if self.on:
            who = "main" if threading.current_thread() is threading.main_thread() else "replica"
            self.total[(who, part)] += seconds
            if cpu_seconds is not None:
                self.cpu[(who, part)] += cpu_seconds

    def wrap(self, owner: Any, name: str, part: str) -> None:
        owner = next(c for c in owner.__mro__ if name in c.__dict__)  # the class that defines it
        original = owner.__dict__[name]

        @functools.wraps(original)
        def timed(*args: Any, **kwargs: Any) -> Any:
            start, cpu = time.perf_counter(), time.thread_time()
            try:
                return original(*args, **kwargs)
            finally:
                self.add(part, time.perf_counter() - start, time.thread_time() - cpu)

        setattr(owner, name, timed)
        self._undo.append((owner, name, original))

    def wrap_step(self, owner: Any, name: str) -> None:
        """The replica's whole step, split by schedstat into on-CPU, runnable, asleep."""
        owner = next(c for c in owner.__mro__ if name in c.__dict__)  # the class that defines it
        original = owner.__dict__[name]

        @functools.wraps(original)
        def timed(*args: Any, **kwargs: Any) -> Any:
            start, (cpu, runnable) = time.perf_counter(), _schedstat()
            try:
                return original(*args, **kwargs)
            finally:
                cpu2, runnable2 = _schedstat()
                _split(self, time.perf_counter() - start, cpu2 - cpu, runnable2 - runnable)

        setattr(owner, name, timed)
        self._undo.append((owner, name, original))

    def undo(self) -> None:
        for owner, name, original in reversed(self._undo):
            setattr(owner, name, original)
        self._undo.clear()


def _split(timers: Timers, wall: float, on_cpu: float, runnable: float) -> None:
    """A step's wall time: on a CPU, runnable but waiting for one, and asleep (the rest)."""
    timers.add("step", wall, on_cpu)
    timers.add("  on a CPU", on_cpu, on_cpu)
    timers.add("  runnable, waiting for a CPU", runnable, 0.0)
    timers.add("  asleep (GIL, meetings)", wall - on_cpu - runnable, 0.0)


def _plain_steps(net: torch.nn.Module, opt: torch.optim.Optimizer, batches: list, parts: Timers) -> None:
    for x, y in batches:
        marks = [(time.perf_counter(), time.thread_time())]
        loss = F.cross_entropy(net(x), y)
        marks.append((time.perf_counter(), time.thread_time()))
        loss.backward()
        marks.append((time.perf_counter(), time.thread_time()))
        opt.step()
        marks.append((time.perf_counter(), time.thread_time()))
        opt.zero_grad(set_to_none=True)
        marks.append((time.perf_counter(), time.thread_time()))
        for part, (w0, c0), (w1, c1) in zip(_PLAIN_PARTS, marks, marks[1:]):
            parts.add(part, w1 - w0, c1 - c0)


def plain(batches: list, out: dict[str, tuple[float, float]], start: threading.Barrier | None = None) -> None:
    """One replica's work in a plain loop on this thread (1 intra-op thread): (wall, CPU) ms per step
    by part, into `out`."""
    torch.set_num_threads(1)
    net = make_net()
    opt = torch.optim.SGD(net.parameters(), lr=0.01, momentum=0.9)
    _plain_steps(net, opt, batches[:_WARMUP_STEPS], Timers())
    if start is not None:
        start.wait()
    parts = Timers()
    parts.on = True
    begin, (cpu, runnable) = time.perf_counter(), _schedstat()
    _plain_steps(net, opt, batches, parts)
    wall = time.perf_counter() - begin
    cpu2, runnable2 = _schedstat()
    _split(parts, wall, cpu2 - cpu, runnable2 - runnable)
    out.update({part: (v / len(batches) * 1e3, parts.cpu.get(key, float("nan")) / len(batches) * 1e3)
                for key, v in parts.total.items() for part in [key[1]]})


def threads(batches: list, n: int) -> dict[str, tuple[float, float]]:
    """n plain loops on n Python threads at once; the parts averaged over the threads."""
    outs: list[dict[str, tuple[float, float]]] = [{} for _ in range(n)]
    barrier = threading.Barrier(n)
    workers = [threading.Thread(target=plain, args=(batches, outs[i], barrier)) for i in range(n)]
    for w in workers:
        w.start()
    for w in workers:
        w.join(timeout=600)
    return {k: (statistics.mean(o[k][0] for o in outs), statistics.mean(o[k][1] for o in outs)) for k in outs[0]}


def _instrument(timers: Timers) -> None:
    M, MO = model_lib.Model, mirrored_optimizer.MirroredOptimizer
    timers.wrap_step(M, "train_step")
    timers.wrap(M, "_forward", "module forward (Model._forward)")
    timers.wrap(M, "compute_loss", "loss (Model.compute_loss)")
    timers.wrap(losses.Loss, "per_example", "  per-example loss (checked)")
    timers.wrap(torch.Tensor, "backward", "backward")
    timers.wrap(M, "_track_loss", "loss tracker (Model._track_loss)")
    timers.wrap(M, "compute_metrics", "metrics (Model.compute_metrics)")
    timers.wrap(MO, "reduce_gradients", "gradient all-reduce (reduce_gradients)")
    timers.wrap(torch.optim.SGD, "step", "optimizer step (torch SGD)")
    timers.wrap(torch.optim.Optimizer, "zero_grad", "zero_grad")
    timers.wrap(MO, "sync_buffers", "BatchNorm buffer sync (sync_buffers)")
    timers.wrap(rollback.StepJournal, "before_forward", "step journal (before_forward)")
    timers.wrap(rollback.StepJournal, "before_write", "step journal (before_write)")
    timers.wrap(rollback.StepJournal, "commit", "step journal (commit)")
    timers.wrap(replicas.Rendezvous, "exchange", "  meetings (Rendezvous.exchange)")
    timers.wrap(cross_device_ops.CrossDeviceOps, "_reduce_into", "  summing for all (last to arrive)")
    timers.wrap(mr.MirroredStrategy, "run", "strategy.run")
    timers.wrap(M, "_logs", "logs (Model._logs)")


def fit(batches: list, n: int, instrumented: bool) -> tuple[float, dict[tuple[str, str], tuple[float, float]]]:
    """ms per step of fit on n replicas, and the parts (ms per step per thread) when instrumented."""
    torch.manual_seed(0)
    strategy = mr.MirroredStrategy(devices=[f"cpu:{i}" for i in range(n)])
    with strategy.scope():
        model = mr.Model(make_net())
        model.compile(optimizer=mr.optimizers.SGD(learning_rate=0.01, momentum=0.9),
                      loss="sparse_categorical_crossentropy")
    model.fit(batches[:_WARMUP_STEPS], epochs=1, verbose=0)
    timers = Timers()
    if instrumented:
        _instrument(timers)
    try:
        timers.on = True
        start = time.perf_counter()
        model.fit(batches, epochs=1, verbose=0)
        seconds = time.perf_counter() - start
    finally:
        timers.on = False
        timers.undo()
    def per_step(v: float, who: str) -> float:
        return v / len(batches) * 1e3 / (n if who == "replica" else 1)

    parts = {key: (per_step(v, key[0]), per_step(timers.cpu.get(key, float("nan")), key[0]))
             for key, v in timers.total.items()}
    return seconds / len(batches) * 1e3, parts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=64, help="global batch")
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--steps", type=int, default=16, help="timed steps per run")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    n, per = args.replicas, -(-args.batch // args.replicas)
    data = make_data(args.batch * (args.steps + _WARMUP_STEPS), args.batch)
    alone_data = make_data(per * (args.steps + _WARMUP_STEPS), per)
    print(machine())
    print(f"global batch {args.batch} on {n} replicas ({per} each), {args.steps} steps per run, "
          f"{args.rounds} rounds; load average before {load()}")
    rows: dict[str, dict[str, list[tuple[float, float]]]] = collections.defaultdict(
        lambda: collections.defaultdict(list))
    for _ in range(args.rounds):
        out: dict[str, tuple[float, float]] = {}
        plain(alone_data, out)
        for k, v in out.items():
            rows["alone: 1 replica's work, 1 thread"][k].append(v)
        for k, v in threads(alone_data, n).items():
            rows[f"threads: {n} plain loops on {n} threads, never meeting"][k].append(v)
        step_ms, _ = fit(data, n, instrumented=False)
        rows[f"fit on {n} replicas"]["fit step, not instrumented [main]"].append((step_ms, float("nan")))
        step_ms, parts = fit(data, n, instrumented=True)
        rows[f"fit on {n} replicas"]["fit step, instrumented [main]"].append((step_ms, float("nan")))
        for (who, part), v in parts.items():
            rows[f"fit on {n} replicas"][part if who == "replica" else f"{part} [main]"].append(v)
    print(f"load average after {load()}")
    print(f"ms per step per replica thread, medians over rounds (wall range):\n{'':<52}{'wall':>9}{'CPU':>9}")
    for name, parts in rows.items():
        print(f"  {name}")
        for part, values in parts.items():
            wall = statistics.median(v[0] for v in values)
            cpu = statistics.median(v[1] for v in values)
            print(f"    {part:<48}{wall:>9.2f}{cpu:>9.2f}  ({min(v[0] for v in values):.1f}-"
                  f"{max(v[0] for v in values):.1f})")

if __name__ == "__main__":
    main()
