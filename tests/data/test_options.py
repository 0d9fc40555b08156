"""mr.data.Options, Dataset.with_options/options(), from_generator's output_types/output_shapes/args,
mr.data.experimental: tf.data's names, and a clear error for what has no counterpart here."""
from __future__ import annotations

import types

import numpy as np
import pytest
import torch

import mirrored as mr
from mirrored.data import Dataset, Options, TensorSpec
from mirrored.data.experimental import AutoShardPolicy
from mirrored.distribute import _input_workers


def test_options_merge_downstream_values_over_upstream_ones_and_survive_transformations():
    first, second = Options(), Options()
    first.deterministic = False
    first.experimental_distribute.auto_shard_policy = AutoShardPolicy.OFF
    second.experimental_distribute.auto_shard_policy = AutoShardPolicy.DATA
    second.threading.private_threadpool_size = 4
    ds = Dataset.range(10).with_options(first).map(lambda x: x * 2).with_options(second).batch(3)
    got = ds.options()
    assert got.deterministic is False  # set upstream only: kept
    assert got.experimental_distribute.auto_shard_policy is AutoShardPolicy.DATA  # set later: wins
    assert got.threading.private_threadpool_size == 4
    assert Dataset.range(3).options() == Options()  # nothing set
    assert first.experimental_distribute.auto_shard_policy is AutoShardPolicy.OFF  # merging copies
    # The elements pass unchanged, and so do cardinality and the spec.
    assert [t.tolist() for t in ds] == [[0, 2, 4], [6, 8, 10], [12, 14, 16], [18]]
    assert ds.cardinality() == 4 and ds.element_spec == TensorSpec(shape=(None,), dtype=torch.int64)


def test_deterministic_false_keeps_the_order_tf_allows():
    options = Options()
    options.deterministic = False
    ds = Dataset.range(50).map(lambda x: x + 1, num_parallel_calls=4).with_options(options)
    assert [int(x) for x in ds] == list(range(1, 51))


@pytest.mark.parametrize("line, error, message", [
    ("o.experimental_optimization = 1", AttributeError, r"no option 'experimental_optimization'.*remove the line"),
    ("o.autotune = 1", AttributeError, r"supported: deterministic, experimental_distribute, threading"),
    ("o.threading.private_threadpool_size = -1", ValueError, r"private_threadpool_size must be an int >= 0"),
    ("o.threading.max_intra_op_parallelism = 1.5", ValueError, r"max_intra_op_parallelism must be an int"),
    ("o.experimental_distribute.auto_shard_policy = 7", ValueError, r"7 is not an AutoShardPolicy.*OFF, AUTO"),
    ("o.experimental_distribute.num_devices = 2", AttributeError, r"no option 'num_devices'"),
    ("o.deterministic = 'yes'", TypeError, r"deterministic must be a bool"),
    ("o.threading = 3", AttributeError, r"threading is a group of options"),
    ("ds.with_options({'deterministic': True})", TypeError, r"expected mr.data.Options, got dict"),
    ("o.merge(3)", TypeError, r"expected mr.data.Options, got int"),
])
def test_options_without_a_counterpart_or_bad_values_are_refused_by_name(line, error, message):
    scope = {"o": Options(), "ds": Dataset.range(3)}
    with pytest.raises(error, match=message):
        exec(line, scope)


def test_from_generator_with_output_types_shapes_and_args_as_tf_data():
    def gen(n, scale):
        for i in range(n):
            yield np.full(4, i * scale, dtype=np.float64), i

    ds = Dataset.from_generator(gen, (torch.float32, torch.int64), ([4], []), args=(3, 0.5))
    assert ds.element_spec == (TensorSpec(shape=(4,), dtype=torch.float32), TensorSpec(shape=(), dtype=torch.int64))
    x, y = zip(*ds)
    assert [t.dtype for t in x] == [torch.float32] * 3 and [int(t) for t in y] == [0, 1, 2]
    assert x[2].tolist() == [1.0] * 4
    # Types alone: shapes unknown, read off each element.
    only_types = Dataset.from_generator(lambda: iter([np.zeros(2), np.zeros(3)]), output_types=torch.float32)
    assert [tuple(t.shape) for t in only_types] == [(2,), (3,)]
    # A declared shape is enforced, as output_signature's is.
    wrong = Dataset.from_generator(lambda: iter([np.zeros(3)]), output_types=torch.float32, output_shapes=[4])
    with pytest.raises(ValueError, match=r"element 0.*has shape \(3,\)"):
        list(wrong)


@pytest.mark.parametrize("kwargs, error, message", [
    ({"output_shapes": [4]}, TypeError, r"output_shapes needs output_types"),
    ({"output_types": "float32"}, TypeError, r"output_types must be a structure of torch dtypes"),
    ({"output_types": (torch.float32, torch.int64), "output_shapes": ([4],)}, ValueError,
     r"does not have the structure of output_types"),
    ({"output_types": torch.float32, "output_shapes": ["a"]}, TypeError, r"entry \['a'\] is not a shape"),
    ({"output_types": torch.float32, "output_signature": TensorSpec((4,), torch.float32)}, TypeError, r"not both"),
    ({"args": 3}, TypeError, r"args must be a tuple"),
])
def test_from_generator_refuses_inconsistent_declarations(kwargs, error, message):
    with pytest.raises(error, match=message):
        Dataset.from_generator(lambda *a: iter([]), **kwargs)


