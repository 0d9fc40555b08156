"""_param_groups.py (issue 14, "no silent misuse"): a torch LR scheduler stepped inside strategy.run.

The natural port of a PyTorch loop body, `opt.step(); sched.step()` inside the step function, has
every replica's thread step the one scheduler: it used to count N steps per batch and give the
replicas different rates, silently. Inside strategy.run a MirroredOptimizer's param groups now read
the replica's own groups and refuse writes, with an error naming the optimizer, the key and the
fix; reads (clipping over the groups' parameters, a logged rate) keep working, and a scheduler
stepped after strategy.run drives every replica like plain PyTorch.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.optim import lr_scheduler

from _replicas import strategy_of  # tests/_replicas.py
from test_copy_watch import assert_unchanged, snapshot, train  # the same steps and checks

# Float reassociation: the replicas' gradient parts add in another order than one device's sum
# (measured at most ~6e-8 on weights of order 0.1 to 1 over these few steps).
RTOL, ATOL = 1e-6, 2e-7


def net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 3))


def data(n: int = 12, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 5, generator=g), torch.randint(0, 3, (n,), generator=g)


def mirrored(n: int, reduction: str):
    strategy = strategy_of(n)
    with strategy.scope():
        mnet = strategy.mirror(net())
        opt = strategy.mirror_optimizer(torch.optim.SGD, mnet, gradient_reduction=reduction, lr=0.1, momentum=0.9)
    return strategy, mnet, opt


def assert_matches(mnet, ref: nn.Module, strategy) -> None:
    for (name, want), got in zip(ref.state_dict().items(), mnet.values[-1].state_dict().values()):
        torch.testing.assert_close(got, want, rtol=RTOL, atol=ATOL, msg=lambda m: f"{name}: {m}")
    strategy.check_in_sync(mnet)  # and every replica bit for bit


# ---- a torch LR scheduler stepped inside strategy.run ----------------------------------------------------
@pytest.mark.parametrize("replicas", [2, 3])
@pytest.mark.parametrize("name", ["StepLR", "OneCycleLR"])
def test_a_scheduler_stepped_inside_run_is_refused_naming_the_fix(name, replicas):
    """The natural port of `opt.step(); sched.step()`: refused when the scheduler writes a group
    (OneCycleLR writes the momentum first). The update before it was applied by every replica and
    stays (a failure after a committed update keeps it, see rollback.py): the replicas equal one
    plain torch step, at the rate before the schedule moved."""
    strategy, mnet, opt = mirrored(replicas, "mean")
    sched = (lr_scheduler.StepLR(opt, step_size=1, gamma=0.5) if name == "StepLR"
             else lr_scheduler.OneCycleLR(opt, max_lr=0.1, total_steps=10))
    rate, momentum = opt.param_groups[0]["lr"], opt.param_groups[0]["momentum"]
    x, y = data()
    with pytest.raises(RuntimeError) as raised:
        for xb, yb in strategy.experimental_distribute_dataset([(x, y)]):
            strategy.run(lambda a, b: (opt.zero_grad(), F.cross_entropy(mnet(a), b).backward(), opt.step(),
                                       sched.step()), args=(xb, yb))
    message = str(raised.value)
    key = "lr" if name == "StepLR" else "momentum"
    assert f"param_groups[0][{key!r}] was set inside strategy.run" in message
    assert f"{name} has already counted this call" in message
    assert "Step the scheduler after strategy.run, once per global step" in message
    assert "mr.callbacks.TorchLRScheduler(scheduler)" in message
    assert [(o.param_groups[0]["lr"], o.param_groups[0]["momentum"]) for o in opt.values] == \
        [(rate, momentum)] * replicas
    ref = net()
    ref_opt = torch.optim.SGD(ref.parameters(), lr=rate, momentum=momentum)
    F.cross_entropy(ref(x), y).backward()
    ref_opt.step()
    assert_matches(mnet, ref, strategy)
    strategy.check_in_sync(opt)


def test_a_scheduler_stepped_before_the_update_inside_run_changes_nothing():
    strategy, mnet, opt = mirrored(2, "sum")
    sched = lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    x, y = data()
    train(strategy, mnet, opt, x, y)
    before = snapshot(mnet, opt)

    def step(xb, yb):
        sched.step()
        F.cross_entropy(mnet(xb), yb, reduction="sum").div(len(x)).backward()
        opt.step()

    with pytest.raises(RuntimeError, match=r"param_groups\[0\]\['lr'\] was set inside strategy.run"):
        for xb, yb in strategy.experimental_distribute_dataset([(x, y)]):
            strategy.run(step, args=(xb, yb))
    assert_unchanged(before, mnet, opt)


def test_reads_of_the_groups_inside_run_still_work():
    """clip_grad_norm_ over the groups' parameters, GradScaler-style reads, and a rate read in the step."""
    strategy, mnet, opt = mirrored(2, "mean")
    x, y = data()
    seen = []

    def step(xb, yb):
        opt.zero_grad()
        F.cross_entropy(mnet(xb), yb).backward()
        params = [p for group in opt.param_groups for p in group["params"]]
        assert all(any(p is q for q in mnet.module.parameters()) for p in params)  # the replica's own
        torch.nn.utils.clip_grad_norm_(params, max_norm=0.5)
        seen.append((opt.param_groups[0]["lr"], opt.param_groups[0].get("momentum"), "lr" in opt.param_groups[0]))
        opt.step()

    for xb, yb in strategy.experimental_distribute_dataset([(x, y)]):
        strategy.run(step, args=(xb, yb))
    assert seen == [(0.1, 0.9, True)] * 2
    strategy.check_in_sync([mnet, opt])


@pytest.mark.parametrize("replicas", [1, 2, 3])
def test_a_scheduler_stepped_after_run_drives_every_replica_like_plain_torch(replicas):
    strategy, mnet, opt = mirrored(replicas, "mean")
    sched = lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    x, y = data()
    train(strategy, mnet, opt, x, y, steps=3, after_step=sched.step)
    ref = net()
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    ref_sched = lr_scheduler.StepLR(ref_opt, step_size=1, gamma=0.5)
    for _ in range(3):
        ref_opt.zero_grad()
        F.cross_entropy(ref(x), y).backward()
        ref_opt.step()
        ref_sched.step()
    assert [o.param_groups[0]["lr"] for o in opt.values] == [ref_opt.param_groups[0]["lr"]] * replicas
    assert_matches(mnet, ref, strategy)
