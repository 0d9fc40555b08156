"""Issue 36: multi-worker jobs that come back with another number of workers. fit with BackupAndRestore on 2
workers, stopped and resumed on 1 (a cluster that came back smaller) and the other way round (larger); and
torchrun's elastic form (`--nnodes=1:2`, c10d rendezvous, `--max-restarts`): a machine lost mid-epoch (its
agent and worker SIGKILLed) and the survivor's job restarting on 1 worker, or a machine joining a job that
runs alone and the job restarting on 2. The script batches by per-replica size x num_replicas_in_sync, so
the global batch changes with the count, and the backup's place in the data, counted in examples, must
still put every example of the interrupted pass in exactly one step.

The reference is plain PyTorch on one device, fed the example order of the pipeline (its shuffle,
unbatched) cut into the batches each run trained: batches of its global size from where it resumed (the
rest of the batch that position falls in first), until the backup the next run resumed from. The workers
must equal each other bitwise; the reference within 2e-6 (the gradient sums of 2 workers add in another
order than one device's, ~1 ulp a step, over 24 steps of a net whose weights stay near 1).

Workers and agents run this file: `python test_multi_worker_elastic.py fit OUT_DIR`.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import traceback
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from _workers import free_port, log_tails, read_results, run_workers  # tests/distribute/_workers.py

N, PER_REPLICA, EPOCHS = 24, 3, 3  # 8 steps an epoch on 1 worker, 4 on 2
DEADLINE_S = 240.0
LAUNCH_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "TF_CONFIG",
               "GROUP_RANK", "ROLE_RANK", "GROUP_WORLD_SIZE", "ROLE_WORLD_SIZE")


# ---- shared by the workers and the reference -------------------------------------------------------------
def data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(N, 5, generator=g), torch.randint(0, 3, (N,), generator=g)


def net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 3))


def reference(segments: list[tuple[int, tuple[int, int]]]) -> list[torch.Tensor]:
    """Plain PyTorch on one device. `segments`: (global batch, (epoch, examples) where that run resumed), in
    order, the first from (0, 0); each run trains until the next one's start."""
    import mirrored as mr

    ds = mr.data.Dataset.from_tensor_slices(torch.arange(N)).shuffle(N, seed=3)
    orders = [[int(i) for i in ds] for _ in range(EPOCHS)]  # the pipeline's example order in each pass
    x, y = data()
    model = net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    def normal(position: tuple[int, int]) -> tuple[int, int]:  # (a backup after an epoch's last step, before its end)
        return (position[0] + 1, 0) if position[1] == N else tuple(position)

    segments = [(size, normal(start)) for size, start in segments]
    ends = [start for _, start in segments[1:]] + [(EPOCHS, 0)]
    for (size, (epoch, at)), end in zip(segments, ends):
        while (epoch, at) < end:
            upto = min((at // size + 1) * size, N)  # the rest of the batch of `size` that `at` falls in
            idx = torch.tensor(orders[epoch][at:upto])
            F.cross_entropy(model(x[idx]), y[idx]).backward()
            opt.step()
            opt.zero_grad()
            epoch, at = (epoch + 1, 0) if upto == N else (epoch, upto)
        assert (epoch, at) == end, f"a backup at {end} is not between two steps of batch size {size}"
    return [p.detach() for p in model.parameters()]


def clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if k not in LAUNCH_VARS and not k.startswith(("TORCHELASTIC_", "SLURM_"))}
    return {**env, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": "", **extra}


def params_of(path: Path) -> list[torch.Tensor]:
    from safetensors.torch import load_file

    saved = load_file(str(path))
    return [saved[str(j)] for j in range(len(saved))]


def check(got: list[torch.Tensor], want: list[torch.Tensor], what: str) -> None:
    for j, (g, w) in enumerate(zip(got, want)):
        torch.testing.assert_close(g, w, rtol=0, atol=2e-6, msg=lambda m: f"{what}, parameter {j}: {m}")


# ---- hand-launched workers: 2 -> 1 and 1 -> 2 ------------------------------------------------------------------
def run(out: Path, workers: int, **extra: str) -> None:
    """The fit scenario on `workers` processes (1: no launcher, a single worker) writing into `out`, with the
    backup in out's parent."""
    out.mkdir(parents=True)
    port = free_port()
    envs = [clean_env(WORKER_NAME=f"w{r}", **extra, **({"RANK": str(r), "WORLD_SIZE": str(workers),
                                                         "LOCAL_RANK": str(r), "MASTER_ADDR": "127.0.0.1",
                                                         "MASTER_PORT": str(port)} if workers > 1 else {}))
            for r in range(workers)]
    names = [f"w{r}" for r in range(workers)]
    codes = run_workers(__file__, "fit", out, envs, names, DEADLINE_S)
    assert codes == [0] * workers, log_tails(out, names)


@pytest.mark.parametrize("first, then, stop, position", [(2, 1, 5, (1, 6)), (1, 2, 9, (1, 3)), (1, 2, 6, (0, 18))])
def test_fit_stopped_on_some_workers_resumes_on_another_number(tmp_path, first, then, stop, position):
    """A backup every step. 2 workers (global batch 6, 4 steps an epoch) stop after their 5th step (epoch 2,
    6 examples in) and 1 worker (global batch 3) resumes there and finishes; or 1 worker stops after its 9th
    step (epoch 2, 3 examples in) and 2 workers resume inside a batch of 6: its last 3 examples first; or
    after its 6th (epoch 1, 18 in: a step past the 4 of an epoch on 2 workers, which the backup's check
    refused until the place in the data was counted in examples)."""
    run(tmp_path / "first", first, STOP_AFTER=str(stop), SAVE_FREQ="1")
    assert all(r["stopped"] for r in read_results(tmp_path / "first", [f"w{r}" for r in range(first)]))
    run(tmp_path / "then", then, SAVE_FREQ="1")
    res = read_results(tmp_path / "then", [f"w{r}" for r in range(then)])
    assert [(r["num_workers"], r["resumed_from"]) for r in res] == [(then, list(position))] * then, res
    want = reference([(PER_REPLICA * first, (0, 0)), (PER_REPLICA * then, position)])
    for r in range(then):
        check(params_of(tmp_path / "then" / f"w{r}.safetensors"), want, f"worker {r} of {then}")
    if then == 2:
        assert all(torch.equal(a, b) for a, b in zip(params_of(tmp_path / "then" / "w0.safetensors"),
                                                      params_of(tmp_path / "then" / "w1.safetensors")))


# ---- torchrun --nnodes=1:2: a machine lost, a machine joining -------------------------------------------------
def agent(out: Path, name: str, endpoint: str, host: bool, last_call_s: float, **extra: str) -> subprocess.Popen:
    """One torchrun agent ("machine") of an elastic job of 1 to 2 machines, 1 worker each, on 127.0.0.1."""
    exe = Path(sys.executable).with_name("torchrun")
    conf = (f"is_host={'true' if host else 'false'},join_timeout=120,last_call_timeout={last_call_s:g},"
            "close_timeout=30,keep_alive_interval=1,keep_alive_max_attempt=3")
    with open(out / f"{name}.agent.log", "w") as log:
        return subprocess.Popen([str(exe), "--nnodes=1:2", "--nproc-per-node=1", "--max-restarts=3",
                                 "--rdzv-backend=c10d", f"--rdzv-endpoint={endpoint}", "--rdzv-id=issue36",
                                 f"--rdzv-conf={conf}", "--monitor-interval=0.5", __file__, "fit", str(out)],
                                env=clean_env(SAVE_FREQ="1", **extra), stdout=log, stderr=subprocess.STDOUT)


def agent_logs(out: Path) -> str:
    return "\n".join(f"--- {p.name} ---\n{p.read_text()[-4000:]}" for p in sorted(out.glob("*.log")))


def wait_all(procs: list[subprocess.Popen], out: Path) -> list[int]:
    deadline = time.monotonic() + DEADLINE_S
    try:
        for p in procs:
            p.wait(timeout=max(0.1, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        pytest.fail(f"the elastic job still ran after {DEADLINE_S:g} s\n{agent_logs(out)}")
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait()
    return [p.returncode for p in procs]


def starts(out: Path) -> list[dict]:
    """Every start of a worker, in order: its world size, rank, the agent's restart count, where it resumed."""
    return [json.loads(line) for line in (out / "starts.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_a_machine_lost_under_nnodes_1_to_2_resumes_on_the_survivor(tmp_path):
    """The issue's elastic run: 2 agents (the first hosts the c10d store), 1 worker each, a backup every step.
    After the 6th step (epoch 2, 12 examples in, its backup written) the second machine's worker SIGKILLs its
    agent and itself. The survivor's worker fails its next collective, its agent restarts it, the rendezvous
    closes with 1 machine, and fit resumes from the backup on 1 worker, with a global batch of 3."""
    endpoint = f"127.0.0.1:{free_port()}"
    survivor = agent(tmp_path, "a", endpoint, True, 10)
    lost = agent(tmp_path, "b", endpoint, False, 10, ELASTIC_VICTIM_AFTER="6")
    codes = wait_all([survivor, lost], tmp_path)
    assert codes[0] == 0 and codes[1] == -signal.SIGKILL, (codes, agent_logs(tmp_path))
    seen = starts(tmp_path)
    assert [s["world"] for s in seen[:2]] == [2, 2], seen  # both machines were in the first round
    last = seen[-1]
    assert last["world"] == 1 and last["restart"] >= 1 and last["resumed_from"] == [1, 12], seen
    (final,) = read_results(tmp_path, ["rank0"]) if (tmp_path / "rank0.json").exists() else [None]
    assert final is not None and final["num_workers"] == 1, agent_logs(tmp_path)
    check(params_of(tmp_path / "rank0.safetensors"), reference([(6, (0, 0)), (3, (1, 12))]), "the survivor")


@pytest.mark.slow
def test_a_machine_joining_under_nnodes_1_to_2_resumes_on_the_larger_count(tmp_path):
    """A job of 1 machine runs alone (a backup every step, slowed to ~0.4 s a step); once it has trained 3 steps
    a second agent joins. The first agent restarts its worker for the new round, and fit resumes from the
    backup on 2 workers, with a global batch of 6, both ending equal to the reference bitwise."""
    endpoint = f"127.0.0.1:{free_port()}"
    # torch 2.13's agents share their rendezvous store with the workers by default, and the first round's rank 0
    # keeps its bootstrap address without publishing it for the next round: a machine that joins later waits for
    # it until a timeout (pytorch#147064). The guide's recipe turns the sharing off, as here.
    unshared = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
    alone = agent(tmp_path, "a", endpoint, True, 1, SLOW_STEP_S="0.4", **unshared)
    procs = [alone]
    try:
        deadline = time.monotonic() + 120
        while not (tmp_path / "trained3").exists():
            assert alone.poll() is None and time.monotonic() < deadline, agent_logs(tmp_path)
            time.sleep(0.1)
        procs.append(agent(tmp_path, "b", endpoint, False, 1, SLOW_STEP_S="0.4", **unshared))
    finally:
        codes = wait_all(procs, tmp_path)
    assert codes == [0, 0], (codes, agent_logs(tmp_path))
    seen = starts(tmp_path)
    assert seen[0]["world"] == 1 and [s["world"] for s in seen[-2:]] == [2, 2], seen
    epoch, at = seen[-1]["resumed_from"]
    assert (epoch, at) > (0, 6) and seen[-2]["resumed_from"] == [epoch, at], seen  # resumed, past step 2
    want = reference([(3, (0, 0)), (6, (epoch, at))])
    got = [params_of(tmp_path / f"rank{r}.safetensors") for r in (0, 1)]
    check(got[0], want, "rank 0 after the join")
    assert all(torch.equal(a, b) for a, b in zip(*got)), "rank 1 against rank 0"


# ---- the worker side ---------------------------------------------------------------------------------------------
class _Stop(Exception):
    pass


def scenario_fit(out: Path) -> dict:
    import mirrored as mr
    from mirrored.training.checkpoint import load_checkpoint

    strategy = mr.MultiWorkerMirroredStrategy(devices=["cpu:0"], timeout_s=20.0)
    resolver = strategy.cluster_resolver
    backup = out.parent / "backup" if os.environ.get("WORKER_NAME") else out / "backup"
    resumed_from = None
    if (backup / "training_state.safetensors").exists():
        state = load_checkpoint(backup / "training_state.safetensors")[1]["objects"]["fit"]["state"]
        resumed_from = [state["epoch"], state["data"]["examples"]]
    if os.environ.get("RANK") is not None and os.environ.get("TORCHELASTIC_RUN_ID"):
        with open(out / "starts.jsonl", "a") as f:
            f.write(json.dumps({"world": resolver.num_workers, "rank": resolver.rank, "restart":
                                resolver.restart_count, "resumed_from": resumed_from}) + "\n")
    stop_after = int(os.environ.get("STOP_AFTER", "-1"))
    victim_after = int(os.environ.get("ELASTIC_VICTIM_AFTER", "-1"))
    slow = float(os.environ.get("SLOW_STEP_S", "0"))

    class Events(mr.callbacks.Callback):
        batches = 0

        def on_train_batch_end(self, batch, logs=None):
            Events.batches += 1
            if Events.batches == 3:
                (out / "trained3").touch()
            if Events.batches == stop_after:
                raise _Stop
            if Events.batches == victim_after and resolver.restart_count == 0:
                os.kill(os.getppid(), signal.SIGKILL)  # the machine goes: its agent, then its worker
                os.kill(os.getpid(), signal.SIGKILL)
            if slow and resolver.num_workers == 1:
                time.sleep(slow)

    x, y = data()
    with strategy.scope():
        model = mr.Model(net())
        model.compile(optimizer=mr.optimizers.SGD(learning_rate=0.1, momentum=0.9),
                      loss="sparse_categorical_crossentropy")
    global_batch = PER_REPLICA * strategy.num_replicas_in_sync  # (changes with the count, as users write it)
    ds = mr.data.Dataset.from_tensor_slices((x, y)).shuffle(N, seed=3).batch(global_batch)
    try:
        model.fit(ds, epochs=EPOCHS, verbose=0, callbacks=[
            mr.callbacks.BackupAndRestore(backup, save_freq=int(os.environ.get("SAVE_FREQ", "2"))), Events()])
    except _Stop:
        return {"stopped": True}
    from safetensors.torch import save_file

    name = os.environ.get("WORKER_NAME") or f"rank{resolver.rank}"
    save_file({str(j): p.detach().contiguous() for j, p in enumerate(model.module.parameters())},
              str(out / f"{name}.safetensors"))
    return {"stopped": False, "num_workers": resolver.num_workers, "resumed_from": resumed_from}


def _worker_main(scenario: str, out: str) -> None:
    out_dir = Path(out)
    name = os.environ.get("WORKER_NAME") or f"rank{os.environ.get('RANK', '0')}"
    try:
        result = {"fit": scenario_fit}[scenario](out_dir)
    except BaseException:  # noqa: BLE001 - reported through the results file, and the exit code for torchrun
        result = {"crash": traceback.format_exc()}
        traceback.print_exc()
    (out_dir / f"{name}.json").write_text(json.dumps(result))
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(1 if "crash" in result else 0)  # (tearing down a gloo group whose peer left can abort)


if __name__ == "__main__":
    _worker_main(sys.argv[1], sys.argv[2])
