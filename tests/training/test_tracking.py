"""mr.train (issue 13): Checkpoint, CheckpointManager and latest_checkpoint with TF's names.

A checkpoint saved on 2 replicas restores on 1 and 3 (inside a scope and outside) and into plain torch
objects, each compared with the values saved; a custom loop interrupted and resumed from its
CheckpointManager (dataset iterator included) ends with the weights of an uninterrupted run, bit for bit.
A checkpoint that does not fit (issue 17) is refused before anything is assigned: every object is as
it was, compared value by value with a copy taken before the restore.
"""
from __future__ import annotations

import gc
import json
import logging
import os
import random

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import mirrored as mr
from mirrored.training.checkpoint import CheckpointError, CheckpointMismatchError
from _replicas import strategy_of  # tests/_replicas.py

GLOBAL_BATCH = 6


def _net(batchnorm: bool = True) -> nn.Module:
    torch.manual_seed(0)
    norm = nn.BatchNorm1d(8) if batchnorm else nn.Identity()  # per-replica batch statistics, buffers
    return nn.Sequential(nn.Linear(4, 8), norm, nn.ReLU(), nn.Linear(8, 3))


def _dataset() -> mr.data.Dataset:
    g = torch.Generator().manual_seed(2)
    x, y = torch.randn(30, 4, generator=g), torch.randint(0, 3, (30,), generator=g)
    return mr.data.Dataset.from_tensor_slices((x, y)).shuffle(30, seed=5).batch(GLOBAL_BATCH)


class _Run:
    """A custom-loop setup on `replicas` CPU replicas: a mirrored net with BatchNorm, an optimizer, a
    mirrored step counter, a sync-on-read SUM variable (float and int), a metric, and an iterator."""

    def __init__(self, replicas: int, in_scope: bool = True, optimizer=None):
        self.strategy = strategy = strategy_of(replicas)
        with strategy.scope():
            self.net = strategy.mirror(_net())
            self.opt = strategy.mirror_optimizer(optimizer or mr.optimizers.SGD(learning_rate=0.1, momentum=0.9),
                                                 self.net)
            self.step = mr.Variable(0, trainable=False)
            self.total = mr.Variable(0.0, synchronization=mr.VariableSynchronization.ON_READ,
                                     aggregation=mr.VariableAggregation.SUM)
            self.seen = mr.Variable(torch.tensor(0), synchronization=mr.VariableSynchronization.ON_READ,
                                    aggregation=mr.VariableAggregation.SUM)
            self.loss = mr.metrics.Mean(name="loss")
        self.iterator = iter(strategy.experimental_distribute_dataset(_dataset()))
        self.in_scope = in_scope

    def checkpoint(self, **only) -> mr.train.Checkpoint:
        objects = dict(net=self.net, opt=self.opt, step=self.step, total=self.total, seen=self.seen,
                       metrics=[self.loss], iterator=self.iterator)
        return mr.train.Checkpoint(**(only or objects))

    def train(self, steps: int) -> None:
        def step(x, y):
            per_example = F.cross_entropy(self.net(x), y, reduction="none")
            mr.losses.compute_average_loss(per_example, global_batch_size=GLOBAL_BATCH).backward()
            self.opt.step()
            self.opt.zero_grad()
            self.total.assign_add(per_example.detach().sum())
            self.seen.assign_add(len(y))
            self.loss.update_state(per_example.detach())

        for _ in range(steps):
            x, y = next(self.iterator)
            self.strategy.run(step, args=(x, y))
            self.step.assign_add(1)

    def restore(self, path: str):
        if not self.in_scope:
            return self.checkpoint().restore(path)
        with self.strategy.scope():
            return self.checkpoint().restore(path)


def _state_of(run: _Run) -> dict:
    """What the checkpoint should carry over, read in cross-replica context."""
    return {"net": {k: v.clone() for k, v in run.net.replicas[0].state_dict().items()},
            "momentum": [run.opt.replicas[0].state[p]["momentum_buffer"].clone()
                         for p in run.net.replicas[0].parameters()],
            "iterations": run.opt.replicas[0].iterations, "step": int(run.step), "total": float(run.total),
            "seen": int(run.seen), "loss": float(run.loss.result())}


