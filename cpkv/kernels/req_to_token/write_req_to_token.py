"""Write each request's prefix and new slots into its ``req_to_token`` row."""

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
from cpkv.kernels.req_to_token._common import (
    check_count,
    check_same_len,
    check_table,
    request_chunks,
)

_NAME = "write_req_to_token"

# Slots per program. 1024 int64 = 8 KiB read + 8 KiB written per program, 8 per thread at 4
# warps: enough bytes in flight per SM for a pure copy without starving the grid at bs=256 x 8k.
# H200, triton 3.6: BLOCK 512..4096 x 4 or 8 warps all within ~3% at bs=1 x 1M, 64 x 32k and
# 256 x 8k: these sizes (17-34 MB) are one wave, bound by launch and ramp, not by the tiling.
BLOCK = 1024
# A streaming copy needs no more than 4 warps to cover its latency with 8 loads each.
NUM_WARPS = 4

if HAS_TRITON:

    @triton.jit
    def _write_req_to_token_kernel(
        table_ptr,  # [max_reqs, max_context_len] int64 or int32; rows have unit column stride
        table_row_stride,
        req_idx_ptr,  # [bs] row of each request
        prefix_lens_ptr,  # [bs]
        seq_lens_ptr,  # [bs]
        cum_ptr,  # [2, bs] int64: inclusive cumsums of prefix_lens (row 0) and seq_lens (row 1)
        cum_row_stride,
        out_cache_loc_ptr,  # [sum(seq_lens - prefix_lens)] int64
        prefix_locs_ptr,  # [sum(prefix_lens)] int64 (unused unless HAS_PREFIX)
        HAS_PREFIX: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
        # Grid: (block within the request, request). Each program copies one block of the
        # request's new slots and, with HAS_PREFIX, the same-numbered block of its prefix slots.
        req = tl.program_id(1)
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)

        row = tl.load(req_idx_ptr + req).to(tl.int64)
        prefix_len = tl.load(prefix_lens_ptr + req).to(tl.int64)
        ext_len = tl.load(seq_lens_ptr + req).to(tl.int64) - prefix_len
        cum_prefix = tl.load(cum_ptr + req)
        # Exclusive start = inclusive cumsum - own length: O(1) per program.
        ext_start = tl.load(cum_ptr + cum_row_stride + req) - cum_prefix - ext_len
        row_ptr = table_ptr + row * table_row_stride
        out_ty = table_ptr.dtype.element_ty

        mask = offs < ext_len
        vals = tl.load(out_cache_loc_ptr + ext_start + offs, mask=mask)
        tl.store(row_ptr + prefix_len + offs, vals.to(out_ty), mask=mask)

        if HAS_PREFIX:
            prefix_start = cum_prefix - prefix_len
            pmask = offs < prefix_len
            pvals = tl.load(prefix_locs_ptr + prefix_start + offs, mask=pmask)
            tl.store(row_ptr + offs, pvals.to(out_ty), mask=pmask)


