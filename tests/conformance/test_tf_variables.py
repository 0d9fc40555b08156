"""Conformance: MirroredVariable (ON_WRITE) and SyncOnReadVariable (ON_READ) semantics.

Sources (tensorflow/python/distribute/): mirrored_strategy_test.py (MirroredVariableUpdateTest,
SyncOnReadVariableAssignTest), strategy_test_lib.py (_test_global_step_update), mirrored_variable_test.py,
values_util.py (on_write_assign / on_read_assign_cross_replica / on_read_assign_add_cross_replica),
values.py (_on_write_update_replica, SyncOnReadVariable._get_cross_replica), values_test.py
(DistributedVariableTest: testAssignSignature, testDeepCopy, testStrategyExtendedUpdate,
testSaveNonDistributed), values_v2_test.py (testDenseUpdate, testOperatorOverride), distribute_lib.py
(StrategyExtendedV2.update / value_container / colocate_vars_with), distribute_utils.py
(create_mirrored_variable, update_regroup). TF 2.x semantics: aggregation NONE in replica context
updates only the calling replica's copy.
"""
from __future__ import annotations

import copy

import pytest
import torch

import mirrored.distribute as md
from _replicas import replica_id, strategy_of  # tests/_replicas.py

AGG = md.VariableAggregation
SYNC = md.VariableSynchronization


def copies(var) -> list:
    return [t.item() for t in var.values]


# ---- ON_WRITE ------------------------------------------------------------------------------------

def test_variable_in_scope_is_mirrored_with_one_copy_per_device():
    """mirrored_variable_test: a variable created in the scope is mirrored; outside it is plain."""
    s = strategy_of(3)
    with s.scope():
        v = md.Variable(1.0, name="foo")
    assert isinstance(v, md.MirroredVariable)
    assert len(v.values) == 3 and copies(v) == [1.0, 1.0, 1.0]
    assert s.experimental_local_results(v) == v.values
    plain = md.Variable(1.0)
    assert type(plain) is md.Variable and len(plain.values) == 1


def test_mirrored_assign_cross_replica_updates_every_copy():
    """MirroredVariableUpdateTest.testAssign/AssignAdd/AssignSubMirroredVarCrossDeviceContext:
    in cross-replica context assign 6 -> 6; assign_add 6 -> 7 then 2 -> 9; assign_sub 2 from 5 -> 3,
    on every copy."""
    s = strategy_of(2)
    with s.scope():
        v = md.Variable(1.0, name="foo")
        w = md.Variable(5.0, name="bar")
        assert v.assign(6.0).read_value().item() == 6.0
        assert copies(v) == [6.0, 6.0]
        v.assign(1.0)
        assert v.assign_add(6.0).read_value().item() == 7.0
        v.assign_add(2.0)
        assert copies(v) == [9.0, 9.0]
        assert w.assign_sub(2.0).read_value().item() == 3.0
        assert copies(w) == [3.0, 3.0]


def test_mirrored_replica_assign_without_aggregation_same_value():
    """testAssignMirroredVarReplicaContextWithoutAggregationType: aggregation NONE, every replica
    assigns 5.0 -> every copy is 5.0."""
    s = strategy_of(2)
    with s.scope():
        v = md.Variable(1.0, name="foo")
    s.run(lambda: v.assign(5.0))
    assert copies(v) == [5.0, 5.0]


def test_mirrored_replica_assign_none_updates_only_callers_copy():
    """values._on_write_update_replica: aggregation NONE writes the calling replica's own copy only
    (the caller promises equal values, as an optimizer applying all-reduced gradients does)."""
    s = strategy_of(3)
    with s.scope():
        v = md.Variable(0.0)

    def fn():
        if replica_id() == 1:
            v.assign(7.0)

    s.run(fn)
    assert copies(v) == [0.0, 7.0, 0.0]


def test_mirrored_replica_assign_with_sum_of_a_constant_raises():
    """testAssignMirroredVarReplicaContextWithSum: aggregation SUM and the same non-distributed 5.0 from
    every replica -> ValueError (reduce_non_distributed_value refuses to SUM identical values)."""
    s = strategy_of(2)
    with s.scope():
        v = md.Variable(1.0, aggregation=AGG.SUM)
    with pytest.raises(ValueError, match="aggregation SUM"):
        s.run(lambda: v.assign(5.0))
    assert copies(v) == [1.0, 1.0]  # nothing was written


