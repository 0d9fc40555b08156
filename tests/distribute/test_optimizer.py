"""optimizer.py (issue 14): a MirroredOptimizer ports a PyTorch training loop unchanged.

torch LR schedulers (StepLR, OneCycleLR, CosineAnnealingLR, LambdaLR, SequentialLR,
ReduceLROnPlateau) take it and set the same rate on every replica; gradient_reduction="mean" takes
an unchanged `F.cross_entropy(out, y).backward()` (DDP's rule, weighted by each replica's examples so
an uneven last batch still gives one device's update); no_sync() accumulates micro-steps and the
next step() reduces once. Every run is checked against plain single-process PyTorch on 1, 2 and 3
CPU replicas, and the replicas against each other bit for bit (check_in_sync).
"""
from __future__ import annotations

import copy
import json

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.optim import lr_scheduler

import mirrored as mr
import mirrored.distribute as md
from _replicas import TIMEOUT_S, replica_id, strategy_of  # tests/_replicas.py

# Float reassociation: "mean" scales each replica's gradient by its example count, sums, and divides
# by the total, and the replicas' partial sums add in another order than one device's. Measured at
# most 6e-8 absolute on weights of order 0.1 to 1 after the 3 to 12 steps of these runs.
RTOL, ATOL = 1e-6, 2e-7


def data(n: int = 22, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 5, generator=g), torch.randint(0, 3, (n,), generator=g)


