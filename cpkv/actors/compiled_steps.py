"""CompiledSteps: every lane's step through one Ray Compiled Graph instead of one actor call each.

A compiled graph's lanes read their input from shared-memory channels that a loop on each
lane waits on, so a step reaches the lanes without Ray's per-call scheduling (measured on the
2-core machine, ``benchmarks/bench_compiled_graph.py``: a round to 4 actors 0.38-0.51 ms
against 2.4 ms as ordinary calls). Only the process that runs a graph reads its results, so
the lanes' answers come back through the coordinator as values (:class:`LaneReply`).

A step is written to the graph by the thread that queues it (the coordinator's, under its
lock, so steps are written in the order they were decided), at once: the lanes start while
the coordinator finishes its bookkeeping (measured on the H100 box: that thread hop, to a
thread that got the GIL only once the caller blocked, cost 0.07-0.16 ms a step). One
thread reads the answers, in order, and owns the graph's life: it builds the graph (again
after a lane died, which ends a graph's run, or after it was idle), and while it is not
built, or steps queued before are not yet written, it writes the queued steps itself.

NOTE: Ray's compiled graph is not documented as thread-safe; here one thread at a time
writes (``_write_lock``) and one other reads. Checked against Ray 2.60's
``CompiledDAG.execute`` / ``CompiledDAGRef.get``: they share the execution counters and the
result buffers, which ``execute`` (``_try_release_buffers``) changes only for results whose
refs were dropped unread; every ref here is read before it is dropped, so ``execute`` only
reads them. A write that fails for want of room (``RayCgraphCapacityExceeded``, raised
before anything is written) leaves the step to the graph thread; any other failed write may
have reached some lanes only, so the graph is torn down and the step fails.

NOTE: Ray reads a round's answers lane by lane, waiting on each up to its read iteration
(0.1 s) before it tries the next, so the lanes that answered while one still computes are
read after it. Lowering that wait (a process-wide setting) to 0.25 ms in the coordinator
read them meanwhile (a round whose first of 4 actors was 4 ms late: 0.26-0.29 -> 0.16 ms after
its answer, H100 box) but gained nothing through the API and made every graph loop in the
coordinator's process raise a timeout each 0.25 ms while it waits: its ordinary calls went
from 0.88-0.94 to 1.45-2.05 ms (docs/BENCHMARKS.md, 2026-12-07 (6)). Not kept.

NOTE: a graph's reader waits for its next input by polling (Ray 2.60's channel read spins
on ``sched_yield``): measured on the 2-core machine, an idle lane's graph loop used 97% of a
core. So a graph no step used for :data:`IDLE_TEARDOWN_S` is torn down, and the next step
builds it again (under a second once the lanes have run a graph before); a pool that steps
steadily keeps its graph.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from concurrent.futures import Future

import ray
from ray.dag import InputNode, MultiOutputNode
from ray.exceptions import RayCgraphCapacityExceeded, RayChannelError

from cpkv.actors.graphs import IDLE_TEARDOWN_S, compile_unowned, teardown_quietly
from cpkv.actors.wire import pack, unpack
from cpkv.coordinator.channel import LaneDeadError, StepAborted, StepNotSent
from cpkv.core.steps import LaneReply, StepPacket
from cpkv.lane_io import actor_death

__all__ = ["CompiledSteps"]

logger = logging.getLogger("cpkv.actors.compiled_steps")

_STOP = object()
_RETIRE = "retire"  # (_RETIRE, graph): a graph to a lane that was lost, torn down in order
# NOTE: a graph's read waits Ray's default of 10 s (RAY_CGRAPH_get_timeout) unless told:
# a longer step would break the graph. A hung lane is the supervisor's to kill instead.
_NO_TIMEOUT_S = 7 * 24 * 3600.0
_BUILD = object()
# How long a lane may take to answer the ping that tells a dead lane from a live one after a
# break that names no actor (a live lane answers in milliseconds once the graph is down).
_PROBE_S = 5.0


class _NotWritten(Exception):
    """A queued step's graph could not be built: no lane got the step."""


class _WriteFailed:
    """A step whose write to the graph failed midway (queued for the graph thread to fail
    and to tear the graph down)."""

    __slots__ = ("error",)

    def __init__(self, error: BaseException) -> None:
        self.error = error


