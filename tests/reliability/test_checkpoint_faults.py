"""Issue 17: a checkpoint that does not fit (or is damaged) is refused before anything is assigned,
with a CheckpointError (a ValueError) naming the file, and every entry point says so: Model.load,
Model.load_weights, BackupAndRestore's restore and the files ModelCheckpoint writes."""
from __future__ import annotations

import copy
import json
import os
import struct
import subprocess
import sys
import textwrap

import pytest
import torch
from torch import nn

import mirrored as mr
from mirrored.training import checkpoint
from mirrored.training.checkpoint import CheckpointError
from _replicas import strategy_of  # tests/_replicas.py

GLOBAL_BATCH = 8


def _data(n: int = 16, features: int = 4, classes: int = 3) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return torch.randn(n, features, generator=g), torch.randint(0, classes, (n,), generator=g)


def _model(hidden: int = 8, replicas: int = 2, seed: int = 0, resnet: bool = False) -> mr.Model:
    """A 2-layer MLP on 4 features, or (resnet=True) the smallest CIFAR ResNet, which mr.models
    records so that Model.load can rebuild it from the file alone."""
    torch.manual_seed(seed)
    strategy = strategy_of(replicas)
    with strategy.scope():
        net = (mr.models.resnet_cifar(depth=8, width=4, num_classes=3) if resnet
               else nn.Sequential(nn.Linear(4, hidden), nn.ReLU(), nn.Linear(hidden, 3)))
        model = mr.Model(net)
        model.compile(optimizer=mr.optimizers.SGD(learning_rate=0.1, momentum=0.9),
                      loss="sparse_categorical_crossentropy", metrics=["accuracy"])
    return model


def _dataset(resnet: bool = False) -> mr.data.Dataset:
    x, y = _data()
    if resnet:
        x = torch.rand(len(y), 8, 8, 3, generator=torch.Generator().manual_seed(1))
    return mr.data.Dataset.from_tensor_slices((x, y)).batch(GLOBAL_BATCH)


def _trained_file(tmp_path, name: str = "model.safetensors", **kwargs) -> tuple[mr.Model, str]:
    model = _model(**kwargs)
    model.fit(_dataset(kwargs.get("resnet", False)), epochs=1, verbose=0)
    path = str(tmp_path / name)
    model.save(path)
    return model, path


def _snapshot(model: mr.Model) -> tuple[dict, dict]:
    return (copy.deepcopy(model.module.state_dict()), copy.deepcopy(model.mirrored_optimizer.state_dict()))


def _assert_unchanged(model: mr.Model, before: tuple[dict, dict]) -> None:
    weights, opt = before
    for k, v in model.module.state_dict().items():
        assert torch.equal(v, weights[k]), k
    now = model.mirrored_optimizer.state_dict()
    assert now["state"].keys() == opt["state"].keys()
    for i, entries in opt["state"].items():
        for name, value in entries.items():
            assert torch.equal(now["state"][i][name], value), (i, name)
    model.check_in_sync()


# --------------------------------------------------------------------------------------------
# Shapes and dtypes, checked before anything is assigned


def test_momentum_buffer_of_another_shape_is_refused_naming_file_key_and_both_shapes(rewrite_checkpoint, tmp_path):
    """Issue 17: momentum buffers of shape (7,) loaded against parameters of (8,), and the first fit
    failed inside torch."""
    _, path = _trained_file(tmp_path)
    rewrite_checkpoint(path, tensors=lambda t: t.update({"model.optimizer/state/1/momentum_buffer": torch.zeros(7)}))
    with pytest.raises(CheckpointError) as info:
        mr.Model.load(path, module=nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3)))
    message = str(info.value)
    assert path in message and "'model.optimizer/state/1/momentum_buffer'" in message
    assert "(7,)" in message and "(8,)" in message and "0.bias" in message


def _rename(entries: dict, old: str, new: str | None) -> None:
    value = entries.pop(old)
    if new is not None:
        entries[new] = value


