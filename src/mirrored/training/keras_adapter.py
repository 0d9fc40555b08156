"""Keras 3 models (torch backend) under a strategy: `mr.Model(keras_model)` with Keras's conventions.

A Keras 3 model on the torch backend is an nn.Module whose variables are torch Parameters (the
non-trainable ones, BatchNormalization's moving statistics and the dropout seed generators' states,
with requires_grad=False), so the strategy mirrors it as any module. What differs is decided here:
the forward pass gets `training=True` in fit's train steps and False elsewhere, as Keras's torch
trainer passes it; loss and metric strings mean probabilities (`from_logits=False`), and
keras.losses / keras.metrics objects compute Keras's own values (KerasLoss, KerasMetric); a
keras.optimizers instance is rebuilt once per replica and applies the all-reduced gradients with
Keras's own update rule, options and state (KerasOptimizer); the variables layers assign in `call`
are made equal across replicas after every step by the strategy's buffer sync (state_tensors,
registered with mirrored.distribute): floating-point ones averaged, as tf.keras's sync-on-read MEAN
variables read, or replica 0's where the variable's aggregation is "only_first_replica", integer ones
(seed generator states) replica 0's. BatchNormalization layers that convert_sync_batchnorm flags
compute their batch statistics over the global batch (a differentiable all-reduce of per-channel
sums), as tf.keras's synchronized=True, which Keras refuses on torch. Keras's own `model.fit` on a
model compiled in a strategy's scope warns once, naming mr.Model (watch_keras_fit). Keras is never imported here: an object is a
Keras one only if `keras` is already in sys.modules. Uses mirrored.distribute's public surface,
losses.py, metrics.py, optimizers.py and keras.
"""
from __future__ import annotations

import contextlib
import copy
import copyreg
import sys
import threading
import warnings
import weakref
from collections.abc import Iterable, Sequence
from typing import Any

import torch
from torch import Tensor, nn
from torch.autograd.function import once_differentiable

import mirrored.distribute as md
from mirrored.training import losses as losses_lib, metrics as metrics_lib, optimizers as optimizers_lib

def _keras() -> Any:
    """The keras module if the program imported it, else None (we never import it ourselves)."""
    return sys.modules.get("keras")


def is_keras_model(obj: Any) -> bool:
    """Whether `obj` is a Keras 3 layer or model (checked without importing keras)."""
    keras = _keras()
    return keras is not None and isinstance(obj, keras.layers.Layer)


def adopt() -> None:
    """Installs, once per process, what the replicas of a Keras model need of Keras's own code: a random
    stream per replica (_replica_seeds) and global-batch BatchNormalization (_patch_batchnorm). Called
    where a Keras model is taken in (mr.Model, its copies for other replicas); a scope's entry installs
    the first too (keras.random in a loop whose model is not a Keras one)."""
    _replica_seeds()
    _patch_batchnorm()


def _is_keras(obj: Any, kind: str) -> bool:
    keras = _keras()
    if keras is None:
        return False
    base = {"optimizer": keras.optimizers.Optimizer, "loss": keras.losses.Loss, "metric": keras.metrics.Metric}[kind]
    return isinstance(obj, base) or (isinstance(obj, type) and issubclass(obj, base))


def check_model(model: Any, where: str = "mr.Model") -> None:
    """Refuses a Keras model of another backend than torch (it would not be an nn.Module), and one not
    built yet: each replica would draw its own initial weights at its first call."""
    keras = _keras()
    if keras is not None and keras.backend.backend() != "torch":
        raise ValueError(f"{where}({type(model).__name__}): Keras runs on the {keras.backend.backend()!r} backend, "
                         "but mirrored trains torch modules. Set KERAS_BACKEND=torch before importing keras.")
    if not model.built or not model.variables:
        raise ValueError(f"{where}({type(model).__name__}): the Keras model is not built yet (it has no variables), "
                         "so every replica would create its own at its first call. Build it first: start it with "
                         "keras.Input(shape), call model.build(input_shape), or call it once on a sample batch.")


def device_scope(device: torch.device) -> Any:
    """Keras's device scope on a CUDA replica (Keras moves the tensors it converts to its current
    device, which is per thread); nothing on the CPU."""
    keras = _keras()
    if keras is None or device.type == "cpu":
        return contextlib.nullcontext()
    return keras.device(str(device))


