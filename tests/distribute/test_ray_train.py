"""Issue 36: Ray Train as users run it - `TorchTrainer` with 2 CPU workers on this machine, Ray creating the
process group, and `mr.MultiWorkerMirroredStrategy()` inside the training function finding it. Runs where
ray[train] is installed (it is not in the test extra: ~500 MB with pyarrow and pandas) and is `slow`: a
local Ray cluster takes ~15 s to start on 2 cores.

The reference is MirroredStrategy on 2 replicas in this process, which both workers must equal bitwise
(the same sums in the same order). Checkpoints go both ways: the chief reports a Model.save file through
ray.train.report (Ray's storage), and BackupAndRestore writes to a folder of ours, from which the run
resumes when Ray restarts the worker group after a worker died (FailureConfig(max_failures=1)).

Ray's driver runs in a subprocess (this file as a script): Ray's threads and processes stay out of pytest's.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

pytest.importorskip("ray.train.torch", reason="Ray Train is not installed (pip install 'ray[train]')")
pytestmark = pytest.mark.slow

N, GLOBAL_BATCH, EPOCHS = 24, 6, 3
DEADLINE_S = 300


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 3))


def _fit(strategy, callbacks=()):
    import mirrored as mr

    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(N, 5, generator=g), torch.randint(0, 3, (N,), generator=g)
    with strategy.scope():
        model = mr.Model(_net())
        model.compile(optimizer=mr.optimizers.SGD(learning_rate=0.1, momentum=0.9),
                      loss="sparse_categorical_crossentropy")
    data = mr.data.Dataset.from_tensor_slices((x, y)).shuffle(N, seed=3).batch(GLOBAL_BATCH)
    model.fit(data, epochs=EPOCHS, verbose=0, callbacks=list(callbacks))
    return model


def _run(tmp_path: Path, die: bool) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": "", "RAY_USAGE_STATS_ENABLED": "0"}
    env = {k: v for k, v in env.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "TF_CONFIG")}
    done = subprocess.run([sys.executable, __file__, str(tmp_path), "die" if die else "live"], env=env,
                          capture_output=True, text=True, timeout=DEADLINE_S)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-6000:]
    return json.loads((tmp_path / "driver.json").read_text())


def _want() -> list[torch.Tensor]:
    import mirrored as mr

    return [p.detach() for p in _fit(mr.MirroredStrategy(devices=["cpu:0", "cpu:1"])).module.parameters()]


def _params(path: Path) -> list[torch.Tensor]:
    from safetensors.torch import load_file

    saved = load_file(str(path))
    return [saved[str(j)] for j in range(len(saved))]


def _check(tmp_path: Path, result: dict) -> None:
    want = _want()
    for rank in (0, 1):
        worker = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert worker["kind"] == "ray" and worker["num_workers"] == 2 and worker["rank"] == rank, worker
        for j, (got, w) in enumerate(zip(_params(tmp_path / f"rank{rank}.safetensors"), want)):
            assert torch.equal(got, w), f"rank {rank}, parameter {j}: {(got - w).abs().max().item():.3g}"
    # Ray's storage: the chief's Model.save, reported with ray.train.report, loads into the same weights.
    import mirrored as mr

    reported = mr.Model.load(result["checkpoint"], module=_net())
    for j, (got, w) in enumerate(zip(reported.module.parameters(), want)):
        assert torch.equal(got.detach(), w), f"the reported checkpoint's parameter {j}"


def test_ray_train_workers_equal_mirrored_strategy_and_report_a_checkpoint(tmp_path):
    _check(tmp_path, _run(tmp_path, die=False))


def test_a_ray_train_run_whose_worker_died_resumes_from_our_backup(tmp_path):
    """Worker 1 exits in epoch 2 of the first attempt; Ray starts a new worker group (max_failures=1), whose
    fit resumes from BackupAndRestore's backup and ends bitwise where an uninterrupted run does."""
    result = _run(tmp_path, die=True)
    assert (tmp_path / "died").exists() and result["attempts"] == 2, result
    _check(tmp_path, result)
    # 12 steps in all; the backup every 2 steps was written after the 6th, where worker 1 died: 6 remain
    assert [json.loads((tmp_path / f"rank{r}.json").read_text())["batches"] for r in (0, 1)] == [6, 6]


# ---- the driver and the training function (this file run as a script) ----------------------------------------
def _train(config: dict) -> None:
    import ray.train
    from safetensors.torch import save_file

    import mirrored as mr

    out = Path(config["out"])
    strategy = mr.MultiWorkerMirroredStrategy()  # Ray made the process group: the strategy joins it
    resolver = strategy.cluster_resolver
    with open(out / "attempts", "a") as f:
        f.write(f"{resolver.rank}\n")

    class Die(mr.callbacks.Callback):
        batches = 0

        def on_epoch_begin(self, epoch, logs=None):
            self.epoch = epoch

        def on_train_batch_end(self, batch, logs=None):
            Die.batches += 1
            if config["die"] and resolver.rank == 1 and self.epoch == 1 and batch == 1 and not (out / "died").exists():
                (out / "died").write_text("1")
                os._exit(1)

    model = _fit(strategy, [mr.callbacks.BackupAndRestore(out / "backup", save_freq=2), Die()])
    model.check_in_sync()
    save_file({str(j): p.detach().contiguous() for j, p in enumerate(model.module.parameters())},
              str(out / f"rank{resolver.rank}.safetensors"))
    (out / f"rank{resolver.rank}.json").write_text(json.dumps(
        {"kind": resolver.kind, "rank": resolver.rank, "num_workers": resolver.num_workers, "batches": Die.batches}))
    staging = out / f"staging{resolver.rank}"
    staging.mkdir(exist_ok=True)
    model.save(staging / "model.safetensors")  # (the chief writes; the others return)
    checkpoint = ray.train.Checkpoint.from_directory(str(staging)) if resolver.is_chief else None
    ray.train.report({"epochs": EPOCHS}, checkpoint=checkpoint)


def _driver(out: Path, die: bool) -> None:
    import ray
    from ray.train import FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=True)
    try:
        trainer = TorchTrainer(_train, train_loop_config={"out": str(out), "die": die},
                               scaling_config=ScalingConfig(num_workers=2, use_gpu=False),
                               run_config=RunConfig(storage_path=str(out / "ray"), name="mirrored",
                                                    failure_config=FailureConfig(max_failures=1)))
        result = trainer.fit()
        with result.checkpoint.as_directory() as directory:
            local = out / "reported.safetensors"
            local.write_bytes((Path(directory) / "model.safetensors").read_bytes())
    finally:
        ray.shutdown()
    attempts = (out / "attempts").read_text().split()
    (out / "driver.json").write_text(json.dumps({"checkpoint": str(local), "attempts": len(attempts) // 2}))


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    _driver(Path(sys.argv[1]), sys.argv[2] == "die")
