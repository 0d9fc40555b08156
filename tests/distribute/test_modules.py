"""modules.py: strategy.mirror(module) and strategy.mirror_optimizer(...), and check_in_sync on them."""
from __future__ import annotations

import copy
import pickle

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import mirrored as mr
import mirrored.distribute as md
from _replicas import TIMEOUT_S, replica_id, strategy_of  # tests/_replicas.py


def tiny() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2))


def test_mirror_makes_identical_independent_copies():
    s = strategy_of(3)
    net = tiny()
    mnet = s.mirror(net)
    assert mnet.replicas[0] is net and len(mnet.replicas) == 3 and mnet.values == mnet.replicas
    for copy_ in mnet.replicas[1:]:
        for p, q in zip(net.parameters(), copy_.parameters()):
            assert torch.equal(p, q) and p.data_ptr() != q.data_ptr()
    s.check_in_sync(mnet)
    assert repr(mnet) == "MirroredModule(3 replicas of Sequential)"


def test_calls_and_attributes_go_to_the_current_replica():
    s = strategy_of(2)
    mnet = s.mirror(tiny())

    def fn():
        return mnet.module is mnet.replicas[replica_id()], mnet.training

    is_own, training = s.run(fn)
    assert is_own is True and training is True
    assert mnet.module is mnet.replicas[0]  # cross-replica context: replica 0's copy
    assert mnet(torch.ones(1, 3)).shape == (1, 2)
    out = s.run(lambda x: mnet(x).sum().item(), args=(torch.ones(2, 3),))
    assert out.values[0] == out.values[1]


def test_setting_attributes_is_refused():
    mnet = strategy_of(2).mirror(tiny())
    with pytest.raises(AttributeError, match="set it on every copy"):
        mnet.dropout = 0.1


def test_whole_module_calls_reach_every_copy():
    s = strategy_of(2)
    mnet = s.mirror(tiny())
    assert mnet.eval() is mnet and not any(m.training for m in mnet.replicas)
    mnet.train()
    assert all(m.training for m in mnet.replicas)
    mnet.requires_grad_(False)
    assert not any(p.requires_grad for m in mnet.replicas for p in m.parameters())
    mnet.requires_grad_(True)
    state = {k: torch.full_like(v, 0.5) for k, v in tiny().state_dict().items()}
    mnet.load_state_dict(state)
    assert all(torch.all(p == 0.5) for m in mnet.replicas for p in m.parameters())
    mnet.apply(lambda m: nn.init.zeros_(m.bias) if isinstance(m, nn.Linear) else None)
    assert all(torch.all(m[0].bias == 0) for m in mnet.replicas)
    s.check_in_sync(mnet)


def test_module_zero_grad_outside_run_clears_every_copy():
    s = strategy_of(2)
    mnet = s.mirror(tiny())
    for m in mnet.replicas:
        m(torch.ones(1, 3)).sum().backward()
    mnet.zero_grad()
    assert all(p.grad is None for m in mnet.replicas for p in m.parameters())


def test_mirror_rejects_non_modules():
    s = strategy_of(2)
    with pytest.raises(TypeError, match="expected a torch.nn.Module"):
        s.mirror(lambda x: x)
    mnet = s.mirror(tiny())
    with pytest.raises(TypeError):
        s.mirror(mnet)
    with pytest.raises(TypeError, match="pass the module that strategy.mirror"):
        s.mirror_optimizer(torch.optim.SGD, tiny(), lr=0.1)
    with pytest.raises(TypeError, match="optimizer class"):
        s.mirror_optimizer("sgd", mnet)


def test_optimizer_has_one_copy_per_replica_on_that_replicas_parameters():
    s = strategy_of(2)
    mnet = s.mirror(tiny())
    opt = s.mirror_optimizer(torch.optim.SGD, mnet, lr=0.1, momentum=0.9)
    assert len(opt.replicas) == 2 and opt.values == opt.replicas
    for r in range(2):
        assert opt.replicas[r].param_groups[0]["params"][0] is next(mnet.replicas[r].parameters())
    assert opt.param_groups[0]["lr"] == 0.1 and repr(opt) == "MirroredOptimizer(2 replicas of SGD)"


def test_step_outside_run_is_refused_and_zero_grad_clears_every_copy():
    """Outside run, step() would update replica 0 alone (the copies would drift), so it raises, in the
    scope and outside it alike; zero_grad() there clears every replica's gradients."""
    s = strategy_of(2)
    mnet = s.mirror(tiny())
    opt = s.mirror_optimizer(torch.optim.SGD, mnet, lr=0.1)
    for m in mnet.replicas:
        m(torch.ones(1, 3)).sum().backward()
    with pytest.raises(RuntimeError, match="outside strategy.run"):
        opt.step()
    with s.scope(), pytest.raises(RuntimeError, match="outside strategy.run"):
        opt.step()
    opt.zero_grad()
    assert all(p.grad is None for m in mnet.replicas for p in m.parameters())
    with pytest.raises(ValueError, match="closure"):
        opt.step(lambda: 0.0)
    s.check_in_sync(mnet)


