"""Merge partial attention outputs (one per lane) by their log-sum-exps."""

from __future__ import annotations

import torch

from cpkv.kernels import naive
from cpkv.kernels._common import (
    HAS_TRITON,
    KV_DTYPES,
    cdiv,
    check_same_device,
    check_tensor,
    for_current_mode,
    next_power_of_2,
    tl,
    triton,
    use_triton,
)

_NAME = "merge_attn_states"

# Output elements per program: 4096 fp32 = 16 KiB written, L x 16 KiB read, 8 fp32 (two 16-byte
# vectors) per thread and part at 4 warps; a streaming reduction, bound by HBM like a copy.
TILE_ELEMS = 4096
NUM_WARPS = 4

if HAS_TRITON:

    @triton.jit
    def _merge_attn_states_kernel(
        outs_ptr,  # [L, T, H, D], unit stride on D
        lses_ptr,  # [L, T, H] fp32
        out_ptr,  # [T, H, D] fp32 contiguous
        lse_ptr,  # [T, H] fp32 contiguous
        n_rows,  # T * H
        n_parts,  # L
        n_heads,  # H
        stride_ol,
        stride_ot,
        stride_oh,
        stride_ll,
        stride_lt,
        stride_lh,
        HEAD_DIM: tl.constexpr,
        BLOCK_R: tl.constexpr,
        BLOCK_D: tl.constexpr,
    ):
        # Grid: (block of BLOCK_R (token, head) rows). Two passes over the parts' lse (cheap),
        # one over their outputs.
        r = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
        r_ok = r < n_rows
        t = r // n_heads
        h = r % n_heads
        d = tl.arange(0, BLOCK_D)
        mask = r_ok[:, None] & (d < HEAD_DIM)[None, :]
        lse_off = t * stride_lt + h * stride_lh
        o_off = (t * stride_ot + h * stride_oh)[:, None] + d[None, :]

        m = tl.full([BLOCK_R], float("-inf"), dtype=tl.float32)
        for part in range(n_parts):
            # NOTE: int64 offsets: a [cp, T, H, D] stack passes 2**31 elements at cp=4, T=180k,
            # 32 x 128 heads (the loop counter and a stride below 2**31 are int32).
            p64 = tl.cast(part, tl.int64)
            lse = tl.load(lses_ptr + p64 * stride_ll + lse_off, mask=r_ok, other=float("-inf"))
            m = tl.maximum(m, lse)
        # No part saw a key: weights exp(-inf - 0) = 0, so out 0 and lse -inf below.
        m_safe = tl.where(m == float("-inf"), 0.0, m)
        acc = tl.zeros([BLOCK_R, BLOCK_D], dtype=tl.float32)
        s = tl.zeros([BLOCK_R], dtype=tl.float32)
        for part in range(n_parts):
            p64 = tl.cast(part, tl.int64)
            lse = tl.load(lses_ptr + p64 * stride_ll + lse_off, mask=r_ok, other=float("-inf"))
            w = tl.math.exp2((lse - m_safe) * 1.4426950408889634)
            o = tl.load(outs_ptr + p64 * stride_ol + o_off, mask=mask, other=0.0).to(tl.float32)
            # NOTE: a part that saw no key (w == 0) adds nothing even if its out is not 0.
            acc += tl.where(w[:, None] > 0.0, w[:, None] * o, 0.0)
            s += w
        seen = s > 0.0
        out = acc / tl.where(seen, s, 1.0)[:, None]
        lse_out = tl.where(seen, m_safe + tl.log(tl.where(seen, s, 1.0)), float("-inf"))
        tl.store(out_ptr + (r * HEAD_DIM)[:, None] + d[None, :], out, mask=mask)
        tl.store(lse_ptr + r, lse_out, mask=r_ok)


def merge_attn_states(outs: torch.Tensor, lses: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Combine partial attentions (each normalised over its own keys) into the attention over
    the union of their keys: ``out = sum_l w_l * outs[l] / sum_l w_l`` with
    ``w_l = exp(lses[l] - max_l lses[l])``, ``lse = log(sum_l exp(lses[l]))``.

    Args:
        outs: ``[L, T, H, D]`` partial outputs (fp16/bf16/fp32), unit stride on D.
        lses: ``fp32 [L, T, H]`` their log-sum-exps (``-inf``: that part saw no key, and its
            output is ignored).

    Returns:
        ``(out, lse)``: fp32 ``[T, H, D]`` and ``[T, H]``, contiguous; 0 and ``-inf`` where no
        part saw a key (also for ``L == 0``).

    Raises:
        ValueError: bad shapes, dtypes, devices or strides.
    """
    outs = check_tensor(_NAME, "outs", outs, ndim=4, dtypes=KV_DTYPES)
    lses = check_tensor(_NAME, "lses", lses, ndim=3, dtypes=(torch.float32,))
    if outs.shape[:3] != lses.shape:
        raise ValueError(
            f"{_NAME}: outs has shape {tuple(outs.shape)} but lses has shape "
            f"{tuple(lses.shape)}; [L, T, H] must match"
        )
    if outs.numel() > 0 and outs.stride(3) != 1 and outs.shape[3] > 1:
        raise ValueError(
            f"{_NAME}: outs must have unit stride on D, got shape {tuple(outs.shape)} "
            f"with strides {outs.stride()}"
        )
    device = check_same_device(_NAME, outs=outs, lses=lses)
    n_parts, t, h, d = outs.shape
    if n_parts == 0 or t * h * d == 0:
        out = torch.zeros((t, h, d), dtype=torch.float32, device=device)
        return out, torch.full((t, h), float("-inf"), dtype=torch.float32, device=device)
    if not use_triton(_NAME, device):
        return naive.merge_attn_states(outs, lses)

    out = torch.empty((t, h, d), dtype=torch.float32, device=device)
    lse = torch.empty((t, h), dtype=torch.float32, device=device)
    block_d = next_power_of_2(d)
    block_r = max(1, TILE_ELEMS // block_d)
    n_rows = t * h
    for_current_mode(_merge_attn_states_kernel)[(cdiv(n_rows, block_r),)](
        outs,
        lses,
        out,
        lse,
        n_rows,
        n_parts,
        h,
        outs.stride(0),
        outs.stride(1),
        outs.stride(2),
        lses.stride(0),
        lses.stride(1),
        lses.stride(2),
        HEAD_DIM=d,
        BLOCK_R=block_r,
        BLOCK_D=block_d,
        num_warps=NUM_WARPS,
    )
    return out, lse