def call_model(module: Any, x: Any, training: bool, *args: Any, **kwargs: Any) -> Any:
    """A Keras model on `x` with `training=` as Keras's torch trainer passes it (only to a call that
    takes it), under the replica's Keras device."""
    own = getattr(module, "module", module)  # (a MirroredModule's replica copy)
    if getattr(own, "_call_has_training_arg", True):
        kwargs["training"] = training
    device = next((p.device for p in own.parameters()), torch.device("cpu"))
    with device_scope(device):
        return module(x, *args, **kwargs)


def regularization(module: Any) -> Tensor | float:
    """The model's `losses` (weight regularizers and the activity losses of its last call), summed:
    what Keras's compute_loss adds to the loss."""
    own = getattr(module, "module", module)
    extra = list(own.losses)
    if not extra:
        return 0.0
    return torch.stack([torch.as_tensor(v).float().sum() for v in extra]).sum()


# ---- state that layers assign in call ------------------------------------------------------------------
_STATE: "weakref.WeakKeyDictionary[nn.Module, tuple[int, list[tuple[Tensor, str]]]]" = weakref.WeakKeyDictionary()


def state_tensors(module: nn.Module) -> list[tuple[Tensor, str]] | None:
    """The non-trainable variables of a Keras model copy, each with how the replicas' copies combine:
    "mean" (floating point: BatchNormalization's moving statistics, as tf.keras's sync-on-read MEAN)
    or "first" (replica 0's: integer seed generator states, and aggregation="only_first_replica").
    None for a module that is not a Keras one. Registered with mirrored.distribute at import."""
    if not is_keras_model(module):
        return None
    params = [p for p in module.parameters() if not p.requires_grad]
    key = sum(id(p) for p in params)  # (a layer frozen since: recomputed)
    cached = _STATE.get(module)
    if cached is not None and cached[0] == key:
        return cached[1]
    aggregation = {id(v.value): v.aggregation for v in module.variables}
    found = []
    for p in params:
        how = aggregation.get(id(p), "none")
        if how == "sum":
            raise ValueError(f"{type(module).__name__}: a non-trainable variable of shape {tuple(p.shape)} has "
                             "aggregation=\"sum\"; its replicas' assignments cannot be combined as one device's. "
                             "Use aggregation=\"mean\" or \"only_first_replica\" for variables a layer assigns.")
        found.append((p, "first" if how == "only_first_replica" or not p.is_floating_point() else "mean"))
    _STATE[module] = (key, found)
    return found


md.register_state_tensors(state_tensors)


# ---- Keras random ops in replica steps: a stream per replica ----------------------------------------------
_SEEDS_PATCHED = False


def _in_replica_step() -> bool:
    """Whether this thread runs a replica of a strategy's step, where torch's random ops draw from the
    replica's generator (mirrored.distribute.random)."""
    return md.has_strategy() and md.get_replica_context() is not None


def _refuse_per_example(what: str) -> None:
    ctx = md.get_replica_context()
    strategy = getattr(ctx, "strategy", None)
    if strategy is not None and strategy.random_state.per_example:
        raise RuntimeError(
            f"{what} drew a seed in a replica step of a strategy with per_example_random=True: a Keras random op "
            "that draws through a SeedGenerator (Dropout(seed=...), GaussianNoise, keras.random.normal, ...) draws "
            "from a generator of its own, which cannot be keyed by example, so the run would depend on the replica "
            "count. Drop seed= from the Keras Dropout (it then runs torch's dropout, which is keyed), or use "
            "per_example_random=False.")


def _replica_seed() -> Tensor:
    """A Keras seed [s, 0] (int32, Keras's torch seed dtype) drawn from the running replica's generator:
    torch.randint in a replica step takes it (mirrored.distribute.random)."""
    drawn = int(torch.randint(1, 1 << 31, (), dtype=torch.int64))
    return torch.tensor([drawn, 0], dtype=torch.int32)


class _ReplicaSeeds:
    """Stands in for Keras's global SeedGenerator in a replica step (keras.random.*(seed=None))."""

    def next(self, ordered: bool = True) -> Any:  # noqa: A003 - Keras's name
        del ordered
        _refuse_per_example("keras.random with seed=None")
        return _replica_seed()


