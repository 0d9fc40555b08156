"""MultiWorkerMirroredStrategy on local worker processes (gloo over 127.0.0.1), and as a single worker.

Each multi-worker test starts its workers with subprocess.Popen running this file as a script
(`python test_multi_worker.py SCENARIO OUT_DIR`) with RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and a
free MASTER_PORT in the environment, as torchrun would. A worker writes what it saw to OUT_DIR as JSON
(parameters as safetensors), and the test compares that with values worked out by hand or with an
independent plain-PyTorch run in this process. Nothing hangs: every launch has a hard deadline after
which its workers are killed, every worker uses a strategy timeout well inside it, and every test
kills the workers it started, whatever happens.
"""
from __future__ import annotations

import atexit
import copy
import datetime
import json
import os
import re
import subprocess
import sys
import time
import traceback
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import mirrored.distribute as md
from _workers import free_port, log_tails, read_results, run_workers  # tests/distribute/_workers.py

LAUNCH_DEADLINE_S = 150.0  # a launch's workers are killed after this, whatever they are doing
COLLECTIVE_TIMEOUT_S = 60.0  # the strategy's timeout where nothing should fail: generous, CI machines are loaded
HANG_TIMEOUT_S = 2.0  # the strategy's timeout where a worker hangs on purpose
STUCK_S = 60.0  # how long the hanging worker sleeps (it is killed long before)
N_EXAMPLES, GLOBAL_BATCH, EPOCHS = 11, 4, 2  # global batches of 4, 4, 3: on 2 workers 2/2, 2/2, 2/1
RTOL, ATOL = 1e-6, 2e-7  # as tests/distribute/test_strategy_equivalence.py, which explains them
LAUNCH_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


# ---- shared by the workers and the reference ----------------------------------------------------------
def mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3))


def global_batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(N_EXAMPLES, 6, generator=g)
    y = torch.randint(0, 3, (N_EXAMPLES,), generator=g)
    return [(x[i:i + GLOBAL_BATCH], y[i:i + GLOBAL_BATCH]) for i in range(0, N_EXAMPLES, GLOBAL_BATCH)]


class SparseNet(nn.Module):
    """A sparse embedding, a sparse bag of context ids and a dense head (issue 36's mixed model)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.tables = nn.ModuleDict({"item": nn.Embedding(20, 4, sparse=True),
                                     "context": nn.EmbeddingBag(20, 4, sparse=True, mode="mean")})
        self.head = nn.Linear(4, 3)

    def forward(self, item: torch.Tensor, context: torch.Tensor) -> torch.Tensor:
        return self.head(self.tables["item"](item) * self.tables["context"](context))


def sparse_batches() -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Global batches of 4, 4, 3 (2/2, 2/2, 2/1 on 2 workers; 1/1/1/1, ..., 1/1/1/0 on 2 workers of 2)."""
    g = torch.Generator().manual_seed(2)
    item, context = torch.randint(0, 20, (N_EXAMPLES,), generator=g), torch.randint(0, 20, (N_EXAMPLES, 3), generator=g)
    y = torch.randint(0, 3, (N_EXAMPLES,), generator=g)
    return [(item[i:i + GLOBAL_BATCH], context[i:i + GLOBAL_BATCH], y[i:i + GLOBAL_BATCH])
            for i in range(0, N_EXAMPLES, GLOBAL_BATCH)]


def sparse_optimizers(net: nn.Module, make) -> dict:
    """SparseAdam for the tables beside Adam for the head, or Adagrad (which takes both kinds) for all."""
    return {"SparseAdam": lambda: [make(torch.optim.SparseAdam, net.tables, lr=0.05),
                                   make(torch.optim.Adam, net.head, lr=0.05)],
            "Adagrad": lambda: [make(torch.optim.Adagrad, net, lr=0.3)],
            # (its momentum buffers of the tables are sparse: check_in_sync compares them by checksum)
            "SGD momentum": lambda: [make(torch.optim.SGD, net, lr=0.3, momentum=0.9)]}


# name: (how the workers sum sparse gradients, optimizers, gradient_reduction, replicas per worker)
SPARSE_RUNS = {"gathered-sparseadam-sum": ("gathered", "SparseAdam", "sum", 1),
               "densified-sparseadam-sum": ("densified", "SparseAdam", "sum", 1),
               "gathered-adagrad-mean": ("gathered", "Adagrad", "mean", 1),
               "densified-adagrad-mean": ("densified", "Adagrad", "mean", 1),
               "gathered-sparseadam-mean-x2": ("gathered", "SparseAdam", "mean", 2),
               "densified-adagrad-sum-x2": ("densified", "Adagrad", "sum", 2),
               "gathered-sgdmomentum-mean": ("gathered", "SGD momentum", "mean", 1)}


def sparse_reference(optimizers: str) -> list[torch.Tensor]:
    """Plain PyTorch on one device, the whole global batches."""
    net = SparseNet()
    opts = sparse_optimizers(net, lambda cls, module, **kw: cls(module.parameters(), **kw))[optimizers]()
    for _ in range(EPOCHS):
        for item, context, y in sparse_batches():
            for opt in opts:
                opt.zero_grad()
            F.cross_entropy(net(item, context), y).backward()
            for opt in opts:
                opt.step()
    return [p.detach() for p in net.parameters()]


# ---- launching workers -----------------------------------------------------------------------------
def launch(scenario: str, out_dir: Path, world: int = 2, wait_for: list[int] | None = None,
           started: int | None = None) -> list[int | None]:
    """Runs `scenario` on the first `started` (default: all) of `world` worker processes; returns their
    exit codes (None: killed while still running after the ranks in `wait_for` had finished). Every
    worker is dead when this returns."""
    port = free_port()
    envs = []
    for rank in range(world if started is None else started):
        env = {k: v for k, v in os.environ.items() if not k.startswith("TORCHELASTIC_")}
        env.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world),
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1",
                   CUDA_VISIBLE_DEVICES="")  # CPU workers: two processes cannot share one GPU under NCCL
        envs.append(env)
    return run_workers(__file__, scenario, out_dir, envs, _names(len(envs)), LAUNCH_DEADLINE_S, wait_for)


def _names(world: int) -> list[str]:
    return [f"rank{r}" for r in range(world)]


def logs(out_dir: Path, world: int) -> str:
    """The tail of each worker's output, for assertion messages (a rank never started has none)."""
    return log_tails(out_dir, _names(world))


def results(out_dir: Path, world: int = 2) -> list[dict]:
    return read_results(out_dir, _names(world))


# ---- the tests ---------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def two_workers(tmp_path_factory) -> list[dict]:
    """One launch of the "collectives" scenario on 2 workers, read by the tests below (each worker
    start costs seconds). At its end rank 1 exits while rank 0 calls one more all_reduce."""
    out_dir = tmp_path_factory.mktemp("collectives")
    assert launch("collectives", out_dir) == [0, 0], logs(out_dir, 2)
    return results(out_dir)


