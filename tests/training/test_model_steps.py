"""The public step of mr.Model (issue 37): a subclass's train_step, test_step and predict_step run on
every replica under fit, evaluate and predict, each on its part of the global batch, and give what
one device gives on the whole batch - a hand-written mean loss stepped with self.optimizer, a
custom evaluation, custom outputs, and a two-optimizer GAN written in torch. References: the same
steps in plain PyTorch on one device."""
from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import mirrored as mr
from _replicas import strategy_of  # tests/_replicas.py

# 22 examples in global batches of 8: parts 3/3/2 then 2/2/2 on 3 replicas, 4/4 then 3/3 on 2. The
# replicas' gradients meet as sum_r n_r g_r / N against one device's mean over N: float reassociation,
# measured below 2e-7 on these weights after 6 steps of SGD with momentum.
N, GLOBAL, EPOCHS = 22, 8, 2
RTOL, ATOL = 1e-5, 1e-6


def _data(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(N, 5, generator=g), torch.randint(0, 3, (N,), generator=g)


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 3))


def _smoothed(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits, y, label_smoothing=0.1)  # (a mean over the batch it sees)


class SmoothedModel(mr.Model):
    """keras.io's first example, in torch: a loss of its own, backward, the optimizer's step, a tracker."""

    def __init__(self, module: nn.Module):
        super().__init__(module)
        self.steps_run = [0] * self.distribute_strategy.num_replicas_in_sync  # a Python side effect per replica
        with self.distribute_strategy.scope():
            self.loss_tracker = mr.metrics.Mean(name="loss")

    @property
    def metrics(self) -> list:
        return [self.loss_tracker]

    def train_step(self, data):
        x, y = data
        self.steps_run[mr.get_replica_context().replica_id_in_sync_group] += 1
        loss = _smoothed(self(x, training=True), y)
        self.optimizer.zero_grad()
        loss.backward()
        self.optimizer.step()
        self.loss_tracker.update_state(loss.detach(), sample_weight=len(y))
        return {"loss": self.loss_tracker.result()}

    def test_step(self, data):
        x, y = data
        logits = self(x, training=False)
        self.loss_tracker.update_state(_smoothed(logits, y), sample_weight=len(y))
        return {m.name: m.result() for m in self.metrics}

    def predict_step(self, data):
        x = data[0] if isinstance(data, (tuple, list)) else data
        return torch.softmax(self(x, training=False), dim=-1)


def _plain_run(net: nn.Module, x: torch.Tensor, y: torch.Tensor) -> list[float]:
    """One device: the same steps on whole batches; the mean loss of each epoch, by example."""
    opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    history = []
    for _ in range(EPOCHS):
        total = 0.0
        for i in range(0, N, GLOBAL):
            loss = _smoothed(net(x[i:i + GLOBAL]), y[i:i + GLOBAL])
            opt.zero_grad()
            loss.backward()
            opt.step()
            total += loss.item() * len(x[i:i + GLOBAL])
        history.append(total / N)
    return history


@pytest.mark.parametrize("replicas", [1, 2, 3])
def test_overridden_steps_run_on_every_replica_and_give_one_devices_result(replicas):
    x, y = _data()
    ref = _net()
    want_history = _plain_run(ref, x, y)
    with strategy_of(replicas).scope():
        model = SmoothedModel(_net())
        model.compile(optimizer=mr.optimizers.SGD(learning_rate=0.1, momentum=0.9))
    ds = mr.data.Dataset.from_tensor_slices((x, y)).batch(GLOBAL)
    history = model.fit(ds, epochs=EPOCHS, verbose=0).history
    assert model.steps_run == [EPOCHS * 3] * replicas  # every replica ran each step once (no step was redone)
    for got, want in zip(model.module.parameters(), ref.parameters()):
        torch.testing.assert_close(got, want, rtol=RTOL, atol=ATOL)
    model.check_in_sync()
    # The tracker's result, read inside the step, is every replica's (tf.keras's merge_call read).
    np.testing.assert_allclose(history["loss"], want_history, rtol=RTOL)
    with torch.no_grad():
        want_eval = _smoothed(ref(x), y).item()
        want_probs = torch.softmax(ref(x), dim=-1).numpy()
    model.loss_tracker.reset_state()
    assert model.evaluate(ds, verbose=0) == pytest.approx(want_eval, rel=RTOL)
    np.testing.assert_allclose(model.predict(x, batch_size=GLOBAL, verbose=0), want_probs, rtol=RTOL, atol=ATOL)


def test_the_default_train_step_is_the_plain_code_it_reads_as():
    """fit's default step equals a subclass whose train_step is the documented plain code, bit for bit."""
    x, y = _data(1)

    class Plain(mr.Model):
        def train_step(self, data):
            x, y = data
            y_pred = self(x, training=True)
            loss = self.compute_loss(x, y, y_pred)
            self._track_loss(loss, x)
            logs = self.compute_metrics(x, y, y_pred)
            loss.backward()
            self.optimizer.step()
            self.optimizer.zero_grad()
            return logs

    runs = []
    for cls in (mr.Model, Plain):
        with strategy_of(2).scope():
            model = cls(_net())
            model.compile(optimizer=mr.optimizers.SGD(learning_rate=0.1, momentum=0.9),
                          loss="sparse_categorical_crossentropy", metrics=["accuracy"])
        history = model.fit(mr.data.Dataset.from_tensor_slices((x, y)).batch(GLOBAL), epochs=EPOCHS, verbose=0)
        runs.append((model.get_weights(), history.history))
    for a, b in zip(runs[0][0], runs[1][0]):
        np.testing.assert_array_equal(a, b)
    assert runs[0][1] == runs[1][1]


