"""Images/s of a JPEG input pipeline: our `Dataset.map` serial vs AUTOTUNE, and against tf.data.

    .venv/bin/python benchmarks/input_pipeline.py                      # 200 synthetic JPEGs
    .venv/bin/python benchmarks/input_pipeline.py --data-dir DIR       # *.jpg under DIR, or TFDS
                                                                       # tfrecords (e.g. cassava)
    .venv/bin/python benchmarks/input_pipeline.py --tf-python /tmp/tfbench/bin/python
    .venv/bin/python benchmarks/input_pipeline.py --tune-malloc    # glibc keeps freed memory

The pipeline is the reference workload's: read file -> decode JPEG (RGB) -> resize to 224x224
(bilinear) -> / 255 -> batch(32) -> prefetch(AUTOTUNE), with map's num_parallel_calls None (one
element at a time, on the consumer's thread) or AUTOTUNE (one thread per core). The same map is
also timed with Pillow decoding instead of decode_image (simplejpeg), to show what the decoder
contributes, and without Dataset (a loop, then a ThreadPoolExecutor with a thread per core), to
show what Dataset's threads cost over a plain pool. Last, the same work in separate processes (one,
then one per core, each on its share of the files, no batching): no GIL and nothing shared, so
their ratio is what this machine gives that many workers at best (a VM's cores may not be whole).
With --tf-python, an interpreter that has TensorFlow (a separate venv, e.g. `python3.11 -m venv
/tmp/tfbench && /tmp/tfbench/bin/pip install tensorflow-cpu`) runs the same pipeline in tf.data
(tf.io.decode_jpeg, tf.image.resize) on the same files, as a subprocess started once and driven
over a pipe, so its rounds alternate with ours. Each configuration runs once untimed, then
`--rounds` times in alternation; medians are printed with the range, since the machine may be
shared, with the cores the process kept busy: a parallel pipeline on an idle machine should keep
them all busy. torch runs each op on `--torch-threads` threads (default 1, so the map's threads
do not each start an OpenMP team on the same cores).

With glibc's default malloc, each image's large buffers are fresh mmap'd pages: ~50-200 page
faults per image, and with two threads the kernel time per image grows, which costs AUTOTUNE
part of its speedup; --tune-malloc runs everything after `mr.tune_allocator()` (what the
`mirrored` command does) to show the pipeline without that cost.
"""
from __future__ import annotations

import argparse
import contextlib
import io
import itertools
import json
import os
import platform
import statistics
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor
from multiprocessing import get_context
from pathlib import Path
from typing import Any

import cv2
import numpy as np
import PIL
import simplejpeg
import torch
from PIL import Image

import mirrored as mr
from mirrored._cpus import usable_cores
from mirrored.data.images import decode_image, resize
from mirrored.data.tfrecord import parse_example, read_records

AUTOTUNE = mr.data.AUTOTUNE

# Run by --tf-python: build the pipeline once per mode, then answer one line per request on
# stdin ("serial" / "autotune": images/s and cores busy over one full pass; "check": per-image
# means of batch 0)
_TF_SNIPPET = r"""
import json, os, sys, time
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
import tensorflow as tf
files, size, batch = json.loads(sys.argv[1])

def load(path):
    image = tf.io.decode_jpeg(tf.io.read_file(path), channels=3)
    return tf.image.resize(image, (size, size)) / 255.0

def pipeline(parallel):
    ds = tf.data.Dataset.from_tensor_slices(files)
    ds = ds.map(load, num_parallel_calls=tf.data.AUTOTUNE if parallel else None)
    return ds.batch(batch).prefetch(tf.data.AUTOTUNE)

datasets = {"serial": pipeline(False), "autotune": pipeline(True)}
print("READY " + tf.__version__, flush=True)
for line in sys.stdin:
    mode = line.strip()
    if mode == "check":
        first = next(iter(datasets["serial"])).numpy()
        print("RESULT " + json.dumps(first.mean(axis=(1, 2, 3)).tolist()), flush=True)
        continue
    wall, cpu, n = time.perf_counter(), time.process_time(), 0
    for images in datasets[mode]:
        n += int(images.shape[0])
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    print("RESULT " + json.dumps([n / wall, cpu / wall]), flush=True)
"""


# ------------------------------------------------------------------------------------- data


