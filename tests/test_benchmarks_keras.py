"""benchmarks/keras_fit.py runs end to end on tiny settings (issue 23), so it does not rot between the
sessions that measure with it. Only that it finishes and prints its rows and ratios is checked."""
from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

if importlib.util.find_spec("keras") is None:
    pytest.skip("keras is not installed (pip install mirrored[keras])", allow_module_level=True)

REPO = Path(__file__).resolve().parent.parent


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_keras_fit_benchmark_prints_every_row_and_both_ratios():
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "keras_fit.py"), "--batch", "4", "--steps", "1",
                           "--rounds", "1", "--width", "2", "--image-size", "8"], cwd=REPO, capture_output=True,
                          text=True, timeout=240, env={**os.environ, "KERAS_BACKEND": "torch"})
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    for label in ("Keras's own fit, 1 device", "Keras's own step cost", "  the same in the random mode",
                  "mr.Model(keras), 1 replica", "Keras's step, 2 threads, no exchange", "  the same, meeting every step",
                  "mr.Model(keras), 2 replicas", "Keras's own fit, 2 replicas",
                  "mr.Model(torch), 2 replicas"):
        assert re.search(rf"^  {re.escape(label)}\s+[0-9.]+\s+[0-9.]+\s+\(", proc.stdout, re.M), out
    assert re.search(r"^CPU cost mr.Model\(keras\) 1 replica / Keras's own fit: [0-9.]+", proc.stdout, re.M), out
    assert re.search(r"^ratio mr.Model\(keras\) 1 replica / Keras's own fit: [0-9.]+", proc.stdout, re.M), out
    assert re.search(r"^ratio mr.Model\(keras\) / mr.Model\(torch\), 2 replicas: [0-9.]+", proc.stdout, re.M), out
    assert re.search(r"^ratio Keras's step on 2 threads meeting every step / never meeting: [0-9.]+", proc.stdout,
                     re.M), out
    assert re.search(r"^ratio Keras's own fit distributed / mr.Model path, 2 replicas: [0-9.]+", proc.stdout, re.M), out


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_keras_fit_pair_runs_only_the_two_distributed_fits_and_prints_their_ratios():
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "keras_fit.py"), "--pair", "--batch", "4",
                           "--steps", "1", "--rounds", "2", "--width", "2", "--image-size", "8"], cwd=REPO,
                          capture_output=True, text=True, timeout=240, env={**os.environ, "KERAS_BACKEND": "torch"})
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    rows = re.findall(r"^  (\S.*?)\s+[0-9.]+\s+[0-9.]+\s+\(", proc.stdout, re.M)
    assert rows == ["mr.Model(keras), 2 replicas", "Keras's own fit, 2 replicas"], out
    assert re.search(r"^ratio Keras's own fit distributed / mr.Model path, 2 replicas: [0-9.]+; median of the "
                     r"rounds' ratios [0-9.]+; CPU per example [0-9.]+", proc.stdout, re.M), out


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_keras_conv_layout_benchmark_checks_its_variants_and_prints_every_row():
    """benchmarks/keras_conv_layout.py (issue 29): every variant computes Keras's own values (the
    script refuses otherwise) and every row is printed with its ratio to Keras as is."""
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "keras_conv_layout.py"), "--batch", "2",
                           "--steps", "1", "--rounds", "1"], cwd=REPO, capture_output=True, text=True, timeout=240,
                          env={**os.environ, "KERAS_BACKEND": "torch"})
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    for label in ("keras", "kernel OHWI", "one copy", "torch CL", "torch NCHW", "torch ResNet-20"):
        assert re.search(rf"^  {re.escape(label)}\s+[0-9.]+ \([0-9.]+-[0-9.]+\)\s+[0-9.]+$", proc.stdout, re.M), out
    assert "Keras ResNet-20, training step" in proc.stdout, out
