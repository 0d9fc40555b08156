"""Conformance: strategy.reduce / gather / all_reduce, as tf.distribute's own tests check them.

Sources (tensorflow/python/distribute/): mirrored_strategy_test.py (testReduceToCpu, reduce_axis_helper,
testAllReduceSum/Mean), strategy_common_test.py (ReduceTest.testBasic/testAxis,
ReplicaCtxAllReduceTest), distribute_lib_test.py (testReduce*Axis, testReductions_acceptStringOps),
cross_device_ops_lib.reduce_non_distributed_value, collective_all_reduce_strategy._reduce_to (a nest
reduced leaf by leaf, map_structure), StrategyExtendedV2.batch_reduce_to. Expected values are worked
out here with numpy or by hand, never with our own code.
"""
from __future__ import annotations

import collections

import numpy as np
import pytest
import torch

import mirrored.distribute as md
from _replicas import TIMEOUT_S, replica_id, strategy_of  # tests/_replicas.py


def test_reduce_sum_of_replica_ids():
    """mirrored_strategy_test.testReduceToCpu: SUM of each replica's id is 0 + 1 + ... + (n-1)."""
    for n in (1, 2, 3):
        s = strategy_of(n)
        with s.scope():
            result = s.run(lambda: torch.tensor(replica_id()))
            assert s.reduce(md.ReduceOp.SUM, result, axis=None).item() == sum(range(n)), n


@pytest.mark.parametrize("n", [2, 3])
def test_reduce_axis_with_uneven_per_replica_values(n):
    """mirrored_strategy_test.reduce_axis_helper: replica r returns [r] * (r + 1), so parts differ in
    length. SUM over axis 0 is sum r(r+1); MEAN over axis 0 divides by the TOTAL count sum (r+1),
    not by the number of replicas (each example weighs the same). float32 and int32 alike."""
    s = strategy_of(n)
    for dtype in (torch.float32, torch.int32):
        with s.scope():
            result = s.run(lambda: torch.tensor([replica_id()] * (replica_id() + 1), dtype=dtype))
            expected_sum = sum(r * (r + 1) for r in range(n))
            got_sum = s.reduce(md.ReduceOp.SUM, result, axis=0)
            assert float(got_sum) == pytest.approx(expected_sum, abs=1e-5), dtype
            got_mean = s.reduce(md.ReduceOp.MEAN, result, axis=0)
            assert float(got_mean) == pytest.approx(expected_sum / sum(r + 1 for r in range(n)), abs=1e-5), dtype


def test_reduce_axis_of_identical_vectors():
    """strategy_common_test.ReduceTest.testAxis: every replica returns [1., 2.]: MEAN over axis 0 is
    1.5 and SUM over axis 0 is 3 * num_replicas."""
    for n in (1, 2, 3):
        s = strategy_of(n)
        x = s.run(lambda: torch.tensor([1.0, 2.0]))
        assert s.reduce(md.ReduceOp.MEAN, x, axis=0).item() == 1.5
        assert s.reduce(md.ReduceOp.SUM, x, axis=0).item() == 3.0 * n


def test_reduce_values_from_function_in_and_out_of_scope():
    """strategy_common_test.ReduceTest.testBasic: ones from experimental_distribute_values_from_function
    SUM to num_replicas, both inside and outside the strategy's scope."""
    for n in (1, 2, 3):
        s = strategy_of(n)
        v = s.experimental_distribute_values_from_function(lambda _: torch.ones((), dtype=torch.float32))
        with s.scope():
            assert s.reduce(md.ReduceOp.SUM, v, axis=None).item() == 1.0 * n
        assert s.reduce(md.ReduceOp.SUM, v, axis=None).item() == 1.0 * n


def test_reduce_plain_tensor_mean_returns_it_and_sum_raises():
    """cross_device_ops.reduce_non_distributed_value: a value that is not a DistributedValues is taken
    to be the same on every replica. MEAN returns it; SUM over more than one replica is refused with
    ValueError (summing identical copies is not clearly defined); a plain 0 reduces to 0."""
    s = strategy_of(2)
    x = torch.tensor([1.0, 2.0])
    assert torch.equal(s.reduce(md.ReduceOp.MEAN, x), x)
    with pytest.raises(ValueError, match="PerReplica"):
        s.reduce(md.ReduceOp.SUM, x)
    assert s.reduce(md.ReduceOp.SUM, 0) == 0


