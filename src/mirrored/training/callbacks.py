"""Keras callbacks for Model.fit/evaluate/predict: `model.fit(ds, callbacks=[EarlyStopping()])`.

Callback is the base whose hooks are no-ops; CallbackList dispatches one hook to every callback
and adds History and ProgbarLogger as Keras does. The rest follow Keras 3: ModelCheckpoint,
BackupAndRestore, EarlyStopping, ReduceLROnPlateau, LearningRateScheduler, TerminateOnNaN,
CSVLogger and TensorBoard. A callback sees the model through `self.model` (stop_training,
optimizer.learning_rate, save, save_weights, get_weights, set_weights) and the run through
`self.params` ({"epochs", "steps", "verbose"}). Batch logs may carry "num_examples", the global
batch size, for the progress bar's throughput; it is not a metric. Messages a callback prints
because its `verbose` asks for them go to stdout like the progress bar (as in Keras); everything
else goes through logging and warnings. The base class and shared helpers are in _callback.py,
ModelCheckpoint and BackupAndRestore in _checkpoint_callbacks.py, ProgbarLogger in _progbar.py,
TensorBoard in _tensorboard.py; all are re-exported here. Uses numpy and those modules.
"""
from __future__ import annotations

import csv
import inspect
import io
import logging
import math
import os
import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import numpy as np

from mirrored._files import append_whole, reporting_write_errors, write_atomically
from mirrored.training._callback import (
    NOT_METRICS, Callback, Logs, check_mode, improved, monitor_value, optimizer_of, resolve_mode, say,
    settable_learning_rate, writes_summaries)
from mirrored.training._checkpoint_callbacks import BackupAndRestore, ModelCheckpoint
from mirrored.training._progbar import ProgbarLogger
from mirrored.training._tensorboard import TensorBoard

logger = logging.getLogger(__name__)

__all__ = [
    "BackupAndRestore", "CSVLogger", "Callback", "CallbackList", "EarlyStopping", "History",
    "LearningRateScheduler", "ModelCheckpoint", "ProgbarLogger", "ReduceLROnPlateau", "TensorBoard",
    "TerminateOnNaN",
]