def test_one_replica_optimizer_steps_anywhere():
    s = strategy_of(1)
    mnet = s.mirror(tiny())
    opt = s.mirror_optimizer(torch.optim.SGD, mnet, lr=0.1)
    before = next(mnet.parameters()).detach().clone()
    mnet(torch.ones(1, 3)).sum().backward()
    opt.step()
    assert not torch.equal(before, next(mnet.parameters()))


def test_step_all_reduces_then_every_replica_applies_the_sum():
    """Replica r's loss is (r + 1) * sum(output): the applied gradient is the SUM over replicas, the
    same on every copy (checked against a plain-torch gradient of the summed loss)."""
    s = strategy_of(3)
    net = tiny()
    ref = copy.deepcopy(net)
    x = torch.randn(2, 3)
    sum((r + 1) * ref(x).sum() for r in range(3)).backward()
    mnet = s.mirror(net)
    opt = s.mirror_optimizer(torch.optim.SGD, mnet, lr=1.0)

    def step():
        ((replica_id() + 1) * mnet(x).sum()).backward()
        opt.step()
        return [p.grad.clone() for p in mnet.parameters()]

    grads = s.run(step)
    for j, p in enumerate(ref.parameters()):
        for r in range(3):
            torch.testing.assert_close(grads[j].values[r], p.grad, rtol=1e-6, atol=1e-6)
            assert torch.equal(grads[j].values[r], grads[j].values[0])
    s.check_in_sync(mnet)


@pytest.mark.parametrize("set_to_none", [True, False])
def test_repeated_steps_stay_in_sync(set_to_none):
    """Gradient buffers are reused step after step (zero_grad to None or to zeros in place): the
    replicas stay bitwise in sync, and after 4 steps equal plain PyTorch's Adam on the summed
    gradient of the two halves' mean losses. Tolerance: the replicas' sum adds in another order than
    one backward over both halves (a few ulps), which Adam's steps of about lr keep small."""
    s = strategy_of(2)
    mnet = s.mirror(tiny())
    opt = s.mirror_optimizer(torch.optim.Adam, mnet, lr=0.01)
    ref = tiny()
    ref_opt = torch.optim.Adam(ref.parameters(), lr=0.01)
    g = torch.Generator().manual_seed(3)
    data = [(torch.randn(4, 3, generator=g), torch.randint(0, 2, (4,), generator=g)) for _ in range(4)]

    def step(x, y):
        F.cross_entropy(mnet(x), y).backward()
        opt.step()
        opt.zero_grad(set_to_none=set_to_none)

    for x, y in data:
        s.run(step, args=(md.PerReplica((x[:2], x[2:])), md.PerReplica((y[:2], y[2:]))))
        s.check_in_sync(mnet)
        s.check_in_sync(opt)
        (F.cross_entropy(ref(x[:2]), y[:2]) + F.cross_entropy(ref(x[2:]), y[2:])).backward()
        ref_opt.step()
        ref_opt.zero_grad()
    for got, want in zip(mnet.parameters(), ref.parameters()):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_check_in_sync_names_the_perturbed_parameter():
    s = strategy_of(3)
    mnet = s.mirror(tiny())
    with torch.no_grad():
        mnet.replicas[1][2].weight[0, 0] += 1e-6
    with pytest.raises(md.OutOfSyncError) as info:
        s.check_in_sync(mnet)
    msg = str(info.value)
    assert msg.startswith("2.weight: replica 0 and replica 1 (cpu:1) hold different values (max abs difference")


def test_check_in_sync_reads_any_strides():
    """A 1x1 convolution in channels_last memory is contiguous yet its last stride is not 1 (so its
    bytes cannot be viewed as is), and a transposed tensor is not contiguous at all: both compare."""
    s = strategy_of(2)
    mnet = s.mirror(nn.Conv2d(4, 3, 1).to(memory_format=torch.channels_last))
    assert mnet.replicas[1].weight.stride(-1) != 1
    s.check_in_sync(mnet)
    with torch.no_grad():
        mnet.replicas[1].weight[2, 3] += 1e-6
    with pytest.raises(md.OutOfSyncError, match="weight: replica 0 and replica 1"):
        s.check_in_sync(mnet)
    from mirrored.distribute._cross_replica import _bitwise_equal

    a, b = torch.arange(6.0).view(2, 3).t(), torch.arange(6.0).view(2, 3).t().contiguous()
    c = b.clone()
    c[2, 1] += 1e-6
    assert _bitwise_equal(a, b) and not _bitwise_equal(a, c)
    assert not _bitwise_equal(torch.tensor(0.0), torch.tensor(-0.0))


