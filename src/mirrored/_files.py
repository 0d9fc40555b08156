"""File-system helpers shared by the atomic writers (TFRecord shards, checkpoints). Stdlib only."""
from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from typing import Any, TypeVar

C = TypeVar("C")


def fsync_directory(directory: str) -> None:
    """Flushes a directory entry, so a rename into it survives a crash (a no-op where unsupported)."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:  # e.g. Windows cannot open a directory; the rename is still atomic
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def config_of(cls: type[C], value: C | Mapping[str, Any] | None, arg: str) -> C:
    """`value` as a dataclass config `cls`: None gives the defaults, a dict sets the fields it names."""
    if value is None or isinstance(value, cls):
        return value or cls()
    if not isinstance(value, Mapping):
        raise TypeError(f"{arg} must be a {cls.__name__} or a dict of its fields; got {value!r}.")
    fields = [f.name for f in dataclasses.fields(cls)]
    unknown = sorted(set(value) - set(fields))
    if unknown:
        raise ValueError(f"{arg}: unknown field(s) {unknown}; {cls.__name__} has {fields}.")
    return cls(**value)
