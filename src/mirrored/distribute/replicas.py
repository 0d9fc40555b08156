"""Replica threads: one persistent worker per replica, run in lock-step around collectives.

`ReplicaPool.run(task)` hands `task(replica_id)` to every worker and waits for all of them; workers
live across steps, so a step costs two hand-offs per replica, not a thread start. `Rendezvous` is
how replicas meet inside a step (all_reduce, merge_call): each deposits a value, the last to
arrive may combine them once, and everyone gets the result. Like tf.distribute's
`_call_for_each_replica`, a replica that returns while others wait in a collective is an error,
and so is a replica that does not arrive within `timeout_s`; either way the waiting replicas are
released with an error naming who is missing, and an exception in one replica releases the others.
Uses torch and devices.py only.
"""
from __future__ import annotations

import _thread
import itertools
import logging
import queue
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import torch

from mirrored.distribute.values import Device

logger = logging.getLogger(__name__)

_STOP = object()
_POLL_S = 0.005  # how often the caller looks at the replicas after an interrupt


class CollectiveTimeoutError(TimeoutError):
    """A replica did not reach a collective within the strategy's timeout."""


class CollectiveMismatchError(RuntimeError):
    """Replicas made different sequences of collective calls (all_reduce / merge_call)."""


class _Released(Exception):
    """Raised in a replica that was waiting when another replica failed; the pool reports the cause."""


def _names(ids: Sequence[int], devices: Sequence[Device]) -> str:
    return ", ".join(f"{i} ({devices[i]})" for i in ids)