def test_check_in_sync_sees_optimizer_state_and_negative_zero():
    s = strategy_of(2)
    mnet = s.mirror(tiny())
    opt = s.mirror_optimizer(torch.optim.SGD, mnet, lr=0.1, momentum=0.9)

    def step():
        mnet(torch.ones(1, 3)).sum().backward()
        opt.step()

    s.run(step)
    s.check_in_sync(opt)
    opt.replicas[1].state_dict()["state"][0]["momentum_buffer"].mul_(-1)
    with pytest.raises(md.OutOfSyncError, match=r"optimizer state\[0\]\['momentum_buffer'\]: replica 0 and replica 1"):
        s.check_in_sync(opt)
    with torch.no_grad():  # +0.0 and -0.0 compare equal but are different bits
        for m in mnet.replicas:
            m[0].bias.zero_()
        mnet.replicas[1][0].bias[0] = -0.0
    with pytest.raises(md.OutOfSyncError, match="0.bias"):
        s.check_in_sync(mnet)


def test_check_in_sync_rejects_other_objects():
    with pytest.raises(TypeError, match="expected a mirrored module, optimizer or variable"):
        strategy_of(2).check_in_sync(tiny())


def test_optimizer_state_dict_round_trip():
    s = strategy_of(2)
    mnet = s.mirror(tiny())
    opt = s.mirror_optimizer(torch.optim.Adam, mnet, lr=0.01)

    def step():
        mnet(torch.ones(1, 3)).sum().backward()
        opt.step()

    s.run(step)
    state = opt.state_dict()
    fresh = s.mirror_optimizer(torch.optim.Adam, mnet, lr=0.5)
    fresh.load_state_dict(state)
    assert fresh.param_groups[0]["lr"] == 0.01
    s.check_in_sync(fresh)
    for r in range(2):  # each replica's state is its own copy, not shared with replica 0's
        exp_avg = fresh.replicas[r].state_dict()["state"][0]["exp_avg"]
        assert torch.equal(exp_avg, state["state"][0]["exp_avg"])
    a = fresh.replicas[0].state_dict()["state"][0]["exp_avg"]
    b = fresh.replicas[1].state_dict()["state"][0]["exp_avg"]
    assert a.data_ptr() != b.data_ptr()


