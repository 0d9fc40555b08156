"""tune_allocator: glibc keeps freed memory for reuse (checked by page faults in a fresh process)."""
from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest

import mirrored as mr

SRC = Path(__file__).resolve().parents[1] / "src"

# Allocates and frees a zero-filled 8 MB block ten times and prints the page faults per cycle.
_CYCLES = """
import resource, sys
sys.path.insert(0, {src!r})
if {tune}:
    from mirrored._allocator import tune_allocator
    assert tune_allocator()
def cycle():
    block = bytearray(8 << 20)
    del block
cycle()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(10):
    cycle()
print((resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / 10)
"""


def faults_per_cycle(tune: bool) -> float:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MALLOC_", "GLIBC_TUNABLES"))}
    out = subprocess.run([sys.executable, "-c", _CYCLES.format(src=str(SRC), tune=tune)], capture_output=True,
                         text=True, timeout=60, check=True, env=env)
    return float(out.stdout)


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="mallopt is glibc's")
def test_freed_blocks_are_reused_instead_of_faulted_in_again():
    """With glibc's defaults the 8 MB block (2048 pages) comes back from the kernel partly as fresh
    pages each time (~200 faults measured: what the heap trim gave back); tuned, none."""
    assert faults_per_cycle(tune=False) > 100
    assert faults_per_cycle(tune=True) < 5


@pytest.mark.parametrize("kwargs", [{"mmap_threshold": 0}, {"mmap_threshold": 64 << 20},
                                    {"trim_threshold": -1}, {"trim_threshold": 1.5}, {"mmap_threshold": True}])
def test_bad_thresholds_are_refused_by_name(kwargs):
    name = next(iter(kwargs))
    with pytest.raises(ValueError, match=rf"tune_allocator\({name}="):
        mr.tune_allocator(**kwargs)


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="mallopt is glibc's")
def test_a_tuned_process_starts_its_children_tuned_through_the_environment():
    """A benchmark's worker processes run on the allocator of the process that starts them: the
    environment child_environment() gives (empty untuned) makes a fresh process reuse freed blocks."""
    script = ("import json, sys; sys.path.insert(0, {src!r}); from mirrored import _allocator; "
              "before = _allocator.child_environment(); assert _allocator.tune_allocator(); "
              "print(json.dumps([before, _allocator.child_environment()]))").format(src=str(SRC))
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60, check=True)
    before, after = json.loads(out.stdout)
    assert before == {} and set(after) == {"MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_"}
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MALLOC_", "GLIBC_TUNABLES"))}
    child = subprocess.run([sys.executable, "-c", _CYCLES.format(src=str(SRC), tune=False)], capture_output=True,
                           text=True, timeout=60, check=True, env={**env, **after})
    assert float(child.stdout) < 5  # (untuned: > 100, the test above)
