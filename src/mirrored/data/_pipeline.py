"""The nodes behind `Dataset`: the `Node` base class and one subclass per transformation.

A `Dataset` wraps one `Node`; a transformation makes a new node whose `inputs` are the nodes it
reads. `node.iterate(probe)` starts one pass and returns an iterator: a generator for the
sequential nodes (so a pass costs one generator frame per node and nothing per element beyond the
transformation itself), and `_threads.threaded_iter` for parallel map, prefetch and parallel
interleave. Every iterator closes the iterators it reads in a `finally`, so closing the outermost
one (or dropping it) stops every background thread below it.

`probe=True` is the pass `element_spec` takes to look at a first element: no threads, no shuffle
buffer, no cache writes, and no epoch counted. Sources are in _sources.py, the cache node in
_cache.py. Uses torch, _structure.py and _threads.py.
"""
from __future__ import annotations

import collections
import itertools
import random
import threading
from collections.abc import Callable, Iterator
from typing import Any

import torch

from mirrored._cpus import usable_cores
from mirrored._seeds import derive_seed
from mirrored.data import _structure
from mirrored.data._structure import TensorSpec, spec_of
from mirrored.data._threads import add_note, close_iterator, threaded_iter

INFINITE_CARDINALITY = -1
UNKNOWN_CARDINALITY = -2
_END = object()


class Node:
    """One source or transformation. Subclasses set `kind` and implement `iterate`."""

    kind = "node"
    # What unbatch's cardinality may rely on: this node yields its input's elements unchanged (or
    # some of them), or every element it yields has exactly the shapes of spec() (not a probed guess).
    passes_elements = False
    exact_spec = False

    def __init__(self, *inputs: Node):
        self.inputs = inputs
        self._spec: Any = None

    def iterate(self, probe: bool) -> Iterator[Any]:
        raise NotImplementedError

    def cardinality(self) -> int:
        return self.inputs[0].cardinality()

    def spec(self) -> Any:
        if self._spec is None:
            self._spec = self._compute_spec()
        return self._spec

    def _compute_spec(self) -> Any:
        return self.inputs[0].spec()

    def _probe_spec(self) -> Any:
        it = self.iterate(probe=True)
        try:
            first = next(it, _END)
        finally:
            close_iterator(it)
        if first is _END:
            raise ValueError(
                f"Dataset.element_spec: cannot infer it from {self.describe()}, which yields no "
                "elements. Give Dataset.from_generator an output_signature, or check the pipeline."
            )
        return spec_of(first)

    def describe(self) -> str:
        return self.kind


# ------------------------------------------------------------------------------- transformations


def resolve_parallelism(num_parallel_calls: int | None) -> int | None:
    if num_parallel_calls is None:
        return None
    return usable_cores() if num_parallel_calls == -1 else num_parallel_calls


def map_in_flight(workers: int) -> int:
    """Elements a parallel map may hold between upstream and its consumer: enough that the workers
    keep going while the consumer stacks a batch or one element takes long (results leave in
    order), and bounded, so memory is too. On 2 cores 2 per worker gave AUTOTUNE 1.52x serial and
    8 per worker 1.62x (one run each); this window measured 1.79x (benchmarks/RESULTS.md)."""
    return max(8, 4 * workers)


class _Indexed:
    """(index, element) pairs of `source`; closing them closes `source` (closing an enumerate does
    nothing, which left the stages above a failed map - their threads, their open files - to the
    garbage collector)."""

    __slots__ = ("_source", "_pairs")

    def __init__(self, source: Iterator[Any]):
        self._source, self._pairs = source, enumerate(source)

    def __iter__(self) -> "_Indexed":
        return self

    def __next__(self) -> tuple[int, Any]:
        return next(self._pairs)

    def close(self) -> None:
        close_iterator(self._source)


