"""LaneChannel: the coordinator's ordered line to its lanes, with the replies still pending.

Every lane call the coordinator makes goes through one sender thread, in the
order the calls were queued, so each lane receives its page moves in decision
order (Ray keeps one caller's calls to an actor in order) and the coordinator
answers its caller without waiting for the submissions. Page moves carry the
lane's generation and a per-lane sequence number; the lane checks them.

A page move does not travel when it is decided: it waits, numbered, until something on
its lane needs it (the lane's next step carries every move waiting for it; a heartbeat,
a client's write behind its fence, or :meth:`LaneChannel.flush` sends them in one call),
or until it has waited ``flush_after_s`` (at most half as long again). An allocation then
costs no lane call: the lanes learn of it with the step that uses it, as a model runner
learns its block table with the batch.

NOTE: a step sent through a compiled graph does not travel behind the lanes' ordinary
calls, so moves decided after it are not sent on their own until every lane has answered
it (they ride in the next step, or go once it is answered): sent at once, they could reach
a lane first, and it would apply them before the step (a gap in the step's own moves, or
the step writing pages freed and taken by another request after it was decided).

The channel speaks to lanes through a :class:`LaneTransport` (Ray actors in
:mod:`cpkv.actors.transport`, plain objects in tests), so it runs without Ray.
"""

from __future__ import annotations

import contextlib
import itertools
import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, Protocol

import numpy as np

from cpkv.core.moves import MovesNotApplied
from cpkv.core.steps import LaneReply, StepPacket

__all__ = [
    "ChannelClosedError",
    "LaneChannel",
    "LaneDeadError",
    "LaneTransport",
    "LaneUnreachableError",
    "StepAborted",
    "StepHandles",
    "StepNotSent",
]

# How long a decided page move may wait for a step to carry it before it is sent on its
# own (with every other move waiting then). On the 2-core machine (bench_actors.py
# --iters 300, 128k tokens at cp 4, two pairs alternating) 20 ms gave 1.27 / 1.41x a bare
# round and 200 ms 1.39 / 1.40x: no gain from waiting longer, and lanes lag less.
FLUSH_AFTER_S = 0.02
# A lane's waiting moves are sent at once when this many pile up (bounds a flush's size).
MAX_WAITING_MOVES = 64
# Polls with no move waiting after which the idle sender sleeps until woken (~1 s at the
# default flush_after_s): an idle coordinator costs no CPU, a busy one no wake a move.
IDLE_POLLS = 100


class LaneDeadError(RuntimeError):
    """The lane's actor died or is restarting: its reply will never come."""


class LaneUnreachableError(LaneDeadError):
    """The lane's actor could not be reached, as while Ray restarts it (Ray's
    ActorUnavailableError): this call is lost, a later one may be answered."""


class ChannelClosedError(RuntimeError):
    """A lane call queued after the coordinator shut down."""


class StepAborted(RuntimeError):
    """A compiled step's run ended because another lane died: this lane's answer is lost."""


class StepNotSent(StepAborted):
    """A compiled step that reached no lane (its graph could not be built, or was torn down
    when it was written): the page moves riding in it go again as ordinary calls."""


class LaneTransport(Protocol):
    """How lane calls are made: submitted without waiting, their results fetched later."""

    def submit(self, lane: int, method: str, *args: Any) -> Any:
        """Start ``method(*args)`` on ``lane``; return a handle to its result (never blocks)."""

    def result(self, handle: Any, timeout: float) -> Any:
        """The call's result. Raises LaneDeadError, TimeoutError, or the lane's own error."""

    def done(self, handles: list[Any]) -> list[bool]:
        """Which of ``handles`` have a result now (never blocks)."""

    # Optional: a transport that runs steps as one compiled graph has
    # ``execute_steps(packet: StepPacket) -> Future[list[LaneReply]]`` (one answer a lane)
    # and ``lane_reset(lane: int) -> None`` (the lane is lost: the graph to it is stale).


