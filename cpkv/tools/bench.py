"""``cpkv bench``: allocation latency, throughput and lane balance against cp_size; with
``--prefill``, prefill time on the lanes against cp_size, zigzag against a contiguous split.

Allocation (:func:`run_bench`): for every (lanes, context) point a fresh coordinator and lanes
are placed, then ``requests`` distinct prompts of ``context`` tokens are allocated and freed by
``concurrency`` threads over a pool that holds about ``concurrency`` of them, so the prefix
cache fills and eviction (and sometimes capacity waits) happen.

Prefill (:func:`run_prefill_bench`): for every (lanes, context, split) point a fresh pool runs a
model's prefill (random weights from a seed, or a checkpoint); after one warm-up prefill,
``requests`` fresh prompts of ``context`` tokens are prefilled one at a time and timed, with each
lane's compute time. The split is the owner plan's: ``zigzag`` (lane ``r`` owns segments ``r``
and ``2 cp - 1 - r`` of ``2 cp``, balancing causal attention) or ``contiguous`` (lane ``r`` owns
segments ``2r`` and ``2r + 1``, the same pages cut in one range a lane): the ablation that
shows why the plan zigzags. cp 1 has no split.

Per point it also reports what CP buys: the overhead against cp 1 at the same context on the same
devices, each lane's own work (step less time in the lanes' collectives) and the critical path
(the largest), the bytes a step exchanges (from the plan, as the attention counts them) and the
lanes' time in the exchange; and a **projection**, never a measurement, of one GPU per lane:
the critical path plus the busiest lane's exchange bytes at ``link_gb_per_s``, against cp 1.
Lanes packed on one GPU time-slice it, so their own work includes the others' slices; a second
projection takes each lane's work alone from cp 1's measured split (attention by the plan's
causal work, the rest by tokens).
"""

from __future__ import annotations

import csv
import json
import os
import platform
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field

import numpy as np

from cpkv.core.layout import PageLayout
from cpkv.errors import KVCapacityWaitError
from cpkv.models.presets import MODEL_PRESETS, preset_config

__all__ = [
    "PREFILL_FIELDS",
    "BenchConfig",
    "PrefillBenchConfig",
    "run_bench",
    "run_prefill_bench",
]

FIELDS = [
    "lanes",
    "context",
    "requests",
    "page_size",
    "p50_ms",
    "p99_ms",
    "allocs_per_s",
    "pages_per_s",
    "balance_max_over_min",
    "pages_evicted",
    "capacity_waits",
    "actor_calls_per_alloc",
    "fallbacks",
    "nodes",
]


@dataclass(slots=True)
class BenchConfig:
    lanes: list[int] = field(default_factory=lambda: [1, 2, 4, 8])
    contexts: list[int] = field(default_factory=lambda: [32 << 10, 128 << 10])
    requests: int = 8
    page_size: int = 64
    concurrency: int = 2
    address: str | None = None
    strategy: str = "STRICT_PACK"
    num_gpus_per_lane: float | None = None
    out_dir: str = "results"
    progress: bool = True
    plot: bool = True
    seed: int = 0


