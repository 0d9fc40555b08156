"""Issue 14: torch LR schedulers in Model.fit through mr.callbacks.TorchLRScheduler, against a plain
PyTorch loop, and their state in Model.save and BackupAndRestore."""
from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.optim import lr_scheduler

import mirrored as mr
from _replicas import strategy_of  # tests/_replicas.py

# fit sums each replica's share of the global batch's mean loss: float reassociation only, a few ulps
# per step (measured below 1e-7 absolute after these 12 steps).
RTOL, ATOL = 1e-6, 2e-7


def _data(n: int = 24):
    g = torch.Generator().manual_seed(0)
    return torch.randn(n, 5, generator=g), torch.randint(0, 3, (n,), generator=g)


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 3))


def _model(net: nn.Module, optimizer, replicas: int = 2) -> mr.Model:
    with strategy_of(replicas).scope():
        model = mr.Model(net)
        model.compile(optimizer=optimizer, loss="sparse_categorical_crossentropy")
    return model


def _plain(make_sched, step_per: str, epochs: int, x, y, batch: int = 8):
    net = _net()
    opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    sched = make_sched(opt)
    rates = []
    for _ in range(epochs):
        rates.append(opt.param_groups[0]["lr"])
        for i in range(0, len(x), batch):
            opt.zero_grad()
            F.cross_entropy(net(x[i:i + batch]), y[i:i + batch]).backward()
            opt.step()
            if step_per == "batch":
                sched.step()
        if step_per == "epoch":
            sched.step()
    return net, rates


def _assert_weights(model: mr.Model, ref: nn.Module) -> None:
    for got, (name, want) in zip(model.get_weights(), ref.state_dict().items()):
        np.testing.assert_allclose(got, want.numpy(), rtol=RTOL, atol=ATOL, err_msg=name)
    model.check_in_sync()


@pytest.mark.parametrize("replicas", [1, 2, 3])
def test_compile_with_a_torch_optimizer_and_step_lr_trains_like_plain_torch(replicas):
    x, y = _data()
    ref, rates = _plain(lambda opt: lr_scheduler.StepLR(opt, step_size=1, gamma=0.5), "epoch", 3, x, y)
    net = _net()
    model = _model(net, torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9), replicas)
    history = model.fit(x, y, batch_size=8, epochs=3, shuffle=False, verbose=0, callbacks=[
        mr.callbacks.TorchLRScheduler(lambda opt: lr_scheduler.StepLR(opt, step_size=1, gamma=0.5))])
    assert history.history["learning_rate"] == pytest.approx(rates) == [0.1, 0.05, 0.025]
    _assert_weights(model, ref)


def test_one_cycle_lr_steps_per_batch():
    x, y = _data()
    make = lambda opt: lr_scheduler.OneCycleLR(opt, max_lr=0.3, total_steps=9)  # noqa: E731
    ref, _ = _plain(make, "batch", 3, x, y)
    model = _model(_net(), mr.optimizers.SGD(learning_rate=0.1, momentum=0.9))
    sched = make(model.mirrored_optimizer)  # built on the model's optimizer, after compile
    model.fit(x, y, batch_size=8, epochs=3, shuffle=False, verbose=0,
              callbacks=[mr.callbacks.TorchLRScheduler(sched, step_per="batch")])
    assert sched.last_epoch == 9
    _assert_weights(model, ref)


def test_reduce_lr_on_plateau_steps_with_the_monitored_value():
    x, y = _data()
    model = _model(_net(), mr.optimizers.SGD(learning_rate=0.1))
    sched = lr_scheduler.ReduceLROnPlateau(model.mirrored_optimizer, mode="max", factor=0.5, patience=0)
    history = model.fit(x, y, batch_size=8, epochs=3, verbose=0,
                        callbacks=[mr.callbacks.TorchLRScheduler(sched, monitor="loss")])
    # mode="max" on a falling loss: no epoch improves on the first, so the end of each one after it
    # halves the rate (epoch 3 runs at 0.05, and 0.025 is left for a next one).
    assert history.history["learning_rate"] == pytest.approx([0.1, 0.1, 0.05])
    assert {o.param_groups[0]["lr"] for o in model.mirrored_optimizer.values} == {0.025}


def test_a_scheduler_of_another_optimizer_is_refused():
    net = _net()
    model = _model(net, torch.optim.SGD(net.parameters(), lr=0.1))
    other = torch.optim.SGD(_net().parameters(), lr=0.1)  # (one on the compiled instance is moved instead)
    x, y = _data()
    with pytest.raises(ValueError, match="not this model's optimizer.*model.mirrored_optimizer"):
        model.fit(x, y, batch_size=8, verbose=0,
                  callbacks=[mr.callbacks.TorchLRScheduler(lr_scheduler.StepLR(other, step_size=1))])
    with pytest.raises(ValueError, match="step_per"):
        mr.callbacks.TorchLRScheduler(lambda opt: lr_scheduler.StepLR(opt, 1), step_per="step")


