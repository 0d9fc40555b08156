"""devices.py: parsing device spellings, validating device lists, splitting cores between replicas."""
from __future__ import annotations

import os

import pytest
import torch

import mirrored.distribute as md
from mirrored.distribute import devices

NO_GPU = not torch.cuda.is_available()


SPELLINGS = [
    ("cpu:0", "cpu:0"),
    ("cpu", "cpu:0"),
    ("CPU:3", "cpu:3"),
    ("/cpu:1", "cpu:1"),
    ("/device:CPU:1", "cpu:1"),
    ("/job:localhost/replica:0/task:0/device:CPU:1", "cpu:1"),
    ("/gpu:0", "cuda:0"),
    ("GPU", "cuda:0"),
    ("/job:worker/replica:0/task:1/device:GPU:2", "cuda:2"),
    ("cuda:1", "cuda:1"),
    (" cuda:1 ", "cuda:1"),
    (torch.device("cpu"), "cpu:0"),
    (torch.device("cuda", 1), "cuda:1"),
]


def test_canonical_spellings():
    """Ours, TF's (fully qualified too) and torch.device spellings all become "cpu:N" / "cuda:N"."""
    for spelling, want in SPELLINGS:
        assert devices.canonical(spelling) == want, spelling


def test_canonical_rejects_unknown_kinds_naming_input():
    for bad in ["cuda1", "tpu:0", "/device:TPU:0", "mps", "cpu:-1", "cpu:x", ""]:
        with pytest.raises(ValueError) as info:
            devices.canonical(bad, where="here")
        msg = str(info.value)
        assert msg.startswith("here: cannot parse device") and repr(bad) in msg and '"cpu:N" or "cuda:N"' in msg


def test_canonical_rejects_non_strings():
    with pytest.raises(TypeError, match="must be a string"):
        devices.canonical(0)


@pytest.mark.skipif(not NO_GPU, reason="checks the error on a CPU-only machine")
def test_gpu_on_cpu_only_box_names_visible_devices():
    for spelling in ("/gpu:0", "cuda:0", "GPU"):
        with pytest.raises(ValueError) as info:
            md.MirroredStrategy(devices=[spelling])
        msg = str(info.value)
        assert "cuda:0 is not a visible GPU (visible: none)" in msg
        assert 'logical CPU replicas ("cpu:0", "cpu:1")' in msg and spelling in msg


def test_unparsable_device_in_strategy_names_the_list():
    with pytest.raises(ValueError) as info:
        md.MirroredStrategy(devices=["cpu:0", "cpu1"])
    msg = str(info.value)
    assert "MirroredStrategy(devices=['cpu:0', 'cpu1'])" in msg and "cannot parse device 'cpu1'" in msg


def test_duplicates_rejected_even_across_spellings():
    with pytest.raises(ValueError) as info:
        md.MirroredStrategy(devices=["cpu:0", "/job:localhost/replica:0/task:0/device:CPU:0"])
    msg = str(info.value)
    assert "'cpu:0' is listed twice (positions 0 and 1)" in msg and '"cpu:0", "cpu:1"' in msg


def test_empty_device_list_rejected():
    with pytest.raises(ValueError, match="names no device"):
        md.MirroredStrategy(devices=[])


def test_tf_spelling_resolves_to_canonical_devices():
    s = md.MirroredStrategy(devices=["/job:localhost/replica:0/task:0/device:CPU:1", "/cpu:0"])
    assert s.extended.worker_devices == ("cpu:1", "cpu:0")
    assert md.OneDeviceStrategy("/device:CPU:0").extended.worker_devices == ("cpu:0",)


def test_a_single_string_is_one_device():
    assert devices.resolve_devices("cpu:2") == ("cpu:2",)


@pytest.mark.skipif(not NO_GPU, reason="default devices on a CPU-only machine")
def test_default_devices_without_gpu_is_one_cpu():
    assert devices.resolve_devices(None) == ("cpu:0",)
    assert md.MirroredStrategy().num_replicas_in_sync == 1


def test_torch_device_maps_every_cpu_replica_to_the_cpu():
    assert devices.torch_device("cpu:3") == torch.device("cpu")
    assert devices.torch_device("cuda:1") == torch.device("cuda", 1)


INTRA_OP = [  # (cores, devices, intra-op threads per CPU replica)
    (4, ["cpu:0", "cpu:1"], 2),
    (4, ["cpu:0", "cpu:1", "cpu:2"], 1),
    (2, ["cpu:0", "cpu:1", "cpu:2"], 1),  # never below one
    (8, ["cpu:0"], 8),
    (8, ["cuda:0", "cuda:1"], 8),  # GPU replicas do not take a share of the cores
    (6, ["cpu:0", "cuda:0", "cpu:1"], 3),
]


def test_intra_op_threads_split_cores(monkeypatch):
    for cores, devs, want in INTRA_OP:
        monkeypatch.setattr(os, "sched_getaffinity", lambda pid, cores=cores: set(range(cores)),
                            raising=False)
        assert devices.intra_op_threads(devs) == want, (cores, devs)


def test_replica_threads_use_their_share_of_cores():
    """Each CPU replica thread sets torch's intra-op thread count to its share, and only on itself."""
    before = torch.get_num_threads()
    s = md.MirroredStrategy(devices=["cpu:0", "cpu:1"])
    share = devices.intra_op_threads(s.extended.worker_devices)
    got = s.run(lambda: torch.get_num_threads())
    assert set(s.experimental_local_results(got)) == {share}
    assert torch.get_num_threads() == before
