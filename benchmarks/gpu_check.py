"""One command that checks mirrored on a CUDA machine and prints a table of what passed.

    PYTHONPATH=$PWD/src python3 benchmarks/gpu_check.py                # a GPU machine: ~5 min on one H200
    PYTHONPATH=$PWD/src python3 benchmarks/gpu_check.py --cpu-smoke    # tiny sizes on the CPU (CI runs it)

Made for a GPU machine's own Python (there: 3.12, torch 2.11) with this repository's src/ on the path,
not an installed package. Modules it lacks are listed first; `mr.Model` needs crc32c (its TensorBoard
callback) and the image pipeline simplejpeg, so carry them as wheels where they are missing (the
"GPU check" section of benchmarks/RESULTS.md gives the commands). Sections, each guarded (one that
fails or raises does not stop the others) and skipped once the time budget (--budget-s) runs out:

  cuda tests        `pytest -m cuda` in a subprocess (the tests marked cuda; skipped without pytest)
  resnet50 fit      ResNet-50, 224x224, bf16 autocast, channels_last, synthetic batches on the GPU:
                    Model.fit on MirroredStrategy() against a plain PyTorch loop on the same batches,
                    alternating rounds, ratio of median images/s (target >= 0.98)
  resnet50 formats  the same fit on NCHW batches with compile(memory_format="auto") (channels_last) against
                    "preserve" (NCHW): ratio of median images/s (issue 29, target >= 1.0)
  fp16              Model.fit with precision="fp16" (loss scaling) against a plain torch.amp loop
  sync batchnorm    SyncBatchNorm over a GPU replica and a CPU replica (two GPUs where there are)
                    against one BatchNorm on the whole batch
  fit, 2 replicas   fit on cuda:0 + cpu:0 (one GPU) or on every GPU (NCCL): results on each device
  seeded dropout    two fits with dropout on 1 GPU replica (seed=, and per_example_random) bitwise equal;
                    the replica's draws on its device; the same on cuda:0 + cpu:0 (issue 26)
  quiet steps       fit's steps without the random mode on GPU replicas after a first step that drew nothing;
                    a late dropout caught by the CUDA generators' watch and redone: bitwise the mode's
  checkpoint        a Model trained and saved on CUDA, read and run on the CPU in a fresh process
  profiler          mirrored.profiler.Profiler around fit on CUDA: steps, trace.json, timeline.png
  nccl              one GPU: NcclAllReduce and a second worker are refused clearly; two: all-reduce
Exit status 0 when nothing failed. Prints only; nothing is written outside a temporary folder.
"""
from __future__ import annotations

import argparse
import copy
import gc
import importlib.util
import json
import os
import platform
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

REPO = Path(__file__).resolve().parent.parent
_OPTIONAL = ("crc32c", "simplejpeg", "cv2", "google.protobuf", "PIL", "matplotlib", "tqdm", "safetensors", "pytest",
             "hypothesis")


@dataclass
class Sizes:
    """What each section runs: the GPU sizes, or tiny ones for --cpu-smoke."""

    device: str
    precision: str | None  # of the ResNet-50 runs: bf16 on the GPU; fp32 on the CPU, whose bf16 convolutions crawl
    resnet_batch: int
    resnet_size: int
    resnet_steps: int
    resnet_warmup: int
    resnet_rounds: int
    small_size: int
    small_batch: int
    small_steps: int


GPU_SIZES = Sizes("cuda:0", "bf16", resnet_batch=256, resnet_size=224, resnet_steps=40, resnet_warmup=10,
                  resnet_rounds=3, small_size=64, small_batch=32, small_steps=8)
SMOKE_SIZES = Sizes("cpu:0", None, resnet_batch=2, resnet_size=32, resnet_steps=2, resnet_warmup=1, resnet_rounds=1,
                    small_size=32, small_batch=8, small_steps=3)


@dataclass
class Row:
    section: str
    status: str  # PASS, FAIL, SKIP or ERROR
    seconds: float
    detail: str


