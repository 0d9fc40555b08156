"""examples/keras_resnet.py runs end to end as a user runs it (issue 23): keras.applications.ResNet50
on 2 CPU replicas, a Keras optimizer and Keras's loss string, in a fresh interpreter."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import importlib.util

import pytest

if importlib.util.find_spec("keras") is None:  # (the example imports it in its own interpreter)
    pytest.skip("keras is not installed (pip install mirrored[keras])", allow_module_level=True)

REPO = Path(__file__).resolve().parent.parent
_TIMEOUT_S = 240


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_keras_resnet_example_trains_and_keeps_replicas_in_sync():
    env = {**os.environ, "KERAS_BACKEND": "torch"}
    proc = subprocess.run([sys.executable, str(REPO / "examples" / "keras_resnet.py"), "--replicas", "2",
                           "--epochs", "1", "--steps", "2"], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=_TIMEOUT_S)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output
    assert "2 replicas in sync" in output, output
    assert "test: loss:" in output, output


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_keras_image_classification_port_trains_checkpoints_and_keeps_replicas_in_sync():
    """keras.io's "Image classification from scratch" ported (issue 23): Keras's augmentation layers,
    SeparableConv2D and BatchNormalization on 2 CPU replicas, .keras checkpoints that Keras reloads
    and predicts with identically (the example asserts it), and the replicas in sync."""
    env = {**os.environ, "KERAS_BACKEND": "torch"}
    proc = subprocess.run([sys.executable, str(REPO / "examples" / "keras_image_classification.py"), "--replicas", "2",
                           "--epochs", "2", "--examples", "128", "--width", "4"], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=_TIMEOUT_S)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output
    assert "checkpoints: ['save_at_1.keras', 'save_at_2.keras']" in output, output
    assert "2 replicas in sync" in output, output
