"""Replica randomness (issue 26): each replica draws from generators of its own, seeded by (seed, step,
replica), so thread order and restarts change nothing; per_example_random keys dropout by example."""
from __future__ import annotations

import copy
import time

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import mirrored as mr
from mirrored._seeds import derive_seed
from mirrored.distribute import random as replica_random
from _replicas import strategy_of  # tests/_replicas.py

pytestmark = pytest.mark.timeout(120)


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Dropout(0.5), nn.Linear(16, 16), nn.AlphaDropout(0.2),
                         nn.Linear(16, 3))


def _data(n: int = 48) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(n, 6, generator=g), torch.randint(0, 3, (n,), generator=g)


def _train(devices: list[str], seed: int = 7, slow_replica: int | None = None, steps: int = 4,
           per_example: bool = False, global_batch: int = 12) -> list[torch.Tensor]:
    """Trains _net with dropout for `steps` custom-loop steps; replica `slow_replica` sleeps before its
    forward on even steps and after it on odd ones, so the threads reach the dropout in either order."""
    x, y = _data(global_batch * steps)
    strategy = mr.MirroredStrategy(devices=devices, seed=seed, per_example_random=per_example)
    with strategy.scope():
        mnet = strategy.mirror(_net())
        opt = strategy.mirror_optimizer(torch.optim.SGD, mnet, lr=0.1)
    counter = {"step": 0}

    def step(xb, yb):
        ctx = mr.get_replica_context()
        slow = ctx.replica_id_in_sync_group == slow_replica
        if slow and counter["step"] % 2 == 0:
            time.sleep(0.05)
        out = mnet(xb)
        noise = torch.rand(out.shape[0], 1) if not per_example else 0.0  # a draw through generator=
        if slow and counter["step"] % 2 == 1:
            time.sleep(0.05)
        loss = F.cross_entropy(out + noise, yb, reduction="none")
        mr.losses.compute_average_loss(loss, global_batch_size=global_batch).backward()
        opt.step()
        opt.zero_grad()

    ds = mr.data.Dataset.from_tensor_slices((x, y)).batch(global_batch)
    for xb, yb in strategy.experimental_distribute_dataset(ds):
        strategy.run(step, args=(xb, yb))
        counter["step"] += 1
    copies = strategy.experimental_local_results(mnet)
    for other in copies[1:]:
        for a, b in zip(copies[0].parameters(), other.parameters()):
            assert torch.equal(a, b)
    return [p.detach().clone() for p in copies[0].parameters()]


@pytest.mark.parametrize("devices", [["cpu:0", "cpu:1"], ["cpu:0", "cpu:1", "cpu:2"]])
def test_two_runs_with_dropout_are_bitwise_equal_whatever_the_thread_order(devices):
    first = _train(devices, slow_replica=None)
    second = _train(devices, slow_replica=1)
    third = _train(devices, slow_replica=0)
    for a, b, c in zip(first, second, third):
        assert torch.equal(a, b) and torch.equal(a, c)
    other_seed = _train(devices, seed=8)
    assert any(not torch.equal(a, b) for a, b in zip(first, other_seed))


def test_replicas_draw_different_masks_and_the_default_generator_is_untouched():
    strategy = mr.MirroredStrategy(devices=["cpu:0", "cpu:1"], seed=3)
    torch.manual_seed(123)
    before = torch.get_rng_state()

    def draw():
        return F.dropout(torch.ones(64), 0.5), torch.rand(4), torch.empty(4).uniform_()

    masks, rands, fills = zip(*strategy.experimental_local_results(strategy.run(draw)))
    assert not torch.equal(masks[0], masks[1]) and not torch.equal(rands[0], rands[1])
    assert torch.equal(torch.get_rng_state(), before)  # replicas never drew from (or left a state in) it
    # Replica r's plain draws are those of a torch.Generator seeded by (seed, step 0, r) - the contract.
    for r in range(2):
        g = torch.Generator().manual_seed(derive_seed(3, 0, r, 0))
        mask = torch.empty(64).bernoulli_(0.5, generator=g)  # what F.dropout draws on CPU, with this state
        torch.testing.assert_close(masks[r], mask * 2.0, rtol=0, atol=0)
        assert torch.equal(rands[r], torch.rand(4, generator=g))
        assert torch.equal(fills[r], torch.empty(4).uniform_(generator=g))


