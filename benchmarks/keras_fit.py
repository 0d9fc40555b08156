"""A Keras 3 model (torch backend) under mr.Model and under Keras's own fit in a 2-replica scope, against Keras's own fit on one device and a torch twin (issues 23, 34).

    .venv/bin/python benchmarks/keras_fit.py                          # batch 64, 10 steps, 3 rounds
    .venv/bin/python benchmarks/keras_fit.py --batch 8 --steps 2 --rounds 1 --width 4   # a smoke run

Eight contestants train the same small ResNet-style network (conv-BN-ReLU blocks with a residual add,
global pooling, a softmax head; 32x32x3 inputs) on the same synthetic data, each for `--steps` steps
of `--batch` global examples per round: Keras's own `model.fit` on one device (torch backend);
"Keras's own step cost", a plain loop of what Keras's torch trainer does per step (forward with
training=True, the Keras loss, backward, the Keras optimizer's apply) without fit's machinery; the
same loop inside a replica's random-number mode (the TorchFunctionMode every replica step runs
under, distribute/random.py), which shows what that mode costs a Keras step alone;
`mr.Model(keras_model)` on 1 replica; the plain step on two threads that never meet, and on two
threads that wait for each other after every backward (where the all-reduce would be, nothing
exchanged); `mr.Model(keras_model)` on 2 CPU replicas; Keras's own fit of the model built and
compiled in a 2-replica scope (the tf.keras program); and `mr.Model(torch module)` of the
equivalent torch network (the twin) on 2 CPU replicas. Rounds alternate the contestants, after a
warm-up of each, so a loaded machine slows all of them alike; the median of the rounds is printed,
with the ratios: ours on 1 replica / Keras's fit (target >= 0.95), ours on 1 replica / the plain
step loop (what is ours: fit's machinery and the random mode), the loop in the mode / the loop,
ours on 2 replicas / the two-thread loop (what is ours on 2 replicas) and / the meeting two-thread
loop (what is ours beyond meeting at all), the meeting loop / the other one, the two-thread loop / the
one-thread loop (how a Keras step scales on threads), the Keras model on 2 replicas / the torch
twin on 2 replicas (target: 1 within noise), and Keras's own fit on 2 replicas / mr.Model's on 2
replicas (target >= 0.95; `--pair` runs only those two, for many rounds). Each row also gives the
process's CPU time per example (all its threads), which other processes on a loaded machine disturb
less than wall time, and the same ratios of CPU cost. `--threads 1` gives the one-device contestants one intra-op thread,
as each replica has on a 2-core machine.
"""
from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import threading
import time

os.environ.setdefault("KERAS_BACKEND", "torch")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402
from torch import nn  # noqa: E402

import mirrored as mr  # noqa: E402
from mirrored.distribute.random import ReplicaRandom  # noqa: E402 - the mode a replica step runs in

CLASSES = 10
KERAS_FIT, PLAIN, PLAIN_MODE = "Keras's own fit, 1 device", "Keras's own step cost", "  the same in the random mode"
PLAIN_TWO = "Keras's step, 2 threads, no exchange"
PLAIN_MEET = "  the same, meeting every step"
ONE, TWO, TORCH_TWO = "mr.Model(keras), 1 replica", "mr.Model(keras), 2 replicas", "mr.Model(torch), 2 replicas"
KERAS_FIT_TWO = "Keras's own fit, 2 replicas"


def keras_net(width: int, size: int) -> keras.Model:
    inp = keras.Input((size, size, 3))
    h = inp
    for i, w in enumerate((width, 2 * width)):
        h = keras.layers.Conv2D(w, 3, strides=2 if i else 1, padding="same", use_bias=False)(h)
        h = keras.layers.BatchNormalization()(h)
        h = keras.layers.Activation("relu")(h)
        skip = h
        h = keras.layers.Conv2D(w, 3, padding="same", use_bias=False)(h)
        h = keras.layers.BatchNormalization()(h)
        h = keras.layers.Activation("relu")(keras.layers.Add()([h, skip]))
    h = keras.layers.GlobalAveragePooling2D()(h)
    return keras.Model(inp, keras.layers.Dense(CLASSES, activation="softmax")(h))


