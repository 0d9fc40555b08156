"""Issue 36: every file the library writes, on a disk that fills or a folder that turns read-only, fails
with one error (a FileWriteError, an OSError with the errno) naming the file, the writer (the callback or
call), the OS error and what was kept - and what was kept is: the previous file, backup or rows are
whole, no temporary file is left, and a resumed fit ends where an uninterrupted one does.

The disk is a small tmpfs mounted for the test (the real ENOSPC and EROFS of a file system); where the
test may not mount one (no root, a container without CAP_SYS_ADMIN), the same errors are injected where
the bytes leave Python: os.write and os.open, and open() in a writing mode, for paths in that folder
(MIRRORED_TEST_NO_MOUNT=1 forces that). The injected full disk fails a write whole; only the tmpfs shows
the kernel writing part of a record before ENOSPC, which the log tests below provoke."""
from __future__ import annotations

import builtins
import contextlib
import errno
import io
import os
import shutil
import struct
import subprocess
import uuid
from pathlib import Path

import pytest
import torch
from tensorboard.compat.proto.event_pb2 import Event
from torch import nn

import mirrored as mr
from mirrored import cli
from mirrored._files import FileWriteError
from mirrored.training.checkpoint import load_checkpoint, save_checkpoint

_DISK_BYTES = 32 << 20  # room for the CLI's ResNet checkpoints (~3 MB each); filled on purpose mid-run


class Disk:
    """A folder whose file system a test can fill, free, and make read-only or writable again."""

    def __init__(self, root: Path):
        self.path = root / "disk"
        self.path.mkdir()
        self.mounted = _mount(self.path)
        self._failing: int | None = None  # the injected errno, where nothing is mounted
        self._undo: list = []

    def fill(self) -> None:
        """Takes every free byte (real), or makes every write fail with ENOSPC (injected)."""
        if not self.mounted:
            return self._inject(errno.ENOSPC)
        with open(self.path / ".filler", "ab", buffering=0) as f:
            with contextlib.suppress(OSError):
                while True:
                    f.write(b"\0" * 65536)
            with contextlib.suppress(OSError):  # the last partial page too
                while True:
                    f.write(b"\0")

    def free(self) -> None:
        if not self.mounted:
            return self._inject(None)
        (self.path / ".filler").unlink(missing_ok=True)

    def read_only(self, on: bool = True) -> None:
        if not self.mounted:
            return self._inject(errno.EROFS if on else None)
        subprocess.run(["mount", "-o", f"remount,{'ro' if on else 'rw'}", str(self.path)], check=True,
                       capture_output=True, timeout=30)

    def files(self) -> list[str]:
        """Every file under the folder (the filler aside), relative to it."""
        return sorted(str(p.relative_to(self.path)) for p in self.path.rglob("*")
                      if p.is_file() and p.name != ".filler")

    # ---- injected errors, where no file system can be mounted --------------------------------------------
    def _inject(self, code: int | None) -> None:
        self._failing = code
        if code is None or self._undo:
            return
        real_open, real_os_open, real_write = builtins.open, os.open, os.write
        disk = str(self.path.resolve())

        def ours(path) -> bool:
            try:
                return str(Path(os.fsdecode(path)).resolve()).startswith(disk)
            except (TypeError, ValueError):
                return False

        def fail(path=None):
            raise OSError(self._failing, os.strerror(self._failing), *([os.fspath(path)] if path else []))

        def fd_ours(fd: int) -> bool:
            try:
                return ours(os.readlink(f"/proc/self/fd/{fd}"))
            except OSError:
                return False

        def open_(file, mode="r", *args, **kwargs):
            writing = isinstance(file, (str, bytes, os.PathLike)) and ours(file) and set(mode) & set("wax+")
            if self._failing == errno.EROFS and writing:
                fail(file)
            f = real_open(file, mode, *args, **kwargs)
            return _NoSpace(f, self) if writing else f  # (a full disk still makes an empty file)

        def os_open(path, flags, *args, **kwargs):
            if self._failing == errno.EROFS and ours(path) and flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT):
                fail(path)
            return real_os_open(path, flags, *args, **kwargs)

        def write(fd, data):
            if self._failing and len(data) and fd_ours(fd):
                fail()
            return real_write(fd, data)

        for owner, name, value in ((builtins, "open", open_), (io, "open", open_), (os, "open", os_open),
                                   (os, "write", write)):
            self._undo.append((owner, name, getattr(owner, name)))
            setattr(owner, name, value)

    def close(self) -> None:
        for owner, name, value in reversed(self._undo):
            setattr(owner, name, value)
        self._undo = []
        if self.mounted:
            subprocess.run(["umount", "-l", str(self.path)], capture_output=True, timeout=30)


