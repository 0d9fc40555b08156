"""Tests for mirrored.training.checkpoint: safetensors + JSON files, atomic writes, no pickle."""
from __future__ import annotations

import ast
import copy
import json
import os
import pickle
import random
import struct
import warnings
from pathlib import Path

import numpy as np
import pytest
import safetensors.torch
import torch
from torch import nn

from mirrored.training import checkpoint, checkpoint_checks
from mirrored.training.checkpoint import (
    CheckpointError, capture_rng_state, load_checkpoint, load_state_dict, optimizer_state_from_flat,
    optimizer_state_to_flat, restore_rng_state, save_checkpoint)


def _tiny_net(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))


def _train(net: nn.Module, opt: torch.optim.Optimizer, steps: int, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        x = torch.randn(16, 4, generator=gen)
        y = torch.randint(0, 3, (16,), generator=gen)
        opt.zero_grad()
        nn.functional.cross_entropy(net(x), y).backward()
        opt.step()


def _files(directory: Path) -> list[str]:
    return sorted(os.listdir(directory))


@pytest.fixture
def no_pickle(monkeypatch):
    """Makes every unpickling entry point raise, so a test fails if anything unpickles."""
    def forbidden(*args, **kwargs):
        raise AssertionError("unpickling was attempted")

    class ForbiddenUnpickler:
        def __init__(self, *args, **kwargs):
            forbidden()

    monkeypatch.setattr(pickle, "load", forbidden)
    monkeypatch.setattr(pickle, "loads", forbidden)
    monkeypatch.setattr(pickle, "Unpickler", ForbiddenUnpickler)
    monkeypatch.setattr(torch, "load", forbidden)
    monkeypatch.setattr(torch.serialization, "load", forbidden)
    monkeypatch.setattr(np, "load", forbidden)


# --------------------------------------------------------------------------------------------
# Files


def test_round_trip_keeps_values_dtypes_shapes_and_metadata(tmp_path):
    tensors = {
        "f32": torch.randn(3, 5), "f16": torch.randn(4).half(), "bf16": torch.randn(2, 2).bfloat16(),
        "i64": torch.arange(6).reshape(2, 3), "bool": torch.tensor([True, False]),
        "u8": torch.arange(5, dtype=torch.uint8), "scalar": torch.tensor(3.5), "empty": torch.zeros(0, 4),
    }
    meta = {"epoch": 3, "name": "run", "nested": {"lr": 0.1, "betas": [0.9, 0.999]}, "none": None}
    path = tmp_path / "ckpt.safetensors"
    save_checkpoint(path, tensors, meta)
    got, got_meta = load_checkpoint(path)
    assert got_meta == meta
    assert sorted(got) == sorted(tensors)
    for name, want in tensors.items():
        assert got[name].dtype == want.dtype and got[name].shape == want.shape, name
        assert torch.equal(got[name], want), name


def test_file_is_plain_safetensors_with_json_under_mirrored_key(tmp_path):
    path = tmp_path / "c.safetensors"
    save_checkpoint(path, {"w": torch.ones(2)}, {"k": [1, 2]})
    # Reference reader: the safetensors layout itself (uint64 header size, then JSON).
    raw = path.read_bytes()
    (size,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + size])
    assert json.loads(header["__metadata__"]["mirrored"]) == {"k": [1, 2]}
    assert header["w"]["dtype"] == "F32" and header["w"]["shape"] == [2]
    assert torch.equal(safetensors.torch.load_file(path)["w"], torch.ones(2))


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(torch.uint8)


