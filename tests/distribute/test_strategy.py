"""strategy.py: construction, run, reductions' edge cases, lifetime of replica threads."""
from __future__ import annotations

import gc
import threading
import weakref

import pytest
import torch

import mirrored.distribute as md
from _replicas import TIMEOUT_S, replica_id, strategy_of  # tests/_replicas.py


def mirrored_threads() -> set[threading.Thread]:
    return {t for t in threading.enumerate() if t.name.startswith("mirrored-replica-")}


def test_constructor_validates_timeout():
    for bad in (0, -1.0, "10"):
        with pytest.raises(ValueError, match=f"timeout_s={bad!r}"):
            md.MirroredStrategy(devices=["cpu:0", "cpu:1"], timeout_s=bad)


def test_repr_and_extended_shim():
    s = strategy_of(2)
    assert repr(s) == "MirroredStrategy(devices=['cpu:0', 'cpu:1'])"
    assert s.extended.worker_devices == s.extended.parameter_devices == ("cpu:0", "cpu:1")
    assert isinstance(s.extended.cross_device_ops, md.InMemoryAllReduce)
    assert repr(md.OneDeviceStrategy("cpu:0")) == "OneDeviceStrategy(devices=['cpu:0'])"


def test_threads_start_on_first_run_and_stop_when_dropped():
    """No thread before the first run; the replica threads end once the strategy is unreferenced,
    without waiting for the cyclic garbage collector (a strategy holds no reference cycle)."""
    before = mirrored_threads()
    s = strategy_of(3)
    assert mirrored_threads() == before
    s.run(lambda: None)
    mine = mirrored_threads() - before
    assert len(mine) == 3
    ref = weakref.ref(s)
    gc.disable()
    try:
        del s
        assert ref() is None
    finally:
        gc.enable()
    for t in mine:
        t.join(timeout=TIMEOUT_S)
        assert not t.is_alive()


def test_used_strategy_with_state_is_freed_without_gc():
    """Mirrored modules, optimizers and variables refer to their strategy, not the other way round."""
    s = strategy_of(2)
    with s.scope():
        mnet = s.mirror(torch.nn.Linear(2, 2))
        opt = s.mirror_optimizer(torch.optim.SGD, mnet, lr=0.1)
        v = md.Variable(1.0)

    def step():
        mnet(torch.ones(1, 2)).sum().backward()
        opt.step()
        v.assign(2.0)
        return md.get_replica_context().all_reduce("sum", torch.ones(1))

    s.run(step)
    ref = weakref.ref(s)
    gc.disable()
    try:
        del s, mnet, opt, v
        assert ref() is None
    finally:
        gc.enable()


def test_run_argument_checks():
    s = strategy_of(2)
    with pytest.raises(TypeError, match="fn must be callable"):
        s.run(42)
    assert s.run(lambda a, b=0: a + b, args=[1], kwargs={"b": 2}) == 3
    assert s.run(lambda: "x", options=object()) == "x"


def test_overlapping_runs_from_two_threads_are_refused():
    s = strategy_of(2)
    started, release = threading.Event(), threading.Event()
    errors: list[BaseException] = []

    def slow():
        started.set()
        release.wait(timeout=TIMEOUT_S)

    def first():
        try:
            s.run(slow)
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    t = threading.Thread(target=first)
    t.start()
    try:
        assert started.wait(timeout=TIMEOUT_S)
        with pytest.raises(RuntimeError, match="must not overlap"):
            s.run(lambda: None)
    finally:
        release.set()
        t.join(timeout=TIMEOUT_S)
    assert not t.is_alive() and not errors


def test_two_strategies_side_by_side():
    a, b = strategy_of(2), strategy_of(3)
    with a.scope():
        va = md.Variable(1.0)
    with b.scope():
        vb = md.Variable(1.0)
    assert a.run(lambda: md.get_strategy() is a) is True and b.run(lambda: md.get_strategy() is b) is True
    assert len(va.values) == 2 and len(vb.values) == 3
    assert a.reduce("sum", a.run(lambda: torch.tensor(1))).item() == 2
    assert b.reduce("sum", b.run(lambda: torch.tensor(1))).item() == 3


def test_one_device_strategy_runs_inline_and_raises_unchanged():
    s = md.OneDeviceStrategy("cpu:0")
    assert s.num_replicas_in_sync == 1
    with pytest.raises(KeyError) as info:
        s.run(lambda: {}["missing"])
    assert info.value.args == ("missing",)  # one replica, no prefix needed
    with s.scope():
        v = md.Variable(1.0)
    # Measured on TF 2.21: OneDeviceStrategy makes plain variables (ResourceVariable), in its scope and
    # inside run alike (review finding: ours were MirroredVariable, and creation inside run was refused).
    assert type(v) is md.Variable and len(v.values) == 1
    assert type(s.run(lambda: md.Variable(2.0))) is md.Variable


