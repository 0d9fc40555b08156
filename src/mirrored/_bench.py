"""The fit throughput table: `Model.fit` on N CPU replicas beside the machine's limit, N independent
processes, DDP and a plain PyTorch loop, measured side by side in one run.

`mirrored bench` prints the quick table and benchmarks/fit_throughput.py the full one; both call
`compare` (one global batch) and `scaling` (1, 2, 4... replicas). Every row trains the same model
(the small CIFAR ResNet, ResNet-20, on NCHW batches; its convolutions in the memory format fit's
compile(memory_format=) runs, "auto": channels_last, in every row alike) with SGD(momentum=0.9) on
the same synthetic 32x32 batches already in memory, so the input pipeline is not what is timed. The
rows:

  alone x N    one replica's step alone (its per-replica batch, one intra-op thread, a plain loop),
               times N: what N cores give if running N at once costs nothing (the limit)
  independent  N independent processes at once, 1 thread each, each training on its per-replica
               batch, never communicating: what N busy cores really give here
  fit          mr.Model.fit on N logical CPU replicas (threads, 1 intra-op thread each)
  DDP          torch DistributedDataParallel, gloo, N processes x 1 thread
  plain        one process, one plain loop at the global batch, intra-op threads on every core

Each round runs every row once, in turn, so that a slow spell of a shared machine hits all of them
alike; printed are medians and ranges of images/s, and fit's ratio to each row. Processes are timed
from a barrier after their warm-up steps, so their start-up is not. The process rows re-run this
module as `python -m mirrored._bench --worker ...`. Benchmark code: torch, torch.distributed and
the public API only; nothing in the library imports it.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import time
import warnings
from collections.abc import Callable, Iterator, Sequence

import torch
import torch.nn.functional as F

import mirrored as mr
from mirrored import _allocator
from mirrored._cpus import usable_cores

WARMUP_STEPS = 2
_WORKER_TIMEOUT_S = 600  # one process row's run; a hung worker fails the table instead of stalling it
ROWS = ("limit", "independent", "fit", "DDP", "plain")
# Rows run only when asked for (benchmarks/fit_throughput.py --rows): fit as the README writes it, on
# Dataset.from_tensor_slices((x, y)).batch(B), without and with .prefetch(AUTOTUNE), metrics=["accuracy"].
README_ROWS = ("fit-readme", "fit-readme-prefetch")

Batches = list[tuple[torch.Tensor, torch.Tensor]]


def make_data(n: int, batch: int, seed: int = 0) -> Batches:
    """`n` synthetic 32x32 RGB images (NCHW) with labels of 10 classes, in batches of `batch`."""
    g = torch.Generator().manual_seed(seed)
    x = torch.rand(n, 3, 32, 32, generator=g)
    y = torch.randint(0, 10, (n,), generator=g)
    return [(x[i:i + batch], y[i:i + batch]) for i in range(0, n, batch)]


# The models a table can time (fit_throughput.py --model): CIFAR ResNets by depth. ResNet-8 (a conv stem,
# one residual block per stage, BatchNorm) is where the fixed Python of a step weighs most.
MODELS = {"resnet20": 20, "resnet8": 8}


def make_net(channels_last: bool = False, model: str = "resnet20") -> torch.nn.Module:
    """A CIFAR ResNet of MODELS (ResNet-20 by default) on NCHW batches; channels_last=True stores its
    convolutions as fit's default does."""
    torch.manual_seed(0)
    net = mr.models.resnet_cifar(depth=MODELS[model], num_classes=10, data_format="channels_first")
    return net.to(memory_format=torch.channels_last) if channels_last else net


def _train(net: torch.nn.Module, batches: Batches) -> None:
    opt = torch.optim.SGD(net.parameters(), lr=0.01, momentum=0.9)
    net.train()
    for x, y in batches:
        opt.zero_grad(set_to_none=True)
        F.cross_entropy(net(x), y).backward()
        opt.step()