class _NoSpace:
    """A file opened for writing in an injected Disk: its writes fail while the disk is full."""

    def __init__(self, file, disk: Disk):
        self._file, self._disk = file, disk

    def write(self, data):
        if self._disk._failing and len(data):
            raise OSError(self._disk._failing, os.strerror(self._disk._failing))
        return self._file.write(data)

    def __getattr__(self, name):
        return getattr(self._file, name)

    def __iter__(self):
        return iter(self._file)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self._file.close()


def _mount(path: Path) -> bool:
    if os.name != "posix" or shutil.which("mount") is None or os.environ.get("MIRRORED_TEST_NO_MOUNT"):
        return False
    try:
        done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={_DISK_BYTES},mode=0777", f"mirrored-test-"
                               f"{uuid.uuid4().hex[:8]}", str(path)], capture_output=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return done.returncode == 0


@pytest.fixture
def disk(tmp_path):
    d = Disk(tmp_path)
    try:
        yield d
    finally:
        d.close()


def _one_error(info, code: int, *parts: str) -> str:
    """The error is a FileWriteError with the errno, on one line, holding every part."""
    e = info.value
    assert isinstance(e, FileWriteError) and e.errno == code, repr(e)
    message = str(e)
    assert "\n" not in message and e.__cause__ is None and e.__suppress_context__, message
    assert os.strerror(code) in message, message
    for part in parts:
        assert part in message, (part, message)
    return message


_FAILURES = {"full": errno.ENOSPC, "read-only": errno.EROFS}


def _break(disk: Disk, how: str) -> None:
    disk.fill() if how == "full" else disk.read_only()


def _mend(disk: Disk, how: str) -> None:
    disk.free() if how == "full" else disk.read_only(False)


# ---- fit's savers: BackupAndRestore, ModelCheckpoint, CSVLogger, TensorBoard ---------------------------------

def _data(examples=24, batch=6):
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(examples, 5, generator=g), torch.randint(0, 3, (examples,), generator=g)
    return mr.data.Dataset.from_tensor_slices((x, y)).shuffle(examples, seed=2).batch(batch)


def _fit(callbacks, epochs=3, data=None):
    """fit of a small net on 2 CPU replicas (4 batches an epoch by default); its final weights, flattened."""
    torch.manual_seed(0)
    strategy = mr.MirroredStrategy(devices=["cpu:0", "cpu:1"])
    with strategy.scope():
        model = mr.Model(nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 3)))
        model.compile(optimizer=mr.optimizers.SGD(learning_rate=0.1, momentum=0.9),
                      loss="sparse_categorical_crossentropy", metrics=["accuracy"])
    model.fit(data or _data(), epochs=epochs, verbose=0, callbacks=callbacks)
    return torch.cat([p.detach().flatten() for p in model.module.parameters()])


class _BreakAfterEpoch(mr.callbacks.Callback):
    """Fills the disk (or makes it read-only) at the end of epoch `epoch` (0-based), after the savers before it
    (-1: as fit begins)."""

    def __init__(self, disk: Disk, how: str, epoch: int = 0):
        super().__init__()
        self.disk, self.how, self.epoch = disk, how, epoch

    def on_train_begin(self, logs=None):
        if self.epoch == -1:  # before fit's first write
            _break(self.disk, self.how)

    def on_epoch_end(self, epoch, logs=None):
        if epoch == self.epoch:
            _break(self.disk, self.how)


