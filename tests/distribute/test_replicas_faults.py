"""Faults in replica threads: errors reach the caller named by replica, nobody hangs, the strategy
stays usable, and no thread outlives its test (tests/conftest.py checks the last part).

Every wait here is bounded: collectives by `timeout_s`, the stuck replica's own wait by
`STUCK_WAIT_S`, and any join by `JOIN_S`. A test that makes a replica stuck sets its event before
leaving, so the old thread ends.
"""
from __future__ import annotations

import gc
import threading
import weakref

import pytest
import torch

import mirrored.distribute as md
from _replicas import replica_id, strategy_of  # tests/_replicas.py

STUCK_WAIT_S = 20.0  # the stuck replica gives up on its own after this, whatever happens


class ReplicaFailure(Exception):
    pass


def all_reduce_ids(strategy) -> list[float]:
    """A step every replica must join: proves none of them is still blocked in an earlier one."""
    out = strategy.run(lambda: md.get_replica_context().all_reduce("sum", torch.tensor(float(replica_id()))))
    return [t.item() for t in strategy.experimental_local_results(out)]


def test_exception_in_one_replica_reaches_caller_named():
    """Replica 1 of 3 raises while 0 and 2 wait in an all_reduce: the caller gets the same exception
    type, its message prefixed "replica 1 (cpu:1): ", the waiting replicas are released, the same
    threads serve the next run, and its result is right."""
    s = strategy_of(3)
    all_reduce_ids(s)
    threads_before = [t.ident for t in s._pool.threads()]

    def fn():
        if replica_id() == 1:
            raise ReplicaFailure("bad batch")
        return md.get_replica_context().all_reduce("sum", torch.ones(2))

    with pytest.raises(ReplicaFailure) as info:
        s.run(fn)
    assert str(info.value) == "replica 1 (cpu:1): bad batch"
    assert all_reduce_ids(s) == [3.0, 3.0, 3.0]
    assert [t.ident for t in s._pool.threads()] == threads_before  # nobody was left blocked


def test_exception_without_a_message_string_gets_a_note():
    """An exception whose args are not one string keeps its args; the replica goes into a note."""
    s = strategy_of(3)

    def fn():
        if replica_id() == 1:
            raise KeyError("label", 7)
        md.get_replica_context().merge_call(lambda _: None)

    with pytest.raises(KeyError) as info:
        s.run(fn)
    assert info.value.args == ("label", 7)
    assert any("replica 1 (cpu:1)" in note for note in info.value.__notes__)
    assert all_reduce_ids(s) == [3.0, 3.0, 3.0]


def test_first_replica_error_wins_when_several_fail():
    """When every replica raises, the caller gets replica 0's exception (the lowest id)."""
    s = strategy_of(3)

    def fn():
        raise ReplicaFailure(f"from {replica_id()}")

    with pytest.raises(ReplicaFailure, match=r"^replica 0 \(cpu:0\): from 0$"):
        s.run(fn)


def test_exception_in_merge_fn_names_the_replica_that_ran_it():
    """merge_fn runs on one replica's thread; its exception reaches the caller with its type."""
    s = strategy_of(2)

    def merge_fn(strategy):
        raise ReplicaFailure("merge failed")

    with pytest.raises(ReplicaFailure, match=r"replica [01] \(cpu:[01]\): merge failed"):
        s.run(lambda: md.get_replica_context().merge_call(merge_fn))
    assert all_reduce_ids(s) == [1.0, 1.0]


def test_replica_that_never_arrives_times_out_naming_it():
    """Replica 2 waits on an event instead of calling all_reduce: with timeout_s=0.5 the others fail
    with CollectiveTimeoutError naming replica 2 and the timeout; the strategy serves the next run
    (replica 2's busy thread is replaced) and the stuck thread ends once released."""
    s = strategy_of(3, timeout_s=0.5)
    release = threading.Event()
    stuck_thread: list[threading.Thread] = []

    def fn():
        if replica_id() == 2:
            stuck_thread.append(threading.current_thread())
            release.wait(timeout=STUCK_WAIT_S)
            return None
        return md.get_replica_context().all_reduce("sum", torch.ones(1))

    try:
        with pytest.raises(md.CollectiveTimeoutError) as info:
            s.run(fn)
        msg = str(info.value)
        assert "replica 2 (cpu:2) did not arrive within 0.5 s" in msg
        assert "replica 0 (cpu:0), 1 (cpu:1) waited" in msg
        assert isinstance(info.value, TimeoutError)
        assert all_reduce_ids(s) == [3.0, 3.0, 3.0]
    finally:
        release.set()
    stuck_thread[0].join(timeout=STUCK_WAIT_S)
    assert not stuck_thread[0].is_alive()


def test_replica_returning_while_others_wait_in_merge_call():
    """Replica 0 returns at once while 1 and 2 call merge_call: CollectiveMismatchError (TF: "Some
    replicas made a different number of replica_context().merge_call() calls."), no replica hangs
    (the strategy's timeout is long, so a hang would show as a pytest timeout), next run works."""
    s = strategy_of(3)
    returned = threading.Event()

    def fn():
        if replica_id() == 0:
            returned.set()
            return "early"
        returned.wait(timeout=STUCK_WAIT_S)  # make the order deterministic: 0 has returned first
        return md.get_replica_context().merge_call(lambda _: "merged")

    with pytest.raises(md.CollectiveMismatchError, match="replica 0 \\(cpu:0\\)"):
        s.run(fn)
    assert all_reduce_ids(s) == [3.0, 3.0, 3.0]


