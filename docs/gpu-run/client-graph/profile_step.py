"""Where a prefill step's fixed cost goes, through the client's step graph (cp=1).

Wraps, inside the coordinator and lane processes (``__ray_call__``), the coordinator's
step (``prefill``), its decision (``_call``), its graph round to the lanes (``_steps._run``)
and the lane's ``_step`` / ``worker.step``; medians of each over the steps, beside the
client's wall time and its graph round. Run from the repository root:

    PYTHONPATH=. python docs/gpu-run/client-graph/profile_step.py [--model tiny] [--iters 60]
"""

import argparse
import os
import statistics
import time

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")

import numpy as np
import ray

import cpkv
from cpkv.models import preset_config


def _wrap_all(actor, targets):
    import functools
    import time as _time

    actor._rec = rec = {}
    for path, key in targets:
        obj = actor
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
                    rec.setdefault(key, []).append(_time.perf_counter() - t0)

            return w

        setattr(obj, name, make(f, key))
    return True


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--iters", type=int, default=60)
    ap.add_argument("--num-gpus-per-lane", type=float, default=None)
    args = ap.parse_args()
    config = preset_config(args.model)
    c = cpkv.connect(
        cp_size=1,
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
    prompt = np.arange(16)
    for i in range(5):
        c.prefill(f"w{i}", prompt)
        c.free(f"w{i}", cache=False)
    ray.get(
        c._coord.__ray_call__.remote(
            _wrap_all,
            [
                ("_c.prefill", "coordinator: the step (run_step's work)"),
                ("_c._call", "coordinator: deciding (_call; prefills and frees)"),
                ("_steps._run", "coordinator: graph round to the lane"),
            ],
        )
    )
    ray.get(
        c.lanes[0].__ray_call__.remote(
            _wrap_all,
            [
                ("_step", "lane: _step (moves + worker.step)"),
                ("_worker.step", "lane: worker.step"),
            ],
        )
    )
    graph = c._graph
    run, rounds = graph.run, []

    def timed_run(call, timeout_s):
        t0 = time.perf_counter()
        try:
            return run(call, timeout_s)
        finally:
            rounds.append(time.perf_counter() - t0)

    graph.run = timed_run
    walls, computes = [], []
    for i in range(args.iters):
        t0 = time.perf_counter()
        res = c.prefill(i, prompt)
        walls.append(time.perf_counter() - t0)
        computes.append(max(res.lane_seconds))
        c.free(i, cache=False)
    rows = {
        "client: prefill wall": walls,
        "client: graph round": rounds,
        "lane: compute_s (the step's own)": computes,
    }
    rows |= ray.get(c._coord.__ray_call__.remote(lambda a: a._rec))
    rows |= ray.get(c.lanes[0].__ray_call__.remote(lambda a: a._rec))
    print(f"model {args.model}, cp 1, 16-token prefill, medians of {args.iters} (ms)")
    for key, values in rows.items():
        print(f"{key:<45} {statistics.median(values) * 1e3:8.3f}  (n={len(values)})")
    c.shutdown()


if __name__ == "__main__":
    main()
