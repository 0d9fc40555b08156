"""Tests for mirrored.training.callbacks, Keras-style: hooks called with scripted logs against a
DummyModel, no training."""
from __future__ import annotations

import csv
import io
import logging
import math
import os
import struct
import sys
import warnings
from pathlib import Path
from types import SimpleNamespace

import crc32c
import numpy as np
import pytest
import torch

from mirrored.training import callbacks as cb_lib
from mirrored.training.callbacks import (
    BackupAndRestore, Callback, CallbackList, CSVLogger, EarlyStopping, History,
    LearningRateScheduler, ModelCheckpoint, ProgbarLogger, ReduceLROnPlateau, TensorBoard,
    TerminateOnNaN)
from mirrored.training.checkpoint import save_checkpoint


class DummyOptimizer:
    def __init__(self, learning_rate: float = 0.1):
        self.learning_rate = learning_rate


class DummyModel:
    """Records what callbacks ask of a Model."""

    def __init__(self) -> None:
        self.stop_training = False
        self.optimizer = DummyOptimizer()
        self.weights = [np.zeros(2)]
        self.calls: list[tuple] = []
        self.history = None

    def get_weights(self):
        return [w.copy() for w in self.weights]

    def set_weights(self, weights):
        self.calls.append(("set_weights", [w.copy() for w in weights]))
        self.weights = [w.copy() for w in weights]

    def save(self, path):
        self.calls.append(("save", str(path)))
        Path(path).write_text("model")

    def save_weights(self, path):
        self.calls.append(("save_weights", str(path)))
        Path(path).write_text("weights")


def _begin(callback: Callback, model: DummyModel | None = None, **params) -> DummyModel:
    model = model or DummyModel()
    callback.set_model(model)
    callback.set_params({"epochs": 10, "steps": None, "verbose": 0, **params})
    callback.on_train_begin({})
    return model


def _run_epochs(callback: Callback, values, key: str = "val_loss", model: DummyModel | None = None,
                extra: dict | None = None) -> tuple[DummyModel, int | None]:
    """on_epoch_end over scripted values of `key`; returns the model and the epoch that stopped."""
    model = _begin(callback, model)
    for epoch, value in enumerate(values):
        model.weights = [np.full(2, float(epoch))]  # "training" this epoch produced these weights
        callback.on_epoch_begin(epoch, {})
        callback.on_epoch_end(epoch, {key: value, **(extra or {})})
        if model.stop_training:
            callback.on_train_end({})
            return model, epoch
    callback.on_train_end({})
    return model, None


# --------------------------------------------------------------------------------------------
# EarlyStopping


def test_early_stopping_waits_patience_epochs_without_improvement():
    _, stopped = _run_epochs(EarlyStopping(patience=2), [0.9, 0.8, 0.85, 0.84, 0.83, 0.1])
    assert stopped == 3  # epochs 2 and 3 did not beat 0.8


def test_early_stopping_patience_0_stops_at_first_non_improvement_but_never_at_epoch_0():
    _, stopped = _run_epochs(EarlyStopping(patience=0), [0.5, 0.4, 0.45])
    assert stopped == 2
    _, stopped = _run_epochs(EarlyStopping(patience=0), [0.5])
    assert stopped is None


def test_early_stopping_min_delta_ignores_small_improvements():
    losses = [1.0, 0.95, 0.92, 0.90, 0.5]
    _, stopped = _run_epochs(EarlyStopping(patience=2, min_delta=0.1), losses)
    assert stopped == 2
    _, stopped = _run_epochs(EarlyStopping(patience=2, min_delta=0.01), losses)
    assert stopped is None
    _, stopped = _run_epochs(EarlyStopping(patience=2, min_delta=-0.1), losses)  # sign ignored
    assert stopped == 2


def test_early_stopping_mode_auto_maximizes_accuracy():
    rising = [0.5, 0.6, 0.7, 0.8]
    _, stopped = _run_epochs(EarlyStopping("val_accuracy", patience=1), rising, key="val_accuracy")
    assert stopped is None
    _, stopped = _run_epochs(EarlyStopping("val_accuracy", patience=1), [0.8, 0.7, 0.6], key="val_accuracy")
    assert stopped == 1
    _, stopped = _run_epochs(EarlyStopping("val_loss", patience=1, mode="max"), rising)
    assert stopped is None


def test_early_stopping_baseline_resets_wait_only_when_beaten():
    below = [0.4, 0.5, 0.55, 0.5]  # improving, but never past the 0.6 baseline
    _, stopped = _run_epochs(EarlyStopping("acc", patience=2, baseline=0.6), below, key="acc")
    assert stopped == 3  # the first epoch without improvement stops: the wait never reset
    _, stopped = _run_epochs(EarlyStopping("acc", patience=2), below, key="acc")
    assert stopped is None
    _, stopped = _run_epochs(EarlyStopping("acc", patience=2, baseline=0.6), [0.7, 0.65, 0.66, 0.9],
                             key="acc")
    assert stopped == 2


def test_early_stopping_restores_the_best_weights():
    es = EarlyStopping(patience=2, restore_best_weights=True)
    model, stopped = _run_epochs(es, [1.0, 0.5, 0.7, 0.8, 0.1])
    assert stopped == 3 and es.best_epoch == 1 and es.best == 0.5
    np.testing.assert_array_equal(model.weights[0], np.full(2, 1.0))  # epoch 1's weights
    assert [c[0] for c in model.calls] == ["set_weights"]


def test_early_stopping_restores_the_best_weights_when_training_ends_without_it():
    """Keras 3.15 (measured): restore_best_weights puts the best epoch's weights back in
    on_train_end, also when the epochs ran out or another callback stopped training."""
    es = EarlyStopping(patience=5, restore_best_weights=True)
    model, stopped = _run_epochs(es, [1.0, 0.5, 0.7, 0.8])
    assert stopped is None and es.best_epoch == 1
    np.testing.assert_array_equal(model.weights[0], np.full(2, 1.0))  # epoch 1's, not the last epoch's 3.0