def _assert_restored(run: _Run, want: dict) -> None:
    for copy in run.net.replicas:
        for name, value in copy.state_dict().items():
            assert torch.equal(value, want["net"][name]), name
    for opt in run.opt.replicas:
        assert opt.iterations == want["iterations"]
        for p, buf in zip(opt.param_groups[0]["params"], want["momentum"]):
            assert torch.equal(opt.state[p]["momentum_buffer"], buf)
    assert int(run.step) == want["step"] and run.step.dtype == torch.int64
    assert float(run.total) == pytest.approx(want["total"], rel=1e-6)  # split over the replicas, read summed
    assert int(run.seen) == want["seen"]  # integers split exactly
    assert float(run.loss.result()) == pytest.approx(want["loss"], rel=1e-6)


def test_saved_on_two_replicas_restores_on_one_and_three_in_and_out_of_a_scope(tmp_path):
    saved = _Run(2)
    saved.train(3)
    path = saved.checkpoint().save(tmp_path / "ckpt")
    want = _state_of(saved)
    saved.train(1)
    next_batch = saved.strategy.gather(saved.strategy.run(lambda x, y: y, args=next(saved.iterator)), axis=0)
    for replicas, in_scope in ((1, False), (3, True)):
        run = _Run(replicas, in_scope=in_scope)
        run.restore(path).assert_consumed()
        _assert_restored(run, want)
        run.train(1)  # the iterator continues the epoch: the 5th batch is the one the original had next
        got = run.strategy.gather(run.strategy.run(lambda x, y: y, args=next(run.iterator)), axis=0)
        assert torch.equal(got, next_batch)
        run.strategy.check_in_sync(run.net)
        run.strategy.check_in_sync(run.opt)


def test_a_checkpoint_restores_into_plain_torch_objects(tmp_path):
    saved = _Run(2)
    saved.train(2)
    path = saved.checkpoint().write(tmp_path / "two_replicas")
    want = _state_of(saved)
    net = _net()
    opt = torch.optim.SGD(net.parameters(), lr=0.5, momentum=0.9)
    step = torch.zeros((), dtype=torch.int64)
    status = mr.train.Checkpoint(net=net, opt=opt, step=step).read(path)
    status.assert_existing_objects_matched().assert_nontrivial_match()
    with pytest.raises(AssertionError, match=r"in the checkpoint went nowhere \(total, seen, metrics.0, iterator\)"):
        status.assert_consumed()
    status.expect_partial()
    for name, value in net.state_dict().items():
        assert torch.equal(value, want["net"][name]), name
    assert all(torch.equal(opt.state[p]["momentum_buffer"], m) for p, m in zip(net.parameters(), want["momentum"]))
    assert opt.param_groups[0]["lr"] == 0.1 and "keras" not in opt.state_dict()
    assert int(step) == 2


def test_save_numbers_the_files_and_restore_carries_the_count_on(tmp_path):
    w = torch.zeros(3)
    ckpt = mr.train.Checkpoint(w=w)
    prefix = str(tmp_path / "run" / "ckpt")
    assert ckpt.save(prefix) == prefix + "-1"
    w += 1
    assert ckpt.save(prefix) == prefix + "-2" and ckpt.save_counter == 2
    assert mr.train.latest_checkpoint(tmp_path / "run") == prefix + "-2"
    state = json.loads((tmp_path / "run" / "checkpoint").read_text())
    assert state["model_checkpoint_path"] == "ckpt-2"  # relative, as TF writes it: the directory can move
    assert ckpt.write(tmp_path / "run" / "other") == str(tmp_path / "run" / "other")
    assert ckpt.save_counter == 2 and mr.train.latest_checkpoint(tmp_path / "run") == prefix + "-2"

    again = mr.train.Checkpoint(w=torch.full((3,), 7.0))
    again.read(prefix + "-1").assert_consumed()
    assert again.save_counter == 0 and torch.equal(again.w, torch.zeros(3))  # read leaves the count alone
    again.restore(prefix + "-1").assert_consumed()
    assert again.save_counter == 1 and again.save(prefix) == prefix + "-2"  # restore carries it on


