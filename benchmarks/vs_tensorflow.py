"""`mirrored` against TensorFlow 2.21 on the same machine: Keras fit on one device and on MirroredStrategy.

    .venv/bin/python benchmarks/vs_tensorflow.py --tf-python /tmp/tfbench/bin/python
    .venv/bin/python benchmarks/vs_tensorflow.py            # without TensorFlow: our rows only

TensorFlow is never a dependency of the package: it runs from its own venv (`python3.11 -m venv
/tmp/tfbench && /tmp/tfbench/bin/pip install "tensorflow-cpu==2.21.*"`), as a subprocess started
once and driven over a pipe, so its runs alternate with ours in the same minutes (as in
input_pipeline.py). Without --tf-python, or where that interpreter cannot import TensorFlow, the
script says so and prints our rows alone (exit status 0).

Rows, each round in turn, medians and ranges:
  fit   images/s of Keras-style fit, and images per CPU-second (the process's CPU time, all its
        threads, spinning ones too: what the fit cost the machine, which a loaded box's share of
        the cores disturbs least), on the same synthetic 32x32 batches in memory, SGD(momentum=0.9),
        at each global batch:
          mirrored        mr.Model, ResNet-20 on NCHW batches, 2 CPU replicas (2 replica threads x 1
                          intra-op thread); its convolutions in channels_last memory, fit's default
          mirrored, NCHW  the same with compile(memory_format="preserve"), the user's NCHW module
          2 processes     2 independent processes at once, 1 thread each, each training its half of
                          every batch in the format fit ran, never communicating (_bench's row)
          TF, one device  Keras 3 on TF, the same ResNet-20 built in Keras (NHWC), no strategy, TF's
                          default threads on every core (the 2 logical CPU devices the next row
                          needs share one process-wide thread pool, so this row keeps all of it)
          TF, Mirrored    the same under tf.distribute.MirroredStrategy over 2 logical CPU devices
  run   microseconds per strategy.run of a no-op on 2 replicas: ours, and TF's inside a tf.function
        (graph) and eagerly
Issue 29's targets (mirrored >= 1.3x TF one device, >= 2x TF Mirrored, >= 0.95x 2 processes) are
printed last, as ratios of medians with the range of the per-round ratios.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

import mirrored as mr
from mirrored import _bench

# Run by --tf-python: one line per request on stdin ("fit BATCH IMAGES one|mirrored", "run graph CALLS",
# "run eager CALLS"), one "RESULT <json>" line per answer; "READY <tf version> <keras version>" once at start.
_TF_SNIPPET = r"""
import json, os, sys, time
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
import tensorflow as tf
import keras

cpu = tf.config.list_physical_devices("CPU")[0]
tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 2)
strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])