def batches(x: torch.Tensor, y: torch.Tensor, size: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Global batches in order; the last one is short when size does not divide len(x)."""
    return [(x[i:i + size], y[i:i + size]) for i in range(0, len(x), size)]


def net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 3))


def plain_run(model: nn.Module, data_batches: list, opt: torch.optim.Optimizer, sched: object, epochs: int,
              step_per: str, metrics: list[float] | None = None) -> list[float]:
    """A plain PyTorch loop, one device: the unchanged loss line, the scheduler stepped as its docs say."""
    rates = []
    for epoch in range(epochs):
        for x, y in data_batches:
            opt.zero_grad()
            F.cross_entropy(model(x), y).backward()
            opt.step()
            if step_per == "batch":
                sched.step()
        rates.append(opt.param_groups[0]["lr"])
        if step_per == "epoch":
            sched.step(metrics[epoch]) if metrics is not None else sched.step()
    return rates


def mirrored_run(strategy: md.MirroredStrategy, mnet: md.MirroredModule, data_batches: list,
                 opt: md.MirroredOptimizer, sched: object, epochs: int, step_per: str,
                 metrics: list[float] | None = None) -> list[float]:
    """The same loop made data-parallel: the step runs on every replica, the scheduler outside it."""
    def step(x, y):
        opt.zero_grad()
        F.cross_entropy(mnet(x), y).backward()  # unchanged: gradient_reduction="mean" averages
        opt.step()

    rates = []
    dist = strategy.experimental_distribute_dataset(data_batches)
    for epoch in range(epochs):
        for x, y in dist:
            strategy.run(step, args=(x, y))
            if step_per == "batch":
                sched.step()
        rates.append(opt.param_groups[0]["lr"])
        assert len({o.param_groups[0]["lr"] for o in opt.values}) == 1  # the same rate on every replica
        if step_per == "epoch":
            sched.step(metrics[epoch]) if metrics is not None else sched.step()
    return rates


def assert_matches(mnet: md.MirroredModule, ref: nn.Module, strategy: md.MirroredStrategy, opt=None) -> None:
    for (name, want), got in zip(ref.state_dict().items(), mnet.values[-1].state_dict().values()):
        torch.testing.assert_close(got, want, rtol=RTOL, atol=ATOL, msg=lambda m: f"{name}: {m}")
    strategy.check_in_sync(mnet)  # every replica bit for bit
    if opt is not None:
        strategy.check_in_sync(opt)


SCHEDULERS = {
    "StepLR": (lambda opt: lr_scheduler.StepLR(opt, step_size=2, gamma=0.5), "epoch"),
    "OneCycleLR": (lambda opt: lr_scheduler.OneCycleLR(opt, max_lr=0.2, total_steps=12), "batch"),
    "CosineAnnealingLR": (lambda opt: lr_scheduler.CosineAnnealingLR(opt, T_max=3), "epoch"),
    "LambdaLR": (lambda opt: lr_scheduler.LambdaLR(opt, lambda epoch: 0.8 ** epoch), "epoch"),
    "SequentialLR": (lambda opt: lr_scheduler.SequentialLR(
        opt, [lr_scheduler.LinearLR(opt, start_factor=0.5, total_iters=2),
              lr_scheduler.ExponentialLR(opt, gamma=0.7)], milestones=[2]), "epoch"),
    "ReduceLROnPlateau": (lambda opt: lr_scheduler.ReduceLROnPlateau(opt, factor=0.5, patience=0), "epoch"),
}


@pytest.mark.parametrize("replicas", [1, 2, 3])
@pytest.mark.parametrize("name", list(SCHEDULERS))
def test_torch_schedulers_drive_every_replica_like_plain_torch(name, replicas):
    """22 examples in global batches of 8 (8, 8, 6), 4 epochs, SGD with momentum (OneCycleLR cycles it)."""
    make, step_per = SCHEDULERS[name]
    metrics = [1.0, 1.0, 0.5, 0.5] if name == "ReduceLROnPlateau" else None  # plateaus, then one improvement
    data_batches = batches(*data(), 8)
    ref = net()
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    want_rates = plain_run(ref, data_batches, ref_opt, make(ref_opt), 4, step_per, metrics)
    strategy = strategy_of(replicas)
    with strategy.scope():
        mnet = strategy.mirror(net())
        opt = strategy.mirror_optimizer(torch.optim.SGD, mnet, gradient_reduction="mean", lr=0.1, momentum=0.9)
    sched = make(opt)
    rates = mirrored_run(strategy, mnet, data_batches, opt, sched, 4, step_per, metrics)
    assert rates == pytest.approx(want_rates, rel=1e-12)
    assert len(set(rates)) > 1  # the schedule changed the rate
    assert_matches(mnet, ref, strategy, opt)


def test_step_lr_on_a_sum_reduced_optimizer_with_tf_loss_scaling():
    """The default "sum" with TF's loss line (per-example losses / GLOBAL batch) under StepLR."""
    x, y = data(24)
    ref = net()
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    plain_run(ref, batches(x, y, 8), ref_opt, lr_scheduler.StepLR(ref_opt, 1, gamma=0.5), 3, "epoch")
    strategy = strategy_of(2)
    with strategy.scope():
        mnet = strategy.mirror(net())
        opt = strategy.mirror_optimizer(torch.optim.SGD, mnet, lr=0.1)
    sched = lr_scheduler.StepLR(opt, 1, gamma=0.5)

    def step(xb, yb):
        per_example = F.cross_entropy(mnet(xb), yb, reduction="none")
        mr.losses.compute_average_loss(per_example, global_batch_size=8).backward()
        opt.step()
        opt.zero_grad()

    for _ in range(3):
        for xb, yb in strategy.experimental_distribute_dataset(batches(x, y, 8)):
            strategy.run(step, args=(xb, yb))
        sched.step()
    assert opt.gradient_reduction == "sum" and opt.param_groups[0]["lr"] == pytest.approx(0.0125)
    assert_matches(mnet, ref, strategy, opt)


@pytest.mark.parametrize("replicas", [2, 3])
@pytest.mark.parametrize("n, batch", [(24, 8), (22, 8), (17, 8), (9, 8)])
def test_mean_reduction_with_an_unchanged_loss_line_gives_one_devices_update(replicas, n, batch):
    """Even parts (24 by 8), uneven ones (22: last batch 6 -> 3/3 or 2/2/2; 17: last 1 -> 1/0 or 1/0/0;
    9: 1 again), each replica weighed by its examples: the whole batch's mean gradient. DDP weighs
    every replica alike, which gives another update whenever the parts differ."""
    data_batches = batches(*data(n), batch)
    ref = net()
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    plain_run(ref, data_batches, ref_opt, lr_scheduler.LambdaLR(ref_opt, lambda e: 1.0), 3, "epoch")
    strategy = strategy_of(replicas)
    with strategy.scope():
        mnet = strategy.mirror(net())
        opt = strategy.mirror_optimizer(torch.optim.SGD, mnet, gradient_reduction="mean", lr=0.1, momentum=0.9)
    mirrored_run(strategy, mnet, data_batches, opt, lr_scheduler.LambdaLR(opt, lambda e: 1.0), 3, "epoch")
    assert_matches(mnet, ref, strategy, opt)


def test_mean_reduction_ignores_evaluation_forwards_between_training_steps():
    """Issue 26 (found porting pytorch/examples' MNIST): the recipe's test() runs the model under
    no_grad between epochs. Those forwards add no gradient, so they must not weigh the next step's
    replicas: an evaluation batch of 5 (3/2) before a training batch of 7 (4/3) still gives one
    device's update on the 7, not replicas weighed 7:5."""
    x, y = data(12)
    ref = net()
    F.cross_entropy(ref(x[:7]), y[:7]).backward()
    torch.optim.SGD(ref.parameters(), lr=0.1).step()
    strategy = strategy_of(2)
    with strategy.scope():
        mnet = strategy.mirror(net())
        opt = strategy.mirror_optimizer(torch.optim.SGD, mnet, gradient_reduction="mean", lr=0.1)

    def evaluate(xb):
        with torch.no_grad():
            return mnet(xb).sum()

    def train(xb, yb):
        opt.zero_grad()
        F.cross_entropy(mnet(xb), yb).backward()
        opt.step()

    (eval_x,) = next(iter(strategy.experimental_distribute_dataset([(x[7:],)])))
    strategy.run(evaluate, args=(eval_x,))
    train_batch = next(iter(strategy.experimental_distribute_dataset([(x[:7], y[:7])])))
    strategy.run(train, args=train_batch)
    assert_matches(mnet, ref, strategy, opt)


def test_mean_reduction_without_weights_is_ddps_plain_average():
    """Gradients set by hand (the module was not called, so no example counts): the plain mean."""
    strategy = strategy_of(3)
    with strategy.scope():
        mnet = strategy.mirror(nn.Linear(2, 1, bias=False))
        opt = strategy.mirror_optimizer(torch.optim.SGD, mnet, gradient_reduction="mean", lr=1.0)

    def fn():
        r = replica_id()
        mnet.module.weight.grad = torch.full((1, 2), float(r + 1))
        opt.reduce_gradients()
        return mnet.module.weight.grad.clone()

    for g in strategy.run(fn).values:
        torch.testing.assert_close(g, torch.full((1, 2), 2.0), rtol=0, atol=0)


@pytest.mark.parametrize("replicas", [1, 2, 3])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("where", ["outside run", "inside run"])
def test_no_sync_accumulates_micro_steps_into_one_step_on_the_bigger_batch(replicas, reduction, where):
    """k = 3 micro-batches of 6 (each split over the replicas), no_sync on the first two: one step that
    equals a plain step on all 18 examples. The loss line divides by k, as gradient accumulation does
    ("sum": TF's line, per-example losses / (k * 6))."""
    x, y = data(18)
    ref = net()
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.3, momentum=0.9)
    F.cross_entropy(ref(x), y).backward()
    ref_opt.step()
    strategy = strategy_of(replicas)
    with strategy.scope():
        mnet = strategy.mirror(net())
        opt = strategy.mirror_optimizer(torch.optim.SGD, mnet, gradient_reduction=reduction, lr=0.3, momentum=0.9)

    def micro(xb, yb, last):
        if reduction == "mean":
            loss = F.cross_entropy(mnet(xb), yb) / 3
        else:
            loss = mr.losses.compute_average_loss(F.cross_entropy(mnet(xb), yb, reduction="none"),
                                                  global_batch_size=18)
        if where == "inside run" and not last:
            with mnet.no_sync():
                loss.backward()
        else:
            loss.backward()
        if last:
            opt.step()

    dist = list(strategy.experimental_distribute_dataset(batches(x, y, 6)))
    for i, (xb, yb) in enumerate(dist):
        last = i == len(dist) - 1
        if where == "outside run" and not last:
            with opt.no_sync():
                strategy.run(micro, args=(xb, yb, last))
        else:
            strategy.run(micro, args=(xb, yb, last))
    assert_matches(mnet, ref, strategy, opt)


