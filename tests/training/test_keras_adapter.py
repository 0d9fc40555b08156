"""Keras 3 models (torch backend) under MirroredStrategy (issue 23), against Keras's own torch-backend
fit on one device with the same data and global batches: weights, loss and metric histories, the
`training` flag, Keras's losses, metrics and optimizers, BatchNormalization's moving statistics,
and the .keras archive. Keras's own fit under our scope: test_keras_fit.py."""
from __future__ import annotations

import os

os.environ.setdefault("KERAS_BACKEND", "torch")  # before keras is imported (it reads it once)

import subprocess
import sys
import time
import warnings

import numpy as np
import pytest
import torch

keras = pytest.importorskip("keras")
if keras.backend.backend() != "torch":
    pytest.skip("keras was imported with another backend than torch", allow_module_level=True)

import mirrored as mr  # noqa: E402
from _replicas import strategy_of  # tests/_replicas.py

ROWS, FEATURES, CLASSES, GLOBAL = 100, 6, 3, 24  # the last batch (4 rows) leaves a replica of 3 empty


def _data(seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    return rng.normal(size=(ROWS, FEATURES)).astype("float32"), rng.integers(0, CLASSES, size=ROWS)


def _mlp(seed: int = 0, head: str | None = "softmax", dropout: float = 0.0) -> keras.Model:
    keras.utils.set_random_seed(seed)
    inp = keras.Input((FEATURES,))
    h = keras.layers.Dense(16, activation="relu")(inp)
    if dropout:
        h = keras.layers.Dropout(dropout)(h)
    out = keras.layers.Dense(CLASSES, activation=head)(h)
    return keras.Model(inp, out)


def _ours(net: keras.Model, replicas: int, **compile_kwargs) -> mr.Model:
    with strategy_of(replicas).scope():
        model = mr.Model(net)
        model.compile(**compile_kwargs)
    return model


def _assert_same_fit(ref: keras.Model, ours: mr.Model, h_ref, h_ours, atol: float = 1e-4) -> None:
    for key, values in h_ref.history.items():
        np.testing.assert_allclose(h_ours.history[key], values, atol=1e-3, err_msg=key)
    for copy in ours.replicas:
        for v, a, b in zip(ref.weights, ref.get_weights(), copy.get_weights()):
            np.testing.assert_allclose(b, a, atol=atol, err_msg=v.path)
    ours.check_in_sync()


def test_import_mirrored_does_not_import_keras():
    """`import mirrored`, a scope and a torch model's fit never import keras (it stays optional)."""
    probe = ("import sys, numpy as np, torch, mirrored as mr\n"
             "with mr.MirroredStrategy(devices=['cpu:0', 'cpu:1']).scope():\n"
             "    m = mr.Model(torch.nn.Linear(3, 2)); m.compile(optimizer='sgd', loss='mse')\n"
             "m.fit(np.zeros((4, 3), 'float32'), np.zeros((4, 2), 'float32'), batch_size=4, verbose=0)\n"
             "print('keras' in sys.modules)\n")
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().splitlines()[-1] == "False"


OPTIMIZERS = {
    "sgd": lambda: keras.optimizers.SGD(learning_rate=0.1),
    "sgd_momentum": lambda: keras.optimizers.SGD(learning_rate=0.05, momentum=0.9, nesterov=False),
    "adam": lambda: keras.optimizers.Adam(learning_rate=0.01),
}


@pytest.mark.parametrize("replicas", [1, 2, 3])
@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_fit_equals_keras_fit(name, replicas):
    """Softmax head, the loss string (probabilities, as Keras means it), "accuracy": N replicas equal
    Keras's own fit on one device, an uneven last batch included."""
    x, y = _data()
    ref = _mlp()
    ref.compile(optimizer=OPTIMIZERS[name](), loss="sparse_categorical_crossentropy", metrics=["accuracy"])
    h_ref = ref.fit(x, y, batch_size=GLOBAL, epochs=3, shuffle=False, verbose=0)
    ours = _ours(_mlp(), replicas, optimizer=OPTIMIZERS[name](), loss="sparse_categorical_crossentropy",
                 metrics=["accuracy"])
    h_ours = ours.fit(x, y, batch_size=GLOBAL, epochs=3, shuffle=False, verbose=0)
    _assert_same_fit(ref, ours, h_ref, h_ours)
    np.testing.assert_allclose(ours.evaluate(x, y, batch_size=GLOBAL, verbose=0),
                               ref.evaluate(x, y, batch_size=GLOBAL, verbose=0), atol=1e-5)
    np.testing.assert_allclose(ours.predict(x, batch_size=GLOBAL, verbose=0), ref.predict(x, verbose=0), atol=1e-5)


class _Subclassed(keras.Model):
    """A subclassed model with a custom layer that is not registered for Keras's serialization."""

    def __init__(self):
        super().__init__()
        self.hidden = keras.layers.Dense(16, activation="relu")
        self.scale = _Records()
        self.out = keras.layers.Dense(CLASSES, activation="softmax")

    def call(self, inputs, training=False):
        return self.out(self.scale(self.hidden(inputs), training=training))


@pytest.mark.parametrize("kind", ["sequential", "subclassed"])
def test_sequential_and_subclassed_models_equal_keras_fit(kind):
    """Sequential and subclassed models (with an unregistered custom layer, which Keras's own copy
    through its saving library could not rebuild) train on 2 replicas as Keras's fit on one device."""
    x, y = _data(11)

    def net():
        keras.utils.set_random_seed(11)
        if kind == "sequential":
            return keras.Sequential([keras.Input((FEATURES,)), keras.layers.Dense(16, activation="relu"),
                                     _Records(), keras.layers.Dense(CLASSES, activation="softmax")])
        model = _Subclassed()
        model(x[:1])
        return model

    ref = net()
    ref.compile(optimizer=keras.optimizers.Adam(0.01), loss="sparse_categorical_crossentropy", metrics=["accuracy"])
    h_ref = ref.fit(x, y, batch_size=GLOBAL, epochs=2, shuffle=False, verbose=0)
    ours = _ours(net(), 2, optimizer=keras.optimizers.Adam(0.01), loss="sparse_categorical_crossentropy",
                 metrics=["accuracy"])
    h_ours = ours.fit(x, y, batch_size=GLOBAL, epochs=2, shuffle=False, verbose=0)
    _assert_same_fit(ref, ours, h_ref, h_ours)


def test_mr_optimizer_on_a_keras_model():
    """mr.optimizers.SGD with momentum (torch's rule, equal to Keras's at a constant rate) trains a
    Keras model's trainable variables only, as keras.optimizers.SGD does on one device."""
    x, y = _data(13)
    ref = _bn_model(13, dropout=0.0)
    ref.compile(optimizer=keras.optimizers.SGD(0.05, momentum=0.9), loss="sparse_categorical_crossentropy")
    h_ref = ref.fit(x, y, batch_size=GLOBAL, epochs=2, shuffle=False, verbose=0)
    ours = _ours(_bn_model(13, dropout=0.0), 1, optimizer=mr.optimizers.SGD(0.05, momentum=0.9),
                 loss="sparse_categorical_crossentropy")
    h_ours = ours.fit(x, y, batch_size=GLOBAL, epochs=2, shuffle=False, verbose=0)
    _assert_same_fit(ref, ours, h_ref, h_ours)


OPTION_CASES = {
    "adamw": lambda: keras.optimizers.AdamW(learning_rate=0.01, weight_decay=0.1),
    "rmsprop": lambda: keras.optimizers.RMSprop(learning_rate=0.01, momentum=0.5, centered=True),
    "clipnorm": lambda: keras.optimizers.SGD(learning_rate=0.5, clipnorm=0.05),
    "global_clipnorm": lambda: keras.optimizers.Adam(learning_rate=0.01, global_clipnorm=0.1),
    "clipvalue": lambda: keras.optimizers.SGD(learning_rate=0.5, clipvalue=0.01),
    "accumulation": lambda: keras.optimizers.SGD(learning_rate=0.1, momentum=0.9, gradient_accumulation_steps=2),
    "ema": lambda: keras.optimizers.Adam(learning_rate=0.01, use_ema=True, ema_momentum=0.9,
                                         ema_overwrite_frequency=3),
    "loss_scale_factor": lambda: keras.optimizers.SGD(learning_rate=0.1, loss_scale_factor=128.0),
    "schedule": lambda: keras.optimizers.SGD(
        learning_rate=keras.optimizers.schedules.ExponentialDecay(0.2, decay_steps=3, decay_rate=0.5)),
}


@pytest.mark.parametrize("name", list(OPTION_CASES))
def test_keras_optimizer_options_equal_keras_fit(name):
    """Each Keras optimizer option acts as in Keras's own fit (on the all-reduced gradients)."""
    x, y = _data(1)
    ref = _mlp(1)
    ref.compile(optimizer=OPTION_CASES[name](), loss="sparse_categorical_crossentropy")
    h_ref = ref.fit(x, y, batch_size=GLOBAL, epochs=2, shuffle=False, verbose=0)
    ours = _ours(_mlp(1), 2, optimizer=OPTION_CASES[name](), loss="sparse_categorical_crossentropy")
    h_ours = ours.fit(x, y, batch_size=GLOBAL, epochs=2, shuffle=False, verbose=0)
    _assert_same_fit(ref, ours, h_ref, h_ours)
    assert ours.optimizer.iterations == int(ref.optimizer.iterations)


def test_keras_losses_and_metrics_objects():
    """keras.losses objects (from_logits=True on a linear head) and keras.metrics objects give Keras's
    values; a name with a Keras model means what Keras means (the optimizer "adam" is Keras's Adam; a
    metric name mirrored does not have is Keras's metric)."""
    x, y = _data(2)
    onehot = np.eye(CLASSES, dtype="float32")[y]

    def compile_args():
        return dict(optimizer="adam", loss=keras.losses.CategoricalCrossentropy(from_logits=True, label_smoothing=0.1),
                    metrics=[keras.metrics.CategoricalAccuracy(), keras.metrics.AUC(from_logits=True, name="auc"),
                             keras.metrics.TopKCategoricalAccuracy(k=2), "mean_squared_error"])

    ref = _mlp(2, head=None)
    ref.compile(**compile_args())
    h_ref = ref.fit(x, onehot, batch_size=GLOBAL, epochs=2, shuffle=False, verbose=0)
    ours = _ours(_mlp(2, head=None), 3, **compile_args())
    h_ours = ours.fit(x, onehot, batch_size=GLOBAL, epochs=2, shuffle=False, verbose=0)
    assert set(h_ours.history) == set(h_ref.history)
    _assert_same_fit(ref, ours, h_ref, h_ours)


def test_regularizers_as_in_keras_fit():
    """Weight and activity regularizers (model.losses) add to the loss as in Keras's own fit."""
    x, y = _data(9)

    def net():
        keras.utils.set_random_seed(9)
        inp = keras.Input((FEATURES,))
        h = keras.layers.Dense(16, activation="relu", kernel_regularizer=keras.regularizers.L2(0.01),
                               activity_regularizer=keras.regularizers.L1(0.001))(inp)
        return keras.Model(inp, keras.layers.Dense(CLASSES, activation="softmax")(h))

    ref = net()
    ref.compile(optimizer=keras.optimizers.SGD(0.1), loss="sparse_categorical_crossentropy")
    h_ref = ref.fit(x, y, batch_size=GLOBAL, epochs=2, shuffle=False, verbose=0)
    ours = _ours(net(), 2, optimizer=keras.optimizers.SGD(0.1), loss="sparse_categorical_crossentropy")
    h_ours = ours.fit(x, y, batch_size=GLOBAL, epochs=2, shuffle=False, verbose=0)
    _assert_same_fit(ref, ours, h_ref, h_ours)


class _Records(keras.layers.Layer):
    """Passes its input through and records the `training` it was called with."""

    seen: list = []

    def call(self, inputs, training=None):
        _Records.seen.append(training)
        return inputs


def test_training_flag_as_keras_trainer_passes_it():
    """training=True in fit's train steps, False in validation, evaluate, predict and model(x)."""
    keras.utils.set_random_seed(0)
    inp = keras.Input((FEATURES,))
    out = keras.layers.Dense(CLASSES, activation="softmax")(_Records()(inp))
    model = _ours(keras.Model(inp, out), 2, optimizer="sgd", loss="sparse_categorical_crossentropy")
    x, y = _data()
    _Records.seen.clear()
    model.fit(x[:48], y[:48], batch_size=GLOBAL, epochs=1, verbose=0)
    assert _Records.seen and all(t is True for t in _Records.seen)
    for run in (lambda: model.evaluate(x, y, batch_size=GLOBAL, verbose=0),
                lambda: model.predict(x, batch_size=GLOBAL, verbose=0), lambda: model(x[:4]),
                lambda: model.fit(x[:24], y[:24], batch_size=GLOBAL, validation_data=(x[:24], y[:24]), verbose=0)):
        _Records.seen.clear()
        run()
        assert False in _Records.seen
    model.fit(x[:24], y[:24], batch_size=GLOBAL, validation_data=(x[:24], y[:24]), verbose=0)


def _bn_model(seed: int = 0, dropout: float = 0.3) -> keras.Model:
    # Layer names (and so state_dict keys) count the layers made so far in the process; a resumed run
    # is a new process, where they start again, as they do here after clear_session().
    keras.backend.clear_session()
    keras.utils.set_random_seed(seed)
    inp = keras.Input((FEATURES,))
    h = keras.layers.Dense(8)(inp)
    h = keras.layers.BatchNormalization(momentum=0.5)(h)
    if dropout:
        h = keras.layers.Dropout(dropout)(h)
    out = keras.layers.Dense(CLASSES, activation="softmax")(h)
    return keras.Model(inp, out)


def test_batchnorm_moving_statistics_are_the_replicas_mean():
    """One step on 2 replicas: each replica's moving mean and variance equal the mean of what Keras
    computes on each replica's half of the batch (tf.keras's sync-on-read MEAN); the dropout seed
    states and every other variable stay in sync (check_in_sync)."""
    x, y = _data(3)
    x, y = x[:GLOBAL], y[:GLOBAL]
    halves = [_bn_model(), _bn_model()]
    for half, rows in zip(halves, (slice(0, 12), slice(12, 24))):
        half(x[rows], training=True)
    bn = [next(l for l in h.layers if isinstance(l, keras.layers.BatchNormalization)) for h in halves]
    expected_mean = (bn[0].moving_mean.numpy() + bn[1].moving_mean.numpy()) / 2
    expected_var = (bn[0].moving_variance.numpy() + bn[1].moving_variance.numpy()) / 2

    model = _ours(_bn_model(), 2, optimizer=keras.optimizers.SGD(0.0), loss="sparse_categorical_crossentropy")
    model.fit(x, y, batch_size=GLOBAL, epochs=1, shuffle=False, verbose=0)
    for copy in model.replicas:
        layer = next(l for l in copy.layers if isinstance(l, keras.layers.BatchNormalization))
        assert np.abs(layer.moving_mean.numpy()).max() > 1e-3  # the statistics moved
        np.testing.assert_allclose(layer.moving_mean.numpy(), expected_mean, atol=1e-6)
        np.testing.assert_allclose(layer.moving_variance.numpy(), expected_var, atol=1e-6)
    model.fit(*_data(4), batch_size=GLOBAL, epochs=1, verbose=0)  # (an empty part in the last batch too)
    model.check_in_sync()


class _FailsOnReplica1(keras.layers.Layer):
    """Raises in replica 1's training call while `armed` (after the BatchNormalization before it ran)."""

    armed = False

    def call(self, inputs, training=None):
        ctx = mr.get_replica_context()
        if training and _FailsOnReplica1.armed and ctx is not None and ctx.replica_id_in_sync_group == 1:
            raise RuntimeError("injected failure")
        return inputs


def test_failed_step_puts_moving_statistics_back():
    """A step that fails in one replica leaves every replica's moving statistics as they were."""
    keras.utils.set_random_seed(0)
    inp = keras.Input((FEATURES,))
    h = _FailsOnReplica1()(keras.layers.BatchNormalization(momentum=0.5)(keras.layers.Dense(8)(inp)))
    model = _ours(keras.Model(inp, keras.layers.Dense(CLASSES, activation="softmax")(h)), 2, optimizer="sgd",
                  loss="sparse_categorical_crossentropy")
    x, y = _data(10)
    model.fit(x[:GLOBAL], y[:GLOBAL], batch_size=GLOBAL, verbose=0)
    before = [copy.get_weights() for copy in model.replicas]
    _FailsOnReplica1.armed = True
    try:
        with pytest.raises(RuntimeError, match="injected failure"):
            model.fit(x[:GLOBAL], y[:GLOBAL], batch_size=GLOBAL, verbose=0)
    finally:
        _FailsOnReplica1.armed = False
    for copy, saved in zip(model.replicas, before):
        for a, b in zip(copy.get_weights(), saved):
            np.testing.assert_array_equal(a, b)
    model.check_in_sync()


def test_seeded_dropout_state_advances_as_on_one_device():
    """A seeded Dropout's seed generator state advances once per step on every replica, a replica
    whose part of the last batch is empty included, and ends where Keras's own fit leaves it; the
    empty replica's moving statistics, which did not move, are synced too (this step used to fail in
    the copies' check before the sync)."""
    x, y = _data(12)

    def net():
        keras.backend.clear_session()
        keras.utils.set_random_seed(12)
        inp = keras.Input((FEATURES,))
        h = keras.layers.BatchNormalization()(keras.layers.Dense(16, activation="relu")(inp))
        h = keras.layers.Dropout(0.5, seed=7)(h)
        return keras.Model(inp, keras.layers.Dense(CLASSES, activation="softmax")(h))

    ref = net()
    ref.compile(optimizer="sgd", loss="sparse_categorical_crossentropy")
    ref.fit(x, y, batch_size=GLOBAL, epochs=2, shuffle=False, verbose=0)
    ours = _ours(net(), 3, optimizer="sgd", loss="sparse_categorical_crossentropy")
    ours.fit(x, y, batch_size=GLOBAL, epochs=2, shuffle=False, verbose=0)  # last batch: 2, 2 and 0 rows
    ours.check_in_sync()
    state = [v for v in ref.variables if "seed_generator" in v.path]
    assert state and int(state[0].numpy()[1]) > 0
    for copy in ours.replicas:
        mine = [v for v in copy.variables if "seed_generator" in v.path]
        np.testing.assert_array_equal(mine[0].numpy(), state[0].numpy())


def test_keras_archive_round_trip(tmp_path):
    """Model.save("x.keras") writes Keras's archive; keras.models.load_model predicts identically."""
    x, y = _data(5)
    model = _ours(_bn_model(5), 2, optimizer="adam", loss="sparse_categorical_crossentropy")
    model.fit(x, y, batch_size=GLOBAL, epochs=1, verbose=0)
    model.save(tmp_path / "m.keras")
    loaded = keras.models.load_model(tmp_path / "m.keras")
    np.testing.assert_array_equal(loaded.predict(x, verbose=0), model.predict(x, batch_size=GLOBAL, verbose=0))
    with strategy_of(2).scope():
        again = mr.Model.load(tmp_path / "m.keras")  # on 2 replicas, to compile and train on
    np.testing.assert_array_equal(again.predict(x, batch_size=GLOBAL, verbose=0), loaded.predict(x, verbose=0))
    with pytest.raises(ValueError, match="Keras's archive"):
        _ours(torch.nn.Linear(3, 2), 1, optimizer="sgd", loss="mse").save(tmp_path / "t.keras")


def test_model_checkpoint_writes_keras_archives(tmp_path):
    """ModelCheckpoint with a ".keras" filepath writes Keras archives that keras.models.load_model reads."""
    x, y = _data(5)
    model = _ours(_bn_model(5), 2, optimizer="adam", loss="sparse_categorical_crossentropy")
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*not Keras zip")  # it IS a Keras archive: no warning says otherwise
        checkpoints = mr.callbacks.ModelCheckpoint(str(tmp_path / "m-{epoch}.keras"), save_best_only=False)
    model.fit(x, y, batch_size=GLOBAL, epochs=2, verbose=0, callbacks=[checkpoints])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m-1.keras", "m-2.keras"]
    loaded = keras.models.load_model(tmp_path / "m-2.keras")
    np.testing.assert_array_equal(loaded.predict(x, verbose=0), model.predict(x, batch_size=GLOBAL, verbose=0))


def test_model_checkpoint_to_keras_files_of_a_torch_model_is_refused_before_training(tmp_path):  # issue 23
    model = _ours(torch.nn.Linear(3, 2), 1, optimizer="sgd", loss="mse")
    x, y = np.zeros((4, 3), "float32"), np.zeros((4, 2), "float32")
    with pytest.raises(ValueError, match=r"ModelCheckpoint\(.*m\.keras'\): \".keras\" is Keras's archive.*Linear"):
        model.fit(x, y, batch_size=4, epochs=1, verbose=0,
                  callbacks=[mr.callbacks.ModelCheckpoint(str(tmp_path / "m.keras"))])
    assert not list(tmp_path.iterdir())


def test_learning_rate_callbacks_set_the_keras_optimizer_rate():
    """mr.callbacks.LearningRateScheduler sets the Keras optimizer's rate on every replica, as
    Keras's LearningRateScheduler does on one device."""
    x, y = _data(8)

    def schedule(epoch, lr):
        return 0.1 / (epoch + 1)

    ref = _mlp(8)
    ref.compile(optimizer=keras.optimizers.SGD(0.1, momentum=0.5), loss="sparse_categorical_crossentropy")
    h_ref = ref.fit(x, y, batch_size=GLOBAL, epochs=3, shuffle=False, verbose=0,
                    callbacks=[keras.callbacks.LearningRateScheduler(schedule)])
    ours = _ours(_mlp(8), 2, optimizer=keras.optimizers.SGD(0.1, momentum=0.5), loss="sparse_categorical_crossentropy")
    h_ours = ours.fit(x, y, batch_size=GLOBAL, epochs=3, shuffle=False, verbose=0,
                      callbacks=[mr.callbacks.LearningRateScheduler(schedule)])
    _assert_same_fit(ref, ours, h_ref, h_ours)
    assert ours.optimizer.learning_rate == pytest.approx(0.1 / 3)


def test_backup_and_restore_resumes_exactly(tmp_path):
    """BackupAndRestore with a Keras model and a Keras optimizer: a run stopped after epoch 1 and
    resumed equals the run that was not stopped (weights, Adam's state, BatchNorm statistics). (With
    dropout: test_backup_and_restore_with_unseeded_keras_random_ops_resumes_bitwise.)"""
    x, y = _data(6)

    def run(epochs, backup):
        model = _ours(_bn_model(6, dropout=0.0), 2, optimizer=keras.optimizers.Adam(0.01), loss="sparse_categorical_crossentropy")
        cbs = [mr.callbacks.BackupAndRestore(str(backup))] if backup else []
        model.fit(x, y, batch_size=GLOBAL, epochs=epochs, shuffle=False, verbose=0, callbacks=cbs)
        return model

    straight = run(3, None)

    class Stop(mr.callbacks.Callback):
        def on_epoch_end(self, epoch, logs=None):
            if epoch == 1:
                raise KeyboardInterrupt

    model = _ours(_bn_model(6, dropout=0.0), 2, optimizer=keras.optimizers.Adam(0.01), loss="sparse_categorical_crossentropy")
    with pytest.raises(KeyboardInterrupt):
        model.fit(x, y, batch_size=GLOBAL, epochs=3, shuffle=False, verbose=0,
                  callbacks=[mr.callbacks.BackupAndRestore(str(tmp_path)), Stop()])
    resumed = run(3, tmp_path)
    for a, b in zip(straight.get_weights(), resumed.get_weights()):
        np.testing.assert_allclose(b, a, atol=1e-6)


def test_refused_with_the_fix():
    with pytest.raises(ValueError, match="not built yet"):  # each replica would draw its own weights
        _ours(keras.Sequential([keras.layers.Dense(3)]), 2, optimizer="sgd", loss="mse")
    with pytest.raises(ValueError, match="LossScaleOptimizer"):
        _ours(_mlp(), 1, optimizer=keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD()),
              loss="sparse_categorical_crossentropy")
    with pytest.raises(ValueError, match="jit_compile=True"):
        _ours(_mlp(), 1, optimizer="sgd", loss="sparse_categorical_crossentropy", jit_compile=True)
    with pytest.raises(TypeError, match="mr.optimizers.Adam"):
        _ours(torch.nn.Linear(3, 2), 1, optimizer=keras.optimizers.Adam(), loss="mse")
    with pytest.raises(ValueError, match="Keras does not know this loss"):
        _ours(_mlp(), 1, optimizer="sgd", loss="no_such_loss")
    with pytest.raises(ValueError, match="mean_with_sample_weight"):
        _ours(_mlp(), 1, optimizer="sgd",
              loss=keras.losses.SparseCategoricalCrossentropy(reduction="mean_with_sample_weight"))