def _replica_seeds() -> None:
    """Gives Keras's random ops in a replica step a stream per replica (issues 23 x 26).

    Seeded (a layer's SeedGenerator(seed=int)): Keras draws through torch.Generator(manual_seed(state))
    from the generator, whose state the replicas hold in step (replica 0's after each step), so every
    replica drew the same mask for its different examples. Replica 0, and any call outside a
    multi-replica step, keeps Keras's own seed, so one replica draws what Keras draws; replica r > 0
    (its global id, so 2 workers x 2 replicas draw as 4 replicas) mixes r into the first word.
    Unseeded (seed=None: keras.random.*'s global SeedGenerator, which Keras keeps per thread and seeds
    from Python's `random` at a thread's first draw, in whatever order the replica threads get there;
    and a layer's SeedGenerator(seed=None), GaussianNoise's say): the seed is drawn from the replica's
    own generator, seeded by the strategy's seed, the step and the replica, so two runs, and a resumed
    one, draw the same whatever the thread order. (An unseeded Keras Dropout runs torch's dropout,
    which draws from that generator already.)"""
    global _SEEDS_PATCHED
    keras = _keras()
    if _SEEDS_PATCHED or keras is None:
        return
    from keras.src.random import seed_generator  # (keras is imported: _keras() found it)
    from mirrored._seeds import derive_seed

    keras_next = seed_generator.SeedGenerator.next
    keras_global = seed_generator.global_seed_generator
    replica_seeds = _ReplicaSeeds()

    def next(self: Any, ordered: bool = True) -> Any:  # noqa: A001 - Keras's name
        if not _in_replica_step():
            return keras_next(self, ordered)
        _refuse_per_example(f"Keras's SeedGenerator {getattr(self, 'name', '')!r}")
        if getattr(self, "_initial_seed", 0) is None:  # built with seed=None: the replica's stream
            return _replica_seed()
        value = keras_next(self, ordered)
        ctx = md.get_replica_context()
        replica = 0 if ctx.num_replicas_in_sync < 2 else ctx.replica_id_in_sync_group
        if not replica or not isinstance(value, Tensor) or value.numel() < 1:
            return value
        first = int(value.reshape(-1)[0])
        mixed = derive_seed(first & 0xFFFFFFFF, replica, 0x23) & 0x7FFFFFFF  # fits int32, Keras's seed dtype
        value = value.clone()
        value.view(-1)[0] = mixed
        return value

    def global_seed_generator() -> Any:
        return replica_seeds if _in_replica_step() else keras_global()

    next.__doc__ = keras_next.__doc__
    global_seed_generator.__doc__ = keras_global.__doc__
    seed_generator.SeedGenerator.next = next
    seed_generator.global_seed_generator = global_seed_generator  # draw_seed(None) looks it up at each call
    _SEEDS_PATCHED = True


# ---- BatchNormalization over the global batch (issue 23) ---------------------------------------------------
_GLOBAL_BN = "_mirrored_global_batch"  # the flag convert_sync_batchnorm sets on a layer (copied with it)
_BN_PATCHED = False


class _AllReduceSum(torch.autograd.Function):
    """The replicas' sum of `local`. Backward: the replicas' sum of the incoming gradients, since every
    replica's statistics enter every replica's loss (the strategy sums the replicas' gradients). The
    replica context comes from forward: on CUDA, backward runs on autograd's own device threads."""

    @staticmethod
    def forward(ctx: Any, local: Tensor, replica_ctx: Any) -> Tensor:
        ctx.replica_ctx = replica_ctx
        return replica_ctx.all_reduce(md.ReduceOp.SUM, local)

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        return ctx.replica_ctx.all_reduce(md.ReduceOp.SUM, grad.contiguous()), None


def _global_moments(layer: Any, inputs: Tensor) -> tuple[Tensor, Tensor]:
    """Mean and (biased) variance per channel over every replica's part of the batch, by Keras's own
    formula on one device (E[x^2] - E[x]^2), differentiable through the exchange."""
    axes = list(layer._reduction_axes)
    channels = inputs.shape[layer.axis]
    count = inputs.numel() // channels if channels else 0
    # The exchange in float64: the sums of replicas' parts add no rounding of their own, and the count
    # stays exact past float32's 2**24.
    f64 = torch.float64
    local = torch.cat([inputs.sum(dim=axes).to(f64), inputs.square().sum(dim=axes).to(f64),
                       inputs.new_full((1,), float(count), dtype=f64)])
    total = _AllReduceSum.apply(local, md.get_replica_context())
    n = total[-1].clamp_min(1)
    mean = total[:channels] / n
    variance = total[channels:2 * channels] / n - mean.square()
    return mean.to(inputs.dtype), variance.to(inputs.dtype)