class CallbackList(Callback):
    """Calls each hook on every callback in order, passing all of them the same logs dict (so a
    callback may add keys, e.g. ReduceLROnPlateau's "learning_rate", for those after it).

    Adds a ProgbarLogger (add_progbar) and a History (add_history) after the user's callbacks
    unless the list already has one, as Keras does; `params` become every callback's params.
    """

    def __init__(self, callbacks: Iterable[Callback] | None = None, add_history: bool = False,
                 add_progbar: bool = False, model: Any = None, **params: Any):
        super().__init__()
        self.callbacks: list[Callback] = []
        for cb in callbacks or ():
            self.callbacks.extend(cb.callbacks if isinstance(cb, CallbackList) else [cb])
        for i, cb in enumerate(self.callbacks):
            if not isinstance(cb, Callback):
                raise TypeError(f"callbacks[{i}] is a {type(cb).__name__}, not a Callback. Pass "
                                f"instances of mr.callbacks classes, or subclass "
                                f"mr.callbacks.Callback.")
        if add_progbar and not any(isinstance(cb, ProgbarLogger) for cb in self.callbacks):
            self.callbacks.append(ProgbarLogger())
        if add_history and not any(isinstance(cb, History) for cb in self.callbacks):
            self.callbacks.append(History())
        if model is not None:
            self.set_model(model)
        if params:
            self.set_params(params)

    def append(self, callback: Callback) -> None:
        """Adds `callback` at the end of the list."""
        self.callbacks.append(callback)

    def __iter__(self) -> Iterator[Callback]:
        return iter(self.callbacks)

    def __len__(self) -> int:
        return len(self.callbacks)

    def set_params(self, params: Mapping[str, Any]) -> None:
        """Gives `params` (epochs, steps, verbose) to this list and every callback in it."""
        super().set_params(params)
        for cb in self.callbacks:
            cb.set_params(params)

    def set_model(self, model: Any) -> None:
        """Gives `model` to this list and every callback in it."""
        super().set_model(model)
        for cb in self.callbacks:
            cb.set_model(model)

    def _call(self, hook: str, *args: Any, logs: Logs | None) -> None:
        logs = {} if logs is None else logs
        for cb in self.callbacks:
            getattr(cb, hook)(*args, logs)

    def on_train_begin(self, logs: Logs | None = None) -> None:
        """Calls on_train_begin of every callback, in order."""
        self._call("on_train_begin", logs=logs)

    def on_train_end(self, logs: Logs | None = None) -> None:
        """Calls on_train_end of every callback, in order."""
        self._call("on_train_end", logs=logs)

    def on_epoch_begin(self, epoch: int, logs: Logs | None = None) -> None:
        """Calls on_epoch_begin of every callback, in order."""
        self._call("on_epoch_begin", epoch, logs=logs)

    def on_epoch_end(self, epoch: int, logs: Logs | None = None) -> None:
        """Calls on_epoch_end of every callback, in order."""
        self._call("on_epoch_end", epoch, logs=logs)

    def on_train_batch_begin(self, batch: int, logs: Logs | None = None) -> None:
        """Calls on_train_batch_begin of every callback, in order."""
        self._call("on_train_batch_begin", batch, logs=logs)

    def on_train_batch_end(self, batch: int, logs: Logs | None = None) -> None:
        """Calls on_train_batch_end of every callback, in order."""
        self._call("on_train_batch_end", batch, logs=logs)

    def on_test_begin(self, logs: Logs | None = None) -> None:
        """Calls on_test_begin of every callback, in order."""
        self._call("on_test_begin", logs=logs)

    def on_test_end(self, logs: Logs | None = None) -> None:
        """Calls on_test_end of every callback, in order."""
        self._call("on_test_end", logs=logs)

    def on_test_batch_begin(self, batch: int, logs: Logs | None = None) -> None:
        """Calls on_test_batch_begin of every callback, in order."""
        self._call("on_test_batch_begin", batch, logs=logs)

    def on_test_batch_end(self, batch: int, logs: Logs | None = None) -> None:
        """Calls on_test_batch_end of every callback, in order."""
        self._call("on_test_batch_end", batch, logs=logs)

    def on_predict_begin(self, logs: Logs | None = None) -> None:
        """Calls on_predict_begin of every callback, in order."""
        self._call("on_predict_begin", logs=logs)

    def on_predict_end(self, logs: Logs | None = None) -> None:
        """Calls on_predict_end of every callback, in order."""
        self._call("on_predict_end", logs=logs)

    def on_predict_batch_begin(self, batch: int, logs: Logs | None = None) -> None:
        """Calls on_predict_batch_begin of every callback, in order."""
        self._call("on_predict_batch_begin", batch, logs=logs)

    def on_predict_batch_end(self, batch: int, logs: Logs | None = None) -> None:
        """Calls on_predict_batch_end of every callback, in order."""
        self._call("on_predict_batch_end", batch, logs=logs)

    def __repr__(self) -> str:
        return f"CallbackList({self.callbacks!r})"


class History(Callback):
    """Records every epoch's logs: `history.history["loss"]` is a list, one entry per epoch.
    fit() returns it, and it is also `model.history`."""

    def __init__(self) -> None:
        super().__init__()
        self.history: dict[str, list[Any]] = {}
        self.epoch: list[int] = []

    def set_model(self, model: Any) -> None:
        """Makes this History `model.history`, as Keras does."""
        super().set_model(model)
        model.history = self

    def on_train_begin(self, logs: Logs | None = None) -> None:
        """Starts a new record of epochs (a reused History keeps its metrics' lists)."""
        self.epoch = []

    def on_epoch_end(self, epoch: int, logs: Logs | None = None) -> None:
        """Appends the epoch and each metric of `logs` to `history`."""
        self.epoch.append(epoch)
        for key, value in (logs or {}).items():
            if key not in NOT_METRICS:
                self.history.setdefault(key, []).append(value)
        if self.model is not None:
            self.model.history = self

    def __repr__(self) -> str:
        return f"History(epochs={len(self.epoch)}, keys={sorted(self.history)})"


# --------------------------------------------------------------------------------------------
# Controlling training


