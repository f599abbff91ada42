"""IpcExchange: the lanes' row collectives through device buffers they share (CUDA IPC).

Each lane owns an exchange buffer of two slots (:mod:`cpkv.lanes.ipc_book`), a *written* and a
*consumed* interprocess event per slot, and a record on the host board
(:mod:`cpkv.lanes.ipc_board`). The handles are shared once per lane group through the group's
store; a buffer that must grow is reallocated and its new handle published under a new version
(peers open it when they first see that version on the board). Exchange ``n``:

1. (``n >= 3``) the stream waits on every peer's consumed event of slot ``n % 2``: the peers
   have read what this lane wrote there for exchange ``n - 2``;
2. the lane copies its payload into its slot and records its written event;
3. it posts ``n`` on the board with the payload's layout;
4. for each peer: once the peer posted ``n`` (host), the stream waits on the peer's written
   event and copies the peer's part out of the peer's mapped slot;
5. it records its consumed event.

No payload byte touches the host, nothing is pickled, and no host thread polls the GPU: the host
only waits for peers' hosts to have *queued* their writes. Every lane must call the same
collectives in the same order (as with any process group); the board carries each exchange's
kind and sizes, so a mismatch raises instead of reading garbage. A dead peer or one that does
not post within ``timeout_s`` raises :class:`~cpkv.lanes.ipc_board.PeerGoneError`.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from cpkv.lanes.ipc_board import Board, PeerGoneError, board_path
from cpkv.lanes.ipc_book import GATHER, GROW_QUANTUM, TO_ALL, SlotBook, to_all_layout

__all__ = ["ExchangeStats", "IpcExchange", "PeerGoneError", "publish_setup_failure"]

logger = logging.getLogger("cpkv.ipc")

# Teardowns whose device work had not finished (a stream stuck on a dead peer's event): their
# mappings are kept here, never closed under a pending copy.
_GRAVEYARD: list[Any] = []
# How long a teardown waits for this lane's queued device work before keeping its mappings
# instead (the queued step of a failed exchange drains in milliseconds).
_CLOSE_GRACE_S = 2.0
# An exchange's posted op carries its element type: lanes exchanging as many bytes as float32
# and as int32 are refused, not read as each other's bits (0: a type not listed).
_DTYPES = (
    torch.float32, torch.float16, torch.bfloat16, torch.float64,
    torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool,
)  # fmt: skip
_DTYPE_CODES = {dtype: i + 1 for i, dtype in enumerate(_DTYPES)}
_OP_NAMES = {GATHER: "all_gather_rows", TO_ALL: "all_to_all_rows"}


def _op_code(op: int, dtype: torch.dtype) -> int:
    return op + 16 * _DTYPE_CODES.get(dtype, 0)


def _describe(code: int) -> str:
    op, dtype = code % 16, code // 16
    name = str(_DTYPES[dtype - 1]).removeprefix("torch.") if 0 < dtype <= len(_DTYPES) else "?"
    return f"{_OP_NAMES.get(op, f'op {op}')} of {name}"


@dataclass(slots=True)
class ExchangeStats:
    """What a lane's exchanges moved since the last :meth:`IpcExchange.take_stats`.

    Attributes:
        exchanges: collectives run.
        bytes_written: payload bytes this lane wrote into its own buffer.
        bytes_read: payload bytes this lane copied out of its peers' buffers.
        regrowths: times the buffer was reallocated (and its handle shared again).
    """

    exchanges: int = 0
    bytes_written: int = 0
    bytes_read: int = 0
    regrowths: int = 0


@dataclass(slots=True)
class _Peer:
    written: list[Any]  # the peer's written event per slot (opened here)
    consumed: list[Any]  # the peer's consumed event per slot
    version: int = 0  # the buffer version mapped
    buffer: Any = None  # the mapping (uint8 [2 * capacity])
    capacity: int = 0


def _bytes_view(t: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor's bytes as a 1-D ``uint8`` view."""
    return t.reshape(-1).view(torch.uint8)