def test_mirrored_replica_assign_with_sum_of_per_replica_values():
    """ON_WRITE with SUM: each replica's value is summed, then every copy gets the total."""
    s = strategy_of(3)
    with s.scope():
        v = md.Variable(0.0, aggregation=AGG.SUM)
    s.run(lambda: v.assign(torch.tensor(float(replica_id() + 1))))
    assert copies(v) == [6.0, 6.0, 6.0]
    s.run(lambda: v.assign_add(torch.tensor(1.0)))
    assert copies(v) == [9.0, 9.0, 9.0]


def test_mirrored_replica_assign_with_mean():
    """testAssignMirroredVarReplicaContext / testAssignAdd... / testAssignSub...: aggregation MEAN with
    value = replica_id on 2 replicas: assign -> 0.5; assign_add to 1.0 -> 1.5; assign_sub from 5.0 -> 4.5."""
    s = strategy_of(2)
    with s.scope():
        a = md.Variable(1.0, aggregation=AGG.MEAN)
        b = md.Variable(1.0, aggregation=AGG.MEAN)
        c = md.Variable(5.0, aggregation=AGG.MEAN)

    def fn():
        value = torch.tensor(float(replica_id()))
        a.assign(value)
        b.assign_add(value)
        c.assign_sub(value)

    s.run(fn)
    assert copies(a) == [0.5, 0.5] and copies(b) == [1.5, 1.5] and copies(c) == [4.5, 4.5]


def test_mirrored_replica_assign_with_mean_of_a_single_value():
    """testAssign/AssignAdd/AssignSubMirroredVarReplicaContextWithSingleValue: MEAN of the same plain
    value from every replica is that value: assign 5 -> 5; assign_add 5 to 1 -> 6; assign_sub 1 from 5 -> 4."""
    s = strategy_of(2)
    with s.scope():
        a = md.Variable(1.0, aggregation=AGG.MEAN)
        b = md.Variable(1.0, aggregation=AGG.MEAN)
        c = md.Variable(5.0, aggregation=AGG.MEAN)

    def fn():
        a.assign(5.0)
        b.assign_add(5.0)
        c.assign_sub(1.0)

    s.run(fn)
    assert copies(a) == [5.0, 5.0] and copies(b) == [6.0, 6.0] and copies(c) == [4.0, 4.0]


def test_only_first_replica_global_step():
    """strategy_test_lib._test_global_step_update: an int64 ONLY_FIRST_REPLICA variable, assign_add(1)
    in every replica, reads 1 on every replica afterwards (inside run and in cross-replica context)."""
    s = strategy_of(3)
    with s.scope():
        step = md.Variable(torch.tensor(0, dtype=torch.int64), trainable=False, aggregation=AGG.ONLY_FIRST_REPLICA)

    def fn():
        step.assign_add(1)
        return step.read_value().item()

    assert set(s.experimental_local_results(s.run(fn))) == {1}
    assert copies(step) == [1, 1, 1]
    assert step.dtype == torch.int64


def test_only_first_replica_takes_replica_zero_value():
    """apply_aggregation(ONLY_FIRST_REPLICA): the first replica's value is broadcast to every copy."""
    s = strategy_of(3)
    with s.scope():
        v = md.Variable(0.0, aggregation=AGG.ONLY_FIRST_REPLICA)
    s.run(lambda: v.assign(torch.tensor(10.0 + replica_id())))
    assert copies(v) == [10.0, 10.0, 10.0]


