"""Issue 24, the data half: every example once per epoch on 2 real worker processes, one writer, FILE sharding.

Each test starts 2 workers with subprocess.Popen running this file as a script (`python
test_multi_worker_data.py SCENARIO OUT_DIR`) with RANK, WORLD_SIZE, MASTER_ADDR=127.0.0.1 and a free
MASTER_PORT set by hand, as torchrun would. The programs seed nothing alike: `torch.seed()` (a seed
from the OS) or `torch.manual_seed(seed + rank)`. Every training forward records the example ids
it sees (column 0 of x), and the test counts them per epoch across both workers against range(N):
each exactly once is the reference, independent of how the library splits the data. Every launch has
a hard deadline after which its workers are killed.
"""
from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
import traceback
from pathlib import Path

import pytest
import torch
from torch import nn

from _workers import free_port, log_tails, read_results, run_workers  # tests/distribute/_workers.py

N, BATCH, EPOCHS = 64, 8, 2
FILES, PER_FILE = 4, 16  # FILE sharding: 4 TFRecord files of 16 examples
LAUNCH_DEADLINE_S = 150.0
COLLECTIVE_TIMEOUT_S = 60.0


# ---- launching -----------------------------------------------------------------------------------
def launch(scenario: str, out_dir: Path, world: int = 2) -> list[int | None]:
    """Runs `scenario` on `world` worker processes; their exit codes. Every worker is dead on return."""
    port = free_port()
    envs = []
    for rank in range(world):
        env = {k: v for k, v in os.environ.items() if not k.startswith("TORCHELASTIC_")}
        env.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=str(port), OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")
        envs.append(env)
    return run_workers(__file__, scenario, out_dir, envs, _names(world), LAUNCH_DEADLINE_S)


def _names(world: int) -> list[str]:
    return [f"rank{r}" for r in range(world)]


def logs(out_dir: Path, world: int = 2) -> str:
    return log_tails(out_dir, _names(world))


def results(out_dir: Path, world: int = 2) -> list[dict]:
    return read_results(out_dir, _names(world))


def assert_every_example_once_per_epoch(res: list[dict]) -> None:
    for epoch in range(EPOCHS):
        seen = sorted(i for r in res for i in r["seen"][epoch])
        assert seen == list(range(N)), (f"epoch {epoch}: {len(set(seen))} of {N} examples trained on, "
                                        f"{len(seen) - len(set(seen))} repeats")


# ---- the tests -----------------------------------------------------------------------------------
def test_unseeded_fit_on_arrays_trains_every_example_once_and_only_the_chief_writes(tmp_path):
    """fit(x, y) shuffles with a seed drawn on the chief and shared, so two workers seeded from the OS
    train every example exactly once per epoch (49-50 of 64 before); CSVLogger, TensorBoard,
    ModelCheckpoint, Model.save and the progress bar write from the chief only: one header, one row per
    epoch, one "Epoch 1/2" line."""
    assert launch("fit_arrays", tmp_path) == [0, 0], logs(tmp_path)
    assert_every_example_once_per_epoch(results(tmp_path))
    with open(tmp_path / "shared" / "log.csv", newline="") as f:
        rows = list(csv.reader(f))
    assert rows[0][:2] == ["epoch", "accuracy"] and [row[0] for row in rows[1:]] == ["0", "1"], rows
    output = (tmp_path / "rank0.log").read_text() + (tmp_path / "rank1.log").read_text()
    assert output.count("Epoch 1/2") == 1 and output.count("Epoch 2/2") == 1, output
    assert (tmp_path / "rank1.log").read_text().count("loss:") == 0, output
    events = list((tmp_path / "shared" / "tb" / "train").iterdir())
    assert len(events) == 1, events  # one event file: the chief's
    assert sorted(p.name for p in (tmp_path / "shared").iterdir()) == ["ckpt-1.safetensors", "ckpt-2.safetensors",
                                                                       "log.csv", "model.safetensors", "tb"]


def test_unseeded_pipeline_shuffle_with_seed_plus_rank_trains_every_example_once(tmp_path):
    """Dataset.shuffle without a seed under the common torch.manual_seed(seed + rank): the chief's seed
    is shared (42 of 64 examples trained before, some twice)."""
    assert launch("pipeline_seed_plus_rank", tmp_path) == [0, 0], logs(tmp_path)
    assert_every_example_once_per_epoch(results(tmp_path))