def test_replica_ids_and_devices(two_workers):
    for rank, r in enumerate(two_workers):
        assert r["num_replicas_in_sync"] == 2 and r["worker_devices"] == ["cpu:0"]
        assert r["replica_id_in_sync_group"] == rank and r["ctx_num_replicas_in_sync"] == 2
        assert r["repr"] == f"MultiWorkerMirroredStrategy(rank={rank}, world_size=2, device='cpu:0', backend='gloo')"
        assert r["cluster_resolver"] == ["worker", rank, "environment", rank, 2]  # RANK set by hand, not torchrun


def test_all_reduce_and_reduce(two_workers):
    """Rank r contributes a = [r+1, 2(r+1)] and b = r+1 (an integer) to a nested all_reduce; reduce
    gets 1 and 2; with an axis, [0] and [1, 1], whose MEAN divides by all 3 elements."""
    for r in two_workers:
        assert r["all_reduce_sum"] == {"a": [3.0, 6.0], "b": 3}
        assert r["all_reduce_mean"] == {"a": [1.5, 3.0], "b": 1.5}  # an integer mean is float64, as in TF 2.21
        assert r["all_reduce_grad"] == [3.0, 3.0, 3.0]  # d/dx_r of sum_k (k+1) * sum(x_0 + x_1) = 1 + 2
        assert r["reduce_sum"] == 3.0 and r["reduce_mean"] == 1.5
        assert r["reduce_sum_axis"] == 2.0 and r["reduce_mean_axis"] == pytest.approx(2 / 3, rel=1e-7)
        assert r["reduce_mean_int"] == [2]
        assert r["cross_device_ops_mean"] == [1.5]  # CollectiveAllReduce.reduce gives a Mirrored
        assert "rank 0: 1 tensor(s), 1 element(s); rank 1: 1 tensor(s), 2 element(s)" in r["shape_error"]


def test_gather_of_uneven_parts(two_workers):
    for r in two_workers:
        assert r["gather_axis0"] == [[0, 1], [10, 11], [12, 13]]
        assert r["gather_axis1"] == [[0, 1, 1], [0, 1, 1]]
        assert r["gather_bool"] == [True, False, False]
        assert "differ in more than the size along axis 0" in r["gather_error"]


def test_merge_call_and_values_from_function(two_workers):
    """merge_fn runs on each worker, and its strategy.reduce crosses workers (1 + 2)."""
    for rank, r in enumerate(two_workers):
        assert r["merge_call"] == 3.0
        assert r["value_context"] == [rank, 2] and r["values_reduced"] == [1, 4]


def test_distributed_input(two_workers):
    """Global batches of ids 0..9 by 4 (4, 4, 2): each worker takes its ceil(B/2) part. From a function,
    rank 0's pipeline yields 3 batches and rank 1's 2: both run 3 steps, rank 1's last part empty."""
    for rank, r in enumerate(two_workers):
        assert r["distributed_batches"] == [[[0, 1], [4, 5], [8]], [[2, 3], [6, 7], [9]]][rank]
        assert r["input_context"] == [2, rank, 2]
        assert r["from_function"] == [[[0], [1], [2]], [[10], [11], []]][rank]


def test_mirror_broadcasts_and_check_in_sync_compares_workers(two_workers):
    torch.manual_seed(0)
    want = nn.Linear(3, 2)  # rank 0's module, built with seed 0; rank 1 used seed 1 before mirror()
    for r in two_workers:
        assert r["mirrored_weight"] == want.weight.tolist() and r["mirrored_bias"] == want.bias.tolist()
        assert r["in_sync_error"] == ("bias: rank 0 and rank(s) 1 hold different values (max abs difference "
                                      "from rank 0: rank 1: 0.5); the copies must be bitwise identical after every "
                                      "step.")


def test_buffers_averaged_and_gradients_agreed(two_workers):
    """BatchNorm running means 0.1 * 2.5 and 0.1 * 3.5 average to 0.3; a gradient only rank 0 has
    arrives on both, and one that no worker has stays None."""
    for r in two_workers:
        assert r["bn_running_mean"] == pytest.approx([0.3] * 3, rel=1e-6)
        assert r["grads_used"] == [[[1.0, 1.0]], [1.0]] and r["grads_unused"] == [None, None]


def test_worker_that_exits_makes_the_other_fail_fast(two_workers):
    """Rank 1 exits instead of joining an all_reduce: rank 0 gets CollectiveTimeoutError naming itself,
    the op and rank 1, long before its 60 s timeout (the closed connection tells at once)."""
    r = two_workers[0]["exit"]
    assert r["error_type"] == "CollectiveTimeoutError"
    assert r["error"].startswith("rank 0 of 2: ReplicaContext.all_reduce"), r["error"]
    assert "another worker's connection closed" in r["error"] and "Rank(s) 1 did not reach" in r["error"]
    assert r["elapsed_s"] < COLLECTIVE_TIMEOUT_S


def reference_run(net: nn.Module) -> tuple[list[float], list[torch.Tensor]]:
    """Plain PyTorch on each whole global batch: the losses and the final parameters."""
    opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    losses = []
    for _ in range(EPOCHS):
        for x, y in global_batches():
            loss = F.cross_entropy(net(x), y, reduction="sum") / len(x)
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
    return losses, [p.detach() for p in net.parameters()]


def check_training(out_dir: Path, world: int) -> None:
    from safetensors.torch import load_file

    torch.manual_seed(0)
    want_losses, want_params = reference_run(mlp())
    res = results(out_dir, world)
    params = [load_file(str(out_dir / f"params{r}.safetensors")) for r in range(world)]
    for rank in range(world):
        assert res[rank]["losses"] == pytest.approx(want_losses, rel=RTOL, abs=ATOL)
        assert res[rank]["parts"] == res[0]["parts"]
        for j, want in enumerate(want_params):
            got = params[rank][str(j)]
            torch.testing.assert_close(got, want, rtol=RTOL, atol=ATOL, msg=lambda m: f"parameter {j}: {m}")
            assert torch.equal(got, params[0][str(j)]), f"rank {rank} differs from rank 0 in parameter {j}"


def test_training_on_two_workers_matches_plain_torch(tmp_path):
    """An MLP with SGD momentum, 2 epochs of global batches 4, 4, 3 (split 2/2, 2/2, 2/1) on 2 workers,
    equals plain PyTorch on the whole batches, and the workers end bitwise identical. The workers
    create the process group themselves (an existing group is used) and seed differently, so the
    start from the same weights is mirror()'s broadcast."""
    assert launch("training", tmp_path) == [0, 0], logs(tmp_path, 2)
    check_training(tmp_path, 2)
    assert results(tmp_path)[0]["parts"] == [[2, 2], [2, 2], [2, 1]] * EPOCHS


