"""The loops of `mr.Model`: fit, evaluate, predict and the *_on_batch calls, on the caller's thread.

Each step takes a global batch, splits it into one part per replica and runs the model's step on every
replica in strategy.run (steps.py); a subclass that overrides a step gets a plain run, a default step one
the strategy may re-run (RunOptions(rerunnable=True)). fit's epochs and place in the data are an
EpochIterator (epochs.py), which BackupAndRestore saves and restores.
"""
from __future__ import annotations


import contextlib
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np
import torch
from torch import Tensor

import mirrored.distribute as md
from mirrored.training import compile_utils, jit, optimizers
from mirrored.training import callbacks as callbacks_lib, data_adapter, epochs as epochs_lib
from mirrored.training.data_adapter import unpack_x_y_sample_weight
from mirrored.training.steps import _Logs, _Steps


class _Loops:
    """fit, evaluate, predict and the *_on_batch calls; mixed into Model (model.py)."""

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
        own = type(self).train_step is _Steps.train_step and self._own_steps is None
        optimizer = getattr(self._mopt, "optimizer", None)
        ema_without_meeting = _averages_weights(optimizer) and getattr(
            getattr(optimizer, "_options", None), "accumulation_steps", 1) > 1
        return md.RunOptions(rerunnable=own and group == 1 and not ema_without_meeting)

    def _step_options(self, kind: str) -> md.RunOptions:
        """How evaluate's and predict's strategy.run calls may run ("test", "predict"): this class's own
        step notes what it changes, so it may be rolled back and run again; yours, or a Keras model's
        own, may do anything and is not."""
        own = getattr(type(self), f"{kind}_step") is getattr(_Steps, f"{kind}_step") and self._own_steps is None
        return md.RunOptions(rerunnable=own)

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
        options = self._step_options("test")
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
        options = self._step_options("test")
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
        options = self._step_options("predict")
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


def _reads_batch_logs(cbs: Any) -> bool:
    """Whether a callback has its own on_train_batch_end (or on_batch_end), which reads each step's logs.
    Without one, fit reads the metrics once per epoch, as tf.keras converts a step's logs to numbers
    only for callbacks with batch hooks."""
    base = callbacks_lib.Callback
    return any(hook in getattr(cb, "__dict__", {}) or getattr(type(cb), hook) is not getattr(base, hook)
               for cb in cbs for hook in ("on_train_batch_end", "on_batch_end"))


def _averages_weights(optimizer: Any) -> bool:
    """Whether `optimizer` keeps a moving average of the weights (use_ema), which it may write into them
    in a step that only accumulates gradients."""
    return bool(getattr(getattr(optimizer, "_options", None), "use_ema", False))


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
