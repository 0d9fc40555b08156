"""`Dataset`: a lazy, re-iterable input pipeline on torch tensors with the tf.data API.

    ds = Dataset.from_tensor_slices((images, labels)).shuffle(1024, seed=0)
    ds = ds.map(augment, num_parallel_calls=AUTOTUNE).batch(64).prefetch(AUTOTUNE)
    for x, y in ds: ...          # each iter(ds) is a new pass (an epoch)

Elements are tensors, numpy arrays, str / bytes / numbers, or tuples / dicts / namedtuples / lists
of them. Transformations return new datasets and run nothing until iterated. map, interleave and
prefetch can run on background threads (PIL decoding and torch kernels release the GIL, so threads
parallelise the heavy part without the copies processes need); every thread ends when its iterator
is exhausted, closed, or garbage-collected. Each public name keeps its tf.data name and behaviour
unless its docstring says otherwise. Builds on _sources.py and _pipeline.py (one node per source or
transformation), _structure.py (nesting, specs, batching), _threads.py and _cache.py; uses torch
and numpy only.
"""
from __future__ import annotations

import functools
import glob
import operator
import os
from collections.abc import Callable, Iterator
from typing import Any

import torch

from mirrored.data import _cache, _pipeline, _sources, _structure
from mirrored.data._pipeline import INFINITE_CARDINALITY, UNKNOWN_CARDINALITY
from mirrored.data._structure import TensorSpec
from mirrored.data._threads import AUTOTUNE, close_iterator
from mirrored.data.options import Options

SHARD_HINT = -1  # tf.data.experimental.SHARD_HINT: Dataset.shard's placeholder for HINT auto-sharding

__all__ = ["AUTOTUNE", "INFINITE_CARDINALITY", "UNKNOWN_CARDINALITY", "Dataset", "TensorSpec"]

_AUTOTUNE_PREFETCH = 2  # elements: one ready while one is consumed; more only holds memory
_STATE_FORMAT = "mirrored.data.Dataset state v1"


def _int_arg(value: Any, where: str, name: str, minimum: int, fix: str) -> int:
    """`value` as an int >= minimum, or a TypeError / ValueError naming it and the fix."""
    if isinstance(value, bool):
        raise TypeError(f"{where}: {name} must be an int; got the bool {value}. {fix}")
    try:
        value = operator.index(value)
    except TypeError:
        raise TypeError(f"{where}: {name} must be an int; got {value!r} ({type(value).__name__}). {fix}") from None
    if value < minimum:
        raise ValueError(f"{where}: {name} must be >= {minimum}; got {value}. {fix}")
    return value


def _parallel_arg(value: Any, where: str) -> int | None:
    if value is None or value == AUTOTUNE:
        return value
    return _int_arg(value, where, "num_parallel_calls", 1,
                    "Give a thread count >= 1, AUTOTUNE (one per CPU), or None to run inline.")


def _callable_arg(fn: Any, where: str, what: str) -> Callable[..., Any]:
    if not callable(fn):
        raise TypeError(f"{where}: {what} must be callable; got {fn!r} ({type(fn).__name__}). "
                        "Pass a function, e.g. lambda x, y: (x * 2, y) for (x, y) elements.")
    return fn


