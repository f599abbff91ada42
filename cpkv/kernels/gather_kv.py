"""Gather tokens' K and V rows back out of a lane's paged shard."""

from __future__ import annotations

import torch

from cpkv.kernels import naive
from cpkv.kernels._common import (
    HAS_TRITON,
    as_bits,
    cdiv,
    check_kv_shards,
    check_same_device,
    check_slots,
    for_current_mode,
    tl,
    triton,
    use_triton,
)
from cpkv.kernels.store_kv import kv_tiles

_NAME = "gather_kv"

# Same shape of work as store_kv (one row read, one row written per token and tensor), so the
# same settings: H200, triton 3.6, 128k tok x 8 x 128 bf16: 2048 to 16384 elements per tensor
# per program and 4 or 8 warps all within ~1.5% (260-265 us).
TILE_ELEMS = 2048
MAX_BLOCK_E = 1024
NUM_WARPS = 4

if HAS_TRITON:

    @triton.jit
    def _gather_kv_kernel(
        k_shard_ptr,  # [P * page_size, ROW] contiguous, as same-size ints
        v_shard_ptr,  # [P * page_size, ROW] contiguous
        slots_ptr,  # [T] int64 local slot of each token, -1 = zeros
        k_out_ptr,  # [T, ROW] contiguous
        v_out_ptr,  # [T, ROW] contiguous
        n_tokens,
        ROW: tl.constexpr,  # H * D; constexpr so row offsets carry its alignment (16-B vectors)
        BLOCK_T: tl.constexpr,
        BLOCK_E: tl.constexpr,
    ):
        # Grid: (block of tokens, block of the H*D row).
        t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
        e = tl.program_id(1) * BLOCK_E + tl.arange(0, BLOCK_E)
        t_mask = t < n_tokens
        slot = tl.load(slots_ptr + t, mask=t_mask, other=-1)
        e_mask = (e < ROW)[None, :]
        read_mask = (slot >= 0)[:, None] & e_mask
        write_mask = t_mask[:, None] & e_mask
        # NOTE: int64 offsets: slot * ROW and t * ROW exceed 2**31 in large shards / batches.
        src = slot[:, None] * ROW + e[None, :]
        dst = t.to(tl.int64)[:, None] * ROW + e[None, :]
        k = tl.load(k_shard_ptr + src, mask=read_mask, other=0)
        v = tl.load(v_shard_ptr + src, mask=read_mask, other=0)
        tl.store(k_out_ptr + dst, k, mask=write_mask)
        tl.store(v_out_ptr + dst, v, mask=write_mask)


def gather_kv(
    k_shard: torch.Tensor, v_shard: torch.Tensor, local_slots: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Read tokens' K and V out of a lane's paged shard (the inverse of :func:`store_kv`).

    Args:
        k_shard: [P, page_size, H, D] fp16/bf16/fp32, contiguous.
        v_shard: [P, page_size, H, D] like ``k_shard``.
        local_slots: [T] int64 local slots, each in [0, P * page_size) or -1.

    Returns:
        (k, v), each [T, H, D] contiguous in the shard's dtype; rows of slot -1 are zeros.

    Raises:
        ValueError: bad shapes, dtypes, devices or contiguity.

    NOTE: slots are not range-checked (that would need a device sync).
    """
    check_kv_shards(_NAME, k_shard, v_shard)
    check_slots(_NAME, local_slots)
    device = check_same_device(_NAME, k_shard=k_shard, v_shard=v_shard, local_slots=local_slots)
    n_tokens = local_slots.shape[0]
    heads, dim = k_shard.shape[2:]
    row = heads * dim
    if n_tokens == 0 or row == 0:
        shape = (n_tokens, heads, dim)
        return k_shard.new_zeros(shape), v_shard.new_zeros(shape)
    if not use_triton(_NAME, device):
        return naive.gather_kv(k_shard, v_shard, local_slots)

    k = torch.empty((n_tokens, heads, dim), dtype=k_shard.dtype, device=device)
    v = torch.empty_like(k)
    block_t, block_e = kv_tiles(row, TILE_ELEMS, MAX_BLOCK_E)
    grid = (cdiv(n_tokens, block_t), cdiv(row, block_e))
    for_current_mode(_gather_kv_kernel)[grid](
        as_bits(k_shard),
        as_bits(v_shard),
        local_slots,
        as_bits(k),
        as_bits(v),
        n_tokens,
        ROW=row,
        BLOCK_T=block_t,
        BLOCK_E=block_e,
        num_warps=NUM_WARPS,
    )
    return k, v
