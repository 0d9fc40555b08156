"""What the overhead work of issue 27 must not change: fit on a README-style pipeline, which fit now
reads one batch ahead on a thread (Dataset.prefetch(1)), trains to the bits of a plain PyTorch loop on
one replica and of fit over the same batches read without it on two; a pipeline that prefetches already
is left as it is."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from _plain_replicas import batchnorm_data, replicas_by_hand  # tests/training/_plain_replicas.py

import mirrored as mr
from mirrored.training import data_adapter
from _replicas import strategy_of  # tests/_replicas.py

N_EXAMPLES, GLOBAL_BATCH, EPOCHS = 20, 8, 2  # batches 8, 8, 4


def _data():
    g = torch.Generator().manual_seed(5)
    return torch.randn(N_EXAMPLES, 6, generator=g), torch.randint(0, 3, (N_EXAMPLES,), generator=g)


def _net():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))


def _fit(replicas, data):
    strategy = strategy_of(replicas)
    with strategy.scope():
        model = mr.Model(_net())
        model.compile(optimizer=mr.optimizers.SGD(learning_rate=0.1, momentum=0.9),
                      loss="sparse_categorical_crossentropy", metrics=["accuracy"])
    model.fit(data, epochs=EPOCHS, verbose=0)
    return model


def test_fit_with_its_own_prefetch_is_bitwise_a_plain_torch_loop_on_one_replica():
    """Regression test for issue 27."""
    x, y = _data()
    ref = _net()
    opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    for _ in range(EPOCHS):
        for i in range(0, N_EXAMPLES, GLOBAL_BATCH):
            xb, yb = x[i:i + GLOBAL_BATCH], y[i:i + GLOBAL_BATCH]
            loss = F.cross_entropy(ref(xb), yb, reduction="none").sum() / len(xb)
            opt.zero_grad()
            loss.backward()
            opt.step()
    model = _fit(1, mr.data.Dataset.from_tensor_slices((x, y)).batch(GLOBAL_BATCH))
    for got, want in zip(model.module.parameters(), ref.parameters()):
        assert torch.equal(got, want)


def test_fit_on_two_replicas_is_bitwise_the_same_with_and_without_its_prefetch():
    x, y = _data()
    batches = [(x[i:i + GLOBAL_BATCH], y[i:i + GLOBAL_BATCH]) for i in range(0, N_EXAMPLES, GLOBAL_BATCH)]
    read_as_is = _fit(2, batches)  # a list: fit reads it as it is, no thread
    prefetched = _fit(2, mr.data.Dataset.from_tensor_slices((x, y)).batch(GLOBAL_BATCH))
    for got, want in zip(prefetched.module.parameters(), read_as_is.module.parameters()):
        assert torch.equal(got, want)
    assert prefetched.evaluate(x, y, batch_size=GLOBAL_BATCH, verbose=0) == read_as_is.evaluate(
        x, y, batch_size=GLOBAL_BATCH, verbose=0)
    prefetched.check_in_sync()


def test_fit_prefetches_a_pipeline_without_prefetch_only():
    x, y = _data()
    plain = mr.data.Dataset.from_tensor_slices((x, y)).batch(GLOBAL_BATCH)
    assert data_adapter.prefetched(plain).get_state()["pipeline"][:2] == ["prefetch", "batch"]
    ahead = plain.prefetch(mr.data.AUTOTUNE)
    assert data_adapter.prefetched(ahead) is ahead
    batches = list(plain)
    assert data_adapter.prefetched(batches) is batches


# ---- the cheaper step (buffer sync, journal, reductions outside the replica's random mode, foreach SGD) ----

BN_EXAMPLES = 22  # batches 8, 8, 6: on 3 replicas 3/3/2, 3/3/2, 2/2/2


def _bn_net():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.BatchNorm1d(16), torch.nn.ReLU(),
                               torch.nn.Dropout(0.0), torch.nn.Linear(16, 4), torch.nn.BatchNorm1d(4))


def test_fit_with_batchnorm_is_bitwise_the_replicas_done_by_hand():
    """Regression test for issue 27: the step's own work (buffer sync, step journal, gradient
    all-reduce, metric updates, the optimizer's update) was made cheaper; weights and statistics
    stay bit for bit what the replicas' arithmetic gives, on 2 and 3 replicas with uneven parts."""
    x, y = batchnorm_data(7, BN_EXAMPLES)
    for replicas in (2, 3):
        threads = torch.get_num_threads()
        torch.set_num_threads(1)  # as each replica thread runs (a matmul's sums may split by thread count)
        try:
            want, _ = replicas_by_hand(_bn_net, x, y, replicas, GLOBAL_BATCH, EPOCHS)
        finally:
            torch.set_num_threads(threads)
        strategy = strategy_of(replicas)
        with strategy.scope():
            model = mr.Model(_bn_net())
            model.compile(optimizer=mr.optimizers.SGD(learning_rate=0.1, momentum=0.9),
                          loss="sparse_categorical_crossentropy", metrics=["accuracy"])
        model.fit(mr.data.Dataset.from_tensor_slices((x, y)).batch(GLOBAL_BATCH), epochs=EPOCHS, verbose=0)
        for (name, got), wanted in zip(model.module.state_dict().items(), want.state_dict().values()):
            assert torch.equal(got, wanted), f"{replicas} replicas: {name}"
        model.check_in_sync()