@pytest.mark.parametrize("optimizer, forge, message", [
    # A scalar where a per-element buffer belongs loaded, and the first fit failed inside torch.
    ("sgd", dict(tensors=lambda t: t.update({"model.optimizer/state/0/momentum_buffer": torch.zeros(())})),
     r"'momentum_buffer' of parameter 0 \(model/0\.weight, shape \(8, 4\)\) is tensor\(0\.\) in the file, but the "
     r"optimizer keeps a tensor shaped like model/0\.weight, \(8, 4\)"),
    ("adam", dict(tensors=lambda t: t.update({"model.optimizer/state/1/exp_avg": torch.zeros(())})),
     r"optimizer keeps a tensor shaped like model/0\.bias, \(8,\)"),
    ("adam", dict(tensors=lambda t: t.update({"model.optimizer/state/1/step": torch.zeros(3)})),
     r"'model.optimizer/state/1/step' has shape \(3,\) in the file, but the optimizer keeps a scalar there"),
    # Entries under other names: a raw KeyError from torch, or momentum silently restarting.
    ("adam", dict(meta=lambda m: _rename(m["objects"]["model.optimizer"]["state"]["state"]["1"], "step", "s:tep")),
     r"state of parameter 1 \(model/0\.bias\) holds \['exp_avg', 'exp_avg_sq', 's:tep'\], but Adam .* keeps "
     r"\['exp_avg', 'exp_avg_sq', 'step'\] \(missing \['step'\]\) \(not its own: \['s:tep'\]\)"),
    ("adam", dict(meta=lambda m: _rename(m["objects"]["model.optimizer"]["state"]["state"]["2"], "exp_avg", None)), r"\(missing \['exp_avg'\]\)"),
    ("sgd", dict(meta=lambda m: _rename(m["objects"]["model.optimizer"]["state"]["state"]["1"], "momentum_buffer", "momentum")),
     r"\(missing \['momentum_buffer'\]\) \(not its own: \['momentum'\]\)"),
], ids=["sgd-scalar-buffer", "adam-scalar-exp_avg", "adam-shaped-step", "adam-renamed-step", "adam-no-exp_avg",
        "sgd-renamed-buffer"])
def test_optimizer_state_entries_are_the_optimizers_own(rewrite_checkpoint, tmp_path, optimizer, forge, message):
    """Issue 17 (audit): each parameter's state must hold the entries the optimizer class keeps under
    the file's settings (learnt from one step of a fresh optimizer), scalars where it keeps scalars
    and buffers shaped like the parameter elsewhere. A 0-dim buffer used to skip every check and fail
    in the first fit; a renamed entry gave torch's KeyError, or momentum restarting without a word."""
    model = _model()
    if optimizer == "adam":
        model.compile(optimizer=mr.optimizers.Adam(learning_rate=0.01), loss="sparse_categorical_crossentropy")
    model.fit(_dataset(), epochs=1, verbose=0)
    path = str(tmp_path / "model.safetensors")
    model.save(path)
    rewrite_checkpoint(path, **forge)
    with pytest.raises(CheckpointError, match=message) as info:
        mr.Model.load(path, module=nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3)))
    assert path in str(info.value)
    model.load_weights(path)  # the weights alone are fine


def test_weights_of_another_architecture_are_refused_by_load_and_load_weights(tmp_path):
    _, path = _trained_file(tmp_path)
    other = nn.Sequential(nn.Linear(4, 7), nn.ReLU(), nn.Linear(7, 3))
    with pytest.raises(CheckpointError, match=r"Model\.load\('.*model\.safetensors'\): tensor 'model/0\.weight' "
                                              r"has shape \(8, 4\) in the file but \(7, 4\) in the model"):
        mr.Model.load(path, module=other)
    small = _model(hidden=7)
    before = _snapshot(small)
    with pytest.raises(CheckpointError, match=r"load_weights\('.*model\.safetensors'\): tensor '0\.weight' has "
                                              r"shape \(8, 4\) in the file but \(7, 4\)"):
        small.load_weights(path)
    _assert_unchanged(small, before)
    extra = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3), nn.BatchNorm1d(3))
    with pytest.raises(CheckpointError, match=r"the model has '3\.weight', '3\.bias', .*which the file lacks"):
        mr.Model.load(path, module=extra)


