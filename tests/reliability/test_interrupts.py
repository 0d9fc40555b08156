"""Ctrl-C stops every replica (issue 17): KeyboardInterrupt reaches the caller only once every replica
is quiescent, with the step applied on all replicas (one Ctrl-C: the step finishes) or on none (a
second Ctrl-C before the gradient all-reduce); a `model.save()` in the handler is safe, and a run
with BackupAndRestore resumes exactly.

Each scenario runs in a child process (real SIGINT, sent by a thread of the child while replica 0 is
inside its forward pass), so an interrupt can never reach pytest. The child prints one JSON line;
every wait is bounded (`CHILD_TIMEOUT_S`). Trials use random delays; their seeds are printed.
"""
from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

CHILD_TIMEOUT_S = 90
GLOBAL = 8
STEPS = 6


def _child(scenario: str, *args: str) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, __file__, scenario, *args], capture_output=True, text=True,
                          timeout=CHILD_TIMEOUT_S, env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_one_interrupt_finishes_the_step_on_every_replica(seed):
    print(f"seed {seed}")
    out = _child("once", str(seed))
    assert out["raised"] == "KeyboardInterrupt"
    assert out["unchanged_after_raise"], "weights changed after fit raised: a replica was still running"
    assert out["in_sync"] and out["grads_none"]
    assert out["equals_clean_after"] == out["steps_done"]  # the interrupted step applied, on every replica
    assert out["saved_and_loaded"]


@pytest.mark.parametrize("seed", [0, 1])
def test_two_interrupts_abandon_the_step_on_every_replica(seed):
    print(f"seed {seed}")
    out = _child("twice", str(seed))
    assert out["raised"] == "KeyboardInterrupt"
    assert out["unchanged_after_raise"] and out["in_sync"] and out["grads_none"]
    assert out["equals_clean_after"] == out["steps_done"] - 1  # the abandoned step applied nowhere
    assert out["run_works_after"]


def test_an_interrupted_run_with_backup_and_restore_resumes_exactly(tmp_path):
    out = _child("backup", str(tmp_path))
    assert out["first_raised"] == "KeyboardInterrupt"
    assert out["resumed_equals_clean"]


# ---- the child process ------------------------------------------------------------------------------
def _scenario(name: str, arg: str) -> dict:
    import numpy as np
    import torch

    import mirrored as mr

    torch.manual_seed(0)
    x, y = torch.randn(GLOBAL * STEPS, 5), torch.randint(0, 3, (GLOBAL * STEPS,))
    in_forward = threading.Event()
    state = {"slow_at": None, "calls": 0}

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.body = torch.nn.Sequential(torch.nn.Linear(5, 8), torch.nn.BatchNorm1d(8), torch.nn.ReLU(),
                                            torch.nn.Linear(8, 3))

        def forward(self, inputs):
            ctx = mr.get_replica_context()
            if self.training and ctx is not None and ctx.replica_id_in_sync_group == 0:
                state["calls"] += 1
                if state["calls"] == state["slow_at"]:
                    in_forward.set()
                    time.sleep(0.6)  # the interrupt lands while replica 0 computes and replica 1 waits
            return self.body(inputs)

    def model_of():
        torch.manual_seed(1)
        with mr.MirroredStrategy(devices=["cpu:0", "cpu:1"], timeout_s=30).scope():
            model = mr.Model(Net())
            model.compile(optimizer=mr.optimizers.SGD(learning_rate=0.1, momentum=0.9),
                          loss="sparse_categorical_crossentropy", metrics=["accuracy"])
        return model

    def ds(n=STEPS):
        return mr.data.Dataset.from_tensor_slices((x[:GLOBAL * n], y[:GLOBAL * n])).batch(GLOBAL)

    def interrupt_when_in_forward(times: int, delay_s: float) -> threading.Thread:
        def send():
            if in_forward.wait(timeout=30):
                for _ in range(times):
                    time.sleep(delay_s)
                    os.kill(os.getpid(), signal.SIGINT)
        t = threading.Thread(target=send, daemon=True)
        t.start()
        return t

    def clean_after(n: int) -> list:
        state["slow_at"] = None
        ref = model_of()
        ref.fit(ds(n), epochs=1, verbose=0, shuffle=False)
        return ref.get_weights()

    def same(a, b) -> bool:
        return all(np.array_equal(u, v) for u, v in zip(a, b))

    if name in ("once", "twice"):
        rng = random.Random(int(arg))
        step = rng.randrange(2, STEPS)  # 1-based: the step interrupted
        times = 1 if name == "once" else 2
        model = model_of()
        state["slow_at"], state["calls"] = step, 0
        sender = interrupt_when_in_forward(times, delay_s=rng.uniform(0.02, 0.15))
        raised = None
        try:
            model.fit(ds(), epochs=1, verbose=0, shuffle=False)
        except KeyboardInterrupt as e:
            raised = type(e).__name__
            right_after = model.get_weights()
            time.sleep(0.8)  # a replica still running would change them now
            unchanged = same(right_after, model.get_weights())
            path = Path(os.environ.get("TMPDIR", "/tmp")) / f"interrupted-{os.getpid()}.safetensors"
            model.save(path)  # safe in the handler: nothing runs behind it
            loaded = mr.Model.load(path, module=Net())
            saved_and_loaded = same(loaded.get_weights(), right_after)
            path.unlink()
        sender.join(timeout=30)
        weights = model.get_weights()
        try:
            model.check_in_sync()
            in_sync = True
        except mr.OutOfSyncError:
            in_sync = False
        grads_none = all(p.grad is None for m in model.replicas for p in m.parameters())
        run_works = model.distribute_strategy.run(lambda: 1) == 1
        equal_after = next((n for n in (step, step - 1) if same(weights, clean_after(n))), None)
        return {"raised": raised, "unchanged_after_raise": raised is not None and unchanged, "in_sync": in_sync,
                "grads_none": grads_none, "steps_done": step, "equals_clean_after": equal_after,
                "saved_and_loaded": raised is not None and saved_and_loaded, "run_works_after": run_works}

    if name == "backup":
        backup = Path(arg) / "backup"
        clean = clean_after(STEPS)
        model = model_of()
        state["slow_at"], state["calls"] = 4, 0
        sender = interrupt_when_in_forward(1, delay_s=0.05)
        first = None
        try:
            model.fit(ds(), epochs=1, verbose=0, shuffle=False,
                      callbacks=[mr.callbacks.BackupAndRestore(backup, save_freq=1)])
        except KeyboardInterrupt as e:
            first = type(e).__name__
        sender.join(timeout=30)
        state["slow_at"] = None
        resumed = model_of()
        resumed.fit(ds(), epochs=1, verbose=0, shuffle=False,
                    callbacks=[mr.callbacks.BackupAndRestore(backup, save_freq=1)])
        return {"first_raised": first, "resumed_equals_clean": same(resumed.get_weights(), clean)}
    raise SystemExit(f"unknown scenario {name}")


if __name__ == "__main__":
    # A process started with SIGINT ignored (by nohup, or `make test &`, whose children inherit it) gets
    # no KeyboardInterrupt from Python: the scenarios need Python's own handler, whoever started pytest.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    print(json.dumps(_scenario(sys.argv[1], sys.argv[2])))