def synthetic_photo(seed: int, height: int = 375, width: int = 500) -> np.ndarray:
    """A photo-like uint8 image: smooth colour gradients, a few soft blobs, sensor-like noise."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width].astype(np.float32)
    base = rng.uniform(60, 190, 3).astype(np.float32)
    tilt = rng.uniform(-0.25, 0.25, (2, 3)).astype(np.float32)
    image = base + x[..., None] * tilt[0] + y[..., None] * tilt[1]
    for _ in range(rng.integers(3, 8)):
        cy, cx = rng.uniform(0, height), rng.uniform(0, width)
        radius = rng.uniform(20, 120)
        weight = np.exp(-((y - cy) ** 2 + (x - cx) ** 2) / (2 * radius**2))
        image += weight[..., None] * rng.uniform(-90, 90, 3).astype(np.float32)
    ripple = np.sin(x / rng.uniform(6, 30) + np.cos(y / rng.uniform(6, 30)) * 3) * 12
    image += ripple[..., None] + rng.normal(0, 6, image.shape).astype(np.float32)
    return np.clip(image, 0, 255).astype(np.uint8)


def write_synthetic(directory: Path, count: int) -> list[str]:
    paths = []
    for i in range(count):
        path = directory / f"photo-{i:04d}.jpg"
        Image.fromarray(synthetic_photo(i)).save(path, format="JPEG", quality=90)
        paths.append(str(path))
    return paths


def files_from(data_dir: Path, scratch: Path, count: int) -> tuple[list[str], str]:
    """Up to `count` JPEG files from `data_dir`: image files as they are, or the "image" feature
    of TFDS tfrecords written out to `scratch`, so both pipelines read plain files."""
    jpegs = sorted(p for p in data_dir.rglob("*") if p.suffix.lower() in (".jpg", ".jpeg"))
    if jpegs:
        return [str(p) for p in jpegs[:count]], f"{min(count, len(jpegs))} JPEGs from {data_dir}"
    records = sorted(p for p in data_dir.rglob("*.tfrecord*") if p.is_file())
    paths: list[str] = []
    for record_file in records:
        for record in read_records(record_file):
            if len(paths) == count:
                break
            path = scratch / f"record-{len(paths):05d}.jpg"
            path.write_bytes(parse_example(record)["image"][0])
            paths.append(str(path))
    if not paths:
        raise SystemExit(f"--data-dir {data_dir}: found no *.jpg/*.jpeg files and no TFDS "
                         f"*.tfrecord* files with an 'image' feature. Point it at a folder of "
                         f"JPEGs or a TFDS dataset directory (e.g. .../cassava/0.1.0).")
    return paths, f"{len(paths)} JPEG records from the tfrecords in {data_dir}"


# ---------------------------------------------------------------------------------- ours


def simplejpeg_load(size: int) -> Callable[[str], torch.Tensor]:
    def load(path: str) -> torch.Tensor:
        with open(path, "rb") as f:
            image = decode_image(f.read(), 3, name=path)
        return resize(image, (size, size)) / 255.0
    return load


def pillow_load(size: int) -> Callable[[str], torch.Tensor]:
    def load(path: str) -> torch.Tensor:
        with open(path, "rb") as f, Image.open(io.BytesIO(f.read())) as image:
            pixels = torch.from_numpy(np.array(image.convert("RGB")))
        return resize(pixels, (size, size)) / 255.0
    return load


def ours(files: list[str], load: Callable[[str], torch.Tensor], parallel: bool,
         batch: int) -> mr.data.Dataset:
    ds = mr.data.Dataset.from_tensor_slices(files)
    ds = ds.map(load, num_parallel_calls=AUTOTUNE if parallel else None)
    return ds.batch(batch).prefetch(AUTOTUNE)


def reference(files: list[str], load: Callable[[str], torch.Tensor], parallel: bool,
              batch: int) -> Iterator[torch.Tensor]:
    """The same work without Dataset: a loop, or a thread pool with a thread per core whose
    results are stacked as they arrive; what Dataset's own stages cost is the difference."""
    with ThreadPoolExecutor(usable_cores()) as pool:
        images = pool.map(load, files) if parallel else map(load, files)
        while chunk := list(itertools.islice(images, batch)):
            yield torch.stack(chunk)


def _load_share(files: list[str], size: int, tune_malloc: bool) -> tuple[int, float, float, float]:
    """In a worker process: loads `files` one by one; (count, CPU s, start, end on the monotonic
    clock, which all processes share)."""
    torch.set_num_threads(1)
    if tune_malloc:
        mr.tune_allocator()
    load = simplejpeg_load(size)
    start, cpu = time.monotonic(), time.process_time()
    for path in files:
        load(path)
    return len(files), time.process_time() - cpu, start, time.monotonic()