def test_reduce_plain_tensor_on_one_replica():
    """distribute_lib_test.testReduce/testReduceMeanAxis/testReduceSumAxis on one-replica strategies
    (OneDeviceStrategy, the default strategy, a one-device MirroredStrategy): axis=None gives the
    tensor back (SUM and MEAN alike); axis=0 and axis=(0, 1) reduce it."""
    for s in (md.OneDeviceStrategy("cpu:0"), md.get_strategy(), strategy_of(1)):
        x = torch.tensor([[1.0, 2.0], [3.0, 4.0]])
        for op in (md.ReduceOp.SUM, md.ReduceOp.MEAN):
            assert torch.equal(s.reduce(op, x, axis=None), x)
        assert s.reduce(md.ReduceOp.MEAN, x, axis=0).tolist() == [2.0, 3.0]
        assert s.reduce(md.ReduceOp.MEAN, x, axis=(0, 1)).item() == 2.5
        assert s.reduce(md.ReduceOp.SUM, x, axis=0).tolist() == [4.0, 6.0]
        assert s.reduce(md.ReduceOp.SUM, x, axis=(0, 1)).item() == 10.0


def test_reduce_tuple_axis_across_replicas():
    """MEAN over several axes divides by the product of their sizes, summed over replicas (TF's
    mean_reduce_helper); replica r holds a (r+1) x 2 block of r's."""
    s = strategy_of(3)
    v = s.run(lambda: torch.full((replica_id() + 1, 2), float(replica_id())))
    blocks = [np.full((r + 1, 2), float(r)) for r in range(3)]
    want = np.concatenate(blocks).mean()
    assert s.reduce(md.ReduceOp.MEAN, v, axis=(0, 1)).item() == pytest.approx(want)
    assert s.reduce(md.ReduceOp.SUM, v, axis=[0, 1]).item() == pytest.approx(np.concatenate(blocks).sum())


def test_reductions_accept_string_ops():
    """distribute_lib_test.testReductions_acceptStringOps: "sum"/"mean" in either case."""
    s = strategy_of(2)
    v = s.run(lambda: torch.tensor(1.0))
    for op in ("mean", "MEAN", "sum", "SUM"):
        want = 2.0 if op.upper() == "SUM" else 1.0
        assert s.reduce(op, v).item() == want, op
        assert md.get_strategy().reduce(op, torch.tensor(1.0)).item() == 1.0, op


def test_reduce_mean_of_mirrored_returns_the_value():
    """MirroredExtended._reduce_to: MEAN of a Mirrored value is the value itself (no arithmetic: 0.1
    summed three times and divided would not be 0.1); here a copy of it, which the caller may modify."""
    s = strategy_of(3)
    m = md.Mirrored([torch.tensor(0.1)] * 3)
    got = s.reduce(md.ReduceOp.MEAN, m)
    assert got.item() == m.values[0].item() and got is not m.values[0]


def test_reduce_in_replica_context_raises():
    """distribute_lib: reduce needs cross-replica context; TF raises RuntimeError inside run."""
    s = strategy_of(2)

    def fn():
        with pytest.raises(RuntimeError, match="cross-replica context"):
            s.reduce(md.ReduceOp.SUM, torch.tensor(1.0))
        return True

    assert s.run(fn) is True


def test_gather_concatenates_uneven_parts_along_axis():
    """strategy.gather (strategy_gather_test): per-replica tensors of different lengths on axis 0
    concatenate in replica order; axis=1 concatenates columns."""
    s = strategy_of(3)
    v = s.run(lambda: torch.arange(replica_id() + 1) + 10 * replica_id())
    assert s.gather(v, axis=0).tolist() == [0, 10, 11, 20, 21, 22]
    w = s.run(lambda: torch.full((2, 1), replica_id()))
    assert s.gather(w, axis=1).tolist() == [[0, 1, 2], [0, 1, 2]]


def test_gather_of_a_plain_value_raises():
    """TF's MirroredExtended._gather_to_implementation returns a non-distributed value unchanged, so a
    caller gets a tensor num_replicas times smaller than the gathered one it expected, silently (a TF
    comment there asks whether it should raise). We raise instead; on one replica the value is returned."""
    s = strategy_of(2)
    with pytest.raises(ValueError, match="PerReplica"):
        s.gather(torch.ones(2), axis=0)
    x = torch.ones(2)
    assert strategy_of(1).gather(x, axis=0) is x


def test_gather_in_replica_context_raises():
    """distribute_lib: "gather method requires cross-replica context"."""
    s = strategy_of(2)

    def fn():
        with pytest.raises(RuntimeError, match="cross-replica context"):
            s.gather(torch.ones(1), axis=0)

    s.run(fn)