class Rendezvous:
    """The meeting point of N replica threads within one step.

    Built on raw locks rather than threading.Condition: a waiting replica blocks on a gate of its
    own, which whoever completes the meeting (or fails it) opens once the outcome is set, so a
    wake-up is one futex call and the woken thread takes no shared lock on its way out (only a
    wait that timed out does, to tell a real timeout from a gate opened just after it). A step
    makes one Rendezvous; its gates are made on first use, so a step without collectives costs
    one lock."""

    __slots__ = ("_devices", "_n", "_timeout_s", "_mutex", "_gates", "_waiting", "_generation", "_slots", "_whats",
                 "_arrived", "_combining", "_result", "_done", "error", "check")

    def __init__(self, devices: Sequence[Device], timeout_s: float):
        self._devices = tuple(devices)
        self._n = len(devices)
        self._timeout_s = timeout_s
        self._mutex = _thread.allocate_lock()  # guards every field below
        self._gates: list[Any] = [None] * self._n  # replica r blocks on _gates[r]; held unless opened for it
        self._waiting: set[int] = set()  # replicas blocked on their gates now
        self._generation = 0
        self._slots: list[Any] = [None] * self._n
        self._whats: list[str | None] = [None] * self._n
        self._arrived = 0
        self._combining = False
        self._result: Any = None
        self._done: set[int] = set()
        self.error: BaseException | None = None  # why this step failed, once it has
        # Called by the last replica to arrive at each meeting, before its outcome: raising fails the step
        # (strategy.run's watch over a step without the replica random mode).
        self.check: Callable[[], None] | None = None

    def exchange(self, replica_id: int, value: Any, what: str,
                 combine: Callable[[list[Any]], Any] | None = None) -> Any:
        """Blocks until every replica deposited a value. Returns combine(values) (computed once, by
        the last replica to arrive) or, without combine, the list of all values in replica order."""
        with self._mutex:
            self._check_can_join(replica_id, what)
            gen = self._generation
            self._slots[replica_id] = value
            self._whats[replica_id] = what
            self._arrived += 1
            if self._arrived < self._n:
                gate = self._gates[replica_id]
                if gate is None:
                    gate = self._gates[replica_id] = _thread.allocate_lock()
                    gate.acquire()
                self._waiting.add(replica_id)
                waiting = True
            else:
                waiting = False
                slots, whats = self._slots, self._whats
                self._slots, self._whats = [None] * self._n, [None] * self._n
                if any(w != what for w in whats):
                    calls = "; ".join(f"replica {i} called {w}" for i, w in enumerate(whats))
                    self._fail(CollectiveMismatchError(
                        f"replicas made different collective calls ({calls}). Every replica must make the same "
                        "merge_call()/all_reduce() calls in the same order."))
                    raise _Released(what)
                if self.check is not None:
                    try:
                        self.check()
                    except BaseException as e:
                        self._fail(e)
                        raise _Released(what) from None
                if combine is None:
                    return self._publish(slots)
                self._combining = True
        if waiting:
            return self._wait(gen, replica_id, what, gate)
        try:
            result = combine(slots)
        except BaseException as e:
            with self._mutex:
                self._combining = False
                self._fail(_Released(f"{what} failed in replica {replica_id}"), notify_only=True)
                self.error = self.error or e
            raise
        with self._mutex:
            self._combining = False
            return self._publish(result)

    def _publish(self, result: Any) -> Any:  # with the mutex held
        self._result = result
        self._arrived = 0
        self._generation += 1
        self._open_gates()
        return result

    def _open_gates(self) -> None:  # with the mutex held
        for i in self._waiting:
            self._gates[i].release()
        self._waiting.clear()

    def _wait(self, gen: int, replica_id: int, what: str, gate: Any) -> Any:
        deadline = time.monotonic() + self._timeout_s
        timeout = self._timeout_s
        while True:
            opened = gate.acquire(timeout=timeout) if timeout >= 0 else gate.acquire()
            if not opened:
                with self._mutex:
                    if replica_id not in self._waiting:
                        gate.acquire()  # opened (under the mutex we now hold) just after the timeout: take it
                        opened = True
                    elif not self._combining and time.monotonic() >= deadline:
                        missing = [i for i in range(self._n) if self._whats[i] is None]
                        waiting = [i for i in range(self._n) if self._whats[i] is not None]
                        self._fail(CollectiveTimeoutError(
                            f"{what}: replica {_names(missing, self._devices)} did not arrive within "
                            f"{self._timeout_s:g} s; replica {_names(waiting, self._devices)} waited for it. A "
                            "replica is hung, or skipped a collective the others made (raise "
                            "MirroredStrategy(timeout_s=...) if its work is just slow)."))
                        gate.acquire()  # _fail opened every gate, this one too
                        opened = True
                    else:  # the combine step is running (its duration is not a missed rendezvous), or
                        # the timeout woke us early: wait again, without a deadline while combining
                        timeout = -1 if self._combining else max(0.0, deadline - time.monotonic())
            if opened:  # opened under the mutex after the outcome was set, which stays until we meet again
                if self._generation != gen:
                    return self._result
                raise _Released(what)

    def _check_can_join(self, replica_id: int, what: str) -> None:
        if len(self._done) == self._n:  # not a replica of this step: it is over (a ReplicaContext kept past run)
            raise RuntimeError(
                f"{what} was called after the strategy.run that made its replica context had returned, so no "
                "replica can join it. Make collectives inside the replica function; run backward through "
                "ctx.all_reduce results inside the same strategy.run, where every replica runs it too.")
        if self.error is not None:
            raise _Released(what)
        if self._done:
            self._fail(CollectiveMismatchError(
                f"replica {replica_id} called {what}, but replica {_names(sorted(self._done), self._devices)} "
                "already returned from its function. Every replica must make the same "
                "merge_call()/all_reduce() calls (check for branches on replica_id or on the data)."))
            raise _Released(what)

    def finish(self, replica_id: int) -> None:
        """Replica `replica_id` returned from its function: nobody may wait for it any more."""
        with self._mutex:
            self._done.add(replica_id)
            if self._arrived and self.error is None:
                waiting = [i for i in range(self._n) if self._whats[i] is not None]
                what = self._whats[waiting[0]]
                self._fail(CollectiveMismatchError(
                    f"replica {_names([replica_id], self._devices)} returned from its function while replica "
                    f"{_names(waiting, self._devices)} waited in {what}. Some replicas made a different number "
                    "of merge_call()/all_reduce() calls."))

    def abort(self, error: BaseException) -> None:
        """Releases every waiting replica because `error` ended the step."""
        with self._mutex:
            self._fail(error)

    def _fail(self, error: BaseException, notify_only: bool = False) -> None:  # with the mutex held
        if self.error is None and not notify_only:
            self.error = error
        if not self._combining:
            self._open_gates()
        # else the meeting is complete and its result on the way: the combining replica publishes it to
        # everyone (all of them, or none, go on with it, e.g. apply reduced gradients), and the error
        # stops them at their next collective.


