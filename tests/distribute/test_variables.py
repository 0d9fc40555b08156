"""variables.py: Variable as a tensor, construction rules, per-context reads, check_in_sync.

The tf.distribute write semantics of each context are in tests/conformance/test_tf_variables.py.
"""
from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch

import mirrored.distribute as md
from _replicas import replica_id, strategy_of  # tests/_replicas.py


def test_torch_ops_accept_variables():
    s = strategy_of(2)
    with s.scope():
        v = md.Variable(torch.tensor([1.0, 2.0]), name="w")
        assert torch.add(v, 1).tolist() == [2.0, 3.0]
        assert (v * 2).tolist() == [2.0, 4.0] and (2 * v).tolist() == [2.0, 4.0]
        assert (v + v).tolist() == [2.0, 4.0] and (v - 1).tolist() == [0.0, 1.0] and (1 - v).tolist() == [0.0, -1.0]
        assert (v / 2).tolist() == [0.5, 1.0] and (v ** 2).tolist() == [1.0, 4.0]
        assert (-v).tolist() == [-1.0, -2.0] and abs(-v).tolist() == [1.0, 2.0]
        assert (v @ torch.ones(2)).item() == 3.0 and (torch.ones(2) @ v).item() == 3.0
        assert (v > 1).tolist() == [False, True] and (v == v).tolist() == [True, True]
        assert v[1].item() == 2.0
        assert torch.stack([v, v]).shape == (2, 2)
        assert torch.nn.functional.linear(torch.ones(1, 2), torch.ones(3, 2), v[:1].expand(3)).shape == (1, 3)
        assert np.asarray(v).tolist() == [1.0, 2.0] and v.numpy().dtype == np.float32


def test_python_number_conversions_do_not_warn():
    v = md.Variable(torch.tensor(2.5))  # trainable float: requires grad
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert float(v) == 2.5 and int(v) == 2 and bool(v) is True and v.item() == 2.5


def test_torch_ops_in_replica_context_use_the_replicas_copy_and_carry_gradients():
    """Inside run a variable means the replica's own copy: ops build autograd graphs on it."""
    s = strategy_of(2)
    with s.scope():
        v = md.Variable(torch.tensor([1.0, 2.0]))

    def fn():
        (v * v).sum().backward()
        mine = v.values[replica_id()]
        return mine.grad.clone(), torch.equal(v.read_value(), mine), v.device

    grads, is_mine, devices = s.run(fn)
    assert [g.tolist() for g in grads.values] == [[2.0, 4.0], [2.0, 4.0]]
    assert is_mine is True and set(devices.values) == {torch.device("cpu")}


def test_plain_variable_outside_scope():
    v = md.Variable(3.0, name="count")
    assert type(v) is md.Variable and len(v.values) == 1 and v.name == "count"
    v.assign_add(2.0)
    v.assign_sub(1.0)
    assert v.read_value().item() == 4.0 and v.value().item() == 4.0
    v.assign(torch.tensor(7.0))
    assert float(v) == 7.0
    assert repr(v) == "<Variable 'count' shape=() dtype=torch.float32 value=7.0>"


def test_construction_options():
    v = md.Variable(lambda: torch.zeros(2), dtype=torch.float64, trainable=False)
    assert v.dtype == torch.float64 and not v.trainable and not v.values[0].requires_grad
    w = md.Variable([1.0, 2.0])
    assert w.trainable and w.values[0].requires_grad and w.shape == (2,)
    i = md.Variable(torch.tensor([1, 2]))
    assert i.trainable and not i.values[0].requires_grad  # integers never require grad
    src = torch.ones(2)
    assert md.Variable(src).values[0].data_ptr() != src.data_ptr()  # the initial value is copied
    with pytest.raises(ValueError, match="initial_value is required"):
        md.Variable()


def test_enum_arguments_accept_names_and_reject_others():
    s = strategy_of(2)
    with s.scope():
        v = md.Variable(0.0, synchronization="on_read", aggregation="sum")
    assert v.synchronization is md.VariableSynchronization.ON_READ and v.aggregation is md.VariableAggregation.SUM
    with pytest.raises(ValueError, match="aggregation='max'"):
        md.Variable(0.0, aggregation="max")
    with pytest.raises(ValueError, match="VariableSynchronization.ON_WRITE"):
        md.Variable(0.0, synchronization=7)


def test_auto_and_on_write_are_mirrored():
    s = strategy_of(2)
    with s.scope():
        for sync in ("AUTO", "ON_WRITE"):  # (NONE is refused in a scope, as in TF: see conformance)
            assert isinstance(md.Variable(0.0, synchronization=sync), md.MirroredVariable)


