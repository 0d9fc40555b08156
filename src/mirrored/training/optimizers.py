"""Optimizers with Keras 3's names and options on torch's update rules: `mr.optimizers.SGD(learning_rate=0.1)`.

An `Optimizer` is a recipe: `build(params)` (or calling it with the parameters) makes the torch
optimizer of one replica, so both `model.compile(optimizer=...)` and
`strategy.mirror_optimizer(mr.optimizers.SGD(...), mnet)` take one. Keras 3's options act in each
built optimizer's `step()`, which runs after the gradients are all-reduced:

- `learning_rate=` a schedule from `mr.optimizers.schedules`, evaluated at the optimizer's step count;
- `clipnorm` (each gradient), `global_clipnorm` (all of them together) or `clipvalue`. Keras under
  MirroredStrategy clips each replica's gradient before the sum, so N replicas clip to N times the
  norm; here the all-reduced gradient is clipped, which gives exactly the single-device update;
- `gradient_accumulation_steps=k`: k steps add up their gradients locally and the k-th updates with
  their average; `accumulate_gradients()` tells the caller whether this step all-reduces (once per
  update);
- `use_ema`: a moving average of the weights (`ema_momentum`), written into them every
  `ema_overwrite_frequency` steps and by `finalize_variable_values()` (fit does it at its end).

The step count (`iterations`), the accumulated gradients and the averages are in the torch
optimizer's `state_dict()` (under "keras"), so checkpoints restore them; the accumulated gradients
are each replica's own, so replicas_state_dict() saves every replica's and
load_replicas_state_dict() gives them back (their sum to replica 0 under another replica count).
`learning_rate` reads the current rate and, without a schedule, sets it (callbacks such as
ReduceLROnPlateau); with several parameter groups it is the first group's, and setting it scales every
group's rate by the same factor, so a head trained at 10x stays at 10x. get() takes a name, an
Optimizer, a config, a torch optimizer class or instance; an instance hands over its class and
defaults, every parameter group's hyperparameters and its state (_from_instance.py). Hyperparameter
defaults are Keras 3's. get_config()/from_config() and serialize()/deserialize() round-trip through JSON.
Keras 3's other optimizers (Adagrad, Adamax, Nadam, Adadelta, Adafactor on torch.optim; Lion, Ftrl,
Lamb on _update_rules.py; LossScaleOptimizer) are in _keras_optimizers.py, re-exported here; they also
take Keras's decoupled weight_decay and loss_scale_factor, which step() applies.
Uses torch, schedules.py, _config.py, _from_instance.py and the two modules above.
"""
from __future__ import annotations

import copy
import dataclasses
import inspect
import warnings
import weakref
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import torch
from torch import Tensor

import mirrored.distribute as md
from mirrored.training import _config, schedules
from mirrored.training._from_instance import InstanceGroups
from mirrored.training.schedules import LearningRateSchedule

__all__ = ["SGD", "Adadelta", "Adafactor", "Adagrad", "Adam", "AdamW", "Adamax", "Ftrl", "Lamb", "Lion",
           "LossScaleOptimizer", "Nadam", "Optimizer", "RMSprop", "deserialize", "get", "load_replicas_state_dict",
           "replicas_state_dict", "schedules", "serialize"]

_STATE_KEY = "keras"  # the key of our state in a built optimizer's state_dict()


@dataclasses.dataclass(frozen=True)
class _Options:
    """Keras 3's options, shared by every torch optimizer a recipe builds."""

    schedule: LearningRateSchedule | None = None
    clipnorm: float | None = None
    clipvalue: float | None = None
    global_clipnorm: float | None = None
    accumulation_steps: int = 1
    use_ema: bool = False
    ema_momentum: float = 0.99
    ema_overwrite_frequency: int | None = None
    # Keras's decoupled weight decay, w -= w * weight_decay * lr before each update (the named
    # optimizers whose torch class has no such rule use it; SGD, Adam and RMSprop keep torch's L2 term).
    decoupled_weight_decay: float | None = None
    loss_scale_factor: float | None = None  # Keras's static loss scale: gradients are divided by it
    dynamic_scale: Any = None  # a LossScaleOptimizer's shared scale (_keras_optimizers.DynamicScale)


def _check_options(name: str, clipnorm: Any, clipvalue: Any, global_clipnorm: Any, gradient_accumulation_steps: Any,
                   use_ema: Any, ema_momentum: Any, ema_overwrite_frequency: Any) -> None:
    clips = {"clipnorm": clipnorm, "clipvalue": clipvalue, "global_clipnorm": global_clipnorm}
    given = {k: v for k, v in clips.items() if v is not None}
    if len(given) > 1:
        raise ValueError(f"{name}({', '.join(f'{k}={v!r}' for k, v in given.items())}): give at most one of "
                         "clipnorm, clipvalue and global_clipnorm (as Keras).")
    for key, value in given.items():
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
            raise ValueError(f"{name}({key}={value!r}): must be a number > 0, or None for no clipping.")
    steps = gradient_accumulation_steps
    if steps is not None and (isinstance(steps, bool) or not isinstance(steps, int) or steps < 2):
        raise ValueError(f"{name}(gradient_accumulation_steps={steps!r}): must be an int >= 2 (updates every that "
                         "many steps), or None to update every step.")
    if not isinstance(use_ema, bool):
        raise TypeError(f"{name}(use_ema={use_ema!r}): must be True or False.")
    if isinstance(ema_momentum, bool) or not isinstance(ema_momentum, (int, float)) or not 0 <= ema_momentum <= 1:
        raise ValueError(f"{name}(ema_momentum={ema_momentum!r}): must be in [0, 1], e.g. 0.99.")
    freq = ema_overwrite_frequency
    if freq is not None and (isinstance(freq, bool) or not isinstance(freq, int) or freq < 1):
        raise ValueError(f"{name}(ema_overwrite_frequency={freq!r}): must be an int >= 1 (steps between writes of "
                         "the averages into the weights), or None to write them only at the end.")


