"""KerasAdapter: mr.Model's adapter for a Keras 3 model (torch backend), and Keras's archive format.

The forward pass gets `training=True` in fit's train steps and False elsewhere, as Keras's torch
trainer passes it; loss and metric names mean probabilities (from_logits=False), and keras.losses /
keras.metrics / keras.optimizers objects compute Keras's own values (_objects.py, _optimizer.py);
the model's `losses` (regularizers) join the loss, as Keras's compute_loss adds them. Building one
installs the adapter (_install.py). A class that defines its own steps or compile runs them on every
replica (_own_steps.py). Uses _common.py, _objects.py, _optimizer.py, _install.py, _own_steps.py and keras.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import torch
from torch import Tensor, nn

from mirrored._files import write_atomically
from mirrored.training.keras_adapter import _objects, _optimizer
from mirrored.training.keras_adapter._common import check_model, device_scope, keras
from mirrored.training.keras_adapter._install import install
from mirrored.training.keras_adapter._own_steps import OwnSteps, defines_own_steps


class KerasAdapter:
    """A Keras 3 model under mr.Model: Keras's conventions (see the module docstring)."""

    kind = "Keras model"

    def __init__(self, module: nn.Module):
        check_model(module)
        install()

    def call(self, net: Any, x: Any, training: bool, *args: Any, **kwargs: Any) -> Any:
        """The model on `x` with `training=` as Keras's torch trainer passes it (only to a call that
        takes it), under the replica's Keras device."""
        own = getattr(net, "module", net)  # (a MirroredModule's replica copy)
        if getattr(own, "_call_has_training_arg", True):
            kwargs["training"] = training
        device = next((p.device for p in own.parameters()), torch.device("cpu"))
        with device_scope(device):
            return net(x, *args, **kwargs)

    def prediction(self, y_pred: Any) -> Any:
        """A Keras model's output, as Keras's compiled loss and metrics take it."""
        return y_pred

    @staticmethod
    def output_names(module: nn.Module) -> list[str] | None:
        """The model's output names (a functional model's output layers), which name its outputs' losses and
        metrics in the logs as Keras names them; None where it has none."""
        names = getattr(module, "output_names", None)
        return list(names) if isinstance(names, (list, tuple)) and all(isinstance(n, str) for n in names) else None

    def module_loss(self, y_pred: Any) -> Tensor | None:
        """None: a Keras model's own losses are its `losses` (regularization), added to the compiled loss."""
        del y_pred
        return None

    @staticmethod
    def labels(x: Any) -> Any:
        """None: Keras's data gives the labels beside the inputs."""
        del x
        return None

    def optimizer(self, identifier: Any, replicas: tuple[nn.Module, ...]) -> Any:
        return _optimizer.optimizer(identifier, replicas)

    def loss(self, identifier: Any) -> Any:
        return _objects.loss(identifier)

    def metric(self, identifier: Any, loss_name: str | None) -> Any:
        return _objects.metric(identifier, loss_name)

    def regularization(self, net: Any) -> Tensor | float:
        """The model's `losses` (weight regularizers and the activity losses of its last call), summed:
        what Keras's compute_loss adds to the loss."""
        own = getattr(net, "module", net)
        extra = list(own.losses)
        if not extra:
            return 0.0
        return torch.stack([torch.as_tensor(v).float().sum() for v in extra]).sum()

    def refuse_jit(self) -> None:
        raise ValueError("compile(jit_compile=True) with a Keras model: not supported (untested with Keras's "
                         "layers on the replica threads). Use jit_compile=False or \"auto\" (eager, Keras 3's "
                         "default on torch).")

    def own_steps(self, mirror: Any) -> OwnSteps | None:
        """For a Keras model whose class defines its own steps or compile (keras.io's "Customizing what
        happens in fit()"): what runs its compile and steps on every replica's copy (_own_steps.py);
        None for Keras's default steps, which mr.Model runs itself."""
        return OwnSteps(mirror) if defines_own_steps(mirror.replicas[0]) else None

    def summary(self, module: nn.Module, title: str, print_fn: Callable[[str], Any]) -> None:
        """The Keras model's own summary."""
        del title
        module.summary(print_fn=lambda line, *args, **kwargs: print_fn(line))

    def check_archive(self, module: nn.Module, path: str | Path, where: str) -> None:
        """A Keras model saves to Keras's archive format."""

    def save_archive(self, module: nn.Module, path: str | Path) -> None:
        """Keras's archive of `module` at `path` (".keras"), written to a temporary name and renamed, so a
        crash leaves the old file."""
        write_atomically(path, "Model.save", lambda tmp: module.save(tmp), suffix=".keras")


def load_archive(path: str | Path) -> nn.Module:
    """The Keras model of a ".keras" archive, uncompiled (compile it through mr.Model)."""
    module = keras()
    if module is None:
        raise ValueError(f"Model.load({str(path)!r}): a .keras archive is read by Keras; import keras first (with "
                         "KERAS_BACKEND=torch set before it).")
    return module.models.load_model(path, compile=False)
