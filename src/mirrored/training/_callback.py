"""The Callback base class and the helpers shared by callbacks that watch one log key.

Callback's hooks are no-ops whose docstrings say what `logs` holds. resolve_mode() decides whether a
monitored key should go down ("min") or up ("max"), improved() compares with min_delta,
monitor_value() reads the key and warns once when it is missing, StepCounter counts steps for
save_freq=N, and say() prints what a callback's `verbose` asks for. Uses the standard library.
"""
from __future__ import annotations

import sys
import warnings
from collections.abc import Mapping
from typing import Any

Logs = dict[str, Any]

# Keys the training loop adds to batch logs for the progress bar's throughput, not metrics.
EXAMPLE_COUNT_KEYS = ("num_examples", "size")
NOT_METRICS = frozenset(EXAMPLE_COUNT_KEYS) | {"batch"}

# mode="auto": which way a monitored quantity should move, judged from its name (val_ removed).
# Losses and errors first, so "accuracy_loss" counts as a loss.
_LOWER_IS_BETTER = ("loss", "error", "mae", "mse", "mape", "msle", "crossentropy", "hinge",
                    "divergence", "poisson", "logcosh")
_HIGHER_IS_BETTER = ("acc", "auc", "precision", "recall", "f1", "fbeta", "iou", "r2",
                     "fmeasure")