def _point(cfg: BenchConfig, cp: int, context: int) -> dict:
    import cpkv

    layout = PageLayout(cp, cfg.page_size)
    # Room for `concurrency` requests plus slack: more than that must evict or wait.
    per_lane = layout.pages_per_lane_for(layout.pages_for(context) * cfg.concurrency) + 2 * cp + 2
    client = cpkv.connect(
        cfg.address,
        cp_size=cp,
        page_size=cfg.page_size,
        num_pages_per_lane=per_lane,
        max_reqs=max(8, 2 * cfg.concurrency),
        max_context_len=context,
        num_gpus_per_lane=cfg.num_gpus_per_lane,
        strategy=cfg.strategy,
        name=f"cpkv-bench-{cp}-{context}-{time.time_ns()}",
        num_heads=1,
        head_dim=8,
        dtype="float32",
    )
    try:
        lane_nodes = [i["node_id"] for i in client.lane_info()]
        nodes = sorted(set(lane_nodes))
        rng = np.random.default_rng(cfg.seed)
        prompts = [
            rng.integers(0, 150_000, size=context, dtype=np.int64) for _ in range(cfg.requests)
        ]
        client.ping_lanes()
        latencies: list[float] = []
        per_lane_pages = np.zeros(cp, dtype=np.int64)
        lock = threading.Lock()
        todo = list(range(cfg.requests))

        def worker() -> None:
            while True:
                with lock:
                    if not todo:
                        return
                    i = todo.pop()
                # A request's latency runs from its first attempt: the capacity waits
                # and backoff the bench provokes are part of it.
                t0 = time.perf_counter()
                while True:
                    try:
                        alloc = client.allocate_extend(f"b{i}", prompts[i])
                    except KVCapacityWaitError:
                        time.sleep(0.002)
                        continue
                    dt = time.perf_counter() - t0
                    break
                counts = layout.count_by_lane(alloc.new_pages)
                client.free(f"b{i}", cache=True)
                with lock:
                    latencies.append(dt)
                    per_lane_pages[:] += counts

        t0 = time.perf_counter()
        with ThreadPoolExecutor(cfg.concurrency) as workers:
            running = [workers.submit(worker) for _ in range(cfg.concurrency)]
            for future in running:
                future.result()  # a worker's error fails the point (it was lost)
        elapsed = time.perf_counter() - t0
        # NOTE: check() first: it flushes the page moves still waiting, which stats() counts.
        report = client.check()
        assert report["ok"], report["problems"]
        stats = client.stats()
    finally:
        client.shutdown()
    lat = np.array(latencies) * 1e3
    allocs = stats["extend_allocations"]
    return {
        "lanes": cp,
        "context": context,
        "requests": cfg.requests,
        "page_size": cfg.page_size,
        "p50_ms": float(np.percentile(lat, 50)),
        "p99_ms": float(np.percentile(lat, 99)),
        "allocs_per_s": cfg.requests / elapsed,
        "pages_per_s": stats["pages_allocated"] / elapsed,
        "balance_max_over_min": float(per_lane_pages.max() / max(1, per_lane_pages.min())),
        "pages_evicted": stats["pages_evicted"],
        "capacity_waits": stats["capacity_waits"],
        # The caller's one call, plus every lane call the coordinator sent with page moves
        # (for allocations and frees alike: the moves of several travel in one call).
        "actor_calls_per_alloc": 1 + stats["lane_calls"] / max(1, allocs),
        "fallbacks": json.dumps(stats["fallbacks_by_reason"]),
        "nodes": len(nodes),
        "lane_nodes": lane_nodes,
    }


def run_bench(cfg: BenchConfig) -> list[dict]:
    """Run every point; write ``bench.json``, ``bench.csv`` and ``bench.png`` to ``out_dir``."""
    points = [(cp, ctx) for cp in cfg.lanes for ctx in cfg.contexts]
    rows = _run_points(
        points,
        lambda cp, ctx: _point(cfg, cp, ctx),
        address=cfg.address,
        num_lanes=max(cfg.lanes),
        progress=cfg.progress,
        desc="bench",
    )
    meta = {"config": asdict(cfg), **_machine()}
    _write(cfg.out_dir, "bench", meta, rows, FIELDS, _plot if cfg.plot else None)
    _print(rows)
    return rows


def _run_points(
    points: list[tuple],
    run_point: Callable[..., dict],
    *,
    address: str | None,
    num_lanes: int,
    progress: bool,
    desc: str,
) -> list[dict]:
    """Run each point (a fresh pool each) under a progress bar, Ray started quietly when this
    process has none (and stopped after); the rows, in order."""
    from tqdm import tqdm
    from tqdm.contrib.logging import logging_redirect_tqdm

    from cpkv.actors.ray_env import tool_ray

    rows = []
    with tool_ray(address, num_lanes=num_lanes):
        bar = tqdm(points, desc=desc, unit="point", disable=not progress)
        with logging_redirect_tqdm():
            for point in bar:
                bar.set_postfix_str(", ".join(map(str, point)))
                rows.append(run_point(*point))
    return rows


def _machine() -> dict:
    return {
        "python": platform.python_version(),
        "machine": platform.machine(),
        "cpus": os.cpu_count(),
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
    }


