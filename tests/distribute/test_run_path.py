"""strategy.run's fast paths (issue 15) keep what run did before them: each replica gets its own
parts of PerReplica arguments wherever they sit, and its own copy of a mutable container; wrong
lengths are refused wherever they sit; a failed call leaves the pool's reused bookkeeping clean;
results are not kept alive between calls. Nothing here is timed (benchmarks/run_overhead.py is)."""
from __future__ import annotations

import gc
import weakref

import pytest
import torch

import mirrored.distribute as md
from _replicas import replica_id, strategy_of  # tests/_replicas.py


@pytest.mark.parametrize("n", [1, 2, 3])
def test_each_replica_gets_its_parts_at_top_level_nested_and_in_kwargs(n):
    s = strategy_of(n)
    parts = md.PerReplica([torch.tensor(float(10 * r)) for r in range(n)])
    others = md.PerReplica([f"r{r}" for r in range(n)])

    def fn(a, plain, b=None, nested=None, flag=None):
        return (a.item(), plain, b, nested["x"][0].item(), nested["x"][1], flag)

    got = s.experimental_local_results(s.run(fn, args=(parts, "p"), kwargs={
        "b": others, "nested": {"x": [parts, "same"]}, "flag": True}))
    # reference by hand: replica r sees its own component of every PerReplica, plain values as given
    assert [tuple(g) for g in got] == [
        (10.0 * r, "p", f"r{r}", 10.0 * r, "same", True) for r in range(n)]


def test_plain_arguments_reach_every_replica_unchanged():
    s = strategy_of(2)
    t = torch.arange(3)
    same = s.experimental_local_results(s.run(lambda x, k=None: (x, k), args=(t,), kwargs={"k": t}))
    assert all(x is t and k is t for x, k in same)


def test_a_mutable_container_argument_is_each_replicas_own_copy():
    """As TF's select_replica rebuilds nests: a replica appending to a list argument does not see
    another replica's append (replicas may run in either order)."""
    s = strategy_of(2)
    seen = s.run(lambda items, d: (items.append(replica_id()) or list(items), d.setdefault("r", replica_id())),
                 args=([], {}))
    assert sorted(map(tuple, s.experimental_local_results(seen))) == [([0], 0), ([1], 1)]


@pytest.mark.parametrize("where", ["args", "kwargs", "nested"])
def test_a_per_replica_of_the_wrong_length_is_refused_wherever_it_sits(where):
    s = strategy_of(2)
    bad = md.PerReplica([1, 2, 3])
    args, kwargs = {"args": ((bad,), {}), "kwargs": ((), {"v": bad}), "nested": (([{"a": (bad,)}],), {})}[where]
    with pytest.raises(ValueError, match="PerReplica of 3 values, but this strategy runs 2 replicas"):
        s.run(lambda *a, **k: None, args=args, kwargs=kwargs)
    assert s.run(lambda: replica_id()).values == (0, 1)  # nothing started: the next run is normal


def test_calls_after_a_failed_call_get_their_own_results():
    """The pool reuses its per-call bookkeeping: a call after a failure (an error, then a result per
    replica) must see no trace of the earlier call."""
    s = strategy_of(2)
    for i in range(3):
        with pytest.raises(ValueError, match=f"replica 1 \\(cpu:1\\): boom {i}"):
            s.run(lambda i=i: (_ for _ in ()).throw(ValueError(f"boom {i}")) if replica_id() == 1 else i)
        assert s.experimental_local_results(s.run(lambda i=i: (i, replica_id()))) == ((i, 0), (i, 1))
        assert s.run(lambda: None) is None


def test_results_are_not_kept_alive_between_calls():
    s = strategy_of(2)

    class Result:
        pass

    made = []

    def fn():
        r = Result()
        made.append(weakref.ref(r))
        return r

    out = s.run(fn)
    assert len(made) == 2
    del out
    gc.collect()
    assert all(ref() is None for ref in made), "the pool still holds the last call's results"


def test_nested_runs_are_still_refused():
    s = strategy_of(2)
    with pytest.raises(RuntimeError, match="strategy.run was called inside strategy.run"):
        s.run(lambda: s.run(lambda: None))
    assert s.run(lambda: replica_id()).values == (0, 1)
