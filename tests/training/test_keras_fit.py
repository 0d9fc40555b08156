"""Keras's own model.fit / evaluate / predict on a model built or compiled in a MirroredStrategy's scope
(issue 34): each global batch split over the replicas, the model's own steps on every replica's copy,
against Keras's own fit on one device with the same initial weights and batches.

Tolerance: 1e-5 on weights and reported metrics (float32 sums regrouped over the replicas' parts:
measured 3e-8 to 2e-7 on these models); the replicas bitwise equal (check_in_sync)."""
from __future__ import annotations

import os

os.environ.setdefault("KERAS_BACKEND", "torch")  # before keras is imported (it reads it once)

import subprocess
import sys
import textwrap
import warnings

import numpy as np
import pytest
import torch

keras = pytest.importorskip("keras")
if keras.backend.backend() != "torch":
    pytest.skip("keras was imported with another backend than torch", allow_module_level=True)

import mirrored as mr  # noqa: E402
from _replicas import strategy_of  # tests/_replicas.py

ATOL = 1e-5
SEEN: list[int] = []  # the batch sizes the probe layer saw (a module global: shared by every copy)


class Probe(keras.layers.Layer):
    """Records the size of every batch it is called on, in training or not."""

    def call(self, x):
        if isinstance(x, torch.Tensor) and x.device.type != "meta":  # (not the build's symbolic call)
            SEEN.append(int(x.shape[0]))
        return x


def digits(rows: int = 200) -> tuple[np.ndarray, np.ndarray]:
    ds = mr.datasets.load("digits", split="train", as_supervised=True)
    pairs = [(x.numpy(), y.numpy()) for x, y in ds.take(rows)]
    images, labels = map(np.stack, zip(*pairs))
    return images.astype("float32") / 255.0, labels


def cnn(seed: int = 0) -> keras.Model:
    """The mission's program's model at 8x8: Conv2D, MaxPooling2D, Flatten, Dense, Dense."""
    keras.utils.set_random_seed(seed)
    return keras.Sequential([
        keras.Input((8, 8, 1)), Probe(),
        keras.layers.Conv2D(8, 3, activation="relu"),
        keras.layers.MaxPooling2D(),
        keras.layers.Flatten(),
        keras.layers.Dense(16, activation="relu"),
        keras.layers.Dense(10, activation="softmax"),
    ])


def assert_same(ref: keras.Model, ours: keras.Model, h_ref=None, h_ours=None, strategy=None) -> None:
    if h_ref is not None:
        assert set(h_ours.history) == set(h_ref.history)
        for key, values in h_ref.history.items():
            np.testing.assert_allclose(h_ours.history[key], values, atol=ATOL, err_msg=key)
    for v, a, b in zip(ref.weights, ref.get_weights(), ours.get_weights()):
        np.testing.assert_allclose(b, a, atol=ATOL, err_msg=v.path)
    if strategy is not None:
        strategy.check_in_sync(ours)


def compiled_in(strategy, build, **compile_kwargs) -> keras.Model:
    with strategy.scope():
        model = build()
        model.compile(**compile_kwargs)
    return model


@pytest.mark.parametrize("replicas,parts", [(2, [32, 32]), (3, [22, 22, 20])])
def test_mission_program_trains_on_every_replica_as_one_device(replicas, parts):
    """Built and compiled in the scope, then Keras's own fit(x, y, batch_size=64): each replica's copy
    sees its part of every global batch (the probe), and History, weights, evaluate and predict (row
    order, 101 rows: a short last batch) equal Keras's fit on one device; no warning."""
    x, y = digits(192)
    kwargs = dict(optimizer=keras.optimizers.SGD(learning_rate=0.05, momentum=0.9),
                  loss="sparse_categorical_crossentropy", metrics=["accuracy"])
    ref = cnn()
    ref.compile(**kwargs)
    h_ref = ref.fit(x, y, batch_size=64, epochs=2, shuffle=False, verbose=0)
    strategy = strategy_of(replicas)
    ours = compiled_in(strategy, cnn, **{**kwargs, "optimizer": keras.optimizers.SGD(learning_rate=0.05,
                                                                                      momentum=0.9)})
    SEEN.clear()
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        h_ours = ours.fit(x, y, batch_size=64, epochs=2, shuffle=False, verbose=0)
    assert sorted(SEEN) == sorted(parts * 6)
    assert_same(ref, ours, h_ref, h_ours, strategy)
    np.testing.assert_allclose(ours.evaluate(x, y, batch_size=64, verbose=0),
                               ref.evaluate(x, y, batch_size=64, verbose=0), atol=ATOL)
    np.testing.assert_allclose(ours.predict(x[:101], batch_size=64, verbose=0),
                               ref.predict(x[:101], batch_size=64, verbose=0), atol=ATOL)


