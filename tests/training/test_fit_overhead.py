"""What the overhead work of issue 27 must not change: fit on a README-style pipeline, which fit now
reads one batch ahead on a thread (Dataset.prefetch(1)), trains to the bits of a plain PyTorch loop on
one replica and of fit over the same batches read without it on two; a pipeline that prefetches already
is left as it is."""
from __future__ import annotations

import torch
import torch.nn.functional as F

import mirrored as mr
from mirrored.training import model as model_lib

N_EXAMPLES, GLOBAL_BATCH, EPOCHS = 20, 8, 2  # batches 8, 8, 4


def _data():
    g = torch.Generator().manual_seed(5)
    return torch.randn(N_EXAMPLES, 6, generator=g), torch.randint(0, 3, (N_EXAMPLES,), generator=g)


def _net():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))


def _fit(replicas, data):
    strategy = mr.MirroredStrategy(devices=[f"cpu:{i}" for i in range(replicas)])
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
    assert model_lib._prefetched(plain).get_state()["pipeline"][:2] == ["prefetch", "batch"]
    ahead = plain.prefetch(mr.data.AUTOTUNE)
    assert model_lib._prefetched(ahead) is ahead
    batches = list(plain)
    assert model_lib._prefetched(batches) is batches


# ---- the cheaper step (buffer sync, journal, reductions outside the replica's random mode, foreach SGD) ----

BN_EXAMPLES = 22  # batches 8, 8, 6: on 3 replicas 3/3/2, 3/3/2, 2/2/2


def _bn_data():
    g = torch.Generator().manual_seed(7)
    return torch.randn(BN_EXAMPLES, 6, generator=g) * 2 + 1, torch.randint(0, 4, (BN_EXAMPLES,), generator=g)


def _bn_net():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.BatchNorm1d(16), torch.nn.ReLU(),
                               torch.nn.Dropout(0.0), torch.nn.Linear(16, 4), torch.nn.BatchNorm1d(4))


def _replicas_by_hand(x, y, replicas):
    """Plain PyTorch doing, op for op, what the replicas do: one module copy each on its part of the
    global batch (TF's split), crossentropy (as -log_softmax at the label, which mr's loss computes)
    summed over the part / global batch, backward on each copy; the
    gradients summed in replica order and applied by each copy's torch SGD; the floating-point buffers
    set to the parts' average weighted by their sizes, computed in float64 in replica order; the
    integer ones (num_batches_tracked) replica 0's."""
    copies = [_bn_net() for _ in range(replicas)]
    opts = [torch.optim.SGD(c.parameters(), lr=0.1, momentum=0.9) for c in copies]
    for _ in range(EPOCHS):
        for i in range(0, BN_EXAMPLES, GLOBAL_BATCH):
            xb, yb = x[i:i + GLOBAL_BATCH], y[i:i + GLOBAL_BATCH]
            per = -(-len(xb) // replicas)
            sizes = [min(per, len(xb) - per * r) for r in range(replicas)]
            for r, (c, opt) in enumerate(zip(copies, opts)):
                opt.zero_grad()
                part = slice(per * r, per * r + sizes[r])
                per_example = -F.log_softmax(c(xb[part]), dim=-1).gather(1, yb[part].unsqueeze(1)).squeeze(1)
                loss = per_example.sum() / len(xb)
                loss.backward()
            with torch.no_grad():
                params = [list(c.parameters()) for c in copies]
                summed = [p.grad.clone() for p in params[0]]
                for other in params[1:]:
                    for s, p in zip(summed, other):
                        s.add_(p.grad)
                for c, opt in zip(copies, opts):
                    for p, s in zip(c.parameters(), summed):
                        p.grad = s.clone()
                    opt.step()
                buffers = [dict(c.named_buffers()) for c in copies]
                for name, first in buffers[0].items():
                    if first.is_floating_point():
                        total = first.double() * sizes[0]
                        for r in range(1, replicas):
                            total = total + buffers[r][name].double() * sizes[r]
                        value = (total / sum(sizes)).to(first.dtype)
                    else:
                        value = first.clone()
                    for b in buffers:
                        b[name].copy_(value)
    return copies[0]


def test_fit_with_batchnorm_is_bitwise_the_replicas_done_by_hand():
    """Regression test for issue 27: the step's own work (buffer sync, step journal, gradient
    all-reduce, metric updates, the optimizer's update) was made cheaper; weights and statistics
    stay bit for bit what the replicas' arithmetic gives, on 2 and 3 replicas with uneven parts."""
    x, y = _bn_data()
    for replicas in (2, 3):
        threads = torch.get_num_threads()
        torch.set_num_threads(1)  # as each replica thread runs (a matmul's sums may split by thread count)
        try:
            want = _replicas_by_hand(x, y, replicas)
        finally:
            torch.set_num_threads(threads)
        strategy = mr.MirroredStrategy(devices=[f"cpu:{i}" for i in range(replicas)])
        with strategy.scope():
            model = mr.Model(_bn_net())
            model.compile(optimizer=mr.optimizers.SGD(learning_rate=0.1, momentum=0.9),
                          loss="sparse_categorical_crossentropy", metrics=["accuracy"])
        model.fit(mr.data.Dataset.from_tensor_slices((x, y)).batch(GLOBAL_BATCH), epochs=EPOCHS, verbose=0)
        for (name, got), wanted in zip(model.module.state_dict().items(), want.state_dict().values()):
            assert torch.equal(got, wanted), f"{replicas} replicas: {name}"
        model.check_in_sync()