def test_integer_variable_with_mean_aggregation_is_refused_at_creation():
    """distribute_utils.create_mirrored_variable, measured on TF 2.21: "creating distributed
    tf.Variable with aggregation=MEAN and a non-floating dtype is not supported" (ValueError), for
    ON_WRITE and ON_READ alike; SUM is fine. Default and one-device strategies make plain
    variables, which TF does not check."""
    s = strategy_of(2)
    with s.scope():
        for sync in (SYNC.ON_WRITE, SYNC.ON_READ):
            with pytest.raises(ValueError, match="aggregation=MEAN on a torch.int32 variable"):
                md.Variable(torch.tensor(3, dtype=torch.int32), trainable=False, synchronization=sync,
                            aggregation=AGG.MEAN)
        v = md.Variable(torch.tensor(3, dtype=torch.int32), synchronization=SYNC.ON_READ, aggregation=AGG.SUM)
    assert copies(v) == [3, 3]
    with md.OneDeviceStrategy("cpu:0").scope():
        assert md.Variable(3, aggregation=AGG.MEAN).dtype == torch.int64
    assert md.Variable(3, aggregation=AGG.MEAN).dtype == torch.int64  # the default strategy


def test_mirrored_read_in_cross_replica_and_replica_context():
    """A MirroredVariable reads its primary copy in cross-replica context and each replica's own copy
    in replica context; torch ops accept it as a tensor."""
    s = strategy_of(2)
    with s.scope():
        v = md.Variable(torch.tensor([1.0, 2.0]))
        assert v.read_value().tolist() == [1.0, 2.0]
        assert torch.add(v, 1).tolist() == [2.0, 3.0]
        assert (v * 2).tolist() == [2.0, 4.0]
    with torch.no_grad():
        v.values[1].add_(10)  # (out of sync on purpose, to see which copy each replica reads)
    out = s.run(lambda: v.read_value())
    assert [t.tolist() for t in s.experimental_local_results(out)] == [[1.0, 2.0], [11.0, 12.0]]


def test_reduce_mean_of_mirrored_variable_is_exact():
    """MirroredExtended._reduce_to: MEAN of a mirrored value returns it, with no arithmetic (0.1 summed
    three times and divided by 3 would not give 0.1 back)."""
    s = strategy_of(3)
    with s.scope():
        v = md.Variable(torch.tensor(0.1, dtype=torch.float64))
    assert s.reduce(md.ReduceOp.MEAN, v).item() == 0.1


def test_variable_created_in_replica_context_is_one_shared_variable():
    """mirrored_run + shared_variable_creator, measured on TF 2.21 with 2 replicas: a tf.Variable made
    inside strategy.run is one MirroredVariable that every replica gets; replica 0 makes it, so its
    initial value wins (replica r passing 10 + r gives 10.0 on both copies). Every replica's function
    sees the same object, and it is usable at once (here: a SUM write of 1 per replica adds 2)."""
    s = strategy_of(2)
    seen = {}

    def fn():
        v = md.Variable(torch.tensor(10.0 + replica_id()), name="late", aggregation=AGG.SUM)
        seen[replica_id()] = v
        v.assign_add(torch.tensor(1.0))
        return v

    v = s.run(fn)
    assert isinstance(v, md.MirroredVariable) and seen[0] is seen[1] is v
    assert v.name == "late" and v.distribute_strategy is s
    assert copies(v) == [12.0, 12.0]
    with s.scope():  # and the same made in cross-replica context inside the scope, for comparison
        w = md.Variable(10.0)
    assert type(w) is type(v) and copies(w) == [10.0, 10.0]


# ---- ON_READ -------------------------------------------------------------------------------------

def test_sync_on_read_sum_read_and_assign():
    """SyncOnReadVariableAssignTest.testAssignReplicaLocalVarSumAggregation: 1.0 on each of 2 replicas
    reads 2.0 in cross-replica context; assign(6.0) there puts 6/2 on each copy and reads back 6.0."""
    s = strategy_of(2)
    with s.scope():
        v = md.Variable(1.0, synchronization=SYNC.ON_READ, aggregation=AGG.SUM)
    assert isinstance(v, md.SyncOnReadVariable)
    assert not v.trainable
    with s.scope():
        assert v.read_value().item() == 2.0
        v.assign(6.0)
        assert copies(v) == [3.0, 3.0]
        assert v.read_value().item() == 6.0


def test_sync_on_read_mean_read_and_assign():
    """testAssignReplicaLocalVarMeanAggregation: MEAN reads 1.0; assign(6.0) reads back 6.0."""
    s = strategy_of(2)
    with s.scope():
        v = md.Variable(1.0, synchronization=SYNC.ON_READ, aggregation=AGG.MEAN)
        assert v.read_value().item() == 1.0
        v.assign(6.0)
        assert copies(v) == [6.0, 6.0] and v.read_value().item() == 6.0


