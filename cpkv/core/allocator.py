"""CPAllocator: the decision core behind the coordinator (no Ray, no torch).

It owns the per-lane page pools, the prefix cache and the request table, and
decides for every step which pages each lane gives. The coordinator actor only
wraps it, so everything here is tested without Ray.
"""

from __future__ import annotations

import logging
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field

import numpy as np

from cpkv.core.availability import LaneAvailability
from cpkv.core.config import CPConfig
from cpkv.core.layout import RESERVED_LOCAL_PAGE, PageLayout
from cpkv.core.owners import (
    OwnerPlan,
    build_owner_plan,
    in_seq_page_compute_owner_unavailable_reason,
)
from cpkv.core.page_hash import ChainState, PageHasher
from cpkv.core.pools import LanePagePool
from cpkv.core.prefix_cache import PrefixCache, PrefixMatch
from cpkv.core.validate import as_token_array, check_int, check_rid, check_rids, check_salt
from cpkv.errors import InvalidRequestError, KVCapacityWaitError, LaneUnavailableError

__all__ = ["CPAllocator", "ExtendAllocation", "slots_from_pages", "split_slots_by_lane"]

logger = logging.getLogger("cpkv.core.allocator")

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


class _Request:
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

    def __init__(self, rid, slot, node, cached_pages: np.ndarray, salt) -> None:
        self.rid = rid
        self.slot = slot
        self.node = node
        self.num_cached_pages = int(cached_pages.shape[0])
        self._parts: list[np.ndarray] = [cached_pages] if cached_pages.size else []
        self._pages: np.ndarray | None = None
        self.num_tokens = 0
        self.hashes: list[np.ndarray] = []
        # Tokens after the last hashed page and the page chain after it; None once a
        # token is unknown (decode without ids): no later page can be cached then.
        self.tail: np.ndarray | None = np.empty(0, dtype=np.int64)
        self.chain: ChainState | None = None
        self.salt = salt
        self.seq = 0

    def add_pages(self, pages: np.ndarray) -> None:
        if pages.size:
            self._parts.append(pages)
            self._pages = None

    @property
    def pages(self) -> np.ndarray:
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
        return self.pages[self.num_cached_pages :]

    @property
    def num_hashed_pages(self) -> int:
        return sum(h.shape[0] for h in self.hashes)

    def last_slot(self, page_size: int) -> int:
        if self.num_tokens == 0:
            return -1
        return int(self.pages[-1]) * page_size + (self.num_tokens - 1) % page_size


@dataclass(slots=True, frozen=True)
class _Chunk:
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


@dataclass(slots=True, frozen=True)
class _Step:
    """One request's share of a step: its cached prefix, lengths and owners."""

    match: PrefixMatch | None
    prefix_len: int
    extend_len: int
    num_new_pages: int
    plan: OwnerPlan | None
    reason: str | None

    def owners(self, rotation) -> np.ndarray:
        return self.plan.page_owners if self.plan is not None else rotation(self.num_new_pages)


@dataclass(slots=True)
class _Counters:
    extend_allocations: int = 0
    decode_allocations: int = 0
    pages_allocated: int = 0
    pages_evicted: int = 0
    evict_calls: int = 0
    evict_tokens_requested: int = 0
    capacity_waits: int = 0
    cached_tokens_hit: int = 0
    requests_lost: int = 0
    fallbacks_by_reason: dict[str, int] = field(default_factory=dict)