def test_mean_reduction_on_two_workers_matches_plain_torch(tmp_path):
    """gradient_reduction="mean" with the unchanged loss line (issue 14), across processes: the last
    batch's parts 2/1 weigh by their examples, so the workers end with plain PyTorch's weights."""
    assert launch("training_mean", tmp_path) == [0, 0], logs(tmp_path, 2)
    check_training(tmp_path, 2)


def fit_run(strategy) -> tuple[dict, list[torch.Tensor], list[list[float]]]:
    """Model.fit, evaluate and predict of mlp() on global batches of GLOBAL_BATCH: the same code
    for the workers and the in-process reference."""
    import mirrored as mr

    x = torch.cat([b[0] for b in global_batches()])
    y = torch.cat([b[1] for b in global_batches()])
    with strategy.scope():
        model = mr.Model(mlp())
        model.compile(optimizer=mr.optimizers.SGD(learning_rate=0.1, momentum=0.9),
                      loss="sparse_categorical_crossentropy", metrics=["accuracy"])
    data = mr.data.Dataset.from_tensor_slices((x, y)).batch(GLOBAL_BATCH)
    history = model.fit(data, epochs=EPOCHS, verbose=0).history
    logs = {"history": history, "evaluate": model.evaluate(data, return_dict=True, verbose=0)}
    return logs, [p.detach().clone() for p in model.module.parameters()], model.predict(x, batch_size=GLOBAL_BATCH).tolist()


@pytest.mark.filterwarnings("ignore:Sparse invariant checks:UserWarning")  # (torch's Adagrad, in the reference)
def test_sparse_gradients_on_two_workers_match_plain_torch(tmp_path):
    """Issue 36: nn.Embedding / nn.EmbeddingBag(sparse=True) beside a dense head, with SparseAdam + Adam or
    Adagrad, "sum" and "mean", each way of summing the sparse gradients across the workers (gathered,
    densified: forced), on 2 workers of one replica and of two (an empty part there: 1/1/1/0). Equal to
    one device within 1e-6 (the replicas' sums of a row add in another order), every worker bitwise
    the same."""
    from safetensors.torch import load_file

    assert launch("sparse", tmp_path) == [0, 0], logs(tmp_path, 2)
    results(tmp_path)
    for name, (_, optimizers, _, _) in SPARSE_RUNS.items():
        want = sparse_reference(optimizers)
        got = [load_file(str(tmp_path / f"sparse-{name}-{rank}.safetensors")) for rank in range(2)]
        for j, w in enumerate(want):
            torch.testing.assert_close(got[0][str(j)], w, rtol=0, atol=1e-6, msg=lambda m: f"{name}, {j}: {m}")
            assert torch.equal(got[1][str(j)], got[0][str(j)]), f"{name}: rank 1 differs from rank 0 in {j}"


def test_model_fit_on_two_workers_matches_two_replicas(tmp_path):
    """Model.fit divides each step's loss by the GLOBAL batch's size, which a worker cannot see in
    its own part: on 2 workers it trains, evaluates and predicts as MirroredStrategy does on 2 replicas
    (before the fix, the learning rate was in effect doubled), and predict returns every worker's rows."""
    from safetensors.torch import load_file

    assert launch("fit", tmp_path) == [0, 0], logs(tmp_path, 2)
    torch.manual_seed(0)
    want_logs, want_params, want_pred = fit_run(md.MirroredStrategy(devices=["cpu:0", "cpu:1"]))
    for rank, res in enumerate(results(tmp_path)):
        for key, values in want_logs["history"].items():
            assert res["logs"]["history"][key] == pytest.approx(values, rel=RTOL, abs=ATOL), (rank, key)
        assert res["logs"]["evaluate"] == pytest.approx(want_logs["evaluate"], rel=RTOL, abs=ATOL), rank
        got_params = load_file(str(tmp_path / f"params{rank}.safetensors"))
        for j, want in enumerate(want_params):
            torch.testing.assert_close(got_params[str(j)], want, rtol=RTOL, atol=ATOL)
        assert len(res["predict"]) == N_EXAMPLES
        torch.testing.assert_close(torch.tensor(res["predict"]), torch.tensor(want_pred), rtol=RTOL, atol=ATOL)


@pytest.mark.slow
def test_training_on_three_workers_matches_plain_torch(tmp_path):
    """Over 3 workers the batches split 2/2/0, 2/2/0, 1/1/1: an empty part still joins the all-reduce."""
    assert launch("training", tmp_path, world=3) == [0, 0, 0], logs(tmp_path, 3)
    check_training(tmp_path, 3)
    assert results(tmp_path, 3)[0]["parts"] == [[2, 2, 0], [2, 2, 0], [1, 1, 1]] * EPOCHS


def test_worker_that_hangs_makes_the_other_time_out(tmp_path):
    """Rank 1 sleeps instead of joining: rank 0 times out after timeout_s (2 s) with an error naming
    rank 1; the test then kills rank 1."""
    codes = launch("hang", tmp_path, wait_for=[0])
    assert codes[0] == 0, logs(tmp_path, 2)
    r = json.loads((tmp_path / "rank0.json").read_text())
    assert r.get("error_type") == "CollectiveTimeoutError", r
    assert r["error"].startswith("rank 0 of 2: strategy.reduce"), r["error"]
    assert f"timed out after {HANG_TIMEOUT_S:.0f}." in r["error"] and "Rank(s) 1 did not reach" in r["error"]
    assert HANG_TIMEOUT_S <= r["elapsed_s"] < HANG_TIMEOUT_S + 10


def test_when_rank_0_dies_the_survivors_name_it(tmp_path):
    """Issue 17: rank 0 hosts the rendezvous store, so when it dies the store cannot say who is
    missing. Rank 1's error now names rank 0 as the likely missing worker instead of "unknown"."""
    codes = launch("rank0_exits", tmp_path, wait_for=[1])
    assert codes[1] == 0, logs(tmp_path, 2)
    r = json.loads((tmp_path / "rank1.json").read_text())
    assert r.get("error_type") == "CollectiveTimeoutError", r
    assert r["error"].startswith("rank 1 of 2: strategy.reduce"), r["error"]
    assert "Rank 0 is likely the missing worker: it hosts the rendezvous store at 127.0.0.1:" in r["error"], r["error"]
    assert "unknown" not in r["error"]
    assert r["elapsed_s"] < COLLECTIVE_TIMEOUT_S


def test_store_gone_under_torchrun_names_rank_0s_machine(monkeypatch):
    """Under torchrun the store is the agent's on rank 0's machine: the message says so."""
    from mirrored.distribute._collectives import _store_gone

    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    message = _store_gone("host0", 29500)
    assert message.startswith("Rank 0's machine is likely what is missing: the rendezvous store at host0:29500, "
                              "which torchrun's agent"), message
    # Issue 24: the store the strategy made is rank 0's own (a new one every attempt), even under torchrun.
    assert _store_gone("host0", 41000, agent_store=False).startswith("Rank 0 is likely the missing")
    monkeypatch.delenv("TORCHELASTIC_USE_AGENT_STORE")
    assert _store_gone("host0", 29500).startswith("Rank 0 is likely the missing worker")


