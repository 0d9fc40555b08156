"""mr.profiler: a fit() on two CPU replicas and a custom loop give a well-formed timeline; the hooks'
arithmetic is checked Keras-style, with scripted logs and a scripted clock. Nothing here asserts
how fast anything is: only structure, counts, containment and exact arithmetic."""
from __future__ import annotations

import json
import os

import pytest
import torch
import torch.nn.functional as F

import mirrored as mr
from mirrored import profiler as profiler_lib
from mirrored.distribute import MirroredOptimizer

N_EXAMPLES, GLOBAL_BATCH, EPOCHS = 40, 8, 2
STEPS = EPOCHS * N_EXAMPLES // GLOBAL_BATCH
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
TOL_US = 1e-3  # ts and dur are ns / 1000 in floats: containment holds up to rounding


def _data():
    g = torch.Generator().manual_seed(1)
    return torch.randn(N_EXAMPLES, 5, generator=g), torch.randint(0, 3, (N_EXAMPLES,), generator=g)


def _net():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(5, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))


def _fit(callbacks, labels=None):
    x, y = _data()
    strategy = mr.MirroredStrategy(devices=["cpu:0", "cpu:1"])
    with strategy.scope():
        model = mr.Model(_net())
        model.compile(optimizer=mr.optimizers.SGD(learning_rate=0.1, momentum=0.9),
                      loss="sparse_categorical_crossentropy", metrics=["accuracy"])
    ds = mr.data.Dataset.from_tensor_slices((x, y if labels is None else labels)).batch(GLOBAL_BATCH)
    model.fit(ds, epochs=EPOCHS, verbose=0, callbacks=callbacks)
    return model, strategy


def _within(inner, outer):
    return outer["ts"] - TOL_US <= inner["ts"] and inner["ts"] + inner["dur"] <= outer["ts"] + outer["dur"] + TOL_US


def _assert_unwrapped(model, strategy):
    assert "reduce_gradients" not in vars(model._mopt)
    assert model._mopt.reduce_gradients.__func__ is MirroredOptimizer.reduce_gradients
    assert "run" not in vars(strategy)
    assert strategy.run.__func__ is type(strategy).run


def test_fit_writes_a_chrome_trace_with_steps_on_main_and_all_reduce_on_each_replica(tmp_path):
    profiler = mr.profiler.Profiler(log_dir=tmp_path)
    _fit([profiler])

    trace = json.loads((tmp_path / "trace.json").read_text())
    events = trace["traceEvents"]
    assert {e["pid"] for e in events} == {os.getpid()}
    names = {e["tid"]: e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "thread_name"}
    tid_of = {name: tid for tid, name in names.items()}
    assert set(tid_of) == {"main", "replica 0", "replica 1"}
    spans = [e for e in events if e["ph"] == "X"]
    for e in spans:
        assert e["ts"] >= 0 and e["dur"] >= 0, e
        assert {"name", "ts", "dur", "pid", "tid"} <= set(e)

    steps = {e["args"]["step"]: e for e in spans if e["name"] == "step"}
    assert sorted(steps) == list(range(STEPS))
    assert {e["tid"] for e in steps.values()} == {tid_of["main"]}
    assert [e["args"]["num_examples"] for e in steps.values()] == [GLOBAL_BATCH] * STEPS
    for replica in (0, 1):
        tid = tid_of[f"replica {replica}"]
        reduces = [e for e in spans if e["tid"] == tid and e["name"] == "all_reduce"]
        bodies = {e["args"]["step"]: e for e in spans if e["tid"] == tid and e["name"] == "replica_step"}
        assert len(reduces) == STEPS and sorted(bodies) == list(range(STEPS))
        for e in reduces:  # nested: all_reduce in the replica's function, which runs within the step
            assert e["args"]["replica"] == replica
            assert _within(e, bodies[e["args"]["step"]]), (e, bodies[e["args"]["step"]])
        for step, e in bodies.items():
            assert _within(e, steps[step]), (e, steps[step])
    for e in spans:  # input waits and steps on the main thread do not overlap
        if e["name"] == "input":
            assert e["ts"] + e["dur"] <= steps[e["args"]["step"]]["ts"] + TOL_US

    assert (tmp_path / "timeline.png").read_bytes()[:8] == PNG_MAGIC


