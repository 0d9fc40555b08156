"""keras.io's "Image classification from scratch" (Keras 3), ported to mirrored section by section.

    KERAS_BACKEND=torch .venv/bin/python examples/keras_image_classification.py        # 2 CPU replicas
    KERAS_BACKEND=torch .venv/bin/python examples/keras_image_classification.py --replicas 1 --epochs 2

The example (keras-team/keras-io, examples/vision/image_classification_from_scratch.py) trains a
small Xception-like network on Kaggle's Cats vs Dogs: Keras's augmentation layers (RandomFlip,
RandomRotation), Rescaling, Conv2D, BatchNormalization, SeparableConv2D, residual adds, Dropout, a
one-unit sigmoid head with the loss string "binary_crossentropy" and metrics=["accuracy"], Adam,
ModelCheckpoint("save_at_{epoch}.keras"), validation data, then predict on one image. Each section
keeps its title and order; a `# keras.io:` comment gives the example's line where ours reads
differently. What changes:
- the 786 MB download becomes generated "cats" (a horizontal bar) and "dogs" (a vertical bar) at
  64x64 with noise, so the program runs anywhere in seconds, and the network is narrower;
- the augmentation runs inside the model (the example's "option 1"), so each replica augments its
  own part of the batch with its own random stream, in training only;
- the model is wrapped in mr.Model in the strategy's scope, and the callback is mr.callbacks';
- `jit_compile=True` is dropped: mr.Model refuses it for Keras models (eager, Keras's default on torch).
With the defaults (4 epochs of 8 steps) training accuracy reaches ~1.0 while validation accuracy
stays at chance (0.48): inference uses BatchNormalization's moving statistics, which at Keras's
momentum 0.99 need a few hundred steps to leave their initial values. Keras's own fit on one device
prints the same validation figures for this program; train longer to see them rise.
"""
from __future__ import annotations

import argparse
import os
import pathlib
import tempfile

os.environ.setdefault("KERAS_BACKEND", "torch")  # before keras is imported

import keras  # noqa: E402
import numpy as np  # noqa: E402
from keras import layers  # noqa: E402

import mirrored as mr  # noqa: E402


