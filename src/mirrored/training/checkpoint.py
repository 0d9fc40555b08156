"""Checkpoints: one safetensors file of tensors plus JSON metadata, written atomically, never pickled.

save_checkpoint() writes tensors and a JSON-able dict (kept in the safetensors header under
"mirrored") to a temporary file beside `path`, fsyncs it and renames it over `path`, so a crash
leaves either the old checkpoint or the new one; the temporary file of a writer that was killed
(kill -9, power loss) is removed by the next save into that folder, and a write that fails (a full
disk, a read-only folder) is one FileWriteError (mirrored._files) naming the file, the call and
what was kept. load_checkpoint() reads it
back without pickle: nothing in a checkpoint can run code, and a file that is not what it claims
(damaged, truncated, forged lengths, not a regular file) raises CheckpointError naming it. Each
tensor is read into memory of its own, never left a view of a memory map of the file.
optimizer_state_to_flat()/optimizer_state_from_flat() and capture_rng_state()/restore_rng_state()
turn a torch optimizer's state_dict and the RNG states into tensors + JSON for it;
load_state_dict() gives the model weights as a plain state_dict. decode_value() is the one decoder
of the tags in that JSON (tensors, tuples, [key, value] pairs), with its checks. Whether a file fits
the model it is loaded into is checked in checkpoint_checks.py. The safetensors layout is written
and read here (any safetensors reader loads the files). Uses torch and the stdlib (and numpy for
the RNG state it owns and the tensors' bytes).
"""
from __future__ import annotations

import collections
import hashlib
import json
import logging
import math
import os
import random
import re
import socket
import stat
import struct
import time
import uuid
import warnings
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import torch
from torch import Tensor

from mirrored._files import FileWriteError, write_error

logger = logging.getLogger(__name__)

__all__ = [
    "CheckpointError", "CheckpointMismatchError", "FileWriteError", "capture_rng_state", "decode_value",
    "load_checkpoint", "load_state_dict", "optimizer_state_from_flat",
    "optimizer_state_to_flat", "restore_rng_state", "save_checkpoint",
]

_METADATA_KEY = "mirrored"  # our JSON lives under this key of the safetensors header metadata
_MAX_HEADER_BYTES = 100 << 20  # safetensors' own limit; a larger "header" means a foreign file
# JSON cannot hold tensors or tuples: they are written as one-key objects with these tags.
_TENSOR_TAG = "__tensor__"
_TUPLE_TAG = "__tuple__"
# A dict whose keys are not all str (JSON's only keys): its [key, value] pairs, e.g. MultiStepLR's
# milestones, a Counter of epochs, which stays a Counter (a missing epoch counts 0 there).
_ITEMS_TAG = "__items__"
_COUNTER_TAG = "__counter__"
_MAX_DEPTH = 32  # JSON nesting deeper than any optimizer setting: a damaged file, not recursion
# safetensors dtype names and the torch dtypes they are read as (whose itemsize the offsets must agree with).
_DTYPES = {"BOOL": torch.bool, "U8": torch.uint8, "I8": torch.int8, "F8_E4M3": torch.float8_e4m3fn,
           "F8_E5M2": torch.float8_e5m2, "F8_E4M3FNUZ": torch.float8_e4m3fnuz,
           "F8_E5M2FNUZ": torch.float8_e5m2fnuz, "I16": torch.int16, "U16": torch.uint16,
           "F16": torch.float16, "BF16": torch.bfloat16, "I32": torch.int32, "U32": torch.uint32,
           "F32": torch.float32, "C64": torch.complex64, "I64": torch.int64, "U64": torch.uint64,
           "F64": torch.float64}
_DTYPE_NAMES = {dtype: name for name, dtype in _DTYPES.items()}
_MAX_DIMS = 64  # more dimensions than any tensor has: a forged shape, refused before it is used
# Temporary files are ".<name>.<host>-<pid>.<random>.tmp": the host and pid say whose they are, so
# a later save can tell a dead writer's leftovers from a live writer's file (see _remove_stale_temps).
_TEMP_RE = re.compile(r"^\..+\.(?P<host>[0-9a-f]{8})-(?P<pid>\d+)\.[0-9a-f]{12}\.tmp$")
# Another host's temporary file cannot be checked for a live writer; one untouched this long is
# taken as abandoned (a writer rewrites its file continuously until the rename).
_FOREIGN_TEMP_AGE_S = 3600.0


class CheckpointError(ValueError):
    """A checkpoint file that cannot be loaded: damaged, truncated, forged, foreign, or not matching
    what it is loaded into. The message names the file and what is wrong. (A missing file raises
    FileNotFoundError, a directory IsADirectoryError, as open() does.)"""


