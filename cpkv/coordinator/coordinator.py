"""Coordinator: the decision core, its line to the lanes, lane health and client leases.

This is the plain class behind :class:`cpkv.actors.CoordinatorActor` (which only
delegates to it), so tests drive it without Ray through a transport of plain
lane objects. It answers every call from its exact mirror of the lanes (the
core) and numbers each touched lane's page moves on the :class:`LaneChannel`,
where they wait for the lane's next step (or a flush); the :class:`LaneSupervisor`
keeps the lanes' table and group and brings lost lanes back off the lock (the
coordinator asks it, and takes the lanes it found lost at its next call); a
:class:`LeaseTable` frees the requests of clients that went silent. Prefill,
batched prefill and decode are one pipeline (:meth:`Coordinator._run_step`):
decide, number the page moves, send one :class:`StepRequest` to every lane
carrying them (built by :mod:`.step_build`); :class:`InflightSteps` keeps each sent step
until its lanes answer. :class:`Namespaces` keys the callers' rids for the core, and
:mod:`.call_digest` tells a retried call from a call id reused for something else.

Answers are values or :class:`cpkv.CPKVError` instances (returned, not raised, so
they cross Ray as themselves and can be remembered for a retried call).
"""

from __future__ import annotations

import contextlib
import logging
import secrets
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable, Hashable
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeoutError
from typing import Any

import numpy as np

from cpkv.coordinator.call_digest import (
    args_digest,
    client_call_number,
    client_call_streams,
    items_digest,
    repeat_answer,
    rids_digest,
    was_answered,
)
from cpkv.coordinator.channel import (
    ChannelClosedError,
    LaneChannel,
    LaneTransport,
    StepHandles,
)
from cpkv.coordinator.inflight import InflightSteps
from cpkv.coordinator.namespaces import NO_NAMESPACE_ID, Namespaces, for_caller, namespace_of
from cpkv.coordinator.step_build import (
    decode_sequences,
    extend_sequences,
    step_tokens,
    worth_sharing,
)
from cpkv.coordinator.supervisor import DEAD, RESTARTING, UP, LaneSupervisor
from cpkv.core.allocator import CPAllocator, ExtendAllocation
from cpkv.core.config import CPConfig, KVShape
from cpkv.core.graph_slots import GraphSlots
from cpkv.core.leases import LeaseTable
from cpkv.core.page_hash import TokenDigest
from cpkv.core.reply_cache import ReplyCache
from cpkv.core.steps import StepRequest, check_mode
from cpkv.core.validate import check_int, user_rid
from cpkv.errors import (
    CoordinatorUnavailableError,
    CPKVError,
    InvalidRequestError,
    LeaseExpiredError,
    RequestTimeoutError,
)

__all__ = ["Coordinator"]

logger = logging.getLogger("cpkv.coordinator.coordinator")

# Replies kept for client calls retried after a lost answer.
_MAX_REMEMBERED_CALLS = 1024
# Bytes those replies may pin (a step's reply holds its logits in the object store: 113
# remembered 1B-model steps pinned 442 MiB before this bound).
_MAX_REMEMBERED_BYTES = 64 << 20
# Lane losses listed by stats() (the last ones: a coordinator lives for days of them).
_MAX_LANE_LOSSES_KEPT = 256
# Page moves in flight before a caller waits for the oldest (back-pressure).
_MAX_PENDING_MOVES = 2048
# The allocation path looks for failed page moves at most this often: each look asks Ray
# about every move in flight (bench_actors, 128k tokens at cp 4: 7.6 -> see docs).
_MOVE_POLL_S = 0.05
# check(): how long to wait before asking a lane again that is behind its moves.
_CHECK_RETRY_S = 0.02
# How long shutdown() waits for the heartbeat and the recoveries to end (a heartbeat round
# waiting on a hung lane is left to its daemon thread).
_SHUTDOWN_JOIN_S = 1.0


