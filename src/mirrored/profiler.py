"""Profiler: where a training step's time goes - waiting for input, computing, all-reducing.

`Profiler` is a Keras callback, `model.fit(ds, callbacks=[mr.profiler.Profiler("logs/prof")])`, and
for custom loops a recorder to start, stop and mark steps on. It records spans (a name, a thread, a
start and an end) from three sources:
  - step boundaries: on_train_batch_begin/end in fit(), `with profiler.step():` in a custom
    loop. The block is the "step"; the time from the end of one step to the start of the next
    is "input" (the wait for the next batch, plus other callbacks' per-batch work such as the
    progress bar's). It restarts at each epoch, so validation and epoch-end callbacks are not
    counted as input.
  - timing wrappers set as instance attributes (classes untouched; removed by `stop()`) on
    one MirroredOptimizer's `reduce_gradients` ("all_reduce", per replica thread; it includes
    waiting for the slowest replica to arrive) and on one strategy's `run` ("replica_step": a
    replica's whole function). A replica's compute is its replica_step minus its all_reduce.
  - `trace(name)` blocks, which anyone may add on any thread.
Out come `summary()`, a Chrome trace (`save_chrome_trace`; chrome://tracing or ui.perfetto.dev) and
a PNG of the per-step breakdown (`plot`). In fit() the optimizer is `model.mirrored_optimizer`.

`breakdown()` splits each step's wall time (its input wait plus the step) into four phases that add
up to it: input, compute and all-reduce of the step's slowest replica (the one on the critical path;
it arrives last at the all-reduce, so its all-reduce is the communication itself), and overhead (the
step outside that replica's function: hand-offs to the replica threads, splitting the batch, the
loop's bookkeeping). `bottleneck()` names the largest in words ("compute-bound: 97% of the step
computes; all-reduce 1%; input 1%; overhead 1%") - or "Python per step" where the replicas, threads of
one interpreter, took turns at its lock (`python_per_step()`: their threads' CPU in their functions
against the wall time they ran in; on GPUs, the host's CPU against it), adding the page faults the
replica threads took where glibc's malloc makes each step fault its memory in again (`page_faults()`,
Linux) - and `scaling()` compares the step with the limit:
every replica as fast as one replica alone (`time_alone` measures that; without it, this run's own
compute stands in).

Spans are host wall time. On CUDA, where kernels run asynchronously, the profiler synchronises the
device at every span boundary (the step's on the main thread, each replica's on its own thread), so
each phase holds the device work it queued; a profiled step thereby loses its host/device overlap.
Uses the public names of mirrored.distribute, the Callback base, torch (device synchronisation),
numpy, matplotlib (Agg canvas, no pyplot state) and the standard library's resource (Linux's
per-thread usage).
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import torch

import mirrored.distribute as md
from mirrored._files import write_atomically
from mirrored.training.callbacks import Callback

try:
    import resource

    _RUSAGE_THREAD: int | None = resource.RUSAGE_THREAD  # (Linux only)
except (ImportError, AttributeError):  # Windows has no resource module; macOS no per-thread usage
    _RUSAGE_THREAD = None

logger = logging.getLogger(__name__)

__all__ = ["Profiler", "Span", "time_alone", "trace"]

_TRACE_FILE = "trace{suffix}.json"  # worker N > 0 of a multi-worker run adds ".workerN"
_PLOT_FILE = "timeline{suffix}.png"
PHASES = ("compute", "all_reduce", "input", "overhead")  # breakdown()'s phases, in the order they are printed
_PHASE_WORDS = {  # phase -> (the bottleneck's name, what the step does in it, the phase's short name)
    "compute": ("compute-bound", "computes", "compute"),
    "all_reduce": ("all-reduce-bound", "all-reduces", "all-reduce"),
    "input": ("input-bound", "waits for input", "input"),
    "overhead": ("overhead-bound", "is overhead (hand-offs to the replicas, bookkeeping)", "overhead"),
}


def _now() -> int:
    """The clock every span reads: monotonic nanoseconds, the same on every thread."""
    return time.perf_counter_ns()


def _device_sync(devices: tuple[str, ...] | list[str]) -> Callable[[], None] | None:
    """What waits for the work queued on `devices`' CUDA GPUs (the main thread's step boundaries);
    None where none is a GPU."""
    indices = sorted({int(d.split(":")[1]) if ":" in d else 0 for d in devices if d.startswith("cuda")})
    if not indices:
        return None

    def sync() -> None:
        for i in indices:
            torch.cuda.synchronize(i)
    return sync


def _sync_current() -> None:
    """Waits for the calling thread's current CUDA device (a replica thread's own GPU)."""
    torch.cuda.synchronize()


@dataclasses.dataclass(frozen=True)
class Span:
    """One timed block on one thread; times are nanoseconds since the profiler started."""

    name: str
    start_ns: int
    end_ns: int
    tid: int  # threading.get_native_id() of the thread it ran on
    replica: int | None  # replica_id_in_sync_group, None outside a replica function
    step: int | None  # index of the step it fell in (from 0, across epochs), None between steps
    args: dict[str, Any] = dataclasses.field(default_factory=dict)

    @property
    def duration_s(self) -> float:
        """end - start, in seconds."""
        return (self.end_ns - self.start_ns) / 1e9


class _Recorder:
    """The spans of one profiling run. Wrappers and trace() hold this, never the Profiler, so a
    wrapper left on an object holds no model or strategy alive."""

    def __init__(self) -> None:
        self.t0_ns = _now()
        self.spans: list[Span] = []
        self.thread_names: dict[int, str] = {}
        self.main_tid = threading.get_native_id()
        self.step: int | None = None  # the open step, read by replica threads while it runs
        self.next_step = 0
        self.step_start_ns = 0
        self.last_end_ns = self.t0_ns
        self.sync: Callable[[], None] | None = None  # waits for every GPU of the strategy (CUDA only)
        self.replicas: int | None = None  # the strategy's num_replicas_in_sync, when one is profiled
        self.local_replicas: int | None = None  # those of this process: threads of one interpreter
        self.device_type = "cpu"  # the replicas' devices' type ("cuda": the GPUs wait for the host)
        self.cores = _cores()  # the cores this process may run on, which CPU replicas share
        self._sync_cpu = threading.local()  # per thread: the CPU its profiler syncs spent (not the step's)
        self._schedstat = threading.local()  # per thread: its open /proc/thread-self/schedstat (Linux)
        self._fds: list[int] = []
        self._lock = threading.Lock()

    def runqueue_ns(self) -> int | None:
        """How long the calling thread has waited, runnable, for a free core (Linux's schedstat: the
        cores were busy, with other processes or more threads than cores); None where the OS does not
        say. Reads a file kept open per thread (close() closes them)."""
        fd = getattr(self._schedstat, "fd", None)
        if fd is None:
            try:
                fd = os.open("/proc/thread-self/schedstat", os.O_RDONLY)
            except OSError:
                fd = -1
            self._schedstat.fd = fd
            if fd >= 0:
                with self._lock:
                    self._fds.append(fd)
        if fd < 0:
            return None
        try:
            return int(os.pread(fd, 128, 0).split()[1])
        except (OSError, IndexError, ValueError):
            return None

    def close(self) -> None:
        """Closes the files runqueue_ns opened."""
        with self._lock:
            fds, self._fds = self._fds, []
        for fd in fds:
            with contextlib.suppress(OSError):
                os.close(fd)

    def replica_sync(self) -> None:
        """Waits for the calling replica thread's GPU, counting the CPU the wait spends (CUDA's wait
        spins) apart, so that a replica's host CPU leaves out what the profiler itself added."""
        cpu = time.thread_time_ns()
        _sync_current()
        self._sync_cpu.ns = self.sync_cpu_ns() + time.thread_time_ns() - cpu

    def sync_cpu_ns(self) -> int:
        """The CPU the calling thread spent in replica_sync so far."""
        return getattr(self._sync_cpu, "ns", 0)

    def now(self) -> int:
        """The clock at a step boundary: on CUDA, after the devices finished what was queued so far."""
        if self.sync is not None:
            self.sync()
        return _now()

    def record(self, name: str, start_ns: int, end_ns: int, args: dict[str, Any] | None = None,
               in_replica: bool = True) -> None:
        ctx = md.get_replica_context() if in_replica and md.has_strategy() else None
        replica = ctx.replica_id_in_sync_group if ctx is not None else None
        thread = threading.current_thread()
        span = Span(name, start_ns - self.t0_ns, end_ns - self.t0_ns, thread.native_id, replica,
                    self.step, args or {})
        with self._lock:
            self.spans.append(span)
            self.thread_names.setdefault(thread.native_id, thread.name)


