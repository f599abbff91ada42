"""``cpkv demo``: chunked prefill of shared-prefix prompts under memory pressure.

Worker threads play prefill jobs: each takes a prompt, allocates it chunk by
chunk (backing off on KVCapacityWaitError), stores its K/V through the lanes,
decodes a few tokens, reads all its K/V back and checks it, then frees with
caching. The pool is sized so that prefix eviction and capacity waits happen.
"""

from __future__ import annotations

import queue
import threading
import time
from dataclasses import dataclass, field

import numpy as np

from cpkv.errors import KVCapacityWaitError
from cpkv.workload import kv_for_tokens, shared_prefix_prompts

__all__ = ["DemoConfig", "run_demo"]


@dataclass(slots=True)
class DemoConfig:
    cp_size: int = 4
    page_size: int = 16
    num_pages_per_lane: int = 56
    num_prompts: int = 32
    chunk_len: int = 256
    decode_tokens: int = 8
    workers: int = 4
    num_heads: int = 2
    head_dim: int = 16
    address: str | None = None
    num_gpus_per_lane: float | None = None
    deadline_s: float = 1.0
    max_attempts: int = 50
    progress: bool = True
    seed: int = 0


@dataclass(slots=True)
class _Tally:
    done: int = 0
    aborted: int = 0
    tokens_prefilled: int = 0
    tokens_verified: int = 0
    kv_mismatches: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)


def _serve(client, prompt: np.ndarray, rid: str, cfg: DemoConfig, tally: _Tally) -> bool:
    """One request: chunked prefill, decode, verify, free. False if it had to give up."""
    slots_all = []
    pos = 0
    try:
        while pos < prompt.size:
            chunk = prompt[pos : pos + cfg.chunk_len] if pos else prompt[: cfg.chunk_len]
            alloc = client.allocate_extend_with_backoff(rid, chunk, deadline_s=cfg.deadline_s)
            start = pos + alloc.cached_len if pos == 0 else pos
            if pos == 0 and alloc.cached_len:
                slots_all.append(alloc.cached_slots)
            new = np.arange(start, start + alloc.extend_len)
            k, v = kv_for_tokens(prompt[new], new, cfg.num_heads, cfg.head_dim)
            slots = alloc.out_cache_loc
            client.store_kv(slots, k, v)
            slots_all.append(slots)
            pos = start + alloc.extend_len
            with tally.lock:
                tally.tokens_prefilled += alloc.extend_len
        tokens = prompt
        for i in range(cfg.decode_tokens):
            tok = np.array([(int(tokens[-1]) * 31 + i) % 1000])
            (slot,) = client.allocate_decode([rid], tok)
            position = np.array([tokens.size])
            k, v = kv_for_tokens(tok, position, cfg.num_heads, cfg.head_dim)
            client.store_kv([slot], k, v)
            slots_all.append(np.array([slot]))
            tokens = np.concatenate([tokens, tok])
    except KVCapacityWaitError:
        if rid in client.live_rids:  # mid-prefill: give its pages back, retry later
            client.free(rid, cache=False)
        return False
    slots = np.concatenate(slots_all)
    k, v = client.gather_kv(slots)
    want_k, want_v = kv_for_tokens(tokens, np.arange(tokens.size), cfg.num_heads, cfg.head_dim)
    ok = bool((k == want_k).all() and (v == want_v).all())
    client.free(rid, cache=True)
    with tally.lock:
        tally.tokens_verified += tokens.size
        tally.kv_mismatches += 0 if ok else 1
    return True


def run_demo(cfg: DemoConfig, out=print) -> int:
    """Run the demo; return the process exit code (0 only if every check holds)."""
    import cpkv

    t0 = time.monotonic()
    client = cpkv.connect(
        cfg.address,
        cp_size=cfg.cp_size,
        page_size=cfg.page_size,
        num_pages_per_lane=cfg.num_pages_per_lane,
        max_reqs=64,
        max_context_len=1 << 16,
        num_heads=cfg.num_heads,
        head_dim=cfg.head_dim,
        dtype="float32",
        num_gpus_per_lane=cfg.num_gpus_per_lane,
        name=f"cpkv-demo-{time.time_ns()}",
        heartbeat_s=0.5,
    )
    try:
        return _run(client, cfg, out, t0)
    finally:
        client.shutdown()