@pytest.mark.parametrize("how", _FAILURES)
def test_a_backup_that_cannot_be_written_keeps_the_previous_one_and_the_run_resumes_from_it(disk, how):
    """The issue's run: BackupAndRestore + ModelCheckpoint, the disk full (or read-only) after epoch 1's
    saves. The error names the backup, the callback and the OS error, and says the previous backup is intact;
    it is (it loads, no temporary file beside it), and fit run again resumes from it and ends bitwise where
    an uninterrupted run does (the same float operations in the same order)."""
    want = _fit([])
    backup_dir = disk.path / "backup"
    callbacks = [mr.callbacks.BackupAndRestore(backup_dir),
                 mr.callbacks.ModelCheckpoint(disk.path / "model.safetensors"), _BreakAfterEpoch(disk, how)]
    with pytest.raises(OSError) as info:
        _fit(callbacks)
    backup = backup_dir / "training_state.safetensors"
    _one_error(info, _FAILURES[how], f"BackupAndRestore({str(backup_dir)!r}): could not write {str(backup)!r}",
               "The previous backup, taken at the end of epoch 1, is intact",
               "fit() run again with this callback resumes from it")
    assert disk.files() == ["backup/training_state.safetensors", "model.safetensors"]
    _, meta = load_checkpoint(backup)
    assert meta["objects"]["fit"]["state"]["epoch"] == 1
    _mend(disk, how)
    got = _fit([mr.callbacks.BackupAndRestore(backup_dir),
                mr.callbacks.ModelCheckpoint(disk.path / "model.safetensors")])
    assert torch.equal(got, want), float((got - want).abs().max())


@pytest.mark.parametrize("how", _FAILURES)
def test_a_model_checkpoint_that_cannot_be_written_names_itself_and_keeps_the_last_file(disk, how):
    path = disk.path / "weights.{epoch}.safetensors"
    with pytest.raises(OSError) as info:
        _fit([mr.callbacks.ModelCheckpoint(path, save_weights_only=True), _BreakAfterEpoch(disk, how)])
    first, second = (str(path).format(epoch=e) for e in (1, 2))
    _one_error(info, _FAILURES[how], f"ModelCheckpoint({str(path)!r}): could not write {second!r}",
               f"The checkpoint it saved before, {first!r}, is intact (no partial file was left)")
    assert disk.files() == ["weights.1.safetensors"]
    mr.Model(nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 3))).load_weights(first)


@pytest.mark.parametrize("how", _FAILURES)
def test_a_csv_row_that_cannot_be_written_leaves_the_rows_before_whole(disk, how):
    """The log is continued (append=True) from a file that ends 10 bytes short of a page, so on a full
    tmpfs the row's first bytes still fit (the kernel writes part of it) and the rest does not: the file
    must be cut back to its rows before, never end in half a row."""
    log = disk.path / "log.csv"
    header = "epoch,accuracy,loss,val_accuracy,val_loss\n"
    before = header + "x" * (os.sysconf("SC_PAGE_SIZE") - 10 - len(header) - 1) + "\n"
    log.write_text(before)
    with pytest.raises(OSError) as info:
        _fit([_BreakAfterEpoch(disk, how, epoch=-1), mr.callbacks.CSVLogger(log, append=True)])
    _one_error(info, _FAILURES[how], f"CSVLogger({str(log)!r}, append=True): could not write {str(log)!r}",
               "The rows written before are intact, and no part of this epoch's row was left")
    assert log.read_text() == before


