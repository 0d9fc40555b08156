"""The callbacks that save during fit: ModelCheckpoint (the model or its weights, every epoch or
`save_freq` steps, optionally only the best) and BackupAndRestore (the whole training state, so an
interrupted fit() resumes where it stopped). callbacks.py re-exports both, where users import them
(mr.callbacks). Uses _callback.py, checkpoint.py for paths, checkpoint_checks.py, and mr.train's
Checkpoint (tracking.py) for BackupAndRestore.
"""
from __future__ import annotations

import errno
import logging
import math
import os
import tempfile

from mirrored._files import write_error
from mirrored.training import adapters, checkpoint, checkpoint_checks, tracking
from mirrored.training._callback import (NOT_METRICS, Callback, Logs, StepCounter, check_mode, check_save_freq,
                                         improved, monitor_value, resolve_mode, say, writes_checkpoints)

logger = logging.getLogger(__name__)

_BACKUP_FILE = "training_state.safetensors"
# What to do when a backup or checkpoint cannot be written, by errno: fit() stopped, and runs again.
_FIXES_BEFORE_RESUMING = {
    errno.ENOSPC: "Free space on that disk (or move backup_dir to another), then run fit() again",
    errno.EDQUOT: "Free space within the disk quota (or move backup_dir elsewhere), then run fit() again",
    errno.EROFS: "That file system is read-only: give a backup_dir on a writable one",
}


def _position(state: dict) -> str:
    """Where fit was when a backup was taken, in the words of its progress bar (epochs from 1)."""
    if state["step"] == 0:
        return f"taken at the end of epoch {state['epoch']}" if state["epoch"] else "taken before the first step"
    return f"taken after step {state['step']} of epoch {state['epoch'] + 1}"


