"""The optimizers of _keras_optimizers.py (and _update_rules.py) against Keras 3's own optimizers
(KERAS_BACKEND=torch) fed the same gradients, and on 2 and 3 replicas against one device.

Tolerance against Keras: both update in float32; the torch classes place epsilon differently
(Adagrad, Adamax, Adafactor: see _keras_optimizers.py's docstring), which moves a step by about
epsilon / sqrt(accumulator) relative (1e-7 / 0.3 here), and the rest is reassociation; over 6 steps
at these rates rtol 2e-5 / atol 1e-6 holds that. Across replica counts the gradient is an all-reduced
sum instead of one: rtol 1e-5 (float32 reassociation, amplified by Lion's sign only where a moment
is ~0, which these gradients avoid), and the replicas are bitwise equal."""
from __future__ import annotations

import copy
import json
import os

import pytest
import torch
import torch.nn.functional as F

os.environ.setdefault("KERAS_BACKEND", "torch")  # before keras is imported (it reads it once)
keras = pytest.importorskip("keras")

import mirrored as mr  # noqa: E402
from mirrored.training import optimizers  # noqa: E402

CASES = [
    ("Adagrad", {"learning_rate": 0.1}),
    ("Adagrad", {"learning_rate": 0.05, "initial_accumulator_value": 0.5, "weight_decay": 0.1}),
    ("Adamax", {"learning_rate": 0.05}),
    ("Adamax", {"learning_rate": 0.05, "beta_1": 0.8, "weight_decay": 0.05}),
    ("Nadam", {"learning_rate": 0.05}),
    ("Nadam", {"learning_rate": 0.02, "beta_2": 0.99, "weight_decay": 0.1}),
    ("Adadelta", {"learning_rate": 1.0}),
    ("Adadelta", {"learning_rate": 0.5, "rho": 0.9, "weight_decay": 0.1}),
    ("Adafactor", {"learning_rate": 0.05}),
    ("Adafactor", {"learning_rate": 0.5, "clip_threshold": 2.0, "beta_2_decay": -0.5}),
    ("Lion", {"learning_rate": 0.01}),
    ("Lion", {"learning_rate": 0.01, "beta_1": 0.8, "weight_decay": 0.5}),
    ("Ftrl", {"learning_rate": 0.1}),
    ("Ftrl", {"learning_rate": 0.1, "l1_regularization_strength": 0.01, "l2_regularization_strength": 0.02,
              "l2_shrinkage_regularization_strength": 0.01, "beta": 0.1}),
    ("Lamb", {"learning_rate": 0.05}),
    ("Lamb", {"learning_rate": 0.05, "weight_decay": 0.1}),
    ("Lamb", {"learning_rate": 0.05, "global_clipnorm": 0.5}),
    ("Nadam", {"learning_rate": 0.05, "clipvalue": 0.2, "gradient_accumulation_steps": 2}),
]
IDS = [f"{c[0]}-{i}" for i, c in enumerate(CASES)]
STEPS = 6


def _start():
    g = torch.Generator().manual_seed(0)
    weights = [torch.randn(4, 3, generator=g), torch.randn(3, generator=g)]
    grads = [[torch.randn(4, 3, generator=g), torch.randn(3, generator=g)] for _ in range(STEPS)]
    return weights, grads


@pytest.mark.parametrize("name, kwargs", CASES, ids=IDS)
def test_updates_equal_keras(name, kwargs):
    weights, grads = _start()
    params = [torch.nn.Parameter(w.clone()) for w in weights]
    ours = getattr(optimizers, name)(**kwargs).build(params)
    variables = [keras.Variable(w.clone()) for w in weights]
    theirs = getattr(keras.optimizers, name)(**kwargs)
    for step in grads:
        for p, g in zip(params, step):
            p.grad = g.clone()
        ours.step()
        theirs.apply_gradients(zip([g.clone() for g in step], variables))
        for p, v in zip(params, variables):
            torch.testing.assert_close(p.detach(), v.value.detach().cpu(), rtol=2e-5, atol=1e-6)
    assert ours.iterations == int(theirs.iterations)


def _keras_scale(opt) -> float:
    return float(opt.dynamic_scale) if opt.built else opt.initial_scale