class Check:
    """Runs sections under a global time budget and collects one row per section."""

    def __init__(self, budget_s: float, smoke: bool):
        self.deadline = time.monotonic() + budget_s
        self.smoke = smoke
        self.rows: list[Row] = []

    def left_s(self) -> float:
        return self.deadline - time.monotonic()

    def run(self, name: str, need_s: float, fn: Callable[[], tuple[str, str]]) -> None:
        if self.left_s() < need_s:
            self.rows.append(Row(name, "SKIP", 0.0, f"time budget: {self.left_s():.0f} s left, needs ~{need_s:.0f} s"))
            return
        started = time.monotonic()
        try:
            status, detail = fn()
        except Exception as e:  # noqa: BLE001 - a section's failure is a row, never the end of the check
            status = "ERROR"
            detail = f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"
            traceback.print_exc(file=sys.stderr)
        self.rows.append(Row(name, status, time.monotonic() - started, detail))
        print(f"[{status}] {name}: {detail}", file=sys.stderr, flush=True)
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()

    def table(self) -> str:
        width = max(len(r.section) for r in self.rows)
        lines = [f"{'section':<{width}}  status  seconds  detail", "-" * (width + 40)]
        lines += [f"{r.section:<{width}}  {r.status:<6}  {r.seconds:7.1f}  {r.detail}" for r in self.rows]
        return "\n".join(lines)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _gpus() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


# ---- sections ---------------------------------------------------------------------------------------
def environment(smoke: bool) -> tuple[str, str]:
    missing = [m for m in _OPTIONAL if importlib.util.find_spec(m.split(".")[0]) is None
               or (m == "google.protobuf" and importlib.util.find_spec(m) is None)]
    gpu = f"{_gpus()} x {torch.cuda.get_device_name(0)}" if _gpus() else "no GPU"
    detail = (f"Python {platform.python_version()}, torch {torch.__version__}, {gpu}; "
              f"missing: {', '.join(missing) or 'none'}")
    if not smoke and not _gpus():
        return "FAIL", detail + " (run with --cpu-smoke on a CPU machine)"
    return "PASS", detail


def cuda_tests(timeout_s: float) -> tuple[str, str]:
    """The tests marked cuda, in a subprocess (pytest's own timeout per test applies inside)."""
    if importlib.util.find_spec("pytest") is None:
        return "SKIP", "pytest is not installed here: carry its wheel (RESULTS.md, GPU check)"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO / "src"), os.environ.get("PYTHONPATH", "")])}
    # A test module that cannot be imported here (a missing wheel) must not stop the others' cuda tests.
    cmd = [sys.executable, "-m", "pytest", "-m", "cuda", "-q", "-p", "no:cacheprovider", "-o", "addopts=",
           "--continue-on-collection-errors", str(REPO / "tests")]
    try:
        done = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired as e:
        tail = (e.stdout or b"")[-2000:]
        print(tail.decode() if isinstance(tail, bytes) else tail, file=sys.stderr)
        return "FAIL", f"still running after {timeout_s:.0f} s (killed)"
    print(done.stdout[-6000:] + done.stderr[-3000:], file=sys.stderr)
    counts = dict((word, int(n)) for n, word in re.findall(r"(\d+) (passed|failed|skipped|error|errors|deselected)",
                                                           done.stdout))
    summary = ", ".join(f"{n} {w}" for w, n in counts.items() if w != "deselected") or done.stdout.strip()[-200:]
    if done.returncode == 5:
        return "FAIL", "no test marked cuda was collected"
    return ("PASS" if done.returncode == 0 else "FAIL"), summary


