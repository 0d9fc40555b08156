"""examples/custom_loop.py continues an interrupted run from its CheckpointManager (issue 13): one epoch,
then a second run of two epochs on the same directory, prints the second epoch and the final accuracy
of an uninterrupted two-epoch run, to the last digit."""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
_TIMEOUT_S = 100  # below pytest's 120 s limit, so a hang fails here with the example's output


def _run(*args: str) -> str:
    proc = subprocess.run([sys.executable, str(REPO / "examples" / "custom_loop.py"), *args], cwd=REPO,
                          capture_output=True, text=True, timeout=_TIMEOUT_S)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout


def _results(output: str) -> list[str]:
    """The epoch lines without their timings and paths, and the final line."""
    lines = [re.sub(r"\s+\(.*\)$", "", line) for line in output.splitlines() if line.startswith("epoch ")]
    return lines + [line for line in output.splitlines() if line.startswith("final test accuracy")]


def test_a_second_run_continues_the_first_from_its_checkpoints(tmp_path):
    whole = _results(_run("--epochs", "2", "--checkpoint-dir", str(tmp_path / "whole")))
    first = _run("--epochs", "1", "--checkpoint-dir", str(tmp_path / "resumed"))
    second = _run("--epochs", "2", "--checkpoint-dir", str(tmp_path / "resumed"))
    assert f"continuing from {tmp_path / 'resumed' / 'ckpt-1'} at epoch 2" in second
    assert _results(first)[0] == whole[0]
    assert _results(second) == whole[1:], second
    assert sorted(p.name for p in (tmp_path / "resumed").iterdir()) == ["checkpoint", "ckpt-1", "ckpt-2"]