_STOP = object()
_WAKE = object()


class _Outbox:
    """The sender's queue: what is queued before :meth:`close` is still sent, a call queued
    after it fails at once (no sender is left to send it, and its caller would wait its
    whole timeout)."""

    def __init__(self) -> None:
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._closed = False

    def put(self, item: Any) -> None:
        with self._lock:
            if not self._closed:
                self._queue.put(item)
                return
        if isinstance(item, tuple):  # (lane, method, args, future, *move futures)
            error = ChannelClosedError("the coordinator has shut its lane channel down")
            for future in item[3:]:
                future.set_exception(error)

    def get(self, timeout: float | None) -> Any:
        return self._queue.get(timeout=timeout)

    def close(self) -> None:
        with self._lock:
            if not self._closed:
                self._closed = True
                self._queue.put(_STOP)


class LaneChannel:
    """Ordered submission of lane calls and tracking of the page moves in flight.

    Args:
        transport: how calls reach the lanes.
        cp_size: number of lanes.
        epoch: the coordinator's id; generations are ``"{epoch}:{n}"``, unique for the
            coordinator's lifetime (and across its restarts).
        flush_after_s: how long a page move waits for a step to carry it (at most 1.5x; default
            ``FLUSH_AFTER_S``).
    """

    def __init__(
        self,
        transport: LaneTransport,
        cp_size: int,
        epoch: str,
        flush_after_s: float | None = None,
    ) -> None:
        self._transport = transport
        self.cp_size = cp_size
        self._epoch = epoch
        self._flush_after_s = FLUSH_AFTER_S if flush_after_s is None else flush_after_s
        self._gen_numbers = itertools.count(1)
        self._generations: list[str | None] = [None] * cp_size
        self._next_seq = [1] * cp_size
        # (lane, generation, last seq, handle future, rides with a step) of the calls that
        # carried moves, not yet seen answered.
        self._pending: deque[tuple[int, str, int, Future, bool]] = deque()
        self._pending_lock = threading.Lock()
        self._outbox = _Outbox()
        # Per lane, the moves decided but not sent (``apply``'s arguments, in seq order).
        # NOTE: taken and queued under _waiting_lock together, so the outbox keeps seq order.
        self._waiting: list[list[tuple]] = [[] for _ in range(cp_size)]
        self._waiting_since: float | None = None
        self._sender_asleep = False  # waiting for an item with no timeout (_waiting_lock)
        # Compiled steps sent and not yet answered by every lane, and whether moves were
        # held back meanwhile (sent when the count is back at 0; both _waiting_lock).
        self._steps_in_flight = 0
        self._held_back = False
        self._waiting_lock = threading.Lock()
        self.num_calls = 0
        self.num_moves = 0
        self.num_riding_moves = 0
        self.num_moves_by_op: dict[str, int] = {}
        self._sender = threading.Thread(target=self._send_loop, daemon=True, name="cpkv-sender")
        self._sender.start()

    @property
    def flush_after_s(self) -> float:
        """The longest a page move waits for a step before it is sent on its own."""
        return self._flush_after_s

    @property
    def transport(self) -> LaneTransport:
        return self._transport

    @property
    def compiled(self) -> bool:
        """Steps go to every lane at once through a compiled graph (:meth:`submit_steps`)."""
        return hasattr(self._transport, "execute_steps")

    def reset_counters(self) -> None:
        """Zero the call counts (the pool was reset)."""
        self.num_calls = 0
        self.num_moves = 0
        self.num_riding_moves = 0
        self.num_moves_by_op.clear()

    # ------------------------------------------------------------- submitting
    def generation(self, lane: int) -> str | None:
        """``lane``'s current generation (``None`` before its first reset)."""
        return self._generations[lane]

    def new_generation(self, lane: int) -> str:
        """Start a new generation of ``lane`` (it is being reset): moves count from 1 again,
        and moves of the old generation no longer matter."""
        gen = f"{self._epoch}:{next(self._gen_numbers)}"
        with self._waiting_lock:
            self._generations[lane] = gen
            self._next_seq[lane] = 1
            self._waiting[lane].clear()  # the lane starts empty: nothing to move
        with self._pending_lock:
            self._pending = deque(p for p in self._pending if p[0] != lane)
        lane_reset = getattr(self._transport, "lane_reset", None)
        if lane_reset is not None:  # a compiled graph to the lane is stale
            lane_reset(lane)
        return gen

    def send_moves(
        self,
        lane: int,
        taken: np.ndarray,
        released: np.ndarray,
        op: str,
        owner: int = 0,
        cached: np.ndarray | None = None,
    ) -> int:
        """Number one page move for ``lane``; returns its sequence number. It reaches the
        lane with the lane's next step, flush, or within 1.5 ``flush_after_s``.

        ``taken`` pages go to namespace ``owner``; ``released`` pages are free; ``cached``
        pages leave their request for the prefix cache (nobody may write them from then on).

        NOTE: callers number moves in decision order (under the coordinator's lock); the
        lane applies them in that order.
        """
        with self._waiting_lock:
            gen = self._generations[lane]
            assert gen is not None, f"lane {lane} has no generation yet"
            seq = self._next_seq[lane]
            self._next_seq[lane] = seq + 1
            args = (gen, seq, taken, released, owner)
            if cached is not None and cached.size:
                args += (cached,)
            waiting = self._waiting[lane]
            waiting.append(args)
            if self._waiting_since is None:
                # NOTE: a polling sender is not woken: it sees this at its next poll. A wake
                # per free cost the decision GIL hand-offs (bench_decision.py --cp 4).
                self._waiting_since = time.monotonic()
                if self._sender_asleep:
                    self._sender_asleep = False
                    self._outbox.put(_WAKE)
            if len(waiting) >= MAX_WAITING_MOVES:
                self._send_or_hold(lane)
        self.num_moves += 1
        self.num_moves_by_op[op] = self.num_moves_by_op.get(op, 0) + 1
        return seq

    def flush(self) -> None:
        """Send every lane the moves waiting for it now (one call a lane that has some), or
        as soon as the compiled steps in flight are answered."""
        with self._waiting_lock:
            for lane in range(self.cp_size):
                if self._waiting[lane]:
                    self._send_or_hold(lane)
            self._waiting_since = None

    def _send_or_hold(self, lane: int) -> None:
        """:meth:`_send_waiting`, unless a compiled step is in flight (lock held)."""
        if self._steps_in_flight:
            self._held_back = True
        else:
            self._send_waiting(lane)

    def _step_answered(self, _replies: Future | None) -> None:
        """A compiled step's answers are in: the moves held back meanwhile may go."""
        with self._waiting_lock:
            self._steps_in_flight -= 1
            if self._steps_in_flight or not self._held_back:
                return
            self._held_back = False
            for lane in range(self.cp_size):
                if self._waiting[lane]:
                    self._send_waiting(lane)

    @property
    def num_waiting_moves(self) -> int:
        """Moves decided and not yet sent."""
        with self._waiting_lock:
            return sum(len(w) for w in self._waiting)

    def _take_waiting(self, lane: int) -> tuple | None:
        """``lane``'s waiting moves as one batch (lock held); ``None`` when there are none."""
        waiting = self._waiting[lane]
        if not waiting:
            return None
        batch = tuple(waiting)
        waiting.clear()
        return batch

    def _track(self, lane: int, batch: tuple, rides: bool) -> Future:
        """A future for the call carrying ``batch``, tracked until it is answered."""
        future: Future = Future()
        with self._pending_lock:
            self._pending.append((lane, batch[0][0], batch[-1][1], future, rides))
        return future

    def _send_waiting(self, lane: int) -> None:
        """Queue one ``apply_moves`` call with ``lane``'s waiting moves (lock held)."""
        batch = self._take_waiting(lane)
        assert batch is not None
        self._outbox.put((lane, "apply_moves", (batch,), self._track(lane, batch, False)))
        self.num_calls += 1

    def fence(self) -> list[tuple[str | None, int]]:
        """Per lane ``(generation, sequence number of the last move decided)``: a lane that
        has applied its move has every page decided so far (clients wait for it before a
        write, after :meth:`flush`)."""
        with self._waiting_lock:
            return [(g, n - 1) for g, n in zip(self._generations, self._next_seq, strict=True)]

    def submit(self, lane: int, method: str, *args: Any) -> Future:
        """Queue any lane call behind those already queued; a future of its handle."""
        future: Future = Future()
        self._outbox.put((lane, method, args, future))
        return future

    def submit_steps(self, step: Any) -> list[Future]:
        """Queue one step for every lane, each carrying the page moves waiting for it (applied
        before the step runs); per lane a future of its ``(status, result)`` handles.

        Through a compiled graph the step does not travel behind the lanes' queued calls:
        each lane gets a fence (the last move sent before those its step carries) and waits
        until it has applied it. The handles are then :class:`LaneReply` values.
        """
        with self._waiting_lock:
            batches = [self._take_waiting(r) for r in range(self.cp_size)]
            self._waiting_since = None
            self.num_riding_moves += sum(len(b) for b in batches if b is not None)
            moves = [None if b is None else self._track(r, b, True) for r, b in enumerate(batches)]
            if not self.compiled:
                out = []
                for r, (batch, move) in enumerate(zip(batches, moves, strict=True)):
                    future: Future = Future()
                    if batch is None:
                        self._outbox.put((r, "step", (step,), future))
                    else:
                        self._outbox.put((r, "step", (step, batch), future, move))
                    out.append(future)
                return out
            fences = tuple(
                (self._generations[r], self._next_seq[r] - 1 if b is None else b[0][1] - 1)
                for r, b in enumerate(batches)
            )
            self._steps_in_flight += 1
        packet = StepPacket(step, tuple(batches), fences, self._epoch)
        try:
            replies = self._transport.execute_steps(packet)
        except BaseException:
            self._unsend(batches, moves)
            self._step_answered(None)
            raise
        self.num_calls += 1
        if any(m is not None for m in moves):
            # NOTE: before _step_answered: moves held back behind this step go after these.
            replies.add_done_callback(self._moves_answer(batches, moves))
        replies.add_done_callback(self._step_answered)
        # NOTE: one future for every lane's answer, not a future and a wrapper a lane:
        # this side of a step 53-82 -> 33-42 us at cp 4 on the 2-core machine
        # (docs/bench-cpu/2026-12-06-step-handles/channel_handles.py).
        return [StepHandles(replies, r) for r in range(self.cp_size)]

    def _unsend(self, batches: list[tuple | None], moves: list[Future | None]) -> None:
        """A step was not sent: the moves it took go back in front of those decided since,
        to go as ordinary calls (no lane saw them, so the order of each lane's moves holds)."""
        self._untrack(moves)
        with self._waiting_lock:
            for lane, batch in enumerate(batches):
                if batch is not None:
                    self.num_riding_moves -= len(batch)
                    self._waiting[lane][:0] = batch
                    self._send_or_hold(lane)

    def _untrack(self, moves: list[Future | None]) -> None:
        """Stop tracking the riding moves of a step that was not delivered (they go again as
        ordinary calls, tracked as those)."""
        taken = {id(m) for m in moves if m is not None}
        with self._pending_lock:
            self._pending = deque(p for p in self._pending if id(p[3]) not in taken)
        for move in moves:  # a back-pressure wait on one of them ends now
            if move is not None:
                move.cancel()

    def _moves_answer(
        self, batches: list[tuple | None], moves: list[Future | None]
    ) -> Callable[[Future], None]:
        """A callback that answers the moves that rode with a compiled step by each lane's
        status (its error when the step failed there); a step that reached no lane sends
        them again instead (:meth:`_resend`)."""

        def answer(replies: Future) -> None:
            unsent: list[tuple | None] = [None] * self.cp_size
            for lane, (move, reply) in enumerate(zip(moves, replies.result(), strict=True)):
                if move is None:
                    continue
                if isinstance(reply.error, StepNotSent):
                    unsent[lane] = batches[lane]
                else:
                    move.set_result(_split(reply)[0])
            if any(b is not None for b in unsent):
                taken = [m if b is not None else None for m, b in zip(moves, unsent, strict=True)]
                self._resend(unsent, taken)

        return answer

    def _resend(self, batches: list[tuple | None], moves: list[Future | None]) -> None:
        """The moves of a compiled step that reached no lane, each lane's as one ordinary
        call now. NOTE: they need not wait for steps in flight, as moves decided later do:
        every step before this one was answered first (one thread reads them in order), so
        no move of an earlier step is still on its way; and a later step's fence names
        them, so it waits for them at the lane."""
        self._untrack(moves)
        with self._waiting_lock:
            for lane, batch in enumerate(batches):
                if batch is None or batch[0][0] != self._generations[lane]:
                    continue  # the lane was reset since: its old moves no longer matter
                self.num_riding_moves -= len(batch)
                self._outbox.put((lane, "apply_moves", (batch,), self._track(lane, batch, False)))
                self.num_calls += 1

    def call(self, lane: int, method: str, *args: Any, timeout: float) -> Any:
        """Queue a lane call and wait for its result (never call this holding a lock
        that the caller's other threads need)."""
        handle = self.submit(lane, method, *args).result(timeout=timeout)
        return self._transport.result(handle, timeout)

    def result(self, future: Future, timeout: float) -> Any:
        """The result of a call queued with :meth:`submit`."""
        return self._transport.result(future.result(timeout=timeout), timeout)

    def outcome(self, handle: Any, timeout: float) -> Any:
        """The result behind a call's handle (a transport handle or a :class:`LaneReply`).
        Raises: the call's error, LaneDeadError, TimeoutError."""
        if isinstance(handle, LaneReply):
            return handle.unwrap()
        return self._transport.result(handle, timeout)

    def done(self, handles: list[Any]) -> list[bool]:
        """Which of ``handles`` have their result now (never blocks)."""
        pending = [h for h in handles if not isinstance(h, LaneReply)]
        ready = iter(self._transport.done(pending) if pending else [])
        return [True if isinstance(h, LaneReply) else next(ready) for h in handles]

    # ---------------------------------------------------------------- replies
    def poll(self) -> list[tuple[int, BaseException]]:
        """Forget the moves answered by now; return ``(lane, error)`` of those that failed
        in their lane's current generation (a move that rode with a step failed only when the
        lane refused it or died: the step's own failures are the step's). Never blocks."""
        with self._pending_lock:
            submitted = [p for p in self._pending if p[3].done()]
        if not submitted:
            return []
        finished, errors = [], []
        handles = [(p, p[3].result()) for p in submitted if p[3].exception() is None]
        for p in submitted:
            if p[3].exception() is not None:
                finished.append(p)
                errors.append((p, p[3].exception()))
        done = self.done([h for _, h in handles]) if handles else []
        for (p, handle), is_done in zip(handles, done, strict=True):
            if not is_done:
                continue
            finished.append(p)
            try:
                self.outcome(handle, 0.0)
            except (MovesNotApplied, LaneDeadError) as e:
                errors.append((p, e))
            except Exception as e:  # any failure of a move call: the lane left the mirror
                if not p[4]:
                    errors.append((p, e))
        failures = [(p[0], e) for p, e in errors if p[1] == self._generations[p[0]]]
        ids = {id(p) for p in finished}
        with self._pending_lock:
            self._pending = deque(p for p in self._pending if id(p) not in ids)
        return failures

    @property
    def num_pending(self) -> int:
        with self._pending_lock:
            return len(self._pending)

    def wait_oldest(self, timeout: float) -> None:
        """Block until the oldest move in flight is answered (back-pressure), or ``timeout``
        (a move that rode in a step is answered when the step is)."""
        with self._pending_lock:
            if not self._pending:
                return
            future = self._pending[0][3]
        with contextlib.suppress(Exception):  # poll() reports failures; here we only wait
            self.outcome(future.result(timeout=timeout), timeout)

    def close(self, timeout: float = 0.0) -> None:
        """Stop the sender thread (queued calls are still submitted first; later ones fail
        with :class:`ChannelClosedError`); wait up to ``timeout`` for it to end."""
        self._outbox.close()
        if timeout > 0:
            self._sender.join(timeout)

    # ---------------------------------------------------------------- sender
    def _send_loop(self) -> None:
        # With no move waiting, the sender polls every half flush_after_s for one that began
        # to (so a move waits at most 1.5 flush_after_s when no step carries it); after
        # IDLE_POLLS such polls it sleeps until the next move or call wakes it.
        idle_polls = 0
        while True:
            wait: float | None
            with self._waiting_lock:
                since = self._waiting_since
                if since is not None:
                    idle_polls = 0
                    wait = since + self._flush_after_s - time.monotonic()
                elif idle_polls >= IDLE_POLLS:
                    self._sender_asleep, wait = True, None
                else:
                    wait = self._flush_after_s / 2
            if wait is not None and wait <= 0:
                self.flush()  # moves waited flush_after_s for a step: send them on their own
                continue
            try:
                item = self._outbox.get(timeout=wait)
            except queue.Empty:
                idle_polls += 1
                continue
            if self._sender_asleep:  # woken by a call, not a move: poll again from here
                with self._waiting_lock:
                    self._sender_asleep = False
            idle_polls = 0
            if item is _STOP:
                return
            if item is _WAKE:
                continue
            lane, method, args, future, *move = item
            try:
                handle = self._transport.submit(lane, method, *args)
                status = handle[0] if move else None  # a step's (status, result) handles
            except Exception as e:  # a submission error surfaces like a failed call
                future.set_exception(e)
                for f in move:
                    f.set_exception(e)
                continue
            future.set_result(handle)
            for f in move:  # the moves rode with a step: they are answered by its status
                f.set_result(status)


