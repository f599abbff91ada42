"""What an allocation sends of its tokens: their digest (8 bytes a page) at the request's
partial-page offset when the client knows it, else the ids; the offset each call id used is
remembered, so that a retry by call id sends what its first send did."""

from __future__ import annotations

import collections
import threading
from collections.abc import Hashable

import numpy as np

from cpkv.client._requests import LiveRequests
from cpkv.core.config import CPConfig
from cpkv.core.page_hash import PageHasher, TokenDigest

__all__ = ["TokenPayloads"]

# Digest offsets remembered by (call id, rid), for retries by call id.
_REMEMBERED_OFFSETS = 4096


class TokenPayloads:
    """The payloads of a client's allocations, digested with the coordinator's page key."""

    def __init__(self, config: CPConfig, hello: dict, requests: LiveRequests) -> None:
        self._page_size = config.page_size
        self._requests = requests
        self._hasher = _hasher(self._page_size, hello)
        # The partial-page offset each (call id, rid) was digested at (the newest), for
        # retries by call id: -1 when the ids themselves were sent.
        self._offsets: collections.OrderedDict[tuple, int] = collections.OrderedDict()
        self._lock = threading.Lock()

    def rekey(self, hello: dict) -> None:
        """Take a (restarted) coordinator's page key from its greeting."""
        self._hasher = _hasher(self._page_size, hello)

    def payload(
        self, call_id: Hashable, rid: Hashable, tokens: np.ndarray
    ) -> np.ndarray | TokenDigest:
        """What an allocation sends of ``tokens``: their digest (8 bytes a page) when this
        client knows where they start in the request's partial page, else the ids. A retry
        by call id digests at the offset its first send used (``held`` may have moved)."""
        if self._hasher is None:
            return tokens
        with self._lock:
            offset = self._offsets.get((call_id, rid))
            if offset is None:
                held = self._requests.held.get(rid)
                # Live, but stepped since (its length unknown here): the ids themselves.
                unknown = held is None and rid in self._requests.rids
                offset = -1 if unknown else (held or 0) % self._page_size
                self._remember_offset((call_id, rid), offset)
        return tokens if offset < 0 else self._hasher.digest(tokens, offset)

    def sends_ids(self, call_id: Hashable, rids: list) -> Hashable:
        """``call_id``, noted as sending the ids of ``rids`` themselves (a digest went stale):
        a retry by that id, which a timeout hands back, sends them again, not a digest."""
        with self._lock:
            for rid in rids:
                self._remember_offset((call_id, rid), -1)
        return call_id

    def _remember_offset(self, key: tuple, offset: int) -> None:
        """Lock held: the offset ``(call id, rid)`` was sent at; the oldest are forgotten."""
        self._offsets[key] = offset
        while len(self._offsets) > _REMEMBERED_OFFSETS:
            self._offsets.popitem(last=False)


def _hasher(page_size: int, hello: dict) -> PageHasher | None:
    """The coordinator's page hasher, rebuilt from the key it gives its clients."""
    key = hello.get("page_hash_key")
    return None if key is None else PageHasher(page_size, key)
