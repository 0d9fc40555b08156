"""Mirrored optimizers: `strategy.mirror_optimizer(torch.optim.SGD, mnet, lr=0.1)`.

A MirroredOptimizer is a torch Optimizer over every copy of a MirroredModule: one torch optimizer
per copy (`.values`). `step()` in replica context all-reduces the replica's gradients, then every
replica applies the same update, so the copies stay bitwise identical; floating-point buffers
(BatchNorm statistics) are averaged too: between the threads of one process in the same meeting,
before the update (they follow the forward); across workers, and for a loop that steps the torch
optimizer itself (finish_step, sync_buffers), in a meeting of their own after it. The reduction is
`gradient_reduction`:

- "sum" (default), TF's rule: each replica scales its loss by the GLOBAL batch
  (mr.losses.compute_average_loss), and the summed gradients are the single-device gradient.
- "mean", DDP's rule: an unchanged `F.cross_entropy(out, y).backward()` on each replica's part, and
  the replicas' gradients are averaged. Each replica weighs by the examples its module copy was
  called with since the last step, so an uneven last batch still gives one device's update on the
  whole batch (DDP weighs every replica alike); `set_gradient_weight` gives a replica another
  weight for the next reduction (the labels a loss averaged over). As in DDP, the all-reduce runs
  when a backward through the module ends (a hook per parameter queues it on autograd's final
  callbacks), so code between backward and step() - clip_grad_norm_ - sees reduced gradients;
  step() then only meets the other replicas, so that no copy updates alone. reduce_in_backward=False
  reduces in step() (or reduce_gradients()) instead, and registers no hooks.

torch LR schedulers take it as their optimizer: outside strategy.run its param_groups write every
replica's, so every replica gets the same rate, and `attach_lr_scheduler` saves a scheduler's state
with its own. Inside strategy.run the groups are read-only (with several replicas in the process):
a scheduler stepped there would step once per replica thread. The gradient all-reduce also compares
the replicas' module copies (_copy_watch.py), so a change that reached some copies only fails the
step before any replica updates. The gradients meet in the optimizer's GradientReducer (reducer.py),
over the strategy's communicator. Uses context.py, devices.py, guards.py, modules.py, random.py,
rollback.py, reducer.py, _param_groups.py and values.py.
"""
from __future__ import annotations

import copy
import functools
import types
import weakref
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from mirrored.distribute import context, guards
from mirrored.distribute._param_groups import MirroredGroup, ReplicaGroup
from mirrored.distribute.devices import torch_device
from mirrored.distribute.modules import MirroredModule, HookHandles, state_tensors
from mirrored.distribute.random import WithoutReplicaRandom
from mirrored.distribute.reducer import GradientReducer, check_weight
from mirrored.distribute.rollback import journal_of, saved_item
from mirrored.distribute.values import ReduceOp

if TYPE_CHECKING:
    from mirrored.distribute.context import ReplicaContext
    from mirrored.distribute.strategy import Strategy

GRADIENT_REDUCTIONS = ("sum", "mean")


# Group settings torch's LR schedulers change besides "lr" (OneCycleLR and CyclicLR cycle momentum or Adam's
# betas): restored with a scheduler's state.
_SCHEDULED_KEYS = ("momentum", "betas")