def test_every_dtype_is_written_as_safetensors_writes_it_and_read_back_bitwise(tmp_path):
    """Issue 25: save_checkpoint writes the safetensors layout itself (streamed, through its own temporary
    file): safetensors' own reader loads it, and our reader loads safetensors' own files, bit for bit."""
    g = torch.Generator().manual_seed(0)
    raw = torch.randint(0, 256, (64,), dtype=torch.uint8, generator=g)
    dtypes = [torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, torch.float16,
              torch.bfloat16, torch.float32, torch.float64, torch.complex64, torch.float8_e4m3fn, torch.float8_e5m2]
    tensors = {f"t/{d}": (raw % 2 if d == torch.bool else raw).view(d).reshape(2, -1) for d in dtypes}
    tensors.update({"scalar": torch.tensor(2.5), "empty": torch.zeros(0, 3), "strided": torch.arange(12.0)[::3]})
    unsigned = {f"t/{d}": raw.view(d) for d in (torch.uint16, torch.uint32, torch.uint64)}  # (safetensors >= 0.5)
    save_checkpoint(tmp_path / "unsigned.safetensors", unsigned, {})
    got, _ = load_checkpoint(tmp_path / "unsigned.safetensors")
    assert all(got[k].dtype == v.dtype and torch.equal(_bits(got[k]), _bits(v)) for k, v in unsigned.items())
    save_checkpoint(tmp_path / "ours.safetensors", tensors, {"k": 1})
    safetensors.torch.save_file({k: v.clone() for k, v in tensors.items()}, tmp_path / "theirs.safetensors",
                                metadata={"mirrored": "{}"})
    by_safetensors = safetensors.torch.load_file(tmp_path / "ours.safetensors")
    ours, _ = load_checkpoint(tmp_path / "theirs.safetensors")
    for name, want in tensors.items():
        for got in (by_safetensors[name], ours[name]):
            assert got.dtype == want.dtype and got.shape == want.shape, name
            assert torch.equal(_bits(got), _bits(want.contiguous())), name
    assert (tmp_path / "ours.safetensors").read_bytes()[8:9] == b"{"


def test_views_transposes_and_shared_storage_are_saved_as_values(tmp_path):
    base = torch.arange(12.0)
    weight = torch.randn(3, 4)
    tensors = {"whole": base, "slice": base[2:6], "strided": base[::3], "w": weight, "w_t": weight.t(),
               "tied": weight}
    path = tmp_path / "c.safetensors"
    save_checkpoint(path, tensors, {})
    got, _ = load_checkpoint(path)
    for name, want in tensors.items():
        assert torch.equal(got[name], want), name
    got["tied"].add_(1)  # loaded tensors are independent of each other (and writable)
    assert torch.equal(got["w"], weight)


def test_loaded_tensors_do_not_depend_on_the_file(tmp_path):
    path = tmp_path / "c.safetensors"
    save_checkpoint(path, {"w": torch.arange(4.0)}, {})
    got, _ = load_checkpoint(path)
    save_checkpoint(path, {"w": torch.zeros(4)}, {})  # replaced under the loaded tensors
    os.remove(path)
    got["w"].mul_(2)
    assert torch.equal(got["w"], torch.arange(4.0) * 2)


def test_saving_creates_the_directory_and_overwrites(tmp_path):
    path = tmp_path / "a" / "b" / "c.safetensors"
    save_checkpoint(path, {"w": torch.ones(1)}, {"v": 1})
    save_checkpoint(str(path), {"w": torch.zeros(1)}, {"v": 2})
    got, meta = load_checkpoint(path)
    assert meta == {"v": 2} and torch.equal(got["w"], torch.zeros(1))
    assert _files(path.parent) == ["c.safetensors"]


def test_requires_grad_parameters_are_saved_detached(tmp_path):
    net = _tiny_net(0)
    save_checkpoint(tmp_path / "c", {f"model/{k}": v for k, v in net.named_parameters()}, {})
    got, _ = load_checkpoint(tmp_path / "c")
    assert not any(t.requires_grad for t in got.values())


# --------------------------------------------------------------------------------------------
# Atomicity


def _existing(tmp_path: Path) -> Path:
    path = tmp_path / "ckpt.safetensors"
    save_checkpoint(path, {"w": torch.arange(3.0)}, {"version": 1})
    return path


def _assert_old_intact(path: Path) -> None:
    got, meta = load_checkpoint(path)
    assert meta == {"version": 1} and torch.equal(got["w"], torch.arange(3.0))
    assert _files(path.parent) == [path.name], "a temporary file was left behind"


