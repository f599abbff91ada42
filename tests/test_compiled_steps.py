"""Steps through one Ray compiled graph (``connect(compiled_steps=True)``).

Without Ray: the channel's packet (each lane's riding moves and fence), the lanes' answers as
values, a lane that waits for the moves its fence names, and who writes a step to the graph
(the sender, or the graph thread while it builds). Through Ray: a compiled pool
answers as an ordinary one, its graph is rebuilt after a lane dies, and a restarted
coordinator's graph starts on the lanes the old one left.
"""

from __future__ import annotations

import threading
import time
import types
from concurrent.futures import Future
from typing import Any

import numpy as np
import pytest

from cpkv.coordinator.channel import MAX_WAITING_MOVES, LaneChannel, StepAborted
from cpkv.core.config import KVShape
from cpkv.core.moves import MovesNotApplied
from cpkv.core.steps import LaneReply, StepPacket

I32 = np.int32


class CompiledTransport:
    """Ordinary calls settle at once; steps are packets the test answers per lane."""

    def __init__(self) -> None:
        self.calls: list[tuple[int, str, tuple]] = []
        self.packets: list[tuple[StepPacket, Future]] = []
        self.resets: list[int] = []

    def submit(self, lane: int, method: str, *args: Any) -> Future:
        self.calls.append((lane, method, args))
        future: Future = Future()
        future.set_result(None)
        return future

    def result(self, handle: Future, timeout: float) -> Any:
        return handle.result(timeout=timeout)

    def done(self, handles: list[Future]) -> list[bool]:
        return [h.done() for h in handles]

    def execute_steps(self, packet: StepPacket) -> Future:
        future: Future = Future()
        self.packets.append((packet, future))
        return future

    def lane_reset(self, lane: int) -> None:
        self.resets.append(lane)


@pytest.fixture
def compiled():
    transport = CompiledTransport()
    # No timer flush here: moves wait for a step or flush() (the timer has its own test).
    ch = LaneChannel(transport, cp_size=2, epoch="e", flush_after_s=60.0)
    for lane in range(2):
        ch.new_generation(lane)
    yield ch, transport
    ch.close()


def test_a_compiled_step_carries_each_lanes_moves_and_fence(compiled):
    ch, transport = compiled
    assert ch.compiled
    ch.send_moves(0, np.array([1, 2], I32), np.empty(0, I32), "alloc")  # seq 1
    ch.send_moves(1, np.array([3], I32), np.empty(0, I32), "alloc")
    ch.send_moves(1, np.array([4], I32), np.empty(0, I32), "alloc")  # lane 1 at seq 2
    ch.flush()  # one apply_moves call a lane
    ch.send_moves(0, np.array([5], I32), np.empty(0, I32), "prefill")  # seq 2, waits
    futures = ch.submit_steps("step")
    ((packet, replies),) = transport.packets
    gen0, gen1 = ch.generation(0), ch.generation(1)
    # Lane 0 waits for its apply (seq 1) and applies the riding move itself; lane 1 waits for
    # both of its moves, sent in one call.
    assert packet.fences == ((gen0, 1), (gen1, 2))
    assert [m[:2] for m in packet.moves[0]] == [(gen0, 2)] and packet.moves[1] is None
    assert packet.step == "step" and packet.epoch == "e"
    assert not futures[0].done()
    replies.set_result([LaneReply(({"lane": r}, f"result {r}")) for r in range(2)])
    assert futures[0].done() and futures[1].exception() is None
    status, result = futures[0].result(timeout=5)
    assert ch.outcome(status, 0) == {"lane": 0} and ch.outcome(result, 0) == "result 0"
    assert ch.done([status, result]) == [True, True]
    deadline = time.monotonic() + 5
    while len(transport.calls) < 2:  # the sender submits the two apply_moves calls
        assert time.monotonic() < deadline
        time.sleep(0.001)
    assert [c[1] for c in transport.calls] == ["apply_moves", "apply_moves"]
    while ch.num_pending:  # every move answered, the riding one by its step's status
        assert ch.poll() == [] and time.monotonic() < deadline
        time.sleep(0.001)


def _wait_calls(transport: CompiledTransport, n: int) -> None:
    deadline = time.monotonic() + 5
    while len(transport.calls) < n:
        assert time.monotonic() < deadline, transport.calls
        time.sleep(0.001)


def test_moves_decided_after_a_compiled_step_go_only_once_it_is_answered(compiled):
    """Sent on their own at once, they could reach a lane before the step (which does not
    travel behind ordinary calls): a gap in the step's own moves, or the step writing pages
    freed after it was decided."""
    ch, transport = compiled
    ch.send_moves(0, np.array([1], I32), np.empty(0, I32), "prefill")  # rides in the step
    ch.submit_steps("step 1")
    ch.send_moves(0, np.empty(0, I32), np.array([1], I32), "free")  # decided after it
    ch.flush()  # a client's write asks for its moves: held back while the step runs
    for _ in range(MAX_WAITING_MOVES):  # however many pile up
        ch.send_moves(1, np.array([2], I32), np.empty(0, I32), "alloc")
    time.sleep(0.05)
    assert transport.calls == [] and ch.num_waiting_moves == MAX_WAITING_MOVES + 1
    ((_, replies),) = transport.packets
    replies.set_result([LaneReply(({}, None))] * 2)
    _wait_calls(transport, 2)  # then at once, one call a lane
    assert [(c[0], c[1]) for c in transport.calls] == [(0, "apply_moves"), (1, "apply_moves")]
    assert [m[1] for m in transport.calls[0][2][0]] == [2]  # lane 0's seq 2: after the step
    assert ch.num_waiting_moves == 0