def mlp(seed: int = 0, batchnorm: bool = False, dropout: float = 0.0) -> keras.Model:
    keras.utils.set_random_seed(seed)
    layers = [keras.Input((64,)), keras.layers.Dense(32, activation="relu")]
    if batchnorm:
        layers.append(keras.layers.BatchNormalization())
    if dropout:
        layers.append(keras.layers.Dropout(dropout))
    return keras.Sequential(layers + [keras.layers.Dense(10, activation="softmax")])


def flat_digits(rows: int = 200) -> tuple[np.ndarray, np.ndarray]:
    x, y = digits(rows)
    return x.reshape(len(x), 64), y


OPTIMIZERS = {
    "adam": lambda: keras.optimizers.Adam(learning_rate=0.01),
    "sgd_momentum_nesterov": lambda: keras.optimizers.SGD(learning_rate=0.05, momentum=0.9, nesterov=True),
    "schedule": lambda: keras.optimizers.SGD(learning_rate=keras.optimizers.schedules.ExponentialDecay(
        0.1, decay_steps=2, decay_rate=0.5), momentum=0.5),
    "global_clipnorm": lambda: keras.optimizers.SGD(learning_rate=0.5, global_clipnorm=0.1),
    "adamw_accumulated": lambda: keras.optimizers.AdamW(learning_rate=0.01, weight_decay=0.1,
                                                        gradient_accumulation_steps=2),
}


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_optimizers_give_one_devices_update(name):
    """Keras's optimizers apply the gradients all-reduced before their own clipping, schedule and
    accumulation, as one device applies the whole batch's; 3 replicas, 100 rows in batches of 24 (the
    last batch of 4 leaves a replica padded)."""
    x, y = flat_digits(100)
    ref = mlp()
    ref.compile(optimizer=OPTIMIZERS[name](), loss="sparse_categorical_crossentropy", metrics=["accuracy"])
    h_ref = ref.fit(x, y, batch_size=24, epochs=2, shuffle=False, verbose=0)
    strategy = strategy_of(3)
    ours = compiled_in(strategy, mlp, optimizer=OPTIMIZERS[name](), loss="sparse_categorical_crossentropy",
                       metrics=["accuracy"])
    h_ours = ours.fit(x, y, batch_size=24, epochs=2, shuffle=False, verbose=0)
    assert_same(ref, ours, h_ref, h_ours, strategy)
    assert int(ours.optimizer.iterations) == int(ref.optimizer.iterations)


def test_a_compiled_sum_loss_sums_the_replicas_gradients():
    """reduction="sum": the parts' sums add up to the batch's, so the replicas' gradients are summed, not
    averaged, and the weights equal one device's (70 rows in batches of 32 on 3 replicas: uneven and
    padded parts). The loss tracker weighs each replica's sum by its rows, as tf.keras's does."""
    x, y = flat_digits(70)

    def loss():
        return keras.losses.SparseCategoricalCrossentropy(reduction="sum")
    ref = mlp()
    ref.compile(optimizer=keras.optimizers.SGD(learning_rate=0.01), loss=loss())
    ref.fit(x, y, batch_size=32, epochs=2, shuffle=False, verbose=0)
    strategy = strategy_of(3)
    ours = compiled_in(strategy, mlp, optimizer=keras.optimizers.SGD(learning_rate=0.01), loss=loss())
    ours.fit(x, y, batch_size=32, epochs=2, shuffle=False, verbose=0)
    assert_same(ref, ours, strategy=strategy)


def test_ema_finalized_then_a_second_fit_stays_in_sync():
    """use_ema: Keras writes the averages into replica 0's weights after fit; the next step carries
    them to the other copies, and a second fit equals one device's second fit."""
    x, y = flat_digits(96)

    def opt():
        return keras.optimizers.SGD(learning_rate=0.1, use_ema=True, ema_momentum=0.5)
    ref = mlp()
    ref.compile(optimizer=opt(), loss="sparse_categorical_crossentropy")
    strategy = strategy_of(2)
    ours = compiled_in(strategy, mlp, optimizer=opt(), loss="sparse_categorical_crossentropy")
    for _ in range(2):
        h_ref = ref.fit(x, y, batch_size=32, shuffle=False, verbose=0)
        h_ours = ours.fit(x, y, batch_size=32, shuffle=False, verbose=0)
        assert_same(ref, ours, h_ref, h_ours)
    strategy.check_in_sync(ours)