def _resnet_batches(sizes: Sizes, classes: int, count: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    device = torch.device(sizes.device)
    g = torch.Generator(device=device).manual_seed(0)
    out = []
    for _ in range(count):
        x = torch.randn(sizes.resnet_batch, 3, sizes.resnet_size, sizes.resnet_size, generator=g, device=device)
        y = torch.randint(0, classes, (sizes.resnet_batch,), generator=g, device=device)
        out.append((x.contiguous(memory_format=torch.channels_last), y))
    return out


def resnet50_fit_vs_plain(sizes: Sizes, smoke: bool) -> tuple[str, str]:
    """Model.fit on MirroredStrategy() against a plain loop: the same ResNet-50 weights, batches, bf16
    autocast, channels_last, SGD with momentum. Images/s of each, alternating, ratio of medians."""
    import mirrored as mr

    device = torch.device(sizes.device)
    classes = 1000 if not smoke else 10
    batches = _resnet_batches(sizes, classes, count=4)
    torch.backends.cudnn.benchmark = True  # the same setting for both runs
    torch.manual_seed(0)
    start_net = mr.models.resnet50(num_classes=classes, data_format="channels_first")

    plain = copy.deepcopy(start_net).to(device)
    if device.type == "cuda":
        plain = plain.to(memory_format=torch.channels_last)  # what mr.Model does (memory_format="auto")
    opt = torch.optim.SGD(plain.parameters(), lr=0.1, momentum=0.9)

    def plain_run(steps: int) -> float:
        _sync(device)
        started = time.perf_counter()
        for i in range(steps):
            x, y = batches[i % len(batches)]
            opt.zero_grad(set_to_none=True)
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=sizes.precision == "bf16"):
                logits = plain(x)
            F.cross_entropy(logits.float(), y).backward()
            opt.step()
        _sync(device)
        return steps * sizes.resnet_batch / (time.perf_counter() - started)

    strategy = mr.MirroredStrategy() if not smoke else mr.MirroredStrategy(devices=[sizes.device])
    with strategy.scope():
        model = mr.Model(copy.deepcopy(start_net))
        model.compile(optimizer=mr.optimizers.SGD(learning_rate=0.1, momentum=0.9),
                      loss="sparse_categorical_crossentropy", precision=sizes.precision)

    def fit_run(steps: int) -> float:
        data = [batches[i % len(batches)] for i in range(steps)]
        _sync(device)
        started = time.perf_counter()
        model.fit(data, epochs=1, verbose=0)
        _sync(device)
        return steps * sizes.resnet_batch / (time.perf_counter() - started)

    if strategy.num_replicas_in_sync > 1:  # several GPUs: the plain loop would use one; compare per GPU
        note = f" (fit on {strategy.num_replicas_in_sync} GPUs, global batch split; plain on one)"
    else:
        note = ""
    plain_run(sizes.resnet_warmup)
    fit_run(sizes.resnet_warmup)
    plains, fits = [], []
    for _ in range(sizes.resnet_rounds):
        plains.append(plain_run(sizes.resnet_steps))
        fits.append(fit_run(sizes.resnet_steps))
    ratio = statistics.median(fits) / statistics.median(plains)
    detail = (f"{sizes.precision or 'fp32'}, batch {sizes.resnet_batch} at {sizes.resnet_size}px: "
              f"plain {statistics.median(plains):.0f} img/s, fit {statistics.median(fits):.0f} img/s, "
              f"fit/plain {ratio:.3f}{note}")
    if smoke:
        return "PASS", detail + " (smoke: ratio not judged)"
    return ("PASS" if ratio >= 0.98 else "FAIL"), detail + " (target >= 0.98)"


def resnet50_memory_formats(sizes: Sizes, smoke: bool) -> tuple[str, str]:
    """Issue 29: Model.fit of ResNet-50 on NCHW batches, bf16, with compile(memory_format="auto") (the
    convolutions in channels_last) against memory_format="preserve" (NCHW), alternating rounds, ratio of
    median images/s; both from the same weights, and their first-step losses within bf16 tolerance."""
    import mirrored as mr

    device = torch.device(sizes.device)
    classes = 1000 if not smoke else 10
    batches = [(x.contiguous(), y) for x, y in _resnet_batches(sizes, classes, count=4)]  # plain NCHW memory
    torch.backends.cudnn.benchmark = True
    torch.manual_seed(0)
    start_net = mr.models.resnet50(num_classes=classes, data_format="channels_first")
    models, ran = {}, {}
    strategy = mr.MirroredStrategy() if not smoke else mr.MirroredStrategy(devices=[sizes.device])
    for fmt in ("auto", "preserve"):
        with strategy.scope():
            models[fmt] = mr.Model(copy.deepcopy(start_net))
            models[fmt].compile(optimizer=mr.optimizers.SGD(learning_rate=0.1, momentum=0.9),
                                loss="sparse_categorical_crossentropy", precision=sizes.precision, memory_format=fmt)
        ran[fmt] = models[fmt].memory_format
    first = {fmt: models[fmt].evaluate([batches[0]], verbose=0) for fmt in models}

    def fit_run(fmt: str, steps: int) -> float:
        data = [batches[i % len(batches)] for i in range(steps)]
        _sync(device)
        started = time.perf_counter()
        models[fmt].fit(data, epochs=1, verbose=0)
        _sync(device)
        return steps * sizes.resnet_batch / (time.perf_counter() - started)

    for fmt in models if not smoke else ():  # (the smoke run checks the path, not the speed)
        fit_run(fmt, sizes.resnet_warmup)
    speeds: dict[str, list[float]] = {fmt: [] for fmt in models}
    for _ in range(sizes.resnet_rounds):
        for fmt in models:
            speeds[fmt].append(fit_run(fmt, sizes.resnet_steps))
    cl, nchw = statistics.median(speeds["auto"]), statistics.median(speeds["preserve"])
    gap = abs(first["auto"] - first["preserve"]) / max(abs(first["preserve"]), 1e-12)
    detail = (f"{sizes.precision or 'fp32'}, batch {sizes.resnet_batch} at {sizes.resnet_size}px: auto ran "
              f"{ran['auto']} {cl:.0f} img/s, preserve ran {ran['preserve']} (NCHW) {nchw:.0f} img/s, "
              f"channels_last/NCHW {cl / nchw:.3f}; first loss gap {gap:.1e}")
    if ran != {"auto": "channels_last", "preserve": "as given"} or not gap < 2e-2:  # (bf16: ~3 significant digits)
        return "FAIL", detail + " (expected auto -> channels_last, preserve -> as given, losses within 2%)"
    if smoke:
        return "PASS", detail + " (smoke: ratio not judged)"
    return ("PASS" if cl / nchw >= 1.0 else "FAIL"), detail + " (target >= 1.0)"


