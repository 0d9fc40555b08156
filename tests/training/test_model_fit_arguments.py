"""Keras 3's fit / evaluate arguments on mr.Model (issue 38): class_weight, validation_split,
validation_batch_size, train_on_batch / test_on_batch / predict_on_batch, Keras's parameter names of
save / save_weights / load_weights, and metrics with one value per class - each on 1, 2 and 3
replicas against plain PyTorch on one device, and against Keras 3's own fit where the semantics are
Keras's (class_weight, validation_split with the callbacks that watch its val_* keys).

Tolerances: the replicas' partial gradient sums add in another order than one device's, a few float32
ulps per step; 1e-5 on weights and logs holds with a wide margin.
"""
from __future__ import annotations

import csv
import os

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import mirrored as mr
from _replicas import strategy_of  # tests/_replicas.py

ROWS, BATCH, LR = 17, 8, 0.1  # batches of 8, 8 and 1: the last leaves every other replica's part empty
ATOL = 1e-5
CLASS_WEIGHT = {0: 1.0, 1: 3.0, 2: 0.5}


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3))


def _data(rows: int = ROWS, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, 4, generator=g), torch.randint(0, 3, (rows,), generator=g)


def _model(replicas: int, **compile_kwargs) -> mr.Model:
    with strategy_of(replicas).scope():
        model = mr.Model(_net())
        compile_kwargs.setdefault("loss", "sparse_categorical_crossentropy")
        model.compile(optimizer=mr.optimizers.SGD(learning_rate=LR), **compile_kwargs)
    return model


def _assert_weights(model: mr.Model, ref: nn.Module) -> None:
    for copy in model.replicas:
        for got, want in zip(copy.parameters(), ref.parameters()):
            torch.testing.assert_close(got, want, rtol=0, atol=ATOL)
    model.check_in_sync()


def _train(ref: nn.Module, x, y, weights=None, epochs: int = 2, loss_weight: float = 1.0) -> dict[str, list[float]]:
    """Plain torch, one device, whole batches in order: Keras's mean of weighted losses over the batch
    (times loss_weight); the epoch's loss (weighted by rows), accuracy, and accuracy weighted by `weights`."""
    opt = torch.optim.SGD(ref.parameters(), lr=LR)
    out: dict[str, list[float]] = {"loss": [], "accuracy": [], "weighted_accuracy": []}
    for _ in range(epochs):
        losses, hits, wsum = [], [], []
        for i in range(0, len(x), BATCH):
            xb, yb = x[i:i + BATCH], y[i:i + BATCH]
            wb = weights[i:i + BATCH] if weights is not None else torch.ones(len(xb))
            logits = ref(xb)
            loss = loss_weight * (F.cross_entropy(logits, yb, reduction="none") * wb).sum() / len(xb)
            losses.append((float(loss.detach()) * len(xb), len(xb)))
            hit = (logits.argmax(-1) == yb).double()
            hits.append(hit)
            wsum.append(((hit * wb).sum(), wb.sum()))
            opt.zero_grad()
            loss.backward()
            opt.step()
        out["loss"].append(sum(v for v, _ in losses) / sum(n for _, n in losses))
        out["accuracy"].append(float(torch.cat(hits).mean()))
        out["weighted_accuracy"].append(float(sum(h for h, _ in wsum) / sum(w for _, w in wsum)))
    return out


def _assert_history(history, want: dict) -> None:
    assert sorted(history.history) == sorted(want)
    for key, values in want.items():
        np.testing.assert_allclose(history.history[key], values, rtol=0, atol=ATOL, err_msg=key)


