"""`mirrored train | profile | evaluate | bench`: the main job and its tools on the command line.

`mirrored train` trains the small CIFAR-style ResNet on the embedded digits (offline, anywhere) on
every GPU, or on 2 logical CPU replicas of a CPU-only machine, validating each epoch on a held-out
part of the training data (or the dataset's validation split), then evaluates the test split once
and prints its metrics and images/s, and writes a checkpoint, a CSV log and a PNG plot into --out.
`--dataset cassava` or `folder:PATH` train on real images. `mirrored profile` trains the same way
for one epoch and writes a step timeline; `mirrored evaluate CHECKPOINT` re-scores a saved model;
`mirrored bench` prints the quick fit throughput table (fit on CPU replicas beside the machine's limit,
independent processes, DDP and a plain loop; benchmarks/fit_throughput.py runs the full one).
A user's mistake (a bad flag, a missing or damaged file, an unwritable --out) is one line on stderr
and exit status 2; a traceback means a bug of ours.
"""
from __future__ import annotations

import argparse
import json
import logging
import math
import os
import sys
import time
from pathlib import Path
from typing import Any

from mirrored._files import reporting_write_errors, write_atomically

_MODELS_FOR_SIZE = {"resnet_cifar": 32, "resnet20": 32, "resnet18": 224, "resnet34": 224, "resnet50": 224}
# What one training replica holds besides its activations, in copies of the weights: the weights,
# their gradients, SGD's momentum and the all-reduce's packed gradient buffer.
_WEIGHT_COPIES_PER_REPLICA = 4


class CliError(Exception):
    """A bad flag or setting: printed as one line, exit status 2."""


def _folder(text: str) -> str:
    if not text.strip():
        raise argparse.ArgumentTypeError(f"expected a folder for the run's files, got {text!r} (an empty name "
                                         "would write into the current folder); e.g. --out runs/first")
    return text


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a number >= 1, got {value}")
    return value


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"expected a number > 0, got {value}")
    return value


def _train_args(epochs: int, out: str) -> argparse.ArgumentParser:
    """The flags `train` and `profile` share, with their own defaults. One parent per command: a
    parent's actions are shared objects, so set_defaults on one subcommand would change both."""
    train = argparse.ArgumentParser(add_help=False)
    train.add_argument("--dataset", default="digits", help="digits (embedded), cassava, or folder:PATH")
    train.add_argument("--data-dir", default=None, help="TFDS data directory (default: $TFDS_DATA_DIR or "
                       "~/tensorflow_datasets)")
    train.add_argument("--download", action="store_true", help="download cassava if it is missing")
    train.add_argument("--model", default=None, help="resnet_cifar (default for digits), resnet18 (default for images), "
                       "resnet34, resnet50")
    where = train.add_mutually_exclusive_group()
    where.add_argument("--replicas", type=_positive_int, default=None,
                       help="N logical replicas (cpu:0..N-1, or the first N GPUs)")
    where.add_argument("--devices", default=None, help="comma-separated devices, e.g. cuda:0,cuda:1 or cpu:0,cpu:1")
    train.add_argument("--epochs", type=_positive_int, default=epochs)
    train.add_argument("--batch-size", type=_positive_int, default=None,
                       help="GLOBAL batch size (default: 32 per replica)")
    train.add_argument("--lr", type=_positive_float, default=None, help="peak learning rate, decayed by a cosine over the epochs (default 0.05 x global/64)")
    train.add_argument("--image-size", type=_positive_int, default=None, help="resize images to this square size")
    train.add_argument("--precision", choices=["fp32", "bf16", "fp16"], default="fp32")
    train.add_argument("--resume", action="store_true", help="continue an interrupted run from --out/backup")
    train.add_argument("--out", type=_folder, default=out, help=f"output folder (default: {out})")
    train.add_argument("--seed", type=int, default=0)
    train.add_argument("--verbose", type=int, choices=[0, 1, 2], default=None,
                       help="0 silent, 1 progress bar, 2 one line per epoch (default: 1 on a terminal, else 2)")
    return train


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="mirrored", description="Synchronous data-parallel training on PyTorch.")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("train", parents=[_train_args(epochs=6, out="runs/train")],
                   help="train a model (default: small ResNet on the embedded digits)")
    sub.add_parser("profile", parents=[_train_args(epochs=1, out="runs/profile")],
                   help="train like `train` and write a step timeline (input / compute / all-reduce)")
    evaluate = sub.add_parser("evaluate", help="evaluate a checkpoint written by `mirrored train`")
    evaluate.add_argument("checkpoint")
    evaluate.add_argument("--dataset", default=None, help="default: the dataset the checkpoint was trained on")
    evaluate.add_argument("--data-dir", default=None)
    evaluate.add_argument("--split", default=None, help="default: the test split training used (test, or "
                          "train[80%%:] for folder:PATH)")
    evaluate.add_argument("--batch-size", type=_positive_int, default=None)
    evaluate.add_argument("--replicas", type=_positive_int, default=None)
    bench = sub.add_parser("bench", help="the quick fit throughput table: fit on CPU replicas vs the machine's "
                           "limit, independent processes, DDP and a plain PyTorch loop")
    bench.add_argument("--batches", type=_positive_int, nargs="+", default=[64, 256], help="GLOBAL batch sizes")
    bench.add_argument("--replicas", type=_positive_int, default=2, help="CPU replicas (and processes)")
    bench.add_argument("--images", type=_positive_int, default=512, help="images per timed run")
    bench.add_argument("--rounds", type=_positive_int, default=1, help="rounds of every row, in turn")
    bench.add_argument("--rows", nargs="+", choices=["limit", "independent", "fit", "DDP", "plain"],
                       default=None, help="the rows to run (default: all; fit always runs)")
    bench.add_argument("--scaling", default=None, help="replica counts for fit's scaling curve, e.g. 1,2,4")
    bench.add_argument("--memory-format", choices=["auto", "channels_last", "preserve"], default="auto",
                       help="fit's compile(memory_format=); the other rows run the format fit ran")
    return parser


