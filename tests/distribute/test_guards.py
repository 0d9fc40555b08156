"""guards.py (issue 14): plain torch state that replica threads would share is refused, not trained.

Inside strategy.run on several replicas, stepping a torch optimizer that strategy.mirror_optimizer
did not make, or training a module that strategy.mirror did not copy, raises an error naming it and
the fix, before anything changed. The checks cost nothing in steady state: the module check is
installed for the first run of each replica function only.
"""
from __future__ import annotations

import copy

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
    no other thread; a submodule added to the copies by hand belongs to its replica. Each run is
    allowed, and trains as plain PyTorch does: the mirrored Linear takes the sum of the two replicas'
    gradients, each replica's `extra` keeps the gradient of its own half of the batch, the frozen
    module is untouched, and one replica steps a plain optimizer as a plain loop does. Tolerances:
    the rounding of SGD's update (torch may fuse p - lr * g), a few ulps."""
    s = strategy_of(2)
    frozen = net().requires_grad_(False)
    frozen_before = snapshot([frozen])
    with s.scope():
        mnet = s.mirror(nn.Linear(2, 2))
        opt = s.mirror_optimizer(torch.optim.SGD, mnet, lr=0.1)
    for m in mnet.values:
        m.extra = nn.Linear(2, 2)  # by hand, after mirror: each replica's own, with its own weights
    refs = [copy.deepcopy(m) for m in mnet.values]

    def step(x, y):
        with torch.no_grad():
            net()(x)  # a fresh module under no_grad
        logits = mnet(F.relu(frozen(x)))
        F.cross_entropy(logits + mnet.extra(logits), y).backward()
        opt.step()

    args = batch(s)
    s.run(step, args=args)
    for ref, x, y in zip(refs, *(s.experimental_local_results(a) for a in args)):  # each replica's half
        logits = ref(F.relu(frozen(x)))
        F.cross_entropy(logits + ref.extra(logits), y).backward()
    with torch.no_grad():  # (the copies start equal: the Linear was mirrored)
        want = [a - 0.1 * (a.grad + b.grad) for a, b in zip((refs[0].weight, refs[0].bias),
                                                             (refs[1].weight, refs[1].bias))]
    for got, ref in zip(mnet.values, refs):
        for p, w in zip((got.weight, got.bias), want):
            torch.testing.assert_close(p, w, rtol=1e-6, atol=1e-7)
        for p, r in zip(got.extra.parameters(), ref.extra.parameters()):
            assert torch.equal(p, r) and p.grad is not None  # not stepped: not the optimizer's
            torch.testing.assert_close(p.grad, r.grad, rtol=1e-6, atol=1e-7)
    assert not torch.equal(mnet.values[0].extra.weight.grad, mnet.values[1].extra.weight.grad)
    assert all(torch.equal(a, b) for a, b in zip(frozen_before, snapshot([frozen])))
    assert all(p.grad is None for p in frozen.parameters())
    assert torch.equal(mnet.values[0].weight, mnet.values[1].weight)  # (check_in_sync would refuse the extras)

    one = strategy_of(1)
    plain = net()
    ref, initial = copy.deepcopy(plain), snapshot([plain])
    plain_opt = torch.optim.SGD(plain.parameters(), lr=0.1)

    def plain_step(x, y):
        F.cross_entropy(plain(x), y).backward()
        plain_opt.step()

    args = batch(one)
    one.run(plain_step, args=args)
    F.cross_entropy(ref(args[0]), args[1]).backward()
    torch.optim.SGD(ref.parameters(), lr=0.1).step()
    for got, want, was in zip(plain.parameters(), ref.parameters(), initial):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)
        assert not torch.equal(got, was)


def test_model_fit_passes_the_guards():
    """fit's replica step (a mirrored module and optimizer, a torch optimizer class) is not refused,
    and trains as plain PyTorch does with Adam over the same two global batches (in order: no
    shuffle). Tolerance: the replicas' gradient parts add in another order (a few ulps), which Adam's
    first steps (about lr * sign(g)) do not amplify."""
    s = strategy_of(2)
    with s.scope():
        model = mr.Model(net())
        model.compile(optimizer=torch.optim.Adam, loss="sparse_categorical_crossentropy")
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(16, 4, generator=g), torch.randint(0, 2, (16,), generator=g)
    model.fit(x, y, batch_size=8, shuffle=False, verbose=0)
    ref = net()
    opt = torch.optim.Adam(ref.parameters())
    for i in (0, 8):
        opt.zero_grad()
        F.cross_entropy(ref(x[i:i + 8]), y[i:i + 8]).backward()
        opt.step()
    for got, want in zip(model.module.parameters(), ref.parameters()):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
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