def test_strategy_mirror_custom_loop_keeps_batchnorm_in_sync():
    """strategy.mirror(keras_model) in a custom loop: a mirrored optimizer's step syncs the moving
    statistics too, so the copies stay equal."""
    strategy = strategy_of(2)
    x, y = _data(7)
    with strategy.scope():
        mnet = strategy.mirror(_bn_model(7))
        opt = strategy.mirror_optimizer(torch.optim.SGD, mnet, lr=0.1)
    loss_fn = keras.losses.SparseCategoricalCrossentropy(reduction="none")

    def step(xb, yb):
        per_example = loss_fn(yb, mnet(xb, training=True))
        mr.losses.compute_average_loss(per_example, global_batch_size=GLOBAL).backward()
        opt.step()
        opt.zero_grad()

    ds = strategy.experimental_distribute_dataset(mr.data.Dataset.from_tensor_slices((x, y)).batch(GLOBAL))
    for xb, yb in ds:
        strategy.run(step, args=(xb, yb))
    strategy.check_in_sync(mnet)
    layer = next(l for l in mnet.values[0].layers if isinstance(l, keras.layers.BatchNormalization))
    assert np.abs(layer.moving_mean.numpy()).max() > 1e-3


def test_small_conv_net_learns_on_two_replicas():
    """A functional conv net with BatchNormalization (ResNet's blocks, small) learns on 2 replicas."""
    keras.utils.set_random_seed(0)
    inp = keras.Input((16, 16, 3))
    h = keras.layers.Conv2D(8, 3, padding="same")(inp)
    h = keras.layers.BatchNormalization()(h)
    h = keras.layers.Activation("relu")(h)
    h = keras.layers.Add()([h, keras.layers.Conv2D(8, 1)(inp)])
    h = keras.layers.GlobalAveragePooling2D()(h)
    out = keras.layers.Dense(2, activation="softmax")(h)
    rng = np.random.default_rng(0)
    y = rng.integers(0, 2, size=128)
    x = (rng.normal(size=(128, 16, 16, 3)) + y[:, None, None, None] * 0.5).astype("float32")
    model = _ours(keras.Model(inp, out), 2, optimizer=keras.optimizers.Adam(0.01),
                  loss="sparse_categorical_crossentropy", metrics=["accuracy"])
    history = model.fit(x, y, batch_size=32, epochs=4, verbose=0)
    assert history.history["loss"][-1] < history.history["loss"][0] * 0.9
    model.check_in_sync()