def test_loss_scale_optimizer_equals_keras():
    """Dynamic scaling: gradients come scaled by the current scale; an infinite one skips the update and
    halves the scale; dynamic_growth_steps finite updates double it. Checked step by step against Keras."""
    weights, grads = _start()
    grads[2][0][1, 1] = float("inf")
    params = [torch.nn.Parameter(w.clone()) for w in weights]
    recipe = optimizers.LossScaleOptimizer(optimizers.Adam(learning_rate=0.05), initial_scale=8.0,
                                           dynamic_growth_steps=2)
    ours = recipe.build(params)
    variables = [keras.Variable(w.clone()) for w in weights]
    theirs = keras.optimizers.LossScaleOptimizer(keras.optimizers.Adam(learning_rate=0.05), initial_scale=8.0,
                                                 dynamic_growth_steps=2)
    for step in grads:
        scale = recipe.loss_scale_factor
        assert scale == _keras_scale(theirs) and float(recipe.scale_loss(torch.tensor(1.0))) == scale
        for p, g in zip(params, step):
            p.grad = g * scale
        ours.step()
        theirs.apply_gradients(zip([g * scale for g in step], variables))
        for p, v in zip(params, variables):
            torch.testing.assert_close(p.detach(), v.value.detach().cpu(), rtol=2e-5, atol=1e-6)
    assert recipe.loss_scale_factor == _keras_scale(theirs) == 16.0  # 8 -> 16 -> (inf) 8 -> 16 -> 32 -> 16 ... as Keras
    assert ours.iterations == int(theirs.iterations) == STEPS - 1  # the skipped update is not counted
    state = ours.state_dict()
    again = optimizers.LossScaleOptimizer(optimizers.Adam(learning_rate=0.05), initial_scale=8.0,
                                          dynamic_growth_steps=2)
    rebuilt = again.build([torch.nn.Parameter(w.clone()) for w in weights])
    rebuilt.load_state_dict(state)
    assert again.loss_scale_factor == recipe.loss_scale_factor and rebuilt._loss_scale == ours._loss_scale


def _tiny_net():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 5), torch.nn.Tanh(), torch.nn.Linear(5, 3))