class CheckpointMismatchError(CheckpointError, AssertionError):
    """The values of a checkpoint and the objects restored from it do not pair up one to one: what
    mr.train's assert_consumed() raises (an AssertionError, as TF's does), and a CheckpointError
    naming the file, so that code handling bad checkpoints handles it too."""


# --------------------------------------------------------------------------------------------
# Files


# Names other tools read as their own format: Keras's HDF5 and zip files, torch.save's pickles.
_FOREIGN_SUFFIXES = {".h5": "HDF5", ".hdf5": "HDF5", ".keras": "Keras zip", ".pt": "torch.save",
                     ".pth": "torch.save", ".pkl": "pickle"}
_warned_paths: set[str] = set()


def check_file_path(path: str, where: str, keras_archive_ok: bool = False) -> None:
    """Refuses a path that names a directory (a TF SavedModel habit): a checkpoint is one file. Warns,
    once per path, where its suffix promises another format (model.h5, a .keras or .pt file): the file
    is safetensors whatever its name, and tools of that format would fail on it."""
    if path.endswith(("/", os.sep)) or os.path.isdir(path):
        raise ValueError(f"{where}({path!r}): that is a directory; a checkpoint is one safetensors file. Give "
                         f"a file name, e.g. {os.path.join(path, 'model.safetensors')!r}.")
    stem, suffix = os.path.splitext(path)
    foreign = _FOREIGN_SUFFIXES.get(suffix.lower())
    if keras_archive_ok and suffix.lower() == ".keras":  # a Keras model's save writes Keras's archive there
        foreign = None
    if foreign is not None and path not in _warned_paths:
        _warned_paths.add(path)
        warnings.warn(f"{where}({path!r}): the file will be safetensors + JSON, not {foreign}, whatever its "
                      f"suffix; name it {stem + '.safetensors'!r} so that no tool takes it for {foreign}.",
                      UserWarning, stacklevel=3)


def save_checkpoint(path: str | os.PathLike, tensors: Mapping[str, Tensor],
                    metadata: Mapping[str, Any], *, where: str = "save_checkpoint") -> None:
    """Writes `tensors` and JSON `metadata` to one safetensors file at `path`, atomically.

    Tensors are detached, moved to CPU and made contiguous (tensors that share storage are each written).
    The file is written beside `path`, fsynced and renamed over it (then the directory is fsynced),
    so on any failure `path` keeps its previous content and no temporary file is left behind. A write
    that fails (a full disk, a read-only folder) raises FileWriteError (an OSError) naming the file,
    `where` (the call), the OS error and what was kept.
    """
    path = os.fspath(path)
    check_file_path(path, where)
    flat = _cpu_tensors(path, tensors)
    try:
        header = {_METADATA_KEY: json.dumps(dict(metadata)), "format": "pt"}
    except (TypeError, ValueError) as e:
        raise TypeError(f"{where}({path!r}): metadata is not JSON-serializable ({e}). Keep "
                        f"tensors in `tensors` and only str/int/float/bool/None/list/dict in "
                        f"`metadata`.") from e
    directory = os.path.dirname(os.path.abspath(path))
    existed = os.path.isfile(path)
    tmp_path = os.path.join(directory, f".{os.path.basename(path)}.{_HOST}-{os.getpid()}."
                                       f"{uuid.uuid4().hex[:12]}.tmp")
    try:
        os.makedirs(directory, exist_ok=True)
        _remove_stale_temps(directory)
        _write_file(tmp_path, flat, header, _old_mode(path))
        os.replace(tmp_path, path)
    except BaseException as e:
        try:
            os.unlink(tmp_path)
        except OSError:  # never made (a read-only folder), or it cannot go: said below
            pass
        if not isinstance(e, OSError):
            raise
        left = " and no temporary file was left" if not os.path.lexists(tmp_path) else (
            f"; its temporary file {tmp_path!r} could not be removed (the next save there removes it)")
        kept = "The file there before is intact" if existed else "Nothing was written there"
        raise write_error(e, path, where, f"{kept}{left}.") from None
    _fsync_directory(directory)  # makes the rename itself survive a crash


def _host_tag() -> str:
    return hashlib.sha1(socket.gethostname().encode("utf-8", "replace")).hexdigest()[:8]


_HOST = _host_tag()  # this machine, in temporary file names (hashed: host names may hold dots)


