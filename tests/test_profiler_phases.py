"""mr.profiler's breakdown (issue 15): the phases of a step add up to it, the bottleneck is named in
words with its numbers, scaling is measured against one replica alone, and on CUDA every span boundary
waits for the device. Arithmetic is checked against spans and clocks scripted by hand; a real fit
checks only structure and sums, never how fast anything is. The CUDA path runs here with a scripted
device (torch.cuda.synchronize replaced); the real-GPU test is marked `cuda`."""
from __future__ import annotations

import time

import pytest
import torch
import torch.nn.functional as F

import mirrored as mr
from mirrored import profiler as profiler_lib
from mirrored.profiler import Span
from _replicas import replica_id  # tests/_replicas.py

MS = 1_000_000  # ns
N_EXAMPLES, GLOBAL_BATCH = 48, 8


class _Clock:
    """A scripted perf_counter_ns: time moves only when the test says so."""

    def __init__(self):
        self.ns = 0

    def __call__(self):
        return self.ns

    def advance_ms(self, ms):
        self.ns += int(ms * MS)


def _scripted_profiler() -> mr.profiler.Profiler:
    """Two steps of a 2-replica record, written span by span (ms):
    step 0: input 2, step 10; replica 0 runs 8 of which all-reduce 1, replica 1 runs 6 of which 3.
    step 1: input 1, step 20; replica 0 runs 12 of which 2, replica 1 runs 18 of which 1."""
    profiler = mr.profiler.Profiler()
    spans = profiler._rec.spans
    t = 0
    for step, (inp, dur, bodies) in enumerate([(2, 10, {0: (8, 1), 1: (6, 3)}), (1, 20, {0: (12, 2), 1: (18, 1)})]):
        spans.append(Span("input", t * MS, (t + inp) * MS, 1, None, step))
        t += inp
        spans.append(Span("step", t * MS, (t + dur) * MS, 1, None, step, {"num_examples": 8}))
        for r, (body, reduce) in bodies.items():
            spans.append(Span("replica_step", t * MS, (t + body) * MS, 2 + r, r, step))
            spans.append(Span("all_reduce", (t + body - reduce) * MS, (t + body) * MS, 2 + r, r, step))
        t += dur
    return profiler


def test_phases_of_scripted_steps_match_a_hand_computation():
    b = _scripted_profiler().breakdown()
    # By hand, the slowest replica of each step: step 0 replica 0 (compute 7, all-reduce 1, overhead
    # 10 - 8 = 2, input 2); step 1 replica 1 (compute 17, all-reduce 1, overhead 2, input 1).
    want_ms = {"compute": 24, "all_reduce": 2, "input": 3, "overhead": 4}
    assert b["steps"] == 2 and b["wall_s"] == pytest.approx(33e-3)
    for name, ms in want_ms.items():
        assert b[name]["total_s"] == pytest.approx(ms * 1e-3), name
        assert b[name]["fraction"] == pytest.approx(ms / 33), name


def test_the_bottleneck_is_named_in_words_with_every_phase():
    assert _scripted_profiler().bottleneck() == (
        "compute-bound: 73% of the step computes; overhead 12%; input 9.1%; all-reduce 6.1%")
    assert mr.profiler.Profiler().bottleneck() is None  # nothing recorded


@pytest.mark.parametrize("slow, words", [("input", "input-bound: 70% of the step waits for input"),
                                         ("all_reduce", "all-reduce-bound: 70% of the step all-reduces"),
                                         ("overhead", "overhead-bound: 70% of the step is overhead")])
def test_each_phase_can_be_the_bottleneck(slow, words):
    # one step of 10 ms wall: 7 ms in `slow`, 1 ms in each other phase
    ms = {"compute": 1, "all_reduce": 1, "input": 1, "overhead": 1, slow: 7}
    body = ms["compute"] + ms["all_reduce"]
    step = body + ms["overhead"]
    profiler = mr.profiler.Profiler()
    profiler._rec.spans += [
        Span("input", 0, ms["input"] * MS, 1, None, 0),
        Span("step", ms["input"] * MS, (ms["input"] + step) * MS, 1, None, 0),
        Span("replica_step", ms["input"] * MS, (ms["input"] + body) * MS, 2, 0, 0),
        Span("all_reduce", (ms["input"] + ms["compute"]) * MS, (ms["input"] + body) * MS, 2, 0, 0)]
    text = profiler.bottleneck()
    assert text.startswith(words) and text.count("10%") == 3, text


