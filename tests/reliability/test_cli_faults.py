"""Issue 17 (and 13): the CLI answers a user's mistake with one line naming the path and the problem
and exit status 2, never a traceback; a bug of ours still shows one. `mirrored train` validates on
held-out training data and looks at the test split once, after training."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from torch import nn

import mirrored as mr
from mirrored import cli


def _one_line_error(capsys, *must_contain: str) -> str:
    err = capsys.readouterr().err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    for text in must_contain:
        assert text in err, err
    return err


def _other_model_backup(path) -> None:
    """A real BackupAndRestore file at `path`, written by a fit of a model that is not the CLI's ResNet."""
    with mr.MirroredStrategy(devices=["cpu:0"]).scope():
        model = mr.Model(nn.Sequential(nn.Linear(4, 3)))
        model.compile(optimizer=mr.optimizers.SGD(learning_rate=0.1, momentum=0.9),
                      loss="sparse_categorical_crossentropy")
    g = torch.Generator().manual_seed(0)
    data = mr.data.Dataset.from_tensor_slices((torch.randn(8, 4, generator=g),
                                               torch.randint(0, 3, (8,), generator=g))).batch(4)
    model.fit(data, epochs=1, verbose=0,
              callbacks=[mr.callbacks.BackupAndRestore(path.parent, delete_checkpoint=False)])
    assert path.is_file()


@pytest.mark.parametrize("damage", ["empty", "garbage", "truncated", "other model"])
def test_resume_from_a_damaged_backup_is_one_line(tmp_path, capsys, damage):
    out = tmp_path / "run"
    backup = out / "backup" / "training_state.safetensors"
    _other_model_backup(backup)
    if damage == "empty":
        backup.write_bytes(b"")
    elif damage == "garbage":
        backup.write_bytes(os.urandom(4096))
    elif damage == "truncated":
        backup.write_bytes(backup.read_bytes()[:300])
    argv = ["train", "--resume", "--epochs", "1", "--out", str(out), "--verbose", "0"]
    assert cli.main(argv) == 2
    err = _one_line_error(capsys, "mirrored train: error: --resume: ", str(backup), "drop --resume")
    if damage == "other model":
        assert "the tensors do not match the model 'model'" in err and "delete it to start afresh" in err
    assert backup.exists()  # the user's file is left for them to look at


def test_resume_when_the_backup_is_a_directory_is_one_line(tmp_path, capsys):
    """Audit of issue 17: a directory where the backup file belongs gave IsADirectoryError's traceback."""
    out = tmp_path / "run"
    backup = out / "backup" / "training_state.safetensors"
    backup.mkdir(parents=True)
    assert cli.main(["train", "--resume", "--epochs", "1", "--out", str(out), "--verbose", "0"]) == 2
    _one_line_error(capsys, "mirrored train: error: --resume: ", str(backup), "drop --resume")
    assert backup.is_dir()


