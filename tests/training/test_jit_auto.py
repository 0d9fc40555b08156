"""Issue 29: compile(jit_compile="auto") starts eager and fit compiles after its first steps only where
the steps left, at the measured step time, save more than compiling costs; the decision is logged.
The rule is checked against its closed form, and fit's both outcomes against an eager fit (the
aot_eager backend runs the same kernels: bitwise equal)."""
from __future__ import annotations

import logging

import pytest
import torch

import mirrored as mr
from mirrored.training import jit

N_EXAMPLES, GLOBAL_BATCH = 48, 8  # 6 steps an epoch


def test_pays_back_weighs_the_time_saved_against_the_compile_time():
    # 10,000 steps of 100 ms at 1.15x save 10,000 * 0.1 * (1 - 1/1.15) = 130.4 s > 120 s.
    ok, why = jit.pays_back(0.1, 10_000, compile_s=120.0, speedup=1.15)
    assert ok and why.startswith("compiling: 10000 steps left at 100.0 ms each would save ~130 s")
    ok, why = jit.pays_back(0.1, 9_000, compile_s=120.0, speedup=1.15)  # 117.4 s < 120 s
    assert not ok and why.startswith("eager:")
    ok, why = jit.pays_back(0.1, None)
    assert not ok and "length is unknown" in why


def _fit(jit_compile, epochs=2):
    g = torch.Generator().manual_seed(2)
    x, y = torch.randn(N_EXAMPLES, 5, generator=g), torch.randint(0, 3, (N_EXAMPLES,), generator=g)
    torch.manual_seed(0)
    strategy = mr.MirroredStrategy(devices=["cpu:0", "cpu:1"])
    with strategy.scope():
        model = mr.Model(torch.nn.Sequential(torch.nn.Linear(5, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3)))
        model.compile(optimizer=mr.optimizers.SGD(learning_rate=0.1), loss="sparse_categorical_crossentropy",
                      jit_compile=jit_compile)
    model.fit(mr.data.Dataset.from_tensor_slices((x, y)).batch(GLOBAL_BATCH), epochs=epochs, verbose=0)
    return model


def test_a_short_fit_stays_eager_and_says_why(caplog):
    with caplog.at_level(logging.INFO, logger="mirrored.training.jit"):
        model = _fit("auto")
    assert not model.jit_compile
    # 3 steps timed: 9 of the 12 batches are left (6 a epoch, 2 epochs).
    assert any(r.getMessage().startswith('Model.fit(jit_compile="auto"): eager: 9 steps left at ')
               for r in caplog.records), caplog.text
    for got, want in zip(model.module.parameters(), _fit(False).module.parameters()):
        assert torch.equal(got, want)


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_a_fit_that_pays_back_compiles_after_its_first_steps(monkeypatch, caplog):
    monkeypatch.setattr(jit, "AUTO_COMPILE_S", 0.0)  # any run pays back
    monkeypatch.setattr(jit, "BACKEND", "aot_eager")  # dynamo + AOTAutograd, the eager kernels: bitwise
    try:  # (dynamo's progress bar would start tqdm's process-wide monitor thread, which outlives the test)
        import tqdm

        monkeypatch.setattr(tqdm.tqdm, "monitor_interval", 0)
    except ImportError:
        pass
    with caplog.at_level(logging.INFO, logger="mirrored.training.jit"):
        model = _fit("auto")
    assert model.jit_compile
    assert any(r.getMessage().startswith('Model.fit(jit_compile="auto"): compiling: 9 steps left')
               for r in caplog.records), caplog.text
    for got, want in zip(model.module.parameters(), _fit(False).module.parameters()):
        assert torch.equal(got, want)
    model.check_in_sync()
