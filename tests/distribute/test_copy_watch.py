"""_copy_watch.py (issue 14, "a mirrored module is a whole module"): a change that reaches some
replicas' copies only fails the step before any replica applies it.

Outside strategy.run, reads of a mirrored module give replica 0's copy; the ordinary PyTorch idioms
that change what they return - freezing (`p.requires_grad = False`), re-initialising
(`nn.init.zeros_(mnet[3].weight)`), freezing BatchNorm (`m.eval()` over `mnet.modules()`) - used to
change replica 0 alone and train on silently. Each now raises OutOfSyncError naming the parameter
or module, the replicas and the fix, and leaves weights, buffers and optimizer state bit for bit as
they were before the step; check_in_sync compares the flags too. The ways that reach every copy keep
working and match plain single-process PyTorch.
"""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import mirrored.distribute as md
from _replicas import strategy_of  # tests/_replicas.py

# Float reassociation: the replicas' gradient parts add in another order than one device's sum
# (measured at most ~6e-8 on weights of order 0.1 to 1 over these few steps).
RTOL, ATOL = 1e-6, 2e-7


def net(bn: bool = True) -> nn.Module:
    """With bn=False, no BatchNorm (its statistics are per replica in training mode, so a run compared
    with one device on the whole batch leaves it out); the layers keep their indices."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 8), nn.BatchNorm1d(8) if bn else nn.Identity(), nn.Tanh(), nn.Linear(8, 3))


def data(n: int = 12, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 5, generator=g), torch.randint(0, 3, (n,), generator=g)


def mirrored(n: int, reduction: str, optimizer: str = "sgd", bn: bool = True):
    strategy = strategy_of(n)
    with strategy.scope():
        mnet = strategy.mirror(net(bn))
        if optimizer == "sgd":
            opt = strategy.mirror_optimizer(torch.optim.SGD, mnet, gradient_reduction=reduction, lr=0.1, momentum=0.9)
        else:
            opt = strategy.mirror_optimizer(torch.optim.Adam, mnet, gradient_reduction=reduction, lr=0.01,
                                            weight_decay=0.01)
    return strategy, mnet, opt


def train(strategy, mnet, opt, x, y, steps: int = 1, after_step=None) -> None:
    """`steps` global steps on the whole batch; the loss line fits the reduction (TF's or DDP's)."""
    def step(xb, yb):
        opt.zero_grad()
        if opt.gradient_reduction == "mean":
            F.cross_entropy(mnet(xb), yb).backward()
        else:
            F.cross_entropy(mnet(xb), yb, reduction="sum").div(len(x)).backward()
        opt.step()

    for _ in range(steps):
        for xb, yb in strategy.experimental_distribute_dataset([(x, y)]):
            strategy.run(step, args=(xb, yb))
        if after_step is not None:
            after_step()


def snapshot(mnet, opt) -> list:
    """Every replica's weights, buffers and optimizer state (tensors copied)."""
    return [(copy.deepcopy(m.state_dict()), copy.deepcopy(o.state_dict())) for m, o in zip(mnet.values, opt.values)]


def assert_unchanged(before: list, mnet, opt) -> None:
    for r, ((module_state, opt_state), m, o) in enumerate(zip(before, mnet.values, opt.values)):
        for name, value in m.state_dict().items():
            assert torch.equal(value, module_state[name]), f"replica {r}: {name} changed"
        now = o.state_dict()
        assert now["param_groups"] == opt_state["param_groups"], f"replica {r}: param groups changed"
        assert now["state"].keys() == opt_state["state"].keys()
        for index, state in now["state"].items():
            for key, value in state.items():
                assert torch.equal(torch.as_tensor(value), torch.as_tensor(opt_state["state"][index][key])), \
                    f"replica {r}: optimizer state[{index}][{key!r}] changed"


def plain_reference(steps: int, setup=None, bn: bool = False) -> nn.Module:
    """One device, the whole batch, SGD with momentum: what the mirrored runs must equal."""
    ref = net(bn)
    if setup is not None:
        setup(ref)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    x, y = data()
    for _ in range(steps):
        ref_opt.zero_grad()
        F.cross_entropy(ref(x), y).backward()
        ref_opt.step()
    return ref


