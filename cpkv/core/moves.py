"""The page moves journal: what each lane must apply to mirror the allocator's pools."""

from __future__ import annotations

import numpy as np

from cpkv.core.layout import PageLayout

__all__ = ["MoveJournal", "MovesNotApplied"]

_EMPTY_I32 = np.empty(0, dtype=np.int32)


class MovesNotApplied(RuntimeError):
    """A lane refused the page moves that rode in a step call (its record left the mirror's):
    the step did not run. Told apart from the step's own failures, which reset no lane."""


class MoveJournal:
    """Per lane, the local pages taken and released since the last drain, and the local
    pages that went from a request into the prefix cache (still held).

    Args:
        layout: the pool's page layout.
    """

    __slots__ = ("_cached", "_released", "_taken", "layout")

    def __init__(self, layout: PageLayout) -> None:
        self.layout = layout
        cp = layout.cp_size
        self._taken: list[list[np.ndarray]] = [[] for _ in range(cp)]
        self._released: list[list[np.ndarray]] = [[] for _ in range(cp)]
        self._cached: list[list[np.ndarray]] = [[] for _ in range(cp)]

    def record_taken(self, lane: int, local: np.ndarray) -> None:
        self._taken[lane].append(local)

    def record_released(self, lane: int, local: np.ndarray) -> None:
        self._released[lane].append(local)

    def record_cached(self, pages: np.ndarray) -> None:
        """Global ``pages`` that left a request for the prefix cache."""
        layout = self.layout
        lanes = layout.lane_of(pages)
        for r in np.unique(lanes):
            mine = layout.local_of(pages[lanes == r])
            self._cached[int(r)].append(mine.astype(np.int32, copy=False))

    def reset_lane(self, lane: int) -> None:
        """Forget ``lane``'s moves: it is reset whole, not page by page."""
        self._taken[lane], self._released[lane], self._cached[lane] = [], [], []

    def drain(self) -> list[tuple[np.ndarray, np.ndarray]]:
        """Per lane ``(taken, released)`` local pages (int32) since the last drain.

        NOTE: within one allocator operation releases (eviction, free) always precede
        takes, so a lane applies ``released`` first, then ``taken``.
        """
        out = [
            (_joined(taken), _joined(released))
            for taken, released in zip(self._taken, self._released, strict=True)
        ]
        cp = self.layout.cp_size
        self._taken = [[] for _ in range(cp)]
        self._released = [[] for _ in range(cp)]
        return out

    def drain_cached(self) -> list[np.ndarray]:
        """Per lane, ``int32`` local pages that went into the prefix cache since the last drain."""
        out = [_joined(c) for c in self._cached]
        self._cached = [[] for _ in range(self.layout.cp_size)]
        return out


def _joined(parts: list[np.ndarray]) -> np.ndarray:
    return np.concatenate(parts) if parts else _EMPTY_I32