def test_workers_reading_different_batches_is_an_error_naming_them(tmp_path):
    """A list of batches in a rank-dependent order (as an unseeded DataLoader gives): the digest of the
    first global batch differs, and fit raises on both workers, naming them, before a step."""
    assert launch("different_orders", tmp_path) == [0, 0], logs(tmp_path)
    for res in results(tmp_path):
        assert "the workers read different first batches (worker(s) 0: digest" in res["error"], res
        assert "; worker(s) 1: digest" in res["error"] and res["seen"] == [], res


def write_files(directory: Path) -> None:
    from mirrored.data.tfrecord import encode_example, write_records

    g = torch.Generator().manual_seed(3)
    x, y = torch.randn(N, 4, generator=g), torch.randint(0, 3, (N,), generator=g)
    for f in range(FILES):
        ids = range(f * PER_FILE, (f + 1) * PER_FILE)
        write_records(directory / f"train-{f}.tfrecord",
                      [encode_example({"id": [i], "x": x[i], "y": [int(y[i])]}) for i in ids])


def test_file_sharding_parses_half_the_records_per_worker_and_trains_each_once(tmp_path):
    """AutoShardPolicy.FILE over 4 TFRecord files (list_files unseeded, seed + rank): each worker opens
    2 whole files and parses only their 32 records, and each epoch trains every example exactly once.
    Then OFF on the same pipeline: every worker reads all of it, each example trained on twice; and HINT
    with a shard(SHARD_HINT, SHARD_HINT) placeholder: each example once."""
    write_files(tmp_path)
    assert launch("file_sharding", tmp_path) == [0, 0], logs(tmp_path)
    res = results(tmp_path)
    assert_every_example_once_per_epoch(res)
    for r in res:
        assert r["parsed"] == N // 2 * EPOCHS, r["parsed"]  # half of the records, per epoch
        assert len(r["ids_by_file"]) == FILES // 2  # whole files: every id of a file it read
    assert sorted(f for r in res for f in r["ids_by_file"]) == list(range(FILES))
    # OFF: every worker reads everything, so each example is trained on once per worker
    assert sorted(i for r in res for i in r["seen_off"]) == sorted(list(range(N)) * 2)
    # HINT: shard(SHARD_HINT, SHARD_HINT) after the records becomes shard(2, rank): each example once
    assert sorted(i for r in res for i in r["seen_hint"]) == list(range(N))


# ---- the worker side -----------------------------------------------------------------------------
SEEN: list[int] = []


