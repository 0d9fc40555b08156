"""Keras 3's update rules that torch.optim does not have, as torch optimizers: Lion, Ftrl and Lamb.

Each follows Keras's update_step line by line (its defaults, epsilon and bias corrections), so that
mr.optimizers.Lion / Ftrl / Lamb build them like any torch.optim class. Weight decay is not here:
the recipes apply Keras's decoupled decay before step(). Uses torch only.
"""
from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import Tensor


def _closure_loss(closure: Callable[[], Any] | None) -> Any:
    if closure is None:
        return None
    with torch.enable_grad():
        return closure()


class Lion(torch.optim.Optimizer):
    """Lion (Chen et al., 2023), as keras.optimizers.Lion: w -= lr * sign(beta_1 * m + (1 - beta_1) * g),
    then m = beta_2 * m + (1 - beta_2) * g."""

    def __init__(self, params: Iterable[Any], lr: float = 0.001, beta_1: float = 0.9, beta_2: float = 0.99):
        if not 0 <= beta_1 <= 1 or not 0 <= beta_2 <= 1:
            raise ValueError(f"Lion(beta_1={beta_1}, beta_2={beta_2}): both must be in [0, 1].")
        super().__init__(params, {"lr": lr, "beta_1": beta_1, "beta_2": beta_2})

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        loss = _closure_loss(closure)
        for group in self.param_groups:
            b1, b2, lr = group["beta_1"], group["beta_2"], group["lr"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if "momentum" not in state:
                    state["momentum"] = torch.zeros_like(p)
                m, g = state["momentum"], p.grad
                p.sub_(lr * torch.sign(m * b1 + g * (1.0 - b1)))
                m.mul_(b2).add_(g * (1.0 - b2))
        return loss


class Ftrl(torch.optim.Optimizer):
    """Follow-the-regularized-leader (McMahan et al., 2013), as keras.optimizers.Ftrl, with its L1, L2,
    L2-shrinkage and beta terms."""

    def __init__(self, params: Iterable[Any], lr: float = 0.001, learning_rate_power: float = -0.5,
                 initial_accumulator_value: float = 0.1, l1_regularization_strength: float = 0.0,
                 l2_regularization_strength: float = 0.0, l2_shrinkage_regularization_strength: float = 0.0,
                 beta: float = 0.0):
        for key, value in (("initial_accumulator_value", initial_accumulator_value),
                           ("l1_regularization_strength", l1_regularization_strength),
                           ("l2_regularization_strength", l2_regularization_strength),
                           ("l2_shrinkage_regularization_strength", l2_shrinkage_regularization_strength),
                           ("beta", beta)):
            if value < 0:
                raise ValueError(f"Ftrl({key}={value}): must be >= 0.")
        if learning_rate_power > 0:
            raise ValueError(f"Ftrl(learning_rate_power={learning_rate_power}): must be <= 0.")
        super().__init__(params, {
            "lr": lr, "learning_rate_power": learning_rate_power, "initial_accumulator_value": initial_accumulator_value,
            "l1_regularization_strength": l1_regularization_strength,
            "l2_regularization_strength": l2_regularization_strength,
            "l2_shrinkage_regularization_strength": l2_shrinkage_regularization_strength, "beta": beta})

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        loss = _closure_loss(closure)
        for group in self.param_groups:
            lr, power = group["lr"], group["learning_rate_power"]
            l1 = group["l1_regularization_strength"]
            l2 = group["l2_regularization_strength"] + group["beta"] / (2.0 * lr)
            shrinkage = group["l2_shrinkage_regularization_strength"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if "accumulator" not in state:
                    state["accumulator"] = torch.full_like(p, group["initial_accumulator_value"])
                    state["linear"] = torch.zeros_like(p)
                accum, linear, g = state["accumulator"], state["linear"], p.grad
                new_accum = accum + g.square()
                linear.add_(g + 2 * shrinkage * p - (new_accum.pow(-power) - accum.pow(-power)) / lr * p)
                quadratic = new_accum.pow(-power) / lr + 2 * l2
                p.copy_((linear.clamp(-l1, l1) - linear) / quadratic)
                accum.copy_(new_accum)
        return loss


class Lamb(torch.optim.Optimizer):
    """LAMB (You et al., 2019), as keras.optimizers.Lamb: Adam's step scaled per tensor by
    ||w|| / ||step|| (1 where either is 0)."""

    def __init__(self, params: Iterable[Any], lr: float = 0.001, beta_1: float = 0.9, beta_2: float = 0.999,
                 epsilon: float = 1e-7):
        super().__init__(params, {"lr": lr, "beta_1": beta_1, "beta_2": beta_2, "epsilon": epsilon})

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        loss = _closure_loss(closure)
        for group in self.param_groups:
            b1, b2, eps, lr = group["beta_1"], group["beta_2"], group["epsilon"], group["lr"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if "step" not in state:
                    state["step"] = 0
                    state["momentum"] = torch.zeros_like(p)
                    state["velocity"] = torch.zeros_like(p)
                state["step"] += 1
                t = state["step"]
                m, v, g = state["momentum"], state["velocity"], p.grad
                m.add_((g - m) * (1 - b1))
                v.add_((g.square() - v) * (1 - b2))
                update = (m / (1.0 - b1 ** t)) / ((v / (1.0 - b2 ** t)).sqrt() + eps)
                w_norm, u_norm = _norm(p), _norm(update)
                ratio = torch.where((w_norm > 0) & (u_norm > 0), w_norm / u_norm, torch.ones_like(w_norm))
                p.sub_(ratio * lr * update)
        return loss


def _norm(t: Tensor) -> Tensor:
    return t.square().sum().sqrt()
