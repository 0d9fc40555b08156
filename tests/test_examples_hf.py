"""examples/hf_gpt2.py (issue 36): a Hugging Face GPT-2 in a custom loop on 2 CPU replicas, run when
transformers is installed. A run stopped at a checkpoint and started again with the same --checkpoint-dir
ends as the uninterrupted run: the same losses, held-out loss and completions, to the printed digit (the
weights, AdamW's moments, the cosine schedule, the data iterator and the replicas' dropout generators all
come back)."""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")

REPO = Path(__file__).resolve().parent.parent
_TIMEOUT_S = 100  # below pytest's 120 s limit, so a hang fails here with the example's output


def _run(*args: str) -> str:
    proc = subprocess.run([sys.executable, str(REPO / "examples" / "hf_gpt2.py"), "--save-every", "15",
                           "--warmup", "5", *args], cwd=REPO, capture_output=True, text=True, timeout=_TIMEOUT_S)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout


def _results(output: str) -> list[str]:
    """The step lines without their timings, and the lines after training."""
    lines = [re.sub(r"\s+\(.*\)$", "", line) for line in output.splitlines() if line.startswith("step ")]
    return lines + [line for line in output.splitlines() if line.startswith(("held-out", "completions"))]


def test_a_second_run_continues_the_first_from_its_checkpoint(tmp_path):
    whole = _results(_run("--steps", "30", "--checkpoint-dir", str(tmp_path / "whole")))
    first = _run("--steps", "30", "--checkpoint-dir", str(tmp_path / "resumed"), "--stop-after", "15")
    second = _run("--steps", "30", "--checkpoint-dir", str(tmp_path / "resumed"))
    assert f"continuing from {tmp_path / 'resumed' / 'ckpt-1'} at step 15" in second
    assert _results(first) == whole[:1]
    assert _results(second) == whole[1:], (whole, second)
    assert "replicas in sync" in second and "each copy's output layer is its token embedding" in second
