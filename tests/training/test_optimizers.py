"""Keras 3's optimizer options (issue 13) on 1, 2 and 3 CPU replicas, against plain PyTorch on one
device over the whole global batch: a learning-rate schedule, clipnorm / global_clipnorm / clipvalue
(torch.nn.utils.clip_grad_norm_ / clip_grad_value_ on the global gradient), gradient accumulation
(one step on a k-times bigger batch), and EMA (the moving average written out step by step here).
In fit() and in custom loops (strategy.mirror_optimizer(mr.optimizers.SGD(...), mnet))."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import mirrored as mr
from _replicas import strategy_of  # tests/_replicas.py

N, BATCH = 24, 12  # 2 global batches per epoch: 12 over 1, 2, 3 replicas
# Float reassociation only (the replicas' partial sums of each gradient are added in another order
# than one device's): a few ulps per step, as in test_model_options.py; clipping rescales by a norm
# computed from those sums, and torch's clip_grad_norm_ adds 1e-6 to the norm, both within this.
RTOL, ATOL = 2e-6, 1e-6


def _data(n: int = N):
    g = torch.Generator().manual_seed(1)
    return torch.randn(n, 5, generator=g) * 3, torch.randint(0, 3, (n,), generator=g)


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 16), nn.Tanh(), nn.Linear(16, 3))


def _fit(replicas: int, optimizer, batch: int = BATCH, epochs: int = 1, n: int = N, **fit_kwargs) -> mr.Model:
    x, y = _data(n)
    with strategy_of(replicas).scope():
        model = mr.Model(_net())
        model.compile(optimizer=optimizer, loss="sparse_categorical_crossentropy")
    model.fit(mr.data.Dataset.from_tensor_slices((x, y)).batch(batch), epochs=epochs, verbose=0, **fit_kwargs)
    return model


def _clip(params, clip):
    """The reference clipping of the global gradient, with torch's own utilities."""
    if clip is None:
        return
    kind, value = clip
    if kind == "global_clipnorm":
        assert torch.nn.utils.clip_grad_norm_(params, value) > value  # every step of the test clips
    elif kind == "clipnorm":
        for p in params:
            torch.nn.utils.clip_grad_norm_([p], value)
    else:
        torch.nn.utils.clip_grad_value_(params, value)


def _reference(batch: int = BATCH, epochs: int = 1, lr_at=lambda update: 0.1, clip=None, k: int = 1, n: int = N,
               momentum: float = 0.9) -> tuple[nn.Module, list[float]]:
    """One device: an update on every k consecutive global batches taken together (their mean loss),
    clipped, at rate lr_at(update index). Returns the net and the rates used."""
    x, y = _data(n)
    net = _net()
    opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=momentum)
    rates, update = [], 0
    for _ in range(epochs):
        for i in range(0, n, batch * k):
            opt.zero_grad()
            F.cross_entropy(net(x[i:i + batch * k]), y[i:i + batch * k]).backward()
            _clip(list(net.parameters()), clip)
            rates.append(lr_at(update))
            for group in opt.param_groups:
                group["lr"] = rates[-1]
            opt.step()
            update += 1
    return net, rates


def _assert_matches(model_or_modules, ref: nn.Module, rtol: float = RTOL, atol: float = ATOL) -> None:
    copies = list(model_or_modules.replicas)
    for name, want in ref.state_dict().items():
        got = copies[0].state_dict()[name]
        torch.testing.assert_close(got, want, rtol=rtol, atol=atol, msg=lambda m: f"{name}: {m}")
        for other in copies[1:]:
            assert torch.equal(other.state_dict()[name], got), name  # replicas bitwise identical


# ---- clipping ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("replicas", [1, 2, 3])
@pytest.mark.parametrize("clip", [("global_clipnorm", 0.2), ("clipnorm", 0.1), ("clipvalue", 0.02)], ids=str)
def test_fit_clips_the_all_reduced_gradient_as_one_device_clips_the_global_one(replicas, clip):
    kind, value = clip
    model = _fit(replicas, mr.optimizers.SGD(learning_rate=0.1, momentum=0.9, **{kind: value}), epochs=2)
    ref, _ = _reference(epochs=2, clip=clip)
    _assert_matches(model, ref)
    model.check_in_sync()