@pytest.mark.parametrize("replicas", [1, 2, 3])
def test_loss_weights_and_weighted_metrics_of_one_output(replicas):
    """compile(loss_weights=0.5) scales the one loss (and its gradient); weighted_metrics take the sample
    weights and metrics do not (Keras 3's rule), logged as "accuracy" and "weighted_accuracy"."""
    x, y = _data()
    weights = torch.rand(ROWS, generator=torch.Generator().manual_seed(3)) + 0.5
    ref = _net()
    want = _train(ref, x, y, weights, loss_weight=0.5)
    model = _model(replicas, loss_weights=0.5, metrics=["accuracy"], weighted_metrics=["accuracy"])
    history = model.fit(x.numpy(), y.numpy(), sample_weight=weights.numpy(), batch_size=BATCH, epochs=2,
                        shuffle=False, verbose=0)
    _assert_weights(model, ref)
    _assert_history(history, want)


def test_run_eagerly_turns_jit_compile_off():
    model = _model(1, run_eagerly=True, jit_compile=True)
    assert not model.jit_compile


# ---- class_weight ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("replicas", [1, 2, 3])
@pytest.mark.parametrize("source", ["arrays", "dataset"])
def test_class_weight_weighs_each_example_by_its_label_as_one_device(replicas, source):
    """class_weight turns into per-example weights of the loss and of weighted_metrics (not of metrics),
    from each label (a class not listed weighs 1), for arrays and for a dataset's batches alike."""
    x, y = _data()
    class_weight = {0: 1.0, 1: 3.0}  # class 2 is not listed
    weights = torch.tensor([class_weight.get(int(c), 1.0) for c in y])
    ref = _net()
    want = _train(ref, x, y, weights)
    model = _model(replicas, metrics=["accuracy"], weighted_metrics=["accuracy"])
    if source == "arrays":
        history = model.fit(x.numpy(), y.numpy(), batch_size=BATCH, epochs=2, shuffle=False, verbose=0,
                            class_weight=class_weight)
    else:
        history = model.fit(mr.data.Dataset.from_tensor_slices((x, y)).batch(BATCH), epochs=2, verbose=0,
                            class_weight=class_weight)
    _assert_weights(model, ref)
    _assert_history(history, want)


def _keras():
    os.environ.setdefault("KERAS_BACKEND", "torch")
    keras = pytest.importorskip("keras")
    if keras.backend.backend() != "torch":
        pytest.skip("keras was imported with another backend than torch")
    return keras


def _keras_net(features: int = 4, seed: int = 0):
    keras = _keras()
    keras.utils.set_random_seed(seed)
    inp = keras.Input((features,))
    hidden = keras.layers.Dense(8, activation="tanh")(inp)
    return keras.Model(inp, keras.layers.Dense(3, activation="softmax")(hidden))


def _against_keras(replicas: int, compile_kwargs: dict, fit_kwargs: dict, make=_keras_net, x=None, y=None):
    """Keras's own fit of a Keras model on one device, and mr.Model's fit of the same model on `replicas`."""
    keras = _keras()
    ref = make()
    ref.compile(optimizer=keras.optimizers.SGD(LR), **compile_kwargs())
    want = ref.fit(x, y, verbose=0, shuffle=False, **fit_kwargs())
    with strategy_of(replicas).scope():
        model = mr.Model(make())
        model.compile(optimizer=keras.optimizers.SGD(LR), **compile_kwargs())
    got = model.fit(x, y, verbose=0, shuffle=False, **fit_kwargs())
    return ref, want, model, got


def _assert_same_as_keras(ref, want, model, got) -> None:
    assert sorted(got.history) == sorted(want.history)
    for key, values in want.history.items():
        np.testing.assert_allclose(got.history[key], values, rtol=0, atol=ATOL, err_msg=key)
    for a, b in zip(ref.get_weights(), model.module.get_weights()):
        np.testing.assert_allclose(b, a, rtol=0, atol=ATOL)


@pytest.mark.parametrize("labels", ["sparse", "one_hot"])
def test_class_weight_gives_keras_own_fit(labels):
    """The same program as Keras 3.15's fit with class_weight: integer labels, and one-hot labels (weighed
    by their argmax, Keras's rule), on 2 replicas against Keras on one device."""
    x, y = _data()
    y = y.numpy() if labels == "sparse" else np.eye(3, dtype="float32")[y.numpy()]
    loss = "sparse_categorical_crossentropy" if labels == "sparse" else "categorical_crossentropy"
    _assert_same_as_keras(*_against_keras(
        2, lambda: dict(loss=loss, metrics=["accuracy"], weighted_metrics=["accuracy"]),
        lambda: dict(batch_size=BATCH, epochs=2, class_weight=CLASS_WEIGHT), x=x.numpy(), y=y))


