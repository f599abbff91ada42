"""Decision-core benchmark: owner plans, allocate/free cycles, metadata per page.

Every ratio is measured side by side in this one run:
    python benchmarks/bench_core.py [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import platform
import time

import numpy as np

from cpkv import CPAllocator, build_in_seq_page_compute_owners
from cpkv.core.page_hash import PageHasher


def loop_owners(extend_len: int, page_size: int, cp_size: int) -> list[int]:
    """The per-page Python loop the vectorised plan replaces (same result)."""
    n = -(-extend_len // page_size)
    segs = 2 * cp_size
    base, extra = divmod(n, segs)
    owners = []
    for page in range(n):
        boundary = extra * (base + 1)
        seg = page // (base + 1) if page < boundary else extra + (page - boundary) // base
        owners.append(seg if seg < cp_size else segs - 1 - seg)
    return owners


def best_of(fn, repeat: int, number: int) -> float:
    """Best mean seconds per call over ``repeat`` runs of ``number`` calls."""
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        for _ in range(number):
            fn()
        best = min(best, (time.perf_counter() - t0) / number)
    return best


def bench_owner_plan() -> dict:
    args = (1 << 20, 0, 64, 8)
    vec = build_in_seq_page_compute_owners(*args)
    assert vec.tolist() == loop_owners(args[0], args[2], args[3])
    t_vec = best_of(lambda: build_in_seq_page_compute_owners(*args), 5, 200)
    t_loop = best_of(lambda: loop_owners(args[0], args[2], args[3]), 3, 3)
    return {"plan_1M_us": t_vec * 1e6, "loop_1M_us": t_loop * 1e6, "speedup": t_loop / t_vec}


def bench_cycles(cache: bool, materialize: bool, seconds: float = 2.0) -> float:
    cp, ps, ctx = 8, 64, 128 * 1024
    a = CPAllocator(cp, ps, num_pages_per_lane=2048, max_reqs=64, max_context_len=ctx)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, 150_000, size=ctx, dtype=np.int64) for _ in range(16)]
    n = 0
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        alloc = a.allocate_extend(n, prompts[n % len(prompts)])
        if materialize:
            alloc.out_cache_loc  # noqa: B018 - the int64 slot per token
        a.free(n, cache=cache)
        n += 1
    rate = n / (time.perf_counter() - t0)
    a.check_invariants()
    return rate


def old_public_hash(tokens: np.ndarray, page_size: int) -> np.ndarray:
    """The hash cpkv used before: linear in the tokens, multipliers fixed in the source
    (forgeable; kept here only as the speed baseline)."""
    rng = np.random.default_rng(0x6370_6B76 + page_size)
    m = rng.integers(1, 2**63, size=page_size, dtype=np.uint64) | np.uint64(1)
    n = tokens.shape[0] // page_size
    h = tokens[: n * page_size].view(np.uint64).reshape(n, page_size) @ m
    h ^= h >> np.uint64(31)
    h *= np.uint64(0x9E3779B97F4A7C15)
    h ^= h >> np.uint64(29)
    return h


def chained_digest(tokens: np.ndarray, page_size: int, algo: str) -> list[bytes]:
    """One hashlib digest per page chained on its parent's (vLLM's sha256 scheme, minus
    its pickling): the cryptographic alternative."""
    import hashlib

    data = tokens.tobytes()
    step = page_size * 8
    prev, out = b"salt", []
    for i in range(tokens.shape[0] // page_size):
        h = hashlib.new(algo, prev)
        h.update(data[i * step : (i + 1) * step])
        prev = h.digest()
        out.append(prev)
    return out


def bench_page_identity() -> dict:
    """Identify a 128k-token prompt: every page's hash, one core."""
    tokens = np.random.default_rng(2).integers(0, 150_000, size=128 * 1024, dtype=np.int64)
    out = {}
    for ps in (64, 16):
        hasher = PageHasher(ps)
        start = hasher.start()
        keyed = lambda h=hasher, s=start: h.hash_pages(tokens, s)
        out[f"keyed_ps{ps}_ms"] = best_of(keyed, 5, 20) * 1e3
        old = lambda p=ps: old_public_hash(tokens, p)
        out[f"old_public_ps{ps}_ms"] = best_of(old, 5, 20) * 1e3
        for algo in ("sha256", "blake2b"):
            t = best_of(lambda a=algo, p=ps: chained_digest(tokens, p, a), 3, 3)
            out[f"{algo}_chain_ps{ps}_ms"] = t * 1e3
    return out


def bench_metadata() -> float:
    cp, ps, pages = 8, 64, 4096
    a = CPAllocator(cp, ps, num_pages_per_lane=pages, max_reqs=64, max_context_len=1 << 21)
    rng = np.random.default_rng(1)
    # Half the pool in running requests, half in the prefix cache.
    per_req = 128 * 1024
    for i in range(8):
        a.allocate_extend(i, rng.integers(0, 150_000, size=per_req, dtype=np.int64))
    for i in range(4):
        a.free(i)
    a.check_invariants()
    return a.metadata_nbytes() / (cp * pages)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--json", help="write results here")
    parser.add_argument("--seconds", type=float, default=2.0, help="time per cycle benchmark")
    args = parser.parse_args()
    print(
        f"cpkv core benchmark on {platform.processor() or platform.machine()}, "
        f"python {platform.python_version()}, numpy {np.__version__}, one core"
    )
    res: dict = {"owner_plan": bench_owner_plan()}
    op = res["owner_plan"]
    print(
        f"owner plan, 1M tokens, page 64, cp 8: {op['plan_1M_us']:.1f} us vectorised vs "
        f"{op['loop_1M_us']:.0f} us per-page loop -> {op['speedup']:.0f}x (target >= 20x)"
    )
    for cache, mat in ((False, False), (False, True), (True, False), (True, True)):
        rate = bench_cycles(cache, mat, args.seconds)
        key = f"cycles_per_s_cache{int(cache)}_slots{int(mat)}"
        res[key] = rate
        print(
            f"allocate_extend+free, 128k tokens, cp 8, cache={cache!s:5} "
            f"materialize slots={mat!s:5}: {rate:8.0f} cycles/s (target >= 2000)"
        )
    res["page_identity"] = pid = bench_page_identity()
    for ps in (64, 16):
        print(
            f"identify a 128k-token prompt, page {ps}: keyed chained hash "
            f"{pid[f'keyed_ps{ps}_ms']:.2f} ms (target <= 1 ms) vs old public linear hash "
            f"{pid[f'old_public_ps{ps}_ms']:.2f} ms, sha256 chain "
            f"{pid[f'sha256_chain_ps{ps}_ms']:.2f} ms, blake2b chain "
            f"{pid[f'blake2b_chain_ps{ps}_ms']:.2f} ms"
        )
    res["metadata_bytes_per_page"] = bench_metadata()
    print(
        f"metadata bytes per page (pool half running, half cached): "
        f"{res['metadata_bytes_per_page']:.2f} (target <= 16)"
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=2)


if __name__ == "__main__":
    main()