def test_the_experimental_namespace_keeps_tf_data_experimental_names():
    assert mr.data.experimental.AUTOTUNE == mr.data.AUTOTUNE
    assert mr.data.experimental.INFINITE_CARDINALITY == mr.data.INFINITE_CARDINALITY == -1
    assert mr.data.experimental.UNKNOWN_CARDINALITY == mr.data.UNKNOWN_CARDINALITY == -2
    assert mr.data.experimental.cardinality(Dataset.range(7).batch(2)) == 4
    assert mr.data.experimental.cardinality(Dataset.range(7).repeat()) == mr.data.INFINITE_CARDINALITY
    assert [p.value for p in AutoShardPolicy] == [-1, 0, 1, 2, 3]  # tf.data.experimental.AutoShardPolicy's
    with pytest.raises(TypeError, match="expected an mr.data.Dataset, got list"):
        mr.data.experimental.cardinality([1, 2])


def _fake_strategy(replicas: int, local: int) -> object:
    """What _shard_policy reads of a strategy: `replicas` in sync, `local` of them in this process."""
    return types.SimpleNamespace(num_replicas_in_sync=replicas, num_workers=replicas // local,
                                 extended=types.SimpleNamespace(worker_devices=[f"cpu:{i}" for i in range(local)]))


def _with_policy(ds: Dataset, policy: AutoShardPolicy) -> Dataset:
    options = Options()
    options.experimental_distribute.auto_shard_policy = policy
    return ds.with_options(options)


@pytest.mark.parametrize("policy", list(AutoShardPolicy))
def test_one_worker_accepts_every_shard_policy_as_tf_ignores_them(policy):
    ds = _with_policy(Dataset.range(8).batch(4), policy)
    assert _input_workers.shard_policy(_fake_strategy(2, 2), ds) == "DATA"  # one process, two replicas
    strategy = mr.MirroredStrategy(devices=["cpu:0", "cpu:1"])
    first = next(iter(strategy.experimental_distribute_dataset(ds)))
    assert [t.tolist() for t in strategy.experimental_local_results(first)] == [[0, 1], [2, 3]]


def _files(tmp_path, count: int) -> Dataset:
    for i in range(count):
        mr.data.tfrecord.write_records(tmp_path / f"part-{i}.tfrecord", [b"x"])
    return mr.data.TFRecordDataset(Dataset.list_files(str(tmp_path / "part-*.tfrecord"), seed=0))


@pytest.mark.parametrize("policy, files, resolved", [
    (AutoShardPolicy.AUTO, 0, "DATA"), (AutoShardPolicy.AUTO, 1, "DATA"), (AutoShardPolicy.AUTO, 2, "FILE"),
    (AutoShardPolicy.DATA, 4, "DATA"), (AutoShardPolicy.OFF, 4, "OFF"), (AutoShardPolicy.FILE, 3, "FILE")])
def test_several_workers_resolve_the_policy_as_tf(tmp_path, policy, files, resolved):
    """Issue 24: as TF's auto_shard, AUTO is FILE where there is at least one file per worker, else DATA."""
    ds = _files(tmp_path, files) if files else Dataset.range(8)
    assert _input_workers.shard_policy(_fake_strategy(2, 1), _with_policy(ds.batch(4), policy)) == resolved


def test_impossible_file_sharding_names_both_counts_and_hint_needs_a_placeholder(tmp_path):
    two_workers = _fake_strategy(2, 1)
    with pytest.raises(ValueError, match=r"reads 1 file for 2 workers, not enough for the required 2 shards"):
        _input_workers.shard_policy(two_workers, _with_policy(_files(tmp_path, 1), AutoShardPolicy.FILE))
    with pytest.raises(ValueError, match=r"reads none: found an unshardable source dataset.*AutoShardPolicy.DATA"):
        _input_workers.shard_policy(two_workers, _with_policy(Dataset.range(8), AutoShardPolicy.FILE))
    with pytest.raises(ValueError, match=r"HINT shards where the pipeline calls shard\(SHARD_HINT, SHARD_HINT\), "
                                         r"but .* has no such call, so each of the 2 workers would read all of it"):
        _input_workers.shard_policy(two_workers, _with_policy(Dataset.range(8), AutoShardPolicy.HINT))
    hinted = Dataset.range(8).shard(mr.data.experimental.SHARD_HINT, mr.data.experimental.SHARD_HINT)
    assert _input_workers.shard_policy(two_workers, _with_policy(hinted, AutoShardPolicy.HINT)) == "HINT"


def test_distributed_element_spec_describes_each_replicas_part():
    strategy = mr.MirroredStrategy(devices=["cpu:0", "cpu:1"])
    ds = Dataset.from_tensors(([1.0], [1.0])).repeat(10).batch(4)
    spec = strategy.experimental_distribute_dataset(ds).element_spec
    part = TensorSpec(shape=(None, 1), dtype=torch.float32)
    assert all(isinstance(s, mr.distribute.PerReplica) for s in spec)
    assert [list(s.values) for s in spec] == [[part, part], [part, part]]
    one = mr.MirroredStrategy(devices=["cpu:0"])
    assert one.experimental_distribute_dataset(ds).element_spec == (part, part)
    with pytest.raises(TypeError, match=r"\(list\) does not describe its elements"):
        strategy.experimental_distribute_dataset([torch.zeros(4)]).element_spec
