"""`mr.Model`: Keras's compile / fit / evaluate / predict / save around any torch.nn.Module.

Created in a strategy's scope, the module is mirrored on every replica. The step is a seam, as in
Keras 3: fit, evaluate and predict run `train_step(data)`, `test_step(data)` and `predict_step(data)`
on every replica, inside strategy.run, each on its part of a global batch; a subclass overrides
them, and the optimizer's step() inside all-reduces. The default train_step is plain code: forward,
compute_loss, backward, optimizer.step(). compute_loss gives this replica's loss of its part, as
Keras computes one device's, and the optimizer averages the replicas' gradients weighted by what
each loss averaged (its examples; the labels ignore_class kept), so N replicas give one device's
update on the global batch, an uneven last batch included (Keras on TF averages per-replica means
there; we do not, on purpose). Metrics keep sync-on-read state: each replica accumulates, a read
sums across replicas. What differs by the module's kind (a Keras 3 model) is its adapter
(adapters.py); fit's epochs and place in the data are an EpochIterator (epochs.py), which
BackupAndRestore saves and restores; the data's conversions are data_adapter.py's. Uses the public
surface of `mirrored.distribute` and `mirrored.data`.
"""
from __future__ import annotations

import contextlib
import logging
import warnings
import weakref
from collections.abc import Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn

import mirrored.distribute as md
from mirrored.training import adapters, compile_utils, jit, losses, optimizers, saving
from mirrored.training import callbacks as callbacks_lib, data_adapter, epochs as epochs_lib, metrics as metrics_lib
from mirrored.training._trackables import LossScale
from mirrored.training.data_adapter import unpack_x_y_sample_weight
from mirrored.training.layers import has_sync_batchnorm

logger = logging.getLogger(__name__)

