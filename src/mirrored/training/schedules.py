"""Learning-rate schedules with Keras 3's names and formulas: `mr.optimizers.schedules.CosineDecay(0.1, 1000)`.

A schedule is a function of the optimizer's step count: `schedule(step) -> float`. Passed as an
optimizer's `learning_rate=`, it is evaluated before every update with the number of optimizer
steps taken so far (0 for the first), as Keras does, and the count is saved in checkpoints, so a
resumed run continues the schedule. Values are computed in Python floats (float64); Keras computes
in float32, so they agree to about 1e-7 relative. Every schedule has get_config()/from_config();
serialize()/deserialize() turn one into JSON and back by class name, from this module's classes
only. Uses the standard library.
"""
from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

from mirrored.training import _config

__all__ = [
    "CosineDecay", "CosineDecayRestarts", "ExponentialDecay", "InverseTimeDecay", "LearningRateSchedule",
    "PiecewiseConstantDecay", "PolynomialDecay", "deserialize", "serialize",
]


class LearningRateSchedule:
    """Base class: subclasses implement `__call__(step) -> float` and `get_config()`."""

    def __call__(self, step: int) -> float:
        raise NotImplementedError(f"learning rate schedule {type(self).__name__} must override __call__(step).")

    def get_config(self) -> dict[str, Any]:
        """The constructor's arguments, as JSON (Keras's get_config); from_config(config) rebuilds it."""
        raise NotImplementedError(f"learning rate schedule {type(self).__name__} must override get_config() to "
                                  "be saved with a model.")

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> LearningRateSchedule:
        """A new instance from get_config()'s dict (Keras's from_config)."""
        return cls(**config)

    def __repr__(self) -> str:
        try:
            args = ", ".join(f"{k}={v!r}" for k, v in self.get_config().items() if k != "name")
        except NotImplementedError:
            args = ""
        return f"{type(self).__name__}({args})"


def _step(step: Any) -> float:
    """The step as a float; a 0-d tensor or numpy integer is accepted too."""
    value = float(step)
    if value < 0:
        raise ValueError(f"learning rate schedule: step {step!r} is negative; steps count from 0.")
    return value


