"""Conformance: distributed values, run's argument/result handling, values from a function.

Sources (tensorflow/python/distribute/): values_test.py (DistributedValuesTest:
testMakeDistributedValueFromTensor / FromTuple / FromNestedStructure, experimental_local_results),
distribute_utils.py (regroup, select_replica), mirrored_strategy_test.py (testPassPerReplica,
testRunRegroupError), distribute_lib.py (experimental_distribute_values_from_function, ValueContext).
"""
from __future__ import annotations

import collections

import pytest
import torch

import mirrored.distribute as md
from _replicas import replica_id, strategy_of  # tests/_replicas.py


def test_values_from_function_gets_value_context():
    """distribute_lib.ValueContext: value_fn sees replica_id_in_sync_group 0..n-1 and num_replicas_in_sync."""
    s = strategy_of(3)
    seen = []
    v = s.experimental_distribute_values_from_function(
        lambda ctx: seen.append((ctx.replica_id_in_sync_group, ctx.num_replicas_in_sync)) or
        torch.tensor(float(ctx.replica_id_in_sync_group)))
    assert seen == [(0, 3), (1, 3), (2, 3)]
    assert isinstance(v, md.PerReplica)
    assert [t.item() for t in s.experimental_local_results(v)] == [0.0, 1.0, 2.0]


def test_values_from_function_same_tuple_is_wrapped_per_leaf():
    """values_test.testMakeDistributedValueFromTuple: the SAME tuple (1., 2., 3.) from every replica
    becomes a tuple of PerReplica; gathered it is ([1, 1], [2, 2], [3, 3]) on two replicas."""
    s = strategy_of(2)
    tuple_value = (1.0, 2.0, 3.0)
    v = s.experimental_distribute_values_from_function(lambda _: tuple_value)
    assert isinstance(v, tuple) and all(isinstance(x, md.PerReplica) for x in v)
    gathered = tuple(list(s.experimental_local_results(x)) for x in v)
    assert gathered == ([1.0, 1.0], [2.0, 2.0], [3.0, 3.0])
    ones = s.experimental_distribute_values_from_function(lambda _: 1)
    assert isinstance(ones, md.PerReplica)
    assert s.reduce(md.ReduceOp.SUM, s.run(lambda x: torch.tensor(x), args=(ones,))).item() == 2


def test_values_from_function_nested_structure():
    """values_test.testMakeDistributedValueFromNestedStructure: a namedtuple / dict structure keeps its
    shape with PerReplica leaves."""
    s = strategy_of(2)
    Point = collections.namedtuple("Point", "x y")
    v = s.experimental_distribute_values_from_function(
        lambda ctx: {"p": Point(torch.tensor(ctx.replica_id_in_sync_group), torch.tensor(5)), "k": "same"})
    assert isinstance(v["p"], Point)
    assert [t.item() for t in v["p"].x.values] == [0, 1]
    assert [t.item() for t in v["p"].y.values] == [5, 5]
    assert v["k"].values == ("same", "same")


def test_experimental_local_results():
    """values_test / distribute_lib: local results of a PerReplica are its values in replica order; of
    a plain value a 1-tuple; of a mirrored variable its copies."""
    s = strategy_of(3)
    pr = md.PerReplica([torch.tensor(i) for i in range(3)])
    assert s.experimental_local_results(pr) == pr.values
    x = torch.tensor(1.0)
    assert s.experimental_local_results(x) == (x,)
    with s.scope():
        v = md.Variable(2.0)
    assert s.experimental_local_results(v) == v.values and len(v.values) == 3


def test_run_unwraps_per_replica_args():
    """mirrored_strategy_test.testPassPerReplica: a PerReplica((5., 3.)) argument gives replica r its
    component; a plain argument goes to every replica as is (factor * 1.25 -> (6.25, 3.75))."""
    s = strategy_of(2)
    factors = md.PerReplica((5.0, 3.0))
    out = s.run(lambda f, w: f * w, args=(factors, 1.25))
    assert s.experimental_local_results(out) == (6.25, 3.75)
    out = s.run(lambda *, f: f + 1, kwargs={"f": factors})
    assert s.experimental_local_results(out) == (6.0, 4.0)