def test_replica_context_all_reduce_sum_and_mean():
    """ReplicaCtxAllReduceTest.testBasic / strategy_test_lib._test_all_reduce_sum/mean: 1.0 on every
    replica all-reduces to n (SUM) and 1.0 (MEAN), and every replica gets the same result."""

    def fn():
        ctx = md.get_replica_context()
        return ctx.all_reduce(md.ReduceOp.SUM, torch.tensor(1.0)), ctx.all_reduce("mean", torch.tensor(1.0))

    for n in (1, 2, 3):
        s = strategy_of(n)
        sums, means = s.run(fn)
        assert [t.item() for t in s.experimental_local_results(sums)] == [float(n)] * n
        assert [t.item() for t in s.experimental_local_results(means)] == [1.0] * n


def test_replica_context_all_reduce_nested_structure():
    """ReplicaCtxAllReduceTest.testNestedInput: a nested value reduces leaf by leaf and keeps its
    structure (tuple of (1, 2) -> (n, 2n)); here with a dict and mixed dtypes too."""
    s = strategy_of(3)

    def fn():
        r = replica_id()
        value = {"pair": (torch.tensor(1.0), torch.tensor(2.0)), "ids": torch.tensor([r, 10 * r])}
        return md.get_replica_context().all_reduce(md.ReduceOp.SUM, value)

    out = s.run(fn)
    for r in range(3):
        got = {"pair": tuple(x.values[r] for x in out["pair"]), "ids": out["ids"].values[r]}
        assert [t.item() for t in got["pair"]] == [3.0, 6.0]
        assert got["ids"].tolist() == [3, 30]
        assert got["ids"].dtype == torch.int64


def test_all_reduce_results_are_bitwise_equal_across_replicas():
    """The reduced value is identical on every replica (a MirroredVariable update relies on it), even
    for float sums whose order matters; large enough to take the sliced in-place path."""
    s = strategy_of(3)
    torch.manual_seed(0)
    data = [torch.randn(40_000) for _ in range(3)]

    def fn():
        return md.get_replica_context().all_reduce(md.ReduceOp.SUM, data[replica_id()].clone())

    out = s.experimental_local_results(s.run(fn))
    want = data[0].double() + data[1].double() + data[2].double()
    for t in out:
        assert torch.equal(t, out[0])
        torch.testing.assert_close(t.double(), want, rtol=1e-6, atol=1e-6)


def test_integer_mean_is_float64_everywhere():
    """Measured on TF 2.21 with 3 replicas holding int32 1, 2 and 4: strategy.reduce(MEAN) with and
    without an axis and ctx.all_reduce(MEAN) all give float64 2.3333333333333335 (true division),
    never a truncated 2."""
    s = strategy_of(3)
    values = (1, 2, 4)
    scalars = s.run(lambda: torch.tensor(values[replica_id()], dtype=torch.int32))
    vectors = s.run(lambda: torch.tensor([values[replica_id()]], dtype=torch.int32))
    results = [s.reduce("mean", scalars), s.reduce("mean", vectors, axis=0)]
    results += s.experimental_local_results(s.run(
        lambda: md.get_replica_context().all_reduce("mean", torch.tensor(values[replica_id()], dtype=torch.int32))))
    for t in results:
        assert t.dtype == torch.float64 and t.item() == 7 / 3
    assert s.reduce("sum", scalars).dtype == torch.int32  # SUM keeps the dtype


def test_mixed_integer_and_float_mean_all_reduce():
    """A MEAN all-reduce of a structure with integer and float leaves: integers become float64
    means, floats keep their dtype and get the bits of a plain float MEAN."""
    s = strategy_of(3)
    floats = [torch.tensor([0.1, 0.7]) * (r + 1) for r in range(3)]

    def fn():
        r = replica_id()
        ctx = md.get_replica_context()
        return ctx.all_reduce("mean", {"i": torch.tensor(r), "f": floats[r]}), ctx.all_reduce("mean", floats[r])

    mixed, plain = s.run(fn)
    for r in range(3):
        assert mixed["i"].values[r].dtype == torch.float64 and mixed["i"].values[r].item() == 1.0
        assert torch.equal(mixed["f"].values[r], plain.values[r])
    weights = [torch.tensor([1.0, 2.0], requires_grad=True) for _ in range(3)]

    def differentiated():  # the float leaves under autograd: d mean / d w_r = 1/3 from every replica's sum
        r = replica_id()
        out = md.get_replica_context().all_reduce("mean", {"w": weights[r], "i": torch.tensor(r)})
        out["w"].sum().backward()

    s.run(differentiated)
    for w in weights:
        torch.testing.assert_close(w.grad, torch.ones(2), rtol=1e-6, atol=1e-7)


