"""Which memory layout Keras 3's Conv2D runs in on the torch backend, and what its copies cost (issue 29).

    KERAS_BACKEND=torch .venv/bin/python benchmarks/keras_conv_layout.py

A Keras model under mr.Model is not converted by compile(memory_format=...): Keras's Conv2D is not an
nn.Conv2d, and it lays out its own tensors. Keras (3.15, data_format="channels_last") permutes each
NHWC input to an NCHW view (already channels_last-strided), copies it to plain NCHW (.contiguous()),
then copies it back to channels_last and the HWIO kernel to a channels_last OIHW, so the oneDNN
kernel itself runs channels_last and the cost is the copies. Rows, forward + backward, one intra-op
thread, alternating, medians and ranges of CPU ms per step (the process's CPU time: on one thread
that is the step's work, which a shared machine's load disturbs far less than wall time):

  keras          the Keras layer or model as it is
  kernel OHWI    the kernel variable stored O,H,W,I in memory, so that Keras's permute of it is already
                 channels_last and its copy goes (what storing the kernel differently could give)
  one copy       Keras's NCHW .contiguous() on the input left out (what keras-team/keras PR 23199 does
                 upstream), the rest as Keras does it
  torch CL       F.conv2d on the permuted view with a channels_last weight: no copy at all
  torch NCHW     the same in plain NCHW memory (the layout a channels_first torch module would run)
  torch ResNet-20  mr.models.resnet_cifar (NHWC batches read as channels_last views, torch layers): the
                 same network's step without Keras, for scale (its own initial weights)

Benchmark code only: the variants patch Keras inside this process, nothing in mirrored does.
"""
from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import time
from collections.abc import Callable, Iterator

os.environ.setdefault("KERAS_BACKEND", "torch")

import keras  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from keras.src.backend.torch import nn as keras_torch_nn  # noqa: E402

import mirrored as mr  # noqa: E402


@contextlib.contextmanager
def kernels_ohwi(model: keras.Model) -> Iterator[None]:
    """Every Conv2D kernel (H, W, I, O) stored O, H, W, I in memory, values unchanged."""
    saved = []
    for layer in model.layers if hasattr(model, "layers") else [model]:
        if isinstance(layer, keras.layers.Conv2D):
            p = layer.kernel.value
            saved.append((p, p.data))
            p.data = p.data.permute(3, 0, 1, 2).contiguous().permute(1, 2, 3, 0)
    try:
        yield
    finally:
        for p, data in saved:
            p.data = data


@contextlib.contextmanager
def one_input_copy() -> Iterator[None]:
    """Keras's NHWC -> NCHW transpose as a channels_last copy (a no-op for a contiguous NHWC input)."""
    original = keras_torch_nn._transpose_spatial_inputs

    def transpose(inputs):
        if inputs.ndim != 4:
            return original(inputs)
        return inputs.permute(0, 3, 1, 2).contiguous(memory_format=torch.channels_last)

    keras_torch_nn._transpose_spatial_inputs = transpose
    try:
        yield
    finally:
        keras_torch_nn._transpose_spatial_inputs = original


def conv_rows(batch: int, size: int, channels: int) -> dict[str, Callable[[torch.Tensor], torch.Tensor]]:
    layer = keras.layers.Conv2D(channels, 3, padding="same", use_bias=False)
    layer.build((None, size, size, channels))
    oihw = layer.kernel.value.detach().permute(3, 2, 0, 1)
    w_cl = torch.nn.Parameter(oihw.contiguous(memory_format=torch.channels_last))
    w_nchw = torch.nn.Parameter(oihw.contiguous())

    def with_(ctx: Callable[[], contextlib.AbstractContextManager]) -> Callable[[torch.Tensor], torch.Tensor]:
        def run(x: torch.Tensor) -> torch.Tensor:
            with ctx():
                return layer(x)
        return run

    return {
        "keras": layer,
        "kernel OHWI": with_(lambda: kernels_ohwi(layer)),
        "one copy": with_(one_input_copy),
        "torch CL": lambda x: F.conv2d(x.permute(0, 3, 1, 2), w_cl, padding=1).permute(0, 2, 3, 1),
        "torch NCHW": lambda x: F.conv2d(x.permute(0, 3, 1, 2).contiguous(), w_nchw, padding=1).permute(0, 2, 3, 1),
    }