def test_restore_of_none_restores_nothing_and_says_so_when_asserted():
    w = torch.ones(2)
    status = mr.train.Checkpoint(w=w).restore(mr.train.latest_checkpoint("no-such-directory"))
    status.expect_partial()
    with pytest.raises(AssertionError, match=r"restore\(None\): no checkpoint was given"):
        status.assert_consumed()
    assert torch.equal(w, torch.ones(2))


def test_a_partial_restore_is_logged_when_the_status_goes_unless_expect_partial(tmp_path, caplog):
    path = mr.train.Checkpoint(a=torch.ones(1), b=torch.ones(1)).write(tmp_path / "ab")
    with caplog.at_level(logging.WARNING, logger="mirrored.training.tracking"):
        mr.train.Checkpoint(a=torch.zeros(1)).read(path).expect_partial()
        gc.collect()
        assert not caplog.records
        mr.train.Checkpoint(a=torch.zeros(1), c=torch.zeros(1)).read(path)
        gc.collect()
    assert len(caplog.records) == 1
    assert "not in the checkpoint (c)" in caplog.records[0].getMessage()
    assert "went nowhere (b)" in caplog.records[0].getMessage()


def test_a_model_restores_into_another_replica_count_and_its_optimizer_resumes(tmp_path):
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(24, 4, generator=g), torch.randint(0, 3, (24,), generator=g)

    def model(replicas):
        with strategy_of(replicas).scope():
            m = mr.Model(_net())
            schedule = mr.optimizers.schedules.ExponentialDecay(0.01, 2, 0.5)
            m.compile(optimizer=mr.optimizers.Adam(learning_rate=schedule), loss="sparse_categorical_crossentropy")
        return m

    first = model(2)
    first.fit(x, y, batch_size=GLOBAL_BATCH, epochs=1, verbose=0)
    path = mr.train.Checkpoint(model=first, optimizer=first.optimizer).save(tmp_path / "m")
    second = model(3)
    mr.train.Checkpoint(model=second, optimizer=second.optimizer).restore(path).assert_consumed()
    assert second.optimizer.iterations == 4 and second.optimizer.learning_rate == pytest.approx(0.0025)
    for a, b in zip(second.get_weights(), first.get_weights()):
        assert (a == b).all()
    for got, want in zip(second.mirrored_optimizer.replicas, [first.mirrored_optimizer.replicas[0]] * 3):
        for p, q in zip(got.param_groups[0]["params"], want.param_groups[0]["params"]):
            assert torch.equal(got.state[p]["exp_avg_sq"], want.state[q]["exp_avg_sq"])
    plain = _net()
    mr.train.Checkpoint(model=plain).restore(path).expect_partial().assert_existing_objects_matched()
    assert all(torch.equal(a, b) for a, b in zip(plain.state_dict().values(), first.module.state_dict().values()))


# ---- CheckpointManager ---------------------------------------------------------------------------------

def test_manager_keeps_the_newest_and_a_new_manager_carries_on(tmp_path):
    w = torch.zeros(1)
    ckpt = mr.train.Checkpoint(w=w)
    manager = mr.train.CheckpointManager(ckpt, tmp_path, max_to_keep=2)
    assert manager.latest_checkpoint is None and manager.checkpoints == []
    paths = [manager.save() for _ in range(3)]
    assert paths == [str(tmp_path / f"ckpt-{i}") for i in (1, 2, 3)]
    assert manager.checkpoints == paths[1:] and manager.latest_checkpoint == paths[2]
    assert sorted(os.listdir(tmp_path)) == ["checkpoint", "ckpt-2", "ckpt-3"]

    restarted = mr.train.Checkpoint(w=torch.ones(1))
    again = mr.train.CheckpointManager(restarted, tmp_path, max_to_keep=2)
    assert again.checkpoints == paths[1:] and again.latest_checkpoint == paths[2]
    restarted.restore(again.latest_checkpoint).assert_consumed()
    assert again.save() == str(tmp_path / "ckpt-4")  # numbering goes on from the restored save_counter
    assert sorted(os.listdir(tmp_path)) == ["checkpoint", "ckpt-3", "ckpt-4"]
    assert mr.train.latest_checkpoint(tmp_path) == str(tmp_path / "ckpt-4")


