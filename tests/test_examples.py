"""The examples run end to end, as a user would run them, in a fresh interpreter."""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
_TIMEOUT_S = 100  # below pytest's 120 s limit, so a hang fails here with the example's output


def test_custom_loop_learns_and_keeps_replicas_in_sync():
    proc = subprocess.run([sys.executable, str(REPO / "examples" / "custom_loop.py"), "--epochs", "2"],
                          cwd=REPO, capture_output=True, text=True, timeout=_TIMEOUT_S)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output
    assert "replicas in sync" in output, output
    found = re.search(r"final test accuracy: ([0-9.]+) \(chance ([0-9.]+)\)", output)
    assert found, output
    accuracy, chance = float(found.group(1)), float(found.group(2))
    # 4 classes, the largest holds ~29% of the test set; two epochs reach ~85%.
    assert accuracy > chance + 0.25, output


def test_torch_ddp_style_script_learns_the_digits_and_keeps_replicas_in_sync():
    """pytorch/examples' MNIST recipe made data-parallel (issue 14), as a user runs it."""
    proc = subprocess.run([sys.executable, str(REPO / "examples" / "torch_ddp_style.py"), "--epochs", "2",
                           "--replicas", "3"], cwd=REPO, capture_output=True, text=True, timeout=_TIMEOUT_S)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output
    found = re.search(r"replicas in sync; final test accuracy: ([0-9.]+)", output)
    assert found, output
    # 10 classes (chance 0.1); two epochs of Adadelta reach ~0.9 (measured 0.93 on 2 replicas).
    assert float(found.group(1)) > 0.75, output