class StepHandles:
    """One lane's view of a compiled step's answers: future-like (``done``, ``exception``,
    ``result``), its result the ``(status, result)`` handles an ordinary step call gives.

    Args:
        replies: the future of every lane's :class:`LaneReply`.
        lane: which of them this is.
    """

    __slots__ = ("_lane", "_pair", "_replies")

    def __init__(self, replies: Future, lane: int) -> None:
        self._replies = replies
        self._lane = lane
        self._pair: tuple[LaneReply, LaneReply] | None = None  # split once, read often

    def done(self) -> bool:
        return self._replies.done()

    def exception(self, timeout: float | None = None) -> BaseException | None:
        return self._replies.exception(timeout)

    def result(self, timeout: float | None = None) -> tuple[LaneReply, LaneReply]:
        """The lane's ``(status, result)``; its error as both when the step failed there.
        Raises: TimeoutError (``concurrent.futures``) when no answer came in ``timeout``."""
        if self._pair is None:
            self._pair = _split(self._replies.result(timeout)[self._lane])
        return self._pair


def _split(reply: LaneReply) -> tuple[LaneReply, LaneReply]:
    """A lane's compiled :class:`LaneReply` of ``(status, result)`` as the two handles."""
    if reply.error is not None:
        return reply, reply
    status, result = reply.value
    return LaneReply(status), LaneReply(result)