def test_summary_counts_every_step_and_replica():
    profiler = mr.profiler.Profiler()
    _fit([profiler])
    s = profiler.summary()
    assert s["steps"] == STEPS
    assert s["input_wait_s"]["count"] == s["step_s"]["count"] == STEPS
    assert set(s["all_reduce_s"]) == set(s["compute_s"]) == {0, 1}
    for per_replica in (s["all_reduce_s"], s["compute_s"]):
        for stats in per_replica.values():
            assert stats["count"] == STEPS
            assert 0 <= stats["median"] <= stats["p90"]
    assert s["images"] == EPOCHS * N_EXAMPLES
    assert s["images_per_s"] > 0
    assert 0 <= s["input_fraction"] <= 1


def test_wrappers_are_removed_after_fit_and_training_is_unchanged():
    profiler = mr.profiler.Profiler()
    model, strategy = _fit([profiler])
    _assert_unwrapped(model, strategy)
    reference, _ = _fit([])  # the same run unprofiled: timing wrappers must change nothing
    for got, want in zip(model.module.parameters(), reference.module.parameters()):
        assert torch.equal(got, want)


def test_stop_removes_the_wrappers_after_a_fit_that_raised():
    profiler = mr.profiler.Profiler()
    x, _ = _data()
    strategy = mr.MirroredStrategy(devices=["cpu:0", "cpu:1"])
    with strategy.scope():
        model = mr.Model(_net())
        model.compile(optimizer="sgd", loss="sparse_categorical_crossentropy")
    bad = mr.data.Dataset.from_tensor_slices((x, torch.full((N_EXAMPLES,), 7))).batch(GLOBAL_BATCH)
    with pytest.raises(ValueError, match="label 7"):
        model.fit(bad, verbose=0, callbacks=[profiler])
    assert "reduce_gradients" in vars(model._mopt)  # on_train_end does not run when fit raises, as in Keras
    profiler.stop()
    _assert_unwrapped(model, strategy)


def test_custom_loop_with_step_and_trace():
    x, y = _data()
    strategy = mr.MirroredStrategy(devices=["cpu:0", "cpu:1"])
    with strategy.scope():
        mnet = strategy.mirror(_net())
        opt = strategy.mirror_optimizer(torch.optim.SGD, mnet, lr=0.1)

    def step_fn(xb, yb):
        with mr.profiler.trace("forward"):
            loss = F.cross_entropy(mnet(xb), yb, reduction="none")
        mr.losses.compute_average_loss(loss, global_batch_size=GLOBAL_BATCH).backward()
        opt.step()
        opt.zero_grad()

    profiler = mr.profiler.Profiler()
    batches = iter(strategy.experimental_distribute_dataset(
        mr.data.Dataset.from_tensor_slices((x, y)).batch(GLOBAL_BATCH)))
    with profiler.start(optimizer=opt, strategy=strategy):
        while True:
            with mr.profiler.trace("next_batch"):
                batch = next(batches, None)
            if batch is None:
                break
            with profiler.step(num_examples=GLOBAL_BATCH):
                strategy.run(step_fn, args=batch)
    assert "reduce_gradients" not in vars(opt) and "run" not in vars(strategy)

    n = N_EXAMPLES // GLOBAL_BATCH
    spans = profiler.spans
    s = profiler.summary()
    assert s["steps"] == n and s["images"] == N_EXAMPLES
    assert all(stats["count"] == n for stats in s["all_reduce_s"].values())
    steps = {sp.step: sp for sp in spans if sp.name == "step"}
    inputs = {sp.step: sp for sp in spans if sp.name == "input"}
    bodies = {(sp.replica, sp.step): sp for sp in spans if sp.name == "replica_step"}
    forwards = [sp for sp in spans if sp.name == "forward"]
    assert sorted((sp.replica, sp.step) for sp in forwards) == sorted(bodies) == [
        (r, i) for r in (0, 1) for i in range(n)]
    for sp in forwards:
        body = bodies[(sp.replica, sp.step)]
        assert body.tid == sp.tid
        assert steps[sp.step].start_ns <= body.start_ns <= sp.start_ns <= sp.end_ns <= body.end_ns
        assert body.end_ns <= steps[sp.step].end_ns
    fetches = [sp for sp in spans if sp.name == "next_batch"]
    assert len(fetches) == n + 1 and all(sp.replica is None and sp.step is None for sp in fetches)
    for i, sp in enumerate(fetches[:n]):  # fetching batch i is part of the input wait before step i
        assert inputs[i].start_ns <= sp.start_ns <= sp.end_ns <= inputs[i].end_ns

    count = len(profiler.spans)
    with mr.profiler.trace("after_stop"):  # no profiler recording: a no-op
        pass
    assert len(profiler.spans) == count


