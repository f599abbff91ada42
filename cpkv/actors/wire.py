"""The allocation calls' wire: their arguments and answer cross Ray as one pickled ``bytes``.

Ray pickles an argument or a result holding numpy arrays with each array as a buffer of its
own; for the allocation path's small objects (a 128k-token ``TokenDigest`` is 16 KB, the
``ExtendAllocation`` answer 17 KB) that costs more than the data. One in-band pickle each
way: measured on the 2-core machine (``benchmarks/bench_actors.py --iters 300``, 128k
tokens at cp 4, five pairs alternating) allocate_extend 2.26-2.58 ms in four runs (one
4.86) against 3.09-5.02 ms with Ray's own serialisation (docs/BENCHMARKS.md, 2026-12-05).
Steps are not packed: their answers hold object refs, which only Ray's serialisation lends
correctly.
"""

from __future__ import annotations

import pickle
from typing import Any

__all__ = ["PACKED_CALLS", "pack", "unpack"]

# Coordinator methods that take one packed argument tuple and answer packed.
PACKED_CALLS = frozenset({"allocate_extend", "allocate_extend_batch", "allocate_decode", "free"})


def pack(obj: Any) -> bytes:
    """``obj`` as one in-band pickle (its arrays' bytes inside)."""
    return pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)


def unpack(data: bytes) -> Any:
    """What :func:`pack` packed. NOTE: only for bytes from cpkv's own clients and
    coordinator (the cluster's trusted code, as Ray's own pickles are)."""
    return pickle.loads(data)
