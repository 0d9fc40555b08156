"""Conformance: CrossDeviceOps.reduce / batch_reduce / broadcast.

Sources (tensorflow/python/distribute/): cross_device_ops_test.py (testReduceDense, testBatchReduceDense:
per-replica inputs 1.0, 2.0, ... reduce to their SUM / MEAN on every destination device, a Mirrored
when there are several), cross_device_ops.py (CrossDeviceOps.reduce validates and takes the one-replica
shortcut; ReductionToOneDevice, HierarchicalCopyAllReduce), distribute_lib_test.py (string ops).
"""
from __future__ import annotations

import pytest
import torch

import mirrored.distribute as md

OPS = [md.ReductionToOneDevice, md.HierarchicalCopyAllReduce, md.InMemoryAllReduce]


def per_replica(n: int, fn) -> md.PerReplica:
    return md.PerReplica([fn(r) for r in range(n)])


@pytest.mark.parametrize("ops_cls", OPS)
def test_reduce_dense(ops_cls):
    """testReduceDense: replica r holds r + 1; on 1..4 replicas every destination gets the SUM
    (n(n+1)/2) or the MEAN ((n+1)/2), as a Mirrored with one value per destination. The results do
    not alias the inputs or each other; a single device string as destination gives one value."""
    for n in (1, 2, 3, 4):
        value = per_replica(n, lambda r: torch.tensor([float(r + 1)] * 3))
        for op, want in ((md.ReduceOp.SUM, n * (n + 1) / 2), (md.ReduceOp.MEAN, (n + 1) / 2)):
            out = ops_cls().reduce(op, value, destinations=value)
            assert isinstance(out, md.Mirrored) and len(out.values) == n
            for t in out.values:
                assert t.tolist() == [want] * 3, (n, op)
    value = per_replica(3, lambda r: torch.ones(4))
    out = ops_cls().reduce(md.ReduceOp.SUM, value, destinations=value)
    out.values[0].add_(100)
    assert out.values[1].tolist() == [3.0] * 4 and value.values[0].tolist() == [1.0] * 4
    value = per_replica(2, lambda r: torch.tensor(float(r + 1)))
    out = ops_cls().reduce(md.ReduceOp.SUM, value, destinations="/device:CPU:0")
    assert len(out.values) == 1 and out.values[0].item() == 3.0


@pytest.mark.parametrize("ops_cls", OPS)
def test_batch_reduce_dense(ops_cls):
    """testBatchReduceDense: several (value, destinations) pairs reduce at once, each to its own result."""
    n = 3
    a = per_replica(n, lambda r: torch.tensor(float(r)))
    b = per_replica(n, lambda r: torch.full((2, 2), float(10 * r)))
    out = ops_cls(bytes_per_pack=8).batch_reduce("sum", [(a, a), (b, b)])  # tiny packs: several buckets
    assert [t.item() for t in out[0].values] == [3.0] * n
    assert all(t.tolist() == [[30.0, 30.0], [30.0, 30.0]] for t in out[1].values)


def test_broadcast_copies_to_every_destination():
    """CrossDeviceOps.broadcast: a copy of the tensor on each destination device (a Mirrored)."""
    t = torch.tensor([1.0, 2.0])
    out = md.ReductionToOneDevice().broadcast(t, ["cpu:0", "cpu:1"])
    assert isinstance(out, md.Mirrored) and [v.tolist() for v in out.values] == [[1.0, 2.0]] * 2
    assert out.values[0].data_ptr() != t.data_ptr()