def _remove_stale_temps(directory: str) -> None:
    """Removes the temporary files that killed writers left in `directory`: only names of ours,
    and only those whose writer is gone (its pid is not alive here; for another host's file, not
    written for _FOREIGN_TEMP_AGE_S). A writer saving into the same folder is never disturbed."""
    try:
        names = os.listdir(directory)
    except OSError:
        return
    for name in names:
        match = _TEMP_RE.match(name)
        if match is None:
            continue
        full = os.path.join(directory, name)
        try:
            if match["host"] == _HOST:
                if _pid_alive(int(match["pid"])):
                    continue
            elif time.time() - os.lstat(full).st_mtime < _FOREIGN_TEMP_AGE_S:
                continue
            if not stat.S_ISREG(os.lstat(full).st_mode):
                continue
            os.unlink(full)
            logger.info("removed %s, the temporary file of a checkpoint save that was killed", full)
        except OSError as e:  # gone already, or not ours to remove: the save itself goes on
            logger.debug("could not remove stale temporary file %s: %s", full, e)


def _pid_alive(pid: int) -> bool:
    if os.name == "nt":  # os.kill(pid, 0) terminates the process on Windows: assume it alive
        return True
    if pid <= 0:  # no writer has pid 0; kill(0, 0) would ask about our own process group
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's live process
        return True
    except OverflowError:  # no such pid can exist
        return False
    return True


def _old_mode(path: str) -> int | None:
    """The permissions of the file `path` replaces, which the new one keeps; None for a new file."""
    try:
        return os.stat(path).st_mode & 0o777
    except FileNotFoundError:
        return None


def _write_file(tmp_path: str, tensors: Mapping[str, Tensor], metadata: dict[str, str], mode: int | None) -> None:
    """Writes `tensors` (CPU, contiguous) and `metadata` as a safetensors file at `tmp_path`, created with
    permissions `mode` (None: what the umask gives), and fsyncs it.

    Written here, streamed from each tensor's own memory: safetensors.torch.save_file writes a temporary
    file of its own (".tmpXXXXXX"), which a killed writer left behind under a name _remove_stale_temps
    cannot know, and safetensors.torch.save holds two whole copies of the checkpoint in memory."""
    # safetensors' order: by element size, largest first, then by name, so after a header padded to 8
    # bytes every tensor's data is aligned to its element size.
    order = sorted(tensors, key=lambda name: (-tensors[name].element_size(), name))
    entries, offset = {}, 0
    for name in order:
        t = tensors[name]
        size = t.numel() * t.element_size()
        entries[name] = {"dtype": _DTYPE_NAMES[t.dtype], "shape": list(t.shape),
                         "data_offsets": [offset, offset + size]}
        offset += size
    header = json.dumps({"__metadata__": metadata, **entries}, separators=(",", ":")).encode()
    header += b" " * (-len(header) % 8)
    fd = os.open(tmp_path, os.O_CREAT | os.O_EXCL | os.O_WRONLY | getattr(os, "O_BINARY", 0), 0o666)
    try:
        if mode is not None:
            os.chmod(tmp_path, mode)
        for chunk in (struct.pack("<Q", len(header)) + header, *(_little_endian_bytes(tensors[n]) for n in order)):
            view = memoryview(chunk)
            while view:
                view = view[os.write(fd, view):]
    finally:
        os.close(fd)
    _fsync_file(tmp_path)


