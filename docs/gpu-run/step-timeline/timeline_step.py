"""A prefill step's timeline across the client, the coordinator and the lanes.

Stamps ``time.perf_counter()`` (CLOCK_MONOTONIC: one clock for every process of the
machine) at each hand-off of a step sent through the client's step graph, inside the
coordinator and lane processes (``__ray_call__``), and prints the median of each leg:

    client -> coordinator       the client graph's write, the coordinator loop's read
    decision                    run_step until the step is queued for the lanes' graph
    coordinator pack            the step packet pickled (cpkv.actors.wire)
    thread hop                  queued until packed (0 when the queuing thread writes it)
    Ray coordinator -> lane     the lanes' graph write and the lane loop's read
    lane unpack / pack          compiled_step_packed's own pickles
    lane before/after _step     compiled_step's own work (fence, reply)
    Ray lane -> coordinator     the lane's write, the coordinator's read
    coordinator unpack          the lane's answer unpickled
    hand-back                   the answer reaching run_step's return (packed for the client)
    coordinator -> client       run_step's return written, read by the client

At cp > 1 a lane's leg is printed as the median over steps of its fastest and slowest lane
(``min / max``); "Ray lane -> coordinator" is each lane's pack end to its answer's unpack
(the answers are read in rank order).

Run from the repository root: ``PYTHONPATH=. python docs/gpu-run/step-timeline/timeline_step.py
[--cp 1] [--model tiny] [--vocab N] [--iters 60] [--greedy]``.
"""

import argparse
import dataclasses
import os
import statistics
import time

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")

import numpy as np
import ray

import cpkv
from cpkv.models import preset_config


def _stamp_all(actor, targets):
    """Wrap ``actor``'s methods (dotted paths) to record (enter, leave) stamps per key."""
    import functools
    import time as _time

    actor._stamps = stamps = {}
    for path, key in targets:
        obj = actor
        if path.startswith("mod:"):  # a module's function: "mod:package.module.function"
            import importlib

            module, _, path = path[4:].rpartition(".")
            obj = importlib.import_module(module)
        *parents, name = path.split(".")
        for p in parents:
            obj = getattr(obj, p)
        f = getattr(obj, name)

        def make(f, key):
            @functools.wraps(f)
            def w(*a, **k):
                t0 = _time.perf_counter()
                try:
                    return f(*a, **k)
                finally:
                    stamps.setdefault(key, []).append((t0, _time.perf_counter()))

            return w

        setattr(obj, name, make(f, key))
    return True