def test_manager_options_interval_hours_numbers_and_init_fn(tmp_path):
    counter = mr.Variable(0, trainable=False)
    ckpt = mr.train.Checkpoint(counter=counter)
    manager = mr.train.CheckpointManager(ckpt, tmp_path / "a", max_to_keep=None, step_counter=counter,
                                         checkpoint_interval=5, checkpoint_name="model.ckpt")
    saved = []
    for step in range(12):
        counter.assign(step)
        saved.append(manager.save() is not None)
    assert [s for s, ok in enumerate(saved) if ok] == [0, 5, 10]
    assert manager.save(checkpoint_number=99, check_interval=False).endswith("model.ckpt-99")  # not due, forced
    assert manager.save(check_interval=False) is None  # never twice at one step

    # A tiny keep_checkpoint_every_n_hours keeps every pruned file on disk, off the managed list.
    kept = mr.train.CheckpointManager(ckpt, tmp_path / "b", max_to_keep=1, keep_checkpoint_every_n_hours=1e-9)
    for _ in range(3):
        kept.save()
    assert len(kept.checkpoints) == 1 and len([f for f in os.listdir(tmp_path / "b") if f != "checkpoint"]) == 3

    calls = []
    fresh = mr.train.CheckpointManager(mr.train.Checkpoint(w=torch.zeros(1)), tmp_path / "c", max_to_keep=1,
                                       init_fn=lambda: calls.append(1))
    assert fresh.restore_or_initialize() is None and calls == [1]
    fresh.save()
    assert fresh.restore_or_initialize() == str(tmp_path / "c" / "ckpt-1") and calls == [1]


def test_bad_arguments_and_files_are_named(tmp_path):
    with pytest.raises(ValueError, match="max_to_keep=0"):
        mr.train.CheckpointManager(mr.train.Checkpoint(), tmp_path, max_to_keep=0)
    with pytest.raises(ValueError, match="pass step_counter"):
        mr.train.CheckpointManager(mr.train.Checkpoint(), tmp_path, 1, checkpoint_interval=2)
    with pytest.raises(TypeError, match="model is a str, which a checkpoint cannot save"):
        mr.train.Checkpoint(model="resnet")
    with pytest.raises(AttributeError, match="reserved"):
        mr.train.Checkpoint(save_counter=torch.zeros(1))
    path = mr.train.Checkpoint(w=torch.zeros(2)).write(tmp_path / "w")
    with pytest.raises(CheckpointError, match=r"w'\): tensor 'w/value' has shape \(2,\) in the file but \(3,\) in the "
                                              r"variable 'w'"):
        mr.train.Checkpoint(w=torch.zeros(3)).read(path)
    with pytest.raises(CheckpointError, match="w holds kind 'variable' in the checkpoint, but the object given under "
                                              "that name, a Linear, is of kind 'module'"):
        mr.train.Checkpoint(w=nn.Linear(1, 1)).read(path)
    with pytest.raises(ValueError, match="'checkpoint' is the name of the file that lists"):
        mr.train.Checkpoint(w=torch.zeros(2)).write(tmp_path / "checkpoint")
    model_file = tmp_path / "model.safetensors"
    with strategy_of(1).scope():
        mr.Model(nn.Linear(2, 2)).save(model_file)
    with pytest.raises(CheckpointError, match="It is a Model file: load it with mr.Model.load"):
        mr.train.Checkpoint(w=torch.zeros(2)).read(model_file)
    (tmp_path / "tf").mkdir()
    (tmp_path / "tf" / "checkpoint").write_text('model_checkpoint_path: "ckpt-1"\n')
    with pytest.raises(ValueError, match="TensorFlow's checkpoint list"):
        mr.train.latest_checkpoint(tmp_path / "tf")
    (tmp_path / "gone").mkdir()
    mr.train.Checkpoint(w=torch.zeros(2)).save(tmp_path / "gone" / "ckpt")
    os.remove(tmp_path / "gone" / "ckpt-1")
    assert mr.train.latest_checkpoint(tmp_path / "gone") is None
    with pytest.raises(ValueError, match="has not been built into an optimizer yet"):
        mr.train.Checkpoint(opt=mr.optimizers.SGD()).write(tmp_path / "x")
    strategy = strategy_of(2)
    ckpt = mr.train.Checkpoint(w=torch.zeros(2))
    with pytest.raises(RuntimeError, match="inside strategy.run"):
        strategy.run(lambda: ckpt.write(tmp_path / "y"))