class Dataset:
    """A sequence of elements, produced lazily and afresh on each `iter()` (tf.data.Dataset).

    Build one with `from_tensor_slices`, `from_tensors`, `from_generator`, `range` or `zip`, then
    chain transformations. Iterating yields elements in a fixed order for fixed seeds: map keeps
    input order unless deterministic=False, and a `shuffle` seeded (or built after
    `torch.manual_seed`) gives the same orders in every run.

    Resuming: `get_state()` returns a JSON-serialisable dict with the seed and pass count (epoch) of
    every shuffle and map_with_generator in the pipeline; `set_state(state)` on the same pipeline
    built in a fresh process restores them, so the next `iter()` repeats the order (and the random
    augmentation) that pass had in the original run. Take
    the state between epochs, before `iter()`: each `iter()` counts a pass. Positions inside a pass
    and memory caches are not part of the state (a file cache persists on its own).
    """

    __slots__ = ("_node",)

    def __init__(self, node: _pipeline.Node):
        """Not for direct use: build datasets with the from_* / range / zip factories."""
        self._node = node

    # ------------------------------------------------------------------------------ sources

    @staticmethod
    def from_tensor_slices(tensors: Any) -> Dataset:
        """One element per index of dim 0 of every component (tf.data.Dataset.from_tensor_slices).

        `tensors`: a tensor, numpy array, list (read as ONE tensor, or as strings if it holds str),
        or a tuple / dict / namedtuple of them. Elements share memory with the input tensors."""
        where = "Dataset.from_tensor_slices"
        leaves, tree = _structure.flatten_source(tensors)
        if not leaves:
            raise ValueError(f"{where}: got {_structure.describe(tensors)} with no components; give "
                             "at least one tensor, e.g. from_tensor_slices((images, labels)).")
        paths = _structure.leaf_paths(tree)
        columns = [_structure.as_column(leaf, path, where) for leaf, path in zip(leaves, paths)]
        lengths = [c.shape[0] if isinstance(c, torch.Tensor) else len(c) for c in columns]
        if len(set(lengths)) > 1:
            listing = ", ".join(f"{p or 'x'}: {n}" for p, n in zip(paths, lengths))
            raise ValueError(
                f"{where}: all components must have the same size in dimension 0 (one slice per "
                f"element), but got {listing}. Check that every component describes the same examples."
            )
        return Dataset(_sources.TensorSlices(columns, tree, lengths[0]))

    @staticmethod
    def from_tensors(tensors: Any) -> Dataset:
        """A dataset of exactly one element, `tensors` (numbers, numpy and lists become tensors)."""
        leaves, tree = _structure.flatten_source(tensors)
        paths = _structure.leaf_paths(tree)
        values = [_structure.as_constant(leaf, path, "Dataset.from_tensors") for leaf, path in zip(leaves, paths)]
        return Dataset(_sources.Tensors(_structure.unflatten(tree, values)))

    @staticmethod
    def from_generator(generator: Callable[..., Any], output_types: Any = None, output_shapes: Any = None,
                       args: tuple[Any, ...] | None = None, output_signature: Any = None) -> Dataset:
        """Elements from `generator(*args)`, a callable returning an iterable; it is called again for
        every pass. numpy values become tensors. With `output_signature` (a structure of TensorSpec)
        each element is checked against it and converted to its dtypes; tf.data's older
        `output_types` (a structure of torch dtypes) with optional `output_shapes` (the same
        structure of shapes, None for a dimension that varies) say the same thing."""
        where = "Dataset.from_generator"
        _callable_arg(generator, where, "generator")
        if output_types is not None or output_shapes is not None:
            if output_signature is not None:
                raise TypeError(f"{where}: give output_signature, or output_types (with output_shapes), not both.")
            output_signature = _signature_from_types(output_types, output_shapes, where)
        if args is not None:
            if not isinstance(args, (tuple, list)):
                raise TypeError(f"{where}: args must be a tuple of the generator's arguments; got {args!r:.100}.")
            generator = functools.partial(generator, *args)
        if output_signature is not None:
            specs, _ = _structure.flatten(output_signature)
            bad = [s for s in specs if not isinstance(s, TensorSpec)]
            if bad or not specs:
                raise TypeError(
                    f"{where}: output_signature must be a structure of TensorSpec; got "
                    f"{output_signature!r}. E.g. (TensorSpec(shape=(None,), dtype=torch.float32), "
                    "TensorSpec(shape=(), dtype=torch.int64))."
                )
        return Dataset(_sources.Generator(generator, output_signature))

    @staticmethod
    def range(start: int, stop: int | None = None, step: int = 1, *,
              dtype: torch.dtype = torch.int64) -> Dataset:
        """Scalar tensors start, start + step, ... before stop, like Python's range (tf.data's
        Dataset.range: int64 unless dtype= says otherwise)."""
        where = "Dataset.range"
        if stop is None:
            start, stop = 0, start
        fix = "Use ints, as for Python's range()."
        start = _int_arg(start, where, "start", -(1 << 63), fix)
        stop = _int_arg(stop, where, "stop", -(1 << 63), fix)
        step = _int_arg(step, where, "step", -(1 << 63), fix)
        if step == 0:
            raise ValueError(f"{where}: step must not be 0; got range({start}, {stop}, 0). {fix}")
        if not isinstance(dtype, torch.dtype):
            raise TypeError(f"{where}: dtype must be a torch.dtype such as torch.int64; got {dtype!r}.")
        return Dataset(_sources.Range(start, stop, step, dtype))

    @staticmethod
    def list_files(file_pattern: str | os.PathLike | list[str | os.PathLike], shuffle: bool | None = None,
                   seed: int | None = None) -> Dataset:
        """The names of the files matching `file_pattern` (a glob, or a list of them), each once, as str
        elements (tf.data.Dataset.list_files): shuffled each pass unless shuffle=False (then sorted).
        A multi-worker strategy's FILE auto-sharding gives each worker every W-th of these files."""
        where = "Dataset.list_files"
        patterns = list(file_pattern) if isinstance(file_pattern, (list, tuple)) else [file_pattern]
        if not patterns or not all(isinstance(p, (str, os.PathLike)) for p in patterns):
            raise TypeError(f"{where}: file_pattern must be a glob pattern (str) or a list of them; got "
                            f"{file_pattern!r:.200}.")
        names = sorted({name for p in patterns for name in glob.glob(os.fspath(p))})
        if not names:
            raise ValueError(f"{where}: no files match {', '.join(repr(os.fspath(p)) for p in patterns)}. Check the "
                             "directory and the pattern (e.g. 'data/train-*.tfrecord').")
        ds = Dataset(_sources.Files(names, "file"))
        return ds.shuffle(len(names), seed=seed) if shuffle is None or shuffle else ds

    @staticmethod
    def zip(*args: Any, datasets: Any = None) -> Dataset:
        """Elements of several datasets side by side, stopping at the shortest. Takes datasets as
        arguments (elements are tuples) or one tuple / dict of datasets (elements have its shape)."""
        if datasets is not None and args:
            raise TypeError("Dataset.zip: give the datasets as arguments or as datasets=, not both.")
        structure = datasets if datasets is not None else args[0] if len(args) == 1 else args
        leaves, tree = _structure.flatten(structure)
        bad = [x for x in leaves if not isinstance(x, Dataset)]
        if bad or not leaves:
            raise TypeError(
                f"Dataset.zip: expected datasets, or one tuple / dict of datasets; got "
                f"{_structure.describe(bad[0]) if bad else 'no datasets'}. E.g. Dataset.zip(images_ds, labels_ds)."
            )
        return Dataset(_sources.Zip([d._node for d in leaves], tree))

    # ------------------------------------------------------------------------ transformations

    def concatenate(self, dataset: Dataset) -> Dataset:
        """This dataset's elements, then `dataset`'s (their structures should match)."""
        if not isinstance(dataset, Dataset):
            raise TypeError(f"Dataset.concatenate: expected a Dataset; got {_structure.describe(dataset)}.")
        return Dataset(_sources.Concatenate(self._node, dataset._node))

    def enumerate(self, start: int = 0) -> Dataset:
        """(index, element) pairs, the index an int64 scalar tensor counting from `start`."""
        start = _int_arg(start, "Dataset.enumerate", "start", -(1 << 63), "Use an int.")
        return Dataset(_pipeline.Enumerate(self._node, start))

    def map(self, map_func: Callable[..., Any], num_parallel_calls: int | None = None,
            deterministic: bool = True) -> Dataset:
        """`map_func(element)` for every element; a tuple element is unpacked into arguments, as in
        tf.data (`map(lambda x, y: ...)`). With num_parallel_calls (a count or AUTOTUNE) it runs on
        that many threads with at most 2 elements per thread in flight; results keep input order
        unless deterministic=False. An error in map_func reaches the caller with a note naming the
        element's index in this pass."""
        where = "Dataset.map"
        fn = _callable_arg(map_func, where, "map_func")
        return Dataset(_pipeline.Map(self._node, fn, _parallel_arg(num_parallel_calls, where), bool(deterministic)))

    def map_with_generator(self, map_func: Callable[..., Any], seed: int | None = None,
                           num_parallel_calls: int | None = None) -> Dataset:
        """map, for random augmentation: map_func gets the element (unpacked as map's) and then a
        torch.Generator seeded by (seed, pass, element index), like tf.image.stateless_random_*'s seeds.
        So the output is the same for any num_parallel_calls, in every run, and after a resume
        (get_state() holds the pass count). seed=None draws one now from torch's global generator.

        E.g. ds.map_with_generator(lambda image, label, g: (mr.data.images.random_flip_left_right(image, g),
        label), seed=0, num_parallel_calls=mr.data.AUTOTUNE)."""
        where = "Dataset.map_with_generator"
        fn = _callable_arg(map_func, where, "map_func")
        if seed is None:
            seed = int(torch.randint(0, 1 << 62, ()).item())
        else:
            seed = _int_arg(seed, where, "seed", -(1 << 63), "Give an int seed, or None for a random one.")
        return Dataset(_pipeline.MapWithGenerator(self._node, fn, seed, _parallel_arg(num_parallel_calls, where)))

    def filter(self, predicate: Callable[..., Any]) -> Dataset:
        """The elements for which `predicate` (unpacked like map's function) returns True."""
        return Dataset(_pipeline.Filter(self._node, _callable_arg(predicate, "Dataset.filter", "predicate")))

    def shuffle(self, buffer_size: int, seed: int | None = None,
                reshuffle_each_iteration: bool = True) -> Dataset:
        """Randomly shuffles through a buffer of `buffer_size` elements (tf.data semantics: fill the
        buffer, emit a uniformly chosen slot, refill it with the next element). A full shuffle needs
        buffer_size >= the dataset size.

        `seed=None` draws the seed now from torch's global generator, so torch.manual_seed(s) before
        building the pipeline makes it reproducible. Pass k uses a seed derived from (seed, k) when
        reshuffle_each_iteration, else the same order each pass. See get_state() to resume. Under a
        multi-worker strategy a drawn seed is replaced by the chief's, so every worker reads the same order
        whatever each process seeded (experimental_distribute_dataset shares it)."""
        where = "Dataset.shuffle"
        buffer_size = _int_arg(buffer_size, where, "buffer_size", 1,
                               "Give the number of elements to shuffle among, e.g. 1024 or the dataset size.")
        drawn = seed is None
        if drawn:
            seed = int(torch.randint(0, 1 << 62, ()).item())
        else:
            seed = _int_arg(seed, where, "seed", -(1 << 63), "Give an int seed, or None for a random one.")
        return Dataset(_pipeline.Shuffle(self._node, buffer_size, seed, bool(reshuffle_each_iteration), drawn))

    def batch(self, batch_size: int, drop_remainder: bool = False) -> Dataset:
        """Stacks `batch_size` consecutive elements (torch.stack per component; numbers become a
        tensor, str a list of str). The last batch may be smaller unless drop_remainder=True."""
        batch_size = _int_arg(batch_size, "Dataset.batch", "batch_size", 1,
                              "Give the number of elements per batch (with a strategy: the GLOBAL batch size).")
        return Dataset(_pipeline.Batch(self._node, batch_size, bool(drop_remainder)))

    def unbatch(self) -> Dataset:
        """Splits each element along dimension 0 into separate elements (the inverse of batch)."""
        return Dataset(_pipeline.Unbatch(self._node))

    def prefetch(self, buffer_size: int) -> Dataset:
        """Produces up to `buffer_size` elements ahead on a background thread (AUTOTUNE: 2;
        0: no prefetching), so the input pipeline overlaps the training step."""
        if buffer_size == AUTOTUNE and not isinstance(buffer_size, bool):
            buffer_size = _AUTOTUNE_PREFETCH
        buffer_size = _int_arg(buffer_size, "Dataset.prefetch", "buffer_size", 0,
                               "Give a number of elements (1 or 2 usually suffice) or AUTOTUNE.")
        return Dataset(_pipeline.Prefetch(self._node, buffer_size))

    def cache(self, filename: str | os.PathLike = "") -> Dataset:
        """Keeps the elements of the first complete pass and replays them in later passes: in
        memory, or in the file `filename` (our own format: JSON headers and raw tensor bytes, no
        pickle). A file that exists is read instead of the pipeline above, also by a new process; a
        pass that stops early writes nothing. Delete the file when the pipeline above changes."""
        if not isinstance(filename, (str, os.PathLike)):
            raise TypeError(f"Dataset.cache: filename must be a path (str), or '' for memory; got {filename!r}.")
        return Dataset(_cache.Cache(self._node, os.fspath(filename)))

    def repeat(self, count: int | None = None) -> Dataset:
        """The dataset `count` times (None or -1: forever). Each repetition is a new pass of what is
        above, so a shuffle before repeat reshuffles every repetition."""
        if count is not None and count != -1:
            count = _int_arg(count, "Dataset.repeat", "count", 0, "Give a count >= 0, or None to repeat forever.")
        return Dataset(_pipeline.Repeat(self._node, None if count in (None, -1) else count))

    def take(self, count: int) -> Dataset:
        """The first `count` elements (-1: all of them)."""
        count = _int_arg(count, "Dataset.take", "count", -1, "Give a count >= 0, or -1 for all elements.")
        return Dataset(_pipeline.Take(self._node, count))

    def skip(self, count: int) -> Dataset:
        """All but the first `count` elements (-1: skip everything)."""
        count = _int_arg(count, "Dataset.skip", "count", -1, "Give a count >= 0, or -1 to skip everything.")
        return Dataset(_pipeline.Skip(self._node, count))

    def shard(self, num_shards: int, index: int) -> Dataset:
        """Every `num_shards`-th element starting at `index`: element i goes to shard i % num_shards.
        shard(SHARD_HINT, SHARD_HINT) (mr.data.experimental.SHARD_HINT) is a placeholder that a multi-worker
        strategy's HINT auto-sharding fills with (workers, rank); elsewhere it keeps every element."""
        where = "Dataset.shard"
        if num_shards == SHARD_HINT and index == SHARD_HINT:
            return Dataset(_pipeline.Shard(self._node, 1, 0, hint=True))
        num_shards = _int_arg(num_shards, where, "num_shards", 1,
                              "Give the number of shards (e.g. the number of workers), >= 1.")
        index = _int_arg(index, where, "index", 0, f"Give an index in [0, {num_shards}).")
        if index >= num_shards:
            raise ValueError(f"{where}: index {index} is out of range for num_shards={num_shards}; "
                             f"give an index in [0, {num_shards}), e.g. the worker's rank.")
        return Dataset(_pipeline.Shard(self._node, num_shards, index))

    def interleave(self, map_func: Callable[..., Dataset], cycle_length: int | None = None,
                   block_length: int = 1, num_parallel_calls: int | None = None,
                   deterministic: bool = True) -> Dataset:
        """Maps each element to a Dataset and mixes their elements: `cycle_length` of them open
        (None: one per CPU), `block_length` consecutive elements from each in turn. With
        num_parallel_calls the open datasets are read ahead on threads. The order is the same with
        or without threads; deterministic=False is accepted and changes nothing. Seed any shuffle
        made inside map_func: one drawn from torch's generator there depends on when it runs."""
        where = "Dataset.interleave"
        fn = _callable_arg(map_func, where, "map_func")
        if cycle_length is not None and cycle_length != AUTOTUNE:
            cycle_length = _int_arg(cycle_length, where, "cycle_length", 1,
                                    "Give how many inner datasets to read at once, or None.")
        block_length = _int_arg(block_length, where, "block_length", 1,
                                "Give how many consecutive elements to take from each inner dataset.")
        del deterministic  # the order is always the deterministic one

        def node_of(*args: Any) -> _pipeline.Node:
            ds = fn(*args)
            if not isinstance(ds, Dataset):
                raise TypeError(f"{where}: map_func must return a Dataset; it returned "
                                f"{_structure.describe(ds)}. E.g. lambda f: Dataset.from_generator(...).")
            return ds._node

        return Dataset(_pipeline.Interleave(self._node, node_of, cycle_length, block_length,
                                            _parallel_arg(num_parallel_calls, where)))

    def flat_map(self, map_func: Callable[..., Dataset]) -> Dataset:
        """Maps each element to a Dataset and yields their elements one dataset after another."""
        return self.interleave(map_func, cycle_length=1, block_length=1)

    def apply(self, transformation_func: Callable[[Dataset], Dataset]) -> Dataset:
        """`transformation_func(self)`, for chaining reusable pipeline pieces."""
        out = _callable_arg(transformation_func, "Dataset.apply", "transformation_func")(self)
        if not isinstance(out, Dataset):
            raise TypeError(f"Dataset.apply: transformation_func must return a Dataset; it returned "
                            f"{_structure.describe(out)}.")
        return out

    def with_options(self, options: Options) -> Dataset:
        """The same elements with `options` (mr.data.Options) set, merged over any set upstream (a
        value set later wins), as tf.data.Dataset.with_options."""
        if not isinstance(options, Options):
            raise TypeError(f"Dataset.with_options: expected mr.data.Options, got {type(options).__name__} "
                            f"({options!r:.100}). Build one with mr.data.Options() and set its fields.")
        return Dataset(_pipeline.WithOptions(self._node, options))

    # ------------------------------------------------------------------------------ inspection

    def options(self) -> Options:
        """The options of this dataset: every with_options upstream, merged in pipeline order."""
        merged = Options()
        for node in reversed(_graph(self._node)):
            if isinstance(node, _pipeline.WithOptions):
                merged = merged.merge(node.options)
        return merged

    def cardinality(self) -> int:
        """The number of elements, INFINITE_CARDINALITY (-1) or UNKNOWN_CARDINALITY (-2); computed
        from the pipeline without iterating (filter, from_generator, interleave: unknown; unbatch:
        known where its input's batches have a known size, as after batch(k, drop_remainder=True)).
        skip(-1) (skip everything) is 0 where TF says -1 or -2 for an infinite or unknown input:
        TF's skips that input forever, ours yields nothing at once."""
        return self._node.cardinality()

    def __len__(self) -> int:
        n = self._node.cardinality()
        if n == INFINITE_CARDINALITY:
            raise TypeError("The dataset is infinite (e.g. repeat() without a count), so it has no len(); "
                            "use cardinality(), or take(n) to make it finite.")
        if n == UNKNOWN_CARDINALITY:
            raise TypeError("The dataset length is unknown (it contains a filter, from_generator, "
                            "interleave, or an unbatch of batches of unknown size); use cardinality(), or "
                            "count by iterating.")
        return n

    def __bool__(self) -> bool:
        return True  # __len__ must not decide truthiness: it raises for unknown lengths

    @property
    def element_spec(self) -> Any:
        """The structure of an element with a TensorSpec per leaf (a batch dimension is None unless
        drop_remainder=True). After map, interleave or a from_generator without output_signature
        it is read off the first element, in a pass that counts no epoch and starts no thread."""
        return self._node.spec()

    def __iter__(self) -> Iterator[Any]:
        it = self._node.iterate(False)
        return it if hasattr(it, "close") else _closable(it)

    def as_numpy_iterator(self) -> Iterator[Any]:
        """Iterates with tensors converted to numpy arrays (str and numbers stay as they are)."""
        return _as_numpy(iter(self))

    def get_state(self) -> dict[str, Any]:
        """The resumable state of the pipeline (JSON-serialisable): see the class docstring."""
        nodes = _graph(self._node)
        state = {
            "format": _STATE_FORMAT,
            "pipeline": [n.kind for n in nodes],
            "shuffle": [{"seed": n.seed, "epoch": n.epoch} for n in nodes if isinstance(n, _pipeline.Shuffle)],
        }
        mapped = [{"seed": n.seed, "epoch": n.epoch} for n in nodes if isinstance(n, _pipeline.MapWithGenerator)]
        if mapped:  # only where there are some, so states of other pipelines keep their old form
            state["generators"] = mapped
        return state

    def set_state(self, state: dict[str, Any]) -> None:
        """Restores a `get_state()` dict taken from the same pipeline (possibly in another process)."""
        where = "Dataset.set_state"
        if not isinstance(state, dict) or state.get("format") != _STATE_FORMAT:
            raise ValueError(f"{where}: expected a dict from Dataset.get_state() (format {_STATE_FORMAT!r}); "
                             f"got {state!r:.200}.")
        nodes = _graph(self._node)
        kinds = [n.kind for n in nodes]
        if state.get("pipeline") != kinds:
            raise ValueError(f"{where}: the state was taken from the pipeline {state.get('pipeline')} but "
                             f"this one is {kinds}. Restore it into the same pipeline it came from.")
        shuffles = [n for n in nodes if isinstance(n, _pipeline.Shuffle)]
        for node, entry in zip(shuffles, state["shuffle"], strict=True):
            node.seed = _int_arg(entry["seed"], where, "shuffle seed", -(1 << 63), "Pass get_state()'s dict unchanged.")
            with node.lock:
                node.epoch = _int_arg(entry["epoch"], where, "shuffle epoch", 0, "Pass get_state()'s dict unchanged.")
        mapped = [n for n in nodes if isinstance(n, _pipeline.MapWithGenerator)]
        for node, entry in zip(mapped, state.get("generators", []), strict=True):
            node.seed = _int_arg(entry["seed"], where, "map_with_generator seed", -(1 << 63),
                                 "Pass get_state()'s dict unchanged.")
            with node.lock:
                node.epoch = _int_arg(entry["epoch"], where, "map_with_generator epoch", 0,
                                      "Pass get_state()'s dict unchanged.")

    def __repr__(self) -> str:
        chain, node = [], self._node
        while True:
            chain.append(node.describe())
            if len(node.inputs) != 1:
                break
            node = node.inputs[0]
        n = self._node.cardinality()
        size = {INFINITE_CARDINALITY: "infinite", UNKNOWN_CARDINALITY: "unknown"}.get(n, str(n))
        return f"<Dataset {' -> '.join(reversed(chain))}, cardinality={size}>"


