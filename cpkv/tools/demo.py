"""``cpkv demo``: a small Llama prefilled and decoded across the lanes, checked on one device.

The model (random weights from a seed, or a local checkpoint directory) runs on ``cp_size``
lanes. Worker threads play prefill jobs: each takes a prompt (prompts share a few prefixes),
prefills it chunk by chunk with :meth:`cpkv.client.CPKVClient.prefill` (capacity waits back
off until a deadline; a request that cannot go on is freed without caching and queued again),
decodes a few tokens greedily with :meth:`cpkv.client.CPKVClient.decode`, and frees the
request with caching. The pool is sized so that prefix eviction and capacity waits happen.

Every request's last-token logits after its last prefill chunk and after each decode step are
compared with a single-device run of the same weights in this process: the whole sequence
through :meth:`cpkv.models.LlamaModel.forward` with plain causal
``torch.nn.functional.scaled_dot_product_attention`` (KV heads repeated for GQA). The demo
exits 0 only when every comparison is within tolerance and the pool's accounting is exact.

When this process has no Ray yet, the demo starts its own, quietly (no lane log lines or Ray
warnings through the progress bar), and stops it at the end; a Ray already initialised (tests,
notebooks) is used as it is and left running.
"""

from __future__ import annotations

import contextlib
import logging
import math
import queue
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from cpkv.core.layout import PageLayout
from cpkv.errors import KVCapacityWaitError
from cpkv.models.config import ModelConfig
from cpkv.models.presets import small_config
from cpkv.tools.workload import shared_prefix_prompts

__all__ = [
    "DemoConfig",
    "DemoResult",
    "Reference",
    "auto_pages_per_lane",
    "lane_pages_for",
    "longest_request",
    "rel_err",
    "run",
    "run_demo",
    "tolerance_for",
]

logger = logging.getLogger("cpkv.tools.demo")

#: Relative error (``max |got - want| / max |want|``) allowed per model dtype. fp32 lanes and
#: reference differ by summation order only; bf16 / fp16 round every layer's activations, and
#: the lanes' partial-attention merge rounds differently from SDPA.
TOLERANCES = {"float32": 1e-3, "float16": 1e-2, "bfloat16": 5e-2}


def tolerance_for(dtype: str) -> float:
    """The relative logits error the demo allows for a model of ``dtype``."""
    return TOLERANCES.get(dtype, TOLERANCES["bfloat16"])


@dataclass(slots=True)
class DemoConfig:
    """What the demo runs.

    Attributes:
        cp_size: lanes.
        page_size: tokens per page.
        num_pages_per_lane: the pool; ``None`` sizes it from the workload so that the workers'
            requests do not all fit at once (eviction and capacity waits happen) while the
            largest request fits alone.
        num_prompts: prompts served.
        num_prefixes, prefix_len: prompts share ``num_prefixes`` prefixes of this many tokens.
        suffix_lens: ``[low, high)`` of each prompt's own suffix (lengths are made odd).
        chunk_len: tokens per prefill chunk.
        decode_tokens: greedy decode steps per request (each one checked).
        workers: threads serving prompts at once.
        model_dir: a local Hugging Face checkpoint directory; ``None``: random weights.
        model_config: the architecture of random weights (``None``:
            :func:`cpkv.models.small_config`).
        seed: the weights' seed (random weights) and the prompts' seed.
        reference_seed: the seed of the reference's weights (``None``: ``seed``); a different
            one makes every check fail (the demo's own test of its checking).
        tolerance: allowed relative logits error; ``None``: :func:`tolerance_for` the dtype.
        address: ``None`` for a local Ray (started quietly when this process has none),
            ``"auto"`` or ``"ray://..."`` to attach.
        num_gpus_per_lane: as :func:`cpkv.connect`.
        deadline_s: how long one step retries capacity waits before its request is requeued.
        max_attempts: attempts per prompt before the demo gives it up (and fails).
        progress: show a progress bar on stderr.
    """

    cp_size: int = 4
    page_size: int = 16
    num_pages_per_lane: int | None = None
    num_prompts: int = 24
    num_prefixes: int = 3
    prefix_len: int = 200
    suffix_lens: tuple[int, int] = (101, 480)
    chunk_len: int = 256
    decode_tokens: int = 3
    workers: int = 4
    model_dir: str | None = None
    model_config: ModelConfig | None = None
    seed: int = 0
    reference_seed: int | None = None
    tolerance: float | None = None
    address: str | None = None
    num_gpus_per_lane: float | None = None
    deadline_s: float = 0.5
    max_attempts: int = 50
    progress: bool = True