def fp16_loss_scaling(sizes: Sizes) -> tuple[str, str]:
    """precision="fp16" in fit (a GradScaler per replica) against the plain torch.amp recipe, from the
    same weights on the same batch: both losses fall and end within 5% of each other."""
    import mirrored as mr

    device = torch.device(sizes.device)
    if device.type != "cuda":
        return "SKIP", "fp16 with loss scaling needs CUDA"
    g = torch.Generator(device=device).manual_seed(1)
    x = torch.randn(sizes.small_batch, 3, sizes.small_size, sizes.small_size, generator=g, device=device)
    y = torch.randint(0, 10, (sizes.small_batch,), generator=g, device=device)
    torch.manual_seed(0)
    start = mr.models.resnet18(num_classes=10, data_format="channels_first")

    plain = copy.deepcopy(start).to(device).to(memory_format=torch.channels_last)
    opt = torch.optim.SGD(plain.parameters(), lr=0.05, momentum=0.9)
    scaler = torch.amp.GradScaler("cuda")
    for _ in range(sizes.small_steps):
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=torch.float16):
            loss = F.cross_entropy(plain(x).float(), y)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()

    with mr.MirroredStrategy(devices=[sizes.device]).scope():
        model = mr.Model(copy.deepcopy(start))
        model.compile(optimizer=mr.optimizers.SGD(learning_rate=0.05, momentum=0.9),
                      loss="sparse_categorical_crossentropy", precision="fp16")
    model.fit([(x, y)] * sizes.small_steps, epochs=1, verbose=0)

    def loss_of(net: nn.Module) -> float:  # in training mode (batch statistics), as the steps saw it
        with torch.no_grad():
            return F.cross_entropy(net(x).float(), y).item()

    first = loss_of(copy.deepcopy(start).to(device))
    got, want = loss_of(model.module), loss_of(plain)
    finite = all(torch.isfinite(p).all() for p in model.module.parameters())
    detail = f"loss {first:.4f} -> fit {got:.4f}, plain amp {want:.4f} after {sizes.small_steps} steps"
    ok = finite and got < first and want < first and abs(got - want) <= 0.05 * abs(want)
    return ("PASS" if ok else "FAIL"), detail + ("" if finite else "; non-finite weights")


def _replica_gap(model: object) -> float:
    """The largest difference between replica 0's parameters and buffers and any other replica's. A GPU
    and a CPU replica apply the same reduced gradients with different kernels (fused multiply-adds or
    not), so they agree to rounding, not bitwise; replicas on GPUs alike are held to 0 by check_in_sync."""
    first, *others = model.replicas  # type: ignore[attr-defined]
    gap = 0.0
    for other in others:
        for a, b in zip(first.state_dict().values(), other.state_dict().values()):
            gap = max(gap, (a.detach().cpu().double() - b.detach().cpu().double()).abs().max().item())
    return gap


def _two_devices(sizes: Sizes) -> list[str]:
    if sizes.device.startswith("cpu"):
        return ["cpu:0", "cpu:1"]
    return ["cuda:0", "cuda:1"] if _gpus() >= 2 else ["cuda:0", "cpu:0"]


