"""keras.io's GAN from "Customizing what happens in fit() with PyTorch", on every replica: its class with
its own compile(d_optimizer=..., g_optimizer=..., loss_fn=...) and train_step, built and compiled in
the strategy's scope, trained by Keras's own fit.

    .venv/bin/python examples/keras_gan.py                          # every GPU (else one CPU replica)
    .venv/bin/python examples/keras_gan.py --replicas 2 --epochs 1 --steps 5   # 2 logical CPU replicas

Against the guide, the data is the embedded 8x8 digits (no download), so the two networks are the
guide's at 8x8 instead of 28x28 (two stride-2 steps from 2x2 rather than from 7x7), and the strategy
is new. Each replica runs train_step on its part of every batch of real images, with latent vectors
of its own; each optimizer's apply averages the replicas' gradients (weighted by their parts) before
Keras's Adam applies them, so the two networks stay the same on every replica.
"""
from __future__ import annotations

import argparse
import os

os.environ.setdefault("KERAS_BACKEND", "torch")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402
from keras import layers  # noqa: E402

import mirrored as mr  # noqa: E402


class GAN(keras.Model):
    """The guide's GAN, as written."""

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
        if isinstance(real_images, (tuple, list)):
            real_images = real_images[0]
        # Sample random points in the latent space and decode them to fake images.
        batch_size = real_images.shape[0]
        random_latent_vectors = keras.random.normal(shape=(batch_size, self.latent_dim), seed=self.seed_generator)
        generated_images = self.generator(random_latent_vectors)
        # Combine them with real images; labels discriminate real from fake, with some noise.
        real_images = torch.as_tensor(real_images, device=device)
        combined_images = torch.concat([generated_images, real_images], axis=0)
        labels = torch.concat([torch.ones((batch_size, 1), device=device),
                               torch.zeros((batch_size, 1), device=device)], axis=0)
        labels += 0.05 * keras.random.uniform(labels.shape, seed=self.seed_generator)

        # Train the discriminator.
        self.zero_grad()
        predictions = self.discriminator(combined_images)
        d_loss = self.loss_fn(labels, predictions)
        d_loss.backward()
        grads = [v.value.grad for v in self.discriminator.trainable_weights]
        with torch.no_grad():
            self.d_optimizer.apply(grads, self.discriminator.trainable_weights)

        # Train the generator (without updating the discriminator's weights) to have fakes called real.
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


def networks(latent_dim: int) -> tuple[keras.Model, keras.Model]:
    """The guide's discriminator and generator, for 8x8x1 images."""
    discriminator = keras.Sequential([
        keras.Input(shape=(8, 8, 1)),
        layers.Conv2D(64, (3, 3), strides=(2, 2), padding="same"), layers.LeakyReLU(negative_slope=0.2),
        layers.Conv2D(128, (3, 3), strides=(2, 2), padding="same"), layers.LeakyReLU(negative_slope=0.2),
        layers.GlobalMaxPooling2D(),
        layers.Dense(1),
    ], name="discriminator")
    generator = keras.Sequential([
        keras.Input(shape=(latent_dim,)),
        layers.Dense(2 * 2 * 128), layers.LeakyReLU(negative_slope=0.2),  # the guide: 7 * 7 * 128
        layers.Reshape((2, 2, 128)),
        layers.Conv2DTranspose(128, (4, 4), strides=(2, 2), padding="same"), layers.LeakyReLU(negative_slope=0.2),
        layers.Conv2DTranspose(128, (4, 4), strides=(2, 2), padding="same"), layers.LeakyReLU(negative_slope=0.2),
        layers.Conv2D(1, (7, 7), padding="same", activation="sigmoid"),
    ], name="generator")
    return discriminator, generator


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--steps", type=int, default=None, help="batches per epoch (default: all the digits)")
    parser.add_argument("--replicas", type=int, default=None, help="logical CPU replicas (default: every GPU)")
    parser.add_argument("--latent-dim", type=int, default=128)
    args = parser.parse_args()

    devices = [f"cpu:{i}" for i in range(args.replicas)] if args.replicas else None
    strategy = mr.MirroredStrategy(devices=devices)
    batch_size = 32 * strategy.num_replicas_in_sync  # the guide's 64 on 2 replicas

    # Both splits of the digits, as the guide takes both of MNIST's, in a DataLoader as the guide makes it.
    splits = mr.datasets.load("digits", as_supervised=True)
    all_digits = np.concatenate([np.stack([x.numpy() for x, _ in splits[s]]) for s in ("train", "test")])
    all_digits = all_digits.astype("float32") / 255.0
    dataset = torch.utils.data.TensorDataset(torch.from_numpy(all_digits), torch.from_numpy(all_digits))
    dataloader = torch.utils.data.DataLoader(dataset, batch_size=batch_size, shuffle=True)

    with strategy.scope():
        gan = GAN(*networks(args.latent_dim), latent_dim=args.latent_dim)
        gan.compile(d_optimizer=keras.optimizers.Adam(learning_rate=0.0003),
                    g_optimizer=keras.optimizers.Adam(learning_rate=0.0003),
                    loss_fn=keras.losses.BinaryCrossentropy(from_logits=True))
    history = gan.fit(dataloader, epochs=args.epochs, steps_per_epoch=args.steps, verbose=2)
    print("losses: " + " - ".join(f"{k}: {v[-1]:.4f}" for k, v in history.history.items()))
    strategy.check_in_sync(gan)  # both networks and both optimizers, the same on every replica
    print(f"{strategy.num_replicas_in_sync} replicas in sync")


if __name__ == "__main__":
    main()