def test_global_batchnorm_and_padded_replicas_equal_one_device():
    """convert_sync_batchnorm: the statistics of the global batch, so the moving statistics and
    weights equal one device's; 65 rows in batches of 64 on 3 replicas, so the last batch has one row
    and two replicas run padded (a row of the batch, counted nowhere)."""
    x, y = flat_digits(65)
    ref = mlp(batchnorm=True)
    ref.compile(optimizer=keras.optimizers.SGD(learning_rate=0.1), loss="sparse_categorical_crossentropy",
                metrics=["accuracy"])
    h_ref = ref.fit(x, y, batch_size=64, epochs=2, shuffle=False, verbose=0)
    strategy = strategy_of(3)
    ours = compiled_in(strategy, lambda: mr.layers.convert_sync_batchnorm(mlp(batchnorm=True)),
                       optimizer=keras.optimizers.SGD(learning_rate=0.1), loss="sparse_categorical_crossentropy",
                       metrics=["accuracy"])
    h_ours = ours.fit(x, y, batch_size=64, epochs=2, shuffle=False, verbose=0)
    assert_same(ref, ours, h_ref, h_ours, strategy)


def test_per_replica_batchnorm_moving_mean_is_the_row_weighted_mean():
    """Without conversion each replica normalizes with its part's statistics (as tf.keras under
    MirroredStrategy), and the moving mean after one step is the replicas' row-weighted mean: what one
    device's would be, since the parts' means weighted by rows are the batch's mean."""
    x, y = flat_digits(10)
    ref = mlp(batchnorm=True)
    ref.compile(optimizer=keras.optimizers.SGD(learning_rate=0.0), loss="sparse_categorical_crossentropy")
    ref.fit(x, y, batch_size=10, shuffle=False, verbose=0)
    strategy = strategy_of(3)
    ours = compiled_in(strategy, lambda: mlp(batchnorm=True), optimizer=keras.optimizers.SGD(learning_rate=0.0),
                       loss="sparse_categorical_crossentropy")
    ours.fit(x, y, batch_size=10, shuffle=False, verbose=0)  # parts of 4, 4 and 2 rows
    bn = next(i for i, layer in enumerate(ref.layers) if isinstance(layer, keras.layers.BatchNormalization))
    np.testing.assert_allclose(ours.layers[bn].moving_mean.numpy(), ref.layers[bn].moving_mean.numpy(), atol=1e-6)
    strategy.check_in_sync(ours)


def test_sample_and_class_weights_and_validation_equal_one_device():
    """sample_weight, class_weight, validation_split and validation_data with validation_freq stay
    Keras's own (the weights are split with the rows), on 2 replicas."""
    x, y = flat_digits(120)
    sw = np.linspace(0.5, 1.5, len(x)).astype("float32")
    runs = {}
    for replicas in (1, 2):
        strategy = strategy_of(replicas)
        model = compiled_in(strategy, mlp, optimizer=keras.optimizers.SGD(learning_rate=0.1),
                            loss="sparse_categorical_crossentropy", metrics=["accuracy"],
                            weighted_metrics=["accuracy"])
        h1 = model.fit(x, y, sample_weight=sw, batch_size=32, epochs=2, validation_split=0.25, shuffle=False,
                       verbose=0)
        h2 = model.fit(x, y, class_weight={c: 1.0 + c / 10 for c in range(10)}, batch_size=32, epochs=2,
                       validation_data=(x[:40], y[:40]), validation_freq=2, shuffle=False, verbose=0)
        runs[replicas] = (model, h1, h2, strategy)
    (ref, r1, r2, _), (ours, o1, o2, strategy) = runs[1], runs[2]
    assert "val_loss" in o1.history and len(o2.history["val_loss"]) == 1
    assert_same(ref, ours, r1, o1)
    assert_same(ref, ours, r2, o2, strategy)