@pytest.mark.slow
def test_keras_applications_resnet50_learns_on_two_replicas():
    """keras.applications.ResNet50 (weights=None, 32x32) learns on 2 replicas: the loss falls."""
    keras.utils.set_random_seed(0)
    net = keras.applications.ResNet50(weights=None, input_shape=(32, 32, 3), classes=2)
    rng = np.random.default_rng(0)
    y = rng.integers(0, 2, size=64)
    x = (rng.normal(size=(64, 32, 32, 3)) * 0.2 + y[:, None, None, None]).astype("float32")
    model = _ours(net, 2, optimizer=keras.optimizers.SGD(0.01, momentum=0.9),
                  loss="sparse_categorical_crossentropy")
    history = model.fit(x, y, batch_size=16, epochs=3, verbose=0)
    assert history.history["loss"][-1] < history.history["loss"][0]
    model.check_in_sync()


# ---- between features: Keras models (issue 23) with the replicas' random draws (issue 26) -------------
def _seeded_dropout_outputs(replicas: int) -> list[np.ndarray]:
    """Each replica's output of a seeded Dropout on a batch of ones, for two steps."""
    keras.utils.set_random_seed(0)
    inp = keras.Input((32,))
    net = keras.Model(inp, keras.layers.Dropout(0.5, seed=7)(inp))
    strategy = strategy_of(replicas)
    with strategy.scope():
        mnet = strategy.mirror(net)
    ones = strategy.experimental_distribute_values_from_function(lambda ctx: torch.ones(4, 32))
    outs = []
    for _ in range(2):
        result = strategy.run(lambda x: mnet(x, training=True), args=(ones,))
        outs.append([t.detach().numpy().copy() for t in strategy.experimental_local_results(result)])
    return outs