def _devices(args: argparse.Namespace) -> list[str]:
    """The replica devices the flags ask for: --devices, --replicas N, else every GPU or 2 CPU replicas."""
    import mirrored as mr

    if getattr(args, "devices", None) is not None:
        devices = [d.strip() for d in args.devices.split(",") if d.strip()]
        if not devices:
            raise CliError(f"--devices {args.devices!r}: names no device. Give a comma-separated list, e.g. "
                           "cuda:0,cuda:1 or cpu:0,cpu:1, or drop --devices to use every GPU.")
        return devices
    gpus = mr.distribute.devices.visible_gpus()
    if args.replicas is not None:
        pool = gpus if gpus else [f"cpu:{i}" for i in range(args.replicas)]
        if len(pool) < args.replicas:
            raise CliError(f"--replicas {args.replicas}: only {len(pool)} GPU(s) are visible ({', '.join(pool)}). "
                           "Use --replicas <= that, or --devices cpu:0,cpu:1 for CPU replicas.")
        return pool[:args.replicas]
    return gpus or ["cpu:0", "cpu:1"]


def _strategy(args: argparse.Namespace, devices: list[str]) -> Any:
    import mirrored as mr

    try:
        return mr.MirroredStrategy(devices=devices)
    except ValueError as e:  # an unknown or unavailable device: the message lists what is visible
        raise CliError(f"{_where(args)}: {e}") from None


def _multi_worker_strategy(args: argparse.Namespace) -> Any:
    """A MultiWorkerMirroredStrategy when this process is one worker of a launched job (torchrun), else None.
    Each worker drives its own device (--devices chooses it); --replicas would count the job's processes,
    which the launcher sets."""
    import mirrored as mr

    try:
        launched = mr.distribute.multi_worker.launched_as_worker()
    except ValueError as e:  # an incomplete launch (RANK without MASTER_ADDR, ...): the resolver names it
        raise CliError(str(e)) from None
    if not launched:
        return None
    if getattr(args, "replicas", None) is not None:
        raise CliError(f"--replicas {args.replicas}: this process is one worker of a job started by a launcher "
                       "(torchrun), which sets how many there are (--nproc_per_node, --nnodes). Drop --replicas, "
                       "or pass --devices to choose this worker's device.")
    devices = None
    if getattr(args, "devices", None) is not None:
        devices = [d.strip() for d in args.devices.split(",") if d.strip()]
    try:
        return mr.MultiWorkerMirroredStrategy(devices=devices)
    except ValueError as e:
        raise CliError(f"{_where(args)}: {e}") from None