# trace() must reach the running profiler from any thread, replica threads included, and those start
# with an empty context stack; a list of started recorders is the least shared state that allows it.
_active: list[_Recorder] = []
_active_lock = threading.Lock()


@contextlib.contextmanager
def trace(name: str) -> Iterator[None]:
    """Records the block as a span `name` on the current thread, in every started Profiler.

    With no Profiler started it only checks a list, so library and user code may leave it in."""
    if not isinstance(name, str) or not name:
        raise TypeError(f"mr.profiler.trace(name={name!r}): give the span a non-empty string name, "
                        "e.g. trace(\"all_reduce\").")
    recorders = list(_active)
    if not recorders:
        yield
        return
    start = _now()
    try:
        yield
    finally:
        end = _now()
        for rec in recorders:
            rec.record(name, start, end)


def _timed(rec: _Recorder, name: str | Callable[[], str], call: Callable[..., Any],
           sync: Callable[[], None] | None = None, cpu: bool = False) -> Callable[..., Any]:
    """`call`, recording a span `name` around it; with `sync` (CUDA), the device is waited for at both
    ends, so the span holds the kernels the call queued and none from before it. With `cpu`, the span's
    args hold "cpu_ns": the CPU its thread spent in the call, less what the profiler's own syncs spent
    in it, "wait_ns": how long it waited for a free core (python_per_step), and "faults" and "kernel_ns":
    its page faults and CPU in the kernel (page_faults), where the OS says."""
    def timed(*args: Any, **kwargs: Any) -> Any:
        if sync is not None:
            sync()
        start = _now()
        if cpu:
            cpu_start, synced, waited = time.thread_time_ns(), rec.sync_cpu_ns(), rec.runqueue_ns()
            usage = _thread_usage()
        try:
            return call(*args, **kwargs)
        finally:
            args_ = None
            if cpu:
                args_ = {"cpu_ns": time.thread_time_ns() - cpu_start - (rec.sync_cpu_ns() - synced)}
                now_waited = rec.runqueue_ns() if waited is not None else None
                if now_waited is not None:
                    args_["wait_ns"] = now_waited - waited
                if usage is not None:
                    now = _thread_usage()
                    args_["faults"], args_["kernel_ns"] = now[0] - usage[0], now[1] - usage[1]
            if sync is not None:
                sync()
            rec.record(name if isinstance(name, str) else name(), start, _now(), args_)
    return timed