def test_step_inside_no_sync_is_refused_and_changes_nothing():
    strategy = strategy_of(2)
    with strategy.scope():
        mnet = strategy.mirror(net())
        opt = strategy.mirror_optimizer(torch.optim.SGD, mnet, gradient_reduction="mean", lr=0.1)
    before = [p.detach().clone() for p in mnet.values[1].parameters()]

    def step(xb, yb):
        F.cross_entropy(mnet(xb), yb).backward()
        opt.step()

    x, y = data(8)
    with opt.no_sync(), pytest.raises(RuntimeError, match=r"step\(\) inside no_sync\(\).*after the block"):
        strategy.run(step, args=next(iter(strategy.experimental_distribute_dataset([(x, y)]))))
    assert all(torch.equal(p, b) for p, b in zip(mnet.values[1].parameters(), before))
    assert all(p.grad is None for m in mnet.values for p in m.parameters())  # the failed step left no trace


def test_mean_reduction_after_a_failed_step_counts_only_the_next_steps_examples():
    """The example counts are part of the step: a step that fails puts them back with the gradients."""
    x, y = data(8)
    ref = net()
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    F.cross_entropy(ref(x), y).backward()
    ref_opt.step()
    strategy = strategy_of(2)
    with strategy.scope():
        mnet = strategy.mirror(net())
        opt = strategy.mirror_optimizer(torch.optim.SGD, mnet, gradient_reduction="mean", lr=0.1)

    def step(xb, yb, fail):
        F.cross_entropy(mnet(xb[:1] if fail else xb), yb[:1] if fail else yb).backward()
        if fail:
            raise ValueError("boom")
        opt.step()

    (xb, yb), = strategy.experimental_distribute_dataset([(x, y)])
    with pytest.raises(ValueError, match="boom"):
        strategy.run(step, args=(xb, yb, True))
    strategy.run(step, args=(xb, yb, False))
    assert_matches(mnet, ref, strategy, opt)


def test_bad_gradient_reduction_is_named():
    strategy = strategy_of(2)
    mnet = strategy.mirror(net())
    with pytest.raises(ValueError, match=r"gradient_reduction='avg'.*\"sum\".*\"mean\""):
        strategy.mirror_optimizer(torch.optim.SGD, mnet, gradient_reduction="avg", lr=0.1)
    assert strategy.mirror_optimizer(torch.optim.SGD, mnet, gradient_reduction=md.ReduceOp.MEAN,
                                     lr=0.1).gradient_reduction == "mean"


def test_scheduler_state_travels_with_the_optimizer_state():
    """attach_lr_scheduler: state_dict() carries the scheduler's state (JSON: what checkpoints store),
    load_state_dict() restores it, also into a scheduler attached after the load."""
    strategy = strategy_of(2)
    with strategy.scope():
        mnet = strategy.mirror(net())
        opt = strategy.mirror_optimizer(torch.optim.SGD, mnet, lr=0.1, momentum=0.9)
    sched = lr_scheduler.OneCycleLR(opt, max_lr=0.5, total_steps=10)
    opt.attach_lr_scheduler(sched)

    def step(xb, yb):
        F.cross_entropy(mnet(xb), yb).backward()
        opt.step()
        opt.zero_grad()

    for xb, yb in strategy.experimental_distribute_dataset(batches(*data(16), 8)):
        strategy.run(step, args=(xb, yb))
        sched.step()
    state = opt.state_dict()
    assert json.loads(json.dumps(state["lr_schedulers"])) == [sched.state_dict()]
    with strategy.scope():
        other = strategy.mirror(net())
        fresh = strategy.mirror_optimizer(torch.optim.SGD, other, lr=0.1, momentum=0.9)
    fresh.load_state_dict(state)
    later = lr_scheduler.OneCycleLR(fresh, max_lr=0.5, total_steps=10)  # resets the rate, as torch does...
    fresh.attach_lr_scheduler(later)  # ...and attaching restores the saved schedule and its rate
    assert later.last_epoch == sched.last_epoch == 2
    assert [g["lr"] for g in fresh.param_groups] == [g["lr"] for g in opt.param_groups]
    assert {o.param_groups[0]["lr"] for o in fresh.values} == {opt.param_groups[0]["lr"]}
    with pytest.raises(ValueError, match="drives .* not this optimizer"):
        fresh.attach_lr_scheduler(sched)


def test_optimizer_methods_reach_every_replica_or_are_refused():
    """Every public torch.optim.Optimizer method is handled by MirroredOptimizer itself, in one list."""
    import inspect

    public = {n for n in dir(torch.optim.Optimizer) if not n.startswith("_")
              and inspect.isfunction(inspect.getattr_static(torch.optim.Optimizer, n))}
    kinds = [md.MirroredOptimizer.EVERY_COPY, md.MirroredOptimizer.READS, md.MirroredOptimizer.IN_RUN,
             md.MirroredOptimizer.REFUSED]
    assert public == set().union(*kinds), "a torch.optim.Optimizer method is not handled"
    assert sum(len(k) for k in kinds) == len(public)  # each in one list
    assert all(n in vars(md.MirroredOptimizer) for n in public)
    strategy = strategy_of(2)
    mnet = strategy.mirror(net())
    opt = strategy.mirror_optimizer(torch.optim.Adam, mnet, lr=0.1)
    assert isinstance(opt, torch.optim.Optimizer) and opt.defaults["lr"] == 0.1
    calls = []
    handle = opt.register_step_pre_hook(lambda o, args, kwargs: calls.append(o))

    def step():
        mnet(torch.ones(2, 5)).sum().backward()
        opt.step()

    strategy.run(step)
    assert sorted(map(id, calls)) == sorted(map(id, opt.values))  # each replica's optimizer, once
    handle.remove()
    strategy.run(step)
    assert len(calls) == 2
    with pytest.raises(ValueError, match="add_param_group"):
        opt.add_param_group({"params": [torch.zeros(1, requires_grad=True)]})
    with pytest.raises(TypeError, match="cannot be pickled or copied"):
        copy.deepcopy(opt)
    with pytest.raises(RuntimeError, match="inside strategy.run"):
        strategy.run(lambda: opt.load_state_dict(opt.state_dict()))


