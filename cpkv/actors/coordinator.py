"""CoordinatorActor: the Ray shell over :class:`cpkv.coordinator.coordinator.Coordinator`.

It holds no logic of its own: it finds its lanes by name (its constructor takes
only plain values, so a restart never depends on objects in Ray's object store,
ray-project/ray#53727), wraps them in a :class:`RayLaneTransport` and delegates
every call. Pool gauges go to Ray's metrics (Prometheus on a cluster).
"""

from __future__ import annotations

import logging
import threading
from typing import Any

import ray

from cpkv.actors.liveness import ProcessLiveness
from cpkv.actors.malloc import fix_malloc_thresholds
from cpkv.actors.ray_env import NAMESPACE
from cpkv.actors.transport import CompiledRayLaneTransport, RayLaneTransport
from cpkv.actors.wire import pack, unpack
from cpkv.coordinator.coordinator import Coordinator
from cpkv.core.config import CPConfig, KVShape
from cpkv.errors import InvalidRequestError

__all__ = ["CoordinatorActor"]

logger = logging.getLogger("cpkv.coordinator.coordinator")


class _Metrics:
    """Pages per lane and capacity waits as Ray metrics (Prometheus on a cluster)."""

    def __init__(self) -> None:
        try:
            from ray.util.metrics import Counter, Gauge

            self._pages = Gauge("cpkv_pages", "pages per lane by state", tag_keys=("lane", "state"))
            self._waits = Counter("cpkv_capacity_waits", "KVCapacityWaitError raised")
            self._evicted = Counter("cpkv_pages_evicted", "prefix-cache pages evicted")
        except Exception:  # metrics are optional: never fail the coordinator for them
            self._pages = None
        self._last = {"capacity_waits": 0, "pages_evicted": 0}
        self._lock = threading.Lock()  # stats() runs on two threads: a delta counted once

    def update(self, stats: dict) -> None:
        if self._pages is None:
            return
        with self._lock:
            for state in ("free", "used", "cached"):
                for lane, value in enumerate(stats[state]):
                    self._pages.set(value, tags={"lane": str(lane), "state": state})
            for name, counter in (
                ("capacity_waits", self._waits),
                ("pages_evicted", self._evicted),
            ):
                delta = stats[name] - self._last[name]
                if delta > 0:
                    counter.inc(delta)
                self._last[name] = stats[name]


# Clients that may send their steps through a compiled graph of their own at once: each
# graph's loop holds one thread of the ``_ray_system`` group while it lives (the group has
# one more: a client whose lease lapsed while it lived may still run its graph there).
_STEP_GRAPHS = 4
# The steps a client's graph may run (see run_step).
_GRAPH_STEPS = frozenset({"prefill", "prefill_batch", "decode"})


