"""Worker processes for the multi-worker tests: start a test module as a script once per environment,
wait for them within a deadline, kill whatever still runs, and read their logs and result files.

The test modules run themselves as the workers (`python <module> <scenario> <out_dir>`); each worker
logs to `<name>.log` and writes `<name>.json` in out_dir (a dict, with "crash" holding a traceback
where it raised)."""
from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_workers(script: str, scenario: str, out_dir: Path, envs: list[dict[str, str]], names: list[str],
                deadline_s: float, wait_for: list[int] | None = None) -> list[int | None]:
    """Runs `script scenario out_dir` once per environment, worker i logging to names[i].log; returns
    their exit codes (None: killed while still running after the workers in `wait_for`, default all,
    had finished). Every worker is dead when this returns."""
    procs: list[subprocess.Popen] = []
    try:
        for env, name in zip(envs, names):
            with open(out_dir / f"{name}.log", "w") as log:
                procs.append(subprocess.Popen([sys.executable, script, scenario, str(out_dir)], env=env,
                                              stdout=log, stderr=subprocess.STDOUT))
        deadline = time.monotonic() + deadline_s
        for i in range(len(procs)) if wait_for is None else wait_for:
            try:
                procs[i].wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pytest.fail(f"{scenario}: {names[i]} still ran after {deadline_s:g} s\n{log_tails(out_dir, names)}")
        return [p.poll() for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait()


def log_tails(out_dir: Path, names: list[str]) -> str:
    """The tail of each worker's output, for assertion messages (a worker never started has none)."""
    paths = [out_dir / f"{name}.log" for name in names]
    return "\n".join(f"--- {name} ---\n{p.read_text()[-3000:] if p.exists() else '(no log)'}"
                     for name, p in zip(names, paths))


def read_results(out_dir: Path, names: list[str]) -> list[dict]:
    """Each worker's result file, failing the test where one is missing or holds a crash."""
    out = []
    for name in names:
        path = out_dir / f"{name}.json"
        assert path.exists(), f"{name} wrote no results\n{log_tails(out_dir, names)}"
        res = json.loads(path.read_text())
        assert "crash" not in res, f"{name} raised:\n{res['crash']}"
        out.append(res)
    return out