def test_global_clipnorm_gives_the_single_device_update_where_keras_doubles_it():
    """Measured on TF 2.21 / Keras 3: 2 replicas whose gradients are [10, 10] each, global_clipnorm=1.0,
    lr 0.1 move the variable by 0.1414: Keras clips each replica's gradient before the sum. One device
    with the summed gradient [20, 20] moves it by 0.0707; so do we, on 1 and on 2 replicas."""
    moved = {}
    for replicas in (1, 2):
        strategy = strategy_of(replicas)
        linear = nn.Linear(2, 1, bias=False)
        nn.init.zeros_(linear.weight)
        with strategy.scope():
            mnet = strategy.mirror(linear)
            opt = strategy.mirror_optimizer(mr.optimizers.SGD(learning_rate=0.1, global_clipnorm=1.0), mnet)

        def step():
            # Each replica's gradient: [10, 10] (with 2 replicas) or the sum [20, 20] (one device).
            (mnet.weight.sum() * 20.0 / replicas).backward()
            opt.step()

        strategy.run(step)
        moved[replicas] = [-float(w) for w in mnet.replicas[0].weight.detach().flatten()]
        strategy.check_in_sync(mnet)
    assert moved[1] == pytest.approx([0.1 / 2 ** 0.5] * 2, rel=1e-6)
    assert moved[2] == moved[1]  # Keras under MirroredStrategy: 0.1414


@pytest.mark.parametrize("replicas", [1, 3])
def test_a_custom_loop_gets_the_options_through_mirror_optimizer(replicas):
    x, y = _data()
    strategy = strategy_of(replicas)
    with strategy.scope():
        mnet = strategy.mirror(_net())
        opt = strategy.mirror_optimizer(mr.optimizers.SGD(learning_rate=0.1, momentum=0.9, global_clipnorm=0.2), mnet)

    def step(xb, yb):
        loss = mr.losses.compute_average_loss(F.cross_entropy(mnet(xb), yb, reduction="none"), global_batch_size=BATCH)
        loss.backward()
        opt.step()
        opt.zero_grad()

    for _ in range(2):
        for xb, yb in strategy.experimental_distribute_dataset(mr.data.Dataset.from_tensor_slices((x, y)).batch(BATCH)):
            strategy.run(step, args=(xb, yb))
    ref, _ = _reference(epochs=2, clip=("global_clipnorm", 0.2))
    _assert_matches(mnet, ref)
    strategy.check_in_sync(opt)


# ---- gradient accumulation -------------------------------------------------------------------------------

def _count_gradient_all_reduces(optimizer) -> list[int]:
    """Counts the reductions of a MirroredOptimizer's gradients that meet other replicas."""
    calls = [0]
    reducer = optimizer._reducer
    reduce = reducer.reduce

    def counting(*args, **kwargs):
        calls[0] += not reducer.lone
        return reduce(*args, **kwargs)

    reducer.reduce = counting
    return calls


@pytest.mark.parametrize("replicas", [1, 2, 3])
@pytest.mark.parametrize("k", [2, 3])
def test_accumulating_k_steps_equals_one_step_on_a_k_times_bigger_batch(replicas, k):
    batch = 6
    n = batch * k * 2  # two updates an epoch
    x, y = _data(n)
    strategy = strategy_of(replicas)
    with strategy.scope():
        model = mr.Model(_net())
        model.compile(optimizer=mr.optimizers.SGD(learning_rate=0.1, momentum=0.9, gradient_accumulation_steps=k),
                      loss="sparse_categorical_crossentropy")
    calls = _count_gradient_all_reduces(model.mirrored_optimizer)
    model.fit(mr.data.Dataset.from_tensor_slices((x, y)).batch(batch), epochs=2, verbose=0)
    ref, _ = _reference(batch=batch, epochs=2, k=k, n=n)
    _assert_matches(model, ref)
    assert model.optimizer.iterations == 4  # updates, as Keras counts them: 2 epochs of 2 k steps, // k
    assert calls[0] == (4 * replicas if replicas > 1 else 0)  # one all-reduce per update, not per step
    model.check_in_sync()


def test_under_accumulation_the_schedule_sees_keras_step_count():
    """Keras 3 evaluates the schedule at its raw step counter, which counts every step: the updates of
    k = 2 use schedule(1), schedule(3), ... while optimizer.iterations counts updates."""
    schedule = mr.optimizers.schedules.PiecewiseConstantDecay([1, 3, 5], [0.4, 0.2, 0.1, 0.05])
    model = _fit(2, mr.optimizers.SGD(learning_rate=schedule, momentum=0.9, gradient_accumulation_steps=2),
                 batch=6, epochs=2)
    ref, rates = _reference(batch=6, epochs=2, k=2, lr_at=lambda update: schedule(2 * update + 1))
    assert rates == [0.4, 0.2, 0.1, 0.05]
    _assert_matches(model, ref)
    assert model.optimizer.iterations == 4 and model.optimizer.learning_rate == schedule(8)