def test_scaling_against_one_replica_alone_and_against_this_runs_compute():
    profiler = _scripted_profiler()
    # measured: median wall per step of (12, 21) ms = 16.5 ms; alone: 10.5 ms per step
    given = profiler.scaling(alone_step_s=10.5e-3)
    assert given["efficiency"] == pytest.approx(10.5 / 16.5)
    assert given["step_s"] == pytest.approx(16.5e-3) and given["limit_source"] == "timed alone"
    estimated = profiler.scaling()  # limit: median compute of the slowest replica, (7, 17) -> 12 ms
    assert estimated["limit_step_s"] == pytest.approx(12e-3)
    assert estimated["efficiency"] == pytest.approx(12 / 16.5)
    assert estimated["replicas"] == 2
    with pytest.raises(ValueError, match="alone_step_s=0"):
        profiler.scaling(alone_step_s=0)
    assert mr.profiler.Profiler().scaling() is None


def test_time_alone_is_the_median_after_warmup_and_restores_threads(monkeypatch):
    clock = _Clock()
    monkeypatch.setattr(profiler_lib, "_now", clock)
    durations = iter([50, 3, 6, 4])  # the first call is warm-up
    seen_threads = []

    def step():
        seen_threads.append(torch.get_num_threads())
        clock.advance_ms(next(durations))

    before = torch.get_num_threads()
    assert mr.profiler.time_alone(step, repeats=3, num_threads=1) == pytest.approx(4e-3)
    assert seen_threads == [1] * 4 and torch.get_num_threads() == before
    with pytest.raises(ValueError, match="repeats=0"):
        mr.profiler.time_alone(step, repeats=0)


# ---- a real fit: structure and sums only ------------------------------------------------------------
def _model(strategy):
    torch.manual_seed(0)
    with strategy.scope():
        model = mr.Model(torch.nn.Sequential(torch.nn.Linear(5, 32), torch.nn.Tanh(), torch.nn.Linear(32, 3)))
        model.compile(optimizer=mr.optimizers.SGD(learning_rate=0.1), loss="sparse_categorical_crossentropy")
    return model


def _dataset():
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(N_EXAMPLES, 5, generator=g), torch.randint(0, 3, (N_EXAMPLES,), generator=g)
    return mr.data.Dataset.from_tensor_slices((x, y)).batch(GLOBAL_BATCH), x, y


