"""torchrun --standalone --nproc_per_node=2 examples/multi_worker.py
torchrun --nnodes=2 --nproc_per_node=1 --node_rank=0 --master_addr=HOST0 --master_port=29500 examples/multi_worker.py
torchrun --nnodes=2 --nproc_per_node=1 --node_rank=1 --master_addr=HOST0 --master_port=29500 examples/multi_worker.py
.venv/bin/python examples/multi_worker.py        # no torchrun: a single worker

Multi-worker training with mr.MultiWorkerMirroredStrategy, in a custom loop on strategy.run. The
first command runs two workers on this machine; the next two run one worker on each of two
machines (HOST0 is the first machine's address, reachable from the second). Each worker process
takes cuda:LOCAL_RANK when it has GPUs (NCCL), else the CPU (gloo). A small MLP learns the embedded
8x8 digits: every worker reads the same shuffled GLOBAL batches and takes its own part, and the
gradients are summed across the workers before each step. Only rank 0 prints.
"""
from __future__ import annotations

import argparse

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import mirrored as mr


def digits(split: str, global_batch: int, train: bool) -> mr.data.Dataset:
    """Images as flat floats in [0, 1], labels as int64; the same order on every worker (seeded)."""
    def prepare(image, label):
        return image.reshape(-1).float() / 255.0, label.long()

    ds = mr.datasets.load("digits", split=split, as_supervised=True).map(prepare)
    if train:  # seed + pass number orders each epoch, identically on every worker
        return ds.shuffle(2048, seed=0).batch(global_batch, drop_remainder=True)
    return ds.batch(global_batch)


def main() -> None:
    parser = argparse.ArgumentParser(description="MultiWorkerMirroredStrategy on the digits dataset")
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--batch-size-per-replica", type=int, default=32)
    parser.add_argument("--lr", type=float, default=0.1)
    args = parser.parse_args()

    strategy = mr.MultiWorkerMirroredStrategy()
    chief = strategy.cluster_resolver.is_chief  # this worker prints (and would write checkpoints)
    global_batch = args.batch_size_per_replica * strategy.num_replicas_in_sync
    train = strategy.experimental_distribute_dataset(digits("train", global_batch, train=True))
    test = strategy.experimental_distribute_dataset(digits("test", global_batch, train=False))
    with strategy.scope():
        net = strategy.mirror(nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10)))  # rank 0's weights
        opt = strategy.mirror_optimizer(torch.optim.SGD, net, lr=args.lr, momentum=0.9)

    def train_step(x, y):
        logits = net(x)
        per_example = F.cross_entropy(logits, y, reduction="none")
        # Scaled by the GLOBAL batch, so the gradients summed over the workers are the full batch's.
        mr.losses.compute_average_loss(per_example, global_batch_size=global_batch).backward()
        opt.step()  # all-reduces the gradients across the workers, then updates
        opt.zero_grad()
        return per_example.sum().detach(), (logits.argmax(1) == y).sum(), torch.tensor(len(y))

    def test_step(x, y):
        with torch.no_grad():
            logits = net(x)
        return F.cross_entropy(logits, y, reduction="sum"), (logits.argmax(1) == y).sum(), torch.tensor(len(y))

    def run_epoch(dataset, step) -> tuple[float, float]:
        loss_sum = correct = count = 0.0
        for x, y in dataset:
            per_worker = strategy.run(step, args=(x, y))
            loss, right, n = (strategy.reduce(mr.ReduceOp.SUM, v).item() for v in per_worker)
            loss_sum, correct, count = loss_sum + loss, correct + right, count + n
        return loss_sum / count, correct / count

    for epoch in range(args.epochs):
        loss, accuracy = run_epoch(train, train_step)
        val_loss, val_accuracy = run_epoch(test, test_step)
        if chief:
            print(f"epoch {epoch + 1}/{args.epochs}: loss {loss:.4f} - accuracy {accuracy:.4f} - "
                  f"val_loss {val_loss:.4f} - val_accuracy {val_accuracy:.4f}", flush=True)
    strategy.check_in_sync([net, opt])  # every worker ended with bitwise-identical weights and optimizer state
    if chief:
        print(f"{strategy.num_replicas_in_sync} worker(s), global batch {global_batch}: weights in sync")
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
