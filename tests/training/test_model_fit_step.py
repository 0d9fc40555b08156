"""What the speed work on fit's step (issue 15) must not change: a BatchNorm model trained by fit on
2 and 3 CPU replicas against a plain PyTorch reference that plays the replicas itself, replicas
bitwise equal; the logs when fit reads the metrics only at the end of each epoch; the step journal's
walk over a module."""
from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from _plain_replicas import batchnorm_data, replicas_by_hand  # tests/training/_plain_replicas.py

import mirrored as mr
from mirrored.distribute import rollback
from _replicas import strategy_of  # tests/_replicas.py

N_EXAMPLES, GLOBAL_BATCH, EPOCHS = 22, 8, 2  # batches 8, 8, 6: on 3 replicas 3/3/2, 3/3/2, 2/2/2


def _data():
    return batchnorm_data(3, N_EXAMPLES)


def _net():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.BatchNorm1d(16), torch.nn.ReLU(),
                               torch.nn.Linear(16, 4))


@pytest.mark.parametrize("replicas", [2, 3])
def test_fit_with_batchnorm_matches_plain_torch_playing_the_replicas(replicas):
    """Regression test for issue 15: the step path's bookkeeping (step journal, metric reads, buffer
    sync) is rewritten for speed; the trained weights and statistics must stay those of the math."""
    x, y = _data()
    ref, want_losses = replicas_by_hand(_net, x, y, replicas, GLOBAL_BATCH, EPOCHS)
    strategy = strategy_of(replicas)
    with strategy.scope():
        model = mr.Model(_net())
        model.compile(optimizer=mr.optimizers.SGD(learning_rate=0.1, momentum=0.9),
                      loss="sparse_categorical_crossentropy")
    history = model.fit(mr.data.Dataset.from_tensor_slices((x, y)).batch(GLOBAL_BATCH), epochs=EPOCHS, verbose=0)
    # Float reassociation only: the reference runs on this thread's intra-op threads and each replica on
    # one, so a matmul's sums may split otherwise (test_model_prefetch.py pins one thread and asks for
    # the bits); a few ulps per step through 6 steps of momentum SGD (a wrong split, weighting or missed
    # update is >1e-3 off).
    for (name, got), want in zip(model.module.state_dict().items(), ref.state_dict().values()):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6, msg=name)
    np.testing.assert_allclose(history.history["loss"], want_losses, rtol=1e-5)
    for other in model.replicas[1:]:
        for (name, a), b in zip(model.module.state_dict().items(), other.state_dict().values()):
            assert torch.equal(a, b), name
    model.check_in_sync()


class _BatchLogs(mr.callbacks.Callback):
    def __init__(self):
        super().__init__()
        self.logs = []

    def on_train_batch_end(self, batch, logs=None):
        self.logs.append(dict(logs))


class _KerasTwoBatchLogs(mr.callbacks.Callback):
    """Only the Keras 2 alias: fit must still read the metrics for it every step."""

    def __init__(self):
        super().__init__()
        self.logs = []

    def on_batch_end(self, batch, logs=None):
        self.logs.append(dict(logs))


def _fit(callbacks):
    x, y = _data()
    strategy = mr.MirroredStrategy(devices=["cpu:0", "cpu:1"])
    with strategy.scope():
        model = mr.Model(_net())
        model.compile(optimizer=mr.optimizers.SGD(learning_rate=0.1, momentum=0.9),
                      loss="sparse_categorical_crossentropy", metrics=["accuracy"])
    history = model.fit(mr.data.Dataset.from_tensor_slices((x, y)).batch(GLOBAL_BATCH), epochs=EPOCHS, verbose=0,
                        callbacks=callbacks)
    return model, history.history


def test_epoch_logs_are_the_same_whether_or_not_a_callback_reads_every_step():
    """Without a batch hook fit reads the metrics once per epoch (as tf.keras converts logs only for
    callbacks with batch hooks); the epoch's logs and weights are the same bit for bit."""
    quiet, quiet_history = _fit([])
    per_step, per_step_cb = _BatchLogs(), _KerasTwoBatchLogs()
    reading, reading_history = _fit([per_step, per_step_cb])
    assert quiet_history == reading_history
    for a, b in zip(quiet.module.state_dict().values(), reading.module.state_dict().values()):
        assert torch.equal(a, b)
    steps = -(-N_EXAMPLES // GLOBAL_BATCH)
    for cb in (per_step, per_step_cb):
        assert len(cb.logs) == EPOCHS * steps
        assert all({"loss", "accuracy", "num_examples"} <= set(logs) for logs in cb.logs)
        for epoch in range(EPOCHS):  # the last step's logs are the epoch's
            last = cb.logs[(epoch + 1) * steps - 1]
            assert last["loss"] == reading_history["loss"][epoch]
            assert last["accuracy"] == reading_history["accuracy"][epoch]


def test_step_journal_walks_every_module_once_in_modules_order():
    shared = torch.nn.Linear(3, 3)
    net = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.BatchNorm1d(3), shared,
                              torch.nn.Sequential(shared, torch.nn.BatchNorm1d(3)), None)
    net.register_buffer("constant", torch.ones(2))
    net.register_parameter("nothing", None)
    params, buffers = rollback._parameters_and_buffers(net)
    want_params = [p for m in net.modules() for p in m._parameters.values() if p is not None]
    want_buffers = [b for m in net.modules() for b in m._buffers.values() if b is not None]
    assert [id(p) for p in params] == [id(p) for p in want_params]
    assert [id(b) for b in buffers] == [id(b) for b in want_buffers]


def test_step_journal_puts_back_gradients_and_buffers():
    net = _net()
    net(torch.randn(4, 6)).sum().backward()  # a gradient that the next backward would add to
    before = copy.deepcopy(net)
    grads = [p.grad.clone() for p in net.parameters()]
    journal = rollback.StepJournal()
    journal.before_forward(net)
    net(torch.randn(4, 6) * 5).sum().backward()  # moves the gradients and BatchNorm's statistics
    journal.rollback()
    for (name, a), b in zip(net.state_dict().items(), before.state_dict().values()):
        assert torch.equal(a, b), name
    for p, grad in zip(net.parameters(), grads):
        assert torch.equal(p.grad, grad)