def _tfrecords(path: Path) -> list[bytes]:
    """The records of an event file, which must end on a whole record."""
    data, records, pos = path.read_bytes(), [], 0
    while pos < len(data):
        assert pos + 12 <= len(data), f"{path} ends inside a record's header"
        (length,) = struct.unpack("<Q", data[pos:pos + 8])
        assert pos + 16 + length <= len(data), f"{path} ends inside a record"
        records.append(data[pos + 12:pos + 12 + length])
        pos += 16 + length
    return records


def test_a_tensorboard_event_that_cannot_be_written_leaves_the_file_on_a_whole_event(disk):
    """An event every step (60 an epoch, ~3.5 KB), the disk full after epoch 1: on a tmpfs epoch 2's events
    fill the event file's last page and the one that crosses it is written in part by the kernel. The file
    must be cut back to its last whole event, which TensorBoard's own Event proto parses."""
    log_dir = disk.path / "logs"
    with pytest.raises(OSError) as info:
        _fit([mr.callbacks.TensorBoard(log_dir, update_freq=1), _BreakAfterEpoch(disk, "full")], epochs=2,
             data=_data(120, 2))
    (path,) = (log_dir / "train").iterdir()
    _one_error(info, errno.ENOSPC, f"TensorBoard({str(log_dir)!r}, update_freq=1): could not write {str(path)!r}",
               "The events written before are intact (TensorBoard reads them), and no part of this one was left")
    disk.free()
    events = [Event.FromString(r) for r in _tfrecords(path)]
    assert events[0].file_version == "brain.Event:2"
    steps = [(e.step, [v.tag for v in e.summary.value]) for e in events[1:]]
    assert steps[:61] == [(i, ["batch_loss", "batch_accuracy"]) for i in range(1, 61)] + [
        (0, ["epoch_loss", "epoch_accuracy", "epoch_learning_rate"])], steps[:61]
    assert len(steps) < 122  # epoch 2 did not end


def test_tensorboard_in_a_read_only_folder_fails_before_the_first_step(disk):
    """(A file system cannot turn read-only under a file open for writing: remounting it so is refused.)"""
    log_dir = disk.path / "logs"
    with pytest.raises(OSError) as info:
        _fit([_BreakAfterEpoch(disk, "read-only", epoch=-1), mr.callbacks.TensorBoard(log_dir)])
    _one_error(info, errno.EROFS, f"TensorBoard({str(log_dir)!r}, update_freq='epoch'): could not write "
               f"'{log_dir / 'train'}/events.out.tfevents.", "No event file was made")
    assert disk.files() == []


# ---- calls: Model.save, save_weights, save_checkpoint, mr.train ------------------------------------------------

def _model():
    with mr.MirroredStrategy(devices=["cpu:0", "cpu:1"]).scope():
        model = mr.Model(nn.Linear(4, 2))
        model.compile(optimizer=mr.optimizers.SGD(learning_rate=0.1, momentum=0.9), loss="mse")
    return model


@pytest.mark.parametrize("how", _FAILURES)
@pytest.mark.parametrize("call", ["save", "save_weights"])
def test_model_save_into_a_full_or_read_only_folder_keeps_the_file_there(disk, how, call):
    model = _model()
    path = disk.path / "model.safetensors"
    getattr(model, call)(path)
    before = path.read_bytes()
    with torch.no_grad():
        model.module.weight.add_(1.0)  # (a file written now would differ)
    _break(disk, how)
    with pytest.raises(OSError) as info:
        getattr(model, call)(path)
    _one_error(info, _FAILURES[how], f"could not write {str(path)!r}",
               "The file there before is intact and no temporary file was left")
    assert disk.files() == ["model.safetensors"] and path.read_bytes() == before


@pytest.mark.parametrize("how", _FAILURES)
def test_save_checkpoint_of_a_new_file_says_nothing_was_written(disk, how):
    _break(disk, how)
    path = disk.path / "sub" / "new.safetensors"
    with pytest.raises(OSError) as info:
        save_checkpoint(path, {"w": torch.ones(100_000)}, {})
    _one_error(info, _FAILURES[how], f"save_checkpoint: could not write {str(path)!r}",
               "Nothing was written there and no temporary file was left")
    assert disk.files() == []


