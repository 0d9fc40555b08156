"""strategy.run's path around the replica function: its options, what each replica thread gets, and
the checks.

RunOptions is what run's `options` may say (tf.distribute.RunOptions, and whether the function may be
run again). _argument_split() decides once per run how the caller's arguments reach the replicas (as they are,
a PerReplica picked per replica, or a nest rebuilt per replica) and _replica_arguments() gives one
replica its own; _caller_modes() and _entered() carry the caller's autograd and autocast modes
into the replica threads, which do not inherit them; _run_result() turns the replicas' results
into run's result. refuse_nested_run() refuses a run where none may start (inside a replica
function, a merge_call function, another strategy's scope) and step_error() picks the error a
failed step raises, named by replica. Used by strategy.py only. Uses context.py, replicas.py and
values.py.
"""
from __future__ import annotations

import contextlib
import copy
import dataclasses
import itertools
import threading
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch

from mirrored.distribute import context, replicas
from mirrored.distribute.values import DistributedValues, flatten, regroup, select_replica

if TYPE_CHECKING:
    from mirrored.distribute.strategy import Strategy

@dataclasses.dataclass(frozen=True)
class RunOptions:
    """How strategy.run may run its function (tf.distribute.RunOptions, which takes TF's fields; they
    have no effect here).

    Args:
      rerunnable: the function notes in the step journal everything it changes before its update -
        it changes state only through mirrored modules, optimizers, metrics and variables, with no
        Python side effects before optimizer.step() - so a step can be rolled back and run again up
        to its update. A rerunnable function whose first step drew no random numbers then runs
        without the replica random mode, which costs a few percent per step on CPU replicas, and is
        run again with it in the one step where it draws. fit, evaluate and predict pass it for
        mr.Model's own steps; by default a function keeps the mode in every step.
    """

    rerunnable: bool = False
    experimental_enable_dynamic_batch_size: bool = True
    experimental_bucketizing_dynamic_shape: bool = False
    experimental_xla_options: Any = None

    def __post_init__(self) -> None:
        if not isinstance(self.rerunnable, bool):
            raise TypeError(f"RunOptions(rerunnable={self.rerunnable!r}): give True or False.")


_DEFAULT_OPTIONS = RunOptions()

# How strategy.run hands its arguments to each replica (see _argument_split).
_SHARED, _FLAT, _NESTED = 0, 1, 2


def _caller_modes() -> tuple[Any, ...]:
    """The caller's thread-local autograd and autocast modes, which replica threads do not inherit
    (torch keeps them per thread): `with torch.no_grad(): strategy.run(f)` must run f without grad
    on every replica, as torch's DataParallel propagates them. Empty in the common case (grad on,
    no inference mode, no autocast), which costs nothing per replica."""
    if torch.is_grad_enabled() and _any_autocast is not None and not _any_autocast():
        return ()  # the common case in two calls (inference mode turns grad off, so it is excluded too)
    modes: list[Any] = []
    if torch.is_inference_mode_enabled():
        modes.append(torch.inference_mode())
    elif not torch.is_grad_enabled():
        modes.append(torch.no_grad())
    for device_type in ("cpu", "cuda"):
        if torch.is_autocast_enabled(device_type):
            modes.append(torch.autocast(device_type, dtype=torch.get_autocast_dtype(device_type)))
    return tuple(modes)


_any_autocast = getattr(torch._C, "_is_any_autocast_enabled", None)  # one call for every device type


def _run_result(results: list[Any]) -> Any:
    """strategy.run's result from the replicas' results: regroup's, with its first answer (every
    replica returned the same object, None say) found without its walk."""
    first = results[0]
    for result in results:
        if result is not first:
            return regroup(results, where="strategy.run")
    return first