def _quiet(*_: Any, **__: Any) -> None:
    """print's stand-in on workers other than the chief: one job prints once."""


def _where(args: argparse.Namespace) -> str:
    """The flag that chose the devices, for messages."""
    if getattr(args, "devices", None) is not None:
        return f"--devices {args.devices}"
    return f"--replicas {args.replicas}" if args.replicas is not None else "the default devices"


def _replica_bytes(model_name: str, num_classes: int, image_size: int, per_replica_batch: int) -> int:
    """What one training replica of the model needs: its weights several times over (see
    _WEIGHT_COPIES_PER_REPLICA) plus the activations autograd keeps for its share of the batch,
    measured on the meta device (no memory used)."""
    import torch
    from torch.autograd.graph import saved_tensors_hooks

    import mirrored as mr

    net = mr.models.skeleton(model_name, num_classes=num_classes)
    weights = sum(t.numel() * t.element_size() for t in [*net.parameters(), *net.buffers()])
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved[id(t)] = t.numel() * t.element_size()
        return t

    with saved_tensors_hooks(pack, lambda t: t):
        net(torch.empty(1, image_size, image_size, 3, device="meta"))  # NHWC: the images the data yields
    return _WEIGHT_COPIES_PER_REPLICA * weights + per_replica_batch * sum(saved.values())


def _check_out(out: Path) -> None:
    """--out exists (created) and is writable, before anything is trained."""
    try:
        out.mkdir(parents=True, exist_ok=True)
        probe = out / f".mirrored-write-check-{os.getpid()}"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as e:
        raise CliError(f"--out {str(out)!r}: cannot write there ({e.strerror or e}). Give a folder you may "
                       "write to.") from None


def _load(name: str, split: str, data_dir: str | None, image_size: int, download: bool,
          shuffle_files: bool = False) -> tuple[Any, Any]:
    """(dataset of (image float32 HWC in [0, 1], label), info) for --dataset."""
    try:
        return _load_unchecked(name, split, data_dir, image_size, download, shuffle_files)
    except (OSError, ValueError) as e:  # missing or malformed data, a failed download: the message says what to do
        raise CliError(str(e)) from None


def _load_unchecked(name: str, split: str, data_dir: str | None, image_size: int, download: bool,
                    shuffle_files: bool) -> tuple[Any, Any]:
    import mirrored as mr

    if name == "digits":
        if image_size != 32:
            raise CliError(f"--image-size {image_size}: the digits come as 8x8 or 32x32; use 32 (the default).")
        ds, info = mr.datasets.load("digits/32x32", split=split, as_supervised=True, with_info=True)
        return ds.map(lambda x, y: (x.float() / 255.0, y)), info
    if name == "cassava":
        ds, info = mr.datasets.load("cassava", split=split, data_dir=data_dir, as_supervised=True, with_info=True,
                                    download=download, shuffle_files=shuffle_files)
    elif name.startswith("folder:"):
        root = name[len("folder:"):]
        if not Path(root).is_dir():
            raise CliError(f"--dataset {name}: {root!r} is not a folder. Give folder:PATH with one sub-folder "
                           "of images per class.")
        ds, info = mr.datasets.image_folder(root, split=split, as_supervised=True, with_info=True)
    else:
        raise CliError(f"--dataset {name!r}: use digits, cassava or folder:PATH.")
    size = (image_size, image_size)
    return ds.map(lambda x, y: (mr.data.images.resize(x, size) / 255.0, y),
                  num_parallel_calls=mr.data.AUTOTUNE), info


