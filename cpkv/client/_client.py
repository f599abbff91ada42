"""CPKVClient, the public API of a client: each call's arguments checked at the edge
(:mod:`~cpkv.client._args`), then handed to the part that does it: allocations
(:mod:`~cpkv.client._allocations`), steps (:mod:`~cpkv.client._steps`), K/V reads and writes
(:mod:`cpkv.lane_io`), status calls (:mod:`~cpkv.client._calls`)."""

from __future__ import annotations

import asyncio
import contextlib
import random
import uuid
import weakref
from collections.abc import Hashable, Sequence

import numpy as np

from cpkv.actors.pool import Pool
from cpkv.actors.step_graph import StepGraph
from cpkv.client._allocations import AllocationCalls
from cpkv.client._args import (
    RequestChecks,
    check_free,
    check_greedy,
    check_lease,
    check_timeout,
    num_tokens,
    stop_tokens,
)
from cpkv.client._backoff import with_backoff
from cpkv.client._calls import Call, CoordinatorCalls
from cpkv.client._fence import MoveFence
from cpkv.client._lifetime import LeaseKeeper, drop_pool, weakly
from cpkv.client._payloads import TokenPayloads
from cpkv.client._requests import LiveRequests
from cpkv.client._steps import StepCalls
from cpkv.core.allocator import ExtendAllocation
from cpkv.core.config import CPConfig, KVShape
from cpkv.core.layout import PageLayout
from cpkv.core.steps import check_mode
from cpkv.core.validate import check_float, check_int
from cpkv.errors import InvalidRequestError, StepFailedError
from cpkv.lane_io import LaneIO
from cpkv.results import PrefillResult, decode_output, decode_samples

__all__ = ["CPKVClient"]


