"""cross_device_ops.py: the four cross-device ops, checked against numpy sums.

ReductionToOneDevice, HierarchicalCopyAllReduce and InMemoryAllReduce run on CPU replicas here;
NcclAllReduce runs against a fake torch.cuda.nccl that checks what NCCL checks, with the meta device
standing in for a second GPU. Tests marked `cuda` run on a GPU machine (benchmarks/gpu_check.py).
"""
from __future__ import annotations

import itertools
import time

import numpy as np
import pytest
import torch
from torch import nn

import mirrored.distribute as md
from mirrored.distribute import cross_device_ops as cdo
from mirrored.distribute import _replica_reduce, devices, reducer as reducer_mod
from mirrored.distribute import strategy as strategy_mod
from _replicas import TIMEOUT_S, replica_id, strategy_of  # tests/_replicas.py

CPU_OPS = [md.ReductionToOneDevice, md.HierarchicalCopyAllReduce, md.InMemoryAllReduce]
SIZES = [1, 7, 1000, _replica_reduce._DIRECT_NUMEL + 5]  # the last is reduced where it lies, not packed


def random_inputs(n: int, size: int, dtype=np.float32) -> list[np.ndarray]:
    rng = np.random.default_rng(size)
    if np.issubdtype(dtype, np.integer):
        return [rng.integers(-1000, 1000, size).astype(dtype) for _ in range(n)]
    return [rng.standard_normal(size).astype(dtype) for _ in range(n)]


@pytest.mark.parametrize("ops_cls", CPU_OPS)
def test_strategy_all_reduce_equals_numpy_sum_on_every_replica(ops_cls):
    """Inside run: every replica gets the numpy sum (float64 reference, float32 rounding allowed),
    bitwise the same on every replica; MEAN is the sum / n; integers are exact. 2 and 3 replicas."""
    for n in (2, 3):
        check_all_reduce(strategy_of(n, cross_device_ops=ops_cls()), n)


def check_all_reduce(s: md.MirroredStrategy, n: int) -> None:
    for size in SIZES:
        xs = random_inputs(n, size)
        want = np.sum([x.astype(np.float64) for x in xs], axis=0)

        def fn():
            ctx = md.get_replica_context()
            x = torch.from_numpy(xs[replica_id()].copy())
            return ctx.all_reduce("sum", x), ctx.all_reduce("mean", x.clone())

        sums, means = (s.experimental_local_results(v) for v in s.run(fn))
        for r in range(n):
            np.testing.assert_allclose(sums[r].numpy(), want, rtol=1e-5, atol=1e-5)
            np.testing.assert_allclose(means[r].numpy(), want / n, rtol=1e-5, atol=1e-5)
            assert torch.equal(sums[r], sums[0]) and torch.equal(means[r], means[0])
    ints = random_inputs(n, 10, np.int64)
    out = s.run(lambda: md.get_replica_context().all_reduce("sum", torch.from_numpy(ints[replica_id()].copy())))
    for t in s.experimental_local_results(out):
        assert t.tolist() == np.sum(ints, axis=0).tolist()


def test_cross_replica_reduce_equals_numpy():
    """ops.reduce on a PerReplica (cross-replica context): every destination holds the numpy sum."""
    n = 3
    for ops_cls, size in itertools.product(CPU_OPS, SIZES):
        xs = random_inputs(n, size, np.float64)
        value = md.PerReplica([torch.from_numpy(x) for x in xs])
        out = ops_cls().reduce(md.ReduceOp.SUM, value, destinations=value)
        for t in out.values:
            np.testing.assert_allclose(t.numpy(), np.sum(xs, axis=0), rtol=1e-12, atol=1e-12)
        mean = ops_cls().reduce(md.ReduceOp.MEAN, value)
        np.testing.assert_allclose(mean.values[0].numpy(), np.mean(xs, axis=0), rtol=1e-12, atol=1e-12)