def test_early_stopping_without_restore_keeps_the_last_weights():
    model, stopped = _run_epochs(EarlyStopping(patience=1), [1.0, 1.5])
    assert stopped == 1 and model.calls == []
    np.testing.assert_array_equal(model.weights[0], np.full(2, 1.0))


def test_early_stopping_start_from_epoch_ignores_the_first_epochs():
    worsening = [1.0, 2.0, 3.0, 4.0, 5.0, 6.0]
    _, stopped = _run_epochs(EarlyStopping(patience=1, start_from_epoch=3), worsening)
    assert stopped == 4  # epoch 3 is the first watched, epoch 4 the first without improvement
    _, stopped = _run_epochs(EarlyStopping(patience=1), worsening)
    assert stopped == 1


def test_early_stopping_instance_is_reusable():
    es = EarlyStopping(patience=1)
    _run_epochs(es, [1.0, 2.0])
    _, stopped = _run_epochs(es, [5.0, 4.0, 3.0])
    assert stopped is None and es.best == 3.0


def test_missing_monitor_warns_once_naming_the_available_keys():
    es = EarlyStopping(patience=0)
    with pytest.warns(UserWarning) as record:
        model, stopped = _run_epochs(es, [1.0, 2.0, 3.0], key="loss", extra={"accuracy": 0.5})
    assert len(record) == 1
    message = str(record[0].message)
    assert "monitor='val_loss'" in message and "available: loss, accuracy" in message
    assert "validation_data" in message
    assert stopped is None


def test_auto_mode_with_an_unknown_metric_asks_for_mode():
    with pytest.raises(ValueError, match=r"monitor='val_my_score'.*mode='max'"):
        _begin(EarlyStopping("val_my_score"))
    _begin(EarlyStopping("val_my_score", mode="max"))  # explicit mode is fine


def test_auto_mode_uses_a_metric_direction_attribute_when_there_is_one():
    class Score:
        name, direction = "my_score", "up"

    model = DummyModel()
    model.metrics = [Score()]
    _, stopped = _run_epochs(EarlyStopping("val_my_score", patience=1), [0.1, 0.2, 0.3], key="val_my_score",
                             model=model)
    assert stopped is None


@pytest.mark.parametrize("kwargs, match", [
    ({"mode": "maximize"}, "mode is 'auto', 'min' or 'max'"),
    ({"patience": -1}, "patience=-1"),
    ({"start_from_epoch": -2}, "start_from_epoch=-2"),
])
def test_early_stopping_rejects_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        EarlyStopping(**kwargs)


# --------------------------------------------------------------------------------------------
# ReduceLROnPlateau and LearningRateScheduler


def _lrs(callback: Callback, losses, lr: float = 1.0) -> list[float]:
    model = DummyModel()
    model.optimizer.learning_rate = lr
    _begin(callback, model)
    out = []
    for epoch, loss in enumerate(losses):
        logs = {"val_loss": loss}
        callback.on_epoch_end(epoch, logs)
        assert logs["learning_rate"] == pytest.approx(out[-1] if out else lr)  # the rate it ran with
        out.append(model.optimizer.learning_rate)
    return out


def test_reduce_lr_after_patience_epochs_on_a_plateau():
    assert _lrs(ReduceLROnPlateau(factor=0.5, patience=2), [1.0, 1.0, 1.0, 1.0, 1.0]) == \
        [1.0, 1.0, 0.5, 0.5, 0.25]


def test_reduce_lr_cooldown_skips_epochs_after_a_reduction():
    lrs = _lrs(ReduceLROnPlateau(factor=0.5, patience=1, cooldown=2), [1.0] * 7)
    assert lrs == [1.0, 0.5, 0.5, 0.25, 0.25, 0.125, 0.125]


def test_reduce_lr_improvement_resets_the_wait():
    lrs = _lrs(ReduceLROnPlateau(factor=0.5, patience=2), [1.0, 1.0, 0.5, 0.5, 0.2, 0.2, 0.2])
    assert lrs == [1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 0.5]


def test_reduce_lr_min_delta_and_min_lr():
    lrs = _lrs(ReduceLROnPlateau(factor=0.1, patience=1, min_delta=0.1, min_lr=0.05),
               [1.0, 0.95, 0.9, 0.85, 0.8])
    assert lrs == [1.0, 0.1, 0.05, 0.05, 0.05]  # 0.01 would be below min_lr


def test_reduce_lr_mode_max_for_accuracy():
    rlr = ReduceLROnPlateau("val_accuracy", factor=0.5, patience=1)
    model = _begin(rlr)
    for epoch, acc in enumerate([0.5, 0.6, 0.7]):
        rlr.on_epoch_end(epoch, {"val_accuracy": acc})
    assert model.optimizer.learning_rate == 0.1


def test_reduce_lr_rejects_bad_arguments_and_models_without_optimizer():
    with pytest.raises(ValueError, match=r"factor=1\.5.*\(0, 1\)"):
        ReduceLROnPlateau(factor=1.5)
    rlr = ReduceLROnPlateau()
    model = DummyModel()
    model.optimizer = None
    with pytest.raises(RuntimeError, match="compile"):  # at the start of fit, not after the first epoch
        _begin(rlr, model)


