"""buckets.py: plan / pack / unpack of gradient buckets (properties checked with hypothesis)."""
from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from mirrored.distribute import buckets
from _replicas import replica_id  # tests/_replicas.py

DTYPES = [torch.float32, torch.float64, torch.int64, torch.float16]


@st.composite
def tensor_lists(draw):
    """Lists of tensors (some None) of mixed shapes and dtypes, and a bucket size in bytes."""
    n = draw(st.integers(0, 8))
    out = []
    for i in range(n):
        if draw(st.booleans()) and draw(st.booleans()):
            out.append(None)
            continue
        shape = tuple(draw(st.lists(st.integers(0, 4), max_size=3)))
        dtype = draw(st.sampled_from(DTYPES))
        out.append(torch.arange(torch.Size(shape).numel(), dtype=torch.float64).reshape(shape).to(dtype) + i)
    return out, draw(st.integers(1, 256))


@settings(max_examples=80, deadline=None)
@given(tensor_lists())
def test_plan_pack_unpack_round_trip(case):
    tensors, bytes_per_pack = case
    plan = buckets.plan(tensors, bytes_per_pack)
    indices = sorted(i for b in plan for i in b.indices)
    assert indices == [i for i, t in enumerate(tensors) if t is not None]  # every tensor once, None never
    restored: list = [None] * len(tensors)
    for b in plan:
        assert all(tensors[i].dtype == b.dtype and tensors[i].device == b.device for i in b.indices)
        assert b.indices == sorted(b.indices)  # order kept within a bucket
        nbytes = b.numel * torch.empty((), dtype=b.dtype).element_size()
        non_empty = [i for i in b.indices if tensors[i].numel()]
        assert nbytes <= bytes_per_pack or len(non_empty) == 1  # an oversized tensor gets its own bucket
        flat = b.pack(tensors)
        assert flat.dim() == 1 and flat.numel() == b.numel
        b.unpack(flat, restored)
    for t, r in zip(tensors, restored):
        if t is None:
            assert r is None
        else:
            assert r.shape == t.shape and r.dtype == t.dtype and torch.equal(r, t)


def test_unpacked_tensors_are_views_of_the_buffer():
    """unpack hands back views, so writing the flat buffer (an all-reduce in place) updates them."""
    tensors = [torch.ones(2, 2), torch.zeros(3)]
    (b,) = buckets.plan(tensors, 1 << 20)
    flat = b.pack(tensors)
    out: list = [None, None]
    b.unpack(flat, out)
    flat.add_(1)
    assert out[0].tolist() == [[2.0, 2.0], [2.0, 2.0]] and out[1].tolist() == [1.0, 1.0, 1.0]


def test_pack_into_a_kept_buffer_and_in_place_views():
    """pack(out=buffer) reuses the caller's buffer; tensors already viewing it are not copied."""
    tensors = [torch.ones(3), torch.full((2,), 5.0)]
    (b,) = buckets.plan(tensors, 1 << 20)
    buffer = b.new_buffer()
    assert b.pack(tensors, out=buffer) is buffer and buffer.tolist() == [1, 1, 1, 5, 5]
    views: list = [None, None]
    b.unpack(buffer, views)
    views[0].mul_(2)  # a gradient accumulated in place in its bucket
    assert b.pack(views, out=buffer).tolist() == [2, 2, 2, 5, 5]


def test_plan_splits_by_dtype_and_size():
    tensors = [torch.ones(4), torch.ones(4, dtype=torch.float64), torch.ones(4), torch.ones(100)]
    plan = buckets.plan(tensors, bytes_per_pack=32)
    groups = sorted((str(b.dtype), b.indices) for b in plan)
    assert groups == [("torch.float32", [0, 2]), ("torch.float32", [3]), ("torch.float64", [1])]


