"""Configs of losses, metrics, optimizers and schedules: JSON that names one of our classes.

to_config(obj, registry) gives {"class_name": ..., "config": obj.get_config()} when obj is exactly
one of the registry's classes and its config is JSON; from_config(config, registry, what) rebuilds
it with that class's from_config(). Only classes of the registry can come back, by name: nothing is
imported and nothing is unpickled, so a saved model's file cannot make us run other code.
Uses the standard library.
"""
from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any


def to_config(obj: Any, registry: Mapping[str, type]) -> dict[str, Any] | None:
    """The JSON config of `obj`, or None when it has none: a class outside the registry (a user's
    subclass included), a get_config() that raises NotImplementedError, or values JSON cannot hold."""
    cls = registry.get(type(obj).__name__)
    if cls is not type(obj):
        return None
    try:
        config = obj.get_config()
        json.dumps(config)
    except (NotImplementedError, TypeError, ValueError):
        return None
    return {"class_name": cls.__name__, "config": config}


def from_config(config: Any, registry: Mapping[str, type], what: str) -> Any:
    """The object to_config() described, built by `registry[class_name].from_config(config)`."""
    if not isinstance(config, Mapping) or not isinstance(config.get("class_name"), str) \
            or not isinstance(config.get("config"), Mapping):
        raise ValueError(f"{what} config {config!r:.200}: expected {{'class_name': ..., 'config': {{...}}}} as "
                         "get_config()/serialize() write it.")
    cls = registry.get(config["class_name"])
    if cls is None:
        raise ValueError(f"{what} config: unknown class {config['class_name']!r}; known: {', '.join(registry)}. "
                         "Only mirrored's own classes are rebuilt from a file.")
    try:
        return cls.from_config(dict(config["config"]))
    except TypeError as e:
        raise ValueError(f"{what} config of {config['class_name']}: {e}. The file was written by another "
                         "version of mirrored, or edited.") from e