class CompiledSteps:
    """Runs steps on every lane through one compiled graph, rebuilt when it breaks.

    Args:
        lanes: the lane actor handles, in rank order.
        build_timeout_s: how long a build's first run may take (a lane's loop starting:
            ~5 s on the 2-core machine the first time, under 1 s after).
    """

    def __init__(
        self, lanes: list, build_timeout_s: float = 120.0, idle_s: float = IDLE_TEARDOWN_S
    ) -> None:
        self._lanes = list(lanes)
        self._epoch = ""
        self._build_timeout_s = build_timeout_s
        self._idle_s = idle_s
        self._graph = None
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        # Held while a step is written and while the graph is swapped in or out.
        self._write_lock = threading.Lock()
        self._num_unwritten = 0  # queued steps the graph thread must write (in order)
        self._closed = False
        self.num_builds = 0
        self.num_runs = 0
        self.num_breaks = 0  # runs the graph could not answer (a lane died, a build failed)
        self.num_idle_teardowns = 0
        self._thread = threading.Thread(target=self._loop, daemon=True, name="cpkv-graph")
        self._thread.start()

    def start(self, epoch: str) -> None:
        """Build the graph now, in the graph thread, so the first step does not wait for it;
        the lanes record ``epoch`` (the coordinator's) as whose graph they serve."""
        self._epoch = epoch
        self._queue.put(_BUILD)

    def execute(self, packet: StepPacket) -> Future:
        """Send ``packet`` to every lane: written to the graph now when it is built and no
        step queued before is still unwritten, else queued for the graph thread to write.
        Callers keep the order of their calls (the coordinator calls under its lock).

        Returns:
            A future of every lane's :class:`LaneReply`, in rank order (never an exception:
            a broken graph answers :class:`LaneDeadError` for the lane that died and
            :class:`StepAborted` for the others).
        """
        future: Future = Future()
        with self._write_lock:
            closed = self._closed
            if not closed:
                graph, refs = self._graph, None
                if graph is not None and self._num_unwritten == 0:
                    try:
                        refs = self._write(packet)
                    except RayCgraphCapacityExceeded:  # nothing was written: the thread will
                        pass
                    except Exception as e:
                        refs = _WriteFailed(e)
                if refs is None or isinstance(refs, _WriteFailed):
                    self._num_unwritten += 1  # every step behind it waits for the thread
                self._queue.put((packet, future, refs, graph))
        if closed:
            _abort(future, len(self._lanes), "the coordinator's lanes graph is closed")
        return future

    def lane_reset(self, lane: int) -> None:
        """``lane`` was lost and is being reset: no step is written to the graph from here
        on, and the next step builds another from the live lanes. The old graph is torn down
        after the steps written to it are read (Ray's monitor may have torn it down already:
        a write to it raised a closed channel, and the lanes' moves riding in it were lost).
        """
        with self._write_lock:
            graph, self._graph = self._graph, None
            if graph is not None:
                self._queue.put((_RETIRE, graph))

    def close(self) -> None:
        """Tear the graph down after the steps queued before; steps sent later are aborted."""
        with self._write_lock:
            self._closed = True
            self._queue.put(_STOP)

    # ------------------------------------------------------------ graph thread
    def _loop(self) -> None:
        while True:
            try:
                item = self._queue.get(timeout=self._idle_s if self._graph is not None else None)
            except queue.Empty:  # idle: stop the lanes' loops spinning until the next step
                if self._teardown(only_if_idle=True):
                    self.num_idle_teardowns += 1
                    logger.info("compiled steps: idle for %.0fs; graph torn down", self._idle_s)
                continue
            if item is _STOP:
                self._teardown()
                while not self._queue.empty():  # sent after close(): answered, never run
                    item = self._queue.get()
                    if isinstance(item, tuple) and item[0] is _RETIRE:
                        teardown_quietly(item[1])
                    elif isinstance(item, tuple):
                        _abort(item[1], len(self._lanes), "the coordinator's lanes graph is closed")
                return
            if item is _BUILD:
                if self._graph is None:
                    self._try_build()
                continue
            if item[0] is _RETIRE:
                teardown_quietly(item[1])
                continue
            packet, future, refs, graph = item
            future.set_result(self._run(packet, refs, graph))

    def _write(self, packet: StepPacket) -> list:
        """Write ``packet`` to the graph (write lock held); its answers' refs.

        Raises:
            _NotWritten: no lane reads it: the graph was retired by a lane reset, or Ray tore
                it down with a dead lane (a closed channel).
        """
        if self._graph is None:
            raise _NotWritten("the lanes' graph was retired (a lane reset) before the write")
        try:
            return self._graph.execute(pack(packet))
        except RayChannelError as e:
            raise _NotWritten(f"{type(e).__name__}: {e}") from e

    def _write_queued(self, packet: StepPacket) -> tuple[list, object]:
        """Write a step that was queued unwritten, building the graph first if need be
        (outside the write lock: meanwhile steps queue unwritten behind this one).

        Returns:
            The answers' refs and the graph written to.
        """
        try:
            if self._graph is None:
                self._build()
        except BaseException as e:
            self._drop_unwritten()
            if isinstance(e, Exception):
                raise _NotWritten(f"{type(e).__name__}: {e}") from e
            raise
        with self._write_lock:
            self._num_unwritten -= 1  # written or failed: either way no longer pending
            return self._write(packet), self._graph

    def _drop_unwritten(self) -> None:
        """One queued step is no longer waiting to be written (it failed first)."""
        with self._write_lock:
            self._num_unwritten -= 1

    def _run(
        self, packet: StepPacket, refs: list | _WriteFailed | None, graph: object
    ) -> list[LaneReply]:
        """The lanes' answers to a step: ``refs`` of the ``graph`` it was written to, or
        ``None`` (not written yet) or :class:`_WriteFailed`."""
        try:
            if isinstance(refs, _WriteFailed):
                self._drop_unwritten()
                raise refs.error  # a _NotWritten one reached no lane
            if refs is None:
                graph = self._graph  # what a failed build or write below tears down
                refs, graph = self._write_queued(packet)
            # NOTE: packed both ways (cpkv.actors.wire): an unpacked reply owns its arrays.
            # One read from a channel may stay a view of its shared buffer, which the lanes
            # then cannot write again while an answer is remembered (seen: the eleventh step
            # hung, with the graph's ten buffers held).
            replies = [unpack(r) for r in ray.get(refs, timeout=_NO_TIMEOUT_S)]
        except Exception as e:  # the graph broke (a lane died) or could not be built
            logger.warning("compiled steps: %s: %s; rebuilt at the next step", type(e).__name__, e)
            self.num_breaks += 1
            self._teardown(graph)
            # A step no lane got says so: the moves riding in it go again (LaneChannel).
            aborted = StepNotSent if isinstance(e, _NotWritten) else StepAborted
            cause = e.__cause__ if isinstance(e, _NotWritten) and e.__cause__ else e
            dead = self._lane_of(cause)
            dead_lanes = {dead} if dead is not None else self._dead_lanes()
            detail = f"{type(cause).__name__}: {str(cause)[:300]}"
            if not dead_lanes:  # every lane answers: the step is lost, no lane with it
                why = f"the step's graph broke with every lane alive: {detail}"
                return [LaneReply(error=aborted(why)) for _ in self._lanes]
            named = ", ".join(map(str, sorted(dead_lanes)))
            return [
                LaneReply(error=LaneDeadError(detail))
                if r in dead_lanes
                else LaneReply(error=aborted(f"lane {named} died: {detail}"))
                for r in range(len(self._lanes))
            ]
        self.num_runs += 1
        return list(replies)

    def _try_build(self) -> None:
        try:
            self._build()
        except Exception as e:
            logger.warning("compiled steps: build failed (%s: %s)", type(e).__name__, e)
            self._teardown()

    def _build(self) -> None:
        t0 = time.perf_counter()
        with InputNode() as packet:
            out = MultiOutputNode([lane.compiled_step_packed.bind(packet) for lane in self._lanes])
        graph = compile_unowned(out)
        try:
            # The first run waits for every lane's loop to start: done here, not in a step.
            ray.get(
                graph.execute(pack(StepPacket(None, epoch=self._epoch))),
                timeout=self._build_timeout_s,
            )
        except BaseException:
            teardown_quietly(graph)
            raise
        with self._write_lock:  # callers write to it from now on
            self._graph = graph
        self.num_builds += 1
        logger.info(
            "compiled steps: graph %d built in %.2fs", self.num_builds, time.perf_counter() - t0
        )

    def _teardown(self, graph: object = None, only_if_idle: bool = False) -> bool:
        """Tear ``graph`` down (default: the current one; no step is written to it from here
        on); with ``only_if_idle``, only when no step was queued meanwhile. Whether it was."""
        with self._write_lock:
            if only_if_idle and not self._queue.empty():
                return False
            if graph is None or graph is self._graph:
                graph, self._graph = self._graph, None
        teardown_quietly(graph)  # a graph replaced already was torn down then: no-op
        return graph is not None

    def _dead_lanes(self) -> set[int]:
        """The lanes that a ping finds dead (after a break whose error named no actor, e.g. a
        closed channel). A lane that does not answer in time is alive as far as this can
        tell: the supervisor's hang check is the judge of that."""
        refs = [lane.ping.remote() for lane in self._lanes]
        # One wait for them all (a lane at a time would cost cp x _PROBE_S with hung lanes).
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=_PROBE_S)
        answered = set(ready)
        dead = set()
        for r, ref in enumerate(refs):
            if ref not in answered:  # slow or hung: not known dead
                continue
            try:
                ray.get(ref, timeout=0)
            except actor_death(ray):
                dead.add(r)
            except Exception as e:
                logger.debug("compiled steps: lane %d probe: %s: %s", r, type(e).__name__, e)
        return dead

    def _lane_of(self, error: BaseException) -> int | None:
        """The rank of the lane whose death ``error`` reports, when it says."""
        actor_id = getattr(error, "actor_id", None)
        if actor_id is None:
            return None
        if isinstance(actor_id, bytes):
            actor_id = actor_id.hex()
        for r, lane in enumerate(self._lanes):
            if lane._actor_id.hex() == actor_id:
                return r
        return None


def _abort(future: Future, num_lanes: int, why: str) -> None:
    future.set_result([LaneReply(error=StepAborted(why)) for _ in range(num_lanes)])