def test_one_replica_reduces_nothing_and_keeps_integers():
    """Measured on TF 2.21 with one replica: MEAN of int32 7 (strategy.reduce, ctx.all_reduce, a
    cross-device op) is int32 7 - nothing is reduced; with an axis it is a float64 mean."""
    s = strategy_of(1)
    seven = s.run(lambda: torch.tensor(7, dtype=torch.int32))
    assert s.reduce("mean", seven).dtype == torch.int32 and s.reduce("mean", seven).item() == 7
    got = s.run(lambda: md.get_replica_context().all_reduce("mean", torch.tensor(7, dtype=torch.int32)))
    assert got.dtype == torch.int32 and got.item() == 7
    out = md.ReductionToOneDevice().reduce("mean", md.PerReplica([torch.tensor([1, -4], dtype=torch.int32)]))
    assert out.values[0].dtype == torch.int32 and out.values[0].tolist() == [1, -4]
    vector = s.run(lambda: torch.tensor([1, 2, 4], dtype=torch.int32))
    assert s.reduce("mean", vector, axis=0).dtype == torch.float64 and s.reduce("mean", vector, axis=0).item() == 7 / 3


def test_dicts_flatten_by_sorted_key_as_tf_nest_does():
    """tf.nest sorts dict keys, so replicas that build the same dict in different orders reduce key
    against key (measured on TF 2.21: every replica gets {"a": 60, "b": 3}); run() regroups such
    results into a dict of PerReplica values, keeping the first replica's key order."""
    s = strategy_of(3)

    def fn():
        r = replica_id()
        a, b = torch.tensor(10.0 * (r + 1)), torch.tensor(1.0)
        return md.get_replica_context().all_reduce("sum", {"a": a, "b": b} if r == 0 else {"b": b, "a": a})

    out = s.run(fn)
    assert list(out) == ["a", "b"]
    assert [t.item() for t in out["a"].values] == [60.0] * 3
    assert [t.item() for t in out["b"].values] == [3.0] * 3
    regrouped = s.run(lambda: {"x": replica_id(), "y": 0} if replica_id() else {"y": 0, "x": 0})
    assert isinstance(regrouped, dict) and list(regrouped) == ["y", "x"]
    assert regrouped["y"] == 0 and regrouped["x"].values == (0, 1, 2)


def test_results_never_alias_the_inputs():
    """TF's results are new tensors (immutable there); ours are too, on one replica as on three, so
    a caller may modify a result in place without touching what it passed in."""
    for n in (1, 3):
        s = strategy_of(n)
        inputs = [torch.ones(2) for _ in range(n)]
        out = s.experimental_local_results(s.run(lambda: md.get_replica_context().all_reduce("sum", inputs[replica_id()])))
        for t in out:
            t.add_(5)
        assert all(x.tolist() == [1.0, 1.0] for x in inputs), n
        parts = md.PerReplica(inputs)
        total = s.reduce("sum", parts if n > 1 else md.PerReplica([inputs[0]]))
        assert all(total is not x for x in inputs) and total.data_ptr() not in {x.data_ptr() for x in inputs}
        for op, value in (("mean", inputs[0]), ("mean", md.Mirrored(inputs))):  # plain and mirrored values
            assert s.reduce(op, value).data_ptr() != inputs[0].data_ptr()
        if n == 1:
            assert s.reduce("sum", inputs[0]).data_ptr() != inputs[0].data_ptr()


def test_reduce_sum_along_axis_keeps_int32():
    """distribute_lib.Strategy.reduce with an axis sums each part with reduce_sum, which keeps the
    dtype: int32 parts reduce to an int32 (measured on TF 2.21; torch's sum would widen to int64), and
    so do uint8 and float16 ones. Parts [1, 2] and [3, 4, 5] sum to 15; MEAN over the axis is the
    float64 3.0, as test_integer_mean_is_float64_everywhere."""
    s = strategy_of(2)
    ints = s.run(lambda: torch.tensor([[1, 2], [3, 4, 5]][replica_id()], dtype=torch.int32))
    total = s.reduce("sum", ints, axis=0)
    assert total.dtype == torch.int32 and total.item() == 15
    mean = s.reduce("mean", ints, axis=0)
    assert mean.dtype == torch.float64 and mean.item() == 3.0
    uint8 = s.run(lambda: torch.tensor([[1, 2], [3]][replica_id()], dtype=torch.uint8))
    assert s.reduce("sum", uint8, axis=0).dtype == torch.uint8
    halves = s.run(lambda: torch.tensor([0.5, 0.25], dtype=torch.float16))
    assert s.reduce("sum", halves, axis=0).dtype == torch.float16 and s.reduce("sum", halves, axis=0).item() == 1.5