def test_dropout_backward_is_the_mask_times_the_scale():
    strategy = mr.MirroredStrategy(devices=["cpu:0", "cpu:1"], seed=5)

    def fn():
        x = torch.ones(32, 8, requires_grad=True)
        y = F.dropout(x, 0.25)
        y.sum().backward()
        return y.detach(), x.grad

    for y, grad in strategy.experimental_local_results(strategy.run(fn)):
        torch.testing.assert_close(grad, y)  # d(sum(x * mask / 0.75))/dx = mask / 0.75 = y for x = 1
        assert set(torch.unique(y).tolist()) <= {0.0, torch.tensor(1.0 / 0.75).item()}


def test_generator_state_round_trips_and_seed_none_takes_torchs_seed():
    mr.utils.set_random_seed(11)
    strategy = mr.MirroredStrategy(devices=["cpu:0", "cpu:1"])
    got = strategy.experimental_local_results(strategy.run(lambda: torch.rand(3)))
    assert strategy.random_state.get_state() == {"seed": 11, "steps": 1, "per_example_random": False}
    again = mr.MirroredStrategy(devices=["cpu:0", "cpu:1"], seed=0)
    again.random_state.set_state({"seed": 11, "steps": 0})
    assert all(torch.equal(a, b) for a, b in zip(got, again.experimental_local_results(
        again.run(lambda: torch.rand(3)))))
    with pytest.raises(ValueError, match="steps"):
        again.random_state.set_state({"seed": 1})
    with pytest.raises(TypeError, match="seed='x'"):
        mr.MirroredStrategy(devices=["cpu:0"], seed="x")


def test_set_random_seed_seeds_python_numpy_and_torch_like_keras():
    import random

    mr.utils.set_random_seed(4)
    a = (random.random(), np.random.rand(), torch.rand(()).item())
    mr.utils.set_random_seed(4)
    assert a == (random.random(), np.random.rand(), torch.rand(()).item())
    with pytest.raises(TypeError, match="int"):
        mr.utils.set_random_seed(1.5)


# ---- per_example_random -------------------------------------------------------------------------------
@pytest.mark.parametrize("op", ["dropout", "dropout2d", "alpha_dropout", "feature_alpha_dropout", "rrelu"])
def test_per_example_draws_do_not_depend_on_the_replica_count(op):
    x = torch.randn(10, 4, 3, 5) + 0.1
    fn = {"dropout": lambda t: F.dropout(t, 0.4), "dropout2d": lambda t: F.dropout2d(t, 0.4),
          "alpha_dropout": lambda t: F.alpha_dropout(t, 0.4, training=True),
          "feature_alpha_dropout": lambda t: F.feature_alpha_dropout(t, 0.4, training=True),
          "rrelu": lambda t: F.rrelu(t, training=True)}[op]
    outs = []
    for n in (1, 2, 3):
        strategy = strategy_of(n, seed=9, per_example_random=True)
        dist = strategy.experimental_distribute_dataset(mr.data.Dataset.from_tensors(x))
        batch = next(iter(dist))
        outs.append(torch.cat(strategy.experimental_local_results(strategy.run(fn, args=(batch,)))))
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])
    if op in ("dropout", "dropout2d"):  # kept with probability 1 - p, scaled by 1 / (1 - p)
        kept = outs[0] != 0
        torch.testing.assert_close(outs[0][kept], (x / 0.6)[kept], rtol=1e-6, atol=0)
        if op == "dropout2d":  # whole channels
            assert torch.all(kept.all(dim=(2, 3)) | (~kept).all(dim=(2, 3)))


