"""LaneShard: one CP rank's KV memory and the record of which of its pages are held.

The coordinator decides every page; the shard applies those decisions in the
order they were made. Each page move carries the lane's generation (bumped at
every reset) and a sequence number: the shard checks the numbers are contiguous
(a lost or reordered move is an error, not silent drift), answers a repeat with
the first answer, and checks the move itself (a page is never taken twice nor
released while free).
"""

from __future__ import annotations

import uuid

import numpy as np
import torch

from cpkv.core.config import KVShape
from cpkv.core.moves import MovesNotApplied
from cpkv.core.reply_cache import ReplyCache
from cpkv.core.steps import superseded
from cpkv.errors import InvalidRequestError

__all__ = ["CACHED", "NOT_YET", "LaneShard", "MoveOrderError"]

# Owner of a page in the prefix cache: readable by every request, writable by none.
CACHED = -1
# What store_kv/gather_kv answer when the caller's fence is ahead of the moves applied here
# (its pages are decided but not yet moved): the caller retries shortly.
NOT_YET = "not-yet"

# Replies to recent moves, for a repeat after a lost answer: a retry comes within a
# few calls of its original, so a few thousand is plenty.
_MAX_REMEMBERED_MOVES = 4096


class MoveOrderError(RuntimeError):
    """A page move arrived out of order or for another generation of this lane."""


