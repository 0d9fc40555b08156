"""`mirrored train` under torchrun (issue 24): one job of MultiWorkerMirroredStrategy, not N separate runs.

The torchrun runs are slow (two worker processes train the digits on a shared CPU); the fast test checks
the flag that is refused under a launcher, before any process group is joined."""
from __future__ import annotations

import csv
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from mirrored import cli

LAUNCH_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
DEADLINE_S = 400.0


def _torchrun(*argv: str) -> list[str]:
    torchrun = Path(sys.executable).with_name("torchrun")
    return [str(torchrun), "--standalone", "--nproc_per_node=2", "-m", "mirrored", *argv]


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in LAUNCH_ENV and not k.startswith("TORCHELASTIC_")}
    env.update(CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1")
    return env


def test_replicas_flag_under_a_launcher_is_a_one_line_error(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "29500")
    assert cli.main(["train", "--replicas", "2", "--out", str(tmp_path)]) == 2
    assert "--replicas 2: this process is one worker of a job started by a launcher" in capsys.readouterr().err


def test_an_incomplete_launch_is_a_one_line_error(tmp_path, monkeypatch, capsys):
    """Issue 24 (the launch resolver beside the CLI): RANK without MASTER_ADDR/MASTER_PORT was a
    traceback out of `mirrored train`; it is the resolver's message on one line."""
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.delenv("MASTER_ADDR", raising=False)
    monkeypatch.delenv("MASTER_PORT", raising=False)
    assert cli.main(["train", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "RANK=0 is set but MASTER_ADDR, MASTER_PORT are not" in err and "Traceback" not in err


@pytest.mark.slow
def test_train_under_torchrun_is_one_job_writing_one_log(tmp_path):
    """Two workers: one "replicas" line saying 2 replicas on 2 workers, global batch 64 (32 per replica),
    one CSV header and one row per epoch, one progress line per epoch, run.json with 2 replicas."""
    out = tmp_path / "run"
    done = subprocess.run(_torchrun("train", "--epochs", "2", "--verbose", "2", "--out", str(out)),
                          capture_output=True, text=True, env=_env(), timeout=DEADLINE_S)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert done.stdout.count("replicas: 2 (2 workers, each on cpu:0)") == 1, done.stdout
    assert "global batch 64 (32, 32 per replica)" in done.stdout
    assert done.stdout.count("Epoch 1/2") == 1 and done.stdout.count("Epoch 2/2") == 1, done.stdout
    assert done.stdout.count("test_accuracy") == 1, done.stdout
    with open(out / "log.csv", newline="") as f:
        rows = list(csv.reader(f))
    assert rows[0][0] == "epoch" and [r[0] for r in rows[1:]] == ["0", "1"], rows
    run = json.loads((out / "run.json").read_text())
    assert run["replicas"] == 2 and run["workers"] == 2
    assert not (out / "backup").exists()


@pytest.mark.slow
def test_train_under_torchrun_resumes_a_killed_job(tmp_path):
    """The job is stopped (torchrun and its workers) once the chief's backup exists; `--resume` under
    torchrun continues from it: the log ends with one row per epoch, the first ones kept."""
    out = tmp_path / "run"
    argv = _torchrun("train", "--epochs", "3", "--verbose", "2", "--out", str(out))
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=_env(),
                            start_new_session=True)
    try:
        deadline = time.monotonic() + DEADLINE_S
        while not (out / "backup" / "training_state.safetensors").exists():
            assert proc.poll() is None, proc.communicate()[0][-3000:]
            assert time.monotonic() < deadline, f"no backup was written within {DEADLINE_S:g} s"
            time.sleep(0.2)
    finally:
        # torchrun starts each worker in a session of its own, so it is torchrun that stops them: on SIGTERM
        # it kills its workers and exits.
        proc.send_signal(signal.SIGTERM)
        try:
            proc.communicate(timeout=60)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.communicate(timeout=60)
    epochs_done = len(list(csv.DictReader(open(out / "log.csv"))))
    assert 1 <= epochs_done < 3
    resumed = subprocess.run(_torchrun("train", "--epochs", "3", "--verbose", "2", "--resume", "--out", str(out)),
                             capture_output=True, text=True, env=_env(), timeout=DEADLINE_S)
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    rows = list(csv.DictReader(open(out / "log.csv")))
    assert [int(r["epoch"]) for r in rows] == [0, 1, 2]
    assert resumed.stdout.count("Epoch ") == 3 - epochs_done, resumed.stdout
