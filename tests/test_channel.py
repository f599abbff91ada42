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
    # No timer flush here: moves wait for a step or flush() (the timer has its own test).
    ch = LaneChannel(transport, cp_size=2, epoch="e", flush_after_s=60.0)
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


def test_nothing_waiting_rides_nothing(channel):
    ch, transport = channel
    ch.submit_steps("s")
    calls = submitted(transport, 2)
    assert [args for _, _, args in calls] == [("s",), ("s",)]
    assert ch.fence()[0][1] == 0 and ch.num_pending == 0


def test_moves_wait_for_the_step_and_ride_in_it_in_order(channel):
    ch, transport = channel
    gen = ch.generation(0)
    assert ch.send_moves(0, np.array([3], I32), np.empty(0, I32), "extend") == 1
    assert ch.send_moves(0, np.empty(0, I32), np.array([3], I32), "free") == 2
    assert ch.send_moves(0, np.array([3, 4], I32), np.empty(0, I32), "prefill", owner=2) == 3
    assert ch.fence()[0] == (gen, 3) and ch.num_waiting_moves == 3  # a write may wait for them
    assert transport.calls == []  # nothing sent: no lane needs them yet
    futures = ch.submit_steps("the-step")
    calls = submitted(transport, 2)
    assert [(lane, method) for lane, method, _ in calls] == [(0, "step"), (1, "step")]
    step, batch = calls[0][2]
    assert step == "the-step" and [m[:2] for m in batch] == [(gen, 1), (gen, 2), (gen, 3)]
    assert batch[2][4] == 2  # the owner travels with its move
    assert calls[1][2] == ("the-step",)
    assert ch.num_calls == 0 and ch.num_riding_moves == 3 and ch.num_waiting_moves == 0
    assert ch.num_moves_by_op == {"extend": 1, "free": 1, "prefill": 1}
    status, _result = futures[0].result(timeout=5)
    assert ch._pending[0][3].result(timeout=5) is status  # the moves are answered by it


def test_flush_sends_each_lane_its_waiting_moves_in_one_call(channel):
    ch, transport = channel
    for page in (1, 2, 3):
        ch.send_moves(1, np.array([page], I32), np.empty(0, I32), "extend")
    ch.flush()
    ((lane, method, (batch,)),) = submitted(transport, 1)
    assert (lane, method) == (1, "apply_moves") and [m[1] for m in batch] == [1, 2, 3]
    assert ch.num_calls == 1 and ch.num_waiting_moves == 0
    ch.flush()  # nothing waits: no call
    time.sleep(0.01)
    assert len(transport.calls) == 1


def test_moves_no_step_needs_are_sent_after_flush_after_s():
    transport = FakeTransport()
    ch = LaneChannel(transport, cp_size=1, epoch="e", flush_after_s=0.05)
    ch.new_generation(0)
    try:
        t0 = time.monotonic()
        ch.send_moves(0, np.array([1], I32), np.empty(0, I32), "extend")
        ((_, method, _),) = submitted(transport, 1)
        assert method == "apply_moves" and time.monotonic() - t0 >= 0.05
    finally:
        ch.close()


@pytest.mark.parametrize("calls_first", [False, True], ids=["asleep", "woken-by-a-call"])
def test_an_idle_sender_sleeps_and_the_next_move_still_goes_out(monkeypatch, calls_first):
    import cpkv.coordinator.channel as channel_module

    monkeypatch.setattr(channel_module, "IDLE_POLLS", 3)
    transport = FakeTransport()
    ch = LaneChannel(transport, cp_size=1, epoch="e", flush_after_s=0.02)
    ch.new_generation(0)
    try:
        deadline = time.monotonic() + 5.0
        while not ch._sender_asleep:  # three idle polls: it no longer wakes on its own
            assert time.monotonic() < deadline, "the idle sender never slept"
            time.sleep(0.01)
        if calls_first:  # a call wakes it; it polls again, then sleeps again
            ch.submit(0, "info")
            submitted(transport, 1)
        t0 = time.monotonic()
        ch.send_moves(0, np.array([1], I32), np.empty(0, I32), "extend")
        calls = submitted(transport, 2 if calls_first else 1)
        assert calls[-1][1] == "apply_moves"
        assert 0.02 <= time.monotonic() - t0 < 2.0
    finally:
        ch.close()


def test_a_lane_with_many_moves_waiting_gets_them_at_once(channel, monkeypatch):
    import cpkv.coordinator.channel as channel_module

    monkeypatch.setattr(channel_module, "MAX_WAITING_MOVES", 3)
    ch, transport = channel
    for page in (1, 2, 3):
        ch.send_moves(0, np.array([page], I32), np.empty(0, I32), "extend")
    ((_, method, (batch,)),) = submitted(transport, 1)
    assert method == "apply_moves" and len(batch) == 3 and ch.num_waiting_moves == 0


def test_a_new_generation_drops_the_moves_waiting_for_the_old_one(channel):
    ch, transport = channel
    ch.send_moves(0, np.array([1], I32), np.empty(0, I32), "extend")
    gen = ch.new_generation(0)
    assert ch.num_waiting_moves == 0 and ch.fence()[0] == (gen, 0)
    ch.flush()
    time.sleep(0.01)
    assert transport.calls == []


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
    ch.send_moves(1, np.array([7], I32), np.empty(0, I32), "prefill")
    status, _ = ch.submit_steps("s")[1].result(timeout=5)
    assert ch.poll() == [] and ch.num_pending == 1  # not answered yet
    status.set_exception(error)
    failures = ch.poll()
    assert ch.num_pending == 0
    assert failures == ([(1, error)] if reported else [])


def test_a_failed_move_call_is_reported_whatever_its_error(channel):
    ch, transport = channel
    ch.send_moves(0, np.array([1], I32), np.empty(0, I32), "extend")
    ch.flush()
    ((_, _, _),) = submitted(transport, 1)
    handle = ch._pending[0][3].result(timeout=5)
    handle.set_exception(ValueError("diverged"))
    assert [lane for lane, _ in ch.poll()] == [0]


def test_a_step_handle_without_a_status_fails_its_move_and_the_sender_goes_on(channel):
    ch, transport = channel
    transport.submit = lambda lane, method, *args: Future()  # one handle, not (status, result)
    ch.send_moves(0, np.array([2], I32), np.empty(0, I32), "prefill")
    future = ch.submit_steps("s")[0]
    moves = ch._pending[0][3]
    with pytest.raises(TypeError):
        future.result(timeout=5)
    with pytest.raises(TypeError):
        moves.result(timeout=5)
    assert isinstance(ch.submit(1, "heartbeat").result(timeout=5), Future)  # still sending
