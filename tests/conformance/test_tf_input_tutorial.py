"""Conformance: tensorflow/docs' "Distributed input" tutorial (site/en/tutorials/distribute/input.ipynb),
ported cell by cell with tf.data -> mr.data and tf.distribute -> mr, on 2 CPU replicas. Each test is
one cell (or a few) and checks what the tutorial prints under TensorFlow on 2 logical devices."""
from __future__ import annotations

import numpy as np
import torch

import mirrored as mr
from mirrored.data import Dataset
from _replicas import strategy_of  # tests/_replicas.py


def train_step(inputs):
    features, labels = inputs
    return labels - 0.3 * features


def test_a_global_batch_of_16_gives_each_replica_8():
    strategy = strategy_of(2)
    dataset = Dataset.from_tensors(([1.0], [1.0])).repeat(100).batch(16)
    dist_dataset = strategy.experimental_distribute_dataset(dataset)
    features, labels = next(iter(dist_dataset))
    assert [tuple(t.shape) for t in strategy.experimental_local_results(features)] == [(8, 1), (8, 1)]
    losses = [strategy.run(train_step, args=(x,)) for x in dist_dataset]
    assert len(losses) == 7  # 100 / 16: six full batches and one of 4
    last = strategy.experimental_local_results(losses[-1])
    assert [tuple(t.shape) for t in last] == [(2, 1), (2, 1)]
    assert all(torch.allclose(t, torch.tensor(0.7)) for t in last)


def test_options_with_an_auto_shard_policy_and_a_dataset_fn():
    strategy = strategy_of(2)
    dataset = Dataset.from_tensors(([1.0], [1.0])).repeat(64).batch(16)
    options = mr.data.Options()
    options.experimental_distribute.auto_shard_policy = mr.data.experimental.AutoShardPolicy.DATA
    dataset = dataset.with_options(options)
    assert len(list(strategy.experimental_distribute_dataset(dataset))) == 4

    def dataset_fn(input_context):
        batch_size = input_context.get_per_replica_batch_size(16)
        ds = Dataset.from_tensors(([1.0], [1.0])).repeat(64)
        ds = ds.shard(input_context.num_input_pipelines, input_context.input_pipeline_id)
        return ds.batch(batch_size).prefetch(2)

    batches = list(strategy.distribute_datasets_from_function(dataset_fn))
    assert len(batches) == 4  # 64 / 8 per-replica batches, two per step
    assert [tuple(t.shape) for t in strategy.experimental_local_results(batches[0][0])] == [(8, 1), (8, 1)]


def test_an_iterator_across_epochs_with_next_and_get_next():
    strategy = strategy_of(2)
    dataset = Dataset.from_tensors(([1.0], [1.0])).repeat(100).batch(16)
    dist_dataset = strategy.experimental_distribute_dataset(dataset)
    for _ in range(3):
        dist_iterator = iter(dist_dataset)
        for step in range(5):
            batch = next(dist_iterator) if step % 2 else dist_iterator.get_next()
            loss = strategy.run(train_step, args=(batch,))
            assert all(torch.allclose(t, torch.tensor(0.7)) for t in strategy.experimental_local_results(loss))


def test_get_next_as_optional_ends_the_loop_after_the_last_batch():
    strategy = strategy_of(2)
    dataset = Dataset.range(9).batch(4)
    distributed_iterator = iter(strategy.experimental_distribute_dataset(dataset))
    printed = []
    for _ in range(5):  # steps_per_loop
        optional_data = distributed_iterator.get_next_as_optional()
        if not optional_data.has_value():
            break
        per_replica_results = strategy.run(lambda x: x, args=(optional_data.get_value(),))
        printed.append([t.tolist() for t in strategy.experimental_local_results(per_replica_results)])
    assert printed == [[[0, 1], [2, 3]], [[4, 5], [6, 7]], [[8], []]]  # TF prints the same


def test_element_spec_describes_the_distributed_batches():
    strategy = strategy_of(2)
    dataset = Dataset.from_tensors(([1.0], [1.0])).repeat(100).batch(16)
    dist_dataset = strategy.experimental_distribute_dataset(dataset)
    spec = dist_dataset.element_spec
    part = mr.data.TensorSpec(shape=(None, 1), dtype=torch.float32)
    assert [list(s.values) for s in spec] == [[part, part], [part, part]]


def test_predictions_keep_their_order_through_enumerate():
    strategy = strategy_of(2)
    dataset = Dataset.range(24).enumerate().batch(6)
    result = {}
    for index, inputs in strategy.experimental_distribute_dataset(dataset):
        output_index, outputs = strategy.run(lambda i, x: (i, 2 * x), args=(index, inputs))
        rindices = [int(a) for t in strategy.experimental_local_results(output_index) for a in t.numpy()]
        routputs = [int(a) for t in strategy.experimental_local_results(outputs) for a in t.numpy()]
        result.update(zip(rindices, routputs))
    assert result == {i: 2 * i for i in range(24)}


def test_values_from_a_function_and_a_generator():
    strategy = strategy_of(2)
    distributed_values = strategy.experimental_distribute_values_from_function(
        lambda ctx: torch.tensor(ctx.replica_id_in_sync_group))
    for _ in range(2):
        result = strategy.run(lambda x: x, args=(distributed_values,))
        assert [int(t) for t in strategy.experimental_local_results(result)] == [0, 1]

    rng = np.random.default_rng(0)

    def input_gen():
        while True:
            yield rng.random(4)

    dataset = Dataset.from_generator(input_gen, output_types=torch.float32, output_shapes=[4])
    iterator = iter(strategy.experimental_distribute_dataset(dataset))
    for _ in range(3):
        parts = strategy.experimental_local_results(strategy.run(lambda x: x, args=(next(iterator),)))
        assert [(tuple(t.shape), t.dtype) for t in parts] == [((2,), torch.float32)] * 2