def test_fit_phases_add_up_to_the_profiled_time_and_name_the_bottleneck(capsys):
    strategy = mr.MirroredStrategy(devices=["cpu:0", "cpu:1"])
    model = _model(strategy)
    ds, x, y = _dataset()
    profiler = mr.profiler.Profiler()
    model.fit(ds, epochs=2, verbose=0, callbacks=[profiler])
    s = profiler.summary()
    phases = s["phases"]
    wall = s["input_wait_s"]["total"] + s["step_s"]["total"]  # the step and input spans, summed on their own
    parts = sum(phases[name]["total_s"] for name in profiler_lib.PHASES)
    assert phases["steps"] == s["steps"] == 2 * N_EXAMPLES // GLOBAL_BATCH
    assert parts == pytest.approx(wall, rel=0.05)
    assert sum(phases[name]["fraction"] for name in profiler_lib.PHASES) == pytest.approx(1.0, rel=0.05)
    assert all(phases[name]["total_s"] >= 0 for name in profiler_lib.PHASES)
    assert phases["all_reduce"]["total_s"] > 0  # every step all-reduced its gradients
    # the slowest replica's compute and all-reduce lie within its steps
    assert phases["compute"]["total_s"] + phases["all_reduce"]["total_s"] <= s["step_s"]["total"] * (1 + 1e-9)
    words = s["bottleneck"]
    assert words.split(":")[0] in {"compute-bound", "all-reduce-bound", "input-bound", "overhead-bound",
                                   "Python per step limits"}
    for short in ("compute", "all-reduce", "input", "overhead"):
        assert short in words
    python = s["python_per_step"]  # (this model's tiny steps are mostly Python: either verdict may come)
    assert python["replicas"] == 2 and python["device_type"] == "cpu" and python["host_cpu_s"] > 0
    assert 0 < python["parallelism"] <= 2.2 and python["window_s"] > 0

    # the limit: one replica's step (its half of the global batch, one intra-op thread) timed alone
    net = model.replicas[0]
    xb, yb = x[:GLOBAL_BATCH // 2], y[:GLOBAL_BATCH // 2]

    def one_replica_step():
        net.zero_grad(set_to_none=True)
        F.cross_entropy(net(xb), yb).backward()

    alone = mr.profiler.time_alone(one_replica_step, repeats=3, num_threads=1)
    net.zero_grad(set_to_none=True)
    scaling = profiler.scaling(alone_step_s=alone)
    assert scaling["replicas"] == 2 and scaling["efficiency"] == pytest.approx(alone / scaling["step_s"])
    profiler.print_summary()
    out = capsys.readouterr().out
    assert words in out and "scaling efficiency" in out and "Python per step: the replicas' threads spent" in out


# ---- Python per step (issue 35): the replicas' CPU in their functions against the wall time they ran in ----
def _python_profiler(bodies: dict[int, tuple[float, float, float]], device_type: str = "cpu",
                     cores: int = 2) -> mr.profiler.Profiler:
    """One 10 ms step (ms): replica r runs from start to end with `cpu` of its thread's CPU."""
    profiler = mr.profiler.Profiler()
    profiler._rec.device_type, profiler._rec.cores = device_type, cores
    profiler._rec.replicas = profiler._rec.local_replicas = len(bodies)
    profiler._rec.spans += [Span("input", 0, 0, 1, None, 0), Span("step", 0, 10 * MS, 1, None, 0)]
    for r, (start, end, cpu) in bodies.items():
        profiler._rec.spans.append(Span("replica_step", int(start * MS), int(end * MS), 2 + r, r, 0,
                                        {"cpu_ns": int(cpu * MS)}))
    return profiler


def test_replicas_taking_turns_at_the_lock_are_named_python_per_step():
    # Each replica ran 4.5 ms of CPU, one after the other: 9 ms of CPU in a 9.5 ms window, parallelism ~0.95.
    turns = _python_profiler({0: (0, 4.5, 4.5), 1: (4.5, 9.5, 4.5)})
    python = turns.python_per_step()
    assert python == {"replicas": 2, "device_type": "cpu", "host_cpu_s": pytest.approx(9e-3),
                      "window_s": pytest.approx(9.5e-3), "parallelism": pytest.approx(9 / 9.5), "usable": 2,
                      "core_wait_s": None, "waited_cores": None, "limits": True}  # (no wait recorded: not said)
    words = turns.bottleneck()
    assert words.startswith("Python per step limits: 2 replicas spent 9.00 ms of CPU per step in their step "
                            "functions against 9.50 ms from the first one's start to the last one's end, a "
                            "parallelism of 0.95 where 2 cores could run them at once"), words
    # (the breakdown counts the slowest replica's own span as compute: the turn it waited for is overhead)
    assert words.endswith("; compute 50%; overhead 50%; all-reduce 0%; input 0%"), words
    # At once, each on its core: parallelism 2, and compute is what limits.
    together = _python_profiler({0: (0, 9, 9), 1: (0, 9, 9)})
    assert together.python_per_step()["parallelism"] == pytest.approx(2) and not together.python_per_step()["limits"]
    assert together.bottleneck().startswith("compute-bound: 90% of the step computes")
    # Replicas that waited for a free core (another process on the box) are not blamed on the lock: each
    # waited 4 ms of its 9.5 ms window, which counts as if it had run.
    busy_box = _python_profiler({0: (0, 4.5, 4.5), 1: (4.5, 9.5, 4.5)})
    for span in busy_box._rec.spans:
        if span.name == "replica_step":
            span.args["wait_ns"] = 4 * MS
    python = busy_box.python_per_step()
    assert python["core_wait_s"] == pytest.approx(8e-3) and python["waited_cores"] == pytest.approx(8 / 9.5)
    assert not python["limits"] and busy_box.bottleneck().startswith("compute-bound")
    # Two replicas on one core take turns whatever their Python: that is the cores' limit, not the lock's.
    one_core = _python_profiler({0: (0, 4.5, 4.5), 1: (4.5, 9.5, 4.5)}, cores=1)
    assert one_core.python_per_step()["usable"] == 1 and not one_core.python_per_step()["limits"]
    assert mr.profiler.Profiler().python_per_step() is None


def test_a_worker_of_a_multi_worker_strategy_counts_only_its_own_replicas():
    """One replica per worker on 2 workers: num_replicas_in_sync is 2, but this process's one replica
    thread shares its lock with nobody. Counting the other worker's replica made a lone replica at 0.9
    of its window look like 2 replicas taking turns, and the lock was blamed; and page faults are
    named per replica of this process."""
    lone = _python_profiler({0: (0, 9.5, 9)})
    lone._rec.replicas = 2  # (strategy.num_replicas_in_sync; local_replicas stays 1)
    python = lone.python_per_step()
    assert python["replicas"] == 1 and python["usable"] == 1 and not python["limits"], python
    assert lone.bottleneck().startswith("compute-bound"), lone.bottleneck()
    for span in lone._rec.spans:
        if span.name == "replica_step":
            span.args.update(faults=1500, kernel_ns=int(1.8 * MS))  # 1,500 faults: named for 1 replica, not 2
    assert lone.page_faults()["limits"] and "and page faults: 1500 per step" in lone.bottleneck()


def test_on_gpus_python_per_step_is_the_hosts_cpu_against_the_replicas_window():
    waiting = _python_profiler({0: (0, 9, 4.5), 1: (0, 9.5, 4.5)}, device_type="cuda")
    python = waiting.python_per_step()
    assert python["parallelism"] == pytest.approx(9 / 9.5) and python["usable"] == 2 and python["limits"]
    assert waiting.bottleneck().startswith("Python per step limits: the replicas' host work, 9.00 ms of CPU per "
                                           "step in their step functions")
    assert "the GPUs wait for the host" in waiting.bottleneck()
    busy_gpus = _python_profiler({0: (0, 9, 1), 1: (0, 9.5, 1)}, device_type="cuda")
    assert not busy_gpus.python_per_step()["limits"]
    assert busy_gpus.bottleneck().startswith("compute-bound")


def test_a_replica_step_of_pure_python_is_named_python_per_step():
    """Real replica threads: a step function that only runs Python holds the interpreter lock, so two
    replicas take turns (parallelism about 1 of 2 whatever the box's load) and the verdict says so."""
    strategy = mr.MirroredStrategy(devices=["cpu:0", "cpu:1"])

    def python_only():
        return sum(i * i for i in range(20000))

    profiler = mr.profiler.Profiler()
    with profiler.start(strategy=strategy):
        for _ in range(8):
            with profiler.step():
                strategy.run(python_only)
    python = profiler.python_per_step()
    assert python["device_type"] == "cpu" and python["replicas"] == 2
    if python["core_wait_s"] is not None:  # (Linux: the wait for a free core is read per replica thread)
        assert python["core_wait_s"] >= 0
    if python["usable"] < 2 or (python["waited_cores"] or 0) > 0.25:
        pytest.skip("one core, or a box too busy to tell the lock from the cores")
    assert python["parallelism"] < 1.3 and python["limits"], python
    assert profiler.bottleneck().startswith("Python per step limits: 2 replicas spent")


def test_the_hosts_cpu_leaves_out_what_the_profilers_device_syncs_spin(monkeypatch):
    """On CUDA a device sync spins on the host; the profiler's own syncs around each replica span and each
    all-reduce are not the step's host work. Scripted device: each sync burns ~5 ms of CPU."""
    def spinning_sync():
        end = time.thread_time_ns() + 5 * MS
        while time.thread_time_ns() < end:
            pass

    monkeypatch.setattr(profiler_lib, "_device_sync", lambda devices: (lambda: None))
    monkeypatch.setattr(profiler_lib, "_sync_current", spinning_sync)
    strategy = mr.MirroredStrategy(devices=["cpu:0", "cpu:1"])
    with strategy.scope():
        mnet = strategy.mirror(torch.nn.Linear(5, 3))
        opt = strategy.mirror_optimizer(torch.optim.SGD, mnet, lr=0.1)

    def step_fn():
        mnet(torch.ones(2, 5)).sum().backward()
        opt.step()  # (its all-reduce is timed too: two more syncs inside the replica's function)
        opt.zero_grad()

    profiler = mr.profiler.Profiler()
    with profiler.start(optimizer=opt, strategy=strategy):
        for _ in range(4):
            with profiler.step():
                strategy.run(step_fn)
    python = profiler.python_per_step()
    assert python["device_type"] == "cuda"
    # Each replica's function holds two spinning syncs (~10 ms of CPU, 20 for both); its own work is far less.
    assert python["host_cpu_s"] < 5e-3, python


# ---- CUDA: synchronised span boundaries, with a scripted device ---------------------------------------
def test_device_sync_waits_for_each_gpu_of_the_strategy(monkeypatch):
    calls = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: calls.append(device))
    assert profiler_lib._device_sync(["cpu:0", "cpu:1"]) is None
    profiler_lib._device_sync(["cuda:1", "cuda:0", "cuda:1"])()
    assert calls == [0, 1]


