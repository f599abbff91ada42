"""A bounded cache of replies, so a call repeated after a lost answer gets the first one."""

from __future__ import annotations

import bisect
from collections import OrderedDict
from collections.abc import Callable, Hashable
from typing import Any

__all__ = ["DROPPED", "ReplyCache"]

_MISSING = object()
# Numbered streams whose forgotten numbers are kept (the least recently forgotten go first).
_MAX_STREAMS = 4096


class _Dropped:
    """Stands for a reply given once and no longer kept (the byte bound): the call took
    effect, and a repeat of it must not run again."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "DROPPED"


DROPPED = _Dropped()


class ReplyCache:
    """The last replies by call key, oldest dropped first, bounded in count and in bytes.

    The coordinator keys client calls by ``(client id, call id)`` and tags each reply
    with what was asked (so a call id reused for another call is caught); a lane shard
    keys page moves by their sequence number. A retry comes within a few calls of its
    original, so a bounded cache is enough.

    Args:
        capacity: replies kept (>= 1).
        max_bytes: bytes of replies kept (each reply's size as given to :meth:`put`);
            ``None`` for no bound. Past it the oldest replies are replaced by :data:`DROPPED`
            (their keys stay, so a repeat is still recognised, never run twice).
        numbered: ``key -> (stream, number)`` for keys a caller numbers (``None`` for other
            keys). Past ``capacity`` the oldest keys are forgotten; of a numbered stream the
            numbers forgotten are kept (as runs: a caller's numbers come nearly in order), so
            :meth:`is_forgotten` still knows a late repeat, and a number never seen is new
            whenever it comes (for the last :data:`_MAX_STREAMS` streams that forgot one).
    """

    __slots__ = (
        "_forgotten",
        "_numbered",
        "_replies",
        "_sized",
        "capacity",
        "max_bytes",
        "nbytes",
        "num_hits",
    )

    def __init__(
        self,
        capacity: int,
        max_bytes: int | None = None,
        numbered: Callable[[Hashable], tuple[Hashable, int] | None] | None = None,
    ) -> None:
        assert capacity >= 1, capacity
        assert max_bytes is None or max_bytes >= 0, max_bytes
        self.capacity = capacity
        self.max_bytes = max_bytes
        self._replies: OrderedDict[Hashable, tuple[Any, Any, int]] = OrderedDict()
        # NOTE: the keys whose reply still holds bytes, oldest first, so the byte bound drops
        # them without walking the dropped ones (a walk cost ~150 us a put with 1024 kept).
        self._sized: OrderedDict[Hashable, None] = OrderedDict()
        self._numbered = numbered
        self._forgotten: OrderedDict[Hashable, _Runs] = OrderedDict()
        self.nbytes = 0
        self.num_hits = 0

    def get(self, key: Hashable, default: Any = _MISSING) -> Any:
        """The reply remembered for ``key``; ``default`` (or KeyError) when there is none."""
        entry = self._replies.get(key)
        if entry is None:
            if default is _MISSING:
                raise KeyError(key)
            return default
        self.num_hits += 1
        return entry[0]

    def peek(self, key: Hashable, default: Any = None) -> Any:
        """:meth:`get` that does not count as a repeat answered."""
        entry = self._replies.get(key)
        return default if entry is None else entry[0]

    def tag(self, key: Hashable) -> Any:
        """The tag :meth:`put` stored beside ``key``'s reply (KeyError when none)."""
        return self._replies[key][1]

    def __contains__(self, key: Hashable) -> bool:
        return key in self._replies

    def is_forgotten(self, key: Hashable) -> bool:
        """Whether ``key`` had a reply that the count bound forgot (a late repeat)."""
        numbered = self._numbered(key) if self._numbered is not None else None
        if numbered is None or key in self._replies:
            return False
        runs = self._forgotten.get(numbered[0])
        return runs is not None and numbered[1] in runs

    def put(self, key: Hashable, reply: Any, *, tag: Any = None, nbytes: int = 0) -> Any:
        """Remember ``reply`` (of ``nbytes``) for ``key`` with ``tag``; returns it."""
        old = self._replies.pop(key, None)
        if old is not None and old[2]:
            self.nbytes -= old[2]
            del self._sized[key]
        if self.max_bytes is not None and nbytes > self.max_bytes:
            # NOTE: too big to keep at all: dropped at once, not after every other reply.
            self._replies[key] = (DROPPED, tag, 0)
            nbytes = 0
        else:
            self._replies[key] = (reply, tag, nbytes)
        if nbytes:
            self.nbytes += nbytes
            self._sized[key] = None
        while len(self._replies) > self.capacity:
            oldest, (_, _, size) = self._replies.popitem(last=False)
            if size:
                self.nbytes -= size
                del self._sized[oldest]
            if self._numbered is not None:
                self._forget_numbered(oldest)
        if self.max_bytes is not None:
            while self.nbytes > self.max_bytes:
                k, _ = self._sized.popitem(last=False)
                _reply, old_tag, size = self._replies[k]
                self._replies[k] = (DROPPED, old_tag, 0)
                self.nbytes -= size
        return reply

    def forget_stream(self, stream: Hashable) -> None:
        """Forget what the count bound forgot of ``stream`` (no repeat of it can come)."""
        self._forgotten.pop(stream, None)

    def _forget_numbered(self, key: Hashable) -> None:
        numbered = self._numbered(key)
        if numbered is None:
            return
        stream, number = numbered
        runs = self._forgotten.pop(stream, None) or _Runs()
        runs.add(number)
        self._forgotten[stream] = runs  # the most recently forgotten stream last
        if len(self._forgotten) > _MAX_STREAMS:
            self._forgotten.popitem(last=False)

    def clear(self) -> None:
        self._replies.clear()
        self._sized.clear()
        self._forgotten.clear()
        self.nbytes = 0

    def __len__(self) -> int:
        return len(self._replies)


class _Runs:
    """A set of integers kept as sorted disjoint runs ``[first, last]``; adding the next
    number of the last run (the common case) is O(1)."""

    __slots__ = ("_firsts", "_lasts")

    def __init__(self) -> None:
        self._firsts: list[int] = []
        self._lasts: list[int] = []

    def __contains__(self, n: int) -> bool:
        i = bisect.bisect_right(self._firsts, n) - 1
        return i >= 0 and n <= self._lasts[i]

    def add(self, n: int) -> None:
        firsts, lasts = self._firsts, self._lasts
        if firsts and lasts[-1] + 1 == n:
            lasts[-1] = n
            return
        i = bisect.bisect_right(firsts, n) - 1  # the run starting at or before n
        if i >= 0 and n <= lasts[i]:
            return
        joins_left = i >= 0 and lasts[i] + 1 == n
        joins_right = i + 1 < len(firsts) and firsts[i + 1] == n + 1
        if joins_left and joins_right:
            lasts[i] = lasts.pop(i + 1)
            del firsts[i + 1]
        elif joins_left:
            lasts[i] = n
        elif joins_right:
            firsts[i + 1] = n
        else:
            firsts.insert(i + 1, n)
            lasts.insert(i + 1, n)

    def __len__(self) -> int:
        """Runs held."""
        return len(self._firsts)
