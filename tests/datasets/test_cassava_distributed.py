"""Issue 5: the TFDS-written Cassava fixture feeds experimental_distribute_dataset on 2 CPU replicas."""
from __future__ import annotations

import json

import torch

import mirrored as mr


def test_fixture_batches_split_across_two_replicas_in_tfds_order(fixtures_dir):
    expected = json.loads((fixtures_dir / "tfds" / "cassava_expected.json").read_text())["splits"]["train"]
    ds = mr.datasets.load("cassava", split="train", data_dir=str(fixtures_dir / "tfds"))
    ds = ds.map(lambda e: {**e, "image": mr.data.images.resize(e["image"], (16, 16)) / 255.0},
                num_parallel_calls=mr.data.AUTOTUNE).batch(6)
    strategy = mr.MirroredStrategy(devices=["cpu:0", "cpu:1"])
    sizes, files, labels = [], [], []
    for batch in strategy.experimental_distribute_dataset(ds):
        parts = strategy.experimental_local_results(batch["image"])
        sizes.append(tuple(len(p) for p in parts))
        assert all(p.shape[1:] == (16, 16, 3) and p.dtype == torch.float32 for p in parts)
        for names, label in zip(strategy.experimental_local_results(batch["image/filename"]),
                                strategy.experimental_local_results(batch["label"])):
            assert len(names) == len(label)
            files += list(names)
            labels += label.tolist()
    assert sizes == [(3, 3), (3, 3), (3, 3), (1, 1)]  # 20 examples by 6: 6, 6, 6, 2, each split ceil(B/2)
    assert files == [r["file"] for r in expected]
    assert labels == [r["label"] for r in expected]
