"""Gradient packing: many small tensors travel as a few flat buckets, one collective per bucket.

`plan(tensors, bytes_per_pack)` groups tensors of one dtype and device, in order, into buckets of
at most `bytes_per_pack` bytes (a tensor larger than that gets a bucket of its own); `pack` copies
them into one flat buffer and `unpack` hands back views of it. Buffers can be kept by the caller
and reused step after step, so a training step allocates nothing. Uses torch only.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor


@dataclass
class Bucket:
    """Which tensors (by index) a flat buffer holds, and where."""

    dtype: torch.dtype
    device: torch.device
    indices: list[int] = field(default_factory=list)
    shapes: list[torch.Size] = field(default_factory=list)
    offsets: list[int] = field(default_factory=list)
    numel: int = 0

    def add(self, index: int, tensor: Tensor) -> None:
        self.indices.append(index)
        self.shapes.append(tensor.shape)
        self.offsets.append(self.numel)
        self.numel += tensor.numel()

    def new_buffer(self) -> Tensor:
        return torch.empty(self.numel, dtype=self.dtype, device=self.device)

    def pack(self, tensors: Sequence[Tensor | None], out: Tensor | None = None) -> Tensor:
        """Copies this bucket's tensors into `out` (a new buffer when None) and returns it."""
        if out is None:
            out = self.new_buffer()
        for i, off in zip(self.indices, self.offsets):
            t = tensors[i]
            n = t.numel()
            dst = out[off:off + n]
            if dst.data_ptr() != t.data_ptr() or not t.is_contiguous():  # a view of this buffer already
                dst.copy_(t.reshape(-1))
        return out

    def unpack(self, flat: Tensor, into: list[Tensor | None]) -> None:
        """Puts views of `flat` (one per packed tensor, in its shape) into `into` at their indices."""
        parts = flat.split([shape.numel() for shape in self.shapes])  # one call for all the views
        for i, part, shape in zip(self.indices, parts, self.shapes):
            into[i] = part.view(shape)


def plan(tensors: Sequence[Tensor | None], bytes_per_pack: int) -> list[Bucket]:
    """Buckets for `tensors` (None entries are left out), at most `bytes_per_pack` bytes each."""
    open_buckets: dict[tuple[torch.dtype, torch.device], Bucket] = {}
    done: list[Bucket] = []
    for i, t in enumerate(tensors):
        if t is None:
            continue
        key = (t.dtype, t.device)
        b = open_buckets.get(key)
        size = t.numel() * t.element_size()
        if b is not None and b.numel and (b.numel * t.element_size() + size) > bytes_per_pack:
            done.append(b)
            b = None
        if b is None:
            b = open_buckets[key] = Bucket(t.dtype, t.device)
        b.add(i, t)
    done.extend(open_buckets.values())
    return done


def signature(tensors: Sequence[Tensor | None]) -> tuple:
    """A key that is equal exactly when two tensor lists would get the same buckets."""
    return tuple(None if t is None else (t.shape, t.dtype, t.device) for t in tensors)


class GradientLayout:
    """How one replica's gradients of a fixed signature travel, step after step, allocating nothing:
    small ones are packed into persistent flat buffers; ones of `direct_numel` elements or more are
    read where backward left them and reduced into persistent outputs of their own. `results` are
    the reduced gradients (views of those buffers), in the order of the gradients."""

    def __init__(self, grads: Sequence[Tensor | None], bytes_per_pack: int, direct_numel: int):
        small = [g if g is not None and g.numel() < direct_numel else None for g in grads]
        self.buckets = plan(small, bytes_per_pack)
        self.flats = [b.new_buffer() for b in self.buckets]
        self.results: list[Tensor | None] = [None] * len(grads)
        for b, flat in zip(self.buckets, self.flats):
            b.unpack(flat, self.results)
        self.packed = [i for b in self.buckets for i in b.indices]
        self._packed_views = [self.results[i] for i in self.packed]
        self.direct = [i for i, g in enumerate(grads) if g is not None and g.numel() >= direct_numel]
        self.direct_out = [torch.empty(grads[i].numel(), dtype=grads[i].dtype, device=grads[i].device)
                           for i in self.direct]
        for i, out in zip(self.direct, self.direct_out):
            self.results[i] = out.view(grads[i].shape)

    def stage(self, grads: Sequence[Tensor | None]) -> tuple[list[Tensor], list[Tensor]]:
        """Packs the small gradients (one fused copy, skipped where backward accumulated into last
        step's results in place) and returns the (inputs, outputs) to all-reduce."""
        src = [grads[i] for i in self.packed]
        if any(s is not d for s, d in zip(src, self._packed_views)):
            torch._foreach_copy_(self._packed_views, src)  # a tensor copied onto itself is a no-op
        inputs = self.flats + [grads[i].reshape(-1) for i in self.direct]
        return inputs, self.flats + self.direct_out
