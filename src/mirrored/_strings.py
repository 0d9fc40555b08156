"""String tensors as the input pipeline holds them: nested Python lists of str / bytes.

TF keeps text in string tensors of any rank; here a rank-1 string tensor is a non-empty list of
str or bytes, and a rank-k one (k > 1) a non-empty list of rank-(k-1) string tensors of one shape,
which is what `Dataset.batch` makes of string vectors. The pipeline and the distribute values treat
such a list as one leaf (it splits along dim 0 like a tensor), never as a structure. One definition
for both, so a batch the pipeline makes is the leaf the strategy splits. Uses the standard library only.
"""
from __future__ import annotations

from typing import Any

_STRINGS = (str, bytes)


def string_tensor_shape(x: Any) -> tuple[int, ...] | None:
    """The shape of `x` as a string tensor, or None when it is not one (a structure, or ragged)."""
    if type(x) is not list or not x:
        return None
    if all(isinstance(s, _STRINGS) for s in x):
        return (len(x),)
    inner = string_tensor_shape(x[0])
    if inner is None or any(string_tensor_shape(row) != inner for row in x[1:]):
        return None
    return (len(x), *inner)


def is_string_tensor(x: Any) -> bool:
    return string_tensor_shape(x) is not None


def string_items(x: list) -> list[str | bytes]:
    """The strings of a string tensor, row by row."""
    if all(isinstance(s, _STRINGS) for s in x):
        return x
    return [s for row in x for s in string_items(row)]


def nest_strings(items: list[Any], shape: tuple[int, ...] | list[int]) -> list:
    """Inverse of string_items: `items` as nested lists of `shape`."""
    if len(shape) <= 1:
        return list(items)
    step = len(items) // shape[0] if shape[0] else 0
    return [nest_strings(items[i * step:(i + 1) * step], shape[1:]) for i in range(shape[0])]
