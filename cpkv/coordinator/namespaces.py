"""Request namespaces: which namespace each client's rids live in, and the core's keys for them.

A client's ``rid`` is keyed in the core as :class:`RequestKey` ``(namespace, rid)`` (clients
that share a namespace share their requests); a call without a client id keys the bare rid.
The lanes know each namespace by a small id (the owner of the pages its requests take).
:func:`for_caller` maps an answer's keys back to the caller's rids.

NOTE: :class:`Namespaces` has no lock of its own: the coordinator's lock guards it.
"""

from __future__ import annotations

import dataclasses
from collections import OrderedDict
from collections.abc import Hashable
from typing import Any

from cpkv.core.allocator import ExtendAllocation
from cpkv.core.validate import RequestKey, check_rid, check_rids, user_rid
from cpkv.errors import InvalidRequestError, LaneUnavailableError, LeaseExpiredError

__all__ = ["NO_NAMESPACE_ID", "Namespaces", "for_caller", "namespace_of"]

# Namespace id of requests made without a client id (tests, tools); clients get 2, 3, ...
NO_NAMESPACE_ID = 1
# Closed clients whose namespace is remembered for a call that raced the close (~200 bytes
# each).
_MAX_CLOSED_CLIENTS = 4096


class Namespaces:
    """Client id -> namespace, and namespace -> the id the lanes know it by.

    A client that closes (:meth:`leave`) is counted out of its namespace but remembered, for
    its late calls, among the last :data:`_MAX_CLOSED_CLIENTS` closed; a namespace's id goes
    once no client and no request is left in it (:meth:`drop`): a coordinator outlives
    many short clients.
    NOTE: ids are never reused (a forgotten namespace that comes back gets a new one), so a
    page a lane still records under an old id is never taken for another namespace's.
    """

    def __init__(self) -> None:
        self._of_client: dict[str, str] = {}
        self._closed: OrderedDict[str, str] = OrderedDict()
        self._ids: dict[str, int] = {}
        self._num_clients: dict[str, int] = {}
        self._next_id = NO_NAMESPACE_ID + 1

    def join(self, client_id: str, namespace: str | None) -> int:
        """Put ``client_id``'s rids in ``namespace`` (default: one of its own); its id."""
        ns = client_id if namespace is None else str(namespace)
        self._closed.pop(client_id, None)
        old = self._of_client.get(client_id)
        if old != ns:
            if old is not None:
                self._num_clients[old] -= 1
            self._of_client[client_id] = ns
            self._num_clients[ns] = self._num_clients.get(ns, 0) + 1
        return self._id(ns)

    def leave(self, client_id: str) -> str | None:
        """Count a closed client out of its namespace; the namespace it left without clients,
        if any (its id goes with :meth:`drop` once no request lives in it)."""
        ns = self._of_client.pop(client_id, None)
        if ns is None:
            return None
        self._closed[client_id] = ns  # a call that raced its close still finds its namespace
        while len(self._closed) > _MAX_CLOSED_CLIENTS:
            self._closed.popitem(last=False)
        self._num_clients[ns] -= 1
        if self._num_clients[ns]:
            return None
        del self._num_clients[ns]
        return ns

    def drop(self, ns: str) -> None:
        """Forget an empty namespace's id (no client counted in it, no request lives in it)."""
        assert not self._num_clients.get(ns), (ns, self._num_clients.get(ns))
        self._ids.pop(ns, None)

    def _id(self, ns: str) -> int:
        ns_id = self._ids.get(ns)
        if ns_id is None:
            ns_id = self._ids[ns] = self._next_id
            self._next_id += 1
        return ns_id

    def namespace(self, client_id: str | None) -> str | None:
        if client_id is None:
            return None
        ns = self._of_client.get(client_id)
        return ns if ns is not None else self._closed.get(client_id, client_id)

    def key(self, client_id: str | None, rid) -> Hashable:
        """The core's key of the caller's ``rid``: its id inside the caller's namespace."""
        rid = check_rid(rid)
        ns = self.namespace(client_id)
        return rid if ns is None else RequestKey(ns, rid)

    def keys(self, client_id: str | None, rids) -> list[Hashable]:
        return [self.key(client_id, rid) for rid in check_rids(rids)]

    def keyed_items(self, client_id: str | None, items) -> list[tuple[Hashable, Any]]:
        if isinstance(items, (str, bytes)) or not isinstance(items, (list, tuple)):
            raise InvalidRequestError(f"a batch is a list of (rid, tokens), got {items!r:.60}")
        for i, item in enumerate(items):
            if not isinstance(item, (list, tuple)) or len(item) != 2:
                raise InvalidRequestError(f"batch item {i} = {item!r:.60} is not (rid, tokens)")
        return [(self.key(client_id, rid), tokens) for rid, tokens in items]

    def owner_id(self, client_id: str | None) -> int:
        """The id the lanes know the caller's namespace by (the owner of pages it takes)."""
        ns = self.namespace(client_id)
        return NO_NAMESPACE_ID if ns is None else self._id(ns)


def namespace_of(key: Hashable) -> str | None:
    return key.namespace if isinstance(key, RequestKey) else None


def for_caller(answer: Any) -> Any:
    """The answer as the caller names its requests (its ids, not the namespaced keys)."""
    if isinstance(answer, ExtendAllocation) and isinstance(answer.rid, RequestKey):
        return dataclasses.replace(answer, rid=answer.rid.rid)
    if isinstance(answer, list) and answer and isinstance(answer[0], ExtendAllocation):
        return [for_caller(a) for a in answer]
    if isinstance(answer, LaneUnavailableError):
        rids = [user_rid(k) for k in answer.rids]
        return LaneUnavailableError(answer.lane, rids, answer.detail)
    if isinstance(answer, LeaseExpiredError):
        return LeaseExpiredError([user_rid(k) for k in answer.rids])
    return answer