class Map(Node):
    """fn over each element, in order; on num_parallel_calls worker threads when given."""

    kind = "map"

    def __init__(self, input: Node, fn: Callable[..., Any], num_parallel_calls: int | None,
                 deterministic: bool):
        super().__init__(input)
        self.fn, self.workers, self.deterministic = fn, resolve_parallelism(num_parallel_calls), deterministic

    def _call(self, probe: bool) -> Callable[[int, Any], Any]:
        """The function of one pass: (element index, element) -> fn's value."""
        fn = self.fn

        def call(index: int, element: Any) -> Any:
            return fn(*element) if type(element) is tuple else fn(element)
        return call

    def iterate(self, probe: bool) -> Iterator[Any]:
        call = self._call(probe)
        upstream = _Indexed(self.inputs[0].iterate(probe))
        if self.workers is None or probe:
            return self._sequential(upstream, call)
        return threaded_iter(upstream, call, num_workers=self.workers, max_in_flight=map_in_flight(self.workers),
                             deterministic=self.deterministic, what=self.kind)

    def _sequential(self, upstream: Iterator[tuple[int, Any]], call: Callable[[int, Any], Any]) -> Iterator[Any]:
        try:
            for index, element in upstream:
                try:
                    value = call(index, element)
                except Exception as e:  # (threaded_iter's workers say the same)
                    add_note(e, f"in Dataset.{self.kind} function, element {index}")
                    raise
                yield value
        finally:
            close_iterator(upstream)

    def _compute_spec(self) -> Any:
        return self._probe_spec()

    def _settings(self) -> str:
        return ""

    def describe(self) -> str:
        name = getattr(self.fn, "__name__", type(self.fn).__name__)
        par = "" if self.workers is None else f", num_parallel_calls={self.workers}"
        return f"{self.kind}({name}{self._settings()}{par})"


class MapWithGenerator(Map):
    """Map whose function also gets a torch.Generator per element, seeded by (seed, pass, element
    index): the output is the same for any num_parallel_calls, in any run, and after a resume.
    Stateful like Shuffle: `epoch` counts the passes started (get_state/set_state)."""

    kind = "map_with_generator"

    def __init__(self, input: Node, fn: Callable[..., Any], seed: int, num_parallel_calls: int | None):
        super().__init__(input, fn, num_parallel_calls, deterministic=True)
        self.seed = seed
        self.epoch = 0
        self.lock = threading.Lock()

    def _call(self, probe: bool) -> Callable[[int, Any], Any]:
        with self.lock:
            epoch = self.epoch
            if not probe:
                self.epoch += 1
        seed, call = self.seed, super()._call(probe)

        def call_with_generator(index: int, element: Any) -> Any:  # fn(*element, generator)
            generator = torch.Generator().manual_seed(derive_seed(seed, epoch, index))
            return call(index, (*element, generator) if type(element) is tuple else (element, generator))
        return call_with_generator

    def _settings(self) -> str:
        return f", seed={self.seed}"


class Filter(Node):
    kind = "filter"
    passes_elements = True

    def __init__(self, input: Node, predicate: Callable[..., Any]):
        super().__init__(input)
        self.predicate = predicate

    def iterate(self, probe: bool) -> Iterator[Any]:
        upstream, predicate = self.inputs[0].iterate(probe), self.predicate
        try:
            for index, element in enumerate(upstream):
                try:
                    keep = predicate(*element) if type(element) is tuple else predicate(element)
                    keep = bool(keep)
                except Exception as e:
                    add_note(e, f"in Dataset.filter function, element {index}")
                    raise
                if keep:
                    yield element
        finally:
            close_iterator(upstream)

    def cardinality(self) -> int:
        return UNKNOWN_CARDINALITY