class MirroredOptimizer(torch.optim.Optimizer):
    """One torch optimizer per replica copy of a MirroredModule, kept identical (see the module docstring).

    Outside strategy.run, param_groups[i][key] = value, zero_grad, load_state_dict and hook
    registrations reach every replica's optimizer; state_dict, state and defaults read replica 0's
    (equal to the others'); step() is refused on more than one replica (it would update replica 0
    alone), and add_param_group always (each replica's groups hold its own copy's parameters).
    Inside it, param_groups reads the replica's own groups and refuses writes (step a scheduler
    after strategy.run)."""

    EVERY_COPY = frozenset({
        "zero_grad", "load_state_dict", "register_step_pre_hook", "register_step_post_hook",
        "register_state_dict_pre_hook", "register_state_dict_post_hook", "register_load_state_dict_pre_hook",
        "register_load_state_dict_post_hook",
    })
    READS = frozenset({"state_dict"})
    IN_RUN = frozenset({"step"})
    REFUSED = frozenset({"add_param_group"})
    LR_SCHEDULERS_KEY = "lr_schedulers"  # the state_dict entry with the attached schedulers' states

    # torch.optim.Optimizer.__init__ is not called: this optimizer holds no parameters of its own;
    # param_groups, state and defaults are its replicas' (the properties below).
    def __init__(self, strategy: Strategy, optimizer_cls: Callable[..., torch.optim.Optimizer], module: Any,
                 hparams: dict[str, Any], gradient_reduction: str | ReduceOp = "sum",
                 reduce_in_backward: bool | None = None):
        if not isinstance(module, MirroredModule):
            raise TypeError(f"strategy.mirror_optimizer(..., {type(module).__name__}): pass the module that "
                            "strategy.mirror() returned, so each replica's optimizer gets that replica's parameters.")
        if not callable(optimizer_cls):
            raise TypeError(f"strategy.mirror_optimizer({optimizer_cls!r}): pass an optimizer class such as "
                            "torch.optim.SGD (or a callable params -> optimizer).")
        self._mean = _is_mean(gradient_reduction)
        self._in_backward = _reduces_in_backward(reduce_in_backward, self._mean)
        self._strategy = strategy
        self._module = module
        self.replicas = tuple(optimizer_cls(m.parameters(), **hparams) for m in module.replicas)
        module._restructured()  # the copies' modules now (a head swapped in on every copy since mirror())
        guards.allow_optimizers(self.replicas)
        devices = [torch_device(d) for d in strategy.extended.worker_devices]
        self._reducer = GradientReducer(strategy._communicator(), devices, module._shared.watch,
                                        f"{self!r}, all-reducing the gradients")
        self._examples: list[int | None] = [None] * len(self.replicas)  # "mean": each replica's in its last reduce
        self._schedulers: list[Any] = []
        self._pending_schedulers: dict[int, dict[str, Any]] = {}  # by attach order: states loaded before it
        if self._mean:
            module._shared.count_examples()
        # "mean" is DDP's rule, and as in DDP the gradients are all-reduced when backward ends, so code
        # between backward and step() (clip_grad_norm_, a logged gradient norm) sees the reduced ones;
        # a hook per parameter costs a Python call per backward, which reduce_in_backward=False saves.
        self._sync = [_BackwardSync() for _ in self.replicas]
        if self._mean:  # the module's example counts now: this optimizer's first reduction counts from here
            for state, counter in zip(self._sync, module._shared.examples):
                state.seen = counter
        self._tokens: dict[int, Tensor] = {}  # per replica: what _meet() sends
        self._buffer_plans: dict[int, tuple[tuple[int, ...], list[_BufferPlan]]] = {}  # per replica, see _buffer_plans_of
        self._carry = [False] * len(self.replicas)  # per replica: step() is reducing, the buffers ride along
        self._synced = [False] * len(self.replicas)  # per replica: step() averaged them; finish_step skips it
        if self._in_backward and strategy.num_replicas_in_sync > 1:
            module._shared.grad_sync = self  # the latest "mean" optimizer of a module syncs it
            for rid in range(len(self.replicas)):
                for param in self._params(rid):
                    param.register_post_accumulate_grad_hook(functools.partial(_grad_accumulated, weakref.ref(self), rid))

    @property
    def values(self) -> tuple[torch.optim.Optimizer, ...]:
        """The replicas' torch optimizers, one per replica, in replica order (as a DistributedValues')."""
        return self.replicas

    @property
    def distribute_strategy(self) -> Strategy:
        """The strategy whose replicas this optimizer steps (whose random state a Checkpoint of it saves)."""
        return self._strategy

    @property
    def gradient_reduction(self) -> str:
        """How step() combines the replicas' gradients: "sum" (TF's rule) or "mean" (DDP's, weighted by examples)."""
        return "mean" if self._mean else "sum"

    @property
    def reduce_in_backward(self) -> bool:
        """Whether the gradients are all-reduced as each backward through the module ends (DDP's way, the
        default for "mean"), rather than in step() or reduce_gradients()."""
        return self._in_backward

    def _replica(self) -> ReplicaContext | None:
        return context.replica_of(self._strategy)

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        """The current replica's optimizer (replica 0's in cross-replica context)."""
        ctx = self._replica()
        return self.replicas[0 if ctx is None else ctx.local_replica_id]

    @property
    def param_groups(self) -> list[Any]:  # type: ignore[override]
        """Outside strategy.run, groups whose hyperparameters are written to every replica's optimizer
        (g["lr"] = 0.01 changes them all, and so does a torch LR scheduler). Inside it, the replica's
        own optimizer's groups, read-only where this process holds several replicas: every replica's
        thread would write its own, and a scheduler stepped there would step once per replica."""
        ctx = self._replica()
        if ctx is not None:
            groups = self.replicas[ctx.local_replica_id].param_groups
            if len(self.replicas) == 1:
                return groups
            return [ReplicaGroup(g, self, i) for i, g in enumerate(groups)]
        return [MirroredGroup([opt.param_groups[i] for opt in self.replicas])
                for i in range(len(self.replicas[0].param_groups))]

    @property
    def state(self) -> Any:  # type: ignore[override]
        """The current replica's optimizer state (per parameter of its copy)."""
        return self.optimizer.state

    @property
    def defaults(self) -> Mapping[str, Any]:  # type: ignore[override]
        """The hyperparameter defaults, read-only (every replica's optimizer was built with the same)."""
        return types.MappingProxyType(self.replicas[0].defaults)

    def _params(self, rid: int) -> list[Tensor]:
        return [p for g in self.replicas[rid].param_groups for p in g["params"]]

    # ---- one step, in replica context ------------------------------------------------------------
    def step(self, closure: Callable[[], Any] | None = None, *, grad_scaler: Any = None) -> Any:
        """Replica context: all-reduce this replica's gradients, then apply them with its optimizer.

        Args:
          closure: not supported (run the forward and backward in the replica function).
          grad_scaler: the replica's torch.amp.GradScaler, for fp16 loss scaling: the gradients are
            all-reduced first, then the scaler unscales them and skips the update where they hold an inf
            or NaN - on every replica alike, since they are the same. Call grad_scaler.update() after.
        """
        if closure is not None:
            raise ValueError("MirroredOptimizer.step(closure) is not supported: run the forward/backward in "
                             "the replica function, then call step().")
        ctx = self._replica()
        if ctx is None and len(self.replicas) > 1:  # else replica 0 alone would step
            raise RuntimeError("MirroredOptimizer.step() was called outside strategy.run (cross-replica context), "
                               "where it would update replica 0's copy only. Call it inside strategy.run(step_fn): "
                               "each replica all-reduces its gradients, then updates.")
        self._refuse_in_no_sync(ctx, "step")
        # An optimizer built by an mr.optimizers recipe with gradient accumulation keeps a step's gradients
        # local until its update step: then one all-reduce sends the sum of all of them (and "mean"
        # weighs by the examples of all of them).
        accumulate = getattr(self.optimizer, "accumulate_gradients", None)
        update = accumulate is None or accumulate()
        examples = None
        rid = None if ctx is None else ctx.local_replica_id
        try:
            if update:
                # The buffers' average rides in the meeting before the update (it follows the forward, and
                # nothing runs between here and the update), so finish_step needs no meeting of its own.
                if self._settle(ctx):  # reduced already (when backward ended, or by reduce_gradients())
                    met = False
                    if rid is not None and self._reducer.riders_ride:
                        with WithoutReplicaRandom():
                            met = self._synced[rid] = self._sync_buffers(self._examples[rid])  # (a meeting too)
                    if not met:
                        self._meet(ctx)
                else:
                    if rid is not None:
                        self._carry[rid] = True
                    self.reduce_gradients()  # (through the public method, which mr.profiler times)
                examples = None if ctx is None else self._examples[rid]
                journal = journal_of(ctx)
                if journal is not None:
                    journal.before_update()  # the weights change now: a step cannot be run again from here
            result = self.optimizer.step() if grad_scaler is None else grad_scaler.step(self.optimizer)
        except BaseException:
            if rid is not None:
                self._synced[rid] = False  # (a step run again averages its buffers again)
            raise
        finally:
            if rid is not None:
                self._carry[rid] = False
        self.finish_step(weight=examples, commit=update)
        return result

    def reduce_gradients(self) -> None:
        """All-reduces the calling replica's gradients in place of its `.grad`s (what step() does first).
        With gradient_reduction="sum" a loop that clips the reduced gradients calls it, then step()
        (which does not reduce them again); with "mean" it is done when backward ends, as in DDP
        (unless reduce_in_backward=False)."""
        with WithoutReplicaRandom():
            self._reduce_gradients()

    def _reduce_gradients(self) -> None:
        ctx = self._replica()
        self._refuse_in_no_sync(ctx, "reduce_gradients")
        if self._settle(ctx):
            return  # already reduced when backward ended ("mean")
        examples = self._take_examples(ctx)
        if ctx is not None:
            # For step()'s buffer average. A copy not called in the step (an empty part of a short batch)
            # changed no buffer: it weighs as its gradients were said to (set_gradient_weight(0)).
            declared = self._sync[ctx.local_replica_id].weight
            if examples is None and declared is not None and isinstance(declared[0], (int, float)):
                examples = declared[0]
            self._examples[ctx.local_replica_id] = examples
        self._reduce(ctx, examples)
        if ctx is not None:
            state = self._sync_state(ctx.local_replica_id, journal_of(ctx))
            state.reduced, state.weight = True, None  # reduced until the update; the weight was used
            self._settle(ctx)  # and add what an earlier backward of this step reduced ("mean")

    # ---- "mean": the all-reduce when backward ends, as DDP's ------------------------------------------
    def _sync_state(self, rid: int, journal: Any) -> _BackwardSync:
        """Replica `rid`'s state, noted in the step's journal before it changes (a failed step puts it back)."""
        state = self._sync[rid]
        if journal is not None:
            journal.before_change(state, state.saved)
        return state

    def before_forward(self, ctx: ReplicaContext) -> None:
        """A forward with gradients on, in replica context (MirroredModule calls it): a backward may
        follow. Gradients already reduced in this step are set aside, so that backward's own are
        reduced alone and then added to them: k backward passes accumulate the k reduced gradients,
        as under DDP."""
        rid = ctx.local_replica_id
        state = self._sync_state(rid, journal_of(ctx))
        state.ctx = ctx
        if state.reduced:
            params = self._params(rid)
            # Copies: reduced gradients may be views of the strategy's reduction buffers, which the next
            # all-reduce writes into.
            state.stash = [None if p.grad is None else p.grad.detach().clone() for p in params]
            for p in params:
                p.grad = None
            state.reduced = False

    def grads_cleared(self) -> None:
        """zero_grad() on the module or this optimizer: nothing reduced or set aside remains."""
        ctx = self._replica()
        for rid in (range(len(self._sync)) if ctx is None else [ctx.local_replica_id]):
            state = self._sync_state(rid, journal_of(ctx))
            state.reduced, state.stash = False, None

    def _end_backward(self, rid: int) -> None:
        """Runs when a backward that accumulated into this optimizer's parameters ends, on the replica's
        own thread (autograd runs final callbacks on the thread that called backward)."""
        state = self._sync[rid]
        state.queued = False
        ctx = context.replica_of(self._strategy)
        if ctx is None or ctx.local_replica_id != rid:
            return  # a backward outside strategy.run (refused elsewhere) or through another replica's thread
        if self._module._shared.in_no_sync(rid) or getattr(self.replicas[rid], "gradient_accumulation_steps", 1) > 1:
            return  # local accumulation: step() (or the first backward after the block) reduces it all
        self.reduce_gradients()

    def _meet(self, ctx: ReplicaContext) -> None:
        """Waits until every replica reaches its update. The reduction met already, but a replica may have
        failed since (between backward and step): then this raises on the others too, so no copy is
        updated alone (the step is all or nothing, as when step() itself all-reduces)."""
        if ctx.num_replicas_in_sync > 1:
            rid = ctx.local_replica_id
            token = self._tokens.get(rid)
            if token is None:
                device = self._params(rid)[0].device if self._params(rid) else "cpu"
                token = self._tokens[rid] = torch.zeros(1, device=device)
            self._strategy.all_reduce_tensors(ctx, ReduceOp.SUM, [token], check_shapes=False)

    def _settle(self, ctx: ReplicaContext | None) -> bool:
        """Before an update: whether this replica's gradients are reduced already (when its last
        backward ended); gradients set aside by a forward that no backward followed are put back."""
        if ctx is None:
            return False
        rid = ctx.local_replica_id
        state = self._sync[rid]
        if state.stash is not None:
            state = self._sync_state(rid, journal_of(ctx))
            params = self._params(rid)
            if state.reduced or all(p.grad is None for p in params):
                # Reduced since (add the two), or no backward since the forward (put them back as they were).
                with torch.no_grad():
                    for p, kept in zip(params, state.stash):
                        if kept is not None:
                            p.grad = kept if p.grad is None else p.grad.add_(kept)
                state.stash, state.reduced = None, True
            else:  # a backward inside no_sync since: reduce its gradients, then add
                return False
        return state.reduced

    def _refuse_in_no_sync(self, ctx: ReplicaContext | None, what: str) -> None:
        if self._module._shared.in_no_sync(0 if ctx is None else ctx.local_replica_id):
            raise RuntimeError(f"MirroredOptimizer.{what}() inside no_sync(): the block accumulates gradients "
                               "without communicating, and an update now would apply one replica's alone. Call "
                               f"{what}() after the block: it all-reduces what accumulated, once.")

    def _take_examples(self, ctx: ReplicaContext | None) -> int | None:
        """"mean": the examples this replica's copy saw since this optimizer's last reduction (None if it was
        not called). The module counts on; each optimizer of it (SparseAdam for its embeddings and Adam for
        the rest, say) remembers where its last reduction left the count, so each weighs by the same examples."""
        if not self._mean or ctx is None:
            return None
        rid = ctx.local_replica_id
        shared = self._module._shared
        examples, calls = shared.examples[rid]
        journal = journal_of(ctx)
        state = self._sync_state(rid, journal)
        (seen_examples, seen_calls), state.seen = state.seen, (examples, calls)
        # Where another optimizer of the module reduced since this one did, in an earlier step (a GAN's
        # generator optimizer, after the discriminator's), the calls before this step were its: count from
        # the module's first call in this step. In the same step (SparseAdam and Adam over one forward's
        # gradients) the calls are this one's too.
        by, run = shared.last_reduction[rid]
        if by is not None and by is not self and run is not journal:
            start = shared.run_start[rid]
            seen_examples, seen_calls = (start[1], start[2]) if start[0] is journal else (examples, calls)
        if journal is not None:
            journal.before_change(shared.last_reduction, functools.partial(saved_item, shared.last_reduction, rid))
        shared.last_reduction[rid] = (self, journal)
        return examples - seen_examples if calls > seen_calls else None

    def _reduce(self, ctx: ReplicaContext | None, examples: int | None) -> None:
        """This replica's gradients, reduced by the optimizer's GradientReducer with every other replica's:
        summed ("sum"), or ("mean") sum_r w_r g_r / sum_r w_r, w_r the examples of replica r (1 where its
        copy was not called) or what set_gradient_weight gave."""
        if ctx is None:
            return
        rid = ctx.local_replica_id
        pending = self._sync[rid].weight
        if self._reducer.lone and (pending is None or pending[1]):
            return  # one replica in all: its gradients are the sum, and w g / w is g
        params = self._params(rid)
        grads = [p.grad for p in params]
        # step()'s buffer average, where it may ride with the gradients (see step)
        plans = self._buffer_plans_of(rid) if self._carry[rid] and self._reducer.riders_ride else []
        first = ctx.replica_id_in_sync_group == 0
        riders = [t for plan in plans for t in plan.gather(1.0 if examples is None else float(examples), first)]
        if self._mean:
            weight, divide = (1 if examples is None else examples, True) if pending is None else pending
            reduced = self._reducer.reduce(ctx, params, grads, weight, divide, riders=riders)
        else:
            reduced = self._reducer.reduce(ctx, params, grads, riders=riders)
        if plans:
            with torch.no_grad():
                i = len(params)
                for plan in plans:
                    i = plan.scatter(reduced, i)
            self._synced[rid] = True
        for p, g in zip(params, reduced):
            if p.grad is not g:  # after zero_grad(set_to_none=False) backward refilled last step's views
                p.grad = g

    def set_gradient_weight(self, weight: float | Tensor, divide: bool = True) -> None:
        """In replica context, with gradient_reduction="mean": in the next reduction this replica's gradients
        count `weight` times instead of the examples its copy saw since the last step, and the weighted
        sum is divided by the replicas' total weight; divide=False leaves it undivided (the gradients
        summed with those weights, as for a loss with reduction="sum"). A loss averaged over the labels it
        kept (ignore_index) weighs its replica by that count, which gives one device's gradient however
        many each replica kept. A tensor weight (>= 0) is used without reading it on the host; with 0 the
        replica's gradients count for nothing, even where they are NaN (a mean over no label). On one
        replica in all, divide=True leaves the gradients as they are (w g / w). A failed step forgets it.

        Args:
          weight: a number >= 0 or a one-element tensor, e.g. (y != ignore_index).sum().
          divide: whether the weighted sum is divided by the sum of every replica's weight.
        """
        if not self._mean:
            raise ValueError(f"{self!r}.set_gradient_weight: gradient_reduction is \"sum\", where each replica "
                             "scales its own loss (by the GLOBAL batch) and the gradients are summed as they are. "
                             "Build the optimizer with strategy.mirror_optimizer(..., gradient_reduction=\"mean\") to "
                             "weigh the replicas' gradients.")
        ctx = self._replica()
        if ctx is None:
            raise RuntimeError(f"{self!r}.set_gradient_weight was called outside strategy.run: a weight is each "
                               "replica's own (the examples or labels of its part). Call it in the replica function, "
                               "before step().")
        check_weight(weight, "MirroredOptimizer.set_gradient_weight")
        if not isinstance(divide, bool):
            raise TypeError(f"MirroredOptimizer.set_gradient_weight(divide={divide!r}): give True or False.")
        state = self._sync_state(ctx.local_replica_id, journal_of(ctx))
        if state.reduced:
            raise RuntimeError(f"{self!r}.set_gradient_weight: this replica's gradients were all-reduced already "
                               "(when backward ended, or by reduce_gradients()), so the weight would apply to the next "
                               "step's. Call it before loss.backward(), or build the optimizer with "
                               "reduce_in_backward=False to reduce in step().")
        state.weight = (weight, divide)

    def finish_step(self, weight: float | None = None, commit: bool = True) -> None:
        """Ends a step: syncs the buffers (see sync_buffers) and, after an update applied by every
        replica (`commit`), commits the step, so that a failure later in the same strategy.run keeps
        the update and rolls back only what follows it. A step that only accumulated gradients locally
        is not committed: no meeting made every replica take it, so a failure rolls it back too.
        `step()` calls it; a loop that steps `self.optimizer` itself calls it after."""
        with WithoutReplicaRandom():
            self._finish_step(weight, commit)

    def _finish_step(self, weight: float | None, commit: bool) -> None:
        self.sync_buffers(weight)
        ctx = self._replica()
        journal = journal_of(ctx)
        if ctx is not None and self._sync[ctx.local_replica_id].reduced:
            self._sync_state(ctx.local_replica_id, journal).reduced = False  # the update consumed them
        self._opt_called = True  # a torch LR scheduler's check that the optimizer stepped before it
        if journal is not None and commit:
            journal.commit()

    def sync_buffers(self, weight: float | None = None) -> None:
        """Makes the module's buffers identical across replicas: floating-point ones (BatchNorm's running
        statistics) are averaged, as TF's MEAN-aggregated moving averages are; integer ones (BatchNorm's
        num_batches_tracked) take replica 0's value. With `weight` (this replica's examples in the step),
        the average is weighted by it: a replica whose part of a short last batch was empty (weight 0)
        did not update its statistics and does not count, and uneven parts count by their size, which
        gives a single device's update of the running mean on the whole batch. State a module keeps
        outside its buffers (a Keras model's moving statistics) is synced too (modules.state_tensors)."""
        with WithoutReplicaRandom():
            self._sync_buffers(weight)

    def _sync_buffers(self, weight: float | None) -> bool:
        """sync_buffers; whether the replicas met for it."""
        ctx = self._replica()
        if ctx is None or ctx.num_replicas_in_sync == 1:
            return False
        if self._synced[ctx.local_replica_id]:  # averaged in step()'s meeting before the update
            self._synced[ctx.local_replica_id] = False
            return False
        plans = self._buffer_plans_of(ctx.local_replica_id)
        if not plans:  # (the same on every replica: no meeting at all)
            return False
        # Averaged in float64: for float32 (or half) copies that are equal, the sum of n of them (weighted
        # by whole numbers) and its division are exact there, so a buffer that no step changed (a
        # constant, a frozen statistic) stays bit for bit itself; in its own dtype, (x + x + x) / 3 is
        # not always x, and such buffers drifted by an ulp here and there. Every copy of the module has
        # the same buffers, so the strategy may skip its shape check.
        # Without a weight every replica weighs 1: the same sum, divided by the replica count.
        w = 1.0 if weight is None else float(weight)
        first = ctx.replica_id_in_sync_group == 0
        with torch.no_grad():
            sent = []
            for plan in plans:
                sent.extend(plan.gather(w, first))
            summed = self._strategy.all_reduce_tensors(ctx, ReduceOp.SUM, sent, check_shapes=False)
            i = 0
            for plan in plans:
                i = plan.scatter(summed, i)
        return True

    def _buffer_plans_of(self, rid: int) -> list[_BufferPlan]:
        """Replica `rid`'s state tensors (modules.state_tensors) laid out for the sync, one plan per
        device, worked out again only when they are not the same tensors as last step. The walk and
        the ~4 torch calls per buffer it saves were a third of the step's own work."""
        tensors = state_tensors(self._module.replicas[rid])
        key = tuple([(id(t), how) for t, how in tensors])
        cached = self._buffer_plans.get(rid)
        if cached is not None and cached[0] == key:  # (ids hold: the plan keeps its tensors alive)
            return cached[1]
        found: dict[torch.device, tuple[list[Tensor], list[Tensor]]] = {}
        for b, how in tensors:
            means, firsts = found.setdefault(b.device, ([], []))
            if how == "mean" and b.is_floating_point():
                means.append(b)
            elif not b.is_complex() and b.dtype != torch.bool:  # replica 0's
                firsts.append(b)
        plans = [_BufferPlan(means, firsts, device) for device, (means, firsts) in found.items() if means or firsts]
        self._buffer_plans[rid] = (key, plans)
        return plans

    def no_sync(self) -> Any:
        """The module's no_sync() (DDP's name): gradients accumulate locally, step() after it reduces once."""
        return self._module.no_sync()

    # ---- what reaches every replica's optimizer ---------------------------------------------------
    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clears the current replica's gradients (every replica's outside strategy.run)."""
        if self._replica() is not None:
            self.optimizer.zero_grad(set_to_none=set_to_none)
        else:
            for opt in self.replicas:
                opt.zero_grad(set_to_none=set_to_none)
        self.grads_cleared()

    def state_dict(self) -> dict[str, Any]:
        """Replica 0's state_dict (equal to the others'), with the attached LR schedulers' states."""
        return {**self.replicas[0].state_dict(), **self.lr_schedulers_state_dict()}

    def lr_schedulers_state_dict(self) -> dict[str, Any]:
        """{"lr_schedulers": [the state_dict() of each attached scheduler]}, or {} without any: the part
        state_dict() adds to the torch optimizer's, for savers that gather that part themselves. JSON."""
        return {self.LR_SCHEDULERS_KEY: [s.state_dict() for s in self._schedulers]} if self._schedulers else {}

    def load_lr_schedulers_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Restores the schedulers' part of `state_dict` (nothing if it has none): into the attached
        schedulers, in the order they were attached, and into those attached later."""
        schedulers = state_dict.get(self.LR_SCHEDULERS_KEY)
        if schedulers is not None:
            self._pending_schedulers = dict(enumerate(schedulers))
            # The groups' settings now (the loaded optimizer state's, called after it): a scheduler built
            # later overwrites them in its constructor (OneCycleLR sets lr and momentum to its start).
            self._pending_groups = [{k: v for k, v in g.items() if k != "params"}
                                    for g in self.replicas[0].param_groups]
            self._load_pending()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Loads into every replica's optimizer (each on its device), and the LR schedulers' states into
        the attached schedulers (or into those attached later, for a model loaded before fit)."""
        self._outside_run("load_state_dict")
        own = {k: v for k, v in state_dict.items() if k != self.LR_SCHEDULERS_KEY}
        for opt in self.replicas:
            # A copy each (replicas on one device must not share state tensors); torch's load_state_dict
            # moves the state to each parameter's device itself, and keeps Adam's `step` on the CPU
            # (moved to a GPU, every step would read it back with .item(): a sync per parameter).
            opt.load_state_dict(copy.deepcopy(own))
        self.load_lr_schedulers_state_dict(state_dict)

    def attach_lr_scheduler(self, scheduler: Any) -> None:
        """Saves `scheduler`'s state with this optimizer's: state_dict() carries it and load_state_dict()
        restores it, so Model.save and BackupAndRestore keep the schedule (mr.callbacks.TorchLRScheduler
        attaches its scheduler). A state loaded before the scheduler existed is restored into it now."""
        if getattr(scheduler, "optimizer", None) is not self:
            raise ValueError(f"MirroredOptimizer.attach_lr_scheduler({type(scheduler).__name__}): the scheduler drives "
                             f"{getattr(scheduler, 'optimizer', None)!r}, not this optimizer. Build it on this one, "
                             "e.g. torch.optim.lr_scheduler.StepLR(mirrored_optimizer, step_size=30).")
        if not any(s is scheduler for s in self._schedulers):
            self._schedulers.append(scheduler)
            self._load_pending()

    def _load_pending(self) -> None:
        """Restores the loaded states of the schedulers attached so far (the i-th state into the i-th
        scheduler attached), and the rate each had set, which is the optimizer's rate at the save."""
        for i, scheduler in enumerate(self._schedulers):
            state = self._pending_schedulers.pop(i, None)
            if state is None:
                continue
            scheduler.load_state_dict(copy.deepcopy(state))
            for group, lr in zip(self.param_groups, scheduler.get_last_lr()):
                group["lr"] = lr
            for group, saved in zip(self.param_groups, getattr(self, "_pending_groups", None) or []):
                for key in _SCHEDULED_KEYS:  # what a scheduler sets besides the rate (OneCycleLR's momentum)
                    if key in saved:
                        group[key] = saved[key]

    def _outside_run(self, what: str) -> None:
        if self._replica() is not None and len(self.replicas) > 1:
            raise RuntimeError(f"MirroredOptimizer.{what}() was called inside strategy.run, where each replica would "
                               f"change the optimizers on its own. Call it before strategy.run (in cross-replica "
                               "context): it then reaches every replica's optimizer at once.")

    def _register(self, what: str, hook: Callable[..., Any], **kwargs: Any) -> HookHandles:
        self._outside_run(what)
        return HookHandles([getattr(opt, what)(hook, **kwargs) for opt in self.replicas])

    def register_step_pre_hook(self, hook: Callable[..., Any]) -> HookHandles:
        """hook(optimizer, args, kwargs) before every replica's update, with that replica's torch optimizer."""
        return self._register("register_step_pre_hook", hook)

    def register_step_post_hook(self, hook: Callable[..., Any]) -> HookHandles:
        """hook(optimizer, args, kwargs) after every replica's update, with that replica's torch optimizer;
        returns handles whose remove() takes it off every replica."""
        return self._register("register_step_post_hook", hook)

    def register_state_dict_pre_hook(self, hook: Callable[..., Any], prepend: bool = False) -> HookHandles:
        """hook(optimizer) before state_dict() reads the state: once, with replica 0's torch optimizer
        (state_dict() reads that one; the others are equal)."""
        return self._register("register_state_dict_pre_hook", hook, prepend=prepend)

    def register_state_dict_post_hook(self, hook: Callable[..., Any], prepend: bool = False) -> HookHandles:
        """hook(optimizer, state_dict) after state_dict() reads replica 0's optimizer; a dict it returns
        replaces the state_dict (torch's contract)."""
        return self._register("register_state_dict_post_hook", hook, prepend=prepend)

    def register_load_state_dict_pre_hook(self, hook: Callable[..., Any], prepend: bool = False) -> HookHandles:
        """hook(optimizer, state_dict) before each replica's optimizer loads (with its own copy of the
        dict); a dict it returns is loaded instead (torch's contract)."""
        return self._register("register_load_state_dict_pre_hook", hook, prepend=prepend)

    def register_load_state_dict_post_hook(self, hook: Callable[..., Any], prepend: bool = False) -> HookHandles:
        """hook(optimizer) after each replica's optimizer has loaded, once per replica."""
        return self._register("register_load_state_dict_post_hook", hook, prepend=prepend)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Refused: a group holds one copy's parameters; build the groups in the optimizer instead."""
        raise ValueError("MirroredOptimizer.add_param_group: each replica's optimizer holds its own copy's "
                         "parameters, so a group of one copy's parameters cannot be added to all. Build the "
                         "groups in the optimizer: strategy.mirror_optimizer(lambda params: torch.optim.SGD("
                         "...), mnet).")

    def __getstate__(self) -> dict[str, Any]:
        raise TypeError("a MirroredOptimizer cannot be pickled or copied (it holds a strategy's replicas); save "
                        "its state_dict() instead.")

    def __repr__(self) -> str:
        return f"MirroredOptimizer({len(self.replicas)} replicas of {type(self.replicas[0]).__name__})"