class EarlyStopping(Callback):
    """Stops fit() (model.stop_training = True) once `monitor` has not improved by more than
    `min_delta` for `patience` epochs, counting from `start_from_epoch`.

    With `baseline`, the wait is reset only by values that also beat the baseline. With
    restore_best_weights, the weights of the best epoch are put back when training ends.
    """

    def __init__(self, monitor: str = "val_loss", min_delta: float = 0.0, patience: int = 0,
                 verbose: int = 0, mode: str = "auto", baseline: float | None = None,
                 restore_best_weights: bool = False, start_from_epoch: int = 0):
        super().__init__()
        check_mode("EarlyStopping", mode)
        if isinstance(patience, bool) or not isinstance(patience, int) or patience < 0:
            raise ValueError(f"EarlyStopping(patience={patience!r}): give a number of epochs >= 0.")
        if start_from_epoch < 0:
            raise ValueError(f"EarlyStopping(start_from_epoch={start_from_epoch!r}): give an "
                             f"epoch index >= 0.")
        self.monitor = monitor
        self.min_delta = abs(min_delta)
        self.patience = patience
        self.verbose = verbose
        self.mode = mode
        self.baseline = baseline
        self.restore_best_weights = restore_best_weights
        self.start_from_epoch = start_from_epoch
        self._direction: str | None = None
        self._reset()

    def _reset(self) -> None:
        self.wait = 0
        self.stopped_epoch = 0
        self.best: float | None = None
        self.best_weights: Any = None
        self.best_epoch = 0

    def on_train_begin(self, logs: Logs | None = None) -> None:
        """Resets the wait, the best value and the best weights (an instance may serve several fits)."""
        self._reset()  # an instance may be reused by several fit() calls
        self._direction = resolve_mode("EarlyStopping", self.monitor, self.mode, self.model)

    def on_epoch_end(self, epoch: int, logs: Logs | None = None) -> None:
        """Compares the monitored value with the best; stops fit after `patience` epochs without improvement."""
        current = monitor_value(self, logs)
        if current is None or epoch < self.start_from_epoch:
            return
        if self._direction is None:
            self._direction = resolve_mode("EarlyStopping", self.monitor, self.mode, self.model)
        if self.restore_best_weights and self.best_weights is None:
            # The first epoch watched counts as the best until one beats it.
            self.best_weights, self.best_epoch = self.model.get_weights(), epoch
        self.wait += 1
        if improved(self._direction, current, self.best, self.min_delta):
            self.best, self.best_epoch = current, epoch
            if self.restore_best_weights:
                self.best_weights = self.model.get_weights()
            if self.baseline is None or improved(self._direction, current, self.baseline,
                                                 self.min_delta):
                self.wait = 0
            return
        if self.wait >= self.patience and epoch > 0:
            self.stopped_epoch = epoch
            self.model.stop_training = True

    def on_train_end(self, logs: Logs | None = None) -> None:
        """As Keras 3 does: the best weights come back when training ends, however it ends (this
        callback stopped it, another one did, or the epochs ran out)."""
        if self.stopped_epoch > 0 and self.verbose:
            say(f"Epoch {self.stopped_epoch + 1}: early stopping", model=self.model)
        if self.restore_best_weights and self.best_weights is not None:
            if self.verbose:
                say(f"Restoring the model weights from the end of the best epoch: {self.best_epoch + 1}.",
                    model=self.model)
            self.model.set_weights(self.best_weights)

    def __repr__(self) -> str:
        return (f"EarlyStopping(monitor={self.monitor!r}, patience={self.patience}, "
                f"min_delta={self.min_delta}, mode={self.mode!r})")