def assert_matches(mnet, ref: nn.Module, strategy) -> None:
    for (name, want), got in zip(ref.state_dict().items(), mnet.values[-1].state_dict().values()):
        torch.testing.assert_close(got, want, rtol=RTOL, atol=ATOL, msg=lambda m: f"{name}: {m}")
    strategy.check_in_sync(mnet)  # and every replica bit for bit


# ---- changes that reached replica 0's copy alone -----------------------------------------------------
def freeze_through_parameters(mnet) -> None:
    for p in mnet[0].parameters():  # the usual freeze idiom, on what a read returned
        p.requires_grad = False


def reinit_through_getattr(mnet) -> None:
    nn.init.zeros_(mnet[3].weight)  # a custom init, on replica 0's Parameter


def bn_eval_through_modules(mnet) -> None:
    for m in mnet.modules():  # freezing BatchNorm, as fine-tuning scripts do
        if isinstance(m, nn.BatchNorm1d):
            m.eval()


MISUSES = {
    "freeze": (freeze_through_parameters,
               "parameter '0.weight' has requires_grad=False on replica 0's copy but True on replica 1's (cpu:1)",
               "m.get_parameter('0.weight').requires_grad_(False)"),
    "reinit": (reinit_through_getattr,
               "parameter '3.weight' holds different values on replica 0's copy and on replica 1's (cpu:1)",
               "replica 0's copy was written in place 1 more time(s) than replica 1's"),
    "bn_eval": (bn_eval_through_modules,
                "module '1' (BatchNorm1d) is in eval mode on replica 0's copy but in training mode on replica 1's",
                "mnet[1].eval()"),
}


@pytest.mark.parametrize("reduction", ["sum", "mean"])
@pytest.mark.parametrize("replicas", [2, 3])
@pytest.mark.parametrize("misuse", list(MISUSES))
def test_a_change_that_reached_replica_0_alone_fails_the_step_and_changes_nothing(misuse, replicas, reduction):
    """Two good steps first (the momentum exists, and normal steps must not trip the check), then the
    change through a read, then the step that must fail before any replica updates."""
    change, says, fix = MISUSES[misuse]
    strategy, mnet, opt = mirrored(replicas, reduction)
    x, y = data()
    train(strategy, mnet, opt, x, y, steps=2)
    change(mnet)
    before = snapshot(mnet, opt)
    with pytest.raises(md.OutOfSyncError) as raised:
        train(strategy, mnet, opt, x, y)
    message = str(raised.value)
    assert message.startswith("replica 0 (cpu:0): MirroredOptimizer(")
    assert says in message and fix in message
    assert "reaches replica 0's copy only" in message and "rolled back on every replica" in message
    assert_unchanged(before, mnet, opt)
    with pytest.raises(md.OutOfSyncError):  # and it stays refused: the copies still differ
        train(strategy, mnet, opt, x, y)
    assert_unchanged(before, mnet, opt)


@pytest.mark.parametrize("misuse", ["freeze", "bn_eval"])
def test_check_in_sync_compares_requires_grad_and_training_flags(misuse):
    """Equal values, but copies that would compute differently: check_in_sync no longer passes."""
    change, says, _ = MISUSES[misuse]
    strategy, mnet, _ = mirrored(2, "sum")
    strategy.check_in_sync(mnet)
    change(mnet)
    with pytest.raises(md.OutOfSyncError, match="the copies of the module differ: " + says.replace("(", r"\(")
                       .replace(")", r"\)")):
        strategy.check_in_sync(mnet)


def test_adam_foreach_steps_and_the_mean_reduction_keep_write_counts_equal():
    """Adam (foreach: several in-place ops per parameter per step) with weight decay, 4 steps, "mean"
    reduction with an uneven split over 3 replicas (8 examples: 3, 3, 2), and a backward pass twice
    per step: no false alarm, and the replicas stay bitwise identical."""
    strategy, mnet, opt = mirrored(3, "mean", optimizer="adam")
    x, y = data(8)

    def step(xb, yb):
        opt.zero_grad()
        F.cross_entropy(mnet(xb), yb).backward()
        F.cross_entropy(mnet(xb), yb).backward()  # accumulates, as under DDP
        opt.step()

    for _ in range(4):
        for xb, yb in strategy.experimental_distribute_dataset([(x, y)]):
            strategy.run(step, args=(xb, yb))
    strategy.check_in_sync([mnet, opt])
    assert all(p._version > 4 for p in mnet.values[0].parameters())  # the counters did move


