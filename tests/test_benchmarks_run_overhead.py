"""benchmarks/run_overhead.py runs end to end on tiny settings, so it does not rot between the
sessions that measure with it. Only that it finishes and prints its rows is checked: never a timing."""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
_TIMEOUT_S = 100


def test_run_overhead_benchmark_prints_every_row():
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "run_overhead.py"), "--samples", "2",
                           "--calls", "50"], cwd=REPO, capture_output=True, text=True, timeout=_TIMEOUT_S)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = proc.stdout
    for row in ("bare call", "run, 1 replica", "run, 2 replicas", "run, 4 replicas", "hand-off floor, 2 threads",
                "hand-off floor, caller + 1", "ReplicaPool.run, 4 threads"):
        assert re.search(rf"^  {re.escape(row)}\s+[0-9.]+\s+[0-9.]+\s+[0-9.]+$", out, re.M), (row, out)
    for piece in ("entry checks, arguments", "rendezvous", "rollback journals", "caller modes",
                  "shared-state guard", "replica wrapper (x1)", "regroup results", "wake-ups (hand-off floor)"):
        assert re.search(rf"^  {re.escape(piece)}\s+-?[0-9.]+", out, re.M), (piece, out)
