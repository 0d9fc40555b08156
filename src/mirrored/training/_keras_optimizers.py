"""Keras 3's other optimizers as mr.optimizers recipes: Adagrad, Adamax, Nadam, Adadelta, Adafactor
(torch.optim's classes, Keras's names and defaults mapped onto them), Lion, Ftrl, Lamb (Keras's rules
in _update_rules.py) and LossScaleOptimizer (Keras's dynamic loss scale around any of them).

Their weight_decay is Keras's: decoupled, w -= w * weight_decay * lr before each update (torch's
weight_decay= on these classes is an L2 term, so it is left at 0). What the torch classes compute
otherwise differs from Keras's update only where epsilon sits (tests/training/test_keras_optimizers.py
measures it against Keras's own optimizers): Adagrad divides by sqrt(acc) + eps (Keras
sqrt(acc + eps)); Adamax takes max(beta_2 * u, |g| + eps) (Keras max(beta_2 * u, |g|) + eps);
Adafactor floors its second moment at eps^2 (Keras adds epsilon_1 to g^2). Nadam is torch's NAdam with
momentum_decay=1, which is Keras's schedule 0.96^t. Loaded by optimizers.py, which re-exports these
names (import them from there).
"""
from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch
from torch import Tensor

from mirrored.training import _update_rules, optimizers
from mirrored.training.optimizers import Optimizer
from mirrored.training.schedules import LearningRateSchedule

# Keras 3's options every optimizer takes (beside its own hyperparameters), with their defaults.
_OPTIONS = {"clipnorm": None, "clipvalue": None, "global_clipnorm": None, "use_ema": False, "ema_momentum": 0.99,
            "ema_overwrite_frequency": None, "loss_scale_factor": None, "gradient_accumulation_steps": None}


class _Named(Optimizer):
    """A Keras optimizer on a torch class: `settings` are Keras's hyperparameters (its config), `torch_kwargs`
    what the torch class takes; Keras's options and decoupled weight decay are applied around its step."""

    def __init__(self, torch_cls: Callable[..., torch.optim.Optimizer], learning_rate: Any, name: str,
                 weight_decay: float | None, options: Mapping[str, Any], settings: Mapping[str, Any],
                 **torch_kwargs: Any):
        unknown = sorted(set(options) - set(_OPTIONS))
        if unknown:
            raise TypeError(f"{name}({unknown[0]}=...): not an argument of {type(self).__name__}; Keras's options are "
                            f"{', '.join(_OPTIONS)}.")
        if weight_decay is not None and (isinstance(weight_decay, bool) or not isinstance(weight_decay, (int, float))
                                         or weight_decay < 0):
            raise ValueError(f"{name}(weight_decay={weight_decay!r}): must be a number >= 0, or None.")
        super().__init__(torch_cls, learning_rate, name, **{**_OPTIONS, **options}, **torch_kwargs)
        self._options = dataclasses.replace(self._options, decoupled_weight_decay=weight_decay or None)
        self._settings = {"weight_decay": weight_decay, **settings}

    def get_config(self) -> dict[str, Any]:
        """The constructor's arguments, as JSON (Keras's get_config); from_config(config) rebuilds it."""
        return {**self._option_config(), "loss_scale_factor": self.loss_scale_factor, **self._settings}


class Adagrad(_Named):
    """Adagrad (keras.optimizers.Adagrad) on torch.optim.Adagrad."""

    def __init__(self, learning_rate: float | LearningRateSchedule = 0.001, initial_accumulator_value: float = 0.1,
                 epsilon: float = 1e-7, weight_decay: float | None = None, name: str = "Adagrad", **options: Any):
        super().__init__(torch.optim.Adagrad, learning_rate, name, weight_decay, options,
                         {"initial_accumulator_value": initial_accumulator_value, "epsilon": epsilon},
                         initial_accumulator_value=initial_accumulator_value, eps=epsilon, foreach=True)


class Adamax(_Named):
    """Adamax (keras.optimizers.Adamax) on torch.optim.Adamax."""

    def __init__(self, learning_rate: float | LearningRateSchedule = 0.001, beta_1: float = 0.9, beta_2: float = 0.999,
                 epsilon: float = 1e-7, weight_decay: float | None = None, name: str = "Adamax", **options: Any):
        super().__init__(torch.optim.Adamax, learning_rate, name, weight_decay, options,
                         {"beta_1": beta_1, "beta_2": beta_2, "epsilon": epsilon},
                         betas=(beta_1, beta_2), eps=epsilon, foreach=True)


