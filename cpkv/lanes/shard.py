"""LaneShard: one CP rank's KV memory and the record of which of its pages are held.

The coordinator decides every page; the shard applies those decisions, checks
they are consistent (a page is never taken twice nor released while free) and
answers repeats of the same ``(rid, seq)`` key with the first answer.
"""

from __future__ import annotations

import uuid
from collections import OrderedDict
from collections.abc import Hashable

import numpy as np
import torch

from cpkv.config import KVShape
from cpkv.errors import InvalidRequestError

__all__ = ["LaneShard"]

# Keys of recent operations remembered for idempotent retries; a retry comes
# within a few calls of its original, so a few thousand is plenty.
_MAX_REMEMBERED_KEYS = 4096


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
        self._answers: OrderedDict[Hashable, object] = OrderedDict()
        self.num_applied = 0
        self.num_repeats = 0

    @property
    def num_held_pages(self) -> int:
        """Pages in requests or in the prefix cache (the reserved page not counted)."""
        return int(self._held.sum())

    @property
    def num_free_pages(self) -> int:
        return self.num_pages - 1 - self.num_held_pages

    def _remembered(self, key: Hashable) -> tuple[bool, object]:
        if key is not None and key in self._answers:
            self.num_repeats += 1
            return True, self._answers[key]
        return False, None

    def _remember(self, key: Hashable, answer: object) -> object:
        if key is not None:
            self._answers[key] = answer
            if len(self._answers) > _MAX_REMEMBERED_KEYS:
                self._answers.popitem(last=False)
        return answer

    def apply(self, key: Hashable, taken: np.ndarray, released: np.ndarray) -> int:
        """Release then take local pages, as the coordinator decided.

        Args:
            key: ``(rid, seq)`` or another unique key; a repeat changes nothing.
            taken: ``int32`` local pages now held.
            released: ``int32`` local pages now free.

        Returns:
            Pages held after the move.

        Raises:
            AssertionError: the move contradicts this shard's record (a bug).
        """
        seen, answer = self._remembered(key)
        if seen:
            return answer
        if released.size:
            assert self._held[released].all(), f"lane {self.lane}: releasing free pages"
            self._held[released] = False
        if taken.size:
            assert (taken != 0).all(), f"lane {self.lane}: reserved page taken"
            assert not self._held[taken].any(), f"lane {self.lane}: taking held pages"
            self._held[taken] = True
        self.num_applied += 1
        return self._remember(key, self.num_held_pages)

    def reset(self) -> str:
        """Every page free (the coordinator forgot this lane's pages); returns the incarnation."""
        self._held[:] = False
        self._answers.clear()
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

    def store_kv(
        self,
        local_slots: np.ndarray,
        k: torch.Tensor,
        v: torch.Tensor,
        layer: int = 0,
        key: Hashable = None,
    ) -> int:
        """Write K/V ``[T, heads, head_dim]`` of ``T`` tokens at their local slots.

        Returns:
            Tokens written.
        """
        from cpkv import kernels

        seen, answer = self._remembered(key)
        if seen:
            return answer
        slots = torch.from_numpy(np.array(local_slots, dtype=np.int64))
        self._check_kv(layer, k, v, slots)
        if slots.numel():
            bound = self.num_pages * self.page_size
            low, high = int(slots.min()), int(slots.max())
            if low < self.page_size or high >= bound:
                raise InvalidRequestError(
                    f"lane {self.lane}: local slots span [{low}, {high}], valid "
                    f"[{self.page_size}, {bound})"
                )
        dev = self.device
        kernels.store_kv(
            k.to(dev).contiguous(),
            v.to(dev).contiguous(),
            self.k[layer],
            self.v[layer],
            slots.to(dev),
        )
        return self._remember(key, int(slots.numel()))

    def gather_kv(
        self, local_slots: np.ndarray, layer: int = 0
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Read K/V ``[T, heads, head_dim]`` at local slots (returned on CPU)."""
        from cpkv import kernels

        if not 0 <= layer < self.kv.num_layers:
            raise InvalidRequestError(f"layer={layer} not in [0, {self.kv.num_layers})")
        slots = torch.from_numpy(np.array(local_slots, dtype=np.int64)).to(self.device)
        k, v = kernels.gather_kv(self.k[layer], self.v[layer], slots)
        return k.cpu(), v.cpu()

    def counts(self) -> dict:
        return {
            "lane": self.lane,
            "incarnation": self.incarnation,
            "held": self.num_held_pages,
            "free": self.num_free_pages,
            "applied": self.num_applied,
            "repeats": self.num_repeats,
        }