# NOTE: threaded, so stats() and check() answer while another call waits on a lane;
# every method takes the coordinator's lock for its state. Leases and status have
# concurrency groups of their own: a renewal or stats() never waits for a free thread
# behind calls stuck on a lane (a hung lane must not lapse every idle client's lease).
@ray.remote(
    num_cpus=0,
    max_restarts=2,
    max_task_retries=0,
    max_concurrency=16,
    concurrency_groups={
        "lease": 2,
        "close": 2,
        "status": 2,
        "check": 2,
        "_ray_system": _STEP_GRAPHS + 1,
    },
)
class CoordinatorActor:
    """Delegates to :class:`cpkv.coordinator.coordinator.Coordinator`.

    Args:
        config: pool shape.
        kv: KV tensor shape of the lanes.
        lane_names: the lane actors' names (namespace ``cpkv``), one per CP rank.
        heartbeat_s: seconds between heartbeats and lease checks (0 turns them off).
        lane_restart_timeout_s: how long to wait for a dead lane to come back.
        lane_hang_s: a lane silent this long is killed and reset (``None``: never).
        vocab_size: the model's vocabulary, checked in every step's token ids.
        compiled_steps: send steps to the lanes through a Ray compiled graph (the lanes
            must be ``CompiledLaneActor`` s).
    """

    def __init__(
        self,
        config: CPConfig,
        kv: KVShape,
        lane_names: list[str],
        heartbeat_s: float = 1.0,
        lane_restart_timeout_s: float = 60.0,
        lane_hang_s: float | None = None,
        vocab_size: int | None = None,
        compiled_steps: bool = False,
    ) -> None:
        assert len(lane_names) == config.cp_size, (len(lane_names), config.cp_size)
        fix_malloc_thresholds()  # before the actor allocates its step buffers
        self._lane_names = list(lane_names)
        self._lanes = [ray.get_actor(name, namespace=NAMESPACE) for name in lane_names]
        self._metrics = _Metrics()
        transport_type = CompiledRayLaneTransport if compiled_steps else RayLaneTransport
        transport = transport_type(self._lanes)
        self._steps = getattr(transport, "steps", None)
        self._c = Coordinator(
            config,
            kv,
            transport,
            heartbeat_s=heartbeat_s,
            lane_restart_timeout_s=lane_restart_timeout_s,
            lane_hang_s=lane_hang_s,
            vocab_size=vocab_size,
            liveness=ProcessLiveness(),
            # A client's graph runs its steps here only when the lanes' answers come back as
            # values (compiled lanes): an ordinary lane call's answer is an object ref, which
            # a graph's channel cannot lend on.
            step_graphs=_STEP_GRAPHS if compiled_steps else 0,
        )
        if self._steps is not None:
            self._steps.start(self._c.epoch)

    @ray.method(concurrency_group="lease")
    def hello(
        self,
        client_id: str | None = None,
        lease_s: float | None = None,
        namespace: str | None = None,
        holder: dict | None = None,
    ) -> dict:
        return {
            **self._c.hello(client_id, lease_s, namespace, holder),
            "lanes": self._lanes,
            "lane_names": self._lane_names,
        }

    # Allocations answer with the lanes' move fence (their moves still wait for a step): the
    # client's writes to the pages wait for it (see LaneShard.store_kv, LaneIO). These calls
    # take their arguments and give their answer packed (cpkv.actors.wire).
    def allocate_extend(self, call: bytes) -> bytes:
        return pack((self._c.allocate_extend(*unpack(call)), self._c.fence()))

    def allocate_extend_batch(self, call: bytes) -> bytes:
        return pack((self._c.allocate_extend_batch(*unpack(call)), self._c.fence()))

    def allocate_decode(self, call: bytes) -> bytes:
        return pack((self._c.allocate_decode(*unpack(call)), self._c.fence()))

    def free(self, call: bytes) -> bytes:
        return pack(self._c.free(*unpack(call)))

    def prefill(self, *args):
        return self._c.prefill(*args)

    def prefill_batch(self, *args):
        return self._c.prefill_batch(*args)

    def decode(self, *args):
        return self._c.decode(*args)

    def run_step(self, call: bytes) -> bytes:
        """A step sent through a client's compiled graph: ``(method, *args)`` of
        :meth:`prefill`, :meth:`prefill_batch` or :meth:`decode` (``("ping",)``: a graph's
        first run), packed (:mod:`cpkv.actors.wire`). Its answer as theirs, packed, and any
        error as a value: a raised one would reach the client as Ray's, not as the error the
        ordinary call gives."""
        answer = self._run_step(unpack(call))
        try:
            out = pack(answer)
            if isinstance(answer, BaseException):
                unpack(out)  # one that pickles but cannot be rebuilt would fail the client's read
            return out
        except Exception as e:  # an error value that will not travel: say so instead
            logger.exception("run_step: answer unpicklable")
            return pack(RuntimeError(f"run_step: {type(answer).__name__}: unpicklable: {e}"))

    def _run_step(self, call: tuple) -> Any:
        method, *args = call
        if method == "ping":
            return None
        if method not in _GRAPH_STEPS:
            return InvalidRequestError(f"run_step: {method!r} is not a step")
        try:
            return getattr(self._c, method)(*args)
        except Exception as e:
            logger.exception("run_step %s failed", method)
            return e

    @ray.method(concurrency_group="lease")
    def claim_step_graph(self, client_id: str) -> bool:
        return self._c.claim_step_graph(client_id)

    @ray.method(concurrency_group="lease")
    def release_step_graph(self, client_id: str) -> bool:
        return self._c.release_step_graph(client_id)

    @ray.method(concurrency_group="lease")
    def renew_lease(self, client_id: str) -> bool:
        return self._c.renew_lease(client_id)

    # NOTE: a group of its own: in the default one a close waited behind steps (each up to
    # the lanes' timeout), timed out in the client's shutdown and left the lease open.
    @ray.method(concurrency_group="close")
    def close_lease(self, client_id: str) -> int:
        return self._c.close_lease(client_id)

    def report_lane_failure(
        self, epoch: str, lane: int, detail: str = "", client_id: str | None = None
    ):
        return self._c.report_lane_failure(epoch, lane, detail, client_id)

    @ray.method(concurrency_group="status")
    def stats(self) -> dict:
        out = self._c.stats()
        if self._steps is not None:
            out["compiled_graph_builds"] = self._steps.num_builds
            out["compiled_graph_breaks"] = self._steps.num_breaks
            out["compiled_graph_idle_teardowns"] = self._steps.num_idle_teardowns
        self._metrics.update(out)
        return out

    # NOTE: check() waits for every lane's count (a hung lane: up to lane_restart_timeout_s):
    # a group of its own, or two checks would hold stats() and the clients' lane_fence().
    @ray.method(concurrency_group="check")
    def check(self) -> dict:
        return self._c.check()

    def reset(self) -> None:
        self._c.reset()

    @ray.method(concurrency_group="status")
    def lane_fence(self) -> list:
        return self._c.lane_fence()

    @ray.method(concurrency_group="status")
    def epoch(self) -> str:
        return self._c.epoch

    @ray.method(concurrency_group="status")
    def ping(self) -> None:
        """A no-op round trip."""

    def shutdown(self) -> None:
        self._c.shutdown()
        if self._steps is not None:
            self._steps.close()
