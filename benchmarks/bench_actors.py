"""Actor-path benchmark: one allocation is one round trip.

Median (and mean) ``allocate_extend`` latency for a 128k-token extend at cp 4,
beside a bare parallel no-op round to the same 4 lane actors and a no-op call to
the coordinator, all measured in this one run; plus actor calls per allocation
(the caller's one, and every lane call that carried page moves, frees' included).
The lanes' work happens in the same run (their moves are sent within
``FLUSH_AFTER_S`` of the allocation): ``--check-every N`` also waits for every
lane to apply them every N allocations, untimed.

    python benchmarks/bench_actors.py [--iters 200] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np


def timed(fn, iters: int) -> list[float]:
    out = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--iters", type=int, default=200)
    parser.add_argument("--context", type=int, default=128 * 1024)
    parser.add_argument("--cp-size", type=int, default=4)
    parser.add_argument("--page-size", type=int, default=64)
    parser.add_argument("--address", default=None)
    parser.add_argument("--check-every", type=int, default=0, help="check() every N (0: at end)")
    parser.add_argument("--json", help="write results here")
    args = parser.parse_args()

    import ray

    import cpkv
    from cpkv.core.layout import PageLayout

    cp, ctx, ps = args.cp_size, args.context, args.page_size
    layout = PageLayout(cp, ps)
    per_lane = layout.pages_per_lane_for(layout.pages_for(ctx)) * 2 + 8
    client = cpkv.connect(
        args.address,
        cp_size=cp,
        page_size=ps,
        num_pages_per_lane=per_lane,
        max_context_len=ctx,
        num_heads=1,
        head_dim=8,
        dtype="float32",
        name=f"bench-actors-{time.time_ns()}",
    )
    try:
        prompt = np.random.default_rng(0).integers(0, 150_000, size=ctx, dtype=np.int64)
        coord = client._coord
        n = iter(range(10**9))

        def alloc_cycle():
            rid = next(n)
            client.allocate_extend(rid, prompt)
            return rid

        # Warm up every path (actor method tables, serializers).
        for _ in range(10):
            client.free(alloc_cycle(), cache=False)
            client.ping_lanes()
            ray.get(coord.ping.remote())
        before = client.stats()
        alloc_times = []
        for i in range(args.iters):
            t0 = time.perf_counter()
            rid = alloc_cycle()
            alloc_times.append(time.perf_counter() - t0)
            client.free(rid, cache=False)
            if args.check_every and (i + 1) % args.check_every == 0:
                assert client.check()["ok"]
        after = client.stats()
        # What waiting moves cost a client that writes right after its allocation: its
        # write first has the coordinator send them (one round, see LaneIO).
        import torch

        short = prompt[: cp * ps]  # a page on every lane
        k = torch.zeros(short.size, client.kv.num_heads, client.kv.head_dim)
        write_times, write_again_times = [], []
        for _ in range(max(20, args.iters // 4)):
            rid = next(n)
            t0 = time.perf_counter()
            alloc = client.allocate_extend(rid, short)
            client.store_kv(alloc.out_cache_loc, k, k)
            t1 = time.perf_counter()
            client.store_kv(alloc.out_cache_loc, k, k)
            write_times.append(t1 - t0)
            write_again_times.append(time.perf_counter() - t1)
            client.free(rid, cache=False)
        lane_round = timed(client.ping_lanes, args.iters)
        coord_round = timed(lambda: ray.get(coord.ping.remote()), args.iters)
        report = client.check()
        assert report["ok"], report
    finally:
        client.shutdown()

    allocs = after["extend_allocations"] - before["extend_allocations"]
    lane_calls = after["lane_calls"] - before["lane_calls"]
    res = {
        "cp_size": cp,
        "context": ctx,
        "page_size": ps,
        "iters": args.iters,
        "alloc_median_ms": statistics.median(alloc_times) * 1e3,
        "alloc_mean_ms": statistics.fmean(alloc_times) * 1e3,
        "lane_round_median_ms": statistics.median(lane_round) * 1e3,
        "coordinator_round_median_ms": statistics.median(coord_round) * 1e3,
        "actor_calls_per_allocation": 1 + lane_calls / allocs,
    }
    res["alloc_then_write_median_ms"] = statistics.median(write_times) * 1e3
    res["write_again_median_ms"] = statistics.median(write_again_times) * 1e3
    res["alloc_over_lane_round"] = res["alloc_median_ms"] / res["lane_round_median_ms"]
    print(
        f"allocate_extend {ctx} tokens at cp {cp}: median {res['alloc_median_ms']:.2f} ms, "
        f"mean {res['alloc_mean_ms']:.2f} ms"
    )
    print(f"bare parallel no-op round to {cp} lanes: median {res['lane_round_median_ms']:.2f} ms")
    print(
        f"no-op call to the coordinator:        median {res['coordinator_round_median_ms']:.2f} ms"
    )
    print(
        f"allocate {cp * ps} tokens then write their K/V: median "
        f"{res['alloc_then_write_median_ms']:.2f} ms (the same write again: "
        f"{res['write_again_median_ms']:.2f} ms)"
    )
    print(f"ratio allocate / lane round: {res['alloc_over_lane_round']:.2f} (target <= 1.5)")
    print(
        f"actor calls per allocation (its free's included): "
        f"{res['actor_calls_per_allocation']:.2f} (target <= {cp + 1})"
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=2)


if __name__ == "__main__":
    main()
