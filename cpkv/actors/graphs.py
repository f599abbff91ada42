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

__all__ = ["IDLE_TEARDOWN_S", "compile_unowned", "teardown_quietly"]

logger = logging.getLogger("cpkv.actors.graphs")

# Seconds without a step before cpkv tears a graph down. A graph's reader waits for its next
# input by polling (Ray 2.60's channel read spins on sched_yield): measured idle on the
# 2-core machine, a lane's graph loop and the coordinator's loop of a client's graph each
# used 97% of a core. A rebuild costs the next step 0.15-0.5 s (a client's graph, 2-core
# machine), so a job that steps steadily keeps its graphs and an idle pool stops spinning.
IDLE_TEARDOWN_S = 10.0


def compile_unowned(node: Any, **options: Any) -> Any:
    """``node.experimental_compile(**options)``, kept out of Ray's shutdown (which would kill
    the graph's actors)."""
    from ray.dag import compiled_dag_node

    graph = node.experimental_compile(**options)
    compiled_dag_node._compiled_dags.pop(graph.get_id(), None)
    return graph


def teardown_quietly(graph: Any) -> None:
    """Tear ``graph`` down (its actors live on); a dead actor's loop is gone already."""
    if graph is None:
        return
    try:
        graph.teardown()
    except Exception as e:
        logger.debug("graph teardown: %s: %s", type(e).__name__, e)