def test_per_example_draws_with_an_empty_replica_part_and_an_explicit_generator():
    x = torch.randn(5, 7)  # batches of 4 and 1 over 3 replicas: parts of 2, 2, 0 and 1, 0, 0 examples
    outs = []
    for n in (1, 3):
        strategy = strategy_of(n, seed=4, per_example_random=True)
        dist = strategy.experimental_distribute_dataset(mr.data.Dataset.from_tensor_slices(x).batch(4))

        def fn(t):
            g = torch.Generator().manual_seed(0)  # the caller's own stream is left alone in this mode
            return F.dropout(F.dropout(t, 0.5), 0.5) + torch.rand(1, generator=g)

        outs.append([torch.cat(strategy.experimental_local_results(strategy.run(fn, args=(b,)))) for b in dist])
    for a, b in zip(*outs):
        assert torch.equal(a, b)


def test_per_example_masks_have_the_right_rate_and_are_independent_across_examples():
    strategy = mr.MirroredStrategy(devices=["cpu:0", "cpu:1"], seed=1, per_example_random=True)
    x = torch.ones(200, 500)
    dist = strategy.experimental_distribute_dataset(mr.data.Dataset.from_tensors(x))
    out = torch.cat(strategy.experimental_local_results(strategy.run(lambda t: F.dropout(t, 0.3),
                                                                     args=(next(iter(dist)),))))
    kept = (out != 0).double()
    assert abs(kept.mean().item() - 0.7) < 0.005  # 100000 draws: sd 0.0014
    corr = np.corrcoef(kept[:-1].flatten().numpy(), kept[1:].flatten().numpy())[0, 1]
    assert abs(corr) < 0.02


def test_per_example_mode_refuses_ops_it_cannot_key_by_name():
    strategy = mr.MirroredStrategy(devices=["cpu:0", "cpu:1"], seed=1, per_example_random=True)
    dist = strategy.experimental_distribute_dataset(mr.data.Dataset.from_tensors(torch.ones(4, 3)))
    batch = next(iter(dist))
    with pytest.raises(RuntimeError, match=r"torch\.rand was called .*per_example_random=True"):
        strategy.run(lambda t: t + torch.rand(3), args=(batch,))
    with pytest.raises(RuntimeError, match=r"dim 0 must be this replica's batch"):
        strategy.run(lambda t: F.dropout(t.T, 0.5), args=(batch,))
    with strategy.scope():
        lstm = strategy.mirror(nn.LSTM(3, 3, num_layers=2, dropout=0.5))
        no_dropout = strategy.mirror(nn.LSTM(3, 3, num_layers=2, dropout=0.0))
    with pytest.raises(RuntimeError, match=r"torch\.lstm"):
        strategy.run(lambda t: lstm(t.unsqueeze(1))[0], args=(batch,))
    strategy.run(lambda t: no_dropout(t.unsqueeze(1))[0], args=(batch,))  # draws nothing: allowed


def _fit_weights(n: int, per_example: bool, dropout: float) -> list[torch.Tensor]:
    x, y = _data(60)
    strategy = strategy_of(n, seed=2, per_example_random=per_example)
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(6, 32), nn.ReLU(), nn.Dropout(dropout), nn.Linear(32, 3))
    with strategy.scope():
        model = mr.Model(net)
        model.compile(optimizer=mr.optimizers.SGD(learning_rate=0.2), loss="sparse_categorical_crossentropy")
    model.fit(mr.data.Dataset.from_tensor_slices((x, y)).batch(12), epochs=3, verbose=0)
    return [p.detach().clone() for p in model.module.parameters()]


def test_per_example_fit_gives_the_same_weights_on_1_2_and_3_replicas():
    runs = {n: _fit_weights(n, True, 0.5) for n in (1, 2, 3)}
    for n in (2, 3):
        for a, b in zip(runs[1], runs[n]):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)  # the tolerance that holds without dropout
    plain = {n: _fit_weights(n, True, 0.0) for n in (1, 3)}
    for a, b in zip(plain[1], plain[3]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert any(not torch.allclose(a, b) for a, b in zip(runs[1], plain[1]))  # dropout did something