def test_an_integer_tensor_stored_as_float_is_refused(rewrite_checkpoint, tmp_path):
    net = nn.Sequential(nn.Linear(4, 3), nn.BatchNorm1d(3))
    strategy = mr.MirroredStrategy(devices=["cpu:0"])
    with strategy.scope():
        model = mr.Model(net)
    path = str(tmp_path / "bn.safetensors")
    model.save_weights(path)
    rewrite_checkpoint(path, tensors=lambda t: t.update({"model/1.num_batches_tracked": torch.zeros(())}))
    with pytest.raises(CheckpointError, match=r"'1\.num_batches_tracked' has dtype torch\.float32 in the file "
                                              r"but torch\.int64"):
        model.load_weights(path)
    # A float tensor in another float dtype loads (cast, as torch does).
    rewrite_checkpoint(path, tensors=lambda t: t.update({"model/0.weight": t["model/0.weight"].double(),
                                               "model/1.num_batches_tracked": torch.tensor(0)}))
    model.load_weights(path)


def test_optimizer_state_of_another_optimizer_is_refused(rewrite_checkpoint, tmp_path):
    _, path = _trained_file(tmp_path, resnet=True)
    rewrite_checkpoint(path, meta=lambda m: m["objects"]["model.optimizer"]["state"]["param_groups"][0].update({"betas": [0.9, 0.999]}))
    with pytest.raises(CheckpointError, match=r"param_groups\[0\] has the setting 'betas', which SGD does not "
                                              r"have: the state was saved from another optimizer"):
        mr.Model.load(path)
    rewrite_checkpoint(path, meta=lambda m: m["objects"]["model.optimizer"]["state"]["param_groups"][0].update({"momentum": "fast"}))
    with pytest.raises(CheckpointError, match=r"\['momentum'\] is 'fast' in the file but 0\.9"):
        mr.Model.load(path)


# --------------------------------------------------------------------------------------------
# Architecture configs read from a file


def test_forged_num_classes_never_reaches_the_allocator(rewrite_checkpoint, tmp_path, monkeypatch):
    """Issue 17: a num_classes of 10**12 in the recorded model_config was built as asked."""
    torch.manual_seed(0)
    with mr.MirroredStrategy(devices=["cpu:0"]).scope():
        model = mr.Model(mr.models.resnet_cifar(depth=8, width=4, num_classes=3))
    path = str(tmp_path / "r.safetensors")
    model.save(path)
    built_on = []
    real_get = mr.models.get
    monkeypatch.setattr(mr.models, "get", lambda *a, **k: (built_on.append(str(torch.get_default_device())),
                                                           real_get(*a, **k))[1])
    for classes, message in ((10**12, r"num_classes=1000000000000\): must be a whole number in \[1, 1048576\]"),
                             (100_000, r"'model/fc\.weight' has shape \(3, 16\) in the file but \(100000, 16\)")):
        rewrite_checkpoint(path, meta=lambda m: m["model_config"]["kwargs"].update({"num_classes": classes}))
        with pytest.raises(CheckpointError, match=message):
            mr.Model.load(path, compile=False)
    assert set(built_on) == {"meta"}  # only the meta-device skeleton of the in-bounds value was built
    for bad, message in (({"depth": 10**9}, r"depth=1000000000\): must be a whole number in \[1, 2000\]"),
                         ({"depth": 9}, r"depth must be 6n\+2"),
                         ({"widht": 4}, r"unknown argument 'widht'"),
                         ({"width": "4"}, r"width='4'\): must be a whole number")):
        rewrite_checkpoint(path, meta=lambda m: m["model_config"].update({"kwargs": bad}))
        with pytest.raises(CheckpointError, match=r"r\.safetensors.*" + message):
            mr.Model.load(path, compile=False)
    rewrite_checkpoint(path, meta=lambda m: m.update({"model_config": {"name": "resnet_cifar", "kwargs": {
        "depth": 8, "width": 4, "num_classes": 3}}}))
    assert mr.Model.load(path, compile=False).module.fc.out_features == 3


