"""Source nodes for `Dataset`: tensor slices, one tensor, range, a Python generator, zip,
concatenate, and the list of files a reader opens (Files, which FILE auto-sharding divides). Each
pass of a source starts from the beginning (the generator is called again).
Uses torch, _structure.py, _threads.py and the Node base class of _pipeline.py.
"""
from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch

from mirrored.data import _structure
from mirrored.data._pipeline import INFINITE_CARDINALITY, UNKNOWN_CARDINALITY, Node
from mirrored.data._structure import TensorSpec, flatten, spec_of, unflatten
from mirrored.data._threads import add_note, close_iterator

_SLICE_CHUNK = 1024  # slices made per torch call: amortises the call, bounds the views alive at once


class TensorSlices(Node):
    kind = "from_tensor_slices"
    exact_spec = True  # every element is a slice (or the whole) of tensors it holds

    def __init__(self, columns: list[Any], tree: Any, length: int):
        super().__init__()
        self.columns, self.tree, self.length = columns, tree, length

    def iterate(self, probe: bool) -> Iterator[Any]:
        build = _structure.builder(self.tree)
        for start in range(0, self.length, _SLICE_CHUNK):
            stop = min(start + _SLICE_CHUNK, self.length)
            parts = [c[start:stop].unbind(0) if isinstance(c, torch.Tensor) else c[start:stop]
                     for c in self.columns]
            if self.tree is None:
                yield from parts[0]
            elif build is tuple:
                yield from zip(*parts)
            else:
                yield from map(build, zip(*parts))

    def cardinality(self) -> int:
        return self.length

    def _compute_spec(self) -> Any:
        specs = [TensorSpec(tuple(c.shape[1:]), c.dtype) if isinstance(c, torch.Tensor)
                 else TensorSpec((), bytes if c and all(isinstance(s, bytes) for s in c) else str)
                 for c in self.columns]
        return unflatten(self.tree, specs)

    def describe(self) -> str:
        return f"from_tensor_slices({self.length} elements)"


class Files(Node):
    """The files (names, or TFDS shard indices) a pipeline reads, in order. A multi-worker strategy's
    FILE auto-sharding sets `shard` = (workers, rank): this worker then lists every workers-th item from
    its rank, so it opens and decodes about 1/workers of the bytes (tf.data's auto_shard rewrite)."""

    kind = "files"
    exact_spec = True

    def __init__(self, items: list[Any], what: str):
        super().__init__()
        self.items, self.what = items, what  # what: "file" or "shard", for messages
        self.shard = (1, 0)

    def mine(self) -> list[Any]:
        count, index = self.shard
        return self.items[index::count]

    def iterate(self, probe: bool) -> Iterator[Any]:
        return iter(self.mine())

    def cardinality(self) -> int:
        return len(self.mine())

    def _compute_spec(self) -> Any:
        first = self.items[0] if self.items else ""
        return spec_of(first) if isinstance(first, torch.Tensor) else TensorSpec((), str)

    def describe(self) -> str:
        count, index = self.shard
        return f"files({len(self.items)} {self.what}s" + (f", shard {index} of {count})" if count > 1 else ")")


class Tensors(Node):
    kind = "from_tensors"
    exact_spec = True  # every element is a slice (or the whole) of tensors it holds

    def __init__(self, value: Any):
        super().__init__()
        self.value = value

    def iterate(self, probe: bool) -> Iterator[Any]:
        return iter((self.value,))

    def cardinality(self) -> int:
        return 1

    def _compute_spec(self) -> Any:
        return spec_of(self.value)


class Range(Node):
    kind = "range"

    def __init__(self, start: int, stop: int, step: int, dtype: torch.dtype):
        super().__init__()
        self.range, self.dtype = range(start, stop, step), dtype

    def iterate(self, probe: bool) -> Iterator[Any]:
        r, dtype = self.range, self.dtype
        for i in range(0, len(r), _SLICE_CHUNK):
            part = r[i:i + _SLICE_CHUNK]
            yield from torch.arange(part.start, part.stop, part.step, dtype=dtype).unbind(0)

    def cardinality(self) -> int:
        return len(self.range)

    def _compute_spec(self) -> Any:
        return TensorSpec((), self.dtype)

    def describe(self) -> str:
        r = self.range
        return f"range({r.start}, {r.stop}, {r.step})"