def sync_batchnorm(sizes: Sizes) -> tuple[str, str]:
    """A conv net with SyncBatchNorm on two replicas (a GPU and the CPU on one GPU) trained by fit for a
    few steps, against the same net with plain BatchNorm on the whole batch on one device."""
    import mirrored as mr

    torch.backends.cudnn.allow_tf32 = False  # fp32 on both sides: the comparison is of the algorithm
    torch.backends.cuda.matmul.allow_tf32 = False
    devices = _two_devices(sizes)
    device = torch.device(devices[0])
    g = torch.Generator().manual_seed(2)
    x = torch.randn(sizes.small_batch, 3, 16, 16, generator=g) * 2 + 1
    y = torch.randint(0, 5, (sizes.small_batch,), generator=g)
    torch.manual_seed(0)
    start = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.Conv2d(8, 8, 3, padding=1),
                          nn.BatchNorm2d(8), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 5))
    plain = copy.deepcopy(start).to(device)
    opt = torch.optim.SGD(plain.parameters(), lr=0.1, momentum=0.9)
    for _ in range(sizes.small_steps):
        opt.zero_grad(set_to_none=True)
        F.cross_entropy(plain(x.to(device)), y.to(device)).backward()
        opt.step()
    strategy = mr.MirroredStrategy(devices=devices)
    with strategy.scope():
        model = mr.Model(mr.layers.convert_sync_batchnorm(copy.deepcopy(start)))
        model.compile(optimizer=mr.optimizers.SGD(learning_rate=0.1, momentum=0.9),
                      loss="sparse_categorical_crossentropy")
    model.fit([(x, y)] * sizes.small_steps, epochs=1, verbose=0)
    if len({d.split(":")[0] for d in devices}) == 1:
        model.check_in_sync()
    gap = _replica_gap(model)
    worst = 0.0
    for (key, got), want in zip(model.module.state_dict().items(), plain.state_dict().values()):
        if got.is_floating_point():
            worst = max(worst, (got.cpu().double() - want.cpu().double()).abs().max().item())
    detail = (f"{' + '.join(devices)}: max difference from one BatchNorm {worst:.2e} (bound 1e-4), "
              f"between replicas {gap:.1e}")
    return ("PASS" if worst < 1e-4 and gap < 1e-5 else "FAIL"), detail


def fit_on_two_replicas(sizes: Sizes) -> tuple[str, str]:
    """Issue 19's failure: fit on 2+ replicas broke after its first step (buffers on replica 0's GPU).
    Three steps, results and weights on each replica's device, replicas in sync."""
    import mirrored as mr
    from mirrored.distribute.devices import torch_device

    devices = _two_devices(sizes) if _gpus() < 2 else [f"cuda:{i}" for i in range(_gpus())]
    g = torch.Generator().manual_seed(3)
    batch = 4 * len(devices)
    data = [(torch.rand(batch, 3, 32, 32, generator=g), torch.randint(0, 10, (batch,), generator=g)) for _ in range(3)]
    strategy = mr.MirroredStrategy(devices=devices)
    with strategy.scope():
        model = mr.Model(mr.models.resnet_cifar(depth=8, num_classes=10, data_format="channels_first"))
        model.compile(optimizer=mr.optimizers.SGD(learning_rate=0.05, momentum=0.9),
                      loss="sparse_categorical_crossentropy", metrics=["accuracy"])
    history = model.fit(data, epochs=2, verbose=0).history
    same_kind = len({d.split(":")[0] for d in devices}) == 1
    if same_kind:
        model.check_in_sync()
    gap = _replica_gap(model)
    targets = [torch_device(d) for d in devices]
    local = strategy.extended.cross_device_ops.reduce("sum", mr.PerReplica([torch.ones(3, device=t) for t in targets]))
    placed = [t.device for t in local.values] == targets
    right = all(torch.equal(t.cpu(), torch.full((3,), float(len(devices)))) for t in local.values)
    per_replica = strategy.run(lambda: torch.ones(2, device=targets[mr.get_replica_context().replica_id_in_sync_group]))
    total = strategy.reduce("sum", per_replica)
    losses = history["loss"]
    ok = placed and right and total.device == targets[0] and all(l == l for l in losses) and gap < 1e-5
    ops = type(strategy.extended.cross_device_ops).__name__
    return ("PASS" if ok else "FAIL"), (f"{' + '.join(devices)} ({ops}): losses "
                                        f"{', '.join(f'{l:.3f}' for l in losses)}; replicas "
                                        f"{'bitwise equal' if same_kind else f'within {gap:.1e}'}; reduce results "
                                        f"on their devices: {placed}, right: {right}")


