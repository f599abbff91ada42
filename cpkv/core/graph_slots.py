"""Step-graph slots: which clients may send their steps through a compiled graph.

A client's compiled graph to the coordinator runs in a loop on one of the coordinator's
threads (Ray's ``_ray_system`` concurrency group) for as long as the graph lives. A graph
its client tore down gives its thread back; the graph of a client that died without tearing
it down keeps its thread forever (the loop waits on a channel nobody writes or closes). So
the coordinator grants at most as many graphs as it has threads for, and counts a slot whose
holder went away without giving it back as lost: its thread is not free again, unless that
client was only paused and gives it back once its graph comes down. A client
that is refused sends its steps as ordinary calls, which are slower but behave the same.

Pure bookkeeping (no Ray), with a lock of its own: a claim never waits behind a decision.
"""

from __future__ import annotations

import threading

__all__ = ["GraphSlots"]


class GraphSlots:
    """At most ``num_slots`` step graphs held at once, one per client.

    Args:
        num_slots: the graphs the coordinator has threads for.
    """

    __slots__ = ("_abandoned", "_holders", "_lock", "num_lost", "num_slots")

    def __init__(self, num_slots: int) -> None:
        if num_slots < 0:
            raise ValueError(f"num_slots={num_slots} must be >= 0")
        self.num_slots = num_slots
        self.num_lost = 0
        self._holders: set[str] = set()
        # NOTE: at most num_slots: only a holder is abandoned, and holders fit the slots.
        self._abandoned: set[str] = set()
        self._lock = threading.Lock()

    @property
    def num_free(self) -> int:
        return self.num_slots - self.num_lost - len(self._holders)

    @property
    def num_held(self) -> int:
        return len(self._holders)

    def claim(self, client_id: str) -> bool:
        """Give ``client_id`` a slot (it keeps the one it holds); False when none is free."""
        with self._lock:
            if client_id in self._holders:
                return True
            if self.num_free <= 0:
                return False
            self._holders.add(client_id)
            return True

    def release(self, client_id: str) -> bool:
        """``client_id`` tore its graph down: its slot is free again, one counted lost too
        (a client only paused past its lease: its loop ended now). False if it held none."""
        with self._lock:
            if client_id in self._holders:
                self._holders.discard(client_id)
                return True
            if client_id in self._abandoned:
                self._abandoned.discard(client_id)
                self.num_lost -= 1
                return True
            return False

    def abandon(self, client_id: str) -> bool:
        """``client_id`` went away holding a slot (its lease closed or lapsed): the slot's
        thread stays with the dead graph, so the slot is lost. False if it held none."""
        with self._lock:
            if client_id not in self._holders:
                return False
            self._holders.discard(client_id)
            self._abandoned.add(client_id)
            self.num_lost += 1
            return True