def _patch_batchnorm() -> None:
    """Makes Keras's BatchNormalization._moments compute global-batch statistics for a flagged layer in
    a multi-replica step; Keras's own everywhere else (one replica: exactly one device)."""
    global _BN_PATCHED
    if _BN_PATCHED:
        return
    from keras.src.layers.normalization.batch_normalization import BatchNormalization

    keras_moments = BatchNormalization._moments

    def _moments(self: Any, inputs: Any, mask: Any) -> Any:
        ctx = md.get_replica_context()
        if not getattr(self, _GLOBAL_BN, False) or ctx is None or ctx.num_replicas_in_sync < 2:
            return keras_moments(self, inputs, mask)
        if mask is not None:
            raise ValueError(f"BatchNormalization {self.name!r} (converted by mr.layers.convert_sync_batchnorm) got "
                             "a mask: masked statistics over the global batch are not supported. Leave this layer "
                             "per-replica (do not convert it), or drop the mask before it.")
        return _global_moments(self, inputs)

    _moments.__doc__ = keras_moments.__doc__
    BatchNormalization._moments = _moments
    _BN_PATCHED = True


def convert_sync_batchnorm(model: Any) -> Any:
    """`model` (a Keras layer or model) with every BatchNormalization computing its batch statistics
    over the global batch of all replicas in training, as tf.keras's BatchNormalization(synchronized=
    True) under MirroredStrategy; Keras on torch refuses that argument. Changes `model` in place."""
    keras = _keras()
    _patch_batchnorm()
    found = [layer for layer in model._flatten_layers(include_self=True, recursive=True)
             if isinstance(layer, keras.layers.BatchNormalization)]
    for layer in found:
        object.__setattr__(layer, _GLOBAL_BN, True)
    return model


def has_global_batchnorm(module: Any) -> bool:
    """True for a Keras model holding a layer convert_sync_batchnorm converted (its training forward
    joins a collective: every replica must call it, also on an empty part of the batch)."""
    if not is_keras_model(module):
        return False
    return any(getattr(layer, _GLOBAL_BN, False) for layer in module._flatten_layers(include_self=True, recursive=True))


_COPY_LOCK = threading.Lock()
_COPY_RECURSION_LIMIT = 100_000


def _as_object(self: Any, memo: dict) -> Any:
    """copy.deepcopy of a Keras object as a Python object (its attributes copied), not through
    Keras's __reduce__, which saves and reloads the model (custom layers would have to be registered
    and a subclassed model to have a config)."""
    return copy._reconstruct(self, memo, copyreg.__newobj__, (type(self),), self.__getstate__())


def _copy_dynamic_backend(self: Any, memo: dict) -> Any:
    """copy.deepcopy of Keras's DynamicBackend: a new one for the same backend."""
    return type(self)(self._backend)


def copy_model(module: nn.Module) -> nn.Module | None:
    """An independent copy of a Keras model for another replica (None for other modules): every
    variable a new torch Parameter, the layers' graph and settings the same. Registered with
    mirrored.distribute's mirroring."""
    if not is_keras_model(module):
        return None
    check_model(module, "strategy.mirror")
    adopt()
    from keras.src.saving.keras_saveable import KerasSaveable
    from keras.src.utils.backend_utils import DynamicBackend

    with _COPY_LOCK:
        KerasSaveable.__deepcopy__ = _as_object  # type: ignore[attr-defined]
        # A preprocessing layer's DynamicBackend (RandomFlip.backend, ...) answers every missing attribute
        # through self._backend, so copy's probe of a bare new instance for __setstate__ recursed without
        # end (a segmentation fault under the raised limit below; found porting keras.io's "Image
        # classification from scratch"). It holds only the backend's name: a new one with that name.
        DynamicBackend.__deepcopy__ = _copy_dynamic_backend  # type: ignore[attr-defined]
        # The copy recurses along the layer graph (a ResNet50's 175 layers and their nodes go deeper
        # than Python's default limit of 1000 frames); frames of Python code, not of the C stack.
        limit = sys.getrecursionlimit()
        sys.setrecursionlimit(max(limit, _COPY_RECURSION_LIMIT))
        try:
            memo = {id(m): m for m in list(sys.modules.values())}  # (modules a layer refers to are shared)
            return copy.deepcopy(module, memo)
        finally:
            sys.setrecursionlimit(limit)
            del KerasSaveable.__deepcopy__
            del DynamicBackend.__deepcopy__


md.register_copier(copy_model)


