"""`tune_allocator()`: make glibc's malloc keep freed memory for reuse, as jemalloc/tcmalloc do.

With glibc's defaults, a block above the adaptive mmap threshold (128 KB, rising to at most 32 MB)
is its own mmap, and memory freed at the top of a heap goes back to the kernel past the trim
threshold. An input pipeline lives on such blocks: each decoded image, each resized float copy
and each batch is allocated on one thread and freed on another, so every image costs fresh
zeroed pages - measured 50-200 page faults and 0.3-0.6 ms of kernel time per 224x224 image, a
fifth of its cost, and more with several threads faulting at once. Raising both thresholds keeps
those blocks in the heaps, where the next image reuses them. The price is memory: up to
`trim_threshold` bytes freed at the top of each heap stay with the process.

This changes a process-wide setting, so the library never does it behind a user's back: the
`mirrored` command and the examples call it, and so may any program (or set
MALLOC_MMAP_THRESHOLD_ / MALLOC_TRIM_THRESHOLD_ in the environment before Python starts).
Uses the standard library only.
"""
from __future__ import annotations

import ctypes
import logging
import os

logger = logging.getLogger(__name__)

_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # glibc's malloc.h
_MMAP_MAX = 32 << 20  # glibc's own ceiling for the mmap threshold on 64-bit systems (HEAP_MAX_SIZE / 2)
_tuned: tuple[int, int] | None = None


def tune_allocator(mmap_threshold: int = _MMAP_MAX, trim_threshold: int = 256 << 20) -> bool:
    """Keeps blocks up to `mmap_threshold` bytes in malloc's heaps and lets up to `trim_threshold`
    freed bytes stay there. Returns True where applied (glibc), False elsewhere (nothing changes:
    macOS, musl and Windows allocators already cache freed memory, or are tuned their own way)."""
    global _tuned
    for name, value, ceiling in (("mmap_threshold", mmap_threshold, _MMAP_MAX),
                                 ("trim_threshold", trim_threshold, 2**31 - 1)):
        if isinstance(value, bool) or not isinstance(value, int) or not 0 < value <= ceiling:
            raise ValueError(f"tune_allocator({name}={value!r}): give a number of bytes in (0, {ceiling}] "
                             f"(glibc's limit), e.g. {_MMAP_MAX} for 32 MB.")
    if _tuned == (mmap_threshold, trim_threshold):
        return True
    libc = _glibc()
    if libc is None:
        logger.info("tune_allocator: not glibc; leaving the allocator as it is")
        return False
    if not (libc.mallopt(_M_MMAP_THRESHOLD, mmap_threshold) and libc.mallopt(_M_TRIM_THRESHOLD, trim_threshold)):
        logger.warning("tune_allocator: glibc's mallopt refused mmap_threshold=%d, trim_threshold=%d",
                       mmap_threshold, trim_threshold)
        return False
    _tuned = (mmap_threshold, trim_threshold)
    logger.debug("tune_allocator: mmap threshold %d, trim threshold %d", mmap_threshold, trim_threshold)
    return True


def child_environment() -> dict[str, str]:
    """The environment variables that start a child process with this one's tuning (glibc reads them
    at startup), or {} where tune_allocator() was not applied: a benchmark's worker processes then run
    on the allocator its own rows run on."""
    if _tuned is None:
        return {}
    return {"MALLOC_MMAP_THRESHOLD_": str(_tuned[0]), "MALLOC_TRIM_THRESHOLD_": str(_tuned[1])}


def _glibc() -> ctypes.CDLL | None:
    try:  # asks the running C library (platform.libc_ver() would scan the interpreter's binary)
        if not os.confstr("CS_GNU_LIBC_VERSION").startswith("glibc"):
            return None
    except (AttributeError, ValueError, OSError):  # not POSIX, or no such name: not glibc
        return None
    try:
        libc = ctypes.CDLL(None)  # the C library this process already runs on
        libc.mallopt.argtypes, libc.mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    except (OSError, AttributeError):
        return None
    return libc
