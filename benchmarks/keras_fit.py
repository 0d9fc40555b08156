"""A Keras 3 model (torch backend) under mr.Model against Keras's own fit and a torch twin (issue 23).

    .venv/bin/python benchmarks/keras_fit.py                          # batch 64, 10 steps, 3 rounds
    .venv/bin/python benchmarks/keras_fit.py --batch 8 --steps 2 --rounds 1 --width 4   # a smoke run

The twin is the same network written in torch, trained by our fit. Four contestants train the same small ResNet-style network (conv-BN-ReLU blocks with a residual add,
global pooling, a softmax head; 32x32x3 inputs) on the same synthetic data, each for `--steps` steps
of `--batch` global examples per round: Keras's own `model.fit` on one device (torch backend),
`mr.Model(keras_model)` on 1 replica, the same on 2 CPU replicas, and `mr.Model(torch module)` of
the equivalent torch network on 2 CPU replicas. Rounds alternate the contestants, after a warm-up
fit of each, so a loaded machine slows all of them alike; the median of the rounds is printed, with
the two ratios the issue asks for: ours on 1 replica / Keras's fit (target >= 0.95) and the Keras
model on 2 replicas / the torch module on 2 replicas (target: 1 within noise).
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

os.environ.setdefault("KERAS_BACKEND", "torch")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402
from torch import nn  # noqa: E402

import mirrored as mr  # noqa: E402

CLASSES = 10


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
    args = parser.parse_args()
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

    contestants = {
        "Keras's own fit, 1 device": lambda: own.fit(x_hwc, y, batch_size=args.batch, shuffle=False, verbose=0),
    }
    one = ours(keras_net(args.width, size), 1, sgd(), "sparse_categorical_crossentropy")
    two = ours(keras_net(args.width, size), 2, sgd(), "sparse_categorical_crossentropy")
    torch_two = ours(TorchNet(args.width), 2, mr.optimizers.SGD(learning_rate=0.01, momentum=0.9),
                     "sparse_categorical_crossentropy")
    contestants["mr.Model(keras), 1 replica"] = lambda: one.fit(x_hwc, y, batch_size=args.batch, shuffle=False,
                                                                verbose=0)
    contestants["mr.Model(keras), 2 replicas"] = lambda: two.fit(x_hwc, y, batch_size=args.batch, shuffle=False,
                                                                 verbose=0)
    contestants["mr.Model(torch), 2 replicas"] = lambda: torch_two.fit(x_chw, y, batch_size=args.batch,
                                                                       shuffle=False, verbose=0)
    for fit in contestants.values():  # warm-up: first calls build functions and touch memory
        fit()
    times: dict[str, list[float]] = {name: [] for name in contestants}
    load = os.getloadavg()
    for _ in range(args.rounds):
        for name, fit in contestants.items():
            start = time.perf_counter()
            fit()
            times[name].append(time.perf_counter() - start)
    rate = {name: n / statistics.median(ts) for name, ts in times.items()}
    print(f"{n} examples per round ({args.steps} steps of {args.batch}), {args.rounds} rounds, width {args.width}, "
          f"{size}x{size}; torch {torch.__version__}, keras {keras.__version__}; load average before "
          f"{load[0]:.1f}, after {os.getloadavg()[0]:.1f}")
    print(f"  {'contestant':<32}{'examples/s':>12}  (rounds)")
    for name, ts in times.items():
        print(f"  {name:<32}{rate[name]:>12.1f}  ({', '.join(f'{n / t:.0f}' for t in ts)})")
    names = list(contestants)
    print(f"ratio mr.Model(keras) 1 replica / Keras's own fit: {rate[names[1]] / rate[names[0]]:.3f} (target >= 0.95)")
    print(f"ratio mr.Model(keras) / mr.Model(torch), 2 replicas: {rate[names[2]] / rate[names[3]]:.3f} (target ~1)")


if __name__ == "__main__":
    main()