class ModelCheckpoint(Callback):
    """Saves the model (model.save) or its weights (model.save_weights) every epoch or every
    `save_freq` steps; with save_best_only, only when `monitor` improves.

    `filepath` may hold {epoch} (1-based), {batch} (1-based, with an int save_freq) and log keys,
    e.g. "ckpt/weights.{epoch:02d}-{val_loss:.2f}.safetensors". Its directory is created.
    """

    def __init__(self, filepath: str | os.PathLike, monitor: str = "val_loss", verbose: int = 0,
                 save_best_only: bool = False, save_weights_only: bool = False, mode: str = "auto",
                 save_freq: str | int = "epoch", initial_value_threshold: float | None = None):
        super().__init__()
        check_mode("ModelCheckpoint", mode)
        check_save_freq("ModelCheckpoint", save_freq)
        self.filepath = os.fspath(filepath)
        # now, not after the first epoch; whether a ".keras" path suits the model is known at train begin
        checkpoint.check_file_path(self.filepath, "ModelCheckpoint", keras_archive_ok=not save_weights_only)
        self.monitor = monitor
        self.verbose = verbose
        self.save_best_only = save_best_only
        self.save_weights_only = save_weights_only
        self.mode = mode
        self.save_freq = save_freq
        self.best: float | None = initial_value_threshold
        self._direction: str | None = None
        self._current_epoch = 0
        self._steps = StepCounter(save_freq) if save_freq != "epoch" else None
        self._last_saved: str | None = None  # the newest file this callback wrote, which a failed save leaves

    def on_train_begin(self, logs: Logs | None = None) -> None:
        """Resolves the monitor's mode (save_best_only) and restarts the step count; a ".keras" path is
        refused here, before any step, for a model that is not a Keras model (Model.save would refuse it)."""
        if adapters.is_archive(self.filepath) and not self.save_weights_only:
            self.model.adapter.check_archive(self.model.module, self.filepath, f"ModelCheckpoint({self.filepath!r})")
        if self.save_best_only:
            self._direction = resolve_mode("ModelCheckpoint", self.monitor, self.mode, self.model)
        if self._steps is not None:
            self._steps = StepCounter(self.save_freq)

    def on_epoch_begin(self, epoch: int, logs: Logs | None = None) -> None:
        """Notes the epoch, for file names of saves made mid-epoch."""
        self._current_epoch = epoch

    def on_train_batch_end(self, batch: int, logs: Logs | None = None) -> None:
        """Saves every `save_freq` steps, when save_freq is a number."""
        if self._steps is not None and self._steps.due(batch):
            self._save(self._current_epoch, batch, logs or {})

    def on_epoch_end(self, epoch: int, logs: Logs | None = None) -> None:
        """Saves after the epoch (save_freq="epoch"), if it improved with save_best_only."""
        if self.save_freq == "epoch":
            self._save(epoch, None, logs or {})

    def _save(self, epoch: int, batch: int | None, logs: Logs) -> None:
        path = self._format_path(epoch, batch, logs)
        chief = writes_checkpoints(self.model)  # other workers of a multi-worker run follow "best" but write nothing
        verbose = self.verbose and chief
        if self.save_best_only:
            current = monitor_value(self, logs)
            if current is None:
                return
            if self._direction is None:
                self._direction = resolve_mode("ModelCheckpoint", self.monitor, self.mode, self.model)
            if math.isnan(current) or not improved(self._direction, current, self.best, 0.0):
                if verbose:
                    say(f"Epoch {epoch + 1}: {self.monitor} did not improve from {self.best}")
                return
            if verbose:
                say(f"Epoch {epoch + 1}: {self.monitor} improved from {self.best} to "
                    f"{current}, saving model to {path}")
            self.best = current
        elif verbose:
            say(f"Epoch {epoch + 1}: saving model to {path}")
        if not chief:
            return
        existed = os.path.isfile(path)
        try:
            directory = os.path.dirname(path)
            if directory:
                os.makedirs(directory, exist_ok=True)
            if self.save_weights_only:
                self.model.save_weights(path)
            else:
                self.model.save(path)
        except OSError as e:
            if existed:
                kept = "The file there before is intact"
            elif self._last_saved is not None:
                kept = f"The checkpoint it saved before, {self._last_saved!r}, is intact"
            else:
                kept = "No checkpoint was saved by it before"
            raise write_error(e, path, f"ModelCheckpoint({self.filepath!r})",
                              f"{kept} (no partial file was left).") from None
        self._last_saved = path

    def _format_path(self, epoch: int, batch: int | None, logs: Logs) -> str:
        fields = {k: v for k, v in logs.items() if k not in NOT_METRICS}
        fields["epoch"] = epoch + 1
        if batch is not None:
            fields["batch"] = batch + 1
        try:
            return self.filepath.format(**fields)
        except KeyError as e:
            raise ValueError(
                f"ModelCheckpoint(filepath={self.filepath!r}): the placeholder {{{e.args[0]}}} "
                f"names no log key at epoch {epoch + 1} (available: {', '.join(fields)}). Use "
                f"one of those; val_ keys need fit(validation_data=...).") from e
        except (IndexError, ValueError) as e:
            raise ValueError(f"ModelCheckpoint(filepath={self.filepath!r}): cannot format the "
                             f"path ({e}). Use named fields such as {{epoch:02d}} or "
                             f"{{val_loss:.4f}}, and double braces for literal ones.") from e

    def __repr__(self) -> str:
        return (f"ModelCheckpoint({self.filepath!r}, monitor={self.monitor!r}, "
                f"save_best_only={self.save_best_only}, save_freq={self.save_freq!r})")