def block(x, channels, stride):
    y = keras.layers.Conv2D(channels, 3, stride, padding="same", use_bias=False)(x)
    y = keras.layers.ReLU()(keras.layers.BatchNormalization()(y))
    y = keras.layers.Conv2D(channels, 3, padding="same", use_bias=False)(y)
    y = keras.layers.BatchNormalization()(y)
    if stride != 1 or x.shape[-1] != channels:  # the CIFAR paper's option A: subsample, zero-pad channels
        pad = channels - x.shape[-1]
        x = keras.layers.Lambda(lambda t: tf.pad(t[:, ::stride, ::stride, :], [[0, 0], [0, 0], [0, 0],
                                                                                  [pad // 2, pad - pad // 2]]))(x)
    return keras.layers.ReLU()(keras.layers.Add()([x, y]))

def resnet20():
    inputs = keras.Input((32, 32, 3))
    x = keras.layers.Conv2D(16, 3, padding="same", use_bias=False)(inputs)
    x = keras.layers.ReLU()(keras.layers.BatchNormalization()(x))
    for channels, stride in ((16, 1), (32, 2), (64, 2)):
        for i in range(3):
            x = block(x, channels, stride if i == 0 else 1)
    x = keras.layers.GlobalAveragePooling2D()(x)
    return keras.Model(inputs, keras.layers.Dense(10)(x))

def data(n, batch):
    g = tf.random.Generator.from_seed(0)
    x = g.uniform((n, 32, 32, 3))
    y = g.uniform((n,), maxval=10, dtype=tf.int32)
    return tf.data.Dataset.from_tensor_slices((x, y)).batch(batch)

def compiled():
    model = resnet20()
    model.compile(optimizer=keras.optimizers.SGD(0.01, momentum=0.9),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model

def fit(batch, images, where):
    if where == "mirrored":
        with strategy.scope():
            model = compiled()
    else:  # one device, TF's default placement and threads: what a Keras user gets without a strategy
        model = compiled()
    model.fit(data(2 * batch, batch), epochs=1, verbose=0)  # traces the step
    ds = data(images, batch)
    start, cpu = time.perf_counter(), time.process_time()
    model.fit(ds, epochs=1, verbose=0)
    return [images / (time.perf_counter() - start), images / (time.process_time() - cpu)]

@tf.function
def run_graph():
    strategy.run(lambda: None)

def run(mode, calls):
    fn = run_graph if mode == "graph" else (lambda: strategy.run(lambda: None))
    for _ in range(10):
        fn()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - start) / calls * 1e6

print("READY", tf.__version__, keras.__version__, flush=True)
for line in sys.stdin:
    words = line.split()
    if words[0] == "fit":
        result = fit(int(words[1]), int(words[2]), words[3])
    else:
        result = run(words[1], int(words[2]))
    print("RESULT", json.dumps(result), flush=True)
"""


class TensorFlow:
    """Keras on TF in another interpreter, started once; one measurement per request."""

    def __init__(self, python: str):
        self.proc = subprocess.Popen([python, "-c", _TF_SNIPPET], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.DEVNULL, text=True,
                                     env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2"))
        line = self._line()
        if not line.startswith("READY "):
            self.close()
            raise RuntimeError(f"{python} did not start TensorFlow ({line!r}); check that `{python} -c 'import "
                               "tensorflow'` works")
        self.version = " ".join(line.split()[1:])

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
            raise RuntimeError(f"the TensorFlow subprocess died during {request!r} (exit status {self.proc.poll()})")
        return json.loads(line[len("RESULT "):])

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def mirrored_fit(batches: _bench.Batches, memory_format: str) -> tuple[float, float]:
    """Images/s and images per CPU-second of fit on 2 CPU replicas (as _bench.fit_loop times it)."""
    model = _bench.fit_model(2, memory_format=memory_format)
    model.fit(batches[:_bench.WARMUP_STEPS], epochs=1, verbose=0)  # starts the replica threads, sizes buffers
    images = sum(len(x) for x, _ in batches)
    start, cpu = time.perf_counter(), time.process_time()
    model.fit(batches, epochs=1, verbose=0)
    return images / (time.perf_counter() - start), images / (time.process_time() - cpu)


def two_processes(batch: int, images: int, channels_last: bool) -> tuple[float, float]:
    """Images/s (over the slower one's time) and images per CPU-second of 2 independent processes."""
    results = _bench.run_workers("independent", 2, batch // 2, images, channels_last)
    done = sum(r["images"] for r in results)
    return done / max(r["seconds"] for r in results), done / sum(r["cpu_seconds"] for r in results)


def run_overhead_us(calls: int) -> float:
    """Microseconds per strategy.run of a no-op on 2 CPU replicas (after 10 warm-up calls)."""
    strategy = mr.MirroredStrategy(devices=["cpu:0", "cpu:1"])
    for _ in range(10):
        strategy.run(lambda: None)
    start = time.perf_counter()
    for _ in range(calls):
        strategy.run(lambda: None)
    return (time.perf_counter() - start) / calls * 1e6


def start_tensorflow(python: str | None) -> TensorFlow | None:
    """TensorFlow's subprocess, or None with a sentence saying why there is none."""
    if not python:
        print("TensorFlow: not run (no --tf-python). TensorFlow is never a dependency of mirrored; to compare, "
              "make its own venv: python3.11 -m venv /tmp/tfbench && /tmp/tfbench/bin/pip install "
              "\"tensorflow-cpu==2.21.*\", then pass --tf-python /tmp/tfbench/bin/python.")
        return None
    try:
        return TensorFlow(python)
    except (OSError, RuntimeError) as e:
        print(f"TensorFlow: not run ({e}). Our rows only; benchmarks/RESULTS.md keeps TF's earlier figures.")
        return None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tf-python", default=os.environ.get("MIRRORED_TF_PYTHON"),
                        help="python of a venv with tensorflow-cpu 2.21 (default: $MIRRORED_TF_PYTHON)")
    parser.add_argument("--batches", type=int, nargs="+", default=[64, 256], help="global batch sizes")
    parser.add_argument("--images", type=int, default=1024, help="images per timed fit")
    parser.add_argument("--calls", type=int, default=500, help="strategy.run calls per timed run")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    if args.rounds < 1 or args.calls < 1 or min(args.batches) < 2 or args.images < max(args.batches):
        parser.error("need --rounds >= 1, --calls >= 1, every batch >= 2 and --images >= the largest batch")
    print(_bench.machine())
    tf = start_tensorflow(args.tf_python)
    try:
        if tf is not None:
            print(f"TensorFlow {tf.version} from {args.tf_python}")
        rows: dict[str, Callable[[], Any]] = {}
        cl = _bench.fit_memory_format() != "as given"  # the independent processes run the format fit runs
        for batch in args.batches:
            data = _bench.make_data(args.images, batch)
            rows[f"fit, global batch {batch}|mirrored"] = lambda data=data: mirrored_fit(data, "auto")
            rows[f"fit, global batch {batch}|mirrored, NCHW"] = lambda data=data: mirrored_fit(data, "preserve")
            rows[f"fit, global batch {batch}|2 processes"] = lambda batch=batch: two_processes(batch, args.images, cl)
            if tf is not None:
                rows[f"fit, global batch {batch}|TF, one device"] = lambda batch=batch: tf.ask(
                    f"fit {batch} {args.images} one")
                rows[f"fit, global batch {batch}|TF, Mirrored"] = lambda batch=batch: tf.ask(
                    f"fit {batch} {args.images} mirrored")
        rows["strategy.run no-op, us per call|mirrored"] = lambda: run_overhead_us(args.calls)
        if tf is not None:
            rows["strategy.run no-op, us per call|TF, tf.function"] = lambda: tf.ask(f"run graph {args.calls}")
            rows["strategy.run no-op, us per call|TF, eager"] = lambda: tf.ask(f"run eager {args.calls}")
        before = _bench.load()
        samples: dict[str, list[Any]] = {key: [] for key in rows}
        for r in range(args.rounds):
            for key, measure in rows.items():
                samples[key].append(measure())
            # (each round's values as they come, on stderr: a run cut short still leaves its rounds)
            print(f"round {r + 1}: {json.dumps({k: v[-1] for k, v in samples.items()})}", file=sys.stderr, flush=True)
    finally:
        if tf is not None:
            tf.close()
    print(f"mirrored's fit ran its convolutions in {_bench.fit_memory_format()} memory (compile(memory_format="
          "\"auto\")); \"mirrored, NCHW\" in NCHW (\"preserve\")")
    print(f"2 CPU replicas; {args.images} images per fit, {args.calls} calls per run row, {args.rounds} rounds; "
          f"load average before {before}, after {_bench.load()}")
    print_table(samples)
    print_targets(samples)


def print_table(samples: dict[str, list[Any]]) -> None:
    """One line per row: median (range), and mirrored's ratio to it (faster is above 1)."""
    print(f"{'':<34}{'':<16}{'images/s or us':>20}{'vs it':>7}{'images per CPU-s':>20}{'vs it':>7}")
    for key, values in samples.items():
        what, who = key.split("|")
        ours = samples[f"{what}|mirrored"]
        if what.startswith("strategy.run"):
            med = statistics.median(values)
            print(f"{what:<34}{who:<16}{_cell(values):>20}{med / statistics.median(ours):>6.2f}x")
            continue
        wall, cpu = [v[0] for v in values], [v[1] for v in values]
        ratio_wall = statistics.median(v[0] for v in ours) / statistics.median(wall)
        ratio_cpu = statistics.median(v[1] for v in ours) / statistics.median(cpu)
        print(f"{what:<34}{who:<16}{_cell(wall):>20}{ratio_wall:>6.2f}x{_cell(cpu):>20}{ratio_cpu:>6.2f}x")


def _cell(values: list[float]) -> str:
    return f"{statistics.median(values):.1f} ({min(values):.0f}-{max(values):.0f})"


TARGETS = {"TF, one device": 1.3, "TF, Mirrored": 2.0, "2 processes": 0.95}  # issue 29: mirrored / row


def print_targets(samples: dict[str, list[Any]]) -> None:
    """Issue 29's targets per batch: mirrored / row in images/s (ratio of medians, range of the
    per-round ratios), and the same in images per CPU-second."""
    for key, values in samples.items():
        what, who = key.split("|")
        if who not in TARGETS:
            continue
        ours = samples[f"{what}|mirrored"]
        ratios, parts = [], []
        for i, unit in ((0, "images/s"), (1, "images per CPU-s")):
            per_round = [a[i] / b[i] for a, b in zip(ours, values)]
            ratios.append(statistics.median(a[i] for a in ours) / statistics.median(b[i] for b in values))
            parts.append(f"{ratios[-1]:.2f}x in {unit} ({min(per_round):.2f}-{max(per_round):.2f} per round)")
        verdict = "met" if ratios[0] >= TARGETS[who] else "MISSED"
        print(f"target, {what}: mirrored / {who} >= {TARGETS[who]}x: {verdict} in images/s; " + ", ".join(parts))


if __name__ == "__main__":
    main()
