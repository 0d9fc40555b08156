"""TFRecordDataset and Dataset.list_files (tf.data's file sources), and what distributed input reads of
them: the drawn shuffle seeds a multi-worker strategy replaces, and FILE sharding's copy of a pipeline
(issue 24). Expected orders are written out by hand from tf.data's documented rules."""
from __future__ import annotations

import os

import pytest
import torch

import mirrored as mr
from mirrored.data import Dataset, auto_shard
from mirrored.data.tfrecord import write_records
from mirrored.distribute import _input_workers


@pytest.fixture
def four_files(tmp_path) -> list[str]:
    """train-0..3.tfrecord, file f holding the records b"f-0", b"f-1", b"f-2"."""
    paths = []
    for f in range(4):
        path = tmp_path / f"train-{f}.tfrecord"
        write_records(path, [f"{f}-{i}".encode() for i in range(3)])
        paths.append(str(path))
    return paths


def _records(files: range, per_file: int = 3) -> list[bytes]:
    return [f"{f}-{i}".encode() for f in files for i in range(per_file)]


def test_tfrecord_dataset_reads_files_one_after_another(four_files):
    ds = mr.data.TFRecordDataset(four_files)
    assert list(ds) == _records(range(4))
    assert ds.element_spec == mr.data.TensorSpec((), bytes)
    assert list(mr.data.TFRecordDataset(four_files[2])) == _records(range(2, 3))


def test_tfrecord_dataset_with_parallel_reads_interleaves_record_by_record(four_files):
    """tf.data: num_parallel_reads=N keeps N files open and takes one record from each in turn; a file
    that ends is replaced by the next one."""
    got = list(mr.data.TFRecordDataset(four_files, num_parallel_reads=2))
    want = [f"{f}-{i}".encode() for pair in ((0, 1), (2, 3)) for i in range(3) for f in pair]
    assert got == want


def test_tfrecord_dataset_reads_compressed_files_and_a_dataset_of_names(tmp_path):
    path = tmp_path / "z.tfrecord.gz"
    write_records(path, [b"a", b"bc"], compression_type="GZIP")
    names = Dataset.from_tensor_slices([str(path)])
    assert list(mr.data.TFRecordDataset(names, compression_type="GZIP")) == [b"a", b"bc"]
    with pytest.raises(ValueError, match=r"compression_type='LZ4'.*GZIP"):
        mr.data.TFRecordDataset([str(path)], compression_type="LZ4")
    with pytest.raises(TypeError, match=r"filenames must be a path, a list of paths or a Dataset"):
        mr.data.TFRecordDataset([1, 2])


def test_list_files_sorted_or_shuffled_per_pass_by_its_seed(four_files, tmp_path):
    pattern = str(tmp_path / "train-*.tfrecord")
    assert list(Dataset.list_files(pattern, shuffle=False)) == four_files
    assert list(Dataset.list_files([pattern, four_files[0]], shuffle=False)) == four_files  # each file once
    a, b = Dataset.list_files(pattern, seed=7), Dataset.list_files(pattern, seed=7)
    passes = [list(a) for _ in range(4)]
    assert passes == [list(b) for _ in range(4)]
    assert all(sorted(p) == four_files for p in passes) and len({tuple(p) for p in passes}) > 1
    with pytest.raises(ValueError, match=r"no files match '.*nothing-\*'"):
        Dataset.list_files(str(tmp_path / "nothing-*"))


def test_unseeded_shuffles_are_the_ones_a_strategy_reseeds(four_files, tmp_path):
    """Issue 24: drawn seeds (seed=None, list_files' shuffle) are listed and replaced, the outermost first;
    given ones are not. Replaced seeds give the order of shuffles built with those seeds."""
    pattern = str(tmp_path / "train-*.tfrecord")
    ds = mr.data.TFRecordDataset(Dataset.list_files(pattern)).shuffle(12, seed=5).shuffle(12)
    assert len(auto_shard.drawn_seeds(ds)) == 2
    auto_shard.set_drawn_seeds(ds, [11, 12])
    assert auto_shard.drawn_seeds(ds) == [11, 12]
    reference = mr.data.TFRecordDataset(Dataset.list_files(pattern, seed=12)).shuffle(12, seed=5).shuffle(12, seed=11)
    assert list(ds) == list(reference)


def test_file_sharding_gives_each_worker_every_second_file_and_leaves_the_dataset(four_files, tmp_path):
    files = Dataset.list_files(str(tmp_path / "train-*.tfrecord"), shuffle=False)
    ds = mr.data.TFRecordDataset(files).cache().batch(4)
    assert sum(list(ds), []) == _records(range(4))  # (the memory cache is full now)
    parts = [auto_shard.shard_files(ds, 2, w) for w in range(2)]
    assert [sum(part, []) for part in map(list, parts)] == [_records((0, 2)), _records((1, 3))]
    assert sum(list(ds), []) == _records(range(4))  # the dataset itself still reads every file
    assert auto_shard.describe_files(auto_shard.file_sources(ds)) == "4 files"


def test_shard_hint_keeps_everything_until_hint_sharding_fills_it_in():
    """tf.data's shard(SHARD_HINT, SHARD_HINT): a placeholder; HINT auto-sharding makes it shard(W, rank)."""
    hint = mr.data.experimental.SHARD_HINT
    ds = Dataset.range(10).shard(hint, hint).batch(2)
    assert [t.tolist() for t in ds] == [[0, 1], [2, 3], [4, 5], [6, 7], [8, 9]]
    assert len(auto_shard.hint_shards(ds)) == 1
    parts = [[t.tolist() for t in auto_shard.fill_hints(ds, 2, w)] for w in range(2)]
    assert parts == [[[0, 2], [4, 6], [8]], [[1, 3], [5, 7], [9]]]
    assert [t.tolist() for t in ds] == [[0, 1], [2, 3], [4, 5], [6, 7], [8, 9]]  # (the dataset itself is unchanged)


def test_tfds_shards_are_a_file_source(fixtures_dir):
    """tfds.load's shards are what FILE sharding divides (TFDS' own shards, as TF's auto-shard sees them)."""
    directory = fixtures_dir / "tfds"
    if not directory.is_dir():
        pytest.skip("no TFDS fixture")
    ds = mr.datasets.load(next(p.name for p in directory.iterdir() if p.is_dir()), split="train",
                          data_dir=str(directory))
    assert [s.what for s in auto_shard.file_sources(ds)] == ["shard"]


def test_digest_of_a_batch_sees_its_labels_not_float_noise():
    x, y = torch.randn(8, 3), torch.arange(8)
    digest = _input_workers.batch_digest((x, y))
    assert _input_workers.batch_digest((x + 0.5, y)) == digest  # an augmentation of the inputs
    assert _input_workers.batch_digest((x, y.flip(0))) != digest  # other examples, or another order
    assert _input_workers.batch_digest(x) != _input_workers.batch_digest(x.flip(0))  # no labels: every leaf
    assert _input_workers.batch_digest((x[:4], y[:4])) != digest
    assert _input_workers.batch_digest((x, ["a"] * 8)) != _input_workers.batch_digest((x, ["b"] * 8))
    assert os.environ.get("RANK") is None  # (these run in one process)
