"""Issue 36: a run resumed on another number of replicas (a machine that lost a GPU, a cluster that came
back smaller or larger) goes on from its backup or checkpoint exactly: fit with BackupAndRestore interrupted
on 2 replicas, resumed on 3, interrupted again and finished on 1; a custom loop with mr.train.Checkpoint
the same way. The global batch is either kept or, as a script batching by per-replica size x
num_replicas_in_sync has it, changes with the count: the data position is counted in examples, so the
examples the interrupted pass had not reached are trained on, once each.

The reference is plain PyTorch on one device, fed the batches the resumed runs must have trained on: the
pipeline's example order (its shuffle, unbatched) cut at the positions of the backups. Tolerance: the
replicas' gradient sums add the same numbers in another order than one device does (~1 ulp a step); 2e-6
absolute over the ~40 steps of these runs, with a test-sized net whose weights stay near 1.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import mirrored as mr

N, PER_REPLICA, EPOCHS = 30, 2, 3
TOLERANCE = dict(rtol=0, atol=2e-6)


def _data():
    g = torch.Generator().manual_seed(1)
    return torch.randn(N, 5, generator=g), torch.randint(0, 3, (N,), generator=g)


def _pipeline(global_batch: int) -> mr.data.Dataset:
    """Built afresh by each run, as a restarted program builds it."""
    return mr.data.Dataset.from_tensor_slices(_data()).shuffle(N, seed=7).batch(global_batch)


def _orders() -> list[list[int]]:
    """The pipeline's example order in each pass: the same shuffle, unbatched."""
    ds = mr.data.Dataset.from_tensor_slices(torch.arange(N)).shuffle(N, seed=7)
    orders = [[int(i) for i in ds] for _ in range(EPOCHS)]
    assert orders[0] != orders[1] != orders[2]  # (each pass is shuffled anew)
    return orders


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 3))


def _reference(cuts: list[list[int]]) -> list[torch.Tensor]:
    """Plain PyTorch on one device: pass e is cut into batches at the example positions cuts[e]."""
    x, y = _data()
    net = _net()
    opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    for order, bounds in zip(_orders(), cuts):
        assert bounds[-1] == N
        for lo, hi in zip([0, *bounds[:-1]], bounds):
            idx = torch.tensor(order[lo:hi])
            F.cross_entropy(net(x[idx]), y[idx]).backward()
            opt.step()
            opt.zero_grad()
    return [p.detach() for p in net.parameters()]


class _Crash(Exception):
    pass


class _CrashAfter(mr.callbacks.Callback):
    def __init__(self, batches: int | None):
        super().__init__()
        self.batches, self.seen = batches, 0

    def on_train_batch_end(self, batch, logs=None):
        self.seen += 1
        if self.seen == self.batches:
            raise _Crash


def _fit(replicas: int, global_batch: int, backup, crash_after: int | None = None, save_freq=3):
    """Model.fit on `replicas` CPU replicas with BackupAndRestore; None if it crashed, else its weights."""
    strategy = mr.MirroredStrategy(devices=[f"cpu:{i}" for i in range(replicas)])
    with strategy.scope():
        model = mr.Model(_net())
        model.compile(optimizer=mr.optimizers.SGD(learning_rate=0.1, momentum=0.9),
                      loss="sparse_categorical_crossentropy")
    try:
        model.fit(_pipeline(global_batch), epochs=EPOCHS, verbose=0,
                  callbacks=[mr.callbacks.BackupAndRestore(backup, save_freq=save_freq), _CrashAfter(crash_after)])
    except _Crash:
        return None
    model.check_in_sync()
    return [p.detach() for p in model.module.parameters()]


def _close(got, want):
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, **TOLERANCE)


def _steps(lo: int, hi: int, size: int) -> list[int]:
    """The ends of the batches of `size` from example lo to hi (the last may be short)."""
    return list(range(lo + size, hi, size)) + [hi]