def test_assign_shape_mismatch_names_shapes():
    s = strategy_of(2)
    with s.scope():
        v = md.Variable(torch.zeros(2, 3))
        v.assign(1.0)  # a scalar broadcasts
        v.assign(torch.ones(3))  # so does a trailing shape
        with pytest.raises(ValueError, match=r"value of shape \(4,\) does not fit a variable of shape \(2, 3\)"):
            v.assign(torch.ones(4))
    assert all(torch.equal(t, torch.ones(2, 3)) for t in v.values)


def test_writes_do_not_touch_autograd_history():
    s = strategy_of(2)
    with s.scope():
        v = md.Variable(torch.ones(2))
        v.assign_add(torch.ones(2, requires_grad=True))
    assert all(t.grad_fn is None and t.requires_grad and t.is_leaf for t in v.values)


def test_repr_of_mirrored_variable_shows_every_copy():
    s = strategy_of(2)
    with s.scope():
        v = md.Variable([1.0], name="b")
    assert repr(v) == "<MirroredVariable 'b' shape=(1,) dtype=torch.float32 {0: [1.0], 1: [1.0]}>"


def test_check_in_sync_names_the_variable_and_replica():
    s = strategy_of(3)
    with s.scope():
        v = md.Variable(torch.zeros(3), name="bias")
    s.check_in_sync(v)
    with torch.no_grad():
        v.values[2][1] += 1e-7
    with pytest.raises(md.OutOfSyncError) as info:
        s.check_in_sync([v])
    msg = str(info.value)
    assert msg.startswith("variable 'bias': replica 0 and replica 2 (cpu:2) hold different values")
    assert "bitwise identical" in msg


def test_check_in_sync_refuses_sync_on_read():
    s = strategy_of(2)
    with s.scope():
        v = md.Variable(0.0, synchronization="ON_READ", aggregation="SUM")
    with pytest.raises(TypeError, match="differ by design"):
        s.check_in_sync(v)


def test_variable_values_live_on_their_devices():
    s = strategy_of(3)
    with s.scope():
        v = md.Variable(torch.ones(2))
    assert len({t.data_ptr() for t in v.values}) == 3  # separate storage per replica
    with torch.no_grad():
        for r, t in enumerate(v.values):
            t.fill_(r)  # tell the copies apart: each replica reads its own
    assert s.run(lambda: v.read_value().tolist() == [float(replica_id())] * 2) is True


def test_a_read_is_a_snapshot_as_in_tf():
    """Measured on TF 2.21: values read before an assign keep the old value (read_value, value(),
    numpy(), indexing), in and out of run; and modifying a read leaves the copies in sync. (Review
    finding: reads shared the variable's storage, so they changed with it, and an in-place change
    of a read altered one copy.)"""
    s = strategy_of(2)
    with s.scope():
        v = md.Variable(torch.tensor([1.0, 2.0]), trainable=False)
    reads = [v.read_value(), v.value(), v.numpy(), v[0]]
    with s.scope():
        v.assign(torch.tensor([5.0, 6.0]))
    assert [r.tolist() for r in reads] == [[1.0, 2.0], [1.0, 2.0], [1.0, 2.0], 1.0]

    def fn():
        before = v.read_value()
        v.assign(torch.tensor([7.0, 8.0]))
        return before

    assert [t.tolist() for t in s.experimental_local_results(s.run(fn))] == [[5.0, 6.0]] * 2
    v.read_value().add_(1)
    s.check_in_sync(v)


def test_per_replica_values_where_one_value_belongs_are_clear_errors():
    """Review findings: a PerReplica assigned in cross-replica context failed inside torch ("must be real
    number") - TF writes each copy its own value, so they diverge - and a PerReplica of the wrong
    length passed to run failed with an IndexError in a replica."""
    s = strategy_of(2)
    with s.scope():
        v = md.Variable(1.0)
        with pytest.raises(ValueError, match=r"assign\(PerReplica\) in cross-replica context"):
            v.assign(md.PerReplica([3.0, 4.0]))
    assert [t.item() for t in v.values] == [1.0, 1.0]
    with pytest.raises(ValueError, match="PerReplica of 1 values, but this strategy runs 2 replicas"):
        s.run(lambda x: x, args=(md.PerReplica([1.0]),))


