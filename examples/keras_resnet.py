"""The reference workload in Keras 3 form: keras.applications.ResNet50 on mr.MirroredStrategy.

    .venv/bin/python examples/keras_resnet.py                                  # digits, 32x32, every GPU
    .venv/bin/python examples/keras_resnet.py --replicas 2 --epochs 1 --steps 5   # 2 logical CPU replicas
    .venv/bin/python examples/keras_resnet.py --dataset cassava --data-dir ~/tensorflow_datasets --image-size 224

Keras runs on PyTorch (KERAS_BACKEND=torch, set below before keras is imported), so its model is a
torch module: the functional ResNet50, a Keras optimizer and Keras's loss string are used as in a
tf.keras program, and the one change is `mr.Model(net)` around the model, in the strategy's scope.
The data comes from mr.datasets (the embedded digits by default, Cassava as TFDS prepares it with
--dataset cassava); the batch is 32 per replica.
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
    strategy = mr.MirroredStrategy(devices=devices)
    batch = 32 * strategy.num_replicas_in_sync  # the GLOBAL batch
    if args.dataset == "digits":
        ds = mr.datasets.load("digits", as_supervised=True)
        train_split, test_split, classes = ds["train"], ds["test"], 10
    else:
        ds, info = mr.datasets.load("cassava", with_info=True, as_supervised=True, data_dir=args.data_dir)
        train_split, test_split, classes = ds["train"], ds["test"], info.features["label"].num_classes
    size = (args.image_size, args.image_size)

    def scale(image, label):  # HWC floats in [0, 1], 3 channels (the digits are grey), as Keras's channels_last
        image = mr.data.images.resize(image, size) / 255.0
        return image.expand(*size, 3) if image.shape[-1] == 1 else image, label

    train = train_split.map(scale, num_parallel_calls=mr.data.AUTOTUNE).shuffle(1000).batch(batch)
    test = test_split.map(scale, num_parallel_calls=mr.data.AUTOTUNE).batch(batch)
    with strategy.scope():
        net = keras.applications.ResNet50(weights=None, input_shape=(*size, 3), classes=classes)
        model = mr.Model(net)
        model.compile(optimizer=keras.optimizers.SGD(learning_rate=0.01, momentum=0.9),
                      loss="sparse_categorical_crossentropy", metrics=["accuracy"])
    model.fit(train.prefetch(mr.data.AUTOTUNE), epochs=args.epochs, steps_per_epoch=args.steps, verbose=2)
    results = model.evaluate(test, steps=args.steps, return_dict=True, verbose=0)
    print("test: " + " - ".join(f"{k}: {v:.4f}" for k, v in results.items()))
    model.check_in_sync()  # every replica ended with identical weights, moving statistics and optimizer state
    print(f"{strategy.num_replicas_in_sync} replicas in sync")


if __name__ == "__main__":
    main()
