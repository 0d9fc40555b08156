"""Strategies: MirroredStrategy, OneDeviceStrategy and the default strategy.

One `Strategy` class does the work; the three differ only in their devices and in whether replicas
run on threads. `run` hands the function to one persistent thread per replica (a single replica runs
inline, on the caller's thread); replicas meet in collectives through a per-run `Rendezvous`;
cross-replica `reduce`/`gather` combine `PerReplica` values on the first replica's device.
What run hands each replica thread, and its checks, are in _run_path.py; what the replicas keep
between in-step all-reduces in _replica_reduce.py; the leaf-by-leaf work of reduce and gather in
_cross_replica.py; a mirrored optimizer's gradients meet in reducer.py, over `_communicator()`.
Uses every other module of `distribute/` but multi_worker.py.
"""
from __future__ import annotations

import itertools
import logging
import threading
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor
from torch.nn.parameter import is_lazy

from mirrored.distribute import buckets, context, devices, guards, replicas, rollback
from mirrored.distribute import random as replica_random
from mirrored.distribute._cross_replica import (_as_tensor, _bitwise_equal, _component, _local_copies, gather_leaf,
                                                reduce_leaves)
from mirrored.distribute._replica_reduce import (_DIRECT_NUMEL, _VALUE_LAYOUTS_KEPT, _AllReduceFunction, _recent,
                                                 _replica_entry)
from mirrored.distribute._run_path import (_DEFAULT_OPTIONS, RunOptions, _argument_split, _caller_modes,
                                           _entered, _inline_runs, _replica_arguments, _run_result, refuse_nested_run,
                                           step_error)
from mirrored.distribute.context import ReplicaContext
from mirrored.distribute.cross_device_ops import (CrossDeviceOps, Disagreement, as_reduce_op, default_for,
                                                mean_of_sum, shape_mismatch, shapes_of)
from mirrored.distribute.devices import intra_op_threads, resolve_devices, torch_device
from mirrored.distribute.reducer import Communicator, GradientReducer
from mirrored.distribute.values import (Device, DistributedValues, Nested, ReduceOp, flatten, is_nested, map_structure,
                                        pack_sequence_as, regroup, select_replica)

if TYPE_CHECKING:  # input.py is imported where it is used (as before); the names are for annotations
    from mirrored.distribute.input import DistributedDataset, DistributedDatasetsFromFunction, InputOptions

logger = logging.getLogger(__name__)

DEFAULT_TIMEOUT_S = 300.0  # a collective waits this long for a missing replica before failing
_WATCHED_KEPT = 256  # replica functions remembered as guarded already (as guards.py remembers them)


class OutOfSyncError(RuntimeError):
    """The copies of a mirrored object differ (raised by `strategy.check_in_sync`, and by a step whose
    replicas find their module copies different when their gradients meet)."""


class ValueContext:
    """What `experimental_distribute_values_from_function` tells its function (tf.distribute.ValueContext)."""

    def __init__(self, replica_id_in_sync_group: int = 0, num_replicas_in_sync: int = 1):
        self.replica_id_in_sync_group = replica_id_in_sync_group
        self.num_replicas_in_sync = num_replicas_in_sync

    def __repr__(self) -> str:
        return (f"ValueContext(replica_id_in_sync_group={self.replica_id_in_sync_group}, "
                f"num_replicas_in_sync={self.num_replicas_in_sync})")


class StrategyExtended:
    """tf.distribute's `strategy.extended`: a thin shim; the work is done by the strategy and variables.py."""

    def __init__(self, strategy: Strategy):
        self._strategy = strategy

    @property
    def worker_devices(self) -> tuple[Device, ...]:
        return self._strategy._devices

    @property
    def parameter_devices(self) -> tuple[Device, ...]:
        return self._strategy._devices

    @property
    def cross_device_ops(self) -> CrossDeviceOps:
        return self._strategy._cross_device_ops

    def update(self, var: Any, fn: Callable[..., Any], args: tuple = (), kwargs: dict | None = None,
               group: bool = True) -> Any:
        """Calls fn(copy, *args, **kwargs) on each copy of `var`, with that replica's part of every
        PerReplica / Mirrored argument (TF's update); inside strategy.run it does so once, through a
        merge_call. group=True returns a Mirrored of the results, group=False a tuple per result."""
        from mirrored.distribute import variables

        args, kwargs = tuple(args), dict(kwargs or {})
        strategy = self._strategy
        ctx = context.get_replica_context()
        if ctx is not None and not strategy._is_default and ctx.strategy is strategy:
            return ctx.merge_call(lambda s, *a, **k: s.extended.update(var, fn, a, k, group), args=args, kwargs=kwargs)
        with strategy.scope():
            return variables.update(strategy, var, fn, args, kwargs, group)

    def value_container(self, value: Any) -> Any:
        """The variable whose copy `value` is (as `update` hands it to fn), else `value` itself."""
        from mirrored.distribute import variables

        return variables.value_container(value)

    @property
    def should_checkpoint(self) -> bool:
        """Whether this process writes checkpoints and saved models (TF's): only the chief, the process
        holding replica 0, so N workers do not write N copies to one path."""
        return self._strategy.first_replica_id == 0

    @property
    def should_save_summary(self) -> bool:
        """Whether this process writes logs and summaries (CSV, TensorBoard, progress): the chief only."""
        return self._strategy.first_replica_id == 0

    def colocate_vars_with(self, colocate_with_variable: Any) -> AbstractContextManager:
        """A block whose variables go on the devices of `colocate_with_variable`. Every variable of a
        strategy lives on all its devices, so this only checks what TF checks: the strategy's scope,
        and a variable created in it."""
        from mirrored.distribute.variables import Variable

        strategy = self._strategy
        if strategy._is_default:  # TF's default strategy needs no scope and takes any variable
            return nullcontext()
        if context.get_strategy() is not strategy:
            raise RuntimeError(f'strategy.extended.colocate_vars_with: need to be inside "with strategy.scope()" of '
                               f"{strategy!r} (as in TF).")
        if not isinstance(colocate_with_variable, Variable) or colocate_with_variable._strategy is not strategy:
            raise ValueError(f"strategy.extended.colocate_vars_with({colocate_with_variable!r}): pass a variable "
                             f"created in the scope of {strategy!r} (as TF requires).")
        return nullcontext()


