"""Issue 24: MultiWorkerMirroredStrategy as users launch it - TF_CONFIG and SLURM variables set by
hand on 127.0.0.1, torchrun with --max-restarts and a worker killed by SIGKILL, and several CPU
replicas per worker. Reference runs are MirroredStrategy's replicas in this process and plain
PyTorch; the resolver's parsing is checked against the variables' documented meaning.

Worker processes run this file: `python test_multi_worker_launch.py SCENARIO OUT_DIR`.
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

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import mirrored.distribute as md
from mirrored.distribute import cluster_resolver as cr
from _workers import free_port, log_tails, read_results, run_workers  # tests/distribute/_workers.py

LAUNCH_DEADLINE_S = 150.0  # a launch's workers are killed after this, whatever they are doing
COLLECTIVE_TIMEOUT_S = 60.0
HANG_TIMEOUT_S = 2.0  # the strategy's timeout where a worker hangs on purpose
N_EXAMPLES, GLOBAL_BATCH, EPOCHS = 22, 8, 2  # global batches 8, 8, 6: over 4 replicas 2/2/2/2 and 2/2/2/0
LAUNCH_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "TF_CONFIG",
               "GROUP_RANK", "ROLE_RANK", "GROUP_WORLD_SIZE", "ROLE_WORLD_SIZE")


# ---- the resolver, on scripted environments -----------------------------------------------------------
def test_torchrun_variables():
    env = {"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "10.0.0.1",
           "MASTER_PORT": "29500", "TORCHELASTIC_RUN_ID": "job", "TORCHELASTIC_RESTART_COUNT": "2",
           "TORCHELASTIC_USE_AGENT_STORE": "True", "TF_CONFIG": "not even json", "SLURM_PROCID": "0"}
    r = cr.resolve(env)  # torchrun wins over TF_CONFIG and SLURM (torchrun inside srun)
    assert (r.kind, r.task_type, r.task_id, r.rank, r.num_workers) == ("torchrun", "worker", 3, 3, 4)
    assert (r.local_rank, r.local_world_size, r.restart_count, r.uses_agent_store) == (1, 2, 2, True)
    assert r.master() == "10.0.0.1:29500" and not r.is_chief
    assert cr.resolve({}).kind == "single" and cr.resolve({}).is_chief


def test_a_ray_train_worker_is_named_ray():
    """Issue 36: Ray Train's TorchTrainer sets torchrun's variables in its workers (as measured in Ray 2.60) and
    creates the process group before the training function runs; Ray gives every worker RAY_RAYLET_PID and
    RAY_JOB_ID. Joined as an existing group or resolved from the variables, the launcher is "ray"."""
    ray = {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2", "NODE_RANK": "0",
           "MASTER_ADDR": "192.0.2.2", "MASTER_PORT": "55033", "RAY_RAYLET_PID": "11321", "RAY_JOB_ID": "01000000"}
    joined = cr.from_process_group(1, 2, ray)
    assert (joined.kind, joined.rank, joined.num_workers, joined.local_rank, joined.local_world_size) == (
        "ray", 1, 2, 1, 2)
    assert joined.master() == "192.0.2.2:55033" and not joined.is_chief
    assert cr.resolve(ray).kind == "ray"
    plain = {k: v for k, v in ray.items() if not k.startswith("RAY_")}
    assert cr.from_process_group(1, 2, plain).kind == "process_group" and cr.resolve(plain).kind == "environment"
    # torchrun inside a Ray task is still torchrun
    assert cr.resolve({**ray, "TORCHELASTIC_RUN_ID": "job"}).kind == "torchrun"


def test_tf_config_chief_then_workers():
    """TF numbers the chief first, then the workers by index; the chief's address is the master."""
    cluster = {"chief": ["boss:5000"], "worker": ["w0:2222", "w1:2222"], "evaluator": ["ev:1"]}
    ranks = {}
    for task_type, index in [("chief", 0), ("worker", 0), ("worker", 1)]:
        r = cr.resolve({"TF_CONFIG": json.dumps({"cluster": cluster, "task": {"type": task_type, "index": index}})})
        assert (r.kind, r.task_type, r.task_id, r.num_workers, r.master()) == ("tf_config", task_type, index, 3,
                                                                               "boss:5000")
        ranks[(task_type, index)] = r.rank
        assert r.cluster_spec() == {"chief": ["boss:5000"], "worker": ["w0:2222", "w1:2222"]}
    assert ranks == {("chief", 0): 0, ("worker", 0): 1, ("worker", 1): 2}
    no_chief = {"cluster": {"worker": ["w0:2222", "w1:3333"]}, "task": {"type": "worker", "index": 1},
                "rpc_layer": "grpc"}
    r = cr.resolve({"TF_CONFIG": json.dumps(no_chief)})
    assert (r.rank, r.master(), r.rpc_layer, r.is_chief) == (1, "w0:2222", "grpc", False)


@pytest.mark.parametrize("config, words", [
    ({"cluster": {"worker": ["a:1", "b:1"], "ps": ["p:1"]}, "task": {"type": "worker", "index": 0}}, "has ps tasks"),
    ({"cluster": {"worker": ["a:1", "b:1"]}, "task": {"type": "worker", "index": 2}}, "is not in its cluster"),
    ({"cluster": {"worker": ["a", "b:1"]}, "task": {"type": "worker", "index": 1}}, "is not \"host:port\""),
    ({"cluster": {"worker": ["a:1", "b:1"], "evaluator": ["e:1"]}, "task": {"type": "evaluator", "index": 0}},
     "is the \"evaluator\""),
])
def test_tf_config_errors_name_the_problem(config, words):
    with pytest.raises(ValueError, match=f"TF_CONFIG.*{words}"):
        cr.resolve({"TF_CONFIG": json.dumps(config)})


