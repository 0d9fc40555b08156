"""An ordinary PyTorch training script made data-parallel: pytorch/examples' MNIST recipe (a small
CNN with dropout, Adadelta, StepLR, F.nll_loss, DataLoaders) on the embedded digits, on N replicas.

    .venv/bin/python examples/torch_ddp_style.py                  # 2 logical CPU replicas, 3 epochs
    .venv/bin/python examples/torch_ddp_style.py --replicas 3 --epochs 1

The lines marked `# mirrored` are all that changed from the single-device script (README.md shows
them as a diff): a strategy, the model and optimizer made in its scope, the loops' bodies run on
every replica by strategy.run, and their results reduced. The loss line is unchanged, as with
DDP: gradient_reduction="mean" averages the replicas' gradients, weighing each by its part of the
batch, so even the short last batch of an epoch gives one device's update. The data is the UCI
digits (8x8, 1,437 for training, 360 for testing) instead of MNIST's 28x28, so fc1 is smaller.
"""
from __future__ import annotations

import argparse

import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.optim as optim
from torch.optim.lr_scheduler import StepLR
from torch.utils.data import DataLoader, TensorDataset

import mirrored as mr

MEAN, STD = 0.3, 0.4  # the digits' pixel mean and standard deviation in [0, 1] (MNIST's: 0.1307, 0.3081)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 32, 3, 1)
        self.conv2 = nn.Conv2d(32, 64, 3, 1)
        self.dropout1 = nn.Dropout(0.25)
        self.dropout2 = nn.Dropout(0.5)
        self.fc1 = nn.Linear(256, 128)  # 64 channels of 2x2 after two 3x3 convs and a 2x2 pool of 8x8
        self.fc2 = nn.Linear(128, 10)

    def forward(self, x):
        x = F.relu(self.conv2(F.relu(self.conv1(x))))
        x = self.dropout1(F.max_pool2d(x, 2))
        x = self.dropout2(F.relu(self.fc1(torch.flatten(x, 1))))
        return F.log_softmax(self.fc2(x), dim=1)


def digits(split: str) -> TensorDataset:
    """The split as (image, label) tensors: CHW floats in [0, 1], normalized (torchvision's ToTensor
    and Normalize)."""
    images, labels = zip(*mr.datasets.load("digits", split=split, as_supervised=True))
    x = torch.stack(images).permute(0, 3, 1, 2).float() / 255.0
    return TensorDataset((x - MEAN) / STD, torch.stack(labels).long())


def train(args, model, strategy, train_loader, optimizer, epoch):
    model.train()

    def step(data, target):  # mirrored: the loop's body, run on every replica
        optimizer.zero_grad()
        output = model(data)
        loss = F.nll_loss(output, target)
        loss.backward()
        optimizer.step()
        return loss

    dist_loader = strategy.experimental_distribute_dataset(train_loader)  # mirrored
    for batch_idx, (data, target) in enumerate(dist_loader):  # mirrored
        losses = strategy.run(step, args=(data, target))  # mirrored
        loss = strategy.reduce(mr.ReduceOp.MEAN, losses)  # mirrored
        if batch_idx % args.log_interval == 0:
            seen, total = batch_idx * args.batch_size, len(train_loader.dataset)
            percent = 100.0 * batch_idx / len(train_loader)
            print(f"Train Epoch: {epoch} [{seen}/{total} ({percent:.0f}%)]"
                  f"\tLoss: {loss.item():.6f}")


def test(model, strategy, test_loader):
    model.eval()

    def step(data, target):  # mirrored
        with torch.no_grad():
            output = model(data)
            pred = output.argmax(dim=1, keepdim=True)
            return F.nll_loss(output, target, reduction="sum"), pred.eq(target.view_as(pred)).sum()

    test_loss, correct = 0.0, 0
    for data, target in strategy.experimental_distribute_dataset(test_loader):  # mirrored
        loss, hits = strategy.run(step, args=(data, target))  # mirrored
        test_loss += strategy.reduce(mr.ReduceOp.SUM, loss).item()  # mirrored
        correct += strategy.reduce(mr.ReduceOp.SUM, hits).item()  # mirrored
    test_loss /= len(test_loader.dataset)
    print(f"\nTest set: Average loss: {test_loss:.4f}, Accuracy: {correct}/{len(test_loader.dataset)} "
          f"({100.0 * correct / len(test_loader.dataset):.0f}%)\n")
    return correct / len(test_loader.dataset)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch-size", type=int, default=64, help="the GLOBAL batch (default: 64)")
    parser.add_argument("--test-batch-size", type=int, default=1000)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--lr", type=float, default=1.0)
    parser.add_argument("--gamma", type=float, default=0.7, help="learning rate step gamma (default: 0.7)")
    parser.add_argument("--replicas", type=int, default=2, help="logical CPU replicas (default: 2)")  # mirrored
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--log-interval", type=int, default=10)
    parser.add_argument("--save-model", action="store_true", default=False)
    args = parser.parse_args()
    torch.manual_seed(args.seed)
    strategy = mr.MirroredStrategy(devices=[f"cpu:{i}" for i in range(args.replicas)])  # mirrored

    train_loader = DataLoader(digits("train"), batch_size=args.batch_size, shuffle=True)
    test_loader = DataLoader(digits("test"), batch_size=args.test_batch_size)

    with strategy.scope():  # mirrored
        model = strategy.mirror(Net())  # mirrored
        optimizer = strategy.mirror_optimizer(optim.Adadelta, model, gradient_reduction="mean", lr=args.lr)  # mirrored
    scheduler = StepLR(optimizer, step_size=1, gamma=args.gamma)
    for epoch in range(1, args.epochs + 1):
        train(args, model, strategy, train_loader, optimizer, epoch)
        accuracy = test(model, strategy, test_loader)
        scheduler.step()

    strategy.check_in_sync([model, optimizer])  # mirrored: every replica's weights, bit for bit
    print(f"replicas in sync; final test accuracy: {accuracy:.3f}")
    if args.save_model:
        torch.save(model.state_dict(), "digits_cnn.pt")


if __name__ == "__main__":
    main()