# ---- losses --------------------------------------------------------------------------------------------
class KerasLoss(losses_lib.Loss):
    """A Keras loss (object, function or name) computed by Keras: its per-example values, reduced
    over the GLOBAL batch by Model.fit as Keras reduces one device's batch."""

    def __init__(self, keras_loss: Any):
        keras = _keras()
        if isinstance(keras_loss, keras.losses.Loss):
            obj = keras_loss
        else:  # a name or a function: Keras's compile wraps it in a LossFunctionWrapper
            fn = keras.losses.get(keras_loss) if isinstance(keras_loss, str) else keras_loss
            name = keras_loss if isinstance(keras_loss, str) else getattr(fn, "__name__", "loss")
            from keras.src.losses.losses import LossFunctionWrapper  # (not exported; what compile uses)

            obj = LossFunctionWrapper(fn, name=name)
        reduction = {"mean": "sum_over_batch_size", None: "none"}.get(obj.reduction, obj.reduction)
        if reduction not in ("sum_over_batch_size", "sum", "none"):
            raise ValueError(f"compile(loss={keras_loss!r}): reduction={obj.reduction!r} is not supported (it divides "
                             "by the sum of the sample weights, which we do not all-reduce). Use "
                             "reduction=\"sum_over_batch_size\" (Keras's default) or \"sum\".")
        config = getattr(obj, "_fn_kwargs", None) or {}
        super().__init__(name=obj.name, reduction=reduction, from_logits=False)
        self.keras_loss = obj
        self.from_logits = bool(getattr(obj, "from_logits", config.get("from_logits", False)))
        ignore = getattr(obj, "ignore_class", config.get("ignore_class"))
        if ignore is not None:
            self.ignore_class = ignore
        self._dtype = obj.dtype

    def _per_example(self, y_true: Any, y_pred: Tensor) -> Tensor:
        keras = _keras()
        y_pred = keras.ops.convert_to_tensor(y_pred, dtype=self._dtype)
        y_true = keras.ops.convert_to_tensor(y_true, dtype=self._dtype)
        return self.keras_loss.call(y_true, y_pred)

    def get_config(self) -> dict[str, Any]:
        raise NotImplementedError(f"{self!r}: a Keras loss is recorded by Keras's own config, not ours.")

    def __repr__(self) -> str:
        return f"KerasLoss({self.keras_loss!r})"


def loss(identifier: Any) -> losses_lib.Loss:
    """compile(loss=...) for a Keras model: a name, function or keras.losses object as Keras means it
    (probabilities unless from_logits=True); an mr.losses object or torch loss as it is."""
    if isinstance(identifier, str):
        try:
            _keras().losses.get(identifier)
        except ValueError as e:
            raise ValueError(f"compile(loss={identifier!r}): Keras does not know this loss ({e}).") from None
    elif isinstance(identifier, type) and _is_keras(identifier, "loss"):
        identifier = identifier()
    elif not (_is_keras(identifier, "loss") or (callable(identifier) and
                                                getattr(identifier, "__module__", "").startswith("keras"))):
        return losses_lib.get(identifier)
    return KerasLoss(identifier)


# ---- metrics -------------------------------------------------------------------------------------------
class KerasMetric(metrics_lib.Metric):
    """A keras.metrics object under a strategy: each replica updates a fresh copy of it on its batch
    and adds the copy's variables (Keras creates metric variables with aggregation="sum") to this
    metric's sync-on-read state; result() sets a copy's variables to the replicas' sum and asks it."""

    def __init__(self, keras_metric: Any):
        bad = [v.path for v in keras_metric.variables if v.aggregation != "sum"]
        if bad:
            raise ValueError(f"compile(metrics=[{keras_metric!r}]): its variables {bad} are aggregated by "
                             "another rule than a sum, so replicas' parts cannot be combined. Use a metric "
                             "whose state adds up (mean, accuracy, AUC, precision, ...).")
        super().__init__(keras_metric.name)
        self.keras_metric = keras_metric
        self._config = (type(keras_metric), keras_metric.get_config())
        self._copies: dict[int, Any] = {}
        self._reader = self._fresh()
        self._totals = [self.add_state(f"v{i}", tuple(v.shape)) for i, v in enumerate(keras_metric.variables)]

    def _fresh(self) -> Any:
        cls, config = self._config
        return cls.from_config(config)

    def update_state(self, y_true: Any, y_pred: Any, sample_weight: Any = None) -> None:
        ctx = md.get_replica_context()
        rid = 0 if ctx is None else getattr(ctx, "local_replica_id", ctx.replica_id_in_sync_group)
        part = self._copies.get(rid)
        if part is None:
            part = self._copies[rid] = self._fresh()
        device = y_pred.device if isinstance(y_pred, Tensor) else torch.device("cpu")
        with device_scope(device), torch.no_grad():
            part.reset_state()
            part.update_state(y_true, y_pred, sample_weight=sample_weight)
            for total, v in zip(self._totals, part.variables):
                total.assign_add(v.value.detach().to(total.dtype))

    def result(self) -> Tensor:
        with torch.no_grad():
            for total, v in zip(self._totals, self._reader.variables):
                v.assign(total.read_value().to(v.value.device, v.value.dtype))
            return torch.as_tensor(self._reader.result()).float()

    def get_config(self) -> dict[str, Any]:
        raise NotImplementedError(f"{self!r}: a Keras metric is recorded by Keras's own config, not ours.")

    def __repr__(self) -> str:
        return f"KerasMetric({self.keras_metric!r})"