def test_callbacks_checkpoint_early_stopping_schedules_and_csv(tmp_path):
    """ModelCheckpoint's .keras file loads to replica 0's weights; EarlyStopping restores the best
    weights, LearningRateScheduler and ReduceLROnPlateau set the rate, CSVLogger writes its rows;
    everything as on one device."""
    x, y = flat_digits(96)

    def callbacks(where):
        return [keras.callbacks.ModelCheckpoint(str(where / "best.keras"), monitor="loss", save_best_only=True),
                keras.callbacks.EarlyStopping(monitor="loss", patience=1, restore_best_weights=True),
                keras.callbacks.LearningRateScheduler(lambda epoch, lr: lr * 0.5),
                keras.callbacks.ReduceLROnPlateau(monitor="loss", patience=1),
                keras.callbacks.CSVLogger(str(where / "log.csv"))]
    runs = {}
    for replicas in (1, 2):
        where = tmp_path / str(replicas)
        where.mkdir()
        strategy = strategy_of(replicas)
        model = compiled_in(strategy, mlp, optimizer=keras.optimizers.SGD(learning_rate=0.5),
                            loss="sparse_categorical_crossentropy")
        history = model.fit(x, y, batch_size=32, epochs=4, shuffle=False, verbose=0, callbacks=callbacks(where))
        runs[replicas] = (model, history, where, strategy)
    (ref, h_ref, ref_dir, _), (ours, h_ours, our_dir, strategy) = runs[1], runs[2]
    assert_same(ref, ours, h_ref, h_ours, strategy)
    assert (our_dir / "log.csv").read_text().count("\n") == (ref_dir / "log.csv").read_text().count("\n") == 5
    loaded = keras.models.load_model(our_dir / "best.keras", compile=False)
    best = keras.models.load_model(ref_dir / "best.keras", compile=False)
    for a, b in zip(loaded.get_weights(), best.get_weights()):
        np.testing.assert_allclose(a, b, atol=ATOL)


BACKUP_PROGRAM = textwrap.dedent("""
    import os, signal, sys, json
    os.environ["KERAS_BACKEND"] = "torch"
    import keras, numpy as np
    import mirrored as mr
    replicas, backup, kill_at, save_freq, out = int(sys.argv[1]), sys.argv[2], int(sys.argv[3]), sys.argv[4], sys.argv[5]
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(96, 8)).astype("float32"), rng.integers(0, 3, 96)
    strategy = mr.MirroredStrategy(devices=[f"cpu:{i}" for i in range(replicas)])
    with strategy.scope():
        keras.utils.set_random_seed(0)
        model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="relu"),
                                  keras.layers.Dense(3, activation="softmax")])
        model.compile(optimizer=keras.optimizers.Adam(0.01), loss="sparse_categorical_crossentropy")

    class Kill(keras.callbacks.Callback):
        seen = 0
        def on_train_batch_end(self, batch, logs=None):
            Kill.seen += 1
            if Kill.seen == kill_at:
                os.kill(os.getpid(), signal.SIGKILL)
    freq = "epoch" if save_freq == "epoch" else int(save_freq)
    history = model.fit(x, y, batch_size=16, epochs=3, shuffle=False, verbose=0,
                        callbacks=[keras.callbacks.BackupAndRestore(backup, save_freq=freq), Kill()])
    json.dump({"weights": [w.tolist() for w in model.get_weights()], "history": history.history}, open(out, "w"))
""")


def backup_run(tmp_path, replicas, backup, kill_at, save_freq, name):
    script = tmp_path / "backup_program.py"
    script.write_text(BACKUP_PROGRAM)
    out = tmp_path / f"{name}.json"
    env = {**os.environ, "KERAS_BACKEND": "torch"}
    done = subprocess.run([sys.executable, str(script), str(replicas), str(backup), str(kill_at), str(save_freq),
                           str(out)], capture_output=True, text=True, timeout=240, env=env)
    return done, out


