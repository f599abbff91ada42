"""glibc's allocator thresholds fixed in a pool actor's process, at its start.

NOTE: glibc serves an allocation above its mmap threshold from fresh pages and returns them
at free; a step's answer pickled into a growing buffer (2 MB for eight bf16 rows of a 128k
vocabulary) then faults in every page, at every step. A fixed threshold keeps such buffers
in the reused heap. Measured on the 2-core machine (docs/BENCHMARKS.md, 2026-12-06 (4)): the
coordinator packed a batch-8 decode's answer in 0.42-0.46 ms with these against 0.97-1.03 ms
without.

They are set by ``mallopt`` in the running actor, not as ``MALLOC_*_`` variables in its
``runtime_env``: an actor with a runtime env of its own needs a worker process started for
it, while one without takes an idle worker Ray has started already (2-core machine, cp=2 tiny
pool, four pairs alternating: ``connect`` 3.35-4.53 s against 4.30-5.13 s;
docs/BENCHMARKS.md, 2026-12-07 (2)).
"""

from __future__ import annotations

import ctypes
import os

__all__ = ["MMAP_THRESHOLD", "TRIM_THRESHOLD", "fix_malloc_thresholds"]

MMAP_THRESHOLD = 64 << 20
TRIM_THRESHOLD = 128 << 20
# mallopt's parameter numbers (glibc's malloc.h)
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3


def fix_malloc_thresholds() -> bool:
    """Fix glibc's mmap and trim thresholds in this process (no dynamic adjustment), except
    one the environment sets itself (glibc read that at start). Whether both are fixed now;
    ``False`` where the C library is not glibc (nothing is changed there)."""
    try:
        mallopt = ctypes.CDLL("libc.so.6").mallopt
    except (OSError, AttributeError):
        return False
    fixed = True
    for param, env, value in (
        (_M_MMAP_THRESHOLD, "MALLOC_MMAP_THRESHOLD_", MMAP_THRESHOLD),
        (_M_TRIM_THRESHOLD, "MALLOC_TRIM_THRESHOLD_", TRIM_THRESHOLD),
    ):
        if env not in os.environ:
            fixed = bool(mallopt(param, value)) and fixed
    return fixed
