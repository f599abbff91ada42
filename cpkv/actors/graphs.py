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

__all__ = ["compile_unowned", "teardown_quietly"]

logger = logging.getLogger("cpkv.actors.graphs")


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