def test_failure_mid_write_leaves_old_checkpoint_and_no_temp_file(tmp_path, monkeypatch):
    path = _existing(tmp_path)
    real_write = os.write

    def crash_mid_write(fd, data):
        real_write(fd, bytes(data)[:len(data) // 2])  # half the file, then the "disk" fails
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "write", crash_mid_write)
    with pytest.raises(OSError, match="No space left"):
        save_checkpoint(path, {"w": torch.zeros(1000)}, {"version": 2})
    monkeypatch.undo()
    _assert_old_intact(path)


@pytest.mark.parametrize("failing", ["fsync", "replace"])
def test_failure_in_fsync_or_rename_leaves_old_checkpoint(tmp_path, monkeypatch, failing):
    path = _existing(tmp_path)

    def fail(*args, **kwargs):
        raise OSError(5, f"injected {failing} failure")

    monkeypatch.setattr(os, failing, fail)
    with pytest.raises(OSError, match=f"injected {failing}"):
        save_checkpoint(path, {"w": torch.zeros(2)}, {"version": 2})
    monkeypatch.undo()
    _assert_old_intact(path)


def test_keyboard_interrupt_mid_write_also_cleans_up(tmp_path, monkeypatch):
    path = _existing(tmp_path)

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(os, "write", interrupted)
    with pytest.raises(KeyboardInterrupt):
        save_checkpoint(path, {"w": torch.zeros(2)}, {"version": 2})
    monkeypatch.undo()
    _assert_old_intact(path)


def test_bad_arguments_raise_before_touching_the_file(tmp_path):
    path = _existing(tmp_path)
    with pytest.raises(TypeError, match=r"not JSON-serializable"):
        save_checkpoint(path, {"w": torch.zeros(2)}, {"bad": object()})
    with pytest.raises(TypeError, match=r"tensors\['lr'\] is a float"):
        save_checkpoint(path, {"lr": 0.1}, {})
    with pytest.raises(TypeError, match="names must be str"):
        save_checkpoint(path, {0: torch.zeros(1)}, {})
    _assert_old_intact(path)


def test_file_is_renamed_into_place_with_fsync(tmp_path, monkeypatch):
    calls = []
    real_fsync, real_replace = os.fsync, os.replace
    monkeypatch.setattr(os, "fsync", lambda fd: (calls.append("fsync"), real_fsync(fd))[1])
    monkeypatch.setattr(os, "replace", lambda a, b: (calls.append(("replace", os.path.dirname(a))),
                                                     real_replace(a, b))[1])
    save_checkpoint(tmp_path / "c.safetensors", {"w": torch.ones(1)}, {})
    # data fsynced, then renamed from the same directory, then the directory fsynced
    assert calls == ["fsync", ("replace", str(tmp_path)), "fsync"]


# --------------------------------------------------------------------------------------------
# Loading errors and no pickle


def test_missing_file_names_the_path(tmp_path):
    path = tmp_path / "nope.safetensors"
    with pytest.raises(FileNotFoundError, match="nope.safetensors.*no such file"):
        load_checkpoint(path)


def test_a_directory_is_refused_with_a_hint(tmp_path):
    with pytest.raises(IsADirectoryError, match="directory"):
        load_checkpoint(tmp_path)


def test_torch_save_file_is_refused_without_unpickling(tmp_path, no_pickle):
    path = tmp_path / "model.pt"
    with open(path, "wb") as f:
        pickle.dump({"w": 1}, f)  # dump is allowed; loads are what the fixture forbids
    with pytest.raises(ValueError, match=r"model\.pt.*pickle.*never loads"):
        load_checkpoint(path)
    zip_path = tmp_path / "model_zip.pt"
    zip_path.write_bytes(b"PK\x03\x04" + b"\0" * 64)  # torch.save's zip format starts so
    with pytest.raises(ValueError, match=r"model_zip\.pt.*torch\.save"):
        load_state_dict(zip_path)


def test_header_size_starting_with_a_pickle_byte_is_still_safetensors(tmp_path):
    # Regression: the header size's first byte may be 0x80, the first byte of a pickle.
    path = tmp_path / "c.safetensors"
    for pad in range(300):
        save_checkpoint(path, {"w": torch.ones(1)}, {"pad": "x" * pad})
        if path.read_bytes()[0] == 0x80:
            break
    else:
        pytest.fail("no padding gave a header size whose low byte is 0x80")
    assert load_checkpoint(path)[1] == {"pad": "x" * pad}


@pytest.mark.parametrize("content", [b"", b"hello", b"{\"not\": \"safetensors\"}" * 4])
def test_non_safetensors_files_are_refused(tmp_path, content):
    path = tmp_path / "x.bin"
    path.write_bytes(content)
    with pytest.raises(ValueError, match=r"x\.bin.*not a safetensors checkpoint"):
        load_checkpoint(path)


def test_truncated_checkpoint_is_refused(tmp_path):
    path = tmp_path / "c.safetensors"
    save_checkpoint(path, {"w": torch.zeros(100)}, {})
    data = path.read_bytes()
    path.write_bytes(data[:len(data) - 50])
    with pytest.raises(ValueError, match=r"c\.safetensors"):
        load_checkpoint(path)
    path.write_bytes(data[:40])  # cut inside the header: a damaged checkpoint, not a foreign file
    with pytest.raises(ValueError, match=r"c\.safetensors.*truncated or damaged: its safetensors header claims"):
        load_checkpoint(path)


def test_a_file_that_shrinks_during_the_load_is_refused_not_a_crash(tmp_path, monkeypatch):
    """Issue 25: the tensors are read, not mapped, so a file cut after its header was checked is an error
    naming it (a mapped tensor was a SIGBUS when touched)."""
    path = tmp_path / "c.safetensors"
    save_checkpoint(path, {"a": torch.zeros(100), "b": torch.ones(100)}, {})
    real_read_header = checkpoint._read_header

    def then_cut(fd, *args):
        checked = real_read_header(fd, *args)
        os.truncate(path, checked[2] + 500)  # a rewrite in place begins: "b" is gone
        return checked

    monkeypatch.setattr(checkpoint, "_read_header", then_cut)
    with pytest.raises(CheckpointError, match=r"c\.safetensors.*ended at data byte .* while tensor 'b'.*truncated"):
        load_checkpoint(path)


def test_a_shape_whose_product_overflows_is_refused_in_the_header(tmp_path):
    """A zero dimension makes [0, 2**62, 4] zero bytes; its other dimensions still overflow a tensor's size."""
    path = tmp_path / "c.safetensors"
    header = json.dumps({"__metadata__": {"mirrored": "{}"},
                         "w": {"dtype": "F32", "shape": [0, 1 << 62, 4], "data_offsets": [0, 0]}}).encode()
    path.write_bytes(struct.pack("<Q", len(header)) + header)
    with pytest.raises(CheckpointError, match=r"c\.safetensors.*'w' the shape \[0, 4611686018427387904, 4\]"):
        load_checkpoint(path)


def test_loaded_tensors_are_read_not_mapped(tmp_path):
    """Issue 25: no tensor is a view of a memory map of the file (tests/reliability/test_loaded_tensors_unmapped.py
    shows what a mapped one does)."""
    path = tmp_path / "c.safetensors"
    save_checkpoint(path, {"w": torch.arange(1 << 16, dtype=torch.float64), "n": torch.tensor(3)}, {})
    got, _ = load_checkpoint(path)
    if os.path.exists("/proc/self/maps"):
        assert str(path) not in Path("/proc/self/maps").read_text()
    assert torch.equal(got["w"], torch.arange(1 << 16, dtype=torch.float64)) and got["n"].item() == 3


def test_foreign_safetensors_file_needs_load_state_dict(tmp_path):
    path = tmp_path / "hub.safetensors"
    safetensors.torch.save_file({"weight": torch.ones(2)}, str(path))
    with pytest.raises(ValueError, match=r"hub\.safetensors.*without mirrored's metadata.*prefix=\"\""):
        load_checkpoint(path)
    assert torch.equal(load_state_dict(path, prefix="")["weight"], torch.ones(2))


def test_no_pickle_in_any_round_trip(tmp_path, no_pickle):
    """Weights, optimizer state and RNG states go through a file and back with every unpickling entry
    point made to raise, and come back equal: the reference is the objects saved."""
    net = _tiny_net(0)
    opt = torch.optim.Adam(net.parameters())
    _train(net, opt, 2, seed=1)
    opt_tensors, opt_meta = optimizer_state_to_flat(opt.state_dict())
    rng_tensors, rng_meta = capture_rng_state()
    next_draws = torch.rand(4), random.random(), np.random.rand()  # what the saved states draw next
    tensors = {**{f"model/{k}": v for k, v in net.state_dict().items()}, **opt_tensors,
               **{f"rng/{k}": v for k, v in rng_tensors.items()}}
    save_checkpoint(tmp_path / "c.safetensors", tensors, {"optimizer": opt_meta, "rng": rng_meta})
    got, meta = load_checkpoint(tmp_path / "c.safetensors")
    state = optimizer_state_from_flat(got, meta["optimizer"])
    want = opt.state_dict()
    assert state["param_groups"] == want["param_groups"] and state["state"].keys() == want["state"].keys()
    for index, entry in want["state"].items():
        assert all(torch.equal(state["state"][index][k], v) for k, v in entry.items())
    restore_rng_state({k[4:]: v for k, v in got.items() if k.startswith("rng/")}, meta["rng"])
    again = torch.rand(4), random.random(), np.random.rand()
    assert torch.equal(again[0], next_draws[0]) and again[1:] == next_draws[1:]
    weights = load_state_dict(tmp_path / "c.safetensors")
    assert weights.keys() == net.state_dict().keys()
    assert all(torch.equal(weights[k], v) for k, v in net.state_dict().items())


def test_module_never_imports_pickle_or_calls_torch_load():
    tree = ast.parse(Path(checkpoint.__file__).read_text())
    modules = {alias.name for node in ast.walk(tree) if isinstance(node, (ast.Import, ast.ImportFrom))
               for alias in (node.names if isinstance(node, ast.Import) else [ast.alias(node.module or "")])}
    # of the package, only the stdlib-only helpers that word a failed write
    assert {m for m in modules if m.split(".")[0] == "mirrored"} <= {"mirrored._files"}, modules
    imported = {m.split(".")[0] for m in modules} - {"mirrored"}
    assert imported <= {"__future__", "hashlib", "json", "logging", "math", "os", "random", "re", "socket", "stat",
                        "struct", "time", "uuid", "warnings", "collections", "typing", "numpy",
                        "safetensors", "torch"}, imported
    loads = [node.func.attr for node in ast.walk(tree) if isinstance(node, ast.Call)
             and isinstance(node.func, ast.Attribute) and node.func.attr in ("load", "loads")
             and not (isinstance(node.func.value, ast.Name) and node.func.value.id == "json")]
    assert loads == []


# --------------------------------------------------------------------------------------------
# load_state_dict


def test_load_state_dict_gives_model_weights_for_a_plain_module(tmp_path):
    net = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4))
    net(torch.randn(8, 3))  # moves the BatchNorm running stats off their initial values
    tensors = {f"model/{k}": v for k, v in net.state_dict().items()}
    tensors["optimizer/state/0/momentum_buffer"] = torch.ones(4, 3)
    save_checkpoint(tmp_path / "m.safetensors", tensors, {"format": 1})
    fresh = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4))
    fresh.load_state_dict(load_state_dict(tmp_path / "m.safetensors"))  # strict: exact key set
    for (name, want), got in zip(net.state_dict().items(), fresh.state_dict().values()):
        assert torch.equal(got, want), name


