"""One lane's free pages."""

from __future__ import annotations

import numpy as np

from cpkv.core.layout import RESERVED_LOCAL_PAGE

__all__ = ["LanePagePool"]



class LanePagePool:
    """Free pages of one CP shard, as a stack of local page ids (4 bytes a page).

    ``allocate`` pops from the top, ``free`` pushes; both are O(n) numpy slices.
    """

    __slots__ = ("_free", "_num_free", "lane", "num_pages")

    def __init__(self, lane: int, num_pages: int) -> None:
        assert num_pages >= 2, num_pages
        self.lane = lane
        self.num_pages = num_pages
        self._free = np.empty(num_pages - 1, dtype=np.int32)
        self._num_free = 0
        self.reset()

    def reset(self) -> None:
        """Every page but the reserved one free again; lowest ids come out first."""
        self._free[:] = np.arange(self.num_pages - 1, RESERVED_LOCAL_PAGE, -1, dtype=np.int32)
        self._num_free = self.num_pages - 1

    @property
    def num_free_pages(self) -> int:
        return self._num_free

    @property
    def num_used_pages(self) -> int:
        """Pages handed out (in requests or in the prefix cache)."""
        return self.num_pages - 1 - self._num_free

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
        assert self._num_free + n <= self.num_pages - 1, (self.lane, n, self._num_free)
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
