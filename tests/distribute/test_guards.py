"""guards.py (issue 14): plain torch state that replica threads would share is refused, not trained.

Inside strategy.run on several replicas, stepping a torch optimizer that strategy.mirror_optimizer
did not make, or training a module that strategy.mirror did not copy, raises an error naming it and
the fix, before anything changed. The checks cost nothing in steady state: the module check is
installed for the first run of each replica function only.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.modules import module as torch_module

import mirrored as mr
import mirrored.distribute as md
from _replicas import strategy_of  # tests/_replicas.py


def net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 3), nn.ReLU(), nn.Linear(3, 2))


def batch(strategy: md.MirroredStrategy):
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(8, 4, generator=g), torch.randint(0, 2, (8,), generator=g)
    return next(iter(strategy.experimental_distribute_dataset([(x, y)])))


def snapshot(modules) -> list[torch.Tensor]:
    return [p.detach().clone() for m in modules for p in m.parameters()]


def test_a_plain_torch_optimizer_stepped_in_run_is_refused_before_it_changes_anything():
    """torch.optim.SGD over mnet.parameters() (replica 0's copy): every replica would step it."""
    s = strategy_of(2)
    with s.scope():
        mnet = s.mirror(net())
    opt = torch.optim.SGD(mnet.parameters(), lr=0.1)
    before = snapshot(mnet.values)

    def step(x, y):
        F.cross_entropy(mnet(x), y).backward()
        opt.step()

    with pytest.raises(RuntimeError, match=r"replica \d \(cpu:\d\): SGD.step\(\) inside strategy.run on 2 replicas"
                                           r".*strategy.mirror_optimizer\(torch.optim.SGD, mnet"):
        s.run(step, args=batch(s))
    assert all(torch.equal(a, b) for a, b in zip(before, snapshot(mnet.values)))
    assert all(p.grad is None for m in mnet.values for p in m.parameters())  # the failed step was rolled back


def test_a_plain_module_trained_in_run_is_refused_before_it_changes_anything():
    """A module created outside the scope and not mirrored: both threads would write its .grad and
    step it (issue 14: both threads updated the same module)."""
    s = strategy_of(2)
    plain = net()
    with s.scope():
        head = s.mirror(nn.Linear(2, 2))
        opt = s.mirror_optimizer(torch.optim.SGD, head, lr=0.1)
    before = snapshot([plain])

    def step(x, y):
        F.cross_entropy(head(plain(x)), y).backward()
        opt.step()

    with pytest.raises(RuntimeError, match=r"Linear was called inside strategy.run on 2 replicas with gradients "
                                           r"on, but it is a plain torch module.*strategy.mirror\(net\)"):
        s.run(step, args=batch(s))
    assert all(torch.equal(a, b) for a, b in zip(before, snapshot([plain])))
    assert all(p.grad is None for p in plain.parameters())


def test_what_cannot_change_a_shared_module_is_allowed():
    """Frozen, parameter-free or no_grad use of a plain module changes nothing; one replica shares with
    no other thread; a submodule added to the copies by hand belongs to its replica."""
    s = strategy_of(2)
    frozen = net().requires_grad_(False)
    with s.scope():
        mnet = s.mirror(nn.Linear(2, 2))
        opt = s.mirror_optimizer(torch.optim.SGD, mnet, lr=0.1)
    for m in mnet.values:
        m.extra = nn.Linear(2, 2)  # by hand, after mirror

    def step(x, y):
        with torch.no_grad():
            net()(x)  # a fresh module under no_grad
        logits = mnet(F.relu(frozen(x)))
        F.cross_entropy(logits + mnet.extra(logits), y).backward()
        opt.step()

    s.run(step, args=batch(s))
    one = strategy_of(1)
    plain = net()
    plain_opt = torch.optim.SGD(plain.parameters(), lr=0.1)

    def plain_step(x, y):
        F.cross_entropy(plain(x), y).backward()
        plain_opt.step()

    one.run(plain_step, args=batch(one))


def test_model_fit_passes_the_guards():
    s = strategy_of(2)
    with s.scope():
        model = mr.Model(net())
        model.compile(optimizer=torch.optim.Adam, loss="sparse_categorical_crossentropy")
    g = torch.Generator().manual_seed(1)
    model.fit(torch.randn(16, 4, generator=g), torch.randint(0, 2, (16,), generator=g), batch_size=8, verbose=0)
    model.check_in_sync()


def test_the_module_check_is_installed_for_the_first_run_of_each_function_only():
    """torch's global module hook takes every module call off its fast path, so it is there only while
    a replica function runs for the first time on a strategy; later runs cost nothing."""
    s = strategy_of(2)
    with s.scope():
        mnet = s.mirror(net())
    installed = []

    def step(x, y):
        installed.append(len(torch_module._global_forward_pre_hooks))
        mnet(x)

    args = batch(s)
    for _ in range(3):
        s.run(step, args=args)
    assert installed[:2] == [1, 1] and installed[2:] == [0] * 4  # both replicas of the first run
    assert len(torch_module._global_forward_pre_hooks) == 0
    s.run(lambda x, y: installed.append(len(torch_module._global_forward_pre_hooks)), args=args)
    assert installed[-2:] == [1, 1]  # another function: checked in its first run
