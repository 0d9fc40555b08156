"""mr.optimizers.schedules against their closed forms (written out here step by step) and the values
TF 2.21 / Keras 3 give; configs round-trip through JSON (issue 13)."""
from __future__ import annotations

import json
import math

import pytest

import mirrored as mr

S = mr.optimizers.schedules
STEPS = [0, 1, 5, 9, 10, 11, 37, 99, 100, 101, 250, 1000]


def test_cosine_decay_with_warmup_gives_tf_value_at_step_5():
    """Measured on TF 2.21: CosineDecay(0.1, 100, warmup_target=1.0, warmup_steps=10) at step 5 is 0.55."""
    schedule = S.CosineDecay(0.1, 100, warmup_target=1.0, warmup_steps=10)
    assert schedule(5) == pytest.approx(0.55, rel=1e-7)
    assert schedule(0) == pytest.approx(0.1)
    assert schedule(10) == pytest.approx(1.0)  # warmup done: the decay starts from warmup_target
    assert schedule(60) == pytest.approx(0.5)  # halfway through the cosine
    assert schedule(110) == schedule(10_000) == pytest.approx(0.0)  # held at alpha * target after the decay


@pytest.mark.parametrize("staircase", [False, True])
def test_exponential_decay(staircase):
    schedule = S.ExponentialDecay(0.1, decay_steps=10, decay_rate=0.5, staircase=staircase)
    for step in STEPS:
        exponent = step // 10 if staircase else step / 10
        assert schedule(step) == pytest.approx(0.1 * 0.5 ** exponent, rel=1e-12), step


@pytest.mark.parametrize("staircase", [False, True])
def test_inverse_time_decay(staircase):
    schedule = S.InverseTimeDecay(1.0, decay_steps=4, decay_rate=0.5, staircase=staircase)
    for step in STEPS:
        ratio = step // 4 if staircase else step / 4
        assert schedule(step) == pytest.approx(1.0 / (1 + 0.5 * ratio), rel=1e-12), step


def test_piecewise_constant_decay_boundaries_belong_to_the_interval_below():
    """Keras: values[0] while step <= boundaries[0], values[1] while step <= boundaries[1], ..."""
    schedule = S.PiecewiseConstantDecay([10, 20], [1.0, 0.5, 0.1])
    got = [schedule(s) for s in (0, 10, 11, 20, 21, 1000)]
    assert got == [1.0, 1.0, 0.5, 0.5, 0.1, 0.1]


@pytest.mark.parametrize("cycle", [False, True])
def test_polynomial_decay(cycle):
    schedule = S.PolynomialDecay(0.1, decay_steps=10, end_learning_rate=0.01, power=2.0, cycle=cycle)
    for step in STEPS:
        if cycle:
            periods = max(1, math.ceil(step / 10))  # the first multiple of decay_steps at or above step
            fraction = step / (10 * periods)
        else:
            fraction = min(step, 10) / 10
        assert schedule(step) == pytest.approx((0.1 - 0.01) * (1 - fraction) ** 2 + 0.01, rel=1e-12), step


def test_cosine_decay_without_warmup():
    schedule = S.CosineDecay(2.0, decay_steps=100, alpha=0.1)
    for step in STEPS:
        cosine = 0.5 * (1 + math.cos(math.pi * min(step, 100) / 100))
        assert schedule(step) == pytest.approx(2.0 * (0.9 * cosine + 0.1), rel=1e-12), step


@pytest.mark.parametrize("t_mul, m_mul", [(1.0, 1.0), (2.0, 0.5), (1.5, 1.0)])
def test_cosine_decay_restarts_walks_the_periods(t_mul, m_mul):
    """Reference: walk the periods one by one (lengths 10, 10 t, 10 t^2, ...; each starting at m_mul
    times the previous start) instead of Keras's closed form with a logarithm."""
    schedule = S.CosineDecayRestarts(1.0, first_decay_steps=10, t_mul=t_mul, m_mul=m_mul, alpha=0.2)
    for step in [0, 1, 4, 9, 10, 11, 19, 29, 31, 55, 100, 333]:
        start, length, scale = 0.0, 10.0, 1.0
        while step >= start + length:
            start, length, scale = start + length, length * t_mul, scale * m_mul
        cosine = 0.5 * scale * (1 + math.cos(math.pi * (step - start) / length))
        assert schedule(step) == pytest.approx(0.8 * cosine + 0.2, rel=1e-9, abs=1e-12), (step, t_mul)


@pytest.mark.parametrize("schedule", [
    S.ExponentialDecay(0.1, 10, 0.5, staircase=True), S.PiecewiseConstantDecay([3, 7], [0.3, 0.2, 0.1]),
    S.PolynomialDecay(0.1, 10, cycle=True), S.InverseTimeDecay(0.1, 10, 0.5),
    S.CosineDecay(0.1, 100, alpha=0.1, warmup_target=1.0, warmup_steps=10), S.CosineDecayRestarts(0.1, 10, 1.5, 0.9),
], ids=lambda s: type(s).__name__)
def test_configs_round_trip_through_json(schedule):
    config = json.loads(json.dumps(S.serialize(schedule)))
    assert config["class_name"] == type(schedule).__name__
    again = S.deserialize(config)
    assert type(again) is type(schedule) and again.get_config() == schedule.get_config()
    assert [again(s) for s in STEPS] == [schedule(s) for s in STEPS]
    assert type(schedule).from_config(schedule.get_config()).get_config() == schedule.get_config()


def test_bad_arguments_and_unknown_configs_are_named():
    with pytest.raises(ValueError, match=r"ExponentialDecay\(decay_steps=0\)"):
        S.ExponentialDecay(0.1, 0, 0.5)
    with pytest.raises(ValueError, match="one value more than boundaries"):
        S.PiecewiseConstantDecay([1, 2], [1.0, 0.5])
    with pytest.raises(ValueError, match="increase strictly"):
        S.PiecewiseConstantDecay([5, 2], [1.0, 0.5, 0.1])
    with pytest.raises(ValueError, match="warmup_steps=-1"):
        S.CosineDecay(0.1, 10, warmup_steps=-1)
    with pytest.raises(ValueError, match="negative"):
        S.ExponentialDecay(0.1, 10, 0.5)(-1)
    with pytest.raises(ValueError, match="unknown class 'os.system'.*Only mirrored's own classes"):
        S.deserialize({"class_name": "os.system", "config": {}})

    class Mine(S.LearningRateSchedule):
        def __call__(self, step):
            return 0.1

    with pytest.raises(TypeError, match="only the schedules of mr.optimizers.schedules"):
        S.serialize(Mine())
