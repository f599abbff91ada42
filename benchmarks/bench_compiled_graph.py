"""Ray Compiled Graphs against ordinary actor calls, for the coordinator -> lanes dispatch
(issue 22 item 2): what a round to ``cp`` actors and a single call cost each way, on the same
actors in one run. The actors echo their argument, so this is Ray's own per-call cost, the
floor under a step's fixed cost (cpkv's own graphs: ``compiled_steps=True`` and the clients'
step graphs, timed in ``bench_steps.py``).

Then a compiled round whose first actor answers ``--late-ms`` after the others (a solo step's
lane computing while the idle ones answer at once): the time from its answer to the round's,
with Ray's read iteration (0.1 s) and cpkv's (``cpkv.actors.graphs.READ_ITERATION_S``: the
outputs that are ready are read while the late one is not), alternating, twice.

    python benchmarks/bench_compiled_graph.py [--cp 4] [--iters 300] [--late-ms 4]

Prints medians in milliseconds and the ordinary / compiled ratios.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

from _timing import median_seconds  # benchmarks/, the script's own folder


def median_ms(fn: Callable[[], object], iters: int) -> float:
    return median_seconds(fn, iters, warmup=20) * 1e3


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cp", type=int, default=4, help="actors in a round")
    parser.add_argument("--iters", type=int, default=300)
    parser.add_argument("--late-ms", type=float, default=4.0, help="the late actor's delay")
    args = parser.parse_args(argv)

    from cpkv.actors.ray_env import keep_ray_on_loopback

    keep_ray_on_loopback()
    import ray
    from ray.dag import DAGContext, InputNode, MultiOutputNode

    from cpkv.actors.graphs import READ_ITERATION_S

    @ray.remote
    class Echo:
        def echo(self, x: object) -> object:
            return x

        def late(self, delay_s: float) -> float:
            """Busy for ``delay_s`` (a lane computing), then its answer's wall time."""
            end = time.perf_counter() + delay_s
            while time.perf_counter() < end:
                pass
            return time.time()

    ray.init(include_dashboard=False, num_cpus=args.cp + 2, num_gpus=0)
    try:
        actors = [Echo.remote() for _ in range(args.cp)]
        ray.get([a.echo.remote(0) for a in actors])
        rows = {
            f"ordinary round to {args.cp}": median_ms(
                lambda: ray.get([a.echo.remote(1) for a in actors]), args.iters
            ),
            "ordinary call to 1": median_ms(lambda: ray.get(actors[0].echo.remote(1)), args.iters),
        }
        # NOTE: an actor belongs to one compiled graph at a time: tear each down before the next.
        with InputNode() as inp:
            fan_out = MultiOutputNode([a.echo.bind(inp) for a in actors])
        graph = fan_out.experimental_compile()
        try:
            rows[f"compiled round to {args.cp}"] = median_ms(
                lambda: ray.get(graph.execute(1)), args.iters
            )
        finally:
            graph.teardown()
        with InputNode() as inp:
            one = actors[0].echo.bind(inp)
        graph = one.experimental_compile()
        try:
            rows["compiled call to 1"] = median_ms(lambda: ray.get(graph.execute(1)), args.iters)
        finally:
            graph.teardown()
        # The first actor late, the others at once: from its answer to the round's.
        with InputNode() as inp:
            fan_out = MultiOutputNode(
                [actors[0].late.bind(inp)] + [a.echo.bind(inp) for a in actors[1:]]
            )
        graph = fan_out.experimental_compile()
        ctx = DAGContext.get_current()
        ray_default = ctx.read_iteration_timeout
        late_s = args.late_ms / 1e3

        def after_late() -> float:
            answered = ray.get(graph.execute(late_s))[0]
            return time.time() - answered

        try:
            for _ in range(2):
                for name, wait_s in (("Ray's", ray_default), ("cpkv's", READ_ITERATION_S)):
                    ctx.read_iteration_timeout = wait_s
                    for _ in range(20):
                        after_late()
                    ms = statistics.median(after_late() for _ in range(args.iters)) * 1e3
                    rows.setdefault(f"late: {name} reads", []).append(ms)
        finally:
            ctx.read_iteration_timeout = ray_default
            graph.teardown()
    finally:
        ray.shutdown()
    late = {name: rows.pop(name) for name in list(rows) if name.startswith("late")}
    for name, ms in rows.items():
        print(f"{name:<24} {ms:7.3f} ms")
    print(f"round with the first of {args.cp} actors {args.late_ms:g} ms late, from its answer:")
    for name, runs in late.items():
        print(f"  {name[6:]:<13} " + " / ".join(f"{ms:.3f}" for ms in runs) + " ms")
    ray_ms, ours_ms = (min(runs) for runs in late.values())
    print(f"  Ray's / cpkv's = {ray_ms / ours_ms:.2f}x (best of each)")
    print(
        f"round: ordinary / compiled = "
        f"{rows[f'ordinary round to {args.cp}'] / rows[f'compiled round to {args.cp}']:.1f}x; "
        f"one call: {rows['ordinary call to 1'] / rows['compiled call to 1']:.1f}x"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
