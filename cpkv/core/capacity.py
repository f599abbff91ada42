"""What each lane can give now, eviction from the prefix cache to make room, the rotation
(water-fill) that spreads fallback pages, and the capacity wait when pages cannot be had."""

from __future__ import annotations

from collections.abc import Callable
from typing import NoReturn

import numpy as np

from cpkv.core.availability import LaneAvailability
from cpkv.core.counters import Counters
from cpkv.core.pools import PagePools
from cpkv.core.prefix_cache import PrefixCache
from cpkv.errors import KVCapacityWaitError

__all__ = ["LaneCapacity"]

_EMPTY_I32 = np.empty(0, dtype=np.int32)


class LaneCapacity:
    """Takes pages for the allocator: from the free pools, evicting cached pages for the
    lanes that are short, never from a lane that is down.

    Args:
        pools: every lane's free pages.
        cache: the prefix cache to evict from.
        availability: the lanes that are down (read only).
        counters: the allocator's counters (evictions, waits, pages taken).
    """

    __slots__ = ("_availability", "_cache", "_counters", "_pools", "layout", "max_evict_attempts")

    def __init__(
        self,
        pools: PagePools,
        cache: PrefixCache,
        availability: LaneAvailability,
        counters: Counters,
    ) -> None:
        self.layout = pools.layout
        self._pools = pools
        self._cache = cache
        self._availability = availability
        self._counters = counters
        self.max_evict_attempts = max(2, min(8, self.layout.cp_size))

    def available_pages_per_lane(self) -> np.ndarray:
        """``int64 [cp_size]`` free pages each lane can give now (0 on a lane that is down)."""
        free = self._pools.num_free_pages_per_lane()
        if self._availability:
            free[self._availability.down_lanes] = 0
        return free

    def rotation_owners(self, num_pages: int, reserved: np.ndarray | None = None) -> np.ndarray:
        """Owners for pages drawn in rotation, starting at the lane with most free pages.

        A lane leaves the rotation once its free plus evictable pages are used up,
        so a fallback step never waits while other lanes could still serve it.
        ``reserved`` pages per lane are already promised to owner plans of the same step.

        Returns:
            ``int32 [num_pages]`` owner lane per page.
        """
        if num_pages == 0:
            return _EMPTY_I32
        cp = self.layout.cp_size
        if cp == 1:  # one lane takes every page (secure() checks it has them)
            return np.zeros(num_pages, dtype=np.int32)
        free = self.available_pages_per_lane()
        if reserved is not None:
            free = free - reserved
        evictable = self._cache.num_evictable_pages_per_lane
        if self._availability:
            evictable[self._availability.down_lanes] = 0  # a lane that is down gives nothing
        # NOTE: the common case (every lane has room for its share) on Python ints: a
        # handful of numpy calls on cp-long arrays cost ~30 us a step (measured).
        free_l, evictable_l = free.tolist(), evictable.tolist()
        order_l = sorted(range(cp), key=lambda r: -free_l[r])  # stable: ties by lane id
        cap_l = [max(0, free_l[r] + evictable_l[r]) for r in order_l]
        base, extra = divmod(num_pages, cp)
        order = np.array(order_l, dtype=np.int32)
        if sum(cap_l) < num_pages or all(c >= base + (i < extra) for i, c in enumerate(cap_l)):
            return order[np.arange(num_pages) % cp]
        cap = np.array(cap_l, dtype=np.int64)
        # Water-fill: every lane gets min(cap, level) for the highest level that fits,
        # the rest one more each in rotation order, so unsaturated lanes stay within
        # a page of each other.
        level = 0
        for c in np.unique(cap):
            if np.minimum(cap, c).sum() > num_pages:
                break
            level = int(c)
        open_lanes = int((cap > level).sum())
        if open_lanes:
            level += (num_pages - int(np.minimum(cap, level).sum())) // open_lanes
        counts = np.minimum(cap, level)
        room = np.flatnonzero(cap > counts)
        counts[room[: num_pages - int(counts.sum())]] += 1
        # Interleave: round j visits, in rotation order, the lanes with > j pages.
        rounds = np.concatenate([np.arange(c) for c in counts])
        rank = np.repeat(np.arange(cp), counts)
        return order[rank[np.lexsort((rank, rounds))]]

    def take_pages(self, planner: Callable[[], np.ndarray], *, reason: str) -> np.ndarray:
        """Take the pages ``planner`` names (an owner lane per page), evicting for the lanes
        that are short; ``planner`` is asked again after each eviction.

        Args:
            planner: returns ``int32`` owner lanes, one per page wanted.
            reason: the wait's reason if the lanes stay short (unless one is down).

        Returns:
            ``int32`` global page ids, one per owner, in order.

        Raises:
            KVCapacityWaitError: still short after eviction (nothing taken).
        """
        owners = self.secure(planner, reason=reason)
        pages = self._pools.take(owners)
        self._counters.pages_allocated += int(owners.shape[0])
        return pages

    def raise_wait(self, required: np.ndarray, reason: str, message: str) -> NoReturn:
        """Raise KVCapacityWaitError with the per-lane vectors for ``required`` pages."""
        available = self.available_pages_per_lane()
        deficit = np.maximum(0, required - available)
        self._counters.capacity_waits += 1
        raise KVCapacityWaitError(
            message,
            required_by_owner=required.tolist(),
            available_by_owner=available.tolist(),
            deficit_by_owner=deficit.tolist(),
            reason=reason,
        )

    def secure(self, planner: Callable[[], np.ndarray], *, reason: str) -> np.ndarray:
        """Make the planned pages free, evicting for the short lanes; take none.

        Returns:
            The owners ``planner`` last answered, all free now.

        Raises:
            KVCapacityWaitError: still short after eviction.
        """
        layout, counters = self.layout, self._counters
        owners = planner()
        for _attempt in range(self.max_evict_attempts):
            required = layout.count_lanes(owners)
            deficit = np.maximum(0, required - self.available_pages_per_lane())
            if not deficit.any():
                return owners
            if self._availability and deficit[self._availability.down_lanes].any():
                break  # a restarting lane: eviction cannot help it
            counters.evict_calls += 1
            # NOTE: deficits are in owner-lane pages already; never scale by cp_size.
            counters.evict_tokens_requested += int(deficit.sum()) * layout.page_size
            result = self._cache.evict(deficit)
            if result.num_pages == 0:
                break
            counters.pages_evicted += result.num_pages
            for r, pages in enumerate(result.freed_pages):
                self._pools.release_local(r, layout.local_of(pages))
            owners = planner()
        required = layout.count_lanes(owners)
        deficit = np.maximum(0, required - self.available_pages_per_lane())
        if not deficit.any():
            return owners
        down = [r for r in self._availability.down_lanes if deficit[r]]
        if down:
            reason = "lane_unavailable"
            message = f"lanes {down} are restarting; {int(required.sum())} pages wanted"
        else:
            message = f"{int(required.sum())} pages wanted after eviction"
        self.raise_wait(required, reason, message)
