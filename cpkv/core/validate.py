"""Argument checks shared by the core and the client (no Ray, no torch)."""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from cpkv.errors import InvalidRequestError


def check_float(name: str, value: object, *, minimum: float = 0.0) -> float:
    """Return ``value`` as a finite float ``>= minimum``, or raise InvalidRequestError."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise InvalidRequestError(f"{name}={value!r} must be a number")
    value = float(value)
    if not math.isfinite(value) or value < minimum:
        raise InvalidRequestError(f"{name}={value!r} must be finite and >= {minimum}")
    return value


def check_rids(rids: object, *, what: str = "rids") -> list[str | int]:
    """Return a list of request ids from a list or tuple of them, or raise.

    A ``str`` is refused (it would be read as one id per character), and so is any
    other non-sequence.
    """
    if isinstance(rids, (str, bytes)) or not isinstance(rids, (list, tuple, range)):
        raise InvalidRequestError(
            f"{what} must be a list of request ids, got {type(rids).__name__} {rids!r:.60}"
        )
    return [check_rid(rid) for rid in rids]


def check_distinct(rids: list, what: str) -> None:
    """Raise InvalidRequestError when a request id repeats in ``rids`` (one call's batch)."""
    if len(set(rids)) != len(rids):
        raise InvalidRequestError(f"{what} got repeated rids: {rids}")


def check_int(name: str, value: object, *, minimum: int | None = None) -> int:
    """Return ``value`` as int, or raise InvalidRequestError naming it."""
    if type(value) is not int:  # the common case skips the ABC check (bool is not int here)
        if isinstance(value, bool) or not isinstance(value, numbers.Integral):
            raise InvalidRequestError(f"{name}={value!r} must be an integer")
        value = int(value)
    if minimum is not None and value < minimum:
        raise InvalidRequestError(f"{name}={value} must be >= {minimum}")
    return value


@dataclass(frozen=True, slots=True)
class RequestKey:
    """A request id inside a namespace: the coordinator's key of a client's request.

    Two clients' ``"req-0"`` are two keys unless the clients share a namespace. Shown as
    the bare id: messages go only to clients of the same namespace.
    """

    namespace: str
    rid: str | int

    def __repr__(self) -> str:
        return repr(self.rid)


def user_rid(key: object) -> object:
    """The id the client gave for ``key`` (the key itself when it has no namespace)."""
    return key.rid if isinstance(key, RequestKey) else key


def check_rid(rid: object) -> str | int | RequestKey:
    """Return a request id (a ``str`` or an ``int``; numpy ints become ``int``), or raise."""
    if isinstance(rid, (str, RequestKey)):
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
    """Return ``token_ids`` as a contiguous 1-D int64 array of non-negative ids, or raise.

    The one converter of token ids: the core takes what it returns as is. A contiguous
    int64 numpy array comes back itself, not copied.
    """
    if isinstance(token_ids, np.ma.MaskedArray):  # its checks would skip masked ids
        raise InvalidRequestError(f"{name} is a masked array: pass the ids themselves")
    if isinstance(token_ids, np.ndarray):
        arr = token_ids
    elif isinstance(token_ids, (Sequence, range)) and not isinstance(token_ids, (str, bytes)):
        try:
            arr = np.asarray(token_ids)
        except ValueError as e:  # ragged: [1, [2, 3]]
            raise InvalidRequestError(f"{name} must be a flat sequence of ints: {e}") from None
    else:
        raise InvalidRequestError(f"{name} must be a sequence of ints, got {type(token_ids)!r}")
    if arr.ndim != 1:
        raise InvalidRequestError(f"{name} must be 1-D, got shape {arr.shape}")
    if arr.size == 0:
        raise InvalidRequestError(f"{name} is empty")
    if not isinstance(token_ids, np.ndarray) and (
        arr.dtype == np.bool_
        or not np.issubdtype(arr.dtype, np.integer)
        or any(type(t) in (bool, np.bool_) for t in token_ids)  # numpy reads [True, 3] as [1, 3]
    ):
        _object_ids(token_ids, name)  # names the first id that is not a plain integer
    if arr.dtype == np.bool_ or not np.issubdtype(arr.dtype, np.integer):
        raise InvalidRequestError(f"{name} must hold integers, got dtype {arr.dtype}")
    if arr.dtype == np.uint64 and arr.size and int(arr.max()) >= 2**63:
        i = int(np.argmax(arr))
        raise InvalidRequestError(f"{name}[{i}]={int(arr[i])} is past the largest id 2**63-1")
    if arr.dtype != np.int64 or not arr.flags.c_contiguous:
        arr = np.ascontiguousarray(arr, dtype=np.int64)
    low = int(arr.min())
    if low < 0:
        raise InvalidRequestError(f"{name}[{int(np.argmin(arr))}] holds a negative id {low}")
    return arr


def check_vocab(tokens: np.ndarray, vocab_size: int | None, *, name: str = "token_ids") -> None:
    """Raise unless every id of ``tokens`` (int64, non-negative) is below ``vocab_size``."""
    if vocab_size is None or tokens.size == 0:
        return
    high = int(tokens.max())
    if high >= vocab_size:
        i = int(np.argmax(tokens >= vocab_size))
        raise InvalidRequestError(
            f"{name}[{i}]={int(tokens[i])} is outside the model's vocabulary [0, {vocab_size})"
        )


def _object_ids(token_ids: object, name: str) -> np.ndarray:
    """Python ints too large for int64 (or mixed objects) in a list: name the first bad one."""
    for i, t in enumerate(token_ids):  # type: ignore[union-attr]
        if isinstance(t, (bool, np.bool_)) or not isinstance(t, numbers.Integral):
            raise InvalidRequestError(
                f"{name}[{i}]={t!r} ({type(t).__name__}) is not an integer id"
            )
        if not 0 <= int(t) < 2**63:
            raise InvalidRequestError(f"{name}[{i}]={int(t)} is outside [0, 2**63)")
    raise InvalidRequestError(f"{name} must hold integer ids")
