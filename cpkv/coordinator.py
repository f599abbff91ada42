"""Coordinator: the decision core, its line to the lanes, lane health and client leases.

This is the plain class behind :class:`cpkv.actors.CoordinatorActor` (which only
delegates to it), so tests drive it without Ray through a transport of plain
lane objects. It answers every call from its exact mirror of the lanes (the
core) and queues each touched lane's page moves on the :class:`LaneChannel`
without waiting; :class:`LaneHealth` watches the lanes and brings lost ones back
off the lock; a :class:`LeaseTable` frees the requests of clients that went silent.

Answers are values or :class:`cpkv.CPKVError` instances (returned, not raised, so
they cross Ray as themselves and can be remembered for a retried call).
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
import uuid
from collections.abc import Callable, Hashable
from concurrent.futures import Future
from typing import Any

import numpy as np

from cpkv.allocator import CPAllocator, ExtendAllocation
from cpkv.config import CPConfig, KVShape
from cpkv.errors import (
    CoordinatorUnavailableError,
    CPKVError,
    InvalidRequestError,
    KVCapacityWaitError,
    LeaseExpiredError,
)
from cpkv.lane_channel import LaneChannel, LaneTransport
from cpkv.lane_health import RESTARTING, LaneHealth
from cpkv.leases import LeaseTable
from cpkv.reply_cache import ReplyCache
from cpkv.steps import MODES, StepInput, StepSequence

__all__ = ["Coordinator"]

logger = logging.getLogger("cpkv.coordinator")

# Replies kept for client calls retried after a lost answer.
_MAX_REMEMBERED_CALLS = 1024
# Page moves in flight before a caller waits for the oldest (back-pressure).
_MAX_PENDING_MOVES = 2048


class Coordinator:
    """Owns the pool's decisions and keeps the lanes in line with them.

    Args:
        config: pool shape.
        kv: KV tensor shape of the lanes.
        transport: how lane calls are made (Ray actors, or plain objects in tests).
        heartbeat_s: seconds between heartbeats and lease checks (0: none; call
            :meth:`heartbeat_once` and :meth:`expire_leases` yourself).
        lane_restart_timeout_s: how long a lost lane may take to come back.
        clock: monotonic seconds (tests step it).
    """

    def __init__(
        self,
        config: CPConfig,
        kv: KVShape,
        transport: LaneTransport,
        *,
        heartbeat_s: float = 1.0,
        lane_restart_timeout_s: float = 60.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.config = config
        self.kv = kv
        self.epoch = uuid.uuid4().hex
        self._clock = clock
        self._timeout_s = lane_restart_timeout_s
        self._lock = threading.RLock()
        self._channel = LaneChannel(transport, config.cp_size, self.epoch)
        self._health = LaneHealth(
            self._channel,
            self._lock,
            on_lost=self._on_lane_lost,
            on_back=self._on_lane_back,
            restart_timeout_s=lane_restart_timeout_s,
            num_pages=config.num_pages_per_lane,
        )
        self._leases = LeaseTable()
        self._transport = transport
        # The lanes' collective group: built before the first step, rebuilt after a lane
        # is lost or comes back (None: stale). Steps are numbered in submission order.
        self._group_lock = threading.Lock()
        self._group_id: str | None = None
        self._group_count = 0
        self._backend: str | None = None
        self._step_count = 0
        self._stop = threading.Event()
        self.reset()
        if heartbeat_s > 0:
            threading.Thread(
                target=self._heartbeat_loop, args=(heartbeat_s,), daemon=True, name="cpkv-heartbeat"
            ).start()

    # ------------------------------------------------------------------ setup
    def hello(self, client_id: str | None = None, lease_s: float | None = None) -> dict:
        """The pool's identity and shape; opens ``client_id``'s lease when given."""
        if client_id is not None and lease_s is not None:
            with self._lock:
                self._leases.open(client_id, lease_s, self._clock())
        return {"epoch": self.epoch, "config": self.config, "kv": self.kv}

    def reset(self) -> None:
        """Forget every request and cached page; every lane back to an empty shard."""
        with self._lock:
            self._core = CPAllocator.from_config(self.config, record_page_moves=True)
            self._replies = ReplyCache(_MAX_REMEMBERED_CALLS)
            self._leases.forget_requests()
            self._health.losses.clear()
            self._health.mismatches = 0
            self._channel.reset_counters()
            for lane in range(self.config.cp_size):
                self._core.set_lane_available(lane, False)
        self._health.reset_all()

    def shutdown(self) -> None:
        self._stop.set()
        self._channel.close()

    # ------------------------------------------------------------- the calls
    def allocate_extend(
        self, epoch: str, client_id: str | None, call_id: Hashable, rid, tokens, cache_salt=None
    ) -> Any:
        def run():
            alloc = self._core.allocate_extend(rid, tokens, cache_salt=cache_salt)
            self._leases.hold(client_id, alloc.rid)
            return alloc

        return self._call(epoch, client_id, call_id, "extend", run)

    def allocate_extend_batch(
        self, epoch: str, client_id: str | None, call_id: Hashable, items, cache_salt=None
    ) -> Any:
        def run():
            allocs = self._core.allocate_extend_batch(items, cache_salt=cache_salt)
            for a in allocs:
                self._leases.hold(client_id, a.rid)
            return allocs

        return self._call(epoch, client_id, call_id, "batch", run)

    def allocate_decode(
        self, epoch: str, client_id: str | None, call_id: Hashable, rids, token_ids=None
    ) -> Any:
        return self._call(
            epoch,
            client_id,
            call_id,
            "decode",
            lambda: self._core.allocate_decode(rids, token_ids),
        )

    def free(
        self,
        epoch: str,
        client_id: str | None,
        call_id: Hashable,
        rid,
        cache: bool = True,
        committed_len: int | None = None,
    ) -> Any:
        def run():
            freed = self._core.free(rid, cache, committed_len)
            self._leases.release(rid)
            return freed

        return self._call(epoch, client_id, call_id, "free", run)

    # ------------------------------------------------------------------ steps
    def prefill(
        self,
        epoch: str,
        client_id: str | None,
        call_id: Hashable,
        rid,
        tokens,
        cache_salt=None,
        mode: str = "auto",
        probe=None,
    ) -> Any:
        """Allocate one request's prefill step and run it on the lanes.

        Returns:
            ``{"allocations": [ExtendAllocation], "lanes": [handle per lane]}``: each lane's
            step result (see :meth:`cpkv.lanes.worker.LaneWorker.step`) behind its handle;
            or the error (nothing is run then).
        """

        def run():
            alloc = self._core.allocate_extend(rid, tokens, cache_salt=cache_salt)
            self._leases.hold(client_id, alloc.rid)
            return [alloc], [tokens]

        return self._step_call(epoch, client_id, call_id, "prefill", run, mode, probe)

    def prefill_batch(
        self,
        epoch: str,
        client_id: str | None,
        call_id: Hashable,
        items,
        cache_salt=None,
        mode: str = "auto",
        probe=None,
    ) -> Any:
        """:meth:`prefill` of several requests in one step (each with its own owner plan)."""

        def run():
            allocs = self._core.allocate_extend_batch(items, cache_salt=cache_salt)
            for a in allocs:
                self._leases.hold(client_id, a.rid)
            return allocs, [t for _, t in items]

        return self._step_call(epoch, client_id, call_id, "prefill", run, mode, probe)

    def decode(
        self,
        epoch: str,
        client_id: str | None,
        call_id: Hashable,
        rids,
        token_ids,
        mode: str = "auto",
        probe=None,
    ) -> Any:
        """One token for each request, and a decode step on the lanes (pass-Q).

        Returns:
            ``{"slots": int64 [len(rids)], "lanes": [handle per lane]}``, or the error.
        """

        def run():
            slots = self._core.allocate_decode(rids, token_ids)
            return slots, None

        return self._step_call(
            epoch, client_id, call_id, "decode", run, mode, probe, decode=(rids, token_ids)
        )

    def _step_call(self, epoch, client_id, call_id, op, run, mode, probe, decode=None) -> Any:
        """:meth:`_call` whose decision is followed by a step on every lane; the answer holds
        each lane's handle to its step result."""
        if epoch != self.epoch:
            return self._restarted(epoch)
        if mode not in MODES:
            return InvalidRequestError(f"mode={mode!r}; expected one of {MODES}")
        group = self._ensure_group()
        if isinstance(group, CPKVError):
            return group

        def decide_and_submit() -> dict:
            made, given = run()
            self._dispatch(op)  # NOTE: the page moves are queued before the step
            if decode is None:
                seqs, answer = self._extend_sequences(made, given), {"allocations": made}
            else:
                seqs, answer = self._decode_sequences(*decode), {"slots": made}
            self._step_count += 1
            shared = self._share(StepInput(self._step_count, group, tuple(seqs), mode, probe))
            answer["lanes"] = [
                self._channel.submit(r, "step", shared) for r in range(self.config.cp_size)
            ]
            return answer

        answer = self._call(epoch, client_id, call_id, op, decide_and_submit)
        if isinstance(answer, dict):
            # The sender submits the steps after the lock is released; the remembered answer
            # (the same dict) then holds the handles for a retried call too.
            answer["lanes"] = [
                f.result(timeout=self._timeout_s) if isinstance(f, Future) else f
                for f in answer["lanes"]
            ]
        return answer

    def _extend_sequences(self, allocs: list[ExtendAllocation], given: list) -> list[StepSequence]:
        seqs, start = [], 0
        for alloc, tokens in zip(allocs, given, strict=True):
            tokens = np.asarray(tokens, dtype=np.int64)
            n = tokens.shape[0]
            # NOTE: a new request's cached prefix is not recomputed: its step starts after it.
            new = tokens[n - alloc.extend_len :]
            pages = self._core.request_pages(alloc.rid)
            seqs.append(
                StepSequence(
                    alloc.rid, alloc.prefix_len, alloc.extend_len, pages, new, start + n - new.size
                )
            )
            start += n
        return seqs

    def _decode_sequences(self, rids, token_ids) -> list[StepSequence]:
        seqs = []
        toks = np.zeros(len(rids), np.int64) if token_ids is None else np.asarray(token_ids)
        for i, rid in enumerate(rids):
            n = self._core.request_len(rid)
            tok = toks[i : i + 1].astype(np.int64)
            seqs.append(StepSequence(rid, n - 1, 1, self._core.request_pages(rid), tok, i))
        return seqs

    def _share(self, obj: Any) -> Any:
        share = getattr(self._transport, "share", None)
        return obj if share is None else share(obj)

    def _ensure_group(self) -> str | CPKVError:
        """The current lane group's id, building the group first when it is stale."""
        with self._group_lock:
            with self._lock:
                if self._group_id is not None:
                    return self._group_id
                down = [r for r in range(self.config.cp_size) if not self._health.is_up(r)]
                if down:
                    return self._lanes_unavailable(f"lanes {down} are restarting; no step can run")
            t = self._timeout_s
            try:
                if self._backend is None:
                    from cpkv.lanes.comm import choose_backend

                    infos = [
                        self._channel.call(r, "info", timeout=t) for r in range(self.config.cp_size)
                    ]
                    self._backend = choose_backend([_device_id(i) for i in infos])
                host, port = self._channel.call(0, "rendezvous_address", timeout=t)
            except Exception as e:  # a lane died meanwhile: the heartbeat will see it
                return self._lanes_unavailable(
                    f"could not build the lane group ({type(e).__name__})"
                )
            with self._lock:
                self._group_count += 1
                gid = f"{self.epoch[:8]}:g{self._group_count}"
                for r in range(self.config.cp_size):
                    self._channel.submit(r, "init_group", gid, host, port, self._backend, t)
                self._group_id = gid
                return gid

    def _lanes_unavailable(self, message: str) -> KVCapacityWaitError:
        """A step cannot run until every lane serves: back off and retry."""
        zeros = [0] * self.config.cp_size
        return KVCapacityWaitError(
            message,
            required_by_owner=zeros,
            available_by_owner=zeros,
            deficit_by_owner=zeros,
            reason="lane_unavailable",
        )

    def renew_lease(self, client_id: str) -> bool:
        """Push the client's lease out; False when it has none (lapsed, or a new coordinator)."""
        with self._lock:
            return self._leases.renew(client_id, self._clock())

    def close_lease(self, client_id: str) -> int:
        """End a client's lease and free the requests it still holds; returns how many."""
        with self._lock:
            rids = self._leases.close(client_id)
            self._free_quietly(rids)
            self._dispatch("lease")
            return len(rids)

    def expire_leases(self) -> int:
        """Free the requests of every client whose lease lapsed; returns how many."""
        with self._lock:
            lapsed = self._leases.expire(self._clock())
            freed = 0
            for client_id, rids in lapsed.items():
                logger.warning(
                    "client %s stopped renewing its lease: freeing its %d requests",
                    client_id,
                    len(rids),
                )
                self._free_quietly(rids)
                freed += len(rids)
            if freed:
                self._dispatch("lease")
            return freed

    def report_lane_failure(self, epoch: str, lane: int, detail: str = "") -> Any:
        """A client saw ``lane`` fail: confirm with a probe; return the rids lost with it."""
        if epoch != self.epoch:
            return self._restarted(epoch)
        # NOTE: probe() fails the lane itself when it finds it dead or restarted; failing
        # it here again could lose a lane that recovered in between a second time.
        logger.info("a client reports lane %d failing: %s", lane, detail)
        self._health.probe(lane, self._timeout_s)
        with self._lock:
            return self._core.lost_rids(lane)

    # ---------------------------------------------------------------- status
    def stats(self) -> dict:
        """Per-lane counts, counters and lane health; never waits for a lane."""
        with self._lock:
            self._health.fail_moves()
            out = self._core.stats()
            out["epoch"] = self.epoch
            out["mirror_mismatches"] = self._health.mismatches
            out["slow_heartbeats"] = self._health.slow_heartbeats
            out["lane_losses"] = [[lane, len(rids)] for lane, rids in self._health.losses]
            out["lane_states"] = list(self._health.states)
            out["restarting_lanes"] = self._health.lanes_in(RESTARTING)
            out["dead_lanes"] = self._health.lanes_in("dead")
            out["lane_calls"] = self._channel.num_calls
            out["lane_calls_by_op"] = dict(self._channel.num_moves_by_op)
            out["pending_lane_calls"] = self._channel.num_pending
            out["num_leases"] = self._leases.num_leases
            out["leases_expired"] = self._leases.num_expired_requests
            out["leases_lapsed"] = self._leases.num_expired_leases
            return out

    def check(self) -> dict:
        """Core invariants, and each serving lane's own count against the mirror.

        Waits for the serving lanes only (a lane that is restarting is reported as such).
        """
        with self._lock:
            self._health.fail_moves()
            problems = []
            try:
                self._core.check_invariants()
            except AssertionError as e:
                problems.append(f"core: {e}")
            expected = self._held_per_lane()
            for lane in range(self.config.cp_size):
                if not self._health.is_up(lane):
                    problems.append(f"lane {lane}: {self._health.states[lane]}")
            sent = self._health.send_heartbeats()
        for r, known, _gen, reply in self._health.replies(sent, self._timeout_s):
            if isinstance(reply, BaseException):  # a dead lane is a finding here, not a crash
                problems.append(f"lane {r}: {type(reply).__name__}")
                continue
            incarnation, held = reply
            if incarnation != known:
                problems.append(f"lane {r}: restarted and not yet recovered")
            elif held != expected[r]:
                problems.append(f"lane {r}: holds {held} pages, mirror says {expected[r]}")
        return {"ok": not problems, "problems": problems, "held": expected}

    def heartbeat_once(self) -> None:
        """One heartbeat round (the background loop calls this every ``heartbeat_s``)."""
        # NOTE: LaneHealth calls _held_per_lane with the lock held.
        self._health.heartbeat(self._held_per_lane, max(5.0, self._timeout_s))

    def wait_recovered(self, timeout: float) -> bool:
        """Wait for lane recoveries in flight (tests)."""
        return self._health.wait_recovered(timeout)

    def lane_states(self) -> list[str]:
        with self._lock:
            return list(self._health.states)

    # ------------------------------------------------------------- internals
    def _restarted(self, epoch: str) -> CoordinatorUnavailableError:
        return CoordinatorUnavailableError(
            f"coordinator restarted (epoch {str(epoch)[:8]} is gone, now {self.epoch[:8]})"
        )

    def _call(
        self,
        epoch: str,
        client_id: str | None,
        call_id: Hashable,
        op: str,
        run: Callable[[], Any],
    ) -> Any:
        if epoch != self.epoch:
            return self._restarted(epoch)
        with self._lock:
            if call_id is not None and call_id in self._replies:
                return self._replies.get(call_id)
            lapsed = self._lapse_notice(client_id)
            if lapsed is not None:
                if call_id is not None:  # a retry of this call gets the same notice
                    self._replies.put(call_id, lapsed)
                return lapsed
            self._health.fail_moves()
            try:
                answer = run()
            except CPKVError as e:
                answer = e
            self._dispatch(op)
            if call_id is not None:
                self._replies.put(call_id, answer)
        if self._channel.num_pending > _MAX_PENDING_MOVES:
            self._channel.wait_oldest(self._timeout_s)  # back-pressure, without the lock
        return answer

    def _lapse_notice(self, client_id: str | None) -> LeaseExpiredError | None:
        """Renew the caller's lease; if it had lapsed, reopen it and say what was freed."""
        if client_id is None:
            return None
        now = self._clock()
        if self._leases.renew(client_id, now):
            return None
        rids = self._leases.reopen_lapsed(client_id, now)
        return None if rids is None else LeaseExpiredError(rids)

    def _free_quietly(self, rids: list[Hashable]) -> None:
        for rid in rids:
            self._leases.release(rid)
            with contextlib.suppress(CPKVError):  # freed meanwhile
                self._core.free(rid, cache=False)

    def _dispatch(self, op: str) -> None:
        """Queue each lane its page moves (the lanes apply them in this order)."""
        for r, (taken, released) in enumerate(self._core.drain_page_moves()):
            if taken.size or released.size:
                self._channel.send_moves(r, taken, released, op)

    def _held_per_lane(self) -> list[int]:
        free = self._core.num_free_pages_per_lane()
        return (self.config.num_pages_per_lane - 1 - free).tolist()

    def _on_lane_lost(self, lane: int, why: str) -> list[Hashable]:
        del why
        self._group_id = None
        lost = self._core.drop_lane(lane)
        self._core.set_lane_available(lane, False)
        self._dispatch("lane_lost")
        # NOTE: leases keep the lost rids until freed: an expiry acknowledges them too.
        return lost

    def _on_lane_back(self, lane: int) -> None:
        self._core.set_lane_available(lane, True)
        self._group_id = None  # the restarted lane joins a new group

    def _heartbeat_loop(self, period_s: float) -> None:
        while not self._stop.wait(period_s):
            try:
                self.heartbeat_once()
                self.expire_leases()
            except Exception:
                logger.exception("heartbeat failed")


def _device_id(info: dict) -> str:
    """A lane's device, named uniquely across the pool (lanes on one GPU share a name)."""
    if not info["device"].startswith("cuda"):
        return "cpu"
    return f"{info['node_id']}/cuda:{','.join(info['gpu_ids'])}"
