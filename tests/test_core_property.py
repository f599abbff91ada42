"""Stateful property tests of the decision core and of the coordinator over real lane shards.

``CoreMachine`` drives one :class:`cpkv.CPAllocator` on a tiny pool (1..4 lanes, pages of
1..4 tokens, 4..24 pages a lane, 3..6 request slots) with prompts built from a few shared
prefixes over a 4-token vocabulary, so the prefix cache gets hits, node splits, duplicate
inserts and evictions, and capacity pressure is the rule rather than the exception.
Rules: new and chunked ``allocate_extend``, ``allocate_extend_batch`` of new and existing
requests, ``allocate_decode`` with and without token ids, ``free`` (cached or not, with
``committed_len``), ``drop_lane`` (sometimes followed by ``set_lane_available(lane, False)``
as the coordinator does while the lane restarts) and bringing the lane back, and invalid
calls of every kind. Request ids are ``str`` or ``int`` (numpy ints on the way in),
reused after ``free``; some requests carry a ``cache_salt``.

The model keeps, per live request, its tokens, salt, the slot of every token (from
``out_cache_loc`` and decode returns) and how many leading pages came from the cache;
the token last written to every slot and the salt of the request that last took every
page; and, when the allocator journals its page moves (``record_page_moves``), a mirror
of every lane's free pages and a trie of the prefix cache per salt (evictions are read
from the journal, everything else is predicted). Every item of an extend is predicted on
its own: a zigzag owner plan when it qualifies, else a rotation over what the planned
pages leave, with its own fallback reason. After every step it checks the core's own
invariants, the page accounting per lane, each request's pages against its slots, that
requests share only cached-prefix pages, that cached pages hold the tokens (and salt)
they were matched for, and that the cache holds what the trie says. A
``KVCapacityWaitError`` must leave the state untouched (eviction aside), carry consistent
vectors and the right reason, and be raised exactly when the pages cannot be had, even
after evicting every unlocked cached page.

``CoordinatorMachine`` drives :class:`cpkv.coordinator.coordinator.Coordinator` through its public
calls over :class:`tests.local_lanes.LocalLaneTransport` (real :class:`LaneShard` s that
check every page move's generation and sequence number), with a stepped clock: extends,
batches, decodes and frees over a small pool of request ids reused on purpose, salted
and unsalted shared-prefix prompts, client leases that lapse, lane restarts (detected by
a heartbeat or a client's report), a lane killed and restarted while its recovery
retries, a lane that stays dead, pool resets, retried calls and stale epochs. After every
step: ``check()`` is ok (save the dead lanes), every shard holds exactly the pages the
core has in use or cached and has applied every move sent to it, no move was refused,
the heartbeat saw no mismatch, lane losses grow only on the steps that lose a lane (and
lose exactly the requests with a page there), and the lease table holds what the model
says. No request gets a cached prefix beyond what requests with its own salt cached.

The plain tests at the end are regressions and worked examples, among them the
minimal examples of four bugs these machines found (now fixed).
"""

from __future__ import annotations

import copy
import pickle
import sys
from collections.abc import Callable, Hashable
from concurrent.futures import Future
from dataclasses import dataclass, field

import numpy as np
import pytest
from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from cpkv import (
    CoordinatorUnavailableError,
    CPAllocator,
    CPConfig,
    CPKVError,
    ExtendAllocation,
    InvalidRequestError,
    KVCapacityWaitError,
    KVShape,
    LaneUnavailableError,
    OwnerPlan,
    build_owner_plan,
    in_seq_page_compute_owner_unavailable_reason,
)
from cpkv.coordinator.channel import LaneDeadError
from cpkv.coordinator.coordinator import Coordinator
from cpkv.core.validate import RequestKey, user_rid
from cpkv.errors import LeaseExpiredError, StepFailedError
from tests.local_lanes import LocalLaneTransport

SHARED = "shared"  # the namespace of the coordinator machine's clients
NO_CLIENT = "c-none"
OUTSIDER = "outsider"  # a client of a namespace of its own

VOCAB = 4
# Salts of new requests: "s" and b"s" are different salts.
SALTS: list[str | bytes | None] = [None, None, "s", b"s", "t"]
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
_BAD_RIDS: list[object] = [True, False, None, 1.5, ("t",), b"r"]


@dataclass
class ReqModel:
    """What the test knows about one live request."""

    tokens: list[int | None]  # None: appended by a decode without token ids
    slots: list[int]
    num_cached_pages: int
    req_slot: int
    salt: str | bytes | None = None
    seq: int = 0
    cached_pages: list[int] = field(default_factory=list)

    @property
    def length(self) -> int:
        return len(self.tokens)

    def num_hashed_pages(self, page_size: int) -> int:
        """Leading full pages whose tokens are all known (only those can be cached)."""
        return known_len(self.tokens) // page_size


@dataclass
class Snapshot:
    stats: dict
    reqs: dict[Hashable, tuple[tuple[int, ...], int, int, int]]


@dataclass
class Item:
    """One request of an extend call, as the test predicts it."""

    rid: Hashable
    tokens: list[int]
    salt: str | bytes | None
    prev_len: int
    match_pages: list[int] | None  # None: existing request
    cached_len: int
    extend_len: int
    num_new_pages: int
    plan: OwnerPlan | None
    reason: str | None


class TrieModel:
    """The prefix cache as the test expects it: one node per cached page, keyed by the
    page's tokens under its parent page, one root per salt. Evictions are learnt from
    the page journal (``drain_page_moves``), everything else is predicted."""

    def __init__(self) -> None:
        self.children: dict[object, dict[tuple[int, ...], int]] = {}
        self.parent: dict[int, object] = {}
        self.chunk: dict[int, tuple[int, ...]] = {}

    @staticmethod
    def root(salt: str | bytes | None) -> tuple[str, str | bytes | None]:
        return ("root", salt)

    def pages(self) -> set[int]:
        return set(self.parent)

    def match(self, salt: str | bytes | None, chunks: list[tuple[int, ...]]) -> list[int]:
        out: list[int] = []
        node: object = self.root(salt)
        for c in chunks:
            nxt = self.children.get(node, {}).get(c)
            if nxt is None:
                break
            out.append(nxt)
            node = nxt
        return out

    def insert(
        self, salt: str | bytes | None, chunks: list[tuple[int, ...]], pages: list[int]
    ) -> list[int]:
        """Cache ``pages`` under their chunks; return the pages that went in."""
        node: object = self.root(salt)
        added = []
        for c, p in zip(chunks, pages, strict=True):
            kids = self.children.setdefault(node, {})
            nxt = kids.get(c)
            if nxt is None:
                assert p not in self.parent, f"page {p} cached twice"
                kids[c] = p
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


def known_len(tokens: list[int | None]) -> int:
    """Leading tokens whose ids are known."""
    return tokens.index(None) if None in tokens else len(tokens)


def expand(pages: list[int] | np.ndarray, page_size: int, n: int) -> list[int]:
    """Slots of the first ``n`` tokens held in ``pages``."""
    return [int(p) * page_size + o for p in pages for o in range(page_size)][:n]


def lane_counts(pages: list[int] | set[int] | np.ndarray, cp_size: int) -> np.ndarray:
    arr = np.asarray(sorted(pages) if isinstance(pages, set) else pages, dtype=np.int64)
    return np.bincount(arr % cp_size, minlength=cp_size).astype(np.int64)


def rotation_counts(order: np.ndarray, n: int) -> np.ndarray:
    """Pages per lane of a plain rotation of ``n`` pages over ``order``."""
    counts = np.zeros(order.shape[0], dtype=np.int64)
    np.add.at(counts, np.resize(order, n), 1)
    return counts


def assert_balanced_with_room(counts: np.ndarray, cap: np.ndarray) -> None:
    """Lanes stay within a page of each other, save those that used all they had."""
    room = counts < cap
    assert not room.any() or counts.max() <= counts[room].min() + 1, (
        f"pages per lane {counts.tolist()} with capacity {cap.tolist()}"
    )


def same_salt(a: object, b: object) -> bool:
    return type(a) is type(b) and a == b


def common_pages(a: list[int | None], b: list[int | None], page_size: int, limit: int) -> int:
    """Leading full pages (at most ``limit``) on which two token lists agree and are known."""
    n = 0
    while n < limit and (n + 1) * page_size <= min(len(a), len(b)):
        pa, pb = a[n * page_size : (n + 1) * page_size], b[n * page_size : (n + 1) * page_size]
        if None in pa or pa != pb:
            break
        n += 1
    return n