# ---- an interrupted custom loop ---------------------------------------------------------------------------

def _custom_loop(directory, steps: int, replicas: int = 2, stop_after: int | None = None):
    """TF's custom-loop idiom: restore the manager's latest checkpoint (none at first), train to `steps`,
    save every 3 steps. Gradient accumulation (k=2) and a schedule make the optimizer's own state
    matter; the shuffled, repeated dataset makes the iterator's. No BatchNorm, whose per-replica
    statistics depend on the replica count. Returns the weights, or None when the run "dies" after
    `stop_after` steps of this process."""
    strategy = strategy_of(replicas)
    with strategy.scope():
        net = strategy.mirror(_net(batchnorm=False))
        opt = strategy.mirror_optimizer(mr.optimizers.SGD(
            learning_rate=mr.optimizers.schedules.PiecewiseConstantDecay([4, 8], [0.2, 0.1, 0.05]), momentum=0.9,
            gradient_accumulation_steps=2), net)
        step = mr.Variable(0, trainable=False)
    iterator = iter(strategy.experimental_distribute_dataset(_dataset().repeat()))
    ckpt = mr.train.Checkpoint(model=net, optimizer=opt, step=step, iterator=iterator)
    manager = mr.train.CheckpointManager(ckpt, directory, max_to_keep=2)
    ckpt.restore(manager.latest_checkpoint)

    def train_step(x, y):
        loss = F.cross_entropy(net(x), y, reduction="none")
        mr.losses.compute_average_loss(loss, global_batch_size=GLOBAL_BATCH).backward()
        opt.step()
        opt.zero_grad()

    done = 0
    while int(step) < steps:
        strategy.run(train_step, args=next(iterator))
        step.assign_add(1)
        done += 1
        if int(step) % 3 == 0:
            manager.save()
        if done == stop_after:
            return None
    strategy.check_in_sync(net)
    return [t.clone() for t in net.replicas[0].state_dict().values()]


def test_an_interrupted_custom_loop_resumes_to_the_uninterrupted_weights(tmp_path):
    want = _custom_loop(tmp_path / "plain", steps=14)
    # Dies after step 10; the last save was after step 9: half-way through an accumulation (k=2) and
    # through the second epoch (5 batches an epoch), past the schedule's second boundary.
    assert _custom_loop(tmp_path / "resumed", steps=14, stop_after=10) is None
    assert mr.train.latest_checkpoint(tmp_path / "resumed") == str(tmp_path / "resumed" / "ckpt-3")
    got = _custom_loop(tmp_path / "resumed", steps=14)
    for a, b in zip(got, want):
        assert torch.equal(a, b)  # the same float operations in the same order
    # On another replica count, the same up to the reassociation of the gradient sums.
    assert _custom_loop(tmp_path / "three", steps=14, stop_after=10) is None
    got = _custom_loop(tmp_path / "three", steps=14, replicas=3)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


# ---- a checkpoint that does not fit is refused before anything is assigned (issue 17) ----------------------

def _everything(run: _Run) -> dict:
    """Every value a restore of _full_checkpoint(run) could assign, each replica's copy, and the generators."""
    opt_state = []
    for opt in run.opt.replicas:
        opt_state += [v.clone() for state in opt.state.values() for v in state.values()]
        opt_state += [a.clone() for a in opt._accumulators or [] if a is not None] + [opt._micro_steps]
    return {"net": [t.clone() for copy in run.net.replicas for t in copy.state_dict().values()],
            "opt": opt_state,
            "variables": [t.clone() for v in (run.step, run.total, run.seen) for t in v.values],
            "metric": [t.clone() for var in run.loss.variables for t in var.values],
            "iterator": run.iterator.get_state(),
            "rng": (torch.get_rng_state(), random.getstate(), np.random.get_state()[1].copy())}