class Shuffle(Node):
    """Stateful: `epoch` counts the passes started, and pass k shuffles with a generator seeded by
    (seed, k) - the DistributedSampler `seed + epoch` scheme - so get_state/set_state can resume."""

    kind = "shuffle"
    passes_elements = True

    def __init__(self, input: Node, buffer_size: int, seed: int, reshuffle: bool, drawn: bool = False):
        super().__init__(input)
        self.buffer_size, self.seed, self.reshuffle = buffer_size, seed, reshuffle
        self.drawn = drawn  # seed=None: drawn here, so a multi-worker strategy replaces it with the chief's
        self.epoch = 0
        self.lock = threading.Lock()

    def iterate(self, probe: bool) -> Iterator[Any]:
        if probe:
            return self.inputs[0].iterate(probe)
        with self.lock:
            epoch, self.epoch = self.epoch, self.epoch + 1
        # str seeds go through sha512 in random.seed: well mixed and the same on every platform
        rng = random.Random(f"mirrored.data.shuffle/{self.seed}/{epoch if self.reshuffle else 0}")
        return self._shuffled(self.inputs[0].iterate(probe), rng)

    def _shuffled(self, upstream: Iterator[Any], rng: random.Random) -> Iterator[Any]:
        # tf.data's buffer: fill it, then each output is a uniformly chosen slot, refilled with the
        # next input. So input j can only come out at output position >= j - buffer_size + 1.
        size, randbelow = self.buffer_size, rng.randrange
        try:
            buffer = list(itertools.islice(upstream, size))
            if len(buffer) == size:
                for element in upstream:
                    j = randbelow(size)
                    out = buffer[j]
                    buffer[j] = element
                    yield out
            rng.shuffle(buffer)
            yield from buffer
        finally:
            close_iterator(upstream)

    def describe(self) -> str:
        return f"shuffle({self.buffer_size}, seed={self.seed})"


class Batch(Node):
    kind = "batch"

    def __init__(self, input: Node, batch_size: int, drop_remainder: bool):
        super().__init__(input)
        self.batch_size, self.drop_remainder = batch_size, drop_remainder

    def iterate(self, probe: bool) -> Iterator[Any]:
        upstream, size = self.inputs[0].iterate(probe), self.batch_size
        first = 0
        try:
            while True:
                chunk = list(itertools.islice(upstream, size))
                if not chunk or (self.drop_remainder and len(chunk) < size):
                    return
                yield _structure.collate(chunk, first)
                if len(chunk) < size:
                    return
                first += size
        finally:
            close_iterator(upstream)

    def cardinality(self) -> int:
        n = self.inputs[0].cardinality()
        if n < 0:
            return n
        return n // self.batch_size if self.drop_remainder else -(-n // self.batch_size)

    def _compute_spec(self) -> Any:
        size = self.batch_size if self.drop_remainder else None
        return _structure.map_leaves(lambda s: _structure.batched_spec(s, size), self.inputs[0].spec())

    def describe(self) -> str:
        return f"batch({self.batch_size}{', drop_remainder=True' if self.drop_remainder else ''})"


class Unbatch(Node):
    kind = "unbatch"

    def iterate(self, probe: bool) -> Iterator[Any]:
        upstream = self.inputs[0].iterate(probe)
        try:
            for index, element in enumerate(upstream):
                yield from _structure.unbatch_rows(element, index)
        finally:
            close_iterator(upstream)

    def cardinality(self) -> int:
        """n batches whose dim 0 is known to be k in every element (batch(k, drop_remainder=True),
        or tensors of k rows) give n * k rows, as in TF; else unknown. A shape seen on a probed first
        element (after a map, say) is no promise for the others, so it does not count."""
        n = self.inputs[0].cardinality()
        if n in (0, INFINITE_CARDINALITY, UNKNOWN_CARDINALITY):
            return n
        k = _fixed_rows(self.inputs[0])
        return UNKNOWN_CARDINALITY if k is None else n * k

    def _compute_spec(self) -> Any:
        return _structure.map_leaves(_structure.unbatched_spec, self.inputs[0].spec())


def _fixed_rows(node: Node) -> int | None:
    """The dim 0 every element of `node` has in all its leaves, where the pipeline guarantees it."""
    while node.passes_elements:
        node = node.inputs[0]
    if isinstance(node, Batch):
        return node.batch_size if node.drop_remainder else None
    if node.kind in ("zip", "concatenate"):  # rows fixed in every input, and the same: fixed here too
        rows = {_fixed_rows(i) for i in node.inputs}
        return rows.pop() if len(rows) == 1 and None not in rows else None
    if not node.exact_spec:
        return None
    dims = {None if spec.shape is None or not spec.shape else spec.shape[0]
            for spec in _structure.flatten(node.spec())[0]}
    return dims.pop() if len(dims) == 1 and None not in dims else None


