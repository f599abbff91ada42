"""Paged partial attention and LSE merge kernels vs their torch references and SDPA.

Without a GPU the Triton kernels run under TRITON_INTERPRET=1 on tiny CPU tensors; with one
they run compiled on CUDA tensors, and larger cases join the parametrisations.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    # NOTE: before cpkv.kernels (and triton) are imported, so @triton.jit builds interpreted
    # kernels; the launchers also re-check at call time.
    os.environ.setdefault("TRITON_INTERPRET", "1")

import importlib
import logging
import math
from collections.abc import Callable
from dataclasses import dataclass, field, fields

import pytest
import torch.nn.functional as F

import cpkv.kernels as K
from cpkv.kernels import _common, naive

attn_mod = importlib.import_module("cpkv.kernels.paged_attention")
tma_mod = importlib.import_module("cpkv.kernels.paged_attention_tma")
merge_mod = importlib.import_module("cpkv.kernels.merge_attn_states")

GPU = torch.cuda.is_available()
DEVICE = torch.device("cuda" if GPU else "cpu")
NAN = float("nan")
NEG_INF = float("-inf")

DTYPES = [
    pytest.param(torch.float32, id="fp32"),
    pytest.param(torch.float16, id="fp16"),
    pytest.param(torch.bfloat16, id="bf16"),
]
# (out atol, out rtol, lse atol): fp32 runs IEEE dots; fp16 / bf16 round P to the input dtype
# before the P @ V dot (the reference keeps it in fp32), so out carries that rounding.
TOL = {
    torch.float32: (2e-5, 1e-4, 2e-5),
    torch.float16: (2e-3, 2e-3, 1e-4),
    torch.bfloat16: (1.6e-2, 1.6e-2, 1e-4),
}


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def dev(t: torch.Tensor) -> torch.Tensor:
    return t.to(DEVICE)


# ---------------------------------------------------------------------------------------------
# Layouts: sequences of queries with positions, and pages with (first position, valid length)
# ---------------------------------------------------------------------------------------------


@dataclass
class Seq:
    """One sequence on one lane: its queries' positions and its pages (first position, length)."""

    q_pos: list[int]
    pages: list[tuple[int, int]] = field(default_factory=list)


def in_order(start: int, stop: int, ps: int) -> list[tuple[int, int]]:
    """Pages holding positions [start, stop) in order, the last one partial."""
    return [(p, min(ps, stop - p)) for p in range(start, stop, ps)]


def shuffled(items: list, seed: int) -> list:
    order = torch.randperm(len(items), generator=gen(seed)).tolist()
    return [items[i] for i in order]


