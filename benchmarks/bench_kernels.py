"""Benchmark cpkv.kernels on a CUDA GPU against the device copy bandwidth and torch baselines.

Each row: bytes read + written by the operation over its median time (triton.testing.do_bench,
which flushes L2 before every run), beside a device-to-device ``dst.copy_(src)`` of a few GB
measured in the same run. write_req_to_token is also compared with a one-program-per-request
kernel of the original shape (defined here); store_kv with ``index_copy_`` and gather_kv with
``index_select`` on the flattened shard.

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


@dataclass
class Row:
    kernel: str
    case: str
    bytes_moved: int
    us: float
    gbps: float
    copy_ratio: float
    baseline: str = ""
    baseline_us: float = 0.0
    speedup: float = 0.0


def bench_us(fn: Callable[[], object]) -> float:
    """Median time of ``fn`` in microseconds (L2 flushed before each run)."""
    return triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median") * 1e3


def copy_gbps() -> float:
    """Device-to-device copy bandwidth, bytes read + written per second, in GB/s."""
    src = torch.randint(0, 1 << 30, (COPY_BYTES // 8,), dtype=torch.int64, device="cuda")
    dst = torch.empty_like(src)
    return 2 * COPY_BYTES / bench_us(lambda: dst.copy_(src)) / 1e3


class Bench:
    def __init__(self) -> None:
        self.rows: list[Row] = []
        self.copy_gbps = copy_gbps()
        torch.cuda.empty_cache()

    def add(
        self,
        kernel: str,
        case: str,
        nbytes: int,
        fn: Callable[[], object],
        baseline: tuple[str, Callable[[], object]] | None = None,
    ) -> Row:
        us = bench_us(fn)
        gbps = nbytes / us / 1e3
        row = Row(kernel, case, nbytes, us, gbps, gbps / self.copy_gbps)
        if baseline is not None:
            row.baseline = baseline[0]
            row.baseline_us = bench_us(baseline[1])
            row.speedup = row.baseline_us / us
        self.rows.append(row)
        return row


def _gen(seed: int) -> torch.Generator:
    return torch.Generator(device="cuda").manual_seed(seed)


def bench_write_req_to_token(b: Bench, K, naive, with_baseline: bool = True) -> None:
    for bs, length in ((1, 1 << 20), (64, 32 << 10), (256, 8 << 10)):
        _bench_write_case(b, K, naive, bs, length, with_baseline)


def _bench_write_case(b: Bench, K, naive, bs: int, length: int, with_baseline: bool) -> None:
    case = f"bs={bs} len={length >> 10}k"
    n = bs * length
    g = _gen(bs)
    table = torch.full((bs + 8, length), -1, dtype=torch.int64, device="cuda")
    rows = torch.randperm(bs + 8, device="cuda", generator=g)[:bs]
    pre = torch.zeros(bs, dtype=torch.int64, device="cuda")
    seq = torch.full((bs,), length, dtype=torch.int64, device="cuda")
    out = torch.randint(0, 1 << 40, (n,), device="cuda", generator=g)

    def run() -> None:
        K.write_req_to_token(table, rows, pre, seq, out, max_extend_len=length)

    def baseline() -> None:
        _per_request_baseline_kernel[(bs,)](
            table, table.stride(0), rows, pre, seq, out, BLOCK=BASELINE_BLOCK
        )

    ref = table.clone()
    naive.write_req_to_token(ref, rows, pre, seq, out)
    run()
    assert torch.equal(table, ref), f"write_req_to_token wrong at {case}"
    if not with_baseline:
        b.add("write_req_to_token", case, 16 * n, run)
        return
    table.fill_(-1)
    baseline()
    assert torch.equal(table, ref), f"baseline wrong at {case}"
    b.add("write_req_to_token", case, 16 * n, run, ("per-request kernel", baseline))
    # The launcher's torch prep alone (stack + cumsum), to see its share of the time.
    b.add("  prep only", case, 32 * bs, lambda: torch.cumsum(torch.stack((pre, seq)), dim=1))


def bench_get_last_loc(b: Bench, K, naive) -> None:
    for bs in (256, 4096):
        g = _gen(bs)
        table = torch.randint(0, 1 << 40, (bs, 4096), device="cuda", generator=g)
        rows = torch.randperm(bs, device="cuda", generator=g)
        pre = torch.randint(0, 4097, (bs,), device="cuda", generator=g)

        def run(table=table, rows=rows, pre=pre) -> torch.Tensor:
            return K.get_last_loc(table, rows, pre)

        assert torch.equal(run(), naive.get_last_loc(table, rows, pre)), "get_last_loc wrong"
        b.add("get_last_loc", f"bs={bs}", 32 * bs, run)


def bench_alloc_extend_slots(b: Bench, K, naive) -> None:
    page = 16
    for bs, length in ((1, 1 << 20), (256, 8 << 10)):
        g = _gen(bs)
        pre = torch.randint(0, 64, (bs,), device="cuda", generator=g)
        seq = pre + length
        n_pages = int(((seq + page - 1) // page - (pre + page - 1) // page).sum())
        new_pages = torch.randperm(2 * n_pages, device="cuda", generator=g)[:n_pages]
        last_loc = torch.where(pre > 0, 5 * page + (pre - 1) % page, -1)
        n = bs * length

        def run(pre=pre, seq=seq, last_loc=last_loc, new_pages=new_pages, n=n, length=length):
            return K.alloc_extend_slots(
                pre, seq, last_loc, new_pages, page, extend_num_tokens=n, max_extend_len=length
            )

        ref = naive.alloc_extend_slots(pre, seq, last_loc, new_pages, page)
        assert torch.equal(run(), ref), "alloc_extend_slots wrong"
        case = f"bs={bs} len={length >> 10}k page={page}"
        b.add("alloc_extend_slots", case, 8 * n + 8 * n_pages, run)


def bench_kv(
    b: Bench,
    K,
    naive,
    tokens: int = 128 << 10,
    heads: int = 8,
    dim: int = 128,
    with_baseline: bool = True,
) -> None:
    dtype, page = torch.bfloat16, 16
    g = _gen(0)
    capacity = 2 * tokens  # shard twice the batch: slots scattered over it
    k = torch.randn(tokens, heads, dim, device="cuda", generator=g).to(dtype)
    v = torch.randn(tokens, heads, dim, device="cuda", generator=g).to(dtype)
    k_shard = torch.randn(capacity // page, page, heads, dim, device="cuda", generator=g).to(dtype)
    v_shard = torch.randn_like(k_shard)
    nbytes = 2 * 2 * k.numel() * k.element_size() + 8 * tokens  # K and V read + written; slots
    case = f"{tokens >> 10}k tok x {heads}h x {dim}d bf16"
    for order in ("random", "sorted"):
        slots = torch.randperm(capacity, device="cuda", generator=g)[:tokens]
        if order == "sorted":
            slots = slots.sort().values
        _bench_kv_case(
            b, K, naive, f"{case} {order}", nbytes, k, v, k_shard, v_shard, slots, with_baseline
        )


def _bench_kv_case(
    b: Bench,
    K,
    naive,
    case: str,
    nbytes: int,
    k: torch.Tensor,
    v: torch.Tensor,
    k_shard: torch.Tensor,
    v_shard: torch.Tensor,
    slots: torch.Tensor,
    with_baseline: bool,
) -> None:
    kf, vf = k_shard.view(-1, *k.shape[1:]), v_shard.view(-1, *k.shape[1:])

    def store() -> None:
        K.store_kv(k, v, k_shard, v_shard, slots)

    def index_copy() -> None:
        kf.index_copy_(0, slots, k)
        vf.index_copy_(0, slots, v)

    def gather() -> tuple[torch.Tensor, torch.Tensor]:
        return K.gather_kv(k_shard, v_shard, slots)

    def index_select() -> tuple[torch.Tensor, torch.Tensor]:
        return kf.index_select(0, slots), vf.index_select(0, slots)

    store()
    assert torch.equal(kf[slots], k) and torch.equal(vf[slots], v), f"store_kv wrong at {case}"
    got, ref = gather(), naive.gather_kv(k_shard, v_shard, slots)
    assert torch.equal(got[0], ref[0]) and torch.equal(got[1], ref[1]), "gather_kv wrong"
    del got, ref
    b.add("store_kv", case, nbytes, store, ("index_copy_", index_copy) if with_baseline else None)
    b.add(
        "gather_kv", case, nbytes, gather, ("index_select", index_select) if with_baseline else None
    )


def sweep(b: Bench, K, naive) -> None:
    """Try tuning constants and print one row per setting (module constants are patched)."""
    wrt = importlib.import_module("cpkv.kernels.write_req_to_token")
    store = importlib.import_module("cpkv.kernels.store_kv")
    gather = importlib.import_module("cpkv.kernels.gather_kv")
    names = ("BLOCK", "TILE_ELEMS", "NUM_WARPS")
    saved = {m: {n: getattr(m, n) for n in names if hasattr(m, n)} for m in (wrt, store, gather)}
    try:
        for block in (512, 1024, 2048, 4096):
            for warps in (4, 8):
                wrt.BLOCK, wrt.NUM_WARPS = block, warps
                before = len(b.rows)
                bench_write_req_to_token(b, K, naive, with_baseline=False)
                for row in b.rows[before:]:
                    row.kernel += f" [BLOCK={block} warps={warps}]"
        for tile in (2048, 4096, 8192, 16384):
            for warps in (4, 8):
                for mod in (store, gather):
                    mod.TILE_ELEMS, mod.NUM_WARPS = tile, warps
                before = len(b.rows)
                bench_kv(b, K, naive, with_baseline=False)
                for row in b.rows[before:]:
                    row.kernel += f" [TILE={tile} warps={warps}]"
    finally:
        for mod, constants in saved.items():
            for name, value in constants.items():
                setattr(mod, name, value)


def print_table(b: Bench) -> None:
    head = (
        f"{'kernel':<44} {'case':<34} {'MB':>8} {'us':>9} {'GB/s':>8} {'copy%':>6} "
        f"{'baseline':<20} {'base us':>9} {'speedup':>8}"
    )
    print(head)
    print("-" * len(head))
    for r in b.rows:
        base = f"{r.baseline:<20} {r.baseline_us:>9.1f} {r.speedup:>7.1f}x" if r.baseline else ""
        print(
            f"{r.kernel:<44} {r.case:<34} {r.bytes_moved / 1e6:>8.1f} {r.us:>9.1f} "
            f"{r.gbps:>8.0f} {100 * r.copy_ratio:>5.0f}% {base}"
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
    from cpkv.kernels import naive

    meta = {
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "python": sys.version.split()[0],
    }
    print(" | ".join(f"{k} {v}" for k, v in meta.items()))
    b = Bench()
    print(f"device copy (dst.copy_(src), {COPY_BYTES >> 30} GiB): {b.copy_gbps:.0f} GB/s")
    bench_write_req_to_token(b, K, naive)
    bench_get_last_loc(b, K, naive)
    bench_alloc_extend_slots(b, K, naive)
    bench_kv(b, K, naive)
    if args.sweep:
        sweep(b, K, naive)
    print_table(b)
    if args.json:
        payload = {**meta, "copy_gbps": b.copy_gbps, "rows": [asdict(r) for r in b.rows]}
        args.json.write_text(json.dumps(payload, indent=2))
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