@pytest.mark.slow
def test_worker_that_never_starts_fails_the_rendezvous(tmp_path):
    """Only rank 0 of 2 starts: creating the strategy fails after timeout_s, naming the rank, the
    address and the fix."""
    assert launch("never_arrives", tmp_path, started=1) == [0], logs(tmp_path, 1)
    r = json.loads((tmp_path / "rank0.json").read_text())
    assert r["error_type"] == "RuntimeError"
    assert r["error"].startswith("MultiWorkerMirroredStrategy: rank 0 of 2 could not join the other workers at "
                                 "127.0.0.1:"), r["error"]
    assert "Check that every worker started" in r["error"]


def test_single_worker_without_environment(monkeypatch):
    """Without RANK the strategy is one worker (TF without TF_CONFIG): no process group, one replica,
    and training is bitwise the plain-PyTorch run."""
    for key in LAUNCH_ENV:
        monkeypatch.delenv(key, raising=False)
    s = md.MultiWorkerMirroredStrategy(devices=["cpu:0"])
    assert not dist.is_initialized()
    assert s.num_replicas_in_sync == 1 and s.extended.worker_devices == ("cpu:0",)
    assert (s.cluster_resolver.task_type, s.cluster_resolver.task_id, s.cluster_resolver.kind) == (None, 0, "single")
    assert repr(s) == "MultiWorkerMirroredStrategy(rank=0, world_size=1, device='cpu:0', backend=None)"
    assert s.run(lambda: md.get_replica_context().replica_id_in_sync_group) == 0
    assert s.reduce("sum", torch.tensor(2.0)).item() == 2.0
    assert s.gather(torch.arange(3), axis=0).tolist() == [0, 1, 2]
    assert s.experimental_distribute_values_from_function(lambda ctx: ctx.replica_id_in_sync_group) == 0

    torch.manual_seed(0)
    net = mlp()
    want_losses, want_params = reference_run(copy.deepcopy(net))
    with s.scope():
        mnet = s.mirror(net)
        opt = s.mirror_optimizer(torch.optim.SGD, mnet, lr=0.1, momentum=0.9)

    def step(x, y):
        loss = F.cross_entropy(mnet(x), y, reduction="sum") / len(x)
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss

    losses = [s.run(step, args=batch).item() for _ in range(EPOCHS)
              for batch in s.experimental_distribute_dataset(global_batches())]
    assert losses == want_losses
    for got, want in zip(mnet.parameters(), want_params):
        assert torch.equal(got, want)
    s.check_in_sync([mnet, opt])


def test_a_single_worker_of_two_devices_is_mirrored_strategy(monkeypatch):
    """Issue 24: without a launch, devices=["cpu:0", "cpu:1"] is one worker of two replica threads,
    which trains bitwise as MirroredStrategy on the same devices (and no process group is made)."""
    for key in LAUNCH_ENV:
        monkeypatch.delenv(key, raising=False)
    s = md.MultiWorkerMirroredStrategy(devices=["cpu:0", "cpu:1"])
    assert s.num_replicas_in_sync == 2 and not dist.is_initialized()
    assert type(s.extended.cross_device_ops) is type(md.MirroredStrategy(["cpu:0", "cpu:1"]).extended.cross_device_ops)
    results = []
    for strategy in (s, md.MirroredStrategy(devices=["cpu:0", "cpu:1"])):
        torch.manual_seed(0)
        with strategy.scope():
            mnet = strategy.mirror(mlp())
            opt = strategy.mirror_optimizer(torch.optim.SGD, mnet, lr=0.1, momentum=0.9)

        def step(x, y, n):
            (F.cross_entropy(mnet(x), y, reduction="sum") / n).backward()
            opt.step()
            opt.zero_grad()

        for x, y in global_batches():
            strategy.run(step, args=(*next(iter(strategy.experimental_distribute_dataset([(x, y)]))), len(x)))
        assert strategy.reduce("sum", strategy.run(lambda: torch.ones(1))).item() == 2.0
        results.append([p.detach().clone() for p in strategy.experimental_local_results(mnet)[1].parameters()])
    for got, want in zip(*results):
        assert torch.equal(got, want)


def test_default_devices_are_every_gpu_or_one_cpu(monkeypatch):
    """A single worker takes every GPU of its machine (TF's MWMS does), else one CPU."""
    for key in LAUNCH_ENV:
        monkeypatch.delenv(key, raising=False)
    want = tuple(f"cuda:{i}" for i in range(torch.cuda.device_count())) or ("cpu:0",)
    assert md.MultiWorkerMirroredStrategy().extended.worker_devices == want


def test_constructor_validates_before_joining(monkeypatch):
    """Every misuse is refused before any rendezvous starts (so a bad launch fails at once)."""
    for key in LAUNCH_ENV:
        monkeypatch.delenv(key, raising=False)
    with pytest.raises(ValueError, match="timeout_s=0"):
        md.MultiWorkerMirroredStrategy(timeout_s=0)
    with pytest.raises(TypeError, match="communication_options=42"):
        md.MultiWorkerMirroredStrategy(communication_options=42)
    with pytest.raises(ValueError, match="implementation='MPI'"):
        md.CommunicationOptions(implementation="MPI")
    with pytest.raises(ValueError, match="implementation NCCL needs a GPU"):
        md.MultiWorkerMirroredStrategy(md.CommunicationOptions(implementation="nccl"), devices=["cpu:0"])
    monkeypatch.setenv("RANK", "0")
    with pytest.raises(ValueError, match="RANK=0 is set but WORLD_SIZE, MASTER_ADDR, MASTER_PORT are not.*torchrun"):
        md.MultiWorkerMirroredStrategy()
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "x")
    with pytest.raises(ValueError, match="MASTER_PORT='x' is not an integer"):
        md.MultiWorkerMirroredStrategy()
    monkeypatch.setenv("MASTER_PORT", "29500")
    monkeypatch.setenv("RANK", "2")
    with pytest.raises(ValueError, match=r"RANK=2 is outside \[0, WORLD_SIZE=2\)"):
        md.MultiWorkerMirroredStrategy()
    assert not dist.is_initialized()


def test_tf_config_of_one_task_is_a_single_worker(monkeypatch):
    """One task is one worker, as in TF (no rendezvous); several are joined (test_multi_worker_launch.py)."""
    for key in LAUNCH_ENV:
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("TF_CONFIG", json.dumps({"cluster": {"worker": ["host0:2222"]},
                                                "task": {"type": "worker", "index": 0}}))
    s = md.MultiWorkerMirroredStrategy(devices=["cpu:0"])
    assert s.num_replicas_in_sync == 1 and s.cluster_resolver.task_type is None and not dist.is_initialized()
    for malformed, words in [("{cluster: ", "is not valid JSON"), ('{"cluster": {"worker": "host0:2222"}}',
                                                                  "is not TF's layout")]:
        monkeypatch.setenv("TF_CONFIG", malformed)
        with pytest.raises(ValueError, match=f"TF_CONFIG={re.escape(repr(malformed))} {words}"):
            md.MultiWorkerMirroredStrategy(devices=["cpu:0"])
    assert not dist.is_initialized()


