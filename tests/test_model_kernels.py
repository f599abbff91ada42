"""The model's fused kernels (RMSNorm, RoPE with the q/k/v split) vs their torch references,
which are transformers' own formulas (tests/test_models.py holds those to transformers).

Without a GPU the Triton kernels run under TRITON_INTERPRET=1 on small CPU tensors.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest

from cpkv.kernels import _common, naive, rms_norm, rope_qkv

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
DTYPES = [
    pytest.param(torch.float32, id="fp32"),
    pytest.param(torch.float16, id="fp16"),
    pytest.param(torch.bfloat16, id="bf16"),
]
# Two units in the last place of the dtype: the norm's sum order (or the interpreter's rounding)
# may move the normalised value by one, and scaling it by the weight rounds once more.
ULP = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


def test_model_kernels_run_triton_not_the_fallback():
    assert _common.use_triton("rms_norm", DEVICE) and _common.use_triton("rope_qkv", DEVICE)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("t", "h"), [(1, 72), (5, 128), (3, 100)], ids=["one-row", "pow2", "odd"])
def test_rms_norm_matches_transformers_formula(t, h, dtype):
    g = torch.Generator().manual_seed(t * h)
    x = (torch.randn(t, h, generator=g) * 3).to(dtype).to(DEVICE)
    w = (1 + torch.randn(h, generator=g) / 4).to(dtype).to(DEVICE)
    got = rms_norm(x, w, 1e-5)
    assert got.dtype == dtype and got.shape == (t, h) and got.is_contiguous()
    want = naive.rms_norm(x, w, 1e-5)
    torch.testing.assert_close(got.float(), want.float(), atol=ULP[dtype], rtol=ULP[dtype])


def test_rms_norm_reads_strided_rows():
    x = torch.randn(4, 48).to(DEVICE)[:, :24]
    w = torch.ones(24, device=DEVICE)
    torch.testing.assert_close(rms_norm(x, w, 1e-6), naive.rms_norm(x, w, 1e-6))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    ("t", "hq", "hkv", "d"), [(1, 4, 4, 16), (3, 6, 2, 12), (2, 8, 1, 64)],
    ids=["mha", "gqa3-d12", "mqa-d64"],
)  # fmt: skip
def test_rope_qkv_matches_transformers_formula(t, hq, hkv, d, dtype):
    g = torch.Generator().manual_seed(t + hq + d)
    qkv = torch.randn(t, (hq + 2 * hkv) * d, generator=g).to(dtype).to(DEVICE)
    ang = torch.rand(t, d // 2, generator=g) * 100
    emb = torch.cat((ang, ang), dim=-1)
    cos, sin = emb.cos().to(dtype).to(DEVICE), emb.sin().to(dtype).to(DEVICE)
    got = rope_qkv(qkv, cos, sin, hq, hkv)
    want = naive.rope_qkv(qkv, cos, sin, hq, hkv)
    for a, b in zip(got, want, strict=True):
        assert a.shape == b.shape and a.is_contiguous() and a.dtype == dtype
        torch.testing.assert_close(a.float(), b.float(), atol=ULP[dtype], rtol=ULP[dtype])
    torch.testing.assert_close(got[2], want[2], atol=0, rtol=0)  # v is a copy


@pytest.mark.parametrize(
    ("call", "match"),
    [
        (lambda: rms_norm(torch.ones(2, 4), torch.ones(3), 1e-5), "4 columns"),
        (lambda: rms_norm(torch.ones(2, 4), torch.ones(4).half(), 1e-5), "weight has dtype"),
        (lambda: rope_qkv(torch.ones(2, 30), torch.ones(2, 5), torch.ones(2, 5), 4, 1), "even"),
        (lambda: rope_qkv(torch.ones(2, 24), torch.ones(3, 4), torch.ones(3, 4), 4, 1), "cos"),
        (lambda: rms_norm(torch.ones(2, 4), torch.ones(4), float("nan")), "eps must be a finite"),
        (lambda: rms_norm(torch.ones(2, 4), torch.ones(4), -1.0), r"eps must .* >= 0, got -1.0"),
        (lambda: rms_norm(torch.ones(2, 4), torch.ones(4), "1e-6"), "eps must be a finite"),
        (lambda: rms_norm(torch.ones(2, 4), torch.ones(4), True), "got True"),
    ],
    ids=[
        "norm-width",
        "norm-dtype",
        "rope-odd-dim",
        "rope-rows",
        "norm-eps-nan",
        "norm-eps-negative",
        "norm-eps-str",
        "norm-eps-bool",
    ],
)
def test_model_kernels_reject_misuse(call, match):
    with pytest.raises(ValueError, match=match):
        call()
