"""replicas.py: the Rendezvous replicas meet at, and the pool of persistent replica threads.

Rendezvous is driven here by plain threads, one per replica; every join and wait has a timeout.
"""
from __future__ import annotations

import gc
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest
import torch

from mirrored.distribute import replicas
from mirrored.distribute.replicas import CollectiveMismatchError, CollectiveTimeoutError, Rendezvous, ReplicaPool

DEVICES = ("cpu:0", "cpu:1", "cpu:2")
JOIN_S = 20.0


def run_threads(fns: list[Callable[[], Any]]) -> list[Any]:
    """Runs fns[i] on thread i; returns each result or the exception it raised."""
    out: list[Any] = [None] * len(fns)

    def target(i):
        try:
            out[i] = fns[i]()
        except BaseException as e:  # noqa: BLE001 - the test inspects it
            out[i] = e

    threads = [threading.Thread(target=target, args=(i,)) for i in range(len(fns))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=JOIN_S)
        assert not t.is_alive(), "a rendezvous participant hung"
    return out


def wait_until(condition: Callable[[], bool]) -> None:
    deadline = time.monotonic() + JOIN_S
    while not condition():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.001)


def test_exchange_gives_everyone_all_values_in_replica_order():
    rv = Rendezvous(DEVICES, timeout_s=JOIN_S)
    out = run_threads([lambda i=i: rv.exchange(i, f"v{i}", "x") for i in range(3)])
    assert out == [["v0", "v1", "v2"]] * 3


def test_combine_runs_once_and_generations_repeat():
    rv = Rendezvous(DEVICES, timeout_s=JOIN_S)
    calls = []

    def combine(values):
        calls.append(list(values))
        return sum(values)

    def replica(i):
        return [rv.exchange(i, i + 10 * step, "sum", combine) for step in range(5)]

    out = run_threads([lambda i=i: replica(i) for i in range(3)])
    assert out == [[3, 33, 63, 93, 123]] * 3
    assert len(calls) == 5 and rv.error is None


def test_timeouts_racing_arrivals_never_hang_or_corrupt():
    """A timeout about as long as the replicas' jitter: a replica's wait may time out just as the
    last one arrives and opens its gate. Whatever the interleaving, every exchange returns the right
    sum or the step fails with the timeout, and every participant finishes."""
    import random

    rv = Rendezvous(DEVICES, timeout_s=0.002)

    def combine(values):
        return sum(values)

    def replica(i):
        rng = random.Random(i)
        sums = []
        try:
            for step in range(300):
                time.sleep(rng.random() * 0.002)
                sums.append(rv.exchange(i, i + 10 * step, "sum", combine))
        except (CollectiveTimeoutError, replicas._Released) as e:
            return sums, e
        return sums, None

    out = run_threads([lambda i=i: replica(i) for i in range(3)])
    for sums, error in out:
        assert sums == [3 + 30 * step for step in range(len(sums))]
        assert (error is None) == (len(sums) == 300)
    if any(error is not None for _, error in out):
        assert isinstance(rv.error, CollectiveTimeoutError)


def test_different_calls_are_a_mismatch():
    rv = Rendezvous(DEVICES, timeout_s=JOIN_S)
    out = run_threads([lambda: rv.exchange(0, 0, "all_reduce"), lambda: rv.exchange(1, 0, "merge_call"),
                       lambda: rv.exchange(2, 0, "all_reduce")])
    assert all(isinstance(e, replicas._Released) for e in out)
    assert isinstance(rv.error, CollectiveMismatchError)
    assert "replica 0 called all_reduce; replica 1 called merge_call; replica 2 called all_reduce" in str(rv.error)


