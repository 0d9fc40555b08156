"""Element structures for `Dataset`: flatten / rebuild, TensorSpec, batching and unbatching.

An element is a leaf or a tuple / dict / namedtuple / list of elements. Leaves are torch tensors,
numpy arrays, Python str / bytes / int / float / bool, and string tensors: a non-empty list of str
or bytes (what `batch` makes of str leaves), or of string tensors of one shape (what it makes of
those; see mirrored._strings). Any other list is a structure.
A structure's shape is a "tree" of nested tuples, hashable and cheap to compare:
None (a leaf), (_TUPLE, children), (_LIST, children), (_DICT, keys, children, dict type),
(_NAMEDTUPLE, class, children). Uses torch and numpy only.
"""
from __future__ import annotations

import collections
import dataclasses
import functools
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import torch

from mirrored._strings import is_string_tensor, string_items, string_tensor_shape

Tree = Any  # None for a leaf, else one of the tuples described above
_TUPLE, _LIST, _DICT, _NAMEDTUPLE = 0, 1, 2, 3
_STRINGS = (str, bytes)
_PY_TO_TORCH = {bool: torch.bool, int: torch.int64, float: torch.float32}


@dataclasses.dataclass(frozen=True)
class TensorSpec:
    """Shape and dtype of one leaf of a dataset element, like tf.TensorSpec.

    `shape` holds None for a dimension that varies (the batch dimension unless drop_remainder=True);
    `shape` itself is None when even the rank varies. `dtype` is a torch.dtype for tensors, and the
    Python type (str, bytes, int, float, bool) for leaves that are plain Python values."""

    shape: tuple[int | None, ...] | None
    dtype: torch.dtype | type

    def is_compatible_with(self, value: Any) -> bool:
        """Whether `value` (a leaf) has this spec's dtype and a shape matching its known dims."""
        other = spec_of_leaf(value)
        if other.dtype != self.dtype:
            return False
        return _shapes_compatible(self.shape, other.shape)

    def __repr__(self) -> str:
        dtype = self.dtype.__name__ if isinstance(self.dtype, type) else str(self.dtype)
        return f"TensorSpec(shape={self.shape}, dtype={dtype})"


def _shapes_compatible(want: tuple | None, got: tuple | None) -> bool:
    if want is None or got is None:
        return True
    return len(want) == len(got) and all(w is None or w == g for w, g in zip(want, got))


# ---------------------------------------------------------------------------------------- trees


def flatten(x: Any) -> tuple[list[Any], Tree]:
    """The leaves of `x` depth first, and its tree."""
    leaves: list[Any] = []
    return leaves, _flatten(x, leaves)


def _flatten(x: Any, leaves: list[Any]) -> Tree:
    t = type(x)
    if t is tuple:
        return (_TUPLE, tuple([_flatten(c, leaves) for c in x]))
    if t is dict or isinstance(x, dict):
        keys = tuple(x)
        kind = t if t in (dict, collections.OrderedDict) else dict
        return (_DICT, keys, tuple([_flatten(x[k], leaves) for k in keys]), kind)
    if isinstance(x, tuple):
        if hasattr(t, "_fields"):
            return (_NAMEDTUPLE, t, tuple([_flatten(c, leaves) for c in x]))
        return (_TUPLE, tuple([_flatten(c, leaves) for c in x]))
    if t is list and not is_string_tensor(x):
        return (_LIST, tuple([_flatten(c, leaves) for c in x]))
    leaves.append(x)
    return None


def flatten_source(x: Any) -> tuple[list[Any], Tree]:
    """Like `flatten`, for the argument of from_tensors / from_tensor_slices, where every list is a
    leaf: tf.data reads a list there as one tensor (or one string vector), never as a structure."""
    leaves: list[Any] = []
    return leaves, _flatten_source(x, leaves)


def _flatten_source(x: Any, leaves: list[Any]) -> Tree:
    if isinstance(x, dict):
        keys = tuple(x)
        kind = type(x) if type(x) in (dict, collections.OrderedDict) else dict
        return (_DICT, keys, tuple([_flatten_source(x[k], leaves) for k in keys]), kind)
    if isinstance(x, tuple):
        children = tuple([_flatten_source(c, leaves) for c in x])
        return (_NAMEDTUPLE, type(x), children) if hasattr(type(x), "_fields") else (_TUPLE, children)
    leaves.append(x)
    return None


