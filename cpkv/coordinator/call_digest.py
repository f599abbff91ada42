"""Telling a retried client call from a misuse: argument digests and client call numbers.

A call is named by ``(client id, call id)``; its repeat must ask the same thing, which the
coordinator checks by a cheap fingerprint of the call's arguments (:func:`args_digest`). A
client's own call ids count up per stream (:func:`client_call_number`), so the reply cache
knows a retry of one of them however late it comes.
"""

from __future__ import annotations

import zlib
from collections.abc import Hashable
from typing import Any

import numpy as np

from cpkv.core.page_hash import TokenDigest
from cpkv.core.reply_cache import DROPPED, ReplyCache
from cpkv.errors import InvalidRequestError

__all__ = [
    "args_digest",
    "client_call_number",
    "client_call_streams",
    "items_digest",
    "repeat_answer",
    "rids_digest",
    "was_answered",
]


def was_answered(replies: ReplyCache, key: tuple) -> bool:
    """Whether the call ``key`` (``(client id, call id)``) was answered: its reply is kept,
    or was forgotten (a repeat of it is not run again either way)."""
    return key in replies or replies.is_forgotten(key)


def repeat_answer(replies: ReplyCache, key: tuple, op: str, digest: int | None) -> Any:
    """The answer to a repeat of an answered call (:func:`was_answered`): the first answer
    when it asks the same thing (``op`` and argument ``digest``), else a refusal."""
    call_id = key[1]
    if key not in replies:
        return InvalidRequestError(
            f"call_id={call_id!r} was answered before the last "
            f"{replies.capacity} calls and its answer is no longer kept: it is "
            "not run again (a retry must come sooner; check the request's state)"
        )
    first_op, first_digest = replies.tag(key)
    if (first_op, first_digest) != (op, digest):
        return InvalidRequestError(
            f"call_id={call_id!r} was first a {first_op!r} call with other arguments; "
            f"a call id names one call (this {op!r} call was not run)"
        )
    answer = replies.get(key)
    if answer is DROPPED:
        return InvalidRequestError(
            f"call_id={call_id!r} was answered and took effect; its reply is no longer "
            "kept (a retry must come sooner)"
        )
    return answer


def client_call_number(key: tuple) -> tuple[Hashable, int] | None:
    """A client's own call ids, ``(client id, n)`` with ``n`` counting up (and its retry
    with token ids, ``("tokens", that)``), as ``(stream, n)``; ``None`` for any other id.
    NOTE: so a retry of such a call is never run twice, however late it comes."""
    client_id, call_id = key
    stream, tokens_stream = client_call_streams(client_id)
    if type(call_id) is tuple and len(call_id) == 2 and call_id[0] == "tokens":
        stream, call_id = tokens_stream, call_id[1]
    if (
        type(call_id) is tuple
        and len(call_id) == 2
        and call_id[0] == client_id
        and type(call_id[1]) is int
    ):
        return stream, call_id[1]
    return None


def client_call_streams(client_id: str | None) -> tuple[tuple, tuple]:
    return (client_id,), (client_id, "tokens")


def args_digest(*parts: Any, crc: int = 0) -> int:
    """A cheap fingerprint of a call's arguments: a call id repeated with other arguments is
    a client bug to refuse, not a retry (CRC32 of the token bytes: 0.1 ms for 128k ids)."""
    for part in parts:
        if isinstance(part, TokenDigest):
            crc = args_digest(part.num_tokens, part.offset, part.head, part.tail, crc=crc)
            crc = zlib.crc32(part.contents.data, crc)
        elif isinstance(part, np.ndarray) or (
            isinstance(part, (list, tuple, range))
            and len(part)
            and isinstance(part[0], (int, np.integer))
        ):
            crc = _array_digest(part, crc)
        elif isinstance(part, np.integer):  # a rid the core keys as the int it equals
            crc = zlib.crc32(repr(int(part)).encode(), crc)
        else:
            crc = zlib.crc32(repr(part).encode(), crc)
    return crc


def _array_digest(part: Any, crc: int) -> int:
    """Integer ids by their int64 values (so ids sent as int32 or int64, list or array, match
    on a retry); anything else by its dtype, shape and bytes, so that float "ids" never
    match the integers they would truncate to."""
    try:
        arr = np.ascontiguousarray(part)
    except (OverflowError, TypeError, ValueError):  # not ids: the call refuses them
        return zlib.crc32(repr(part).encode(), crc)
    if arr.dtype.kind in "iu":
        return zlib.crc32(arr.astype(np.int64, copy=False).data, crc)
    if arr.dtype.hasobject:
        return zlib.crc32(repr(part).encode(), crc)
    crc = zlib.crc32(f"{arr.dtype.str}{arr.shape}".encode(), crc)
    return zlib.crc32(arr.data, crc)


def items_digest(items: Any) -> int:
    try:
        return args_digest(*(x for item in items for x in item))
    except TypeError:
        return args_digest(repr(items))


def rids_digest(rids: Any) -> int:
    return args_digest(repr(list(rids)) if isinstance(rids, (list, tuple)) else repr(rids))
