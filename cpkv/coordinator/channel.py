"""LaneChannel: the coordinator's ordered line to its lanes, with the replies still pending.

Every lane call the coordinator makes goes through one sender thread, in the
order the calls were queued, so each lane receives its page moves in decision
order (Ray keeps one caller's calls to an actor in order) and the coordinator
answers its caller without waiting for the submissions. Page moves carry the
lane's generation and a per-lane sequence number; the lane checks them.

The channel speaks to lanes through a :class:`LaneTransport` (Ray actors in
:mod:`cpkv.actors.transport`, plain objects in tests), so it runs without Ray.
"""

from __future__ import annotations

import contextlib
import itertools
import queue
import threading
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from cpkv.core.moves import MovesNotApplied
from cpkv.core.steps import LaneReply, StepPacket

__all__ = ["LaneChannel", "LaneDeadError", "LaneTransport", "RidingMoves", "StepAborted"]


class LaneDeadError(RuntimeError):
    """The lane's actor died or is restarting: its reply will never come."""


class StepAborted(RuntimeError):
    """A compiled step's run ended because another lane died: this lane's answer is lost."""


@dataclass(frozen=True, slots=True)
class RidingMoves:
    """A page move registered for a lane that travels inside its next step call.

    Attributes:
        args: the move's arguments as the lane's ``apply`` takes them.
        future: set to the step's status handle once the step is submitted.
    """

    args: tuple
    future: Future


class LaneTransport(Protocol):
    """How lane calls are made: submitted without waiting, their results fetched later."""

    def submit(self, lane: int, method: str, *args: Any) -> Any:
        """Start ``method(*args)`` on ``lane``; return a handle to its result (never blocks)."""

    def result(self, handle: Any, timeout: float) -> Any:
        """The call's result. Raises LaneDeadError, TimeoutError, or the lane's own error."""

    def done(self, handles: list[Any]) -> list[bool]:
        """Which of ``handles`` have a result now (never blocks)."""

    # Optional: a transport that runs steps as one compiled graph has
    # ``execute_steps(packet: StepPacket) -> list[Future[LaneReply]]`` (one per lane).


_STOP = object()