def test_integer_mean_is_a_float64_true_division():
    """TF 2.21 (measured): the cross-device ops' MEAN of int32 [1, -4], [2, 0], [0, 0] is float64
    [1.0, -1.3333...], not a truncated integer."""
    value = md.PerReplica([torch.tensor(v, dtype=torch.int32) for v in ([1, -4], [2, 0], [0, 0])])
    for ops_cls in CPU_OPS:
        out = ops_cls().reduce("mean", value)
        assert out.values[0].dtype == torch.float64, ops_cls
        assert out.values[0].tolist() == [1.0, -4 / 3], ops_cls


@pytest.mark.parametrize("parts", [([4], [4], [2]), ([2], [4]), ([2, 3], [3, 2]), ([1], [1], [0])])
def test_reduce_refuses_parts_of_different_shapes(parts):
    """TF 2.21 raises InvalidArgumentError ("Inputs to operation AddN ... must have the same size
    and shape"); packing would otherwise read past the smaller part and return garbage."""
    value = md.PerReplica([torch.ones(p) for p in parts])
    for ops_cls in CPU_OPS:
        with pytest.raises(ValueError, match=r"tensor 0 has shape \[.*\] .* on replica \d but"):
            ops_cls().reduce("sum", value)
    with pytest.raises(ValueError, match="dtypes"):
        md.ReductionToOneDevice().reduce("sum", md.PerReplica([torch.ones(2), torch.ones(2, dtype=torch.float64)]))


def test_batch_reduce_packs_tensors_into_buckets(monkeypatch):
    """batch_reduce sends one flat buffer per bucket (per dtype, at most bytes_per_pack bytes), and
    unpacks every tensor back to its own shape with the right sum."""
    for ops_cls in CPU_OPS:
        check_packing(ops_cls, monkeypatch)


def check_packing(ops_cls, monkeypatch) -> None:
    n = 2
    shapes = [(3,), (2, 2), (5,), (1,)]
    dtypes = [torch.float32, torch.float32, torch.float64, torch.float32]
    values = [md.PerReplica([torch.full(shape, float(r + 1 + 10 * j), dtype=dt) for r in range(n)])
              for j, (shape, dt) in enumerate(zip(shapes, dtypes))]
    seen: list[int] = []
    original = ops_cls._all_sum

    def spy(self, per_replica):
        seen.append(len(per_replica[0]))
        return original(self, per_replica)

    monkeypatch.setattr(ops_cls, "_all_sum", spy)
    out = ops_cls().batch_reduce("sum", [(v, None) for v in values])
    assert seen == [2]  # one float32 bucket and one float64 bucket, in one call
    for j, (shape, dt) in enumerate(zip(shapes, dtypes)):
        for t in out[j].values:
            assert t.shape == shape and t.dtype == dt and torch.all(t == 3 + 20 * j)
    seen.clear()
    ops_cls(bytes_per_pack=16).batch_reduce("sum", [(v, None) for v in values])
    assert seen == [4]  # 16-byte packs: 12 + 16 bytes of float32 do not fit together


def test_all_reduce_of_nested_values_with_tiny_packs():
    """A strategy whose ops pack 8 bytes at a time still reduces a nested structure correctly."""
    s = strategy_of(3, cross_device_ops=md.InMemoryAllReduce(bytes_per_pack=8))

    def fn():
        r = replica_id()
        return md.get_replica_context().all_reduce("sum", [torch.ones(3) * r, {"k": torch.tensor([r, 1])}])

    out = s.run(fn)
    for r in range(3):
        assert out[0].values[r].tolist() == [3.0] * 3 and out[1]["k"].values[r].tolist() == [3, 3]


def _two_layer():
    torch.manual_seed(0)
    return nn.ModuleDict({"used": nn.Linear(3, 2), "unused": nn.Linear(3, 2), "sometimes": nn.Linear(3, 2)})


