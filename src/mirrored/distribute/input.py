"""Distributed input: global batches in, per-replica parts on each replica's device out.

`DistributedDataset` wraps any iterable of GLOBAL batches (an `mr.data.Dataset`, a DataLoader, a
list, an object whose __iter__ returns a generator): each batch is split along dim 0 by
tf.distribute 2.21's rule, where replicas in order take ceil(B/N) examples until the batch runs out
(10 over 3 -> 4, 4, 2; 1 over 2 -> 1, 0; empty parts are legal), and each part is moved to its
replica's device one batch ahead of use (host to GPU from pinned memory without waiting; every
other copy completes before it is handed over). On a worker of a multi-worker strategy the dataset's
AutoShardPolicy decides what each worker reads, as in TF: DATA (and AUTO without enough files) reads
the same global batches everywhere and keeps this worker's replicas' parts - the chief's shuffle seeds
are shared first, and a digest of the first batch of each pass is compared across workers, so two
workers that read different batches are an error, not data trained twice; FILE (and AUTO with at least
one file per worker) gives each worker whole files of its own and takes this worker's share of every
batch it reads from them; HINT does so with the part its shard(SHARD_HINT, SHARD_HINT) placeholders
take; OFF gives every worker all the data the same way.
`distribute_datasets_from_function` calls the user's function with an `InputContext` (one input
pipeline per worker) and gives replicas successive per-replica batches. Iterators hand out distributed
batches with next() / get_next(), or get_next_as_optional(). Uses values.py, devices.py,
_input_workers.py and data/.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch import Tensor

from mirrored.data import INFINITE_CARDINALITY, UNKNOWN_CARDINALITY, Dataset, TensorSpec, auto_shard
from mirrored.distribute._input_workers import compare_first_batches, shard_policy, share_drawn_seeds
from mirrored.distribute.devices import torch_device
from mirrored.distribute.values import PerReplica, flatten, map_structure, pack_sequence_as

if TYPE_CHECKING:
    from mirrored.distribute.strategy import Strategy


@dataclasses.dataclass
class InputOptions:
    """tf.distribute.InputOptions: whether batches are copied to the replicas' devices ahead of use.
    memory_format (ours, not TF's): "channels_last" stores 4-D (5-D) batch tensors channels_last(_3d)
    in that copy, for a module whose convolutions run so (no extra pass: where no copy is made, the
    first convolution converts, as it would anyway); "preserve" copies as given."""

    experimental_fetch_to_device: bool = True
    experimental_per_replica_buffer_size: int = 1
    memory_format: str = "preserve"


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


_CHANNELS_LAST = {4: torch.channels_last, 5: torch.channels_last_3d}


def _to_device(value: Any, device: torch.device, channels_last: bool = False) -> Any:
    if not isinstance(value, Tensor) or value.device == device:
        return value
    # The copy to the device writes the layout the convolutions read: one pass, not two.
    memory_format = _CHANNELS_LAST.get(value.dim(), torch.preserve_format) if channels_last else torch.preserve_format
    if _copies_async(value.device, device):
        if not value.is_pinned():  # (a DataLoader with pin_memory=True gives pinned batches already)
            value = value.pin_memory()
        return value.to(device, non_blocking=True, memory_format=memory_format)
    return value.to(device, memory_format=memory_format)


def _copies_async(source: torch.device, target: torch.device) -> bool:
    """Whether a batch may travel from `source` to `target` without waiting for the copy. Only host to
    GPU, from pinned memory: the copy is queued on the GPU's stream, before whatever the replica then
    runs there, and torch keeps the pinned buffer until it is done. A copy to the host must finish
    before the call returns: the replica may read the tensor on the CPU at once, and nothing would wait
    for the GPU first. GPU to GPU waits too: it costs little, and the order is plain."""
    return source.type == "cpu" and target.type == "cuda"


class _Splitter:
    """Turns global batches into per-replica parts placed on the replicas' devices."""

    def __init__(self, strategy: Strategy, options: InputOptions | None):
        self._devices = [torch_device(d) for d in strategy.extended.worker_devices]
        self._n = strategy.num_replicas_in_sync  # the split is over every worker's replicas...
        self._first = strategy.first_replica_id  # ...and this process keeps its own replicas' parts
        options = options or InputOptions()
        self._fetch = options.experimental_fetch_to_device
        if options.memory_format not in ("preserve", "channels_last"):
            raise ValueError(f"InputOptions(memory_format={options.memory_format!r}): use \"preserve\" (copy "
                             "batches as given) or \"channels_last\" (4-D and 5-D tensors channels_last in the copy).")
        self._channels_last = options.memory_format == "channels_last"

    def place(self, value: Any, replica: int) -> Any:
        if not self._fetch:
            return value
        device, channels_last = self._devices[replica], self._channels_last
        return map_structure(lambda leaf: _to_device(leaf, device, channels_last), value)

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

    def pack(self, parts: list[Any]) -> Any:
        """This process's replicas' parts (one each, in order) as one distributed batch."""
        placed = [self.place(p, r) for r, p in enumerate(parts)]
        if len(placed) == 1:
            return placed[0]
        leaves = [flatten(p) for p in placed]
        return pack_sequence_as(placed[0], [PerReplica(list(col)) for col in zip(*leaves)])


def split_global_batch(strategy: Strategy, batch: Any, options: InputOptions | None = None,
                       compare_workers: bool = False) -> tuple[list[Any], list[int], int]:
    """One GLOBAL batch split as experimental_distribute_dataset splits each of its batches, for a loop
    that draws its own batches (Keras's own fit): this process's replicas' parts, each on its replica's
    device and in the batch's own containers (a list stays a list), their row counts, and the global
    size. With compare_workers (a loop's first batch, on a multi-worker strategy) the workers compare
    digests of the batch first: every worker must draw the same global batches.

    Returns:
      A tuple (parts, rows, global_batch_size), with one part and one row count per local replica, in
      replica order.
    """
    where = "split_global_batch"
    if compare_workers and strategy.num_workers > 1:
        compare_first_batches(strategy, batch)
    size = batch_size_of(batch, where)
    splitter = _Splitter(strategy, options)
    sizes = split_sizes(size, strategy.num_replicas_in_sync)
    starts = [sum(sizes[:i]) for i in range(len(sizes))]
    local = range(strategy.first_replica_id, strategy.first_replica_id + len(splitter._devices))
    leaves = flatten(batch)
    parts = [splitter.place(pack_sequence_as(batch, [_part(leaf, starts[i], starts[i] + sizes[i]) for leaf in leaves]),
                            r) for r, i in enumerate(local)]
    return parts, [sizes[i] for i in local], size


class _GetNext:
    """tf.distribute.DistributedIterator's two reading methods, over the iterator's own __next__: shared
    by DistributedIterator and the iterator of distribute_datasets_from_function, as TF gives both kinds
    of distributed dataset one iterator interface."""

    __slots__ = ()

    def get_next(self) -> Any:
        """The next distributed batch; StopIteration at the end (TF raises OutOfRangeError)."""
        return next(self)

    def get_next_as_optional(self) -> Optional:
        """The next distributed batch as an Optional, empty after the last one, so a loop can end
        without catching StopIteration (tf.distribute.DistributedIterator.get_next_as_optional)."""
        batch = next(self, _END)
        return Optional.empty() if batch is _END else Optional.from_value(batch)


class DistributedIterator(_GetNext):
    """What iterating a DistributedDataset gives (tf.distribute.DistributedIterator): distributed global
    batches, by next(), `get_next()` or `get_next_as_optional()`; the next batch is split and sent to
    the devices ahead of use. `global_batch_size` is the size of the global batch last handed out (the
    same on every worker). The iterator of distribute_datasets_from_function has get_next() and
    get_next_as_optional() too, but not get_state()/set_state()."""

    def __init__(self, strategy: Strategy, source: Iterator[Any], options: InputOptions | None,
                 policy: str = "DATA"):
        self._strategy = strategy
        self._splitter = _Splitter(strategy, options)
        self._n = strategy.num_replicas_in_sync
        self._source = source
        self._step = 0
        self._examples = 0  # the examples of the global batches handed out this pass: the position to resume at
        self._ahead: list[Any] = []
        self._policy = policy  # "DATA": the same global batches on every worker; "FILE"/"HINT"/"OFF": its own
        self._compared = False  # DATA on several workers: the first batch's digest is compared once a pass
        self._parts: list[Any] = []  # FILE/OFF: replicas' parts of this worker's batches, not yet handed out
        self._template: Any = None
        #: The size of the global batch the last next() split (None before the first): the same on every
        #: worker, where the parts a worker holds say only how many rows its own replicas got.
        self.global_batch_size: int | None = None

    def __iter__(self) -> DistributedIterator:
        return self

    def _fetch(self) -> Any | None:
        if self._policy != "DATA":
            return self._fetch_own()
        batch = next(self._source, _END)
        if not self._compared and self._strategy.num_workers > 1:
            self._compared = True
            compare_first_batches(self._strategy, None if batch is _END else batch)
        if batch is _END:
            return None
        return self._splitter.split(batch, "experimental_distribute_dataset")

    def _fetch_own(self) -> Any | None:
        """FILE / HINT / OFF: each batch this worker reads is cut into num_replicas_in_sync parts (TF's rebatch)
        and its replicas take the next parts each step, so a step's global batch is every worker's share
        and each worker reads only its own data. Workers whose data ran out take empty parts while any
        other still has some (a count per step, as TF's get_next_as_optional); (None when all are done)."""
        where = "experimental_distribute_dataset"
        local = len(self._splitter._devices)
        while True:
            parts = []
            while len(parts) < local:
                if not self._parts:
                    batch = next(self._source, _END)
                    if batch is _END:
                        break
                    self._template, leaves, lo = batch, flatten(batch), 0
                    for rows in split_sizes(batch_size_of(batch, where), self._n):
                        self._parts.append(pack_sequence_as(batch, [_part(leaf, lo, lo + rows) for leaf in leaves]))
                        lo += rows
                parts.append(self._parts.pop(0))
            rows = sum(batch_size_of(p, where) for p in parts)
            table = self._strategy.gather_over_workers([len(parts), rows], "distributed input (parts left)")
            if sum(row[0] for row in table) == 0:
                return None
            if self._template is None:
                empty = [r for r, row in enumerate(table) if row[0] == 0]
                raise ValueError(
                    f"experimental_distribute_dataset: worker(s) {', '.join(map(str, empty))} read no batches while "
                    f"other workers still do ({self._policy} auto-sharding: each worker reads its own data). Give "
                    "every worker data: at least one file per worker for FILE.")
            while len(parts) < local:  # this worker's data ran out mid-step: empty parts for its other replicas
                parts.append(pack_sequence_as(self._template, [_empty_part(leaf, len(parts))
                                                               for leaf in flatten(self._template)]))
            size = sum(row[1] for row in table)
            if size:  # (a step where every worker's part is empty trains nothing: skipped)
                return self._splitter.pack(parts), size

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
        if self._examples == 0 and size < self._n and following is not None:
            raise ValueError(
                f"experimental_distribute_dataset: the dataset is batched by {size} but num_replicas_in_sync is "
                f"{self._n}, so replica {self._n - 1} would get no examples. Batch by the GLOBAL size, e.g. "
                f"ds.batch({max(size, 1)} * strategy.num_replicas_in_sync). (A short final batch of an epoch "
                "is fine.)")
        self._step += 1
        self._examples += size
        self.global_batch_size = size
        return current

    # ---- resuming (mr.train.Checkpoint, Model.fit's BackupAndRestore) --------------------------------
    def get_state(self) -> dict[str, Any]:
        """Where this iterator is, as JSON: the dataset's get_state() from before this pass began (None for
        a dataset without one), the global batches handed out since ("drawn") and the examples in them
        ("examples"). Take it between steps."""
        _, pass_state = getattr(self, "_resume", (None, None))
        return {"dataset": pass_state, "drawn": self._step, "examples": self._examples}

    def set_state(self, state: dict[str, Any]) -> None:
        """Continues where get_state() was taken, on an iterator of the same dataset (in another process
        too, on another number of replicas or workers): restores the dataset's state, starts the pass again
        and reads past the examples already handed out. The position is counted in examples, so it is exact
        when the global batch changed (a script that batches by per-replica size x replicas, resumed on
        another count): the rest of the batch it falls in is the next batch, then whole batches follow.
        (Where each worker reads its own data - FILE, HINT or OFF sharding - it reads past as many batches.)
        A dataset without get_state()/set_state() is re-read from its start."""
        if getattr(self, "_resume", None) is None:
            raise TypeError("DistributedIterator.set_state: only an iterator of strategy.experimental_distribute_"
                            "dataset(...) can be restored.")
        examples = state.get("examples") if isinstance(state, dict) else None
        if (not isinstance(state, dict) or not _is_count(state.get("drawn"))
                or not (examples is None or _is_count(examples))):
            raise ValueError(f"DistributedIterator.set_state: expected the dict get_state() returned, got "
                             f"{state!r:.200}.")
        dataset, _ = self._resume
        if isinstance(dataset, Iterator):
            raise ValueError(f"DistributedIterator.set_state: the dataset is a one-shot iterator "
                             f"({type(dataset).__name__}), which cannot be read again from its start; distribute "
                             "a dataset that can be iterated again (an mr.data.Dataset, a list) to restore it.")
        if state.get("dataset") is not None and not hasattr(dataset, "set_state"):
            raise ValueError(f"DistributedIterator.set_state: the state holds a dataset state, but this "
                             f"iterator's dataset ({type(dataset).__name__}) has no set_state(); restore into an "
                             "iterator of the same dataset.")
        # The pass running now ends first: its threads (a prefetch) stop and are joined. Closed after the
        # restore, a prefetch thread that had yet to start its shuffle's pass counted one pass more on top
        # of the restored count, and the restored pass shuffled as the next one.
        previous = self.get_state()
        close = getattr(self._source, "close", None)
        if close is not None:
            close()
        try:
            self._restore(dataset, state)
        except BaseException:  # a state the dataset refused: back on the pass it was on, then the error
            self._restore(dataset, previous)
            raise

    def _restore(self, dataset: Any, state: dict[str, Any]) -> None:
        """Opens the pass `state` was taken in and reads past the batches it had handed out."""
        if state.get("dataset") is not None:
            dataset.set_state(state["dataset"])
        self._resume = (dataset, state.get("dataset"))
        self._source, self._ahead, self._parts, self._template = iter(dataset), [], [], None
        self._compared = True  # (the batches the restored pass starts with need not be its first)
        if self._policy == "DATA" and state.get("examples") is not None:
            self._skip_examples(state["examples"])
            return
        for i in range(state["drawn"]):
            if (self._fetch() is None) if self._policy != "DATA" else (next(self._source, _END) is _END):
                raise ValueError(f"DistributedIterator.set_state: the state is {state['drawn']} batches into the "
                                 f"pass, but the dataset ran out after {i}; restore into an iterator of the same "
                                 "dataset.")
        self._step = state["drawn"]
        self._examples = state.get("examples") or 0

    def _skip_examples(self, examples: int) -> None:
        """Reads past `examples` examples of the pass: whole batches, then the head of the batch the position
        falls in, whose rest becomes the next batch handed out."""
        where, skipped, batches = "DistributedIterator.set_state", 0, 0
        while skipped < examples:
            batch = next(self._source, _END)
            if batch is _END:
                raise ValueError(f"{where}: the state is {examples} examples into the pass, but the dataset ran out "
                                 f"after {skipped}; restore into an iterator of the same dataset.")
            size = batch_size_of(batch, where)
            if skipped + size > examples:  # the position falls inside this batch: its rest comes next
                rest = pack_sequence_as(batch, [_part(leaf, examples - skipped, size) for leaf in flatten(batch)])
                self._ahead.append(self._splitter.split(rest, "experimental_distribute_dataset"))
                skipped = examples
                break
            skipped += size
            batches += 1
        self._step, self._examples = batches, examples


def _is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


class Optional:
    """A value that may be missing (tf.experimental.Optional): `has_value()`, then `get_value()`. What
    `get_next_as_optional()` of a distributed iterator returns."""

    __slots__ = ("_value", "_has_value")

    def __init__(self, value: Any, has_value: bool):
        self._value, self._has_value = value, has_value

    @classmethod
    def from_value(cls, value: Any) -> Optional:
        """An Optional holding `value` (tf.experimental.Optional.from_value)."""
        return cls(value, True)

    @classmethod
    def empty(cls) -> Optional:
        """An Optional holding nothing: has_value() is False (tf.experimental.Optional.empty)."""
        return cls(None, False)

    def has_value(self) -> bool:
        """Whether there is a value: for get_next_as_optional(), False once the batches ran out."""
        return self._has_value

    def get_value(self) -> Any:
        """The value; ValueError when the Optional is empty (check has_value() first)."""
        if not self._has_value:
            raise ValueError("Optional.get_value(): the optional is empty (the iterator has no more batches). "
                             "Check has_value() first.")
        return self._value

    def __repr__(self) -> str:
        return f"Optional(has_value={self._has_value})"


_END = object()


class _Passes:
    """Starts one pass over a source of batches per epoch. A one-shot source (an iterator, such as a
    generator object) gives one pass: a second would silently yield nothing, so it is an error."""

    def __init__(self, source: Iterable[Any], where: str):
        self.source = source
        self._where = where
        self._one_shot = isinstance(source, Iterator)
        self._started = 0

    def start(self) -> Iterator[Any]:
        if self._one_shot and self._started:
            raise ValueError(
                f"{self._where}: the dataset is a one-shot iterator ({type(self.source).__name__}), which was read "
                "in an earlier pass; a second pass would get no batches. Pass something that can be iterated "
                "again, once per epoch: the mr.data.Dataset, DataLoader or list itself (or a class whose "
                "__iter__ makes a new generator), not iter(...) of it or a generator object.")
        self._started += 1
        return iter(self.source)

    def cardinality(self) -> int:
        """The number of batches: the dataset's cardinality() or len(), else UNKNOWN_CARDINALITY (-2)."""
        count = getattr(self.source, "cardinality", None)
        if callable(count):
            return int(count())
        if self._one_shot:
            return UNKNOWN_CARDINALITY
        try:
            return len(self.source)  # type: ignore[arg-type]
        except TypeError:  # no __len__, or one that refuses (a DataLoader over an IterableDataset)
            return UNKNOWN_CARDINALITY


def _distributed_spec(strategy: Strategy, dataset: Any) -> Any:
    spec = getattr(dataset, "element_spec", None)
    if spec is None:
        raise TypeError(f"element_spec: the distributed dataset ({type(dataset).__name__}) does not describe its "
                        "elements; an mr.data.Dataset does (tf.data's element_spec).")
    local = len(strategy.extended.worker_devices)

    def part(leaf: Any) -> Any:
        if isinstance(leaf, TensorSpec) and leaf.shape:
            leaf = TensorSpec(shape=(None, *leaf.shape[1:]), dtype=leaf.dtype)
        return leaf if local == 1 else PerReplica([leaf] * local)

    return map_structure(part, spec)


class DistributedDataset:
    """What `strategy.experimental_distribute_dataset` returns (tf.distribute.DistributedDataset):
    iterate it once per epoch; each pass is a DistributedIterator of distributed global batches.

    The dataset may be any iterable of GLOBAL batches: an mr.data.Dataset, a torch DataLoader, a list,
    an object whose __iter__ returns a generator. An iterator (a generator object) is read once: a
    second pass is an error, not an empty epoch."""

    def __init__(self, strategy: Strategy, dataset: Iterable[Any], options: InputOptions | None = None):
        if not isinstance(dataset, Iterable):
            raise TypeError(f"experimental_distribute_dataset: expected a dataset of GLOBAL batches (an "
                            f"mr.data.Dataset, a DataLoader or any iterable); got {type(dataset).__name__}.")
        self._policy = shard_policy(strategy, dataset)
        if strategy.num_workers > 1 and isinstance(dataset, Dataset) and self._policy != "OFF":
            # (OFF keeps each worker's own draws, as TF: the same order everywhere would repeat examples in a step)
            share_drawn_seeds(strategy, dataset)
            rank = strategy.first_replica_id // len(strategy.extended.worker_devices)
            if self._policy == "FILE":  # this worker's copy lists its own files: it reads about 1/W of them
                dataset = auto_shard.shard_files(dataset, strategy.num_workers, rank)
            elif self._policy == "HINT":  # its shard(SHARD_HINT, SHARD_HINT) placeholders become shard(W, rank)
                dataset = auto_shard.fill_hints(dataset, strategy.num_workers, rank)
        self._strategy = strategy
        self._passes = _Passes(dataset, "experimental_distribute_dataset")
        self._options = options

    def __iter__(self) -> DistributedIterator:
        # The dataset's state before a pass starts is where DistributedIterator.get_state() resumes.
        source = self._passes.source
        pass_state = source.get_state() if hasattr(source, "get_state") else None
        it = DistributedIterator(self._strategy, self._passes.start(), self._options, self._policy)
        it._resume = (source, pass_state)
        return it

    def __len__(self) -> int:
        """The number of global batches, where the dataset knows it (see cardinality())."""
        n = self.cardinality()
        if n < 0:
            raise TypeError(f"experimental_distribute_dataset: the number of batches of this "
                            f"{type(self.dataset).__name__} is not known "
                            f"({'infinite' if n == INFINITE_CARDINALITY else 'unknown'}); use cardinality().")
        return n

    def cardinality(self) -> int:
        """The number of global batches, INFINITE_CARDINALITY (-1) or UNKNOWN_CARDINALITY (-2), as the
        dataset reports it (cardinality() or len()); unknown where workers read their own data (FILE, HINT,
        OFF), whose steps depend on every worker's part."""
        n = self._passes.cardinality()
        return n if self._policy == "DATA" or n == INFINITE_CARDINALITY else UNKNOWN_CARDINALITY

    @property
    def dataset(self) -> Iterable[Any]:
        """The dataset of global batches this was made from, as passed to experimental_distribute_dataset."""
        return self._passes.source

    @property
    def element_spec(self) -> Any:
        """The structure of a distributed batch, a TensorSpec per part: each leaf is a PerReplica of the
        replicas' specs (a plain spec with one replica in this process), their first dimension None
        (parts differ by a row where the batch does not divide). Needs a dataset with element_spec."""
        return _distributed_spec(self._strategy, self._passes.source)


class DistributedDatasetsFromFunction:
    """What `strategy.distribute_datasets_from_function` returns (where TF returns a DistributedDataset):
    replica i of each step gets the next per-replica batch of the function's dataset, in turn. Iterate it
    once per epoch; its iterator has get_next() and get_next_as_optional() as DistributedIterator does."""

    def __init__(self, strategy: Strategy, dataset_fn: Callable[[InputContext], Iterable[Any]],
                 options: InputOptions | None = None):
        if not callable(dataset_fn):
            raise TypeError(f"distribute_datasets_from_function({dataset_fn!r}): pass a function "
                            "InputContext -> dataset of per-replica batches.")
        self._strategy = strategy
        local = len(strategy.extended.worker_devices)  # one input pipeline per worker process
        ctx = InputContext(strategy.num_replicas_in_sync // local, strategy.first_replica_id // local,
                           strategy.num_replicas_in_sync)
        dataset = dataset_fn(ctx)
        if dataset is None or not isinstance(dataset, Iterable):
            raise TypeError(f"distribute_datasets_from_function: the function returned "
                            f"{type(dataset).__name__}, not a dataset.")
        self._passes = _Passes(dataset, "distribute_datasets_from_function")
        self._splitter = _Splitter(strategy, options)

    def __iter__(self) -> _FunctionIterator:
        return _FunctionIterator(self._batches())

    def _batches(self) -> Iterator[Any]:
        n = len(self._strategy.extended.worker_devices)  # this process's replicas
        source = self._passes.start()
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
            if self._strategy.sum_over_workers(len(parts)) == 0:
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


class _FunctionIterator(_GetNext):
    """The iterator of distribute_datasets_from_function: its steps' batches, with get_next() and
    get_next_as_optional() as TF's iterator has them."""

    __slots__ = ("_batches",)

    def __init__(self, batches: Iterator[Any]):
        self._batches = batches

    def __iter__(self) -> _FunctionIterator:
        return self

    def __next__(self) -> Any:
        return next(self._batches)

    def close(self) -> None:
        """Ends the pass now (its input pipeline is closed), as a generator's close() does."""
        self._batches.close()
