"""Issue 17: a long run does not leak. 2,000 training steps of a tiny model on 3 CPU replicas (with
validation, checkpoints and backups every epoch, as `mirrored train` runs) end with as many threads
as after the first epoch and resident memory grown by less than RSS_GROWTH_BOUND_BYTES. Slow: run
with `pytest -m slow tests/reliability/test_soak.py -s` (or `make test-all`); it prints its figures."""
from __future__ import annotations

import gc
import os
import threading

import pytest
import torch
from torch import nn

import mirrored as mr

STEPS_PER_EPOCH = 200
EPOCHS = 10  # 2,000 steps
# After the first epoch everything is allocated (buffers, bucket layouts, metric state, allocator
# pools); what is left may grow by allocator fragmentation only. 32 MB is ~50x the model and optimizer
# state (~0.6 MB): a per-step leak of even 16 kB (2,000 steps) would exceed it.
RSS_GROWTH_BOUND_BYTES = 32 << 20


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class _Sampler(mr.callbacks.Callback):
    """Threads and RSS at the end of each epoch (after validation and the saves)."""

    def __init__(self):
        super().__init__()
        self.samples: list[tuple[int, int]] = []

    def on_epoch_end(self, epoch, logs=None):
        gc.collect()
        self.samples.append((threading.active_count(), _rss_bytes()))


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_two_thousand_steps_on_three_replicas_grow_no_threads_and_bounded_memory(tmp_path):
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(240, 16, generator=g), torch.randint(0, 4, (240,), generator=g)
    train = mr.data.Dataset.from_tensor_slices((x, y)).shuffle(240, seed=0).repeat().batch(24)
    val = mr.data.Dataset.from_tensor_slices((x[:48], y[:48])).batch(24)
    strategy = mr.MirroredStrategy(devices=["cpu:0", "cpu:1", "cpu:2"])
    with strategy.scope():
        model = mr.Model(nn.Sequential(nn.Linear(16, 64), nn.BatchNorm1d(64), nn.ReLU(), nn.Linear(64, 4)))
        model.compile(optimizer=mr.optimizers.SGD(learning_rate=0.05, momentum=0.9),
                      loss="sparse_categorical_crossentropy", metrics=["accuracy"])
    sampler = _Sampler()
    history = model.fit(train, epochs=EPOCHS, steps_per_epoch=STEPS_PER_EPOCH, validation_data=val, verbose=0,
                        callbacks=[sampler, mr.callbacks.BackupAndRestore(str(tmp_path / "backup")),
                                   mr.callbacks.ModelCheckpoint(str(tmp_path / "best.safetensors"),
                                                                monitor="val_accuracy", save_best_only=True)])
    assert len(history.history["loss"]) == EPOCHS
    assert history.history["loss"][-1] < history.history["loss"][0]  # it trained
    model.check_in_sync()
    threads = [t for t, _ in sampler.samples]
    rss = [r for _, r in sampler.samples]
    growth = max(rss[1:]) - rss[0]
    print(f"\nsoak: {EPOCHS * STEPS_PER_EPOCH} steps on 3 replicas; threads per epoch {threads}; RSS after "
          f"epoch 1 {rss[0] / 2**20:.1f} MB, max later {max(rss[1:]) / 2**20:.1f} MB, growth "
          f"{growth / 2**20:+.1f} MB (bound {RSS_GROWTH_BOUND_BYTES >> 20} MB)")
    assert threads == [threads[0]] * EPOCHS
    assert growth < RSS_GROWTH_BOUND_BYTES
    assert os.listdir(tmp_path) == ["best.safetensors"]  # the backup is gone after a finished run, no temp files
