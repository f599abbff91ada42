"""Stateful property test of the decision core (:class:`cpkv.CPAllocator`), no Ray, no torch.

A hypothesis ``RuleBasedStateMachine`` drives one allocator on a tiny pool (1..4 lanes,
pages of 1..4 tokens, 4..24 pages a lane, 3..6 request slots) with prompts built from a
few shared prefixes over a 4-token vocabulary, so the prefix cache gets hits, node
splits, duplicate inserts and evictions, and capacity pressure is the rule rather than
the exception. Rules: new and chunked ``allocate_extend``, mixed ``allocate_extend_batch``,
``allocate_decode`` with and without token ids, ``free`` (cached or not, with
``committed_len``), a rare ``drop_lane``, and invalid calls of every kind.

The model keeps, per live request, its tokens, the slot of every token (from
``out_cache_loc`` and decode returns) and how many leading pages came from the cache;
the token last written to every slot; and, when the allocator journals its page moves
(``record_page_moves``), a mirror of every lane's free pages and a trie of the prefix
cache (evictions are read from the journal, everything else is predicted). After every
step it checks the core's own invariants, the page accounting per lane, each request's
pages against its slots, that requests share only cached-prefix pages, that cached pages
hold the tokens they were matched for, and that the cache holds what the trie says. A
``KVCapacityWaitError`` must leave the state untouched (eviction aside), carry
consistent vectors, and be raised exactly when the pages cannot be had, even after
evicting every unlocked cached page.

Two subclasses add checks that the core fails today (the regression tests at the end
are their minimal examples; those machines skip shrinking to stay fast):
``RotationBalanceMachine`` (a rotation fallback keeps lanes within a page of each other,
save lanes that ran out of pages) and ``FreeCountMachine`` (``free`` counts every page
it returns).
"""

from __future__ import annotations

import copy
import pickle
import sys
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field

import numpy as np
import pytest
from hypothesis import HealthCheck, Phase, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from cpkv import (
    CPAllocator,
    ExtendAllocation,
    InvalidRequestError,
    KVCapacityWaitError,
    LaneUnavailableError,
    OwnerPlan,
    build_owner_plan,
    in_seq_page_compute_owner_unavailable_reason,
)

VOCAB = 4
# Stats keys a capacity wait may change: eviction moves pages from cached to free.
_WAIT_MAY_CHANGE = {
    "free",
    "cached",
    "evictable",
    "capacity_waits",
    "evict_calls",
    "pages_evicted",
    "evict_tokens_requested",
}
_ROOT = -1


@dataclass
class ReqModel:
    """What the test knows about one live request."""

    tokens: list[int | None]  # None: appended by a decode without token ids
    slots: list[int]
    num_cached_pages: int
    req_slot: int
    seq: int = 0
    cached_pages: list[int] = field(default_factory=list)

    @property
    def length(self) -> int:
        return len(self.tokens)

    def num_hashed_pages(self, page_size: int) -> int:
        """Leading full pages whose tokens are all known (only those can be cached)."""
        known = self.tokens.index(None) if None in self.tokens else len(self.tokens)
        return known // page_size


@dataclass
class Snapshot:
    stats: dict
    reqs: dict[Hashable, tuple[tuple[int, ...], int, int, int]]


@dataclass
class Item:
    """One request of an extend call, as the test predicts it."""

    rid: Hashable
    tokens: list[int]
    prev_len: int
    match_pages: list[int] | None  # None: existing request
    cached_len: int
    extend_len: int
    num_new_pages: int


class TrieModel:
    """The prefix cache as the test expects it: one node per cached page, keyed by
    the page's tokens under its parent page. Evictions are learnt from the page
    journal (``drain_page_moves``), everything else is predicted."""

    def __init__(self) -> None:
        self.children: dict[int, dict[tuple[int, ...], int]] = {_ROOT: {}}
        self.parent: dict[int, int] = {}
        self.chunk: dict[int, tuple[int, ...]] = {}

    def pages(self) -> set[int]:
        return set(self.parent)

    def match(self, chunks: list[tuple[int, ...]]) -> list[int]:
        out, node = [], _ROOT
        for c in chunks:
            nxt = self.children[node].get(c)
            if nxt is None:
                break
            out.append(nxt)
            node = nxt
        return out

    def insert(self, chunks: list[tuple[int, ...]], pages: list[int]) -> list[int]:
        """Cache ``pages`` under their chunks; return the pages that went in."""
        node, added = _ROOT, []
        for c, p in zip(chunks, pages, strict=True):
            nxt = self.children[node].get(c)
            if nxt is None:
                assert p not in self.parent, f"page {p} cached twice"
                self.children[node][c] = p
                self.children[p] = {}
                self.parent[p], self.chunk[p] = node, c
                added.append(p)
                nxt = p
            node = nxt
        return added

    def subtree(self, page: int) -> set[int]:
        out, stack = set(), [page]
        while stack:
            p = stack.pop()
            out.add(p)
            stack.extend(self.children[p].values())
        return out

    def remove(self, pages: set[int]) -> None:
        """Forget ``pages``; they must be closed under descendants (trimmed from the tail)."""
        for p in pages:
            assert p in self.parent, f"page {p} freed from the cache but not cached"
            kept = set(self.children[p].values()) - pages
            assert not kept, f"page {p} evicted while its children {kept} stay cached"
        for p in pages:
            del self.children[self.parent[p]][self.chunk[p]]
        for p in pages:
            del self.parent[p], self.chunk[p], self.children[p]


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def expand(pages: list[int] | np.ndarray, page_size: int, n: int) -> list[int]:
    """Slots of the first ``n`` tokens held in ``pages``."""
    return [int(p) * page_size + o for p in pages for o in range(page_size)][:n]


def lane_counts(pages: list[int] | set[int] | np.ndarray, cp_size: int) -> np.ndarray:
    arr = np.asarray(sorted(pages) if isinstance(pages, set) else pages, dtype=np.int64)
    return np.bincount(arr % cp_size, minlength=cp_size).astype(np.int64)


def assert_balanced(required: list[int], n: int) -> None:
    assert sum(required) == n, (required, n)
    assert max(required) - min(required) <= 1, required


def rotation_counts(order: np.ndarray, n: int) -> np.ndarray:
    """Pages per lane of a plain rotation of ``n`` pages over ``order``."""
    counts = np.zeros(order.shape[0], dtype=np.int64)
    np.add.at(counts, np.resize(order, n), 1)
    return counts


