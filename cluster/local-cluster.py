#!/usr/bin/env python3
"""A several-node Ray cluster on this one machine, and ``cpkv bench`` run against it.

One head node (CPUs, no GPUs) and ``--workers`` worker nodes, each with
``--gpus-per-worker`` *logical* GPUs, all started by ``ray.cluster_utils.Cluster``
and all bound to 127.0.0.1. Logical GPUs are only numbers in Ray's scheduler, so
``--strategy SPREAD`` / ``STRICT_SPREAD`` placement across nodes is testable on a
laptop or a CPU-only CI box; the lanes then run on CPU tensors. On a machine with
real GPUs every node sees the same devices, so use it for placement, not speed.

    python cluster/local-cluster.py                      # 2 workers x 2 GPUs, default sweep
    python cluster/local-cluster.py --workers 3 --gpus-per-worker 1 -- \\
        --lanes 1,3 --context 32k --requests 4 --strategy STRICT_SPREAD --out results/lc
    python cluster/local-cluster.py --probe              # placement check only, no bench

Everything after this script's own options (or after ``--``) goes to ``cpkv bench``;
``--address <this cluster>`` is added unless given. The cluster is always shut down.
"""

from __future__ import annotations

import os

# NOTE: Ray reads this when `ray` is first imported (ray._private.ray_constants), so
# it must be set before any `import ray`, here or in a caller. "0" makes every node
# and driver use 127.0.0.1 instead of the machine's outward address.
os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"

import argparse
import contextlib
import sys
import time
from collections.abc import Iterator, Sequence
from typing import Any

__all__ = ["default_bench_args", "local_cluster", "main", "probe", "run", "start_cluster"]

DEFAULT_OUT = "results/local-cluster"
NAMESPACE = "cpkv"  # the namespace cpkv's actors live in (cpkv.actors.ray_env.NAMESPACE)


def _check_loopback() -> None:
    """Fail loudly when Ray was imported before the loopback switch could take effect."""
    from ray._private import ray_constants

    if getattr(ray_constants, "ENABLE_RAY_CLUSTER", False):
        raise RuntimeError(
            "ray was imported before RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 was set, so the "
            "nodes would bind the machine's outward address; set it in the environment "
            "(or import this module before ray)"
        )


def start_cluster(
    num_workers: int = 2,
    gpus_per_worker: float = 2,
    *,
    cpus_per_worker: float = 2,
    head_cpus: float = 2,
    object_store_mb: int | None = None,
) -> Any:
    """Start a head and ``num_workers`` worker nodes on 127.0.0.1; return the Cluster.

    Args:
        num_workers: worker nodes besides the head (>= 1).
        gpus_per_worker: logical GPUs each worker advertises (> 0).
        cpus_per_worker: logical CPUs each worker advertises (> 0).
        head_cpus: logical CPUs of the head, which has no GPUs.
        object_store_mb: object store size per node; Ray's default when None.

    Returns:
        A started ``ray.cluster_utils.Cluster``; the caller shuts it down.

    Raises:
        ValueError: a count out of range.
        RuntimeError: ray was imported without the loopback switch.
    """
    # NOTE: Ray takes only whole resource counts for a node (its lanes take fractions).
    counts = (gpus_per_worker, cpus_per_worker, head_cpus)
    whole = all(float(x) == int(x) for x in counts)
    if not whole or num_workers < 1 or min(gpus_per_worker, cpus_per_worker) <= 0 or head_cpus < 0:
        raise ValueError(
            f"num_workers={num_workers} (>= 1), gpus_per_worker={gpus_per_worker} (> 0), "
            f"cpus_per_worker={cpus_per_worker} (> 0), head_cpus={head_cpus} (>= 0): whole "
            "numbers of each"
        )
    _check_loopback()
    from ray.cluster_utils import Cluster

    store = {} if object_store_mb is None else {"object_store_memory": object_store_mb << 20}
    cluster = Cluster(
        initialize_head=True,
        head_node_args={"num_cpus": head_cpus, "num_gpus": 0, "include_dashboard": False, **store},
    )
    try:
        for _ in range(num_workers):
            cluster.add_node(num_cpus=cpus_per_worker, num_gpus=gpus_per_worker, **store)
        cluster.wait_for_nodes()
    except BaseException:
        cluster.shutdown()
        raise
    return cluster


