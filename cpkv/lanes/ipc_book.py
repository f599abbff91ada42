"""Bookkeeping of a device exchange, without a device: buffer sizing and growth, the turn of
each exchange (its sequence number, slot, and which events it records and waits on), and the
byte layout of a payload.

Each lane owns one exchange buffer of two equal slots; exchange ``n`` (1, 2, ...; every lane
counts the same collectives) writes slot ``n % 2``. Per slot a lane has a *written* event
(recorded after it wrote the slot) and a *consumed* event (recorded after it read every peer's
slot). Before writing slot ``s`` for exchange ``n >= 3`` a lane's stream waits on every peer's
consumed event of slot ``s``, last recorded by that peer for exchange ``n - 2``: a buffer is
never overwritten before every peer has read it. The records an exchange waits on carry
*tags* (the exchange that recorded them) so a fake device can check the order on CPU.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

__all__ = [
    "ALIGN",
    "GATHER",
    "TO_ALL",
    "SlotBook",
    "Turn",
    "aligned",
    "grown_capacity",
    "to_all_layout",
]

#: Byte alignment of every payload part (a CUDA allocation's and vector loads' alignment).
ALIGN = 256
#: Growth rounds a slot up to this many bytes (fewer regrowths for steps of similar size).
GROW_QUANTUM = 1 << 20
#: ``op`` codes posted on the board, so lanes that call different collectives fail loudly.
GATHER, TO_ALL = 1, 2


def aligned(nbytes: int) -> int:
    """``nbytes`` rounded up to :data:`ALIGN`."""
    return -(-int(nbytes) // ALIGN) * ALIGN


def grown_capacity(need: int, current: int, minimum: int = GROW_QUANTUM) -> int:
    """Slot capacity for a payload of ``need`` bytes.

    Args:
        need: bytes the exchange writes into one slot.
        current: the slot's capacity now (0: no buffer yet).
        minimum: the smallest slot ever allocated.

    Returns:
        ``current`` when the payload fits; else at least ``need``, twice ``current`` and
        ``minimum``, rounded up to :data:`GROW_QUANTUM` (doubling keeps the number of regrowths,
        each a new handle every peer opens, logarithmic in the largest step).
    """
    if need < 0 or current < 0:
        raise ValueError(f"need={need} and current={current} must be >= 0")
    if need <= current:
        return current
    want = max(need, 2 * current, minimum)
    return -(-want // GROW_QUANTUM) * GROW_QUANTUM


@dataclass(frozen=True, slots=True)
class Turn:
    """What one exchange does on this lane.

    Attributes:
        seq: the exchange's number (1, 2, ...), equal on every lane.
        slot: ``seq % 2``, the slot written and read.
        grow_to: the new slot capacity when the buffer must be reallocated (and its handle
            shared again) before writing, else ``None``.
        version: the buffer version the payload is written to (after any growth).
        wait_consumed_tag: the exchange whose consumed-event records (one per peer) the write
            waits for, or ``None`` when the slot was never written in this buffer's lifetime
            group (``seq <= 2``).
    """

    seq: int
    slot: int
    grow_to: int | None
    version: int
    wait_consumed_tag: int | None

    def offset(self, capacity: int) -> int:
        """Byte offset of this turn's slot in a buffer of slots of ``capacity`` bytes."""
        return self.slot * capacity


class SlotBook:
    """Sequence, slot and buffer size of one lane's exchanges.

    Args:
        minimum: the smallest slot capacity (bytes).
        initial: bytes to size the first buffer for (``0``: grow on the first exchange).
    """

    __slots__ = ("capacity", "minimum", "seq", "version")

    def __init__(self, minimum: int = GROW_QUANTUM, initial: int = 0) -> None:
        if minimum <= 0:
            raise ValueError(f"minimum={minimum} must be > 0")
        self.minimum = int(minimum)
        self.capacity = grown_capacity(initial, 0, self.minimum) if initial > 0 else 0
        self.version = 1 if self.capacity else 0
        self.seq = 0

    def begin(self, nbytes: int) -> Turn:
        """The next exchange's turn for a payload of ``nbytes`` bytes (then counted)."""
        cap = grown_capacity(aligned(nbytes), self.capacity, self.minimum)
        grow = cap if cap != self.capacity else None
        if grow is not None:
            self.capacity = cap
            self.version += 1
        self.seq += 1
        seq = self.seq
        return Turn(seq, seq % 2, grow, self.version, seq - 2 if seq > 2 else None)


def to_all_layout(nbytes_per_dest: Sequence[int], rank: int) -> tuple[list[int], list[int], int]:
    """Where each destination's part of an all-to-all payload goes in the sender's slot.

    Args:
        nbytes_per_dest: bytes this lane sends to each lane (its own entry stays local and takes
            no room).
        rank: this lane.

    Returns:
        ``(starts, lengths, total)``: byte offset and length per destination (``ALIGN``-ed
        starts; own entry ``(0, 0)``), and the bytes the slot must hold.
    """
    starts, lengths, at = [], [], 0
    for dest, n in enumerate(nbytes_per_dest):
        if n < 0:
            raise ValueError(f"negative size {n} for lane {dest}")
        if dest == rank:
            starts.append(0)
            lengths.append(0)
            continue
        starts.append(at)
        lengths.append(int(n))
        at = aligned(at + int(n))
    return starts, lengths, at