def test_load_state_dict_gives_each_replica_its_own_state_and_keeps_adams_step_where_torch_puts_it():
    """Issue 19: the state was moved to each replica's device before torch's load_state_dict, which put
    Adam's scalar `step` on the GPU, where every step reads it back with .item(). Now torch's own rule
    places it (the CPU, for a non-fused, non-capturable Adam); each replica gets its own tensors."""
    s = md.MirroredStrategy(devices=["cpu:0", "cpu:1"])
    with s.scope():
        mnet = s.mirror(nn.Linear(3, 2))
        opt = s.mirror_optimizer(torch.optim.Adam, mnet, lr=0.1)
    saved = {"state": {0: {"step": torch.tensor(5.0), "exp_avg": torch.ones(2, 3), "exp_avg_sq": torch.ones(2, 3)},
                       1: {"step": torch.tensor(5.0), "exp_avg": torch.ones(2), "exp_avg_sq": torch.ones(2)}},
             "param_groups": [dict(opt.replicas[0].state_dict()["param_groups"][0])]}
    opt.load_state_dict(saved)
    first, second = (o.state_dict()["state"] for o in opt.replicas)
    assert first[0]["step"].device.type == "cpu" and first[0]["step"].dim() == 0
    assert first[0]["exp_avg"] is not second[0]["exp_avg"] and first[0]["exp_avg"] is not saved["state"][0]["exp_avg"]
    s.check_in_sync(opt)


# ---- "mean" reduces when backward ends, as DDP: code between backward and step sees reduced gradients ----

def clipped_plain_steps(data_batches: list, max_norm: float, micro: int = 1) -> nn.Module:
    """One device: each batch's mean loss in `micro` backward passes (equal slices), clip, step."""
    ref = net()
    opt = torch.optim.SGD(ref.parameters(), lr=0.5)
    for x, y in data_batches:
        opt.zero_grad()
        for xs, ys in zip(x.chunk(micro), y.chunk(micro)):
            F.cross_entropy(ref(xs), ys).backward()
        torch.nn.utils.clip_grad_norm_(ref.parameters(), max_norm)
        opt.step()
    return ref


@pytest.mark.parametrize("replicas, n, batch", [(2, 24, 8), (3, 22, 6), (2, 21, 8)])
def test_clip_grad_norm_between_backward_and_step_clips_the_reduced_gradients_as_ddp(replicas, n, batch):
    """pytorch/examples' word_language_model and nanoGPT clip between backward and step: under DDP the
    gradients are averaged by then. Clipping each replica's own gradient instead would change the
    update whenever clipping acts (it acts on every step here: max_norm 0.05)."""
    x, y = data(n)
    ref = clipped_plain_steps(batches(x, y, batch), max_norm=0.05)
    strategy = strategy_of(replicas)
    with strategy.scope():
        mnet = strategy.mirror(net())
        opt = strategy.mirror_optimizer(torch.optim.SGD, mnet, gradient_reduction="mean", lr=0.5)
    seen = []

    def step(xb, yb):
        opt.zero_grad()
        F.cross_entropy(mnet(xb), yb).backward()
        seen.append([p.grad.clone() for p in mnet.parameters()])  # after backward: already reduced
        torch.nn.utils.clip_grad_norm_(mnet.parameters(), 0.05)
        opt.step()

    for xb, yb in strategy.experimental_distribute_dataset(batches(x, y, batch)):
        seen.clear()
        strategy.run(step, args=(xb, yb))
        for other in seen[1:]:
            assert all(torch.equal(a, b) for a, b in zip(seen[0], other))
    assert_matches(mnet, ref, strategy, opt)


def test_several_backward_passes_per_step_each_reduce_and_accumulate_as_ddp():
    """Without no_sync, DDP averages each backward's gradients and they accumulate: the same sum as one
    device's backward passes over the same slices."""
    x, y = data(24)
    ref = clipped_plain_steps(batches(x, y, 12), max_norm=0.05, micro=2)
    strategy = strategy_of(2)
    with strategy.scope():
        mnet = strategy.mirror(net())
        opt = strategy.mirror_optimizer(torch.optim.SGD, mnet, gradient_reduction="mean", lr=0.5)

    def step(first, second):
        opt.zero_grad()
        for xb, yb in (first, second):
            F.cross_entropy(mnet(xb), yb).backward()
        torch.nn.utils.clip_grad_norm_(mnet.parameters(), 0.05)
        opt.step()

    for x12, y12 in batches(x, y, 12):
        # Each micro-batch of 6 is split over the replicas as the one device's slices are.
        halves = [strategy.experimental_distribute_values_from_function(
            lambda ctx, xs=xs, ys=ys: (xs[3 * ctx.replica_id_in_sync_group:3 * ctx.replica_id_in_sync_group + 3],
                                       ys[3 * ctx.replica_id_in_sync_group:3 * ctx.replica_id_in_sync_group + 3]))
            for xs, ys in zip(x12.chunk(2), y12.chunk(2))]
        strategy.run(step, args=(halves[0], halves[1]))
    assert_matches(mnet, ref, strategy, opt)


def test_a_forward_or_zero_grad_between_backward_and_step_keeps_the_update_right():
    """Gradients reduced at the end of backward are set aside by a following forward (a backward may
    come) and put back when none did; zero_grad forgets them. Both give one device's update."""
    x, y = data(16)
    ref = net()
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.5)
    for xb, yb in batches(x, y, 8):
        ref_opt.zero_grad()
        F.cross_entropy(ref(xb), yb).backward()
        ref_opt.step()
    strategy = strategy_of(2)
    with strategy.scope():
        mnet = strategy.mirror(net())
        opt = strategy.mirror_optimizer(torch.optim.SGD, mnet, gradient_reduction="mean", lr=0.5)

    def step(xb, yb):
        F.cross_entropy(mnet(xb), yb).backward()  # a backward whose step is skipped...
        mnet.zero_grad()  # ...and forgotten
        F.cross_entropy(mnet(xb), yb).backward()
        probe = mnet(xb).sum()  # a forward with gradients on and no backward (logging, say)
        del probe
        opt.step()
        opt.zero_grad()

    for xb, yb in strategy.experimental_distribute_dataset(batches(x, y, 8)):
        strategy.run(step, args=(xb, yb))
    assert_matches(mnet, ref, strategy, opt)


def test_a_step_failing_after_the_backward_reduction_leaves_no_trace():
    x, y = data(8)
    ref = net()
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.5)
    F.cross_entropy(ref(x), y).backward()
    ref_opt.step()
    strategy = strategy_of(2)
    with strategy.scope():
        mnet = strategy.mirror(net())
        opt = strategy.mirror_optimizer(torch.optim.SGD, mnet, gradient_reduction="mean", lr=0.5)

    def step(xb, yb, fail):
        F.cross_entropy(mnet(xb), yb).backward()  # reduced here, on every replica
        if fail and replica_id() == 1:
            raise ValueError("boom after backward")
        opt.step()

    (xb, yb), = strategy.experimental_distribute_dataset([(x, y)])
    with pytest.raises(ValueError, match="boom after backward"):
        strategy.run(step, args=(xb, yb, True))
    assert all(p.grad is None for m in mnet.values for p in m.parameters())
    strategy.run(step, args=(xb, yb, False))
    assert_matches(mnet, ref, strategy, opt)


