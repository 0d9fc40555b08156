"""input.py: the split rule, batch validation, and the distributed dataset / iterator objects.

TF's behaviours (10 over 3 -> 4, 4, 2; InputContext; datasets from a function) are in
tests/conformance/test_tf_input.py.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import mirrored.distribute as md
from mirrored.distribute import input as dist_input

TIMEOUT_S = 20.0


def strategy_of(n: int) -> md.MirroredStrategy:
    return md.MirroredStrategy(devices=[f"cpu:{i}" for i in range(n)], timeout_s=TIMEOUT_S)


@given(st.integers(0, 500), st.integers(1, 9))
def test_split_sizes_properties(batch_size, n):
    """Sizes sum to B; replicas in order take ceil(B/N) while examples last, so the sizes never
    increase, at most one is partial, and every size is in [0, ceil(B/N)]."""
    sizes = dist_input.split_sizes(batch_size, n)
    per = -(-batch_size // n)
    assert len(sizes) == n and sum(sizes) == batch_size
    assert all(0 <= s <= per for s in sizes) and sizes == sorted(sizes, reverse=True)
    assert sum(0 < s < per for s in sizes) <= 1


def test_batch_size_of_validates():
    assert dist_input.batch_size_of((torch.ones(4, 2), np.zeros(4), [1, 2, 3, 4], "tag"), "where") == 4
    with pytest.raises(ValueError, match=r"where: the leaves of one batch have different batch sizes \{0: 4, 1: 3\}"):
        dist_input.batch_size_of((torch.ones(4), torch.ones(3)), "where")
    with pytest.raises(ValueError, match="element leaf 1 is a scalar, so the dataset is not batched"):
        dist_input.batch_size_of((torch.ones(4), torch.tensor(1)), "where")
    with pytest.raises(ValueError, match="holds no tensors to split"):
        dist_input.batch_size_of({"a": "text"}, "where")


def test_numpy_and_list_leaves_are_split():
    s = strategy_of(2)
    batch = {"x": np.arange(6).reshape(3, 2), "names": ["a", "b", "c"], "tag": "const"}
    (dist,) = list(s.experimental_distribute_dataset([batch]))
    assert [t.tolist() for t in dist["x"].values] == [[[0, 1], [2, 3]], [[4, 5]]]
    assert isinstance(dist["x"].values[0], torch.Tensor)
    assert dist["names"].values == (["a", "b"], ["c"])
    assert dist["tag"].values == ("const", "const")


def test_batched_string_vectors_split_by_row():
    """A batch of string vectors (a rank-2 string tensor: mr.data's batch of parse_example's bytes
    lists) splits by row like a tensor, not as a list structure of rows."""
    from mirrored.data import Dataset

    rows = [{"t": [b"a%d" % i, b"b%d" % i], "x": torch.tensor(i)} for i in range(5)]
    s = strategy_of(2)
    dists = list(s.experimental_distribute_dataset(Dataset.from_generator(lambda: iter(rows)).batch(5)))
    assert len(dists) == 1
    assert dists[0]["t"].values == ([r["t"] for r in rows[:3]], [r["t"] for r in rows[3:]])
    assert [t.tolist() for t in dists[0]["x"].values] == [[0, 1, 2], [3, 4]]


def test_distributed_dataset_rejects_iterators_and_non_iterables():
    s = strategy_of(2)
    with pytest.raises(TypeError, match="got an iterator"):
        s.experimental_distribute_dataset(iter([torch.ones(2)]))
    with pytest.raises(TypeError, match="expected a dataset of GLOBAL batches"):
        s.experimental_distribute_dataset(42)
    with pytest.raises(TypeError, match="not a dataset"):
        s.distribute_datasets_from_function(lambda ctx: None)
    with pytest.raises(TypeError, match="pass a function"):
        s.distribute_datasets_from_function([torch.ones(2)])


def test_distributed_dataset_len_and_get_next():
    s = strategy_of(2)
    data = [torch.arange(4), torch.arange(4, 8)]
    dist = s.experimental_distribute_dataset(data)
    assert len(dist) == 2 and dist.dataset is data
    it = iter(dist)
    assert [t.tolist() for t in it.get_next().values] == [[0, 1], [2, 3]]
    assert iter(it) is it


def test_iterator_reads_one_batch_ahead():
    """The next global batch is split (and sent to the devices) while the current one is used."""
    s = strategy_of(2)
    read: list[int] = []

    class Source:
        def __iter__(self):
            for i in range(3):
                read.append(i)
                yield torch.arange(2) + 10 * i

    it = iter(s.experimental_distribute_dataset(Source()))
    next(it)
    assert read == [0, 1]
    next(it), next(it)
    assert read == [0, 1, 2]
    with pytest.raises(StopIteration):
        next(it)


def test_one_replica_gets_the_whole_batch():
    s = strategy_of(1)
    batch = (torch.arange(3), torch.arange(3))
    (dist,) = list(s.experimental_distribute_dataset([batch]))
    assert torch.equal(dist[0], batch[0]) and not isinstance(dist[0], md.PerReplica)


def test_a_short_only_batch_is_fine_but_a_short_first_of_many_is_not():
    """A dataset of one short batch is its own final batch (legal); a short first batch followed by
    more batches means the dataset was batched per replica."""
    s = strategy_of(3)
    (only,) = list(s.experimental_distribute_dataset([torch.arange(2)]))
    assert [t.tolist() for t in only.values] == [[0], [1], []]
    with pytest.raises(ValueError, match="batched by 2 but num_replicas_in_sync is 3"):
        list(s.experimental_distribute_dataset([torch.arange(2), torch.arange(2)]))


def test_run_consumes_distributed_batches():
    """A distributed batch is what run expects: each replica receives its own part."""
    s = strategy_of(3)
    sizes = [s.experimental_local_results(s.run(lambda x: len(x), args=(b,)))
             for b in s.experimental_distribute_dataset([torch.arange(10), torch.arange(4)])]
    assert sizes == [(4, 4, 2), (2, 2, 0)]


def test_input_options_defaults():
    opts = md.InputOptions()
    assert opts.experimental_fetch_to_device is True and opts.experimental_per_replica_buffer_size == 1
    assert repr(md.InputContext(2, 1, 4)) == "InputContext(num_input_pipelines=2, input_pipeline_id=1, " \
                                             "num_replicas_in_sync=4)"