def test_gradient_none_on_every_replica_stays_none():
    """Through mirror_optimizer: a parameter no replica's loss reaches keeps grad None (and its value);
    one reached by some replicas only counts as zero gradient on the others; replicas stay in sync."""
    for ops_cls in CPU_OPS:
        check_none_gradients(strategy_of(3, cross_device_ops=ops_cls()))


def check_none_gradients(s: md.MirroredStrategy) -> None:
    with s.scope():
        mnet = s.mirror(_two_layer())
        opt = s.mirror_optimizer(torch.optim.SGD, mnet, lr=1.0)
    before = {k: v.clone() for k, v in mnet.replicas[0].state_dict().items()}
    x = torch.ones(1, 3)

    def step():
        net = mnet.module
        loss = net["used"](x).sum()
        if replica_id() == 0:
            loss = loss + net["sometimes"](x).sum()
        loss.backward()
        opt.step()
        return {n: p.grad is None for n, p in net.named_parameters()}

    none = s.run(step)
    assert none["unused.weight"] is True and none["unused.bias"] is True
    assert none["used.weight"] is False
    assert none["sometimes.weight"] is False  # zeros filled in on the replicas where it was None
    s.check_in_sync(mnet)
    after = mnet.replicas[0].state_dict()
    assert torch.equal(after["unused.weight"], before["unused.weight"])
    # d(sum(Wx + b))/dW = 1 per replica that used it: "used" on 3 replicas, "sometimes" on replica 0 only.
    assert torch.allclose(after["used.weight"], before["used.weight"] - 3.0)
    assert torch.allclose(after["sometimes.weight"], before["sometimes.weight"] - 1.0)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error on a CPU-only machine")
def test_nccl_all_reduce_on_cpu_box_fails_at_construction():
    with pytest.raises(ValueError) as info:
        strategy_of(2, cross_device_ops=md.NcclAllReduce())
    msg = str(info.value)
    assert "NcclAllReduce needs CUDA GPUs, but torch sees none" in msg and "cross_device_ops=" in msg


@pytest.mark.cuda
def test_nccl_all_reduce_refuses_cpu_devices():  # pragma: no cover - GPU machines only
    """The one-GPU refusal: NCCL across cuda:0 and a CPU replica is refused at construction."""
    with pytest.raises(ValueError, match="reduces across GPUs only"):
        strategy_of(2, cross_device_ops=md.NcclAllReduce())
    with pytest.raises(ValueError, match="reduces across GPUs only"):
        md.MirroredStrategy(devices=["cuda:0", "cpu:0"], cross_device_ops=md.NcclAllReduce())


def test_one_device_nccl_is_allowed():
    """With one replica no reduction happens, so the ops are not checked against the device."""
    assert md.MirroredStrategy(devices=["cpu:0"], cross_device_ops=md.NcclAllReduce()).num_replicas_in_sync == 1


def test_default_ops_for_cpu_replicas():
    assert isinstance(strategy_of(2).extended.cross_device_ops, md.InMemoryAllReduce)
    assert isinstance(cdo.default_for(["cpu:0"]), md.InMemoryAllReduce)


def test_constructor_validation():
    with pytest.raises(ValueError, match="bytes_per_pack=0"):
        md.ReductionToOneDevice(bytes_per_pack=0)
    with pytest.raises(ValueError, match="num_packs=-1"):
        md.HierarchicalCopyAllReduce(num_packs=-1)
    with pytest.raises(ValueError, match="unknown reduce op"):
        md.ReductionToOneDevice().reduce("max", md.PerReplica([torch.ones(1)]))
    with pytest.raises(TypeError, match="expected a CrossDeviceOps"):
        strategy_of(2, cross_device_ops="nccl")  # type: ignore[arg-type]
    assert repr(md.InMemoryAllReduce(bytes_per_pack=64)) == "InMemoryAllReduce(bytes_per_pack=64)"
    assert md.ReductionToOneDevice(reduce_to_device="/device:CPU:0").reduce_to_device == "cpu:0"


