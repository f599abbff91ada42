"""The request table: each live request's pages, tokens and page chain, its row, and the
requests lost with a lane."""

from __future__ import annotations

from collections.abc import Hashable, Iterator
from dataclasses import dataclass

import numpy as np

from cpkv.core.layout import PageLayout
from cpkv.core.page_hash import ChainState, PageHasher, TokenDigest
from cpkv.core.prefix_cache import PrefixMatch
from cpkv.core.validate import check_rid
from cpkv.errors import (
    LaneUnavailableError,
    StaleDigestError,
    UnknownRequestError,
)

__all__ = ["Chunk", "Request", "RequestTable"]

_EMPTY_I32 = np.empty(0, dtype=np.int32)
_EMPTY_I32.flags.writeable = False
_EMPTY_U64 = np.empty(0, dtype=np.uint64)
_EMPTY_I64 = np.empty(0, dtype=np.int64)


@dataclass(slots=True, frozen=True)
class Chunk:
    """A step's new tokens as the prefix cache sees them.

    Attributes:
        num_tokens: new tokens.
        hashes: ``uint64`` hashes of the pages that the request's partial page plus
            these tokens complete.
        chain: the page chain after those pages; ``None`` when the tokens are unknown.
        tail: tokens after the last full page; ``None`` when unknown.
    """

    num_tokens: int
    hashes: np.ndarray
    chain: ChainState | None
    tail: np.ndarray | None

    @classmethod
    def hashed(
        cls, hasher: PageHasher, tokens: np.ndarray, state: ChainState, prev: np.ndarray
    ) -> Chunk:
        """Hash the pages that ``prev`` (a partial page) plus ``tokens`` complete after a
        chain at ``state``."""
        seq = np.concatenate([prev, tokens]) if prev.size else tokens
        hashes, chain = hasher.hash_pages(seq, state)
        tail = seq[hashes.shape[0] * hasher.page_size :].copy()
        return cls(int(tokens.shape[0]), hashes, chain, tail)

    @classmethod
    def of(
        cls,
        hasher: PageHasher,
        tokens: np.ndarray | TokenDigest,
        state: ChainState,
        prev: np.ndarray,
    ) -> Chunk:
        """:meth:`hashed` for token ids, :meth:`digested` for a client's digest of them."""
        if isinstance(tokens, TokenDigest):
            return cls.digested(hasher, tokens, state, prev)
        return cls.hashed(hasher, tokens, state, prev)

    @classmethod
    def digested(
        cls, hasher: PageHasher, digest: TokenDigest, state: ChainState, prev: np.ndarray
    ) -> Chunk:
        """:meth:`hashed`, from a client's digest of the tokens (their full pages hashed
        on its side, with this coordinator's key).

        Raises:
            StaleDigestError: the digest was built for another fill of the partial page.
        """
        ps = hasher.page_size
        if digest.page_size != ps or digest.offset != prev.shape[0]:
            raise StaleDigestError(
                f"token digest built for {digest.offset} tokens in the partial page (page "
                f"{digest.page_size}); the request holds {prev.shape[0]} (page {ps})"
            )
        n = digest.num_tokens
        if digest.head.shape[0] == n and prev.shape[0] + n < ps:  # the page stays partial
            return cls(digest.num_tokens, _EMPTY_U64, state, np.concatenate([prev, digest.head]))
        contents = digest.contents
        if digest.head.size:  # the partial page, filled: hashed here from its tokens
            first = hasher.contents(np.concatenate([prev, digest.head]))
            contents = np.concatenate([first, contents])
        hashes, chain = hasher.chain(contents, state)
        return cls(digest.num_tokens, hashes, chain, digest.tail)

    @classmethod
    def unknown(cls, num_tokens: int) -> Chunk:
        """Tokens after an unknown one: no page they complete can be cached."""
        return cls(num_tokens, _EMPTY_U64, None, None)