class LaneShard:
    """KV memory of one lane: per layer K and V ``[num_pages, page_size, heads, head_dim]``.

    Args:
        lane: this shard's CP rank.
        num_pages: pages in the shard (local page 0 reserved).
        page_size: tokens per page.
        kv: heads, head_dim, layers and dtype of the tensors.
        device: where the tensors live (``"cuda"``, ``"cpu"``, ...).
    """

    def __init__(
        self, lane: int, num_pages: int, page_size: int, kv: KVShape, device: str | torch.device
    ) -> None:
        self.lane = lane
        self.num_pages = num_pages
        self.page_size = page_size
        self.kv = kv
        self.device = torch.device(device)
        dtype = getattr(torch, kv.dtype)
        shape = (num_pages, page_size, kv.num_heads, kv.head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=self.device) for _ in range(kv.num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=self.device) for _ in range(kv.num_layers)]
        self.incarnation = uuid.uuid4().hex
        self._held = np.zeros(num_pages, dtype=bool)
        # Namespace id owning each held page (CACHED for the prefix cache, 0 when free).
        # NOTE: int64: namespace ids are never reused (one a client, for days of clients).
        self._owner = np.zeros(num_pages, dtype=np.int64)
        self._replies = ReplyCache(_MAX_REMEMBERED_MOVES)
        # None until the coordinator resets this (re)started shard: moves are refused.
        self.generation: str | None = None
        self._next_seq = 1
        self.num_applied = 0

    @property
    def num_held_pages(self) -> int:
        """Pages in requests or in the prefix cache (the reserved page not counted)."""
        return int(self._held.sum())

    @property
    def num_free_pages(self) -> int:
        return self.num_pages - 1 - self.num_held_pages

    @property
    def num_repeats(self) -> int:
        return self._replies.num_hits

    @property
    def last_seq(self) -> int:
        """Sequence number of the last move applied in this generation (0: none)."""
        return self._next_seq - 1

    def num_held_at(self, seq: int) -> int | None:
        """Pages held right after move ``seq`` of this generation (0: after the reset);
        ``None`` for a move not applied yet or one too old to be remembered."""
        if seq == self.last_seq:
            return self.num_held_pages
        if seq == 0:
            return 0
        if seq > self.last_seq:
            return None
        return self._replies.peek(seq)  # what apply answered for it

    def apply(
        self,
        generation: str,
        seq: int,
        taken: np.ndarray,
        released: np.ndarray,
        owner: int = 0,
        cached: np.ndarray | None = None,
    ) -> int:
        """Release then take local pages, as the coordinator decided.

        Args:
            generation: the lane generation the move was decided in (set by :meth:`reset`).
            seq: the move's number in that generation: 1, 2, 3, ... with no gap.
            taken: ``int32`` local pages now held.
            released: ``int32`` local pages now free.
            owner: the namespace id the taken pages belong to.
            cached: ``int32`` held pages that went into the prefix cache.

        Returns:
            Pages held after the move (a repeat returns the first answer, changing nothing).

        Raises:
            MoveOrderError: another generation, or a sequence gap (a move was lost).
            AssertionError: the move contradicts this shard's record (a bug).
        """
        if generation != self.generation:
            raise MoveOrderError(
                f"lane {self.lane}: move {seq} of generation {generation!r}, "
                f"shard is at {self.generation!r}"
            )
        if seq < self._next_seq:
            reply = self._replies.get(seq, None)
            if reply is None:
                raise MoveOrderError(f"lane {self.lane}: move {seq} repeated, reply forgotten")
            return reply
        if seq != self._next_seq:
            raise MoveOrderError(
                f"lane {self.lane}: move {seq} arrived, expected {self._next_seq} (a move was lost)"
            )
        self._check_move(taken, released, cached)
        if released.size:
            self._held[released] = False
            self._owner[released] = 0
        if taken.size:
            self._held[taken] = True
            self._owner[taken] = owner
        if cached is not None and cached.size:
            self._owner[cached] = CACHED
        self._next_seq += 1
        self.num_applied += 1
        return self._replies.put(seq, self.num_held_pages)

    def _check_move(
        self, taken: np.ndarray, released: np.ndarray, cached: np.ndarray | None
    ) -> None:
        """Assert the whole move against the record before any of it is applied (a move
        refused halfway would leave the record neither before nor after it).

        NOTE: a lane's hot path (every step's riding moves): the usual move passes each
        check in one or two reductions; the set tests run only where a page is held."""
        lane, n = self.lane, self.num_pages
        for name, pages in (("taken", taken), ("released", released), ("cached", cached)):
            if pages is None or not pages.size:
                continue
            # NOTE: page 0 is reserved; a negative id would index from the end.
            assert pages.min() > 0 and pages.max() < n, f"lane {lane}: {name} page outside [1, {n})"
            if pages.size > 1:
                order = np.sort(pages)
                assert (order[1:] != order[:-1]).all(), f"lane {lane}: a page {name} twice"
        if released.size:
            assert self._held[released].all(), f"lane {lane}: releasing free pages"
        if taken.size:
            busy = self._held[taken]
            if busy.any():  # only a page this move releases first may be taken again
                assert np.isin(taken[busy], released).all(), f"lane {lane}: taking held pages"
        if cached is not None and cached.size:
            held = self._held[cached]
            if released.size or not held.all():
                kept = held & ~np.isin(cached, released)
                assert (kept | np.isin(cached, taken)).all(), f"lane {lane}: caching free pages"

    def apply_moves(self, moves: tuple[tuple, ...]) -> int:
        """Apply several moves (each ``apply``'s arguments) in order; pages held after them.

        Raises:
            MoveOrderError, AssertionError: as :meth:`apply`, for the first move refused
            (those before it stay applied; the coordinator resets a lane that refuses one).
        """
        held = self.num_held_pages
        for move in moves:
            held = self.apply(*move)
        return held

    def apply_riding(self, moves: tuple[tuple, ...] | None) -> None:
        """Apply the page moves that rode in a step call (each ``apply``'s arguments), before
        the step runs.

        Raises:
            MovesNotApplied: the shard refused a move (the step must not run).
        """
        if moves is None:
            return
        try:
            self.apply_moves(moves)
        except Exception as e:
            raise MovesNotApplied(f"lane {self.lane}: {type(e).__name__}: {e}") from e

    def reset(self, generation: str) -> str:
        """Every page free, moves numbered from 1 in ``generation``; returns the incarnation.

        Raises:
            MoveOrderError: ``generation`` is older than the shard's, of the same coordinator
                (a late reset overtaken by a later one; never taken back to it).
        """
        if superseded(generation, self.generation):
            raise MoveOrderError(
                f"lane {self.lane}: reset to generation {generation!r} after {self.generation!r}"
            )
        self._held[:] = False
        self._owner[:] = 0
        self._replies.clear()
        self.generation = generation
        self._next_seq = 1
        return self.incarnation

    def _check_kv(self, layer: int, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor) -> None:
        if not 0 <= layer < self.kv.num_layers:
            raise InvalidRequestError(f"layer={layer} not in [0, {self.kv.num_layers})")
        want = (slots.shape[0], self.kv.num_heads, self.kv.head_dim)
        for name, t in (("k", k), ("v", v)):
            if tuple(t.shape) != want:
                raise InvalidRequestError(f"{name} has shape {tuple(t.shape)}, expected {want}")
            if t.dtype != self.k[0].dtype:
                raise InvalidRequestError(f"{name} has dtype {t.dtype}, expected {self.k[0].dtype}")

    def _check_slots(self, local_slots: np.ndarray) -> None:
        """Refuse slots outside the shard's pages (page 0 is the reserved one)."""
        if local_slots.size:
            bound = self.num_pages * self.page_size
            low, high = int(local_slots.min()), int(local_slots.max())
            if low < self.page_size or high >= bound:
                raise InvalidRequestError(
                    f"lane {self.lane}: local slots span [{low}, {high}], valid "
                    f"[{self.page_size}, {bound})"
                )

    def _check_access(
        self, local_slots: np.ndarray, owner: int | None, fence, write: bool
    ) -> str | None:
        """Refuse slots on pages the caller's namespace does not own (``NOT_YET`` when the
        moves that may give them are still on their way: the fence's generation is the
        shard's and its move not applied yet, or a later one whose reset has not come).

        NOTE: a fence of a generation the shard has left is not refused: a client's fence is
        the latest it was told of, for all its requests, and a request made since by a step
        (which answers no fence) lives in the new generation. The namespace check stands.
        """
        if fence is not None:
            generation, seq = fence
            if generation == self.generation:
                if seq > self.last_seq:
                    return NOT_YET
            elif self.generation is None or superseded(self.generation, generation):
                return NOT_YET  # the reset into the fence's generation is still on its way
        if owner is None or local_slots.size == 0:
            return None
        pages = np.clip(local_slots // self.page_size, 0, self.num_pages - 1)
        owners = self._owner[pages]
        ok = (owners == owner) & self._held[pages]
        if not write:
            ok |= owners == CACHED
        if not ok.all():
            i = int(np.argmin(ok))
            what = (
                "cached (read-only)"
                if owners[i] == CACHED
                else ("free" if not self._held[pages[i]] else "another namespace's")
            )
            raise InvalidRequestError(
                f"lane {self.lane}: local slot {int(local_slots[i])} is on a page that is "
                f"{what}; {'writes' if write else 'reads'} reach only this client's requests"
            )
        return None

    def store_kv(
        self,
        local_slots: np.ndarray,
        k: torch.Tensor,
        v: torch.Tensor,
        layer: int = 0,
        owner: int | None = None,
        fence: tuple[str, int] | None = None,
    ) -> int | str:
        """Write K/V ``[T, heads, head_dim]`` of ``T`` tokens at their local slots.

        Writing is idempotent (the same values land on the same slots), so a
        retried call needs no key.

        Args:
            owner: the caller's namespace id: every slot must be on a page of its requests
                (``None``: unchecked, for tests of the shard alone).
            fence: ``(generation, seq)`` of the last move the caller's pages depend on.

        Returns:
            Tokens written, or :data:`NOT_YET` when the fence is ahead of this shard.

        Raises:
            InvalidRequestError: bad shapes, or a slot outside the caller's pages.
        """
        from cpkv import kernels

        slots = torch.from_numpy(np.array(local_slots, dtype=np.int64))
        self._check_kv(layer, k, v, slots)
        self._check_slots(slots.numpy())
        if self._check_access(slots.numpy(), owner, fence, write=True) is NOT_YET:
            return NOT_YET
        dev = self.device
        kernels.store_kv(  # NOTE: detached: the shard never joins a caller's autograd graph
            k.detach().to(dev).contiguous(),
            v.detach().to(dev).contiguous(),
            self.k[layer],
            self.v[layer],
            slots.to(dev),
        )
        return int(slots.numel())

    def gather_kv(
        self,
        local_slots: np.ndarray,
        layer: int = 0,
        owner: int | None = None,
        fence: tuple[str, int] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor] | str:
        """Read K/V ``[T, heads, head_dim]`` at local slots (returned on CPU).

        ``owner``/``fence`` as in :meth:`store_kv`; cached pages are readable by everyone.
        """
        from cpkv import kernels

        if not 0 <= layer < self.kv.num_layers:
            raise InvalidRequestError(f"layer={layer} not in [0, {self.kv.num_layers})")
        host = np.array(local_slots, dtype=np.int64)
        self._check_slots(host)
        if self._check_access(host, owner, fence, write=False) is NOT_YET:
            return NOT_YET
        slots = torch.from_numpy(host).to(self.device)
        k, v = kernels.gather_kv(self.k[layer], self.v[layer], slots)
        return k.cpu(), v.cpu()

    def counts(self) -> dict:
        return {
            "lane": self.lane,
            "incarnation": self.incarnation,
            "held": self.num_held_pages,
            "free": self.num_free_pages,
            "applied": self.num_applied,
            "generation": self.generation,
            "last_seq": self.last_seq,
            "repeats": self.num_repeats,
        }