# --------------------------------------------------------------------------------------------
# Only regular files


def test_a_named_pipe_is_refused_at_once_instead_of_blocking(tmp_path):
    """Issue 17: Model.load on a named pipe blocked forever (it waited for a writer)."""
    fifo = tmp_path / "model.safetensors"
    os.mkfifo(fifo)
    code = textwrap.dedent(f"""
        import mirrored as mr
        from mirrored.training.checkpoint import CheckpointError
        for load in (mr.Model.load, mr.training.checkpoint.load_checkpoint):
            try:
                load({str(fifo)!r})
            except CheckpointError as e:
                print(e)
    """)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert len(lines) == 2 and all(str(fifo) in line and "a named pipe, not a checkpoint file" in line
                                   for line in lines), done.stdout


def test_a_device_file_is_refused(tmp_path):
    with pytest.raises(CheckpointError, match=r"'/dev/zero'\): this is a device"):
        checkpoint.load_checkpoint("/dev/zero")


# --------------------------------------------------------------------------------------------
# Malformed files: every entry point, every failure a CheckpointError naming the file


def _header_and_body(path: str) -> tuple[dict, bytes]:
    raw = open(path, "rb").read()
    n = struct.unpack("<Q", raw[:8])[0]
    return json.loads(raw[8:8 + n]), raw[8 + n:]


def _with_header(header: dict, body: bytes, size: int | None = None) -> bytes:
    text = json.dumps(header).encode()
    return struct.pack("<Q", len(text) if size is None else size) + text + body