def test_load_state_dict_with_wrong_prefix_lists_the_names(tmp_path):
    save_checkpoint(tmp_path / "m", {"net/w": torch.ones(1)}, {})
    with pytest.raises(ValueError, match=r"no tensor name starts with 'model/' \(names: net/w\)"):
        load_state_dict(tmp_path / "m")


# --------------------------------------------------------------------------------------------
# Optimizer state


OPTIMIZERS = {
    "sgd_momentum": lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, nesterov=True, weight_decay=1e-4),
    "adam": lambda p: torch.optim.Adam(p, lr=1e-2, betas=(0.8, 0.99)),
    "adam_amsgrad": lambda p: torch.optim.Adam(p, lr=1e-2, amsgrad=True),
    "adamw": lambda p: torch.optim.AdamW(p, lr=1e-2, weight_decay=0.05),
    "rmsprop": lambda p: torch.optim.RMSprop(p, lr=1e-3, momentum=0.5, centered=True),
}


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_optimizer_continues_bitwise_after_save_and_load(tmp_path, name):
    make = OPTIMIZERS[name]
    net = _tiny_net(0)
    opt = make(net.parameters())
    _train(net, opt, 3, seed=1)
    # Reference: the same run, never saved, continued for 3 more steps.
    ref_net = copy.deepcopy(net)
    ref_opt = make(ref_net.parameters())
    ref_opt.load_state_dict(copy.deepcopy(opt.state_dict()))
    _train(ref_net, ref_opt, 3, seed=2)

    opt_tensors, opt_meta = optimizer_state_to_flat(opt.state_dict())
    tensors = {**{f"model/{k}": v for k, v in net.state_dict().items()}, **opt_tensors}
    save_checkpoint(tmp_path / "c.safetensors", tensors, {"optimizer": opt_meta})
    del net, opt
    got, meta = load_checkpoint(tmp_path / "c.safetensors")
    net2 = _tiny_net(123)  # other initial weights: everything must come from the file
    net2.load_state_dict(load_state_dict(tmp_path / "c.safetensors"))
    opt2 = make(net2.parameters())
    opt2.load_state_dict(optimizer_state_from_flat(got, meta["optimizer"]))
    _train(net2, opt2, 3, seed=2)

    for (pname, want), have in zip(ref_net.named_parameters(), net2.parameters()):
        assert torch.equal(have, want), pname
    ref_state, state = ref_opt.state_dict(), opt2.state_dict()
    assert state["param_groups"] == ref_state["param_groups"]
    for index, param_state in ref_state["state"].items():
        for key, want in param_state.items():
            have = state["state"][index][key]
            if isinstance(want, torch.Tensor):
                assert have.dtype == want.dtype and torch.equal(have, want), (index, key)
            else:
                assert have == want, (index, key)