class _Clock:
    """A scripted perf_counter_ns: time moves only when the test says so."""

    def __init__(self):
        self.ns = 0

    def __call__(self):
        return self.ns

    def advance_ms(self, ms):
        self.ns += int(ms * 1_000_000)


class DummyModel:
    """Has neither an optimizer nor a strategy: the profiler only marks steps."""


def test_hooks_with_scripted_logs_and_clock(monkeypatch, tmp_path):
    clock = _Clock()
    monkeypatch.setattr(profiler_lib, "_now", clock)
    profiler = mr.profiler.Profiler()
    profiler.set_model(DummyModel())
    profiler.on_train_begin()
    # (input wait ms, step ms) per batch; 100 ms of validation between the epochs is not input wait.
    epochs = [[(1, 10), (2, 20), (4, 30)], [(3, 40)]]
    for epoch, batches in enumerate(epochs):
        clock.advance_ms(100)
        profiler.on_epoch_begin(epoch)
        for batch, (wait_ms, step_ms) in enumerate(batches):
            clock.advance_ms(wait_ms)
            profiler.on_train_batch_begin(batch)
            clock.advance_ms(step_ms)
            profiler.on_train_batch_end(batch, {"loss": 1.0, "num_examples": 4})
        profiler.on_epoch_end(epoch, {"loss": 1.0})
    profiler.on_train_end()

    s = profiler.summary()
    # Reference by hand: waits 1, 2, 4, 3 ms; steps 10, 20, 30, 40 ms; numpy's linear p90 of
    # [1, 2, 3, 4] is 3 + 0.7 * (4 - 3).
    assert s["steps"] == 4
    assert s["input_wait_s"] == pytest.approx({"count": 4, "median": 2.5e-3, "p90": 3.7e-3, "total": 10e-3})
    assert s["step_s"] == pytest.approx({"count": 4, "median": 25e-3, "p90": 37e-3, "total": 100e-3})
    assert s["all_reduce_s"] == {} and s["compute_s"] == {}
    assert s["images"] == 16
    assert s["images_per_s"] == pytest.approx(16 / 0.110)
    assert s["input_fraction"] == pytest.approx(10 / 110)
    step_args = [sp.args for sp in profiler.spans if sp.name == "step"]
    assert step_args == [{"epoch": 0, "batch": 0, "num_examples": 4}, {"epoch": 0, "batch": 1, "num_examples": 4},
                         {"epoch": 0, "batch": 2, "num_examples": 4}, {"epoch": 1, "batch": 0, "num_examples": 4}]

    profiler.save_chrome_trace(tmp_path / "t.json")
    events = json.loads((tmp_path / "t.json").read_text())["traceEvents"]
    assert [e["dur"] for e in events if e["name"] == "step"] == [10_000, 20_000, 30_000, 40_000]  # microseconds
    profiler.plot(tmp_path / "t.png")
    assert (tmp_path / "t.png").read_bytes()[:8] == PNG_MAGIC


def test_print_summary_prints_and_an_empty_record_still_plots(capsys, tmp_path):
    profiler = mr.profiler.Profiler()
    s = profiler.summary()
    assert s["steps"] == 0 and s["step_s"]["median"] is None and s["images_per_s"] is None
    profiler.plot(tmp_path / "empty.png")
    assert (tmp_path / "empty.png").read_bytes()[:8] == PNG_MAGIC
    with profiler:
        with profiler.step(num_examples=3):
            pass
    profiler.print_summary()
    out = capsys.readouterr().out
    assert "Profiler: 1 step, 3 images" in out and "input wait" in out


def test_misuse_is_reported():
    profiler = mr.profiler.Profiler()
    with pytest.raises(RuntimeError, match="before start"):
        profiler.on_train_batch_begin(0)
    with pytest.raises(TypeError, match="MirroredOptimizer"):
        profiler.start(optimizer=object())
    with pytest.raises(TypeError, match="non-empty string"):
        with mr.profiler.trace(""):
            pass
    with profiler:
        with pytest.raises(RuntimeError, match="already recording"):
            profiler.start()
        with profiler.step():
            with pytest.raises(RuntimeError, match="do not nest"):
                with profiler.step():
                    pass
    assert profiler.summary()["steps"] == 1
