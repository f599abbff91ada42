"""LaneHealth: which lanes are up, heartbeats, and bringing a lost lane back off the lock.

A lane is *up* (serving), *restarting* (lost: its requests were failed, it is
being reset) or *dead* (it did not come back in time). Losing a lane takes the
coordinator's lock only to drop its state; waiting for Ray to restart the actor
happens in a thread of its own, so calls that do not need that lane answer at
once meanwhile.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Hashable, Iterator
from typing import Any

from cpkv.coordinator.channel import LaneChannel, LaneDeadError

__all__ = ["DEAD", "RESTARTING", "UP", "LaneHealth"]

logger = logging.getLogger("cpkv.health")

UP, RESTARTING, DEAD = "up", "restarting", "dead"

# A lane whose actor died this many times in a row while we reset it is gone for good.
_MAX_DEATHS = 5


class LaneHealth:
    """Lane states, incarnations and recovery.

    Args:
        channel: the coordinator's line to the lanes.
        lock: the coordinator's lock (held by callers of :meth:`fail`).
        on_lost: called under the lock with ``(lane, why)`` when a lane is lost; drops
            its requests and returns their ids.
        on_back: called under the lock with ``lane`` once it is reset and serving again.
        restart_timeout_s: how long a lost lane may take to come back.
        num_pages: the shard size a reset (re)allocates (a restarted lane sized from free
            memory has no shard until then).
        hang_s: a lane whose heartbeats go unanswered this long is hung: it is killed
            (``kill``) and brought back like a dead one. ``None``: a slow lane is only
            counted, never killed.
        kill: ends a lane's process so that it restarts (Ray: ``ray.kill``).
    """

    def __init__(
        self,
        channel: LaneChannel,
        lock: threading.RLock,
        *,
        on_lost: Callable[[int, str], list[Hashable]],
        on_back: Callable[[int], None],
        restart_timeout_s: float,
        num_pages: int | None = None,
        hang_s: float | None = None,
        kill: Callable[[int], None] | None = None,
    ) -> None:
        cp = channel.cp_size
        self._num_pages = num_pages
        self._channel = channel
        self._lock = lock
        self._on_lost = on_lost
        self._on_back = on_back
        self.restart_timeout_s = restart_timeout_s
        self.states: list[str] = [RESTARTING] * cp
        self.incarnations: list[str | None] = [None] * cp
        self.losses: list[tuple[int, list[Hashable]]] = []
        self.mismatches = 0
        self.slow_heartbeats = 0
        self.num_hung = 0
        self._hang_s = hang_s
        self._kill = kill
        # When each lane last answered a heartbeat (or came back); None while not up.
        self._last_answer: list[float | None] = [None] * cp
        self._last_poll = 0.0
        self._threads: list[threading.Thread] = []

    # ------------------------------------------------------------------ states
    def is_up(self, lane: int) -> bool:
        return self.states[lane] == UP

    def lanes_in(self, state: str) -> list[int]:
        return [r for r, s in enumerate(self.states) if s == state]

    # ---------------------------------------------------------------- recovery
    def reset_all(self) -> None:
        """Reset every lane to an empty shard and wait (start-up and pool reset).

        Call without the lock: it waits for the lanes.
        """
        with self._lock:
            gens = []
            for lane in range(self._channel.cp_size):
                self.states[lane] = RESTARTING
                gens.append(self._channel.new_generation(lane))
        threads = [
            threading.Thread(target=self._restart, args=(lane, gen), daemon=True)
            for lane, gen in enumerate(gens)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join()

    def fail(self, lane: int, why: str) -> list[Hashable]:
        """``lane`` is lost: drop its state now, bring it back in the background.

        NOTE: the caller holds the lock. Returns the requests lost ([] when the lane
        was already down).
        """
        if self.states[lane] != UP:
            return []
        self.states[lane] = RESTARTING
        self._last_answer[lane] = None
        lost = self._on_lost(lane, why)
        self.losses.append((lane, lost))
        gen = self._channel.new_generation(lane)
        logger.warning("lane %d lost (%s): %d requests failed: %s", lane, why, len(lost), lost)
        thread = threading.Thread(
            target=self._restart, args=(lane, gen), daemon=True, name=f"cpkv-recover-{lane}"
        )
        self._threads = [t for t in self._threads if t.is_alive()] + [thread]
        thread.start()
        return lost

    def wait_recovered(self, timeout: float) -> bool:
        """Wait for recoveries in flight (tests); True when none is left."""
        end = time.monotonic() + timeout
        for t in list(self._threads):
            t.join(max(0.0, end - time.monotonic()))
        return not any(t.is_alive() for t in self._threads)

    def _restart(self, lane: int, gen: str) -> None:
        """Reset ``lane`` into generation ``gen``, retrying while Ray restarts it (no lock held)."""
        deadline = time.monotonic() + self.restart_timeout_s
        deaths = 0
        while True:
            left = deadline - time.monotonic()
            try:
                incarnation = self._channel.call(
                    lane, "reset", gen, self._num_pages, timeout=max(0.1, left)
                )
                break
            except Exception as e:
                deaths += isinstance(e, LaneDeadError)
                if deaths >= _MAX_DEATHS or time.monotonic() >= deadline:
                    with self._lock:
                        if self._channel.generations[lane] == gen:
                            self.states[lane] = DEAD
                    logger.error("lane %d did not come back: %s", lane, type(e).__name__)
                    return
                time.sleep(0.05)
        with self._lock:
            if self._channel.generations[lane] != gen:
                return  # lost again meanwhile: a newer recovery owns it
            self.incarnations[lane] = incarnation
            self.states[lane] = UP
            self._last_answer[lane] = time.monotonic()
            self._on_back(lane)

    # --------------------------------------------------------------- heartbeat
    def send_heartbeats(self) -> dict[int, tuple[str | None, str | None, Any]]:
        """Queue a heartbeat to every serving lane, behind its page moves.

        NOTE: the caller holds the lock, so the replies compare with the mirror as it is now.

        Returns:
            per lane ``(incarnation known, generation, future of the reply)``.
        """
        return {
            r: (
                self.incarnations[r],
                self._channel.generations[r],
                self._channel.submit(r, "heartbeat"),
            )
            for r in self.lanes_in(UP)
        }

    def replies(
        self, sent: dict[int, tuple[str | None, str | None, Any]], timeout: float
    ) -> Iterator[tuple[int, str | None, str | None, Any]]:
        """``(lane, known, generation, reply)`` for each heartbeat sent, the reply being
        ``(incarnation, held)`` or the error that came instead; waits without the lock."""
        for r, (known, gen, future) in sent.items():
            try:
                reply = self._channel.result(future, timeout)
            except Exception as e:
                reply = e
            yield r, known, gen, reply

    def heartbeat(self, expected_held: Callable[[], list[int]], timeout: float) -> None:
        """One heartbeat round: find lanes that died, restarted or disagree with the mirror.

        Takes the lock only to read and to act; waits for the lanes without it. A slow
        lane is not a lost lane: only a dead or restarted actor is.
        """
        with self._lock:
            self.fail_moves()
            expected = expected_held()
            sent = self.send_heartbeats()
        if self._hang_s is not None:
            timeout = min(timeout, max(0.1, self._hang_s / 2))
        for r, known, gen, reply in self.replies(sent, timeout):
            if isinstance(reply, TimeoutError):
                self.slow_heartbeats += 1
                self._check_hung(r, gen)
                continue
            self._last_answer[r] = time.monotonic()
            if isinstance(reply, LaneDeadError):
                incarnation, held = None, None
            elif isinstance(reply, BaseException):
                raise reply
            else:
                incarnation, held = reply
            if incarnation != known:
                with self._lock:
                    if self._channel.generations[r] == gen:
                        self.fail(r, "heartbeat: lane restarted or died")
            elif held != expected[r]:
                self.mismatches += 1
                logger.error("lane %d holds %d pages but the mirror says %d", r, held, expected[r])

    def _check_hung(self, lane: int, gen: str | None) -> None:
        """A lane silent for ``hang_s`` (alive but not answering: stopped, deadlocked, stuck
        in a collective) is treated as lost: killed, so that it restarts, and reset."""
        last = self._last_answer[lane]
        if self._hang_s is None or last is None or time.monotonic() - last < self._hang_s:
            return
        with self._lock:
            if self._channel.generations[lane] != gen or self.states[lane] != UP:
                return
        # NOTE: killed before it is failed, so the reset that recovery sends next reaches
        # the restarted process, not the stuck one.
        if self._kill is not None:
            try:
                self._kill(lane)
            except Exception:
                logger.exception("could not kill hung lane %d", lane)
        with self._lock:
            if self._channel.generations[lane] != gen or self.states[lane] != UP:
                return
            self.num_hung += 1
            self.fail(lane, f"hung: no heartbeat answered for {self._hang_s:.1f}s")

    def fail_moves(self, min_interval_s: float = 0.0) -> None:
        """Fail the lanes whose page moves came back with an error (caller holds the lock).

        ``min_interval_s``: skip the poll when the last one is more recent (each poll asks
        Ray about every move in flight; the allocation path polls at most this often).
        """
        now = time.monotonic()
        if min_interval_s and now - self._last_poll < min_interval_s:
            return
        self._last_poll = now
        for lane, error in self._channel.poll():
            if self.states[lane] == UP:
                self.fail(lane, f"a page move failed: {type(error).__name__}: {error}")

    def probe(self, lane: int, timeout: float) -> bool:
        """True when ``lane`` answers as the incarnation we know (no lock held)."""
        with self._lock:
            known, gen = self.incarnations[lane], self._channel.generations[lane]
            if self.states[lane] != UP:
                return False
            future = self._channel.submit(lane, "heartbeat")
        try:
            incarnation, _ = self._channel.result(future, timeout)
        except TimeoutError:
            return True  # slow, not lost
        except Exception:
            incarnation = None
        if incarnation == known:
            return True
        with self._lock:
            if self._channel.generations[lane] == gen:
                self.fail(lane, "probe: lane restarted or died")
        return False
