"""Checkpoint load and save times: mirrored's reader (each tensor read into memory of its own, issue 25)
against safetensors' memory-mapped reader (how load_checkpoint read before) with and without a copy,
and save_checkpoint (its own streamed writer) against safetensors.torch.save_file plus the same fsync and
rename (how it saved before). Contestants alternate in one process; medians of the rounds are printed
with ratios to the former way (a mapped load reads no byte until a tensor is touched, so each load is
followed by one pass over every tensor, as loading them into a model does).

    python benchmarks/checkpoint_io.py [--model resnet50] [--rounds 7]
"""
from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

import safetensors
import safetensors.torch
import torch

import mirrored as mr
from mirrored.training import checkpoint


def _touch(tensors: dict[str, torch.Tensor]) -> None:
    for t in tensors.values():
        t.sum()


def _mapped(path: Path) -> dict[str, torch.Tensor]:
    with safetensors.safe_open(str(path), framework="pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}


def _mapped_copied(path: Path) -> dict[str, torch.Tensor]:
    with safetensors.safe_open(str(path), framework="pt") as f:
        return {k: f.get_tensor(k).clone() for k in f.keys()}


def _save_file(tensors: dict[str, torch.Tensor], path: Path) -> None:
    tmp = path.with_suffix(".tmp")
    safetensors.torch.save_file(tensors, str(tmp), metadata={"mirrored": "{}"})
    fd = os.open(tmp, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="resnet50")
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    torch.set_num_threads(1)
    net = mr.models.get(args.model, num_classes=1000) if args.model != "resnet_cifar" else mr.models.get(args.model)
    tensors = {f"model/{k}": v.detach().contiguous() for k, v in net.state_dict().items()}
    tensors.update({f"optimizer/{k}": v.detach().clone() for k, v in net.state_dict().items()
                    if v.is_floating_point()})  # momentum buffers: a resumable file's size
    megabytes = sum(t.numel() * t.element_size() for t in tensors.values()) / 1e6
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "c.safetensors"
        checkpoint.save_checkpoint(path, tensors, {"format": "bench"})
        loaders = {
            "mapped (safetensors get_tensor, before)": _mapped,
            "mapped + clone": _mapped_copied,
            "read (mirrored, now)": lambda p: checkpoint.load_checkpoint(p)[0],
        }
        savers = {
            "safetensors save_file + fsync, rename (before)": lambda p: _save_file(tensors, p),
            "save_checkpoint (now)": lambda p: checkpoint.save_checkpoint(p, tensors, {"format": "bench"}),
        }
        load_s: dict[str, list[float]] = {name: [] for name in loaders}
        save_s: dict[str, list[float]] = {name: [] for name in savers}
        for _ in range(args.rounds):
            for name, load in loaders.items():
                start = time.perf_counter()
                _touch(load(path))
                load_s[name].append(time.perf_counter() - start)
            for name, save in savers.items():
                start = time.perf_counter()
                save(Path(tmp) / "s.safetensors")
                save_s[name].append(time.perf_counter() - start)
    print(f"{args.model}: {len(tensors)} tensors, {megabytes:.1f} MB, {args.rounds} rounds, medians")
    base = statistics.median(load_s["mapped (safetensors get_tensor, before)"])
    for name, times in load_s.items():
        print(f"  load {name:46s} {statistics.median(times) * 1e3:8.1f} ms  x{statistics.median(times) / base:.2f}")
    base = statistics.median(save_s["safetensors save_file + fsync, rename (before)"])
    for name, times in save_s.items():
        print(f"  save {name:46s} {statistics.median(times) * 1e3:8.1f} ms  x{statistics.median(times) / base:.2f}")


if __name__ == "__main__":
    main()
