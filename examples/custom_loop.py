"""A custom training loop with strategy.run and strategy.reduce: an MLP learns a teacher network's classes.

    .venv/bin/python examples/custom_loop.py                  # 2 logical CPU replicas, 5 epochs (~5 s)
    .venv/bin/python examples/custom_loop.py --replicas 4 --epochs 2

The data is synthetic and offline: 20-dimensional Gaussian inputs labelled with the argmax of a
fixed, randomly initialised "teacher" network (4 classes); the test set holds other inputs labelled
by the same teacher, so its accuracy shows what the student MLP learned, not what it memorised. Each replica sees 32 examples per step, so the GLOBAL batch is
32 * num_replicas_in_sync. Each replica divides its summed loss by that global batch, and the
optimizer SUMs the gradients across replicas, which gives the single-device gradient of the whole
batch. Accuracy is a count of correct predictions summed over replicas, divided by the total.
"""
from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F
from torch import nn

import mirrored as mr

try:
    from mirrored.data import Dataset
except ImportError:  # TODO: drop this fallback once mirrored.data ships with every install
    Dataset = None

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


def global_batches(x: torch.Tensor, y: torch.Tensor, batch_size: int, shuffle: bool, seed: int):
    """A re-iterable of GLOBAL batches (x, y), reshuffled on every pass when `shuffle`. Training drops
    the short last batch, so every step divides its loss by the same global batch size."""
    if Dataset is None:
        return _ListBatches(x, y, batch_size, shuffle, seed)
    ds = Dataset.from_tensor_slices((x, y))
    if shuffle:
        ds = ds.shuffle(len(x), seed=seed)  # pass k shuffles with a seed derived from (seed, k)
    return ds.batch(batch_size, drop_remainder=shuffle)


class _ListBatches:
    """The fallback without mirrored.data: pass k shuffles with seed + k, so runs are reproducible."""

    def __init__(self, x: torch.Tensor, y: torch.Tensor, batch_size: int, shuffle: bool, seed: int):
        self.x, self.y, self.batch_size, self.shuffle, self.seed = x, y, batch_size, shuffle, seed
        self.passes = 0

    def __iter__(self):
        n = len(self.x)
        order = torch.arange(n)
        if self.shuffle:
            order = torch.randperm(n, generator=torch.Generator().manual_seed(self.seed + self.passes))
            n -= n % self.batch_size
        self.passes += 1
        for i in range(0, n, self.batch_size):
            yield self.x[order[i:i + self.batch_size]], self.y[order[i:i + self.batch_size]]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--replicas", type=int, default=2, help="logical CPU replicas (default 2)")
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    if args.replicas < 1 or args.epochs < 1:
        parser.error(f"--replicas ({args.replicas}) and --epochs ({args.epochs}) must be at least 1")

    torch.manual_seed(args.seed)
    strategy = mr.MirroredStrategy(devices=[f"cpu:{i}" for i in range(args.replicas)])
    global_batch_size = PER_REPLICA_BATCH * strategy.num_replicas_in_sync
    train_x, train_y = make_data(8192, seed=args.seed)
    test_x, test_y = make_data(2048, seed=args.seed + 1)
    train_ds = strategy.experimental_distribute_dataset(
        global_batches(train_x, train_y, global_batch_size, shuffle=True, seed=args.seed))
    test_ds = strategy.experimental_distribute_dataset(
        global_batches(test_x, test_y, global_batch_size, shuffle=False, seed=args.seed))
    chance = torch.bincount(test_y, minlength=CLASSES).max().item() / len(test_y)  # always guessing the top class

    net = nn.Sequential(nn.Linear(FEATURES, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, HIDDEN), nn.ReLU(),
                        nn.Linear(HIDDEN, CLASSES))
    with strategy.scope():
        mnet = strategy.mirror(net)
        opt = strategy.mirror_optimizer(torch.optim.SGD, mnet, lr=args.lr, momentum=0.9)

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
          f"{len(train_x)} training examples, chance accuracy {chance:.3f}")
    start = time.perf_counter()
    for epoch in range(1, args.epochs + 1):
        mnet.train()
        losses, correct, seen = [], [], 0
        for x, y in train_ds:
            loss, hits = strategy.run(train_step, args=(x, y))
            losses.append(strategy.reduce(mr.ReduceOp.SUM, loss, axis=None))  # this batch's mean loss
            correct.append(strategy.reduce(mr.ReduceOp.SUM, hits, axis=None))
            seen += global_batch_size
        mnet.eval()
        test_correct = [strategy.reduce(mr.ReduceOp.SUM, strategy.run(test_step, args=(x, y)), axis=None)
                        for x, y in test_ds]
        print(f"epoch {epoch}: loss {torch.stack(losses).mean().item():.4f}  accuracy "
              f"{accuracy(correct, seen):.3f}  test accuracy {accuracy(test_correct, len(test_x)):.3f}  "
              f"({time.perf_counter() - start:.1f} s)")

    strategy.check_in_sync(mnet)  # raises if any replica's copy drifted by a single bit
    strategy.check_in_sync(opt)
    print("replicas in sync: parameters and optimizer state are bitwise identical")
    print(f"final test accuracy: {accuracy(test_correct, len(test_x)):.3f} (chance {chance:.3f})")


if __name__ == "__main__":
    main()