def test_learning_rate_scheduler_two_and_one_argument_schedules():
    sched = LearningRateScheduler(lambda epoch, lr: lr * 0.5)
    model = _begin(sched)
    for epoch in range(3):
        sched.on_epoch_begin(epoch)
    assert model.optimizer.learning_rate == pytest.approx(0.0125)

    sched = LearningRateScheduler(lambda epoch: 0.1 / (epoch + 1))
    model = _begin(sched)
    sched.on_epoch_begin(3)
    logs = {"loss": 1.0}
    sched.on_epoch_end(3, logs)
    assert model.optimizer.learning_rate == pytest.approx(0.025) and logs["learning_rate"] == pytest.approx(0.025)


def test_learning_rate_scheduler_rejects_non_numbers():
    sched = LearningRateScheduler(lambda epoch, lr: "fast")
    _begin(sched)
    with pytest.raises(ValueError, match=r"returned 'fast'"):
        sched.on_epoch_begin(0)
    with pytest.raises(TypeError, match="give a function"):
        LearningRateScheduler(0.1)


# --------------------------------------------------------------------------------------------
# ModelCheckpoint


def test_checkpoint_every_epoch_with_formatted_path(tmp_path):
    mc = ModelCheckpoint(tmp_path / "ckpt" / "m.{epoch:02d}-{loss:.2f}.safetensors")
    model, _ = _run_epochs(mc, [0.5, 0.25], key="loss")
    assert model.calls == [("save", str(tmp_path / "ckpt" / "m.01-0.50.safetensors")),
                           ("save", str(tmp_path / "ckpt" / "m.02-0.25.safetensors"))]


@pytest.mark.parametrize("monitor, values, saved_epochs", [
    ("val_loss", [0.5, 0.6, 0.4, 0.4], [1, 3]),  # auto -> min; equal is not better
    ("val_accuracy", [0.5, 0.4, 0.7, 0.6], [1, 3]),  # auto -> max
    ("val_sparse_categorical_accuracy", [0.5, 0.6, 0.55], [1, 2]),
])
def test_checkpoint_best_only_follows_the_monitor_direction(tmp_path, monitor, values, saved_epochs):
    mc = ModelCheckpoint(str(tmp_path / "best-{epoch}.safetensors"), monitor=monitor, save_best_only=True,
                         save_weights_only=True)
    model, _ = _run_epochs(mc, values, key=monitor)
    assert model.calls == [("save_weights", str(tmp_path / f"best-{e}.safetensors")) for e in saved_epochs]


def test_checkpoint_initial_value_threshold(tmp_path):
    mc = ModelCheckpoint(tmp_path / "m", save_best_only=True, initial_value_threshold=0.45)
    model, _ = _run_epochs(mc, [0.5, 0.4, 0.42])
    assert len(model.calls) == 1 and mc.best == 0.4


def test_checkpoint_best_only_never_saves_nan(tmp_path):
    mc = ModelCheckpoint(tmp_path / "m", save_best_only=True)
    model, _ = _run_epochs(mc, [float("nan"), 1.0])
    assert len(model.calls) == 1 and mc.best == 1.0


def test_checkpoint_every_n_steps_counts_across_epochs(tmp_path):
    mc = ModelCheckpoint(tmp_path / "m-{epoch}-{batch}.safetensors", save_freq=2)
    model = _begin(mc)
    for epoch in range(2):
        mc.on_epoch_begin(epoch)
        for batch in range(3):
            mc.on_train_batch_end(batch, {"loss": 1.0, "num_examples": 32})
        mc.on_epoch_end(epoch, {"loss": 1.0})
    assert [c[1] for c in model.calls] == [str(tmp_path / p) for p in
                                           ("m-1-2.safetensors", "m-2-1.safetensors", "m-2-3.safetensors")]


def test_checkpoint_grouped_steps_jump_batch_indices(tmp_path):
    # steps_per_execution=3: one hook call per 3 steps, with the index of the last one
    mc = ModelCheckpoint(tmp_path / "m-{batch}", save_freq=4)
    model = _begin(mc)
    mc.on_epoch_begin(0)
    for batch in (2, 5, 8, 11):
        mc.on_train_batch_end(batch, {})
    assert [c[1] for c in model.calls] == [str(tmp_path / "m-6"), str(tmp_path / "m-12")]


def test_checkpoint_unknown_placeholder_names_the_available_keys(tmp_path):
    mc = ModelCheckpoint(tmp_path / "m-{val_acc:.2f}")
    _begin(mc)
    with pytest.raises(ValueError, match=r"\{val_acc\}.*available: loss, epoch"):
        mc.on_epoch_end(0, {"loss": 0.3})


def test_checkpoint_best_only_with_missing_monitor_warns_and_skips(tmp_path):
    mc = ModelCheckpoint(tmp_path / "m", save_best_only=True)
    with pytest.warns(UserWarning, match=r"monitor='val_loss'.*available: loss"):
        model, _ = _run_epochs(mc, [0.3, 0.2], key="loss")
    assert model.calls == []


def test_checkpoint_rejects_bad_save_freq(tmp_path):
    for bad in (0, "batch", 1.5, True):
        with pytest.raises(ValueError, match="save_freq"):
            ModelCheckpoint(tmp_path / "m", save_freq=bad)


# --------------------------------------------------------------------------------------------
# TerminateOnNaN, History, CallbackList


@pytest.mark.parametrize("loss, stops", [(float("nan"), True), (float("inf"), True), (-math.inf, True),
                                         (np.float32("nan"), True), (0.3, False)])
def test_terminate_on_nan(loss, stops, caplog):
    cb = TerminateOnNaN()
    model = _begin(cb)
    with caplog.at_level(logging.WARNING):
        cb.on_train_batch_end(4, {"loss": loss, "num_examples": 8})
    assert model.stop_training is stops
    assert ("batch 4" in caplog.text) is stops


