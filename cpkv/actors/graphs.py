"""Compiling a Ray graph that this process, not Ray's shutdown, tears down.

Ray keeps every graph a process compiles in a registry, and its shutdown (``ray.shutdown``,
or the exit of a driver that did not call it) tears each one down with ``kill_actors=True``:
every actor in the graph is killed, without a restart. Measured: a client process that
exited with a live graph to a detached coordinator killed the coordinator. cpkv's graphs
run on actors other clients share, so they are left out of that registry, and their owners
tear them down themselves (``teardown()`` without killing, at ``close``, at exit, or when
the graph is collected).
"""

from __future__ import annotations

import logging
from typing import Any

__all__ = [
    "IDLE_TEARDOWN_S",
    "READ_ITERATION_S",
    "compile_unowned",
    "read_ready_outputs_first",
    "teardown_quietly",
]

logger = logging.getLogger("cpkv.actors.graphs")

# Seconds without a step before cpkv tears a graph down. A graph's reader waits for its next
# input by polling (Ray 2.60's channel read spins on sched_yield): measured idle on the
# 2-core machine, a lane's graph loop and the coordinator's loop of a client's graph each
# used 97% of a core. A rebuild costs the next step 0.15-0.5 s (a client's graph, 2-core
# machine), so a job that steps steadily keeps its graphs and an idle pool stops spinning.
IDLE_TEARDOWN_S = 10.0

# Seconds a graph's reader waits on one output before it moves to the next (Ray's
# ``read_iteration_timeout``, 0.1 s by default). Ray 2.60 reads a round's outputs in order,
# waiting on each in turn up to this long: with its default, a lane still computing holds up
# the reads of the lanes after it, which answered long before and are then read only after
# it. With this, those are read while it computes and only its own read is left. Measured on
# the 2-core machine (``benchmarks/bench_compiled_graph.py``, the first of 4 actors 4 ms
# late): 0.52-0.74 ms from its answer to the round's against 0.33-0.34 ms. Each wait that
# times out costs the reader an exception (~10 us) while it polls, which it did anyway.
READ_ITERATION_S = 0.00025


def compile_unowned(node: Any, **options: Any) -> Any:
    """``node.experimental_compile(**options)``, kept out of Ray's shutdown (which would kill
    the graph's actors)."""
    from ray.dag import compiled_dag_node

    graph = node.experimental_compile(**options)
    compiled_dag_node._compiled_dags.pop(graph.get_id(), None)
    return graph


def read_ready_outputs_first() -> None:
    """Make this process's compiled-graph reads take the outputs that are ready while another
    is not (:data:`READ_ITERATION_S`). NOTE: process-wide (Ray's ``DAGContext``): the
    coordinator's, which reads every lane's answer to a step."""
    from ray.dag import DAGContext

    ctx = DAGContext.get_current()
    ctx.read_iteration_timeout = min(ctx.read_iteration_timeout, READ_ITERATION_S)


def teardown_quietly(graph: Any) -> None:
    """Tear ``graph`` down (its actors live on); a dead actor's loop is gone already."""
    if graph is None:
        return
    try:
        graph.teardown()
    except Exception as e:
        logger.debug("graph teardown: %s: %s", type(e).__name__, e)
