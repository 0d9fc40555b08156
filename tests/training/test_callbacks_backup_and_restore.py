"""Issue 6: a fit killed with SIGKILL mid-epoch, rerun with BackupAndRestore, ends with the weights
of an uninterrupted run (data order, optimizer state and RNG state included)."""
from __future__ import annotations

import signal
import subprocess
import sys
import textwrap

import pytest

from safetensors.torch import load_file

SCRIPT = textwrap.dedent('''
    import os, signal, sys
    import torch
    from safetensors.torch import save_file
    import mirrored as mr

    out, kill_after = sys.argv[1], int(sys.argv[2])
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(40, 5, generator=g), torch.randint(0, 3, (40,), generator=g)
    ds = mr.data.Dataset.from_tensor_slices((x, y)).shuffle(40).batch(6)   # 7 batches, the last of 4
    strategy = mr.MirroredStrategy(devices=["cpu:0", "cpu:1"])
    with strategy.scope():
        model = mr.Model(torch.nn.Sequential(torch.nn.Linear(5, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3)))
        model.compile(optimizer=mr.optimizers.SGD(learning_rate=0.1, momentum=0.9),
                      loss="sparse_categorical_crossentropy", metrics=["accuracy"])

    class Kill(mr.callbacks.Callback):
        seen = 0
        def on_train_batch_end(self, batch, logs=None):
            Kill.seen += 1
            if Kill.seen == kill_after:
                os.kill(os.getpid(), signal.SIGKILL)

    history = model.fit(ds, epochs=3, verbose=0, callbacks=[
        mr.callbacks.BackupAndRestore(os.path.join(out, "backup"), save_freq=2), Kill()])
    model.check_in_sync()
    print("batches trained:", Kill.seen)
    save_file({k: v.contiguous() for k, v in model.module.state_dict().items()}, os.path.join(out, "final.safetensors"))
''')


def _fit(tmp_path, name, kill_after):
    out = tmp_path / name
    out.mkdir(exist_ok=True)
    script = tmp_path / "fit.py"
    script.write_text(SCRIPT)
    return subprocess.run([sys.executable, str(script), str(out), str(kill_after)], capture_output=True,
                          text=True, timeout=300), out


def test_sigkill_mid_epoch_then_resume_gives_the_uninterrupted_weights(tmp_path):
    done, plain = _fit(tmp_path, "plain", -1)
    assert done.returncode == 0, done.stderr
    killed, out = _fit(tmp_path, "resumed", 11)  # epoch 2 (of 3), after its 4th batch; last backup at its 3rd
    assert killed.returncode == -signal.SIGKILL
    assert (out / "backup").is_dir() and not (out / "final.safetensors").exists()
    resumed, _ = _fit(tmp_path, "resumed", -1)
    assert resumed.returncode == 0, resumed.stderr
    assert "batches trained: 21" in done.stdout
    # backups every 2 batches: the last before the kill was after batch 10 of 21, so 11 remain
    assert "batches trained: 11" in resumed.stdout, resumed.stdout
    want, got = load_file(plain / "final.safetensors"), load_file(out / "final.safetensors")
    assert want.keys() == got.keys()
    # the same float operations in the same order: bitwise equal (the message gives every key's largest
    # difference, to tell a float-order difference, ~1e-7, from other batches, ~1e-2)
    diffs = {key: float((want[key] - got[key]).abs().max()) for key in want}
    assert not any(diffs.values()), (diffs, resumed.stdout, resumed.stderr)
    assert not (out / "backup" / "training_state.safetensors").exists()  # deleted after a finished fit


class _Crash(Exception):
    pass


def _fit_in_process(backup, crash_at_batch=None, steps_per_epoch=None, schedule=False, endless=None,
                    save_freq=2, histories=None, optimizer=None):
    """Model.fit of a small net on 2 CPU replicas; raises _Crash after `crash_at_batch` batches. The
    data repeats endlessly with steps_per_epoch (unless endless=False), else it is 10 batches."""
    import torch

    import mirrored as mr

    torch.manual_seed(0)
    x = torch.arange(60, dtype=torch.float32).reshape(20, 3) / 60
    y = torch.arange(20) % 2
    ds = mr.data.Dataset.from_tensor_slices((x, y)).shuffle(20, seed=1)
    ds = (ds.repeat() if (steps_per_epoch if endless is None else endless) else ds).batch(2)
    strategy = mr.MirroredStrategy(devices=["cpu:0", "cpu:1"])
    with strategy.scope():
        model = mr.Model(torch.nn.Linear(3, 2))
        model.compile(optimizer=optimizer or mr.optimizers.SGD(learning_rate=0.1, momentum=0.9),
                      loss="sparse_categorical_crossentropy", metrics=["accuracy"])
    rates = []

    class Crash(mr.callbacks.Callback):
        seen = 0

        def on_train_batch_end(self, batch, logs=None):
            Crash.seen += 1
            rates.append(model.optimizer.learning_rate)
            if Crash.seen == crash_at_batch:
                raise _Crash()

    callbacks = [mr.callbacks.BackupAndRestore(str(backup), save_freq=save_freq), Crash()]
    if schedule:
        callbacks.insert(0, mr.callbacks.LearningRateScheduler(lambda epoch, lr: lr * 0.5))
    try:
        history = model.fit(ds, epochs=4, steps_per_epoch=steps_per_epoch, verbose=0, callbacks=callbacks)
    except _Crash:
        return None, rates
    if histories is not None:
        histories.append(history.history)
    return torch.cat([p.detach().flatten() for p in model.module.parameters()]), rates