def test_sync_on_read_per_replica_writes_then_cross_replica_read():
    """ON_READ: each replica writes its own copy (replica r assigns r + 1); a cross-replica read
    aggregates: SUM 1+2+3, MEAN 2, ONLY_FIRST_REPLICA replica 0's 1; in replica context each replica
    reads its own copy."""
    s = strategy_of(3)
    for agg, want in ((AGG.SUM, 6.0), (AGG.MEAN, 2.0), (AGG.ONLY_FIRST_REPLICA, 1.0)):
        with s.scope():
            v = md.Variable(0.0, synchronization=SYNC.ON_READ, aggregation=agg)

        def fn():
            v.assign(float(replica_id() + 1))
            return v.read_value().item()

        assert s.experimental_local_results(s.run(fn)) == (1.0, 2.0, 3.0)
        assert copies(v) == [1.0, 2.0, 3.0]
        with s.scope():
            assert v.read_value().item() == want, agg
        assert s.reduce(md.ReduceOp.SUM, v).item() == 6.0  # the copies reduce like a PerReplica


def test_sync_on_read_assign_add_with_sum_in_cross_replica_raises():
    """values_util.on_read_assign_add_cross_replica: "SyncOnReadVariable does not support `assign_add`
    in cross-replica context when aggregation is set to `tf.VariableAggregation.SUM`" (ValueError);
    assign_sub likewise. With MEAN, assign_add adds to every copy."""
    s = strategy_of(2)
    with s.scope():
        total = md.Variable(1.0, synchronization=SYNC.ON_READ, aggregation=AGG.SUM)
        mean = md.Variable(1.0, synchronization=SYNC.ON_READ, aggregation=AGG.MEAN)
        with pytest.raises(ValueError, match="assign_add"):
            total.assign_add(1.0)
        with pytest.raises(ValueError, match="assign_sub"):
            total.assign_sub(1.0)
        mean.assign_add(2.0)
    assert copies(total) == [1.0, 1.0]
    assert copies(mean) == [3.0, 3.0]
    s.run(lambda: total.assign_add(1.0))  # in replica context it is each replica's own copy
    assert copies(total) == [2.0, 2.0]


def test_sync_on_read_integer_sum_assign_splits_exactly():
    """TF's on_read_assign_cross_replica computes cast(value / num_replicas, dtype), so assigning 10 to
    an int SUM variable on 3 replicas stores 3 per copy and reads back 9. We split the total exactly
    (4, 3, 3) so the value reads back as assigned: the point of dividing is that it does."""
    s = strategy_of(3)
    with s.scope():
        v = md.Variable(torch.tensor(0, dtype=torch.int64), synchronization=SYNC.ON_READ, aggregation=AGG.SUM)
        v.assign(10)
        assert v.read_value().item() == 10
    assert sum(copies(v)) == 10 and v.dtype == torch.int64


def test_sync_on_read_is_trainable_when_asked():
    """values_test.DistributedVariableTest.testSaveNonDistributed creates ON_READ variables with
    trainable=True and reads v.trainable == True (TF 2.21: accepted); only the default follows the
    synchronization (ON_READ: False, ON_WRITE: True)."""
    s = strategy_of(2)
    with s.scope():
        asked = md.Variable(1.0, synchronization=SYNC.ON_READ, aggregation=AGG.SUM, trainable=True)
        default = md.Variable(1.0, synchronization=SYNC.ON_READ, aggregation=AGG.SUM)
        mirrored = md.Variable(1.0)
    assert isinstance(asked, md.SyncOnReadVariable) and asked.trainable
    assert all(t.requires_grad for t in asked.values)
    assert not default.trainable and mirrored.trainable


