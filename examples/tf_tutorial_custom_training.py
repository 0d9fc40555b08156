"""TensorFlow's tutorial "Custom training with tf.distribute.Strategy", ported to mirrored section by section.

    .venv/bin/python examples/tf_tutorial_custom_training.py                 # 2 logical CPU replicas, 10 epochs
    .venv/bin/python examples/tf_tutorial_custom_training.py --replicas 1 --epochs 2

The tutorial (tensorflow/docs, site/en/tutorials/distribute/custom_training.ipynb) trains a CNN with
L2 regularization on Fashion-MNIST in a loop of its own: datasets distributed by the strategy, a
loss scaled by the GLOBAL batch (tf.nn.compute_average_loss) plus the regularization scaled by the
replica count (tf.nn.scale_regularization_loss), train and test steps run by strategy.run, metrics
updated inside them, a tf.train.Checkpoint saved every other epoch and restored, without a
strategy, into a new model; then the same training driven by an iterator for a fixed number of
steps, and by a function that runs a whole epoch (the tutorial's tf.function). Each section keeps its title
and order; a `# TF:` comment gives the tutorial's line where ours reads differently. Fashion-MNIST
becomes the embedded 8x8 digits (no download), as numpy arrays like keras.datasets gives, so the
convolutions pad ("same"): two unpadded 3x3 convolutions and pools do not fit in 8x8.

What changes for PyTorch: the step calls loss.backward() and optimizer.step() where TF records a
GradientTape and calls apply_gradients; the model is a torch module (channels first, so the images
are transposed once), made one copy per replica by strategy.mirror; and Keras's kernel_regularizer
becomes the L2 sum that Keras would add to model.losses, computed from the module's weights.

--denominator global divides every batch by GLOBAL_BATCH_SIZE, the tutorial's "special cases"
alternative to its default (each replica divides by num_replicas_in_sync x its own part's size),
which makes a short last batch that splits unevenly weigh each replica's examples alike, so any
replica count gives the single-device answer.
"""
from __future__ import annotations

import argparse
import os
import tempfile

import numpy as np
import torch
from torch import nn

import mirrored as mr

L2 = 1e-5  # TF: tf.keras.regularizers.L2(1e-5) on every kernel


def load_data() -> tuple[tuple[np.ndarray, np.ndarray], tuple[np.ndarray, np.ndarray]]:
    """The digits as numpy arrays, as fashion_mnist.load_data() returns Fashion-MNIST: uint8 images
    (N, 8, 8, 1) and int64 labels (N,)."""
    def arrays(split: str) -> tuple[np.ndarray, np.ndarray]:
        ds = mr.datasets.load("digits", split=split, as_supervised=True)
        images, labels = zip(*ds.as_numpy_iterator())
        return np.stack(images), np.array(labels)
    return arrays("train"), arrays("test")


def create_model() -> nn.Module:
    """The tutorial's create_model(): two Conv2D(3x3, relu) + MaxPooling2D, Dense(64, relu), Dense(10)."""
    return nn.Sequential(
        nn.Conv2d(1, 32, 3, padding="same"), nn.ReLU(), nn.MaxPool2d(2),   # 8x8 -> 4x4
        nn.Conv2d(32, 64, 3, padding="same"), nn.ReLU(), nn.MaxPool2d(2),  # 4x4 -> 2x2
        nn.Flatten(),
        nn.Linear(64 * 2 * 2, 64), nn.ReLU(),
        nn.Linear(64, 10),
    )


