"""A client over a plain Coordinator without Ray: its actor calls run at once in process.

``PlainCoordinator`` stands for the coordinator's actor handle (its packed calls packed, as
``CoordinatorActor``'s are; its lanes' handles run on the LaneShards of the coordinator of
the moment, as lane actors outlive a coordinator's restart); :func:`plain_client` makes a
``CPKVClient`` on it once ``ray.get`` reads :class:`Answer` values (``patch_ray``). Hooks:
``dead = True`` makes every call fail as a dead actor's; ``lose(name, args)`` loses a call's
answer after it ran (a timeout); ``restart()`` is Ray's restart (a new coordinator, a new
epoch).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from cpkv.actors.wire import PACKED_CALLS, pack, unpack
from cpkv.coordinator.coordinator import Coordinator
from cpkv.core.config import CPConfig, KVShape
from tests.local_lanes import LocalLaneTransport

CONFIG = CPConfig(cp_size=2, page_size=4, num_pages_per_lane=32, max_reqs=16, max_context_len=512)
KV = KVShape(num_layers=1, num_heads=2, head_dim=8, dtype="float32")


class Answer:
    """A call's outcome, read by the patched ``ray.get`` or awaited (after ``delay`` s)."""

    def __init__(self, value: Any = None, error: BaseException | None = None) -> None:
        self.value, self.error = value, error
        self.delay = 0.0

    def __await__(self):
        if self.delay:
            yield from asyncio.sleep(self.delay).__await__()
        if self.error is not None:
            raise self.error
        return self.value


def patch_ray(monkeypatch) -> None:
    import ray

    import cpkv.actors.liveness as liveness

    def get(ref, timeout=None):
        if isinstance(ref, list):
            return [get(r, timeout) for r in ref]
        if ref.error is not None:
            raise ref.error
        return ref.value

    monkeypatch.setattr(ray, "get", get)
    monkeypatch.setattr(liveness, "process_holder", lambda: {"node_id": "n", "pid": 1})


class PlainCoordinator:
    """The coordinator's actor handle, over a plain :class:`Coordinator`."""

    def __init__(self) -> None:
        self.dead = False
        self.lose: Callable[[str, tuple], bool] | None = None
        self.delays: dict[str, float] = {}  # method -> seconds its answer takes, awaited
        self.restart()

    def restart(self) -> None:
        transport = LocalLaneTransport(CONFIG.cp_size, CONFIG.num_pages_per_lane, 4, KV)
        self.core = Coordinator(CONFIG, KV, transport, heartbeat_s=0, lane_restart_timeout_s=5)
        self.dead = False

    def _run(self, name: str, args: tuple) -> Any:
        core = self.core
        if name == "hello":
            lanes = [_LaneHandle(self, r) for r in range(CONFIG.cp_size)]
            return {**core.hello(*args), "lanes": lanes, "lane_names": []}
        if name in PACKED_CALLS:
            out = getattr(core, name)(*unpack(args[0]))
            return pack(out if name == "free" else (out, core.fence()))
        return getattr(core, name)(*args)

    def __getattr__(self, name: str) -> Any:
        import ray

        def remote(*args: Any) -> Answer:
            if self.dead:
                return Answer(error=ray.exceptions.RayActorError())
            out = self._run(name, args)
            logical = unpack(args[0]) if name in PACKED_CALLS else args
            if self.lose is not None and self.lose(name, logical):
                return Answer(error=ray.exceptions.GetTimeoutError("answer lost"))
            answer = Answer(out)
            answer.delay = self.delays.get(name, 0.0)
            return answer

        return type("Method", (), {"remote": staticmethod(remote)})()


class _LaneHandle:
    """A lane actor's handle: its calls run on the lane's shard now."""

    def __init__(self, coordinator: PlainCoordinator, lane: int) -> None:
        self._coordinator, self._lane = coordinator, lane

    def __getattr__(self, method: str) -> Any:
        def remote(*args: Any) -> Answer:
            shard = self._coordinator.core._transport.shards[self._lane]
            try:
                return Answer(getattr(shard, method)(*args))
            except Exception as e:
                return Answer(error=e)

        return type("Method", (), {"remote": staticmethod(remote)})()


def plain_client(coordinator: PlainCoordinator, **kwargs: Any):
    from cpkv.client import CPKVClient

    kwargs.setdefault("timeout_s", 1.0)
    return CPKVClient(coordinator, **kwargs)
