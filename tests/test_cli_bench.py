"""`mirrored bench`: its flags reach the fit table's rows, and bad flags are one line and status 2.
The table itself (its timing) is the benchmark's business, never a test's (tests/test_benchmarks.py
runs it end to end on tiny settings)."""
from __future__ import annotations

import pytest

from mirrored import _bench, cli


@pytest.fixture
def calls(monkeypatch):
    """Records what cmd_bench asks of the fit table instead of timing anything."""
    seen = []
    monkeypatch.setattr(_bench, "compare", lambda *args, **kwargs: seen.append(("compare", args, kwargs)) or {})
    monkeypatch.setattr(_bench, "scaling", lambda *args, **kwargs: seen.append(("scaling", args, kwargs)) or {})
    return seen


def test_bench_defaults_are_the_quick_table_at_batches_64_and_256(calls, capsys):
    assert cli.main(["bench"]) == 0
    assert [(name, args[:4]) for name, args, _ in calls] == [("compare", (64, 2, 512, 1)),
                                                             ("compare", (256, 2, 512, 1))]
    assert all(kwargs["rows"] == _bench.ROWS for _, _, kwargs in calls)
    out = capsys.readouterr().out
    assert out.startswith("machine: ") and "fit >= 0.95 x the independent processes at once" in out
    assert all(kwargs["memory_format"] == "auto" for _, _, kwargs in calls)  # (issue 29: fit's default)


def test_bench_flags_reach_the_rows_and_the_scaling_curve(calls):
    argv = ["bench", "--batches", "32", "--replicas", "4", "--images", "128", "--rounds", "2", "--rows", "limit",
            "DDP", "--scaling", "1,2,4", "--memory-format", "preserve"]
    assert cli.main(argv) == 0
    assert calls == [("compare", (32, 4, 128, 2), {"rows": ["limit", "DDP"], "memory_format": "preserve"}),
                     ("scaling", (32, [1, 2, 4], 128, 2), {})]


@pytest.mark.parametrize("argv, message", [
    (["bench", "--scaling", "1,two"], "--scaling '1,two' is not a list of replica counts"),
    (["bench", "--batches", "2", "--replicas", "4"], "--batches 2 is smaller than --replicas 4"),
    (["bench", "--images", "100"], "--images 100 is less than one batch of 256"),
])
def test_bench_bad_flags_are_one_line_and_status_2(calls, capsys, argv, message):
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("mirrored bench: error: ") and message in err and err.count("\n") == 1
    assert calls == []