@contextlib.contextmanager
def local_cluster(
    num_workers: int = 2,
    gpus_per_worker: float = 2,
    *,
    cpus_per_worker: float = 2,
    head_cpus: float = 2,
    object_store_mb: int | None = None,
    connect: bool = True,
) -> Iterator[Any]:
    """Context manager: a started cluster (this driver connected when ``connect``).

    ``RAY_ADDRESS`` points at the cluster inside the block, so ``address="auto"``
    (``cpkv bench --address auto``, ``cpkv.connect(address="auto")``) finds it.
    On exit the driver disconnects, every node is stopped, and ``RAY_ADDRESS``
    is restored, whatever happened inside.
    """
    import ray

    t0 = time.perf_counter()
    cluster = start_cluster(
        num_workers,
        gpus_per_worker,
        cpus_per_worker=cpus_per_worker,
        head_cpus=head_cpus,
        object_store_mb=object_store_mb,
    )
    old_address = os.environ.get("RAY_ADDRESS")
    try:
        os.environ["RAY_ADDRESS"] = cluster.address
        if connect:
            ray.init(address=cluster.address, namespace=NAMESPACE, log_to_driver=True)
        print(
            f"[local-cluster] {1 + num_workers} nodes at {cluster.address} in "
            f"{time.perf_counter() - t0:.1f}s: {_resources_line()}",
            flush=True,
        )
        yield cluster
    finally:
        with contextlib.suppress(Exception):
            ray.shutdown()
        cluster.shutdown()
        if old_address is None:
            os.environ.pop("RAY_ADDRESS", None)
        else:
            os.environ["RAY_ADDRESS"] = old_address


def _resources_line() -> str:
    import ray

    if not ray.is_initialized():
        return "(driver not connected)"
    res = ray.cluster_resources()
    alive = sum(1 for n in ray.nodes() if n.get("Alive"))
    return f"alive={alive} CPU={res.get('CPU', 0):g} GPU={res.get('GPU', 0):g}"


def default_bench_args(total_gpus: float) -> list[str]:
    """A small sweep that fits the cluster: lane counts 1, 2, 4, ... up to the GPUs."""
    lanes, n = [], 1
    while n <= max(1, int(total_gpus)):
        lanes.append(str(n))
        n *= 2
    return [
        "--lanes", ",".join(lanes),
        "--context", "32k",
        "--requests", "4",
        "--page-size", "64",
        "--strategy", "SPREAD",
        "--num-gpus-per-lane", "1",
        "--out", DEFAULT_OUT,
    ]  # fmt: skip


def _has_option(args: Sequence[str], name: str) -> bool:
    return any(a == name or a.startswith(name + "=") for a in args)


def _call_bench(argv: list[str]) -> int:
    """Run ``cpkv bench`` in this process (``cpkv.tools.cli.main``); return its exit status."""
    try:
        from cpkv.tools.cli import main as cli_main
    except ImportError as e:
        print(f"[local-cluster] cpkv.tools.cli is not importable: {e}", file=sys.stderr)
        return 2
    try:
        rc = cli_main(argv)
    except SystemExit as e:  # argparse errors and sys.exit() inside the CLI
        rc = e.code
    if rc is None:
        return 0
    if isinstance(rc, int):
        return rc
    print(f"[local-cluster] cpkv bench: {rc}", file=sys.stderr)
    return 1


def run(
    num_workers: int = 2,
    gpus_per_worker: float = 2,
    bench_args: Sequence[str] = (),
    *,
    cpus_per_worker: float = 2,
    head_cpus: float = 2,
    object_store_mb: int | None = None,
) -> int:
    """Start the local cluster, run ``cpkv bench`` on it in-process, always shut it down.

    Args:
        num_workers: worker nodes besides the head.
        gpus_per_worker: logical GPUs per worker node.
        bench_args: arguments for ``cpkv bench`` (without the word ``bench``); empty
            means :func:`default_bench_args`. ``--address`` is added when missing.
        cpus_per_worker: logical CPUs per worker node.
        head_cpus: logical CPUs of the head node.
        object_store_mb: object store per node; Ray's default when None.

    Returns:
        The bench's exit status (2 when ``cpkv.tools.cli`` cannot be imported).
    """
    args = list(bench_args)
    if args[:1] == ["bench"]:
        args = args[1:]
    if not args:
        args = default_bench_args(num_workers * gpus_per_worker)
    with local_cluster(
        num_workers,
        gpus_per_worker,
        cpus_per_worker=cpus_per_worker,
        head_cpus=head_cpus,
        object_store_mb=object_store_mb,
    ) as cluster:
        if not _has_option(args, "--address"):
            args = [*args, "--address", cluster.address]
        print(f"[local-cluster] cpkv bench {' '.join(args)}", flush=True)
        return _call_bench(["bench", *args])


