"""Checkpoints: one safetensors file of tensors plus JSON metadata, written atomically, never pickled.

save_checkpoint() writes tensors and a JSON-able dict (kept in the safetensors header under
"mirrored") to a temporary file beside `path`, fsyncs it and renames it over `path`, so a crash
leaves either the old checkpoint or the new one. load_checkpoint() reads it back with safetensors
only: nothing in a checkpoint can run code. optimizer_state_to_flat()/optimizer_state_from_flat()
and capture_rng_state()/restore_rng_state() turn a torch optimizer's state_dict and the RNG states
into tensors + JSON for it; load_state_dict() gives the model weights as a plain state_dict.
Uses torch, safetensors, json, os (and random/numpy for the RNG states they own).
"""
from __future__ import annotations

import json
import os
import random
import struct
import uuid
import warnings
from collections.abc import Mapping
from typing import Any

import numpy as np
import safetensors
import safetensors.torch
import torch
from torch import Tensor

__all__ = [
    "capture_rng_state", "load_checkpoint", "load_state_dict", "optimizer_state_from_flat",
    "optimizer_state_to_flat", "restore_rng_state", "save_checkpoint",
]

_METADATA_KEY = "mirrored"  # our JSON lives under this key of the safetensors header metadata
_MAX_HEADER_BYTES = 100 << 20  # safetensors' own limit; a larger "header" means a foreign file
# JSON cannot hold tensors or tuples: they are written as one-key objects with these tags.
_TENSOR_TAG = "__tensor__"
_TUPLE_TAG = "__tuple__"


# --------------------------------------------------------------------------------------------
# Files


def check_file_path(path: str, where: str) -> None:
    """Refuses a path that names a directory (a TF SavedModel habit): a checkpoint is one file."""
    if path.endswith(("/", os.sep)) or os.path.isdir(path):
        raise ValueError(f"{where}({path!r}): that is a directory; a checkpoint is one safetensors file. Give "
                         f"a file name, e.g. {os.path.join(path, 'model.safetensors')!r}.")


def save_checkpoint(path: str | os.PathLike, tensors: Mapping[str, Tensor],
                    metadata: Mapping[str, Any]) -> None:
    """Writes `tensors` and JSON `metadata` to one safetensors file at `path`, atomically.

    Tensors are detached, moved to CPU and made contiguous; tensors that share storage are cloned.
    The file is written beside `path`, fsynced and renamed over it (then the directory is fsynced),
    so on any failure `path` keeps its previous content and no temporary file is left behind.
    """
    path = os.fspath(path)
    check_file_path(path, "save_checkpoint")
    flat = _cpu_tensors(path, tensors)
    try:
        header = {_METADATA_KEY: json.dumps(dict(metadata)), "format": "pt"}
    except (TypeError, ValueError) as e:
        raise TypeError(f"save_checkpoint({path!r}): metadata is not JSON-serializable ({e}). Keep "
                        f"tensors in `tensors` and only str/int/float/bool/None/list/dict in "
                        f"`metadata`.") from e
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    tmp_path = os.path.join(directory, f".{os.path.basename(path)}.{uuid.uuid4().hex[:12]}.tmp")
    try:
        mode = _new_file_mode(path, tmp_path)
        safetensors.torch.save_file(flat, tmp_path, metadata=header)
        os.chmod(tmp_path, mode)  # safetensors makes its files 0600 whatever the umask
        _fsync_file(tmp_path)
        os.replace(tmp_path, path)
    except BaseException:
        try:
            os.unlink(tmp_path)
        except FileNotFoundError:
            pass
        raise
    _fsync_directory(directory)  # makes the rename itself survive a crash


def _new_file_mode(path: str, tmp_path: str) -> int:
    """The permissions `path` should end with: those of the file it replaces, else what a new file
    gets under the umask (learned by creating `tmp_path`, which save_file then overwrites)."""
    try:
        return os.stat(path).st_mode & 0o777
    except FileNotFoundError:
        fd = os.open(tmp_path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o666)
        try:
            return os.fstat(fd).st_mode & 0o777
        finally:
            os.close(fd)


def _cpu_tensors(path: str, tensors: Mapping[str, Tensor]) -> dict[str, Tensor]:
    if not isinstance(tensors, Mapping):
        raise TypeError(f"save_checkpoint({path!r}): tensors must be a mapping of name -> Tensor, "
                        f"got {type(tensors).__name__}.")
    flat: dict[str, Tensor] = {}
    storages: set[tuple[int, str]] = set()
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
        t = tensor.detach().to("cpu").contiguous()
        # safetensors refuses two names over one storage (e.g. tied weights): give each its own.
        key = (t.untyped_storage().data_ptr(), str(t.device))
        if t.numel() and key in storages:
            t = t.clone()
        elif t.numel():
            storages.add(key)
        flat[name] = t
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


def load_checkpoint(path: str | os.PathLike,
                    device: str | torch.device = "cpu") -> tuple[dict[str, Tensor], dict[str, Any]]:
    """The tensors (on `device`) and JSON metadata of a file written by save_checkpoint().

    Reads with safetensors only, never pickle or torch.load.
    """
    path = os.fspath(path)
    tensors, header = _read(path, device, "load_checkpoint")
    if _METADATA_KEY not in header:
        raise ValueError(
            f"load_checkpoint({path!r}): a safetensors file without mirrored's metadata (it was "
            f"not written by save_checkpoint()/Model.save()). For its weights alone use "
            f"load_state_dict({path!r}, prefix=\"\"), or safetensors.torch.load_file().")
    try:
        metadata = json.loads(header[_METADATA_KEY])
    except json.JSONDecodeError as e:
        raise ValueError(f"load_checkpoint({path!r}): the metadata under {_METADATA_KEY!r} is not "
                         f"valid JSON ({e}); the file is damaged. Use an older checkpoint.") from e
    if not isinstance(metadata, dict):
        raise ValueError(f"load_checkpoint({path!r}): the metadata is a "
                         f"{type(metadata).__name__}, expected a JSON object; the file was not "
                         f"written by save_checkpoint().")
    return tensors, metadata