class StructureMismatch(ValueError):
    """An element whose structure differs from the tree it is read against."""


def flatten_as(tree: Tree, x: Any) -> list[Any]:
    """The leaves of `x` read in the order of `tree`; StructureMismatch if `x` has another shape.
    Dict keys are looked up by name, so dicts built in another key order still match."""
    if tree is None:
        return [x]
    if tree[0] == _TUPLE and type(x) is tuple and all(c is None for c in tree[1]):
        if len(x) != len(tree[1]):
            raise StructureMismatch(f"a tuple of {len(x)} items instead of {len(tree[1])}")
        return list(x)
    leaves: list[Any] = []
    _flatten_as(tree, x, leaves)
    return leaves


def _flatten_as(tree: Tree, x: Any, leaves: list[Any]) -> None:
    if tree is None:
        leaves.append(x)
        return
    kind = tree[0]
    if kind == _DICT:
        if not isinstance(x, dict) or len(x) != len(tree[1]) or any(k not in x for k in tree[1]):
            raise StructureMismatch(f"{describe(x)} instead of a dict with keys {list(tree[1])}")
        for k, child in zip(tree[1], tree[2]):
            _flatten_as(child, x[k], leaves)
        return
    if kind == _NAMEDTUPLE:
        ok = type(x) is tree[1]
    elif kind == _TUPLE:
        ok = isinstance(x, tuple) and not hasattr(type(x), "_fields")
    else:
        ok = type(x) is list
    children = tree[-1]
    if not ok or len(x) != len(children):
        raise StructureMismatch(f"{describe(x)} instead of {describe_tree(tree)}")
    for child, item in zip(children, x):
        _flatten_as(child, item, leaves)


def unflatten(tree: Tree, leaves: list[Any]) -> Any:
    """Inverse of `flatten`: the structure `tree` holding `leaves`."""
    return builder(tree)(leaves)


@functools.lru_cache(maxsize=256)
def builder(tree: Tree) -> Callable[[list[Any]], Any]:
    """A function leaves -> structure for `tree`, with fast paths for the common flat shapes."""
    if tree is None:
        return lambda leaves: leaves[0]
    kind = tree[0]
    if all(c is None for c in tree[-1 if kind != _DICT else 2]):
        if kind == _TUPLE:
            return tuple
        if kind == _LIST:
            return list
        if kind == _NAMEDTUPLE:
            cls = tree[1]
            return lambda leaves: cls(*leaves)
        keys, ctor = tree[1], tree[3]
        return lambda leaves: ctor(zip(keys, leaves))
    return lambda leaves: _build(tree, iter(leaves))


def _build(tree: Tree, it: Iterator[Any]) -> Any:
    if tree is None:
        return next(it)
    kind = tree[0]
    if kind == _DICT:
        return tree[3]((k, _build(c, it)) for k, c in zip(tree[1], tree[2]))
    items = [_build(c, it) for c in tree[-1]]
    if kind == _TUPLE:
        return tuple(items)
    if kind == _LIST:
        return items
    return tree[1](*items)


def map_leaves(fn: Callable[[Any], Any], x: Any) -> Any:
    leaves, tree = flatten(x)
    return unflatten(tree, [fn(leaf) for leaf in leaves])


def leaf_paths(tree: Tree, prefix: str = "") -> list[str]:
    """A readable path per leaf, in flatten order: "[0]", "['image']", ".label"."""
    if tree is None:
        return [prefix]
    kind = tree[0]
    if kind == _DICT:
        parts = [f"[{k!r}]" for k in tree[1]]
        children = tree[2]
    elif kind == _NAMEDTUPLE:
        parts = [f".{f}" for f in tree[1]._fields]
        children = tree[2]
    else:
        parts = [f"[{i}]" for i in range(len(tree[1]))]
        children = tree[1]
    out: list[str] = []
    for part, child in zip(parts, children):
        out.extend(leaf_paths(child, prefix + part))
    return out


