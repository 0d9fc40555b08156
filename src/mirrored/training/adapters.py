"""What differs between kinds of model under mr.Model, one adapter per kind, chosen once when the
Model is built (adapter_for): TorchAdapter for a torch.nn.Module, keras_adapter.KerasAdapter for a
Keras 3 model (torch backend). An adapter owns the forward call and its training flag, how
compile()'s names and objects become losses, metrics and optimizers, the regularization a step adds
to its loss, the summary, and the archive format of its kind. Model asks its adapter and never which
kind it holds. Uses losses.py, metrics.py, optimizers.py and keras_adapter/.
"""
from __future__ import annotations

import functools
import inspect
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Callable

from torch import Tensor, nn

from mirrored.training import keras_adapter, losses, metrics as metrics_lib, optimizers


class TorchAdapter:
    """A torch.nn.Module: it returns logits, so loss and metric names mean from_logits=True; names and
    objects of mr.losses, mr.metrics and mr.optimizers (and torch's losses and optimizers)."""

    kind = "torch module"

    def __init__(self, module: nn.Module):
        del module  # (nothing to check: any nn.Module will do)

    def call(self, net: Any, x: Any, training: bool, *args: Any, **kwargs: Any) -> Any:
        """The module on `x`; `training` is the module's mode, which fit sets (train() / eval()). A dict
        whose keys all name parameters of the module's forward is passed as keyword arguments, as
        model(**batch) (a Hugging Face model's input_ids, attention_mask, labels); any other x, a dict
        for a forward that takes one argument included, is passed as it is."""
        del training
        if isinstance(x, Mapping) and not args and _names_parameters(net.module, x.keys()):
            return net(**x, **kwargs)
        return net(x, *args, **kwargs)

    def prediction(self, y_pred: Any) -> Any:
        """What the compiled loss and metrics compare with the labels: the output, or the "logits" of an
        output that is a mapping holding them (a Hugging Face ModelOutput)."""
        if isinstance(y_pred, Mapping) and "logits" in y_pred:
            return y_pred["logits"]
        return y_pred

    @staticmethod
    def output_names(module: nn.Module) -> list[str] | None:
        """None: a torch module's outputs are named by the keys of the dict it returns (a tuple's are not)."""
        del module
        return None

    def module_loss(self, y_pred: Any) -> Tensor | None:
        """The loss the module computed itself (an output mapping's "loss": a Hugging Face model given
        labels), which fit minimises when compile() has none; None where there is none."""
        loss = y_pred.get("loss") if isinstance(y_pred, Mapping) else None
        return loss if isinstance(loss, Tensor) else None

    @staticmethod
    def labels(x: Any) -> Any:
        """The labels of a batch whose labels are in its inputs (a dict with "labels", as Hugging Face's
        model(**batch) takes them), for the metrics; None otherwise."""
        return x.get("labels") if isinstance(x, Mapping) else None

    def optimizer(self, identifier: Any, replicas: tuple[nn.Module, ...]) -> optimizers.Optimizer:
        del replicas
        if keras_adapter.is_keras(identifier, "optimizer"):
            name = identifier.__name__ if isinstance(identifier, type) else type(identifier).__name__
            ours = getattr(optimizers, name, None)
            fix = (f"Use mr.optimizers.{name} (the same options) for a torch module." if isinstance(ours, type)
                   and issubclass(ours, optimizers.Optimizer) else
                   f"mr.optimizers has no {name}: " + optimizers._NOT_HERE.get(name.lower(), "use mr.optimizers.AdamW."))
            raise TypeError(f"compile(optimizer={name}(...)) on a torch module: a Keras optimizer updates a Keras "
                            f"model's variables. {fix}")
        return optimizers.get(identifier)

    def loss(self, identifier: Any) -> losses.Loss:
        return losses.get(identifier)

    def metric(self, identifier: Any, loss_name: str | None) -> Any:
        return metrics_lib.get(identifier, loss_name=loss_name)

    def regularization(self, net: Any) -> Tensor | float:
        """The module's `regularization_loss()`, if it has one."""
        fn = getattr(net, "regularization_loss", None)
        return fn() if callable(fn) else 0.0

    def refuse_jit(self) -> None:
        """torch.compile takes any module (jit.py falls back to eager where it cannot)."""

    def own_steps(self, mirror: Any) -> None:
        """None: a torch module's steps are the Model's (a subclass of Model overrides them)."""
        del mirror

    def summary(self, module: nn.Module, title: str, print_fn: Callable[[str], Any]) -> None:
        """The top-level children with their parameter counts, and the totals."""
        rows = [(name, type(child).__name__, sum(p.numel() for p in child.parameters()))
                for name, child in module.named_children()]
        total = sum(p.numel() for p in module.parameters())
        trainable = sum(p.numel() for p in module.parameters() if p.requires_grad)
        width = max([len(r[0]) + len(r[1]) + 3 for r in rows] + [30])
        lines = [title, "-" * (width + 16), f"{'Layer (type)':<{width}}{'Param #':>16}", "=" * (width + 16)]
        lines += [f"{f'{n} ({t})':<{width}}{c:>16,}" for n, t, c in rows]
        lines += ["=" * (width + 16), f"Total params: {total:,}", f"Trainable params: {trainable:,}",
                  f"Non-trainable params: {total - trainable:,}"]
        print_fn("\n".join(lines))

    def check_archive(self, module: nn.Module, path: str | Path, where: str) -> None:
        """Refuses Keras's archive format (checked on every worker, before anything runs)."""
        raise ValueError(f"{where}: \".keras\" is Keras's archive, for Keras models; this model is the torch module "
                         f"{type(module).__name__}. Save to a .safetensors path (Model.load reads it back).")

    def save_archive(self, module: nn.Module, path: str | Path) -> None:
        self.check_archive(module, path, f"Model.save({str(path)!r})")


@functools.lru_cache(maxsize=256)
def _forward_parameters(cls: type) -> frozenset[str]:
    """The parameters forward() of module class `cls` names (besides self; a **kwargs names none)."""
    try:
        parameters = list(inspect.signature(cls.forward).parameters.values())[1:]
    except (TypeError, ValueError):
        return frozenset()
    return frozenset(p.name for p in parameters if p.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD,
                                                              inspect.Parameter.KEYWORD_ONLY))


def _names_parameters(module: nn.Module, keys: Any) -> bool:
    named = _forward_parameters(type(module))
    keys = list(keys)
    return bool(keys) and all(isinstance(k, str) and k in named for k in keys)


def adapter_for(module: Any) -> TorchAdapter | keras_adapter.KerasAdapter:
    """The adapter of `module`'s kind: a Keras 3 model's, else a torch module's."""
    if keras_adapter.is_keras_model(module):
        return keras_adapter.KerasAdapter(module)
    return TorchAdapter(module)


ARCHIVE_SUFFIX = ".keras"  # a path ending so is Keras's own archive, not a mirrored file


def is_archive(path: str | Path) -> bool:
    """Whether `path` names Keras's archive format (Model.save / Model.load read it through Keras)."""
    return str(path).endswith(ARCHIVE_SUFFIX)


def load_archive(path: str | Path) -> nn.Module:
    """The module of a Keras archive (uncompiled): Model.load's ".keras" path."""
    return keras_adapter.load_archive(path)
