"""What the allocator counts, for ``CPAllocator.stats()``."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

__all__ = ["Counters"]

# The allocator's log, whichever of its parts writes to it.
logger = logging.getLogger("cpkv.core.allocator")


@dataclass(slots=True)
class Counters:
    """Counters since the allocator was built (plain ints)."""

    extend_allocations: int = 0
    decode_allocations: int = 0
    pages_allocated: int = 0
    pages_evicted: int = 0
    evict_calls: int = 0
    evict_tokens_requested: int = 0
    capacity_waits: int = 0
    cached_tokens_hit: int = 0
    requests_lost: int = 0
    fallbacks_by_reason: dict[str, int] = field(default_factory=dict)
    _logged_reasons: set[str] = field(default_factory=set, init=False, repr=False, compare=False)

    def count_fallback(self, reason: str, num_tokens: int) -> None:
        """Count an extend drawn in rotation because no owner plan applied; log the first
        of each reason."""
        by = self.fallbacks_by_reason
        by[reason] = by.get(reason, 0) + 1
        if reason not in self._logged_reasons:
            self._logged_reasons.add(reason)
            logger.warning(
                "owner plan unavailable (reason=%s, %d tokens); drawing pages in rotation. "
                "Logged once per reason; counts are in stats()['fallbacks_by_reason'].",
                reason,
                num_tokens,
            )

    def as_dict(self) -> dict:
        """The counters by name, in ``stats()`` order (a copy)."""
        return {
            "extend_allocations": self.extend_allocations,
            "decode_allocations": self.decode_allocations,
            "pages_allocated": self.pages_allocated,
            "pages_evicted": self.pages_evicted,
            "evict_calls": self.evict_calls,
            "evict_tokens_requested": self.evict_tokens_requested,
            "capacity_waits": self.capacity_waits,
            "cached_tokens_hit": self.cached_tokens_hit,
            "requests_lost": self.requests_lost,
            "fallbacks_by_reason": dict(self.fallbacks_by_reason),
        }
