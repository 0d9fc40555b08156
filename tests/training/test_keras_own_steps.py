"""keras.io's "Customizing what happens in fit() with PyTorch" (keras-io's guides/custom_train_step_in_torch.py,
the version that takes a DataLoader's list batches in the GAN) on 2 and 3 CPU replicas, under Keras's
own fit in the scope and under mr.Model (issue 34): each section's model class as the guide writes it,
against Keras's own fit on one device with the same initial weights and batches (shuffle=False: the
guide's shuffle draws from torch's global generator). Tolerance 1e-5 (float32 sums regrouped over the
replicas' parts). The GAN draws random latent vectors per replica, so it is checked for what holds
on any replica count: each replica's part, finite losses, replicas in sync.

The last tests hold the difference to tf.keras under tf.distribute by closed form (TensorFlow is not
a dependency): Keras on TF sums the replicas' gradients (keras/src/backend/tensorflow/optimizer.py,
_backend_update_step, 113-125), so a train_step whose loss is a hand-written mean over its part
steps N times one device's step; and a keras.losses object divides its mean by N in replica context
(keras/src/losses/loss.py, scale_loss_for_distribution, 229-243), so a tracker of that loss reports
loss / N. Ours weighs each replica by its rows: one device's update, one device's report."""
from __future__ import annotations

import os

os.environ.setdefault("KERAS_BACKEND", "torch")  # before keras is imported (it reads it once)

import numpy as np
import pytest
import torch

keras = pytest.importorskip("keras")
if keras.backend.backend() != "torch":
    pytest.skip("keras was imported with another backend than torch", allow_module_level=True)
from keras import layers  # noqa: E402

import mirrored as mr  # noqa: E402
from _replicas import strategy_of  # tests/_replicas.py

ATOL = 1e-5
PATHS = ["keras_fit", "mr_model"]


class CustomLoss(keras.Model):
    """The guide's first example: compute_loss, backward, optimizer.apply, the metrics updated by hand."""

    def train_step(self, data):
        x, y = data
        self.zero_grad()
        y_pred = self(x, training=True)
        loss = self.compute_loss(y=y, y_pred=y_pred)
        loss.backward()
        trainable_weights = [v for v in self.trainable_weights]
        gradients = [v.value.grad for v in trainable_weights]
        with torch.no_grad():
            self.optimizer.apply(gradients, trainable_weights)
        for metric in self.metrics:
            if metric.name == "loss":
                metric.update_state(loss)
            else:
                metric.update_state(y, y_pred)
        return {m.name: m.result() for m in self.metrics}


