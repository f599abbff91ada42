"""Step latency: what a tiny prefill and a decode step cost beside the rounds they are made of.

For each cp: the median of a prefill of a few tokens (and its free; with logits, and greedy:
the next token only, alternating), of one decode step of one request (with logits, and
greedy: ids only), of a bare parallel no-op round to the lanes
and of a no-op call to the coordinator, all in this one run, on a model preset with random
weights. A prefill's fixed cost is its wall time less its slowest lane's step: the control
path (client -> coordinator -> lanes -> client) with no lane computing.

    python benchmarks/bench_steps.py [--cp 1,4] [--dispatch calls,compiled,graph]
        [--model tiny] [--vocab N] [--dtype bfloat16] [--tokens 16] [--iters 40] [--warmup 300]

``--dispatch``: how steps travel, one row each, side by side: ``calls`` (an actor call to
the coordinator, one per lane from it), ``compiled`` (the coordinator's steps to the lanes
through one Ray compiled graph, the client's to the coordinator an actor call:
``cpkv.connect(compiled_steps=True, step_graph=False)``) or ``graph`` (the client's through
a compiled graph of its own too: ``cpkv.connect(compiled_steps=True)``).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time

import numpy as np
from _timing import median_seconds  # benchmarks/, the script's own folder


def _median_ms(fn, iters: int) -> float:
    return median_seconds(fn, iters) * 1e3


def _point(args, cp: int, dispatch: str) -> dict:
    import ray

    import cpkv
    from cpkv.models import preset_config

    config = preset_config(args.model)
    if args.vocab:  # a big vocabulary's logits on a small model (the 1B's: 128256)
        config = dataclasses.replace(config, vocab_size=args.vocab)
    if args.dtype:
        config = dataclasses.replace(config, dtype=args.dtype)
    client = cpkv.connect(
        args.address,
        cp_size=cp,
        page_size=args.page_size,
        num_pages_per_lane=256,
        max_reqs=16,
        max_context_len=4096,
        num_gpus_per_lane=args.num_gpus_per_lane,
        model=config,
        model_seed=0,
        dtype=config.dtype,
        name=f"bench-steps-{cp}-{time.time_ns()}",
        compiled_steps=dispatch in ("compiled", "graph"),
        step_graph=dispatch == "graph",
    )
    try:
        rng = np.random.default_rng(0)
        prompt = rng.integers(0, config.vocab_size, size=args.tokens)
        n = iter(range(10**9))

        def prefill_cycle():
            rid = next(n)
            client.prefill(rid, prompt)
            client.free(rid, cache=False)

        def prefill_only(greedy: bool = False):
            rid = next(n)
            t0 = time.perf_counter()
            res = client.prefill(rid, prompt, greedy=greedy)
            dt = time.perf_counter() - t0
            client.free(rid, cache=False)
            return dt, max(res.lane_seconds)

        client.prefill("d", prompt)
        step = iter(range(10**9))

        def decode_step():
            client.decode(["d"], [int(next(step) % config.vocab_size)])

        def decode_greedy():
            client.decode_greedy(["d"], [int(next(step) % config.vocab_size)])

        for _ in range(5):  # warm every path (kernels, actor method tables, serializers)
            prefill_cycle()
            decode_step()
            client.ping_lanes()
            ray.get(client._coord.ping.remote())
        # Alternating, so a slower moment of the machine falls on both alike. First right
        # after the start (cold), then once the coordinator's remembered replies have reached
        # their byte bound (a long job's steady state): until then every logits row it keeps
        # lands on fresh heap pages, which fault in (~0.17 ms a 1B row on the 2-core machine).
        cold = [prefill_only() for _ in range(args.iters)]
        cold_fixed_ms = statistics.median(w - s for w, s in cold) * 1e3
        for _ in range(max(0, args.warmup - args.iters)):
            prefill_cycle()
        pairs = [(prefill_only(), prefill_only(greedy=True)) for _ in range(args.iters)]
        walls, lanes = zip(*(p for p, _ in pairs), strict=True)
        prefill_ms = statistics.median(walls) * 1e3
        lane_ms = statistics.median(lanes) * 1e3
        # The control path's own cost: the wall time no lane was computing.
        fixed_ms = statistics.median(w - s for w, s in zip(walls, lanes, strict=True)) * 1e3
        greedy_fixed_ms = statistics.median(w - s for _, (w, s) in pairs) * 1e3
        greedy_ms = _median_ms(decode_greedy, args.iters)
        decode_ms = _median_ms(decode_step, args.iters)
        lanes_ms = _median_ms(client.ping_lanes, args.iters)
        coord_ms = _median_ms(lambda: ray.get(client._coord.ping.remote()), args.iters)
    finally:
        client.shutdown()
    floor = coord_ms + lanes_ms
    return {
        "cp_size": cp,
        "dispatch": dispatch,
        "tokens": args.tokens,
        "prefill_ms": prefill_ms,
        "prefill_lane_ms": lane_ms,
        "prefill_fixed_ms": fixed_ms,
        "prefill_fixed_cold_ms": cold_fixed_ms,
        "prefill_greedy_fixed_ms": greedy_fixed_ms,
        "decode_ms": decode_ms,
        "decode_greedy_ms": greedy_ms,
        "lane_round_ms": lanes_ms,
        "coordinator_round_ms": coord_ms,
        "prefill_fixed_over_rounds_ms": prefill_ms - floor,
        "decode_fixed_over_rounds_ms": decode_ms - floor,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--cp", default="1,4", help="comma-separated cp sizes")
    parser.add_argument(
        "--dispatch", default="calls,compiled,graph", help="calls, compiled and/or graph"
    )
    parser.add_argument("--model", default="tiny", help="a preset of cpkv.models")
    parser.add_argument("--tokens", type=int, default=16)
    parser.add_argument("--vocab", type=int, default=None, help="the preset's vocabulary replaced")
    parser.add_argument("--dtype", default=None, help="the preset's dtype replaced")
    parser.add_argument("--page-size", type=int, default=64)
    parser.add_argument("--iters", type=int, default=40)
    parser.add_argument(
        "--warmup",
        type=int,
        default=300,
        help="logits prefills before the steady-state figures, the cold ones included (the "
        "remembered replies' byte bound, 64 MB at 4 bytes a logit, holds ~130 rows of a 128k "
        "vocabulary)",
    )
    parser.add_argument("--num-gpus-per-lane", type=float, default=None)
    parser.add_argument("--address", default=None)
    parser.add_argument("--json", help="write results here")
    args = parser.parse_args()
    dispatches = args.dispatch.split(",")
    for d in dispatches:
        if d not in ("calls", "compiled", "graph"):
            parser.error(f"--dispatch {d!r}: expected calls, compiled or graph")
    rows = [_point(args, int(cp), d) for cp in args.cp.split(",") for d in dispatches]
    print(f"model {args.model}, prompt {args.tokens} tokens; medians of {args.iters} in this run")
    print(
        "cp  dispatch  prefill ms  its lanes' step ms  prefill fixed ms  greedy fixed ms  "
        "cold fixed ms  decode ms  decode_greedy ms  coordinator round ms  lane round ms"
    )
    for r in rows:
        print(
            f"{r['cp_size']:>2}  {r['dispatch']:>8}  {r['prefill_ms']:>10.2f}  "
            f"{r['prefill_lane_ms']:>18.2f}  {r['prefill_fixed_ms']:>16.2f}  "
            f"{r['prefill_greedy_fixed_ms']:>15.2f}  {r['prefill_fixed_cold_ms']:>13.2f}  "
            f"{r['decode_ms']:>9.2f}  "
            f"{r['decode_greedy_ms']:>16.2f}  {r['coordinator_round_ms']:>20.2f}  "
            f"{r['lane_round_ms']:>13.2f}"
        )
    print("prefill fixed ms: the prefill's wall time less its slowest lane's step (median)")
    print("greedy fixed ms: the same for prefill(..., greedy=True) (the next token, no logits)")
    print(
        f"both after {max(args.warmup, args.iters)} logits prefills; cold fixed ms: the "
        "prefill's, in the first steps after the start"
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)


if __name__ == "__main__":
    main()