class ReduceLROnPlateau(Callback):
    """Multiplies the learning rate by `factor` once `monitor` has not improved by more than
    `min_delta` for `patience` epochs, then waits `cooldown` epochs; never below `min_lr`.
    Adds "learning_rate" to the epoch logs."""

    def __init__(self, monitor: str = "val_loss", factor: float = 0.1, patience: int = 10,
                 verbose: int = 0, mode: str = "auto", min_delta: float = 1e-4, cooldown: int = 0,
                 min_lr: float = 0.0):
        super().__init__()
        check_mode("ReduceLROnPlateau", mode)
        if not 0 < factor < 1:
            raise ValueError(f"ReduceLROnPlateau(factor={factor!r}): the factor multiplies the "
                             f"learning rate, so it must be in (0, 1), e.g. 0.1 or 0.5.")
        if patience < 0 or cooldown < 0 or min_lr < 0:
            raise ValueError(f"ReduceLROnPlateau(patience={patience!r}, cooldown={cooldown!r}, "
                             f"min_lr={min_lr!r}): these must be >= 0.")
        self.monitor = monitor
        self.factor = factor
        self.patience = patience
        self.verbose = verbose
        self.mode = mode
        self.min_delta = abs(min_delta)
        self.cooldown = cooldown
        self.min_lr = min_lr
        self._direction: str | None = None
        self._reset()

    def _reset(self) -> None:
        self.wait = 0
        self.cooldown_counter = 0
        self.best: float | None = None

    def on_train_begin(self, logs: Logs | None = None) -> None:
        """Resets the wait and cooldown; checks the optimizer's rate can be set."""
        self._reset()
        settable_learning_rate("ReduceLROnPlateau", self.model)
        self._direction = resolve_mode("ReduceLROnPlateau", self.monitor, self.mode, self.model)

    def on_epoch_end(self, epoch: int, logs: Logs | None = None) -> None:
        """Logs the rate; multiplies it by `factor` after `patience` epochs without improvement."""
        logs = {} if logs is None else logs
        optimizer = optimizer_of("ReduceLROnPlateau", self.model)
        logs["learning_rate"] = float(optimizer.learning_rate)
        current = monitor_value(self, logs)
        if current is None:
            return
        if self._direction is None:
            self._direction = resolve_mode("ReduceLROnPlateau", self.monitor, self.mode,
                                           self.model)
        if self.cooldown_counter > 0:
            self.cooldown_counter -= 1
            self.wait = 0
        if improved(self._direction, current, self.best, self.min_delta):
            self.best, self.wait = current, 0
            return
        if self.cooldown_counter > 0:
            return
        self.wait += 1
        if self.wait < self.patience:
            return
        old_lr = float(optimizer.learning_rate)
        if old_lr > self.min_lr:
            new_lr = max(old_lr * self.factor, self.min_lr)
            optimizer.learning_rate = new_lr
            if self.verbose:
                say(f"Epoch {epoch + 1}: ReduceLROnPlateau reducing learning rate to {new_lr}.", model=self.model)
            self.cooldown_counter, self.wait = self.cooldown, 0

    def __repr__(self) -> str:
        return (f"ReduceLROnPlateau(monitor={self.monitor!r}, factor={self.factor}, "
                f"patience={self.patience}, cooldown={self.cooldown}, min_lr={self.min_lr})")


class LearningRateScheduler(Callback):
    """Sets the learning rate at each epoch's start to schedule(epoch, current_lr) (or
    schedule(epoch) for a one-argument function); adds "learning_rate" to the epoch logs."""

    def __init__(self, schedule: Callable[..., float], verbose: int = 0):
        super().__init__()
        if not callable(schedule):
            raise TypeError(f"LearningRateScheduler(schedule={schedule!r}): give a function "
                            f"(epoch, lr) -> new lr, e.g. lambda epoch, lr: lr * 0.9.")
        self.schedule = schedule
        self.verbose = verbose
        self._takes_lr = _accepts_two_args(schedule)

    def on_train_begin(self, logs: Logs | None = None) -> None:
        """Checks that the optimizer's rate can be set (not a schedule of mr.optimizers)."""
        settable_learning_rate("LearningRateScheduler", self.model)

    def on_epoch_begin(self, epoch: int, logs: Logs | None = None) -> None:
        """Sets every replica's rate to schedule(epoch) (or schedule(epoch, rate))."""
        optimizer = optimizer_of("LearningRateScheduler", self.model)
        current = float(optimizer.learning_rate)
        lr = self.schedule(epoch, current) if self._takes_lr else self.schedule(epoch)
        if isinstance(lr, bool) or not isinstance(lr, (int, float, np.floating, np.integer)) \
                or not math.isfinite(lr):
            raise ValueError(f"LearningRateScheduler: schedule({epoch}) returned {lr!r}; it "
                             f"must return a finite float learning rate.")
        optimizer.learning_rate = float(lr)
        if self.verbose:
            say(f"Epoch {epoch + 1}: LearningRateScheduler setting learning rate to {float(lr)}.", model=self.model)

    def on_epoch_end(self, epoch: int, logs: Logs | None = None) -> None:
        """Adds the epoch's rate to `logs` as "learning_rate"."""
        if logs is not None:
            logs["learning_rate"] = float(optimizer_of("LearningRateScheduler",
                                                       self.model).learning_rate)

    def __repr__(self) -> str:
        return f"LearningRateScheduler({self.schedule!r})"


