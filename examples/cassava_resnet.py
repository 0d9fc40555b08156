"""The reference workload: a ResNet trained on Cassava leaf disease (5 classes) read as TFDS prepares it.

    .venv/bin/python examples/cassava_resnet.py --data-dir ~/tensorflow_datasets          # prepared by TFDS
    .venv/bin/python examples/cassava_resnet.py --download                                 # fetch + prepare (1.35 GB)
    .venv/bin/python examples/cassava_resnet.py --data-dir ../shared/fixtures/tfds --image-size 32 \
        --model resnet18 --epochs 1 --replicas 2                                           # the tiny test copy

Every visible GPU gets a replica (or --replicas N logical CPU replicas); the batch is 32 per replica.
"""
from __future__ import annotations

import argparse

import mirrored as mr


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data-dir", default=None, help="TFDS data dir (default: $TFDS_DATA_DIR or ~/tensorflow_datasets)")
    parser.add_argument("--download", action="store_true", help="download and prepare cassava if missing")
    parser.add_argument("--model", default="resnet50", choices=["resnet18", "resnet34", "resnet50"])
    parser.add_argument("--image-size", type=int, default=224)
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--replicas", type=int, default=None, help="logical CPU replicas (default: every GPU)")
    args = parser.parse_args()
    mr.tune_allocator()  # glibc: reuse freed image/batch memory instead of fresh pages (see its docstring)

    devices = [f"cpu:{i}" for i in range(args.replicas)] if args.replicas else None
    strategy = mr.MirroredStrategy(devices=devices)
    batch = 32 * strategy.num_replicas_in_sync  # the GLOBAL batch
    ds, info = mr.datasets.load("cassava", with_info=True, as_supervised=True, data_dir=args.data_dir,
                                download=args.download)
    size = (args.image_size, args.image_size)

    def scale(image, label):
        return mr.data.images.resize(image, size) / 255.0, label

    train = ds["train"].map(scale, num_parallel_calls=mr.data.AUTOTUNE).shuffle(1000).batch(batch).prefetch(mr.data.AUTOTUNE)
    validation = ds["validation"].map(scale, num_parallel_calls=mr.data.AUTOTUNE).batch(batch).prefetch(mr.data.AUTOTUNE)
    test = ds["test"].map(scale, num_parallel_calls=mr.data.AUTOTUNE).batch(batch)
    with strategy.scope():
        model = mr.Model(mr.models.get(args.model, num_classes=info.features["label"].num_classes))
        model.compile(loss="sparse_categorical_crossentropy",
                      optimizer=mr.optimizers.SGD(learning_rate=0.01, momentum=0.9), metrics=["accuracy"])
    model.fit(train, epochs=args.epochs, validation_data=validation)
    results = model.evaluate(test, return_dict=True, verbose=0)
    print("test: " + " - ".join(f"{k}: {v:.4f}" for k, v in results.items()))
    model.check_in_sync()  # every replica ended with bitwise-identical weights and optimizer state


if __name__ == "__main__":
    main()