def _is_mean(reduction: str | ReduceOp) -> bool:
    value = reduction.value if isinstance(reduction, ReduceOp) else reduction
    if not isinstance(value, str) or value.lower() not in GRADIENT_REDUCTIONS:
        raise ValueError(f"strategy.mirror_optimizer(gradient_reduction={reduction!r}): use \"sum\" (TF's rule: "
                         "scale each replica's loss by the GLOBAL batch) or \"mean\" (DDP's: average the replicas' "
                         "gradients, for an unchanged loss line).")
    return value.lower() == "mean"


def _reduces_in_backward(reduce_in_backward: bool | None, mean: bool) -> bool:
    if reduce_in_backward is not None and not isinstance(reduce_in_backward, bool):
        raise TypeError(f"strategy.mirror_optimizer(reduce_in_backward={reduce_in_backward!r}): give True, False, or "
                        "None (True for \"mean\", False for \"sum\").")
    if reduce_in_backward and not mean:
        raise ValueError("strategy.mirror_optimizer(reduce_in_backward=True) needs gradient_reduction=\"mean\": with "
                         "\"sum\" each replica scales its loss by the GLOBAL batch and the gradients are all-reduced "
                         "in step() (or reduce_gradients(), to clip them first). Pass gradient_reduction=\"mean\", or "
                         "leave reduce_in_backward unset.")
    return mean if reduce_in_backward is None else reduce_in_backward


