"""reducer.py and _sparse.py: sparse gradients (issue 36) meet like dense ones.

nn.Embedding(sparse=True) and nn.EmbeddingBag(sparse=True) give torch.sparse_coo gradients; the
reducer sums them apart from the buckets, gathered or densified, into the coalesced sum that names
every row some replica's gradient named. Each run is checked against the same loop on one device
(plain PyTorch, the whole global batch) and the replicas against each other bit for bit.
Tolerance: 1e-6 absolute on weights of order 0.1 to 1 - the replicas' partial sums of a row add in
another order than one device's (measured at most 4.8e-7 after these 6 steps, 4 replicas).
The multi-worker runs are in test_multi_worker.py.
"""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import mirrored as mr
import mirrored.distribute as md
from mirrored.distribute import _sparse

TIMEOUT_S = 20.0
ATOL = 1e-6
WORDS, CLASSES = 40, 3

pytestmark = pytest.mark.filterwarnings("ignore:Sparse invariant checks:UserWarning")


def strategy_of(n: int) -> md.MirroredStrategy:
    return md.MirroredStrategy(devices=[f"cpu:{i}" for i in range(n)], timeout_s=TIMEOUT_S)


class Recommender(nn.Module):
    """A sparse embedding and a sparse bag of context words (`tables`), and a dense head (a mixed model)
    or none; called on (item ids, context ids), as fit passes what the data yields."""

    def __init__(self, dense_head: bool = True):
        super().__init__()
        torch.manual_seed(0)
        self.tables = nn.ModuleDict({"item": nn.Embedding(WORDS, 6, sparse=True),
                                     "context": nn.EmbeddingBag(WORDS, 6, sparse=True, mode="mean")})
        self.head = nn.Linear(6, CLASSES) if dense_head else None

    def forward(self, x: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        item, context = x
        h = self.tables["item"](item) * self.tables["context"](context)
        return self.head(h) if self.head is not None else h[:, :CLASSES]


def data(n: int = 22) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return (torch.randint(0, WORDS, (n,), generator=g), torch.randint(0, WORDS, (n, 4), generator=g),
            torch.randint(0, CLASSES, (n,), generator=g))


def global_batches(n: int = 22, size: int = 8) -> list[tuple[torch.Tensor, ...]]:
    """22 by 8: the last batch is 6 (3/3 on 2 replicas, 2/2/2 on 3); 17 by 8 ends with 1 (1/0, 1/0/0)."""
    item, context, y = data(n)
    return [(item[i:i + size], context[i:i + size], y[i:i + size]) for i in range(0, n, size)]


def loss_of(out: torch.Tensor, y: torch.Tensor, reduction: str, global_size: int) -> torch.Tensor:
    if reduction == "mean":
        return F.cross_entropy(out, y)  # DDP's unchanged line: the optimizer averages, weighted by examples
    return F.cross_entropy(out, y, reduction="sum") / global_size  # TF's: scaled by the GLOBAL batch


def one_device(make_optimizers, batches, epochs: int = 2, clip=None) -> nn.Module:
    net = Recommender(dense_head=make_optimizers is not _sparse_adam_only)
    optimizers = make_optimizers(net)
    for _ in range(epochs):
        for item, context, y in batches:
            for opt in optimizers:
                opt.zero_grad()
            F.cross_entropy(net((item, context)), y).backward()
            if clip is not None:
                clip(net)
            for opt in optimizers:
                opt.step()
    return net


def mirrored(replicas: int, make_optimizers, batches, reduction: str, epochs: int = 2,
             reduce_in_backward: bool | None = None) -> tuple[md.MirroredStrategy, md.MirroredModule, list]:
    strategy = strategy_of(replicas)
    with strategy.scope():
        mnet = strategy.mirror(Recommender(dense_head=make_optimizers is not _sparse_adam_only))
        optimizers = make_optimizers(mnet, strategy=strategy, reduction=reduction,
                                     reduce_in_backward=reduce_in_backward)

    def step(item, context, y, global_size):
        for opt in optimizers:
            opt.zero_grad()
        loss_of(mnet((item, context)), y, reduction, global_size).backward()
        for opt in optimizers:
            opt.step()

    for _ in range(epochs):
        for batch in batches:
            parts = next(iter(strategy.experimental_distribute_dataset([batch])))
            strategy.run(step, args=(*parts, len(batch[0])))
    return strategy, mnet, optimizers


def _build(cls, module, strategy=None, reduction="sum", reduce_in_backward=None, **hparams):
    if strategy is None:
        return cls(module.parameters(), **hparams)
    return strategy.mirror_optimizer(cls, module, gradient_reduction=reduction, reduce_in_backward=reduce_in_backward,
                                     **hparams)


def _sgd(net, **kw):
    return [_build(torch.optim.SGD, net, lr=0.5, **kw)]


def _sgd_momentum(net, **kw):
    """SGD's momentum buffer of a sparse gradient is itself a sparse tensor, which check_in_sync compares."""
    return [_build(torch.optim.SGD, net, lr=0.3, momentum=0.9, **kw)]


def _adagrad(net, **kw):
    return [_build(torch.optim.Adagrad, net, lr=0.3, **kw)]


def _sparse_adam_and_adam(net, **kw):
    """SparseAdam for the embeddings, Adam for the dense head: the usual recipe of a mixed model (a
    submodule of a mirrored module is mirrored: each optimizer gets its part of every copy)."""
    return [_build(torch.optim.SparseAdam, net.tables, lr=0.05, **kw),
            _build(torch.optim.Adam, net.head, lr=0.05, **kw)]


def _sparse_adam_only(net, **kw):
    return [_build(torch.optim.SparseAdam, net, lr=0.05, **kw)]


OPTIMIZERS = {"SGD": _sgd, "SGD momentum": _sgd_momentum, "Adagrad": _adagrad,
              "SparseAdam + Adam": _sparse_adam_and_adam, "SparseAdam": _sparse_adam_only}


def assert_one_device(mnet: md.MirroredModule, ref: nn.Module, strategy: md.MirroredStrategy, optimizers) -> None:
    for (name, want), got in zip(ref.named_parameters(), mnet.values[-1].parameters()):
        torch.testing.assert_close(got, want, rtol=0, atol=ATOL, msg=lambda m: f"{name}: {m}")
    strategy.check_in_sync(mnet)  # every replica bit for bit
    for opt in optimizers:
        strategy.check_in_sync(opt)


@pytest.mark.parametrize("replicas", [1, 2, 3])
@pytest.mark.parametrize("reduction", ["sum", "mean"])
@pytest.mark.parametrize("optimizer", list(OPTIMIZERS))
def test_sparse_gradients_train_as_one_device(replicas, reduction, optimizer):
    batches = global_batches()
    ref = one_device(OPTIMIZERS[optimizer], batches)
    strategy, mnet, optimizers = mirrored(replicas, OPTIMIZERS[optimizer], batches, reduction)
    assert_one_device(mnet, ref, strategy, optimizers)


def test_check_in_sync_names_a_sparse_momentum_buffer_that_differs_between_replicas():
    strategy, mnet, (opt,) = mirrored(2, _sgd_momentum, global_batches(), "mean")
    strategy.check_in_sync(opt)  # equal after training (the test above compares with one device)
    table = mnet.values[1].tables["item"].weight
    buf = opt.replicas[1].state[table]["momentum_buffer"]
    assert buf.is_sparse
    values = buf.coalesce().values().clone()
    values[0, 0] = torch.nextafter(values[0, 0], torch.tensor(float("inf")))  # one ulp on replica 1
    opt.replicas[1].state[table]["momentum_buffer"] = torch.sparse_coo_tensor(buf.coalesce().indices(), values,
                                                                              buf.shape).coalesce()
    with pytest.raises(md.OutOfSyncError, match=r"momentum_buffer.*replica 0 and replica 1.*max abs difference"):
        strategy.check_in_sync(opt)


def test_a_sparse_tensors_checksum_is_that_of_its_coalesced_rows():
    """What check_in_sync compares across workers: equal for the same rows however they are stored
    (uncoalesced, repeats), different for one ulp of one value."""
    from mirrored.distribute._collectives import _value_digest

    i = torch.tensor([[3, 1, 3]])
    v = torch.tensor([[1.0, 2.0], [0.5, 0.5], [0.25, 0.5]])
    coalesced = torch.sparse_coo_tensor(i, v, (5, 2)).coalesce()
    assert _value_digest(torch.sparse_coo_tensor(i, v, (5, 2))) == _value_digest(coalesced)
    nudged = coalesced.values().clone()
    nudged[0, 0] = torch.nextafter(nudged[0, 0], torch.tensor(float("inf")))
    assert _value_digest(torch.sparse_coo_tensor(coalesced.indices(), nudged, (5, 2))) != _value_digest(coalesced)


@pytest.mark.parametrize("mode", ["gathered", "densified"])
@pytest.mark.parametrize("replicas", [2, 3])
def test_both_ways_of_summing_give_one_devices_update(monkeypatch, mode, replicas):
    """The rule picks one way by size; both must give the same sum (rows included), each forced here.
    An uneven last batch of 1 (1/0, 1/0/0) leaves replicas without any sparse gradient."""
    monkeypatch.setattr(_sparse, "_THREADS_DENSIFY_AT", 0.0 if mode == "densified" else float("inf"))
    batches = global_batches(n=17)
    ref = one_device(_sparse_adam_and_adam, batches)
    strategy, mnet, optimizers = mirrored(replicas, _sparse_adam_and_adam, batches, "mean", reduce_in_backward=False)
    assert_one_device(mnet, ref, strategy, optimizers)


def test_the_rule_chooses_by_the_rows_gathered_against_the_tables_rows():
    rows = 10_000
    for across_workers, at in ((False, _sparse._THREADS_DENSIFY_AT), (True, _sparse._WORKERS_DENSIFY_AT)):
        assert not _sparse.densify(0, rows, across_workers)
        assert not _sparse.densify(int(rows * at), rows, across_workers)
        assert _sparse.densify(int(rows * at) + 1, rows, across_workers)
    assert _sparse.table_rows((5, 7, 3), 2) == 35


@pytest.mark.parametrize("parts", [[(0, 1, 1), (1, 3)], [(2,), ()], [(), (4, 4)]])
@pytest.mark.parametrize("densify", [False, True])
def test_a_sum_names_exactly_the_rows_some_part_named(monkeypatch, parts, densify):
    """SparseAdam moves every row a gradient names, a zero one too: the sum names their union (a row
    whose values cancel stays; one nobody named stays out), coalesced, as one device's gradient.
    Checked on a 2-d sparse index too (sparse_dim 2)."""
    monkeypatch.setattr(_sparse, "_THREADS_DENSIFY_AT", 0.0 if densify else float("inf"))
    tensors = []
    for k, rows in enumerate(parts):
        idx = torch.tensor([list(rows)], dtype=torch.int64).view(1, -1)
        values = torch.full((len(rows), 2), 1.0 if k == 0 else -1.0)
        tensors.append(torch.sparse_coo_tensor(idx, values, (6, 2), check_invariants=False))
    total = _sparse.local_sum(tensors, torch.device("cpu"))
    want = torch.sparse_coo_tensor(torch.cat([t._indices() for t in tensors], 1),
                                   torch.cat([t._values() for t in tensors]), (6, 2)).coalesce()
    assert total.is_coalesced() and torch.equal(total.indices(), want.indices())
    assert torch.equal(total.values(), want.values())
    assert all(total is not t for t in tensors)  # a new tensor: every replica gets its own
    two_d = [torch.sparse_coo_tensor(torch.tensor([[0, 2], [1, 1]]), torch.ones(2, 3), (3, 2, 3)),
             torch.sparse_coo_tensor(torch.tensor([[2], [1]]), torch.ones(1, 3), (3, 2, 3))]
    summed = _sparse.local_sum(two_d, torch.device("cpu"))
    torch.testing.assert_close(summed.to_dense(), two_d[0].to_dense() + two_d[1].to_dense(), rtol=0, atol=0)
    assert summed.indices().tolist() == [[0, 2], [1, 1]]


def test_a_gradient_sparse_on_some_replicas_and_dense_on_others_sums_dense():
    """A table read through a sparse lookup on replica 0 and by plain indexing (a dense gradient) on
    replica 1: the sum is dense, the one-device gradient of both reads."""
    strategy = strategy_of(2)
    torch.manual_seed(0)
    table = nn.Embedding(10, 3)
    ref = copy.deepcopy(table)
    (F.embedding(torch.tensor([1, 2, 2]), ref.weight, sparse=True).sum() + ref.weight[torch.tensor([2, 7])].sum()
     ).backward()
    with strategy.scope():
        mtable = strategy.mirror(copy.deepcopy(table))
        opt = strategy.mirror_optimizer(torch.optim.SGD, mtable, lr=1.0)

    def step():
        weight = mtable.module.weight
        if md.get_replica_context().replica_id_in_sync_group == 0:
            F.embedding(torch.tensor([1, 2, 2]), weight, sparse=True).sum().backward()
        else:
            weight[torch.tensor([2, 7])].sum().backward()
        opt.reduce_gradients()
        return weight.grad

    for grad in strategy.run(step).values:
        assert not grad.is_sparse
        torch.testing.assert_close(grad, ref.weight.grad.to_dense(), rtol=0, atol=0)


def test_a_step_that_fails_after_backward_puts_the_sparse_gradients_back():
    """The journal notes sparse gradients as it notes dense ones: a failed step leaves none behind, and
    the next step (which no_sync accumulates into) gives one device's update."""
    batches = global_batches(n=16)
    ref = one_device(_adagrad, batches[:1], epochs=1)
    strategy = strategy_of(2)
    with strategy.scope():
        mnet = strategy.mirror(Recommender())
        (opt,) = _adagrad(mnet, strategy=strategy)

    def step(item, context, y, fail):
        F.cross_entropy(mnet((item, context)), y, reduction="sum").div(8).backward()
        if fail:
            raise ValueError("boom after backward")
        opt.step()

    parts = next(iter(strategy.experimental_distribute_dataset(batches[:1])))
    with pytest.raises(ValueError, match="boom after backward"):
        strategy.run(step, args=(*parts, True))
    assert all(p.grad is None for m in mnet.values for p in m.parameters())
    with opt.no_sync():  # a sparse gradient kept locally, then a failed step on top of it
        strategy.run(lambda *a: F.cross_entropy(mnet(a[:2]), a[2], reduction="sum").div(8).backward(), args=parts)
    kept = [p.grad.coalesce() if p.grad.is_sparse else p.grad.clone() for p in mnet.values[0].parameters()]
    with pytest.raises(ValueError, match="boom after backward"):
        strategy.run(step, args=(*parts, True))
    for p, k in zip(mnet.values[0].parameters(), kept):
        g = p.grad.coalesce() if p.grad.is_sparse else p.grad
        assert g.is_sparse == k.is_sparse and torch.equal(g.to_dense(), k.to_dense())
    mnet.zero_grad()
    strategy.run(step, args=(*parts, False))
    assert_one_device(mnet, ref, strategy, [opt])


@pytest.mark.parametrize("replicas", [1, 2, 3])
@pytest.mark.parametrize("option, value", [("clipnorm", 0.05), ("global_clipnorm", 0.05), ("clipvalue", 0.01)])
def test_keras_clipping_acts_on_sparse_gradients_as_on_their_dense_form(replicas, option, value):
    """mr.optimizers' clipnorm / global_clipnorm / clipvalue on the reduced gradients: a sparse one
    counts its rows as its dense form would (duplicates summed first). Reference: plain torch, the
    gradient densified, clipped, made sparse again at the same rows. fit averages the replicas'
    gradients weighted by their rows (n_r g_r summed, then divided): on 3 replicas that rounds a few
    ulps off one device's, 5e-7 relative measured on weights near 2, hence rtol 1e-6 beside atol."""
    batches = global_batches()

    def clip(net):
        dense = [p.grad.coalesce() if p.grad.is_sparse else p.grad for p in net.parameters()]
        values = [g.values() if g.is_sparse else g for g in dense]
        if option == "clipnorm":
            for v in values:
                v.mul_(value / torch.linalg.vector_norm(v).clamp(min=value))
        elif option == "global_clipnorm":
            norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(v) for v in values]))
            for v in values:
                v.mul_((value / norm).clamp(max=1.0))
        else:
            for v in values:
                v.clamp_(-value, value)
        for p, g in zip(net.parameters(), dense):
            p.grad = g

    ref = one_device(_adagrad, batches, clip=clip)
    strategy = strategy_of(replicas)
    with strategy.scope():
        model = mr.Model(Recommender())
        model.compile(optimizer=mr.optimizers.Optimizer(torch.optim.Adagrad, 0.3, **{option: value}),
                      loss="sparse_categorical_crossentropy")
    item, context, y = data()
    model.fit(mr.data.Dataset.from_tensor_slices(((item, context), y)).batch(8), epochs=2, verbose=0)
    for (name, want), got in zip(ref.named_parameters(), model.replicas[-1].parameters()):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=ATOL, msg=lambda m: f"{name}: {m}")
    model.check_in_sync()


