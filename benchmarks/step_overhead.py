"""mirrored's own work per fit step, by phase, and how it grows with the replica count (issue 27).

    .venv/bin/python benchmarks/step_overhead.py                  # ResNet-20 at 64 and 256; MLP on 1, 2, 4, 8
    .venv/bin/python benchmarks/step_overhead.py --quick          # a smoke run (a few seconds)

Every run is `Model.fit` on a pipeline written as the README writes it,
`Dataset.from_tensor_slices((x, y)).batch(B)`, with metrics=["accuracy"]. The phases of a step are
timed by wrapping the methods that do them (as instance-free class attributes, removed after), in
CPU seconds of the thread that runs them (`time.thread_time`), each exclusive of the phases nested in
it; CPU time is what a shared machine's load disturbs least, and Python's CPU time is the time it
holds the GIL:
  input     reading the next global batch (the dataset's pipeline), main thread
  split     cutting it into per-replica parts and placing them (DistributedIterator's splitter)
  hand-off  strategy.run on the main thread: waking the replica threads and collecting them
  all-reduce  the gradient and BatchNorm-buffer all-reduces, CPU only (waiting is not CPU)
  metrics   the loss tracker and metric updates of a replica step (Model._track_loss, compute_metrics)
  checks    the copy watch (replicas' requires_grad / mode / write counts) and the step journal
            (rollback of a failed step)
  compute   the rest of the process's CPU time: forward, backward, optimizer, torch's own work
Table 1: the ResNet-20 (fit_throughput.py's model) on 2 CPU replicas, ms of CPU per step per phase,
and the wall time per step beside one replica's step timed alone (the limit x 2 replicas).
Table 2: a model whose compute is negligible (Linear(8, 4), 2 examples per replica) on 1, 2, 4 and 8
logical CPU replicas: the CPU (GIL-held) time per replica step, by phase, and the wall time per step.
Table 3: ResNet-20 on 8x8 inputs, 2 examples per replica, on 2 replicas: the CPU time per replica step
of a real model's structure (BatchNorm buffers, 65 parameters) beside a plain torch loop's step.
docs/benchmarks.md projects table 2 onto 8 GPUs. Rounds alternate the configurations; medians.
"""
from __future__ import annotations

import argparse
import collections
import functools
import statistics
import threading
import time
import warnings
from typing import Any

import torch

import mirrored as mr
from mirrored._bench import load, machine, make_net
from mirrored.distribute import _copy_watch, input as input_lib, modules as modules_lib, optimizer as optimizer_lib
from mirrored.distribute import reducer as reducer_lib, replicas as replicas_lib, rollback
from mirrored.training import losses as losses_lib, model as model_lib, optimizers as optimizers_lib

PHASES = ("input", "split", "hand-off", "all-reduce", "metrics", "checks", "compute")
_WRAPPED = (  # (class, method, phase)
    (input_lib.DistributedIterator, "_fetch", "input"),
    (input_lib._Splitter, "split", "split"),
    (mr.MirroredStrategy, "run", "hand-off"),
    (model_lib.Model, "train_step", "replica step"),  # (one replica runs it on the caller's thread)
    (optimizer_lib.MirroredOptimizer, "reduce_gradients", "all-reduce"),
    (optimizer_lib.MirroredOptimizer, "sync_buffers", "all-reduce"),
    (model_lib.Model, "_track_loss", "metrics"),
    (model_lib.Model, "compute_metrics", "metrics"),
    (_copy_watch.CopyWatch, "signature", "checks"),
    (_copy_watch.CopyWatch, "settle", "checks"),
    (rollback.StepJournal, "before_forward", "checks"),
    (rollback.StepJournal, "before_write", "checks"),
    (rollback.StepJournal, "commit", "checks"),
)


