"""CPAllocator stepped by hand: state asserted after every step (no Ray, no torch)."""

from __future__ import annotations

import dataclasses
import logging
import os
import pickle
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import cpkv
from cpkv import CPAllocator, InvalidRequestError, KVCapacityWaitError, LaneUnavailableError
from cpkv.core.validate import as_token_array


def make(cp=2, ps=4, pages=20, reqs=4, ctx=1000, **kw) -> CPAllocator:
    return CPAllocator(cp, ps, pages, max_reqs=reqs, max_context_len=ctx, **kw)


def expand(pages: np.ndarray, ps: int) -> np.ndarray:
    return (pages.astype(np.int64)[:, None] * ps + np.arange(ps)).ravel()


def test_owner_plan_allocation_lands_on_owner_lanes():
    a = make()
    alloc = a.allocate_extend("r", np.arange(40))
    assert alloc.fallback_reason is None
    assert alloc.page_owners.tolist() == [0, 0, 0, 1, 1, 1, 1, 1, 0, 0]
    assert (alloc.new_pages % 2 == alloc.page_owners).all()
    assert (alloc.new_pages // 2 != 0).all(), "reserved page handed out"
    assert alloc.out_cache_loc.tolist() == expand(alloc.new_pages, 4).tolist()
    assert alloc.lane_token_ranges == (((0, 12), (32, 40)), ((12, 32),)) or (
        alloc.lane_token_ranges == (((0, 12), (32, 40)), ((12, 24), (24, 32)))
    )
    s = a.stats()
    assert s["free"] == [14, 14] and s["used"] == [5, 5] and s["cached"] == [0, 0]
    a.check_invariants()


def test_chunked_prefill_continues_partial_page():
    a = make()
    first = a.allocate_extend("r", np.arange(18))  # 4.5 pages: plan (5 pages >= 4)
    assert first.fallback_reason is None and first.num_new_pages == 5
    second = a.allocate_extend("r", np.arange(18, 29))  # prefix 18 not page aligned
    assert second.fallback_reason == "prefix_not_page_aligned"
    assert second.prefix_len == 18 and second.extend_len == 11
    last = int(first.new_pages[-1])
    assert second.head_slot == last * 4 + 2 and second.head_len == 2
    whole = np.concatenate([first.out_cache_loc, second.out_cache_loc])
    assert whole.tolist() == expand(a.request_pages("r"), 4)[:29].tolist()
    assert a.request_len("r") == 29
    assert a.stats()["fallbacks_by_reason"] == {"prefix_not_page_aligned": 1}
    a.check_invariants()


def test_prefix_cache_reuse_and_sharing():
    a = make()
    a.allocate_extend("a", np.arange(40))
    assert a.free("a", cache=True) == 0  # 10 full pages all cached
    s = a.stats()
    assert s["cached"] == [5, 5] and s["evictable"] == [5, 5] and s["used"] == [0, 0]
    b = a.allocate_extend("b", np.arange(48))
    assert b.cached_len == 40 and b.prefix_len == 40 and b.extend_len == 8
    assert a.stats()["evictable"] == [0, 0], "matched prefix must be locked"
    c = a.allocate_extend("c", np.arange(40))  # whole prompt cached: last page recomputed
    assert c.cached_len == 36 and c.extend_len == 4
    shared = np.intersect1d(a.request_pages("b"), a.request_pages("c"))
    assert shared.size == 9
    a.check_invariants()
    a.free("b")
    a.free("c")
    a.check_invariants()
    assert a.stats()["used"] == [0, 0]


def test_duplicate_pages_are_freed_on_insert():
    a = make()
    a.allocate_extend("a", np.arange(16))
    a.allocate_extend("b", np.arange(16))  # no cache hit: "a" is still running
    a.free("a")
    free_before = sum(a.stats()["free"])
    a.free("b")  # same content: b's pages are duplicates and go back free
    assert sum(a.stats()["free"]) == free_before + 4
    assert sum(a.stats()["cached"]) == 4
    a.check_invariants()


def test_eviction_targets_deficit_lane_and_asks_deficit_tokens():
    a = make(cp=2, ps=4, pages=12, reqs=8)  # 11 usable pages a lane
    # Cache two prompts; their pages land on both lanes.
    for rid, base in (("x", 0), ("y", 1000)):
        a.allocate_extend(rid, np.arange(base, base + 32))  # 8 pages, 4 a lane
        a.free(rid)
    assert a.stats()["cached"] == [8, 8] and a.stats()["free"] == [3, 3]
    # Fill lane 1 only, with a decode-style rotation... use a plan that needs 6 on each lane.
    before = a.stats()
    alloc = a.allocate_extend("z", np.arange(5000, 5000 + 48))  # 12 pages: 6 a lane
    after = a.stats()
    deficit = [6 - 3, 6 - 3]
    assert after["evict_tokens_requested"] - before["evict_tokens_requested"] == (sum(deficit) * 4)
    # The LRU leaf "x" (lanes 0,0,1,1,1,1,0,0) is trimmed from its tail only as far as
    # the deficits need: 7 pages cover 3 on each lane; "y" is untouched.
    assert after["pages_evicted"] == 7
    assert after["cached"] == [5, 4] and after["free"] == [0, 1]
    assert alloc.num_new_pages == 12
    a.check_invariants()


def test_capacity_wait_vectors_and_nothing_allocated():
    a = make(cp=2, ps=4, pages=6, reqs=4)  # 5 usable pages a lane
    a.allocate_extend("keep", np.arange(24))  # 6 pages, 3 a lane
    before = a.stats()
    with pytest.raises(KVCapacityWaitError) as info:
        a.allocate_extend("big", np.arange(100, 100 + 40))  # 10 pages: 5 a lane, 2 free each
    err = info.value
    assert err.required_by_owner == [5, 5]
    assert err.available_by_owner == [2, 2]
    assert err.deficit_by_owner == [3, 3]
    assert err.reason == "owner_lane_exhausted"
    after = a.stats()
    assert after["free"] == before["free"] and after["num_requests"] == 1
    assert after["capacity_waits"] == 1
    assert not a.has_request("big")
    a.check_invariants()
    # The request slot was released: 3 more requests still fit in max_reqs=4.
    for i in range(3):
        a.allocate_extend(f"s{i}", [i])
    a.check_invariants()


def test_capacity_wait_crosses_pickle_intact():
    err = KVCapacityWaitError(
        "x", required_by_owner=[3, 1], available_by_owner=[1, 1], deficit_by_owner=[2, 0]
    )
    back = pickle.loads(pickle.dumps(err))
    assert type(back) is KVCapacityWaitError and isinstance(back, RuntimeError)
    assert (back.required_by_owner, back.available_by_owner, back.deficit_by_owner) == (
        [3, 1],
        [1, 1],
        [2, 0],
    )
    assert "deficit_by_owner=[2, 0]" in str(back)
    lane = pickle.loads(pickle.dumps(LaneUnavailableError(2, ["a", 7])))
    assert (lane.lane, lane.rids) == (2, ["a", 7])


def test_request_slots_exhausted_is_a_capacity_wait():
    a = make(reqs=2)
    a.allocate_extend("a", [1])
    a.allocate_extend("b", [2])
    with pytest.raises(KVCapacityWaitError) as info:
        a.allocate_extend("c", [3])
    assert info.value.reason == "request_slots_exhausted"
    a.free("a")
    a.allocate_extend("c", [3])
    a.check_invariants()


def test_batch_rotation_from_most_free_lane_and_all_or_nothing():
    a = make(cp=3, ps=2, pages=10, reqs=8)  # 9 usable a lane
    a.allocate_extend("w", [1, 2, 3])  # fallback: 2 pages, lanes 0 then 1
    assert a.stats()["free"] == [8, 8, 9]
    out = a.allocate_extend_batch([("b1", np.arange(10, 16)), ("b2", np.arange(20, 25))])
    assert [o.fallback_reason for o in out] == ["extend_too_short", "extend_too_short"]
    lanes = np.concatenate([o.new_pages for o in out]) % 3
    assert lanes.tolist() == [2, 0, 1, 2, 0, 1]  # starts at lane 2 (most free)
    free = a.stats()["free"]
    assert max(free) - min(free) <= 1
    before = a.stats()
    with pytest.raises(KVCapacityWaitError) as info:
        a.allocate_extend_batch([("c1", np.arange(100, 130)), ("c2", np.arange(200, 230))])
    assert info.value.reason == "owner_lane_exhausted"  # both qualify for their own plan
    assert sum(info.value.required_by_owner) == 30
    after = a.stats()
    assert after["free"] == before["free"] and after["num_requests"] == before["num_requests"]
    a.check_invariants()


def test_batch_plans_each_sequence_and_rotates_the_rest():
    a = make(cp=2, ps=4, pages=40, reqs=8)
    items = [("long1", np.arange(40)), ("short", [1, 2, 3]), ("long2", np.arange(100, 133))]
    out = a.allocate_extend_batch(items)
    for o, (_, toks) in zip(out, items, strict=True):
        assert o.extend_len == len(toks)
    long1, short, long2 = out
    expect1 = cpkv.build_in_seq_page_compute_owners(40, 0, 4, 2)
    assert long1.fallback_reason is None and long1.page_owners.tolist() == expect1.tolist()
    assert (long1.new_pages % 2 == long1.page_owners).all()
    assert long2.fallback_reason is None and (long2.new_pages % 2 == long2.page_owners).all()
    assert short.fallback_reason == "extend_too_short" and short.page_owners is None
    assert a.stats()["fallbacks_by_reason"] == {"extend_too_short": 1}
    a.check_invariants()


def test_decode_takes_a_page_only_when_last_is_full():
    a = make(cp=2, ps=4, pages=20)
    a.allocate_extend("r", np.arange(7))  # 2 pages, second holds 3 tokens
    free0 = a.stats()["free"]
    (slot,) = a.allocate_decode(["r"], [70])
    assert a.stats()["free"] == free0  # filled the partial page
    assert slot == int(a.request_pages("r")[-1]) * 4 + 3
    (slot2,) = a.allocate_decode(["r"], [71])  # page full: new page from the most free lane
    free1 = a.stats()["free"]
    lane = int(np.argmax(free0))
    assert free1[lane] == free0[lane] - 1
    assert slot2 == int(a.request_pages("r")[-1]) * 4
    assert a.request_len("r") == 9
    a.check_invariants()


def test_decode_pages_enter_cache_only_with_token_ids():
    a = make(cp=1, ps=2, pages=20)
    a.allocate_extend("r", [1, 2])
    a.allocate_decode(["r"])  # unknown token
    a.allocate_decode(["r"])
    a.free("r")
    assert a.stats()["cached"] == [1]  # only the prompt page is known
    a.allocate_extend("s", [1, 2])
    a.allocate_decode(["s"], [3])
    a.allocate_decode(["s"], [4])
    a.free("s")
    assert a.stats()["cached"] == [2]
    a.check_invariants()


def test_committed_len_frees_overallocated_pages():
    a = make(cp=1, ps=4, pages=20)
    a.allocate_extend("r", np.arange(16))  # 4 full pages, say 2 speculative
    a.free("r", committed_len=9)  # 2 full pages committed; 3rd is partial, 4th past the end
    s = a.stats()
    assert s["cached"] == [2] and s["free"] == [17]
    a.check_invariants()


def test_free_without_cache_returns_everything():
    a = make()
    a.allocate_extend("r", np.arange(30))
    assert a.free("r", cache=False) == 8
    assert a.stats()["free"] == [19, 19] and a.stats()["cached"] == [0, 0]
    a.check_invariants()


def test_drop_lane_fails_only_its_requests():
    a = make(cp=2, ps=4, pages=20)
    a.allocate_extend("both", np.arange(40))  # plan: pages on both lanes
    a.allocate_extend("zero", [5])  # one page on lane 0 (most free, ties -> lane 0)
    assert int(a.request_pages("zero")[0]) % 2 == 0
    a.allocate_extend("one", [6])
    assert int(a.request_pages("one")[0]) % 2 == 1
    lost = a.drop_lane(0)
    assert sorted(lost) == ["both", "zero"]
    assert a.has_request("one")
    s = a.stats()
    assert s["free"] == [19, 18] and s["requests_lost"] == 2
    with pytest.raises(LaneUnavailableError) as info:
        a.allocate_decode(["zero"])
    assert info.value.lane == 0 and info.value.rids == ["zero"]
    assert a.free("zero") == 0  # acknowledges the loss
    with pytest.raises(InvalidRequestError):
        a.free("zero")
    a.check_invariants()


def test_drop_lane_drops_cached_pages_on_it():
    a = make(cp=2, ps=4, pages=20)
    a.allocate_extend("r", np.arange(40))
    a.free("r")
    a.drop_lane(1)
    # Owners run 0,0,0,1,...: the three pages before the first lane-1 page stay cached.
    assert a.stats()["cached"] == [3, 0] and a.stats()["free"] == [16, 19]
    a.check_invariants()


def test_fallback_logged_once_per_reason(caplog):
    a = make(reqs=8)
    with caplog.at_level(logging.WARNING, logger="cpkv.core.allocator"):
        for i in range(5):
            a.allocate_extend(f"r{i}", [i])
    records = [r for r in caplog.records if "extend_too_short" in r.getMessage()]
    assert len(records) == 1
    assert a.stats()["fallbacks_by_reason"] == {"extend_too_short": 5}


BAD_CALLS = [
    ("empty tokens", lambda a: a.allocate_extend("n", []), "empty"),
    ("float tokens", lambda a: a.allocate_extend("n", [1.5, 2.0]), "float"),
    ("negative token", lambda a: a.allocate_extend("n", [1, -3]), "-3"),
    ("2-d tokens", lambda a: a.allocate_extend("n", np.zeros((2, 2), int)), "(2, 2)"),
    ("string tokens", lambda a: a.allocate_extend("n", "abc"), "str"),
    ("too long new", lambda a: a.allocate_extend("n", np.arange(1001)), "1001"),
    ("too long chunk", lambda a: a.allocate_extend("live", np.arange(990)), "1000"),
    ("unknown rid decode", lambda a: a.allocate_decode(["ghost"]), "ghost"),
    ("repeated decode rid", lambda a: a.allocate_decode(["live", "live"]), "repeated"),
    ("decode token count", lambda a: a.allocate_decode(["live"], [1, 2]), "2 token ids"),
    ("unknown free", lambda a: a.free("ghost"), "ghost"),
    ("committed too long", lambda a: a.free("live", committed_len=99), "99"),
    ("committed negative", lambda a: a.free("live", committed_len=-1), "-1"),
    ("empty batch", lambda a: a.allocate_extend_batch([]), "empty"),
    ("repeated batch", lambda a: a.allocate_extend_batch([("x", [1]), ("x", [2])]), "x"),
    ("numpy bool token", lambda a: a.allocate_extend("n", [np.True_, 3]), "bool"),
    ("lane stats owner", lambda a: a.lane_stats([0, 5]), "5"),
    ("lane stats float owners", lambda a: a.lane_stats([0.7, 1.9]), "float64"),
    ("drop bad lane", lambda a: a.drop_lane(7), "7"),
]


@pytest.mark.parametrize(
    ("fn", "needle"), [c[1:] for c in BAD_CALLS], ids=[c[0] for c in BAD_CALLS]
)
def test_bad_input_raises_and_leaves_state(fn, needle):
    a = make()
    a.allocate_extend("live", np.arange(20))
    before = a.stats()
    with pytest.raises(ValueError) as info:
        fn(a)
    assert isinstance(info.value, InvalidRequestError)
    assert needle in str(info.value)
    assert a.stats() == before
    a.check_invariants()


def test_a_rejected_batch_leaves_the_cache_order_as_it_was():
    """An item's length is checked before any item's prefix match, which would refresh the
    cache's LRU order: the next eviction would then take another prompt's pages."""

    def cached_after_eviction(bad_call: bool) -> tuple[int, int]:
        a = make(cp=1, ps=1, pages=7, ctx=4, hash_key=bytes(32))
        for rid, prompt in (("x", [1, 2]), ("y", [7, 8])):  # x older than y
            a.allocate_extend(rid, prompt)
            a.free(rid)
        a.allocate_extend("live", [3, 3])
        if bad_call:
            with pytest.raises(InvalidRequestError, match="5 tokens"):
                a.allocate_extend_batch([("n", [1, 2, 9]), ("live", [0, 0, 0])])
        a.allocate_extend("z", [5, 6])  # evicts the least recently used prompt
        return a.match_prefix([1, 2, 0]).size, a.match_prefix([7, 8, 0]).size

    assert cached_after_eviction(True) == cached_after_eviction(False) == (0, 2)


def test_free_checks_committed_len_of_a_request_lost_with_its_lane():
    a = make()
    a.allocate_extend("r", np.arange(40))
    a.drop_lane(1)
    with pytest.raises(InvalidRequestError, match="-5"):
        a.free("r", committed_len=-5)
    assert a.free("r") == 0  # the loss acknowledged once, by a well-formed call


def test_double_free_and_decode_after_free():
    a = make()
    a.allocate_extend("r", [1, 2, 3])
    a.free("r")
    with pytest.raises(InvalidRequestError, match="'r'"):
        a.free("r")
    with pytest.raises(InvalidRequestError, match="'r'"):
        a.allocate_decode(["r"])


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(cp_size=0),
        dict(page_size=0),
        dict(num_pages_per_lane=1),
        dict(max_reqs=0),
        dict(cp_size=2.0),
    ],
    ids=["cp0", "page0", "pages1", "reqs0", "cp-float"],
)
def test_bad_config(kwargs):
    args = dict(cp_size=2, page_size=4, num_pages_per_lane=8) | kwargs
    with pytest.raises(ValueError, match=next(iter(kwargs))):
        CPAllocator(**args)


