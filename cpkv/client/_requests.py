"""The requests a client holds: those it allocated and has not freed, and the tokens each
held after its last ``allocate_extend`` here."""

from __future__ import annotations

from collections.abc import Hashable, Iterable

__all__ = ["LiveRequests"]


class LiveRequests:
    """A client's live requests.

    ``rids``: requests allocated and not freed. ``held``: tokens each request held after
    this client's last ``allocate_extend`` of it: where its next chunk starts in its partial
    page (the digest of that chunk depends on it); none once it stepped (its length unknown
    here).
    """

    def __init__(self) -> None:
        self.rids: set[Hashable] = set()
        self.held: dict[Hashable, int] = {}
        self._lost: list = []

    def forget(self, rids: Iterable[Hashable]) -> None:
        """Drop ``rids`` (freed, or lost with a lane or the pool)."""
        for rid in rids:
            self.rids.discard(rid)
            self.held.pop(rid, None)

    def lose_all(self) -> None:
        """The coordinator died: every request is lost; :meth:`take_lost` says which."""
        self._lost = sorted(self.rids, key=repr)
        self.forget(self._lost)

    def take_lost(self) -> list:
        """The requests :meth:`lose_all` lost, once."""
        lost, self._lost = self._lost, []
        return lost

    def clear(self) -> None:
        """Forget every request (the pool was reset, or let go of)."""
        self.rids.clear()
        self.held.clear()
