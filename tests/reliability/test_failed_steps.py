"""A failed step leaves no trace (issue 17): after an exception inside a step, in a custom loop or in
`fit`, gradients, BatchNorm buffers, optimizer state and metrics are as before the step, and the
steps that follow equal a clean run's bit for bit.

The reference is the same program run without the fault (plain float32 on the same replica
threads: the same operations in the same order, so equality is exact, not approximate). Faults are
injected at every point of a step, on each replica in turn; each case prints its point and replica.
"""
from __future__ import annotations

import re
import numpy as np
import pytest
import torch
import torch.nn.functional as F

import mirrored as mr
from _replicas import replica_id, strategy_of  # tests/_replicas.py

GLOBAL = 12
STEPS = 4
FAULT_STEP = 2


class Fault(Exception):
    pass


def _net() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.BatchNorm1d(16), torch.nn.ReLU(),
                               torch.nn.Linear(16, 3))


def _batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(GLOBAL, 6, generator=g), torch.randint(0, 3, (GLOBAL,), generator=g))
            for _ in range(STEPS)]


class _Loop:
    """A TF-style custom loop: loss scaled by the global batch, mirrored SGD with momentum, a Mean
    metric updated before the update, zero_grad after it (so a failed step's gradients would leak)."""

    def __init__(self, n: int, accumulate: int = 1, reduction: str = "sum"):
        self.strategy = strategy_of(n)
        self.reduction = reduction  # "mean": DDP's rule, the unchanged mean loss line, reduced as backward ends
        with self.strategy.scope():
            self.net = self.strategy.mirror(_net())
            if accumulate == 1:
                self.opt = self.strategy.mirror_optimizer(torch.optim.SGD, self.net, lr=0.1, momentum=0.9,
                                                          gradient_reduction=reduction)
            else:
                recipe = mr.optimizers.SGD(learning_rate=0.1, momentum=0.9, gradient_accumulation_steps=accumulate)
                self.opt = self.strategy.mirror_optimizer(recipe, self.net)
            self.loss_metric = mr.metrics.Mean()
        self.fault: tuple[str, int] | None = None

    def _maybe_fail(self, where: str) -> None:
        rid = replica_id()
        if self.fault == (where, rid):
            raise Fault(f"{where} on replica {rid}")

    def step(self, x: torch.Tensor, y: torch.Tensor) -> None:
        def replica_step(xb, yb):
            self._maybe_fail("before forward")
            out = self.net(xb)
            self._maybe_fail("after forward")
            per_example = F.cross_entropy(out, yb, reduction="none")
            self.loss_metric.update_state(per_example.detach())
            if self.reduction == "mean":
                loss = per_example.mean()
            else:
                loss = mr.losses.compute_average_loss(per_example, global_batch_size=GLOBAL)
            if self.fault is not None and self.fault[0] == "in backward":
                out.register_hook(lambda g: self._maybe_fail("in backward") or g)
            loss.backward()
            self._maybe_fail("after backward")
            self.opt.step()
            self._maybe_fail("after the update")
            self.opt.zero_grad()

        ds = mr.data.Dataset.from_tensor_slices((x, y)).batch(GLOBAL)
        for xb, yb in self.strategy.experimental_distribute_dataset(ds):
            self.strategy.run(replica_step, args=(xb, yb))

    def state(self) -> dict[str, list[torch.Tensor]]:
        """Every replica's weights, buffers, gradients, optimizer state and metric totals."""
        out: dict[str, list[torch.Tensor]] = {}
        for r, (m, o) in enumerate(zip(self.net.replicas, self.opt.replicas)):
            for k, v in m.state_dict().items():
                out.setdefault(f"module {k}", []).append(v.clone())
            for i, p in enumerate(m.parameters()):
                out.setdefault(f"grad {i}", []).append(None if p.grad is None else p.grad.clone())
            for i, st in o.state_dict()["state"].items():
                for k, v in st.items():
                    if isinstance(v, torch.Tensor):
                        out.setdefault(f"optimizer {i} {k}", []).append(v.clone())
            for i, acc in enumerate(getattr(o, "_accumulators", None) or []):
                out.setdefault(f"accumulator {i}", []).append(None if acc is None else acc.clone())
            out.setdefault("step count", []).append(torch.tensor(getattr(o, "_micro_steps", 0)))
            for j, var in enumerate(self.loss_metric.variables):
                out.setdefault(f"metric {j}", []).append(var.values[r].clone())
        return out


def _assert_same(got: dict, want: dict, what: str) -> None:
    assert got.keys() == want.keys(), what
    for key in want:
        for r, (g, w) in enumerate(zip(got[key], want[key])):
            if w is None or g is None:
                assert g is None and w is None, f"{what}: {key} on replica {r}: {g} against {w}"
            else:
                assert torch.equal(g, w), f"{what}: {key} differs on replica {r}"


POINTS = ["before forward", "after forward", "in backward", "after backward"]