class Optimizer:
    """A torch optimizer class, its hyperparameters and Keras 3's options; one torch optimizer is built
    per replica, and every built one applies the options in its step()."""

    def __init__(self, torch_cls: Callable[..., torch.optim.Optimizer],
                 learning_rate: float | LearningRateSchedule = 0.001, name: str | None = None, *,
                 clipnorm: float | None = None, clipvalue: float | None = None, global_clipnorm: float | None = None,
                 gradient_accumulation_steps: int | None = None, use_ema: bool = False, ema_momentum: float = 0.99,
                 ema_overwrite_frequency: int | None = None, loss_scale_factor: float | None = None,
                 **torch_kwargs: Any):
        name = name or getattr(torch_cls, "__name__", "Optimizer")
        if isinstance(learning_rate, LearningRateSchedule):
            schedule, rate = learning_rate, float(learning_rate(0))
        elif isinstance(learning_rate, bool) or not isinstance(learning_rate, (int, float)) or learning_rate < 0:
            raise ValueError(f"{name}(learning_rate={learning_rate!r}): give a non-negative number, e.g. 0.01, or a "
                             "schedule from mr.optimizers.schedules.")
        else:
            schedule, rate = None, float(learning_rate)
        _check_options(name, clipnorm, clipvalue, global_clipnorm, gradient_accumulation_steps, use_ema,
                       ema_momentum, ema_overwrite_frequency)
        if loss_scale_factor is not None and (isinstance(loss_scale_factor, bool) or not isinstance(
                loss_scale_factor, (int, float)) or not loss_scale_factor > 0):
            raise ValueError(f"{name}(loss_scale_factor={loss_scale_factor!r}): must be a number > 0 (the loss is "
                             "multiplied by it and the gradients divided), or None.")
        _with_options(torch_cls)  # checks that it is a torch optimizer class, now rather than at build()
        self._torch_cls = torch_cls
        self._lr = rate
        self._schedule = schedule
        self._kwargs = torch_kwargs
        self.name = name
        self.clipnorm, self.clipvalue, self.global_clipnorm = clipnorm, clipvalue, global_clipnorm
        self.gradient_accumulation_steps = gradient_accumulation_steps
        self.use_ema, self.ema_momentum, self.ema_overwrite_frequency = use_ema, ema_momentum, ema_overwrite_frequency
        self.loss_scale_factor = loss_scale_factor
        self._options = _Options(schedule, clipnorm, clipvalue, global_clipnorm, gradient_accumulation_steps or 1,
                                 use_ema, float(ema_momentum), ema_overwrite_frequency,
                                 loss_scale_factor=loss_scale_factor)
        self._built: list[weakref.ref] = []
        # A torch optimizer instance's groups and state (get(instance)), built into every optimizer.
        self._from_instance: InstanceGroups | None = None

    # ---- building ---------------------------------------------------------------------------------
    def build(self, params: Iterable[torch.nn.Parameter]) -> torch.optim.Optimizer:
        """A new torch optimizer over `params` with this recipe's hyperparameters and options (and, for
        one made from a torch optimizer instance, its parameter groups and state)."""
        lr = self._lr if self._schedule is None else self._schedule(0)
        groups = self._from_instance
        if groups is None:
            opt = _with_options(self._torch_cls)(params, lr=lr, **self._kwargs)
        else:
            opt = _with_options(self._torch_cls)(groups.groups_for(list(params)), lr=lr, **self._kwargs)
        opt._set_options(self._options)
        state = groups.state_dict() if groups is not None else None
        if state is not None:
            opt.load_state_dict(state)
        self._built = [r for r in self._built if r() is not None] + [weakref.ref(opt)]
        return opt

    def __call__(self, params: Iterable[torch.nn.Parameter]) -> torch.optim.Optimizer:
        """build(params): a recipe is what strategy.mirror_optimizer calls once per replica."""
        return self.build(params)

    def _live(self) -> list[torch.optim.Optimizer]:
        return [opt for opt in (r() for r in self._built) if opt is not None]

    # ---- state -------------------------------------------------------------------------------------
    @property
    def learning_rate(self) -> float:
        """The rate of the next update: the schedule's value at the step count, or the rate last set
        (the first parameter group's; setting it scales every group's rate by the same factor)."""
        live = self._live()
        if self._schedule is not None:
            return float(self._schedule(live[-1]._micro_steps if live else 0))
        return float(live[-1].param_groups[0]["lr"]) if live else self._lr

    @learning_rate.setter
    def learning_rate(self, value: float) -> None:
        value = settable_rate(self.name, self._schedule, value)
        self._lr = value
        if self._from_instance is not None:
            _set_rate(self._from_instance.hparams, value, self.name)
        for opt in self._live():
            _set_rate(opt.param_groups, value, self.name)

    @property
    def iterations(self) -> int:
        """Updates applied so far (with gradient accumulation, steps // gradient_accumulation_steps, as Keras)."""
        live = self._live()
        return live[-1].iterations if live else 0

    def finalize_variable_values(self) -> None:
        """With use_ema, writes the moving averages into the weights of every optimizer built from this
        recipe (Keras's finalize_variable_values; fit calls it when training ends)."""
        for opt in self._live():
            opt.finalize_variable_values()

    # ---- config --------------------------------------------------------------------------------------
    def _option_config(self) -> dict[str, Any]:
        rate = schedules.serialize(self._schedule) if self._schedule is not None else self._lr
        return {"name": self.name, "learning_rate": rate, "clipnorm": self.clipnorm,
                "global_clipnorm": self.global_clipnorm, "clipvalue": self.clipvalue, "use_ema": self.use_ema,
                "ema_momentum": self.ema_momentum, "ema_overwrite_frequency": self.ema_overwrite_frequency,
                "gradient_accumulation_steps": self.gradient_accumulation_steps}

    def get_config(self) -> dict[str, Any]:
        """Keras-style config: the options, the torch.optim class's name and its keyword arguments."""
        if getattr(torch.optim, getattr(self._torch_cls, "__name__", ""), None) is not self._torch_cls:
            raise NotImplementedError(f"{self.name}: the optimizer class {self._torch_cls!r} is not one of "
                                      "torch.optim's, so no config can rebuild it.")
        config = {"torch_class": self._torch_cls.__name__, **self._option_config(), **self._kwargs}
        if self._from_instance is not None:  # [{"params": [positions in the model's parameters], **settings}]
            config["param_groups"] = self._from_instance.config()
        return config

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> Optimizer:
        """A new instance from get_config()'s dict (Keras's from_config)."""
        config = dict(config)
        if isinstance(config.get("learning_rate"), Mapping):
            config["learning_rate"] = schedules.deserialize(config["learning_rate"])
        if cls is not Optimizer:
            return cls(**config)
        name = config.pop("torch_class", None)
        groups = config.pop("param_groups", None)
        torch_cls = getattr(torch.optim, str(name), None)
        if not (isinstance(torch_cls, type) and issubclass(torch_cls, torch.optim.Optimizer)):
            raise ValueError(f"Optimizer config: torch_class {name!r} is not a torch.optim optimizer.")
        optimizer = cls(torch_cls, **config)
        if groups is not None:
            optimizer._from_instance = InstanceGroups.from_config(groups, optimizer.name)
        return optimizer

    def __repr__(self) -> str:
        try:
            config = self.get_config()
        except NotImplementedError:
            config = dict(self._kwargs)
        config["learning_rate"] = self._schedule or self._lr
        if self._from_instance is not None:
            config["param_groups"] = len(self._from_instance.hparams)  # (their count: the settings are long)
        shown = {k: v for k, v in config.items()
                 if k not in ("name", "torch_class") and not (k in _OPTION_DEFAULTS and v == _OPTION_DEFAULTS[k])}
        return f"{self.name}({', '.join(f'{k}={v!r}' for k, v in shown.items())})"

    # ---- in a model's steps ------------------------------------------------------------------------
    _steps: Any = None  # set by mr.Model's compile() and build_optimizer(): the mirrored optimizer it acts on

    def step(self) -> None:
        """In a model's train_step: all-reduces the calling replica's gradients with every other replica's
        and applies the update (to the optimizer mr.Model built from this recipe)."""
        self._bound("step").step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clears the gradients of the parameters this recipe's model optimizer updates (the calling
        replica's inside a step)."""
        self._bound("zero_grad").zero_grad(set_to_none)

    def scale_loss(self, loss: Tensor) -> Tensor:
        """Keras's scale_loss: the loss times loss_scale_factor, if set, and by the replica's fp16 loss
        scale under compile(precision="fp16"); step() and apply() undo both."""
        factor = getattr(self, "loss_scale_factor", None)
        if self._steps is None:
            return loss if factor is None else loss * factor
        return self._steps.scale_loss(loss, factor)

    def apply(self, grads: Sequence[Tensor | None], trainable_variables: Sequence[Any] | None = None) -> None:
        """Keras's apply: sets `grads` as the gradients of `trainable_variables` (the optimizer's
        parameters, in order, by default) and steps."""
        self._bound("apply").apply(grads, trainable_variables)

    def _bound(self, what: str) -> Any:
        if self._steps is None:
            raise RuntimeError(f"{self.name}.{what}(): this optimizer is not a model's yet. Compile an mr.Model with "
                               f"it (model.compile(optimizer=...)) or make it with model.build_optimizer(...); in a "
                               "custom loop, call step() on what strategy.mirror_optimizer returns.")
        return self._steps