def test_sync_on_read_with_none_aggregation_cannot_be_read_cross_replica():
    """reduce_util.ReduceOp.from_variable_aggregation has no op for NONE, so TF cannot read such a
    variable in cross-replica context; we raise ValueError naming the fix."""
    s = strategy_of(2)
    with s.scope():
        v = md.Variable(1.0, synchronization=SYNC.ON_READ, aggregation=AGG.NONE)
        with pytest.raises(ValueError, match="aggregation NONE"):
            v.read_value()
    assert s.experimental_local_results(s.run(lambda: v.read_value().item())) == (1.0, 1.0)


# ---- the tf.Variable interface of distributed variables -------------------------------------------

ALL_KINDS = [(SYNC.ON_WRITE, AGG.NONE), (SYNC.ON_WRITE, AGG.MEAN), (SYNC.ON_READ, AGG.SUM), (SYNC.ON_READ, AGG.MEAN),
             (SYNC.ON_READ, AGG.ONLY_FIRST_REPLICA)]


@pytest.mark.parametrize("sync,agg", ALL_KINDS)
def test_assign_signature(sync, agg):
    """values_test.DistributedVariableTest.testAssignSignature and values_v2_test testDenseUpdate:
    assign / assign_add / assign_sub take (value, use_locking, name, read_value) by position or
    keyword; read_value=False returns None; read_value=True returns the variable, reading the new
    value (2 after assign(2), 5 after assign_add(1) from 4, ...). In replica context too."""
    s = strategy_of(2)
    with s.scope():
        v = md.Variable(0.0, synchronization=sync, aggregation=agg)
        if not (sync is SYNC.ON_READ and agg is AGG.SUM):  # TF refuses assign_add there (tested above)
            assert v.assign(2.0, use_locking=True, name="assign", read_value=True).read_value().item() == 2.0
            assert v.assign(3.0, read_value=False) is None and v.read_value().item() == 3.0
            assert v.assign_add(1.0, True, "assign_add", True).read_value().item() == 4.0
            assert v.assign_add(1.0, read_value=False) is None and v.read_value().item() == 5.0
            assert v.assign_sub(1.0, use_locking=True, name="assign_sub").read_value().item() == 4.0
            assert v.assign_sub(1.0, True, "assign_sub", False) is None and v.read_value().item() == 3.0

    def assign():
        one = torch.tensor(1.0)
        results = [v.assign(one, True, "assign", False), v.assign(one, use_locking=True, name="a", read_value=False),
                   v.assign_add(one, True, "assign", False), v.assign_sub(one, use_locking=True, read_value=False)]
        assert all(r is None for r in results)
        return v.assign_add(one, read_value=True) is v

    assert s.run(assign) is True  # every replica's function saw its variable returned


def test_none_synchronization_in_a_strategy_scope_is_refused():
    """distribute_utils.validate_synchronization, measured on TF 2.21: ValueError "`NONE` variable
    synchronization mode is not supported with tf.distribute strategy". Outside any scope, and in
    the one-device strategy's (plain variables), NONE is accepted and reported."""
    s = strategy_of(2)
    with s.scope(), pytest.raises(ValueError, match="synchronization=NONE"):
        md.Variable(1.0, synchronization=SYNC.NONE)
    with pytest.raises(ValueError, match="synchronization=NONE"):  # inside run as well
        s.run(lambda: md.Variable(1.0, synchronization="none"))
    plain = md.Variable(1.0, synchronization=SYNC.NONE)
    assert type(plain) is md.Variable and plain.synchronization is SYNC.NONE
    with md.OneDeviceStrategy("cpu:0").scope():
        assert md.Variable(1.0, synchronization=SYNC.NONE).synchronization is SYNC.NONE


def test_auto_synchronization_reports_on_write():
    """distribute_utils.create_mirrored_variable turns AUTO into ON_WRITE for a distributed variable;
    a plain variable keeps AUTO (values_v2_test testSynchronization reports what was asked)."""
    s = strategy_of(2)
    with s.scope():
        assert md.Variable(1.0).synchronization is SYNC.ON_WRITE
    assert md.Variable(1.0).synchronization is SYNC.AUTO