def test_slurm_variables():
    env = {"SLURM_PROCID": "5", "SLURM_NTASKS": "8", "SLURM_LOCALID": "1", "SLURM_STEP_ID": "0",
           "SLURM_JOB_ID": "123456", "SLURM_JOB_NODELIST": "gpu[007-009,012],login1",
           "SLURM_STEP_TASKS_PER_NODE": "2(x3),1,1", "SLURM_NODEID": "2"}
    r = cr.resolve(env)
    assert (r.kind, r.task_type, r.rank, r.num_workers, r.local_rank, r.local_world_size) == ("slurm", "worker", 5,
                                                                                                8, 1, 2)
    assert r.master_addr == "gpu007"  # the first node
    assert r.master_port == 15000 + 123456 % 15000  # the same on every task of the job
    assert r.cluster_spec() == {"worker": ["gpu007", "gpu008", "gpu009", "gpu012", "login1"]}
    assert cr.resolve({**env, "MASTER_PORT": "4000", "MASTER_ADDR": "h"}).master() == "h:4000"
    # The batch script itself (no srun step) is one worker, whatever SLURM_NTASKS says.
    assert cr.resolve({k: v for k, v in env.items() if k != "SLURM_STEP_ID"}).kind == "single"


def test_slurm_host_lists():
    assert cr.expand_hostlist("n[1-2],m5,o[3-4,6,7-9]") == ["n1", "n2", "m5", "o3", "o4", "o6", "o7", "o8", "o9"]
    assert cr.expand_hostlist("rack[1-2]-n[01-02]") == ["rack1-n01", "rack1-n02", "rack2-n01", "rack2-n02"]
    assert cr.expand_hostlist("127.0.0.1") == ["127.0.0.1"]
    for bad, words in [("n[1-", "unbalanced brackets"), ("n[3-1]", "cannot read the range '3-1'"),
                       ("n[a-b]", "cannot read the range 'a-b'")]:
        with pytest.raises(ValueError, match=f"SLURM_JOB_NODELIST='{re_escape(bad)}'.*{words}"):
            cr.resolve({"SLURM_PROCID": "0", "SLURM_NTASKS": "2", "SLURM_STEP_ID": "0", "SLURM_JOB_ID": "1",
                        "SLURM_JOB_NODELIST": bad})


@pytest.mark.parametrize("env, words", [
    ({"RANK": "0"}, "RANK=0 is set but WORLD_SIZE, MASTER_ADDR, MASTER_PORT are not"),
    ({"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "h", "MASTER_PORT": "99999"}, "MASTER_PORT=99999 is not a TCP"),
    ({"RANK": "0", "WORLD_SIZE": "two"}, "WORLD_SIZE='two' is not an integer"),
    ({"SLURM_PROCID": "2", "SLURM_NTASKS": "2", "SLURM_STEP_ID": "0"}, r"SLURM_PROCID=2 is outside \[0, SLURM_NTASKS=2"),
    ({"SLURM_PROCID": "0", "SLURM_NTASKS": "2", "SLURM_STEP_ID": "0"}, "neither SLURM_JOB_NODELIST nor MASTER_ADDR"),
    ({"SLURM_PROCID": "0", "SLURM_NTASKS": "2", "SLURM_STEP_ID": "0", "SLURM_JOB_NODELIST": "n1"},
     "neither MASTER_PORT nor SLURM_JOB_ID"),
    ({"SLURM_PROCID": "0", "SLURM_NTASKS": "2", "SLURM_STEP_ID": "0", "SLURM_JOB_NODELIST": "n1", "SLURM_JOB_ID": "1",
      "SLURM_TASKS_PER_NODE": "2(3)"}, r"SLURM_TASKS_PER_NODE='2\(3\)': cannot read"),
])
def test_malformed_launches_name_the_variable(env, words):
    with pytest.raises(ValueError, match=words):
        cr.resolve(env)


def test_default_devices_split_the_machines_gpus(monkeypatch):
    """Without devices=, a worker takes its share of its machine's GPUs: all of them for one process
    per machine, cuda:LOCAL_RANK for one per GPU, an even split in between; a SLURM task bound to its
    GPUs takes those it sees. (GPUs are faked: only the choice is checked.)"""
    from mirrored.distribute import multi_worker as mw

    gpus = [f"cuda:{i}" for i in range(8)]
    monkeypatch.setattr(mw, "visible_gpus", lambda: list(gpus))
    torchrun = {"WORLD_SIZE": "16", "MASTER_ADDR": "h", "MASTER_PORT": "1", "TORCHELASTIC_RUN_ID": "x"}

    def chosen(**env: str) -> tuple[str, ...]:
        return mw._local_devices(None, cr.resolve({k: str(v) for k, v in env.items()}))

    assert chosen(**torchrun, RANK=11, LOCAL_RANK=3, LOCAL_WORLD_SIZE=8) == ("cuda:3",)
    assert chosen(**torchrun, RANK=3, LOCAL_RANK=1, LOCAL_WORLD_SIZE=2) == ("cuda:4", "cuda:5", "cuda:6", "cuda:7")
    assert chosen(**{**torchrun, "WORLD_SIZE": "2"}, RANK=1, LOCAL_RANK=0, LOCAL_WORLD_SIZE=1) == tuple(gpus)
    assert chosen(TF_CONFIG=json.dumps({"cluster": {"worker": ["a:1", "b:1"]}, "task": {"type": "worker",
                                                                                          "index": 1}})) == tuple(gpus)
    assert chosen(RANK=1, WORLD_SIZE=2, LOCAL_RANK=1, MASTER_ADDR="h", MASTER_PORT=1) == ("cuda:1",)  # by hand
    assert chosen() == tuple(gpus)  # a single worker: every GPU, as TF's
    with pytest.raises(ValueError, match=r"local rank 9 of 16 process\(es\) on this machine, but it shows 8 GPU"):
        chosen(**torchrun, RANK=9, LOCAL_RANK=9, LOCAL_WORLD_SIZE=16)
    gpus[:] = ["cuda:0"]  # srun --gpus-per-task=1: each of the node's 4 tasks sees its own GPU as cuda:0
    assert chosen(SLURM_PROCID=6, SLURM_NTASKS=8, SLURM_LOCALID=2, SLURM_STEP_ID=0, SLURM_JOB_ID=1,
                  SLURM_JOB_NODELIST="n[1-2]", SLURM_STEP_TASKS_PER_NODE="4(x2)", SLURM_NODEID=1) == ("cuda:0",)


def re_escape(text: str) -> str:
    import re

    return re.escape(text)


# ---- shared by the workers and the references -----------------------------------------------------------
def mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3))