class _Run:
    """Bookkeeping of one `ReplicaPool.run` call. Workers record their outcome under `lock` and open
    `wake` (a raw lock the caller blocks on) when the last one finishes or one fails. The pool reuses
    it for the next call when every worker finished (no thread can touch it any more)."""

    __slots__ = ("lock", "wake", "woken", "pending", "results", "errors", "finished")

    def __init__(self, n: int):
        self.lock = _thread.allocate_lock()
        self.wake = _thread.allocate_lock()
        self.wake.acquire()
        self.woken = False
        self.reset(n)

    def reset(self, n: int) -> None:
        """Ready for a new call; no worker may hold this object any more."""
        if self.woken:  # opened by the last worker after the caller took it for an earlier error: close it
            self.wake.acquire()
        self.woken = False  # wake is open and not yet taken by the caller
        self.pending = n
        self.results: list[Any] = [None] * n
        self.errors: dict[int, BaseException] = {}
        self.finished = [False] * n


class Outcome(NamedTuple):
    """What `ReplicaPool.run` saw: each replica's result or error, which replicas finished (the others
    were abandoned), and the exception that interrupted the caller while it waited, if one did."""

    results: list[Any]
    errors: dict[int, BaseException]
    finished: list[bool]
    interrupted: BaseException | None


class _Worker:
    def __init__(self, replica_id: int, device: Device, intra_op: int):
        self.inbox: queue.SimpleQueue = queue.SimpleQueue()
        self.thread = threading.Thread(
            target=_worker_main, args=(self.inbox, replica_id, device, intra_op),
            name=f"mirrored-replica-{replica_id}-{device}", daemon=True)
        self.thread.start()


def _worker_main(inbox: queue.SimpleQueue, replica_id: int, device: Device, intra_op: int) -> None:
    # Runs on the replica's own thread, so these settings stay with the replica: torch's intra-op
    # thread count is per thread (OpenMP), and the current CUDA device is per thread.
    if device.startswith("cpu"):
        # ATen sets a thread's count lazily, at its first parallel op, from the last
        # torch.set_num_threads made by ANY thread, over one this thread made before: without this
        # read first, a replica could run with the count another thread set meanwhile (the summing
        # replica borrowing every core), a count that then depended on timing.
        torch.get_num_threads()
        torch.set_num_threads(intra_op)
    else:
        torch.cuda.set_device(torch.device(device))
    while True:
        item = inbox.get()
        if item is _STOP:
            return
        run, task = item
        try:
            result, error = task(replica_id), None
        except BaseException as e:  # noqa: BLE001 - everything reaches the caller of run()
            result, error = None, e
        with run.lock:
            if error is None:
                run.results[replica_id] = result
            else:
                run.errors[replica_id] = error
            run.finished[replica_id] = True
            run.pending -= 1
            if (run.pending == 0 or error is not None) and not run.woken:
                run.woken = True
                run.wake.release()
        del run, task, result, error, item


