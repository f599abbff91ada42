"""The client's page-move fence: per lane, the latest page move the coordinator had decided
in any answer this client got, and whether those moves may still wait at the coordinator (a
write waits for the moves of its own allocation)."""

from __future__ import annotations

import threading
import time

from cpkv.core.steps import superseded

__all__ = ["MoveFence"]


class MoveFence:
    """Per lane, the last page move the coordinator had decided at our last allocation, and
    when it came: for ``move_flush_s`` after it, its moves may still wait there."""

    def __init__(self, move_flush_s: float) -> None:
        self.move_flush_s = move_flush_s
        self._fence: list | None = None
        self._fence_at = -float("inf")
        self._lock = threading.Lock()

    def take(self, out):
        """Keep the latest move of each lane seen in any answer: answers of concurrent calls
        arrive in any order, and a write must wait for the moves of its own allocation."""
        answer, fence = out
        self.merge(fence, waiting=True)
        return answer

    def merge(self, fence: list, waiting: bool) -> None:
        """Take ``fence`` where it is later than ours; ``waiting``: its moves may still wait
        at the coordinator (an allocation's answer), else they were sent (``lane_fence``)."""
        with self._lock:
            self._fence = fence if self._fence is None else _later_fence(self._fence, fence)
            self._fence_at = time.monotonic() if waiting else -float("inf")

    def current(self) -> list | None:
        """Per lane, the latest page move seen (``None``: no allocation answered yet)."""
        return self._fence

    def waiting(self) -> bool:
        """Whether the fence's moves may still wait at the coordinator for a step (they are
        sent within ``move_flush_s`` of the answer that named them)."""
        return time.monotonic() - self._fence_at < self.move_flush_s


def _later_fence(old: list, new: list) -> list:
    """Per lane the later of two ``(generation, seq)`` marks (generations are
    ``"{epoch}:{n}"``, n growing; a new epoch wins)."""
    out = []
    for a, b in zip(old, new, strict=True):
        (ga, sa), (gb, sb) = a, b
        if ga == gb:
            out.append((ga, max(sa, sb)))
            continue
        out.append(a if ga is not None and superseded(gb or "", ga) else b)
    return out