@dataclass(slots=True)
class _Tally:
    """Counts the worker threads add up (under ``lock``)."""

    cp_size: int
    done: int = 0
    aborted: int = 0
    prefill_steps: int = 0
    decode_steps: int = 0
    tokens_prefilled: int = 0
    tokens_decoded: int = 0
    cached_tokens: int = 0
    checks: int = 0
    mismatches: int = 0
    max_rel_err: float = 0.0
    requests_checked: int = 0
    lane_tokens: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    lane_seconds: np.ndarray = field(default_factory=lambda: np.zeros(0))
    worst: list[str] = field(default_factory=list)
    failed: list[str] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def __post_init__(self) -> None:
        self.lane_tokens = np.zeros(self.cp_size, np.int64)
        self.lane_seconds = np.zeros(self.cp_size)


@dataclass(slots=True)
class DemoResult:
    """What one demo run found.

    Attributes:
        exit_code: 0 only when every check held.
        ok: ``exit_code == 0``.
        wall_s: the whole run (Ray and lanes started, every prompt served).
        serve_s: serving the prompts only.
        num_prompts: prompts asked for.
        served: prompts served to the end (prefill, decode, checks, free).
        aborted: attempts given up under capacity pressure and queued again.
        checks: logits compared with the reference (aborted attempts' too).
        requests_checked: served requests whose last chunk and every decode step were checked.
        mismatches: comparisons over the tolerance.
        max_rel_err: the largest relative error seen.
        tolerance: the relative error allowed.
        tokens_prefilled: tokens the lanes computed in prefill steps.
        tokens_decoded: tokens decoded.
        cached_tokens: prompt tokens served from the prefix cache instead.
        tokens_per_s: (prefilled + decoded) tokens per second of serving.
        lane_tokens: prefill tokens each lane computed (the lane of each new token's page).
        lane_seconds: each lane's seconds in its prefill steps (its work and its waits in
            the lanes' collectives: :attr:`cpkv.client.PrefillResult.lane_seconds`).
        accounting_exact: the coordinator's check holds, no request is left and every page is
            free or cached.
        stats: the coordinator's final :meth:`cpkv.client.CPKVClient.stats`.
        failed: requests that failed, with why.
    """

    exit_code: int
    wall_s: float
    serve_s: float
    num_prompts: int
    served: int
    aborted: int
    checks: int
    requests_checked: int
    mismatches: int
    max_rel_err: float
    tolerance: float
    tokens_prefilled: int
    tokens_decoded: int
    cached_tokens: int
    tokens_per_s: float
    lane_tokens: list[int]
    lane_seconds: list[float]
    accounting_exact: bool
    stats: dict
    failed: list[str]

    @property
    def ok(self) -> bool:
        return self.exit_code == 0


class Reference:
    """The same weights on one device (this process): whole-sequence causal SDPA.

    Args:
        model: a :class:`cpkv.models.LlamaModel` (CPU).
    """

    def __init__(self, model) -> None:
        self.model = model
        self._lock = threading.Lock()

    @classmethod
    def load(cls, cfg: DemoConfig, model_config: ModelConfig) -> Reference:
        """The reference model the demo's config names (``reference_seed`` for random weights)."""
        from cpkv.models import LlamaModel

        if cfg.model_dir is not None:
            return cls(LlamaModel.from_dir(cfg.model_dir, dtype=model_config.dtype))
        seed = cfg.seed if cfg.reference_seed is None else cfg.reference_seed
        return cls(LlamaModel.random(model_config, seed))

    def _attend(self, layer: int, q, k, v):
        import torch.nn.functional as F

        group = q.shape[1] // k.shape[1]
        k = k.repeat_interleave(group, dim=1)  # GQA: query head h reads KV head h // group
        v = v.repeat_interleave(group, dim=1)
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1),
            k.transpose(0, 1),
            v.transpose(0, 1),
            is_causal=True,
            scale=self.model.sm_scale,
        )
        return out.transpose(0, 1)

    def last_logits(self, tokens: np.ndarray) -> np.ndarray:
        """fp32 ``[vocab]`` logits of the last token of ``tokens`` (a whole sequence)."""
        import torch

        # NOTE: one at a time: the workers share two cores with the lanes, and a serial
        # reference keeps its latency (and the lanes' share of the cores) steady.
        with self._lock, torch.no_grad():
            ids = torch.as_tensor(np.asarray(tokens, dtype=np.int64))
            hidden = self.model.forward(ids, torch.arange(ids.shape[0]), self._attend)
            return self.model.logits(hidden[-1:])[0].numpy()