def describe(x: Any) -> str:
    if isinstance(x, dict):
        return f"a dict with keys {list(x)}"
    if isinstance(x, (list, tuple)):
        return f"a {type(x).__name__} of {len(x)} items"
    if isinstance(x, (torch.Tensor, np.ndarray)):
        return f"a {type(x).__name__} of shape {tuple(x.shape)}"
    return f"a {type(x).__name__}"


def describe_tree(tree: Tree) -> str:
    if tree is None:
        return "a leaf"
    kind = tree[0]
    if kind == _DICT:
        return f"a dict with keys {list(tree[1])}"
    name = {_TUPLE: "tuple", _LIST: "list"}.get(kind) or tree[1].__name__
    return f"a {name} of {len(tree[-1])} items"


# ---------------------------------------------------------------------------------------- specs


def spec_of_leaf(x: Any) -> TensorSpec:
    if isinstance(x, torch.Tensor):
        return TensorSpec(tuple(x.shape), x.dtype)
    if isinstance(x, np.ndarray):
        if x.dtype.kind in "USO":
            return TensorSpec(tuple(x.shape), bytes if x.dtype.kind == "S" else str)
        return TensorSpec(tuple(x.shape), torch_dtype_of(x.dtype))
    if isinstance(x, np.generic):
        return TensorSpec((), torch_dtype_of(x.dtype))
    shape = string_tensor_shape(x)
    if shape is not None:
        return TensorSpec(shape, bytes if all(isinstance(s, bytes) for s in string_items(x)) else str)
    if isinstance(x, str):
        return TensorSpec((), str)
    if isinstance(x, bytes):
        return TensorSpec((), bytes)
    return TensorSpec((), type(x))


def spec_of(element: Any) -> Any:
    """The element's structure with a TensorSpec per leaf."""
    return map_leaves(spec_of_leaf, element)


def torch_dtype_of(dtype: np.dtype) -> torch.dtype:
    return torch.from_numpy(np.empty(0, dtype=dtype)).dtype


def batched_spec(spec: TensorSpec, batch_size: int | None) -> TensorSpec:
    dtype = _PY_TO_TORCH.get(spec.dtype, spec.dtype) if isinstance(spec.dtype, type) else spec.dtype
    shape = None if spec.shape is None else (batch_size, *spec.shape)
    return TensorSpec(shape, dtype)


def unbatched_spec(spec: TensorSpec) -> TensorSpec:
    return TensorSpec(None if spec.shape is None else spec.shape[1:], spec.dtype)


def merged_spec(a: TensorSpec, b: TensorSpec) -> TensorSpec:
    """The most specific spec both `a` and `b` satisfy (for concatenate): differing dims -> None."""
    if a.dtype != b.dtype:
        raise TypeError(f"the two datasets have leaves of different dtypes: {a} vs {b}")
    if a.shape is None or b.shape is None or len(a.shape) != len(b.shape):
        return TensorSpec(None, a.dtype)
    return TensorSpec(tuple(x if x == y else None for x, y in zip(a.shape, b.shape)), a.dtype)


# ---------------------------------------------------------------------------------- source leaves


def as_column(x: Any, path: str, where: str) -> torch.Tensor | list:
    """A leaf of from_tensor_slices as something sliceable along dim 0: a tensor or a list of str.
    Lists are one tensor (or one string vector), as in tf.data; tuples and dicts are structures."""
    value = as_constant(x, path, where)
    if isinstance(value, torch.Tensor):
        if value.dim() == 0:
            raise ValueError(
                f"{where}: component {path or 'x'} is a scalar (shape ()), which has no dimension 0 to "
                "slice. Use Dataset.from_tensors for one element, or give a tensor of shape (n, ...)."
            )
        return value
    if isinstance(value, list):
        return value
    raise ValueError(
        f"{where}: component {path or 'x'} is {describe(value)}, which cannot be sliced. Give tensors, "
        "numpy arrays or lists of str, nested in tuples or dicts."
    )