class _BufferPlan:
    """One replica's state tensors on one device, laid out once for every step's sync: the averaged ones
    (floating point) in one float64 flat whose last element holds the replica's weight, and replica 0's
    ones in a float64 flat (floats) and an int64 flat (integers, exact for any int64 value), each with
    views shaped like its tensors, so that a sync is a few fused torch calls whatever their number (each
    torch call on the step's path also hands the GIL to the other replicas)."""

    __slots__ = ("means", "flat", "values", "views", "weighted", "weight", "firsts", "result", "parts")

    def __init__(self, means: list[Tensor], firsts: list[Tensor], device: torch.device):
        self.means = means
        numel = sum(b.numel() for b in means)
        self.flat = torch.ones(numel + 1, dtype=torch.float64, device=device)  # (the last: the weight, x w)
        self.values = self.flat[:numel]
        self.views = _views_of(self.values, means)
        self.weighted = torch.empty_like(self.flat)  # what a replica sends with a weight other than 1
        self.weight = 1.0  # the weight of this replica's last gather
        # The last sums scattered and their (total weight, sums) views: the reducer's results are views of
        # buffers it keeps, the same tensors step after step.
        self.result: Tensor | None = None
        self.parts: tuple[Tensor, Tensor] | None = None
        kinds = ([b for b in firsts if b.is_floating_point()], [b for b in firsts if not b.is_floating_point()])
        self.firsts = [_Firsts(kind, dtype, device) for kind, dtype in zip(kinds, (torch.float64, torch.int64)) if kind]

    def gather(self, weight: float, first: bool) -> list[Tensor]:
        """What this replica sends: its averaged tensors (exactly, in float64) times `weight`, with the
        weight itself last; then replica 0's tensors (zeros on the others, so that the sum is replica 0's)."""
        sent = []
        self.weight = weight
        if self.means:
            torch._foreach_copy_(self.views, self.means)
            sent.append(self.flat if weight == 1.0 else torch.mul(self.flat, weight, out=self.weighted))
        sent.extend(part.gather(first) for part in self.firsts)
        return sent

    def scatter(self, summed: list[Tensor], i: int) -> int:
        """Writes the sums from summed[i] on into the tensors, each cast back to its dtype: the averaged
        ones divided by the replicas' total weight (> 0 in a step with examples; otherwise they keep their
        values - torch.where keeps a device sync out of the step). Returns the next index."""
        if self.means:
            if summed[i] is not self.result:
                self.result, self.parts = summed[i], (summed[i][-1], summed[i][:-1])
            total, sums = self.parts
            if self.weight > 0:  # (then so is the total: weights are >= 0)
                torch.div(sums, total, out=self.values)
            else:
                self.values.copy_(torch.where(total > 0, sums / total, self.values))
            torch._foreach_copy_(self.means, self.views)
            i += 1
        for part in self.firsts:
            part.scatter(summed[i])
            i += 1
        return i