def test_flat_keys_and_json_layout():
    net = _tiny_net(0)
    opt = torch.optim.Adam(net.parameters(), betas=(0.8, 0.99))
    _train(net, opt, 1, seed=1)
    tensors, meta = optimizer_state_to_flat(opt.state_dict())
    assert {"optimizer/state/0/exp_avg", "optimizer/state/0/exp_avg_sq", "optimizer/state/0/step",
            "optimizer/state/3/exp_avg"} <= set(tensors)
    assert tensors["optimizer/state/0/step"].ndim == 0  # Adam's step is a tensor
    assert json.loads(json.dumps(meta)) == meta  # plain JSON
    assert meta["param_groups"][0]["params"] == [0, 1, 2, 3]
    state = optimizer_state_from_flat(tensors, meta)
    assert state["param_groups"][0]["betas"] == (0.8, 0.99)
    assert isinstance(state["param_groups"][0]["betas"], tuple)
    assert list(state["state"]) == [0, 1, 2, 3]


def test_nested_and_non_tensor_state_values_round_trip():
    state_dict = {
        "state": {0: {"step": 7, "d": torch.ones(2), "old_dirs": [torch.zeros(2), torch.full((2,), 2.0)],
                      "ro": None, "func_evals": 3.5, "cfg": {"a": (1, torch.ones(1))}},
                  2: {"momentum_buffer": None}},
        "param_groups": [{"lr": torch.tensor(0.01), "params": [0, 1, 2], "betas": (0.9, 0.999),
                          "line_search_fn": "strong_wolfe", "foreach": None}],
    }
    tensors, meta = optimizer_state_to_flat(state_dict)
    assert "optimizer/state/0/old_dirs/1" in tensors and "optimizer/param_groups/0/lr" in tensors
    back = optimizer_state_from_flat(tensors, json.loads(json.dumps(meta)))
    assert back["state"][0]["step"] == 7 and back["state"][0]["ro"] is None
    assert back["state"][2] == {"momentum_buffer": None}
    assert torch.equal(back["state"][0]["old_dirs"][1], torch.full((2,), 2.0))
    assert back["state"][0]["cfg"]["a"][0] == 1 and isinstance(back["state"][0]["cfg"]["a"], tuple)
    assert torch.equal(back["param_groups"][0]["lr"], torch.tensor(0.01))
    assert back["param_groups"][0]["line_search_fn"] == "strong_wolfe"