def _run(client, cfg: DemoConfig, out, t0: float) -> int:
    from tqdm import tqdm

    prompts = shared_prefix_prompts(cfg.num_prompts, seed=cfg.seed)
    work: queue.Queue = queue.Queue()
    for i, p in enumerate(prompts):
        work.put((i, p, 0))
    tally = _Tally()
    bar = tqdm(
        total=len(prompts), desc="prefill", unit="req", disable=not cfg.progress, leave=False
    )
    failed: list[str] = []

    def worker() -> None:
        while True:
            try:
                i, prompt, attempt = work.get_nowait()
            except queue.Empty:
                return
            rid = f"req{i}.{attempt}"
            try:
                served = _serve(client, prompt, rid, cfg, tally)
            except Exception as e:  # report, keep the other workers going
                failed.append(f"{rid}: {type(e).__name__}: {e}")
                continue
            if served:
                with tally.lock:
                    tally.done += 1
                bar.update(1)
            elif attempt + 1 < cfg.max_attempts:
                with tally.lock:
                    tally.aborted += 1
                time.sleep(0.01 * (attempt + 1))
                work.put((i, prompt, attempt + 1))
            else:
                failed.append(f"{rid}: gave up after {attempt + 1} attempts")

    threads = [threading.Thread(target=worker) for _ in range(cfg.workers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    bar.close()
    elapsed = time.monotonic() - t0
    stats = client.stats()
    lanes = client.lane_info()
    report = client.check()
    out(_table(stats, lanes))
    out("")
    ok = (
        not failed
        and tally.done == len(prompts)
        and tally.kv_mismatches == 0
        and report["ok"]
        and sum(stats["used"]) == 0
        and stats["num_requests"] == 0
    )
    total = stats["num_pages_per_lane"]
    balanced = all(
        f + u + c + r == total
        for f, u, c, r in zip(
            stats["free"], stats["used"], stats["cached"], stats["reserved"], strict=True
        )
    )
    ok = ok and balanced
    out(
        f"requests served      {tally.done}/{len(prompts)} "
        f"(aborted and retried after waits: {tally.aborted})"
    )
    out(
        f"tokens prefilled     {tally.tokens_prefilled}  "
        f"(cached prefix tokens reused: {stats['cached_tokens_hit']})"
    )
    out(
        f"K/V verified         {tally.tokens_verified} tokens, mismatching requests: "
        f"{tally.kv_mismatches}"
    )
    out(
        f"allocations          {stats['extend_allocations']} extend, "
        f"{stats['decode_allocations']} decode; owner-plan fallbacks "
        f"{stats['fallbacks_by_reason']}"
    )
    out(
        f"pressure             {stats['pages_evicted']} pages evicted in "
        f"{stats['evict_calls']} evictions, {stats['capacity_waits']} capacity waits"
    )
    out(
        f"accounting           {'exact' if balanced and report['ok'] else 'BROKEN'}: "
        f"lanes agree with the mirror: {report['ok']} {report['problems'] or ''}"
    )
    for line in failed[:5]:
        out(f"failed: {line}")
    out(f"{'OK' if ok else 'FAILED'} in {elapsed:.1f}s")
    return 0 if ok else 1


def _table(stats: dict, lanes: list[dict]) -> str:
    head = f"{'lane':>4} {'device':>8} {'used':>6} {'cached':>7} {'free':>6} {'held':>6}"
    rows = [head, "-" * len(head)]
    for r, info in enumerate(lanes):
        rows.append(
            f"{r:>4} {info['device']:>8} {stats['used'][r]:>6} {stats['cached'][r]:>7} "
            f"{stats['free'][r]:>6} {info['held']:>6}"
        )
    return "\n".join(rows)
