"""``cpkv bench``: allocation latency, throughput and lane balance against cp_size.

For every (lanes, context) point a fresh coordinator and lanes are placed, then
``requests`` distinct prompts of ``context`` tokens are allocated and freed by
``concurrency`` threads over a pool that holds about ``concurrency`` of them, so
the prefix cache fills and eviction (and sometimes capacity waits) happen.
"""

from __future__ import annotations

import csv
import json
import os
import platform
import threading
import time
from dataclasses import asdict, dataclass, field

import numpy as np

from cpkv.errors import KVCapacityWaitError

__all__ = ["BenchConfig", "run_bench"]

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

    pages_per_req = -(-context // cfg.page_size)
    # Room for `concurrency` requests plus slack: more than that must evict or wait.
    per_lane = -(-pages_per_req * cfg.concurrency // cp) + 2 * cp + 2
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
                while True:
                    t0 = time.perf_counter()
                    try:
                        alloc = client.allocate_extend(f"b{i}", prompts[i])
                    except KVCapacityWaitError:
                        time.sleep(0.002)
                        continue
                    dt = time.perf_counter() - t0
                    break
                counts = np.bincount(alloc.new_pages % cp, minlength=cp)
                client.free(f"b{i}", cache=True)
                with lock:
                    latencies.append(dt)
                    per_lane_pages[:] += counts

        t0 = time.perf_counter()
        threads = [threading.Thread(target=worker) for _ in range(cfg.concurrency)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        elapsed = time.perf_counter() - t0
        stats = client.stats()
        report = client.check()
        assert report["ok"], report["problems"]
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
        # The caller's one call, plus the lane calls the coordinator sent for allocations.
        "actor_calls_per_alloc": 1 + stats["lane_calls_by_op"].get("extend", 0) / max(1, allocs),
        "fallbacks": json.dumps(stats["fallbacks_by_reason"]),
        "nodes": len(nodes),
        "lane_nodes": lane_nodes,
    }


def run_bench(cfg: BenchConfig) -> list[dict]:
    """Run every point; write ``bench.json``, ``bench.csv`` and ``bench.png`` to ``out_dir``."""
    from tqdm import tqdm

    from cpkv._ray_env import ensure_ray, local_gpu_count

    most = max(cfg.lanes)
    ensure_ray(
        cfg.address,
        num_cpus=None if cfg.address else most + 2,
        num_gpus=None if cfg.address else (local_gpu_count() or most),
    )
    points = [(cp, ctx) for cp in cfg.lanes for ctx in cfg.contexts]
    rows = []
    for cp, ctx in tqdm(points, desc="bench", unit="point", disable=not cfg.progress):
        rows.append(_point(cfg, cp, ctx))
    os.makedirs(cfg.out_dir, exist_ok=True)
    meta = {
        "config": asdict(cfg),
        "python": platform.python_version(),
        "machine": platform.machine(),
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
    }
    with open(os.path.join(cfg.out_dir, "bench.json"), "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=2)
    with open(os.path.join(cfg.out_dir, "bench.csv"), "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=FIELDS, extrasaction="ignore")
        w.writeheader()
        w.writerows(rows)
    if cfg.plot:
        _plot(rows, os.path.join(cfg.out_dir, "bench.png"))
    _print(rows)
    return rows


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
