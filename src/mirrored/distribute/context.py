"""Replica and cross-replica contexts: which strategy is current, and which replica is running.

Each thread keeps a stack of frames (strategy, replica context or None). `strategy.scope()` pushes
(strategy, None): cross-replica context. A replica thread inside `strategy.run` pushes (strategy,
its ReplicaContext), and a merge_call function runs under (strategy, None) again. With no frame the
default strategy and its default replica context apply, as in tf.distribute. This stack is the only
process-wide mutable state of the package; new threads start with an empty one.
"""
from __future__ import annotations

import contextlib
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, NamedTuple

from torch.utils.hooks import RemovableHandle

from mirrored.distribute.values import Nested, ReduceOp

if TYPE_CHECKING:
    from mirrored.distribute.strategy import Strategy

_local = threading.local()


class _Frame(NamedTuple):
    strategy: Strategy
    replica_context: ReplicaContext | None  # None: cross-replica context


def _stack() -> list[_Frame]:
    try:
        return _local.stack
    except AttributeError:
        _local.stack = []
        return _local.stack


def _default_strategy() -> Strategy:
    from mirrored.distribute.strategy import default_strategy  # strategy.py builds on this module

    return default_strategy()


def _current() -> _Frame | None:
    stack = _stack()
    return stack[-1] if stack else None


@contextlib.contextmanager
def push(strategy: Strategy, replica_context: ReplicaContext | None) -> Iterator[None]:
    """Makes (strategy, replica_context) current on this thread until the block ends."""
    stack = _stack()
    stack.append(_Frame(strategy, replica_context))
    try:
        yield
    finally:
        stack.pop()


@contextlib.contextmanager
def enter_scope(strategy: Strategy) -> Iterator[None]:
    """`strategy.scope()`: refuses to mix two strategies; re-entering the same one is allowed."""
    frame = _current()
    if frame is not None and frame.strategy is not strategy and not frame.strategy._is_default:
        raise RuntimeError(
            f"cannot enter the scope of {strategy!r} inside the scope of {frame.strategy!r}: mixing two "
            "strategies is not supported (as in tf.distribute). Leave the first `with strategy.scope():` "
            "block before entering the second."
        )
    keep = frame.replica_context if frame is not None and frame.strategy is strategy else None
    with push(strategy, keep):
        for hook in list(_SCOPE_HOOKS.values()):
            hook()
        yield


# Called on every entry of a strategy's scope, inside it: a layer above (training/'s Keras adapter)
# registers what it must do then, since this package may not import it.
_SCOPE_HOOKS: OrderedDict[int, Callable[[], None]] = OrderedDict()  # (RemovableHandle refers to it weakly)


def register_scope_hook(hook: Callable[[], None]) -> RemovableHandle:
    """Runs `hook()` at every entry of a strategy's scope (inside it) until the handle's remove()."""
    handle = RemovableHandle(_SCOPE_HOOKS)
    _SCOPE_HOOKS[handle.id] = hook
    return handle


def get_strategy() -> Strategy:
    """The current strategy: the one whose scope (or run) this thread is in, else the default strategy."""
    frame = _current()
    return frame.strategy if frame is not None else _default_strategy()


def has_strategy() -> bool:
    """True inside a non-default strategy's scope or replica function."""
    frame = _current()
    return frame is not None and not frame.strategy._is_default


def in_cross_replica_context() -> bool:
    """True in a strategy's scope outside `strategy.run`, and inside a merge_call function."""
    frame = _current()
    return frame is not None and frame.replica_context is None


def get_replica_context() -> ReplicaContext | None:
    """The running replica's context; None in cross-replica context; the default one outside any strategy."""
    stack = getattr(_local, "stack", None)  # (_current() inlined: a replica step asks ~50 times)
    if not stack:
        return _default_strategy()._default_replica_context
    return stack[-1].replica_context


def replica_of(strategy: Strategy) -> ReplicaContext | None:
    """The context of the replica of `strategy` this thread runs, else None (cross-replica context,
    another strategy's replica, or no strategy). The one answer to "is this thread a replica of my
    strategy, and which?" for mirrored modules, optimizers and variables: `local_replica_id` of the
    result indexes their copies."""
    stack = getattr(_local, "stack", None)
    ctx = stack[-1].replica_context if stack else get_replica_context()
    return ctx if ctx is not None and ctx._strategy is strategy else None


def require_cross_replica(what: str) -> None:
    """Raises when called from inside `strategy.run` (replica context)."""
    frame = _current()
    if frame is not None and frame.replica_context is not None and not frame.strategy._is_default:
        raise RuntimeError(
            f"{what} must be called in cross-replica context (outside strategy.run, or inside a "
            "merge_call function); it was called from replica "
            f"{frame.replica_context.replica_id_in_sync_group}'s function."
        )


class ReplicaContext:
    """What a replica function sees of its strategy (tf.distribute.ReplicaContext)."""

    def __init__(self, strategy: Strategy, replica_id: int):
        self._strategy = strategy
        self._replica_id = replica_id
        self._step: Any = None  # the strategy's per-run state (collectives); set by strategy.run

    @property
    def strategy(self) -> Strategy:
        """The strategy whose `run` made this context."""
        return self._strategy

    @property
    def replica_id_in_sync_group(self) -> int:
        """This replica's id among all replicas in sync, 0..num_replicas_in_sync-1 (across workers too)."""
        # _replica_id indexes this process's replicas (their devices, module copies); the id in the
        # sync group counts every worker's replicas before this process's too.
        return self._strategy.first_replica_id + self._replica_id

    @property
    def local_replica_id(self) -> int:
        """This replica's index among this process's replicas: its device in
        `strategy.extended.worker_devices`, its copy in a mirrored object's `.values`. Equal to
        `replica_id_in_sync_group` except on the workers past the first of a multi-worker strategy."""
        return self._replica_id

    @property
    def num_replicas_in_sync(self) -> int:
        """How many replicas run the step together (every worker's); what a loss divides the batch by."""
        return self._strategy.num_replicas_in_sync

    @property
    def devices(self) -> tuple[str, ...]:
        """The device this replica runs on, as a 1-tuple (TF's ReplicaContext.devices), e.g. ("cpu:1",)."""
        return (self._strategy.extended.worker_devices[self._replica_id],)

    def all_reduce(self, reduce_op: ReduceOp | str, value: Nested, options: Any = None) -> Nested:
        """Reduces `value` (tensors, nested) across replicas; every replica gets the result."""
        del options  # communication hints: bucket sizes come from the strategy's cross-device ops
        return self._strategy._replica_all_reduce(self, reduce_op, value)

    def merge_call(self, merge_fn: Callable[..., Any], args: tuple = (), kwargs: dict | None = None) -> Any:
        """Pauses every replica, runs merge_fn(strategy, *merged_args) once in cross-replica context,
        and hands its result to every replica (each gets its own component of a PerReplica result)."""
        return self._strategy._merge_call(self, merge_fn, tuple(args), dict(kwargs or {}))

    def __enter__(self) -> ReplicaContext:
        self._cm = push(self._strategy, self)
        self._cm.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._cm.__exit__(*exc)

    def __repr__(self) -> str:
        return (f"ReplicaContext(replica_id_in_sync_group={self.replica_id_in_sync_group}, "
                f"num_replicas_in_sync={self.num_replicas_in_sync})")
