"""Images/s of `Model.fit` eager against `compile(jit_compile=True)` on N CPU replicas, and compile time.

    .venv/bin/python benchmarks/jit_compile.py             # global batches 64 and 256, 2 replicas
    .venv/bin/python benchmarks/jit_compile.py --quick     # one small round (a smoke test)

Same model (the small CIFAR ResNet, NCHW), same synthetic 32x32 data batched in memory, same seeds
and optimizer. Compile time is measured cold (a fresh inductor cache directory unless --warm-cache):
the jit model's first fit, over two full batches and an uneven last one (which compiles again),
minus what those images cost at the steady jit rate. Then eager and jit
fits alternate for several rounds over the same batches and the medians are printed, with the
ratio jit / eager. Also printed: the largest difference between the two models' weights after the
same warm-up steps (float reassociation in inductor's fused kernels).
"""
from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import tempfile
import time
import warnings

if "--warm-cache" not in sys.argv:  # before torch reads it: a cold compile, as a first run has
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="mirrored-jit-bench-")

import torch  # noqa: E402

import mirrored as mr  # noqa: E402
from mirrored._cpus import usable_cores  # noqa: E402
from mirrored.training import jit as jit_lib  # noqa: E402


def make_batches(n: int, batch: int, seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    x = torch.rand(n, 3, 32, 32, generator=g)
    y = torch.randint(0, 10, (n,), generator=g)
    return [(x[i:i + batch], y[i:i + batch]) for i in range(0, n, batch)]


def make_model(replicas: int, jit_compile: bool, depth: int) -> mr.Model:
    torch.manual_seed(0)
    strategy = mr.MirroredStrategy(devices=[f"cpu:{i}" for i in range(replicas)])
    with strategy.scope():
        model = mr.Model(mr.models.resnet_cifar(depth=depth, num_classes=10, data_format="channels_first"))
        model.compile(optimizer=mr.optimizers.SGD(learning_rate=0.01, momentum=0.9),
                      loss="sparse_categorical_crossentropy", jit_compile=jit_compile)
    return model


def timed_fit(model: mr.Model, batches: list) -> float:
    """Seconds of one fit epoch over `batches`."""
    start = time.perf_counter()
    model.fit(batches, epochs=1, verbose=0)
    return time.perf_counter() - start


def images(batches: list) -> int:
    return sum(len(x) for x, _ in batches)


def max_weight_difference(a: mr.Model, b: mr.Model) -> float:
    return max(float((p - q).detach().abs().max()) for p, q in zip(a.module.parameters(), b.module.parameters()))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, nargs="+", default=[64, 256])
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--images", type=int, default=2048, help="images per timed run")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--depth", type=int, default=20, help="resnet_cifar depth (6n+2)")
    parser.add_argument("--warm-cache", action="store_true", help="reuse inductor's on-disk cache")
    parser.add_argument("--dynamic", choices=["auto", "false"], default="false",
                        help="torch.compile(dynamic=): false (mirrored's choice) compiles a static graph per batch "
                             "size; auto (torch's None) recompiles the uneven last batch once with a dynamic size")
    parser.add_argument("--quick", action="store_true", help="one small round (a smoke test)")
    args = parser.parse_args()
    jit_lib.DYNAMIC = None if args.dynamic == "auto" else False
    if args.quick:
        args.images, args.rounds = 4 * max(args.batches), 1
    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")),
               platform.processor())
    cc = jit_lib.find_cpp_compiler()
    print(f"machine: {cpu}, {usable_cores()} cores | python {platform.python_version()} | torch {torch.__version__}"
          f" | C++ compiler: {cc or 'none'}")
    print(f"model: resnet_cifar(depth={args.depth}), 32x32 inputs, {args.replicas} CPU replicas, {args.images} "
          f"images per run, {args.rounds} rounds, inductor cache {'warm' if args.warm_cache else 'cold'}, "
          f"dynamic={jit_lib.DYNAMIC}")
    print(f"{'global batch':>12} {'eager img/s':>12} {'jit img/s':>10} {'jit/eager':>10} {'compile s':>10} "
          f"{'max |dw|':>9}")
    for batch in args.batches:
        data = make_batches(args.images, batch)
        # Two full batches and an uneven last one: the first compile and the recompile it causes.
        warmup = make_batches(2 * batch + batch // 2 + 2, batch, seed=1)
        eager, jit = make_model(args.replicas, False, args.depth), make_model(args.replicas, True, args.depth)
        with warnings.catch_warnings():
            # A fallback to eager would make the figures meaningless.
            warnings.filterwarnings("error", message=".*running eager", category=UserWarning)
            warm_s = timed_fit(jit, warmup)
        timed_fit(eager, warmup)
        difference = max_weight_difference(eager, jit)
        eager_rates, jit_rates = [], []
        for _ in range(args.rounds):
            eager_rates.append(images(data) / timed_fit(eager, data))
            jit_rates.append(images(data) / timed_fit(jit, data))
        eager_rate, jit_rate = statistics.median(eager_rates), statistics.median(jit_rates)
        # (the warm-up's first fit step is eager, while mirrored's first-run module check is installed)
        compile_s = warm_s - images(warmup) / jit_rate
        print(f"{batch:>12} {eager_rate:>12.0f} {jit_rate:>10.0f} {jit_rate / eager_rate:>10.2f} {compile_s:>10.1f} "
              f"{difference:>9.1e}")
        print(f"{'':>12} eager {min(eager_rates):.0f}-{max(eager_rates):.0f}, jit {min(jit_rates):.0f}-"
              f"{max(jit_rates):.0f} img/s over {args.rounds} rounds")


if __name__ == "__main__":
    main()