def test_torch_clip_grad_norm_refuses_sparse_gradients_as_on_one_device():
    """torch's clip_grad_norm_ has no sparse kernel (its NotImplementedError names
    aten::linalg_vector_norm and SparseCPU) on one device as here: the error reaches the caller naming
    the replica, and the step leaves no trace."""
    net = Recommender()
    F.cross_entropy(net(data()[:2]), data()[2]).backward()
    with pytest.raises(NotImplementedError, match="linalg_vector_norm.*Sparse"):
        torch.nn.utils.clip_grad_norm_(net.parameters(), 1.0)
    strategy = strategy_of(2)
    with strategy.scope():
        mnet = strategy.mirror(Recommender())
        (opt,) = _sgd(mnet, strategy=strategy, reduction="mean")

    def step(item, context, y):
        F.cross_entropy(mnet((item, context)), y).backward()  # reduced as backward ends ("mean")
        torch.nn.utils.clip_grad_norm_(mnet.parameters(), 1.0)
        opt.step()

    parts = next(iter(strategy.experimental_distribute_dataset(global_batches()[:1])))
    with pytest.raises(NotImplementedError, match=r"replica \d \(cpu:\d\): .*linalg_vector_norm.*Sparse"):
        strategy.run(step, args=parts)
    assert all(p.grad is None for m in mnet.values for p in m.parameters())


