"""Device strings: parse what users write (ours, TF's, torch.device) into "cpu:N" / "cuda:N".

`resolve_devices` validates a MirroredStrategy device list (duplicates, unknown kinds, absent GPUs)
and `intra_op_threads` splits the cores between CPU replicas so N replica threads share them
instead of oversubscribing. Uses torch and values.py only.
"""
from __future__ import annotations

import re
from collections.abc import Sequence

import torch

from mirrored._cpus import usable_cores
from mirrored.distribute.values import Device

# "/job:localhost/replica:0/task:0/device:GPU:0", "/device:CPU:1", "/gpu:0", "GPU", "cuda:1", "cpu"
_DEVICE_RE = re.compile(r"(?:^|/)(?:device:)?(cpu|gpu|cuda)(?::(\d+))?$", re.IGNORECASE)
_KIND = {"cpu": "cpu", "gpu": "cuda", "cuda": "cuda"}


def visible_gpus() -> list[Device]:
    """The CUDA devices torch can see, as "cuda:N" strings (empty without CUDA)."""
    if not torch.cuda.is_available():
        return []
    return [f"cuda:{i}" for i in range(torch.cuda.device_count())]


def _available() -> str:
    gpus = visible_gpus()
    return ", ".join(gpus) if gpus else "no GPU; logical CPU replicas cpu:0, cpu:1, ..."


def canonical(device: str | torch.device, *, where: str = "device") -> Device:
    """"cpu:0" / "cuda:1" for any accepted spelling; ValueError naming the input otherwise."""
    if isinstance(device, torch.device):
        device = str(device)
    if not isinstance(device, str):
        raise TypeError(f"{where}: a device must be a string such as \"cpu:0\" or \"cuda:1\"; got {device!r}.")
    m = _DEVICE_RE.search(device.strip())
    if m is None:
        raise ValueError(
            f"{where}: cannot parse device {device!r}. Write \"cpu:N\" or \"cuda:N\" (TF spellings such as "
            f"\"/gpu:0\" work too; visible here: {_available()})."
        )
    return f"{_KIND[m.group(1).lower()]}:{int(m.group(2) or 0)}"


def resolve_devices(devices: Sequence[str | torch.device] | None, *, where: str = "MirroredStrategy") -> tuple[Device, ...]:
    """The validated device tuple of a strategy: every visible GPU when `devices` is None, else one CPU."""
    if devices is None:
        return tuple(visible_gpus()) or ("cpu:0",)
    if isinstance(devices, (str, torch.device)):
        devices = [devices]
    parsed = [canonical(d, where=f"{where}(devices={list(map(str, devices))})") for d in devices]
    if not parsed:
        raise ValueError(f"{where}: devices=[] names no device. Omit devices= to use every GPU (or one CPU).")
    seen: dict[str, int] = {}
    for i, d in enumerate(parsed):
        if d in seen:
            raise ValueError(
                f"{where}(devices={list(map(str, devices))}): device {d!r} is listed twice (positions "
                f"{seen[d]} and {i}). Each replica needs its own device; for several CPU replicas write "
                "\"cpu:0\", \"cpu:1\", ..."
            )
        seen[d] = i
    gpus = visible_gpus()
    for d in parsed:
        if d.startswith("cuda") and d not in gpus:
            raise ValueError(
                f"{where}(devices={list(map(str, devices))}): {d} is not a visible GPU (visible: "
                f"{', '.join(gpus) if gpus else 'none'}). Use logical CPU replicas (\"cpu:0\", \"cpu:1\") "
                "or check CUDA_VISIBLE_DEVICES."
            )
    return tuple(parsed)


def torch_device(device: Device) -> torch.device:
    """The torch.device a replica's tensors live on: every logical CPU replica uses the one CPU."""
    return torch.device("cpu") if device.startswith("cpu") else torch.device(device)


def intra_op_threads(devices: Sequence[Device]) -> int:
    """Intra-op threads per CPU replica: the cores split evenly between them, at least 1."""
    n_cpu = sum(d.startswith("cpu") for d in devices)
    return max(1, usable_cores() // max(1, n_cpu))