class Generator(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(1)
        self.body = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 5))

    def forward(self, z):
        return self.body(z)


class Discriminator(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(2)
        self.body = nn.Sequential(nn.Linear(5, 8), nn.LeakyReLU(0.2), nn.Linear(8, 1))

    def forward(self, x):
        return self.body(x)


def _gan_losses(generator: nn.Module, discriminator: nn.Module, real: torch.Tensor, z: torch.Tensor):
    """The discriminator's loss (real as 1, generated as 0) and, after its update, the generator's."""
    def d_loss():
        fake = generator(z).detach()
        logits = torch.cat([discriminator(real), discriminator(fake)])
        labels = torch.cat([torch.ones(len(real), 1), torch.zeros(len(z), 1)])
        return F.binary_cross_entropy_with_logits(logits, labels)

    def g_loss():
        return F.binary_cross_entropy_with_logits(discriminator(generator(z)), torch.ones(len(z), 1))
    return d_loss, g_loss


class GAN(mr.Model):
    """keras.io's GAN, in torch: its own compile with two optimizers, each stepped on its part."""

    def __init__(self, generator: nn.Module, discriminator: nn.Module):
        super().__init__(nn.ModuleDict({"generator": generator, "discriminator": discriminator}))
        with self.distribute_strategy.scope():
            self.d_tracker, self.g_tracker = mr.metrics.Mean(name="d_loss"), mr.metrics.Mean(name="g_loss")

    @property
    def metrics(self) -> list:
        return [self.d_tracker, self.g_tracker]

    def compile(self, d_optimizer, g_optimizer):
        super().compile()
        self.d_optimizer = self.build_optimizer(d_optimizer, self.discriminator)
        self.g_optimizer = self.build_optimizer(g_optimizer, self.generator)

    def train_step(self, data):
        real, z = data  # (the noise comes with the data, so that one device draws the same)
        d_loss, g_loss = _gan_losses(self.generator, self.discriminator, real, z)
        loss = d_loss()
        self.d_optimizer.zero_grad()
        loss.backward()
        self.d_optimizer.step()
        self.d_tracker.update_state(loss.detach(), sample_weight=len(real))
        loss = g_loss()
        self.g_optimizer.zero_grad()
        loss.backward()
        self.g_optimizer.step()
        self.g_tracker.update_state(loss.detach(), sample_weight=len(real))
        return {m.name: m.result() for m in self.metrics}


@pytest.mark.parametrize("replicas", [1, 2, 3])
def test_a_two_optimizer_gan_written_in_torch_gives_one_devices_updates(replicas):
    g = torch.Generator().manual_seed(3)
    real, z = torch.randn(N, 5, generator=g) + 2, torch.randn(N, 4, generator=g)
    generator, discriminator = Generator(), Discriminator()
    d_opt = torch.optim.Adam(discriminator.parameters(), lr=1e-3)
    g_opt = torch.optim.Adam(generator.parameters(), lr=1e-3)
    want = {"d_loss": [], "g_loss": []}
    for _ in range(EPOCHS):
        sums = {"d_loss": 0.0, "g_loss": 0.0}
        for i in range(0, N, GLOBAL):
            d_loss, g_loss = _gan_losses(generator, discriminator, real[i:i + GLOBAL], z[i:i + GLOBAL])
            for name, loss_fn, opt in (("d_loss", d_loss, d_opt), ("g_loss", g_loss, g_opt)):
                loss = loss_fn()
                opt.zero_grad()
                loss.backward()
                opt.step()
                sums[name] += loss.item() * len(real[i:i + GLOBAL])
        for name in sums:
            want[name].append(sums[name] / N)
    with strategy_of(replicas).scope():
        gan = GAN(Generator(), Discriminator())
        gan.compile(d_optimizer=mr.optimizers.Adam(learning_rate=1e-3),
                    g_optimizer=mr.optimizers.Adam(learning_rate=1e-3))
    history = gan.fit(mr.data.Dataset.from_tensor_slices((real, z)).batch(GLOBAL), epochs=EPOCHS, verbose=0).history
    for part, ref in (("generator", generator), ("discriminator", discriminator)):
        for got, wanted in zip(gan.module[part].parameters(), ref.parameters()):
            torch.testing.assert_close(got, wanted, rtol=RTOL, atol=ATOL)
    for name in want:
        np.testing.assert_allclose(history[name], want[name], rtol=RTOL)
    gan.check_in_sync()
    gan.distribute_strategy.check_in_sync(gan.d_optimizer._steps.mirrored)
    gan.distribute_strategy.check_in_sync(gan.g_optimizer._steps.mirrored)


def test_an_optimizer_for_something_not_of_the_model_is_refused():
    with strategy_of(2).scope():
        model = mr.Model(_net())
        with pytest.raises(TypeError, match="pass a part of this model"):
            model.build_optimizer("sgd", _net())
    with pytest.raises(RuntimeError, match="not a model's yet"):
        mr.optimizers.SGD(learning_rate=0.1).step()


def test_fit_without_a_loss_needs_a_train_step_of_ones_own():
    with strategy_of(2).scope():
        model = mr.Model(_net())
        model.compile(optimizer="sgd")
    x, y = _data()
    with pytest.raises(ValueError, match="no loss"):
        model.fit(x, y, batch_size=GLOBAL, verbose=0)
