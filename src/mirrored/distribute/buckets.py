"""Gradient packing: many small tensors travel as a few flat buckets, one collective per bucket.

`plan(tensors, bytes_per_pack)` groups tensors of one dtype and device, in order, into buckets of
at most `bytes_per_pack` bytes (a tensor larger than that gets a bucket of its own); `pack` copies
them into one flat buffer on the device of the tensors it is given (a plan made from one replica's
tensors serves the others, each on its own device), and `unpack` hands back views of it. A
`Layout` is the plan for tensors of one signature (which are packed, which are read where they
lie); each replica makes its own from its own tensors, so its buffers lie on its device. Its
`buffers()` can be kept and reused step after step, so a training step allocates nothing. Uses
torch only.
"""
from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any

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
    strides: list[tuple[int, ...] | None] = field(default_factory=list)  # None: row-major (contiguous)
    numel: int = 0

    def add(self, index: int, tensor: Tensor) -> None:
        self.indices.append(index)
        self.shapes.append(tensor.shape)
        self.offsets.append(self.numel)
        strides = tuple(tensor.stride())
        self.strides.append(None if strides == _row_major(tensor.shape) or dense_flat(tensor) is None else strides)
        self.numel += tensor.numel()

    def new_buffer(self, device: torch.device | None = None) -> Tensor:
        """An uninitialised flat buffer for this bucket, on `device` (the planned one when None)."""
        return torch.empty(self.numel, dtype=self.dtype, device=self.device if device is None else device)

    def pack(self, tensors: Sequence[Tensor | None], out: Tensor | None = None) -> Tensor:
        """Copies this bucket's tensors into `out` and returns it. A new buffer (out=None) lies on the
        device of the tensors packed, not the planned one: a plan made from replica 0's tensors packs
        replica 1's on replica 1's device (NCCL needs one buffer per GPU)."""
        if out is None:
            out = self.new_buffer(tensors[self.indices[0]].device if self.indices else None)
        for i, off, shape, strides in zip(self.indices, self.offsets, self.shapes, self.strides):
            t = tensors[i]
            region = out[off:off + t.numel()]
            dst = region.view(shape) if strides is None else region.as_strided(shape, strides)
            if dst.data_ptr() != t.data_ptr() or dst.stride() != t.stride():  # (not a view of this buffer already)
                dst.copy_(t)
        return out

    def unpack(self, flat: Tensor, into: list[Tensor | None]) -> None:
        """Puts views of `flat` (one per packed tensor, in its shape) into `into` at their indices. A
        tensor planned in a dense non-row-major layout (channels_last) gets a view in that layout, so
        a gradient keeps its parameter's strides and the optimizer's foreach kernels their fast path."""
        parts = flat.split([shape.numel() for shape in self.shapes])  # one call for all the views
        for i, part, shape, strides in zip(self.indices, parts, self.shapes, self.strides):
            into[i] = _shaped(part, shape) if strides is None else part.as_strided(shape, strides)


def _shaped(flat: Tensor, shape: Sequence[int]) -> Tensor:
    """`flat` viewed in `shape`: view(*ints) costs a third of view(torch.Size), and 1-D needs none."""
    if len(shape) == 1:
        return flat
    return flat.view(*shape) if shape else flat.view(())


def _row_major(shape: Sequence[int]) -> tuple[int, ...]:
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= size
    return tuple(reversed(strides))


def dense_flat(t: Tensor) -> Tensor | None:
    """A 1-D view of `t`'s elements in memory order when they fill one block without gaps or overlap
    (row-major, or a permutation such as channels_last), else None."""
    if t.is_contiguous():
        return t.view(-1)
    expected = 1
    for stride, size in sorted((st, sz) for st, sz in zip(t.stride(), t.shape) if sz != 1):
        if stride != expected:
            return None
        expected *= size
    return t.as_strided((t.numel(),), (1,))


def plan(tensors: Sequence[Tensor | None], bytes_per_pack: int,
         groups: Sequence[Hashable] | None = None) -> list[Bucket]:
    """Buckets for `tensors` (None entries are left out), at most `bytes_per_pack` bytes each.
    `groups[i]`, when given, also keeps tensors of different groups apart (a plan for several
    replicas groups by every replica's device of tensor i, so no bucket mixes devices anywhere)."""
    open_buckets: dict[tuple[Any, ...], Bucket] = {}
    done: list[Bucket] = []
    for i, t in enumerate(tensors):
        if t is None:
            continue
        key = (t.dtype, t.device) if groups is None else (t.dtype, t.device, groups[i])
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


