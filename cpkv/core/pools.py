"""Free pages: one lane's stack, and every lane's pools addressed by global page id."""

from __future__ import annotations

import numpy as np

from cpkv.core.layout import RESERVED_LOCAL_PAGE, PageLayout
from cpkv.core.moves import MoveJournal

__all__ = ["LanePagePool", "PagePools"]


class LanePagePool:
    """Free pages of one CP shard, as a stack of local page ids (4 bytes a page).

    ``allocate`` pops from the top, ``free`` pushes; both are O(n) numpy slices.
    """

    __slots__ = ("_free", "_num_free", "lane", "num_pages", "num_usable_pages")

    def __init__(self, lane: int, num_pages: int) -> None:
        assert num_pages >= 2, num_pages
        self.lane = lane
        self.num_pages = num_pages
        self.num_usable_pages = num_pages - 1  # all but RESERVED_LOCAL_PAGE
        self._free = np.empty(self.num_usable_pages, dtype=np.int32)
        self._num_free = 0
        self.reset()

    def reset(self) -> None:
        """Every page but the reserved one free again; lowest ids come out first."""
        self._free[:] = np.arange(self.num_pages - 1, RESERVED_LOCAL_PAGE, -1, dtype=np.int32)
        self._num_free = self.num_usable_pages

    @property
    def num_free_pages(self) -> int:
        return self._num_free

    @property
    def num_used_pages(self) -> int:
        """Pages handed out (in requests or in the prefix cache)."""
        return self.num_usable_pages - self._num_free

    def can_allocate(self, n: int) -> bool:
        return 0 <= n <= self._num_free

    def allocate(self, n: int) -> np.ndarray:
        """Take ``n`` free local pages (int32); the caller checked ``can_allocate``."""
        assert self.can_allocate(n), (self.lane, n, self._num_free)
        self._num_free -= n
        return self._free[self._num_free : self._num_free + n][::-1].copy()

    def free(self, local_pages: np.ndarray) -> None:
        """Return local pages to the pool."""
        n = int(local_pages.shape[0])
        # NOTE: overflowing the stack means a page was freed twice.
        assert self._num_free + n <= self.num_usable_pages, (self.lane, n, self._num_free)
        self._free[self._num_free : self._num_free + n] = local_pages
        self._num_free += n

    def free_pages_view(self) -> np.ndarray:
        """The free local pages (a read-only view), for invariant checks."""
        view = self._free[: self._num_free]
        view.flags.writeable = False
        return view

    @property
    def nbytes(self) -> int:
        return int(self._free.nbytes)


class PagePools:
    """The free pages of every lane, taken and released by global page id.

    Args:
        layout: the pool's page layout.
        num_pages_per_lane: pages per lane shard, the reserved one included.
        journal: records every page taken or released, per lane; ``None`` records nothing.
    """

    __slots__ = ("_lanes", "journal", "layout")

    def __init__(
        self, layout: PageLayout, num_pages_per_lane: int, journal: MoveJournal | None = None
    ) -> None:
        self.layout = layout
        self.journal = journal
        self._lanes = [LanePagePool(r, num_pages_per_lane) for r in range(layout.cp_size)]

    def __getitem__(self, lane: int) -> LanePagePool:
        return self._lanes[lane]

    def num_free_pages_per_lane(self) -> np.ndarray:
        """``int64 [cp_size]`` free pages on each lane."""
        return np.array([p.num_free_pages for p in self._lanes], dtype=np.int64)

    def take(self, owners: np.ndarray) -> np.ndarray:
        """Take a page on each lane ``owners`` names, one batched pop per lane; the caller
        checked they are free.

        Returns:
            ``int32`` global page ids, in the order of ``owners``.
        """
        out = np.empty(owners.shape[0], dtype=np.int32)
        if owners.shape[0] == 0:
            return out
        counts = self.layout.count_lanes(owners)
        for r in np.flatnonzero(counts):
            local = self._lanes[r].allocate(int(counts[r]))
            if self.journal is not None:
                self.journal.record_taken(r, local)
            out[owners == r] = self.layout.global_of(r, local)
        return out

    def release(self, pages: np.ndarray) -> None:
        """Return global ``pages`` to their lanes' pools."""
        if pages.size == 0:
            return
        for r, mine in enumerate(self.layout.pages_by_lane(pages)):
            if mine.size:
                self.release_local(r, self.layout.local_of(mine))

    def release_local(self, lane: int, local: np.ndarray) -> None:
        """Return local pages to ``lane``'s pool."""
        self._lanes[lane].free(local)
        if self.journal is not None:
            self.journal.record_released(lane, local)

    def reset_lane(self, lane: int) -> None:
        """Every page of ``lane`` free again (it was lost); its journal starts over."""
        self._lanes[lane].reset()
        if self.journal is not None:
            self.journal.reset_lane(lane)

    def check_places(self, held: np.ndarray) -> None:
        """Raise AssertionError unless every page is in exactly one place: free, reserved,
        or once in ``held`` (global ids of the pages in requests or in the prefix cache)."""
        layout = self.layout
        seen = np.zeros((layout.cp_size, self._lanes[0].num_pages), dtype=np.int64)
        for r, pool in enumerate(self._lanes):
            np.add.at(seen[r], pool.free_pages_view(), 1)
            seen[r, RESERVED_LOCAL_PAGE] += 1
        np.add.at(seen, (layout.lane_of(held), layout.local_of(held)), 1)
        bad = np.argwhere(seen != 1)
        if bad.size:
            lane, local = bad[0]
            raise AssertionError(
                f"{len(bad)} pages misplaced; e.g. lane {lane} local page {local} is in "
                f"{seen[lane, local]} places"
            )

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self._lanes)