def test_replica_returning_after_others_entered_merge_call():
    """The other order: replicas 1 and 2 already wait in merge_call when replica 0 returns."""
    s = strategy_of(3)
    waiting = threading.Barrier(2, timeout=STUCK_WAIT_S)
    entered = threading.Event()

    def merge_fn(strategy):
        return None

    def fn():
        if replica_id() == 0:
            entered.wait(timeout=STUCK_WAIT_S)
            return "early"
        waiting.wait()
        entered.set()
        return md.get_replica_context().merge_call(merge_fn)

    with pytest.raises(md.CollectiveMismatchError, match="different number of merge_call"):
        s.run(fn)
    assert all_reduce_ids(s) == [3.0, 3.0, 3.0]


def test_mismatched_collectives_raise():
    """One replica all_reduces while the others merge_call: CollectiveMismatchError naming both calls."""
    s = strategy_of(2)

    def fn():
        ctx = md.get_replica_context()
        if replica_id() == 0:
            return ctx.all_reduce("sum", torch.ones(1))
        return ctx.merge_call(lambda _: None)

    with pytest.raises(md.CollectiveMismatchError, match=r"replica 0 called all_reduce\(SUM\); replica 1 called merge_call"):
        s.run(fn)
    assert all_reduce_ids(s) == [1.0, 1.0]


def test_all_reduce_of_different_shapes_raises_in_every_replica():
    """Replicas all-reducing tensors of different sizes get a ValueError naming the replica, not a hang."""
    s = strategy_of(2)

    def fn():
        return md.get_replica_context().all_reduce("sum", torch.ones(replica_id() + 1))

    with pytest.raises(ValueError, match=r"tensor 0 has shape \[2\] \(torch.float32\) on replica 1 but \[1\]"):
        s.run(fn)
    assert all_reduce_ids(s) == [1.0, 1.0]


@pytest.mark.parametrize("shapes", [((2, 3), (3, 2)), ((3,), (5,))])
def test_all_reduce_of_equal_sizes_but_different_shapes_raises(shapes):
    """TF 2.21 refuses a shape mismatch in a collective (measured: InvalidArgumentError "Shape
    mismatch"). (2, 3) against (3, 2) has the same size, and [a(3), b(5)] against [b(5), a(3)]
    packs to the same flat buffer: both would sum unrelated values without the shape check."""
    s = strategy_of(3)

    def fn():
        first, second = (torch.ones(shapes[0]), torch.ones(shapes[1]))
        return md.get_replica_context().all_reduce("sum", [first, second] if replica_id() == 0 else [second, first])

    with pytest.raises(ValueError, match=r"tensor 0 has shape .* on replica 1 but .* on replica 0"):
        s.run(fn)
    assert all_reduce_ids(s) == [3.0, 3.0, 3.0]


def test_replicas_asking_for_different_reduce_ops_raise():
    """SUM on one replica and MEAN on the others would give an answer that depends on which replica
    arrives last: a CollectiveMismatchError names each replica's call instead."""
    s = strategy_of(3)

    def fn():
        return md.get_replica_context().all_reduce("sum" if replica_id() == 0 else "mean", torch.ones(1))

    with pytest.raises(md.CollectiveMismatchError,
                       match=r"replica 0 called all_reduce\(SUM\); replica 1 called all_reduce\(MEAN\)"):
        s.run(fn)
    assert all_reduce_ids(s) == [3.0, 3.0, 3.0]


def test_collective_after_run_returned_is_a_clear_error():
    """Backward through ctx.all_reduce results outside the strategy.run that made them would make a
    collective no replica can join: a RuntimeError says so (not an internal exception), and the
    strategy stays usable."""
    s = strategy_of(2)
    weights = [torch.ones(2, requires_grad=True) for _ in range(2)]

    def fn():
        return md.get_replica_context().all_reduce("sum", weights[replica_id()] * 2)

    out = s.run(fn)
    with pytest.raises(RuntimeError, match=r"all_reduce\(SUM\) was called after the strategy.run"):
        out.values[0].sum().backward()
    assert all_reduce_ids(s) == [1.0, 1.0]


def test_failed_strategy_is_garbage_collected():
    """After a timeout the strategy is still collectable once its stuck replica is released, and every
    replica thread (the replaced one included) ends."""
    s = strategy_of(2, timeout_s=0.5)
    release = threading.Event()
    stuck_thread: list[threading.Thread] = []

    def fn():
        if replica_id() == 1:
            stuck_thread.append(threading.current_thread())
            release.wait(timeout=STUCK_WAIT_S)
            return None
        return md.get_replica_context().all_reduce("sum", torch.ones(1))

    try:
        with pytest.raises(md.CollectiveTimeoutError):
            s.run(fn)
    finally:
        release.set()
    stuck_thread[0].join(timeout=STUCK_WAIT_S)  # it held the step's closure (and so the strategy)
    threads = s._pool.threads()
    ref = weakref.ref(s)
    del s
    gc.collect()
    assert ref() is None
    for t in threads:
        t.join(timeout=STUCK_WAIT_S)
        assert not t.is_alive()


def test_keyboard_interrupt_in_a_replica_propagates():
    """BaseExceptions (KeyboardInterrupt, SystemExit) from a replica are re-raised too, not swallowed."""
    s = strategy_of(2)

    def fn():
        if replica_id() == 1:
            raise KeyboardInterrupt
        md.get_replica_context().merge_call(lambda _: None)

    with pytest.raises(KeyboardInterrupt):
        s.run(fn)
    assert all_reduce_ids(s) == [1.0, 1.0]