class Model:
    """Wraps a torch.nn.Module (which returns logits) with Keras's training API, under a strategy.

    The module receives exactly what the data yields, in fit, evaluate, predict and model(x) alike:
    numpy arrays, lists of numbers and tensors are taken as given; only floating-point inputs change,
    to the module's dtype (as Keras casts to floatx), and integer labels become int64. A layout is
    never guessed from a shape: the module declares it (mr.models' data_format), or the pipeline
    makes it. The module's attributes are the Model's (model.generator for a module holding one):
    inside a step, its submodules are the replica's own copies."""

    def __init__(self, module: nn.Module, name: str | None = None):
        # What differs by the module's kind (a Keras 3 model follows Keras's conventions), decided once.
        self._adapter = adapters.adapter_for(module)
        if not isinstance(module, nn.Module):
            raise TypeError(f"mr.Model({type(module).__name__}): expected a torch.nn.Module.")
        strategy = md.get_strategy()
        if not md.has_strategy():  # outside any scope: one replica where the module already lives
            device = data_adapter.device_of(module)
            strategy = md.OneDeviceStrategy(str(device) if device.type != "cpu" else "cpu:0")
        if md.get_replica_context() is not None and md.has_strategy():
            raise RuntimeError("mr.Model(...) was created inside strategy.run; create it in `with strategy.scope():`.")
        self.name = name or type(module).__name__
        self.distribute_strategy = strategy
        with strategy.scope():  # (convolutions in channels_last memory: compile(memory_format=) changes it)
            self._net = strategy.mirror(module, memory_format="auto")
        self._sync_bn = has_sync_batchnorm(module)
        # A Keras model whose class defines its own steps or compile runs them on every replica's copy, and
        # compile() is its own, with its own arguments (a GAN's compile(d_optimizer=..., ...)).
        self._own_steps = self._adapter.own_steps(self._net)
        if self._own_steps is not None:
            self.compile = self._compile_own
        self.optimizer: optimizers.Optimizer | None = None
        self._mopt: Any = None
        self._outputs: compile_utils.CompiledOutputs | None = None  # compile's losses and metrics, per output
        self._class_weight: Mapping[int, float] | None = None  # fit's, while it trains
        self._loss_tracker: Any = None
        self._logs_view: _Logs | None = None  # what the default steps return: the metrics, read when asked
        self._loss_records: dict[int, Any] = {}  # per local replica: its last compute_loss's part of the reported loss
        self._global_rows: dict[int, int | None] = {}  # per local replica: its step's global batch, where known
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
        """The loss tracker (once compiled), the compiled metrics and, for several outputs, each output's
        loss tracker, as Keras's `model.metrics` (a multi-output model's once its first step built them)."""
        if self._own_steps is not None:  # a Keras model that compiles itself: its own metrics (replica 0's)
            return list(self.module.metrics)
        compiled = self._outputs.metric_objects() if self._outputs is not None else []
        return ([self._loss_tracker] if self._loss_tracker is not None else []) + compiled

    @property
    def _loss(self) -> losses.Loss | None:
        """The compiled loss of a model with one output."""
        return self._outputs.single_loss if self._outputs is not None else None

    @property
    def _metrics(self) -> list[Any]:
        """The compiled metrics (and weighted metrics), without the loss trackers."""
        if self._outputs is None:
            return []
        return [m for output in self._outputs.metric_sets for m in output.metrics]

    def __getattr__(self, name: str) -> Any:
        # The module's attributes, as a Keras model's layers are its attributes: through the mirror, so
        # that a submodule called in a step is the replica's own copy (and its step journal notes it).
        if name.startswith("_") or "_net" not in self.__dict__:
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
        try:
            return getattr(self.__dict__["_net"], name)
        except AttributeError:
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}, and its module "
                                 f"{type(self.module).__name__} has none either") from None

    def __call__(self, x: Any, *args: Any, training: bool | None = None, **kwargs: Any) -> Any:
        """The module on `x`, fed as fit, evaluate and predict feed it: arrays and lists become tensors on
        its device, floating-point inputs take its dtype, nothing else changes. Outside strategy.run it
        runs in inference mode unless training=True, so model(x) equals predict(x); inside it, it is the
        replica's own copy, in the mode `training` says (train_step passes True), or the module's
        mode where None."""
        net = self._net
        own = net.module  # (the calling replica's copy inside strategy.run)
        device = data_adapter.device_of(own)
        if not isinstance(x, Tensor) or x.device != device:
            x = data_adapter.as_input(data_adapter.as_array(x, "__call__", "x"), device)
            x = md.map_structure(lambda v: data_adapter.as_input(v, device), x)  # a dict or tuple of inputs
        ctx = md.get_replica_context()
        in_step = ctx is not None and ctx.strategy is self.distribute_strategy
        if training is None:
            training = own.training if in_step else False
        copies = [own] if in_step else net.values
        if all(m.training == training for m in copies):
            return self._forward(net, x, *args, training=training, **kwargs)
        modes = [{m: m.training for m in copy_.modules()} for copy_ in copies]
        for copy_ in copies:
            copy_.train(training)
        try:
            return self._forward(net, x, *args, training=training, **kwargs)
        finally:
            for saved in modes:
                for m, mode in saved.items():
                    m.training = mode

    def summary(self, print_fn: Any = print) -> None:
        """Prints the top-level layers with their parameter counts, and the totals (a Keras model's
        own summary for a Keras model)."""
        title = f'Model: "{self.name}" on {self.distribute_strategy.num_replicas_in_sync} replica(s)'
        self._adapter.summary(self.module, title, print_fn)

    # ---- compile -----------------------------------------------------------------------------------
    def compile(self, optimizer: Any = "rmsprop", loss: Any = None, loss_weights: Any = None,
                metrics: Any = None, weighted_metrics: Any = None, run_eagerly: bool = False,
                steps_per_execution: int = 1, jit_compile: bool | str = "auto", auto_scale_loss: bool = True,
                precision: str | None = None, memory_format: str = "auto") -> None:
        """Chooses the optimizer, loss and metrics (Keras 3's arguments, in Keras's order, then ours).
        Strings mean Keras names; losses take logits.

        Args:
          optimizer: a Keras name ("sgd", "adam", "adamw", "rmsprop", "adagrad", "adamax", "nadam",
            "adadelta", "adafactor", "lion", "ftrl", "lamb"), an mr.optimizers.Optimizer, its serialize()
            config, or a torch.optim class or instance (its class and defaults are reused: every replica
            gets its own). `model.optimizer` is it; a step calls its step().
          loss: a name ("sparse_categorical_crossentropy", "mse", ...; crossentropies take logits), an
            mr.losses.Loss, a torch.nn loss module, or fn(y_true, y_pred) -> per-example losses. For a
            module returning a dict, list or tuple of outputs: a dict keyed by output (or a list, by
            position) of those, None for an output without a loss; one loss applies to every output.
            The default train_step needs one; a train_step of your own may compute its loss itself.
          loss_weights: a number (it multiplies the loss), or a dict / list with one per output: the
            loss minimised is the weighted sum of the outputs' losses (the logs' `<output>_loss` are
            unweighted, as Keras's).
          metrics: names ("accuracy" follows the loss, as in Keras), mr.metrics.Metric objects, or
            functions fn(y_true, y_pred) -> one value per example; for several outputs a dict keyed by
            output (or a list with an entry per output) of such lists. They ignore sample weights, as
            Keras 3's do; a several-output model logs them as `<output>_<name>`.
          weighted_metrics: metrics as above that the sample weights (or class weights) weigh.
          run_eagerly: True runs every step eagerly (jit_compile is then off), as Keras; the default
            steps run eagerly anyway unless jit_compile compiles them.
          steps_per_execution: batches each strategy.run call trains on, one update each: fewer hand-offs
            to the replica threads, the same updates.
          jit_compile: True compiles each replica's forward and backward with torch.compile (training/jit.py:
            what is compiled, the tolerance against eager, the fallback); False runs eager; "auto" (Keras
            3's default) starts eager and compiles after fit's first steps where the steps left pay back
            the compile time (logged at INFO).
          auto_scale_loss: with precision="fp16", scale the loss (a GradScaler per replica), as Keras wraps
            the optimizer in a LossScaleOptimizer under "mixed_float16"; False trains fp16 unscaled.
          precision: None or "fp32"; "bf16" (autocast, CPU or CUDA); "fp16" (autocast with a loss scale per
            replica, CUDA only). Ours: Keras sets this by a dtype policy.
          memory_format: where the module's 2-D / 3-D convolution weights live in memory (ours; Keras has no
            such knob): "auto" channels_last(_3d) for float32/16 weights on CPU and CUDA, whose kernels are
            fastest so (1.4-1.6x on a CPU); "channels_last" always; "preserve" the module's own format, as
            given. Results equal the NCHW path's up to float reassociation; checkpoints hold the standard
            layout either way. `model.memory_format` says which ran.
        """
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
        if run_eagerly:  # as Keras: eager steps, nothing compiled
            jit_compile = False
        use_jit = jit.resolve(jit_compile)
        if use_jit:
            self._adapter.refuse_jit()
        strategy = self.distribute_strategy
        # Before the optimizer is built: its gradient buckets follow the weights' layout.
        self._net.set_memory_format(memory_format)
        with strategy.scope():
            # One output's losses and metrics are made here; those of several, at the first step.
            self._outputs = compile_utils.CompiledOutputs(self._adapter, loss, loss_weights, metrics, weighted_metrics,
                                                           self._adapter.output_names(self.module))
            self._loss_tracker = metrics_lib.Mean(name="loss")
        self._precision = None if precision == "fp32" else precision
        self._scalers = ([torch.amp.GradScaler("cuda") for _ in devices] if precision == "fp16" and auto_scale_loss
                         else [])
        self._mopt = self._bind(recipe, self._net)
        self.optimizer = recipe
        self._logs_view = _Logs(self)
        self._steps_per_execution = steps_per_execution
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
            "loss": compile_utils.config_of(
                loss, lambda given: _config_or_repr(given, self._adapter.loss(given), losses.serialize)),
            "loss_weights": loss_weights,
            "metrics": compile_utils.config_of(metrics or [], _metric_config),
            "weighted_metrics": compile_utils.config_of(weighted_metrics, _metric_config),
            "precision": precision, "jit_compile": use_jit, "memory_format": memory_format,
            "auto_scale_loss": auto_scale_loss}
        self._compiled = True

    def _compile_own(self, *args: Any, **kwargs: Any) -> None:
        """compile() of a Keras model whose class defines its own steps or compile: the model's own
        compile(*args, **kwargs) on every replica's copy; its compiled optimizer, losses and metrics are
        what its steps use, and its metrics are the Model's."""
        self.optimizer = self._own_steps.compile(*args, **kwargs)
        self._outputs = self._loss_tracker = self._mopt = self._logs_view = self._precision = None
        self._jit = self._auto_jit = None
        self._scalers, self._steps_per_execution = [], 1
        # (Model.load cannot call it: it refuses compile=True naming it, and loads the weights with compile=False)
        self._compile_config = {"optimizer": {"object": f"{type(self.module).__name__}.compile(...)"}}
        self._compiled = True

    def build_optimizer(self, optimizer: Any, module: Any = None) -> optimizers.Optimizer:
        """An optimizer for `module` (a part of this model, such as a GAN's self.discriminator; the whole
        module by default) on every replica, made as compile() makes its own: a name, an
        mr.optimizers object or a torch.optim class or instance. Its step() inside a step all-reduces
        that part's gradients, averaged over the replicas by their examples. For models with several
        optimizers: call it in an overridden compile() and keep what it returns.

        Returns:
          The optimizer recipe (learning_rate, iterations, step(), zero_grad(), apply()), bound to this
          model's replicas.
        """
        part = self._net if module is None else module
        if not isinstance(part, md.MirroredModule) or part.distribute_strategy is not self.distribute_strategy:
            raise TypeError(f"Model.build_optimizer(module={type(module).__name__}): pass a part of this model as "
                            "the model gives it (self.discriminator, an attribute of the module it wraps), so that "
                            "every replica's optimizer gets that replica's copy of it.")
        recipe = self._adapter.optimizer(optimizer, part.replicas)
        self._bind(recipe, part)
        return recipe

    def _bind(self, recipe: optimizers.Optimizer, part: Any) -> Any:
        """The mirrored optimizer of `recipe` over `part`, with the model's rule for its gradients: the
        replicas' average weighted by their examples (or what compute_loss says each loss averaged),
        reduced in step(); `recipe.step()` and the others then act on it."""
        with self.distribute_strategy.scope():
            mopt = self.distribute_strategy.mirror_optimizer(lambda params: recipe.build(params), part,
                                                             gradient_reduction="mean", reduce_in_backward=False)
        recipe._steps = _OptimizerSteps(mopt, self)
        return mopt

    def _require_compiled(self, what: str) -> None:
        if not self._compiled:
            raise RuntimeError(f"Model.{what}() needs compile() first: model.compile(optimizer=..., loss=...).")

    def _autocast(self, device: torch.device) -> Any:
        if self._precision is None:
            return contextlib.nullcontext()
        dtype = torch.bfloat16 if self._precision == "bf16" else torch.float16
        return torch.autocast(device_type=device.type, dtype=dtype)

    def _forward(self, net: Any, x: Any, *args: Any, training: bool = False, **kwargs: Any) -> Any:
        """The module on what the data yields, in fit, evaluate, predict and model(x) alike: only
        floating-point inputs change, to the module's dtype. A Keras model also gets `training`, as
        Keras's trainer passes it (True in fit's train steps only)."""
        dtype = data_adapter.module_dtype(net)
        with self._autocast(data_adapter.device_of(net)):
            try:
                out = self._adapter.call(net, data_adapter.cast_inputs(x, dtype), training, *args, **kwargs)
            except RuntimeError as e:
                if "view size is not compatible" not in str(e) or self.memory_format == "as given":
                    raise
                raise RuntimeError(
                    f"{e}\nThe module's convolutions run in {self.memory_format} memory (compile(memory_format="
                    "\"auto\")), and a .view() after one needs row-major memory: use .reshape() or "
                    "torch.flatten() there, or compile(..., memory_format=\"preserve\").") from e
        return out.float() if isinstance(out, Tensor) and out.dtype in (torch.bfloat16, torch.float16) else out

    # ---- the steps: run on every replica (inside strategy.run) -------------------------------------
    def train_step(self, data: Any) -> Any:
        """One training step on this replica's part of a global batch, as Keras 3's: the forward pass,
        compute_loss, backward, and the optimizer's step, which all-reduces the gradients with every
        other replica's and applies the same update. fit runs it on every replica; override it to
        change what a step does (the optimizer's step() must be called on every replica, as any
        collective). Returns the logs: compute_metrics's, or a dict of values (replica 0's are
        reported, as tf.keras reports the first replica's)."""
        if self._own_steps is not None:  # a Keras model's own train_step, on this replica's copy
            return self._own_steps.step("train", data)
        x, y, sample_weight = unpack_x_y_sample_weight(data)
        if not data_adapter.rows(x) and not self._sync_bn:
            # An empty part (a short last batch): nothing to learn from, but every replica's update meets.
            self._empty_part(x, y, training=True)
            self.optimizer.step()
            self.optimizer.zero_grad()
            return self.get_metrics_result()
        y_pred = self(x, training=True)
        loss = self.compute_loss(x, y, y_pred, sample_weight, training=True)
        self._track_loss(loss, x)
        logs = self.compute_metrics(x, y, y_pred, sample_weight)
        self.optimizer.scale_loss(loss).backward()
        self.optimizer.step()
        # (cleared after the update rather than before the forward, as Keras's does: nothing holds the
        # gradients between steps, and fit clears any a loop of your own left before its first step)
        self.optimizer.zero_grad()
        return logs

    def test_step(self, data: Any) -> Any:
        """One evaluation step on this replica's part: the forward pass in inference mode, the loss and
        the metrics (Keras 3's test_step). evaluate and fit's validation run it on every replica."""
        if self._own_steps is not None:
            return self._own_steps.step("test", data)
        x, y, sample_weight = unpack_x_y_sample_weight(data)
        if not data_adapter.rows(x):
            self._empty_part(x, y, training=False)
            return self.get_metrics_result()
        y_pred = self(x, training=False)
        if (self._outputs is not None and self._outputs.loss is not None) \
                or self._adapter.module_loss(y_pred) is not None:
            self._track_loss(self.compute_loss(x, y, y_pred, sample_weight, training=False), x)
        return self.compute_metrics(x, y, y_pred, sample_weight)

    def predict_step(self, data: Any) -> Any:
        """The outputs on this replica's part (Keras 3's predict_step; a Hugging Face output's logits);
        predict concatenates every replica's in the order of the input rows."""
        if self._own_steps is not None:
            return self._own_steps.step("predict", data)
        x, _, _ = unpack_x_y_sample_weight(data)
        return self._adapter.prediction(self(x, training=False))

    def compute_loss(self, x: Any = None, y: Any = None, y_pred: Any = None, sample_weight: Any = None,
                     training: bool = True) -> Tensor:
        """This replica's loss on its part of the batch, as Keras computes one device's: the compiled loss
        reduced over the part (sample_weight as Keras weighs it), plus the module's regularization; for
        several outputs, each output's loss reduced so, weighted by loss_weights and summed (and each
        output's unweighted loss tracked, as Keras's `<output>_loss`). With training=True it also tells
        the model's optimizer how the part's gradients weigh in the average over the replicas - by the
        loss values it averaged: its examples, or the labels kept with ignore_class - so the update is
        one device's on the global batch."""
        compiled = self._outputs
        if compiled is None or compiled.loss is None:
            own = self._adapter.module_loss(y_pred)
            if own is None:
                raise ValueError("Model.compute_loss: no loss to compute. Provide a `loss` argument in `compile()`, "
                                 "return one from the module (an output mapping with a \"loss\", as a Hugging Face "
                                 "model given labels), or compute the loss yourself in an overridden train_step.")
            # The module's own loss, a mean over its part: its share of the global batch's by its rows.
            ctx = md.get_replica_context()
            rid = 0 if ctx is None else ctx.local_replica_id
            rows = data_adapter.rows(x)
            self._loss_records[rid] = (own.detach().double() * rows, rows)
            return self._as_share(own, rows, rid, training)
        if y is None:
            y = self._adapter.labels(x)
        if y is None:
            raise ValueError(f"Model.compute_loss: the batch has no labels for the loss {_describe(compiled.loss)}: "
                             "the data yields inputs only. Give (x, y) batches (or y= with arrays), labels inside a "
                             "dict of inputs under \"labels\", or compile without a loss for a module that computes "
                             "its own.")
        y_pred = self._built_for(y, y_pred)
        if not compiled.single:
            return self._outputs_loss(x, y, y_pred, sample_weight, training)
        out = compiled.losses[0]
        dtype = data_adapter.module_dtype(self._net)
        # Labels and weights as Keras's data adapters make them: float ones in the module's dtype (floatx).
        y = data_adapter.cast_inputs(data_adapter.as_labels(y), dtype)
        per_example = out.loss.per_example(y, y_pred)
        sw = data_adapter.weights_like(data_adapter.cast_inputs(sample_weight, dtype), per_example)
        if sw is not None:
            per_example = per_example * sw
        if out.weight is not None:
            per_example = per_example * out.weight
        penalty = self._adapter.regularization(self._net)
        ctx = md.get_replica_context()
        rid = 0 if ctx is None else ctx.local_replica_id
        rows = per_example.shape[0] if per_example.dim() else 1
        ignore = getattr(out.loss, "ignore_class", None)
        total = per_example.sum()
        rows_all = self._global_rows.get(rid)
        if out.loss.reduction != "sum" and ignore is None and rows_all:
            # A mean over every loss value of the part (rows times the values per row: a sequence's steps).
            # Its gradient is the replica's share of one device's loss on the global batch - its sums over
            # the global count, and its rows' part of the penalty - so the replicas' gradients add up to
            # one device's, through the statistics a SyncBatchNorm shares too; the value is its own part's.
            values = per_example.numel() // rows if rows else 1
            share = total / (rows_all * values) + penalty * (rows / rows_all)
            loss = total / max(per_example.numel(), 1) + penalty
            self._loss_records[rid] = (loss.detach().double() * rows, rows)
            if training and self._mopt is not None:
                self._mopt.set_gradient_weight(1, divide=False)
            return share + (loss - share).detach()
        if out.loss.reduction == "sum" or ignore is not None:
            # Keras reports each step's loss weighted by its batch size, and these losses are no mean over
            # examples: the reported one needs the global batch's rows (and labels kept) - one meeting,
            # which an empty part joins too (_empty_part).
            kept = out.loss.kept(y) if ignore is not None else None
            kept_all, rows_all = self._global_counts(ctx, kept, rows)
            if out.loss.reduction == "sum":
                # The replicas' sums add up to one device's, so they are summed, not averaged; the penalty is
                # shared by rows.
                loss = total + penalty * (rows / rows_all).to(total.dtype)
                record = (loss.detach().double() * rows_all, rows)
                if training and self._mopt is not None:
                    self._mopt.set_gradient_weight(1, divide=False)
            else:  # a mean over the labels kept: the share of one device's mean over all the labels kept
                local = total / kept.clamp(min=1) + penalty
                share = total / kept_all.clamp(min=1).to(total.dtype) + penalty * (rows / rows_all).to(total.dtype)
                loss = share + (local - share).detach()
                record = (share.detach().double() * rows_all, rows)
                if training and self._mopt is not None:
                    self._mopt.set_gradient_weight(1, divide=False)
        else:
            # A mean over every loss value of the part: rows times the values per row (a sequence's steps).
            # The optimizer weighs the part by its rows, which is the same ratio.
            loss = total / max(per_example.numel(), 1) + penalty
            record = (loss.detach().double() * rows, rows)
        self._loss_records[rid] = record
        return loss

    def _outputs_loss(self, x: Any, y: Any, y_pred: Any, sample_weight: Any, training: bool) -> Tensor:
        """compute_loss for several outputs: sum of loss_weight * the output's loss, each reduced as Keras
        reduces it on one device, plus the regularization. Where every loss is a mean over its values (the
        default) the replicas' gradients weigh by rows, as one loss's do. Otherwise (a sum, ignore_class) the
        outputs' means divide by different counts, which no one weight per replica can give: each replica
        then takes its share of one device's loss (its sums over the global counts, one meeting), whose
        gradients add up to one device's, and the returned value is still its own part's loss."""
        compiled = self._outputs
        dtype = data_adapter.module_dtype(self._net)
        ctx = md.get_replica_context()
        rid = 0 if ctx is None else ctx.local_replica_id
        rows = data_adapter.rows(x) if x is not None else data_adapter.rows(y_pred)
        terms = []
        for out in compiled.losses:
            y_t = data_adapter.cast_inputs(data_adapter.as_labels(compiled.part_of(y, out.path, "a loss")), dtype)
            per_example = out.loss.per_example(y_t, compile_utils.select(y_pred, out.path))
            sw = data_adapter.cast_inputs(compile_utils.sample_weight_of(sample_weight, out.path, compiled), dtype)
            sw = data_adapter.weights_like(sw, per_example)
            if sw is not None:
                per_example = per_example * sw
            terms.append((out, y_t, per_example))
        penalty = self._adapter.regularization(self._net)

        def weighed(out: compile_utils.OutputLoss, value: Tensor) -> Tensor:
            return value if out.weight is None else value * out.weight

        if not compile_utils.shares_needed(compiled):
            values = [pe.sum() / max(pe.numel(), 1) for _, _, pe in terms]
            loss = sum(weighed(out, v) for (out, _, _), v in zip(terms, values)) + penalty
            self._loss_records[rid] = (loss.detach().double() * rows, rows)
            for (out, _, _), v in zip(terms, values):
                self._track_output_loss(out, v.detach().double() * rows, rows)
            return self._as_share(loss, rows, rid, training)
        local = [out.loss.kept(y_t) if getattr(out.loss, "ignore_class", None) is not None else pe.numel()
                 for out, y_t, pe in terms]
        counts, rows_all = self._global_sums(ctx, local, rows)
        shares, values = [], []
        for (out, _, pe), c, c_all in zip(terms, local, counts):
            total = pe.sum()
            if out.loss.reduction == "sum":
                shares.append(total)
                values.append(total)
            else:
                shares.append(total / c_all.clamp(min=1).to(total.device, total.dtype))
                values.append(total / torch.as_tensor(c, device=total.device).clamp(min=1).to(total.dtype))
        share = sum(weighed(out, v) for (out, _, _), v in zip(terms, shares)) \
            + penalty * (rows / rows_all).to(shares[0].dtype)
        value = sum(weighed(out, v) for (out, _, _), v in zip(terms, values)) + penalty
        if training and self._mopt is not None:
            self._mopt.set_gradient_weight(1, divide=False)  # (the shares' gradients add up to one device's)
        self._loss_records[rid] = (share.detach().double() * rows_all, rows)
        for (out, _, _), v in zip(terms, shares):
            self._track_output_loss(out, v.detach().double() * rows_all, rows)
        return share + (value - share).detach()

    @staticmethod
    def _track_output_loss(out: compile_utils.OutputLoss, total: Tensor, rows: int) -> None:
        """An output's loss tracker (several outputs): its unweighted loss, weighted by the batch's rows."""
        if out.tracker is not None:
            out.tracker.total.assign_add(total)
            out.tracker.count.assign_add(rows)

    def compute_metrics(self, x: Any, y: Any, y_pred: Any, sample_weight: Any = None) -> Mapping[str, Any]:
        """Updates the compiled metrics with this replica's part (each output's with its labels; only the
        weighted_metrics with the sample weights, as Keras 3) and returns the logs (get_metrics_result)."""
        compiled = self._outputs
        if y_pred is not None and compiled is not None:
            if y is None:
                y = self._adapter.labels(x)
            y_pred = self._built_for(y, y_pred)
            for output in compiled.metric_sets:
                if not output.metrics:
                    continue
                y_p = compile_utils.select(y_pred, output.path).detach()
                y_t = data_adapter.cast_inputs(data_adapter.as_labels(compiled.part_of(y, output.path, "metrics")),
                                               y_p.dtype if y_p.is_floating_point() else None)
                sw = compile_utils.sample_weight_of(sample_weight, output.path, compiled) if output.weighted else None
                while isinstance(sw, Tensor) and sw.dim() > 1 and sw.shape[-1] == 1:
                    sw = sw.squeeze(-1)
                for m in output.metrics:
                    m.update_state(y_t, y_p, sw)
        return self.get_metrics_result()

    def get_metrics_result(self) -> Mapping[str, Any]:
        """Every metric's result by name (Keras's), each read across the replicas when it is asked for:
        fit reads them after the step, in cross-replica context."""
        return self._logs_view if self._logs_view is not None else {}

    def zero_grad(self) -> None:
        """Clears the gradients of the replica's copy (every copy's outside strategy.run), as Keras's
        train_step does first."""
        self._net.zero_grad(set_to_none=True)

    def _built_for(self, y: Any, y_pred: Any) -> Any:
        """The outputs as the compiled losses and metrics read them, once those are built against them: a
        module's first step with several outputs (or metrics whose state the data sizes) builds them, in
        one merge_call that every replica joins, an empty part's too (_empty_part)."""
        compiled = self._outputs
        view = self._adapter.prediction(y_pred) if compiled.single and not compile_utils.is_nested(y) else y_pred
        if compiled.needs_build(y):
            self._build_compiled(y, view)
        return view

    def _build_compiled(self, y: Any, y_pred: Any) -> None:
        compiled = self._outputs
        seen = _Seen(y, y_pred)
        ctx = md.get_replica_context()

        def build(strategy: Any, seen: Any) -> None:
            parts = strategy.experimental_local_results(seen) if isinstance(seen, md.PerReplica) else (seen,)
            first = next((p for p in parts if p.y_pred is not None), None)
            if first is not None and compiled.needs_build(first.y):
                compiled.build(first.y, first.y_pred)

        if ctx is None or ctx.strategy is not self.distribute_strategy:
            with self.distribute_strategy.scope():
                build(self.distribute_strategy, seen)
        else:
            ctx.merge_call(build, args=(seen,))

    def _as_share(self, loss: Tensor, rows: int, rid: int, training: bool) -> Tensor:
        """`loss`, a mean over this replica's part, with the gradient of its share of the global batch's
        loss (its rows' part) where the global batch is known: the replicas' gradients then add up to one
        device's, through what they share in the step (a SyncBatchNorm's statistics) too. Elsewhere the
        optimizer weighs the part by its examples."""
        rows_all = self._global_rows.get(rid)
        if not rows_all:
            return loss
        if training and self._mopt is not None:
            self._mopt.set_gradient_weight(1, divide=False)
        share = loss * (rows / rows_all)
        return share + (loss - share).detach()

    def _empty_part(self, x: Any, y: Any, training: bool) -> None:
        """An empty part of a short last batch: it joins the first step's build of the compiled losses and
        metrics, the count of the global batch that a loss with reduction="sum" or ignore_class makes, and
        in training weighs nothing in the replicas' average."""
        compiled = self._outputs
        ctx = md.get_replica_context()
        # (as the replicas with examples weigh theirs: shares summed where the global batch is known)
        sums = bool(self._global_rows.get(0 if ctx is None else ctx.local_replica_id))
        if compiled is not None:
            labels = y if y is not None else self._adapter.labels(x)
            if compiled.needs_build(labels):
                self._build_compiled(labels, None)
            loss = compiled.single_loss
            if compiled.single and loss is not None and (
                    loss.reduction == "sum" or getattr(loss, "ignore_class", None) is not None):
                self._global_counts(ctx, torch.zeros((), dtype=torch.int64), 0)
                sums = True
            elif not compiled.single and compile_utils.shares_needed(compiled):
                self._global_sums(ctx, [torch.zeros((), dtype=torch.int64) for _ in compiled.losses], 0)
                sums = True
        if training and self._mopt is not None:
            self._mopt.set_gradient_weight(0, divide=not sums)

    @staticmethod
    def _global_counts(ctx: Any, kept: Tensor | None, rows: int) -> tuple[Tensor, Tensor]:
        """The labels kept and the rows of the global batch, as float64 tensors (one meeting of every
        replica; nothing is read on the host)."""
        (kept_all,), rows_all = Model._global_sums(ctx, [kept if kept is not None else rows], rows)
        return kept_all, rows_all

    @staticmethod
    def _global_sums(ctx: Any, counts: Sequence[Tensor | int], rows: int) -> tuple[list[Tensor], Tensor]:
        """`counts` (numbers or one-element tensors) and the rows, summed over the replicas, as float64
        tensors: one meeting of every replica; nothing is read on the host."""
        device = next((c.device for c in counts if isinstance(c, Tensor)), None)
        local = torch.zeros(len(counts) + 1, dtype=torch.float64, device=device)
        for i, c in enumerate(counts):
            local[i] = c
        local[-1] = float(rows)
        if ctx is not None and ctx.num_replicas_in_sync > 1:
            local = ctx.all_reduce(md.ReduceOp.SUM, local)
        return list(local[:-1]), local[-1]

    def _track_loss(self, loss: Tensor, x: Any) -> None:
        """The reported loss is Keras's: each step's loss (regularization included) weighted by its batch
        size. This replica adds what compute_loss worked out as its part of that (so the sum over the
        replicas is one device's), or, for a compute_loss of your own, its loss weighted by its rows."""
        ctx = md.get_replica_context()
        record = self._loss_records.pop(0 if ctx is None else ctx.local_replica_id, None)
        if record is None:
            rows = data_adapter.rows(x)
            record = (loss.detach().double() * rows, rows)
        self._loss_tracker.total.assign_add(record[0])  # (no device sync: the values stay tensors)
        self._loss_tracker.count.assign_add(record[1])

    # ---- fit / evaluate / predict: the loops, on the caller's thread ----------------------------------
    def _train_function(self, batches: list[Any], rows: list[int | None] | None = None) -> Any:
        """What fit runs on every replica for one strategy.run: train_step on each batch of the group
        (steps_per_execution, each of `rows` examples in all), returning the last one's logs. A step of
        the group that updated the weights is kept whole - what it wrote after its update too (metrics
        a train_step of your own updates after optimizer.step()) - if a later one fails."""
        logs = None
        journal = md.current_journal() if len(batches) > 1 else None
        for i, data in enumerate(batches):
            updates = journal.updates if journal is not None else 0
            if self._class_weight is not None:  # (Keras's data adapter makes them: train_step sees them in data)
                data = data_adapter.with_class_weight(data, self._class_weight)
            with self._global_batch(rows[i] if rows is not None else None):
                logs = self.train_step(data)
            if journal is not None and journal.updates > updates:
                journal.commit()
        return logs

    @torch.no_grad()
    def _test_function(self, batches: list[Any], rows: list[int | None] | None = None) -> Any:
        """What evaluate runs on every replica: test_step on each batch of the group, without autograd
        (as Keras's test function)."""
        logs = None
        for i, data in enumerate(batches):
            with self._global_batch(rows[i] if rows is not None else None):
                logs = self.test_step(data)
        return logs

    @contextlib.contextmanager
    def _global_batch(self, rows: int | None) -> Any:
        """While a step runs, the examples of its whole global batch (every replica's part, every
        worker's), for compute_loss: the calling replica's, where fit knows it."""
        ctx = md.get_replica_context()
        rid = 0 if ctx is None else ctx.local_replica_id
        self._global_rows[rid] = rows
        try:
            yield
        finally:
            self._global_rows[rid] = None

    @torch.no_grad()
    def _predict_function(self, data: Any) -> Any:
        """predict_step on this replica's part; for an empty part (a short last batch), no rows of the
        shape and dtype of the others' rows, so that the parts concatenate (across workers too). Only
        when no output was seen yet (a single batch smaller than the replica count) does the model run
        on zero rows to learn that shape."""
        x, _, _ = unpack_x_y_sample_weight(data)
        if data_adapter.rows(x) or self._predict_like is None:
            return self.predict_step(data)
        device = data_adapter.device_of(self._net.module)
        return md.map_structure(lambda t: torch.empty(t.shape, dtype=t.dtype, device=device), self._predict_like)

    def _run_options(self, group: int) -> md.RunOptions:
        """How fit's strategy.run calls may run. A step of this class's own train_step notes everything it
        changes before its update in the step journal, so the strategy may roll it back and run it again
        up to the update (rerunnable); a train_step of your own, a group of several batches (which
        updates between them) and moving averages written into the weights by a step that only
        accumulates gradients (use_ema with gradient accumulation: no meeting before that write) are not."""
        own = type(self).train_step is Model.train_step and self._own_steps is None
        optimizer = getattr(self._mopt, "optimizer", None)
        ema_without_meeting = _averages_weights(optimizer) and getattr(
            getattr(optimizer, "_options", None), "accumulation_steps", 1) > 1
        return md.RunOptions(rerunnable=own and group == 1 and not ema_without_meeting)

    def fit(self, x: Any = None, y: Any = None, batch_size: int | None = None, epochs: int = 1,
            verbose: Any = "auto", callbacks: Sequence[Any] | None = None, validation_split: float = 0.0,
            validation_data: Any = None, shuffle: bool = True, class_weight: Mapping[int, float] | None = None,
            sample_weight: Any = None, initial_epoch: int = 0, steps_per_epoch: int | None = None,
            validation_steps: int | None = None, validation_batch_size: int | None = None,
            validation_freq: int | Sequence[int] = 1) -> Any:
        """Trains for `epochs` epochs over a dataset of GLOBAL batches (or arrays with batch_size): each
        batch split over the replicas, train_step run on every one. Keras 3's arguments, in its order.

        Args:
          x: an mr.data.Dataset (or any iterable) of GLOBAL batches, each (x, y) or (x, y, sample_weight);
            or the inputs as a numpy array or tensor (or a dict of them), with `y` and `batch_size`.
          y: the labels, for array `x` only (a dataset yields its own): an array, or for a module with
            several outputs a dict keyed by output (or a tuple, by position) of arrays.
          batch_size: the GLOBAL batch size, for array `x` only; default 32 per replica.
          epochs: the epoch to stop before, counted from 0 (Keras's rule): with initial_epoch=2, epochs=5
            trains epochs 2, 3 and 4.
          verbose: "auto" or 1 a progress bar (whole lines when not a terminal), 2 one line per epoch, 0
            silent.
          callbacks: Callback objects; a History (returned) and, unless verbose=0, a ProgbarLogger are added.
          validation_split: a fraction in (0, 1) of array data to validate on instead of training: the last
            rows of x, y and sample_weight, taken before any shuffling (Keras's rule). Not for a dataset,
            which would have to be read to be split; validation_data, where given, takes precedence.
          validation_data: a dataset of GLOBAL batches, or a tuple (x, y) or (x, y, sample_weight) of arrays
            (batched by `validation_batch_size`, else `batch_size`), evaluated at the end of the epochs
            `validation_freq` selects; its results enter the logs with the val_ prefix.
          shuffle: for array `x`, draw the examples in a new order every epoch (a dataset shuffles itself).
          class_weight: {class id: weight}: each training example's loss (and weighted_metrics) is weighed
            by its label's weight (1 for a class not listed), as Keras turns it into sample weights (one-hot
            labels by their argmax). Single-output models only; not together with sample weights.
          sample_weight: per-example weights of the loss and weighted_metrics, for array `x` only (for
            several outputs: one array for all, or a dict / tuple with one per output).
          initial_epoch: the epoch to start at, to resume a run.
          steps_per_epoch: batches per epoch; then each epoch goes on from where the last one stopped (for
            ds.repeat()). None: one full pass per epoch.
          validation_steps: batches of validation_data per evaluation; None: all of it.
          validation_batch_size: the GLOBAL batch size of array validation data (or of the split); default
            `batch_size`. A dataset is batched already.
          validation_freq: validate every that many epochs (an int), or after the listed 1-based epochs.

        Returns:
          The History callback, whose `.history` maps each log key (loss, metrics, val_ ones) to its
          per-epoch values.
        """
        self._require_compiled("fit")
        data_adapter.check_validation_freq(validation_freq)
        self._check_class_weight(class_weight, y, sample_weight, "fit")
        replicas = self.distribute_strategy.num_replicas_in_sync
        if validation_split and validation_data is None:
            (x, y, sample_weight), validation_data = data_adapter.train_validation_split(
                x, y, sample_weight, validation_split)
        elif validation_split:  # (validation_data takes precedence, as in Keras)
            data_adapter.check_validation_split(validation_split)
        dataset = data_adapter.as_dataset(x, y, batch_size, sample_weight, shuffle, "fit", replicas)
        val = self._validation_dataset(validation_data, validation_batch_size or batch_size, validation_batch_size)
        strategy = self.distribute_strategy
        # Keras: with steps_per_epoch, each epoch continues the previous one's iterator (so ds.repeat()
        # with steps_per_epoch sees all the data); without it, every epoch is a fresh full pass.
        data_adapter.check_ends(dataset, steps_per_epoch, "fit", "steps_per_epoch")
        if val is not None:
            data_adapter.check_ends(val, validation_steps, "fit(validation_data)", "validation_steps")
        source = data_adapter.prefetched(dataset)
        epoch_iterator = epochs_lib.EpochIterator(
            strategy.experimental_distribute_dataset(source, self._input_options()), steps_per_epoch=steps_per_epoch,
            steps_per_execution=self._steps_per_execution, initial_epoch=initial_epoch,
            learning_rate=self._settable_learning_rate, max_learning_rate=self._max_learning_rate())
        verbose = 1 if verbose == "auto" else verbose
        cbs = callbacks_lib.CallbackList(callbacks, add_history=True, add_progbar=verbose != 0, model=self,
                                         verbose=verbose, epochs=epochs, steps=epoch_iterator.num_batches)
        self.stop_training = False
        self._epoch_iterator = epoch_iterator
        self._class_weight = class_weight
        try:
            cbs.on_train_begin()  # BackupAndRestore may move the iterator to where a run stopped
            optimizers.warn_if_instance_changed(self.optimizer, stacklevel=2)
            if epoch_iterator.resume_learning_rate is not None:
                self.optimizer.learning_rate = epoch_iterator.resume_learning_rate
            self._net.train()
            self._net.zero_grad()
            epoch_logs = self._fit_epochs(epoch_iterator, epochs, cbs, dataset, val, validation_steps,
                                          validation_freq)
            if self.optimizer.use_ema and epochs > 0:  # as Keras, before on_train_end
                for opt in self._mopt.replicas:
                    opt.finalize_variable_values()
            cbs.on_train_end(epoch_logs)
        finally:
            self._epoch_iterator = None
            self._class_weight = None
        return self.history

    def _validation_dataset(self, validation_data: Any, batch_size: int | None,
                            validation_batch_size: int | None) -> Any:
        """fit's validation data as a dataset of GLOBAL batches: arrays (x, y) or (x, y, sample_weight)
        batched by `batch_size`, or a dataset as it is."""
        if validation_data is None:
            return None
        replicas = self.distribute_strategy.num_replicas_in_sync
        if isinstance(validation_data, tuple) and len(validation_data) in (2, 3):
            vx, vy, *vsw = validation_data
            return data_adapter.as_dataset(vx, vy, batch_size, vsw[0] if vsw else None, False,
                                           "fit(validation_data)", replicas)
        if validation_batch_size is not None:
            raise ValueError(f"Model.fit(validation_batch_size={validation_batch_size!r}): validation_data is a "
                             "dataset, which is batched already (by the GLOBAL batch size); validation_batch_size "
                             "is for array validation data (or validation_split).")
        return data_adapter.as_dataset(validation_data, None, None, None, False, "fit(validation_data)", replicas)

    def _check_class_weight(self, class_weight: Any, y: Any, sample_weight: Any, where: str) -> None:
        """Keras's rules for class_weight, checked before anything runs: {class id: weight}, a single
        output, and no sample weights beside it (a dataset's are refused at its first batch)."""
        if class_weight is None:
            return
        data_adapter.check_class_weight(class_weight, where)
        if sample_weight is not None:
            raise ValueError(f"Model.{where}: class_weight and sample_weight were both given; Keras takes one or "
                             "the other. Fold the class weights into sample_weight (multiply them), or drop one.")
        if compile_utils.is_nested(y) or (self._outputs is not None and not self._outputs.single):
            raise ValueError(f"Model.{where}(class_weight=...): the model has several outputs, and class_weight "
                             "is only for a single output (as in Keras). Give sample_weight instead: a dict (or "
                             "tuple) with one weight array per output.")

    def _fit_epochs(self, epoch_iterator: epochs_lib.EpochIterator, epochs: int, cbs: Any, dataset: Any, val: Any,
                    validation_steps: int | None, validation_freq: Any) -> dict[str, float]:
        strategy = self.distribute_strategy
        epoch_logs: dict[str, float] = {}
        for epoch in epoch_iterator.epochs(epochs):
            if not epoch_iterator.step:  # a resumed epoch goes on with the metrics restored with it
                self.reset_metrics()
            cbs.on_epoch_begin(epoch)
            logs: Any = None
            batch_logs = _reads_batch_logs(cbs)
            options = {True: self._run_options(1), False: self._run_options(2)}  # by whether a group is one batch
            for step, group in epoch_iterator.steps():
                cbs.on_train_batch_begin(step)
                logs = strategy.run(self._train_function, args=([b for b, _ in group], [n for _, n in group]),
                                    options=options[len(group) == 1])
                # (the logs read every metric across replicas, while they wait: only for callbacks that read
                # each batch's; else once per epoch)
                cbs.on_train_batch_end(step + len(group) - 1,
                                       {**self._read_logs(logs), "num_examples": sum(n for _, n in group)}
                                       if batch_logs else {"num_examples": sum(n for _, n in group)})
                if self._auto_jit is not None and self._auto_jit.after_step(
                        len(group), data_adapter.steps_left(epoch_iterator.num_batches, epochs - epoch - 1,
                                                            step + len(group))):
                    self._jit = jit.ReplicaCompiler(self._net.replicas, strategy.extended.worker_devices,
                                                    where='Model.fit(jit_compile="auto")')
                if self.stop_training:
                    break
            if epoch_iterator.step == 0 and epoch_iterator.num_batches != 0:  # (a resumed epoch may be done)
                raise data_adapter.no_batches("fit", dataset, f"epoch {epoch + 1}")
            epoch_iterator.end_epoch()
            epoch_logs = self._read_logs(logs)
            # As Keras: validation runs (through the fit callbacks' test hooks) even in the epoch that
            # a callback stopped, so its end has val_* logs for EarlyStopping, checkpoints and History.
            if val is not None and data_adapter.should_validate(epoch, validation_freq):
                val_logs = self._evaluate(val, validation_steps, cbs)
                epoch_logs.update({f"val_{k}": v for k, v in val_logs.items()})
                self._net.train()
            cbs.on_epoch_end(epoch, epoch_logs)
            optimizers.warn_if_instance_changed(self.optimizer, stacklevel=3)  # (a scheduler stepped by hand)
            if self.stop_training:
                break
        return epoch_logs

    def _read_logs(self, returned: Any) -> dict[str, float]:
        """The logs of a step as numbers, from what its step function returned on the replicas: the
        metrics' results (read across replicas) for get_metrics_result()'s view or nothing, else the first
        replica's values (tf.keras reports the first replica's)."""
        if returned is None or returned is self._logs_view:
            return self._logs()
        first = self.distribute_strategy.experimental_local_results(returned)[0]
        if isinstance(first, _Logs):
            return self._logs()
        if not isinstance(first, Mapping):
            raise TypeError(f"{type(self).__name__}.train_step/test_step returned a {type(first).__name__}; return "
                            "a dict of logs ({name: value}), self.compute_metrics(...), or None.")
        return {k: _log_value(k, v) for k, v in first.items()}

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
        self._net.eval()
        self.reset_metrics()
        if cbs is not None:
            cbs.on_test_begin()
        batches = epochs_lib.EpochIterator(strategy.experimental_distribute_dataset(dataset, self._input_options()),
                                           steps_per_epoch=steps,
                                           steps_per_execution=self._steps_per_execution)
        options = md.RunOptions(rerunnable=type(self).test_step is Model.test_step and self._own_steps is None)
        i, logs = -1, None
        for i, (_, group) in enumerate(batches.steps()):
            if cbs is not None:
                cbs.on_test_batch_begin(i)
            logs = strategy.run(self._test_function, args=([b for b, _ in group], [n for _, n in group]),
                                options=options)
            if cbs is not None:
                cbs.on_test_batch_end(i, self._read_logs(logs))
        if i < 0 and steps != 0:
            raise data_adapter.no_batches("evaluate", dataset, "its pass")
        logs = self._read_logs(logs)
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
        dataset = data_adapter.as_dataset(x, y, batch_size, sample_weight, False, "evaluate",
                                          self.distribute_strategy.num_replicas_in_sync)
        data_adapter.check_ends(dataset, steps, "evaluate", "steps")
        verbose = 1 if verbose == "auto" else verbose  # Keras: a progress bar unless verbose=0
        cbs = callbacks_lib.CallbackList(callbacks, add_history=False, add_progbar=verbose != 0, model=self,
                                         verbose=verbose, epochs=1,
                                         steps=steps if steps is not None else epochs_lib.len_or_none(dataset))
        logs = self._evaluate(dataset, steps, cbs)
        return logs if return_dict else self._flatten_logs(logs)

    def _flatten_logs(self, logs: dict[str, Any]) -> Any:
        """Logs as evaluate's list (Keras's order: loss, the metrics, each output's loss, the rest sorted);
        the one value alone."""
        values = compile_utils.flatten_metrics_in_order(logs, self._outputs)
        return values[0] if len(values) == 1 else values

    def train_on_batch(self, x: Any, y: Any = None, sample_weight: Any = None,
                       class_weight: Mapping[int, float] | None = None, return_dict: bool = False) -> Any:
        """One update on one GLOBAL batch of arrays (Keras's train_on_batch): the batch is split over the
        replicas as fit splits it, train_step runs on every one, and the metrics are reset first, so the
        logs are this batch's.

        Args:
          x, y, sample_weight: the batch as arrays (as fit's x, y and sample_weight), all of it one step.
          class_weight: {class id: weight}, as fit's.
          return_dict: return {name: value} instead of evaluate's list.

        Returns:
          The loss alone (no metrics), a list [loss, *metrics] in evaluate's order, or a dict.
        """
        self._require_compiled("train_on_batch")
        self._check_class_weight(class_weight, y, sample_weight, "train_on_batch")
        batch, rows = self._one_batch(x, y, sample_weight, "train_on_batch")
        self._net.train()
        self._net.zero_grad()
        self.reset_metrics()
        self._class_weight = class_weight
        try:
            logs = self.distribute_strategy.run(self._train_function, args=([batch], [rows]),
                                                options=self._run_options(1))
        finally:
            self._class_weight = None
        logs = self._read_logs(logs)
        return logs if return_dict else self._flatten_logs(logs)

    def test_on_batch(self, x: Any, y: Any = None, sample_weight: Any = None, return_dict: bool = False) -> Any:
        """The loss and metrics of one GLOBAL batch of arrays (Keras's test_on_batch), split over the
        replicas; the metrics are reset first. Returns as train_on_batch does."""
        self._require_compiled("test_on_batch")
        batch, rows = self._one_batch(x, y, sample_weight, "test_on_batch")
        self._net.eval()
        self.reset_metrics()
        options = md.RunOptions(rerunnable=type(self).test_step is Model.test_step)
        logs = self._read_logs(self.distribute_strategy.run(self._test_function, args=([batch], [rows]),
                                                            options=options))
        return logs if return_dict else self._flatten_logs(logs)

    def predict_on_batch(self, x: Any) -> Any:
        """The outputs of one GLOBAL batch of arrays (Keras's predict_on_batch), split over the replicas:
        predict(x) with the batch as one step."""
        x = data_adapter.as_array(x, "predict_on_batch", "x")
        if not data_adapter.is_arrays(x):
            raise TypeError(f"Model.predict_on_batch: x is a {type(x).__name__}; give one batch as arrays (a numpy "
                            "array or tensor, or a dict of them). For a dataset, use predict.")
        return self.predict(x, batch_size=max(data_adapter.rows(x), 1), verbose=0)

    def _one_batch(self, x: Any, y: Any, sample_weight: Any, where: str) -> Any:
        """The arrays x, y, sample_weight as one GLOBAL batch, split over the replicas (a distributed batch)."""
        x = data_adapter.as_array(x, where, "x")
        if not data_adapter.is_arrays(x):
            raise TypeError(f"Model.{where}: x is a {type(x).__name__}; give one batch as arrays (a numpy array or "
                            "tensor, or a dict of them), with y and sample_weight as arrays too.")
        dataset = data_adapter.as_dataset(x, y, max(data_adapter.rows(x), 1), sample_weight, False, where,
                                          self.distribute_strategy.num_replicas_in_sync)
        distributed = iter(self.distribute_strategy.experimental_distribute_dataset(dataset, self._input_options()))
        return next(distributed), getattr(distributed, "global_batch_size", None)

    def predict(self, x: Any, batch_size: int | None = None, verbose: Any = "auto", steps: int | None = None,
                callbacks: Sequence[Any] | None = None) -> Any:
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
          concatenated along dim 0; for a module returning a dict, list or tuple, the same structure of
          such arrays.
        """
        strategy = self.distribute_strategy
        x = data_adapter.as_array(x, "predict", "x")
        arrays = data_adapter.is_arrays(x)
        dataset = data_adapter.as_dataset(x, None, batch_size if arrays else None, None, False, "predict",
                                          strategy.num_replicas_in_sync)
        data_adapter.check_ends(dataset, steps, "predict", "steps")
        verbose = 1 if verbose == "auto" else verbose
        cbs = callbacks_lib.CallbackList(callbacks, add_progbar=verbose != 0, model=self, verbose=verbose, epochs=1,
                                         steps=steps if steps is not None else epochs_lib.len_or_none(dataset))
        self._net.eval()
        outputs = []
        self._predict_like = None
        options = md.RunOptions(rerunnable=type(self).predict_step is Model.predict_step and self._own_steps is None)
        cbs.on_predict_begin()
        for i, batch in enumerate(strategy.experimental_distribute_dataset(dataset, self._input_options())):
            if steps is not None and i >= steps:
                break
            cbs.on_predict_batch_begin(i)
            result = strategy.run(self._predict_function, args=(batch,), options=options)
            first = next((p for p in strategy.experimental_local_results(result) if data_adapter.rows(p)), None)
            if first is not None and self._predict_like is None:
                self._predict_like = md.map_structure(lambda t: t[:0].detach(), first)
            # Every replica's rows in batch order: on a multi-worker strategy, every worker's.
            outputs.append(md.map_structure(lambda t: t.detach().cpu().numpy(), strategy.gather(result, axis=0)))
            cbs.on_predict_batch_end(i, {"outputs": outputs[-1]})
        cbs.on_predict_end()
        if not outputs:
            raise ValueError("Model.predict: the dataset yielded no batches.")
        # (a module with several outputs: their structure, each output's rows concatenated, as Keras's)
        return md.map_structure(lambda *parts: np.concatenate(parts, axis=0), *outputs)

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

    def _logs(self) -> dict[str, Any]:
        return {name: _log_value(name, m.result()) for name, m in self._log_entries()}

    def _log_entries(self) -> list[tuple[str, Any]]:
        """(name in the logs, metric) for every metric of `metrics` (which a subclass may override): the
        compiled ones as Keras names them (an output's prefixed), any other by its own name."""
        named = {id(m): name for name, m in self._outputs.names} if self._outputs is not None else {}
        return [(named.get(id(m), m.name), m) for m in self.metrics]

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

    def save(self, filepath: str | Path, overwrite: bool = True, zipped: bool | None = None) -> None:
        """Weights, optimizer state, the random state and compile settings in one safetensors file,
        written atomically (saving.py). Keras's arguments.

        Args:
          filepath: the file to write (a directory is refused: a checkpoint is one file). Replaced only once
            the new file is complete, so a crash leaves the old one. `Model.load(filepath)` rebuilds the
            model. For a Keras model, a path ending in ".keras" is a Keras archive (replica 0's model, which
            every replica equals) that keras.models.load_model reads. Under a multi-worker strategy only the
            chief writes it (TF's should_checkpoint; the workers' copies are bitwise equal); the others
            return without writing.
          overwrite: False refuses a file that exists (FileExistsError; Keras asks at a prompt instead).
          zipped: Keras's, for a ".keras" archive: None or True (the archive is zipped; Keras's unzipped
            directory is refused).
        """
        archive = adapters.is_archive(filepath)
        where = f"Model.save({str(filepath)!r})"
        if archive:  # refused on every worker alike, before the chief-only gate
            self._adapter.check_archive(self.module, filepath, where)
        if zipped is not None and not (archive and zipped is True):
            raise ValueError(f"{where}: zipped={zipped!r}: a \".keras\" archive is written zipped (Keras's unzipped "
                             "directory is not supported here), and a mirrored file is one safetensors file. Leave "
                             "zipped out.")
        saving.check_overwrite(filepath, overwrite, where)
        if not self._writes_checkpoints("save", filepath):
            return
        if archive:
            self._adapter.save_archive(self.module, filepath)
            return
        saving.save(self, filepath, with_optimizer=True)

    def save_weights(self, filepath: str | Path, overwrite: bool = True, max_shard_size: float | None = None) -> None:
        """The weights alone (no optimizer state), in one safetensors file, written atomically (by the
        chief only, under a multi-worker strategy). Keras's arguments: overwrite=False refuses a file that
        exists (FileExistsError); max_shard_size must stay None (the file is never sharded)."""
        where = f"Model.save_weights({str(filepath)!r})"
        if max_shard_size is not None:
            raise ValueError(f"{where}: max_shard_size={max_shard_size!r}, but the weights are written to one "
                             "safetensors file, never sharded. Leave max_shard_size out.")
        saving.check_overwrite(filepath, overwrite, where)
        if self._writes_checkpoints("save_weights", filepath):
            saving.save(self, filepath, with_optimizer=False)

    def _writes_checkpoints(self, what: str, path: str | Path) -> bool:
        # TF's other workers write to a temporary path and delete it; nothing here is collective, so they skip.
        if self.distribute_strategy.extended.should_checkpoint:
            return True
        logger.debug("Model.%s(%s): not the chief worker, so nothing is written here", what, path)
        return False

    def load_weights(self, filepath: str | Path, skip_mismatch: bool = False) -> None:
        """Loads the weights of a checkpoint saved on any number of replicas into every replica; every
        tensor's name, shape and dtype is checked first (CheckpointError naming the file otherwise).
        skip_mismatch=True (Keras's) loads the tensors that fit and skips, with one warning naming them,
        those whose shape or dtype differs and those only one side has."""
        saving.load_weights(self, filepath, skip_mismatch=skip_mismatch)

    @classmethod
    def load(cls, path: str | Path, module: nn.Module | None = None, compile: bool = True) -> Model:
        """A Model from `save()`'s file. Pass `module=` (an instance of the same architecture) unless the
        model came from `mr.models`, whose name and arguments the file records. Never unpickles.

        Args:
          path: the file `save()` wrote, saved on any number of replicas.
          module: a torch module of the saved architecture to load the weights into; None builds it from the
            file (mr.models only).
          compile: compile with the recorded optimizer, loss, metrics and precision and restore the
            optimizer state, fp16 loss scale and random state, so fit() continues the run; False loads the
            weights only.

        Returns:
          The Model, under the current strategy's scope (one replica outside any). Every tensor's name,
          shape and dtype is checked first: a file that does not fit is a CheckpointError naming it. A
          ".keras" archive (Keras 3, torch backend) is read by keras.models.load_model, uncompiled.
        """
        if adapters.is_archive(path):
            return cls(adapters.load_archive(path))
        return saving.load(cls, path, module, compile)

    def __repr__(self) -> str:
        return f"Model({self.name}, replicas={self.distribute_strategy.num_replicas_in_sync})"




class _Seen:
    """What one replica saw at the first step (the labels, and the outputs: None for an empty part), handed
    to the merge_call that builds the compiled losses and metrics, as one value per replica."""

    def __init__(self, y: Any, y_pred: Any):
        self.y, self.y_pred = y, y_pred


def _describe(given: Any) -> str:
    """A compile() argument in an error: a name as it is, else its type."""
    return repr(given) if isinstance(given, str) else type(given).__name__


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


def _metric_config(given: Any) -> Any:
    """What compile() records of one metric: a name as given, else the config of the metric it makes (an
    mr.metrics function's too), else {"object": its repr}, which load() leaves out with a warning."""
    if isinstance(given, str):
        return given
    metric = None
    if isinstance(given, metrics_lib.Metric):
        metric = given
    elif isinstance(given, type) and issubclass(given, metrics_lib.Metric):
        metric = given()
    elif callable(given) and not isinstance(given, type) and not type(given).__module__.startswith("keras"):
        metric = metrics_lib.MeanMetricWrapper(given)
    return (metrics_lib.serialize(metric) if metric is not None else None) or {"object": repr(given)}


def _averages_weights(optimizer: Any) -> bool:
    """Whether `optimizer` keeps a moving average of the weights (use_ema), which it may write into them
    in a step that only accumulates gradients."""
    return bool(getattr(getattr(optimizer, "_options", None), "use_ema", False))


def _as_double(value: Tensor | float) -> Tensor | float:
    return value.detach().double() if isinstance(value, Tensor) else float(value)


def _log_value(key: str, value: Any) -> float | np.ndarray:
    """A log's value as Keras gives it: a float, or a numpy array for a metric with one value per class
    (F1Score(average=None), R2Score(class_aggregation=None)), which History and evaluate keep as arrays
    and the progress bar shows by its mean."""
    if isinstance(value, Tensor):
        return float(value) if value.numel() == 1 else value.detach().float().cpu().numpy()
    if isinstance(value, np.ndarray) and value.dtype.kind in "fiub":
        return float(value) if value.size == 1 else value
    if isinstance(value, (int, float, np.number)) and not isinstance(value, bool):
        return float(value)
    raise TypeError(f"a step's logs hold {key!r}: {value!r:.80}, not a number; give each log one number (a "
                    "metric's result(), a loss.detach()).")


class _Logs(Mapping):
    """What the default steps return (get_metrics_result): every metric's result by name, computed when
    a value is asked for - after the step, in cross-replica context, where a read sums the replicas'
    state - so that a step reads nothing it does not need to."""

    def __init__(self, model: Model):
        self._model = model

    def _by_name(self) -> dict[str, Any]:
        return dict(self._model._log_entries())

    def __getitem__(self, name: str) -> Tensor:
        return self._by_name()[name].result()

    def __iter__(self) -> Iterator[str]:
        return iter(self._by_name())

    def __len__(self) -> int:
        return len(self._by_name())

    def __repr__(self) -> str:
        return f"<logs of {', '.join(self._by_name())}>"


class _OptimizerSteps:
    """What a compiled (or Model.build_optimizer) optimizer recipe does when a step calls it: the mirrored
    optimizer's step, zero_grad and Keras's scale_loss / apply on the calling replica, with that
    replica's fp16 loss scale (a GradScaler) where the model has one."""

    def __init__(self, mirrored: Any, model: Model):
        self.mirrored = mirrored
        self._model = weakref.ref(model)  # (the model holds the recipe, which holds this)
        self._scaled: dict[int, bool] = {}  # per replica: whether it scaled a loss since its last update

    def _scaler(self) -> tuple[int, Any]:
        model = self._model()
        scalers = model._scalers if model is not None else []
        if not scalers:
            return 0, None
        ctx = md.get_replica_context()
        rid = 0 if ctx is None else ctx.local_replica_id
        return rid, scalers[rid]

    def scale_loss(self, loss: Tensor, factor: float | None) -> Tensor:
        rid, scaler = self._scaler()
        if factor is not None:
            loss = loss * factor  # Keras's loss_scale_factor, which a Keras optimizer's apply() undoes
        if scaler is None:
            return loss
        self._scaled[rid] = True
        return scaler.scale(loss)

    def step(self) -> None:
        rid, scaler = self._scaler()
        if scaler is None:
            self.mirrored.step()
            return
        if not self._scaled.get(rid):  # (an empty part: its scaler must hold the scale that step() unscales by)
            scaler.scale(torch.zeros((), device=self.mirrored.optimizer.param_groups[0]["params"][0].device))
        self._scaled[rid] = False
        self.mirrored.step(grad_scaler=scaler)  # (reduced first, then unscaled: every replica skips alike)
        scaler.update()

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.mirrored.zero_grad(set_to_none=set_to_none)

    def apply(self, grads: Sequence[Tensor | None], variables: Sequence[Any] | None) -> None:
        """Keras's apply: sets the given gradients on `variables` (the optimizer's parameters where None),
        then steps."""
        params = ([p for g in self.mirrored.param_groups for p in g["params"]] if variables is None
                  else [getattr(v, "value", v) for v in variables])
        if len(params) != len(grads):
            raise ValueError(f"optimizer.apply: {len(grads)} gradients for {len(params)} variables; give one "
                             "gradient (or None) per variable, in the same order.")
        for p, g in zip(params, grads):
            if g is not p.grad:
                p.grad = g
        self.step()

