"""Decode attention (one query per sequence) over a lane's paged KV shard, split over the keys.

Flash-decoding: each program takes one sequence, one KV head (with its GQA group of query
heads packed into the tile's rows) and one of ``num_splits`` key ranges, walks that range
through the sequence's row of a block table and writes a partial (fp32 output normalised over
its keys, and their log-sum-exp); :func:`merge_attn_states` combines the splits. Every size the
launch depends on is a host-side constant (batch, heads, splits) and every length is read on
the device, so a launch records into a CUDA graph and replays for any context length.
"""

from __future__ import annotations

import torch

from cpkv.kernels import naive
from cpkv.kernels._common import (
    HAS_TRITON,
    INT_DTYPES,
    KV_DTYPES,
    cdiv,
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
from cpkv.kernels.merge_attn_states import merge_attn_states

if HAS_TRITON:
    from cpkv.kernels._attn_helpers import finish_softmax

__all__ = ["decode_splits", "num_sms", "paged_decode_attention"]

_NAME = "paged_decode_attention"

LOG2E = 1.4426950408889634
# NOTE: tl.dot needs every tile dim >= 16.
MIN_DOT = 16
# Keys per inner iteration: 64 rows of K and V (8 KiB each at D=64 bf16) per step; decode is
# bound by reading the cache, and a 64-key tile keeps each program's loads in flight.
BLOCK_N = 64
NUM_WARPS = 4
# Programs a launch aims at, per SM: enough splits that a batch of one fills the GPU.
PROGRAMS_PER_SM = 4
MAX_SPLITS = 64


def decode_splits(batch: int, num_kv_heads: int, num_sms: int) -> int:
    """How many key splits fill ``num_sms`` SMs ``PROGRAMS_PER_SM`` deep for this batch.

    Args:
        batch: sequences in the launch.
        num_kv_heads: KV heads (one program per sequence x KV head x split).
        num_sms: the device's SM count (see :func:`num_sms`).

    Returns:
        A split count in ``[1, MAX_SPLITS]``.
    """
    return max(1, min(MAX_SPLITS, cdiv(PROGRAMS_PER_SM * num_sms, max(1, batch * num_kv_heads))))


def num_sms(device: torch.device) -> int:
    """The device's SM count (1 for a CPU: the interpreter runs one program at a time)."""
    if device.type != "cuda":
        return 1
    return torch.cuda.get_device_properties(device).multi_processor_count


if HAS_TRITON:

    @triton.jit
    def _paged_decode_kernel(
        q_ptr,  # [B, Hq, D], unit stride on D
        k_ptr,  # [P, PAGE_SIZE, Hkv, D] contiguous
        v_ptr,  # [P, PAGE_SIZE, Hkv, D] contiguous
        table_ptr,  # [B, W] local page ids, unit stride on W
        seq_lens_ptr,  # [B] keys each sequence's query sees (positions 0 .. len - 1)
        out_ptr,  # [S, B, Hq, D] fp32 contiguous: each split's output
        lse_ptr,  # [S, B, Hq] fp32 contiguous: each split's log-sum-exp
        qk_scale,  # sm_scale * log2(e): scores in the exp2 domain
        n_seqs,
        stride_qb,
        stride_qh,
        stride_tb,
        N_HEADS: tl.constexpr,  # Hq
        GROUP: tl.constexpr,  # Hq // Hkv
        BLOCK_G: tl.constexpr,  # next power of two >= max(GROUP, 16)
        KV_ROW: tl.constexpr,  # Hkv * D: one slot's stride in the shard
        PAGE_SIZE: tl.constexpr,
        HEAD_DIM: tl.constexpr,
        BLOCK_D: tl.constexpr,
        BLOCK_N: tl.constexpr,
        DOT_PRECISION: tl.constexpr,
        UPCAST: tl.constexpr,  # fp32 copies of the tiles (the interpreter with bf16)
    ):
        seq = tl.program_id(0)
        kv_head = tl.program_id(1)
        split = tl.program_id(2)
        n_splits = tl.num_programs(2)
        seq_len = tl.load(seq_lens_ptr + seq).to(tl.int32)
        # Whole tiles per split, so only a split's last tile (the sequence's end) is partial.
        # NOTE: plain integer arithmetic, not tl.cdiv (a jit helper of triton's own: a kernel
        # rebuilt for the interpreter after triton was imported compiled cannot call it).
        per_split = ((seq_len + n_splits - 1) // n_splits + BLOCK_N - 1) // BLOCK_N * BLOCK_N
        start = split * per_split
        end = tl.minimum(start + per_split, seq_len)

        g = tl.arange(0, BLOCK_G)
        d = tl.arange(0, BLOCK_D)
        g_ok = g < GROUP
        d_ok = d < HEAD_DIM
        head = kv_head * GROUP + g
        q_off = seq.to(tl.int64) * stride_qb + head * stride_qh
        q = tl.load(q_ptr + q_off[:, None] + d[None, :], mask=g_ok[:, None] & d_ok[None, :])
        if UPCAST:
            q = q.to(tl.float32)
        kv_base = kv_head * HEAD_DIM + d
        table = table_ptr + seq.to(tl.int64) * stride_tb

        m_i = tl.full([BLOCK_G], float("-inf"), dtype=tl.float32)
        l_i = tl.full([BLOCK_G], 0.0, dtype=tl.float32)
        acc = tl.full([BLOCK_G, BLOCK_D], 0.0, dtype=tl.float32)
        for row0 in range(start, end, BLOCK_N):
            rows = row0 + tl.arange(0, BLOCK_N)
            ok = rows < end
            page = tl.load(table + rows // PAGE_SIZE, mask=ok, other=0).to(tl.int64)
            slot = page * PAGE_SIZE + rows % PAGE_SIZE
            kv_off = (slot * KV_ROW)[:, None] + kv_base[None, :]
            kv_mask = ok[:, None] & d_ok[None, :]
            k = tl.load(k_ptr + kv_off, mask=kv_mask, other=0.0)
            v = tl.load(v_ptr + kv_off, mask=kv_mask, other=0.0)
            if UPCAST:
                k = k.to(tl.float32)
                v = v.to(tl.float32)
            qk = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale
            qk = tl.where(ok[None, :], qk, float("-inf"))
            # NOTE: every tile holds at least one key (row0 < end), so m_new is finite.
            m_new = tl.maximum(m_i, tl.max(qk, 1))
            p = tl.math.exp2(qk - m_new[:, None])
            alpha = tl.math.exp2(m_i - m_new)
            l_i = l_i * alpha + tl.sum(p, 1)
            acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=DOT_PRECISION)
            m_i = m_new

        out, lse = finish_softmax(acc, l_i, m_i)
        row = (split.to(tl.int64) * n_seqs + seq) * N_HEADS + head
        tl.store(
            out_ptr + (row * HEAD_DIM)[:, None] + d[None, :],
            out,
            mask=g_ok[:, None] & d_ok[None, :],
        )
        tl.store(lse_ptr + row, lse, mask=g_ok)


def _validate(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    sm_scale: float,
    num_splits: int | None,
) -> torch.device:
    q = check_tensor(_NAME, "q", q, ndim=3, dtypes=KV_DTYPES)
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
        check_tensor(_NAME, name, t, ndim=4, dtypes=(q.dtype,), contiguous=True)
    check_tensor(_NAME, "block_table", block_table, ndim=2, dtypes=INT_DTYPES)
    check_tensor(_NAME, "seq_lens", seq_lens, ndim=1, dtypes=INT_DTYPES, contiguous=True)
    b, hq, d = q.shape
    if k_cache.shape != v_cache.shape:
        raise ValueError(
            f"{_NAME}: k_cache {tuple(k_cache.shape)} and v_cache {tuple(v_cache.shape)} differ"
        )
    hkv = k_cache.shape[2]
    if k_cache.shape[1] < 1:
        raise ValueError(f"{_NAME}: page_size {k_cache.shape[1]} (k_cache dim 1) must be >= 1")
    if k_cache.shape[3] != d or hkv == 0 or hq % hkv:
        raise ValueError(
            f"{_NAME}: q {tuple(q.shape)} does not fit the cache {tuple(k_cache.shape)} "
            "(need one head dim and Hq % Hkv == 0)"
        )
    if block_table.shape[0] != b or seq_lens.shape[0] != b:
        raise ValueError(
            f"{_NAME}: {b} queries but block_table {tuple(block_table.shape)} and seq_lens "
            f"{tuple(seq_lens.shape)}"
        )
    if b and d > 1 and q.stride(2) != 1:
        raise ValueError(f"{_NAME}: q must have unit stride on D, got strides {q.stride()}")
    if block_table.shape[1] > 1 and block_table.stride(1) != 1:
        raise ValueError(
            f"{_NAME}: block_table must have unit stride on pages, got {block_table.stride()}"
        )
    check_real(_NAME, "sm_scale", sm_scale, positive=True)
    if num_splits is not None and (
        isinstance(num_splits, bool) or not isinstance(num_splits, int) or num_splits < 1
    ):
        raise ValueError(f"{_NAME}: num_splits={num_splits!r} must be an int >= 1")
    return check_same_device(
        _NAME, q=q, k_cache=k_cache, v_cache=v_cache, block_table=block_table, seq_lens=seq_lens
    )


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    sm_scale: float,
    *,
    num_splits: int | None = None,
) -> torch.Tensor:
    """Attention of one query per sequence over that sequence's keys in a paged shard.

    Sequence ``b``'s query sees the keys at positions ``0 .. seq_lens[b] - 1``; position ``p``
    sits in local page ``block_table[b, p // page_size]`` at slot ``p % page_size`` (a cp=1
    lane's layout: every page of the sequence is local). The launch reads no length back, so
    it records into a CUDA graph: lengths and the table may change between replays.

    Args:
        q: ``[B, Hq, D]`` queries (fp16/bf16/fp32), unit stride on D.
        k_cache, v_cache: ``[P, page_size, Hkv, D]`` contiguous, dtype of ``q``; ``Hq % Hkv
            == 0`` (query head ``h`` reads KV head ``h // (Hq // Hkv)``).
        block_table: ``int32/int64 [B, W]`` local page ids, unit stride on ``W``; row ``b``
            needs ``ceil(seq_lens[b] / page_size)`` valid entries (the rest is not read).
        seq_lens: ``int32/int64 [B]`` keys per sequence, each in ``[1, W * page_size]``.
        sm_scale: softmax scale > 0.
        num_splits: key splits (default :func:`decode_splits` for this device and batch);
            fix it when recording a graph.

    Returns:
        fp32 ``[B, Hq, D]``.

    Raises:
        ValueError: bad shapes, dtypes, devices or strides.

    NOTE: lengths and page ids are not range-checked (that needs a device sync).
    """
    device = _validate(q, k_cache, v_cache, block_table, seq_lens, sm_scale, num_splits)
    b, hq, d = q.shape
    page_size, hkv = k_cache.shape[1], k_cache.shape[2]
    if b == 0 or d == 0:
        return torch.zeros((b, hq, d), dtype=torch.float32, device=device)
    if not use_triton(_NAME, device):
        return naive.paged_decode_attention(q, k_cache, v_cache, block_table, seq_lens, sm_scale)
    if num_splits is None:
        num_splits = decode_splits(b, hkv, num_sms(device))
    group = hq // hkv
    upcast = q.dtype == torch.bfloat16 and interpreter_enabled()
    outs = torch.empty((num_splits, b, hq, d), dtype=torch.float32, device=device)
    lses = torch.empty((num_splits, b, hq), dtype=torch.float32, device=device)
    for_current_mode(_paged_decode_kernel)[(b, hkv, num_splits)](
        q,
        k_cache,
        v_cache,
        block_table,
        seq_lens,
        outs,
        lses,
        sm_scale * LOG2E,
        b,
        q.stride(0),
        q.stride(1),
        block_table.stride(0),
        N_HEADS=hq,
        GROUP=group,
        BLOCK_G=max(MIN_DOT, next_power_of_2(group)),
        KV_ROW=hkv * d,
        PAGE_SIZE=page_size,
        HEAD_DIM=d,
        BLOCK_D=max(MIN_DOT, next_power_of_2(d)),
        BLOCK_N=BLOCK_N if d <= 128 else BLOCK_N // 2,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 or upcast else "tf32",
        UPCAST=upcast,
        num_warps=NUM_WARPS,
    )
    if num_splits == 1:
        return outs[0]
    return merge_attn_states(outs, lses)[0]