def test_signature_equal_exactly_when_plans_match():
    a = [torch.ones(2), None, torch.ones(3, dtype=torch.int64)]
    b = [torch.zeros(2), None, torch.zeros(3, dtype=torch.int64)]
    assert buckets.signature(a) == buckets.signature(b)
    assert buckets.signature(a) != buckets.signature([torch.ones(2), torch.ones(1), a[2]])
    assert buckets.signature(a) != buckets.signature([torch.ones(2, 1), None, a[2]])


def test_a_plan_packs_each_replicas_tensors_on_their_own_device():
    """Issue 19: a plan made from replica 0's tensors packed replica 1's into a buffer on replica 0's
    device. The meta device stands in for a second GPU (it has no data to copy to the CPU)."""
    mine, theirs = [torch.ones(3), torch.ones(2, 2)], [torch.ones(3, device="meta"), torch.ones(2, 2, device="meta")]
    (b,) = buckets.plan(mine, 1 << 20)
    flat = b.pack(theirs)
    assert flat.device.type == "meta" and flat.numel() == 7
    out: list = [None, None]
    b.unpack(flat, out)
    assert [t.device.type for t in out] == ["meta", "meta"] and out[1].shape == (2, 2)
    assert b.pack(mine).device.type == "cpu"


def test_a_layout_keeps_its_buffers_on_the_device_of_its_tensors():
    """Each replica builds its Layout from its own tensors: packed buckets, direct outputs and results
    all lie on that replica's device."""
    tensors = [torch.ones(3, device="meta"), torch.ones(40, device="meta"), None]
    layout = buckets.Layout(tensors, bytes_per_pack=64, direct_numel=32)
    for in_place in (False, True):
        inputs, outputs, results = layout.buffers(in_place=in_place).stage(tensors)
        assert {t.device.type for t in inputs + outputs} == {"meta"}
        assert [None if t is None else t.device.type for t in results] == ["meta", "meta", None]


def test_plan_groups_keep_tensors_apart():
    """groups= splits what dtype and device alone would bucket together (another replica's devices)."""
    tensors = [torch.ones(2), torch.ones(2), torch.ones(2)]
    plan = buckets.plan(tensors, 1 << 20, groups=["a", "b", "a"])
    assert sorted(b.indices for b in plan) == [[0, 2], [1]]


def test_channels_last_gradients_keep_their_layout_through_the_all_reduce():
    """Issue 19: gradients of a channels_last model were copied into row-major buffers and replaced
    .grad, so an optimizer's foreach kernels lost their fast path (they need equal strides). Small
    ones are now packed through views in their own layout, large ones reduced where they lie; the
    sums equal the replicas' gradients added by hand."""
    import mirrored as mr

    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.Conv2d(8, 128, 1), torch.nn.Conv2d(128, 80, 3))
    net = net.to(memory_format=torch.channels_last)  # conv weights: 216 (packed), 1024, 92160 (direct) values
    strategy = mr.MirroredStrategy(devices=["cpu:0", "cpu:1"])
    with strategy.scope():
        mnet = strategy.mirror(net)
        opt = strategy.mirror_optimizer(torch.optim.SGD, mnet, lr=0.0)
    x = torch.randn(2, 3, 9, 9).to(memory_format=torch.channels_last)
    seen = {}

    def step(xb):
        mnet(xb).square().sum().backward()
        rid = replica_id()
        seen[rid] = [p.grad.clone() for p in mnet.parameters()]
        opt.step()

    strategy.run(step, args=(strategy.experimental_distribute_values_from_function(lambda ctx: x[ctx.replica_id_in_sync_group:][:1]),))
    for copy in mnet.replicas:
        for i, p in enumerate(copy.parameters()):
            assert p.grad.stride() == p.stride(), f"parameter {i}: {p.grad.stride()} against {p.stride()}"
            torch.testing.assert_close(p.grad, seen[0][i] + seen[1][i], rtol=1e-6, atol=1e-6)
    conv = [p for p in mnet.replicas[0].parameters() if p.dim() == 4]
    assert not conv[0].is_contiguous() and conv[-1].numel() >= 1 << 16  # both paths were taken
