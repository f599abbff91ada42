"""Argument checks shared by the core and the client (no Ray, no torch)."""

from __future__ import annotations

import numbers
from collections.abc import Sequence

import numpy as np

from cpkv.errors import InvalidRequestError


def check_int(name: str, value: object, *, minimum: int | None = None) -> int:
    """Return ``value`` as int, or raise InvalidRequestError naming it."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise InvalidRequestError(f"{name}={value!r} must be an integer")
    value = int(value)
    if minimum is not None and value < minimum:
        raise InvalidRequestError(f"{name}={value} must be >= {minimum}")
    return value


def check_rid(rid: object) -> str | int:
    """Return a request id (a ``str`` or an ``int``; numpy ints become ``int``), or raise."""
    if isinstance(rid, str):
        return rid
    if isinstance(rid, numbers.Integral) and not isinstance(rid, bool):
        return int(rid)
    raise InvalidRequestError(f"rid={rid!r} must be a str or an int, got {type(rid).__name__}")


def check_salt(cache_salt: object) -> None:
    """Raise unless ``cache_salt`` is a ``str``, ``bytes`` or ``None``."""
    if cache_salt is not None and not isinstance(cache_salt, (str, bytes)):
        raise InvalidRequestError(
            f"cache_salt={cache_salt!r} must be str, bytes or None, not {type(cache_salt).__name__}"
        )


def as_token_array(token_ids: object, *, name: str = "token_ids") -> np.ndarray:
    """Return ``token_ids`` as a 1-D int64 array of non-negative ids, or raise.

    A numpy integer array is used without copying when it already is int64.
    """
    if isinstance(token_ids, np.ndarray):
        arr = token_ids
    elif isinstance(token_ids, (Sequence, range)) and not isinstance(token_ids, (str, bytes)):
        arr = np.asarray(token_ids)
    else:
        raise InvalidRequestError(f"{name} must be a sequence of ints, got {type(token_ids)!r}")
    if arr.ndim != 1:
        raise InvalidRequestError(f"{name} must be 1-D, got shape {arr.shape}")
    if arr.size == 0:
        raise InvalidRequestError(f"{name} is empty")
    if arr.dtype == np.bool_ or not np.issubdtype(arr.dtype, np.integer):
        raise InvalidRequestError(f"{name} must hold integers, got dtype {arr.dtype}")
    if arr.dtype != np.int64:
        arr = arr.astype(np.int64)
    low = int(arr.min())
    if low < 0:
        raise InvalidRequestError(f"{name} holds a negative id {low}")
    return arr
