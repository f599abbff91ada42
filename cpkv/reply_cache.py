"""A bounded cache of replies, so a call repeated after a lost answer gets the first one."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable
from typing import Any

__all__ = ["ReplyCache"]

_MISSING = object()


class ReplyCache:
    """The last ``capacity`` replies by call key, oldest dropped first.

    The coordinator keys client calls by ``(client id, call number)``; a lane
    shard keys page moves by their sequence number. A retry comes within a few
    calls of its original, so a bounded cache is enough.

    Args:
        capacity: replies kept (>= 1).
    """

    __slots__ = ("_replies", "capacity", "num_hits")

    def __init__(self, capacity: int) -> None:
        assert capacity >= 1, capacity
        self.capacity = capacity
        self._replies: OrderedDict[Hashable, Any] = OrderedDict()
        self.num_hits = 0

    def get(self, key: Hashable, default: Any = _MISSING) -> Any:
        """The reply remembered for ``key``; ``default`` (or KeyError) when there is none."""
        reply = self._replies.get(key, _MISSING)
        if reply is _MISSING:
            if default is _MISSING:
                raise KeyError(key)
            return default
        self.num_hits += 1
        return reply

    def __contains__(self, key: Hashable) -> bool:
        return key in self._replies

    def put(self, key: Hashable, reply: Any) -> Any:
        """Remember ``reply`` for ``key``; returns it."""
        self._replies[key] = reply
        if len(self._replies) > self.capacity:
            self._replies.popitem(last=False)
        return reply

    def clear(self) -> None:
        self._replies.clear()

    def __len__(self) -> int:
        return len(self._replies)