class Layout:
    """Where the tensors of one signature travel: small ones packed into flat buckets, ones of
    `direct_numel` elements or more read where they lie (packing them would only copy). Holds no
    buffers: `buffers()` makes a set, which the caller may keep and reuse step after step, on the
    devices of the tensors the layout was made from."""

    def __init__(self, tensors: Sequence[Tensor | None], bytes_per_pack: int, direct_numel: int):
        small = [t if t is not None and t.numel() < direct_numel else None for t in tensors]
        self.buckets = plan(small, bytes_per_pack)
        self.packed = [i for b in self.buckets for i in b.indices]
        self.direct = [(i, t.numel(), t.dtype, t.device, tuple(t.shape)) for i, t in enumerate(tensors)
                       if t is not None and t.numel() >= direct_numel]
        self.size = len(tensors)

    def buffers(self, in_place: bool = False) -> LayoutBuffers:
        """Fresh buffers for reductions of this layout: flat buckets for the small tensors, and for
        the large ones an output each, or none with `in_place` (they are then reduced where they lie,
        as DDP reduces .grad: half the memory, and half the bytes for the caches to hold)."""
        flats = [b.new_buffer() for b in self.buckets]
        results: list[Tensor | None] = [None] * self.size
        for b, flat in zip(self.buckets, flats):
            b.unpack(flat, results)
        direct_out = None if in_place else [torch.empty(numel, dtype=dtype, device=device)
                                            for _, numel, dtype, device, _ in self.direct]
        return LayoutBuffers(self, flats, direct_out, results)


class LayoutBuffers:
    """One set of buffers of a Layout: `stage(tensors)` gives what to reduce and where its results
    will be."""

    def __init__(self, layout: Layout, flats: list[Tensor], direct_out: list[Tensor] | None,
                 results: list[Tensor | None]):
        self.layout = layout
        self.flats = flats
        self.direct_out = direct_out
        self._packed_results = results
        self._packed_views = [results[i] for i in layout.packed]
        if direct_out is not None:
            self._fixed_results = list(results)
            for (i, *_, shape), out in zip(layout.direct, direct_out):
                self._fixed_results[i] = _shaped(out, shape)

    def stage(self, tensors: Sequence[Tensor | None], like: Sequence[Tensor] | None = None
              ) -> tuple[list[Tensor], list[Tensor], list[Tensor | None]]:
        """Packs the small tensors (one fused copy, skipped where they already are last step's
        results: backward accumulated into them) and returns the flat (inputs, outputs) to reduce
        and the `results` they become, in the tensors' shapes. In place, a large tensor is its own
        result when it is contiguous, or laid out like its `like` tensor (a gradient like its parameter:
        channels_last), and shares its memory with no other large one; otherwise (strided, expanded,
        or a gradient tied to another) it is reduced in a copy of its own. Every replica must then lay
        its tensor out alike, which the replicas' copies of a parameter do, and so their gradients."""
        src = [tensors[i] for i in self.layout.packed]
        if any(s is not d for s, d in zip(src, self._packed_views)):
            torch._foreach_copy_(self._packed_views, src)  # a tensor copied onto itself is a no-op
        if self.direct_out is not None:
            direct = [tensors[i].reshape(-1) for i, *_ in self.layout.direct]  # read only: a view will do
            return self.flats + direct, self.flats + self.direct_out, list(self._fixed_results)
        results = list(self._packed_results)
        inputs = list(self.flats)
        storages: set[int] = set()
        for i, *_, shape in self.layout.direct:
            t = tensors[i]
            storage = t.untyped_storage().data_ptr()
            same_layout = t.is_contiguous() or (like is not None and t.stride() == like[i].stride())
            flat = dense_flat(t) if same_layout and storage not in storages else None
            if flat is not None:  # reduced where it lies
                storages.add(storage)
                inputs.append(flat)
                results[i] = t
            else:
                flat = t.contiguous().view(-1)
                flat = flat.clone() if flat.data_ptr() == t.data_ptr() else flat
                inputs.append(flat)
                results[i] = _shaped(flat, shape)
        return inputs, inputs, results