class Recorder(nn.Module):
    """A linear classifier on x[:, 1:] that records the example ids (x[:, 0]) each training forward sees."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training:
            SEEN.extend(int(i) for i in x[:, 0].tolist())
        return self.fc(x[:, 1:])


def _model(strategy):
    import mirrored as mr

    with strategy.scope():
        model = mr.Model(Recorder())
        model.compile(optimizer=mr.optimizers.SGD(learning_rate=0.1), loss="sparse_categorical_crossentropy",
                      metrics=["accuracy"])
    return model


def _epochs_callback(per_epoch: list[list[int]]):
    import mirrored as mr

    class Snapshot(mr.callbacks.Callback):
        def on_epoch_end(self, epoch, logs=None):
            per_epoch.append(list(SEEN))
            SEEN.clear()
    return Snapshot()


def _arrays() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    x, y = torch.randn(N, 4, generator=g), torch.randint(0, 3, (N,), generator=g)
    return torch.cat([torch.arange(N, dtype=torch.float32)[:, None], x], 1), y


def scenario_fit_arrays(strategy, rank: int, out: Path) -> dict:
    import mirrored as mr

    torch.seed()  # each process its own seed, from the OS
    shared = out / "shared"
    seen: list[list[int]] = []
    model = _model(strategy)
    x, y = _arrays()
    callbacks = [_epochs_callback(seen), mr.callbacks.CSVLogger(shared / "log.csv"),
                 mr.callbacks.TensorBoard(shared / "tb"),
                 mr.callbacks.ModelCheckpoint(str(shared / "ckpt-{epoch}.safetensors"))]
    model.fit(x, y, batch_size=BATCH, epochs=EPOCHS, callbacks=callbacks, verbose=1)
    model.save(shared / "model.safetensors")
    return {"seen": seen}


def scenario_pipeline_seed_plus_rank(strategy, rank: int, out: Path) -> dict:
    import mirrored as mr

    torch.manual_seed(1234 + rank)
    seen: list[list[int]] = []
    model = _model(strategy)
    ds = mr.data.Dataset.from_tensor_slices(_arrays()).shuffle(N).batch(BATCH)
    model.fit(ds, epochs=EPOCHS, callbacks=[_epochs_callback(seen)], verbose=0)
    return {"seen": seen}


def scenario_different_orders(strategy, rank: int, out: Path) -> dict:
    x, y = _arrays()
    order = torch.randperm(N, generator=torch.Generator().manual_seed(rank))
    batches = [(x[order[i:i + BATCH]], y[order[i:i + BATCH]]) for i in range(0, N, BATCH)]
    model = _model(strategy)
    try:
        model.fit(batches, epochs=EPOCHS, verbose=0)
    except ValueError as e:
        return {"error": str(e), "seen": list(SEEN)}
    return {"error": None, "seen": list(SEEN)}


def scenario_file_sharding(strategy, rank: int, out: Path) -> dict:
    import mirrored as mr
    from mirrored.data.tfrecord import parse_example

    torch.manual_seed(99 + rank)
    parsed: list[int] = []

    def parse(record: bytes):
        ex = parse_example(record)
        parsed.append(int(ex["id"][0]))
        x = torch.cat([torch.tensor([float(ex["id"][0])]), torch.from_numpy(ex["x"])])
        return x, torch.tensor(int(ex["y"][0]))

    options = mr.data.Options()
    options.experimental_distribute.auto_shard_policy = mr.data.experimental.AutoShardPolicy.FILE
    files = mr.data.Dataset.list_files(str(out / "train-*.tfrecord"))  # shuffled, seed drawn per process
    ds = mr.data.TFRecordDataset(files).map(parse).shuffle(N).batch(BATCH).with_options(options)
    seen: list[list[int]] = []
    model = _model(strategy)
    model.fit(ds, epochs=EPOCHS, callbacks=[_epochs_callback(seen)], verbose=0)
    result = {"seen": seen, "parsed": len(parsed), "ids_by_file": sorted({i // PER_FILE for i in parsed})}
    off = mr.data.Options()
    off.experimental_distribute.auto_shard_policy = mr.data.experimental.AutoShardPolicy.OFF
    seen_off: list[list[int]] = []
    model.fit(ds.with_options(off), epochs=1, callbacks=[_epochs_callback(seen_off)], verbose=0)
    hint = mr.data.experimental.SHARD_HINT
    hinted = mr.data.TFRecordDataset(files).shard(hint, hint).map(parse).batch(BATCH)
    options = mr.data.Options()
    options.experimental_distribute.auto_shard_policy = mr.data.experimental.AutoShardPolicy.HINT
    seen_hint: list[list[int]] = []
    model.fit(hinted.with_options(options), epochs=1, callbacks=[_epochs_callback(seen_hint)], verbose=0)
    return {**result, "seen_off": seen_off[0], "seen_hint": seen_hint[0]}


SCENARIOS = {"fit_arrays": scenario_fit_arrays, "pipeline_seed_plus_rank": scenario_pipeline_seed_plus_rank,
             "different_orders": scenario_different_orders, "file_sharding": scenario_file_sharding}


def _worker_main(scenario: str, out_dir: str) -> None:
    import mirrored as mr

    rank = int(os.environ["RANK"])
    out = Path(out_dir)
    try:
        result = SCENARIOS[scenario](mr.MultiWorkerMirroredStrategy(timeout_s=COLLECTIVE_TIMEOUT_S), rank, out)
    except BaseException:  # noqa: BLE001 - reported to the test through the results file
        result = {"crash": traceback.format_exc()}
    (out / f"rank{rank}.json").write_text(json.dumps(result))
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(1 if "crash" in result else 0)  # (as test_multi_worker.py: avoids gloo's teardown race)


if __name__ == "__main__":
    _worker_main(sys.argv[1], sys.argv[2])
