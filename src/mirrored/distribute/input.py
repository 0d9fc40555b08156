"""Distributed input: global batches in, per-replica parts on each replica's device out.

`DistributedDataset` wraps any re-iterable of GLOBAL batches (an `mr.data.Dataset`, a list, a
DataLoader): each batch is split along dim 0 by tf.distribute 2.21's rule, where replicas in order
take ceil(B/N) examples until the batch runs out (10 over 3 -> 4, 4, 2; 1 over 2 -> 1, 0; empty
parts are legal), and each part is moved to its replica's device one batch ahead of use (pinned
memory and non-blocking copies on CUDA). On a worker of a multi-worker strategy every worker reads
the same global batches and keeps only its own replicas' parts. `distribute_datasets_from_function`
calls the user's function with an `InputContext` (one input pipeline per worker) and gives replicas
successive per-replica batches. Uses values.py and devices.py.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch import Tensor

from mirrored.distribute.devices import torch_device
from mirrored.distribute.values import PerReplica, flatten, map_structure, pack_sequence_as

if TYPE_CHECKING:
    from mirrored.distribute.strategy import Strategy


@dataclasses.dataclass
class InputOptions:
    """tf.distribute.InputOptions: whether batches are copied to the replicas' devices ahead of use."""

    experimental_fetch_to_device: bool = True
    experimental_per_replica_buffer_size: int = 1


class InputContext:
    """What an input function learns about the input pipelines and replicas (tf.distribute.InputContext)."""

    def __init__(self, num_input_pipelines: int = 1, input_pipeline_id: int = 0, num_replicas_in_sync: int = 1):
        self.num_input_pipelines = num_input_pipelines
        self.input_pipeline_id = input_pipeline_id
        self.num_replicas_in_sync = num_replicas_in_sync

    def get_per_replica_batch_size(self, global_batch_size: int) -> int:
        """global_batch_size // num_replicas_in_sync; it must divide evenly."""
        if global_batch_size % self.num_replicas_in_sync:
            raise ValueError(
                f"InputContext.get_per_replica_batch_size: the global batch size {global_batch_size} is not "
                f"divisible by num_replicas_in_sync ({self.num_replicas_in_sync}). Use a multiple, e.g. "
                f"{-(-global_batch_size // self.num_replicas_in_sync) * self.num_replicas_in_sync}.")
        return global_batch_size // self.num_replicas_in_sync

    def __repr__(self) -> str:
        return (f"InputContext(num_input_pipelines={self.num_input_pipelines}, input_pipeline_id="
                f"{self.input_pipeline_id}, num_replicas_in_sync={self.num_replicas_in_sync})")