class Nadam(_Named):
    """Adam with Nesterov momentum (keras.optimizers.Nadam) on torch.optim.NAdam, whose momentum schedule
    with momentum_decay=1 is Keras's beta_1 * (1 - 0.5 * 0.96^t)."""

    def __init__(self, learning_rate: float | LearningRateSchedule = 0.001, beta_1: float = 0.9, beta_2: float = 0.999,
                 epsilon: float = 1e-7, weight_decay: float | None = None, name: str = "Nadam", **options: Any):
        super().__init__(torch.optim.NAdam, learning_rate, name, weight_decay, options,
                         {"beta_1": beta_1, "beta_2": beta_2, "epsilon": epsilon},
                         betas=(beta_1, beta_2), eps=epsilon, momentum_decay=1.0, foreach=True)


class Adadelta(_Named):
    """Adadelta (keras.optimizers.Adadelta: learning_rate 0.001, rho 0.95) on torch.optim.Adadelta."""

    def __init__(self, learning_rate: float | LearningRateSchedule = 0.001, rho: float = 0.95, epsilon: float = 1e-7,
                 weight_decay: float | None = None, name: str = "Adadelta", **options: Any):
        super().__init__(torch.optim.Adadelta, learning_rate, name, weight_decay, options,
                         {"rho": rho, "epsilon": epsilon}, rho=rho, eps=epsilon, foreach=True)


class Adafactor(_Named):
    """Adafactor (keras.optimizers.Adafactor) on torch.optim.Adafactor: factored second moments for
    matrices, step min(learning_rate, 1/sqrt(t)) scaled by max(epsilon_2, RMS(w)), updates clipped to
    RMS clip_threshold. relative_step is kept for Keras's config; Keras 3.15 caps the step either way."""

    def __init__(self, learning_rate: float | LearningRateSchedule = 0.001, beta_2_decay: float = -0.8,
                 epsilon_1: float = 1e-30, epsilon_2: float = 1e-3, clip_threshold: float = 1.0,
                 relative_step: bool = True, weight_decay: float | None = None, name: str = "Adafactor",
                 **options: Any):
        if isinstance(clip_threshold, bool) or not isinstance(clip_threshold, (int, float)) or clip_threshold < 1:
            raise ValueError(f"Adafactor(clip_threshold={clip_threshold!r}): must be >= 1 here (torch.optim.Adafactor, "
                             "which computes the update, takes no smaller one).")
        super().__init__(torch.optim.Adafactor, learning_rate, name, weight_decay, options,
                         {"beta_2_decay": beta_2_decay, "epsilon_1": epsilon_1, "epsilon_2": epsilon_2,
                          "clip_threshold": clip_threshold, "relative_step": relative_step},
                         beta2_decay=beta_2_decay, eps=(None, epsilon_2), d=clip_threshold, foreach=False)


class Lion(_Named):
    """Lion (keras.optimizers.Lion): the sign of interpolated momentum (_update_rules.Lion)."""

    def __init__(self, learning_rate: float | LearningRateSchedule = 0.001, beta_1: float = 0.9, beta_2: float = 0.99,
                 weight_decay: float | None = None, name: str = "Lion", **options: Any):
        super().__init__(_update_rules.Lion, learning_rate, name, weight_decay, options,
                         {"beta_1": beta_1, "beta_2": beta_2}, beta_1=beta_1, beta_2=beta_2)


class Ftrl(_Named):
    """Follow-the-regularized-leader (keras.optimizers.Ftrl, _update_rules.Ftrl)."""

    def __init__(self, learning_rate: float | LearningRateSchedule = 0.001, learning_rate_power: float = -0.5,
                 initial_accumulator_value: float = 0.1, l1_regularization_strength: float = 0.0,
                 l2_regularization_strength: float = 0.0, l2_shrinkage_regularization_strength: float = 0.0,
                 beta: float = 0.0, weight_decay: float | None = None, name: str = "Ftrl", **options: Any):
        settings = {"learning_rate_power": learning_rate_power, "initial_accumulator_value": initial_accumulator_value,
                    "l1_regularization_strength": l1_regularization_strength,
                    "l2_regularization_strength": l2_regularization_strength,
                    "l2_shrinkage_regularization_strength": l2_shrinkage_regularization_strength, "beta": beta}
        super().__init__(_update_rules.Ftrl, learning_rate, name, weight_decay, options, settings, **settings)


class Lamb(_Named):
    """LAMB (keras.optimizers.Lamb): Adam's step scaled per tensor by ||w|| / ||step|| (_update_rules.Lamb)."""

    def __init__(self, learning_rate: float | LearningRateSchedule = 0.001, beta_1: float = 0.9, beta_2: float = 0.999,
                 epsilon: float = 1e-7, weight_decay: float | None = None, name: str = "Lamb", **options: Any):
        settings = {"beta_1": beta_1, "beta_2": beta_2, "epsilon": epsilon}
        super().__init__(_update_rules.Lamb, learning_rate, name, weight_decay, options, settings, **settings)