def test_default_strategy():
    default = md.get_strategy()
    assert default.num_replicas_in_sync == 1 and default.extended.worker_devices == ("cpu:0",)
    assert default.run(lambda x: x * 2, args=(md.PerReplica([3]),)) == 6
    assert type(md.Variable(0.0)) is md.Variable
    # Measured on TF 2.21: run in the default strategy's own scope works (review finding: it was taken
    # for a run inside a merge_call); run inside its run is refused, as TF refuses it.
    with default.scope():
        assert md.get_strategy().run(lambda: 1) == 1
    with pytest.raises(RuntimeError, match="inside strategy.run of the default strategy"):
        default.run(lambda: default.run(lambda: 1))


def test_reduce_and_gather_edge_cases():
    s = strategy_of(2)
    scalars = s.run(lambda: torch.tensor(float(replica_id())))
    with pytest.raises(ValueError, match="scalars"):
        s.gather(scalars, axis=0)
    assert s.gather(s.run(lambda: torch.tensor([replica_id()])), axis=-1).tolist() == [0, 1]
    ints = s.run(lambda: torch.tensor([1 + 2 * replica_id()]))  # 1 and 3
    assert s.reduce("mean", ints).tolist() == [2]
    assert s.reduce("sum", md.Mirrored([torch.ones(1)] * 2)).tolist() == [2.0]


def test_check_in_sync_accepts_lists_and_passes_in_sync_state():
    """In-sync objects pass, given alone, in a list or in a tuple; and every element of a list is
    checked: a variable whose copies differ fails the list, named."""
    s = strategy_of(2)
    with s.scope():
        mnet = s.mirror(torch.nn.Linear(2, 2))
        opt = s.mirror_optimizer(torch.optim.SGD, mnet, lr=0.1)
        v = md.Variable(torch.zeros(2))
    assert s.check_in_sync([mnet, opt, v]) is None
    assert s.check_in_sync((mnet,)) is None
    with torch.no_grad():
        v.values[1].add_(1.0)
    with pytest.raises(md.OutOfSyncError, match="replica 0 and replica 1"):
        s.check_in_sync([mnet, opt, v])
    assert s.check_in_sync([mnet, opt]) is None


def test_values_from_function_on_one_replica_is_plain():
    """With one replica the value itself comes back (as run returns plain values)."""
    s = strategy_of(1)
    assert s.experimental_distribute_values_from_function(lambda ctx: ctx.replica_id_in_sync_group) == 0
    assert repr(md.ValueContext(1, 2)) == "ValueContext(replica_id_in_sync_group=1, num_replicas_in_sync=2)"


def test_values_from_function_places_nested_tensors_too(monkeypatch):
    """A bare tensor went to its replica's device but tensors inside a dict or tuple stayed where the
    function made them (review finding). Replica 1's device is mapped to "meta" here to see it on CPU."""
    from mirrored.distribute import devices
    from mirrored.distribute import strategy as strategy_module

    real = devices.torch_device
    monkeypatch.setattr(strategy_module, "torch_device", lambda d: torch.device("meta") if d == "cpu:1" else real(d))
    s = md.MirroredStrategy(devices=["cpu:0", "cpu:1"])
    values = s.experimental_distribute_values_from_function(
        lambda ctx: {"a": torch.ones(1), "b": (torch.zeros(2), 3)})
    assert [t.device.type for t in values["a"].values] == ["cpu", "meta"]
    assert [t.device.type for t in values["b"][0].values] == ["cpu", "meta"]
    assert values["b"][1].values == (3, 3)


def test_scope_object_entries_are_per_thread():
    """One scope object entered on two threads at once: each thread's exit pops its own entry."""
    s = strategy_of(2)
    scope = s.scope()
    inside, release = threading.Event(), threading.Event()
    seen: list = []

    def other():
        with scope:
            inside.set()
            release.wait(TIMEOUT_S)
            seen.append(md.get_strategy() is s)
        seen.append(md.has_strategy())

    t = threading.Thread(target=other)
    t.start()
    try:
        assert inside.wait(TIMEOUT_S)
        with scope:
            assert md.get_strategy() is s
        assert not md.has_strategy()
    finally:
        release.set()
        t.join(TIMEOUT_S)
    assert seen == [True, False]