def test_steps_per_epoch_resumes_exactly_mid_pass(tmp_path):
    """With steps_per_epoch, epochs continue one pass of the data: a backup records where in that pass
    it is (the pass's shuffle state and the batches drawn), and the resumed run draws up to there.
    (Review finding: the resumed run restarted the pass, ending up to 0.31 off in the weights.)"""
    want, _ = _fit_in_process(tmp_path / "plain", steps_per_epoch=3)
    assert _fit_in_process(tmp_path / "backup", crash_at_batch=8, steps_per_epoch=3)[0] is None  # epoch 2, step 2
    got, rates = _fit_in_process(tmp_path / "backup", steps_per_epoch=3)
    assert len(rates) == 4 and (got == want).all()  # backed up after batch 8 of 12


def test_steps_per_epoch_resumes_exactly_after_a_pass_ran_out(tmp_path):
    """10 batches, 4 steps per epoch: epoch 2 ends after the pass ran out (2 batches), epoch 3 starts
    a new one. Backed up at that boundary (after batch 10), the resumed run must start the new pass,
    not replay the finished one (review finding: it trained 0 batches in the next epoch)."""
    want, want_rates = _fit_in_process(tmp_path / "plain", steps_per_epoch=4, endless=False)
    assert len(want_rates) == 4 + 4 + 2 + 4  # epochs of 4, 4, 2 (the pass ran out) and 4 batches
    for save_freq in (2, "epoch"):  # backed up mid-pass (after batch 10) or at epoch 2's end
        backup = tmp_path / f"backup-{save_freq}"
        assert _fit_in_process(backup, crash_at_batch=11, steps_per_epoch=4, endless=False,
                               save_freq=save_freq)[0] is None
        got, rates = _fit_in_process(backup, steps_per_epoch=4, endless=False, save_freq=save_freq)
        assert len(rates) == 4 and (got == want).all(), save_freq


def test_a_learning_rate_a_callback_changed_is_resumed(tmp_path):
    """LearningRateScheduler halving the rate each epoch (a schedule of the current rate, as in the
    Keras measurement): the resumed run goes on with the rates of the uninterrupted one. (Review
    finding: the rate restarted from the compiled one.) The backup here is epoch 1 with its 10 steps
    done; the resumed run calls on_epoch_begin(1) again, so the backup holds the rate from before
    epoch 1's halving, which would otherwise happen twice."""
    want, want_rates = _fit_in_process(tmp_path / "plain", schedule=True)
    assert _fit_in_process(tmp_path / "backup", crash_at_batch=21, schedule=True)[0] is None  # epoch 2, step 1
    got, got_rates = _fit_in_process(tmp_path / "backup", schedule=True)
    assert got_rates == want_rates[20:] and (got == want).all()


def test_a_resumed_epoch_reports_the_metrics_of_the_uninterrupted_one(tmp_path):
    """The backup holds the epoch's metrics so far, and the resumed epoch goes on from them (issue 13:
    they were reset, so a resumed epoch's loss and accuracy covered only the steps after the resume)."""
    plain, resumed = [], []
    _fit_in_process(tmp_path / "plain", histories=plain)
    assert _fit_in_process(tmp_path / "backup", crash_at_batch=13)[0] is None  # backed up at epoch 1, step 2
    _fit_in_process(tmp_path / "backup", histories=resumed)
    for key in ("loss", "accuracy"):
        assert resumed[0][key] == pytest.approx(plain[0][key][1:], rel=1e-6), key


def test_the_optimizer_options_resume_mid_accumulation_with_their_schedule(tmp_path):
    """Keras 3's options carry over a backup taken half-way through a gradient accumulation: the step
    count (which drives the schedule), each replica's accumulated gradients, the moving averages."""
    import mirrored as mr

    def optimizer():
        schedule = mr.optimizers.schedules.PiecewiseConstantDecay([6, 14], [0.2, 0.1, 0.05])
        return mr.optimizers.SGD(learning_rate=schedule, momentum=0.9, gradient_accumulation_steps=2, use_ema=True,
                                 ema_momentum=0.8)

    want, _ = _fit_in_process(tmp_path / "plain", optimizer=optimizer())
    assert _fit_in_process(tmp_path / "backup", crash_at_batch=16, save_freq=3, optimizer=optimizer())[0] is None
    got, _ = _fit_in_process(tmp_path / "backup", save_freq=3, optimizer=optimizer())  # from batch 15: odd
    assert (got == want).all()