# ---- the ways that reach every copy ------------------------------------------------------------------
@pytest.mark.parametrize("replicas", [2, 3])
def test_freezing_a_submodule_view_freezes_every_copy_like_plain_torch(replicas):
    strategy, mnet, opt = mirrored(replicas, "mean", bn=False)
    mnet[0].requires_grad_(False)
    x, y = data()
    train(strategy, mnet, opt, x, y, steps=3)
    ref = plain_reference(3, setup=lambda m: m[0].requires_grad_(False))
    assert_matches(mnet, ref, strategy)
    assert torch.equal(mnet.values[0][0].weight, net(bn=False)[0].weight)  # frozen: as built


@pytest.mark.parametrize("replicas", [2, 3])
def test_eval_mode_on_the_mirror_reaches_every_copy_like_plain_torch(replicas):
    strategy, mnet, opt = mirrored(replicas, "mean")
    mnet.eval()  # BatchNorm uses its running statistics on every copy
    x, y = data()
    train(strategy, mnet, opt, x, y, steps=3)
    assert_matches(mnet, plain_reference(3, setup=lambda m: m.eval(), bn=True), strategy)


def test_a_change_made_inside_strategy_run_reaches_each_replicas_own_copy():
    """There a read gives the replica's own copy, and every replica runs the same line."""
    strategy, mnet, opt = mirrored(2, "mean", bn=False)
    strategy.run(lambda: [p.requires_grad_(False) for p in mnet[0].parameters()])
    x, y = data()
    train(strategy, mnet, opt, x, y, steps=2)
    assert_matches(mnet, plain_reference(2, setup=lambda m: m[0].requires_grad_(False)), strategy)


def test_the_same_change_made_on_every_copy_afterwards_is_accepted():
    """After the error, the change made on every copy: replica 0's weight was written twice, the
    others' once, but the values are equal, so the step goes ahead (and later ones too)."""
    strategy, mnet, opt = mirrored(2, "sum", bn=False)
    x, y = data()
    reinit_through_getattr(mnet)
    with pytest.raises(md.OutOfSyncError, match="'3.weight' holds different values"):
        train(strategy, mnet, opt, x, y)
    for m in mnet.values:
        nn.init.zeros_(m[3].weight)
    train(strategy, mnet, opt, x, y, steps=2)
    assert_matches(mnet, plain_reference(2, setup=lambda m: nn.init.zeros_(m[3].weight)), strategy)


def test_structure_changes_through_the_mirror_are_watched_too():
    """A module added through the mirror (every copy) is walked again: a later change through a read
    of the new module's parameter is caught."""
    strategy, mnet, opt = mirrored(2, "sum")
    mnet.add_module("head", nn.Linear(3, 3))
    nn.init.ones_(mnet.head.weight)  # replica 0's copy of the new module only
    with pytest.raises(md.OutOfSyncError, match="'head.weight' holds different values"):
        train(strategy, mnet, opt, *data())


def test_a_head_swapped_on_every_copy_before_the_optimizer_is_watched():
    """Fine-tuning: a new head put on every copy by hand after mirror(); the optimizer made after it
    walks the copies again, so a later change through a read of the head is caught."""
    strategy = strategy_of(2)
    with strategy.scope():
        mnet = strategy.mirror(net(bn=False))
        for m in mnet.values:
            torch.manual_seed(1)  # the same head on every copy
            m[3] = nn.Linear(8, 4)
        opt = strategy.mirror_optimizer(torch.optim.SGD, mnet, lr=0.1)
    for p in mnet[3].parameters():
        p.requires_grad = False
    with pytest.raises(md.OutOfSyncError, match="parameter '3.weight' has requires_grad=False on replica 0's copy"):
        train(strategy, mnet, opt, *data())