def settable_rate(name: str, schedule: Any, value: Any) -> float:
    """`value` as the new float learning rate of the optimizer `name`: refused where the optimizer was
    made with a schedule (as in Keras) or where it is negative."""
    if schedule is not None:
        raise TypeError(f"{name} was created with the schedule {schedule!r} as its learning_rate, so "
                        "the rate cannot be set (as in Keras). Create it with a float learning_rate to set it.")
    value = float(value)
    if value < 0:
        raise ValueError(f"{name}.learning_rate = {value}: the learning rate must be non-negative.")
    return value


def _set_rate(groups: Sequence[Any], value: float, name: str) -> None:
    """Sets the first group's rate to `value` and scales the others' by the same factor (all of them to
    `value` when they share one rate), as torch's ReduceLROnPlateau scales every group."""
    first = float(groups[0]["lr"])
    if value == first:
        return
    if all(float(g["lr"]) == first for g in groups):
        for g in groups:
            g["lr"] = value
        return
    if first == 0:
        raise ValueError(f"{name}.learning_rate = {value}: the first parameter group's rate is 0 and the others' are "
                         "not, so no common factor scales them. Set each group's rate: "
                         "model.mirrored_optimizer.param_groups[i]['lr'] = ...")
    factor = value / first
    groups[0]["lr"] = value
    for g in groups[1:]:
        g["lr"] = g["lr"] * factor


_OPTION_DEFAULTS = {"clipnorm": None, "global_clipnorm": None, "clipvalue": None, "use_ema": False,
                    "ema_momentum": 0.99, "ema_overwrite_frequency": None, "gradient_accumulation_steps": None,
                    "loss_scale_factor": None}


