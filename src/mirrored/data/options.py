"""`Options` for a Dataset, with tf.data's names: `ds = ds.with_options(options)`.

    options = mr.data.Options()
    policy = mr.data.experimental.AutoShardPolicy.DATA
    options.experimental_distribute.auto_shard_policy = policy
    ds = ds.with_options(options)

Only the options whose meaning carries over are accepted, each with tf.data's semantics where it
changes a result and a stated effect where it is a speed knob; setting any other attribute (e.g.
`experimental_optimization`, tf.data's graph rewrites, which have nothing to rewrite here) is an
AttributeError naming what is supported. Options attach to the dataset and stay with every
dataset made from it; `with_options` merges (an option set later wins), as in tf.data.
"""
from __future__ import annotations

import enum
from typing import Any

__all__ = ["AutoShardPolicy", "DistributeOptions", "Options", "ThreadingOptions"]


class AutoShardPolicy(enum.IntEnum):
    """How a multi-worker strategy splits a dataset between workers (tf.data.experimental's values).

    DATA: every worker reads the same global batches and keeps its replicas' parts of each. FILE: each
    worker reads whole files of its own (list_files, TFRecordDataset, tfds.load's shards; at least one
    per worker, else an error) and takes its share of every batch from them. AUTO: FILE where every
    file source has at least one file per worker, else DATA. OFF: every worker reads all the data. HINT:
    the pipeline's shard(SHARD_HINT, SHARD_HINT) placeholders become shard(workers, rank) (none is an
    error). On one worker every policy means the same, as in TF."""

    OFF = -1
    AUTO = 0
    FILE = 1
    DATA = 2
    HINT = 3


class _Group:
    """A set of named options, each None (unset) or a checked value; unknown names are refused."""

    _fields: dict[str, str] = {}  # name -> what it accepts (for messages)
    _path = "Options"

    def __init__(self) -> None:
        for name in self._fields:
            object.__setattr__(self, name, None)

    def __setattr__(self, name: str, value: Any) -> None:
        if name not in self._fields:
            raise AttributeError(
                f"mr.data.{self._path} has no option {name!r}; supported: {', '.join(self._fields)}. tf.data "
                "options that tune its graph runtime have no counterpart here (the pipeline runs as "
                "written): remove the line.")
        object.__setattr__(self, name, None if value is None else self._check(name, value))

    def _check(self, name: str, value: Any) -> Any:
        raise NotImplementedError

    def _merged(self, later: _Group) -> _Group:
        out = type(self)()
        for name in self._fields:
            mine, theirs = getattr(self, name), getattr(later, name)
            if isinstance(mine, _Group):
                object.__setattr__(out, name, mine._merged(theirs))
            else:
                object.__setattr__(out, name, theirs if theirs is not None else mine)
        return out

    def __eq__(self, other: object) -> bool:
        return type(other) is type(self) and all(getattr(self, n) == getattr(other, n) for n in self._fields)

    def __repr__(self) -> str:
        values = {n: getattr(self, n) for n in self._fields}
        shown = ", ".join(f"{n}={v!r}" for n, v in values.items()
                          if v is not None and not (isinstance(v, _Group) and v == type(v)()))
        return f"{type(self).__name__}({shown})"


def _nonneg_int(path: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"mr.data.{path} must be an int >= 0 (0: the default); got {value!r}.")
    return value


class DistributeOptions(_Group):
    """`options.experimental_distribute`: `auto_shard_policy` (an AutoShardPolicy; AUTO when unset)."""

    _fields = {"auto_shard_policy": "an AutoShardPolicy"}
    _path = "Options.experimental_distribute"

    def _check(self, name: str, value: Any) -> Any:
        try:
            return AutoShardPolicy(value)
        except ValueError:
            raise ValueError(f"mr.data.{self._path}.auto_shard_policy: {value!r} is not an AutoShardPolicy; use "
                             f"one of {', '.join(p.name for p in AutoShardPolicy)}.") from None


class ThreadingOptions(_Group):
    """`options.threading`: `private_threadpool_size` and `max_intra_op_parallelism`, accepted for tf.data
    programs. They are speed knobs that change no result; here each map's `num_parallel_calls` and
    prefetch decide the threads, so they change nothing."""

    _fields = {"private_threadpool_size": "an int >= 0", "max_intra_op_parallelism": "an int >= 0"}
    _path = "Options.threading"

    def _check(self, name: str, value: Any) -> Any:
        return _nonneg_int(f"{self._path}.{name}", value)


class Options(_Group):
    """tf.data.Options: `deterministic`, `experimental_distribute` (DistributeOptions) and `threading`
    (ThreadingOptions).

    `deterministic=False` allows a pipeline to yield elements out of order for speed; this one keeps
    the order always (an order tf.data's semantics allow), so results are those of True."""

    _fields = {"deterministic": "a bool", "experimental_distribute": "DistributeOptions",
               "threading": "ThreadingOptions"}

    def __init__(self) -> None:
        super().__init__()
        object.__setattr__(self, "experimental_distribute", DistributeOptions())
        object.__setattr__(self, "threading", ThreadingOptions())

    def _check(self, name: str, value: Any) -> Any:
        if name == "deterministic":
            if not isinstance(value, bool):
                raise TypeError(f"mr.data.Options.deterministic must be a bool or None; got {value!r}.")
            return value
        raise AttributeError(f"mr.data.Options.{name} is a group of options: set its fields, e.g. "
                             f"options.{name}.{next(iter(getattr(self, name)._fields))} = ...")

    def merge(self, options: Options) -> Options:
        """A new Options with `options`' set values over this one's (tf.data.Options.merge)."""
        if not isinstance(options, Options):
            raise TypeError(f"Options.merge: expected mr.data.Options, got {type(options).__name__}.")
        return self._merged(options)
