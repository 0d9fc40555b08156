"""context.py: the per-thread stack of (strategy, replica context) frames and ReplicaContext."""
from __future__ import annotations

import pytest
import torch

import mirrored.distribute as md
from mirrored.distribute import context
from _replicas import strategy_of  # tests/_replicas.py


def test_push_pops_even_on_error():
    s = strategy_of(2)
    depth = len(context._stack())
    with pytest.raises(ZeroDivisionError):
        with context.push(s, None):
            assert md.get_strategy() is s
            1 / 0
    assert len(context._stack()) == depth and not md.has_strategy()


def test_require_cross_replica():
    s = strategy_of(2)
    context.require_cross_replica("thing")  # default context: fine
    with s.scope():
        context.require_cross_replica("thing")

    def fn():
        with pytest.raises(RuntimeError) as info:
            context.require_cross_replica("thing")
        return str(info.value)

    msgs = s.experimental_local_results(s.run(fn))
    assert msgs[1].startswith("thing must be called in cross-replica context")
    assert "replica 1's function" in msgs[1]


def test_scope_inside_run_keeps_replica_context():
    """Re-entering the running strategy's scope inside its replica function stays in replica context."""
    s = strategy_of(2)

    def fn():
        with s.scope():
            ctx = md.get_replica_context()
            return ctx is not None and not md.in_cross_replica_context(), ctx.replica_id_in_sync_group

    ok, ids = s.run(fn)
    assert ok is True and ids.values == (0, 1)


def test_replica_context_properties_and_repr():
    s = strategy_of(3)

    def fn():
        ctx = md.get_replica_context()
        return ctx.strategy is s, ctx.num_replicas_in_sync, ctx.devices, repr(ctx)

    same, n, devs, reprs = s.run(fn)
    assert same is True and n == 3
    assert devs[0].values == ("cpu:0", "cpu:1", "cpu:2")  # each a 1-tuple: regrouped leaf by leaf
    assert reprs.values[2] == "ReplicaContext(replica_id_in_sync_group=2, num_replicas_in_sync=3)"


def test_replica_context_as_context_manager():
    """A ReplicaContext entered with `with` makes itself current (what TF's replica contexts allow)."""
    s = strategy_of(2)
    ctx = md.ReplicaContext(s, 1)
    with ctx as entered:
        assert entered is ctx and md.get_replica_context() is ctx and md.get_strategy() is s
        assert not md.in_cross_replica_context()
    assert not md.has_strategy()


def test_replica_context_outside_run_collectives_are_local():
    """A ReplicaContext not inside run has no peers: all_reduce returns the value, merge_call runs
    merge_fn in cross-replica context directly."""
    s = strategy_of(2)
    with md.ReplicaContext(s, 0) as ctx:
        assert ctx.all_reduce("sum", torch.tensor(3.0)).item() == 3.0
        assert ctx.merge_call(lambda strategy, x: (strategy is s and md.in_cross_replica_context(), x),
                              args=(4,)) == (True, 4)


def test_default_strategy_scope_is_default_replica_context():
    default = md.get_strategy()
    with default.scope() as entered:
        assert entered is default
        assert md.get_replica_context() is not None and not md.has_strategy()
    with strategy_of(2).scope():
        with default.scope():  # the default strategy nests anywhere
            assert md.get_strategy() is default


def test_all_reduce_rejects_unknown_op():
    s = strategy_of(2)

    def fn():
        md.get_replica_context().all_reduce("max", torch.ones(1))

    with pytest.raises(ValueError, match="unknown reduce op 'max'"):
        s.run(fn)