class LowerLevel(keras.Model):
    """"Going lower-level": compile() gives only the optimizer; the loss and trackers are the model's."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.loss_tracker = keras.metrics.Mean(name="loss")
        self.mae_metric = keras.metrics.MeanAbsoluteError(name="mae")
        self.loss_fn = keras.losses.MeanSquaredError()

    def train_step(self, data):
        x, y = data
        self.zero_grad()
        y_pred = self(x, training=True)
        loss = self.loss_fn(y, y_pred)
        loss.backward()
        trainable_weights = [v for v in self.trainable_weights]
        gradients = [v.value.grad for v in trainable_weights]
        with torch.no_grad():
            self.optimizer.apply(gradients, trainable_weights)
        self.loss_tracker.update_state(loss)
        self.mae_metric.update_state(y, y_pred)
        return {"loss": self.loss_tracker.result(), "mae": self.mae_metric.result()}

    @property
    def metrics(self):
        return [self.loss_tracker, self.mae_metric]


class Weighted(keras.Model):
    """"Supporting sample_weight & class_weight": the weights unpacked and passed on."""

    def train_step(self, data):
        if len(data) == 3:
            x, y, sample_weight = data
        else:
            sample_weight = None
            x, y = data
        self.zero_grad()
        y_pred = self(x, training=True)
        loss = self.compute_loss(y=y, y_pred=y_pred, sample_weight=sample_weight)
        loss.backward()
        trainable_weights = [v for v in self.trainable_weights]
        gradients = [v.value.grad for v in trainable_weights]
        with torch.no_grad():
            self.optimizer.apply(gradients, trainable_weights)
        for metric in self.metrics:
            if metric.name == "loss":
                metric.update_state(loss)
            else:
                metric.update_state(y, y_pred, sample_weight=sample_weight)
        return {m.name: m.result() for m in self.metrics}


class OwnEvaluation(keras.Model):
    """"Providing your own evaluation step": test_step."""

    def test_step(self, data):
        x, y = data
        y_pred = self(x, training=False)
        loss = self.compute_loss(y=y, y_pred=y_pred)
        for metric in self.metrics:
            if metric.name == "loss":
                metric.update_state(loss)
            else:
                metric.update_state(y, y_pred)
        return {m.name: m.result() for m in self.metrics}


def data(rows: int = 200, seed: int = 0):
    rng = np.random.default_rng(seed)
    return (rng.random((rows, 32)).astype("float32"), rng.random((rows, 1)).astype("float32"),
            rng.random((rows, 1)).astype("float32"))


def build(cls):
    keras.utils.set_random_seed(1)
    inputs = keras.Input(shape=(32,))
    return cls(inputs, keras.layers.Dense(1)(inputs))


def run(cls, replicas, path, compile_kwargs, call):
    """`call(model)` on a model of class `cls` compiled with compile_kwargs: on one device (replicas
    None), in the strategy's scope (keras_fit) or wrapped in mr.Model (mr_model); returns (the
    Keras model, what call returned, the strategy)."""
    if replicas is None:
        model = build(cls)
        model.compile(**compile_kwargs)
        return model, call(model), None
    strategy = strategy_of(replicas)
    with strategy.scope():
        net = build(cls)
        model = net if path == "keras_fit" else mr.Model(net)
        model.compile(**compile_kwargs)
    return net, call(model), strategy


def history_of(result):
    return result.history if hasattr(result, "history") else result


def assert_same(ref, ours, got, want, strategy):
    if isinstance(want, dict):
        assert set(got) == set(want)
        for key in want:
            np.testing.assert_allclose(got[key], want[key], atol=ATOL, err_msg=key)
    else:
        np.testing.assert_allclose(got, want, atol=ATOL)
    for v, a, b in zip(ref.weights, ref.get_weights(), ours.get_weights()):
        np.testing.assert_allclose(b, a, atol=ATOL, err_msg=v.path)
    if strategy is not None:
        strategy.check_in_sync(ours)


SECTIONS = {
    "custom_loss": (CustomLoss, dict(optimizer="adam", loss="mse", metrics=["mae"]),
                    lambda m, x, y, sw: history_of(m.fit(x, y, epochs=3, batch_size=32, shuffle=False, verbose=0))),
    "lower_level": (LowerLevel, dict(optimizer="adam"),
                    lambda m, x, y, sw: history_of(m.fit(x, y, epochs=3, batch_size=32, shuffle=False, verbose=0))),
    "sample_weight": (Weighted, dict(optimizer="adam", loss="mse", metrics=["mae"]),
                      lambda m, x, y, sw: history_of(m.fit(x, y, sample_weight=sw, epochs=3, batch_size=32,
                                                           shuffle=False, verbose=0))),
    "test_step": (OwnEvaluation, dict(loss="mse", metrics=["mae"]),
                  lambda m, x, y, sw: m.evaluate(x, y, batch_size=32, verbose=0, return_dict=True)),
}


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("replicas", [2, 3])
@pytest.mark.parametrize("section", list(SECTIONS))
def test_guide_section_equals_one_device(section, replicas, path):
    """Each section's program, 200 rows in batches of 32 (the last of 8 is uneven over 3 replicas): the
    reported metrics (History, or evaluate's) and the weights equal Keras's own on one device."""
    cls, compile_kwargs, call = SECTIONS[section]
    x, y, sw = data()
    ref, want, _ = run(cls, None, path, compile_kwargs, lambda m: call(m, x, y, sw))
    ours, got, strategy = run(cls, replicas, path, compile_kwargs, lambda m: call(m, x, y, sw))
    assert_same(ref, ours, got, want, strategy)


PARTS: list[int] = []  # the batch each replica's discriminator saw real images of (a global: shared by copies)


class GAN(keras.Model):
    """The guide's GAN, as written (its train_step takes a DataLoader's [images, images] list)."""

    def __init__(self, discriminator, generator, latent_dim):
        super().__init__()
        self.discriminator = discriminator
        self.generator = generator
        self.latent_dim = latent_dim
        self.d_loss_tracker = keras.metrics.Mean(name="d_loss")
        self.g_loss_tracker = keras.metrics.Mean(name="g_loss")
        self.seed_generator = keras.random.SeedGenerator(1337)
        self.built = True

    @property
    def metrics(self):
        return [self.d_loss_tracker, self.g_loss_tracker]

    def compile(self, d_optimizer, g_optimizer, loss_fn):
        super().compile()
        self.d_optimizer = d_optimizer
        self.g_optimizer = g_optimizer
        self.loss_fn = loss_fn

    def train_step(self, real_images):
        device = "cuda" if torch.cuda.is_available() else "cpu"
        if isinstance(real_images, tuple) or isinstance(real_images, list):
            real_images = real_images[0]
        batch_size = real_images.shape[0]
        PARTS.append(int(batch_size))
        random_latent_vectors = keras.random.normal(shape=(batch_size, self.latent_dim), seed=self.seed_generator)
        generated_images = self.generator(random_latent_vectors)
        real_images = torch.as_tensor(real_images, device=device)
        combined_images = torch.concat([generated_images, real_images], axis=0)
        labels = torch.concat([torch.ones((batch_size, 1), device=device),
                               torch.zeros((batch_size, 1), device=device)], axis=0)
        labels += 0.05 * keras.random.uniform(labels.shape, seed=self.seed_generator)
        self.zero_grad()
        predictions = self.discriminator(combined_images)
        d_loss = self.loss_fn(labels, predictions)
        d_loss.backward()
        grads = [v.value.grad for v in self.discriminator.trainable_weights]
        with torch.no_grad():
            self.d_optimizer.apply(grads, self.discriminator.trainable_weights)
        random_latent_vectors = keras.random.normal(shape=(batch_size, self.latent_dim), seed=self.seed_generator)
        misleading_labels = torch.zeros((batch_size, 1), device=device)
        self.zero_grad()
        predictions = self.discriminator(self.generator(random_latent_vectors))
        g_loss = self.loss_fn(misleading_labels, predictions)
        g_loss.backward()
        grads = [v.value.grad for v in self.generator.trainable_weights]
        with torch.no_grad():
            self.g_optimizer.apply(grads, self.generator.trainable_weights)
        self.d_loss_tracker.update_state(d_loss)
        self.g_loss_tracker.update_state(g_loss)
        return {"d_loss": self.d_loss_tracker.result(), "g_loss": self.g_loss_tracker.result()}


def gan_parts(latent_dim: int = 8):
    discriminator = keras.Sequential([
        keras.Input(shape=(28, 28, 1)),
        layers.Conv2D(8, (3, 3), strides=(2, 2), padding="same"), layers.LeakyReLU(negative_slope=0.2),
        layers.GlobalMaxPooling2D(), layers.Dense(1)], name="discriminator")
    generator = keras.Sequential([
        keras.Input(shape=(latent_dim,)),
        layers.Dense(7 * 7 * 8), layers.LeakyReLU(negative_slope=0.2), layers.Reshape((7, 7, 8)),
        layers.Conv2DTranspose(8, (4, 4), strides=(2, 2), padding="same"), layers.LeakyReLU(negative_slope=0.2),
        layers.Conv2DTranspose(8, (4, 4), strides=(2, 2), padding="same"), layers.LeakyReLU(negative_slope=0.2),
        layers.Conv2D(1, (7, 7), padding="same", activation="sigmoid")], name="generator")
    return discriminator, generator, latent_dim


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("replicas,parts", [(2, [16, 16]), (3, [11, 11, 10])])
def test_guide_gan_trains_on_every_replica(replicas, parts, path):
    """The GAN with its own compile(d_optimizer=..., g_optimizer=..., loss_fn=...) and a DataLoader of
    small random images: every replica's discriminator sees its part of each batch of 32, both Adams
    build on every copy and step alike (the replicas stay bitwise equal), the losses are finite."""
    images = np.random.default_rng(0).random((64, 28, 28, 1)).astype("float32")
    dataset = torch.utils.data.TensorDataset(torch.from_numpy(images), torch.from_numpy(images))
    loader = torch.utils.data.DataLoader(dataset, batch_size=32, shuffle=True)
    strategy = strategy_of(replicas)
    with strategy.scope():
        keras.utils.set_random_seed(0)
        gan = GAN(*gan_parts())
        model = gan if path == "keras_fit" else mr.Model(gan)
        model.compile(d_optimizer=keras.optimizers.Adam(learning_rate=0.0003),
                      g_optimizer=keras.optimizers.Adam(learning_rate=0.0003),
                      loss_fn=keras.losses.BinaryCrossentropy(from_logits=True))
    PARTS.clear()
    history = model.fit(loader, epochs=2, verbose=0)
    assert sorted(PARTS) == sorted(parts * 4)
    assert all(np.isfinite(v).all() for v in history.history.values()) and set(history.history) == {"d_loss",
                                                                                                     "g_loss"}
    strategy.check_in_sync(gan)  # the weights, and both optimizers' variables
    assert int(gan.d_optimizer.iterations) == int(gan.g_optimizer.iterations) == 4


class HandWrittenMean(keras.Model):
    """A train_step whose loss is a hand-written mean (torch.mean), not a Keras loss."""

    def train_step(self, data):
        x, y = data
        self.zero_grad()
        loss = torch.mean(torch.square(self(x, training=True) - y))
        loss.backward()
        with torch.no_grad():
            self.optimizer.apply([v.value.grad for v in self.trainable_weights], self.trainable_weights)
        return {"loss": loss}


def test_a_hand_written_mean_loss_gives_one_devices_step_where_tf_keras_gives_n_times_it():
    """One SGD step of a hand-written mean loss, 8 rows on 2 replicas: ours is w - lr * g (g the mean
    loss's gradient on the whole batch: one device's); tf.keras's rule, w - lr * (g_1 + g_2) with g_r
    the gradient of replica r's part mean, is twice that step here (equal parts: g_1 + g_2 = 2 g)."""
    x, y, _ = data(8)
    lr = 0.1
    strategy = strategy_of(2)
    with strategy.scope():
        model = build(HandWrittenMean)
        model.compile(optimizer=keras.optimizers.SGD(learning_rate=lr))
    w0 = [w.copy() for w in model.get_weights()]
    model.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
    strategy.check_in_sync(model)

    def grad(rows):  # the mean loss's gradient at w0 on those rows, by torch autograd
        kernel, bias = (torch.tensor(w, requires_grad=True) for w in w0)
        loss = torch.mean(torch.square(torch.from_numpy(x[rows]) @ kernel + bias - torch.from_numpy(y[rows])))
        return [g.numpy() for g in torch.autograd.grad(loss, [kernel, bias])]
    whole, first, second = grad(slice(0, 8)), grad(slice(0, 4)), grad(slice(4, 8))
    for w, start, g, g1, g2 in zip(model.get_weights(), w0, whole, first, second):
        np.testing.assert_allclose(w, start - lr * g, atol=1e-6)  # one device's step
        tf_step = -lr * (g1 + g2)
        np.testing.assert_allclose(tf_step, 2 * (w - start), atol=1e-6)  # tf.keras: N times ours


