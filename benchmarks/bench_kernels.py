"""Benchmark cpkv.kernels on a CUDA GPU against the device copy bandwidth and torch baselines.

Each row: bytes read + written by the operation over its GPU time, beside a device-to-device
``dst.copy_(src)`` of a few GB measured in the same run. GPU time ("us") is the median over
replays of a CUDA graph of many calls that rotate over enough independent input sets to exceed
4x the L2 cache, so neither host launch overhead nor L2 hits flatter it; "eager us" is
triton.testing.do_bench's median of one plain call (L2 flushed first; host overhead included
when the host is slower than the GPU). write_req_to_token is also compared with a
one-program-per-request kernel of the original shape (defined here); store_kv with
``index_copy_`` and gather_kv with ``index_select`` on the flattened shard.

Usage: python benchmarks/bench_kernels.py [--json PATH] [--sweep]
Without a CUDA device it prints "no CUDA device; skipping" and exits 0.
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

try:
    import triton
    import triton.language as tl
except Exception:  # the CPU skip path must work without Triton
    triton = None  # type: ignore[assignment]
    tl = None  # type: ignore[assignment]

# The original kernel copies 512 slots per loop step.
BASELINE_BLOCK = 512
COPY_BYTES = 2 << 30  # 2 GiB copied (4 GiB moved): far past L2, long enough to time well
CALLS_PER_GRAPH = 64  # enough calls per replay that one replay's launch cost is noise

if triton is not None:

    @triton.jit
    def _per_request_baseline_kernel(
        table_ptr,
        table_row_stride,
        req_idx_ptr,
        prefix_lens_ptr,
        seq_lens_ptr,
        out_cache_loc_ptr,
        BLOCK: tl.constexpr,
    ):
        # The original shape: one program per request; its start in out_cache_loc summed over
        # all earlier requests (O(bs^2) overall); its slots copied by a serial loop.
        req = tl.program_id(0)
        row = tl.load(req_idx_ptr + req)
        prefix_len = tl.load(prefix_lens_ptr + req)
        ext_len = tl.load(seq_lens_ptr + req) - prefix_len
        start = prefix_len * 0
        for i in range(req):
            start += tl.load(seq_lens_ptr + i) - tl.load(prefix_lens_ptr + i)
        for b in range(tl.cdiv(ext_len, BLOCK)):
            offs = b * BLOCK + tl.arange(0, BLOCK)
            mask = offs < ext_len
            vals = tl.load(out_cache_loc_ptr + start + offs, mask=mask)
            tl.store(table_ptr + row * table_row_stride + prefix_len + offs, vals, mask=mask)

    @triton.jit
    def _copy_kernel(src_ptr, dst_ptr, n, BLOCK: tl.constexpr):
        # A plain SM copy of the same bytes: what any kernel moving this much could reach.
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        tl.store(dst_ptr + offs, tl.load(src_ptr + offs, mask=mask), mask=mask)


@dataclass
class Row:
    kernel: str
    case: str
    bytes_moved: int
    us: float
    gbps: float
    copy_ratio: float
    eager_us: float
    baseline: str = ""
    baseline_us: float = 0.0
    speedup: float = 0.0


def eager_us(fn: Callable[[], object]) -> float:
    """do_bench median of one call in microseconds (L2 flushed before each run)."""
    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median") * 1e3


def graph_us(fns: list[Callable[[], object]]) -> float:
    """GPU time per call in microseconds: median over replays of a CUDA graph that calls
    ``fns`` in rotation (one fn per independent input set), CALLS_PER_GRAPH calls in all."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm up (and compile) off the capture
        for fn in fns:
            fn()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    rounds = max(1, CALLS_PER_GRAPH // len(fns))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(rounds):
            for fn in fns:
                fn()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(7):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / (rounds * len(fns)))
    del graph
    return sorted(times)[len(times) // 2]


def n_sets(footprint: int) -> int:
    """Independent input sets whose total footprint is at least 4x the L2 cache."""
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    return max(1, min(16, -(-4 * l2 // max(footprint, 1))))


def copy_gbps() -> float:
    """Device-to-device copy bandwidth, bytes read + written per second, in GB/s."""
    src = torch.randint(0, 1 << 30, (COPY_BYTES // 8,), dtype=torch.int64, device="cuda")
    dst = torch.empty_like(src)
    # NOTE: timed eagerly: inside a CUDA graph copy_ becomes a memcpy node, which ran at ~65%
    # of this on an H200; a 1.5 ms copy hides any host overhead anyway.
    return 2 * COPY_BYTES / eager_us(lambda: dst.copy_(src)) / 1e3


class Bench:
    def __init__(self, eager: bool = True) -> None:
        self.rows: list[Row] = []
        self.eager = eager
        self.copy_gbps = copy_gbps()
        torch.cuda.empty_cache()

    def add(
        self,
        kernel: str,
        case: str,
        nbytes: int,
        fns: list[Callable[[], object]],
        baseline: tuple[str, list[Callable[[], object]]] | None = None,
    ) -> Row:
        us = graph_us(fns)
        gbps = nbytes / us / 1e3
        eager = eager_us(fns[0]) if self.eager else 0.0
        row = Row(kernel, case, nbytes, us, gbps, gbps / self.copy_gbps, eager)
        if baseline is not None:
            row.baseline = baseline[0]
            row.baseline_us = graph_us(baseline[1])
            row.speedup = row.baseline_us / us
        self.rows.append(row)
        return row


def _gen(seed: int) -> torch.Generator:
    return torch.Generator(device="cuda").manual_seed(seed)


def bench_write_req_to_token(b: Bench, K, naive, with_baseline: bool = True) -> None:
    for bs, length in ((1, 1 << 20), (64, 32 << 10), (256, 8 << 10)):
        case = f"bs={bs} len={length >> 10}k"
        nbytes = 16 * bs * length  # each slot read once and written once
        sets = [_write_set(K, naive, bs, length, seed) for seed in range(n_sets(nbytes))]
        baseline = ("per-request kernel", [s[1] for s in sets]) if with_baseline else None
        b.add("write_req_to_token", case, nbytes, [s[0] for s in sets], baseline)
        if with_baseline:
            # The parts: the launcher's torch prep alone (stack + cumsum), the kernel alone, and
            # a plain copy of the same bytes, to show what launch and ramp cost at this size.
            b.add("  prep only (stack+cumsum)", case, 32 * bs, [sets[0][2]])
            b.add("  kernel only", case, nbytes, [s[3] for s in sets])
            b.add("  same-size triton copy", case, nbytes, [s[4] for s in sets])


def _write_set(K, naive, bs: int, length: int, seed: int):
    """One input set: (launcher, baseline, prep only, kernel only, same-size copy) calls; the
    first two are checked once."""
    g = _gen(seed)
    table = torch.full((bs + 8, length), -1, dtype=torch.int64, device="cuda")
    rows = torch.randperm(bs + 8, device="cuda", generator=g)[:bs]
    pre = torch.zeros(bs, dtype=torch.int64, device="cuda")
    seq = torch.full((bs,), length, dtype=torch.int64, device="cuda")
    out = torch.randint(0, 1 << 40, (bs * length,), device="cuda", generator=g)

    def run() -> None:
        K.write_req_to_token(table, rows, pre, seq, out, max_extend_len=length)

    def baseline() -> None:
        _per_request_baseline_kernel[(bs,)](
            table, table.stride(0), rows, pre, seq, out, BLOCK=BASELINE_BLOCK
        )

    def prep() -> torch.Tensor:
        return torch.cumsum(torch.stack((pre, seq)), dim=1)

    wrt = importlib.import_module("cpkv.kernels.req_to_token.write_req_to_token")
    cum = prep()

    def kernel_only() -> None:
        wrt._write_req_to_token_kernel[(triton.cdiv(length, wrt.BLOCK), bs)](
            table,
            table.stride(0),
            rows,
            pre,
            seq,
            cum,
            cum.stride(0),
            out,
            out,
            HAS_PREFIX=False,
            BLOCK=wrt.BLOCK,
            num_warps=wrt.NUM_WARPS,
        )

    dst = torch.empty_like(out)

    def same_size_copy() -> None:
        _copy_kernel[(triton.cdiv(out.numel(), 4096),)](out, dst, out.numel(), BLOCK=4096)

    if seed == 0:
        ref = table.clone()
        naive.write_req_to_token(ref, rows, pre, seq, out)
        run()
        assert torch.equal(table, ref), f"write_req_to_token wrong at bs={bs}"
        table.fill_(-1)
        baseline()
        assert torch.equal(table, ref), f"baseline wrong at bs={bs}"
    return run, baseline, prep, kernel_only, same_size_copy


def bench_get_last_loc(b: Bench, K, naive) -> None:
    for bs in (256, 4096):
        g = _gen(bs)
        table = torch.randint(0, 1 << 40, (bs, 4096), device="cuda", generator=g)
        rows = torch.randperm(bs, device="cuda", generator=g)
        pre = torch.randint(0, 4097, (bs,), device="cuda", generator=g)

        def run(table=table, rows=rows, pre=pre) -> torch.Tensor:
            return K.get_last_loc(table, rows, pre)

        assert torch.equal(run(), naive.get_last_loc(table, rows, pre)), "get_last_loc wrong"
        b.add("get_last_loc", f"bs={bs}", 32 * bs, [run])


def bench_alloc_extend_slots(b: Bench, K, naive) -> None:
    page = 16
    for bs, length in ((1, 1 << 20), (256, 8 << 10)):
        n = bs * length
        n_pages = bs * (-(-length // page) + 1)
        nbytes = 8 * n + 8 * n_pages  # slots written, page ids read
        sets = [_alloc_set(K, naive, bs, length, page, seed) for seed in range(n_sets(nbytes))]
        b.add("alloc_extend_slots", f"bs={bs} len={length >> 10}k page={page}", nbytes, sets)


def _alloc_set(K, naive, bs: int, length: int, page: int, seed: int) -> Callable[[], object]:
    g = _gen(seed)
    pre = torch.randint(1, 64, (bs,), device="cuda", generator=g)  # partial last pages
    seq = pre + length
    n_pages = int(((seq + page - 1) // page - (pre + page - 1) // page).sum())
    new_pages = torch.randperm(2 * n_pages, device="cuda", generator=g)[:n_pages]
    last_loc = 5 * page + (pre - 1) % page
    n = bs * length

    def run() -> torch.Tensor:
        return K.alloc_extend_slots(
            pre, seq, last_loc, new_pages, page, extend_num_tokens=n, max_extend_len=length
        )

    if seed == 0:
        ref = naive.alloc_extend_slots(pre, seq, last_loc, new_pages, page)
        assert torch.equal(run(), ref), "alloc_extend_slots wrong"
    return run


def bench_kv(b: Bench, K, naive, with_baseline: bool = True) -> None:
    tokens, heads, dim, page, dtype = 128 << 10, 8, 128, 16, torch.bfloat16
    g = _gen(0)
    capacity = 2 * tokens  # shard twice the batch: slots scattered over it
    k = torch.randn(tokens, heads, dim, device="cuda", generator=g).to(dtype)
    v = torch.randn(tokens, heads, dim, device="cuda", generator=g).to(dtype)
    k_shard = torch.randn(capacity // page, page, heads, dim, device="cuda", generator=g).to(dtype)
    v_shard = torch.randn_like(k_shard)
    kf, vf = k_shard.view(-1, heads, dim), v_shard.view(-1, heads, dim)
    # K and V each read once and written once, plus the slots; ~1 GB, so one set exceeds L2.
    nbytes = 2 * 2 * k.numel() * k.element_size() + 8 * tokens
    for order in ("random", "sorted"):
        case = f"{tokens >> 10}k tok x {heads}h x {dim}d bf16 {order}"
        slots = torch.randperm(capacity, device="cuda", generator=g)[:tokens]
        if order == "sorted":
            slots = slots.sort().values

        def store(slots=slots) -> None:
            K.store_kv(k, v, k_shard, v_shard, slots)

        def index_copy(slots=slots) -> None:
            kf.index_copy_(0, slots, k)
            vf.index_copy_(0, slots, v)

        def gather(slots=slots) -> tuple[torch.Tensor, torch.Tensor]:
            return K.gather_kv(k_shard, v_shard, slots)

        def index_select(slots=slots) -> tuple[torch.Tensor, torch.Tensor]:
            return kf.index_select(0, slots), vf.index_select(0, slots)

        store()
        assert torch.equal(kf[slots], k) and torch.equal(vf[slots], v), f"store_kv wrong: {case}"
        got, ref = gather(), naive.gather_kv(k_shard, v_shard, slots)
        assert torch.equal(got[0], ref[0]) and torch.equal(got[1], ref[1]), "gather_kv wrong"
        del got, ref
        copy_base = ("index_copy_", [index_copy]) if with_baseline else None
        select_base = ("index_select", [index_select]) if with_baseline else None
        b.add("store_kv", case, nbytes, [store], copy_base)
        b.add("gather_kv", case, nbytes, [gather], select_base)


def sweep(b: Bench, K, naive, RT, rt_naive) -> None:
    """Try tuning constants; one row per setting (module constants patched, then restored)."""
    wrt = importlib.import_module("cpkv.kernels.req_to_token.write_req_to_token")
    store = importlib.import_module("cpkv.kernels.store_kv")
    gather = importlib.import_module("cpkv.kernels.gather_kv")
    names = ("BLOCK", "TILE_ELEMS", "NUM_WARPS")
    saved = {m: {n: getattr(m, n) for n in names if hasattr(m, n)} for m in (wrt, store, gather)}
    b.eager = False
    try:
        for block in (512, 1024, 2048, 4096):
            for warps in (4, 8):
                wrt.BLOCK, wrt.NUM_WARPS = block, warps
                before = len(b.rows)
                bench_write_req_to_token(b, RT, rt_naive, with_baseline=False)
                for row in b.rows[before:]:
                    row.kernel += f" [BLOCK={block} w={warps}]"
        for tile in (2048, 4096, 8192, 16384):
            for warps in (4, 8):
                for mod in (store, gather):
                    mod.TILE_ELEMS, mod.NUM_WARPS = tile, warps
                before = len(b.rows)
                bench_kv(b, K, naive, with_baseline=False)
                for row in b.rows[before:]:
                    row.kernel += f" [TILE={tile} w={warps}]"
    finally:
        b.eager = True
        for mod, constants in saved.items():
            for name, value in constants.items():
                setattr(mod, name, value)


def print_table(b: Bench) -> None:
    head = (
        f"{'kernel':<36} {'case':<32} {'MB':>7} {'us':>8} {'GB/s':>6} {'copy%':>5} "
        f"{'eager us':>8}  {'baseline':<18} {'base us':>8} {'speedup':>7}"
    )
    print(head)
    print("-" * len(head))
    for r in b.rows:
        base = f"{r.baseline:<18} {r.baseline_us:>8.1f} {r.speedup:>6.1f}x" if r.baseline else ""
        eager = f"{r.eager_us:>8.1f}" if r.eager_us else f"{'':>8}"
        print(
            f"{r.kernel:<36} {r.case:<32} {r.bytes_moved / 1e6:>7.1f} {r.us:>8.1f} "
            f"{r.gbps:>6.0f} {100 * r.copy_ratio:>4.0f}% {eager}  {base}"
        )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path, help="write the results here as JSON")
    parser.add_argument("--sweep", action="store_true", help="also try tuning constants")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available() or triton is None:
        print("no CUDA device; skipping")
        return 0

    import cpkv.kernels as K
    import cpkv.kernels.req_to_token as RT
    from cpkv.kernels import naive
    from cpkv.kernels.req_to_token import naive as rt_naive

    meta = {
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "python": sys.version.split()[0],
    }
    print(" | ".join(f"{k} {v}" for k, v in meta.items()))
    b = Bench()
    print(f"device copy (dst.copy_(src), {COPY_BYTES >> 30} GiB): {b.copy_gbps:.0f} GB/s")
    print(f"L2 {torch.cuda.get_device_properties(0).L2_cache_size >> 20} MiB")
    bench_write_req_to_token(b, RT, rt_naive)
    bench_get_last_loc(b, RT, rt_naive)
    bench_alloc_extend_slots(b, RT, rt_naive)
    bench_kv(b, K, naive)
    if args.sweep:
        sweep(b, K, naive, RT, rt_naive)
    print_table(b)
    if args.json:
        payload = {**meta, "copy_gbps": b.copy_gbps, "rows": [asdict(r) for r in b.rows]}
        args.json.write_text(json.dumps(payload, indent=2))
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