def test_seeded_keras_dropout_draws_a_mask_per_replica_and_replica_0_draws_keras_own():
    """Issues 23 x 26: a seeded Keras Dropout draws from its SeedGenerator, whose state the replicas
    hold equal, so every replica drew the same mask for its different examples (correlated dropout).
    Replica 0 now draws what Keras draws on one device, replica 1 another mask, and two runs agree."""
    keras.utils.set_random_seed(0)
    inp = keras.Input((32,))
    ref = keras.Model(inp, keras.layers.Dropout(0.5, seed=7)(inp))
    want = [ref(torch.ones(4, 32), training=True).detach().numpy() for _ in range(2)]
    got = _seeded_dropout_outputs(2)
    for step, (mine, keras_own) in enumerate(zip(got, want)):
        np.testing.assert_array_equal(mine[0], keras_own, err_msg=f"step {step}: replica 0 against Keras")
        assert not np.array_equal(mine[1], mine[0]), f"step {step}: replica 1 drew replica 0's mask"
        assert 0.3 < (mine[1] == 0).mean() < 0.7  # still a rate-0.5 mask
    again = _seeded_dropout_outputs(2)
    for a, b in zip(got, again):
        for x, y in zip(a, b):
            np.testing.assert_array_equal(x, y)


def _last_line_of_fresh_process(probe: str) -> str:
    """The last line `probe` prints, run in a fresh Python process on Keras's torch backend."""
    env = {**os.environ, "KERAS_BACKEND": "torch"}
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout.strip().splitlines()[-1]