def test_missing_replica_times_out_naming_it():
    rv = Rendezvous(DEVICES, timeout_s=0.2)
    out = run_threads([lambda: rv.exchange(0, 0, "all_reduce"), lambda: rv.exchange(1, 0, "all_reduce")])
    assert all(isinstance(e, replicas._Released) for e in out)
    assert isinstance(rv.error, CollectiveTimeoutError)
    assert str(rv.error).startswith("all_reduce: replica 2 (cpu:2) did not arrive within 0.2 s; replica 0 (cpu:0), "
                                    "1 (cpu:1) waited for it.")
    with pytest.raises(replicas._Released):  # a late arrival is released at once, not made to wait
        rv.exchange(2, 0, "all_reduce")


def test_slow_combine_is_not_a_timeout():
    """Waiting while the last arrival combines does not count against the timeout."""
    rv = Rendezvous(DEVICES[:2], timeout_s=0.05)
    arrived = threading.Event()

    def combine(values):
        time.sleep(0.3)  # longer than timeout_s: the waiting replica must keep waiting
        return "done"

    def first():
        arrived.set()
        return rv.exchange(0, 0, "x", combine)

    def second():
        arrived.wait(timeout=JOIN_S)
        time.sleep(0.01)  # let replica 0 start waiting
        return rv.exchange(1, 0, "x", combine)

    assert run_threads([first, second]) == ["done", "done"]


def test_returning_while_others_wait_is_a_mismatch():
    rv = Rendezvous(DEVICES[:2], timeout_s=JOIN_S)
    waiting = threading.Event()

    def waiter():
        waiting.set()
        return rv.exchange(0, 0, "merge_call")

    def quitter():
        waiting.wait(timeout=JOIN_S)
        wait_until(lambda: rv._arrived == 1)  # replica 0 is in the rendezvous
        rv.finish(1)

    out = run_threads([waiter, quitter])
    assert isinstance(out[0], replicas._Released)
    assert isinstance(rv.error, CollectiveMismatchError)
    assert "replica 1 (cpu:1) returned from its function while replica 0 (cpu:0) waited in merge_call" in str(rv.error)


def test_joining_after_a_replica_returned_is_a_mismatch():
    rv = Rendezvous(DEVICES[:2], timeout_s=JOIN_S)
    rv.finish(0)
    with pytest.raises(replicas._Released):
        rv.exchange(1, 0, "all_reduce")
    assert "replica 1 called all_reduce, but replica 0 (cpu:0) already returned" in str(rv.error)


def test_abort_releases_waiters():
    rv = Rendezvous(DEVICES, timeout_s=JOIN_S)
    waiting = threading.Barrier(3, timeout=JOIN_S)

    def waiter(i):
        waiting.wait()
        return rv.exchange(i, 0, "x")

    def aborter():
        waiting.wait()
        wait_until(lambda: rv._arrived == 2)
        rv.abort(KeyError("boom"))

    out = run_threads([lambda: waiter(0), lambda: waiter(1), aborter])
    assert isinstance(out[0], replicas._Released) and isinstance(out[1], replicas._Released)
    assert isinstance(rv.error, KeyError)


def test_combine_error_reaches_the_combiner_and_releases_others():
    rv = Rendezvous(DEVICES, timeout_s=JOIN_S)

    def combine(values):
        raise ArithmeticError("bad combine")

    out = run_threads([lambda i=i: rv.exchange(i, i, "x", combine) for i in range(3)])
    assert sum(isinstance(e, ArithmeticError) for e in out) == 1
    assert sum(isinstance(e, replicas._Released) for e in out) == 2
    assert isinstance(rv.error, ArithmeticError)


# ---- ReplicaPool -----------------------------------------------------------------------------------

def test_pool_runs_every_replica_on_persistent_threads():
    pool = ReplicaPool(DEVICES, intra_op_threads=1)
    try:
        results, errors, *_ = pool.run(lambda i: (i, threading.current_thread().name), grace_s=JOIN_S)
        assert errors == {}
        assert results == [(0, "mirrored-replica-0-cpu:0"), (1, "mirrored-replica-1-cpu:1"),
                           (2, "mirrored-replica-2-cpu:2")]
        idents = [t.ident for t in pool.threads()]
        pool.run(lambda i: None, grace_s=JOIN_S)
        assert [t.ident for t in pool.threads()] == idents
        assert all(t.daemon for t in pool.threads())
    finally:
        threads = pool.threads()
        pool.shutdown()
    for t in threads:
        t.join(timeout=JOIN_S)
        assert not t.is_alive()


