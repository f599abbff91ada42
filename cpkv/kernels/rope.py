"""Split a fused q/k/v projection into heads and rotate q and k (RoPE), in one kernel.

Replaces ~11 small kernels a layer (views, two ``x * cos + rotate_half(x) * sin`` and a copy
of v) with one: what a decode step recorded in a CUDA graph pays for per kernel.
"""

from __future__ import annotations

import torch

from cpkv.kernels import naive
from cpkv.kernels._common import (
    HAS_TRITON,
    KV_DTYPES,
    check_same_device,
    check_tensor,
    for_current_mode,
    next_power_of_2,
    tl,
    triton,
    use_triton,
)

__all__ = ["rope_qkv"]

_NAME = "rope_qkv"
NUM_WARPS = 1  # one head row (64-256 elements) per program

if HAS_TRITON:

    @triton.jit
    def _rope_qkv_kernel(
        qkv_ptr,  # [T, (Hq + 2 Hkv) * D], unit stride on the last dim
        cos_ptr,  # [T, D] contiguous, model dtype
        sin_ptr,  # [T, D] contiguous, model dtype
        q_ptr,  # [T, Hq, D] contiguous
        k_ptr,  # [T, Hkv, D] contiguous
        v_ptr,  # [T, Hkv, D] contiguous
        stride_t,
        HQ: tl.constexpr,
        HKV: tl.constexpr,
        D: tl.constexpr,
        BLOCK_D: tl.constexpr,
    ):
        t = tl.program_id(0).to(tl.int64)
        head = tl.program_id(1)  # q heads, then k heads, then v heads
        d = tl.arange(0, BLOCK_D)
        ok = d < D
        row = qkv_ptr + t * stride_t + head * D
        x = tl.load(row + d, mask=ok, other=0.0)
        dtype = x.dtype
        if head >= HQ + HKV:  # v: a copy
            tl.store(v_ptr + (t * HKV + head - HQ - HKV) * D + d, x, mask=ok)
        else:
            half: tl.constexpr = D // 2
            # rotate_half: [-x2, x1], so the partner of d is d + half (negated) or d - half.
            partner = tl.where(d < half, d + half, d - half)
            xr = tl.load(row + partner, mask=ok, other=0.0).to(tl.float32)
            xr = tl.where(d < half, -xr, xr)
            c = tl.load(cos_ptr + t * D + d, mask=ok, other=0.0).to(tl.float32)
            s = tl.load(sin_ptr + t * D + d, mask=ok, other=0.0).to(tl.float32)
            # Rounded as torch's x * cos + rotate_half(x) * sin in the model dtype: each product
            # rounded, then their sum.
            a = (x.to(tl.float32) * c).to(dtype).to(tl.float32)
            b = (xr * s).to(dtype).to(tl.float32)
            out = (a + b).to(dtype)
            if head < HQ:
                tl.store(q_ptr + (t * HQ + head) * D + d, out, mask=ok)
            else:
                tl.store(k_ptr + (t * HKV + head - HQ) * D + d, out, mask=ok)


def rope_qkv(
    qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, num_heads: int, num_kv_heads: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Heads of a fused q/k/v projection, q and k rotated: ``x * cos + rotate_half(x) * sin``
    rounded as torch rounds it in the model dtype.

    Args:
        qkv: ``[T, (Hq + 2 Hkv) * D]`` (fp16/bf16/fp32), unit stride on the last dim: q heads,
            then k heads, then v heads.
        cos, sin: ``[T, D]``, dtype of ``qkv`` (one row per token).
        num_heads, num_kv_heads: ``Hq`` and ``Hkv``.

    Returns:
        ``(q [T, Hq, D], k [T, Hkv, D], v [T, Hkv, D])``, contiguous.

    Raises:
        ValueError: bad shapes, dtypes, devices or strides.
    """
    qkv = check_tensor(_NAME, "qkv", qkv, ndim=2, dtypes=KV_DTYPES)
    cos = check_tensor(_NAME, "cos", cos, ndim=2, dtypes=(qkv.dtype,), contiguous=True)
    sin = check_tensor(_NAME, "sin", sin, ndim=2, dtypes=(qkv.dtype,), contiguous=True)
    for name, value in (("num_heads", num_heads), ("num_kv_heads", num_kv_heads)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{_NAME}: {name}={value!r} must be an int >= 1")
    t, width = qkv.shape
    heads = num_heads + 2 * num_kv_heads
    d = cos.shape[1]
    if width != heads * d or d % 2:
        raise ValueError(
            f"{_NAME}: qkv has {width} columns, expected ({num_heads} + 2 * {num_kv_heads}) * "
            f"{d} with an even head dim"
        )
    if cos.shape != (t, d) or sin.shape != (t, d):
        raise ValueError(
            f"{_NAME}: cos {tuple(cos.shape)} and sin {tuple(sin.shape)} must be [{t}, {d}]"
        )
    if width > 1 and qkv.stride(1) != 1:
        raise ValueError(f"{_NAME}: qkv must have unit stride on columns, got {qkv.stride()}")
    device = check_same_device(_NAME, qkv=qkv, cos=cos, sin=sin)
    if t == 0 or not use_triton(_NAME, device):
        return naive.rope_qkv(qkv, cos, sin, num_heads, num_kv_heads)
    q = torch.empty((t, num_heads, d), dtype=qkv.dtype, device=device)
    k = torch.empty((t, num_kv_heads, d), dtype=qkv.dtype, device=device)
    v = torch.empty((t, num_kv_heads, d), dtype=qkv.dtype, device=device)
    for_current_mode(_rope_qkv_kernel)[(t, heads)](
        qkv, cos, sin, q, k, v, qkv.stride(0), HQ=num_heads, HKV=num_kv_heads, D=d,
        BLOCK_D=next_power_of_2(d), num_warps=NUM_WARPS,
    )  # fmt: skip
    return q, k, v
