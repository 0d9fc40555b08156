"""Model zoo: plain torch.nn.Modules that return logits. `get(name, **kw)` builds one by name (the CLI
uses it); `names()` lists the names. Uses torch only."""
from __future__ import annotations

import functools
from collections.abc import Callable

from torch import nn

from mirrored.models.resnet import (
    BasicBlock,
    Bottleneck,
    CifarResNet,
    ResNet,
    resnet18,
    resnet34,
    resnet50,
    resnet_cifar,
)

__all__ = [
    "BasicBlock",
    "Bottleneck",
    "CifarResNet",
    "ResNet",
    "get",
    "names",
    "resnet18",
    "resnet34",
    "resnet50",
    "resnet_cifar",
]

_MODELS: dict[str, Callable[..., nn.Module]] = {
    "resnet18": resnet18,
    "resnet34": resnet34,
    "resnet50": resnet50,
    "resnet_cifar": resnet_cifar,
    **{f"resnet{depth}": functools.partial(resnet_cifar, depth=depth) for depth in (20, 32, 44, 56, 110)},
}


def names() -> list[str]:
    """The model names `get` knows, sorted."""
    return sorted(_MODELS)


def get(name: str, **kwargs) -> nn.Module:
    """Builds the model called `name` with `kwargs` (e.g. get("resnet50", num_classes=5)).

    "resnet20", "resnet32", "resnet44", "resnet56" and "resnet110" are resnet_cifar at that depth."""
    if not isinstance(name, str):
        raise TypeError(f"models.get(name={name!r}): name must be a str, one of {names()}.")
    try:
        build = _MODELS[name.lower()]
    except KeyError:
        raise ValueError(f"models.get: unknown model {name!r}. Known models: {', '.join(names())}.") from None
    if isinstance(build, functools.partial) and "depth" in kwargs:
        raise TypeError(f"models.get({name!r}, depth={kwargs['depth']!r}): {name} fixes the depth; use "
                        f"get('resnet_cifar', depth={kwargs['depth']!r}) instead.")
    return build(**kwargs)
