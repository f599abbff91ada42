"""The page table :func:`cpkv.kernels.paged_partial_attention` reads a lane's shard through."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from cpkv.kernels._common import INT_DTYPES, check_same_device, check_tensor

_NAME = "PagedKVTable"


@dataclass(slots=True, frozen=True, eq=False)
class PagedKVTable:
    """One lane's pages grouped by sequence (CSR), as device tensors.

    Sequence ``b`` owns pages ``cu_pages[b]:cu_pages[b+1]``. Slot ``j`` of page ``i`` (local
    page ``page_table[i]`` of the shard) holds the key at global position ``page_pos[i] + j``
    when ``j < page_len[i]``; slots past that may hold anything (NaN included) and are never
    read. Pages need not be in position order nor contiguous in positions (zigzag segments,
    cached prefixes spread over lanes).

    Attributes:
        page_table: ``int32/int64 [N]`` local page ids, grouped by sequence.
        page_pos: ``int64 [N]`` global position of each page's slot 0.
        page_len: ``int32/int64 [N]`` valid slots of each page, in ``[0, page_size]``.
        cu_pages: ``int32/int64 [B + 1]`` page offsets per sequence (non-decreasing, from 0).

    Raises:
        ValueError: a tensor of the wrong rank or dtype, not contiguous, per-page tensors of
            different lengths, or tensors on different devices. Checked on the host without a
            device sync; the values are checked by the launcher.
    """

    page_table: torch.Tensor
    page_pos: torch.Tensor
    page_len: torch.Tensor
    cu_pages: torch.Tensor

    def __post_init__(self) -> None:
        check_tensor(_NAME, "cu_pages", self.cu_pages, ndim=1, dtypes=INT_DTYPES, contiguous=True)
        for name, dtypes in (
            ("page_table", INT_DTYPES),
            ("page_pos", (torch.int64,)),
            ("page_len", INT_DTYPES),
        ):
            check_tensor(_NAME, name, getattr(self, name), ndim=1, dtypes=dtypes, contiguous=True)
        if not self.page_table.shape == self.page_pos.shape == self.page_len.shape:
            raise ValueError(
                f"{_NAME}: page_table has shape {tuple(self.page_table.shape)}, page_pos has "
                f"shape {tuple(self.page_pos.shape)}, page_len has shape "
                f"{tuple(self.page_len.shape)}; they must have one length"
            )
        check_same_device(
            _NAME,
            page_table=self.page_table,
            page_pos=self.page_pos,
            page_len=self.page_len,
            cu_pages=self.cu_pages,
        )

    @property
    def num_pages(self) -> int:
        """``N``, the pages of all sequences (from the shape: no device sync)."""
        return self.page_table.shape[0]
