"""Model.compile(jit_compile=True) (issue 15) against the same model run eager: the reference is the
eager path on the same data and seeds.

With backend "aot_eager" (dynamo and AOTAutograd, no code generation: no C++ compiler needed) the
compiled run performs the same kernels in the same order, so results are bitwise equal. With
inductor (where a C++ compiler exists), fused kernels reassociate float sums: this net's weights
differ from eager by at most 1.5e-7 after 4 SGD steps (measured), so the tolerance is rtol=1e-4,
atol=1e-5: ~60x that drift, and far below what one step changes. In both cases the replicas stay
bitwise identical (check_in_sync): they apply the same all-reduced gradient.
"""
from __future__ import annotations

import copy
import warnings

import numpy as np
import pytest
import torch

import mirrored as mr
from mirrored.training import jit
from _replicas import strategy_of  # tests/_replicas.py

N_EXAMPLES, GLOBAL_BATCH = 22, 8  # batches of 8, 8, 6: parts of 4 then 3 on 2 replicas (a recompile)
TIMEOUT_S = 60.0


class Fault(Exception):
    pass


class _Net(torch.nn.Module):
    """A conv + BatchNorm + linear net (BatchNorm: buffers the compiled graph mutates); `armed` makes
    its forward raise, to fail a step inside the compiled region."""

    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 6, 3, padding=1)
        self.bn = torch.nn.BatchNorm2d(6)
        self.fc = torch.nn.Linear(6, 3)
        self.armed = False

    def forward(self, x):
        if self.armed:
            raise Fault("armed")
        h = torch.relu(self.bn(self.conv(x)))
        return self.fc(h.mean(dim=(2, 3)))


def _data(n: int = N_EXAMPLES, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 3, 6, 6, generator=g), torch.randint(0, 3, (n,), generator=g)


def _dataset(x, y, batch: int = GLOBAL_BATCH):
    return mr.data.Dataset.from_tensor_slices((x, y)).batch(batch)


def _model(jit_compile, replicas: int = 2, **compile_kwargs) -> mr.Model:
    torch.manual_seed(0)
    strategy = strategy_of(replicas, timeout_s=TIMEOUT_S)
    with strategy.scope():
        model = mr.Model(_Net())
        model.compile(optimizer=mr.optimizers.SGD(learning_rate=0.1, momentum=0.9),
                      loss="sparse_categorical_crossentropy", metrics=["accuracy"], jit_compile=jit_compile,
                      **compile_kwargs)
    return model


@pytest.fixture(scope="module", autouse=True)
def _compiler_threads(compiler_threads):
    """torch.compile's process-wide helper threads, started before the per-test thread check (conftest)."""


@pytest.fixture
def graphs(monkeypatch):
    """jit_compile=True compiles with aot_eager (bitwise eager) and records each graph dynamo makes."""
    made = []
    aot_eager = torch._dynamo.lookup_backend("aot_eager")

    def counting(gm, example_inputs, **kwargs):
        made.append(gm)
        return aot_eager(gm, example_inputs, **kwargs)

    monkeypatch.setattr(jit, "BACKEND", counting)
    return made


def _run(model: mr.Model, x, y, epochs: int = 2):
    history = model.fit(_dataset(x, y), epochs=epochs, verbose=0, validation_data=_dataset(x, y)).history
    evaluated = model.evaluate(_dataset(x, y), verbose=0, return_dict=True)
    predicted = model.predict(x, batch_size=GLOBAL_BATCH, verbose=0)
    return history, evaluated, predicted


def _state(model: mr.Model) -> list[np.ndarray]:
    return model.get_weights() + [t.numpy() for t in _momenta(model)]


def _momenta(model: mr.Model) -> list[torch.Tensor]:
    return [s["momentum_buffer"] for s in model.mirrored_optimizer.state_dict()["state"].values()]


def test_jit_compile_auto_is_eager_as_keras_on_torch_and_bad_values_are_refused():
    model = _model("auto")
    assert model.jit_compile is False
    assert all(m._compiled_call_impl is None for m in model.replicas)
    with pytest.raises(ValueError, match=r"jit_compile='yes'.*True.*False.*\"auto\""):
        _model("yes")


@pytest.mark.parametrize("options", [{}, {"steps_per_execution": 2}, {"precision": "bf16"}])
def test_aot_eager_fit_evaluate_predict_are_bitwise_eager(graphs, options):
    x, y = _data()
    eager = _model(False, **options)
    want = _run(eager, x, y)
    model = _model(True, **options)
    assert model.jit_compile is True
    got = _run(model, x, y)
    assert graphs, "nothing was compiled"
    assert got[0] == want[0] and got[1] == want[1]  # history (val_ included) and evaluate: exactly
    np.testing.assert_array_equal(got[2], want[2])
    for a, b in zip(_state(model), _state(eager)):
        np.testing.assert_array_equal(a, b)
    model.check_in_sync()
    # model(x) goes through the compiled call too
    np.testing.assert_array_equal(model(x[:4]).detach().numpy(), eager(x[:4]).detach().numpy())