@contextlib.contextmanager
def _threads(n: int) -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _images(batches: Batches) -> int:
    return sum(len(x) for x, _ in batches)


def plain_loop(batches: Batches, threads: int, channels_last: bool = False, model: str = "resnet20") -> float:
    """Images/s of a hand-written loop in this process with `threads` intra-op threads."""
    with _threads(threads):
        net = make_net(channels_last, model)
        _train(net, batches[:WARMUP_STEPS])
        start = time.perf_counter()
        _train(net, batches)
        seconds = time.perf_counter() - start
    return _images(batches) / seconds


def limit(per_replica_batches: Batches, replicas: int, channels_last: bool = False, model: str = "resnet20") -> float:
    """One replica's work timed alone (its batches, one thread), times the replica count."""
    return replicas * plain_loop(per_replica_batches, 1, channels_last, model)


def fit_model(replicas: int, steps_per_execution: int = 1, memory_format: str = "auto",
              metrics: Sequence[str] = (), net: str = "resnet20") -> mr.Model:
    """The compiled mr.Model the fit row trains, on `replicas` logical CPU replicas."""
    strategy = mr.MirroredStrategy(devices=[f"cpu:{i}" for i in range(replicas)])
    with strategy.scope():
        model = mr.Model(make_net(model=net))
        model.compile(optimizer=mr.optimizers.SGD(learning_rate=0.01, momentum=0.9),
                      loss="sparse_categorical_crossentropy", metrics=list(metrics),
                      steps_per_execution=steps_per_execution, memory_format=memory_format)
    return model


def fit_loop(batches: Batches, replicas: int, steps_per_execution: int = 1, memory_format: str = "auto",
             metrics: Sequence[str] = (), net: str = "resnet20") -> float:
    """Images/s of Model.fit on `replicas` logical CPU replicas over the same batches."""
    model = fit_model(replicas, steps_per_execution, memory_format, metrics, net)
    model.fit(batches[:WARMUP_STEPS], epochs=1, verbose=0)  # starts the replica threads, sizes buffers
    start = time.perf_counter()
    model.fit(batches, epochs=1, verbose=0)
    return _images(batches) / (time.perf_counter() - start)


def fit_readme(batches: Batches, replicas: int, prefetch: bool, memory_format: str = "auto") -> float:
    """Images/s of Model.fit with metrics=["accuracy"] on the README's pipeline over the same examples:
    Dataset.from_tensor_slices((x, y)).batch(B), with .prefetch(AUTOTUNE) if `prefetch`."""
    x, y = torch.cat([b[0] for b in batches]).numpy(), torch.cat([b[1] for b in batches]).numpy()

    def pipeline(n: int) -> mr.data.Dataset:
        ds = mr.data.Dataset.from_tensor_slices((x[:n], y[:n])).batch(len(batches[0][0]))
        return ds.prefetch(mr.data.AUTOTUNE) if prefetch else ds

    model = fit_model(replicas, memory_format=memory_format, metrics=["accuracy"])
    model.fit(pipeline(len(batches[0][0]) * WARMUP_STEPS), epochs=1, verbose=0)
    data = pipeline(len(x))
    start = time.perf_counter()
    model.fit(data, epochs=1, verbose=0)
    return len(x) / (time.perf_counter() - start)


def fit_memory_format(memory_format: str = "auto") -> str:
    """The memory format fit's convolutions run in under compile(memory_format=...) (model.memory_format)."""
    return fit_model(1, memory_format=memory_format).memory_format


# ---- process rows -------------------------------------------------------------------------------

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def processes(kind: str, replicas: int, per_replica: int, images: int, channels_last: bool = False,
              model: str = "resnet20") -> float:
    """Images/s of `replicas` worker processes of `kind` ("ddp" or "independent"): the images all of
    them trained on, over the slowest one's time from their common start."""
    results = run_workers(kind, replicas, per_replica, images, channels_last, model)
    return sum(r["images"] for r in results) / max(r["seconds"] for r in results)


