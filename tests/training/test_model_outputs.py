"""mr.Model with a module of several outputs (issue 38): compile's loss, loss_weights, metrics and
weighted_metrics per output, on 1, 2 and 3 replicas against a plain-PyTorch run on one device, and
the logs' names against Keras 3's own (compile_utils.py's rules).

Tolerances: the replicas' partial gradient sums add in another order than one device's, which moves
the weights and the reported losses by a few float32 ulps per step: 1e-5 holds with a wide margin.
Every run ends with a batch of one row, which leaves the other replicas' parts empty.
"""
from __future__ import annotations

import os

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import mirrored as mr
from _replicas import strategy_of  # tests/_replicas.py

ROWS, BATCH, EPOCHS, LR = 17, 8, 2, 0.1  # batches of 8, 8 and 1
ATOL = 1e-5


class TwoHeads(nn.Module):
    """A trunk and two heads: class logits and one regression value. `kind` says how it returns them."""

    def __init__(self, kind: str = "dict"):
        super().__init__()
        torch.manual_seed(0)
        self.trunk = nn.Sequential(nn.Linear(4, 8), nn.Tanh())
        self.cls, self.reg = nn.Linear(8, 3), nn.Linear(8, 1)
        self.kind = kind

    def forward(self, x):
        h = self.trunk(x)
        if self.kind == "dict":  # "reg" first: the logs' order must not depend on it
            return {"reg": self.reg(h), "cls": self.cls(h)}
        return (self.cls(h), self.reg(h)) if self.kind == "tuple" else [self.cls(h), self.reg(h)]


def _data(rows: int = ROWS, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(rows, 4, generator=g), torch.randint(0, 3, (rows,), generator=g),
            torch.randn(rows, 1, generator=g), torch.rand(rows, generator=g) + 0.5)


def _fit(replicas: int, kind: str, compile_kwargs: dict, x, y, **fit_kwargs):
    with strategy_of(replicas).scope():
        model = mr.Model(TwoHeads(kind))
        model.compile(optimizer=mr.optimizers.SGD(learning_rate=LR), **compile_kwargs)
    history = model.fit(x.numpy(), y, batch_size=BATCH, epochs=EPOCHS, shuffle=False, verbose=0, **fit_kwargs)
    return model, history


def _assert_weights(model: mr.Model, ref: nn.Module) -> None:
    for copy in model.replicas:
        for (name, got), want in zip(copy.named_parameters(), ref.parameters()):
            torch.testing.assert_close(got, want, rtol=0, atol=ATOL, msg=name)
    model.check_in_sync()


def _assert_history(history, want: dict) -> None:
    assert sorted(history.history) == sorted(want)
    for key, values in want.items():
        np.testing.assert_allclose(history.history[key], values, rtol=0, atol=ATOL, err_msg=key)


def _means(records: list[tuple[float, int]]) -> float:
    """A tracker's value: each step's value weighted by its rows (Keras's loss trackers)."""
    return sum(v * n for v, n in records) / sum(n for _, n in records)