def test_batchnorm_running_stats_are_averaged_and_stay_in_sync():
    """BatchNorm statistics differ per replica batch; step() averages them (TF's MEAN moving averages)."""
    import mirrored as mr

    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.BatchNorm1d(6), torch.nn.Linear(6, 2))
    x, y = torch.randn(8, 4), torch.randint(0, 2, (8,))
    with torch.no_grad():  # reference: each half-batch's statistics, averaged, one momentum step from init
        h = net[0](x)
        want_mean = 0.1 * (h[:4].mean(0) + h[4:].mean(0)) / 2
        want_var = 0.9 + 0.1 * (h[:4].var(0) + h[4:].var(0)) / 2
    strategy = mr.MirroredStrategy(devices=["cpu:0", "cpu:1"])
    with strategy.scope():
        mnet = strategy.mirror(net)
        opt = strategy.mirror_optimizer(torch.optim.SGD, mnet, lr=0.0)

    def step(xb, yb):
        loss = torch.nn.functional.cross_entropy(mnet(xb), yb, reduction="sum") / 8
        loss.backward()
        opt.step()
        opt.zero_grad()

    for xb, yb in strategy.experimental_distribute_dataset([(x, y)]):
        strategy.run(step, args=(xb, yb))
    strategy.check_in_sync(mnet)
    bn = mnet.replicas[1][1]
    torch.testing.assert_close(bn.running_mean, want_mean, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(bn.running_var, want_var, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("replicas", [2, 3])
@pytest.mark.parametrize("set_to_none", [True, False])
def test_large_gradients_reduced_where_they_lie_match_plain_torch(replicas, set_to_none):
    """Gradients of >= 64K elements skip the bucket copy (reduced in place in their own tensors);
    with zero_grad(set_to_none=False) backward accumulates into last step's results, reduced again."""
    import copy

    import mirrored as mr

    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(300, 256), torch.nn.Tanh(), torch.nn.Linear(256, 4))
    x, y = torch.randn(9, 300), torch.randint(0, 4, (9,))
    ref = copy.deepcopy(net)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    strategy = strategy_of(replicas)
    with strategy.scope():
        mnet = strategy.mirror(net)
        opt = strategy.mirror_optimizer(torch.optim.SGD, mnet, lr=0.1, momentum=0.9)

    def step(xb, yb):
        torch.nn.functional.cross_entropy(mnet(xb), yb, reduction="sum").div(9).backward()
        opt.step()
        opt.zero_grad(set_to_none=set_to_none)

    for _ in range(3):
        ref_opt.zero_grad()
        torch.nn.functional.cross_entropy(ref(x), y).backward()
        ref_opt.step()
        for xb, yb in strategy.experimental_distribute_dataset([(x, y)]):
            strategy.run(step, args=(xb, yb))
        strategy.check_in_sync(mnet)
        strategy.check_in_sync(opt)
    for got, want in zip(mnet.replicas[-1].parameters(), ref.parameters()):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_large_gradients_are_reduced_in_their_own_tensors():
    """As DDP does with .grad: a large contiguous gradient is summed where it lies (p.grad stays the
    same tensor and the optimizer keeps no second copy); a non-contiguous one (a transposed view)
    is summed in a contiguous copy and the caller's tensor is left alone; small ones travel packed."""
    from mirrored.distribute import _replica_reduce

    rows, cols = 256, _replica_reduce._DIRECT_NUMEL // 256 + 1
    s = strategy_of(2)
    with s.scope():
        mnet = s.mirror(nn.ParameterList([nn.Parameter(torch.zeros(rows, cols)), nn.Parameter(torch.zeros(cols, rows)),
                                          nn.Parameter(torch.zeros(5))]))
        opt = s.mirror_optimizer(torch.optim.SGD, mnet, lr=0.0)
    seen = {}

    def fn():
        r = replica_id()
        big, transposed, small = mnet.replicas[r]
        grads = [torch.full((rows, cols), 1.0 + r), torch.full((rows, cols), 10.0 * (1 + r)).t(),
                 torch.full((5,), 100.0 * (1 + r))]
        for p, g in zip((big, transposed, small), grads):
            p.grad = g
        opt.reduce_gradients()
        seen[r] = grads, [big.grad, transposed.grad, small.grad]

    s.run(fn)
    for r, (given, reduced) in seen.items():
        assert reduced[0] is given[0]
        torch.testing.assert_close(reduced[0], torch.full((rows, cols), 3.0), rtol=0, atol=0)
        torch.testing.assert_close(given[1], torch.full((cols, rows), 10.0 * (1 + r)), rtol=0, atol=0)
        assert reduced[1].is_contiguous()
        torch.testing.assert_close(reduced[1], torch.full((cols, rows), 30.0), rtol=0, atol=0)
        torch.testing.assert_close(reduced[2], torch.full((5,), 300.0), rtol=0, atol=0)
        (buffers,) = opt._reducer._states[r].layouts.values()
        assert buffers.direct_out is None and sum(f.numel() for f in buffers.flats) == 5


def test_odd_gradients_reduce_like_plain_sums():
    """What in-place reduction must not get wrong: an expanded gradient (stride 0: the gradient of
    a sum), one tensor tied to two parameters (summed once, not twice), and a step where no
    replica has any gradient (nothing to reduce)."""
    from mirrored.distribute import _replica_reduce

    n = _replica_reduce._DIRECT_NUMEL
    s = strategy_of(2)
    with s.scope():
        mnet = s.mirror(nn.ParameterList([nn.Parameter(torch.zeros(n)) for _ in range(3)]))
        opt = s.mirror_optimizer(torch.optim.SGD, mnet, lr=1.0)
    seen = {}

    def fn():
        r = replica_id()
        expanded, a, b = mnet.replicas[r]
        (g,) = torch.autograd.grad(expanded.sum() * (r + 1), [expanded])
        assert g.stride() == (0,)
        expanded.grad = g
        a.grad = b.grad = torch.full((n,), 10.0 * (r + 1))
        opt.reduce_gradients()
        seen[r] = [p.grad for p in (expanded, a, b)]
        opt.zero_grad()
        opt.step()  # no gradients anywhere: a no-op, as in plain torch

    s.run(fn)
    assert sorted(seen) == [0, 1]
    for expanded, a, b in seen.values():
        torch.testing.assert_close(expanded, torch.full((n,), 3.0), rtol=0, atol=0)
        torch.testing.assert_close(a, torch.full((n,), 30.0), rtol=0, atol=0)
        torch.testing.assert_close(b, torch.full((n,), 30.0), rtol=0, atol=0)
    assert all(not p.any() for p in mnet.replicas[0])
    assert s.run(lambda: md.get_replica_context().all_reduce("sum", [])) == []


def test_converting_the_module_after_a_step_gets_new_buffers():
    """module.double() keeps the Parameter objects (same gradient mask) but changes their dtype:
    the optimizer's gradient buffers follow."""
    s = strategy_of(2)
    with s.scope():
        mnet = s.mirror(tiny())
        opt = s.mirror_optimizer(torch.optim.SGD, mnet, lr=0.1)

    def step():
        net = mnet.replicas[replica_id()]
        net(torch.ones(2, 3, dtype=net[0].weight.dtype)).sum().backward()
        opt.step()
        opt.zero_grad()

    s.run(step)
    for m in mnet.replicas:
        m.double()
    s.run(step)
    s.check_in_sync(mnet)
    assert all(p.dtype == torch.float64 for p in mnet.replicas[1].parameters())


def test_a_buffer_no_step_changes_stays_bit_for_bit_on_three_replicas():
    """Averaging equal copies in their own dtype is not exact: (x + x + x) / 3 != x for some float32 x,
    so a constant buffer drifted an ulp here and there (review finding: 151 of 1000 values after 20
    steps on 3 replicas). sync_buffers averages in float64, where it is exact, weighted or not."""
    torch.manual_seed(0)
    net = nn.Linear(4, 1)
    net.register_buffer("table", torch.rand(1000))
    want = net.table.clone()
    s = md.MirroredStrategy(devices=["cpu:0", "cpu:1", "cpu:2"])
    with s.scope():
        mnet = s.mirror(net)
        opt = s.mirror_optimizer(torch.optim.SGD, mnet, lr=0.1)

    def step(weighted: bool):
        mnet(torch.ones(2, 4)).sum().backward()
        opt.reduce_gradients()
        opt.optimizer.step()
        opt.sync_buffers(weight=replica_id() + 1 if weighted else None)

    for i in range(20):
        s.run(step, args=(i % 2 == 0,))
    for copy in mnet.replicas:
        assert torch.equal(copy.table, want)


def test_module_changes_outside_run_reach_every_copy():
    """Review findings: mnet.double(), mnet.to(dtype), mnet.fc.requires_grad_(False), mnet[0] and
    register_buffer changed replica 0's copy only (and .double() returned the bare module), so the
    copies fell out of sync or a frozen layer still trained on the other replicas."""
    s = strategy_of(2)
    with s.scope():
        mnet = s.mirror(nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2)))
    assert mnet.double() is mnet and {p.dtype for m in mnet.replicas for p in m.parameters()} == {torch.float64}
    mnet.to(torch.float32)
    assert {p.dtype for m in mnet.replicas for p in m.parameters()} == {torch.float32}
    with pytest.raises(ValueError, match="copies live on their replicas' devices"):
        mnet.to("meta")  # would move every copy to one device
    assert isinstance(mnet[0], md.MirroredModule) and len(mnet) == 3 and len(list(mnet)) == 3
    mnet[0].requires_grad_(False)
    assert [m[0].weight.requires_grad for m in mnet.replicas] == [False, False]
    mnet.register_buffer("scale", torch.ones(2))
    assert all(torch.equal(m.scale, torch.ones(2)) for m in mnet.replicas)
    assert mnet.replicas[0].scale.data_ptr() != mnet.replicas[1].scale.data_ptr()
    opt = s.mirror_optimizer(torch.optim.SGD, mnet, lr=0.1)
    before = [m[0].weight.clone() for m in mnet.replicas]

    def step():
        mnet(torch.ones(2, 3)).sum().backward()
        opt.step()

    s.run(step)
    assert all(torch.equal(m[0].weight, b) for m, b in zip(mnet.replicas, before))  # frozen everywhere
    s.check_in_sync([mnet, opt])
    # In run, a submodule is mirrored as well (a call of it is journaled), and it is the replica's own.
    assert s.run(lambda: mnet[0].module is mnet.replicas[replica_id()][0]) is True


