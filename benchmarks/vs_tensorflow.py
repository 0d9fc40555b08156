"""`mirrored` against TensorFlow 2.21's MirroredStrategy on the same machine: Keras fit and a no-op run.

    .venv/bin/python benchmarks/vs_tensorflow.py --tf-python /tmp/tfbench/bin/python
    .venv/bin/python benchmarks/vs_tensorflow.py            # without TensorFlow: our rows only

TensorFlow is never a dependency of the package: it runs from its own venv (`python3.11 -m venv
/tmp/tfbench && /tmp/tfbench/bin/pip install "tensorflow-cpu==2.21.*"`), as a subprocess started
once and driven over a pipe, so its runs alternate with ours in the same minutes (as in
input_pipeline.py). Without --tf-python, or where that interpreter cannot import TensorFlow, the
script says so and prints our rows alone (exit status 0).

Rows, each round in turn, medians and ranges:
  fit   images/s of Keras-style fit on 2 CPU replicas: ours (mr.Model, ResNet-20 on NCHW batches, 2
        replica threads x 1 intra-op thread; its convolutions in channels_last memory, fit's default
        since issue 29, and "mirrored, NCHW" with compile(memory_format="preserve")) against Keras 3
        on TF with tf.distribute.MirroredStrategy over 2 logical CPU devices (the same ResNet-20 built in Keras, NHWC, TF's default threads), same
        synthetic 32x32 batches in memory, SGD(momentum=0.9), at each global batch
  run   microseconds per strategy.run of a no-op on 2 replicas: ours, and TF's inside a tf.function
        (graph) and eagerly
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import time
from collections.abc import Callable

import mirrored as mr
from mirrored import _bench

# Run by --tf-python: one line per request on stdin ("fit BATCH IMAGES", "run graph CALLS", "run eager
# CALLS"), one "RESULT <json>" line per answer; "READY <tf version> <keras version>" once at start.
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

def fit(batch, images):
    with strategy.scope():
        model = resnet20()
        model.compile(optimizer=keras.optimizers.SGD(0.01, momentum=0.9),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    model.fit(data(2 * batch, batch), epochs=1, verbose=0)  # traces the step
    ds = data(images, batch)
    start = time.perf_counter()
    model.fit(ds, epochs=1, verbose=0)
    return images / (time.perf_counter() - start)

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
        result = fit(int(words[1]), int(words[2]))
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

    def ask(self, request: str) -> float:
        self.proc.stdin.write(request + "\n")
        self.proc.stdin.flush()
        line = self._line()
        if not line.startswith("RESULT "):
            raise RuntimeError(f"the TensorFlow subprocess died during {request!r} (exit status {self.proc.poll()})")
        return float(json.loads(line[len("RESULT "):]))

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


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
        rows: dict[str, Callable[[], float]] = {}
        for batch in args.batches:
            data = _bench.make_data(args.images, batch)
            rows[f"fit, global batch {batch}|mirrored"] = lambda data=data: _bench.fit_loop(data, 2)
            rows[f"fit, global batch {batch}|mirrored, NCHW"] = lambda data=data: _bench.fit_loop(
                data, 2, memory_format="preserve")
            if tf is not None:
                rows[f"fit, global batch {batch}|TF 2.21 Keras"] = lambda batch=batch: tf.ask(
                    f"fit {batch} {args.images}")
        rows["strategy.run no-op, us per call|mirrored"] = lambda: run_overhead_us(args.calls)
        if tf is not None:
            rows["strategy.run no-op, us per call|TF, tf.function"] = lambda: tf.ask(f"run graph {args.calls}")
            rows["strategy.run no-op, us per call|TF, eager"] = lambda: tf.ask(f"run eager {args.calls}")
        before = _bench.load()
        samples: dict[str, list[float]] = {key: [] for key in rows}
        for _ in range(args.rounds):
            for key, measure in rows.items():
                samples[key].append(measure())
    finally:
        if tf is not None:
            tf.close()
    print(f"mirrored's fit ran its convolutions in {_bench.fit_memory_format()} memory (compile(memory_format="
          "\"auto\")); \"mirrored, NCHW\" in NCHW (\"preserve\")")
    print(f"2 CPU replicas; {args.images} images per fit, {args.calls} calls per run row, {args.rounds} rounds; "
          f"load average before {before}, after {_bench.load()}")
    print_table(samples)


def print_table(samples: dict[str, list[float]]) -> None:
    """One line per row: median (range), and ours / theirs (images/s) or theirs / ours (run time)."""
    ours = {key.split("|")[0]: statistics.median(v) for key, v in samples.items() if key.endswith("|mirrored")}
    print(f"{'':<40}{'':<18}{'median (range)':>22}{'mirrored vs it':>16}")
    for key, values in samples.items():
        what, who = key.split("|")
        med = statistics.median(values)
        faster = med / ours[what] if what.startswith("strategy.run") else ours[what] / med
        cell = f"{med:.1f} ({min(values):.0f}-{max(values):.0f})"
        print(f"{what:<40}{who:<18}{cell:>22}{faster:>15.2f}x")


if __name__ == "__main__":
    main()
