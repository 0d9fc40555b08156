"""A custom training loop with strategy.run and strategy.reduce: an MLP learns a teacher network's classes.

    .venv/bin/python examples/custom_loop.py                  # 2 logical CPU replicas, 5 epochs (~5 s)
    .venv/bin/python examples/custom_loop.py --replicas 4 --epochs 2
    .venv/bin/python examples/custom_loop.py --checkpoint-dir runs/loop   # run it again to continue

The data is synthetic and offline: 20-dimensional Gaussian inputs labelled with the argmax of a
fixed, randomly initialised "teacher" network (4 classes); the test set holds other inputs labelled
by the same teacher, so its accuracy shows what the student MLP learned, not what it memorised.
Each replica sees 32 examples per step, so the GLOBAL batch is 32 * num_replicas_in_sync. Each
replica divides its summed loss by that global batch, and the optimizer SUMs the gradients across
replicas, which gives the single-device gradient of the whole batch. Accuracy is a count of correct
predictions summed over replicas, divided by the total.

The learning rate follows an exponential decay, step by step. After every epoch a
tf.train.CheckpointManager-style manager saves the weights, the optimizer (its momentum and its
step count, so the schedule), the epoch and the data iterator; a run started again with the same
--checkpoint-dir continues where the last one saved, with the data order it would have had.
"""
from __future__ import annotations

import argparse
import shutil
import tempfile
import time

import torch
import torch.nn.functional as F
from torch import nn

import mirrored as mr

PER_REPLICA_BATCH = 32
FEATURES, CLASSES, HIDDEN = 20, 4, 64


