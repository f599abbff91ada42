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
    def exp2_poly(x):
        # 2**x for finite x <= 0 on the FMA pipe, not the MUFU's 16 exponentials a clock an
        # SM (FlashAttention-4's trick): x = j + f with j = round(x), f in [-0.5, 0.5]; 2**f
        # by a degree-3 polynomial (max relative error 7.5e-5, fitted in fp64 and checked in
        # fp32; a bf16 P rounds at 3.9e-3), and j added to its exponent bits. x is clamped
        # to -126 first (below it the true value is < 1.2e-38: the exponent must not wrap).
        x = tl.maximum(x, -126.0)
        t = x + 12582912.0  # 1.5 * 2**23: the sum's low mantissa bits hold round(x)
        f = x - (t - 12582912.0)
        p = tl.fma(f, 0.05517134442925453, 0.24261033535003662)
        p = tl.fma(p, f, 0.6932609677314758)
        p = tl.fma(p, f, 0.9999281167984009)
        # NOTE: t's bits are 0x4B400000 + j, and 0x4B400000 << 23 wraps to 0: (bits(t) << 23)
        # is j << 23.
        bits = p.to(tl.int32, bitcast=True) + (t.to(tl.int32, bitcast=True) << 23)
        return bits.to(tl.float32, bitcast=True)

    @triton.jit
    def exp2_split(x, POLY: tl.constexpr):
        # exp2 of a [rows, cols] tile of finite x <= 0, 1 in POLY columns (0: none; 2 or 4)
        # by exp2_poly so both pipes share the work. NOTE: a thread holds an MMA result's
        # columns in adjacent pairs, one pair in each 8 columns: splitting on bit 0 of the
        # column (odd ones to the polynomial) and then on bit 3 moves no data (sm_90a:
        # same shared memory as exp2 alone; a second split on bit 1 adds 15 KB of it).
        if POLY == 0:
            return tl.math.exp2(x)
        rows: tl.constexpr = x.shape[0]
        cols: tl.constexpr = x.shape[1]
        a, b = tl.split(tl.reshape(x, [rows, cols // 2, 2]))
        if POLY == 2:
            pb = exp2_poly(b)
        else:
            # b's column j is x's 2j + 1; j's bit 2 is x's column bit 3.
            b4 = tl.permute(tl.reshape(b, [rows, cols // 16, 2, 4]), (0, 1, 3, 2))
            b0, b1 = tl.split(b4)
            pb4 = tl.join(tl.math.exp2(b0), exp2_poly(b1))
            pb = tl.reshape(tl.permute(pb4, (0, 1, 3, 2)), [rows, cols // 2])
        return tl.reshape(tl.join(tl.math.exp2(a), pb), [rows, cols])

    @triton.jit
    def softmax_tile(
        qk, m_i, l_i, visible, qk_scale, MASK: tl.constexpr, EXP_POLY: tl.constexpr = 0
    ):
        # One key tile's step of the online softmax on its raw scores qk = q.k (exp2 domain
        # after qk_scale): returns (p, alpha, l_i, m_new); the caller rescales its output by
        # alpha and adds p @ v. With MASK, scores where not visible are dropped. EXP_POLY:
        # see exp2_split (unmasked tiles only: their scores are all finite).
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
            p = exp2_split(qk * qk_scale - m_new[:, None], EXP_POLY)
            alpha = tl.math.exp2(m_i - m_new)
        return p, alpha, l_i * alpha + tl.sum(p, 1), m_new

    @triton.jit
    def softmax_tile_lazy(qk, m_i, l_i, acc, qk_scale, EXP_POLY: tl.constexpr = 0):
        # softmax_tile's unmasked step that rescales the output only when some row's max
        # grew by more than 8 (FlashAttention-4's trick): else the stale max stays the
        # reference, so p <= 2**8 (exact in bf16 / fp16, its sums far from fp32's range) and
        # out = acc / l and LSE = m + log2(l) are unchanged. Returns (p, acc, l_i, m_i); the
        # caller adds p @ v to acc. NOTE: the test is one branch for the whole tile, a
        # tile-wide max (sm_90a: one more block barrier a tile) that skips 144 instructions a
        # thread of a D=128 iteration (its 128 multiplies), 40 of a D=64 one.
        m_new = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)
        if tl.max(m_new - m_i, 0) > 8.0:  # a first tile's m_i is -inf: always taken
            alpha = tl.math.exp2(m_i - m_new)
            acc = acc * alpha[:, None]
            l_i = l_i * alpha
            m_i = m_new
        p = exp2_split(qk * qk_scale - m_i[:, None], EXP_POLY)
        return p, acc, l_i + tl.sum(p, 1), m_i

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