# ---------------------------------------------------------------------------------------------
# Keras 3's optimizers by name.

class SGD(Optimizer):
    """Stochastic gradient descent (keras.optimizers.SGD) on torch.optim.SGD. weight_decay is torch's L2
    term added to the gradient (Keras decays the weights directly, decoupled from the gradient)."""

    def __init__(self, learning_rate: float | LearningRateSchedule = 0.01, momentum: float = 0.0,
                 nesterov: bool = False, weight_decay: float | None = None, clipnorm: float | None = None,
                 clipvalue: float | None = None, global_clipnorm: float | None = None, use_ema: bool = False,
                 ema_momentum: float = 0.99, ema_overwrite_frequency: int | None = None,
                 gradient_accumulation_steps: int | None = None, name: str = "SGD"):
        super().__init__(torch.optim.SGD, learning_rate, name, clipnorm=clipnorm, clipvalue=clipvalue,
                         global_clipnorm=global_clipnorm, use_ema=use_ema, ema_momentum=ema_momentum,
                         ema_overwrite_frequency=ema_overwrite_frequency,
                         gradient_accumulation_steps=gradient_accumulation_steps, momentum=momentum,
                         nesterov=nesterov, weight_decay=weight_decay or 0.0, foreach=True)
        # foreach=True: torch defaults to a Python loop over the parameters on the CPU (~3 torch calls each,
        # held under the GIL that replica threads share); its foreach path does the same arithmetic in one
        # call per step of the update, bit for bit (tests/training/test_optimizers.py checks).
        self._settings = {"weight_decay": weight_decay, "momentum": momentum, "nesterov": nesterov}

    def get_config(self) -> dict[str, Any]:
        """The constructor's arguments, as JSON (Keras's get_config); from_config(config) rebuilds it."""
        return {**self._option_config(), **self._settings}


class Adam(Optimizer):
    """Adam (keras.optimizers.Adam defaults, epsilon 1e-7) on torch.optim.Adam. weight_decay is torch's L2
    term added to the gradient; for Keras's decoupled decay use AdamW, which is the same in both."""

    def __init__(self, learning_rate: float | LearningRateSchedule = 0.001, beta_1: float = 0.9, beta_2: float = 0.999,
                 epsilon: float = 1e-7, amsgrad: bool = False, weight_decay: float | None = None,
                 clipnorm: float | None = None, clipvalue: float | None = None, global_clipnorm: float | None = None,
                 use_ema: bool = False, ema_momentum: float = 0.99, ema_overwrite_frequency: int | None = None,
                 gradient_accumulation_steps: int | None = None, name: str = "Adam"):
        super().__init__(torch.optim.Adam, learning_rate, name, clipnorm=clipnorm, clipvalue=clipvalue,
                         global_clipnorm=global_clipnorm, use_ema=use_ema, ema_momentum=ema_momentum,
                         ema_overwrite_frequency=ema_overwrite_frequency,
                         gradient_accumulation_steps=gradient_accumulation_steps, betas=(beta_1, beta_2),
                         eps=epsilon, amsgrad=amsgrad, weight_decay=weight_decay or 0.0)
        self._settings = {"weight_decay": weight_decay, "beta_1": beta_1, "beta_2": beta_2, "epsilon": epsilon,
                          "amsgrad": amsgrad}

    def get_config(self) -> dict[str, Any]:
        """The constructor's arguments, as JSON (Keras's get_config); from_config(config) rebuilds it."""
        return {**self._option_config(), **self._settings}


class AdamW(Optimizer):
    """Adam with decoupled weight decay (keras.optimizers.AdamW) on torch.optim.AdamW."""

    def __init__(self, learning_rate: float | LearningRateSchedule = 0.001, weight_decay: float = 0.004,
                 beta_1: float = 0.9, beta_2: float = 0.999, epsilon: float = 1e-7, amsgrad: bool = False,
                 clipnorm: float | None = None, clipvalue: float | None = None, global_clipnorm: float | None = None,
                 use_ema: bool = False, ema_momentum: float = 0.99, ema_overwrite_frequency: int | None = None,
                 gradient_accumulation_steps: int | None = None, name: str = "AdamW"):
        super().__init__(torch.optim.AdamW, learning_rate, name, clipnorm=clipnorm, clipvalue=clipvalue,
                         global_clipnorm=global_clipnorm, use_ema=use_ema, ema_momentum=ema_momentum,
                         ema_overwrite_frequency=ema_overwrite_frequency,
                         gradient_accumulation_steps=gradient_accumulation_steps, betas=(beta_1, beta_2),
                         eps=epsilon, amsgrad=amsgrad, weight_decay=weight_decay)
        self._settings = {"weight_decay": weight_decay, "beta_1": beta_1, "beta_2": beta_2, "epsilon": epsilon,
                          "amsgrad": amsgrad}

    def get_config(self) -> dict[str, Any]:
        """The constructor's arguments, as JSON (Keras's get_config); from_config(config) rebuilds it."""
        return {**self._option_config(), **self._settings}