def test_batch_reduce_rejects_different_replica_counts():
    a, b = md.PerReplica([torch.ones(1)] * 2), md.PerReplica([torch.ones(1)] * 3)
    with pytest.raises(ValueError, match=r"different numbers of replicas: \[2, 3\]"):
        md.ReductionToOneDevice().batch_reduce("sum", [(a, None), (b, None)])


@pytest.mark.parametrize("ops_cls", CPU_OPS)
def test_results_are_complete_when_a_replica_is_released(ops_cls):
    """Every replica's outputs are written before any replica leaves the all-reduce, so one that
    modifies its result in place at once (gradient clipping, say) cannot change what the others got."""
    s = strategy_of(3, cross_device_ops=ops_cls())
    size = _replica_reduce._DIRECT_NUMEL + 5  # large enough to be reduced in place, not packed
    xs = random_inputs(3, size)

    def fn():
        r = replica_id()
        out = md.get_replica_context().all_reduce("sum", torch.from_numpy(xs[r].copy()))
        if r == 0:
            out.mul_(-1.0)  # replica 0 scribbles on its result at once ...
            return out.clone()
        time.sleep(0.05)  # ... while the others look at theirs only later
        return out.clone()

    for _ in range(3):
        out = s.run(fn).values
        expected = xs[0] + xs[1] + xs[2]
        np.testing.assert_allclose(out[0].numpy(), -expected, rtol=1e-5, atol=1e-5)
        for r in (1, 2):
            np.testing.assert_allclose(out[r].numpy(), expected, rtol=1e-5, atol=1e-5)


def test_gradient_masks_that_vary_by_step_keep_few_buffers():
    """A model whose None gradients differ between replicas and steps: every step sums the right
    gradients, and the optimizer keeps at most a few buffer layouts per replica."""
    s = strategy_of(2)
    with s.scope():
        mnet = s.mirror(nn.ModuleList(nn.Linear(3, 1, bias=False) for _ in range(4)))
        opt = s.mirror_optimizer(torch.optim.SGD, mnet, lr=1.0)
    x = torch.ones(1, 3)
    expected = [p.detach().clone() for p in mnet.replicas[0].parameters()]

    for step in range(12):
        used = [(step + r) % 4 for r in range(2)]  # each replica reaches one layer, a different one each step
        for i in used:
            expected[i] -= 1.0

        def fn():
            mnet.module[used[replica_id()]](x).sum().backward()
            opt.step()
            opt.zero_grad()

        s.run(fn)
        s.check_in_sync(mnet)
        for p, e in zip(mnet.replicas[0].parameters(), expected):
            torch.testing.assert_close(p.detach(), e)
    for r in range(2):
        state = opt._reducer._states[r]
        assert len(state.layouts) == reducer_mod._LAYOUTS_KEPT
        assert len(state.unions) == 4  # each mask's union, learned once: later steps meet only once
        # the layouts kept are the unions' (two layers with gradients), not the masks' own
        assert all(sum(union) == 2 for union, *_ in state.layouts)


@pytest.mark.parametrize("ops_cls", CPU_OPS)
def test_inputs_are_left_as_they_were(ops_cls):
    """4 replicas (a two-level tree for HierarchicalCopyAllReduce), large tensors read in place:
    every replica's input keeps its values."""
    s = strategy_of(4, cross_device_ops=ops_cls())
    xs = random_inputs(4, _replica_reduce._DIRECT_NUMEL + 5)
    inputs = [torch.from_numpy(x.copy()) for x in xs]
    out = s.run(lambda: md.get_replica_context().all_reduce("sum", inputs[replica_id()]))
    for r in range(4):
        np.testing.assert_array_equal(inputs[r].numpy(), xs[r])
        np.testing.assert_allclose(out.values[r].numpy(), sum(xs), rtol=1e-5, atol=1e-5)