class CPAllocator:
    """Decision core of a context-parallel paged KV pool.

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
        self.enable_prefix_cache = enable_prefix_cache
        self._pools = [LanePagePool(r, num_pages_per_lane) for r in range(cp_size)]
        self._cache = PrefixCache(cp_size, page_size)
        self._hasher = PageHasher(page_size, hash_key)
        # Lanes restarting take no pages; the coordinator's lane supervisor writes this object.
        self.availability = LaneAvailability(cp_size)
        self._reqs: dict[Hashable, _Request] = {}
        self._free_slots = list(range(max_reqs - 1, -1, -1))
        self._lost: dict[Hashable, int] = {}
        self._counters = _Counters()
        self._logged_reasons: set[str] = set()
        self.max_evict_attempts = max(2, min(8, cp_size))
        self._moves: list[tuple[list[np.ndarray], list[np.ndarray]]] | None = (
            [([], []) for _ in range(cp_size)] if record_page_moves else None
        )
        # Per lane, local pages that left a request for the prefix cache (still held).
        self._cached_moves: list[list[np.ndarray]] = [[] for _ in range(cp_size)]

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

    # ---------------------------------------------------------------- queries
    def num_free_pages_per_lane(self) -> np.ndarray:
        """``int64 [cp_size]`` free pages on each lane."""
        return np.array([p.num_free_pages for p in self._pools], dtype=np.int64)

    def num_available_pages_per_lane(self) -> np.ndarray:
        """``int64 [cp_size]`` free pages each lane can give now (0 on a lane that is down)."""
        free = self.num_free_pages_per_lane()
        if self.availability:
            free[self.availability.down_lanes] = 0
        return free

    def set_lane_available(self, lane: int, available: bool) -> None:
        """Take ``lane`` out of (or back into) allocation while it restarts.

        A lane that is down gives no pages: plans that need it wait with
        ``KVCapacityWaitError(reason="lane_unavailable")``, the rotation leaves it out.
        """
        check_int("lane", lane, minimum=0)
        if lane >= self.cp_size:
            raise InvalidRequestError(f"lane={lane} >= cp_size={self.cp_size}")
        self.availability.set_available(lane, available)

    @property
    def down_lanes(self) -> list[int]:
        return self.availability.down_lanes

    @property
    def num_requests(self) -> int:
        return len(self._reqs)

    def has_request(self, rid: Hashable) -> bool:
        return rid in self._reqs

    def request_pages(self, rid: Hashable) -> np.ndarray:
        """``int32`` global page ids of ``rid`` in sequence order (cached prefix included;
        a read-only view)."""
        return _readonly(self._get(rid).pages)

    def request_len(self, rid: Hashable) -> int:
        return self._get(rid).num_tokens

    def request_slot(self, rid: Hashable) -> int:
        return self._get(rid).slot

    def request_seq(self, rid: Hashable) -> int:
        return self._get(rid).seq

    def lost_rids(self, lane: int) -> list[Hashable]:
        """Requests lost with ``lane`` whose loss is not yet acknowledged by ``free``."""
        return [rid for rid, r in self._lost.items() if r == lane]

    def request_ids(self) -> list[Hashable]:
        return list(self._reqs)

    def lane_stats(
        self, page_owners: Sequence[int] | np.ndarray
    ) -> tuple[list[int], list[int], list[int]]:
        """``(required, available, deficit)`` per lane for pages owned as given."""
        owners = np.asarray(page_owners, dtype=np.int64)
        if owners.size and (owners.min() < 0 or owners.max() >= self.cp_size):
            raise InvalidRequestError(
                f"page_owners must lie in [0, {self.cp_size}), got [{owners.min()}, {owners.max()}]"
            )
        required = np.bincount(owners, minlength=self.cp_size)
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
        """Allocate slots for one request's new tokens (a prefill step).

        A new ``rid`` first reuses the cached prefix of ``token_ids`` (all but at
        least its last token); an existing ``rid`` appends ``token_ids`` after
        what it holds (chunked prefill).

        Args:
            rid: request id, a ``str`` or an ``int``.
            token_ids: the new tokens, 1-D ints (a numpy int64 array is not copied).
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
        self._check_not_lost(rid)
        req = self._reqs.get(rid)
        chunk = self._chunk(rid, req, as_token_array(token_ids), cache_salt)
        step = self._plan_step(rid, req, chunk)
        match = step.match
        if match is not None:
            self._cache.lock(match.node)
        try:
            slot = self._take_slot() if req is None else req.slot
            try:
                owners = self._secure(
                    lambda: step.owners(self._rotation_owners),
                    reason="owner_lane_exhausted" if step.plan is not None else "lane_exhausted",
                )
            except KVCapacityWaitError:
                if req is None:
                    self._free_slots.append(slot)
                raise
        except KVCapacityWaitError:
            if match is not None:
                self._cache.unlock(match.node)
            raise
        new_pages = self._take_pages(owners)
        if req is None:
            req = self._new_request(rid, slot, match, chunk, cache_salt)
        if step.reason:
            self._count_fallback(step.reason, step.extend_len)
        return self._extend(req, step, new_pages, chunk)

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
        if len(items) == 1:
            return [self.allocate_extend(*items[0], cache_salt=cache_salt)]
        rids = [check_rid(rid) for rid, _ in items]
        if len(set(rids)) != len(rids):
            raise InvalidRequestError(f"allocate_extend_batch got repeated rids: {rids}")
        tokens = [
            as_token_array(t, name=f"token_ids[{rid!r}]")
            for rid, (_, t) in zip(rids, items, strict=True)
        ]
        for rid in rids:  # lengths are checked where each step is planned
            self._check_not_lost(rid)
        # Match (and lock) every new request's prefix before deciding anything.
        chunks = [
            self._chunk(rid, self._reqs.get(rid), tok, cache_salt)
            for rid, tok in zip(rids, tokens, strict=True)
        ]
        steps = [
            self._plan_step(rid, self._reqs.get(rid), chunk)
            for rid, chunk in zip(rids, chunks, strict=True)
        ]
        locked = [st.match.node for st in steps if st.match is not None]
        for node in locked:
            self._cache.lock(node)
        num_new_reqs = sum(1 for st in steps if st.match is not None)
        any_plan = any(st.plan is not None for st in steps)
        try:
            if num_new_reqs > len(self._free_slots):
                self._raise_wait(
                    np.zeros(self.cp_size, np.int64),
                    "request_slots_exhausted",
                    f"{num_new_reqs} new requests but {len(self._free_slots)} request slots free",
                )
            owners = self._secure(
                lambda: self._batch_owners(steps),
                reason="owner_lane_exhausted" if any_plan else "lane_exhausted",
            )
        except KVCapacityWaitError:
            for node in locked:
                self._cache.unlock(node)
            raise
        pages = self._take_pages(owners)
        out, start = [], 0
        for rid, chunk, st in zip(rids, chunks, steps, strict=True):
            new_pages = pages[start : start + st.num_new_pages]
            start += st.num_new_pages
            req = self._reqs.get(rid)
            if req is None:
                req = self._new_request(rid, self._take_slot(), st.match, chunk, cache_salt)
            if st.reason:
                self._count_fallback(st.reason, st.extend_len)
            out.append(self._extend(req, st, new_pages, chunk))
        return out

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
        if len(set(rids)) != len(rids):
            raise InvalidRequestError(f"allocate_decode got repeated rids: {rids}")
        if token_ids is not None:
            toks = as_token_array(token_ids)
            if toks.shape[0] != len(rids):
                raise InvalidRequestError(
                    f"allocate_decode got {toks.shape[0]} token ids for {len(rids)} rids"
                )
        for rid in rids:
            self._check_not_lost(rid)
        reqs = [self._get(rid) for rid in rids]
        for req in reqs:
            self._check_len(req.rid, req.num_tokens, 1)
        needs = [req for req in reqs if req.num_tokens % self.page_size == 0]
        owners = self._secure(lambda: self._rotation_owners(len(needs)), reason="lane_exhausted")
        pages = self._take_pages(owners)
        for req, page in zip(needs, pages, strict=True):
            req.add_pages(page[None])
        slots = np.empty(len(reqs), dtype=np.int64)
        for i, req in enumerate(reqs):
            known = token_ids is not None and req.tail is not None
            self._advance(
                req, 1, self._chunk(req.rid, req, toks[i : i + 1], None) if known else None
            )
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
        if rid in self._lost:
            del self._lost[rid]
            return 0
        req = self._get(rid)
        if committed_len is not None:
            check_int("committed_len", committed_len, minimum=0)
            if committed_len > req.num_tokens:
                raise InvalidRequestError(
                    f"committed_len={committed_len} > tokens held {req.num_tokens} for rid={rid!r}"
                )
        del self._reqs[rid]
        pages = req.pages
        keep = req.num_cached_pages
        num_dups = 0
        if cache and self.enable_prefix_cache:
            n_commit = req.num_tokens if committed_len is None else committed_len
            n_full = min(req.num_hashed_pages, n_commit // self.page_size)
            if n_full:
                hashes = np.concatenate(req.hashes)[:n_full] if req.hashes else _EMPTY_U64
                dups = self._cache.insert(hashes, pages[:n_full])
                if self._moves is not None and n_full > req.num_cached_pages:
                    mine = pages[req.num_cached_pages : n_full]
                    self._journal_cached(mine[~np.isin(mine, dups)])
                keep = max(keep, n_full)
                self._release(dups)
                num_dups = int(dups.shape[0])
        released = pages[keep:]
        self._release(released)
        self._cache.unlock(req.node)
        self._free_slots.append(req.slot)
        return int(released.shape[0]) + num_dups

    # -------------------------------------------------------------- lane loss
    def drop_lane(self, lane: int) -> list[Hashable]:
        """A lane died: fail its requests, free their other pages, empty the lane.

        Returns:
            The rids lost (they answer LaneUnavailableError until freed).
        """
        check_int("lane", lane, minimum=0)
        if lane >= self.cp_size:
            raise InvalidRequestError(f"lane={lane} >= cp_size={self.cp_size}")
        lost = [rid for rid, req in self._reqs.items() if (req.pages % self.cp_size == lane).any()]
        for rid in lost:
            req = self._reqs.pop(rid)
            own = req.own_pages
            self._release(own[own % self.cp_size != lane])
            self._cache.unlock(req.node)
            self._free_slots.append(req.slot)
            self._lost[rid] = lane
        self._release(self._cache.drop_lane(lane))
        self._pools[lane].reset()
        if self._moves is not None:
            self._moves[lane] = ([], [])  # the lane is reset whole, not page by page
            self._cached_moves[lane] = []
        self._counters.requests_lost += len(lost)
        return lost

    def drain_page_moves(self) -> list[tuple[np.ndarray, np.ndarray]]:
        """Per lane ``(taken, released)`` local pages since the last drain (int32).

        Only with ``record_page_moves=True``. Drain after every operation: within
        one operation releases (eviction, free) always precede takes, so a lane
        applies ``released`` first, then ``taken``.
        """
        assert self._moves is not None, "construct with record_page_moves=True"
        out = []
        for r in range(self.cp_size):
            taken, released = self._moves[r]
            out.append(
                (
                    np.concatenate(taken) if taken else _EMPTY_I32,
                    np.concatenate(released) if released else _EMPTY_I32,
                )
            )
            self._moves[r] = ([], [])
        return out

    def drain_cached_pages(self) -> list[np.ndarray]:
        """Per lane, ``int32`` local pages that went from a request into the prefix cache since
        the last drain (they stay held; the lanes stop letting anyone write them).

        Only with ``record_page_moves=True``; drain with :meth:`drain_page_moves`.
        """
        out = [np.concatenate(c) if c else _EMPTY_I32 for c in self._cached_moves]
        self._cached_moves = [[] for _ in range(self.cp_size)]
        return out

    def _journal_cached(self, pages: np.ndarray) -> None:
        lanes = pages % self.cp_size
        for r in np.unique(lanes):
            self._cached_moves[int(r)].append((pages[lanes == r] // self.cp_size).astype(np.int32))

    # ------------------------------------------------------------------ stats
    def stats(self) -> dict:
        """Per-lane page counts and counters (plain ints and lists)."""
        free = self.num_free_pages_per_lane()
        cached = self._cache.num_cached_pages_per_lane
        total = self.config.num_pages_per_lane
        used = total - 1 - free - cached
        c = self._counters
        return {
            "cp_size": self.cp_size,
            "page_size": self.page_size,
            "num_pages_per_lane": total,
            "free": free.tolist(),
            "used": used.tolist(),
            "cached": cached.tolist(),
            "evictable": self._cache.num_evictable_pages_per_lane.tolist(),
            "reserved": [1] * self.cp_size,
            "num_requests": len(self._reqs),
            "down_lanes": self.availability.down_lanes,
            "num_lost_requests": len(self._lost),
            "extend_allocations": c.extend_allocations,
            "decode_allocations": c.decode_allocations,
            "pages_allocated": c.pages_allocated,
            "pages_evicted": c.pages_evicted,
            "evict_calls": c.evict_calls,
            "evict_tokens_requested": c.evict_tokens_requested,
            "capacity_waits": c.capacity_waits,
            "cached_tokens_hit": c.cached_tokens_hit,
            "requests_lost": c.requests_lost,
            "fallbacks_by_reason": dict(c.fallbacks_by_reason),
        }

    def metadata_nbytes(self) -> int:
        """Bytes of per-page bookkeeping: free stacks, request pages and hashes, tree."""
        total = sum(p.nbytes for p in self._pools) + self._cache.nbytes
        for req in self._reqs.values():
            total += req.own_pages.nbytes + sum(h.nbytes for h in req.hashes)
        return total

    def check_invariants(self) -> None:
        """Raise AssertionError unless every page is in exactly one place.

        Places: free, used by one request, cached, reserved. Also checks the
        prefix cache's own counts and locks.
        """
        n = self.config.num_pages_per_lane
        seen = np.zeros((self.cp_size, n), dtype=np.int64)
        for r, pool in enumerate(self._pools):
            np.add.at(seen[r], pool.free_pages_view(), 1)
            seen[r, RESERVED_LOCAL_PAGE] += 1
        owned = [req.own_pages for req in self._reqs.values()]
        owned.append(self._cache.all_pages())
        pages = np.concatenate(owned) if owned else _EMPTY_I32
        np.add.at(seen, (pages % self.cp_size, pages // self.cp_size), 1)
        bad = np.argwhere(seen != 1)
        if bad.size:
            lane, local = bad[0]
            raise AssertionError(
                f"{len(bad)} pages misplaced; e.g. lane {lane} local page {local} is in "
                f"{seen[lane, local]} places"
            )
        self._cache.check()
        for req in self._reqs.values():
            want = -(-req.num_tokens // self.page_size)
            if req.pages.shape[0] != want:
                raise AssertionError(
                    f"rid {req.rid!r} holds {req.pages.shape[0]} pages for {req.num_tokens} tokens"
                )
        slots = {req.slot for req in self._reqs.values()}
        if len(slots) != len(self._reqs) or slots & set(self._free_slots):
            raise AssertionError("request slots are shared or both used and free")
        if len(slots) + len(self._free_slots) != self.config.max_reqs:
            raise AssertionError("request slots leaked")

    # ---------------------------------------------------------------- private
    def _get(self, rid: Hashable) -> _Request:
        rid = check_rid(rid)
        req = self._reqs.get(rid)
        if req is None:
            self._check_not_lost(rid)
            raise InvalidRequestError(f"unknown rid={rid!r} (never allocated, or already freed)")
        return req

    def _check_not_lost(self, rid: Hashable) -> None:
        lane = self._lost.get(rid)
        if lane is not None:
            raise LaneUnavailableError(lane, [rid], "the request was lost with the lane")

    def _check_len(self, rid: Hashable, held: int, adding: int) -> None:
        if held + adding > self.config.max_context_len:
            raise InvalidRequestError(
                f"rid={rid!r} would hold {held} + {adding} = {held + adding} tokens "
                f"> max_context_len={self.config.max_context_len}"
            )

    def _match_for_new(self, num_tokens: int, hashes: np.ndarray):
        # Leave at least one token to compute (a prefill must produce logits).
        limit = (num_tokens - 1) // self.page_size
        return (
            self._cache.match_prefix(hashes[:limit])
            if self.enable_prefix_cache
            else self._cache.match_prefix(hashes[:0])
        )

    def _num_new_pages(self, prefix_len: int, extend_len: int) -> int:
        p = self.page_size
        return -(-(prefix_len + extend_len) // p) - (-(-prefix_len // p))

    def _head(self, req: _Request, extend_len: int) -> tuple[int, int]:
        used = req.num_tokens % self.page_size
        if used == 0 or req.num_tokens == 0:
            return -1, 0
        return req.last_slot(self.page_size) + 1, min(self.page_size - used, extend_len)

    def _plan_step(self, rid: Hashable, req: _Request | None, chunk: _Chunk) -> _Step:
        """Decide where one request's step goes: cached prefix, owner plan or rotation.

        NOTE: each sequence of a batch is planned alone, so ``multi_batch`` is never a reason.
        """
        num_tokens = chunk.num_tokens
        prefix_len = 0 if req is None else req.num_tokens
        self._check_len(rid, prefix_len, num_tokens)
        match = None
        if req is None:
            match = self._match_for_new(num_tokens, chunk.hashes)
            prefix_len = match.num_pages * self.page_size
        extend_len = num_tokens - (prefix_len if req is None else 0)
        reason = in_seq_page_compute_owner_unavailable_reason(
            extend_len, prefix_len, self.page_size, self.cp_size
        )
        plan = (
            None
            if reason
            else build_owner_plan(
                extend_len, prefix_len, self.page_size, self.cp_size, self.config.owner_split
            )
        )
        num_new = self._num_new_pages(prefix_len, extend_len)
        assert plan is None or plan.num_pages == num_new, (plan.num_pages, num_new)
        return _Step(match, prefix_len, extend_len, num_new, plan, reason)

    def _batch_owners(self, steps: list[_Step]) -> np.ndarray:
        """Owners of a batch's new pages, in item order: plans where they exist, the rest in
        rotation over what the planned pages leave."""
        planned = np.zeros(self.cp_size, dtype=np.int64)
        rotated = 0
        for st in steps:
            if st.plan is not None:
                planned += st.plan.pages_per_lane
            else:
                rotated += st.num_new_pages
        rotation = self._rotation_owners(rotated, reserved=planned)
        parts, taken = [], 0
        for st in steps:
            if st.plan is not None:
                parts.append(st.plan.page_owners)
            else:
                parts.append(rotation[taken : taken + st.num_new_pages])
                taken += st.num_new_pages
        return np.concatenate(parts).astype(np.int32, copy=False) if parts else _EMPTY_I32

    def _extend(
        self, req: _Request, step: _Step, new_pages: np.ndarray, chunk: _Chunk
    ) -> ExtendAllocation:
        """Give ``req`` its new pages and tokens; describe the step to the caller."""
        head_slot, head_len = self._head(req, step.extend_len)
        req.add_pages(new_pages)
        match, plan = step.match, step.plan
        self._advance(req, step.extend_len, chunk, skip=match.num_pages if match else 0)
        req.seq += 1
        self._counters.extend_allocations += 1
        return ExtendAllocation(
            rid=req.rid,
            seq=req.seq,
            req_slot=req.slot,
            prefix_len=step.prefix_len,
            cached_len=step.prefix_len if match is not None else 0,
            extend_len=step.extend_len,
            page_size=self.page_size,
            cp_size=self.cp_size,
            head_slot=head_slot,
            head_len=head_len,
            new_pages=_readonly(new_pages),
            page_owners=None if plan is None else _readonly(plan.page_owners),
            lane_token_ranges=None if plan is None else plan.lane_token_ranges,
            fallback_reason=step.reason,
            cached_pages=_readonly(match.pages) if match is not None else _EMPTY_I32,
        )

    def _chunk(
        self,
        rid: Hashable,
        req: _Request | None,
        tokens: np.ndarray,
        cache_salt: str | bytes | None,
    ) -> _Chunk:
        """Hash the pages that ``req``'s partial page plus ``tokens`` complete."""
        if req is None:
            state, prev = self._hasher.start(cache_salt), _EMPTY_I64
        else:
            if cache_salt is not None and cache_salt != req.salt:
                raise InvalidRequestError(
                    f"rid={rid!r} was created with cache_salt={req.salt!r}, got {cache_salt!r}"
                )
            if req.tail is None or req.chain is None:
                return _Chunk(int(tokens.shape[0]), _EMPTY_U64, None, None)
            state, prev = req.chain, req.tail
        seq = np.concatenate([prev, tokens]) if prev.size else tokens
        hashes, chain = self._hasher.hash_pages(seq, state)
        tail = seq[hashes.shape[0] * self.page_size :].copy()
        return _Chunk(int(tokens.shape[0]), hashes, chain, tail)

    def _new_request(
        self, rid: Hashable, slot: int, match, chunk: _Chunk, salt: str | bytes | None
    ) -> _Request:
        req = _Request(rid, slot, match.node, match.pages, salt)
        self._reqs[rid] = req
        req.num_tokens = match.num_pages * self.page_size
        req.hashes.append(chunk.hashes[: match.num_pages])
        self._counters.cached_tokens_hit += req.num_tokens
        return req

    def _advance(self, req: _Request, num_tokens: int, chunk: _Chunk | None, skip: int = 0) -> None:
        """Advance ``req`` by ``num_tokens``; keep the hashes of the pages they complete.

        ``skip`` hashes at the front were already kept (a new request's cached prefix).
        """
        req.num_tokens += num_tokens
        if req.tail is None:
            return
        if chunk is None or chunk.tail is None:
            req.tail = req.chain = None  # an unknown token: no later page can be cached
            return
        if chunk.hashes.shape[0] > skip:
            req.hashes.append(chunk.hashes[skip:])
        req.tail, req.chain = chunk.tail, chunk.chain

    def _take_slot(self) -> int:
        if not self._free_slots:
            self._raise_wait(
                np.zeros(self.cp_size, np.int64),
                "request_slots_exhausted",
                f"all {self.config.max_reqs} request slots are in use",
            )
        return self._free_slots.pop()

    def _rotation_owners(self, num_pages: int, reserved: np.ndarray | None = None) -> np.ndarray:
        """Owners for pages drawn in rotation, starting at the lane with most free pages.

        A lane leaves the rotation once its free plus evictable pages are used up,
        so a fallback step never waits while other lanes could still serve it.
        ``reserved`` pages per lane are already promised to owner plans of the same step.
        """
        if num_pages == 0:
            return _EMPTY_I32
        free = self.num_available_pages_per_lane()
        if reserved is not None:
            free = free - reserved
        order = np.argsort(-free, kind="stable").astype(np.int32)
        base, extra = divmod(num_pages, self.cp_size)
        counts = np.full(self.cp_size, base, dtype=np.int64)
        counts[:extra] += 1  # per position in `order`
        evictable = self._cache.num_evictable_pages_per_lane
        if self.availability:
            evictable[self.availability.down_lanes] = 0  # a lane that is down gives nothing
        cap = np.maximum(0, free + evictable)[order]
        if (counts <= cap).all() or cap.sum() < num_pages:
            return np.resize(order, num_pages)
        # Water-fill: every lane gets min(cap, level) for the highest level that fits,
        # the rest one more each in rotation order, so unsaturated lanes stay within
        # a page of each other.
        level = 0
        for c in np.unique(cap):
            if np.minimum(cap, c).sum() > num_pages:
                break
            level = int(c)
        open_lanes = int((cap > level).sum())
        if open_lanes:
            level += (num_pages - int(np.minimum(cap, level).sum())) // open_lanes
        counts = np.minimum(cap, level)
        room = np.flatnonzero(cap > counts)
        counts[room[: num_pages - int(counts.sum())]] += 1
        # Interleave: round j visits, in rotation order, the lanes with > j pages.
        rounds = np.concatenate([np.arange(c) for c in counts])
        rank = np.repeat(np.arange(self.cp_size), counts)
        return order[rank[np.lexsort((rank, rounds))]]

    def _secure(self, planner, *, reason: str) -> np.ndarray:
        """Make the planned pages free, evicting for the short lanes; return the owners.

        Raises:
            KVCapacityWaitError: still short after eviction (nothing allocated).
        """
        owners = planner()
        for _attempt in range(self.max_evict_attempts):
            required = np.bincount(owners, minlength=self.cp_size)
            deficit = np.maximum(0, required - self.num_available_pages_per_lane())
            if not deficit.any():
                return owners
            if self.availability and deficit[self.availability.down_lanes].any():
                break  # a restarting lane: eviction cannot help it
            self._counters.evict_calls += 1
            # NOTE: deficits are in owner-lane pages already; never scale by cp_size.
            self._counters.evict_tokens_requested += int(deficit.sum()) * self.page_size
            result = self._cache.evict(deficit)
            if result.num_pages == 0:
                break
            self._counters.pages_evicted += result.num_pages
            for r, pages in enumerate(result.freed_pages):
                self._free_local(r, pages // self.cp_size)
            owners = planner()
        required = np.bincount(owners, minlength=self.cp_size)
        deficit = np.maximum(0, required - self.num_available_pages_per_lane())
        if not deficit.any():
            return owners
        down = [r for r in self.availability.down_lanes if deficit[r]]
        if down:
            reason = "lane_unavailable"
            message = f"lanes {down} are restarting; {int(required.sum())} pages wanted"
        else:
            message = f"{int(required.sum())} pages wanted after eviction"
        self._raise_wait(required, reason, message)
        raise AssertionError("unreachable")

    def _raise_wait(self, required: np.ndarray, reason: str, message: str) -> None:
        available = self.num_available_pages_per_lane()
        deficit = np.maximum(0, required - available)
        self._counters.capacity_waits += 1
        raise KVCapacityWaitError(
            message,
            required_by_owner=required.tolist(),
            available_by_owner=available.tolist(),
            deficit_by_owner=deficit.tolist(),
            reason=reason,
        )

    def _take_pages(self, owners: np.ndarray) -> np.ndarray:
        """Take the pages the owners name, one batched pop per lane; global ids in order."""
        out = np.empty(owners.shape[0], dtype=np.int32)
        if owners.shape[0] == 0:
            return out
        counts = np.bincount(owners, minlength=self.cp_size)
        for r in np.flatnonzero(counts):
            local = self._pools[r].allocate(int(counts[r]))
            if self._moves is not None:
                self._moves[r][0].append(local)
            out[owners == r] = local * self.cp_size + r
        self._counters.pages_allocated += int(owners.shape[0])
        return out

    def _release(self, pages: np.ndarray) -> None:
        if pages.size == 0:
            return
        lanes = pages % self.cp_size
        for r in range(self.cp_size):
            mine = pages[lanes == r]
            if mine.size:
                self._free_local(r, mine // self.cp_size)

    def _free_local(self, lane: int, local: np.ndarray) -> None:
        self._pools[lane].free(local)
        if self._moves is not None:
            self._moves[lane][1].append(local)

    def _count_fallback(self, reason: str, num_tokens: int) -> None:
        by = self._counters.fallbacks_by_reason
        by[reason] = by.get(reason, 0) + 1
        if reason not in self._logged_reasons:
            self._logged_reasons.add(reason)
            logger.warning(
                "owner plan unavailable (reason=%s, %d tokens); drawing pages in rotation. "
                "Logged once per reason; counts are in stats()['fallbacks_by_reason'].",
                reason,
                num_tokens,
            )


def _readonly(a: np.ndarray) -> np.ndarray:
    """A read-only view: answers share memory with the core, callers must not write it."""
    v = a.view()
    v.flags.writeable = False
    return v