class Generator(Node):
    kind = "from_generator"

    def __init__(self, fn: Callable[[], Any], signature: Any):
        super().__init__()
        self.fn, self.signature = fn, signature
        if signature is not None:
            self.signature_specs, self.signature_tree = flatten(signature)
            self.signature_paths = _structure.leaf_paths(self.signature_tree)

    def iterate(self, probe: bool) -> Iterator[Any]:
        it = iter(self.fn())  # called anew each pass, as tf.data calls the generator
        check = self._convert if self.signature is None else self._check
        index = 0
        try:
            while True:
                try:
                    x = next(it)
                except StopIteration:
                    return
                except Exception as e:
                    add_note(e, f"in Dataset.from_generator generator, element {index}")
                    raise
                yield check(x, index)
                index += 1
        finally:
            close_iterator(it)

    @staticmethod
    def _convert(x: Any, index: int) -> Any:
        if isinstance(x, torch.Tensor):
            return x
        leaves, tree = flatten(x)
        return unflatten(tree, [_structure.to_torch_leaf(leaf) for leaf in leaves])

    def _check(self, x: Any, index: int) -> Any:
        try:
            leaves = _structure.flatten_as(self.signature_tree, x)
        except _structure.StructureMismatch as e:
            raise ValueError(
                f"Dataset.from_generator: element {index} is {e}, not the structure of "
                f"output_signature {self.signature}. Fix the generator or the output_signature."
            ) from None
        return unflatten(self.signature_tree, [
            _conform(leaf, spec, index, path)
            for leaf, spec, path in zip(leaves, self.signature_specs, self.signature_paths)
        ])

    def cardinality(self) -> int:
        return UNKNOWN_CARDINALITY

    def _compute_spec(self) -> Any:
        return self.signature if self.signature is not None else self._probe_spec()


def _conform(leaf: Any, spec: TensorSpec, index: int, path: str) -> Any:
    """`leaf` converted to `spec.dtype` (only where the conversion loses nothing), shape checked."""
    where = f"Dataset.from_generator: element {index}" + (f", component {path}" if path else "")
    if isinstance(spec.dtype, torch.dtype):
        try:
            value = torch.as_tensor(_structure.to_torch_leaf(leaf))
        except (TypeError, RuntimeError, ValueError):
            value = None
        if value is None or not torch.can_cast(value.dtype, spec.dtype):
            got = _structure.describe(leaf) if value is None else f"dtype {value.dtype}"
            raise TypeError(f"{where} is {got}, which does not convert to {spec.dtype} without loss; "
                            "fix the generator or the output_signature.")
        value = value.to(spec.dtype)
    else:
        value = _structure.to_torch_leaf(leaf)
        if _structure.spec_of_leaf(value).dtype != spec.dtype:
            raise TypeError(f"{where} is {_structure.describe(leaf)}, but output_signature says "
                            f"{spec}; fix the generator or the output_signature.")
    got = _structure.spec_of_leaf(value).shape
    if not _structure._shapes_compatible(spec.shape, got):
        raise ValueError(f"{where} has shape {got}, but output_signature says {spec.shape}; fix "
                         "the generator or the output_signature.")
    return value


class Zip(Node):
    kind = "zip"

    def __init__(self, inputs: list[Node], tree: Any):
        super().__init__(*inputs)
        self.tree = tree

    def iterate(self, probe: bool) -> Iterator[Any]:
        its = [n.iterate(probe) for n in self.inputs]
        build = _structure.builder(self.tree)
        try:
            if build is tuple:
                yield from zip(*its)
            else:
                yield from map(build, zip(*its))
        finally:
            for it in its:
                close_iterator(it)

    def cardinality(self) -> int:
        sizes = [n.cardinality() for n in self.inputs]
        if UNKNOWN_CARDINALITY in sizes:
            return UNKNOWN_CARDINALITY
        finite = [s for s in sizes if s != INFINITE_CARDINALITY]
        return min(finite) if finite else INFINITE_CARDINALITY

    def _compute_spec(self) -> Any:
        return unflatten(self.tree, [n.spec() for n in self.inputs])

    def describe(self) -> str:
        return f"zip({len(self.inputs)} datasets)"


class Concatenate(Node):
    kind = "concatenate"

    def iterate(self, probe: bool) -> Iterator[Any]:
        for node in self.inputs:
            it = node.iterate(probe)
            try:
                yield from it
            finally:
                close_iterator(it)

    def cardinality(self) -> int:
        a, b = (n.cardinality() for n in self.inputs)
        if INFINITE_CARDINALITY in (a, b):
            return INFINITE_CARDINALITY
        if UNKNOWN_CARDINALITY in (a, b):
            return UNKNOWN_CARDINALITY
        return a + b

    def _compute_spec(self) -> Any:
        (a, tree_a), (b, tree_b) = (flatten(n.spec()) for n in self.inputs)
        if tree_a != tree_b:
            raise TypeError(
                f"Dataset.concatenate: the datasets have different element structures, "
                f"{self.inputs[0].spec()} vs {self.inputs[1].spec()}. Map one to the other's structure."
            )
        return unflatten(tree_a, [_structure.merged_spec(x, y) for x, y in zip(a, b)])
