"""DistributedIterator.get_state()/set_state() (issue 13): an iterator restored from a state, in a new
iterator of the same pipeline (as in another process), yields exactly the batches the original had
left, as TF restores a tf.data iterator from a checkpoint."""
from __future__ import annotations

import json
import threading

import pytest
import torch

import mirrored as mr
import mirrored.distribute as md
from mirrored.data import _pipeline as pipeline_nodes
from _replicas import strategy_of  # tests/_replicas.py


def _pipeline() -> mr.data.Dataset:
    """Built afresh each call, as a restarted process builds it: the shuffle's seed fixes each pass."""
    return mr.data.Dataset.range(23).shuffle(23, seed=3).batch(4).repeat(3)


def _rest(iterator) -> list[list[int]]:
    return [[int(v) for part in batch.values for v in part] if isinstance(batch, md.PerReplica)
            else batch.tolist() for batch in iterator]


@pytest.mark.parametrize("replicas", [1, 2])
def test_a_restored_iterator_goes_on_with_the_original_batches(replicas):
    strategy = strategy_of(replicas)
    dataset = _pipeline()
    dist = strategy.experimental_distribute_dataset(dataset)
    iter(dist)  # a pass before this one: the state must say which pass the iterator is on
    original = iter(dist)
    for _ in range(8):  # into the second repetition (6 batches a repetition)
        next(original)
    state = json.loads(json.dumps(original.get_state()))  # JSON, as a checkpoint holds it
    assert state["drawn"] == 8
    want = _rest(original)

    restored = iter(strategy.experimental_distribute_dataset(_pipeline()))
    restored.set_state(state)
    assert restored.get_state() == state
    assert _rest(restored) == want and len(want) == 18 - 8


def test_a_dataset_without_state_is_replayed_from_its_start():
    batches = [torch.full((2,), float(i)) for i in range(5)]
    strategy = strategy_of(1)
    original = iter(strategy.experimental_distribute_dataset(batches))
    next(original), next(original)
    state = original.get_state()
    assert state == {"dataset": None, "drawn": 2, "examples": 4}
    restored = iter(strategy.experimental_distribute_dataset(batches))
    restored.set_state(state)
    assert [float(b[0]) for b in restored] == [2.0, 3.0, 4.0]


def test_states_that_do_not_fit_are_refused():
    strategy = strategy_of(1)
    short = iter(strategy.experimental_distribute_dataset(mr.data.Dataset.range(8).batch(4)))
    with pytest.raises(ValueError, match="the state is 5 batches into the pass, but the dataset ran out after 2"):
        short.set_state({"dataset": None, "drawn": 5})
    with pytest.raises(ValueError, match="the state is 9 examples into the pass, but the dataset ran out after 8"):
        short.set_state({"dataset": None, "drawn": 2, "examples": 9})
    with pytest.raises(ValueError, match="expected the dict get_state"):
        short.set_state({"drawn": -1})
    with pytest.raises(ValueError, match="expected the dict get_state"):
        short.set_state({"drawn": 1, "examples": "4"})
    plain = iter(strategy.experimental_distribute_dataset([torch.zeros(2)]))
    with pytest.raises(ValueError, match="has no set_state"):
        plain.set_state({"dataset": _pipeline().get_state(), "drawn": 0})
    other = iter(strategy.experimental_distribute_dataset(mr.data.Dataset.range(8).batch(4)))
    with pytest.raises(ValueError, match="Restore it into the same pipeline"):
        other.set_state({"dataset": _pipeline().get_state(), "drawn": 0})


@pytest.mark.parametrize("wrong", ["another pipeline's state", "too many batches"])
def test_a_refused_state_leaves_the_iterator_where_it_was(wrong):
    """set_state ends the running pass before it restores (issue 25); a state the dataset refuses then
    left the iterator on a closed pass, which ended early as if the epoch were over (found in review)."""
    strategy = strategy_of(2)
    def first_pass():
        return iter(strategy.experimental_distribute_dataset(mr.data.Dataset.range(16).shuffle(16, seed=2).batch(4)))
    reference = _rest(first_pass())
    it = first_pass()
    first = _rest([next(it)])
    bad = ({"dataset": _pipeline().get_state(), "drawn": 0} if wrong == "another pipeline's state"
           else {"dataset": it.get_state()["dataset"], "drawn": 9})
    with pytest.raises(ValueError):
        it.set_state(bad)
    assert first + _rest(it) == reference  # this pass's four batches, once each, in order