@pytest.mark.timeout(600)
def test_backup_and_restore_resumes_a_sigkill_as_keras_does_on_one_device(tmp_path):
    """Keras 3's BackupAndRestore restores the weights and the epoch, never the batch: after a SIGKILL
    mid-epoch the epoch starts again from its first batch on the restored weights (one device does the
    same). So the resumed run on 2 replicas equals one device under the same kill and resume, two
    resumes from the same backup are bitwise equal, and with save_freq="epoch" a kill between epochs
    equals the uninterrupted run."""
    import json
    import shutil

    results = {}
    for replicas in (1, 2):
        backup = tmp_path / f"backup{replicas}"
        done, _ = backup_run(tmp_path, replicas, backup, 9, 2, f"killed{replicas}")  # batch 3 of epoch 2
        assert done.returncode == -9, done.stderr[-2000:]
        if replicas == 2:
            shutil.copytree(backup, tmp_path / "backup_again")
        done, out = backup_run(tmp_path, replicas, backup, 0, 2, f"resumed{replicas}")
        assert done.returncode == 0, done.stderr[-2000:]
        results[replicas] = json.loads(out.read_text())
    done, out = backup_run(tmp_path, 2, tmp_path / "backup_again", 0, 2, "resumed_again")
    assert done.returncode == 0, done.stderr[-2000:]
    again = json.loads(out.read_text())
    assert again == results[2]  # bitwise: the same floats
    for a, b in zip(results[2]["weights"], results[1]["weights"]):
        np.testing.assert_allclose(np.array(a), np.array(b), atol=ATOL)
    np.testing.assert_allclose(results[2]["history"]["loss"], results[1]["history"]["loss"], atol=ATOL)
    # Killed at the end of epoch 1 with save_freq="epoch": the resumed run is the uninterrupted one.
    backup = tmp_path / "backup_epoch"
    done, _ = backup_run(tmp_path, 2, backup, 7, "epoch", "killed_epoch")  # epoch 2's first batch ends
    assert done.returncode == -9, done.stderr[-2000:]
    done, out = backup_run(tmp_path, 2, backup, 0, "epoch", "resumed_epoch")
    assert done.returncode == 0, done.stderr[-2000:]
    done, whole = backup_run(tmp_path, 2, tmp_path / "backup_whole", 0, "epoch", "whole")
    assert done.returncode == 0, done.stderr[-2000:]
    resumed, straight = json.loads(out.read_text()), json.loads(whole.read_text())
    for a, b in zip(resumed["weights"], straight["weights"]):
        np.testing.assert_allclose(np.array(a), np.array(b), atol=ATOL)


def test_recompile_rebuilds_the_copies_and_batch_methods_and_mr_data():
    """A recompile with a new optimizer makes the copies again from the model; train_on_batch,
    test_on_batch and predict_on_batch run on the replicas (predict leaves the metrics as they were);
    an mr.data.Dataset is Keras's data, as x and as validation_data; a model created in the scope and
    compiled outside it is distributed too."""
    x, y = flat_digits(64)
    ds = mr.data.Dataset.from_tensor_slices((x, y)).batch(32)
    models = {}
    for replicas in (1, 2):
        strategy = strategy_of(replicas)
        with strategy.scope():
            model = mlp()
        model.compile(optimizer=keras.optimizers.SGD(learning_rate=0.1), loss="sparse_categorical_crossentropy",
                      metrics=["accuracy"])
        h1 = model.fit(ds, epochs=1, validation_data=ds, verbose=0)
        model.compile(optimizer=keras.optimizers.Adam(learning_rate=0.01), loss="sparse_categorical_crossentropy")
        h2 = model.fit(x, y, batch_size=32, epochs=1, shuffle=False, verbose=0)
        logs = model.train_on_batch(x[:10], y[:10], return_dict=True)
        test = model.test_on_batch(x[:10], y[:10], return_dict=True)
        before = {k: float(v) for k, v in model.get_metrics_result().items()}
        out = model.predict_on_batch(x[:5])
        assert {k: float(v) for k, v in model.get_metrics_result().items()} == before  # predict leaves them
        models[replicas] = (model, h1, h2, logs, test, out, strategy)
    ref, ours = models[1], models[2]
    assert_same(ref[0], ours[0], ref[1], ours[1])
    assert_same(ref[0], ours[0], ref[2], ours[2], ours[6])
    for a, b in zip(ref[3:6], ours[3:6]):
        if isinstance(a, dict):
            assert set(a) == set(b)
            np.testing.assert_allclose([b[k] for k in a], [a[k] for k in a], atol=ATOL)
        else:
            np.testing.assert_allclose(b, a, atol=ATOL)


def test_a_model_outside_any_scope_and_one_replica_are_keras_own():
    """A model neither created nor compiled in a scope of several replicas runs Keras's own step
    functions, untouched."""
    from keras.src.backend.torch.trainer import TorchTrainer

    x, y = flat_digits(32)
    for strategy in (None, strategy_of(1)):
        with strategy.scope() if strategy is not None else warnings.catch_warnings():
            model = mlp()
            model.compile(optimizer="sgd", loss="sparse_categorical_crossentropy")
        model.fit(x, y, batch_size=16, verbose=0)
        assert not hasattr(model.train_function, "_mirrored")
        assert TorchTrainer.make_train_function.__wrapped__ is not None