def test_distribute_strategy_property():
    """values.DistributedVariable.distribute_strategy (compared in testDeepCopy): the strategy whose
    scope made the variable, ON_WRITE and ON_READ alike, also read inside run; None for a variable
    made outside any strategy (TF's ResourceVariable default)."""
    s = strategy_of(2)
    with s.scope():
        mirrored = md.Variable(1.0)
        on_read = md.Variable(1.0, synchronization=SYNC.ON_READ, aggregation=AGG.SUM)
    assert mirrored.distribute_strategy is s and on_read.distribute_strategy is s
    assert s.run(lambda: mirrored.distribute_strategy is s) is True
    assert md.Variable(1.0).distribute_strategy is None
    one = md.OneDeviceStrategy("cpu:0")
    with one.scope():
        assert md.Variable(1.0).distribute_strategy is one


@pytest.mark.parametrize("sync,agg", ALL_KINDS)
def test_deepcopy_in_and_out_of_scope(sync, agg):
    """values_test.DistributedVariableTest.testDeepCopy: copy.deepcopy of a distributed variable, inside
    the scope or outside it, is a variable of the same type, aggregation and distribute_strategy,
    with as many copies, on the same devices, equal in value but distinct objects. Writes to the copy
    leave the original alone (resource_variable_ops_test.testEagerDeepCopy)."""
    s = strategy_of(2)
    with s.scope():
        v = md.Variable(torch.tensor([1.0, 2.0]), synchronization=sync, aggregation=agg)
        in_scope = copy.deepcopy(v)
    out_of_scope = copy.deepcopy(v)
    for c in (in_scope, out_of_scope):
        assert type(c) is type(v) and c.aggregation is agg and c.synchronization is v.synchronization
        assert c.distribute_strategy is s and c.trainable == v.trainable and c.name == v.name
        assert len(c.values) == len(v.values)
        for mine, theirs in zip(c.values, v.values):
            assert mine is not theirs and mine.data_ptr() != theirs.data_ptr()
            assert mine.device == theirs.device and torch.equal(mine, theirs)
            assert mine.requires_grad == theirs.requires_grad
    with s.scope():
        in_scope.assign(torch.tensor([5.0, 5.0]))
    assert [t.tolist() for t in v.values] == [[1.0, 2.0], [1.0, 2.0]]


