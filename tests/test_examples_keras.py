"""The Keras examples run end to end as a user runs them, in a fresh interpreter: examples/keras_resnet.py
(issue 23; Keras's own fit since issue 34) - keras.applications.ResNet50 built and compiled in the
strategy's scope on 2 CPU replicas, on the embedded digits and on the Cassava that TFDS wrote;
examples/keras_gan.py (issue 34), keras.io's GAN on 2 CPU replicas; and keras.io's "Image
classification from scratch" ported."""
from __future__ import annotations

import math
import os
import re
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
    assert "test: accuracy:" in output, output


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_keras_resnet_example_trains_on_the_cassava_that_tfds_wrote():
    tfds_dir = REPO.parent / "shared" / "fixtures" / "tfds"
    if not (tfds_dir / "cassava").is_dir():
        pytest.skip(f"the TFDS cassava fixture is not at {tfds_dir}")
    env = {**os.environ, "KERAS_BACKEND": "torch"}
    proc = subprocess.run([sys.executable, str(REPO / "examples" / "keras_resnet.py"), "--replicas", "2",
                           "--epochs", "1", "--dataset", "cassava", "--data-dir", str(tfds_dir), "--image-size", "32"],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=_TIMEOUT_S)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output
    assert "2 replicas in sync" in output, output
    match = re.search(r"^test: accuracy: (\S+) - loss: (\S+)$", proc.stdout, re.M)
    assert match and math.isfinite(float(match.group(2))), output
    assert float(match.group(1)) in {k / 10 for k in range(11)}, output  # 10 test images


@pytest.mark.timeout(300)
def test_keras_gan_example_trains_on_two_replicas_in_sync():
    env = {**os.environ, "KERAS_BACKEND": "torch"}
    proc = subprocess.run([sys.executable, str(REPO / "examples" / "keras_gan.py"), "--replicas", "2",
                           "--epochs", "1", "--steps", "3", "--latent-dim", "16"], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=_TIMEOUT_S)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output
    match = re.search(r"^losses: d_loss: (\S+) - g_loss: (\S+)$", proc.stdout, re.M)
    assert match and all(math.isfinite(float(v)) for v in match.groups()), output
    assert "2 replicas in sync" in output, output


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