class Processes:
    """One process per core, started once (spawned: no inherited threads); `run(k)` splits the
    files over k of them and returns (images/s from the first start to the last end, cores busy)."""

    def __init__(self, files: list[str], size: int, tune_malloc: bool):
        self.files, self.size, self.tune_malloc = files, size, tune_malloc
        self.pool = ProcessPoolExecutor(usable_cores(), mp_context=get_context("spawn"))

    def run(self, k: int) -> tuple[float, float]:
        shares = [self.files[i::k] for i in range(k)]
        done = list(self.pool.map(_load_share, shares, [self.size] * k, [self.tune_malloc] * k))
        wall = max(d[3] for d in done) - min(d[2] for d in done)
        return sum(d[0] for d in done) / wall, sum(d[1] for d in done) / wall

    def close(self) -> None:
        self.pool.shutdown()


def throughput(batches: Iterable[torch.Tensor]) -> tuple[float, float]:
    """(images/s, cores busy = this process's CPU seconds per second) over one pass."""
    wall, cpu, n = time.perf_counter(), time.process_time(), 0
    for images in batches:
        n += images.shape[0]
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    return n / wall, cpu / wall


# -------------------------------------------------------------------------------- tf.data


class TfData:
    """The tf.data pipeline in another interpreter, started once; one pass per request."""

    def __init__(self, python: str, files: list[str], size: int, batch: int):
        env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
        self.proc = subprocess.Popen(
            [python, "-c", _TF_SNIPPET, json.dumps([files, size, batch])], stdin=subprocess.PIPE,
            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env)
        line = self._line()
        if not line.startswith("READY "):
            raise SystemExit(f"--tf-python {python}: TensorFlow did not start ({line!r}). Check "
                             f"that `{python} -c 'import tensorflow'` works.")
        self.version = line.split()[1]

    def _line(self) -> str:
        while True:
            line = self.proc.stdout.readline()
            if not line or line.startswith(("READY ", "RESULT ")):
                return line.strip()

    def ask(self, request: str) -> Any:
        self.proc.stdin.write(request + "\n")
        self.proc.stdin.flush()
        line = self._line()
        if not line.startswith("RESULT "):
            raise SystemExit(f"tf.data subprocess died during {request!r} (exit code "
                             f"{self.proc.poll()}).")
        return json.loads(line[len("RESULT "):])

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=60)


# ----------------------------------------------------------------------------------- main


def machine() -> str:
    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo")
                if line.startswith("model name")), platform.processor())
    return f"{cpu}, {usable_cores()} cores"