def _wrap_method(obj: Any, name: str, wrap: Callable[[Callable[..., Any]], Callable[..., Any]]) -> Callable[[], None]:
    """Sets `obj.<name>` to wrap(the method) as an instance attribute, and returns the undo.

    The wrapper reaches `obj` through a weak reference: a bound method stored on its own instance
    would be a reference cycle, and a strategy in a cycle stops its threads only at the next GC."""
    own = vars(obj).get(name)  # an instance attribute someone set before us: wrapped, then put back
    if own is not None:
        call = own
    else:
        func, ref = getattr(type(obj), name), weakref.ref(obj)

        def call(*args: Any, **kwargs: Any) -> Any:
            return func(ref(), *args, **kwargs)
    wrapper = wrap(call)
    setattr(obj, name, wrapper)

    def undo() -> None:
        if vars(obj).get(name) is not wrapper:
            logger.warning("Profiler: %r.%s was replaced while profiling; leaving it as it is", obj, name)
        elif own is not None:
            setattr(obj, name, own)
        else:
            delattr(obj, name)
    return undo


def _mirrored_optimizer(model: Any) -> Any:
    return getattr(model, "mirrored_optimizer", None)


class Profiler(Callback):
    """Records a step timeline (input wait / compute / all-reduce per replica) of fit() or a custom loop.

    In fit(): pass it in `callbacks=`; with `log_dir`, trace.json and timeline.png are written there
    when training ends. In a custom loop:

        profiler = mr.profiler.Profiler()
        with profiler.start(optimizer=opt, strategy=strategy):
            for x, y in dist_ds:
                with profiler.step(num_examples=GLOBAL_BATCH):
                    strategy.run(step_fn, args=(x, y))
        profiler.print_summary()

    Each start() (each fit) begins a new record. If fit() raises, on_train_end does not run (as in
    Keras): call `stop()` to remove the wrappers.
    """

    def __init__(self, log_dir: str | os.PathLike | None = None):
        super().__init__()
        self.log_dir = None if log_dir is None else os.fspath(log_dir)
        self._rec = _Recorder()
        self._undo: list[Callable[[], None]] = []
        self._recording = False
        self._epoch: int | None = None
        self._batch: int | None = None
        self._worker = 0
        self.memory_format: str | None = None  # what the model's convolutions ran in (fit), for the summary
        #: One replica's step timed alone (seconds, e.g. time_alone in the same command): summary()'s
        #: scaling compares with it; None: this run's own compute stands in (an upper bound).
        self.alone_step_s: float | None = None

    # ---- recording ---------------------------------------------------------------------------------
    def start(self, optimizer: Any = None, strategy: Any = None) -> Profiler:
        """Begins a new record. Times `optimizer.reduce_gradients` (a MirroredOptimizer) and the
        replica functions of `strategy.run` until stop(). Returns self, a context manager."""
        if self._recording:
            raise RuntimeError("Profiler.start(): already recording; call stop() first (one record at a time).")
        if optimizer is not None and not callable(getattr(optimizer, "reduce_gradients", None)):
            raise TypeError(f"Profiler.start(optimizer={type(optimizer).__name__}): expected a MirroredOptimizer "
                            "(what strategy.mirror_optimizer returns), whose reduce_gradients it times.")
        if strategy is not None and not isinstance(strategy, md.Strategy):
            raise TypeError(f"Profiler.start(strategy={type(strategy).__name__}): expected an mr strategy, "
                            "e.g. mr.MirroredStrategy(...).")
        rec = self._rec = _Recorder()
        self._epoch = self._batch = None
        resolver = getattr(strategy, "cluster_resolver", None)  # multi-worker: this process's rank
        self._worker = getattr(resolver, "rank", None) or 0  # (task_id repeats under TF_CONFIG: chief 0, worker 0)
        devices = tuple(strategy.extended.worker_devices) if strategy is not None else ()
        if strategy is not None:
            rec.replicas, rec.local_replicas = strategy.num_replicas_in_sync, len(devices)
        rec.sync = _device_sync(devices)
        rec.device_type = "cuda" if rec.sync is not None else "cpu"
        replica_sync = rec.replica_sync if rec.sync is not None else None
        if optimizer is not None:
            self._undo.append(_wrap_method(optimizer, "reduce_gradients",
                                           lambda call: _timed(rec, "all_reduce", call, replica_sync)))
        if strategy is not None:
            def replica_name() -> str:
                return "replica_step" if rec.step is not None else "replica_run"

            def wrap_run(call: Callable[..., Any]) -> Callable[..., Any]:
                def run(fn: Any, *args: Any, **kwargs: Any) -> Any:
                    return call(_timed(rec, replica_name, fn, replica_sync, cpu=True) if callable(fn) else fn,
                                *args, **kwargs)
                return run
            self._undo.append(_wrap_method(strategy, "run", wrap_run))
        with _active_lock:
            _active.append(rec)
        self._recording = True
        return self

    def stop(self) -> None:
        """Ends the record, removes the wrappers, and writes trace.json and timeline.png to log_dir."""
        if not self._recording:
            return
        while self._undo:
            self._undo.pop()()
        with _active_lock:
            _active.remove(self._rec)
        self._rec.close()
        self._recording = False
        if self.log_dir is not None:
            suffix = f".worker{self._worker}" if self._worker else ""
            trace_path = os.path.join(self.log_dir, _TRACE_FILE.format(suffix=suffix))
            plot_path = os.path.join(self.log_dir, _PLOT_FILE.format(suffix=suffix))
            also = "The record stays in this Profiler: save_chrome_trace(path) and plot(path) write it elsewhere."
            write_atomically(trace_path, f"Profiler({self.log_dir!r})", self.save_chrome_trace, suffix=".json",
                             also=also)
            write_atomically(plot_path, f"Profiler({self.log_dir!r})", self.plot, suffix=".png", also=also)
            logger.log(logging.DEBUG if self._worker else logging.INFO, "Profiler: %d steps; wrote %s and %s",
                       self._rec.next_step, trace_path, plot_path)

    def __enter__(self) -> Profiler:
        return self if self._recording else self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    @contextlib.contextmanager
    def step(self, num_examples: int | None = None) -> Iterator[None]:
        """Marks one step of a custom loop: the block is the step, and the time since the previous
        step ended (or since start()) is input wait - the split fit() makes with its batch hooks."""
        self._begin_step()
        try:
            yield
        finally:
            self._end_step({"num_examples": num_examples} if num_examples is not None else {})

    def _begin_step(self, batch: int | None = None) -> None:
        rec = self._rec
        if not self._recording:
            raise RuntimeError("Profiler: a step began before start(); use `with profiler.start(...):` around "
                               "the loop, or pass the profiler to model.fit(callbacks=[...]).")
        if rec.step is not None:
            raise RuntimeError(f"Profiler: a step began while step {rec.step} was still open; steps do not nest.")
        now = rec.now()
        rec.step = rec.next_step
        rec.record("input", rec.last_end_ns, now, in_replica=False)
        rec.step_start_ns = now
        self._batch = batch

    def _end_step(self, logs: dict[str, Any]) -> None:
        rec = self._rec
        if rec.step is None:
            return
        now = rec.now()
        examples = logs.get("num_examples", logs.get("size"))
        args = {"epoch": self._epoch, "batch": self._batch, "num_examples": examples}
        rec.record("step", rec.step_start_ns, now, {k: v for k, v in args.items() if v is not None},
                   in_replica=False)
        rec.step, rec.next_step, rec.last_end_ns = None, rec.next_step + 1, now

    # ---- Callback hooks ------------------------------------------------------------------------------
    def on_train_begin(self, logs: dict[str, Any] | None = None) -> None:
        """Starts a record of this fit(): times the model's strategy.run and its optimizer's all-reduce."""
        self.start(optimizer=_mirrored_optimizer(self.model),
                   strategy=getattr(self.model, "distribute_strategy", None))
        self.memory_format = getattr(self.model, "memory_format", None)

    def on_epoch_begin(self, epoch: int, logs: dict[str, Any] | None = None) -> None:
        """Notes the epoch for the steps' trace args; input wait restarts here, so validation and
        epoch-end work do not count as input."""
        self._epoch = epoch
        self._rec.last_end_ns = _now()  # input wait restarts: validation and epoch-end work are not input

    def on_train_batch_begin(self, batch: int, logs: dict[str, Any] | None = None) -> None:
        """Opens step `batch`: the time since the previous step ended is recorded as input wait."""
        self._begin_step(batch)

    def on_train_batch_end(self, batch: int, logs: dict[str, Any] | None = None) -> None:
        """Closes the step, with the batch's "num_examples" (or "size") from `logs` for the throughput."""
        self._end_step(logs or {})

    def on_train_end(self, logs: dict[str, Any] | None = None) -> None:
        """stop(): removes the wrappers and, with log_dir, writes trace.json and timeline.png."""
        self.stop()

    # ---- results ---------------------------------------------------------------------------------------
    @property
    def spans(self) -> tuple[Span, ...]:
        """Every span of the current (or last) record, in the order they ended."""
        return tuple(self._rec.spans)

    def _steps(self) -> list[dict[str, Any]]:
        """Per step: input_s, step_s, num_examples, per replica all_reduce_s, replica_s and cpu_s (the CPU its
        thread spent in its function), the replicas' window_ns, and wait_s (their wait for a free core,
        summed), faults and kernel_s (their page faults and CPU in the kernel, summed) where the OS says."""
        rows: dict[int, dict[str, Any]] = {}
        for s in self.spans:
            if s.step is None:
                continue
            row = rows.setdefault(s.step, {"input_s": 0.0, "step_s": None, "num_examples": None,
                                           "all_reduce_s": {}, "replica_s": {}, "cpu_s": {}})
            if s.name == "input" and s.replica is None:
                row["input_s"] = s.duration_s
            elif s.name == "step" and s.replica is None:
                row["step_s"], row["num_examples"] = s.duration_s, s.args.get("num_examples")
            elif s.name in ("all_reduce", "replica_step") and s.replica is not None:
                key = "all_reduce_s" if s.name == "all_reduce" else "replica_s"
                row[key][s.replica] = row[key].get(s.replica, 0.0) + s.duration_s
                if "cpu_ns" in s.args:
                    row["cpu_s"][s.replica] = row["cpu_s"].get(s.replica, 0.0) + s.args["cpu_ns"] / 1e9
                if "wait_ns" in s.args:
                    row["wait_s"] = row.get("wait_s", 0.0) + s.args["wait_ns"] / 1e9
                if "faults" in s.args:
                    row["faults"] = row.get("faults", 0) + s.args["faults"]
                    row["kernel_s"] = row.get("kernel_s", 0.0) + s.args["kernel_ns"] / 1e9
                if s.name == "replica_step":  # from the first replica's start to the last one's end
                    first, last = row.get("window_ns", (s.start_ns, s.end_ns))
                    row["window_ns"] = (min(first, s.start_ns), max(last, s.end_ns))
        return [rows[i] for i in sorted(rows) if rows[i]["step_s"] is not None]

    def summary(self) -> dict[str, Any]:
        """Median / p90 / total (seconds) of input wait, step time, and per replica all-reduce and compute
        time; images, images/s over the profiled wall time (input wait + steps), the input fraction."""
        rows = self._steps()
        replicas = sorted({r for row in rows for r in row["all_reduce_s"]} |
                          {r for row in rows for r in row["replica_s"]})
        input_total = sum(row["input_s"] for row in rows)
        wall = input_total + sum(row["step_s"] for row in rows)
        counts = [row["num_examples"] for row in rows]
        images = sum(counts) if rows and all(c is not None for c in counts) else None
        compute = {r: [row["replica_s"][r] - row["all_reduce_s"].get(r, 0.0) for row in rows
                       if r in row["replica_s"]] for r in replicas}
        return {
            "steps": len(rows),
            "input_wait_s": _stats([row["input_s"] for row in rows]),
            "step_s": _stats([row["step_s"] for row in rows]),
            "all_reduce_s": {r: _stats([row["all_reduce_s"][r] for row in rows if r in row["all_reduce_s"]])
                             for r in replicas},
            "compute_s": {r: _stats(v) for r, v in compute.items() if v},
            "images": images,
            "images_per_s": images / wall if images is not None and wall > 0 else None,
            "input_fraction": input_total / wall if wall > 0 else None,
            "phases": self.breakdown(),
            "bottleneck": self.bottleneck(),
            "python_per_step": self.python_per_step(),
            "page_faults": self.page_faults(),
            "scaling": self.scaling(self.alone_step_s),
            "memory_format": self.memory_format,
        }

    def breakdown(self) -> dict[str, Any]:
        """The profiled wall time (input waits + steps) split into PHASES that add up to it: per phase,
        its total seconds and its fraction of the wall time; also `wall_s` and `steps`. Each step
        counts its slowest replica (see the module docstring)."""
        rows = self._steps()
        totals = dict.fromkeys(PHASES, 0.0)
        for row in rows:
            for name, seconds in _phases(row).items():
                totals[name] += seconds
        wall = sum(row["input_s"] + row["step_s"] for row in rows)
        out: dict[str, Any] = {name: {"total_s": t, "fraction": t / wall if wall > 0 else None}
                               for name, t in totals.items()}
        out["wall_s"], out["steps"] = wall, len(rows)
        return out

    def python_per_step(self) -> dict[str, Any] | None:
        """Whether the replicas' Python limits the step: this process's replicas are threads of one
        interpreter, so the Python each replica step runs (and torch's dispatch of each op) runs in
        series under its lock. Per step, the CPU the replica threads spent in their functions
        (`host_cpu_s`, summed over the replicas; less the profiler's own device syncs) against the wall
        time from the first replica's start to the last one's end (`window_s`), medians over the steps.
        On CPU replicas, whose kernels run on the same cores, `parallelism` = host_cpu / window says how
        many replicas progressed at once: far below the replicas the cores can hold (`usable`) they took
        turns at the lock - `limits` when under 3/4 of it, counting as run the time they waited for a
        free core (`core_wait_s`, summed over the replicas; `waited_cores`, that in cores' worth of the
        window: a busy machine, where Linux says). On GPUs the host CPU is Python and dispatch alone:
        `limits` when it is 0.8 of the window or more, the GPUs waiting for the host. `replicas` counts
        this process's (a worker of a multi-worker strategy shares no lock with the others). None
        without replica functions timed."""
        rows = [row for row in self._steps() if row["cpu_s"] and "window_ns" in row]
        if not rows:
            return None
        host = [sum(row["cpu_s"].values()) for row in rows]
        # (the replicas' window, not the slowest one's own span: a replica waiting for the lock before its
        # function starts would hide the wait)
        window = [(row["window_ns"][1] - row["window_ns"][0]) / 1e9 for row in rows]
        replicas = self._rec.local_replicas or max(len(row["replica_s"]) for row in rows)
        cuda = self._rec.device_type == "cuda"
        usable = replicas if cuda else max(1, min(replicas, self._rec.cores))
        parallelism = float(np.median([h / w for h, w in zip(host, window) if w > 0] or [0.0]))
        waits = [row["wait_s"] for row in rows if "wait_s" in row]
        # The replicas' time waiting for a free core, in cores' worth of the window: a busy machine's, not
        # the lock's (counted as if they had run).
        waited = (float(np.median([row["wait_s"] / w for row, w in zip(rows, window) if "wait_s" in row and w > 0]
                                  or [0.0])) if len(waits) == len(rows) else None)
        limits = parallelism >= 0.8 if cuda else usable >= 2 and parallelism + (waited or 0.0) < 0.75 * usable
        return {"replicas": replicas, "device_type": self._rec.device_type, "host_cpu_s": float(np.median(host)),
                "window_s": float(np.median(window)), "parallelism": parallelism, "usable": usable,
                "core_wait_s": float(np.median(waits)) if waited is not None else None,
                "waited_cores": waited, "limits": bool(limits)}

    def page_faults(self) -> dict[str, Any] | None:
        """The page faults the replica threads took in their step functions, and the CPU they spent in
        the kernel, per step (medians, summed over the replicas), with that kernel time's `fraction` of
        their CPU (this process's replicas). glibc's default malloc hands each step's activations back to the kernel and faults
        them in again on the replica threads (measured: 2,200-4,000 faults per replica step of ResNet-8
        at 32 per replica on 32x32, 10-23% of its CPU; tuned, 130-320), which mr.tune_allocator() stops:
        `limits` where the faults come to _FAULTS_NAMED or more per replica step (4 MB of fresh pages) and
        the kernel to 5% of the CPU or more (the kernel's time holds other calls too: the lock's waits on
        a busy box). None where the OS does not say (Linux does) or before a replica function was timed."""
        rows = [row for row in self._steps() if "faults" in row and row["cpu_s"]]
        if not rows:
            return None
        replicas = self._rec.local_replicas or max(len(row["cpu_s"]) for row in rows)
        faults = float(np.median([row["faults"] for row in rows]))
        kernel = float(np.median([row["kernel_s"] for row in rows]))
        cpu = float(np.median([sum(row["cpu_s"].values()) for row in rows]))
        fraction = kernel / cpu if cpu > 0 else 0.0
        return {"faults_per_step": faults, "kernel_s": kernel, "fraction": fraction,
                "limits": faults >= _FAULTS_NAMED * replicas and fraction >= 0.05}

    def bottleneck(self) -> str | None:
        """What limits the step, in words, with the numbers: "compute-bound: 97% of the step computes;
        all-reduce 1%; input 1%; overhead 1%", or "Python per step: ..." where the replicas' Python,
        in series under the interpreter lock, is what their compute waits for (python_per_step). None
        before any step was recorded."""
        phases = self.breakdown()
        if not phases["steps"] or not phases["wall_s"] > 0:
            return None
        order = sorted(PHASES, key=lambda name: -phases[name]["fraction"])
        name, doing, _ = _PHASE_WORDS[order[0]]
        rest = "; ".join(f"{_PHASE_WORDS[p][2]} {_percent(phases[p]['fraction'])}" for p in order[1:])
        # Replicas taking turns at the lock show in compute, in the all-reduce (the first waits there for the
        # last) and in overhead (the hand-off waits for the lock): any but input.
        python = self.python_per_step() if order[0] != "input" else None
        faults = self.page_faults()
        also = f"; and {_fault_words(faults)}" if faults is not None and faults["limits"] else ""
        if python is not None and python["limits"]:
            every = "; ".join(f"{_PHASE_WORDS[p][2]} {_percent(phases[p]['fraction'])}" for p in order)
            return f"{_python_words(python)}; {every}{also}"
        return f"{name}: {_percent(phases[order[0]]['fraction'])} of the step {doing}; {rest}{also}"

    def scaling(self, alone_step_s: float | None = None) -> dict[str, Any] | None:
        """Scaling efficiency against the limit, N replicas each as fast as one replica alone: one
        replica's step timed alone (`alone_step_s`, e.g. from `time_alone` on a per-replica batch) over
        the measured wall time per step (median of input wait + step). Without `alone_step_s`, this
        run's median compute time of the slowest replica stands in: that limit leaves out what the
        replicas cost each other (shared cores, caches, memory bandwidth), so its efficiency is an
        upper bound. None before any step was recorded."""
        if alone_step_s is not None and not (isinstance(alone_step_s, (int, float)) and alone_step_s > 0):
            raise ValueError(f"Profiler.scaling(alone_step_s={alone_step_s!r}): give one replica's step time "
                             "alone in seconds, a positive number (e.g. from mr.profiler.time_alone).")
        rows = self._steps()
        if not rows:
            return None
        measured = float(np.median([row["input_s"] + row["step_s"] for row in rows]))
        if alone_step_s is None:
            limit, source = float(np.median([_phases(row)["compute"] for row in rows])), "this run's compute"
        else:
            limit, source = float(alone_step_s), "timed alone"
        replicas = self._rec.replicas or max(1, len({r for row in rows for r in row["replica_s"]}))
        return {"replicas": replicas, "step_s": measured, "limit_step_s": limit, "limit_source": source,
                "efficiency": limit / measured if measured > 0 else None}

    def print_summary(self) -> None:
        """Prints summary() as a small table (the only output of this module that is printed)."""
        s = self.summary()
        head = f"Profiler: {s['steps']} step{'' if s['steps'] == 1 else 's'}"
        if s["images_per_s"] is not None:
            head += f", {s['images']} images, {s['images_per_s']:.1f} images/s"
        if s["input_fraction"] is not None:
            head += f"; {100 * s['input_fraction']:.1f}% of the time waiting for input"
        if s["memory_format"] is not None:
            head += f"; convolutions in {s['memory_format']} memory"
        rows = [("input wait", s["input_wait_s"]), ("step", s["step_s"])]
        for r, stats in s["compute_s"].items():
            rows.append((f"replica {r} compute", stats))
        for r, stats in s["all_reduce_s"].items():
            rows.append((f"replica {r} all-reduce", stats))
        lines = [head, f"{'':<22}{'median':>12}{'p90':>12}{'total':>12}"]
        lines += [f"{name:<22}{_ms(st['median']):>12}{_ms(st['p90']):>12}{_ms(st['total']):>12}"
                  for name, st in rows]
        python = s["python_per_step"]
        if python is not None:
            cuda = python["device_type"] == "cuda"
            waited = ("" if python["core_wait_s"] is None else
                      f"; they waited {_ms(python['core_wait_s'])} for a free core")
            lines.append(f"Python per step: the replicas' threads spent {_ms(python['host_cpu_s'])} of CPU in their "
                         f"step functions, in {_ms(python['window_s'])} from the first one's start to the last one's end "
                         f"({'host CPU / step' if cuda else 'parallelism'} {python['parallelism']:.2f}"
                         f"{'' if cuda else ' of ' + str(python['usable'])}{waited})")
        faults = s["page_faults"]
        if faults is not None:
            lines.append(f"Page faults: the replicas' threads took {faults['faults_per_step']:.0f} per step in their step "
                         f"functions, {_ms(faults['kernel_s'])} of CPU in the kernel ({_percent(faults['fraction'])} "
                         "of their CPU)")
        if s["bottleneck"] is not None:
            lines.append(s["bottleneck"])
        scaling = s["scaling"]
        if scaling is not None and scaling["efficiency"] is not None:
            lines.append(f"scaling efficiency {100 * scaling['efficiency']:.0f}% of the limit ({scaling['replicas']} "
                         f"replicas each at {_ms(scaling['limit_step_s'])} per step, {scaling['limit_source']}; "
                         f"measured {_ms(scaling['step_s'])})")
        print("\n".join(lines))

    def chrome_trace(self) -> dict[str, Any]:
        """The record in Chrome's trace event format: "X" events, microseconds, one tid per thread."""
        pid = os.getpid()
        spans = self.spans
        events: list[dict[str, Any]] = [{"name": "process_name", "ph": "M", "pid": pid, "tid": 0,
                                         "args": {"name": "mirrored"}}]
        for tid, (name, order) in self._thread_rows(spans).items():
            events.append({"name": "thread_name", "ph": "M", "pid": pid, "tid": tid, "args": {"name": name}})
            events.append({"name": "thread_sort_index", "ph": "M", "pid": pid, "tid": tid,
                           "args": {"sort_index": order}})
        for s in sorted(spans, key=lambda s: (s.start_ns, -s.end_ns)):
            args = dict(s.args)
            if s.step is not None:
                args.setdefault("step", s.step)
            if s.replica is not None:
                args["replica"] = s.replica
            events.append({"name": s.name, "cat": s.name, "ph": "X", "ts": s.start_ns / 1e3,
                           "dur": (s.end_ns - s.start_ns) / 1e3, "pid": pid, "tid": s.tid, "args": args})
        return {"traceEvents": events, "displayTimeUnit": "ms"}

    def _thread_rows(self, spans: tuple[Span, ...]) -> dict[int, tuple[str, int]]:
        """tid -> (row name, sort index): "main" (where steps are marked), "replica N", else the thread's name."""
        replicas: dict[int, set[int]] = {}
        for s in spans:
            replicas.setdefault(s.tid, set())
            if s.replica is not None:
                replicas[s.tid].add(s.replica)
        rows = {}
        for tid, ids in replicas.items():
            parts = (["main"] if tid == self._rec.main_tid else []) + [f"replica {r}" for r in sorted(ids)]
            order = 0 if tid == self._rec.main_tid else (1 + min(ids) if ids else 1_000_000)
            rows[tid] = (" / ".join(parts) or self._rec.thread_names.get(tid, str(tid)), order)
        return dict(sorted(rows.items(), key=lambda item: (item[1][1], item[0])))

    def save_chrome_trace(self, path: str | os.PathLike) -> None:
        """Writes chrome_trace() as JSON, for chrome://tracing or https://ui.perfetto.dev."""
        with open(path, "w") as f:
            json.dump(self.chrome_trace(), f, allow_nan=False)

    def plot(self, path: str | os.PathLike) -> None:
        """Writes a PNG: each step's time stacked as input / compute / all-reduce and, below, each
        replica's compute and all-reduce per step."""
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure

        rows = self._steps()
        replicas = sorted({r for row in rows for r in row["all_reduce_s"]})
        fig = Figure(figsize=(10, 6.5 if replicas else 4), dpi=100, layout="constrained")
        FigureCanvasAgg(fig)
        axes = fig.subplots(2 if replicas else 1, 1, sharex=True, squeeze=False)[:, 0]
        x = np.arange(len(rows))
        phases = [_phases(row) for row in rows]  # the slowest replica's, as breakdown() counts them
        ax = axes[0]
        bottom = np.zeros(len(rows))
        for name, label, color in (("input", "input wait", "tab:orange"), ("compute", "compute", "tab:blue"),
                                   ("all_reduce", "all-reduce", "tab:green"), ("overhead", "overhead", "tab:gray")):
            height = np.array([p[name] for p in phases]) * 1e3
            ax.bar(x, height, width=1.0, bottom=bottom, label=label, color=color)
            bottom += height
        summary = self.summary()
        rate = f", {summary['images_per_s']:.1f} images/s" if summary["images_per_s"] is not None else ""
        title = f"Step time breakdown ({len(rows)} steps{rate})"
        if summary["bottleneck"] is not None:
            title += f"\n{summary['bottleneck']}"
        ax.set_title(title, fontsize="medium")
        ax.set_ylabel("ms")
        ax.legend(loc="upper right")
        if not rows:
            ax.text(0.5, 0.5, "no steps recorded", ha="center", va="center", transform=ax.transAxes)
        if replicas:
            ax = axes[1]
            for r in replicas:
                ar = np.array([row["all_reduce_s"].get(r, np.nan) for row in rows]) * 1e3
                rs = np.array([row["replica_s"].get(r, np.nan) for row in rows]) * 1e3
                line = ax.plot(x, ar, label=f"replica {r} all-reduce")[0]
                ax.plot(x, rs - ar, linestyle="--", color=line.get_color(), label=f"replica {r} compute")
            ax.set_ylabel("ms")
            ax.set_title("Per replica")
            ax.legend(loc="upper right", fontsize="small", ncols=2)
        axes[-1].set_xlabel("step")
        fig.savefig(os.fspath(path), format="png")

    def __repr__(self) -> str:
        return f"Profiler(log_dir={self.log_dir!r}, steps={self._rec.next_step}, recording={self._recording})"


