"""Prefix cache: a radix tree over page-sized token chunks, with per-lane eviction.

Each node holds a run of pages (their chunk hashes and global page ids), so a
128k-token prompt is one node, not 2,048. Every node knows how many of its pages
sit on each lane; unlocked pages are evictable, and ``evict`` trims least
recently used unlocked leaves that hold pages on the lanes that are short.

Pages are identified by their keyed, chained 64-bit hashes (:mod:`cpkv.core.page_hash`);
a page is looked up only among its parent's children, so the tree path is the
chain as well.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np

from cpkv.core.layout import PageLayout

__all__ = ["EvictResult", "PrefixCache", "PrefixMatch"]


class _Node:
    __slots__ = (
        "children",
        "hashes",
        "id",
        "lane_counts",
        "last_access",
        "lock_ref",
        "pages",
        "parent",
    )

    def __init__(self, node_id, parent, hashes, pages, layout: PageLayout, last_access) -> None:
        self.id = node_id
        self.parent: _Node | None = parent
        self.children: dict[int, _Node] = {}
        self.hashes: np.ndarray = hashes
        self.pages: np.ndarray = pages
        self.lane_counts = layout.count_by_lane(pages)
        self.lock_ref = 0
        self.last_access = last_access

    def __len__(self) -> int:
        return int(self.pages.shape[0])


@dataclass(slots=True, frozen=True)
class PrefixMatch:
    """A cached, page-aligned prefix.

    Attributes:
        pages: ``int32 [num_pages]`` global page ids of the prefix, in order.
        node: the deepest matched node (lock it while the pages are in use);
            ``None`` when nothing matched.
    """

    pages: np.ndarray
    node: _Node | None

    @property
    def num_pages(self) -> int:
        return int(self.pages.shape[0])


@dataclass(slots=True, frozen=True)
class EvictResult:
    """Pages freed by one ``evict`` call.

    Attributes:
        freed_pages: per lane, ``int32`` global page ids now free.
        freed_per_lane: ``int64 [cp_size]`` counts of the same.
    """

    freed_pages: tuple[np.ndarray, ...]
    freed_per_lane: np.ndarray

    @property
    def num_pages(self) -> int:
        return int(self.freed_per_lane.sum())


_EMPTY_PAGES = np.empty(0, dtype=np.int32)


class PrefixCache:
    """Radix tree of cached pages with locking, LRU and per-lane evictable counts."""

    def __init__(self, cp_size: int, page_size: int) -> None:
        self.cp_size = cp_size
        self.page_size = page_size
        self.layout = PageLayout(cp_size, page_size)
        self._clock = itertools.count(1)
        self._ids = itertools.count(1)
        self._root = _Node(0, None, np.empty(0, np.uint64), _EMPTY_PAGES, self.layout, 0)
        self._root.lock_ref = 1  # the root is never evicted
        self._nodes: dict[int, _Node] = {}
        self._cached = np.zeros(cp_size, dtype=np.int64)
        self._evictable = np.zeros(cp_size, dtype=np.int64)

    # ------------------------------------------------------------------ counts
    @property
    def num_cached_pages_per_lane(self) -> np.ndarray:
        return self._cached.copy()

    @property
    def num_evictable_pages_per_lane(self) -> np.ndarray:
        return self._evictable.copy()

    @property
    def num_nodes(self) -> int:
        return len(self._nodes)

    def all_pages(self) -> np.ndarray:
        """Every cached global page id (for invariant checks)."""
        if not self._nodes:
            return _EMPTY_PAGES
        return np.concatenate([n.pages for n in self._nodes.values()])

    @property
    def nbytes(self) -> int:
        """Bytes of per-page metadata held by the tree (hashes + page ids)."""
        return sum(n.hashes.nbytes + n.pages.nbytes for n in self._nodes.values())

    # ------------------------------------------------------------------- match
    def match_prefix(self, hashes: np.ndarray) -> PrefixMatch:
        """Longest cached prefix of the pages whose chunk hashes are ``hashes``.

        The node where the match ends is split so the match covers whole nodes.
        """
        node, pos, parts = self._root, 0, []
        now = next(self._clock)
        while pos < hashes.shape[0]:
            child = node.children.get(int(hashes[pos]))
            if child is None:
                break
            k = self._common_len(child.hashes, hashes[pos:])
            whole = k == len(child)
            if not whole:
                child = self._split(child, k)
            child.last_access = now
            parts.append(child.pages)
            pos += k
            node = child
            if not whole:
                break
        if node is self._root:
            return PrefixMatch(_EMPTY_PAGES, None)
        return PrefixMatch(np.concatenate(parts) if len(parts) > 1 else parts[0], node)

    @staticmethod
    def _common_len(a: np.ndarray, b: np.ndarray) -> int:
        m = min(a.shape[0], b.shape[0])
        diff = np.flatnonzero(a[:m] != b[:m])
        return int(diff[0]) if diff.size else m

    def _split(self, node: _Node, k: int) -> _Node:
        """Cut ``node`` after its first ``k`` pages; return the new upper part."""
        assert 0 < k < len(node), (k, len(node))
        upper = _Node(
            next(self._ids),
            node.parent,
            node.hashes[:k],
            node.pages[:k],
            self.layout,
            node.last_access,
        )
        upper.lock_ref = node.lock_ref
        node.parent.children[int(node.hashes[0])] = upper
        node.hashes, node.pages = node.hashes[k:], node.pages[k:]
        node.lane_counts = node.lane_counts - upper.lane_counts
        node.parent = upper
        upper.children[int(node.hashes[0])] = node
        self._nodes[upper.id] = upper
        return upper

    # ------------------------------------------------------------------ locks
    def lock(self, node: _Node | None) -> None:
        """Pin ``node`` and its ancestors: their pages are in use, not evictable."""
        while node is not None and node is not self._root:
            if node.lock_ref == 0:
                self._evictable -= node.lane_counts
            node.lock_ref += 1
            node = node.parent

    def unlock(self, node: _Node | None) -> None:
        while node is not None and node is not self._root:
            assert node.lock_ref > 0, node.id
            node.lock_ref -= 1
            if node.lock_ref == 0:
                self._evictable += node.lane_counts
            node = node.parent

    # ----------------------------------------------------------------- insert
    def insert(self, hashes: np.ndarray, pages: np.ndarray) -> np.ndarray:
        """Cache the pages of a sequence whose page hashes are ``hashes``.

        Args:
            hashes: ``uint64 [n]`` chunk hashes from the first page on.
            pages: ``int32 [n]`` the sequence's global page ids.

        Returns:
            ``int32`` page ids of ``pages`` that duplicate pages already cached
            (other ids at the same place): the caller frees them.
        """
        assert hashes.shape == pages.shape, (hashes.shape, pages.shape)
        node, pos, dups = self._root, 0, []
        now = next(self._clock)
        n = hashes.shape[0]
        while pos < n:
            child = node.children.get(int(hashes[pos]))
            if child is None:
                leaf = _Node(
                    next(self._ids),
                    node,
                    hashes[pos:].copy(),
                    pages[pos:].copy(),
                    self.layout,
                    now,
                )
                node.children[int(hashes[pos])] = leaf
                self._nodes[leaf.id] = leaf
                self._cached += leaf.lane_counts
                self._evictable += leaf.lane_counts
                break
            k = self._common_len(child.hashes, hashes[pos:])
            if k < len(child):
                child = self._split(child, k)
            mine = pages[pos : pos + k]
            dups.append(mine[mine != child.pages])
            child.last_access = now
            pos += k
            node = child
        if not dups:
            return _EMPTY_PAGES
        return np.concatenate(dups).astype(np.int32, copy=False)

    # ------------------------------------------------------------------ evict
    def evict(self, owner_lane_deficits: np.ndarray) -> EvictResult:
        """Free cached pages until each lane's deficit is covered, LRU first.

        Least recently used unlocked leaves that hold pages on a deficit lane
        go first; each is trimmed from its tail only as far as the deficits
        need. Stops when the deficits are covered or nothing evictable could
        help any more.

        Args:
            owner_lane_deficits: ``[cp_size]`` pages still wanted per lane.

        Returns:
            The pages freed, per lane.
        """
        remaining = np.maximum(np.asarray(owner_lane_deficits, dtype=np.int64), 0)
        freed: list[np.ndarray] = []
        while remaining.any():
            short = remaining > 0
            if not (self._evictable[short] > 0).any():
                break
            leaf = self._pick_leaf(short)
            if leaf is None:
                break
            taken = self._trim(leaf, remaining)
            freed.append(taken)
            remaining -= np.minimum(remaining, self.layout.count_by_lane(taken))
        pages = np.concatenate(freed) if freed else _EMPTY_PAGES
        by_lane = tuple(self.layout.pages_by_lane(pages))
        return EvictResult(by_lane, self.layout.count_by_lane(pages))

    def _pick_leaf(self, short: np.ndarray) -> _Node | None:
        best = fallback = None
        for node in self._nodes.values():
            if node.children or node.lock_ref:
                continue
            if node.lane_counts[short].any():
                if best is None or node.last_access < best.last_access:
                    best = node
            elif (
                best is None
                and (fallback is None or node.last_access < fallback.last_access)
                and self._exposes_short(node, short)
            ):
                fallback = node
        # A leaf with no page on a short lane only helps by exposing an ancestor that has one
        # (any other leaf would go for nothing: a cached prompt lost).
        return best if best is not None else fallback

    @staticmethod
    def _exposes_short(leaf: _Node, short: np.ndarray) -> bool:
        """Whether an unlocked ancestor of ``leaf`` holds a page on a ``short`` lane."""
        node = leaf.parent
        while node is not None and not node.lock_ref:
            if node.lane_counts[short].any():
                return True
            node = node.parent
        return False

    def _trim(self, leaf: _Node, remaining: np.ndarray) -> np.ndarray:
        """Drop the fewest tail pages of ``leaf`` that cover what it can of ``remaining``."""
        need = np.minimum(remaining, leaf.lane_counts)
        take = 0 if need.any() else len(leaf)  # no page that helps: it goes whole
        if take == 0:
            rev = self.layout.lane_of(leaf.pages)[::-1]
            for r in np.flatnonzero(need):
                # The need[r]-th page of lane r counted from the tail bounds the cut.
                take = max(take, int(np.flatnonzero(rev == r)[need[r] - 1]) + 1)
        taken = leaf.pages[len(leaf) - take :]
        counts = self.layout.count_by_lane(taken)
        self._cached -= counts
        self._evictable -= counts
        if take == len(leaf):
            self._remove(leaf)
        else:
            leaf.hashes, leaf.pages = (
                leaf.hashes[: len(leaf) - take],
                leaf.pages[: len(leaf) - take],
            )
            leaf.lane_counts = leaf.lane_counts - counts
        return taken

    def _remove(self, node: _Node) -> None:
        del node.parent.children[int(node.hashes[0])]
        del self._nodes[node.id]

    # -------------------------------------------------------------- lane loss
    def drop_lane(self, lane: int) -> np.ndarray:
        """Forget every cached page from the first one on ``lane`` down, subtrees included.

        Returns:
            ``int32`` global ids of the dropped pages on the *other* lanes,
            which the caller frees (the lost lane's pool is reset whole).
        """
        doomed = [n for n in self._nodes.values() if n.lane_counts[lane] > 0]
        freed = []
        for top in doomed:
            if top.id not in self._nodes:
                continue  # already gone with an ancestor
            first = int(np.flatnonzero(self.layout.lane_of(top.pages) == lane)[0])
            if first:
                self._split(top, first)  # keep the pages before the lost one
            stack = [top]
            del top.parent.children[int(top.hashes[0])]
            while stack:
                node = stack.pop()
                assert node.lock_ref == 0, f"dropping node {node.id} still locked"
                stack.extend(node.children.values())
                del self._nodes[node.id]
                self._cached -= node.lane_counts
                self._evictable -= node.lane_counts
                freed.append(node.pages)
        pages = np.concatenate(freed) if freed else _EMPTY_PAGES
        return pages[self.layout.lane_of(pages) != lane]

    def check(self) -> None:
        """Raise AssertionError if counts or locks disagree with the tree."""
        cached = np.zeros(self.cp_size, dtype=np.int64)
        evictable = np.zeros(self.cp_size, dtype=np.int64)
        for node in self._nodes.values():
            counts = self.layout.count_by_lane(node.pages)
            if not np.array_equal(counts, node.lane_counts):
                raise AssertionError(f"node {node.id} lane counts {node.lane_counts} != {counts}")
            if len(node) == 0:
                raise AssertionError(f"node {node.id} is empty")
            child_locks = sum(c.lock_ref for c in node.children.values())
            if node.lock_ref < child_locks:
                raise AssertionError(
                    f"node {node.id} lock {node.lock_ref} < children {child_locks}"
                )
            cached += counts
            if node.lock_ref == 0:
                evictable += counts
        if not np.array_equal(cached, self._cached):
            raise AssertionError(f"cached {self._cached} != recount {cached}")
        if not np.array_equal(evictable, self._evictable):
            raise AssertionError(f"evictable {self._evictable} != recount {evictable}")