class RMSprop(Optimizer):
    """RMSprop with Keras's names on torch.optim.RMSprop (torch's update rule)."""

    def __init__(self, learning_rate: float | LearningRateSchedule = 0.001, rho: float = 0.9, momentum: float = 0.0,
                 epsilon: float = 1e-7, centered: bool = False, clipnorm: float | None = None,
                 clipvalue: float | None = None, global_clipnorm: float | None = None, use_ema: bool = False,
                 ema_momentum: float = 0.99, ema_overwrite_frequency: int | None = None,
                 gradient_accumulation_steps: int | None = None, name: str = "RMSprop"):
        super().__init__(torch.optim.RMSprop, learning_rate, name, clipnorm=clipnorm, clipvalue=clipvalue,
                         global_clipnorm=global_clipnorm, use_ema=use_ema, ema_momentum=ema_momentum,
                         ema_overwrite_frequency=ema_overwrite_frequency,
                         gradient_accumulation_steps=gradient_accumulation_steps, alpha=rho, momentum=momentum,
                         eps=epsilon, centered=centered)
        self._settings = {"rho": rho, "momentum": momentum, "epsilon": epsilon, "centered": centered}

    def get_config(self) -> dict[str, Any]:
        """The constructor's arguments, as JSON (Keras's get_config); from_config(config) rebuilds it."""
        return {**self._option_config(), **self._settings}


# Keras 3's other optimizers, beside this module (they build on Optimizer above, importing it from here).
from mirrored.training._keras_optimizers import (  # noqa: E402
    Adadelta,
    Adafactor,
    Adagrad,
    Adamax,
    Ftrl,
    Lamb,
    Lion,
    LossScaleOptimizer,
    Nadam,
)

# Keras's names: the class name in lower case (keras.optimizers.get's rule).
_OPTIMIZERS: dict[str, type[Optimizer]] = {cls.__name__.lower(): cls for cls in (
    SGD, Adam, AdamW, RMSprop, Adagrad, Adamax, Nadam, Adadelta, Adafactor, Lion, Ftrl, Lamb)}
_CLASSES: dict[str, type[Optimizer]] = {cls.__name__: cls for cls in (
    Optimizer, *_OPTIMIZERS.values(), LossScaleOptimizer)}
# Keras 3.15 optimizers that mr.optimizers does not have, and what to use instead.
_NOT_HERE = {
    "lossscaleoptimizer": "LossScaleOptimizer wraps another optimizer: "
                          "mr.optimizers.LossScaleOptimizer(mr.optimizers.Adam()).",
    "muon": "Muon: torch.optim.Muon (2-D weights only; pass it as compile(optimizer=torch.optim.Muon) for a "
            "module of matrices), or mr.optimizers.AdamW.",
    "multioptimizer": "MultiOptimizer: give the parameter groups to a torch optimizer "
                      "(torch.optim.Adam([{'params': head.parameters(), 'lr': 1e-2}, ...])) and pass that.",
    "optimizermap": "OptimizerMap: give the parameter groups to a torch optimizer "
                    "(torch.optim.Adam([{'params': head.parameters(), 'lr': 1e-2}, ...])) and pass that.",
    "schedulefreeadamw": "ScheduleFreeAdamW: it swaps weights between training and evaluation, which "
                         "mr.Model does not do; use mr.optimizers.AdamW with a schedule.",
}


def serialize(optimizer: Optimizer) -> dict[str, Any] | None:
    """{"class_name": ..., "config": ...} (JSON), or None for an optimizer no config can rebuild (a torch
    optimizer class outside torch.optim, a subclass, settings JSON cannot hold)."""
    return _config.to_config(optimizer, _CLASSES)


def deserialize(config: Mapping[str, Any]) -> Optimizer:
    """The optimizer serialize() described, rebuilt from mirrored's classes and torch.optim's by name."""
    return _config.from_config(config, _CLASSES, "optimizer")


def get(identifier: Any) -> Optimizer:
    """An Optimizer from a name, an Optimizer, a serialize() config, a torch optimizer class, or a torch
    optimizer instance: its class, defaults, parameter groups (mapped onto the model's parameters by
    identity when first built) and state are carried over."""
    if isinstance(identifier, Optimizer):
        return identifier
    if isinstance(identifier, str):
        key = identifier.lower()
        if key in _NOT_HERE:
            raise ValueError(f"optimizer {identifier!r}: {_NOT_HERE[key]}")
        try:
            return _OPTIMIZERS[key]()
        except KeyError:
            raise ValueError(f"unknown optimizer {identifier!r}. Known names: {', '.join(sorted(_OPTIMIZERS))}; "
                             "or pass mr.optimizers.SGD(...), a torch.optim class, or an instance.") from None
    if isinstance(identifier, Mapping):
        return deserialize(identifier)
    if isinstance(identifier, torch.optim.Optimizer):
        return _from_torch_instance(identifier)
    if isinstance(identifier, type) and issubclass(identifier, torch.optim.Optimizer):
        lr = inspect.signature(identifier).parameters.get("lr")
        default_lr = lr.default if lr is not None and isinstance(lr.default, (int, float)) else 0.001
        return Optimizer(identifier, float(default_lr), identifier.__name__)
    raise TypeError(f"compile(optimizer={identifier!r}): expected a name ({', '.join(sorted(_OPTIMIZERS))}), "
                    "an mr.optimizers optimizer, a torch.optim class, or a torch optimizer instance.")