def make_data(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """n examples labelled by a fixed teacher network (the same teacher for every seed)."""
    teacher_gen = torch.Generator().manual_seed(1234)
    w1 = torch.randn(FEATURES, 32, generator=teacher_gen) / FEATURES**0.5  # unit-scale pre-activations
    w2 = torch.randn(32, CLASSES, generator=teacher_gen)
    x = torch.randn(n, FEATURES, generator=torch.Generator().manual_seed(seed))
    y = (torch.tanh(x @ w1) @ w2).argmax(dim=1)
    return x, y


def train_batches(x: torch.Tensor, y: torch.Tensor, batch_size: int, seed: int) -> mr.data.Dataset:
    """GLOBAL batches (x, y), reshuffled on every pass (pass k shuffles with a seed derived from (seed,
    k)), repeated without end: the loop takes steps_per_epoch of them an epoch from one iterator, which
    the checkpoint saves. The short last batch is dropped, so every step divides by the same size."""
    ds = mr.data.Dataset.from_tensor_slices((x, y)).shuffle(len(x), seed=seed)
    return ds.batch(batch_size, drop_remainder=True).repeat()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--replicas", type=int, default=2, help="logical CPU replicas (default 2)")
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--checkpoint-dir", default=None,
                        help="where checkpoints go; an earlier run's there are continued (default: a temporary "
                             "directory, deleted at the end)")
    args = parser.parse_args()
    if args.replicas < 1 or args.epochs < 1:
        parser.error(f"--replicas ({args.replicas}) and --epochs ({args.epochs}) must be at least 1")

    torch.manual_seed(args.seed)
    strategy = mr.MirroredStrategy(devices=[f"cpu:{i}" for i in range(args.replicas)])
    global_batch_size = PER_REPLICA_BATCH * strategy.num_replicas_in_sync
    train_x, train_y = make_data(8192, seed=args.seed)
    test_x, test_y = make_data(2048, seed=args.seed + 1)
    steps_per_epoch = len(train_x) // global_batch_size
    train_iterator = iter(strategy.experimental_distribute_dataset(
        train_batches(train_x, train_y, global_batch_size, seed=args.seed)))
    test_ds = strategy.experimental_distribute_dataset(
        mr.data.Dataset.from_tensor_slices((test_x, test_y)).batch(global_batch_size))
    chance = torch.bincount(test_y, minlength=CLASSES).max().item() / len(test_y)  # always guessing the top class

    net = nn.Sequential(nn.Linear(FEATURES, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, HIDDEN), nn.ReLU(),
                        nn.Linear(HIDDEN, CLASSES))
    # Keras's optimizer with a schedule, evaluated at the optimizer's step count before every update:
    # the rate shrinks smoothly by 0.7 an epoch.
    sgd = mr.optimizers.SGD(learning_rate=mr.optimizers.schedules.ExponentialDecay(
        args.lr, decay_steps=steps_per_epoch, decay_rate=0.7), momentum=0.9)
    with strategy.scope():
        mnet = strategy.mirror(net)
        opt = strategy.mirror_optimizer(sgd, mnet)  # one torch SGD per replica, built by the recipe
        epoch = mr.Variable(0, trainable=False)  # a mirrored counter: which epoch comes next

    # TF's checkpoint idiom: restore the latest checkpoint if there is one (None on a first run).
    directory = args.checkpoint_dir or tempfile.mkdtemp(prefix="custom_loop-")
    checkpoint = mr.train.Checkpoint(model=mnet, optimizer=opt, iterator=train_iterator, epoch=epoch)
    manager = mr.train.CheckpointManager(checkpoint, directory, max_to_keep=2)
    checkpoint.restore(manager.latest_checkpoint)
    if manager.latest_checkpoint:
        print(f"continuing from {manager.latest_checkpoint} at epoch {int(epoch) + 1}")

    def train_step(x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = mnet(x)
        per_example = F.cross_entropy(logits, y, reduction="none")
        # sum / GLOBAL batch: the replicas' gradients then SUM to the gradient of the batch mean.
        loss = mr.losses.compute_average_loss(per_example, global_batch_size=global_batch_size)
        loss.backward()
        opt.step()  # all-reduces this replica's gradients (SUM) with the others', then updates
        opt.zero_grad()
        return loss.detach(), (logits.argmax(dim=1) == y).sum()

    def test_step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():  # grad mode is per thread: it must be switched off inside the replica
            return (mnet(x).argmax(dim=1) == y).sum()

    def accuracy(correct_counts: list[torch.Tensor], total: int) -> float:
        return sum(c.item() for c in correct_counts) / total

    print(f"{strategy.num_replicas_in_sync} replicas, global batch {global_batch_size}, "
          f"{len(train_x)} training examples, chance accuracy {chance:.3f}, checkpoints in {directory}")
    start = time.perf_counter()
    test_correct = []
    while int(epoch) < args.epochs:
        mnet.train()
        rate = sgd.learning_rate
        losses, correct = [], []
        for _ in range(steps_per_epoch):
            loss, hits = strategy.run(train_step, args=next(train_iterator))
            losses.append(strategy.reduce(mr.ReduceOp.SUM, loss, axis=None))  # this batch's mean loss
            correct.append(strategy.reduce(mr.ReduceOp.SUM, hits, axis=None))
        epoch.assign_add(1)
        saved = manager.save()
        mnet.eval()
        test_correct = [strategy.reduce(mr.ReduceOp.SUM, strategy.run(test_step, args=(x, y)), axis=None)
                        for x, y in test_ds]
        print(f"epoch {int(epoch)}: learning rate {rate:.4f}  loss {torch.stack(losses).mean().item():.4f}  "
              f"accuracy {accuracy(correct, steps_per_epoch * global_batch_size):.3f}  test accuracy "
              f"{accuracy(test_correct, len(test_x)):.3f}  ({time.perf_counter() - start:.1f} s, saved {saved})")
    if not test_correct:  # the checkpoint was already at the last epoch: evaluate what it holds
        mnet.eval()
        test_correct = [strategy.reduce(mr.ReduceOp.SUM, strategy.run(test_step, args=(x, y)), axis=None)
                        for x, y in test_ds]

    if args.checkpoint_dir is None:
        shutil.rmtree(directory)
    strategy.check_in_sync(mnet)  # raises if any replica's copy drifted by a single bit
    strategy.check_in_sync(opt)
    print("replicas in sync: parameters and optimizer state are bitwise identical")
    print(f"final test accuracy: {accuracy(test_correct, len(test_x)):.3f} (chance {chance:.3f})")


if __name__ == "__main__":
    main()
