"""Issue 14: Model.compile(optimizer=torch.optim.X(groups, ...)) carries the instance over: every
parameter group's hyperparameters (weight decay off for biases and norms, a head's own rate, a rate
set on a group after construction) and the state loaded into it. Each run is checked against plain
PyTorch on one device with the same instance, on 1, 2 and 3 CPU replicas; an instance over
parameters that are not the model's is refused, naming the fix, with nothing changed."""
from __future__ import annotations

import copy
import json

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import mirrored as mr
from _replicas import strategy_of  # tests/_replicas.py

# Float reassociation only: a replica adds its part of the batch's gradient, then the parts are
# summed, where one device sums the whole batch at once; each gradient entry differs by a few ulps
# (~1e-7 relative). SGD passes that to the weights scaled by lr (<= 0.05); Adam's update m / sqrt(v) is
# scale-free in the gradient, so an ulp-level change stays ulp-level. Measured after these 9 steps:
# at most 6e-8 absolute on weights of size ~0.5, so 2e-7 absolute is tight yet never flaky (the CPU
# kernels are deterministic).
RTOL, ATOL = 1e-6, 2e-7
BATCH, EPOCHS = 8, 3


def _data(n: int = 23):
    g = torch.Generator().manual_seed(0)
    return torch.randn(n, 5, generator=g), torch.randint(0, 3, (n,), generator=g)


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 8), nn.LayerNorm(8), nn.Tanh(), nn.Linear(8, 3))


def _adamw_groups(net: nn.Module) -> torch.optim.Optimizer:
    """The usual recipe: decay for the matrices only, the head at its own rate, and a rate set on a
    group after construction (a tuned warm start)."""
    body, head = net[:3], net[3]
    matrices = [p for p in body.parameters() if p.dim() > 1]
    others = [p for p in body.parameters() if p.dim() <= 1]
    opt = torch.optim.AdamW([{"params": matrices, "weight_decay": 0.1},
                             {"params": others, "weight_decay": 0.0},
                             {"params": head.parameters(), "lr": 0.05}], lr=0.01, betas=(0.8, 0.99))
    opt.param_groups[1]["lr"] = 0.02
    return opt


def _sgd_groups(net: nn.Module) -> torch.optim.Optimizer:
    opt = torch.optim.SGD([{"params": net[0].parameters(), "momentum": 0.9, "nesterov": True},
                           {"params": list(net[1].parameters()) + list(net[3].parameters()), "lr": 0.02}],
                          lr=0.05, momentum=0.5)
    opt.param_groups[0]["lr"] = 0.03
    return opt


def _warm_up(net: nn.Module, opt: torch.optim.Optimizer, x, y) -> None:
    """Two steps, so the instance holds state (momentum buffers, Adam's moments and step count)."""
    for i in range(2):
        opt.zero_grad()
        F.cross_entropy(net(x[i * 4:i * 4 + 4]), y[i * 4:i * 4 + 4]).backward()
        opt.step()
    opt.zero_grad()


def _plain_fit(net: nn.Module, opt: torch.optim.Optimizer, x, y, epochs: int = EPOCHS) -> None:
    for _ in range(epochs):
        for i in range(0, len(x), BATCH):
            opt.zero_grad()
            F.cross_entropy(net(x[i:i + BATCH]), y[i:i + BATCH]).backward()
            opt.step()


def _model(net: nn.Module, optimizer, replicas: int) -> mr.Model:
    with strategy_of(replicas).scope():
        model = mr.Model(net)
        model.compile(optimizer=optimizer, loss="sparse_categorical_crossentropy")
    return model


def _assert_weights(model: mr.Model, ref: nn.Module) -> None:
    for got, (name, want) in zip(model.get_weights(), ref.state_dict().items()):
        np.testing.assert_allclose(got, want.detach().numpy(), rtol=RTOL, atol=ATOL, err_msg=name)
    model.check_in_sync()