def test_communication_options(monkeypatch):
    for key in LAUNCH_ENV:
        monkeypatch.delenv(key, raising=False)
    s = md.MultiWorkerMirroredStrategy(md.CommunicationOptions(bytes_per_pack=1024, timeout_seconds=7),
                                       devices="cpu:0")
    assert s.extended.cross_device_ops.bytes_per_pack == 1024 and s._timeout_s == 7.0
    assert repr(s.extended.cross_device_ops) == "CollectiveAllReduce(rank=0, world_size=1, bytes_per_pack=1024)"


# ---- NCCL on a CPU box: fakes of torch.distributed that record what they are handed --------------
class FakeWork:
    def __init__(self, log: list, error: BaseException | None = None):
        self.log, self.error = log, error

    def wait(self, timeout=None):
        self.log.append(("wait", timeout))
        if self.error is not None:
            raise self.error
        return True


class Recorded(Exception):
    """Raised by a fake collective that was handed meta tensors: there is no data to bring back."""


def fake_collectives(monkeypatch, error: BaseException | None = None) -> list:
    """Replaces the collectives multi_worker calls; each records (name, devices of its tensors)."""

    log: list = []

    def record(name):
        def collective(*args, async_op=False, **kwargs):
            tensors = [a for a in args if isinstance(a, torch.Tensor)]
            tensors += [t for a in args if isinstance(a, list) for t in a]
            log.append((name, sorted({t.device.type for t in tensors})))
            assert async_op, f"{name} without async_op: its wait could not be given a timeout"
            return FakeWork(log, error)
        return collective

    for name in ("all_reduce", "all_gather", "broadcast"):
        monkeypatch.setattr(dist, name, record(name))
    return log


def test_backends_and_the_devices_they_carry():
    from mirrored.distribute import multi_worker as mw
    from mirrored.distribute._collectives import _device_types_of

    assert mw._backend_for("cuda:0", "AUTO") == "cpu:gloo,cuda:nccl"  # CPU values go by gloo, not NCCL
    assert mw._backend_for("cpu:0", "AUTO") == mw._backend_for("cuda:0", "RING") == "gloo"
    assert _device_types_of("cpu:gloo,cuda:nccl") == {"cpu", "cuda"}
    assert _device_types_of("nccl") == {"cuda"} and _device_types_of("gloo") == {"cpu"}


def test_a_gpu_worker_creates_a_device_aware_group_with_a_longer_watchdog(monkeypatch):
    """Issue 19: a GPU worker's group was NCCL only, so the CPU count of examples/multi_worker.py's
    step reached NCCL. It is now "cpu:gloo,cuda:nccl", and NCCL's watchdog (which kills the process)
    waits longer than our timeout, whose error names the rank."""
    from mirrored.distribute import multi_worker as mw
    from mirrored.distribute._collectives import _WATCHDOG_GRACE_S

    calls: list = []
    monkeypatch.setattr(mw, "visible_gpus", lambda: ["cuda:0"])
    monkeypatch.setattr(mw, "resolve_devices", lambda devices, where: tuple(devices))
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: calls.append(("set_device", device)))
    monkeypatch.setattr(dist, "init_process_group", lambda backend, **kw: calls.append((backend, kw)))
    monkeypatch.setattr(mw, "_rendezvous_store", lambda resolver, timeout: "store")
    monkeypatch.setattr(md.CollectiveAllReduce, "all_gather_row", lambda self, row, what, dtype=None: [list(row)] * 2)
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    for key, value in dict(RANK="0", WORLD_SIZE="2", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                           MASTER_PORT="29500").items():
        monkeypatch.setenv(key, value)
    s = md.MultiWorkerMirroredStrategy(timeout_s=5)
    backend, kw = calls[1]
    assert backend == "cpu:gloo,cuda:nccl"
    assert kw["timeout"].total_seconds() == 5 + _WATCHDOG_GRACE_S and kw["device_id"] == torch.device("cuda:0")
    assert kw["store"] == "store"
    ops = s.extended.cross_device_ops
    assert ops._wire == torch.device("cuda:0") and ops._carried(torch.ones(1))  # gloo takes the CPU tensor


def test_an_nccl_only_group_gets_cpu_tensors_on_the_wire_device(monkeypatch):
    """Issue 19: in a group made with plain "nccl" (a user's), every collective call hands NCCL only
    tensors on the wire device (the meta device stands in for the GPU here), and waits with our
    timeout, which blocks the host and raises instead of leaving a hang to NCCL's watchdog."""
    from mirrored.distribute import multi_worker as mw

    log = fake_collectives(monkeypatch)
    ops = md.CollectiveAllReduce(0, 2, torch.device("meta"), timeout_s=7.0, backend="nccl")
    cpu = torch.tensor([3.0])
    for call in (lambda: ops.all_sum_([cpu], "sum"), lambda: ops.all_reduce(md.ReduceOp.SUM, [cpu], "reduce"),
                 lambda: ops.gather(torch.ones(2, 1), 0, "gather"), lambda: ops.broadcast_([torch.ones(3)], "b"),
                 lambda: ops.all_gather_row([1, 2], "row")):
        log.clear()
        try:
            call()
        except NotImplementedError as e:  # bringing a meta result back to the CPU: nothing to copy
            assert "meta" in str(e)
        collectives = [entry for entry in log if entry[0] != "wait"]
        assert collectives and all(devices == ["meta"] for _, devices in collectives), log
        assert ("wait", datetime.timedelta(seconds=7.0)) in log
    gloo = md.CollectiveAllReduce(0, 2, torch.device("cpu"), timeout_s=7.0)
    log.clear()
    gloo.all_sum_([cpu], "sum")
    assert log == [("all_reduce", ["cpu"]), ("wait", None)]  # gloo's own timeout applies, as before
    both = md.CollectiveAllReduce(0, 2, torch.device("meta"), timeout_s=7.0, backend="cpu:gloo,cuda:nccl")
    assert both._carried(torch.ones(1)) and both._carried(torch.ones(1, device="meta"))
    assert not gloo._carried(torch.ones(1, device="meta"))  # a tensor off the wire device travels via it


def test_an_nccl_timeout_raised_by_the_wait_names_the_rank(monkeypatch):
    """What a timed-out blocking wait raises becomes CollectiveTimeoutError naming this rank and the op."""
    from mirrored.distribute import multi_worker as mw

    error = dist.DistBackendError("[Rank 1] Work WorkNCCL(SeqNum=5, OpType=ALLREDUCE) timed out in blocking wait.")
    fake_collectives(monkeypatch, error)
    ops = md.CollectiveAllReduce(1, 2, torch.device("cpu"), timeout_s=3.0, backend="cpu:gloo,cuda:nccl")
    with pytest.raises(md.CollectiveTimeoutError, match=r"^rank 1 of 2: all_reduce \(gradients\) \(collective #1 "
                                                        r"of this worker\) timed out after .* \(timeout_s=3"):
        ops.all_sum_([torch.ones(2)], "all_reduce (gradients)")


