"""Which lanes take pages now: one object, written by whoever watches the lanes, read by
the allocator."""

from __future__ import annotations

__all__ = ["LaneAvailability"]


class LaneAvailability:
    """The lanes that are down (restarting): they give no pages and take no new ones.

    The coordinator's lane supervisor owns it and writes it; the allocator holds the same
    object and only reads it, so there is one copy of the lanes' state.

    Args:
        cp_size: number of lanes.
    """

    __slots__ = ("_down", "cp_size")

    def __init__(self, cp_size: int) -> None:
        assert cp_size >= 1, cp_size
        self.cp_size = cp_size
        self._down: set[int] = set()

    def set_available(self, lane: int, available: bool) -> None:
        assert 0 <= lane < self.cp_size, (lane, self.cp_size)
        if available:
            self._down.discard(lane)
        else:
            self._down.add(lane)

    def is_available(self, lane: int) -> bool:
        return lane not in self._down

    @property
    def down_lanes(self) -> list[int]:
        """Lanes that are down, ascending."""
        return sorted(self._down)

    def __bool__(self) -> bool:
        """True when some lane is down (the common case, none, is one cheap test)."""
        return bool(self._down)
