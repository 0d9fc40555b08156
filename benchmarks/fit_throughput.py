"""Images/s of `Model.fit` on N CPU replicas against the machine's limit, DDP and a plain PyTorch loop.

    .venv/bin/python benchmarks/fit_throughput.py                   # global batches 64 and 256, 2 replicas
    .venv/bin/python benchmarks/fit_throughput.py --scaling 1,2,4   # and fit's curve over replica counts
    .venv/bin/python benchmarks/fit_throughput.py --quick           # one small round (`mirrored bench`)

Rows (each round runs all of them in turn; medians and ranges of images/s, fit's ratio to each):
limit (one replica's per-replica-batch step timed alone on 1 thread, x N), N independent processes
x 1 thread, mirrored fit on N CPU replicas, DDP (gloo, N processes x 1 thread), and plain PyTorch
(one process, every core). The load average before and after each table says how busy the machine
was. The rows are defined in src/mirrored/_bench.py, which `mirrored bench` shares. Targets
(issues 15 and 35): fit >= 0.95 of the limit at both batches on both models, and >= 1.0 of DDP.
"""
from __future__ import annotations

import argparse

import mirrored as mr
from mirrored import _bench


def _counts(text: str) -> list[int]:
    try:
        counts = [int(n) for n in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected replica counts like 1,2,4, got {text!r}") from None
    if not counts or min(counts) < 1:
        raise argparse.ArgumentTypeError(f"replica counts must be >= 1, got {text!r}")
    return counts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, nargs="+", default=[64, 256], help="global batch sizes")
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--images", type=int, default=2048, help="images per timed run")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps-per-execution", type=int, default=1)
    parser.add_argument("--scaling", type=_counts, default=None, help="replica counts for fit's curve, e.g. 1,2,4 "
                        "(at the first of --batches)")
    parser.add_argument("--rows", nargs="+", choices=_bench.ROWS + _bench.README_ROWS,
                        default=list(_bench.ROWS), help="the rows to run (fit always runs; the README rows "
                        "fit-readme and fit-readme-prefetch only when named)")
    parser.add_argument("--memory-format", choices=["auto", "channels_last", "preserve"], default="auto",
                        help="fit's compile(memory_format=); the other rows run the format fit ran")
    parser.add_argument("--model", nargs="+", choices=sorted(_bench.MODELS), default=["resnet20"],
                        help="the models, one table each: resnet20, and resnet8 (a conv stem, three residual blocks), "
                        "where the fixed Python per step weighs most")
    parser.add_argument("--quick", action="store_true", help="512 images, one round (what `mirrored bench` runs)")
    parser.add_argument("--tune-malloc", action="store_true",
                        help="every row after mr.tune_allocator() (the worker processes too), as `mirrored train` "
                        "runs: glibc's defaults fault in fresh pages for each step's activations on the replica "
                        "threads")
    args = parser.parse_args()
    if args.quick:
        args.images, args.rounds = 512, 1
    if args.replicas < 1 or args.rounds < 1 or min(args.batches) < args.replicas or args.images < max(args.batches):
        parser.error("need --replicas >= 1, --rounds >= 1, every batch >= --replicas and --images >= the largest "
                     "batch")
    if args.tune_malloc and not mr.tune_allocator():
        parser.error("--tune-malloc: this C library is not glibc, whose allocator it tunes")
    print(_bench.machine() + (" | malloc tuned (mr.tune_allocator)" if args.tune_malloc else ""))
    for model in args.model:
        depth = _bench.MODELS[model]
        print(f"\nmodel: resnet_cifar(depth={depth}), 32x32 inputs, SGD(momentum=0.9), batches in memory")
        for batch in args.batches:
            _bench.compare(batch, args.replicas, args.images, args.rounds, args.steps_per_execution, rows=args.rows,
                           memory_format=args.memory_format, model=model)
    if args.scaling:
        _bench.scaling(args.batches[0], args.scaling, args.images, args.rounds)


if __name__ == "__main__":
    main()
