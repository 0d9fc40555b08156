"""What auto-sharding across workers asks of a Dataset (tf.data's AutoShardPolicy): the shuffle seeds
this process drew (a multi-worker strategy replaces them with the chief's, so every worker reads one
order), the file sources that FILE sharding divides between workers (a copy of the pipeline that lists
this worker's files), and the SHARD_HINT placeholders HINT sharding fills. mirrored.distribute's
distributed input calls these; a program rarely needs them. Uses dataset.py, _pipeline.py and
_sources.py.
"""
from __future__ import annotations

import copy
import threading
from collections.abc import Callable

from mirrored._seeds import derive_seed
from mirrored.data import _pipeline, _sources
from mirrored.data.dataset import Dataset, _graph

__all__ = ["describe_files", "drawn_seeds", "file_sources", "fill_hints", "hint_shards", "set_drawn_seeds",
           "shard_files"]


def _drawn_shuffles(dataset: Dataset) -> list[_pipeline.Shuffle]:
    return [n for n in _graph(dataset._node) if isinstance(n, _pipeline.Shuffle) and n.drawn]


def drawn_seeds(dataset: Dataset) -> list[int]:
    """The seeds of the dataset's shuffles made with seed=None, in pipeline order."""
    return [n.seed for n in _drawn_shuffles(dataset)]


def set_drawn_seeds(dataset: Dataset, seeds: list[int]) -> None:
    """Replaces the drawn seeds (another random draw: the chief's), in drawn_seeds()'s order."""
    for node, seed in zip(_drawn_shuffles(dataset), seeds, strict=True):
        node.seed = int(seed)


def file_sources(dataset: Dataset) -> list[_pipeline.Node]:
    """The lists of files (or TFDS shards) the pipeline reads: list_files, TFRecordDataset, tfds.load."""
    return [n for n in _graph(dataset._node) if isinstance(n, _sources.Files)]


def shard_files(dataset: Dataset, count: int, index: int) -> Dataset:
    """A copy of the pipeline whose file sources list every `count`-th file from `index` (tf.data's FILE
    auto-shard): nodes between them and the output are copied, the rest shared. A cardinality the
    whole set of files promised (TFDS' shard lengths) no longer holds for a part, so it is dropped, and a
    memory cache starts empty. (A cache(filename) keeps its file: give each worker its own, as in TF.)"""
    def files(node: _pipeline.Node) -> _pipeline.Node | None:
        if not isinstance(node, _sources.Files):
            return None
        out = copy.copy(node)
        out.shard = (count, index)
        return out
    return _rewritten(dataset, files, (count, index))


def hint_shards(dataset: Dataset) -> list[_pipeline.Node]:
    """The pipeline's shard(SHARD_HINT, SHARD_HINT) placeholders."""
    return [n for n in _graph(dataset._node) if isinstance(n, _pipeline.Shard) and n.hint]


def fill_hints(dataset: Dataset, count: int, index: int) -> Dataset:
    """A copy of the pipeline whose SHARD_HINT placeholders are shard(count, index) (tf.data's HINT)."""
    def hint(node: _pipeline.Node) -> _pipeline.Node | None:
        if not (isinstance(node, _pipeline.Shard) and node.hint):
            return None
        out = copy.copy(node)
        out.num_shards, out.index = count, index
        return out
    return _rewritten(dataset, hint, (count, index))


def _rewritten(dataset: Dataset, replace: Callable[[_pipeline.Node], _pipeline.Node | None],
               part: tuple[int, int]) -> Dataset:
    """The pipeline with the nodes `replace` returns a copy for replaced: the nodes between them and the
    output are copied (their inputs change), the others shared. A copied map_with_generator numbers
    this part's elements from 0, so its seed takes `part` (count, index) in: else worker w's k-th
    element drew worker 0's k-th element's numbers."""
    memo: dict[int, _pipeline.Node] = {}

    def clone(node: _pipeline.Node) -> _pipeline.Node:
        if id(node) in memo:
            return memo[id(node)]
        inputs = tuple(clone(i) for i in node.inputs)
        out = replace(node)
        if out is not None:
            out.inputs = inputs
        elif all(a is b for a, b in zip(inputs, node.inputs)):
            out = node
        elif node.kind == "assert_cardinality":
            out = inputs[0]
        else:
            out = copy.copy(node)
            out.inputs = inputs
            if isinstance(getattr(node, "lock", None), type(threading.Lock())):
                out.lock = threading.Lock()  # (a shuffle's pass counter: the copy counts its own passes)
            if node.kind == "map_with_generator":
                out.seed = derive_seed(node.seed, *part, 0x24)
            if node.kind == "cache":
                out.elements, out.namedtuples = None, {}  # a memory cache of all of it is not this part's
        memo[id(node)] = out
        return out

    return Dataset(clone(dataset._node))


def describe_files(sources: list[_pipeline.Node]) -> str:
    """'8 files' / '4 shards' (the smallest source first), for messages."""
    smallest = min(sources, key=lambda s: len(s.items))
    return f"{len(smallest.items)} {smallest.what}{'' if len(smallest.items) == 1 else 's'}"
