"""`mr.train`: checkpoints for custom loops, with TF's names: Checkpoint, CheckpointManager, latest_checkpoint.

    ckpt = mr.train.Checkpoint(model=mnet, optimizer=opt, iterator=dist_iterator)
    manager = mr.train.CheckpointManager(ckpt, "ckpts", max_to_keep=3)
    ckpt.restore(manager.latest_checkpoint)      # None on a first run: nothing is restored
    ...
    manager.save()                               # ckpts/ckpt-1, ckpts/ckpt-2, ...

A Checkpoint saves the state of the objects it is given ("trackables"): mirrored modules
(strategy.mirror), mirrored optimizers, mr.Model (weights and optimizer), optimizers of
mr.optimizers once built, mr.Variable (a mirrored one's copy, a sync-on-read one's aggregate), metrics,
objects with get_state()/set_state() (a distributed iterator, an mr.data.Dataset, fit's
EpochIterator), plain torch modules, optimizers and tensors, and lists or dicts of these. Each value
is saved once, from replica 0 or aggregated, so a checkpoint restores under any replica count,
inside a strategy's scope or outside it, and into plain torch objects. One checkpoint is one file:
safetensors plus JSON metadata, written atomically by checkpoint.py and never unpickled. Beside it a
JSON file named "checkpoint" records the latest ones, for latest_checkpoint() and CheckpointManager
(TF's role for its text file of that name). restore() checks every value against its object before
it assigns any (checkpoint_checks.py), so a checkpoint that does not fit raises a CheckpointError
naming the file, the entry and what differs, and leaves every object as it was. It returns a status
with assert_consumed() and expect_partial(), as TF's: values and objects that did not pair up are
reported there, not refused, and logged when the status is collected unless expect_partial() was
called. What each kind of trackable saves is in _trackables.py. Uses checkpoint.py,
checkpoint_checks.py and the public names of mirrored.distribute.
"""
from __future__ import annotations

import json
import logging
import os
import time
import warnings
import weakref
from collections.abc import Callable
from typing import Any

from torch import Tensor

import mirrored.distribute as md
from mirrored._files import write_atomically, write_error
from mirrored.training import _trackables, checkpoint, checkpoint_checks
from mirrored.training._trackables import LossScale, RandomState
from mirrored.training.checkpoint import CheckpointError, CheckpointMismatchError

logger = logging.getLogger(__name__)

__all__ = ["Checkpoint", "CheckpointLoadStatus", "CheckpointManager", "LossScale", "RandomState", "latest_checkpoint"]

_FORMAT = "mirrored.Checkpoint/1"
_STATE_FILE = "checkpoint"  # TF's name for the file that lists a directory's checkpoints


# ---------------------------------------------------------------------------------------------
# The status of a restore.

class CheckpointLoadStatus:
    """What restore() or read() matched (tf.train.Checkpoint's load status). Its checks raise
    CheckpointMismatchError, an AssertionError as TF's and a CheckpointError; they return the status,
    so calls chain."""

    def __init__(self, path: str, missing: list[str], unused: list[str], matched: int):
        self.save_path = path
        self._missing, self._unused, self._matched = missing, unused, matched
        self._finalizer = None
        if missing or unused:  # as TF: said when the status goes away, unless expect_partial() was called
            self._finalizer = weakref.finalize(self, _log_unmatched, path, missing, unused)
            self._finalizer.atexit = False

    def assert_consumed(self) -> CheckpointLoadStatus:
        """Every value in the checkpoint went into an object, and every object got a value."""
        if self._missing or self._unused:
            raise CheckpointMismatchError(
                f"Checkpoint {self.save_path!r}: {_describe(self._missing, self._unused)} Restore into the same "
                "objects under the same names; for a partial restore, skip this check and call expect_partial() on "
                "the status.")
        return self

    def assert_existing_objects_matched(self) -> CheckpointLoadStatus:
        """Every object given got a value (the checkpoint may hold more)."""
        if self._missing:
            raise CheckpointMismatchError(f"Checkpoint {self.save_path!r}: {_describe(self._missing, [])} Restore "
                                          "into the same objects under the same names as were saved.")
        return self

    def assert_nontrivial_match(self) -> CheckpointLoadStatus:
        """At least one object got a value."""
        if not self._matched:
            raise CheckpointMismatchError(f"Checkpoint {self.save_path!r}: nothing matched. "
                                          f"{_describe(self._missing, self._unused)}")
        return self

    def expect_partial(self) -> CheckpointLoadStatus:
        """Silences the log of unmatched values (for a deliberately partial restore)."""
        if self._finalizer is not None:
            self._finalizer.detach()
        return self

    def __repr__(self) -> str:
        return (f"CheckpointLoadStatus({self.save_path!r}, matched={self._matched}, missing={len(self._missing)}, "
                f"unused={len(self._unused)})")


