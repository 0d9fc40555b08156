"""Keras's own model.fit / evaluate / predict on every replica, for a Keras model created or compiled in
a strategy's scope, as tf.keras's are under tf.distribute.

Keras's loop, data adapters, callbacks, progress bar and History stay Keras's; what is replaced is the
step function Keras calls per batch (make_train_function / make_test_function / make_predict_function):
it splits each GLOBAL batch over the replicas and runs the model's own train_step / test_step /
predict_step on every replica's copy (KerasReplicas, _replicas.py). A Keras optimizer's apply inside
a replica step all-reduces the gradients first (weighted by each replica's rows), an unweighted Mean
of one number per step counts the replica's share of the global batch, an mr.data.Dataset is taken as
Keras's data, and under a multi-worker strategy only the chief writes model.save / save_weights.
The strategy is the one whose scope the model was created or compiled in (TF captures it so), else
the scope at the call; one replica is Keras's own path, unchanged. patches() lists what install()
replaces. Uses _replicas.py, _mirroring.py, mirrored.distribute, mirrored.data and keras.
"""
from __future__ import annotations

import logging
import weakref
from typing import Any

from torch import Tensor, nn

import mirrored.distribute as md
from mirrored.data import INFINITE_CARDINALITY, UNKNOWN_CARDINALITY, Dataset
from mirrored.training.keras_adapter import _replicas
from mirrored.training.keras_adapter._mirroring import RECORD
from mirrored.training.keras_adapter._replicas import KerasReplicas, no_grad_unless, with_metrics

logger = logging.getLogger(__name__)


# A distributed model's compiled optimizer -> its replicas: what finalize_variable_values (use_ema) writes into
# replica 0's weights after fit reaches the other copies at once.
_AVERAGED: "weakref.WeakKeyDictionary[Any, weakref.ref]" = weakref.WeakKeyDictionary()


class _Record:
    """What a Keras model's __dict__ holds for us (never copied to a replica): the strategy whose scope
    it was created or compiled in (the model keeps it, as a tf.keras model's variables keep theirs:
    `with mr.MirroredStrategy().scope():` holds it nowhere else), and the model's replicas."""

    __slots__ = ("strategy", "replicas")

    def __init__(self) -> None:
        self.strategy: Any = None
        self.replicas: KerasReplicas | None = None

    def __deepcopy__(self, memo: dict) -> None:
        return None  # (a copy of the model, another replica's or the user's own, is not distributed by it)


def record_of(model: nn.Module, create: bool = False) -> _Record | None:
    rec = model.__dict__.get(RECORD)
    if rec is None and create:
        rec = _Record()
        object.__setattr__(model, RECORD, rec)  # (past Keras's attribute tracking and torch's)
    return rec


def _scope_strategy() -> Any:
    """The strategy of the scope this thread is in, outside its replica functions; None elsewhere."""
    if not md.has_strategy() or md.get_replica_context() is not None:
        return None
    return md.get_strategy()


def _is_copy(model: nn.Module) -> bool:
    """Whether `model` is another replica's copy (not replica 0's, the user's)."""
    mirror = md.mirror_holding(model)
    return mirror is not None and mirror.replicas[0] is not model and any(c is model for c in mirror.replicas)


def _note_strategy(model: nn.Module) -> None:
    """Records the scope's strategy on a model created or compiled in it (several replicas only)."""
    strategy = _scope_strategy()
    if strategy is None or strategy.num_replicas_in_sync < 2 or _is_copy(model):
        return
    rec = record_of(model, create=True)
    if rec.strategy is not None and rec.strategy is not strategy and rec.replicas is not None:
        raise ValueError(f"{type(model).__name__}.compile in the scope of {strategy!r}: the model is distributed by "
                         f"{rec.strategy!r} already. Build and compile a model in one strategy's scope.")
    rec.strategy = strategy


def distributing(model: nn.Module) -> Any:
    """The strategy `model`'s own fit distributes over (several replicas), or None: Keras's own path."""
    rec = record_of(model)
    recorded = rec.strategy if rec is not None else None
    current = _scope_strategy()
    if recorded is not None and current is not None and current is not recorded and current.num_replicas_in_sync > 1:
        raise ValueError(f"{type(model).__name__}: created or compiled in the scope of {recorded!r}, but its fit, "
                         f"evaluate or predict runs in the scope of {current!r}. Use one strategy for a model.")
    strategy = recorded or current
    if strategy is None or strategy.num_replicas_in_sync < 2:
        return None
    return strategy