def test_unstorable_optimizer_values_are_named():
    with pytest.raises(TypeError, match=r"optimizer/state/0/fn is a function"):
        optimizer_state_to_flat({"state": {0: {"fn": lambda: 0}}, "param_groups": []})
    with pytest.raises(TypeError, match="optimizer.state_dict"):
        optimizer_state_to_flat({"weight": torch.ones(1)})
    with pytest.raises(ValueError, match=r"'optimizer/state/0/exp_avg'.*does not hold"):
        optimizer_state_from_flat({}, {"state": {"0": {"exp_avg": {"__tensor__": "optimizer/state/0/exp_avg"}}},
                                       "param_groups": []})


def test_dicts_with_number_and_tuple_keys_and_counters_round_trip_through_json():
    """MultiStepLR keeps its milestones in a Counter: it comes back a Counter with the same counts (issue 25's
    one decoder first counted the [key, value] pairs themselves)."""
    import collections

    group = {"params": [0], "milestones": collections.Counter({3: 1, 5: 2}), "by_key": {(1, "a"): 0.5, 2.5: None}}
    tensors, meta = optimizer_state_to_flat({"state": {}, "param_groups": [group]})
    back = optimizer_state_from_flat(tensors, json.loads(json.dumps(meta)))["param_groups"][0]
    assert type(back["milestones"]) is collections.Counter and back["milestones"] == group["milestones"]
    assert back["by_key"] == group["by_key"]


