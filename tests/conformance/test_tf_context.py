"""Conformance: which strategy and which context are current, as tf.distribute's tests check it.

Sources (tensorflow/python/distribute/): distribute_lib_test.py (_assert_in_default_state,
testCallForEachReplica, testScope, testSameScopeNesting, _run_in_and_out_of_scope,
DefaultDistributionStrategyTest.testMergeCall), strategy_test_lib.py (_test_replica_id),
mirrored_strategy_test.py (testNumReplicasInSync), distribute_lib.py
(_require_cross_replica_or_default_context_extended: run inside run).
"""
from __future__ import annotations

import threading

import pytest
import torch

import mirrored.distribute as md
from _replicas import TIMEOUT_S, strategy_of  # tests/_replicas.py


def assert_default_state() -> None:
    """Outside every scope: the default strategy and its default replica context are current."""
    default = md.get_strategy()
    assert default is md.get_strategy()  # one default strategy per process
    assert not md.has_strategy()
    assert not md.in_cross_replica_context()
    ctx = md.get_replica_context()
    assert ctx is not None and ctx is md.get_replica_context()
    assert ctx.replica_id_in_sync_group == 0 and ctx.num_replicas_in_sync == 1
    assert default.num_replicas_in_sync == 1


def test_default_state_outside_any_scope():
    """distribute_lib_test._assert_in_default_state."""
    assert_default_state()


def test_scope_is_cross_replica_context():
    """distribute_lib_test.testScope: inside the scope the strategy is current, there is no replica
    context, and the context is cross-replica; leaving restores the default state."""
    s = strategy_of(2)
    with s.scope() as entered:
        assert entered is s
        assert md.get_replica_context() is None
        assert md.in_cross_replica_context()
        assert md.has_strategy()
        assert md.get_strategy() is s
    assert_default_state()


def test_run_is_replica_context():
    """distribute_lib_test.testCallForEachReplica: inside run there is a replica context, the context
    is not cross-replica, and the strategy is current, whether or not run was called in the scope."""
    s = strategy_of(2)

    def fn():
        ctx = md.get_replica_context()
        return (ctx is not None, md.in_cross_replica_context(), md.has_strategy(), md.get_strategy() is s,
                ctx.strategy is s, ctx.num_replicas_in_sync)

    for in_scope in (False, True):
        if in_scope:
            with s.scope():
                out = s.run(fn)
        else:
            out = s.run(fn)
        assert out == (True, False, True, True, True, 2)  # the same objects on every replica
        assert_default_state()


def test_each_replica_id_runs_once():
    """strategy_test_lib._test_replica_id: every replica_id_in_sync_group in [0, n) runs exactly once,
    each on its own device (ReplicaContext.devices)."""
    s = strategy_of(3)
    seen: list[int] = []
    lock = threading.Lock()

    def fn():
        ctx = md.get_replica_context()
        with lock:
            seen.append(ctx.replica_id_in_sync_group)
        return ctx.devices

    devices = s.run(fn)
    assert sorted(seen) == [0, 1, 2]
    (per_replica,) = devices  # a tuple result regroups into a tuple of PerReplica
    assert per_replica.values == ("cpu:0", "cpu:1", "cpu:2")


def test_merge_call_is_cross_replica_context():
    """mirrored_strategy: the merge function runs in cross-replica context of the same strategy."""
    s = strategy_of(2)

    def merge_fn(strategy):
        return (strategy is s, md.get_replica_context() is None, md.in_cross_replica_context(),
                md.has_strategy(), md.get_strategy() is s)

    def fn():
        inside = md.get_replica_context().merge_call(merge_fn)
        after = md.get_replica_context() is not None and not md.in_cross_replica_context()
        return inside, after

    inside, after = s.run(fn)
    assert inside == (True, True, True, True, True)
    assert after is True  # back in replica context once merge_call returns


def test_default_replica_context_merge_call():
    """DefaultDistributionStrategyTest.testMergeCall: merge_call on the default replica context runs
    merge_fn(default_strategy, *args) in cross-replica context, has_strategy stays False, and its
    result comes back."""
    default = md.get_strategy()

    def merge_fn(strategy, s):
        assert strategy is default
        assert md.get_replica_context() is None
        assert md.in_cross_replica_context()
        assert md.get_strategy() is default
        assert not md.has_strategy()
        return "foo_" + s

    assert md.get_replica_context().merge_call(merge_fn, args=("bar",)) == "foo_bar"
    assert_default_state()