def test_class_weight_misuse_is_refused_in_one_line():
    x, y = _data()
    model = _model(2)
    with pytest.raises(ValueError, match="class_weight and sample_weight were both given"):
        model.fit(x.numpy(), y.numpy(), class_weight=CLASS_WEIGHT, sample_weight=np.ones(ROWS), verbose=0)
    with pytest.raises(ValueError, match="the model has several outputs, and class_weight is only for a single"):
        model.fit(x.numpy(), {"a": y.numpy(), "b": y.numpy()}, class_weight=CLASS_WEIGHT, verbose=0)
    with pytest.raises(ValueError, match="give a dict from class ids"):
        model.fit(x.numpy(), y.numpy(), class_weight=[1.0, 2.0], verbose=0)
    weighted = mr.data.Dataset.from_tensor_slices((x, y, torch.ones(ROWS))).batch(BATCH)
    with pytest.raises(ValueError, match="the dataset's batches hold sample weights too"):
        model.fit(weighted, class_weight=CLASS_WEIGHT, verbose=0)


# ---- validation_split, validation_batch_size ------------------------------------------------------------
@pytest.mark.parametrize("replicas", [1, 2, 3])
def test_validation_split_trains_on_the_first_rows_and_validates_on_the_last(replicas):
    """validation_split=0.25 of 23 rows: the first 17 train (batches 8, 8, 1), the last 6 validate (Keras's
    floor rule), taken before shuffling: with shuffle=False the weights equal one device trained on the
    first 17; with shuffle=True val_loss is the trained model's loss on the last 6."""
    x, y = _data(23)
    ref = _net()
    want = _train(ref, x[:17], y[:17], epochs=1)
    model = _model(replicas)
    history = model.fit(x.numpy(), y.numpy(), batch_size=BATCH, epochs=1, shuffle=False, verbose=0,
                        validation_split=0.25)
    _assert_weights(model, ref)
    with torch.no_grad():
        val = float(F.cross_entropy(ref(x[17:]), y[17:]))
    np.testing.assert_allclose(history.history["loss"], want["loss"], rtol=0, atol=ATOL)
    np.testing.assert_allclose(history.history["val_loss"], [val], rtol=0, atol=ATOL)
    shuffled = _model(replicas)
    history = shuffled.fit(x.numpy(), y.numpy(), batch_size=BATCH, epochs=1, verbose=0, validation_split=0.25)
    np.testing.assert_allclose(history.history["val_loss"], [shuffled.evaluate(x[17:].numpy(), y[17:].numpy(),
                                                                               verbose=0)], rtol=0, atol=ATOL)