def _positive(cls: str, arg: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ValueError(f"{cls}({arg}={value!r}): must be a number > 0 (a count of optimizer steps).")


class _StepRatioDecay(LearningRateSchedule):
    """A rate that is a function of p = step / decay_steps (floored with staircase): the shared shape of
    ExponentialDecay and InverseTimeDecay, which differ only in `_rate(p)` and their name."""

    def __init__(self, initial_learning_rate: float, decay_steps: int, decay_rate: float, staircase: bool = False,
                 name: str | None = None):
        _positive(type(self).__name__, "decay_steps", decay_steps)
        self.initial_learning_rate = initial_learning_rate
        self.decay_steps = decay_steps
        self.decay_rate = decay_rate
        self.staircase = staircase
        self.name = name if name is not None else type(self).__name__

    def _rate(self, p: float) -> float:
        raise NotImplementedError

    def __call__(self, step: int) -> float:
        p = _step(step) / self.decay_steps
        if self.staircase:
            p = math.floor(p)
        return float(self._rate(p))

    def get_config(self) -> dict[str, Any]:
        """The constructor's arguments, as JSON (Keras's get_config); from_config(config) rebuilds it."""
        return {"initial_learning_rate": self.initial_learning_rate, "decay_steps": self.decay_steps,
                "decay_rate": self.decay_rate, "staircase": self.staircase, "name": self.name}


class ExponentialDecay(_StepRatioDecay):
    """initial_learning_rate * decay_rate ** (step / decay_steps); with staircase, the exponent is
    floored, so the rate drops every decay_steps steps."""

    def _rate(self, p: float) -> float:
        return self.initial_learning_rate * self.decay_rate ** p


class PiecewiseConstantDecay(LearningRateSchedule):
    """values[0] while step <= boundaries[0], values[1] while step <= boundaries[1], ..., and values[-1]
    after the last boundary."""

    def __init__(self, boundaries: Sequence[int], values: Sequence[float], name: str = "PiecewiseConstant"):
        boundaries, values = list(boundaries), list(values)
        if len(boundaries) != len(values) - 1:
            raise ValueError(f"PiecewiseConstantDecay: boundaries={boundaries} has {len(boundaries)} entries and "
                             f"values={values} has {len(values)}; give one value more than boundaries (one per "
                             "interval).")
        if any(b >= a for a, b in zip(boundaries[1:], boundaries)):
            raise ValueError(f"PiecewiseConstantDecay(boundaries={boundaries}): boundaries must increase strictly.")
        self.boundaries = boundaries
        self.values = values
        self.name = name

    def __call__(self, step: int) -> float:
        s = _step(step)
        for boundary, value in zip(self.boundaries, self.values):
            if s <= boundary:
                return float(value)
        return float(self.values[-1])

    def get_config(self) -> dict[str, Any]:
        """The constructor's arguments, as JSON (Keras's get_config); from_config(config) rebuilds it."""
        return {"boundaries": self.boundaries, "values": self.values, "name": self.name}


class PolynomialDecay(LearningRateSchedule):
    """(initial - end) * (1 - step / decay_steps) ** power + end, with the step capped at decay_steps;
    with cycle, decay_steps becomes the first multiple of itself at or above the step."""

    def __init__(self, initial_learning_rate: float, decay_steps: int, end_learning_rate: float = 0.0001,
                 power: float = 1.0, cycle: bool = False, name: str = "PolynomialDecay"):
        _positive("PolynomialDecay", "decay_steps", decay_steps)
        self.initial_learning_rate = initial_learning_rate
        self.decay_steps = decay_steps
        self.end_learning_rate = end_learning_rate
        self.power = power
        self.cycle = cycle
        self.name = name

    def __call__(self, step: int) -> float:
        s, decay_steps = _step(step), float(self.decay_steps)
        if self.cycle:
            decay_steps *= 1.0 if s == 0 else math.ceil(s / decay_steps)
        else:
            s = min(s, decay_steps)
        p = s / decay_steps
        return float((self.initial_learning_rate - self.end_learning_rate) * (1 - p) ** self.power
                     + self.end_learning_rate)

    def get_config(self) -> dict[str, Any]:
        """The constructor's arguments, as JSON (Keras's get_config); from_config(config) rebuilds it."""
        return {"initial_learning_rate": self.initial_learning_rate, "decay_steps": self.decay_steps,
                "end_learning_rate": self.end_learning_rate, "power": self.power, "cycle": self.cycle,
                "name": self.name}


class InverseTimeDecay(_StepRatioDecay):
    """initial_learning_rate / (1 + decay_rate * step / decay_steps); with staircase, the ratio
    step / decay_steps is floored."""

    def _rate(self, p: float) -> float:
        return self.initial_learning_rate / (1 + self.decay_rate * p)


class CosineDecay(LearningRateSchedule):
    """Cosine decay from the start rate to start * alpha over decay_steps, after an optional linear
    warmup (Keras 3): with warmup_target, the rate rises from initial_learning_rate to warmup_target
    over warmup_steps, then decays from warmup_target. CosineDecay(0.1, 100, warmup_target=1.0,
    warmup_steps=10)(5) is 0.55, as in TF 2.21."""

    def __init__(self, initial_learning_rate: float, decay_steps: int, alpha: float = 0.0, name: str = "CosineDecay",
                 warmup_target: float | None = None, warmup_steps: int = 0):
        _positive("CosineDecay", "decay_steps", decay_steps)
        if isinstance(warmup_steps, bool) or not isinstance(warmup_steps, (int, float)) or warmup_steps < 0:
            raise ValueError(f"CosineDecay(warmup_steps={warmup_steps!r}): must be a number of steps >= 0.")
        self.initial_learning_rate = initial_learning_rate
        self.decay_steps = decay_steps
        self.alpha = alpha
        self.name = name
        self.warmup_target = warmup_target
        self.warmup_steps = warmup_steps

    def _decayed(self, step: float, start: float) -> float:
        cosine = 0.5 * (1.0 + math.cos(math.pi * step / self.decay_steps))
        return start * ((1 - self.alpha) * cosine + self.alpha)

    def __call__(self, step: int) -> float:
        s = _step(step)
        if self.warmup_target is None:
            return float(self._decayed(min(s, self.decay_steps), self.initial_learning_rate))
        s = min(s, self.decay_steps + self.warmup_steps)
        if s < self.warmup_steps:
            fraction = s / self.warmup_steps
            return float((self.warmup_target - self.initial_learning_rate) * fraction + self.initial_learning_rate)
        return float(self._decayed(s - self.warmup_steps, self.warmup_target))

    def get_config(self) -> dict[str, Any]:
        """The constructor's arguments, as JSON (Keras's get_config); from_config(config) rebuilds it."""
        return {"initial_learning_rate": self.initial_learning_rate, "decay_steps": self.decay_steps,
                "alpha": self.alpha, "name": self.name, "warmup_target": self.warmup_target,
                "warmup_steps": self.warmup_steps}


class CosineDecayRestarts(LearningRateSchedule):
    """Cosine decay with warm restarts (SGDR): the multiplier decays from 1 to alpha over
    first_decay_steps, then restarts; each period is t_mul times longer than the one before and
    starts at m_mul times the previous start."""

    def __init__(self, initial_learning_rate: float, first_decay_steps: int, t_mul: float = 2.0, m_mul: float = 1.0,
                 alpha: float = 0.0, name: str = "SGDRDecay"):
        _positive("CosineDecayRestarts", "first_decay_steps", first_decay_steps)
        if not t_mul > 0:
            raise ValueError(f"CosineDecayRestarts(t_mul={t_mul!r}): must be > 0 (how much longer each period is).")
        self.initial_learning_rate = initial_learning_rate
        self.first_decay_steps = first_decay_steps
        self.t_mul = t_mul
        self.m_mul = m_mul
        self.alpha = alpha
        self.name = name

    def __call__(self, step: int) -> float:
        fraction = _step(step) / self.first_decay_steps
        if self.t_mul == 1.0:
            restart = math.floor(fraction)
            fraction -= restart
        else:
            # Periods of length 1, t, t^2, ... (in units of first_decay_steps) end at (1 - t^i) / (1 - t).
            restart = math.floor(math.log(1.0 - fraction * (1.0 - self.t_mul)) / math.log(self.t_mul))
            done = (1.0 - self.t_mul ** restart) / (1.0 - self.t_mul)
            fraction = (fraction - done) / self.t_mul ** restart
        cosine = 0.5 * self.m_mul ** restart * (1.0 + math.cos(math.pi * fraction))
        return float(self.initial_learning_rate * ((1 - self.alpha) * cosine + self.alpha))

    def get_config(self) -> dict[str, Any]:
        """The constructor's arguments, as JSON (Keras's get_config); from_config(config) rebuilds it."""
        return {"initial_learning_rate": self.initial_learning_rate, "first_decay_steps": self.first_decay_steps,
                "t_mul": self.t_mul, "m_mul": self.m_mul, "alpha": self.alpha, "name": self.name}


_SCHEDULES: dict[str, type[LearningRateSchedule]] = {cls.__name__: cls for cls in (
    ExponentialDecay, PiecewiseConstantDecay, PolynomialDecay, InverseTimeDecay, CosineDecay, CosineDecayRestarts)}


def serialize(schedule: LearningRateSchedule) -> dict[str, Any]:
    """{"class_name": ..., "config": ...} for one of this module's schedules (JSON)."""
    config = _config.to_config(schedule, _SCHEDULES)
    if config is None:
        raise TypeError(f"schedules.serialize({schedule!r}): only the schedules of mr.optimizers.schedules "
                        f"({', '.join(_SCHEDULES)}) have a config that can be saved.")
    return config


def deserialize(config: Mapping[str, Any]) -> LearningRateSchedule:
    """The schedule serialize() described, rebuilt from this module's classes by name."""
    return _config.from_config(config, _SCHEDULES, "learning rate schedule")