def run_workers(kind: str, replicas: int, per_replica: int, images: int, channels_last: bool = False,
                model: str = "resnet20") -> list[dict]:
    """Each worker's {"images", "seconds", "cpu_seconds"} (wall and CPU time of its timed steps)."""
    port = _free_port()
    argv = [sys.executable, "-m", "mirrored._bench", "--worker", kind, "--world", str(replicas), "--port", str(port),
            "--per-replica", str(per_replica), "--images", str(images), "--model", model]
    argv += ["--channels-last"] if channels_last else []
    env = {**os.environ, **_allocator.child_environment()}  # (the rows in this process run on the same malloc)
    procs = [subprocess.Popen(argv + ["--rank", str(r)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env=env) for r in range(replicas)]
    results = []
    try:
        for p in procs:
            out, err = p.communicate(timeout=_WORKER_TIMEOUT_S)
            if p.returncode != 0:
                raise RuntimeError(f"a {kind} worker exited with status {p.returncode}: {err.strip()[-2000:]}")
            results.append(json.loads(out.strip().splitlines()[-1]))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return results


def worker(kind: str, rank: int, world: int, port: int, per_replica: int, images: int,
           channels_last: bool = False, model: str = "resnet20") -> None:
    """One process of a process row: its share of the images, one intra-op thread; prints its JSON."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        batches = make_data(images // world, per_replica, seed=1 + rank)
        net = make_net(channels_last, model)
        if kind == "ddp":
            net = torch.nn.parallel.DistributedDataParallel(net)
        _train(net, batches[:WARMUP_STEPS])
        dist.barrier()  # (the independent workers meet only here: everyone starts together)
        start, cpu = time.perf_counter(), time.process_time()
        _train(net, batches)
        seconds, cpu_seconds = time.perf_counter() - start, time.process_time() - cpu
        print(json.dumps({"images": _images(batches), "seconds": seconds, "cpu_seconds": cpu_seconds}), flush=True)
        del net  # (DDP's reducer holds the group: gone before the group is, not in the interpreter's teardown)
        dist.barrier()  # (no one tears the group down while another still talks over it)
    finally:
        dist.destroy_process_group()


# ---- the tables ---------------------------------------------------------------------------------

def machine() -> str:
    cpu = platform.processor()
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as f:
        cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu)
    return (f"machine: {cpu or 'unknown CPU'}, {usable_cores()} cores | python {platform.python_version()} | "
            f"torch {torch.__version__} | mirrored {mr.__version__}")


def load() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg()) if hasattr(os, "getloadavg") else "n/a"


def _cell(values: list[float]) -> str:
    return f"{statistics.median(values):.1f} ({min(values):.0f}-{max(values):.0f})"


def compare(batch: int, replicas: int, images: int, rounds: int, steps_per_execution: int = 1,
            rows: Sequence[str] = ROWS, print_fn: Callable[[str], None] = print,
            memory_format: str = "auto", model: str = "resnet20") -> dict[str, float]:
    """Every row at one global batch, in turn, `rounds` times; prints the table, returns the medians.
    The rows other than fit store their convolutions in the memory format fit runs in."""
    per_replica = -(-batch // replicas)
    data = make_data(images, batch)
    alone = make_data(images // replicas, per_replica)
    ran = fit_memory_format(memory_format)
    cl = ran != "as given"
    runs: dict[str, Callable[[], float]] = {
        "limit": lambda: limit(alone, replicas, cl, model),
        "independent": lambda: processes("independent", replicas, per_replica, images, cl, model),
        "fit": lambda: fit_loop(data, replicas, steps_per_execution, memory_format, net=model),
        "DDP": lambda: processes("ddp", replicas, per_replica, images, cl, model),
        "plain": lambda: plain_loop(data, usable_cores(), cl, model),
        "fit-readme": lambda: fit_readme(data, replicas, False, memory_format),
        "fit-readme-prefetch": lambda: fit_readme(data, replicas, True, memory_format),
    }
    labels = {
        "limit": f"1 replica's step alone x {replicas}",
        "independent": f"{replicas} independent processes at once",
        "fit": f"mirrored fit, {replicas} CPU replicas",
        "DDP": f"DDP (gloo), {replicas} processes x 1 thread",
        "plain": f"plain PyTorch, 1 process, {usable_cores()} threads",
        "fit-readme": "fit, README pipeline, accuracy",
        "fit-readme-prefetch": "fit, README pipeline + prefetch, accuracy",
    }
    chosen = [name for name in ROWS + README_ROWS if name in rows or name == "fit"]
    before = load()
    samples: dict[str, list[float]] = {name: [] for name in chosen}
    for _ in range(rounds):
        for name in chosen:
            samples[name].append(runs[name]())
    med = {name: statistics.median(v) for name, v in samples.items()}
    print_fn(f"\nglobal batch {batch} ({per_replica} per replica), {images} images per run, {rounds} round(s); "
             f"load average before {before}, after {load()}")
    print_fn(f"  memory format: fit's convolutions ran {ran} (compile(memory_format={memory_format!r})); every row "
             f"runs {'channels_last' if cl else 'NCHW (as given)'}")
    print_fn(f"  {'':<42}{'images/s (range)':>22}{'fit / row':>11}{'row / limit':>13}")
    for name in chosen:
        ratio_limit = f"{med[name] / med['limit']:>13.3f}" if "limit" in med else f"{'-':>13}"
        print_fn(f"  {labels[name]:<42}{_cell(samples[name]):>22}{med['fit'] / med[name]:>11.3f}{ratio_limit}")
    return med


def scaling(batch: int, counts: Sequence[int], images: int, rounds: int,
            print_fn: Callable[[str], None] = print) -> dict[int, float]:
    """fit's images/s on each replica count at one global batch, in turn; against the first count."""
    data = make_data(images, batch)
    samples: dict[int, list[float]] = {n: [] for n in counts}
    with warnings.catch_warnings():  # more replicas than cores is this curve's point: the table says so
        warnings.filterwarnings("ignore", message=r".*CPU replicas share \d+ core", category=UserWarning)
        for _ in range(rounds):
            for n in counts:
                samples[n].append(fit_loop(data, n))
    med = {n: statistics.median(v) for n, v in samples.items()}
    print_fn(f"\nscaling: mirrored fit at global batch {batch}, {images} images per run, {rounds} round(s), "
             f"{usable_cores()} cores; load average {load()}")
    print_fn(f"  {'replicas':>8}{'images/s (range)':>22}{f'x {counts[0]} replica(s)':>17}")
    for n in counts:
        shared = f"  ({n} threads take turns on {usable_cores()} cores)" if n > usable_cores() else ""
        print_fn(f"  {n:>8}{_cell(samples[n]):>22}{med[n] / med[counts[0]]:>17.2f}{shared}")
    return med


def _worker_main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="one worker process of the fit table (internal)")
    parser.add_argument("--worker", choices=["ddp", "independent"], required=True)
    parser.add_argument("--channels-last", action="store_true")
    parser.add_argument("--model", choices=sorted(MODELS), default="resnet20")
    for flag in ("--rank", "--world", "--port", "--per-replica", "--images"):
        parser.add_argument(flag, type=int, required=True)
    args = parser.parse_args(argv)
    worker(args.worker, args.rank, args.world, args.port, args.per_replica, args.images, args.channels_last,
           args.model)
    # Out without the interpreter's teardown: gloo's threads can still hold tensors whose release then needs
    # the GIL of a dying interpreter, and the process aborts (SIGABRT, "terminate called without an active
    # exception") after its result was printed - a flake the rows used to fail on, once in hundreds of runs.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    _worker_main()