class _Firsts:
    """Tensors that take replica 0's value, in one flat of `dtype` that holds each of them exactly."""

    __slots__ = ("tensors", "flat", "views", "zeros", "result", "result_views")

    def __init__(self, tensors: list[Tensor], dtype: torch.dtype, device: torch.device):
        self.tensors = tensors
        self.flat = torch.zeros(sum(t.numel() for t in tensors), dtype=dtype, device=device)
        self.views = _views_of(self.flat, tensors)
        self.zeros = torch.zeros_like(self.flat)  # what the replicas other than replica 0 send
        # The last sum scattered, and once it came twice its views (see _BufferPlan.result; a large one
        # comes in a new tensor each time, whose views would cost more than the flat's copy)
        self.result: Tensor | None = None
        self.result_views: list[Tensor] | None = None

    def gather(self, first: bool) -> Tensor:
        if not first:
            return self.zeros
        torch._foreach_copy_(self.views, self.tensors)
        return self.flat

    def scatter(self, summed: Tensor) -> None:
        if summed is self.result:
            if self.result_views is None:
                self.result_views = _views_of(summed, self.tensors)
            torch._foreach_copy_(self.tensors, self.result_views)
        else:
            self.result, self.result_views = summed, None
            self.flat.copy_(summed)
            torch._foreach_copy_(self.tensors, self.views)