def global_batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(N_EXAMPLES, 6, generator=g)
    y = torch.randint(0, 3, (N_EXAMPLES,), generator=g)
    return [(x[i:i + GLOBAL_BATCH], y[i:i + GLOBAL_BATCH]) for i in range(0, N_EXAMPLES, GLOBAL_BATCH)]


def custom_loop(strategy) -> list[torch.Tensor]:
    """SGD with momentum over EPOCHS passes of global_batches(), in strategy.run; the final parameters.
    The module is built with the rank's seed: mirror() must broadcast rank 0's."""
    rank = getattr(getattr(strategy, "cluster_resolver", None), "rank", 0)
    torch.manual_seed(rank)
    net = mlp()
    with strategy.scope():
        mnet = strategy.mirror(net)
        opt = strategy.mirror_optimizer(torch.optim.SGD, mnet, lr=0.1, momentum=0.9)

    def step(x, y, global_size):
        loss = F.cross_entropy(mnet(x), y, reduction="sum") / global_size
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss

    data = global_batches()
    for _ in range(EPOCHS):
        for (xb, yb), (x, _) in zip(strategy.experimental_distribute_dataset(data), data):
            strategy.run(step, args=(xb, yb, len(x)))
    strategy.check_in_sync([mnet, opt])
    return [p.detach().clone() for p in strategy.experimental_local_results(mnet)[0].parameters()]


def fit(strategy, epochs: int = EPOCHS, callbacks: list | None = None) -> tuple[dict, list[torch.Tensor]]:
    import mirrored as mr

    x = torch.cat([b[0] for b in global_batches()])
    y = torch.cat([b[1] for b in global_batches()])
    torch.manual_seed(0)
    with strategy.scope():
        model = mr.Model(mlp())
        model.compile(optimizer=mr.optimizers.SGD(learning_rate=0.1, momentum=0.9),
                      loss="sparse_categorical_crossentropy", metrics=["accuracy"])
    data = mr.data.Dataset.from_tensor_slices((x, y)).shuffle(64, seed=3).batch(GLOBAL_BATCH)
    history = model.fit(data, epochs=epochs, verbose=0, callbacks=callbacks or []).history
    if callbacks is None:  # (not in the restart test: every worker would evaluate and predict again)
        history["evaluate"] = model.evaluate(data, return_dict=True, verbose=0)
        history["predict"] = model.predict(x, batch_size=GLOBAL_BATCH).tolist()
    return history, [p.detach().clone() for p in model.module.parameters()]


# ---- launching workers by hand ------------------------------------------------------------------------------
def clean_env() -> dict[str, str]:
    """This process's environment without any launcher's variables (pytest may itself run under one)."""
    return {k: v for k, v in os.environ.items()
            if k not in LAUNCH_VARS and not k.startswith(("TORCHELASTIC_", "SLURM_"))}