def test_all_reduce_results_belong_to_the_caller():
    """ctx.all_reduce reuses its plan for tensors of the same shapes, but never its results: those of
    an earlier call keep their values after a later one, and differ in storage between calls."""
    s = strategy_of(2)
    shapes = [(3, 2), (_replica_reduce._DIRECT_NUMEL + 5,), ()]  # packed, read in place, a scalar

    seen = {}

    def fn():
        r = replica_id()
        first = md.get_replica_context().all_reduce("sum", [torch.full(sh, 1.0 + r) for sh in shapes])
        kept = [t.clone() for t in first]
        second = md.get_replica_context().all_reduce("sum", [torch.full(sh, 10.0 * (1 + r)) for sh in shapes])
        seen[r] = first, kept, second

    s.run(fn)
    assert sorted(seen) == [0, 1]
    for first, kept, second in seen.values():
        for a, k, b, shape in zip(first, kept, second, shapes):
            assert a.shape == b.shape == shape
            torch.testing.assert_close(a, k, rtol=0, atol=0)
            torch.testing.assert_close(a, torch.full(shape, 3.0), rtol=0, atol=0)
            torch.testing.assert_close(b, torch.full(shape, 30.0), rtol=0, atol=0)
            assert a.untyped_storage().data_ptr() != b.untyped_storage().data_ptr()


def test_all_reduce_keeps_few_plans():
    """Many different shapes through ctx.all_reduce: each replica keeps a bounded number of plans."""
    s = strategy_of(2)
    calls = _replica_reduce._VALUE_LAYOUTS_KEPT + 5

    seen = {}

    def fn():
        seen[replica_id()] = [md.get_replica_context().all_reduce("sum", torch.ones(n)) for n in range(1, calls + 1)]

    s.run(fn)
    assert sorted(seen) == [0, 1]
    for results in seen.values():
        for n, t in enumerate(results, start=1):
            torch.testing.assert_close(t, torch.full((n,), 2.0))
    assert {len(layouts) for layouts in s._value_layouts.values()} == {_replica_reduce._VALUE_LAYOUTS_KEPT}


@pytest.mark.parametrize("size", [3, _replica_reduce._DIRECT_NUMEL + 5])
def test_all_reduce_is_differentiable_as_in_tf(size):
    """TF's all-reduce gradient is the same all-reduce of the upstream gradients. Each replica's
    loss is sum(w * y) with y = all_reduce(x_r): dL_total/dx_r = sum_k w_k for SUM, its mean for
    MEAN (closed form), and a trainable Variable passes through the same way."""
    s = strategy_of(3)
    weights = [float(r + 1) for r in range(3)]

    def fn(op):
        r = replica_id()
        x = torch.full((size,), float(r), requires_grad=True)
        y = md.get_replica_context().all_reduce(op, x)
        (weights[r] * y).sum().backward()
        return y.detach(), x.grad

    for op, scale in (("sum", 1.0), ("mean", 1 / 3)):
        ys, grads = s.run(fn, args=(op,))
        for r in range(3):
            torch.testing.assert_close(ys.values[r], torch.full((size,), 3.0 * scale))
            torch.testing.assert_close(grads.values[r], torch.full((size,), sum(weights) * scale))
    with s.scope():
        v = md.Variable(torch.ones(3))
    out = s.run(lambda: md.get_replica_context().all_reduce("mean", v))
    assert all(torch.equal(t.detach(), torch.ones(3)) for t in out.values)


def test_different_collectives_are_named_not_confused():
    """Replica 0 all-reduces a tensor while replica 1 steps its optimizer: the error names both calls."""
    s = strategy_of(2)
    with s.scope():
        mnet = s.mirror(nn.Linear(3, 1))
        opt = s.mirror_optimizer(torch.optim.SGD, mnet, lr=0.1)

    def fn():
        if replica_id() == 0:
            md.get_replica_context().all_reduce("sum", torch.ones(2))
        else:
            mnet(torch.ones(1, 3)).sum().backward()
            opt.step()

    with pytest.raises(md.CollectiveMismatchError, match=r"replica 0 called all_reduce\(SUM\); replica 1 called "
                                                         r"all_reduce \(gradients\)"):
        s.run(fn)


