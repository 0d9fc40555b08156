"""How the workers of a multi-worker strategy divide a dataset given to experimental_distribute_dataset.

shard_policy() resolves the dataset's AutoShardPolicy as TF does (DATA, FILE, AUTO, OFF; HINT refused);
share_drawn_seeds() gives the shuffles that drew their own seed the chief's (one broadcast); and
compare_first_batches() compares a digest of each pass's first global batch across workers under DATA,
where every worker must read the same batches. input.py calls them. Uses data/ (its file sources and
seeds) and the strategy's gather_over_workers / chief_ints.
"""
from __future__ import annotations

import hashlib
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch import Tensor

from mirrored.data import Dataset, auto_shard
from mirrored.data.options import AutoShardPolicy
from mirrored.distribute.values import flatten

if TYPE_CHECKING:
    from mirrored.distribute.strategy import Strategy


def shard_policy(strategy: Strategy, dataset: Any) -> str:
    """The AutoShardPolicy this worker follows, as TF resolves it: "DATA", "FILE", "HINT" or "OFF".

    AUTO is FILE where the dataset reads files (list_files, TFRecordDataset, tfds.load's shards) and
    each source has at least one per worker, DATA otherwise; FILE with fewer files than workers, or with
    no files at all, is an error as in TF. HINT fills the pipeline's shard(SHARD_HINT, SHARD_HINT)
    placeholders with (workers, rank); without one it is an error (every worker would read everything).
    On one worker every policy reads everything once, as in TF."""
    workers = strategy.num_workers
    options = getattr(dataset, "options", None)
    policy = getattr(getattr(options(), "experimental_distribute", None), "auto_shard_policy", None) \
        if callable(options) else None
    policy = AutoShardPolicy.AUTO if policy is None else policy
    if workers == 1 or not isinstance(dataset, Dataset):
        return "DATA"  # a DataLoader or list: every worker reads it and keeps its part
    if policy is AutoShardPolicy.HINT:
        if not auto_shard.hint_shards(dataset):
            raise ValueError(f"experimental_distribute_dataset: AutoShardPolicy.HINT shards where the pipeline calls "
                             f"shard(SHARD_HINT, SHARD_HINT), but {dataset!r} has no such call, so each of the "
                             f"{workers} workers would read all of it. Add "
                             "ds.shard(mr.data.experimental.SHARD_HINT, mr.data.experimental.SHARD_HINT) where each "
                             "worker's part should be taken, or use FILE, DATA or AUTO.")
        return "HINT"
    if policy in (AutoShardPolicy.OFF, AutoShardPolicy.DATA):
        return policy.name
    sources = auto_shard.file_sources(dataset)
    enough = bool(sources) and all(len(s.items) >= workers for s in sources)
    if policy is AutoShardPolicy.AUTO:
        return "FILE" if enough else "DATA"
    if not sources:
        raise ValueError(f"experimental_distribute_dataset: AutoShardPolicy.FILE needs a dataset that reads files "
                         f"(Dataset.list_files, TFRecordDataset, tfds.load), but {dataset!r} reads none: found an "
                         "unshardable source dataset. Use AutoShardPolicy.DATA (or AUTO) for it.")
    if not enough:
        raise ValueError(f"experimental_distribute_dataset: AutoShardPolicy.FILE gives each worker whole files, but "
                         f"the dataset reads {auto_shard.describe_files(sources)} for {workers} workers, not enough "
                         f"for the required {workers} shards/workers. Write at least {workers} files, or use "
                         "AutoShardPolicy.DATA (or AUTO, which picks DATA here).")
    return "FILE"


def share_drawn_seeds(strategy: Strategy, dataset: Dataset) -> None:
    """Gives the dataset's unseeded shuffles the chief's seeds, so every worker reads one order whatever
    each process seeded (a broadcast; every worker distributes the same pipeline)."""
    mine = auto_shard.drawn_seeds(dataset)
    counts = strategy.gather_over_workers([len(mine)], "distributed input (shuffle seeds)")
    if len({row[0] for row in counts}) > 1:
        raise ValueError("experimental_distribute_dataset: the workers' pipelines have different numbers of "
                         f"unseeded shuffles ({', '.join(f'worker {w}: {row[0]}' for w, row in enumerate(counts))}); "
                         "every worker must build the same pipeline.")
    if mine:
        auto_shard.set_drawn_seeds(dataset, strategy.chief_ints(mine, "distributed input (shuffle seeds)"))


_DIGEST_SAMPLES = 4096  # values per leaf hashed when a leaf is large: cheap, and any reordering shows


def batch_digest(batch: Any) -> int:
    """A 56-bit digest of a batch's structure and contents: the shapes and dtypes of every leaf, and the
    values of the label-like leaves (integer, bool or string ones) where there are any - a random
    augmentation of float inputs with each worker's own generator is not a different batch - else of
    every leaf (evenly spaced samples of large ones)."""
    leaves = flatten(batch)
    labels = [x for x in leaves if (isinstance(x, (Tensor, np.ndarray)) and str(x.dtype).split(".")[-1] in
                                    ("int64", "int32", "int16", "bool"))
              or (isinstance(x, (list, tuple)) and x and isinstance(x[0], (str, bytes)))]
    h = hashlib.blake2b(digest_size=7)
    for x in leaves:
        h.update(repr((type(x).__name__, tuple(getattr(x, "shape", ())), str(getattr(x, "dtype", "")))).encode())
    for x in labels or leaves:
        if isinstance(x, np.ndarray):
            x = torch.from_numpy(np.ascontiguousarray(x))
        if isinstance(x, Tensor):
            flat = x.detach().reshape(-1)
            if flat.numel() > _DIGEST_SAMPLES:
                flat = flat[torch.linspace(0, flat.numel() - 1, _DIGEST_SAMPLES, device=flat.device).long()]
            h.update(flat.cpu().contiguous().view(torch.uint8).numpy().tobytes() if flat.numel() else b"")
        elif isinstance(x, (list, tuple)):
            h.update(repr(list(x)).encode())
        else:
            h.update(repr(x).encode())
    return int.from_bytes(h.digest(), "little")


def compare_first_batches(strategy: Strategy, batch: Any) -> None:
    """Raises, on every worker, where the workers' first global batches of a pass differ (DATA sharding
    needs the same batches everywhere; otherwise examples are trained on twice or never)."""
    row = [0, 0] if batch is None else [1, batch_digest(batch)]
    table = strategy.gather_over_workers(row, "distributed input (first batch digest)")
    groups: dict[tuple[int, ...], list[int]] = {}
    for w, r in enumerate(table):
        groups.setdefault(tuple(r), []).append(w)
    if len(groups) == 1:
        return
    described = "; ".join(f"worker(s) {', '.join(map(str, ws))}: "
                          + ("no batch" if not key[0] else f"digest {key[1]:x}") for key, ws in groups.items())
    raise ValueError(
        f"experimental_distribute_dataset: the workers read different first batches ({described}). With DATA "
        "sharding every worker must read the same global batches and keeps its replicas' part of each, so "
        "differing batches train some examples twice and others never. Seed every shuffle alike on every "
        "worker (an mr.data shuffle with seed=None is shared from the chief; a DataLoader's shuffle or a "
        "generator's order is not), or give each worker its own files (AutoShardPolicy.FILE) or its own "
        "pipeline (strategy.distribute_datasets_from_function).")
