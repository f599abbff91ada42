"""PrefixCache: matching, splitting, duplicates, locking and deficit-targeted eviction."""

from __future__ import annotations

import numpy as np

from cpkv.core.page_hash import PageHasher
from cpkv.core.prefix_cache import PrefixCache

_HASHERS = {ps: PageHasher(ps, key=bytes(32)) for ps in (1, 2, 4)}


def hashes(tokens, ps=2):
    h = _HASHERS[ps]
    return h.hash_pages(np.asarray(tokens, dtype=np.int64), h.start())[0]


def test_match_splits_and_insert_returns_duplicates():
    c = PrefixCache(cp_size=2, page_size=2)
    toks = np.arange(8)
    pages = np.array([2, 3, 4, 5], dtype=np.int32)
    assert c.insert(hashes(toks), pages).size == 0
    m = c.match_prefix(hashes([0, 1, 2, 3, 9, 9]))
    assert m.pages.tolist() == [2, 3] and c.num_nodes == 2  # split after two pages
    dup = c.insert(hashes(toks), np.array([2, 3, 7, 8], dtype=np.int32))
    assert dup.tolist() == [7, 8]  # already cached as 4, 5
    c.check()


def test_lock_protects_from_eviction():
    c = PrefixCache(cp_size=1, page_size=2)
    c.insert(hashes(np.arange(6)), np.array([1, 2, 3], dtype=np.int32))
    m = c.match_prefix(hashes(np.arange(6)))
    c.lock(m.node)
    assert c.num_evictable_pages_per_lane.tolist() == [0]
    assert c.evict(np.array([3])).num_pages == 0
    c.unlock(m.node)
    res = c.evict(np.array([2]))
    assert res.freed_pages[0].tolist() == [2, 3]  # tail first; page 1 stays
    assert c.num_cached_pages_per_lane.tolist() == [1]
    c.check()


def test_evict_prefers_leaves_on_deficit_lanes_over_lru():
    c = PrefixCache(cp_size=2, page_size=1)
    c.insert(hashes([10], 1), np.array([2], dtype=np.int32))  # older, lane 0
    c.insert(hashes([20], 1), np.array([3], dtype=np.int32))  # newer, lane 1
    res = c.evict(np.array([0, 1]))
    assert res.freed_per_lane.tolist() == [0, 1] and res.freed_pages[1].tolist() == [3]
    res = c.evict(np.array([1, 0]))
    assert res.freed_per_lane.tolist() == [1, 0]
    c.check()


def test_evict_lru_order_among_candidates():
    c = PrefixCache(cp_size=1, page_size=1)
    c.insert(hashes([1], 1), np.array([5], dtype=np.int32))
    c.insert(hashes([2], 1), np.array([6], dtype=np.int32))
    c.match_prefix(hashes([1], 1))  # touch: [1] is now most recent
    res = c.evict(np.array([1]))
    assert res.freed_pages[0].tolist() == [6]


def test_evict_exposes_parent_holding_deficit_pages():
    c = PrefixCache(cp_size=2, page_size=1)
    # parent page on lane 1, child page on lane 0: the child must go to reach the parent.
    c.insert(hashes([1, 2], 1), np.array([3, 4], dtype=np.int32))
    res = c.evict(np.array([0, 1]))
    assert sorted(res.freed_pages[1].tolist()) == [3]
    assert res.num_pages == 2 and c.num_nodes == 0
    c.check()


def test_evict_spares_leaves_that_expose_nothing_on_a_deficit_lane():
    c = PrefixCache(cp_size=2, page_size=1)
    for i, page in enumerate([3, 5, 7]):  # older prompts, a lane-1 page each
        c.insert(hashes([100 + i], 1), np.array([page], dtype=np.int32))
    # Newer: [1] on lane 0 with a child on lane 1; only the child's removal exposes lane 0.
    c.insert(hashes([1, 2], 1), np.array([2, 13], dtype=np.int32))
    c.match_prefix(hashes([1], 1))  # split: [1] a node of its own
    res = c.evict(np.array([1, 0]))
    assert sorted(int(p) for lane in res.freed_pages for p in lane) == [2, 13]
    assert c.num_cached_pages_per_lane.tolist() == [0, 3]  # the older prompts stay cached
    c.check()


def test_drop_lane_removes_subtrees():
    c = PrefixCache(cp_size=2, page_size=1)
    c.insert(hashes([1, 2, 3], 1), np.array([2, 5, 4], dtype=np.int32))  # lanes 0,1,0
    c.insert(hashes([7], 1), np.array([6], dtype=np.int32))  # lane 0 only
    freed = c.drop_lane(1)
    assert freed.tolist() == [4]  # the child of the lane-1 page, on lane 0
    assert c.num_cached_pages_per_lane.tolist() == [2, 0]
    c.check()
