"""CPAllocator: the decision core behind the coordinator (no Ray, no torch).

It owns the per-lane page pools, the prefix cache and the request table, and
decides for every step which pages each lane gives. The coordinator actor only
wraps it, so everything here is tested without Ray. The class is a façade: each
job lives in a module of its own (see :class:`CPAllocator`).
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field

import numpy as np

from cpkv.core.availability import LaneAvailability
from cpkv.core.capacity import LaneCapacity
from cpkv.core.config import CPConfig
from cpkv.core.counters import Counters
from cpkv.core.extend_plan import ExtendPlan, batch_owners, plan_extend
from cpkv.core.layout import PageLayout
from cpkv.core.moves import MoveJournal
from cpkv.core.page_hash import PageHasher, TokenDigest
from cpkv.core.pools import PagePools
from cpkv.core.prefix_cache import PrefixCache
from cpkv.core.requests import Chunk, Request, RequestTable
from cpkv.core.validate import (
    as_token_array,
    check_distinct,
    check_int,
    check_rid,
    check_rids,
    check_salt,
)
from cpkv.errors import InvalidRequestError, KVCapacityWaitError

__all__ = ["CPAllocator", "ExtendAllocation", "slots_from_pages", "split_slots_by_lane"]

_EMPTY_I32 = np.empty(0, dtype=np.int32)
_EMPTY_I32.flags.writeable = False
_EMPTY_U64 = np.empty(0, dtype=np.uint64)
_EMPTY_I64 = np.empty(0, dtype=np.int64)


def slots_from_pages(
    head_slot: int, head_len: int, new_pages: np.ndarray, page_size: int, num_tokens: int
) -> np.ndarray:
    """Slots of ``num_tokens`` new tokens: ``head_len`` slots from ``head_slot`` on
    (the rest of a partial page), then the new pages in order.

    Returns:
        ``int64 [num_tokens]``.
    """
    num_pages = int(new_pages.shape[0])
    out = np.empty(head_len + num_pages * page_size, dtype=np.int64)
    if head_len:
        out[:head_len] = np.arange(head_slot, head_slot + head_len, dtype=np.int64)
    if num_pages:
        # Broadcast straight into the output: no temporaries of the slot array's size.
        body = out[head_len:].reshape(num_pages, page_size)
        np.multiply(new_pages[:, None], page_size, out=body, dtype=np.int64, casting="unsafe")
        body += np.arange(page_size, dtype=np.int64)
    return out[:num_tokens]


def split_slots_by_lane(
    slots: np.ndarray, page_size: int, cp_size: int
) -> list[tuple[np.ndarray, np.ndarray]]:
    """Group global slots by lane.

    Returns:
        per lane, ``(token_index int64 [m], local_slot int64 [m])``: which of the
        given tokens live on that lane, and their slots inside its shard.
    """
    return PageLayout(cp_size, page_size).split_slots(slots)


@dataclass(slots=True)
class ExtendAllocation:
    """Where one request's new tokens go: compact pages, slots on demand.

    Attributes:
        rid: the request.
        seq: this request's step number (lane calls carry ``(rid, seq)``).
        req_slot: the request's row in the request table.
        prefix_len: tokens the request held before this step (cached prefix
            matched now, or earlier chunks).
        cached_len: of those, tokens matched in the prefix cache by this call.
        extend_len: new tokens.
        head_slot, head_len: the first new tokens fill the rest of the partial
            last page from ``head_slot`` on (``head_len`` of them; 0 when none).
        new_pages: ``int32`` global page ids taken, in sequence order.
        page_owners: ``int32`` owner lane per new page, or ``None`` (fallback).
        lane_token_ranges: per lane, ``(start, end)`` ranges of extend tokens it
            computes (owner plan only).
        fallback_reason: why no owner plan was used, ``None`` when it was.
        cached_pages: ``int32`` pages of the ``cached_len`` prefix matched now
            (shared with other requests; already hold their K/V).
    """

    rid: Hashable
    seq: int
    req_slot: int
    prefix_len: int
    cached_len: int
    extend_len: int
    page_size: int
    cp_size: int
    head_slot: int
    head_len: int
    new_pages: np.ndarray
    page_owners: np.ndarray | None
    lane_token_ranges: tuple[tuple[tuple[int, int], ...], ...] | None
    fallback_reason: str | None
    cached_pages: np.ndarray = field(default_factory=lambda: _EMPTY_I32)

    @property
    def cached_slots(self) -> np.ndarray:
        """``int64 [cached_len]`` slots of the cached prefix matched by this call."""
        return slots_from_pages(-1, 0, self.cached_pages, self.page_size, self.cached_len)

    @property
    def out_cache_loc(self) -> np.ndarray:
        """``int64 [extend_len]`` slot of every new token, in sequence order."""
        return slots_from_pages(
            self.head_slot, self.head_len, self.new_pages, self.page_size, self.extend_len
        )

    @property
    def num_new_pages(self) -> int:
        return int(self.new_pages.shape[0])

    def slots_by_lane(self) -> list[tuple[np.ndarray, np.ndarray]]:
        """Per lane ``(extend token index, local slot)``; see :func:`split_slots_by_lane`."""
        return split_slots_by_lane(self.out_cache_loc, self.page_size, self.cp_size)


class CPAllocator:
    """Decision core of a context-parallel paged KV pool.

    A façade over its parts: the lanes' page pools (:mod:`cpkv.core.pools`), the prefix
    cache, the request table (:mod:`cpkv.core.requests`), where a step's pages go
    (:mod:`cpkv.core.extend_plan`), eviction and the capacity wait
    (:mod:`cpkv.core.capacity`), the move journal (:mod:`cpkv.core.moves`) and the counters.

    Args:
        cp_size: lanes (CP ranks).
        page_size: tokens per page.
        num_pages_per_lane: pages per lane shard, reserved page 0 included.
        max_reqs: concurrent requests (rows of the request table).
        max_context_len: most tokens one request may hold.
        enable_prefix_cache: keep freed full pages for reuse.
        record_page_moves: journal every page taken or released per lane, for
            :meth:`drain_page_moves` (the coordinator forwards them to the lanes).
        hash_key: secret of the page hashes (tests pin it); ``None`` draws one at
            random, so nobody outside this process can craft colliding prompts.

    Raises:
        InvalidRequestError (a ValueError): a bad size.
    """

    def __init__(
        self,
        cp_size: int,
        page_size: int,
        num_pages_per_lane: int,
        max_reqs: int = 256,
        max_context_len: int = 1 << 20,
        *,
        enable_prefix_cache: bool = True,
        record_page_moves: bool = False,
        hash_key: bytes | None = None,
    ) -> None:
        self.config = CPConfig(cp_size, page_size, num_pages_per_lane, max_reqs, max_context_len)
        self.cp_size = cp_size
        self.page_size = page_size
        self.layout = PageLayout(cp_size, page_size)
        self.enable_prefix_cache = enable_prefix_cache
        self._journal = MoveJournal(self.layout) if record_page_moves else None
        self._pools = PagePools(self.layout, num_pages_per_lane, self._journal)
        self._cache = PrefixCache(cp_size, page_size)
        self._hasher = PageHasher(page_size, hash_key)
        # Lanes restarting take no pages; the coordinator's lane supervisor writes this object.
        self.availability = LaneAvailability(cp_size)
        self._requests = RequestTable(max_reqs)
        self._counters = Counters()
        self._capacity = LaneCapacity(self._pools, self._cache, self.availability, self._counters)

    @classmethod
    def from_config(cls, config: CPConfig, **kwargs) -> CPAllocator:
        alloc = cls(
            config.cp_size,
            config.page_size,
            config.num_pages_per_lane,
            config.max_reqs,
            config.max_context_len,
            **kwargs,
        )
        alloc.config = config
        return alloc

    @property
    def max_evict_attempts(self) -> int:
        """Evictions tried before a step waits."""
        return self._capacity.max_evict_attempts

    # ---------------------------------------------------------------- queries
    def num_free_pages_per_lane(self) -> np.ndarray:
        """``int64 [cp_size]`` free pages on each lane."""
        return self._pools.num_free_pages_per_lane()

    def num_available_pages_per_lane(self) -> np.ndarray:
        """``int64 [cp_size]`` free pages each lane can give now (0 on a lane that is down)."""
        return self._capacity.available_pages_per_lane()

    def set_lane_available(self, lane: int, available: bool) -> None:
        """Take ``lane`` out of (or back into) allocation while it restarts.

        A lane that is down gives no pages: plans that need it wait with
        ``KVCapacityWaitError(reason="lane_unavailable")``, the rotation leaves it out.
        """
        self.availability.set_available(self._check_lane(lane), available)

    @property
    def down_lanes(self) -> list[int]:
        return self.availability.down_lanes

    @property
    def num_requests(self) -> int:
        return len(self._requests)

    def has_request(self, rid: Hashable) -> bool:
        return rid in self._requests

    def check_not_lost(self, rid: Hashable) -> None:
        """Raise LaneUnavailableError when ``rid`` was lost with a lane (until freed)."""
        self._requests.check_not_lost(rid)

    def request_pages(self, rid: Hashable) -> np.ndarray:
        """``int32`` global page ids of ``rid`` in sequence order (cached prefix included;
        a read-only view)."""
        return _readonly(self._requests.get(rid).pages)

    def request_len(self, rid: Hashable) -> int:
        return self._requests.get(rid).num_tokens

    def request_slot(self, rid: Hashable) -> int:
        return self._requests.get(rid).slot

    def request_seq(self, rid: Hashable) -> int:
        return self._requests.get(rid).seq

    def lost_rids(self, lane: int) -> list[Hashable]:
        """Requests lost with ``lane`` whose loss is not yet acknowledged by ``free``."""
        return self._requests.lost_rids(lane)

    def request_ids(self) -> list[Hashable]:
        return self._requests.ids()

    def lane_stats(
        self, page_owners: Sequence[int] | np.ndarray
    ) -> tuple[list[int], list[int], list[int]]:
        """``(required, available, deficit)`` per lane for pages owned as given."""
        raw = np.asarray(page_owners)
        if raw.size and (raw.dtype == np.bool_ or not np.issubdtype(raw.dtype, np.integer)):
            raise InvalidRequestError(f"page_owners must hold lane numbers, got dtype {raw.dtype}")
        owners = raw.astype(np.int64, copy=False).reshape(-1)
        if owners.size and (owners.min() < 0 or owners.max() >= self.cp_size):
            raise InvalidRequestError(
                f"page_owners must lie in [0, {self.cp_size}), got [{owners.min()}, {owners.max()}]"
            )
        required = self.layout.count_lanes(owners)
        available = self.num_available_pages_per_lane()
        deficit = np.maximum(0, required - available)
        return required.tolist(), available.tolist(), deficit.tolist()

    def match_prefix(self, token_ids, cache_salt: str | bytes | None = None) -> np.ndarray:
        """``int32`` pages of the cached page-aligned prefix of ``token_ids`` (not locked)."""
        tokens = as_token_array(token_ids)
        check_salt(cache_salt)
        hashes, _ = self._hasher.hash_pages(tokens, self._hasher.start(cache_salt))
        return self._cache.match_prefix(hashes).pages

    # ------------------------------------------------------------- allocation
    def allocate_extend(
        self, rid: Hashable, token_ids, *, cache_salt: str | bytes | None = None
    ) -> ExtendAllocation:
        """Allocate slots for one request's new tokens (a prefill step): a batch of one.

        A new ``rid`` first reuses the cached prefix of ``token_ids`` (all but at
        least its last token); an existing ``rid`` appends ``token_ids`` after
        what it holds (chunked prefill).

        Args:
            rid: request id, a ``str`` or an ``int``.
            token_ids: the new tokens, 1-D ints (a contiguous int64 array is not copied).
            cache_salt: requests share cached pages only when their salts are equal
                (per tenant, say); fixed when the request is created.

        Returns:
            An :class:`ExtendAllocation`.

        Raises:
            InvalidRequestError: a bad rid, empty/non-integer/negative tokens, too long,
                a salt other than the request's.
            KVCapacityWaitError: the pages (or a request slot) are not there even
                after eviction; nothing stays allocated.
            LaneUnavailableError: ``rid`` was lost with a lane.
        """
        rid = check_rid(rid)
        check_salt(cache_salt)
        self._requests.check_not_lost(rid)
        return self._extend_batch([rid], [_new_tokens(token_ids, "token_ids")], cache_salt)[0]

    def allocate_extend_batch(
        self,
        items: Sequence[tuple[Hashable, object]],
        *,
        cache_salt: str | bytes | None = None,
    ) -> list[ExtendAllocation]:
        """Allocate one prefill step of several requests.

        Every request that qualifies gets its own zigzag owner plan (each sequence of
        the batch is split over the lanes); the others draw their pages in rotation.
        All-or-nothing: either every request gets its pages or none does.

        Args:
            items: ``(rid, token_ids)`` pairs, distinct rids.
            cache_salt: the salt of the batch's new requests (see :meth:`allocate_extend`).

        Returns:
            One :class:`ExtendAllocation` per item, in order.

        Raises:
            As :meth:`allocate_extend`; also InvalidRequestError for an empty
            batch or a repeated rid.
        """
        if isinstance(items, (str, bytes)) or not isinstance(items, (list, tuple)):
            raise InvalidRequestError(
                f"allocate_extend_batch takes a list of (rid, token_ids) pairs, "
                f"got {type(items).__name__}"
            )
        items = list(items)
        if not items:
            raise InvalidRequestError("allocate_extend_batch got an empty batch")
        for i, item in enumerate(items):
            if not isinstance(item, (list, tuple)) or len(item) != 2:
                raise InvalidRequestError(
                    f"allocate_extend_batch: item {i} = {item!r:.60} is not (rid, token_ids)"
                )
        check_salt(cache_salt)
        if len(items) == 1:  # its errors read as allocate_extend's
            return [self.allocate_extend(*items[0], cache_salt=cache_salt)]
        rids = [check_rid(rid) for rid, _ in items]
        check_distinct(rids, "allocate_extend_batch")
        tokens = [
            _new_tokens(t, f"token_ids[{rid!r}]") for rid, (_, t) in zip(rids, items, strict=True)
        ]
        for rid in rids:  # lengths are checked where each step is planned
            self._requests.check_not_lost(rid)
        return self._extend_batch(rids, tokens, cache_salt)

    def allocate_decode(
        self, rids: Sequence[Hashable], token_ids: Sequence[int] | None = None
    ) -> np.ndarray:
        """Append one token to each request; a page is taken only when its last is full.

        Args:
            rids: distinct live requests.
            token_ids: the appended tokens, one per rid; without them the new
                pages cannot enter the prefix cache.

        Returns:
            ``int64 [len(rids)]`` the slot of each appended token.

        Raises:
            InvalidRequestError: unknown/repeated rid, bad token ids, too long.
            KVCapacityWaitError: not enough pages even after eviction.
            LaneUnavailableError: a rid was lost with a lane.
        """
        rids = check_rids(rids)
        if not rids:
            raise InvalidRequestError("allocate_decode got no rids")
        check_distinct(rids, "allocate_decode")
        if token_ids is not None:
            toks = as_token_array(token_ids)
            if toks.shape[0] != len(rids):
                raise InvalidRequestError(
                    f"allocate_decode got {toks.shape[0]} token ids for {len(rids)} rids"
                )
        for rid in rids:
            self._requests.check_not_lost(rid)
        reqs = [self._requests.get(rid) for rid in rids]
        for req in reqs:
            self._check_len(req.rid, req.num_tokens, 1)
        # NOTE: every request's chunk before any request changes: all of them or none.
        chunks = [
            req.next_chunk(self._hasher, toks[i : i + 1])
            if token_ids is not None and req.tail is not None
            else None
            for i, req in enumerate(reqs)
        ]
        needs = [req for req in reqs if req.num_tokens % self.page_size == 0]
        pages = self._capacity.take_pages(
            lambda: self._capacity.rotation_owners(len(needs)), reason="lane_exhausted"
        )
        for req, page in zip(needs, pages, strict=True):
            req.add_pages(page[None])
        slots = np.empty(len(reqs), dtype=np.int64)
        for i, (req, chunk) in enumerate(zip(reqs, chunks, strict=True)):
            req.advance(1, chunk)
            slots[i] = req.last_slot(self.page_size)
            req.seq += 1
        self._counters.decode_allocations += 1
        return slots

    # ------------------------------------------------------------------- free
    def free(self, rid: Hashable, cache: bool = True, committed_len: int | None = None) -> int:
        """Release a request's pages; full pages go into the prefix cache.

        Args:
            rid: a live request (or one lost with a lane: then this only
                acknowledges the loss).
            cache: keep its full pages in the prefix cache (evictable from now on).
            committed_len: tokens that are really part of the sequence (speculative
                decoding over-allocates); pages past it are freed, never cached.

        Returns:
            Pages returned to the free pools.

        Raises:
            InvalidRequestError: unknown rid (or freed twice), bad committed_len.
        """
        rid = check_rid(rid)
        if not isinstance(cache, (bool, np.bool_)):  # before the request is gone
            raise InvalidRequestError(f"cache={cache!r} must be a bool")
        cache = bool(cache)
        if committed_len is not None:  # checked for a lost request too: misuse is misuse
            check_int("committed_len", committed_len, minimum=0)
        if self._requests.acknowledge_lost(rid):
            return 0
        req = self._requests.get(rid)
        if committed_len is not None and committed_len > req.num_tokens:
            raise InvalidRequestError(
                f"committed_len={committed_len} > tokens held {req.num_tokens} for rid={rid!r}"
            )
        self._requests.remove(rid)
        pages = req.pages
        keep = req.num_cached_pages
        num_dups = 0
        if cache and self.enable_prefix_cache:
            n_commit = req.num_tokens if committed_len is None else committed_len
            n_full = min(req.num_hashed_pages, self.layout.full_pages(n_commit))
            if n_full:
                hashes = np.concatenate(req.hashes)[:n_full] if req.hashes else _EMPTY_U64
                dups = self._cache.insert(hashes, pages[:n_full])
                if self._journal is not None and n_full > req.num_cached_pages:
                    mine = pages[req.num_cached_pages : n_full]
                    self._journal.record_cached(mine[~np.isin(mine, dups)])
                keep = max(keep, n_full)
                self._pools.release(dups)
                num_dups = int(dups.shape[0])
        released = pages[keep:]
        self._pools.release(released)
        self._cache.unlock(req.node)
        return int(released.shape[0]) + num_dups

    # -------------------------------------------------------------- lane loss
    def drop_lane(self, lane: int) -> list[Hashable]:
        """A lane died: fail its requests, free their other pages, empty the lane.

        Returns:
            The rids lost (they answer LaneUnavailableError until freed).
        """
        lane = self._check_lane(lane)
        lost = self._requests.lose_lane(lane, self.layout)
        for req in lost:
            own = req.own_pages
            self._pools.release(own[self.layout.lane_of(own) != lane])
            self._cache.unlock(req.node)
        self._pools.release(self._cache.drop_lane(lane))
        self._pools.reset_lane(lane)
        self._counters.requests_lost += len(lost)
        return [req.rid for req in lost]

    def drain_page_moves(self) -> list[tuple[np.ndarray, np.ndarray]]:
        """Per lane ``(taken, released)`` local pages since the last drain (int32).

        Only with ``record_page_moves=True``. Drain after every operation: within
        one operation releases (eviction, free) always precede takes, so a lane
        applies ``released`` first, then ``taken``.
        """
        assert self._journal is not None, "construct with record_page_moves=True"
        return self._journal.drain()

    def drain_cached_pages(self) -> list[np.ndarray]:
        """Per lane, ``int32`` local pages that went from a request into the prefix cache since
        the last drain (they stay held; the lanes stop letting anyone write them).

        Only with ``record_page_moves=True`` (empty otherwise); drain with
        :meth:`drain_page_moves`.
        """
        if self._journal is None:
            return [_EMPTY_I32] * self.cp_size
        return self._journal.drain_cached()

    # ------------------------------------------------------------------ stats
    def stats(self) -> dict:
        """Per-lane page counts and counters (plain ints and lists)."""
        free = self.num_free_pages_per_lane()
        cached = self._cache.num_cached_pages_per_lane
        total = self.config.num_pages_per_lane
        usable = self.layout.usable_pages(total)
        return {
            "cp_size": self.cp_size,
            "page_size": self.page_size,
            "num_pages_per_lane": total,
            "free": free.tolist(),
            "used": (usable - free - cached).tolist(),
            "cached": cached.tolist(),
            "evictable": self._cache.num_evictable_pages_per_lane.tolist(),
            "reserved": [total - usable] * self.cp_size,
            "num_requests": len(self._requests),
            "down_lanes": self.availability.down_lanes,
            "num_lost_requests": self._requests.num_lost,
            **self._counters.as_dict(),
        }

    def metadata_nbytes(self) -> int:
        """Bytes of per-page bookkeeping: free stacks, request pages and hashes, tree."""
        total = self._pools.nbytes + self._cache.nbytes
        for req in self._requests:
            total += req.own_pages.nbytes + sum(h.nbytes for h in req.hashes)
        return total

    def check_invariants(self) -> None:
        """Raise AssertionError unless every page is in exactly one place.

        Places: free, used by one request, cached, reserved. Also checks the
        prefix cache's own counts and locks, and the request table's rows.
        """
        held = [req.own_pages for req in self._requests]
        held.append(self._cache.all_pages())
        self._pools.check_places(np.concatenate(held))
        self._cache.check()
        self._requests.check(self.layout)

    # ---------------------------------------------------------------- private
    def _check_lane(self, lane: int) -> int:
        check_int("lane", lane, minimum=0)
        if lane >= self.cp_size:
            raise InvalidRequestError(f"lane={lane} >= cp_size={self.cp_size}")
        return lane

    def _check_len(self, rid: Hashable, held: int, adding: int) -> None:
        if held + adding > self.config.max_context_len:
            raise InvalidRequestError(
                f"rid={rid!r} would hold {held} + {adding} = {held + adding} tokens "
                f"> max_context_len={self.config.max_context_len}"
            )

    def _extend_batch(
        self, rids: list[Hashable], tokens: list[np.ndarray], cache_salt: str | bytes | None
    ) -> list[ExtendAllocation]:
        """The one prefill pipeline (checked rids, int64 tokens): hash, match and plan every
        item, then take every page at once or none."""
        reqs = [self._requests.lookup(rid) for rid in rids]
        chunks = [
            self._chunk(rid, req, tok, cache_salt)
            for rid, req, tok in zip(rids, reqs, tokens, strict=True)
        ]
        # Every item's length before any match: a match refreshes (and may split) the cache.
        for rid, req, chunk in zip(rids, reqs, chunks, strict=True):
            self._check_len(rid, 0 if req is None else req.num_tokens, chunk.num_tokens)
        # Match (and lock) every new request's prefix before deciding anything.
        plans = [self._plan(req, chunk) for req, chunk in zip(reqs, chunks, strict=True)]
        locked = [p.match.node for p in plans if p.match is not None]
        for node in locked:
            self._cache.lock(node)
        num_new_reqs = sum(1 for p in plans if p.match is not None)
        any_plan = any(p.plan is not None for p in plans)
        try:
            free_slots = self._requests.num_free_slots
            if num_new_reqs > free_slots:
                self._capacity.raise_wait(
                    np.zeros(self.cp_size, np.int64),
                    "request_slots_exhausted",
                    f"all {self.config.max_reqs} request slots are in use"
                    if free_slots == 0
                    else f"{num_new_reqs} new requests but {free_slots} request slots free",
                )
            pages = self._capacity.take_pages(
                lambda: batch_owners(plans, self.cp_size, self._capacity.rotation_owners),
                reason="owner_lane_exhausted" if any_plan else "lane_exhausted",
            )
        except KVCapacityWaitError:
            for node in locked:
                self._cache.unlock(node)
            raise
        out, start = [], 0
        for rid, req, chunk, plan in zip(rids, reqs, chunks, plans, strict=True):
            new_pages = pages[start : start + plan.num_new_pages]
            start += plan.num_new_pages
            if req is None:
                req = self._requests.add(rid, plan.match, chunk, self.page_size, cache_salt)
                self._counters.cached_tokens_hit += req.num_tokens
            if plan.reason:
                self._counters.count_fallback(plan.reason, plan.extend_len)
            out.append(self._extend(req, plan, new_pages, chunk))
        return out

    def _chunk(
        self,
        rid: Hashable,
        req: Request | None,
        tokens: np.ndarray | TokenDigest,
        cache_salt: str | bytes | None,
    ) -> Chunk:
        """Hash the pages that ``req``'s partial page plus ``tokens`` complete."""
        if req is None:
            return Chunk.of(self._hasher, tokens, self._hasher.start(cache_salt), _EMPTY_I64)
        if cache_salt is not None and cache_salt != req.salt:
            raise InvalidRequestError(
                f"rid={rid!r} was created with cache_salt={req.salt!r}, got {cache_salt!r}"
            )
        return req.next_chunk(self._hasher, tokens)

    def _plan(self, req: Request | None, chunk: Chunk) -> ExtendPlan:
        """Decide where one request's step goes: cached prefix, owner plan or rotation."""
        num_tokens = chunk.num_tokens
        prefix_len = 0 if req is None else req.num_tokens
        if req is not None:
            return plan_extend(self.layout, self.config.owner_split, None, prefix_len, num_tokens)
        # Leave at least one token to compute (a prefill must produce logits).
        limit = self.layout.full_pages(num_tokens - 1) if self.enable_prefix_cache else 0
        match = self._cache.match_prefix(chunk.hashes[:limit])
        prefix_len = match.num_pages * self.page_size
        return plan_extend(
            self.layout, self.config.owner_split, match, prefix_len, num_tokens - prefix_len
        )

    def _extend(
        self, req: Request, plan: ExtendPlan, new_pages: np.ndarray, chunk: Chunk
    ) -> ExtendAllocation:
        """Give ``req`` its new pages and tokens; describe the step to the caller."""
        head_slot, head_len = req.head(self.page_size, plan.extend_len)
        req.add_pages(new_pages)
        match, owner_plan = plan.match, plan.plan
        req.advance(plan.extend_len, chunk, skip=match.num_pages if match else 0)
        req.seq += 1
        self._counters.extend_allocations += 1
        return ExtendAllocation(
            rid=req.rid,
            seq=req.seq,
            req_slot=req.slot,
            prefix_len=plan.prefix_len,
            cached_len=plan.prefix_len if match is not None else 0,
            extend_len=plan.extend_len,
            page_size=self.page_size,
            cp_size=self.cp_size,
            head_slot=head_slot,
            head_len=head_len,
            new_pages=_readonly(new_pages),
            page_owners=None if owner_plan is None else _readonly(owner_plan.page_owners),
            lane_token_ranges=None if owner_plan is None else owner_plan.lane_token_ranges,
            fallback_reason=plan.reason,
            cached_pages=_readonly(match.pages) if match is not None else _EMPTY_I32,
        )


def _new_tokens(token_ids: object, name: str) -> np.ndarray | TokenDigest:
    """A step's new tokens: int64 ids, or a client's digest of them (already checked)."""
    if isinstance(token_ids, TokenDigest):
        return token_ids
    return as_token_array(token_ids, name=name)


def _readonly(a: np.ndarray) -> np.ndarray:
    """A read-only view: answers share memory with the core, callers must not write it."""
    v = a.view()
    v.flags.writeable = False
    return v