class BackupAndRestore(Callback):
    """Lets an interrupted fit() resume where it stopped: saves the whole training state to
    `backup_dir` every epoch or every `save_freq` steps, and at the start of fit() restores a backup
    left there by a run that did not finish.

    The backup is an mr.train.Checkpoint (one file, written atomically) of the model (weights and
    optimizer, with its step count), its metrics, the random generators and fit's EpochIterator
    (the epoch, the steps done in it and the place in the data), which the restore moves to where
    the backup was taken, as Keras's callback sets model._initial_epoch. The backup must fit this
    fit() in full: every value is checked against the model, optimizer, metrics and data before any
    is assigned, and one that does not (or a damaged file) is a CheckpointError naming the file, with
    the model left as it was. After a fit() that ends normally the backup is deleted (unless
    delete_checkpoint=False). Under a multi-worker strategy only the chief writes and deletes the backup
    and every worker restores from it, as in TF, so backup_dir must be readable by every worker.
    """

    def __init__(self, backup_dir: str | os.PathLike, save_freq: str | int = "epoch",
                 delete_checkpoint: bool = True):
        super().__init__()
        if not backup_dir:
            raise ValueError("BackupAndRestore(backup_dir=...): give a directory for the backup, "
                             "e.g. '/tmp/backup'.")
        check_save_freq("BackupAndRestore", save_freq)
        self.backup_dir = os.fspath(backup_dir)
        self.save_freq = save_freq
        self.delete_checkpoint = delete_checkpoint
        self.path = os.path.join(self.backup_dir, _BACKUP_FILE)
        self._checkpoint: tracking.Checkpoint | None = None
        self._fit = None
        self._kept: str | None = None  # where the backup on disk stands, for an error that must say it is intact
        self._rebase = False
        self._steps = StepCounter(save_freq) if save_freq != "epoch" else None

    def on_train_begin(self, logs: Logs | None = None) -> None:
        """Restores a backup left in backup_dir, all of it or nothing (it is checked in full first)."""
        fit = getattr(self.model, "_epoch_iterator", None)
        if fit is None:
            raise TypeError(f"BackupAndRestore needs a mirrored Model's fit() (one with an epoch iterator); "
                            f"got {type(self.model).__name__}.")
        self._checkpoint = tracking.Checkpoint(model=self.model, metrics=list(self.model.metrics), fit=fit,
                                               rng=tracking.RandomState())
        self._kept = None
        self._fit = fit
        if os.path.exists(self.path):
            origin = checkpoint_checks.Origin(
                f"BackupAndRestore: cannot resume from {self.path!r}",
                "It holds another run's state (another model, optimizer, metrics or data, or an older mirrored's "
                "backup): delete it to start afresh, or resume with the model, optimizer and data that made it.")
            # complete: a backup restores all of the run or none of it, so nothing is assigned unless
            # every value pairs up with this fit's (CheckpointMismatchError, an AssertionError, otherwise).
            self._checkpoint._read(self.path, "BackupAndRestore", restore_counter=False, origin=origin, complete=True)
            self._kept = _position(fit.get_state())
            logger.info("BackupAndRestore: resuming from %s at epoch %d, step %d",
                        self.path, fit.initial_epoch + 1, fit.step)
        if self._steps is not None:
            self._steps = StepCounter(self.save_freq, last_batch=fit.step - 1)
        self._rebase = True

    def on_train_batch_begin(self, batch: int, logs: Logs | None = None) -> None:
        """The first step's index starts the count: a run resumed with another global batch (another replica
        count) goes on at another step of the epoch than the backup's."""
        if self._rebase and self._steps is not None:
            self._steps.last_batch = batch - 1
        self._rebase = False

    def on_train_batch_end(self, batch: int, logs: Logs | None = None) -> None:
        """Backs up every `save_freq` steps, when save_freq is a number."""
        if self._steps is not None and self._steps.due(batch):
            self._backup()

    def on_epoch_end(self, epoch: int, logs: Logs | None = None) -> None:
        """Backs up after the epoch (save_freq="epoch")."""
        if self.save_freq == "epoch":
            self._backup()

    def on_train_end(self, logs: Logs | None = None) -> None:
        """Deletes the backup after a fit() that finished (unless delete_checkpoint=False)."""
        if not self.delete_checkpoint or not writes_checkpoints(self.model):
            return
        try:
            os.remove(self.path)
        except FileNotFoundError:
            pass
        try:
            os.rmdir(self.backup_dir)  # only if empty: the directory may hold the user's files
        except OSError:
            pass

    def _backup(self) -> None:
        # As TF's: every worker restores from the chief's backup, which only the chief keeps. Reading the
        # state takes collectives (metrics' sync-on-read values), so the other workers build it too and
        # write it to a temporary directory they delete (TF's workertemp_N directories).
        if not writes_checkpoints(self.model):
            with tempfile.TemporaryDirectory(prefix="mirrored-backup-") as scratch:
                self._checkpoint.write(os.path.join(scratch, _BACKUP_FILE))
            return
        where = self._fit.get_state()
        try:
            os.makedirs(self.backup_dir, exist_ok=True)
            # where fit is now: after this batch, or (at an epoch's end) the next epoch
            self._checkpoint.write(self.path)
        except OSError as e:
            if self._kept is None:
                kept = "No backup of this run was written before, so a rerun starts afresh."
            else:
                kept = (f"The previous backup, {self._kept}, is intact (no partial file was left), and fit() run "
                        "again with this callback resumes from it.")
            raise write_error(e, self.path, f"BackupAndRestore({self.backup_dir!r})", kept,
                              _FIXES_BEFORE_RESUMING.get(e.errno)) from None
        self._kept = _position(where)

    def __repr__(self) -> str:
        return f"BackupAndRestore({self.backup_dir!r}, save_freq={self.save_freq!r})"
