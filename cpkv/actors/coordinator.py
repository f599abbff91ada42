"""CoordinatorActor: the CPU-only actor that wraps the decision core.

It answers the caller from its exact mirror of the lanes (the core), then sends
each lane touched its page moves as ordered calls it does not wait for, so one
allocation is one round trip for the caller and at most ``cp_size`` lane calls.
A heartbeat thread compares each lane's own count with the mirror and detects
lanes that died or restarted.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable, Hashable
from concurrent.futures import Future

import ray

from cpkv.allocator import CPAllocator
from cpkv.config import CPConfig, KVShape
from cpkv.errors import CoordinatorUnavailableError, CPKVError

logger = logging.getLogger("cpkv.coordinator")

# Replies kept for calls a client may retry after a lost answer.
_MAX_REMEMBERED_CALLS = 1024
# Fire-and-forget lane calls checked before we wait on the oldest (backpressure).
_MAX_PENDING_LANE_CALLS = 2048


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

    def update(self, stats: dict) -> None:
        if self._pages is None:
            return
        for state in ("free", "used", "cached"):
            for lane, value in enumerate(stats[state]):
                self._pages.set(value, tags={"lane": str(lane), "state": state})
        for name, counter in (("capacity_waits", self._waits), ("pages_evicted", self._evicted)):
            delta = stats[name] - self._last[name]
            if delta > 0:
                counter.inc(delta)
            self._last[name] = stats[name]


@ray.remote(num_cpus=0, max_restarts=2, max_task_retries=0)
class CoordinatorActor:
    """Holds the core, the lanes' handles and the request table.

    Args:
        config: pool shape.
        kv: KV tensor shape of the lanes.
        lanes: one lane actor handle per CP rank.
        heartbeat_s: seconds between heartbeats (0 turns them off).
        lane_restart_timeout_s: how long to wait for a dead lane to come back.
    """

    def __init__(
        self,
        config: CPConfig,
        kv: KVShape,
        lanes: list,
        heartbeat_s: float = 1.0,
        lane_restart_timeout_s: float = 60.0,
    ) -> None:
        assert len(lanes) == config.cp_size, (len(lanes), config.cp_size)
        self._config = config
        self._kv = kv
        self._lanes = list(lanes)
        self._lock = threading.RLock()
        self._epoch = uuid.uuid4().hex
        self._lane_restart_timeout_s = lane_restart_timeout_s
        self._metrics = _Metrics()
        self._pending: list[tuple[int, ray.ObjectRef]] = []
        self._pending_lock = threading.Lock()
        # NOTE: every lane call goes through this one sender thread, in the order it
        # was queued (under self._lock), so Ray keeps a lane's calls in decision order
        # and the caller gets its answer without waiting for the submissions.
        self._outbox: queue.SimpleQueue = queue.SimpleQueue()
        threading.Thread(target=self._sender_loop, daemon=True, name="cpkv-sender").start()
        self.reset()  # a (re)started coordinator knows no pages: make the lanes agree
        self._stop = threading.Event()
        if heartbeat_s > 0:
            threading.Thread(
                target=self._heartbeat_loop, args=(heartbeat_s,), daemon=True, name="cpkv-heartbeat"
            ).start()

    # ------------------------------------------------------------ the calls
    def hello(self) -> dict:
        return {"epoch": self._epoch, "config": self._config, "kv": self._kv, "lanes": self._lanes}

    def allocate_extend(self, epoch: str, call_id: Hashable, rid: Hashable, tokens):
        def run():
            alloc = self._core.allocate_extend(rid, tokens)
            return alloc, ("extend", rid, alloc.seq)

        return self._call(epoch, call_id, run)

    def allocate_extend_batch(self, epoch: str, call_id: Hashable, items):
        def run():
            allocs = self._core.allocate_extend_batch(items)
            return allocs, ("batch", self._op)

        return self._call(epoch, call_id, run)

    def allocate_decode(self, epoch: str, call_id: Hashable, rids, token_ids):
        def run():
            return self._core.allocate_decode(rids, token_ids), ("decode", self._op)

        return self._call(epoch, call_id, run)

    def free(self, epoch: str, call_id: Hashable, rid: Hashable, cache: bool, committed_len):
        def run():
            seq = self._core.request_seq(rid) if self._core.has_request(rid) else -1
            return self._core.free(rid, cache, committed_len), ("free", rid, seq)

        return self._call(epoch, call_id, run)

    def report_lane_failure(self, epoch: str, lane: int, detail: str = "") -> list:
        """A client saw ``lane`` fail: confirm with a heartbeat; return the rids lost."""
        if epoch != self._epoch:
            return CoordinatorUnavailableError("coordinator restarted")
        alive = self._probe(lane)
        with self._lock:
            if not alive and lane not in self._dead_lanes:
                self._lane_lost(lane, detail or "reported by a client")
            # Also those a heartbeat already failed and nobody has acknowledged yet.
            return self._core.lost_rids(lane)

    def stats(self) -> dict:
        with self._lock:
            self._poll_pending()
            out = self._core.stats()
            out["epoch"] = self._epoch
            out["mirror_mismatches"] = self._mirror_mismatches
            out["lane_losses"] = [[lane, len(rids)] for lane, rids in self._lane_losses]
            out["lane_calls"] = self._lane_calls
            out["lane_calls_by_op"] = dict(self._lane_calls_by_op)
            out["dead_lanes"] = sorted(self._dead_lanes)
            return out

    def check(self) -> dict:
        """Core invariants plus every lane's own count against the mirror (waits for lanes)."""
        with self._lock:
            problems = []
            try:
                self._core.check_invariants()
            except AssertionError as e:
                problems.append(f"core: {e}")
            expected = self._held_per_lane()
            known = list(self._incarnations)
            futures = [self._send(r, "heartbeat", wait=True) for r in range(len(self._lanes))]
        refs = [f.result() for f in futures]
        for r, ref in enumerate(refs):
            try:
                incarnation, held = ray.get(ref, timeout=self._lane_restart_timeout_s)
            except Exception as e:  # a dead lane is a finding here, not a crash
                problems.append(f"lane {r}: {type(e).__name__}")
                continue
            if incarnation != known[r]:
                problems.append(f"lane {r}: restarted and not yet recovered")
            elif held != expected[r]:
                problems.append(f"lane {r}: holds {held} pages, mirror says {expected[r]}")
        return {"ok": not problems, "problems": problems, "held": expected}

    def reset(self) -> None:
        """Forget every request and cached page; every lane back to an empty shard."""
        with self._lock:
            self._core = CPAllocator.from_config(self._config, record_page_moves=True)
            self._op = 0
            self._answers: OrderedDict[Hashable, object] = OrderedDict()
            self._mirror_mismatches = 0
            self._lane_losses: list[tuple[int, list]] = []
            self._lane_calls = 0
            self._lane_calls_by_op: dict[str, int] = {}
            self._dead_lanes: set[int] = set()
            futures = [self._send(r, "reset", wait=True) for r in range(len(self._lanes))]
            refs = [f.result() for f in futures]
            with self._pending_lock:
                self._pending = []  # every earlier move was submitted before these resets
            self._incarnations = ray.get(refs, timeout=self._lane_restart_timeout_s)

    def epoch(self) -> str:
        return self._epoch

    def ping(self) -> None:
        """A no-op round trip."""

    def shutdown(self) -> None:
        self._stop.set()

    # ----------------------------------------------------------- internals
    def _call(self, epoch: str, call_id: Hashable, run: Callable):
        if epoch != self._epoch:
            return CoordinatorUnavailableError(
                f"coordinator restarted (epoch {epoch[:8]} is gone, now {self._epoch[:8]})"
            )
        with self._lock:
            if call_id is not None and call_id in self._answers:
                return self._answers[call_id]
            self._poll_pending()
            self._op += 1
            try:
                answer, key = run()
            except CPKVError as e:
                answer, key = e, ("error", self._op)
            self._dispatch(key)
            if call_id is not None:
                self._answers[call_id] = answer
                if len(self._answers) > _MAX_REMEMBERED_CALLS:
                    self._answers.popitem(last=False)
            return answer

    def _dispatch(self, key: Hashable) -> None:
        """Send each lane its page moves; do not wait (Ray keeps them in order)."""
        for r, (taken, released) in enumerate(self._core.drain_page_moves()):
            if taken.size or released.size:
                self._send(r, "apply", key, taken, released)
                self._lane_calls += 1
                self._lane_calls_by_op[key[0]] = self._lane_calls_by_op.get(key[0], 0) + 1
        if len(self._pending) + self._outbox.qsize() > _MAX_PENDING_LANE_CALLS:
            self._poll_pending(block_oldest=True)

    def _send(self, lane: int, method: str, *args, wait: bool = False) -> Future | None:
        """Queue a lane call; with ``wait`` get a future of its ObjectRef."""
        future = Future() if wait else None
        self._outbox.put((lane, method, args, future))
        return future

    def _sender_loop(self) -> None:
        while True:
            lane, method, args, future = self._outbox.get()
            try:
                ref = getattr(self._lanes[lane], method).remote(*args)
            except Exception as e:  # a submission error surfaces like a failed call
                if future is not None:
                    future.set_exception(e)
                continue
            if future is not None:
                future.set_result(ref)
            else:
                with self._pending_lock:
                    self._pending.append((lane, ref))

    def _poll_pending(self, block_oldest: bool = False) -> None:
        with self._pending_lock:
            pending = list(self._pending)
        if not pending:
            return
        refs = [ref for _, ref in pending]
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=0)
        if block_oldest and not ready:
            ready, _ = ray.wait(refs[:1], timeout=self._lane_restart_timeout_s)
        ready = set(ready)
        failed = set()
        for r, ref in pending:
            if ref not in ready:
                continue
            try:
                ray.get(ref)
            except ray.exceptions.RayActorError:
                failed.add(r)
            except Exception:
                logger.exception("lane %d rejected a page move", r)
                failed.add(r)
        with self._pending_lock:
            self._pending = [(r, ref) for r, ref in self._pending if ref not in ready]
        for r in sorted(failed):
            self._lane_lost(r, "a page move failed")

    def _held_per_lane(self) -> list[int]:
        free = self._core.num_free_pages_per_lane()
        return (self._config.num_pages_per_lane - 1 - free).tolist()

    def _probe(self, lane: int) -> bool:
        """True when ``lane`` answers with the incarnation we know."""
        try:
            incarnation, _ = ray.get(
                self._send(lane, "heartbeat", wait=True).result(),
                timeout=self._lane_restart_timeout_s,
            )
        except Exception:
            return False
        return incarnation == self._incarnations[lane]

    def _lane_lost(self, lane: int, why: str) -> list:
        """Fail the lane's requests, free their other pages, bring the lane back empty."""
        assert self._lock._is_owned()  # type: ignore[attr-defined]
        lost = self._core.drop_lane(lane)
        self._op += 1
        self._dispatch(("lane_lost", lane, self._op))
        with self._pending_lock:
            self._pending = [(r, ref) for r, ref in self._pending if r != lane]
        self._lane_losses.append((lane, lost))
        logger.warning("lane %d lost (%s): %d requests failed: %s", lane, why, len(lost), lost)
        self._bring_back(lane)
        return lost

    def _bring_back(self, lane: int) -> None:
        """Reset ``lane`` to an empty shard, retrying while Ray restarts it.

        Calls to a restarting actor wait for it; a few ActorDiedError in a row
        mean it is gone for good (restarts exhausted or killed without restart).
        """
        deadline = time.monotonic() + self._lane_restart_timeout_s
        died = 0
        while True:
            try:
                self._incarnations[lane] = ray.get(
                    self._send(lane, "reset", wait=True).result(),
                    timeout=max(0.1, deadline - time.monotonic()),
                )
                self._dead_lanes.discard(lane)
                return
            except Exception as e:
                died += isinstance(e, ray.exceptions.ActorDiedError)
                if died >= 5 or time.monotonic() >= deadline:
                    self._dead_lanes.add(lane)
                    logger.error("lane %d did not come back: %s", lane, type(e).__name__)
                    return
                time.sleep(0.1)

    def _heartbeat_loop(self, period_s: float) -> None:
        while not self._stop.wait(period_s):
            try:
                self._heartbeat_once()
            except Exception:
                logger.exception("heartbeat failed")

    def _heartbeat_once(self) -> None:
        with self._lock:
            self._poll_pending()
            expected = self._held_per_lane()
            known = list(self._incarnations)
            futures = [self._send(r, "heartbeat", wait=True) for r in range(len(self._lanes))]
            self._metrics.update(self._core.stats())
        refs = [f.result() for f in futures]
        deadline = time.monotonic() + max(5.0, self._lane_restart_timeout_s)
        for r, ref in enumerate(refs):
            try:
                incarnation, held = ray.get(ref, timeout=max(0.1, deadline - time.monotonic()))
            except Exception:
                incarnation, held = None, None
            if incarnation != known[r]:
                with self._lock:
                    if self._incarnations[r] == known[r]:  # nobody handled it meanwhile
                        self._lane_lost(r, "heartbeat: lane restarted or unreachable")
            elif held != expected[r]:
                self._mirror_mismatches += 1
                logger.error("lane %d holds %d pages but the mirror says %d", r, held, expected[r])