class _NothingRestored(CheckpointLoadStatus):
    """restore(None): no checkpoint yet (the usual first run of `ckpt.restore(manager.latest_checkpoint)`)."""

    def __init__(self) -> None:
        super().__init__("", [], [], 0)

    def _refuse(self) -> CheckpointLoadStatus:
        raise AssertionError("Checkpoint.restore(None): no checkpoint was given (latest_checkpoint() finds none "
                             "before the first save), so nothing was restored.")

    assert_consumed = assert_existing_objects_matched = assert_nontrivial_match = _refuse

    def __repr__(self) -> str:
        return "CheckpointLoadStatus(None: nothing restored)"


def _describe(missing: list[str], unused: list[str]) -> str:
    parts = []
    if missing:
        parts.append(f"{len(missing)} value(s) of the objects given are not in the checkpoint "
                     f"({', '.join(missing[:5])}{', ...' if len(missing) > 5 else ''}).")
    if unused:
        parts.append(f"{len(unused)} value(s) in the checkpoint went nowhere "
                     f"({', '.join(unused[:5])}{', ...' if len(unused) > 5 else ''}).")
    return " ".join(parts)


def _log_unmatched(path: str, missing: list[str], unused: list[str]) -> None:
    logger.warning("Checkpoint %r was restored only in part: %s Call expect_partial() on the status of restore() "
                   "to silence this.", path, _describe(missing, unused))


# ---------------------------------------------------------------------------------------------
# Checkpoint