def _refuse(model: nn.Module, strategy: Any) -> None:
    """What Keras does on one device that its steps on replicas cannot: refused before the first step."""
    import keras

    name = type(model).__name__
    if getattr(model, "jit_compile", False) is True:
        raise ValueError(f"{name}.compile(jit_compile=True) under {type(strategy).__name__}: Keras would torch.compile "
                         "a step function that runs the replicas. Use jit_compile=False or \"auto\" (eager, Keras's "
                         "default on torch).")
    if keras.distribution.distribution() is not None:
        raise ValueError(f"{name}.fit under {type(strategy).__name__} with a keras.distribution in effect: the two "
                         "distribute the same model two ways. Use one: leave keras.distribution unset.")
    stateful = [layer.name for layer in model._flatten_layers(include_self=True, recursive=True)
                if getattr(layer, "stateful", False) is True]
    if stateful:
        raise ValueError(f"{name}: layer(s) {', '.join(stateful)} have stateful=True, whose state has one row per "
                         "example of the GLOBAL batch, while each replica runs on its part of it. Use stateful=False "
                         "under the strategy (or train on one device).")
    mirror = md.mirror_holding(model)
    rec = record_of(model)
    if mirror is not None and (rec is None or rec.replicas is None or rec.replicas.mirror is not mirror):
        raise ValueError(f"{name}.fit (Keras's own) under {type(strategy).__name__}: the model is mirrored already "
                         "(by mr.Model or strategy.mirror), and that mirror's copies are the ones its steps must run "
                         "on. Train it through what mirrored it (mr.Model's fit), or call Keras's own fit on a model "
                         "that nothing mirrored.")


def replicas_for(model: nn.Module, strategy: Any) -> KerasReplicas:
    """The model's KerasReplicas under `strategy` (made at its first step: the copies come then)."""
    rec = record_of(model, create=True)
    if rec.replicas is None or rec.replicas.strategy is not strategy:
        rec.replicas = KerasReplicas(model, strategy)
    return rec.replicas


def _rerunnable(model: nn.Module, kind: str) -> bool:
    """Keras's own steps change nothing but what the replica step notes before its update, so a step
    may be rolled back and run again (then without the replica random mode while it draws nothing);
    a step of your own may do anything, and runs with the mode."""
    import keras

    cls = type(model)
    return all(getattr(cls, name) is getattr(keras.Model, name)
               for name in (f"{kind}_step", "compute_loss", "compute_metrics"))


def _weight_rule(model: nn.Module, kind: str) -> Any:
    """How a replica's gradients weigh in the all-reduce: its rows, averaged (a mean loss over its part
    gives one device's update); for Keras's own train_step of a loss compiled with reduction="sum",
    1 each, summed (the parts' sums add up to one device's)."""
    sums = kind == "train" and _rerunnable(model, "train") and _compiled_reduction(model) == "sum"

    def weight(copy_: nn.Module, rows: int) -> tuple[float, bool]:
        del copy_
        if sums:
            return (1.0 if rows else 0.0), False
        return float(rows), True
    return weight


def _compiled_reduction(model: nn.Module) -> str | None:
    """"sum" where every compiled loss sums, None otherwise; a mix of sums and means is refused."""
    compiled = getattr(model, "_compile_loss", None)  # (built by then: Keras's fit builds it before the first step)
    entries = [entry for entry in getattr(compiled, "_flat_losses", None) or [] if entry is not None]
    reductions = {getattr(getattr(entry, "loss", entry), "reduction", None) for entry in entries}
    if reductions == {"sum"}:
        return "sum"
    if "sum" in reductions:
        raise ValueError(f"{type(model).__name__}.compile: some outputs' losses have reduction=\"sum\" and others "
                         "average, so no one weighting of the replicas' gradients gives one device's. Use one kind "
                         "of reduction for every output.")
    return None


def step_function(model: nn.Module, reps: KerasReplicas, kind: str) -> Any:
    """What Keras's loop calls per batch (data is a list of one batch): the step on every replica."""
    strategy = reps.strategy
    options = md.RunOptions(rerunnable=_rerunnable(model, kind))
    weight = _weight_rule(model, kind)

    def one_step_on_data(data: Any) -> Any:
        reps.prepare()
        reps.sync_from_first()
        part, rows, size = reps.split(data[0])
        with no_grad_unless(kind):
            out = strategy.run(reps.replica_step, args=(kind, part, rows, size, weight), options=options)
        reps.take_snapshot()
        if kind == "predict":
            return strategy.gather(out, axis=0)
        logs, of_metrics = strategy.experimental_local_results(out)[0]
        return with_metrics(model, logs, of_metrics)

    one_step_on_data._mirrored = reps  # type: ignore[attr-defined]
    return one_step_on_data