class Request:
    """One live request: its pages (cached prefix first), tokens and page chain."""

    __slots__ = (
        "_pages",
        "_parts",
        "chain",
        "hashes",
        "node",
        "num_cached_pages",
        "num_tokens",
        "rid",
        "salt",
        "seq",
        "slot",
        "tail",
    )

    def __init__(
        self, rid: Hashable, slot: int, match: PrefixMatch, salt: str | bytes | None
    ) -> None:
        self.rid = rid
        self.slot = slot
        self.node = match.node
        cached_pages = match.pages
        self.num_cached_pages = int(cached_pages.shape[0])
        self._parts: list[np.ndarray] = [cached_pages] if cached_pages.size else []
        self._pages: np.ndarray | None = None
        self.num_tokens = 0
        self.hashes: list[np.ndarray] = []
        # Tokens after the last hashed page and the page chain after it; None once a
        # token is unknown (decode without ids): no later page can be cached then.
        self.tail: np.ndarray | None = _EMPTY_I64
        self.chain: ChainState | None = None
        self.salt = salt
        self.seq = 0

    def add_pages(self, pages: np.ndarray) -> None:
        if pages.size:
            self._parts.append(pages)
            self._pages = None

    @property
    def pages(self) -> np.ndarray:
        """``int32`` global page ids in sequence order, the cached prefix included."""
        if self._pages is None:
            if not self._parts:
                self._pages = _EMPTY_I32
            elif len(self._parts) == 1:
                self._pages = self._parts[0]
            else:
                self._pages = np.concatenate(self._parts)
                self._parts = [self._pages]
        return self._pages

    @property
    def own_pages(self) -> np.ndarray:
        """The pages after the cached prefix (this request's alone)."""
        return self.pages[self.num_cached_pages :]

    @property
    def num_hashed_pages(self) -> int:
        return sum(h.shape[0] for h in self.hashes)

    def last_slot(self, page_size: int) -> int:
        """Slot of the last token held; -1 when none."""
        if self.num_tokens == 0:
            return -1
        return int(self.pages[-1]) * page_size + (self.num_tokens - 1) % page_size

    def head(self, page_size: int, extend_len: int) -> tuple[int, int]:
        """``(head_slot, head_len)``: where the first of ``extend_len`` new tokens go in the
        partial last page, and how many fit there; ``(-1, 0)`` when no page is partial."""
        used = self.num_tokens % page_size
        if used == 0 or self.num_tokens == 0:
            return -1, 0
        return self.last_slot(page_size) + 1, min(page_size - used, extend_len)

    def next_chunk(self, hasher: PageHasher, tokens: np.ndarray | TokenDigest) -> Chunk:
        """The chunk of ``tokens`` (or a client's digest of them) appended to what this
        request holds."""
        if self.tail is None or self.chain is None:
            n = tokens.num_tokens if isinstance(tokens, TokenDigest) else int(tokens.shape[0])
            return Chunk.unknown(n)
        return Chunk.of(hasher, tokens, self.chain, self.tail)

    def advance(self, num_tokens: int, chunk: Chunk | None, skip: int = 0) -> None:
        """Advance by ``num_tokens``; keep the hashes of the pages they complete.

        ``skip`` hashes at the front were already kept (a new request's cached prefix).
        """
        self.num_tokens += num_tokens
        if self.tail is None:
            return
        if chunk is None or chunk.tail is None:
            self.tail = self.chain = None  # an unknown token: no later page can be cached
            return
        if chunk.hashes.shape[0] > skip:
            self.hashes.append(chunk.hashes[skip:])
        self.tail, self.chain = chunk.tail, chunk.chain


