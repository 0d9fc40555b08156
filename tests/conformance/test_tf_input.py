"""Conformance: distributed input (splitting global batches, InputContext, datasets from a function).

Sources (tensorflow/python/distribute/): input_lib_test.py (DistributedIteratorTest:
testUnevenDatasetBatches, testTFFunctionInputWithUnevenBatches, the rebatch of a global batch
over replicas), input_lib.py (DistributedIterator.get_next_as_optional), strategy_common_test.py
(testSimpleInputFromDatasetLastPartialBatch, testDatasetFromFunction), mirrored_strategy_test.py
(testReplicateDataset, test_prefetch_to_host_dataset), strategy_test_lib.py
(_input_fn_to_test_input_context, _test_input_fn_iterable), distribute_lib.py
(InputContext.get_per_replica_batch_size).

TF 2.21 splits a global batch of B over N replicas by giving replicas, in order, ceil(B/N) examples
until the batch runs out: 10 over 3 -> 4, 4, 2; 1 over 2 -> 1, 0 (empty parts are legal).
"""
from __future__ import annotations

import pytest
import torch

import mirrored.distribute as md
from _replicas import strategy_of  # tests/_replicas.py


def batches(n_examples: int, batch_size: int) -> list[torch.Tensor]:
    """Global batches of the ids 0..n_examples-1 (the last one short), like range(n).batch(b)."""
    ids = torch.arange(n_examples)
    return [ids[i:i + batch_size] for i in range(0, n_examples, batch_size)]


def parts(strategy, batch) -> list[list[int]]:
    return [t.tolist() for t in strategy.experimental_local_results(batch)]


SPLITS = [  # (examples in the global batch, replicas, the parts)
    (10, 3, [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]),
    (5, 2, [[0, 1, 2], [3, 4]]),
    (1, 2, [[0], []]),
    (8, 2, [[0, 1, 2, 3], [4, 5, 6, 7]]),
    (7, 4, [[0, 1], [2, 3], [4, 5], [6]]),
    (6, 4, [[0, 1], [2, 3], [4, 5], []]),
]


def test_one_global_batch_splits_by_ceil():
    """Replicas in order take ceil(B/N) examples until the batch runs out; empty parts are legal."""
    for n_examples, n_replicas, want in SPLITS:
        s = strategy_of(n_replicas)
        (batch,) = list(s.experimental_distribute_dataset([torch.arange(n_examples)]))
        assert parts(s, batch) == want, (n_examples, n_replicas)


def test_last_partial_batch():
    """strategy_common_test.testSimpleInputFromDatasetLastPartialBatch: range(14).batch(8) on two
    replicas: the full batch splits 4 / 4, the partial batch of 6 splits [8, 9, 10] / [11, 12, 13]."""
    s = strategy_of(2)
    got = [parts(s, b) for b in s.experimental_distribute_dataset(batches(14, 8))]
    assert got == [[[0, 1, 2, 3], [4, 5, 6, 7]], [[8, 9, 10], [11, 12, 13]]]


def test_uneven_last_batch_over_three_replicas():
    """input_lib_test uneven batches: 10 examples batched by 4 over 3 replicas: (2, 2, 0) twice ->
    ceil(4/3) = 2, then the final batch of 2 -> 1, 1, 0; every replica sees every step."""
    s = strategy_of(3)
    got = [parts(s, b) for b in s.experimental_distribute_dataset(batches(10, 4))]
    assert got == [[[0, 1], [2, 3], []], [[4, 5], [6, 7], []], [[8], [9], []]]


def test_structured_elements_split_together():
    """Every leaf of an (x, y) / dict element is split at the same boundaries."""
    s = strategy_of(2)
    x, y = torch.arange(10).reshape(5, 2), torch.arange(5)
    (batch,) = list(s.experimental_distribute_dataset([{"x": x, "y": y}]))
    assert [t.tolist() for t in batch["y"].values] == [[0, 1, 2], [3, 4]]
    assert [t.shape[0] for t in batch["x"].values] == [3, 2]


def test_dataset_batched_smaller_than_replicas_errors_at_first_step():
    """A dataset batched per replica instead of globally (batch 3 on 4 replicas) would leave the
    last replica without examples at every step: the first step raises with the fix."""
    s = strategy_of(4)
    it = iter(s.experimental_distribute_dataset(batches(9, 3)))
    with pytest.raises(ValueError) as info:
        next(it)
    assert str(info.value) == (  # the message STYLE.md gives as its example
        "experimental_distribute_dataset: the dataset is batched by 3 but num_replicas_in_sync is 4, so replica 3 "
        "would get no examples. Batch by the GLOBAL size, e.g. ds.batch(3 * strategy.num_replicas_in_sync). "
        "(A short final batch of an epoch is fine.)")


def test_distributed_dataset_is_reiterable():
    """_test_input_fn_iterable: iterating again starts from the beginning; the end is StopIteration."""
    s = strategy_of(2)
    dist = s.experimental_distribute_dataset(batches(4, 2))
    first = [parts(s, b) for b in dist]
    assert first == [[[0], [1]], [[2], [3]]] and [parts(s, b) for b in dist] == first
    it = iter(dist)
    next(it), next(it)
    with pytest.raises(StopIteration):
        next(it)


