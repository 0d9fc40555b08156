"""Issue 26: with dropout, a fit killed with SIGKILL and resumed by BackupAndRestore ends with the
weights of the uninterrupted run, bitwise: the replicas' generator state (seed, steps run) is saved
with the model in every checkpoint."""
from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from torch import nn

import mirrored as mr

# The subprocess scripts' first lines: their imports and a module that makes replica 1 reach the
# dropout after it on every other call, so that a draw in thread order would show.
PREAMBLE = textwrap.dedent('''
    import os, signal, sys, time
    import torch
    import torch.nn.functional as F
    from safetensors.torch import save_file
    import mirrored as mr

    class Slow(torch.nn.Module):  # replica 1 reaches the dropout late, on every other call
        calls = 0
        def forward(self, t):
            ctx = mr.get_replica_context()
            if ctx is not None and ctx.replica_id_in_sync_group == 1:
                Slow.calls += 1
                if Slow.calls % 2:
                    time.sleep(0.02)
            return t
''')

SCRIPT = PREAMBLE + textwrap.dedent('''
    out, kill_after, replicas = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    mr.utils.set_random_seed(0)
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(40, 5, generator=g), torch.randint(0, 3, (40,), generator=g)
    ds = mr.data.Dataset.from_tensor_slices((x, y)).shuffle(40).batch(6)   # 7 batches, the last of 4
    strategy = mr.MirroredStrategy(devices=[f"cpu:{i}" for i in range(replicas)])

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



@pytest.mark.timeout(120)
def test_a_checkpoint_saved_without_random_reads_into_an_explicit_random_state(tmp_path):
    """Review leftover 2: a file saved without random= holds the strategy's implicit "model.random"; read
    with random=strategy.random_state, it reported `random` missing and left the seed as it was. It now
    restores the same seed and step count, and the next dropout step draws what the uninterrupted run does."""
    strategy, mnet, batch = _two_replicas(3)
    _dropout_step(strategy, batch)  # step 0
    path = mr.train.Checkpoint(model=mnet).write(str(tmp_path / "ckpt"))
    saved = (strategy.random_state.seed, strategy.random_state.steps)
    assert saved == (3, 1)
    want = _dropout_step(strategy, batch)
    fresh, mnet2, batch2 = _two_replicas(99)
    mr.train.Checkpoint(model=mnet2, random=fresh.random_state).read(path).assert_consumed()
    assert (fresh.random_state.seed, fresh.random_state.steps) == saved
    for a, b in zip(want, _dropout_step(fresh, batch2)):
        assert torch.equal(a, b)


LOOP = PREAMBLE + textwrap.dedent('''
    out, kill_after = sys.argv[1], int(sys.argv[2])
    torch.manual_seed(0)
    x, y = torch.randn(48, 5), torch.randint(0, 3, (48,))
    strategy = mr.MirroredStrategy(devices=["cpu:0", "cpu:1"], seed=5)

    with strategy.scope():
        mnet = strategy.mirror(torch.nn.Sequential(torch.nn.Linear(5, 16), torch.nn.ReLU(), Slow(),
                                                   torch.nn.Dropout(0.5), torch.nn.Linear(16, 3)))
        opt = strategy.mirror_optimizer(torch.optim.SGD, mnet, lr=0.1, momentum=0.9)
    ds = mr.data.Dataset.from_tensor_slices((x, y)).repeat().batch(8)
    iterator = iter(strategy.experimental_distribute_dataset(ds))
    ckpt = mr.train.Checkpoint(model=mnet, optimizer=opt, iterator=iterator)   # no random=: saved anyway
    manager = mr.train.CheckpointManager(ckpt, os.path.join(out, "ckpts"), max_to_keep=2)
    ckpt.restore(manager.latest_checkpoint)

    def step(xb, yb):
        loss = F.cross_entropy(mnet(xb), yb, reduction="none")
        mr.losses.compute_average_loss(loss, global_batch_size=8).backward()
        opt.step()
        opt.zero_grad()

    while ckpt.save_counter * 3 < 12:  # 12 steps, a checkpoint every 3
        for _ in range(3):
            strategy.run(step, args=next(iterator))
        manager.save()
        if ckpt.save_counter == kill_after:
            os.kill(os.getpid(), signal.SIGKILL)
    save_file({k: v.contiguous() for k, v in mnet.state_dict().items()}, os.path.join(out, "final.safetensors"))
''')


def _loop(tmp_path, name, kill_after):
    out = tmp_path / name
    out.mkdir(exist_ok=True)
    script = tmp_path / "loop.py"
    script.write_text(LOOP)
    return subprocess.run([sys.executable, str(script), str(out), str(kill_after)], capture_output=True, text=True,
                          timeout=300), out


@pytest.mark.timeout(600)
def test_a_custom_loop_killed_and_resumed_by_checkpoint_gives_the_uninterrupted_weights_without_random(tmp_path):
    """Issue 26: mr.train.Checkpoint(model=mnet, optimizer=opt, iterator=it) saves the strategy's random
    state without random=strategy.random_state, so a custom loop with dropout, killed with SIGKILL after
    its 2nd checkpoint and resumed from it, ends with the weights of the uninterrupted run, bitwise."""
    done, plain = _loop(tmp_path, "plain", -1)
    assert done.returncode == 0, done.stderr
    killed, out = _loop(tmp_path, "resumed", 2)
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    assert not (out / "final.safetensors").exists()
    resumed, _ = _loop(tmp_path, "resumed", -1)
    assert resumed.returncode == 0, resumed.stderr
    want, got = load_file(plain / "final.safetensors"), load_file(out / "final.safetensors")
    assert want.keys() == got.keys()
    for key in want:
        assert torch.equal(want[key], got[key]), key


def _two_replicas(seed: int) -> tuple[mr.MirroredStrategy, Any, Any]:
    strategy = mr.MirroredStrategy(devices=["cpu:0", "cpu:1"], seed=seed)
    with strategy.scope():
        mnet = strategy.mirror(nn.Sequential(nn.Linear(4, 8), nn.Dropout(0.5)))
    batch = next(iter(strategy.experimental_distribute_dataset(mr.data.Dataset.from_tensors(torch.ones(6, 4)))))
    return strategy, mnet, batch


def _dropout_step(strategy: mr.MirroredStrategy, batch: Any) -> list[torch.Tensor]:
    return list(strategy.experimental_local_results(strategy.run(lambda t: F.dropout(t, 0.5), args=(batch,))))


@pytest.mark.timeout(120)
def test_a_checkpoint_saves_each_strategys_random_state_once_and_plain_modules_ignore_it(tmp_path):
    """Issue 26: two strategies' mirrored modules in one Checkpoint each get their strategy's state
    ("<first name>.random"); the optimizer of the same strategy adds none (and alone reads its strategy's
    from a file of one strategy); a plain torch module reads
    the file back without an unused entry; a file without the state restores with a warning; a file that
    holds none of a strategy's objects leaves its random state alone (a warm start; found in review)."""
    from mirrored.training import checkpoint

    a, net_a, batch_a = _two_replicas(1)
    b, net_b, batch_b = _two_replicas(2)
    with a.scope():
        opt_a = a.mirror_optimizer(torch.optim.SGD, net_a, lr=0.1)
    _dropout_step(a, batch_a)
    for _ in range(3):
        _dropout_step(b, batch_b)
    path = mr.train.Checkpoint(gen=net_a, opt=opt_a, disc=net_b).write(str(tmp_path / "ckpt"))
    objects = checkpoint.load_checkpoint(path)[1]["objects"]
    assert objects["gen.random"]["state"] == {"seed": 1, "steps": 1, "per_example_random": False}
    assert objects["disc.random"]["state"] == {"seed": 2, "steps": 3, "per_example_random": False}
    assert "opt.random" not in objects
    single = mr.train.Checkpoint(model=net_a, opt=opt_a).write(str(tmp_path / "single"))
    want_a, want_b = _dropout_step(a, batch_a), _dropout_step(b, batch_b)

    c, net_c, batch_c = _two_replicas(98)
    d, net_d, batch_d = _two_replicas(99)
    with c.scope():
        opt_c = c.mirror_optimizer(torch.optim.SGD, net_c, lr=0.1)
    mr.train.Checkpoint(opt=opt_c).read(single).expect_partial()  # one strategy each side: "model.random"
    assert (c.random_state.seed, c.random_state.steps) == (1, 1)
    mr.train.Checkpoint(gen=net_c, opt=opt_c, disc=net_d).read(path).assert_consumed()
    for got, want in ((_dropout_step(c, batch_c), want_a), (_dropout_step(d, batch_d), want_b)):
        for x, y in zip(got, want):
            assert torch.equal(x, y)

    explicit = mr.train.Checkpoint(model=net_a, random=a.random_state).write(str(tmp_path / "explicit"))
    mr.train.Checkpoint(model=net_c).read(explicit).assert_consumed()  # the older spelling's file: its "random"
    assert (c.random_state.seed, c.random_state.steps) == (1, 2)

    plain = {"gen": nn.Sequential(nn.Linear(4, 8), nn.Dropout(0.5)), "disc": nn.Sequential(nn.Linear(4, 8))}
    plain_path = mr.train.Checkpoint(gen=net_a, disc=net_b).write(str(tmp_path / "no_optimizer"))
    mr.train.Checkpoint(gen=plain["gen"], disc=plain["disc"]).read(plain_path).assert_consumed()  # no unused .random

    # a warm start from weights saved under another name reads nothing of that strategy: its seed stays
    f, net_f, _ = _two_replicas(43)
    mr.train.Checkpoint(backbone=net_f).read(single).expect_partial()
    assert (f.random_state.seed, f.random_state.steps) == (43, 0)
    old = mr.train.Checkpoint(model=nn.Sequential(nn.Linear(4, 8), nn.Dropout(0.5))).write(str(tmp_path / "old"))
    e, net_e, _ = _two_replicas(7)
    with pytest.warns(UserWarning, match=r"holds no entry 'model.random'.*not match an uninterrupted run"):
        mr.train.Checkpoint(model=net_e).read(old).assert_consumed()
    assert (e.random_state.seed, e.random_state.steps) == (7, 0)


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
