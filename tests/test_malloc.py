"""cpkv.actors.malloc: the pool actors' allocator thresholds, in a fresh process (no Ray)."""

from __future__ import annotations

import os
import resource
import subprocess
import sys

import pytest

_BIG = 40 << 20  # above glibc's largest dynamic mmap threshold (32 MB on 64-bit)


def faults_per_big_alloc(cycles: int = 3) -> int:
    """Page faults per allocation and free of a 40 MB buffer in this process (its pages
    touched): ~10k when glibc maps it afresh each time, ~0 when the heap keeps it."""
    bytearray(_BIG)  # the first one may fault anywhere
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(cycles):
        bytearray(_BIG)
    return (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) // cycles


# Faults before the fix, whether it fixed both thresholds, faults after.
_CHILD = """
from cpkv.actors.malloc import fix_malloc_thresholds
from tests.test_malloc import faults_per_big_alloc
before = faults_per_big_alloc()
fixed = fix_malloc_thresholds()
print(before, fixed, faults_per_big_alloc())
"""


def _child(**env: str) -> tuple[int, str, int]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    out = subprocess.run(
        [sys.executable, "-c", _CHILD],
        env={**clean, **env},
        cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    return int(out[0]), out[1], int(out[2])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_fixed_thresholds_keep_a_big_buffer_in_the_heap():
    before, fixed, after = _child()
    assert before > 5000, before  # glibc's default: mapped and faulted in every time
    assert fixed == "True" and after < 100, (fixed, after)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_a_threshold_the_environment_sets_is_left_to_it():
    # glibc read it at start (here: keep the default behaviour for a 40 MB buffer)
    before, fixed, after = _child(MALLOC_MMAP_THRESHOLD_=str(1 << 20))
    assert fixed == "True" and before > 5000 and after > 5000, (before, after)