def regularization_losses(model) -> list[torch.Tensor]:
    """What Keras collects in model.losses for kernel_regularizer=L2(1e-5): 1e-5 x the sum of squares of
    each kernel (weights, not biases). Inside strategy.run, `model.modules()` are the replica's own copies."""
    return [L2 * (m.weight ** 2).sum() for m in model.modules() if isinstance(m, (nn.Conv2d, nn.Linear))]


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--replicas", type=int, default=2, help="logical CPU replicas; 0: every GPU (default 2)")
    parser.add_argument("--epochs", type=int, default=10, help="the tutorial's EPOCHS (default 10)")
    parser.add_argument("--batch-per-replica", type=int, default=64, help="BATCH_SIZE_PER_REPLICA (default 64)")
    parser.add_argument("--denominator", choices=["replica", "global"], default="replica",
                        help="what compute_average_loss divides by: the tutorial's default (replica), or "
                             "GLOBAL_BATCH_SIZE (global)")
    parser.add_argument("--out", default=None, help="where checkpoints go (default: a temporary directory)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    torch.manual_seed(args.seed)  # the same initial weights for any replica count
    out = args.out or tempfile.mkdtemp(prefix="tf_tutorial_custom_training-")

    # ## Download the Fashion MNIST dataset (here: the digits)
    (train_images, train_labels), (test_images, test_labels) = load_data()
    # The images already have their channel axis: (N, 8, 8, 1). torch's Conv2d wants it first.
    train_images = train_images.transpose(0, 3, 1, 2)  # TF: train_images[..., None]
    test_images = test_images.transpose(0, 3, 1, 2)
    train_images = train_images / np.float32(255)
    test_images = test_images / np.float32(255)

    # ## Create a strategy to distribute the variables and the graph
    if args.replicas:
        strategy = mr.MirroredStrategy(devices=[f"cpu:{i}" for i in range(args.replicas)])
    else:
        strategy = mr.MirroredStrategy()  # TF: tf.distribute.MirroredStrategy(): every GPU
    print("Number of devices: {}".format(strategy.num_replicas_in_sync))

    # ## Setup input pipeline
    BUFFER_SIZE = len(train_images)
    BATCH_SIZE_PER_REPLICA = args.batch_per_replica
    GLOBAL_BATCH_SIZE = BATCH_SIZE_PER_REPLICA * strategy.num_replicas_in_sync
    EPOCHS = args.epochs

    train_dataset = mr.data.Dataset.from_tensor_slices((train_images, train_labels)).shuffle(
        BUFFER_SIZE, seed=args.seed).batch(GLOBAL_BATCH_SIZE)
    test_dataset = mr.data.Dataset.from_tensor_slices((test_images, test_labels)).batch(GLOBAL_BATCH_SIZE)
    train_dist_dataset = strategy.experimental_distribute_dataset(train_dataset)
    test_dist_dataset = strategy.experimental_distribute_dataset(test_dataset)

    # ## Create the model
    checkpoint_dir = os.path.join(out, "training_checkpoints")
    checkpoint_prefix = os.path.join(checkpoint_dir, "ckpt")

    # ## Define the loss function
    with strategy.scope():
        # Set reduction to "none" so you can do the reduction yourself.
        loss_object = mr.losses.SparseCategoricalCrossentropy(from_logits=True, reduction="none")

        def compute_loss(labels, predictions, model_losses):
            per_example_loss = loss_object(labels, predictions)
            if args.denominator == "global":
                loss = mr.losses.compute_average_loss(per_example_loss, global_batch_size=GLOBAL_BATCH_SIZE)
            else:
                loss = mr.losses.compute_average_loss(per_example_loss)
            if model_losses:
                loss += mr.losses.scale_regularization_loss(sum(model_losses))  # TF: tf.add_n(model_losses)
            return loss

    # ## Define the metrics to track loss and accuracy
    with strategy.scope():
        test_loss = mr.metrics.Mean(name="test_loss")
        train_accuracy = mr.metrics.SparseCategoricalAccuracy(name="train_accuracy")
        test_accuracy = mr.metrics.SparseCategoricalAccuracy(name="test_accuracy")

    # ## Training loop
    # A model, an optimizer, and a checkpoint must be created under `strategy.scope`.
    with strategy.scope():
        model = strategy.mirror(create_model())  # TF: create_model() (variables made in the scope are mirrored)
        optimizer = strategy.mirror_optimizer(mr.optimizers.Adam(learning_rate=0.001), model)
        checkpoint = mr.train.Checkpoint(optimizer=optimizer, model=model)

    def train_step(inputs):
        images, labels = inputs
        model.train()  # TF: model(images, training=True)
        predictions = model(images)
        loss = compute_loss(labels, predictions, regularization_losses(model))  # TF: model.losses
        loss.backward()  # TF: tape.gradient(loss, model.trainable_variables)
        optimizer.step()  # TF: optimizer.apply_gradients(...): sums the replicas' gradients, then updates
        optimizer.zero_grad()
        train_accuracy.update_state(labels, predictions)
        return loss.detach()

    def test_step(inputs):
        images, labels = inputs
        model.eval()  # TF: model(images, training=False)
        with torch.no_grad():
            predictions = model(images)
        t_loss = loss_object(labels, predictions)
        test_loss.update_state(t_loss)
        test_accuracy.update_state(labels, predictions)

    # `run` replicates the provided computation and runs it with the distributed input.
    def distributed_train_step(dataset_inputs):  # TF: @tf.function
        per_replica_losses = strategy.run(train_step, args=(dataset_inputs,))
        return strategy.reduce(mr.ReduceOp.SUM, per_replica_losses, axis=None)

    def distributed_test_step(dataset_inputs):
        return strategy.run(test_step, args=(dataset_inputs,))

    for epoch in range(EPOCHS):
        # TRAIN LOOP
        total_loss = 0.0
        num_batches = 0
        for x in train_dist_dataset:
            total_loss += distributed_train_step(x)
            num_batches += 1
        train_loss = total_loss / num_batches

        # TEST LOOP
        for x in test_dist_dataset:
            distributed_test_step(x)

        if epoch % 2 == 0:
            checkpoint.save(checkpoint_prefix)

        template = "Epoch {}, Loss: {}, Accuracy: {}, Test Loss: {}, Test Accuracy: {}"
        print(template.format(epoch + 1, train_loss, train_accuracy.result() * 100, test_loss.result(),
                              test_accuracy.result() * 100))

        test_loss.reset_state()  # TF: reset_states() (Keras 2's name)
        train_accuracy.reset_state()
        test_accuracy.reset_state()

    # ## Restore the latest checkpoint and test
    # A model checkpointed with a strategy can be restored with or without a strategy.
    eval_accuracy = mr.metrics.SparseCategoricalAccuracy(name="eval_accuracy")
    new_model = create_model()
    # TF restores into an optimizer that is not built yet (its slots are made, and filled, on first use);
    # a torch optimizer's state is per parameter, so it is built on the new model's parameters first.
    new_optimizer = mr.optimizers.Adam().build(new_model.parameters())  # TF: tf.keras.optimizers.Adam()
    test_dataset = mr.data.Dataset.from_tensor_slices((test_images, test_labels)).batch(GLOBAL_BATCH_SIZE)

    def eval_step(images, labels):
        new_model.eval()  # TF: new_model(images, training=False)
        with torch.no_grad():
            predictions = new_model(images)
        eval_accuracy(labels, predictions)

    checkpoint = mr.train.Checkpoint(optimizer=new_optimizer, model=new_model)
    checkpoint.restore(mr.train.latest_checkpoint(checkpoint_dir))
    for images, labels in test_dataset:
        eval_step(images, labels)
    print("Accuracy after restoring the saved model without strategy: {}".format(eval_accuracy.result() * 100))

    # ## Alternate ways of iterating over a dataset
    # ### Using iterators: a given number of steps rather than whole passes.
    for epoch in range(EPOCHS):  # TF: `for _ in range(EPOCHS)`, which prints the last epoch's number each time
        total_loss = 0.0
        num_batches = 0
        train_iter = iter(train_dist_dataset)
        for _ in range(10):
            total_loss += distributed_train_step(next(train_iter))
            num_batches += 1
        average_train_loss = total_loss / num_batches
        template = "Epoch {}, Loss: {}, Accuracy: {}"
        print(template.format(epoch + 1, average_train_loss, train_accuracy.result() * 100))
        train_accuracy.reset_state()

    # ### Iterating inside a tf.function: torch has no graph functions, so the epoch is a plain function.
    def distributed_train_epoch(dataset):  # TF: @tf.function
        total_loss = 0.0
        num_batches = 0
        for x in dataset:
            per_replica_losses = strategy.run(train_step, args=(x,))
            total_loss += strategy.reduce(mr.ReduceOp.SUM, per_replica_losses, axis=None)
            num_batches += 1
        return total_loss / num_batches  # TF: tf.cast(num_batches, dtype=tf.float32)

    for epoch in range(EPOCHS):
        train_loss = distributed_train_epoch(train_dist_dataset)
        template = "Epoch {}, Loss: {}, Accuracy: {}"
        print(template.format(epoch + 1, train_loss, train_accuracy.result() * 100))
        train_accuracy.reset_state()

    strategy.check_in_sync([model, optimizer])  # mirrored: every replica's weights and Adam state, bit for bit
    return {"model": model, "optimizer": optimizer, "restored_model": new_model,
            "restored_accuracy": float(eval_accuracy.result()), "checkpoint_dir": checkpoint_dir}


if __name__ == "__main__":
    main()