def as_constant(x: Any, path: str, where: str) -> Any:
    """A leaf of from_tensors / from_tensor_slices converted the way tf.data converts it: numpy and
    Python numbers and lists of numbers become tensors, str stays str, a list of str stays a list."""
    if isinstance(x, torch.Tensor):
        return x
    if isinstance(x, np.ndarray):
        return numpy_leaf(x, path, where)
    if isinstance(x, np.generic):
        return torch.as_tensor(np.asarray(x))
    if isinstance(x, _STRINGS):
        return x
    if isinstance(x, (bool, int, float)):
        return torch.tensor(x)
    if type(x) is list:
        if is_string_tensor(x):
            return list(x)
        try:
            if any(isinstance(v, (torch.Tensor, np.ndarray)) for v in x):
                return torch.stack([torch.as_tensor(v) for v in x])
            return torch.tensor(x) if x else torch.empty(0)
        except (RuntimeError, TypeError, ValueError) as e:
            raise ValueError(
                f"{where}: component {path or 'x'} is a list, which tf.data reads as ONE tensor, but "
                f"its items do not stack ({e}). If the items are separate components (e.g. images "
                "and labels), pass them as a tuple: (images, labels)."
            ) from None
    raise TypeError(
        f"{where}: component {path or 'x'} is {describe(x)}; expected a torch.Tensor, numpy array, "
        "number, str, or a list of numbers or of str (nested in tuples, dicts or namedtuples)."
    )


def numpy_leaf(x: np.ndarray, path: str, where: str) -> torch.Tensor | list:
    if x.dtype.kind in "USO":
        if x.ndim == 0 or not x.size or not all(isinstance(s, _STRINGS) for s in x.ravel().tolist()):
            raise TypeError(
                f"{where}: component {path or 'x'} is a numpy array of dtype {x.dtype} and shape "
                f"{x.shape}; only non-empty arrays of str or bytes (1-D or more) are supported for "
                "text. Convert numbers to a numeric dtype."
            )
        return x.tolist()  # nested lists: a string tensor of the array's shape
    if not x.flags.writeable or not x.dtype.isnative:
        x = x.astype(x.dtype.newbyteorder("="), copy=True)
    try:
        return torch.from_numpy(x)
    except TypeError as e:
        raise TypeError(f"{where}: component {path or 'x'}: {e}. Cast it with .astype(...).") from None


def to_torch_leaf(x: Any) -> Any:
    """numpy values from a user generator become tensors (as tf.data converts them); else unchanged."""
    if isinstance(x, np.ndarray):
        return numpy_leaf(x, "", "Dataset.from_generator")
    if isinstance(x, np.generic):
        return torch.as_tensor(np.asarray(x))
    return x


def to_numpy_leaf(x: Any) -> Any:
    if isinstance(x, torch.Tensor):
        return x.detach().cpu().numpy()
    return x


# ------------------------------------------------------------------------------ batch / unbatch


def collate(elements: list[Any], first_index: int) -> Any:
    """Stacks `elements` into one batch: tensors with one torch.stack per leaf, numbers into a
    tensor, str into a list of str. `first_index` (the input position of elements[0]) is for errors."""
    leaves0, tree = flatten(elements[0])
    if tree is None:
        columns: Any = [elements]
    else:
        rows = [leaves0]
        for k in range(1, len(elements)):
            try:
                rows.append(flatten_as(tree, elements[k]))
            except StructureMismatch as e:
                raise ValueError(
                    f"Dataset.batch: element {first_index + k} (item {k} of its batch) is {e}, unlike "
                    f"element {first_index}. Every element of a batch needs the same structure."
                ) from None
        columns = list(zip(*rows))
    paths = None
    out = []
    for j, column in enumerate(columns):
        try:
            out.append(_stack(column))
        except _BadColumn as e:
            paths = paths or leaf_paths(tree)
            where = f" component {paths[j]}" if paths[j] else ""
            k = e.index
            if k is None:
                raise ValueError(f"Dataset.batch: cannot stack{where} of the batch that starts at element "
                                 f"{first_index}: {e.got}") from None
            raise ValueError(
                f"Dataset.batch: cannot stack{where}: element {first_index + k} (item {k} of its "
                f"batch) has {e.got} but element {first_index} has {e.want}. Give all elements one "
                "shape and dtype first (e.g. resize / cast in a map), or batch(1)."
            ) from None
    return unflatten(tree, out)