def test_validation_split_and_the_callbacks_on_its_keys_give_keras_own_fit(tmp_path):
    """The same program as Keras 3.15's: validation_split with EarlyStopping, ReduceLROnPlateau and
    ModelCheckpoint(save_best_only) watching val_loss. mr.Model on 2 replicas stops at Keras's epoch, with
    Keras's learning rates, history and weights; the checkpoint is written at the epochs val_loss improved."""
    keras = _keras()
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(40, 6)).astype("float32"), rng.integers(0, 3, 40)
    keras_cbs = [keras.callbacks.EarlyStopping(monitor="val_loss", patience=3),
                 keras.callbacks.ReduceLROnPlateau(monitor="val_loss", patience=0, factor=0.5)]
    ref = _keras_net(6)
    ref.compile(optimizer=keras.optimizers.SGD(0.5), loss="sparse_categorical_crossentropy", metrics=["accuracy"])
    want = ref.fit(x, y, batch_size=BATCH, epochs=12, verbose=0, shuffle=False, validation_split=0.25,
                   callbacks=keras_cbs)
    assert len(want.history["loss"]) < 12 and min(want.history["learning_rate"]) < 0.5  # (both act)
    saved = []

    class Saves(mr.callbacks.Callback):
        def on_epoch_end(self, epoch, logs=None):
            saved.append(os.path.exists(tmp_path / f"best-{epoch + 1}.safetensors"))

    with strategy_of(2).scope():
        model = mr.Model(_keras_net(6))
        model.compile(optimizer=keras.optimizers.SGD(0.5), loss="sparse_categorical_crossentropy", metrics=["accuracy"])
    got = model.fit(x, y, batch_size=BATCH, epochs=12, verbose=0, shuffle=False, validation_split=0.25, callbacks=[
        mr.callbacks.EarlyStopping(monitor="val_loss", patience=3),
        mr.callbacks.ReduceLROnPlateau(monitor="val_loss", patience=0, factor=0.5),
        mr.callbacks.ModelCheckpoint(str(tmp_path / "best-{epoch}.safetensors"), monitor="val_loss",
                                     save_best_only=True, save_weights_only=True), Saves()])
    _assert_same_as_keras(ref, want, model, got)
    val = want.history["val_loss"]
    assert saved == [v < min(val[:i], default=np.inf) for i, v in enumerate(val)]


@pytest.mark.parametrize("replicas", [1, 2, 3])
def test_validation_batch_size_batches_the_validation_arrays(replicas):
    """validation_batch_size=3 validates the 6 split rows in 2 batches (batch_size's 8 would take one), with
    the same val_loss; a dataset's validation data is refused it, being batched already."""
    x, y = _data(23)
    batches = []

    class Count(mr.callbacks.Callback):
        def on_test_batch_end(self, batch, logs=None):
            batches.append(batch)

    losses = []
    for size in (None, 3):
        batches.clear()
        history = _model(replicas).fit(x.numpy(), y.numpy(), batch_size=BATCH, epochs=1, verbose=0,
                                       validation_split=0.25, validation_batch_size=size, callbacks=[Count()],
                                       shuffle=False)
        losses.append(history.history["val_loss"][0])
        assert len(batches) == (1 if size is None else 2)
    np.testing.assert_allclose(losses[1], losses[0], rtol=0, atol=ATOL)
    val = mr.data.Dataset.from_tensor_slices((x, y)).batch(4)
    with pytest.raises(ValueError, match="validation_data is a dataset, which is batched already"):
        _model(2).fit(x.numpy(), y.numpy(), validation_data=val, validation_batch_size=3, verbose=0)


def test_validation_split_misuse_is_refused_in_one_line():
    x, y = _data()
    ds = mr.data.Dataset.from_tensor_slices((x, y)).batch(BATCH)
    with pytest.raises(ValueError, match=r"validation_split is only for arrays.*Give validation_data="):
        _model(2).fit(ds, validation_split=0.2, verbose=0)
    with pytest.raises(ValueError, match=r"x has 1 row\(s\), too few to split"):
        _model(2).fit(x[:1].numpy(), y[:1].numpy(), validation_split=0.2, verbose=0)
    with pytest.raises(ValueError, match=r"give a fraction in \[0, 1\)"):
        _model(2).fit(x.numpy(), y.numpy(), validation_split=1.5, verbose=0)