class _Scope:
    """What `strategy.scope()` returns: it may be entered again after it exits, and nested in itself,
    as TF's can. Each entry pushes the strategy and its exit pops that entry (entries are per thread)."""

    def __init__(self, strategy: Strategy):
        self._strategy = strategy
        self._open = threading.local()  # per thread: the entries not exited yet, innermost last

    def __enter__(self) -> Strategy:
        entry = self._strategy._scope_entry()
        entry.__enter__()
        self._open.__dict__.setdefault("entries", []).append(entry)
        return self._strategy

    def __exit__(self, *exc: Any) -> bool | None:
        return self._open.entries.pop().__exit__(*exc)


class Strategy:
    """Synchronous data parallelism over `devices`; see MirroredStrategy for the public constructor.

    Extension points: a strategy whose replicas are not all threads of one process overrides the
    methods of the "extension points" section below - num_workers, first_replica_id, has_peers,
    all_reduce_tensors, sum_over_workers and _communicator - and the cross-replica ones it
    does differently (reduce, gather, check_in_sync, mirror), as MultiWorkerMirroredStrategy does
    for one replica per process over torch.distributed. Mirrored modules, optimizers, variables and
    distributed input use nothing else of a strategy's internals."""

    _is_default = False
    _mirrors_variables = True  # False where TF makes plain variables (default and one-device strategies)

    def __init__(self, devices: Sequence[Device], cross_device_ops: CrossDeviceOps | None = None,
                 timeout_s: float = DEFAULT_TIMEOUT_S, seed: int | None = None, per_example_random: bool = False):
        if not (isinstance(timeout_s, (int, float)) and timeout_s > 0):
            raise ValueError(f"{type(self).__name__}(timeout_s={timeout_s!r}): give a positive number of seconds.")
        if seed is not None and (not isinstance(seed, int) or isinstance(seed, bool)):
            raise TypeError(f"{type(self).__name__}(seed={seed!r}): give an int, or None to take torch's seed "
                            "(torch.manual_seed / mr.utils.set_random_seed) at the first step.")
        if not isinstance(per_example_random, bool):
            raise TypeError(f"{type(self).__name__}(per_example_random={per_example_random!r}): give True or False.")
        self._random = replica_random.StrategyRandom(seed, per_example_random)
        if cross_device_ops is not None and not isinstance(cross_device_ops, CrossDeviceOps):
            raise TypeError(f"{type(self).__name__}(cross_device_ops={cross_device_ops!r}): expected a "
                            "CrossDeviceOps such as mr.ReductionToOneDevice() or mr.NcclAllReduce().")
        self._devices = tuple(devices)
        self._torch_devices = [torch_device(d) for d in self._devices]
        # Whether a step without the replica random mode can be watched (random.DefaultGenerators).
        self._watchable = replica_random.DefaultGenerators.watchable(self._torch_devices)
        self._cross_device_ops = cross_device_ops or default_for(self._devices)
        if len(self._devices) > 1:
            self._cross_device_ops.check_devices(self._devices)
        self._timeout_s = float(timeout_s)
        self._pool: replicas.ReplicaPool | None = None
        self._value_layouts: dict[int, dict] = {}  # ctx.all_reduce's layouts, by replica and signature
        self._watched: set[Any] = set()  # codes of replica functions whose guarded first run is done
        self._gradient_reductions: set[str] = set()  # of the optimizers mirror_optimizer made
        if len(self._devices) > 1:
            self._pool = replicas.ReplicaPool(self._devices, intra_op_threads(self._devices))
            replicas.stop_on_collect(self, self._pool)
        self._log_created()

    def _log_created(self) -> None:
        logger.info("%s: %d replica(s) on %s, cross-device ops %s", type(self).__name__, len(self._devices),
                    ", ".join(self._devices), self._cross_device_ops)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(devices={list(self._devices)})"

    @property
    def num_replicas_in_sync(self) -> int:
        """How many replicas run each step: the GLOBAL batch is split over this many."""
        return len(self._devices)

    @property
    def random_state(self) -> replica_random.StrategyRandom:
        """The replicas' randomness (seed, steps run): get_state()/set_state() for checkpoints, which
        mr.Model and BackupAndRestore save, so a resumed run draws what the uninterrupted one did."""
        return self._random

    @property
    def extended(self) -> StrategyExtended:
        """TF's `strategy.extended`: worker_devices, update, value_container, colocate_vars_with."""
        # Built on access, not stored: a strategy must hold no reference cycle, so that dropping the
        # last reference stops its replica threads at once instead of at the next cyclic GC.
        return StrategyExtended(self)

    def scope(self) -> AbstractContextManager[Strategy]:
        """Variables, mirrored modules and metrics created in this block are mirrored on every replica.
        The object may be entered again, and nested in itself."""
        return _Scope(self)

    def _scope_entry(self) -> AbstractContextManager:
        """What one entry of `scope()` does: make this strategy current, in cross-replica context."""
        return context.enter_scope(self)

    # ---- running replicas -------------------------------------------------------------------------
    def run(self, fn: Callable[..., Any], args: tuple = (), kwargs: dict | None = None,
            options: RunOptions | None = None) -> Any:
        """Runs fn once per replica, concurrently; returns PerReplica results (or the object itself where
        every replica returned the same object). PerReplica arguments are unwrapped per replica.

        Args:
          fn: the replica function, run on each replica's thread in that replica's context
            (get_replica_context()); mirrored modules, optimizers and variables used in it are that
            replica's copies. Call run from cross-replica context (not inside another replica function).
          args: positional arguments. A PerReplica or Mirrored value, at any depth of lists, tuples and
            dicts, gives each replica its own component; anything else reaches every replica as it is.
          kwargs: keyword arguments, handed out the same way.
          options: a RunOptions (TF's tf.distribute.RunOptions; `rerunnable` is ours). Another object (TF's
            own RunOptions in ported code) runs as the defaults do.

        Returns:
          The replicas' results, a PerReplica per tensor (a nest keeps its structure), or the one object
          every replica returned (None, say). If a replica raises, every replica puts back what the step
          changed (rollback.py) and the error is raised here, prefixed "replica 1 (cpu:1): ".
        """
        if not callable(fn):
            raise TypeError(f"strategy.run(fn={fn!r}): fn must be callable.")
        frame = context._current()
        if frame is not None or self._is_default:
            refuse_nested_run(self, frame)
        args = args if type(args) is tuple else tuple(args)
        kwargs = dict(kwargs) if kwargs else {}
        split = _argument_split(args, kwargs, len(self._devices))
        if self._pool is None:
            return self._run_inline(fn, args, kwargs, split, _options(options))
        modes = _caller_modes()
        randomness = self._begin_random(fn, _options(options))
        interrupted = None
        with self._guard(fn):  # refuses plain torch optimizers and modules that the threads would share
            while True:
                step = replicas.Rendezvous(self._devices, self._timeout_s)
                journals = [rollback.StepJournal() for _ in self._devices]
                step.check = randomness.meeting_check(lambda: any(j.updating for j in journals))
                random_modes = randomness.modes(self.first_replica_id, len(self._devices),
                                                self._example_parts(args, kwargs, split))
                task = self._replica_task(fn, args, kwargs, split, step, journals, modes, random_modes)
                outcome = self._pool.run(task, grace_s=self._timeout_s, abort=step.abort)
                failed = [e for e in outcome.errors.values() if not isinstance(e, replicas._Released)]
                if randomness.redo(caught=isinstance(step.error, replica_random.DrewWithoutMode),
                                   failed=bool(outcome.errors) or step.error is not None,
                                   updating=any(j.updating for j in journals),
                                   can_roll_back=all(outcome.finished) and not failed, fn=fn):
                    # What the attempt drew in thread order is undone, and it runs again with the mode. A
                    # first Ctrl-C that came meanwhile (finish the step, then stop) is raised after the redo.
                    self._roll_back(journals, outcome.finished)
                    interrupted = outcome.interrupted
                    continue
                break
        if interrupted is not None and outcome.interrupted is None:
            outcome = outcome._replace(interrupted=interrupted)
        if outcome.errors or step.error is not None:
            self._roll_back(journals, outcome.finished)
            if outcome.interrupted is not None:
                raise outcome.interrupted
            raise step_error(self, outcome.errors, step)
        randomness.finished()
        if outcome.interrupted is not None:  # the step finished on every replica first: it stays applied
            raise outcome.interrupted
        try:
            return _run_result(outcome.results)
        except ValueError:  # the replicas returned different structures: the step failed as a whole
            self._roll_back(journals, outcome.finished)
            raise

    def _begin_random(self, fn: Callable[..., Any], options: RunOptions) -> replica_random.StepRandom:
        """The randomness of the step about to run (random.py): its number, and whether fn runs without
        the replica random mode - only a rerunnable function on one worker, where a draw shows on this
        process's default generators (cpu and cuda devices)."""
        state = self._random
        if not state.seed_given and self.num_workers > 1:
            # seed=None: the chief's seed on every worker, so that a restore from the chief's backup (which
            # holds the chief's) goes on drawing what the uninterrupted run drew.
            mine = state.seed
            high, low = self.chief_ints([mine >> 32, mine & 0xFFFFFFFF], "the replicas' random seed (the chief's)")
            state.set_state({"seed": (high << 32) | low, "steps": state.steps})
        return state.begin(fn, state.begin_step(), options.rerunnable, self._torch_devices,
                           watchable=self._watchable and self.num_workers == 1)

    def _example_parts(self, args: tuple, kwargs: dict, split: int) -> list[tuple[int, int]] | None:
        """With per_example_random: where each local replica's part of the global batch starts, and its
        size (None where a replica has no batch tensor to key by)."""
        if not self._random.per_example:
            return None
        sizes = []
        for i in range(len(self._devices)):
            leaves = flatten(_replica_arguments(i, args, kwargs, split))
            batch = next((x for x in leaves if isinstance(x, Tensor) and x.dim() > 0), None)
            if batch is None:
                return None
            sizes.append(int(batch.shape[0]))
        starts = itertools.accumulate([0] + sizes[:-1])
        return list(zip(starts, sizes))

    def _replica_task(self, fn: Callable[..., Any], args: tuple, kwargs: dict, split: int, step: replicas.Rendezvous,
                      journals: list[rollback.StepJournal], modes: tuple[Any, ...],
                      random_modes: list[replica_random.ReplicaRandom] | None) -> Callable[[int], Any]:
        """What each replica thread runs for one strategy.run: fn in the replica's context, with its
        arguments, the caller's modes and its journal; a failure releases the other replicas."""
        def task(replica_id: int) -> Any:
            ctx = ReplicaContext(self, replica_id)
            ctx._step = step
            ctx._journal = journals[replica_id]
            # The frame goes on this thread's context stack directly: context.push, a generator-based
            # context manager, costs ~3 us per replica per step, a tenth of a no-op run.
            stack = context._stack()
            stack.append(context._Frame(self, ctx))
            try:
                try:
                    call_args, call_kwargs = _replica_arguments(replica_id, args, kwargs, split)
                    # The replica's own generators (random.py); none for a step function that draws nothing.
                    with random_modes[replica_id] if random_modes is not None else nullcontext():
                        if modes:
                            with _entered(modes):
                                result = fn(*call_args, **call_kwargs)
                        else:
                            result = fn(*call_args, **call_kwargs)
                finally:
                    stack.pop()
            except BaseException as e:
                if not isinstance(e, replicas._Released):
                    step.abort(e)
                raise
            step.finish(replica_id)
            return result
        return task

    def _guard(self, fn: Callable[..., Any]) -> AbstractContextManager:
        """guards.watch(self, fn), skipped for a function whose first run was watched already: watch
        would return a null context for it, after ~1 us of weak-dictionary lookups per run."""
        code = getattr(getattr(fn, "__func__", fn), "__code__", None)
        if code is not None and code in self._watched:
            return nullcontext()
        watch = guards.watch(self, fn)
        if code is not None and isinstance(watch, nullcontext):
            if len(self._watched) >= _WATCHED_KEPT:
                self._watched.clear()
            self._watched.add(code)
        return watch

    def _run_inline(self, fn: Callable[..., Any], args: tuple, kwargs: dict, split: int,
                    options: RunOptions) -> Any:
        """One replica on the caller's thread (the default and one-device strategies, one device): the
        same step as on replica threads, with its journal, its randomness and its redo; with no meeting
        to check a quiet step at, the check comes right before the update (StepJournal.check)."""
        ctx = ReplicaContext(self, 0) if not self._is_default else self._default_replica_context
        _inline_runs.depth = getattr(_inline_runs, "depth", 0) + 1
        try:
            if self._is_default:
                return self._inline_attempt(ctx, fn, args, kwargs, split, rollback.StepJournal(), None)
            randomness = self._begin_random(fn, options)
            while True:
                journal = rollback.StepJournal()
                journal.check = randomness.update_check()
                modes = randomness.modes(self.first_replica_id, 1, self._example_parts(args, kwargs, split))
                caught = False
                try:
                    result = self._inline_attempt(ctx, fn, args, kwargs, split, journal, modes[0] if modes else None)
                except replica_random.DrewWithoutMode:  # (rolled back already)
                    caught = True
                if randomness.redo(caught=caught, failed=False, updating=journal.updating, can_roll_back=True,
                                   fn=fn):
                    if not caught:
                        journal.rollback()
                    continue
                randomness.finished()
                return result
        finally:
            _inline_runs.depth -= 1

    def _inline_attempt(self, ctx: ReplicaContext, fn: Callable[..., Any], args: tuple, kwargs: dict, split: int,
                        journal: rollback.StepJournal, mode: replica_random.ReplicaRandom | None) -> Any:
        """fn on the caller's thread in replica context `ctx`, noting in `journal`, in `mode` if given; a
        failure puts back what it changed."""
        ctx._journal = journal
        stack = context._stack()
        try:
            stack.append(context._Frame(self, ctx))  # as in run(): context.push costs more than the rest
            try:
                call_args, call_kwargs = _replica_arguments(0, args, kwargs, split)
                with mode if mode is not None else nullcontext():  # as on replica threads
                    return fn(*call_args, **call_kwargs)
            finally:
                stack.pop()
        except BaseException:
            journal.rollback()
            raise
        finally:
            ctx._journal = None

    def _roll_back(self, journals: list[rollback.StepJournal], finished: list[bool]) -> None:
        """A failed step leaves no trace: every replica's gradients, buffers and metrics go back to what
        they were before the step (or, past a committed update, before what followed it). Runs once
        the replicas are quiescent; a replica still busy after the grace period cannot be rolled back."""
        stuck = [i for i, done in enumerate(finished) if not done]
        for journal, done in zip(journals, finished):
            if done:
                journal.rollback()
        if stuck:
            logger.warning("replica %s did not finish the failed step in time; what it changed was not rolled "
                           "back, so the replicas may differ: check with strategy.check_in_sync(...) or restore "
                           "a checkpoint.", ", ".join(f"{i} ({self._devices[i]})" for i in stuck))

    def _merge_call(self, ctx: ReplicaContext, merge_fn: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
        if ctx._step is None:
            with context.push(self, None):
                return select_replica(0, merge_fn(self, *args, **kwargs))

        def combine(slots: list[tuple]) -> Any:
            fn0 = slots[0][0]
            merged_args = regroup([s[1] for s in slots])
            merged_kwargs = regroup([s[2] for s in slots])
            with context.push(self, None):
                return fn0(self, *merged_args, **merged_kwargs)

        result = ctx._step.exchange(ctx._replica_id, (merge_fn, args, kwargs), "merge_call", combine)
        return select_replica(ctx._replica_id, result)

    def _replica_all_reduce(self, ctx: ReplicaContext, reduce_op: ReduceOp | str, value: Nested,
                            same_shapes: bool = False) -> Nested:
        """`ctx.all_reduce`. same_shapes=True: the caller guarantees every replica passes the same
        shapes, so a strategy whose shape check costs a round trip (multi-worker) may skip it.
        Differentiable as in TF: the gradient is the same all-reduce of the upstream gradients
        (run backward inside the same `strategy.run`, where the other replicas do too)."""
        op = as_reduce_op(reduce_op, "ReplicaContext.all_reduce")
        device = torch_device(self._devices[ctx._replica_id])
        leaves = [_as_tensor(v, device) for v in flatten(value)]
        n = ctx.num_replicas_in_sync
        if op is ReduceOp.MEAN and n > 1 and not all(t.is_floating_point() or t.is_complex() for t in leaves):
            # As TF 2.21: an integer mean over replicas is a float64 (7 over 3 is 2.333..., not 2); on one
            # replica TF reduces nothing and the dtype stays. Floats get the same bits as from a MEAN
            # all-reduce: the sum, divided once.
            summed = flatten(self._replica_all_reduce(ctx, ReduceOp.SUM, leaves, same_shapes))
            return pack_sequence_as(value, [mean_of_sum(t, n, in_place=False) for t in summed])
        if not self.has_peers(ctx):  # a new tensor all the same, as with peers (the caller may modify it)
            return pack_sequence_as(value, [t.clone() for t in leaves])
        if torch.is_grad_enabled() and any(t.requires_grad for t in leaves):
            return pack_sequence_as(value, list(_AllReduceFunction.apply(self, ctx, op, *leaves)))
        return pack_sequence_as(value, self._all_reduce_leaves(ctx, op, leaves, check_shapes=not same_shapes))

    def _all_reduce_leaves(self, ctx: ReplicaContext, op: ReduceOp, leaves: Sequence[Tensor],
                           check_shapes: bool = True) -> list[Tensor]:
        """Reduces tensors into new ones that belong to the caller. Autograd sees the reduction
        only through _AllReduceFunction, so it runs untracked."""
        with torch.no_grad():
            return self.all_reduce_tensors(ctx, op, [t.detach() if t.requires_grad else t for t in leaves],
                                           check_shapes)

    # ---- extension points ---------------------------------------------------------------------------
    # What a strategy whose replicas are not all threads of this process overrides; the rest of the
    # class, and mirrored modules, optimizers, variables and distributed input, are built on these.
    @property
    def num_workers(self) -> int:
        """How many processes hold this strategy's replicas: 1 here (MultiWorkerMirroredStrategy: its
        world size). State added to one process's copies alone cannot be kept in sync past 1."""
        return 1

    @property
    def first_replica_id(self) -> int:
        """replica_id_in_sync_group of this process's first replica: 0 here; a worker of a multi-worker
        strategy starts past it. This process's replicas are first_replica_id .. first_replica_id +
        len(worker_devices) - 1; inside a process they are indexed from 0 (ctx.local_replica_id)."""
        return 0

    def has_peers(self, ctx: ReplicaContext) -> bool:
        """Whether `ctx`'s replica reduces with others (not a lone replica run inline)."""
        return ctx._step is not None

    def all_reduce_tensors(self, ctx: ReplicaContext, op: ReduceOp, leaves: list[Tensor],
                           check_shapes: bool = True) -> list[Tensor]:
        """`ctx`'s replica's tensors reduced by `op` with the other replicas' (called on every replica
        at once), into new tensors the caller owns, outside autograd (ReplicaContext.all_reduce and
        the optimizers' buffer averages build on it). With check_shapes, every replica checks the
        others' shapes and dtypes in the same meeting (TF refuses a mismatch too: equal sizes alone
        would let (2, 3) meet (3, 2), or two leaves swap places); False where the caller guarantees
        them. Between threads here: small tensors travel packed, large ones are read where they lie."""
        rid = ctx._replica_id
        layouts = _replica_entry(ctx, self._value_layouts, dict, "all_reduce")
        staged = _recent(layouts, buckets.signature(leaves),
                         lambda: buckets.Layout(leaves, self._cross_device_ops.bytes_per_pack, _DIRECT_NUMEL),
                         _VALUE_LAYOUTS_KEPT).buffers()  # fresh results every call: the caller owns them
        inputs, outputs, results = staged.stage(leaves)
        shapes = shapes_of(leaves) if check_shapes else None
        reduced = self._cross_device_ops.all_reduce(ctx._step, rid, op, inputs, outputs, agree=shapes,
                                                    what=f"all_reduce({op.name})")
        if isinstance(reduced, Disagreement):
            raise ValueError(shape_mismatch("ReplicaContext.all_reduce", reduced.tokens))
        return results  # type: ignore[return-value]

    def sum_over_workers(self, count: int) -> int:
        """`count` summed over the worker processes (distributed input uses it to end an epoch on every
        worker at the same step); one process here, so `count` itself."""
        return count

    def gather_over_workers(self, row: Sequence[int], what: str) -> list[list[int]]:
        """Every worker process's `row` of ints (the same length on each), in rank order (one all-gather;
        distributed input compares digests and counts with it); [row] in one process."""
        return [list(row)]

    def chief_ints(self, values: Sequence[int], what: str) -> list[int]:
        """The chief's (rank 0's) `values` on every worker process (one broadcast; distributed input
        shares the seeds drawn there); `values` itself in one process."""
        return list(values)

    def _communicator(self) -> Communicator:
        """Whom a mirrored optimizer's gradients are reduced with (reducer.py): the replica threads of
        this process, through the strategy's cross-device ops, where it holds several."""
        return Communicator(self._cross_device_ops if len(self._devices) > 1 else None, None)

    # ---- cross-replica reductions -----------------------------------------------------------------
    def reduce(self, reduce_op: ReduceOp | str, value: Any, axis: int | Sequence[int] | None = None) -> Any:
        """Combines per-replica values into one tensor (tf.distribute.Strategy.reduce).

        With 2 replicas and a global batch of 8, a PerReplica of per-example losses of shape (4,) each
        gives: reduce(SUM, v, axis=0) the sum of all 8; reduce(MEAN, v, axis=0) their mean (the total
        count divides, so uneven parts weigh correctly); reduce(SUM, v) a tensor of shape (4,).
        `value` may be a nest (dict, list, tuple, namedtuple) of such values, as strategy.run returns
        them: each leaf is reduced, all in one packed cross-device call, and the structure is kept.
        The result is a value to read, outside autograd: a replica's loss, returned as it is from
        strategy.run, reduces as well as its detached copy.

        Args:
          reduce_op: ReduceOp.SUM or ReduceOp.MEAN (or "sum" / "mean").
          value: a PerReplica (or a nest of them) as strategy.run returns it. Under MEAN a Mirrored value or
            mirrored variable gives its first copy (no rounding), and a plain value is returned as it is;
            SUM refuses a plain value on several replicas (as TF does): it may be one replica's or the total.
          axis: None combines the replicas' values element by element; an int or a tuple of ints also
            reduces those dimensions of each replica's value (MEAN divides by all their elements, over
            every replica).

        Returns:
          A tensor on the first replica's device (a nest of them for a nest). The MEAN of integers over
          several replicas is float64, as in TF.
        """
        context.require_cross_replica("strategy.reduce")
        op = as_reduce_op(reduce_op, "strategy.reduce")
        with torch.no_grad():
            if not is_nested(value):
                return reduce_leaves(self, op, [value], axis, nested=False)[0]
            return pack_sequence_as(value, reduce_leaves(self, op, flatten(value), axis, nested=True))

    def gather(self, value: Any, axis: int) -> Any:
        """Concatenates the replicas' values along `axis` on the first replica's device (tf's gather);
        a nest of such values gathers leaf by leaf."""
        context.require_cross_replica("strategy.gather")
        if is_nested(value):
            return map_structure(lambda leaf: gather_leaf(self, leaf, axis), value)
        return gather_leaf(self, value, axis)

    def experimental_local_results(self, value: Any) -> tuple[Any, ...]:
        """The per-replica components of `value` as a tuple: a PerReplica's values; a mirrored variable's,
        module's or optimizer's copies; for a nest, one structure per replica (as TF); a plain value
        gives a 1-tuple."""
        if isinstance(value, DistributedValues):
            return value.values
        copies = _local_copies(value)
        if copies is not None:
            return copies
        if is_nested(value):
            return tuple(map_structure(lambda x, r=r: _component(x, r), value) for r in range(len(self._devices)))
        return (value,)

    def experimental_distribute_values_from_function(self, value_fn: Callable[[ValueContext], Any]) -> Any:
        """Calls value_fn(ValueContext) once per replica and returns the results as a PerReplica."""
        n = self.num_replicas_in_sync
        results = []
        for i, device in enumerate(self._devices):
            v = value_fn(ValueContext(self.first_replica_id + i, n))
            target = torch_device(device)  # every tensor on its replica's device, nested or not
            results.append(map_structure(lambda t, target=target: t.to(target) if isinstance(t, Tensor) else t, v))
        # TF wraps every leaf, even where all replicas returned the same object (a constant).
        return results[0] if n == 1 else regroup(results, always_wrap=True)

    # ---- mirrored state -----------------------------------------------------------------------------
    def mirror(self, module: torch.nn.Module, memory_format: str = "auto") -> Any:
        """One copy of `module` per replica (the first is `module` itself, moved to device 0). Refused,
        before anything is copied, when the copies would not fit in memory (devices.check_replica_memory).
        memory_format="auto" stores 2-D / 3-D convolution weights in channels_last(_3d) on CPU and CUDA,
        where those kernels are fastest (float32/16 weights); "channels_last" always; "preserve" as given."""
        from mirrored.distribute.modules import MirroredModule

        if isinstance(module, torch.nn.Module) and len(self._devices) > 1:
            per_copy = sum(t.numel() * t.element_size() for t in itertools.chain(module.parameters(), module.buffers())
                           if not is_lazy(t))  # (MirroredModule refuses lazy ones, naming the fix)
            # On the CPU the module itself is the first copy: only the others are new memory.
            new = self._devices[1:] if self._devices[0].startswith("cpu") else self._devices
            devices.check_replica_memory(per_copy, new, where=f"{type(self).__name__}.mirror")
        return MirroredModule(self, module, memory_format)

    def mirror_optimizer(self, optimizer_cls: Callable[..., torch.optim.Optimizer], module: Any,
                         gradient_reduction: str | ReduceOp = "sum", reduce_in_backward: bool | None = None,
                         **hparams: Any) -> Any:
        """One `optimizer_cls(params, **hparams)` per replica of `module` (what mirror() returned); step()
        in replica context all-reduces the gradients first. gradient_reduction="sum" (TF's rule: scale
        each replica's loss by the GLOBAL batch) or "mean" (DDP's: average the replicas' gradients,
        weighted by their examples, for an unchanged `F.cross_entropy(out, y).backward()`).

        Args:
          optimizer_cls: a torch optimizer class, or any callable params -> torch optimizer (a lambda to
            build parameter groups), called once per replica with that replica's parameters.
          module: the MirroredModule that strategy.mirror() returned.
          gradient_reduction: "sum" (ReduceOp.SUM) or "mean" (ReduceOp.MEAN), as above. With "mean" the
            gradients are all-reduced as each backward through the module ends (as in DDP), so code between
            backward and step(), such as clip_grad_norm_, sees the reduced ones.
          reduce_in_backward: None: as gradient_reduction says (True for "mean", False for "sum").
            False with "mean": the gradients are all-reduced in step() (or reduce_gradients()) only, and no
            hook is registered per parameter (each costs a Python call per backward). True needs "mean".
          hparams: keyword arguments of optimizer_cls (lr=0.1, momentum=0.9, ...).

        Returns:
          A MirroredOptimizer. In strategy.run, step() updates the calling replica's copy once the
          gradients are reduced; outside it, zero_grad(), load_state_dict() and hook registrations reach
          every replica's optimizer, and state_dict() reads replica 0's.
        """
        from mirrored.distribute.optimizer import MirroredOptimizer

        optimizer = MirroredOptimizer(self, optimizer_cls, module, hparams, gradient_reduction, reduce_in_backward)
        self._gradient_reductions.add(optimizer.gradient_reduction)
        return optimizer

    def gradient_reducer(self, module: Any, where: str | None = None) -> GradientReducer:
        """Where the copies of `module` (what mirror() returned) meet to all-reduce their gradients, for
        code that applies gradients itself (a Keras optimizer's apply inside a replica step) rather than
        through mirror_optimizer: the same GradientReducer a mirrored optimizer owns, over this
        strategy's replicas, comparing the copies as it does. Use one per list of parameters reduced.

        Args:
          module: the MirroredModule that strategy.mirror() returned.
          where: how errors name the reduction (default: the module's class).
        """
        from mirrored.distribute.modules import MirroredModule

        if not isinstance(module, MirroredModule) or module.distribute_strategy is not self:
            raise TypeError(f"strategy.gradient_reducer({type(module).__name__}): pass the module this strategy's "
                            "mirror() returned, whose copies the reduction compares.")
        devices = [torch_device(d) for d in self._devices]
        return GradientReducer(self._communicator(), devices, module._shared.watch,
                               where or f"the gradients of {type(module.replicas[0]).__name__}")

    @property
    def gradient_reductions(self) -> frozenset[str]:
        """The gradient_reduction of every optimizer mirror_optimizer made ("sum", "mean"): a loss that
        averages over one replica's part warns only where a "sum" optimizer (or none yet) may follow."""
        return frozenset(self._gradient_reductions)

    def check_in_sync(self, obj: Any) -> None:
        """Raises OutOfSyncError naming the first tensor whose copies differ, and the replicas."""
        from mirrored.distribute.modules import copies_checked, named_copies

        for name, copies in named_copies(obj):
            ref = copies[0].detach().cpu()
            for r, t in enumerate(copies[1:], start=1):
                other = t.detach().cpu()
                if ref.shape != other.shape or ref.dtype != other.dtype or not _bitwise_equal(ref, other):
                    if ref.shape != other.shape or ref.dtype != other.dtype:
                        diff = (f" (shape {tuple(ref.shape)} {ref.dtype} against {tuple(other.shape)} "
                                f"{other.dtype})")
                    else:
                        a, b = (t.to_dense().double() if t.is_sparse else t.double() for t in (ref, other))
                        diff = (f" (max abs difference {(a - b).abs().max().item():.3g})"
                                if ref.is_floating_point() else "")
                    raise OutOfSyncError(f"{name}: replica 0 and replica {r} ({self._devices[r]}) hold different "
                                         f"values{diff}; the copies must be bitwise identical after every step.")
        copies_checked(obj)  # (a mirrored module's count of in-place writes starts again from here)

    # ---- input ----------------------------------------------------------------------------------------
    def experimental_distribute_dataset(self, dataset: Any,
                                        options: InputOptions | None = None) -> DistributedDataset:
        """Splits each GLOBAL batch of `dataset` into per-replica parts, on each replica's device."""
        from mirrored.distribute.input import DistributedDataset

        return DistributedDataset(self, dataset, options)

    def distribute_datasets_from_function(self, dataset_fn: Callable[..., Any],
                                          options: InputOptions | None = None) -> DistributedDatasetsFromFunction:
        """Calls dataset_fn(InputContext) per input pipeline; replicas take successive per-replica batches."""
        from mirrored.distribute.input import DistributedDatasetsFromFunction

        return DistributedDatasetsFromFunction(self, dataset_fn, options)


def _options(options: Any) -> RunOptions:
    """strategy.run's options as ours: TF's own RunOptions (or None) run as the defaults."""
    return options if isinstance(options, RunOptions) else _DEFAULT_OPTIONS


class MirroredStrategy(Strategy):
    """Synchronous training on every device of one machine (tf.distribute.MirroredStrategy).

    `devices=None` takes every visible GPU, else one CPU replica; `["cpu:0", "cpu:1"]` gives two
    logical CPU replicas, each a thread with an even share of the cores. `timeout_s` bounds how long
    a collective waits for a missing replica.

    Args:
      devices: the replicas' devices, one replica each: "cuda:N" or "cpu:N" strings (or torch.device),
        all distinct; None takes every visible GPU, or one CPU replica without any.
      cross_device_ops: how replicas' values are summed: NcclAllReduce, HierarchicalCopyAllReduce,
        ReductionToOneDevice or InMemoryAllReduce. None picks as TF does: NCCL across GPUs where it
        works (else HierarchicalCopyAllReduce), InMemoryAllReduce on CPUs, ReductionToOneDevice for a mix.
      timeout_s: how long a collective waits for a replica that has not arrived before the step fails
        with CollectiveTimeoutError naming it (a replica stuck or dead would otherwise hang the others).
      seed: the seed of the replicas' random draws in strategy.run (dropout, torch.rand, ...): each
        replica draws from generators of its own, seeded by (seed, step, replica id), so neither thread
        order nor a resume changes them. None: torch.initial_seed() at the first step.
      per_example_random: key each draw of the dropout family (and rrelu) by (seed, step, index of the
        example in the global batch) instead, so a run draws the same on any number of replicas; other
        random ops are refused inside strategy.run. Costs a few elementwise ops per dropout.
    """

    def __init__(self, devices: Sequence[str | torch.device] | None = None,
                 cross_device_ops: CrossDeviceOps | None = None, timeout_s: float = DEFAULT_TIMEOUT_S,
                 seed: int | None = None, per_example_random: bool = False):
        super().__init__(resolve_devices(devices, where="MirroredStrategy"), cross_device_ops, timeout_s,
                         seed=seed, per_example_random=per_example_random)


class OneDeviceStrategy(Strategy):
    """Everything on one device, with the strategy API (tf.distribute.OneDeviceStrategy)."""

    _mirrors_variables = False

    def __init__(self, device: str | torch.device):
        super().__init__(resolve_devices([device], where="OneDeviceStrategy"))


class _DefaultStrategy(Strategy):
    """The strategy in force outside any scope: one replica, the current thread, no mirroring."""

    _is_default = True
    _mirrors_variables = False

    def __init__(self) -> None:
        super().__init__(("cpu:0",))
        self._default_replica_context = ReplicaContext(self, 0)  # a cycle, but this strategy lives forever

    def _log_created(self) -> None:
        # Made on first use, in every process (each worker of a multi-worker run too): not worth an INFO line.
        logger.debug("the default strategy: one replica on cpu:0, no mirroring")

    def _scope_entry(self) -> AbstractContextManager:
        return context.push(self, self._default_replica_context)


_default: _DefaultStrategy | None = None
_default_lock = threading.Lock()


def default_strategy() -> Strategy:
    global _default
    if _default is None:
        with _default_lock:
            if _default is None:
                _default = _DefaultStrategy()
    return _default