def test_fit_resumed_on_3_replicas_then_on_1_with_the_same_global_batch(tmp_path):
    """The issue's run, global batch 6 throughout (5 steps an epoch), a backup every 3 steps: 2 replicas
    crash after 7 steps (backup after step 6: epoch 2, 6 examples in), 3 replicas resume and crash after
    4 more (backup after 3: epoch 2, 24 examples in), 1 replica finishes."""
    backup = tmp_path / "backup"
    assert _fit(2, 6, backup, crash_after=7) is None
    assert _fit(3, 6, backup, crash_after=4) is None
    got = _fit(1, 6, backup)
    _close(got, _reference([_steps(0, N, 6)] * EPOCHS))


def test_fit_resumed_on_other_replica_counts_whose_global_batch_changed_with_them(tmp_path):
    """2 per replica: a global batch of 4 on 2 replicas (8 steps an epoch), 6 on 3, 2 on 1. Backups every 3
    steps. 2 replicas crash after 11 steps, the last backup after 9 (epoch 2, 4 examples in). 3 replicas
    resume there: the rest of the batch of 6 that position falls in (2 examples), then batches of 6, and
    crash after 4 steps, the last backup after 3 (18 examples in). 1 replica resumes at example 18 of
    epoch 2 and finishes with batches of 2."""
    backup = tmp_path / "backup"
    assert _fit(2, 2 * PER_REPLICA, backup, crash_after=11) is None
    assert _fit(3, 3 * PER_REPLICA, backup, crash_after=4) is None
    got = _fit(1, PER_REPLICA, backup)
    epoch_2 = [4, 6, 12, 18, *_steps(18, N, 2)]
    _close(got, _reference([_steps(0, N, 4), epoch_2, _steps(0, N, 2)]))


def _custom_loop(replicas: int, global_batch: int, directory, crash_after: int | None = None):
    """A custom loop (strategy.mirror, mirror_optimizer, one iterator over EPOCHS repetitions) checkpointed with
    mr.train.Checkpoint every 3 steps; restored from the latest checkpoint first. None if it crashed."""
    strategy = mr.MirroredStrategy(devices=[f"cpu:{i}" for i in range(replicas)])
    with strategy.scope():
        mnet = strategy.mirror(_net())
        opt = strategy.mirror_optimizer(torch.optim.SGD, mnet, lr=0.1, momentum=0.9)
    dataset = mr.data.Dataset.from_tensor_slices(_data()).shuffle(N, seed=7).batch(global_batch).repeat(EPOCHS)
    iterator = iter(strategy.experimental_distribute_dataset(dataset))
    ckpt = mr.train.Checkpoint(model=mnet, optimizer=opt, iterator=iterator)
    manager = mr.train.CheckpointManager(ckpt, directory, max_to_keep=2)
    manager.restore_or_initialize()

    def step(x, y, size):
        loss = mr.losses.compute_average_loss(F.cross_entropy(mnet(x), y, reduction="none"), global_batch_size=size)
        loss.backward()
        opt.step()
        opt.zero_grad()

    for steps, (x, y) in enumerate(iterator, start=1):
        strategy.run(step, args=(x, y, iterator.global_batch_size))
        if steps % 3 == 0:
            manager.save()
        if steps == crash_after:
            return None
    strategy.check_in_sync([mnet, opt])
    return [p.detach() for p in strategy.experimental_local_results(mnet)[0].parameters()]


def test_a_custom_loop_resumed_from_mr_train_checkpoint_on_other_replica_counts(tmp_path):
    """The same cuts as fit's, with a custom loop whose one iterator runs through 3 repetitions of the data:
    2 replicas (batches of 4) checkpoint after their 9th step (34 examples in: 4 into the second pass) and
    stop after 11; 3 replicas (batches of 6) restore, train the 2 examples left of the batch of 6 that
    position falls in, then 6 and 6, checkpoint (48 in) and stop after 4; 1 replica (batches of 2) finishes."""
    assert _custom_loop(2, 2 * PER_REPLICA, tmp_path, crash_after=11) is None
    assert _custom_loop(3, 3 * PER_REPLICA, tmp_path, crash_after=4) is None
    got = _custom_loop(1, PER_REPLICA, tmp_path)
    _close(got, _reference([_steps(0, N, 4), [4, 6, 12, 18, *_steps(18, N, 2)], _steps(0, N, 2)]))
