"""Keras's own fit under MultiWorkerMirroredStrategy (issue 34): 2 worker processes of 1 CPU replica each,
started on 127.0.0.1 with torchrun's variables (as tests/distribute/test_multi_worker_launch.py starts
them), each running the same program - a Keras model built and compiled in the scope, Keras's own
fit with ModelCheckpoint, evaluate and predict - end equal to one process with 2 replicas: weights,
History, evaluate and predict within 1e-6 (the same sums, reduced in another order), the workers
bitwise equal, and the checkpoint written once, by the chief.

Worker processes run this file: `python test_keras_fit_multi_worker.py OUT_DIR`.
"""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import traceback
from pathlib import Path

import numpy as np
import pytest

DEADLINE_S = 180.0
LAUNCH_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "TF_CONFIG")


def program(strategy, out_dir: Path, seed: int) -> dict:
    """The program every worker runs (and the reference, on 2 replicas of one process)."""
    import keras

    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(70, 6)).astype("float32"), rng.integers(0, 3, 70)  # batches 16 x 4 and 6
    seen: list[int] = []

    class Probe(keras.layers.Layer):  # the batch sizes a replica's copy trains on
        def call(self, inputs, training=None):
            if training and inputs.device.type != "meta":
                seen.append(int(inputs.shape[0]))
            return inputs

    keras.utils.set_random_seed(seed)  # the workers build different weights: rank 0's are broadcast
    with strategy.scope():
        model = keras.Sequential([keras.Input((6,)), Probe(), keras.layers.Dense(16, activation="relu"),
                                  keras.layers.Dense(3, activation="softmax")])
        model.compile(optimizer=keras.optimizers.SGD(learning_rate=0.1, momentum=0.9),
                      loss="sparse_categorical_crossentropy", metrics=["accuracy"])
    # BackupAndRestore's file operations in this process: a double backup saved every 2 batches copies
    # and writes in the shared directory, and deletes it at the end - which every worker did, racing
    from keras.src.callbacks import backup_and_restore

    files = backup_and_restore.file_utils
    done: list[str] = []
    originals = {name: getattr(files, name) for name in ("makedirs", "copy", "rmtree")}

    def counted(name):
        def call(*args, **kwargs):
            done.append(name)
            return originals[name](*args, **kwargs)
        return call

    for name in originals:
        setattr(files, name, counted(name))
    try:
        history = model.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0,
                            callbacks=[keras.callbacks.ModelCheckpoint(str(out_dir / "ckpt.keras")),
                                       keras.callbacks.BackupAndRestore(str(out_dir / "backup"), save_freq=2,
                                                                        double_checkpoint=True)])
    finally:
        for name, original in originals.items():
            setattr(files, name, original)
    evaluated = model.evaluate(x, y, batch_size=16, verbose=0, return_dict=True)
    predicted = model.predict(x[:21], batch_size=16, verbose=0)
    strategy.check_in_sync(model)
    return {"weights": [w.tolist() for w in model.get_weights()], "history": history.history,
            "evaluate": evaluated, "predict": predicted.tolist(), "seen": sorted(seen),
            "backup_files": sorted(set(done)), "backup_left": (out_dir / "backup").exists()}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.timeout(300)
def test_two_workers_of_one_replica_equal_one_process_of_two(tmp_path):
    os.environ.setdefault("KERAS_BACKEND", "torch")
    keras = pytest.importorskip("keras")
    if keras.backend.backend() != "torch":
        pytest.skip("keras was imported with another backend than torch")
    from _replicas import strategy_of  # tests/_replicas.py

    port = free_port()
    base = {k: v for k, v in os.environ.items() if k not in LAUNCH_VARS and not k.startswith("TORCHELASTIC_")}
    procs = []
    try:
        for rank in range(2):
            env = {**base, "RANK": str(rank), "WORLD_SIZE": "2", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
                   "MASTER_PORT": str(port), "KERAS_BACKEND": "torch", "OMP_NUM_THREADS": "1",
                   "CUDA_VISIBLE_DEVICES": ""}
            with open(tmp_path / f"w{rank}.log", "w") as log:
                procs.append(subprocess.Popen([sys.executable, __file__, str(tmp_path)], env=env, stdout=log,
                                              stderr=subprocess.STDOUT))
        deadline = time.monotonic() + DEADLINE_S
        codes = [p.wait(timeout=max(0.1, deadline - time.monotonic())) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait()
    logs = "\n".join((tmp_path / f"w{r}.log").read_text()[-3000:] for r in range(2))
    assert codes == [0, 0], logs
    workers = [json.loads((tmp_path / f"w{r}.json").read_text()) for r in range(2)]
    # BackupAndRestore: the chief made, wrote and deleted the backup directory; the other worker touched
    # nothing in it
    assert [w.pop("backup_files") for w in workers] == [["copy", "makedirs", "rmtree"], []]
    assert not (tmp_path / "backup").exists() and not any(w.pop("backup_left") for w in workers)
    assert workers[0] == workers[1]  # bitwise: the same floats on both workers
    assert workers[0]["seen"] == sorted([8] * 8 + [3] * 2)  # each worker's replica trains on half of each batch
    assert sorted(p.name for p in tmp_path.iterdir() if p.suffix == ".keras") == ["ckpt.keras"]
    one = tmp_path / "one"
    one.mkdir()
    reference = program(strategy_of(2), one, seed=0)
    assert reference.pop("backup_files") == ["copy", "makedirs", "rmtree"] and not reference.pop("backup_left")
    ours = workers[0]
    for a, b in zip(ours["weights"], reference["weights"]):
        np.testing.assert_allclose(np.array(a), np.array(b), atol=1e-6)
    for key in reference["history"]:
        np.testing.assert_allclose(ours["history"][key], reference["history"][key], atol=1e-6, err_msg=key)
    np.testing.assert_allclose([ours["evaluate"][k] for k in reference["evaluate"]],
                               list(reference["evaluate"].values()), atol=1e-6)
    np.testing.assert_allclose(np.array(ours["predict"]), np.array(reference["predict"]), atol=1e-6)
    saved = keras.models.load_model(tmp_path / "ckpt.keras", compile=False,
                                    custom_objects={"Probe": keras.layers.Identity})
    for a, b in zip(saved.get_weights(), ours["weights"]):
        np.testing.assert_array_equal(a, np.array(b, dtype=a.dtype))


def _worker_main(out_dir: str) -> None:
    os.environ["KERAS_BACKEND"] = "torch"
    import mirrored as mr

    rank = int(os.environ["RANK"])
    try:
        strategy = mr.MultiWorkerMirroredStrategy(devices=["cpu:0"], timeout_s=60.0)
        result = program(strategy, Path(out_dir), seed=rank)
    except BaseException:  # noqa: BLE001 - reported to the test through the log and the exit code
        traceback.print_exc()
        sys.stdout.flush()
        os._exit(1)
    (Path(out_dir) / f"w{rank}.json").write_text(json.dumps(result))
    sys.stdout.flush()
    # os._exit: the result is on disk, and tearing down a gloo group whose peer already left can abort.
    os._exit(0)


if __name__ == "__main__":
    _worker_main(sys.argv[1])