def _argument_split(args: tuple, kwargs: dict, n: int) -> int:
    """How run() gives each of its `n` replicas its arguments, once it checked every PerReplica's length:
    _SHARED (no distributed value, no container: every replica gets them as they are), _FLAT (only
    top-level values, some distributed: a comprehension picks each replica's) or _NESTED
    (select_replica, which rebuilds every list, dict and tuple, so each replica has its own copy of
    a mutable container, as in TF)."""
    if not args and not kwargs:
        return _SHARED
    nested = False
    for value in itertools.chain(args, kwargs.values()):
        if isinstance(value, (list, tuple, dict)):
            nested = True
            break
    split = _NESTED if nested else _SHARED
    for leaf in flatten((args, kwargs)) if nested else itertools.chain(args, kwargs.values()):
        if isinstance(leaf, DistributedValues):
            if len(leaf.values) != n:
                raise ValueError(f"strategy.run: an argument is a {type(leaf).__name__} of {len(leaf.values)} "
                                 f"values, but this strategy runs {n} replica{'s' if n > 1 else ''} here. Pass what "
                                 "this strategy made (its distributed dataset, run results, "
                                 "experimental_distribute_values_from_function).")
            if not nested:
                split = _FLAT
    return split


def _replica_arguments(replica_id: int, args: tuple, kwargs: dict, split: int) -> tuple[tuple, dict]:
    """Replica `replica_id`'s positional and keyword arguments (`split` from _argument_split)."""
    if split == _SHARED:
        return args, kwargs
    if split == _FLAT:
        return (tuple(a.values[replica_id] if isinstance(a, DistributedValues) else a for a in args),
                {k: v.values[replica_id] if isinstance(v, DistributedValues) else v for k, v in kwargs.items()})
    return select_replica(replica_id, args), select_replica(replica_id, kwargs)


@contextlib.contextmanager
def _entered(modes: tuple[Any, ...]) -> Iterator[None]:
    if not modes:
        yield
        return
    with contextlib.ExitStack() as stack:
        for mode in modes:
            stack.enter_context(copy.copy(mode))  # a context manager object is entered once per thread
        yield


_inline_runs = threading.local()  # per thread: how deep in an inline (one-replica) run we are


def refuse_nested_run(strategy: Strategy, frame: context._Frame | None) -> None:
    """Raises where run() may not start: inside a replica function, a merge_call function, or the
    scope of another strategy."""
    if frame is not None and frame.replica_context is not None and not frame.strategy._is_default:
        raise RuntimeError("strategy.run was called inside strategy.run (from replica "
                           f"{frame.replica_context.replica_id_in_sync_group}'s function). Call the inner "
                           "function directly: it already runs on every replica.")
    if strategy._is_default:  # its scope holds its replica context too: a run is told apart by _inline_runs
        if getattr(_inline_runs, "depth", 0):
            raise RuntimeError("strategy.run was called inside strategy.run of the default strategy (TF "
                               "refuses this too). Call the inner function directly.")
    elif frame is not None and any(f.strategy is strategy and f.replica_context is not None
                                   for f in context._stack()):
        raise RuntimeError("strategy.run was called inside a merge_call function, while the replicas wait in "
                           "that merge_call; this is not supported. Return what you need from merge_fn and "
                           "call run() after the current step.")
    if frame is not None and frame.strategy is not strategy and not frame.strategy._is_default:
        # TF's run enters this strategy's scope, which refuses to nest in another strategy's.
        raise RuntimeError(f"{strategy!r}.run was called inside the scope of {frame.strategy!r}: mixing two "
                           "strategies is not supported (as in tf.distribute). Leave the other strategy's "
                           "scope first.")


def step_error(strategy: Strategy, errors: dict[int, BaseException], step: replicas.Rendezvous) -> BaseException:
    """The exception a failed step raises: the first replica's own error, named by replica."""
    for rid in sorted(errors):
        e = errors[rid]
        if not isinstance(e, replicas._Released):
            prefix = f"replica {rid} ({strategy._devices[rid]}): "
            if len(e.args) == 1 and isinstance(e.args[0], str) and not e.args[0].startswith(prefix):
                e.args = (prefix + e.args[0],)
            else:
                e.add_note(f"raised in {prefix.rstrip(': ')} of {strategy.num_replicas_in_sync}")
            return e
    if step.error is not None:
        return step.error
    return RuntimeError("strategy.run failed without an error from any replica (internal error).")