def test_pool_threads_keep_their_intra_op_count_when_another_thread_sets_one_after_them():
    """Regression, found hunting torch_mnist_port's rare out-of-sync replicas: ATen fixes a thread's
    count at its first parallel op from the last torch.set_num_threads of any thread, so the summing
    replica's borrowing of every core leaked into a replica whose first op came after it."""
    before = torch.get_num_threads()
    pool = ReplicaPool(DEVICES[:2], intra_op_threads=1)
    try:
        pool.run(lambda i: None, grace_s=JOIN_S)  # the workers have started (and set their count)
        torch.set_num_threads(2)  # another thread's setting, made before the workers' first torch op
        counts, errors, *_ = pool.run(lambda i: torch.get_num_threads(), grace_s=JOIN_S)
        assert errors == {}
        assert counts == [1, 1]
        assert torch.get_num_threads() == 2  # (the caller's own setting stands)
    finally:
        torch.set_num_threads(before)
        threads = pool.threads()
        pool.shutdown()
    for t in threads:
        t.join(timeout=JOIN_S)


def test_pool_collects_errors_by_replica():
    pool = ReplicaPool(DEVICES[:2], intra_op_threads=1)
    try:
        def task(i):
            if i == 1:
                raise ValueError("one")
            return "ok"

        results, errors, *_ = pool.run(task, grace_s=JOIN_S)
        assert results[0] == "ok" and list(errors) == [1] and isinstance(errors[1], ValueError)
    finally:
        pool.shutdown()


def test_pool_refuses_overlapping_runs():
    pool = ReplicaPool(DEVICES[:2], intra_op_threads=1)
    started, release = threading.Event(), threading.Event()

    def slow(i):
        started.set()
        release.wait(timeout=JOIN_S)

    caller = threading.Thread(target=lambda: pool.run(slow, grace_s=JOIN_S))
    caller.start()
    try:
        assert started.wait(timeout=JOIN_S)
        with pytest.raises(RuntimeError, match="must not overlap"):
            pool.run(lambda i: None, grace_s=JOIN_S)
    finally:
        release.set()
        caller.join(timeout=JOIN_S)
        pool.shutdown()
    assert not caller.is_alive()


def test_pool_replaces_a_worker_stuck_after_an_error():
    """After one replica fails, a replica still busy after grace_s is abandoned for a fresh thread;
    the abandoned one exits once its task returns."""
    pool = ReplicaPool(DEVICES[:2], intra_op_threads=1)
    release = threading.Event()
    old = None
    try:
        pool.run(lambda i: None, grace_s=JOIN_S)
        old = pool.threads()[1]

        def task(i):
            if i == 0:
                raise RuntimeError("fail fast")
            release.wait(timeout=JOIN_S)

        results, errors, *_ = pool.run(task, grace_s=0.05)
        assert list(errors) == [0]
        assert pool.threads()[1] is not old and pool.threads()[1].is_alive()
        assert pool.run(lambda i: i * 2, grace_s=JOIN_S)[:2] == ([0, 2], {})
    finally:
        release.set()
        threads = pool.threads()
        pool.shutdown()
    for t in [old, *threads]:
        t.join(timeout=JOIN_S)
        assert not t.is_alive()


def test_stop_on_collect_shuts_the_pool_down():
    class Owner:
        pass

    owner, pool = Owner(), ReplicaPool(DEVICES[:2], intra_op_threads=1)
    replicas.stop_on_collect(owner, pool)
    pool.run(lambda i: None, grace_s=JOIN_S)
    threads = pool.threads()
    del owner
    gc.collect()
    for t in threads:
        t.join(timeout=JOIN_S)
        assert not t.is_alive()
