"""``connect()``: start or attach to Ray and a named pool, and check that a pool attached to
is the one asked for."""

from __future__ import annotations

import dataclasses
from dataclasses import replace

from cpkv.actors.pool import LaneOptions, Pool
from cpkv.client._args import check_lease, check_timeout
from cpkv.client._client import CPKVClient
from cpkv.core.config import CPConfig, KVShape
from cpkv.core.steps import check_mode
from cpkv.core.validate import check_float, check_int
from cpkv.errors import InvalidRequestError

__all__ = ["DEFAULT_NAME", "connect"]

DEFAULT_NAME = "cpkv-coordinator"

# A new pool's K/V fields when connect() names none (an attaching client takes the pool's).
_KV_FIELDS = tuple(f.name for f in dataclasses.fields(KVShape))
_DEFAULT_KV = dataclasses.astuple(KVShape())


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
    check_lease(lease_s)
    if namespace is not None and not isinstance(namespace, str):
        raise InvalidRequestError(f"namespace={namespace!r} must be a str or None")
    timeout_s = check_timeout(timeout_s)
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