def test_strategy_mirror_alone_keeps_a_keras_models_state_in_sync():
    """Issue 23: a program that only calls strategy.mirror(keras_model) (never mr.Model) gets the Keras
    adapter's copier and state sync too; BatchNormalization's moving statistics used to drift apart
    silently, because the adapter was imported only through mr.Model. A fresh process, as a user's."""
    probe = ("import os; os.environ['KERAS_BACKEND'] = 'torch'\n"
             "import keras, torch, mirrored as mr\n"
             "keras.utils.set_random_seed(0)\n"
             "inp = keras.Input((6,))\n"
             "h = keras.layers.BatchNormalization()(keras.layers.Dense(8)(inp))\n"
             "net = keras.Model(inp, keras.layers.Dense(3)(h))\n"
             "s = mr.MirroredStrategy(devices=['cpu:0', 'cpu:1'])\n"
             "with s.scope():\n"
             "    m = s.mirror(net)\n"
             "    opt = s.mirror_optimizer(torch.optim.SGD, m, lr=0.1)\n"
             "x = torch.randn(8, 6)\n"
             "def step(x):\n"
             "    m(x, training=True).square().mean().backward(); opt.step(); opt.zero_grad()\n"
             "part = lambda ctx: x[4 * ctx.replica_id_in_sync_group:][:4]\n"
             "s.run(step, args=(s.experimental_distribute_values_from_function(part),))\n"
             "s.check_in_sync(m)\n"
             "print('in sync')\n")
    assert _last_line_of_fresh_process(probe) == "in sync"