class _BadColumn(Exception):
    """Item `index` of a column does not stack with item 0 (index None: no single item to blame)."""

    def __init__(self, index: int | None, want: str, got: str):
        super().__init__(index, want, got)
        self.index, self.want, self.got = index, want, got


def _leaf_desc(x: Any) -> str:
    if isinstance(x, torch.Tensor) and x.device.type != "cpu":
        return f"shape {tuple(x.shape)} dtype {x.dtype} on {x.device}"
    if isinstance(x, (torch.Tensor, np.ndarray)):
        return f"shape {tuple(x.shape)} dtype {x.dtype}"
    return f"a value of type {type(x).__name__}"


def _first_mismatch(column: tuple, same: Callable[[Any, Any], bool], error: Exception | None = None) -> _BadColumn:
    x0 = column[0]
    for k, x in enumerate(column):
        if not same(x0, x):
            return _BadColumn(k, _leaf_desc(x0), _leaf_desc(x))
    return _BadColumn(None, _leaf_desc(x0), f"{type(error).__name__}: {error}")


def _stack(column: tuple) -> Any:
    x0 = column[0]
    if isinstance(x0, torch.Tensor):
        dtype = x0.dtype
        for x in column:
            if not isinstance(x, torch.Tensor) or x.dtype != dtype:
                raise _first_mismatch(column, lambda a, b: isinstance(b, torch.Tensor) and a.dtype == b.dtype)
        try:
            return torch.stack(column)
        except RuntimeError as e:
            raise _first_mismatch(column, lambda a, b: a.shape == b.shape and a.device == b.device, e) from None
    if isinstance(x0, np.ndarray):
        try:
            return torch.as_tensor(np.stack(column))
        except (ValueError, TypeError) as e:
            raise _first_mismatch(
                column, lambda a, b: isinstance(b, np.ndarray) and a.shape == b.shape and a.dtype == b.dtype, e
            ) from None
    if isinstance(x0, _STRINGS):
        for x in column:
            if not isinstance(x, _STRINGS):
                raise _first_mismatch(column, lambda a, b: isinstance(b, _STRINGS))
        return list(column)
    if isinstance(x0, (bool, int, float, np.generic)) or x0 is None:
        try:
            return torch.tensor(column)
        except (TypeError, RuntimeError, ValueError) as e:
            raise _first_mismatch(column, lambda a, b: isinstance(b, (bool, int, float, np.generic)), e) from None
    shape = string_tensor_shape(x0)
    if shape is not None:  # string tensors of one shape stack into one of a rank more (tf.data refuses ragged ones)
        for k, x in enumerate(column):
            other = string_tensor_shape(x)
            if other != shape:
                raise _BadColumn(k, f"strings of shape {shape}",
                                 f"strings of shape {other}" if other is not None else _leaf_desc(x))
    return list(column)


def unbatch_rows(element: Any, index: int) -> Iterator[Any]:
    """The rows of one batched element: dim 0 of each tensor, item of each string vector."""
    leaves, tree = flatten(element)
    sizes = []
    for leaf in leaves:
        if isinstance(leaf, (torch.Tensor, np.ndarray)) and leaf.ndim > 0:
            sizes.append(leaf.shape[0])
        elif type(leaf) is list:
            sizes.append(len(leaf))
        else:
            sizes.append(None)
    if None in sizes or len(set(sizes)) > 1:
        paths = leaf_paths(tree)
        listing = ", ".join(
            f"{p or 'element'}: {'unbatchable ' + _leaf_desc(leaf) if s is None else s}"
            for p, s, leaf in zip(paths, sizes, leaves)
        )
        raise ValueError(
            f"Dataset.unbatch: element {index} does not have one batch size in dimension 0 across its "
            f"components ({listing}). Every component needs a leading dimension of the same size."
        )
    columns = [leaf.unbind(0) if isinstance(leaf, torch.Tensor) else list(leaf) for leaf in leaves]
    if tree is None:
        return iter(columns[0])
    build = builder(tree)
    return (build(row) for row in zip(*columns))