def test_a_restarted_jobs_errors_name_the_attempt(monkeypatch):
    """Issue 24: after torchrun restarted the workers, a failed collective says which attempt failed."""
    from mirrored.distribute import multi_worker as mw

    fake_collectives(monkeypatch, RuntimeError("Timed out waiting 2000ms for recv operation to complete"))
    ops = md.CollectiveAllReduce(1, 2, torch.device("cpu"), timeout_s=3.0, attempt=2)
    with pytest.raises(md.CollectiveTimeoutError, match=r"^rank 1 of 2 \(restart attempt 2\): all_reduce \(gradients\)"):
        ops.all_sum_([torch.ones(2)], "all_reduce (gradients)")


@pytest.mark.cuda
def test_an_nccl_group_of_one_reduces_cpu_and_gpu_values(tmp_path):  # pragma: no cover - GPU machines only
    """On a real NCCL group (one worker, one GPU): CPU values, GPU values, gather and broadcast come
    back right and where they were; a plain "nccl" group (no gloo for the CPU) too."""
    for backend in ("cpu:gloo,cuda:nccl", "nccl"):
        done = subprocess.run([sys.executable, __file__, "nccl_of_one", str(tmp_path), backend],
                              env={**os.environ, "RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0",
                                   "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())},
                              capture_output=True, text=True, timeout=LAUNCH_DEADLINE_S)
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
        res = json.loads((tmp_path / "rank0.json").read_text())
        assert "crash" not in res, res["crash"]
        assert res == {"sum_cpu": [[3.0], "cpu"], "sum_gpu": [[2.0, 4.0], "cuda:0"], "count": [5, "cpu"],
                       "gather": [[1.0, 1.0], "cpu"], "broadcast": [[7.0], "cpu"], "mean_cpu": [1.5, "cpu"]}, res


def test_example_runs_under_torchrun(tmp_path):
    """examples/multi_worker.py, launched as its docstring says (2 processes), trains and prints on rank 0 only."""
    torchrun = Path(sys.executable).with_name("torchrun")
    example = Path(__file__).resolve().parents[2] / "examples" / "multi_worker.py"
    env = {k: v for k, v in os.environ.items() if k not in LAUNCH_ENV}
    env.update(CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1")
    done = subprocess.run([str(torchrun), "--standalone", "--nproc_per_node=2", str(example), "--epochs", "2"],
                          capture_output=True, text=True, env=env, timeout=LAUNCH_DEADLINE_S * 2)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    epochs = [line for line in done.stdout.splitlines() if line.startswith("epoch ")]
    assert len(epochs) == 2, done.stdout  # printed once per epoch: by rank 0 only


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="threads are listed from Linux's /proc")
def test_a_script_that_ends_normally_leaves_no_gloo_thread_to_interpreter_teardown(tmp_path):
    """Regression (issue 25): rank 1 of examples/multi_worker.py aborted at exit now and then, under
    load ("terminate called without an active exception", -6). The first torch optimizer imports
    torch.distributed.nn, whose `group=group.WORLD` defaults then pinned the group: even
    destroy_process_group() freed nothing, and gloo's threads ran into interpreter teardown. Here a
    script trains a step and just ends; what is left when the interpreter starts tearing down is read
    from the OS's list of this process's threads."""
    assert launch("exit_normally", tmp_path) == [0, 0], logs(tmp_path, 2)
    for rank in range(2):
        path = tmp_path / f"rank{rank}.json"
        assert path.exists(), f"rank {rank} wrote no report\n{logs(tmp_path, 2)}"
        left = json.loads(path.read_text())
        assert not left["initialized"], left  # the group the strategy created was destroyed at exit
        assert [t for t in left["threads"] if "gloo" in t] == [], left


# ---- the worker side: `python test_multi_worker.py SCENARIO OUT_DIR` --------------------------------
def _rank() -> int:
    return md.get_replica_context().replica_id_in_sync_group


def scenario_collectives(s: md.MultiWorkerMirroredStrategy, rank: int) -> dict:
    res: dict = {"num_replicas_in_sync": s.num_replicas_in_sync, "worker_devices": list(s.extended.worker_devices),
                 "repr": repr(s), "cluster_resolver": [s.cluster_resolver.task_type, s.cluster_resolver.task_id,
                                                           s.cluster_resolver.kind, s.cluster_resolver.rank,
                                                           s.cluster_resolver.num_workers],
                 "replica_id_in_sync_group": s.run(_rank),
                 "ctx_num_replicas_in_sync": s.run(lambda: md.get_replica_context().num_replicas_in_sync)}

    def nested():
        ctx, r = md.get_replica_context(), _rank()
        value = {"a": torch.tensor([r + 1.0, 2.0 * (r + 1)]), "b": (torch.tensor(r + 1),)}
        return ctx.all_reduce("sum", value), ctx.all_reduce(md.ReduceOp.MEAN, value)

    total, mean = s.run(nested)

    def differentiated():  # TF's rule: the gradient of an all-reduce is the all-reduce of the gradients
        x = torch.full((3,), float(_rank()), requires_grad=True)
        ((_rank() + 1.0) * md.get_replica_context().all_reduce("sum", x)).sum().backward()
        return x.grad

    res["all_reduce_grad"] = s.run(differentiated).tolist()
    res["all_reduce_sum"] = {"a": total["a"].tolist(), "b": total["b"][0].item()}
    res["all_reduce_mean"] = {"a": mean["a"].tolist(), "b": mean["b"][0].item()}
    ones = s.run(lambda: torch.tensor(float(_rank() + 1)))
    res["reduce_sum"] = s.reduce(md.ReduceOp.SUM, ones).item()
    res["reduce_mean"] = s.reduce(md.ReduceOp.MEAN, ones).item()
    uneven = s.run(lambda: torch.full((_rank() + 1,), float(_rank())))
    res["reduce_sum_axis"] = s.reduce("sum", uneven, axis=0).item()
    res["reduce_mean_axis"] = s.reduce("mean", uneven, axis=0).item()
    res["reduce_mean_int"] = s.reduce("mean", s.run(lambda: torch.tensor([1 + 2 * _rank()]))).tolist()
    rows = s.run(lambda: torch.arange(2 * (_rank() + 1)).reshape(_rank() + 1, 2) + 10 * _rank())
    res["gather_axis0"] = s.gather(rows, axis=0).tolist()
    res["gather_axis1"] = s.gather(s.run(lambda: torch.full((2, _rank() + 1), _rank())), axis=-1).tolist()
    res["gather_bool"] = s.gather(torch.tensor([True, False][:rank + 1]) if rank == 0 else torch.tensor([False, False]),
                                  axis=0).tolist()
    res["cross_device_ops_mean"] = [t.item() for t in s.extended.cross_device_ops.reduce("mean", ones).values]
    res["merge_call"] = s.run(lambda: md.get_replica_context().merge_call(
        lambda strategy, v: strategy.reduce("sum", v), args=(torch.tensor(_rank() + 1.0),))).item()
    values = s.experimental_distribute_values_from_function(
        lambda ctx: torch.tensor([ctx.replica_id_in_sync_group, ctx.num_replicas_in_sync]))
    res["value_context"] = s.experimental_local_results(values)[0].tolist()
    res["values_reduced"] = s.reduce("sum", values).tolist()
    ids = torch.arange(10)
    res["distributed_batches"] = [b.tolist() for b in s.experimental_distribute_dataset(
        [ids[i:i + 4] for i in range(0, 10, 4)])]

    def dataset_fn(ctx):
        res["input_context"] = [ctx.num_input_pipelines, ctx.input_pipeline_id, ctx.num_replicas_in_sync]
        return [torch.tensor([10 * ctx.input_pipeline_id + i]) for i in range(3 - ctx.input_pipeline_id)]

    res["from_function"] = [b.tolist() for b in s.distribute_datasets_from_function(dataset_fn)]

    with s.scope():  # running statistics are averaged across workers after each step
        bn = s.mirror(nn.BatchNorm1d(3))
        bn_opt = s.mirror_optimizer(torch.optim.SGD, bn, lr=0.1)

    def bn_step(x):  # forward updates this worker's statistics; the optimizer then averages them
        bn(x).sum().backward()
        bn_opt.reduce_gradients()
        bn_opt.sync_buffers()

    s.run(bn_step, args=(torch.full((4, 3), rank + 1.0) + torch.arange(4.0).reshape(4, 1),))
    res["bn_running_mean"] = bn.running_mean.tolist()
    s.check_in_sync([bn, bn_opt])

    with s.scope():  # a gradient only rank 0 has is summed with rank 1's zeros; None everywhere stays None
        two = s.mirror(nn.ModuleDict({"used": nn.Linear(2, 1), "unused": nn.Linear(2, 1)}))
        two_opt = s.mirror_optimizer(torch.optim.SGD, two, lr=0.1)

    def partial_backward():
        if _rank() == 0:
            two.used(torch.ones(1, 2)).sum().backward()
        two_opt.reduce_gradients()
        return [p.grad.tolist() for p in two.used.parameters()], [two.unused.weight.grad, two.unused.bias.grad]

    res["grads_used"], unused = s.run(partial_backward)
    res["grads_unused"] = [None if g is None else g.tolist() for g in unused]

    torch.manual_seed(rank)  # different weights on each worker until mirror() broadcasts rank 0's
    with s.scope():
        net = s.mirror(nn.Linear(3, 2))
    res["mirrored_weight"], res["mirrored_bias"] = net.weight.tolist(), net.bias.tolist()
    s.check_in_sync(net)
    if rank == 1:
        with torch.no_grad():
            net.bias[1] += 0.5
    try:
        s.check_in_sync(net)
        res["in_sync_error"] = "no error"
    except md.OutOfSyncError as e:
        res["in_sync_error"] = str(e)
    try:
        s.run(lambda: md.get_replica_context().all_reduce("sum", torch.ones(_rank() + 1)))
    except ValueError as e:
        res["shape_error"] = str(e)
    try:
        s.gather(torch.ones(1, rank + 1), axis=0)
    except ValueError as e:
        res["gather_error"] = str(e)
    res["exit"] = exit_early(s, rank)
    return res


def scenario_training(s: md.MultiWorkerMirroredStrategy, rank: int, reduction: str = "sum") -> dict:
    from safetensors.torch import save_file

    torch.manual_seed(rank)  # rank 0's weights are the reference's (seed 0); mirror() must broadcast them
    net = mlp()
    with s.scope():
        mnet = s.mirror(net)
        opt = s.mirror_optimizer(torch.optim.SGD, mnet, gradient_reduction=reduction, lr=0.1, momentum=0.9)

    def step(x, y, global_size):
        if reduction == "mean":  # DDP's unchanged loss line; the optimizer weighs the workers by their parts
            loss = F.cross_entropy(mnet(x), y)
            loss.backward()
            loss = loss.detach() * len(x) / global_size  # (this worker's share of the batch's mean, to report)
        else:
            loss = F.cross_entropy(mnet(x), y, reduction="sum") / global_size
            loss.backward()
        opt.step()
        opt.zero_grad()
        return loss, len(x)

    data = global_batches()
    losses, parts = [], []
    for _ in range(EPOCHS):
        for (xb, yb), (x, _) in zip(s.experimental_distribute_dataset(data), data):
            loss, size = s.run(step, args=(xb, yb, len(x)))
            losses.append(s.reduce("sum", loss).item())
            parts.append(s.gather(torch.tensor([size]), axis=0).tolist())
    s.check_in_sync([mnet, opt])
    save_file({str(j): p.detach().contiguous() for j, p in enumerate(mnet.parameters())},
              str(OUT_DIR / f"params{rank}.safetensors"))
    return {"losses": losses, "parts": parts}


def scenario_sparse(s: md.MultiWorkerMirroredStrategy, rank: int) -> dict:
    import math
    import warnings

    from safetensors.torch import save_file

    from mirrored.distribute import _sparse

    warnings.filterwarnings("ignore", "Sparse invariant checks")
    strategies = {1: s, 2: md.MultiWorkerMirroredStrategy(devices=["cpu:0", "cpu:1"], timeout_s=COLLECTIVE_TIMEOUT_S)}
    for name, (mode, optimizers, reduction, local) in SPARSE_RUNS.items():
        _sparse._WORKERS_DENSIFY_AT = 0.0 if mode == "densified" else math.inf
        strategy = strategies[local]
        with strategy.scope():
            mnet = strategy.mirror(SparseNet())
            opts = sparse_optimizers(mnet, lambda cls, module, **kw: strategy.mirror_optimizer(
                cls, module, gradient_reduction=reduction, **kw))[optimizers]()

        def step(item, context, y, global_size):
            for opt in opts:
                opt.zero_grad()
            out = mnet(item, context)
            loss = F.cross_entropy(out, y) if reduction == "mean" else F.cross_entropy(out, y, reduction="sum") / global_size
            loss.backward()
            for opt in opts:
                opt.step()

        for _ in range(EPOCHS):
            for batch in sparse_batches():
                parts = next(iter(strategy.experimental_distribute_dataset([batch])))
                strategy.run(step, args=(*parts, len(batch[2])))
        strategy.check_in_sync([mnet, *opts])
        save_file({str(j): p.detach().contiguous() for j, p in enumerate(mnet.values[0].parameters())},
                  str(OUT_DIR / f"sparse-{name}-{rank}.safetensors"))
    return {}


def scenario_fit(s: md.MultiWorkerMirroredStrategy, rank: int) -> dict:
    from safetensors.torch import save_file

    torch.manual_seed(rank)  # rank 0's weights are the reference's (seed 0); Model() must broadcast them
    fit_logs, params, predicted = fit_run(s)
    save_file({str(j): p.contiguous() for j, p in enumerate(params)}, str(OUT_DIR / f"params{rank}.safetensors"))
    return {"logs": fit_logs, "predict": predicted}


def exit_early(s: md.MultiWorkerMirroredStrategy, rank: int) -> dict:
    if rank == 1:
        return {}  # and exits, without joining the next collective
    started = time.monotonic()
    try:
        s.run(lambda: md.get_replica_context().all_reduce("sum", torch.ones(2)))
        return {"error_type": None}
    except Exception as e:  # noqa: BLE001 - the test checks which
        return {"error_type": type(e).__name__, "error": str(e), "elapsed_s": time.monotonic() - started}


def _next_reduce(s: md.MultiWorkerMirroredStrategy) -> dict:
    """How the next collective ends for this rank: its error (type, message, seconds) or none."""
    started = time.monotonic()
    try:
        s.reduce("sum", torch.ones(2))
        return {"error_type": None}
    except Exception as e:  # noqa: BLE001
        return {"error_type": type(e).__name__, "error": str(e), "elapsed_s": time.monotonic() - started}


def scenario_hang(s: md.MultiWorkerMirroredStrategy, rank: int) -> dict:
    s.reduce("sum", torch.ones(1))
    if rank == 1:
        time.sleep(STUCK_S)  # the test kills this process once rank 0 has reported
        return {}
    return _next_reduce(s)


def scenario_rank0_exits(s: md.MultiWorkerMirroredStrategy, rank: int) -> dict:
    s.reduce("sum", torch.ones(1))
    if rank == 0:  # the store's host goes without a word, once rank 1 waits in the next collective
        time.sleep(1.0)
        os._exit(0)
    return _next_reduce(s)


def scenario_training_mean(s: md.MultiWorkerMirroredStrategy, rank: int) -> dict:
    return scenario_training(s, rank, reduction="mean")


SCENARIOS = {"collectives": scenario_collectives, "training": scenario_training, "hang": scenario_hang,
             "training_mean": scenario_training_mean,
             "fit": scenario_fit, "rank0_exits": scenario_rank0_exits, "sparse": scenario_sparse}


def never_arrives() -> dict:
    try:
        md.MultiWorkerMirroredStrategy(timeout_s=HANG_TIMEOUT_S)
        return {"error_type": None}
    except Exception as e:  # noqa: BLE001
        return {"error_type": type(e).__name__, "error": str(e)}
OUT_DIR = Path(".")


def nccl_of_one(backend: str) -> dict:
    """One worker on cuda:0 in a group of `backend`: values on the CPU and on the GPU."""
    torch.cuda.set_device(0)
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S),
                            device_id=torch.device("cuda:0"))
    s = md.MultiWorkerMirroredStrategy(timeout_s=COLLECTIVE_TIMEOUT_S)
    ops = s.extended.cross_device_ops
    out = {}
    total = ops.all_reduce(md.ReduceOp.SUM, [torch.tensor([3.0])], "sum")[0]
    out["sum_cpu"] = [total.tolist(), str(total.device)]
    total = ops.all_reduce(md.ReduceOp.SUM, [torch.tensor([2.0, 4.0], device="cuda:0")], "sum")[0]
    out["sum_gpu"] = [total.tolist(), str(total.device)]
    n = torch.tensor([5])
    ops.all_sum_([n], "count")
    out["count"] = [n.item(), str(n.device)]
    g = ops.gather(torch.ones(2), 0, "gather")
    out["gather"] = [g.tolist(), str(g.device)]
    b = torch.tensor([7.0])
    ops.broadcast_([b], "broadcast")
    out["broadcast"] = [b.tolist(), str(b.device)]
    mean = ops.all_reduce(md.ReduceOp.MEAN, [torch.tensor(1.5)], "mean")[0]
    out["mean_cpu"] = [mean.item(), str(mean.device)]
    dist.destroy_process_group()
    return out