class IpcExchange:
    """Row collectives among the ``world_size`` lanes of one node through shared buffers.

    Construction is a collective (every lane of the group, same ``prefix``): it publishes this
    lane's events and first buffer through ``store`` and opens every peer's.

    Args:
        rank, world_size: this lane and the group's size (``>= 2``).
        store: the group's ``torch.distributed`` store (handles travel through it once).
        prefix: keys' prefix, unique per group incarnation (e.g. its generation).
        adaptor: the device (:class:`~cpkv.lanes.ipc_device.CudaIpcDevice`, or the CPU stand-in).
        timeout_s: how long a lane waits for a peer to post an exchange (and for the handles).
        initial_bytes: the first buffer's slot size (``0``: the growth minimum).

    Raises:
        RuntimeError: a peer's handles could not be opened here (another GPU not visible, no
            peer access) or a peer failed to publish them; the group then falls back.
    """

    def __init__(
        self,
        rank: int,
        world_size: int,
        store: Any,
        prefix: str,
        adaptor: Any,
        timeout_s: float,
        initial_bytes: int = 0,
    ) -> None:
        if world_size < 2:
            raise ValueError(f"an exchange needs world_size >= 2, got {world_size}")
        self.rank, self.world_size, self.timeout_s = rank, world_size, float(timeout_s)
        self.adaptor = adaptor
        self.stats = ExchangeStats()
        self._store, self._prefix = store, prefix
        self._book = SlotBook(GROW_QUANTUM, initial_bytes or GROW_QUANTUM)
        self._retired: list[tuple[int, Any]] = []  # (seq retired at, own buffer)
        self._closed = False
        self.stuck = False  # set by close(): device work still pending (a dead peer's event)
        self._peers: dict[int, _Peer] = {}
        # NOTE: set before anything can fail, so close() can tear down a half-built exchange.
        self.board: Board | None = None
        self._buf: Any = None
        self._written: list[Any] = []
        self._consumed: list[Any] = []
        try:
            self._open_board()
            self._buf = adaptor.alloc(2 * self._book.capacity)
            self._written = [adaptor.new_event(), adaptor.new_event()]
            self._consumed = [adaptor.new_event(), adaptor.new_event()]
            self._publish_buffer()
            mine = {
                "written": [adaptor.export_event(e) for e in self._written],
                "consumed": [adaptor.export_event(e) for e in self._consumed],
            }
        except Exception as e:  # tell the peers at once instead of letting them time out
            publish_setup_failure(store, prefix, rank, e)
            self.close()
            raise
        store.set(self._key(f"events/{rank}"), json.dumps(mine))
        try:
            for p in range(world_size):
                if p == rank:
                    continue
                desc = self._peer_events(p)
                self._peers[p] = _Peer(
                    [adaptor.open_event(d) for d in desc["written"]],
                    [adaptor.open_event(d) for d in desc["consumed"]],
                )
                # NOTE: eager: a lane that cannot map a peer fails here, not mid-step.
                self._map(p, 1)
        except Exception:
            self.close()
            raise

    def _open_board(self) -> None:
        """Create (lane 0) or open the group's host board."""
        if self.rank == 0:
            name = board_path(self._prefix.replace("/", "-"))
            self.board = Board(name, self.world_size, self.rank, create=True)
            self._store.set(self._key("board"), name)
        else:
            name = self._store.get(self._key("board")).decode()
            if not name:  # lane 0 failed before it made the board: its error says why
                self._peer_events(0)
            self.board = Board(name, self.world_size, self.rank)
        if self._store.add(self._key("board_opened"), 1) == self.world_size:
            self.board.unlink()  # every lane mapped it: nothing left behind if one dies

    def _peer_events(self, p: int) -> dict:
        """Lane ``p``'s published event handles; raises when it published its setup failure."""
        desc = json.loads(self._store.get(self._key(f"events/{p}")))
        if "error" in desc:
            raise RuntimeError(f"lane {p} could not set up its exchange: {desc['error']}")
        return desc

    # --- handles ---

    def _key(self, name: str) -> str:
        return f"{self._prefix}/{name}"

    def _publish_buffer(self) -> None:
        # NOTE: one export per peer: a CUDA IPC share carries a reference count of one, which
        # the one process that opens it takes back when it lets go (as torch.multiprocessing
        # shares a tensor anew for every receiver). A share opened by two peers is counted
        # down twice: the block is freed under the second, or (count -1) never freed.
        for q in range(self.world_size):
            if q != self.rank:
                desc = {"capacity": self._book.capacity, **self.adaptor.export(self._buf)}
                key = self._key(f"buf/{self.rank}/{self._book.version}/{q}")
                self._store.set(key, json.dumps(desc))

    def _map(self, p: int, version: int) -> _Peer:
        peer = self._peers[p]
        if peer.version == version:
            return peer
        if version < peer.version:
            raise RuntimeError(f"lane {p} went back from buffer {peer.version} to {version}")
        desc = json.loads(self._store.get(self._key(f"buf/{p}/{version}/{self.rank}")))
        if peer.buffer is not None:
            self.adaptor.retire(peer.buffer)  # read by earlier exchanges still in flight
        peer.buffer, peer.capacity, peer.version = (
            self.adaptor.open(desc),
            desc["capacity"],
            version,
        )
        return peer

    # --- one exchange ---

    def _begin(self, nbytes: int) -> tuple[int, int, int]:
        """Steps 1 (and growth): ``(seq, slot, byte offset of the slot)`` to write."""
        if self._closed:
            raise RuntimeError("this exchange was closed")
        turn = self._book.begin(nbytes)
        self._retired = [(s, b) for s, b in self._retired if not self._drop_if_read(s, b, turn.seq)]
        self.adaptor.collect()
        if turn.grow_to is not None:
            # NOTE: kept until every peer has mapped the new version (see _drop_if_read): a peer
            # may not have opened this one yet, and its block must not be reused before.
            self._retired.append((turn.seq, self._buf))
            self._buf = self.adaptor.alloc(2 * turn.grow_to)
            self._publish_buffer()
            self.stats.regrowths += 1
        if turn.wait_consumed_tag is not None:
            for peer in self._peers.values():
                self.adaptor.wait(peer.consumed[turn.slot], turn.wait_consumed_tag)
        return turn.seq, turn.slot, turn.offset(self._book.capacity)

    def _drop_if_read(self, retired_at: int, buf: Any, seq: int) -> bool:
        # A buffer replaced at exchange m was last written at m - 1; before exchange m + 1 this
        # lane saw every peer post m, which they do after queueing their reads of m - 1 (so after
        # mapping it, which holds the block alive until their reads are done).
        if seq > retired_at + 1:
            self.adaptor.release(buf)
            return True
        return False

    def _read(self, p: int, seq: int, slot: int, op: int, want: int, out: torch.Tensor) -> None:
        """Step 4 for peer ``p``: copy its ``want`` bytes for this lane into ``out`` (bytes)."""
        try:
            self.board.wait_posted(p, seq, self.timeout_s)
        except PeerGoneError:
            self._unblock_dead()
            raise
        got_op, version, start, length = self.board.slot(p, seq, self.rank)
        if got_op != op or length != want:
            raise RuntimeError(
                f"lane {self.rank}: exchange {seq} mismatch with lane {p}: it posted "
                f"{_describe(got_op)} with {length} bytes for this lane, this lane expected "
                f"{_describe(op)} with {want} (the lanes called different collectives)"
            )
        peer = self._map(p, version)
        self.adaptor.wait(peer.written[slot], seq)
        if want:
            at = slot * peer.capacity + start
            out.copy_(peer.buffer[at : at + want])
            self.stats.bytes_read += want

    def _unblock_dead(self) -> None:
        """Complete the events of peers whose process is gone, from this side.

        NOTE: measured on the H200 (docs/gpu-run/ipc): a stream waiting on the written event of
        a peer that died with that record still queued stays blocked for good (20 s and more);
        the step's final synchronize would hang, and every later step of this lane too. Recording
        the dead peer's event from here did NOT release that wait (dying2.txt); it is kept as a
        harmless attempt, and :attr:`stuck` (set by :meth:`close`) tells the lane to restart.
        """
        for p, peer in self._peers.items():
            if self.board.alive(p):
                continue
            for ev in (*peer.written, *peer.consumed):
                try:
                    self.adaptor.unblock(ev)
                except Exception:  # the event may be unusable too: nothing more to do
                    logger.warning("lane %d: could not complete lane %d's event", self.rank, p)

    def _finish(self, seq: int, slot: int) -> None:
        self.adaptor.record(self._consumed[slot], seq)
        self.stats.exchanges += 1

    def all_gather_rows(self, x: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """Rank-major rows of every lane (see :meth:`cpkv.lanes.comm.LaneGroup.all_gather_rows`).

        Args:
            x: ``[counts[rank], ...]`` contiguous.
            counts: rows per lane (known to every lane).

        Returns:
            ``[sum(counts), ...]`` on ``x``'s device.
        """
        x = x.contiguous()
        tail = tuple(x.shape[1:])
        row = _row_bytes(x)
        n = counts[self.rank] * row
        op = _op_code(GATHER, x.dtype)
        seq, slot, offset = self._begin(n)
        if n:
            self._buf[offset : offset + n].copy_(_bytes_view(x))
            self.stats.bytes_written += n
        self.adaptor.record(self._written[slot], seq)
        self.board.post(seq, op, self._book.version, [0] * self.world_size, [n] * self.world_size)
        out = x.new_empty((sum(counts), *tail))
        first = 0
        for p, c in enumerate(counts):
            rows = out[first : first + c]
            first += c
            if p == self.rank:
                rows.copy_(x)
            else:
                self._read(p, seq, slot, op, c * row, _bytes_view(rows))
        self._finish(seq, slot)
        return out

    def all_to_all_rows(
        self, send: Sequence[torch.Tensor], recv_counts: list[int]
    ) -> list[torch.Tensor]:
        """``send[r]`` to lane ``r``; each lane's rows for this one (see
        :meth:`cpkv.lanes.comm.LaneGroup.all_to_all_rows`).

        Args:
            send: ``world_size`` tensors ``[n_r, ...]`` on one device.
            recv_counts: rows this lane receives from each lane.

        Returns:
            ``world_size`` tensors ``[recv_counts[r], ...]``.
        """
        send = [s.contiguous() for s in send]
        if send[self.rank].shape[0] != recv_counts[self.rank]:  # before any peer reads a post
            raise ValueError(
                f"all_to_all_rows: sending {send[self.rank].shape[0]} rows to self but "
                f"expecting {recv_counts[self.rank]}"
            )
        tail = tuple(send[0].shape[1:])
        row = _row_bytes(send[0])
        op = _op_code(TO_ALL, send[0].dtype)
        starts, lengths, total = to_all_layout([s.shape[0] * row for s in send], self.rank)
        seq, slot, offset = self._begin(total)
        for q, s in enumerate(send):
            if q != self.rank and lengths[q]:
                at = offset + starts[q]
                self._buf[at : at + lengths[q]].copy_(_bytes_view(s))
                self.stats.bytes_written += lengths[q]
        self.adaptor.record(self._written[slot], seq)
        self.board.post(seq, op, self._book.version, starts, lengths)
        out = send[0].new_empty((sum(recv_counts), *tail))
        parts = list(out.split(recv_counts))
        for p, part in enumerate(parts):
            if p == self.rank:
                part.copy_(send[p])
            else:
                self._read(p, seq, slot, op, recv_counts[p] * row, _bytes_view(part))
        self._finish(seq, slot)
        return parts

    # --- teardown ---

    def take_stats(self) -> ExchangeStats:
        """The counts since the last call (then reset)."""
        stats, self.stats = self.stats, ExchangeStats()
        return stats

    def close(self) -> None:
        """Drop every mapping, event and buffer (idempotent), and remove the board's file. When
        this lane's queued device work is not finished (a stream stuck on a dead peer), they are
        kept alive instead of being closed under a pending copy."""
        if self._closed:
            return
        self._closed = True
        # NOTE: the adaptor too: it holds the peer mappings retired after a regrowth, whose
        # release on CUDA synchronizes the stream (a hang under the GIL on a stuck one).
        keep = (self.adaptor, self._buf, self._retired, self._peers, self._written, self._consumed)
        if self.board is not None:
            self._unblock_dead()
        if not self.adaptor.quiesce(grace_s=_CLOSE_GRACE_S):
            logger.warning("lane %d: exchange closed with device work pending", self.rank)
            self.stuck = True
            _GRAVEYARD.append(keep)
        else:
            for _, buf in self._retired:
                self.adaptor.release(buf)
            if self._buf is not None:
                self.adaptor.release(self._buf)
        self._buf, self._retired, self._peers = None, [], {}
        if self.board is not None:
            self.board.leave()
            # NOTE: lanes that mapped it keep their mapping; one that fails setup before every
            # lane opened it (or dies) would else leave it in /dev/shm for good.
            self.board.unlink()
            self.board.close()
        close = getattr(self.adaptor, "close", None)
        if close is not None:
            close()
        # NOTE: a group kept after its destroy (a traceback, a test) must not keep rank 0's
        # store server, its sockets and these events alive (a stuck close keeps its own).
        self._store, self._written, self._consumed = None, [], []


def publish_setup_failure(store: Any, prefix: str, rank: int, error: BaseException) -> None:
    """Tell the peers of a group's exchange that lane ``rank`` failed to set its side up, so
    they fail at once instead of waiting ``timeout_s`` for its handles.

    Args:
        store, prefix: the group's store and the exchange's key prefix.
        rank: the lane that failed.
        error: why.
    """
    try:
        store.set(f"{prefix}/events/{rank}", json.dumps({"error": repr(error)}))
        if rank == 0:  # the peers wait for the board's name first: no board, fail at once
            store.set(f"{prefix}/board", "")
    except Exception:  # the store is gone too: the peers fail at their timeout
        logger.warning("lane %d: could not publish its setup failure", rank, exc_info=True)


def _row_bytes(t: torch.Tensor) -> int:
    n = 1
    for s in t.shape[1:]:
        n *= int(s)
    return n * t.element_size()