class DynamicScale:
    """A LossScaleOptimizer's loss scale. Every replica's optimizer keeps its own copy of the scale and
    its count of finite updates, which evolve the same (every replica sees the same all-reduced
    gradients), and writes the scale here after each update. `scale` is read for the next step's loss:
    a replica reads it after its own write and before any replica's next one (that one follows the
    next all-reduce), so the replicas always read the scale their own optimizer divides by."""

    def __init__(self, initial_scale: float, growth_steps: int):
        self.scale = float(initial_scale)
        self.growth_steps = growth_steps

    def _own(self, opt: Any) -> list[float]:
        return opt.__dict__.setdefault("_loss_scale", [self.scale, 0])

    def unscale(self, params: Iterable[Tensor], opt: Any) -> bool:
        """Divides the gradients by the scale and updates it; False (skip the update) if any is not finite."""
        own = self._own(opt)
        grads = [p.grad for p in params if p.grad is not None]
        with torch.no_grad():
            if grads:
                torch._foreach_div_(grads, own[0])
            finite = bool(torch.stack([torch.isfinite(g).all() for g in grads]).all()) if grads else True
        if not finite:
            own[:] = [own[0] / 2, 0]
        elif own[1] + 1 == self.growth_steps:
            own[:] = [own[0] * 2, 0]
        else:
            own[1] += 1
        self.scale = own[0]
        return finite

    def state_of(self, opt: Any) -> dict[str, float]:
        scale, count = self._own(opt)
        return {"scale": scale, "finite_steps": count}

    def load(self, opt: Any, state: Mapping[str, float]) -> None:
        opt.__dict__["_loss_scale"] = [float(state["scale"]), int(state["finite_steps"])]
        self.scale = float(state["scale"])


class LossScaleOptimizer(Optimizer):
    """Keras's dynamic loss scaling around another optimizer (keras.optimizers.LossScaleOptimizer): the
    loss is multiplied by the scale (`scale_loss`, which fit applies through `loss_scale_factor`), the
    all-reduced gradients divided by it; an update with a non-finite gradient is skipped and halves the
    scale, and dynamic_growth_steps finite updates in a row double it."""

    def __init__(self, inner_optimizer: Any, initial_scale: float = 32768.0, dynamic_growth_steps: int = 2000,
                 name: str | None = None):
        inner = optimizers.get(inner_optimizer)
        if isinstance(inner, LossScaleOptimizer) or inner.loss_scale_factor is not None:
            raise ValueError(f"LossScaleOptimizer({inner!r}): the inner optimizer scales the loss already "
                             "(loss_scale_factor or a LossScaleOptimizer); give it without.")
        if isinstance(initial_scale, bool) or not isinstance(initial_scale, (int, float)) or not initial_scale > 0:
            raise ValueError(f"LossScaleOptimizer(initial_scale={initial_scale!r}): must be a number > 0.")
        if isinstance(dynamic_growth_steps, bool) or not isinstance(dynamic_growth_steps, int) \
                or dynamic_growth_steps < 1:
            raise ValueError(f"LossScaleOptimizer(dynamic_growth_steps={dynamic_growth_steps!r}): must be an int >= 1.")
        # The inner recipe's torch class, settings and options, built with the scale added.
        self.__dict__.update(copy.copy(inner.__dict__))
        self._built = []
        self.inner_optimizer = inner
        self.initial_scale, self.dynamic_growth_steps = float(initial_scale), dynamic_growth_steps
        self._dynamic = DynamicScale(initial_scale, dynamic_growth_steps)
        self._options = dataclasses.replace(inner._options, dynamic_scale=self._dynamic)
        self.name = name or "loss_scale_optimizer"

    @property
    def loss_scale_factor(self) -> float:  # type: ignore[override]
        """The current dynamic scale: what the next step's loss is multiplied by."""
        return self._dynamic.scale

    def scale_loss(self, loss: Tensor) -> Tensor:
        """loss * the current scale (Keras's scale_loss): call it on the loss before backward()."""
        return loss * self._dynamic.scale

    def get_config(self) -> dict[str, Any]:
        """The constructor's arguments, as JSON (Keras's get_config); from_config(config) rebuilds it."""
        inner = optimizers.serialize(self.inner_optimizer)
        if inner is None:
            raise NotImplementedError(f"{self.name}: its inner optimizer {self.inner_optimizer!r} has no config.")
        return {"inner_optimizer": inner, "initial_scale": self.initial_scale,
                "dynamic_growth_steps": self.dynamic_growth_steps, "name": self.name}

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> Optimizer:
        """A new instance from get_config()'s dict, its inner optimizer rebuilt from its own config."""
        config = dict(config)
        config["inner_optimizer"] = optimizers.deserialize(config["inner_optimizer"])
        return cls(**config)

    def __repr__(self) -> str:
        return f"LossScaleOptimizer({self.inner_optimizer!r}, initial_scale={self.initial_scale})"


CLASSES = (Adagrad, Adamax, Nadam, Adadelta, Adafactor, Lion, Ftrl, Lamb, LossScaleOptimizer)