@pytest.mark.parametrize("mirror", ["mr.Model(net)", "mr.MirroredStrategy(devices=['cpu:0', 'cpu:1']).mirror(net)"],
                         ids=["mr.Model", "strategy.mirror"])
def test_is_keras_model_is_pure_and_mirroring_outside_a_scope_installs_the_replica_seeds(mirror):
    """Review leftover 4: the predicate is_keras_model installed the per-replica Keras seeds (and the
    global-batch BatchNormalization) as a side effect; now a Keras model's adoption does (mr.Model,
    strategy.mirror's copies), also outside any strategy's scope. A fresh process: the patches are
    process-wide, and another test may have installed them."""
    probe = ("import os; os.environ['KERAS_BACKEND'] = 'torch'\n"
             "import keras, mirrored as mr\n"
             "from keras.src.random import seed_generator\n"
             "from keras.src.layers.normalization.batch_normalization import BatchNormalization as BN\n"
             "from mirrored.training import keras_adapter\n"
             "keras_next, keras_moments = seed_generator.SeedGenerator.next, BN._moments\n"
             "net = keras.Sequential([keras.Input((3,)), keras.layers.Dropout(0.5, seed=1), keras.layers.Dense(2)])\n"
             "assert keras_adapter.is_keras_model(net)\n"
             "print('pure' if (seed_generator.SeedGenerator.next, BN._moments) == (keras_next, keras_moments)\n"
             "      else 'patched by the predicate')\n"
             f"m = {mirror}\n"
             "print(seed_generator.SeedGenerator.next is not keras_next and BN._moments is not keras_moments)\n")
    env = {**os.environ, "KERAS_BACKEND": "torch"}
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split() == ["pure", "True"], done.stdout