# ---- device placement (issue 19): each replica's buffers and results on its own device ---------------
# A CPU box has one torch device, so the meta device stands in for a second GPU: its tensors have a
# device and a shape but no data, and copying one to the CPU fails, as packing replica 1's tensors
# into a buffer on replica 0's device did. Values are checked where data exists (the tests above,
# and the CUDA tests below on a GPU machine).
class DeviceRecorder(md.CrossDeviceOps):
    """Records which device each replica's tensors reach the reduction on; 'sums' nothing."""

    def __init__(self, bytes_per_pack: int = 25 * 2**20):
        super().__init__(bytes_per_pack)
        self.seen: list[list[set[str]]] = []

    def _all_sum(self, per_replica):
        self.seen.append([{str(t.device) for t in lst} for lst in per_replica])
        return [[t.clone() for t in lst] for lst in per_replica]

    def _reduce_into(self, inputs, outputs, reduce_op):
        self.seen.append([{str(t.device) for t in ins + outs} for ins, outs in zip(inputs, outputs)])


def test_cross_replica_reduce_packs_each_replica_on_its_own_device():
    """Issue 19: batch_reduce planned buckets from replica 0 and packed every replica's buffer on
    replica 0's device. Now replica 1's buffers, and its results, stay on its device."""
    ops = DeviceRecorder(bytes_per_pack=16)  # several buckets
    values = [md.PerReplica([torch.ones(shape), torch.ones(shape, device="meta")]) for shape in [(3,), (2, 2), (5,)]]
    out = ops.batch_reduce("sum", [(v, None) for v in values])
    assert ops.seen == [[{"cpu"}, {"meta"}]]
    for v in out:
        assert [t.device.type for t in v.values] == ["cpu", "meta"]
    mean = ops.reduce("mean", values[1])
    assert [t.device.type for t in mean.values] == ["cpu", "meta"] and mean.values[1].shape == (2, 2)


def test_a_bucket_never_mixes_devices_of_one_replica():
    """Where replica 1's tensors lie on two devices (replica 0's on one), no bucket mixes them:
    each result comes back where its input was."""
    ops = DeviceRecorder()
    a, b = md.PerReplica([torch.ones(2), torch.ones(2)]), md.PerReplica([torch.ones(3), torch.ones(3, device="meta")])
    out = ops.batch_reduce("sum", [(a, None), (b, None)])
    assert [t.device.type for t in out[0].values] == ["cpu", "cpu"]
    assert [t.device.type for t in out[1].values] == ["cpu", "meta"]


def _replica_1_on_meta(monkeypatch) -> None:
    """Makes "cpu:1" mean the meta device for the strategy, its modules and its input."""
    from mirrored.distribute import modules

    real = devices.torch_device
    fake = lambda d: torch.device("meta") if d == "cpu:1" else real(d)  # noqa: E731
    monkeypatch.setattr(strategy_mod, "torch_device", fake)
    monkeypatch.setattr(modules, "torch_device", fake)


