"""keras.optimizers objects under a strategy: KerasOptimizer, a recipe that builds Keras's own
optimizer on every replica's copy of the model, so the all-reduced gradients are applied with
Keras's update rule, options and state; optimizer() resolves compile(optimizer=...) for a Keras
model. Uses _common.py, optimizers.py and keras."""
from __future__ import annotations

import weakref
from collections.abc import Iterable, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from mirrored.training import optimizers as optimizers_lib
from mirrored.training.keras_adapter._common import device_scope, is_keras, keras as _keras


class _KerasUpdate(torch.optim.Optimizer):
    """One replica's Keras optimizer behind torch's Optimizer interface: step() hands the (all-reduced)
    gradients to Keras's `apply`, so the update, clipping, weight decay, EMA, gradient accumulation
    and schedule are Keras's own. Its state_dict holds every Keras optimizer variable."""

    def __init__(self, keras_opt: Any, variables: list[Any], device: torch.device):
        params = [v.value for v in variables]
        super().__init__(params, {"lr": float(keras_opt.learning_rate)})
        self.keras_optimizer = keras_opt
        self._variables = variables
        self._device = device
        with device_scope(device):
            keras_opt.build(variables)

    # What Model.fit asks of mr.optimizers' optimizers: Keras accumulates itself, so every step all-reduces.
    def accumulate_gradients(self) -> bool:
        """True: every step's gradients are all-reduced; Keras's apply accumulates them if asked."""
        return True

    @property
    def gradient_accumulation_steps(self) -> int:
        return 1

    @property
    def iterations(self) -> int:
        return int(self.keras_optimizer.iterations)

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:
        if closure is not None:
            raise ValueError("step(closure): a Keras optimizer applies the gradients present; call step() alone.")
        grads = [p.grad for p in self.param_groups[0]["params"]]
        with device_scope(self._device):
            self.keras_optimizer.apply(grads, self._variables)
        self.param_groups[0]["lr"] = float(self.keras_optimizer.learning_rate)

    def finalize_variable_values(self) -> None:
        """With use_ema, writes the moving averages into the weights (Keras's, at the end of fit)."""
        with torch.no_grad(), device_scope(self._device):
            self.keras_optimizer.finalize_variable_values(self._variables)

    def state_dict(self) -> dict[str, Any]:
        state = super().state_dict()
        state["keras_optimizer"] = [v.value.detach().clone() for v in self.keras_optimizer.variables]
        return state

    def load_state_dict(self, state_dict: Any) -> None:
        state_dict = dict(state_dict)
        saved = state_dict.pop("keras_optimizer", None)
        super().load_state_dict(state_dict)
        if saved is None:
            return
        own = self.keras_optimizer.variables
        if not isinstance(saved, list) or len(saved) != len(own) or any(
                not isinstance(s, Tensor) or tuple(s.shape) != tuple(v.shape) for s, v in zip(saved, own)):
            raise ValueError(f"{self.keras_optimizer.name}.load_state_dict: the state holds "
                             f"{len(saved) if isinstance(saved, list) else saved!r:.40} Keras optimizer variables "
                             f"that do not match this optimizer's {len(own)}; it was saved from another optimizer "
                             "or model.")
        with torch.no_grad():
            for s, v in zip(saved, own):
                v.value.copy_(s.to(v.value.device, v.value.dtype))