def test_terminate_on_nan_can_raise_as_keras_3():
    """Keras 3.15's raise_error=True raises RuntimeError instead of stopping (so backups survive)."""
    cb = TerminateOnNaN(raise_error=True)
    model = _begin(cb)
    cb.on_train_batch_end(0, {"loss": 0.3})
    with pytest.raises(RuntimeError, match="loss is nan at batch 1"):
        cb.on_train_batch_end(1, {"loss": float("nan")})
    assert model.stop_training is False


def test_history_records_each_epoch_and_sets_model_history():
    history = History()
    model = _begin(history)
    assert model.history is history
    history.on_epoch_end(0, {"loss": 0.5, "accuracy": 0.7})
    history.on_epoch_end(1, {"loss": 0.4, "accuracy": 0.8, "val_loss": 0.6})
    assert history.epoch == [0, 1]
    assert history.history == {"loss": [0.5, 0.4], "accuracy": [0.7, 0.8], "val_loss": [0.6]}


def test_callback_list_adds_progbar_and_history_last_and_sets_params():
    es = EarlyStopping()
    model = DummyModel()
    cbs = CallbackList([es], add_history=True, add_progbar=True, model=model, epochs=3, steps=10, verbose=1)
    assert [type(c) for c in cbs] == [EarlyStopping, ProgbarLogger, History]
    assert all(c.model is model for c in cbs)
    assert all(c.params == {"epochs": 3, "steps": 10, "verbose": 1} for c in cbs)
    mine = History()
    cbs = CallbackList([mine], add_history=True, add_progbar=False, model=model)
    assert list(cbs) == [mine]


def test_callback_list_passes_one_logs_dict_so_later_callbacks_see_additions():
    cbs = CallbackList([ReduceLROnPlateau(patience=5)], add_history=True, model=DummyModel(), epochs=1)
    cbs.on_train_begin()
    cbs.on_epoch_end(0, {"val_loss": 1.0})
    assert cbs.callbacks[-1].history == {"val_loss": [1.0], "learning_rate": [0.1]}


def test_callback_list_dispatches_every_hook_in_order():
    seen = []

    class Recorder(Callback):
        def __init__(self, name):
            super().__init__()
            self.name = name

        def __getattribute__(self, attr):
            if attr.startswith("on_"):
                return lambda *args: seen.append((object.__getattribute__(self, "name"), attr, args))
            return object.__getattribute__(self, attr)

    cbs = CallbackList([Recorder("a"), Recorder("b")])
    hooks = ["on_train_begin", "on_train_end", "on_test_begin", "on_test_end", "on_predict_begin",
             "on_predict_end"]
    batch_hooks = ["on_epoch_begin", "on_epoch_end", "on_train_batch_begin", "on_train_batch_end",
                   "on_test_batch_begin", "on_test_batch_end", "on_predict_batch_begin", "on_predict_batch_end"]
    for hook in hooks:
        getattr(cbs, hook)({"x": 1})
    for hook in batch_hooks:
        getattr(cbs, hook)(7)
    assert seen == [(n, h, ({"x": 1},)) for h in hooks for n in "ab"] + \
        [(n, h, (7, {})) for h in batch_hooks for n in "ab"]


def test_keras2_on_batch_end_is_called_for_train_batches():
    class Legacy(Callback):
        def __init__(self):
            super().__init__()
            self.batches = []

        def on_batch_end(self, batch, logs=None):
            self.batches.append(batch)

    legacy = Legacy()
    cbs = CallbackList([legacy])
    cbs.on_train_batch_end(0, {})
    cbs.on_test_batch_end(1, {})
    assert legacy.batches == [0]


def test_callback_list_rejects_non_callbacks():
    with pytest.raises(TypeError, match=r"callbacks\[1\] is a function, not a Callback"):
        CallbackList([History(), lambda: None])


# --------------------------------------------------------------------------------------------
# ProgbarLogger


class ScriptedClock:
    def __init__(self, step_s: float):
        self.now, self.step_s = 0.0, step_s

    def __call__(self) -> float:
        value = self.now
        self.now += self.step_s
        return value


def _fit_progbar(progbar: ProgbarLogger, epochs: int, steps: int | None, verbose: int = 1,
                 step_s: float = 0.25) -> None:
    model = DummyModel()
    progbar._clock = ScriptedClock(step_s)
    cbs = CallbackList([progbar], model=model, epochs=epochs, steps=steps, verbose=verbose)
    cbs.on_train_begin()
    for epoch in range(epochs):
        cbs.on_epoch_begin(epoch)
        for batch in range(4):
            cbs.on_train_batch_begin(batch)
            cbs.on_train_batch_end(batch, {"loss": 0.41234, "accuracy": 0.8125, "num_examples": 32})
        cbs.on_epoch_end(epoch, {"loss": 0.41234, "accuracy": 0.8125, "val_loss": 0.5,
                                 "val_accuracy": 0.75, "learning_rate": 1e-5})
    cbs.on_train_end()


def test_progbar_non_tty_prints_one_plain_line_per_epoch(capsys):
    _fit_progbar(ProgbarLogger(interval_s=None), epochs=2, steps=4)
    out = capsys.readouterr().out
    assert "\r" not in out and "num_examples" not in out
    # clock: one read at epoch start, one per batch, one at the end -> 5 * 0.25 s = 1.25 s
    line = ("4/4 - 1s 312ms/step - loss: 0.4123 - accuracy: 0.8125 - val_loss: 0.5000 - "
            "val_accuracy: 0.7500 - learning_rate: 1.0000e-05 - 102 img/s")
    assert out.splitlines() == ["Epoch 1/2", line, "Epoch 2/2", line]