class ReplicaPool:
    """Persistent replica threads. Stop them with `shutdown()` (a strategy does it when collected)."""

    def __init__(self, devices: Sequence[Device], intra_op_threads: int):
        self._devices = tuple(devices)
        self._intra_op = intra_op_threads
        self._workers: list[_Worker] | None = None
        self._inboxes: list[queue.SimpleQueue] = []  # the workers', in replica order
        self._spare: _Run | None = None  # the last call's bookkeeping, when no worker holds it any more
        self._lock = threading.Lock()

    def _ensure_started(self) -> list[_Worker]:
        if self._workers is None:
            self._workers = [_Worker(i, d, self._intra_op) for i, d in enumerate(self._devices)]
            self._inboxes = [w.inbox for w in self._workers]
            logger.debug("started %d replica threads", len(self._workers))
        return self._workers

    def run(self, task: Callable[[int], Any], grace_s: float,
            abort: Callable[[BaseException], None] | None = None
            ) -> Outcome:
        """Runs task(replica_id) on every worker and returns the Outcome. After the first error, waits at most `grace_s` for the other replicas; a worker still
        busy then is abandoned and replaced, so the pool stays usable.

        An exception in the caller while it waits (Ctrl-C's KeyboardInterrupt, a signal handler's
        SystemExit) is returned as `interrupted` once every replica is quiescent: the first lets the
        step finish, so it is applied on every replica; a second calls `abort` (the replicas stop at
        their next collective, so the step is applied on none, unless they are past the gradient
        all-reduce, where all apply it) and waits `grace_s` at most; a third abandons the replicas."""
        if not self._lock.acquire(blocking=False):
            raise RuntimeError("strategy.run is already running on this strategy in another thread; "
                               "calls to run() on one strategy must not overlap.")
        try:
            n = len(self._ensure_started())
            run, self._spare = self._spare, None
            if run is None:
                run = _Run(n)
            else:
                run.reset(n)
            # Handed out in C, with no Python bytecode between the puts: an interrupt cannot land between
            # two of them and leave some replicas waiting in a step the others never start.
            list(map(queue.SimpleQueue.put, self._inboxes, itertools.repeat((run, task))))
            interrupted: BaseException | None = None
            interrupts = 0
            deadline = None
            while True:
                try:
                    if interrupted is None:
                        self._wait(run, deadline)
                    else:  # an interrupt may have landed between taking `wake` and noting it: poll instead
                        time.sleep(_POLL_S)
                    with run.lock:
                        if run.pending == 0:
                            if interrupted is None:  # `wake` is held again, and no worker holds `run`
                                self._spare = run
                            break
                        if run.errors and deadline is None:  # the others get grace_s to finish
                            deadline = time.monotonic() + grace_s
                        elif deadline is not None and time.monotonic() >= deadline:
                            break
                except BaseException as e:  # noqa: BLE001 - re-raised below, once the replicas are quiescent
                    interrupts += 1
                    interrupted = interrupted or e
                    if interrupts == 1:
                        logger.warning("%s: finishing the current step on every replica first (interrupt again "
                                       "to abandon the step)", type(e).__name__)
                    elif interrupts == 2:
                        logger.warning("%s again: abandoning the current step; waiting for the replicas to "
                                       "stop (interrupt again to leave them running)", type(e).__name__)
                        if abort is not None:
                            abort(e)
                        deadline = time.monotonic() + grace_s
                    else:
                        break
            finished = run.finished  # final once pending is 0 (the common case): no copy needed
            if run.pending:
                finished = list(finished)  # a snapshot: an abandoned worker may still finish
                self._replace([i for i, done in enumerate(finished) if not done])
            outcome = Outcome(run.results, run.errors, finished, interrupted)
            if self._spare is run:  # kept for the next call, which must not find this call's results in it
                run.results, run.errors, run.finished = [], {}, []
            return outcome
        finally:
            self._lock.release()

    @staticmethod
    def _wait(run: _Run, deadline: float | None) -> None:
        """Blocks until a worker opens `run.wake` (the last finished, or one failed) or `deadline`."""
        if deadline is None:
            run.wake.acquire()
            taken = True
        else:
            taken = run.wake.acquire(timeout=max(0.0, deadline - time.monotonic()))
        with run.lock:
            if run.woken:
                if not taken:
                    run.wake.acquire()  # opened (under run.lock) just after the timeout: take it
                run.woken = False

    def _replace(self, replica_ids: list[int]) -> None:
        assert self._workers is not None
        for i in replica_ids:
            old = self._workers[i]
            old.inbox.put(_STOP)  # it exits once its current task returns
            self._workers[i] = _Worker(i, self._devices[i], self._intra_op)
            self._inboxes[i] = self._workers[i].inbox
            logger.warning("replica %d (%s) did not finish after a failed step; started a new thread for it",
                           i, self._devices[i])

    def threads(self) -> list[threading.Thread]:
        return [w.thread for w in self._workers or []]

    def shutdown(self) -> None:
        """Asks every worker to exit after its current task. Does not join (may run in a finalizer)."""
        for w in self._workers or []:
            w.inbox.put(_STOP)
        self._workers = None
        self._inboxes = []


def stop_on_collect(owner: object, pool: ReplicaPool) -> weakref.finalize:
    """Shuts `pool` down when `owner` is garbage-collected (or at interpreter exit)."""
    return weakref.finalize(owner, pool.shutdown)