def test_metadata_is_small():
    a = make(cp=4, ps=16, pages=256, reqs=8, ctx=1 << 16)
    a.allocate_extend("r", np.arange(4 * 255 * 16 - 16))
    per_page = a.metadata_nbytes() / (4 * 256)
    assert per_page <= 16, per_page


def test_token_ids_become_contiguous_int64_once():
    ids = np.arange(8, dtype=np.int64)
    assert as_token_array(ids) is ids  # already what the core takes: not copied
    strided = np.arange(16, dtype=np.int64)[::2]
    narrow = np.arange(8, dtype=np.int32)
    for arr in (strided, narrow, list(range(8))):
        out = as_token_array(arr)
        assert out.dtype == np.int64 and out.flags.c_contiguous
        assert out.tolist() == np.asarray(arr).tolist()
    a = make(hash_key=bytes(32))
    b = make(hash_key=bytes(32))
    a.allocate_extend("s", strided)
    b.allocate_extend("s", strided.copy())
    a.free("s")
    b.free("s")
    assert a.match_prefix(strided).tolist() == b.match_prefix(np.arange(0, 16, 2)).tolist()


def test_extend_is_a_batch_of_one():
    a, b = make(reqs=3, hash_key=bytes(32)), make(reqs=3, hash_key=bytes(32))
    steps = [("a", np.arange(40)), ("a", np.arange(40, 47)), ("b", np.arange(44)), ("c", [1])]
    for rid, toks in steps:
        one = a.allocate_extend(rid, toks)
        (batch,) = b.allocate_extend_batch([(rid, toks)])
        for f in dataclasses.fields(cpkv.ExtendAllocation):
            x, y = getattr(one, f.name), getattr(batch, f.name)
            assert np.array_equal(x, y) if isinstance(x, np.ndarray) else x == y, f.name
    assert a.stats() == b.stats()
    errors = []
    for alloc in (a, b):
        with pytest.raises(KVCapacityWaitError) as info:
            if alloc is a:
                alloc.allocate_extend("d", [2])
            else:
                alloc.allocate_extend_batch([("d", [2])])
        errors.append((str(info.value), info.value.reason))
    assert errors[0] == errors[1]
    assert errors[0][1] == "request_slots_exhausted" and "all 3 request slots" in errors[0][0]


