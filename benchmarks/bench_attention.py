"""Benchmark cpkv's CP prefill attention kernels on a CUDA GPU against torch SDPA.

Causal prefill of one sequence whose pages all sit on one lane, in position order (32k and 128k
tokens, 32 query heads / 8 KV heads, head dim 128, bf16, page 64): the paged kernel's TFLOP/s
beside ``scaled_dot_product_attention`` with the FLASH and the CUDNN backends, measured in the
same run, with the ratios. Causal FLOPs are ``4 * T * T / 2 * Hq * D`` for every row, so the
numbers compare directly. Then the zigzag case (cp=2: each lane holds 2 of 4 segments and
computes all queries' partials over them; TFLOP/s on the FLOPs of the pairs it sees, and its
time beside the one-lane time) and the merge kernel's GB/s beside a same-size device copy.
At head dim 64 (Llama-3.2-1B) the split ablation: each lane's own queries over the whole
sequence (a fresh pass-KV prefill) at cp 2 and 4, zigzag against a contiguous split, timed lane
by lane; the slowest lane is the step's critical path.

Times: triton.testing.do_bench medians (warmup first, L2 flushed before each call).

Usage: python benchmarks/bench_attention.py [--json PATH] [--sweep [--sweep-d 64|128]]
       [--sweep-seconds S] [--only-sweep]
Without a CUDA device it prints "no CUDA device; skipping" and exits 0.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import itertools
import json
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from cpkv.kernels import PagedKVTable

try:
    import triton
    import triton.testing
except Exception:  # the CPU skip path must work without Triton
    triton = None  # type: ignore[assignment]

HQ, HKV, HEAD_DIM, PAGE = 32, 8, 128, 64
DTYPE = torch.bfloat16
SIZES = (32 << 10, 128 << 10)
# The Hopper table: every head dim x length, cpkv (both paths) beside SDPA flash and cuDNN.
TABLE_DIMS = (64, 128)
TABLE_SIZES = (8 << 10, 32 << 10, 128 << 10)
PAGE_SIZES = (16, 32, 64, 128)
POINTER = "cpkv paged (pointer kernel)"
DEVICE = "cuda"  # a CPU dry run of the logic (interpreter, tiny sizes) may patch it


@dataclass
class Row:
    case: str
    impl: str
    ms: float
    tflops: float = 0.0
    gbps: float = 0.0
    note: str = ""


def bench_ms(fn: Callable[[], object], warmup: int = 25, rep: int = 100) -> float:
    """do_bench median in milliseconds."""
    return triton.testing.do_bench(fn, warmup=warmup, rep=rep, return_mode="median")


def causal_flops(t: int, hq: int = HQ, d: int = HEAD_DIM) -> float:
    return 4.0 * t * t / 2 * hq * d


class Table:
    """Rows, each printed as it is measured (a run cut short still shows what it got)."""

    HEAD = f"{'case':<26} {'impl':<46} {'ms':>9} {'TFLOP/s':>8} {'GB/s':>7}  note"

    def __init__(self) -> None:
        self.rows: list[Row] = []
        self.quiet = False

    def add(self, row: Row) -> Row:
        if not self.rows and not self.quiet:
            print(self.HEAD)
            print("-" * len(self.HEAD))
        self.rows.append(row)
        if not self.quiet:
            print(format_row(row), flush=True)
        return row


def format_row(r: Row) -> str:
    tf = f"{r.tflops:>8.1f}" if r.tflops else f"{'':>8}"
    gb = f"{r.gbps:>7.0f}" if r.gbps else f"{'':>7}"
    return f"{r.case:<26} {r.impl:<46} {r.ms:>9.3f} {tf} {gb}  {r.note}"


@dataclass
class Lane:
    """One lane's inputs for one sequence: all ``t`` queries, the pages it holds."""

    q: torch.Tensor
    q_pos: torch.Tensor
    cu_q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    pages: PagedKVTable
    pairs: int  # (query, key) pairs that see each other
    head_dim: int

    def call(self, K, **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
        return K.paged_partial_attention(
            self.q,
            self.q_pos,
            self.cu_q,
            self.k,
            self.v,
            self.pages,
            self.head_dim**-0.5,
            max_q_len=self.q.shape[0],
            **kwargs,
        )


def make_lane(
    q: torch.Tensor,
    k_all: torch.Tensor,
    v_all: torch.Tensor,
    pages: list[int],
    page: int,
    scatter: bool = False,
) -> Lane:
    """A lane holding the given page numbers (position ``n * page``) of the sequence, in that
    order, at local ids 0..n-1 (``scatter``: at a random permutation of them, as a pool that
    has churned holds them)."""
    from cpkv.kernels import PagedKVTable

    t = q.shape[0]
    n = len(pages)
    idx = torch.tensor(pages, device=DEVICE, dtype=torch.int64)
    local = torch.arange(n, device=DEVICE)
    if scatter:
        local = torch.randperm(n, device=DEVICE, generator=torch.Generator(DEVICE).manual_seed(n))
    k = torch.empty((n, page, *k_all.shape[1:]), dtype=k_all.dtype, device=DEVICE)
    v = torch.empty_like(k)
    k[local] = k_all.view(-1, page, *k_all.shape[1:])[idx]
    v[local] = v_all.view(-1, page, *v_all.shape[1:])[idx]
    # Slot j of page p (position p * page + j) is seen by the t - (p * page + j) queries at or
    # after it.
    pairs = sum(page * (t - p * page) for p in pages) - n * (page * (page - 1) // 2)
    return Lane(
        q,
        torch.arange(t, device=DEVICE),
        torch.tensor([0, t], device=DEVICE, dtype=torch.int32),
        k,
        v,
        PagedKVTable(
            local.to(torch.int32),
            idx * page,
            torch.full((n,), page, device=DEVICE, dtype=torch.int32),
            torch.tensor([0, n], device=DEVICE, dtype=torch.int32),
        ),
        pairs,
        q.shape[2],
    )


def sdpa_fns(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
) -> dict[str, tuple[Callable[[], torch.Tensor], str]]:
    """FLASH and CUDNN SDPA calls on [1, H, T, D] views; native GQA when the backend takes it,
    else KV heads repeated (same FLOPs)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.functional import scaled_dot_product_attention as sdpa

    qs = q.transpose(0, 1).unsqueeze(0).contiguous()
    ks = k.transpose(0, 1).unsqueeze(0).contiguous()
    vs = v.transpose(0, 1).unsqueeze(0).contiguous()
    group = q.shape[1] // k.shape[1]
    fns: dict[str, tuple[Callable[[], torch.Tensor], str]] = {}
    for name, backend in (
        ("flash", SDPBackend.FLASH_ATTENTION),
        ("cudnn", SDPBackend.CUDNN_ATTENTION),
    ):

        def native(backend=backend) -> torch.Tensor:
            with sdpa_kernel(backend):
                return sdpa(qs, ks, vs, is_causal=True, enable_gqa=True)

        try:
            native()
            fns[name] = (native, "native GQA")
            continue
        except Exception as exc:  # backend refuses GQA: repeat KV heads
            reason = f"{type(exc).__name__}"
        kr = ks.repeat_interleave(group, 1)
        vr = vs.repeat_interleave(group, 1)

        def repeated(backend=backend, kr=kr, vr=vr) -> torch.Tensor:
            with sdpa_kernel(backend):
                return sdpa(qs, kr, vr, is_causal=True)

        try:
            repeated()
            fns[name] = (repeated, f"KV heads repeated ({reason} with enable_gqa)")
        except Exception as exc:
            print(f"  {name}: unavailable ({type(exc).__name__}: {str(exc)[:120]})")
    return fns


def bench_causal(
    tab: Table,
    K,
    t: int,
    page: int = PAGE,
    head_dim: int = HEAD_DIM,
    with_sdpa: bool = True,
    rep: int = 100,
    impl: str = "cpkv paged",
    scatter: bool = False,
) -> Row:
    """One sequence, all pages on the lane in order: the kernel's row (and SDPA's)."""
    g = torch.Generator(device=DEVICE).manual_seed(t)
    q = torch.randn(t, HQ, head_dim, device=DEVICE, generator=g).to(DTYPE)
    k = torch.randn(t, HKV, head_dim, device=DEVICE, generator=g).to(DTYPE)
    v = torch.randn(t, HKV, head_dim, device=DEVICE, generator=g).to(DTYPE)
    lane = make_lane(q, k, v, list(range(t // page)), page, scatter)
    case = causal_case(t, page, head_dim) + (" scattered" if scatter else "")
    flops = causal_flops(t, d=head_dim)
    out, _ = lane.call(K)
    ms = bench_ms(lambda: lane.call(K), rep=rep)
    mine = tab.add(Row(case, impl, ms, flops / ms / 1e9))
    if with_sdpa:
        for name, (fn, note) in sdpa_fns(q, k, v).items():
            ref = fn()
            err = (out - ref[0].transpose(0, 1).float()).abs().max().item()
            del ref
            ms_b = bench_ms(fn, rep=rep)
            tab.add(
                Row(
                    case,
                    f"sdpa {name}",
                    ms_b,
                    flops / ms_b / 1e9,
                    note=f"{note}; max |cpkv - sdpa| {err:.1e}",
                )
            )
    return mine


def causal_case(t: int, page: int = PAGE, head_dim: int = HEAD_DIM) -> str:
    return f"causal T={t >> 10}k page={page} D={head_dim}"


@contextlib.contextmanager
def kernel_path(mode: str) -> Iterator[None]:
    """The launcher's path for the block: "never" the pointer kernel, "auto" TMA on Hopper."""
    mod = importlib.import_module("cpkv.kernels.paged_attention_tma")
    saved, mod.MODE = mod.MODE, mode
    try:
        yield
    finally:
        mod.MODE = saved


MIXED_LENGTHS = (512, 1000, 2048, 3000, 4096, 6000, 8192, 16384)


def bench_mixed(tab: Table, K, head_dim: int = HEAD_DIM) -> None:
    """A batch of sequences of mixed lengths (not multiples of the page or the tile), each
    causal over its own pages at scattered local ids: both kernel paths, and SDPA cuDNN
    called once per sequence (it has no ragged batch) for scale."""
    from cpkv.kernels import PagedKVTable

    g = torch.Generator(device=DEVICE).manual_seed(head_dim)
    lens = MIXED_LENGTHS
    n_pages = [-(-t // PAGE) for t in lens]
    total_pages = sum(n_pages)
    qs = [torch.randn(t, HQ, head_dim, device=DEVICE, generator=g).to(DTYPE) for t in lens]
    ks = [torch.randn(t, HKV, head_dim, device=DEVICE, generator=g).to(DTYPE) for t in lens]
    vs = [torch.randn(t, HKV, head_dim, device=DEVICE, generator=g).to(DTYPE) for t in lens]
    local = torch.randperm(total_pages, device=DEVICE, generator=g)
    k = torch.zeros(total_pages, PAGE, HKV, head_dim, dtype=DTYPE, device=DEVICE)
    v = torch.zeros_like(k)
    pos, plen, i = [], [], 0
    for t, kk, vv in zip(lens, ks, vs, strict=True):
        for p in range(0, t, PAGE):
            n = min(PAGE, t - p)
            k[local[i], :n], v[local[i], :n] = kk[p : p + n], vv[p : p + n]
            pos.append(p)
            plen.append(n)
            i += 1
    cu = torch.tensor([0, *itertools.accumulate(lens)], device=DEVICE, dtype=torch.int32)
    cu_p = torch.tensor([0, *itertools.accumulate(n_pages)], device=DEVICE, dtype=torch.int32)
    pages = PagedKVTable(
        local.to(torch.int32),
        torch.tensor(pos, device=DEVICE, dtype=torch.int64),
        torch.tensor(plen, device=DEVICE, dtype=torch.int32),
        cu_p,
    )
    q = torch.cat(qs)
    q_pos = torch.cat([torch.arange(t, device=DEVICE) for t in lens])
    flops = sum(causal_flops(t, d=head_dim) for t in lens)
    case = f"mixed {len(lens)} seqs D={head_dim}"

    def call() -> tuple[torch.Tensor, torch.Tensor]:
        return K.paged_partial_attention(
            q, q_pos, cu, k, v, pages, head_dim**-0.5, max_q_len=max(lens)
        )

    outs = []
    for path, impl in (("auto", "cpkv paged"), ("never", POINTER)):
        with kernel_path(path):
            outs.append(call()[0])
            ms = bench_ms(call)
        note = f"lengths {list(lens)}"
        if len(outs) == 2:
            note += f"; max |tma - pointer| {(outs[0] - outs[1]).abs().max().item():.1e}"
        tab.add(Row(case, impl, ms, flops / ms / 1e9, note=note))
    fns = [sdpa_fns(qq, kk, vv).get("cudnn") for qq, kk, vv in zip(qs, ks, vs, strict=True)]
    if all(fns):
        ms = bench_ms(lambda: [fn() for fn, _ in fns])
        tab.add(Row(case, "sdpa cudnn, one call a sequence", ms, flops / ms / 1e9))


def bench_zigzag(tab: Table, K, t: int, one_lane_ms: float) -> None:
    """cp=2 zigzag: lane 0 holds segments 0 and 3 of 4, lane 1 segments 1 and 2; each computes
    all t queries' partials over its pages; then the merge of the two partials."""
    g = torch.Generator(device=DEVICE).manual_seed(t + 1)
    q = torch.randn(t, HQ, HEAD_DIM, device=DEVICE, generator=g).to(DTYPE)
    k = torch.randn(t, HKV, HEAD_DIM, device=DEVICE, generator=g).to(DTYPE)
    v = torch.randn(t, HKV, HEAD_DIM, device=DEVICE, generator=g).to(DTYPE)
    seg = t // PAGE // 4
    segs = [list(range(i * seg, (i + 1) * seg)) for i in range(4)]
    case = f"zigzag cp=2 T={t >> 10}k"
    parts = []
    for lane_id, pages in ((0, segs[0] + segs[3]), (1, segs[1] + segs[2])):
        lane = make_lane(q, k, v, pages, PAGE)
        flops = 4.0 * lane.pairs * HQ * HEAD_DIM
        ms = bench_ms(lambda lane=lane: lane.call(K))
        note = (
            f"sees {lane.pairs / (t * (t + 1) / 2):.3f} of the causal pairs in "
            f"{ms / one_lane_ms:.3f}x the one-lane time"
        )
        tab.add(
            Row(
                case,
                f"cpkv paged lane {lane_id} (segs {pages[0] // seg},{pages[-1] // seg})",
                ms,
                flops / ms / 1e9,
                note=note,
            )
        )
        parts.append(lane.call(K))
        del lane
    outs = torch.stack([p[0] for p in parts])
    lses = torch.stack([p[1] for p in parts])
    del parts, q, k, v
    bench_merge(tab, K, outs, lses, case)


def split_token_ranges(t: int, cp: int, split: str) -> list[list[tuple[int, int]]]:
    """Each lane's query token ranges: ``zigzag`` (2 cp segments, lane r owns r and 2cp-1-r)
    or ``contiguous`` (lane r owns the r-th of cp equal runs)."""
    if split == "contiguous":
        n = t // cp
        return [[(r * n, (r + 1) * n)] for r in range(cp)]
    n = t // (2 * cp)
    return [[(r * n, (r + 1) * n), ((2 * cp - 1 - r) * n, (2 * cp - r) * n)] for r in range(cp)]


def bench_split_ablation(tab: Table, K, t: int, head_dim: int, one_lane_ms: float) -> None:
    """Why the zigzag plan exists, measured: each lane's attention of its own queries over the
    whole sequence's K/V (what a lane computes in a fresh pass-KV prefill), timed alone on the
    GPU one lane after another; a step waits for the slowest lane (the critical path)."""
    g = torch.Generator(device=DEVICE).manual_seed(t + 2)
    q = torch.randn(t, HQ, head_dim, device=DEVICE, generator=g).to(DTYPE)
    k = torch.randn(t, HKV, head_dim, device=DEVICE, generator=g).to(DTYPE)
    v = torch.randn(t, HKV, head_dim, device=DEVICE, generator=g).to(DTYPE)
    full = make_lane(q, k, v, list(range(t // PAGE)), PAGE)
    for cp in (2, 4):
        slowest = {}
        for split in ("zigzag", "contiguous"):
            times = []
            for ranges in split_token_ranges(t, cp, split):
                rows = torch.cat([torch.arange(a, b, device=DEVICE) for a, b in ranges])
                n = rows.shape[0]
                lane = Lane(
                    q[rows].contiguous(),
                    rows,
                    torch.tensor([0, n], device=DEVICE, dtype=torch.int32),
                    full.k,
                    full.v,
                    full.pages,
                    0,
                    head_dim,
                )
                times.append(bench_ms(lambda lane=lane: lane.call(K), rep=50))
            slowest[split] = max(times)
            tab.add(
                Row(
                    f"split cp={cp} T={t >> 10}k D={head_dim}",
                    f"{split}: slowest lane (lanes {', '.join(f'{x:.2f}' for x in times)})",
                    max(times),
                    note=f"{max(times) / (one_lane_ms / cp):.2f}x the ideal one-lane time / cp",
                )
            )
        print(
            f"split cp={cp} T={t >> 10}k D={head_dim}: contiguous / zigzag critical path = "
            f"{slowest['contiguous'] / slowest['zigzag']:.2f}x",
            flush=True,
        )


def bench_merge(tab: Table, K, outs: torch.Tensor, lses: torch.Tensor, case: str) -> None:
    """Merge GB/s (bytes read + written) beside a device copy moving the same bytes."""
    n_parts = outs.shape[0]
    nbytes = outs.numel() * outs.element_size() + lses.numel() * 4
    nbytes += (outs.numel() + lses.numel()) // n_parts * 4  # fp32 out and lse written
    ms = bench_ms(lambda: K.merge_attn_states(outs, lses))
    src = torch.empty(nbytes // 16, dtype=torch.int64, device=DEVICE).random_()
    dst = torch.empty_like(src)
    ms_copy = bench_ms(lambda: dst.copy_(src))
    gbps, copy_gbps = nbytes / ms / 1e6, 2 * src.numel() * 8 / ms_copy / 1e6
    tab.add(
        Row(
            case,
            f"merge L={n_parts} fp32",
            ms,
            gbps=gbps,
            note=f"{gbps / copy_gbps:.2f}x the same-size copy",
        )
    )
    tab.add(Row(case, "  same-size copy (dst.copy_(src))", ms_copy, gbps=copy_gbps))


def sweep_candidates(cfg_t, d_only: int | None = None) -> list[tuple[int, object]]:
    """(head dim, pointer-kernel config) pairs to time, 16-bit D=128 first. Pruned by
    compiling for sm_90a offline (triton 3.9, ptxas -v): 128-key tiles at D=128 and 128 rows at
    4 warps spill (104-844 B) and are left out; 64 rows x 128 keys at D=64 do not."""
    cands = []
    if d_only != 64:
        for hp in (1, 4):
            for st in (3, 2, 4):
                cands.append((128, cfg_t(128, 64, hp, 8, st)))
            cands.append((128, cfg_t(128, 32, hp, 8, 3)))
            cands.append((128, cfg_t(64, 64, hp, 4, 3)))
    if d_only != 128:
        for bm, bn, hp, w, st in ((64, 128, 1, 4, 2), (64, 128, 1, 4, 3), (128, 128, 1, 8, 2)):
            cands.append((64, cfg_t(bm, bn, hp, w, st)))
    return cands


def tma_sweep_candidates(cfg_t, d_only: int | None = None) -> list[tuple[int, object]]:
    """(head dim, TMA config) pairs to time: tile shapes, pipelining depth, warps, GQA packing
    and Triton's warp specialisation, around the FA2/FA3 shapes (128 query rows)."""
    # (block_m, block_n, heads, warps, stages, warp_specialize, heads_first, pair_tiles,
    # exp_fma)
    shapes = {
        128: [
            (128, 64, 1, 4, 3, True),
            (128, 64, 1, 8, 3, True),
            (128, 128, 1, 8, 2, True),
            (128, 128, 1, 4, 2, True),
            (128, 64, 1, 4, 3, False),
            (128, 64, 1, 4, 2, False),
            (128, 64, 1, 4, 4, False),
            (128, 128, 1, 4, 2, False),
            (128, 64, 2, 4, 3, False),
            (128, 128, 2, 4, 2, False),
            (128, 64, 1, 4, 3, False, True),
            (64, 64, 1, 4, 2, False),
            (256, 64, 1, 8, 2, False),
            (128, 64, 1, 8, 3, False),
        ],
        64: [
            # Today's config against the pairs' second exp2 on the FMA pipes, twice in turn
            # (the arms' own spread is a few per cent).
            *[(64, 128, 1, 4, 2, False, False, True, f) for _ in (1, 2) for f in (False, True)],
            (64, 128, 1, 4, 2, True),
            (128, 128, 1, 8, 2, True),
            (128, 64, 1, 4, 2, True),
            (64, 128, 1, 4, 2, False),
            (64, 128, 1, 4, 3, False),
            (64, 64, 1, 4, 2, False),
            (64, 256, 1, 4, 2, False),
            (128, 128, 1, 4, 2, False),
            (128, 64, 1, 4, 2, False),
            (64, 128, 2, 4, 2, False),
            (64, 128, 1, 4, 2, False, True),
            (256, 128, 1, 8, 2, False),
        ],
    }
    return [(d, cfg_t(*shape)) for d in (128, 64) if d_only in (None, d) for shape in shapes[d]]


def sweep(tab: Table, K, seconds: float, d_only: int | None = None, kernel: str = "tma") -> None:
    """Time tiling candidates of one kernel on the 32k causal case (its module's configs
    patched, then restored); starts no new candidate after ``seconds``."""
    if kernel == "tma":
        mod = importlib.import_module("cpkv.kernels.paged_attention_tma")
        cands = tma_sweep_candidates(mod.TmaConfig, d_only)

        def key(d: int) -> int:
            return d

        path = "auto"
    else:
        mod = importlib.import_module("cpkv.kernels.paged_attention")
        cands = sweep_candidates(mod.AttnConfig, d_only)

        def key(d: int) -> tuple[int, int]:
            return (2, d)

        path = "never"
    saved = dict(mod.CONFIGS)
    start = time.time()
    print(f"sweep of the {kernel} kernel (causal T=32k, page 64, 32/8 heads, bf16):")
    try:
        for d, cfg in cands:
            if time.time() - start > seconds:
                print(f"sweep: stopped after {seconds:.0f} s")
                break
            mod.CONFIGS = {**saved, key(d): cfg}
            label = (
                f"D={d} M={cfg.block_m} N={cfg.block_n} hp={cfg.heads_per_program} "
                f"w={cfg.num_warps} s={cfg.num_stages}"
                + (" ws" if getattr(cfg, "warp_specialize", False) else "")
                + (" heads-first" if getattr(cfg, "heads_first", False) else "")
                + (" pairs" if getattr(cfg, "pair_tiles", False) else "")
                + (" exp-fma" if getattr(cfg, "exp_fma", False) else "")
            )
            sub = Table()
            sub.quiet = True
            try:
                with kernel_path(path):
                    row = bench_causal(sub, K, 32 << 10, head_dim=d, with_sdpa=False, rep=40)
            except Exception as exc:
                print(f"  {label}: failed ({type(exc).__name__}: {str(exc)[:160]})", flush=True)
                torch.cuda.empty_cache()
                continue
            row.impl = f"sweep {kernel} {label}"
            tab.rows.append(row)
            print(f"  {label}: {row.ms:.3f} ms {row.tflops:.0f} TFLOP/s", flush=True)
    finally:
        mod.CONFIGS = saved


def ratios(rows: list[Row]) -> list[str]:
    """cpkv against SDPA's backends, row by row of the causal table."""
    lines = []
    cases = dict.fromkeys(r.case for r in rows if r.case.startswith("causal"))
    for case in cases:
        by = {r.impl: r for r in rows if r.case == case}
        for impl in ("cpkv paged", POINTER):
            mine = by.get(impl)
            for name in ("flash", "cudnn"):
                base = by.get(f"sdpa {name}")
                if mine is not None and base is not None:
                    lines.append(
                        f"{case}: {impl}/{name} = {mine.tflops / base.tflops:.2f}x "
                        f"({mine.tflops:.0f} vs {base.tflops:.0f} TFLOP/s)"
                    )
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path, help="write the results here as JSON")
    parser.add_argument("--sweep", action="store_true", help="also time tiling candidates")
    parser.add_argument("--sweep-seconds", type=float, default=150.0)
    parser.add_argument("--only-sweep", action="store_true", help="time the candidates only")
    parser.add_argument("--sweep-d", type=int, choices=(64, 128), help="sweep one head dim")
    parser.add_argument(
        "--sweep-kernel", choices=("tma", "pointer"), default="tma", help="which kernel to tune"
    )
    args = parser.parse_args(argv)
    if not torch.cuda.is_available() or triton is None:
        print("no CUDA device; skipping")
        return 0

    import cpkv.kernels as K

    mod = importlib.import_module("cpkv.kernels.paged_attention")
    meta = {
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "python": sys.version.split()[0],
    }
    print(" | ".join(f"{k} {v}" for k, v in meta.items()))
    cfg = mod.config_for(DTYPE, HEAD_DIM, HQ // HKV, None)
    print(f"bf16 D={HEAD_DIM} pointer-kernel config: {cfg}")
    tma = importlib.import_module("cpkv.kernels.paged_attention_tma")
    print(f"TMA configs: D=64 {tma.CONFIGS[64]}; D=128 {tma.CONFIGS[128]}")
    tab = Table()
    if not args.only_sweep:
        for d in TABLE_DIMS:
            for t in TABLE_SIZES:
                bench_causal(tab, K, t, head_dim=d)
                with kernel_path("never"):
                    bench_causal(tab, K, t, head_dim=d, with_sdpa=False, impl=POINTER)
        for d in TABLE_DIMS:
            bench_mixed(tab, K, d)
        # Pages at random local ids: the page table's indirection costs the TMA path nothing.
        bench_causal(tab, K, 32 << 10, with_sdpa=False, scatter=True)
        for page in PAGE_SIZES:
            if page != PAGE:
                bench_causal(tab, K, 32 << 10, page=page, with_sdpa=False)
                with kernel_path("never"):
                    bench_causal(tab, K, 32 << 10, page=page, with_sdpa=False, impl=POINTER)
        for t in SIZES:
            one = next(r for r in tab.rows if r.case == causal_case(t) and r.impl == "cpkv paged")
            if t == SIZES[0]:
                one_64 = next(
                    r
                    for r in tab.rows
                    if r.case == causal_case(t, head_dim=64) and r.impl == "cpkv paged"
                )
                bench_split_ablation(tab, K, t, 64, one_64.ms)
            bench_zigzag(tab, K, t, one.ms)
        g = torch.Generator(device=DEVICE).manual_seed(9)
        t = 32 << 10
        outs = torch.randn(4, t, HQ, HEAD_DIM, device=DEVICE, generator=g)
        lses = torch.randn(4, t, HQ, device=DEVICE, generator=g)
        bench_merge(tab, K, outs, lses, f"merge T={t >> 10}k")
        del outs, lses
        for line in ratios(tab.rows):
            print(line)
    if args.sweep or args.only_sweep:
        sweep(tab, K, args.sweep_seconds, args.sweep_d, args.sweep_kernel)
        best = sorted((r for r in tab.rows if r.impl.startswith("sweep")), key=lambda r: -r.tflops)
        for d in (128, 64):
            top = [r for r in best if f"D={d} " in r.impl][:3]
            print(f"best D={d}: " + "; ".join(f"{r.impl[6:]} {r.tflops:.0f}" for r in top))
    if args.json:
        payload = {
            **meta,
            "config": asdict(cfg),
            "rows": [asdict(r) for r in tab.rows],
            "ratios": ratios(tab.rows),
        }
        args.json.write_text(json.dumps(payload, indent=2))
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