def seeded_dropout(sizes: Sizes) -> tuple[str, str]:
    """Issue 26 on CUDA: two fits of an MLP with dropout on one GPU replica of a strategy with seed=
    give bitwise the same weights (and so do two with per_example_random=True), the replica's
    generators live on its device (torch.rand(device=...) and F.dropout on a CUDA tensor draw there),
    and a CUDA and a CPU replica together also give the same weights twice."""
    import mirrored as mr
    from mirrored.distribute.devices import torch_device

    device = torch_device(sizes.device)
    g = torch.Generator().manual_seed(5)
    x, y = torch.randn(64, 16, generator=g), torch.randint(0, 4, (64,), generator=g)

    def fit(devices: list[str], per_example: bool) -> list[torch.Tensor]:
        torch.manual_seed(0)
        with mr.MirroredStrategy(devices=devices, seed=11, per_example_random=per_example).scope():
            model = mr.Model(nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Dropout(0.5), nn.Linear(64, 4)))
            model.compile(optimizer=mr.optimizers.SGD(learning_rate=0.1, momentum=0.9),
                          loss="sparse_categorical_crossentropy")
        model.fit(mr.data.Dataset.from_tensor_slices((x, y)).batch(16), epochs=2, verbose=0)
        return [p.detach().cpu().clone() for p in model.module.parameters()]

    def same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
        return all(torch.equal(u, v) for u, v in zip(a, b))

    one = [sizes.device]
    seeded = same(fit(one, False), fit(one, False))
    keyed = same(fit(one, True), fit(one, True))
    strategy = mr.MirroredStrategy(devices=one, seed=11)
    drawn = strategy.run(lambda: (torch.rand(3, device=device), F.dropout(torch.ones(8, device=device), 0.5)))
    placed = all(t.device == device for t in drawn)
    mixed_devices = _two_devices(sizes) if device.type == "cuda" else ["cpu:0", "cpu:1"]
    mixed = same(fit(mixed_devices, False), fit(mixed_devices, False))
    ok = seeded and keyed and placed and mixed
    return ("PASS" if ok else "FAIL"), (f"1 replica on {sizes.device}: two fits bitwise equal {seeded}, with "
                                        f"per_example_random {keyed}; draws on the replica's device {placed}; "
                                        f"{' + '.join(mixed_devices)}: two fits bitwise equal {mixed}")


class _LateDropout(nn.Module):
    """Identity for its first `start - 1` calls per copy, dropout from then on; logs whether each call ran
    in the replica random mode (one log shared by every copy: deepcopy keeps it)."""

    def __init__(self, start: int, log: list[bool]):
        super().__init__()
        self.start, self.log, self.calls = start, log, 0

    def __deepcopy__(self, memo: dict) -> _LateDropout:
        return _LateDropout(self.start, self.log)

    def forward(self, t: torch.Tensor) -> torch.Tensor:
        from mirrored.distribute.random import current_mode

        self.log.append(current_mode() is not None)
        self.calls += 1
        return F.dropout(t, 0.5, training=self.training) if self.calls >= self.start else t


def quiet_steps(sizes: Sizes) -> tuple[str, str]:
    """Issue 35 on CUDA: fit's steps that draw nothing run without the replica random mode on GPU
    replicas too, and a step that starts drawing dropout on the GPU (third step) is caught by the watch
    of the replicas' CUDA generators, rolled back and redone with the mode: the weights equal, bitwise,
    a fit with the mode on every step."""
    import mirrored as mr
    from mirrored.distribute import random as replica_random

    devices = _two_devices(sizes)
    g = torch.Generator().manual_seed(3)
    x, y = torch.randn(80, 16, generator=g), torch.randint(0, 4, (80,), generator=g)

    def fit(always_mode: bool) -> tuple[list[torch.Tensor], list[bool]]:
        log: list[bool] = []
        quiet = replica_random.StrategyRandom.quiet
        if always_mode:
            replica_random.StrategyRandom.quiet = lambda self, key: False  # type: ignore[method-assign]
        try:
            torch.manual_seed(0)
            with mr.MirroredStrategy(devices=devices, seed=11).scope():
                model = mr.Model(nn.Sequential(nn.Linear(16, 32), nn.ReLU(), _LateDropout(3, log), nn.Linear(32, 4)))
                model.compile(optimizer=mr.optimizers.SGD(learning_rate=0.1, momentum=0.9),
                              loss="sparse_categorical_crossentropy")
            model.fit(x, y, batch_size=16, epochs=1, verbose=0, shuffle=False)
            if len({d.split(":")[0] for d in devices}) == 1:  # (a GPU and a CPU replica agree to rounding only)
                model.check_in_sync()
        finally:
            replica_random.StrategyRandom.quiet = quiet  # type: ignore[method-assign]
        return [p.detach().cpu().clone() for p in model.module.parameters()], log

    weights, log = fit(False)
    reference, _ = fit(True)
    replicas = len(devices)
    # Per replica: step 1 with the mode, step 2 without, step 3 without (caught drawing), redone with, on with.
    quiet_second = log[replicas:2 * replicas] == [False] * replicas
    mode_after = all(log[-replicas:])
    same = all(torch.equal(a, b) for a, b in zip(weights, reference))
    ok = quiet_second and mode_after and same
    return ("PASS" if ok else "FAIL"), (f"{' + '.join(devices)}: step 2 without the mode {quiet_second}; the mode "
                                        f"back after the late draw {mode_after}; weights bitwise those of the mode "
                                        f"throughout {same}")


