"""The split-key paged decode kernel vs its torch reference and SDPA.

Without a GPU the Triton kernel runs under TRITON_INTERPRET=1 on tiny CPU tensors; with one it
runs compiled, and it also replays inside a CUDA graph with new lengths and pages.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    # NOTE: before cpkv.kernels (and triton) are imported, so @triton.jit builds interpreted
    # kernels; the launcher also re-checks at call time.
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import torch.nn.functional as F

from cpkv.kernels import _common, naive, paged_decode_attention
from cpkv.kernels.paged_decode import MAX_SPLITS, decode_splits

GPU = torch.cuda.is_available()
DEVICE = torch.device("cuda" if GPU else "cpu")

DTYPES = [
    pytest.param(torch.float32, id="fp32"),
    pytest.param(torch.float16, id="fp16"),
    pytest.param(torch.bfloat16, id="bf16"),
]
# fp16 / bf16 round P to the input dtype before the P @ V dot (the reference keeps fp32).
TOL = {torch.float32: 3e-5, torch.float16: 3e-3, torch.bfloat16: 2e-2}


def make(
    seq_lens: list[int], ps: int, hq: int, hkv: int, d: int, dtype: torch.dtype, seed: int = 0
):
    """A shard whose pages are handed out shuffled, one table row per sequence (padded with
    a page id that would be out of range, so a read past a row's end would fault or show)."""
    g = torch.Generator().manual_seed(seed)
    need = [-(-n // ps) for n in seq_lens]
    n_pages = sum(need) + 3
    k = torch.randn(n_pages, ps, hkv, d, generator=g).to(dtype)
    v = torch.randn(n_pages, ps, hkv, d, generator=g).to(dtype)
    order = (torch.randperm(n_pages - 1, generator=g) + 1).tolist()
    width = max(need) + 2
    table = torch.full((len(seq_lens), width), 10**6, dtype=torch.int32)
    for b, n in enumerate(need):
        table[b, :n] = torch.tensor([order.pop() for _ in range(n)], dtype=torch.int32)
    q = torch.randn(len(seq_lens), hq, d, generator=g).to(dtype)
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    return [t.to(DEVICE) for t in (q, k, v, table, lens)]


def sdpa(q, k, v, table, lens, scale) -> torch.Tensor:
    """torch SDPA (fp32) over each sequence's keys gathered contiguously."""
    ps, hkv, d = k.shape[1], k.shape[2], k.shape[3]
    out = []
    for b, n in enumerate(lens.tolist()):
        pos = torch.arange(n, device=q.device)
        slots = table[b].long()[pos // ps] * ps + pos % ps
        kb = k.reshape(-1, hkv, d)[slots].float().transpose(0, 1)  # [Hkv, n, D]
        vb = v.reshape(-1, hkv, d)[slots].float().transpose(0, 1)
        qb = q[b].float()[:, None, :]  # [Hq, 1, D]
        o = F.scaled_dot_product_attention(qb, kb, vb, scale=scale, enable_gqa=True)
        out.append(o[:, 0])
    return torch.stack(out)


def test_decode_kernel_runs_triton_not_the_fallback():
    assert _common.use_triton("paged_decode_attention", DEVICE)


SHAPES = [
    pytest.param([1], 16, 4, 4, 16, id="one-key"),
    pytest.param([16, 17, 31], 16, 6, 2, 12, id="page-edges-d12-gqa3"),
    pytest.param([200, 5, 64], 64, 8, 1, 32, id="page64-mqa"),
    pytest.param([37, 90], 8, 4, 2, 64, id="page8-tiles-span-pages"),
    pytest.param([130], 128, 2, 2, 80, id="page128-d80"),
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("splits", [1, 3, 8], ids=["1split", "3splits", "8splits"])
@pytest.mark.parametrize(("lens", "ps", "hq", "hkv", "d"), SHAPES)
def test_decode_matches_reference_and_sdpa(lens, ps, hq, hkv, d, splits, dtype):
    q, k, v, table, seq_lens = make(lens, ps, hq, hkv, d, dtype)
    scale = d**-0.5
    got = paged_decode_attention(q, k, v, table, seq_lens, scale, num_splits=splits)
    assert got.dtype == torch.float32 and got.shape == (len(lens), hq, d)
    ref = naive.paged_decode_attention(q, k, v, table, seq_lens, scale)
    torch.testing.assert_close(got, ref, atol=TOL[dtype], rtol=TOL[dtype])
    torch.testing.assert_close(got, sdpa(q, k, v, table, seq_lens, scale), atol=TOL[dtype],
                               rtol=TOL[dtype])  # fmt: skip


def test_more_splits_than_keys_leave_empty_splits_out():
    q, k, v, table, seq_lens = make([3, 70], 16, 4, 2, 16, torch.float32)
    got = paged_decode_attention(q, k, v, table, seq_lens, 0.25, num_splits=MAX_SPLITS)
    ref = naive.paged_decode_attention(q, k, v, table, seq_lens, 0.25)
    torch.testing.assert_close(got, ref, atol=3e-5, rtol=3e-5)


def test_splits_fill_the_device_and_stay_in_range():
    assert decode_splits(1, 8, 132) == MAX_SPLITS
    assert decode_splits(8, 8, 132) == 9
    assert decode_splits(64, 8, 132) == 2
    assert decode_splits(10**6, 8, 132) == 1
    assert decode_splits(0, 8, 1) >= 1


@pytest.mark.parametrize(
    ("change", "match"),
    [
        (lambda a: {**a, "q": a["q"][..., :-1]}, "does not fit the cache"),
        (lambda a: {**a, "seq_lens": a["seq_lens"][:1]}, "2 queries"),
        (lambda a: {**a, "block_table": a["block_table"].float()}, "block_table has dtype"),
        (lambda a: {**a, "block_table": a["block_table"].t().contiguous().t()}, "unit stride"),
        (lambda a: {**a, "k_cache": a["k_cache"].half()}, "k_cache has dtype"),
        (lambda a: {**a, "sm_scale": 0.0}, "sm_scale"),
        (lambda a: {**a, "num_splits": 0}, "num_splits"),
        # The kernel reads seq_lens at unit stride: a strided view would be read wrong.
        (lambda a: {**a, "seq_lens": a["seq_lens"].repeat_interleave(2)[::2]}, "contiguous"),
        (
            lambda a: {**a, "k_cache": a["k_cache"][:, :0], "v_cache": a["v_cache"][:, :0]},
            "page_size 0",
        ),
        (
            lambda a: {**a, "k_cache": a["k_cache"][:, :, :0], "v_cache": a["v_cache"][:, :, :0]},
            "does not fit the cache",
        ),
        (lambda a: {**a, "sm_scale": float("inf")}, "finite"),
        (lambda a: {**a, "sm_scale": "0.25"}, "finite"),
        (lambda a: {**a, "num_splits": 2.5}, "num_splits"),
        (lambda a: {**a, "sm_scale": True}, "got True"),
    ],
    ids=[
        "head-dim",
        "batch",
        "table-dtype",
        "table-stride",
        "cache-dtype",
        "scale",
        "splits",
        "lens-strided",
        "page-0",
        "kv-heads-0",
        "scale-inf",
        "scale-str",
        "splits-float",
        "scale-bool",
    ],
)
def test_decode_rejects_misuse_with_the_numbers(change, match):
    q, k, v, table, seq_lens = make([20, 40], 16, 4, 2, 16, torch.float32)
    args = {"q": q, "k_cache": k, "v_cache": v, "block_table": table, "seq_lens": seq_lens,
            "sm_scale": 0.25, "num_splits": None}  # fmt: skip
    args = change(args)
    with pytest.raises(ValueError, match=match):
        paged_decode_attention(
            args["q"], args["k_cache"], args["v_cache"], args["block_table"], args["seq_lens"],
            args["sm_scale"], num_splits=args["num_splits"],
        )  # fmt: skip


if GPU:

    @pytest.mark.gpu
    @pytest.mark.parametrize("dtype", DTYPES[1:])
    def test_decode_long_contexts_against_sdpa_backends(dtype):
        """4k-32k keys, the 1B shape's heads, against SDPA's flash and cuDNN backends on
        contiguous K/V (the backends SDPA picks on Hopper)."""
        from torch.nn.attention import SDPBackend, sdpa_kernel

        lens = [4096, 32768, 1000]
        q, k, v, table, seq_lens = make(lens, 64, 32, 8, 64, dtype, seed=3)
        got = paged_decode_attention(q, k, v, table, seq_lens, 0.125)
        for backend in (SDPBackend.FLASH_ATTENTION, SDPBackend.CUDNN_ATTENTION):
            for b, n in enumerate(lens):
                pos = torch.arange(n, device=DEVICE)
                slots = table[b].long()[pos // 64] * 64 + pos % 64
                kb = k.reshape(-1, 8, 64)[slots].transpose(0, 1)[None]
                vb = v.reshape(-1, 8, 64)[slots].transpose(0, 1)[None]
                kb, vb = kb.repeat_interleave(4, dim=1), vb.repeat_interleave(4, dim=1)
                with sdpa_kernel(backend):
                    want = F.scaled_dot_product_attention(q[b][None, :, None], kb, vb, scale=0.125)
                torch.testing.assert_close(got[b], want[0, :, 0].float(), atol=2e-2, rtol=2e-2)

    @pytest.mark.gpu
    def test_decode_replays_in_a_cuda_graph_with_new_lengths_and_pages():
        q, k, v, table, seq_lens = make([100, 3000], 64, 8, 2, 64, torch.bfloat16, seed=1)
        out = {}

        def launch():
            out["o"] = paged_decode_attention(q, k, v, table, seq_lens, 0.125, num_splits=16)

        s = torch.cuda.Stream()
        with torch.cuda.stream(s):
            launch()  # compile outside the capture
        torch.cuda.current_stream().wait_stream(s)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            launch()
        # Row 0 holds 2 pages and row 1 47 at first; swapped rows swap what fits.
        for swap, new_lens in ((False, [1, 64]), (False, [128, 2999]), (True, [3000, 65])):
            if swap:
                table.copy_(table.flip(0))
            seq_lens.copy_(torch.tensor(new_lens, dtype=torch.int32))
            graph.replay()
            torch.cuda.synchronize()
            ref = naive.paged_decode_attention(q, k, v, table, seq_lens, 0.125)
            torch.testing.assert_close(out["o"], ref, atol=2e-2, rtol=2e-2)