def _validate(
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    prefix_lens: torch.Tensor,
    seq_lens: torch.Tensor,
    out_cache_loc: torch.Tensor,
    prefix_locs: torch.Tensor | None,
    max_extend_len: int | None,
    max_prefix_len: int | None,
) -> None:
    check_table(_NAME, req_to_token)
    for name, t in (
        ("req_pool_indices", req_pool_indices),
        ("prefix_lens", prefix_lens),
        ("seq_lens", seq_lens),
    ):
        check_tensor(_NAME, name, t, ndim=1, dtypes=INT_DTYPES, contiguous=True)
    check_same_len(
        _NAME, req_pool_indices=req_pool_indices, prefix_lens=prefix_lens, seq_lens=seq_lens
    )
    slots = (torch.int64,)
    check_tensor(_NAME, "out_cache_loc", out_cache_loc, ndim=1, dtypes=slots, contiguous=True)
    if prefix_locs is not None:
        check_tensor(_NAME, "prefix_locs", prefix_locs, ndim=1, dtypes=slots, contiguous=True)
    check_same_device(
        _NAME,
        req_to_token=req_to_token,
        req_pool_indices=req_pool_indices,
        prefix_lens=prefix_lens,
        seq_lens=seq_lens,
        out_cache_loc=out_cache_loc,
        prefix_locs=prefix_locs,
    )
    check_hint(_NAME, "max_extend_len", max_extend_len)
    check_hint(_NAME, "max_prefix_len", max_prefix_len)


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
    """Write requests' slots into their ``req_to_token`` rows, in place.

    For request ``i`` with row ``r = req_pool_indices[i]``:
    ``req_to_token[r, prefix_lens[i]:seq_lens[i]]`` = its new slots, and, when ``prefix_locs`` is
    given, ``req_to_token[r, :prefix_lens[i]]`` = its prefix slots.

    Args:
        req_to_token: [max_reqs, max_context_len] int64 or int32 table (values are cast);
            rows must have unit column stride.
        req_pool_indices: [bs] int64/int32 row of each request.
        prefix_lens: [bs] int64/int32 cached prefix length of each request.
        seq_lens: [bs] int64/int32 total length of each request (>= its prefix length).
        out_cache_loc: [sum(seq_lens - prefix_lens)] int64 new slots, requests in batch order.
        prefix_locs: None, or [sum(prefix_lens)] int64 prefix slots, requests in batch order.
        max_extend_len: optional host-side max of ``seq_lens - prefix_lens`` (any upper bound
            works; larger only adds idle programs). Given, the launch needs no device sync.
        max_prefix_len: likewise for ``prefix_lens``; only used with ``prefix_locs``.

    Raises:
        ValueError: bad shapes, dtypes, devices or contiguity; and, when a hint is missing (so
            the launcher reads the lengths anyway), element counts that do not match the
            lengths, lengths outside the table's width or rows outside the table.

    NOTE: with both hints given, values are not checked (that would need a device sync): rows,
    lengths and hints must be in range, or the kernel writes out of bounds / misses slots.
    """
    _validate(
        req_to_token,
        req_pool_indices,
        prefix_lens,
        seq_lens,
        out_cache_loc,
        prefix_locs,
        max_extend_len,
        max_prefix_len,
    )
    bs = req_pool_indices.shape[0]
    if bs == 0:
        return
    if not use_triton(_NAME, req_to_token.device):
        naive.write_req_to_token(
            req_to_token, req_pool_indices, prefix_lens, seq_lens, out_cache_loc, prefix_locs
        )
        return

    has_prefix = prefix_locs is not None
    # One inclusive cumsum of both length rows, computed once; programs derive exclusive starts.
    cum = torch.cumsum(torch.stack((prefix_lens, seq_lens)), dim=1, dtype=torch.int64)
    if max_extend_len is None or (has_prefix and max_prefix_len is None):
        max_extend_len, max_prefix_len = _read_sizes(
            req_to_token, req_pool_indices, prefix_lens, seq_lens, cum, out_cache_loc, prefix_locs
        )
    max_len = max(max_extend_len, max_prefix_len or 0) if has_prefix else max_extend_len
    if max_len == 0:
        return

    kernel = for_current_mode(_write_req_to_token_kernel)
    n_blocks = cdiv(max_len, BLOCK)
    prefix_arg = prefix_locs if has_prefix else out_cache_loc  # never read without HAS_PREFIX
    for n_req, (rows, pre, seq, cum_part) in request_chunks(
        bs, req_pool_indices, prefix_lens, seq_lens, cum
    ):
        kernel[(n_blocks, n_req)](
            req_to_token,
            req_to_token.stride(0),
            rows,
            pre,
            seq,
            cum_part,
            cum.stride(0),
            out_cache_loc,
            prefix_arg,
            HAS_PREFIX=has_prefix,
            BLOCK=BLOCK,
            num_warps=NUM_WARPS,
        )


def _read_sizes(
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    prefix_lens: torch.Tensor,
    seq_lens: torch.Tensor,
    cum: torch.Tensor,
    out_cache_loc: torch.Tensor,
    prefix_locs: torch.Tensor | None,
) -> tuple[int, int]:
    """Read the max lengths from the device (one sync) and check the totals, the rows and
    the lengths against the table while at it (the kernel stores unchecked)."""
    ext = seq_lens.to(torch.int64) - prefix_lens
    i64 = torch.int64
    stats = torch.cat(
        (
            torch.stack(
                (
                    ext.min(),
                    ext.max(),
                    prefix_lens.max().to(i64),
                    prefix_lens.min().to(i64),
                    seq_lens.max().to(i64),
                    req_pool_indices.min().to(i64),
                    req_pool_indices.max().to(i64),
                )
            ),
            cum[:, -1],
        )
    )
    min_ext, max_ext, max_pre, min_pre, max_seq, min_row, max_row, total_pre, total_seq = (
        stats.tolist()
    )
    if min_ext < 0:
        raise ValueError(
            f"{_NAME}: seq_lens {seq_lens.tolist()} < prefix_lens {prefix_lens.tolist()}"
        )
    rows, width = req_to_token.shape
    if min_pre < 0 or max_seq > width:
        raise ValueError(
            f"{_NAME}: lengths must lie in [0, {width}] (req_to_token's width), got prefix_lens "
            f"down to {min_pre}, seq_lens up to {max_seq}"
        )
    if min_row < 0 or max_row >= rows:
        raise ValueError(
            f"{_NAME}: req_pool_indices must lie in [0, {rows}), got [{min_row}, {max_row}]"
        )
    check_count(
        _NAME, "out_cache_loc", out_cache_loc.numel(), total_seq - total_pre, "extend lengths"
    )
    if prefix_locs is not None:
        check_count(_NAME, "prefix_locs", prefix_locs.numel(), total_pre, "prefix_lens")
    return max_ext, max_pre