def _write(out_dir: str, base: str, meta: dict, rows: list[dict], fields: list[str], plot) -> None:
    """``{base}.json`` (meta and rows), ``{base}.csv`` (``fields``; lists as JSON) and, with
    ``plot``, ``{base}.png`` in ``out_dir``."""
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, base)
    with open(path + ".json", "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=2)
    with open(path + ".csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=fields, extrasaction="ignore")
        w.writeheader()
        for row in rows:
            w.writerow({k: json.dumps(v) if isinstance(v, list) else v for k, v in row.items()})
    if plot is not None:
        plot(rows, path + ".png")


def _print(rows: list[dict]) -> None:
    print(
        f"{'lanes':>5} {'context':>8} {'p50 ms':>8} {'p99 ms':>8} {'alloc/s':>8} "
        f"{'pages/s':>10} {'balance':>7} {'evicted':>8} {'waits':>6} {'calls':>6}"
    )
    for r in rows:
        print(
            f"{r['lanes']:>5} {r['context']:>8} {r['p50_ms']:>8.2f} {r['p99_ms']:>8.2f} "
            f"{r['allocs_per_s']:>8.1f} {r['pages_per_s']:>10.0f} "
            f"{r['balance_max_over_min']:>7.3f} {r['pages_evicted']:>8} "
            f"{r['capacity_waits']:>6} {r['actor_calls_per_alloc']:>6.2f}"
        )


def _plot(rows: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    for ctx in sorted({r["context"] for r in rows}):
        pts = sorted(
            (r["lanes"], r["pages_per_s"], r["balance_max_over_min"])
            for r in rows
            if r["context"] == ctx
        )
        xs = [p[0] for p in pts]
        label = f"{ctx // 1024}k tokens"
        ax1.plot(xs, [p[1] for p in pts], marker="o", label=label)
        ax2.plot(xs, [p[2] for p in pts], marker="o", label=label)
    ax1.set(xlabel="cp_size (lanes)", ylabel="pages allocated / s", title="throughput")
    ax2.set(xlabel="cp_size (lanes)", ylabel="max/min pages per lane", title="lane balance")
    for ax in (ax1, ax2):
        ax.set_xscale("log", base=2)
        ax.grid(True, alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# --------------------------------------------------------------------------- prefill

PREFILL_FIELDS = [
    "lanes",
    "context",
    "split",
    "requests",
    "page_size",
    "prefill_ms_p50",
    "prefill_ms_min",
    "tokens_per_s",
    "lane_ms",
    "imbalance",
    "lane_busy_ms",
    "busy_imbalance",
    "work_share",
    "work_imbalance",
    "lane_cpu_ms",
    "cpu_imbalance",
    "mode",
    "fallback",
    "overhead_vs_cp1",
    "critical_path_ms",
    "exchange_bytes",
    "exchange_bytes_max_lane",
    "exchange_ms",
    "link_gb_per_s",
    "projected_ms",
    "projected_speedup",
    "critical_path_est_ms",
    "projected_est_ms",
    "projected_est_speedup",
    "device",
    "model",
    "dtype",
]

#: NVLink-class link for the one-GPU-per-lane projection: H100/H200 NVLink 4 moves 450 GB/s
#: each way (900 GB/s both); GB/s are bytes.
DEFAULT_LINK_GB_PER_S = 450.0


@dataclass(slots=True)
class PrefillBenchConfig:
    """What ``cpkv bench --prefill`` measures.

    Attributes:
        lanes: cp sizes.
        contexts: prompt lengths in tokens (``None``: 2k and 4k, CPU-sized; pass 32k on GPUs).
        requests: timed prefills per point (after one warm-up).
        page_size: tokens per page.
        model: a checkpoint directory, or a preset of random weights (``small``: the demo's
            model; ``tiny``: :meth:`ModelConfig.tiny`; ``llama-3.2-1b``: that shape).
        dtype: run the model in this dtype (``None``: the checkpoint's; fp32 for ``small`` and
            ``tiny``, bf16 for ``llama-3.2-1b``).
        splits: owner splits compared at cp >= 2.
        attention_mode: the lanes' exchange (``auto``, ``pass_q``, ``pass_kv``).
        address: ``None``: a local Ray (started quietly when this process has none).
        strategy, num_gpus_per_lane: lane placement (see :func:`cpkv.connect`).
        timeout_s: per-call timeout (long prompts on CPU take a while).
        out_dir: where ``bench_prefill.{json,csv,png}`` go.
        progress, plot: a progress bar; the PNG.
        seed: weights' seed (presets) and prompts' seed.
        link_gb_per_s: the link of the one-GPU-per-lane projection (GB/s, bytes, one way).
    """

    lanes: list[int] = field(default_factory=lambda: [1, 2, 4])
    contexts: list[int] | None = None
    requests: int = 3
    page_size: int = 64
    model: str = "small"
    dtype: str | None = None
    splits: tuple[str, ...] = ("zigzag", "contiguous")
    attention_mode: str = "auto"
    address: str | None = None
    strategy: str = "STRICT_PACK"
    num_gpus_per_lane: float | None = None
    timeout_s: float = 600.0
    out_dir: str = "results"
    progress: bool = True
    plot: bool = True
    seed: int = 0
    link_gb_per_s: float = DEFAULT_LINK_GB_PER_S


def _model_spec(cfg: PrefillBenchConfig):
    """The :class:`cpkv.models.spec.ModelSpec` every point's lanes load."""
    from cpkv.models.spec import ModelSpec

    if cfg.model in MODEL_PRESETS:
        config = preset_config(cfg.model)
        longest = max(cfg.contexts or [0])
        config = config.replace(
            max_position_embeddings=max(config.max_position_embeddings, longest)
        )
        if cfg.dtype is not None:
            config = config.replace(dtype=cfg.dtype)
        return ModelSpec(config, seed=cfg.seed)
    spec = ModelSpec.from_source(os.path.abspath(cfg.model))
    if cfg.dtype is not None and cfg.dtype != spec.config.dtype:
        spec = ModelSpec(spec.config.replace(dtype=cfg.dtype), path=spec.path)
    return spec


def _lane_cpu_seconds(pids: list[int] | None) -> list[float] | None:
    """CPU seconds each lane process has used so far (``None`` when not readable here)."""
    if pids is None:
        return None
    tick = os.sysconf("SC_CLK_TCK")
    out = []
    try:
        for pid in pids:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            out.append((int(fields[11]) + int(fields[12])) / tick)  # utime + stime
    except (OSError, IndexError, ValueError):
        return None
    return out


def causal_work_by_lane(alloc, cp_size: int) -> np.ndarray:
    """Causal attention work each lane's queries have in one prefill step: for every new token
    its compute owner (the lane of its page) attends ``position + 1`` keys.

    What a causal kernel that skips masked tiles spends per lane: the planned balance.
    """
    positions = alloc.prefix_len + np.arange(alloc.extend_len, dtype=np.int64)
    lanes, _ = PageLayout(cp_size, alloc.page_size).local_slots(alloc.out_cache_loc)
    return np.bincount(lanes, weights=positions + 1, minlength=cp_size)


def step_exchange_bytes(alloc, cp_size: int, config, mode: str) -> list[int]:
    """Bytes each lane receives from the others in one fresh prefill step of ``mode``, all
    layers: :func:`cpkv.lanes.attention.lane_exchange_bytes` of every lane's plan.

    Args:
        alloc: the step's :class:`cpkv.core.allocator.ExtendAllocation` (no cached prefix).
        cp_size: lanes.
        config: the model's :class:`cpkv.models.ModelConfig`.
        mode: the mode the step ran.

    Returns:
        One count per lane.

    Raises:
        ValueError: the step had a cached prefix (its pages are not in the allocation).
    """
    from cpkv.core.steps import StepSequence
    from cpkv.lanes.attention import lane_exchange_bytes
    from cpkv.lanes.step import StepPlan

    if alloc.prefix_len:
        raise ValueError("step_exchange_bytes needs a step without a cached prefix")
    ps = alloc.page_size
    pages = (np.asarray(alloc.out_cache_loc)[::ps] // ps).astype(np.int32)
    elt = {"float32": 4, "bfloat16": 2, "float16": 2}[config.dtype]
    req = [StepSequence(0, alloc.extend_len, pages)]
    return [
        config.num_layers
        * lane_exchange_bytes(
            StepPlan.build(req, cp_size, ps, lane),
            mode,
            config.num_heads,
            config.num_kv_heads,
            config.head_dim,
            elt,
            elt,
        )
        for lane in range(cp_size)
    ]


def _tokens_by_lane(alloc, cp_size: int) -> np.ndarray:
    lanes, _ = PageLayout(cp_size, alloc.page_size).local_slots(np.asarray(alloc.out_cache_loc))
    return np.bincount(lanes, minlength=cp_size).astype(np.float64)


def add_projection(rows: list[dict], link_gb_per_s: float) -> None:
    """Fill each row's overhead against cp 1 and its one-GPU-per-lane projections, in place.

    A row needs the cp 1 row of its context (same run, same devices); without one the fields
    stay ``None``. Projected time: critical path + the busiest lane's exchange bytes at
    ``link_gb_per_s`` (the exchange not overlapped with compute) + cp 1's time outside its lane
    (client and Ray round trip). ``*_est_*``: the critical
    path from cp 1's own split, each lane's share of its attention by causal work and of the
    rest by tokens.
    """
    link = link_gb_per_s * 1e9
    base = {r["context"]: r for r in rows if r["lanes"] == 1}
    for r in rows:  # first: every row's, cp 1's among them, whatever the order of --lanes
        r["critical_path_ms"] = max(r["lane_busy_ms"])
    for r in rows:
        one = base.get(r["context"])
        r["link_gb_per_s"] = link_gb_per_s
        for key in ("overhead_vs_cp1", "projected_ms", "projected_speedup"):
            r[key] = None
        for key in ("critical_path_est_ms", "projected_est_ms", "projected_est_speedup"):
            r[key] = None
        if one is None:
            continue
        cp1 = one["prefill_ms_p50"]
        # NOTE: what cp 1's wall time holds outside its lane (client, coordinator, Ray round
        # trip) is taken as the same at every cp, so cp 1 projects onto itself.
        fixed = cp1 - one["critical_path_ms"]
        exchange_ms = r["exchange_bytes_max_lane"] / link * 1e3 + fixed
        r["overhead_vs_cp1"] = r["prefill_ms_p50"] / cp1
        r["projected_ms"] = r["critical_path_ms"] + exchange_ms
        r["projected_speedup"] = cp1 / r["projected_ms"]
        attn1 = one["lane_attention_ms"][0]
        rest1 = one["lane_busy_ms"][0] - attn1
        work = np.asarray(r["work_share"], dtype=np.float64)
        tokens = np.asarray(r["lane_tokens"], dtype=np.float64)
        alone = attn1 * work / work.sum() + rest1 * tokens / tokens.sum()
        r["critical_path_est_ms"] = float(alone.max())
        r["projected_est_ms"] = r["critical_path_est_ms"] + exchange_ms
        r["projected_est_speedup"] = cp1 / r["projected_est_ms"]


def _max_over_mean(values) -> float:
    arr = np.asarray(values, dtype=np.float64)
    mean = float(arr.mean()) if arr.size else 0.0
    return float(arr.max() / mean) if mean > 0 else float("nan")


def _prefill_point(cfg: PrefillBenchConfig, spec, cp: int, context: int, split: str) -> dict:
    import ray

    import cpkv

    layout = PageLayout(cp, cfg.page_size)
    # One request at a time: its share of pages on every lane, the reserved page and slack.
    per_lane = layout.pages_per_lane_for(layout.pages_for(context)) + 3
    client = cpkv.connect(
        cfg.address,
        cp_size=cp,
        page_size=cfg.page_size,
        num_pages_per_lane=per_lane,
        max_reqs=8,
        max_context_len=context,
        num_gpus_per_lane=cfg.num_gpus_per_lane,
        strategy=cfg.strategy,
        name=f"cpkv-bench-prefill-{cp}-{context}-{split}-{time.time_ns()}",
        timeout_s=cfg.timeout_s,
        model=spec,
        attention_mode=cfg.attention_mode,
        owner_split="zigzag" if split == "none" else split,
    )
    try:
        info = client.lane_info()
        here = ray.get_runtime_context().get_node_id()
        local_cpu = all(i["device"] == "cpu" and i["node_id"] == here for i in info)
        pids = [int(i["pid"]) for i in info] if local_cpu else None
        # NOTE: the same prompts at every (cp, split) of a context: fresh random tokens, so no
        # prefix is ever cached; each request is freed without caching.
        rng = np.random.default_rng([cfg.seed, context])
        vocab = spec.config.vocab_size
        client.prefill("warm-up", rng.integers(0, vocab, size=context))
        client.free("warm-up", cache=False)
        walls, lane_s, wait_s, cpu_s, work, modes, fallbacks = [], [], [], [], [], [], set()
        attn_s, tokens, moved = [], [], []
        for i in range(cfg.requests):
            prompt = rng.integers(0, vocab, size=context)
            c0 = _lane_cpu_seconds(pids)
            t0 = time.perf_counter()
            res = client.prefill(f"p{i}", prompt)
            walls.append(time.perf_counter() - t0)
            c1 = _lane_cpu_seconds(pids)
            client.free(f"p{i}", cache=False)
            lane_s.append(res.lane_seconds)
            wait_s.append(res.lane_wait_seconds)
            if c0 is not None and c1 is not None:
                cpu_s.append([b - a for a, b in zip(c0, c1, strict=True)])
            work.append(causal_work_by_lane(res.allocation, cp))
            tokens.append(_tokens_by_lane(res.allocation, cp))
            attn_s.append(res.lane_attention_seconds)
            moved.append(step_exchange_bytes(res.allocation, cp, spec.config, res.mode))
            modes.append(res.mode)
            if res.allocation.fallback_reason is not None:
                fallbacks.add(res.allocation.fallback_reason)
        report = client.check()
        if not report["ok"]:
            raise RuntimeError(f"pool accounting broken after the point: {report['problems']}")
        device = info[0]["device"]
    finally:
        client.shutdown()
    wall = np.asarray(walls)
    lane_mean = np.mean(lane_s, axis=0)
    lane_ms = (lane_mean * 1e3).tolist()
    busy_ms = ((lane_mean - np.mean(wait_s, axis=0)) * 1e3).tolist()
    share = np.mean(work, axis=0)
    share = (share / share.mean()).tolist() if share.mean() > 0 else share.tolist()
    cpu_ms = (np.mean(cpu_s, axis=0) * 1e3).tolist() if cpu_s else []
    p50 = float(np.percentile(wall, 50))
    wait_ms = np.mean(wait_s, axis=0) * 1e3
    moved_mean = np.mean(moved, axis=0)
    return {
        "lanes": cp,
        "context": context,
        "split": split,
        "requests": cfg.requests,
        "page_size": cfg.page_size,
        "prefill_ms_p50": p50 * 1e3,
        "prefill_ms_min": float(wall.min()) * 1e3,
        "tokens_per_s": context / p50,
        "lane_ms": [round(x, 3) for x in lane_ms],
        "imbalance": _max_over_mean(lane_ms),
        "lane_busy_ms": [round(x, 3) for x in busy_ms],
        "busy_imbalance": _max_over_mean(busy_ms),
        "work_share": [round(x, 4) for x in share],
        "work_imbalance": _max_over_mean(share),
        "lane_cpu_ms": [round(x, 1) for x in cpu_ms],
        "cpu_imbalance": _max_over_mean(cpu_ms) if cpu_ms else None,
        "lane_attention_ms": [round(x * 1e3, 3) for x in np.mean(attn_s, axis=0)],
        "lane_wait_ms": [round(float(x), 3) for x in wait_ms],
        "lane_tokens": [float(x) for x in np.mean(tokens, axis=0)],
        "exchange_bytes": int(moved_mean.sum()),
        "exchange_bytes_max_lane": int(moved_mean.max()),
        "exchange_ms": max(round(float(x), 3) for x in wait_ms),
        "mode": max(set(modes), key=modes.count),
        "fallback": ",".join(sorted(fallbacks)),
        "device": device,
        "model": cfg.model if cfg.model in MODEL_PRESETS else os.path.abspath(cfg.model),
        "dtype": spec.config.dtype,
    }


def prefill_points(cfg: PrefillBenchConfig) -> list[tuple[int, int, str]]:
    """``(lanes, context, split)`` of every point, in run order (cp 1 once, split ``none``)."""
    contexts = cfg.contexts or [2 << 10, 4 << 10]
    return [
        (cp, ctx, split)
        for ctx in contexts
        for cp in cfg.lanes
        for split in (("none",) if cp == 1 else cfg.splits)
    ]


def run_prefill_bench(cfg: PrefillBenchConfig) -> list[dict]:
    """Run every prefill point; write ``bench_prefill.json``, ``bench_prefill.csv`` and
    ``bench_prefill.png`` to ``out_dir``; the rows."""
    if cfg.contexts is None:
        cfg.contexts = [2 << 10, 4 << 10]
    spec = _model_spec(cfg)
    try:
        rows = _run_points(
            prefill_points(cfg),
            lambda cp, ctx, split: _prefill_point(cfg, spec, cp, ctx, split),
            address=cfg.address,
            num_lanes=max(cfg.lanes),
            progress=cfg.progress,
            desc="bench --prefill",
        )
    finally:
        spec.remove()
    add_projection(rows, cfg.link_gb_per_s)
    meta = {
        "config": asdict(cfg),
        "model_config": asdict(spec.config),
        **_machine(),
        "notes": (
            "lane_ms: each lane's step time (PrefillResult.lane_seconds), which includes "
            "waiting in the lanes' collectives; lane_busy_ms: that minus the time in the "
            "collectives (PrefillResult.lane_wait_seconds), the lane's own work (lanes packed "
            "on one GPU also wait for each other's kernels there); work_share: causal "
            "attention work per lane from the owner plan, relative to the mean; lane_cpu_ms: "
            "CPU time of each lane process during the prefill (CPU lanes on this node only); "
            "critical_path_ms: the largest own work; exchange_bytes: bytes the lanes receive "
            "from each other in one step (all layers, from the plan, as CPAttention counts "
            "them), exchange_ms: the largest time in collectives; projected_*: a PROJECTION, "
            "not a measurement, of one GPU per lane: critical path (measured; *_est_*: from "
            "cp 1's split by the plan) plus the busiest lane's bytes at link_gb_per_s"
        ),
    }
    plot = _plot_prefill if cfg.plot else None
    _write(cfg.out_dir, "bench_prefill", meta, rows, PREFILL_FIELDS, plot)
    _print_prefill(rows)
    return rows


def _print_prefill(rows: list[dict]) -> None:
    print(
        f"{'lanes':>5} {'context':>7} {'split':>10} {'p50 ms':>9} {'tok/s':>8} "
        f"{'imbalance':>9} {'busy imb':>8} {'work imb':>8} {'cpu imb':>7} {'mode':>7}  "
        "lane busy ms"
    )
    for r in rows:
        cpu = "-" if r["cpu_imbalance"] is None else f"{r['cpu_imbalance']:.3f}"
        print(
            f"{r['lanes']:>5} {r['context']:>7} {r['split']:>10} {r['prefill_ms_p50']:>9.1f} "
            f"{r['tokens_per_s']:>8.0f} {r['imbalance']:>9.3f} {r['busy_imbalance']:>8.3f} "
            f"{r['work_imbalance']:>8.3f} {cpu:>7} {r['mode']:>7}  "
            f"{', '.join(f'{x:.0f}' for x in r['lane_busy_ms'])}"
        )
    print(
        f"\nwhat CP buys (measured: overhead, critical path, exchange; PROJECTED, not measured: "
        f"one GPU per lane at {rows[0]['link_gb_per_s']:g} GB/s)"
    )
    print(
        f"{'lanes':>5} {'context':>7} {'split':>10} {'vs cp1':>7} {'crit ms':>8} "
        f"{'xchg MB':>8} {'xchg ms':>8} {'proj ms':>8} {'proj x':>7} {'est crit':>8} "
        f"{'est proj':>8} {'est x':>6}"
    )

    def f(v, spec: str) -> str:
        return "-" if v is None else format(v, spec)

    for r in rows:
        print(
            f"{r['lanes']:>5} {r['context']:>7} {r['split']:>10} "
            f"{f(r['overhead_vs_cp1'], '.2f'):>7} {r['critical_path_ms']:>8.1f} "
            f"{r['exchange_bytes'] / 1e6:>8.1f} {r['exchange_ms']:>8.1f} "
            f"{f(r['projected_ms'], '.1f'):>8} {f(r['projected_speedup'], '.2f'):>7} "
            f"{f(r['critical_path_est_ms'], '.1f'):>8} {f(r['projected_est_ms'], '.1f'):>8} "
            f"{f(r['projected_est_speedup'], '.2f'):>6}"
        )


def _plot_prefill(rows: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(13, 8.4))
    (ax1, ax2), (ax3, ax4) = axes
    contexts = sorted({r["context"] for r in rows})
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, ctx in enumerate(contexts):
        here = [r for r in rows if r["context"] == ctx]
        color = colors[i % len(colors)]
        splits = [sp for sp in ("zigzag", "contiguous") if any(r["split"] == sp for r in here)]
        for split in splits or ["none"]:
            pts = sorted(
                (r["lanes"], r["prefill_ms_p50"]) for r in here if r["split"] in (split, "none")
            )
            ax1.plot(
                [p[0] for p in pts],
                [p[1] for p in pts],
                "--" if split == "contiguous" else "-",
                marker="s" if split == "contiguous" else "o",
                markerfacecolor="none" if split == "contiguous" else color,
                color=color,
                label=f"{ctx / 1024:g}k tokens, {split}",
            )
    ax1.set(xlabel="cp_size (lanes)", ylabel="prefill ms (p50)", title="prefill time")
    ax1.set_xscale("log", base=2)
    ax1.set_xticks(
        sorted({r["lanes"] for r in rows}), [str(x) for x in sorted({r["lanes"] for r in rows})]
    )
    ax1.grid(True, alpha=0.3)
    ax1.legend(fontsize=8)
    top = max(r["lanes"] for r in rows)
    ctx = max(contexts)
    last = [r for r in rows if r["lanes"] == top and r["context"] == ctx]
    width = 0.8 / max(1, len(last))
    split_color = {"zigzag": colors[0], "contiguous": colors[1], "none": colors[2]}
    for j, r in enumerate(last):
        xs = np.arange(top) + (j - (len(last) - 1) / 2) * width
        color = split_color.get(r["split"], colors[3])
        ax2.bar(
            xs,
            r["lane_ms"],
            width,
            color=color,
            alpha=0.8,
            label=f"{r['split']}: step (max/mean {r['imbalance']:.2f})",
        )
        ax2.bar(
            xs,
            r["lane_busy_ms"],
            width,
            fill=False,
            edgecolor="black",
            label=f"{r['split']}: own work (max/mean {r['busy_imbalance']:.2f})",
        )
        if r["lane_cpu_ms"]:
            ax2.bar(
                xs,
                r["lane_cpu_ms"],
                width,
                fill=False,
                hatch="//",
                edgecolor="black",
                label=f"{r['split']}: CPU time (max/mean {r['cpu_imbalance']:.2f})",
            )
        ax3.bar(
            xs,
            r["work_share"],
            width,
            color=color,
            alpha=0.8,
            label=f"{r['split']} (max/mean {r['work_imbalance']:.2f})",
        )
    for ax, ylabel, title in (
        (ax2, "lane compute ms (mean)", f"per-lane step time, cp {top}, {ctx / 1024:g}k"),
        (ax3, "causal work / mean", f"per-lane attention work (plan), cp {top}, {ctx / 1024:g}k"),
    ):
        ax.set(xlabel="lane", ylabel=ylabel, title=title)
        ax.set_xticks(range(top))
        ax.grid(True, axis="y", alpha=0.3)
        ax.legend(fontsize=7, loc="lower right", framealpha=0.9)
    ax3.axhline(1.0, color="gray", lw=0.8)
    _plot_projection(ax4, rows, colors)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _plot_projection(ax, rows: list[dict], colors: list[str]) -> None:
    """Measured prefill time beside the PROJECTED one-GPU-per-lane time (hatched), per cp."""
    here = [r for r in rows if r["split"] in ("none", "zigzag")]
    contexts = sorted({r["context"] for r in here})
    lanes = sorted({r["lanes"] for r in here})
    kinds = (
        ("prefill_ms_p50", "measured", None),
        ("projected_ms", "projected: measured crit. path", "//"),
        ("projected_est_ms", "projected: crit. path from cp 1", ".."),
    )
    width = 0.8 / (len(contexts) * len(kinds))
    for i, ctx in enumerate(contexts):
        by_cp = {r["lanes"]: r for r in here if r["context"] == ctx}
        for j, (key, what, hatch) in enumerate(kinds):
            at = (i * len(kinds) + j - (len(contexts) * len(kinds) - 1) / 2) * width
            xs = [k + at for k, cp in enumerate(lanes) if by_cp.get(cp, {}).get(key)]
            ys = [by_cp[cp][key] for cp in lanes if by_cp.get(cp, {}).get(key)]
            ax.bar(
                xs,
                ys,
                width,
                color=colors[i % len(colors)],
                alpha=0.9 if hatch is None else 0.35,
                hatch=hatch,
                edgecolor="black",
                label=f"{ctx / 1024:g}k: {what}",
            )
    link = rows[0].get("link_gb_per_s")
    ax.set(
        xlabel="cp_size (lanes)",
        ylabel="prefill ms",
        title=f"measured vs PROJECTED (1 GPU per lane, {link:g} GB/s link)",
    )
    ax.set_xticks(range(len(lanes)), [str(x) for x in lanes])
    ax.grid(True, axis="y", alpha=0.3)
    ax.legend(fontsize=7)