class Checkpoint:
    """Saves and restores named trackables (tf.train.Checkpoint): `Checkpoint(model=mnet, optimizer=opt)`.

    save(prefix) writes prefix-1, prefix-2, ... (counting with save_counter, which restore() restores)
    and records the newest in the directory's "checkpoint" file; write(path) writes exactly `path` and
    records nothing; read(path) and restore(path) load one back. Call them outside strategy.run.

    Args:
      root: a trackable saved under the name "root" (TF's positional argument).
      kwargs: name=trackable: mirrored modules and optimizers, an mr.Model (its weights, optimizer and
        fp16 loss scale), mr.Variable, metrics, torch modules, optimizers and tensors, objects with
        get_state()/set_state() (a distributed iterator, an mr.data.Dataset), or lists and dicts of
        them. Names are attributes (ckpt.model); what cannot be saved is refused here, not at save().
        Values are saved once (replica 0's, or aggregated) and restored into every replica, so a
        checkpoint reads back on any replica count.

    The random state (seed, steps run) of each strategy whose mirrored modules, optimizers or variables
    are tracked is saved too, as "<path>.random" of its object whose name sorts first, so a resumed
    custom loop draws the dropout masks the uninterrupted one would have; two strategies get an entry
    each, and random=strategy.random_state reads it too. A file without it (an older mirrored's)
    restores with a warning.
    """

    def __init__(self, root: Any = None, **kwargs: Any):
        object.__setattr__(self, "_trackables", {})
        object.__setattr__(self, "_save_counter", 0)
        if root is not None:
            self.root = root
        for name, value in kwargs.items():
            setattr(self, name, value)

    def __setattr__(self, name: str, value: Any) -> None:
        if name.startswith("_"):  # our own state, not a trackable
            object.__setattr__(self, name, value)
            return
        if name == "save_counter":
            raise AttributeError("Checkpoint: 'save_counter' is reserved; name the trackable otherwise.")
        _trackables.check_name(name, "the trackable")
        list(_trackables.entries(name, value))  # refuses what cannot be saved, now rather than at the first save
        self._trackables[name] = value

    def __getattr__(self, name: str) -> Any:
        try:
            return self._trackables[name]
        except KeyError:
            names = ", ".join(self._trackables) or "none"
            raise AttributeError(f"Checkpoint has no trackable {name!r} (it has {names}).") from None

    @property
    def save_counter(self) -> int:
        """How many times save() has been called (restore() sets it from the checkpoint)."""
        return self._save_counter

    def _entries(self, saved: Any = None) -> list[tuple[str, Any, Any]]:
        """What is saved: the trackables' entries, and the random state of each strategy of a mirrored
        object among them (its replicas' dropout masks), read at the path `saved` (a file's entries) has."""
        found = [entry for name, obj in self._trackables.items() for entry in _trackables.entries(name, obj)]
        if isinstance(saved, dict):  # a random= state the file holds implicitly: read from there
            found = _trackables.named_random_at(found, saved)
        return found + _trackables.random_entries(found, saved if isinstance(saved, dict) else None)

    # ---- writing --------------------------------------------------------------------------------
    def write(self, file_path: str | os.PathLike) -> str:
        """Writes one checkpoint file at `file_path` (atomically) and returns the path. Does not count
        in save_counter or update the "checkpoint" file (as TF's write)."""
        return self._write(os.fspath(file_path), "Checkpoint.write")

    def save(self, file_prefix: str | os.PathLike) -> str:
        """Writes `{file_prefix}-{save_counter + 1}`, records it as the directory's latest checkpoint,
        and returns its path."""
        self._save_counter += 1
        try:
            path = self._write(f"{os.fspath(file_prefix)}-{self._save_counter}", "Checkpoint.save")
        except BaseException:
            self._save_counter -= 1  # nothing was saved: the next save takes this number
            raise
        directory = os.path.dirname(path) or "."
        _write_state(directory, path, [path], [time.time()], None, "Checkpoint.save")
        return path

    def _write(self, path: str, where: str) -> str:
        _require_cross_replica(where)
        if os.path.basename(path) == _STATE_FILE:
            raise ValueError(f"{where}({path!r}): {_STATE_FILE!r} is the name of the file that lists a directory's "
                             "checkpoints; choose another name.")
        tensors, objects = collect(self._entries())
        meta = {"format": _FORMAT, "save_counter": self._save_counter, "objects": objects}
        checkpoint.save_checkpoint(path, tensors, meta, where=where)
        return path

    # ---- reading ----------------------------------------------------------------------------------
    def read(self, save_path: str | os.PathLike) -> CheckpointLoadStatus:
        """Restores from a file written by write() or save(); save_counter is left as it is (as TF's read)."""
        return self._read(os.fspath(save_path), "Checkpoint.read", restore_counter=False)

    def restore(self, save_path: str | os.PathLike | None) -> CheckpointLoadStatus:
        """Restores from `save_path` (e.g. latest_checkpoint(dir)), save_counter included; None restores
        nothing (a first run), and the status's assert_consumed() says so."""
        if save_path is None:
            return _NothingRestored()
        return self._read(os.fspath(save_path), "Checkpoint.restore", restore_counter=True)

    def _read(self, path: str, where: str, restore_counter: bool, origin: checkpoint_checks.Origin | None = None,
              complete: bool = False) -> CheckpointLoadStatus:
        """Checks every entry of the file at `path` against its object, then assigns them all. `origin` names
        the reader in errors (default: `where` and the path); `complete` (BackupAndRestore) refuses,
        before assigning anything, values and objects that do not pair up, which a status reports otherwise."""
        _require_cross_replica(where)
        tensors, meta = checkpoint.load_checkpoint(path, where=where)
        origin = origin or checkpoint_checks.Origin(
            f"{where}({path!r})", "Restore into objects like those that were saved: the same kinds under the same "
            "names, of the same shapes.")
        if meta.get("format") != _FORMAT:
            hint = (" It is a Model file: load it with mr.Model.load() or model.load_weights()."
                    if str(meta.get("format", "")).startswith("mirrored.Model") else "")
            raise CheckpointError(f"{origin.where}: not a checkpoint of mr.train.Checkpoint (format "
                                  f"{meta.get('format')!r:.60}).{hint}")
        counter = meta.get("save_counter", 0)
        if not checkpoint_checks.is_count(counter) or counter >= 1 << 63:
            raise origin.damaged(f"its save_counter is {counter!r:.40}, not a whole number >= 0")
        restores, missing, unused = self._check(tensors, meta.get("objects", {}), origin, complete,
                                                f"{where}({path!r})")
        _apply(restores, origin)
        if restore_counter:
            self._save_counter = counter
        return CheckpointLoadStatus(path, missing, unused, len(restores))

    def _check(self, tensors: dict[str, Tensor], saved: Any, origin: checkpoint_checks.Origin, complete: bool,
               reader: str = "Checkpoint") -> tuple[list[_trackables.Restore], list[str], list[str]]:
        """Every entry checked in full against its object, nothing assigned: the checked restores, and the
        values of the objects that the file lacks (missing) and those of the file that no object takes (unused)."""
        if not isinstance(saved, dict):
            raise origin.damaged(f"its 'objects' are {saved!r:.60}, not a dict of entries")
        return check_entries(self._entries(saved), tensors, saved, origin, complete, reader)

    def __repr__(self) -> str:
        return f"Checkpoint({', '.join(f'{k}={type(v).__name__}' for k, v in self._trackables.items())})"


