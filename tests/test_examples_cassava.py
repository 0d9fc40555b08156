"""examples/cassava_resnet.py end to end on the tiny Cassava that TFDS itself wrote (20/10/10 images
of 24x32), in a subprocess as a user runs it: 2 CPU replicas, ResNet-18 at 32x32, one epoch."""
from __future__ import annotations

import math
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
TFDS_DIR = REPO.parent / "shared" / "fixtures" / "tfds"
TIMEOUT_S = 300  # about 6 s on 2 cores; the margin is for a loaded machine, not a budget


def test_cassava_example_trains_and_prints_test_metrics():
    if not (TFDS_DIR / "cassava").is_dir():
        pytest.skip(f"the TFDS cassava fixture is not at {TFDS_DIR}")
    cmd = [sys.executable, str(REPO / "examples" / "cassava_resnet.py"), "--data-dir", str(TFDS_DIR),
           "--image-size", "32", "--model", "resnet18", "--epochs", "1", "--replicas", "2"]
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=TIMEOUT_S)
    output = f"stdout:\n{done.stdout}\nstderr:\n{done.stderr}"
    assert done.returncode == 0, output
    match = re.search(r"^test: loss: (\S+) - accuracy: (\S+)$", done.stdout, re.M)
    assert match, output
    loss, accuracy = float(match.group(1)), float(match.group(2))
    assert math.isfinite(loss) and loss > 0, output
    assert accuracy in {k / 10 for k in range(11)}, output  # 10 test images
    assert "val_loss" in done.stdout, output  # the epoch line includes validation