def test_progbar_non_tty_adds_a_line_every_interval(capsys):
    _fit_progbar(ProgbarLogger(interval_s=0.5), epochs=1, steps=4)
    lines = capsys.readouterr().out.splitlines()
    assert lines == ["2/4 - ETA: 0s - loss: 0.4123 - accuracy: 0.8125 - 128 img/s",
                     "4/4 - ETA: 0s - loss: 0.4123 - accuracy: 0.8125 - 128 img/s",
                     "4/4 - 1s 312ms/step - loss: 0.4123 - accuracy: 0.8125 - val_loss: 0.5000 - "
                     "val_accuracy: 0.7500 - learning_rate: 1.0000e-05 - 102 img/s"]


def test_progbar_unknown_steps(capsys):
    _fit_progbar(ProgbarLogger(interval_s=0.5), epochs=1, steps=None)
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("2/Unknown - 0s - loss: 0.4123")
    assert lines[-1].startswith("4/4 - 1s 312ms/step - loss")


class FakeTerminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progbar_on_a_terminal_redraws_one_line(monkeypatch):
    terminal = FakeTerminal()
    monkeypatch.setattr(sys, "stdout", terminal)
    _fit_progbar(ProgbarLogger(), epochs=1, steps=4, step_s=1.0)
    out = terminal.getvalue()
    assert out.count("\n") == 1 and out.endswith("\n")  # one finished line per epoch
    frames = out.rstrip("\n").split("\r")[1:]
    # clock: 0 at epoch start, 1 s per batch, 5 at the end
    assert frames[0] == "1/4 [======>.......................] - ETA: 3s - loss: 0.4123 - accuracy: 0.8125 - 32 img/s"
    assert frames[2] == "3/4 [=====================>........] - ETA: 1s - loss: 0.4123 - accuracy: 0.8125 - 32 img/s"
    assert len(frames) == 5
    assert frames[-1] == ("4/4 [==============================] - 5s 1.2s/step - loss: 0.4123 - accuracy: 0.8125 - "
                          "val_loss: 0.5000 - val_accuracy: 0.7500 - learning_rate: 1.0000e-05 - 26 img/s")


def test_progbar_epoch_stopped_early_shows_a_partial_bar(monkeypatch):
    terminal = FakeTerminal()
    monkeypatch.setattr(sys, "stdout", terminal)
    progbar = ProgbarLogger()
    progbar._clock = ScriptedClock(1.0)
    cbs = CallbackList([progbar], model=DummyModel(), epochs=1, steps=4, verbose=1)
    cbs.on_train_begin()
    cbs.on_epoch_begin(0)
    for batch in range(2):  # e.g. TerminateOnNaN stopped the epoch after 2 of 4 steps
        cbs.on_train_batch_end(batch, {"loss": 0.5})
    cbs.on_epoch_end(0, {"loss": float("nan")})
    assert terminal.getvalue().split("\r")[-1] == \
        "2/4 [==============>...............] - 3s 1.5s/step - loss: nan\n"


def test_progbar_verbose_2_prints_plain_lines_even_on_a_terminal(monkeypatch):
    terminal = FakeTerminal()
    monkeypatch.setattr(sys, "stdout", terminal)
    _fit_progbar(ProgbarLogger(), epochs=1, steps=4, verbose=2)
    assert "\r" not in terminal.getvalue() and len(terminal.getvalue().splitlines()) == 1


def test_progbar_verbose_0_prints_nothing(capsys):
    _fit_progbar(ProgbarLogger(), epochs=2, steps=4, verbose=0)
    assert capsys.readouterr().out == ""


def test_progbar_shows_evaluate_outside_fit_only(capsys):
    progbar = ProgbarLogger(interval_s=None)
    progbar._clock = ScriptedClock(0.5)
    cbs = CallbackList([progbar], model=DummyModel(), epochs=1, steps=2, verbose=1)
    cbs.on_test_begin()
    for batch in range(2):
        cbs.on_test_batch_end(batch, {"loss": 0.25})
    cbs.on_test_end({"loss": 0.25})
    assert capsys.readouterr().out == "2/2 - 2s 750ms/step - loss: 0.2500\n"


def test_progbar_value_formatting():
    from mirrored.training import _progbar

    assert _progbar.format_value(0.000123) == "1.2300e-04"
    assert _progbar.format_value(0) == "0.0000"
    assert _progbar.format_value(float("nan")) == "nan"
    assert _progbar.format_duration(3725) == "1:02:05" and _progbar.format_duration(125) == "2:05"
    assert _progbar.format_step_time(0.0005) == "500us/step"


# --------------------------------------------------------------------------------------------
# CSVLogger


def _csv_rows(path: Path, sep: str = ",") -> list[list[str]]:
    with open(path, newline="") as f:
        return list(csv.reader(f, delimiter=sep))


def _csv_run(logger: CSVLogger, epoch_logs: list[dict], first_epoch: int = 0) -> None:
    _begin(logger)
    for i, logs in enumerate(epoch_logs):
        logger.on_epoch_end(first_epoch + i, dict(logs))
    logger.on_train_end({})


def test_csv_logger_writes_header_and_rows(tmp_path):
    path = tmp_path / "log.csv"
    _csv_run(CSVLogger(path), [{"loss": 0.5, "accuracy": 0.75, "val_loss": 0.625, "val_accuracy": 0.5},
                               {"loss": 0.25, "accuracy": 0.875, "val_loss": 0.5, "val_accuracy": 0.625}])
    assert _csv_rows(path) == [["epoch", "accuracy", "loss", "val_accuracy", "val_loss"],
                               ["0", "0.75", "0.5", "0.5", "0.625"],
                               ["1", "0.875", "0.25", "0.625", "0.5"]]


