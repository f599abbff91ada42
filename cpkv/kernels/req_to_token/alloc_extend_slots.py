"""Expand an extend's new pages (and the rest of each partial last page) into token slots."""

from __future__ import annotations

import torch

from cpkv.kernels._common import (
    HAS_TRITON,
    INT_DTYPES,
    cdiv,
    check_hint,
    check_same_device,
    check_tensor,
    for_current_mode,
    tl,
    triton,
    use_triton,
)
from cpkv.kernels.req_to_token import naive
from cpkv.kernels.req_to_token._common import check_count, check_same_len, request_chunks

_NAME = "alloc_extend_slots"

# Output slots per program: 1024 int64 = 8 KiB written per program, 8 per thread at 4 warps;
# the page-id reads are ~page_size times fewer, so this is a store-bound fill.
BLOCK = 1024
NUM_WARPS = 4

if HAS_TRITON:

    @triton.jit
    def _alloc_extend_slots_kernel(
        prefix_lens_ptr,  # [bs]
        seq_lens_ptr,  # [bs]
        last_loc_ptr,  # [bs] slot of the last prefix token, -1 for none
        cum_ptr,  # [4, bs] int64 inclusive cumsums of prefix_lens, seq_lens and their page counts
        cum_row_stride,
        new_pages_ptr,  # [sum(new pages)] global page ids, requests in batch order
        out_ptr,  # [sum(new tokens)] int64
        page_size,
        BLOCK: tl.constexpr,
    ):
        # Grid: (block of the request's new tokens, request).
        req = tl.program_id(1)
        j = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)

        prefix_len = tl.load(prefix_lens_ptr + req).to(tl.int64)
        seq_len = tl.load(seq_lens_ptr + req).to(tl.int64)
        ext_len = seq_len - prefix_len
        prefix_pages = (prefix_len + page_size - 1) // page_size  # pages the prefix touches
        n_pages = (seq_len + page_size - 1) // page_size - prefix_pages
        # Exclusive starts = inclusive cumsum - own count: O(1) per program.
        cum_tokens = tl.load(cum_ptr + cum_row_stride + req) - tl.load(cum_ptr + req)
        cum_pages = tl.load(cum_ptr + 3 * cum_row_stride + req) - tl.load(
            cum_ptr + 2 * cum_row_stride + req
        )
        out_start = cum_tokens - ext_len
        page_start = cum_pages - n_pages
        last_loc = tl.load(last_loc_ptr + req).to(tl.int64)

        mask = j < ext_len
        pos = prefix_len + j  # position in the sequence
        # NOTE: positions before prefix_pages * page_size continue the prefix's partial last
        # page, whose slots follow last_loc; the rest come from the new pages in order.
        in_partial = pos < prefix_pages * page_size
        page = tl.load(
            new_pages_ptr + page_start + pos // page_size - prefix_pages,
            mask=mask & (~in_partial),
            other=0,
        ).to(tl.int64)
        slot = tl.where(in_partial, last_loc + 1 + j, page * page_size + pos % page_size)
        tl.store(out_ptr + out_start + j, slot, mask=mask)


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
    """Slots of each request's new tokens, from its last cached slot and its new pages.

    Request ``i`` gets ``seq_lens[i] - prefix_lens[i]`` slots: first the rest of its partial last
    page (``last_loc[i] + 1``, ``+ 2``, ... while inside that page; only when
    ``prefix_lens[i] % page_size != 0``), then ``page * page_size + offset`` over its new pages
    in order, stopping at ``seq_lens[i]``. It owns
    ``ceil(seq_lens[i] / page_size) - ceil(prefix_lens[i] / page_size)`` of ``new_pages``.

    Args:
        prefix_lens: [bs] int64/int32 cached prefix length of each request.
        seq_lens: [bs] int64/int32 total length of each request (>= its prefix length).
        last_loc: [bs] int64/int32 slot of each request's last prefix token (-1 when none),
            as :func:`get_last_loc` returns.
        new_pages: [sum of new page counts] int64/int32 global page ids, requests in batch order.
        page_size: tokens per page, any int >= 1.
        extend_num_tokens: optional host-side ``sum(seq_lens - prefix_lens)``.
        max_extend_len: optional host-side upper bound of ``seq_lens - prefix_lens``. With both
            hints given the launch needs no device sync.

    Returns:
        [sum(seq_lens - prefix_lens)] int64 slots, requests in batch order.

    Raises:
        ValueError: bad shapes, dtypes, devices, contiguity or page_size; and, when a hint is
            missing (so the launcher reads the lengths anyway), counts that do not add up.

    NOTE: with both hints given, values are not checked (that would need a device sync).
    """
    for name, t in (
        ("prefix_lens", prefix_lens),
        ("seq_lens", seq_lens),
        ("last_loc", last_loc),
        ("new_pages", new_pages),
    ):
        check_tensor(_NAME, name, t, ndim=1, dtypes=INT_DTYPES, contiguous=True)
    bs = check_same_len(_NAME, prefix_lens=prefix_lens, seq_lens=seq_lens, last_loc=last_loc)
    device = check_same_device(
        _NAME, prefix_lens=prefix_lens, seq_lens=seq_lens, last_loc=last_loc, new_pages=new_pages
    )
    if isinstance(page_size, bool) or not isinstance(page_size, int) or page_size < 1:
        raise ValueError(f"{_NAME}: page_size must be an int >= 1, got {page_size!r}")
    check_hint(_NAME, "extend_num_tokens", extend_num_tokens)
    check_hint(_NAME, "max_extend_len", max_extend_len)
    if bs == 0:
        return torch.empty(0, dtype=torch.int64, device=device)
    if not use_triton(_NAME, device):
        return naive.alloc_extend_slots(
            prefix_lens,
            seq_lens,
            last_loc,
            new_pages,
            page_size,
            extend_num_tokens=extend_num_tokens,
        )

    # One inclusive cumsum of the lengths and their page counts (ceil(len / page_size)), computed
    # once; programs derive their exclusive starts. 4 small launches in all.
    lens = torch.stack((prefix_lens, seq_lens)).to(torch.int64)
    pages = torch.div(lens + (page_size - 1), page_size, rounding_mode="floor")
    cum = torch.cumsum(torch.cat((lens, pages)), dim=1)
    if extend_num_tokens is None or max_extend_len is None:
        extend_num_tokens, max_extend_len = _read_sizes(lens, cum, new_pages, extend_num_tokens)
    out = torch.empty(extend_num_tokens, dtype=torch.int64, device=device)
    if extend_num_tokens == 0 or max_extend_len == 0:
        return out

    kernel = for_current_mode(_alloc_extend_slots_kernel)
    n_blocks = cdiv(max_extend_len, BLOCK)
    for n_req, (pre, seq, last, cum_part) in request_chunks(
        bs, prefix_lens, seq_lens, last_loc, cum
    ):
        kernel[(n_blocks, n_req)](
            pre,
            seq,
            last,
            cum_part,
            cum.stride(0),
            new_pages,
            out,
            page_size,
            BLOCK=BLOCK,
            num_warps=NUM_WARPS,
        )
    return out


def _read_sizes(
    lens: torch.Tensor, cum: torch.Tensor, new_pages: torch.Tensor, extend_num_tokens: int | None
) -> tuple[int, int]:
    """Read the total and max extend length from the device (one sync); check the counts."""
    ext_lens = lens[1] - lens[0]
    min_ext, max_ext, min_pre, *totals = torch.cat(
        (torch.stack((ext_lens.min(), ext_lens.max(), lens[0].min())), cum[:, -1])
    ).tolist()
    total_tokens, total_pages = totals[1] - totals[0], totals[3] - totals[2]
    if min_ext < 0:
        raise ValueError(f"{_NAME}: seq_lens {lens[1].tolist()} < prefix_lens {lens[0].tolist()}")
    if min_pre < 0:
        raise ValueError(f"{_NAME}: prefix_lens {lens[0].tolist()} must be >= 0")
    check_count(_NAME, "new_pages", new_pages.numel(), total_pages, "new page counts")
    if extend_num_tokens is not None and extend_num_tokens != total_tokens:
        raise ValueError(
            f"{_NAME}: extend_num_tokens={extend_num_tokens} but extend lengths sum to "
            f"{total_tokens}"
        )
    return total_tokens, max_ext