def rel_err(got: np.ndarray, want: np.ndarray) -> float:
    """``max |got - want| / max |want|`` (inf when the shapes differ or anything is not finite)."""
    if got.shape != want.shape or not (np.isfinite(got).all() and np.isfinite(want).all()):
        return math.inf
    return float(np.abs(got - want).max() / max(float(np.abs(want).max()), 1e-30))


def longest_request(cfg: DemoConfig) -> int:
    """Tokens of ``cfg``'s longest request: the prefix, the longest suffix, the decodes."""
    return cfg.prefix_len + cfg.suffix_lens[1] + cfg.decode_tokens


def lane_pages_for(layout: PageLayout, pages: int) -> int:
    """Pages per lane (reserved page included) that hold ``pages`` over the lanes."""
    # NOTE: one request's pages are spread within a page of even over the lanes (zigzag
    # segments, rotation); the +2 keeps the largest request placeable on any lane.
    return layout.pages_per_lane_for(pages) + 2


def auto_pages_per_lane(cfg: DemoConfig) -> int:
    """Pages per lane (reserved page included) for ``cfg``'s workload: the largest request
    fits alone with room to spare, but the workers' requests together do not fit."""
    layout = PageLayout(cfg.cp_size, cfg.page_size)
    mean = cfg.prefix_len + sum(cfg.suffix_lens) / 2 + cfg.decode_tokens
    biggest = layout.pages_for(longest_request(cfg)) + 1
    total = max(
        math.ceil(1.5 * biggest), math.ceil(0.75 * max(1, cfg.workers) * mean / cfg.page_size)
    )
    return lane_pages_for(layout, total)


