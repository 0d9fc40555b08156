"""`mr.Model`: a Keras-style compile / fit / evaluate / predict / save around any torch.nn.Module.

Created in a strategy's scope, the module is mirrored on every replica and each training step runs
on all of them (`strategy.run`). Loss scaling is exact: per-example losses are summed and divided by
the number of examples in the GLOBAL step (the real count, so an uneven last batch weighs right),
which makes N replicas give one device's update. Keras on TF instead averages per-replica means in
that last batch; we do not, on purpose. Metrics keep sync-on-read state: each replica accumulates,
a read sums across replicas. fit's epochs and its place in the data are an EpochIterator
(epochs.py), which BackupAndRestore saves and restores. Uses the public surface of
`mirrored.distribute` and `mirrored.data`.
"""
from __future__ import annotations

import contextlib
import itertools
import logging
import math
import time
import warnings
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn

import mirrored.distribute as md
from mirrored.training import callbacks as callbacks_lib
from mirrored.training import checkpoint, checkpoint_checks, epochs as epochs_lib, losses, metrics as metrics_lib, optimizers
from mirrored.training import adapters, jit
from mirrored.training._trackables import LossScale
from mirrored.distribute.random import watched_step
from mirrored.training.layers import has_sync_batchnorm

logger = logging.getLogger(__name__)

_FORMAT = "mirrored.Model/1"
INFINITE = -1  # mr.data's INFINITE_CARDINALITY


def _device_of(module: nn.Module) -> str:
    for t in list(module.parameters()) + list(module.buffers()):
        return str(t.device) if t.device.type != "cpu" else "cpu:0"
    return "cpu:0"


def _unpack(batch: Any) -> tuple[Any, Any, Any]:
    """(x, y, sample_weight) from a dataset element, as Keras' unpack_x_y_sample_weight."""
    if isinstance(batch, (tuple, list)):
        if len(batch) == 1:
            return batch[0], None, None
        if len(batch) == 2:
            return batch[0], batch[1], None
        if len(batch) == 3:
            return batch[0], batch[1], batch[2]
        raise ValueError(f"a dataset element has {len(batch)} parts; expected (x,), (x, y) or (x, y, sample_weight).")
    if isinstance(batch, dict) and "image" in batch and "label" in batch:
        return batch["image"], batch["label"], None
    return batch, None, None


def _as_array(value: Any, where: str, arg: str) -> Any:
    """Array data as the user gives it: a numpy array or tensor as is; a (nested) list or tuple of
    numbers becomes a numpy array (anything else is a dataset, or None)."""
    if not isinstance(value, (list, tuple)) or not _numbers(value):
        return value
    try:
        return np.asarray(value)
    except ValueError as e:  # a ragged list
        raise ValueError(f"Model.{where}: {arg} is a list of numbers but not a rectangular array ({e}). Give "
                         "one row per example, all of the same shape.") from None


def _numbers(value: Any) -> bool:
    """Whether a list or tuple holds numbers (down its first elements), not batches or arrays."""
    while isinstance(value, (list, tuple)) and value:
        value = value[0]
    return isinstance(value, (bool, int, float, np.number))


def _as_input(value: Any, device: torch.device) -> Any:
    """One input of model(x): an array as a tensor on the module's device."""
    if isinstance(value, np.ndarray):
        return torch.as_tensor(value, device=device)
    return value.to(device) if isinstance(value, Tensor) else value


def _module_dtype(net: Any) -> torch.dtype | None:
    """The dtype of the module's floating-point parameters (its buffers' without any)."""
    for t in itertools.chain(net.parameters(), net.buffers()):
        if t.is_floating_point():
            return t.dtype
    return None


def _cast_inputs(x: Any, dtype: torch.dtype | None) -> Any:
    """Floating-point inputs in the module's dtype, as Keras casts inputs to floatx: float64 numpy data
    meets a float32 module, and a float64 module keeps float64. Nothing else changes: integer inputs
    (token ids, uint8 images) stay, and the layout is the module's business (it is never guessed)."""
    if dtype is None:
        return x
    return md.values.map_structure(
        lambda t: t.to(dtype) if isinstance(t, Tensor) and t.is_floating_point() and t.dtype != dtype else t, x)


def _as_labels(y: Any) -> Any:
    """Integer labels as int64, which torch's losses and metrics take (numpy's int32 labels too)."""
    if isinstance(y, Tensor) and not (y.is_floating_point() or y.is_complex()) and y.dtype not in (torch.int64,
                                                                                                    torch.bool):
        return y.long()
    return y


def _weights_like(sw: Any, per_example: Tensor) -> Any:
    """Sample weights shaped like the per-example losses: (B, 1) is squeezed to (B,), as Keras does."""
    if sw is None:
        return None
    while isinstance(sw, Tensor) and sw.dim() > per_example.dim() and sw.shape[-1] == 1:
        sw = sw.squeeze(-1)
    if isinstance(sw, Tensor) and sw.dim() > per_example.dim():
        raise ValueError(f"sample_weight of shape {tuple(sw.shape)} does not fit per-example losses of shape "
                         f"{tuple(per_example.shape)}: give one weight per example, shape (batch,) or (batch, 1).")
    if isinstance(sw, Tensor) and 0 < sw.dim() < per_example.dim():  # one weight per example, for all its values
        sw = sw.reshape(*sw.shape, *[1] * (per_example.dim() - sw.dim()))
    return sw


def _check_validation_freq(freq: Any) -> None:
    """Keras's validation_freq: validate every `freq` epochs (an int >= 1), or after the epochs
    listed (1-based, e.g. [1, 5, 10]). Checked before training, not after the first epoch."""
    if isinstance(freq, bool) or not (
            (isinstance(freq, int) and freq >= 1)
            or (isinstance(freq, (list, tuple, set, range)) and freq
                and all(isinstance(e, int) and not isinstance(e, bool) and e >= 1 for e in freq))):
        raise ValueError(f"fit(validation_freq={freq!r}): give an int >= 1 (validate every that many epochs) or "
                         "a list of 1-based epoch numbers, e.g. [1, 5, 10].")


def _should_validate(epoch: int, freq: int | Iterable[int]) -> bool:
    return (epoch + 1) % freq == 0 if isinstance(freq, int) else epoch + 1 in freq


class Model:
    """Wraps a torch.nn.Module (which returns logits) with Keras's training API, under a strategy.

    The module receives exactly what the data yields, in fit, evaluate, predict and model(x) alike:
    numpy arrays, lists of numbers and tensors are taken as given; only floating-point inputs change,
    to the module's dtype (as Keras casts to floatx), and integer labels become int64. A layout is
    never guessed from a shape: the module declares it (mr.models' data_format), or the pipeline
    makes it."""

    def __init__(self, module: nn.Module, name: str | None = None):
        # What differs by the module's kind (a Keras 3 model follows Keras's conventions), decided once.
        self._adapter = adapters.adapter_for(module)
        if not isinstance(module, nn.Module):
            raise TypeError(f"mr.Model({type(module).__name__}): expected a torch.nn.Module.")
        strategy = md.get_strategy()
        if not md.has_strategy():  # outside any scope: one replica where the module already lives
            strategy = md.OneDeviceStrategy(_device_of(module))
        if md.get_replica_context() is not None and md.has_strategy():
            raise RuntimeError("mr.Model(...) was created inside strategy.run; create it in `with strategy.scope():`.")
        self.name = name or type(module).__name__
        self.distribute_strategy = strategy
        with strategy.scope():  # (convolutions in channels_last memory: compile(memory_format=) changes it)
            self._net = strategy.mirror(module, memory_format="auto")
        self._sync_bn = has_sync_batchnorm(module)
        self.optimizer: optimizers.Optimizer | None = None
        self._mopt: Any = None
        self._loss: losses.Loss | None = None
        self._metrics: list[Any] = []
        self._loss_tracker: Any = None
        self._compiled = False
        self.stop_training = False
        self.history: Any = None
        # fit's epochs and place in the data, during fit; callbacks (BackupAndRestore) use its get_state /
        # set_state, and its initial_epoch is Keras's model._initial_epoch.
        self._epoch_iterator: epochs_lib.EpochIterator | None = None
        self._precision: str | None = None
        self._predict_like: tuple[torch.Size, torch.dtype] | None = None  # an output row's shape and dtype
        self._scalers: list[Any] = []
        self._jit: jit.ReplicaCompiler | None = None  # compile(jit_compile=True)'s, on the replicas' copies
        self._auto_jit: jit.AutoCompile | None = None  # compile(jit_compile="auto")'s decision, made in fit

    # ---- structure -------------------------------------------------------------------------------
    @property
    def module(self) -> nn.Module:
        """Replica 0's module (every replica's copy is identical)."""
        return self._net.replicas[0]

    @property
    def replicas(self) -> tuple[nn.Module, ...]:
        """The module's copies, one per replica (replica 0's is `module`)."""
        return self._net.replicas

    @property
    def adapter(self) -> Any:
        """What differs by the module's kind, chosen when the Model was built (adapters.py): a
        TorchAdapter, or a KerasAdapter for a Keras 3 model."""
        return self._adapter

    @property
    def mirrored_optimizer(self) -> Any:
        """The MirroredOptimizer compile() built (one torch optimizer per replica); None before compile()."""
        return self._mopt

    @property
    def jit_compile(self) -> bool:
        """Whether the replicas' steps run compiled (Keras's model.jit_compile); False after a fallback."""
        return self._jit is not None and self._jit.active

    @property
    def memory_format(self) -> str:
        """The memory format the module's convolutions run in ("channels_last", "channels_last_3d", or
        "as given"), as compile(memory_format=...) chose it."""
        return self._net.memory_format

    @property
    def metrics(self) -> list[Any]:
        """The loss tracker (once compiled) and the compiled metrics, as Keras's `model.metrics`."""
        return ([self._loss_tracker] if self._loss_tracker is not None else []) + list(self._metrics)

    def __call__(self, x: Any, *args: Any, training: bool = False, **kwargs: Any) -> Any:
        """The module on `x`, fed as fit, evaluate and predict feed it: arrays and lists become tensors on
        its device, floating-point inputs take its dtype, nothing else changes. training=False (Keras's
        default) runs in inference mode, so model(x) equals predict(x); inside strategy.run it is the
        replica's own copy, in the mode the module is in."""
        net = self._net
        own = net.module
        device = next(itertools.chain(own.parameters(), own.buffers()), torch.empty(0)).device
        x = _as_input(_as_array(x, "__call__", "x"), device)
        x = md.values.map_structure(lambda v: _as_input(v, device), x)  # a dict or tuple of inputs, each
        ctx = md.get_replica_context()
        if ctx is not None and ctx.strategy is self.distribute_strategy:
            return self._forward(net, x, *args, training=training, **kwargs)
        modes = [m.training for m in net.values]
        net.train(training)
        try:
            return self._forward(net, x, *args, training=training, **kwargs)
        finally:
            for m, mode in zip(net.values, modes):
                m.train(mode)

    def summary(self, print_fn: Any = print) -> None:
        """Prints the top-level layers with their parameter counts, and the totals (a Keras model's
        own summary for a Keras model)."""
        title = f'Model: "{self.name}" on {self.distribute_strategy.num_replicas_in_sync} replica(s)'
        self._adapter.summary(self.module, title, print_fn)

    # ---- compile -----------------------------------------------------------------------------------
    def compile(self, optimizer: Any = "rmsprop", loss: Any = None, metrics: Sequence[Any] | None = None,
                steps_per_execution: int = 1, precision: str | None = None, jit_compile: bool | str = "auto",
                memory_format: str = "auto") -> None:
        """Chooses the optimizer, loss and metrics. Strings mean Keras names; losses take logits.

        Args:
          optimizer: a name ("sgd", "adam", "adamw", "rmsprop"), an mr.optimizers.Optimizer, its
            serialize() config, or a torch.optim class or instance (its class and defaults are reused:
            every replica gets its own).
          loss: a name ("sparse_categorical_crossentropy", "mse", ...; crossentropies take logits), an
            mr.losses.Loss, a torch.nn loss module, or fn(y_true, y_pred) -> per-example losses. Required.
          metrics: names ("accuracy" follows the loss, as in Keras), mr.metrics.Metric objects, or
            functions fn(y_true, y_pred) -> one value per example.
          steps_per_execution: batches each strategy.run call trains on, one update each: fewer hand-offs
            to the replica threads, the same updates.
          precision: None or "fp32"; "bf16" (autocast, CPU or CUDA); "fp16" (autocast with a loss scale per
            replica, CUDA only).
          jit_compile: True compiles each replica's forward and backward with torch.compile (training/jit.py:
            what is compiled, the tolerance against eager, the fallback); False runs eager; "auto" (Keras
            3's default) starts eager and compiles after fit's first steps where the steps left pay back
            the compile time (logged at INFO).
          memory_format: where the module's 2-D / 3-D convolution weights live in memory (ours; Keras has no
            such knob): "auto" channels_last(_3d) for float32/16 weights on CPU and CUDA, whose kernels are
            fastest so (1.4-1.6x on a CPU); "channels_last" always; "preserve" the module's own format, as
            given. Results equal the NCHW path's up to float reassociation; checkpoints hold the standard
            layout either way. `model.memory_format` says which ran.
        """
        if loss is None:
            raise ValueError("compile(loss=None): give a loss, e.g. loss=\"sparse_categorical_crossentropy\".")
        # (set on the model once built: a refused instance changes nothing)
        recipe = self._adapter.optimizer(optimizer, self._net.replicas)
        if not isinstance(steps_per_execution, int) or steps_per_execution < 1:
            raise ValueError(f"compile(steps_per_execution={steps_per_execution!r}): give an integer >= 1.")
        if precision not in (None, "fp32", "bf16", "fp16"):
            raise ValueError(f"compile(precision={precision!r}): use None/\"fp32\", \"bf16\" or \"fp16\".")
        if precision == "fp16" and getattr(recipe, "gradient_accumulation_steps", None):
            raise ValueError("compile(precision=\"fp16\") with gradient_accumulation_steps: the loss scale may skip "
                             "the update that k steps of gradients build up to. Use precision=\"bf16\", or no "
                             "gradient accumulation.")
        devices = self.distribute_strategy.extended.worker_devices
        if precision == "fp16" and not all(d.startswith("cuda") for d in devices):
            raise ValueError("compile(precision=\"fp16\") needs CUDA devices (fp16 with loss scaling); on CPU use "
                             "precision=\"bf16\".")
        use_jit = jit.resolve(jit_compile)
        if use_jit:
            self._adapter.refuse_jit()
        strategy = self.distribute_strategy
        # Before the optimizer is built: its gradient buckets follow the weights' layout.
        self._net.set_memory_format(memory_format)
        with strategy.scope():
            self._mopt = strategy.mirror_optimizer(lambda params: recipe.build(params), self._net)
            self.optimizer = recipe
            self._loss = self._adapter.loss(loss)
            if getattr(self._loss, "reduction", None) == "none":
                raise ValueError(f"compile(loss={loss!r}): reduction='none' leaves one loss per example, but fit "
                                 "needs one number to minimise. Use reduction='sum_over_batch_size' (the mean, "
                                 "Keras's default) or 'sum'.")
            loss_name = getattr(self._loss, "name", None)
            self._metrics = [self._adapter.metric(m, loss_name) for m in (metrics or [])]
            self._loss_tracker = metrics_lib.Mean(name="loss")
        self._steps_per_execution = steps_per_execution
        self._precision = None if precision == "fp32" else precision
        self._scalers = [torch.amp.GradScaler("cuda") for _ in devices] if precision == "fp16" else []
        if self._jit is not None:
            self._jit.remove()
        self._jit = jit.ReplicaCompiler(self._net.replicas, devices) if use_jit else None
        # "auto": fit times its first steps and compiles where that pays back within the run. Eager with
        # SyncBatchNorm (which cannot be compiled) and across workers, where each would time and decide on
        # its own and one compiling for minutes would keep the others waiting in the all-reduce.
        self._auto_jit = (jit.AutoCompile(devices) if jit_compile == "auto" and not self._sync_bn
                          and strategy.num_workers == 1 else None)
        # Names and configs rebuild exactly; an object without a config is recorded by its repr, so that load()
        # can say what to pass.
        self._compile_config = {
            "optimizer": _config_or_repr(self.optimizer, self.optimizer, optimizers.serialize),
            "loss": _config_or_repr(loss, self._loss, losses.serialize),
            "metrics": [_config_or_repr(m, compiled, metrics_lib.serialize)
                        for m, compiled in zip(metrics or [], self._metrics)],
            "precision": precision, "jit_compile": use_jit, "memory_format": memory_format}
        self._compiled = True

    def _require_compiled(self, what: str) -> None:
        if not self._compiled:
            raise RuntimeError(f"Model.{what}() needs compile() first: model.compile(optimizer=..., loss=...).")

    def _autocast(self, device: torch.device) -> Any:
        if self._precision is None:
            return contextlib.nullcontext()
        dtype = torch.bfloat16 if self._precision == "bf16" else torch.float16
        return torch.autocast(device_type=device.type, dtype=dtype)

    # ---- one replica's steps (replica context) ----------------------------------------------------
    def _forward(self, net: Any, x: Any, *args: Any, training: bool = False, **kwargs: Any) -> Tensor:
        """The module on what the data yields, in fit, evaluate, predict and model(x) alike: only
        floating-point inputs change, to the module's dtype. A Keras model also gets `training`, as
        Keras's trainer passes it (True in fit's train steps only)."""
        dtype = _module_dtype(net)
        device = next((p.device for p in net.parameters()), torch.device("cpu"))
        with self._autocast(device):
            try:
                out = self._adapter.call(net, _cast_inputs(x, dtype), training, *args, **kwargs)
            except RuntimeError as e:
                if "view size is not compatible" not in str(e) or self.memory_format == "as given":
                    raise
                raise RuntimeError(
                    f"{e}\nThe module's convolutions run in {self.memory_format} memory (compile(memory_format="
                    "\"auto\")), and a .view() after one needs row-major memory: use .reshape() or "
                    "torch.flatten() there, or compile(..., memory_format=\"preserve\").") from e
        return out.float() if isinstance(out, Tensor) and out.dtype in (torch.bfloat16, torch.float16) else out

    def _step_loss(self, ctx: Any, net: nn.Module, x: Any, y: Any, sw: Any, count: int, training: bool = False
                   ) -> tuple[Tensor | None, Tensor | None, Any]:
        """This replica's share of the step's loss (the shares of all replicas add up to the loss of
        the global batch, reduced as the loss object says, as Keras reduces it on one device), its
        logits, and its sample weights. An empty part (a short last batch) has no share and no
        logits, but joins whatever collective the others make: with ignore_class, the count of
        kept labels; with SyncBatchNorm, the forward pass's statistics."""
        rows = _rows(x)
        # Labels and weights as Keras's data adapters make them: float ones in the module's dtype (floatx).
        dtype = _module_dtype(net)
        y, sw = _cast_inputs(_as_labels(y), dtype), _cast_inputs(sw, dtype)
        logits = per_example = None
        if rows or self._sync_bn:
            logits = self._forward(net, x, training=training)
            per_example = self._loss.per_example(y, logits)
            sw = _weights_like(sw, per_example)
            if sw is not None:
                per_example = per_example * sw
        ignore = getattr(self._loss, "ignore_class", None)
        if self._loss.reduction == "sum":
            denominator: Any = 1
        elif ignore is not None:  # Keras divides by the labels kept, over the whole global batch
            denominator = ctx.all_reduce(md.ReduceOp.SUM, self._loss.kept(y)).clamp(min=1)
        else:  # every loss value of the global batch: rows times the values per row (a sequence's steps)
            denominator = count * (math.prod(per_example.shape[1:]) if per_example is not None else 1)
        share = per_example.sum() / denominator if per_example is not None else None
        return share, logits, sw

    def _track(self, y: Any, logits: Tensor | None, share: Tensor | None, sw: Any, count: int,
               regularization: Tensor | float) -> None:
        """The reported loss is Keras's: each step's loss (regularization included) weighted by its
        batch size; this replica adds its share of that, and its rows to the count."""
        rows = _rows(logits) if logits is not None else 0
        if not rows:
            return
        penalty = regularization.detach().float() if isinstance(regularization, Tensor) else regularization
        with md.WithoutReplicaRandom():  # (the loss tracker draws nothing; a user's metric may, so it keeps it)
            self._loss_tracker.total.assign_add(share.detach().float() * count + penalty * rows)  # no device sync
            self._loss_tracker.count.assign_add(rows)
        y = _cast_inputs(_as_labels(y), logits.dtype if logits.is_floating_point() else None)
        for m in self._metrics:
            if _draws_nothing(m):
                with md.WithoutReplicaRandom():
                    m.update_state(y, logits.detach(), sw)
            else:
                m.update_state(y, logits.detach(), sw)

    def _watchable_steps(self) -> bool:
        """Whether every weight change of a train step follows a meeting of the replicas, where a step
        run without the random mode is checked: not with use_ema and gradient accumulation, whose
        averages may be written into the weights in a step that only accumulates, with no meeting."""
        optimizer = self._mopt.optimizer
        return not (_averages_weights(optimizer) and getattr(optimizer._options, "accumulation_steps", 1) > 1)

    def _train_group(self, batches: list[tuple[Any, Any, Any]], global_counts: list[int]) -> None:
        """_train_replica on several batches, as a step function that keeps the replica random mode."""
        self._train_replica(batches, global_counts)

    @watched_step  # (runs without the replica random mode where it draws nothing)
    def _train_replica(self, batches: list[tuple[Any, Any, Any]], global_counts: list[int]) -> None:
        ctx = md.get_replica_context()
        # Called through the mirror, which notes this replica's gradients and buffers first: a failed
        # step puts them back (issue 17), so the next step does not add a failed step's gradients in.
        net = self._net
        opt = self._mopt
        own = self._net.module  # this replica's copy (on a multi-worker strategy, the process's one)
        scaler = self._scalers[[m is own for m in self._net.replicas].index(True)] if self._scalers else None
        loss_scale = getattr(self.optimizer, "loss_scale_factor", None)
        for (x, y, sw), count in zip(batches, global_counts):
            # An empty part (a short last batch) still joins the gradient all-reduce.
            share, logits, sw = self._step_loss(ctx, net, x, y, sw, count, training=True)
            regularization = self._regularization(net)
            # Every replica adds its 1 / replicas of the penalty, an empty part too: the gradients are summed.
            loss = regularization / ctx.num_replicas_in_sync + (share if share is not None else 0.0)
            if loss_scale is not None and isinstance(loss, Tensor):  # a Keras optimizer's, which apply() undoes
                loss = loss * loss_scale
            if isinstance(loss, Tensor) and loss.requires_grad:
                (scaler.scale(loss) if scaler else loss).backward()
            elif scaler is not None:  # an empty part: its scaler must still hold the scale that step() unscales by
                scaler.scale(torch.zeros((), device=next(own.parameters()).device))
            if share is not None:
                with torch.no_grad():
                    self._track(y, logits, share, sw, count, regularization)
            # With gradient_accumulation_steps, a step that only accumulates keeps its gradients local: one
            # all-reduce per update. Then step() clips the reduced gradients and applies the schedule and EMA.
            update = opt.optimizer.accumulate_gradients()
            if update:
                opt.reduce_gradients()
            journal = md.current_journal()
            if journal is not None and (update or _averages_weights(opt.optimizer)):
                journal.before_update()  # the weights change now: a step caught drawing later is not run again
            if scaler is not None:
                scaler.step(opt.optimizer)
                scaler.update()
            else:
                opt.optimizer.step()
            if type(opt.optimizer).zero_grad is torch.optim.Optimizer.zero_grad:
                with md.WithoutReplicaRandom():  # (torch's draws nothing: see the optimizer's step)
                    opt.optimizer.zero_grad(set_to_none=True)
            else:
                opt.optimizer.zero_grad(set_to_none=True)
            opt.finish_step(weight=_rows(x), commit=update)  # (an empty part did not update BatchNorm's statistics)

    def _regularization(self, net: nn.Module) -> Tensor | float:
        """A module's `regularization_loss()`, if it has one, or a Keras model's `losses` (each replica's
        gradient takes its share of it, 1 / replicas, as TF does; the reported loss includes all of it,
        as Keras's does)."""
        return self._adapter.regularization(net)

    @watched_step  # (runs without the replica random mode where it draws nothing)
    def _test_replica(self, batches: list[tuple[Any, Any, Any]], global_counts: list[int]) -> None:
        ctx = md.get_replica_context()
        net = self._net.module
        with torch.no_grad():
            for (x, y, sw), count in zip(batches, global_counts):
                share, logits, sw = self._step_loss(ctx, net, x, y, sw, count)
                if share is not None:
                    self._track(y, logits, share, sw, count, self._regularization(net))

    @watched_step  # (runs without the replica random mode where it draws nothing)
    def _predict_replica(self, x: Any) -> Tensor:
        """This replica's outputs; for an empty part (a short last batch), no rows of the shape and
        dtype of the others' rows, so that the parts concatenate (across workers too). Only when no
        output was seen yet (a single batch smaller than the replica count) does the model run on
        zero rows to learn that shape."""
        net = self._net.module
        with torch.no_grad():
            if _rows(x) or self._predict_like is None:
                return self._forward(net, x)
            shape, dtype = self._predict_like
            return torch.empty((0, *shape), dtype=dtype, device=next(iter(net.parameters())).device)

    # ---- data -----------------------------------------------------------------------------------------
    def _as_dataset(self, x: Any, y: Any, batch_size: int | None, sample_weight: Any, shuffle: bool,
                    where: str) -> Iterable[Any]:
        from mirrored.data import Dataset

        if x is None:
            raise ValueError(f"Model.{where}: no data given (x=None).")
        x, y = _as_array(x, where, "x"), _as_array(y, where, "y")
        sample_weight = _as_array(sample_weight, where, "sample_weight")
        if isinstance(y, np.ndarray) and y.dtype.kind in "iu":
            y = y.astype(np.int64)  # class ids: what torch's losses take
        if isinstance(x, (np.ndarray, Tensor)):
            n = len(x)
            if batch_size is None:
                batch_size = 32 * self.distribute_strategy.num_replicas_in_sync
                logger.info("%s: batch_size not given; using %d (32 per replica)", where, batch_size)
            parts = tuple(p for p in (x, y, sample_weight) if p is not None)
            for p in parts:
                if len(p) != n:
                    raise ValueError(f"Model.{where}: x has {n} rows but another array has {len(p)}; "
                                     "x, y and sample_weight must have one row per example.")
            if n == 0:
                raise ValueError(f"Model.{where}: x has no rows (shape {tuple(x.shape)}), so there is nothing to "
                                 "train or evaluate on. Pass at least one example.")
            ds = Dataset.from_tensor_slices(parts if len(parts) > 1 else parts[0])
            if shuffle:
                ds = ds.shuffle(n)
            return ds.batch(batch_size)
        if y is not None:
            raise ValueError(f"Model.{where}: y= is only for arrays; a dataset yields (x, y) pairs itself.")
        if batch_size is not None:
            raise ValueError(f"Model.{where}: batch_size= is only for arrays; a dataset is batched already "
                             "(by the GLOBAL batch size).")
        if isinstance(x, Iterator):  # (a DataLoader is Iterable; its iterator, like a generator, is one pass)
            raise TypeError(f"Model.{where}: got a {type(x).__name__}, which can be read only once, but every epoch "
                            "(and validation) reads the data again. Give something re-iterable that yields GLOBAL "
                            "batches: a torch DataLoader, a list of batches, mr.data.Dataset.from_generator(fn) "
                            "(fn returns a new generator each pass), or arrays with batch_size=.")
        if not isinstance(x, Iterable):
            raise TypeError(f"Model.{where}: expected an mr.data.Dataset of GLOBAL batches (or arrays with "
                            f"batch_size=, a torch DataLoader, a list of batches); got {type(x).__name__}.")
        return x

    # ---- fit / evaluate / predict ------------------------------------------------------------------------
    def fit(self, x: Any = None, y: Any = None, batch_size: int | None = None, epochs: int = 1,
            verbose: Any = "auto", callbacks: Sequence[Any] | None = None, validation_data: Any = None,
            shuffle: bool = True, sample_weight: Any = None, initial_epoch: int = 0,
            steps_per_epoch: int | None = None, validation_steps: int | None = None,
            validation_freq: int | Sequence[int] = 1) -> Any:
        """Trains for `epochs` epochs over a dataset of GLOBAL batches (or arrays with batch_size).

        Args:
          x: an mr.data.Dataset (or any iterable) of GLOBAL batches, each (x, y) or (x, y, sample_weight);
            or the inputs as a numpy array or tensor, with `y` and `batch_size`.
          y: the labels, for array `x` only (a dataset yields its own).
          batch_size: the GLOBAL batch size, for array `x` only; default 32 per replica.
          epochs: the epoch to stop before, counted from 0 (Keras's rule): with initial_epoch=2, epochs=5
            trains epochs 2, 3 and 4.
          verbose: "auto" or 1 a progress bar (whole lines when not a terminal), 2 one line per epoch, 0
            silent.
          callbacks: Callback objects; a History (returned) and, unless verbose=0, a ProgbarLogger are added.
          validation_data: a dataset of GLOBAL batches, or a tuple (x, y) or (x, y, sample_weight) of arrays
            (batched by `batch_size`), evaluated at the end of the epochs `validation_freq` selects; its
            results enter the logs with the val_ prefix.
          shuffle: for array `x`, draw the examples in a new order every epoch (a dataset shuffles itself).
          sample_weight: per-example weights of the loss and metrics, for array `x` only.
          initial_epoch: the epoch to start at, to resume a run.
          steps_per_epoch: batches per epoch; then each epoch goes on from where the last one stopped (for
            ds.repeat()). None: one full pass per epoch.
          validation_steps: batches of validation_data per evaluation; None: all of it.
          validation_freq: validate every that many epochs (an int), or after the listed 1-based epochs.

        Returns:
          The History callback, whose `.history` maps each log key (loss, metrics, val_ ones) to its
          per-epoch values.
        """
        self._require_compiled("fit")
        _check_validation_freq(validation_freq)
        dataset = self._as_dataset(x, y, batch_size, sample_weight, shuffle, "fit")
        val = None
        if validation_data is not None:
            if isinstance(validation_data, tuple) and len(validation_data) in (2, 3):
                vx, vy, *vsw = validation_data
                val = self._as_dataset(vx, vy, batch_size, vsw[0] if vsw else None, False, "fit(validation_data)")
            else:
                val = self._as_dataset(validation_data, None, None, None, False, "fit(validation_data)")
        strategy = self.distribute_strategy
        # Keras: with steps_per_epoch, each epoch continues the previous one's iterator (so ds.repeat()
        # with steps_per_epoch sees all the data); without it, every epoch is a fresh full pass.
        _check_ends(dataset, steps_per_epoch, "fit", "steps_per_epoch")
        if val is not None:
            _check_ends(val, validation_steps, "fit(validation_data)", "validation_steps")
        source = _prefetched(dataset)
        epoch_iterator = epochs_lib.EpochIterator(
            strategy.experimental_distribute_dataset(source, self._input_options()), steps_per_epoch=steps_per_epoch,
            steps_per_execution=self._steps_per_execution, initial_epoch=initial_epoch,
            learning_rate=self._settable_learning_rate, max_learning_rate=self._max_learning_rate())
        verbose = 1 if verbose == "auto" else verbose
        cbs = callbacks_lib.CallbackList(callbacks, add_history=True, add_progbar=verbose != 0, model=self,
                                         verbose=verbose, epochs=epochs, steps=epoch_iterator.num_batches)
        self.stop_training = False
        self._epoch_iterator = epoch_iterator
        try:
            cbs.on_train_begin()  # BackupAndRestore may move the iterator to where a run stopped
            optimizers.warn_if_instance_changed(self.optimizer, stacklevel=2)
            if epoch_iterator.resume_learning_rate is not None:
                self.optimizer.learning_rate = epoch_iterator.resume_learning_rate
            for m in self._net.replicas:
                m.train()
            epoch_logs = self._fit_epochs(epoch_iterator, epochs, cbs, dataset, val, validation_steps,
                                          validation_freq)
            if self.optimizer.use_ema and epochs > 0:  # as Keras, before on_train_end
                for opt in self._mopt.replicas:
                    opt.finalize_variable_values()
            cbs.on_train_end(epoch_logs)
        finally:
            self._epoch_iterator = None
        return self.history

    def _fit_epochs(self, epoch_iterator: epochs_lib.EpochIterator, epochs: int, cbs: Any, dataset: Any, val: Any,
                    validation_steps: int | None, validation_freq: Any) -> dict[str, float]:
        strategy = self.distribute_strategy
        epoch_logs: dict[str, float] = {}
        for epoch in epoch_iterator.epochs(epochs):
            if not epoch_iterator.step:  # a resumed epoch goes on with the metrics restored with it
                self.reset_metrics()
            cbs.on_epoch_begin(epoch)
            logs: dict[str, float] = {}
            batch_logs = _reads_batch_logs(cbs)
            for step, group in epoch_iterator.steps():
                cbs.on_train_batch_begin(step)
                # A group of several batches (steps_per_execution) updates between them, so a draw caught
                # in a later one could not be redone: a group runs in the random mode (_train_group).
                strategy.run(self._train_replica if len(group) == 1 and self._watchable_steps() else self._train_group,
                             args=([_unpack(b) for b, _ in group], [n for _, n in group]))
                if batch_logs:  # (a read of every metric across replicas, while they wait; else once per epoch)
                    logs = self._logs()
                cbs.on_train_batch_end(step + len(group) - 1, {**logs, "num_examples": sum(n for _, n in group)})
                if self._auto_jit is not None and self._auto_jit.after_step(
                        len(group), _steps_left(epoch_iterator.num_batches, epochs - epoch - 1, step + len(group))):
                    self._jit = jit.ReplicaCompiler(self._net.replicas, strategy.extended.worker_devices,
                                                    where='Model.fit(jit_compile="auto")')
                if self.stop_training:
                    break
            if epoch_iterator.step == 0 and epoch_iterator.num_batches != 0:  # (a resumed epoch may be done)
                raise _no_batches("fit", dataset, f"epoch {epoch + 1}")
            epoch_iterator.end_epoch()
            epoch_logs = dict(logs) if logs else self._logs()
            # As Keras: validation runs (through the fit callbacks' test hooks) even in the epoch that
            # a callback stopped, so its end has val_* logs for EarlyStopping, checkpoints and History.
            if val is not None and _should_validate(epoch, validation_freq):
                val_logs = self._evaluate(val, validation_steps, cbs)
                epoch_logs.update({f"val_{k}": v for k, v in val_logs.items()})
                for m in self._net.replicas:
                    m.train()
            cbs.on_epoch_end(epoch, epoch_logs)
            optimizers.warn_if_instance_changed(self.optimizer, stacklevel=3)  # (a scheduler stepped by hand)
            if self.stop_training:
                break
        return epoch_logs

    def _input_options(self) -> md.InputOptions:
        """Batches copied to a replica's device (a GPU) are written there in the convolutions' layout."""
        return md.InputOptions(memory_format="preserve" if self.memory_format == "as given" else "channels_last")

    def _settable_learning_rate(self) -> float | None:
        """The optimizer's rate, which a resumed fit sets back; None with a schedule, which sets it itself."""
        return None if self.optimizer._schedule is not None else self.optimizer.learning_rate

    def _max_learning_rate(self) -> float | None:
        """The largest rate the optimizer can apply: torch's kernels take it in the parameters' dtype."""
        if self._mopt is None:
            return None
        params = [p for g in self._mopt.replicas[0].param_groups for p in g["params"] if p.is_floating_point()]
        return float(torch.finfo(params[0].dtype).max) if params else None

    def _evaluate(self, dataset: Iterable[Any], steps: int | None, cbs: Any) -> dict[str, float]:
        strategy = self.distribute_strategy
        for m in self._net.replicas:
            m.eval()
        self.reset_metrics()
        if cbs is not None:
            cbs.on_test_begin()
        batches = epochs_lib.EpochIterator(strategy.experimental_distribute_dataset(dataset, self._input_options()),
                                           steps_per_epoch=steps,
                                           steps_per_execution=self._steps_per_execution)
        i = -1
        for i, (_, group) in enumerate(batches.steps()):
            if cbs is not None:
                cbs.on_test_batch_begin(i)
            strategy.run(self._test_replica, args=([_unpack(b) for b, _ in group], [n for _, n in group]))
            if cbs is not None:
                cbs.on_test_batch_end(i, self._logs())
        if i < 0 and steps != 0:
            raise _no_batches("evaluate", dataset, "its pass")
        logs = self._logs()
        if cbs is not None:
            cbs.on_test_end(logs)
        return logs

    def evaluate(self, x: Any = None, y: Any = None, batch_size: int | None = None, verbose: Any = "auto",
                 sample_weight: Any = None, steps: int | None = None, callbacks: Sequence[Any] | None = None,
                 return_dict: bool = False) -> Any:
        """Loss and metrics over a dataset: a list [loss, *metrics], or a dict with return_dict=True.

        Args:
          x: an mr.data.Dataset of GLOBAL batches, each (x, y) or (x, y, sample_weight); or inputs as an
            array with `y` and `batch_size`.
          y: the labels, for array `x` only.
          batch_size: the GLOBAL batch size, for array `x` only; default 32 per replica.
          verbose: "auto" or 1 a progress bar, 2 one final line, 0 silent.
          sample_weight: per-example weights, for array `x` only.
          steps: batches to evaluate; None: the whole dataset.
          callbacks: Callback objects; their test hooks run.
          return_dict: return {name: value} instead of a list.

        Returns:
          [loss, *metrics] as floats in compile's order (the loss alone, a float, when there are no
          metrics), or a dict with return_dict=True. Every replica's examples count once.
        """
        self._require_compiled("evaluate")
        dataset = self._as_dataset(x, y, batch_size, sample_weight, False, "evaluate")
        _check_ends(dataset, steps, "evaluate", "steps")
        verbose = 1 if verbose == "auto" else verbose  # Keras: a progress bar unless verbose=0
        cbs = callbacks_lib.CallbackList(callbacks, add_history=False, add_progbar=verbose != 0, model=self,
                                         verbose=verbose, epochs=1,
                                         steps=steps if steps is not None else epochs_lib.len_or_none(dataset))
        logs = self._evaluate(dataset, steps, cbs)
        return logs if return_dict else (list(logs.values()) if len(logs) > 1 else next(iter(logs.values())))

    def predict(self, x: Any, batch_size: int | None = None, verbose: Any = "auto", steps: int | None = None,
                callbacks: Sequence[Any] | None = None) -> np.ndarray:
        """Model outputs for every input row, in input order (the uneven last batch included); the
        callbacks' predict hooks see each batch's outputs (logs["outputs"]), as in Keras.

        Args:
          x: the inputs as an array (batched by `batch_size`) or a dataset of GLOBAL batches (only x of an
            (x, y) element is used).
          batch_size: the GLOBAL batch size, for array `x` only; default 32 per replica.
          verbose: "auto" or 1 a progress bar, 2 one final line, 0 silent.
          steps: batches to predict; None: the whole dataset.
          callbacks: Callback objects; their predict hooks run.

        Returns:
          A numpy array, the outputs of all batches (every replica's rows, every worker's too)
          concatenated along dim 0.
        """
        strategy = self.distribute_strategy
        x = _as_array(x, "predict", "x")
        arrays = isinstance(x, (np.ndarray, Tensor))
        dataset = self._as_dataset(x, None, batch_size if arrays else None, None, False, "predict")
        _check_ends(dataset, steps, "predict", "steps")
        verbose = 1 if verbose == "auto" else verbose
        cbs = callbacks_lib.CallbackList(callbacks, add_progbar=verbose != 0, model=self, verbose=verbose, epochs=1,
                                         steps=steps if steps is not None else epochs_lib.len_or_none(dataset))
        for m in self._net.replicas:
            m.eval()
        outputs = []
        self._predict_like = None
        cbs.on_predict_begin()
        for i, batch in enumerate(strategy.experimental_distribute_dataset(dataset, self._input_options())):
            if steps is not None and i >= steps:
                break
            cbs.on_predict_batch_begin(i)
            bx, _, _ = _unpack(batch)
            result = strategy.run(self._predict_replica, args=(bx,))
            first = next((p for p in strategy.experimental_local_results(result) if len(p)), None)
            if first is not None and self._predict_like is None:
                self._predict_like = (first.shape[1:], first.dtype)
            # Every replica's rows in batch order: on a multi-worker strategy, every worker's.
            outputs.append(strategy.gather(result, axis=0).detach().cpu().numpy())
            cbs.on_predict_batch_end(i, {"outputs": outputs[-1]})
        cbs.on_predict_end()
        if not outputs:
            raise ValueError("Model.predict: the dataset yielded no batches.")
        return np.concatenate(outputs, axis=0)

    def check_in_sync(self) -> None:
        """Raises OutOfSyncError unless every replica holds bitwise-identical weights and optimizer state."""
        self.distribute_strategy.check_in_sync(self._net)
        if self._mopt is not None:
            self.distribute_strategy.check_in_sync(self._mopt)

    # ---- metrics -----------------------------------------------------------------------------------
    def reset_metrics(self) -> None:
        """Resets every metric's state (every replica's copy), as fit does at each epoch's start."""
        for m in self.metrics:
            m.reset_state()

    def _logs(self) -> dict[str, float]:
        return {m.name: float(m.result()) for m in self.metrics}

    # ---- weights and checkpoints ------------------------------------------------------------------
    def get_weights(self) -> list[np.ndarray]:
        """The state_dict's tensors (parameters and buffers) as numpy arrays, in state_dict order."""
        return [t.detach().cpu().numpy().copy() for t in self.module.state_dict().values()]

    def set_weights(self, weights: Sequence[Any]) -> None:
        """Sets every replica's state_dict from a list in get_weights() order."""
        keys = list(self.module.state_dict().keys())
        if len(weights) != len(keys):
            raise ValueError(f"set_weights: got {len(weights)} arrays but the model's state_dict has {len(keys)} "
                             "entries; pass the list get_weights() returns.")
        state = {}
        for k, (key, w) in enumerate(zip(keys, weights)):
            t = torch.as_tensor(np.asarray(w))
            ref = self.module.state_dict()[key]
            if tuple(t.shape) != tuple(ref.shape):
                raise ValueError(f"set_weights: weight {k} ({key}) has shape {tuple(t.shape)}, expected "
                                 f"{tuple(ref.shape)}.")
            state[key] = t.to(ref.dtype)
        self._net.load_state_dict(state)

    @property
    def loss_scale(self) -> LossScale | None:
        """The fp16 loss scale of compile(precision="fp16") as one trackable (get_state/set_state), None
        otherwise; Model.save and mr.train checkpoints (BackupAndRestore) keep it."""
        return LossScale(self._scalers) if self._scalers else None

    def _state_tensors(self, with_optimizer: bool) -> tuple[dict[str, Tensor], dict[str, Any]]:
        tensors = {f"model/{k}": v.detach() for k, v in self.module.state_dict().items()}
        meta: dict[str, Any] = {"format": _FORMAT, "replicas": self.distribute_strategy.num_replicas_in_sync,
                                "model_config": getattr(self.module, "_mirrored_config", None)}
        if with_optimizer and self._mopt is not None:
            # (each replica's accumulated gradients too: they are its own)
            state = {**optimizers.replicas_state_dict(self._mopt.replicas),
                     **self._mopt.lr_schedulers_state_dict()}  # (torch LR schedulers attached in fit)
            opt_tensors, opt_meta = checkpoint.optimizer_state_to_flat(state)
            tensors.update(opt_tensors)
            meta["optimizer"] = opt_meta
            meta["compile"] = self._compile_config
            if self._scalers:  # fp16: a resumed run goes on with the scale it had, not from 65536 again
                meta["loss_scale"] = self.loss_scale.get_state()
        return tensors, meta

    def save(self, path: str | Path) -> None:
        """Weights, optimizer state and compile settings in one safetensors file, written atomically.

        Args:
          path: the file to write (a directory is refused: a checkpoint is one file). Replaced only once the
            new file is complete, so a crash leaves the old one. `Model.load(path)` rebuilds the model. For
            a Keras model, a path ending in ".keras" is a Keras archive (replica 0's model, which every
            replica equals) that keras.models.load_model reads. Under a multi-worker strategy only the
            chief writes it (TF's should_checkpoint; the workers' copies are bitwise equal); the others
            return without writing.
        """
        archive = adapters.is_archive(path)
        if archive:  # refused on every worker alike, before the chief-only gate
            self._adapter.check_archive(self.module, path, f"Model.save({str(path)!r})")
        if not self._writes_checkpoints("save", path):
            return
        if archive:
            self._adapter.save_archive(self.module, path)
            return
        tensors, meta = self._state_tensors(with_optimizer=True)
        checkpoint.save_checkpoint(path, tensors, meta)

    def save_weights(self, path: str | Path) -> None:
        """The weights alone (no optimizer state), in one safetensors file, written atomically (by the
        chief only, under a multi-worker strategy)."""
        if not self._writes_checkpoints("save_weights", path):
            return
        tensors, meta = self._state_tensors(with_optimizer=False)
        checkpoint.save_checkpoint(path, tensors, meta)

    def _writes_checkpoints(self, what: str, path: str | Path) -> bool:
        # TF's other workers write to a temporary path and delete it; nothing here is collective, so they skip.
        if self.distribute_strategy.extended.should_checkpoint:
            return True
        logger.debug("Model.%s(%s): not the chief worker, so nothing is written here", what, path)
        return False

    def load_weights(self, path: str | Path) -> None:
        """Loads the weights of a checkpoint saved on any number of replicas into every replica; every
        tensor's name, shape and dtype is checked first (CheckpointError naming the file otherwise)."""
        state = checkpoint.load_state_dict(path, where="Model.load_weights")
        origin = checkpoint_checks.Origin(f"Model.load_weights({str(path)!r})")
        self._net.load_state_dict(checkpoint_checks.state_dict(origin, state, self.module.state_dict(), prefix=""))

    def _load_optimizer(self, state: dict[str, Any] | None) -> None:
        """Loads a state checked by checkpoint_checks (None: the file has none) into every replica."""
        if state is not None and self._mopt is not None:
            own = {k: v for k, v in state.items() if k != self._mopt.LR_SCHEDULERS_KEY}
            optimizers.load_replicas_state_dict(self._mopt.replicas, own)
            self._mopt.load_lr_schedulers_state_dict(state)  # (torch LR schedulers, attached now or in fit)
            groups = self._mopt.replicas[0].param_groups
            if groups and self.optimizer is not None and self.optimizer._schedule is None:
                # The saved rate, which a callback may have changed (LearningRateScheduler, ReduceLROnPlateau),
                # is in the torch optimizer's groups; callbacks read and write it through the recipe.
                self.optimizer.learning_rate = groups[0]["lr"]

    @classmethod
    def load(cls, path: str | Path, module: nn.Module | None = None, compile: bool = True) -> Model:
        """A Model from `save()`'s file. Pass `module=` (an instance of the same architecture) unless the
        model came from `mr.models`, whose name and arguments the file records. Never unpickles.

        Args:
          path: the file `save()` wrote, saved on any number of replicas.
          module: a torch module of the saved architecture to load the weights into; None builds it from the
            file (mr.models only).
          compile: compile with the recorded optimizer, loss, metrics and precision and restore the
            optimizer state (and fp16 loss scale), so fit() continues the run; False loads the weights only.

        Returns:
          The Model, under the current strategy's scope (one replica outside any). Every tensor's name,
          shape and dtype is checked first: a file that does not fit is a CheckpointError naming it. A
          ".keras" archive (Keras 3, torch backend) is read by keras.models.load_model, uncompiled.
        """
        if adapters.is_archive(path):
            return cls(adapters.load_archive(path))
        tensors, meta = checkpoint.load_checkpoint(path, where="Model.load")
        origin = checkpoint_checks.Origin(f"Model.load({str(path)!r})")
        if meta.get("format") != _FORMAT:
            raise checkpoint.CheckpointError(f"Model.load({str(path)!r}): not a mirrored Model file (format "
                                             f"{meta.get('format')!r:.60}).")
        # Everything the file says is checked before it is used: the architecture before it is built.
        checkpoint_checks.model_metadata(origin, meta)
        if module is None:
            config = meta.get("model_config")
            if not config:
                raise checkpoint.CheckpointError(
                    f"Model.load({str(path)!r}): the file does not record how to build the module (it was not "
                    "made by mr.models). Pass module=YourNet(...) to load the weights into.")
            module = checkpoint_checks.build_module(origin, config, tensors)
        state = checkpoint_checks.state_dict(origin, tensors, module.state_dict())
        model = cls(module)
        model._net.load_state_dict(state)
        cfg = meta.get("compile")
        if compile and cfg:
            try:
                model._compile_from_config(cfg, str(path))
            except checkpoint.CheckpointError:
                raise
            except (TypeError, KeyError, ValueError) as e:  # settings from the file: damaged, or another version's
                raise checkpoint.CheckpointError(
                    f"Model.load({str(path)!r}): cannot compile with the settings the file records ({e}). Load "
                    "with compile=False and compile(...) yourself; the weights load either way.") from e
            model._load_optimizer(checkpoint_checks.model_optimizer_state(origin, tensors, meta, model))
            if model._scalers and meta.get("loss_scale") is not None:
                model.loss_scale.set_state(checkpoint_checks.loss_scale(origin, meta["loss_scale"]))
        return model

    def _compile_from_config(self, cfg: dict[str, Any], path: str) -> None:
        """compile() as save() recorded it: names, and configs rebuilt from mirrored's own classes by name."""
        loss = cfg.get("loss")
        if isinstance(loss, dict) and "object" in loss:  # training with another loss would be wrong
            raise ValueError(
                f"Model.load({path!r}): the model was compiled with the loss {loss['object']}, an object without a "
                "config (a class or function of your own), so the file cannot rebuild it. Load with compile=False "
                "and call model.compile(...) with it again; the weights load either way.")
        metrics, dropped = [], []
        for m in cfg.get("metrics", []):
            if isinstance(m, dict) and "object" in m:
                dropped.append(m["object"])
            else:
                metrics.append(metrics_lib.deserialize(m) if isinstance(m, dict) else m)
        if dropped:
            warnings.warn(f"Model.load({path!r}): the metrics {', '.join(dropped)} were objects without a config "
                          "(classes or functions of your own); the model is compiled without them. Load with "
                          "compile=False and compile(...) again to have them.", UserWarning, stacklevel=3)
        self.compile(optimizer=_optimizer_from_config(cfg["optimizer"], path),
                     loss=losses.deserialize(loss) if isinstance(loss, dict) else loss, metrics=metrics,
                     precision=cfg.get("precision"), jit_compile=cfg.get("jit_compile", False),
                     memory_format=cfg.get("memory_format", "auto"))

    def __repr__(self) -> str:
        return f"Model({self.name}, replicas={self.distribute_strategy.num_replicas_in_sync})"


