"""A client's allocation calls (extend, decode, free): their tokens sent as a digest where
the client can, and what their answers leave in its book of live requests."""

from __future__ import annotations

import functools
from collections.abc import Hashable

import numpy as np

from cpkv.client._calls import Call, CoordinatorCalls
from cpkv.client._payloads import TokenPayloads
from cpkv.client._requests import LiveRequests
from cpkv.errors import StaleDigestError, UnknownRequestError

__all__ = ["AllocationCalls"]


class AllocationCalls:
    """Makes a client's allocation calls over its coordinator calls; the arguments are
    checked already (see :mod:`cpkv.client._args`)."""

    def __init__(
        self, rpc: CoordinatorCalls, requests: LiveRequests, payloads: TokenPayloads
    ) -> None:
        self._rpc = rpc
        self._requests = requests
        self._payloads = payloads

    def extend(self, rid, tokens: np.ndarray, cache_salt, call_id) -> Call:
        """Allocate one request's new tokens (checked); its held length noted."""
        call = functools.partial(
            self._rpc.call, "allocate_extend", rid, what="allocate_extend", fenced=True
        )
        call_id = self._rpc.call_id(call_id)
        yield from self._rpc.greet_if_restarted()  # first: the restarted one's key digests
        payload = self._payloads.payload(call_id, rid, tokens)
        try:
            out = yield from call(payload, cache_salt, call_id=call_id)
        except StaleDigestError:  # another client of the namespace extended it meanwhile
            ids_id = self._payloads.sends_ids(("tokens", call_id), [rid])
            out = yield from call(tokens, cache_salt, call_id=ids_id)
        self._requests.rids.add(rid)
        self._requests.held[rid] = out.prefix_len + out.extend_len
        return out

    def extend_batch(self, checked: list[tuple[Hashable, np.ndarray]], cache_salt, call_id) -> list:
        """Allocate one prefill step of several requests (checked), all or nothing."""
        call = functools.partial(
            self._rpc.call, "allocate_extend_batch", what="allocate_extend_batch", fenced=True
        )
        call_id = self._rpc.call_id(call_id)
        self._rpc.run(self._rpc.greet_if_restarted())  # first: the restarted one's key digests
        payload = [(rid, self._payloads.payload(call_id, rid, tokens)) for rid, tokens in checked]
        try:
            out = self._rpc.run(call(payload, cache_salt, call_id=call_id))
        except StaleDigestError:  # another client of the namespace extended one meanwhile
            ids_id = self._payloads.sends_ids(("tokens", call_id), [rid for rid, _ in checked])
            out = self._rpc.run(call(checked, cache_salt, call_id=ids_id))
        self._requests.rids.update(rid for rid, _ in checked)
        for alloc, (rid, _) in zip(out, checked, strict=True):
            self._requests.held[rid] = alloc.prefix_len + alloc.extend_len
        return out

    def decode(self, rids: list, toks: np.ndarray | None, call_id) -> Call:
        """One more token for each request; their held lengths moved on."""
        out = yield from self._rpc.call(
            "allocate_decode", rids, toks, what="allocate_decode", call_id=call_id, fenced=True
        )
        for rid in rids:
            if rid in self._requests.held:
                self._requests.held[rid] += 1
        return out

    def free(self, rid, cache, committed_len, call_id) -> Call:
        """Release a request; it is forgotten, also when the pool holds none."""
        try:
            out = yield from self._rpc.call(
                "free", rid, bool(cache), committed_len, what="free", call_id=call_id
            )
        except UnknownRequestError:  # the pool holds none (a free that timed out took effect)
            self._requests.forget([rid])
            raise
        self._requests.forget([rid])
        return out