def exit_normally(rank: int) -> None:
    """A training script's life, ended by a plain return to the interpreter (no destroy_process_group,
    no os._exit). A hook registered before the strategy's runs after it: it records what is left."""
    def report() -> None:
        tasks = Path("/proc/self/task")
        names = sorted((tasks / t / "comm").read_text().strip() for t in os.listdir(tasks))
        (OUT_DIR / f"rank{rank}.json").write_text(json.dumps({"threads": names, "initialized": dist.is_initialized()}))

    atexit.register(report)
    s = md.MultiWorkerMirroredStrategy(timeout_s=COLLECTIVE_TIMEOUT_S)
    import torch.distributed.nn  # noqa: F401 - as the first torch optimizer does (through torch._dynamo)
    with s.scope():
        net = s.mirror(mlp())
        opt = s.mirror_optimizer(torch.optim.SGD, net, lr=0.1)

    def step(x, y):
        F.cross_entropy(net(x), y).backward()
        opt.step()
        opt.zero_grad()

    x, y = global_batches()[0]
    s.run(step, args=(x[rank::2], y[rank::2]))
    s.check_in_sync([net, opt])


def _worker_main(scenario: str, out_dir: str) -> None:
    global OUT_DIR
    OUT_DIR = Path(out_dir)
    rank = int(os.environ["RANK"])
    if scenario == "exit_normally":
        exit_normally(rank)
        return  # into interpreter exit, as a script ends
    result: dict
    try:
        if scenario == "nccl_of_one":
            result = nccl_of_one(sys.argv[3])
            (OUT_DIR / f"rank{rank}.json").write_text(json.dumps(result))
            sys.stdout.flush()
            os._exit(0)
        if scenario == "training":  # a process group made before the strategy: the strategy joins it
            dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S))
        if scenario == "never_arrives":
            result = never_arrives()
        else:
            timeout_s = HANG_TIMEOUT_S if scenario == "hang" else COLLECTIVE_TIMEOUT_S
            result = SCENARIOS[scenario](md.MultiWorkerMirroredStrategy(timeout_s=timeout_s), rank)
    except BaseException:  # noqa: BLE001 - reported to the test through the results file
        result = {"crash": traceback.format_exc()}
    (OUT_DIR / f"rank{rank}.json").write_text(json.dumps(result))
    if scenario == "training" and "crash" not in result:
        dist.destroy_process_group()  # as a training script should; after a failed collective it could block
    # os._exit, not sys.exit: the result is on disk, and C++ teardown of a gloo group whose peer
    # already left can std::terminate (seen under load: "terminate called without an active
    # exception", exit -6). A group the strategy made is destroyed at exit (issue 25; tested by
    # exit_normally), but not the `training` scenario's own group, nor one after a failed collective.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(1 if "crash" in result else 0)


if __name__ == "__main__":
    _worker_main(sys.argv[1], sys.argv[2])