def test_a_span_holds_the_device_work_its_call_queued(monkeypatch):
    """A scripted device: each synchronize waits 2 ms for queued kernels. The span starts after the
    work queued before it is done and ends after its own is done: 5 ms of host work + 2 ms tail."""
    clock = _Clock()
    monkeypatch.setattr(profiler_lib, "_now", clock)
    rec = profiler_lib._Recorder()
    timed = profiler_lib._timed(rec, "all_reduce", lambda: clock.advance_ms(5), sync=lambda: clock.advance_ms(2))
    timed()
    (span,) = rec.spans
    assert span.end_ns - span.start_ns == 7 * MS and span.start_ns == 2 * MS


def test_on_cuda_devices_the_profiler_synchronises_steps_and_replica_spans(monkeypatch):
    """start() with a strategy on GPUs waits for them at each step boundary (main thread) and around
    every replica span (on the replica's thread). The device is scripted: the strategy runs on CPU
    replicas, and the profiler is told its devices are GPUs."""
    main_syncs, replica_syncs = [], []
    monkeypatch.setattr(profiler_lib, "_device_sync", lambda devices: (lambda: main_syncs.append(tuple(devices))))
    monkeypatch.setattr(profiler_lib, "_sync_current", lambda: replica_syncs.append(replica_id()))
    strategy = mr.MirroredStrategy(devices=["cpu:0", "cpu:1"])
    with strategy.scope():
        mnet = strategy.mirror(torch.nn.Linear(5, 3))
        opt = strategy.mirror_optimizer(torch.optim.SGD, mnet, lr=0.1)
    ds, _, _ = _dataset()

    def step_fn(xb, yb):
        loss = F.cross_entropy(mnet(xb), yb, reduction="none")
        mr.losses.compute_average_loss(loss, global_batch_size=GLOBAL_BATCH).backward()
        opt.step()
        opt.zero_grad()

    profiler = mr.profiler.Profiler()
    steps = 0
    with profiler.start(optimizer=opt, strategy=strategy):
        for xb, yb in strategy.experimental_distribute_dataset(ds):
            with profiler.step(num_examples=GLOBAL_BATCH):
                strategy.run(step_fn, args=(xb, yb))
            steps += 1
    assert main_syncs == [("cpu:0", "cpu:1")] * (2 * steps)  # at each step's start and end
    # per replica and step: before and after its function, before and after its all-reduce
    assert sorted(replica_syncs) == [0] * (4 * steps) + [1] * (4 * steps)
    assert profiler.breakdown()["steps"] == steps


