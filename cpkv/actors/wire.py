"""The allocation calls' wire: their arguments and answer cross Ray as one pickled ``bytes``.

Ray pickles an argument or a result holding numpy arrays with each array as a buffer of its
own; for the allocation path's small objects (a 128k-token ``TokenDigest`` is 16 KB, the
``ExtendAllocation`` answer 17 KB) that costs more than the data. One in-band pickle each
way: measured on the 2-core machine (``benchmarks/bench_actors.py --iters 300``, 128k
tokens at cp 4, five pairs alternating) allocate_extend 2.26-2.58 ms in four runs (one
4.86) against 3.09-5.02 ms with Ray's own serialisation (docs/BENCHMARKS.md, 2026-12-05).
Steps sent through compiled graphs are packed too (:mod:`cpkv.actors.step_graph`,
:mod:`cpkv.actors.compiled_steps`): their values hold no object refs, and a freshly unpickled
answer owns its arrays (a value read from a graph's channel may stay a view of its shared
buffer, which had to be deep-copied). Steps sent as actor calls are not: their answers hold
object refs, which only Ray's serialisation lends correctly.
"""

from __future__ import annotations

import pickle
from typing import Any

__all__ = ["PACKED_CALLS", "pack", "unpack"]

# Coordinator methods that take one packed argument tuple and answer packed.
PACKED_CALLS = frozenset({"allocate_extend", "allocate_extend_batch", "allocate_decode", "free"})


def pack(obj: Any) -> bytes:
    """``obj`` as one in-band pickle (its arrays' bytes inside); what the standard pickler
    refuses (an error value of a class defined in a function, say) goes through Ray's
    cloudpickle, whose output :func:`unpack` reads as well."""
    try:
        return pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    except (pickle.PicklingError, TypeError, AttributeError):
        from ray import cloudpickle

        return cloudpickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)


def unpack(data: bytes) -> Any:
    """What :func:`pack` packed. NOTE: only for bytes from cpkv's own clients and
    coordinator (the cluster's trusted code, as Ray's own pickles are)."""
    return pickle.loads(data)