def collect(found: list[tuple[str, Any, Any]]) -> tuple[dict[str, Tensor], dict[str, Any]]:
    """The tensors and the entries (JSON) that the trackables of `found` ((path, kind, object), as
    _trackables.entries gives them) save: what a checkpoint file holds, and Model.save's."""
    tensors: dict[str, Tensor] = {}
    objects: dict[str, Any] = {}
    for entry_path, kind, obj in found:
        entry_tensors, objects[entry_path] = kind.save(obj, entry_path)
        tensors.update(entry_tensors)
    return tensors, objects


def check_entries(found: list[tuple[str, Any, Any]], tensors: dict[str, Tensor], saved: dict[str, Any],
                  origin: checkpoint_checks.Origin, complete: bool, reader: str
                  ) -> tuple[list[_trackables.Restore], list[str], list[str]]:
    """Every entry of `found` checked in full against the file's (`saved`), nothing assigned: the checked
    restores, the values of the objects that the file lacks (missing) and those of the file that no
    object takes (unused); with `complete`, either is a CheckpointMismatchError instead."""
    names: dict[int, str] = {}
    for entry_path, kind, obj in found:
        if kind.kind == "module":
            names.update(_trackables.module_names(entry_path, obj))
    ctx = _trackables.Context(origin, names, complete)
    restores: list[_trackables.Restore] = []
    missing: list[str] = []
    for entry_path, kind, obj in found:
        entry = saved.get(entry_path)
        if entry is None and getattr(kind, "absent", None):  # an entry that files of older versions lack
            warnings.warn(f"{reader}: the file {kind.absent.format(path=entry_path)}", stacklevel=5)
            continue
        if entry is None:
            missing.append(entry_path)
            continue
        if not isinstance(entry, dict) or not isinstance(entry.get("kind"), str):
            raise origin.damaged(f"its entry {entry_path!r} is {entry!r:.60}, not a dict with a 'kind'")
        if entry["kind"] != kind.kind:
            raise origin.mismatch(f"{entry_path} holds kind {entry['kind']!r:.40} in the checkpoint, but the "
                                  f"object given under that name, a {type(obj).__name__}, is of kind "
                                  f"{kind.kind!r}")
        restores.append(kind.check(obj, entry_path, tensors, entry, ctx))
    given = {entry_path for entry_path, _, _ in found}
    missing += [m for r in restores for m in r.missing]
    unused = [u for r in restores for u in r.unused] + [
        p for p, entry in saved.items()
        if p not in given and not (isinstance(entry, dict) and entry.get("implicit") is True)]
    if complete and (missing or unused):
        raise origin.mismatch(_describe(missing, unused).rstrip("."), CheckpointMismatchError)
    return restores, missing, unused