@pytest.mark.parametrize("replicas", [2, 3])
def test_each_optimizer_on_replicas_equals_one_device(replicas):
    """Three steps of a custom loop (global batch 12, sum / global batch) with each optimizer, on N replicas
    and on one device: the same weights, and bitwise-equal replicas."""
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(3, 12, 4, generator=g), torch.randint(0, 3, (3, 12), generator=g)
    strategy = mr.MirroredStrategy(devices=[f"cpu:{i}" for i in range(replicas)])
    recipes = [getattr(optimizers, name)(**kwargs) for name, kwargs in CASES]
    recipes.append(optimizers.LossScaleOptimizer(optimizers.Lamb(learning_rate=0.05), initial_scale=4.0,
                                                 dynamic_growth_steps=2))
    for recipe in recipes:
        net = _tiny_net()
        ref = copy.deepcopy(net)
        ref_opt = copy.deepcopy(recipe).build(list(ref.parameters()))
        for xb, yb in zip(x, y):
            loss = F.cross_entropy(ref(xb), yb, reduction="sum") / 12
            ref_opt.scale_loss(loss).backward()
            ref_opt.step()
            ref_opt.zero_grad()
        with strategy.scope():
            mnet = strategy.mirror(net)
            opt = strategy.mirror_optimizer(recipe, mnet)

        def step(xb, yb):
            loss = mr.losses.compute_average_loss(F.cross_entropy(mnet(xb), yb, reduction="none"), global_batch_size=12)
            (loss * (recipe.loss_scale_factor or 1)).backward()
            opt.step()
            opt.zero_grad()

        size = -(-12 // replicas)
        for xb, yb in zip(x, y):
            strategy.run(step, args=(mr.PerReplica([xb[i * size:(i + 1) * size] for i in range(replicas)]),
                                     mr.PerReplica([yb[i * size:(i + 1) * size] for i in range(replicas)])))
        copies = strategy.experimental_local_results(mnet)
        for got, want in zip(copies[0].parameters(), ref.parameters()):
            torch.testing.assert_close(got.detach(), want.detach(), rtol=1e-5, atol=1e-6, msg=recipe.name)
        for other in copies[1:]:
            assert all(torch.equal(a, b) for a, b in zip(copies[0].parameters(), other.parameters())), recipe.name
    del strategy


@pytest.mark.parametrize("name, kwargs", CASES, ids=IDS)
def test_configs_round_trip_through_json(name, kwargs):
    ours = getattr(optimizers, name)(**kwargs)
    back = optimizers.deserialize(json.loads(json.dumps(optimizers.serialize(ours))))
    assert type(back) is type(ours) and back.get_config() == ours.get_config()
    keras_config = getattr(keras.optimizers, name)(**kwargs).get_config()
    assert set(ours.get_config()) - {"amsgrad"} <= set(keras_config), "our config keys are Keras's"
    wrapped = optimizers.LossScaleOptimizer(ours, initial_scale=2.0)
    back = optimizers.deserialize(json.loads(json.dumps(optimizers.serialize(wrapped))))
    assert type(back.inner_optimizer) is type(ours) and back.get_config() == wrapped.get_config()


def test_names_as_keras_resolves_them():
    for name in ("adagrad", "Adamax", "nadam", "adadelta", "adafactor", "lion", "ftrl", "lamb", "sgd", "adam"):
        assert type(optimizers.get(name)).__name__.lower() == name.lower()
        if name != "lamb":  # (Keras 3.15's get does not list Lamb)
            keras.optimizers.get(name)
    for name, fix in (("muon", "torch.optim.Muon"), ("lossscaleoptimizer", r"LossScaleOptimizer\(mr.optimizers"),
                      ("multioptimizer", "parameter groups"), ("schedulefreeadamw", "AdamW with a schedule")):
        with pytest.raises(ValueError, match=fix):
            optimizers.get(name)
    with pytest.raises(ValueError, match="unknown optimizer 'adamm'. Known names: adadelta, adafactor, adagrad"):
        optimizers.get("adamm")


def test_bad_arguments_are_refused():
    with pytest.raises(TypeError, match=r"Adagrad\(rho=...\): not an argument of Adagrad"):
        optimizers.Adagrad(rho=0.9)
    with pytest.raises(ValueError, match=r"weight_decay=-1"):
        optimizers.Lion(weight_decay=-1)
    with pytest.raises(ValueError, match="loss_scale_factor"):
        optimizers.Lamb(loss_scale_factor=0)
    with pytest.raises(ValueError, match="scales the loss already"):
        optimizers.LossScaleOptimizer(optimizers.Lion(loss_scale_factor=4.0))
    with pytest.raises(ValueError, match=r"Adafactor\(clip_threshold=0.5\): must be >= 1"):
        optimizers.Adafactor(clip_threshold=0.5)
    with pytest.raises(ValueError, match="learning_rate_power"):
        optimizers.Ftrl(learning_rate_power=0.5).build([torch.nn.Parameter(torch.ones(2))])


def test_static_loss_scale_factor_divides_the_gradients():
    """Keras's loss_scale_factor: the loss is multiplied (fit reads the recipe's loss_scale_factor), the
    gradients divided: the update is the unscaled one."""
    weights, grads = _start()
    plain, scaled = ([torch.nn.Parameter(w.clone()) for w in weights] for _ in range(2))
    a = optimizers.Lion(learning_rate=0.01).build(plain)
    recipe = optimizers.Lion(learning_rate=0.01, loss_scale_factor=64.0)
    b = recipe.build(scaled)
    assert recipe.loss_scale_factor == 64.0
    for step in grads:
        for p, q, g in zip(plain, scaled, step):
            p.grad, q.grad = g.clone(), g * 64.0
        a.step()
        b.step()
    for p, q in zip(plain, scaled):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)


def test_an_instance_built_by_a_recipe_carries_its_decoupled_decay_to_compile():
    """compile(optimizer=<torch instance>) rebuilds it per replica: Keras's decoupled weight_decay and
    loss_scale_factor come along; a LossScaleOptimizer's instance is refused, its scale being the recipe's."""
    weights, grads = _start()
    first, second = ([torch.nn.Parameter(w.clone()) for w in weights] for _ in range(2))
    instance = optimizers.Lion(learning_rate=0.01, weight_decay=0.5, loss_scale_factor=2.0).build(first)
    rebuilt = optimizers.get(instance).build(first)  # (compile maps the instance's parameters by identity)
    reference = optimizers.Lion(learning_rate=0.01, weight_decay=0.5, loss_scale_factor=2.0).build(second)
    for step in grads:
        for p, q, g in zip(first, second, step):
            p.grad, q.grad = g * 2.0, g * 2.0
        rebuilt.step()
        reference.step()
    for p, q in zip(first, second):
        assert torch.equal(p, q)
    scaled = optimizers.LossScaleOptimizer(optimizers.Lion()).build([torch.nn.Parameter(torch.ones(2))])
    with pytest.raises(ValueError, match="built by a LossScaleOptimizer"):
        optimizers.get(scaled)