class Prefetch(Node):
    kind = "prefetch"
    passes_elements = True

    def __init__(self, input: Node, buffer_size: int):
        super().__init__(input)
        self.buffer_size = buffer_size

    def iterate(self, probe: bool) -> Iterator[Any]:
        upstream = self.inputs[0].iterate(probe)
        if probe or self.buffer_size == 0:
            return upstream
        return threaded_iter(upstream, None, num_workers=1, max_in_flight=self.buffer_size,
                             deterministic=True, what="prefetch")

    def describe(self) -> str:
        return f"prefetch({self.buffer_size})"


class WithOptions(Node):
    """Dataset.with_options: the elements pass unchanged; `options` is read by Dataset.options()."""

    kind = "with_options"
    passes_elements = True

    def __init__(self, input: Node, options: Any):
        super().__init__(input)
        self.options = options

    def iterate(self, probe: bool) -> Iterator[Any]:
        return self.inputs[0].iterate(probe)

    def describe(self) -> str:
        return f"with_options({self.options!r})"


class Repeat(Node):
    kind = "repeat"
    passes_elements = True

    def __init__(self, input: Node, count: int | None):
        super().__init__(input)
        self.count = count  # None: forever

    def iterate(self, probe: bool) -> Iterator[Any]:
        count = 1 if probe else self.count
        k = 0
        while count is None or k < count:
            it = self.inputs[0].iterate(probe)
            try:
                first = next(it, _END)
                if first is _END and count is None:  # repeating an empty pass forever would never return
                    return
                if first is not _END:  # (with a count, an empty pass just counts: a later one may yield, as in TF)
                    yield first
                    yield from it
            finally:
                close_iterator(it)
            k += 1

    def cardinality(self) -> int:
        n = self.inputs[0].cardinality()
        if self.count is None:
            return 0 if n == 0 else INFINITE_CARDINALITY
        if self.count == 0:
            return 0
        return n if n < 0 else n * self.count

    def describe(self) -> str:
        return "repeat()" if self.count is None else f"repeat({self.count})"


class Take(Node):
    kind = "take"
    passes_elements = True

    def __init__(self, input: Node, count: int):
        super().__init__(input)
        self.count = count

    def iterate(self, probe: bool) -> Iterator[Any]:
        upstream = self.inputs[0].iterate(probe)
        try:
            yield from itertools.islice(upstream, None if self.count < 0 else self.count)
        finally:
            close_iterator(upstream)

    def cardinality(self) -> int:
        n = self.inputs[0].cardinality()
        if self.count < 0:
            return n
        if n == INFINITE_CARDINALITY:
            return self.count
        return n if n == UNKNOWN_CARDINALITY else min(n, self.count)

    def describe(self) -> str:
        return f"take({self.count})"


class Skip(Node):
    kind = "skip"
    passes_elements = True

    def __init__(self, input: Node, count: int):
        super().__init__(input)
        self.count = count  # -1: everything

    def iterate(self, probe: bool) -> Iterator[Any]:
        if self.count < 0:
            return
        upstream = self.inputs[0].iterate(probe)
        try:
            collections.deque(itertools.islice(upstream, self.count), maxlen=0)
            yield from upstream
        finally:
            close_iterator(upstream)

    def cardinality(self) -> int:
        n = self.inputs[0].cardinality()
        if self.count < 0:
            return 0
        return n if n < 0 else max(0, n - self.count)

    def describe(self) -> str:
        return f"skip({self.count})"


