"""Partial prefill attention of queries with global positions over one lane's paged KV shard."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from cpkv.kernels import naive, paged_attention_tma
from cpkv.kernels._common import (
    HAS_TRITON,
    INT_DTYPES,
    KV_DTYPES,
    cdiv,
    check_hint,
    check_real,
    check_same_device,
    check_tensor,
    for_current_mode,
    interpreter_enabled,
    next_power_of_2,
    tl,
    triton,
    use_triton,
)
from cpkv.kernels.page_table import PagedKVTable

if HAS_TRITON:
    from cpkv.kernels._attn_helpers import finish_softmax, key_range, query_block, softmax_tile

_NAME = "paged_partial_attention"

LOG2E = 1.4426950408889634


@dataclass(frozen=True)
class AttnConfig:
    """Tiling of one launch.

    Attributes:
        block_m: query rows per program (tokens x heads_per_program).
        block_n: key rows per inner iteration (may span several pages or part of one).
        heads_per_program: query heads of one GQA group a program packs into its rows, so
            they share each K/V tile it loads (1: one program per query head).
        num_warps: warps per program.
        num_stages: software-pipelining depth of the K/V loads.
    """

    block_m: int
    block_n: int
    heads_per_program: int
    num_warps: int
    num_stages: int


# Tiling by (element size in bytes, padded head dim). Every entry compiles for sm_90a without
# register spills (triton 3.9, ptxas -v; 128-key tiles at D=128 spilled 100-230 B, 128 rows at
# 4 warps 670-840 B). 16-bit entries measured on an H200 (triton 3.6; causal 32k, 32/8 heads,
# page 64, bf16; docs/gpu-run/attention-bench.txt):
# - D=128: 128 rows x 64 keys, 8 warps, 3 stages: 374 TFLOP/s. 64x64 at 4 warps gave 377-378 and
#   packing 4 GQA heads per program 370-378, both within ~1% (run-to-run spread ~0.5%), so the
#   FA2 shape stays; 2 stages cost 3% (364), 4 stages nothing (372), 32-key tiles 27% (271).
# - D=64: 64 rows x 128 keys, 4 warps, 2 stages: 348 TFLOP/s (3 stages 334, 4 stages 332; 2026-12-03
#   sweep, docs/gpu-run/lanes2/sweep.txt), against 245 for 128x64 at 8 warps, 274 for 64x64, 292
#   for 128x128, 226 for 64x256 and 156 for 64x128 at 8 warps (a 64-wide head halves the work
#   per key tile, so wider key tiles amortise the softmax and loop overhead, up to 128).
# - D=256: not measured; 64x32 at 8 warps is the largest tile that did not spill.
# fp32 runs its dots in IEEE fp32 on the FMA units (a correctness path, not tuned): the largest
# tiles that did not spill (64x32 at D=128 spilled 900 B).
CONFIGS: dict[tuple[int, int], AttnConfig] = {
    (2, 64): AttnConfig(block_m=64, block_n=128, heads_per_program=1, num_warps=4, num_stages=2),
    (2, 128): AttnConfig(block_m=128, block_n=64, heads_per_program=1, num_warps=8, num_stages=3),
    (2, 256): AttnConfig(block_m=64, block_n=32, heads_per_program=1, num_warps=8, num_stages=2),
    (4, 64): AttnConfig(block_m=64, block_n=32, heads_per_program=1, num_warps=8, num_stages=2),
    (4, 128): AttnConfig(block_m=32, block_n=16, heads_per_program=1, num_warps=4, num_stages=2),
    (4, 256): AttnConfig(block_m=16, block_n=16, heads_per_program=1, num_warps=4, num_stages=2),
}
# Pages scanned per step when a program bounds its key range (positions + lengths: 12 B each).
SCAN_BLOCK = 256
# NOTE: tl.dot needs every tile dim >= 16.
MIN_DOT = 16


def config_for(dtype: torch.dtype, head_dim: int, group: int, max_q_len: int | None) -> AttnConfig:
    """The tiling for one launch: the tuned entry for (dtype, head dim), with the GQA packing cut
    to a divisor of ``group`` and the query rows cut to what the longest sequence can fill.

    Args:
        dtype: q / KV dtype.
        head_dim: D.
        group: query heads per KV head (Hq // Hkv).
        max_q_len: longest sequence's query count, when known.

    Returns:
        The :class:`AttnConfig` to launch with.
    """
    elem = torch.empty((), dtype=dtype).element_size()
    d_key = min(256, max(64, next_power_of_2(head_dim)))
    cfg = CONFIGS[(elem, d_key)]
    heads = math.gcd(cfg.heads_per_program, group)
    block_m = cfg.block_m
    if max_q_len is not None:  # short sequences: no point in rows no query fills
        block_m = min(block_m, max(MIN_DOT, next_power_of_2(max_q_len * heads)))
    heads = min(heads, block_m)
    return AttnConfig(block_m, cfg.block_n, heads, cfg.num_warps, cfg.num_stages)


if HAS_TRITON:

    @triton.jit
    def _tile_update(
        acc,  # [BLOCK_M, BLOCK_D] fp32 output so far, unnormalised
        l_i,  # [BLOCK_M] fp32 sum of exp2 so far
        m_i,  # [BLOCK_M] fp32 running max of the scaled scores (exp2 domain)
        q,  # [BLOCK_M, BLOCK_D] the program's queries
        q_pos,  # [BLOCK_M] their positions (read with MASK only)
        row0,  # the tile's first key row: row -> page row // PAGE_SIZE, slot row % PAGE_SIZE
        row_hi,  # end of the key rows (read with MASK only)
        qk_scale,
        page_table_ptr,
        page_pos_ptr,
        page_len_ptr,
        k_ptr,
        v_ptr,
        kv_base,  # [BLOCK_D] offsets of the program's KV head's dims within a slot
        d_ok,  # [BLOCK_D] dims < HEAD_DIM
        MASK: tl.constexpr,  # False: full pages every query sees (no row/length/position mask)
        PAGE_SIZE: tl.constexpr,
        KV_ROW: tl.constexpr,
        HEAD_DIM: tl.constexpr,
        BLOCK_D: tl.constexpr,
        BLOCK_N: tl.constexpr,
        DOT_PRECISION: tl.constexpr,
        UPCAST: tl.constexpr,
    ):
        # One BLOCK_N-row key tile of the online softmax; returns (acc, l_i, m_i) updated. Both
        # key loops of the kernel call it; the constexpr branches leave each loop the exact
        # body it would have written out.
        rows = row0 + tl.arange(0, BLOCK_N)
        if MASK:
            in_range = rows < row_hi
            pidx = rows // PAGE_SIZE
            page = tl.load(page_table_ptr + pidx, mask=in_range, other=0).to(tl.int64)
            ppos = tl.load(page_pos_ptr + pidx, mask=in_range, other=0)
            plen = tl.load(page_len_ptr + pidx, mask=in_range, other=0)
            s = rows % PAGE_SIZE
            # NOTE: slots past a page's length may hold anything (NaN included): never read.
            valid = in_range & (s < plen)
            kv_off = ((page * PAGE_SIZE + s) * KV_ROW)[:, None] + kv_base[None, :]
            kv_mask = valid[:, None] & d_ok[None, :]
            k = tl.load(k_ptr + kv_off, mask=kv_mask, other=0.0)
            visible = valid[None, :] & ((ppos + s)[None, :] <= q_pos[:, None])
        else:
            visible = None
            page = tl.load(page_table_ptr + rows // PAGE_SIZE).to(tl.int64)
            slot = (page * PAGE_SIZE + rows % PAGE_SIZE) * KV_ROW
            kv_off = slot[:, None] + kv_base[None, :]
            if BLOCK_D == HEAD_DIM:  # no mask at all: plain (pipelined) row copies
                k = tl.load(k_ptr + kv_off)
            else:
                k = tl.load(k_ptr + kv_off, mask=d_ok[None, :])
        if UPCAST:
            k = k.to(tl.float32)
        qk = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)
        p, alpha, l_i, m_new = softmax_tile(qk, m_i, l_i, visible, qk_scale, MASK)
        if MASK:
            v = tl.load(v_ptr + kv_off, mask=kv_mask, other=0.0)
        elif BLOCK_D == HEAD_DIM:
            v = tl.load(v_ptr + kv_off)
        else:
            v = tl.load(v_ptr + kv_off, mask=d_ok[None, :])
        if UPCAST:
            v = v.to(tl.float32)
        acc = acc * alpha[:, None]
        acc = tl.dot(p.to(v.dtype), v, acc, input_precision=DOT_PRECISION)
        return acc, l_i, m_new

    @triton.jit
    def _paged_attention_kernel(
        q_ptr,  # [Tq, Hq, D], unit stride on D
        q_pos_ptr,  # [Tq] int64
        cu_q_ptr,  # [B + 1]
        k_ptr,  # [P, PAGE_SIZE, Hkv, D] contiguous
        v_ptr,  # [P, PAGE_SIZE, Hkv, D] contiguous
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
        KV_ROW: tl.constexpr,  # Hkv * D: one slot's stride in the shard
        PAGE_SIZE: tl.constexpr,
        HEAD_DIM: tl.constexpr,
        BLOCK_D: tl.constexpr,  # next power of two >= max(HEAD_DIM, 16)
        HP: tl.constexpr,  # query heads per program (a divisor of GROUP)
        BLOCK_M: tl.constexpr,  # rows: BLOCK_M // HP tokens x HP heads
        BLOCK_N: tl.constexpr,
        SCAN: tl.constexpr,
        DOT_PRECISION: tl.constexpr,
        UPCAST: tl.constexpr,  # run the dots on fp32 copies of the tiles (interpreter + bf16)
    ):
        # Grid: (query block, group of HP query heads). Each program owns BLOCK_M // HP query
        # tokens of one sequence x HP heads of one KV group, and walks that sequence's pages
        # through the page table: first the key rows every one of its queries sees (no mask),
        # then the rest of the rows that any of them may see (masked by position and length).
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
        d = tl.arange(0, BLOCK_D)
        d_ok = d < HEAD_DIM
        q_pos = tl.load(q_pos_ptr + tok, mask=q_valid, other=-1)
        q_max = tl.max(tl.where(q_valid, q_pos, -(2**62)), axis=0)
        q_min = tl.min(tl.where(q_valid, q_pos, 2**62), axis=0)
        tok64 = tok.to(tl.int64)
        q_off = tok64 * stride_qt + head * stride_qh
        q = tl.load(q_ptr + q_off[:, None] + d[None, :], mask=q_valid[:, None] & d_ok[None, :])
        if UPCAST:
            q = q.to(tl.float32)

        # Bound the key range from the page list (see key_range).
        lo, mid, hi = key_range(
            seq, q_min, q_max, cu_pages_ptr, page_pos_ptr, page_len_ptr, PAGE_SIZE, SCAN
        )

        # Key rows count through the sequence's pages: row -> page row // PAGE_SIZE of the
        # table, slot row % PAGE_SIZE; a BLOCK_N tile may cover several pages or part of one.
        row_lo = lo * PAGE_SIZE
        row_full = row_lo + ((mid - lo) * PAGE_SIZE) // BLOCK_N * BLOCK_N
        row_hi = (hi + 1) * PAGE_SIZE
        kv_head = head0 // GROUP
        kv_base = kv_head * HEAD_DIM + d

        m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)

        # NOTE: rows in [row_lo, row_full) are slots of full pages every query here sees: no
        # row, length or position mask, and the running max is finite after the first tile.
        for row0 in range(row_lo, row_full, BLOCK_N):
            acc, l_i, m_i = _tile_update(
                acc, l_i, m_i, q, q_pos, row0, row_hi, qk_scale,
                page_table_ptr, page_pos_ptr, page_len_ptr, k_ptr, v_ptr, kv_base, d_ok,
                MASK=False, PAGE_SIZE=PAGE_SIZE, KV_ROW=KV_ROW, HEAD_DIM=HEAD_DIM,
                BLOCK_D=BLOCK_D, BLOCK_N=BLOCK_N, DOT_PRECISION=DOT_PRECISION, UPCAST=UPCAST,
            )  # fmt: skip
        for row0 in range(row_full, row_hi, BLOCK_N):
            acc, l_i, m_i = _tile_update(
                acc, l_i, m_i, q, q_pos, row0, row_hi, qk_scale,
                page_table_ptr, page_pos_ptr, page_len_ptr, k_ptr, v_ptr, kv_base, d_ok,
                MASK=True, PAGE_SIZE=PAGE_SIZE, KV_ROW=KV_ROW, HEAD_DIM=HEAD_DIM,
                BLOCK_D=BLOCK_D, BLOCK_N=BLOCK_N, DOT_PRECISION=DOT_PRECISION, UPCAST=UPCAST,
            )  # fmt: skip

        out, lse = finish_softmax(acc, l_i, m_i)
        o_row = tok64 * N_HEADS + head
        tl.store(
            out_ptr + (o_row * HEAD_DIM)[:, None] + d[None, :],
            out,
            mask=q_valid[:, None] & d_ok[None, :],
        )
        tl.store(lse_ptr + o_row, lse, mask=q_valid)


def _validate(
    q: torch.Tensor,
    q_pos: torch.Tensor,
    cu_q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    pages: PagedKVTable,
    sm_scale: float,
    max_q_len: int | None,
    out_dtype: torch.dtype,
) -> torch.device:
    """Host-side checks of shapes, dtypes, devices and layout (no device sync); the table
    checked its own tensors when it was built."""
    q = check_tensor(_NAME, "q", q, ndim=3, dtypes=KV_DTYPES)
    k_cache = check_tensor(_NAME, "k_cache", k_cache, ndim=4, dtypes=KV_DTYPES, contiguous=True)
    v_cache = check_tensor(_NAME, "v_cache", v_cache, ndim=4, dtypes=KV_DTYPES, contiguous=True)
    if k_cache.shape != v_cache.shape:
        raise ValueError(
            f"{_NAME}: k_cache has shape {tuple(k_cache.shape)} but v_cache has shape "
            f"{tuple(v_cache.shape)}"
        )
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
        if t.dtype != q.dtype:
            raise ValueError(f"{_NAME}: q has dtype {q.dtype} but {name} has dtype {t.dtype}")
    if q.shape[0] > 0 and q.stride(2) != 1 and q.shape[2] > 1:
        raise ValueError(
            f"{_NAME}: q must have unit stride on D, got shape {tuple(q.shape)} "
            f"with strides {q.stride()}"
        )
    tq, hq, d = q.shape
    page_size, hkv, dk = k_cache.shape[1:]
    if dk != d:
        raise ValueError(
            f"{_NAME}: q has head dim {d} (shape {tuple(q.shape)}) but k_cache has {dk} "
            f"(shape {tuple(k_cache.shape)})"
        )
    if hkv == 0 or hq % hkv != 0:
        raise ValueError(
            f"{_NAME}: q has {hq} heads, not a multiple of k_cache's {hkv} KV heads "
            f"(shapes {tuple(q.shape)} and {tuple(k_cache.shape)})"
        )
    if page_size == 0:
        raise ValueError(f"{_NAME}: k_cache has page size 0 (shape {tuple(k_cache.shape)})")
    check_tensor(_NAME, "q_pos", q_pos, ndim=1, dtypes=(torch.int64,), contiguous=True)
    if q_pos.shape[0] != tq:
        raise ValueError(
            f"{_NAME}: q has {tq} tokens (shape {tuple(q.shape)}) but q_pos has shape "
            f"{tuple(q_pos.shape)}"
        )
    check_tensor(_NAME, "cu_q", cu_q, ndim=1, dtypes=INT_DTYPES, contiguous=True)
    if not isinstance(pages, PagedKVTable):
        raise ValueError(f"{_NAME}: pages must be a PagedKVTable, got {type(pages).__name__}")
    if cu_q.shape[0] == 0 or cu_q.shape != pages.cu_pages.shape:
        raise ValueError(
            f"{_NAME}: cu_q has shape {tuple(cu_q.shape)} and cu_pages has shape "
            f"{tuple(pages.cu_pages.shape)}; both must be [B + 1] for the same B"
        )
    # NOTE: > 0 so the row max of the scaled scores is the scaled row max (one FMA per score).
    check_real(_NAME, "sm_scale", sm_scale, positive=True)
    check_hint(_NAME, "max_q_len", max_q_len)
    if out_dtype not in KV_DTYPES:
        raise ValueError(f"{_NAME}: out_dtype must be one of {KV_DTYPES}, got {out_dtype!r}")
    return check_same_device(
        _NAME,
        q=q,
        q_pos=q_pos,
        cu_q=cu_q,
        k_cache=k_cache,
        v_cache=v_cache,
        pages=pages.page_table,
    )


def _read_sizes(
    cu_q: torch.Tensor, pages: PagedKVTable, n_tokens: int, page_size: int, num_cache_pages: int
) -> int:
    """Read the offsets' ends and the longest sequence from the device (one sync) and check the
    offsets, page ids and page lengths while at it.

    Returns:
        The longest sequence's query count.

    Raises:
        ValueError: offsets that do not start at 0, fall, or end off the tensors' lengths;
            page ids outside the cache's ``[0, num_cache_pages)``; page lengths outside
            ``[0, page_size]``.
    """
    cu_q64, cu_p64 = cu_q.to(torch.int64), pages.cu_pages.to(torch.int64)
    q_lens, p_lens = cu_q64.diff(), cu_p64.diff()
    zero = cu_q64.new_zeros(())
    lens = pages.page_len.to(torch.int64)
    ids = pages.page_table.to(torch.int64)
    stats = torch.stack(
        (
            cu_q64[0],
            cu_q64[-1],
            q_lens.min() if q_lens.numel() else zero,
            q_lens.max() if q_lens.numel() else zero,
            cu_p64[0],
            cu_p64[-1],
            p_lens.min() if p_lens.numel() else zero,
            lens.min() if lens.numel() else zero,
            lens.max() if lens.numel() else zero,
            ids.min() if ids.numel() else zero,
            ids.max() if ids.numel() else zero,
        )
    )
    q0, q1, q_min, q_max, p0, p1, p_min, len_min, len_max, id_min, id_max = stats.tolist()
    # NOTE: an id out of range reads another page (a negative one, from the end) or past the
    # cache (garbage, or a fault) in the kernel.
    if ids.numel() and (id_min < 0 or id_max >= num_cache_pages):
        raise ValueError(
            f"{_NAME}: page_table ids must lie in [0, {num_cache_pages}) (the cache's pages), "
            f"got min {id_min} and max {id_max}"
        )
    n_pages = pages.num_pages
    if q0 != 0 or q1 != n_tokens or q_min < 0:
        raise ValueError(f"{_NAME}: cu_q {cu_q.tolist()} must rise from 0 to q's {n_tokens} tokens")
    if p0 != 0 or p1 != n_pages or p_min < 0:
        raise ValueError(
            f"{_NAME}: cu_pages {pages.cu_pages.tolist()} must rise from 0 to the {n_pages} pages "
            "of page_table"
        )
    if len_min < 0 or len_max > page_size:
        raise ValueError(
            f"{_NAME}: page_len values must lie in [0, page_size={page_size}], got "
            f"min {len_min} and max {len_max}"
        )
    return q_max


def _block_map(cu_q: torch.Tensor, block_t: int, n_grid: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each program's sequence (varlen grid, like flash-attn's): all on the device, no sync.

    Args:
        cu_q: [B + 1] query offsets.
        block_t: query tokens per block.
        n_grid: programs on grid axis 0 (at least the total block count).

    Returns:
        (block_seq int32 [n_grid]: the sequence of program i, B for idle programs;
        cu_blocks int64 [B]: inclusive cumsum of blocks per sequence).
    """
    q_lens = cu_q[1:].to(torch.int64) - cu_q[:-1]
    cu_blocks = torch.cumsum((q_lens + (block_t - 1)) // block_t, 0)
    ids = torch.arange(n_grid, device=cu_q.device, dtype=torch.int64)
    return torch.searchsorted(cu_blocks, ids, right=True, out_int32=True), cu_blocks


def paged_partial_attention(
    q: torch.Tensor,
    q_pos: torch.Tensor,
    cu_q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    pages: PagedKVTable,
    sm_scale: float,
    *,
    max_q_len: int | None = None,
    out_dtype: torch.dtype = torch.float32,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of queries with global positions over the pages one lane holds, causal by
    position, with its log-sum-exp (merge lanes' partials with :func:`merge_attn_states`).

    Queries and pages are grouped by sequence: sequence ``b`` owns queries
    ``cu_q[b]:cu_q[b+1]`` and its pages of ``pages`` (see :class:`PagedKVTable`); a query at
    position ``p`` sees the keys of its own sequence at positions ``<= p``. The shard is read
    in place through the page table (FA2-style online softmax in fp32, exp2 domain); the key
    range of each block of queries is bounded first, so pages past its last position cost
    nothing and pages every query of the block fully sees run without masks (fastest when a
    sequence's pages come in position order).

    Args:
        q: ``[Tq, Hq, D]`` queries (fp16/bf16/fp32), unit stride on D.
        q_pos: ``int64 [Tq]`` global position of each query.
        cu_q: ``int32/int64 [B + 1]`` query offsets per sequence (non-decreasing, from 0).
        k_cache: ``[P, page_size, Hkv, D]`` contiguous, dtype of ``q``; ``Hq % Hkv == 0``
            (GQA: query head ``h`` reads KV head ``h // (Hq // Hkv)``).
        v_cache: like ``k_cache``.
        pages: the sequences' pages in the shard, on its device; ``B`` sequences, as ``cu_q``.
        sm_scale: softmax scale > 0 (usually ``D ** -0.5``).
        max_q_len: optional host-side bound on the longest sequence's query count (any upper
            bound works; larger only adds idle programs). Given, the launch needs no device
            sync; without it the launcher reads the offsets once and checks them.
        out_dtype: dtype of ``out``: fp32 (default) for partials that will be merged; the
            model dtype when this is the whole attention (one lane), which saves writing fp32
            and casting it after (the kernel accumulates in fp32 either way).

    Returns:
        ``(out, lse)``: ``out`` ``[Tq, Hq, D]`` in ``out_dtype``, normalised over the visible
        keys, ``lse`` fp32 ``[Tq, Hq]`` natural-log sum of ``exp(sm_scale * q.k)`` over them;
        where a query sees no key, ``out`` is 0 and ``lse`` is ``-inf``.

    Raises:
        ValueError: bad shapes, dtypes, devices or strides; and, without ``max_q_len``,
            offsets that do not match the tensors, page ids outside the cache's pages or page
            lengths outside ``[0, page_size]``.

    NOTE: with ``max_q_len`` given nothing is value-checked (that needs a device sync): offsets
    must cover ``q`` and the page table exactly and page ids / lengths be in range, or queries
    are left unwritten and the kernel reads out of bounds.
    """
    device = _validate(q, q_pos, cu_q, k_cache, v_cache, pages, sm_scale, max_q_len, out_dtype)
    tq, hq, d = q.shape
    page_size, hkv = k_cache.shape[1], k_cache.shape[2]
    n_seqs = cu_q.shape[0] - 1
    if max_q_len is None:
        max_q_len = _read_sizes(cu_q, pages, tq, page_size, k_cache.shape[0])
    if tq == 0 or d == 0 or n_seqs == 0 or max_q_len == 0:
        out = torch.zeros((tq, hq, d), dtype=out_dtype, device=device)
        return out, torch.full((tq, hq), float("-inf"), dtype=torch.float32, device=device)
    if not use_triton(_NAME, device):
        out, lse = naive.paged_partial_attention(q, q_pos, cu_q, k_cache, v_cache, pages, sm_scale)
        return out.to(out_dtype), lse

    group = hq // hkv
    # NOTE: Triton's interpreter (3.9) multiplies the raw bit patterns of bf16 tiles in tl.dot;
    # there the tiles go to fp32 first (so P is not rounded to bf16 as it is on the GPU).
    upcast = q.dtype == torch.bfloat16 and interpreter_enabled()
    tma = paged_attention_tma.tma_supported(q, k_cache, v_cache)
    if tma:
        cfg = paged_attention_tma.config_for(d, page_size, group, max_q_len)
    else:
        cfg = config_for(q.dtype, d, group, max_q_len)
    block_t = cfg.block_m // cfg.heads_per_program
    # NOTE: sum over sequences of cdiv(len, block_t) <= tq // block_t + B, so this bound
    # covers every block without reading the lengths.
    n_grid = min(tq // block_t + n_seqs, n_seqs * cdiv(max_q_len, block_t))
    block_seq, cu_blocks = _block_map(cu_q, block_t, n_grid)
    # NOTE: the kernel's store rounds the fp32 accumulator to out's dtype.
    out = torch.empty((tq, hq, d), dtype=out_dtype, device=device)
    lse = torch.empty((tq, hq), dtype=torch.float32, device=device)
    grid = (n_grid, hq // cfg.heads_per_program)
    if tma:
        paged_attention_tma.launch(
            cfg, grid, q, q_pos, cu_q, k_cache, v_cache, pages, block_seq, cu_blocks, out, lse,
            sm_scale * LOG2E, upcast,
        )  # fmt: skip
        return out, lse
    for_current_mode(_paged_attention_kernel)[grid](
        q,
        q_pos,
        cu_q,
        k_cache,
        v_cache,
        pages.page_table,
        pages.page_pos,
        pages.page_len,
        pages.cu_pages,
        block_seq,
        cu_blocks,
        out,
        lse,
        sm_scale * LOG2E,
        n_seqs,
        q.stride(0),
        q.stride(1),
        N_HEADS=hq,
        GROUP=group,
        KV_ROW=hkv * d,
        PAGE_SIZE=page_size,
        HEAD_DIM=d,
        BLOCK_D=max(MIN_DOT, next_power_of_2(d)),
        HP=cfg.heads_per_program,
        BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n,
        SCAN=SCAN_BLOCK,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 or upcast else "tf32",
        UPCAST=upcast,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )
    return out, lse