def _assert_same(got: dict, want: dict) -> None:
    for key in ("net", "opt", "variables", "metric"):
        assert len(got[key]) == len(want[key]), key
        for a, b in zip(got[key], want[key]):
            assert torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b, key
    assert got["iterator"] == want["iterator"]
    assert torch.equal(got["rng"][0], want["rng"][0]) and got["rng"][1] == want["rng"][1]
    assert (got["rng"][2] == want["rng"][2]).all()


def _full_checkpoint(run: _Run, **more) -> mr.train.Checkpoint:
    return mr.train.Checkpoint(net=run.net, opt=run.opt, step=run.step, total=run.total, seen=run.seen,
                               metrics=[run.loss], iterator=run.iterator, rng=mr.train.RandomState(), **more)


def _accumulating_run() -> _Run:
    """A run on 2 replicas whose optimizer is half-way through a gradient accumulation (k=2)."""
    return _Run(2, optimizer=mr.optimizers.SGD(learning_rate=0.1, momentum=0.9, gradient_accumulation_steps=2))


# Damage in each kind of entry; the checkpoint's entries are restored in the order net, opt, step, total,
# seen, metrics.0, iterator, rng, so an entry-by-entry restore would have assigned those before the damage.
DAMAGES = {
    "weights": (dict(tensors=lambda t: t.update({"net/3.weight": torch.zeros(3, 7)})),
                r"tensor 'net/3\.weight' has shape \(3, 7\) in the file but \(3, 8\) in the module 'net'"),
    "momentum": (dict(tensors=lambda t: t.update({"opt/state/2/momentum_buffer": torch.zeros(5)})),
                 r"tensor 'opt/state/2/momentum_buffer' has shape \(5,\) in the file but net/1\.weight has shape "
                 r"\(8,\)"),
    "accumulator": (dict(tensors=lambda t: t.update({"opt/keras/replica_accumulators/1/0": torch.zeros(4, 8)})),
                    r"'opt/keras'\['replica_accumulators'\]\[1\]\[0\] has shape \(4, 8\) in the file but "
                    r"net/0\.weight has shape \(8, 4\)"),
    "step count": (dict(meta=lambda m: m["objects"]["opt"]["state"]["extra"]["keras"].update(iterations=-1)),
                   r"'opt/keras'\['iterations'\] is -1, not a step count"),
    "variable dtype": (dict(tensors=lambda t: t.update({"seen/value": torch.tensor(0.5)})),
                       r"tensor 'seen/value' has dtype torch\.float32 in the file but torch\.int64 in the variable "
                       r"'seen'"),
    "metric": (dict(tensors=lambda t: t.update({"metrics.0/1": torch.zeros(2, dtype=torch.float64)})),
               r"tensor 'metrics\.0/1' has shape \(2,\) in the file but \(\) in metric 'loss'"),
    "data position": (dict(meta=lambda m: m["objects"]["iterator"]["state"]["dataset"].update(pipeline=["batch"])),
                      r"the saved data position 'iterator\.dataset\.pipeline' is \['batch'\] but this run's "
                      r"dataset has \['batch', 'shuffle', 'from_tensor_slices'\]"),
    "rng": (dict(meta=lambda m: m["objects"]["rng"]["rng"]["numpy"].__setitem__(1, [1, 2])),
            r"the RNG state 'rng' cannot be restored"),
}


@pytest.mark.parametrize("damage", list(DAMAGES))
def test_a_checkpoint_that_does_not_fit_is_refused_and_leaves_every_object_as_it_was(rewrite_checkpoint, tmp_path, damage):
    saved = _accumulating_run()
    saved.train(3)
    path = _full_checkpoint(saved).write(tmp_path / "ckpt")
    edit, message = DAMAGES[damage]
    rewrite_checkpoint(path, **edit)
    run = _accumulating_run()
    run.train(1)  # its own state, unlike the file's
    torch.rand(3), random.random(), np.random.rand()
    before = _everything(run)
    with pytest.raises(CheckpointError, match=message) as info:
        _full_checkpoint(run).read(path)
    assert str(info.value).startswith(f"Checkpoint.read({path!r}): ")
    _assert_same(_everything(run), before)
    run.strategy.check_in_sync(run.net)
    run.strategy.check_in_sync(run.opt)


