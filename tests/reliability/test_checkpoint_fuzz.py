"""Issue 17: random mutations of a valid checkpoint's header (the safetensors JSON, the mirrored
metadata inside it, the length prefix) always end in a CheckpointError naming the file, or in a
model that loads and trains: never another exception, never a hang, never a large allocation.
(The TFRecord reader has the same kind of test in tests/data/test_tfrecord.py.)"""
from __future__ import annotations

import copy
import json
import struct
import tracemalloc

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import mirrored as mr
from mirrored.training.checkpoint import CheckpointError

# Any JSON value: what a damaged or forged header may hold where a field should be.
JSON = st.recursive(
    st.none() | st.booleans() | st.integers(min_value=-(1 << 70), max_value=1 << 70)
    | st.floats(allow_nan=True, allow_infinity=True) | st.text(max_size=12),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=8)
PYTHON_PEAK_BYTES = 32 << 20  # the header is ~10 kB: parsing and checking it needs far less than this
RSS_GROWTH_BYTES = 256 << 20  # the whole file is ~60 kB: no tensor may be allocated beyond its bytes


@pytest.fixture(scope="module")
def valid_file(tmp_path_factory):
    """A trained smallest CIFAR ResNet (2 replicas, SGD with momentum), saved by Model.save."""
    torch.manual_seed(0)
    strategy = mr.MirroredStrategy(devices=["cpu:0", "cpu:1"])
    with strategy.scope():
        model = mr.Model(mr.models.resnet_cifar(depth=8, width=4, num_classes=3))
        model.compile(optimizer=mr.optimizers.SGD(learning_rate=0.1, momentum=0.9),
                      loss="sparse_categorical_crossentropy", metrics=["accuracy"])
    model.fit(_dataset(), epochs=1, verbose=0)
    path = tmp_path_factory.mktemp("fuzz") / "valid.safetensors"
    model.save(path)
    raw = path.read_bytes()
    size = struct.unpack("<Q", raw[:8])[0]
    return json.loads(raw[8:8 + size]), raw[8 + size:]


def _dataset() -> mr.data.Dataset:
    g = torch.Generator().manual_seed(1)
    x, y = torch.rand(8, 8, 8, 3, generator=g), torch.randint(0, 3, (8,), generator=g)
    return mr.data.Dataset.from_tensor_slices((x, y)).batch(8)


def _mutate(data: st.DataObject, value, depth: int = 0):
    """`value` with one part replaced by any JSON value (or a dict key deleted), at a random depth."""
    if isinstance(value, (dict, list)) and value and depth < 8 and data.draw(st.integers(0, 3)):
        value = copy.copy(value)
        key = data.draw(st.sampled_from(sorted(value) if isinstance(value, dict) else range(len(value))))
        if isinstance(value, dict) and data.draw(st.integers(0, 5)) == 0:
            del value[key]
        else:
            value[key] = _mutate(data, value[key], depth + 1)
        return value
    return data.draw(JSON)


def _rss_peak_reset() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:  # "5" resets the peak RSS (VmHWM), Linux >= 4.0
            f.write("5")
        return True
    except OSError:
        return False


def _rss_peak() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                  HealthCheck.too_slow])
@given(data=st.data())
def test_mutated_headers_are_refused_naming_the_file_or_load_and_train(valid_file, tmp_path, data):
    header, body = valid_file
    target = data.draw(st.sampled_from(["tensors", "metadata", "length"]))
    header = copy.deepcopy(header)
    if target == "tensors":
        header = _mutate(data, header)
    elif target == "metadata":
        header["__metadata__"]["mirrored"] = json.dumps(
            _mutate(data, json.loads(header["__metadata__"]["mirrored"])))
    text = json.dumps(header).encode()
    length = len(text)
    if target == "length":
        length = data.draw(st.integers(0, (1 << 64) - 1) | st.integers(-64, 64).map(lambda d: max(0, len(text) + d)))
    path = tmp_path / "mutated.safetensors"
    path.write_bytes(struct.pack("<Q", length) + text + body)

    reset = _rss_peak_reset()
    start_rss = _rss_peak()
    tracemalloc.start()
    try:
        try:
            model = mr.Model.load(path)
        except CheckpointError as e:
            assert str(path) in str(e)
            model = None
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < PYTHON_PEAK_BYTES
    if reset:
        assert _rss_peak() - start_rss < RSS_GROWTH_BYTES
    if model is not None:  # a harmless mutation (a value changed to one of its own kind): it must work
        if model.mirrored_optimizer is not None:
            model.fit(_dataset(), epochs=1, verbose=0)
        assert model.predict(_dataset(), verbose=0).shape == (8, 3)