def _signature_from_types(output_types: Any, output_shapes: Any, where: str) -> Any:
    """A TensorSpec structure from from_generator's output_types and output_shapes (tf.data's older
    way to give output_signature): shapes default to unknown rank."""
    if output_types is None:
        raise TypeError(f"{where}: output_shapes needs output_types (the dtypes of the same structure).")
    types, tree = _structure.flatten(output_types)
    bad = [t for t in types if not isinstance(t, torch.dtype)]
    if bad or not types:
        raise TypeError(f"{where}: output_types must be a structure of torch dtypes (e.g. (torch.float32, "
                        f"torch.int64)); got {output_types!r}.")
    if output_shapes is None:
        shapes: list[Any] = [None] * len(types)
    else:
        # A shape is a list or tuple of dims: flatten the shapes' structure down to the types' leaves.
        try:
            shapes = _structure.flatten_as(tree, output_shapes)
        except _structure.StructureMismatch as e:
            raise ValueError(f"{where}: output_shapes {output_shapes!r} does not have the structure of output_types "
                             f"{output_types!r} ({e}); give one shape (a list of dims) per dtype.") from None
        for shape in shapes:
            if shape is not None and (not isinstance(shape, (list, tuple, torch.Size))
                                      or any(d is not None and (isinstance(d, bool) or not isinstance(d, int))
                                             for d in shape)):
                raise TypeError(f"{where}: output_shapes entry {shape!r} is not a shape; give a list of ints "
                                "(None for a dimension that varies), e.g. [None, 4].")
    specs = [TensorSpec(shape=None if shape is None else tuple(shape), dtype=dtype)
             for dtype, shape in zip(types, shapes)]
    return _structure.unflatten(tree, specs)


def _graph(root: _pipeline.Node) -> list[_pipeline.Node]:
    """Every node reachable from `root`, each once, depth first with inputs in order: the same
    pipeline code always lists its nodes in the same order, which is what makes states portable."""
    seen: set[int] = set()
    out: list[_pipeline.Node] = []
    stack = [root]
    while stack:
        node = stack.pop()
        if id(node) in seen:
            continue
        seen.add(id(node))
        out.append(node)
        stack.extend(reversed(node.inputs))
    return out


def _closable(it: Iterator[Any]) -> Iterator[Any]:
    yield from it


def _as_numpy(it: Iterator[Any]) -> Iterator[Any]:
    try:
        for element in it:
            yield _structure.map_leaves(_structure.to_numpy_leaf, element)
    finally:
        close_iterator(it)
