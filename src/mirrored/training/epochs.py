"""fit's place in its epochs and its data, in one object: EpochIterator (as Keras's).

Model.fit makes one per call and draws each epoch's steps from it. It knows the epoch running, the
steps done in it and where the data is. With steps_per_epoch, epochs continue one pass of the data
(Keras: `ds.repeat()` with steps_per_epoch sees all of it) and a new pass starts only when one runs
out; without, every epoch is a pass of its own. get_state() gives that position as JSON, and
set_state(), called before the epochs start (in a callback's on_train_begin), makes fit resume
there: `initial_epoch` is Keras's `_initial_epoch`, the field a callback moves. The place in the data
is counted in examples, so a run resumed on another number of replicas whose global batch changed
with it trains on exactly the examples the interrupted pass had not reached. BackupAndRestore
saves and restores it through mr.train.Checkpoint, along with the weights, optimizer, metrics and
RNG. Uses the distributed iterator's get_state()/set_state().
"""
from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import Any

_END = object()


class EpochIterator:
    """The epochs of one fit() and their steps, in groups of steps_per_execution, resumable.

    The state, as get_state() returns it: {"epoch": the epoch running (the next one between epochs),
    "step": steps done in it, "data": the distributed iterator's position, "learning_rate": the rate
    from before that epoch's on_epoch_begin (None when it cannot be set: a schedule), which a resumed
    fit puts back so that a callback setting it (LearningRateScheduler) does not apply an epoch's
    change twice}."""

    def __init__(self, distributed: Iterable[Any], steps_per_epoch: int | None = None, steps_per_execution: int = 1,
                 initial_epoch: int = 0, learning_rate: Callable[[], float | None] | None = None,
                 max_learning_rate: float | None = None):
        self._distributed = distributed
        self._continuing = steps_per_epoch is not None
        self.num_batches = steps_per_epoch if steps_per_epoch is not None else len_or_none(distributed)
        self._per_execution = steps_per_execution
        self._learning_rate = learning_rate or (lambda: None)
        self.initial_epoch = initial_epoch  # the first epoch fit runs (Keras's model._initial_epoch)
        self.resume_learning_rate: float | None = None  # set_state's rate, for fit to put back
        self.max_learning_rate = max_learning_rate  # the most a restored rate may be: what the parameters hold
        self._epoch = initial_epoch
        self._step = 0
        self._epoch_rate: float | None = None
        self._it: Any = None  # the distributed iterator of the pass in progress
        self._pending: dict[str, Any] | None = None  # a restored position, applied when the next pass starts

    @property
    def step(self) -> int:
        """Steps done in the current epoch: before its first step, those a resumed run had done already."""
        return self._step

    @property
    def continues_passes(self) -> bool:
        """Whether epochs continue one pass of the data (steps_per_epoch given) rather than each being one."""
        return self._continuing

    @property
    def batches_per_pass(self) -> int | None:
        """The batches in one pass of the data, where the dataset knows it (for checking a saved state)."""
        return len_or_none(self._distributed)

    def epochs(self, epochs: int) -> Iterator[int]:
        """The epochs to run, from initial_epoch to `epochs` (exclusive). Call end_epoch() after each."""
        for epoch in range(self.initial_epoch, epochs):
            self._epoch = epoch
            self._epoch_rate = self._learning_rate()
            yield epoch

    def steps(self) -> Iterator[tuple[int, list[tuple[Any, int | None]]]]:
        """The current epoch's remaining steps: (first step index, [(distributed batch, global batch
        size), ...]) with up to steps_per_execution batches each. A step counts once it is handed out."""
        if self._it is None:
            self._it = iter(self._distributed)
            if self._pending is not None:
                self._it.set_state(self._pending)  # replays the pass up to where it was, in examples
                self._pending = None
                if not self._continuing:
                    # An epoch is the pass: its step is the pass's batch, of the size it has now (a global batch
                    # that changed with the replica count puts the same examples at another step).
                    self._step = self._it.get_state()["drawn"]
        group: list[tuple[Any, int | None]] = []
        first = self._step
        while self.num_batches is None or self._step < self.num_batches:
            it = self._it
            batch = next(it, _END)
            if batch is _END and self._continuing and self._step == 0:
                # The previous epoch took the pass's last batch; this epoch starts the next pass (an empty
                # dataset yields nothing here either).
                self._it = it = iter(self._distributed)
                batch = next(it, _END)
            if batch is _END:  # the pass ran out: the next epoch starts a new one
                self._it = None
                break
            self._step += 1
            # The iterator's global batch size: on a multi-worker strategy the local parts are not all of it.
            group.append((batch, getattr(it, "global_batch_size", None)))
            if len(group) == self._per_execution:
                yield first, group
                group, first = [], self._step
        if group:
            yield first, group

    def end_epoch(self) -> None:
        """The epoch's steps are over (all of them, or a callback stopped it): the state points at the next."""
        self._epoch += 1
        self._step = 0
        if not self._continuing:
            self._it = None

    # ---- resuming --------------------------------------------------------------------------------
    def get_state(self) -> dict[str, Any]:
        """Where fit is, as JSON (see the class docstring). Take it between steps."""
        if self._it is not None:
            data = self._it.get_state()
        elif self._pending is not None:
            data = self._pending
        else:  # between passes: the next one starts from the dataset's state now
            dataset = getattr(self._distributed, "dataset", None)
            data = {"dataset": dataset.get_state() if hasattr(dataset, "get_state") else None, "drawn": 0,
                    "examples": 0}
        rate = self._epoch_rate if self._step else self._learning_rate()
        return {"epoch": self._epoch, "step": self._step, "data": data, "learning_rate": rate}

    def set_state(self, state: dict[str, Any]) -> None:
        """Makes fit resume where get_state() was taken (in this process or another). Call it before
        the epochs start, e.g. in a callback's on_train_begin."""
        if not isinstance(state, dict) or any(k not in state for k in ("epoch", "step", "data")):
            raise ValueError(f"EpochIterator.set_state: expected the dict get_state() returned, got {state!r:.200}.")
        epoch, step, rate = state["epoch"], state["step"], state.get("learning_rate")
        if any(isinstance(v, bool) or not isinstance(v, int) or v < 0 for v in (epoch, step)):
            raise ValueError(f"EpochIterator.set_state: epoch {epoch!r} and step {step!r} must be ints >= 0.")
        if rate is not None and (isinstance(rate, bool) or not isinstance(rate, (int, float))
                                 or not 0 <= rate < float("inf")):
            raise ValueError(f"EpochIterator.set_state: learning_rate {rate!r:.40} must be None or a number >= 0.")
        self.initial_epoch = self._epoch = epoch
        self._step = step
        self._it, self._pending = None, state["data"]
        self.resume_learning_rate = state.get("learning_rate")

    def __repr__(self) -> str:
        return f"EpochIterator(epoch={self._epoch}, step={self._step}, steps_per_epoch={self.num_batches})"


def len_or_none(dataset: Any) -> int | None:
    """len(dataset) when it has a finite, known one; None otherwise (a generator, an unknown size)."""
    try:
        n = len(dataset)
    except TypeError:
        return None
    return n if n >= 0 else None
