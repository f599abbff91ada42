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

The pickler is the standard one with a dispatch table of its own for what every step
carries: a numpy array crosses as its bytes, dtype and shape, and the slotted step and
allocation dataclasses as their field values (rebuilt without ``__post_init__``: they were
checked where they were made). Measured on the 2-core machine
(``python benchmarks/bench_wire.py``, medians): a 16-token prefill's ``StepPacket`` packs in
20 us and unpacks in 19 against 40 and 31 through numpy's and the dataclasses' own reducers
(an array costs ~10 us to pickle that way, a frozen slotted dataclass ~5.5 each way); a
lane's answer with one 1B logits row 20 / 19 against 31 / 27.
"""

from __future__ import annotations

import io
import operator
import pickle
from collections.abc import Callable
from typing import Any

import numpy as np

from cpkv.core.allocator import ExtendAllocation
from cpkv.core.page_hash import TokenDigest
from cpkv.core.steps import LaneReply, StepPacket, StepRequest, StepResult, StepSequence
from cpkv.core.validate import RequestKey

__all__ = ["PACKED_CALLS", "pack", "unpack"]

# Coordinator methods that take one packed argument tuple and answer packed.
PACKED_CALLS = frozenset({"allocate_extend", "allocate_extend_batch", "allocate_decode", "free"})


def pack(obj: Any) -> bytes:
    """``obj`` as one in-band pickle (its arrays' bytes inside); what the standard pickler
    refuses (an error value of a class defined in a function, say) goes through Ray's
    cloudpickle, whose output :func:`unpack` reads as well."""
    buf = io.BytesIO()
    try:
        _Pickler(buf, pickle.HIGHEST_PROTOCOL).dump(obj)
        return buf.getvalue()
    except (pickle.PicklingError, TypeError, AttributeError, ValueError, BufferError):
        from ray import cloudpickle

        return cloudpickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)


def unpack(data: bytes) -> Any:
    """What :func:`pack` packed. NOTE: only for bytes from cpkv's own clients and
    coordinator (the cluster's trusted code, as Ray's own pickles are)."""
    return pickle.loads(data)


def _array(data: Any, dtype: str, shape: tuple[int, ...]) -> np.ndarray:
    """An array from its bytes (writable unless it was read-only, as numpy's own pickle)."""
    out = np.frombuffer(data, dtype)
    return out if len(shape) == 1 else out.reshape(shape)


def _reduce_array(a: np.ndarray) -> tuple:
    dtype = a.dtype
    if (
        dtype.hasobject
        or dtype.names is not None
        or dtype.subdtype is not None
        or dtype.kind in "mM"
    ):
        # numpy's own for the rare kinds (a buffer cannot carry datetimes, say)
        return a.__reduce_ex__(pickle.HIGHEST_PROTOCOL)
    if not a.flags.c_contiguous:  # crosses in C order
        writeable = a.flags.writeable
        a = np.ascontiguousarray(a)
        a.flags.writeable = writeable
    # NOTE: in band, a PickleBuffer of a writable array unpickles as a bytearray (a writable
    # array), of a read-only one as bytes (a read-only one): numpy's own behaviour.
    return _array, (pickle.PickleBuffer(a), a.dtype.str, a.shape)


def _rebuild(cls: type, values: tuple) -> Any:
    """An instance of the slotted ``cls`` with ``values`` in its slots (no ``__init__``)."""
    obj = object.__new__(cls)
    for set_slot, value in zip(_SLOT_SETTERS[cls], values, strict=True):
        set_slot(obj, value)
    return obj


def _slots_reducer(cls: type) -> Callable[[Any], tuple]:
    fields = operator.attrgetter(*cls.__slots__)
    if len(cls.__slots__) == 1:
        return lambda obj: (_rebuild, (cls, (fields(obj),)))
    return lambda obj: (_rebuild, (cls, fields(obj)))


_SLOTTED = (
    StepPacket,
    StepRequest,
    StepSequence,
    StepResult,
    LaneReply,
    ExtendAllocation,
    RequestKey,
    TokenDigest,
)
# The slots' own descriptors: setting through them passes a frozen class's __setattr__
# (half the cost of object.__setattr__ by name, measured).
_SLOT_SETTERS = {cls: tuple(cls.__dict__[n].__set__ for n in cls.__slots__) for cls in _SLOTTED}


class _Pickler(pickle.Pickler):
    # Exact types only: a subclass pickles as it always did.
    dispatch_table = {
        np.ndarray: _reduce_array,
        **{cls: _slots_reducer(cls) for cls in _SLOTTED},
    }
