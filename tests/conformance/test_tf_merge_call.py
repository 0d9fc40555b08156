"""Conformance: ReplicaContext.merge_call and errors raised inside replica functions.

Sources (tensorflow/python/distribute/): mirrored_strategy_test.py (testThreeDevices,
MirroredStrategyNameScopeTest's merge_call(lambda _: _), testCallAndMergeExceptions),
strategy_test_lib.py (_raise_exception_fn, _merge_raises_fn, _merge_call_raises_fn),
mirrored_run.py (_call_for_each_replica: lock-step threads, "Some replicas made a different number
of replica_context().merge_call() calls.").
"""
from __future__ import annotations

import threading

import pytest
import torch

import mirrored.distribute as md
from _replicas import replica_id, strategy_of  # tests/_replicas.py


class _TestException(Exception):
    pass


def test_merge_call_merges_args_runs_once_and_hands_back_result():
    """merge_call: each replica's argument arrives in merge_fn as one PerReplica (replica order), the
    merge function runs once, and every replica receives its result."""
    s = strategy_of(3)
    calls: list[tuple] = []
    lock = threading.Lock()

    def merge_fn(strategy, value, *, scale):
        with lock:
            calls.append((threading.current_thread().name, value))
        assert isinstance(value, md.PerReplica) and isinstance(scale, md.PerReplica)
        return scale.values[0] * sum(v.item() for v in value.values)

    def fn():
        r = replica_id()
        return md.get_replica_context().merge_call(merge_fn, args=(torch.tensor(r + 1),),
                                                   kwargs={"scale": float(10 ** r)})

    out = s.run(fn)
    assert len(calls) == 1
    assert [v.item() for v in calls[0][1].values] == [1, 2, 3]
    assert out == 6.0  # the same object went back to every replica, so run returns it unwrapped


def test_merge_call_per_replica_result_is_unwrapped_per_replica():
    """A PerReplica returned by merge_fn reaches each replica as its own component."""
    s = strategy_of(3)

    def merge_fn(strategy, value):
        return md.PerReplica([v * 100 for v in value.values])

    out = s.run(lambda: md.get_replica_context().merge_call(merge_fn, args=(torch.tensor(replica_id()),)))
    assert [t.item() for t in s.experimental_local_results(out)] == [0, 100, 200]


def test_merge_call_same_object_is_not_wrapped():
    """regroup: an argument that is the same object on every replica (a module, a constant) arrives
    unwrapped, as in TF (same_id)."""
    s = strategy_of(2)
    shared = torch.nn.Linear(1, 1)

    def merge_fn(strategy, module, constant):
        return module is shared and constant == "k"

    out = s.run(lambda: md.get_replica_context().merge_call(merge_fn, args=(shared, "k")))
    assert out is True


def test_identity_merge_call_keeps_replicas_in_step():
    """mirrored_strategy_test.testThreeDevices / testNameScope: merge_call(lambda _: _) is a barrier;
    work before and after it happens in the replica's context."""
    s = strategy_of(3)
    order: list[str] = []
    lock = threading.Lock()

    def fn():
        with lock:
            order.append("before")
        md.get_replica_context().merge_call(lambda _: _)
        with lock:
            order.append("after")
        return replica_id()

    assert s.experimental_local_results(s.run(fn)) == (0, 1, 2)
    assert order == ["before"] * 3 + ["after"] * 3


def test_several_merge_calls_in_one_step():
    """Replicas may make any number of merge_calls as long as they all make the same ones."""
    s = strategy_of(2)
    merges: list[int] = []

    def fn():
        ctx = md.get_replica_context()
        total = 0
        for i in range(4):
            total += ctx.merge_call(lambda strategy, i: (merges.append(i), i)[1], args=(i,))
        return total

    assert s.run(fn) == 6
    assert merges == [0, 1, 2, 3]


def test_different_number_of_merge_calls_raises():
    """mirrored_run: "Some replicas made a different number of replica_context().merge_call() calls."
    (RuntimeError in TF; ours is CollectiveMismatchError, a RuntimeError)."""
    s = strategy_of(3)

    def fn():
        calls = 2 if replica_id() == 1 else 1
        for _ in range(calls):
            md.get_replica_context().merge_call(lambda _: None)

    with pytest.raises(md.CollectiveMismatchError) as info:
        s.run(fn)
    assert isinstance(info.value, RuntimeError)
    assert "different number" in str(info.value) or "already returned" in str(info.value)
    assert s.run(lambda: replica_id() + 1) is not None  # still usable


def test_exception_in_replica_fn_reaches_caller():
    """strategy_test_lib._test_call_and_merge_exceptions (_raise_exception_fn): the replica's exception
    type reaches the caller of run."""
    s = strategy_of(2)

    def raise_fn(_=None):
        raise _TestException("raised in a replica")

    with pytest.raises(_TestException):
        s.run(raise_fn)


def test_exception_in_merge_fn_reaches_caller():
    """_merge_raises_fn: an exception raised by merge_fn reaches the caller of run with its type."""
    s = strategy_of(2)

    def merge_raises():
        md.get_replica_context().merge_call(lambda _: (_ for _ in ()).throw(_TestException("merge")))

    with pytest.raises(_TestException):
        s.run(merge_raises)
    assert s.run(lambda: 5) == 5


def test_run_inside_merge_fn_is_refused():
    """_merge_call_raises_fn calls call_for_each_replica from inside merge_fn, a TF1 pattern that needs
    a second set of replica threads while the first waits in merge_call. We do not support it and
    raise RuntimeError (TF's test expects the inner function's own exception)."""
    s = strategy_of(2)

    def merge_fn(strategy):
        strategy.run(lambda: None)

    with pytest.raises(RuntimeError, match="merge_call"):
        s.run(lambda: md.get_replica_context().merge_call(merge_fn))
    assert s.run(lambda: 7) == 7


def test_merge_call_with_one_replica_runs_inline():
    """A one-replica MirroredStrategy still calls merge_fn with the strategy, in cross-replica context."""
    s = strategy_of(1)

    def merge_fn(strategy, x):
        assert strategy is s and md.in_cross_replica_context()
        return x * 2

    assert s.run(lambda: md.get_replica_context().merge_call(merge_fn, args=(21,))) == 42