class PhaseTimer:
    """CPU seconds per phase over all threads, each call exclusive of the timed calls nested in it."""

    def __init__(self) -> None:
        self.cpu: dict[str, float] = collections.defaultdict(float)
        self._local = threading.local()
        self._undo: list[tuple[type, str, Any]] = []

    def install(self) -> None:
        for cls, name, phase in _WRAPPED:
            owner = next(c for c in cls.__mro__ if name in c.__dict__)  # the class that defines it
            original = owner.__dict__[name]
            setattr(owner, name, self._timed(original, phase))
            self._undo.append((owner, name, original))

    def remove(self) -> None:
        while self._undo:
            owner, name, original = self._undo.pop()
            setattr(owner, name, original)

    def _timed(self, original: Any, phase: str) -> Any:
        timer = self

        @functools.wraps(original)
        def timed(*args: Any, **kwargs: Any) -> Any:
            stack = timer._local.__dict__.setdefault("stack", [])
            stack.append(0.0)  # CPU seconds of the timed calls nested in this one
            start = time.thread_time()
            try:
                return original(*args, **kwargs)
            finally:
                spent = time.thread_time() - start
                nested = stack.pop()
                timer.cpu[phase] += spent - nested
                if stack:
                    stack[-1] += spent

        return timed


def _dataset(n: int, batch: int, shape: tuple[int, ...], classes: int) -> Any:
    g = torch.Generator().manual_seed(0)
    x = torch.rand(n, *shape, generator=g).numpy()
    y = torch.randint(0, classes, (n,), generator=g).numpy()
    return mr.data.Dataset.from_tensor_slices((x, y)).batch(batch)


def _model(net: torch.nn.Module, replicas: int) -> mr.Model:
    strategy = mr.MirroredStrategy(devices=[f"cpu:{i}" for i in range(replicas)])
    with strategy.scope():
        model = mr.Model(net)
        model.compile(optimizer=mr.optimizers.SGD(learning_rate=0.01, momentum=0.9),
                      loss="sparse_categorical_crossentropy", metrics=["accuracy"])
    return model


def measure(model: mr.Model, data: Any, warmup: Any, steps: int) -> dict[str, float]:
    """ms per step: wall, process CPU, and each phase's CPU (compute: the rest of the process CPU)."""
    model.fit(warmup, epochs=1, verbose=0)
    timer = PhaseTimer()
    timer.install()
    try:
        wall, cpu = time.perf_counter(), time.process_time()
        model.fit(data, epochs=1, verbose=0)
        wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    finally:
        timer.remove()
    out = {phase: timer.cpu.get(phase, 0.0) for phase in PHASES[:-1]}
    out["compute"] = cpu - sum(out.values())  # (the replica step's own CPU, less its timed phases, and the rest)
    out.update(wall=wall, cpu=cpu)
    return {k: v / steps * 1e3 for k, v in out.items()}


def _plain_steps(per_replica: int, size: int, steps: int, clock) -> list[float]:
    """`clock()` around each of `steps` steps of a plain torch loop (ResNet-20, channels_last, one
    intra-op thread) on `per_replica` images of size x size, after one untimed warm-up step."""
    g = torch.Generator().manual_seed(1)
    x, y = torch.rand(per_replica, 3, size, size, generator=g), torch.randint(0, 10, (per_replica,), generator=g)
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        net = make_net(channels_last=True)
        opt = torch.optim.SGD(net.parameters(), lr=0.01, momentum=0.9)
        times = []
        for i in range(steps + 1):
            start = clock()
            opt.zero_grad(set_to_none=True)
            torch.nn.functional.cross_entropy(net(x), y).backward()
            opt.step()
            if i:
                times.append(clock() - start)
        return times
    finally:
        torch.set_num_threads(before)


def alone_step_ms(per_replica: int, steps: int) -> float:
    """One replica's step timed alone: its batch, one intra-op thread, a plain torch loop (the limit)."""
    return statistics.median(_plain_steps(per_replica, 32, steps, time.perf_counter)) * 1e3


def _row(label: str, runs: list[dict[str, float]], width: int, per: int = 1) -> str:
    med = {k: statistics.median(r[k] for r in runs) / per for k in runs[0]}
    return f"  {label:<{width}}" + "".join(f"{med[p]:>11.3f}" for p in (*PHASES, "cpu")) + f"{med['wall']:>11.2f}"