@pytest.mark.parametrize("replicas", [1, 2, 3])
@pytest.mark.parametrize("make", [_adamw_groups, _sgd_groups], ids=["adamw", "sgd"])
def test_groups_and_state_of_the_instance_train_like_plain_torch(make, replicas):
    x, y = _data()
    ref = _net()
    ref_opt = make(ref)
    _warm_up(ref, ref_opt, x, y)
    net = copy.deepcopy(ref)  # the same weights, and an instance with the same groups and state
    opt = make(net)
    opt.load_state_dict(ref_opt.state_dict())
    model = _model(net, opt, replicas)
    assert all(a is b for a, b in zip(model.module.parameters(), net.parameters()))  # replica 0 is the net
    own = {t.data_ptr() for s in opt.state.values() for t in s.values() if torch.is_tensor(t)}
    for replica in model.mirrored_optimizer.replicas:  # each replica's state is its own copy
        assert own.isdisjoint(t.data_ptr() for s in replica.state.values() for t in s.values() if torch.is_tensor(t))
    groups = model.mirrored_optimizer.param_groups
    assert [{k: g[k] for k in ("lr", "weight_decay")} for g in groups] == \
           [{k: g[k] for k in ("lr", "weight_decay")} for g in ref_opt.param_groups]
    model.fit(x, y, batch_size=BATCH, epochs=EPOCHS, shuffle=False, verbose=0)
    _plain_fit(ref, ref_opt, x, y)
    _assert_weights(model, ref)
    for replica in model.mirrored_optimizer.replicas:  # the state went on from the instance's
        assert [len(g["params"]) for g in replica.param_groups] == [len(g["params"]) for g in ref_opt.param_groups]
    if make is _adamw_groups:
        steps = [float(s["step"]) for s in model.mirrored_optimizer.replicas[0].state_dict()["state"].values()]
        assert steps == [2.0 + EPOCHS * 3] * len(steps)


def test_an_instance_over_part_of_the_model_trains_that_part_alone():
    """A frozen backbone, as in fine-tuning: plain torch leaves what the optimizer does not hold."""
    x, y = _data()
    ref = _net()
    net = copy.deepcopy(ref)
    model = _model(net, torch.optim.SGD(net[3].parameters(), lr=0.1, momentum=0.9), replicas=2)
    backbone = [p.detach().clone() for p in net[:3].parameters()]
    model.fit(x, y, batch_size=BATCH, epochs=EPOCHS, shuffle=False, verbose=0)
    _plain_fit(ref, torch.optim.SGD(ref[3].parameters(), lr=0.1, momentum=0.9), x, y)
    _assert_weights(model, ref)
    for replica in model.replicas:
        assert all(torch.equal(a, b) for a, b in zip(replica[:3].parameters(), backbone))


def _state(model_or_net):
    return [t.detach().clone() for t in model_or_net.state_dict().values()]


def test_an_instance_over_another_modules_parameters_is_refused():
    net = _net()
    stranger = torch.optim.SGD(_net().parameters(), lr=0.1)  # a copy's parameters, not the model's
    with mr.MirroredStrategy(devices=["cpu:0", "cpu:1"]).scope():
        model = mr.Model(net)
        before = _state(model.module)
        with pytest.raises(ValueError, match=r"none of its 6 parameters is one of the model's 6.*net\.parameters\(\)"
                                             r".*mr\.optimizers\.Optimizer\(torch\.optim\.SGD"):
            model.compile(optimizer=stranger, loss="sparse_categorical_crossentropy")
    assert model.optimizer is None and model.mirrored_optimizer is None
    assert all(torch.equal(a, b) for a, b in zip(_state(model.module), before))


def test_an_instance_over_some_foreign_parameters_is_refused():
    net, other = _net(), nn.Linear(3, 3)
    mixed = torch.optim.SGD([{"params": net.parameters()}, {"params": other.parameters(), "lr": 0.5}], lr=0.1)
    with mr.MirroredStrategy(devices=["cpu:0", "cpu:1"]).scope():
        model = mr.Model(net)
        model.compile(optimizer="sgd", loss="mse")
        compiled = model.mirrored_optimizer
        with pytest.raises(ValueError, match=r"2 of its 8 parameters are not the model's \(the first: group 1's "
                                             r"parameter 0, of shape \(3, 3\)\)"):
            model.compile(optimizer=mixed, loss="sparse_categorical_crossentropy")
    assert model.mirrored_optimizer is compiled  # the earlier compile stands
    assert mixed.param_groups[1]["lr"] == 0.5 and not mixed.state