# ---- train_on_batch, test_on_batch, predict_on_batch -------------------------------------------------------
@pytest.mark.parametrize("replicas", [1, 2, 3])
def test_on_batch_methods_split_one_global_batch_over_the_replicas(replicas):
    """train_on_batch on 5 rows (3 replicas: 2, 2, 1), then on 1 row (the others empty): one device's
    update each, and the batch's loss and metrics (reset first) before its update, as Keras's; test_on_batch
    and predict_on_batch give the batch's loss and outputs. Lists in Keras's order, dicts by name."""
    x, y = _data()
    ref = _net()
    opt = torch.optim.SGD(ref.parameters(), lr=LR)
    model = _model(replicas, metrics=["accuracy"])
    for rows in (slice(0, 5), slice(5, 6)):
        logits = ref(x[rows])
        loss = F.cross_entropy(logits, y[rows])
        accuracy = float((logits.argmax(-1) == y[rows]).double().mean())
        got = model.train_on_batch(x[rows].numpy(), y[rows].numpy())
        np.testing.assert_allclose(got, [float(loss.detach()), accuracy], rtol=0, atol=ATOL)
        opt.zero_grad()
        loss.backward()
        opt.step()
    _assert_weights(model, ref)
    with torch.no_grad():
        logits = ref(x[6:11])
    logs = model.test_on_batch(x[6:11].numpy(), y[6:11].numpy(), return_dict=True)
    assert list(logs) == ["loss", "accuracy"]
    np.testing.assert_allclose(logs["loss"], float(F.cross_entropy(logits, y[6:11])), rtol=0, atol=ATOL)
    np.testing.assert_allclose(model.predict_on_batch(x[6:11].numpy()), logits.numpy(), rtol=0, atol=ATOL)
    alone = _model(replicas)
    assert isinstance(alone.train_on_batch(x[:4].numpy(), y[:4].numpy()), float)  # the loss alone


def test_on_batch_methods_return_what_keras_returns():
    """Keras 3.15's own train_on_batch / test_on_batch / predict_on_batch on a Keras model, and mr.Model's on
    2 replicas: the same values (list and dict), the same weights after, class_weight included."""
    keras = _keras()
    x, y = _data()
    ref = _keras_net()
    with strategy_of(2).scope():
        model = mr.Model(_keras_net())
    for net in (ref, model):
        net.compile(optimizer=keras.optimizers.SGD(LR), loss="sparse_categorical_crossentropy",
                    metrics=["accuracy"], weighted_metrics=["accuracy"])
    calls = [("train_on_batch", dict(x=x[:5].numpy(), y=y[:5].numpy(), class_weight=CLASS_WEIGHT)),
             ("train_on_batch", dict(x=x[5:12].numpy(), y=y[5:12].numpy(), return_dict=True)),
             ("test_on_batch", dict(x=x[12:].numpy(), y=y[12:].numpy())),
             ("test_on_batch", dict(x=x[12:].numpy(), y=y[12:].numpy(), sample_weight=np.arange(5.0),
                                    return_dict=True))]
    for method, kwargs in calls:
        want, got = getattr(ref, method)(**kwargs), getattr(model, method)(**kwargs)
        if isinstance(want, dict):
            assert list(got) == list(want) or sorted(got) == sorted(want)
            want, got = [want[k] for k in sorted(want)], [got[k] for k in sorted(want)]
        np.testing.assert_allclose(got, want, rtol=0, atol=ATOL, err_msg=method)
    np.testing.assert_allclose(model.predict_on_batch(x.numpy()), ref.predict_on_batch(x.numpy()), rtol=0, atol=ATOL)
    for a, b in zip(ref.get_weights(), model.module.get_weights()):
        np.testing.assert_allclose(b, a, rtol=0, atol=ATOL)


# ---- save / save_weights / load_weights: Keras's parameters ----------------------------------------------
def test_save_and_weights_take_keras_parameter_names(tmp_path):
    """filepath= and overwrite= (False refuses a file that exists, leaving it), save_weights' max_shard_size
    (None only), load_weights' skip_mismatch: tensors of another shape are skipped with a warning naming
    them, the rest load."""
    x, y = _data()
    model = _model(2)
    model.fit(x.numpy(), y.numpy(), batch_size=BATCH, verbose=0)
    path = tmp_path / "w.safetensors"
    model.save_weights(filepath=path)
    before = path.read_bytes()
    with pytest.raises(FileExistsError, match="exists and overwrite=False"):
        model.save_weights(path, overwrite=False)
    with pytest.raises(FileExistsError, match="exists and overwrite=False"):
        model.save(filepath=path, overwrite=False)
    assert path.read_bytes() == before
    model.save(filepath=tmp_path / "m.safetensors", overwrite=False)  # (a new file)
    with pytest.raises(ValueError, match="max_shard_size=1.0, but the weights are written to one safetensors file"):
        model.save_weights(tmp_path / "x.safetensors", max_shard_size=1.0)

    with strategy_of(2).scope():
        other = mr.Model(nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 5)))  # another head
    first_layer = [t.clone() for t in model.module[0].parameters()]
    with pytest.raises(mr.train.CheckpointError, match="shape"):
        other.load_weights(path)
    skipped = (r"skipped 2 tensor\(s\) that do not fit: .*"
               r"'2.weight' \(shape \(3, 8\) in the file, \(5, 8\) in the model\)")
    with pytest.warns(UserWarning, match=skipped):
        other.load_weights(filepath=path, skip_mismatch=True)
    for copy in other.replicas:
        for got, want in zip(copy[0].parameters(), first_layer):
            assert torch.equal(got, want)
        assert copy[2].weight.shape == (5, 8)
    other.check_in_sync()


