"""pytorch/examples' MNIST recipe (a CNN with dropout, Adadelta, StepLR), reproducible on mirrored.

The same seed gives the same weights bit for bit, after a resume too, and with
--per-example-random the same run on any number of replicas (within float rounding).

    .venv/bin/python examples/torch_mnist_port.py                   # custom loop, 2 CPU replicas
    .venv/bin/python examples/torch_mnist_port.py --fit             # mr.Model.fit instead
    .venv/bin/python examples/torch_mnist_port.py --replicas 3 --per-example-random
    .venv/bin/python examples/torch_mnist_port.py --checkpoint-dir runs/mnist   # again: continues

Rewritten after pytorch/examples' mnist/main.py (BSD-3-Clause,
https://github.com/pytorch/examples/blob/main/mnist/main.py): the same network, optimizer, schedule
and loss, and its log lines. What differs: the data is the embedded UCI digits (8x8, no download),
resized bilinearly to MNIST's 28x28 so that the recipe's Net is unchanged (fc1 still takes
64 x 12 x 12); the seed goes to the strategy too, which gives every replica dropout generators of
its own; the training state is checkpointed after each epoch's test, so a second run with the same
--checkpoint-dir continues the first. examples/torch_ddp_style.py is the minimal port instead (the
recipe's own DataLoaders, its lines marked).
"""
from __future__ import annotations

import argparse
import math
import shutil
import tempfile
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn, optim
from torch.optim.lr_scheduler import StepLR

import mirrored as mr

SIZE = 28  # MNIST's side: the recipe's fc1 (9216 inputs) expects it
MEAN, STD = 0.30, 0.32  # the resized digits' pixel mean and deviation in [0, 1] (MNIST's 0.1307, 0.3081)