def resnet20() -> keras.Model:
    """ResNet-20 for 32x32 inputs in Keras (NHWC), as benchmarks/vs_tensorflow.py builds it for TF."""
    def block(x, channels, stride):
        y = keras.layers.Conv2D(channels, 3, stride, padding="same", use_bias=False)(x)
        y = keras.layers.ReLU()(keras.layers.BatchNormalization()(y))
        y = keras.layers.BatchNormalization()(keras.layers.Conv2D(channels, 3, padding="same", use_bias=False)(y))
        if stride != 1 or x.shape[-1] != channels:  # the CIFAR paper's option A: subsample, zero-pad channels
            pad = channels - x.shape[-1]
            x = keras.layers.Lambda(lambda t: keras.ops.pad(t[:, ::stride, ::stride, :], [[0, 0], [0, 0], [0, 0],
                                                                                       [pad // 2, pad - pad // 2]]))(x)
        return keras.layers.ReLU()(keras.layers.Add()([x, y]))

    inputs = keras.Input((32, 32, 3))
    x = keras.layers.ReLU()(keras.layers.BatchNormalization()(
        keras.layers.Conv2D(16, 3, padding="same", use_bias=False)(inputs)))
    for channels, stride in ((16, 1), (32, 2), (64, 2)):
        for i in range(3):
            x = block(x, channels, stride if i == 0 else 1)
    return keras.Model(inputs, keras.layers.Dense(10)(keras.layers.GlobalAveragePooling2D()(x)))


UNCHECKED = {"torch ResNet-20"}  # other weights: a reference for the time, not the values


def time_rows(rows: dict[str, Callable[[torch.Tensor], torch.Tensor]], x: torch.Tensor, steps: int,
              rounds: int) -> dict[str, list[float]]:
    def step(fn):
        xi = x.clone().requires_grad_()
        fn(xi).float().sum().backward()

    ref = rows["keras"](x).detach()
    for name, fn in rows.items():
        if name in UNCHECKED:
            continue
        diff = (fn(x).detach() - ref).abs().max().item()
        if diff > 1e-4 * max(1.0, ref.abs().max().item()):
            raise RuntimeError(f"row {name!r} computes something else: max difference {diff:.3g} to Keras's")
    samples: dict[str, list[float]] = {name: [] for name in rows}
    for _ in range(rounds):
        for name, fn in rows.items():
            step(fn)
            start = time.process_time()
            for _ in range(steps):
                step(fn)
            samples[name].append((time.process_time() - start) / steps * 1e3)
    return samples


def print_rows(title: str, samples: dict[str, list[float]]) -> None:
    base = statistics.median(samples["keras"])
    print(f"\n{title}\n  {'':<17}{'CPU ms per step (range)':>24}{'keras / row':>13}")
    for name, v in samples.items():
        med = statistics.median(v)
        print(f"  {name:<17}{f'{med:.2f} ({min(v):.2f}-{max(v):.2f})':>24}{base / med:>13.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=32, help="images per step (a replica's share of 64)")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    print(f"keras {keras.__version__} ({keras.backend.backend()}), torch {torch.__version__}, 1 intra-op thread")
    for size, channels in ((32, 16), (16, 32), (8, 64)):
        x = torch.rand(args.batch, size, size, channels)
        print_rows(f"Conv2D 3x3, {channels} -> {channels} channels, {size}x{size}, batch {args.batch}",
                   time_rows(conv_rows(args.batch, size, channels), x, args.steps, args.rounds))
    model = resnet20()

    def with_(ctx):
        def run(x):
            with ctx():
                return model(x, training=True)
        return run

    rows = {"keras": lambda x: model(x, training=True), "kernel OHWI": with_(lambda: kernels_ohwi(model)),
            "one copy": with_(one_input_copy)}
    torch_net = mr.models.resnet_cifar(depth=20, num_classes=10, data_format="channels_last").train()
    rows["torch ResNet-20"] = torch_net
    x = torch.rand(args.batch, 32, 32, 3)
    print_rows(f"Keras ResNet-20, training step's forward + backward, batch {args.batch}",
               time_rows(rows, x, max(1, args.steps // 2), args.rounds))


if __name__ == "__main__":
    main()