# ---- metrics with a value per class ----------------------------------------------------------------------
def _one_hot(y: torch.Tensor) -> np.ndarray:
    return np.eye(3, dtype="float32")[y.numpy()]


@pytest.mark.parametrize("replicas", [1, 2, 3])
def test_a_metric_with_a_value_per_class_is_logged_as_an_array(replicas, tmp_path):
    """Regression (issue 38): "f1_score" (F1Score(average=None)) and R2Score(class_aggregation=None) made fit
    fail converting to float. As Keras: History and evaluate hold arrays, equal on any replica count to
    plain torch's per-class F1; the progress bar shows their mean, CSVLogger writes the list, TensorBoard one
    scalar per class; EarlyStopping watching one refuses it naming average="macro"."""
    x, y = _data()
    model = _model(replicas, loss="categorical_crossentropy",
                   metrics=["f1_score", mr.metrics.R2Score(class_aggregation=None)])
    log_dir = tmp_path / "tb"
    history = model.fit(x.numpy(), _one_hot(y), batch_size=BATCH, epochs=1, shuffle=False, verbose=2, callbacks=[
        mr.callbacks.CSVLogger(str(tmp_path / "log.csv")), mr.callbacks.TensorBoard(str(log_dir))])
    ref = _net()
    opt = torch.optim.SGD(ref.parameters(), lr=LR)
    predicted = []
    for i in range(0, ROWS, BATCH):
        logits = ref(x[i:i + BATCH])
        predicted.append(logits.argmax(-1).detach())
        loss = F.cross_entropy(logits, y[i:i + BATCH])
        opt.zero_grad()
        loss.backward()
        opt.step()
    predicted = torch.cat(predicted)
    tp = torch.stack([((predicted == c) & (y == c)).sum() for c in range(3)]).double()
    precision = tp / (torch.stack([(predicted == c).sum() for c in range(3)]) + 1e-7)
    recall = tp / (torch.stack([(y == c).sum() for c in range(3)]) + 1e-7)
    f1 = 2 * precision * recall / (precision + recall + 1e-7)
    (value,) = history.history["f1_score"]
    assert isinstance(value, np.ndarray) and value.shape == (3,)
    np.testing.assert_allclose(value, f1.numpy(), rtol=0, atol=ATOL)
    assert history.history["r2_score"][0].shape == (3,)
    loss, f1_eval, r2_eval = model.evaluate(x.numpy(), _one_hot(y), verbose=0)
    assert f1_eval.shape == (3,) and r2_eval.shape == (3,)
    with open(tmp_path / "log.csv") as f:
        row = next(csv.DictReader(f))
    assert row["f1_score"] == "[" + ", ".join(str(v) for v in value) + "]"
    tags = {v.tag for path in log_dir.rglob("*tfevents*") for event in _events(path)
            for v in event.summary.value}
    assert {"epoch_loss", "epoch_f1_score/0", "epoch_f1_score/1", "epoch_f1_score/2", "epoch_r2_score/2"} <= tags
    with pytest.raises(ValueError, match=r"monitor='f1_score' is .*not one number.*average=\"macro\""):
        model.fit(x.numpy(), _one_hot(y), batch_size=BATCH, epochs=1, verbose=0,
                  callbacks=[mr.callbacks.EarlyStopping(monitor="f1_score", mode="max")])