def time_alone(fn: Callable[..., Any], *args: Any, repeats: int = 5, warmup: int = 1, num_threads: int | None = None,
               device: str | None = None, **kwargs: Any) -> float:
    """Median seconds of fn(*args, **kwargs) on the calling thread, nothing else running: one replica's
    step alone, the limit that Profiler.scaling compares with. `num_threads`: torch's intra-op threads
    while timing (a CPU replica's share of the cores; restored after); `device` "cuda:N" waits for that
    GPU after each call."""
    if not callable(fn):
        raise TypeError(f"mr.profiler.time_alone(fn={fn!r}): fn must be callable (one replica's step).")
    if not (isinstance(repeats, int) and repeats >= 1) or not (isinstance(warmup, int) and warmup >= 0):
        raise ValueError(f"mr.profiler.time_alone(repeats={repeats!r}, warmup={warmup!r}): give repeats >= 1 and "
                         "warmup >= 0, whole numbers.")
    sync = _device_sync([device]) if device is not None else None
    before = torch.get_num_threads()
    if num_threads is not None:
        torch.set_num_threads(num_threads)
    try:
        times = []
        for i in range(warmup + repeats):
            start = _now()
            fn(*args, **kwargs)
            if sync is not None:
                sync()
            if i >= warmup:
                times.append((_now() - start) / 1e9)
    finally:
        torch.set_num_threads(before)
    return float(np.median(times))