def _from_torch_instance(instance: torch.optim.Optimizer) -> Optimizer:
    """The recipe that builds, for every replica, what `instance` is: its class and defaults, its
    groups' hyperparameters and its state (and, for one an mr.optimizers recipe built, its options)."""
    if isinstance(instance, md.MirroredOptimizer):
        raise TypeError(f"compile(optimizer={instance!r}): compile() builds the model's mirrored optimizer itself. "
                        "Pass a torch optimizer over the module's parameters (torch.optim.SGD(net.parameters(), "
                        "...)), its class, or an mr.optimizers optimizer.")
    torch_cls = _torch_class_of(type(instance))
    name = torch_cls.__name__
    defaults = _constructor_arguments(torch_cls, instance.defaults)
    options: _Options | None = getattr(instance, "_options", None)
    keras: dict[str, Any] = {}
    if options is not None:  # one an mr.optimizers recipe built: its Keras options too
        if any(a is not None for a in instance._accumulators or []):
            raise ValueError(f"compile(optimizer=<{name} instance>): it holds gradients accumulated towards its next "
                             "update (gradient_accumulation_steps), which are one replica's. Pass it after an update, "
                             "or pass the mr.optimizers optimizer it was built from.")
        if options.dynamic_scale is not None:
            raise ValueError(f"compile(optimizer=<{name} instance>): it was built by a LossScaleOptimizer, whose scale "
                             "the instance does not carry over. Pass the mr.optimizers.LossScaleOptimizer itself.")
        keras = {"clipnorm": options.clipnorm, "clipvalue": options.clipvalue,
                 "global_clipnorm": options.global_clipnorm, "use_ema": options.use_ema,
                 "ema_momentum": options.ema_momentum, "ema_overwrite_frequency": options.ema_overwrite_frequency,
                 "gradient_accumulation_steps": options.accumulation_steps if options.accumulation_steps > 1 else None,
                 "loss_scale_factor": options.loss_scale_factor}
    groups = InstanceGroups.of(instance, name)
    rate = options.schedule if options is not None and options.schedule is not None else float(groups.hparams[0]["lr"])
    recipe = Optimizer(torch_cls, rate, name, **keras, **defaults)
    if options is not None and options.decoupled_weight_decay:
        recipe._options = dataclasses.replace(recipe._options, decoupled_weight_decay=options.decoupled_weight_decay)
    recipe._from_instance = groups
    return recipe


def _constructor_arguments(torch_cls: type, defaults: Mapping[str, Any]) -> dict[str, Any]:
    """The defaults the class's constructor takes, but lr (AdamW's defaults hold decoupled_weight_decay,
    which AdamW sets itself and does not take)."""
    parameters = inspect.signature(torch_cls).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values()):
        return {k: v for k, v in defaults.items() if k != "lr"}
    return {k: v for k, v in defaults.items() if k != "lr" and k in parameters}


def from_instance(optimizer: Any) -> InstanceGroups | None:
    """The groups and state of the torch optimizer instance `optimizer` (a recipe) was made from, if any."""
    return getattr(optimizer, "_from_instance", None)


def warn_if_instance_changed(optimizer: Any, stacklevel: int = 2) -> None:
    """Warns when the torch optimizer instance given to compile() changed since (a scheduler built on it
    and stepped by hand): the model trains with its own optimizer, so the change does nothing."""
    groups = from_instance(optimizer)
    change = groups.changes_since_compile() if groups is not None else None
    if change is not None:
        warnings.warn(f"the {groups.name} optimizer given to compile() changed after compile ({change}), but the "
                      "model trains with model.mirrored_optimizer, which compile() built from it: the change has no "
                      "effect. Pass its scheduler to mr.callbacks.TorchLRScheduler(scheduler), which moves it onto "
                      "the model's optimizer, or change model.mirrored_optimizer.param_groups instead.",
                      UserWarning, stacklevel=stacklevel + 1)


# ---------------------------------------------------------------------------------------------
# One replica's torch optimizer with Keras's options. Every replica applies the same all-reduced
# gradients with the same options, so each computes the same clipping, average and count.