def _reads_batch_logs(cbs: Any) -> bool:
    """Whether a callback has its own on_train_batch_end (or on_batch_end), which reads each step's logs.
    Without one, fit reads the metrics once per epoch, as tf.keras converts a step's logs to numbers
    only for callbacks with batch hooks."""
    base = callbacks_lib.Callback
    return any(hook in getattr(cb, "__dict__", {}) or getattr(type(cb), hook) is not getattr(base, hook)
               for cb in cbs for hook in ("on_train_batch_end", "on_batch_end"))


def _config_or_repr(given: Any, obj: Any, serialize: Any) -> Any:
    """What compile() records of a loss, metric or optimizer: a name as given, else the object's config
    (serialize), else {"object": its repr}, which load() names in its error."""
    if isinstance(given, str):
        return given
    return serialize(obj) or {"object": repr(obj)}


def _optimizer_from_config(cfg: dict[str, Any], path: str) -> optimizers.Optimizer:
    if "class_name" in cfg:
        return optimizers.deserialize(cfg)
    # A file from before optimizers had configs holds a torch.optim class's name (ours are named after
    # theirs: SGD, Adam, AdamW, RMSprop) and its torch arguments; never a pickle.
    name = cfg.get("name")
    torch_cls = getattr(torch.optim, str(name), None) if "object" not in cfg else None
    if not (isinstance(torch_cls, type) and issubclass(torch_cls, torch.optim.Optimizer)):
        raise ValueError(f"Model.load({path!r}): the model was compiled with the optimizer {cfg.get('object', name)}, "
                         "which load cannot rebuild (not one of mirrored's or torch.optim's). Load with compile=False "
                         "and compile(...) again; the weights load either way.")
    cfg = {k: v for k, v in cfg.items() if k != "name"}
    return optimizers.Optimizer(torch_cls, cfg.pop("learning_rate"), str(name), **cfg)