class DatasetAdapter:
    """An mr.data.Dataset as Keras's data: its batches as they come (the GLOBAL batches), its
    cardinality as the number of batches. Built as a subclass of Keras's DataAdapter (patches())."""

    def __init__(self, dataset: Dataset):
        self._dataset = dataset

    def get_torch_dataloader(self) -> Any:
        return self._dataset

    def get_numpy_iterator(self) -> Any:
        return iter(self._dataset)

    @property
    def num_batches(self) -> int | None:
        n = self._dataset.cardinality()
        return None if n in (INFINITE_CARDINALITY, UNKNOWN_CARDINALITY) else int(n)

    @property
    def batch_size(self) -> int | None:
        return None

    @property
    def has_partial_batch(self) -> bool | None:
        return None

    @property
    def partial_batch_size(self) -> int | None:
        return None


def patches() -> list[tuple[Any, str, Any]]:
    """(owner, attribute, replacement) for what Keras's own fit needs on replicas: the trainer's
    __init__ and compile (note the scope's strategy), its three make_*_function methods and train()
    (Keras sets the torch mode of the model it has; the copies follow), the three
    optimizers' apply (the gradient all-reduce), finalize_variable_values (use_ema's averages written
    after fit reach every copy), Mean.update_state (a replica's share), the data
    adapter lookup (mr.data), and Model.save / save_weights and BackupAndRestore's saves and cleanup (the
    chief writes)."""
    import keras
    from keras.src.backend.torch.trainer import TorchTrainer
    from keras.src.metrics.reduction_metrics import Mean
    from keras.src.optimizers.base_optimizer import BaseOptimizer
    from keras.src.optimizers.loss_scale_optimizer import LossScaleOptimizer
    from keras.src.optimizers.multi_optimizer import MultiOptimizer
    from keras.src.trainers import data_adapters
    from keras.src.trainers.data_adapters.data_adapter import DataAdapter

    found: list[tuple[Any, str, Any]] = []

    def wrap(owner: Any, name: str, make: Any) -> None:
        original = getattr(owner, name)
        replacement = make(original)
        replacement.__wrapped__ = original
        replacement.__doc__ = original.__doc__
        found.append((owner, name, replacement))

    def init(original: Any) -> Any:
        def __init__(self: Any) -> None:
            original(self)
            _note_strategy(self)
        return __init__

    def compile_(original: Any) -> Any:
        def compile(self: Any, *args: Any, **kwargs: Any) -> Any:
            _note_strategy(self)
            result = original(self, *args, **kwargs)
            rec = record_of(self)
            if rec is not None and rec.replicas is not None:
                rec.replicas.stale = True  # (the copies are made again from the recompiled model)
            return result
        return compile

    def make(kind: str) -> Any:
        def maker(original: Any) -> Any:
            def make_function(self: Any, force: bool = False) -> Any:
                strategy = distributing(self)
                if strategy is None:
                    return original(self, force)
                attribute = f"{kind}_function"
                current = getattr(self, attribute)
                reps = replicas_for(self, strategy)
                # (each fit, evaluate or predict: the workers compare their first batch, as each pass of a
                # distributed dataset does)
                reps.compare_next = strategy.num_workers > 1
                if current is not None and not force and getattr(current, "_mirrored", None) is reps:
                    return current
                original(self, True)  # (Keras's own checks: steps_per_execution)
                _refuse(self, strategy)
                if force:
                    reps.stale = True  # (Keras: after a change of trainable flags)
                setattr(self, attribute, step_function(self, reps, kind))
                if getattr(self, "optimizer", None) is not None:
                    _AVERAGED[self.optimizer] = weakref.ref(reps)  # (the model holds its replicas)
                return getattr(self, attribute)
            return make_function
        return maker

    def train_(original: Any) -> Any:
        def train(self: Any, mode: bool = True) -> Any:
            result = original(self, mode)
            rec = record_of(self)
            if rec is not None and rec.replicas is not None and rec.replicas.mirror is not None:
                for copy_ in rec.replicas.replicas[1:]:  # (Keras's fit sets the mode of the model it has)
                    original(copy_, mode)
            return result
        return train

    def apply_(original: Any) -> Any:
        def apply(self: Any, grads: Any, trainable_variables: Any = None) -> Any:
            step = _replicas.current()
            if step is None or step.applying or (trainable_variables is None and not self.built):
                return original(self, grads, trainable_variables)
            grads = list(grads)
            variables = list(trainable_variables if trainable_variables is not None else self._trainable_variables)
            grads = step.reduce(self, grads, variables)
            step.applying = True
            try:
                return original(self, grads, variables if trainable_variables is not None else None)
            finally:
                step.applying = False
                step.after_apply(variables)
        return apply

    def finalize(original: Any) -> Any:
        def finalize_variable_values(self: Any, var_list: Any) -> Any:
            result = original(self, var_list)
            ref = _AVERAGED.get(self)
            reps = ref() if ref is not None else None
            if reps is not None and _replicas.current() is None:
                reps.sync_from_first()  # (Keras writes the moving averages into replica 0's weights after fit)
            return result
        return finalize_variable_values

    def mean_update(original: Any) -> Any:
        def update_state(self: Any, values: Any, sample_weight: Any = None) -> Any:
            step = _replicas.current()
            if step is not None and sample_weight is None and _is_scalar(values):
                # One number per step (a train_step's own loss tracker): on one device it counts once per
                # batch; here every replica adds its part's value, counted as its share of the batch.
                sample_weight = step.share
            return original(self, values, sample_weight)
        return update_state

    def adapter_lookup(original: Any) -> Any:
        def get_data_adapter(x: Any, y: Any = None, sample_weight: Any = None, *args: Any, **kwargs: Any) -> Any:
            if isinstance(x, Dataset):
                if y is not None or sample_weight is not None:
                    raise ValueError("fit(x=<mr.data.Dataset>, y=...): a dataset yields its own labels (and sample "
                                     "weights); pass them in its elements, as (x, y) or (x, y, sample_weight).")
                return _KerasDatasetAdapter(x)
            return original(x, y, sample_weight, *args, **kwargs)
        return get_data_adapter

    def chief_writes(what: str) -> Any:
        def maker(original: Any) -> Any:
            def write(self: Any, filepath: Any, *args: Any, **kwargs: Any) -> Any:
                if not _writes_files(self):
                    # TF's other workers write to a temporary path and delete it; the chief's file is everyone's.
                    logger.debug("%s.%s(%s): not the chief worker, so nothing is written here", type(self).__name__,
                                 what, filepath)
                    return None
                return original(self, filepath, *args, **kwargs)
            return write
        return maker

    def chief_keeps_backup(what: str) -> Any:
        """BackupAndRestore's saves and its deletion at the end: the chief's alone. Every worker copying,
        writing and deleting one shared directory raced (one worker's rmtree under another's copy)."""
        def maker(original: Any) -> Any:
            def run(self: Any, *args: Any, **kwargs: Any) -> Any:
                model = getattr(self, "model", None)
                if model is not None and not _writes_files(model):
                    logger.debug("BackupAndRestore.%s: not the chief worker, which keeps the backup", what)
                    return None
                return original(self, *args, **kwargs)
            return run
        return maker

    _KerasDatasetAdapter = type("DatasetAdapter", (DatasetAdapter, DataAdapter), {})
    wrap(TorchTrainer, "__init__", init)
    wrap(keras.Model, "compile", compile_)
    for kind in ("train", "test", "predict"):
        wrap(TorchTrainer, f"make_{kind}_function", make(kind))
    wrap(keras.Model, "train", train_)
    for cls in (BaseOptimizer, LossScaleOptimizer, MultiOptimizer):
        wrap(cls, "apply", apply_)
    wrap(BaseOptimizer, "finalize_variable_values", finalize)
    wrap(Mean, "update_state", mean_update)
    # (epoch_iterator.py looks get_data_adapter up in its module at each call)
    wrap(data_adapters, "get_data_adapter", adapter_lookup)
    wrap(keras.Model, "save", chief_writes("save"))
    wrap(keras.Model, "save_weights", chief_writes("save_weights"))
    wrap(keras.callbacks.BackupAndRestore, "_save_model", chief_keeps_backup("_save_model"))
    wrap(keras.callbacks.BackupAndRestore, "on_train_end", chief_keeps_backup("on_train_end"))
    return found


def _writes_files(model: Any) -> bool:
    """False on a worker other than the chief of the multi-worker strategy `model` was built or compiled
    in: its files are the chief's (the workers' copies are equal)."""
    rec = record_of(model)
    strategy = rec.strategy if rec is not None else None
    return strategy is None or strategy.num_workers == 1 or bool(strategy.extended.should_checkpoint)


def _is_scalar(values: Any) -> bool:
    if isinstance(values, Tensor):
        return values.dim() == 0
    if isinstance(values, (int, float)) and not isinstance(values, bool):
        return True
    return getattr(values, "shape", None) == ()