class _KerasSteps:
    """Mixed into a subclass of the recipe's torch optimizer class (so it is still, e.g., a torch.optim.SGD):
    step() applies gradient accumulation, clipping, the schedule and EMA around the class's own step."""

    _options: _Options
    _micro_steps: int  # Keras's optimizer._iterations: every step() call, accumulating ones included
    _accumulators: list[Tensor | None] | None  # this replica's local gradient sums between updates
    _averages: list[Tensor] | None  # EMA of each parameter
    _ready: bool | None  # accumulate_gradients()'s answer for the step in progress

    def _set_options(self, options: _Options) -> None:
        self._options = options
        self._micro_steps = 0
        self._accumulators = None
        self._averages = None
        self._ready = None

    def _params(self) -> list[Tensor]:
        return [p for group in self.param_groups for p in group["params"]]

    @property
    def gradient_accumulation_steps(self) -> int:
        """Steps per update (1: every step updates); a mirrored optimizer all-reduces only on updates."""
        return self._options.accumulation_steps

    @property
    def iterations(self) -> int:
        """Updates applied: steps // gradient_accumulation_steps, as Keras counts them."""
        return self._micro_steps // self._options.accumulation_steps

    def scale_loss(self, loss: Tensor) -> Tensor:
        """loss times this optimizer's loss scale (Keras's scale_loss): its LossScaleOptimizer's current
        scale, or loss_scale_factor, or 1; step() divides the gradients by the same."""
        dynamic = self._options.dynamic_scale
        if dynamic is not None:
            return loss * dynamic.state_of(self)["scale"]
        return loss * self._options.loss_scale_factor if self._options.loss_scale_factor else loss

    def accumulate_gradients(self) -> bool:
        """Whether this step updates the weights. With gradient_accumulation_steps=k, the first k - 1 steps
        of every k move their gradients into local sums and return False (no all-reduce is needed); the
        k-th adds the sums to its gradients and returns True, so that one all-reduce sends all k. Call it
        before the all-reduce; step() calls it itself when the caller did not."""
        if self._ready is not None:
            return self._ready
        self._note_for_rollback()
        k = self._options.accumulation_steps
        ready = (self._micro_steps + 1) % k == 0
        if k > 1:
            params = self._params()
            if self._accumulators is None:
                self._accumulators = [None] * len(params)
            with torch.no_grad():
                for i, p in enumerate(params):
                    acc, grad = self._accumulators[i], p.grad
                    if ready:
                        if acc is not None:
                            p.grad = acc if grad is None else grad.add_(acc)
                        self._accumulators[i] = None
                    elif grad is not None:
                        self._accumulators[i] = grad.detach().clone() if acc is None else acc.add_(grad)
        self._ready = ready
        return ready

    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """Keras 3's order: average the accumulated gradients, clip, evaluate the schedule, update, then
        update the moving averages and count the step."""
        options = self._options
        if closure is not None and (options.accumulation_steps > 1 or options.clipnorm or options.clipvalue
                                    or options.global_clipnorm):
            raise ValueError("step(closure): clipping and gradient accumulation act on the gradients present "
                             "before step(), which a closure would recompute. Call step() without a closure.")
        ready = self.accumulate_gradients()
        self._ready = None
        result = None
        if ready and options.dynamic_scale is not None and not options.dynamic_scale.unscale(self._params(), self):
            return None  # non-finite gradients: no update and no step counted (Keras's LossScaleOptimizer)
        if ready:
            if (options.accumulation_steps > 1 or options.clipnorm is not None or options.clipvalue is not None
                    or options.global_clipnorm is not None
                    or options.loss_scale_factor is not None):  # (else no gradient is read)
                grads = _clippable(self._params())
                with torch.no_grad():
                    divisor = options.accumulation_steps * (options.loss_scale_factor or 1)
                    if divisor != 1:
                        for g in grads:
                            g.div_(divisor)
                    _clip(grads, options)
            if options.schedule is not None:
                rate = float(options.schedule(self._micro_steps))
                for group in self.param_groups:
                    group["lr"] = rate
            if options.decoupled_weight_decay:
                with torch.no_grad():
                    for group in self.param_groups:
                        decayed = [p for p in group["params"] if p.grad is not None]
                        if decayed:
                            torch._foreach_mul_(decayed, 1 - options.decoupled_weight_decay * group["lr"])
            if closure is None and type(self).__mro__[2].__module__.startswith("torch.optim."):
                # torch's own optimizers draw no random numbers: their update (~4 torch calls per parameter
                # on the CPU, even with foreach: the state walk) skips the replica's random mode.
                # _update runs no step hooks (a user's may draw: gradient noise): they run around this
                # step(), in the mode.
                with md.WithoutReplicaRandom():
                    result = self._update()
            else:
                result = self._update(closure)
        if options.use_ema:
            self._update_averages()
        self._micro_steps += 1
        return result

    def _update(self, closure: Callable[[], Any] | None = None) -> Any:
        """The torch class's own step, without the hook wrapper torch puts on a class's step() once an
        instance of it is built: this step() is wrapped already, so the hooks would run twice."""
        update = super().step  # type: ignore[misc]
        func = getattr(update, "__func__", None)
        if getattr(func, "hooked", False):  # (torch's profile_hook_step, made with functools.wraps)
            update = func.__wrapped__.__get__(self)
        return update() if closure is None else update(closure)

    def _note_for_rollback(self) -> None:
        """Inside strategy.run, notes the accumulated gradients, step count and averages before this step
        changes them, so that a failed step puts them back: a step that only accumulates has no meeting
        of the replicas, so without this one replica's failure would leave the others a step ahead."""
        if self._options.accumulation_steps == 1 and not self._options.use_ema:
            return  # nothing of ours changes before the update, which every replica applies or none
        journal = md.current_journal()
        if journal is not None:
            journal.before_change(self, self._saved_counts)

    def _saved_counts(self) -> Callable[[], None]:
        micro = self._micro_steps
        acc = None if self._accumulators is None else [None if a is None else a.clone() for a in self._accumulators]
        avg = None if self._averages is None else [a.clone() for a in self._averages]

        def restore() -> None:
            self._micro_steps, self._ready, self._accumulators, self._averages = micro, None, acc, avg

        return restore

    def _update_averages(self) -> None:
        # As Keras: every step (accumulating ones too) averages the current weights, with momentum 0
        # while no update has been counted, and writes the averages into the weights after every
        # ema_overwrite_frequency-th.
        params = self._params()
        with torch.no_grad():
            if self._averages is None or self.iterations == 0:
                self._averages = [p.detach().clone() for p in params]
            else:
                m = self._options.ema_momentum
                for average, p in zip(self._averages, params):
                    average.mul_(m).add_(p, alpha=1 - m)
            freq = self._options.ema_overwrite_frequency
            if freq and (self.iterations + 1) % freq == 0:
                journal = md.current_journal()
                if journal is not None:
                    journal.before_update()  # the weights change now, also in a step that only accumulates
                for average, p in zip(self._averages, params):
                    p.copy_(average)

    def finalize_variable_values(self) -> None:
        """With use_ema, writes the moving averages into the weights."""
        if self._averages is not None:
            with torch.no_grad():
                for average, p in zip(self._averages, self._params()):
                    p.copy_(average)

    def state_dict(self) -> dict[str, Any]:
        state = super().state_dict()  # type: ignore[misc]
        state[_STATE_KEY] = {"iterations": self._micro_steps,
                             "accumulators": None if self._accumulators is None else list(self._accumulators),
                             "averages": None if self._averages is None else list(self._averages)}
        if self._options.dynamic_scale is not None:
            state[_STATE_KEY]["loss_scale"] = self._options.dynamic_scale.state_of(self)
        return state

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """A torch optimizer's state_dict; ours under "keras" (step count, accumulators, averages) if present."""
        state_dict = dict(state_dict)
        extra = state_dict.pop(_STATE_KEY, None) or {}
        super().load_state_dict(state_dict)  # type: ignore[misc]
        params = self._params()
        self._micro_steps = int(extra.get("iterations", 0))
        accumulators = extra.get("accumulators")
        if accumulators is None and extra.get("replica_accumulators"):  # every replica's: this one takes the sum
            accumulators = _summed(extra["replica_accumulators"])
        self._accumulators = _like_params(accumulators, params, "accumulators")
        self._averages = _like_params(extra.get("averages"), params, "averages")
        self._ready = None
        if self._options.dynamic_scale is not None and extra.get("loss_scale") is not None:
            self._options.dynamic_scale.load(self, extra["loss_scale"])


