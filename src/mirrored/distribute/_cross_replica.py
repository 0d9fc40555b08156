"""Cross-replica reduce and gather: combine a strategy's per-replica values outside strategy.run.

reduce_leaves() is strategy.reduce for a list of leaves (everything that needs a cross-replica sum
goes into one packed sum_to_first() call on the first replica's device), gather_leaf() is
strategy.gather of one leaf; the helpers tell distributed values from plain ones and find the
per-replica copies of a variable, module or optimizer (strategy.experimental_local_results,
check_in_sync). Used by strategy.py (and multi_worker.py through it). Uses values.py,
cross_device_ops.py and devices.py; variables.py, modules.py and optimizer.py when called.
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from mirrored.distribute.cross_device_ops import mean_of_sum
from mirrored.distribute.devices import torch_device
from mirrored.distribute.values import DistributedValues, Mirrored, PerReplica, ReduceOp

if TYPE_CHECKING:
    from mirrored.distribute.strategy import Strategy

def reduce_leaves(strategy: Strategy, op: ReduceOp, leaves: list[Any], axis: int | Sequence[int] | None,
                   nested: bool) -> list[Any]:
    """`reduce` of each leaf: what needs a cross-replica sum goes into one `sum_to_first` call."""
    n = strategy.num_replicas_in_sync
    out: list[Any] = [None] * len(leaves)
    to_sum: list[tuple[int, list[Tensor]]] = []  # (leaf index, its per-replica parts)
    counts: dict[int, int] = {}  # leaf index -> elements summed along `axis`, for MEAN
    axes = None if axis is None else tuple(axis) if isinstance(axis, (tuple, list)) else (axis,)
    for i, leaf in enumerate(leaves):
        distributed = _is_distributed(leaf)
        if axes is not None:
            local = strategy.experimental_local_results(leaf) if distributed else [leaf] * n
            parts = [_as_tensor(p, None) for p in local]
            to_sum.append((i, [_sum_along(p, axes) for p in parts]))
            counts[i] = sum(math.prod(p.shape[a] for a in axes) for p in parts)
        elif not distributed:
            if n == 1 or op is ReduceOp.MEAN:
                out[i] = leaf.clone() if isinstance(leaf, Tensor) else leaf
            elif isinstance(leaf, (int, float)) and leaf == 0:
                out[i] = leaf
            else:
                where = f" (leaf {i} of the nest)" if nested else ""
                raise ValueError(
                    f"strategy.reduce(SUM, value) got a plain {type(leaf).__name__}{where}, not a PerReplica, "
                    f"on {n} replicas: it is unclear whether it is one replica's value or the total (TF refuses "
                    "this too). Pass the PerReplica that strategy.run returned, or use ReduceOp.MEAN for a value "
                    "that is the same on every replica.")
        elif op is ReduceOp.MEAN and isinstance(leaf, Mirrored):
            first = leaf.values[0]
            out[i] = first.clone() if isinstance(first, Tensor) else first
        elif op is ReduceOp.MEAN and _is_mirrored_variable(leaf):  # identical copies: no rounding, as in TF
            out[i] = leaf.values[0].detach().clone()
        else:
            to_sum.append((i, [_as_tensor(p, None) for p in strategy.experimental_local_results(leaf)]))
    totals = sum_to_first(strategy, [parts for _, parts in to_sum])
    for (i, _), total in zip(to_sum, totals):
        if axes is not None:
            out[i] = total if op is ReduceOp.SUM else mean_of_sum(total, counts[i])
        else:  # one replica: TF reduces nothing, and the dtype stays
            out[i] = mean_of_sum(total, n) if op is ReduceOp.MEAN and n > 1 else total
    return out


def sum_to_first(strategy: Strategy, columns: list[list[Tensor]]) -> list[Tensor]:
    """Each column's per-replica parts summed on the first replica's device: new tensors, even of
    one part. The columns travel together, packed into buckets: one cross-device call in all."""
    if not columns:
        return []
    if len(columns[0]) == 1:
        return [parts[0].clone() for parts in columns]
    pairs = [(PerReplica(parts), strategy._devices[0]) for parts in columns]
    return [mirrored.values[0] for mirrored in strategy._cross_device_ops.batch_reduce(ReduceOp.SUM, pairs)]


def gather_leaf(strategy: Strategy, value: Any, axis: int) -> Any:
    if not _is_distributed(value):
        if strategy.num_replicas_in_sync == 1:
            return value
        raise ValueError("strategy.gather got a plain value, not a PerReplica: pass what strategy.run "
                         "returned (a plain tensor has no per-replica parts to gather).")
    parts = [_as_tensor(p, None) for p in strategy.experimental_local_results(value)]
    if any(p.dim() == 0 for p in parts):
        raise ValueError("strategy.gather: the per-replica values are scalars (rank 0), which have no axis to "
                         "concatenate along. Gather tensors of rank >= 1, e.g. v.reshape(1).")
    target = torch_device(strategy._devices[0])
    return torch.cat([p.to(target) for p in parts], dim=axis)


def _is_distributed(value: Any) -> bool:
    from mirrored.distribute.variables import Variable

    return isinstance(value, DistributedValues) or (isinstance(value, Variable) and len(value.values) > 1)


def _sum_along(part: Tensor, axes: tuple[int, ...]) -> Tensor:
    """part summed over `axes`, keeping an integer dtype as TF's reduce_sum does (torch widens to int64)."""
    keep = not (part.is_floating_point() or part.is_complex() or part.dtype == torch.bool)
    return part.sum(dim=axes, dtype=part.dtype if keep else None)


def _as_tensor(value: Any, device: torch.device | None) -> Tensor:
    if isinstance(value, Tensor):
        t = value
    else:
        from mirrored.distribute.variables import Variable

        t = torch.as_tensor(value.read_value() if isinstance(value, Variable) else value)
    return t if device is None or t.device == device else t.to(device)


def _is_mirrored_variable(value: Any) -> bool:
    from mirrored.distribute.variables import MirroredVariable

    return isinstance(value, MirroredVariable)


def _local_copies(value: Any) -> tuple[Any, ...] | None:
    """This process's copies of a mirrored variable, module or optimizer; None for anything else."""
    from mirrored.distribute.modules import MirroredModule
    from mirrored.distribute.optimizer import MirroredOptimizer
    from mirrored.distribute.variables import Variable

    if isinstance(value, Variable):
        return value.values if len(value.values) > 1 else None
    if isinstance(value, (MirroredModule, MirroredOptimizer)):
        return value.replicas
    return None


def _component(value: Any, replica: int) -> Any:
    """Replica `replica`'s part of one leaf of a nest (the leaf itself where it has no parts)."""
    if isinstance(value, DistributedValues):
        return value.values[replica]
    copies = _local_copies(value)
    return value if copies is None else copies[replica]


def _bitwise_equal(a: Tensor, b: Tensor) -> bool:
    """Same bits (NaN equals NaN, -0.0 differs from 0.0), whatever the strides (channels_last state too);
    sparse COO tensors (SGD's momentum for a sparse gradient) by their coalesced indices and values."""
    if a.is_sparse or b.is_sparse:
        if a.layout != b.layout or a.shape != b.shape:
            return False
        a, b = a.coalesce(), b.coalesce()
        return torch.equal(a.indices(), b.indices()) and _bitwise_equal(a.values(), b.values())
    if a.is_floating_point() or a.is_complex():
        return torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))
    return torch.equal(a, b)
