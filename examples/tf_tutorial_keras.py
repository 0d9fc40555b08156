"""TensorFlow's tutorial "Distributed training with Keras", ported to mirrored section by section.

    .venv/bin/python examples/tf_tutorial_keras.py                    # 2 logical CPU replicas, 12 epochs
    .venv/bin/python examples/tf_tutorial_keras.py --replicas 1 --epochs 2 --out runs/keras

The tutorial (tensorflow/docs, site/en/tutorials/distribute/keras.ipynb) trains a small CNN on MNIST
with MirroredStrategy and Model.fit: a strategy, the model compiled in its scope, TensorBoard,
ModelCheckpoint, LearningRateScheduler and a PrintLR callback, evaluation of the latest checkpoint,
then Model.save and loading without and with the strategy's scope. Each section below keeps its
title and order; a `# TF:` comment gives the tutorial's line where ours reads differently. MNIST
becomes the embedded 8x8 digits (no download), so the network is the tutorial's at a smaller scale.
What changes for PyTorch: the model is a torch module that returns logits (so the loss string
means from_logits=True), and torch's Conv2d wants channels first, so `scale` transposes each HWC
image (Keras's Conv2D takes channels last).
"""
from __future__ import annotations

import argparse
import os
import pathlib
import tempfile

import torch
from torch import nn

import mirrored as mr


def build_model() -> nn.Module:
    """The tutorial's Sequential: Conv2D(32, 3, relu), MaxPooling2D, Flatten, Dense(64, relu), Dense(10)."""
    return nn.Sequential(
        nn.Conv2d(1, 32, 3), nn.ReLU(),  # TF: Conv2D(32, 3, activation='relu', input_shape=(28, 28, 1))
        nn.MaxPool2d(2),
        nn.Flatten(),
        nn.Linear(32 * 3 * 3, 64), nn.ReLU(),  # 8x8 -> conv 6x6 -> pool 3x3 (MNIST: 28 -> 26 -> 13)
        nn.Linear(64, 10),
    )


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--replicas", type=int, default=2, help="logical CPU replicas; 0: every GPU (default 2)")
    parser.add_argument("--epochs", type=int, default=12, help="the tutorial's EPOCHS (default 12)")
    parser.add_argument("--batch-per-replica", type=int, default=64, help="BATCH_SIZE_PER_REPLICA (default 64)")
    parser.add_argument("--out", default=None, help="where checkpoints, logs and the saved model go (default: a "
                                                    "temporary directory)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    torch.manual_seed(args.seed)  # the same initial weights for any replica count
    out = pathlib.Path(args.out or tempfile.mkdtemp(prefix="tf_tutorial_keras-"))

    # ## Download the dataset
    datasets, info = mr.datasets.load("digits", with_info=True, as_supervised=True)  # TF: tfds.load(name='mnist', ...)
    mnist_train, mnist_test = datasets["train"], datasets["test"]

    # ## Define the distribution strategy
    if args.replicas:
        strategy = mr.MirroredStrategy(devices=[f"cpu:{i}" for i in range(args.replicas)])
    else:
        strategy = mr.MirroredStrategy()  # TF: tf.distribute.MirroredStrategy(): every GPU
    print("Number of devices: {}".format(strategy.num_replicas_in_sync))

    # ## Set up the input pipeline
    num_train_examples = info.splits["train"].num_examples
    num_test_examples = info.splits["test"].num_examples
    print(f"{num_train_examples} training and {num_test_examples} test examples")
    BUFFER_SIZE = 10000
    BATCH_SIZE_PER_REPLICA = args.batch_per_replica
    BATCH_SIZE = BATCH_SIZE_PER_REPLICA * strategy.num_replicas_in_sync

    def scale(image, label):
        image = image.permute(2, 0, 1).float()  # TF: tf.cast(image, tf.float32) (HWC; torch's Conv2d wants CHW)
        image /= 255
        return image, label

    train_dataset = mnist_train.map(scale).cache().shuffle(BUFFER_SIZE, seed=args.seed).batch(BATCH_SIZE)
    eval_dataset = mnist_test.map(scale).batch(BATCH_SIZE)

    # ## Create the model and instantiate the optimizer
    with strategy.scope():
        model = mr.Model(build_model())
        model.compile(loss=mr.losses.SparseCategoricalCrossentropy(from_logits=True),
                      optimizer=mr.optimizers.Adam(learning_rate=0.001),
                      metrics=["accuracy"])

    # ## Define the callbacks
    checkpoint_dir = os.path.join(out, "training_checkpoints")
    checkpoint_prefix = os.path.join(checkpoint_dir, "ckpt_{epoch:04d}.weights.safetensors")  # TF: .weights.h5

    def decay(epoch):
        if epoch < 3:
            return 1e-3
        elif epoch >= 3 and epoch < 7:
            return 1e-4
        else:
            return 1e-5

    class PrintLR(mr.callbacks.Callback):
        def on_epoch_end(self, epoch, logs=None):
            print("\nLearning rate for epoch {} is {}".format(epoch + 1, model.optimizer.learning_rate))  # TF: .numpy()

    callbacks = [
        mr.callbacks.TensorBoard(log_dir=os.path.join(out, "logs")),
        mr.callbacks.ModelCheckpoint(filepath=checkpoint_prefix, save_weights_only=True),
        mr.callbacks.LearningRateScheduler(decay),
        PrintLR(),
    ]

    # ## Train and evaluate
    EPOCHS = args.epochs
    history = model.fit(train_dataset, epochs=EPOCHS, callbacks=callbacks, verbose=2)
    print(sorted(os.listdir(checkpoint_dir)))  # TF: !ls {checkpoint_dir}

    latest_checkpoint = sorted(pathlib.Path(checkpoint_dir).glob("*"))[-1]
    model.load_weights(latest_checkpoint)
    eval_loss, eval_acc = model.evaluate(eval_dataset, verbose=0)
    print("Eval loss: {}, Eval accuracy: {}".format(eval_loss, eval_acc))
    print(sorted(os.listdir(os.path.join(out, "logs"))))  # TF: !ls -sh ./logs

    # ## Save the model
    path = os.path.join(out, "my_model.safetensors")  # TF: 'my_model.keras'
    model.save(path)

    # Load the model without Strategy.scope: one replica, where the module lives. A torch module's
    # architecture is code, so load() is given a fresh one to fill (TF: tf.keras.models.load_model(path)).
    unreplicated_model = mr.Model.load(path, module=build_model())
    unreplicated_model.compile(loss=mr.losses.SparseCategoricalCrossentropy(from_logits=True),
                               optimizer=mr.optimizers.Adam(), metrics=["accuracy"])
    unreplicated = unreplicated_model.evaluate(eval_dataset, verbose=0)
    print("Eval loss: {}, Eval Accuracy: {}".format(*unreplicated))

    # Load the model with Strategy.scope.
    with strategy.scope():
        replicated_model = mr.Model.load(path, module=build_model())
        replicated_model.compile(loss=mr.losses.SparseCategoricalCrossentropy(from_logits=True),
                                 optimizer=mr.optimizers.Adam(), metrics=["accuracy"])
        replicated = replicated_model.evaluate(eval_dataset, verbose=0)
        print("Eval loss: {}, Eval Accuracy: {}".format(*replicated))

    model.check_in_sync()  # mirrored: every replica's weights are the same bits
    return {"model": model, "history": history.history, "eval": (eval_loss, eval_acc),
            "unreplicated": unreplicated, "replicated": replicated, "out": out}


if __name__ == "__main__":
    main()
