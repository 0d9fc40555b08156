"""The reference workload as a tf.keras program writes it: keras.applications.ResNet50, built and compiled
in the strategy's scope, trained by Keras's own model.fit on every replica.

    .venv/bin/python examples/keras_resnet.py                                  # digits, 32x32, every GPU
    .venv/bin/python examples/keras_resnet.py --replicas 2 --epochs 1 --steps 5   # 2 logical CPU replicas
    .venv/bin/python examples/keras_resnet.py --dataset cassava --data-dir ~/tensorflow_datasets --image-size 224

Keras runs on PyTorch (KERAS_BACKEND=torch, set below before keras is imported). Against the tf.keras
program, three lines differ: `mr.MirroredStrategy()` for `tf.distribute.MirroredStrategy()`,
`mr.datasets.load` for `tfds.load` and `mr.data` for `tf.data`; the model, compile, fit and evaluate
are Keras's own, and each global batch is split over the replicas, as under tf.distribute. The data is
the embedded digits by default (grey 8x8 images, resized and given 3 channels), or Cassava as TFDS
prepares it (--dataset cassava); the batch is 32 per replica.
"""
from __future__ import annotations

import argparse
import os

os.environ.setdefault("KERAS_BACKEND", "torch")

import keras  # noqa: E402

import mirrored as mr  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dataset", default="digits", choices=["digits", "cassava"])
    parser.add_argument("--data-dir", default=None, help="TFDS data dir for cassava (default: ~/tensorflow_datasets)")
    parser.add_argument("--image-size", type=int, default=32, help="the model's input size (ResNet50: >= 32)")
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--steps", type=int, default=None, help="batches per epoch (default: the whole split)")
    parser.add_argument("--replicas", type=int, default=None, help="logical CPU replicas (default: every GPU)")
    args = parser.parse_args()

    devices = [f"cpu:{i}" for i in range(args.replicas)] if args.replicas else None
    strategy = mr.MirroredStrategy(devices=devices)  # tf.distribute.MirroredStrategy()
    BATCH = 32 * strategy.num_replicas_in_sync  # the GLOBAL batch
    if args.dataset == "digits":
        ds, info = mr.datasets.load("digits", with_info=True, as_supervised=True)
    else:
        ds, info = mr.datasets.load("cassava", with_info=True, as_supervised=True, data_dir=args.data_dir)
    size = (args.image_size, args.image_size)

    def scale(image, label):  # floats in [0, 1], HWC with 3 channels (the digits are grey)
        image = mr.data.images.resize(image, size) / 255.0
        return image.expand(*size, 3) if image.shape[-1] == 1 else image, label

    train = ds["train"].map(scale, num_parallel_calls=mr.data.AUTOTUNE).shuffle(1000).batch(BATCH)
    test = ds["test"].map(scale, num_parallel_calls=mr.data.AUTOTUNE).batch(BATCH)
    with strategy.scope():
        model = keras.applications.ResNet50(weights=None, input_shape=(*size, 3),
                                            classes=info.features["label"].num_classes)
        model.compile(loss="sparse_categorical_crossentropy",
                      optimizer=keras.optimizers.SGD(learning_rate=0.01, momentum=0.9), metrics=["accuracy"])
    model.fit(train.prefetch(mr.data.AUTOTUNE), epochs=args.epochs, steps_per_epoch=args.steps, verbose=2)
    results = model.evaluate(test, steps=args.steps, return_dict=True, verbose=0)
    print("test: " + " - ".join(f"{k}: {v:.4f}" for k, v in results.items()))
    strategy.check_in_sync(model)  # every replica's copy: identical weights, moving statistics, optimizer state
    print(f"{strategy.num_replicas_in_sync} replicas in sync")


if __name__ == "__main__":
    main()