def metric(identifier: Any, loss_name: str | None) -> metrics_lib.Metric:
    """compile(metrics=[...]) for a Keras model: names as Keras means them (probabilities), a
    keras.metrics object computed by Keras (KerasMetric), anything else as for any module."""
    if _is_keras(identifier, "metric"):
        return KerasMetric(identifier() if isinstance(identifier, type) else identifier)
    try:
        return metrics_lib.get(identifier, loss_name=loss_name, from_logits=False)
    except ValueError:
        if not isinstance(identifier, str):
            raise
    keras = _keras()  # a name we do not have ("f1_score", "r2_score", ...): Keras's metric of that name
    try:
        found = keras.metrics.get(identifier)
    except ValueError as e:
        raise ValueError(f"compile(metrics=[{identifier!r}]): neither mirrored nor Keras knows this metric ({e}).") \
            from None
    if not isinstance(found, keras.metrics.Metric):
        found = keras.metrics.MeanMetricWrapper(found, name=identifier)
    return KerasMetric(found)


# ---- optimizers ----------------------------------------------------------------------------------------
class _KerasUpdate(torch.optim.Optimizer):
    """One replica's Keras optimizer behind torch's Optimizer interface: step() hands the (all-reduced)
    gradients to Keras's `apply`, so the update, clipping, weight decay, EMA, gradient accumulation
    and schedule are Keras's own. Its state_dict holds every Keras optimizer variable."""

    def __init__(self, keras_opt: Any, variables: list[Any], device: torch.device):
        params = [v.value for v in variables]
        super().__init__(params, {"lr": float(keras_opt.learning_rate)})
        self.keras_optimizer = keras_opt
        self._variables = variables
        self._device = device
        with device_scope(device):
            keras_opt.build(variables)

    # What Model.fit asks of mr.optimizers' optimizers: Keras accumulates itself, so every step all-reduces.
    def accumulate_gradients(self) -> bool:
        """True: every step's gradients are all-reduced; Keras's apply accumulates them if asked."""
        return True

    @property
    def gradient_accumulation_steps(self) -> int:
        return 1

    @property
    def iterations(self) -> int:
        return int(self.keras_optimizer.iterations)

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:
        if closure is not None:
            raise ValueError("step(closure): a Keras optimizer applies the gradients present; call step() alone.")
        grads = [p.grad for p in self.param_groups[0]["params"]]
        with device_scope(self._device):
            self.keras_optimizer.apply(grads, self._variables)
        self.param_groups[0]["lr"] = float(self.keras_optimizer.learning_rate)

    def finalize_variable_values(self) -> None:
        """With use_ema, writes the moving averages into the weights (Keras's, at the end of fit)."""
        with torch.no_grad(), device_scope(self._device):
            self.keras_optimizer.finalize_variable_values(self._variables)

    def state_dict(self) -> dict[str, Any]:
        state = super().state_dict()
        state["keras_optimizer"] = [v.value.detach().clone() for v in self.keras_optimizer.variables]
        return state

    def load_state_dict(self, state_dict: Any) -> None:
        state_dict = dict(state_dict)
        saved = state_dict.pop("keras_optimizer", None)
        super().load_state_dict(state_dict)
        if saved is None:
            return
        own = self.keras_optimizer.variables
        if not isinstance(saved, list) or len(saved) != len(own) or any(
                not isinstance(s, Tensor) or tuple(s.shape) != tuple(v.shape) for s, v in zip(saved, own)):
            raise ValueError(f"{self.keras_optimizer.name}.load_state_dict: the state holds "
                             f"{len(saved) if isinstance(saved, list) else saved!r:.40} Keras optimizer variables "
                             f"that do not match this optimizer's {len(own)}; it was saved from another optimizer "
                             "or model.")
        with torch.no_grad():
            for s, v in zip(saved, own):
                v.value.copy_(s.to(v.value.device, v.value.dtype))