def test_a_custom_loop_accumulates_with_one_all_reduce_per_update():
    batch, k = 6, 2
    x, y = _data()
    strategy = strategy_of(2)
    with strategy.scope():
        mnet = strategy.mirror(_net())
        opt = strategy.mirror_optimizer(
            mr.optimizers.SGD(learning_rate=0.1, momentum=0.9, gradient_accumulation_steps=k), mnet)
    calls = _count_gradient_all_reduces(opt)

    def step(xb, yb):
        loss = mr.losses.compute_average_loss(F.cross_entropy(mnet(xb), yb, reduction="none"), global_batch_size=batch)
        loss.backward()
        opt.step()
        mnet.zero_grad()  # clearing the gradients does not lose what the optimizer accumulated

    for xb, yb in strategy.experimental_distribute_dataset(mr.data.Dataset.from_tensor_slices((x, y)).batch(batch)):
        strategy.run(step, args=(xb, yb))
    ref, _ = _reference(batch=batch, k=k)
    _assert_matches(mnet, ref)
    assert calls[0] == 2 * 2  # 4 steps, 2 updates, on 2 replicas
    assert [o.iterations for o in opt.replicas] == [2, 2]


# ---- schedules -------------------------------------------------------------------------------------------

@pytest.mark.parametrize("replicas", [1, 2])
def test_fit_evaluates_the_schedule_at_every_step(replicas):
    schedule = mr.optimizers.schedules.ExponentialDecay(0.2, decay_steps=1, decay_rate=0.5)
    model = _fit(replicas, mr.optimizers.SGD(learning_rate=schedule, momentum=0.9), epochs=2)
    ref, rates = _reference(epochs=2, lr_at=schedule)
    assert rates == [0.2, 0.1, 0.05, 0.025]
    _assert_matches(model, ref)
    assert model.optimizer.iterations == 4
    assert model.optimizer.learning_rate == pytest.approx(0.0125)  # the rate of the next update: schedule(4)
    assert [g["lr"] for opt in model.mirrored_optimizer.replicas for g in opt.param_groups] == [0.025] * replicas


def test_a_saved_model_resumes_its_schedule_and_optimizer_options(tmp_path):
    """Model.save records the optimizer by its config (schedule and options included) and its state (the
    step count): the loaded model's next epoch is bit for bit the uninterrupted run's."""
    def optimizer():
        return mr.optimizers.Adam(learning_rate=mr.optimizers.schedules.CosineDecay(0.05, 4, warmup_target=0.1,
                                                                                   warmup_steps=2),
                                  global_clipnorm=2.0, gradient_accumulation_steps=2)
    x, y = _data()
    ds = mr.data.Dataset.from_tensor_slices((x, y)).batch(BATCH)
    with strategy_of(2).scope():
        whole = mr.Model(_net())
        whole.compile(optimizer=optimizer(), loss=mr.losses.SparseCategoricalCrossentropy(from_logits=True),
                      metrics=[mr.metrics.SparseTopKCategoricalAccuracy(k=2)])
        half = mr.Model(_net())
        half.compile(optimizer=optimizer(), loss=mr.losses.SparseCategoricalCrossentropy(from_logits=True),
                     metrics=[mr.metrics.SparseTopKCategoricalAccuracy(k=2)])
    whole.fit(ds, epochs=2, verbose=0)
    half.fit(ds, epochs=1, verbose=0)
    path = tmp_path / "half.safetensors"
    half.save(path)
    with strategy_of(3).scope():  # another replica count
        loaded = mr.Model.load(path, module=nn.Sequential(nn.Linear(5, 16), nn.Tanh(), nn.Linear(16, 3)))
    assert loaded.optimizer.get_config() == optimizer().get_config()
    assert loaded.optimizer.iterations == 1  # 2 steps, 1 update
    assert loaded.optimizer.learning_rate == pytest.approx(0.1)  # schedule(2): the end of the warmup
    history = loaded.fit(ds, epochs=1, verbose=0)
    assert list(history.history) == ["loss", "sparse_top_k_categorical_accuracy"]
    ref = whole.module.state_dict()
    for name, got in loaded.module.state_dict().items():
        torch.testing.assert_close(got, ref[name], rtol=RTOL, atol=ATOL)  # 3 replicas now: reassociation