def test_preprocessing_layers_are_copied_for_the_replicas():
    """Issue 23 (keras.io's "Image classification from scratch" ported): a model starting with
    RandomFlip and RandomRotation crashed the process (a segmentation fault) when mr.Model copied it
    for the replicas: their DynamicBackend recursed in copy. Now the copies train, in sync, and the
    augmentation runs in training only, as in Keras (predict equals the unaugmented network)."""
    keras.utils.set_random_seed(0)
    inp = keras.Input((8, 8, 3))
    h = keras.layers.RandomRotation(0.1)(keras.layers.RandomFlip("horizontal")(inp))
    out = keras.layers.Dense(2, activation="softmax")(keras.layers.Flatten()(h))
    net = keras.Model(inp, out)
    x = np.random.default_rng(0).random((16, 8, 8, 3), dtype=np.float32)
    model = _ours(net, 2, optimizer=keras.optimizers.SGD(learning_rate=0.1), loss="sparse_categorical_crossentropy")
    model.fit(x, np.arange(16) % 2, batch_size=8, verbose=0)
    model.check_in_sync()
    copy = model.replicas[1]
    assert copy.layers[1].backend is not net.layers[1].backend and copy.layers[1].backend.name == "torch"
    flat = keras.Model(inp, keras.layers.Dense(2, activation="softmax")(keras.layers.Flatten()(inp)))
    flat.layers[-1].set_weights(model.replicas[0].layers[-1].get_weights())
    np.testing.assert_allclose(model.predict(x, verbose=0), keras.ops.convert_to_numpy(flat(x)), atol=1e-6)


def test_per_example_random_keys_keras_dropout_and_refuses_a_seeded_one():
    """Issues 23 x 26: with per_example_random=True an unseeded Keras Dropout (torch's dropout) draws
    the same masks on 1 and 2 replicas; a seeded one draws from its own generator, which cannot be
    keyed by example, and is refused by name instead of depending silently on the replica count."""
    def masks(seed: int | None, replicas: int) -> torch.Tensor:
        keras.utils.set_random_seed(0)
        inp = keras.Input((32,))
        net = keras.Model(inp, keras.layers.Dropout(0.5, seed=seed)(inp))
        strategy = strategy_of(replicas, per_example_random=True, seed=3)
        with strategy.scope():
            mnet = strategy.mirror(net)
        batch = next(iter(strategy.experimental_distribute_dataset(mr.data.Dataset.from_tensors(torch.ones(4, 32)))))
        out = strategy.run(lambda x: mnet(x, training=True), args=(batch,))
        return torch.cat(strategy.experimental_local_results(out)).detach()

    one = masks(None, 1)
    assert torch.equal(one, masks(None, 2)) and 0.3 < (one == 0).float().mean() < 0.7
    with pytest.raises(RuntimeError, match="per_example_random=True.*Drop seed="):
        masks(7, 2)


class _SlowNoise(keras.layers.Layer):
    """Adds keras.random.normal(seed=None) - Keras's global SeedGenerator - and, when `slow`, makes
    replica 1 reach it late on every other call, so the threads draw in another order."""

    slow = False
    calls = 0

    def call(self, x, training=False):
        ctx = mr.get_replica_context()
        if _SlowNoise.slow and ctx is not None and ctx.replica_id_in_sync_group == 1:
            _SlowNoise.calls += 1
            if _SlowNoise.calls % 2:
                time.sleep(0.02)
        return x + 0.1 * keras.random.normal(keras.ops.shape(x)) if training else x


