"""mr.utils: helpers that belong to no other namespace (keras.utils's spelling)."""
from __future__ import annotations

import random

import numpy as np
import torch

__all__ = ["set_random_seed"]


def set_random_seed(seed: int) -> None:
    """Seeds Python's `random`, numpy's and torch's global generators (keras.utils.set_random_seed),
    and so the replicas' generators of every strategy built with seed=None (they take torch's seed)."""
    if not isinstance(seed, int) or isinstance(seed, bool):
        raise TypeError(f"mr.utils.set_random_seed(seed={seed!r}): the seed must be an int, e.g. 1337.")
    random.seed(seed)
    np.random.seed(seed % (1 << 32))  # numpy takes seeds in [0, 2**32)
    torch.manual_seed(seed)  # every CUDA device's too