@pytest.mark.parametrize("how", _FAILURES)
def test_checkpoint_manager_save_keeps_the_checkpoints_before_and_the_same_number_next(disk, how):
    net = nn.Linear(3, 2)
    manager = mr.train.CheckpointManager(mr.train.Checkpoint(net=net), disk.path / "ckpts", max_to_keep=2)
    first = manager.save()
    _break(disk, how)
    with pytest.raises(OSError) as info:
        manager.save()
    _one_error(info, _FAILURES[how], f"could not write {str(disk.path / 'ckpts' / 'ckpt-2')!r}",
               f"The checkpoints saved before are intact and still listed (latest: {first!r})")
    assert mr.train.latest_checkpoint(disk.path / "ckpts") == first
    _mend(disk, how)
    assert manager.save().endswith("ckpt-2")  # the failed save took no number


# ---- the CLI: one line naming the file ---------------------------------------------------------------------------

def _cli_error(capsys) -> str:
    err = capsys.readouterr().err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    return err


def test_cli_train_into_a_full_disk_is_one_line_naming_the_file(disk, capsys):
    """--out on a disk with no room: the first write of the run, epoch 1's CSV row, fails."""
    out = disk.path / "run"
    out.mkdir()
    disk.fill()
    assert cli.main(["train", "--out", str(out), "--epochs", "1", "--verbose", "0"]) == 2
    err = _cli_error(capsys)
    assert f"could not write {str(out / 'log.csv')!r} ([Errno {errno.ENOSPC}] {os.strerror(errno.ENOSPC)})" in err


@pytest.mark.parametrize("fails", ["model.safetensors", "history.png", "run.json"])
def test_cli_train_final_files_name_themselves_and_what_is_kept(disk, capsys, monkeypatch, fails):
    """The disk fills just before one of the files written after training: the model (after the test
    split's evaluation), the plot, run.json (after the plot)."""
    out = disk.path / "run"
    owner, name, fill_first = {"model.safetensors": (mr.Model, "evaluate", False), "history.png": (cli, "_plot", True),
                               "run.json": (cli, "_plot", False)}[fails]
    real = getattr(owner, name)

    def then_fill(*args, **kwargs):
        if fill_first:
            disk.fill()
        result = real(*args, **kwargs)
        disk.fill()
        return result

    monkeypatch.setattr(owner, name, then_fill)
    assert cli.main(["train", "--out", str(out), "--epochs", "1", "--verbose", "0"]) == 2
    err = _cli_error(capsys)
    assert f"could not write {str(out / fails)!r} ([Errno {errno.ENOSPC}]" in err, err
    assert "Nothing was written there" in err and "best.safetensors" in err, err
    if fails != "model.safetensors":
        assert f"The trained model is in {str(out / 'model.safetensors')!r}" in err, err
    assert not [f for f in disk.files() if f.endswith(".tmp") or "/." in f], disk.files()


@pytest.mark.parametrize("how", _FAILURES)
def test_a_keras_archive_written_through_write_atomically_keeps_the_file_there(disk, how):
    """The helper Model.save's Keras archives go through (KerasAdapter.save_archive): Keras writes the archive
    to a temporary ".keras" name beside the target, renamed over it once whole."""
    os.environ.setdefault("KERAS_BACKEND", "torch")
    keras = pytest.importorskip("keras")
    from mirrored._files import write_atomically

    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    path = disk.path / "model.keras"
    write_atomically(path, "Model.save", lambda tmp: model.save(tmp), suffix=".keras")
    before = path.read_bytes()
    _break(disk, how)
    with pytest.raises(OSError) as info:
        write_atomically(path, "Model.save", lambda tmp: model.save(tmp), suffix=".keras")
    _one_error(info, _FAILURES[how], f"Model.save: could not write {str(path)!r}", "The file there before is intact")
    assert disk.files() == ["model.keras"] and path.read_bytes() == before