def test_sum_reduction_reduce_gradients_then_clip_then_step_reduces_once():
    """TF's rule ("sum", the loss scaled by the global batch): reduce_gradients(), clip the reduced
    gradients, step() - which does not reduce them a second time."""
    x, y = data(16)
    ref = clipped_plain_steps(batches(x, y, 8), max_norm=0.05)
    strategy = strategy_of(2)
    with strategy.scope():
        mnet = strategy.mirror(net())
        opt = strategy.mirror_optimizer(torch.optim.SGD, mnet, lr=0.5)

    def step(xb, yb):
        opt.zero_grad()
        (F.cross_entropy(mnet(xb), yb, reduction="sum") / 8).backward()
        opt.reduce_gradients()
        torch.nn.utils.clip_grad_norm_(mnet.parameters(), 0.05)
        opt.step()

    for xb, yb in strategy.experimental_distribute_dataset(batches(x, y, 8)):
        strategy.run(step, args=(xb, yb))
    assert_matches(mnet, ref, strategy, opt)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def test_autograd_runs_the_queued_end_of_backward_on_the_thread_that_called_backward(device):
    """What "mean"'s all-reduce at the end of backward relies on: autograd's final callbacks run on the
    thread that called backward (the replica's, with its replica context), after every gradient was
    accumulated, also when the graph ran on a GPU's own autograd thread."""
    import threading

    param = nn.Parameter(torch.ones(3, device=device))
    seen = []

    def queue(p):
        torch.autograd.Variable._execution_engine.queue_callback(
            lambda: seen.append((threading.current_thread().name, p.grad.clone().cpu())))

    param.register_post_accumulate_grad_hook(queue)
    caller = threading.Thread(target=lambda: (param * 2).sum().backward(), name="replica-thread")
    caller.start()
    caller.join(timeout=TIMEOUT_S)
    assert not caller.is_alive()
    assert len(seen) == 1 and seen[0][0] == "replica-thread"
    assert torch.equal(seen[0][1], torch.full((3,), 2.0))  # every gradient accumulated by then


# ---- reduce_in_backward=False and set_gradient_weight ------------------------------------------------
IGNORE = -100


def labels_kept_unevenly(n: int = 22) -> tuple[torch.Tensor, torch.Tensor]:
    """Data whose batches of 8 keep their labels unevenly: rows 4-7 ignore theirs, so replica 1 of 2
    (rows 4-7) and replica 2 of 3 (rows 6-7) keep none in the first batch; the last batch is 6 (3/3,
    2/2/2) and keeps 3 of them."""
    x, y = data(n)
    y = y.clone()
    y[4:8] = IGNORE
    y[9] = y[12] = y[17] = y[19] = y[20] = IGNORE
    return x, y


def kept_mean(out: torch.Tensor, y: torch.Tensor, by_hand: bool) -> torch.Tensor:
    """The loss averaged over the labels kept: torch's ignore_index (0 gradients where none are kept),
    or written by hand (NaN gradients there: 0 / 0)."""
    if not by_hand:
        return F.cross_entropy(out, y, ignore_index=IGNORE)
    keep = y != IGNORE
    return (F.cross_entropy(out, y.clamp(min=0), reduction="none") * keep).sum() / keep.sum()


@pytest.mark.parametrize("replicas", [1, 2, 3])
@pytest.mark.parametrize("n", [22, 17])
def test_mean_reduced_in_step_gives_one_devices_update_and_registers_no_hooks(replicas, n):
    """reduce_in_backward=False: the gradients stay each replica's own until step() reduces them
    (weighted by the examples, so uneven last batches - 6 as 3/3 or 2/2/2, 1 as 1/0 or 1/0/0 - give
    one device's update), and no hook is registered on any copy's parameters."""
    data_batches = batches(*data(n), 8)
    ref = net()
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    plain_run(ref, data_batches, ref_opt, lr_scheduler.LambdaLR(ref_opt, lambda e: 1.0), 3, "epoch")
    strategy = strategy_of(replicas)
    with strategy.scope():
        mnet = strategy.mirror(net())
        opt = strategy.mirror_optimizer(torch.optim.SGD, mnet, gradient_reduction="mean", reduce_in_backward=False,
                                        lr=0.1, momentum=0.9)
    assert not opt.reduce_in_backward
    assert all(not p._post_accumulate_grad_hooks for m in mnet.values for p in m.parameters())
    local = {}

    def step(xb, yb):
        opt.zero_grad()
        F.cross_entropy(mnet(xb), yb).backward()
        if len(xb):  # (an empty part's gradients are zeros)
            local[md.get_replica_context().replica_id_in_sync_group] = mnet.module[0].weight.grad.clone()
        opt.step()

    for _ in range(3):
        for xb, yb in strategy.experimental_distribute_dataset(data_batches):
            strategy.run(step, args=(xb, yb))
    if replicas > 1:  # between backward and step each replica held its own gradient
        assert not torch.equal(local[0], local[1])
    assert_matches(mnet, ref, strategy, opt)


def test_reduce_in_backward_is_validated():
    strategy = strategy_of(2)
    mnet = strategy.mirror(net())
    with pytest.raises(ValueError, match=r"reduce_in_backward=True\) needs gradient_reduction=\"mean\""):
        strategy.mirror_optimizer(torch.optim.SGD, mnet, reduce_in_backward=True, lr=0.1)
    with pytest.raises(TypeError, match=r"reduce_in_backward='no'.*True, False, or None"):
        strategy.mirror_optimizer(torch.optim.SGD, mnet, gradient_reduction="mean", reduce_in_backward="no", lr=0.1)
    assert strategy.mirror_optimizer(torch.optim.SGD, mnet, gradient_reduction="mean", lr=0.1).reduce_in_backward
    assert not strategy.mirror_optimizer(torch.optim.SGD, mnet, reduce_in_backward=False, lr=0.1).reduce_in_backward


