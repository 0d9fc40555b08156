"""EpochIterator (issue 13): fit's epochs, their steps and the data position in one resumable object.
Driven here as Model.fit drives it, with batches that say where they come from."""
from __future__ import annotations

import json

import pytest

import mirrored as mr
from mirrored.training.epochs import EpochIterator


def _distributed(n_batches: int = 5, shuffled: bool = True):
    ds = mr.data.Dataset.range(n_batches * 2)
    if shuffled:
        ds = ds.shuffle(n_batches * 2, seed=7)
    return mr.OneDeviceStrategy("cpu:0").experimental_distribute_dataset(ds.batch(2))


def _run(it: EpochIterator, epochs: int, groups: int | None = None) -> list:
    """fit's loop: (epoch, first step, [first element of each batch]) per group; returns after `groups`
    groups, as a run that dies after a step (its state is taken at that step's end)."""
    seen = []
    for epoch in it.epochs(epochs):
        for step, group in it.steps():
            seen.append((epoch, step, [int(batch[0]) for batch, _ in group]))
            if len(seen) == groups:
                return seen
        it.end_epoch()
    return seen


@pytest.mark.parametrize("steps_per_epoch", [None, 3])
@pytest.mark.parametrize("per_execution", [1, 2])
def test_a_new_iterator_set_to_the_state_goes_on_as_the_first_would(steps_per_epoch, per_execution):
    """Without steps_per_epoch every epoch is a new pass (5 batches); with 3, epochs continue one pass,
    and once it runs out (in epoch 1: 2 batches) the next epoch starts another."""
    whole = _run(EpochIterator(_distributed(), steps_per_epoch, per_execution), epochs=4)
    for stop in range(1, len(whole)):
        first = EpochIterator(_distributed(), steps_per_epoch, per_execution)
        done = _run(first, epochs=4, groups=stop)
        state = json.loads(json.dumps(first.get_state()))
        epoch, step, batches = whole[stop - 1]
        assert (state["epoch"], state["step"]) == (epoch, step + len(batches))
        second = EpochIterator(_distributed(), steps_per_epoch, per_execution)
        second.set_state(state)
        assert second.initial_epoch == epoch and second.step == step + len(batches)
        assert done + _run(second, epochs=4) == whole, stop


def test_an_epoch_that_finds_the_pass_taken_starts_the_next_one():
    """6 batches, 3 steps an epoch: epoch 1 takes the pass's last batch without seeing its end; epoch 2
    starts the next pass instead of being empty (so does a run resumed from epoch 2's start)."""
    whole = _run(EpochIterator(_distributed(6), steps_per_epoch=3), epochs=4)
    assert [(epoch, step) for epoch, step, _ in whole] == [(e, s) for e in range(4) for s in range(3)]
    assert [b for _, _, b in whole[6:]] != [b for _, _, b in whole[:6]]  # the second pass is reshuffled
    first = EpochIterator(_distributed(6), steps_per_epoch=3)
    done = _run(first, epochs=2)
    second = EpochIterator(_distributed(6), steps_per_epoch=3)
    second.set_state(first.get_state())
    assert done + _run(second, epochs=4) == whole


def test_an_epoch_boundary_state_starts_the_next_epoch_and_records_the_rate_before_it():
    rates = iter([0.5, 0.25, 0.125])
    it = EpochIterator(_distributed(), learning_rate=lambda: next(rates))
    epochs = it.epochs(3)
    next(epochs)  # epoch 0 begins: the rate 0.5 is recorded before its on_epoch_begin
    list(it.steps())
    assert it.get_state()["learning_rate"] == 0.5  # mid-epoch (all steps done but not ended): its start rate
    it.end_epoch()
    state = it.get_state()  # at the boundary: the rate now, for epoch 1
    assert (state["epoch"], state["step"], state["learning_rate"]) == (1, 0, 0.25)
    resumed = EpochIterator(_distributed())
    resumed.set_state(state)
    assert resumed.resume_learning_rate == 0.25 and list(resumed.epochs(3)) == [1, 2]


def test_bad_states_are_refused():
    it = EpochIterator(_distributed())
    with pytest.raises(ValueError, match="expected the dict get_state"):
        it.set_state({"epoch": 1})
    with pytest.raises(ValueError, match="must be ints >= 0"):
        it.set_state({"epoch": -1, "step": 0, "data": None})
