"""A bounded cache of replies, so a call repeated after a lost answer gets the first one."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Hashable
from typing import Any

__all__ = ["DROPPED", "ReplyCache"]

_MISSING = object()


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
        numbered: ``key -> (stream, number)`` for keys a caller numbers in increasing order
            (``None`` for other keys). Past ``capacity`` the oldest keys are forgotten; of a
            numbered stream the highest number forgotten is kept, so :meth:`is_forgotten`
            still knows a late repeat of any key at or below it.
    """

    __slots__ = (
        "_forgotten_upto",
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
        self._forgotten_upto: dict[Hashable, int] = {}
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
        """Whether ``key`` is not kept but numbered at or below a key of its stream that the
        count bound forgot: an old key (a late repeat), never a new one."""
        numbered = self._numbered(key) if self._numbered is not None else None
        if numbered is None or key in self._replies:
            return False
        upto = self._forgotten_upto.get(numbered[0])
        return upto is not None and numbered[1] <= upto

    def put(self, key: Hashable, reply: Any, *, tag: Any = None, nbytes: int = 0) -> Any:
        """Remember ``reply`` (of ``nbytes``) for ``key`` with ``tag``; returns it."""
        old = self._replies.pop(key, None)
        if old is not None and old[2]:
            self.nbytes -= old[2]
            del self._sized[key]
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
        self._forgotten_upto.pop(stream, None)

    def _forget_numbered(self, key: Hashable) -> None:
        numbered = self._numbered(key)
        if numbered is not None:
            stream, number = numbered
            if number > self._forgotten_upto.get(stream, number - 1):
                self._forgotten_upto[stream] = number

    def clear(self) -> None:
        self._replies.clear()
        self._sized.clear()
        self._forgotten_upto.clear()
        self.nbytes = 0

    def __len__(self) -> int:
        return len(self._replies)