def _clear(actor):
    actor._stamps.clear()
    return True


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cp", type=int, default=1)
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--iters", type=int, default=60)
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--num-gpus-per-lane", type=float, default=None)
    ap.add_argument("--vocab", type=int, default=None, help="the preset's vocabulary replaced")
    ap.add_argument("--dtype", default=None, help="the preset's dtype replaced")
    ap.add_argument("--greedy", action="store_true", help="prefill(..., greedy=True)")
    ap.add_argument(
        "--warmup",
        type=int,
        default=300,
        help="steps first (with a big vocabulary's logits, ~130 of them fill the coordinator's "
        "remembered replies to their byte bound)",
    )
    args = ap.parse_args()
    config = preset_config(args.model)
    if args.vocab:  # a big vocabulary's logits on a small model (the 1B's: 128256)
        config = dataclasses.replace(config, vocab_size=args.vocab)
    if args.dtype:
        config = dataclasses.replace(config, dtype=args.dtype)
    c = cpkv.connect(
        cp_size=args.cp,
        page_size=64,
        num_pages_per_lane=256,
        max_reqs=16,
        max_context_len=4096,
        model=config,
        model_seed=0,
        dtype=config.dtype,
        compiled_steps=True,
        num_gpus_per_lane=args.num_gpus_per_lane,
    )
    prompt = np.arange(args.tokens)
    coord, lanes, cp = c._coord, c.lanes, args.cp
    ray.get(
        coord.__ray_call__.remote(
            _stamp_all,
            [
                ("run_step", "run_step"),
                ("_steps.execute", "queued"),
                ("mod:cpkv.actors.compiled_steps.pack", "cs_pack"),
                ("mod:cpkv.actors.compiled_steps.unpack", "cs_unpack"),
            ],
        )
    )
    ray.get(
        [
            lane.__ray_call__.remote(
                _stamp_all,
                [("compiled_step_packed", "packed"), ("compiled_step", "lane"), ("_step", "step")],
            )
            for lane in lanes
        ]
    )
    graph, client = c._graph, []
    run = graph.run

    def timed_run(call, timeout_s):
        t0 = time.perf_counter()
        try:
            return run(call, timeout_s)
        finally:
            client.append((t0, time.perf_counter()))

    graph.run = timed_run
    # Warm-up: builds, first runs, and the remembered replies grown to their bound (a long
    # job's state: until then each logits row faults in fresh pages, ~0.17 ms a step).
    for i in range(args.warmup):
        c.prefill(f"w{i}", prompt, greedy=args.greedy)
        c.free(f"w{i}", cache=False)
    client.clear()
    ray.get([coord.__ray_call__.remote(_clear)] + [la.__ray_call__.remote(_clear) for la in lanes])
    for i in range(args.iters):
        c.prefill(i, prompt, greedy=args.greedy)
        c.free(i, cache=False)
    co = ray.get(coord.__ray_call__.remote(lambda a: a._stamps))
    las = ray.get([la.__ray_call__.remote(lambda a: a._stamps) for la in lanes])
    n = args.iters
    lengths = {k: len(v) for k, v in {**co, "client": client}.items()}
    lengths["cs_unpack"] //= cp  # one an answer: cp a step
    lengths.update({f"lane {r} {k}": len(v) for r, la in enumerate(las) for k, v in la.items()})
    assert all(v == n for v in lengths.values()), lengths
    unpack = [co["cs_unpack"][i * cp : (i + 1) * cp] for i in range(n)]

    def lanes_leg(f) -> list[tuple[float, float]]:
        """Per step, (fastest, slowest) lane of ``f(i, r, lane_stamps)``."""
        out = []
        for i in range(n):
            vals = [f(i, r, la) for r, la in enumerate(las)]
            out.append((min(vals), max(vals)))
        return out

    legs = {
        "client -> coordinator": [co["run_step"][i][0] - client[i][0] for i in range(n)],
        "decision (run_step until queued)": [
            co["queued"][i][0] - co["run_step"][i][0] for i in range(n)
        ],
        "coordinator pack": [co["cs_pack"][i][1] - co["cs_pack"][i][0] for i in range(n)],
        "queued until packed (thread hop)": [
            co["cs_pack"][i][0] - co["queued"][i][0] for i in range(n)
        ],
        "Ray coordinator -> lane": lanes_leg(
            lambda i, r, la: la["packed"][i][0] - co["cs_pack"][i][1]
        ),
        "lane unpack": lanes_leg(lambda i, r, la: la["lane"][i][0] - la["packed"][i][0]),
        "lane before _step": lanes_leg(lambda i, r, la: la["step"][i][0] - la["lane"][i][0]),
        "lane _step (moves + compute)": lanes_leg(
            lambda i, r, la: la["step"][i][1] - la["step"][i][0]
        ),
        "lane after _step": lanes_leg(lambda i, r, la: la["lane"][i][1] - la["step"][i][1]),
        "lane pack": lanes_leg(lambda i, r, la: la["packed"][i][1] - la["lane"][i][1]),
        "lane's answer written (since pack)": lanes_leg(
            lambda i, r, la: la["packed"][i][1] - co["cs_pack"][i][1]
        ),
        "Ray lane -> coordinator": lanes_leg(lambda i, r, la: unpack[i][r][0] - la["packed"][i][1]),
        "coordinator unpack (all answers)": [unpack[i][-1][1] - unpack[i][0][0] for i in range(n)],
        "hand-back to run_step's return": [
            co["run_step"][i][1] - unpack[i][-1][1] for i in range(n)
        ],
        "coordinator -> client": [client[i][1] - co["run_step"][i][1] for i in range(n)],
        "client round (total)": [client[i][1] - client[i][0] for i in range(n)],
    }
    kind = "greedy " if args.greedy else ""
    print(f"model {args.model}, cp {cp}, {args.tokens}-token {kind}prefill, medians of {n} (ms)")
    for key, values in legs.items():
        if isinstance(values[0], tuple):
            lo = statistics.median(v[0] for v in values) * 1e3
            hi = statistics.median(v[1] for v in values) * 1e3
            print(f"{key:<36} {lo:8.3f} / {hi:.3f}" if cp > 1 else f"{key:<36} {lo:8.3f}")
        else:
            print(f"{key:<36} {statistics.median(values) * 1e3:8.3f}")
    slowest = legs["lane _step (moves + compute)"]
    over = [legs["client round (total)"][i] - slowest[i][1] for i in range(n)]
    print(f"{'round beyond the slowest lane _step':<36} {statistics.median(over) * 1e3:8.3f}")
    c.shutdown()


if __name__ == "__main__":
    main()