def test_learning_rate_cannot_be_set_under_a_schedule_and_callbacks_that_set_it_refuse_at_once():
    schedule = mr.optimizers.schedules.InverseTimeDecay(0.1, 10, 0.5)
    recipe = mr.optimizers.SGD(learning_rate=schedule)
    with pytest.raises(TypeError, match="cannot be set"):
        recipe.learning_rate = 0.01
    x, y = _data()
    for callback in (mr.callbacks.LearningRateScheduler(lambda epoch, lr: lr / 2),
                     mr.callbacks.ReduceLROnPlateau(monitor="loss", patience=0)):
        with strategy_of(2).scope():
            model = mr.Model(_net())
            model.compile(optimizer=mr.optimizers.SGD(learning_rate=schedule), loss="sparse_categorical_crossentropy")
        before = model.get_weights()
        with pytest.raises(TypeError, match=f"{type(callback).__name__}: the optimizer's learning_rate is the "
                                            "schedule"):
            model.fit(x, y, batch_size=BATCH, epochs=2, verbose=0, callbacks=[callback])
        for a, b in zip(model.get_weights(), before):
            np.testing.assert_array_equal(a, b)  # refused before the first step, not after hours


def test_reduce_lr_on_plateau_still_sets_a_float_rate():
    model = _fit(2, mr.optimizers.SGD(learning_rate=0.1), epochs=3,
                 callbacks=[mr.callbacks.ReduceLROnPlateau(monitor="loss", mode="max", patience=0, factor=0.5)])
    assert model.optimizer.learning_rate == pytest.approx(0.025)  # "loss" never rose: halved after epochs 2, 3
    assert [g["lr"] for opt in model.mirrored_optimizer.replicas for g in opt.param_groups] == [0.025] * 2


# ---- EMA -------------------------------------------------------------------------------------------------

def _ema_reference(momentum: float, overwrite_every: int | None, epochs: int = 2) -> tuple[nn.Module, list]:
    """Plain SGD, with Keras's average kept beside it: the first update's average is the weights, then
    average = m * average + (1 - m) * weights; every overwrite_every-th update writes it into them."""
    x, y = _data()
    net = _net()
    opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    averages, update = None, 0
    for _ in range(epochs):
        for i in range(0, N, BATCH):
            opt.zero_grad()
            F.cross_entropy(net(x[i:i + BATCH]), y[i:i + BATCH]).backward()
            opt.step()
            with torch.no_grad():
                if averages is None:
                    averages = [p.detach().clone() for p in net.parameters()]
                else:
                    averages = [momentum * a + (1 - momentum) * p for a, p in zip(averages, net.parameters())]
                if overwrite_every and (update + 1) % overwrite_every == 0:
                    for a, p in zip(averages, net.parameters()):
                        p.copy_(a)
            update += 1
    return net, averages


@pytest.mark.parametrize("replicas", [1, 2])
@pytest.mark.parametrize("overwrite_every", [None, 3])
def test_ema_averages_the_weights_and_fit_writes_them_in_at_the_end(replicas, overwrite_every):
    model = _fit(replicas, mr.optimizers.SGD(learning_rate=0.1, momentum=0.9, use_ema=True, ema_momentum=0.7,
                                             ema_overwrite_frequency=overwrite_every), epochs=2)
    ref, averages = _ema_reference(0.7, overwrite_every)
    with torch.no_grad():
        for a, p in zip(averages, ref.parameters()):
            p.copy_(a)  # what Keras's fit does at its end (finalize_variable_values)
    _assert_matches(model, ref, rtol=1e-5, atol=2e-6)  # averages of 4 steps' reassociation
    states = [opt.state_dict()["keras"]["averages"] for opt in model.mirrored_optimizer.replicas]
    for other in states[1:]:
        assert all(torch.equal(a, b) for a, b in zip(states[0], other))  # identical on every replica


# ---- construction, configs, errors -----------------------------------------------------------------------