class CoreMachine(RuleBasedStateMachine):
    """CPAllocator against a model of requests, slots and page contents."""

    # Checks of behaviour the core gets wrong today (see the regression tests).
    CHECK_ROTATION_BALANCE = False
    CHECK_FREE_COUNT = False

    def __init__(self) -> None:
        super().__init__()
        self.alloc: CPAllocator | None = None
        self.live: dict[Hashable, ReqModel] = {}
        self.lost: dict[Hashable, int] = {}
        self.dead: list[Hashable] = []
        self.slot_token: dict[int, int | None] = {}
        self.next_rid = 0

    # ------------------------------------------------------------------ setup
    @initialize(
        cp=st.integers(1, 4),
        ps=st.sampled_from([1, 2, 3, 4]),
        npl=st.integers(4, 24),
        max_reqs=st.integers(3, 6),
        max_ctx=st.sampled_from([16, 48, 200]),
        cache=st.sampled_from([True, True, True, False]),
        moves=st.sampled_from([True, True, True, False]),
        base=st.lists(st.integers(0, VOCAB - 1), min_size=8, max_size=40),
        branches=st.lists(
            st.tuples(st.integers(0, 40), st.lists(st.integers(0, VOCAB - 1), max_size=20)),
            min_size=1,
            max_size=3,
        ),
    )
    def setup(
        self,
        cp: int,
        ps: int,
        npl: int,
        max_reqs: int,
        max_ctx: int,
        cache: bool,
        moves: bool,
        base: list[int],
        branches: list[tuple[int, list[int]]],
    ) -> None:
        self.cp, self.ps, self.npl = cp, ps, npl
        self.max_reqs, self.max_ctx, self.cache = max_reqs, max_ctx, cache
        self.max_attempts = max(2, min(8, cp))
        # Prompts up to about 2/3 of the pool: most fit, some only after eviction.
        self.room = min(max_ctx, max(2, 2 * cp * (npl - 1) * ps // 3))
        self.alloc = CPAllocator(
            cp,
            ps,
            npl,
            max_reqs=max_reqs,
            max_context_len=max_ctx,
            enable_prefix_cache=cache,
            record_page_moves=moves,
        )
        # Mirror of each lane's free local pages, kept from drain_page_moves() alone.
        self.mirror: list[set[int]] | None = (
            [set(range(1, npl)) for _ in range(cp)] if moves else None
        )
        # The cache model needs the journal to learn which pages were evicted.
        self.trie: TrieModel | None = TrieModel() if moves else None
        # Shared prefixes: a base and branches off it (so cached nodes get split).
        self.prefixes = [base] + [base[: min(cut, len(base))] + tail for cut, tail in branches]

    # ---------------------------------------------------------------- helpers
    def _fresh_rid(self, data: st.DataObject) -> Hashable:
        if self.dead and data.draw(st.integers(0, 4), label="reuse rid") == 0:
            rid = data.draw(st.sampled_from(self.dead), label="reused rid")
            self.dead.remove(rid)
            return rid
        self.next_rid += 1
        return self.next_rid

    def _prompt(self, data: st.DataObject, room: int) -> list[int]:
        """A prompt of 1..room tokens: a cut of a shared prefix plus a random tail."""
        pre = data.draw(st.sampled_from(self.prefixes), label="prefix")
        cut = data.draw(st.integers(0, len(pre)), label="cut")
        tail = data.draw(st.lists(st.integers(0, VOCAB - 1), max_size=24), label="tail")
        toks = (pre[:cut] + tail)[:room]
        return toks or [data.draw(st.integers(0, VOCAB - 1), label="one token")]

    def _chunk(self, data: st.DataObject, m: ReqModel, room: int) -> list[int]:
        """Next prefill chunk: continue a shared prefix when the request follows one."""
        n = data.draw(st.integers(1, max(1, min(room, 32))), label="chunk len")
        if None not in m.tokens:
            for pre in self.prefixes:
                follows = len(pre) > m.length and pre[: m.length] == m.tokens
                if follows and data.draw(st.booleans(), label="follow prefix"):
                    return pre[m.length : m.length + n]
        return data.draw(st.lists(st.integers(0, VOCAB - 1), min_size=n, max_size=n))

    @staticmethod
    def _as_input(data: st.DataObject, toks: list[int]) -> object:
        """The tokens as the caller may pass them: list, tuple or an int array."""
        form = data.draw(st.sampled_from(["list", "tuple", "int64", "int32"]), label="form")
        if form == "list":
            return list(toks)
        if form == "tuple":
            return tuple(toks)
        return np.asarray(toks, dtype=np.int64 if form == "int64" else np.int32)

    @staticmethod
    def _scribble(inputs: list[object]) -> None:
        """Overwrite the caller's arrays: the core must have kept no view of them."""
        for x in inputs:
            if isinstance(x, np.ndarray):
                x[:] = VOCAB + 95

    def _snapshot(self) -> Snapshot:
        a = self.alloc
        reqs = {
            rid: (
                tuple(int(p) for p in a.request_pages(rid)),
                a.request_len(rid),
                a.request_slot(rid),
                a.request_seq(rid),
            )
            for rid in a.request_ids()
        }
        return Snapshot(a.stats(), reqs)

    def _locked_cached_pages(self) -> set[int]:
        """Cached pages in use: the union of the live requests' cached prefixes."""
        out: set[int] = set()
        for m in self.live.values():
            out.update(m.cached_pages)
        return out

    def _capacity(self, before: Snapshot, match_pages: list[list[int]]) -> np.ndarray:
        """Pages each lane can give once everything evictable (and not about to be
        locked by this call's prefix matches) is evicted."""
        newly_locked = set().union(*match_pages) - self._locked_cached_pages()
        evictable = np.asarray(before.stats["evictable"]) - lane_counts(newly_locked, self.cp)
        return np.asarray(before.stats["free"]) + evictable

    def _chunks(self, toks: list[int], n: int) -> list[tuple[int, ...]]:
        ps = self.ps
        return [tuple(toks[i * ps : (i + 1) * ps]) for i in range(n)]

    def _after_alloc(self, taken_want: set[int], locked_now: set[int]) -> None:
        """Journal of an allocation: it took ``taken_want`` and released evictions only."""
        if self.mirror is None:
            return
        taken, released = self._drain()
        assert taken == taken_want, (taken, taken_want)
        assert self.trie is not None
        locked = self._locked_cached_pages() | locked_now
        assert not released & locked, f"evicted pages in use: {released & locked}"
        self.trie.remove(released)

    def _write(self, slots: list[int], toks: list[int | None]) -> None:
        for s, t in zip(slots, toks, strict=True):
            self.slot_token[s] = t

    def _check_unchanged(self, before: Snapshot) -> None:
        after = self._snapshot()
        assert after.stats == before.stats
        assert after.reqs == before.reqs

    def _expect_invalid(
        self, call: Callable[[], object], exc: type[Exception] = InvalidRequestError
    ) -> Exception:
        before = self._snapshot()
        with pytest.raises(exc) as info:
            call()
        self._check_unchanged(before)
        return info.value

    def _check_wait(
        self,
        err: KVCapacityWaitError,
        before: Snapshot,
        *,
        slots_exhausted: bool,
        reason: str,
        num_pages: int,
        plan_required: np.ndarray | None,
    ) -> None:
        after = self._snapshot()
        b, a = before.stats, after.stats
        cp = self.cp
        for key in b:
            if key not in _WAIT_MAY_CHANGE:
                assert a[key] == b[key], key
        assert a["capacity_waits"] == b["capacity_waits"] + 1
        freed = np.asarray(a["free"]) - np.asarray(b["free"])
        evicted = np.asarray(b["cached"]) - np.asarray(a["cached"])
        assert (freed >= 0).all(), (b["free"], a["free"])
        assert np.array_equal(freed, evicted), (freed, evicted)
        assert np.array_equal(np.asarray(b["evictable"]) - np.asarray(a["evictable"]), evicted)
        assert a["pages_evicted"] - b["pages_evicted"] == int(evicted.sum())
        assert after.reqs == before.reqs
        assert set(self.alloc.request_ids()) == set(self.live)
        # The three vectors.
        req, avail, deficit = err.required_by_owner, err.available_by_owner, err.deficit_by_owner
        back = pickle.loads(pickle.dumps(err))
        assert type(back) is KVCapacityWaitError and str(back) == str(err)
        assert (back.required_by_owner, back.available_by_owner, back.deficit_by_owner) == (
            req,
            avail,
            deficit,
        )
        assert back.reason == err.reason
        assert len(req) == len(avail) == len(deficit) == cp
        assert deficit == [max(0, r - v) for r, v in zip(req, avail, strict=True)]
        assert avail == a["free"]
        if slots_exhausted:
            assert err.reason == "request_slots_exhausted", err.reason
            assert req == [0] * cp
            assert a == {**b, "capacity_waits": b["capacity_waits"] + 1}
            return
        assert err.reason == reason, (err.reason, reason)
        assert any(d > 0 for d in deficit), deficit
        if plan_required is not None:
            assert req == plan_required.tolist(), (req, plan_required)
        else:
            assert_balanced(req, num_pages)

    def _check_rotation(self, lanes: np.ndarray, before: Snapshot, cap: np.ndarray) -> None:
        """Lanes of the pages a rotation fallback drew, in order."""
        n, cp = lanes.shape[0], self.cp
        counts = np.bincount(lanes, minlength=cp)
        assert (counts <= cap).all(), (counts, cap)
        free = np.asarray(before.stats["free"])
        order = np.argsort(-free, kind="stable")
        if (rotation_counts(order, n) <= free).all():
            # Enough free pages: a plain rotation from the lane with most free, no eviction.
            assert np.array_equal(lanes, np.resize(order, n)), (lanes, free)
            assert self.alloc.stats()["evict_calls"] == before.stats["evict_calls"]
        if self.CHECK_ROTATION_BALANCE:
            # Lanes stay within a page of each other, save those that ran out of pages.
            room = counts < cap
            assert not room.any() or counts.max() <= counts[room].min() + 1, (
                f"pages per lane {counts.tolist()} with capacity {cap.tolist()}"
            )

    def _check_evict_counters(
        self,
        before: Snapshot,
        *,
        num_pages: int,
        plan_required: np.ndarray | None,
        final_deficit: list[int] | None,
    ) -> None:
        b, a = before.stats, self.alloc.stats()
        calls = a["evict_calls"] - b["evict_calls"]
        tokens = a["evict_tokens_requested"] - b["evict_tokens_requested"]
        assert 0 <= calls <= self.max_attempts, calls
        assert tokens % self.ps == 0 and tokens <= calls * num_pages * self.ps, (tokens, calls)
        if plan_required is None:
            return
        d0 = np.maximum(0, plan_required - np.asarray(b["free"]))
        if not d0.any():
            assert calls == 0 and final_deficit is None
            return
        if final_deficit is None:
            assert calls == 1, calls
            assert tokens == int(d0.sum()) * self.ps, (tokens, d0)
        else:
            assert calls in (1, 2), calls
            extra = sum(final_deficit) if calls == 2 else 0
            assert tokens == (int(d0.sum()) + extra) * self.ps, (tokens, d0, final_deficit)

    # ---------------------------------------------------------------- extend
    def _items(self, pairs: list[tuple[Hashable, list[int]]]) -> list[Item]:
        probe = copy.deepcopy(self.alloc)
        items = []
        for rid, toks in pairs:
            m = self.live.get(rid)
            if m is None:
                limit = (len(toks) - 1) // self.ps
                mp = probe.match_prefix(toks[: limit * self.ps]) if limit else np.empty(0)
                match = [int(p) for p in mp] if self.cache else []
                if self.trie is not None:
                    assert match == self.trie.match(self._chunks(toks, limit)), (
                        match,
                        self.trie.match(self._chunks(toks, limit)),
                    )
                cached = len(match) * self.ps
                items.append(
                    Item(
                        rid,
                        toks,
                        0,
                        match,
                        cached,
                        len(toks) - cached,
                        ceil_div(len(toks), self.ps) - len(match),
                    )
                )
            else:
                n = m.length
                items.append(
                    Item(
                        rid,
                        toks,
                        n,
                        None,
                        0,
                        len(toks),
                        ceil_div(n + len(toks), self.ps) - ceil_div(n, self.ps),
                    )
                )
        return items

    def _extend(self, pairs: list[tuple[Hashable, list[int]]], data: st.DataObject) -> None:
        batch = len(pairs) > 1
        inputs = [self._as_input(data, toks) for _, toks in pairs]
        call_pairs = [(rid, x) for (rid, _), x in zip(pairs, inputs, strict=True)]
        items = self._items(pairs)
        before = self._snapshot()
        b = before.stats
        num_pages = sum(it.num_new_pages for it in items)
        num_new_reqs = sum(it.match_pages is not None for it in items)
        slots_exhausted = num_new_reqs > self.max_reqs - len(self.live)
        plan = None
        reason: str | None = "multi_batch"
        if not batch:
            it = items[0]
            prefix = it.prev_len if it.match_pages is None else it.cached_len
            reason = in_seq_page_compute_owner_unavailable_reason(
                it.extend_len, prefix, self.ps, self.cp
            )
            plan = build_owner_plan(it.extend_len, prefix, self.ps, self.cp)
            assert (plan is None) == (reason is not None)
        plan_required = None if plan is None else plan.pages_per_lane.astype(np.int64)
        if plan is not None:
            req, avail, deficit = self.alloc.lane_stats(plan.page_owners)
            assert req == plan_required.tolist() and avail == b["free"]
            assert deficit == [max(0, r - v) for r, v in zip(req, avail, strict=True)]
        cap = self._capacity(before, [it.match_pages or [] for it in items])
        if plan_required is not None:
            feasible = bool((cap >= plan_required).all())
        else:  # the fallback leaves out lanes that run out, so only the total counts
            feasible = int(cap.sum()) >= num_pages
        try:
            if batch:
                allocs = self.alloc.allocate_extend_batch(call_pairs)
            else:
                allocs = [self.alloc.allocate_extend(*call_pairs[0])]
        except KVCapacityWaitError as err:
            self._scribble(inputs)
            self._after_alloc(set(), set().union(*(it.match_pages or [] for it in items)))
            event(f"extend wait: {err.reason}")
            assert slots_exhausted or not feasible, (
                f"waited although evicting would do: capacity {cap.tolist()}, "
                f"wanted {err.required_by_owner}, reason {err.reason}"
            )
            self._check_wait(
                err,
                before,
                slots_exhausted=slots_exhausted,
                reason="owner_lane_exhausted" if plan is not None else "lane_exhausted",
                num_pages=num_pages,
                plan_required=plan_required,
            )
            if not slots_exhausted:
                self._check_evict_counters(
                    before,
                    num_pages=num_pages,
                    plan_required=plan_required,
                    final_deficit=err.deficit_by_owner,
                )
            return
        assert not slots_exhausted, "a new request got a slot although none was free"
        self._scribble(inputs)
        assert feasible, f"allocated {num_pages} pages beyond capacity {cap.tolist()}"
        self._after_alloc(
            {int(p) for al in allocs for p in al.new_pages},
            set().union(*(it.match_pages or [] for it in items)),
        )
        a = self.alloc.stats()
        event("extend ok: " + ("batch" if batch else "plan" if plan else str(reason)))
        if a["evict_calls"] > b["evict_calls"]:
            event("extend ok after eviction")
        if any(it.cached_len for it in items):
            event("extend with cache hit")
        assert len(allocs) == len(items)
        for it, al in zip(items, allocs, strict=True):
            self._check_allocation(it, al, batch, plan)
        new_pages = (
            np.concatenate([al.new_pages for al in allocs]) if allocs else np.empty(0, np.int32)
        )
        assert new_pages.shape[0] == num_pages
        lanes = new_pages.astype(np.int64) % self.cp
        evicted = np.asarray(b["cached"]) - np.asarray(a["cached"])
        assert (evicted >= 0).all()
        assert a["pages_evicted"] - b["pages_evicted"] == int(evicted.sum())
        got = lane_counts(new_pages, self.cp)
        assert np.array_equal(np.asarray(a["free"]), np.asarray(b["free"]) + evicted - got)
        if plan is None:
            self._check_rotation(lanes, before, cap)
        self._check_evict_counters(
            before, num_pages=num_pages, plan_required=plan_required, final_deficit=None
        )
        # Counters.
        assert a["extend_allocations"] == b["extend_allocations"] + len(items)
        assert a["pages_allocated"] == b["pages_allocated"] + num_pages
        assert a["capacity_waits"] == b["capacity_waits"]
        assert a["cached_tokens_hit"] == b["cached_tokens_hit"] + sum(it.cached_len for it in items)
        fb = dict(b["fallbacks_by_reason"])
        if reason is not None:
            fb[reason] = fb.get(reason, 0) + 1
        assert a["fallbacks_by_reason"] == fb

    def _check_allocation(
        self, it: Item, al: ExtendAllocation, batch: bool, plan: OwnerPlan | None
    ) -> None:
        ps, cp = self.ps, self.cp
        assert al.rid == it.rid
        assert al.extend_len == it.extend_len
        assert al.cached_len == it.cached_len
        assert al.num_new_pages == it.num_new_pages
        assert al.page_size == ps and al.cp_size == cp
        slots = al.out_cache_loc.tolist()
        assert len(slots) == it.extend_len
        assert len(set(slots)) == len(slots), slots
        assert all((s // ps) // cp != 0 for s in slots), f"reserved page handed out: {slots}"
        assert all(0 <= s < cp * self.npl * ps for s in slots), slots
        # Per-lane split of the slots.
        seen = np.zeros(it.extend_len, dtype=np.int64)
        for r, (idx, local) in enumerate(al.slots_by_lane()):
            seen[idx] += 1
            g = np.asarray(slots, dtype=np.int64)[idx] // ps
            assert (g % cp == r).all()
            assert np.array_equal(local, (g // cp) * ps + np.asarray(slots)[idx] % ps)
        assert (seen == 1).all()
        if al.head_len:
            assert al.head_slot == slots[0]
        if it.match_pages is None:  # existing request: chunked prefill
            m = self.live[it.rid]
            assert al.prefix_len == it.prev_len
            assert al.req_slot == m.req_slot
            assert al.cached_pages.shape == (0,)
            used = m.length % ps
            assert al.head_len == (min(ps - used, it.extend_len) if used else 0)
            m.tokens.extend(it.tokens)
            m.slots.extend(slots)
            self._write(slots, list(it.tokens))
        else:  # new request
            pages = [int(p) for p in self.alloc.request_pages(it.rid)]
            assert pages[: len(it.match_pages)] == it.match_pages
            assert al.prefix_len == it.cached_len
            assert al.head_len == 0
            prefix_slots = expand(it.match_pages, ps, it.cached_len)
            assert al.cached_pages.tolist() == it.match_pages
            assert al.cached_slots.tolist() == prefix_slots
            for i, s in enumerate(prefix_slots):
                assert self.slot_token.get(s) == it.tokens[i], (
                    f"cached page {s // ps} holds {self.slot_token.get(s)} at offset {s % ps}, "
                    f"matched for token {it.tokens[i]}"
                )
            assert not set(prefix_slots) & set(slots)
            m = ReqModel(
                tokens=list(it.tokens),
                slots=prefix_slots + slots,
                num_cached_pages=len(it.match_pages),
                req_slot=al.req_slot,
                cached_pages=list(it.match_pages),
            )
            assert 0 <= al.req_slot < self.max_reqs
            self.live[it.rid] = m
            self._write(slots, list(it.tokens[it.cached_len :]))
        m.seq += 1
        assert al.seq == m.seq
        # Owner plan.
        if batch:
            assert al.page_owners is None and al.fallback_reason == "multi_batch"
        elif plan is None:
            assert al.page_owners is None and al.lane_token_ranges is None
            assert al.fallback_reason is not None
        else:
            assert al.fallback_reason is None
            owners = al.page_owners
            assert owners is not None
            assert np.array_equal(owners, plan.page_owners)
            assert np.array_equal(al.new_pages.astype(np.int64) % cp, owners), (
                al.new_pages,
                owners,
            )
            assert al.lane_token_ranges is not None
            for r, ranges in enumerate(al.lane_token_ranges):
                mine = {i for lo, hi in ranges for i in range(lo, hi)}
                want = {i for i in range(it.extend_len) if owners[i // ps] == r}
                assert mine == want, (r, ranges)

    @rule(data=st.data())
    def extend_new(self, data: st.DataObject) -> None:
        rid = self._fresh_rid(data)
        self._extend([(rid, self._prompt(data, self.room))], data)

    @rule(data=st.data())
    def extend_shared(self, data: st.DataObject) -> None:
        """A new request that is a whole shared prefix plus a short tail (cache hits)."""
        rid = self._fresh_rid(data)
        pre = data.draw(st.sampled_from(self.prefixes), label="prefix")
        tail = data.draw(st.lists(st.integers(0, VOCAB - 1), max_size=3), label="tail")
        toks = (pre + tail)[: self.room] or [0]
        self._extend([(rid, toks)], data)

    @rule(data=st.data())
    def extend_existing(self, data: st.DataObject) -> None:
        rids = [r for r, m in self.live.items() if m.length < self.max_ctx]
        if not rids:
            return
        rid = data.draw(st.sampled_from(rids), label="rid")
        m = self.live[rid]
        self._extend([(rid, self._chunk(data, m, min(self.room, self.max_ctx - m.length)))], data)

    @rule(data=st.data())
    def extend_batch(self, data: st.DataObject) -> None:
        n = data.draw(st.integers(2, 3), label="batch size")
        pairs: list[tuple[Hashable, list[int]]] = []
        existing = [r for r, m in self.live.items() if m.length < self.max_ctx]
        for _ in range(n):
            if existing and data.draw(st.booleans(), label="existing"):
                rid = data.draw(st.sampled_from(existing), label="rid")
                existing.remove(rid)
                m = self.live[rid]
                room = min(self.room, self.max_ctx - m.length)
                pairs.append((rid, self._chunk(data, m, room)))
            else:
                pairs.append((self._fresh_rid(data), self._prompt(data, self.room)))
        self._extend(pairs, data)

    # ---------------------------------------------------------------- decode
    @rule(data=st.data())
    def decode(self, data: st.DataObject) -> None:
        ok = [r for r, m in self.live.items() if m.length < self.max_ctx]
        if not ok:
            return
        rids = data.draw(st.lists(st.sampled_from(ok), min_size=1, unique=True), label="rids")
        with_ids = data.draw(st.booleans(), label="with ids")
        toks = (
            data.draw(st.lists(st.integers(0, VOCAB - 1), min_size=len(rids), max_size=len(rids)))
            if with_ids
            else None
        )
        ps, cp = self.ps, self.cp
        needs = [r for r in rids if self.live[r].length % ps == 0]
        before = self._snapshot()
        b = before.stats
        cap = self._capacity(before, [])
        feasible = int(cap.sum()) >= len(needs)
        try:
            ids = None if toks is None else self._as_input(data, toks)
            slots = self.alloc.allocate_decode(rids, ids)
            self._scribble([ids])
        except KVCapacityWaitError as err:
            self._after_alloc(set(), set())
            event("decode wait")
            assert not feasible, (
                f"decode waited although evicting would do: capacity {cap.tolist()}, "
                f"wanted {err.required_by_owner}"
            )
            self._check_wait(
                err,
                before,
                slots_exhausted=False,
                reason="lane_exhausted",
                num_pages=len(needs),
                plan_required=None,
            )
            self._check_evict_counters(
                before, num_pages=len(needs), plan_required=None, final_deficit=err.deficit_by_owner
            )
            return
        assert feasible, f"decode got {len(needs)} pages beyond capacity {cap.tolist()}"
        a = self.alloc.stats()
        self._after_alloc(
            {int(slots[i]) // ps for i, r in enumerate(rids) if self.live[r].length % ps == 0},
            set(),
        )
        event(f"decode ok, {len(needs)} new pages")
        assert slots.shape == (len(rids),)
        new_pages = []
        for i, rid in enumerate(rids):
            m = self.live[rid]
            s = int(slots[i])
            if m.length % ps:
                assert s == m.slots[-1] + 1, (s, m.slots[-1])
            else:
                assert s % ps == 0 and (s // ps) // cp != 0, s
                new_pages.append(s // ps)
            assert s not in m.slots
            tok = None if toks is None else toks[i]
            m.tokens.append(tok)
            m.slots.append(s)
            m.seq += 1
            self._write([s], [tok])
        assert len(set(slots.tolist())) == len(rids)
        lanes = np.asarray(new_pages, dtype=np.int64) % cp
        self._check_rotation(lanes, before, cap)
        evicted = np.asarray(b["cached"]) - np.asarray(a["cached"])
        assert (evicted >= 0).all()
        got = lane_counts(new_pages, cp)
        assert np.array_equal(np.asarray(a["free"]), np.asarray(b["free"]) + evicted - got)
        assert a["pages_evicted"] - b["pages_evicted"] == int(evicted.sum())
        assert a["decode_allocations"] == b["decode_allocations"] + 1
        assert a["pages_allocated"] == b["pages_allocated"] + len(needs)
        assert a["capacity_waits"] == b["capacity_waits"]
        self._check_evict_counters(
            before, num_pages=len(needs), plan_required=None, final_deficit=None
        )

    # ------------------------------------------------------------------ free
    @rule(data=st.data())
    def free(self, data: st.DataObject) -> None:
        if self.lost and data.draw(st.integers(0, 3), label="free lost") == 0:
            rid = data.draw(st.sampled_from(sorted(self.lost)), label="lost rid")
            before = self._snapshot()
            assert self.alloc.free(rid, cache=data.draw(st.booleans())) == 0
            del self.lost[rid]
            self.dead.append(rid)
            after = self._snapshot()
            want = dict(before.stats)
            want["num_lost_requests"] -= 1
            assert after.stats == want and after.reqs == before.reqs
            return
        if not self.live:
            return
        rid = data.draw(st.sampled_from(list(self.live)), label="rid")
        m = self.live[rid]
        cache = data.draw(st.sampled_from([True, True, True, False]), label="cache")
        # Speculative decoding: sometimes less is committed, inside the cached prefix or
        # a token short of a page boundary.
        cached_len = m.num_cached_pages * self.ps
        committed = data.draw(
            st.none()
            | st.integers(0, m.length)
            | st.integers(0, cached_len)
            | st.integers(1, max(1, m.length // self.ps)).map(
                lambda k: min(m.length, k * self.ps - 1)
            ),
            label="committed_len",
        )
        self._free(rid, cache, committed)

    @rule()
    def finish(self) -> None:
        """The oldest live request completes and its pages go into the prefix cache."""
        if self.live:
            self._free(next(iter(self.live)), True, None)

    def _free(self, rid: Hashable, cache: bool, committed: int | None) -> None:
        m = self.live[rid]
        ps, cp = self.ps, self.cp
        pages = [int(p) for p in self.alloc.request_pages(rid)]
        own = pages[m.num_cached_pages :]
        n_commit = m.length if committed is None else committed
        n_full = min(m.num_hashed_pages(ps), n_commit // ps) if cache and self.cache else 0
        before = self._snapshot()
        b = before.stats
        ret = self.alloc.free(rid, cache=cache, committed_len=committed)
        del self.live[rid]
        self.dead.append(rid)
        a = self.alloc.stats()
        if self.trie is not None:
            toks = [int(t) for t in m.tokens[: n_full * ps]]  # type: ignore[arg-type]
            added = self.trie.insert(self._chunks(toks, n_full), pages[:n_full])
            taken, released = self._drain()
            assert not taken
            assert released == set(own) - set(added), (released, own, added)
            assert (np.asarray(a["cached"]) - b["cached"]).tolist() == lane_counts(
                added, cp
            ).tolist()
        d_free = np.asarray(a["free"]) - np.asarray(b["free"])
        d_cached = np.asarray(a["cached"]) - np.asarray(b["cached"])
        assert (d_free >= 0).all() and (d_cached >= 0).all(), (d_free, d_cached)
        assert np.array_equal(d_free + d_cached, lane_counts(own, cp)), (d_free, d_cached, own)
        keep = max(m.num_cached_pages, n_full)
        assert int(d_free.sum()) >= len(pages) - keep
        assert int(d_cached.sum()) <= max(0, n_full - m.num_cached_pages)
        assert 0 <= ret <= int(d_free.sum())
        if ret != int(d_free.sum()):
            event("free returned duplicate pages")
        if self.CHECK_FREE_COUNT:
            assert ret == int(d_free.sum()), f"free returned {ret}, freed {int(d_free.sum())}"
        for key in ("num_requests",):
            assert a[key] == b[key] - 1
        for key in b:
            if key not in ("free", "used", "cached", "evictable", "num_requests"):
                assert a[key] == b[key], key
        if n_full:
            # The committed full pages are cached now (these or equal ones already there).
            probe = copy.deepcopy(self.alloc)
            toks = [int(t) for t in m.tokens[: n_full * ps]]  # type: ignore[arg-type]
            got = [int(p) for p in probe.match_prefix(toks)]
            assert len(got) == n_full, (got, n_full)
            for i, s in enumerate(expand(got, ps, n_full * ps)):
                assert self.slot_token.get(s) == toks[i]

    # --------------------------------------------------------------- drop lane
    @rule(data=st.data())
    def drop_lane(self, data: st.DataObject) -> None:
        if data.draw(st.integers(0, 5), label="drop lane?") != 0:
            return
        lane = data.draw(st.integers(0, self.cp - 1), label="lane")
        cp = self.cp
        want_lost = set()
        own_lost = np.zeros(cp, dtype=np.int64)
        own_lost_pages: set[int] = set()
        for rid, m in self.live.items():
            pages = [int(p) for p in self.alloc.request_pages(rid)]
            if any(p % cp == lane for p in pages):
                want_lost.add(rid)
                own_lost += lane_counts(pages[m.num_cached_pages :], cp)
                own_lost_pages.update(pages[m.num_cached_pages :])
        before = self._snapshot()
        b = before.stats
        lost = self.alloc.drop_lane(lane)
        event(f"drop_lane lost {min(len(lost), 2)}+ requests")
        assert set(lost) == want_lost and len(lost) == len(want_lost)
        a = self.alloc.stats()
        for rid in lost:
            del self.live[rid]
            self.lost[rid] = lane
        assert a["free"][lane] == self.npl - 1 and a["cached"][lane] == 0
        if self.mirror is not None and self.trie is not None:
            # Every cached page from the first one on the lane down goes, subtrees included.
            on_lane = [p for p in self.trie.pages() if p % cp == lane]
            doomed = set().union(*(self.trie.subtree(p) for p in on_lane))
            taken, released = self._drain()  # the other lanes' releases
            assert not taken
            want = {p for p in own_lost_pages | doomed if p % cp != lane}
            assert released == want, (released, want)
            self.trie.remove(doomed)
            self.mirror[lane] = set(range(1, self.npl))  # the lost lane comes back whole
        for r in range(cp):
            if r != lane:
                moved = (a["free"][r] - b["free"][r]) + (a["cached"][r] - b["cached"][r])
                assert moved == own_lost[r], (r, moved, own_lost)
                assert a["cached"][r] <= b["cached"][r]
        assert a["requests_lost"] == b["requests_lost"] + len(lost)
        assert a["num_lost_requests"] == b["num_lost_requests"] + len(lost)

    # -------------------------------------------------------------- invalid
    @rule(data=st.data())
    def invalid(self, data: st.DataObject) -> None:
        a = self.alloc
        kinds = [
            "extend_empty_new",
            "extend_negative",
            "extend_2d",
            "extend_too_long_new",
            "batch_empty",
            "batch_bad_item",
            "decode_empty",
            "decode_unknown",
            "free_unknown",
            "drop_lane_bad",
            "lane_stats_bad",
        ]
        if self.live:
            kinds += [
                "extend_empty_existing",
                "extend_too_long_existing",
                "batch_repeated",
                "batch_too_long",
                "decode_repeated",
                "decode_wrong_count",
                "decode_negative",
                "free_committed_too_big",
                "free_committed_negative",
                "free_committed_bool",
            ]
            if any(m.length >= self.max_ctx for m in self.live.values()):
                kinds.append("decode_too_long")
        if self.dead:
            kinds += ["decode_freed", "free_double"]
        if self.lost:
            kinds += ["lost_extend", "lost_decode", "lost_batch"]
        kind = data.draw(st.sampled_from(kinds), label="invalid kind")
        event(f"invalid: {kind}")
        live = list(self.live)
        rid = data.draw(st.sampled_from(live), label="rid") if live else None
        unknown = ("never", self.next_rid)
        if kind == "extend_empty_new":
            self._expect_invalid(lambda: a.allocate_extend(unknown, []))
        elif kind == "extend_empty_existing":
            self._expect_invalid(lambda: a.allocate_extend(rid, np.empty(0, np.int64)))
        elif kind == "extend_negative":
            self._expect_invalid(lambda: a.allocate_extend(rid or unknown, [1, -1, 2]))
        elif kind == "extend_2d":
            self._expect_invalid(lambda: a.allocate_extend(unknown, np.zeros((2, 2), np.int64)))
        elif kind == "extend_too_long_new":
            self._expect_invalid(lambda: a.allocate_extend(unknown, [0] * (self.max_ctx + 1)))
        elif kind == "extend_too_long_existing":
            n = self.max_ctx - self.live[rid].length + 1
            self._expect_invalid(lambda: a.allocate_extend(rid, [1] * n))
        elif kind == "batch_empty":
            self._expect_invalid(lambda: a.allocate_extend_batch([]))
        elif kind == "batch_bad_item":
            self._expect_invalid(
                lambda: a.allocate_extend_batch([(unknown, [1, 2]), (("never", -1), [])])
            )
        elif kind == "batch_repeated":
            self._expect_invalid(lambda: a.allocate_extend_batch([(rid, [1]), (rid, [2])]))
        elif kind == "batch_too_long":
            n = self.max_ctx - self.live[rid].length + 1
            self._expect_invalid(lambda: a.allocate_extend_batch([(unknown, [1]), (rid, [0] * n)]))
        elif kind == "decode_empty":
            self._expect_invalid(lambda: a.allocate_decode([]))
        elif kind == "decode_unknown":
            self._expect_invalid(lambda: a.allocate_decode([*live[:1], unknown]))
        elif kind == "decode_freed":
            dead = data.draw(st.sampled_from(self.dead), label="dead rid")
            self._expect_invalid(lambda: a.allocate_decode([dead]))
        elif kind == "decode_repeated":
            self._expect_invalid(lambda: a.allocate_decode([rid, rid]))
        elif kind == "decode_wrong_count":
            self._expect_invalid(lambda: a.allocate_decode([rid], [1, 2]))
        elif kind == "decode_negative":
            self._expect_invalid(lambda: a.allocate_decode([rid], [-3]))
        elif kind == "decode_too_long":
            full = [r for r, m in self.live.items() if m.length >= self.max_ctx]
            self._expect_invalid(lambda: a.allocate_decode(full[:1]))
        elif kind == "free_unknown":
            self._expect_invalid(lambda: a.free(unknown))
        elif kind == "free_double":
            dead = data.draw(st.sampled_from(self.dead), label="dead rid")
            self._expect_invalid(lambda: a.free(dead, cache=True))
        elif kind == "free_committed_too_big":
            n = self.live[rid].length + 1
            self._expect_invalid(lambda: a.free(rid, committed_len=n))
        elif kind == "free_committed_negative":
            self._expect_invalid(lambda: a.free(rid, committed_len=-1))
        elif kind == "free_committed_bool":
            self._expect_invalid(lambda: a.free(rid, committed_len=True))
        elif kind == "drop_lane_bad":
            self._expect_invalid(lambda: a.drop_lane(self.cp))
        elif kind == "lane_stats_bad":
            bad = data.draw(st.sampled_from([-1, self.cp]), label="bad owner")
            self._expect_invalid(lambda: a.lane_stats([0, bad]))
        elif kind.startswith("lost_"):
            lrid = data.draw(st.sampled_from(sorted(self.lost)), label="lost rid")
            calls: dict[str, Callable[[], object]] = {
                "lost_extend": lambda: a.allocate_extend(lrid, [1, 2, 3]),
                "lost_decode": lambda: a.allocate_decode([lrid]),
                "lost_batch": lambda: a.allocate_extend_batch([(unknown, [1]), (lrid, [2])]),
            }
            err = self._expect_invalid(calls[kind], LaneUnavailableError)
            assert isinstance(err, LaneUnavailableError)
            assert err.lane == self.lost[lrid] and lrid in err.rids
            back = pickle.loads(pickle.dumps(err))
            assert type(back) is LaneUnavailableError
            assert (back.lane, back.rids) == (err.lane, err.rids)
        else:  # pragma: no cover
            raise AssertionError(kind)

    def _drain(self) -> tuple[set[int], set[int]]:
        """Apply the page journal to the mirror (releases first, then takes).

        Returns:
            The global pages taken and released since the last drain.
        """
        assert self.mirror is not None
        cp = self.cp
        taken_g: set[int] = set()
        released_g: set[int] = set()
        for r, (taken, released) in enumerate(self.alloc.drain_page_moves()):
            free = self.mirror[r]
            rel, tak = released.tolist(), taken.tolist()
            assert len(set(rel)) == len(rel) and len(set(tak)) == len(tak), (rel, tak)
            assert not free & set(rel), f"lane {r} released free pages {free & set(rel)}"
            free.update(rel)
            assert set(tak) <= free, f"lane {r} took pages not free: {set(tak) - free}"
            free.difference_update(tak)
            assert 0 not in free
            taken_g.update(x * cp + r for x in tak)
            released_g.update(x * cp + r for x in rel)
        return taken_g, released_g

    # ------------------------------------------------------------ invariants
    @invariant()
    def consistent(self) -> None:
        a = self.alloc
        if a is None:
            return
        a.check_invariants()
        assert a.metadata_nbytes() > 0
        ps, cp, npl = self.ps, self.cp, self.npl
        s = a.stats()
        if self.mirror is not None:
            assert self._drain() == (set(), set()), "pages moved outside an allocation or free"
            assert [len(f) for f in self.mirror] == s["free"], (self.mirror, s["free"])
        if self.trie is not None:
            assert lane_counts(self.trie.pages(), cp).tolist() == s["cached"]
            for m in self.live.values():
                n = m.num_cached_pages
                toks = [int(t) for t in m.tokens[: n * ps]]  # type: ignore[arg-type]
                assert self.trie.match(self._chunks(toks, n)) == m.cached_pages
            for rid in self.live:
                for g in a.request_pages(rid).tolist():
                    assert g // cp not in self.mirror[g % cp], f"page {g} of {rid!r} is free"

        free, used = np.asarray(s["free"]), np.asarray(s["used"])
        cached, evictable = np.asarray(s["cached"]), np.asarray(s["evictable"])
        assert np.array_equal(free + used + cached + np.asarray(s["reserved"]), np.full(cp, npl))
        assert s["reserved"] == [1] * cp
        assert (free >= 0).all() and (used >= 0).all() and (cached >= 0).all()
        assert ((evictable >= 0) & (evictable <= cached)).all()
        if not self.cache:
            assert not cached.any()
        assert set(a.request_ids()) == set(self.live)
        assert s["num_requests"] == len(self.live) == a.num_requests
        assert s["num_lost_requests"] == len(self.lost)
        owners: dict[int, list[tuple[Hashable, bool]]] = {}
        own_pages: list[int] = []
        req_slots = set()
        for rid, m in self.live.items():
            assert a.has_request(rid)
            assert a.request_len(rid) == m.length
            assert a.request_seq(rid) == m.seq
            assert a.request_slot(rid) == m.req_slot
            req_slots.add(m.req_slot)
            pages = [int(p) for p in a.request_pages(rid)]
            assert len(pages) == ceil_div(m.length, ps), (rid, pages, m.length)
            assert len(set(pages)) == len(pages)
            assert len(m.slots) == m.length
            assert m.slots == expand(pages, ps, m.length), (rid, m.slots, pages)
            assert pages[: m.num_cached_pages] == m.cached_pages
            assert all(p // cp != 0 for p in pages)
            for i, p in enumerate(pages):
                owners.setdefault(p, []).append((rid, i < m.num_cached_pages))
            own_pages += pages[m.num_cached_pages :]
        assert len(req_slots) == len(self.live)
        for p, users in owners.items():
            if len(users) > 1:
                assert all(c for _, c in users), f"page {p} shared by {users}"
        # Pages held by requests alone (not cached) are exactly the used pages.
        assert np.array_equal(lane_counts(own_pages, cp), used), (own_pages, used)
        # Cached pages in use are exactly the live requests' cached prefixes.
        locked = lane_counts(self._locked_cached_pages(), cp)
        assert (locked <= cached).all()
        assert np.array_equal(evictable, cached - locked), (evictable, cached, locked)

    # -------------------------------------------------------------- teardown
    def teardown(self) -> None:
        a = self.alloc
        if a is None or sys.exc_info()[0] is not None:
            return  # a step failed: hypothesis reports that, the model is stale
        for rid in list(self.live):
            self._free(rid, True, None)
        for rid in list(self.lost):
            assert a.free(rid) == 0
            del self.lost[rid]
        self.consistent()
        s = a.stats()
        free, cached = np.asarray(s["free"]), np.asarray(s["cached"])
        assert s["num_requests"] == 0 and s["num_lost_requests"] == 0
        assert s["used"] == [0] * self.cp
        assert np.array_equal(free + cached, np.full(self.cp, self.npl - 1))
        assert s["evictable"] == s["cached"]
        # Evict everything: ask the core to secure every usable page of every lane.
        # NOTE: _secure is private; no public call asks for a whole pool at once.
        want = np.repeat(np.arange(self.cp, dtype=np.int32), self.npl - 1)
        a._secure(lambda: want, reason="owner_lane_exhausted")
        if self.trie is not None:
            self.trie.remove(self._drain()[1])
            assert not self.trie.pages()
        a.check_invariants()
        t = a.stats()
        assert t["free"] == [self.npl - 1] * self.cp
        assert t["cached"] == [0] * self.cp and t["evictable"] == [0] * self.cp
        assert t["used"] == [0] * self.cp
        assert t["pages_evicted"] == s["pages_evicted"] + int(cached.sum())
        # Nothing is cached any more: a shared-prefix prompt gets no hit.
        prompt = self.prefixes[0][: self.ps + 1]
        al = a.allocate_extend(("teardown",), prompt)
        assert al.cached_len == 0 and al.extend_len == len(prompt)
        if self.mirror is not None:
            assert self._drain() == ({int(p) for p in al.new_pages}, set())
        a.free(("teardown",), cache=False)
        if self.mirror is not None:
            assert self._drain() == (set(), {int(p) for p in al.new_pages})
        a.check_invariants()
        assert a.stats()["free"] == [self.npl - 1] * self.cp
        if self.mirror is not None:
            assert self.mirror == [set(range(1, self.npl))] * self.cp


class RotationBalanceMachine(CoreMachine):
    """A rotation fallback keeps lanes within a page of each other, except lanes whose
    free and evictable pages are all used."""

    CHECK_ROTATION_BALANCE = True


class FreeCountMachine(CoreMachine):
    """``free`` must return the number of pages it gave back to the free pools."""

    CHECK_FREE_COUNT = True


_SETTINGS = settings(
    max_examples=200,
    stateful_step_count=30,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
# NOTE: no shrink phase for the two machines the core fails today: shrinking a 30-step
# failure runs for minutes; the regression tests below are the minimal examples.
# The balance failure needs a rare state: 200 examples find it only now and then.
_NO_SHRINK = settings(_SETTINGS, phases=[Phase.explicit, Phase.reuse, Phase.generate])

TestCoreMachine = CoreMachine.TestCase
TestCoreMachine.settings = _SETTINGS
TestRotationBalance = RotationBalanceMachine.TestCase
TestRotationBalance.settings = _NO_SHRINK
TestFreeCount = FreeCountMachine.TestCase
TestFreeCount.settings = _NO_SHRINK


# ------------------------------------------------------------- regressions
def test_rotation_evicts_on_other_lanes_rather_than_waiting() -> None:
    """A one-page decode evicts a cached page on another lane rather than wait forever.

    Both lanes are full; lane 1's page is cached and unlocked. The rotation starts at
    lane 0 (ties go to the lowest lane), which has nothing evictable; the fallback must
    leave lane 0 out instead of answering the same wait on every retry.
    """
    a = CPAllocator(cp_size=2, page_size=1, num_pages_per_lane=2, max_reqs=4)
    a.allocate_extend("a", [5])  # lane 0's only page
    a.allocate_extend("b", [7])  # lane 1's only page
    a.free("b", cache=True)  # lane 1's page: cached, evictable
    assert a.stats()["evictable"] == [0, 1]
    slots = a.allocate_decode(["a"], [9])
    assert slots.tolist() == [3]  # lane 1's page, evicted and taken again
    a.check_invariants()


def test_rotation_fallback_stays_balanced_when_a_lane_runs_out() -> None:
    """Four pages over free [3, 0, 2]: lane 1 is out, so lanes 0 and 2 take two each.

    The water-fill gives lane 1's share to the first lane in rotation order, which
    already had the extra page: [3, 0, 1], two pages apart although [2, 0, 2] fits.
    """
    a = CPAllocator(cp_size=3, page_size=1, num_pages_per_lane=4, max_reqs=12)
    for i in range(9):
        a.allocate_extend(i, [i])  # request i holds one page, on lane i % 3
    for i in (0, 3, 6, 2, 5):
        a.free(i, cache=False)
    assert a.stats()["free"] == [3, 0, 2] and a.stats()["evictable"] == [0, 0, 0]
    out = a.allocate_extend_batch([("x", [1, 2]), ("y", [3, 4])])
    lanes = np.concatenate([o.new_pages for o in out]) % 3
    assert np.bincount(lanes, minlength=3).tolist() == [2, 0, 2]


def test_free_counts_duplicate_pages_it_returns() -> None:
    """``free`` returns the pages given back, duplicates of cached pages included."""
    a = CPAllocator(cp_size=1, page_size=1, num_pages_per_lane=8, max_reqs=4)
    a.allocate_extend("a", [1, 2, 3])
    a.allocate_extend("b", [1, 2, 3])  # no hit: "a" is not cached yet
    a.free("a", cache=True)
    before = a.stats()["free"][0]
    returned = a.free("b", cache=True)  # all three pages duplicate "a"'s
    assert a.stats()["free"][0] - before == 3
    assert returned == 3