def test_a_keras_loss_tracker_reports_the_loss_where_tf_keras_reports_loss_over_n():
    """The guide's lower-level example, one batch of 8 rows on 2 replicas with a learning rate of 0 (so
    the reported loss is the loss at the initial weights): ours reports one device's loss; tf.keras
    divides a keras.losses mean by N in replica context, so its tracker (each replica's part, summed
    state read once) reports the mean of the parts' losses over N: half of it here."""
    x, y, _ = data(8)
    ref = build(LowerLevel)
    ref.compile(optimizer=keras.optimizers.SGD(learning_rate=0.0))
    want = ref.fit(x, y, batch_size=8, shuffle=False, verbose=0).history["loss"][0]
    strategy = strategy_of(2)
    with strategy.scope():
        model = build(LowerLevel)
        model.compile(optimizer=keras.optimizers.SGD(learning_rate=0.0))
    got = model.fit(x, y, batch_size=8, shuffle=False, verbose=0).history["loss"][0]
    np.testing.assert_allclose(got, want, atol=1e-6)
    pred = keras.ops.convert_to_numpy(ref(x))
    parts = [float(np.mean((pred[r] - y[r]) ** 2)) for r in (slice(0, 4), slice(4, 8))]
    tf_reported = sum(p / 2 for p in parts) / 2  # total: each replica's loss / N, count: one per replica
    np.testing.assert_allclose(tf_reported, want / 2, rtol=1e-5)


CALLS: list[int] = []  # one entry per run of LateDrawing.test_step, any replica (a global: shared by copies)


class LateDrawing(OwnEvaluation):
    """The guide's own test_step, drawing nothing at first and from its third run on drawing from torch's
    default generator (in its loss): a step of your own may do anything, so it is never rolled back and
    run again."""

    def test_step(self, data):
        CALLS.append(1)
        return super().test_step(data)

    def compute_loss(self, *args, **kwargs):
        if len(CALLS) > 2:
            torch.rand(())
        return super().compute_loss(*args, **kwargs)


def test_test_on_batch_runs_a_keras_models_own_test_step_once_per_replica():
    """mr.Model's test_on_batch took a Keras model's own test_step for the Model's default step, which may
    be rolled back and run again: after a first call that drew nothing, a call that drew ran twice."""
    x, y, _ = data(8)
    CALLS.clear()

    def call(model):
        return [model.test_on_batch(x, y) for _ in range(3)]

    run(LateDrawing, 2, "mr_model", {"optimizer": "sgd", "loss": "mse"}, call)
    assert len(CALLS) == 3 * 2  # 3 calls on 2 replicas, each step once