class CoreMachine(RuleBasedStateMachine):
    """CPAllocator against a model of requests, slots and page contents."""

    def __init__(self) -> None:
        super().__init__()
        self.alloc: CPAllocator | None = None
        self.live: dict[Hashable, ReqModel] = {}
        self.lost: dict[Hashable, int] = {}
        self.dead: list[Hashable] = []
        self.down: set[int] = set()
        self.slot_token: dict[int, int | None] = {}
        self.page_salt: dict[int, str | bytes | None] = {}
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
        hash_key=st.sampled_from([None, bytes(range(32))]),
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
        hash_key: bytes | None,
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
            hash_key=hash_key,
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
        return self.next_rid if data.draw(st.booleans(), label="int rid") else f"r{self.next_rid}"

    @staticmethod
    def _call_rid(data: st.DataObject, rid: Hashable) -> object:
        """The rid as the caller may pass it: an int rid sometimes as a numpy int."""
        if isinstance(rid, int) and data.draw(st.booleans(), label="numpy rid"):
            return np.int64(rid)
        return rid

    def _unknown(self, data: st.DataObject) -> Hashable:
        """A rid nobody used."""
        if data.draw(st.booleans(), label="unknown int"):
            return -1 - self.next_rid
        return f"never-{self.next_rid}"

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

    def _avail(self, stats: dict) -> np.ndarray:
        """Free pages each lane can give: none on a lane that is down."""
        out = np.asarray(stats["free"], dtype=np.int64).copy()
        out[sorted(self.down)] = 0
        return out

    def _locked_cached_pages(self) -> set[int]:
        """Cached pages in use: the union of the live requests' cached prefixes."""
        out: set[int] = set()
        for m in self.live.values():
            out.update(m.cached_pages)
        return out

    def _capacity(self, before: Snapshot, matched: set[int]) -> np.ndarray:
        """Pages each lane can give once everything evictable (and not about to be
        locked by this call's prefix matches) is evicted."""
        newly_locked = matched - self._locked_cached_pages()
        evictable = np.asarray(before.stats["evictable"]) - lane_counts(newly_locked, self.cp)
        return self._avail(before.stats) + evictable

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
        if self.mirror is not None:
            assert self._drain() == (set(), set())
        return info.value

    def _check_wait(
        self,
        err: KVCapacityWaitError,
        before: Snapshot,
        *,
        slots_exhausted: bool,
        any_plan: bool,
        planned: np.ndarray,
        rotated: int,
        cap_rot: np.ndarray,
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
        assert avail == self._avail(a).tolist()
        if slots_exhausted:
            assert err.reason == "request_slots_exhausted", err.reason
            assert req == [0] * cp
            assert a == {**b, "capacity_waits": b["capacity_waits"] + 1}
            return
        assert any(d > 0 for d in deficit), deficit
        if any(deficit[r] for r in self.down):
            want = "lane_unavailable"
        else:
            want = "owner_lane_exhausted" if any_plan else "lane_exhausted"
        assert err.reason == want, (err.reason, want)
        # Plans ask for their pages; the rest is the rotation's last proposal.
        rot = np.asarray(req) - planned
        assert (rot >= 0).all() and int(rot.sum()) == rotated, (req, planned.tolist(), rotated)
        if rotated > int(cap_rot.sum()):  # a plain rotation: it can never fit
            assert rot.max() - rot.min() <= 1, rot
        else:
            assert (rot <= cap_rot).all(), (rot, cap_rot)
            assert_balanced_with_room(rot, cap_rot)

    def _check_rotation(
        self, lanes: np.ndarray, before: Snapshot, cap_rot: np.ndarray, planned: np.ndarray
    ) -> None:
        """Lanes of the pages the rotation drew (items without a plan, in order)."""
        n, cp = lanes.shape[0], self.cp
        counts = np.bincount(lanes, minlength=cp)
        assert (counts <= cap_rot).all(), (counts, cap_rot)
        assert not any(counts[r] for r in self.down), (counts, self.down)
        avail = self._avail(before.stats)
        left = avail - planned
        order = np.argsort(-left, kind="stable")
        if (planned <= avail).all() and (rotation_counts(order, n) <= left).all():
            # Enough free pages: a plain rotation from the lane with most left, no eviction.
            assert np.array_equal(lanes, np.resize(order, n)), (lanes, left)
            assert self.alloc.stats()["evict_calls"] == before.stats["evict_calls"]
        assert_balanced_with_room(counts, cap_rot)

    def _check_evict_counters(
        self,
        before: Snapshot,
        *,
        num_pages: int,
        fixed_required: np.ndarray | None,
        final_deficit: list[int] | None,
    ) -> None:
        """``fixed_required``: the pages per lane when no rotation is involved."""
        b, a = before.stats, self.alloc.stats()
        calls = a["evict_calls"] - b["evict_calls"]
        tokens = a["evict_tokens_requested"] - b["evict_tokens_requested"]
        assert 0 <= calls <= self.max_attempts, calls
        assert tokens % self.ps == 0 and tokens <= calls * num_pages * self.ps, (tokens, calls)
        if fixed_required is None:
            return
        d0 = np.maximum(0, fixed_required - self._avail(b))
        if not d0.any():
            assert calls == 0 and final_deficit is None
        elif any(d0[r] for r in self.down):  # eviction cannot help a lane that is down
            assert calls == 0 and final_deficit is not None
        elif final_deficit is None:
            assert calls == 1, calls
            assert tokens == int(d0.sum()) * self.ps, (tokens, d0)
        else:
            assert calls in (1, 2), calls
            extra = sum(final_deficit) if calls == 2 else 0
            assert tokens == (int(d0.sum()) + extra) * self.ps, (tokens, d0, final_deficit)

    # ---------------------------------------------------------------- extend
    def _items(self, pairs: list[tuple[Hashable, list[int]]], salt: object) -> list[Item]:
        probe = copy.deepcopy(self.alloc)
        ps, cp = self.ps, self.cp
        items = []
        for rid, toks in pairs:
            m = self.live.get(rid)
            if m is None:
                limit = (len(toks) - 1) // ps
                mp = probe.match_prefix(toks[: limit * ps], cache_salt=salt) if limit else []
                match = [int(p) for p in mp] if self.cache else []
                if self.trie is not None:
                    want = self.trie.match(salt, self._chunks(toks, limit))
                    assert match == want, (match, want)
                for p in match:
                    assert same_salt(self.page_salt[p], salt), (p, self.page_salt[p], salt)
                prev, prefix, item_salt = 0, len(match) * ps, salt
                new_pages = ceil_div(len(toks), ps) - len(match)
            else:
                match, prev, item_salt = None, m.length, m.salt
                prefix = prev
                new_pages = ceil_div(prev + len(toks), ps) - ceil_div(prev, ps)
            cached = 0 if m is not None else prefix
            extend_len = len(toks) - cached
            reason = in_seq_page_compute_owner_unavailable_reason(extend_len, prefix, ps, cp)
            plan = build_owner_plan(extend_len, prefix, ps, cp)
            assert (plan is None) == (reason is not None)
            assert plan is None or plan.num_pages == new_pages
            items.append(
                Item(rid, toks, item_salt, prev, match, cached, extend_len, new_pages, plan, reason)
            )
        return items

    def _extend(
        self,
        pairs: list[tuple[Hashable, list[int]]],
        data: st.DataObject,
        salt: str | bytes | None = None,
        *,
        batch_call: bool = False,
    ) -> None:
        batch_call = batch_call or len(pairs) > 1
        inputs = [self._as_input(data, toks) for _, toks in pairs]
        call_pairs = [
            (self._call_rid(data, rid), x) for (rid, _), x in zip(pairs, inputs, strict=True)
        ]
        items = self._items(pairs, salt)
        before = self._snapshot()
        b = before.stats
        cp = self.cp
        num_pages = sum(it.num_new_pages for it in items)
        num_new_reqs = sum(it.match_pages is not None for it in items)
        slots_exhausted = num_new_reqs > self.max_reqs - len(self.live)
        matched = set().union(*(it.match_pages or [] for it in items))
        planned = np.zeros(cp, dtype=np.int64)
        rotated = 0
        for it in items:
            if it.plan is not None:
                planned += it.plan.pages_per_lane.astype(np.int64)
                req, avail, deficit = self.alloc.lane_stats(it.plan.page_owners)
                assert req == it.plan.pages_per_lane.tolist()
                assert avail == self._avail(b).tolist()
                assert deficit == [max(0, r - v) for r, v in zip(req, avail, strict=True)]
            else:
                rotated += it.num_new_pages
        any_plan = any(it.plan is not None for it in items)
        cap = self._capacity(before, matched)
        cap_rot = np.maximum(0, cap - planned)
        # Plans need their own lanes; the rotation leaves out lanes that run out.
        feasible = bool((planned <= cap).all()) and rotated <= int(cap_rot.sum())
        try:
            if batch_call:
                allocs = self.alloc.allocate_extend_batch(call_pairs, cache_salt=salt)
            else:
                allocs = [self.alloc.allocate_extend(*call_pairs[0], cache_salt=salt)]
        except KVCapacityWaitError as err:
            self._scribble(inputs)
            self._after_alloc(set(), matched)
            event(f"extend wait: {err.reason}")
            assert slots_exhausted or not feasible, (
                f"waited although evicting would do: capacity {cap.tolist()}, "
                f"wanted {err.required_by_owner}, reason {err.reason}"
            )
            self._check_wait(
                err,
                before,
                slots_exhausted=slots_exhausted,
                any_plan=any_plan,
                planned=planned,
                rotated=rotated,
                cap_rot=cap_rot,
            )
            if not slots_exhausted:
                self._check_evict_counters(
                    before,
                    num_pages=num_pages,
                    fixed_required=planned if rotated == 0 else None,
                    final_deficit=err.deficit_by_owner,
                )
            return
        assert not slots_exhausted, "a new request got a slot although none was free"
        self._scribble(inputs)
        assert feasible, f"allocated {num_pages} pages beyond capacity {cap.tolist()}"
        self._after_alloc({int(p) for al in allocs for p in al.new_pages}, matched)
        a = self.alloc.stats()
        kinds = sorted({"plan" if it.plan is not None else str(it.reason) for it in items})
        event(f"extend ok ({len(items)}): " + "+".join(kinds))
        if a["evict_calls"] > b["evict_calls"]:
            event("extend ok after eviction")
        if any(it.cached_len for it in items):
            event("extend with cache hit")
        assert len(allocs) == len(items)
        for it, al in zip(items, allocs, strict=True):
            self._check_allocation(it, al)
        new_pages = np.concatenate([al.new_pages for al in allocs])
        assert new_pages.shape[0] == num_pages
        rot_pages = [al.new_pages for it, al in zip(items, allocs, strict=True) if it.plan is None]
        rot_lanes = np.concatenate(rot_pages).astype(np.int64) % cp if rot_pages else np.empty(0)
        self._check_rotation(rot_lanes.astype(np.int64), before, cap_rot, planned)
        evicted = np.asarray(b["cached"]) - np.asarray(a["cached"])
        assert (evicted >= 0).all()
        assert a["pages_evicted"] - b["pages_evicted"] == int(evicted.sum())
        got = lane_counts(new_pages, cp)
        assert np.array_equal(np.asarray(a["free"]), np.asarray(b["free"]) + evicted - got)
        self._check_evict_counters(
            before,
            num_pages=num_pages,
            fixed_required=planned if rotated == 0 else None,
            final_deficit=None,
        )
        # Counters: a fallback is counted per item.
        assert a["extend_allocations"] == b["extend_allocations"] + len(items)
        assert a["pages_allocated"] == b["pages_allocated"] + num_pages
        assert a["capacity_waits"] == b["capacity_waits"]
        assert a["cached_tokens_hit"] == b["cached_tokens_hit"] + sum(it.cached_len for it in items)
        fb = dict(b["fallbacks_by_reason"])
        for it in items:
            if it.reason is not None:
                fb[it.reason] = fb.get(it.reason, 0) + 1
        assert a["fallbacks_by_reason"] == fb
        assert "multi_batch" not in fb

    def _check_allocation(self, it: Item, al: ExtendAllocation) -> None:
        ps, cp = self.ps, self.cp
        assert al.rid == it.rid and type(al.rid) is type(it.rid), (al.rid, it.rid)
        assert al.extend_len == it.extend_len
        assert al.cached_len == it.cached_len
        assert al.num_new_pages == it.num_new_pages
        assert al.page_size == ps and al.cp_size == cp
        slots = al.out_cache_loc.tolist()
        assert len(slots) == it.extend_len
        assert len(set(slots)) == len(slots), slots
        assert all((s // ps) // cp != 0 for s in slots), f"reserved page handed out: {slots}"
        assert all(0 <= s < cp * self.npl * ps for s in slots), slots
        assert not any((s // ps) % cp in self.down for s in slots), "a page from a lane down"
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
                salt=it.salt,
                cached_pages=list(it.match_pages),
            )
            assert 0 <= al.req_slot < self.max_reqs
            self.live[it.rid] = m
            self._write(slots, list(it.tokens[it.cached_len :]))
        for p in al.new_pages.tolist():
            self.page_salt[int(p)] = m.salt
        m.seq += 1
        assert al.seq == m.seq
        # Owner plan, or the fallback and its reason.
        if it.plan is None:
            assert al.page_owners is None and al.lane_token_ranges is None
            assert al.fallback_reason == it.reason, (al.fallback_reason, it.reason)
        else:
            assert al.fallback_reason is None
            owners = al.page_owners
            assert owners is not None
            assert np.array_equal(owners, it.plan.page_owners)
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
        salt = data.draw(st.sampled_from(SALTS), label="salt")
        self._extend([(rid, self._prompt(data, self.room))], data, salt)

    @rule(data=st.data())
    def extend_shared(self, data: st.DataObject) -> None:
        """A new request that is a whole shared prefix plus a short tail (cache hits)."""
        rid = self._fresh_rid(data)
        pre = data.draw(st.sampled_from(self.prefixes), label="prefix")
        tail = data.draw(st.lists(st.integers(0, VOCAB - 1), max_size=3), label="tail")
        toks = (pre + tail)[: self.room] or [0]
        salt = data.draw(st.sampled_from(SALTS), label="salt")
        self._extend([(rid, toks)], data, salt, batch_call=data.draw(st.booleans()))

    @rule(data=st.data())
    def extend_existing(self, data: st.DataObject) -> None:
        rids = [r for r, m in self.live.items() if m.length < self.max_ctx]
        if not rids:
            return
        rid = data.draw(st.sampled_from(rids), label="rid")
        m = self.live[rid]
        salt = data.draw(st.sampled_from([None, m.salt]), label="salt")
        toks = self._chunk(data, m, min(self.room, self.max_ctx - m.length))
        self._extend([(rid, toks)], data, salt)

    @rule(data=st.data())
    def extend_batch(self, data: st.DataObject) -> None:
        n = data.draw(st.integers(2, 4), label="batch size")
        salt = data.draw(st.sampled_from(SALTS), label="batch salt")
        pairs: list[tuple[Hashable, list[int]]] = []
        existing = [
            r
            for r, m in self.live.items()
            if m.length < self.max_ctx and (salt is None or same_salt(m.salt, salt))
        ]
        for _ in range(n):
            if existing and data.draw(st.booleans(), label="existing"):
                rid = data.draw(st.sampled_from(existing), label="rid")
                existing.remove(rid)
                m = self.live[rid]
                room = min(self.room, self.max_ctx - m.length)
                pairs.append((rid, self._chunk(data, m, room)))
            else:
                rid = self._fresh_rid(data)
                size = data.draw(st.sampled_from([self.room, max(1, self.room // n)]))
                pairs.append((rid, self._prompt(data, size)))
        self._extend(pairs, data, salt, batch_call=True)

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
        cap = self._capacity(before, set())
        none = np.zeros(cp, dtype=np.int64)
        feasible = int(cap.sum()) >= len(needs)
        call_rids = [self._call_rid(data, r) for r in rids]
        try:
            ids = None if toks is None else self._as_input(data, toks)
            slots = self.alloc.allocate_decode(call_rids, ids)
            self._scribble([ids])
        except KVCapacityWaitError as err:
            self._after_alloc(set(), set())
            event(f"decode wait: {err.reason}")
            assert not feasible, (
                f"decode waited although evicting would do: capacity {cap.tolist()}, "
                f"wanted {err.required_by_owner}"
            )
            self._check_wait(
                err,
                before,
                slots_exhausted=False,
                any_plan=False,
                planned=none,
                rotated=len(needs),
                cap_rot=cap,
            )
            self._check_evict_counters(
                before,
                num_pages=len(needs),
                fixed_required=None,
                final_deficit=err.deficit_by_owner,
            )
            return
        assert feasible, f"decode got {len(needs)} pages beyond capacity {cap.tolist()}"
        a = self.alloc.stats()
        self._after_alloc(
            {int(slots[i]) // ps for i, r in enumerate(rids) if self.live[r].length % ps == 0},
            set(),
        )
        event(f"decode ok, {min(len(needs), 2)}+ new pages")
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
                self.page_salt[s // ps] = m.salt
            assert s not in m.slots
            tok = None if toks is None else toks[i]
            m.tokens.append(tok)
            m.slots.append(s)
            m.seq += 1
            self._write([s], [tok])
        assert len(set(slots.tolist())) == len(rids)
        lanes = np.asarray(new_pages, dtype=np.int64) % cp
        self._check_rotation(lanes, before, cap, none)
        evicted = np.asarray(b["cached"]) - np.asarray(a["cached"])
        assert (evicted >= 0).all()
        got = lane_counts(new_pages, cp)
        assert np.array_equal(np.asarray(a["free"]), np.asarray(b["free"]) + evicted - got)
        assert a["pages_evicted"] - b["pages_evicted"] == int(evicted.sum())
        assert a["decode_allocations"] == b["decode_allocations"] + 1
        assert a["pages_allocated"] == b["pages_allocated"] + len(needs)
        assert a["capacity_waits"] == b["capacity_waits"]
        self._check_evict_counters(
            before, num_pages=len(needs), fixed_required=None, final_deficit=None
        )

    # ------------------------------------------------------------------ free
    @rule(data=st.data())
    def free(self, data: st.DataObject) -> None:
        if self.lost and data.draw(st.integers(0, 3), label="free lost") == 0:
            rid = data.draw(st.sampled_from(list(self.lost)), label="lost rid")
            before = self._snapshot()
            assert self.alloc.free(self._call_rid(data, rid), cache=data.draw(st.booleans())) == 0
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
        self._free(rid, cache, committed, self._call_rid(data, rid))

    @rule()
    def finish(self) -> None:
        """The oldest live request completes and its pages go into the prefix cache."""
        if self.live:
            self._free(next(iter(self.live)), True, None)

    def _free(
        self, rid: Hashable, cache: bool, committed: int | None, call_rid: object = None
    ) -> None:
        m = self.live[rid]
        ps, cp = self.ps, self.cp
        pages = [int(p) for p in self.alloc.request_pages(rid)]
        own = pages[m.num_cached_pages :]
        n_commit = m.length if committed is None else committed
        n_full = min(m.num_hashed_pages(ps), n_commit // ps) if cache and self.cache else 0
        before = self._snapshot()
        b = before.stats
        ret = self.alloc.free(rid if call_rid is None else call_rid, cache, committed)
        del self.live[rid]
        self.dead.append(rid)
        a = self.alloc.stats()
        if self.trie is not None:
            toks = [int(t) for t in m.tokens[: n_full * ps]]  # type: ignore[arg-type]
            added = self.trie.insert(m.salt, self._chunks(toks, n_full), pages[:n_full])
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
        assert ret == int(d_free.sum()), f"free returned {ret}, freed {int(d_free.sum())}"
        assert a["num_requests"] == b["num_requests"] - 1
        for key in b:
            if key not in ("free", "used", "cached", "evictable", "num_requests"):
                assert a[key] == b[key], key
        if n_full:
            # The committed full pages are cached now (these or equal ones already there),
            # under this request's salt only.
            probe = copy.deepcopy(self.alloc)
            toks = [int(t) for t in m.tokens[: n_full * ps]]  # type: ignore[arg-type]
            got = [int(p) for p in probe.match_prefix(toks, cache_salt=m.salt)]
            assert len(got) == n_full, (got, n_full)
            for i, s in enumerate(expand(got, ps, n_full * ps)):
                assert self.slot_token.get(s) == toks[i]
            for p in got:
                assert same_salt(self.page_salt[p], m.salt)

    # --------------------------------------------------------------- lanes
    @rule(data=st.data())
    def drop_lane(self, data: st.DataObject) -> None:
        if data.draw(st.integers(0, 5), label="drop lane?") != 0:
            return
        lane = data.draw(st.integers(0, self.cp - 1), label="lane")
        cp = self.cp
        want_lost = []
        own_lost = np.zeros(cp, dtype=np.int64)
        own_lost_pages: set[int] = set()
        for rid, m in self.live.items():
            pages = [int(p) for p in self.alloc.request_pages(rid)]
            if any(p % cp == lane for p in pages):
                want_lost.append(rid)
                own_lost += lane_counts(pages[m.num_cached_pages :], cp)
                own_lost_pages.update(pages[m.num_cached_pages :])
        before = self._snapshot()
        b = before.stats
        lost = self.alloc.drop_lane(lane)
        event(f"drop_lane lost {min(len(lost), 2)}+ requests")
        assert lost == want_lost, (lost, want_lost)
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
        if data.draw(st.booleans(), label="lane restarts"):
            # As the coordinator does while the lane restarts: it gives no pages.
            self.alloc.set_lane_available(lane, False)
            self.down.add(lane)
            assert self.alloc.down_lanes == sorted(self.down)

    @rule(data=st.data())
    def lane_back(self, data: st.DataObject) -> None:
        if not self.down:
            return
        lane = data.draw(st.sampled_from(sorted(self.down)), label="lane back")
        before = self._snapshot()
        self.alloc.set_lane_available(lane, True)
        self.down.discard(lane)
        after = self._snapshot()
        assert after.stats == {**before.stats, "down_lanes": sorted(self.down)}
        assert after.reqs == before.reqs

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
            "lane_available_bad",
            "lane_stats_bad",
            "rid_bad_type",
            "salt_bad_type",
        ]
        if self.live:
            kinds += [
                "extend_empty_existing",
                "extend_too_long_existing",
                "extend_salt_mismatch",
                "batch_repeated",
                "batch_too_long",
                "batch_salt_mismatch",
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
        unknown = self._unknown(data)
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
        elif kind in ("extend_salt_mismatch", "batch_salt_mismatch"):
            other = data.draw(
                st.sampled_from([s for s in SALTS[2:] if not same_salt(s, self.live[rid].salt)]),
                label="other salt",
            )
            if kind == "extend_salt_mismatch":
                self._expect_invalid(lambda: a.allocate_extend(rid, [1], cache_salt=other))
            else:
                items = [(unknown, [1, 2]), (rid, [1])]
                self._expect_invalid(lambda: a.allocate_extend_batch(items, cache_salt=other))
        elif kind == "batch_empty":
            self._expect_invalid(lambda: a.allocate_extend_batch([]))
        elif kind == "batch_bad_item":
            self._expect_invalid(
                lambda: a.allocate_extend_batch([(unknown, [1, 2]), (f"{unknown}-2", [])])
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
        elif kind == "lane_available_bad":
            bad = data.draw(st.sampled_from([-1, self.cp, True, 0.0]), label="bad lane")
            self._expect_invalid(lambda: a.set_lane_available(bad, False))
        elif kind == "lane_stats_bad":
            bad = data.draw(st.sampled_from([-1, self.cp]), label="bad owner")
            self._expect_invalid(lambda: a.lane_stats([0, bad]))
        elif kind == "rid_bad_type":
            bad = data.draw(st.sampled_from(_BAD_RIDS), label="bad rid")
            calls: dict[str, Callable[[], object]] = {
                "extend": lambda: a.allocate_extend(bad, [1, 2]),
                "batch": lambda: a.allocate_extend_batch([(unknown, [1]), (bad, [2])]),
                "batch_of_one": lambda: a.allocate_extend_batch([(bad, [2])]),
                "decode": lambda: a.allocate_decode([*live[:1], bad]),
                "free": lambda: a.free(bad),
                "request_len": lambda: a.request_len(bad),
            }
            op = data.draw(st.sampled_from(sorted(calls)), label="op")
            self._expect_invalid(calls[op])
        elif kind == "salt_bad_type":
            bad = data.draw(st.sampled_from([5, 1.5, ("s",), bytearray(b"s")]), label="bad salt")
            calls = {
                "extend": lambda: a.allocate_extend(unknown, [1, 2], cache_salt=bad),
                "batch": lambda: a.allocate_extend_batch(
                    [(unknown, [1]), (f"{unknown}-2", [2])], cache_salt=bad
                ),
                "match": lambda: a.match_prefix([1, 2], cache_salt=bad),
            }
            op = data.draw(st.sampled_from(sorted(calls)), label="op")
            self._expect_invalid(calls[op])
        elif kind.startswith("lost_"):
            lrid = data.draw(st.sampled_from(list(self.lost)), label="lost rid")
            calls = {
                "lost_extend": lambda: a.allocate_extend(lrid, [1, 2, 3]),
                "lost_decode": lambda: a.allocate_decode([lrid]),
                "lost_batch": lambda: a.allocate_extend_batch([(unknown, [1]), (lrid, [2])]),
            }
            err = self._expect_invalid(calls[kind], LaneUnavailableError)
            assert isinstance(err, LaneUnavailableError)
            assert err.lane == self.lost[lrid] and err.rids == [lrid]
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
                assert self.trie.match(m.salt, self._chunks(toks, n)) == m.cached_pages
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
        assert s["down_lanes"] == a.down_lanes == sorted(self.down)
        for r in self.down:  # a lane is put down only right after it was dropped
            assert free[r] == npl - 1 and used[r] == 0 and cached[r] == 0
        assert a.num_available_pages_per_lane().tolist() == self._avail(s).tolist()
        assert a.request_ids() == list(self.live)
        assert s["num_requests"] == len(self.live) == a.num_requests
        assert s["num_lost_requests"] == len(self.lost)
        for lane in range(cp):
            assert a.lost_rids(lane) == [r for r, x in self.lost.items() if x == lane]
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
        for lane in sorted(self.down):
            a.set_lane_available(lane, True)
        self.down.clear()
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
        # NOTE: _capacity is private; no public call asks for a whole pool at once.
        want = np.repeat(np.arange(self.cp, dtype=np.int32), self.npl - 1)
        a._capacity.secure(lambda: want, reason="owner_lane_exhausted")
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
        al = a.allocate_extend("teardown", prompt)
        assert al.cached_len == 0 and al.extend_len == len(prompt)
        if self.mirror is not None:
            assert self._drain() == ({int(p) for p in al.new_pages}, set())
        a.free("teardown", cache=False)
        if self.mirror is not None:
            assert self._drain() == (set(), {int(p) for p in al.new_pages})
        a.check_invariants()
        assert a.stats()["free"] == [self.npl - 1] * self.cp
        if self.mirror is not None:
            assert self.mirror == [set(range(1, self.npl))] * self.cp


# ---------------------------------------------------------------------------
# The coordinator over real lane shards.

C_RIDS: list[Hashable] = ["req-0", "req-1", "req-2", 0, 1, 2]
C_CLIENTS: list[str | None] = [None, "c0", "c1"]
C_SALTS: list[str | bytes | None] = [None, None, "s", b"s"]
_KV = KVShape(num_layers=1, num_heads=1, head_dim=1, dtype="float32")


class RecordingTransport(LocalLaneTransport):
    """Local lanes that remember every page move a shard refused (none ever should be)."""

    def __init__(self, *args) -> None:
        super().__init__(*args)
        self.refused: list[tuple[int, tuple, str]] = []

    def submit(self, lane: int, method: str, *args):
        if method == "step":  # every step here fails: a lane raised mid-step
            status, result = Future(), Future()
            error: Exception = RuntimeError(f"lane {lane} raised mid-step")
            if lane in self.dead:
                error = LaneDeadError(f"lane {lane} is dead")
            else:
                try:  # the page move riding in the call lands first, as on a lane actor
                    self.shards[lane].apply_riding(args[1] if len(args) > 1 else None)
                except Exception as e:
                    self.refused.append((lane, tuple(m[:2] for m in args[1]), repr(e)))
                    error = e
            for f in (status, result):
                f.set_exception(error)
            return status, result
        future = super().submit(lane, method, *args)
        if method == "apply_moves" and future.exception() is not None:
            self.refused.append((lane, tuple(m[:2] for m in args[0]), repr(future.exception())))
        return future


@dataclass
class CReq:
    """A live request as the coordinator test knows it."""

    tokens: list[int | None]
    salt: str | bytes | None
    pages: list[int]


@dataclass
class Lease:
    lease_s: float
    expires_at: float
    rids: set[Hashable] = field(default_factory=set)


@dataclass
class Call:
    """The last client call, to send again with its call id."""

    method: str
    args: tuple
    client: str | None
    call_id: int
    answer: object


class CoordinatorMachine(RuleBasedStateMachine):
    """Coordinator + LocalLaneTransport against a model of requests, lanes and leases."""

    def __init__(self) -> None:
        super().__init__()
        self.coord: Coordinator | None = None
        self.now = 0.0
        self.live: dict[Hashable, CReq] = {}
        self.lost: dict[Hashable, int] = {}
        self.losses: list[list[int]] = []
        self.requests_lost = 0
        self.dead_lanes: set[int] = set()
        self.killed: set[int] = set()
        self.leases: dict[str, Lease] = {}
        self.holders: dict[Hashable, set[str]] = {}  # the leased clients that extended it
        self.lapsed: dict[str, tuple[float, list[Hashable]]] = {}
        self.leases_expired = 0
        self.leases_lapsed = 0
        self.slot_token: dict[int, int | None] = {}
        self.page_salt: dict[int, str | bytes | None] = {}
        # Token runs cached (full pages) per salt since the cache was last empty; the
        # cache holds at most these, exactly these while nothing was evicted or dropped.
        self.cached_runs: list[tuple[str | bytes | None, list[int]]] = []
        self.cache_exact = True
        self.pages_evicted = 0
        self.next_call = 0
        self.last_call: Call | None = None

    # ------------------------------------------------------------------ setup
    @initialize(
        cp=st.integers(1, 3),
        ps=st.integers(1, 3),
        npl=st.integers(4, 12),
        max_reqs=st.integers(3, 6),
        max_ctx=st.sampled_from([24, 64]),
        leases=st.booleans(),
        base=st.lists(st.integers(0, VOCAB - 1), min_size=6, max_size=24),
        branches=st.lists(
            st.tuples(st.integers(0, 24), st.lists(st.integers(0, VOCAB - 1), max_size=12)),
            min_size=1,
            max_size=2,
        ),
    )
    def setup(
        self,
        cp: int,
        ps: int,
        npl: int,
        max_reqs: int,
        max_ctx: int,
        leases: bool,
        base: list[int],
        branches: list[tuple[int, list[int]]],
    ) -> None:
        self.cp, self.ps, self.npl, self.max_ctx = cp, ps, npl, max_ctx
        self.room = min(max_ctx, max(2, 2 * cp * (npl - 1) * ps // 3))
        self.prefixes = [base] + [base[: min(cut, len(base))] + tail for cut, tail in branches]
        config = CPConfig(cp, ps, npl, max_reqs=max_reqs, max_context_len=max_ctx)
        self.transport = RecordingTransport(cp, npl, ps, _KV)
        self.coord = Coordinator(
            config,
            _KV,
            self.transport,
            heartbeat_s=0,
            lane_restart_timeout_s=5,
            clock=lambda: self.now,
        )
        self.epoch = self.coord.hello()["epoch"]
        # The machine's clients share one namespace (the model keeps one table of rids);
        # "no client" calls come from a third member without a lease.
        for client in ("c0", "c1", NO_CLIENT):
            self.coord.hello(client, None, SHARED)
        self.coord._ensure_group = lambda: "g"  # steps need no real lane group here
        self.coord._group_is_current = lambda group: True
        assert self.coord.lane_states() == ["up"] * cp
        if leases:  # both clients hold leases from the start
            self.hello("c0", 1.0)
            self.hello("c1", 2.5)

    def teardown(self) -> None:
        if self.coord is not None:
            self.coord.wait_recovered(5)
            self.coord.shutdown()

    # ---------------------------------------------------------------- helpers
    def _prompt(self, data: st.DataObject, whole: bool = False) -> list[int]:
        """A cut of a shared prefix (``whole``: all of it) plus a short random tail."""
        pre = data.draw(st.sampled_from(self.prefixes), label="prefix")
        cut = len(pre) if whole else data.draw(st.integers(0, len(pre)), label="cut")
        tail = data.draw(st.lists(st.integers(0, VOCAB - 1), max_size=8), label="tail")
        room = data.draw(st.sampled_from([self.room, max(1, self.room // 2)]), label="room")
        toks = (pre[:cut] + tail)[:room]
        return toks or [data.draw(st.integers(0, VOCAB - 1), label="one token")]

    def _chunk(self, data: st.DataObject, m: CReq) -> list[int]:
        """Next prefill chunk, sometimes one token too many for max_context_len."""
        room = max(1, min(self.room, self.max_ctx - len(m.tokens)))
        n = data.draw(st.integers(1, min(room, 12)), label="chunk len")
        if None not in m.tokens:
            for pre in self.prefixes:
                if len(pre) > len(m.tokens) and pre[: len(m.tokens)] == m.tokens:
                    return pre[len(m.tokens) : len(m.tokens) + n]
        return data.draw(st.lists(st.integers(0, VOCAB - 1), min_size=n, max_size=n))

    def _call(self, method: str, client: str | None, *args) -> object:
        self.next_call += 1
        who = NO_CLIENT if client is None else client
        answer = getattr(self.coord, method)(self.epoch, who, self.next_call, *args)
        self.last_call = Call(method, args, who, self.next_call, answer)
        event(f"{method} -> {type(answer).__name__}")
        return answer

    def _lapse_notice(self, client: str | None) -> list[Hashable] | None:
        """What a client call does to the leases first: renew, or reopen a lapsed one."""
        if client is None:
            return None
        # NOTE: a remembered lapse is told first, even when the lease was opened again
        # meanwhile (the client's renewer says hello before its next call: issue 19.6).
        if client in self.lapsed:
            lease_s, rids = self.lapsed.pop(client)
            if client not in self.leases:
                self.leases[client] = Lease(lease_s, self.now + lease_s)
            return rids
        lease = self.leases.get(client)
        if lease is not None:
            lease.expires_at = self.now + lease.lease_s
        return None

    def _expect_lapsed(self, answer: object, rids: list[Hashable]) -> None:
        event("call after a lapsed lease")
        assert isinstance(answer, LeaseExpiredError), answer
        assert answer.rids == rids

    def _hold(self, client: str | None, rid: Hashable) -> None:
        if client is None or client not in self.leases:
            return
        self.holders.setdefault(rid, set()).add(client)
        self.leases[client].rids.add(rid)

    def _release(self, rid: Hashable) -> None:
        for client in self.holders.pop(rid, ()):
            self.leases[client].rids.discard(rid)

    def _end_lease(self, client: str) -> list[Hashable]:
        """``client``'s lease is gone: the requests no other lease holds, freed."""
        lease = self.leases.pop(client)
        freed = []
        for rid in sorted(lease.rids, key=repr):
            self.holders[rid].discard(client)
            if not self.holders[rid]:
                del self.holders[rid]
                self._drop(rid)
                freed.append(rid)
            else:
                event("a lapse leaves a request another lease holds")
        return freed

    def _cached_bound(self, salt: object, toks: list[int], limit: int) -> int:
        """Most leading pages of ``toks`` the cache can hold under ``salt``."""
        best = 0
        for run_salt, run in self.cached_runs:
            if same_salt(run_salt, salt):
                best = max(best, common_pages(run, list(toks), self.ps, limit))
        return best

    def _check_new_prefix(self, al: ExtendAllocation, toks: list[int], salt: object) -> None:
        """A new request's cached prefix: its own salt's pages, holding its tokens."""
        ps = self.ps
        limit = (len(toks) - 1) // ps
        bound = self._cached_bound(salt, toks, limit)
        assert al.cached_len % ps == 0 and al.cached_len <= limit * ps
        assert al.cached_len <= bound * ps, (
            f"cached_len {al.cached_len} but requests with salt {salt!r} cached only "
            f"{bound} pages of this prompt"
        )
        if self.cache_exact:
            assert al.cached_len == bound * ps, (al.cached_len, bound)
        if al.cached_len:
            event("coordinator cache hit" + (" (salted)" if salt is not None else ""))
        for p in al.cached_pages.tolist():
            assert same_salt(self.page_salt.get(p, "?"), salt), (p, self.page_salt.get(p), salt)
        for i, s in enumerate(al.cached_slots.tolist()):
            assert self.slot_token.get(s) == toks[i], (s, self.slot_token.get(s), toks[i])

    def _take(self, m: CReq, pages: list[int], slots: list[int], toks: list) -> None:
        for p in pages:
            assert p % self.cp not in self.dead_lanes, f"page {p} from dead lane"
            self.page_salt[p] = m.salt
        m.pages += pages
        for s, t in zip(slots, toks, strict=True):
            self.slot_token[s] = t

    def _apply_extend(
        self, rid: Hashable, al: object, toks: list[int], salt: object, client: str | None
    ) -> None:
        assert isinstance(al, ExtendAllocation), al
        assert al.rid == rid and type(al.rid) is type(rid)
        m = self.live.get(rid)
        if m is None:
            self._check_new_prefix(al, toks, salt)
            m = CReq(list(toks[: al.cached_len]), salt, al.cached_pages.tolist())
            self.live[rid] = m
            toks = toks[al.cached_len :]
        else:
            assert al.cached_len == 0 and al.prefix_len == len(m.tokens)
        assert al.extend_len == len(toks)
        self._take(m, al.new_pages.tolist(), al.out_cache_loc.tolist(), list(toks))
        m.tokens += toks
        assert len(m.pages) == ceil_div(len(m.tokens), self.ps)
        self._hold(client, rid)

    def _extend_invalid(self, m: CReq | None, toks: list[int], salt: object) -> bool:
        """A salt other than the request's, or too many tokens."""
        if m is not None and salt is not None and not same_salt(salt, m.salt):
            return True
        return (len(m.tokens) if m else 0) + len(toks) > self.max_ctx

    def _check_wait(self, answer: object) -> None:
        assert isinstance(answer, KVCapacityWaitError), answer
        event(f"coordinator wait: {answer.reason}")
        if answer.reason == "lane_unavailable":
            assert any(answer.deficit_by_owner[r] for r in self.dead_lanes), answer
        else:
            assert answer.reason in (
                "owner_lane_exhausted",
                "lane_exhausted",
                "request_slots_exhausted",
            ), answer.reason

    def _drop(self, rid: Hashable) -> None:
        """``rid`` was freed with cache=False (or its loss acknowledged)."""
        self._release(rid)
        if self.lost.pop(rid, None) is None:
            del self.live[rid]

    def _lose_lane(self, lane: int) -> None:
        """What a lane loss does: the requests with a page there are lost."""
        lost = [r for r, m in self.live.items() if any(p % self.cp == lane for p in m.pages)]
        for rid in lost:
            del self.live[rid]
            self.lost[rid] = lane
        self.losses.append([lane, len(lost)])
        self.requests_lost += len(lost)
        self.cache_exact = False
        event(f"lane lost with {min(len(lost), 2)}+ requests")

    # ------------------------------------------------------------------ calls
    @rule(data=st.data())
    def extend(self, data: st.DataObject) -> None:
        self._extend(data, whole=False)

    @rule(data=st.data())
    def extend_shared(self, data: st.DataObject) -> None:
        """A new request (if the rid is free) on a whole shared prefix: cache hits."""
        self._extend(data, whole=True)

    def _extend(self, data: st.DataObject, *, whole: bool) -> None:
        rid = data.draw(st.sampled_from(C_RIDS), label="rid")
        client = data.draw(st.sampled_from(C_CLIENTS), label="client")
        m = self.live.get(rid)
        if m is not None:
            toks = self._chunk(data, m)
            salts = [None, m.salt, m.salt] + [s for s in C_SALTS if not same_salt(s, m.salt)]
            salt = data.draw(st.sampled_from(salts), label="salt")
        else:
            toks = self._prompt(data, whole)
            salt = data.draw(st.sampled_from(C_SALTS), label="salt")
        answer = self._call("allocate_extend", client, rid, toks, salt)
        notice = self._lapse_notice(client)
        if notice is not None:
            self._expect_lapsed(answer, notice)
        elif rid in self.lost:
            assert isinstance(answer, LaneUnavailableError), answer
            assert (answer.lane, answer.rids) == (self.lost[rid], [rid])
        elif self._extend_invalid(m, toks, salt):
            assert isinstance(answer, InvalidRequestError), answer
        elif isinstance(answer, CPKVError):
            self._check_wait(answer)
        else:
            self._apply_extend(rid, answer, toks, salt, client)

    @rule(data=st.data())
    def extend_batch(self, data: st.DataObject) -> None:
        rids = data.draw(
            st.lists(st.sampled_from(C_RIDS), min_size=2, max_size=3, unique=True), label="rids"
        )
        client = data.draw(st.sampled_from(C_CLIENTS), label="client")
        salt = data.draw(st.sampled_from(C_SALTS), label="batch salt")
        items = [
            (rid, self._chunk(data, self.live[rid]) if rid in self.live else self._prompt(data))
            for rid in rids
        ]
        answer = self._call("allocate_extend_batch", client, items, salt)
        notice = self._lapse_notice(client)
        if notice is not None:
            self._expect_lapsed(answer, notice)
            return
        for rid, toks in items:  # lost or too long, in item order
            if rid in self.lost:
                assert isinstance(answer, LaneUnavailableError), answer
                assert (answer.lane, answer.rids) == (self.lost[rid], [rid])
                return
            m = self.live.get(rid)
            if (len(m.tokens) if m else 0) + len(toks) > self.max_ctx:
                assert isinstance(answer, InvalidRequestError), answer
                return
        if salt is not None and any(
            rid in self.live and not same_salt(self.live[rid].salt, salt) for rid in rids
        ):
            assert isinstance(answer, InvalidRequestError), answer
            return
        if isinstance(answer, CPKVError):
            self._check_wait(answer)
            return
        assert isinstance(answer, list) and len(answer) == len(items)
        event("coordinator batch ok")
        for (rid, toks), al in zip(items, answer, strict=True):
            self._apply_extend(rid, al, toks, salt, client)

    @rule(data=st.data())
    def decode(self, data: st.DataObject) -> None:
        live = self.live and data.draw(st.integers(0, 3), label="live only") > 0
        pool = list(self.live) if live else C_RIDS
        rids = data.draw(
            st.lists(st.sampled_from(pool), min_size=1, max_size=3, unique=True), label="rids"
        )
        client = data.draw(st.sampled_from(C_CLIENTS), label="client")
        toks = (
            data.draw(st.lists(st.integers(0, VOCAB - 1), min_size=len(rids), max_size=len(rids)))
            if data.draw(st.booleans(), label="with ids")
            else None
        )
        answer = self._call("allocate_decode", client, rids, toks)
        notice = self._lapse_notice(client)
        if notice is not None:
            self._expect_lapsed(answer, notice)
            return
        lost = [r for r in rids if r in self.lost]
        if lost:
            assert isinstance(answer, LaneUnavailableError), answer
            assert (answer.lane, answer.rids) == (self.lost[lost[0]], [lost[0]])
            return
        if any(r not in self.live for r in rids) or any(
            len(self.live[r].tokens) >= self.max_ctx for r in rids
        ):
            assert isinstance(answer, InvalidRequestError), answer
            return
        if isinstance(answer, CPKVError):
            self._check_wait(answer)
            return
        assert isinstance(answer, np.ndarray) and answer.shape == (len(rids),), answer
        ps = self.ps
        for i, rid in enumerate(rids):
            self._hold(client, rid)  # a client that carries a request on holds it
            m = self.live[rid]
            s = int(answer[i])
            tok = None if toks is None else toks[i]
            if len(m.tokens) % ps:
                assert s == m.pages[-1] * ps + len(m.tokens) % ps, (s, m.pages)
                self._take(m, [], [s], [tok])
            else:
                assert s % ps == 0
                self._take(m, [s // ps], [s], [tok])
            m.tokens.append(tok)

    @rule(data=st.data())
    def free(self, data: st.DataObject) -> None:
        live = self.live and data.draw(st.integers(0, 3), label="live only") > 0
        pool = list(self.live) if live else C_RIDS
        rid = data.draw(st.sampled_from(pool), label="rid")
        client = data.draw(st.sampled_from(C_CLIENTS), label="client")
        cache = data.draw(st.sampled_from([True, True, False]), label="cache")
        m = self.live.get(rid)
        committed = None
        if m is not None and data.draw(st.booleans(), label="committed"):
            committed = data.draw(st.integers(0, len(m.tokens)), label="committed_len")
        before = self.coord.stats()
        answer = self._call("free", client, rid, cache, committed)
        notice = self._lapse_notice(client)
        if notice is not None:
            self._expect_lapsed(answer, notice)
            return
        if rid in self.lost:
            assert answer == 0, answer
            self._drop(rid)
            return
        if m is None:
            assert isinstance(answer, InvalidRequestError), answer
            return
        self._check_free(rid, m, answer, before, cache, committed)

    def _check_free(
        self,
        rid: Hashable,
        m: CReq,
        answer: object,
        before: dict,
        cache: bool,
        committed: int | None,
    ) -> None:
        after = self.coord.stats()
        freed = int(np.sum(np.asarray(after["free"]) - np.asarray(before["free"])))
        assert answer == freed, (answer, freed)
        self._release(rid)
        del self.live[rid]
        n_commit = len(m.tokens) if committed is None else committed
        n_full = min(known_len(m.tokens), n_commit) // self.ps if cache else 0
        if n_full:
            run = [int(t) for t in m.tokens[: n_full * self.ps]]  # type: ignore[arg-type]
            self.cached_runs.append((m.salt, run))
            # Cached under this salt; under another, no more than that salt cached.
            core = self.coord._core
            assert core.match_prefix(run, cache_salt=m.salt).shape[0] == n_full
            for other in ("s", b"s", None, "other"):
                got = core.match_prefix(run, cache_salt=other).shape[0]
                assert got <= self._cached_bound(other, run, n_full), (other, got)
            event("coordinator cached free")

    @rule()
    def finish(self) -> None:
        """The oldest live request completes, its pages cached (no client: no lease)."""
        if not self.live:
            return
        rid = next(iter(self.live))
        m = self.live[rid]
        before = self.coord.stats()
        answer = self._call("free", None, rid, True, None)
        self._check_free(rid, m, answer, before, True, None)

    # ----------------------------------------------------------------- leases
    @rule(data=st.data())
    def leases(self, data: st.DataObject) -> None:
        op = data.draw(st.sampled_from(["hello", "hello", "renew", "close"]), label="lease op")
        client = data.draw(st.sampled_from(["c0", "c1", "c2"]), label="lease client")
        if op == "hello":
            self.hello(client, data.draw(st.sampled_from([1.0, 2.5, None]), label="lease_s"))
        elif op == "renew":
            self.renew(client)
        else:
            self.close_lease(client)

    def hello(self, client: str, lease_s: float | None) -> None:
        info = self.coord.hello(client, lease_s, SHARED)
        assert info["epoch"] == self.epoch and info["config"] == self.coord.config
        if lease_s is None:
            return
        lease = self.leases.get(client)
        if lease is None:
            self.leases[client] = Lease(lease_s, self.now + lease_s)
        else:
            lease.lease_s, lease.expires_at = lease_s, self.now + lease_s

    def renew(self, client: str) -> None:
        lease = self.leases.get(client)
        assert self.coord.renew_lease(client) == (lease is not None)
        if lease is not None:
            lease.expires_at = self.now + lease.lease_s

    @rule(dt=st.sampled_from([0.5, 1.0, 2.0]))
    def tick(self, dt: float) -> None:
        """Time passes; the coordinator frees the requests of lapsed leases."""
        self.now += dt
        freed = 0
        for client in [c for c, lease in self.leases.items() if lease.expires_at <= self.now]:
            lease_s = self.leases[client].lease_s
            rids = self._end_lease(client)
            # A lapse not yet told (no call since) is told with this one: both lists.
            told_later = self.lapsed.pop(client, (0.0, []))[1]
            self.lapsed[client] = (lease_s, told_later + rids)
            self.leases_lapsed += 1
            freed += len(rids)
        self.leases_expired += freed
        assert self.coord.expire_leases() == freed
        if freed:
            event("lease expiry freed requests")

    def close_lease(self, client: str) -> None:
        rids = self._end_lease(client) if client in self.leases else []
        assert self.coord.close_lease(client) == len(rids)

    # ------------------------------------------------------------ lanes, pool
    @rule(data=st.data())
    def lanes_and_pool(self, data: st.DataObject) -> None:
        op = data.draw(
            st.sampled_from(["heartbeat", "restart", "restart", "report_healthy", "kill", "reset"]),
            label="lane op",
        )
        if op == "heartbeat":
            self.coord.heartbeat_once()
        elif op == "restart":
            self.restart_lane(data)
        elif op == "report_healthy":
            self.report_healthy_lane(data)
        elif op == "kill":
            self.kill_lane(data)
        elif data.draw(st.booleans(), label="reset?"):
            self.reset_pool()

    def restart_lane(self, data: st.DataObject) -> None:
        """A lane's actor restarts (a new incarnation); the coordinator notices."""
        up = [r for r in range(self.cp) if r not in self.dead_lanes]
        if not up:
            return
        lane = data.draw(st.sampled_from(up), label="lane")
        how = data.draw(st.sampled_from(["restart", "kill_restart", "report"]), label="how")
        event(f"lane restart: {how}")
        reported = None
        if how == "restart":
            self.transport.restart(lane)
            self.coord.heartbeat_once()
        elif how == "kill_restart":
            # Dead at the heartbeat, back while the recovery still retries.
            self.transport.kill(lane)
            self.coord.heartbeat_once()
            self.transport.restart(lane)
        else:
            self.transport.restart(lane)
            reported = self.coord.report_lane_failure(
                self.epoch, lane, "seen by a client", NO_CLIENT
            )
        assert self.coord.wait_recovered(5)
        self._lose_lane(lane)
        if reported is not None:
            assert reported == [r for r, x in self.lost.items() if x == lane], reported
        state = self.coord.lane_states()[lane]
        if state == "dead":  # the recovery gave up before the restart (a slow machine)
            assert how == "kill_restart"
            event("lane recovery gave up")
            self.dead_lanes.add(lane)
        else:
            assert state == "up", state

    def report_healthy_lane(self, data: st.DataObject) -> None:
        lane = data.draw(st.integers(0, self.cp - 1), label="lane")
        got = self.coord.report_lane_failure(self.epoch, lane, "", NO_CLIENT)
        assert got == [r for r, x in self.lost.items() if x == lane], got

    def kill_lane(self, data: st.DataObject) -> None:
        """A lane dies for good: the recovery gives up (about 0.2 s), the lane stays dead."""
        up = [r for r in range(self.cp) if r not in self.dead_lanes]
        if not up or not data.draw(st.booleans(), label="kill?"):
            return
        lane = data.draw(st.sampled_from(up), label="lane")
        self.transport.kill(lane)
        self.killed.add(lane)
        self.coord.heartbeat_once()
        assert self.coord.wait_recovered(5)
        assert self.coord.lane_states()[lane] == "dead"
        self._lose_lane(lane)
        self.dead_lanes.add(lane)
        event("lane dead")

    def reset_pool(self) -> None:
        for lane in sorted(self.killed):
            self.transport.restart(lane)
        self.killed.clear()
        self.coord.reset()
        assert self.coord.lane_states() == ["up"] * self.cp
        self.live.clear()
        self.lost.clear()
        self.losses.clear()
        self.dead_lanes.clear()
        self.holders.clear()
        for lease in self.leases.values():
            lease.rids.clear()
        self.requests_lost = 0
        self.pages_evicted = 0
        self.cached_runs.clear()
        self.cache_exact = True
        self.last_call = None

    @rule(data=st.data())
    def failed_step(self, data: st.DataObject) -> None:
        """A prefill step fails on the lanes after its pages were decided: later calls on the
        request say so, and its free caches only what was written before (its cache hit),
        however ``cache=True`` (issue 19.1)."""
        fresh = [r for r in C_RIDS if r not in self.live and r not in self.lost]
        if not fresh:
            return
        rid = data.draw(st.sampled_from(fresh), label="rid")
        client = data.draw(st.sampled_from(C_CLIENTS), label="client")
        toks = self._prompt(data, whole=data.draw(st.booleans(), label="whole"))
        if self._extend_invalid(None, toks, None):
            return
        answer = self._call("prefill", client, rid, np.asarray(toks), None, "auto", None)
        notice = self._lapse_notice(client)
        if notice is not None:
            self._expect_lapsed(answer, notice)
            return
        if isinstance(answer, KVCapacityWaitError):
            self._check_wait(answer)
            return
        assert isinstance(answer, dict), answer
        al = answer["allocations"][0]
        self._apply_extend(rid, al, toks, None, client)
        again = self._call("allocate_decode", client, [rid], None)
        self._lapse_notice(client)
        assert isinstance(again, StepFailedError) and again.rid == rid, again
        event("failed step refused later calls")
        before = self.coord.stats()
        freed = self._call("free", client, rid, True, None)
        self._lapse_notice(client)
        self._check_free(rid, self.live[rid], freed, before, True, al.cached_len)

    @rule(data=st.data())
    def outsider(self, data: st.DataObject) -> None:
        """Another namespace never reaches the machine's requests, and a call id sent again
        with other arguments is refused: nothing changes either way (issue 19.3, 19.4)."""
        before = self.coord.stats()
        rid = data.draw(st.sampled_from(C_RIDS), label="rid")
        op = data.draw(st.sampled_from(["free", "decode", "retry_other"]), label="outsider op")
        if op == "free":
            answer = self.coord.free(self.epoch, OUTSIDER, None, rid, True, None)
        elif op == "decode":
            answer = self.coord.allocate_decode(self.epoch, OUTSIDER, None, [rid], None)
        else:
            c = self.last_call
            if c is None or c.method == "free":
                return
            answer = getattr(self.coord, c.method)(self.epoch, c.client, c.call_id, *c.args[:-1])
            if c.answer is answer:  # the arguments happened to digest alike: a true repeat
                return
        assert isinstance(answer, InvalidRequestError), answer
        event(f"outsider {op} refused")
        after = self.coord.stats()
        for key in ("num_requests", "used", "free", "cached", "extend_allocations"):
            assert after[key] == before[key], key

    @rule(data=st.data())
    def stale_or_retried_call(self, data: st.DataObject) -> None:
        if data.draw(st.booleans(), label="retry"):
            self.retry()
        else:
            self.stale_epoch(data)

    def stale_epoch(self, data: st.DataObject) -> None:
        """Calls of a coordinator's former life are refused; nothing changes."""
        client = data.draw(st.sampled_from(C_CLIENTS), label="client")
        rid = data.draw(st.sampled_from(C_RIDS), label="rid")
        answers = [
            self.coord.allocate_extend("stale", client, None, rid, [1]),
            self.coord.allocate_decode("stale", client, None, [rid], None),
            self.coord.free("stale", client, None, rid),
            self.coord.report_lane_failure("stale", 0),
        ]
        for answer in answers:
            assert isinstance(answer, CoordinatorUnavailableError), answer

    def retry(self) -> None:
        """A call sent again with its call id gets the first answer and changes nothing."""
        c = self.last_call
        if c is None:
            return
        again = getattr(self.coord, c.method)(self.epoch, c.client, c.call_id, *c.args)
        assert again is c.answer

    # ------------------------------------------------------------ invariants
    @invariant()
    def lanes_match_core(self) -> None:
        coord = self.coord
        if coord is None:
            return
        cp, npl = self.cp, self.npl
        coord.heartbeat_once()  # no lane restarted or disagrees with the core: no loss
        report = coord.check()  # waits for heartbeats ordered after every move
        dead = sorted(self.dead_lanes)
        assert report["problems"] == [f"lane {r}: dead" for r in dead], report
        assert report["ok"] == (not dead)
        s = coord.stats()
        assert s["mirror_mismatches"] == 0
        assert s["lane_losses"] == self.losses, (s["lane_losses"], self.losses)
        assert s["requests_lost"] == self.requests_lost
        assert s["dead_lanes"] == dead and s["down_lanes"] == dead
        assert s["restarting_lanes"] == []
        assert s["pending_lane_calls"] == 0
        assert self.transport.refused == [], self.transport.refused
        # Requests.
        core = coord._core
        assert [user_rid(k) for k in core.request_ids()] == list(self.live)
        assert s["num_requests"] == len(self.live)
        assert s["num_lost_requests"] == len(self.lost)
        for lane in range(cp):
            got = [user_rid(k) for k in core.lost_rids(lane)]
            assert got == [r for r, x in self.lost.items() if x == lane]
        in_use: set[int] = set()
        for rid, m in self.live.items():
            key = RequestKey(SHARED, rid)
            assert core.request_pages(key).tolist() == m.pages, (rid, m.pages)
            assert core.request_len(key) == len(m.tokens)
            in_use.update(m.pages)
        cached = {int(p) for p in core._cache.all_pages()}
        assert lane_counts(cached, cp).tolist() == s["cached"]
        if s["pages_evicted"] != self.pages_evicted:
            self.pages_evicted = s["pages_evicted"]
            self.cache_exact = False
            event("coordinator eviction")
        if not cached:
            self.cached_runs.clear()
            self.cache_exact = True
        # Every serving shard holds exactly the pages in use or cached on its lane, and
        # has applied every move of its generation.
        channel = coord._channel
        for r in range(cp):
            want = {p // cp for p in in_use | cached if p % cp == r}
            assert want == set(range(1, npl)) - set(core._pools[r].free_pages_view().tolist())
            if r in self.dead_lanes:
                assert not want and s["free"][r] == npl - 1
                continue
            shard = self.transport.shards[r]
            assert shard.generation == channel.generation(r)
            assert shard.last_seq == channel._next_seq[r] - 1
            held = set(np.flatnonzero(shard._held).tolist())
            assert held == want, (r, sorted(held), sorted(want))
            assert report["held"][r] == len(want)
        # Leases.
        assert s["num_leases"] == len(self.leases)
        assert s["leases_expired"] == self.leases_expired
        assert s["leases_lapsed"] == self.leases_lapsed
        table = coord._leases
        for client, lease in self.leases.items():
            got = table._leases[client]
            assert (got.lease_s, got.expires_at, {user_rid(k) for k in got.rids}) == (
                lease.lease_s,
                lease.expires_at,
                lease.rids,
            )
        for rid in C_RIDS:
            assert table.holders(RequestKey(SHARED, rid)) == self.holders.get(rid, set()), rid


_SETTINGS = settings(
    max_examples=250,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
_COORD_SETTINGS = settings(
    max_examples=150,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)

TestCoreMachine = CoreMachine.TestCase
TestCoreMachine.settings = _SETTINGS
TestCoordinatorMachine = CoordinatorMachine.TestCase
TestCoordinatorMachine.settings = _COORD_SETTINGS


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
    """Four pages over free [3, 0, 2]: lane 1 is out, so lanes 0 and 2 take two each."""
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


def test_batch_plans_each_item_and_rotates_the_rest() -> None:
    """A batch item long enough gets its own zigzag plan; a short one draws in rotation
    over what the plan leaves, with its own reason."""
    a = CPAllocator(cp_size=2, page_size=1, num_pages_per_lane=8, max_reqs=4)
    long, short = a.allocate_extend_batch([("long", list(range(8))), (7, [1, 2])])
    assert long.fallback_reason is None
    assert long.page_owners.tolist() == [0, 0, 1, 1, 1, 1, 0, 0]
    assert (long.new_pages % 2).tolist() == long.page_owners.tolist()
    assert short.fallback_reason == "extend_too_short" and short.page_owners is None
    assert (short.new_pages % 2).tolist() == [0, 1]  # 3 pages left on each lane
    assert a.stats()["fallbacks_by_reason"] == {"extend_too_short": 1}


def test_salted_requests_share_pages_only_with_their_salt() -> None:
    a = CPAllocator(cp_size=1, page_size=2, num_pages_per_lane=16)
    prompt = [1, 2, 3, 4, 5]
    a.allocate_extend("a", prompt, cache_salt="tenant-a")
    a.free("a")
    assert a.allocate_extend("b", prompt).cached_len == 0
    assert a.allocate_extend("c", prompt, cache_salt=b"tenant-a").cached_len == 0
    assert a.allocate_extend("d", prompt, cache_salt="tenant-a").cached_len == 4
    assert a.match_prefix(prompt[:4], cache_salt="tenant-a").shape == (2,)
    assert a.match_prefix(prompt[:4]).shape == (0,)


# ------------------------------------------ regressions for bugs the machines found
def test_report_of_a_restarted_lane_loses_it_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """A client reports a lane whose actor restarted: one loss, one recovery.

    ``LaneSupervisor.probe`` fails the lane it finds restarted; ``report_lane_failure`` used
    to call ``fail`` again, which lost the lane a second time (with whatever was allocated
    on it meanwhile) when the recovery had brought it back in between (made certain here).
    """
    from cpkv.coordinator.supervisor import LaneSupervisor

    probe = LaneSupervisor.probe

    def probe_then_recover(self: LaneSupervisor, lane: int, timeout: float) -> bool:
        ok = probe(self, lane, timeout)
        self.wait_recovered(5)  # the recovery wins the race
        return ok

    monkeypatch.setattr(LaneSupervisor, "probe", probe_then_recover)
    transport = LocalLaneTransport(1, 4, 1, _KV)
    coord = Coordinator(CPConfig(1, 1, 4), _KV, transport, heartbeat_s=0)
    try:
        epoch = coord.hello()["epoch"]
        coord.allocate_extend(epoch, None, None, "a", [1, 2])
        transport.restart(0)
        assert coord.report_lane_failure(epoch, 0, "seen by a client") == ["a"]
        assert coord.wait_recovered(5)
        assert coord.stats()["lane_losses"] == [[0, 1]]
    finally:
        coord.shutdown()


def test_retried_call_gets_its_lapse_notice_again() -> None:
    """A call answered with LeaseExpiredError and sent again (the answer was lost) must get
    the same answer (it used to run, turning the request's next chunk into a new request)."""
    now = [0.0]
    transport = LocalLaneTransport(1, 8, 1, _KV)
    coord = Coordinator(CPConfig(1, 1, 8), _KV, transport, heartbeat_s=0, clock=lambda: now[0])
    try:
        epoch = coord.hello("c0", 1.0)["epoch"]
        coord.allocate_extend(epoch, "c0", ("c0", 1), "a", [1, 2, 3])
        now[0] = 2.0
        assert coord.expire_leases() == 1
        first = coord.allocate_extend(epoch, "c0", ("c0", 2), "a", [4])
        assert isinstance(first, LeaseExpiredError) and first.rids == ["a"]
        again = coord.allocate_extend(epoch, "c0", ("c0", 2), "a", [4])
        assert again is first
    finally:
        coord.shutdown()


def test_rotation_leaves_out_a_lane_that_is_down() -> None:
    """Lane 1 is down but holds a cached page; lane 0 has two free pages for a two-page
    fallback. The rotation must not count lane 1's evictable page as room (it used to,
    and the step waited with ``lane_unavailable``)."""
    a = CPAllocator(cp_size=2, page_size=1, num_pages_per_lane=4, max_reqs=4)
    a.allocate_extend("b", [7])  # lane 0
    a.allocate_extend("c", [8])  # lane 1
    a.free("c", cache=True)  # lane 1's page: cached, evictable
    a.set_lane_available(1, False)
    assert a.stats()["free"] == [2, 2] and a.stats()["evictable"] == [0, 1]
    al = a.allocate_extend("x", [1, 2])
    assert (al.new_pages % 2).tolist() == [0, 0]


def test_answers_share_no_memory_with_the_core() -> None:
    """A caller that edits its answer (the plain Coordinator hands it over as is) cannot
    edit the core: the page arrays in answers are read-only views."""
    a = CPAllocator(cp_size=1, page_size=1, num_pages_per_lane=8)
    a.allocate_extend("a", [1, 2, 3])
    a.free("a")
    al = a.allocate_extend("b", [1, 2, 3])
    pages = a.request_pages("b").tolist()
    assert al.cached_pages.tolist() == [1, 2]
    for arr in (al.cached_pages, al.new_pages, a.request_pages("b")):
        with pytest.raises(ValueError, match="read-only"):
            arr[:] = 7
    assert a.match_prefix([1, 2]).tolist() == [1, 2]
    assert a.request_pages("b").tolist() == pages
    a.check_invariants()