@pytest.mark.parametrize("replicas", [1, 2, 3])
@pytest.mark.parametrize("in_backward", [True, False])
@pytest.mark.parametrize("as_tensor, by_hand", [(True, False), (True, True), (False, False)])
def test_a_loss_averaged_over_the_labels_it_kept_weighs_each_replica_by_them(replicas, in_backward, as_tensor,
                                                                              by_hand):
    """set_gradient_weight(labels kept): one device's mean over every kept label of the global batch,
    though the replicas keep different counts (some none: their loss is NaN, and written by hand their
    gradients too) and the last batch is short. Weighed by examples instead, the update would differ.
    Tolerance: the file's (float reassociation of the weighted sum)."""
    x, y = labels_kept_unevenly()
    data_batches = batches(x, y, 8)
    ref = net()
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    for _ in range(2):
        for xb, yb in data_batches:
            ref_opt.zero_grad()
            F.cross_entropy(ref(xb), yb, ignore_index=IGNORE).backward()
            ref_opt.step()
    strategy = strategy_of(replicas)
    with strategy.scope():
        mnet = strategy.mirror(net())
        opt = strategy.mirror_optimizer(torch.optim.SGD, mnet, gradient_reduction="mean",
                                        reduce_in_backward=in_backward, lr=0.1, momentum=0.9)

    def step(xb, yb):
        opt.zero_grad()
        loss = kept_mean(mnet(xb), yb, by_hand)
        kept = (yb != IGNORE).sum()
        weight = kept if as_tensor else int(kept)
        if in_backward:  # before the reduction at the end of backward
            opt.set_gradient_weight(weight)
        loss.backward()
        if not in_backward:
            opt.set_gradient_weight(weight)
        opt.step()

    for _ in range(2):
        for xb, yb in strategy.experimental_distribute_dataset(data_batches):
            strategy.run(step, args=(xb, yb))
    assert_matches(mnet, ref, strategy, opt)


@pytest.mark.parametrize("replicas", [1, 2, 3])
@pytest.mark.parametrize("as_tensor", [True, False])
def test_undivided_weights_sum_the_gradients_as_a_loss_with_reduction_sum(replicas, as_tensor):
    """divide=False: each replica's mean loss weighted by its examples, summed - one device's loss with
    reduction="sum" (on one replica too: the gradient times the weight), uneven last batch included."""
    x, y = data(22)
    data_batches = batches(x, y, 8)
    ref = net()
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.01)
    for xb, yb in data_batches:
        ref_opt.zero_grad()
        F.cross_entropy(ref(xb), yb, reduction="sum").backward()
        ref_opt.step()
    strategy = strategy_of(replicas)
    with strategy.scope():
        mnet = strategy.mirror(net())
        opt = strategy.mirror_optimizer(torch.optim.SGD, mnet, gradient_reduction="mean", reduce_in_backward=False,
                                        lr=0.01)

    def step(xb, yb):
        opt.zero_grad()
        F.cross_entropy(mnet(xb), yb).backward()
        opt.set_gradient_weight(torch.tensor(len(yb)) if as_tensor else len(yb), divide=False)
        opt.step()

    for xb, yb in strategy.experimental_distribute_dataset(data_batches):
        strategy.run(step, args=(xb, yb))
    assert_matches(mnet, ref, strategy, opt)


class _NoHostRead(torch.Tensor):
    """A tensor that fails wherever it (or a tensor computed from it) is read on the host: what would
    make a GPU wait for the step's work."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if func in (torch.Tensor.item, torch.Tensor.tolist, torch.Tensor.__float__, torch.Tensor.__int__,
                    torch.Tensor.__bool__, torch.Tensor.__index__):
            raise AssertionError(f"the weight was read on the host ({func.__name__})")
        return super().__torch_function__(func, types, args, kwargs)


@pytest.mark.parametrize("replicas", [1, 2])
def test_a_tensor_weight_is_never_read_on_the_host(replicas):
    x, y = data(8)
    ref = net()
    F.cross_entropy(ref(x), y).backward()
    torch.optim.SGD(ref.parameters(), lr=0.1).step()
    strategy = strategy_of(replicas)
    with strategy.scope():
        mnet = strategy.mirror(net())
        opt = strategy.mirror_optimizer(torch.optim.SGD, mnet, gradient_reduction="mean", reduce_in_backward=False,
                                        lr=0.1)

    def step(xb, yb):
        F.cross_entropy(mnet(xb), yb).backward()
        opt.set_gradient_weight(torch.tensor(float(len(yb))).as_subclass(_NoHostRead))
        opt.step()

    strategy.run(step, args=next(iter(strategy.experimental_distribute_dataset([(x, y)]))))
    assert_matches(mnet, ref, strategy, opt)


def test_a_failed_step_forgets_its_gradient_weight():
    """The weight is part of the step: set in a step that fails, it does not weigh the next one, which
    (weighed by its examples) gives one device's update."""
    x, y = data(8)
    ref = net()
    F.cross_entropy(ref(x), y).backward()
    torch.optim.SGD(ref.parameters(), lr=0.1).step()
    strategy = strategy_of(2)
    with strategy.scope():
        mnet = strategy.mirror(net())
        opt = strategy.mirror_optimizer(torch.optim.SGD, mnet, gradient_reduction="mean", reduce_in_backward=False,
                                        lr=0.1)

    def step(xb, yb, fail):
        F.cross_entropy(mnet(xb), yb).backward()
        if fail:
            opt.set_gradient_weight(100.0 * (1 + md.get_replica_context().replica_id_in_sync_group))
            raise ValueError("boom")
        opt.step()

    (xb, yb), = strategy.experimental_distribute_dataset([(x, y)])
    with pytest.raises(ValueError, match="boom"):
        strategy.run(step, args=(xb, yb, True))
    strategy.run(step, args=(xb, yb, False))
    assert_matches(mnet, ref, strategy, opt)


