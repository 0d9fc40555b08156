"""Issue 26: with dropout, a fit killed with SIGKILL and resumed by BackupAndRestore ends with the
weights of the uninterrupted run, bitwise: the replicas' generator state (seed, steps run) is saved
with the model in every checkpoint."""
from __future__ import annotations

import signal
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from torch import nn

import mirrored as mr

SCRIPT = textwrap.dedent('''
    import os, signal, sys, time
    import torch
    from safetensors.torch import save_file
    import mirrored as mr

    out, kill_after, replicas = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    mr.utils.set_random_seed(0)
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(40, 5, generator=g), torch.randint(0, 3, (40,), generator=g)
    ds = mr.data.Dataset.from_tensor_slices((x, y)).shuffle(40).batch(6)   # 7 batches, the last of 4
    strategy = mr.MirroredStrategy(devices=[f"cpu:{i}" for i in range(replicas)])

    class Slow(torch.nn.Module):  # replica 1 reaches the dropout late, on every other call
        calls = 0
        def forward(self, t):
            ctx = mr.get_replica_context()
            if ctx is not None and ctx.replica_id_in_sync_group == 1:
                Slow.calls += 1
                if Slow.calls % 2:
                    time.sleep(0.02)
            return t

    with strategy.scope():
        model = mr.Model(torch.nn.Sequential(torch.nn.Linear(5, 16), torch.nn.ReLU(), Slow(),
                                             torch.nn.Dropout(0.5), torch.nn.Linear(16, 3)))
        model.compile(optimizer=mr.optimizers.SGD(learning_rate=0.1, momentum=0.9),
                      loss="sparse_categorical_crossentropy", metrics=["accuracy"])

    class Kill(mr.callbacks.Callback):
        seen = 0
        def on_train_batch_end(self, batch, logs=None):
            Kill.seen += 1
            if Kill.seen == kill_after:
                os.kill(os.getpid(), signal.SIGKILL)

    model.fit(ds, epochs=3, verbose=0, validation_data=ds.take(2), callbacks=[
        mr.callbacks.BackupAndRestore(os.path.join(out, "backup"), save_freq=2), Kill()])
    model.check_in_sync()
    print("batches trained:", Kill.seen)
    save_file({k: v.contiguous() for k, v in model.module.state_dict().items()}, os.path.join(out, "final.safetensors"))
''')


def _fit(tmp_path, name, kill_after, replicas):
    out = tmp_path / name
    out.mkdir(exist_ok=True)
    script = tmp_path / "fit.py"
    script.write_text(SCRIPT)
    return subprocess.run([sys.executable, str(script), str(out), str(kill_after), str(replicas)],
                          capture_output=True, text=True, timeout=300), out


@pytest.mark.timeout(600)
@pytest.mark.parametrize("replicas", [2, pytest.param(3, marks=pytest.mark.slow)])
def test_sigkill_then_resume_with_dropout_gives_the_uninterrupted_weights_bitwise(tmp_path, replicas):
    done, plain = _fit(tmp_path, "plain", -1, replicas)
    assert done.returncode == 0, done.stderr
    again, second = _fit(tmp_path, "second", -1, replicas)  # two uninterrupted runs agree, too
    assert again.returncode == 0, again.stderr
    killed, out = _fit(tmp_path, "resumed", 11, replicas)  # epoch 2, after its 4th batch; last backup at its 3rd
    assert killed.returncode == -signal.SIGKILL
    resumed, _ = _fit(tmp_path, "resumed", -1, replicas)
    assert resumed.returncode == 0, resumed.stderr
    assert "batches trained: 11" in resumed.stdout, resumed.stdout
    want = load_file(plain / "final.safetensors")
    for other in (load_file(second / "final.safetensors"), load_file(out / "final.safetensors")):
        assert want.keys() == other.keys()
        for key in want:
            assert torch.equal(want[key], other[key]), key