@pytest.mark.parametrize("replicas", [1, 2, 3])
def test_dict_outputs_weigh_each_outputs_loss_as_one_device(replicas):
    """loss and loss_weights as dicts, one sample_weight array for both outputs, metrics (unweighted) and
    weighted_metrics per output, validation data per output: weights, the losses (total and each
    output's, unweighted) and every metric equal plain torch on one device; the logs are named as
    Keras names them (cls_loss, reg_mae, cls_weighted_accuracy, val_reg_loss)."""
    x, y1, y2, sw = _data()
    xv, yv1, yv2, _ = _data(7, seed=1)
    ref = TwoHeads()
    opt = torch.optim.SGD(ref.parameters(), lr=LR)
    want: dict[str, list[float]] = {}
    for _ in range(EPOCHS):
        rec: dict[str, list] = {k: [] for k in ("loss", "cls_loss", "reg_loss")}
        hits, weighted, errors = [], [], []
        for i in range(0, ROWS, BATCH):
            xb, yb1, yb2, wb = x[i:i + BATCH], y1[i:i + BATCH], y2[i:i + BATCH], sw[i:i + BATCH]
            out = ref(xb)
            cls = (F.cross_entropy(out["cls"], yb1, reduction="none") * wb).sum() / len(xb)
            reg = (((out["reg"] - yb2) ** 2).mean(-1) * wb).sum() / len(xb)
            loss = cls + 0.5 * reg
            for key, v in (("loss", loss), ("cls_loss", cls), ("reg_loss", reg)):
                rec[key].append((float(v.detach()), len(xb)))
            hit = (out["cls"].argmax(-1) == yb1).double()
            hits.append(hit)
            weighted.append((hit * wb, wb))
            errors.append((out["reg"] - yb2).abs().mean(-1).detach())
            opt.zero_grad()
            loss.backward()
            opt.step()
        with torch.no_grad():
            out = ref(xv)
            v_cls, v_reg = F.cross_entropy(out["cls"], yv1), ((out["reg"] - yv2) ** 2).mean()
            epoch = {"loss": _means(rec["loss"]), "cls_loss": _means(rec["cls_loss"]),
                     "reg_loss": _means(rec["reg_loss"]), "cls_accuracy": float(torch.cat(hits).mean()),
                     "cls_weighted_accuracy": float(sum(h.sum() for h, _ in weighted)
                                                    / sum(w.sum() for _, w in weighted)),
                     "reg_mae": float(torch.cat(errors).mean()),
                     "val_loss": float(v_cls + 0.5 * v_reg), "val_cls_loss": float(v_cls),
                     "val_reg_loss": float(v_reg),
                     "val_cls_accuracy": float((out["cls"].argmax(-1) == yv1).double().mean()),
                     "val_cls_weighted_accuracy": float((out["cls"].argmax(-1) == yv1).double().mean()),
                     "val_reg_mae": float((out["reg"] - yv2).abs().mean())}
        for key, v in epoch.items():
            want.setdefault(key, []).append(v)
    model, history = _fit(replicas, "dict", dict(
        loss={"cls": "sparse_categorical_crossentropy", "reg": "mse"}, loss_weights={"cls": 1.0, "reg": 0.5},
        metrics={"cls": ["accuracy"], "reg": ["mae"]}, weighted_metrics={"cls": ["accuracy"]}),
        x, {"cls": y1.numpy(), "reg": y2.numpy()}, sample_weight=sw.numpy(),
        validation_data=(xv.numpy(), {"cls": yv1.numpy(), "reg": yv2.numpy()}))
    _assert_weights(model, ref)
    _assert_history(history, want)
    # evaluate's list in Keras's order: loss, each output's loss, then the prefixed metrics, sorted
    logs = model.evaluate(xv.numpy(), {"cls": yv1.numpy(), "reg": yv2.numpy()}, return_dict=True, verbose=0)
    listed = model.evaluate(xv.numpy(), {"cls": yv1.numpy(), "reg": yv2.numpy()}, verbose=0)
    assert listed == [logs[k] for k in ("loss", "cls_loss", "reg_loss", "cls_accuracy", "cls_weighted_accuracy",
                                        "reg_mae")]
    predicted = model.predict(xv.numpy(), batch_size=4, verbose=0)
    with torch.no_grad():
        out = ref(xv)
    assert sorted(predicted) == ["cls", "reg"]
    for key in predicted:
        np.testing.assert_allclose(predicted[key], out[key].numpy(), rtol=0, atol=ATOL)


