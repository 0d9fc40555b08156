"""ProgbarLogger, the callback that prints progress, and Progbar, the line it prints.

Progbar tracks one epoch (or one evaluation): steps done, examples seen and time, and renders
"12/40 [====>.........] - ETA: 3s - loss: 0.4123 - accuracy: 0.8125 - 512 img/s". On a terminal
it redraws one line with \\r; in a log file it writes whole lines only, at the end and optionally
every `interval_s` seconds, so captured output holds no \\r noise. Uses _callback.py.
"""
from __future__ import annotations

import math
import sys
import time
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from mirrored.training._callback import EXAMPLE_COUNT_KEYS, NOT_METRICS, Callback, Logs, writes_summaries


_BAR_WIDTH = 30
_REDRAW_S = 0.1  # a terminal redraw per step would cost more than small steps themselves


def is_interactive() -> bool:
    """True when stdout is a terminal (or a Jupyter kernel), where \\r redraws a line."""
    if "ipykernel" in sys.modules:
        return True
    isatty = getattr(sys.stdout, "isatty", None)
    try:
        return bool(isatty and isatty())
    except ValueError:  # a closed stream
        return False


def format_value(value: Any) -> str:
    """A metric value as Keras shows it: 4 decimals, or scientific notation for tiny numbers; a metric with
    one value per class (an array) by its mean, as Keras's progress bar shows it."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        try:
            value = float(value)
        except (TypeError, ValueError):
            try:
                value = float(np.mean(np.asarray(value, dtype=np.float64)))
            except (TypeError, ValueError):
                return str(value)
    if math.isnan(value) or math.isinf(value):
        return str(float(value))
    if value == 0 or abs(value) >= 1e-3:
        return f"{value:.4f}"
    return f"{value:.4e}"


def format_duration(seconds: float) -> str:
    """ETA as 1:02:03, 2:03 or 7s."""
    seconds = max(int(round(seconds)), 0)
    if seconds >= 3600:
        return f"{seconds // 3600}:{seconds % 3600 // 60:02d}:{seconds % 60:02d}"
    if seconds >= 60:
        return f"{seconds // 60}:{seconds % 60:02d}"
    return f"{seconds}s"


def format_step_time(seconds: float) -> str:
    """Time per step as 1.2s/step, 75ms/step or 310us/step."""
    if seconds >= 1:
        return f"{seconds:.1f}s/step"
    if seconds >= 1e-3:
        return f"{seconds * 1e3:.0f}ms/step"
    return f"{seconds * 1e6:.0f}us/step"


def format_metrics(logs: Mapping[str, Any]) -> str:
    """" - loss: 0.4123 - accuracy: 0.8125" for every metric key of `logs`."""
    return "".join(f" - {k}: {format_value(v)}" for k, v in logs.items() if k not in NOT_METRICS)


class Progbar:
    """The progress of one epoch or evaluation over `target` steps (None: unknown)."""

    def __init__(self, target: int | None, *, dynamic: bool, interval_s: float | None,
                 unit: str = "img", clock: Callable[[], float] = time.monotonic):
        self.target = target
        self.dynamic = dynamic
        self.interval_s = interval_s
        self.unit = unit
        self.clock = clock
        self.seen = 0
        self.examples = 0
        self._start = clock()
        self._last_draw = -math.inf if dynamic else self._start
        self._drawn_width = 0  # characters of the line on screen, so a shorter one blanks the rest

    def update(self, step: int, logs: Mapping[str, Any]) -> None:
        """Records that `step` steps are done; redraws (terminal) or prints a line if it is time."""
        self.seen = step
        for key in EXAMPLE_COUNT_KEYS:
            if logs.get(key) is not None:
                self.examples += int(logs[key])
                break
        now = self.clock()
        if self.dynamic:
            if now - self._last_draw >= _REDRAW_S:
                self._draw(self._progress_line(now, logs))
                self._last_draw = now
        elif self.interval_s is not None and now - self._last_draw >= self.interval_s:
            write(self._progress_line(now, logs) + "\n")
            self._last_draw = now

    def finish(self, logs: Mapping[str, Any]) -> None:
        """Prints the final line of the epoch: steps, time, time per step, every log, throughput."""
        elapsed = self.clock() - self._start
        steps = f"{self.seen}/{self.target if self.target is not None else self.seen}"
        line = steps + (f" {self._bar()}" if self.dynamic else "")
        line += f" - {format_duration(elapsed)}"
        if self.seen:
            line += f" {format_step_time(elapsed / self.seen)}"
        line += format_metrics(logs) + self._throughput(elapsed)
        if self.dynamic:
            self._draw(line)
            write("\n")
        else:
            write(line + "\n")
        self._drawn_width = 0

    def _progress_line(self, now: float, logs: Mapping[str, Any]) -> str:
        elapsed = now - self._start
        if self.target is None:
            line = f"{self.seen}/Unknown - {format_duration(elapsed)}"
        else:
            width = len(str(self.target))
            line = f"{self.seen:>{width}}/{self.target}"
            if self.dynamic:
                line += f" {self._bar()}"
            if self.seen:
                eta = elapsed / self.seen * max(self.target - self.seen, 0)
                line += f" - ETA: {format_duration(eta)}"
        return line + format_metrics(logs) + self._throughput(elapsed)

    def _bar(self) -> str:
        if self.target is None or self.target <= 0:
            return ""
        filled = min(_BAR_WIDTH * self.seen // self.target, _BAR_WIDTH)
        head = ">" if 0 < filled < _BAR_WIDTH else ""
        return "[" + "=" * (filled - len(head)) + head + "." * (_BAR_WIDTH - filled) + "]"

    def _throughput(self, elapsed: float) -> str:
        if not self.examples or elapsed <= 0:
            return ""
        rate = self.examples / elapsed
        return f" - {rate:.0f} {self.unit}/s" if rate >= 10 else f" - {rate:.1f} {self.unit}/s"

    def _draw(self, line: str) -> None:
        pad = " " * max(self._drawn_width - len(line), 0)
        write("\r" + line + pad)
        self._drawn_width = len(line)


def write(text: str) -> None:
    """Writes to stdout and flushes; sys.stdout is looked up each time, so redirection applies."""
    sys.stdout.write(text)
    sys.stdout.flush()


class ProgbarLogger(Callback):
    """Prints "Epoch 1/5" and a progress line per epoch: on a terminal a bar redrawn in place,
    "12/40 [====>....] - ETA: 3s - loss: 0.4123 - accuracy: 0.8125 - 512 img/s"; elsewhere (a
    log file, CI) whole lines only: one per epoch plus one every `interval_s` seconds (None: none).

    params["verbose"]: 0 silent, 1 as above, 2 one line per epoch even on a terminal. The
    throughput counts the "num_examples" (or Keras's "size") of each batch's logs, named `unit`.
    """

    def __init__(self, interval_s: float | None = 60.0, unit: str = "img"):
        super().__init__()
        if interval_s is not None and not interval_s > 0:
            raise ValueError(f"ProgbarLogger(interval_s={interval_s!r}): give a positive number "
                             f"of seconds, or None for one line per epoch.")
        self.interval_s = interval_s
        self.unit = unit
        self._bar: Progbar | None = None
        self._in_fit = False
        self._clock: Callable[[], float] = time.monotonic  # a test may script time here

    @property
    def verbose(self) -> int:
        """params["verbose"] as a level: 0 silent, 1 bar or timed lines ("auto" is 1), 2 one line per epoch;
        0 on a worker other than the chief, so N workers print one progress, not N."""
        if not writes_summaries(self.model):
            return 0
        verbose = self.params.get("verbose", 1)
        return 1 if verbose == "auto" else int(verbose or 0)

    def _start(self, target: int | None) -> None:
        dynamic = self.verbose == 1 and is_interactive()
        interval = self.interval_s if self.verbose == 1 else None
        self._bar = Progbar(target, dynamic=dynamic, interval_s=interval, unit=self.unit,
                            clock=self._clock)

    def _update(self, batch: int, logs: Logs | None) -> None:
        if self.verbose and self._bar is not None:
            self._bar.update(batch + 1, logs or {})

    def _finish(self, logs: Logs | None) -> None:
        if self.verbose and self._bar is not None:
            self._bar.finish(logs or {})
        self._bar = None

    def on_train_begin(self, logs: Logs | None = None) -> None:
        """Notes that fit() runs, so its validation passes print no bar of their own (their val_ keys
        end the epoch line)."""
        self._in_fit = True

    def on_train_end(self, logs: Logs | None = None) -> None:
        """fit() is over: a later evaluate() prints its own progress again."""
        self._in_fit = False

    def on_epoch_begin(self, epoch: int, logs: Logs | None = None) -> None:
        """Prints "Epoch 3/5" (when there is more than one epoch) and starts the epoch's progress over
        params["steps"] steps (None: unknown)."""
        epochs = self.params.get("epochs", 1)
        if self.verbose and epochs and epochs > 1:
            write(f"Epoch {epoch + 1}/{epochs}\n")
        self._start(self.params.get("steps"))

    def on_train_batch_end(self, batch: int, logs: Logs | None = None) -> None:
        """Advances the bar to batch + 1 with the batch's logs (loss, metrics, num_examples)."""
        self._update(batch, logs)

    def on_epoch_end(self, epoch: int, logs: Logs | None = None) -> None:
        """Prints the epoch's final line: steps, time, time per step, `logs` (val_ keys included), throughput."""
        self._finish(logs)

    # Evaluation inside fit() is summed up by the val_ keys of the epoch line, as in Keras.
    def on_test_begin(self, logs: Logs | None = None) -> None:
        """Starts evaluate()'s progress (not inside fit(), whose validation the epoch line sums up)."""
        if not self._in_fit:
            self._start(self.params.get("steps"))

    def on_test_batch_end(self, batch: int, logs: Logs | None = None) -> None:
        """Advances evaluate()'s progress with the batch's logs (not inside fit())."""
        if not self._in_fit:
            self._update(batch, logs)

    def on_test_end(self, logs: Logs | None = None) -> None:
        """Prints evaluate()'s final line with its results in `logs` (not inside fit())."""
        if not self._in_fit:
            self._finish(logs)

    def on_predict_begin(self, logs: Logs | None = None) -> None:
        """Starts predict()'s progress over params["steps"] steps."""
        self._start(self.params.get("steps"))

    def on_predict_batch_end(self, batch: int, logs: Logs | None = None) -> None:
        """Advances predict()'s progress; the batch's "outputs" in `logs` are not printed."""
        self._update(batch, {k: v for k, v in (logs or {}).items() if k != "outputs"})

    def on_predict_end(self, logs: Logs | None = None) -> None:
        """Prints predict()'s final line: steps, time and throughput (no metrics)."""
        self._finish({})

    def __repr__(self) -> str:
        return f"ProgbarLogger(interval_s={self.interval_s!r})"
