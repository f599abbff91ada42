"""Plain-torch references for the kernels; also the fallback when Triton cannot run.

Same signatures as the launchers in :mod:`cpkv.kernels`. Vectorised torch (no Python loop per
token); the launchers validate shapes and dtypes before calling these, and these check the
value-level consistency (sizes that sum up) that is cheap for them to see.
"""

from __future__ import annotations

import torch

from cpkv.kernels.page_table import PagedKVTable

__all__ = [
    "gather_kv",
    "merge_attn_states",
    "paged_decode_attention",
    "paged_partial_attention",
    "rms_norm",
    "rope_qkv",
    "store_kv",
]


def store_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    k_shard: torch.Tensor,
    v_shard: torch.Tensor,
    local_slots: torch.Tensor,
) -> None:
    """Reference for :func:`cpkv.kernels.store_kv`."""
    keep = local_slots >= 0
    slots = local_slots[keep]
    for src, shard in ((k, k_shard), (v, v_shard)):
        shard.view(-1, *shard.shape[2:])[slots] = src[keep]


def gather_kv(
    k_shard: torch.Tensor, v_shard: torch.Tensor, local_slots: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference for :func:`cpkv.kernels.gather_kv`."""
    keep = local_slots >= 0
    slots = local_slots[keep]
    out = []
    for shard in (k_shard, v_shard):
        rows = shard.new_zeros((local_slots.numel(), *shard.shape[2:]))
        rows[keep] = shard.reshape(-1, *shard.shape[2:])[slots]
        out.append(rows)
    return out[0], out[1]


def paged_partial_attention(
    q: torch.Tensor,
    q_pos: torch.Tensor,
    cu_q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    pages: PagedKVTable,
    sm_scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference for :func:`cpkv.kernels.paged_partial_attention`: attention of queries with
    global positions over the pages one lane holds, causal by position, with its log-sum-exp.

    Queries and pages are grouped by sequence: sequence ``b`` owns queries
    ``cu_q[b]:cu_q[b+1]`` and its pages of ``pages`` (see :class:`PagedKVTable`); a query at
    position ``p`` sees the keys of its own sequence at positions ``<= p``.

    Args:
        q: ``[Tq, Hq, D]`` queries (fp16/bf16/fp32).
        q_pos: ``int64 [Tq]`` global position of each query.
        cu_q: ``int32/int64 [B + 1]`` query offsets per sequence (non-decreasing, from 0).
        k_cache, v_cache: ``[P, page_size, Hkv, D]`` the lane's shard; ``Hq % Hkv == 0`` (GQA:
            query head ``h`` reads KV head ``h // (Hq // Hkv)``).
        pages: the sequences' pages in the shard.
        sm_scale: softmax scale (usually ``D ** -0.5``).

    Returns:
        ``(out, lse)``: ``out`` fp32 ``[Tq, Hq, D]`` normalised over the visible keys, ``lse``
        fp32 ``[Tq, Hq]`` natural-log sum of ``exp(scale * q.k)`` over them; where a query sees
        no key, ``out`` is 0 and ``lse`` is ``-inf``.
    """
    tq, hq, d = q.shape
    ps, hkv = k_cache.shape[1], k_cache.shape[2]
    group = hq // hkv
    out = torch.zeros(tq, hq, d, dtype=torch.float32, device=q.device)
    lse = torch.full((tq, hq), float("-inf"), dtype=torch.float32, device=q.device)
    cu_q_l, cu_p_l = cu_q.tolist(), pages.cu_pages.tolist()
    for b in range(len(cu_q_l) - 1):
        q0, q1, p0, p1 = cu_q_l[b], cu_q_l[b + 1], cu_p_l[b], cu_p_l[b + 1]
        if q1 == q0 or p1 == p0:
            continue
        local = pages.page_table[p0:p1].to(torch.int64)
        # Keys of this sequence on this lane, flattened page by page: [n_pages * ps, Hkv, D].
        k = k_cache[local].reshape(-1, hkv, d).float()
        v = v_cache[local].reshape(-1, hkv, d).float()
        offs = torch.arange(ps, device=q.device)
        kpos = (pages.page_pos[p0:p1].to(torch.int64)[:, None] + offs).reshape(-1)
        kvalid = (offs[None, :] < pages.page_len[p0:p1].to(torch.int64)[:, None]).reshape(-1)
        # NOTE: slots past a page's length may hold anything (NaN included); p there is 0, but
        # 0 * NaN is NaN, so their values never reach the product.
        v = v.masked_fill(~kvalid[:, None, None], 0.0)
        k = k.repeat_interleave(group, dim=1)  # [K, Hq, D]
        v = v.repeat_interleave(group, dim=1)
        qb = q[q0:q1].float()
        scores = torch.einsum("qhd,khd->hqk", qb, k) * sm_scale  # [Hq, Tb, K]
        visible = kvalid[None, :] & (kpos[None, :] <= q_pos[q0:q1].to(torch.int64)[:, None])
        scores = scores.masked_fill(~visible[None], float("-inf"))
        m = scores.amax(dim=-1, keepdim=True)  # [Hq, Tb, 1]
        m_safe = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
        p = torch.exp(scores - m_safe)
        s = p.sum(dim=-1, keepdim=True)
        o = torch.einsum("hqk,khd->qhd", p / s.clamp(min=1e-30), v)
        seen = visible.any(dim=-1)  # [Tb]
        out[q0:q1] = torch.where(seen[:, None, None], o, torch.zeros_like(o))
        lse_b = (m_safe + torch.log(s.clamp(min=1e-30))).squeeze(-1).transpose(0, 1)  # [Tb, Hq]
        lse[q0:q1] = torch.where(seen[:, None], lse_b, torch.full_like(lse_b, float("-inf")))
    return out, lse


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    sm_scale: float,
) -> torch.Tensor:
    """Reference for :func:`cpkv.kernels.paged_decode_attention`: one query per sequence over
    the keys at positions ``0 .. seq_lens[b] - 1``, read through ``block_table``; fp32
    ``[B, Hq, D]``."""
    b, hq, d = q.shape
    ps, hkv = k_cache.shape[1], k_cache.shape[2]
    out = torch.empty(b, hq, d, dtype=torch.float32, device=q.device)
    for i, n in enumerate(seq_lens.tolist()):
        pos = torch.arange(n, device=q.device)
        slots = block_table[i].to(torch.int64)[pos // ps] * ps + pos % ps
        k = k_cache.reshape(-1, hkv, d)[slots].float().repeat_interleave(hq // hkv, dim=1)
        v = v_cache.reshape(-1, hkv, d)[slots].float().repeat_interleave(hq // hkv, dim=1)
        p = torch.softmax(torch.einsum("hd,khd->hk", q[i].float(), k) * sm_scale, dim=-1)
        out[i] = torch.einsum("hk,khd->hd", p, v)
    return out


def merge_attn_states(outs: torch.Tensor, lses: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference for :func:`cpkv.kernels.merge_attn_states`: combine partial attentions.

    Args:
        outs: ``[L, T, H, D]`` partial outputs (each normalised over its own keys).
        lses: ``fp32 [L, T, H]`` their log-sum-exps (``-inf``: that part saw no key; its
            output is ignored).

    Returns:
        ``(out, lse)``: fp32 ``[T, H, D]`` and ``[T, H]``, exactly the attention over the
        union of the parts' keys; 0 and ``-inf`` where no part saw a key.
    """
    lses = lses.float()
    m = lses.amax(dim=0)  # [T, H]
    m_safe = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    w = torch.exp(lses - m_safe[None])  # 0 for -inf parts
    s = w.sum(dim=0)  # [T, H]
    # A part that saw no key (w == 0) adds nothing, whatever its output holds.
    parts = torch.where(w[..., None] > 0, w[..., None] * outs.float(), 0.0)
    out = parts.sum(dim=0) / s.clamp(min=1e-30)[..., None]
    lse = torch.where(s > 0, m_safe + torch.log(s.clamp(min=1e-30)), torch.full_like(s, -torch.inf))
    return out, lse


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Reference for :func:`cpkv.kernels.rms_norm` (transformers' ``LlamaRMSNorm``)."""
    xf = x.to(torch.float32)
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def rope_qkv(
    qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, num_heads: int, num_kv_heads: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Reference for :func:`cpkv.kernels.rope_qkv` (transformers' ``apply_rotary_pos_emb``)."""
    t, d = qkv.shape[0], cos.shape[1]
    q, k, v = qkv.split([num_heads * d, num_kv_heads * d, num_kv_heads * d], dim=-1)
    q, k = q.view(t, num_heads, d), k.view(t, num_kv_heads, d)
    c, s = cos[:, None, :], sin[:, None, :]

    def rotate_half(x: torch.Tensor) -> torch.Tensor:
        return torch.cat((-x[..., d // 2 :], x[..., : d // 2]), dim=-1)

    q = q * c + rotate_half(q) * s
    k = k * c + rotate_half(k) * s
    return q, k, v.reshape(t, num_kv_heads, d).contiguous()