@pytest.mark.cuda
def test_fit_on_a_gpu_phases_add_up_to_the_profiled_time():
    strategy = mr.MirroredStrategy(devices=["cuda:0"])
    model = _model(strategy)
    ds, _, _ = _dataset()
    profiler = mr.profiler.Profiler()
    model.fit(ds, epochs=2, verbose=0, callbacks=[profiler])
    s = profiler.summary()
    wall = s["input_wait_s"]["total"] + s["step_s"]["total"]
    assert sum(s["phases"][name]["total_s"] for name in profiler_lib.PHASES) == pytest.approx(wall, rel=0.05)
    assert s["bottleneck"] is not None and s["scaling"]["efficiency"] > 0


# ---- page faults: glibc's malloc giving each step's activations back to the kernel ----------------------
def test_page_faults_are_counted_per_step_and_named_with_the_fix_where_they_cost(capsys):
    """Each replica's page faults and kernel CPU in its function, summed per step (medians over steps):
    named in bottleneck() with mr.tune_allocator() where they come to 1,024 or more per replica step and
    the kernel to 5% or more of the replicas' CPU; said in print_summary either way."""
    def with_faults(faults: int, kernel_ms: float) -> mr.profiler.Profiler:
        profiler = _python_profiler({0: (0, 9, 9), 1: (0, 9, 9)})
        for span in profiler._rec.spans:
            if span.name == "replica_step":
                span.args.update(faults=faults, kernel_ns=int(kernel_ms * MS))
        return profiler

    faulting = with_faults(3000, 1.8)  # per replica: 3000 faults, 1.8 ms of its 9 ms in the kernel
    assert faulting.page_faults() == {"faults_per_step": 6000, "kernel_s": pytest.approx(3.6e-3),
                                      "fraction": pytest.approx(0.2), "limits": True}
    words = faulting.bottleneck()
    assert words.startswith("compute-bound: 90% of the step computes") and words.endswith(
        "; and page faults: 6000 per step, 3.60 ms in the kernel (20% of the replicas' CPU): glibc gives each "
        "step's freed memory back to the kernel; mr.tune_allocator() at the start of the program keeps it for "
        "reuse"), words
    faulting.print_summary()
    assert ("Page faults: the replicas' threads took 6000 per step in their step functions, 3.60 ms of CPU in "
            "the kernel (20% of their CPU)") in capsys.readouterr().out
    for few, cheap in ((1000, 1.8), (3000, 0.3)):  # few faults, or little kernel time: not named
        quiet = with_faults(few, cheap)
        assert not quiet.page_faults()["limits"] and "page faults" not in quiet.bottleneck()
    assert _python_profiler({0: (0, 9, 9)}).page_faults() is None  # (no counts recorded: the OS said nothing)