def test_csv_logger_append_continues_under_the_existing_header(tmp_path):
    path = tmp_path / "log.csv"
    _csv_run(CSVLogger(path), [{"loss": 0.5, "val_loss": 0.6}])
    _csv_run(CSVLogger(path, append=True), [{"val_loss": 0.4, "loss": 0.3}], first_epoch=1)
    assert _csv_rows(path) == [["epoch", "loss", "val_loss"], ["0", "0.5", "0.6"], ["1", "0.3", "0.4"]]
    _csv_run(CSVLogger(path), [{"loss": 0.1, "val_loss": 0.2}])  # append=False starts anew
    assert _csv_rows(path) == [["epoch", "loss", "val_loss"], ["0", "0.1", "0.2"]]


def test_csv_logger_of_a_resumed_run_keeps_the_rows_before_it_and_redoes_the_rest(tmp_path):
    """Issue 24: a run restarted by BackupAndRestore at epoch 2 (append=False) keeps rows 0 and 1 - which
    Keras's CSVLogger truncates - and drops row 2, written before the crash and now run again."""
    path = tmp_path / "log.csv"
    _csv_run(CSVLogger(path), [{"loss": 0.5}, {"loss": 0.4}, {"loss": 0.3}])
    resumed = CSVLogger(path)
    _begin(resumed)
    resumed.on_epoch_begin(2)
    assert _csv_rows(path) == [["epoch", "loss", "val_loss"], ["0", "0.5", "NA"], ["1", "0.4", "NA"]]
    resumed.on_epoch_end(2, {"loss": 0.25})
    resumed.on_epoch_begin(3)
    resumed.on_epoch_end(3, {"loss": 0.2})
    assert [row[:2] for row in _csv_rows(path)] == [["epoch", "loss"], ["0", "0.5"], ["1", "0.4"], ["2", "0.25"],
                                                    ["3", "0.2"]]


def test_only_the_chief_writes_logs(tmp_path, capsys):
    """Issue 24: on a worker other than the chief (should_save_summary False, as TF's), CSVLogger,
    TensorBoard, the progress bar and a callback's verbose messages write nothing."""
    extended = SimpleNamespace(should_save_summary=False, should_checkpoint=False)
    model = SimpleNamespace(distribute_strategy=SimpleNamespace(extended=extended), optimizer=None)
    callbacks = [CSVLogger(tmp_path / "log.csv"), TensorBoard(tmp_path / "tb"), ProgbarLogger()]
    for cb in callbacks:
        cb.set_model(model)
        cb.set_params({"epochs": 2, "steps": 1, "verbose": 1})
        cb.on_train_begin({})
        for epoch in range(2):
            cb.on_epoch_begin(epoch)
            cb.on_train_batch_end(0, {"loss": 0.5})
            cb.on_epoch_end(epoch, {"loss": 0.5})
        cb.on_train_end({})
    stopper = EarlyStopping(monitor="loss", patience=0, verbose=1)
    stopper.set_model(model)
    stopper.on_train_begin({})
    for epoch, loss in enumerate([0.5, 0.6]):
        stopper.on_epoch_end(epoch, {"loss": loss})
    stopper.on_train_end({})  # ("Epoch 2: early stopping" on the chief)
    assert list(tmp_path.iterdir()) == [] and capsys.readouterr().out == ""
    extended.should_save_summary = True  # the chief
    callbacks[2].on_epoch_begin(0)
    assert capsys.readouterr().out == "Epoch 1/2\n"


def test_csv_logger_append_to_a_missing_file_writes_the_header(tmp_path):
    path = tmp_path / "sub" / "log.csv"
    _csv_run(CSVLogger(path, append=True), [{"loss": 0.5, "val_loss": 0.5}])
    assert _csv_rows(path)[0] == ["epoch", "loss", "val_loss"]


def test_csv_logger_reserves_val_columns_for_validation_freq_and_separator(tmp_path):
    path = tmp_path / "log.tsv"
    _csv_run(CSVLogger(path, separator="\t"), [{"loss": 0.5}, {"loss": 0.4, "val_loss": 0.45}])
    assert _csv_rows(path, "\t") == [["epoch", "loss", "val_loss"], ["0", "0.5", "NA"], ["1", "0.4", "0.45"]]


def test_csv_logger_warns_about_keys_that_appear_later(tmp_path):
    path = tmp_path / "log.csv"
    with pytest.warns(UserWarning, match=r"\['learning_rate'\] are not columns"):
        _csv_run(CSVLogger(path), [{"loss": 0.5, "val_loss": 0.5},
                                   {"loss": 0.4, "val_loss": 0.4, "learning_rate": 0.01}])
    assert _csv_rows(path)[-1] == ["1", "0.4", "0.4"]


# --------------------------------------------------------------------------------------------
# TensorBoard: files read back by a decoder written here, and by tensorboard itself if installed


def _masked_crc32c(data: bytes) -> int:
    crc = crc32c.crc32c(data)
    return ((((crc >> 15) | (crc << 17)) & 0xFFFFFFFF) + 0xA282EAD8) & 0xFFFFFFFF


def _records(path: Path) -> list[bytes]:
    data, out, pos = path.read_bytes(), [], 0
    while pos < len(data):
        header = data[pos:pos + 8]
        (length,) = struct.unpack("<Q", header)
        assert struct.unpack("<I", data[pos + 8:pos + 12])[0] == _masked_crc32c(header)
        payload = data[pos + 12:pos + 12 + length]
        assert struct.unpack("<I", data[pos + 12 + length:pos + 16 + length])[0] == _masked_crc32c(payload)
        out.append(payload)
        pos += 16 + length
    return out


