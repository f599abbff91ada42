"""Bare Ray compiled-graph rounds to one echoing actor: the floor under each leg of a step.

Driven from the driver process, and from inside a threaded actor shaped like the
coordinator (its own thread and a thread of its own), with a ``bytes`` payload:

    python3 docs/gpu-run/step-wire/bare_rounds.py [iters] [payload_bytes]
"""

import os
import statistics
import sys
import threading
import time

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")

import ray
from ray.dag import InputNode, MultiOutputNode


@ray.remote(num_cpus=0, concurrency_groups={"x": 2})
class Echo:
    def echo(self, b):
        return b


def median_round_ms(lanes, iters: int, payload: int) -> float:
    with InputNode() as inp:
        out = MultiOutputNode([lane.echo.bind(inp) for lane in lanes])
    graph = out.experimental_compile()
    data = b"x" * payload
    try:
        for _ in range(20):
            ray.get(graph.execute(data))
        times = []
        for _ in range(iters):
            t0 = time.perf_counter()
            ray.get(graph.execute(data))
            times.append(time.perf_counter() - t0)
        return statistics.median(times) * 1e3
    finally:
        graph.teardown()


@ray.remote(
    num_cpus=0,
    max_concurrency=16,
    concurrency_groups={"lease": 2, "status": 2, "_ray_system": 5},
)
class Coordinator:
    def __init__(self, lanes):
        self.lanes = lanes

    def bench(self, iters: int, payload: int, own_thread: bool) -> float:
        if not own_thread:
            return median_round_ms(self.lanes, iters, payload)
        out = {}
        t = threading.Thread(
            target=lambda: out.setdefault("ms", median_round_ms(self.lanes, iters, payload))
        )
        t.start()
        t.join()
        return out["ms"]


def main() -> None:
    iters = int(sys.argv[1]) if len(sys.argv) > 1 else 300
    payload = int(sys.argv[2]) if len(sys.argv) > 2 else 1000
    ray.init(include_dashboard=False, num_cpus=2, log_to_driver=False)
    try:
        # NOTE: a fresh actor per graph: a graph built right after another's teardown on the
        # same actor ran 2.5x slower for its first ~0.3 s on the 2-core machine.
        print(f"driver process   : {median_round_ms([Echo.remote()], iters, payload):.3f} ms")
        for own in (False, True):
            coord = Coordinator.remote([Echo.remote()])
            ms = ray.get(coord.bench.remote(iters, payload, own))
            print(f"actor, {'own' if own else 'its'} thread : {ms:.3f} ms")
    finally:
        ray.shutdown()


if __name__ == "__main__":
    main()