class Callback:
    """Base class of callbacks: every hook is a no-op; override the ones you need."""

    def __init__(self) -> None:
        self.model: Any = None
        self.params: dict[str, Any] = {}

    def set_params(self, params: Mapping[str, Any]) -> None:
        """Receives the run's parameters: {"epochs", "steps", "verbose"}."""
        self.params = dict(params)

    def set_model(self, model: Any) -> None:
        """Receives the Model being trained, evaluated or used to predict."""
        self.model = model

    def on_train_begin(self, logs: Logs | None = None) -> None:
        """Start of fit(); logs is empty."""

    def on_train_end(self, logs: Logs | None = None) -> None:
        """End of fit(); logs holds the last epoch's logs."""

    def on_epoch_begin(self, epoch: int, logs: Logs | None = None) -> None:
        """Start of epoch `epoch` (0-based); logs is empty."""

    def on_epoch_end(self, epoch: int, logs: Logs | None = None) -> None:
        """End of epoch `epoch`; logs holds the epoch's metrics, e.g. {"loss", "accuracy",
        "val_loss", "val_accuracy"} (val_ keys only on epochs that ran validation)."""

    def on_batch_begin(self, batch: int, logs: Logs | None = None) -> None:
        """Keras 2 alias of on_train_batch_begin, which calls it by default."""

    def on_batch_end(self, batch: int, logs: Logs | None = None) -> None:
        """Keras 2 alias of on_train_batch_end, which calls it by default."""

    def on_train_batch_begin(self, batch: int, logs: Logs | None = None) -> None:
        """Before training step `batch` (index within the epoch); logs is empty."""
        self.on_batch_begin(batch, logs)

    def on_train_batch_end(self, batch: int, logs: Logs | None = None) -> None:
        """After training step `batch`; logs holds the running epoch metrics (e.g. {"loss",
        "accuracy"}) and "num_examples", the examples in the step's global batch."""
        self.on_batch_end(batch, logs)

    def on_test_begin(self, logs: Logs | None = None) -> None:
        """Start of evaluate(); logs is empty."""

    def on_test_end(self, logs: Logs | None = None) -> None:
        """End of evaluate(); logs holds the final metrics, e.g. {"loss", "accuracy"}."""

    def on_test_batch_begin(self, batch: int, logs: Logs | None = None) -> None:
        """Before evaluation step `batch`; logs is empty."""

    def on_test_batch_end(self, batch: int, logs: Logs | None = None) -> None:
        """After evaluation step `batch`; logs holds the running metrics."""

    def on_predict_begin(self, logs: Logs | None = None) -> None:
        """Start of predict(); logs is empty."""

    def on_predict_end(self, logs: Logs | None = None) -> None:
        """End of predict(); logs is empty."""

    def on_predict_batch_begin(self, batch: int, logs: Logs | None = None) -> None:
        """Before prediction step `batch`; logs is empty."""

    def on_predict_batch_end(self, batch: int, logs: Logs | None = None) -> None:
        """After prediction step `batch`; logs may hold "outputs" for the batch."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"





def say(message: str, model: Any = None) -> None:
    """Output a callback's `verbose` asked for: printed like the progress bar (as in Keras), since
    the user asked to see it; all else goes through logging. Given the model, only by the chief of a
    multi-worker run (writes_summaries), so N workers print it once."""
    if model is not None and not writes_summaries(model):
        return
    sys.stdout.write(message + "\n")
    sys.stdout.flush()


def writes_summaries(model: Any) -> bool:
    """Whether this process writes logs (progress, CSV rows, TensorBoard events): under a multi-worker
    strategy only the chief (TF's should_save_summary). TF's other workers write to temporary directories
    and delete them, so the chief's files are what is left; here they skip writing (none of these writes
    takes part in a collective), which leaves the same files without the detour."""
    extended = getattr(getattr(model, "distribute_strategy", None), "extended", None)
    return bool(getattr(extended, "should_save_summary", True))


def writes_checkpoints(model: Any) -> bool:
    """Whether this process writes checkpoints and saved models: the chief only (TF's should_checkpoint)."""
    extended = getattr(getattr(model, "distribute_strategy", None), "extended", None)
    return bool(getattr(extended, "should_checkpoint", True))


def check_mode(where: str, mode: str) -> None:
    if mode not in ("auto", "min", "max"):
        raise ValueError(f"{where}(mode={mode!r}): mode is 'auto', 'min' or 'max'.")


def resolve_mode(where: str, monitor: str, mode: str, model: Any) -> str:
    """'min' or 'max': `mode` itself, or for 'auto' the direction `monitor` should move in."""
    if mode != "auto":
        return mode
    name = monitor.removeprefix("val_")
    for metric in getattr(model, "metrics", None) or ():
        direction = getattr(metric, "direction", getattr(metric, "_direction", None))
        if getattr(metric, "name", None) == name and direction in ("up", "down"):
            return "max" if direction == "up" else "min"
    lowered = name.lower()
    if any(part in lowered for part in _LOWER_IS_BETTER):
        return "min"
    if any(part in lowered for part in _HIGHER_IS_BETTER):
        return "max"
    raise ValueError(f"{where}(monitor={monitor!r}, mode='auto'): cannot tell from the name "
                     f"whether {monitor!r} should go up or down. Pass mode='max' (accuracy-like "
                     f"metrics) or mode='min' (losses and errors).")


def improved(mode: str, current: float, reference: float | None, min_delta: float) -> bool:
    """Whether `current` beats `reference` by more than min_delta (>= 0) in direction `mode`."""
    if reference is None:
        return True
    if mode == "min":
        return current + min_delta < reference
    return current - min_delta > reference


def monitor_value(callback: Any, logs: Logs | None) -> float | None:
    """logs[callback.monitor] as a float, or None with one warning per callback that it is
    missing (naming the keys there are)."""
    value = (logs or {}).get(callback.monitor)
    if value is not None:
        try:
            return float(value)
        except (TypeError, ValueError):
            raise ValueError(f"{type(callback).__name__}: monitor={callback.monitor!r} is {value!r:.80}, not one "
                             "number (a metric with one value per class, such as F1Score(average=None), which the "
                             "\"f1_score\" name makes). Monitor one number: compile the metric with "
                             "average=\"macro\" (R2Score: class_aggregation=\"uniform_average\"), or monitor "
                             "another key.") from None
    if not getattr(callback, "_warned_missing", False):
        callback._warned_missing = True
        keys = ", ".join(k for k in (logs or {}) if k not in NOT_METRICS) or "none"
        hint = (" val_ keys exist only when fit() is given validation_data=."
                if callback.monitor.startswith("val_") else "")
        warnings.warn(f"{type(callback).__name__}: monitor={callback.monitor!r} is not in the "
                      f"logs (available: {keys}), so it is skipped.{hint} Monitor one of the "
                      f"available keys.", stacklevel=3)
    return None


def check_save_freq(where: str, save_freq: Any) -> None:
    if save_freq != "epoch" and (isinstance(save_freq, bool) or not isinstance(save_freq, int)
                                 or save_freq <= 0):
        raise ValueError(f"{where}(save_freq={save_freq!r}): save_freq is 'epoch' or a positive "
                         f"number of training steps.")


class StepCounter:
    """Counts training steps across epochs from batch indices (which may jump by more than one
    when steps are grouped, and restart each epoch) and says every `every` steps."""

    def __init__(self, every: int, last_batch: int = -1):
        self.every = every
        self.last_batch = last_batch
        self.since = 0

    def due(self, batch: int) -> bool:
        self.since += batch + 1 if batch <= self.last_batch else batch - self.last_batch
        self.last_batch = batch
        if self.since >= self.every:
            self.since = 0
            return True
        return False


def optimizer_of(where: str, model: Any) -> Any:
    optimizer = getattr(model, "optimizer", None)
    if optimizer is None or not hasattr(optimizer, "learning_rate"):
        raise RuntimeError(f"{where}: the model has no optimizer with a learning_rate; call "
                           f"model.compile(optimizer=...) before fit().")
    return optimizer


def settable_learning_rate(where: str, model: Any) -> Any:
    """The model's optimizer, if callbacks may set its rate; a TypeError now, before training, when a
    schedule sets it (Keras refuses too, but only when the callback first sets it)."""
    optimizer = optimizer_of(where, model)
    schedule = getattr(optimizer, "_schedule", None)
    if schedule is not None:
        raise TypeError(f"{where}: the optimizer's learning_rate is the schedule {schedule!r}, which sets the rate "
                        f"every step, so {where} cannot set it (Keras refuses too). Use one of them: compile with a "
                        "float learning_rate for the callback, or drop the callback and keep the schedule.")
    return optimizer