def _events(path):
    from mirrored.training._tensorboard import Event

    data = path.read_bytes()
    offset = 0
    while offset < len(data):
        (length,) = np.frombuffer(data[offset:offset + 8], dtype="<u8")
        event = Event()
        event.ParseFromString(data[offset + 12:offset + 12 + int(length)])
        yield event
        offset += 12 + int(length) + 4


def test_the_progress_bar_shows_a_per_class_metric_by_its_mean(capsys):
    x, y = _data()
    model = _model(2, loss="categorical_crossentropy", metrics=["f1_score"])
    history = model.fit(x.numpy(), _one_hot(y), batch_size=BATCH, epochs=1, verbose=2)
    mean = float(np.mean(history.history["f1_score"][0]))
    assert f"f1_score: {mean:.4f}" in capsys.readouterr().out


@pytest.mark.parametrize("replicas", [2, 3])
def test_metrics_made_at_their_first_update_work_when_a_part_is_empty(replicas):
    """Regression (issue 38): F1Score, FBetaScore and R2Score make their state at the first update, through a
    merge_call; a first batch of one row left the other replicas' parts empty (their steps skip the
    update) and fit failed with CollectiveMismatchError. The first step now builds that state on every
    replica: fit, evaluate and train_on_batch on one row give one replica's results."""
    x, y = _data()
    runs = []
    for n in (1, replicas):
        model = _model(n, loss="categorical_crossentropy", metrics=[
            mr.metrics.F1Score(average="macro"), mr.metrics.FBetaScore(beta=2.0), mr.metrics.R2Score()])
        history = model.fit(x[:1].numpy(), _one_hot(y[:1]), batch_size=1, epochs=2, verbose=0)
        evaluated = _model(n, loss="categorical_crossentropy", metrics=[mr.metrics.F1Score()])
        stepped = _model(n, loss="categorical_crossentropy", metrics=[mr.metrics.R2Score(class_aggregation=None)])
        runs.append([history.history,
                     evaluated.evaluate(x[:1].numpy(), _one_hot(y[:1]), return_dict=True, verbose=0),
                     stepped.train_on_batch(x[:1].numpy(), _one_hot(y[:1]), return_dict=True)])
    for one, many in zip(*runs):
        assert list(one) == list(many)
        for key in one:
            np.testing.assert_allclose(np.asarray(many[key], dtype=np.float64), np.asarray(one[key], dtype=np.float64),
                                       rtol=0, atol=ATOL, err_msg=key)


def test_backup_and_restore_resumes_a_metric_made_at_its_first_update(tmp_path):
    """A backup taken mid-epoch holds F1Score's per-class counts; a new run (whose F1Score has made no state
    yet) restores them instead of refusing the backup as another kind of metric, and its epoch ends with
    the uninterrupted run's loss, F1 scores and weights."""
    x, y = _data(24)

    class Interrupt(mr.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            if batch == 1:
                raise KeyboardInterrupt

    def run(callbacks):
        model = _model(2, loss="categorical_crossentropy", metrics=["f1_score", mr.metrics.R2Score()])
        return model, model.fit(x.numpy(), _one_hot(y), batch_size=BATCH, epochs=1, shuffle=False, verbose=0,
                                callbacks=callbacks)

    whole, want = run([])
    with pytest.raises(KeyboardInterrupt):
        run([mr.callbacks.BackupAndRestore(str(tmp_path), save_freq=1), Interrupt()])
    resumed, got = run([mr.callbacks.BackupAndRestore(str(tmp_path), save_freq=1)])
    for key, values in want.history.items():
        np.testing.assert_allclose(np.asarray(got.history[key]), np.asarray(values), rtol=0, atol=ATOL, err_msg=key)
    for a, b in zip(whole.module.parameters(), resumed.module.parameters()):
        torch.testing.assert_close(b, a, rtol=0, atol=ATOL)