@pytest.mark.parametrize("replicas", [1, 2, 3])
@pytest.mark.parametrize("optimizer", ["SparseAdam", "Adagrad"])
def test_fit_trains_a_sparse_model_with_a_torch_optimizer_class(replicas, optimizer):
    """model.compile(optimizer=torch.optim.SparseAdam): a bag-of-words classifier whose only layer is a
    sparse EmbeddingBag (SparseAdam takes sparse gradients only), and a mixed one with Adagrad."""
    cls = getattr(torch.optim, optimizer)
    torch.manual_seed(0)
    if optimizer == "SparseAdam":
        net = nn.EmbeddingBag(WORDS, CLASSES, sparse=True, mode="mean")
    else:
        net = nn.Sequential(nn.EmbeddingBag(WORDS, 6, sparse=True, mode="mean"), nn.Linear(6, CLASSES))
    _, context, y = data()
    ref = copy.deepcopy(net)
    ref_opt = cls(ref.parameters())  # torch's defaults, which compile() takes for a class
    for _ in range(2):
        for i in range(0, len(y), 8):
            ref_opt.zero_grad()
            F.cross_entropy(ref(context[i:i + 8]), y[i:i + 8]).backward()
            ref_opt.step()
    strategy = strategy_of(replicas) if replicas > 1 else md.OneDeviceStrategy("cpu:0")
    with strategy.scope():
        model = mr.Model(copy.deepcopy(net))
        model.compile(optimizer=cls, loss="sparse_categorical_crossentropy")
    model.fit(mr.data.Dataset.from_tensor_slices((context, y)).batch(8), epochs=2, verbose=0)
    for (name, want), got in zip(ref.named_parameters(), model.replicas[-1].parameters()):
        torch.testing.assert_close(got, want, rtol=0, atol=ATOL, msg=lambda m: f"{name}: {m}")
    model.check_in_sync()