def _python_words(python: dict[str, Any]) -> str:
    """python_per_step()'s verdict where it limits, in words with its numbers."""
    n, host, window = python["replicas"], _ms(python["host_cpu_s"]), _ms(python["window_s"])
    if python["device_type"] == "cuda":
        return (f"Python per step limits: the replicas' host work, {host} of CPU per step in their step functions "
                f"(Python and torch's dispatch, in series under the interpreter lock), is "
                f"{_percent(min(python['parallelism'], 1.0))} of the replicas' {window} (from the first one's start to "
                f"the last one's end): the GPUs wait for "
                "the host (fewer, larger ops per step: a larger batch per replica, jit_compile)")
    return (f"Python per step limits: {n} replicas spent {host} of CPU per step in their step functions against "
            f"{window} from the first one's start to the last one's end, a parallelism of {python['parallelism']:.2f} where {python['usable']} "
            "cores could run them at once: they took turns at the interpreter lock (fewer, larger ops per step: a "
            "larger batch per replica, fewer replicas with more intra-op threads each)")


_FAULTS_NAMED = 1024  # page faults per replica step from which page_faults() may name them


def _fault_words(faults: dict[str, Any]) -> str:
    """page_faults()'s verdict where it limits, in words with its numbers and the fix."""
    return (f"page faults: {faults['faults_per_step']:.0f} per step, {_ms(faults['kernel_s'])} in the kernel "
            f"({_percent(faults['fraction'])} of the replicas' CPU): glibc gives each step's freed memory back to "
            "the kernel; mr.tune_allocator() at the start of the program keeps it for reuse")


