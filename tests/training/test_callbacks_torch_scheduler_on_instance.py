"""Issue 14: a torch LR scheduler built on the optimizer instance given to compile(), as a PyTorch
script builds it, drives the model's mirrored optimizer once passed to mr.callbacks.TorchLRScheduler
(it used to change nothing: the replicas stayed at 0.1 while the instance showed 0.0125). Checked
against plain PyTorch with the same scheduler on 1, 2 and 3 CPU replicas. Misuse is reported: the
scheduler stepped by hand on the instance (a warning: the change does nothing), a torch scheduler
next to a Keras schedule, and a scheduler given to mr.train.Checkpoint (errors, nothing changed)."""
from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.optim import lr_scheduler

import mirrored as mr
from _replicas import strategy_of  # tests/_replicas.py

# As in test_optimizers_torch_instance.py: float reassociation of the gradient sum, a few ulps per step
# (measured below 1e-7 absolute after these 9 steps).
RTOL, ATOL = 1e-6, 2e-7
BATCH, EPOCHS = 8, 3


def _data(n: int = 24):
    g = torch.Generator().manual_seed(1)
    return torch.randn(n, 5, generator=g), torch.randint(0, 3, (n,), generator=g)


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 3))


def _groups(net: nn.Module, momentum: float = 0.9) -> torch.optim.Optimizer:
    return torch.optim.SGD([{"params": net[0].parameters()}, {"params": net[2].parameters(), "lr": 0.2}],
                           lr=0.1, momentum=momentum)


SCHEDULERS = {  # name: (scheduler on an optimizer, step_per)
    "step": (lambda opt: lr_scheduler.StepLR(opt, step_size=1, gamma=0.5), "epoch"),
    "one_cycle": (lambda opt: lr_scheduler.OneCycleLR(opt, max_lr=[0.3, 0.5], total_steps=EPOCHS * 3), "batch"),
    "lambda_per_group": (lambda opt: lr_scheduler.LambdaLR(opt, [lambda e: 0.5 ** e, lambda e: 1.0 / (1 + e)]),
                         "epoch"),
    "warmup_then_cosine": (lambda opt: lr_scheduler.SequentialLR(opt, [
        lr_scheduler.LinearLR(opt, start_factor=0.25, total_iters=2),
        lr_scheduler.CosineAnnealingLR(opt, T_max=4)], milestones=[2]), "batch"),
    "plateau": (lambda opt: lr_scheduler.ReduceLROnPlateau(opt, factor=0.5, patience=0, threshold=10.0), "epoch"),
}


def _plain(make, step_per: str, x, y) -> tuple[nn.Module, list[list[float]]]:
    net = _net()
    opt = _groups(net)
    sched = make(opt)
    rates = []
    for _ in range(EPOCHS):
        rates.append([g["lr"] for g in opt.param_groups])
        total = 0.0
        for i in range(0, len(x), BATCH):
            opt.zero_grad()
            loss = F.cross_entropy(net(x[i:i + BATCH]), y[i:i + BATCH])
            loss.backward()
            opt.step()
            total += loss.item() * len(x[i:i + BATCH])
            if step_per == "batch":
                sched.step()
        if isinstance(sched, lr_scheduler.ReduceLROnPlateau):
            sched.step(total / len(x))
        elif step_per == "epoch":
            sched.step()
    return net, rates


def _model(net: nn.Module, optimizer, replicas: int = 2) -> mr.Model:
    with strategy_of(replicas).scope():
        model = mr.Model(net)
        model.compile(optimizer=optimizer, loss="sparse_categorical_crossentropy")
    return model


class _Rates(mr.callbacks.Callback):
    """Every group's rate at each epoch's start, as the replicas' optimizers hold it."""

    def __init__(self):
        super().__init__()
        self.rates = []

    def on_epoch_begin(self, epoch, logs=None):
        replicas = self.model.mirrored_optimizer.replicas
        self.rates.append([g["lr"] for g in replicas[0].param_groups])
        assert all([g["lr"] for g in r.param_groups] == self.rates[-1] for r in replicas)


@pytest.mark.parametrize("replicas", [1, 2, 3])
@pytest.mark.parametrize("name", list(SCHEDULERS))
@pytest.mark.parametrize("built", ["before_compile", "after_compile"])
def test_a_scheduler_on_the_compiled_instance_trains_like_plain_torch(name, built, replicas):
    make, step_per = SCHEDULERS[name]
    x, y = _data()
    ref, ref_rates = _plain(make, step_per, x, y)
    net = _net()
    opt = _groups(net)
    sched = make(opt) if built == "before_compile" else None
    model = _model(net, opt, replicas)
    if sched is None:  # built after compile: its constructor changed the instance (OneCycleLR's rates)
        sched = make(opt)
    rates = _Rates()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # not torch's "optimizer.step() overridden" nor our "no effect"
        model.fit(x, y, batch_size=BATCH, epochs=EPOCHS, shuffle=False, verbose=0,
                  callbacks=[mr.callbacks.TorchLRScheduler(sched, step_per=step_per, monitor="loss"), rates])
    assert sched.optimizer is model.mirrored_optimizer
    np.testing.assert_allclose(rates.rates, ref_rates, rtol=1e-12)
    for got, (key, want) in zip(model.get_weights(), ref.state_dict().items()):
        np.testing.assert_allclose(got, want.numpy(), rtol=RTOL, atol=ATOL, err_msg=key)
    model.check_in_sync()
    assert model.mirrored_optimizer.state_dict()["lr_schedulers"][0]["last_epoch"] == sched.last_epoch