def split_sizes(batch_size: int, num_replicas: int) -> list[int]:
    """Per-replica sizes of a global batch: each replica in order takes ceil(B/N) until none are left."""
    per = -(-batch_size // num_replicas)
    return [max(0, min(per, batch_size - i * per)) for i in range(num_replicas)]


def batch_size_of(batch: Any, where: str) -> int:
    """The common dim-0 length of every leaf of a batch; a clear error when they differ or are scalars."""
    sizes = {}
    for i, leaf in enumerate(flatten(batch)):
        if isinstance(leaf, (Tensor, np.ndarray)):
            if leaf.ndim == 0:
                raise ValueError(
                    f"{where}: element leaf {i} is a scalar, so the dataset is not batched. Batch it by the "
                    "GLOBAL batch size first: ds.batch(per_replica_batch * strategy.num_replicas_in_sync).")
            sizes[i] = leaf.shape[0]
        elif isinstance(leaf, (list, tuple)):
            sizes[i] = len(leaf)
    if not sizes:
        raise ValueError(f"{where}: the batch holds no tensors to split: {type(batch).__name__}.")
    if len(set(sizes.values())) > 1:
        raise ValueError(f"{where}: the leaves of one batch have different batch sizes {sizes} (leaf index: "
                         "size); every tensor in a batch must have the same first dimension.")
    return next(iter(sizes.values()))


def _part(leaf: Any, lo: int, hi: int) -> Any:
    if isinstance(leaf, np.ndarray):
        leaf = torch.from_numpy(leaf)
    if isinstance(leaf, Tensor):
        return leaf[lo:hi]
    if isinstance(leaf, (list, tuple)):
        return leaf[lo:hi]
    return leaf


def _empty_part(leaf: Any, replica: int) -> Any:
    """An empty batch shaped like `leaf`, for a replica the data ran out for; an unbatched (scalar)
    leaf has no empty form, and repeating it would feed that replica a duplicate example."""
    if (isinstance(leaf, (Tensor, np.ndarray)) and leaf.ndim == 0) or isinstance(leaf, (bool, int, float, complex)):
        raise ValueError(
            f"distribute_datasets_from_function: the dataset ran out in the middle of a step, so replica {replica} "
            f"gets an empty batch, but its elements are scalars ({type(leaf).__name__}), which have no empty form. "
            "Batch the dataset by the per-replica size: "
            "ds.batch(input_context.get_per_replica_batch_size(GLOBAL_BATCH_SIZE)).")
    return _part(leaf, 0, 0)


def _to_device(value: Any, device: torch.device, non_blocking: bool) -> Any:
    if not isinstance(value, Tensor) or value.device == device:
        return value
    if device.type == "cuda" and value.device.type == "cpu" and non_blocking:
        value = value.pin_memory()
    return value.to(device, non_blocking=non_blocking)


class _Splitter:
    """Turns global batches into per-replica parts placed on the replicas' devices."""

    def __init__(self, strategy: Strategy, options: InputOptions | None):
        self._devices = [torch_device(d) for d in strategy.extended.worker_devices]
        self._n = strategy.num_replicas_in_sync  # the split is over every worker's replicas...
        self._first = strategy._first_replica_id  # ...and this process keeps its own replicas' parts
        self._fetch = (options or InputOptions()).experimental_fetch_to_device

    def place(self, value: Any, replica: int) -> Any:
        if not self._fetch:
            return value
        device = self._devices[replica]
        return map_structure(lambda leaf: _to_device(leaf, device, True), value)

    def split(self, batch: Any, where: str) -> tuple[Any, int]:
        """(the distributed batch, its global size)."""
        size = batch_size_of(batch, where)
        if self._n == 1:
            return self.place(batch, 0), size
        bounds, lo = [], 0
        for n in split_sizes(size, self._n):
            bounds.append((lo, lo + n))
            lo += n
        mine = bounds[self._first:self._first + len(self._devices)]
        leaves = flatten(batch)
        per_replica = [[self.place(_part(leaf, a, b), r) for leaf in leaves] for r, (a, b) in enumerate(mine)]
        if len(mine) == 1:  # one replica in this process (a multi-worker strategy): plain values, as in TF
            return pack_sequence_as(batch, per_replica[0]), size
        columns = [PerReplica([per_replica[r][j] for r in range(len(mine))]) for j in range(len(leaves))]
        return pack_sequence_as(batch, columns), size


class DistributedIterator:
    """Yields distributed global batches; the next one is split and sent to the devices ahead of use."""

    def __init__(self, strategy: Strategy, source: Iterator[Any], options: InputOptions | None):
        self._splitter = _Splitter(strategy, options)
        self._n = strategy.num_replicas_in_sync
        self._source = source
        self._step = 0
        self._ahead: list[Any] = []
        # The size of the global batch the last next() split: the same on every worker, where the
        # parts a worker holds say only how many rows its own replicas got.
        self.global_batch_size: int | None = None

    def __iter__(self) -> DistributedIterator:
        return self

    def _fetch(self) -> Any | None:
        batch = next(self._source, _END)
        if batch is _END:
            return None
        return self._splitter.split(batch, "experimental_distribute_dataset")

    def __next__(self) -> Any:
        if not self._ahead:
            first = self._fetch()
            if first is None:
                raise StopIteration
            self._ahead.append(first)
        current, size = self._ahead.pop(0)
        following = self._fetch()  # split and copy the next batch now, so it is on the devices in time
        if following is not None:
            self._ahead.append(following)
        if self._step == 0 and size < self._n and following is not None:
            raise ValueError(
                f"experimental_distribute_dataset: the dataset is batched by {size} but num_replicas_in_sync is "
                f"{self._n}, so replica {self._n - 1} would get no examples. Batch by the GLOBAL size, e.g. "
                f"ds.batch({max(size, 1)} * strategy.num_replicas_in_sync). (A short final batch of an epoch "
                "is fine.)")
        self._step += 1
        self.global_batch_size = size
        return current

    def get_next(self) -> Any:
        return next(self)

    # ---- resuming (mr.train.Checkpoint, Model.fit's BackupAndRestore) --------------------------------
    def get_state(self) -> dict[str, Any]:
        """Where this iterator is, as JSON: the dataset's get_state() from before this pass began (None for
        a dataset without one) and the batches handed out since. Take it between steps."""
        _, pass_state = getattr(self, "_resume", (None, None))
        return {"dataset": pass_state, "drawn": self._step}

    def set_state(self, state: dict[str, Any]) -> None:
        """Continues where get_state() was taken, on an iterator of the same dataset (in another process
        too): restores the dataset's state, starts the pass again and reads past the batches already
        handed out. A dataset without get_state()/set_state() is re-read from its start."""
        if getattr(self, "_resume", None) is None:
            raise TypeError("DistributedIterator.set_state: only an iterator of strategy.experimental_distribute_"
                            "dataset(...) can be restored.")
        if not isinstance(state, dict) or not isinstance(state.get("drawn"), int) or state["drawn"] < 0:
            raise ValueError(f"DistributedIterator.set_state: expected the dict get_state() returned, got "
                             f"{state!r:.200}.")
        dataset, _ = self._resume
        if state.get("dataset") is not None:
            if not hasattr(dataset, "set_state"):
                raise ValueError(f"DistributedIterator.set_state: the state holds a dataset state, but this "
                                 f"iterator's dataset ({type(dataset).__name__}) has no set_state(); restore into an "
                                 "iterator of the same dataset.")
            dataset.set_state(state["dataset"])
        close = getattr(self._source, "close", None)
        if close is not None:
            close()
        self._resume = (dataset, state.get("dataset"))
        self._source, self._ahead = iter(dataset), []
        for i in range(state["drawn"]):
            if next(self._source, _END) is _END:
                raise ValueError(f"DistributedIterator.set_state: the state is {state['drawn']} batches into the "
                                 f"pass, but the dataset ran out after {i}; restore into an iterator of the same "
                                 "dataset.")
        self._step = state["drawn"]


_END = object()


class DistributedDataset:
    """What `strategy.experimental_distribute_dataset` returns: iterate it once per epoch."""

    def __init__(self, strategy: Strategy, dataset: Iterable[Any], options: InputOptions | None = None):
        if not isinstance(dataset, Iterable):
            raise TypeError(f"experimental_distribute_dataset: expected a dataset of GLOBAL batches (an "
                            f"mr.data.Dataset or any re-iterable); got {type(dataset).__name__}.")
        if isinstance(dataset, Iterator):
            raise TypeError("experimental_distribute_dataset: got an iterator, which can be read only once. "
                            "Pass the dataset itself so each epoch can iterate it again.")
        self._strategy = strategy
        self._dataset = dataset
        self._options = options

    def __iter__(self) -> DistributedIterator:
        # The dataset's state before iter() starts a pass is where DistributedIterator.get_state() resumes.
        pass_state = self._dataset.get_state() if hasattr(self._dataset, "get_state") else None
        it = DistributedIterator(self._strategy, iter(self._dataset), self._options)
        it._resume = (self._dataset, pass_state)
        return it

    def __len__(self) -> int:
        return len(self._dataset)  # type: ignore[arg-type]

    @property
    def dataset(self) -> Iterable[Any]:
        return self._dataset


class DistributedDatasetsFromFunction:
    """Replica i of each step gets the next per-replica batch of the function's dataset, in turn."""

    def __init__(self, strategy: Strategy, dataset_fn: Callable[[InputContext], Iterable[Any]],
                 options: InputOptions | None = None):
        if not callable(dataset_fn):
            raise TypeError(f"distribute_datasets_from_function({dataset_fn!r}): pass a function "
                            "InputContext -> dataset of per-replica batches.")
        self._strategy = strategy
        local = len(strategy.extended.worker_devices)  # one input pipeline per worker process
        ctx = InputContext(strategy.num_replicas_in_sync // local, strategy._first_replica_id // local,
                           strategy.num_replicas_in_sync)
        self._dataset = dataset_fn(ctx)
        if self._dataset is None or not isinstance(self._dataset, Iterable):
            raise TypeError(f"distribute_datasets_from_function: the function returned "
                            f"{type(self._dataset).__name__}, not a dataset.")
        self._splitter = _Splitter(strategy, options)

    def __iter__(self) -> Iterator[Any]:
        n = len(self._strategy.extended.worker_devices)  # this process's replicas
        source = iter(self._dataset)
        template = None
        while True:
            parts = []
            for _ in range(n):
                item = next(source, _END)
                if item is _END:
                    break
                parts.append(item)
            template = parts[0] if parts else template
            # Workers' datasets may run out at different steps: every worker goes on while any has data
            # (an all-reduce of the counts, as TF's get_next_as_optional), so none waits alone in a step.
            if self._strategy._sum_over_workers(len(parts)) == 0:
                return
            if template is None:
                raise ValueError(
                    "distribute_datasets_from_function: this worker's dataset is empty while other workers' "
                    f"still yield batches ({self._strategy!r}). Give every input pipeline data, e.g. shard "
                    "with ds.shard(input_context.num_input_pipelines, input_context.input_pipeline_id).")
            while len(parts) < n:  # the data ran out mid-step: the remaining replicas get empty batches
                parts.append(map_structure(lambda leaf: _empty_part(leaf, len(parts)), template))
            placed = [self._splitter.place(p, r) for r, p in enumerate(parts)]
            if n == 1:
                yield placed[0]
            else:
                leaves = [flatten(p) for p in placed]
                yield pack_sequence_as(placed[0], [PerReplica(col) for col in zip(*leaves)])