def load_data(n: int, image_size: tuple[int, int], seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Two classes of RGB images in [0, 255]: 0 ("cat") a horizontal bar, 1 ("dog") a vertical one."""
    rng = np.random.default_rng(seed)
    h, w = image_size
    images = rng.uniform(0, 96, size=(n, h, w, 3)).astype("float32")
    labels = rng.integers(0, 2, size=n)
    for i, label in enumerate(labels):
        at, width = rng.integers(h // 4, 3 * h // 4), max(2, h // 8)
        if label:
            images[i, :, at:at + width, :] += 150.0
        else:
            images[i, at:at + width, :, :] += 150.0
    return np.clip(images, 0, 255), labels.astype("float32")


def make_model(input_shape: tuple[int, ...], num_classes: int, width: int) -> keras.Model:
    """The example's make_model, with the augmentation first and `width` channels in the entry block
    (keras.io: 32 and 64, then blocks of 128, 256, 512, 728 and a 1024 SeparableConv2D)."""
    data_augmentation = keras.Sequential([layers.RandomFlip("horizontal"), layers.RandomRotation(0.1)])
    inputs = keras.Input(shape=input_shape)
    x = data_augmentation(inputs)  # keras.io: applied to the tf.data pipeline (option 2)

    # Entry block
    x = layers.Rescaling(1.0 / 255)(x)
    x = layers.Conv2D(width, 3, strides=2, padding="same")(x)
    x = layers.BatchNormalization()(x)
    x = layers.Activation("relu")(x)

    x = layers.Conv2D(2 * width, 3, padding="same")(x)
    x = layers.BatchNormalization()(x)
    x = layers.Activation("relu")(x)

    previous_block_activation = x  # Set aside residual

    for size in [4 * width, 8 * width]:  # keras.io: [128, 256, 512, 728]
        x = layers.Activation("relu")(x)
        x = layers.SeparableConv2D(size, 3, padding="same")(x)
        x = layers.BatchNormalization()(x)

        x = layers.Activation("relu")(x)
        x = layers.SeparableConv2D(size, 3, padding="same")(x)
        x = layers.BatchNormalization()(x)

        x = layers.MaxPooling2D(3, strides=2, padding="same")(x)

        # Project residual
        residual = layers.Conv2D(size, 1, strides=2, padding="same")(previous_block_activation)
        x = layers.add([x, residual])  # Add back residual
        previous_block_activation = x  # Set aside next residual

    x = layers.SeparableConv2D(16 * width, 3, padding="same")(x)  # keras.io: 1024
    x = layers.BatchNormalization()(x)
    x = layers.Activation("relu")(x)

    x = layers.GlobalAveragePooling2D()(x)
    units = 1 if num_classes == 2 else num_classes

    activation = "sigmoid" if num_classes == 2 else "softmax"
    x = layers.Dropout(0.5)(x)
    outputs = layers.Dense(units, activation=activation)(x)
    return keras.Model(inputs, outputs)


def main(argv: list[str] | None = None) -> dict[str, list[float]]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--replicas", type=int, default=2, help="CPU replicas")
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--examples", type=int, default=512, help="training examples (validation: a quarter)")
    parser.add_argument("--batch-size", type=int, default=64, help="global batch")
    parser.add_argument("--width", type=int, default=8, help="channels of the entry block's first Conv2D")
    parser.add_argument("--out", default=None, help="where the .keras checkpoints go (default: a temporary folder)")
    args = parser.parse_args(argv)

    # ## Load the data: generated Cats vs Dogs (keras.io: a download, then image_dataset_from_directory)
    image_size = (64, 64)  # keras.io: (180, 180)
    keras.utils.set_random_seed(1337)
    train_x, train_y = load_data(args.examples, image_size, seed=1)
    val_x, val_y = load_data(args.examples // 4, image_size, seed=2)

    # ## Build a model, inside the strategy's scope (keras.io: one device)
    strategy = mr.MirroredStrategy(devices=[f"cpu:{i}" for i in range(args.replicas)])
    print(f"Number of devices: {strategy.num_replicas_in_sync}")
    with strategy.scope():
        model = mr.Model(make_model(input_shape=image_size + (3,), num_classes=2, width=args.width))
        # ## Train the model
        model.compile(
            optimizer=keras.optimizers.Adam(1e-3),
            loss="binary_crossentropy",
            metrics=["accuracy"],
        )  # keras.io: jit_compile=True

    with tempfile.TemporaryDirectory() as tmp:
        out = pathlib.Path(args.out or tmp)
        out.mkdir(parents=True, exist_ok=True)
        callbacks = [mr.callbacks.ModelCheckpoint(str(out / "save_at_{epoch}.keras"))]
        history = model.fit(train_x, train_y, batch_size=args.batch_size, epochs=args.epochs, callbacks=callbacks,
                            validation_data=(val_x, val_y), verbose=2)
        saved = sorted(p.name for p in out.glob("save_at_*.keras"))
        print(f"checkpoints: {saved}")
        # A checkpoint is Keras's own archive: Keras reads it and predicts what the model predicts.
        last = keras.models.load_model(out / f"save_at_{args.epochs}.keras", compile=False)
        np.testing.assert_allclose(keras.ops.convert_to_numpy(last(val_x[:8], training=False)),
                                   model.predict(val_x[:8], verbose=0), atol=1e-5)

    model.check_in_sync()
    print(f"{strategy.num_replicas_in_sync} replicas in sync")

    # ## Run inference on new data (keras.io: a JPEG from disk)
    img_array = val_x[:1]  # Create batch axis
    predictions = model.predict(img_array, verbose=0)
    score = float(predictions[0][0])
    print(f"This image is {100 * (1 - score):.2f}% cat and {100 * score:.2f}% dog (label: {int(val_y[0])}).")
    return history.history


if __name__ == "__main__":
    main()