def _views_of(flat: Tensor, tensors: list[Tensor]) -> list[Tensor]:
    """Views of consecutive parts of `flat`, one shaped like each of `tensors`."""
    views, start = [], 0
    for t in tensors:
        views.append(flat[start:start + t.numel()].view(t.shape))
        start += t.numel()
    return views


class _BackwardSync:
    """One replica's part in its gradients' reduction: whether they are reduced (until the update), the
    reduced gradients set aside while another backward accumulates its own ("mean" in backward),
    whether the end-of-backward callback is queued, its replica context, the weight
    set_gradient_weight gave for the next reduction, and where its last reduction left the module's
    example count ("mean")."""

    __slots__ = ("reduced", "stash", "queued", "ctx", "weight", "seen")

    def __init__(self) -> None:
        self.reduced = False
        self.stash: list[Tensor | None] | None = None
        self.queued = False
        self.ctx: Any = None
        self.weight: tuple[float | Tensor, bool] | None = None  # set_gradient_weight's, until the next reduction
        self.seen = (0, 0)  # "mean": the module's (examples, calls) count at this optimizer's last reduction

    def saved(self) -> Callable[[], None]:
        """This state as it is now, as a function that puts it back (for StepJournal.before_change)."""
        reduced, stash, weight, seen = self.reduced, self.stash, self.weight, self.seen

        def restore() -> None:
            self.reduced, self.stash, self.queued, self.weight, self.seen = reduced, stash, False, weight, seen

        return restore


def _grad_accumulated(optimizer_ref: Any, rid: int, param: Tensor) -> None:
    """A parameter's gradient was accumulated in backward: queue the replica's all-reduce for the end
    of this backward (once per backward; autograd runs queued callbacks after every accumulation)."""
    optimizer = optimizer_ref()
    if optimizer is None or optimizer._module._shared.grad_sync is not optimizer:
        return  # a newer "mean" optimizer of the module syncs it now
    state = optimizer._sync[rid]
    if not state.queued:
        state.queued = True
        torch.autograd.Variable._execution_engine.queue_callback(lambda: optimizer._end_backward(rid))
