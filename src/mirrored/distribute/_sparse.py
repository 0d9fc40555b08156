"""Sums of sparse gradients (torch.sparse_coo, as nn.Embedding(sparse=True) and
nn.EmbeddingBag(sparse=True) make them) for the gradient reducer: in one process, and across workers.

A sum is gathered - every replica's indices and values concatenated, then coalesced - or densified:
every replica's values added into a dense table of the parameter's shape, the rows they name marked,
and the table read back at the marked rows. Both give the coalesced sum, naming exactly the rows some
replica's gradient named, as one device's gradient does (SparseAdam updates the rows a
gradient names, a zero one too, so a row may be neither dropped nor added). Gathering costs what the
replicas' rows cost; densifying what the whole table costs, so `densify()` chooses by the rows
gathered against the rows of the table: densified once they pass half of them between threads, three
quarters across workers (measured by benchmarks/sparse_allreduce.py). Uses torch; the workers'
collectives are handed in.
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
from torch import Tensor

if TYPE_CHECKING:
    from mirrored.distribute._collectives import CollectiveAllReduce

# Densify where the rows gathered pass this share of the table's rows (benchmarks/sparse_allreduce.py,
# RESULTS.md: tables of 10^4 and 10^5 rows of 16 and 128 values, 2 replicas or 2 gloo workers). Below
# it gathering was up to 34x (threads) and 26x (workers) cheaper, above it densifying up to 4x and 2.4x;
# the rule's worst choice in that grid cost 1.5x (threads) and 1.4x (workers) the better one.
_THREADS_DENSIFY_AT = 0.5
_WORKERS_DENSIFY_AT = 0.75


def densify(gathered_rows: int, table_rows: int, across_workers: bool) -> bool:
    """Whether a sum that would gather `gathered_rows` rows (every replica's, duplicates included; across
    workers, the workers x the most any one sends) of a table of `table_rows` rows is densified instead."""
    return gathered_rows > table_rows * (_WORKERS_DENSIFY_AT if across_workers else _THREADS_DENSIFY_AT)


def table_rows(size: Sequence[int], sparse_dim: int) -> int:
    """The rows a sparse tensor of `size` may name: the product of its first sparse_dim sizes."""
    return math.prod(size[:sparse_dim])


def local_sum(parts: Sequence[Tensor], device: torch.device) -> Tensor:
    """The coalesced sum of sparse tensors of one size (one or more), a new tensor on `device`."""
    parts = [p.to(device) for p in parts]
    first = parts[0]
    rows = sum(p._nnz() for p in parts)
    if densify(rows, table_rows(first.shape, first.sparse_dim()), across_workers=False):
        table, touched = _empty_table(first.shape, first.sparse_dim(), first.dtype, device)
        for p in parts:
            _add_into(table, touched, p)
        return from_table(table, touched, first.sparse_dim())
    if len(parts) == 1:
        total = first.coalesce()
        return total.clone() if total is first else total  # (a coalesced tensor coalesces to itself)
    indices = torch.cat([p._indices() for p in parts], dim=1)
    values = torch.cat([p._values() for p in parts])
    return torch.sparse_coo_tensor(indices, values, first.shape, check_invariants=False).coalesce()


def _empty_table(size: Sequence[int], sparse_dim: int, dtype: torch.dtype, device: torch.device
                 ) -> tuple[Tensor, Tensor]:
    return (torch.zeros(size, dtype=dtype, device=device),
            torch.zeros(table_rows(size, sparse_dim), dtype=torch.int32, device=device))


def _add_into(table: Tensor, touched: Tensor, part: Tensor) -> None:
    """Adds sparse `part` into dense `table` and counts the rows it names in `touched` (flat)."""
    indices, values = part._indices(), part._values()
    if part.sparse_dim() == 1:
        table.index_add_(0, indices[0], values)
        flat = indices[0]
    else:
        table.index_put_(tuple(indices), values, accumulate=True)
        strides = torch.tensor(_row_strides(table.shape[:part.sparse_dim()]), device=indices.device)
        flat = (indices * strides[:, None]).sum(0)
    touched[flat] = 1


def _row_strides(sizes: Sequence[int]) -> list[int]:
    strides, step = [], 1
    for size in reversed(sizes):
        strides.append(step)
        step *= size
    return strides[::-1]


def from_table(table: Tensor, touched: Tensor, sparse_dim: int) -> Tensor:
    """The sparse tensor of `table`'s rows that `touched` marks (> 0), coalesced (nonzero() is sorted)."""
    flat = touched.nonzero().view(-1)
    if sparse_dim == 1:
        return torch.sparse_coo_tensor(flat.unsqueeze(0), table.index_select(0, flat), table.shape,
                                       is_coalesced=True, check_invariants=False)
    indices = torch.stack(torch.unravel_index(flat, table.shape[:sparse_dim]))
    return torch.sparse_coo_tensor(indices, table[tuple(indices)], table.shape, is_coalesced=True,
                                   check_invariants=False)