def _averages_weights(optimizer: Any) -> bool:
    """Whether `optimizer` keeps a moving average of the weights (use_ema), which it may write into them
    in a step that only accumulates gradients."""
    return bool(getattr(getattr(optimizer, "_options", None), "use_ema", False))


def _draws_nothing(metric: Any) -> bool:
    """A metric of mr.metrics on one of its own functions: its update draws no random numbers, so it
    runs without the replica's random mode (~1 us per torch call, ~40 calls; issue 27). A user's
    metric, or a wrapper around a user's function, keeps the mode."""
    own = metrics_lib.__name__
    return type(metric).__module__ == own and getattr(getattr(metric, "_fn", None), "__module__", own) == own


def _rows(x: Any) -> int:
    leaf = md.values.flatten(x)[0]
    return len(leaf)


def _steps_left(per_epoch: int | None, epochs_after: int, done: int) -> int | None:
    """Batches fit has left: the rest of this epoch and the epochs after it (None: unknown length)."""
    return None if per_epoch is None else max(per_epoch - done, 0) + epochs_after * per_epoch


def _prefetched(dataset: Any) -> Any:
    """fit's input with a batch made ahead on a thread while the replicas train (issue 27): an
    mr.data.Dataset without a prefetch anywhere gets .prefetch(1), which yields the same batches in the
    same order; other iterables (lists, DataLoaders with their own workers) are read as they are."""
    from mirrored.data import Dataset

    if isinstance(dataset, Dataset) and "prefetch" not in dataset.get_state()["pipeline"]:
        return dataset.prefetch(1)
    return dataset


def _check_ends(dataset: Any, steps: int | None, where: str, steps_arg: str) -> None:
    """Refuses, before anything runs, a dataset that cannot end a pass (infinite, with no `steps_arg`)
    or that has nothing in it. Keras 3 trains forever on the first and only warns on the second."""
    cardinality = getattr(dataset, "cardinality", None)
    n = int(cardinality()) if callable(cardinality) else epochs_lib.len_or_none(dataset)
    if n == INFINITE and steps is None:
        raise ValueError(f"Model.{where}: the dataset repeats forever ({dataset!r}) and {steps_arg} is not set, so "
                         f"the first pass would never end. Pass {steps_arg}=N (the batches per pass), or drop the "
                         ".repeat().")
    if n == 0:
        raise ValueError(f"Model.{where}: the dataset yields no batches ({dataset!r}). Check the source (an empty "
                         "file list or split, a filter that drops everything, a batch with drop_remainder=True "
                         "larger than the data).")


def _no_batches(where: str, dataset: Any, what: str) -> ValueError:
    return ValueError(f"Model.{where}: the dataset yielded no batches in {what} ({dataset!r}). Check the source (an "
                      "empty file list or split, a filter that drops everything, a batch with drop_remainder=True "
                      "larger than the data).")