class Coordinator:
    """Owns the pool's decisions and keeps the lanes in line with them.

    Args:
        config: pool shape.
        kv: KV tensor shape of the lanes.
        transport: how lane calls are made (Ray actors, or plain objects in tests).
        heartbeat_s: seconds between heartbeats and lease checks (0: none; call
            :meth:`heartbeat_once` and :meth:`expire_leases` yourself).
        lane_restart_timeout_s: how long a lost lane may take to come back.
        step_graphs: how many clients may send their steps through a compiled graph of
            their own (see :class:`cpkv.core.graph_slots.GraphSlots`).
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
        lane_hang_s: float | None = None,
        vocab_size: int | None = None,
        liveness: Callable[[dict], bool | None] | None = None,
        step_graphs: int = 0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.config = config
        self.kv = kv
        self.vocab_size = vocab_size
        self.epoch = uuid.uuid4().hex
        # One page-hash key for the coordinator's life (a reset keeps it): its clients hash
        # page contents with it (trusted code, see the README's threat model).
        self._hash_key = secrets.token_bytes(32)
        self._clock = clock
        self._timeout_s = lane_restart_timeout_s
        self._liveness = liveness
        self._lock = threading.RLock()
        self._channel = LaneChannel(transport, config.cp_size, self.epoch)
        self._supervisor = LaneSupervisor(
            self._channel,
            self.epoch,
            restart_timeout_s=lane_restart_timeout_s,
            num_pages=config.num_pages_per_lane,
            hang_s=lane_hang_s,
            kill=getattr(transport, "kill", None),
        )
        self._leases = LeaseTable()
        self._graph_slots = GraphSlots(step_graphs)
        self._namespaces = Namespaces()
        self._transport = transport
        # Steps are numbered in submission order.
        self._step_count = 0
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self.reset()
        if heartbeat_s > 0:
            self._threads.append(
                threading.Thread(
                    target=self._heartbeat_loop,
                    args=(heartbeat_s,),
                    daemon=True,
                    name="cpkv-heartbeat",
                )
            )
            self._threads[-1].start()

    # ------------------------------------------------------------------ setup
    def hello(
        self,
        client_id: str | None = None,
        lease_s: float | None = None,
        namespace: str | None = None,
        holder: dict | None = None,
    ) -> dict:
        """The pool's identity and shape; registers ``client_id``.

        Args:
            client_id: the client (its calls carry it).
            lease_s: open (or refresh) the client's lease of this many seconds.
            namespace: the client's request ids live in this namespace (default: one of its
                own; clients that pass the same name share their requests).
            holder: the client's process (``node_id``, ``pid``, ``start``), asked before
                its lease is lapsed for silence: a live but busy process keeps its lease.

        Returns:
            ``epoch``, ``config``, ``kv``, ``vocab_size``, ``namespace_id`` (the id the
            lanes check the client's reads and writes against) and, for a client,
            ``page_hash_key`` (it sends :class:`TokenDigest` s hashed with it), and
            ``step_graph``: whether a client may claim a compiled graph for its steps.
        """
        ns_id = NO_NAMESPACE_ID
        if client_id is not None:
            with self._lock:
                ns_id = self._namespaces.join(client_id, namespace)
            if lease_s is not None:
                self._leases.open(client_id, lease_s, self._clock(), holder)
        return {
            "epoch": self.epoch,
            "config": self.config,
            "kv": self.kv,
            "vocab_size": self.vocab_size,
            "namespace_id": ns_id,
            "page_hash_key": None if client_id is None else self._hash_key,
            "move_flush_s": self._channel.flush_after_s,
            "step_graph": self._graph_slots.num_slots > 0,
        }

    def reset(self) -> None:
        """Forget every request and cached page; every lane back to an empty shard."""
        with self._lock:
            self._core = CPAllocator.from_config(
                self.config, record_page_moves=True, hash_key=self._hash_key
            )
            self._replies = ReplyCache(
                _MAX_REMEMBERED_CALLS, _MAX_REMEMBERED_BYTES, numbered=client_call_number
            )
            self._steps = InflightSteps(
                self._channel, self._core.has_request, self._supervisor.drop_group
            )
            # (lane, number of requests lost with it) of the last lanes lost since the reset.
            self._losses: deque[tuple[int, int]] = deque(maxlen=_MAX_LANE_LOSSES_KEPT)
            self._leases.forget_requests()
            self._channel.reset_counters()
            self._supervisor.restart_all(self._core.availability)
        self._supervisor.wait_recovered(None)
        with self._lock:
            self._settle_lanes()  # the lanes that came back take pages

    def shutdown(self) -> None:
        """Stop the heartbeat, the lane recoveries in flight and the lane channel (calls
        queued after it fail at once); waits up to a second for those threads to end."""
        self._stop.set()
        self._supervisor.close()
        end = time.monotonic() + _SHUTDOWN_JOIN_S
        self._channel.close(_SHUTDOWN_JOIN_S)
        for thread in self._threads:
            thread.join(max(0.0, end - time.monotonic()))
        self._supervisor.wait_recovered(max(0.0, end - time.monotonic()))

    # ------------------------------------------------------------- the calls
    def allocate_extend(
        self, epoch: str, client_id: str | None, call_id: Hashable, rid, tokens, cache_salt=None
    ) -> Any:
        """A batch of one: :meth:`allocate_extend_batch` answering its one allocation."""

        def run():
            return self._extend(client_id, [(rid, tokens)], cache_salt)[0][0]

        digest = args_digest("extend", rid, tokens, cache_salt)
        return self._call(epoch, client_id, call_id, "extend", run, digest)

    def allocate_extend_batch(
        self, epoch: str, client_id: str | None, call_id: Hashable, items, cache_salt=None
    ) -> Any:
        def run():
            return self._extend(client_id, items, cache_salt)[0]

        digest = args_digest("batch", items_digest(items), cache_salt)
        return self._call(epoch, client_id, call_id, "batch", run, digest)

    def allocate_decode(
        self, epoch: str, client_id: str | None, call_id: Hashable, rids, token_ids=None
    ) -> Any:
        def run():
            return self._decode(client_id, rids, token_ids)[0]

        digest = args_digest("decode", rids_digest(rids), token_ids)
        return self._call(epoch, client_id, call_id, "decode", run, digest)

    def free(
        self,
        epoch: str,
        client_id: str | None,
        call_id: Hashable,
        rid,
        cache: bool = True,
        committed_len: int | None = None,
    ) -> Any:
        """Free a request; only pages whose K/V was written may enter the prefix cache.

        A request whose step failed, or has a step in flight, is freed as far as its K/V
        is known written, whatever ``cache`` and ``committed_len`` say.
        """

        def run():
            if not isinstance(cache, (bool, np.bool_)):
                raise InvalidRequestError(f"cache={cache!r} must be True or False")
            key = self._namespaces.key(client_id, rid)
            written = self._steps.written_len(key)
            committed = committed_len
            if committed is not None:  # compared below before the core checks it
                committed = check_int("committed_len", committed, minimum=0)
            if written is not None and cache:
                if committed is not None and committed > self._core.request_len(key):
                    committed = max(committed, written)  # the core names the bad value
                else:
                    committed = written if committed is None else min(committed, written)
            freed = self._core.free(key, cache, committed)
            self._steps.forget(key)
            self._leases.release(key)
            return freed

        digest = args_digest("free", rid, cache, committed_len)
        return self._call(epoch, client_id, call_id, "free", run, digest)

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
        sample: bool = False,
    ) -> Any:
        """Allocate one request's prefill step and run it on the lanes (a batch of one).

        Args:
            sample: the lane answers the greedy next token instead of the logits.

        Returns:
            ``{"allocations": [ExtendAllocation], "lanes": [handle per lane]}``: each lane's
            :class:`cpkv.core.steps.StepResult` behind its handle; or the error (nothing is
            run then).
        """
        digest = args_digest(
            "prefill", rid, tokens, cache_salt, mode, probe is not None, bool(sample)
        )
        return self._run_step(
            epoch, client_id, call_id, "prefill", digest, mode, probe, [(rid, tokens)], cache_salt,
            sample=bool(sample),
        )  # fmt: skip

    def prefill_batch(
        self,
        epoch: str,
        client_id: str | None,
        call_id: Hashable,
        items,
        cache_salt=None,
        mode: str = "auto",
        probe=None,
        sample: bool = False,
    ) -> Any:
        """:meth:`prefill` of several requests in one step (each with its own owner plan)."""
        digest = args_digest(
            "prefill_batch", items_digest(items), cache_salt, mode, probe is not None, bool(sample)
        )
        return self._run_step(
            epoch, client_id, call_id, "prefill", digest, mode, probe, items, cache_salt,
            sample=bool(sample),
        )  # fmt: skip

    def decode(
        self,
        epoch: str,
        client_id: str | None,
        call_id: Hashable,
        rids,
        token_ids,
        mode: str = "auto",
        probe=None,
        sample: bool = False,
    ) -> Any:
        """One token for each request, and a decode step on the lanes (pass-Q).

        Args:
            sample: the lanes answer greedy next tokens instead of logits.

        Returns:
            ``{"slots": int64 [len(rids)], "lanes": [handle per lane]}``, or the error.
        """
        digest = args_digest("decode_step", rids_digest(rids), token_ids, mode, bool(sample))
        return self._run_step(
            epoch, client_id, call_id, "decode", digest, mode, probe, rids, token_ids=token_ids,
            sample=bool(sample),
        )  # fmt: skip

    def _run_step(
        self,
        epoch: str,
        client_id: str | None,
        call_id: Hashable,
        op: str,
        digest: int,
        mode: str,
        probe,
        requests,
        cache_salt=None,
        token_ids=None,
        sample: bool = False,
    ) -> Any:
        """:meth:`_call` whose decision is followed by one step on every lane; the answer
        holds each lane's handle to its step result.

        Args:
            op: ``prefill`` (``requests``: ``(rid, tokens)`` items, ``cache_salt``) or
                ``decode`` (``requests``: rids, ``token_ids`` one each).
        """
        if epoch != self.epoch:
            return self._restarted(epoch)
        try:
            check_mode(mode)
        except InvalidRequestError as e:
            return e
        with self._lock:
            self._steps.settle()  # a step that failed since: its group is rebuilt first
            # NOTE: a repeat of a call that was answered gets that answer from _call, whatever
            # the lanes' state now (a lane_unavailable wait would have it sent again).
            key = (client_id, call_id)
            answered = call_id is not None and was_answered(self._replies, key)
        group = None if answered else self._ensure_group()
        if isinstance(group, CPKVError):
            # A request the step cannot continue says so before any wait for the lanes.
            return for_caller(self._request_error(client_id, op, requests)) or group

        def decide_and_submit() -> dict:
            if group is None or not self._group_is_current(group):
                # None: the call looked answered, and its reply was forgotten since (pushed
                # out by other calls): nothing ran for it here, so it waits like any other.
                # Dropped since it was read (a lane lost, a step failed, while settling):
                # the lanes left it; a step for it would fail requests it never touched.
                raise self._request_error(client_id, op, requests) or self._supervisor.unavailable(
                    "the lane group changed meanwhile (a lane lost or a step failed); retry"
                )
            if op == "decode":
                slots, keys, toks = self._decode(
                    client_id, requests, token_ids, step=True, probe=probe
                )
                answer: dict[str, Any] = {"slots": slots}
                seqs = decode_sequences(self._core, keys, toks)
            else:
                allocs, tokens = self._extend(
                    client_id, requests, cache_salt, step=True, probe=probe
                )
                answer = {"allocations": for_caller(allocs)}
                seqs = extend_sequences(self._core, allocs, tokens)
            self._step_count += 1
            step = StepRequest(self._step_count, group, tuple(seqs), mode, probe, sample)
            shared = step
            if not self._channel.compiled and worth_sharing(step, self.config.cp_size):
                try:
                    shared = self._share(step)
                except Exception as e:  # decided, never sent (the object store is full, say)
                    self._dispatch(op, client_id)  # the moves go out as this caller's
                    raise self._steps.unsent(step, e) from e
            # NOTE: each lane's page moves ride in its step call, applied before the step runs
            # (measured on the 2-core machine: a move's own lane call cost a 16-token prefill
            # ~0.55 ms); numbered only once nothing can fail before the calls queue.
            self._dispatch(op, client_id)
            handles = self._channel.submit_steps(shared)
            self._steps.track(step, handles)
            answer["lanes"] = handles
            return answer

        # A sampled step's answer holds token ids only: nothing worth counting against the
        # replies' byte bound.
        size = None if sample else self._step_reply_bytes
        answer = self._call(epoch, client_id, call_id, op, decide_and_submit, digest, size)
        if isinstance(answer, dict):
            # The sender submits the steps after the lock is released (a compiled graph
            # answers them: the lanes' results come back here). NOTE: into a copy: the
            # remembered answer keeps the sender's handles, which a retried call resolves
            # again (a plain transport's results are futures too: resolving those waited for
            # the step, and rewrote the first caller's answer).
            try:
                answer = {
                    **answer,
                    "lanes": [
                        _result_handle(f.result(timeout=self._timeout_s))
                        if isinstance(f, (Future, StepHandles))
                        else f
                        for f in answer["lanes"]
                    ],
                }
            except FutureTimeoutError:
                return RequestTimeoutError(
                    f"{op}: lanes silent for {self._timeout_s}s; call_id={call_id!r} (pass it "
                    "as call_id= to wait for this step again)",
                    call_id,
                )
            except ChannelClosedError as e:  # shut down before its sender sent it
                return CoordinatorUnavailableError(f"{op}: {e}")
        return answer

    def _extend(
        self, client_id: str | None, items, cache_salt, *, step: bool = False, probe=None
    ) -> tuple[list[ExtendAllocation], list[np.ndarray]]:
        """Decide an extend of ``items`` (lock held): a plain allocation (the client writes
        the K/V) or, for a ``step``, the step's (its tokens checked against the vocabulary
        unless it is a ``probe`` step).

        Returns:
            The allocations and the token ids of each item (``int64`` for a step).
        """
        keyed = self._namespaces.keyed_items(client_id, items)
        if step:
            for key, tokens in keyed:
                if isinstance(tokens, TokenDigest):
                    raise InvalidRequestError(f"a step needs token ids, got a digest for {key!r}")
            keyed = [
                (key, step_tokens(key, tokens, probe, self.vocab_size)) for key, tokens in keyed
            ]
        for key, _ in keyed:
            self._steps.check_not_failed(key)
        allocs = self._core.allocate_extend_batch(keyed, cache_salt=cache_salt)
        for a in allocs:
            self._leases.hold(client_id, a.rid)
            if not step:
                self._steps.client_writes(a.rid)
        return allocs, [tokens for _, tokens in keyed]

    def _decode(
        self, client_id: str | None, rids, token_ids, *, step: bool = False, probe=None
    ) -> tuple[np.ndarray, list[Hashable], Any]:
        """Decide one more token for each request (lock held); for a step, its ids are
        checked against the vocabulary. Returns the slots, the requests' keys and the ids."""
        keys = self._namespaces.keys(client_id, rids)
        if step:
            if token_ids is None and probe is None:
                raise InvalidRequestError("a decode step needs the token id of every request")
            token_ids = step_tokens(rids, token_ids, probe, self.vocab_size)
        for key in keys:
            self._steps.check_not_failed(key)
        slots = self._core.allocate_decode(keys, token_ids)
        for key in keys:
            # A client that carries a request on holds it, as one that extended it does:
            # another client's lapse must not free it under a live one.
            self._leases.hold(client_id, key)
            if not step:
                self._steps.client_writes(key)
        return slots, keys, token_ids

    def _step_reply_bytes(self, answer: Any) -> int:
        """What a step's remembered reply pins: its logits (and probe outputs)."""
        if not isinstance(answer, dict):
            return 0
        rows = len(answer.get("allocations", ())) or len(answer.get("slots", ()))
        return 4 * rows * (self.vocab_size or 1024)

    def _request_error(self, client_id: str | None, op: str, requests) -> CPKVError | None:
        """What a step's requests answer whatever the lanes' state: lost with a lane
        (LaneUnavailableError), failed (StepFailedError), unknown (a decode's rid:
        UnknownRequestError) or misnamed; ``None`` otherwise."""
        try:
            with self._lock:
                if op == "decode":
                    keys = self._namespaces.keys(client_id, requests)
                else:
                    keys = [key for key, _ in self._namespaces.keyed_items(client_id, requests)]
                for key in keys:
                    self._steps.check_not_failed(key)
                    self._core.check_not_lost(key)
                    if op == "decode":
                        self._core.request_len(key)  # an unknown rid says so, not "wait"
        except CPKVError as e:
            return e
        return None

    def fence(self) -> list[tuple[str | None, int]]:
        """Per lane, the last page move decided: a client's write waits for its lane to get
        there (the moves that gave it its pages travel on another path than its write)."""
        with self._lock:
            return self._channel.fence()

    def lane_fence(self) -> list[tuple[str | None, int]]:
        """:meth:`fence`, after sending every move still waiting for a step (a client's write
        found its lane behind its fence)."""
        with self._lock:
            self._channel.flush()
            return self._channel.fence()

    def _share(self, obj: Any) -> Any:
        share = getattr(self._transport, "share", None)
        return obj if share is None else share(obj)

    def _ensure_group(self) -> str | CPKVError:
        """The current lane group's id (the supervisor builds a stale one first)."""
        return self._supervisor.ensure_group(self._timeout_s)

    def _group_is_current(self, group: str) -> bool:
        """Whether the lanes are still in ``group`` (not dropped since it was read)."""
        return self._supervisor.is_current_group(group)

    def renew_lease(self, client_id: str) -> bool:
        """Push the client's lease out; False when it has none (lapsed, or a new coordinator).

        NOTE: takes only the lease table's lock: a renewal never waits behind a decision.
        """
        return self._leases.renew(client_id, self._clock())

    def claim_step_graph(self, client_id: str) -> bool:
        """May ``client_id`` run its steps through a compiled graph of its own? (It keeps a
        slot until :meth:`release_step_graph`, or loses it with its lease.)"""
        return self._graph_slots.claim(client_id)

    def release_step_graph(self, client_id: str) -> bool:
        """``client_id`` tore its step graph down: its slot is free again."""
        return self._graph_slots.release(client_id)

    def close_lease(self, client_id: str) -> int:
        """End a client's lease and free the requests it still holds; returns how many."""
        self._graph_slots.abandon(client_id)  # still held: its graph was not torn down
        with self._lock:
            rids = self._leases.close(client_id)
            self._free_quietly(rids)
            self._dispatch("lease")
            for stream in client_call_streams(client_id):  # it sends no call after this
                self._replies.forget_stream(stream)
            left = self._namespaces.leave(client_id)
            if left is not None and not any(
                namespace_of(key) == left for key in self._core.request_ids()
            ):
                self._namespaces.drop(left)
            return len(rids)

    def expire_leases(self) -> int:
        """Free the requests of every client whose lease lapsed; returns how many.

        A lease past its expiry is first checked with the liveness probe (when there is
        one): a client whose process is alive and running but did not renew (its renewer
        starved by a busy interpreter) keeps its lease; a stopped, dead or unknown one
        lapses. The probe runs without the lock.
        """
        now = self._clock()
        due = self._leases.due(now)
        if not due:
            return 0
        alive = set()
        if self._liveness is not None:
            for client_id, holder in due.items():
                if holder is not None and _safe_probe(self._liveness, holder) is True:
                    alive.add(client_id)
                    self._leases.extend(client_id, now)
        with self._lock:
            lapsed = self._leases.expire(now, only=set(due) - alive)
            freed = 0
            for client_id, rids in lapsed.items():
                self._graph_slots.abandon(client_id)
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

    def report_lane_failure(
        self, epoch: str, lane: int, detail: str = "", client_id: str | None = None
    ) -> Any:
        """A client saw ``lane`` fail: confirm with a probe; return the caller's requests lost
        with it (those of its namespace, as it named them)."""
        if epoch != self.epoch:
            return self._restarted(epoch)
        # NOTE: probe() records the lane lost when it finds it dead or restarted, for the
        # generation it asked; a lane that recovered in between is not lost a second time.
        logger.info("a client reports lane %d failing: %s", lane, detail)
        self._supervisor.probe(lane, self._timeout_s)
        with self._lock:
            self._settle_lanes()
            ns = self._namespaces.namespace(client_id)
            return [user_rid(k) for k in self._core.lost_rids(lane) if namespace_of(k) == ns]

    # ---------------------------------------------------------------- status
    def stats(self) -> dict:
        """Per-lane counts, counters and lane health; never waits for a lane."""
        with self._lock:
            self._settle_lanes()
            self._steps.settle()  # a step answered since the last call counts (never blocks)
            states = self._supervisor.states()
            out = self._core.stats()
            out["epoch"] = self.epoch
            out["mirror_mismatches"] = self._supervisor.num_mismatches
            out["slow_heartbeats"] = self._supervisor.num_slow_heartbeats
            out["heartbeat_errors"] = self._supervisor.num_heartbeat_errors
            out["lane_losses"] = [[lane, num_lost] for lane, num_lost in self._losses]
            out["lane_states"] = states
            out["restarting_lanes"] = [r for r, s in enumerate(states) if s == RESTARTING]
            out["dead_lanes"] = [r for r, s in enumerate(states) if s == DEAD]
            # Lane calls that carried page moves of their own (and compiled steps), the moves
            # decided, those that rode in step calls, and the moves by the op that made them.
            out["lane_calls"] = self._channel.num_calls
            out["lane_moves"] = self._channel.num_moves
            out["moves_in_step_calls"] = self._channel.num_riding_moves
            out["lane_moves_by_op"] = dict(self._channel.num_moves_by_op)
            out["pending_lane_calls"] = self._channel.num_pending
            out["num_leases"] = self._leases.num_leases
            out["leases_expired"] = self._leases.num_expired_requests
            out["leases_lapsed"] = self._leases.num_expired_leases
            out["leases_kept_alive"] = self._leases.num_kept_alive
            out["failed_steps"] = self._steps.num_failed_steps
            out["steps_in_flight"] = len(self._steps)
            out["hung_lanes"] = self._supervisor.num_hung
            out["step_graphs"] = self._graph_slots.num_held
            out["step_graphs_lost"] = self._graph_slots.num_lost
            return out

    def check(self) -> dict:
        """Core invariants, and each serving lane's own count against the mirror.

        Waits for the serving lanes only (a lane that is restarting is reported as such).
        """
        end = time.monotonic() + self._timeout_s
        while True:
            with self._lock:
                self._settle_lanes()
                problems = []
                try:
                    self._core.check_invariants()
                except AssertionError as e:
                    problems.append(f"core: {e}")
                expected = self._held_per_lane()
                for lane, state in enumerate(self._supervisor.states()):
                    if state != UP:
                        problems.append(f"lane {lane}: {state}")
                sent = self._supervisor.send_heartbeats()
            behind = False
            for r, known, _gen, reply in self._supervisor.replies(sent, self._timeout_s):
                if isinstance(reply, BaseException):  # a dead lane is a finding, not a crash
                    problems.append(f"lane {r}: {type(reply).__name__}")
                    continue
                incarnation, held = reply
                if incarnation != known:
                    problems.append(f"lane {r}: restarted and not yet recovered")
                elif held is None:  # a move riding in a compiled step still to come
                    behind = True
                elif held != expected[r]:
                    problems.append(f"lane {r}: holds {held} pages, mirror says {expected[r]}")
            if not behind or time.monotonic() > end:
                break
            time.sleep(_CHECK_RETRY_S)
        if behind:
            problems.append("lanes still behind their moves")
        with self._lock:  # the moves answered before those heartbeats: any refused?
            self._settle_lanes()
        return {"ok": not problems, "problems": problems, "held": expected}

    def heartbeat_once(self) -> None:
        """One heartbeat round (the background loop calls this every ``heartbeat_s``): find
        lanes that died, restarted, hung or disagree with the mirror; fail the lost ones.

        Takes the lock only to read and to act; waits for the lanes without it.
        """
        with self._lock:
            self._settle_lanes()
            expected = self._held_per_lane()
            sent = self._supervisor.send_heartbeats()
        self._supervisor.heartbeat(sent, expected, max(5.0, self._timeout_s))
        with self._lock:
            self._settle_lanes()

    def wait_recovered(self, timeout: float) -> bool:
        """Wait for lane recoveries in flight (tests)."""
        return self._supervisor.wait_recovered(timeout)

    def lane_states(self) -> list[str]:
        return self._supervisor.states()

    @property
    def num_failed_steps(self) -> int:
        """Steps that failed since the last reset."""
        return self._steps.num_failed_steps

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
        digest: int | None = None,
        size: Callable[[Any], int] | None = None,
    ) -> Any:
        """Decide one call under the lock, remember its answer for a repeat of the call.

        A call is named by ``(client_id, call_id)``; a repeat must ask the same thing (the
        same ``op`` and argument ``digest``): it then gets the first answer and changes
        nothing; a call id reused for something else is refused.
        """
        if epoch != self.epoch:
            return self._restarted(epoch)
        with self._lock:
            self._steps.settle()
            key = None if call_id is None else (client_id, call_id)
            if key is not None and was_answered(self._replies, key):
                return repeat_answer(self._replies, key, op, digest)
            lapsed = self._lapse_notice(client_id)
            if lapsed is not None:
                if key is not None:  # a retry of this call gets the same notice
                    self._replies.put(key, lapsed, tag=(op, digest))
                return lapsed
            self._settle_lanes(_MOVE_POLL_S)
            try:
                answer = for_caller(run())
            except CPKVError as e:
                answer = for_caller(e)
            self._dispatch(op, client_id)
            if key is not None:
                nbytes = size(answer) if size is not None else 0
                self._replies.put(key, answer, tag=(op, digest), nbytes=nbytes)
        if self._channel.num_pending > _MAX_PENDING_MOVES:
            self._channel.wait_oldest(self._timeout_s)  # back-pressure, without the lock
        return answer

    def _lapse_notice(self, client_id: str | None) -> LeaseExpiredError | None:
        """Renew the caller's lease; if it lapsed since its last call, say what was freed.

        NOTE: the notice is consumed here only, by a call of that client: its renewer
        reopening the lease (``hello``) does not hide it.
        """
        if client_id is None:
            return None
        now = self._clock()
        rids = self._leases.take_lapse(client_id, now)
        if rids is None:
            self._leases.renew(client_id, now)
            return None
        return LeaseExpiredError([user_rid(k) for k in rids])

    def _free_quietly(self, rids: list[Hashable]) -> None:
        for rid in rids:
            self._leases.release(rid)
            self._steps.forget(rid)
            with contextlib.suppress(CPKVError):  # freed meanwhile
                self._core.free(rid, cache=False)

    def _dispatch(self, op: str, client_id: str | None = None) -> None:
        """Number each lane its page moves (the lanes apply them in this order; they travel
        with the lane's next step, or on their own soon after); pages taken belong to the
        caller's namespace."""
        cached = self._core.drain_cached_pages()
        owner = self._namespaces.owner_id(client_id)
        for r, (taken, released) in enumerate(self._core.drain_page_moves()):
            if taken.size or released.size or cached[r].size:
                self._channel.send_moves(r, taken, released, op, owner, cached[r])

    def _held_per_lane(self) -> list[int]:
        free = self._core.num_free_pages_per_lane()
        return (self.config.num_pages_per_lane - 1 - free).tolist()

    def _settle_lanes(self, min_poll_s: float = 0.0) -> None:
        """Fail the requests of every lane the supervisor found lost since the last call
        (lock held; ``min_poll_s``: see :meth:`LaneSupervisor.settle`)."""
        lanes = self._supervisor.settle(min_poll_s)
        for lane, why in lanes:
            lost = self._core.drop_lane(lane)
            for key in lost:
                self._steps.forget(key)
            self._losses.append((lane, len(lost)))
            logger.warning("lane %d lost (%s): %d requests failed: %s", lane, why, len(lost), lost)
            # NOTE: leases keep the lost rids until freed: an expiry acknowledges them too.
        if lanes:
            # NOTE: once every lost lane is dropped: a lost request's pages on another lost
            # lane (in its new generation already) are released by its reset, not by a move
            # that lane, reset empty, would refuse (and be lost again once back).
            self._dispatch("lane_lost")

    def _heartbeat_loop(self, period_s: float) -> None:
        while not self._stop.wait(period_s):
            for task in (self.heartbeat_once, self.expire_leases):  # one failing skips not both
                try:
                    task()
                except Exception:
                    logger.exception("%s failed", task.__name__)


def _result_handle(handle: Any) -> Any:
    """A lane step gives ``(status, result)`` handles: the client reads the result."""
    return handle[1] if isinstance(handle, (list, tuple)) else handle


def _safe_probe(probe: Callable[[dict], bool | None], holder: dict) -> bool | None:
    try:
        return probe(holder)
    except Exception:
        logger.debug("liveness probe failed", exc_info=True)
        return None