def launch(scenario: str, out_dir: Path, envs: list[dict[str, str]], wait_for: list[int] | None = None) -> list[int]:
    """Runs `scenario` in one process per environment; returns their exit codes (None: killed while
    still running after the workers in `wait_for` had finished). Every worker is dead when this returns."""
    full = [{**clean_env(), **extra, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": "", "WORKER_NAME": f"w{i}"}
            for i, extra in enumerate(envs)]
    return run_workers(__file__, scenario, out_dir, full, _names(len(envs)), LAUNCH_DEADLINE_S, wait_for)


def _names(n: int) -> list[str]:
    return [f"w{i}" for i in range(n)]


def logs(out_dir: Path, n: int) -> str:
    return log_tails(out_dir, _names(n))


def results(out_dir: Path, names: list[str]) -> list[dict]:
    return read_results(out_dir, names)


def params_of(out_dir: Path, name: str, key: str = "params") -> list[torch.Tensor]:
    from safetensors.torch import load_file

    saved = load_file(str(out_dir / f"{name}.{key}.safetensors"))
    return [saved[str(j)] for j in range(len(saved))]


def assert_bitwise(got: list[torch.Tensor], want: list[torch.Tensor], what: str) -> None:
    for j, (g, w) in enumerate(zip(got, want)):
        assert torch.equal(g, w), f"{what}: parameter {j} differs by {(g - w).abs().max().item():.3g}"


def tf_config(index: int, port: int, chief: bool) -> dict[str, str]:
    """Worker `index` of 2 on 127.0.0.1 (with chief=True: the chief, then worker 0)."""
    if chief:
        cluster = {"chief": [f"127.0.0.1:{port}"], "worker": [f"127.0.0.1:{free_port()}"]}
        task = {"type": "chief", "index": 0} if index == 0 else {"type": "worker", "index": 0}
    else:
        cluster = {"worker": [f"127.0.0.1:{port}", "127.0.0.1:1"]}
        task = {"type": "worker", "index": index}
    return {"TF_CONFIG": json.dumps({"cluster": cluster, "task": task})}


def slurm(procid: int, port: int) -> dict[str, str]:
    return {"SLURM_PROCID": str(procid), "SLURM_NTASKS": "2", "SLURM_LOCALID": str(procid), "SLURM_STEP_ID": "0",
            "SLURM_JOB_ID": "4242", "SLURM_JOB_NODELIST": "127.0.0.1", "SLURM_TASKS_PER_NODE": "2",
            "MASTER_PORT": str(port)}


# ---- the tests that launch workers ------------------------------------------------------------------------
@pytest.mark.parametrize("launcher", ["tf_config", "slurm"])
def test_hand_launched_workers_train_as_mirrored_strategy(tmp_path, launcher):
    """2 workers started by hand with TF_CONFIG (chief + worker) or SLURM's variables join, say so in
    cluster_resolver, and end bitwise equal to each other and to MirroredStrategy on 2 replicas."""
    port = free_port()
    envs = ([tf_config(i, port, chief=True) for i in range(2)] if launcher == "tf_config"
            else [slurm(i, port) for i in range(2)])
    assert launch("custom_loop", tmp_path, envs) == [0, 0], logs(tmp_path, 2)
    res = results(tmp_path, ["w0", "w1"])
    if launcher == "tf_config":
        assert [r["resolver"] for r in res] == [["tf_config", "chief", 0, 0, 2], ["tf_config", "worker", 0, 1, 2]]
    else:
        assert [r["resolver"] for r in res] == [["slurm", "worker", 0, 0, 2], ["slurm", "worker", 1, 1, 2]]
    want = custom_loop(md.MirroredStrategy(devices=["cpu:0", "cpu:1"]))
    for name in ("w0", "w1"):
        assert_bitwise(params_of(tmp_path, name), want, f"{launcher} {name} against MirroredStrategy on 2 replicas")


def test_two_workers_of_two_replicas_equal_four_replicas(tmp_path):
    """MultiWorkerMirroredStrategy(devices=["cpu:0", "cpu:1"]) on 2 workers is 4 replicas with global
    ids 0..3: a custom loop and Model.fit end as MirroredStrategy on 4 CPU replicas, on the same global
    batches (8, 8, 6: the last split 2/2/2/0); evaluate and predict too."""
    port = free_port()
    envs = [{"RANK": str(r), "WORLD_SIZE": "2", "LOCAL_RANK": str(r), "MASTER_ADDR": "127.0.0.1",
             "MASTER_PORT": str(port)} for r in range(2)]
    assert launch("two_by_two", tmp_path, envs) == [0, 0], logs(tmp_path, 2)
    res = results(tmp_path, ["w0", "w1"])
    assert [r["replica_ids"] for r in res] == [[0, 1], [2, 3]]
    assert all(r["num_replicas_in_sync"] == 4 for r in res)
    assert res[0]["repr"] == ("MultiWorkerMirroredStrategy(rank=0, world_size=2, devices=['cpu:0', 'cpu:1'], "
                              "backend='gloo')")
    four = md.MirroredStrategy(devices=["cpu:0", "cpu:1", "cpu:2", "cpu:3"])
    want_loop = custom_loop(four)
    want_history, want_fit = fit(four)
    for name, r in zip(("w0", "w1"), res):
        for got, want in zip(params_of(tmp_path, name), want_loop):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        for got, want in zip(params_of(tmp_path, name, "fit"), want_fit):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        predicted, want_predicted = r["history"].pop("predict"), want_history["predict"]
        torch.testing.assert_close(torch.tensor(predicted), torch.tensor(want_predicted), rtol=1e-5, atol=1e-5)
        assert len(predicted) == N_EXAMPLES  # every worker's rows, in order
        for key, values in want_history.items():
            if key != "predict":
                assert r["history"][key] == pytest.approx(values, rel=1e-5, abs=1e-5), key
    assert_bitwise(params_of(tmp_path, "w1"), params_of(tmp_path, "w0"), "worker 1 against worker 0")
    assert_bitwise(params_of(tmp_path, "w1", "fit"), params_of(tmp_path, "w0", "fit"), "worker 1 against worker 0")


def test_two_workers_of_two_replicas_draw_the_masks_of_four_replicas_with_the_chiefs_seed(tmp_path):
    """Issues 24 x 26: replica j of worker w draws what replica 2w+j of MirroredStrategy on 4 replicas
    draws, with the chief's torch seed (worker 1's program seeded torch otherwise), so a restore from the
    chief's backup, which holds the chief's seed, draws on as the uninterrupted run did; and
    MultiWorkerMirroredStrategy(per_example_random=True) on 2 workers is refused naming the fix."""
    port = free_port()
    envs = [{"RANK": str(r), "WORLD_SIZE": "2", "LOCAL_RANK": str(r), "MASTER_ADDR": "127.0.0.1",
             "MASTER_PORT": str(port)} for r in range(2)]
    assert launch("random_2x2", tmp_path, envs) == [0, 0], logs(tmp_path, 2)
    res = results(tmp_path, ["w0", "w1"])
    for r in res:
        assert r["refused"] and "per_example_random=True" in r["refused"] and "2 workers" in r["refused"]
    want = dropout_masks(md.MirroredStrategy(devices=["cpu:0", "cpu:1", "cpu:2", "cpu:3"], seed=100))
    for w, r in enumerate(res):
        for step, (got, four) in enumerate(zip(r["masks"], want)):
            assert got == four[2 * w:2 * w + 2], f"worker {w}, step {step}"
    assert want[0][0] != want[0][1]  # (the replicas' masks differ)


def test_two_workers_of_two_replicas_train_a_channels_last_conv_net_with_dropout_as_four_replicas(tmp_path):
    """Issues 24 x 26 x 29: a conv net in channels_last (the default) with Dropout2d, fit on 2 workers x 2
    replicas with seed=11, ends as on MirroredStrategy(seed=11) with 4 replicas: the hierarchical
    all-reduce sums channels_last gradients element for element, and the replicas draw the same masks."""
    port = free_port()
    envs = [{"RANK": str(r), "WORLD_SIZE": "2", "LOCAL_RANK": str(r), "MASTER_ADDR": "127.0.0.1",
             "MASTER_PORT": str(port)} for r in range(2)]
    assert launch("conv_2x2", tmp_path, envs) == [0, 0], logs(tmp_path, 2)
    results(tmp_path, ["w0", "w1"])
    want = conv_fit(md.MirroredStrategy(devices=["cpu:0", "cpu:1", "cpu:2", "cpu:3"], seed=11))
    for name in ("w0", "w1"):
        for got, ref in zip(params_of(tmp_path, name, "conv"), want):
            torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    assert_bitwise(params_of(tmp_path, "w1", "conv"), params_of(tmp_path, "w0", "conv"), "worker 1 against 0")


@pytest.mark.slow
def test_two_workers_seeded_apart_resume_dropout_from_the_chiefs_backup_bitwise(tmp_path):
    """Issues 24 x 26: workers whose programs seed torch differently (100 + rank) fit with Dropout; a
    job stopped after 5 steps and resumed from the chief's backup ends bitwise as the uninterrupted
    job. Worker 1 used to draw with its own seed before and the chief's (restored) after."""
    def run(out: Path, stop_after: int) -> list[int]:
        out.mkdir(parents=True)
        port = free_port()
        envs = [{"RANK": str(r), "WORLD_SIZE": "2", "LOCAL_RANK": str(r), "MASTER_ADDR": "127.0.0.1",
                 "MASTER_PORT": str(port), "STOP_AFTER": str(stop_after)} for r in range(2)]
        return launch("dropout_resume", out, envs)

    assert run(tmp_path / "whole" / "run", -1) == [0, 0], logs(tmp_path / "whole" / "run", 2)
    assert run(tmp_path / "cut" / "first", 5) == [0, 0], logs(tmp_path / "cut" / "first", 2)
    assert all(r["stopped"] for r in results(tmp_path / "cut" / "first", ["w0", "w1"]))
    assert run(tmp_path / "cut" / "resumed", -1) == [0, 0], logs(tmp_path / "cut" / "resumed", 2)
    res = results(tmp_path / "cut" / "resumed", ["w0", "w1"])
    assert all(r["batches"] < 9 for r in res)  # it resumed (9 steps in all), not started afresh
    for name in ("w0", "w1"):
        assert_bitwise(params_of(tmp_path / "cut" / "resumed", name, "final"),
                       params_of(tmp_path / "whole" / "run", name, "final"), f"{name} resumed against whole")


@pytest.mark.slow
def test_a_keras_model_trains_on_two_workers_and_only_the_chief_writes_keras_archives(tmp_path):
    """Issues 23 x 24: mr.Model(keras_model) under MultiWorkerMirroredStrategy on 2 workers: the workers
    end bitwise equal although they built different initial weights (rank 0's are broadcast), and
    ModelCheckpoint and Model.save write .keras archives on the chief only; Keras loads the chief's
    archive with the trained weights."""
    os.environ.setdefault("KERAS_BACKEND", "torch")  # (read once, at keras's first import)
    keras = pytest.importorskip("keras")
    if keras.backend.backend() != "torch":
        pytest.skip("keras was imported with another backend than torch")
    port = free_port()
    envs = [{"RANK": str(r), "WORLD_SIZE": "2", "LOCAL_RANK": str(r), "MASTER_ADDR": "127.0.0.1",
             "MASTER_PORT": str(port), "KERAS_BACKEND": "torch"} for r in range(2)]
    assert launch("keras_2w", tmp_path, envs) == [0, 0], logs(tmp_path, 2)
    res = results(tmp_path, ["w0", "w1"])
    assert res[0]["files"] == ["ckpt.keras", "final.keras"] and res[1]["files"] == []
    assert_bitwise(params_of(tmp_path, "w1", "keras"), params_of(tmp_path, "w0", "keras"), "worker 1 against 0")
    loaded = keras.models.load_model(tmp_path / "w0" / "final.keras", compile=False)
    assert len(loaded.weights) == len(params_of(tmp_path, "w0", "keras"))
    for got, want in zip(loaded.weights, params_of(tmp_path, "w0", "keras")):
        np.testing.assert_array_equal(got.numpy(), want.numpy())


@pytest.mark.parametrize("fault", ["hangs", "exits"])
def test_a_worker_of_two_replicas_that_hangs_or_dies_is_named(tmp_path, fault):
    """With 2 replicas per worker the cross-worker collective runs inside the local meeting: when
    rank 1 hangs (or exits), rank 0's step still fails within timeout_s (2 s; at once for an exit)
    with CollectiveTimeoutError naming rank 1, on rank 0's replicas."""
    port = free_port()
    envs = [{"RANK": str(r), "WORLD_SIZE": "2", "LOCAL_RANK": str(r), "MASTER_ADDR": "127.0.0.1",
             "MASTER_PORT": str(port), "FAULT": fault} for r in range(2)]
    assert launch("fault_2x2", tmp_path, envs, wait_for=[0])[0] == 0, logs(tmp_path, 2)
    r = results(tmp_path, ["w0"])[0]
    assert r["error_type"] == "CollectiveTimeoutError", r
    assert r["error"].startswith("replica "), r["error"]  # which of rank 0's replicas issued the collective
    assert "rank 0 of 2: all_reduce(SUM)" in r["error"] and "Rank(s) 1 did not reach" in r["error"], r["error"]
    assert r["elapsed_s"] < HANG_TIMEOUT_S + 10


def torchrun(out_dir: Path, scenario: str, *flags: str) -> subprocess.CompletedProcess:
    exe = Path(sys.executable).with_name("torchrun")
    env = {**clean_env(), "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    return subprocess.run([str(exe), *flags, __file__, scenario, str(out_dir)], capture_output=True, text=True,
                          env=env, timeout=LAUNCH_DEADLINE_S * 2)


def check_resumed(out_dir: Path, done: subprocess.CompletedProcess) -> None:
    """Worker 1 was killed once, torchrun restarted both, and they ended with the uninterrupted run's
    weights (MirroredStrategy on 2 replicas, this process)."""
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-4000:]
    assert (out_dir / "killed").exists(), "no worker was killed: the test did not test a restart"
    res = results(out_dir, ["rank0", "rank1"])
    # The restarted attempt finished. (An agent that restarts its workers because another machine re-joined
    # does not count a restart in torch 2.13: on two machines the counts may differ.)
    assert max(r["attempt"] for r in res) >= 1, res
    _, want = fit(md.MirroredStrategy(devices=["cpu:0", "cpu:1"]), epochs=3)
    for name in ("rank0", "rank1"):
        assert_bitwise(params_of(out_dir, name, "fit"), want, f"{name} after the restart against an uninterrupted run")


