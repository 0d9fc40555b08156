"""Model zoo: plain torch.nn.Modules that return logits. `get(name, **kw)` builds one by name (the CLI
uses it); `names()` lists the names; `check_config(name, kw)` checks arguments read from a file
and `skeleton(name, **kw)` builds on the meta device (shapes, no memory), both before anything real
is built. Uses torch only."""
from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Mapping
from typing import Any

import torch
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
    "check_config",
    "get",
    "names",
    "resnet18",
    "resnet34",
    "resnet50",
    "resnet_cifar",
    "skeleton",
]

_MODELS: dict[str, Callable[..., nn.Module]] = {
    "resnet18": resnet18,
    "resnet34": resnet34,
    "resnet50": resnet50,
    "resnet_cifar": resnet_cifar,
    **{f"resnet{depth}": functools.partial(resnet_cifar, depth=depth) for depth in (20, 32, 44, 56, 110)},
}

# Upper bounds for whole-number arguments read from a file (Model.load's recorded model_config): far
# beyond any real model (ImageNet-21k has 21,841 classes; the CIFAR paper's deepest ResNet is 1202),
# low enough that a forged value cannot ask the allocator for terabytes or build for hours.
_ARG_LIMITS = {"num_classes": 1 << 20, "depth": 2000, "width": 1024, "in_channels": 1024}


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


def check_config(name: Any, kwargs: Any) -> None:
    """Raises ValueError/TypeError unless get(name, **kwargs) names a known model with arguments of its
    factory, of the factory's types, within sane bounds (_ARG_LIMITS). For configs read from files,
    where a damaged or forged value must not reach the allocator; get() itself trusts its caller."""
    if not isinstance(name, str) or name.lower() not in _MODELS:
        raise ValueError(f"unknown model {name!r:.60}; known models: {', '.join(names())}.")
    if not isinstance(kwargs, Mapping) or not all(isinstance(k, str) for k in kwargs):
        raise TypeError(f"{name}: the arguments must be a dict of name -> value, got {kwargs!r:.80}.")
    build = _MODELS[name.lower()]
    fixed = build.keywords if isinstance(build, functools.partial) else {}
    params = {k: p for k, p in inspect.signature(build).parameters.items() if k not in fixed}
    for key, value in kwargs.items():
        if key not in params:
            raise ValueError(f"{name}: unknown argument {key!r:.40}; it takes {', '.join(params)}.")
        default = params[key].default
        if isinstance(default, bool):
            if not isinstance(value, bool):
                raise TypeError(f"{name}({key}={value!r:.40}): must be True or False.")
        elif isinstance(default, int):
            limit = _ARG_LIMITS.get(key, 1 << 16)
            if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= limit:
                raise ValueError(f"{name}({key}={value!r:.40}): must be a whole number in [1, {limit}].")


class _NoRandomInit(torch.overrides.TorchFunctionMode):
    """Skips in-place random fills: on the meta device they only cost time (torch's meta normal_
    imports torch._dynamo on first use, ~4 s)."""

    _SKIPPED = frozenset({torch.Tensor.normal_, torch.Tensor.uniform_, torch.Tensor.bernoulli_,
                          torch.Tensor.exponential_, torch.Tensor.random_})

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in self._SKIPPED:
            return args[0]
        return func(*args, **(kwargs or {}))


def skeleton(name: str, **kwargs: Any) -> nn.Module:
    """get(name, **kwargs) on the meta device: every parameter's shape and dtype without memory or
    initialization, to check a config (or size its replicas) before building it for real."""
    with torch.device("meta"), _NoRandomInit():
        return get(name, **kwargs)
