"""`mr.data.experimental`: the tf.data.experimental names that tf.data programs still use.

`AutoShardPolicy` (see mr.data.options), and the older spellings of names that now live in
`mr.data`: `AUTOTUNE`, `INFINITE_CARDINALITY`, `UNKNOWN_CARDINALITY` and `cardinality(ds)`."""
from __future__ import annotations

from typing import Any

from mirrored.data.dataset import AUTOTUNE, INFINITE_CARDINALITY, SHARD_HINT, UNKNOWN_CARDINALITY, Dataset
from mirrored.data.options import AutoShardPolicy

__all__ = ["AUTOTUNE", "INFINITE_CARDINALITY", "SHARD_HINT", "UNKNOWN_CARDINALITY", "AutoShardPolicy", "cardinality"]


def cardinality(dataset: Any) -> int:
    """`dataset.cardinality()`: its number of elements, INFINITE_CARDINALITY or UNKNOWN_CARDINALITY."""
    if not isinstance(dataset, Dataset):
        raise TypeError(f"mr.data.experimental.cardinality: expected an mr.data.Dataset, got "
                        f"{type(dataset).__name__}.")
    return dataset.cardinality()