class CPKVClient:
    """Talks to one coordinator and its lanes; every call has a timeout.

    Args:
        coordinator: the coordinator actor handle.
        timeout_s: seconds before a call fails with RequestTimeoutError.
        pool: the pool the coordinator runs (see :class:`cpkv.actors.Pool`); when this
            process created it, this client owns it (its :meth:`shutdown` stops it).
            ``None``: the coordinator's pool, attached to.
        lease_s: this client's lease (see :func:`connect`); ``None`` for none.
        namespace: where this client's request ids live (``None``: a namespace of its own).
        call_retries: times a coordinator call that timed out is sent again, with the same
            call id (so it never takes effect twice).
        attention_mode: the steps' attention exchange unless a call names one.
        step_graph: send steps through a compiled graph to the coordinator when it grants
            one (a coordinator whose lanes run compiled steps); see :func:`connect`.

    Raises:
        InvalidRequestError: a bad ``call_retries`` or ``attention_mode``.
        RequestTimeoutError, CoordinatorUnavailableError: the coordinator did not answer.
    """

    def __init__(
        self,
        coordinator,
        *,
        timeout_s: float = 60.0,
        pool: Pool | None = None,
        lease_s: float | None = None,
        namespace: str | None = None,
        call_retries: int = 1,
        attention_mode: str = "auto",
        step_graph: bool = True,
    ) -> None:
        import ray

        from cpkv.actors.liveness import process_holder

        self._ray = ray
        call_timeout_s = check_timeout(timeout_s)
        self.client_id = uuid.uuid4().hex[:16]
        self.lease_s = check_lease(lease_s)
        self._requests = LiveRequests()
        self.namespace = namespace
        call_retries = check_int("call_retries", call_retries, minimum=0)
        self.attention_mode = check_mode(attention_mode, "attention_mode")
        self._hello_args = (self.client_id, lease_s, namespace, process_holder())
        self._fence = MoveFence(move_flush_s=0.0)
        self._rpc = CoordinatorCalls(
            ray,
            coordinator,
            self.client_id,
            self._hello_args,
            timeout_s=call_timeout_s,
            call_retries=call_retries,
            requests=self._requests,
            fence=self._fence,
            check_open=weakly(self._check_open),
            greeted=weakly(self._greeted),
        )
        hello = self._rpc.hello()
        self.config: CPConfig = hello["config"]
        self.kv: KVShape = hello["kv"]
        self.lanes: list = hello["lanes"]
        self.lane_names: list[str] = hello.get("lane_names", [])
        self.vocab_size: int | None = hello.get("vocab_size")
        self._checks = RequestChecks(self.config.max_context_len, self.vocab_size, self.kv)
        self._namespace_id: int = hello["namespace_id"]
        self._layout = PageLayout(self.config.cp_size, self.config.page_size)
        self._payloads = TokenPayloads(self.config, hello, self._requests)
        self._allocations = AllocationCalls(self._rpc, self._requests, self._payloads)
        if pool is None:
            pool = Pool(None, coordinator, self.config, self.lanes, self.lane_names)
        self._pool = pool
        self.name: str | None = pool.name  # the coordinator's actor name, when known
        self._fence.move_flush_s = hello.get("move_flush_s", 0.0)
        self._io = LaneIO(
            self.lanes,
            self._layout,
            self.kv,
            self.config.cp_size * self.config.num_pages_per_lane * self.config.page_size,
            self._namespace_id,
            self.timeout_s,
            fence=self._fence.current,
            fence_waiting=self._fence.waiting,
            refresh_fence=self._rpc.refresh_fence,
            unwrap=self._rpc.unwrap,
            lane_lost=self._rpc.lane_lost,
        )
        self._lease = LeaseKeeper(self, lease_s) if lease_s is not None else None
        graph = None
        if step_graph and hello.get("step_graph"):
            graph = StepGraph(coordinator, self.client_id, build_timeout_s=timeout_s)
        self._steps = StepCalls(self._rpc, graph)
        self._closed = False
        # A creator dropped without shutdown(): Ray's reference counts end its actors, this
        # removes their placement group and checkpoint too (not at exit: the job's end
        # removes them then, and a detached pool outlives it).
        self._drop_guard = weakref.finalize(self, drop_pool, pool)
        self._drop_guard.atexit = False

    @property
    def owns_pool(self) -> bool:
        """True when this client created the coordinator and lanes (shutdown stops them)."""
        return self._pool.created

    def _check_open(self) -> None:
        """Refuse a call after :meth:`shutdown` (on a handle of a stopped Ray it would start
        a new local Ray, then fail with Ray's own error)."""
        if self._closed:
            raise InvalidRequestError(
                "this client was shut down: cpkv.connect() again to use the pool"
            )

    def _open_coord(self):
        """The coordinator's handle, once :meth:`_check_open` passed."""
        self._check_open()
        return self._coord

    # ------------------------------------------------------------------- RPC
    # The coordinator calls (see cpkv.client._calls): their handle, settings and epoch
    # are the client's to read and set; ``_run``/``_arun`` run a call, ``_call`` makes one.
    @property
    def _coord(self):
        """The coordinator's actor handle."""
        return self._rpc.coord

    @_coord.setter
    def _coord(self, coordinator) -> None:
        self._rpc.coord = coordinator

    @property
    def _graph(self) -> StepGraph | None:
        """The compiled graph this client's steps go through (``None``: ordinary calls)."""
        return self._steps.graph

    @_graph.setter
    def _graph(self, graph: StepGraph | None) -> None:
        self._steps.graph = graph

    @property
    def _epoch(self) -> str:
        """The epoch of the coordinator this client last greeted."""
        return self._rpc.epoch

    @property
    def timeout_s(self) -> float:
        """Seconds before a call fails with RequestTimeoutError."""
        return self._rpc.timeout_s

    @timeout_s.setter
    def timeout_s(self, value: float) -> None:
        self._rpc.timeout_s = self._io.timeout_s = check_timeout(value)

    @property
    def call_retries(self) -> int:
        """Times a coordinator call that timed out is sent again, with the same call id."""
        return self._rpc.call_retries

    @call_retries.setter
    def call_retries(self, value: int) -> None:
        self._rpc.call_retries = check_int("call_retries", value, minimum=0)

    def _run(self, call: Call):
        return self._rpc.run(call)

    async def _arun(self, call: Call):
        return await self._rpc.arun(call)

    def _get(self, ref, what: str):
        return self._rpc.get(ref, what)

    def _call(self, method: str, *args, **kwargs) -> Call:
        return self._rpc.call(method, *args, **kwargs)

    def _call_id(self, call_id: Hashable | None = None) -> Hashable:
        return self._rpc.call_id(call_id)

    def _greeted(self, hello: dict) -> None:
        """Take a restarted coordinator's namespace id, page key and move flush period."""
        self._namespace_id = hello["namespace_id"]
        self._io.set_namespace_id(self._namespace_id)
        self._payloads.rekey(hello)
        self._fence.move_flush_s = hello.get("move_flush_s", 0.0)

    # ------------------------------------------------------------ allocation
    def allocate_extend(
        self,
        rid: Hashable,
        token_ids,
        *,
        cache_salt: str | bytes | None = None,
        call_id: Hashable | None = None,
    ) -> ExtendAllocation:
        """Allocate one request's prefill step (see :meth:`cpkv.CPAllocator.allocate_extend`).

        Request ids live in this client's namespace (see :func:`connect`): another job's
        ``"req-0"`` is another request. Calls on one rid are serialised by the coordinator.

        Args:
            rid: request id, ``str`` or ``int``.
            token_ids: the new tokens (the whole prompt for a new rid).
            cache_salt: requests share cached pages only with requests of the same salt.
            call_id: retry a call that raised RequestTimeoutError: pass its ``call_id``
                (the answer, if the call took effect, is the first one; never a second
                allocation).

        Raises:
            InvalidRequestError, KVCapacityWaitError, LaneUnavailableError,
            LeaseExpiredError, StepFailedError, CoordinatorUnavailableError,
            RequestTimeoutError.
        """
        rid, tokens = self._checks.extend(rid, token_ids, cache_salt)
        return self._run(self._allocations.extend(rid, tokens, cache_salt, call_id))

    async def allocate_extend_async(
        self,
        rid: Hashable,
        token_ids,
        *,
        cache_salt: str | bytes | None = None,
        call_id: Hashable | None = None,
    ) -> ExtendAllocation:
        """Async twin of :meth:`allocate_extend`."""
        rid, tokens = self._checks.extend(rid, token_ids, cache_salt)
        return await self._arun(self._allocations.extend(rid, tokens, cache_salt, call_id))

    def allocate_extend_with_backoff(
        self,
        rid: Hashable,
        token_ids,
        *,
        cache_salt: str | bytes | None = None,
        deadline_s: float = 30.0,
        initial_backoff_s: float = 0.005,
        max_backoff_s: float = 0.5,
        rng: random.Random | None = None,
    ) -> ExtendAllocation:
        """:meth:`allocate_extend`, retried on KVCapacityWaitError with jittered backoff.

        Raises:
            KVCapacityWaitError: the last one, once ``deadline_s`` has passed.
        """
        rid, tokens = self._checks.extend(rid, token_ids, cache_salt)
        return with_backoff(
            # checked once above, not on every retry
            lambda: self._run(self._allocations.extend(rid, tokens, cache_salt, None)),
            deadline_s=deadline_s,
            initial_backoff_s=initial_backoff_s,
            max_backoff_s=max_backoff_s,
            rng=rng,
        )

    def allocate_extend_batch(
        self,
        items: Sequence[tuple[Hashable, object]],
        *,
        cache_salt: str | bytes | None = None,
        call_id: Hashable | None = None,
    ) -> list:
        """Allocate one prefill step of several requests, all or nothing."""
        checked = self._checks.batch(items, cache_salt, "allocate_extend_batch")
        return self._allocations.extend_batch(checked, cache_salt, call_id)

    def allocate_decode(
        self, rids: Sequence[Hashable], token_ids=None, *, call_id: Hashable | None = None
    ) -> np.ndarray:
        """One more token for each request; ``int64 [len(rids)]`` slots."""
        rids, toks = self._checks.decode(rids, token_ids)
        return self._run(self._allocations.decode(rids, toks, call_id))

    async def allocate_decode_async(
        self, rids: Sequence[Hashable], token_ids=None, *, call_id: Hashable | None = None
    ) -> np.ndarray:
        """Async twin of :meth:`allocate_decode`."""
        rids, toks = self._checks.decode(rids, token_ids)
        return await self._arun(self._allocations.decode(rids, toks, call_id))

    def free(
        self,
        rid: Hashable,
        cache: bool = True,
        committed_len: int | None = None,
        *,
        call_id: Hashable | None = None,
    ) -> int:
        """Release a request; full pages go to the prefix cache when ``cache`` (only pages
        whose K/V is known written: a request whose step failed, or is still running,
        caches no page of that step)."""
        rid = check_free(rid, cache, committed_len)
        return self._run(self._allocations.free(rid, cache, committed_len, call_id))

    async def free_async(
        self,
        rid: Hashable,
        cache: bool = True,
        committed_len: int | None = None,
        *,
        call_id: Hashable | None = None,
    ) -> int:
        """Async twin of :meth:`free`."""
        rid = check_free(rid, cache, committed_len)
        return await self._arun(self._allocations.free(rid, cache, committed_len, call_id))

    # ---------------------------------------------------------------- steps
    def prefill(
        self,
        rid: Hashable,
        token_ids,
        *,
        cache_salt: str | bytes | None = None,
        mode: str | None = None,
        deadline_s: float | None = None,
        probe=None,
        call_id: Hashable | None = None,
        greedy: bool = False,
    ) -> PrefillResult:
        """Prefill one request's new tokens on the lanes (the pool's model).

        A new ``rid`` matches the prefix cache and gets a zigzag plan; an existing one
        continues (chunked prefill). Every lane runs every layer for its token ranges,
        writes their K/V into its shard in place and attends through the lanes' CP
        attention; one Ray call per lane.

        Args:
            rid: request id (``str`` or ``int``).
            token_ids: the new tokens (the whole prompt for a new rid), ids of the model's
                vocabulary.
            cache_salt: share cached pages only with requests of the same salt.
            mode: attention exchange for this step (default: the pool's ``attention_mode``).
            deadline_s: retry capacity waits with backoff until then (``None``: raise at once).
            probe: tests and benchmarks without a model: ``(q, k, v)`` tensors, one row per
                given token; the lanes attend them instead of running a model.
            call_id: retry a call that raised RequestTimeoutError (its ``call_id``).
            greedy: the lane takes the argmax of the last token's logits and answers only
                that id (``next_token``; ``logits`` is then ``None``): a 1B model's logits
                row is 256 KB on its way through the coordinator (about 1 ms of a step on an
                H100 box, measured).

        Returns:
            A :class:`PrefillResult`: fp32 ``[vocab]`` logits of the last new token (or with
            ``greedy`` its ``next_token``) and the step's :class:`ExtendAllocation`.

        Raises:
            As :meth:`allocate_extend`; InvalidRequestError when the pool has no model or an
            id is outside its vocabulary; StepFailedError when the step failed on a lane
            (the request is then failed: free it and submit again).
        """
        if deadline_s is not None:
            check_float("deadline_s", deadline_s)
        greedy = check_greedy(greedy, probe)
        rid, tokens = self._checks.extend(rid, token_ids, cache_salt, step=probe is None)
        mode = self._step_args(mode, probe, num_tokens(tokens))
        call_id = self._call_id(call_id)
        try:
            out, call_id = self._steps.send(
                "prefill", rid, tokens, cache_salt, mode, probe, greedy,
                call_id=call_id, deadline_s=deadline_s,
            )  # fmt: skip
        except StepFailedError:  # the request lives on, failed, until freed
            self._requests.rids.add(rid)
            raise
        self._requests.rids.add(rid)
        self._requests.held.pop(rid, None)  # stepped: the next allocation sends token ids
        return self._steps.results(out, "prefill", [rid], call_id)[0]

    def prefill_batch(
        self,
        items: Sequence[tuple[Hashable, object]],
        *,
        cache_salt: str | bytes | None = None,
        mode: str | None = None,
        probe=None,
        call_id: Hashable | None = None,
        greedy: bool = False,
    ) -> list[PrefillResult]:
        """Prefill several requests in one step (each sequence split by its own plan);
        ``greedy`` as :meth:`prefill`'s."""
        greedy = check_greedy(greedy, probe)
        checked = self._checks.batch(items, cache_salt, "prefill_batch", step=probe is None)
        mode = self._step_args(mode, probe, sum(num_tokens(t) for _, t in checked))
        call_id = self._call_id(call_id)
        try:
            out, call_id = self._steps.send(
                "prefill_batch", checked, cache_salt, mode, probe, greedy, call_id=call_id
            )
        except StepFailedError as e:  # the requests it names live on, failed, until freed
            rids = [rid for rid, _ in checked]
            # NOTE: a step that failed names every rid (as a tuple, or its one rid); a batch
            # refused before it allocated anything names the one already failed rid in it.
            self._requests.rids.update(
                rids if e.rid == tuple(rids) else [r for r in rids if r == e.rid]
            )
            raise
        self._requests.rids.update(rid for rid, _ in checked)
        for rid, _ in checked:
            self._requests.held.pop(rid, None)
        return self._steps.results(out, "prefill_batch", [rid for rid, _ in checked], call_id)

    def decode(
        self,
        rids: Sequence[Hashable],
        token_ids,
        *,
        mode: str | None = None,
        probe=None,
        deadline_s: float | None = None,
        call_id: Hashable | None = None,
    ):
        """One token for each request, attended over every lane's pages (merged by LSE).

        Args:
            rids: live requests.
            token_ids: the token each request appends (the last sampled one).
            deadline_s: retry capacity waits with backoff until then (``None``: raise at once).
            call_id: retry a call that raised RequestTimeoutError (its ``call_id``).

        Returns:
            ``fp32 [len(rids), vocab]`` next-token logits (probe steps: ``[len(rids), Hq, D]``
            attention outputs).

        Raises:
            As :meth:`prefill`.
        """
        return self._decode_step(rids, token_ids, mode, probe, deadline_s, call_id, False)

    def decode_greedy(
        self,
        rids: Sequence[Hashable],
        token_ids,
        *,
        mode: str | None = None,
        deadline_s: float | None = None,
        call_id: Hashable | None = None,
    ) -> np.ndarray:
        """:meth:`decode`, answering each request's greedy next token: the lanes take the
        argmax, so only ids come back (a 1B model's logits are 256 KB a row in bf16).

        Args:
            rids: live requests.
            token_ids: the token each request appends (the last sampled one).
            mode: attention exchange for this step (default: the pool's ``attention_mode``).
            deadline_s: retry capacity waits with backoff until then (``None``: raise at once).
            call_id: retry a call that raised RequestTimeoutError (its ``call_id``).

        Returns:
            ``int64 [len(rids)]`` the next token of each request.

        Raises:
            As :meth:`decode`.
        """
        return self._decode_step(rids, token_ids, mode, None, deadline_s, call_id, True)

    def _decode_step(
        self,
        rids: Sequence[Hashable],
        token_ids,
        mode: str | None,
        probe,
        deadline_s: float | None,
        call_id: Hashable | None,
        sample: bool,
    ) -> np.ndarray:
        """One decode step: logits (or probe outputs), or with ``sample`` the greedy ids."""
        rids, toks = self._checks.decode(rids, token_ids, step=probe is None)
        if toks is None:
            raise InvalidRequestError("decode needs the token id of every request")
        mode = self._step_args(mode, probe, len(rids))
        call_id = self._call_id(call_id)
        out, call_id = self._steps.send(
            "decode", rids, toks, mode, probe, sample, call_id=call_id, deadline_s=deadline_s
        )
        for rid in rids:
            self._requests.held.pop(rid, None)  # stepped: the next allocation sends token ids
        results = self._steps.wait(out["lanes"], "decode", rids, call_id)
        if sample:
            return decode_samples(results, len(rids))
        return decode_output(results, len(rids), probe is not None)

    def generate(
        self,
        rid: Hashable,
        token_ids,
        max_new_tokens: int,
        *,
        eos_token_id: int | Sequence[int] | None = None,
        cache_salt: str | bytes | None = None,
        deadline_s: float | None = None,
    ) -> list[int]:
        """Greedy generation: prefill ``token_ids`` then decode; the new token ids.

        Stops after ``max_new_tokens`` or at a stop token: ``eos_token_id`` is one id or
        several (transformers' ``generation_config.eos_token_id`` is often a list). The
        request stays live (free it when done). ``deadline_s``: each step waits out capacity
        pressure with backoff for up to this long (as :meth:`prefill`'s).

        Raises:
            The failing step's error, with ``generated``: the ids generated before it.
            After a :class:`KVCapacityWaitError` the request holds all but the last of them:
            resume with ``decode_greedy([rid], [generated[-1]])``. After a
            :class:`RequestTimeoutError` the step was sent and holds the last one too: take
            its answer with ``decode_greedy([rid], [generated[-1]], call_id=e.call_id)``
            (``prefill(rid, token_ids, greedy=True, call_id=e.call_id)`` when ``generated``
            is empty); a new call would append that id again. After a
            :class:`StepFailedError` or :class:`LaneUnavailableError` the request is failed
            or lost: free it and start again.
        """
        check_int("max_new_tokens", max_new_tokens, minimum=1)
        stop = stop_tokens(eos_token_id)
        out: list[int] = []
        try:
            first = self.prefill(
                rid, token_ids, cache_salt=cache_salt, greedy=True, deadline_s=deadline_s
            )
            out.append(first.next_token)
            while len(out) < max_new_tokens and out[-1] not in stop:
                ids = self.decode_greedy([rid], [out[-1]], deadline_s=deadline_s)
                out.append(int(ids[0]))
        except Exception as e:
            e.generated = out  # type: ignore[attr-defined]
            raise
        return out

    def _step_args(self, mode: str | None, probe, num_tokens: int) -> str:
        """The step's mode (default: the client's ``attention_mode``), its probe checked."""
        return self._checks.step(self.attention_mode if mode is None else mode, probe, num_tokens)

    # ------------------------------------------------------------------- KV
    def store_kv(self, slots, k, v, layer: int = 0) -> None:
        """Write K/V of tokens at their global slots; each lane gets its own tokens.

        Args:
            slots: ``int64 [T]`` global slots, e.g. ``alloc.out_cache_loc``.
            k, v: ``[T, num_heads, head_dim]`` tensors of the lanes' dtype.
            layer: which layer's shard.

        Raises:
            InvalidRequestError: shapes, dtypes or slots wrong (before any call); a slot on a
                page that is not this client's namespace's (the lanes refuse it: cached
                pages are read-only, other jobs' pages out of reach).
            LaneUnavailableError: a lane died; its requests are lost.
        """
        self._check_open()
        self._io.store_kv(slots, k, v, layer)

    def gather_kv(self, slots, layer: int = 0):
        """Read back K/V ``[T, heads, head_dim]`` at global slots (CPU tensors)."""
        self._check_open()
        return self._io.gather_kv(slots, layer)

    # ---------------------------------------------------------------- status
    def stats(self, lanes: bool = False) -> dict:
        """The coordinator's per-lane counts and counters; ``lanes`` adds each lane's own."""
        out = self._get(self._open_coord().stats.remote(), "stats")
        if lanes:
            out["lanes"] = self.lane_info()
        return out

    async def stats_async(self, lanes: bool = False) -> dict:
        """Async twin of :meth:`stats`."""
        out = await self._arun(self._rpc.answer(self._open_coord().stats.remote(), "stats"))
        if lanes:
            out["lanes"] = await asyncio.to_thread(self.lane_info)
        return out

    def check(self) -> dict:
        """Core invariants and each lane's count against the mirror: ``{"ok", "problems"}``."""
        return self._get(self._open_coord().check.remote(), "check")

    def reset(self) -> None:
        """Drop every request and cached page of the pool (all clients'); lanes emptied."""
        self._get(self._open_coord().reset.remote(), "reset")
        self._requests.clear()

    def lane_info(self) -> list[dict]:
        """Each lane's node, device, GPU ids and own page counts."""
        self._check_open()
        return self._io.wait_lanes(
            [(r, lane.info.remote()) for r, lane in enumerate(self.lanes)], "lane_info"
        )

    def ping_lanes(self) -> None:
        """A bare parallel no-op round to every lane (the benchmarks' baseline)."""
        self._check_open()
        self._io.wait_lanes([(r, lane.ping.remote()) for r, lane in enumerate(self.lanes)], "ping")

    @property
    def live_rids(self) -> set:
        """Requests this client allocated and has not freed."""
        return set(self._requests.rids)

    def shutdown(self) -> None:
        """Let go of the pool.

        The client that created the pool stops it (coordinator and lanes) and Ray if it
        started it. A client that attached only closes its lease, which frees the
        requests it still holds; the pool goes on for its other clients (to stop a
        pool from any client, call :meth:`stop_pool`).
        """
        if self._lease is not None:
            self._lease.stop()
        if self._graph is not None:  # before the pool or our lease goes: see StepGraph
            self._graph.close(timeout_s=self.timeout_s)
        if self._closed:
            return
        self._closed = True
        self._drop_guard.detach()
        if self.owns_pool:
            self.stop_pool()
        elif self.lease_s is not None:
            with contextlib.suppress(Exception):  # the pool is gone already
                self._ray.get(self._coord.close_lease.remote(self.client_id), timeout=5)
        self._requests.clear()
        self._pool.release_ray()  # the last of this process's pools stops the local Ray

    def stop_pool(self) -> None:
        """Stop the coordinator and its lanes for every client (whoever created them)."""
        self._pool.stop()

    def __enter__(self) -> CPKVClient:
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()