def test_the_undamaged_checkpoint_restores_every_object(tmp_path):
    """The counterpart of the damaged ones: the same checkpoint restores all of it (the RNG included)."""
    saved = _accumulating_run()
    saved.train(3)
    want = _everything(saved)
    path = _full_checkpoint(saved).write(tmp_path / "ckpt")
    run = _accumulating_run()
    run.train(1)
    torch.rand(3), random.random(), np.random.rand()
    _full_checkpoint(run).read(path).assert_consumed()
    got = _everything(run)
    # A sync-on-read SUM variable is split over the replicas on restore: its copies differ, its sum not.
    assert float(run.total) == pytest.approx(float(saved.total), rel=1e-6) and int(run.seen) == int(saved.seen)
    got["variables"], want["variables"] = got["variables"][:2], want["variables"][:2]  # the step counter's copies
    got["metric"] = want["metric"] = []  # likewise summed: compared by result()
    assert float(run.loss.result()) == pytest.approx(float(saved.loss.result()), rel=1e-6)
    _assert_same(got, want)


class _Picky:
    """A user's object with state whose set_state() refuses a count over its limit (after the checks,
    which see only the state's outline)."""

    def __init__(self, count: int, limit: int):
        self.count, self.limit = count, limit

    def get_state(self) -> dict:
        return {"count": self.count}

    def set_state(self, state: dict) -> None:
        if state["count"] > self.limit:
            raise ValueError(f"count {state['count']} is over {self.limit}")
        self.count = state["count"]


def test_a_set_state_that_refuses_puts_back_the_objects_restored_before_it(tmp_path):
    """set_state() of a distributed iterator replays its data and the user's may refuse, so those go
    first and go back: the iterator continues exactly where it was, as a twin run's does."""
    saved, run, twin = _Run(2), _Run(2), _Run(2)
    saved.train(3)
    path = mr.train.Checkpoint(net=saved.net, iterator=saved.iterator, picky=_Picky(5, 9)).write(tmp_path / "c")
    run.train(1)
    twin.train(1)
    before = _everything(run)
    picky = _Picky(1, limit=3)
    with pytest.raises(CheckpointError, match=r"picky\.set_state\(\) refused the saved state \(ValueError: count 5 is "
                                              r"over 3\); nothing was restored"):
        mr.train.Checkpoint(net=run.net, iterator=run.iterator, picky=picky).read(path)
    assert picky.count == 1
    _assert_same(_everything(run), before)
    for _ in range(4):  # the rest of the epoch (5 batches), and the end of the data
        got, want = next(run.iterator), next(twin.iterator)
        for a, b in zip(run.strategy.experimental_local_results(got[1]),
                        twin.strategy.experimental_local_results(want[1]), strict=True):
            assert torch.equal(a, b)
    assert next(run.iterator, None) is None and next(twin.iterator, None) is None
    # A state of another outline is refused by the checks already.
    with pytest.raises(CheckpointError, match=r"the saved state 'picky' is \{'count': 5\} but the object's "
                                              r"get_state\(\) is \{'n': 0\}"):
        mr.train.Checkpoint(picky=type("Other", (), {"get_state": lambda self: {"n": 0},
                                                     "set_state": lambda self, s: None})()).read(path)


def test_backup_semantics_complete_match_is_checked_first_and_status_errors_are_checkpoint_errors(tmp_path):
    """A partial match is the status's to report (TF), with errors that are both AssertionError (TF) and
    CheckpointError (so a CLI reports them in a line); and the weights it matched are assigned."""
    path = mr.train.Checkpoint(a=torch.ones(2), b=torch.ones(1)).write(tmp_path / "ab")
    a = torch.zeros(2)
    status = mr.train.Checkpoint(a=a, c=torch.zeros(1)).read(path)
    with pytest.raises(CheckpointMismatchError, match=r"not in the checkpoint \(c\).*went nowhere \(b\)") as info:
        status.assert_consumed()
    assert isinstance(info.value, AssertionError) and isinstance(info.value, CheckpointError)
    assert str(path) in str(info.value) and torch.equal(a, torch.ones(2))
    status.expect_partial()