def test_set_gradient_weight_is_refused_where_it_cannot_act():
    strategy = strategy_of(2)
    with strategy.scope():
        mnet = strategy.mirror(net())
        summed = strategy.mirror_optimizer(torch.optim.SGD, mnet, lr=0.1)
        mean = strategy.mirror_optimizer(torch.optim.SGD, mnet, gradient_reduction="mean", lr=0.1)
    with pytest.raises(RuntimeError, match=r"outside strategy.run.*Call it in the replica function"):
        mean.set_gradient_weight(2)
    x, y = data(8)
    (xb, yb), = strategy.experimental_distribute_dataset([(x, y)])

    def refused(call):
        def fn(xb, yb):
            call(xb, yb)
        return fn

    cases = [
        (lambda xb, yb: summed.set_gradient_weight(2), ValueError, r"gradient_reduction is \"sum\".*\"mean\""),
        (lambda xb, yb: mean.set_gradient_weight(True), TypeError, r"weight=True must be a number"),
        (lambda xb, yb: mean.set_gradient_weight(-1), ValueError, r"weight=-1 must be finite and >= 0"),
        (lambda xb, yb: mean.set_gradient_weight(torch.ones(2)), ValueError, r"one real number.*shape \(2,\)"),
        (lambda xb, yb: mean.set_gradient_weight(1, divide=None), TypeError, r"divide=None"),
        # the gradients were reduced as backward ended: the weight would act on the next step's
        (lambda xb, yb: (F.cross_entropy(mnet(xb), yb).backward(), mean.set_gradient_weight(2)), RuntimeError,
         r"all-reduced already.*before loss.backward\(\).*reduce_in_backward=False"),
    ]
    for call, error, words in cases:
        with pytest.raises(error, match=words):
            strategy.run(refused(call), args=(xb, yb))
    assert all(p.grad is None for m in mnet.values for p in m.parameters())  # the failed steps left no trace


@pytest.mark.parametrize("in_backward", [True, False])
def test_two_mean_optimizers_of_one_module_each_weigh_by_the_replicas_examples(in_backward):
    """One optimizer for the body, another for the head (as SparseAdam for embeddings beside Adam): each
    weighs the replicas by the examples since its own last reduction. They shared one count, which the
    first to reduce took, so the other weighed 1 each: an uneven batch (5 as 2/2/1) updated wrongly."""
    x, y = data(5)
    ref = net()
    body, head = torch.optim.SGD(ref[0].parameters(), lr=0.5), torch.optim.SGD(ref[2].parameters(), lr=0.5)
    F.cross_entropy(ref(x), y).backward()
    body.step()
    head.step()
    strategy = strategy_of(3)
    with strategy.scope():
        mnet = strategy.mirror(net())
        opts = [strategy.mirror_optimizer(torch.optim.SGD, part, gradient_reduction="mean", lr=0.5,
                                          reduce_in_backward=in_backward) for part in (mnet[0], mnet[2])]

    def step(xb, yb):
        F.cross_entropy(mnet(xb), yb).backward()
        for opt in opts:
            opt.step()

    strategy.run(step, args=next(iter(strategy.experimental_distribute_dataset([(x, y)]))))
    assert_matches(mnet, ref, strategy)


def _bn_net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 4), nn.BatchNorm1d(4), nn.ReLU(), nn.Linear(4, 3))


@pytest.mark.parametrize("in_backward", [False, True])
def test_step_averages_the_buffers_in_the_gradients_meeting(in_backward):
    """Issue 35: step() averages BatchNorm's statistics in the meeting that reduces the gradients (or
    that meets before the update), not in one of their own: a step of 2 replicas makes one meeting
    fewer, and gives the same statistics, weighted by each replica's examples, and the same weights,
    bit for bit, as the separate average (the reference: torch's step, then finish_step's own meeting)."""
    x, y = data(7)
    strategy = strategy_of(2)
    with strategy.scope():
        mnet = strategy.mirror(_bn_net())
        opt = strategy.mirror_optimizer(torch.optim.SGD, mnet, gradient_reduction="mean",
                                        reduce_in_backward=in_backward, lr=0.1)
        ref = strategy.mirror(_bn_net())
        ref_opt = strategy.mirror_optimizer(torch.optim.SGD, ref, gradient_reduction="mean",
                                            reduce_in_backward=in_backward, lr=0.1)
    meetings = []
    exchange = md.replicas.Rendezvous.exchange

    def counted(self, *args, **kwargs):
        meetings.append(args[1] if len(args) > 1 else kwargs.get("what"))
        return exchange(self, *args, **kwargs)

    def step(xb, yb):
        F.cross_entropy(mnet(xb), yb).backward()
        opt.step()
        opt.zero_grad()

    def ref_step(xb, yb):
        F.cross_entropy(ref(xb), yb).backward()
        if not in_backward:
            ref_opt.reduce_gradients()
        ref_opt.optimizer.step()  # (torch's own, then the average in a meeting of its own)
        ref_opt.finish_step(weight=len(yb))
        ref_opt.zero_grad()

    (xb, yb), = strategy.experimental_distribute_dataset([(x, y)])  # 4 and 3 examples: uneven parts
    md.replicas.Rendezvous.exchange = counted
    try:
        strategy.run(step, args=(xb, yb))
        ours = len(meetings)
        meetings.clear()
        strategy.run(ref_step, args=(xb, yb))
        theirs = len(meetings)
    finally:
        md.replicas.Rendezvous.exchange = exchange
    # Per replica: reduced in step(), one meeting (the separate average: two); reduced when backward ended,
    # that meeting and the one before the update, which carries the average (before: a third of its own).
    assert ours == 2 * (2 if in_backward else 1), meetings
    assert theirs == 2 * 2
    strategy.check_in_sync(mnet)
    for a, b in zip(mnet.replicas[0].buffers(), ref.replicas[0].buffers()):
        assert torch.equal(a, b)
    for a, b in zip(mnet.replicas[0].parameters(), ref.replicas[0].parameters()):
        assert torch.equal(a, b)


