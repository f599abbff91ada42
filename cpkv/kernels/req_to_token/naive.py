"""Plain-torch references for the ``req_to_token`` kernels; also their fallback when Triton
cannot run.

Same signatures as the launchers in :mod:`cpkv.kernels.req_to_token`; vectorised torch, as
:mod:`cpkv.kernels.naive`.
"""

from __future__ import annotations

import torch

from cpkv.kernels.req_to_token._common import check_count

__all__ = ["alloc_extend_slots", "get_last_loc", "write_req_to_token"]


def _segments(lens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """For segments of ``lens[i]`` items laid end to end: each item's segment and index in it.

    Args:
        lens: [n] non-negative int lengths.

    Returns:
        (segment id [sum(lens)] int64, index within its segment [sum(lens)] int64).
    """
    lens = lens.to(torch.int64)
    seg = torch.repeat_interleave(torch.arange(lens.numel(), device=lens.device), lens)
    starts = torch.cumsum(lens, 0) - lens
    pos = torch.arange(seg.numel(), device=lens.device) - starts[seg]
    return seg, pos


def _check_total(kernel: str, name: str, t: torch.Tensor, lens: torch.Tensor, what: str) -> None:
    check_count(kernel, name, t.numel(), int(lens.sum()), what)


def write_req_to_token(
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    prefix_lens: torch.Tensor,
    seq_lens: torch.Tensor,
    out_cache_loc: torch.Tensor,
    prefix_locs: torch.Tensor | None = None,
    *,
    max_extend_len: int | None = None,
    max_prefix_len: int | None = None,
) -> None:
    """Reference for :func:`cpkv.kernels.req_to_token.write_req_to_token` (size hints are
    ignored)."""
    del max_extend_len, max_prefix_len  # only the kernel's grid needs them
    ext_lens = seq_lens.to(torch.int64) - prefix_lens.to(torch.int64)
    if bool((ext_lens < 0).any()):
        raise ValueError(
            f"write_req_to_token: seq_lens {seq_lens.tolist()} < prefix_lens {prefix_lens.tolist()}"
        )
    _check_total("write_req_to_token", "out_cache_loc", out_cache_loc, ext_lens, "extend lengths")
    seg, pos = _segments(ext_lens)
    rows = req_pool_indices.to(torch.int64)
    req_to_token[rows[seg], prefix_lens.to(torch.int64)[seg] + pos] = out_cache_loc.to(
        req_to_token.dtype
    )
    if prefix_locs is not None:
        _check_total("write_req_to_token", "prefix_locs", prefix_locs, prefix_lens, "prefix_lens")
        seg, pos = _segments(prefix_lens)
        req_to_token[rows[seg], pos] = prefix_locs.to(req_to_token.dtype)


def get_last_loc(
    req_to_token: torch.Tensor, req_pool_indices: torch.Tensor, prefix_lens: torch.Tensor
) -> torch.Tensor:
    """Reference for :func:`cpkv.kernels.req_to_token.get_last_loc`."""
    prefix_lens = prefix_lens.to(torch.int64)
    last = req_to_token[req_pool_indices.to(torch.int64), (prefix_lens - 1).clamp(min=0)]
    return torch.where(prefix_lens > 0, last.to(torch.int64), -1)


def alloc_extend_slots(
    prefix_lens: torch.Tensor,
    seq_lens: torch.Tensor,
    last_loc: torch.Tensor,
    new_pages: torch.Tensor,
    page_size: int,
    *,
    extend_num_tokens: int | None = None,
    max_extend_len: int | None = None,
) -> torch.Tensor:
    """Reference for :func:`cpkv.kernels.req_to_token.alloc_extend_slots` (``max_extend_len``
    is ignored)."""
    del max_extend_len  # only the kernel's grid needs it
    prefix_lens = prefix_lens.to(torch.int64)
    seq_lens = seq_lens.to(torch.int64)
    ext_lens = seq_lens - prefix_lens
    if bool((ext_lens < 0).any()):
        raise ValueError(
            f"alloc_extend_slots: seq_lens {seq_lens.tolist()} < prefix_lens {prefix_lens.tolist()}"
        )
    prefix_pages = -(-prefix_lens // page_size)  # pages the prefix already touches
    page_counts = -(-seq_lens // page_size) - prefix_pages
    _check_total("alloc_extend_slots", "new_pages", new_pages, page_counts, "new page counts")
    total = int(ext_lens.sum())
    if extend_num_tokens is not None and extend_num_tokens != total:
        raise ValueError(
            f"alloc_extend_slots: extend_num_tokens={extend_num_tokens} but extend lengths sum "
            f"to {total}"
        )
    page_starts = torch.cumsum(page_counts, 0) - page_counts

    seg, j = _segments(ext_lens)
    pos = prefix_lens[seg] + j  # token position in its sequence
    in_partial_page = pos < prefix_pages[seg] * page_size
    page_index = (page_starts[seg] + pos // page_size - prefix_pages[seg]).clamp(min=0)
    if new_pages.numel() == 0:  # every token continues a partial page (or there are none)
        page = torch.zeros_like(pos)
    else:
        page = new_pages.to(torch.int64)[page_index.clamp(max=new_pages.numel() - 1)]
    return torch.where(
        in_partial_page, last_loc.to(torch.int64)[seg] + 1 + j, page * page_size + pos % page_size
    )