class LaneChannel:
    """Ordered submission of lane calls and tracking of the page moves in flight.

    Args:
        transport: how calls reach the lanes.
        cp_size: number of lanes.
        epoch: the coordinator's id; generations are ``"{epoch}:{n}"``, unique for the
            coordinator's lifetime (and across its restarts).
    """

    def __init__(self, transport: LaneTransport, cp_size: int, epoch: str) -> None:
        self._transport = transport
        self.cp_size = cp_size
        self._epoch = epoch
        self._gen_numbers = itertools.count(1)
        self._generations: list[str | None] = [None] * cp_size
        self._next_seq = [1] * cp_size
        # (lane, generation, seq, handle future, rides with a step) of moves not yet seen
        # answered.
        self._pending: deque[tuple[int, str, int, Future, bool]] = deque()
        self._pending_lock = threading.Lock()
        self._outbox: queue.SimpleQueue = queue.SimpleQueue()
        # Per lane, releases held back (this generation): they ride with the lane's next move.
        self._held_back: list[list[np.ndarray]] = [[] for _ in range(cp_size)]
        self.num_calls = 0
        self.num_riding_moves = 0
        self.num_moves_by_op: dict[str, int] = {}
        self._sender = threading.Thread(target=self._send_loop, daemon=True, name="cpkv-sender")
        self._sender.start()

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
        self._generations[lane] = gen
        self._next_seq[lane] = 1
        self._held_back[lane].clear()  # the lane starts empty: nothing to release
        with self._pending_lock:
            self._pending = deque(p for p in self._pending if p[0] != lane)
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
        """Queue one page move for ``lane``; returns its sequence number.

        ``taken`` pages go to namespace ``owner``; ``cached`` pages leave their request
        for the prefix cache (nobody may write them from then on).

        NOTE: callers queue moves in decision order (under the coordinator's lock);
        the sender keeps that order.
        """
        args, future = self._register_move(lane, taken, released, op, owner, cached, False)
        self._outbox.put((lane, "apply", args, future))
        self.num_calls += 1
        return args[1]

    def moves_for_step(
        self,
        lane: int,
        taken: np.ndarray,
        released: np.ndarray,
        op: str,
        owner: int = 0,
        cached: np.ndarray | None = None,
    ) -> RidingMoves | None:
        """Register ``lane``'s page move (with the releases held back for it) to ride inside
        its next step call (:meth:`submit_step`) instead of a call of its own: one lane task
        fewer before the step. ``None`` when there is nothing to move."""
        if not (taken.size or released.size or self._held_back[lane]) and (
            cached is None or not cached.size
        ):
            return None
        args, future = self._register_move(lane, taken, released, op, owner, cached, True)
        self.num_riding_moves += 1
        return RidingMoves(args, future)

    def _register_move(
        self,
        lane: int,
        taken: np.ndarray,
        released: np.ndarray,
        op: str,
        owner: int,
        cached: np.ndarray | None,
        rides: bool,
    ) -> tuple[tuple, Future]:
        gen = self._generations[lane]
        assert gen is not None, f"lane {lane} has no generation yet"
        held = self._held_back[lane]
        if held:  # released before the pages taken here (a page may be in both)
            released = np.concatenate([*held, released])
            held.clear()
        seq = self._next_seq[lane]
        self._next_seq[lane] = seq + 1
        future: Future = Future()
        with self._pending_lock:
            self._pending.append((lane, gen, seq, future, rides))
        args = (gen, seq, taken, released, owner)
        if cached is not None and cached.size:
            args += (cached,)
        self.num_moves_by_op[op] = self.num_moves_by_op.get(op, 0) + 1
        return args, future

    def hold_release(self, lane: int, released: np.ndarray) -> None:
        """Keep a move that only releases pages until ``lane``'s next move (it goes first
        there) or :meth:`flush_releases`: one lane call fewer per free.

        NOTE: a freed page matters to its lane only once it is taken again, which sends the
        release first, or when the lane's count is checked (flush first). Until then its
        former owner's late writes still land in it, on a page nobody holds.
        """
        self._held_back[lane].append(released)

    def flush_releases(self) -> None:
        """Send every release held back (before the lanes' counts are compared)."""
        empty = np.empty(0, dtype=np.int32)
        for lane, held in enumerate(self._held_back):
            if held:
                self.send_moves(lane, empty, empty, "release")

    def fence(self) -> list[tuple[str | None, int]]:
        """Per lane ``(generation, sequence number of the last move queued)``: a lane that has
        applied its move has every page decided so far (clients wait for it before a write)."""
        return [(g, n - 1) for g, n in zip(self._generations, self._next_seq, strict=True)]

    def submit(self, lane: int, method: str, *args: Any) -> Future:
        """Queue any lane call behind those already queued; a future of its handle."""
        future: Future = Future()
        self._outbox.put((lane, method, args, future))
        return future

    def submit_step(self, lane: int, step: Any, moves: RidingMoves | None) -> Future:
        """Queue ``lane``'s step call, carrying its page move when there is one; a future of
        its ``(status, result)`` handles."""
        if moves is None:
            return self.submit(lane, "step", step)
        future: Future = Future()
        self._outbox.put((lane, "step", (step, moves.args), future, moves.future))
        return future

    def submit_steps(self, step: Any, moves: list[RidingMoves | None]) -> list[Future]:
        """Queue one step for every lane, each carrying its page move when it has one; per
        lane a future of its ``(status, result)`` handles.

        Through a compiled graph the step does not travel behind the lanes' queued calls:
        each lane gets a fence (the last move queued for it before the step's own) and waits
        until it has applied it. The handles are then :class:`LaneReply` values.
        """
        if not self.compiled:
            return [self.submit_step(r, step, moves[r]) for r in range(self.cp_size)]
        fences = tuple(
            (self._generations[r], self._next_seq[r] - 1 if m is None else m.args[1] - 1)
            for r, m in enumerate(moves)
        )
        args = tuple(None if m is None else m.args for m in moves)
        replies = self._transport.execute_steps(StepPacket(step, args, fences, self._epoch))
        self.num_calls += 1
        out = []
        for reply, m in zip(replies, moves, strict=True):
            handles: Future = Future()
            reply.add_done_callback(_split_reply(handles, None if m is None else m.future))
            out.append(handles)
        return out

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

    def close(self) -> None:
        """Stop the sender thread (queued calls are still submitted first)."""
        self._outbox.put(_STOP)

    # ---------------------------------------------------------------- sender
    def _send_loop(self) -> None:
        while True:
            item = self._outbox.get()
            if item is _STOP:
                return
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
            for f in move:  # the move rode with a step: it is answered by the step's status
                f.set_result(status)


def _split_reply(handles: Future, move: Future | None):
    """A callback that turns a lane's compiled :class:`LaneReply` of ``(status, result)``
    into the ``(status, result)`` handles an ordinary step call gives, and answers the move
    that rode with it by the status."""

    def split(reply_future: Future) -> None:
        reply: LaneReply = reply_future.result()
        if reply.error is not None:
            pair = (reply, reply)
        else:
            status, result = reply.value
            pair = (LaneReply(status), LaneReply(result))
        handles.set_result(pair)
        if move is not None:
            move.set_result(pair[0])

    return split