class Net(nn.Module):
    """The recipe's CNN: two 3x3 convolutions, a 2x2 max-pool, two dropouts, two linear layers;
    log-probabilities out, for nll_loss."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 32, 3, 1)
        self.conv2 = nn.Conv2d(32, 64, 3, 1)
        self.dropout1 = nn.Dropout(0.25)
        self.dropout2 = nn.Dropout(0.5)
        self.fc1 = nn.Linear(64 * 12 * 12, 128)  # 28 -> 26 -> 24 (convs) -> 12 (pool)
        self.fc2 = nn.Linear(128, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.max_pool2d(F.relu(self.conv2(F.relu(self.conv1(x)))), 2)
        x = self.dropout1(x).flatten(1)
        x = self.dropout2(F.relu(self.fc1(x)))
        return F.log_softmax(self.fc2(x), dim=1)


def _to_net_input(image: torch.Tensor, label: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """uint8 HWC 8x8 -> normalized float CHW 28x28 (torchvision's ToTensor and Normalize)."""
    image = mr.data.images.resize(image, (SIZE, SIZE)) / 255.0
    return ((image - MEAN) / STD).permute(2, 0, 1).contiguous(), label.long()


def digits(split: str, examples: int | None = None) -> mr.data.Dataset:
    """The split's (image, label) pairs as the net takes them, the first `examples` of them if given."""
    ds = mr.datasets.load("digits", split=split, as_supervised=True)
    if examples is not None:
        ds = ds.take(examples)
    return ds.map(_to_net_input).cache()


def make_strategy(args: argparse.Namespace) -> mr.MirroredStrategy:
    """The recipe's torch.manual_seed(seed), as Keras spells it, and a strategy whose replicas'
    generators take the same seed."""
    mr.utils.set_random_seed(args.seed)
    return mr.MirroredStrategy(devices=[f"cpu:{i}" for i in range(args.replicas)], seed=args.seed,
                               per_example_random=args.per_example_random)


def run_loop(args: argparse.Namespace) -> dict[str, Any]:
    """The recipe's train/test loops, their bodies run on every replica by strategy.run."""
    strategy = make_strategy(args)
    train_set, test_set = digits("train", args.train_examples), digits("test", args.test_examples)
    examples = len(list(train_set))
    steps_per_epoch = math.ceil(examples / args.batch_size)
    # One iterator over every epoch's batches (reshuffled each pass), so a checkpoint holds its place.
    batches = train_set.shuffle(examples, seed=args.seed).batch(args.batch_size).repeat()
    train_iterator = iter(strategy.experimental_distribute_dataset(batches))
    test_batches = strategy.experimental_distribute_dataset(test_set.batch(args.test_batch_size))
    with strategy.scope():
        model = strategy.mirror(Net(), memory_format=args.memory_format)
        # "mean": the loss line stays the recipe's F.nll_loss, a mean over the replica's examples.
        optimizer = strategy.mirror_optimizer(optim.Adadelta, model, gradient_reduction="mean",
                                              lr=args.lr)
        epoch = mr.Variable(0, trainable=False)
    scheduler = StepLR(optimizer, step_size=1, gamma=args.gamma)
    optimizer.attach_lr_scheduler(scheduler)  # its state is saved with the optimizer's

    directory = args.checkpoint_dir or tempfile.mkdtemp(prefix="torch_mnist_port-")
    # It holds the replicas' generators too (seed, steps run: "model.random"), so dropout resumes exactly.
    checkpoint = mr.train.Checkpoint(model=model, optimizer=optimizer, iterator=train_iterator, epoch=epoch)
    manager = mr.train.CheckpointManager(checkpoint, directory, max_to_keep=1)
    checkpoint.restore(manager.latest_checkpoint)
    if manager.latest_checkpoint:
        print(f"continuing from {manager.latest_checkpoint} at epoch {int(epoch) + 1}")

    def train_step(data: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        optimizer.zero_grad()
        loss = F.nll_loss(model(data), target)
        loss.backward()
        optimizer.step()  # averages the replicas' gradients, then updates every copy
        return loss.detach()

    def test_step(data: torch.Tensor, target: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        with torch.no_grad():  # grad mode is per thread: switched off inside the replica
            output = model(data)
            hits = (output.argmax(dim=1) == target).sum()
            return F.nll_loss(output, target, reduction="sum"), hits

    accuracy, lrs = None, []
    while int(epoch) < args.epochs:
        model.train()
        lrs.append(optimizer.param_groups[0]["lr"])
        for batch_idx in range(steps_per_epoch):
            losses = strategy.run(train_step, args=next(train_iterator))
            if batch_idx % args.log_interval == 0:
                loss = strategy.reduce(mr.ReduceOp.MEAN, losses).item()
                print(f"Train Epoch: {int(epoch) + 1} [{batch_idx * args.batch_size}/{examples} "
                      f"({100.0 * batch_idx / steps_per_epoch:.0f}%)]\tLoss: {loss:.6f}")
        scheduler.step()
        accuracy = _test(strategy, model, test_step, test_batches)
        epoch.assign_add(1)
        # After the test: its strategy.run calls count as steps of the replicas' generators too, so
        # a checkpoint taken before them would resume at another step number (other dropout masks).
        manager.save()
    if accuracy is None:  # the checkpoint was already at the last epoch: test what it holds
        accuracy = _test(strategy, model, test_step, test_batches)
    if args.checkpoint_dir is None:
        shutil.rmtree(directory)
    strategy.check_in_sync([model, optimizer])  # every replica's weights, bit for bit
    replica_lrs = [opt.param_groups[0]["lr"] for opt in strategy.experimental_local_results(optimizer)]
    return {"weights": {k: v.detach().clone() for k, v in model.state_dict().items()},
            "accuracy": accuracy, "lrs": lrs, "replica_lrs": replica_lrs}


def _test(strategy: mr.MirroredStrategy, model: Any, test_step: Any, test_batches: Any) -> float:
    """The recipe's test(): the summed loss and hits of every replica, over the whole split."""
    model.eval()
    test_loss, correct, total = 0.0, 0, 0
    for data, target in test_batches:
        loss, hits = strategy.run(test_step, args=(data, target))
        test_loss += strategy.reduce(mr.ReduceOp.SUM, loss).item()
        correct += int(strategy.reduce(mr.ReduceOp.SUM, hits).item())
        total += sum(t.shape[0] for t in strategy.experimental_local_results(target))
    print(f"\nTest set: Average loss: {test_loss / total:.4f}, Accuracy: {correct}/{total} "
          f"({100.0 * correct / total:.0f}%)\n")
    return correct / total


def run_fit(args: argparse.Namespace, callbacks: list[Any] | None = None) -> dict[str, Any]:
    """The same training through mr.Model: compile takes the recipe's optimizer instance and loss
    module, a callback steps its StepLR, BackupAndRestore makes the run resumable."""
    strategy = make_strategy(args)
    train_set = digits("train", args.train_examples)
    train = train_set.shuffle(len(list(train_set)), seed=args.seed).batch(args.batch_size)
    test = digits("test", args.test_examples).batch(args.test_batch_size)
    with strategy.scope():
        model = mr.Model(Net())
        model.compile(optimizer=optim.Adadelta(model.module.parameters(), lr=args.lr),
                      loss=nn.NLLLoss(), metrics=["sparse_categorical_accuracy"],
                      memory_format=args.memory_format)
    every = [mr.callbacks.TorchLRScheduler(lambda opt: StepLR(opt, step_size=1, gamma=args.gamma))]
    if args.checkpoint_dir:  # after the scheduler's callback, so that a backup holds its step
        every.append(mr.callbacks.BackupAndRestore(args.checkpoint_dir, save_freq=args.save_freq))
    history = model.fit(train, epochs=args.epochs, validation_data=test, verbose=2,
                        callbacks=every + list(callbacks or []))
    strategy.check_in_sync(model.mirrored_optimizer)
    replica_lrs = [opt.param_groups[0]["lr"]
                   for opt in strategy.experimental_local_results(model.mirrored_optimizer)]
    return {"weights": {k: v.detach().clone() for k, v in model.module.state_dict().items()},
            "accuracy": history.history["val_sparse_categorical_accuracy"][-1],
            "lrs": history.history["learning_rate"], "replica_lrs": replica_lrs}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--fit", action="store_true", help="train with mr.Model.fit")
    parser.add_argument("--batch-size", type=int, default=64, help="the GLOBAL batch (default 64)")
    parser.add_argument("--test-batch-size", type=int, default=1000)
    parser.add_argument("--epochs", type=int, default=3, help="(the recipe's 14 is for MNIST)")
    parser.add_argument("--lr", type=float, default=1.0)
    parser.add_argument("--gamma", type=float, default=0.7, help="StepLR's factor per epoch")
    parser.add_argument("--replicas", type=int, default=2, help="logical CPU replicas (default 2)")
    parser.add_argument("--per-example-random", action="store_true",
                        help="dropout keyed by example: the same masks on any replica count")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--memory-format", default="auto", choices=["auto", "channels_last", "preserve"],
                        help="the convolutions' memory (default auto: channels_last on CPU and CUDA)")
    parser.add_argument("--log-interval", type=int, default=10)
    parser.add_argument("--checkpoint-dir", default=None,
                        help="checkpoints (loop) or BackupAndRestore's backup (--fit); a run started "
                             "again with it continues")
    parser.add_argument("--save-freq", default="epoch",
                        type=lambda s: s if s == "epoch" else int(s),
                        help="--fit: back up every N steps instead of every epoch")
    parser.add_argument("--train-examples", type=int, default=None, help="the first N (default all)")
    parser.add_argument("--test-examples", type=int, default=None, help="the first N (default all)")
    parser.add_argument("--save-model", default=None, metavar="PATH",
                        help="write the trained weights there (safetensors)")
    args = parser.parse_args(argv)
    if args.replicas < 1 or args.epochs < 1 or args.batch_size < 1:
        parser.error(f"--replicas ({args.replicas}), --epochs ({args.epochs}) and --batch-size "
                     f"({args.batch_size}) must be at least 1")
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    result = run_fit(args) if args.fit else run_loop(args)
    if args.save_model:
        from safetensors.torch import save_file

        # The convolutions ran in channels_last memory (mirror's default); safetensors stores the
        # standard layout only, so the weights are made contiguous first (torch.save needs no such step).
        save_file({k: v.contiguous() for k, v in result["weights"].items()}, args.save_model)
    print(f"replicas in sync; final test accuracy: {result['accuracy']:.3f}")
    return result


if __name__ == "__main__":
    main()