def _accepts_two_args(fn: Callable[..., Any]) -> bool:
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):  # some builtins have no signature: use the Keras 2 form
        return True
    positional = [p for p in params
                  if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    return len(positional) >= 2 or any(p.kind == p.VAR_POSITIONAL for p in params)


class TerminateOnNaN(Callback):
    """Stops fit() after a training step whose loss is NaN or infinite. With raise_error=True (Keras
    3's option) it raises RuntimeError at once instead, so no callback's on_train_end runs: a
    BackupAndRestore backup is kept rather than deleted as after a finished fit."""

    def __init__(self, raise_error: bool = False):
        super().__init__()
        self.raise_error = raise_error

    def on_train_batch_end(self, batch: int, logs: Logs | None = None) -> None:
        """Stops fit (or raises, with raise_error=True) when the batch's loss is not finite."""
        loss = (logs or {}).get("loss")
        if loss is not None and not math.isfinite(float(loss)):
            if self.raise_error:
                raise RuntimeError(f"TerminateOnNaN: the loss is {float(loss)} at batch {batch}.")
            logger.warning("TerminateOnNaN: batch %d: the loss is %s; stopping training.",
                           batch, float(loss))
            self.model.stop_training = True


# --------------------------------------------------------------------------------------------
# Logging


class CSVLogger(Callback):
    """Writes one row per epoch to a CSV file: "epoch" then the log keys, sorted.

    With append=True an existing file is continued under its own header. Otherwise fit() starts the
    file anew - unless it starts past epoch 0 (BackupAndRestore resumed it, or initial_epoch): then the
    rows of the epochs before its first are kept and later ones, which it runs again, dropped, so a
    restarted run leaves one row per epoch. Under a multi-worker strategy only the chief writes.
    """

    def __init__(self, filename: str | os.PathLike, separator: str = ",", append: bool = False):
        super().__init__()
        if len(separator) != 1:
            raise ValueError(f"CSVLogger(separator={separator!r}): give one character, e.g. ',' "
                             f"or '\\t'.")
        self.filename = os.fspath(filename)
        self.sep = separator
        self.append = append
        self.keys: list[str] | None = None
        self._dropped: set[str] = set()
        self._opened = False

    def on_train_begin(self, logs: Logs | None = None) -> None:
        """Creates the file's directory; the file is opened at the first epoch, once fit knows where it
        starts (BackupAndRestore restores in its own on_train_begin, before or after this one)."""
        self.keys, self._dropped, self._opened = None, set(), False
        if not writes_summaries(self.model):
            return
        directory = os.path.dirname(self.filename)
        if directory:
            with reporting_write_errors(self.filename, repr(self), "Nothing was written."):
                os.makedirs(directory, exist_ok=True)

    def on_epoch_begin(self, epoch: int, logs: Logs | None = None) -> None:
        """At fit()'s first epoch: continues the file (append=True, or a run resumed past epoch 0,
        keeping the rows before `epoch`) or starts it anew."""
        if self._opened or not writes_summaries(self.model):
            return
        self._opened = True
        header, rows = self._read()
        if header is not None and (self.append or epoch > 0):
            self.keys = header[1:]
            if not self.append:
                kept = [row for row in rows if row and _epoch_of(row) is not None and _epoch_of(row) < epoch]
                if len(kept) < len(rows):
                    write_atomically(self.filename, repr(self),
                                     lambda tmp: _write_rows(tmp, [header, *kept], self.sep))
            return
        # The file is opened per row, so an interrupted run leaves no open handle behind.
        with reporting_write_errors(self.filename, repr(self), "Nothing was written."):
            open(self.filename, "w").close()

    def _read(self) -> tuple[list[str] | None, list[list[str]]]:
        if not os.path.exists(self.filename):
            return None, []
        with open(self.filename, newline="", encoding="utf-8") as f:
            lines = list(csv.reader(f, delimiter=self.sep))
        if not lines or not lines[0] or lines[0][0] != "epoch":
            return None, []
        return lines[0], lines[1:]

    def on_epoch_end(self, epoch: int, logs: Logs | None = None) -> None:
        """Writes the epoch's row of metrics."""
        if not writes_summaries(self.model):
            return
        if not self._opened:  # (a caller that skipped on_epoch_begin)
            self.on_epoch_begin(epoch)
        logs = {k: v for k, v in (logs or {}).items() if k not in NOT_METRICS}
        rows = []
        if self.keys is None:
            self.keys = sorted(logs)
            # As Keras does: when validation runs only every few epochs (validation_freq), the
            # first epoch has no val_ keys, so reserve their columns in the header.
            if self.keys and not any(k.startswith("val_") for k in self.keys):
                self.keys += [f"val_{k}" for k in self.keys if k != "learning_rate"]
            rows.append(["epoch", *self.keys])
        new = set(logs) - set(self.keys) - self._dropped
        if new:
            self._dropped |= new
            warnings.warn(f"CSVLogger({self.filename!r}): keys {sorted(new)} are not columns of "
                          f"the header written at the first epoch, so they are not logged.",
                          stacklevel=2)
        rows.append([epoch, *(_csv_value(logs.get(k, "NA")) for k in self.keys)])
        text = io.StringIO(newline="")
        csv.writer(text, delimiter=self.sep).writerows(rows)
        append_whole(self.filename, text.getvalue().encode(), repr(self),
                     "The rows written before are intact, and no part of this epoch's row was left.")

    def __repr__(self) -> str:
        return f"CSVLogger({self.filename!r}, append={self.append})"


def _epoch_of(row: list[str]) -> int | None:
    try:
        return int(row[0])
    except ValueError:
        return None


def _write_rows(path: str, rows: list[list[str]], sep: str) -> None:
    with open(path, "w", newline="", encoding="utf-8") as f:
        csv.writer(f, delimiter=sep).writerows(rows)


def _csv_value(value: Any) -> Any:
    if isinstance(value, np.ndarray) and value.ndim == 0:
        return value.item()
    if isinstance(value, (list, tuple, np.ndarray)):
        return "[" + ", ".join(str(v) for v in value) + "]"
    return value




# --------------------------------------------------------------------------------------------
# torch.optim.lr_scheduler in fit


class TorchLRScheduler(Callback):
    """Steps a torch.optim.lr_scheduler scheduler in fit() as a plain PyTorch loop does: after every
    epoch (step_per="epoch": StepLR, CosineAnnealingLR, ...), or after every batch ("batch":
    OneCycleLR); ReduceLROnPlateau steps at each epoch's end with logs[monitor].

    Give a scheduler built on model.mirrored_optimizer (after compile), or a function optimizer ->
    scheduler, which is called with it: TorchLRScheduler(lambda opt: StepLR(opt, step_size=30)), or
    one built on the torch optimizer instance given to compile(), as a PyTorch script builds it: when
    fit starts it is moved onto model.mirrored_optimizer, with what it set on the instance, and drives
    it from then on (the instance keeps its last settings). The scheduler sets every replica's rate.
    A Keras schedule as the optimizer's learning_rate sets the rate itself: the pair is refused. Its state is saved with the optimizer's (Model.save,
    BackupAndRestore); list this callback before BackupAndRestore and ModelCheckpoint, so that what
    they save at an epoch's or a batch's end holds the step taken there. Before each epoch the
    scheduler's last rate is set again, which a resumed fit needs. Adds "learning_rate" to the epoch
    logs (the rate the epoch ran with), as Keras's callbacks do.
    """

    def __init__(self, scheduler: Any, step_per: str = "epoch", monitor: str = "val_loss", verbose: int = 0):
        super().__init__()
        import torch

        plateau = isinstance(scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau)
        if not (isinstance(scheduler, torch.optim.lr_scheduler.LRScheduler) or callable(scheduler)):
            raise TypeError(f"TorchLRScheduler(scheduler={scheduler!r}): give a torch.optim.lr_scheduler scheduler "
                            "built on model.mirrored_optimizer, or a function optimizer -> scheduler, e.g. "
                            "lambda opt: torch.optim.lr_scheduler.StepLR(opt, step_size=30).")
        if step_per not in ("epoch", "batch"):
            raise ValueError(f"TorchLRScheduler(step_per={step_per!r}): use \"epoch\" (StepLR, CosineAnnealingLR) "
                             "or \"batch\" (OneCycleLR, whose total_steps counts batches).")
        if plateau and step_per == "batch":
            raise ValueError("TorchLRScheduler(ReduceLROnPlateau, step_per=\"batch\"): ReduceLROnPlateau steps with "
                             "an epoch's monitored value; use step_per=\"epoch\".")
        self.scheduler = scheduler if isinstance(scheduler, torch.optim.lr_scheduler.LRScheduler) else None
        self._make = None if self.scheduler is not None else scheduler
        self.step_per = step_per
        self.monitor = monitor
        self.verbose = verbose

    def set_model(self, model: Any) -> None:
        """Builds the scheduler on the model's mirrored optimizer (if compiled) and attaches it, so it is saved."""
        super().set_model(model)
        optimizer = getattr(model, "mirrored_optimizer", None)
        # (Compiled: fit() needs it; predict() does not.) With a Keras schedule nothing is touched here:
        # on_train_begin refuses the pair.
        if optimizer is not None and getattr(getattr(model, "optimizer", None), "_schedule", None) is None:
            self._attach(optimizer)

    def _attach(self, optimizer: Any) -> None:
        from mirrored.training import optimizers

        if self.scheduler is None:
            self.scheduler = self._make(optimizer)
        target = getattr(self.scheduler, "optimizer", None)
        if target is not optimizer:
            instance = optimizers.from_instance(getattr(self.model, "optimizer", None))
            if instance is None or target is None or target is not instance.source:
                raise ValueError(f"TorchLRScheduler: the scheduler {type(self.scheduler).__name__} drives "
                                 f"{target!r}, not this model's optimizer, so it would change nothing. Build it on "
                                 "model.mirrored_optimizer after compile(), or pass a function: "
                                 "TorchLRScheduler(lambda opt: StepLR(opt, step_size=30)).")
            # Built on the instance given to compile(), which compile() copied into the replicas' optimizers.
            instance.move_scheduler(self.scheduler, optimizer)
        optimizer.attach_lr_scheduler(self.scheduler)  # its state is saved with the optimizer's

    def on_train_begin(self, logs: Logs | None = None) -> None:
        """Checks there is an optimizer to schedule, whose rate no Keras schedule sets."""
        settable_learning_rate("TorchLRScheduler", self.model)
        if self.scheduler is None or getattr(self.model, "mirrored_optimizer", None) is None:
            raise RuntimeError("TorchLRScheduler: the model has no optimizer to schedule; call "
                               "model.compile(optimizer=...) before fit().")

    def on_epoch_begin(self, epoch: int, logs: Logs | None = None) -> None:
        """Sets every replica's rate to the scheduler's (a resumed fit follows the schedule)."""
        # A resumed fit set the optimizer's rate from its own records: the schedule's rate wins.
        for group, lr in zip(self.model.mirrored_optimizer.param_groups, self.scheduler.get_last_lr()):
            group["lr"] = lr

    def on_train_batch_end(self, batch: int, logs: Logs | None = None) -> None:
        """Steps the scheduler after every batch, with step_per="batch"."""
        if self.step_per == "batch":
            self.scheduler.step()

    def on_epoch_end(self, epoch: int, logs: Logs | None = None) -> None:
        """Steps the scheduler (ReduceLROnPlateau with the monitored value) and logs the epoch's rate."""
        import torch

        before = self._rate()
        if isinstance(self.scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau):
            value = monitor_value(self, logs)
            if value is not None:
                self.scheduler.step(value)
        elif self.step_per == "epoch":
            self.scheduler.step()
        if self.verbose and self._rate() != before:
            say(f"Epoch {epoch + 1}: TorchLRScheduler setting learning rate to {self._rate()}.", model=self.model)
        if logs is not None:
            logs["learning_rate"] = before  # the rate this epoch ran with, as Keras logs it

    def _rate(self) -> float:
        return float(self.scheduler.get_last_lr()[0])

    def __repr__(self) -> str:
        return f"TorchLRScheduler({type(self.scheduler).__name__ if self.scheduler else self._make!r}, " \
               f"step_per={self.step_per!r})"


__all__.append("TorchLRScheduler")