def test_a_mirrored_optimizer_is_refused_as_the_optimizer():
    net = _net()
    with mr.MirroredStrategy(devices=["cpu:0", "cpu:1"]).scope():
        model = mr.Model(net)
        model.compile(optimizer="sgd", loss="mse")
        with pytest.raises(TypeError, match="builds the model's mirrored optimizer itself"):
            model.compile(optimizer=model.mirrored_optimizer, loss="mse")


def test_setting_the_rate_scales_every_group():
    """Keras's callbacks set one learning_rate; each group keeps its ratio to the first, as torch's
    ReduceLROnPlateau scales every group."""
    net = _net()
    model = _model(net, torch.optim.SGD([{"params": net[:3].parameters()},
                                         {"params": net[3].parameters(), "lr": 1.0}], lr=0.1), replicas=2)
    model.optimizer.learning_rate = 0.05
    assert model.optimizer.learning_rate == 0.05
    for replica in model.mirrored_optimizer.replicas:
        assert [g["lr"] for g in replica.param_groups] == [0.05, 0.5]
    for group in model.mirrored_optimizer.param_groups:
        group["lr"] = 0.0 if group["lr"] == 0.05 else group["lr"]
    with pytest.raises(ValueError, match="first parameter group's rate is 0"):
        model.optimizer.learning_rate = 0.1
    model.optimizer.learning_rate = 0.0  # (the rate it has: nothing to scale)


def test_reduce_lr_on_plateau_keeps_the_groups_ratio():
    x, y = _data()
    net = _net()
    model = _model(net, torch.optim.SGD([{"params": net[:3].parameters()},
                                         {"params": net[3].parameters(), "lr": 0.4}], lr=0.1), replicas=2)
    model.fit(x, y, batch_size=BATCH, epochs=2, verbose=0,
              callbacks=[mr.callbacks.ReduceLROnPlateau(monitor="loss", factor=0.5, patience=0, min_delta=1e9)])
    rates = [g["lr"] for g in model.mirrored_optimizer.param_groups]
    assert rates == pytest.approx([0.05, 0.2], rel=1e-12)  # halved once (epoch 2 did not improve), each group


def test_the_config_records_the_groups_and_save_load_continues_them(tmp_path):
    x, y = _data()
    net = _net()
    model = _model(net, _adamw_groups(net), replicas=2)
    model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
    config = json.loads(json.dumps(mr.optimizers.serialize(model.optimizer)))
    assert [g["params"] for g in config["config"]["param_groups"]] == [[0], [1, 2, 3], [4, 5]]
    assert mr.optimizers.deserialize(config).get_config()["param_groups"] == config["config"]["param_groups"]
    model.save(tmp_path / "m.safetensors")
    with mr.MirroredStrategy(devices=["cpu:0", "cpu:1"]).scope():
        loaded = mr.Model.load(tmp_path / "m.safetensors", module=_net())
    for a, b in zip(loaded.mirrored_optimizer.param_groups, model.mirrored_optimizer.param_groups):
        assert {k: v for k, v in a.items() if k != "params"} == {k: v for k, v in b.items() if k != "params"}
    for m in (model, loaded):
        m.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
    for a, b in zip(loaded.get_weights(), model.get_weights()):
        assert np.array_equal(a, b)  # the same program on the same replicas: bit for bit


def test_an_optimizer_built_by_an_mr_optimizers_recipe_keeps_its_keras_options():
    x, y = _data()
    ref = _net()
    net = copy.deepcopy(ref)
    model = _model(net, mr.optimizers.SGD(learning_rate=0.1, momentum=0.9, clipvalue=0.05)(net.parameters()), 2)
    assert model.optimizer.clipvalue == 0.05
    model.fit(x, y, batch_size=BATCH, epochs=EPOCHS, shuffle=False, verbose=0)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    for _ in range(EPOCHS):
        for i in range(0, len(x), BATCH):
            ref_opt.zero_grad()
            F.cross_entropy(ref(x[i:i + BATCH]), y[i:i + BATCH]).backward()
            torch.nn.utils.clip_grad_value_(ref.parameters(), 0.05)
            ref_opt.step()
    _assert_weights(model, ref)
    accumulating = mr.optimizers.SGD(learning_rate=0.1, gradient_accumulation_steps=2)(net.parameters())
    F.cross_entropy(net(x), y).backward()
    accumulating.step()  # the first of 2 steps: its gradients wait in the optimizer
    with pytest.raises(ValueError, match="holds gradients accumulated towards its next update"):
        _model(_net(), accumulating, 2)
