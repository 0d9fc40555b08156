"""derive_seed: one seed from several integers, the same in every process and on every platform.

The replicas' generators (distribute/random.py) and the pipeline's per-element generators
(data/, Dataset.map_with_generator) seed from it. Uses nothing."""
from __future__ import annotations

_MASK64 = (1 << 64) - 1


def derive_seed(*parts: int) -> int:
    """A 63-bit seed from integers by splitmix64, so nearby inputs (steps, indices) give unrelated seeds."""
    h = 0x9E3779B97F4A7C15
    for part in parts:
        h = (h ^ (int(part) & _MASK64)) & _MASK64
        h = (h + 0x9E3779B97F4A7C15) & _MASK64
        h = ((h ^ (h >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
        h = ((h ^ (h >> 27)) * 0x94D049BB133111EB) & _MASK64
        h ^= h >> 31
    return h >> 1
