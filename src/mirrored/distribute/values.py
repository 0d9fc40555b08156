"""Distributed values and the vocabulary shared by the rest of `distribute/`.

`PerReplica` holds one value per replica that may differ (a batch split, a loss); `Mirrored` holds
copies known to be identical (a reduced gradient). Both are `DistributedValues` with `.values`.
The nest helpers walk tuples, lists, dicts and namedtuples, the structures tf.nest walks, so a
`strategy.run` argument or result may be any nesting of them (a list of strings is one leaf, as a
string tensor is in tf.nest). Uses mirrored._strings, nothing else from mirrored.
"""
from __future__ import annotations

import enum
from collections.abc import Callable, Sequence
from typing import Any

from mirrored._strings import is_string_tensor

Device = str  # "cpu:0", "cuda:1": always the canonical spelling from devices.py
Nested = Any  # a tensor, a DistributedValues, or a tuple / list / dict / namedtuple of Nested


class ReduceOp(enum.Enum):
    """How `strategy.reduce` and `ReplicaContext.all_reduce` combine values (tf.distribute.ReduceOp)."""

    SUM = "SUM"
    MEAN = "MEAN"


class DistributedValues:
    """One value per replica, in replica order. Read them with `.values`."""

    __slots__ = ("_values",)

    def __init__(self, values: Sequence[Any]):
        values = tuple(values)
        if not values:
            raise ValueError(f"{type(self).__name__} needs at least one value (one per replica); got none.")
        self._values = values

    @property
    def values(self) -> tuple[Any, ...]:
        """One component per local replica, in replica order (strategy.experimental_local_results)."""
        return self._values

    def __repr__(self) -> str:
        body = ",\n".join(f"  {i}: {v!r}" for i, v in enumerate(self._values))
        return f"{type(self).__name__}:{{\n{body}\n}}"

    def __bool__(self) -> bool:
        raise TypeError(
            f"the truth value of a {type(self).__name__} is ambiguous: it holds one value per replica. "
            "Reduce it first (strategy.reduce) or read one replica's value (.values[i])."
        )


class PerReplica(DistributedValues):
    """Values that may differ between replicas (tf.distribute's PerReplica)."""

    __slots__ = ()


class Mirrored(DistributedValues):
    """Values that are identical on every replica, each on its replica's device."""

    __slots__ = ()


def is_namedtuple(x: Any) -> bool:
    return isinstance(x, tuple) and hasattr(type(x), "_fields")


def _rebuild(template: Any, items: list[Any]) -> Any:
    """A container of the same kind as `template` holding `items` (in `_children` order); a dict
    keeps the template's key order."""
    if isinstance(template, dict):
        by_key = dict(zip(sorted_keys(template), items))
        return type(template)((k, by_key[k]) for k in template)
    if is_namedtuple(template):
        return type(template)(*items)
    return type(template)(items)


def sorted_keys(d: dict) -> list[Any]:
    """A dict's keys in tf.nest's order: sorted, so dicts that differ only in insertion order
    flatten alike (replicas may build their results' dicts in any order). Keys that do not sort
    among themselves (mixed types) go by type name, then value."""
    try:
        return sorted(d)
    except TypeError:
        return sorted(d, key=lambda k: (type(k).__name__, repr(k)))


def is_nested(x: Any) -> bool:
    """Whether `x` is a structure the nest helpers walk into (tuple, list, dict, namedtuple), not a leaf."""
    return _children(x) is not None


def _children(x: Any) -> list[Any] | None:
    if isinstance(x, dict):
        return [x[k] for k in sorted_keys(x)]
    if isinstance(x, (list, tuple)) and not is_string_tensor(x):  # a string tensor is one leaf
        return list(x)
    return None


def map_structure(fn: Callable[..., Any], structure: Nested, *others: Nested) -> Nested:
    """Applies fn to the leaves of `structure` (and the matching leaves of `others`), keeping its shape."""
    kids = _children(structure)
    if kids is None:
        return fn(structure, *others)
    columns = [kids]
    for other in others:
        columns.append(_matching_children(structure, other))
    return _rebuild(structure, [map_structure(fn, *col) for col in zip(*columns)])