def test_datasets_from_function_replicates_dataset():
    """mirrored_strategy_test.testReplicateDataset: the function gets InputContext(num_input_pipelines=1,
    input_pipeline_id=0, num_replicas_in_sync=2); replicas take successive elements of range(10):
    [0, 1], [2, 3], ..., then StopIteration, and iterating again starts over."""
    s = strategy_of(2)
    contexts = []

    def dataset_fn(ctx):
        contexts.append((ctx.num_input_pipelines, ctx.input_pipeline_id, ctx.num_replicas_in_sync))
        return [torch.tensor([i]) for i in range(10)]

    dist = s.distribute_datasets_from_function(dataset_fn)
    assert contexts == [(1, 0, 2)]
    want = [[[i], [i + 1]] for i in range(0, 10, 2)]
    assert [parts(s, b) for b in dist] == want
    assert [parts(s, b) for b in dist] == want


def test_datasets_from_function_last_partial_batch():
    """strategy_common_test.testSimpleInputFromFnLastPartialBatch (one worker): per-replica batches of
    4 from range(14) on 2 replicas: [0..3] / [4..7], then [8..11] / [12, 13]."""
    s = strategy_of(2)

    def dataset_fn(ctx):
        per_replica = ctx.get_per_replica_batch_size(8)
        return batches(14, per_replica)

    got = [parts(s, b) for b in s.distribute_datasets_from_function(dataset_fn)]
    assert got == [[[0, 1, 2, 3], [4, 5, 6, 7]], [[8, 9, 10, 11], [12, 13]]]


def test_datasets_from_function_runs_out_mid_step():
    """When the data runs out mid-step, the remaining replicas get empty batches (as with a short
    global batch); for unbatched scalar elements there is no empty batch, so it is a ValueError
    naming the fix, not a silently repeated example."""
    s = strategy_of(3)
    got = [parts(s, b) for b in s.distribute_datasets_from_function(lambda ctx: batches(4, 1))]
    assert got == [[[0], [1], [2]], [[3], [], []]]
    scalars = s.distribute_datasets_from_function(lambda ctx: [torch.tensor(i) for i in range(4)])
    with pytest.raises(ValueError, match="get_per_replica_batch_size"):
        list(scalars)


def test_input_context_per_replica_batch_size():
    """InputContext.get_per_replica_batch_size: the global batch divided by num_replicas_in_sync."""
    for global_batch, n, want in ((10, 2, 5), (12, 3, 4), (8, 1, 8)):
        assert md.InputContext(num_replicas_in_sync=n).get_per_replica_batch_size(global_batch) == want


def test_input_context_indivisible_batch_raises():
    """InputContext: "The `global_batch_size` 10 is not divisible by `num_replicas_in_sync` 3" (ValueError)."""
    with pytest.raises(ValueError, match="10 is not divisible by num_replicas_in_sync"):
        md.InputContext(num_replicas_in_sync=3).get_per_replica_batch_size(10)


def test_fetch_to_device_off_keeps_host_tensors():
    """mirrored_strategy_test.test_prefetch_to_host_dataset: with experimental_fetch_to_device=False the
    parts stay on the host (CPU) and are views of the global batch."""
    s = strategy_of(2)
    batch = torch.arange(4)
    opts = md.InputOptions(experimental_fetch_to_device=False)
    (dist,) = list(s.experimental_distribute_dataset([batch], options=opts))
    assert all(t.device.type == "cpu" for t in dist.values)
    assert dist.values[0].data_ptr() == batch.data_ptr()


def test_get_next_as_optional_after_the_last_global_batch():
    """input_lib.DistributedIterator.get_next_as_optional, measured on TF 2.21 with 2 replicas: the
    optional holds each distributed batch in turn (range(5).batch(2): [0] / [1], [2] / [3], [4] / []),
    and has_value() is False after the last global batch, so a loop ends without StopIteration."""
    s = strategy_of(2)
    it = iter(s.experimental_distribute_dataset(batches(5, 2)))
    got = []
    opt = it.get_next_as_optional()
    while opt.has_value():
        got.append(parts(s, opt.get_value()))
        opt = it.get_next_as_optional()
    assert got == [[[0], [1]], [[2], [3]], [[4], []]]
    assert not it.get_next_as_optional().has_value()
    it2 = iter(s.experimental_distribute_dataset(batches(5, 2)))
    assert parts(s, it2.get_next()) == [[0], [1]]  # get_next(), as TF names it


def test_get_next_as_optional_from_a_function():
    """input_lib.DistributedIterator is also the iterator of distribute_datasets_from_function in TF
    2.21, with the same get_next()/get_next_as_optional(): each replica's pipeline yields per-replica
    batches in turn, and has_value() is False after the last step (here 3 batches on 2 replicas: the
    data runs out in the second step, whose replica 1 gets an empty batch)."""
    s = strategy_of(2)
    dist = s.distribute_datasets_from_function(lambda ctx: [torch.arange(2), torch.arange(2, 4), torch.arange(4, 5)])
    it = iter(dist)
    assert iter(it) is it
    got = []
    opt = it.get_next_as_optional()
    while opt.has_value():
        got.append(parts(s, opt.get_value()))
        opt = it.get_next_as_optional()
    assert got == [[[0, 1], [2, 3]], [[4], []]]
    assert not it.get_next_as_optional().has_value()
    it2 = iter(dist)
    assert parts(s, it2.get_next()) == [[0, 1], [2, 3]]
    it2.close()
    with pytest.raises(StopIteration):
        it2.get_next()
