"""RMSNorm of rows, rounded as transformers' LlamaRMSNorm rounds (one kernel instead of ~7)."""

from __future__ import annotations

import torch

from cpkv.kernels import naive
from cpkv.kernels._common import (
    HAS_TRITON,
    KV_DTYPES,
    check_real,
    check_same_device,
    check_tensor,
    for_current_mode,
    next_power_of_2,
    tl,
    triton,
    use_triton,
)

__all__ = ["rms_norm"]

_NAME = "rms_norm"
# One row per program: a 2048-wide bf16 row is 4 KiB, 16 elements a thread at 4 warps.
NUM_WARPS = 4

if HAS_TRITON:

    @triton.jit
    def _rms_norm_kernel(
        x_ptr,  # [T, H], unit stride on H
        w_ptr,  # [H]
        out_ptr,  # [T, H] contiguous
        stride_x,
        eps,
        H: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        ok = cols < H
        x = tl.load(x_ptr + row * stride_x + cols, mask=ok, other=0.0).to(tl.float32)
        var = tl.sum(x * x, axis=0) / H
        # transformers: normalise in fp32, round to the model dtype, then scale in that dtype
        # (the product of two model-dtype values, computed in fp32 and rounded once).
        xn = (x * tl.math.rsqrt(var + eps)).to(out_ptr.dtype.element_ty)
        w = tl.load(w_ptr + cols, mask=ok, other=0.0)
        out = (w.to(tl.float32) * xn.to(tl.float32)).to(out_ptr.dtype.element_ty)
        tl.store(out_ptr + row * H + cols, out, mask=ok)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``weight * (x / sqrt(mean(x^2) + eps))`` per row, as transformers' ``LlamaRMSNorm``:
    the norm in fp32, rounded to ``x``'s dtype, then scaled by ``weight`` in that dtype.

    Args:
        x: ``[T, H]`` (fp16/bf16/fp32), unit stride on ``H``.
        weight: ``[H]``, dtype of ``x``.
        eps: added to the mean square.

    Returns:
        ``[T, H]`` contiguous, dtype of ``x``.

    Raises:
        ValueError: bad shapes, dtypes, devices or strides; ``eps`` not a finite number
            ``>= 0``.
    """
    x = check_tensor(_NAME, "x", x, ndim=2, dtypes=KV_DTYPES)
    weight = check_tensor(_NAME, "weight", weight, ndim=1, dtypes=(x.dtype,), contiguous=True)
    if weight.shape[0] != x.shape[1]:
        raise ValueError(f"{_NAME}: x has {x.shape[1]} columns but weight has {weight.shape[0]}")
    if x.shape[1] > 1 and x.stride(1) != 1:
        raise ValueError(f"{_NAME}: x must have unit stride on H, got strides {x.stride()}")
    eps = check_real(_NAME, "eps", eps, positive=False)
    device = check_same_device(_NAME, x=x, weight=weight)
    t, h = x.shape
    if t == 0 or h == 0 or not use_triton(_NAME, device):
        return naive.rms_norm(x, weight, eps)
    out = torch.empty((t, h), dtype=x.dtype, device=device)
    for_current_mode(_rms_norm_kernel)[(t,)](
        x, weight, out, x.stride(0), eps, H=h, BLOCK=next_power_of_2(h), num_warps=NUM_WARPS
    )
    return out
