"""Optimizers with Keras names on torch's update rules: `mr.optimizers.SGD(learning_rate=0.1, momentum=0.9)`.

An `Optimizer` is a recipe: `build(params)` makes the torch optimizer for one replica's parameters,
and `learning_rate` reads or sets the rate of every optimizer built from it (callbacks such as
ReduceLROnPlateau use this). `get()` accepts a name ("sgd", "adam", "adamw", "rmsprop"), an
Optimizer, a torch optimizer class, or a torch optimizer instance (its class and defaults are
reused). Hyperparameter defaults are Keras 3's. Uses torch only.
"""
from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable
from typing import Any

import torch


class Optimizer:
    """A torch optimizer class plus hyperparameters; one torch optimizer is built per replica."""

    def __init__(self, torch_cls: Callable[..., torch.optim.Optimizer], learning_rate: float, name: str,
                 **torch_kwargs: Any):
        if not isinstance(learning_rate, (int, float)) or learning_rate < 0:
            raise ValueError(f"{name}(learning_rate={learning_rate!r}): give a non-negative number, e.g. 0.01.")
        self._torch_cls = torch_cls
        self._lr = float(learning_rate)
        self._kwargs = torch_kwargs
        self.name = name
        self._built: weakref.WeakSet = weakref.WeakSet()

    def build(self, params: Iterable[torch.nn.Parameter]) -> torch.optim.Optimizer:
        """A new torch optimizer over `params` with this recipe's hyperparameters."""
        opt = self._torch_cls(params, lr=self._lr, **self._kwargs)
        self._built.add(opt)
        return opt

    @property
    def learning_rate(self) -> float:
        return self._lr

    @learning_rate.setter
    def learning_rate(self, value: float) -> None:
        value = float(value)
        if value < 0:
            raise ValueError(f"{self.name}.learning_rate = {value}: the learning rate must be non-negative.")
        self._lr = value
        for opt in self._built:
            for group in opt.param_groups:
                group["lr"] = value

    def get_config(self) -> dict[str, Any]:
        return {"name": self.name, "learning_rate": self._lr, **self._kwargs}

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in self.get_config().items() if k != "name")
        return f"{self.name}({args})"


def SGD(learning_rate: float = 0.01, momentum: float = 0.0, nesterov: bool = False,
        weight_decay: float | None = None) -> Optimizer:
    """Stochastic gradient descent (keras.optimizers.SGD): torch.optim.SGD. weight_decay is torch's L2
    term added to the gradient (Keras decays the weights directly, decoupled from the gradient)."""
    return Optimizer(torch.optim.SGD, learning_rate, "SGD", momentum=momentum, nesterov=nesterov,
                     weight_decay=weight_decay or 0.0)


def Adam(learning_rate: float = 0.001, beta_1: float = 0.9, beta_2: float = 0.999, epsilon: float = 1e-7,
         amsgrad: bool = False, weight_decay: float | None = None) -> Optimizer:
    """Adam (keras.optimizers.Adam defaults, epsilon 1e-7): torch.optim.Adam. weight_decay is torch's L2
    term added to the gradient; for Keras's decoupled decay use AdamW, which is the same in both."""
    return Optimizer(torch.optim.Adam, learning_rate, "Adam", betas=(beta_1, beta_2), eps=epsilon,
                     amsgrad=amsgrad, weight_decay=weight_decay or 0.0)


def AdamW(learning_rate: float = 0.001, weight_decay: float = 0.004, beta_1: float = 0.9, beta_2: float = 0.999,
          epsilon: float = 1e-7, amsgrad: bool = False) -> Optimizer:
    """Adam with decoupled weight decay (keras.optimizers.AdamW): torch.optim.AdamW."""
    return Optimizer(torch.optim.AdamW, learning_rate, "AdamW", betas=(beta_1, beta_2), eps=epsilon,
                     amsgrad=amsgrad, weight_decay=weight_decay)


def RMSprop(learning_rate: float = 0.001, rho: float = 0.9, momentum: float = 0.0, epsilon: float = 1e-7,
            centered: bool = False) -> Optimizer:
    """RMSprop with Keras's names (torch's update rule): torch.optim.RMSprop."""
    return Optimizer(torch.optim.RMSprop, learning_rate, "RMSprop", alpha=rho, momentum=momentum, eps=epsilon,
                     centered=centered)


_OPTIMIZERS: dict[str, Callable[..., Optimizer]] = {"sgd": SGD, "adam": Adam, "adamw": AdamW, "rmsprop": RMSprop}


def get(identifier: Any) -> Optimizer:
    """An Optimizer from a name, an Optimizer, a torch optimizer class, or a torch optimizer instance."""
    if isinstance(identifier, Optimizer):
        return identifier
    if isinstance(identifier, str):
        try:
            return _OPTIMIZERS[identifier.lower()]()
        except KeyError:
            raise ValueError(f"unknown optimizer {identifier!r}. Known names: {', '.join(sorted(_OPTIMIZERS))}; "
                             "or pass mr.optimizers.SGD(...), a torch.optim class, or an instance.") from None
    if isinstance(identifier, torch.optim.Optimizer):
        defaults = dict(identifier.defaults)
        lr = defaults.pop("lr", 0.001)
        if len(identifier.param_groups) > 1:
            raise ValueError(f"optimizer {type(identifier).__name__} has {len(identifier.param_groups)} parameter "
                             "groups; compile() rebuilds the optimizer for every replica and keeps only the class and "
                             "defaults. Pass the class with its settings instead.")
        return Optimizer(type(identifier), float(lr), type(identifier).__name__, **defaults)
    if isinstance(identifier, type) and issubclass(identifier, torch.optim.Optimizer):
        import inspect

        lr = inspect.signature(identifier).parameters.get("lr")
        default_lr = lr.default if lr is not None and isinstance(lr.default, (int, float)) else 0.001
        return Optimizer(identifier, float(default_lr), identifier.__name__)
    raise TypeError(f"compile(optimizer={identifier!r}): expected a name ({', '.join(sorted(_OPTIMIZERS))}), "
                    "an mr.optimizers optimizer, a torch.optim class, or a torch optimizer instance.")