@pytest.mark.timeout(120)
def test_a_custom_loop_checkpoint_with_the_random_state_resumes_the_dropout_masks(tmp_path):
    strategy = mr.MirroredStrategy(devices=["cpu:0", "cpu:1"], seed=3)
    with strategy.scope():
        mnet = strategy.mirror(nn.Sequential(nn.Linear(4, 8), nn.Dropout(0.5)))
    x = strategy.experimental_distribute_dataset(mr.data.Dataset.from_tensors(torch.ones(6, 4)))
    batch = next(iter(x))
    strategy.run(lambda t: mnet(t), args=(batch,))  # step 0
    ckpt = mr.train.Checkpoint(model=mnet, random=strategy.random_state)
    path = ckpt.write(str(tmp_path / "ckpt"))
    want = strategy.experimental_local_results(strategy.run(lambda t: F.dropout(t, 0.5), args=(batch,)))
    fresh = mr.MirroredStrategy(devices=["cpu:0", "cpu:1"], seed=99)
    with fresh.scope():
        mnet2 = fresh.mirror(nn.Sequential(nn.Linear(4, 8), nn.Dropout(0.5)))
    mr.train.Checkpoint(model=mnet2, random=fresh.random_state).read(path).assert_consumed()
    batch2 = next(iter(fresh.experimental_distribute_dataset(mr.data.Dataset.from_tensors(torch.ones(6, 4)))))
    got = fresh.experimental_local_results(fresh.run(lambda t: F.dropout(t, 0.5), args=(batch2,)))
    for a, b in zip(want, got):
        assert torch.equal(a, b)


class _Interrupt(Exception):
    pass


def _fit_without_dropout(callbacks: list) -> dict[str, torch.Tensor]:
    mr.utils.set_random_seed(0)
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(40, 5, generator=g), torch.randint(0, 3, (40,), generator=g)
    ds = mr.data.Dataset.from_tensor_slices((x, y)).shuffle(40, seed=2).batch(8)
    with mr.MirroredStrategy(devices=["cpu:0", "cpu:1"]).scope():
        model = mr.Model(nn.Sequential(nn.Linear(5, 16), nn.ReLU(), nn.Linear(16, 3)))
        model.compile(optimizer=mr.optimizers.SGD(learning_rate=0.1, momentum=0.9),
                      loss="sparse_categorical_crossentropy")
    model.fit(ds, epochs=2, verbose=0, callbacks=callbacks)
    return {k: v.detach().clone() for k, v in model.module.state_dict().items()}


def test_a_backup_from_before_the_random_state_was_saved_resumes_with_a_warning(tmp_path):
    """Issue 26: backups written before the replicas' generators were saved lack the 'model.random'
    entry. Refusing them would throw an interrupted run away; they resume, with a warning that random
    draws will not match. A model without dropout loses nothing: the uninterrupted run's weights."""
    import json

    from safetensors import safe_open
    from safetensors.torch import save_file

    class StopAfter(mr.callbacks.Callback):
        seen = 0

        def on_train_batch_end(self, batch, logs=None):
            StopAfter.seen += 1
            if StopAfter.seen == 7:  # in the second epoch, after the backup at its 2nd batch
                raise _Interrupt

    want = _fit_without_dropout([])
    backup = mr.callbacks.BackupAndRestore(tmp_path / "backup", save_freq=2)
    with pytest.raises(_Interrupt):
        _fit_without_dropout([backup, StopAfter()])
    with safe_open(backup.path, "pt") as f:  # make it an older version's backup
        header, tensors = f.metadata(), {k: f.get_tensor(k) for k in f.keys()}
    saved = json.loads(header["mirrored"])
    del saved["objects"]["model.random"]
    save_file(tensors, backup.path, {**header, "mirrored": json.dumps(saved)})
    with pytest.warns(UserWarning, match=r"holds no entry 'model.random'.*not match an uninterrupted run"):
        got = _fit_without_dropout([mr.callbacks.BackupAndRestore(tmp_path / "backup", save_freq=2)])
    for name, value in want.items():
        assert torch.equal(got[name], value), name
