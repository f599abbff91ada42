"""LaneSupervisor: the one table of the lanes' state, their group, and bringing lost lanes back.

Per lane the table holds its state, the incarnation it answered last and when it last
answered a heartbeat; beside it, the lanes' collective group (its id and backend). A lane is
*up* (serving), *restarting* (lost: its requests were failed, it is being reset) or *dead* (it
did not come back in time). The supervisor alone writes the allocator's
:class:`cpkv.core.availability.LaneAvailability`.

It has a lock of its own and never calls the coordinator: heartbeat replies, probes and
failed page moves only *record* a lane as lost; the coordinator takes the record at its next
call (:meth:`LaneSupervisor.settle`, its lock held), fails the lane's requests, and the
supervisor brings the lane back (wait for Ray's restart, reset) in a thread of its own, so
calls that do not need that lane answer at once meanwhile.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from cpkv.coordinator.channel import LaneChannel, LaneDeadError, LaneUnreachableError
from cpkv.core.availability import LaneAvailability
from cpkv.core.backend import choose_backend, device_id
from cpkv.core.steps import group_id
from cpkv.errors import KVCapacityWaitError

__all__ = ["DEAD", "RESTARTING", "UP", "LaneSupervisor"]

logger = logging.getLogger("cpkv.supervisor")

UP, RESTARTING, DEAD = "up", "restarting", "dead"

# A lane whose actor died this many times in a row while we reset it is gone for good.
_MAX_DEATHS = 5


@dataclass(slots=True)
class _Lane:
    """One lane's row of the table.

    Attributes:
        state: ``up``, ``restarting`` or ``dead``.
        incarnation: the lane process's id as of its last reset.
        heartbeat: its heartbeat in flight, sent and not yet answered (``None``: none is).
        unanswered_since: when the oldest heartbeat it has not answered was sent (``None``:
            it answered the last one); a heartbeat that came back with an error is no answer.
        lost: why it was seen lost since the last :meth:`LaneSupervisor.settle` (``None``: it
            was not).
        back: it came back since the last settle (it takes pages again from then on).
    """

    state: str = RESTARTING
    incarnation: str | None = None
    heartbeat: Any = None
    unanswered_since: float | None = None
    lost: str | None = None
    back: bool = False


@dataclass(slots=True)
class _Sent:
    """A heartbeat a round reads: the incarnation and generation known when it was sent, its
    reply's future, and whether this round sent it (a heartbeat still unanswered from an
    earlier round is read again, not stacked behind by another: its page count is of the
    moves decided when it was sent, so it is not compared with the mirror of now)."""

    known: str | None
    gen: str | None
    future: Any
    fresh: bool


class LaneSupervisor:
    """Lane states, incarnations, the lane group, and recovery.

    Args:
        channel: the coordinator's line to the lanes.
        epoch: the coordinator's id (lane groups are named after it).
        restart_timeout_s: how long a lost lane may take to come back.
        num_pages: the shard size a reset (re)allocates (a restarted lane sized from free
            memory has no shard until then).
        hang_s: a lane that leaves a heartbeat unanswered this long is hung: it is killed
            (``kill``) and brought back like a dead one. ``None``: a slow lane is only
            counted, never killed.
        kill: ends a lane's process so that it restarts (Ray: ``ray.kill``).
    """

    def __init__(
        self,
        channel: LaneChannel,
        epoch: str,
        *,
        restart_timeout_s: float,
        num_pages: int | None = None,
        hang_s: float | None = None,
        kill: Callable[[int], None] | None = None,
    ) -> None:
        self._channel = channel
        self._epoch = epoch
        self._num_pages = num_pages
        self._hang_s = hang_s
        self._kill = kill
        self._restart_timeout_s = restart_timeout_s
        self._lock = threading.Lock()
        self._lanes = [_Lane() for _ in range(channel.cp_size)]
        # The allocator's record of the lanes that take pages (given by restart_all).
        self._availability: LaneAvailability | None = None
        self._threads: list[threading.Thread] = []
        self._closed = threading.Event()  # recoveries stop retrying (the coordinator shut down)
        self._last_poll = 0.0
        self.num_mismatches = 0
        self.num_slow_heartbeats = 0
        self.num_heartbeat_errors = 0
        self.num_hung = 0
        # The lanes' collective group: built before a step (ensure_group), stale (None) after a
        # lane is lost or comes back, or a step failed. Builds take _group_lock, one at a time.
        self._group_lock = threading.Lock()
        self._group_id: str | None = None
        self._group_count = 0
        self._group_drops = 0
        self._backend: str | None = None

    # ------------------------------------------------------------------ states
    def states(self) -> list[str]:
        """Each lane's state, in lane order."""
        with self._lock:
            return [row.state for row in self._lanes]

    # ---------------------------------------------------------------- recovery
    def restart_all(self, availability: LaneAvailability) -> None:
        """Reset every lane to an empty shard for an allocator that starts empty (start-up
        and pool reset), taking over its ``availability``; :meth:`wait_recovered` waits.

        NOTE: the coordinator's lock is held (see :meth:`settle`).
        """
        with self._lock:
            self._availability = availability
            self.num_mismatches = 0
            for lane in range(len(self._lanes)):
                self._recover(lane)

    def settle(self, min_poll_s: float = 0.0) -> list[tuple[int, str]]:
        """Act on what the lanes showed since the last call: a lane that came back takes
        pages again; a lane seen lost (or whose page move failed) is taken out of allocation
        and brought back in the background.

        NOTE: the coordinator's lock is held: page moves are queued under it, so a lane's new
        generation never falls between the moves of one decision.

        Args:
            min_poll_s: skip the poll of the page moves when the last one is more recent
                (each poll asks Ray about every move in flight).

        Returns:
            ``(lane, why)`` of each lane lost now: the coordinator fails its requests.
        """
        if self._closed.is_set():  # shut down: its calls fail as closed, not as lost lanes
            return []
        failed = self._poll_moves(min_poll_s)
        lost = []
        with self._lock:
            for lane, why in failed:
                if self._lanes[lane].lost is None:
                    self._lanes[lane].lost = why
            for lane, row in enumerate(self._lanes):
                if row.back:
                    row.back = False
                    if row.state == UP:
                        self._availability.set_available(lane, True)
                if row.lost is not None and row.state == UP:
                    lost.append((lane, row.lost))
                    self._recover(lane)
                row.lost = None
        return lost

    def wait_recovered(self, timeout: float | None) -> bool:
        """Wait for recoveries in flight (``None``: as long as they take); True when none is
        left."""
        with self._lock:
            threads = list(self._threads)
        end = None if timeout is None else time.monotonic() + timeout
        for t in threads:
            t.join(None if end is None else max(0.0, end - time.monotonic()))
        return not any(t.is_alive() for t in threads)

    def close(self) -> None:
        """Stop the recoveries in flight (they end at their next retry) and start none."""
        self._closed.set()

    def _recover(self, lane: int) -> None:
        """Take ``lane`` out and start its reset into a new generation (lock held)."""
        row = self._lanes[lane]
        row.state, row.lost, row.back = RESTARTING, None, False
        row.heartbeat = row.unanswered_since = None
        self._availability.set_available(lane, False)
        self._drop_group_locked()
        gen = self._channel.new_generation(lane)
        thread = threading.Thread(
            target=self._restart, args=(lane, gen), daemon=True, name=f"cpkv-recover-{lane}"
        )
        self._threads = [t for t in self._threads if t.is_alive()] + [thread]
        thread.start()

    def _restart(self, lane: int, gen: str) -> None:
        """Reset ``lane`` into generation ``gen``, retrying while Ray restarts it (its own
        thread; no coordinator lock)."""
        deadline = time.monotonic() + self._restart_timeout_s
        deaths = 0
        while True:
            if self._channel.generation(lane) != gen or self._closed.is_set():
                return  # lost again or reset meanwhile (a newer recovery owns it), or shut down
            left = deadline - time.monotonic()
            try:
                incarnation = self._channel.call(
                    lane, "reset", gen, self._num_pages, timeout=max(0.1, left)
                )
                break
            except Exception as e:
                # NOTE: unreachable is not a death: Ray answers so while it restarts the
                # actor, several times over seconds (three in 5.3 s, 2-core machine).
                deaths += isinstance(e, LaneDeadError) and not isinstance(e, LaneUnreachableError)
                if deaths >= _MAX_DEATHS or time.monotonic() >= deadline:
                    with self._lock:
                        if self._channel.generation(lane) == gen:
                            self._lanes[lane].state = DEAD
                    logger.error("lane %d did not come back: %s", lane, type(e).__name__)
                    return
                self._closed.wait(0.05)
        with self._lock:
            if self._channel.generation(lane) != gen:
                return  # lost again meanwhile: a newer recovery owns it
            row = self._lanes[lane]
            row.incarnation, row.state, row.back = incarnation, UP, True
            row.heartbeat = row.unanswered_since = None
            self._drop_group_locked()  # the restarted lane joins a new group

    def _report_lost(self, lane: int, gen: str | None, why: str) -> None:
        """Record ``lane`` as lost if it still is the generation seen (taken by settle)."""
        with self._lock:
            row = self._lanes[lane]
            if self._channel.generation(lane) == gen and row.state == UP and row.lost is None:
                row.lost = why

    def _poll_moves(self, min_interval_s: float) -> list[tuple[int, str]]:
        """``(lane, why)`` of the lanes whose page moves came back with an error."""
        now = time.monotonic()
        if min_interval_s and now - self._last_poll < min_interval_s:
            return []
        self._last_poll = now
        return [
            (lane, f"a page move failed: {type(error).__name__}: {error}")
            for lane, error in self._channel.poll()
        ]

    # --------------------------------------------------------------- heartbeat
    def send_heartbeats(self) -> dict[int, _Sent]:
        """Queue a heartbeat to every serving lane, behind its page moves (those still
        waiting for a step are sent first: the count a lane answers includes them); a lane
        whose last heartbeat is still unanswered gets none: that one is read again.

        NOTE: the coordinator's lock is held, so the replies compare with its mirror as it
        is now.

        Returns:
            per lane, the heartbeat to read (:meth:`replies`, :meth:`heartbeat`).
        """
        self._channel.flush()
        # A lane counts its pages only once it has applied every move queued so far (those
        # riding in compiled steps do not travel behind the heartbeat).
        fence = self._channel.fence()
        sent = {}
        with self._lock:
            now = time.monotonic()
            for r, row in enumerate(self._lanes):
                if row.state != UP:
                    continue
                fresh = row.heartbeat is None
                if fresh:
                    row.heartbeat = self._channel.submit(r, "heartbeat", fence[r])
                    if row.unanswered_since is None:
                        row.unanswered_since = now
                sent[r] = _Sent(row.incarnation, self._channel.generation(r), row.heartbeat, fresh)
        return sent

    def replies(
        self, sent: dict[int, _Sent], timeout: float
    ) -> Iterator[tuple[int, str | None, str | None, Any]]:
        """``(lane, known, generation, reply)`` for each heartbeat sent, the reply being
        ``(incarnation, held)`` or the error that came instead (``TimeoutError``: not
        answered yet; it is read again next round); waits without any lock. ``held`` is
        ``None`` where it cannot be compared with the mirror (a heartbeat of an earlier
        round, or one that a move riding in a step is still to reach)."""
        for r, hb in sent.items():
            try:
                reply = self._channel.result(hb.future, timeout)
            except Exception as e:
                reply = e
            if not isinstance(reply, TimeoutError):
                self._answered(r, hb.future, answered=not isinstance(reply, BaseException))
            if not hb.fresh and not isinstance(reply, BaseException):
                reply = (reply[0], None)
            yield r, hb.known, hb.gen, reply

    def _answered(self, lane: int, future: Any, answered: bool) -> None:
        """``future``, ``lane``'s heartbeat, came back: the next round sends another. An
        error is no answer: the lane's hang clock keeps running."""
        with self._lock:
            row = self._lanes[lane]
            if row.heartbeat is not future:  # reset meanwhile: the row is a new incarnation's
                return
            row.heartbeat = None
            if answered:
                row.unanswered_since = None

    def heartbeat(self, sent: dict[int, _Sent], expected_held: list[int], timeout: float) -> None:
        """Read one heartbeat round: record lanes that died, restarted or hung; count those
        that disagree with the mirror (``expected_held`` pages per lane). A slow lane is not
        a lost lane: only a dead, restarted or hung one is; a lane whose heartbeat came back
        with an error of another kind is logged and counted, and the round reads the rest."""
        if self._hang_s is not None:
            timeout = min(timeout, max(0.1, self._hang_s / 2))
        for r, known, gen, reply in self.replies(sent, timeout):
            if isinstance(reply, TimeoutError):
                self.num_slow_heartbeats += 1
                self._check_hung(r, gen)
                continue
            # NOTE: unreachable is not a death (Ray: "may be available later"); a lane
            # that restarted answers its next heartbeat as another incarnation.
            if isinstance(reply, LaneDeadError) and not isinstance(reply, LaneUnreachableError):
                incarnation, held = None, None
            elif isinstance(reply, BaseException):
                self.num_heartbeat_errors += 1
                logger.warning("lane %d heartbeat: %s: %s", r, type(reply).__name__, reply)
                self._check_hung(r, gen)
                continue
            else:
                incarnation, held = reply
            if incarnation != known:
                self._report_lost(r, gen, "heartbeat: lane restarted or died")
            elif held is not None and held != expected_held[r]:  # None: a move still to come
                self.num_mismatches += 1
                logger.error(
                    "lane %d holds %d pages but the mirror says %d", r, held, expected_held[r]
                )

    def _check_hung(self, lane: int, gen: str | None) -> None:
        """A lane that left a heartbeat unanswered for ``hang_s`` (alive but not answering:
        stopped, deadlocked, stuck in a collective) is treated as lost: killed, so that it
        restarts, and reset."""
        with self._lock:
            row = self._lanes[lane]
            since = row.unanswered_since
            if self._hang_s is None or since is None or time.monotonic() - since < self._hang_s:
                return
            if self._channel.generation(lane) != gen or row.state != UP or row.lost is not None:
                return
            # NOTE: killed before it is recorded lost, so the reset that recovery sends next
            # reaches the restarted process, not the stuck one; under the lock, so that no
            # recovery in between has the kill hit the process it brought back (Ray's kill
            # only sends the request).
            if self._kill is not None:
                try:
                    self._kill(lane)
                except Exception:
                    logger.exception("could not kill hung lane %d", lane)
            self.num_hung += 1
            row.lost = f"hung: a heartbeat unanswered for {self._hang_s:.1f}s"

    def probe(self, lane: int, timeout: float) -> bool:
        """True when ``lane`` answers as the incarnation we know; else the lane is recorded
        lost (the coordinator's next settle takes it). Waits without any lock."""
        with self._lock:
            row = self._lanes[lane]
            if row.state != UP:
                return False
            known, gen = row.incarnation, self._channel.generation(lane)
            future = self._channel.submit(lane, "heartbeat")
        try:
            incarnation, _ = self._channel.result(future, timeout)
        except TimeoutError:
            return True  # slow, not lost
        except Exception:
            incarnation = None
        if incarnation == known:
            return True
        self._report_lost(lane, gen, "probe: lane restarted or died")
        return False

    # -------------------------------------------------------------- lane group
    def ensure_group(self, timeout_s: float) -> str | KVCapacityWaitError:
        """The current lane group's id, building the group first when it is stale.

        Returns:
            The group id, or a ``KVCapacityWaitError(reason="lane_unavailable")`` when a lane
            is not serving or the group was dropped while it was built (back off and retry).
        """
        with self._group_lock:
            with self._lock:
                if self._group_id is not None:
                    return self._group_id
                down = [r for r, row in enumerate(self._lanes) if row.state != UP]
                drops = self._group_drops
            if down:
                return self.unavailable(f"lanes {down} are restarting; no step can run")
            cp = len(self._lanes)
            try:
                if self._backend is None:
                    infos = [self._channel.call(r, "info", timeout=timeout_s) for r in range(cp)]
                    self._backend = choose_backend([device_id(i) for i in infos])
                host, port = self._channel.call(0, "rendezvous_address", timeout=timeout_s)
            except Exception as e:  # a lane died meanwhile: the heartbeat will see it
                return self.unavailable(f"could not build the lane group ({type(e).__name__})")
            with self._lock:
                self._group_count += 1
                gid = group_id(self._epoch, self._group_count)
                for r in range(cp):
                    self._channel.submit(r, "init_group", gid, host, port, self._backend, timeout_s)
                # NOTE: a group dropped while this one was built is stale already: the step
                # that asked backs off (the next builds another) instead of failing.
                if self._group_drops != drops:
                    return self.unavailable("the lane group changed while it was built")
                self._group_id = gid
                return gid

    def is_current_group(self, gid: str) -> bool:
        """Whether ``gid`` is the lane group the lanes are in now (not dropped since)."""
        with self._lock:
            return self._group_id == gid

    def drop_group(self) -> None:
        """The lanes left the group (a step failed): the next step builds a new one."""
        with self._lock:
            self._drop_group_locked()

    def _drop_group_locked(self) -> None:
        self._group_id = None
        self._group_drops += 1

    def unavailable(self, message: str) -> KVCapacityWaitError:
        """A step cannot run until every lane serves (or its group is current): back off and
        retry."""
        zeros = [0] * len(self._lanes)
        return KVCapacityWaitError(
            message,
            required_by_owner=zeros,
            available_by_owner=zeros,
            deficit_by_owner=zeros,
            reason="lane_unavailable",
        )
