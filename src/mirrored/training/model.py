"""`mr.Model`: Keras's compile / fit / evaluate / predict / save around any torch.nn.Module.

Created in a strategy's scope, the module is mirrored on every replica. The class is three parts:
this file (construction, compile, weights, save and load), steps.py (train_step, test_step,
predict_step and compute_loss, run on every replica inside strategy.run) and loops.py (fit, evaluate,
predict, on the caller's thread). What differs by the module's kind (a Keras 3 model) is its adapter
(adapters.py); the data's conversions are data_adapter.py's. Uses the public surface of
`mirrored.distribute` and `mirrored.data`.
"""
from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn

import mirrored.distribute as md
from mirrored.training import adapters, compile_utils, jit, losses, optimizers, saving
from mirrored.training import data_adapter, epochs as epochs_lib, metrics as metrics_lib
from mirrored.training._trackables import LossScale
from mirrored.training.layers import has_sync_batchnorm
from mirrored.training.loops import _Loops
from mirrored.training.steps import _Logs, _OptimizerSteps, _Steps

logger = logging.getLogger(__name__)


class Model(_Loops, _Steps):
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
