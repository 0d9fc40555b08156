"""Background threads for `Dataset`: parallel map, prefetch and parallel interleave.

`threaded_iter` runs `fn` over an upstream iterator on `num_workers` threads with at most
`max_in_flight` elements taken from upstream but not yet handed to the consumer, and returns a
generator yielding the results (in input order when deterministic). prefetch is the same stage
with one worker and no fn. Uses the standard library only.

Hand-offs go through two `queue.SimpleQueue`s (C code, no Python-level lock per element):
`credits` (tokens a worker takes before pulling an element; the consumer returns one per element
it yields, which is what bounds the buffer) and `results` ((index, kind, value) from the workers).
Workers take turns on the upstream iterator under one lock, since iterators are not thread-safe.
The generator's `finally` (run on exhaustion, error, .close(), or when the generator is
garbage-collected) stops the workers, joins them, then closes upstream, so no thread outlives it.
"""
from __future__ import annotations

import sys
import threading
from collections.abc import Callable, Iterator
from queue import SimpleQueue
from typing import Any

AUTOTUNE = -1
_OK, _END, _ERROR, _UPSTREAM_ERROR = 0, 1, 2, 3


def add_note(error: BaseException, note: str) -> None:
    if note not in getattr(error, "__notes__", ()):
        error.add_note(note)


def close_iterator(it: Any) -> None:
    close = getattr(it, "close", None)
    if close is not None:
        close()


class _Shared:
    """What the workers of one stage share: the upstream iterator and whether to stop."""

    __slots__ = ("upstream", "lock", "next_index", "done", "stop", "gate")

    def __init__(self, upstream: Iterator[Any], gate: threading.Semaphore | None):
        self.upstream = upstream
        self.lock = threading.Lock()
        self.next_index = 0
        self.done = False  # upstream ended or failed: pull nothing more
        self.stop = False  # the consumer is gone
        self.gate = gate


def _worker(shared: _Shared, fn: Callable[..., Any] | None, what: str,
            credits: SimpleQueue, results: SimpleQueue) -> None:
    lock, upstream, gate = shared.lock, shared.upstream, shared.gate
    while credits.get() and not shared.stop:
        if gate is not None:
            gate.acquire()
        try:
            with lock:
                if shared.done or shared.stop:
                    return
                index = shared.next_index
                try:
                    element = next(upstream)
                except StopIteration:
                    shared.done = True
                    results.put((index, _END, None))
                    return
                except BaseException as e:  # noqa: BLE001 - handed to the consumer, raised there
                    shared.done = True
                    results.put((index, _UPSTREAM_ERROR, e))
                    return
                shared.next_index = index + 1
        finally:
            if gate is not None:
                gate.release()
        if fn is None:
            results.put((index, _OK, element))
            continue
        try:
            value = fn(*element) if type(element) is tuple else fn(element)
        except BaseException as e:  # noqa: BLE001
            add_note(e, f"in Dataset.{what} function, element {index}")
            results.put((index, _ERROR, e))
            continue
        results.put((index, _OK, value))


def threaded_iter(upstream: Iterator[Any], fn: Callable[..., Any] | None, *, num_workers: int,
                  max_in_flight: int, deterministic: bool, what: str,
                  gate: threading.Semaphore | None = None) -> Iterator[Any]:
    """Starts the workers now and returns the generator that yields their results."""
    gen = _consume(upstream, fn, num_workers, max_in_flight, deterministic, what, gate)
    next(gen)  # runs up to the first `yield`, so the finally clause is armed from here on
    return gen


def _consume(upstream: Iterator[Any], fn: Callable[..., Any] | None, num_workers: int,
             max_in_flight: int, deterministic: bool, what: str,
             gate: threading.Semaphore | None) -> Iterator[Any]:
    shared = _Shared(upstream, gate)
    credits: SimpleQueue = SimpleQueue()
    results: SimpleQueue = SimpleQueue()
    for _ in range(max_in_flight):
        credits.put(True)
    workers = [
        threading.Thread(target=_worker, args=(shared, fn, what, credits, results),
                         name=f"mirrored.data.{what}-{k}", daemon=True)
        for k in range(num_workers)
    ]
    try:
        for w in workers:
            w.start()
        yield None  # primer, consumed by threaded_iter
        get, give_back = results.get, credits.put
        if deterministic:
            waiting: dict[int, tuple[int, Any]] = {}
            want = 0
            while True:
                item = waiting.pop(want, None)
                while item is None:
                    index, kind, value = get()
                    if index == want:
                        item = (kind, value)
                    else:
                        waiting[index] = (kind, value)
                kind, value = item
                if kind == _OK:
                    want += 1
                    give_back(True)
                    yield value
                elif kind == _END:
                    return
                else:
                    raise value
        else:
            delivered, end_at, end_error = 0, None, None
            while end_at is None or delivered < end_at:
                index, kind, value = get()
                if kind == _OK:
                    delivered += 1
                    give_back(True)
                    yield value
                elif kind == _END:
                    end_at = index
                elif kind == _UPSTREAM_ERROR:  # after the elements pulled before it, as if in order
                    end_at, end_error = index, value
                else:
                    raise value
            if end_error is not None:
                raise end_error
    finally:
        shared.stop = True
        for _ in workers:
            credits.put(False)
        # at interpreter exit daemon workers die with the process and may no longer be joinable
        if not sys.is_finalizing():
            me = threading.current_thread()
            for w in workers:
                if w is not me and w.ident is not None:
                    w.join()
            close_iterator(upstream)