def _malformed(path: str) -> dict[str, bytes]:
    """A corpus of broken variants of the checkpoint at `path`, by name."""
    raw = open(path, "rb").read()
    header, body = _header_and_body(path)
    tensor = next(k for k in header if k.startswith("model/"))
    meta = json.loads(header["__metadata__"]["mirrored"])

    def entry(**change):
        h = copy.deepcopy(header)
        h[tensor].update(change)
        return _with_header(h, body)

    def with_meta(edit):
        h, m = copy.deepcopy(header), copy.deepcopy(meta)
        edit(m)
        h["__metadata__"]["mirrored"] = json.dumps(m)
        return _with_header(h, body)

    corpus = {
        "empty": b"", "one byte": b"\x00", "size only": raw[:8], "zeros": bytes(4096),
        "pickle": b"\x80\x04\x95" + bytes(64), "zip": b"PK\x03\x04" + bytes(64), "text": b"hello world " * 20,
        "json array header": _with_header([1, 2], b""), "header is a string": _with_header("x", b""),  # type: ignore[arg-type]
        "size past the end": _with_header(header, body, size=len(raw)),
        "size 2**63": struct.pack("<Q", 1 << 63) + raw[8:],
        "size one short": _with_header(header, body, size=len(json.dumps(header)) - 1),
        "size one long": _with_header(header, body, size=len(json.dumps(header)) + 1),
        "not utf-8": struct.pack("<Q", 4) + b"{\xff\xfe}" + body,
        "deep JSON": (lambda t: struct.pack("<Q", len(t)) + t)(b"{\"a\":" + b"[" * 100_000 + b"]" * 100_000 + b"}"),
        "huge int in JSON": (lambda t: struct.pack("<Q", len(t)) + t)(b'{"a": ' + b"9" * 5000 + b"}"),
        "unknown dtype": entry(dtype="F128"), "dtype not a string": entry(dtype=4),
        "negative dim": entry(shape=[-1, 4]), "huge shape": entry(shape=[10**12, 10**12]),
        "shape not a list": entry(shape="8x4"), "too many dims": entry(shape=[1] * 100),
        "offsets reversed": entry(data_offsets=[64, 0]), "offsets past the end": entry(data_offsets=[0, 10**15]),
        "offsets not ints": entry(data_offsets=["0", "4"]), "extra entry field": entry(extra=1),
        "metadata not strings": (lambda h: _with_header(h, body))({**header, "__metadata__": {"mirrored": 5}}),
        "mirrored JSON broken": (lambda h: _with_header(h, body))(
            {**header, "__metadata__": {"mirrored": "{not json", "format": "pt"}}),
        "mirrored JSON a list": (lambda h: _with_header(h, body))(
            {**header, "__metadata__": {"mirrored": "[1]", "format": "pt"}}),
        "no mirrored metadata": (lambda h: _with_header(h, body))({**header, "__metadata__": {"format": "pt"}}),
        "format changed": with_meta(lambda m: m.update(format="keras")),
        "model_config a list": with_meta(lambda m: m.update(model_config=[1])),
        "replicas negative": with_meta(lambda m: m.update(replicas=-2)),
        "compile a string": with_meta(lambda m: m.update(compile="sgd")),
        "learning rate a string": with_meta(lambda m: m["compile"]["optimizer"].update(learning_rate="x")),
        "unknown optimizer argument": with_meta(lambda m: m["compile"]["optimizer"].update(warp=9)),
        "loss unknown": with_meta(lambda m: m["compile"].update(loss="no_such_loss")),
        "metrics not a list": with_meta(lambda m: m["compile"].update(metrics=7)),
        "precision bogus": with_meta(lambda m: m["compile"].update(precision="fp8")),
        "optimizer state a list": with_meta(lambda m: m["objects"]["model.optimizer"]["state"].update(state=[])),
        "optimizer index bogus": with_meta(lambda m: m["objects"]["model.optimizer"]["state"]["state"].update({"99": {}})),
        "optimizer tensor missing": with_meta(lambda m: m["objects"]["model.optimizer"]["state"]["state"]["0"].update(
            momentum_buffer={"__tensor__": "optimizer/nowhere"})),
        "optimizer group lost": with_meta(lambda m: m["objects"]["model.optimizer"]["state"].update(param_groups=[])),
        "optimizer params shortened": with_meta(lambda m: m["objects"]["model.optimizer"]["state"]["param_groups"][0].update(params=[0])),
        "optimizer lr negative": with_meta(lambda m: m["objects"]["model.optimizer"]["state"]["param_groups"][0].update(lr=-1.0)),
        "optimizer lr NaN": with_meta(lambda m: m["objects"]["model.optimizer"]["state"]["param_groups"][0].update(lr=float("nan"))),
    }
    for cut in (9, 20, len(raw) // 3, len(raw) // 2, len(raw) - 1):
        corpus[f"truncated at {cut}"] = raw[:cut]
    flipped = bytearray(raw)
    flipped[12] ^= 0xFF  # inside the JSON header
    corpus["flipped header byte"] = bytes(flipped)
    return corpus


# Which loaders must refuse a variant whose bytes are sound but whose mirrored metadata is not: the
# weights are still there for load_weights, and load_checkpoint reads any mirrored file.
LOADS = ("Model.load", "Model.load module=")
REFUSED_BY = {"format changed": LOADS, "model_config a list": ("Model.load",),
              **{name: (*LOADS, "load_checkpoint") for name in (
                  "no mirrored metadata", "mirrored JSON broken", "mirrored JSON a list")}}


def test_every_malformed_file_is_a_checkpoint_error_naming_the_file(tmp_path):
    """Issue 17: 15 of 48 malformed files failed with a raw TypeError/RuntimeError/KeyError that did
    not name the file. Every entry point that reads a checkpoint is tried on each."""
    model, good = _trained_file(tmp_path, name="good.safetensors", resnet=True)
    corpus = _malformed(good)
    assert len(corpus) >= 48
    entry_points = {
        "Model.load": lambda p: mr.Model.load(p),
        "Model.load module=": lambda p: mr.Model.load(p, module=copy.deepcopy(model.module)),
        "load_weights": lambda p: model.load_weights(p),
        "load_checkpoint": lambda p: checkpoint.load_checkpoint(p),
    }
    metadata_only = {name for name in corpus if name in REFUSED_BY or name.split()[0] in (
        "model_config", "replicas", "compile", "learning", "unknown", "loss", "metrics", "precision", "optimizer")}
    before = _snapshot(model)
    wrong = []
    for name, content in corpus.items():
        path = tmp_path / f"bad {name}.safetensors"
        path.write_bytes(content)
        refused_by = REFUSED_BY.get(name, LOADS) if name in metadata_only else tuple(entry_points)
        for entry, load in entry_points.items():
            try:
                load(str(path))
            except CheckpointError as e:
                if str(path) not in str(e):
                    wrong.append((name, entry, f"does not name the file: {e}"))
            except Exception as e:  # noqa: BLE001 - the point: nothing else may escape
                wrong.append((name, entry, f"{type(e).__name__}: {e}"))
            else:
                if entry in refused_by:
                    wrong.append((name, entry, "loaded"))
    assert not wrong, "\n".join(map(str, wrong))
    _assert_unchanged(model, before)


def test_the_good_file_still_loads_everywhere(tmp_path):
    model, good = _trained_file(tmp_path, resnet=True)
    loaded = mr.Model.load(good)
    for (name, want), got in zip(model.module.state_dict().items(), loaded.module.state_dict().values()):
        assert torch.equal(got, want), name
    assert torch.equal(loaded.mirrored_optimizer.state_dict()["state"][1]["momentum_buffer"],
                       model.mirrored_optimizer.state_dict()["state"][1]["momentum_buffer"])


# --------------------------------------------------------------------------------------------
# BackupAndRestore and ModelCheckpoint


def _backup_of(tmp_path, **kwargs) -> str:
    """The directory of a real backup: the mr.train.Checkpoint that BackupAndRestore writes after an epoch."""
    model = _model(**kwargs)
    backup = tmp_path / "backup"
    model.fit(_dataset(), epochs=1, verbose=0,
              callbacks=[mr.callbacks.BackupAndRestore(str(backup), delete_checkpoint=False)])
    return str(backup)


def _metric_values(model: mr.Model) -> list[torch.Tensor]:
    return [t.clone() for m in model.metrics for var in m.variables for t in var.values]


def test_a_backup_of_another_model_is_refused_and_leaves_the_model_as_it_was(tmp_path):
    backup = _backup_of(tmp_path)
    path = os.path.join(backup, "training_state.safetensors")
    other = _model(hidden=7, seed=5)
    other.fit(_dataset(), epochs=1, verbose=0)
    before, metrics = _snapshot(other), _metric_values(other)
    with pytest.raises(CheckpointError) as info:
        other.fit(_dataset(), epochs=2, verbose=0, callbacks=[mr.callbacks.BackupAndRestore(backup)])
    message = str(info.value)
    assert message.startswith(f"BackupAndRestore: cannot resume from {path!r}: tensor 'model/0.weight'")
    assert "(8, 4) in the file but (7, 4)" in message and "delete" in message
    _assert_unchanged(other, before)
    assert all(torch.equal(a, b) for a, b in zip(_metric_values(other), metrics, strict=True))
    assert os.path.exists(path)  # the user's backup stays for them to look at


# Each damage is to an entry after the model's weights (written first), so a restore entry by entry
# would have assigned those before it met the damage.
@pytest.mark.parametrize("damage, message", [
    ("momentum", r"tensor 'model\.optimizer/state/3/momentum_buffer' has shape \(7,\) in the file but model/2\.bias "
                 r"has shape \(3,\)"),
    ("step count", r"'model\.optimizer/keras'\['iterations'\] is 2\.5, not a step count"),
    ("rng", r"the RNG state 'rng' cannot be restored"),
    ("epoch", r"'fit\.epoch' is 'two', not a whole number"),
    ("data", r"the saved data position 'fit\.data\.dataset\.pipeline' is \['tensor_slices'\].*another input pipeline"),
    ("metric", r"tensor 'metrics\.1/0' has shape \(2,\) in the file but \(\) in metric 'accuracy'"),
    ("empty", r"only 0 bytes long"),
])
def test_a_damaged_backup_is_refused_before_anything_is_assigned(rewrite_checkpoint, tmp_path, damage, message):
    backup = _backup_of(tmp_path)
    path = os.path.join(backup, "training_state.safetensors")

    def entry(m, name):
        return m["objects"][name]

    edits = {
        "momentum": dict(tensors=lambda t: t.update({"model.optimizer/state/3/momentum_buffer": torch.zeros(7)})),
        "step count": dict(meta=lambda m: entry(m, "model.optimizer")["state"]["extra"]["keras"].update(
            iterations=2.5)),
        "rng": dict(meta=lambda m: entry(m, "rng")["rng"].update(python=[3, [1, 2, 3], None])),
        "epoch": dict(meta=lambda m: entry(m, "fit")["state"].update(epoch="two")),
        "data": dict(meta=lambda m: entry(m, "fit")["state"]["data"]["dataset"].update(pipeline=["tensor_slices"])),
        "metric": dict(tensors=lambda t: t.update({"metrics.1/0": torch.zeros(2)})),
    }
    if damage == "empty":
        open(path, "wb").close()
    else:
        rewrite_checkpoint(path, **edits[damage])
    model = _model(seed=3)
    data = _dataset()
    model.fit(data, epochs=1, verbose=0)
    before, metrics, data_state = _snapshot(model), _metric_values(model), data.get_state()
    rng_before = torch.get_rng_state()
    with pytest.raises(CheckpointError, match=message) as info:
        model.fit(data, epochs=2, verbose=0, callbacks=[mr.callbacks.BackupAndRestore(backup)])
    assert path in str(info.value)
    _assert_unchanged(model, before)
    assert all(torch.equal(a, b) for a, b in zip(_metric_values(model), metrics, strict=True))
    assert data.get_state() == data_state
    assert torch.equal(torch.get_rng_state(), rng_before)


def test_the_undamaged_backup_resumes(tmp_path):
    """The counterpart of the damaged ones: the same backup, untouched, restores the model that wrote it."""
    model = _model()
    backup = str(tmp_path / "backup")
    model.fit(_dataset(), epochs=1, verbose=0,
              callbacks=[mr.callbacks.BackupAndRestore(backup, delete_checkpoint=False)])
    want = _snapshot(model)
    resumed = _model(seed=3)
    resumed.fit(_dataset(), epochs=1, verbose=0,  # epoch 1 of 1 was done: the restore is all that happens
                callbacks=[mr.callbacks.BackupAndRestore(backup, delete_checkpoint=False)])
    _assert_unchanged(resumed, want)


def test_model_checkpoint_files_are_checked_like_any_other(rewrite_checkpoint, tmp_path):
    model = _model()
    pattern = str(tmp_path / "ckpt" / "e{epoch}.safetensors")
    model.fit(_dataset(), epochs=2, verbose=0, callbacks=[mr.callbacks.ModelCheckpoint(pattern)])
    first = pattern.format(epoch=1)
    assert mr.Model.load(first, module=copy.deepcopy(model.module)).module[0].weight.shape == (8, 4)
    rewrite_checkpoint(first, tensors=lambda t: t.update({"model/2.bias": torch.zeros(4)}))
    with pytest.raises(CheckpointError, match=r"e1\.safetensors'\): tensor 'model/2\.bias' has shape \(4,\) in the "
                                              r"file but \(3,\)"):
        mr.Model.load(first, module=copy.deepcopy(model.module))
    with open(pattern.format(epoch=2), "r+b") as f:
        f.truncate(100)
    with pytest.raises(CheckpointError, match=r"e2\.safetensors.*truncated or damaged"):
        model.load_weights(pattern.format(epoch=2))