def zigzag(total: int, cp: int, lane: int, ps: int) -> list[tuple[int, int]]:
    """The lane's pages under zigzag CP: segments ``lane`` and ``2 * cp - 1 - lane`` of
    ``2 * cp``, each split into pages (segment ends may leave partial pages mid-list)."""
    seg = -(-total // (2 * cp))
    pages = []
    for s in (lane, 2 * cp - 1 - lane):
        pages += in_order(s * seg, min(total, (s + 1) * seg), ps)
    return pages


# Each case: page size -> list of sequences.
LAYOUTS: dict[str, Callable[[int], list[Seq]]] = {
    "one-seq-in-order": lambda ps: [Seq(list(range(70)), in_order(0, 70, ps))],
    "ragged-3-seqs": lambda ps: [
        Seq(list(range(3)), in_order(0, 3, ps)),
        Seq(list(range(29)), in_order(0, 29, ps)),
        Seq(list(range(75)), in_order(0, 75, ps)),
    ],
    "pages-out-of-order": lambda ps: [Seq(list(range(80)), shuffled(in_order(0, 80, ps), 1))],
    "zigzag-cp2-lane0": lambda ps: [Seq(list(range(100)), zigzag(100, 2, 0, ps))],
    "zigzag-cp2-lane1-shuffled": lambda ps: [
        Seq(list(range(90)), shuffled(zigzag(90, 2, 1, ps), 2))
    ],
    "prefix-gaps": lambda ps: [  # extend queries over every other cached page
        Seq(list(range(5 * ps // 2, 5 * ps // 2 + 30)), in_order(0, 5 * ps, ps)[::2])
    ],
    "partial-pages-mid": lambda ps: [
        Seq(
            list(range(2 * ps + 20)), [(0, ps), (ps, 3), (ps + 3, 0), (ps + 3, ps), (2 * ps + 3, 5)]
        )
    ],
    "no-visible-key": lambda ps: [Seq(list(range(10)), in_order(20, 40, ps))],
    "empty-seqs": lambda ps: [
        Seq(list(range(12)), []),  # queries, no pages: lse -inf
        Seq([], in_order(0, 20, ps)),  # pages, no queries
        Seq(list(range(21)), in_order(0, 21, ps)),
        Seq([], []),
    ],
    "queries-shuffled-dup": lambda ps: [
        Seq(shuffled([*range(40), 7, 7, 33, 0], 3), shuffled(in_order(0, 40, ps), 4))
    ],
}


@dataclass
class Inputs:
    q: torch.Tensor
    q_pos: torch.Tensor
    cu_q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    page_table: torch.Tensor
    page_pos: torch.Tensor
    page_len: torch.Tensor
    cu_pages: torch.Tensor

    def args(self) -> tuple[torch.Tensor | K.PagedKVTable, ...]:
        """The launcher's positional arguments before ``sm_scale``."""
        pages = K.PagedKVTable(self.page_table, self.page_pos, self.page_len, self.cu_pages)
        return (self.q, self.q_pos, self.cu_q, self.k, self.v, pages)

    def to(self, device: torch.device) -> Inputs:
        return Inputs(*(getattr(self, f.name).to(device) for f in fields(self)))


def build(
    seqs: list[Seq],
    ps: int,
    hq: int,
    hkv: int,
    d: int,
    dtype: torch.dtype,
    seed: int,
    spare_pages: int = 3,
) -> Inputs:
    """A shard whose used pages sit at random local ids and whose unused slots hold NaN (a
    kernel that reads past a page's length, or an unused page, shows it)."""
    g = gen(seed)
    n_pages = sum(len(s.pages) for s in seqs)
    local = torch.randperm(n_pages + spare_pages, generator=g)[:n_pages]
    k = torch.full((n_pages + spare_pages, ps, hkv, d), NAN)
    v = torch.full_like(k, NAN)
    pages = [p for s in seqs for p in s.pages]
    for i, (_, ln) in enumerate(pages):
        k[local[i], :ln] = torch.randn(ln, hkv, d, generator=g)
        v[local[i], :ln] = torch.randn(ln, hkv, d, generator=g)
    q_pos = [p for s in seqs for p in s.q_pos]
    q = torch.randn(len(q_pos), hq, d, generator=g)
    cu = [0]
    cu_p = [0]
    for s in seqs:
        cu.append(cu[-1] + len(s.q_pos))
        cu_p.append(cu_p[-1] + len(s.pages))
    return Inputs(
        q.to(dtype),
        torch.tensor(q_pos, dtype=torch.int64),
        torch.tensor(cu, dtype=torch.int32),
        k.to(dtype),
        v.to(dtype),
        local.to(torch.int32),
        torch.tensor([p for p, _ in pages], dtype=torch.int64),
        torch.tensor([ln for _, ln in pages], dtype=torch.int32),
        torch.tensor(cu_p, dtype=torch.int64),
    )


def attention_loop(x: Inputs, sm_scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The plain per-query definition in fp64, independent of naive.py."""
    tq, hq, d = x.q.shape
    group = hq // x.k.shape[2]
    out = torch.zeros(tq, hq, d, dtype=torch.float64)
    lse = torch.full((tq, hq), NEG_INF, dtype=torch.float64)
    cu, cu_p = x.cu_q.tolist(), x.cu_pages.tolist()
    for b in range(len(cu) - 1):
        keys = [
            (int(x.page_table[i]), j)
            for i in range(cu_p[b], cu_p[b + 1])
            for j in range(int(x.page_len[i]))
        ]
        kpos = [
            int(x.page_pos[i]) + j
            for i in range(cu_p[b], cu_p[b + 1])
            for j in range(int(x.page_len[i]))
        ]
        for t in range(cu[b], cu[b + 1]):
            seen = [key for key, p in zip(keys, kpos, strict=True) if p <= int(x.q_pos[t])]
            if not seen:
                continue
            kk = torch.stack([x.k[pg, s] for pg, s in seen]).double()  # [n, Hkv, D]
            vv = torch.stack([x.v[pg, s] for pg, s in seen]).double()
            for h in range(hq):
                scores = kk[:, h // group] @ x.q[t, h].double() * sm_scale
                lse[t, h] = torch.logsumexp(scores, 0)
                out[t, h] = torch.softmax(scores, 0) @ vv[:, h // group]
    return out, lse


def assert_attention_close(got, expected, dtype: torch.dtype) -> None:
    out, lse = (t.cpu() for t in got)
    exp_out, exp_lse = (t.float() for t in expected)
    assert out.dtype == lse.dtype == torch.float32
    assert out.shape == exp_out.shape and lse.shape == exp_lse.shape
    atol, rtol, lse_atol = TOL[dtype]
    none = torch.isneginf(exp_lse)
    assert torch.equal(torch.isneginf(lse), none), "queries that see no key differ"
    assert bool((out[none] == 0).all()), "out must be 0 where a query sees no key"
    torch.testing.assert_close(lse[~none], exp_lse[~none], atol=lse_atol, rtol=1e-5)
    torch.testing.assert_close(out, exp_out, atol=atol, rtol=rtol)


def run_kernel(x: Inputs, sm_scale: float, **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
    return K.paged_partial_attention(*x.to(DEVICE).args(), sm_scale, **kwargs)


def test_kernel_tests_run_triton_not_the_fallback():
    # Otherwise every "kernel vs reference" test below would compare the reference with itself.
    assert _common.fallback_reason(DEVICE) is None


# ---------------------------------------------------------------------------------------------
# paged_partial_attention
# ---------------------------------------------------------------------------------------------


def small_tiles(block_m: int, block_n: int, heads_per_program: int) -> dict:
    """Every config replaced by small tiles: more blocks per sequence, more tiles per page."""
    cfg = attn_mod.AttnConfig(block_m, block_n, heads_per_program, num_warps=4, num_stages=2)
    return {key: cfg for key in attn_mod.CONFIGS}


# Each dtype with its own tiling, so the layouts meet large and small tiles at one cost: small
# blocks start past position 0 and see whole pages unmasked; 16-key tiles split 64-slot pages.
DTYPE_TILINGS = [
    pytest.param(torch.float32, None, id="fp32-default-tiles"),
    pytest.param(torch.float16, (16, 16, 1), id="fp16-m16-n16"),
    pytest.param(torch.bfloat16, (32, 32, 2), id="bf16-m32-n32-2heads"),
]


@pytest.mark.parametrize(("dtype", "tiling"), DTYPE_TILINGS)
@pytest.mark.parametrize("ps", [16, 64], ids=["page16", "page64"])
@pytest.mark.parametrize("layout", list(LAYOUTS), ids=list(LAYOUTS))
def test_paged_attention_matches_reference(monkeypatch, layout, ps, dtype, tiling):
    if tiling is not None:
        monkeypatch.setattr(attn_mod, "CONFIGS", small_tiles(*tiling))
    x = build(LAYOUTS[layout](ps), ps, hq=4, hkv=2, d=32, dtype=dtype, seed=ps)
    scale = 32**-0.5
    ref = naive.paged_partial_attention(*x.args(), scale)
    if dtype == torch.float32:  # the reference itself, once per layout and page size
        assert_attention_close(ref, attention_loop(x, scale), torch.float32)
    assert_attention_close(run_kernel(x, scale), ref, dtype)


GQA_SHAPES = [  # (hq, hkv, d)
    pytest.param(2, 2, 64, id="gqa1-d64"),
    pytest.param(4, 2, 64, id="gqa2-d64"),
    pytest.param(8, 2, 128, id="gqa4-d128"),
    pytest.param(4, 1, 128, id="gqa4-d128-1kv"),
    pytest.param(3, 1, 24, id="gqa3-d24"),
]
# (The default tiles meet these shapes in the GPU-only large cases.)
TILINGS = {
    "m16-n16-per-head": (16, 16, 1),  # page 64: 4 tiles per page
    "m16-n32-group": (16, 32, 8),  # page 16: 2 pages per tile; a KV group's heads share tiles
}


@pytest.mark.parametrize("tiling", list(TILINGS), ids=list(TILINGS))
@pytest.mark.parametrize(("hq", "hkv", "d"), GQA_SHAPES)
@pytest.mark.parametrize("ps", [16, 64], ids=["page16", "page64"])
def test_paged_attention_gqa_head_dims_and_tilings(monkeypatch, ps, hq, hkv, d, tiling):
    monkeypatch.setattr(attn_mod, "CONFIGS", small_tiles(*TILINGS[tiling]))
    seqs = [
        # Every 4th position: late blocks see two full pages unmasked, then a partial one.
        Seq(list(range(0, 3 * ps, 4)), in_order(0, 3 * ps - 5, ps)),
        Seq([], []),
        Seq(list(range(ps - 5, ps + 15)), shuffled(in_order(0, 2 * ps + 3, ps), 5)),
    ]
    x = build(seqs, ps, hq, hkv, d, torch.bfloat16, seed=hq * d)
    scale = d**-0.5
    assert_attention_close(
        run_kernel(x, scale), naive.paged_partial_attention(*x.args(), scale), torch.bfloat16
    )


@pytest.mark.parametrize("hint", [0, 7], ids=["exact-max-q-len", "loose-max-q-len"])
def test_paged_attention_with_max_q_len_hint(hint):
    seqs = LAYOUTS["ragged-3-seqs"](16) + LAYOUTS["empty-seqs"](16)
    x = build(seqs, 16, 4, 2, 16, torch.float16, seed=21)
    scale = 0.3
    max_q = max(len(s.q_pos) for s in seqs) + hint
    assert_attention_close(
        run_kernel(x, scale, max_q_len=max_q),
        naive.paged_partial_attention(*x.args(), scale),
        torch.float16,
    )


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_paged_attention_writes_out_in_the_asked_dtype(dtype):
    # One lane's whole attention: out in the model dtype, the fp32 result rounded once (to
    # nearest on a GPU; Triton's interpreter truncates), so within one ulp of it.
    x = build(LAYOUTS["ragged-3-seqs"](16), 16, 4, 2, 16, dtype, seed=5)
    out32, lse32 = run_kernel(x, 0.25)
    out, lse = run_kernel(x, 0.25, out_dtype=dtype)
    assert out.dtype == dtype and lse.dtype == torch.float32
    ulp = torch.finfo(dtype).eps
    torch.testing.assert_close(out.cpu().float(), out32.cpu(), rtol=ulp, atol=1e-30)
    assert torch.equal(lse.cpu(), lse32.cpu())


def test_paged_attention_rejects_an_integer_out_dtype():
    x = build(LAYOUTS["ragged-3-seqs"](16), 16, 4, 2, 16, torch.float16, seed=5)
    with pytest.raises(ValueError, match="out_dtype"):
        run_kernel(x, 0.25, out_dtype=torch.int32)


def test_paged_attention_block_shrinks_to_short_sequences():
    # Short sequences (decode-like chunks): the launcher cuts query rows to what they fill.
    cfg = attn_mod.config_for(torch.bfloat16, 128, group=4, max_q_len=3)
    assert cfg.block_m == attn_mod.MIN_DOT
    assert attn_mod.config_for(torch.bfloat16, 128, group=4, max_q_len=None).block_m >= 64
    x = build(
        [Seq([9, 10, 11], in_order(0, 12, 16)), Seq([40], in_order(0, 41, 16))],
        16,
        4,
        2,
        32,
        torch.float32,
        seed=22,
    )
    assert_attention_close(
        run_kernel(x, 0.2, max_q_len=3),
        naive.paged_partial_attention(*x.args(), 0.2),
        torch.float32,
    )


def test_paged_attention_strided_queries():
    # q as the first heads of a fused [T, q + k + v heads, D] projection: token stride > Hq * D.
    seqs = LAYOUTS["zigzag-cp2-lane0"](16)
    x = build(seqs, 16, 4, 2, 32, torch.float16, seed=23)
    fused = torch.cat([x.q, torch.zeros(x.q.shape[0], 4, 32, dtype=x.q.dtype)], dim=1)
    args = list(x.to(DEVICE).args())
    args[0] = dev(fused)[:, :4]
    got = K.paged_partial_attention(*args, 0.2)
    assert_attention_close(got, naive.paged_partial_attention(*x.args(), 0.2), torch.float16)


# ---------------------------------------------------------------------------------------------
# The TMA (Hopper) path: driven under the interpreter with MODE "always"
# ---------------------------------------------------------------------------------------------


def tma_tiles(
    block_m: int,
    block_n: int,
    heads: int,
    heads_first: bool = False,
    pairs: bool = False,
    exp_fma: bool = False,
) -> dict:
    """Every TMA config replaced by small tiles (the interpreter's cost grows with them)."""
    cfg = tma_mod.TmaConfig(
        block_m, block_n, heads, 4, 2, heads_first=heads_first, pair_tiles=pairs, exp_fma=exp_fma
    )
    return {d: cfg for d in tma_mod.CONFIGS}


TMA_TILINGS = {
    # Page 32 cuts the 64-key tiles to 32, paired into 64-key steps (across pages too);
    # page 64 keeps them whole, unpaired; grid (heads, blocks)
    "m16-n64-pairs-heads-first": (16, 64, 1, True, True),
    "m32-n64-2heads": (32, 64, 2),  # page 32: the tile cut to the page; 2 GQA heads a program
}


# Each tiling with its own dtype (as DTYPE_TILINGS): every layout meets both at half the cost.
TMA_DTYPE_TILINGS = [
    pytest.param(torch.float16, "m16-n64-pairs-heads-first", id="fp16-m16-n64-pairs-heads-first"),
    pytest.param(torch.bfloat16, "m32-n64-2heads", id="bf16-m32-n64-2heads"),
]


@pytest.mark.parametrize(("dtype", "tiling"), TMA_DTYPE_TILINGS)
@pytest.mark.parametrize("ps", [32, 64], ids=["page32", "page64"])
@pytest.mark.parametrize("layout", list(LAYOUTS), ids=list(LAYOUTS))
def test_tma_path_matches_reference(monkeypatch, layout, ps, dtype, tiling):
    monkeypatch.setattr(tma_mod, "MODE", "always")
    monkeypatch.setattr(tma_mod, "CONFIGS", tma_tiles(*TMA_TILINGS[tiling]))
    paired = tma_mod.config_for(32, ps, group=2, max_q_len=64).pair_tiles
    assert paired == (tiling.startswith("m16-n64-pairs") and ps == 32)
    x = build(LAYOUTS[layout](ps), ps, hq=4, hkv=2, d=32, dtype=dtype, seed=ps + 1)
    assert tma_mod.tma_supported(dev(x.q), dev(x.k))
    scale = 32**-0.5
    assert_attention_close(
        run_kernel(x, scale), naive.paged_partial_attention(*x.args(), scale), dtype
    )


# The layouts whose query blocks see two full pages or more (paired steps): checked by a
# mutant of _exp2_fma that each of them fails.
@pytest.mark.parametrize("layout", ["one-seq-in-order", "ragged-3-seqs", "prefix-gaps"])
def test_tma_pairs_with_exp2_on_the_fma_pipes_match_reference(monkeypatch, layout):
    monkeypatch.setattr(tma_mod, "MODE", "always")
    monkeypatch.setattr(tma_mod, "CONFIGS", tma_tiles(16, 64, 1, pairs=True, exp_fma=True))
    ps = 32  # the 64-key tile cut to the page: paired, and the pairs' second exp2 emulated
    assert tma_mod.config_for(32, ps, group=2, max_q_len=64).exp_fma
    x = build(LAYOUTS[layout](ps), ps, hq=4, hkv=2, d=32, dtype=torch.bfloat16, seed=ps + 3)
    scale = 32**-0.5
    assert_attention_close(
        run_kernel(x, scale), naive.paged_partial_attention(*x.args(), scale), torch.bfloat16
    )


def test_exp2_on_the_fma_pipes_is_within_the_cubics_error():
    """2^x for x <= 0 (scores less the row maximum): relative error under 7.5e-5 down to
    2^-125, and below that a normal float no larger than 2^-124 (0 beside the maximum)."""
    from cpkv.kernels._common import for_current_mode, tl, triton

    @triton.jit
    def exp2_kernel(x_ptr, y_ptr, N: tl.constexpr):
        i = tl.arange(0, N)
        tl.store(y_ptr + i, tma_mod._exp2_fma(tl.load(x_ptr + i)))

    edges = torch.tensor([0.0, -0.5, -0.49999997, -0.50000006, -1.5, -2.5, -124.6, -125.0])
    x = torch.cat([edges, -torch.rand(1000) * 130.0, -torch.rand(1000) * 2.0])
    x = torch.cat([x, torch.zeros(2048 - x.numel())])
    y = dev(torch.empty_like(x))
    for_current_mode(exp2_kernel)[(1,)](dev(x), y, N=x.numel())
    y, want = y.cpu().double(), torch.exp2(x.double())
    normal = x >= -125.0
    rel = ((y - want).abs() / want)[normal]
    assert rel.max() < 7.5e-5, (rel.max(), x[normal][rel.argmax()])
    assert (y[~normal] > 0).all() and (y[~normal] <= 2.0**-124).all()


@pytest.mark.parametrize(("hq", "hkv", "d"), [s for s in GQA_SHAPES if s.id != "gqa3-d24"])
def test_tma_path_gqa_and_head_dims(monkeypatch, hq, hkv, d):
    monkeypatch.setattr(tma_mod, "MODE", "always")
    monkeypatch.setattr(tma_mod, "CONFIGS", tma_tiles(32, 32, 4))
    ps = 32
    seqs = [
        Seq(list(range(0, 3 * ps, 4)), in_order(0, 3 * ps - 5, ps)),
        Seq(list(range(ps - 5, ps + 15)), shuffled(in_order(0, 2 * ps + 3, ps), 5)),
    ]
    x = build(seqs, ps, hq, hkv, d, torch.bfloat16, seed=hq * d + 1)
    scale = d**-0.5
    assert_attention_close(
        run_kernel(x, scale), naive.paged_partial_attention(*x.args(), scale), torch.bfloat16
    )


def test_tma_path_only_where_a_descriptor_fits(monkeypatch):
    monkeypatch.setattr(tma_mod, "MODE", "always")
    q = torch.zeros(4, 4, 64, dtype=torch.bfloat16)
    k = torch.zeros(3, 64, 2, 64, dtype=torch.bfloat16)
    assert tma_mod.tma_supported(q, k)
    assert not tma_mod.tma_supported(q.float(), k.float())  # 16-bit tiles only
    assert not tma_mod.tma_supported(q[..., :24], torch.zeros(3, 64, 2, 24))  # D not a box side
    assert not tma_mod.tma_supported(q, torch.zeros(3, 16, 2, 64, dtype=torch.bfloat16))  # page 16
    assert not tma_mod.tma_supported(q, torch.zeros(3, 48, 2, 64, dtype=torch.bfloat16))
    # A descriptor needs 16-byte aligned bases and at least one page, V's too.
    flat = torch.zeros(3 * 64 * 2 * 64 + 1, dtype=torch.bfloat16)
    assert not tma_mod.tma_supported(q, k, flat[1:].view(3, 64, 2, 64))
    assert not tma_mod.tma_supported(q, torch.zeros(0, 64, 2, 64, dtype=torch.bfloat16))
    monkeypatch.setattr(tma_mod, "MODE", "auto")
    # Under the interpreter (or on a GPU other than sm_90) "auto" keeps the pointer kernel.
    if not GPU or torch.cuda.get_device_capability()[0] != 9:
        assert not tma_mod.tma_supported(dev(q), dev(k))
    monkeypatch.setattr(tma_mod, "MODE", "never")
    assert not tma_mod.tma_supported(dev(q), dev(k))
    cfg = tma_mod.config_for(128, page_size=16, group=4, max_q_len=3)
    assert cfg.block_n <= 16 and cfg.block_m == 16
    # D=64 pairs tiles where the page cut them (page 64: 128-key steps), not past its step.
    assert tma_mod.config_for(64, page_size=64, group=4, max_q_len=4096).pair_tiles
    assert not tma_mod.config_for(64, page_size=128, group=4, max_q_len=4096).pair_tiles
    assert not tma_mod.config_for(128, page_size=64, group=4, max_q_len=4096).pair_tiles
    with pytest.raises(ValueError, match="power of two"):
        tma_mod.TmaConfig(96, 64, 1, 8, 3)


if GPU:
    LARGE = [
        pytest.param(3000, 64, 32, 8, 128, id="T3000-page64-32x8x128"),
        pytest.param(2500, 16, 8, 8, 64, id="T2500-page16-8x8x64"),
        pytest.param(2100, 128, 16, 2, 64, id="T2100-page128-16x2x64"),
        pytest.param(1700, 32, 8, 2, 256, id="T1700-page32-8x2x256"),
    ]

    @pytest.mark.gpu
    @pytest.mark.parametrize("path", ["auto", "never"], ids=["tma-on-hopper", "pointer"])
    @pytest.mark.parametrize("dtype", DTYPES)
    @pytest.mark.parametrize(("t", "ps", "hq", "hkv", "d"), LARGE)
    def test_paged_attention_large_on_gpu(monkeypatch, t, ps, hq, hkv, d, dtype, path):
        monkeypatch.setattr(tma_mod, "MODE", path)
        seqs = [
            Seq(list(range(t)), zigzag(t, 2, 0, ps)),
            Seq(list(range(t // 3)), shuffled(in_order(0, t // 3, ps), 6)),
            Seq(list(range(700, 1400)), in_order(0, 1400, ps)[1::2]),
        ]
        x = build(seqs, ps, hq, hkv, d, dtype, seed=t)
        scale = d**-0.5
        # The reference on the GPU too (it is vectorised torch): fp32 throughout.
        ref = naive.paged_partial_attention(*x.to(DEVICE).args(), scale)
        assert_attention_close(run_kernel(x, scale), tuple(r.cpu() for r in ref), dtype)


# ---------------------------------------------------------------------------------------------
# merge_attn_states, and lanes' partials merged == causal attention over all keys
# ---------------------------------------------------------------------------------------------


def merge_loop(outs: torch.Tensor, lses: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """fp64 per-row definition: softmax weights over the parts that saw a key."""
    n, t, h, d = outs.shape
    out = torch.zeros(t, h, d, dtype=torch.float64)
    lse = torch.full((t, h), NEG_INF, dtype=torch.float64)
    for i in range(t):
        for j in range(h):
            keep = [p for p in range(n) if lses[p, i, j] != NEG_INF]
            if keep:
                ls = lses[keep, i, j].double()
                lse[i, j] = torch.logsumexp(ls, 0)
                out[i, j] = (torch.softmax(ls, 0)[:, None] * outs[keep, i, j].double()).sum(0)
    return out, lse


MERGE_SHAPES = [  # (parts, tokens, heads, dim)
    pytest.param(2, 7, 3, 24, id="L2-T7-H3-D24"),
    pytest.param(4, 5, 4, 128, id="L4-T5-H4-D128"),
    pytest.param(1, 3, 2, 64, id="L1"),
    pytest.param(3, 40, 2, 16, id="L3-T40-H2-D16"),
]
if GPU:
    MERGE_SHAPES.append(pytest.param(4, 3000, 32, 128, id="L4-T3000-H32-D128"))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("n", "t", "h", "d"), MERGE_SHAPES)
def test_merge_matches_reference(n, t, h, d, dtype):
    g = gen(n * t)
    outs = torch.randn(n, t, h, d, generator=g).to(dtype)
    lses = torch.randn(n, t, h, generator=g) * 4
    lses[torch.rand(n, t, h, generator=g) < 0.3] = NEG_INF  # parts that saw nothing
    lses[:, 0, 0] = NEG_INF  # a row no part saw
    outs[lses == NEG_INF] = NAN  # ignored, whatever it holds
    expected = merge_loop(outs, lses)
    ref = naive.merge_attn_states(outs, lses)
    assert_attention_close(ref, expected, torch.float32)
    got = K.merge_attn_states(dev(outs), dev(lses))
    assert_attention_close(got, expected, torch.float32)


def test_merge_all_neg_inf_and_strided_parts():
    outs = torch.randn(5, 3, 2, 3, 16)[:, 1]  # [L, T, H, D] not contiguous on L
    lses = torch.full((2, 3, 5), NEG_INF).permute(2, 0, 1)  # [L, T, H] strided
    out, lse = K.merge_attn_states(dev(outs), dev(lses))
    assert bool((out == 0).all()) and bool(torch.isneginf(lse).all())
    lses = torch.randn(5, 3, 2, 3)[:, 1]
    got = K.merge_attn_states(dev(outs), dev(lses))
    assert_attention_close(got, merge_loop(outs, lses), torch.float32)


@pytest.mark.skipif(GPU, reason="a lazily mapped host buffer; on a GPU it would be 8 GiB")
def test_merge_offsets_past_int32():
    """Parts 2**30 elements apart: part 2 starts past 2**31 elements, where an int32 offset
    wraps to memory before ``outs`` (a [cp, T, H, D] stack at cp=4, T=180k, 32 x 128 heads)."""
    stride, d, base = 2**30, 8, 2**31
    buf = torch.empty(base + 2 * stride + d, dtype=torch.float16)  # untouched pages stay unmapped
    buf[:d] = 1000.0  # what a wrapped offset would read
    outs = buf.as_strided((3, 1, 1, d), (stride, d, d, 1), base)
    for p in range(3):
        outs[p].fill_(p + 1.0)
    out, lse = K.merge_attn_states(outs, torch.zeros(3, 1, 1))
    torch.testing.assert_close(out, torch.full((1, 1, d), 2.0))  # equal weights: the mean
    torch.testing.assert_close(lse, torch.full((1, 1), math.log(3.0)))


def test_merge_empty():
    out, lse = K.merge_attn_states(dev(torch.zeros(0, 3, 2, 8)), dev(torch.zeros(0, 3, 2)))
    assert out.shape == (3, 2, 8) and bool((out == 0).all()) and bool(torch.isneginf(lse).all())
    out, lse = K.merge_attn_states(dev(torch.zeros(2, 0, 2, 8)), dev(torch.zeros(2, 0, 2)))
    assert out.shape == (0, 2, 8) and lse.shape == (0, 2)


def split_over_lanes(
    total: int, ps: int, lanes: int, how: str, hkv: int, d: int, dtype, seed: int
) -> tuple[torch.Tensor, torch.Tensor, list[Inputs]]:
    """One sequence of ``total`` keys split page by page over ``lanes`` shards; every lane gets
    all the queries (positions 0..total-1) and its own page ids.

    Returns:
        (global K [total, Hkv, D], global V, the lanes' inputs without q).
    """
    g = gen(seed)
    k_all = torch.randn(total, hkv, d, generator=g).to(dtype)
    v_all = torch.randn(total, hkv, d, generator=g).to(dtype)
    pages = in_order(0, total, ps)
    if how == "round-robin":
        owner = [i % lanes for i in range(len(pages))]
    elif how == "zigzag":
        seg = -(-len(pages) // (2 * lanes))
        owner = [min(i // seg, 2 * lanes - 1) for i in range(len(pages))]
        owner = [o if o < lanes else 2 * lanes - 1 - o for o in owner]
    else:
        owner = torch.randint(0, lanes, (len(pages),), generator=g).tolist()
    lane_inputs = []
    for lane in range(lanes):
        mine = shuffled([p for p, o in zip(pages, owner, strict=True) if o == lane], seed + lane)
        n = len(mine)
        local = torch.randperm(n + 2, generator=g)[:n]
        k = torch.full((n + 2, ps, hkv, d), NAN, dtype=dtype)
        v = torch.full_like(k, NAN)
        for i, (pos, ln) in enumerate(mine):
            k[local[i], :ln] = k_all[pos : pos + ln]
            v[local[i], :ln] = v_all[pos : pos + ln]
        lane_inputs.append(
            Inputs(
                torch.empty(0),
                torch.arange(total),
                torch.tensor([0, total], dtype=torch.int32),
                k,
                v,
                local.to(torch.int32),
                torch.tensor([p for p, _ in mine], dtype=torch.int64),
                torch.tensor([ln for _, ln in mine], dtype=torch.int32),
                torch.tensor([0, n], dtype=torch.int32),
            )
        )
    return k_all, v_all, lane_inputs


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    ("lanes", "how"),
    [(2, "zigzag"), (3, "round-robin"), (4, "random"), (4, "zigzag")],
    ids=["cp2-zigzag", "cp3-round-robin", "cp4-random", "cp4-zigzag"],
)
def test_lane_partials_merge_to_causal_sdpa(lanes, how, dtype):
    total, ps, hq, hkv, d = 90, 16, 4, 2, 32
    k_all, v_all, lane_inputs = split_over_lanes(total, ps, lanes, how, hkv, d, dtype, seed=31)
    q = torch.randn(total, hq, d, generator=gen(32)).to(dtype)
    scale = d**-0.5
    outs, lses = [], []
    for x in lane_inputs:
        x.q = q
        out, lse = run_kernel(x, scale)
        outs.append(out)
        lses.append(lse)
    out, lse = K.merge_attn_states(torch.stack(outs), torch.stack(lses))
    # SDPA over all keys, causal, fp32, GQA by repeating KV heads; [1, H, T, D] layout.
    group = hq // hkv
    qs = q.float().transpose(0, 1)[None]
    ks = k_all.float().repeat_interleave(group, 1).transpose(0, 1)[None]
    vs = v_all.float().repeat_interleave(group, 1).transpose(0, 1)[None]
    expected = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=scale)[0]
    scores = (qs @ ks.transpose(-1, -2))[0] * scale  # [H, T, T]
    causal = torch.ones(total, total, dtype=torch.bool).tril()
    expected_lse = torch.logsumexp(scores.masked_fill(~causal, NEG_INF), -1).transpose(0, 1)
    assert_attention_close((out, lse), (expected.transpose(0, 1), expected_lse), dtype)


# ---------------------------------------------------------------------------------------------
# Validation, empty inputs, fallback
# ---------------------------------------------------------------------------------------------


def _ok() -> Inputs:
    return build([Seq(list(range(5)), in_order(0, 5, 4))], 4, 4, 2, 8, torch.float32, seed=0)


def _call(**changes) -> Callable[[], object]:
    """A launcher call on valid inputs with some arguments replaced."""

    def call():
        x = _ok()
        args = dict(
            zip(
                (
                    "q",
                    "q_pos",
                    "cu_q",
                    "k_cache",
                    "v_cache",
                    "page_table",
                    "page_pos",
                    "page_len",
                    "cu_pages",
                ),
                (getattr(x, f.name) for f in fields(x)),
                strict=True,
            )
        )
        kwargs = {"sm_scale": 0.5}
        for name, value in changes.items():
            if name in ("sm_scale", "max_q_len"):
                kwargs[name] = value
            else:
                args[name] = value(args[name]) if callable(value) else value
        table = [args.pop(n) for n in ("page_table", "page_pos", "page_len", "cu_pages")]
        return K.paged_partial_attention(**args, pages=K.PagedKVTable(*table), **kwargs)

    return call


def _i(*values: int, dtype=torch.int32) -> torch.Tensor:
    return torch.tensor(values, dtype=dtype)


BAD_CALLS: list[tuple[str, Callable[[], object], str]] = [
    ("attn-2d-q", _call(q=lambda q: q[:, 0]), "q must be 3-D, got shape (5, 8) (2-D)"),
    ("attn-int-q", _call(q=lambda q: q.int()), "q has dtype torch.int32"),
    (
        "attn-q-kv-dtype",
        _call(q=lambda q: q.half()),
        "q has dtype torch.float16 but k_cache has dtype torch.float32",
    ),
    (
        "attn-kv-shapes",
        _call(v_cache=lambda v: v[:, :2].contiguous()),
        "k_cache has shape (5, 4, 2, 8) but v_cache has shape (5, 2, 2, 8)",
    ),
    (
        "attn-strided-cache",
        _call(k_cache=lambda k: k.transpose(1, 2).contiguous().transpose(1, 2)),
        "k_cache must be contiguous",
    ),
    (
        "attn-head-dim",
        _call(q=lambda q: torch.zeros(5, 4, 16)),
        "q has head dim 16 (shape (5, 4, 16)) but k_cache has 8",
    ),
    (
        "attn-gqa-ratio",
        _call(q=lambda q: torch.zeros(5, 3, 8)),
        "q has 3 heads, not a multiple of k_cache's 2 KV heads",
    ),
    (
        "attn-strided-d",
        _call(q=lambda q: torch.zeros(5, 8, 4).transpose(1, 2)),
        "q must have unit stride on D, got shape (5, 4, 8) with strides (32, 1, 4)",
    ),
    ("attn-qpos-len", _call(q_pos=torch.arange(4)), "q has 5 tokens (shape (5, 4, 8)) but q_pos"),
    ("attn-qpos-int32", _call(q_pos=torch.arange(5, dtype=torch.int32)), "q_pos has dtype"),
    (
        "attn-cu-lens",
        _call(cu_q=_i(0, 5, 5)),
        "cu_q has shape (3,) and cu_pages has shape (2,); both must be [B + 1]",
    ),
    ("attn-cu-empty", _call(cu_q=_i(), cu_pages=_i()), "cu_q has shape (0,)"),
    ("attn-float-cu", _call(cu_q=torch.tensor([0.0, 5.0])), "cu_q has dtype torch.float32"),
    (
        "attn-page-lens",
        _call(page_pos=torch.zeros(3, dtype=torch.int64)),
        "page_table has shape (2,), page_pos has shape (3,), page_len has shape (2,)",
    ),
    ("attn-page-pos-int32", _call(page_pos=_i(0, 4)), "page_pos has dtype torch.int32"),
    ("attn-2d-table", _call(page_table=_i(0, 1).view(1, 2)), "page_table must be 1-D"),
    ("attn-scale-0", _call(sm_scale=0.0), "sm_scale must be a finite number > 0, got 0.0"),
    ("attn-scale-nan", _call(sm_scale=NAN), "sm_scale must be a finite number > 0, got nan"),
    ("attn-scale-tensor", _call(sm_scale=torch.tensor(0.5)), "sm_scale must be a finite number"),
    ("attn-hint", _call(max_q_len=-1), "max_q_len must be a non-negative int or None, got -1"),
    ("attn-cu-q-end", _call(cu_q=_i(0, 4)), "cu_q [0, 4] must rise from 0 to q's 5 tokens"),
    ("attn-cu-q-start", _call(cu_q=_i(1, 5)), "cu_q [1, 5] must rise from 0"),
    (
        "attn-cu-q-falls",
        _call(cu_q=_i(0, 6, 5), cu_pages=_i(0, 1, 2)),
        "cu_q [0, 6, 5] must rise from 0 to q's 5 tokens",
    ),
    (
        "attn-cu-pages-end",
        _call(cu_pages=_i(0, 3)),
        "cu_pages [0, 3] must rise from 0 to the 2 pages of page_table",
    ),
    (
        "attn-page-len-range",
        _call(page_len=_i(4, 5)),
        "page_len values must lie in [0, page_size=4], got min 4 and max 5",
    ),
    (
        "attn-page-id-negative",
        _call(page_table=_i(0, -1)),
        "page_table ids must lie in [0, 5) (the cache's pages), got min -1 and max 0",
    ),
    (
        "attn-page-id-past-cache",
        _call(page_table=_i(0, 5)),
        "page_table ids must lie in [0, 5) (the cache's pages), got min 0 and max 5",
    ),
    (
        "attn-device",
        _call(page_pos=torch.zeros(2, dtype=torch.int64, device="meta")),
        "page_pos on meta",
    ),
    ("attn-not-tensor", _call(q_pos=list(range(5))), "q_pos must be a torch.Tensor, got list"),
    # merge_attn_states
    (
        "merge-3d-outs",
        lambda: K.merge_attn_states(torch.zeros(2, 3, 4), torch.zeros(2, 3, 4)),
        "merge_attn_states: outs must be 4-D, got shape (2, 3, 4) (3-D)",
    ),
    (
        "merge-lse-shape",
        lambda: K.merge_attn_states(torch.zeros(2, 3, 4, 8), torch.zeros(2, 3, 5)),
        "outs has shape (2, 3, 4, 8) but lses has shape (2, 3, 5); [L, T, H] must match",
    ),
    (
        "merge-lse-dtype",
        lambda: K.merge_attn_states(torch.zeros(2, 3, 4, 8), torch.zeros(2, 3, 4).half()),
        "lses has dtype torch.float16, expected one of (float32)",
    ),
    (
        "merge-strided-d",
        lambda: K.merge_attn_states(torch.zeros(2, 3, 8, 4).transpose(2, 3), torch.zeros(2, 3, 4)),
        "outs must have unit stride on D",
    ),
    (
        "merge-device",
        lambda: K.merge_attn_states(torch.zeros(2, 3, 4, 8), torch.zeros(2, 3, 4, device="meta")),
        "lses on meta",
    ),
]


@pytest.mark.parametrize(("call", "message"), [pytest.param(c, m, id=i) for i, c, m in BAD_CALLS])
def test_bad_input_raises_value_error(call, message):
    with pytest.raises(ValueError) as info:
        call()
    assert message in str(info.value)


def test_paged_attention_empty_inputs():
    x = build([Seq([], in_order(0, 8, 4))], 4, 4, 2, 8, torch.float16, seed=1)
    out, lse = run_kernel(x, 0.5)
    assert out.shape == (0, 4, 8) and lse.shape == (0, 4) and out.dtype == torch.float32
    x = build([Seq(list(range(6)), [])], 4, 4, 2, 8, torch.float16, seed=2)
    out, lse = run_kernel(x, 0.5)
    assert bool((out == 0).all()) and bool(torch.isneginf(lse).all())


@pytest.mark.parametrize("reason", ["no-interpreter", "no-triton"])
@pytest.mark.parametrize("name", ["paged_partial_attention", "merge_attn_states"])
def test_fallback_uses_reference_and_logs_once(monkeypatch, caplog, reason, name):
    if reason == "no-interpreter":
        monkeypatch.delenv("TRITON_INTERPRET", raising=False)
        expected_reason = "TRITON_INTERPRET is not 1"
    else:
        monkeypatch.setattr(_common, "_TRITON_IMPORT_ERROR", "ImportError: no triton")
        expected_reason = "triton import failed (ImportError: no triton)"
    monkeypatch.setattr(_common, "_fallback_logged", set())
    caplog.set_level(logging.INFO, logger="cpkv.kernels")
    x = build(LAYOUTS["ragged-3-seqs"](4), 4, 4, 2, 8, torch.float16, seed=3)
    outs, lses = torch.randn(2, 5, 3, 8), torch.randn(2, 5, 3)
    if name == "paged_partial_attention":
        first, second = (K.paged_partial_attention(*x.args(), 0.5) for _ in range(2))
        ref = naive.paged_partial_attention(*x.args(), 0.5)
    else:
        first, second = (K.merge_attn_states(outs, lses) for _ in range(2))
        ref = naive.merge_attn_states(outs, lses)
    for got in (first, second):
        assert all(torch.equal(a, b) for a, b in zip(got, ref, strict=True))
    records = [r for r in caplog.records if r.name == "cpkv.kernels"]
    assert len(records) == 1, [r.getMessage() for r in records]
    assert name in records[0].getMessage() and expected_reason in records[0].getMessage()


# NOTE: where Triton itself was imported without the interpreter (a GPU machine), its own
# library (tl.max, ...) stays compiled and no kernel can switch to the interpreter later.
@pytest.mark.skipif(GPU, reason="Triton's library was built compiled on this machine")
def test_kernel_built_compiled_is_rebuilt_with_its_helper(monkeypatch):
    """TRITON_INTERPRET set after import: the kernel and the @triton.jit tile update it calls
    are both rebuilt for the interpreter (a kernel of one kind cannot call a helper of the
    other)."""
    from triton.runtime.jit import JITFunction

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    for name in ("_paged_attention_kernel", "_tile_update"):
        monkeypatch.setattr(attn_mod, name, JITFunction(getattr(attn_mod, name).fn))
    x = build(LAYOUTS["ragged-3-seqs"](16), 16, 4, 2, 16, torch.float32, seed=6)
    got = K.paged_partial_attention(*x.args(), 0.3)  # CPU tensors: only the interpreter runs
    assert_attention_close(got, naive.paged_partial_attention(*x.args(), 0.3), torch.float32)