def test_in_step_reductions_use_each_replicas_own_device(monkeypatch):
    """ctx.all_reduce and the optimizer's gradient all-reduce build each replica's Layout from its
    own tensors, so replica 1 (a stand-in GPU) hands over and gets back tensors on its device only."""
    _replica_1_on_meta(monkeypatch)
    ops = DeviceRecorder(bytes_per_pack=64)
    s = strategy_of(2, cross_device_ops=ops)
    with s.scope():
        mnet = s.mirror(nn.Sequential(nn.Linear(4, 300), nn.Linear(300, 2)))  # one gradient reduced in place
        opt = s.mirror_optimizer(torch.optim.SGD, mnet, lr=0.1)

    def step():
        ctx = md.get_replica_context()
        device = next(mnet.parameters()).device
        summed = ctx.all_reduce("sum", [torch.ones(3, device=device), torch.ones(_replica_reduce._DIRECT_NUMEL,
                                                                                  device=device)])
        mnet(torch.ones(2, 4, device=device)).sum().backward()
        opt.step()
        return [t.device.type for t in summed], [p.device.type for p in mnet.parameters()]

    out = s.run(step)
    assert [ops.seen[0], ops.seen[1]] == [[{"cpu"}, {"meta"}]] * 2
    assert s.experimental_local_results(out[0]) == (["cpu", "cpu"], ["meta", "meta"])
    assert s.experimental_local_results(out[1])[1] == ["meta"] * 4


class FakeNccl:
    """torch.cuda.nccl.all_reduce as far as its checks go: one tensor per distinct device, outputs on
    their inputs' devices, one dtype and size. Sums where the data is on the CPU."""

    def __init__(self):
        self.calls: list[list[str]] = []

    def __call__(self, inputs, outputs=None, op=0, streams=None, comms=None):
        outputs = inputs if outputs is None else outputs
        devices = [t.device for t in inputs]
        assert len(set(devices)) == len(devices), f"NCCL needs tensors on distinct devices, got {devices}"
        assert [t.device for t in outputs] == devices
        assert len({(t.numel(), t.dtype) for t in inputs}) == 1
        self.calls.append([str(d) for d in devices])


def test_nccl_gets_one_buffer_per_device_and_results_stay_there(monkeypatch):
    """Issue 19: with NcclAllReduce every strategy.reduce handed NCCL buffers all on replica 0's GPU.
    With a fake NCCL that checks what the real one checks, the cross-replica and in-step paths pass
    one buffer per device."""
    import torch.cuda.nccl

    fake = FakeNccl()
    monkeypatch.setattr(torch.cuda.nccl, "all_reduce", fake)
    monkeypatch.setattr(cdo, "nccl_can_reduce", lambda column: len({t.device for t in column}) == len(column))
    ops = md.NcclAllReduce(bytes_per_pack=16)
    values = [md.PerReplica([torch.ones(s), torch.ones(s, device="meta")]) for s in [(3,), (2, 2), (1,)]]
    out = ops.batch_reduce("sum", [(v, None) for v in values])
    assert fake.calls == [["cpu", "meta"]] * 3  # one call per bucket
    assert all([t.device.type for t in v.values] == ["cpu", "meta"] for v in out)
    inputs = [[torch.ones(4), torch.ones(2)], [torch.ones(4, device="meta"), torch.ones(2, device="meta")]]
    outputs = [[torch.empty(4), torch.empty(2)], [torch.empty(4, device="meta"), torch.empty(2, device="meta")]]
    ops._reduce_into(inputs, outputs, md.ReduceOp.SUM)
    assert len(fake.calls) == 5


def test_nccl_ops_sum_what_nccl_cannot_take_as_a_tree():
    """strategy.reduce of CPU values (a metric's counts, say) under NcclAllReduce: no NCCL call, the
    same sums as the hierarchical copy, each on its replica's device."""
    xs = random_inputs(3, 7, np.float64)
    out = md.NcclAllReduce().reduce("sum", md.PerReplica([torch.from_numpy(x) for x in xs]))
    for t in out.values:
        assert t.device.type == "cpu"
        np.testing.assert_allclose(t.numpy(), np.sum(xs, axis=0), rtol=1e-12)
    assert not cdo.nccl_can_reduce([torch.ones(1), torch.ones(1)])