@pytest.mark.parametrize("replicas", [1, 2, 3])
def test_tuple_outputs_with_a_sum_and_an_ignore_class_loss_give_one_devices_update(replicas):
    """A list of losses on a tuple output whose reductions differ: a mean over the labels ignore_class
    keeps, and a sum. No one weight per replica can give their gradient; each replica takes its share
    of one device's loss (its sums over the global counts), so N replicas still equal one device - and
    a replica whose part keeps no label, or is empty, adds nothing. The logs name the outputs by their
    losses (a tuple's outputs have no names), as Keras does."""
    x, y1, y2, _ = _data()
    y1[:6] = 0  # the first batch's first parts keep no label on 2 or 3 replicas
    ref = TwoHeads("tuple")
    opt = torch.optim.SGD(ref.parameters(), lr=LR)
    want: dict[str, list[float]] = {}
    for _ in range(EPOCHS):
        rec: dict[str, list] = {k: [] for k in ("loss", "sparse_categorical_crossentropy_loss",
                                                "mean_squared_error_loss")}
        for i in range(0, ROWS, BATCH):
            xb, yb1, yb2 = x[i:i + BATCH], y1[i:i + BATCH], y2[i:i + BATCH]
            logits, value = ref(xb)
            kept = yb1 != 0
            cls = (F.cross_entropy(logits, yb1, reduction="none") * kept).sum() / max(int(kept.sum()), 1)
            reg = ((value - yb2) ** 2).mean(-1).sum()
            loss = cls + 0.25 * reg
            for key, v in zip(rec, (loss, cls, reg)):
                rec[key].append((float(v.detach()), len(xb)))
            opt.zero_grad()
            loss.backward()
            opt.step()
        for key, records in rec.items():
            want.setdefault(key, []).append(_means(records))
    model, history = _fit(replicas, "tuple", dict(
        loss=[mr.losses.SparseCategoricalCrossentropy(ignore_class=0), mr.losses.MeanSquaredError(reduction="sum")],
        loss_weights=[1.0, 0.25]), x, (y1.numpy(), y2.numpy()))
    _assert_weights(model, ref)
    _assert_history(history, want)


@pytest.mark.parametrize("replicas", [1, 2, 3])
def test_one_loss_applies_to_every_output_and_a_list_of_metrics_to_each(replicas):
    """One loss name for a list output applies to each output (Keras's rule), each with the loss weight
    given as one number; a metrics list with one entry per output goes to each in order. Names: the
    outputs have none, so two losses named "mse" log once as mse_loss, and the metrics keep their own
    names, as Keras logs them."""
    x, _, y2, _ = _data()
    y3 = torch.randn(ROWS, 3, generator=torch.Generator().manual_seed(5))
    ref = TwoHeads("list")
    opt = torch.optim.SGD(ref.parameters(), lr=LR)
    want: dict[str, list[float]] = {}
    for _ in range(EPOCHS):
        rec: dict[str, list] = {"loss": [], "mse_loss": []}
        errors, squares = [], []
        for i in range(0, ROWS, BATCH):
            xb, yb3, yb2 = x[i:i + BATCH], y3[i:i + BATCH], y2[i:i + BATCH]
            a, b = ref(xb)
            la, lb = ((a - yb3) ** 2).mean(), ((b - yb2) ** 2).mean()
            loss = 2.0 * la + 2.0 * lb
            rec["loss"].append((float(loss.detach()), len(xb)))
            rec["mse_loss"].append((float(lb.detach()), len(xb)))  # (the second tracker of that name is the one logged)
            errors.append((a - yb3).abs().mean(-1).detach())
            squares.append(((b - yb2) ** 2).mean(-1).detach())
            opt.zero_grad()
            loss.backward()
            opt.step()
        epoch = {"loss": _means(rec["loss"]), "mse_loss": _means(rec["mse_loss"]),
                 "mae": float(torch.cat(errors).mean()), "mse": float(torch.cat(squares).mean())}
        for key, v in epoch.items():
            want.setdefault(key, []).append(v)
    model, history = _fit(replicas, "list", dict(loss="mse", loss_weights=2.0, metrics=["mae", "mse"]),
                          x, (y3.numpy(), y2.numpy()))
    _assert_weights(model, ref)
    _assert_history(history, want)


# ---- Keras's own names and values -----------------------------------------------------------------------
keras = None


def _keras():
    global keras
    if keras is None:
        os.environ.setdefault("KERAS_BACKEND", "torch")
        keras = pytest.importorskip("keras")
        if keras.backend.backend() != "torch":
            pytest.skip("keras was imported with another backend than torch")
    return keras


def _keras_names(kind: str, compile_kwargs: dict, y) -> tuple[list[str], int]:
    """The history keys and evaluate's length of Keras's own subclassed model of TwoHeads' structure."""
    k = _keras()

    class KerasTwoHeads(k.Model):
        def __init__(self):
            super().__init__()
            self.trunk, self.cls, self.reg = k.layers.Dense(8, activation="tanh"), k.layers.Dense(3), k.layers.Dense(1)

        def call(self, x):
            h = self.trunk(x)
            if kind == "dict":
                return {"reg": self.reg(h), "cls": self.cls(h)}
            return (self.cls(h), self.reg(h)) if kind == "tuple" else [self.cls(h), self.reg(h)]

    x, *_ = _data()
    net = KerasTwoHeads()
    net.compile(optimizer="sgd", **compile_kwargs)
    history = net.fit(x.numpy(), y, batch_size=BATCH, epochs=1, verbose=0, validation_split=0.25)
    return sorted(history.history), len(net.evaluate(x.numpy(), y, verbose=0))


