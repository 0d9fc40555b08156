"""Issue 17: CPU replica counts beyond what the machine holds. More CPU replicas than cores warn;
replicas whose copies would not fit in memory are refused before anything is built, with the
estimate in the message (devices.check_replica_memory, which the CLI and strategy.mirror call)."""
from __future__ import annotations

import threading
import warnings

import pytest

import mirrored as mr
from mirrored.distribute import devices

GB = 1 << 30


def test_more_cpu_replicas_than_cores_warn_at_the_users_line(monkeypatch):
    monkeypatch.setattr(devices, "usable_cores", lambda: 2)
    with pytest.warns(UserWarning, match=r"MirroredStrategy: 3 CPU replicas share 2 core\(s\).*at most 2") as record:
        mr.MirroredStrategy(devices=["cpu:0", "cpu:1", "cpu:2"])
    assert [w.filename for w in record] == [__file__]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        mr.MirroredStrategy(devices=["cpu:0", "cpu:1"])
        mr.OneDeviceStrategy("cpu:0")


def test_the_warning_comes_once_per_place_not_once_per_strategy(monkeypatch):
    monkeypatch.setattr(devices, "usable_cores", lambda: 1)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("default")  # Python's default: once per message and line
        for _ in range(3):
            mr.MirroredStrategy(devices=["cpu:0", "cpu:1"])
    assert len(record) == 1


def test_replicas_that_fit_pass(monkeypatch):
    """Up to the planned 80% of the available memory, and any count of empty copies, pass; one copy
    more than fits is refused (so the check is live here, not skipped)."""
    monkeypatch.setattr(devices, "available_memory_bytes", lambda: 10 * GB)
    cpus = [f"cpu:{i}" for i in range(1000)]
    assert devices.check_replica_memory(GB, cpus[:3], "here") is None  # 3 GB of 8 GB planned
    assert devices.check_replica_memory(GB, cpus[:8], "here") is None  # 8 GB of 8 GB: the limit itself
    assert devices.check_replica_memory(0, cpus, "here") is None
    with pytest.raises(ValueError, match="9 CPU replicas need about 9.0 GB.*Use at most 8 CPU"):
        devices.check_replica_memory(GB, cpus[:9], "here")


def test_replicas_that_do_not_fit_are_refused_with_the_estimate(monkeypatch):
    monkeypatch.setattr(devices, "available_memory_bytes", lambda: 10 * GB)
    with pytest.raises(ValueError) as info:
        devices.check_replica_memory(3 * GB, [f"cpu:{i}" for i in range(4)], "mirrored train --replicas 4")
    assert str(info.value) == (
        "mirrored train --replicas 4: 4 CPU replicas need about 12.0 GB (3.0 GB per replica's copy) but "
        "10.0 GB of memory is available, of which 80% is planned for copies. Use at most 2 CPU replica(s), a "
        "smaller model or batch, or free memory.")
    # The headroom: 8 GB of 10 GB may be planned, so 4 x 2 GB fits and 4 x 2.1 GB does not.
    devices.check_replica_memory(2 * GB, [f"cpu:{i}" for i in range(4)], "here")
    with pytest.raises(ValueError, match="Use at most 3 CPU"):
        devices.check_replica_memory(int(2.1 * GB), [f"cpu:{i}" for i in range(4)], "here")


def test_unknown_available_memory_checks_nothing_and_bad_sizes_are_refused(monkeypatch):
    monkeypatch.setattr(devices, "available_memory_bytes", lambda: None)
    devices.check_replica_memory(1 << 60, ["cpu:0", "cpu:1"], "here")
    with pytest.raises(TypeError, match="bytes_per_copy must be an int"):
        devices.check_replica_memory(1.5, ["cpu:0"], "here")
    with pytest.raises(ValueError, match="bytes_per_copy must be >= 0"):
        devices.check_replica_memory(-1, ["cpu:0"], "here")


def test_available_memory_is_read_from_the_system():
    """Against an independent read of /proc/meminfo (a cgroup limit may only lower it)."""
    with open("/proc/meminfo") as f:
        fields = {line.split(":")[0]: int(line.split()[1]) * 1024 for line in f}
    got = devices.available_memory_bytes()
    assert got is not None and 0 < got <= fields["MemTotal"]
    assert got <= fields["MemAvailable"] * 1.25 + (256 << 20)  # the system moves on between the two reads


def test_many_replicas_that_fit_start_and_stop_their_threads(monkeypatch):
    monkeypatch.setattr(devices, "usable_cores", lambda: 64)
    before = threading.active_count()
    strategy = mr.MirroredStrategy(devices=[f"cpu:{i}" for i in range(16)])
    ids = strategy.run(lambda: mr.get_replica_context().replica_id_in_sync_group)
    assert strategy.experimental_local_results(ids) == tuple(range(16))
    # (The conftest fixture checks that the 16 replica threads stop once the strategy is dropped.)
    assert threading.active_count() > before


def test_strategy_mirror_refuses_copies_that_do_not_fit_before_copying(monkeypatch):
    """A library user's path (not only the CLI's): strategy.mirror estimates the copies from the
    module's parameters and buffers and refuses before any copy is made."""
    import torch

    import mirrored as mr

    net = torch.nn.Linear(1000, 1000)  # 4.0 MB of weights
    monkeypatch.setattr(devices, "usable_cores", lambda: 8)
    monkeypatch.setattr(devices, "available_memory_bytes", lambda: 10 * 2**20)  # 10 MB: 2 new copies fit, not 3
    strategy = mr.MirroredStrategy(devices=[f"cpu:{i}" for i in range(4)])
    with pytest.raises(ValueError, match=r"MirroredStrategy.mirror: .*3 CPU replica"):
        strategy.mirror(net)
    assert net.weight.device.type == "cpu"
    mr.MirroredStrategy(devices=["cpu:0", "cpu:1", "cpu:2"]).mirror(net)  # the module itself and 2 copies
