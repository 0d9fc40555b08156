"""Shared test fixtures. Every test is checked for threads it leaves behind (the guide's rule).

`@pytest.mark.cuda` marks a test that needs CUDA (`@pytest.mark.cuda(devices=2)`: two GPUs); it is
skipped where torch sees fewer. `pytest -m cuda` runs just those (benchmarks/gpu_check.py does)."""
from __future__ import annotations

import gc
import json
import threading
import time
from pathlib import Path

import pytest
import safetensors
import safetensors.torch
import torch

REPO = Path(__file__).resolve().parent.parent
FIXTURES = REPO.parent / "shared" / "fixtures"
_THREAD_GRACE_S = 10.0  # generous: a finalizer-driven shutdown joins worker threads
# Threads that live as long as the process, started lazily by others: pytest-timeout's, and (torch
# 2.11) the reader and timer of inductor's pool of compile subprocesses, which torch 2.13 starts at
# the first compile (test_jit_compile.py starts the rest itself, before its tests are checked).
_PROCESS_WIDE_THREADS = ("pytest_timeout", "InductorSubproc", "subproc_worker_timer")


def _live_threads() -> set[threading.Thread]:
    return {t for t in threading.enumerate() if t.is_alive()}


@pytest.fixture(autouse=True)
def no_thread_left_behind():
    """Fails a test that leaves a thread running once its objects are garbage-collected."""
    before = _live_threads()
    yield
    deadline = time.monotonic() + _THREAD_GRACE_S
    while True:
        left = [t for t in _live_threads() - before if not t.name.startswith(_PROCESS_WIDE_THREADS)]
        if not left or time.monotonic() > deadline:
            break
        gc.collect()  # only when something is left: a strategy's threads stop when it is collected
        time.sleep(0.02)
    assert not left, f"test left threads running: {[t.name for t in left]}"


@pytest.fixture(scope="session")
def compiler_threads():
    """Starts torch.compile's process-wide helper threads, which stay for the process: tqdm's monitor
    (torch.fx's interpreter makes a progress bar) and inductor's pool of compile threads. A module that
    compiles uses it, so that they start before the per-test check for threads left behind."""
    torch.compile(lambda t: t * 2, backend="aot_eager")(torch.ones(2, requires_grad=True))
    from torch._inductor.async_compile import AsyncCompile, get_compile_threads

    workers = get_compile_threads()
    if workers > 1:  # (one compile thread: inductor compiles on the calling thread, no pool)
        everyone = threading.Barrier(workers)  # each task waits for the others: one thread per task
        for done in [AsyncCompile.pool().submit(everyone.wait, 30) for _ in range(workers)]:
            done.result()


@pytest.fixture
def fixtures_dir() -> Path:
    """../shared/fixtures, read by a path relative to the repository."""
    if not FIXTURES.is_dir():
        pytest.skip(f"shared fixtures not found at {FIXTURES}")
    return FIXTURES


def _rewrite_checkpoint(path: str, tensors=None, meta=None) -> None:
    """Rewrites a checkpoint with plain safetensors: `tensors(dict)` and `meta(dict)` edit in place."""
    with safetensors.safe_open(path, framework="pt") as f:
        header = f.metadata()
    with open(path, "rb") as f:  # not get_tensor: its tensors map the file this rewrites (issue 25)
        data = safetensors.torch.load(f.read())
    metadata = json.loads(header["mirrored"])
    if tensors:
        tensors(data)
    if meta:
        meta(metadata)
    safetensors.torch.save_file(data, path, metadata={"mirrored": json.dumps(metadata), "format": "pt"})


@pytest.fixture
def rewrite_checkpoint():
    """A function that rewrites a saved checkpoint's tensors and metadata in place, as a forger would."""
    return _rewrite_checkpoint


def pytest_collection_modifyitems(config, items):
    """Skips `cuda`-marked tests where torch sees fewer GPUs than they need."""
    del config
    have = torch.cuda.device_count() if torch.cuda.is_available() else 0
    for item in items:
        marker = item.get_closest_marker("cuda")
        if marker is None:
            continue
        need = marker.kwargs.get("devices", 1)
        if have < need:
            item.add_marker(pytest.mark.skip(reason=f"needs {need} CUDA GPU(s); torch sees {have}"))


def pytest_collection_finish(session):
    """Moves everything imported so far (torch's many objects) out of the cyclic GC's view, so the
    thread-leak fixture's gc.collect() only walks what a test created."""
    gc.collect()
    gc.freeze()
