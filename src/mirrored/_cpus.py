"""`usable_cores()`: the cores this process may run on, for sizing thread pools. Stdlib only."""
from __future__ import annotations

import os


def usable_cores() -> int:
    """This process's CPU affinity (what taskset or a container grants), else every core; at least 1."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0)) or 1
    return os.cpu_count() or 1
