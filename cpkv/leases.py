"""Client leases: which client holds which requests, and when a silent client lapses.

Pure bookkeeping (no Ray, no clock of its own: callers pass ``now``), so the
coordinator's behaviour on a lapse is tested by stepping time.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable
from dataclasses import dataclass, field

__all__ = ["LeaseTable"]

# Lapsed leases remembered, so the client's next call can be told what was freed.
_MAX_REMEMBERED_LAPSES = 1024


@dataclass(slots=True)
class _Lease:
    lease_s: float
    expires_at: float
    rids: set[Hashable] = field(default_factory=set)


class LeaseTable:
    """Leases by client id, each holding the request ids that client created."""

    __slots__ = ("_lapsed", "_leases", "_owner", "num_expired_leases", "num_expired_requests")

    def __init__(self) -> None:
        self._leases: dict[str, _Lease] = {}
        self._owner: dict[Hashable, str] = {}
        self._lapsed: OrderedDict[str, tuple[float, list[Hashable]]] = OrderedDict()
        self.num_expired_leases = 0
        self.num_expired_requests = 0

    def open(self, client_id: str, lease_s: float, now: float) -> None:
        """Start (or refresh) ``client_id``'s lease of ``lease_s`` seconds."""
        assert lease_s > 0, lease_s
        self._lapsed.pop(client_id, None)
        lease = self._leases.get(client_id)
        if lease is None:
            self._leases[client_id] = _Lease(lease_s, now + lease_s)
        else:
            lease.lease_s = lease_s
            lease.expires_at = now + lease_s

    def renew(self, client_id: str, now: float) -> bool:
        """Push ``client_id``'s expiry out by its lease; False when it has no lease."""
        lease = self._leases.get(client_id)
        if lease is None:
            return False
        lease.expires_at = now + lease.lease_s
        return True

    def has(self, client_id: str) -> bool:
        return client_id in self._leases

    def hold(self, client_id: str | None, rid: Hashable) -> None:
        """Record that ``client_id`` created ``rid`` (a request held by no lease when None)."""
        if client_id is None or client_id not in self._leases or rid in self._owner:
            return
        self._owner[rid] = client_id
        self._leases[client_id].rids.add(rid)

    def release(self, rid: Hashable) -> None:
        """``rid`` was freed or lost: no lease holds it any more."""
        owner = self._owner.pop(rid, None)
        if owner is not None:
            self._leases[owner].rids.discard(rid)

    def close(self, client_id: str) -> list[Hashable]:
        """End ``client_id``'s lease; return the requests it still held (the caller frees them)."""
        lease = self._leases.pop(client_id, None)
        if lease is None:
            return []
        for rid in lease.rids:
            del self._owner[rid]
        return sorted(lease.rids, key=repr)

    def expire(self, now: float) -> dict[str, list[Hashable]]:
        """Close every lease past its expiry; return their held requests by client id.

        The lapse is remembered: :meth:`reopen_lapsed` tells the client what it lost.
        """
        lapsed = [cid for cid, lease in self._leases.items() if lease.expires_at <= now]
        out = {}
        for cid in lapsed:
            lease_s = self._leases[cid].lease_s
            out[cid] = self.close(cid)
            self._lapsed[cid] = (lease_s, out[cid])
            while len(self._lapsed) > _MAX_REMEMBERED_LAPSES:
                self._lapsed.popitem(last=False)
        self.num_expired_leases += len(out)
        self.num_expired_requests += sum(len(rids) for rids in out.values())
        return out

    def reopen_lapsed(self, client_id: str, now: float) -> list[Hashable] | None:
        """If ``client_id``'s lease lapsed, open it again and return the requests that were
        freed then; ``None`` when it had not lapsed."""
        lapsed = self._lapsed.pop(client_id, None)
        if lapsed is None:
            return None
        lease_s, rids = lapsed
        self.open(client_id, lease_s, now)
        return rids

    def forget_requests(self) -> None:
        """Every request is gone (the pool was reset); the leases stay."""
        for lease in self._leases.values():
            lease.rids.clear()
        self._owner.clear()

    def owner(self, rid: Hashable) -> str | None:
        return self._owner.get(rid)

    @property
    def num_leases(self) -> int:
        return len(self._leases)