def test_optimizer_hyperparameters_set_outside_run_reach_every_replica():
    """Review finding: opt.param_groups[0]["lr"] = 0.01 changed replica 0's optimizer only, and the
    next step put the copies out of sync."""
    s = strategy_of(2)
    with s.scope():
        mnet = s.mirror(nn.Linear(3, 1))
        opt = s.mirror_optimizer(torch.optim.SGD, mnet, lr=0.1)
    for group in opt.param_groups:
        group["lr"] = 0.01
    assert [o.param_groups[0]["lr"] for o in opt.replicas] == [0.01, 0.01]
    with pytest.raises(ValueError, match="cannot be set"):
        opt.param_groups[0]["params"] = []

    def step():
        mnet(torch.ones(2, 3)).sum().backward()
        opt.step()
        return opt.param_groups[0]["lr"]

    assert s.run(step) == 0.01
    s.check_in_sync([mnet, opt])


def test_check_in_sync_names_entries_and_dtypes_that_differ():
    """Review findings: copies with different entries gave a bare KeyError, and different dtypes were
    reported as "different values (max abs difference 0)"."""
    s = strategy_of(2)
    with s.scope():
        mnet = s.mirror(nn.Linear(2, 1))
    mnet.replicas[1].register_buffer("extra", torch.ones(1))
    with pytest.raises(md.OutOfSyncError, match=r"replica 0 alone has none, replica 1 alone has \['extra'\]"):
        s.check_in_sync(mnet)
    with s.scope():
        other = s.mirror(nn.Linear(2, 1))
    other.replicas[1].double()
    with pytest.raises(md.OutOfSyncError, match=r"weight: .*\(shape \(1, 2\) torch.float32 against \(1, 2\) "
                                                r"torch.float64\)"):
        s.check_in_sync(other)