def probe(
    num_lanes: int = 2,
    strategy: str = "SPREAD",
    *,
    gpus_per_lane: float = 1.0,
    timeout_s: float = 60.0,
) -> list[str]:
    """Place ``num_lanes`` GPU actors with ``strategy`` as cpkv places lanes; return nodes.

    Needs a connected driver (inside :func:`local_cluster`). The actors and the
    placement group are removed before returning.
    """
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    @ray.remote
    class _Where:
        def node(self) -> tuple[str, list]:
            return ray.get_runtime_context().get_node_id(), ray.get_gpu_ids()

    bundle = {"CPU": 0.25, "GPU": gpus_per_lane}
    pg = placement_group([dict(bundle) for _ in range(num_lanes)], strategy=strategy)
    try:
        ray.get(pg.ready(), timeout=timeout_s)
        actors = [
            _Where.options(
                num_cpus=0.25,
                num_gpus=gpus_per_lane,
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    pg, placement_group_bundle_index=i
                ),
            ).remote()
            for i in range(num_lanes)
        ]
        found = ray.get([a.node.remote() for a in actors], timeout=timeout_s)
        for a in actors:
            ray.kill(a)
    finally:
        remove_placement_group(pg)
    for i, (node, gpus) in enumerate(found):
        print(f"[local-cluster] lane {i}: node {node[:16]} gpu_ids={gpus}", flush=True)
    nodes = [node for node, _ in found]
    print(f"[local-cluster] {strategy}: {len(set(nodes))} distinct node(s)", flush=True)
    return nodes


def _int_at_least(low: int):
    """An argparse type: an int ``>= low``, as :func:`start_cluster` asks (0 worker nodes
    failed there, after the arguments, with a traceback)."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"{value} must be >= {low}")
        return value

    return parse


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="local-cluster.py",
        description="Start a multi-node Ray on 127.0.0.1 and run `cpkv bench` against it; "
        "unknown arguments (or those after --) go to cpkv bench.",
        allow_abbrev=False,  # never swallow a bench option by prefix
    )
    positive, count = _int_at_least(1), _int_at_least(0)
    p.add_argument("--workers", type=positive, default=2, help="worker nodes (default 2)")
    p.add_argument("--gpus-per-worker", type=positive, default=2, help="logical GPUs (default 2)")
    p.add_argument("--cpus-per-worker", type=positive, default=2, help="logical CPUs (default 2)")
    p.add_argument("--head-cpus", type=count, default=2, help="head CPUs, no GPUs (default 2)")
    p.add_argument("--object-store-mb", type=int, default=None, help="object store per node")
    p.add_argument(
        "--probe",
        action="store_true",
        help="no bench: place one lane-like actor per GPU with SPREAD, print their nodes",
    )
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Command line: ``python cluster/local-cluster.py [options] [--] [bench args]``."""
    opts, rest = _parser().parse_known_args(argv)
    if rest[:1] == ["--"]:
        rest = rest[1:]
    if opts.probe:
        with local_cluster(
            opts.workers,
            opts.gpus_per_worker,
            cpus_per_worker=opts.cpus_per_worker,
            head_cpus=opts.head_cpus,
            object_store_mb=opts.object_store_mb,
        ):
            per_lane = min(1.0, opts.gpus_per_worker)
            lanes = opts.workers * int(opts.gpus_per_worker / per_lane)
            nodes = probe(lanes, "SPREAD", gpus_per_lane=per_lane)
        return 0 if len(set(nodes)) == min(lanes, opts.workers) else 1
    return run(
        opts.workers,
        opts.gpus_per_worker,
        rest,
        cpus_per_worker=opts.cpus_per_worker,
        head_cpus=opts.head_cpus,
        object_store_mb=opts.object_store_mb,
    )


if __name__ == "__main__":
    sys.exit(main())