class TorchNet(nn.Module):
    """keras_net in torch (NCHW inputs, logits out): the same layers and parameter counts."""

    def __init__(self, width: int):
        super().__init__()
        self.blocks = nn.ModuleList()
        cin = 3
        for i, w in enumerate((width, 2 * width)):
            self.blocks.append(nn.ModuleList([
                nn.Sequential(nn.Conv2d(cin, w, 3, 2 if i else 1, 1, bias=False), nn.BatchNorm2d(w), nn.ReLU()),
                nn.Sequential(nn.Conv2d(w, w, 3, 1, 1, bias=False), nn.BatchNorm2d(w))]))
            cin = w
        self.head = nn.Linear(cin, CLASSES)

    def forward(self, x):
        for first, second in self.blocks:
            x = first(x)
            x = torch.relu(second(x) + x)
        return self.head(x.mean(dim=(2, 3)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=64, help="global batch")
    parser.add_argument("--steps", type=int, default=10, help="steps per round and contestant")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--width", type=int, default=16, help="channels of the first block")
    parser.add_argument("--image-size", type=int, default=32)
    parser.add_argument("--pair", action="store_true",
                        help="only the two 2-replica fits of a Keras model (Keras's own in the scope, mr.Model's), "
                             "alternating: their ratio with many rounds, and the median of each round's ratio")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch's intra-op threads for the one-device contestants (Keras's fit, the step loops, "
                             "1 replica, which runs on the caller's thread); default torch's. Each of 2 replicas "
                             "runs 1 thread on a 2-core machine")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    rng = np.random.default_rng(0)
    n, size = args.batch * args.steps, args.image_size
    x_hwc = rng.random((n, size, size, 3), dtype=np.float32)
    x_chw = np.ascontiguousarray(x_hwc.transpose(0, 3, 1, 2))
    y = rng.integers(0, CLASSES, size=n)

    def sgd():
        return keras.optimizers.SGD(learning_rate=0.01, momentum=0.9)

    keras.utils.set_random_seed(0)
    own = keras_net(args.width, size)
    own.compile(optimizer=sgd(), loss="sparse_categorical_crossentropy")

    def ours(net, replicas, optimizer, loss):
        with mr.MirroredStrategy(devices=[f"cpu:{i}" for i in range(replicas)]).scope():
            model = mr.Model(net)
            model.compile(optimizer=optimizer, loss=loss)
        return model

    def plain_loop(in_mode: bool):
        """Keras's torch train_step without fit: forward, loss, backward, the optimizer's apply."""
        net = keras_net(args.width, size)
        opt = sgd()
        weights = net.trainable_weights
        opt.build(weights)
        loss_fn = keras.losses.SparseCategoricalCrossentropy()
        batches = [(torch.from_numpy(x_hwc[i:i + args.batch]), torch.from_numpy(y[i:i + args.batch]))
                   for i in range(0, n, args.batch)]

        def run():
            for step, (xb, yb) in enumerate(batches):
                mode = ReplicaRandom(0, step, 0) if in_mode else contextlib.nullcontext()
                with mode:
                    loss = loss_fn(yb, net(xb, training=True))
                    net.zero_grad()
                    loss.backward()
                    with torch.no_grad():
                        opt.apply([v.value.grad for v in weights], weights)
        return run

    def plain_threads(meet: bool):
        """Two threads, each running plain_loop's step on its half of every batch with its own model and
        1 intra-op thread, with no exchange at all: what 2 replicas cost without mirrored (the GIL's
        share of a Keras step shows here). With `meet`, the threads wait for each other after backward
        every step (a barrier where the gradient all-reduce would be, nothing exchanged): what a
        synchronous step costs by itself when the GIL makes the threads' progress uneven."""
        halves = []
        for half in range(2):
            net, opt = keras_net(args.width, size), sgd()
            opt.build(net.trainable_weights)
            rows = [(torch.from_numpy(x_hwc[i:i + args.batch][half::2]), torch.from_numpy(y[i:i + args.batch][half::2]))
                    for i in range(0, n, args.batch)]
            halves.append((net, opt, rows))
        loss_fn = keras.losses.SparseCategoricalCrossentropy()
        barrier = threading.Barrier(2, timeout=300)

        def work(net, opt, rows):
            torch.set_num_threads(1)
            weights = net.trainable_weights
            for xb, yb in rows:
                loss = loss_fn(yb, net(xb, training=True))
                net.zero_grad()
                loss.backward()
                if meet:
                    barrier.wait()
                with torch.no_grad():
                    opt.apply([v.value.grad for v in weights], weights)

        def run():
            threads = [threading.Thread(target=work, args=half) for half in halves]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
        return run

    one = ours(keras_net(args.width, size), 1, sgd(), "sparse_categorical_crossentropy")
    two = ours(keras_net(args.width, size), 2, sgd(), "sparse_categorical_crossentropy")
    torch_two = ours(TorchNet(args.width), 2, mr.optimizers.SGD(learning_rate=0.01, momentum=0.9),
                     "sparse_categorical_crossentropy")
    with mr.MirroredStrategy(devices=["cpu:0", "cpu:1"]).scope():  # a tf.keras program: Keras's own fit
        own_two = keras_net(args.width, size)
        own_two.compile(optimizer=sgd(), loss="sparse_categorical_crossentropy")
    contestants = {
        KERAS_FIT: lambda: own.fit(x_hwc, y, batch_size=args.batch, shuffle=False, verbose=0),
        PLAIN: plain_loop(False),
        PLAIN_MODE: plain_loop(True),
        ONE: lambda: one.fit(x_hwc, y, batch_size=args.batch, shuffle=False, verbose=0),
        PLAIN_TWO: plain_threads(False),
        PLAIN_MEET: plain_threads(True),
        TWO: lambda: two.fit(x_hwc, y, batch_size=args.batch, shuffle=False, verbose=0),
        KERAS_FIT_TWO: lambda: own_two.fit(x_hwc, y, batch_size=args.batch, shuffle=False, verbose=0),
        TORCH_TWO: lambda: torch_two.fit(x_chw, y, batch_size=args.batch, shuffle=False, verbose=0),
    }
    if args.pair:
        contestants = {name: contestants[name] for name in (TWO, KERAS_FIT_TWO)}
    for fit in contestants.values():  # warm-up: first calls build functions and touch memory
        fit()
    times: dict[str, list[float]] = {name: [] for name in contestants}
    cpu: dict[str, list[float]] = {name: [] for name in contestants}  # the process's CPU seconds, all threads
    load = os.getloadavg()
    for _ in range(args.rounds):
        for name, fit in contestants.items():
            start, start_cpu = time.perf_counter(), time.process_time()
            fit()
            times[name].append(time.perf_counter() - start)
            cpu[name].append(time.process_time() - start_cpu)
    rate = {name: n / statistics.median(ts) for name, ts in times.items()}
    print(f"{n} examples per round ({args.steps} steps of {args.batch}), {args.rounds} rounds, width {args.width}, "
          f"{size}x{size}, {torch.get_num_threads()} thread(s) on one device; torch {torch.__version__}, keras "
          f"{keras.__version__}; load average before "
          f"{load[0]:.1f}, after {os.getloadavg()[0]:.1f}")
    # CPU time per example: what a contestant costs, less hurt than wall time by other processes taking
    # the cores (a 1-thread contestant's wall time is its CPU time plus the time it waited for a core).
    cost = {name: 1e3 * statistics.median(c) / n for name, c in cpu.items()}
    print(f"  {'contestant':<36}{'examples/s':>12}{'CPU ms/example':>16}  (rounds, examples/s)")
    for name, ts in times.items():
        print(f"  {name:<36}{rate[name]:>12.1f}{cost[name]:>16.2f}  ({', '.join(f'{n / t:.0f}' for t in ts)})")
    if args.pair:
        rounds = [t / k for t, k in zip(times[TWO], times[KERAS_FIT_TWO])]
        print(f"ratio Keras's own fit distributed / mr.Model path, 2 replicas: {rate[KERAS_FIT_TWO] / rate[TWO]:.3f}; "
              f"median of the rounds' ratios {statistics.median(rounds):.3f}; CPU per example "
              f"{cost[TWO] / cost[KERAS_FIT_TWO]:.3f} (target >= 0.95)")
        return
    print(f"CPU cost mr.Model(keras) 1 replica / Keras's own fit: {cost[ONE] / cost[KERAS_FIT]:.3f}; / Keras's own "
          f"step cost: {cost[ONE] / cost[PLAIN]:.3f}; the random mode / the step: {cost[PLAIN_MODE] / cost[PLAIN]:.3f}; "
          f"2 replicas / the 2-thread step: {cost[TWO] / cost[PLAIN_TWO]:.3f} (above 1: ours)")
    print(f"ratio mr.Model(keras) 1 replica / Keras's own fit: {rate[ONE] / rate[KERAS_FIT]:.3f} (target >= 0.95)")
    print(f"ratio mr.Model(keras) 1 replica / Keras's own step cost: {rate[ONE] / rate[PLAIN]:.3f} (below 1: ours)")
    print(f"ratio Keras's step in the replica random mode / Keras's own step cost: "
          f"{rate[PLAIN_MODE] / rate[PLAIN]:.3f}")
    print(f"ratio Keras's own fit / Keras's own step cost: {rate[KERAS_FIT] / rate[PLAIN]:.3f} (Keras's fit machinery)")
    print(f"ratio mr.Model(keras) 2 replicas / Keras's step on 2 threads: {rate[TWO] / rate[PLAIN_TWO]:.3f} "
          "(below 1: ours)")
    print(f"ratio mr.Model(keras) 2 replicas / Keras's step on 2 threads meeting every step: "
          f"{rate[TWO] / rate[PLAIN_MEET]:.3f} (below 1: ours)")
    print(f"ratio Keras's step on 2 threads meeting every step / never meeting: {rate[PLAIN_MEET] / rate[PLAIN_TWO]:.3f} "
          "(what a synchronous step costs by itself)")
    print(f"ratio Keras's step on 2 threads / on 1: {rate[PLAIN_TWO] / rate[PLAIN]:.3f} (2 would be perfect scaling)")
    print(f"ratio mr.Model(keras) / mr.Model(torch), 2 replicas: {rate[TWO] / rate[TORCH_TWO]:.3f} (target ~1)")
    print(f"ratio Keras's own fit distributed / mr.Model path, 2 replicas: {rate[KERAS_FIT_TWO] / rate[TWO]:.3f} "
          "(target >= 0.95)")

if __name__ == "__main__":
    main()