class KerasOptimizer(optimizers_lib.Optimizer):
    """A keras.optimizers instance as a recipe: every replica gets `type(opt).from_config(config)`,
    built on that replica's copy of the Keras model, so the update is Keras's own on the all-reduced
    gradients (Keras's SGD momentum rule, Adam's epsilon placement, decoupled weight decay, clipping,
    EMA, gradient accumulation, schedules). learning_rate reads and sets every replica's."""

    def __init__(self, keras_opt: Any, replicas: Sequence[nn.Module]):
        keras = _keras()
        if isinstance(keras_opt, keras.optimizers.LossScaleOptimizer):
            raise ValueError("compile(optimizer=LossScaleOptimizer(...)): not supported; pass the inner optimizer "
                             "and compile(precision=\"fp16\") for a loss scale, or loss_scale_factor= on it.")
        if keras_opt.built and int(keras_opt.iterations) > 0:
            raise ValueError(f"compile(optimizer=<{type(keras_opt).__name__} that has taken "
                             f"{int(keras_opt.iterations)} steps>): its state belongs to another model's "
                             "variables. Pass a new optimizer (keras.optimizers.X(...) with the same settings).")
        if getattr(keras_opt, "_exclude_from_weight_decay", None) or getattr(
                keras_opt, "_exclude_from_weight_decay_pattern", None):
            raise ValueError(f"compile(optimizer={type(keras_opt).__name__}): exclude_from_weight_decay(...) was "
                             "called on it, which refers to the model's own variables and is not carried to the "
                             "replicas' copies. Set the weight decay per layer, or none.")
        self._keras_cls = type(keras_opt)
        self._keras_config = keras_opt.get_config()
        self._replicas = tuple(replicas)
        rate = keras_opt._learning_rate
        self._schedule = None if isinstance(rate, keras.Variable) else rate
        self._lr = float(keras_opt.learning_rate)
        self._kwargs: dict[str, Any] = {}
        self._torch_cls = _KerasUpdate
        self.name = keras_opt.name
        config = self._keras_config
        self.clipnorm, self.clipvalue = config.get("clipnorm"), config.get("clipvalue")
        self.global_clipnorm = config.get("global_clipnorm")
        self.gradient_accumulation_steps = None  # (Keras's apply accumulates; nothing for fit to do)
        self.keras_gradient_accumulation_steps = config.get("gradient_accumulation_steps")
        self.use_ema = bool(config.get("use_ema", False))
        self.ema_momentum, self.ema_overwrite_frequency = config.get("ema_momentum"), config.get(
            "ema_overwrite_frequency")
        self.loss_scale_factor = config.get("loss_scale_factor")
        self._built: list[weakref.ref] = []
        self._from_instance = None

    def build(self, params: Iterable[torch.nn.Parameter]) -> torch.optim.Optimizer:
        first = next(iter(params), None)
        replica = next((m for m in self._replicas if any(p is first for p in m.parameters())), None)
        if replica is None:
            raise ValueError(f"{self.name}: a Keras optimizer is built on a Keras model's variables; it was given "
                             "parameters of another module. Compile the mr.Model of that Keras model.")
        opt = self._keras_cls.from_config(dict(self._keras_config))
        opt.learning_rate = self._schedule if self._schedule is not None else self._lr
        device = first.device if first is not None else torch.device("cpu")
        built = _KerasUpdate(opt, list(replica.trainable_variables), device)
        self._built = [r for r in self._built if r() is not None] + [weakref.ref(built)]
        return built

    @property
    def learning_rate(self) -> float:
        live = self._live()
        return float(live[-1].keras_optimizer.learning_rate) if live else self._lr

    @learning_rate.setter
    def learning_rate(self, value: float) -> None:
        value = optimizers_lib.settable_rate(self.name, self._schedule, value)
        self._lr = value
        for opt in self._live():
            opt.keras_optimizer.learning_rate = value
            opt.param_groups[0]["lr"] = value

    @property
    def iterations(self) -> int:
        live = self._live()
        return live[-1].iterations if live else 0

    def finalize_variable_values(self) -> None:
        for opt in self._live():
            opt.finalize_variable_values()

    def get_config(self) -> dict[str, Any]:
        raise NotImplementedError(f"{self.name}: a Keras optimizer is recorded by Keras's own config, not ours.")

    def __repr__(self) -> str:
        return f"KerasOptimizer({self._keras_cls.__name__}, learning_rate={self._schedule or self._lr!r})"


