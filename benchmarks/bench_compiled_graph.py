"""Ray Compiled Graphs against ordinary actor calls, for the coordinator -> lanes dispatch
(issue 22 item 2): what a round to ``cp`` actors and a single call cost each way, on the same
actors in one run. The actors echo their argument, so this is Ray's own per-call cost, the
floor under a step's fixed cost (cpkv's own graphs: ``compiled_steps=True`` and the clients'
step graphs, timed in ``bench_steps.py``).

    python benchmarks/bench_compiled_graph.py [--cp 4] [--iters 300]

Prints medians in milliseconds and the ordinary / compiled ratios.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

from _timing import median_seconds  # benchmarks/, the script's own folder


def median_ms(fn: Callable[[], object], iters: int) -> float:
    return median_seconds(fn, iters, warmup=20) * 1e3


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cp", type=int, default=4, help="actors in a round")
    parser.add_argument("--iters", type=int, default=300)
    args = parser.parse_args(argv)

    from cpkv.actors.ray_env import keep_ray_on_loopback

    keep_ray_on_loopback()
    import ray
    from ray.dag import InputNode, MultiOutputNode

    @ray.remote
    class Echo:
        def echo(self, x: object) -> object:
            return x

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
    finally:
        ray.shutdown()
    for name, ms in rows.items():
        print(f"{name:<24} {ms:7.3f} ms")
    print(
        f"round: ordinary / compiled = "
        f"{rows[f'ordinary round to {args.cp}'] / rows[f'compiled round to {args.cp}']:.1f}x; "
        f"one call: {rows['ordinary call to 1'] / rows['compiled call to 1']:.1f}x"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