def test_mirrored_containers_behave_like_the_module():
    """Review of the fan-out: bool(mnet) asked len() (TypeError for a Linear), iterating a ModuleDict
    mirrored its keys, and a ParameterList item came back wrapped; cpu() moved replica 0 alone."""
    s = strategy_of(2)
    with s.scope():
        linear = s.mirror(nn.Linear(2, 1))
        table = s.mirror(nn.ModuleDict({"a": nn.Linear(2, 2), "b": nn.ReLU()}))
        params = s.mirror(nn.ParameterList([nn.Parameter(torch.ones(2))]))
    assert bool(linear) and bool(s.mirror(nn.Sequential()))
    assert list(table) == ["a", "b"] and "a" in table and isinstance(table["a"], md.MirroredModule)
    assert isinstance(params[0], nn.Parameter) and torch.equal(params[0] * 2, torch.full((2,), 2.0))
    assert linear.cpu() is linear and linear.to("cpu") is linear  # every copy is there already: no move
    one = md.MirroredStrategy(devices=["cpu:0"])
    with one.scope():
        assert one.mirror(nn.Linear(2, 1)).to("cpu", torch.float64).weight.dtype == torch.float64


class _TwoWorkers(md.MirroredStrategy):
    """As a worker of a MultiWorkerMirroredStrategy sees it: its strategy spans 2 processes."""

    num_workers = 2


def test_new_state_is_refused_across_workers():
    """On a multi-worker strategy each worker would register its own value (mirror() broadcasts rank
    0's state; register_* does not), so they are refused there."""
    s = _TwoWorkers(devices=["cpu:0", "cpu:1"], timeout_s=TIMEOUT_S)
    with s.scope():
        mnet = s.mirror(nn.Linear(2, 1))
    for call in (lambda: mnet.register_buffer("b", torch.ones(1)), lambda: mnet.add_module("m", nn.ReLU()),
                 lambda: mnet.register_parameter("p", nn.Parameter(torch.ones(1)))):
        with pytest.raises(ValueError, match="on a multi-worker strategy: each worker would add its own"):
            call()


# ---- issue 14: a mirrored module is a whole module -------------------------------------------------

def test_every_public_module_method_reaches_every_copy_reads_or_is_refused():
    """Each public nn.Module method is MirroredModule's own, in exactly one of its lists, so nothing
    falls through __getattr__ to replica 0's copy; a method torch adds fails here until it is sorted.
    (Methods another library sets on nn.Module - transformers' smart_apply - are not torch's: a
    MirroredModule refuses them outside strategy.run, as any method of a copy it does not list.)"""
    import inspect

    public = {n for n in dir(nn.Module) if not n.startswith("_") and inspect.isfunction(getattr(nn.Module, n))
              and getattr(nn.Module, n).__module__.startswith("torch.")}
    kinds = [md.MirroredModule.EVERY_COPY, md.MirroredModule.READS, md.MirroredModule.REFUSED]
    assert public == set().union(*kinds), f"unsorted: {public - set().union(*kinds)}"
    assert sum(len(k) for k in kinds) == len(public)
    assert all(n in vars(md.MirroredModule) for n in public)


def test_hooks_reach_every_copy_and_run_on_each_replica():
    s = strategy_of(3)
    with s.scope():
        mnet = s.mirror(tiny())
    seen = []
    handles = [mnet.register_forward_pre_hook(lambda m, args: seen.append(("pre", replica_id(), m))),
               mnet.register_forward_hook(lambda m, args, out: seen.append(("fwd", replica_id(), m))),
               mnet.register_full_backward_hook(lambda m, gin, gout: seen.append(("bwd", replica_id(), m))),
               mnet[2].register_forward_hook(lambda m, args, out: seen.append(("fc", replica_id(), m)))]

    def step():
        mnet(torch.ones(2, 3, requires_grad=True)).sum().backward()

    s.run(step)
    for kind, index in (("pre", None), ("fwd", None), ("bwd", None), ("fc", 2)):
        calls = sorted((r, id(m)) for k, r, m in seen if k == kind)
        want = sorted((r, id(c if index is None else c[index])) for r, c in enumerate(mnet.values))
        assert calls == want, kind  # once per replica, with that replica's own copy
    for h in handles:
        h.remove()
    seen.clear()
    s.run(step)
    assert seen == []


def test_new_state_and_settings_reach_every_copy_with_their_own_storage():
    s = strategy_of(2)
    with s.scope():
        mnet = s.mirror(tiny())
    state = {k: torch.full_like(v, 0.25) for k, v in tiny().state_dict().items()}
    mnet.load_state_dict(state, assign=True)
    assert all(torch.equal(p, torch.full_like(p, 0.25)) for m in mnet.values for p in m.parameters())
    assert mnet.values[0][0].weight.data_ptr() != mnet.values[1][0].weight.data_ptr()
    mnet.set_submodule("1", nn.Tanh())
    assert all(isinstance(m[1], nn.Tanh) for m in mnet.values) and mnet.values[0][1] is not mnet.values[1][1]
    mnet.register_parameter("extra", nn.Parameter(torch.ones(2)))
    assert mnet.values[0].extra.data_ptr() != mnet.values[1].extra.data_ptr()
    assert mnet.share_memory() is mnet
    s.check_in_sync(mnet)
    twin = copy.deepcopy(mnet)  # independent copies, mirrored by the same strategy
    assert twin.values[1][0].weight.data_ptr() != mnet.values[1][0].weight.data_ptr()
    s.check_in_sync(twin)
    with pytest.raises(TypeError, match="cannot be pickled"):
        pickle.dumps(mnet)
    with pytest.raises(ValueError, match="copies live on their replicas' devices"):
        mnet.to_empty(device="cpu")
    with pytest.raises(ValueError, match="copies live on their replicas' devices"):
        mnet.xpu()


