"""CPKVClient: the plain Python face of cpkv; Ray stays inside.

client = cpkv.connect(cp_size=4, page_size=64, num_pages_per_lane=4096)
alloc = client.allocate_extend("req-1", token_ids)
client.store_kv(alloc.out_cache_loc, k, v)        # the lanes' K/V for those tokens
client.free("req-1")
client.shutdown()
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import functools
import itertools
import logging
import pickle
import random
import threading
import time
import uuid
import weakref
from collections.abc import Callable, Generator, Hashable, Sequence
from dataclasses import replace
from typing import Any, TypeVar

import numpy as np

from cpkv.actors.pool import LaneOptions, Pool
from cpkv.actors.step_graph import GraphUnavailable, StepGraph
from cpkv.actors.wire import PACKED_CALLS, pack, unpack
from cpkv.coordinator.channel import LaneDeadError, StepAborted
from cpkv.core.allocator import ExtendAllocation
from cpkv.core.config import CPConfig, KVShape
from cpkv.core.layout import PageLayout
from cpkv.core.page_hash import PageHasher, TokenDigest
from cpkv.core.steps import LaneReply, StepResult, check_mode, superseded
from cpkv.core.validate import (
    as_token_array,
    check_distinct,
    check_float,
    check_int,
    check_rid,
    check_rids,
    check_salt,
    check_vocab,
)
from cpkv.errors import (
    CoordinatorUnavailableError,
    InvalidRequestError,
    KVCapacityWaitError,
    LaneUnavailableError,
    LeaseExpiredError,
    RequestTimeoutError,
    StaleDigestError,
    StepFailedError,
    UnknownRequestError,
)
from cpkv.lane_io import LaneIO, actor_death
from cpkv.results import PrefillResult, decode_output, decode_samples, prefill_results

__all__ = ["CPKVClient", "PrefillResult", "connect"]

logger = logging.getLogger("cpkv.client")
# The least backoff between capacity-wait retries (10k calls a second at most).
_MIN_BACKOFF_S = 1e-4

DEFAULT_NAME = "cpkv-coordinator"

_T = TypeVar("_T")
# A new pool's K/V fields when connect() names none (an attaching client takes the pool's).
_KV_FIELDS = tuple(f.name for f in dataclasses.fields(KVShape))
_DEFAULT_KV = dataclasses.astuple(KVShape())
# Digest offsets remembered by (call id, rid), for retries by call id.
_REMEMBERED_OFFSETS = 4096
# A coordinator call: yields ``(ref, what)``, is sent the answer, returns the result.
_Call = Generator[tuple[Any, str], Any, Any]


def connect(
    address: str | None = None,
    *,
    cp_size: int = 4,
    page_size: int = 64,
    num_pages_per_lane: int = 1024,
    max_reqs: int = 256,
    max_context_len: int = 1 << 20,
    num_gpus_per_lane: float | None = None,
    num_cpus_per_lane: float = 0.25,
    strategy: str = "STRICT_PACK",
    name: str = DEFAULT_NAME,
    timeout_s: float = 60.0,
    start_timeout_s: float = 300.0,
    heartbeat_s: float = 1.0,
    lease_s: float | None = 30.0,
    detached: bool = False,
    num_layers: int | None = None,
    num_heads: int | None = None,
    head_dim: int | None = None,
    dtype: str | None = None,
    model=None,
    model_seed: int | None = None,
    gpu_memory_utilization: float | None = None,
    attention_mode: str = "auto",
    owner_split: str = "zigzag",
    namespace: str | None = None,
    lane_hang_s: float | None = None,
    call_retries: int = 1,
    compiled_steps: bool = False,
    step_graph: bool = True,
) -> CPKVClient:
    """Start or attach to Ray, get or create the named coordinator and its lanes.

    Args:
        address: ``None`` starts an embedded Ray on 127.0.0.1 (logical GPUs when
            the machine has none); ``"auto"`` or ``"ray://host:port"`` attaches (also
            from inside a Ray actor or task, which then gets a client of its own).
        cp_size, page_size, num_pages_per_lane, max_reqs, max_context_len: the
            pool (see :class:`cpkv.CPConfig`).
        num_gpus_per_lane: GPUs per lane; default 1 where the cluster has at least
            ``cp_size`` GPUs, else lanes packed an equal share of a GPU each (3 GPUs at
            cp 4: 0.5 a lane), and 0 (CPU lanes) where it has none.
        num_cpus_per_lane: logical CPUs each lane reserves.
        strategy: ``STRICT_PACK`` (default), ``PACK``, ``SPREAD`` or ``STRICT_SPREAD``.
        name: the coordinator's actor name; an existing one is attached to (a client that
            attached leaves the pool running on :meth:`CPKVClient.shutdown`).
        timeout_s: every client call fails with RequestTimeoutError after this.
        start_timeout_s: how long a pool this call creates may take to start: its lanes
            placed, their processes up (importing torch, loading the model) and the
            coordinator's first answer.
        heartbeat_s: the coordinator's lane heartbeat and lease-check period.
        lease_s: this client's lease: renewed in the background while the client
            lives; when it lapses (the process died) the coordinator frees the
            client's requests. ``None``: no lease, requests live until freed.
        detached: actors outlive this driver (for shared, long-lived pools).
        num_layers, num_heads, head_dim, dtype: each lane's K/V tensors (taken from the
            model's config when a model is given). ``None``: a new pool's defaults (1, 8,
            128, ``bfloat16``), an existing pool's own when attaching; one named must be
            the existing pool's.
        model: run this model's prefill and decode on the lanes: a transformers
            Llama-family ``*ForCausalLM`` instance (written once to a temporary checkpoint
            that every local lane reads; on several machines pass a checkpoint directory
            they share), a checkpoint directory every lane can read (``config.json`` +
            ``*.safetensors``), a :class:`cpkv.models.LlamaModel`, or a
            :class:`cpkv.models.ModelConfig` (random weights from ``model_seed``, drawn
            on every lane alike).
        model_seed: the seed of random weights for a ``ModelConfig``.
        gpu_memory_utilization: size each lane's pages from its device's memory (this
            fraction of it, less what the weights use and an activation reserve) instead of
            ``num_pages_per_lane``; lanes packed on one GPU take their GPU fraction each,
            CPU lanes an equal part of their host's; the smallest lane sets the pool's size.
        attention_mode: the exchange of CP attention steps: ``auto`` (chosen per step by
            measured cost), ``pass_q`` or ``pass_kv``.
        owner_split: ``zigzag`` (default) or ``contiguous``, an ablation of the owner plan.
        namespace: where this client's request ids live. ``None`` (default): a namespace of
            its own, so two jobs that both name a request ``"req-0"`` never meet; clients
            that pass the same name (a driver and its actors) share their requests. Reads
            and writes of K/V reach only the namespace's pages (and cached ones, read-only).
        lane_hang_s: a lane that answers no heartbeat for this long (alive but stuck) is
            killed and brought back like a dead one; default ``max(60, 2 * timeout_s)``
            (a step holds the lane's heartbeat behind it, so this must outlast the longest
            step).
        call_retries: times a coordinator call that timed out is sent again with the same
            call id (it never takes effect twice).
        compiled_steps: send prefill and decode steps to the lanes through one Ray Compiled
            Graph instead of an actor call per lane: a step's fixed cost drops by Ray's
            per-call scheduling (``benchmarks/bench_steps.py --dispatch``); the lanes'
            answers then come back through the coordinator.
        step_graph: with ``compiled_steps``, this client sends its steps to the coordinator
            through a compiled graph of its own too (when the coordinator has a slot free;
            otherwise, and whenever the graph cannot take a step, as ordinary calls).

    Returns:
        A :class:`CPKVClient`.

    Raises:
        InvalidRequestError: bad sizes, or an existing coordinator of another shape.
        TypeError: a ``model`` of a kind cpkv does not run.
        ValueError: a model config cpkv refuses (a sliding window).
        RequestTimeoutError, CoordinatorUnavailableError: an existing coordinator did not
            answer.
        TimeoutError: the lanes were not placed or started within ``start_timeout_s``.
    """
    check_mode(attention_mode, "attention_mode")
    heartbeat_s = check_float("heartbeat_s", heartbeat_s)
    start_timeout_s = check_float("start_timeout_s", start_timeout_s)
    config = CPConfig(
        cp_size, page_size, num_pages_per_lane, max_reqs, max_context_len, owner_split
    )
    _check_lease(lease_s)
    if namespace is not None and not isinstance(namespace, str):
        raise InvalidRequestError(f"namespace={namespace!r} must be a str or None")
    timeout_s = _check_timeout(timeout_s)
    if lane_hang_s is None:
        lane_hang_s = max(60.0, 2 * timeout_s)
    options = LaneOptions(
        num_gpus_per_lane=num_gpus_per_lane,
        num_cpus_per_lane=num_cpus_per_lane,
        strategy=strategy,
        start_timeout_s=start_timeout_s,
        detached=detached,
        gpu_memory_utilization=gpu_memory_utilization,
        heartbeat_s=heartbeat_s,
        timeout_s=timeout_s,
        lane_hang_s=check_float("lane_hang_s", lane_hang_s),
        compiled_steps=bool(compiled_steps),
    )
    call_retries = check_int("call_retries", call_retries, minimum=0)
    spec = None
    if model is not None:
        from cpkv.models.spec import ModelSpec

        spec = ModelSpec.from_source(model, seed=model_seed)
        num_layers, num_heads, head_dim, dtype = spec.kv_shape
    asked = (num_layers, num_heads, head_dim, dtype)
    kv = KVShape(*(d if a is None else a for a, d in zip(asked, _DEFAULT_KV, strict=True)))
    pool = Pool.open(address, name, config, kv, options, spec)
    try:
        if not pool.created:
            if gpu_memory_utilization is not None:  # sized by its creator: compare the rest
                config = replace(config, num_pages_per_lane=pool.config.num_pages_per_lane)
            _check_attached(pool, name, config, asked, spec)
        return CPKVClient(
            pool.coordinator,
            timeout_s=timeout_s,
            pool=pool,
            lease_s=lease_s,
            namespace=namespace,
            call_retries=call_retries,
            attention_mode=attention_mode,
            step_graph=step_graph,
        )
    except BaseException:  # nothing this call started stays behind
        if pool.created:
            pool.stop()
        pool.release_ray()
        raise


def _check_attached(pool: Pool, name: str, config: CPConfig, asked: tuple, spec) -> None:
    """An existing pool must be the one asked for: its shape, the K/V fields the caller
    named (``None``: the pool's), and its model's vocabulary when a model is named."""
    if pool.config != config:
        raise InvalidRequestError(
            f"coordinator {name!r} exists with {pool.config}, asked for {config}"
        )
    have = dataclasses.astuple(pool.kv) if pool.kv is not None else (None,) * 4
    named = [(f, a, h) for f, a, h in zip(_KV_FIELDS, asked, have, strict=True) if a is not None]
    vocab = None if spec is None else spec.config.vocab_size
    if any(a != h for _, a, h in named) or (spec is not None and vocab != pool.vocab_size):
        want = ", ".join(f"{f}={a!r}" for f, a, _ in named)
        raise InvalidRequestError(
            f"coordinator {name!r} exists with {pool.kv} and vocab_size={pool.vocab_size}; "
            f"asked for {want or 'its K/V'} and vocab_size={vocab}"
        )


class _LeaseKeeper:
    """Renews a client's lease every third of it, while the client lives.

    Holds the client weakly: a client that is garbage-collected (dropped without
    :meth:`CPKVClient.shutdown`) has its lease closed, its requests freed, as shutdown does.
    NOTE: not left to lapse: its process may live on (a pooled Ray worker), and the
    coordinator keeps the lease of a live process's client whose renewals stopped.
    """

    def __init__(self, client: CPKVClient, lease_s: float) -> None:
        self._client = weakref.ref(client)
        self._coord = client._coord
        self._client_id = client.client_id
        self._hello_args = client._hello_args
        self._lease_s = lease_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="cpkv-lease")
        self._thread.start()

    def _run(self) -> None:
        import ray

        while not self._stop.wait(self._lease_s / 3):
            if self._client() is None:
                try:
                    ray.get(self._coord.close_lease.remote(self._client_id), timeout=self._lease_s)
                except Exception:  # the pool went with it (its creator), or is restarting
                    logger.debug("closing a dropped client's lease failed", exc_info=True)
                return
            try:
                renewed = ray.get(
                    self._coord.renew_lease.remote(self._client_id), timeout=self._lease_s
                )
                if not renewed and not self._stop.is_set():  # (closed by shutdown meanwhile)
                    # Lapsed (or a new coordinator): open the lease again. NOTE: the lapse
                    # stays remembered; the client's next call is told what was freed.
                    ray.get(self._coord.hello.remote(*self._hello_args), timeout=self._lease_s)
            except Exception:  # coordinator restarting or gone: try again next period
                logger.debug("lease renewal failed", exc_info=True)

    def stop(self) -> None:
        self._stop.set()


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
        self._coord = coordinator
        self.timeout_s = _check_timeout(timeout_s)
        self._calls = itertools.count()
        self.client_id = uuid.uuid4().hex[:16]
        self.lease_s = _check_lease(lease_s)
        self._rids: set[Hashable] = set()
        self._lost: list = []
        self.namespace = namespace
        self.call_retries = check_int("call_retries", call_retries, minimum=0)
        self.attention_mode = check_mode(attention_mode, "attention_mode")
        self._hello_args = (self.client_id, lease_s, namespace, process_holder())
        hello = self._get(self._coord.hello.remote(*self._hello_args), "hello")
        self._epoch: str = hello["epoch"]
        # The coordinator died or restarted under a call: its restart has a new epoch (and
        # key) to take before the next call, or that call would be refused as the old one's.
        self._epoch_stale = False
        self.config: CPConfig = hello["config"]
        self.kv: KVShape = hello["kv"]
        self.lanes: list = hello["lanes"]
        self.lane_names: list[str] = hello.get("lane_names", [])
        self.vocab_size: int | None = hello.get("vocab_size")
        self._namespace_id: int = hello["namespace_id"]
        self._layout = PageLayout(self.config.cp_size, self.config.page_size)
        self._hasher = _hasher(self.config, hello)
        # Tokens each request held after this client's last allocate_extend of it: where its
        # next chunk starts in its partial page (the digest of that chunk depends on it).
        self._held: dict[Hashable, int] = {}
        # The partial-page offset each (call id, rid) was digested at (the newest), for
        # retries by call id: -1 when the ids themselves were sent.
        self._offsets: collections.OrderedDict[tuple, int] = collections.OrderedDict()
        self._offsets_lock = threading.Lock()
        if pool is None:
            pool = Pool(None, coordinator, self.config, self.lanes, self.lane_names)
        self._pool = pool
        self.name: str | None = pool.name  # the coordinator's actor name, when known
        # Per lane, the last page move the coordinator had decided at our last allocation,
        # and when it came: for move_flush_s after it, its moves may still wait there.
        self._fence: list | None = None
        self._fence_at = -float("inf")
        self._move_flush_s: float = hello.get("move_flush_s", 0.0)
        self._fence_lock = threading.Lock()
        self._io = LaneIO(
            self.lanes,
            self._layout,
            self.kv,
            self.config.cp_size * self.config.num_pages_per_lane * self.config.page_size,
            self._namespace_id,
            self.timeout_s,
            fence=_weakly(self._current_fence),
            fence_waiting=_weakly(self._fence_waiting),
            refresh_fence=_weakly(self._refresh_fence),
            unwrap=_weakly(self._unwrap),
            lane_lost=_weakly(self._lane_lost),
        )
        self._lease = _LeaseKeeper(self, lease_s) if lease_s is not None else None
        self._graph: StepGraph | None = None
        if step_graph and hello.get("step_graph"):
            self._graph = StepGraph(coordinator, self.client_id, build_timeout_s=timeout_s)
        self._closed = False
        # A creator dropped without shutdown(): Ray's reference counts end its actors, this
        # removes their placement group and checkpoint too (not at exit: the job's end
        # removes them then, and a detached pool outlives it).
        self._drop_guard = weakref.finalize(self, _drop_pool, pool)
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
    # NOTE: a coordinator call is written once, as a generator that yields ``(ref, what)``
    # and is sent the answer (or thrown the error, already cpkv's); :meth:`_run` waits with
    # ``ray.get``, :meth:`_arun` with ``await``: sync and async twins share all but the wait.
    def _run(self, call: _Call):
        answer = error = None
        while True:
            try:
                ref, what = call.send(answer) if error is None else call.throw(error)
            except StopIteration as done:
                return done.value
            try:
                answer, error = self._ray.get(ref, timeout=self.timeout_s), None
            except Exception as e:
                answer, error = None, self._translate(e, what)

    async def _arun(self, call: _Call):
        answer = error = None
        while True:
            try:
                ref, what = call.send(answer) if error is None else call.throw(error)
            except StopIteration as done:
                return done.value
            try:
                answer, error = await asyncio.wait_for(ref, timeout=self.timeout_s), None
            except Exception as e:
                answer, error = None, self._translate(e, what)

    def _get(self, ref, what: str):
        """One coordinator answer (no call id: status and lease calls)."""
        return self._run(self._answer(ref, what))

    def _answer(self, ref, what: str, fenced: bool = False, packed: bool = False) -> _Call:
        out = yield ref, what
        if packed:  # cpkv.actors.wire
            out = unpack(out)
        return self._unwrap(self._take_fence(out) if fenced else out)

    def _call(
        self,
        method: str,
        *args,
        what: str,
        call_id: Hashable | None = None,
        fenced=False,
        retries: int | None = None,
    ) -> _Call:
        """One coordinator call named by a call id. A call that times out is sent again with
        the same id (``retries`` times, default ``call_retries``): the coordinator answers a
        repeat with its first answer, so it never takes effect twice.

        Raises:
            RequestTimeoutError: no answer after the retries; its ``call_id`` retries later.
        """
        call_id = self._call_id(call_id)
        retries = self.call_retries if retries is None else retries
        for attempt in range(retries + 1):
            yield from self._greet_if_restarted()
            call = (self._epoch, self.client_id, call_id, *args)
            packed = method in PACKED_CALLS
            self._check_open()
            ref = getattr(self._coord, method).remote(*((pack(call),) if packed else call))
            try:
                return (yield from self._answer(ref, what, fenced, packed))
            except RequestTimeoutError as e:
                if attempt == retries:
                    raise _retryable(e, call_id) from None
                logger.info("%s timed out; sending it again as call %r", what, call_id)
        raise AssertionError("unreachable")

    def _call_id(self, call_id: Hashable | None = None) -> Hashable:
        """A new call id, or the caller's (to retry a call that timed out, safely)."""
        if call_id is None:
            return (self.client_id, next(self._calls))
        try:
            hash(call_id)
        except TypeError:
            raise InvalidRequestError(f"call_id={call_id!r} must be hashable") from None
        # The coordinator knows a repeat by equality with the id it got, a copy: an id
        # unequal to its copy (a NaN in it) would run the call again on every retry.
        try:
            same = pickle.loads(pickle.dumps(call_id)) == call_id
        except Exception:
            same = False
        if not same:
            raise InvalidRequestError(
                f"call_id={call_id!r} must equal a copy of itself (no NaN) and be picklable"
            )
        return call_id

    def _take_fence(self, out):
        """Keep the latest move of each lane seen in any answer: answers of concurrent calls
        arrive in any order, and a write must wait for the moves of its own allocation."""
        answer, fence = out
        self._merge_fence(fence, waiting=True)
        return answer

    def _merge_fence(self, fence: list, waiting: bool) -> None:
        """Take ``fence`` where it is later than ours; ``waiting``: its moves may still wait
        at the coordinator (an allocation's answer), else they were sent (``lane_fence``)."""
        with self._fence_lock:
            self._fence = fence if self._fence is None else _later_fence(self._fence, fence)
            self._fence_at = time.monotonic() if waiting else -float("inf")

    def _current_fence(self) -> list | None:
        """Per lane, the latest page move seen (``None``: no allocation answered yet)."""
        return self._fence

    def _fence_waiting(self) -> bool:
        """Whether the fence's moves may still wait at the coordinator for a step (they are
        sent within ``move_flush_s`` of the answer that named them)."""
        return time.monotonic() - self._fence_at < self._move_flush_s

    def _refresh_fence(self) -> None:
        """Have the coordinator send every page move it decided so far; take them as the
        fence."""
        self._merge_fence(self._get(self._open_coord().lane_fence.remote(), "fence"), waiting=False)

    def _translate(self, e: Exception, what: str) -> Exception:
        """Ray's timeout and actor errors as cpkv's; anything else unchanged."""
        ray = self._ray
        if isinstance(e, (ray.exceptions.GetTimeoutError, asyncio.TimeoutError)):
            return RequestTimeoutError(f"{what}: no answer within {self.timeout_s}s")
        if isinstance(e, actor_death(ray)):
            self._lose_all()
            self._epoch_stale = True
            return CoordinatorUnavailableError(
                f"{what}: coordinator died ({type(e).__name__})", self._take_lost()
            )
        return e

    def _unwrap(self, out):
        if isinstance(out, CoordinatorUnavailableError):
            self._lose_all()
            self._epoch_stale = True  # the next call greets the restarted coordinator first
            raise CoordinatorUnavailableError(out.detail, self._take_lost())
        if isinstance(out, (LaneUnavailableError, LeaseExpiredError)):
            self._forget(out.rids)
        if isinstance(out, BaseException):
            raise out
        return out

    def _greet_if_restarted(self) -> _Call:
        """When a call found the coordinator dead or gone (``_epoch_stale``), greet its
        restart and take its epoch, page key and namespace id (it numbers namespaces again,
        in the order its clients greet it); while it is still down this raises
        CoordinatorUnavailableError again. Otherwise nothing."""
        if not self._epoch_stale:
            return
        hello = yield self._open_coord().hello.remote(*self._hello_args), "hello"
        self._epoch = hello["epoch"]
        self._namespace_id = hello["namespace_id"]
        self._io.set_namespace_id(self._namespace_id)
        self._hasher = _hasher(self.config, hello)
        self._move_flush_s = hello.get("move_flush_s", 0.0)
        self._epoch_stale = False

    def _lane_lost(self, lane: int, what: str, detail: str) -> LaneUnavailableError:
        """A lane call found ``lane`` dead: tell the coordinator, forget our requests lost
        with it; the error to raise."""
        lost = self._get(
            self._coord.report_lane_failure.remote(self._epoch, lane, detail, self.client_id),
            "report_lane_failure",
        )
        self._forget(lost)
        return LaneUnavailableError(lane, lost, f"{what} failed")

    def _forget(self, rids) -> None:
        for rid in rids:
            self._rids.discard(rid)
            self._held.pop(rid, None)

    def _lose_all(self) -> None:
        self._lost = sorted(self._rids, key=repr)
        self._forget(self._lost)

    def _take_lost(self) -> list:
        lost, self._lost = self._lost, []
        return lost

    # ------------------------------------------------------------ validation
    def _check_tokens(self, rid: Hashable, token_ids, *, step: bool = False) -> np.ndarray:
        """``int64 [n]`` token ids, checked once here and passed on as they are."""
        tokens = as_token_array(token_ids, name=f"token_ids[{rid!r}]")
        if step:
            check_vocab(tokens, self.vocab_size, name=f"token_ids[{rid!r}]")
        if tokens.shape[0] > self.config.max_context_len:
            raise InvalidRequestError(
                f"rid={rid!r}: {tokens.shape[0]} tokens > max_context_len="
                f"{self.config.max_context_len}"
            )
        return tokens

    def _extend_args(self, rid, token_ids, cache_salt, *, step: bool = False):
        """Validate an extend's arguments on the caller's side (before any actor call);
        a step's token ids are also checked against the model's vocabulary."""
        rid = check_rid(rid)
        tokens = self._check_tokens(rid, token_ids, step=step)
        check_salt(cache_salt)
        return rid, tokens

    def _batch_args(
        self, items, cache_salt, what: str, *, step: bool = False
    ) -> list[tuple[Hashable, np.ndarray]]:
        """A batch's ``(rid, tokens)`` pairs checked on the caller's side."""
        if isinstance(items, (str, bytes)) or not isinstance(items, (list, tuple)):
            raise InvalidRequestError(
                f"{what} takes a list of (rid, token_ids) pairs, got {type(items).__name__}"
            )
        checked = []
        for i, item in enumerate(items):
            if not isinstance(item, (list, tuple)) or len(item) != 2:
                raise InvalidRequestError(f"{what}: item {i} = {item!r:.60} is not (rid, tokens)")
            rid = check_rid(item[0])
            checked.append((rid, self._check_tokens(rid, item[1], step=step)))
        if not checked:
            raise InvalidRequestError(f"{what} got an empty batch")
        check_distinct([rid for rid, _ in checked], what)
        check_salt(cache_salt)
        return checked

    def _decode_args(
        self, rids: Sequence[Hashable], token_ids, *, step: bool = False
    ) -> tuple[list, np.ndarray | None]:
        rids = check_rids(rids)
        if not rids:
            raise InvalidRequestError("allocate_decode got no rids")
        check_distinct(rids, "allocate_decode")
        toks = None if token_ids is None else as_token_array(token_ids)
        if toks is not None and toks.shape[0] != len(rids):
            raise InvalidRequestError(
                f"allocate_decode got {toks.shape[0]} token ids for {len(rids)} rids"
            )
        if step and toks is not None:
            check_vocab(toks, self.vocab_size)
        return rids, toks

    def _free_args(self, rid, cache, committed_len) -> Hashable:
        rid = check_rid(rid)
        if not isinstance(cache, (bool, np.bool_)):
            raise InvalidRequestError(f"cache={cache!r} must be True or False")
        if committed_len is not None:
            check_int("committed_len", committed_len, minimum=0)
        return rid

    def _step_args(self, mode: str | None, probe, num_tokens: int) -> str:
        """The step's mode; a step without a probe needs the pool's model, and a probe is
        ``(q, k, v)`` of the step's ``num_tokens`` tokens in the pool's K/V shape."""
        mode = check_mode(self.attention_mode if mode is None else mode)
        if probe is None and self.vocab_size is None:
            raise InvalidRequestError(
                "this pool has no model: connect(..., model=...) to prefill and decode"
            )
        if probe is not None:
            _check_probe(probe, num_tokens, self.kv)
        return mode

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
        rid, tokens = self._extend_args(rid, token_ids, cache_salt)
        return self._run(self._extend(rid, tokens, cache_salt, call_id))

    async def allocate_extend_async(
        self,
        rid: Hashable,
        token_ids,
        *,
        cache_salt: str | bytes | None = None,
        call_id: Hashable | None = None,
    ) -> ExtendAllocation:
        """Async twin of :meth:`allocate_extend`."""
        rid, tokens = self._extend_args(rid, token_ids, cache_salt)
        return await self._arun(self._extend(rid, tokens, cache_salt, call_id))

    def _extend(self, rid, tokens: np.ndarray, cache_salt, call_id) -> _Call:
        call = functools.partial(
            self._call, "allocate_extend", rid, what="allocate_extend", fenced=True
        )
        call_id = self._call_id(call_id)
        yield from self._greet_if_restarted()  # first: the restarted one's key digests
        payload = self._payload(call_id, rid, tokens)
        try:
            out = yield from call(payload, cache_salt, call_id=call_id)
        except StaleDigestError:  # another client of the namespace extended it meanwhile
            ids_id = self._sends_ids(("tokens", call_id), [rid])
            out = yield from call(tokens, cache_salt, call_id=ids_id)
        self._rids.add(rid)
        self._held[rid] = out.prefix_len + out.extend_len
        return out

    def _payload(
        self, call_id: Hashable, rid: Hashable, tokens: np.ndarray
    ) -> np.ndarray | TokenDigest:
        """What an allocation sends of ``tokens``: their digest (8 bytes a page) when this
        client knows where they start in the request's partial page, else the ids. A retry
        by call id digests at the offset its first send used (``_held`` may have moved)."""
        if self._hasher is None:
            return tokens
        with self._offsets_lock:
            offset = self._offsets.get((call_id, rid))
            if offset is None:
                held = self._held.get(rid)
                # Live, but stepped since (its length unknown here): the ids themselves.
                unknown = held is None and rid in self._rids
                offset = -1 if unknown else (held or 0) % self.config.page_size
                self._remember_offset((call_id, rid), offset)
        return tokens if offset < 0 else self._hasher.digest(tokens, offset)

    def _sends_ids(self, call_id: Hashable, rids: list) -> Hashable:
        """``call_id``, noted as sending the ids of ``rids`` themselves (a digest went stale):
        a retry by that id, which a timeout hands back, sends them again, not a digest."""
        with self._offsets_lock:
            for rid in rids:
                self._remember_offset((call_id, rid), -1)
        return call_id

    def _remember_offset(self, key: tuple, offset: int) -> None:
        """Lock held: the offset ``(call id, rid)`` was sent at; the oldest are forgotten."""
        self._offsets[key] = offset
        while len(self._offsets) > _REMEMBERED_OFFSETS:
            self._offsets.popitem(last=False)

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
        rid, tokens = self._extend_args(rid, token_ids, cache_salt)
        return _with_backoff(
            # checked once above, not on every retry
            lambda: self._run(self._extend(rid, tokens, cache_salt, None)),
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
        checked = self._batch_args(items, cache_salt, "allocate_extend_batch")
        call = functools.partial(
            self._call, "allocate_extend_batch", what="allocate_extend_batch", fenced=True
        )
        call_id = self._call_id(call_id)
        self._run(self._greet_if_restarted())  # first: the restarted one's key digests
        payload = [(rid, self._payload(call_id, rid, tokens)) for rid, tokens in checked]
        try:
            out = self._run(call(payload, cache_salt, call_id=call_id))
        except StaleDigestError:  # another client of the namespace extended one meanwhile
            ids_id = self._sends_ids(("tokens", call_id), [rid for rid, _ in checked])
            out = self._run(call(checked, cache_salt, call_id=ids_id))
        self._rids.update(rid for rid, _ in checked)
        for alloc, (rid, _) in zip(out, checked, strict=True):
            self._held[rid] = alloc.prefix_len + alloc.extend_len
        return out

    def allocate_decode(
        self, rids: Sequence[Hashable], token_ids=None, *, call_id: Hashable | None = None
    ) -> np.ndarray:
        """One more token for each request; ``int64 [len(rids)]`` slots."""
        rids, toks = self._decode_args(rids, token_ids)
        return self._run(self._decode_call(rids, toks, call_id))

    async def allocate_decode_async(
        self, rids: Sequence[Hashable], token_ids=None, *, call_id: Hashable | None = None
    ) -> np.ndarray:
        """Async twin of :meth:`allocate_decode`."""
        rids, toks = self._decode_args(rids, token_ids)
        return await self._arun(self._decode_call(rids, toks, call_id))

    def _decode_call(self, rids: list, toks: np.ndarray | None, call_id) -> _Call:
        out = yield from self._call(
            "allocate_decode", rids, toks, what="allocate_decode", call_id=call_id, fenced=True
        )
        for rid in rids:
            if rid in self._held:
                self._held[rid] += 1
        return out

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
        rid = self._free_args(rid, cache, committed_len)
        return self._run(self._free(rid, cache, committed_len, call_id))

    async def free_async(
        self,
        rid: Hashable,
        cache: bool = True,
        committed_len: int | None = None,
        *,
        call_id: Hashable | None = None,
    ) -> int:
        """Async twin of :meth:`free`."""
        rid = self._free_args(rid, cache, committed_len)
        return await self._arun(self._free(rid, cache, committed_len, call_id))

    def _free(self, rid, cache, committed_len, call_id) -> _Call:
        try:
            out = yield from self._call(
                "free", rid, bool(cache), committed_len, what="free", call_id=call_id
            )
        except UnknownRequestError:  # the pool holds none (a free that timed out took effect)
            self._forget([rid])
            raise
        self._forget([rid])
        return out

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
        greedy = _check_greedy(greedy, probe)
        rid, tokens = self._extend_args(rid, token_ids, cache_salt, step=probe is None)
        mode = self._step_args(mode, probe, _num_tokens(tokens))
        call_id = self._call_id(call_id)
        try:
            out, call_id = self._step(
                "prefill", rid, tokens, cache_salt, mode, probe, greedy,
                call_id=call_id, deadline_s=deadline_s,
            )  # fmt: skip
        except StepFailedError:  # the request lives on, failed, until freed
            self._rids.add(rid)
            raise
        self._rids.add(rid)
        self._held.pop(rid, None)  # stepped: the next allocation sends token ids
        return self._step_results(out, "prefill", [rid], call_id)[0]

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
        greedy = _check_greedy(greedy, probe)
        checked = self._batch_args(items, cache_salt, "prefill_batch", step=probe is None)
        mode = self._step_args(mode, probe, sum(_num_tokens(t) for _, t in checked))
        call_id = self._call_id(call_id)
        try:
            out, call_id = self._step(
                "prefill_batch", checked, cache_salt, mode, probe, greedy, call_id=call_id
            )
        except StepFailedError as e:  # the requests it names live on, failed, until freed
            rids = [rid for rid, _ in checked]
            # NOTE: a step that failed names every rid (as a tuple, or its one rid); a batch
            # refused before it allocated anything names the one already failed rid in it.
            self._rids.update(rids if e.rid == tuple(rids) else [r for r in rids if r == e.rid])
            raise
        self._rids.update(rid for rid, _ in checked)
        for rid, _ in checked:
            self._held.pop(rid, None)
        return self._step_results(out, "prefill_batch", [rid for rid, _ in checked], call_id)

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
        rids, toks = self._decode_args(rids, token_ids, step=probe is None)
        if toks is None:
            raise InvalidRequestError("decode needs the token id of every request")
        mode = self._step_args(mode, probe, len(rids))
        call_id = self._call_id(call_id)
        out, call_id = self._step(
            "decode", rids, toks, mode, probe, sample, call_id=call_id, deadline_s=deadline_s
        )
        for rid in rids:
            self._held.pop(rid, None)  # stepped: the next allocation sends token ids
        results = self._wait_step(out["lanes"], "decode", rids, call_id)
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
        stop = _stop_tokens(eos_token_id)
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

    def _step(
        self, method: str, *args, call_id: Hashable, deadline_s: float | None = None
    ) -> tuple[dict, Hashable]:
        """Send a step to the coordinator (capacity waits retried with backoff until
        ``deadline_s``).

        Returns:
            Its answer (the allocations and the lanes' result handles) and the call id that
            got it: a capacity wait took no effect, so each retry is a new call (the
            coordinator answers a repeated call id with its first answer, the wait).
        """
        ids: list[Hashable | None] = [call_id]

        def once():
            if ids[-1] is None:  # numbered when sent, not before the backoff's sleep
                ids[-1] = self._call_id()
            try:
                return self._run(self._step_call(method, *args, call_id=ids[-1]))
            except KVCapacityWaitError:
                ids.append(None)
                raise

        out = once() if deadline_s is None else _with_backoff(once, deadline_s=deadline_s)
        return out, ids[-1]

    def _step_call(self, method: str, *args, call_id: Hashable) -> _Call:
        """A step through the client's step graph when it takes it, else (or for the retries
        after its timeout) as an ordinary call with the same call id."""
        retries = self.call_retries
        yield from self._greet_if_restarted()
        if self._graph is not None:
            call = (method, self._epoch, self.client_id, call_id, *args)
            try:
                out = self._graph.run(call, self.timeout_s)
            except GraphUnavailable:
                pass
            except TimeoutError:
                e = RequestTimeoutError(f"{method}: no answer within {self.timeout_s}s")
                if retries == 0:
                    raise _retryable(e, call_id) from None
                logger.info("%s timed out; sending it again as call %r", method, call_id)
                retries -= 1
            else:  # NOTE: outside the try: an answer may be a RequestTimeoutError (a TimeoutError)
                return self._unwrap(out)
        return (yield from self._call(method, *args, what=method, call_id=call_id, retries=retries))

    def _step_results(
        self, out: dict, what: str, rids: list, call_id: Hashable = None
    ) -> list[PrefillResult]:
        results = self._wait_step(out["lanes"], what, rids, call_id)
        return prefill_results(out["allocations"], results)

    def _wait_step(
        self, handles: list, what: str, rids: list, call_id: Hashable = None
    ) -> list[StepResult]:
        """Every lane's step result, in lane order. A dead lane is reported at once; a lane
        whose step failed made the others fail it too (it left the lane group), but for a
        solo step (every page on that lane), which the others skipped.

        Raises:
            LaneUnavailableError: a lane died (its requests are lost).
            StepFailedError: the step failed on a lane (its requests are failed).
            RequestTimeoutError: lanes silent past ``timeout_s`` (``call_id`` waits again).
        """
        if all(isinstance(h, LaneReply) for h in handles):  # compiled: answered already
            return self._step_outcome(dict(enumerate(handles)), [], what, rids)
        ray = self._ray
        index = {ref: r for r, ref in enumerate(handles)}
        remaining, results, errors = list(handles), {}, []
        end = time.monotonic() + self.timeout_s
        while remaining:
            ready, remaining = ray.wait(
                remaining, num_returns=1, timeout=max(0.0, end - time.monotonic())
            )
            if not ready:
                lanes = sorted(index[ref] for ref in remaining)
                raise RequestTimeoutError(
                    f"{what}: lanes {lanes} silent for {self.timeout_s}s; call_id={call_id!r} "
                    "(pass it as call_id= to wait for this step again)",
                    call_id,
                )
            for ref in ready:
                r = index[ref]
                try:
                    results[r] = ray.get(ref)
                except actor_death(ray):
                    raise self._lane_lost(r, what, f"{what}: lane died") from None
                except ray.exceptions.RayTaskError as e:
                    errors.append((r, e.as_instanceof_cause()))
        return self._step_outcome(results, errors, what, rids)

    def _step_outcome(
        self, results: dict, errors: list[tuple[int, BaseException]], what: str, rids: list
    ) -> list[StepResult]:
        """The lanes' results in lane order, or the step's error (``results`` may hold
        :class:`LaneReply` values: a compiled step's answers, errors included)."""
        for r in sorted(results):
            reply = results[r]
            if not isinstance(reply, LaneReply):
                continue
            if isinstance(reply.error, LaneDeadError):
                raise self._lane_lost(r, what, f"{what}: lane died ({reply.error})") from None
            if reply.error is not None:
                errors.append((r, reply.error))
            results[r] = reply.value
        if errors:
            lane, cause = min(errors, key=_aborted_last)  # the first to fail; the rest with it
            detail = f"lane {lane}: {type(cause).__name__}: {str(cause)[:300]}"
            raise StepFailedError(rids[0] if len(rids) == 1 else tuple(rids), detail) from cause
        return [results[r] for r in range(len(results))]

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
        out = await self._arun(self._answer(self._open_coord().stats.remote(), "stats"))
        if lanes:
            out["lanes"] = await asyncio.to_thread(self.lane_info)
        return out

    def check(self) -> dict:
        """Core invariants and each lane's count against the mirror: ``{"ok", "problems"}``."""
        return self._get(self._open_coord().check.remote(), "check")

    def reset(self) -> None:
        """Drop every request and cached page of the pool (all clients'); lanes emptied."""
        self._get(self._open_coord().reset.remote(), "reset")
        self._rids.clear()
        self._held.clear()

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
        return set(self._rids)

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
        self._rids.clear()
        self._held.clear()
        self._pool.release_ray()  # the last of this process's pools stops the local Ray

    def stop_pool(self) -> None:
        """Stop the coordinator and its lanes for every client (whoever created them)."""
        self._pool.stop()

    def __enter__(self) -> CPKVClient:
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()


def _with_backoff(
    fn: Callable[[], _T],
    *,
    deadline_s: float,
    initial_backoff_s: float = 0.005,
    max_backoff_s: float = 0.5,
    rng: random.Random | None = None,
) -> _T:
    """``fn()``, called again on KVCapacityWaitError with jittered exponential backoff until
    ``deadline_s`` has passed (then the last one is raised)."""
    deadline_s = check_float("deadline_s", deadline_s)
    # NOTE: > 0: a 0 backoff retried against the coordinator in a hot loop.
    initial_backoff_s = check_float("initial_backoff_s", initial_backoff_s, minimum=_MIN_BACKOFF_S)
    max_backoff_s = check_float("max_backoff_s", max_backoff_s, minimum=initial_backoff_s)
    if rng is not None and not isinstance(rng, random.Random):
        raise InvalidRequestError(f"rng={rng!r} must be a random.Random or None")
    rng = rng or random.Random()
    end = time.monotonic() + deadline_s
    backoff = initial_backoff_s
    while True:
        try:
            return fn()
        except KVCapacityWaitError:
            left = end - time.monotonic()
            if left <= 0:
                raise
            # Jitter keeps many waiting callers from retrying in lockstep; never past the cap.
            time.sleep(min(left, max_backoff_s, backoff * (0.5 + rng.random())))
            backoff = min(max_backoff_s, backoff * 2)


def _stop_tokens(eos_token_id: object) -> frozenset[int]:
    """``generate``'s stop tokens: none, one id or a collection of ids."""
    if eos_token_id is None:
        return frozenset()
    if isinstance(eos_token_id, np.ndarray):
        eos_token_id = eos_token_id.reshape(-1).tolist()
    ids = (
        eos_token_id if isinstance(eos_token_id, (list, tuple, set, frozenset)) else [eos_token_id]
    )
    return frozenset(check_int("eos_token_id", t, minimum=0) for t in ids)


def _aborted_last(error: tuple[int, BaseException]) -> tuple[bool, int]:
    """Sort key of a step's lane errors: a lane's own failure before the lanes it aborted."""
    return isinstance(error[1], StepAborted), error[0]


def _retryable(e: RequestTimeoutError, call_id: Hashable) -> RequestTimeoutError:
    """The timeout of a call that may have taken effect, with the id that retries it safely."""
    return RequestTimeoutError(
        f"{e}; call_id={call_id!r} (pass it as call_id= to retry safely)", call_id
    )


def _later_fence(old: list, new: list) -> list:
    """Per lane the later of two ``(generation, seq)`` marks (generations are
    ``"{epoch}:{n}"``, n growing; a new epoch wins)."""
    out = []
    for a, b in zip(old, new, strict=True):
        (ga, sa), (gb, sb) = a, b
        if ga == gb:
            out.append((ga, max(sa, sb)))
            continue
        out.append(a if ga is not None and superseded(gb or "", ga) else b)
    return out


def _hasher(config: CPConfig, hello: dict) -> PageHasher | None:
    """The coordinator's page hasher, rebuilt from the key it gives its clients."""
    key = hello.get("page_hash_key")
    return None if key is None else PageHasher(config.page_size, key)


def _weakly(method: Callable[..., _T]) -> Callable[..., _T]:
    """A bound method called through a weak reference to its object: a part the client owns
    holds no reference back to it, so a dropped client is freed at once (and its lease stops
    being renewed: see :class:`_LeaseKeeper`)."""
    ref = weakref.WeakMethod(method)
    return lambda *args: ref()(*args)


def _drop_pool(pool: Pool) -> None:
    """What a dropped client leaves: the pool it created stopped (unless detached), its
    share of the local Ray given back."""
    try:
        if pool.created and not pool.detached:
            pool.stop()
        pool.release_ray()
    except Exception:  # a finalizer never raises
        logger.debug("dropping a client's pool failed", exc_info=True)


def _check_timeout(timeout_s: object) -> float:
    value = check_float("timeout_s", timeout_s)
    if value <= 0:  # every call would time out at once
        raise InvalidRequestError(f"timeout_s={timeout_s!r} must be > 0")
    return value


def _check_lease(lease_s: object) -> float | None:
    if lease_s is not None and not check_float("lease_s", lease_s) > 0:
        raise InvalidRequestError(f"lease_s={lease_s!r} must be > 0 or None")
    return lease_s


def _num_tokens(tokens) -> int:
    """Tokens of a step's checked ids (an array, or a digest of them)."""
    return int(tokens.num_tokens) if isinstance(tokens, TokenDigest) else len(tokens)


def _check_probe(probe, num_tokens: int, kv: KVShape) -> None:
    """Raise unless ``probe`` is ``(q, k, v)``: floating tensors ``[num_tokens, Hq, D]`` and
    ``[num_tokens, num_heads, D]`` (``Hq`` a multiple of the pool's ``num_heads``)."""
    import torch

    if (
        not isinstance(probe, (tuple, list))
        or len(probe) != 3
        or not all(isinstance(t, torch.Tensor) and t.is_floating_point() for t in probe)
    ):
        raise InvalidRequestError(f"probe must be (q, k, v) floating torch tensors: {probe!r:.80}")
    q, k, v = probe
    want = (num_tokens, kv.num_heads, kv.head_dim)
    for name, t in (("k", k), ("v", v)):
        if tuple(t.shape) != want:
            raise InvalidRequestError(f"probe {name} has shape {tuple(t.shape)}, expected {want}")
    if (
        q.ndim != 3
        or (q.shape[0], q.shape[2]) != (num_tokens, kv.head_dim)
        or (q.shape[1] % kv.num_heads)
    ):
        raise InvalidRequestError(
            f"probe q has shape {tuple(q.shape)}, expected [{num_tokens}, a multiple of "
            f"{kv.num_heads}, {kv.head_dim}]"
        )


def _check_greedy(greedy: object, probe: object) -> bool:
    """``greedy`` as a bool (a numpy bool too), checked against ``probe``."""
    if not isinstance(greedy, (bool, np.bool_)):
        raise InvalidRequestError(f"greedy={greedy!r} must be True or False")
    if greedy and probe is not None:
        raise InvalidRequestError("greedy=True needs the pool's model, not a probe")
    return bool(greedy)
