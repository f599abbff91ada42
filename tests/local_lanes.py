"""Lanes without Ray: LaneShards behind a transport the coordinator drives directly."""

from __future__ import annotations

from concurrent.futures import Future
from typing import Any

from cpkv.coordinator.channel import LaneDeadError
from cpkv.core.config import KVShape
from cpkv.lanes.shard import LaneShard


class LocalLaneTransport:
    """Runs each lane call at once on a plain :class:`LaneShard` (CPU tensors).

    ``kill(lane)`` makes calls fail as a dead actor's would until ``restart(lane)``
    gives the lane a fresh shard (a new incarnation), as Ray would.
    """

    def __init__(self, cp_size: int, num_pages: int, page_size: int, kv: KVShape) -> None:
        self._args = (num_pages, page_size, kv)
        self.shards = [LaneShard(r, num_pages, page_size, kv, "cpu") for r in range(cp_size)]
        self.dead: set[int] = set()
        self.calls: list[tuple[int, str]] = []

    def kill(self, lane: int) -> None:
        self.dead.add(lane)

    def restart(self, lane: int) -> None:
        self.shards[lane] = LaneShard(lane, *self._args, "cpu")
        self.dead.discard(lane)

    def submit(self, lane: int, method: str, *args: Any) -> Future:
        self.calls.append((lane, method))
        future: Future = Future()
        if lane in self.dead:
            future.set_exception(LaneDeadError(f"lane {lane} is dead"))
            return future
        shard = self.shards[lane]
        try:
            if method == "heartbeat":
                future.set_result((shard.incarnation, shard.num_held_pages))
            elif method == "reset":
                future.set_result(shard.reset(args[0]))
            else:
                future.set_result(getattr(shard, method)(*args))
        except Exception as e:
            future.set_exception(e)
        return future

    def result(self, handle: Future, timeout: float) -> Any:
        return handle.result(timeout=timeout)

    def done(self, handles: list[Future]) -> list[bool]:
        return [h.done() for h in handles]