NAMING_CASES = {
    "dict": ("dict", lambda: dict(loss={"cls": "sparse_categorical_crossentropy", "reg": "mse"},
                                  metrics={"cls": ["accuracy"], "reg": ["mae", "mse"]},
                                  weighted_metrics={"cls": ["accuracy"]})),
    "dict_one_loss": ("dict", lambda: dict(loss={"reg": "mse"}, metrics={"reg": ["mae"]})),
    "tuple": ("tuple", lambda: dict(loss=["sparse_categorical_crossentropy", "mse"],
                                    metrics=[["accuracy"], ["mae"]], loss_weights=[1.0, 0.3])),
}


@pytest.mark.filterwarnings("ignore:Gradients do not exist")  # (Keras's own, for its head without a loss)
@pytest.mark.parametrize("case", sorted(NAMING_CASES))
def test_history_keys_are_named_as_keras_names_them(case):
    """The history keys (and evaluate's length) of a torch module returning a dict or tuple equal those of
    Keras 3.15's own fit of a Keras model returning the same structure, compiled the same way."""
    kind, make = NAMING_CASES[case]
    x, y1, y2, _ = _data()
    y = ({"cls": y1.numpy(), "reg": y2.numpy()} if kind == "dict" else (y1.numpy(), y2.numpy()))
    theirs, evaluated = _keras_names(kind, make(), y)
    with strategy_of(2).scope():
        model = mr.Model(TwoHeads(kind))
        model.compile(optimizer="sgd", **make())
    history = model.fit(x.numpy(), y, batch_size=BATCH, epochs=1, verbose=0, validation_split=0.25)
    assert sorted(history.history) == theirs
    assert len(model.evaluate(x.numpy(), y, verbose=0)) == evaluated


@pytest.mark.parametrize("replicas", [1, 2, 3])
def test_a_keras_functional_model_with_two_outputs_fits_as_keras_fits_it(replicas):
    """The same program as Keras's: a functional model with outputs "cls" and "reg", loss and metrics as
    lists, loss_weights, validation_split; mr.Model on N replicas against Keras's own fit on one device:
    the same history keys, values within float error, the same weights and evaluate list."""
    k = _keras()
    rng = np.random.default_rng(0)
    x = rng.normal(size=(40, 4)).astype("float32")
    y = (rng.integers(0, 3, 40), rng.normal(size=(40, 1)).astype("float32"))

    def build():
        k.utils.set_random_seed(0)
        inp = k.Input((4,))
        h = k.layers.Dense(8, activation="relu")(inp)
        return k.Model(inp, [k.layers.Dense(3, activation="softmax", name="cls")(h), k.layers.Dense(1, name="reg")(h)])

    settings = dict(loss=["sparse_categorical_crossentropy", "mse"], loss_weights=[1.0, 0.5],
                    metrics=[["accuracy"], ["mae"]])
    ref = build()
    ref.compile(optimizer=k.optimizers.SGD(0.1), **settings)
    want = ref.fit(x, y, batch_size=9, epochs=2, verbose=0, shuffle=False, validation_split=0.25)
    with strategy_of(replicas).scope():
        model = mr.Model(build())
        model.compile(optimizer=k.optimizers.SGD(0.1), **settings)
    got = model.fit(x, y, batch_size=9, epochs=2, verbose=0, shuffle=False, validation_split=0.25)
    assert sorted(got.history) == sorted(want.history)
    assert "val_cls_accuracy" in got.history and "reg_loss" in got.history
    for key, values in want.history.items():
        np.testing.assert_allclose(got.history[key], values, rtol=0, atol=ATOL, err_msg=key)
    for a, b in zip(ref.get_weights(), model.module.get_weights()):
        np.testing.assert_allclose(b, a, rtol=0, atol=ATOL)
    np.testing.assert_allclose(model.evaluate(x, y, verbose=0), ref.evaluate(x, y, verbose=0), rtol=0, atol=ATOL)


