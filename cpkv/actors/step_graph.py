"""StepGraph: a client's steps to the coordinator through a Ray compiled graph of its own.

An ordinary actor call costs a Ray round of scheduling and an object-store read of the
answer; a compiled graph's call is a write and a read of shared-memory channels. With the
coordinator's own steps to the lanes compiled too (``compiled_steps``), the coordinator
runs a client's step inside the client's graph node. Measured on the 2-core machine
(``docs/bench-cpu/2026-12-05-step-graph``): 0.44 ms for a short answer and 0.83 ms with a
513 KB logits row, against 1.07 and 3.18 ms as an ordinary call over the same lanes' graph.

The graph is only a faster road to the same call: every step keeps its call id, so when
the graph cannot take it (another thread's step holds it, the coordinator grants no slot,
the graph broke or is being torn down) the client sends it as an ordinary call, which the
coordinator answers once whichever road it came by (it remembers answers by call id).

NOTE: one step at a time is in the graph (a lock over execute and read): its answers are
read in order, and a step that timed out leaves nothing behind for the next to read (the
graph is abandoned: torn down in the background and built again at a later step).

NOTE: the coordinator's loop of a graph waits for the next step by polling (Ray 2.60's
channel read spins on ``sched_yield``: 97% of a core, measured idle on the 2-core machine),
so a graph no step used for :data:`IDLE_TEARDOWN_S` is torn down (its slot kept) and the
next step builds it again (0.15-0.5 s on the 2-core machine).
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import threading
import time
import weakref
from typing import Any

from cpkv.actors.graphs import IDLE_TEARDOWN_S, compile_unowned, teardown_quietly
from cpkv.actors.wire import pack, unpack

__all__ = ["GraphUnavailable", "StepGraph"]

logger = logging.getLogger("cpkv.actors.step_graph")

# After a build failed or a slot was refused, ordinary calls for this long before trying
# again (a claim is one ordinary round; a build ~0.2 s on the 2-core machine).
_RETRY_S = 5.0


class GraphUnavailable(Exception):
    """The graph did not take the step: send it as an ordinary call (same call id)."""


class StepGraph:
    """Runs a client's steps through one compiled graph to the coordinator's ``run_step``.

    Args:
        coordinator: the coordinator actor handle.
        client_id: the client (its slot at the coordinator is claimed under this id).
        build_timeout_s: how long a build's first run may take (the coordinator's loop
            starting).
    """

    def __init__(
        self,
        coordinator: Any,
        client_id: str,
        build_timeout_s: float = 60.0,
        idle_s: float = IDLE_TEARDOWN_S,
    ) -> None:
        self._coord = coordinator
        self._client_id = client_id
        self._build_timeout_s = build_timeout_s
        self.idle_s = idle_s
        self._lock = threading.Lock()
        self._graph = None
        self._claimed = False
        self._closed = False
        self._retry_at = 0.0
        self._last_step = time.monotonic()
        self._teardown_thread: threading.Thread | None = None
        self._wake = threading.Event()
        self.num_builds = 0
        self.num_steps = 0
        self.num_fallbacks = 0
        self.num_idle_teardowns = 0
        # NOTE: registered after ray.init, so it runs before Ray's own exit handler.
        self_ref = weakref.ref(self)
        self._at_exit = lambda: (g := self_ref()) is not None and g.close(timeout_s=10.0)
        atexit.register(self._at_exit)
        threading.Thread(
            target=_watch_idle, args=(self_ref, self._wake), daemon=True, name="cpkv-step-graph"
        ).start()

    def run(self, call: tuple, timeout_s: float) -> Any:
        """The coordinator's answer to ``call``: ``(method, epoch, client_id, call_id, *args)``.

        Raises:
            GraphUnavailable: the graph did not take the step (send it as an ordinary call).
            TimeoutError: no answer within ``timeout_s`` (the step may have run; the graph
                is abandoned).
        """
        try:
            return self._run(call, timeout_s)
        except GraphUnavailable:
            self.num_fallbacks += 1
            raise

    def _run(self, call: tuple, timeout_s: float) -> Any:
        if not self._lock.acquire(blocking=False):
            raise GraphUnavailable("another step is in the graph")
        try:
            graph = self._ready()
            try:
                out = unpack(graph.execute(pack(call)).get(timeout=timeout_s))
            except Exception as e:
                self._abandon()
                # Ray's channel and get timeouts are TimeoutErrors.
                if isinstance(e, TimeoutError):
                    raise TimeoutError(f"no answer through the step graph in {timeout_s}s") from e
                raise GraphUnavailable(f"{type(e).__name__}: {str(e)[:200]}") from e
            self.num_steps += 1
            self._last_step = time.monotonic()
            return out
        finally:
            self._lock.release()

    def close(self, timeout_s: float = 60.0) -> None:
        """Tear the graph down and give the slot back (the client's shutdown)."""
        if not self._lock.acquire(timeout=timeout_s):
            logger.warning("step graph: a step still holds it after %.0fs; left", timeout_s)
            return
        try:
            if self._closed:
                return
            self._closed = True
            self._wake.set()
            atexit.unregister(self._at_exit)
            graph, self._graph = self._graph, None
            teardown_quietly(graph)
            if self._teardown_thread is not None:
                self._teardown_thread.join(timeout_s)
            if self._teardown_thread is None or not self._teardown_thread.is_alive():
                # A slot whose loop is still stuck stays taken (its lease gives it up).
                self._release_slot()
        finally:
            self._lock.release()

    def tear_down_if_idle(self) -> float:
        """Tear the graph down if no step used it for ``idle_s``; the seconds until it may
        be idle next."""
        if not self._lock.acquire(blocking=False):  # a step is in it
            return self.idle_s
        try:
            if self._graph is None:
                return self.idle_s
            left = self._last_step + self.idle_s - time.monotonic()
            if left > 0:
                return left
            graph, self._graph = self._graph, None
            teardown_quietly(graph)
            self.num_idle_teardowns += 1
            logger.info("step graph: idle for %.0fs; torn down", self.idle_s)
            # NOTE: its loop ended: the slot goes back (the next build claims one again), or
            # a client that dies idle would take it with it, counted lost for good. Given
            # back under the lock: a build meanwhile would claim first, and this release
            # then free the slot its new graph holds (a step falls back to a plain call).
            self._release_slot()
            return self.idle_s
        finally:
            self._lock.release()

    def __del__(self) -> None:
        # A client dropped without shutdown(): tear down and give the slot back without
        # waiting for an answer (a collector's thread must not block on Ray).
        if self._closed:
            return
        atexit.unregister(self._at_exit)  # or a long-lived process keeps one a dropped client
        graph, self._graph = self._graph, None
        teardown_quietly(graph)
        if self._claimed:
            with contextlib.suppress(Exception):  # Ray is gone already
                self._coord.release_step_graph.remote(self._client_id)

    # ------------------------------------------------------------- internals
    def _ready(self) -> Any:
        """The graph, built first if need be (lock held); GraphUnavailable if it cannot be."""
        if self._graph is not None:
            return self._graph
        if self._closed:
            raise GraphUnavailable("closed")
        if self._teardown_thread is not None:
            if self._teardown_thread.is_alive():
                raise GraphUnavailable("the last graph is still being torn down")
            self._teardown_thread = None
        if time.monotonic() < self._retry_at:
            raise GraphUnavailable("waiting to try again")
        try:
            self._build()
        except Exception as e:
            self._retry_at = time.monotonic() + _RETRY_S
            if not isinstance(e, GraphUnavailable):
                logger.warning("step graph: build failed (%s: %s)", type(e).__name__, e)
            raise GraphUnavailable(f"not built: {e}") from e
        return self._graph

    def _build(self) -> None:
        import ray
        from ray.dag import InputNode

        # Claimed at every build (a claim the client holds is granted again): a restarted
        # coordinator knows no claims.
        self._claimed = bool(
            ray.get(
                self._coord.claim_step_graph.remote(self._client_id),
                timeout=self._build_timeout_s,
            )
        )
        if not self._claimed:
            raise GraphUnavailable("the coordinator has no free graph slot")
        t0 = time.perf_counter()
        graph = None
        try:
            with InputNode() as call:
                node = self._coord.run_step.bind(call)
            graph = compile_unowned(node)
            # The first run waits for the coordinator's loop to start: done here, not in a step.
            graph.execute(pack(("ping",))).get(timeout=self._build_timeout_s)
        except BaseException:
            teardown_quietly(graph)
            # NOTE: no loop holds the slot now: it goes back, or a client that dies before
            # its next build would take it with it (counted lost for good).
            self._release_slot()
            raise
        self._graph = graph
        self._last_step = time.monotonic()
        self.num_builds += 1
        logger.info("step graph: built in %.2fs", time.perf_counter() - t0)

    def _abandon(self) -> None:
        """Tear the graph down in the background (its loop may still be inside a step for a
        while); a later step builds a new one once that is done."""
        graph, self._graph = self._graph, None
        if graph is None:
            return
        self._teardown_thread = threading.Thread(
            target=self._tear_down_and_release,
            args=(graph,),
            daemon=True,
            name="cpkv-step-graph-teardown",
        )
        self._teardown_thread.start()

    def _tear_down_and_release(self, graph: Any) -> None:
        """An abandoned graph's teardown, then its slot given back (no build claims another
        while this thread lives)."""
        teardown_quietly(graph)
        self._release_slot()

    def _release_slot(self) -> None:
        """Give the coordinator's graph slot back, if this client holds one (its loop ended)."""
        if self._claimed:
            self._claimed = False
            self._quiet_call("release_step_graph")

    def _quiet_call(self, method: str) -> None:
        import ray

        try:
            ray.get(getattr(self._coord, method).remote(self._client_id), timeout=10)
        except Exception as e:  # the coordinator is gone: so is the slot
            logger.debug("step graph: %s: %s", method, e)


def _watch_idle(graph_ref: weakref.ref, wake: threading.Event) -> None:
    """Tear the graph down whenever it has been idle (holds only a weak reference: a
    dropped client's graph ends this thread)."""
    wait_s = 1.0
    while not wake.wait(wait_s):
        graph = graph_ref()
        if graph is None:
            return
        wait_s = graph.tear_down_if_idle()
        del graph
