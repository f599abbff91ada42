"""LaneChannel without Ray: page moves in order, and moves that ride inside a step call."""

from __future__ import annotations

import time
from concurrent.futures import Future
from typing import Any

import numpy as np
import pytest

from cpkv.coordinator.channel import LaneChannel, LaneDeadError
from cpkv.core.moves import MovesNotApplied

I32 = np.int32


class FakeTransport:
    """Records every call; a call's handle is a Future the test settles (a step's: two)."""

    def __init__(self) -> None:
        self.calls: list[tuple[int, str, tuple]] = []

    def submit(self, lane: int, method: str, *args: Any) -> Any:
        self.calls.append((lane, method, args))
        return (Future(), Future()) if method == "step" else Future()

    def result(self, handle: Future, timeout: float) -> Any:
        return handle.result(timeout=timeout)

    def done(self, handles: list[Future]) -> list[bool]:
        return [h.done() for h in handles]


@pytest.fixture
def channel():
    transport = FakeTransport()
    ch = LaneChannel(transport, cp_size=2, epoch="e")
    for lane in range(2):
        ch.new_generation(lane)
    yield ch, transport
    ch.close()


def submitted(transport: FakeTransport, n: int) -> list[tuple[int, str, tuple]]:
    deadline = time.monotonic() + 5
    while len(transport.calls) < n:
        assert time.monotonic() < deadline, f"only {len(transport.calls)} of {n} calls submitted"
        time.sleep(0.001)
    return transport.calls


def test_nothing_to_move_rides_nothing(channel):
    ch, _ = channel
    empty = np.empty(0, I32)
    assert ch.moves_for_step(0, empty, empty, "prefill") is None
    assert ch.fence()[0][1] == 0 and ch.num_pending == 0


def test_a_move_rides_in_its_step_call_after_the_moves_queued_before_it(channel):
    ch, transport = channel
    gen = ch.generation(0)
    ch.send_moves(0, np.array([3], I32), np.empty(0, I32), "extend")
    ch.hold_release(0, np.array([3], I32))
    moves = ch.moves_for_step(0, np.array([4, 5], I32), np.empty(0, I32), "prefill", owner=2)
    assert moves is not None and moves.args[:2] == (gen, 2)
    np.testing.assert_array_equal(moves.args[3], [3])  # the held release goes first
    assert ch.fence()[0] == (gen, 2)  # a write may wait for the riding move
    step_future = ch.submit_step(0, "the-step", moves)
    ch.submit_step(1, "the-step", None)
    calls = submitted(transport, 3)
    assert [(lane, method) for lane, method, _ in calls] == [(0, "apply"), (0, "step"), (1, "step")]
    assert calls[1][2] == ("the-step", moves.args) and calls[2][2] == ("the-step",)
    assert ch.num_calls == 1 and ch.num_riding_moves == 1  # no call of its own
    assert ch.num_moves_by_op == {"extend": 1, "prefill": 1}
    status, _result = step_future.result(timeout=5)
    assert moves.future.result(timeout=5) is status  # the move is answered by the status


@pytest.mark.parametrize(
    ("error", "reported"),
    [
        pytest.param(ValueError("the step's own failure"), False, id="step-failed"),
        pytest.param(MovesNotApplied("refused"), True, id="moves-refused"),
        pytest.param(LaneDeadError("gone"), True, id="lane-died"),
    ],
)
def test_a_riding_move_fails_only_when_the_lane_refused_it_or_died(channel, error, reported):
    ch, _ = channel
    moves = ch.moves_for_step(1, np.array([7], I32), np.empty(0, I32), "prefill")
    status, _ = ch.submit_step(1, "s", moves).result(timeout=5)
    assert ch.poll() == [] and ch.num_pending == 1  # not answered yet
    status.set_exception(error)
    failures = ch.poll()
    assert ch.num_pending == 0
    assert failures == ([(1, error)] if reported else [])


def test_a_failed_move_call_is_reported_whatever_its_error(channel):
    ch, transport = channel
    ch.send_moves(0, np.array([1], I32), np.empty(0, I32), "extend")
    ((_, _, _),) = submitted(transport, 1)
    handle = ch._pending[0][3].result(timeout=5)
    handle.set_exception(ValueError("diverged"))
    assert [lane for lane, _ in ch.poll()] == [0]


def test_a_step_handle_without_a_status_fails_its_move_and_the_sender_goes_on(channel):
    ch, transport = channel
    transport.submit = lambda lane, method, *args: Future()  # one handle, not (status, result)
    moves = ch.moves_for_step(0, np.array([2], I32), np.empty(0, I32), "prefill")
    with pytest.raises(TypeError):
        ch.submit_step(0, "s", moves).result(timeout=5)
    with pytest.raises(TypeError):
        moves.future.result(timeout=5)
    assert isinstance(ch.submit(1, "heartbeat").result(timeout=5), Future)  # still sending