def test_integer_variable_operators():
    """values_v2_test._VariableInterfaceTestBase.testOperatorOverride with v = 7 (and
    values_test.testSaveNonDistributed's integer y): +, -, *, /, //, %, comparisons, &, |, ^, pow,
    -, ~ (~7 = -8) and abs, each side, as on the int value 7."""
    s = strategy_of(2)
    with s.scope():
        v = md.Variable(torch.tensor(7, dtype=torch.int32))
    checks = [(v + 1, 8), (3 + v, 10), (v + v, 14), (v - 2, 5), (13 - v, 6), (v - v, 0), (v * 2, 14), (3 * v, 21),
              (v * v, 49), (v / 2, 3.5), (14 / v, 2.0), (v // 2, 3), (15 // v, 2), (v % 2, 1), (16 % v, 2),
              (v & 3, 3), (11 & v, 3), (v | 8, 15), (16 | v, 23), (v ^ 3, 4), (11 ^ v, 12), (pow(v, 3), 343),
              (pow(2, v), 128), (-v, -7), (~v, ~7), (abs(v), 7)]
    for got, want in checks:
        assert got.item() == want
    assert (v < 12) and (v <= 12) and not (v > 12) and not (v >= 12)
    assert not (12 < v) and not (12 <= v) and (12 > v) and (12 >= v)
    assert (~v).dtype == torch.int32
    # True division divides in float64 for 32/64-bit integers (TF's _TRUEDIV_TABLE; torch: float32).
    assert (v / 3).dtype == torch.float64 and (v / 3).item() == 7 / 3 and (7 / v).item() == 1.0
    assert (v / torch.tensor(3, dtype=torch.int64)).item() == 7 / 3
    with s.scope():
        small = md.Variable(torch.tensor(7, dtype=torch.int16))
    assert (small / 2).dtype == torch.float32
    assert (v / torch.tensor(2.0)).dtype == torch.float32  # a float divisor: torch's promotion
    with s.scope():
        flag = md.Variable(torch.tensor([True, False]))
    assert (~flag).tolist() == [False, True]


@pytest.mark.parametrize("sync,agg", [(SYNC.ON_WRITE, AGG.NONE), (SYNC.ON_READ, AGG.SUM), (SYNC.ON_READ, AGG.MEAN),
                                      (SYNC.ON_READ, AGG.ONLY_FIRST_REPLICA)])
def test_strategy_extended_update(sync, agg):
    """values_test.DistributedVariableTest.testStrategyExtendedUpdate (2 replicas, measured on TF 2.21):
    extended.update(v, fn, args=(PerReplica([1., 2.]),)) calls fn on each copy with that replica's
    part: assign -> [1, 2]; assign_add -> [2, 4]; assign_sub -> [1, 2]; fn reading the copy
    (assign_add(value() + read_value())) -> [3, 6]."""
    s = strategy_of(2)
    with s.scope():
        v = md.Variable(0.0, synchronization=sync, aggregation=agg)
    value = md.PerReplica([torch.tensor(1.0), torch.tensor(2.0)])
    s.extended.update(v, lambda var, x: var.assign(x), args=(value,))
    assert copies(v) == [1.0, 2.0]
    s.extended.update(v, lambda var, x: var.assign_add(x), args=(value,))
    assert copies(v) == [2.0, 4.0]
    s.extended.update(v, lambda var, x: var.assign_sub(x), args=(value,))
    assert copies(v) == [1.0, 2.0]
    s.extended.update(v, lambda var, x: var.assign_add(var.value() + var.read_value()), args=(value,))
    assert copies(v) == [3.0, 6.0]


def test_strategy_extended_update_results_and_contexts():
    """distribute_utils.update_regroup: group=True gives a Mirrored of each copy's result (the
    updated values, as tensors), group=False a tuple per replica. value_container(copy) inside fn is
    the variable (StrategyExtended.value_container). In replica context update goes through a
    merge_call (StrategyExtended._replica_ctx_update): fn runs once per copy, not once per replica per
    copy, with the replicas' values merged."""
    s = strategy_of(2)
    with s.scope():
        v = md.Variable(0.0)
    containers = []

    def add(var, x):
        containers.append(s.extended.value_container(var))
        return var.assign_add(x)

    grouped = s.extended.update(v, add, args=(md.PerReplica([torch.tensor(1.0), torch.tensor(2.0)]),))
    assert isinstance(grouped, md.Mirrored) and [t.item() for t in grouped.values] == [1.0, 2.0]
    assert containers == [v, v] and s.extended.value_container(torch.ones(1)).tolist() == [1.0]
    ungrouped = s.extended.update(v, lambda var: var.read_value() * 10, group=False)
    assert isinstance(ungrouped, tuple) and [t.item() for t in ungrouped] == [10.0, 20.0]
    calls = []

    def in_replica():
        return s.extended.update(v, lambda var, x: calls.append(x) or var.assign(x),
                                 args=(torch.tensor(5.0 + replica_id()),))

    out = s.run(in_replica)
    assert copies(v) == [5.0, 6.0] and len(calls) == 2
    assert [t.item() for t in s.experimental_local_results(out)] == [5.0, 6.0]


def test_colocate_vars_with():
    """StrategyExtendedV2.colocate_vars_with: inside the scope, with a variable of this strategy, a
    block whose variables are created as usual (every variable here is on all replicas' devices);
    outside the scope RuntimeError ('Need to be inside "with strategy.scope()"'); with a variable not
    created in this strategy's scope ValueError (validate_colocate_distributed_variable)."""
    s, other = strategy_of(2), strategy_of(2)
    with s.scope():
        v = md.Variable(1.0)
        with s.extended.colocate_vars_with(v):
            w = md.Variable(2.0)
        assert isinstance(w, md.MirroredVariable) and [t.device for t in w.values] == [t.device for t in v.values]
        with pytest.raises(ValueError, match="colocate_vars_with"):
            s.extended.colocate_vars_with(torch.ones(1))
    with other.scope():
        foreign = md.Variable(1.0)
    with s.scope(), pytest.raises(ValueError, match="colocate_vars_with"):
        s.extended.colocate_vars_with(foreign)
    with pytest.raises(RuntimeError, match="strategy.scope"):
        s.extended.colocate_vars_with(v)