def _little_endian_bytes(t: Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor, without a copy (on a little-endian machine)."""
    raw = t.reshape(-1).view(torch.uint8)
    if not np.little_endian and t.element_size() > 1 and t.numel():
        raw = raw.view(-1, t.element_size()).flip(1).reshape(-1)
    return memoryview(raw.numpy())


def _cpu_tensors(path: str, tensors: Mapping[str, Tensor]) -> dict[str, Tensor]:
    if not isinstance(tensors, Mapping):
        raise TypeError(f"save_checkpoint({path!r}): tensors must be a mapping of name -> Tensor, "
                        f"got {type(tensors).__name__}.")
    flat: dict[str, Tensor] = {}
    for name, tensor in tensors.items():
        if not isinstance(name, str):
            raise TypeError(f"save_checkpoint({path!r}): tensor names must be str, got "
                            f"{name!r} ({type(name).__name__}).")
        if not isinstance(tensor, Tensor):
            raise TypeError(f"save_checkpoint({path!r}): tensors[{name!r}] is a "
                            f"{type(tensor).__name__}, not a torch.Tensor. Put plain values in "
                            f"`metadata` instead.")
        if tensor.layout != torch.strided:
            raise TypeError(f"save_checkpoint({path!r}): tensors[{name!r}] has layout "
                            f"{tensor.layout}; convert it with .to_dense() first.")
        if tensor.dtype not in _DTYPE_NAMES:
            raise TypeError(f"save_checkpoint({path!r}): tensors[{name!r}] has dtype {tensor.dtype}, which "
                            f"safetensors cannot hold; convert it to one of "
                            f"{', '.join(str(d).removeprefix('torch.') for d in _DTYPE_NAMES)}.")
        if name == "__metadata__":
            raise ValueError(f"save_checkpoint({path!r}): '__metadata__' is the name of the safetensors "
                             "header's metadata; give the tensor another name.")
        # (Tensors that share storage, e.g. tied weights, are each written whole: no clone needed.)
        flat[name] = tensor.detach().to("cpu").contiguous()
    return flat


def _fsync_file(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)  # fsync flushes the inode, whichever descriptor asks
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_directory(directory: str) -> None:
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:  # e.g. Windows cannot open a directory; the rename is still atomic
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def load_checkpoint(path: str | os.PathLike, device: str | torch.device = "cpu", *,
                    where: str = "load_checkpoint") -> tuple[dict[str, Tensor], dict[str, Any]]:
    """The tensors (on `device`) and JSON metadata of a file written by save_checkpoint().

    Never unpickles (no torch.load); no tensor is a view of the file. A file that cannot be read raises
    CheckpointError (a ValueError) naming it, its errors prefixed with `where`.
    """
    path = os.fspath(path)
    tensors, header = _read(path, device, where)
    if _METADATA_KEY not in header:
        raise CheckpointError(
            f"{where}({path!r}): a safetensors file without mirrored's metadata (it was "
            f"not written by save_checkpoint()/Model.save()). For its weights alone use "
            f"load_state_dict({path!r}, prefix=\"\"), or safetensors.torch.load_file().")
    try:
        metadata = json.loads(header[_METADATA_KEY])
    except (ValueError, RecursionError) as e:
        raise CheckpointError(f"{where}({path!r}): the metadata under {_METADATA_KEY!r} is "
                              f"not valid JSON ({type(e).__name__}: {str(e)[:200]}); the file is "
                              f"damaged. Use an older checkpoint.") from None
    if not isinstance(metadata, dict):
        raise CheckpointError(f"{where}({path!r}): the metadata is a "
                              f"{type(metadata).__name__}, expected a JSON object; the file was not "
                              f"written by save_checkpoint().")
    return tensors, metadata


def load_state_dict(path: str | os.PathLike, prefix: str = "model/", *,
                    where: str = "load_state_dict") -> dict[str, Tensor]:
    """The tensors of a checkpoint whose names start with `prefix`, prefix removed: the model's
    weights as a state_dict for a plain nn.Module (`net.load_state_dict(load_state_dict(path))`)."""
    path = os.fspath(path)
    tensors, _ = _read(path, "cpu", where)
    state = {name[len(prefix):]: t for name, t in tensors.items() if name.startswith(prefix)}
    if not state:
        some = ", ".join(sorted(tensors)[:5]) or "none"
        raise CheckpointError(f"{where}({path!r}, prefix={prefix!r}): no tensor name starts "
                              f"with {prefix!r} (names: {some}{', ...' if len(tensors) > 5 else ''}). "
                              f"Pass the prefix the file uses, or prefix=\"\" for all tensors.")
    return state


def _read(path: str, device: str | torch.device, where: str) -> tuple[dict[str, Tensor], dict]:
    """Tensors and header metadata of a safetensors file, with errors that say what the file is.

    The header is parsed and checked here first (JSON, dtypes, shapes, offsets that add up to the
    file's size), so every tensor then allocated is backed by bytes of the file: a forged length or
    shape is refused before it reaches the allocator. The tensors are read into memory of their own,
    never memory-mapped: one that outlives the load (in a state dict, an optimizer, an exception's
    traceback) would turn a later rewrite of the file in place into a SIGBUS that kills the process."""
    fd = _open_regular(path, where)
    try:
        entries, metadata, data_start = _read_header(fd, path, where)
        tensors = _read_tensors(fd, entries, data_start, path, where)
    finally:
        os.close(fd)
    if torch.device(device).type != "cpu":
        tensors = {name: t.to(device) for name, t in tensors.items()}
    return tensors, metadata


def _read_tensors(fd: int, entries: Mapping[str, dict], data_start: int, path: str,
                  where: str) -> dict[str, Tensor]:
    """Each tensor of the checked header `entries`, read from `fd` straight into a tensor of its own
    (one copy, from the kernel). A file that shrinks meanwhile is a CheckpointError, not a crash."""
    tensors: dict[str, Tensor] = {}
    with open(fd, "rb", buffering=0, closefd=False) as reader:  # (fd stays open: _read closes it)
        reader.seek(data_start)
        # The entries tile the data section in order of their offsets (checked): one pass reads them.
        for name, entry in sorted(entries.items(), key=lambda item: item[1]["data_offsets"][0]):
            tensors[name] = _read_tensor(reader, name, entry, path, where)
    return tensors


def _read_tensor(reader: Any, name: str, entry: dict, path: str, where: str) -> Tensor:
    begin, end = entry["data_offsets"]
    raw = torch.empty(end - begin, dtype=torch.uint8)
    view, done = memoryview(raw.numpy()), 0
    while done < len(view):
        got = reader.readinto(view[done:])
        if not got:
            raise CheckpointError(
                f"{where}({path!r}): the file ended at data byte {begin + done} while tensor {name!r} was "
                f"read (its header says {end}): it was truncated or rewritten during the load. Load it again "
                "once nothing writes it, or use another copy.")
        done += got
    dtype = _DTYPES[entry["dtype"]]
    if not np.little_endian and dtype.itemsize > 1 and len(raw):  # safetensors is little-endian
        raw = raw.view(-1, dtype.itemsize).flip(1).reshape(-1)
    return raw.view(dtype).reshape(entry["shape"])


def _open_regular(path: str, where: str) -> int:
    """A read descriptor for `path` if it is a regular file. Opened non-blocking and checked with
    fstat, so a named pipe or a device is refused at once instead of blocking the reader forever."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_BINARY", 0))
    except FileNotFoundError:
        raise FileNotFoundError(f"{where}({path!r}): no such file. Check the path; a checkpoint is "
                                f"written by Model.save(), ModelCheckpoint or save_checkpoint().") from None
    except IsADirectoryError:
        fd = None
    mode = os.fstat(fd).st_mode if fd is not None else stat.S_IFDIR
    if stat.S_ISDIR(mode):
        if fd is not None:
            os.close(fd)
        raise IsADirectoryError(f"{where}({path!r}): this is a directory; pass the checkpoint file "
                                f"inside it (e.g. {os.path.join(path, 'model.safetensors')}).")
    if not stat.S_ISREG(mode):
        os.close(fd)
        kind = ("a named pipe" if stat.S_ISFIFO(mode) else "a socket" if stat.S_ISSOCK(mode)
                else "a device" if stat.S_ISCHR(mode) or stat.S_ISBLK(mode) else "not a regular file")
        raise CheckpointError(f"{where}({path!r}): this is {kind}, not a checkpoint file; only regular "
                              f"files are read. Pass the .safetensors file itself.")
    return fd