def test_new_conformance_paths_leave_no_reference_cycle():
    """A reused scope object, extended.update, a variable created inside run and a nested reduce keep
    the strategy free of cycles: dropping it stops its threads without the cyclic collector."""
    s = strategy_of(2)
    scope = s.scope()
    with scope:
        v = md.Variable(0.0)
    with scope:
        s.extended.update(v, lambda var, x: var.assign_add(x), args=(md.PerReplica([torch.tensor(1.0)] * 2),))
    late = s.run(lambda: md.Variable(1.0))
    s.reduce("sum", s.run(lambda: {"a": torch.ones(1), "b": [torch.ones(2)]}))
    s.experimental_local_results({"v": v})
    ref = weakref.ref(s)
    gc.disable()
    try:
        del s, scope, v, late
        assert ref() is None
    finally:
        gc.enable()


def test_replicas_run_in_the_callers_grad_and_autocast_modes():
    """torch keeps grad and autocast modes per thread; replica threads would run with grad on and no
    autocast whatever the caller set. As torch's DataParallel does, the caller's modes reach every
    replica: `with torch.no_grad(): strategy.run(f)` builds no graph anywhere."""
    s = md.MirroredStrategy(devices=["cpu:0", "cpu:1"])

    def probe():
        return (torch.is_grad_enabled(), torch.is_inference_mode_enabled(), torch.is_autocast_enabled("cpu"),
                torch.get_autocast_dtype("cpu"))

    local = s.experimental_local_results
    assert set(local(s.run(probe))) == {(True, False, False, torch.get_autocast_dtype("cpu"))}
    with torch.no_grad():
        assert {r[0] for r in local(s.run(probe))} == {False}
    with torch.inference_mode():
        assert {r[:2] for r in local(s.run(probe))} == {(False, True)}
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert {r[2:] for r in local(s.run(probe))} == {(True, torch.bfloat16)}
        w = torch.randn(3, 3)
        assert {t.dtype for t in local(s.run(lambda: torch.randn(2, 3) @ w))} == {torch.bfloat16}
    assert set(local(s.run(probe))) == {(True, False, False, torch.get_autocast_dtype("cpu"))}  # nothing leaks


def test_gradient_reducer_averages_by_weight_and_compares_the_copies():
    """strategy.gradient_reducer: what code that applies its own gradients (a Keras optimizer's apply)
    meets the other replicas in. Weighted by rows, 2 replicas' mean-loss gradients on uneven parts
    (3 and 2 rows) give the one-device gradient of the whole batch, bitwise the same on both."""
    torch.manual_seed(0)
    net, x, y = torch.nn.Linear(3, 1), torch.randn(5, 3), torch.randn(5, 1)
    ref = torch.nn.functional.mse_loss(net(x), y)
    want = torch.autograd.grad(ref, list(net.parameters()))
    strategy = strategy_of(2)
    with strategy.scope():
        mnet = strategy.mirror(net)
    reducer = strategy.gradient_reducer(mnet)
    parts = md.PerReplica([(x[:3], y[:3]), (x[3:], y[3:])])

    def step(part):
        xb, yb = part
        copy = mnet.values[replica_id()]
        params = list(copy.parameters())
        grads = list(torch.autograd.grad(torch.nn.functional.mse_loss(copy(xb), yb), params))
        return reducer.reduce(md.get_replica_context(), params, grads, weight=xb.shape[0])

    first, second = strategy.experimental_local_results(strategy.run(step, args=(parts,)))
    for got, other, expected in zip(first, second, want):
        torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-7)
        assert torch.equal(got, other)
    with pytest.raises(TypeError, match="mirror\\(\\) returned"):
        strategy.gradient_reducer(net)


def test_check_in_sync_takes_the_module_a_mirror_took():
    """The module given to strategy.mirror is replica 0's copy: check_in_sync(module) checks the
    mirror's copies, and tensors a registered finder names outside the state_dict too."""
    strategy = strategy_of(2)
    net = torch.nn.Linear(2, 2)
    extra = {}
    with strategy.scope():
        mnet = strategy.mirror(net)
    for copy in mnet.values:
        extra[id(copy)] = torch.zeros(3)
    handle = md.register_synced_tensors(lambda m: [("extra", extra[id(m)])] if id(m) in extra else None)
    try:
        strategy.check_in_sync(net)
        extra[id(mnet.values[1])][0] = 1.0
        with pytest.raises(md.OutOfSyncError, match="extra"):
            strategy.check_in_sync(net)
    finally:
        handle.remove()
    with pytest.raises(TypeError, match="strategy.mirror took"):
        strategy.check_in_sync(torch.nn.Linear(2, 2))