def test_run_nested_per_replica_args():
    """select_replica walks nested structures: a dict holding PerReplica values is unwrapped leaf by leaf."""
    s = strategy_of(2)
    batch = {"x": md.PerReplica((torch.ones(2), torch.zeros(3))), "meta": ("tag", md.PerReplica((0, 1)))}
    out = s.run(lambda b: (b["x"].numel(), b["meta"][0], b["meta"][1]), args=(batch,))
    sizes, tag, ids = out
    assert sizes.values == (2, 3) and tag == "tag" and ids.values == (0, 1)


def test_run_result_regroups_structures():
    """distribute_utils.regroup: a tuple / dict result becomes the same structure of PerReplica."""
    s = strategy_of(2)
    out = s.run(lambda: {"loss": torch.tensor(float(replica_id())), "n": (torch.tensor(replica_id()),)})
    assert isinstance(out, dict) and isinstance(out["loss"], md.PerReplica)
    assert [t.item() for t in out["loss"].values] == [0.0, 1.0]
    assert isinstance(out["n"], tuple) and [t.item() for t in out["n"][0].values] == [0, 1]


def test_run_returning_the_same_object_returns_it():
    """regroup (same_id): a value every replica returns as the same object, such as a mirrored
    variable, comes back as that object, not wrapped."""
    s = strategy_of(2)
    with s.scope():
        v = md.Variable(1.0)
    assert s.run(lambda: v) is v
    assert s.run(lambda: None) is None


def test_run_results_of_different_lengths():
    """mirrored_strategy_test.testRunRegroupError: lists of different lengths per replica make TF's
    regroup fail (an assert there). We raise a ValueError naming both structures (issue 17)."""
    s = strategy_of(2)
    with pytest.raises(ValueError, match=r"replica 0 returned list\(\) but replica 1 returned list\(int\)"):
        s.run(lambda: list(range(replica_id())))


def test_one_replica_run_returns_plain_values():
    """With one replica, run returns plain values (TF: regroup of a single value is the value)."""
    s = strategy_of(1)
    out = s.run(lambda: (torch.tensor(1.0), {"a": 2}))
    assert isinstance(out[0], torch.Tensor) and out[1] == {"a": 2}
    assert s.experimental_local_results(out[0]) == (out[0],)


def test_distributed_values_truth_value_is_ambiguous():
    """A PerReplica is not a bool (TF's DistributedValues has no __bool__ that picks a replica)."""
    with pytest.raises(TypeError, match="ambiguous"):
        bool(md.PerReplica((True, False)))
    assert "PerReplica" in repr(md.PerReplica((1, 2)))


def test_experimental_local_results_of_a_nest_is_one_structure_per_replica():
    """StrategyExtendedV2._local_results (measured on TF 2.21, 2 replicas): for a nest (dict, tuple,
    namedtuple, list) holding PerReplica values, one structure per replica, each PerReplica replaced
    by that replica's value and plain leaves repeated; a mirrored variable in it gives its copy."""
    s = strategy_of(2)
    Pair = collections.namedtuple("Pair", "x y")
    with s.scope():
        v = md.Variable(1.0)
    out = s.run(lambda: {"id": torch.tensor(replica_id()), "pair": Pair(torch.tensor(10 * replica_id()), "tag")})
    first, second = s.experimental_local_results(out)
    assert first["id"].item() == 0 and second["id"].item() == 1
    assert isinstance(first["pair"], Pair) and first["pair"].y == "tag" == second["pair"].y
    assert first["pair"].x.item() == 0 and second["pair"].x.item() == 10
    a, b = s.experimental_local_results((v, [out["id"]]))
    assert a[0] is v.values[0] and b[0] is v.values[1] and b[1][0].item() == 1
    assert strategy_of(1).experimental_local_results({"k": 1}) == ({"k": 1},)


def test_experimental_local_results_of_mirrored_modules_and_optimizers():
    """As for a MirroredVariable (its copies), experimental_local_results of a mirrored module or
    optimizer gives the per-replica copies, so `first, second = ...(mnet)` unpacks them."""
    s = strategy_of(2)
    with s.scope():
        mnet = s.mirror(torch.nn.Linear(2, 1))
        opt = s.mirror_optimizer(torch.optim.SGD, mnet, lr=0.1)
    first, second = s.experimental_local_results(mnet)
    assert first is mnet.replicas[0] and second is mnet.replicas[1] and first is not second
    assert s.experimental_local_results(opt) == opt.replicas and len(opt.replicas) == 2
    assert s.experimental_local_results({"net": mnet})[1]["net"] is mnet.replicas[1]