def _read_header(fd: int, path: str, where: str) -> tuple[dict[str, dict], dict[str, str], int]:
    """The tensor entries and __metadata__ of the header of the file open at `fd`, once the whole
    header is checked, and where its data section begins; CheckpointError naming the file and the
    first problem otherwise."""
    size = os.fstat(fd).st_size
    start = os.pread(fd, 9, 0)
    header_bytes = struct.unpack("<Q", start[:8])[0] if len(start) >= 8 else None
    plausible = (header_bytes is not None and len(start) == 9 and start[8:9] == b"{"
                 and header_bytes <= _MAX_HEADER_BYTES)
    if plausible and header_bytes <= size - 8:
        raw = os.pread(fd, header_bytes, 8)
        if len(raw) < header_bytes:  # shrunk since fstat: as truncated
            size = 8 + len(raw)
    if not plausible:
        # Not safetensors: say what it looks like. (Only now, since a valid header size may itself
        # begin with the bytes checked here.)
        if start[:4] == b"PK\x03\x04" or start[:1] == b"\x80":
            problem = ("it looks like a torch.save()/pickle file, which mirrored never loads because "
                       "unpickling can run arbitrary code")
        elif len(start) < 9:
            problem = f"it is only {size} byte{'s' if size != 1 else ''} long"
        elif start[8:9] == b"{":
            problem = (f"its header claims {header_bytes} bytes, more than the "
                       f"{_MAX_HEADER_BYTES} safetensors allows")
        else:
            problem = "its first bytes are not a safetensors header"
        raise CheckpointError(f"{where}({path!r}): not a safetensors checkpoint: {problem}. Load it "
                              f"with the tool that wrote it and re-save it with Model.save() or "
                              f"save_checkpoint().")
    if header_bytes > size - 8:
        raise CheckpointError(
            f"{where}({path!r}): the checkpoint is truncated or damaged: its safetensors header "
            f"claims {header_bytes} bytes but the file holds {size - 8} after the size field. "
            "Use another copy (a backup, an earlier checkpoint) or train again.")
    damaged = (f"{where}({path!r}): the checkpoint is damaged: its safetensors header")
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise CheckpointError(f"{damaged} is not valid JSON ({type(e).__name__}: {str(e)[:200]}). Use "
                              f"another copy (a backup, an earlier checkpoint) or train again.") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{damaged} is a JSON {type(header).__name__}, not an object. Use another copy.")
    _check_header_entries(header, size - 8 - header_bytes, path, where)
    metadata = header.pop("__metadata__", None) or {}
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise CheckpointError(f"{damaged}'s __metadata__ is not a mapping of strings. Use another copy.")
    return header, metadata, 8 + header_bytes