def apply_restores(restores: list[_trackables.Restore], origin: checkpoint_checks.Origin) -> None:
    """Assigns checked entries (check_entries'); see _apply."""
    _apply(restores, origin)


def _apply(restores: list[_trackables.Restore], origin: checkpoint_checks.Origin) -> None:
    """Assigns checked entries. Those that may still refuse (a set_state() that replays data) go first;
    if one does, they are all put back, so that nothing has changed."""
    fallible = [r for r in restores if r.undo is not None]
    for i, restore in enumerate(fallible):
        try:
            restore.apply()
        except Exception as e:  # noqa: BLE001 - whatever set_state raises, the objects go back as they were
            for done in reversed(fallible[:i + 1]):
                try:
                    done.undo()
                except Exception:  # noqa: BLE001 - the first error is the one to report
                    logger.exception("Checkpoint: could not put %s back as it was", done.path)
            raise origin.mismatch(f"{restore.path}.set_state() refused the saved state ({type(e).__name__}: "
                                  f"{str(e)[:300]}); nothing was restored") from e
    for restore in restores:
        if restore.undo is None:
            restore.apply()


def _require_cross_replica(where: str) -> None:
    if md.has_strategy() and md.get_replica_context() is not None:
        raise RuntimeError(f"{where} was called inside strategy.run (replica context); call it outside, where one "
                           "call saves or restores every replica.")


# ---------------------------------------------------------------------------------------------
# The "checkpoint" file: which checkpoints a directory holds, newest last (JSON, written atomically).

def _write_state(directory: str, latest: str, paths: list[str], timestamps: list[float],
                 last_preserved: float | None, writer: str) -> None:
    def relative(p: str) -> str:
        return os.path.relpath(os.path.abspath(p), os.path.abspath(directory))

    state = {"model_checkpoint_path": relative(latest), "all_model_checkpoint_paths": [relative(p) for p in paths],
             "all_model_checkpoint_timestamps": timestamps, "last_preserved_timestamp": last_preserved}

    def write(tmp: str) -> None:
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(state, f, indent=1)

    target = os.path.join(directory, _STATE_FILE)
    before = ("the list there before is intact, so latest_checkpoint() gives the checkpoint before it"
              if os.path.isfile(target) else "no list was there before, so latest_checkpoint() finds none")
    write_atomically(target, f"{writer} (the list of checkpoints)", write,
                     kept=f"The checkpoint {latest!r} itself was written, but {before}.")


def _read_state(directory: str, filename: str | None = None) -> dict[str, Any] | None:
    """The directory's "checkpoint" file with its paths made absolute (joined with the directory);
    None when there is none."""
    path = os.path.join(directory, filename or _STATE_FILE)
    if not os.path.isfile(path):
        return None
    with open(path, encoding="utf-8") as f:
        text = f.read()
    try:
        state = json.loads(text)
        latest = state["model_checkpoint_path"]
    except (json.JSONDecodeError, KeyError, TypeError) as e:
        tf_hint = (" It is TensorFlow's checkpoint list; mirrored's checkpoints are safetensors files, so use a "
                   "directory of its own." if text.lstrip().startswith("model_checkpoint_path:") else
                   " Delete it (the checkpoint files stay) and pass a checkpoint's path to restore() yourself.")
        raise ValueError(f"{path}: not a checkpoint list written by mr.train ({type(e).__name__}: {e}).{tf_hint}"
                         ) from e

    def absolute(p: str) -> str:
        return p if os.path.isabs(p) else os.path.join(directory, p)

    state["model_checkpoint_path"] = absolute(latest)
    state["all_model_checkpoint_paths"] = [absolute(p) for p in state.get("all_model_checkpoint_paths", [])]
    return state