@pytest.mark.parametrize("optimizer", [
    mr.optimizers.SGD(learning_rate=0.05, momentum=0.9, nesterov=True, clipnorm=1.0),
    mr.optimizers.Adam(learning_rate=mr.optimizers.schedules.PolynomialDecay(0.01, 10), amsgrad=True, use_ema=True),
    mr.optimizers.AdamW(weight_decay=0.01, gradient_accumulation_steps=4),
    mr.optimizers.RMSprop(rho=0.8, centered=True, clipvalue=0.5),
    mr.optimizers.get(torch.optim.Adagrad),
], ids=lambda o: o.name)
def test_configs_round_trip_through_json(optimizer):
    config = json.loads(json.dumps(mr.optimizers.serialize(optimizer)))
    again = mr.optimizers.deserialize(config)
    assert type(again) is type(optimizer) and again.get_config() == optimizer.get_config()
    assert again._torch_cls is optimizer._torch_cls and again._kwargs == optimizer._kwargs
    assert mr.optimizers.get(config).get_config() == optimizer.get_config()


def test_a_built_optimizer_is_the_torch_class_and_works_without_a_strategy():
    net = _net()
    ref = _net()
    opt = mr.optimizers.SGD(learning_rate=0.1, momentum=0.9, clipvalue=0.05)(net.parameters())
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    assert isinstance(opt, torch.optim.SGD)
    assert mr.optimizers.get(opt)._torch_cls is torch.optim.SGD  # its class and defaults, as for any instance
    x, y = _data()
    for model, o in ((net, opt), (ref, ref_opt)):
        F.cross_entropy(model(x), y).backward()
        if o is ref_opt:
            torch.nn.utils.clip_grad_value_(ref.parameters(), 0.05)
        o.step()
    for a, b in zip(net.parameters(), ref.parameters()):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_bad_options_are_named():
    with pytest.raises(ValueError, match="at most one of clipnorm, clipvalue and global_clipnorm"):
        mr.optimizers.SGD(clipnorm=1.0, global_clipnorm=1.0)
    with pytest.raises(ValueError, match=r"clipnorm=-1.*> 0"):
        mr.optimizers.SGD(clipnorm=-1)
    with pytest.raises(ValueError, match=r"gradient_accumulation_steps=1\).*>= 2"):
        mr.optimizers.Adam(gradient_accumulation_steps=1)
    with pytest.raises(ValueError, match=r"ema_momentum=1.5"):
        mr.optimizers.SGD(use_ema=True, ema_momentum=1.5)
    with pytest.raises(ValueError, match="ema_overwrite_frequency=0"):
        mr.optimizers.SGD(use_ema=True, ema_overwrite_frequency=0)
    with pytest.raises(ValueError, match=r"learning_rate='fast'"):
        mr.optimizers.SGD(learning_rate="fast")
    with pytest.raises(TypeError, match="expected a torch.optim.Optimizer subclass"):
        mr.optimizers.Optimizer(lambda params: None, 0.1)
    with pytest.raises(ValueError, match="unknown class 'Pickle'"):
        mr.optimizers.deserialize({"class_name": "Pickle", "config": {}})
    with pytest.raises(ValueError, match="torch_class 'system' is not a torch.optim optimizer"):
        mr.optimizers.deserialize({"class_name": "Optimizer", "config": {"torch_class": "system"}})
    with strategy_of(1).scope():
        model = mr.Model(_net())
    with pytest.raises(ValueError, match=r"fp16.*gradient_accumulation_steps.*bf16"):
        model.compile(optimizer=mr.optimizers.SGD(gradient_accumulation_steps=2), loss="mse", precision="fp16")


@pytest.mark.parametrize("momentum, nesterov, weight_decay", [(0.0, False, None), (0.9, False, 1e-4), (0.9, True, None)])
def test_sgd_update_is_bitwise_torchs_loop_over_the_parameters(momentum, nesterov, weight_decay):
    """Regression test for issue 27: mr.optimizers.SGD runs torch's foreach update (one call per step of
    the update instead of ~3 per parameter under the replicas' shared GIL); on the CPU it must give the
    bits of torch.optim.SGD's default there, the per-parameter loop (foreach=False)."""
    torch.manual_seed(0)
    shapes = [(8, 3, 3, 3), (8,), (4, 8), (4,), ()]
    ref = [torch.nn.Parameter(torch.randn(s)) for s in shapes]
    ours = [torch.nn.Parameter(p.detach().clone()) for p in ref]
    ref_opt = torch.optim.SGD(ref, lr=0.05, momentum=momentum, nesterov=nesterov, weight_decay=weight_decay or 0.0,
                              foreach=False)
    opt = mr.optimizers.SGD(learning_rate=0.05, momentum=momentum, nesterov=nesterov,
                            weight_decay=weight_decay).build(ours)
    for _ in range(4):
        grads = [torch.randn(s) for s in shapes]
        for params, o in ((ref, ref_opt), (ours, opt)):
            for p, g in zip(params, grads):
                p.grad = g.clone()
            o.step()
    for got, want in zip(ours, ref):
        assert torch.equal(got, want)