def _thread_usage() -> tuple[int, int] | None:
    """The calling thread's page faults (minor and major) and CPU in the kernel (ns) so far; None where
    the OS keeps no such count per thread (Linux does)."""
    if _RUSAGE_THREAD is None:
        return None
    usage = resource.getrusage(_RUSAGE_THREAD)
    return usage.ru_minflt + usage.ru_majflt, int(usage.ru_stime * 1e9)


def _cores() -> int:
    """The cores this process may run on (its affinity where the OS tells it)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def _phases(row: dict[str, Any]) -> dict[str, float]:
    """One step's wall time (input wait + step) as PHASES, adding up to it exactly."""
    step = row["step_s"]
    if row["replica_s"]:  # the slowest replica is the critical path; it waits least in the all-reduce
        slowest = max(row["replica_s"], key=row["replica_s"].get)
        body, reduce = row["replica_s"][slowest], row["all_reduce_s"].get(slowest, 0.0)
    else:  # no replica function timed (no strategy given): the fastest all-reduce is the communication
        body, reduce = step, min(row["all_reduce_s"].values(), default=0.0)
    body = min(body, step)  # a replica's function lies within its step; this only absorbs rounding
    reduce = min(reduce, body)
    return {"compute": body - reduce, "all_reduce": reduce, "input": row["input_s"], "overhead": step - body}


def _percent(fraction: float) -> str:
    return f"{100 * fraction:.0f}%" if fraction >= 0.095 or fraction == 0 else f"{100 * fraction:.1f}%"


def _stats(values: list[float]) -> dict[str, Any]:
    if not values:
        return {"count": 0, "median": None, "p90": None, "total": 0.0}
    a = np.asarray(values, dtype=np.float64)
    return {"count": len(a), "median": float(np.median(a)), "p90": float(np.percentile(a, 90)),
            "total": float(a.sum())}


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1e3:.2f} ms"