@pytest.mark.parametrize("reduction", ["sum", "mean"])
@pytest.mark.parametrize("replicas", [2, 3])
@pytest.mark.parametrize("point", POINTS)
def test_custom_loop_fault_before_the_update_leaves_no_trace(replicas, point, reduction):
    """Bitwise: the failed step's state equals the state before it, and the retried run a clean one's.
    With gradient_reduction="mean" the all-reduce happens when backward ends, so "after backward"
    fails after the replicas' gradients were already reduced (and "in backward" before)."""
    batches = _batches()
    clean = _Loop(replicas, reduction=reduction)
    for x, y in batches:
        clean.step(x, y)
    want = clean.state()
    for faulty_replica in range(replicas):
        print(f"fault {point!r} on replica {faulty_replica} of {replicas}, step {FAULT_STEP}, {reduction}")
        loop = _Loop(replicas, reduction=reduction)
        for x, y in batches[:FAULT_STEP]:
            loop.step(x, y)
        before = loop.state()
        loop.fault = (point, faulty_replica)
        with pytest.raises(Fault, match=f"replica {faulty_replica} \\(cpu:{faulty_replica}\\)"):
            loop.step(*batches[FAULT_STEP])
        loop.fault = None
        _assert_same(loop.state(), before, f"state after the failed step ({point}, replica {faulty_replica})")
        for x, y in batches[FAULT_STEP:]:  # the same step again, then the rest
            loop.step(x, y)
        _assert_same(loop.state(), want, f"after retrying ({point}, replica {faulty_replica})")
        loop.strategy.check_in_sync([loop.net, loop.opt])


@pytest.mark.parametrize("replicas", [2, 3])
def test_custom_loop_fault_after_the_update_keeps_it_on_every_replica(replicas):
    """A replica failing after the update (after every replica passed the gradient all-reduce): the
    update is applied on every replica, its gradients are gone, and the metric counts the step (it
    was updated before the update, which committed it)."""
    batches = _batches()
    clean = _Loop(replicas)
    for x, y in batches[:FAULT_STEP + 1]:
        clean.step(x, y)
    want = clean.state()
    loop = _Loop(replicas)
    for x, y in batches[:FAULT_STEP]:
        loop.step(x, y)
    loop.fault = ("after the update", replicas - 1)
    with pytest.raises(Fault):
        loop.step(*batches[FAULT_STEP])
    _assert_same(loop.state(), want, "after a failure past the update")
    loop.strategy.check_in_sync([loop.net, loop.opt])


def test_one_replica_fault_leaves_no_trace():
    """One replica runs inline on the caller's thread; a failed step still puts everything back."""
    batches = _batches()
    loop = _Loop(1)
    loop.step(*batches[0])
    before = loop.state()
    loop.fault = ("after backward", 0)
    with pytest.raises(Fault):
        loop.step(*batches[1])
    _assert_same(loop.state(), before, "one replica")


class _FailOnce(torch.nn.Module):
    """Raises in replica `replica`'s copy on its `at`-th training forward (0-based), once: in that
    forward, or (`where="backward"`) in the backward through it."""

    def __init__(self, net: torch.nn.Module, replica: int, at: int, where: str = "forward"):
        super().__init__()
        self.net = net
        self.replica, self.at, self.calls, self.where = replica, at, 0, where
        self.armed = True

    def forward(self, x):
        ctx = mr.get_replica_context()
        fail = False
        if self.training and self.armed and ctx is not None and ctx.replica_id_in_sync_group == self.replica:
            self.calls += 1
            fail = self.calls == self.at + 1
        if fail and self.where == "forward":
            raise Fault("injected")
        out = self.net(x)
        if fail:
            out.register_hook(_raise_in_backward)
        return out


def _raise_in_backward(grad: torch.Tensor) -> torch.Tensor:
    raise Fault("injected in backward")


def _model(n: int, replica: int = 0, at: int = 10**9, where: str = "forward", accumulate: int = 1) -> mr.Model:
    with strategy_of(n).scope():
        model = mr.Model(_FailOnce(_net(), replica, at, where))
        model.compile(optimizer=mr.optimizers.SGD(learning_rate=0.1, momentum=0.9,
                                                  gradient_accumulation_steps=accumulate if accumulate > 1 else None),
                      loss="sparse_categorical_crossentropy", metrics=["accuracy"])
    return model


def _dataset(batches) -> mr.data.Dataset:
    x = torch.cat([b[0] for b in batches])
    y = torch.cat([b[1] for b in batches])
    return mr.data.Dataset.from_tensor_slices((x, y)).batch(GLOBAL)


def _weights(model: mr.Model) -> list[np.ndarray]:
    return model.get_weights()


@pytest.mark.parametrize("replicas,faulty,where,accumulate", [
    (2, 0, "forward", 1), (2, 1, "forward", 1), (3, 2, "forward", 1),
    (2, 1, "backward", 1), (3, 0, "backward", 1), (2, 0, "forward", 2), (3, 1, "backward", 2)])