def test_torchrun_restarts_a_killed_worker_and_the_run_resumes(tmp_path):
    """Issue 24: `torchrun --standalone --nproc_per_node 2 --max-restarts 1` with BackupAndRestore;
    worker 1 dies by SIGKILL in epoch 2. Before, the restarted workers could not join ("Gloo
    connectFullMesh failed ... Connection refused": torchrun's shared store kept the dead workers'
    addresses, pytorch#135712); now each attempt meets in a store its rank 0 serves, and the job ends
    bitwise equal to an uninterrupted run, with no environment variable to set."""
    done = torchrun(tmp_path, "fit_killed", "--standalone", "--nproc_per_node", "2", "--max-restarts", "1")
    check_resumed(tmp_path, done)


@pytest.mark.slow
def test_torchrun_c10d_rendezvous_restart_resumes(tmp_path):
    """The same with an explicit c10d rendezvous endpoint on localhost (the two-machine form's backend)."""
    done = torchrun(tmp_path, "fit_killed", "--nnodes", "1", "--nproc_per_node", "2", "--max-restarts", "1",
                    "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{free_port()}", "--rdzv-id", "issue24")
    check_resumed(tmp_path, done)


@pytest.mark.slow
def test_torchrun_static_two_node_form_restart_resumes(tmp_path):
    """The guide's two-machine form (--nnodes 2 --node_rank i --master_addr --master_port), both
    "machines" on 127.0.0.1, with --max-restarts 1: it hung before (the static rendezvous's store
    outlives the attempt as the c10d one does); now it resumes as the one-machine form does."""
    nodes_ran(tmp_path, ["--nnodes", "2", "--nproc_per_node", "1", "--master_addr", "127.0.0.1", "--master_port",
                         str(free_port()), "--max-restarts", "1"], [["--node_rank", "0"], ["--node_rank", "1"]])


