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
from _replicas import strategy_of  # tests/_replicas.py


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


def test_distributed_dataset_rejects_non_iterables():
    s = strategy_of(2)
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


# ---- any iterable of global batches (issue 14) ------------------------------------------------------

def reference_parts(x: torch.Tensor, batch_size: int, n: int) -> list[list[list[int]]]:
    """Per global batch, each replica's rows of x by TF's rule, worked out here by hand: replicas in
    order take ceil(B/N) until the batch runs out."""
    out = []
    for lo in range(0, len(x), batch_size):
        batch = x[lo:lo + batch_size].tolist()
        per = -(-len(batch) // n)
        out.append([batch[r * per:(r + 1) * per] for r in range(n)])
    return out


def test_torch_dataloader_is_split_by_tf_rule_every_epoch():
    """A torch DataLoader (num_workers=0) of (x, y) pairs batched by 5: each global batch (the last one
    short: 10 examples -> 5, 5; 13 -> 5, 5, 3) splits 3 / 2 (then 2 / 1), x and y alike, and the
    DataLoader is read afresh each epoch; len() and cardinality() are its number of batches."""
    s = strategy_of(2)
    x = torch.arange(13).reshape(13, 1)
    y = torch.arange(13) * 10
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=5, num_workers=0)
    dist = s.experimental_distribute_dataset(loader)
    assert len(dist) == 3 and dist.cardinality() == 3
    want = reference_parts(x.squeeze(1), 5, 2)
    for _ in range(2):  # two epochs
        got_x, got_y = [], []
        for bx, by in dist:
            got_x.append([t.squeeze(1).tolist() for t in s.experimental_local_results(bx)])
            got_y.append([t.tolist() for t in s.experimental_local_results(by)])
        assert got_x == want
        assert got_y == [[[10 * i for i in part] for part in parts] for parts in want]


def test_list_of_tuples_and_generator_iterable():
    """A plain list of (x, y) tuples and an object whose __iter__ returns a new generator are both
    re-iterable sources of global batches; the generator one has no len (cardinality -2, unknown)."""
    s = strategy_of(3)
    x = torch.arange(20)
    batches = [(x[i:i + 8], -x[i:i + 8]) for i in range(0, 20, 8)]

    class Generated:
        def __iter__(self):
            return (b for b in batches)

    want = reference_parts(x, 8, 3)
    for source in (batches, Generated()):
        dist = s.experimental_distribute_dataset(source)
        for _ in range(2):
            got = [[t.tolist() for t in s.experimental_local_results(bx)] for bx, _ in dist]
            assert got == want, type(source).__name__
    assert len(s.experimental_distribute_dataset(batches)) == 3
    gen_dist = s.experimental_distribute_dataset(Generated())
    assert gen_dist.cardinality() == -2
    with pytest.raises(TypeError, match="not known"):
        len(gen_dist)


def test_one_shot_iterator_gives_one_pass_then_a_clear_error():
    """A generator object (or iter(list)) is read once; a second pass would silently be empty, so it
    raises, naming the fix. distribute_datasets_from_function whose function returns one likewise."""
    s = strategy_of(2)
    dist = s.experimental_distribute_dataset(b for b in [torch.arange(4), torch.arange(4, 8)])
    assert dist.cardinality() == -2
    assert [[t.tolist() for t in b.values] for b in dist] == [[[0, 1], [2, 3]], [[4, 5], [6, 7]]]
    with pytest.raises(ValueError, match="one-shot iterator"):
        iter(dist)
    fn_dist = s.distribute_datasets_from_function(lambda ctx: iter([torch.arange(2), torch.arange(2, 4)]))
    assert [[t.tolist() for t in b.values] for b in fn_dist] == [[[0, 1], [2, 3]]]
    with pytest.raises(ValueError, match="one-shot iterator"):
        list(fn_dist)


def test_mr_data_cardinality_is_reported():
    from mirrored.data import Dataset

    s = strategy_of(2)
    ds = Dataset.from_tensor_slices(torch.arange(10)).batch(4)
    assert s.experimental_distribute_dataset(ds).cardinality() == 3 == len(s.experimental_distribute_dataset(ds))
    assert s.experimental_distribute_dataset(ds.repeat()).cardinality() == -1


def test_get_next_as_optional_ends_a_loop_cleanly():
    """The optional holds the same distributed batch next() would give; after the last one it is
    empty, and get_value() on it names has_value()."""
    s = strategy_of(2)
    it = iter(s.experimental_distribute_dataset([torch.arange(4), torch.arange(4, 7)]))
    seen = []
    while True:
        opt = it.get_next_as_optional()
        if not opt.has_value():
            break
        seen.append([t.tolist() for t in opt.get_value().values])
    assert seen == [[[0, 1], [2, 3]], [[4, 5], [6]]]
    assert not it.get_next_as_optional().has_value()
    with pytest.raises(ValueError, match="has_value"):
        it.get_next_as_optional().get_value()
    with pytest.raises(StopIteration):
        it.get_next()


# ---- copies to the replicas' devices (issue 19) ------------------------------------------------------

def test_only_host_to_gpu_copies_are_asynchronous():
    """A replica may read its batch on the host at once, so a copy that ends on the CPU must be
    complete when handed over: only host -> GPU (from pinned memory) is left to run asynchronously,
    ordered on the GPU's stream before the replica's work."""
    cpu, gpu0, gpu1 = torch.device("cpu"), torch.device("cuda:0"), torch.device("cuda:1")
    assert dist_input._copies_async(cpu, gpu0)
    assert not dist_input._copies_async(gpu0, cpu)
    assert not dist_input._copies_async(gpu0, gpu1)
    assert not dist_input._copies_async(cpu, cpu)


def test_cpu_batches_are_not_copied():
    """Logical CPU replicas share the one CPU: their parts are views of the global batch, no copy."""
    s = strategy_of(2)
    batch = torch.arange(6)
    (dist,) = list(s.experimental_distribute_dataset([batch]))
    assert all(t.untyped_storage().data_ptr() == batch.untyped_storage().data_ptr() for t in dist.values)


def test_split_global_batch_splits_as_the_distributed_dataset_does():
    """One batch drawn by a loop of its own (Keras's fit) is split as experimental_distribute_dataset
    splits each batch: the same parts on the same devices, the row counts and the global size; a
    list stays a list (a DataLoader over a TensorDataset yields lists) and numpy becomes tensors."""
    strategy = strategy_of(3)
    x, y = torch.arange(20.0).reshape(10, 2), np.arange(10)
    parts, rows, size = md.split_global_batch(strategy, [x, y])
    assert rows == [4, 4, 2] and size == 10
    (expected,) = list(strategy.experimental_distribute_dataset([(x, torch.from_numpy(y))]))
    for r, part in enumerate(parts):
        assert isinstance(part, list)
        want = strategy.experimental_local_results(expected)[r]
        assert torch.equal(part[0], want[0]) and torch.equal(part[1], want[1])
    parts, rows, _ = md.split_global_batch(strategy, (x[:1],))
    assert rows == [1, 0, 0] and [p[0].shape[0] for p in parts] == [1, 0, 0]