def test_the_moved_scheduler_is_saved_and_a_loaded_model_continues_it(tmp_path):
    """3 epochs, Model.save, load, 3 more with the same kind of scheduler (restored from the file):
    the rates and weights of 6 epochs straight."""
    x, y = _data()
    make = SCHEDULERS["step"][0]
    straight = _net()
    straight_opt = _groups(straight)
    model = _model(straight, straight_opt)
    model.fit(x, y, batch_size=BATCH, epochs=6, shuffle=False, verbose=0,
              callbacks=[mr.callbacks.TorchLRScheduler(make(straight_opt))])
    net = _net()
    opt = _groups(net)
    first = _model(net, opt)
    first.fit(x, y, batch_size=BATCH, epochs=3, shuffle=False, verbose=0,
              callbacks=[mr.callbacks.TorchLRScheduler(make(opt))])
    first.save(tmp_path / "m.safetensors")
    with mr.MirroredStrategy(devices=["cpu:0", "cpu:1"]).scope():
        loaded = mr.Model.load(tmp_path / "m.safetensors", module=_net())
    history = loaded.fit(x, y, batch_size=BATCH, epochs=3, shuffle=False, verbose=0,
                         callbacks=[mr.callbacks.TorchLRScheduler(make)])
    assert history.history["learning_rate"] == pytest.approx([0.1 * 0.5 ** e for e in (3, 4, 5)], rel=1e-12)
    for a, b in zip(loaded.get_weights(), model.get_weights()):
        np.testing.assert_array_equal(a, b)


class _ByHand(mr.callbacks.Callback):
    def __init__(self, scheduler):
        super().__init__()
        self.scheduler = scheduler

    def on_epoch_end(self, epoch, logs=None):
        self.scheduler.step()


@pytest.mark.filterwarnings("ignore:Detected call of `lr_scheduler")  # (torch's: the instance never steps)
def test_a_scheduler_stepped_by_hand_on_the_instance_is_reported():
    """A callback of the user's own steps the instance's scheduler: the replicas would not see it."""
    x, y = _data()
    net = _net()
    opt = _groups(net)
    sched = lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    model = _model(net, opt)
    by_hand = _ByHand(sched)
    with pytest.warns(UserWarning, match=r"SGD optimizer given to compile\(\) changed after compile \(group 0's lr "
                                         r"0\.1 -> 0\.05\).*no effect.*TorchLRScheduler\(scheduler\)") as caught:
        model.fit(x, y, batch_size=BATCH, epochs=3, verbose=0, callbacks=[by_hand])
    assert sum("changed after compile" in str(w.message) for w in caught) == 1  # once, not every epoch
    assert [g["lr"] for g in model.mirrored_optimizer.param_groups] == [0.1, 0.2]


def test_a_torch_scheduler_next_to_a_keras_schedule_is_refused():
    x, y = _data()
    schedule = mr.optimizers.schedules.ExponentialDecay(0.1, decay_steps=1, decay_rate=0.5)
    model = _model(_net(), mr.optimizers.SGD(learning_rate=schedule))
    weights = model.get_weights()
    groups = [dict(g) for g in model.mirrored_optimizer.param_groups]
    for scheduler in (lambda opt: lr_scheduler.StepLR(opt, step_size=1), None):
        if scheduler is None:  # one the user built on the model's optimizer
            scheduler = lr_scheduler.StepLR(model.mirrored_optimizer, step_size=1)
            groups = [dict(g) for g in model.mirrored_optimizer.param_groups]
        with pytest.raises(TypeError, match=r"TorchLRScheduler: the optimizer's learning_rate is the schedule "
                                            r"ExponentialDecay.*Use one of them"):
            model.fit(x, y, batch_size=BATCH, verbose=0, callbacks=[mr.callbacks.TorchLRScheduler(scheduler)])
        assert all(np.array_equal(a, b) for a, b in zip(model.get_weights(), weights))
        assert [dict(g) for g in model.mirrored_optimizer.param_groups] == groups
        assert "lr_schedulers" not in model.mirrored_optimizer.state_dict()


@pytest.mark.filterwarnings("ignore:Detected call of `lr_scheduler")  # (stepped with no training)
def test_a_scheduler_given_to_a_checkpoint_points_at_attach_lr_scheduler(tmp_path):
    strategy = mr.MirroredStrategy(devices=["cpu:0", "cpu:1"])
    with strategy.scope():
        mnet = strategy.mirror(_net())
        opt = strategy.mirror_optimizer(torch.optim.SGD, mnet, lr=0.1)
    sched = lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    with pytest.raises(TypeError, match=r"scheduler is a torch LR scheduler \(StepLR\).*"
                                        r"mirrored_optimizer\.attach_lr_scheduler\(scheduler\)"):
        mr.train.Checkpoint(model=mnet, optimizer=opt, scheduler=sched)
    assert not list(tmp_path.iterdir())
    opt.attach_lr_scheduler(sched)  # the way: its state travels with the optimizer's
    for _ in range(2):
        sched.step()
    prefix = mr.train.Checkpoint(model=mnet, optimizer=opt).save(str(tmp_path / "ckpt"))
    with strategy.scope():
        mnet2 = strategy.mirror(_net())
        opt2 = strategy.mirror_optimizer(torch.optim.SGD, mnet2, lr=0.1)
    sched2 = lr_scheduler.StepLR(opt2, step_size=1, gamma=0.5)
    opt2.attach_lr_scheduler(sched2)
    mr.train.Checkpoint(model=mnet2, optimizer=opt2).restore(prefix)
    assert sched2.last_epoch == 2 and [g["lr"] for g in opt2.param_groups] == [0.025]