@pytest.mark.slow
def test_torchrun_c10d_two_node_form_restart_resumes(tmp_path):
    """Two "machines" on 127.0.0.1 with the c10d rendezvous: the agent of the machine whose worker
    did not die restarts its worker without counting a restart, so the attempts' numbers differ
    across machines; the workers still meet (rank 0 serves each attempt's store) and resume."""
    nodes_ran(tmp_path, ["--nnodes", "2", "--nproc_per_node", "1", "--rdzv-backend", "c10d", "--rdzv-endpoint",
                         f"127.0.0.1:{free_port()}", "--rdzv-id", "issue24", "--max-restarts", "2"], [[], []])


def nodes_ran(tmp_path: Path, common: list[str], per_node: list[list[str]]) -> None:
    """Starts one torchrun per "machine" (all on this one) and checks the resumed run."""
    exe = Path(sys.executable).with_name("torchrun")
    env = {**clean_env(), "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    nodes = []
    try:
        for node_rank, flags in enumerate(per_node):
            with open(tmp_path / f"node{node_rank}.log", "w") as log:
                nodes.append(subprocess.Popen([str(exe), *common, *flags, __file__, "fit_killed", str(tmp_path)],
                                              env=env, stdout=log, stderr=subprocess.STDOUT))
        codes = [p.wait(timeout=LAUNCH_DEADLINE_S * 2) for p in nodes]
    finally:
        for p in nodes:
            if p.poll() is None:
                p.kill()
            p.wait()
    output = "\n".join((tmp_path / f"node{i}.log").read_text()[-3000:] for i in range(len(per_node)))
    check_resumed(tmp_path, subprocess.CompletedProcess([], max(codes), output, ""))


# ---- the worker side ---------------------------------------------------------------------------------------
OUT_DIR = Path(".")


def save(name: str, key: str, params: list[torch.Tensor]) -> None:
    from safetensors.torch import save_file

    save_file({str(j): p.contiguous() for j, p in enumerate(params)}, str(OUT_DIR / f"{name}.{key}.safetensors"))


def scenario_custom_loop(name: str) -> dict:
    s = md.MultiWorkerMirroredStrategy(devices=["cpu:0"], timeout_s=COLLECTIVE_TIMEOUT_S)
    r = s.cluster_resolver
    save(name, "params", custom_loop(s))
    return {"resolver": [r.kind, r.task_type, r.task_id, r.rank, r.num_workers]}


def scenario_two_by_two(name: str) -> dict:
    s = md.MultiWorkerMirroredStrategy(devices=["cpu:0", "cpu:1"], timeout_s=COLLECTIVE_TIMEOUT_S)
    ids = s.experimental_local_results(s.run(lambda: md.get_replica_context().replica_id_in_sync_group))
    save(name, "params", custom_loop(s))
    history, params = fit(s)
    save(name, "fit", params)
    return {"replica_ids": list(ids), "num_replicas_in_sync": s.num_replicas_in_sync, "repr": repr(s),
            "history": history}


def scenario_fit_killed(name: str) -> dict:
    """Model.fit for 3 epochs with BackupAndRestore; on the first attempt worker 1 kills itself with
    SIGKILL after the second step of epoch 2 (the marker file tells a restarted worker not to)."""
    import mirrored as mr

    s = md.MultiWorkerMirroredStrategy(devices=["cpu:0"], timeout_s=COLLECTIVE_TIMEOUT_S)
    rank, attempt = s.cluster_resolver.rank, s.cluster_resolver.restart_count
    marker = OUT_DIR / "killed"

    class Kill(mr.callbacks.Callback):
        def on_epoch_begin(self, epoch, logs=None):
            self.epoch = epoch

        def on_train_batch_end(self, batch, logs=None):
            if rank == 1 and self.epoch == 1 and batch == 1 and not marker.exists():
                marker.write_text("1")
                os.kill(os.getpid(), signal.SIGKILL)

    _, params = fit(s, epochs=3, callbacks=[mr.callbacks.BackupAndRestore(OUT_DIR / "backup"), Kill()])
    save(name, "fit", params)
    return {"attempt": attempt}


def scenario_fault_2x2(name: str) -> dict:
    """Rank 1 hangs (sleeps past the test's deadline) or exits before the second all_reduce."""
    s = md.MultiWorkerMirroredStrategy(devices=["cpu:0", "cpu:1"], timeout_s=HANG_TIMEOUT_S)
    step = lambda: md.get_replica_context().all_reduce("sum", torch.ones(2))  # noqa: E731
    s.run(step)
    if s.cluster_resolver.rank == 1:
        if os.environ["FAULT"] == "hangs":
            time.sleep(LAUNCH_DEADLINE_S)
        os._exit(0)
    started = time.monotonic()
    try:
        s.run(step)
        return {"error_type": None}
    except Exception as e:  # noqa: BLE001 - the test checks which
        return {"error_type": type(e).__name__, "error": str(e), "elapsed_s": time.monotonic() - started}


def scenario_random_2x2(name: str) -> dict:
    """Dropout masks of 2 workers x 2 replicas whose programs seed torch differently (100 + rank), and
    per_example_random=True refused across workers."""
    torch.manual_seed(100 + int(os.environ["RANK"]))
    try:
        md.MultiWorkerMirroredStrategy(devices=["cpu:0", "cpu:1"], per_example_random=True)
        refused = None
    except ValueError as e:
        refused = str(e)
    s = md.MultiWorkerMirroredStrategy(devices=["cpu:0", "cpu:1"], timeout_s=COLLECTIVE_TIMEOUT_S)
    return {"refused": refused, "masks": dropout_masks(s)}


def dropout_masks(strategy) -> list[list[list]]:
    """Each local replica's F.dropout(ones, 0.5) in two steps."""
    ones = strategy.experimental_distribute_values_from_function(lambda ctx: torch.ones(4, 64))
    steps = []
    for _ in range(2):
        result = strategy.run(lambda x: F.dropout(x, 0.5), args=(ones,))
        steps.append([t.tolist() for t in strategy.experimental_local_results(result)])
    return steps


def scenario_keras_2w(name: str) -> dict:
    """A Keras model (seeded Dropout, BatchNormalization) fit on 2 workers x 1 replica, with
    ModelCheckpoint and Model.save to .keras archives in a directory of each worker's own."""
    os.environ["KERAS_BACKEND"] = "torch"
    import keras

    import mirrored as mr

    s = md.MultiWorkerMirroredStrategy(devices=["cpu:0"], timeout_s=COLLECTIVE_TIMEOUT_S)
    keras.utils.set_random_seed(int(os.environ["RANK"]))  # the workers build different initial weights
    inp = keras.Input((6,))
    h = keras.layers.BatchNormalization()(keras.layers.Dense(16, activation="relu")(inp))
    out = keras.layers.Dense(3, activation="softmax")(keras.layers.Dropout(0.5, seed=7)(h))
    with s.scope():
        model = mr.Model(keras.Model(inp, out))
        model.compile(optimizer=keras.optimizers.SGD(0.1), loss="sparse_categorical_crossentropy")
    x = torch.cat([b[0] for b in global_batches()]).numpy()
    y = torch.cat([b[1] for b in global_batches()]).numpy()
    own = OUT_DIR / name
    own.mkdir()
    model.fit(x, y, batch_size=GLOBAL_BATCH, epochs=2, shuffle=False, verbose=0,
              callbacks=[mr.callbacks.ModelCheckpoint(str(own / "ckpt.keras"))])
    model.save(own / "final.keras")
    model.check_in_sync()
    save(name, "keras", [torch.as_tensor(v.numpy()) for v in model.module.weights])
    return {"files": sorted(p.name for p in own.iterdir())}


def conv_fit(strategy) -> list[torch.Tensor]:
    """fit of a small conv net with Dropout2d (channels_last by default) over global_batches() as images."""
    import mirrored as mr

    g = torch.Generator().manual_seed(2)
    x, y = torch.randn(N_EXAMPLES, 3, 6, 6, generator=g), torch.randint(0, 3, (N_EXAMPLES,), generator=g)
    torch.manual_seed(0)
    with strategy.scope():
        model = mr.Model(nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU(), nn.Dropout2d(0.3), nn.Conv2d(4, 4, 3),
                                       nn.Flatten(), nn.Linear(16, 3)))
        model.compile(optimizer=mr.optimizers.SGD(learning_rate=0.1, momentum=0.9),
                      loss="sparse_categorical_crossentropy")
    model.fit(x, y, batch_size=GLOBAL_BATCH, epochs=EPOCHS, shuffle=False, verbose=0)
    assert model.memory_format == "channels_last", model.memory_format
    return [p.detach().clone() for p in model.module.parameters()]


