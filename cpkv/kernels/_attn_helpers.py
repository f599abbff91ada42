"""``@triton.jit`` helpers shared by the prefill and decode attention kernels: a program's
query block, the key range it sees through the page list, the online softmax's tile step
and its end."""

from __future__ import annotations

from cpkv.kernels._common import HAS_TRITON, tl, triton

if HAS_TRITON:

    @triton.jit
    def query_block(pid, seq, cu_q_ptr, cu_blocks_ptr, BLOCK_T: tl.constexpr):
        # Program pid's query block of sequence seq (< n_seqs: the caller returns first on an
        # idle program's): (first token, end of the sequence's tokens). Blocks run last first
        # within a sequence: with positions rising through it, the blocks that see the most
        # keys start first and the short ones fill the grid's tail.
        q_start = tl.load(cu_q_ptr + seq).to(tl.int32)
        q_end = tl.load(cu_q_ptr + seq + 1).to(tl.int32)
        n_blk = (q_end - q_start + BLOCK_T - 1) // BLOCK_T
        local = pid - (tl.load(cu_blocks_ptr + seq).to(tl.int32) - n_blk)
        t0 = q_start + (n_blk - 1 - local) * BLOCK_T
        return t0, q_end

    @triton.jit
    def key_range(
        seq,
        q_min,
        q_max,
        cu_pages_ptr,
        page_pos_ptr,
        page_len_ptr,
        PAGE_SIZE: tl.constexpr,
        SCAN: tl.constexpr,
    ):
        # The page-list range [lo, hi] spanning every page with a slot at a position <= q_max
        # (pages outside it hold no key any query of the block sees), and mid: pages
        # [lo, mid) are full and end at or before q_min (every query sees all their keys).
        p_start = tl.load(cu_pages_ptr + seq).to(tl.int32)
        p_end = tl.load(cu_pages_ptr + seq + 1).to(tl.int32)
        lo = p_end
        hi = p_start - 1
        for c in range(p_start, p_end, SCAN):
            idx = c + tl.arange(0, SCAN)
            in_seq = idx < p_end
            ppos = tl.load(page_pos_ptr + idx, mask=in_seq, other=0)
            plen = tl.load(page_len_ptr + idx, mask=in_seq, other=0)
            seen = in_seq & (plen > 0) & (ppos <= q_max)
            lo = tl.minimum(lo, tl.min(tl.where(seen, idx, p_end), axis=0))
            hi = tl.maximum(hi, tl.max(tl.where(seen, idx, p_start - 1), axis=0))
        hi = tl.maximum(hi, lo - 1)  # no page seen: an empty range at lo
        mid = hi + 1
        for c in range(lo, hi + 1, SCAN):
            idx = c + tl.arange(0, SCAN)
            in_range = idx <= hi
            ppos = tl.load(page_pos_ptr + idx, mask=in_range, other=0)
            plen = tl.load(page_len_ptr + idx, mask=in_range, other=0)
            partly = in_range & ((plen < PAGE_SIZE) | (ppos + (PAGE_SIZE - 1) > q_min))
            mid = tl.minimum(mid, tl.min(tl.where(partly, idx, hi + 1), axis=0))
        return lo, mid, hi

    @triton.jit
    def softmax_tile(qk, m_i, l_i, visible, qk_scale, MASK: tl.constexpr):
        # One key tile's step of the online softmax on its raw scores qk = q.k (exp2 domain
        # after qk_scale): returns (p, alpha, l_i, m_new); the caller rescales its output by
        # alpha and adds p @ v. With MASK, scores where not visible are dropped.
        if MASK:
            qk = tl.where(visible, qk * qk_scale, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(qk, 1))
            # A row that has seen nothing yet keeps m = -inf; shift it by 0 so exp2 gives 0s.
            m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
            p = tl.math.exp2(qk - m_use[:, None])
            alpha = tl.math.exp2(m_i - m_use)
        else:
            # Every score is finite here: scale the row max, not each score (one FMA each).
            m_new = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)
            p = tl.math.exp2(qk * qk_scale - m_new[:, None])
            alpha = tl.math.exp2(m_i - m_new)
        return p, alpha, l_i * alpha + tl.sum(p, 1), m_new

    @triton.jit
    def finish_softmax(acc, l_i, m_i):
        # The online softmax's end: (out normalised over the keys seen, natural-log LSE); rows
        # that saw no key give 0 and -inf. m_i is in the exp2 domain.
        seen = l_i > 0.0
        out = acc / tl.where(seen, l_i, 1.0)[:, None]
        lse = tl.where(
            seen, (m_i + tl.math.log2(tl.where(seen, l_i, 1.0))) * 0.6931471805599453, float("-inf")
        )
        return out, lse
