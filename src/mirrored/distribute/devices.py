"""Device strings: parse what users write (ours, TF's, torch.device) into "cpu:N" / "cuda:N".

`resolve_devices` validates a MirroredStrategy device list (duplicates, unknown kinds, absent GPUs)
and warns when there are more CPU replicas than cores; `intra_op_threads` splits the cores between
CPU replicas so N replica threads share them instead of oversubscribing; `check_replica_memory`
refuses, before anything is built, replicas whose copies would not fit in memory. Uses torch and
values.py only.
"""
from __future__ import annotations

import os
import re
import warnings
from collections.abc import Sequence

import torch

from mirrored._cpus import usable_cores
from mirrored.distribute.values import Device

# "/job:localhost/replica:0/task:0/device:GPU:0", "/device:CPU:1", "/gpu:0", "GPU", "cuda:1", "cpu"
_DEVICE_RE = re.compile(r"(?:^|/)(?:device:)?(cpu|gpu|cuda)(?::(\d+))?$", re.IGNORECASE)
_KIND = {"cpu": "cpu", "gpu": "cuda", "cuda": "cuda"}
# The replicas' copies may plan on this share of the memory available: the rest is for what no
# estimate counts (the interpreter, the input pipeline's buffers, allocator slack, the OS).
_MEMORY_HEADROOM = 0.8


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
    n_cpu, cores = sum(d.startswith("cpu") for d in parsed), usable_cores()
    if n_cpu > cores:
        # Works (each replica gets one intra-op thread and they take turns), but every replica is a
        # thread holding its own model copy and batch: more replicas than cores only costs memory.
        warnings.warn(f"{where}: {n_cpu} CPU replicas share {cores} core(s): they take turns, and each is a "
                      "thread with its own model copy and batch. That is fine for testing replica counts; for "
                      f"speed and memory use at most {cores} CPU replicas.", UserWarning, stacklevel=3)
    return tuple(parsed)


def torch_device(device: Device) -> torch.device:
    """The torch.device a replica's tensors live on: every logical CPU replica uses the one CPU."""
    return torch.device("cpu") if device.startswith("cpu") else torch.device(device)


def intra_op_threads(devices: Sequence[Device]) -> int:
    """Intra-op threads per CPU replica: the cores split evenly between them, at least 1."""
    n_cpu = sum(d.startswith("cpu") for d in devices)
    return max(1, usable_cores() // max(1, n_cpu))


def available_memory_bytes() -> int | None:
    """Host memory this process can still take: MemAvailable (or free pages), capped by the cgroup's
    limit in a container; None where neither can be read."""
    available = None
    try:
        with open("/proc/meminfo") as f:
            available = next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))
    except (OSError, StopIteration, ValueError, IndexError):
        try:
            available = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        except (AttributeError, ValueError, OSError):
            pass
    limit = _cgroup_room()
    if limit is not None:
        available = limit if available is None else min(available, limit)
    return available


def _cgroup_room() -> int | None:
    """The cgroup's memory limit minus its usage (v2, then v1), None without a limit."""
    try:
        with open("/proc/self/cgroup") as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if controllers == "":
            files = ("/sys/fs/cgroup{}/memory.max", "/sys/fs/cgroup{}/memory.current")
        elif "memory" in controllers.split(","):
            files = ("/sys/fs/cgroup/memory{}/memory.limit_in_bytes", "/sys/fs/cgroup/memory{}/memory.usage_in_bytes")
        else:
            continue
        for prefix in (path.rstrip("/"), ""):  # our own group, else the container's root view
            try:
                with open(files[0].format(prefix)) as f:
                    limit = f.read().strip()
                with open(files[1].format(prefix)) as f:
                    usage = int(f.read().strip())
            except (OSError, ValueError):
                continue
            if limit.isdigit() and int(limit) < 1 << 60:  # "max" or a huge number: no limit
                return max(0, int(limit) - usage)
            break
    return None


def check_replica_memory(bytes_per_copy: int, devices: Sequence[Device], where: str) -> None:
    """Raises ValueError, before anything is built, when one copy per replica would not fit.

    CPU replicas share host memory: their copies together must fit in _MEMORY_HEADROOM of
    available_memory_bytes(). Each GPU holds its own replica's copy: it must fit in that share of
    the GPU's free memory. `bytes_per_copy` is what the caller estimates one replica needs (weights,
    and for training gradients, optimizer state and activations); nothing is checked where the
    available memory cannot be read. The message gives the estimate and the largest replica count
    that fits.
    """
    if isinstance(bytes_per_copy, bool) or not isinstance(bytes_per_copy, int):
        raise TypeError(f"{where}: bytes_per_copy must be an int, got {bytes_per_copy!r}.")
    if bytes_per_copy < 0:
        raise ValueError(f"{where}: bytes_per_copy must be >= 0, got {bytes_per_copy}.")
    cpus = [d for d in devices if d.startswith("cpu")]
    available = available_memory_bytes() if cpus and bytes_per_copy else None
    if available is not None and len(cpus) * bytes_per_copy > _MEMORY_HEADROOM * available:
        fits = int(_MEMORY_HEADROOM * available // bytes_per_copy)
        raise ValueError(
            f"{where}: {len(cpus)} CPU replicas need about {_size(len(cpus) * bytes_per_copy)} "
            f"({_size(bytes_per_copy)} per replica's copy) but {_size(available)} of memory is available, "
            f"of which {_MEMORY_HEADROOM:.0%} is planned for copies. Use at most {fits} CPU replica(s), a "
            "smaller model or batch, or free memory.")
    for d in devices:
        if d.startswith("cuda") and bytes_per_copy and torch.cuda.is_available():
            free, _ = torch.cuda.mem_get_info(torch_device(d))
            if bytes_per_copy > _MEMORY_HEADROOM * free:
                raise ValueError(
                    f"{where}: the replica on {d} needs about {_size(bytes_per_copy)} but {d} has "
                    f"{_size(free)} free, of which {_MEMORY_HEADROOM:.0%} is planned for it. Use a smaller "
                    "model or batch, or free the GPU's memory.")


def _size(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1024:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TB"