def test_the_decision_core_imports_neither_ray_nor_torch():
    """Any process can hold the core (a client, a test, the coordinator) without Ray's or
    torch's start-up cost: importing it and running an allocation loads neither."""
    code = (
        "import sys, numpy as np; from cpkv.core import CPAllocator; "
        "a = CPAllocator(2, 4, 8, 2, 64); a.allocate_extend('r', np.arange(9)); "
        "print(sorted(m for m in ('ray', 'torch', 'triton') if m in sys.modules))"
    )
    root = str(Path(__file__).resolve().parents[1])
    out = subprocess.run(
        [sys.executable, "-c", code],
        env={**os.environ, "PYTHONPATH": root},
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    assert out.stdout.strip() == "[]", out.stdout


def test_free_with_a_cache_flag_that_is_no_bool_changes_nothing():
    """It raised numpy's ambiguous truth value after the request was removed: its pages
    leaked and the rid was unknown; a str cached the pages silently."""
    a = make()
    a.allocate_extend("x", np.arange(9))
    before = a.num_free_pages_per_lane().tolist()
    for cache in (np.array([1, 0]), "no", 1):
        with pytest.raises(InvalidRequestError, match="cache="):
            a.free("x", cache=cache)
    assert a.has_request("x") and a.num_free_pages_per_lane().tolist() == before
    a.check_invariants()
    a.free("x", cache=np.bool_(False))
    a.check_invariants()


def test_a_decode_that_fails_on_one_rid_leaves_every_rid_as_it_was(monkeypatch):
    from cpkv.core import requests

    a = make()
    a.allocate_extend("a", np.arange(6))
    a.allocate_extend("b", np.arange(7))
    plain = requests.Request.next_chunk

    def next_chunk(self, hasher, tokens):
        if self.rid == "b":
            raise ValueError("bad tail")
        return plain(self, hasher, tokens)

    monkeypatch.setattr(requests.Request, "next_chunk", next_chunk)
    free = a.num_free_pages_per_lane().tolist()
    with pytest.raises(ValueError, match="bad tail"):
        a.allocate_decode(["a", "b"], [7, 7])
    assert a.request_len("a") == 6 and a.request_len("b") == 7
    assert a.num_free_pages_per_lane().tolist() == free
    a.check_invariants()