class KerasOptimizer(optimizers_lib.Optimizer):
    """A keras.optimizers instance as a recipe: every replica gets `type(opt).from_config(config)`,
    built on that replica's copy of the Keras model, so the update is Keras's own on the all-reduced
    gradients (Keras's SGD momentum rule, Adam's epsilon placement, decoupled weight decay, clipping,
    EMA, gradient accumulation, schedules). learning_rate reads and sets every replica's."""

    def __init__(self, keras_opt: Any, replicas: Sequence[nn.Module]):
        keras = _keras()
        if isinstance(keras_opt, keras.optimizers.LossScaleOptimizer):
            raise ValueError("compile(optimizer=LossScaleOptimizer(...)): not supported; pass the inner optimizer "
                             "and compile(precision=\"fp16\") for a loss scale, or loss_scale_factor= on it.")
        if keras_opt.built and int(keras_opt.iterations) > 0:
            raise ValueError(f"compile(optimizer=<{type(keras_opt).__name__} that has taken "
                             f"{int(keras_opt.iterations)} steps>): its state belongs to another model's "
                             "variables. Pass a new optimizer (keras.optimizers.X(...) with the same settings).")
        if getattr(keras_opt, "_exclude_from_weight_decay", None) or getattr(
                keras_opt, "_exclude_from_weight_decay_pattern", None):
            raise ValueError(f"compile(optimizer={type(keras_opt).__name__}): exclude_from_weight_decay(...) was "
                             "called on it, which refers to the model's own variables and is not carried to the "
                             "replicas' copies. Set the weight decay per layer, or none.")
        self._keras_cls = type(keras_opt)
        self._keras_config = keras_opt.get_config()
        self._replicas = tuple(replicas)
        rate = keras_opt._learning_rate
        self._schedule = None if isinstance(rate, keras.Variable) else rate
        self._lr = float(keras_opt.learning_rate)
        self._kwargs: dict[str, Any] = {}
        self._torch_cls = _KerasUpdate
        self.name = keras_opt.name
        config = self._keras_config
        self.clipnorm, self.clipvalue = config.get("clipnorm"), config.get("clipvalue")
        self.global_clipnorm = config.get("global_clipnorm")
        self.gradient_accumulation_steps = None  # (Keras's apply accumulates; nothing for fit to do)
        self.keras_gradient_accumulation_steps = config.get("gradient_accumulation_steps")
        self.use_ema = bool(config.get("use_ema", False))
        self.ema_momentum, self.ema_overwrite_frequency = config.get("ema_momentum"), config.get(
            "ema_overwrite_frequency")
        self.loss_scale_factor = config.get("loss_scale_factor")
        self._built: list[weakref.ref] = []
        self._from_instance = None

    def build(self, params: Iterable[torch.nn.Parameter]) -> torch.optim.Optimizer:
        first = next(iter(params), None)
        replica = next((m for m in self._replicas if any(p is first for p in m.parameters())), None)
        if replica is None:
            raise ValueError(f"{self.name}: a Keras optimizer is built on a Keras model's variables; it was given "
                             "parameters of another module. Compile the mr.Model of that Keras model.")
        opt = self._keras_cls.from_config(dict(self._keras_config))
        opt.learning_rate = self._schedule if self._schedule is not None else self._lr
        device = first.device if first is not None else torch.device("cpu")
        built = _KerasUpdate(opt, list(replica.trainable_variables), device)
        self._built = [r for r in self._built if r() is not None] + [weakref.ref(built)]
        return built

    @property
    def learning_rate(self) -> float:
        live = self._live()
        return float(live[-1].keras_optimizer.learning_rate) if live else self._lr

    @learning_rate.setter
    def learning_rate(self, value: float) -> None:
        value = optimizers_lib.settable_rate(self.name, self._schedule, value)
        self._lr = value
        for opt in self._live():
            opt.keras_optimizer.learning_rate = value
            opt.param_groups[0]["lr"] = value

    @property
    def iterations(self) -> int:
        live = self._live()
        return live[-1].iterations if live else 0

    def finalize_variable_values(self) -> None:
        for opt in self._live():
            opt.finalize_variable_values()

    def get_config(self) -> dict[str, Any]:
        raise NotImplementedError(f"{self.name}: a Keras optimizer is recorded by Keras's own config, not ours.")

    def __repr__(self) -> str:
        return f"KerasOptimizer({self._keras_cls.__name__}, learning_rate={self._schedule or self._lr!r})"


def optimizer(identifier: Any, replicas: Sequence[nn.Module]) -> optimizers_lib.Optimizer:
    """compile(optimizer=...) for a Keras model: a name or keras.optimizers object becomes Keras's own
    optimizer on every replica (KerasOptimizer); an mr.optimizers or torch optimizer stays as it is."""
    keras = _keras()
    if isinstance(identifier, str):
        try:
            identifier = keras.optimizers.get(identifier)
        except ValueError as e:
            raise ValueError(f"compile(optimizer={identifier!r}): Keras does not know this optimizer ({e}).") from None
    if is_keras(identifier, "optimizer"):
        return KerasOptimizer(identifier() if isinstance(identifier, type) else identifier, replicas)
    return optimizers_lib.get(identifier)