# Forged values of the tag format, each with what the one decoder says about it.
FORGED_VALUES = [
    ({"__tuple__": 3}, "is a tuple that holds no list"),
    ({"__items__": [[1]]}, "is a dict that holds no list of \\[key, value\\] pairs"),
    ({"__items__": [[{"__tuple__": [[1]]}, 2]]}, "has a key that is not a number"),  # unhashable: was a TypeError
    ({"__counter__": [[{"__tensor__": "w"}, 2]]}, "has a key that is not a number"),
    ({"__tensor__": 5}, "refers to tensor 5, which the file does not hold"),
    (json.loads("[" * 40 + "]" * 40), "is nested more than 32 levels deep"),
]


@pytest.mark.parametrize("value, problem", FORGED_VALUES)
def test_one_decoder_refuses_a_forged_value_for_the_plain_and_the_checked_load(value, problem):
    """Issue 25: optimizer_state_from_flat and the loading checks (checkpoint_checks) decode the format with one
    decoder, so they refuse the same values: a difference between two decoders would let a damaged file in."""
    meta = {"state": {}, "param_groups": [{"params": [0], "lr": 0.1, "momentum": value}]}
    tensors = {"w": torch.zeros(1)}
    with pytest.raises(ValueError, match=f"optimizer_state_from_flat: param_groups\\[0\\] {problem}"):
        optimizer_state_from_flat(tensors, meta)
    optimizer = torch.optim.SGD([nn.Parameter(torch.zeros(2))], lr=0.1)
    origin = checkpoint_checks.Origin("Model.load('f.safetensors')")
    where = r"Model.load\('f.safetensors'\): optimizer param_groups\[0\]\['momentum'\] "
    with pytest.raises(CheckpointError, match=where + problem + ".*damaged"):
        checkpoint_checks.optimizer_state(origin, tensors, meta, optimizer)


# --------------------------------------------------------------------------------------------
# RNG state


def _draws() -> tuple:
    return (torch.rand(5), torch.randn(3), random.random(), random.gauss(0, 1),
            np.random.rand(4), np.random.standard_normal())


def _assert_same_draws(a: tuple, b: tuple) -> None:
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    assert a[2] == b[2] and a[3] == b[3]
    np.testing.assert_array_equal(a[4], b[4])
    assert a[5] == b[5]


def test_rng_state_round_trips_through_a_checkpoint(tmp_path):
    torch.manual_seed(5)
    random.seed(5)
    np.random.seed(5)
    random.gauss(0, 1)  # leaves a cached second normal (gauss_next) in the state
    np.random.standard_normal(3)  # leaves numpy's cached gaussian
    tensors, meta = capture_rng_state()
    assert tensors["torch_cpu"].dtype == torch.uint8
    first = _draws()
    save_checkpoint(tmp_path / "rng.safetensors", tensors, {"rng": meta})
    _draws()  # move every generator on
    got, got_meta = load_checkpoint(tmp_path / "rng.safetensors")
    restore_rng_state(got, got_meta["rng"])
    _assert_same_draws(first, _draws())


def test_restore_rng_state_names_what_is_missing():
    tensors, meta = capture_rng_state()
    with pytest.raises(ValueError, match="missing numpy"):
        restore_rng_state(tensors, {"python": meta["python"]})
    with pytest.raises(ValueError, match="missing tensor torch_cpu"):
        restore_rng_state({}, meta)


@pytest.mark.cuda
def test_cuda_rng_state_round_trips():
    torch.cuda.manual_seed_all(3)
    tensors, meta = capture_rng_state()
    assert meta["cuda_devices"] == torch.cuda.device_count()
    first = torch.rand(4, device="cuda")
    torch.rand(4, device="cuda")
    restore_rng_state(tensors, meta)
    assert torch.equal(first, torch.rand(4, device="cuda"))


