"""The host board of a device exchange: each lane's progress and payload layout, in host memory
shared by the lanes of one node (no torch).

A lane records its exchange ``n``'s write event, then *posts* ``n`` here; a peer enqueues its
wait on that event only after it sees ``n`` posted. This host handshake is what makes waiting on
an interprocess CUDA event exact: ``cudaStreamWaitEvent`` waits for the record the event had
when the wait was *enqueued*, so the wait must come after the record call on the host. Hosts run
ahead of their GPUs, so a lane rarely waits here, and never for device work.

Layout: one record of int64 per lane, padded to a 64-byte line: ``[pid, posted, left, slot 0:
(op, version, start[ws], length[ws]), slot 1: (...)]``. ``posted`` is the last exchange the lane
posted (0: none), ``left`` is 1 once it left the group; slot ``n % 2`` describes exchange ``n``:
the kind of collective (``op``), the buffer version it lives in, and for each destination lane
the byte range of the payload meant for it. A record is written by its own lane only.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import tempfile
import time
from dataclasses import dataclass

import numpy as np

__all__ = ["Board", "BoardLayout", "PeerGoneError", "board_path"]

_PID, _POSTED, _LEFT, _HEADER = 0, 1, 2, 3  # header words of a lane's record

# Spin this long on a peer's counter before sleeping between reads (a peer's host is usually
# microseconds from posting), then back off up to _MAX_NAP_S. A sleep of 20 us costs about
# 60 us on Linux, which a layer's exchange pays only when a peer's host is really behind.
_SPIN_S = 50e-6
_MAX_NAP_S = 1e-3
# How often a waiting lane checks that the peer it waits for still exists.
_LIVENESS_EVERY_S = 0.05


class PeerGoneError(RuntimeError):
    """A peer lane died or did not post in time; the exchange (and so the step) fails."""


def board_path(name: str) -> str:
    """Where a board named ``name`` lives: ``/dev/shm`` where there is one (memory, not disk)."""
    base = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
    return os.path.join(base, f"cpkv-board-{name}")


@dataclass(frozen=True, slots=True)
class BoardLayout:
    """Offsets (in int64 words) of one lane's record for ``world_size`` lanes."""

    world_size: int

    @property
    def slot_words(self) -> int:
        return 2 + 2 * self.world_size

    @property
    def record_words(self) -> int:
        words = _HEADER + 2 * self.slot_words
        return -(-words // 8) * 8  # NOTE: a 64-byte line per lane: no false sharing

    @property
    def nbytes(self) -> int:
        return self.world_size * self.record_words * 8

    def slot_offset(self, slot: int) -> int:
        return _HEADER + slot * self.slot_words


class Board:
    """A lane's view of the shared board (``world_size`` records).

    Args:
        path: the board's file (see :func:`board_path`); rank 0 creates it.
        world_size, rank: the group's size and this lane.
        create: make the file (zeroed) instead of opening it.
    """

    __slots__ = ("_mm", "_words", "layout", "path", "rank")

    def __init__(self, path: str, world_size: int, rank: int, *, create: bool = False) -> None:
        self.layout = BoardLayout(world_size)
        self.rank = rank
        self.path = path
        flags = os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0)
        fd = os.open(path, flags, 0o600)
        try:
            if create:
                os.ftruncate(fd, self.layout.nbytes)
            self._mm = mmap.mmap(fd, self.layout.nbytes)
        finally:
            os.close(fd)
        words = np.frombuffer(self._mm, dtype=np.int64)
        self._words = words.reshape(world_size, self.layout.record_words)
        self._words[rank, _PID] = os.getpid()

    def unlink(self) -> None:
        """Remove the file (the lanes that mapped it keep their mapping)."""
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)

    def close(self) -> None:
        self._words = None  # release the numpy view before the mapping
        with contextlib.suppress(BufferError):  # a view still alive: the mapping ends with it
            self._mm.close()

    # --- this lane's record ---

    def post(self, seq: int, op: int, version: int, starts: list[int], lengths: list[int]) -> None:
        """Describe exchange ``seq`` in slot ``seq % 2``, then mark it posted.

        NOTE: the layout is written before ``posted`` (x86-64 keeps stores in order; a reader
        reads ``posted`` first), and slot ``seq % 2`` is free: the peers read it for exchange
        ``seq - 2`` before they posted ``seq - 1``, which this lane waited for.
        """
        ws = self.layout.world_size
        rec = self._words[self.rank]
        at = self.layout.slot_offset(seq % 2)
        rec[at] = op
        rec[at + 1] = version
        rec[at + 2 : at + 2 + ws] = starts
        rec[at + 2 + ws : at + 2 + 2 * ws] = lengths
        rec[_POSTED] = seq

    def leave(self) -> None:
        """Mark this lane gone: peers waiting for its next exchange fail now, not at the
        timeout (a lane leaves its group when its step fails)."""
        self._words[self.rank, _LEFT] = 1

    # --- peers' records ---

    def posted(self, lane: int) -> int:
        return int(self._words[lane, _POSTED])

    def pid(self, lane: int) -> int:
        return int(self._words[lane, _PID])

    def slot(self, lane: int, seq: int, dest: int) -> tuple[int, int, int, int]:
        """``(op, version, start, length)`` lane ``lane`` posted for ``dest`` in exchange
        ``seq`` (read only once :meth:`wait_posted` returned for it)."""
        ws = self.layout.world_size
        rec = self._words[lane]
        at = self.layout.slot_offset(seq % 2)
        return (
            int(rec[at]),
            int(rec[at + 1]),
            int(rec[at + 2 + dest]),
            int(rec[at + 2 + ws + dest]),
        )

    def alive(self, lane: int) -> bool:
        """Whether lane ``lane``'s process still exists (not yet registered counts as alive)."""
        return _alive(self.pid(lane))

    def wait_posted(self, lane: int, seq: int, timeout_s: float) -> None:
        """Return once lane ``lane`` posted exchange ``seq``.

        Raises:
            PeerGoneError: its process is gone, or ``timeout_s`` passed.
        """
        if self.posted(lane) >= seq:
            return
        start = time.perf_counter()
        checked, nap = start, 0.0
        while self.posted(lane) < seq:
            # NOTE: posted is read before left: a lane posts, then may leave once done.
            if self._words[lane, _LEFT] and self.posted(lane) < seq:
                raise PeerGoneError(f"lane {lane} left the group before posting exchange {seq}")
            now = time.perf_counter()
            if now - start > _SPIN_S:
                nap = min(_MAX_NAP_S, max(2 * nap, 10e-6))
                time.sleep(nap)
            if now - checked > _LIVENESS_EVERY_S:
                checked = now
                if not _alive(self.pid(lane)):
                    raise PeerGoneError(
                        f"lane {lane} (pid {self.pid(lane)}) died before posting exchange {seq}"
                    )
                if now - start > timeout_s:
                    raise PeerGoneError(
                        f"lane {lane} did not post exchange {seq} within {timeout_s:g} s "
                        f"(it posted {self.posted(lane)})"
                    )


def _alive(pid: int) -> bool:
    if pid <= 0:
        return True  # not registered yet
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # NOTE: a zombie (dead, not yet reaped by its parent) still answers kill(0).
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return True
