"""Scatter tokens' K and V rows into a lane's paged shard."""

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
    check_tensor,
    for_current_mode,
    next_power_of_2,
    tl,
    triton,
    use_triton,
)

_NAME = "store_kv"

# Elements of one tensor (K or V) per program: 2048 bf16 = 4 KiB of K plus 4 KiB of V in flight,
# 2 x 16-byte vectors per thread per tensor at 4 warps; the many programs an SM holds cover HBM
# latency. H200, triton 3.6, 128k tok x 8 x 128 bf16 random slots: 2048 beat 4096..16384 by ~2%
# (269 vs 273-275 us); 4 vs 8 warps made no difference.
TILE_ELEMS = 2048
# Widest row chunk one program copies; a full H*D row up to this (1024 = 8 heads x 128 dim).
MAX_BLOCK_E = 1024
# Copies need few registers; 4 warps per program leaves room for many programs per SM.
NUM_WARPS = 4

if HAS_TRITON:

    @triton.jit
    def _store_kv_kernel(
        k_ptr,  # [T, ROW] rows of K (token stride k_token_stride), as same-size ints
        v_ptr,  # [T, ROW] rows of V
        k_shard_ptr,  # [P * page_size, ROW] contiguous
        v_shard_ptr,  # [P * page_size, ROW] contiguous
        slots_ptr,  # [T] int64 local slot of each token, -1 = skip
        n_tokens,
        k_token_stride,
        v_token_stride,
        ROW: tl.constexpr,  # H * D; constexpr so row offsets carry its alignment (16-B vectors)
        BLOCK_T: tl.constexpr,
        BLOCK_E: tl.constexpr,
    ):
        # Grid: (block of tokens, block of the H*D row).
        t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
        e = tl.program_id(1) * BLOCK_E + tl.arange(0, BLOCK_E)
        slot = tl.load(slots_ptr + t, mask=t < n_tokens, other=-1)
        mask = (slot >= 0)[:, None] & (e < ROW)[None, :]
        # NOTE: int64 offsets: slot * ROW and t * stride exceed 2**31 in large shards / batches.
        dst = slot[:, None] * ROW + e[None, :]
        t64 = t.to(tl.int64)[:, None]
        k = tl.load(k_ptr + t64 * k_token_stride + e[None, :], mask=mask)
        v = tl.load(v_ptr + t64 * v_token_stride + e[None, :], mask=mask)
        tl.store(k_shard_ptr + dst, k, mask=mask)
        tl.store(v_shard_ptr + dst, v, mask=mask)


def kv_tiles(row: int, tile_elems: int, max_block_e: int) -> tuple[int, int]:
    """(BLOCK_T, BLOCK_E) for rows of ``row`` elements: a power-of-two row chunk, whole rows
    when they fit, and as many tokens as fill ``tile_elems``."""
    block_e = min(next_power_of_2(row), max_block_e)
    return max(1, tile_elems // block_e), block_e


def _rows_contiguous(t: torch.Tensor) -> bool:
    """Each token's [H, D] block is contiguous (the token stride may be anything)."""
    return t.shape[0] == 0 or t[0].is_contiguous()


def store_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    k_shard: torch.Tensor,
    v_shard: torch.Tensor,
    local_slots: torch.Tensor,
) -> None:
    """Write tokens' K and V into a lane's paged shard, in place.

    ``k[t]`` goes to ``k_shard.view(-1, H, D)[local_slots[t]]`` (page ``s // page_size``, offset
    ``s % page_size``), likewise ``v``. Slots may come in any order; -1 skips the token.

    Args:
        k: [T, H, D] fp16/bf16/fp32, each token's [H, D] contiguous (any token stride).
        v: [T, H, D] same shape and dtype as ``k``, same layout rule.
        k_shard: [P, page_size, H, D] contiguous, dtype of ``k`` (one layer of a lane's shard).
        v_shard: [P, page_size, H, D] like ``k_shard``.
        local_slots: [T] int64 local slots, each in [0, P * page_size) or -1.

    Raises:
        ValueError: bad shapes, dtypes, devices or contiguity.

    NOTE: slots are not range-checked (that would need a device sync); two tokens with one slot
    leave either token's row there.
    """
    check_kv_shards(_NAME, k_shard, v_shard)
    check_slots(_NAME, local_slots)
    k = check_tensor(_NAME, "k", k, ndim=3)
    v = check_tensor(_NAME, "v", v, ndim=3)
    if k.shape != v.shape:
        raise ValueError(f"{_NAME}: k has shape {tuple(k.shape)} but v has shape {tuple(v.shape)}")
    if k.shape[1:] != k_shard.shape[2:]:
        raise ValueError(
            f"{_NAME}: k has shape {tuple(k.shape)} but k_shard has shape "
            f"{tuple(k_shard.shape)}; [H, D] must match"
        )
    if k.shape[0] != local_slots.shape[0]:
        raise ValueError(
            f"{_NAME}: k has {k.shape[0]} tokens but local_slots has shape "
            f"{tuple(local_slots.shape)}"
        )
    for name, t in (("k", k), ("v", v)):
        if t.dtype != k_shard.dtype:
            raise ValueError(
                f"{_NAME}: {name} has dtype {t.dtype} but k_shard has dtype {k_shard.dtype}"
            )
        if not _rows_contiguous(t):
            raise ValueError(
                f"{_NAME}: {name} must have contiguous [H, D] rows, got shape {tuple(t.shape)} "
                f"with strides {t.stride()}"
            )
    device = check_same_device(
        _NAME, k=k, v=v, k_shard=k_shard, v_shard=v_shard, local_slots=local_slots
    )
    n_tokens = k.shape[0]
    row = k.shape[1] * k.shape[2]
    if n_tokens == 0 or row == 0:
        return
    if not use_triton(_NAME, device):
        naive.store_kv(k, v, k_shard, v_shard, local_slots)
        return

    block_t, block_e = kv_tiles(row, TILE_ELEMS, MAX_BLOCK_E)
    grid = (cdiv(n_tokens, block_t), cdiv(row, block_e))
    for_current_mode(_store_kv_kernel)[grid](
        as_bits(k),
        as_bits(v),
        as_bits(k_shard),
        as_bits(v_shard),
        local_slots,
        n_tokens,
        k.stride(0),
        v.stride(0),
        ROW=row,
        BLOCK_T=block_t,
        BLOCK_E=block_e,
        num_warps=NUM_WARPS,
    )