def checkpoint_to_cpu(sizes: Sizes, tmp: Path) -> tuple[str, str]:
    """A Model trained and saved on the device, loaded in a fresh process that sees no GPU."""
    from safetensors.torch import save_file

    import mirrored as mr

    torch.backends.cudnn.allow_tf32 = False
    g = torch.Generator().manual_seed(4)
    x = torch.rand(16, 3, 32, 32, generator=g)
    y = torch.randint(0, 10, (16,), generator=g)
    torch.manual_seed(0)
    with mr.MirroredStrategy(devices=[sizes.device]).scope():
        model = mr.Model(mr.models.resnet_cifar(depth=8, num_classes=10, data_format="channels_first"))
        model.compile(optimizer=mr.optimizers.SGD(learning_rate=0.05, momentum=0.9),
                      loss="sparse_categorical_crossentropy")
    model.fit([(x[:8], y[:8]), (x[8:], y[8:])], epochs=1, verbose=0)
    path = tmp / "model.safetensors"
    model.save(path)
    want = torch.as_tensor(model.predict(x, batch_size=8, verbose=0))
    save_file({"x": x, "want": want.contiguous()}, str(tmp / "inputs.safetensors"))
    code = ("import torch, mirrored as mr\n"
            "from safetensors.torch import load_file\n"
            "assert not torch.cuda.is_available()\n"
            f"m = mr.Model.load({str(path)!r})\n"
            "assert {p.device.type for p in m.module.parameters()} == {'cpu'}\n"
            f"data = load_file({str(tmp / 'inputs.safetensors')!r})\n"
            "got = torch.as_tensor(m.predict(data['x'], batch_size=8, verbose=0))\n"
            "print((got - data['want']).abs().max().item())\n")
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "",
           "PYTHONPATH": os.pathsep.join([str(REPO / "src"), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    if done.returncode != 0:
        return "FAIL", f"loading on the CPU failed: {(done.stderr.strip().splitlines() or ['?'])[-1]}"
    gap = float(done.stdout.strip().splitlines()[-1])
    detail = f"saved on {sizes.device}, predictions on the CPU within {gap:.1e} (bound 1e-3)"
    return ("PASS" if gap < 1e-3 else "FAIL"), detail


def profiler_on_device(sizes: Sizes, tmp: Path) -> tuple[str, str]:
    import mirrored as mr

    g = torch.Generator().manual_seed(5)
    data = [(torch.rand(8, 3, 32, 32, generator=g), torch.randint(0, 10, (8,), generator=g)) for _ in range(4)]
    with mr.MirroredStrategy(devices=[sizes.device]).scope():
        model = mr.Model(mr.models.resnet_cifar(depth=8, num_classes=10, data_format="channels_first"))
        model.compile(optimizer=mr.optimizers.SGD(learning_rate=0.05), loss="sparse_categorical_crossentropy")
    profiler = mr.profiler.Profiler(log_dir=tmp / "profile")
    model.fit(data, epochs=1, verbose=0, callbacks=[profiler])
    summary = profiler.summary()
    files = [name for name in ("trace.json", "timeline.png") if (tmp / "profile" / name).is_file()]
    trace_ok = "trace.json" in files and bool(json.loads((tmp / "profile" / "trace.json").read_text()))
    ok = summary["steps"] == len(data) and len(files) == 2 and trace_ok
    return ("PASS" if ok else "FAIL"), (f"{summary['steps']} steps, median step {summary['step_s']['median']:.4f} s, "
                                        f"wrote {', '.join(files) or 'nothing'}")


def nccl_paths(sizes: Sizes) -> tuple[str, str]:
    """One GPU: NCCL across a GPU and the CPU, and a second worker process on the only GPU, are refused
    with errors that say what to do. Two GPUs: NcclAllReduce sums onto each GPU."""
    import mirrored as mr
    from mirrored.distribute import multi_worker

    if _gpus() >= 2:
        s = mr.MirroredStrategy(devices=["cuda:0", "cuda:1"], cross_device_ops=mr.NcclAllReduce())
        out = s.extended.cross_device_ops.reduce("sum", mr.PerReplica([torch.full((5,), 1.0, device="cuda:0"),
                                                                        torch.full((5,), 2.0, device="cuda:1")]))
        ok = [str(t.device) for t in out.values] == ["cuda:0", "cuda:1"] and all(
            t.eq(3.0).all().item() for t in out.values)
        return ("PASS" if ok else "FAIL"), f"NCCL all-reduce on 2 GPUs: {[t.tolist() for t in out.values]}"
    messages = []
    try:
        mr.MirroredStrategy(devices=[sizes.device, "cpu:1" if sizes.device == "cpu:0" else "cpu:0"],
                            cross_device_ops=mr.NcclAllReduce())
        return "FAIL", "NcclAllReduce across a GPU and the CPU was accepted"
    except ValueError as e:
        messages.append(str(e))
    try:  # the devices a second worker process (LOCAL_RANK=1 of 2 on this machine) would take
        from mirrored.distribute import cluster_resolver

        second = cluster_resolver.resolve({"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2",
                                           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"})
        device = multi_worker._local_devices(None, second)
        if _gpus() == 1:
            return "FAIL", f"a second worker was given {device} on a one-GPU machine"
    except ValueError as e:
        messages.append(str(e))
    wanted = ["nccl", "local rank 1"] if _gpus() == 1 else ["nccl"]
    ok = all(any(w in m.lower() for m in messages) for w in wanted)
    return ("PASS" if ok else "FAIL"), " | ".join(m.split(". ")[0] for m in messages)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cpu-smoke", action="store_true", help="tiny sizes on the CPU: checks the script runs")
    parser.add_argument("--budget-s", type=float, default=450.0, help="stop starting sections after this long")
    parser.add_argument("--tests-timeout-s", type=float, default=200.0, help="limit of the pytest -m cuda run")
    args = parser.parse_args(argv)
    smoke = args.cpu_smoke
    sizes = SMOKE_SIZES if smoke else GPU_SIZES
    check = Check(args.budget_s, smoke)
    tmp = Path(tempfile.mkdtemp(prefix="gpu_check_"))
    try:
        check.run("environment", 0, lambda: environment(smoke))
        if smoke:
            check.rows.append(Row("cuda tests", "SKIP", 0.0, "not in --cpu-smoke (the suite skips them without CUDA)"))
        else:
            check.run("cuda tests", 60, lambda: cuda_tests(min(args.tests_timeout_s, check.left_s() - 150)))
        check.run("resnet50 fit vs plain", 0 if smoke else 90, lambda: resnet50_fit_vs_plain(sizes, smoke))
        check.run("resnet50 channels_last vs nchw", 0 if smoke else 90, lambda: resnet50_memory_formats(sizes, smoke))
        check.run("fp16 loss scaling", 10, lambda: fp16_loss_scaling(sizes))
        check.run("sync batchnorm", 10, lambda: sync_batchnorm(sizes))
        check.run("fit on 2 replicas", 10, lambda: fit_on_two_replicas(sizes))
        check.run("seeded dropout", 10, lambda: seeded_dropout(sizes))
        check.run("quiet steps", 10, lambda: quiet_steps(sizes))
        check.run("checkpoint -> cpu", 15, lambda: checkpoint_to_cpu(sizes, tmp))
        check.run("profiler", 10, lambda: profiler_on_device(sizes, tmp))
        check.run("nccl", 5, lambda: nccl_paths(sizes))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print(check.table())
    failed = [r.section for r in check.rows if r.status in ("FAIL", "ERROR")]
    print(f"{len(check.rows) - len(failed)} of {len(check.rows)} sections without failure"
          + (f"; failed: {', '.join(failed)}" if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