def cell(values: list[tuple[float, float]]) -> str:
    speeds = [v[0] for v in values]
    cores = statistics.median(v[1] for v in values)
    return f"{statistics.median(speeds):6.0f} ({min(speeds):.0f}-{max(speeds):.0f}) {cores:4.2f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data-dir", type=Path,
                        help="JPEGs or TFDS tfrecords (default: synthetic photos)")
    parser.add_argument("--images", type=int, default=200, help="images per pass")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--size", type=int, default=224, help="resize to size x size")
    parser.add_argument("--torch-threads", type=int, default=1)
    parser.add_argument("--tf-python", help="python of a venv with TensorFlow, to time tf.data")
    parser.add_argument("--no-pillow", action="store_true", help="skip the Pillow-decode rows")
    parser.add_argument("--tune-malloc", action="store_true",
                        help="keep freed memory in glibc's heaps (mr.tune_allocator(), as `mirrored train` does)")
    args = parser.parse_args()
    torch.set_num_threads(args.torch_threads)
    if args.tune_malloc and not mr.tune_allocator():
        raise SystemExit("--tune-malloc: this is not glibc; run without it.")

    # The stack stops the worker processes and tf.data (also on an error) before the files go.
    with tempfile.TemporaryDirectory(prefix="mirrored-bench-") as scratch, contextlib.ExitStack() as stack:
        if args.data_dir is None:
            files = write_synthetic(Path(scratch), args.images)
            source = f"{len(files)} synthetic 500x375 photo-like JPEGs (quality 90)"
        else:
            files, source = files_from(args.data_dir, Path(scratch), args.images)
        kb = statistics.mean(os.path.getsize(f) for f in files) / 1024

        loads = {"ours, simplejpeg": simplejpeg_load(args.size)}
        if not args.no_pillow:
            loads["ours, Pillow decode"] = pillow_load(args.size)
        runs: dict[str, Callable[[], tuple[float, float]]] = {}
        for label, load in loads.items():
            for mode, parallel in (("serial", False), ("AUTOTUNE", True)):
                ds = ours(files, load, parallel, args.batch)
                runs[f"{label}|{mode}"] = lambda ds=ds: throughput(ds)
        for mode, parallel in (("serial", False), ("AUTOTUNE", True)):
            runs[f"{_REFERENCE}|{mode}"] = lambda parallel=parallel: throughput(
                reference(files, loads["ours, simplejpeg"], parallel, args.batch))
        processes = Processes(files, args.size, args.tune_malloc)
        stack.callback(processes.close)
        runs[f"{_PROCESSES}|serial"] = lambda: processes.run(1)
        runs[f"{_PROCESSES}|AUTOTUNE"] = lambda: processes.run(usable_cores())
        tf = None
        if args.tf_python:
            tf = TfData(args.tf_python, files, args.size, args.batch)
            stack.callback(tf.close)
            runs["tf.data|serial"] = lambda: tuple(tf.ask("serial"))
            runs["tf.data|AUTOTUNE"] = lambda: tuple(tf.ask("autotune"))

        versions = (f"python {platform.python_version()} | torch {torch.__version__} | simplejpeg "
                    f"{simplejpeg.__version__} | Pillow {PIL.__version__} | OpenCV {cv2.__version__} (resize)")
        if tf is not None:
            versions += f" | tensorflow {tf.version} ({args.tf_python})"
        print(f"machine: {machine()} | load average at start {os.getloadavg()[0]:.1f}")
        print(versions)
        print(f"data: {source}, {kb:.0f} KB mean; read -> decode -> resize {args.size}x{args.size} "
              f"-> /255 -> batch({args.batch}) -> prefetch(AUTOTUNE); torch threads "
              f"{args.torch_threads}; glibc malloc {'tuned' if args.tune_malloc else 'default'}; "
              f"{args.rounds} alternating rounds")
        if tf is not None:
            ours_means = next(iter(ours(files[:args.batch], loads["ours, simplejpeg"], False,
                                        args.batch))).mean(dim=(1, 2, 3))
            tf_means = torch.tensor(tf.ask("check"))
            print(f"check: per-image mean of batch 0, ours vs tf.data: max |diff| "
                  f"{(ours_means - tf_means).abs().max().item():.2e} (pixels in [0, 1])")

        for run in runs.values():  # warm-up: page cache, first-iteration costs
            run()
        results: dict[str, list[tuple[float, float]]] = {key: [] for key in runs}
        keys = list(runs)
        for r in range(args.rounds):
            for key in keys[r % len(keys):] + keys[:r % len(keys)]:  # rotate who goes first
                results[key].append(runs[key]())
    print_table(results, tf is not None)


_REFERENCE = "no Dataset (ref.)"
_PROCESSES = "processes (ceiling)"


def print_table(results: dict[str, list[tuple[float, float]]], with_tf: bool) -> None:
    med = {key: statistics.median(v[0] for v in values) for key, values in results.items()}
    print("\nimages/s: median (min-max), then the median cores busy (CPU s per s, all threads)")
    print(f"{'pipeline':<21}{'serial':>24}{'AUTOTUNE':>24}{'AUTOTUNE/serial':>17}")
    labels = list(dict.fromkeys(key.split("|")[0] for key in results))
    for label in labels:
        serial, auto = results[f"{label}|serial"], results[f"{label}|AUTOTUNE"]
        print(f"{label:<21}{cell(serial):>24}{cell(auto):>24}"
              f"{med[f'{label}|AUTOTUNE'] / med[f'{label}|serial']:>16.2f}x")
    if with_tf:
        for label in labels:
            if label.startswith("ours"):
                serial = med[f"{label}|serial"] / med["tf.data|serial"]
                auto = med[f"{label}|AUTOTUNE"] / med["tf.data|AUTOTUNE"]
                print(f"{label + ' / tf.data':<35}{serial:>9.2f}x{auto:>24.2f}x")
    cores = usable_cores()
    busy = statistics.median(v[1] for v in results[f"{_REFERENCE}|AUTOTUNE"])
    if busy < 0.8 * cores:
        print(f"note: the thread-pool reference kept only {busy:.2f} of {cores} cores busy: other "
              f"processes had the rest, so AUTOTUNE/serial understates; rerun on an idle machine.")
    print(f"load average at end {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
