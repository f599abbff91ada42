"""Read each request's last cached slot from ``req_to_token``."""

from __future__ import annotations

import torch

from cpkv.kernels._common import (
    HAS_TRITON,
    INT_DTYPES,
    cdiv,
    check_same_device,
    check_tensor,
    for_current_mode,
    tl,
    triton,
    use_triton,
)
from cpkv.kernels.req_to_token import naive
from cpkv.kernels.req_to_token._common import check_same_len, check_table

_NAME = "get_last_loc"

# Requests per program: one gathered element per request, so one program covers typical
# batches and large ones still spread over several SMs.
BLOCK = 256
NUM_WARPS = 4

if HAS_TRITON:

    @triton.jit
    def _get_last_loc_kernel(
        table_ptr,  # [max_reqs, max_context_len] int64 or int32
        table_row_stride,
        req_idx_ptr,  # [bs]
        prefix_lens_ptr,  # [bs]
        out_ptr,  # [bs] int64
        bs,
        BLOCK: tl.constexpr,
    ):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < bs
        row = tl.load(req_idx_ptr + offs, mask=mask, other=0).to(tl.int64)
        prefix_len = tl.load(prefix_lens_ptr + offs, mask=mask, other=0).to(tl.int64)
        has_prefix = prefix_len > 0
        last = tl.load(
            table_ptr + row * table_row_stride + prefix_len - 1, mask=mask & has_prefix, other=-1
        )
        tl.store(out_ptr + offs, last.to(tl.int64), mask=mask)


def get_last_loc(
    req_to_token: torch.Tensor, req_pool_indices: torch.Tensor, prefix_lens: torch.Tensor
) -> torch.Tensor:
    """Slot of each request's last prefix token, or -1 for an empty prefix.

    Args:
        req_to_token: [max_reqs, max_context_len] int64 or int32 table; rows have unit column
            stride.
        req_pool_indices: [bs] int64/int32 row of each request.
        prefix_lens: [bs] int64/int32 prefix length of each request (<= max_context_len).

    Returns:
        [bs] int64: ``req_to_token[req_pool_indices[i], prefix_lens[i] - 1]``, or -1 where
        ``prefix_lens[i] == 0``.

    Raises:
        ValueError: bad shapes, dtypes, devices or contiguity.

    NOTE: values are not checked (that would need a device sync, which this launcher never
    makes): rows must lie in the table and prefix lengths in [0, max_context_len], or the
    kernel reads outside them.
    """
    check_table(_NAME, req_to_token)
    for name, t in (("req_pool_indices", req_pool_indices), ("prefix_lens", prefix_lens)):
        check_tensor(_NAME, name, t, ndim=1, dtypes=INT_DTYPES, contiguous=True)
    bs = check_same_len(_NAME, req_pool_indices=req_pool_indices, prefix_lens=prefix_lens)
    device = check_same_device(
        _NAME,
        req_to_token=req_to_token,
        req_pool_indices=req_pool_indices,
        prefix_lens=prefix_lens,
    )
    out = torch.empty(bs, dtype=torch.int64, device=device)
    if bs == 0:
        return out
    if not use_triton(_NAME, device):
        return naive.get_last_loc(req_to_token, req_pool_indices, prefix_lens)
    for_current_mode(_get_last_loc_kernel)[(cdiv(bs, BLOCK),)](
        req_to_token,
        req_to_token.stride(0),
        req_pool_indices,
        prefix_lens,
        out,
        bs,
        BLOCK=BLOCK,
        num_warps=NUM_WARPS,
    )
    return out