def test_a_users_step_hook_that_draws_runs_in_the_replicas_random_mode():
    """Issue 27 lifts the replica random mode around torch's own update, which draws nothing; a step hook
    of the user's may draw (gradient noise), so with one registered the mode stays (found in review:
    the hook ran without it, drawing from torch's one generator in thread order). (A step of fit whose
    first step drew nothing runs without the mode at all: this hook draws in every step.)"""
    from torch.optim.optimizer import register_optimizer_step_pre_hook

    from mirrored.distribute.random import current_mode

    seen = []

    def hook(optimizer, args, kwargs):
        seen.append(current_mode() is not None)
        torch.rand(1)  # gradient noise, say

    handle = register_optimizer_step_pre_hook(hook)
    torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)  # (torch then wraps SGD.step itself in hooks)
    try:
        x, y = torch.randn(16, 3), torch.randint(0, 2, (16,))
        with mr.MirroredStrategy(devices=["cpu:0", "cpu:1"], seed=1).scope():
            model = mr.Model(torch.nn.Linear(3, 2))
            model.compile(optimizer=mr.optimizers.SGD(learning_rate=0.1, momentum=0.9),
                          loss="sparse_categorical_crossentropy")
        model.fit(mr.data.Dataset.from_tensor_slices((x, y)).batch(8), epochs=1, verbose=0)
    finally:
        handle.remove()
    assert seen and all(seen), seen


def _count_step_hooks(run_steps) -> dict[str, dict[int, int]]:
    """Calls of torch's global step pre/post hooks and of the optimizers' own pre/post hooks during
    run_steps(register_own), by kind, per optimizer object."""
    from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

    calls: dict[str, dict[int, int]] = {k: {} for k in ("global pre", "global post", "own pre", "own post")}

    def counter(kind):
        def hook(optimizer, args, kwargs):
            calls[kind][id(optimizer)] = calls[kind].get(id(optimizer), 0) + 1
        return hook

    def register_own(opt):
        return [opt.register_step_pre_hook(counter("own pre")), opt.register_step_post_hook(counter("own post"))]

    handles = [register_optimizer_step_pre_hook(counter("global pre")),
               register_optimizer_step_post_hook(counter("global post"))]
    try:
        run_steps(register_own)
    finally:
        for h in handles:
            h.remove()
    return calls


def test_step_hooks_run_once_per_replica_step_as_for_a_plain_torch_optimizer():
    """Review leftover 3: torch wraps a class's step() in its hooks once an instance is built, so the
    mr.optimizers subclass's step() and the torch SGD.step() its update calls both ran them: every
    global and own hook twice per step. Reference: a plain torch.optim.SGD on one device, whose hooks
    run once per step(); each replica's optimizer must see the same."""
    x, y = _data()

    def plain(register_own):
        net = _net()
        opt = torch.optim.SGD(net.parameters(), lr=0.1)  # (built first: torch then wraps SGD.step itself)
        register_own(opt)
        for xb, yb in zip(x.split(BATCH), y.split(BATCH)):
            F.cross_entropy(net(xb), yb).backward()
            opt.step()
            opt.zero_grad()

    replica_optimizers: list[int] = []

    def fit(register_own):
        with strategy_of(2).scope():
            model = mr.Model(_net())
            model.compile(optimizer=mr.optimizers.SGD(learning_rate=0.1, momentum=0.9),
                          loss="sparse_categorical_crossentropy")
        register_own(model.mirrored_optimizer)
        model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
        replica_optimizers.extend(id(opt) for opt in model.mirrored_optimizer.values)

    want = _count_step_hooks(plain)
    assert all(list(per_opt.values()) == [N // BATCH] for per_opt in want.values()), want
    got = _count_step_hooks(fit)
    for kind, per_opt in got.items():
        assert per_opt == {opt: N // BATCH for opt in replica_optimizers}, (kind, per_opt)