def test_reads_see_the_replicas_own_copy_in_run_and_replica_0_outside():
    s = strategy_of(2)
    mnet = s.mirror(tiny())
    assert next(mnet.parameters()) is next(mnet.values[0].parameters())
    assert mnet.state_dict().keys() == mnet.values[0].state_dict().keys()
    assert mnet.get_submodule("0") is mnet.values[0][0]
    got = s.run(lambda: (next(mnet.parameters()) is next(mnet.values[replica_id()].parameters()),
                         mnet.get_submodule("2") is mnet.values[replica_id()][2]))
    assert got == (True, True)


def test_changes_inside_run_act_on_the_own_copy_or_are_refused():
    """Every replica runs the same code: train()/eval() change each replica's own copy once; new state
    or hooks added inside run are refused (each replica would add its own)."""
    s = strategy_of(2)
    mnet = s.mirror(tiny())

    def fn():
        mnet.eval()
        return mnet.training

    assert s.run(fn) is False and not any(m.training for m in mnet.values)
    with pytest.raises(RuntimeError, match=r"register_buffer\(\) was called inside strategy.run"):
        s.run(lambda: mnet.register_buffer("b", torch.ones(1)))
    with pytest.raises(RuntimeError, match=r"register_forward_hook\(\) was called inside strategy.run"):
        s.run(lambda: mnet.register_forward_hook(lambda *a: None))
    assert not any(hasattr(m, "b") or m._forward_hooks for m in mnet.values)


class _WithMethod(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(2, 2)
        self.scale = 1.0

    def forward(self, x):
        return self.fc(x) * self.scale

    def shrink(self):
        with torch.no_grad():
            self.fc.weight.mul_(0.5)
        return self.fc.weight.sum().item()


def test_methods_of_your_module_are_refused_outside_run():
    """A method of the user's class outside run would change replica 0's copy alone (fell through
    __getattr__ before); inside run each replica calls its own."""
    s = strategy_of(2)
    mnet = s.mirror(_WithMethod())
    before = mnet.values[0].fc.weight.clone()
    with pytest.raises(RuntimeError, match=r"shrink\(\) was called outside strategy.run.*for m in mnet.values"):
        mnet.shrink()
    assert torch.equal(mnet.values[0].fc.weight, before) and mnet.scale == 1.0  # data attributes are reads
    s.run(lambda: mnet.shrink())
    s.check_in_sync(mnet)
    assert torch.equal(mnet.values[1].fc.weight, before * 0.5)


def test_a_call_outside_run_that_would_change_replica_0_alone_is_refused():
    s = strategy_of(2)
    mnet = s.mirror(nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4)))
    with pytest.raises(RuntimeError, match="in training mode: its BatchNorm statistics"):
        mnet(torch.randn(4, 3))
    assert all(m[1].num_batches_tracked == 0 for m in mnet.values)
    mnet.eval()
    out = mnet(torch.randn(4, 3))  # inference is fine
    with pytest.raises(RuntimeError, match="backward through the output of a mirrored module called outside"):
        out.sum().backward()
    assert all(p.grad is None for m in mnet.values for p in m.parameters())
    with torch.no_grad():
        mnet(torch.randn(4, 3))
    s.check_in_sync(mnet)


def test_no_sync_blocks_are_counted_per_replica_and_outside_run():
    s = strategy_of(2)
    mnet = s.mirror(tiny())
    with mnet.no_sync():
        assert mnet._shared.in_no_sync(0) and mnet._shared.in_no_sync(1)
    assert not mnet._shared.in_no_sync(0)

    def fn():
        with mnet.no_sync():
            return mnet._shared.in_no_sync(replica_id()), mnet._shared.no_sync[1 - replica_id()] in (0, 1)

    assert s.run(fn) == (True, True)
    assert mnet._shared.no_sync == [0, 0] and mnet[0]._shared is mnet._shared  # views share the blocks