def _check_header_entries(header: dict, data_bytes: int, path: str, where: str) -> None:
    """Every tensor entry has a known dtype, a shape of whole numbers and offsets that match them,
    and the entries tile the data section exactly (what safetensors itself requires)."""
    damaged = f"{where}({path!r}): the checkpoint is damaged: its safetensors header"
    spans = []
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        if not isinstance(entry, dict) or set(entry) != {"dtype", "shape", "data_offsets"}:
            raise CheckpointError(f"{damaged} entry for {name!r} is not a tensor description "
                                  f"(dtype, shape, data_offsets). Use another copy.")
        dtype, shape, offsets = entry["dtype"], entry["shape"], entry["data_offsets"]
        if not isinstance(dtype, str) or dtype not in _DTYPES:
            raise CheckpointError(f"{damaged} gives tensor {name!r} the dtype {dtype!r:.50}, which "
                                  f"mirrored does not read ({', '.join(_DTYPES)}). Use another copy.")
        if (not isinstance(shape, list) or len(shape) > _MAX_DIMS
                or not all(_is_count(d) for d in shape) or math.prod(max(d, 1) for d in shape) >= 1 << 63):
            raise CheckpointError(f"{damaged} gives tensor {name!r} the shape {shape!r:.80}; a shape "
                                  f"is a list of at most {_MAX_DIMS} whole numbers >= 0 whose product is below 2**63. "
                                  "Use another copy.")
        if (not isinstance(offsets, list) or len(offsets) != 2 or not all(_is_count(o) for o in offsets)
                or offsets[0] > offsets[1]):
            raise CheckpointError(f"{damaged} gives tensor {name!r} the data offsets {offsets!r:.80}, not "
                                  "[begin, end] with 0 <= begin <= end. Use another copy.")
        if offsets[1] > data_bytes:
            raise CheckpointError(f"{where}({path!r}): the checkpoint is truncated or damaged: tensor {name!r} "
                                  f"ends at data byte {offsets[1]} but the file holds {data_bytes} bytes of "
                                  "data. Use another copy (a backup, an earlier checkpoint) or train again.")
        numel = 1
        for d in shape:
            numel *= d
        if numel * _DTYPES[dtype].itemsize != offsets[1] - offsets[0]:
            raise CheckpointError(f"{damaged} gives tensor {name!r} the shape {shape} of {dtype} "
                                  f"({numel * _DTYPES[dtype].itemsize} bytes) but {offsets[1] - offsets[0]} "
                                  "bytes of data. Use another copy.")
        spans.append((offsets[0], offsets[1], name))
    end = 0
    for begin, stop, name in sorted(spans):
        if begin != end:
            raise CheckpointError(f"{damaged}'s tensor {name!r} starts at data byte {begin} where the "
                                  f"previous one ends at {end}. Use another copy.")
        end = stop
    if end != data_bytes:
        raise CheckpointError(f"{damaged} describes {end} bytes of tensor data but the file holds "
                              f"{data_bytes}. Use another copy.")


def _is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


# --------------------------------------------------------------------------------------------
# Optimizer state <-> tensors + JSON


def optimizer_state_to_flat(state_dict: Mapping[str, Any],
                            prefix: str = "optimizer") -> tuple[dict[str, Tensor], dict[str, Any]]:
    """A torch optimizer state_dict as tensors named "{prefix}/state/{param_index}/{name}" plus
    JSON metadata (param_groups and the non-tensor state values)."""
    if not isinstance(state_dict, Mapping) or "state" not in state_dict or \
            "param_groups" not in state_dict:
        raise TypeError(f"optimizer_state_to_flat: expected optimizer.state_dict() (a dict with "
                        f"'state' and 'param_groups'), got {type(state_dict).__name__}.")
    tensors: dict[str, Tensor] = {}
    state_meta: dict[str, Any] = {}
    for index, param_state in state_dict["state"].items():
        if not isinstance(index, int) or isinstance(index, bool):
            raise TypeError(f"optimizer_state_to_flat: state key {index!r} is not a parameter "
                            f"index (int); pass optimizer.state_dict(), not optimizer.state.")
        state_meta[str(index)] = {
            name: _encode(value, f"{prefix}/state/{index}/{name}", tensors)
            for name, value in param_state.items()}
    groups = [_encode(dict(group), f"{prefix}/param_groups/{i}", tensors)
              for i, group in enumerate(state_dict["param_groups"])]
    extra = {k: _encode(v, f"{prefix}/{k}", tensors) for k, v in state_dict.items()
             if k not in ("state", "param_groups")}
    meta = {"state": state_meta, "param_groups": groups}
    if extra:
        meta["extra"] = extra
    return tensors, meta