def scenario_conv_2x2(name: str) -> dict:
    s = md.MultiWorkerMirroredStrategy(devices=["cpu:0", "cpu:1"], timeout_s=COLLECTIVE_TIMEOUT_S, seed=11)
    save(name, "conv", conv_fit(s))
    return {}


class _Stop(Exception):
    pass


def scenario_dropout_resume(name: str) -> dict:
    """fit with Dropout and BackupAndRestore on 2 workers whose programs seed torch differently; with
    STOP_AFTER=k both workers stop after their k-th batch (a backup every 2 steps), as a preempted job."""
    import mirrored as mr

    rank, stop_after = int(os.environ["RANK"]), int(os.environ.get("STOP_AFTER", "-1"))
    torch.manual_seed(100 + rank)
    s = md.MultiWorkerMirroredStrategy(devices=["cpu:0"], timeout_s=COLLECTIVE_TIMEOUT_S)
    x = torch.cat([b[0] for b in global_batches()])
    y = torch.cat([b[1] for b in global_batches()])
    with s.scope():
        model = mr.Model(nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Dropout(0.5), nn.Linear(16, 3)))
        model.compile(optimizer=mr.optimizers.SGD(learning_rate=0.1), loss="sparse_categorical_crossentropy")

    class Stop(mr.callbacks.Callback):
        seen = 0

        def on_train_batch_end(self, batch, logs=None):
            Stop.seen += 1
            if Stop.seen == stop_after:
                raise _Stop

    try:
        model.fit(x, y, batch_size=GLOBAL_BATCH, epochs=3, shuffle=False, verbose=0,
                  callbacks=[mr.callbacks.BackupAndRestore(OUT_DIR.parent / "backup", save_freq=2), Stop()])
    except _Stop:
        return {"stopped": True}
    save(name, "final", [p.detach().clone() for p in model.module.parameters()])
    return {"stopped": False, "batches": Stop.seen}


SCENARIOS = {
    "dropout_resume": scenario_dropout_resume,
    "conv_2x2": scenario_conv_2x2,
    "keras_2w": scenario_keras_2w,
    "random_2x2": scenario_random_2x2,
    "fault_2x2": scenario_fault_2x2,
    "custom_loop": scenario_custom_loop,
    "two_by_two": scenario_two_by_two,
    "fit_killed": scenario_fit_killed,
}


def _worker_main(scenario: str, out_dir: str) -> None:
    global OUT_DIR
    OUT_DIR = Path(out_dir)
    name = os.environ.get("WORKER_NAME") or f"rank{os.environ['RANK']}"
    try:
        result = SCENARIOS[scenario](name)
    except BaseException:  # noqa: BLE001 - reported to the test through the results file
        result = {"crash": traceback.format_exc()}
        traceback.print_exc()
    (OUT_DIR / f"{name}.json").write_text(json.dumps(result))
    sys.stdout.flush()
    sys.stderr.flush()
    # os._exit: the result is on disk, and tearing down a gloo group whose peer already left can abort.
    # A crash exits 1, so that torchrun restarts the workers.
    os._exit(1 if "crash" in result else 0)


if __name__ == "__main__":
    _worker_main(sys.argv[1], sys.argv[2])