def test_a_step_that_could_not_be_sent_gives_its_moves_back(compiled):
    """Taken to ride in it, they would wait for an answer that never comes (and the lane's
    next fence for moves that never left)."""
    ch, transport = compiled
    ch.send_moves(0, np.array([1], I32), np.empty(0, I32), "prefill")  # seq 1, to ride

    def refuse(packet: StepPacket) -> Future:
        ch.send_moves(0, np.array([2], I32), np.empty(0, I32), "alloc")  # seq 2, meanwhile
        raise MemoryError("no room for the packet")

    transport.execute_steps = refuse
    with pytest.raises(MemoryError):
        ch.submit_steps("step")
    _wait_calls(transport, 1)  # both go, in their order, as one call
    assert [(c[0], c[1]) for c in transport.calls] == [(0, "apply_moves")]
    assert [m[1] for m in transport.calls[0][2][0]] == [1, 2]
    deadline = time.monotonic() + 5
    while ch.num_pending:  # answered as ordinary calls: nothing waits for the step
        assert ch.poll() == [] and time.monotonic() < deadline
        time.sleep(0.001)
    assert ch.num_riding_moves == 0 and ch.num_waiting_moves == 0


def test_the_moves_of_a_step_that_reached_no_lane_go_again_before_those_decided_later(compiled):
    """A step whose graph could not be built (StepNotSent) took its lanes' moves to ride in
    it: no lane saw them, and every later fence names them. They go at once as ordinary
    calls, ahead of the moves held back behind the next step (which waits for them at the
    lane); a step that broke after it was written (StepAborted) sends nothing again."""
    from cpkv.coordinator.channel import StepNotSent

    ch, transport = compiled
    ch.send_moves(0, np.array([1], I32), np.empty(0, I32), "prefill")  # seq 1, rides in 1
    ch.send_moves(1, np.array([2], I32), np.empty(0, I32), "prefill")  # seq 1, rides in 1
    first = ch.submit_steps("step 1")
    ch.send_moves(0, np.array([3], I32), np.empty(0, I32), "prefill")  # seq 2, rides in 2
    ch.submit_steps("step 2")
    ch.send_moves(0, np.empty(0, I32), np.array([3], I32), "free")  # seq 3, held back
    ch.flush()
    (packet1, replies1), (packet2, replies2) = transport.packets
    assert packet2.fences[0] == (ch.generation(0), 1)  # step 2 expects step 1's move
    why = "the step's graph broke with every lane alive: RuntimeError: build"
    replies1.set_result([LaneReply(error=StepNotSent(why))] * 2)
    _wait_calls(transport, 2)  # step 2 still in flight: only step 1's moves go, each alone
    assert [(c[0], c[1]) for c in transport.calls] == [(0, "apply_moves"), (1, "apply_moves")]
    assert [[m[1] for m in c[2][0]] for c in transport.calls] == [[1], [1]]
    assert ch.num_riding_moves == 1 and ch.num_waiting_moves == 1  # step 2's; the free
    with pytest.raises(StepNotSent):
        ch.outcome(first[0].result(timeout=5)[1], 0)
    replies2.set_result([LaneReply(error=StepAborted("lane 1 died"))] * 2)
    _wait_calls(transport, 3)  # then the held-back free; step 2's move is not sent again
    assert [m[1] for m in transport.calls[2][2][0]] == [3] and len(transport.calls) == 3
    deadline = time.monotonic() + 5
    while ch.num_pending:  # the resent moves answered as ordinary calls
        assert ch.poll() == [] and time.monotonic() < deadline
        time.sleep(0.001)
    del packet1


def test_moves_held_back_ride_in_the_next_step_instead(compiled):
    ch, transport = compiled
    ch.submit_steps("step 1")
    ch.send_moves(0, np.array([1], I32), np.empty(0, I32), "alloc")
    ch.flush()
    ch.submit_steps("step 2")  # written behind step 1: the moves ride in it
    (_, first), (second, _) = transport.packets
    assert [m[1] for m in second.moves[0]] == [1]
    first.set_result([LaneReply(({}, None))] * 2)
    time.sleep(0.05)
    assert transport.calls == []  # nothing left to send on its own


def test_a_riding_move_the_lane_refused_is_reported_through_its_reply(compiled):
    ch, transport = compiled
    ch.send_moves(1, np.array([5], I32), np.empty(0, I32), "prefill")
    futures = ch.submit_steps("step")
    ((_, replies),) = transport.packets
    refused = MovesNotApplied("lane 1: move 1 arrived, expected 3")
    replies.set_result([LaneReply(error=StepAborted("lane 1 left")), LaneReply(error=refused)])
    _status, result = futures[1].result(timeout=5)
    with pytest.raises(MovesNotApplied):
        ch.outcome(result, 0)
    assert ch.poll() == [(1, refused)]