def optimizer_state_from_flat(tensors: Mapping[str, Tensor], meta: Mapping[str, Any]) -> dict:
    """The state_dict that optimizer_state_to_flat() took apart, for optimizer.load_state_dict()."""
    if not isinstance(meta, Mapping) or "state" not in meta or "param_groups" not in meta:
        raise ValueError("optimizer_state_from_flat: meta must be the dict optimizer_state_to_flat() "
                         "returned (with 'state' and 'param_groups'); the checkpoint holds no "
                         "optimizer state or the wrong part of the metadata was passed.")

    def damaged(problem: str) -> ValueError:
        return ValueError(f"optimizer_state_from_flat: {problem}; the checkpoint is damaged or incomplete. "
                          "Use another checkpoint.")

    def decode(value: Any, where: str) -> Any:
        return decode_value(value, tensors, where, damaged)

    if not isinstance(meta["state"], Mapping) or not isinstance(meta["param_groups"], list):
        raise damaged("'state' is not a dict or 'param_groups' not a list")
    state = {}
    for index, param_state in meta["state"].items():
        if not (isinstance(index, str) and index.isdigit()) or not isinstance(param_state, Mapping):
            raise damaged(f"the state entry {index!r:.40} is not a parameter index with a dict of values")
        state[int(index)] = {name: decode(value, f"state {index} {name!r}") for name, value in param_state.items()}
    groups = [decode(group, f"param_groups[{i}]") for i, group in enumerate(meta["param_groups"])]
    result = {"state": state, "param_groups": groups}
    result.update({k: decode(v, repr(k)) for k, v in dict(meta.get("extra", {})).items()})
    return result


def _encode(value: Any, name: str, tensors: dict[str, Tensor]) -> Any:
    """`value` as JSON; tensors inside it go to `tensors` under `name` (plus a path if nested)."""
    if isinstance(value, Tensor):
        tensors[name] = value
        return {_TENSOR_TAG: name}
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, tuple):
        return {_TUPLE_TAG: [_encode(v, f"{name}/{i}", tensors) for i, v in enumerate(value)]}
    if isinstance(value, list):
        return [_encode(v, f"{name}/{i}", tensors) for i, v in enumerate(value)]
    if isinstance(value, Mapping):
        if any(not isinstance(k, str) for k in value):
            if any(not isinstance(k, (bool, int, float, tuple)) for k in value):
                raise TypeError(f"optimizer_state_to_flat: {name} is a dict with keys "
                                f"{[k for k in value if not isinstance(k, str)][:3]}; keys can be str, numbers "
                                f"and tuples.")
            tag = _COUNTER_TAG if isinstance(value, collections.Counter) else _ITEMS_TAG
            return {tag: [[_encode(k, f"{name}/key{i}", tensors), _encode(v, f"{name}/{i}", tensors)]
                          for i, (k, v) in enumerate(value.items())]}
        if len(value) == 1 and next(iter(value)) in (_TENSOR_TAG, _TUPLE_TAG, _ITEMS_TAG, _COUNTER_TAG):
            raise ValueError(f"optimizer_state_to_flat: {name} is a dict whose only key is "
                             f"{next(iter(value))!r}, which the checkpoint format reserves.")
        return {k: _encode(v, f"{name}/{k}", tensors) for k, v in value.items()}
    raise TypeError(f"optimizer_state_to_flat: {name} is a {type(value).__name__}; optimizer "
                    f"state can hold tensors, numbers, str, None, lists, tuples and dicts.")