def latest_checkpoint(checkpoint_dir: str | os.PathLike, latest_filename: str | None = None) -> str | None:
    """The path of the newest checkpoint that save() or a CheckpointManager recorded in `checkpoint_dir`,
    or None if there is none (tf.train.latest_checkpoint). A recorded file that is gone gives None and a
    warning."""
    directory = os.fspath(checkpoint_dir)
    state = _read_state(directory, latest_filename)
    if state is None:
        return None
    path = state["model_checkpoint_path"]
    if not os.path.isfile(path):
        logger.warning("latest_checkpoint(%r): the newest recorded checkpoint %s does not exist (deleted by hand?); "
                       "returning None", directory, path)
        return None
    return path


class CheckpointManager:
    """Numbers, records and prunes a Checkpoint's saves in one directory (tf.train.CheckpointManager).

    save() writes `{directory}/{checkpoint_name}-{n}` and deletes the oldest beyond max_to_keep (None
    keeps all), except one every keep_checkpoint_every_n_hours. With step_counter and
    checkpoint_interval, save() skips until the counter has advanced that far. A new manager on the
    same directory carries on from the "checkpoint" file.

    Args:
      checkpoint: the mr.train.Checkpoint to save and restore.
      directory: where the checkpoints and the "checkpoint" file (the record of them) live.
      max_to_keep: how many of the newest checkpoints to keep; None keeps all.
      keep_checkpoint_every_n_hours: also keep one checkpoint per this many hours of saves, beyond
        max_to_keep; None keeps none of them.
      checkpoint_name: the file name's prefix: `{directory}/{checkpoint_name}-{n}`.
      step_counter: the counter checkpoint_interval is measured in, read with int() at each save (an
        mr.Variable incremented each step, say). Saves are numbered by save_counter either way.
      checkpoint_interval: steps of step_counter between saves; save() returns None before then. None:
        every save() saves.
      init_fn: called by restore_or_initialize() when there is no checkpoint to restore.
    """

    def __init__(self, checkpoint: Checkpoint, directory: str | os.PathLike, max_to_keep: int | None,
                 keep_checkpoint_every_n_hours: float | None = None, checkpoint_name: str = "ckpt",
                 step_counter: Any = None, checkpoint_interval: int | None = None,
                 init_fn: Callable[[], Any] | None = None):
        if not isinstance(checkpoint, Checkpoint):
            raise TypeError(f"CheckpointManager: expected an mr.train.Checkpoint, got {type(checkpoint).__name__}.")
        if max_to_keep is not None and (isinstance(max_to_keep, bool) or not isinstance(max_to_keep, int)
                                        or max_to_keep <= 0):
            raise ValueError(f"CheckpointManager(max_to_keep={max_to_keep!r}): give a positive int, or None to keep "
                             "every checkpoint.")
        if checkpoint_interval is not None and step_counter is None:
            raise ValueError("CheckpointManager(checkpoint_interval=...): pass step_counter= too, the counter the "
                             "interval is measured in.")
        if not isinstance(checkpoint_name, str) or not checkpoint_name or os.sep in checkpoint_name \
                or checkpoint_name == _STATE_FILE:
            raise ValueError(f"CheckpointManager(checkpoint_name={checkpoint_name!r}): give a file name without a "
                             f"directory, other than {_STATE_FILE!r}, e.g. 'ckpt'.")
        self._checkpoint = checkpoint
        self._directory = os.fspath(directory)
        self._max_to_keep = max_to_keep
        self._keep_every_n_hours = keep_checkpoint_every_n_hours
        self._prefix = os.path.join(self._directory, checkpoint_name)
        self._step_counter = step_counter
        self._checkpoint_interval = checkpoint_interval
        self._last_checkpoint_step: int | None = None
        self._init_fn = init_fn
        self._maybe_delete: dict[str, float] = {}
        now = time.time()
        state = _read_state(self._directory)
        if state is None:
            self._latest: str | None = None
            self._last_preserved = now - 1.0  # a little back, so that a manager made at once keeps the same view
        else:
            self._latest = state["model_checkpoint_path"]
            self._last_preserved = min(float(state.get("last_preserved_timestamp") or now), now)
            paths = state["all_model_checkpoint_paths"]
            stamps = state.get("all_model_checkpoint_timestamps") or [self._last_preserved] * len(paths)
            for path, stamp in zip(paths, stamps):
                if min(stamp, now) > self._last_preserved:
                    self._maybe_delete[path] = min(stamp, now)

    directory = property(lambda self: self._directory, doc="The directory the manager saves into.")
    checkpoint = property(lambda self: self._checkpoint, doc="The Checkpoint whose saves it numbers.")
    checkpoint_interval = property(lambda self: self._checkpoint_interval,
                                   doc="Steps of step_counter between saves (None: every save() saves).")

    @property
    def latest_checkpoint(self) -> str | None:
        """The newest checkpoint's path, or None: what to pass to Checkpoint.restore() to resume."""
        return self._latest

    @property
    def checkpoints(self) -> list[str]:
        """The managed checkpoints, oldest first (those kept by keep_checkpoint_every_n_hours are not listed)."""
        return list(self._maybe_delete)

    def save(self, checkpoint_number: int | None = None, check_interval: bool = True) -> str | None:
        """Writes a new checkpoint (numbered by the Checkpoint's save_counter, or checkpoint_number),
        records it, prunes old ones, and returns its path; None when checkpoint_interval skips it."""
        if self._checkpoint_interval is not None:
            current = int(self._step_counter)
            if self._last_checkpoint_step is not None:
                if current == self._last_checkpoint_step:
                    return None
                if check_interval and current < self._last_checkpoint_step + self._checkpoint_interval:
                    return None
        ckpt = self._checkpoint
        ckpt._save_counter += 1  # (the file records the count it makes)
        number = ckpt._save_counter if checkpoint_number is None else int(checkpoint_number)
        try:
            path = ckpt._write(f"{self._prefix}-{number}", "CheckpointManager.save")
        except OSError as e:  # nothing changed: the next save() tries again with the same number
            ckpt._save_counter -= 1
            kept = (f"The checkpoints saved before are intact and still listed (latest: {self._latest!r})."
                    if self._latest else "No checkpoint was saved there before.")
            raise write_error(e, f"{self._prefix}-{number}", repr(self), kept) from None
        if self._checkpoint_interval is not None:
            self._last_checkpoint_step = current
        self._maybe_delete.pop(path, None)  # saved again: it moves to the end of the queue
        self._maybe_delete[path] = time.time()
        self._latest = path
        # The list names the new checkpoint before anything is deleted, and again after.
        self._record_state()
        self._sweep()
        self._record_state()
        return path

    def restore_or_initialize(self) -> str | None:
        """Restores the latest checkpoint and returns its path; without one, calls init_fn (if given) and
        returns None."""
        if self._latest is not None:
            self._checkpoint.restore(self._latest)
            if self._checkpoint_interval is not None:
                self._last_checkpoint_step = int(self._step_counter)
            return self._latest
        if self._init_fn is not None:
            self._init_fn()
        return None

    def _sweep(self) -> None:
        if not self._max_to_keep:
            return
        while len(self._maybe_delete) > self._max_to_keep:
            path, stamp = next(iter(self._maybe_delete.items()))
            del self._maybe_delete[path]
            if self._keep_every_n_hours and stamp - self._keep_every_n_hours * 3600.0 >= self._last_preserved:
                self._last_preserved = stamp  # kept for good, and no longer listed
                continue
            try:
                os.remove(path)
            except FileNotFoundError:
                pass

    def _record_state(self) -> None:
        _write_state(self._directory, self._latest, list(self._maybe_delete), list(self._maybe_delete.values()),
                     self._last_preserved, repr(self))

    def __repr__(self) -> str:
        return (f"CheckpointManager({self._directory!r}, max_to_keep={self._max_to_keep}, "
                f"latest={self._latest!r})")