def test_a_step_error_on_a_lane_is_not_a_move_failure(compiled):
    ch, transport = compiled
    ch.send_moves(0, np.array([5], I32), np.empty(0, I32), "prefill")
    ch.submit_steps("step")
    ((_, replies),) = transport.packets
    replies.set_result([LaneReply(error=RuntimeError("the model failed"))] * 2)
    assert ch.poll() == []  # the step's own failure fails the step, resets no lane
    assert ch.num_pending == 0


# ----------------------------------------------------------- the lane, without Ray
@pytest.fixture
def lane(monkeypatch):
    import cpkv.actors.lane as lane_module

    monkeypatch.setattr(lane_module, "_FENCE_WAIT_S", 0.5)
    lane = lane_module._Lane(0, 1, 8, 4, KVShape(1, 2, 8, "float32"), device="cpu")
    lane.reset("g")
    return lane


class _LibError(Exception):
    """A third-party error as they often are: it pickles, but cannot be rebuilt."""

    def __init__(self, message: str, code: int) -> None:
        super().__init__(message)
        self.code = code


def test_a_lane_error_that_cannot_be_rebuilt_arrives_as_a_readable_one(lane, monkeypatch):
    """Unpacked by the coordinator it would raise there: the graph's read fails, every
    lane's answer is lost and the graph torn down."""
    from cpkv.actors.wire import pack, unpack

    monkeypatch.setattr(lane, "compiled_step", lambda packet: LaneReply(error=_LibError("x", 7)))
    reply = unpack(lane.compiled_step_packed(pack(_packet(1))))
    assert isinstance(reply.error, RuntimeError) and "_LibError: x" in str(reply.error)