def resnet_table(batches: list[int], steps: int, rounds: int) -> None:
    print(f"\nTable 1: ResNet-20 fit on 2 CPU replicas, ms of CPU per step by phase; {steps} steps, {rounds} "
          f"round(s); load average {load()}")
    width = 26
    print(f"  {'':<{width}}" + "".join(f"{p:>11}" for p in (*PHASES, "CPU total")) + f"{'wall':>11}")
    for batch in batches:
        per = -(-batch // 2)
        runs, alone = [], []
        for _ in range(rounds):
            alone.append(alone_step_ms(per, max(3, steps // 4)))
            runs.append(measure(_model(make_net(), 2), _dataset(batch * steps, batch, (3, 32, 32), 10),
                                _dataset(batch * 2, batch, (3, 32, 32), 10), steps))
        print(_row(f"global batch {batch}", runs, width))
        limit = statistics.median(alone)
        fit = statistics.median(r["wall"] for r in runs)
        own = sum(statistics.median(r[p] for r in runs) for p in PHASES[:-1])
        print(f"  {'':<{width}}one replica's step alone {limit:.1f} ms (the limit of 2 at once); fit's step "
              f"{fit:.1f} ms ({limit / fit:.2f} of the limit); mirrored's own phases {own:.2f} ms of CPU")


def scaling_table(counts: list[int], steps: int, rounds: int, per_replica: int = 2) -> None:
    print(f"\nTable 2: negligible compute (Linear(8, 4), {per_replica} examples per replica), ms of CPU "
          f"(GIL-held) per REPLICA step by phase; {steps} steps, {rounds} round(s); load average {load()}")
    width = 12
    print(f"  {'replicas':<{width}}" + "".join(f"{p:>11}" for p in (*PHASES, "CPU total")) + f"{'wall/step':>11}")
    runs: dict[int, list[dict[str, float]]] = {n: [] for n in counts}
    with warnings.catch_warnings():  # more replicas than cores is this table's point
        warnings.filterwarnings("ignore", message=r".*CPU replicas share \d+ core", category=UserWarning)
        # An untimed run first: the process's first fit pays one-time costs (15 ms of CPU a step, measured)
        measure(_model(torch.nn.Linear(8, 4), counts[0]), _dataset(8 * steps, 8, (8,), 4), _dataset(16, 8, (8,), 4),
                steps)
        for _ in range(rounds):
            for n in counts:
                torch.manual_seed(0)
                batch = n * per_replica
                runs[n].append(measure(_model(torch.nn.Linear(8, 4), n), _dataset(batch * steps, batch, (8,), 4),
                                       _dataset(batch * 2, batch, (8,), 4), steps))
    for n in counts:
        row = _row(str(n), runs[n], width, per=n)  # phases per replica step; wall per step
        wall = statistics.median(r["wall"] for r in runs[n])
        print(row[: -11] + f"{wall:>11.2f}")


# The accounted table: every phase of a replica step of fit, timed exclusive of the phases nested in it,
# on every thread, summing with "other" to the process's CPU; the plain loop's step beside it.
_ACCOUNTED = (  # (class, method, row), in the order printed
    (mr.Model, "fit", "fit's loop (main thread)"),
    (input_lib.DistributedIterator, "_fetch", "input: the next batch"),
    (input_lib._Splitter, "split", "input: split and place"),
    (mr.MirroredStrategy, "run", "hand-off (strategy.run)"),
    (mr.Model, "train_step", "train_step's own Python"),
    (mr.Model, "__call__", "model call (Model.__call__, _forward)"),
    (mr.Model, "_forward", "model call (Model.__call__, _forward)"),
    (modules_lib.MirroredModule, "_call", "mirror call (journal note, examples)"),
    (torch.nn.Module, "_call_impl", "module forward (torch)"),
    (mr.Model, "compute_loss", "loss (compute_loss, per_example)"),
    (losses_lib.Loss, "per_example", "loss (compute_loss, per_example)"),
    (mr.Model, "_track_loss", "metrics (loss tracker, compute_metrics)"),
    (mr.Model, "compute_metrics", "metrics (loss tracker, compute_metrics)"),
    (torch.Tensor, "backward", "backward (torch)"),
    (optimizers_lib.Optimizer, "step", "optimizer step: mirrored's path"),
    (optimizer_lib.MirroredOptimizer, "step", "optimizer step: mirrored's path"),
    (optimizer_lib.MirroredOptimizer, "reduce_gradients", "gradient all-reduce"),
    (reducer_lib.GradientReducer, "reduce", "gradient all-reduce"),
    (replicas_lib.Rendezvous, "exchange", "meetings (Rendezvous.exchange)"),
    # (the torch class's step, as mr.optimizers calls it: past torch's hook wrapper, so a timer around
    # torch.optim.SGD.step, which copies the wrapper's marks, was skipped and the update counted as ours)
    (optimizers_lib._KerasSteps, "_update", "optimizer update (torch's SGD)"),
    (optimizer_lib.MirroredOptimizer, "sync_buffers", "buffer sync (BatchNorm statistics)"),
    # (fit's buffer average rides in the gradients' meeting: its packing and unpacking, and the walk)
    (optimizer_lib.MirroredOptimizer, "_buffer_plans_of", "buffer sync (BatchNorm statistics)"),
    (optimizer_lib._BufferPlan, "gather", "buffer sync (BatchNorm statistics)"),
    (optimizer_lib._BufferPlan, "scatter", "buffer sync (BatchNorm statistics)"),
    (optimizer_lib.MirroredOptimizer, "zero_grad", "zero_grad"),
    (rollback.StepJournal, "before_forward", "checks (journal, copy watch)"),
    (rollback.StepJournal, "before_write", "checks (journal, copy watch)"),
    (rollback.StepJournal, "before_change", "checks (journal, copy watch)"),
    (rollback.StepJournal, "commit", "checks (journal, copy watch)"),
    (_copy_watch.CopyWatch, "signature", "checks (journal, copy watch)"),
    (_copy_watch.CopyWatch, "settle", "checks (journal, copy watch)"),
)
_PLAIN_ROWS = ("module forward (torch)", "loss (torch's cross_entropy)", "backward (torch)",
               "optimizer update (torch's SGD)", "zero_grad")


def _small_net() -> torch.nn.Module:
    """The issue's small model: a conv stem, three residual blocks (one per stage), BatchNorm (ResNet-8)."""
    torch.manual_seed(0)
    return mr.models.resnet_cifar(depth=8, num_classes=10, data_format="channels_first")


def _resnet50() -> torch.nn.Module:
    """ResNet-50 (ImageNet's architecture, 10 classes) for the 8-GPU projection: on 64x64 inputs a GPU's
    kernels are small, so what 8 replicas serialise under the GIL is the Python and the dispatch."""
    torch.manual_seed(0)
    return mr.models.resnet50(num_classes=10, data_format="channels_first")


_NETS = {"resnet20": make_net, "resnet8": _small_net, "resnet50": _resnet50}
_SIDE = {"resnet20": 8, "resnet8": 8, "resnet50": 64}  # the inputs' height and width


def _plain_step(net_fn: Any, per_replica: int, g: torch.Generator) -> Any:
    """One step of a plain torch loop on one replica's part (channels_last), as a function: the step
    _plain_loop_ms times alone and _threads_floor_ms on several threads at once."""
    side = _SIDE[net_fn]
    x, y = torch.rand(per_replica, 3, side, side, generator=g), torch.randint(0, 10, (per_replica,), generator=g)
    net = _NETS[net_fn]().to(memory_format=torch.channels_last)
    opt = torch.optim.SGD(net.parameters(), lr=0.01, momentum=0.9)

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        torch.nn.functional.cross_entropy(net(x), y).backward()
        opt.step()
    return step


def _plain_loop_ms(net_fn: Any, per_replica: int, steps: int, rows: bool = True) -> dict[str, float]:
    """ms of CPU per step of a plain torch loop on one replica's part (channels_last, one intra-op
    thread): its total, and with `rows` its rows, timed with the same exclusive timer (whose wrappers
    cost a few us a call, so the total is taken in a run without them)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    timer = ExclusiveTimer(((torch.nn.Module, "_call_impl", _PLAIN_ROWS[0]),
                            (torch.nn.functional, "cross_entropy", _PLAIN_ROWS[1]),
                            (torch.Tensor, "backward", _PLAIN_ROWS[2]), (torch.optim.SGD, "step", _PLAIN_ROWS[3]),
                            (torch.optim.Optimizer, "zero_grad", _PLAIN_ROWS[4])))
    try:
        step = _plain_step(net_fn, per_replica, torch.Generator().manual_seed(1))
        for _ in range(3):
            step()
        if rows:
            timer.install()
        cpu = time.thread_time()
        for _ in range(steps):
            step()
        cpu = time.thread_time() - cpu
    finally:
        timer.remove()
        torch.set_num_threads(before)
    rows = {row: timer.cpu.get(row, 0.0) / steps * 1e3 for row in _PLAIN_ROWS}
    rows["total"] = cpu / steps * 1e3
    return rows


def _threads_floor_ms(net_fn: Any, per_replica: int, steps: int, replicas: int) -> float:
    """ms of CPU per step of `replicas` plain loops (as _plain_loop_ms's) on as many threads of one
    process, meeting at a barrier after every step as replicas do: what threads sharing one interpreter
    cost before mirrored does anything (their torch calls hand the GIL to one another)."""
    g = torch.Generator().manual_seed(1)
    loop_steps = [_plain_step(net_fn, per_replica, g) for _ in range(replicas)]
    barrier = threading.Barrier(replicas)
    cpu: list[float] = []  # each thread's CPU over the timed steps (the models are built, 3 steps warm)

    def loop(step: Any) -> None:
        torch.set_num_threads(1)
        for _ in range(3):
            step()
        barrier.wait()
        start = time.thread_time()
        for _ in range(steps):
            step()
            barrier.wait()
        cpu.append(time.thread_time() - start)

    threads = [threading.Thread(target=loop, args=(step,), name=f"floor-{i}") for i, step in enumerate(loop_steps)]
    before = torch.get_num_threads()
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=600)
    finally:
        torch.set_num_threads(before)
    return sum(cpu) / (steps * replicas) * 1e3


class ExclusiveTimer(PhaseTimer):
    """PhaseTimer over the given (class or module, function, row) triples."""

    def __init__(self, wrapped: Any) -> None:
        super().__init__()
        self._wrapped = wrapped

    def install(self) -> None:
        for owner, name, row in self._wrapped:
            if isinstance(owner, type):
                owner = next(c for c in owner.__mro__ if name in c.__dict__)
            original = owner.__dict__[name] if isinstance(owner, type) else getattr(owner, name)
            setattr(owner, name, self._timed(original, row))
            self._undo.append((owner, name, original))


def _fit_accounted(net_fn: Any, replicas: int, per_replica: int, steps: int, rows: bool = True) -> dict[str, float]:
    """ms of CPU per REPLICA step of fit: its total (the process's CPU), and with `rows` by row of
    _ACCOUNTED (the wrappers' own cost lands in the rows; the total is taken in a run without them)."""
    torch.manual_seed(0)
    strategy = mr.MirroredStrategy(devices=[f"cpu:{i}" for i in range(replicas)])
    with strategy.scope():
        model = mr.Model(_NETS[net_fn]())
        model.compile(optimizer=mr.optimizers.SGD(learning_rate=0.01, momentum=0.9),
                      loss="sparse_categorical_crossentropy")
    batch = replicas * per_replica
    g = torch.Generator().manual_seed(0)
    x = torch.rand(batch * steps, 3, _SIDE[net_fn], _SIDE[net_fn], generator=g).numpy()
    y = torch.randint(0, 10, (batch * steps,), generator=g).numpy()
    model.fit(x[:batch * 3], y[:batch * 3], batch_size=batch, verbose=0, shuffle=False)
    timer = ExclusiveTimer(_ACCOUNTED)
    if rows:
        timer.install()
    try:
        cpu = time.process_time()
        model.fit(x, y, batch_size=batch, verbose=0, shuffle=False)
        cpu = time.process_time() - cpu
    finally:
        timer.remove()
    per = steps * replicas
    rows = {row: 0.0 for _, _, row in _ACCOUNTED}
    for row, seconds in timer.cpu.items():
        rows[row] += seconds / per * 1e3
    rows["other (threads, GC, what no row names)"] = cpu / per * 1e3 - sum(rows.values())
    rows["total"] = cpu / per * 1e3
    return rows


def accounted_table(nets: list[str], steps: int, rounds: int, per_replica: int = 2, replicas: int = 2) -> None:
    """Table 3: every millisecond of fit's CPU per replica step at negligible compute, against a plain loop."""
    print(f"\nTable 3: fit's CPU per REPLICA step at negligible compute ({per_replica} examples per replica on "
          f"8x8 inputs, ResNet-50's on 64x64, {replicas} replicas, fit on numpy arrays, no metrics), ms, medians of "
          f"{rounds} alternating "
          f"rounds of {steps} steps; load average {load()}")
    for net in nets:
        fits, plains, fit_totals, plain_totals, floors = [], [], [], [], []
        for _ in range(rounds):
            plains.append(_plain_loop_ms(net, per_replica, steps))
            fits.append(_fit_accounted(net, replicas, per_replica, steps))
            plain_totals.append(_plain_loop_ms(net, per_replica, steps, rows=False)["total"])
            fit_totals.append(_fit_accounted(net, replicas, per_replica, steps, rows=False)["total"])
            floors.append(_threads_floor_ms(net, per_replica, steps, replicas))
        fit = {k: statistics.median(r[k] for r in fits) for k in fits[0]}
        plain = {k: statistics.median(r[k] for r in plains) for k in plains[0]}
        print(f"  {net}: fit, per replica step                       plain loop, per step")
        shown = [k for k in fit if k != "total"]
        for i, row in enumerate(shown):
            right = f"{_PLAIN_ROWS[i]:<32}{plain[_PLAIN_ROWS[i]]:>8.3f}" if i < len(_PLAIN_ROWS) else ""
            print(f"    {row:<42}{fit[row]:>8.3f}    {right}")
        print(f"    {'total, timed by rows':<42}{fit['total']:>8.3f}    {'total, timed by rows':<32}"
              f"{plain['total']:>8.3f}")
        fit_total, plain_total = statistics.median(fit_totals), statistics.median(plain_totals)
        print(f"    {'total, untimed run':<42}{fit_total:>8.3f}    {'total, untimed run':<32}{plain_total:>8.3f}")
        ratios = sorted(f / p for f, p in zip(fit_totals, plain_totals))
        print(f"    fit / plain loop (untimed runs): {fit_total / plain_total:.2f} (rounds: "
              f"{', '.join(f'{r:.2f}' for r in ratios)}); target <= 1.25")
        floor = statistics.median(floors)
        print(f"    {replicas} plain loops on {replicas} threads, in step (the floor threads set): {floor:.3f} ms, "
              f"{floor / plain_total:.2f}x the plain loop; fit / that floor: {fit_total / floor:.2f}")
        print(f"    fit - plain loop: {fit_total - plain_total:.3f} ms per replica step; on 8 replicas "
              f"{8 * (fit_total - plain_total):.1f} ms more in series per step than 8 plain loops' Python")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, nargs="+", default=[64, 256], help="ResNet-20 global batches")
    parser.add_argument("--counts", type=int, nargs="+", default=[1, 2, 4, 8], help="replica counts of table 2")
    parser.add_argument("--steps", type=int, default=20, help="timed steps per ResNet run (x10 for the MLP)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--nets", nargs="+", default=["resnet20", "resnet8"], choices=sorted(_NETS),
                        help="table 3's models")
    parser.add_argument("--tables", nargs="+", type=int, default=[1, 2, 3], help="which tables to print")
    parser.add_argument("--quick", action="store_true", help="tiny settings: checks the script runs")
    args = parser.parse_args()
    if args.quick:
        args.batches, args.counts, args.steps, args.rounds = [8], [1, 2], 2, 1
    print(machine())
    if 1 in args.tables:
        resnet_table(args.batches, args.steps, args.rounds)
    if 2 in args.tables:
        scaling_table(args.counts, args.steps * 10, args.rounds)
    if 3 in args.tables:
        accounted_table(args.nets, args.steps * 5, args.rounds)


if __name__ == "__main__":
    main()