@pytest.mark.cuda
def test_cuda_tensors_are_saved_from_and_loaded_to_the_device(tmp_path):
    weight = torch.randn(3, 4, device="cuda")
    save_checkpoint(tmp_path / "c", {"w": weight, "w_t": weight.t()}, {})
    got, _ = load_checkpoint(tmp_path / "c", device="cuda:0")
    assert got["w"].device.type == "cuda" and torch.equal(got["w"], weight)
    assert torch.equal(got["w_t"], weight.t())
    on_cpu, _ = load_checkpoint(tmp_path / "c")
    assert on_cpu["w"].device.type == "cpu" and torch.equal(on_cpu["w"], weight.cpu())


@pytest.mark.cuda
def test_a_model_trained_on_cuda_loads_and_predicts_on_the_cpu(tmp_path):
    """A Model fitted and saved on cuda:0 (with a BatchNorm) is read back outside any strategy, on the
    CPU: the same weights bitwise, and predictions within float32 kernel differences."""
    import mirrored as mr

    torch.manual_seed(0)
    x, y = torch.randn(32, 6), torch.randint(0, 3, (32,))

    def net() -> nn.Module:
        return nn.Sequential(nn.Linear(6, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 3))

    with mr.MirroredStrategy(devices=["cuda:0"]).scope():
        model = mr.Model(net())
        model.compile(optimizer=mr.optimizers.SGD(learning_rate=0.1, momentum=0.9),
                      loss="sparse_categorical_crossentropy")
    model.fit(mr.data.Dataset.from_tensor_slices((x, y)).batch(8), epochs=1, verbose=0)
    assert next(model.module.parameters()).device.type == "cuda"
    model.save(tmp_path / "model.safetensors")
    loaded = mr.Model.load(tmp_path / "model.safetensors", module=net())
    assert {p.device.type for p in loaded.module.parameters()} == {"cpu"}
    for a, b in zip(model.get_weights(), loaded.get_weights()):
        np.testing.assert_array_equal(a, b)
    # fp32 on both devices (torch keeps TF32 off for matmuls by default): kernels differ in the last bits.
    np.testing.assert_allclose(np.asarray(loaded.predict(x, batch_size=8)), np.asarray(model.predict(x, batch_size=8)),
                               rtol=1e-4, atol=1e-4)


def test_checkpoint_files_get_the_usual_permissions(tmp_path):
    """safetensors creates its files 0600; a checkpoint gets what a new file gets under the umask, and a
    replaced one keeps its permissions (review finding: always 0600, a surprise for shared setups)."""
    path = tmp_path / "c.safetensors"
    old_umask = os.umask(0o022)
    try:
        save_checkpoint(path, {"w": torch.zeros(2)}, {})
        assert path.stat().st_mode & 0o777 == 0o644
        os.chmod(path, 0o640)
        save_checkpoint(path, {"w": torch.ones(2)}, {})
        assert path.stat().st_mode & 0o777 == 0o640
    finally:
        os.umask(old_umask)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.safetensors"]


@pytest.mark.parametrize("name, fmt", [("model.h5", "HDF5"), ("m.weights.h5", "HDF5"), ("model.keras", "Keras zip"),
                                       ("model.pt", "torch.save"), ("model.PTH", "torch.save")])
def test_a_suffix_of_another_format_warns_once_and_the_file_is_safetensors(tmp_path, name, fmt):
    """Keras code saves to model.h5 / model.keras and torch code to model.pt; the file is written (the
    port keeps working) but the name would send h5py, keras or torch.load to a file they cannot read."""
    path = tmp_path / name
    stem = str(path)[: -len(path.suffix)]
    with pytest.warns(UserWarning, match=rf"safetensors \+ JSON, not {fmt}.*{stem.split('/')[-1]}\.safetensors"):
        save_checkpoint(path, {"w": torch.ones(2)}, {"k": 1})
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once per path: a ModelCheckpoint saving every epoch warns once
        save_checkpoint(path, {"w": torch.zeros(2)}, {"k": 2})
    tensors, meta = load_checkpoint(path)
    assert torch.equal(tensors["w"], torch.zeros(2)) and meta == {"k": 2}
    assert path.read_bytes()[8:9] == b"{"  # a safetensors header, whatever the suffix