def replicas_state_dict(replicas: Sequence[torch.optim.Optimizer]) -> dict[str, Any]:
    """The state_dict of the replicas' optimizers: replica 0's (every replica holds the same), with the
    gradients that each replica has accumulated towards its next update, which are its own."""
    state = replicas[0].state_dict()
    extra = state.get(_STATE_KEY)
    if extra is not None and any(getattr(opt, "_accumulators", None) for opt in replicas):
        state[_STATE_KEY] = {**extra, "accumulators": None, "replica_accumulators": [
            None if opt._accumulators is None else list(opt._accumulators) for opt in replicas]}
    return state


def load_replicas_state_dict(replicas: Sequence[torch.optim.Optimizer], state: Mapping[str, Any]) -> None:
    """Loads replicas_state_dict()'s state into each replica's optimizer (a copy each). Accumulated
    gradients go back to their replicas; under another replica count replica 0 takes their sum, which
    the next all-reduce adds up the same. A plain torch optimizer takes the torch part only."""
    extra = state.get(_STATE_KEY)
    saved = (extra or {}).get("replica_accumulators")
    for r, opt in enumerate(replicas):
        own = copy.deepcopy({k: v for k, v in state.items() if k != _STATE_KEY})
        if extra is not None and hasattr(opt, "accumulate_gradients"):
            own[_STATE_KEY] = {k: v for k, v in extra.items() if k != "replica_accumulators"}
            if saved is not None:
                same_count = len(saved) == len(replicas)
                own[_STATE_KEY]["accumulators"] = saved[r] if same_count else _summed(saved) if r == 0 else None
        opt.load_state_dict(own)


def _summed(per_replica: list[list[Tensor | None] | None]) -> list[Tensor | None] | None:
    lists = [acc for acc in per_replica if acc is not None]
    if not lists:
        return None
    total: list[Tensor | None] = [None] * len(lists[0])
    for acc in lists:
        total = [t if a is None else a.clone() if t is None else t + a for t, a in zip(total, acc)]
    return total


def _like_params(values: Any, params: list[Tensor], what: str) -> list[Any] | None:
    if values is None:
        return None
    if len(values) != len(params):
        raise ValueError(f"optimizer.load_state_dict: the state holds {len(values)} {what} but the optimizer has "
                         f"{len(params)} parameters; load the state of an optimizer of the same model.")
    return [None if v is None else v.detach().to(p.device, p.dtype).clone() for v, p in zip(values, params)]


def _clippable(params: list[Tensor]) -> list[Tensor]:
    """The gradients of `params`, a sparse one (nn.Embedding(sparse=True)) coalesced in place of its .grad:
    one that names a row twice holds that row's gradient as the sum of the two, which clipping must see."""
    for p in params:
        if p.grad is not None and p.grad.is_sparse and not p.grad.is_coalesced():
            p.grad = p.grad.coalesce()
    return [p.grad for p in params if p.grad is not None]


def _values(g: Tensor) -> Tensor:
    """The values a (coalesced) gradient holds: a sparse one's stored rows, a dense one itself."""
    return g._values() if g.is_sparse else g


def _clip(grads: list[Tensor], options: _Options) -> None:
    """Keras's clipping, in place: each gradient to norm <= clipnorm, all of them together to
    global_clipnorm (a NaN or infinite norm makes them all NaN, as Keras), or each value to +-clipvalue.
    A sparse gradient (coalesced) counts its stored rows, as its dense form would."""
    if options.clipnorm is not None:
        for g in grads:
            g.mul_(options.clipnorm / torch.linalg.vector_norm(_values(g)).clamp(min=options.clipnorm))
    elif options.global_clipnorm is not None and grads:
        norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(_values(g)).float() for g in grads]))
        scale = (options.global_clipnorm / norm).clamp(max=1.0)
        scale = torch.where(torch.isfinite(norm), scale, torch.full_like(scale, float("nan")))
        for g in grads:
            g.mul_(scale)
    elif options.clipvalue is not None:
        for g in grads:
            _values(g).clamp_(-options.clipvalue, options.clipvalue)


_WITH_OPTIONS: dict[type, type] = {}


def _with_options(torch_cls: Callable[..., torch.optim.Optimizer]) -> Callable[..., Any]:
    """torch_cls's subclass with _KerasSteps (one per class, made on first use)."""
    if not (isinstance(torch_cls, type) and issubclass(torch_cls, torch.optim.Optimizer)):
        raise TypeError(f"mr.optimizers.Optimizer({torch_cls!r}): expected a torch.optim.Optimizer subclass, e.g. "
                        "torch.optim.SGD.")
    torch_cls = _torch_class_of(torch_cls)
    cls = _WITH_OPTIONS.get(torch_cls)
    if cls is None:
        cls = type(torch_cls.__name__, (_KerasSteps, torch_cls), {"__module__": __name__})
        _WITH_OPTIONS[torch_cls] = cls
    return cls


def _torch_class_of(cls: type) -> type:
    """The torch optimizer class under one of ours (an optimizer a recipe built), else `cls`."""
    return next((base for base, ours in _WITH_OPTIONS.items() if ours is cls), cls)