# ---- on CUDA (benchmarks/gpu_check.py runs these on a GPU machine) ----------------------------------
@pytest.mark.cuda
@pytest.mark.parametrize("ops_cls", [md.ReductionToOneDevice, md.HierarchicalCopyAllReduce])
def test_gpu_and_cpu_replicas_get_their_results_on_their_devices(ops_cls):  # pragma: no cover - GPU only
    """One GPU suffices: replicas on cuda:0 and cpu:0 are two devices, so a result of replica 1 that
    lands on cuda:0 (issue 19) shows here, in strategy.reduce, ctx.all_reduce and a training step."""
    s = md.MirroredStrategy(devices=["cuda:0", "cpu:0"], cross_device_ops=ops_cls(bytes_per_pack=64),
                            timeout_s=TIMEOUT_S)
    devices = [torch.device("cuda:0"), torch.device("cpu")]
    xs = random_inputs(2, 1000)
    value = md.PerReplica([torch.from_numpy(x).to(d) for x, d in zip(xs, devices)])
    mirrored = s.extended.cross_device_ops.reduce("sum", value)
    for t, d in zip(mirrored.values, devices):
        assert t.device == d
        np.testing.assert_allclose(t.cpu().numpy(), xs[0] + xs[1], rtol=1e-5, atol=1e-5)
    assert s.reduce("sum", value).device == devices[0]

    def fn():
        x = torch.from_numpy(xs[replica_id()]).to(devices[replica_id()])
        return md.get_replica_context().all_reduce("mean", [x, x[:3].double()])

    out = s.run(fn)
    for r, d in enumerate(devices):
        assert out[0].values[r].device == d and out[1].values[r].device == d
        np.testing.assert_allclose(out[0].values[r].cpu().numpy(), (xs[0] + xs[1]) / 2, rtol=1e-5, atol=1e-5)
    with s.scope():
        mnet = s.mirror(nn.Linear(1000, 3))
        opt = s.mirror_optimizer(torch.optim.SGD, mnet, lr=0.1)

    def step():
        x = torch.from_numpy(xs[replica_id()]).to(devices[replica_id()])
        mnet(x.reshape(1, -1)).sum().backward()
        opt.step()

    s.run(step)
    gpu_copy, cpu_copy = s.experimental_local_results(mnet)
    assert [p.device for p in cpu_copy.parameters()] == [devices[1]] * 2
    # The same reduced gradient, applied by a CUDA and a CPU kernel: equal up to whether each fuses
    # the multiply-add (replicas of one device kind are held bitwise by check_in_sync).
    for a, b in zip(gpu_copy.parameters(), cpu_copy.parameters()):
        torch.testing.assert_close(a.detach().cpu(), b.detach(), rtol=0, atol=1e-6)


@pytest.mark.cuda(devices=2)
def test_nccl_all_reduce_equals_numpy_sum_on_two_gpus():  # pragma: no cover - GPU machines only
    s = md.MirroredStrategy(devices=["cuda:0", "cuda:1"], cross_device_ops=md.NcclAllReduce(), timeout_s=TIMEOUT_S)
    xs = random_inputs(2, 1000)
    out = s.run(lambda: md.get_replica_context().all_reduce(
        "sum", torch.from_numpy(xs[replica_id()]).to(f"cuda:{replica_id()}")))
    for r, t in enumerate(s.experimental_local_results(out)):
        assert t.device == torch.device(f"cuda:{r}")
        np.testing.assert_allclose(t.cpu().numpy(), xs[0] + xs[1], rtol=1e-5, atol=1e-5)
    value = md.PerReplica([torch.from_numpy(x).to(f"cuda:{r}") for r, x in enumerate(xs)])
    mirrored = s.extended.cross_device_ops.reduce("mean", value)
    assert [t.device for t in mirrored.values] == [torch.device("cuda:0"), torch.device("cuda:1")]
    total = s.reduce("sum", value)
    assert total.device == torch.device("cuda:0")
    np.testing.assert_allclose(total.cpu().numpy(), xs[0] + xs[1], rtol=1e-5, atol=1e-5)