_FAULTING_FIT = """
import json, sys, warnings
warnings.simplefilter("ignore")
sys.path.insert(0, {src!r})
import torch
import mirrored as mr
if {tune}:
    assert mr.tune_allocator()
strategy = mr.MirroredStrategy(devices=["cpu:0", "cpu:1"])
with strategy.scope():
    model = mr.Model(mr.models.resnet_cifar(depth=8, num_classes=10, data_format="channels_first"))
    model.compile(optimizer=mr.optimizers.SGD(learning_rate=0.01), loss="sparse_categorical_crossentropy")
g = torch.Generator().manual_seed(0)
x, y = torch.rand(64 * 6, 3, 32, 32, generator=g), torch.randint(0, 10, (64 * 6,), generator=g)
profiler = mr.profiler.Profiler()
model.fit(x, y, batch_size=64, verbose=0, callbacks=[profiler])
print(json.dumps(profiler.page_faults()))
"""


@pytest.mark.skipif(not hasattr(__import__("resource"), "RUSAGE_THREAD") or __import__("platform").libc_ver()[0]
                    != "glibc", reason="per-thread page faults are Linux's; mallopt is glibc's")
def test_a_fit_on_glibcs_default_malloc_is_told_to_tune_it():
    """Real replica threads, each in a fresh process: a small ResNet at 32 per replica faults its
    activations in again every step on glibc's defaults (4,400-8,100 faults per step and 10-23% of the
    replicas' CPU in the kernel, measured) and the profiler names it; after mr.tune_allocator() the
    faults drop 7-24 fold (256-645 measured; asserted: 4 fold) and nothing is named, even where a busy
    box puts 11% of the CPU in the kernel (the lock's waits)."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    src = str(Path(__file__).resolve().parents[1] / "src")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MALLOC_", "GLIBC_TUNABLES"))}
    found = {}
    for tune in (False, True):
        out = subprocess.run([sys.executable, "-c", _FAULTING_FIT.format(src=src, tune=tune)], capture_output=True,
                             text=True, timeout=240, check=True, env=env)
        found[tune] = json.loads(out.stdout.strip().splitlines()[-1])
    assert found[False]["faults_per_step"] > 2 * 1024, found
    assert found[True]["faults_per_step"] * 4 < found[False]["faults_per_step"] and not found[True]["limits"], found
    if found[False]["fraction"] >= 0.05:  # (the kernel's share varies with the box: the count is what is sure)
        assert found[False]["limits"], found