def test_same_scope_nesting_is_allowed():
    """distribute_lib_test.testSameScopeNesting: entering the same strategy's scope again, even the
    same scope object, keeps the strategy current; leaving the outer one restores the default."""
    s = strategy_of(2)
    with s.scope():
        with s.scope():
            assert md.get_strategy() is s
            with s.scope():
                assert md.get_strategy() is s
            assert md.get_strategy() is s and md.in_cross_replica_context()
        assert md.get_strategy() is s
    assert_default_state()


def test_mixing_two_strategies_raises_and_restores_state():
    """distribute_lib_test.testSameScopeNesting / _run_in_and_out_of_scope: entering another
    strategy's scope inside a scope raises RuntimeError (TF: "Mixing different tf.distribute.Strategy
    objects"); the outer scope is still in force, and the default state returns after it."""
    a, b = strategy_of(2), strategy_of(2)
    with a.scope():
        with pytest.raises(RuntimeError, match="mixing two strategies"):
            with b.scope():
                pass
        assert md.get_strategy() is a and md.in_cross_replica_context()
    assert_default_state()


def test_run_of_another_strategy_in_scope_raises():
    """TF's run enters its strategy's scope, so running strategy b inside a's scope is mixing two
    strategies: RuntimeError, and a's scope is still in force afterwards."""
    a, b = strategy_of(2), strategy_of(2)
    with a.scope():
        with pytest.raises(RuntimeError, match="mixing two strategies"):
            b.run(lambda: 1)
        assert md.get_strategy() is a
    assert b.run(lambda: 1) == 1  # outside any scope b runs normally
    assert_default_state()


def test_run_inside_run_raises():
    """distribute_lib._require_cross_replica_or_default_context_extended: run (call_for_each_replica)
    must be called in cross-replica context; inside a replica function TF raises RuntimeError."""
    s = strategy_of(2)

    def inner():
        return 1

    def outer():
        with pytest.raises(RuntimeError, match="inside strategy.run"):
            s.run(inner)
        return "ok"

    assert s.run(outer) == "ok"


def test_context_is_thread_local():
    """tf.distribute keeps the context per thread: a thread started inside a scope sees the default
    state (it must enter the scope itself)."""
    s = strategy_of(2)
    seen: dict[str, object] = {}

    def probe():
        seen["has_strategy"] = md.has_strategy()
        seen["strategy"] = md.get_strategy()

    with s.scope():
        t = threading.Thread(target=probe)
        t.start()
        t.join(timeout=TIMEOUT_S)
    assert not t.is_alive()
    assert seen["has_strategy"] is False and seen["strategy"] is not s


def test_num_replicas_in_sync():
    """mirrored_strategy_test.testNumReplicasInSync: one replica per listed device."""
    for n in (1, 2, 3):
        s = strategy_of(n)
        assert s.num_replicas_in_sync == n
        assert s.extended.worker_devices == tuple(f"cpu:{i}" for i in range(n))
        assert s.run(lambda: md.get_replica_context().num_replicas_in_sync) == n


def test_scope_exits_on_exception():
    """A scope left by an exception restores the previous context (try/finally, as Keras does)."""
    s = strategy_of(2)
    with pytest.raises(KeyError):
        with s.scope():
            raise KeyError("boom")
    assert_default_state()


def test_one_device_strategy_context():
    """OneDeviceStrategy: run executes on the caller's thread with a replica context of id 0."""
    s = md.OneDeviceStrategy("cpu:0")
    caller = threading.current_thread()

    def fn():
        ctx = md.get_replica_context()
        return threading.current_thread() is caller, ctx.replica_id_in_sync_group, md.get_strategy() is s

    assert s.run(fn) == (True, 0, True)
    with s.scope():
        assert md.in_cross_replica_context() and md.get_replica_context() is None
    assert_default_state()
    assert torch.equal(s.reduce("SUM", torch.ones(2)), torch.ones(2))


def test_one_scope_object_is_reentrant_and_nests_in_itself():
    """distribute_lib._CurrentDistributionContext, measured on TF 2.21: the object strategy.scope()
    returns can be entered again after it exits, and nested in itself; each exit restores what was
    current before its own entry."""
    s = strategy_of(2)
    scope = s.scope()
    for _ in range(2):
        with scope as entered:
            assert entered is s and md.get_strategy() is s and md.in_cross_replica_context()
        assert_default_state()
    with scope:
        with scope:
            assert md.get_strategy() is s
        assert md.get_strategy() is s and md.in_cross_replica_context()
    assert_default_state()
    with pytest.raises(KeyError), scope:  # an error inside still pops the entry
        raise KeyError("x")
    assert_default_state()
    default = md.get_strategy()
    default_scope = default.scope()
    for _ in range(2):
        with default_scope:
            assert md.get_strategy() is default
