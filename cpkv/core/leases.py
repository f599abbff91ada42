"""Client leases: which client holds which requests, and when a silent client lapses.

Pure bookkeeping (no Ray, no clock of its own: callers pass ``now``), so the
coordinator's behaviour on a lapse is tested by stepping time. The table has a lock of
its own: renewals never wait behind the coordinator's other work.

A lease that passes its expiry is only *due*: :meth:`LeaseTable.due` names the due
leases with the process that holds each, the caller asks whether that process is still
making progress (a client whose renewer thread was starved by a busy interpreter is
alive; a stopped or dead one is not), then :meth:`LeaseTable.expire` lapses the ones it
could not confirm alive and :meth:`LeaseTable.extend` keeps the rest, for at most
:data:`MAX_SILENT_PERIODS` lease periods without a renewal.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Hashable
from dataclasses import dataclass, field

__all__ = ["LeaseTable"]

# Lapsed leases remembered, so the client's next call can be told what was freed.
_MAX_REMEMBERED_LAPSES = 1024
# A live process keeps a lease it stopped renewing for at most this many lease periods: a
# renewer starved by a busy interpreter wakes within seconds (the GIL's switch interval is
# 5 ms), while a client whose close never reached the coordinator (its process lives on,
# e.g. a pooled Ray worker) would otherwise hold its requests' pages for good.
MAX_SILENT_PERIODS = 10
# ... and for at least this long, whatever its period (a lease of 0.2 s would lapse a live
# process silent for 2 s).
MIN_SILENT_S = 30.0


@dataclass(slots=True)
class _Lease:
    lease_s: float
    expires_at: float
    renewed_at: float
    holder: dict | None = None
    rids: set[Hashable] = field(default_factory=set)


class LeaseTable:
    """Leases by client id, each holding the request ids (keys) that client extended.

    A request is held by the lease of every client that created or extended it (clients
    of one namespace share requests: a driver and its actors) and freed when the last of
    them lapses or closes; a request no leased client extended is held by none.
    """

    __slots__ = (
        "_holders",
        "_lapsed",
        "_leases",
        "_lock",
        "num_expired_leases",
        "num_expired_requests",
        "num_kept_alive",
    )

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._leases: dict[str, _Lease] = {}
        self._holders: dict[Hashable, set[str]] = {}
        # client id -> (lease_s, holder, requests freed) of leases that lapsed unseen.
        self._lapsed: OrderedDict[str, tuple[float, dict | None, list[Hashable]]] = OrderedDict()
        self.num_expired_leases = 0
        self.num_expired_requests = 0
        self.num_kept_alive = 0

    def open(self, client_id: str, lease_s: float, now: float, holder: dict | None = None) -> None:
        """Start (or refresh) ``client_id``'s lease of ``lease_s`` seconds.

        ``holder`` describes the client's process (node, pid, start time) for liveness
        checks. NOTE: a remembered lapse is kept: only the client's next call consumes it.
        """
        assert lease_s > 0, lease_s
        with self._lock:
            lease = self._leases.get(client_id)
            if lease is None:
                self._leases[client_id] = _Lease(lease_s, now + lease_s, now, holder)
            else:
                lease.lease_s = lease_s
                lease.expires_at = now + lease_s
                lease.renewed_at = now
                lease.holder = holder if holder is not None else lease.holder

    def renew(self, client_id: str, now: float) -> bool:
        """Push ``client_id``'s expiry out by its lease; False when it has none."""
        with self._lock:
            lease = self._leases.get(client_id)
            if lease is None:
                return False
            lease.expires_at = now + lease.lease_s
            lease.renewed_at = now
            return True

    def has(self, client_id: str) -> bool:
        return client_id in self._leases

    def hold(self, client_id: str | None, rid: Hashable) -> None:
        """Record that ``client_id`` created or extended ``rid`` (no hold when it has no
        lease)."""
        with self._lock:
            lease = self._leases.get(client_id) if client_id is not None else None
            if lease is None:
                return
            self._holders.setdefault(rid, set()).add(client_id)
            lease.rids.add(rid)

    def release(self, rid: Hashable) -> None:
        """``rid`` was freed or lost: no lease holds it any more."""
        with self._lock:
            for client_id in self._holders.pop(rid, ()):
                self._leases[client_id].rids.discard(rid)

    def close(self, client_id: str) -> list[Hashable]:
        """End ``client_id``'s lease; return the requests no other lease holds (the caller
        frees them)."""
        with self._lock:
            return self._close(client_id)

    def _close(self, client_id: str) -> list[Hashable]:
        lease = self._leases.pop(client_id, None)
        if lease is None:
            return []
        freed = []
        for rid in lease.rids:
            holders = self._holders[rid]
            holders.discard(client_id)
            if not holders:
                del self._holders[rid]
                freed.append(rid)
        return sorted(freed, key=repr)

    def due(self, now: float) -> dict[str, dict | None]:
        """Leases past their expiry: ``{client_id: holder}`` (nothing changes). A lease silent
        for :data:`MAX_SILENT_PERIODS` of its periods (and :data:`MIN_SILENT_S`) has no holder
        to ask: it lapses."""
        with self._lock:
            return {
                cid: lease.holder
                if now - lease.renewed_at < max(MAX_SILENT_PERIODS * lease.lease_s, MIN_SILENT_S)
                else None
                for cid, lease in self._leases.items()
                if lease.expires_at <= now
            }

    def extend(self, client_id: str, now: float) -> None:
        """The client's process was confirmed alive though it did not renew: keep its lease."""
        with self._lock:
            lease = self._leases.get(client_id)
            if lease is not None and lease.expires_at <= now:
                lease.expires_at = now + lease.lease_s
                self.num_kept_alive += 1

    def expire(self, now: float, only: set[str] | None = None) -> dict[str, list[Hashable]]:
        """Close every lease past its expiry (of ``only`` those clients, when given); return
        their held requests by client id.

        A lease renewed meanwhile is left alone. The lapse is remembered: the client's next
        call is told what was freed (:meth:`take_lapse`).
        """
        with self._lock:
            lapsed = [
                cid
                for cid, lease in self._leases.items()
                if lease.expires_at <= now and (only is None or cid in only)
            ]
            out = {}
            for cid in lapsed:
                lease = self._leases[cid]
                out[cid] = self._close(cid)
                earlier = self._lapsed.pop(cid, (0.0, None, []))[2]
                self._lapsed[cid] = (lease.lease_s, lease.holder, earlier + out[cid])
                while len(self._lapsed) > _MAX_REMEMBERED_LAPSES:
                    self._lapsed.popitem(last=False)
            self.num_expired_leases += len(out)
            self.num_expired_requests += sum(len(rids) for rids in out.values())
            return out

    def take_lapse(self, client_id: str, now: float) -> list[Hashable] | None:
        """If ``client_id``'s lease lapsed since its last call, forget the lapse, make sure
        its lease is open again and return the requests that were freed; ``None`` when it
        had not lapsed."""
        with self._lock:
            lapsed = self._lapsed.pop(client_id, None)
        if lapsed is None:
            return None
        lease_s, holder, rids = lapsed
        if not self.has(client_id):
            self.open(client_id, lease_s, now, holder)
        return rids

    def forget_requests(self) -> None:
        """Every request is gone (the pool was reset); the leases stay."""
        with self._lock:
            for lease in self._leases.values():
                lease.rids.clear()
            self._holders.clear()

    def holders(self, rid: Hashable) -> frozenset[str]:
        """The clients whose leases hold ``rid``."""
        with self._lock:
            return frozenset(self._holders.get(rid, ()))

    def lease_s(self, client_id: str) -> float | None:
        lease = self._leases.get(client_id)
        return None if lease is None else lease.lease_s

    @property
    def num_leases(self) -> int:
        return len(self._leases)