class RequestTable:
    """Live requests by id, the free rows of the request table, and the requests lost
    with a lane (until their loss is acknowledged).

    Args:
        max_reqs: rows of the request table.
    """

    __slots__ = ("_free_slots", "_lost", "_reqs", "max_reqs")

    def __init__(self, max_reqs: int) -> None:
        self.max_reqs = max_reqs
        self._reqs: dict[Hashable, Request] = {}
        # Popped from the end: row 0 comes out first.
        self._free_slots = list(range(max_reqs - 1, -1, -1))
        self._lost: dict[Hashable, int] = {}

    # ---------------------------------------------------------------- lookups
    def __len__(self) -> int:
        return len(self._reqs)

    def __contains__(self, rid: Hashable) -> bool:
        return rid in self._reqs

    def __iter__(self) -> Iterator[Request]:
        return iter(self._reqs.values())

    def ids(self) -> list[Hashable]:
        return list(self._reqs)

    def lookup(self, rid: Hashable) -> Request | None:
        """The live request ``rid`` (already checked), or ``None``."""
        return self._reqs.get(rid)

    def get(self, rid: Hashable) -> Request:
        """The live request ``rid``.

        Raises:
            InvalidRequestError: a bad or unknown rid (never allocated, or already freed).
            LaneUnavailableError: ``rid`` was lost with a lane.
        """
        rid = check_rid(rid)
        req = self._reqs.get(rid)
        if req is None:
            self.check_not_lost(rid)
            raise UnknownRequestError(f"unknown rid={rid!r} (never allocated, or already freed)")
        return req

    # ------------------------------------------------------------------- rows
    @property
    def num_free_slots(self) -> int:
        return len(self._free_slots)

    def add(
        self,
        rid: Hashable,
        match: PrefixMatch,
        chunk: Chunk,
        page_size: int,
        salt: str | bytes | None,
    ) -> Request:
        """A new request on a free row, holding its cached prefix ``match`` (the first pages
        of ``chunk``); the caller checked a row is free."""
        assert self._free_slots, "no free request slot"
        req = Request(rid, self._free_slots.pop(), match, salt)
        self._reqs[rid] = req
        req.num_tokens = match.num_pages * page_size
        req.hashes.append(chunk.hashes[: match.num_pages])
        return req

    def remove(self, rid: Hashable) -> Request:
        """Take a live request out; its row is free again."""
        req = self._reqs.pop(rid)
        self._free_slots.append(req.slot)
        return req

    # ------------------------------------------------------------------- loss
    def check_not_lost(self, rid: Hashable) -> None:
        """Raise LaneUnavailableError if ``rid`` was lost with a lane (not yet freed)."""
        lane = self._lost.get(rid)
        if lane is not None:
            raise LaneUnavailableError(lane, [rid], "the request was lost with the lane")

    def lose_lane(self, lane: int, layout: PageLayout) -> list[Request]:
        """Take out every request with a page on ``lane``; they answer LaneUnavailableError
        until :meth:`acknowledge_lost`.

        Returns:
            The requests taken out, in table order (the caller releases their pages).
        """
        lost = [req for req in self._reqs.values() if (layout.lane_of(req.pages) == lane).any()]
        for req in lost:
            self.remove(req.rid)
            self._lost[req.rid] = lane
        return lost

    def acknowledge_lost(self, rid: Hashable) -> bool:
        """Forget that ``rid`` was lost; ``False`` when it was not."""
        return self._lost.pop(rid, None) is not None

    def lost_rids(self, lane: int) -> list[Hashable]:
        return [rid for rid, r in self._lost.items() if r == lane]

    @property
    def num_lost(self) -> int:
        return len(self._lost)

    # ------------------------------------------------------------- invariants
    def check(self, layout: PageLayout) -> None:
        """Raise AssertionError unless every request holds the pages its tokens need and
        every row is either one request's or free."""
        for req in self._reqs.values():
            want = layout.pages_for(req.num_tokens)
            if req.pages.shape[0] != want:
                raise AssertionError(
                    f"rid {req.rid!r} holds {req.pages.shape[0]} pages for {req.num_tokens} tokens"
                )
        slots = {req.slot for req in self._reqs.values()}
        if len(slots) != len(self._reqs) or slots & set(self._free_slots):
            raise AssertionError("request slots are shared or both used and free")
        if len(slots) + len(self._free_slots) != self.max_reqs:
            raise AssertionError("request slots leaked")
