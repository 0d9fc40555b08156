"""Training on 1, 2 and 3 CPU replicas matches plain PyTorch on the whole global batch.

The reference is an independent plain-PyTorch loop: one model, one optimizer, each GLOBAL batch at
once, loss = sum of per-example cross-entropy / global batch size. The mirrored run splits every
global batch over the replicas (10 examples batched by 4 -> 4, 4, 2; over 3 replicas the first
batch splits 2, 2, 0), scales its loss the same way, and lets the optimizer all-reduce (SUM) the
gradients before each replica applies them.

Tolerance: the per-replica gradients are summed in a different order than one backward over the
whole batch sums them, so results differ by float32 reassociation only, a few ulps per step. After
six steps every parameter must match within rtol=1e-6, atol=2e-7: the largest difference measured
over all models, optimizers and replica counts here is 6e-8 (parameters of size ~0.1-1), so the
bound keeps a 3x margin while a real error (a wrong scale, a missed replica) is off by 1e-2 or more.
With one replica the computation is the reference's, so it must be bitwise equal. Whatever the
replica count, the replicas must be bitwise identical to each other after every step.

BatchNorm is left out on purpose: batch statistics per replica legitimately differ from full-batch
statistics, so a model with BatchNorm cannot match a single-device run exactly.
"""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import mirrored.distribute as md
from _replicas import strategy_of  # tests/_replicas.py

TIMEOUT_S = 30.0
N_EXAMPLES, GLOBAL_BATCH, EPOCHS = 10, 4, 2  # batches of 4, 4, 2 per epoch: 6 steps
RTOL, ATOL = 1e-6, 2e-7


def mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3))


class SmallConvNet(nn.Module):
    """Conv -> ReLU -> max-pool -> linear, no BatchNorm (see the module docstring)."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(1, 4, kernel_size=3, padding=1)
        self.head = nn.Linear(4 * 3 * 3, 3)

    def forward(self, x):
        return self.head(F.max_pool2d(F.relu(self.conv(x)), 2).flatten(1))


MODELS = {"mlp": (mlp, (6,)), "conv": (SmallConvNet, (1, 6, 6))}
OPTIMIZERS = {
    "sgd_momentum": (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9}),
    "adam": (torch.optim.Adam, {"lr": 0.01}),
}


def global_batches(input_shape) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(N_EXAMPLES, *input_shape, generator=g)
    y = torch.randint(0, 3, (N_EXAMPLES,), generator=g)
    return [(x[i:i + GLOBAL_BATCH], y[i:i + GLOBAL_BATCH]) for i in range(0, N_EXAMPLES, GLOBAL_BATCH)]


def reference_run(net: nn.Module, opt_cls, hparams, data) -> list[tuple[float, list[torch.Tensor]]]:
    """Plain PyTorch on each whole global batch; (loss, parameters) after every step."""
    opt = opt_cls(net.parameters(), **hparams)
    history = []
    for _ in range(EPOCHS):
        for x, y in data:
            loss = F.cross_entropy(net(x), y, reduction="sum") / len(x)
            loss.backward()
            opt.step()
            opt.zero_grad()
            history.append((loss.item(), [p.detach().clone() for p in net.parameters()]))
    return history


@pytest.mark.parametrize("n_replicas", [1, 2, 3])
@pytest.mark.parametrize("opt_name", sorted(OPTIMIZERS))
@pytest.mark.parametrize("model_name", sorted(MODELS))
def test_mirrored_training_matches_plain_torch(model_name, opt_name, n_replicas):
    make_model, input_shape = MODELS[model_name]
    opt_cls, hparams = OPTIMIZERS[opt_name]
    torch.manual_seed(0)
    net = make_model()
    data = global_batches(input_shape)
    want = reference_run(copy.deepcopy(net), opt_cls, hparams, data)

    strategy = strategy_of(n_replicas, timeout_s=TIMEOUT_S)
    with strategy.scope():
        mnet = strategy.mirror(copy.deepcopy(net))
        opt = strategy.mirror_optimizer(opt_cls, mnet, **hparams)

    def step(xb, yb, global_size):
        loss = F.cross_entropy(mnet(xb), yb, reduction="sum") / global_size
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss

    dist = strategy.experimental_distribute_dataset(data)
    i = 0
    for _ in range(EPOCHS):
        for (xb, yb), (x, _) in zip(dist, data):
            per_replica_loss = strategy.run(step, args=(xb, yb, len(x)))
            loss = strategy.reduce(md.ReduceOp.SUM, per_replica_loss)
            want_loss, want_params = want[i]
            assert loss.item() == pytest.approx(want_loss, rel=RTOL, abs=ATOL), f"step {i}"
            strategy.check_in_sync(mnet)
            strategy.check_in_sync(opt)
            copies = [list(m.parameters()) for m in mnet.replicas]
            for j, ref in enumerate(want_params):
                for r in range(n_replicas):
                    assert torch.equal(copies[r][j], copies[0][j]), f"step {i}: replica {r} differs, param {j}"
                if n_replicas == 1:
                    assert torch.equal(copies[0][j], ref), f"step {i}: one replica must be bitwise the reference"
                else:
                    torch.testing.assert_close(copies[0][j].detach(), ref, rtol=RTOL, atol=ATOL,
                                               msg=lambda m: f"step {i}, parameter {j}: {m}")
            i += 1
    assert i == len(want) == 6


def test_empty_replica_batch_contributes_zero_gradient():
    """Over 3 replicas a global batch of 2 splits 1, 1, 0: the empty replica still steps (its zero
    gradient joins the all-reduce) and the result matches the full-batch gradient."""
    torch.manual_seed(0)
    net = mlp()
    x, y = torch.randn(2, 6), torch.tensor([0, 2])
    ref = copy.deepcopy(net)
    (F.cross_entropy(ref(x), y, reduction="sum") / 2).backward()
    strategy = md.MirroredStrategy(devices=["cpu:0", "cpu:1", "cpu:2"], timeout_s=TIMEOUT_S)
    with strategy.scope():
        mnet = strategy.mirror(copy.deepcopy(net))
        opt = strategy.mirror_optimizer(torch.optim.SGD, mnet, lr=1.0)

    def step(xb, yb):
        (F.cross_entropy(mnet(xb), yb, reduction="sum") / 2).backward()
        opt.reduce_gradients()
        return [p.grad.clone() for p in mnet.parameters()], len(xb)

    xb, yb = next(iter(strategy.experimental_distribute_dataset([(x, y)])))
    grads, sizes = strategy.run(step, args=(xb, yb))
    assert sizes.values == (1, 1, 0)
    for j, p in enumerate(ref.parameters()):
        for r in range(3):
            torch.testing.assert_close(grads[j].values[r], p.grad, rtol=RTOL, atol=ATOL)
            assert torch.equal(grads[j].values[r], grads[j].values[0])