def test_reduce_nested_structure_leaf_by_leaf():
    """Measured on TF 2.21 with 2 replicas: s.reduce("SUM", s.run(lambda: {"a": tf.constant(1.0),
    "b": (tf.constant(2.0),)}), axis=None) gives {"a": 2.0, "b": (4.0,)}. (With Python floats, as the
    issue wrote it, TF 2.21 refuses, eager and in a tf.function alike: every replica returns the same
    float object, so run returns the plain dict and "A non-DistributedValues value 1.0 cannot be
    reduced with the given reduce op ReduceOp.SUM"; so do we, below.) Any nest (dict, list, tuple,
    namedtuple) of PerReplica values, plain tensors (MEAN), Mirrored values and mirrored variables
    reduces leaf by leaf and keeps its structure; with an axis each leaf reduces along it."""
    s = strategy_of(2)
    Pair = collections.namedtuple("Pair", "x y")
    out = s.reduce("SUM", s.run(lambda: {"a": torch.tensor(1.0), "b": (torch.tensor(2.0),)}), axis=None)
    assert list(out) == ["a", "b"] and isinstance(out["b"], tuple)
    assert out["a"].item() == 2.0 and out["b"][0].item() == 4.0
    with pytest.raises(ValueError, match="not a PerReplica"):
        s.reduce("SUM", s.run(lambda: {"a": 1.0, "b": (2.0,)}), axis=None)
    with s.scope():
        v = md.Variable(3.0)
    value = s.run(lambda: Pair(torch.tensor([1.0 + replica_id(), 5.0]), [torch.tensor(replica_id()), v]))
    mean = s.reduce("mean", value)
    assert isinstance(mean, Pair) and isinstance(mean.y, list)
    assert mean.x.tolist() == [1.5, 5.0] and mean.y[0].item() == 0.5 and mean.y[1].item() == 3.0
    rows = s.run(lambda: {"n": torch.ones(replica_id() + 1, 2), "m": torch.arange(3) * (replica_id() + 1)})
    along = s.reduce("sum", rows, axis=0)
    assert along["n"].tolist() == [3.0, 3.0] and along["m"].item() == 9
    with pytest.raises(ValueError, match="leaf 1 of the nest"):  # a plain value where SUM needs parts
        s.reduce("sum", {"a": s.run(lambda: torch.ones(1)), "b": torch.ones(1)})


def test_reduce_of_a_nest_is_one_packed_cross_device_call():
    """All leaves that need a cross-replica sum travel in one batch_reduce (packed into buckets), not
    one call per leaf; the results equal leaf-by-leaf reductions."""
    calls = []

    class Counting(md.ReductionToOneDevice):
        def batch_reduce(self, reduce_op, value_destination_pairs):
            calls.append(len(value_destination_pairs))
            return super().batch_reduce(reduce_op, value_destination_pairs)

    s = md.MirroredStrategy(devices=["cpu:0", "cpu:1"], cross_device_ops=Counting(), timeout_s=TIMEOUT_S)
    torch.manual_seed(0)
    data = [[torch.randn(3), torch.randint(0, 9, (2,)), torch.randn(4, 2, dtype=torch.float64)] for _ in range(2)]
    nest = s.run(lambda: {"f": data[replica_id()][0], "i": [data[replica_id()][1], (data[replica_id()][2],)]})
    got = s.reduce("sum", nest)
    assert calls == [3]
    torch.testing.assert_close(got["f"], data[0][0] + data[1][0], rtol=0, atol=1e-6)
    assert torch.equal(got["i"][0], data[0][1] + data[1][1])
    torch.testing.assert_close(got["i"][1][0], data[0][2] + data[1][2], rtol=0, atol=1e-12)


def test_gather_nested_structure():
    """gather of a nest gathers each leaf along the axis (replica order), keeping the structure."""
    s = strategy_of(2)
    out = s.gather(s.run(lambda: {"a": torch.full((replica_id() + 1,), replica_id()),
                                  "b": (torch.tensor([[replica_id()]]),)}), axis=0)
    assert out["a"].tolist() == [0, 1, 1] and out["b"][0].tolist() == [[0], [1]]