def test_a_lazy_module_is_refused_until_initialised_so_replicas_cannot_start_apart():
    """Each copy of a LazyLinear would draw its own weights at its first forward (measured before the
    refusal: replicas 0.40 and -0.01 apart after one fit); a dry run first makes one set to copy."""
    strategy = md.MirroredStrategy(devices=["cpu:0", "cpu:1"])
    torch.manual_seed(0)
    net = nn.Sequential(nn.Flatten(), nn.LazyLinear(4), nn.ReLU(), nn.Linear(4, 3))
    with pytest.raises(ValueError, match=r"Sequential has parameters that are not initialised yet \(1\.weight, "
                                         r"1\.bias.*module\(x\[:1\]\)"):
        strategy.mirror(net)
    net(torch.zeros(1, 5))
    mnet = strategy.mirror(net)
    for a, b in zip(mnet.replicas[0].parameters(), mnet.replicas[1].parameters()):
        assert torch.equal(a, b)


def test_buffers_replaced_between_steps_are_the_ones_synced():
    """Regression test for issue 27: sync_buffers keeps how it packs the buffers while they are the same
    tensors; a buffer replaced on every copy (a new tensor, of another shape too), or one registered
    after the first step, is synced from then on: after a step each copy holds the replicas' mean."""
    torch.manual_seed(0)
    s = md.MirroredStrategy(devices=["cpu:0", "cpu:1"])
    with s.scope():
        mnet = s.mirror(nn.Linear(4, 1))
        opt = s.mirror_optimizer(torch.optim.SGD, mnet, lr=0.1)

    def step(values):
        rid = replica_id()
        copy_ = mnet.replicas[rid]
        with torch.no_grad():
            for name, value in values.items():
                getattr(copy_, name).copy_(value * (rid + 1))  # replica r writes (r + 1) * value
        mnet(torch.ones(2, 4)).sum().backward()
        opt.step()
        opt.zero_grad()

    for copy_ in mnet.replicas:
        copy_.register_buffer("stat", torch.zeros(3))
    s.run(step, args=({"stat": torch.ones(3)},))
    for copy_ in mnet.replicas:
        copy_.stat = torch.zeros(2, 2)  # a new tensor under the same name
        copy_.register_buffer("extra", torch.zeros(()))
    s.run(step, args=({"stat": torch.full((2, 2), 2.0), "extra": torch.tensor(4.0)},))
    for copy_ in mnet.replicas:
        assert torch.equal(copy_.stat, torch.full((2, 2), 3.0))  # (2 + 4) / 2
        assert torch.equal(copy_.extra, torch.tensor(6.0))  # (4 + 8) / 2
    s.check_in_sync(mnet)


def test_a_step_that_calls_only_submodules_is_rolled_back_and_weighed_by_its_examples():
    """Issue 37: inside strategy.run, mnet.encoder was the replica's raw submodule, so a step that called
    only submodules (a GAN's generator and discriminator) was neither noted in the step journal nor
    counted in its examples: its gradient_reduction="mean" weighed uneven parts alike, and a failed step
    left its gradients. A submodule is mirrored in run too. Reference: plain torch on the whole batch."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))
    ref = copy.deepcopy(net)
    x, y = torch.randn(5, 3), torch.randn(5, 2)  # parts 2/2/1 on 3 replicas
    F.mse_loss(ref[2](ref[1](ref[0](x))), y).backward()
    s = strategy_of(3)
    with s.scope():
        mnet = s.mirror(net)
        opt = s.mirror_optimizer(torch.optim.SGD, mnet, gradient_reduction="mean", lr=0.1)
    batch = next(iter(s.experimental_distribute_dataset(mr.data.Dataset.from_tensors((x, y)))))

    def step(xb, yb, fail=False):
        h = mnet[0](xb)
        F.mse_loss(mnet[2](mnet[1](h)), yb).backward()
        if fail and replica_id() == 2:
            raise RuntimeError("boom")
        opt.step()

    with pytest.raises(RuntimeError, match="boom"):
        s.run(step, args=(*batch, True))
    assert all(p.grad is None for m in mnet.replicas for p in m.parameters())  # rolled back
    s.run(step, args=batch)
    for copy_ in mnet.replicas:
        for got, want in zip(copy_.parameters(), ref.parameters()):
            torch.testing.assert_close(got.grad, want.grad, rtol=1e-6, atol=1e-7)
    s.check_in_sync([mnet, opt])


def test_the_step_path_walks_modules_in_torchs_order_each_once():
    """The step journal and the buffer average walk modules themselves (module.modules() builds a name
    string per module): the same modules in the same order, a shared one once and None slots skipped."""
    from mirrored.distribute.rollback import modules_in_order

    shared = nn.Linear(2, 2)
    inner = nn.Sequential(shared, nn.ReLU(), nn.Sequential(nn.Tanh(), shared))
    net = nn.Sequential(nn.Linear(2, 2), inner, shared, nn.ModuleDict({"b": nn.BatchNorm1d(2), "a": inner}))
    net.add_module("empty", None)
    deep = nn.Sequential()
    tail = deep
    for _ in range(50):  # deeper than a recursive walk would like
        tail.append(nn.Sequential())
        tail = tail[-1]
    net.append(deep)
    assert modules_in_order(net) == list(net.modules())
    leaf = nn.ReLU()
    assert modules_in_order(leaf) == [leaf]