@pytest.mark.parametrize("make", [
    lambda opt: lr_scheduler.StepLR(opt, step_size=2, gamma=0.5),
    # Its milestones are a Counter of epochs, a dict with int keys, which JSON cannot key: it used
    # to make the save fail with a TypeError.
    lambda opt: lr_scheduler.MultiStepLR(opt, milestones=[2, 4, 5], gamma=0.5),
], ids=["StepLR", "MultiStepLR"])
def test_model_save_keeps_the_schedule_and_load_continues_it(tmp_path, make):
    """3 epochs, save, load, 3 more (a new callback, its scheduler restored from the file): the
    weights and rates of 6 epochs straight."""
    x, y = _data()
    ref, rates = _plain(make, "epoch", 6, x, y)
    model = _model(_net(), mr.optimizers.SGD(learning_rate=0.1, momentum=0.9))
    first = model.fit(x, y, batch_size=8, epochs=3, shuffle=False, verbose=0,
                      callbacks=[mr.callbacks.TorchLRScheduler(make)])
    model.save(tmp_path / "model.safetensors")
    with mr.MirroredStrategy(devices=["cpu:0", "cpu:1"]).scope():
        loaded = mr.Model.load(tmp_path / "model.safetensors", module=_net())
    second = loaded.fit(x, y, batch_size=8, epochs=6, initial_epoch=3, shuffle=False, verbose=0,
                        callbacks=[mr.callbacks.TorchLRScheduler(make)])
    assert first.history["learning_rate"] + second.history["learning_rate"] == pytest.approx(rates)
    _assert_weights(loaded, ref)


class _Crash(Exception):
    pass


def _fit_with_backup(backup, crash_after: int | None, step_per: str) -> tuple[mr.Model, list[float]]:
    x, y = _data()
    make = (lambda opt: lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)) if step_per == "epoch" else \
        (lambda opt: lr_scheduler.OneCycleLR(opt, max_lr=0.3, total_steps=12))
    model = _model(_net(), mr.optimizers.SGD(learning_rate=0.1, momentum=0.9))
    rates = []

    class Crash(mr.callbacks.Callback):
        seen = 0

        def on_train_batch_begin(self, batch, logs=None):
            rates.append(model.mirrored_optimizer.param_groups[0]["lr"])

        def on_train_batch_end(self, batch, logs=None):
            Crash.seen += 1
            if Crash.seen == crash_after:
                raise _Crash()

    callbacks = [mr.callbacks.TorchLRScheduler(make, step_per=step_per),
                 mr.callbacks.BackupAndRestore(str(backup), save_freq=2), Crash()]
    try:
        model.fit(x, y, batch_size=8, epochs=4, shuffle=False, verbose=0, callbacks=callbacks)
    except _Crash:
        pass
    return model, rates


@pytest.mark.parametrize("step_per", ["epoch", "batch"])
def test_backup_and_restore_resumes_the_schedule(tmp_path, step_per):
    """Crashed after batch 7 of 12 (the last backup after batch 6, mid-epoch): the resumed run trains
    the last 6 batches at the uninterrupted run's rates and ends with its weights, bit for bit."""
    want, want_rates = _fit_with_backup(tmp_path / "plain", None, step_per)
    _fit_with_backup(tmp_path / "backup", 7, step_per)
    got, rates = _fit_with_backup(tmp_path / "backup", None, step_per)
    assert rates == want_rates[6:]
    for a, b in zip(got.get_weights(), want.get_weights()):
        np.testing.assert_array_equal(a, b)


def test_a_model_saved_with_one_cycle_lr_loads_before_its_scheduler_is_attached(tmp_path):
    """OneCycleLR writes max_lr, min_lr, max_momentum and base_momentum into the param groups; a
    file saved with it loads into a fresh model (whose optimizer has none of them yet), and the
    schedule continues where it was, as 6 epochs straight."""
    x, y = _data()
    make = lambda opt: lr_scheduler.OneCycleLR(opt, max_lr=0.3, total_steps=18)  # noqa: E731
    ref, _ = _plain(make, "batch", 6, x, y)
    model = _model(_net(), mr.optimizers.SGD(learning_rate=0.1, momentum=0.9))
    model.fit(x, y, batch_size=8, epochs=3, shuffle=False, verbose=0,
              callbacks=[mr.callbacks.TorchLRScheduler(make, step_per="batch")])
    model.save(tmp_path / "model.safetensors")
    with mr.MirroredStrategy(devices=["cpu:0", "cpu:1"]).scope():
        loaded = mr.Model.load(tmp_path / "model.safetensors", module=_net())
    loaded.fit(x, y, batch_size=8, epochs=6, initial_epoch=3, shuffle=False, verbose=0,
               callbacks=[mr.callbacks.TorchLRScheduler(make, step_per="batch")])
    _assert_weights(loaded, ref)