def decode_value(value: Any, tensors: Mapping[str, Tensor], where: str,
                 damaged: Callable[[str], Exception], depth: int = 0) -> Any:
    """A value _encode() wrote, its tensors taken from `tensors`: the one decoder of the format (the
    loading checks use it too). What no encoder writes - a tensor the file lacks, a tuple or [key,
    value] pairs that are not lists, a key that is no number or tuple, nesting past _MAX_DEPTH - raises
    damaged(problem), the problem naming `where`."""
    if depth > _MAX_DEPTH:
        raise damaged(f"{where} is nested more than {_MAX_DEPTH} levels deep")
    if isinstance(value, list):
        return [decode_value(v, tensors, where, damaged, depth + 1) for v in value]
    if not isinstance(value, dict):
        return value
    if len(value) == 1 and _TENSOR_TAG in value:
        name = value[_TENSOR_TAG]
        if not isinstance(name, str) or name not in tensors:
            raise damaged(f"{where} refers to tensor {name!r:.80}, which the file does not hold")
        return tensors[name]
    if len(value) == 1 and _TUPLE_TAG in value:
        if not isinstance(value[_TUPLE_TAG], list):
            raise damaged(f"{where} is a tuple that holds no list")
        return tuple(decode_value(v, tensors, where, damaged, depth + 1) for v in value[_TUPLE_TAG])
    if len(value) == 1 and (_ITEMS_TAG in value or _COUNTER_TAG in value):
        pairs = next(iter(value.values()))
        if not isinstance(pairs, list) or not all(isinstance(p, list) and len(p) == 2 for p in pairs):
            raise damaged(f"{where} is a dict that holds no list of [key, value] pairs")
        decoded = [(decode_value(k, tensors, where, damaged, depth + 1),
                    decode_value(v, tensors, where, damaged, depth + 1)) for k, v in pairs]
        if not all(_is_key(k) for k, _ in decoded):
            raise damaged(f"{where} has a key that is not a number or a tuple of numbers and str")
        return (collections.Counter if _COUNTER_TAG in value else dict)(dict(decoded))  # (Counter(pairs) counts them)
    return {k: decode_value(v, tensors, where, damaged, depth + 1) for k, v in value.items()}


def _is_key(key: Any) -> bool:
    """What _encode() writes as a dict key in [key, value] pairs: a number, or a (hashable) tuple of
    numbers, str and None."""
    if isinstance(key, tuple):
        return all(k is None or isinstance(k, (bool, int, float, str)) or (isinstance(k, tuple) and _is_key(k))
                   for k in key)
    return isinstance(key, (bool, int, float))


# --------------------------------------------------------------------------------------------
# RNG state <-> tensors + JSON


def capture_rng_state() -> tuple[dict[str, Tensor], dict[str, Any]]:
    """The torch CPU (and CUDA, if available) generator states as uint8 tensors, and Python's
    `random` and numpy's global RNG states as JSON, for restore_rng_state()."""
    tensors = {"torch_cpu": torch.get_rng_state()}
    cuda_devices = 0
    if torch.cuda.is_available():
        states = torch.cuda.get_rng_state_all()
        cuda_devices = len(states)
        tensors.update({f"cuda/{i}": s for i, s in enumerate(states)})
    version, internal, gauss_next = random.getstate()
    kind, keys, pos, has_gauss, cached_gaussian = np.random.get_state(legacy=True)
    meta = {
        "python": [version, list(internal), gauss_next],
        "numpy": [kind, keys.tolist(), int(pos), int(has_gauss), float(cached_gaussian)],
        "cuda_devices": cuda_devices,
    }
    return tensors, meta


def restore_rng_state(tensors: Mapping[str, Tensor], meta: Mapping[str, Any]) -> None:
    """Sets the RNG states that capture_rng_state() returned. CUDA states are restored for the
    devices present in both runs (a warning says when the device counts differ)."""
    missing = [k for k in ("python", "numpy") if k not in meta]
    missing += [] if "torch_cpu" in tensors else ["tensor torch_cpu"]
    if missing:
        raise ValueError(f"restore_rng_state: missing {', '.join(missing)}; pass the tensors and "
                         f"metadata that capture_rng_state() returned.")
    torch.set_rng_state(tensors["torch_cpu"].to("cpu", torch.uint8))
    version, internal, gauss_next = meta["python"]
    random.setstate((version, tuple(internal), gauss_next))
    kind, keys, pos, has_gauss, cached_gaussian = meta["numpy"]
    np.random.set_state((kind, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached_gaussian))
    saved = int(meta.get("cuda_devices", 0))
    present = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if saved != present and saved:
        warnings.warn(f"restore_rng_state: the checkpoint has CUDA RNG states for {saved} devices "
                      f"but {present} are visible; restoring the first {min(saved, present)}. "
                      f"Random ops on the others will differ from the original run.",
                      stacklevel=2)
    for i in range(min(saved, present)):
        torch.cuda.set_rng_state(tensors[f"cuda/{i}"].to("cpu", torch.uint8), device=i)