class Shard(Node):
    kind = "shard"
    passes_elements = True

    def __init__(self, input: Node, num_shards: int, index: int, hint: bool = False):
        super().__init__(input)
        self.num_shards, self.index = num_shards, index
        self.hint = hint  # shard(SHARD_HINT, SHARD_HINT): all of it, unless HINT auto-sharding fills it in

    def iterate(self, probe: bool) -> Iterator[Any]:
        upstream = self.inputs[0].iterate(probe)
        try:
            yield from itertools.islice(upstream, self.index, None, self.num_shards)
        finally:
            close_iterator(upstream)

    def cardinality(self) -> int:
        n = self.inputs[0].cardinality()
        if n < 0:
            return n
        return n // self.num_shards + (1 if self.index < n % self.num_shards else 0)

    def describe(self) -> str:
        return "shard(SHARD_HINT)" if self.hint and self.num_shards == 1 else f"shard({self.num_shards}, {self.index})"


class Enumerate(Node):
    kind = "enumerate"

    def __init__(self, input: Node, start: int):
        super().__init__(input)
        self.start = start

    def iterate(self, probe: bool) -> Iterator[Any]:
        upstream = self.inputs[0].iterate(probe)
        try:
            for i, element in enumerate(upstream, self.start):
                yield torch.tensor(i, dtype=torch.int64), element
        finally:
            close_iterator(upstream)

    def _compute_spec(self) -> Any:
        return (TensorSpec((), torch.int64), self.inputs[0].spec())


class Interleave(Node):
    """tf.data's interleave: `cycle_length` inner datasets open at once, `block_length` elements
    from each in turn; a finished one's slot is refilled from the next input element when the
    cycle comes back to it. With num_parallel_calls each open inner dataset is read ahead by its
    own thread, at most num_parallel_calls of them reading at a time; the order stays the same."""

    kind = "interleave"

    def __init__(self, input: Node, fn: Callable[..., Node], cycle_length: int | None,
                 block_length: int, num_parallel_calls: int | None):
        super().__init__(input)
        self.fn, self.block_length = fn, block_length
        self.cycle_length = cycle_length if cycle_length not in (None, -1) else usable_cores()
        self.workers = resolve_parallelism(num_parallel_calls)

    def iterate(self, probe: bool) -> Iterator[Any]:
        parallel = self.workers is not None and not probe
        gate = threading.BoundedSemaphore(self.workers) if parallel and self.workers < self.cycle_length else None
        inputs = self.inputs[0].iterate(probe)
        cycle: list[Iterator[Any] | None] = [None] * self.cycle_length
        fn, block_length, cycle_length = self.fn, self.block_length, self.cycle_length
        slot = block = n_open = index = 0
        end_of_input = False
        try:
            while not end_of_input or n_open:
                current = cycle[slot]
                if current is not None:
                    element = next(current, _END)
                    if element is not _END:
                        block += 1
                        if block == block_length:
                            block, slot = 0, (slot + 1) % cycle_length
                        yield element
                        continue
                    cycle[slot] = None
                    n_open -= 1
                    close_iterator(current)
                    block, slot = 0, (slot + 1) % cycle_length
                elif not end_of_input:
                    arg = next(inputs, _END)
                    if arg is _END:
                        end_of_input = True
                        continue
                    try:
                        node = fn(*arg) if type(arg) is tuple else fn(arg)
                    except Exception as e:
                        add_note(e, f"in Dataset.interleave function, element {index}")
                        raise
                    index += 1
                    it = node.iterate(probe)
                    if parallel:
                        it = threaded_iter(it, None, num_workers=1, max_in_flight=max(2, block_length),
                                           deterministic=True, what="interleave", gate=gate)
                    cycle[slot] = it
                    n_open += 1
                else:
                    block, slot = 0, (slot + 1) % cycle_length
        finally:
            for it in cycle:
                if it is not None:
                    close_iterator(it)
            close_iterator(inputs)

    def cardinality(self) -> int:
        return UNKNOWN_CARDINALITY

    def _compute_spec(self) -> Any:
        return self._probe_spec()

    def describe(self) -> str:
        return f"interleave(cycle_length={self.cycle_length}, block_length={self.block_length})"