def test_concurrent_stats_count_each_capacity_wait_once():
    from cpkv.actors.coordinator import _Metrics

    metrics = _Metrics.__new__(_Metrics)
    incs: list[int] = []
    start = threading.Barrier(2)

    class _Counter:
        def inc(self, n: int) -> None:
            incs.append(n)
            time.sleep(0.02)  # the window two updates raced in

    metrics._pages = types.SimpleNamespace(set=lambda *a, **k: None)
    metrics._waits = _Counter()
    metrics._evicted = types.SimpleNamespace(inc=lambda n: None)
    metrics._last = {"capacity_waits": 0, "pages_evicted": 0}
    metrics._lock = threading.Lock()
    stats = {"free": [1], "used": [0], "cached": [0], "capacity_waits": 5, "pages_evicted": 0}

    def update() -> None:
        start.wait()
        metrics.update(stats)

    threads = [threading.Thread(target=update) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sum(incs) == 5


def test_a_heartbeat_counts_pages_only_once_the_moves_of_its_fence_are_applied(lane):
    assert lane.heartbeat(("g", 1))[1] is None  # the move it names has not come
    lane.apply_moves((("g", 1, np.array([1, 2], I32), np.empty(0, I32)),))
    assert lane.heartbeat(("g", 1))[1] == 2
    assert lane.heartbeat()[1] == 2


def test_a_heartbeat_counts_pages_as_of_its_fence_when_later_moves_came_first(lane):
    """A step decided after the heartbeat carries its moves through the graph, which does
    not travel behind the heartbeat: the lane may apply them first. The count compared with
    the coordinator's mirror is the one right after the fence's move."""
    take = lambda seq, *pages: ("g", seq, np.array(pages, I32), np.empty(0, I32))
    lane.apply_moves((take(1, 1, 2),))
    lane.apply_moves((take(2, 3), take(3, 4, 5)))  # rode in a later step
    assert [lane.heartbeat(("g", s))[1] for s in (0, 1, 2, 3)] == [0, 2, 3, 5]
    assert lane.heartbeat(("g", 4))[1] is None  # still to come
    assert lane.heartbeat()[1] == 5
    assert lane._shard.num_repeats == 0  # a count is not a repeated move


def test_a_lane_without_its_shard_yet_answers_a_heartbeat_as_a_new_lane():
    """A lane sized from free memory that Ray restarted has no shard until the coordinator
    resets it: its heartbeat says it is not the lane the coordinator knew."""
    import cpkv.actors.lane as lane_module

    lane = lane_module._Lane(0, 1, None, 4, KVShape(1, 2, 8, "float32"), device="cpu")
    assert lane.heartbeat(("g", 3)) == (None, None)
    assert lane.heartbeat() == (None, None)
    lane.reset("g", num_pages=8)
    assert lane.heartbeat(("g", 0))[1] == 0


def test_a_compiled_step_whose_fence_never_comes_is_refused(lane):
    from cpkv.core.steps import StepRequest, StepSequence

    step = StepRequest(1, "group", (StepSequence(0, 4, np.array([1]), None, "r"),))
    t0 = time.monotonic()
    reply = lane.compiled_step(StepPacket(step, (None,), (("g", 1),), "e"))
    assert time.monotonic() - t0 >= 0.5
    assert isinstance(reply.error, MovesNotApplied) and "through 1 of 'g'" in str(reply.error)
    # The warm-up packet says whose graph the lane serves.
    assert lane.compiled_step(StepPacket(None, epoch="e")) is None
    assert lane._graph_epoch == "e"  # (info() says it; it would start a Ray here)


def test_the_graphs_packets_and_answers_cross_as_one_pickle_each_way(lane):
    """The lanes' graph runs compiled_step_packed: packed in, packed out; an answer the
    standard pickler refuses goes through cloudpickle, one nothing pickles says so."""
    import threading as _threading

    from cpkv.actors.wire import pack, unpack
    from cpkv.core.steps import StepRequest, StepSequence

    assert unpack(lane.compiled_step_packed(pack(StepPacket(None, epoch="e2")))) is None
    assert lane._graph_epoch == "e2"
    step = StepRequest(1, "e:g2", (StepSequence(0, 4, np.array([1]), None, "r"),))
    lane._worker.group_id = "e:g3"  # a stale step: refused at once, as a value
    reply = unpack(lane.compiled_step_packed(pack(StepPacket(step, (None,), (("g", 0),), "e"))))
    assert type(reply.error).__name__ == "LaneGroupError", reply.error

    class Local(Exception):  # defined in a function: only cloudpickle carries it
        pass

    assert type(unpack(pack(Local("x")))).__name__ == "Local"
    arrays = unpack(pack({"a": np.arange(3)}))
    assert arrays["a"].flags.writeable and arrays["a"].tolist() == [0, 1, 2]

    class Unpicklable(Exception):
        def __init__(self) -> None:
            super().__init__("holds a lock")
            self.lock = _threading.Lock()

    lane.compiled_step = lambda packet: LaneReply(error=Unpicklable())
    reply = unpack(lane.compiled_step_packed(pack(StepPacket(step, (None,), (("g", 0),), "e"))))
    assert isinstance(reply.error, RuntimeError) and "unpicklable" in str(reply.error)


def test_a_compiled_step_waits_for_its_moves_and_its_group(lane):
    from cpkv.core.steps import StepRequest, StepSequence

    step = StepRequest(1, "e:g2", (StepSequence(0, 4, np.array([1]), None, "r"),))
    move = ("g", 1, np.array([1], I32), np.empty(0, I32))
    applier = threading.Timer(0.1, lane.apply_moves, ((move,),))
    applier.start()
    reply = lane.compiled_step(StepPacket(step, (None,), (("g", 1),), "e"))
    applier.join()
    # The move came; the group the step was made for never did (its init_group call).
    assert isinstance(reply.error, MovesNotApplied) and "'e:g2'" in str(reply.error)
    assert lane.heartbeat(("g", 1))[1] == 1
    # A step of a group the lane has left for a later one fails at once, as a stale step.
    lane._worker.group_id = "e:g3"
    t0 = time.monotonic()
    reply = lane.compiled_step(StepPacket(step, (None,), (("g", 1),), "e"))
    assert time.monotonic() - t0 < 0.5
    assert type(reply.error).__name__ == "LaneGroupError", reply.error


def test_generations_and_group_ids_order_within_one_coordinator():
    from cpkv.core.steps import group_id, superseded

    g1, g2, g10 = (group_id("0123456789", n) for n in (1, 2, 10))
    assert superseded(g1, g2) and superseded(g2, g10)
    assert not superseded(g2, g1) and not superseded(g2, g2)
    assert not superseded(g2, None)
    assert not superseded(g1, group_id("another", 5))  # another coordinator's
    assert superseded("epoch:3", "epoch:12") and not superseded("epoch:3", "other:4")


def test_a_compiled_step_for_another_coordinators_generation_is_refused_at_once(lane):
    from cpkv.core.steps import StepRequest, StepSequence

    step = StepRequest(1, "e:g1", (StepSequence(0, 4, np.array([1]), None, "r"),))
    lane.reset("not-the-coordinators:1")  # behind the coordinator's back
    t0 = time.monotonic()
    reply = lane.compiled_step(StepPacket(step, (None,), (("g", 1),), "e"))
    assert time.monotonic() - t0 < 0.4
    assert isinstance(reply.error, MovesNotApplied)
    assert lane.heartbeat(("g", 1))[1] == 0  # counted: nothing is on its way


@pytest.mark.parametrize("later", ["e:g5", "f:g1"], ids=["recovered", "new-coordinator"])
def test_a_late_step_refused_after_a_reset_leaves_the_lanes_current_group_alone(lane, later):
    """Sent through the graph, a step can arrive after ordinary calls reset the lane into a
    later generation and joined it to a later group (a recovery, or a new coordinator): it
    is refused, and the lane stays in the group its next steps need."""
    from cpkv.core.steps import StepRequest, StepSequence

    step = StepRequest(7, "e:g4", (StepSequence(0, 4, np.array([1]), None, "r"),))
    lane.reset(later.split(":")[0] + ":2")
    lane._worker.group_id = later  # the group it joined since
    reply = lane.compiled_step(StepPacket(step, (None,), (("e:1", 1),), "e"))
    assert isinstance(reply.error, MovesNotApplied)
    assert lane._worker.group_id == later
    # Its own group's step that cannot get its moves does leave it (its peers must not wait).
    own = StepRequest(8, later, (StepSequence(0, 4, np.array([1]), None, "r"),))
    reply = lane.compiled_step(StepPacket(own, (None,), ((lane._shard.generation, 5),), "e"))
    assert isinstance(reply.error, MovesNotApplied) and lane._worker.group_id is None


# ---------------------------------------------- CompiledSteps' writes and reads, without Ray
class _Graph:
    """A compiled graph's stand-in: ``execute`` logs (thread, step id) and answers with
    refs that :class:`_Ray` resolves to each lane's packed reply."""

    def __init__(self, log: list, num_lanes: int, fail_writes: list | None = None) -> None:
        self.log, self.num_lanes, self.fail_writes = log, num_lanes, list(fail_writes or ())
        self.torn_down = False

    def execute(self, data: bytes) -> list:
        from cpkv.actors.wire import unpack

        step_id = unpack(data).step.step_id
        if self.fail_writes:
            raise self.fail_writes.pop(0)
        self.log.append((threading.current_thread().name, step_id))
        return [(r, step_id) for r in range(self.num_lanes)]

    def teardown(self) -> None:
        self.torn_down = True


class _Ray:
    """``ray.get`` of :class:`_Graph`'s refs (the timeouts it was given kept)."""

    timeouts: list = []

    @classmethod
    def get(cls, refs: list, timeout: float | None = None) -> list:
        from cpkv.actors.wire import pack

        cls.timeouts.append(timeout)
        return [pack(LaneReply((("gen", 0), f"lane {r} step {sid}"))) for r, sid in refs]


def _steps(monkeypatch, builds: list, num_lanes: int = 2, dead: frozenset = frozenset()):
    """A CompiledSteps whose builds take their outcome from ``builds`` (a graph, an
    exception to raise, or an Event to wait for before the next item); a ping after a
    break finds the lanes ``dead`` dead."""
    from cpkv.actors import compiled_steps

    monkeypatch.setattr(compiled_steps, "ray", _Ray)

    class Steps(compiled_steps.CompiledSteps):
        def _build(self) -> None:
            outcome = builds.pop(0)
            if isinstance(outcome, threading.Event):
                outcome.wait(10)
                outcome = builds.pop(0)
            if isinstance(outcome, BaseException):
                raise outcome
            with self._write_lock:
                self._graph = outcome
            self.num_builds += 1

        def _dead_lanes(self) -> set[int]:
            return set(dead)

    return Steps([None] * num_lanes, idle_s=60.0)


def _packet(step_id: int) -> StepPacket:
    from cpkv.core.steps import StepRequest, StepSequence

    seq = StepSequence(0, 1, np.array([1], I32), np.array([5]))
    return StepPacket(StepRequest(step_id, "g", (seq,)), (None, None), (("gen", 0),) * 2, "e")


def _values(future: Future) -> list:
    return [reply.unwrap() for reply in future.result(timeout=10)]


def _built(steps) -> None:
    deadline = time.monotonic() + 10
    while steps._graph is None and time.monotonic() < deadline:
        time.sleep(0.01)
    assert steps._graph is not None


def test_a_step_is_written_by_the_thread_that_sends_it_once_the_graph_is_built(monkeypatch):
    log: list = []
    steps = _steps(monkeypatch, [_Graph(log, 2)])
    steps.start("e")
    _built(steps)
    futures = [steps.execute(_packet(i)) for i in (1, 2, 3)]
    assert [_values(f) for f in futures] == [
        [(("gen", 0), f"lane {r} step {i}") for r in range(2)] for i in (1, 2, 3)
    ]
    me = threading.current_thread().name
    assert log == [(me, 1), (me, 2), (me, 3)]  # no hop to the graph thread
    assert steps._num_unwritten == 0 and steps.num_runs == 3
    # A step may take longer than Ray's default read timeout (10 s) without breaking it.
    assert min(_Ray.timeouts[-3:]) > 24 * 3600
    steps.close()


def test_steps_sent_while_the_graph_builds_are_written_in_order_by_the_graph_thread(monkeypatch):
    log: list = []
    built = threading.Event()
    steps = _steps(monkeypatch, [built, _Graph(log, 2)])
    first = [steps.execute(_packet(i)) for i in (1, 2, 3)]  # the first one starts the build
    assert steps._num_unwritten == 3
    built.set()
    assert [_values(f)[0][1] for f in first] == ["lane 0 step 1", "lane 0 step 2", "lane 0 step 3"]
    later = steps.execute(_packet(4))
    assert _values(later)[1][1] == "lane 1 step 4"
    me = threading.current_thread().name
    assert log == [("cpkv-graph", 1), ("cpkv-graph", 2), ("cpkv-graph", 3), (me, 4)]
    assert steps._num_unwritten == 0
    steps.close()


def test_a_failed_build_answers_its_steps_and_leaves_none_pending(monkeypatch):
    from cpkv.coordinator.channel import LaneDeadError, StepNotSent

    log: list = []
    steps = _steps(monkeypatch, [RuntimeError("a lane is gone"), _Graph(log, 2)], dead={1})
    # The error names no actor: a ping tells the dead lane from the live one.
    live, gone = steps.execute(_packet(1)).result(timeout=10)
    assert isinstance(gone.error, LaneDeadError)
    # No lane got it: its riding moves go again (StepNotSent, a StepAborted to the client).
    assert isinstance(live.error, StepNotSent) and "lane 1 died" in str(live.error)
    assert steps._num_unwritten == 0 and steps.num_breaks == 1
    assert _values(steps.execute(_packet(2)))[0][1] == "lane 0 step 2"  # built again
    assert log == [("cpkv-graph", 2)]
    assert _values(steps.execute(_packet(3)))[0][1] == "lane 0 step 3"
    assert log[-1] == (threading.current_thread().name, 3) and steps._num_unwritten == 0
    steps.close()


def test_a_ping_tells_dead_lanes_from_slow_and_live_ones(monkeypatch):
    import ray as real_ray

    from cpkv.actors import compiled_steps

    outcomes = [None, real_ray.exceptions.ActorDiedError(), TimeoutError("slow"), None]

    class _Lane:
        def __init__(self, rank: int) -> None:
            self.ping = types.SimpleNamespace(remote=lambda: rank)

    class _PingRay:
        exceptions = real_ray.exceptions

        @staticmethod
        def wait(ranks: list, num_returns: int, timeout: float) -> tuple[list, list]:
            assert num_returns == len(ranks) and timeout == compiled_steps._PROBE_S
            slow = [r for r in ranks if isinstance(outcomes[r], TimeoutError)]
            return [r for r in ranks if r not in slow], slow  # one wait for them all

        @staticmethod
        def get(rank: int, timeout: float | None = None) -> None:
            if outcomes[rank] is not None:
                raise outcomes[rank]

    monkeypatch.setattr(compiled_steps, "ray", _PingRay)
    steps = compiled_steps.CompiledSteps([_Lane(r) for r in range(4)], idle_s=60.0)
    assert steps._dead_lanes() == {1}  # the slow lane 2 is the hang check's to judge
    steps.close()


def test_a_write_that_fails_midway_fails_its_step_and_the_graph_is_built_again(monkeypatch):
    from cpkv.coordinator.channel import StepAborted, StepNotSent

    log: list = []
    broken = _Graph(log, 2, fail_writes=[RuntimeError("channel closed")])
    steps = _steps(monkeypatch, [broken, _Graph(log, 2)])
    steps.start("e")
    _built(steps)
    # It may have reached some lanes: not written again. Every lane answers a ping, so the
    # step failed and no lane is reported lost (each would be reset, its requests lost).
    for reply in steps.execute(_packet(1)).result(timeout=10):
        assert isinstance(reply.error, StepAborted) and "every lane alive" in str(reply.error)
        assert not isinstance(reply.error, StepNotSent)  # its moves are not sent again
    assert broken.torn_down and steps._num_unwritten == 0 and log == []
    assert _values(steps.execute(_packet(2)))[0][1] == "lane 0 step 2"
    assert log == [("cpkv-graph", 2)] and steps.num_builds == 2
    steps.close()


def test_a_write_to_a_graph_already_torn_down_sends_the_steps_moves_again(monkeypatch):
    """Ray's monitor tears a graph down when a lane dies: a write to it raises a closed
    channel before any lane reads it, so the moves riding in the step go again (else every
    lane's next step waited for moves that never came, and a healthy lane was reset)."""
    from ray.exceptions import RayChannelError

    from cpkv.coordinator.channel import StepNotSent

    log: list = []
    closed = _Graph(log, 2, fail_writes=[RayChannelError("Channel closed.")])
    steps = _steps(monkeypatch, [closed, _Graph(log, 2)])
    steps.start("e")
    _built(steps)
    for reply in steps.execute(_packet(1)).result(timeout=10):
        assert isinstance(reply.error, StepNotSent) and "every lane alive" in str(reply.error)
    assert closed.torn_down and steps._num_unwritten == 0
    assert _values(steps.execute(_packet(2)))[0][1] == "lane 0 step 2"
    steps.close()


def test_a_lane_reset_retires_the_graph_and_the_next_step_builds_another(monkeypatch):
    """A lane lost while no step ran: the graph to it is stale (Ray tore it down with the
    lane), so no step is written to it; the next one builds a graph on the live lanes."""
    log: list = []
    old, new = _Graph(log, 2), _Graph(log, 2)
    steps = _steps(monkeypatch, [old, new, _Graph(log, 2)])
    steps.start("e")
    _built(steps)
    assert _values(steps.execute(_packet(1)))[1][1] == "lane 1 step 1"
    steps.lane_reset(1)
    assert _values(steps.execute(_packet(2)))[1][1] == "lane 1 step 2"
    assert old.torn_down and not new.torn_down and steps.num_builds == 2
    assert log[-1] == ("cpkv-graph", 2) and steps.num_breaks == 0
    steps.lane_reset(0)  # twice in a row, or with no graph built: nothing to retire
    steps.lane_reset(0)
    assert _values(steps.execute(_packet(3)))[0][1] == "lane 0 step 3"
    assert new.torn_down and steps.num_builds == 3
    steps.close()


@pytest.mark.parametrize("when", ["behind-a-full-graph", "queued-while-built"])
def test_a_queued_step_written_to_a_torn_down_graph_sends_its_moves_again(monkeypatch, when):
    """The graph thread's own write (of a step queued behind a full graph, or while the graph
    was built) to a graph Ray had torn down answered StepAborted: its moves were taken as
    delivered."""
    from ray.exceptions import RayCgraphCapacityExceeded, RayChannelError

    from cpkv.coordinator.channel import StepNotSent

    log: list = []
    fails = [RayChannelError("Channel closed.")]
    if when == "behind-a-full-graph":
        fails.insert(0, RayCgraphCapacityExceeded("10 in flight"))
    steps = _steps(monkeypatch, [_Graph(log, 2, fail_writes=fails), _Graph(log, 2)])
    if when == "behind-a-full-graph":
        steps.start("e")
        _built(steps)
    for reply in steps.execute(_packet(1)).result(timeout=10):
        assert isinstance(reply.error, StepNotSent), reply.error
    assert steps._num_unwritten == 0
    assert _values(steps.execute(_packet(2)))[0][1] == "lane 0 step 2"
    steps.close()


def test_a_lane_reset_between_a_build_and_its_write_sends_the_moves_again(monkeypatch):
    """A reset on the coordinator's thread retired the graph the graph thread had just built
    for a queued step: the write raised AttributeError and answered StepAborted."""
    from cpkv.actors import compiled_steps
    from cpkv.coordinator.channel import StepNotSent

    monkeypatch.setattr(compiled_steps, "ray", _Ray)
    log: list = []
    graphs = [_Graph(log, 2) for _ in range(3)]
    built, reset = threading.Event(), threading.Event()

    class Steps(compiled_steps.CompiledSteps):
        def _build(self) -> None:
            with self._write_lock:
                self._graph = graphs.pop(0)
            self.num_builds += 1
            if self.num_builds == 2:  # the build for the queued step: a reset comes now
                built.set()
                reset.wait(5)

        def _dead_lanes(self) -> set[int]:
            return set()

    steps = Steps([None, None], idle_s=60.0)
    steps.start("e")
    _built(steps)
    steps.lane_reset(0)
    future = steps.execute(_packet(1))  # queued unwritten: the graph thread builds
    assert built.wait(5)
    steps.lane_reset(1)
    reset.set()
    for reply in future.result(timeout=10):
        assert isinstance(reply.error, StepNotSent), reply.error
    assert log == [] and steps._num_unwritten == 0
    assert _values(steps.execute(_packet(2)))[1][1] == "lane 1 step 2"
    steps.close()


def test_a_graph_retired_after_close_is_torn_down(monkeypatch):
    log: list = []
    graph = _Graph(log, 2)
    steps = _steps(monkeypatch, [graph])
    steps.start("e")
    _built(steps)
    gate = threading.Event()
    plain_get = _Ray.get
    monkeypatch.setattr(_Ray, "get", lambda refs, timeout=None: gate.wait(5) and plain_get(refs))
    future = steps.execute(_packet(1))  # the graph thread reads it while the rest comes
    steps.close()
    steps.lane_reset(0)  # a recovery racing the shutdown
    gate.set()
    future.result(timeout=5)
    steps._thread.join(5)
    assert graph.torn_down and not steps._thread.is_alive()


def test_a_compiled_channel_tells_its_transport_of_each_lane_reset(compiled):
    ch, transport = compiled
    assert transport.resets == [0, 1]  # the fixture's first generations
    ch.new_generation(1)
    assert transport.resets == [0, 1, 1]


def test_a_step_the_graph_has_no_room_for_yet_is_written_by_the_graph_thread(monkeypatch):
    from ray.exceptions import RayCgraphCapacityExceeded

    log: list = []
    full = _Graph(log, 2, fail_writes=[RayCgraphCapacityExceeded("10 in flight")])
    steps = _steps(monkeypatch, [full])
    steps.start("e")
    _built(steps)
    assert _values(steps.execute(_packet(1)))[0][1] == "lane 0 step 1"
    assert log == [("cpkv-graph", 1)] and not full.torn_down and steps.num_breaks == 0
    steps.close()


def test_steps_sent_after_close_are_aborted_not_lost(monkeypatch):
    from cpkv.coordinator.channel import StepAborted

    log: list = []
    steps = _steps(monkeypatch, [_Graph(log, 2)])
    steps.start("e")
    _built(steps)
    steps.close()
    for reply in steps.execute(_packet(1)).result(timeout=10):
        assert isinstance(reply.error, StepAborted)
    assert log == []


# ------------------------------------------------------------------ through Ray
@pytest.mark.ray
def test_a_compiled_pool_answers_as_an_ordinary_one(make_client):
    torch = pytest.importorskip("torch")
    from tests.test_lane_attention import close, qkv, reference

    c = make_client(cp_size=2, num_pages_per_lane=48, compiled_steps=True)
    breaks = c.stats()["compiled_graph_breaks"]  # counted since the pool started
    prompt = np.arange(37) % 200
    res = c.prefill("a", prompt, probe=qkv(prompt))
    close(res.attention, reference(prompt, 0))
    more = np.array([7, 9])
    seq = np.concatenate([prompt, more])
    for i, tok in enumerate(more):
        out = c.decode(["a"], [int(tok)], probe=qkv(more[i : i + 1], len(prompt) + i))
        close(out, reference(seq[: len(prompt) + i + 1], len(prompt) + i))
    stats = c.stats()
    assert stats["compiled_graph_builds"] >= 1 and stats["compiled_graph_breaks"] == breaks
    assert stats["moves_in_step_calls"] >= 2
    assert c.check()["ok"], c.check()
    del torch


@pytest.mark.ray
def test_check_agrees_with_the_lanes_while_steps_run(make_client):
    """A heartbeat (check() sends them) travels as an ordinary lane call; a step decided
    after it carries its moves through the graph and may reach the lane first. Every check
    taken while another thread steps finds the lanes agreeing with the mirror."""
    pytest.importorskip("torch")
    from tests.test_lane_attention import qkv

    c = make_client(cp_size=2, num_pages_per_lane=48, compiled_steps=True)
    prompt = np.arange(9) % 200
    stop, cycles = threading.Event(), []

    def step() -> None:
        while not stop.is_set():
            rid = f"s{len(cycles)}"
            c.prefill(rid, prompt, probe=qkv(prompt))
            c.free(rid, cache=False)
            cycles.append(rid)

    stepper = threading.Thread(target=step)
    stepper.start()
    try:
        checks = []
        while (len(checks) < 80 or len(cycles) < 40) and stepper.is_alive():
            checks.append(c.check())
    finally:
        stop.set()
        stepper.join()
    assert len(cycles) >= 40, "the stepping thread failed (its error is printed above)"
    assert [ch["problems"] for ch in checks if not ch["ok"]] == []
    assert c.stats()["mirror_mismatches"] == 0


def wait_for(pred, timeout: float = 60.0):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        try:
            value = pred()
        except Exception:  # e.g. the coordinator is still restarting
            value = None
        if value:
            return value
        time.sleep(0.1)
    raise AssertionError("condition not met in time")


@pytest.mark.ray
def test_a_compiled_graph_is_rebuilt_after_a_lane_dies(make_client):
    import ray

    from cpkv.errors import LaneUnavailableError, StepFailedError
    from tests.test_lane_attention import close, qkv, reference

    # The pool of the test above (the lane is back and the graph rebuilt at the end).
    c = make_client(cp_size=2, num_pages_per_lane=48, compiled_steps=True)
    prompt = np.arange(21) % 200
    c.prefill("a", prompt, probe=qkv(prompt))
    before = c.stats()  # graph counters run since the pool started; a graph is built now
    ray.kill(c.lanes[1], no_restart=False)
    with pytest.raises((LaneUnavailableError, StepFailedError)):
        c.decode(["a"], [3], probe=qkv(np.array([3]), len(prompt)))
    wait_for(lambda: c.stats()["lane_states"] == ["up"] * 2)
    res = c.prefill("b", prompt, probe=qkv(prompt))
    close(res.attention, reference(prompt, 0))
    stats = c.stats()
    assert stats["compiled_graph_breaks"] == before["compiled_graph_breaks"] + 1
    assert stats["compiled_graph_builds"] >= before["compiled_graph_builds"] + 1
    assert c.check()["ok"]
    # A lane that dies and comes back while no step runs: the next step builds a graph on
    # the live lanes (it wrote to the torn-down one and failed, and the moves riding in it
    # were lost: the step after waited for them and a healthy lane was reset).
    losses = len(stats["lane_losses"])
    ray.kill(c.lanes[0], no_restart=False)
    wait_for(lambda: len(c.stats()["lane_losses"]) > losses)
    wait_for(lambda: c.stats()["lane_states"] == ["up"] * 2)
    for rid in ("c", "d"):
        res = c.prefill(rid, prompt, probe=qkv(prompt))
        close(res.attention, reference(prompt, 0))
    stats = c.stats()
    assert [lane for lane, _ in stats["lane_losses"][losses:]] == [0], stats["lane_losses"]
    assert c.check()["ok"]


@pytest.mark.ray
def test_a_restarted_coordinator_builds_its_graph_on_the_same_lanes(make_client):
    import ray

    from tests.test_lane_attention import close, qkv, reference

    c = make_client(fresh=True, cp_size=2, num_pages_per_lane=48, compiled_steps=True)
    prompt = np.arange(21) % 200
    c.prefill("a", prompt, probe=qkv(prompt))
    epoch = c.stats()["epoch"]
    ray.kill(c._coord, no_restart=False)
    # The old graph's loop still holds a thread on each lane; the new graph runs beside it.
    res = wait_for(lambda: c.prefill("b", prompt, probe=qkv(prompt)))
    assert c.stats()["epoch"] != epoch
    close(res.attention, reference(prompt, 0))
    assert {info["graph_epoch"] for info in c.lane_info()} == {c.stats()["epoch"]}