def _matching_children(structure: Nested, other: Nested) -> list[Any]:
    """The children of `other` in the order of `structure`'s, or a ValueError naming the difference."""
    if isinstance(structure, dict):
        if not isinstance(other, dict) or set(other) != set(structure):
            raise ValueError(f"nested structures differ: {_describe(structure)} vs {_describe(other)}.")
        return [other[k] for k in sorted_keys(structure)]
    if not isinstance(other, (list, tuple)) or len(other) != len(structure):
        raise ValueError(f"nested structures differ: {_describe(structure)} vs {_describe(other)}.")
    return list(other)


def flatten(structure: Nested) -> list[Any]:
    """The leaves of `structure`, depth first, in container order (a dict's by sorted key, as tf.nest)."""
    kids = _children(structure)
    if kids is None:
        return [structure]
    out: list[Any] = []
    for k in kids:
        out.extend(flatten(k))
    return out


def pack_sequence_as(structure: Nested, flat: Sequence[Any]) -> Nested:
    """Inverse of `flatten`: puts `flat` back into the shape of `structure`."""
    it = iter(flat)
    result = map_structure(lambda _: next(it), structure)
    if next(it, _END) is not _END:
        raise ValueError(f"pack_sequence_as: got more values than the {len(flatten(structure))} leaves of the structure.")
    return result


_END = object()


def _describe(x: Any) -> str:
    if isinstance(x, dict):
        return f"dict with keys {sorted(map(str, x))}"
    if isinstance(x, (list, tuple)):
        return f"{type(x).__name__} of length {len(x)}"
    return type(x).__name__


def select_replica(replica_id: int, structure: Nested) -> Nested:
    """`structure` as replica `replica_id` sees it: each DistributedValues becomes its own component."""
    if isinstance(structure, DistributedValues):
        return structure._values[replica_id]
    if _children(structure) is None:
        return structure
    return map_structure(
        lambda x: x._values[replica_id] if isinstance(x, DistributedValues) else x, structure
    )


def regroup(per_replica: Sequence[Nested], wrap: type[DistributedValues] = PerReplica,
            always_wrap: bool = False, where: str | None = None) -> Nested:
    """Turns one result per replica into one result: the object itself where every replica returned
    the same object (so one replica gives plain values, as in TF), else nested containers of `wrap`.
    `always_wrap` wraps every leaf even then, as TF's experimental_distribute_values_from_function does.
    With `where` (the caller's name), replicas that returned different structures (a 2-tuple and a
    3-tuple, a dict and a tensor, None and a tensor) are a ValueError, as tf.nest refuses them."""
    first = per_replica[0]
    if not always_wrap and all(v is first for v in per_replica[1:]):
        return first
    kids = _children(first)
    if kids is not None and all(type(v) is type(first) for v in per_replica[1:]):
        others = [_children(v) for v in per_replica[1:]]
        same_keys = not isinstance(first, dict) or all(v.keys() == first.keys() for v in per_replica[1:])
        if same_keys and all(len(o) == len(kids) for o in others):
            columns = zip(kids, *others)
            return _rebuild(first, [regroup(col, wrap, always_wrap, where) for col in columns])
    elif kids is None and all(_children(v) is None and (v is None) == (first is None) for v in per_replica[1:]):
        return wrap(per_replica)
    if where is not None:
        _raise_different_structures(per_replica, where)
    return wrap(per_replica)


def _raise_different_structures(per_replica: Sequence[Nested], where: str) -> None:
    first = describe_structure(per_replica[0])
    for r, v in enumerate(per_replica[1:], start=1):
        other = describe_structure(v)
        if other != first:
            raise ValueError(f"{where}: replica 0 returned {first} but replica {r} returned {other}. Every replica "
                             "must return the same structure (the same containers, keys and lengths, and None in "
                             "the same places), so that the results can be combined.")
    raise ValueError(f"{where}: the replicas returned different structures (a part differs in type: "
                     f"{[type(v).__name__ for v in per_replica]}). Every replica must return the same structure.")


def describe_structure(x: Nested, limit: int = 160) -> str:
    """A short description of a nest's shape: `tuple(Tensor, dict(a: Tensor, b: None))`."""
    def walk(v: Any) -> str:
        kids = _children(v)
        if kids is None:
            return "None" if v is None else type(v).__name__
        if isinstance(v, dict):
            return f"{type(v).__name__}(" + ", ".join(f"{k}: {walk(v[k])}" for k in sorted_keys(v)) + ")"
        return f"{type(v).__name__}(" + ", ".join(walk(k) for k in kids) + ")"

    text = walk(x)
    return text if len(text) <= limit else text[:limit - 3] + "..."