def test_replicas_share_one_graph_compiled_once(graphs):
    """Both replica threads reach the new signature together; one compiles, the other reuses it
    (dynamo alone would compile it once per thread that missed its cache)."""
    x, y = _data(3 * GLOBAL_BATCH)
    model = _model(True)
    model.fit(_dataset(x, y), epochs=1, verbose=0)  # step 1 eager (the first-run module check), 2-3 compiled
    assert len(graphs) == 1
    model.check_in_sync()


needs_cxx = pytest.mark.skipif(jit.find_cpp_compiler() is None, reason="inductor needs a C++ compiler on CPU")
# inductor's own code calls torch.jit.script_method, which warns that it is deprecated
quiet_inductor = pytest.mark.filterwarnings("ignore:.*torch.jit.script_method:DeprecationWarning")


def _assert_close_to_eager(got, want):
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)


@needs_cxx
@quiet_inductor
def test_inductor_fit_matches_eager_within_the_stated_tolerance():
    """One graph (train: forward and backward), ~5-15 s of compiling cold on 2 cores; the slow test
    below adds the uneven last batch, evaluate and predict."""
    x, y = _data(2 * GLOBAL_BATCH)
    models, losses = {}, {}
    for jit_compile in (False, True):
        model = models[jit_compile] = _model(jit_compile)
        with warnings.catch_warnings():
            warnings.filterwarnings("error", message=".*running eager", category=UserWarning)
            losses[jit_compile] = model.fit(_dataset(x, y), epochs=2, verbose=0).history["loss"]  # steps 2-4 compiled
        assert model.jit_compile is jit_compile
    _assert_close_to_eager(losses[True], losses[False])
    for a, b in zip(_state(models[True]), _state(models[False])):
        _assert_close_to_eager(a, b)
    models[True].check_in_sync()  # bitwise, whatever the kernels


@pytest.mark.slow
@needs_cxx
@quiet_inductor
def test_inductor_fit_evaluate_predict_with_uneven_batches_match_eager_within_the_stated_tolerance():
    x, y = _data()
    eager = _model(False)
    want = _run(eager, x, y)
    model = _model(True)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*running eager", category=UserWarning)
        got = _run(model, x, y)
    for key in want[0]:
        np.testing.assert_allclose(got[0][key], want[0][key], rtol=1e-4, atol=1e-5, err_msg=key)
    for key in want[1]:
        np.testing.assert_allclose(got[1][key], want[1][key], rtol=1e-4, atol=1e-5, err_msg=key)
    _assert_close_to_eager(got[2], want[2])
    for a, b in zip(_state(model), _state(eager)):
        _assert_close_to_eager(a, b)
    model.check_in_sync()


def test_no_cpp_compiler_warns_once_naming_the_fix_and_runs_eager(monkeypatch, tmp_path):
    from torch._inductor import config

    monkeypatch.setenv("PATH", str(tmp_path))  # no cc, g++ or clang on it
    monkeypatch.delenv("CXX", raising=False)
    monkeypatch.setattr(config.cpp, "cxx", (None, "g++"))
    assert jit.find_cpp_compiler() is None
    x, y = _data()
    with pytest.warns(UserWarning) as caught:
        model = _model(True)
        got = _run(model, x, y)
    messages = [str(w.message) for w in caught if "running eager" in str(w.message)]
    assert len(messages) == 1, messages
    assert "C++ compiler" in messages[0] and "apt-get install g++" in messages[0] and "CXX" in messages[0]
    assert model.jit_compile is False
    assert all(m._compiled_call_impl is None for m in model.replicas)
    want = _run(_model(False), x, y)
    assert got[0] == want[0]
    np.testing.assert_array_equal(got[2], want[2])


def test_sync_batchnorm_runs_eager_with_a_warning(graphs):
    """SyncBatchNorm's forward meets the other replicas: not compiled (a replica compiling under the
    lock would wait in the all-reduce for one waiting on the lock)."""
    strategy = mr.MirroredStrategy(devices=["cpu:0", "cpu:1"], timeout_s=TIMEOUT_S)
    with strategy.scope():
        model = mr.Model(mr.layers.convert_sync_batchnorm(_Net()))
        with pytest.warns(UserWarning, match="running eager: the module has SyncBatchNorm"):
            model.compile(optimizer="sgd", loss="sparse_categorical_crossentropy", jit_compile=True)
    x, y = _data(2 * GLOBAL_BATCH)
    model.fit(_dataset(x, y), epochs=1, verbose=0)
    assert model.jit_compile is False and not graphs