def _unseeded_fit(replicas: int, slow: bool) -> list[np.ndarray]:
    """The weights after a fit of a model whose random ops have no seed: keras.random.normal(seed=None),
    GaussianNoise() and Dropout() (torch's dropout), on `replicas` replicas of a strategy with seed=3."""
    _SlowNoise.slow, _SlowNoise.calls = slow, 0
    keras.utils.set_random_seed(0)
    inp = keras.Input((FEATURES,))
    h = keras.layers.Dense(16, activation="relu")(inp)
    h = keras.layers.Dropout(0.5)(keras.layers.GaussianNoise(0.2)(_SlowNoise()(h)))
    net = keras.Model(inp, keras.layers.Dense(CLASSES, activation="softmax")(h))
    with strategy_of(replicas, seed=3).scope():
        model = mr.Model(net)
        model.compile(optimizer="sgd", loss="sparse_categorical_crossentropy")
    keras.utils.set_random_seed(1)  # Python's `random`, which Keras seeds its global SeedGenerators from
    x, y = _data()
    model.fit(x, y, batch_size=GLOBAL, epochs=2, verbose=0, shuffle=False)
    model.check_in_sync()
    return [w.copy() for w in model.replicas[0].get_weights()]


@pytest.mark.parametrize("replicas", [2, 3])
def test_unseeded_keras_random_ops_draw_the_same_whatever_the_thread_order(replicas):
    """Issue 26: keras.random.*(seed=None) drew from Keras's global SeedGenerator, which Keras keeps per
    thread and seeds from Python's `random` at each replica thread's first draw, in thread order, so
    two runs differed when a replica ran late. Unseeded Keras ops now draw from the replica's own
    generator: runs with and without a slow replica give bitwise the same weights."""
    want = _unseeded_fit(replicas, slow=False)
    got = _unseeded_fit(replicas, slow=True)
    for a, b in zip(want, got):
        np.testing.assert_array_equal(a, b)


def test_seeded_keras_random_layers_on_one_replica_draw_what_keras_draws():
    """Issue 26: on one replica a seeded GaussianNoise and Dropout draw Keras's own values, step after
    step (replica 0 keeps Keras's seeds). Unseeded ones draw from the strategy's seed instead: Keras
    alone draws those from Python's `random` at the thread's first draw, which no strategy reproduces."""
    def net() -> keras.Model:
        keras.utils.set_random_seed(0)
        inp = keras.Input((32,))
        return keras.Model(inp, keras.layers.Dropout(0.5, seed=7)(keras.layers.GaussianNoise(1.0, seed=5)(inp)))

    ref = net()
    want = [ref(torch.ones(4, 32), training=True).detach().numpy() for _ in range(3)]
    strategy = strategy_of(1)
    with strategy.scope():
        mnet = strategy.mirror(net())
    got = [strategy.run(lambda x: mnet(x, training=True), args=(torch.ones(4, 32),)).detach().numpy()
           for _ in range(3)]
    for step, (a, b) in enumerate(zip(got, want)):
        np.testing.assert_array_equal(a, b, err_msg=f"step {step}")


def test_per_example_random_refuses_unseeded_keras_random_ops_by_name():
    """Issue 26: keras.random.normal(seed=None) in a step of a per_example_random strategy would draw per
    replica, not per example; it is refused by name rather than silently depending on the replica count."""
    strategy = mr.MirroredStrategy(devices=["cpu:0", "cpu:1"], per_example_random=True, seed=3)
    assert mr.Model  # mirrored.training loaded (by mr.Model, mr.train or mirroring a Keras model): no Keras model needed
    with strategy.scope():
        pass
    with pytest.raises(RuntimeError, match=r"keras.random with seed=None.*per_example_random=True"):
        strategy.run(lambda x: x + keras.random.normal((4,)), args=(torch.ones(4),))


def test_backup_and_restore_with_unseeded_keras_random_ops_resumes_bitwise(tmp_path):
    """Issue 26: a Keras model with unseeded Dropout, GaussianNoise and keras.random.normal, stopped after
    epoch 1 and resumed by BackupAndRestore, ends with the weights of the run that was not stopped,
    bitwise: the replicas' seeds come from their generators, whose state (seed, steps) the backup holds."""
    x, y = _data(6)

    def model() -> mr.Model:
        keras.backend.clear_session()  # layer names restart, as in the new process of a real resume
        keras.utils.set_random_seed(0)
        inp = keras.Input((FEATURES,))
        h = keras.layers.GaussianNoise(0.2)(_SlowNoise()(keras.layers.Dense(8)(inp)))
        out = keras.layers.Dense(CLASSES, activation="softmax")(keras.layers.Dropout(0.3)(h))
        with mr.MirroredStrategy(devices=["cpu:0", "cpu:1"]).scope():
            ours = mr.Model(keras.Model(inp, out))
            ours.compile(optimizer=keras.optimizers.Adam(0.01), loss="sparse_categorical_crossentropy")
        return ours

    class Stop(mr.callbacks.Callback):
        def on_epoch_end(self, epoch, logs=None):
            if epoch == 1:
                raise KeyboardInterrupt

    _SlowNoise.slow = False
    straight = model()
    straight.fit(x, y, batch_size=GLOBAL, epochs=3, shuffle=False, verbose=0)
    stopped = model()
    with pytest.raises(KeyboardInterrupt):
        stopped.fit(x, y, batch_size=GLOBAL, epochs=3, shuffle=False, verbose=0,
                    callbacks=[mr.callbacks.BackupAndRestore(str(tmp_path)), Stop()])
    _SlowNoise.slow, _SlowNoise.calls = True, 0  # and the resumed run's threads draw in another order
    resumed = model()
    resumed.fit(x, y, batch_size=GLOBAL, epochs=3, shuffle=False, verbose=0,
                callbacks=[mr.callbacks.BackupAndRestore(str(tmp_path))])
    _SlowNoise.slow = False
    for a, b in zip(straight.get_weights(), resumed.get_weights()):
        np.testing.assert_array_equal(b, a)