def test_fit_fault_leaves_no_trace_and_the_rest_equals_a_clean_run(replicas, faulty, where, accumulate):
    batches = _batches()
    clean = _model(replicas, accumulate=accumulate)
    clean.fit(_dataset(batches), epochs=1, verbose=0, shuffle=False)
    partial = _model(replicas, accumulate=accumulate)
    partial.fit(_dataset(batches[:FAULT_STEP]), epochs=1, verbose=0, shuffle=False)

    print(f"fit: fault in {where} of replica {faulty} of {replicas}, step {FAULT_STEP}, accumulating {accumulate}")
    model = _model(replicas, replica=faulty, at=FAULT_STEP, where=where, accumulate=accumulate)
    with pytest.raises(Fault, match=f"replica {faulty}"):
        model.fit(_dataset(batches), epochs=1, verbose=0, shuffle=False)
    # As before the failed step: what a run of the first FAULT_STEP batches left, metrics included.
    for got, want in zip(_weights(model), _weights(partial)):
        np.testing.assert_array_equal(got, want)
    assert model._logs() == partial._logs()
    assert all(p.grad is None for m in model.replicas for p in m.parameters())
    model.check_in_sync()
    # The step again, then the rest: the clean run's weights and optimizer state, bit for bit.
    model.module.armed = False
    for m in model.replicas:
        m.armed = False
    model.fit(_dataset(batches[FAULT_STEP:]), epochs=1, verbose=0, shuffle=False)
    for got, want in zip(_weights(model), _weights(clean)):
        np.testing.assert_array_equal(got, want)
    want_state = clean.mirrored_optimizer.state_dict()["state"]
    got_state = model.mirrored_optimizer.state_dict()["state"]
    for i in want_state:
        assert torch.equal(got_state[i]["momentum_buffer"], want_state[i]["momentum_buffer"])
    model.check_in_sync()


def test_fit_fault_in_the_second_step_of_an_execution_keeps_the_first():
    """steps_per_execution=2 runs two steps per strategy.run: a failure in the second keeps the
    first step's update and metrics (it was committed) and puts back only the second's."""
    batches = _batches()
    partial = _model(2)
    partial.compile(optimizer=mr.optimizers.SGD(learning_rate=0.1, momentum=0.9),
                    loss="sparse_categorical_crossentropy", metrics=["accuracy"], steps_per_execution=2)
    partial.fit(_dataset(batches[:3]), epochs=1, verbose=0, shuffle=False)
    model = _model(2, replica=1, at=3)
    model.compile(optimizer=mr.optimizers.SGD(learning_rate=0.1, momentum=0.9),
                  loss="sparse_categorical_crossentropy", metrics=["accuracy"], steps_per_execution=2)
    with pytest.raises(Fault):
        model.fit(_dataset(batches), epochs=1, verbose=0, shuffle=False)
    for got, want in zip(_weights(model), _weights(partial)):
        np.testing.assert_array_equal(got, want)
    assert model._logs() == partial._logs()
    model.check_in_sync()


def test_replicas_returning_different_structures_fail_at_run_and_roll_back():
    """A 2-tuple against a 3-tuple, a dict against a tensor, None against a tensor: a ValueError at
    run naming the replicas and both structures (TF's nest refuses them too); nothing changes."""
    strategy = strategy_of(2)
    with strategy.scope():
        metric = mr.metrics.Mean()
    cases = {
        "tuple(Tensor, Tensor)": lambda r: (torch.ones(1),) * (2 + r),
        "dict(a: Tensor)": lambda r: {"a": torch.ones(1)} if r == 0 else torch.ones(1),
        "Tensor": lambda r: torch.ones(1) if r == 0 else None,
    }
    for first, fn in cases.items():
        def replica_fn(fn=fn):
            rid = replica_id()
            metric.update_state(torch.tensor([1.0]))
            return fn(rid)

        with pytest.raises(ValueError, match=re.escape(f"replica 0 returned {first} but replica 1 returned")):
            strategy.run(replica_fn)
        assert float(metric.result()) == 0.0 and [float(v) for v in metric.count.values] == [0.0, 0.0]
    out = strategy.run(lambda: (torch.ones(1), None))  # the same structures on both: fine
    assert out[1] is None and len(strategy.experimental_local_results(out[0])) == 2


@pytest.mark.parametrize("fault_step", [2, 3])
def test_a_failed_step_that_only_accumulates_leaves_no_trace(fault_step):
    """gradient_accumulation_steps=2: a step that only accumulates has no meeting of the replicas, so
    without the journal the replica that finished it would be a step (and its gradients) ahead of the
    one that failed (found by issue 13's review). Both the accumulating step (3) and the updating one
    (2, counting from 0) roll back; the retried run equals a clean one bit for bit."""
    batches = _batches() + _batches()[:2]
    clean = _Loop(2, accumulate=2)
    for x, y in batches:
        clean.step(x, y)
    want = clean.state()
    loop = _Loop(2, accumulate=2)
    for x, y in batches[:fault_step]:
        loop.step(x, y)
    before = loop.state()
    loop.fault = ("after forward", 1)
    with pytest.raises(Fault):
        loop.step(*batches[fault_step])
    loop.fault = None
    _assert_same(loop.state(), before, f"after a failed step {fault_step} with accumulation")
    for x, y in batches[fault_step:]:
        loop.step(x, y)
    _assert_same(loop.state(), want, "after retrying with accumulation")