def load_state_dict(path: str | os.PathLike, prefix: str = "model/") -> dict[str, Tensor]:
    """The tensors of a checkpoint whose names start with `prefix`, prefix removed: the model's
    weights as a state_dict for a plain nn.Module (`net.load_state_dict(load_state_dict(path))`)."""
    path = os.fspath(path)
    tensors, _ = _read(path, "cpu", "load_state_dict")
    state = {name[len(prefix):]: t for name, t in tensors.items() if name.startswith(prefix)}
    if not state:
        some = ", ".join(sorted(tensors)[:5]) or "none"
        raise ValueError(f"load_state_dict({path!r}, prefix={prefix!r}): no tensor name starts "
                         f"with {prefix!r} (names: {some}{', ...' if len(tensors) > 5 else ''}). "
                         f"Pass the prefix the file uses, or prefix=\"\" for all tensors.")
    return state


def _read(path: str, device: str | torch.device, where: str) -> tuple[dict[str, Tensor], dict]:
    """Tensors and header metadata of a safetensors file, with errors that say what the file is."""
    if not os.path.exists(path):
        raise FileNotFoundError(f"{where}({path!r}): no such file. Check the path; a checkpoint "
                                f"is written by Model.save(), ModelCheckpoint or save_checkpoint().")
    if os.path.isdir(path):
        raise IsADirectoryError(f"{where}({path!r}): this is a directory; pass the checkpoint "
                                f"file inside it (e.g. {os.path.join(path, 'model.safetensors')}).")
    _check_safetensors_header(path, where)
    try:
        with safetensors.safe_open(path, framework="pt", device=str(device)) as f:
            header = f.metadata() or {}
            tensors = {name: f.get_tensor(name) for name in f.keys()}
    except safetensors.SafetensorError as e:
        raise ValueError(f"{where}({path!r}): not a readable safetensors file ({e}). It may be "
                         f"truncated or damaged; use another checkpoint.") from e
    return tensors, header


def _check_safetensors_header(path: str, where: str) -> None:
    # safetensors layout: uint64 little-endian header size N, then N bytes of JSON starting "{".
    with open(path, "rb") as f:
        start = f.read(9)
    size = os.path.getsize(path)
    if len(start) == 9:
        (header_bytes,) = struct.unpack("<Q", start[:8])
        if header_bytes <= min(size - 8, _MAX_HEADER_BYTES) and start[8:9] == b"{":
            return
    # Not safetensors: say what it looks like. (Only now, since a valid header size may itself
    # begin with the bytes checked here.)
    if start[:4] == b"PK\x03\x04" or start[:1] == b"\x80":
        problem = ("it looks like a torch.save()/pickle file, which mirrored never loads because "
                   "unpickling can run arbitrary code")
    elif len(start) < 9:
        problem = f"it is only {size} bytes long"
    elif start[8:9] == b"{" and header_bytes <= _MAX_HEADER_BYTES:
        raise ValueError(f"{where}({path!r}): the checkpoint is truncated or damaged: its safetensors header "
                         f"claims {header_bytes} bytes but the file holds {size - 8} after the size field. "
                         "Use another copy (a backup, an earlier checkpoint) or train again.")
    else:
        problem = "its first bytes are not a safetensors header"
    raise ValueError(f"{where}({path!r}): not a safetensors checkpoint: {problem}. Load it "
                     f"with the tool that wrote it and re-save it with Model.save() or "
                     f"save_checkpoint().")


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
    state = {int(index): {name: _decode(value, tensors) for name, value in param_state.items()}
             for index, param_state in meta["state"].items()}
    groups = [_decode(group, tensors) for group in meta["param_groups"]]
    result = {"state": state, "param_groups": groups}
    result.update({k: _decode(v, tensors) for k, v in meta.get("extra", {}).items()})
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
            raise TypeError(f"optimizer_state_to_flat: {name} is a dict with non-str keys "
                            f"{[k for k in value if not isinstance(k, str)][:3]}; only str keys "
                            f"can be stored in JSON.")
        if len(value) == 1 and next(iter(value)) in (_TENSOR_TAG, _TUPLE_TAG):
            raise ValueError(f"optimizer_state_to_flat: {name} is a dict whose only key is "
                             f"{next(iter(value))!r}, which the checkpoint format reserves.")
        return {k: _encode(v, f"{name}/{k}", tensors) for k, v in value.items()}
    raise TypeError(f"optimizer_state_to_flat: {name} is a {type(value).__name__}; optimizer "
                    f"state can hold tensors, numbers, str, None, lists, tuples and dicts.")


def _decode(value: Any, tensors: Mapping[str, Tensor]) -> Any:
    if isinstance(value, list):
        return [_decode(v, tensors) for v in value]
    if isinstance(value, dict):
        if len(value) == 1 and _TENSOR_TAG in value:
            name = value[_TENSOR_TAG]
            if name not in tensors:
                raise ValueError(f"optimizer_state_from_flat: the metadata refers to tensor "
                                 f"{name!r}, which the checkpoint does not hold; the file is "
                                 f"incomplete. Use another checkpoint.")
            return tensors[name]
        if len(value) == 1 and _TUPLE_TAG in value:
            return tuple(_decode(v, tensors) for v in value[_TUPLE_TAG])
        return {k: _decode(v, tensors) for k, v in value.items()}
    return value


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
