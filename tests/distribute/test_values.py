"""values.py: the DistributedValues containers, the nest helpers, select_replica and regroup."""
from __future__ import annotations

import collections

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from mirrored.distribute import values as v

Point = collections.namedtuple("Point", "x y")

# Nested structures of int leaves, the shapes tf.nest walks: lists, tuples, dicts, namedtuples.
leaves = st.integers(-5, 5)
nested = st.recursive(
    leaves,
    lambda children: st.one_of(
        st.lists(children, max_size=3),
        st.lists(children, max_size=3).map(tuple),
        st.dictionaries(st.sampled_from("abcd"), children, max_size=3),
        st.tuples(children, children).map(lambda t: Point(*t)),
    ),
    max_leaves=12,
)


@settings(max_examples=60, deadline=None)
@given(nested)
def test_flatten_pack_round_trip(structure):
    flat = v.flatten(structure)
    assert v.pack_sequence_as(structure, flat) == structure
    doubled = v.map_structure(lambda x: 2 * x, structure)
    assert v.flatten(doubled) == [2 * x for x in flat]
    assert v.map_structure(lambda a, b: a - b, doubled, structure) == structure


def test_nest_keeps_container_types_and_dict_order():
    """Dicts flatten by sorted key, as tf.nest does, and rebuild in their own key order."""
    s = {"b": Point(1, [2, (3,)]), "a": 4}
    out = v.map_structure(lambda x: x * 10, s)
    assert list(out) == ["b", "a"] and isinstance(out["b"], Point) and isinstance(out["b"].y[1], tuple)
    assert v.flatten(s) == [4, 1, 2, 3]
    assert v.pack_sequence_as(s, [40, 10, 20, 30]) == {"b": Point(10, [20, (30,)]), "a": 40}
    assert v.flatten({2: "two", "1": "one", 1: "uno"}) == v.flatten({1: "uno", "1": "one", 2: "two"})


def test_map_structure_mismatch_names_both_shapes():
    with pytest.raises(ValueError, match="list of length 2 vs list of length 3"):
        v.map_structure(lambda a, b: a, [1, 2], [1, 2, 3])
    with pytest.raises(ValueError, match="dict with keys"):
        v.map_structure(lambda a, b: a, {"a": 1}, {"b": 1})


def test_pack_sequence_as_too_many_values():
    with pytest.raises(ValueError, match="more values"):
        v.pack_sequence_as([1, 2], [1, 2, 3])


def test_distributed_values_basics():
    pr = v.PerReplica([1, 2])
    assert pr.values == (1, 2) and isinstance(pr, v.DistributedValues)
    assert isinstance(v.Mirrored((3,)), v.DistributedValues)
    with pytest.raises(ValueError, match="at least one value"):
        v.PerReplica([])
    with pytest.raises(TypeError, match="ambiguous"):
        if v.Mirrored([True]):
            pass
    assert repr(pr) == "PerReplica:{\n  0: 1,\n  1: 2\n}"


def test_select_replica():
    s = {"x": v.PerReplica(("a0", "a1")), "y": [v.Mirrored((1, 1)), "same"], "z": Point(v.PerReplica((0, 1)), 9)}
    assert v.select_replica(1, s) == {"x": "a1", "y": [1, "same"], "z": Point(1, 9)}
    assert v.select_replica(0, v.PerReplica((5, 6))) == 5
    assert v.select_replica(1, 7) == 7


def test_regroup_same_object_is_returned_unwrapped():
    obj = object()
    assert v.regroup([obj, obj, obj]) is obj
    wrapped = v.regroup([obj, obj], always_wrap=True)
    assert isinstance(wrapped, v.PerReplica) and wrapped.values == (obj, obj)


def test_regroup_nested_structures_leafwise():
    a = {"loss": torch.tensor(1.0), "ids": (1, 2)}
    b = {"loss": torch.tensor(2.0), "ids": (1, 3)}
    out = v.regroup([a, b])
    assert isinstance(out["loss"], v.PerReplica)
    assert out["ids"][0] == 1  # identical small ints are the same object: left unwrapped
    assert isinstance(out["ids"][1], v.PerReplica) and out["ids"][1].values == (2, 3)


def test_regroup_mismatched_structures_wrap_whole():
    out = v.regroup([[1], [1, 2]])
    assert isinstance(out, v.PerReplica) and out.values == ([1], [1, 2])
    out = v.regroup([{"a": 1, "b": 2}, {"b": 3, "a": 1}])  # same keys, other order: by key, as TF does
    assert list(out) == ["a", "b"] and out["a"] == 1 and out["b"].values == (2, 3)
    out = v.regroup([{"a": 1}, {"b": 1}])  # other keys: kept whole
    assert isinstance(out, v.PerReplica)


def test_regroup_with_mirrored_wrap():
    ones, zeros = [torch.ones(1), torch.ones(1)], [torch.zeros(1), torch.zeros(1)]
    out = v.regroup([(ones[0], zeros[0]), (ones[1], zeros[1])], wrap=v.Mirrored)
    assert type(out) is tuple and len(out) == 2 and all(isinstance(x, v.Mirrored) for x in out)
    for got, want in zip(out, (ones, zeros)):  # each position's values, in replica order, not copied
        assert len(got.values) == 2 and all(a is b for a, b in zip(got.values, want))


def test_reduce_op_members():
    assert v.ReduceOp["SUM"] is v.ReduceOp.SUM and v.ReduceOp("MEAN") is v.ReduceOp.MEAN
    assert len(v.ReduceOp) == 2


def test_a_list_of_strings_is_one_leaf():
    """mr.data batches str leaves into lists of str; like a string tensor in tf.nest, such a list is
    one leaf, so a distributed batch splits it along with the tensors."""
    batch = {"name": ["a.jpg", "b.jpg"], "ids": [1, 2], "empty": []}
    assert v.flatten(batch) == [1, 2, ["a.jpg", "b.jpg"]]  # keys sorted: empty, ids, name
    assert v.map_structure(len, {"name": ["a", b"b"]}) == {"name": 2}
    assert v.flatten({"rows": [["a", "b"], ["c", "d"]], "ragged": [["a"], ["b", "c"]]}) == [["a"], ["b", "c"], [["a", "b"], ["c", "d"]]]


def test_is_nested():
    Point = collections.namedtuple("Point", "x y")
    for nest in ((1,), [1], {"a": 1}, Point(1, 2), ()):
        assert v.is_nested(nest), nest
    for leaf in (1, torch.ones(2), "s", ["a", "b"], v.PerReplica([1, 2])):  # a list of strings is one leaf
        assert not v.is_nested(leaf), leaf