class _Serve:
    """One demo run's shared state: the client, the reference, the prompts and the tally."""

    def __init__(self, client, ref: Reference, cfg: DemoConfig, tol: float, bar) -> None:
        self.client = client
        self.ref = ref
        self.cfg = cfg
        self.tol = tol
        self.bar = bar
        self.tally = _Tally(cfg.cp_size)
        self.layout = PageLayout(cfg.cp_size, client.config.page_size)

    def _record_prefill(self, res) -> None:
        alloc = res.allocation
        counts = self.layout.count_by_lane(alloc.out_cache_loc // self.layout.page_size)
        t = self.tally
        with t.lock:
            t.prefill_steps += 1
            t.tokens_prefilled += alloc.extend_len
            t.cached_tokens += alloc.cached_len
            t.lane_tokens += counts
            t.lane_seconds += np.asarray(res.lane_seconds, dtype=np.float64)

    def _check(self, rid: str, tokens: np.ndarray, got: np.ndarray) -> bool:
        err = rel_err(np.asarray(got, dtype=np.float32), self.ref.last_logits(tokens))
        bad = not err < self.tol
        t = self.tally
        with t.lock:
            t.checks += 1
            t.max_rel_err = max(t.max_rel_err, err)
            if bad:
                t.mismatches += 1
                if len(t.worst) < 5:
                    t.worst.append(f"{rid} at {tokens.size} tokens: relative error {err:.3g}")
        return not bad

    def _decode(self, rid: str, token: int) -> np.ndarray:
        """One decode step, retrying capacity waits until the deadline."""
        return self.client.decode([rid], [token], deadline_s=self.cfg.deadline_s)[0]

    def serve(self, prompt: np.ndarray, rid: str) -> bool:
        """One request: chunked prefill, check, decode and check, free. False: gave up under
        pressure (its pages are freed; the caller queues it again)."""
        cfg, client = self.cfg, self.client
        try:
            pos, res = 0, None
            while pos < prompt.size:
                chunk = prompt[pos : pos + cfg.chunk_len]
                res = client.prefill(rid, chunk, deadline_s=cfg.deadline_s)
                self._record_prefill(res)
                pos += chunk.size
            checked = int(self._check(rid, prompt, res.logits))
            seq, logits = prompt, res.logits
            for _ in range(cfg.decode_tokens):
                token = int(np.argmax(logits))
                logits = self._decode(rid, token)
                seq = np.append(seq, token)
                checked += int(self._check(rid, seq, logits))
                with self.tally.lock:
                    self.tally.decode_steps += 1
                    self.tally.tokens_decoded += 1
        except KVCapacityWaitError:
            if rid in client.live_rids:  # mid-request: give its pages back, retry later
                client.free(rid, cache=False)
            return False
        client.free(rid, cache=True)
        with self.tally.lock:
            self.tally.requests_checked += int(checked == 1 + cfg.decode_tokens)
        return True

    def worker(self, work: queue.Queue) -> None:
        """Serve prompts from ``work`` until it is empty."""
        t = self.tally
        while True:
            try:
                i, prompt, attempt = work.get_nowait()
            except queue.Empty:
                return
            rid = f"demo{i}.{attempt}"
            try:
                served = self.serve(prompt, rid)
            except Exception as e:  # report it, keep the other workers going
                with t.lock:
                    t.failed.append(f"{rid}: {type(e).__name__}: {e}")
                with contextlib.suppress(Exception):
                    if rid in self.client.live_rids:
                        self.client.free(rid, cache=False)
                continue
            if served:
                with t.lock:
                    t.done += 1
                    errs = t.max_rel_err
                self.bar.set_postfix_str(f"max rel err {errs:.1e}", refresh=False)
                self.bar.update(1)
            elif attempt + 1 < self.cfg.max_attempts:
                with t.lock:
                    t.aborted += 1
                time.sleep(0.01 * (attempt + 1))
                work.put((i, prompt, attempt + 1))
            else:
                with t.lock:
                    t.failed.append(f"{rid}: gave up after {attempt + 1} attempts")


def run(cfg: DemoConfig, out: Callable[[str], object] = print) -> DemoResult:
    """Run the demo, print its report through ``out``; the :class:`DemoResult`."""
    import cpkv
    from cpkv.actors.ray_env import tool_ray

    t0 = time.monotonic()
    if cfg.model_dir is not None:
        model_config = ModelConfig.from_dir(cfg.model_dir)
        model: object = cfg.model_dir
    else:
        model_config = cfg.model_config or small_config()
        model = model_config
    tol = cfg.tolerance if cfg.tolerance is not None else tolerance_for(model_config.dtype)
    with tool_ray(cfg.address, num_lanes=cfg.cp_size):
        pages = cfg.num_pages_per_lane
        if pages is None:
            pages = auto_pages_per_lane(cfg)
        longest = longest_request(cfg)
        client = cpkv.connect(
            cfg.address,
            cp_size=cfg.cp_size,
            page_size=cfg.page_size,
            num_pages_per_lane=pages,
            max_reqs=max(16, 4 * cfg.workers),
            max_context_len=max(longest, 1024),
            num_gpus_per_lane=cfg.num_gpus_per_lane,
            name=f"cpkv-demo-{time.time_ns()}",
            heartbeat_s=0.5,
            model=model,
            model_seed=cfg.seed if cfg.model_dir is None else None,
        )
        try:
            ref = Reference.load(cfg, model_config)
            return _run(client, ref, cfg, tol, out, t0)
        finally:
            client.shutdown()


def run_demo(cfg: DemoConfig, out: Callable[[str], object] = print) -> int:
    """Run the demo; the process exit code (0 only if every check holds)."""
    return run(cfg, out).exit_code


def _run(client, ref: Reference, cfg: DemoConfig, tol: float, out, t0: float) -> DemoResult:
    from tqdm import tqdm
    from tqdm.contrib.logging import logging_redirect_tqdm

    vocab = ref.model.config.vocab_size
    prompts = shared_prefix_prompts(
        cfg.num_prompts,
        num_prefixes=cfg.num_prefixes,
        prefix_len=cfg.prefix_len,
        suffix_lens=cfg.suffix_lens,
        vocab=vocab,
        seed=cfg.seed,
        odd_lengths=True,
    )
    work: queue.Queue = queue.Queue()
    for i, p in enumerate(prompts):
        work.put((i, p, 0))
    bar = tqdm(
        total=len(prompts),
        desc="requests",
        unit="req",
        disable=not cfg.progress,
        file=sys.stderr,
        dynamic_ncols=True,
    )
    serve = _Serve(client, ref, cfg, tol, bar)
    t1 = time.monotonic()
    # NOTE: this process's log records go through tqdm.write, above the bar, not through it.
    with logging_redirect_tqdm():
        threads = [
            threading.Thread(target=serve.worker, args=(work,), name=f"cpkv-demo-{w}")
            for w in range(max(1, cfg.workers))
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    bar.close()
    serve_s = time.monotonic() - t1
    tally = serve.tally
    report = client.check()  # first: it sends the page moves still waiting to the lanes
    stats = client.stats()
    lanes = client.lane_info()
    total = stats["num_pages_per_lane"]
    every_page_home = all(
        u == 0 and f + c + r == total
        for f, u, c, r in zip(
            stats["free"], stats["used"], stats["cached"], stats["reserved"], strict=True
        )
    )
    exact = bool(report["ok"]) and every_page_home and stats["num_requests"] == 0
    expected_checks = len(prompts) * (1 + cfg.decode_tokens)
    ok = (
        not tally.failed
        and tally.done == len(prompts)
        and tally.mismatches == 0
        and tally.requests_checked == len(prompts)
        and tally.checks >= expected_checks
        and exact
    )
    wall_s = time.monotonic() - t0
    tokens = tally.tokens_prefilled + tally.tokens_decoded
    tps = tokens / serve_s if serve_s > 0 else 0.0
    out(_table(stats, lanes, tally))
    out("")
    out(
        f"requests served      {tally.done}/{len(prompts)} "
        f"(aborted under pressure and retried: {tally.aborted})"
    )
    out(
        f"tokens prefilled     {tally.tokens_prefilled} in {tally.prefill_steps} steps  "
        f"(cached prefix tokens reused: {tally.cached_tokens}); decoded {tally.tokens_decoded}"
    )
    out(
        f"logits checked       {tally.checks} vs one device (SDPA, {ref.model.config.dtype}): "
        f"max relative error {tally.max_rel_err:.2e} (tolerance {tol:g}), "
        f"mismatches {tally.mismatches}"
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
        f"accounting           {'exact' if exact else 'BROKEN'}: lanes agree with the mirror: "
        f"{report['ok']} {report['problems'] or ''}".rstrip()
    )
    out(
        f"throughput           {tps:.0f} tokens/s ({tokens} tokens in {serve_s:.1f}s "
        f"on {cfg.cp_size} lanes, {cfg.workers} workers)"
    )
    for line in (tally.worst + tally.failed)[:8]:
        out(f"failed: {line}")
    out(f"{'OK' if ok else 'FAILED'} in {wall_s:.1f}s")
    return DemoResult(
        exit_code=0 if ok else 1,
        wall_s=wall_s,
        serve_s=serve_s,
        num_prompts=len(prompts),
        served=tally.done,
        aborted=tally.aborted,
        checks=tally.checks,
        requests_checked=tally.requests_checked,
        mismatches=tally.mismatches,
        max_rel_err=tally.max_rel_err,
        tolerance=tol,
        tokens_prefilled=tally.tokens_prefilled,
        tokens_decoded=tally.tokens_decoded,
        cached_tokens=tally.cached_tokens,
        tokens_per_s=tps,
        lane_tokens=[int(x) for x in tally.lane_tokens],
        lane_seconds=[float(x) for x in tally.lane_seconds],
        accounting_exact=exact,
        stats=stats,
        failed=list(tally.failed),
    )


def _table(stats: dict, lanes: list[dict], tally: _Tally) -> str:
    head = (
        f"{'lane':>4} {'device':>8} {'used':>6} {'cached':>7} {'free':>6} {'held':>6} "
        f"{'tokens':>8} {'step s':>10}"
    )
    rows = [head, "-" * len(head)]
    for r, info in enumerate(lanes):
        rows.append(
            f"{r:>4} {info['device']:>8} {stats['used'][r]:>6} {stats['cached'][r]:>7} "
            f"{stats['free'][r]:>6} {info['held']:>6} {int(tally.lane_tokens[r]):>8} "
            f"{tally.lane_seconds[r]:>10.2f}"
        )
    return "\n".join(rows)