def _fields(buf: bytes) -> list[tuple[int, object]]:
    """(field number, value) of a protobuf message: varints as int, fixed64/32 as bytes,
    length-delimited as bytes."""
    out, pos = [], 0

    def varint() -> int:
        nonlocal pos
        shift = result = 0
        while True:
            byte = buf[pos]
            pos += 1
            result |= (byte & 0x7F) << shift
            shift += 7
            if not byte & 0x80:
                return result

    while pos < len(buf):
        key = varint()
        number, wire = key >> 3, key & 7
        if wire == 0:
            out.append((number, varint()))
        elif wire == 1:
            out.append((number, buf[pos:pos + 8]))
            pos += 8
        elif wire == 5:
            out.append((number, buf[pos:pos + 4]))
            pos += 4
        elif wire == 2:
            length = varint()
            out.append((number, buf[pos:pos + length]))
            pos += length
        else:
            raise AssertionError(f"unexpected wire type {wire}")
    return out


def _events(run_dir: Path) -> list[dict]:
    """Every event in the run's event files: {"wall_time", "step", "file_version" | "scalars"}."""
    events = []
    files = sorted(p for p in run_dir.iterdir() if "tfevents" in p.name)
    assert files, f"no event file in {run_dir}"
    for path in files:
        for record in _records(path):
            event: dict = {"step": 0}
            for number, value in _fields(record):
                if number == 1:
                    event["wall_time"] = struct.unpack("<d", value)[0]
                elif number == 2:
                    event["step"] = value
                elif number == 3:
                    event["file_version"] = value.decode()
                elif number == 5:
                    scalars = {}
                    for vnum, vbuf in _fields(value):
                        assert vnum == 1  # Summary.value
                        fields = dict(_fields(vbuf))
                        scalars[fields[1].decode()] = struct.unpack("<f", fields[2])[0]
                    event["scalars"] = scalars
            events.append(event)
    return events


def _tensorboard_run(log_dir: Path, update_freq="epoch", close: bool = True) -> TensorBoard:
    tb = TensorBoard(log_dir, update_freq=update_freq)
    model = _begin(tb)
    model.optimizer.learning_rate = 0.5
    for epoch in range(2):
        tb.on_epoch_begin(epoch)
        for batch in range(3):
            tb.on_train_batch_end(batch, {"loss": 1.0 - 0.1 * batch, "num_examples": 16})
        tb.on_epoch_end(epoch, {"loss": 0.5 - epoch / 10, "accuracy": 0.25 * (epoch + 1),
                                "val_loss": 0.75 - epoch / 10, "val_accuracy": 0.5})
    if close:
        tb.on_train_end({})
    return tb


def test_tensorboard_writes_train_and_validation_event_files(tmp_path):
    _tensorboard_run(tmp_path)
    train, val = _events(tmp_path / "train"), _events(tmp_path / "validation")
    for events in (train, val):
        assert events[0]["file_version"] == "brain.Event:2" and events[0]["wall_time"] > 1e9
    assert [(e["step"], e["scalars"]) for e in train[1:]] == [
        (0, {"epoch_loss": 0.5, "epoch_accuracy": 0.25, "epoch_learning_rate": 0.5}),
        (1, {"epoch_loss": pytest.approx(0.4), "epoch_accuracy": 0.5, "epoch_learning_rate": 0.5})]
    assert [(e["step"], e["scalars"]) for e in val[1:]] == [
        (0, {"epoch_loss": 0.75, "epoch_accuracy": 0.5}),
        (1, {"epoch_loss": pytest.approx(0.65), "epoch_accuracy": 0.5})]


def test_tensorboard_batch_logs_every_n_steps(tmp_path):
    _tensorboard_run(tmp_path, update_freq=2)
    batch = [(e["step"], e["scalars"]) for e in _events(tmp_path / "train") if "scalars" in e
             and "batch_loss" in e["scalars"]]
    assert batch == [(2, {"batch_loss": pytest.approx(0.9)}), (4, {"batch_loss": 1.0}),
                     (6, {"batch_loss": pytest.approx(0.8)})]


def test_tensorboard_files_are_readable_before_training_ends(tmp_path):
    tb = _tensorboard_run(tmp_path, close=False)
    assert len(_events(tmp_path / "train")) == 3
    tb.on_train_end({})


def test_tensorboard_second_fit_writes_a_new_file(tmp_path):
    _tensorboard_run(tmp_path)
    _tensorboard_run(tmp_path)
    assert len([p for p in (tmp_path / "train").iterdir() if "tfevents" in p.name]) == 2


def test_tensorboard_rejects_bad_update_freq(tmp_path):
    with pytest.raises(ValueError, match="update_freq"):
        TensorBoard(tmp_path, update_freq="step")


def test_tensorboard_event_accumulator_reads_our_files(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing import event_accumulator

    _tensorboard_run(tmp_path, update_freq="batch")
    train = event_accumulator.EventAccumulator(str(tmp_path / "train"))
    train.Reload()
    assert [(s.step, s.value) for s in train.Scalars("epoch_accuracy")] == [(0, 0.25), (1, 0.5)]
    assert len(train.Scalars("batch_loss")) == 6
    val = event_accumulator.EventAccumulator(str(tmp_path / "validation"))
    val.Reload()
    assert sorted(val.Tags()["scalars"]) == ["epoch_accuracy", "epoch_loss"]
    assert [s.value for s in val.Scalars("epoch_loss")] == pytest.approx([0.75, 0.65])


# --------------------------------------------------------------------------------------------
# BackupAndRestore


class BackupModel(torch.nn.Module):
    """What BackupAndRestore asks of a Model: the model itself (a trackable), its metrics, and fit's
    EpochIterator; each step adds 1 to its one weight, so the weights count the steps trained."""

    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(1))
        self.metrics: list = []
        self.calls: list[tuple] = []
        self._epoch_iterator = None