def _reads_no_data_dir(name: str) -> bool:
    """digits are embedded and folder:PATH names its own folder: --data-dir would be ignored."""
    return name == "digits" or name.startswith("folder:")


def _splits(name: str) -> tuple[str, str, str]:
    """(train, validation, test) splits of a dataset. Validation picks the best checkpoint and shows
    progress; the test split is evaluated once, after training, so its numbers chose nothing. Without
    a validation split of its own, the last 10% of the training data is held out for it."""
    if name == "cassava":
        return "train", "validation", "test"
    if name.startswith("folder:"):
        return "train[:70%]", "train[70%:80%]", "train[80%:]"
    return "train[:90%]", "train[90%:]", "test"


def _plot(history: dict[str, list[float]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    epochs = range(1, len(history.get("loss", [])) + 1)
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for ax, key in zip(axes, ("loss", "accuracy")):
        for prefix, style in (("", "-o"), ("val_", "--s")):
            if prefix + key in history:
                ax.plot(list(epochs), history[prefix + key], style, label=(prefix or "train_") + key)
        ax.set_xlabel("epoch")
        ax.set_title(key)
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def cmd_train(args: argparse.Namespace) -> int:
    import torch

    import mirrored as mr
    from mirrored.training.checkpoint import CheckpointError

    if args.data_dir is not None and _reads_no_data_dir(args.dataset):
        raise CliError(f"--data-dir {args.data_dir!r}: --dataset {args.dataset} does not read a data directory "
                       "(digits are embedded; folder:PATH names its folder). Drop --data-dir, or use it with "
                       "--dataset cassava.")
    out = Path(args.out)
    backup = out / "backup"
    state_file = backup / "training_state.safetensors"
    if args.resume and state_file.exists() and not state_file.is_file():
        raise CliError(f"--resume: {str(state_file)!r} is not a file (a directory or a device), so it holds no "
                       "backup. Remove it, or drop --resume to start afresh.")
    resuming = args.resume and state_file.exists()
    if args.resume and not resuming:
        raise CliError(f"--resume: no interrupted run to continue in {str(backup)!r} (it is written after each "
                       "epoch and deleted when a run finishes). Drop --resume to start afresh.")
    _check_out(out)
    torch.manual_seed(args.seed)
    # Under torchrun each process is one worker of one job: a MultiWorkerMirroredStrategy over all of them,
    # the global batch scaled by every replica, and the files written by the chief alone.
    strategy = _multi_worker_strategy(args)
    devices = list(strategy.extended.worker_devices) if strategy is not None else _devices(args)
    n = strategy.num_replicas_in_sync if strategy is not None else len(devices)
    chief = strategy is None or strategy.extended.should_checkpoint
    say = print if chief else _quiet
    model_name = args.model or ("resnet_cifar" if args.dataset == "digits" else "resnet18")
    if model_name not in mr.models.names():
        raise CliError(f"--model {model_name!r}: known models are {', '.join(mr.models.names())}.")
    image_size = args.image_size or (32 if args.dataset == "digits" else _MODELS_FOR_SIZE.get(model_name, 224))
    global_batch = args.batch_size or 32 * n
    lr = args.lr or 0.05 * global_batch / 64
    train_split, val_split, test_split = _splits(args.dataset)
    train_ds, info = _load(args.dataset, train_split, args.data_dir, image_size, args.download, shuffle_files=True)
    num_classes = info.features["label"].num_classes
    per_replica = mr.distribute.input.split_sizes(global_batch, n)
    try:  # before any replica is built: --replicas 1000 on a small machine grew past its memory
        mr.distribute.devices.check_replica_memory(
            _replica_bytes(model_name, num_classes, image_size, max(per_replica)), devices,
            f"{_where(args)} ({model_name} at {image_size}x{image_size}, global batch {global_batch})")
    except ValueError as e:
        raise CliError(str(e)) from None
    if strategy is None:
        strategy = _strategy(args, devices)
    workers = strategy.num_workers
    on = ', '.join(strategy.extended.worker_devices)
    where = f"({workers} workers, each on {on})" if workers > 1 else f"on {on}"
    say(f"replicas: {n} {where} | cross-device ops: {type(strategy.extended.cross_device_ops).__name__} | "
        f"global batch {global_batch} ({', '.join(map(str, per_replica))} per replica)")
    val_ds, _ = _load(args.dataset, val_split, args.data_dir, image_size, False)
    test_ds, _ = _load(args.dataset, test_split, args.data_dir, image_size, False)
    sizes = {split: info.splits[split].num_examples for split in (train_split, val_split, test_split)}
    say(f"data: {args.dataset} | train on {train_split!r} ({sizes[train_split]} images) | validate (val_*) on "
          f"{val_split!r} ({sizes[val_split]}) | test once, after training, on {test_split!r} ({sizes[test_split]})")
    train = train_ds.shuffle(2048, seed=args.seed).batch(global_batch).prefetch(mr.data.AUTOTUNE)
    val = val_ds.batch(global_batch).prefetch(mr.data.AUTOTUNE)
    test = test_ds.batch(global_batch).prefetch(mr.data.AUTOTUNE)
    with strategy.scope():
        model = mr.Model(mr.models.get(model_name, num_classes=num_classes))
        model.compile(optimizer=mr.optimizers.SGD(learning_rate=lr, momentum=0.9),
                      loss="sparse_categorical_crossentropy", metrics=["accuracy"],
                      precision=None if args.precision == "fp32" else args.precision)
    if not args.resume and backup.exists():
        import shutil

        # (every worker removes it before its own fit reads it: the chief writes a new one only after an epoch)
        shutil.rmtree(backup, ignore_errors=True)
    verbose = args.verbose if args.verbose is not None else (1 if sys.stdout.isatty() else 2)
    def cosine(epoch: int, _lr: float) -> float:  # decay to ~0 so BatchNorm statistics settle by the end
        return lr * 0.5 * (1 + math.cos(math.pi * epoch / args.epochs))

    profiler = mr.profiler.Profiler(str(out)) if args.command == "profile" and chief else None
    if profiler is not None:  # the limit its scaling efficiency compares with, timed now, on this machine
        profiler.alone_step_s = _alone_step_s(model_name, num_classes, train_ds.batch(max(per_replica)), devices[0],
                                              len(strategy.extended.worker_devices), args.precision)
        print(f"one replica's step alone: {profiler.alone_step_s * 1e3:.1f} ms (its batch of {max(per_replica)}, "
              f"on {devices[0]}; the limit the profiler's scaling efficiency compares with)")
    callbacks = [*([profiler] if profiler else []), mr.callbacks.LearningRateScheduler(cosine),
                 mr.callbacks.CSVLogger(str(out / "log.csv"), append=resuming),
                 mr.callbacks.BackupAndRestore(str(backup)),
                 mr.callbacks.ModelCheckpoint(str(out / "best.safetensors"), monitor="val_accuracy",
                                              save_best_only=True)]
    start = time.perf_counter()
    try:
        history = model.fit(train, epochs=args.epochs, validation_data=val, callbacks=callbacks, verbose=verbose)
    except CheckpointError as e:  # only the backup is read during fit
        raise CliError(f"--resume: {e} (Or drop --resume: the run starts afresh.)" if resuming else str(e)) from None
    seconds = time.perf_counter() - start
    images = sizes[train_split] * len(history.history.get("loss", []))
    results = model.evaluate(test, return_dict=True, verbose=0)  # the one look at the test split
    best = "the best epoch's weights are in " + repr(str(out / "best.safetensors"))
    before = "The file there before is intact" if (out / "model.safetensors").is_file() else "Nothing was written there"
    with reporting_write_errors(out / "model.safetensors", "mirrored train (the trained model)",
                                f"{before}; {best}, and log.csv holds every epoch's metrics."):
        model.save(out / "model.safetensors")  # (by the chief only, under a multi-worker strategy)
    if not chief:
        return 0
    kept = f"The trained model is in {str(out / 'model.safetensors')!r} and {best}."
    write_atomically(out / "history.png", "mirrored train (the plot of the epochs)",
                     lambda tmp: _plot(history.history, tmp), suffix=".png", also=kept)
    run_info = json.dumps({"dataset": args.dataset, "model": model_name, "image_size": image_size, "replicas": n,
                           "workers": workers, "splits": {"train": train_split, "validation": val_split,
                                                          "test": test_split}, "test": results}, indent=2)
    write_atomically(out / "run.json", "mirrored train (the run's settings, which evaluate reads)",
                     lambda tmp: Path(tmp).write_text(run_info, encoding="utf-8"),
                     also=f"{kept} (`mirrored evaluate` reads run.json beside the model.)")
    metrics = " - ".join(f"test_{k}: {v:.4f}" for k, v in results.items())
    print(f"{metrics} (split {test_split!r}, evaluated once after training) - {images / seconds:.0f} images/s "
          f"over {seconds:.1f} s of training")
    print(f"wrote {out / 'model.safetensors'}, {out / 'log.csv'}, {out / 'history.png'}")
    if profiler is not None:
        profiler.print_summary()
        print(f"wrote {out / 'trace.json'} (open in chrome://tracing or ui.perfetto.dev) and {out / 'timeline.png'}")
    return 0


def _alone_step_s(model_name: str, num_classes: int, batches: Any, device: str, replicas: int,
                  precision: str) -> float:
    """One replica's training step timed alone (mr.profiler.time_alone): a fresh copy of the model in fit's
    memory format, its per-replica batch, SGD, on `device` with a CPU replica's share of the cores."""
    import torch
    import torch.nn.functional as F

    import mirrored as mr
    from mirrored._cpus import usable_cores

    x, y = next(iter(batches))
    target = torch.device("cpu" if device.startswith("cpu") else device)
    net = mr.models.get(model_name, num_classes=num_classes).to(target, memory_format=torch.channels_last)
    x, y = x.to(target), y.to(target).long()
    opt = torch.optim.SGD(net.parameters(), lr=0.01, momentum=0.9)

    def step() -> None:
        with torch.autocast(target.type, dtype=torch.float16 if precision == "fp16" else torch.bfloat16,
                            enabled=precision in ("bf16", "fp16")):
            loss = F.cross_entropy(net(x).float(), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    threads = max(1, usable_cores() // replicas) if target.type == "cpu" else None
    return mr.profiler.time_alone(step, repeats=3, warmup=1, num_threads=threads,
                                  device=device if target.type == "cuda" else None)


def cmd_evaluate(args: argparse.Namespace) -> int:
    import mirrored as mr

    path = Path(args.checkpoint)
    if not path.exists():
        raise CliError(f"evaluate: no checkpoint at {str(path)!r}. Pass the model.safetensors that "
                       "`mirrored train` wrote into --out.")
    run_info = path.parent / "run.json"
    try:
        saved = json.loads(run_info.read_text()) if run_info.is_file() else {}
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise CliError(f"evaluate: cannot read {str(run_info)!r}, the run's settings beside the checkpoint "
                       f"({e}). Pass --dataset (and --split) yourself, or remove the file.") from None
    if not isinstance(saved, dict):
        saved = {}
    dataset = args.dataset or saved.get("dataset", "digits")
    if args.data_dir is not None and _reads_no_data_dir(dataset):
        raise CliError(f"--data-dir {args.data_dir!r}: --dataset {dataset} does not read a data directory. Drop "
                       "--data-dir, or use it with --dataset cassava.")
    image_size = saved.get("image_size", 32)
    if not isinstance(image_size, int) or isinstance(image_size, bool) or not 1 <= image_size <= 4096:
        raise CliError(f"evaluate: {str(run_info)!r} gives image_size {image_size!r:.40}; expected a whole number "
                       "of pixels. Remove the file or pass the settings yourself.")
    split = args.split or _splits(dataset)[2]  # what `train` tested on: folder:PATH has no "test" split
    strategy = _strategy(args, _devices(args))
    try:
        with strategy.scope():
            model = mr.Model.load(path)
    except (FileNotFoundError, IsADirectoryError) as e:  # the path names no file: the message says what to pass
        raise CliError(str(e)) from None
    test, _ = _load(dataset, split, args.data_dir, image_size, False)
    batch = args.batch_size or 32 * strategy.num_replicas_in_sync
    results = model.evaluate(test.batch(batch), return_dict=True, verbose=0)
    print(" - ".join(f"{k}: {v:.4f}" for k, v in results.items()))
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    """The fit table of benchmarks/fit_throughput.py at quick settings (~1-2 minutes on 2 cores)."""
    from mirrored import _bench

    scaling = _replica_counts(args.scaling) if args.scaling else None
    cores = os.cpu_count() or 1
    most = max([args.replicas, *(scaling or [])])
    if most > 4 * cores:  # each row starts this many processes or threads, each with a model copy
        raise CliError(f"bench: {most} replicas on {cores} core(s) would only take turns (and start {most} "
                       f"processes, each with torch loaded); use at most {4 * cores}, e.g. --replicas {min(2, cores)}.")
    if min(args.batches) < args.replicas:
        raise CliError(f"bench: --batches {min(args.batches)} is smaller than --replicas {args.replicas}, so a "
                       "replica would get no examples. Give global batches of at least one example per replica.")
    if args.images < max(args.batches):
        raise CliError(f"bench: --images {args.images} is less than one batch of {max(args.batches)}. Give at "
                       "least one full batch of images per run.")
    start = time.perf_counter()
    print(_bench.machine())
    print("model: resnet_cifar(depth=20), 32x32 inputs, SGD(momentum=0.9), batches in memory; targets: fit >= 0.95 "
          "x the independent processes at once, >= 1.0 x DDP")
    for batch in args.batches:
        _bench.compare(batch, args.replicas, args.images, args.rounds, rows=args.rows or _bench.ROWS,
                       memory_format=args.memory_format)
    if scaling:
        _bench.scaling(args.batches[0], scaling, args.images, args.rounds)
    print(f"\n{time.perf_counter() - start:.0f} s; benchmarks/fit_throughput.py runs more images and rounds")
    return 0


def _replica_counts(text: str) -> list[int]:
    try:
        counts = [int(n) for n in text.split(",")]
    except ValueError:
        counts = []
    if not counts or min(counts) < 1:
        raise CliError(f"bench: --scaling {text!r} is not a list of replica counts; write e.g. --scaling 1,2,4.")
    return counts


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=os.environ.get("MIRRORED_LOG", "WARNING"), format="%(levelname)s %(name)s: %(message)s")
    args = build_parser().parse_args(argv)
    from mirrored import tune_allocator

    # Images, batches and activations reuse freed memory instead of faulting in fresh pages; the bench's
    # worker processes inherit it (mirrored._allocator.child_environment), so its rows compare alike.
    tune_allocator()
    from mirrored.training.checkpoint import CheckpointError

    try:
        return {"train": cmd_train, "profile": cmd_train, "evaluate": cmd_evaluate,
                "bench": cmd_bench}[args.command](args)
    except (CliError, CheckpointError) as e:  # CheckpointError: a damaged or mismatched file, named in e
        return _error(args, e)
    except OSError as e:
        if _users_file(args, e):  # a file the user named (the checkpoint) or a write into --out failed
            return _error(args, e)
        raise


def _error(args: argparse.Namespace, e: BaseException) -> int:
    print(f"mirrored {args.command}: error: {' '.join(str(e).split())}", file=sys.stderr)
    return 2


def _users_file(args: argparse.Namespace, e: OSError) -> bool:
    """Whether an OSError is about a path the user chose (the checkpoint, something under --out), so
    that it is the user's to fix (a full disk, permissions), not a bug of ours."""
    if not e.filename:
        return False
    path = Path(os.fsdecode(e.filename)).resolve()
    mine = [Path(p).resolve() for p in (getattr(args, "out", None), getattr(args, "checkpoint", None)) if p]
    return any(path == p or p in path.parents for p in mine)


if __name__ == "__main__":
    sys.exit(main())