@pytest.mark.parametrize("case,words", [
    ("jit", "jit_compile=True"),
    ("stateful", "stateful=True"),
    ("distribution", "keras.distribution"),
    ("other_scope", "Use one strategy for a model"),
    ("metric", "aggregation='mean'"),
    ("local_update", "outside the optimizer's apply"),
    ("mirrored", "mirrored already"),
])
def test_what_cannot_be_distributed_is_refused_at_the_first_step(case, words):
    """Each case raises one error naming it and the fix, before (or at) the first step; none trains
    on one device silently."""
    x, y = flat_digits(16)
    strategy = strategy_of(2)
    compile_kwargs = dict(optimizer="sgd", loss="sparse_categorical_crossentropy")
    fit = dict(batch_size=8, verbose=0)

    class MeanAggregated(keras.metrics.Metric):
        def __init__(self):
            super().__init__(name="odd")
            self.v = self.add_variable(shape=(), initializer="zeros", aggregation="mean", name="v")

        def update_state(self, y_true, y_pred, sample_weight=None):
            self.v.assign_add(1.0)

        def result(self):
            return self.v.value

    class LocalUpdate(keras.Sequential):
        def train_step(self, data):
            xb, yb = data
            self.zero_grad()
            loss = self.compute_loss(y=yb, y_pred=self(xb, training=True))
            loss.backward()
            with torch.no_grad():
                for v in self.trainable_weights:
                    v.assign(v - 0.1 * v.value.grad)  # this replica's gradient alone
            return {"loss": loss}

    if case == "jit":
        compile_kwargs["jit_compile"] = True
    if case == "metric":
        compile_kwargs["metrics"] = [MeanAggregated()]
    with strategy.scope():
        if case == "stateful":
            model = keras.Sequential([keras.Input((4, 16), batch_size=8), keras.layers.SimpleRNN(4, stateful=True),
                                      keras.layers.Dense(10, activation="softmax")])
            x = x.reshape(16, 4, 16)
        elif case == "local_update":
            model = LocalUpdate([keras.Input((64,)), keras.layers.Dense(10, activation="softmax")])
        else:
            model = mlp()
        if case == "mirrored":
            wrapper = mr.Model(model)  # noqa: F841 - (its mirror lives while it does)
        model.compile(**compile_kwargs)
    if case == "other_scope":
        with strategy_of(2).scope(), pytest.raises(ValueError, match=words):
            model.fit(x, y, **fit)
        return
    if case == "distribution":
        keras.distribution.set_distribution(keras.distribution.DataParallel(devices=["cpu:0"]))
    try:
        with pytest.raises(ValueError, match=words):
            model.fit(x, y, **fit)
    finally:
        if case == "distribution":
            keras.distribution.set_distribution(None)


def test_keras_own_fit_distributes_in_a_program_that_never_touched_mr_model():
    """Issue 23 then 34: a program that built and compiled a Keras model in our scope and called Keras's
    own fit trained on one device (first silently, then with a warning); now it trains on both
    replicas, with no warning. A fresh process, as a user's."""
    probe = ("import os, warnings; os.environ['KERAS_BACKEND'] = 'torch'\n"
             "import keras, numpy as np, mirrored as mr\n"
             "seen = []\n"
             "class Probe(keras.layers.Layer):\n"
             "    def call(self, x):\n"
             "        if x.device.type != 'meta': seen.append(int(x.shape[0]))\n"
             "        return x\n"
             "with mr.MirroredStrategy(devices=['cpu:0', 'cpu:1']).scope():\n"
             "    net = keras.Sequential([keras.Input((3,)), Probe(), keras.layers.Dense(2)])\n"
             "    net.compile(optimizer='sgd', loss='mse')\n"
             "with warnings.catch_warnings(record=True) as caught:\n"
             "    warnings.simplefilter('always')\n"
             "    net.fit(np.zeros((8, 3), 'float32'), np.zeros((8, 2), 'float32'), batch_size=8, verbose=0)\n"
             "print(sorted(seen), [str(w.message) for w in caught if 'one device' in str(w.message)])\n")
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "KERAS_BACKEND": "torch"})
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().splitlines()[-1] == "[4, 4] []"
