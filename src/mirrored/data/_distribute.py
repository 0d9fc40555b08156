"""What distributed input asks of a Dataset: the shuffle seeds this process drew (a multi-worker
strategy replaces them with the chief's, so every worker reads one order), and the file sources that
FILE auto-sharding divides between workers (a copy of the pipeline that lists this worker's files).
distribute/input.py calls these. Uses dataset.py, _pipeline.py and _sources.py.
"""
from __future__ import annotations

import copy
import threading
from mirrored.data import _pipeline, _sources
from mirrored.data.dataset import Dataset, _graph

__all__ = ["drawn_seeds", "file_sources", "set_drawn_seeds", "shard_files"]


def _drawn_shuffles(dataset: Dataset) -> list[_pipeline.Shuffle]:
    return [n for n in _graph(dataset._node) if isinstance(n, _pipeline.Shuffle) and n.drawn]


def drawn_seeds(dataset: Dataset) -> list[int]:
    """The seeds of the dataset's shuffles made with seed=None, in pipeline order."""
    return [n.seed for n in _drawn_shuffles(dataset)]


def set_drawn_seeds(dataset: Dataset, seeds: list[int]) -> None:
    """Replaces the drawn seeds (another random draw: the chief's), in drawn_seeds()'s order."""
    for node, seed in zip(_drawn_shuffles(dataset), seeds, strict=True):
        node.seed = int(seed)


def file_sources(dataset: Dataset) -> list[_sources.Files]:
    """The lists of files (or TFDS shards) the pipeline reads: list_files, TFRecordDataset, tfds.load."""
    return [n for n in _graph(dataset._node) if isinstance(n, _sources.Files)]


def shard_files(dataset: Dataset, count: int, index: int) -> Dataset:
    """A copy of the pipeline whose file sources list every `count`-th file from `index` (tf.data's FILE
    auto-shard): nodes between them and the output are copied, the rest shared. A cardinality the
    whole set of files promised (TFDS' shard lengths) no longer holds for a part, so it is dropped, and a
    memory cache starts empty. (A cache(filename) keeps its file: give each worker its own, as in TF.)"""
    memo: dict[int, _pipeline.Node] = {}

    def clone(node: _pipeline.Node) -> _pipeline.Node:
        if id(node) in memo:
            return memo[id(node)]
        out: _pipeline.Node
        if isinstance(node, _sources.Files):
            out = copy.copy(node)
            out.shard = (count, index)
        else:
            inputs = tuple(clone(i) for i in node.inputs)
            if all(a is b for a, b in zip(inputs, node.inputs)):
                out = node
            elif node.kind == "assert_cardinality":
                out = inputs[0]
            else:
                out = copy.copy(node)
                out.inputs = inputs
                if isinstance(getattr(node, "lock", None), type(threading.Lock())):
                    out.lock = threading.Lock()  # (a shuffle's pass counter: the copy counts its own passes)
                if node.kind == "cache":
                    out.elements, out.namedtuples = None, {}  # a memory cache of all files is not this part's
        memo[id(node)] = out
        return out

    return Dataset(clone(dataset._node))


def describe_files(sources: list[_sources.Files]) -> str:
    """'8 files' / '4 shards' (the smallest source first), for messages."""
    smallest = min(sources, key=lambda s: len(s.items))
    return f"{len(smallest.items)} {smallest.what}{'' if len(smallest.items) == 1 else 's'}"