def test_an_empty_out_is_refused_instead_of_writing_into_the_current_folder(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as info:
        cli.main(["train", "--out", "", "--epochs", "1"])
    assert info.value.code == 2
    assert "argument --out: expected a folder" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


def test_bench_refuses_replica_counts_far_beyond_the_cores(capsys, monkeypatch):
    """Audit of issue 17: `mirrored bench --replicas 1000` reached the first of 1000 process starts."""
    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    for argv in (["--replicas", "1000"], ["--scaling", "1,2,64"]):
        assert cli.main(["bench", *argv]) == 2
        err = capsys.readouterr().err
        assert "bench:" in err and "on 2 core(s)" in err and "use at most 8" in err


@pytest.mark.parametrize("content", [b"", b"\x80\x04garbage", b"{\"not\": \"a checkpoint\"}", "truncated",
                                     "directory", "fifo"])
def test_evaluate_on_a_damaged_checkpoint_is_one_line(tmp_path, capsys, content):
    path = tmp_path / "model.safetensors"
    if content == "truncated":
        with mr.MirroredStrategy(devices=["cpu:0"]).scope():
            mr.Model(mr.models.resnet_cifar(depth=8, width=4, num_classes=3)).save(path)
        path.write_bytes(path.read_bytes()[:-100])
    elif content == "directory":
        path.mkdir()
    elif content == "fifo":
        os.mkfifo(path)
    else:
        path.write_bytes(content)
    assert cli.main(["evaluate", str(path)]) == 2
    _one_line_error(capsys, "mirrored evaluate: error: ", str(path))


def test_evaluate_with_a_damaged_run_json_is_one_line(tmp_path, capsys):
    with mr.MirroredStrategy(devices=["cpu:0"]).scope():
        mr.Model(mr.models.resnet_cifar(depth=8, width=4, num_classes=10)).save(tmp_path / "model.safetensors")
    (tmp_path / "run.json").write_text("{broken")
    assert cli.main(["evaluate", str(tmp_path / "model.safetensors")]) == 2
    _one_line_error(capsys, str(tmp_path / "run.json"), "--dataset")


@pytest.mark.parametrize("where", ["under a file", "is a file", "read-only"])
def test_an_impossible_or_unwritable_out_is_one_line_before_training(tmp_path, capsys, monkeypatch, where):
    trained = []
    monkeypatch.setattr(mr.Model, "fit", lambda *a, **k: trained.append(1))
    blocker = tmp_path / "file"
    blocker.write_text("x")
    out = {"under a file": blocker / "run", "is a file": blocker, "read-only": tmp_path / "ro" / "run"}[where]
    if where == "read-only":
        if os.geteuid() == 0:
            pytest.skip("root writes into read-only folders")
        (tmp_path / "ro").mkdir(mode=0o500)
    assert cli.main(["train", "--out", str(out), "--epochs", "1"]) == 2
    _one_line_error(capsys, f"--out {str(out)!r}: cannot write there")
    assert trained == []


def test_a_failed_write_into_out_mid_run_is_one_line(tmp_path, capsys, monkeypatch):
    out = tmp_path / "run"

    def disk_full(self, path):
        raise OSError(28, "No space left on device", str(path))

    monkeypatch.setattr(mr.Model, "save", disk_full)
    assert cli.main(["train", "--out", str(out), "--epochs", "1", "--verbose", "0"]) == 2
    # The first save is ModelCheckpoint's, after the first epoch.
    _one_line_error(capsys, "No space left on device", str(out / "best.safetensors"))


@pytest.mark.parametrize("dataset", ["digits", "folder:{tmp}"])
def test_data_dir_with_a_dataset_that_does_not_read_it_is_an_error(tmp_path, capsys, dataset):
    """Issue 17: `mirrored train --data-dir X` with digits ignored X silently."""
    dataset = dataset.format(tmp=tmp_path)
    assert cli.main(["train", "--dataset", dataset, "--data-dir", str(tmp_path), "--out", str(tmp_path)]) == 2
    _one_line_error(capsys, f"--data-dir {str(tmp_path)!r}: --dataset {dataset} does not read a data directory")
    with mr.MirroredStrategy(devices=["cpu:0"]).scope():
        mr.Model(mr.models.resnet_cifar(depth=8, width=4, num_classes=10)).save(tmp_path / "m.safetensors")
    assert cli.main(["evaluate", str(tmp_path / "m.safetensors"), "--data-dir", str(tmp_path)]) == 2
    _one_line_error(capsys, "does not read a data directory")


@pytest.mark.parametrize("bug", [RuntimeError("a bug of ours"), KeyError("internal"),
                                 OSError(2, "No such file or directory", "/nowhere/internal.bin")])
def test_our_own_bugs_still_show_a_traceback(tmp_path, monkeypatch, bug):
    def broken(name):
        raise bug

    monkeypatch.setattr(cli, "_splits", broken)
    with pytest.raises(type(bug)):
        cli.main(["train", "--out", str(tmp_path), "--epochs", "1"])


def test_too_many_cpu_replicas_for_memory_are_refused_before_anything_is_built(tmp_path, capsys, monkeypatch):
    """Issue 17: --replicas 1000 on a 2-core box started 1,001 threads and grew past 5.5 GB."""
    monkeypatch.setattr(mr.distribute.devices, "available_memory_bytes", lambda: 4 << 30)
    built = []
    monkeypatch.setattr(mr, "MirroredStrategy", lambda *a, **k: built.append(1))
    assert cli.main(["train", "--replicas", "1000", "--out", str(tmp_path)]) == 2
    err = _one_line_error(capsys, "--replicas 1000 (resnet_cifar at 32x32, global batch 32000): 1000 CPU replicas "
                                  "need about", "but 4.0 GB of memory is available", "Use at most")
    assert built == []
    per_copy_mb = float(err.split("(")[2].split(" MB per replica")[0])
    assert 40 < per_copy_mb < 200, err  # weights x4 (~4 MB) + 32 examples' activations (~2.5 MB each)


# --------------------------------------------------------------------------------------------
# Issue 13: the test split is looked at once, after training


def _derives_from(dataset, source) -> bool:
    nodes, seen = [dataset._node], set()
    while nodes:
        node = nodes.pop()
        if node is source._node:
            return True
        if id(node) not in seen:
            seen.add(id(node))
            nodes.extend(getattr(node, "inputs", ()))
    return False


def test_train_validates_on_held_out_training_data_and_tests_once_at_the_end(tmp_path, capsys, monkeypatch):
    loaded, events = {}, []
    real_load, real_fit, real_evaluate = cli._load, mr.Model.fit, mr.Model.evaluate

    def load(name, split, *args, **kwargs):
        ds, info = real_load(name, split, *args, **kwargs)
        loaded[split] = ds
        return ds, info

    def fit(self, x, *args, validation_data=None, **kwargs):
        events.append(("fit", [s for s, ds in loaded.items() if _derives_from(validation_data, ds)],
                       [s for s, ds in loaded.items() if _derives_from(x, ds)]))
        return real_fit(self, x, *args, validation_data=validation_data, **kwargs)

    def evaluate(self, x, *args, **kwargs):
        events.append(("evaluate", [s for s, ds in loaded.items() if _derives_from(x, ds)]))
        return real_evaluate(self, x, *args, **kwargs)

    monkeypatch.setattr(cli, "_load", load)
    monkeypatch.setattr(mr.Model, "fit", fit)
    monkeypatch.setattr(mr.Model, "evaluate", evaluate)
    out = tmp_path / "run"
    assert cli.main(["train", "--epochs", "1", "--out", str(out), "--verbose", "2"]) == 0
    assert events == [("fit", ["train[90%:]"], ["train[:90%]"]), ("evaluate", ["test"])]
    printed = capsys.readouterr().out
    assert ("train on 'train[:90%]' (1293 images) | validate (val_*) on 'train[90%:]' (144) | test once, after "
            "training, on 'test' (360)") in printed
    assert "(split 'test', evaluated once after training)" in printed
    saved = json.loads((out / "run.json").read_text())
    assert saved["splits"] == {"train": "train[:90%]", "validation": "train[90%:]", "test": "test"}
    # The held-out part and the training part are the training split, cut in two.
    whole = mr.datasets.load("digits/32x32", split="train", as_supervised=True)
    parts = [mr.datasets.load("digits/32x32", split=s, as_supervised=True) for s in ("train[:90%]", "train[90%:]")]
    images = [torch.stack([x for x, _ in ds]) for ds in (whole, *parts)]
    assert torch.equal(images[0], torch.cat(images[1:]))


def test_cassava_validates_on_its_own_validation_split():
    assert cli._splits("cassava") == ("train", "validation", "test")
    train, val, test = cli._splits("folder:/x")
    assert (train, val, test) == ("train[:70%]", "train[70%:80%]", "train[80%:]")


def test_the_cli_runs_as_a_program_with_one_line_errors(tmp_path):
    """The same through `python -m mirrored`, as a user runs it: exit status 2, one line on stderr."""
    (tmp_path / "model.safetensors").write_bytes(b"\0" * 64)
    done = subprocess.run([sys.executable, "-m", "mirrored", "evaluate", str(tmp_path / "model.safetensors")],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 2 and len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert str(tmp_path / "model.safetensors") in done.stderr