def test_deepcopy_of_a_plain_variable_and_inside_a_structure():
    """A plain variable copies too (its strategy is shared, never copied: the default strategy is a
    process singleton); a structure holding a variable twice gets one copy twice (deepcopy's memo)."""
    import copy

    v = md.Variable(torch.tensor([1.0, 2.0]))
    c = copy.deepcopy(v)
    assert type(c) is md.Variable and torch.equal(c.values[0], v.values[0]) and c.values[0] is not v.values[0]
    assert c._strategy is v._strategy and c.values[0].requires_grad
    pair = copy.deepcopy([v, v])
    assert pair[0] is pair[1] and pair[0] is not v


def test_extended_update_argument_checks():
    s, other = strategy_of(2), strategy_of(2)
    with other.scope():
        foreign = md.Variable(0.0)
    with pytest.raises(TypeError, match="expected a variable"):
        s.extended.update(torch.ones(1), lambda t: t)
    with pytest.raises(TypeError, match="fn must be callable"):
        s.extended.update(foreign, 3)
    with pytest.raises(ValueError, match="belongs to"):
        s.extended.update(foreign, lambda var: var.assign(1.0))
    plain = md.Variable(1.0)  # the default strategy: fn gets the variable itself
    assert md.get_strategy().extended.update(plain, lambda var: var.assign_add(1.0)) is plain
    assert plain.item() == 2.0
    assert md.get_strategy().extended.update(plain, lambda var: var.read_value(), group=False)[0].item() == 2.0


def test_update_copies_write_in_place_and_carry_names():
    """The copy fn receives writes through to the variable's own tensor (no re-binding of .values)."""
    s = strategy_of(2)
    with s.scope():
        v = md.Variable(torch.zeros(2), name="w")
    before = [t.data_ptr() for t in v.values]
    names = []
    s.extended.update(v, lambda var: names.append(var.name) or var.assign(torch.ones(2)))
    assert [t.data_ptr() for t in v.values] == before and names == ["w", "w/replica_1"]
    assert [t.tolist() for t in v.values] == [[1.0, 1.0], [1.0, 1.0]]


def test_variables_created_inside_run_two_in_a_row_pair_up_in_order():
    """Each creation inside run is one merge_call, so the k-th variable of every replica is one
    variable (TF's shared creator pairs them by name; the order is the same here). A callable initial
    value is called once, by the first replica, in its replica context (as TF's replica 0 does)."""
    s = strategy_of(3)
    called_by = []

    def init():
        called_by.append(replica_id())
        return torch.full((2,), 5.0 + replica_id())

    def fn():
        a = md.Variable(torch.tensor(float(replica_id())), name="a")
        b = md.Variable(init, name="b")
        return a, b

    a, b = s.run(fn)
    assert called_by == [0]
    assert isinstance(a, md.MirroredVariable) and isinstance(b, md.MirroredVariable)
    assert [t.item() for t in a.values] == [0.0] * 3 and [t.tolist() for t in b.values] == [[5.0, 5.0]] * 3
    one = strategy_of(1)
    assert one.run(lambda: md.Variable(2.0)).values[0].item() == 2.0


@pytest.mark.parametrize("dtype", [torch.int64, torch.float64, torch.float32, torch.int32])
def test_writes_convert_values_as_torch_does_whatever_path_they_take(dtype):
    """assign / assign_add / assign_sub skip converting whole numbers (for int64 and float64 targets) and
    tensors already of the target's dtype (a metric's update, twice per replica step): every value still
    lands as torch.as_tensor(value, dtype=target's) would, bit for bit, and a value that does not fit is
    still refused."""
    start = torch.tensor([5, -2, 7], dtype=dtype)
    values = [3, True, np.int64(4), torch.tensor(2, dtype=dtype), torch.tensor([1, 2, 3], dtype=torch.int64),
              torch.tensor(1.75, dtype=torch.float64)]
    if dtype != torch.int32:
        values += [-(2 ** 53), 2 ** 53 + 1]  # (the limit of the unconverted path, and one past it)
    if dtype.is_floating_point:
        values += [0.1, torch.tensor([0.5, -0.25, 3.0], dtype=torch.float32)]
    for value in values:
        for op, ref in (("assign", lambda t, v: t.copy_(v)), ("assign_add", torch.Tensor.add_),
                        ("assign_sub", torch.Tensor.sub_)):
            v = md.Variable(start.clone(), trainable=False)
            getattr(v, op)(value)
            want = ref(start.clone(), torch.as_tensor(value, dtype=dtype))
            got = v.read_value()
            assert got.dtype == dtype and torch.equal(got, want), (op, value, got, want)
    v = md.Variable(start.clone(), trainable=False)
    with pytest.raises(ValueError, match="does not fit"):
        v.assign_add(torch.ones(2, dtype=dtype))