# ---- what is refused ------------------------------------------------------------------------------------
def _compiled(kind: str = "dict", **compile_kwargs) -> mr.Model:
    with strategy_of(2).scope():
        model = mr.Model(TwoHeads(kind))
        model.compile(optimizer="sgd", **compile_kwargs)
    return model


def test_a_loss_dict_is_read_as_losses_per_output_not_as_a_config():
    """Regression (issue 38): {"cls": ..., "reg": ...} was read as a serialized config and refused. A
    config ({"class_name", "config"}) still gives one loss."""
    x, y1, y2, _ = _data()
    model = _compiled(loss={"cls": mr.losses.SparseCategoricalCrossentropy(), "reg": mr.losses.MeanSquaredError()})
    assert "cls_loss" in model.fit(x.numpy(), {"cls": y1.numpy(), "reg": y2.numpy()}, verbose=0).history
    single = _compiled("tuple", loss=mr.losses.serialize(mr.losses.MeanSquaredError()))
    assert single._outputs.single


def test_a_loss_dict_whose_keys_name_no_output_is_refused_naming_them():
    x, y1, y2, _ = _data()
    model = _compiled(loss={"class": "sparse_categorical_crossentropy", "reg": "mse"})
    with pytest.raises(ValueError, match=r"'class' names no output of the module, which returns outputs 'reg', 'cls'"):
        model.fit(x.numpy(), {"cls": y1.numpy(), "reg": y2.numpy()}, verbose=0)


def test_misuse_of_per_output_arguments_is_refused_in_one_line():
    x, y1, y2, _ = _data()
    with pytest.raises(ValueError, match=r"3 entries for the module's 2 output"):
        _compiled("tuple", loss=["mse", "mse", "mse"]).fit(x.numpy(), (y2.numpy(), y2.numpy()), verbose=0)
    with pytest.raises(ValueError, match=r"loss_weights=\[1.0, 2.0\]\) with one loss for every output"):
        _compiled("tuple", loss="mse", loss_weights=[1.0, 2.0]).fit(x.numpy(), (y2.numpy(), y2.numpy()), verbose=0)
    with pytest.raises(ValueError, match=r"the labels are one array but the module returns 2 outputs"):
        _compiled(loss={"cls": "sparse_categorical_crossentropy", "reg": "mse"}).fit(x.numpy(), y1.numpy(), verbose=0)
    with pytest.raises(TypeError, match=r"compile\(metrics='accuracy'\): give a list"):
        _compiled(loss="mse", metrics="accuracy")


def test_save_and_load_keep_the_per_output_compile_settings(tmp_path):
    """Model.save records loss, loss_weights, metrics and weighted_metrics per output; Model.load compiles
    with them, and fit goes on with the same logs as the original model's."""
    x, y1, y2, sw = _data()
    y = {"cls": y1.numpy(), "reg": y2.numpy()}
    settings = dict(loss={"cls": "sparse_categorical_crossentropy", "reg": mr.losses.Huber(delta=0.5)},
                    loss_weights={"cls": 1.0, "reg": 0.5},
                    metrics={"cls": ["accuracy"], "reg": [mr.metrics.MeanAbsoluteError()]},
                    weighted_metrics={"cls": ["accuracy"]})
    model = _compiled(**settings)
    model.fit(x.numpy(), y, batch_size=BATCH, sample_weight=sw.numpy(), verbose=0)
    model.save(tmp_path / "m.safetensors")
    with strategy_of(2).scope():
        loaded = mr.Model.load(tmp_path / "m.safetensors", module=TwoHeads())
    a = model.fit(x.numpy(), y, batch_size=BATCH, sample_weight=sw.numpy(), verbose=0, shuffle=False).history
    b = loaded.fit(x.numpy(), y, batch_size=BATCH, sample_weight=sw.numpy(), verbose=0, shuffle=False).history
    assert list(a) == list(b)
    for key in a:
        np.testing.assert_allclose(b[key], a[key], rtol=0, atol=ATOL, err_msg=key)