class SpyBackup(BackupAndRestore):
    """Records where fit was (the EpochIterator's epoch and step) at each backup."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.saves: list[tuple[int, int]] = []

    def _backup(self) -> None:
        super()._backup()
        state = self.model._epoch_iterator.get_state()
        self.saves.append((state["epoch"], state["step"]))


def _backup_fit(callback: BackupAndRestore, model: BackupModel, epochs: int, steps: int,
                crash_at: tuple[int, int] | None = None) -> None:
    """A fit() loop as Model.fit runs it over `steps` batches an epoch, optionally dying before step
    crash_at=(epoch, batch)."""
    from mirrored.training.epochs import EpochIterator

    import mirrored as mr

    batches = [torch.full((1, 1), float(i)) for i in range(steps)]
    model._epoch_iterator = it = EpochIterator(mr.OneDeviceStrategy("cpu:0").experimental_distribute_dataset(batches))
    callback.set_model(model)
    callback.on_train_begin({})
    for epoch in it.epochs(epochs):
        callback.on_epoch_begin(epoch)
        for batch, group in it.steps():
            if (epoch, batch) == crash_at:
                return  # the process dies: no on_train_end
            assert float(group[0][0]) == batch  # the data resumes at the step fit resumes at
            model.calls.append(("step", epoch, batch))
            with torch.no_grad():
                model.w += 1
            callback.on_train_batch_end(batch, {"loss": 1.0})
        it.end_epoch()
        callback.on_epoch_end(epoch, {"loss": 1.0})
    callback.on_train_end({})


def test_backup_saves_each_epoch_and_deletes_after_success(tmp_path):
    backup = tmp_path / "backup"
    callback = SpyBackup(backup)
    _backup_fit(callback, BackupModel(), epochs=2, steps=2)
    assert callback.saves == [(1, 0), (2, 0)]  # at each epoch's end: the next epoch, none of its steps done
    assert not backup.exists()


def test_backup_restores_after_a_crash_and_resumes_at_the_next_epoch(tmp_path):
    backup = tmp_path / "backup"
    first = BackupModel()
    _backup_fit(BackupAndRestore(backup), first, epochs=3, steps=2, crash_at=(1, 1))
    assert (backup / "training_state.safetensors").exists()

    second, callback = BackupModel(), SpyBackup(backup)
    _backup_fit(callback, second, epochs=3, steps=2)
    assert second.calls[0] == ("step", 1, 0)  # epoch 0 is not run again
    assert second.w.item() == 2 + 4  # the weights of the backup (2 steps), then 4 more steps
    assert callback.saves[-1] == (3, 0)
    assert not backup.exists()


def test_backup_every_n_steps_resumes_inside_an_epoch(tmp_path):
    backup = tmp_path / "backup"
    first = SpyBackup(backup, save_freq=2)
    _backup_fit(first, BackupModel(), epochs=2, steps=3, crash_at=(1, 1))
    assert first.saves == [(0, 2), (1, 1)]  # step 4 overall = epoch 1, 1 step in

    second_model, second = BackupModel(), SpyBackup(backup, save_freq=2)
    _backup_fit(second, second_model, epochs=2, steps=3)
    assert second_model.calls[0] == ("step", 1, 1)
    assert second_model.w.item() == 4 + 2
    assert second.saves[0] == (1, 3)  # 2 more steps since the restored save


def test_backup_keeps_the_file_with_delete_checkpoint_false_and_never_removes_user_files(tmp_path):
    backup = tmp_path / "backup"
    _backup_fit(BackupAndRestore(backup, delete_checkpoint=False), BackupModel(), epochs=1, steps=1)
    assert (backup / "training_state.safetensors").exists()
    (backup / "notes.txt").write_text("mine")
    _backup_fit(BackupAndRestore(backup), BackupModel(), epochs=1, steps=1)
    assert sorted(os.listdir(backup)) == ["notes.txt"]


def test_backup_of_another_run_is_refused_with_what_to_do(tmp_path):
    backup = tmp_path / "backup"
    _backup_fit(BackupAndRestore(backup), BackupModel(), epochs=2, steps=2, crash_at=(1, 0))
    other = BackupModel()
    other.extra = torch.nn.Linear(2, 2)  # another model: weights the backup does not hold
    with pytest.raises(AssertionError, match=r"BackupAndRestore: cannot resume .*delete it to start afresh"):
        _backup_fit(BackupAndRestore(backup), other, epochs=2, steps=2)


def test_backup_needs_a_mirrored_model(tmp_path):
    callback = BackupAndRestore(tmp_path)
    callback.set_model(object())
    with pytest.raises(TypeError, match="needs a mirrored Model"):
        callback.on_train_begin({})
    with pytest.raises(ValueError, match="backup_dir"):
        BackupAndRestore("")


def test_public_names_have_docstrings_and_typed_signatures():
    import inspect

    for name in cb_lib.__all__:
        obj = getattr(cb_lib, name)
        assert obj.__doc__, name
        hints = inspect.signature(obj.__init__).parameters
        for param in list(hints.values())[1:]:
            if param.kind not in (param.VAR_KEYWORD, param.VAR_POSITIONAL):
                assert param.annotation is not inspect.Parameter.empty, f"{name}.{param.name}"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        repr(EarlyStopping()), repr(ModelCheckpoint("x")), repr(CSVLogger("x"))


def test_model_checkpoint_refuses_a_directory_path_at_once(tmp_path):
    """A directory (TF's SavedModel habit) failed only at the first save, after an epoch, naming a
    temporary file the user never made, and left the directory behind (review finding)."""
    for path in (str(tmp_path / "ckdir") + os.sep, str(tmp_path)):
        with pytest.raises(ValueError, match="that is a directory; a checkpoint is one safetensors file"):
            ModelCheckpoint(path)
        with pytest.raises(ValueError, match="that is a directory"):
            save_checkpoint(path, {"w": torch.zeros(1)}, {})
    assert not (tmp_path / "ckdir").exists()