def test_an_update_failing_after_the_buffers_were_averaged_leaves_the_next_average_to_run():
    """Issue 35: the buffer average rides in the gradients' meeting, before the update, and finish_step
    then skips its own; when the update fails (on every replica, before it changed anything), the step
    is rolled back - statistics too - and nothing skips the next average: a later sync_buffers() still
    averages, and the next step gives one clean step's result, bit for bit (the reference: another
    strategy)."""
    x, y = data(8)
    strategy, ref_strategy = strategy_of(2), strategy_of(2)
    with strategy.scope():
        mnet = strategy.mirror(_bn_net())
        opt = strategy.mirror_optimizer(torch.optim.SGD, mnet, gradient_reduction="mean", lr=0.1)
    with ref_strategy.scope():
        ref = ref_strategy.mirror(_bn_net())
        ref_opt = ref_strategy.mirror_optimizer(torch.optim.SGD, ref, gradient_reduction="mean", lr=0.1)
    saved = [copy_.state_dict() for copy_ in mnet.replicas]
    steps = [o.step for o in opt.replicas]
    for o in opt.replicas:
        o.step = lambda *args, **kwargs: (_ for _ in ()).throw(RuntimeError("boom in the update"))

    def step(module, optimizer, xb, yb):
        F.cross_entropy(module(xb), yb).backward()
        optimizer.step()
        optimizer.zero_grad()

    (xb, yb), = strategy.experimental_distribute_dataset([(x, y)])
    with pytest.raises(RuntimeError, match="boom in the update"):
        strategy.run(step, args=(mnet, opt, xb, yb))
    for o, torch_step in zip(opt.replicas, steps):
        o.step = torch_step
    for copy_, before in zip(mnet.replicas, saved):  # rolled back: the statistics too
        for a, b in zip(copy_.state_dict().values(), before.values()):
            assert torch.equal(a, b)

    def uneven_statistics():
        with torch.no_grad():
            mnet.module[1].running_mean.fill_(float(replica_id()))
        opt.sync_buffers()

    strategy.run(uneven_statistics)
    strategy.check_in_sync(mnet)
    for copy_ in mnet.replicas:
        assert torch.equal(copy_[1].running_mean, torch.full((4,), 0.5))
        copy_[1].running_mean.zero_()
    strategy.run(step, args=(mnet, opt, xb, yb))
    (rx, ry), = ref_strategy.experimental_distribute_dataset([(x, y)])
    ref_strategy.run(step, args=(ref, ref_opt, rx, ry))
    strategy.check_in_sync(mnet)
    for a, b in zip(mnet.replicas[0].state_dict().values(), ref.replicas[0].state_dict().values()):
        assert torch.equal(a, b)


def test_integer_buffers_take_replica_0s_value_exactly_beyond_float64s_whole_numbers():
    """The buffers that take replica 0's value travel in int64 (a float64 holds whole numbers exactly
    only up to 2**53): an int64 buffer of 2**60 + 1 arrives bit for bit, and each float buffer is the
    replicas' mean."""
    net = nn.Linear(5, 3)
    net.register_buffer("tag", torch.zeros(2, dtype=torch.int64))
    net.register_buffer("stat", torch.zeros(2))
    strategy = strategy_of(2)
    with strategy.scope():
        mnet = strategy.mirror(net)
        opt = strategy.mirror_optimizer(torch.optim.SGD, mnet, lr=0.1)

    def step(xb, yb):
        copy_ = mnet.module
        with torch.no_grad():
            copy_.tag.copy_(torch.tensor([2 ** 60 + 1, -(2 ** 62) - 3]) + replica_id())
            copy_.stat.fill_(1.0 + replica_id())
        F.cross_entropy(mnet(xb), yb).backward()
        opt.step()

    (xb, yb), = strategy.experimental_distribute_dataset([data(4)])
    strategy.run(step, args=(xb, yb))
    for copy_ in mnet.replicas:
        assert copy_.tag.tolist() == [2 ** 60 + 1, -(2 ** 62) - 3]
        assert torch.equal(copy_.stat, torch.full((2,), 1.5))


def test_buffers_too_large_to_pack_are_averaged_step_after_step():
    """A buffer of 2**16 elements or more makes its flat as large as a gradient the reducer reads where it
    lies; riding with the gradients, the flats each replica keeps between steps (its zeros for replica
    0's integers among them) must still hold what the next step needs: three steps, each copy the mean
    of the replicas' values (floats) and replica 0's (integers), bit for bit."""
    net = nn.Linear(5, 3)
    n = (1 << 16) + 3
    net.register_buffer("big", torch.zeros(n))
    net.register_buffer("ids", torch.zeros(n, dtype=torch.int64))
    strategy = strategy_of(2)
    with strategy.scope():
        mnet = strategy.mirror(net)
        opt = strategy.mirror_optimizer(torch.optim.SGD, mnet, gradient_reduction="mean", lr=0.1)

    def step(xb, yb, k):
        copy_ = mnet.module
        with torch.no_grad():
            copy_.big.copy_(torch.arange(n, dtype=torch.float32) * (replica_id() + k))
            copy_.ids.copy_(torch.arange(n) + 1000 * (replica_id() + 1) * k)
        F.cross_entropy(mnet(xb), yb).backward()
        opt.step()
        opt.zero_grad()

    (xb, yb), = strategy.experimental_distribute_dataset([data(4)])  # 2 examples each: equal weights
    for k in (1, 2, 3):
        strategy.run(step, args=(xb, yb, k))
        for copy_ in mnet.replicas:
            assert torch.equal(copy_.big, torch.arange(n, dtype=torch.float32) * (k + 0.5))
            assert torch.equal(copy_.ids, torch.arange(n) + 1000 * k)


def test_a_replica_without_examples_adds_nothing_to_the_buffer_average():
    """The buffer average riding with the gradients weighs each replica by its examples: with parts of 1
    and 0 rows every copy takes replica 0's statistics bit for bit (a replica of weight 0 cannot divide
    without knowing the total: its way and replica 0's give the same), and where no replica has an
    example the statistics keep their values instead of 0/0."""
    torch.manual_seed(0)
    net = nn.Linear(5, 3)
    net.register_buffer("stat", torch.zeros(3))
    strategy = strategy_of(2)
    with strategy.scope():
        mnet = strategy.mirror(net)
        opt = strategy.mirror_optimizer(torch.optim.SGD, mnet, gradient_reduction="mean", lr=0.1)
    value = torch.tensor([0.1, 1 / 3, -7.25])

    def step(xb, yb):
        copy_ = mnet.module
        with torch.no_grad():
            copy_.stat.copy_(value * (1 + replica_id()))
        loss = F.cross_entropy(mnet(xb), yb, reduction="sum")  # (0 on the empty part, not a NaN mean)
        loss.backward()
        opt.step()
        opt.zero_grad()

    x, y = data(1)
    (xb, yb), = strategy.experimental_distribute_dataset([(x, y)])  # parts of 1 and 0 rows
    strategy.run(step, args=(xb, yb))
    for copy_ in mnet.replicas:
        assert torch.equal(copy_.stat, value)
    empty = strategy.experimental_distribute_values_from_function(lambda ctx: (x[:0], y[:0]))
    strategy.run(lambda part: step(*part), args=(empty,))
    for r, copy_ in enumerate(mnet.replicas):  # nobody weighs: each keeps what its step wrote
        assert torch.equal(copy_.stat, value * (1 + r))