def optimizer(identifier: Any, replicas: Sequence[nn.Module]) -> optimizers_lib.Optimizer:
    """compile(optimizer=...) for a Keras model: a name or keras.optimizers object becomes Keras's own
    optimizer on every replica (KerasOptimizer); an mr.optimizers or torch optimizer stays as it is."""
    keras = _keras()
    if isinstance(identifier, str):
        try:
            identifier = keras.optimizers.get(identifier)
        except ValueError as e:
            raise ValueError(f"compile(optimizer={identifier!r}): Keras does not know this optimizer ({e}).") from None
    if _is_keras(identifier, "optimizer"):
        return KerasOptimizer(identifier() if isinstance(identifier, type) else identifier, replicas)
    return optimizers_lib.get(identifier)


def refuse_keras_optimizer(identifier: Any, module: nn.Module) -> None:
    """A keras.optimizers object needs a Keras model's variables: refused for a plain torch module."""
    if _is_keras(identifier, "optimizer"):
        raise TypeError(f"compile(optimizer={type(identifier).__name__}(...)) on the torch module "
                        f"{type(module).__name__}: a Keras optimizer updates a Keras model's variables. Use "
                        f"mr.optimizers.{type(identifier).__name__} (the same options) for a torch module.")


def save_keras(model: Any, path: Any) -> None:
    """Keras's archive of `model` at `path` (".keras"), written to a temporary name and renamed, so a
    crash leaves the old file."""
    import os
    from pathlib import Path

    path = Path(path)
    tmp = path.with_name(f".{path.stem}.tmp-{os.getpid()}.keras")
    try:
        model.save(str(tmp))
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def load_keras(path: Any) -> Any:
    """The Keras model of a ".keras" archive, uncompiled (compile it through mr.Model)."""
    keras = _keras()
    if keras is None:
        raise ValueError(f"Model.load({str(path)!r}): a .keras archive is read by Keras; import keras first (with "
                         "KERAS_BACKEND=torch set before it).")
    return keras.models.load_model(path, compile=False)


# ---- Keras's own fit under our scope ----------------------------------------------------------------------
_WATCHED = False


def watch_keras_fit() -> None:
    """Once keras is imported and a strategy's scope is entered: Keras's model.compile in a scope
    marks the model, and Keras's own model.fit of a marked model (or inside a scope) warns once,
    at the user's line: it would train on one device."""
    global _WATCHED
    keras = _keras()
    if _WATCHED or keras is None or not md.has_strategy():
        return
    _WATCHED = True
    cls = keras.Model
    compile_, fit = cls.compile, cls.fit

    def compile(self: Any, *args: Any, **kwargs: Any) -> Any:
        if md.has_strategy() and md.get_strategy().num_replicas_in_sync > 1:
            self.__dict__["_mirrored_scope"] = md.get_strategy()
        return compile_(self, *args, **kwargs)

    def fitting(self: Any, *args: Any, **kwargs: Any) -> Any:
        strategy = self.__dict__.get("_mirrored_scope") or (md.get_strategy() if md.has_strategy() else None)
        if strategy is not None and not self.__dict__.get("_mirrored_warned"):
            self.__dict__["_mirrored_warned"] = True
            warnings.warn(f"{type(self).__name__}.fit (Keras's own) trains on one device: Keras does not know "
                          f"mirrored's {type(strategy).__name__} with {strategy.num_replicas_in_sync} replicas. "
                          "Wrap the model: model = mr.Model(keras_model) in strategy.scope(), then "
                          "model.compile(...) and model.fit(...).", UserWarning, stacklevel=2)
        return fit(self, *args, **kwargs)

    compile.__wrapped__ = compile_  # type: ignore[attr-defined]
    fitting.__wrapped__ = fit  # type: ignore[attr-defined]
    cls.compile, cls.fit = compile, fitting


md.register_scope_hook(watch_keras_fit)
md.register_scope_hook(_replica_seeds)  # keras.random.* in a loop whose model is not a Keras one