def sum_over_workers(workers: CollectiveAllReduce, mine: Sequence[Tensor | None], like: Sequence[Tensor],
                     dense: Sequence[bool], what: str) -> list[Tensor]:
    """Column j: every worker's `mine[j]` (sparse, dense, or None: nothing) summed, on `like[j]`'s device.
    Where `dense[j]` (some worker's gradient is dense: every worker says alike) the sum is dense; else it
    is sparse and coalesced, gathered or densified as `densify()` says of the sizes the workers send.
    Every worker calls it with the same columns (at least one worker has each sparse column)."""
    out: list[Tensor | None] = [None] * len(mine)
    dense_cols = [j for j, d in enumerate(dense) if d]
    if dense_cols:
        tables = [dense_of(mine[j], like[j]) for j in dense_cols]
        workers.all_sum_([t.view(-1) for t in tables], f"{what} (dense)")
        for j, t in zip(dense_cols, tables):
            out[j] = t
    sparse_cols = [j for j, d in enumerate(dense) if not d]
    if not sparse_cols:
        return out  # type: ignore[return-value]
    parts = {j: None if mine[j] is None else mine[j].coalesce() for j in sparse_cols}
    header = [n for j in sparse_cols
              for n in ((0, -1) if parts[j] is None else (parts[j]._nnz(), parts[j].sparse_dim()))]
    rows = workers.all_gather_row(header, f"{what} (sizes)")
    gathered, densified = [], []
    for c, j in enumerate(sparse_cols):
        counts = [row[2 * c] for row in rows]
        sparse_dim = max(row[2 * c + 1] for row in rows)
        many = len(rows) * max(counts)  # a padded all-gather moves every worker's share at the largest size
        chosen = densified if densify(many, table_rows(like[j].shape, sparse_dim), across_workers=True) else gathered
        chosen.append((j, counts, sparse_dim))
    if densified:
        _densified_over_workers(workers, parts, like, densified, out, what)
    if gathered:
        _gathered_over_workers(workers, parts, like, gathered, out, what)
    return out  # type: ignore[return-value]


def dense_of(part: Tensor | None, like: Tensor) -> Tensor:
    """A contiguous dense tensor of `part`'s values that the caller may reduce in place (a new one, or
    `part` itself where it is a dense gradient: reduced in place, as the reducer reduces .grad)."""
    if part is None:
        return torch.zeros_like(like, memory_format=torch.contiguous_format)
    return part.to_dense() if part.is_sparse else part.contiguous()


def _densified_over_workers(workers: CollectiveAllReduce, parts: dict[int, Tensor | None], like: Sequence[Tensor],
                            columns: list[tuple[int, list[int], int]], out: list[Tensor | None], what: str) -> None:
    flats, tables = [], []
    for j, _, sparse_dim in columns:
        table, touched = _empty_table(like[j].shape, sparse_dim, like[j].dtype, like[j].device)
        if parts[j] is not None:
            _add_into(table, touched, parts[j])
        tables.append((j, table, touched, sparse_dim))
        flats += [table.view(-1), touched]
    workers.all_sum_(flats, f"{what} (densified)")
    for j, table, touched, sparse_dim in tables:
        out[j] = from_table(table, touched, sparse_dim)


def _gathered_over_workers(workers: CollectiveAllReduce, parts: dict[int, Tensor | None], like: Sequence[Tensor],
                           columns: list[tuple[int, list[int], int]], out: list[Tensor | None], what: str) -> None:
    """Every worker's indices and values, each padded to the most any worker has, in one all-gather for
    the indices of every column and one per dtype of values; then every worker coalesces the same rows in
    rank order, so all get the same bits."""
    device = like[columns[0][0]].device
    index_parts: list[Tensor] = []
    value_parts: dict[torch.dtype, list[Tensor]] = {}
    for j, counts, sparse_dim in columns:
        most = max(counts)
        size = like[j].shape
        indices = torch.zeros(sparse_dim, most, dtype=torch.int64, device=device)
        values = torch.zeros((most, *size[sparse_dim:]), dtype=like[j].dtype, device=device)
        if parts[j] is not None:
            n = parts[j]._nnz()
            indices[:, :n] = parts[j]._indices()
            values[:n] = parts[j]._values()
        index_parts.append(indices.view(-1))
        value_parts.setdefault(values.dtype, []).append(values.view(-1))
    dtypes = list(value_parts)
    flats = [torch.cat(index_parts)] + [torch.cat(value_parts[d]) for d in dtypes]
    everyone = workers.all_gather_flat(flats, f"{what} (gathered)")
    index_at, value_at = 0, dict.fromkeys(dtypes, 0)
    for j, counts, sparse_dim in columns:
        most = max(counts)
        size = like[j].shape
        dtype = like[j].dtype
        width = math.prod(size[sparse_dim:])
        indices = [everyone[0][w][index_at:index_at + sparse_dim * most].view(sparse_dim, most)[:, :n]
                   for w, n in enumerate(counts)]
        k = 1 + dtypes.index(dtype)
        values = [everyone[k][w][value_at[dtype]:value_at[dtype] + most * width].view(most, *size[sparse_dim:])[:n]
                  for w, n in enumerate(counts)]
        index_at += sparse_dim * most
        value_at[dtype] += most * width
        total = torch.sparse_coo_tensor(torch.cat(indices, dim=1), torch.cat(values), size,
                                        check_invariants=False).coalesce()
        out[j] = total.to(like[j].device)
