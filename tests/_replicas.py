"""Logical CPU replicas, as most tests build them: `strategy_of(n)`, the calling replica's
`replica_id()` and the collective timeout `TIMEOUT_S`. Test modules import it by name
(`from _replicas import strategy_of`): conftest.py's folder, tests/, is on sys.path.

Plain functions, not fixtures: a test builds its strategy where it needs one, with the replica count
it is parametrized by, and drops it when it returns; a fixture's value would live until teardown,
past conftest.py's check for threads left behind."""
from __future__ import annotations

from typing import Any

import mirrored.distribute as md

# A collective waits this long for a missing replica: a hang fails its test in seconds, naming the
# replica, instead of at pytest's 120 s timeout; a loaded 2-core machine stays far below it.
TIMEOUT_S = 20.0


def strategy_of(n: int, **kwargs: Any) -> md.MirroredStrategy:
    """MirroredStrategy on the logical CPU replicas cpu:0 .. cpu:n-1, with timeout_s=TIMEOUT_S unless
    kwargs give another (or any other argument of MirroredStrategy)."""
    kwargs.setdefault("timeout_s", TIMEOUT_S)
    return md.MirroredStrategy(devices=[f"cpu:{i}" for i in range(n)], **kwargs)


def replica_id() -> int:
    """The calling replica's id inside strategy.run (0 outside it)."""
    return md.get_replica_context().replica_id_in_sync_group
