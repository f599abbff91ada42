"""Hopper (sm_90) path of :func:`~cpkv.kernels.paged_partial_attention`: K/V tiles loaded with
TMA tensor descriptors straight from the page table.

A page of ``page_size`` tokens is, for one KV head, a ``[page_size, D]`` tile of the shard
viewed as ``[P * page_size, Hkv * D]`` (row stride ``Hkv * D``), so a key tile of ``BLOCK_N``
rows (a divisor of the page size) is one descriptor load at ``(page * page_size + slot0,
kv_head * D)``: the tensor-memory accelerator moves it into shared memory with no address
arithmetic per row, and the loop's loads pipeline against the two GEMMs. The launcher in
:mod:`cpkv.kernels.paged_attention` picks this path on sm_90 for 16-bit tiles whose shapes a
descriptor takes (:func:`tma_supported`); other GPUs and the interpreter keep the pointer
kernel, and tests drive this one under the interpreter with :data:`MODE` set to ``"always"``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from cpkv.kernels._common import HAS_TRITON, interpreter_enabled, next_power_of_2, tl, triton

if HAS_TRITON:
    from cpkv.kernels._attn_helpers import finish_softmax, key_range, query_block, softmax_tile

    try:
        from triton.tools.tensor_descriptor import TensorDescriptor
    except ImportError:  # triton < 3.4: no host-side descriptors, no TMA path
        TensorDescriptor = None  # type: ignore[assignment,misc]
else:  # pragma: no cover - exercised only without triton
    TensorDescriptor = None  # type: ignore[assignment,misc]

# "auto": sm_90 devices take this path where tma_supported() holds; "always": wherever it
# holds, the interpreter included (tests); "never": the pointer kernel everywhere (ablations).
MODE = "auto"


@dataclass(frozen=True, slots=True)
class TmaConfig:
    """Tiling of one TMA launch (see :class:`~cpkv.kernels.paged_attention.AttnConfig`).

    Attributes:
        block_m: query rows per program (tokens x heads_per_program).
        block_n: key rows per tile; cut to the page size when larger (a tile never spans
            pages: one descriptor load each).
        heads_per_program: query heads of one GQA group sharing each K/V tile.
        num_warps: warps per program.
        num_stages: software-pipelining depth of the K/V loads.
        warp_specialize: ask Triton to split producer and consumer warps in the key loops.
        heads_first: order the grid head groups first, so every head's heaviest query block
            starts in the first wave (else each head's blocks run heaviest first in turn).
        pair_tiles: in the loop over fully visible pages, two key tiles (two descriptor
            loads, two pages when the tile is the page) share one softmax step: one row max,
            one rescale of the output per ``2 * block_n`` keys (a tile never spans pages, so
            this is how a page of 64 gets 128-key steps); :func:`config_for` keeps it only
            where the page cut the tile to half ``block_n`` or less.
        exp_fma: with ``pair_tiles``, the second tile's ``exp2`` by a cubic on the FMA
            pipes instead of the special-function unit (FA4's software exponential): at
            D=64 one score costs ``4 * D`` = 256 tensor-core flops (~1/16 clock of an sm_90
            SM at ~4096 dense bf16 flops a clock) and one ``exp2`` (16 a clock): the two
            units are equally busy, and half the exponentials move to the idle pipes.
    """

    block_m: int
    block_n: int
    heads_per_program: int
    num_warps: int
    num_stages: int
    warp_specialize: bool = False
    heads_first: bool = False
    pair_tiles: bool = False
    exp_fma: bool = False

    def __post_init__(self) -> None:
        for name in ("block_m", "block_n", "heads_per_program", "num_warps"):
            value = getattr(self, name)
            if value < 1 or value & (value - 1):
                raise ValueError(f"TmaConfig.{name} must be a power of two >= 1, got {value}")
        if self.num_stages < 1:
            raise ValueError(f"TmaConfig.num_stages must be >= 1, got {self.num_stages}")
        if self.block_m < 16 or self.block_n < 16:
            raise ValueError(
                f"TmaConfig: block_m {self.block_m} and block_n {self.block_n} must be >= 16"
            )
        if self.exp_fma and not self.pair_tiles:
            raise ValueError("TmaConfig: exp_fma applies to the paired tiles; set pair_tiles")
        if self.block_m % self.heads_per_program:
            raise ValueError(
                f"TmaConfig: block_m {self.block_m} is not a multiple of heads_per_program "
                f"{self.heads_per_program}"
            )


# Tiling by head dim (16-bit tiles only). Measured on an H200 (triton 3.6; causal 32k, 32/8
# heads, page 64, bf16; four sweeps in docs/gpu-run/hopper-attention/, spread ~1%):
# - D=128: 128 rows x 64 keys at 4 warps (one warpgroup), 3 stages: 514-522 TFLOP/s; 2 or 4
#   stages, 128-key tiles and 2-4 GQA heads a program all within 1% of it; 8 warps 387-402,
#   256 rows at 8 warps 458-468, 64 rows 428-441, 32-key tiles 410, head groups first 507-511.
# - D=64: 64 rows x 128 keys at 4 warps, 2 stages: 416-421 TFLOP/s; 64- or 256-key tiles
#   410-419, 3 stages 373-377, 128 rows 382-391, 2-4 GQA heads 371-380, 8 warps 250-407.
# - Triton's warp specialisation (tl.range(warp_specialize=True)): at 4 warps the pass fails
#   inside Triton 3.6 (an assertion), at 8 warps it compiles and changes nothing. Loading the
#   query tile by descriptor too (kept in shared memory) changed nothing either (500-517).
# - Paired key tiles (pair_tiles: at page 64 the tile is the page, so the sweeps' "128-key"
#   D=64 rows ran 64-key tiles), H100, 2026-12-07, against cuDNN in the same run
#   (docs/gpu-run/hopper-attention/11-pair-tiles/h100-2026-12-07.txt): D=64 0.857 -> 0.881x at
#   8k, 0.922 -> 0.939x at 32k, 0.935 -> 0.939x at 128k (3 stages: no better); D=128 2.5x
#   slower (two 128x64 score tiles at 4 warps), so D=64 only.
# - D=64 with pairs and taller query tiles, H100, 2026-12-07 (5), same harness
#   (docs/gpu-run/hopper-attention/12-d64-wide/h100-2026-12-07.txt): 128 rows at 4 warps
#   0.879 -> 0.829x cuDNN at 8k, 0.937 -> 0.954x at 32k (within the arms' own 5% spread);
#   128 rows at 8 warps 0.60-0.66x (2 or 3 stages); two GQA heads a program equal. Not kept.
# - D=16 / 32 (tiny test models) and 256: not tuned.
CONFIGS: dict[int, TmaConfig] = {
    16: TmaConfig(block_m=64, block_n=64, heads_per_program=1, num_warps=4, num_stages=2),
    32: TmaConfig(block_m=64, block_n=64, heads_per_program=1, num_warps=4, num_stages=2),
    64: TmaConfig(
        block_m=64, block_n=128, heads_per_program=1, num_warps=4, num_stages=2, pair_tiles=True
    ),
    128: TmaConfig(block_m=128, block_n=64, heads_per_program=1, num_warps=4, num_stages=3),
    256: TmaConfig(block_m=64, block_n=32, heads_per_program=1, num_warps=8, num_stages=2),
}
# Smaller pages cut the key tile to the page: at 16 the pointer kernel, which spans pages in
# one tile, is faster (D=128, 32k: 357 against 250 TFLOP/s; at 32: 360 against 416).
MIN_PAGE = 32
# NOTE: a descriptor's box is at most 256 elements a side, its rows 16-byte aligned.
_MAX_BOX = 256


def config_for(head_dim: int, page_size: int, group: int, max_q_len: int) -> TmaConfig:
    """The tiling for one launch: the entry for ``head_dim``, its key tile cut to the page
    size, its GQA packing to a divisor of ``group`` and its rows to what the longest sequence
    fills."""
    cfg = CONFIGS[head_dim]
    heads = _gcd_pow2(cfg.heads_per_program, group)
    block_m = min(cfg.block_m, max(16, next_power_of_2(max_q_len * heads)))
    block_n = min(cfg.block_n, page_size)
    # Pairs give back the configured key step where the page cut the tile (no more).
    pairs = cfg.pair_tiles and 2 * block_n <= cfg.block_n
    return TmaConfig(
        block_m=block_m,
        block_n=block_n,
        heads_per_program=min(heads, block_m),
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
        warp_specialize=cfg.warp_specialize,
        heads_first=cfg.heads_first,
        pair_tiles=pairs,
        exp_fma=cfg.exp_fma and pairs,
    )


def _gcd_pow2(pow2: int, n: int) -> int:
    """The largest power of two dividing both ``pow2`` (a power of two) and ``n``."""
    g = 1
    while g < pow2 and n % (2 * g) == 0:
        g *= 2
    return g


def tma_supported(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor | None = None
) -> bool:
    """Whether this launch can take the TMA path under :data:`MODE` (checked after the
    launcher's validation: shapes and dtypes already agree; ``v_cache`` is ``k_cache``'s
    shape, its address checked too)."""
    if MODE == "never" or TensorDescriptor is None:
        return False
    if interpreter_enabled():
        if MODE != "always":
            return False
    elif MODE != "always" and (
        q.device.type != "cuda" or torch.cuda.get_device_capability(q.device)[0] != 9
    ):
        return False
    page_size, hkv, d = k_cache.shape[1:]
    return (
        q.dtype in (torch.float16, torch.bfloat16)
        and d in CONFIGS
        and page_size >= MIN_PAGE
        and page_size & (page_size - 1) == 0
        and page_size <= _MAX_BOX
        and (hkv * d * k_cache.element_size()) % 16 == 0
        and k_cache.data_ptr() % 16 == 0
        and (v_cache is None or v_cache.data_ptr() % 16 == 0)
        and 0 < k_cache.shape[0] * page_size < 2**31  # descriptor coordinates are int32
    )


def kv_descriptors(k_cache: torch.Tensor, v_cache: torch.Tensor, block_n: int) -> tuple:
    """Host-side descriptors of both shards as ``[P * page_size, Hkv * D]`` with a
    ``[block_n, D]`` box."""
    p, page_size, hkv, d = k_cache.shape
    shape, strides = [p * page_size, hkv * d], [hkv * d, 1]
    return tuple(TensorDescriptor(t, shape, strides, [block_n, d]) for t in (k_cache, v_cache))


if HAS_TRITON:
    # 2^f on |f| <= 1/2: a cubic fitted for relative error (under 7.5e-5; p is rounded to
    # the 16-bit dtype, relative 2^-8 or 2^-11, before its dot with V).
    _EXP2_C3 = tl.constexpr(0.05517145047549069)
    _EXP2_C2 = tl.constexpr(0.24261111737372776)
    _EXP2_C1 = tl.constexpr(0.6932610262135153)
    _EXP2_C0 = tl.constexpr(0.9999280740706467)
    # x + 1.5 * 2^23 rounds x to an integer j held in the low bits of the sum's mantissa.
    _ROUND_MAGIC = tl.constexpr(12582912.0)

    @triton.jit
    def _exp2_fma(x):
        # 2^x for x <= 0 without the special-function unit: x = j + f with j = round(x) and
        # |f| <= 1/2; 2^f by the cubic, then j added to its exponent bits. NOTE: the sum's
        # bits are 0x4B400000 + j; shifted left 23 in 32 bits, only j << 23 is left. x is
        # clamped so 2^j stays a normal float (2^-125 is 0 beside the row's maximum of 1).
        x = tl.maximum(x, -125.0)
        t = x + _ROUND_MAGIC
        f = x - (t - _ROUND_MAGIC)
        p = _EXP2_C3 * f + _EXP2_C2
        p = p * f + _EXP2_C1
        p = p * f + _EXP2_C0
        bits = p.to(tl.int32, bitcast=True) + (t.to(tl.int32, bitcast=True) << 23)
        return bits.to(tl.float32, bitcast=True)

    @triton.jit
    def _tma_tile_update(
        acc,  # [BLOCK_M, HEAD_DIM] fp32 output so far, unnormalised
        l_i,  # [BLOCK_M] fp32 sum of exp2 so far
        m_i,  # [BLOCK_M] fp32 running max of the scaled scores (exp2 domain)
        q,  # [BLOCK_M, HEAD_DIM] the program's queries
        q_pos,  # [BLOCK_M] their positions (read with MASK only)
        row0,  # the tile's first key row: page row0 // PAGE_SIZE, slots from row0 % PAGE_SIZE
        qk_scale,
        page_table_ptr,
        page_pos_ptr,
        page_len_ptr,
        k_desc,
        v_desc,
        kv_col,  # the KV head's first column in the [P * PAGE_SIZE, Hkv * D] view
        MASK: tl.constexpr,  # False: a tile of a full page every query sees
        PAGE_SIZE: tl.constexpr,
        BLOCK_N: tl.constexpr,
        UPCAST: tl.constexpr,
    ):
        # One key tile of the online softmax; returns (acc, l_i, m_i) updated. NOTE: BLOCK_N
        # divides PAGE_SIZE, so a tile lies in one page: one page id, one position, one length.
        pidx = row0 // PAGE_SIZE
        s0 = row0 % PAGE_SIZE
        page = tl.load(page_table_ptr + pidx).to(tl.int32)
        y = page * PAGE_SIZE + s0
        k = k_desc.load([y, kv_col])
        if UPCAST:
            k = k.to(tl.float32)
        qk = tl.dot(q, k.T)
        if MASK:
            s = s0 + tl.arange(0, BLOCK_N)
            valid = s < tl.load(page_len_ptr + pidx)
            k_pos = tl.load(page_pos_ptr + pidx) + s
            visible = valid[None, :] & (k_pos[None, :] <= q_pos[:, None])
        else:
            visible = None
        p, alpha, l_i, m_new = softmax_tile(qk, m_i, l_i, visible, qk_scale, MASK)
        v = v_desc.load([y, kv_col])
        if MASK:
            # NOTE: slots past a page's length may hold anything (NaN included), and 0 * NaN
            # is NaN in the dot: zero them (the box cannot be masked).
            v = tl.where(valid[:, None], v, 0.0)
        if UPCAST:
            v = v.to(tl.float32)
        acc = acc * alpha[:, None]
        acc = tl.dot(p.to(v.dtype), v, acc)
        return acc, l_i, m_new

    @triton.jit
    def _tma_pair_update(
        acc,
        l_i,
        m_i,
        q,
        row0,  # the first tile's first key row; the second tile starts BLOCK_N rows later
        qk_scale,
        page_table_ptr,
        k_desc,
        v_desc,
        kv_col,
        PAGE_SIZE: tl.constexpr,
        BLOCK_N: tl.constexpr,
        UPCAST: tl.constexpr,
        EXP_FMA: tl.constexpr,
    ):
        # Two key tiles of full pages every query sees, one online-softmax step for both (as
        # softmax_tile's unmasked branch over 2 * BLOCK_N keys). NOTE: each tile lies in one
        # page, as in _tma_tile_update; the two may be in different pages.
        row1 = row0 + BLOCK_N
        y0 = tl.load(page_table_ptr + row0 // PAGE_SIZE).to(tl.int32) * PAGE_SIZE
        y1 = tl.load(page_table_ptr + row1 // PAGE_SIZE).to(tl.int32) * PAGE_SIZE
        y0 += row0 % PAGE_SIZE
        y1 += row1 % PAGE_SIZE
        k0 = k_desc.load([y0, kv_col])
        k1 = k_desc.load([y1, kv_col])
        if UPCAST:
            k0 = k0.to(tl.float32)
            k1 = k1.to(tl.float32)
        qk0 = tl.dot(q, k0.T)
        qk1 = tl.dot(q, k1.T)
        m_new = tl.maximum(m_i, tl.maximum(tl.max(qk0, 1), tl.max(qk1, 1)) * qk_scale)
        p0 = tl.math.exp2(qk0 * qk_scale - m_new[:, None])
        if EXP_FMA:  # the second tile's exponentials on the FMA pipes (TmaConfig.exp_fma)
            p1 = _exp2_fma(qk1 * qk_scale - m_new[:, None])
        else:
            p1 = tl.math.exp2(qk1 * qk_scale - m_new[:, None])
        alpha = tl.math.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p0, 1) + tl.sum(p1, 1)
        v0 = v_desc.load([y0, kv_col])
        v1 = v_desc.load([y1, kv_col])
        if UPCAST:
            v0 = v0.to(tl.float32)
            v1 = v1.to(tl.float32)
        acc = acc * alpha[:, None]
        acc = tl.dot(p0.to(v0.dtype), v0, acc)
        acc = tl.dot(p1.to(v1.dtype), v1, acc)
        return acc, l_i, m_new

    @triton.jit
    def _paged_attention_tma_kernel(
        q_ptr,  # [Tq, Hq, D], unit stride on D
        q_pos_ptr,  # [Tq] int64
        cu_q_ptr,  # [B + 1]
        k_desc,  # descriptor of K as [P * PAGE_SIZE, Hkv * D], box [BLOCK_N, D]
        v_desc,  # likewise V
        page_table_ptr,  # [N] local page ids
        page_pos_ptr,  # [N] int64 position of each page's slot 0
        page_len_ptr,  # [N] valid slots per page
        cu_pages_ptr,  # [B + 1]
        block_seq_ptr,  # [grid0] int32 sequence of each query block (>= B: idle program)
        cu_blocks_ptr,  # [B] int64 inclusive cumsum of query blocks per sequence
        out_ptr,  # [Tq, Hq, D] contiguous, fp32 or the q dtype
        lse_ptr,  # [Tq, Hq] fp32 contiguous
        qk_scale,  # sm_scale * log2(e): scores in the exp2 domain
        n_seqs,
        stride_qt,
        stride_qh,
        N_HEADS: tl.constexpr,  # Hq
        GROUP: tl.constexpr,  # Hq // Hkv
        PAGE_SIZE: tl.constexpr,
        HEAD_DIM: tl.constexpr,  # a power of two (a descriptor box side)
        HP: tl.constexpr,  # query heads per program (a divisor of GROUP)
        BLOCK_M: tl.constexpr,  # rows: BLOCK_M // HP tokens x HP heads
        BLOCK_N: tl.constexpr,  # a divisor of PAGE_SIZE
        SCAN: tl.constexpr,
        WARP_SPECIALIZE: tl.constexpr,
        HEADS_FIRST: tl.constexpr,  # grid (head group, query block), else the other way round
        PAIR_TILES: tl.constexpr,  # two key tiles a softmax step over fully visible pages
        EXP_FMA: tl.constexpr,  # the pairs' second exp2 on the FMA pipes
        UPCAST: tl.constexpr,  # run the dots on fp32 copies of the tiles (interpreter + bf16)
    ):
        # Grid and walk as the pointer kernel's: (query block, group of HP query heads); first
        # the tiles every query of the block sees (no mask), then the rest it may see.
        if HEADS_FIRST:
            pid = tl.program_id(1)
            head0 = tl.program_id(0) * HP
        else:
            pid = tl.program_id(0)
            head0 = tl.program_id(1) * HP
        BLOCK_T: tl.constexpr = BLOCK_M // HP
        seq = tl.load(block_seq_ptr + pid)
        if seq >= n_seqs:
            return
        t0, q_end = query_block(pid, seq, cu_q_ptr, cu_blocks_ptr, BLOCK_T)

        r = tl.arange(0, BLOCK_M)
        tok = t0 + r // HP
        head = head0 + r % HP
        q_valid = tok < q_end
        d = tl.arange(0, HEAD_DIM)
        q_pos = tl.load(q_pos_ptr + tok, mask=q_valid, other=-1)
        q_max = tl.max(tl.where(q_valid, q_pos, -(2**62)), axis=0)
        q_min = tl.min(tl.where(q_valid, q_pos, 2**62), axis=0)
        tok64 = tok.to(tl.int64)
        q = tl.load(
            q_ptr + (tok64 * stride_qt + head * stride_qh)[:, None] + d[None, :],
            mask=q_valid[:, None],
        )
        if UPCAST:
            q = q.to(tl.float32)

        lo, mid, hi = key_range(
            seq, q_min, q_max, cu_pages_ptr, page_pos_ptr, page_len_ptr, PAGE_SIZE, SCAN
        )
        row_lo = lo * PAGE_SIZE
        row_full = mid * PAGE_SIZE
        row_hi = (hi + 1) * PAGE_SIZE
        kv_col = (head0 // GROUP) * HEAD_DIM

        m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
        # NOTE: rows in [row_lo, row_full) are slots of full pages every query here sees.
        if PAIR_TILES:
            # Whole pairs of tiles here; an odd last tile joins the masked loop (its mask
            # passes every key: the same result, one tile's mask the dearer).
            row_pairs = row_lo + (row_full - row_lo) // (2 * BLOCK_N) * (2 * BLOCK_N)
            for row0 in tl.range(row_lo, row_pairs, 2 * BLOCK_N):
                acc, l_i, m_i = _tma_pair_update(
                    acc, l_i, m_i, q, row0, qk_scale, page_table_ptr, k_desc, v_desc, kv_col,
                    PAGE_SIZE=PAGE_SIZE, BLOCK_N=BLOCK_N, UPCAST=UPCAST, EXP_FMA=EXP_FMA,
                )  # fmt: skip
            row_full = row_pairs
        else:
            for row0 in tl.range(row_lo, row_full, BLOCK_N, warp_specialize=WARP_SPECIALIZE):
                acc, l_i, m_i = _tma_tile_update(
                    acc, l_i, m_i, q, q_pos, row0, qk_scale, page_table_ptr, page_pos_ptr,
                    page_len_ptr, k_desc, v_desc, kv_col,
                    MASK=False, PAGE_SIZE=PAGE_SIZE, BLOCK_N=BLOCK_N, UPCAST=UPCAST,
                )  # fmt: skip
        for row0 in tl.range(row_full, row_hi, BLOCK_N):
            acc, l_i, m_i = _tma_tile_update(
                acc, l_i, m_i, q, q_pos, row0, qk_scale, page_table_ptr, page_pos_ptr,
                page_len_ptr, k_desc, v_desc, kv_col,
                MASK=True, PAGE_SIZE=PAGE_SIZE, BLOCK_N=BLOCK_N, UPCAST=UPCAST,
            )  # fmt: skip

        out, lse = finish_softmax(acc, l_i, m_i)
        o_row = tok64 * N_HEADS + head
        tl.store(out_ptr + (o_row * HEAD_DIM)[:, None] + d[None, :], out, mask=q_valid[:, None])
        tl.store(lse_ptr + o_row, lse, mask=q_valid)


def launch(
    cfg: TmaConfig,
    grid: tuple[int, int],
    q: torch.Tensor,
    q_pos: torch.Tensor,
    cu_q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    pages,
    block_seq: torch.Tensor,
    cu_blocks: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    qk_scale: float,
    upcast: bool,
) -> None:
    """Launch the TMA kernel over inputs the pointer launcher validated and mapped."""
    from cpkv.kernels._common import for_current_mode
    from cpkv.kernels.paged_attention import SCAN_BLOCK

    hq, d = q.shape[1], q.shape[2]
    page_size, hkv = k_cache.shape[1], k_cache.shape[2]
    # NOTE: a tile never spans pages (one descriptor load, one page's position and length).
    assert page_size % cfg.block_n == 0, (page_size, cfg.block_n)
    k_desc, v_desc = kv_descriptors(k_cache, v_cache, cfg.block_n)
    # NOTE: CUDA caps grid axis 1 at 65535 programs.
    heads_first = cfg.heads_first and grid[0] <= 65535
    if heads_first:
        grid = (grid[1], grid[0])
    for_current_mode(_paged_attention_tma_kernel)[grid](
        q,
        q_pos,
        cu_q,
        k_desc,
        v_desc,
        pages.page_table,
        pages.page_pos,
        pages.page_len,
        pages.cu_pages,
        block_seq,
        cu_blocks,
        out,
        lse,
        qk_scale,
        cu_q.shape[0] - 1,
        q.stride(0),
        q.stride(1),
        N_HEADS=hq,
        GROUP=hq // hkv,
        PAGE_SIZE=page_size,
        HEAD_DIM=d,
        HP=cfg.heads_per_program,
        BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n,
        SCAN=SCAN_BLOCK,
        WARP_SPECIALIZE=cfg.warp_specialize,
        HEADS_FIRST=heads_first,
        PAIR_TILES=cfg.pair_tiles,
        EXP_FMA=cfg.exp_fma,
        UPCAST=upcast,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )
