"""How global page ids and slots map onto the lanes' shards: one name for the arithmetic."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

__all__ = ["RESERVED_LOCAL_PAGE", "PageLayout"]

# NOTE: local page 0 of every lane is the padding target of the kernels and is never handed
# out; global pages 0..cp_size-1 are therefore never in a request.
RESERVED_LOCAL_PAGE = 0


@dataclass(frozen=True, slots=True)
class PageLayout:
    """Global page ``g`` lives on lane ``g % cp_size`` as local page ``g // cp_size``.

    A slot is ``page * page_size + offset``; a lane's local slot is ``local_page *
    page_size + offset`` in its own shard. Every helper takes ints or numpy arrays.

    Args:
        cp_size: number of lanes (CP shards), >= 1.
        page_size: tokens per page, >= 1.
    """

    cp_size: int
    page_size: int

    def __post_init__(self) -> None:
        if self.cp_size < 1 or self.page_size < 1:
            raise ValueError(f"PageLayout needs cp_size >= 1 and page_size >= 1, got {self}")

    # ------------------------------------------------------------------ pages
    def lane_of(self, pages):
        """Lane holding each global page."""
        return pages % self.cp_size

    def local_of(self, pages):
        """Local page id of each global page inside its lane's shard."""
        return pages // self.cp_size

    def global_of(self, lane, local):
        """Global page id of local page(s) ``local`` on lane(s) ``lane``."""
        return local * self.cp_size + lane

    def usable_pages(self, num_pages_per_lane: int) -> int:
        """Pages a lane can hand out: all but the reserved one."""
        return num_pages_per_lane - 1

    def pages_for(self, num_tokens: int) -> int:
        """Pages that hold ``num_tokens`` tokens."""
        return -(-num_tokens // self.page_size)

    def full_pages(self, num_tokens: int) -> int:
        """Pages that ``num_tokens`` tokens fill completely (a partial last page left out)."""
        return num_tokens // self.page_size

    def pages_per_lane_for(self, num_pages: int) -> int:
        """Most pages any lane holds of ``num_pages`` spread round-robin over the lanes."""
        return -(-num_pages // self.cp_size)

    def count_by_lane(self, pages: np.ndarray) -> np.ndarray:
        """``int64 [cp_size]``: how many of ``pages`` each lane holds."""
        return self.count_lanes(self.lane_of(pages))

    def count_lanes(self, lanes: np.ndarray) -> np.ndarray:
        """``int64 [cp_size]``: how many entries of ``lanes`` (lane ids, e.g. page owners)
        name each lane."""
        return np.bincount(lanes, minlength=self.cp_size).astype(np.int64, copy=False)

    def pages_by_lane(self, pages: np.ndarray) -> list[np.ndarray]:
        """Per lane, the global ``pages`` it holds, in their given order."""
        lanes = self.lane_of(pages)
        return [pages[lanes == r] for r in range(self.cp_size)]

    # ------------------------------------------------------------------ slots
    def local_slots(self, slots: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``(lane, local_slot)`` of global slots, both ``int64`` like ``slots``."""
        pages, offsets = np.divmod(slots, self.page_size)
        return self.lane_of(pages), self.local_of(pages) * self.page_size + offsets

    def split_slots(self, slots: np.ndarray) -> list[tuple[np.ndarray, np.ndarray]]:
        """Group global slots by lane.

        Returns:
            per lane, ``(token_index int64 [m], local_slot int64 [m])``: which of the given
            tokens live on that lane, and their slots inside its shard.
        """
        lanes, local = self.local_slots(slots)
        out = []
        for r in range(self.cp_size):
            idx = np.flatnonzero(lanes == r)
            out.append((idx, local[idx]))
        return out