def test_a_failing_compile_warns_once_with_its_cause_and_the_step_runs_eager(monkeypatch):
    def broken(gm, example_inputs, **kwargs):
        raise RuntimeError("no luck today")

    monkeypatch.setattr(jit, "BACKEND", broken)
    x, y = _data()
    model = _model(True)
    with pytest.warns(UserWarning) as caught:
        got = _run(model, x, y)
    messages = [str(w.message) for w in caught if "running eager" in str(w.message)]
    assert len(messages) == 1, messages
    assert "RuntimeError: no luck today" in messages[0] and "jit_compile=False" in messages[0]
    assert model.jit_compile is False
    want = _run(_model(False), x, y)
    assert got[0] == want[0] and got[1] == want[1]
    np.testing.assert_array_equal(got[2], want[2])
    model.check_in_sync()


@pytest.mark.parametrize("where", ["loss", "forward"])
def test_a_failed_compiled_step_leaves_no_trace(graphs, where):
    """Issue 17 with jit: replica 1 fails (a bad label in its half, or its compiled forward raises)
    after replica 0 ran its compiled forward and backward; gradients, BatchNorm statistics, momenta
    and metrics are as before, and the rest equals a clean run bit for bit."""
    x, y = _data(4 * GLOBAL_BATCH)
    clean = _model(True)
    clean.fit(_dataset(x, y), epochs=1, verbose=0, shuffle=False)
    model = _model(True)
    model.fit(_dataset(x[:2 * GLOBAL_BATCH], y[:2 * GLOBAL_BATCH]), epochs=1, verbose=0, shuffle=False)
    before, logs = _state(model), model._logs()
    bad_x, bad_y = x[2 * GLOBAL_BATCH:3 * GLOBAL_BATCH], y[2 * GLOBAL_BATCH:3 * GLOBAL_BATCH].clone()
    if where == "loss":
        bad_y[-1] = 7  # in replica 1's half
        expected = ValueError
    else:
        model.replicas[1].armed = True
        expected = Fault
    with pytest.raises(expected, match="replica 1"):
        model.fit(_dataset(bad_x, bad_y), epochs=1, verbose=0, shuffle=False)
    model.replicas[1].armed = False
    for a, b in zip(_state(model), before):
        np.testing.assert_array_equal(a, b)
    assert all(p.grad is None for m in model.replicas for p in m.parameters())
    model.check_in_sync()
    model.fit(_dataset(x[2 * GLOBAL_BATCH:], y[2 * GLOBAL_BATCH:]), epochs=1, verbose=0, shuffle=False)
    for a, b in zip(_state(model), _state(clean)):
        np.testing.assert_array_equal(a, b)
    del logs


def test_save_and_load_keep_jit_compile(graphs, tmp_path):
    x, y = _data()
    model = _model(True)
    model.fit(_dataset(x, y), epochs=1, verbose=0)
    model.save(tmp_path / "jit.safetensors")
    loaded = mr.Model.load(tmp_path / "jit.safetensors", module=_Net())
    assert loaded.jit_compile is True and loaded._compile_config["jit_compile"] is True
    np.testing.assert_array_equal(loaded.predict(x, batch_size=GLOBAL_BATCH, verbose=0),
                                  model.predict(x, batch_size=GLOBAL_BATCH, verbose=0))
    _model("auto").save(tmp_path / "eager.safetensors")
    assert mr.Model.load(tmp_path / "eager.safetensors", module=_Net()).jit_compile is False


def test_compiling_again_without_jit_and_copies_of_a_compiled_module_are_eager(graphs):
    model = _model(True)
    assert all(m._compiled_call_impl is not None for m in model.replicas)
    assert copy.deepcopy(model.module)._compiled_call_impl is None  # not the original's graph and weights
    model.compile(optimizer="sgd", loss="sparse_categorical_crossentropy", jit_compile=False)
    assert model.jit_compile is False
    assert all(m._compiled_call_impl is None for m in model.replicas)


@pytest.mark.slow
@pytest.mark.timeout(330)
@needs_cxx
def test_the_benchmark_runs_and_prints_its_table():
    """benchmarks/jit_compile.py at tiny settings, so it does not rot (its numbers mean nothing here);
    a cold compile of the smallest ResNet took 1-2 minutes on the shared 2-core box."""
    import re
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parents[2] / "benchmarks" / "jit_compile.py"
    proc = subprocess.run([sys.executable, str(script), "--quick", "--batches", "8", "--depth", "8"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert re.search(r"^\s+8\s+\d+\s+\d+\s+[0-9.]+\s+-?[0-9.]+\s+[0-9.e+-]+$", proc.stdout, re.M), proc.stdout