def test_a_prefetch_thread_that_starts_late_does_not_move_the_restored_pass(monkeypatch):
    """Issue 25 (a fit resumed by BackupAndRestore ended off the uninterrupted run's weights, in 1
    full-suite run of 6): set_state restored the dataset's state, then closed the pass that iter() had
    started. That pass's prefetch thread, where it started its shuffle's pass only after the restore,
    counted one pass more, and the restored pass was shuffled as the next one. Forced here: the thread
    starts its pass once the state is restored (or after 1 s, where set_state closed the pass first)."""
    def pipeline() -> mr.data.Dataset:
        return mr.data.Dataset.range(12).shuffle(12, seed=5).batch(4).prefetch(1)  # fit adds prefetch(1) too

    strategy = strategy_of(2)
    dist = strategy.experimental_distribute_dataset(pipeline())
    iter(dist)  # a pass before: the state is of pass 1
    original = iter(dist)
    next(original)
    state = json.loads(json.dumps(original.get_state()))
    want = _rest(original)
    assert len(want) == 2

    restored_state = threading.Event()
    shuffle_iterate, dataset_set_state = pipeline_nodes.Shuffle.iterate, mr.data.Dataset.set_state

    def late_pass(self, probe):
        if not probe and threading.current_thread() is not threading.main_thread():  # the prefetch thread
            restored_state.wait(timeout=1.0)
        return shuffle_iterate(self, probe)

    def set_state(self, s):
        dataset_set_state(self, s)
        restored_state.set()

    monkeypatch.setattr(pipeline_nodes.Shuffle, "iterate", late_pass)
    monkeypatch.setattr(mr.data.Dataset, "set_state", set_state)
    restored = iter(strategy.experimental_distribute_dataset(pipeline()))
    restored.set_state(state)
    assert _rest(restored) == want


def _examples(iterator) -> list[int]:
    return [v for batch in _rest(iterator) for v in batch]


@pytest.mark.parametrize("replicas, batch, resumed_replicas, resumed_batch", [
    (2, 4, 3, 6),   # a global batch of 2 per replica: 8 examples in, the position falls inside batch 1 of 6
    (2, 4, 1, 2),   # 4 whole batches of 2
    (3, 6, 2, 4),   # 12 examples in: on a batch boundary of the new size too
    (2, 4, 3, 5)])  # any size: 8 examples in, 3 left of the batch of 5 they fall in
def test_the_position_is_in_examples_so_a_changed_global_batch_resumes_exactly(replicas, batch, resumed_replicas,
                                                                                resumed_batch):
    """Issue 36: a script batching by per-replica size x num_replicas_in_sync, resumed on another replica count,
    gets another global batch. The restored iterator hands out exactly the examples the original had not: the
    rest of the batch the position falls in, then whole batches of the new size; and its state counts the
    same examples and the new size's batches."""
    def pipeline(size):
        return mr.data.Dataset.range(23).shuffle(23, seed=3).batch(size)

    original = iter(strategy_of(replicas).experimental_distribute_dataset(pipeline(batch)))
    for _ in range(2):
        next(original)
    state = json.loads(json.dumps(original.get_state()))
    assert state["examples"] == 2 * batch
    want = _examples(original)

    strategy = strategy_of(resumed_replicas)
    restored = iter(strategy.experimental_distribute_dataset(pipeline(resumed_batch)))
    restored.set_state(state)
    assert restored.get_state()["examples"] == 2 * batch
    assert restored.get_state()["drawn"] == 2 * batch // resumed_batch  # whole batches of the new size read past
    got = []
    for step in restored:
        parts = step.values if isinstance(step, md.PerReplica) else (step,)
        got += [int(v) for part in parts for v in part]
        if len(got) + 2 * batch < 23:  # every step but the last holds a whole batch, or the rest of one
            assert restored.get_state()["examples"] == 2 * batch + len(got)
    assert got == want and len(got) == 23 - 2 * batch
