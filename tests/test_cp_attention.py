"""CP attention on the lanes vs single-device attention: plan, groups, both exchange modes.

Multi-lane cases run in 4 processes spawned once with torch.multiprocessing (no Ray), gloo on
127.0.0.1: they form groups of 4, 3 and 2 lanes one after another, each running every case,
then rebuild a group of 4 on a fresh port (as a restarted lane forces), so the file stays fast.
Each lane builds its shard as earlier steps would have left it (the cached prefix written at
its slots, unused pages filled with NaN so a stray read or write shows), runs
:class:`cpkv.lanes.attention.CPAttention` on the tokens it owns, and checks its outputs against
``scaled_dot_product_attention`` over the whole sequence (fp32, causal) and its shard against
the K/V every position of its pages must hold. World size 1 runs in this process. With a GPU,
every lane's shards and tensors are CUDA tensors on it (gloo stages them through the host).

Every multi-lane case runs twice: over gloo, and over the device exchange (``cuda_ipc``: CUDA IPC
buffers on a GPU, :class:`cpkv.lanes.ipc_device.FakeIpcDevice` on CPU, whose event waits check
the protocol's order).
"""

from __future__ import annotations

import json
import os
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.multiprocessing as mp
import torch.nn.functional as F

from cpkv.core.owners import build_owner_plan
from cpkv.core.steps import StepSequence
from cpkv.kernels._common import HAS_TRITON, interpreter_enabled
from cpkv.lanes.attention import MODES, CPAttention, exchange_costs, lane_exchange_bytes
from cpkv.lanes.comm import LaneGroup, choose_backend, free_port
from cpkv.lanes.ipc_device import FakeIpcDevice
from cpkv.lanes.step import StepPlan

HQ, HKV, D = 4, 2, 8
SCALE = D**-0.5
PAGE_SIZES = (4, 16)
GROUP_TIMEOUT_S = 60.0
# With a GPU every lane's tensors live on it (lanes share it: gloo, staged through host memory).
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


# --- cases (deterministic: every lane builds the same list) ---


@dataclass(frozen=True)
class Case:
    """One step: requests ``(prefix_len, extend_len)`` with their global pages."""

    name: str
    cp: int
    page_size: int
    mode: str
    lens: tuple[tuple[int, int], ...]
    pages: tuple[tuple[int, ...], ...]
    pages_per_lane: int
    seed: int
    dtype: str = "float32"

    def requests(self) -> list[StepSequence]:
        return [
            StepSequence(p, e, np.array(pg, dtype=np.int32))
            for (p, e), pg in zip(self.lens, self.pages, strict=True)
        ]


def assign_pages(
    cp: int, ps: int, lens: list[tuple[int, int]], rng: np.random.Generator
) -> tuple[tuple[tuple[int, ...], ...], int]:
    """Plausible global pages: the cached prefix's pages on arbitrary lanes; the new pages by
    the zigzag owner plan when one exists (single long extend), in rotation otherwise; local
    ids distinct per lane, shuffled, never the reserved page 0."""
    total = sum(-(-(p + e) // ps) for p, e in lens)
    pages_per_lane = total + 4
    free = [list(rng.permutation(np.arange(1, pages_per_lane))) for _ in range(cp)]
    out = []
    for p, e in lens:
        n_prefix = -(-p // ps)
        n_new = -(-(p + e) // ps) - n_prefix
        lanes = [int(x) for x in rng.integers(0, cp, n_prefix)]
        plan = build_owner_plan(e, p, ps, cp) if len(lens) == 1 else None
        if plan is not None:
            assert plan.num_pages == n_new
            lanes += [int(x) for x in plan.page_owners]
        else:
            start = int(rng.integers(0, cp))
            lanes += [(start + i) % cp for i in range(n_new)]
        out.append(tuple(int(free[lane].pop()) * cp + lane for lane in lanes))
    return tuple(out), pages_per_lane


def scenarios(cp: int, ps: int) -> dict[str, list[tuple[int, int]]]:
    """Step shapes; lengths are neither multiples of the page size nor of ``2 * cp``."""
    return {
        # one long fresh prefill: zigzag owners when cp >= 2
        "fresh_long": [(0, (2 * cp + 1) * ps + 3)],
        # cached page-aligned prefix on arbitrary lanes + a zigzag extend
        "prefix_aligned": [(3 * ps, 2 * cp * ps + 5)],
        # chunked continuation: the prefix ends mid-page, the step fills that page first
        "chunk_midpage": [(2 * ps + 3, 3 * ps + 1)],
        # a batch with different prefix lengths (none, mid-page, aligned, short)
        "batch": [(0, ps + 3), (ps + 1, 5), (2 * ps, 2 * ps + 1), (7, 1)],
        # decode: one token per request
        "decode": [(5, 1), (ps, 1), (3 * ps + 2, 1), (0, 1), (1, 1)],
        # fresh requests only (at cp=1 the SDPA route: each request's keys are its tokens)
        "fresh_batch": [(0, ps + 3), (0, 5), (0, 1)],
        # one short request: most lanes own no token and hold no key of it
        "tiny": [(0, 3)],
        "tiny_decode": [(2, 1)],
    }


def build_cases(cp: int) -> list[Case]:
    cases = []
    seed = 1000 * cp
    for ps in PAGE_SIZES:
        for name, lens in scenarios(cp, ps).items():
            for mode in MODES:
                seed += 1
                rng = np.random.default_rng(seed)
                pages, per_lane = assign_pages(cp, ps, lens, rng)
                cases.append(Case(name, cp, ps, mode, tuple(lens), pages, per_lane, seed))
    # every page on the last lane, a cached prefix among them (the paged route, not SDPA): a
    # solo step, which that lane runs alone; and a batch of two such requests
    if cp > 1:
        for name, lens in (("solo_prefix", [(6, 5)]), ("solo_batch", [(5, 2), (0, 3)])):
            for mode in MODES:
                seed += 1
                n_pages = [-(-(p + e) // 4) for p, e in lens]
                ids = iter(range(1, sum(n_pages) + 1))
                pages = tuple(tuple(next(ids) * cp + cp - 1 for _ in range(n)) for n in n_pages)
                cases.append(Case(name, cp, 4, mode, tuple(lens), pages, sum(n_pages) + 2, seed))
    # one bf16 case per mode: the exchanges carry the shard's dtype
    for mode in MODES:
        seed += 1
        lens = scenarios(cp, 4)["batch"]
        pages, per_lane = assign_pages(cp, 4, lens, np.random.default_rng(seed))
        cases.append(
            Case("batch_bf16", cp, 4, mode, tuple(lens), pages, per_lane, seed, "bfloat16")
        )
    return cases


# --- what one lane does for one case ---


def sequence_qkv(case: Case, b: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q ``[S, HQ, D]``, k and v ``[S, HKV, D]`` of request ``b`` at every position: a
    deterministic function of (case, request, position), so each lane can build its part."""
    s = sum(case.lens[b])
    g = torch.Generator().manual_seed(case.seed * 100 + b)
    dtype = getattr(torch, case.dtype)
    q = torch.randn(s, HQ, D, generator=g).to(dtype)
    k = torch.randn(s, HKV, D, generator=g).to(dtype)
    v = torch.randn(s, HKV, D, generator=g).to(dtype)
    return q, k, v


def reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Causal fp32 attention over the whole sequence on one device: ``[S, HQ, D]``."""
    rep = HQ // HKV
    qf = q.float().transpose(0, 1)[None]
    kf = k.float().repeat_interleave(rep, dim=1).transpose(0, 1)[None]
    vf = v.float().repeat_interleave(rep, dim=1).transpose(0, 1)[None]
    out = F.scaled_dot_product_attention(qf, kf, vf, is_causal=True, scale=SCALE)
    return out[0].transpose(0, 1)


def mismatch(got: torch.Tensor, want: torch.Tensor, tol: float, dtype: torch.dtype) -> str | None:
    """What differs between ``got`` and ``want`` (NaN must match NaN), or ``None``.

    NOTE: not torch.testing.assert_close: its first call imports torch.distributed.tensor,
    over a second in every spawned lane.
    """
    if got.dtype != dtype or got.shape != want.shape:
        return f"got {got.dtype} {tuple(got.shape)}, want {dtype} {tuple(want.shape)}"
    g, w = got.float(), want.float()
    nan_g, nan_w = torch.isnan(g), torch.isnan(w)
    if not torch.equal(nan_g, nan_w):
        return f"NaN at {int((nan_g != nan_w).sum())} elements where the other side has none"
    err = (g - w).abs().masked_fill(nan_w, 0)
    bad = err > tol + tol * w.abs().masked_fill(nan_w, 0)
    if bool(bad.any()):
        return f"{int(bad.sum())}/{bad.numel()} elements differ, max abs diff {float(err.max())}"
    return None


def run_case(group: LaneGroup, case: Case) -> dict:
    """Run one case on this lane; return what it saw (mismatches as strings, so every lane
    finishes the case's collectives and the parent sees all of them)."""
    lane, cp, ps = group.rank, case.cp, case.page_size
    dtype = getattr(torch, case.dtype)
    plan = StepPlan.build(case.requests(), cp, ps, lane)
    seqs = [sequence_qkv(case, b) for b in range(len(case.lens))]

    # Shards as earlier steps left them: pages of this step's requests zero, then the cached
    # prefix at its slots; every other page (the reserved one included) NaN.
    shape = (case.pages_per_lane, ps, HKV, D)
    k_shard = torch.full(shape, float("nan"), dtype=dtype)
    v_shard = torch.full(shape, float("nan"), dtype=dtype)
    expect_k, expect_v = k_shard.clone(), v_shard.clone()
    for b, ((prefix, ext), pages) in enumerate(zip(case.lens, case.pages, strict=True)):
        for i, g in enumerate(pages):
            if g % cp != lane:
                continue
            local = g // cp
            for shard in (k_shard, v_shard, expect_k, expect_v):
                shard[local] = 0
            hi = min(ps, prefix + ext - i * ps)
            expect_k[local, :hi] = seqs[b][1][i * ps : i * ps + hi]
            expect_v[local, :hi] = seqs[b][2][i * ps : i * ps + hi]
            hi = min(ps, max(0, prefix - i * ps))
            k_shard[local, :hi] = seqs[b][1][i * ps : i * ps + hi]
            v_shard[local, :hi] = seqs[b][2][i * ps : i * ps + hi]

    reqs = plan.token_request[plan.my_tokens].tolist()
    pos = plan.my_positions.tolist()
    n = len(pos)
    q = torch.stack([seqs[b][0][p] for b, p in zip(reqs, pos, strict=True)]) if n else None
    k = torch.stack([seqs[b][1][p] for b, p in zip(reqs, pos, strict=True)]) if n else None
    v = torch.stack([seqs[b][2][p] for b, p in zip(reqs, pos, strict=True)]) if n else None
    if n == 0:
        q = torch.zeros(0, HQ, D, dtype=dtype)
        k = torch.zeros(0, HKV, D, dtype=dtype)
        v = torch.zeros(0, HKV, D, dtype=dtype)

    errors: list[str] = []
    attn = CPAttention(group, plan, case.mode)
    # NOTE: an exception here propagates: the other lanes would now wait in (or mismatch)
    # collectives, so the lane process must end and mp.spawn report its traceback.
    on = [t.to(DEVICE) for t in (k_shard, v_shard, q, k, v)]
    group.take_wait_seconds()
    group.take_exchange_stats()
    out = attn.forward(*on, SCALE)
    wait_s = group.take_wait_seconds()
    moved = group.take_exchange_stats()
    k_shard, v_shard, out = on[0].cpu(), on[1].cpu(), out.cpu()

    refs = [reference(*s) for s in seqs]
    want = torch.stack([refs[b][p] for b, p in zip(reqs, pos, strict=True)]) if n else out
    tol = 1e-5 if case.dtype == "float32" else 2e-2
    # Partials merge in fp32; one lane's pass-Q output is the whole attention, in q's dtype,
    # as is a solo step's (one lane holds every page of it).
    one = (group.world_size == 1 and attn.last_mode == "pass_q") or attn.solo
    out_dtype = dtype if one else torch.float32
    for what, got, exp, t in (
        ("output", out, want, tol),
        ("k_shard", k_shard, expect_k, 0.0),
        ("v_shard", v_shard, expect_v, 0.0),
    ):
        problem = mismatch(got, exp, t, out_dtype if what == "output" else dtype)
        if problem:
            errors.append(f"{what}: {problem}")
    elt = torch.finfo(dtype).bits // 8
    planned = lane_exchange_bytes(plan, attn.last_mode, HQ, HKV, D, elt, elt)
    if planned != attn.exchange_bytes:
        errors.append(
            f"exchange bytes: the plan says {planned}, the call counted {attn.exchange_bytes}"
        )
    for b in range(len(case.lens)):
        if int(plan.last_token_owner[b]) == lane:
            i = int(plan.last_token_index[b])
            if (reqs[i], pos[i]) != (b, sum(case.lens[b]) - 1):
                errors.append(f"last token of request {b}: row {i} is {(reqs[i], pos[i])}")
    return {
        "case": case,
        "solo": attn.solo,
        "errors": errors,
        "mode": attn.last_mode,
        "bytes": attn.exchange_bytes,
        "n": n,
        "wait_s": wait_s,
        "bytes_read": moved.bytes_read,
    }


def summary(result: dict) -> dict:
    c: Case = result["case"]
    return {
        "id": f"{c.name}/ps{c.page_size}/{c.mode}",
        "name": c.name,
        "mode": c.mode,
        "solo": result["solo"],
        "errors": result["errors"],
        "last_mode": result["mode"],
        "bytes": result["bytes"],
        "n": result["n"],
        "wait_s": result["wait_s"],
        "bytes_read": result["bytes_read"],
    }


SLOW_S = 0.3  # how long lane 0 keeps the others waiting in the wait-clock probe


def slow_lane_waits(group: LaneGroup) -> float:
    """Lane 0 arrives ``SLOW_S`` late at a gather; the seconds this lane's clock counted."""
    group.take_wait_seconds()
    if group.rank == 0:
        time.sleep(SLOW_S)
    group.all_gather_rows(torch.ones(1, 4), [1] * group.world_size)
    return group.take_wait_seconds()


# Groups the same 4 spawned lanes form one after another: every world size, then a rebuild at
# 4 on a fresh port (a restarted lane forces this). Lanes outside a smaller group sit it out.
PHASES = (4, 3, 2, 4)
MAX_LANES = max(PHASES)


def lane_main(rank: int, ports: list[int], out_dir: str, backend: str) -> None:
    """A spawned lane: for each phase it belongs to, create the group, run every case (the
    rebuilt group: the first few), destroy it; write what it saw to ``rank<r>.json``."""
    if not torch.cuda.is_available():
        # NOTE: these tests check the exchange; the kernels are checked against their references
        # in test_kernels.py. Interpreted Triton (set there for CPU runs) would be slow here.
        os.environ.pop("TRITON_INTERPRET", None)
    torch.set_num_threads(1)
    report: dict = {"rank": rank, "phases": [], "fatal": None}
    try:
        for i, (world_size, port) in enumerate(zip(PHASES, ports, strict=True)):
            if rank >= world_size:
                report["phases"].append(None)
                continue
            # cuda_ipc on CPU: the stand-in device (its waits check the order of records).
            fake = FakeIpcDevice() if backend == "cuda_ipc" and DEVICE.type == "cpu" else None
            group = LaneGroup.create(
                rank,
                world_size,
                "127.0.0.1",
                port,
                backend,
                GROUP_TIMEOUT_S,
                device=DEVICE if backend == "cuda_ipc" else None,
                exchange_device=fake,
            )
            phase = {
                "world_size": world_size,
                "generation": group.generation,
                "backend": group.backend,
                "link": group.measure(),
                "slow_lane_wait_s": slow_lane_waits(group),
                "results": [],
            }
            report["phases"].append(phase)
            cases = build_cases(world_size)
            for case in cases if i < len(PHASES) - 1 else cases[:4]:
                phase["results"].append(summary(run_case(group, case)))
            group.destroy()
            group.destroy()  # idempotent
            phase["alive_after_destroy"] = group.alive
    except Exception:
        report["fatal"] = traceback.format_exc()
        raise  # mp.spawn ends the other lanes and raises this traceback in the test
    finally:
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps(report))


@pytest.fixture(scope="module", params=["gloo", "cuda_ipc"])
def lane_reports(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    """Spawn the lanes once per backend; their reports, one per rank."""
    out = tmp_path_factory.mktemp("lanes")
    ports = [free_port() for _ in PHASES]
    mp.spawn(lane_main, args=(ports, str(out), request.param), nprocs=MAX_LANES, join=True)
    reports = [json.loads((out / f"rank{r}.json").read_text()) for r in range(MAX_LANES)]
    for r in reports:
        r["backend"] = request.param
    return reports


def phase_of(reports: list[dict], index: int) -> list[dict]:
    """The members' reports of one phase (rank order)."""
    fatal = [r["fatal"] for r in reports if r["fatal"]]
    assert not fatal, "\n".join(fatal)
    return [r["phases"][index] for r in reports if r["phases"][index] is not None]


def check_phase(lanes: list[dict], world_size: int, backend: str) -> None:
    assert len(lanes) == world_size
    failures = [
        f"lane {rank} {res['id']}: {err}"
        for rank, lane in enumerate(lanes)
        for res in lane["results"]
        for err in res["errors"]
    ]
    assert not failures, "\n".join(failures[:20])
    assert len({lane["generation"] for lane in lanes}) == 1  # every lane joined the same group
    assert all(lane["backend"] == backend and not lane["alive_after_destroy"] for lane in lanes)
    assert all(lane["link"] == lanes[0]["link"] for lane in lanes)  # agreed link numbers
    # The wait clock counts the time spent waiting for a late lane, and only that.
    waits = [lane["slow_lane_wait_s"] for lane in lanes]
    assert waits[0] < SLOW_S / 2 and all(w >= SLOW_S * 0.9 for w in waits[1:]), waits
    by_id = [{res["id"]: res for res in lane["results"]} for lane in lanes]
    cases = {f"{c.name}/ps{c.page_size}/{c.mode}": c for c in build_cases(world_size)}
    for cid in by_id[0]:
        c = cases[cid]
        modes = {lane[cid]["last_mode"] for lane in by_id}
        assert len(modes) == 1, f"{cid}: lanes chose different modes {modes}"
        mode = modes.pop()
        assert mode == c.mode or c.mode == "auto", cid
        assert sum(lane[cid]["n"] for lane in by_id) == sum(e for _, e in c.lens), cid
        solo = StepPlan.build(c.requests(), world_size, c.page_size, 0).solo_lane >= 0
        assert all(lane[cid]["solo"] == solo for lane in by_id), cid
        if solo:
            # One lane holds every page: it attends alone, nobody exchanges or waits.
            assert mode == ("pass_q" if c.mode == "auto" else c.mode), cid
            assert all(lane[cid]["bytes"] == lane[cid]["bytes_read"] == 0 for lane in by_id), cid
            assert all(lane[cid]["wait_s"] == 0 for lane in by_id), cid
            continue
        if c.mode == "auto":
            # no history: pass-KV moves fewer bytes in fewer collectives (GQA, Hkv < Hq)
            if all(p == 0 for p, _ in c.lens):
                assert mode == "pass_kv", cid
            # every request has history: pass-KV would add a K/V gather to the same pass-Q
            if all(p > 0 for p, _ in c.lens):
                assert mode == "pass_q", cid
        assert any(lane[cid]["bytes"] > 0 for lane in by_id), cid
        assert all(lane[cid]["wait_s"] > 0 for lane in by_id), cid  # every lane exchanged
        if backend == "cuda_ipc":  # what the attention counts is what the exchange read
            assert all(lane[cid]["bytes_read"] == lane[cid]["bytes"] for lane in by_id), cid


# --- tests ---


def test_world_size_1_in_process(monkeypatch: pytest.MonkeyPatch) -> None:
    group = LaneGroup.create(0, 1)
    assert group.backend == "none"
    assert group.measure() == {"latency_s": 0.0, "bytes_per_s": float("inf")}
    cases = build_cases(1)
    # On CPU: every case with the kernels' torch references, as the spawned lanes run them;
    # then, where the interpreter is on (the suite: the kernel tests turn it on before Triton
    # loads, which it needs), page 4's cases of auto (SDPA or pass-Q) and pass-KV (its
    # temporary pages and merge), the bf16 batch among them, with the Triton kernels,
    # launched as the attention launches them (~10x slower).
    interpreted = DEVICE.type == "cpu" and HAS_TRITON and interpreter_enabled()
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    results = [summary(run_case(group, c)) for c in cases]
    if interpreted:
        monkeypatch.setenv("TRITON_INTERPRET", "1")
        picked = [c for c in cases if c.mode in ("auto", "pass_kv") and c.page_size == 4]
        assert len(picked) == 2 * (len(scenarios(1, 4)) + 1)
        results += [summary(run_case(group, c)) for c in picked]
    failures = [f"{r['id']}: {e}" for r in results for e in r["errors"]]
    assert not failures, "\n".join(failures)
    assert all(r["bytes"] == 0 and r["wait_s"] == 0 for r in results)
    group.destroy()
    group.destroy()


def test_one_lane_attends_fresh_requests_with_sdpa_and_the_rest_paged() -> None:
    group = LaneGroup.create(0, 1)
    pages = (np.array([1, 2]), np.array([3, 4]))

    def attention(prefixes: tuple[int, int]) -> CPAttention:
        seqs = [StepSequence(p, 5, pg) for p, pg in zip(prefixes, pages, strict=True)]
        return CPAttention(group, StepPlan.build(seqs, 1, 4, 0), "auto")

    assert attention((0, 0))._dense
    assert not attention((0, 1))._dense  # a cached prefix lives in the shard: paged
    group.destroy()


def test_a_step_copies_to_the_device_only_what_its_route_reads() -> None:
    group = LaneGroup.create(0, 1)
    k_shard, v_shard = torch.zeros(4, 4, HKV, D), torch.zeros(4, 4, HKV, D)

    def copied(prefix: int, mode: str) -> set[str]:
        plan = StepPlan.build([StepSequence(prefix, 5 - prefix, np.array([1, 2]))], 1, 4, 0)
        attn = CPAttention(group, plan, mode)
        n = 5 - prefix
        q, k, v = torch.randn(n, HQ, D), torch.randn(n, HKV, D), torch.randn(n, HKV, D)
        for _ in range(2):  # two layers: the second copies nothing more
            attn.forward(k_shard, v_shard, q, k, v, SCALE)
        return set(attn._device_plans[q.device]._made)

    assert copied(0, "auto") == {"my_local_slots"}  # SDPA over the new tokens
    assert copied(3, "pass_q") == {"my_local_slots", "pass_q"}
    assert copied(3, "pass_kv") == {
        "my_local_slots", "my_positions", "my_cu_q", "new_pages", "new_rows", "history"
    }  # fmt: skip
    group.destroy()


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_lanes_match_single_device(world_size: int, lane_reports: list[dict]) -> None:
    lanes = phase_of(lane_reports, PHASES.index(world_size))
    check_phase(lanes, world_size, lane_reports[0]["backend"])
    by_id = [{res["id"]: res for res in lane["results"]} for lane in lanes]
    # a tiny request (one page): one lane ran it alone, the others own none of its tokens
    tiny = [lane["tiny/ps16/pass_q"] for lane in by_id]
    assert all(r["solo"] for r in tiny) and sorted(r["n"] for r in tiny)[-2:] == [0, 3]
    # steps over pages on several lanes: every lane takes part, whatever tokens it owns
    for name in ("prefix_aligned", "chunk_midpage", "batch"):
        for ps in PAGE_SIZES:
            rs = [lane[f"{name}/ps{ps}/pass_q"] for lane in by_id]
            assert not any(r["solo"] for r in rs) and all(r["wait_s"] > 0 for r in rs)


def test_group_rebuilt_in_the_same_processes(lane_reports: list[dict]) -> None:
    first, rebuilt = phase_of(lane_reports, 0), phase_of(lane_reports, len(PHASES) - 1)
    check_phase(rebuilt, PHASES[-1], lane_reports[0]["backend"])
    assert len(rebuilt[0]["results"]) == 4
    generations = {phase_of(lane_reports, i)[0]["generation"] for i in range(len(PHASES))}
    assert len(generations) == len(PHASES)  # each incarnation has its own id
    assert first[0]["generation"] != rebuilt[0]["generation"]


# --- plan, cost model and backend choice (no processes) ---


def test_step_plan_matches_a_direct_walk() -> None:
    rng = np.random.default_rng(7)
    cp, ps = 3, 4
    lens = [(0, 9), (6, 7), (4, 1), (13, 2)]
    pages, _ = assign_pages(cp, ps, lens, rng)
    reqs = [StepSequence(p, e, np.array(pg)) for (p, e), pg in zip(lens, pages, strict=True)]
    plans = [StepPlan.build(reqs, cp, ps, lane) for lane in range(cp)]
    tokens = [(b, p) for b, (pre, e) in enumerate(lens) for p in range(pre, pre + e)]
    for lane, plan in enumerate(plans):
        assert np.array_equal(plan.token_owner, plans[0].token_owner)
        assert np.array_equal(plan.gather_order, plans[0].gather_order)
        mine = [t for t, (b, p) in enumerate(tokens) if pages[b][p // ps] % cp == lane]  # ascending
        assert plan.my_tokens.tolist() == mine
        assert plan.my_positions.tolist() == [tokens[t][1] for t in mine]
        assert plan.my_local_slots.dtype == np.int64
        assert plan.my_local_slots.tolist() == [
            pages[tokens[t][0]][tokens[t][1] // ps] // cp * ps + tokens[t][1] % ps for t in mine
        ]
        for b, (pre, e) in enumerate(lens):
            on_lane = [(i, g) for i, g in enumerate(pages[b]) if g % cp == lane]
            a = plan.all_pages
            s = slice(a.cu_pages[b], a.cu_pages[b + 1])
            assert a.page_table[s].tolist() == [g // cp for _, g in on_lane]
            assert a.page_pos[s].tolist() == [i * ps for i, _ in on_lane]
            assert a.page_len[s].tolist() == [min(ps, pre + e - i * ps) for i, _ in on_lane]
            h = plan.history_pages
            s = slice(h.cu_pages[b], h.cu_pages[b + 1])
            hist = [(i, g) for i, g in on_lane if i * ps < pre]
            assert h.page_table[s].tolist() == [g // cp for _, g in hist]
            assert h.page_len[s].tolist() == [min(ps, pre - i * ps) for i, _ in hist]
            last = tokens.index((b, pre + e - 1))
            owner = int(plan.last_token_owner[b])
            assert owner == pages[b][(pre + e - 1) // ps] % cp
            assert plans[owner].my_tokens[plan.last_token_index[b]] == last
    assert plans[0].all_pages.page_table.dtype == np.int32
    assert plans[0].all_pages.page_len.dtype == np.int32
    assert plans[0].history is not None and plans[0].num_history_tokens == 10


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (dict(prefix_len=-1, extend_len=1, pages=[5]), "prefix_len=-1"),
        (dict(prefix_len=0, extend_len=0, pages=[5]), "extend_len=0"),
        (dict(prefix_len=1.5, extend_len=1, pages=[5]), "prefix_len=1.5"),
        (dict(prefix_len=0, extend_len=1, pages=[[5]]), "1-D"),
        (dict(prefix_len=0, extend_len=1, pages=[-3]), "negative page id -3"),
        (dict(prefix_len=0, extend_len=1, pages=[1.0]), "integers"),
        (dict(prefix_len=0, extend_len=1, pages=np.array([True])), "integers"),
        (dict(prefix_len=0, extend_len=1, pages=np.array([2**31])), "beyond int32"),
        (dict(prefix_len=0, extend_len=1, pages=np.array([2**32], np.uint64)), "beyond int32"),
        (dict(prefix_len=0, extend_len=1, pages=np.array([2**31], np.uint32)), "beyond int32"),
        (dict(prefix_len=0, extend_len=True, pages=[5]), "extend_len=True"),
        (dict(prefix_len=np.int64(-2), extend_len=1, pages=[5]), "prefix_len=-2"),
    ],
)
def test_step_request_rejects(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        StepSequence(**kwargs)


@pytest.mark.parametrize(
    ("pages", "cp", "want"),
    [
        ([[5, 9, 13]], 4, 1),  # three pages, all on lane 1
        ([[6], [10, 14]], 4, 2),  # two requests, every page on lane 2
        ([[5, 6]], 4, -1),  # a prompt over two lanes
        ([[5], [6]], 4, -1),  # two requests, each on its own lane
        ([[2, 3, 5]], 1, 0),  # cp 1: the one lane
    ],
    ids=["one-lane", "batch-one-lane", "two-lanes", "batch-two-lanes", "cp1"],
)
def test_step_plan_names_the_lane_holding_every_page(pages: list, cp: int, want: int) -> None:
    # Prefix of 2 tokens where a request has more than one page: its history counts too.
    seqs = [StepSequence(2 if len(p) > 1 else 0, len(p) * 4 - 3, np.array(p)) for p in pages]
    plans = [StepPlan.build(seqs, cp, 4, lane) for lane in range(cp)]
    assert {plan.solo_lane for plan in plans} == {want}
    if want >= 0 and cp > 1:
        # The lane holding the step owns all of it; the others own nothing and skip it.
        assert [int(n) for n in plans[0].lane_counts] == [
            sum(len(p) * 4 - 3 for p in pages) if lane == want else 0 for lane in range(cp)
        ]
    if want >= 0:  # nothing to exchange, whatever the link
        assert exchange_costs(plans[0], HQ, HKV, D, 4, 4, 1e-3, 1e6) == {
            "pass_q": 0.0,
            "pass_kv": 0.0,
        }
    for lane, plan in enumerate(plans):
        # Only the group's rank and size are read here: a stand-in will do.
        attn = CPAttention(SimpleNamespace(rank=lane, world_size=cp), plan, "auto")
        assert attn.solo == (cp > 1 and want >= 0)
        assert attn.idle == (attn.solo and lane != want)


@pytest.mark.parametrize(
    ("reqs", "cp", "ps", "lane", "match"),
    [
        ([StepSequence(0, 5, np.array([4]))], 2, 4, 0, "needs 2 pages"),
        ([StepSequence(0, 3, np.array([1]))], 2, 4, 0, r"page ids \[1\].*reserved"),
        (
            [StepSequence(0, 3, np.array([4])), StepSequence(0, 3, np.array([4]))],
            2,
            4,
            0,
            r"page ids \[4\] appear more than once",
        ),
        (  # a page one request reads and another writes
            [StepSequence(0, 3, np.array([4])), StepSequence(4, 1, np.array([4, 6]))],
            2,
            4,
            0,
            r"page ids \[4\] appear more than once",
        ),
        ([StepSequence(8, 1, np.array([4, 4, 6]))], 2, 4, 0, r"page ids \[4\] appear"),
        ([StepSequence(0, 3, np.array([4]))], 2, 4, 2, "lane=2"),
        ([], 2, 4, 0, "at least one request"),
        ([StepSequence(0, 3, np.array([4]))], 0, 4, 0, "cp_size=0"),
    ],
)
def test_step_plan_rejects(reqs: list, cp: int, ps: int, lane: int, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        StepPlan.build(reqs, cp, ps, lane)


def test_requests_on_one_cached_prefix_share_its_pages_in_a_step() -> None:
    shared = [4, 6]  # two full pages of a cached prefix, on lanes 0 and 1
    a = StepSequence(8, 1, np.array([*shared, 8]))
    b = StepSequence(8, 3, np.array([*shared, 10]))
    plan = StepPlan.build([a, b], 2, 4, 0)
    assert plan.num_tokens == 4


def test_a_probe_in_another_dtype_attends_in_the_shards() -> None:
    """Probe rows in fp32 on a bf16 pool: q, k and v all take the shard's dtype (q alone
    did not: both the SDPA route and the paged kernel refused the step)."""
    from cpkv.core.config import KVShape
    from cpkv.core.steps import StepRequest
    from cpkv.lanes.shard import LaneShard
    from cpkv.lanes.worker import LaneWorker

    shard = LaneShard(0, 16, 4, KVShape(1, 2, 8, "bfloat16"), "cpu")
    worker = LaneWorker(0, 1, torch.device("cpu"), None)
    worker.init_group("g", "127.0.0.1", 0, "gloo", 10.0)
    for step_id, prefix in ((1, 0), (2, 6)):  # fresh (SDPA), then on a cached prefix (paged)
        n = 6
        pages = np.arange(1, 1 + -(-(prefix + n) // 4))
        probe = (torch.randn(n, 4, 8), torch.randn(n, 2, 8), torch.randn(n, 2, 8))
        step = StepRequest(step_id, "g", (StepSequence(prefix, n, pages),), probe=probe)
        res = worker.step(shard, step)
        assert res.out.shape == (n, 4, 8) and bool(torch.as_tensor(res.out).isfinite().all())


def test_a_step_out_of_order_leaves_the_group() -> None:
    """A reordering bug fails the step on the lane that sees it and takes it out of the group,
    so its peers fail at once rather than waiting for the group's timeout."""
    from cpkv.core.config import KVShape
    from cpkv.core.steps import StepRequest
    from cpkv.lanes.shard import LaneShard
    from cpkv.lanes.worker import LaneWorker

    shard = LaneShard(0, 16, 4, KVShape(1, 2, 8, "float32"), "cpu")
    worker = LaneWorker(0, 1, torch.device("cpu"), None)
    worker.init_group("g", "127.0.0.1", 0, "gloo", 10.0)
    probe = (torch.randn(2, 4, 8), torch.randn(2, 2, 8), torch.randn(2, 2, 8))
    worker.step(shard, StepRequest(2, "g", (StepSequence(0, 2, np.array([1])),), probe=probe))
    with pytest.raises(AssertionError):
        worker.step(shard, StepRequest(1, "g", (StepSequence(0, 2, np.array([2])),), probe=probe))
    assert worker.group is None


def test_exchange_costs_follow_the_model() -> None:
    fresh = StepPlan.build([StepSequence(0, 8, np.array([2, 3]))], 2, 4, 0)
    costs = exchange_costs(fresh, HQ, HKV, D, 4, 4, latency_s=1e-4, bytes_per_s=1e9)
    rows = 4  # busiest lane's tokens; (cp - 1) * rows rows arrive from the other lane
    assert costs["pass_q"] == pytest.approx(2e-4 + rows * (HQ * D * 4 + HQ * (D + 1) * 4) / 1e9)
    assert costs["pass_kv"] == pytest.approx(1e-4 + rows * 2 * HKV * D * 4 / 1e9)
    decode = StepPlan.build([StepSequence(9, 1, np.array([2, 3, 4]))], 2, 4, 0)
    costs = exchange_costs(decode, HQ, HKV, D, 4, 4, latency_s=1e-4, bytes_per_s=1e9)
    assert costs["pass_kv"] > costs["pass_q"]
    one = StepPlan.build([StepSequence(0, 8, np.array([1, 2]))], 1, 4, 0)
    assert exchange_costs(one, HQ, HKV, D, 4, 4, 1e-4, 1e9) == {"pass_q": 0.0, "pass_kv": 0.0}


def test_choose_backend() -> None:
    # CUDA lanes of one node share device memory, on one GPU or several
    assert choose_backend(["cuda:0", "cuda:1"]) == "cuda_ipc"
    assert choose_backend(["cuda:0", "cuda:0"]) == "cuda_ipc"  # two lanes on one GPU
    assert choose_backend(["n1/cuda:0", "n1/cuda:0", "n1/cuda:1"]) == "cuda_ipc"
    assert choose_backend(["n1/cuda:0", "n2/cuda:0"]) == "nccl"  # several nodes
    assert choose_backend(["n1/cuda:0", "n1/cuda:0", "n2/cuda:0"]) == "gloo"
    assert choose_backend(["cpu", "cpu"]) == "gloo"
    assert choose_backend(["cuda:0", "cpu"]) == "gloo"
    with pytest.raises(ValueError, match="empty"):
        choose_backend([])


def test_cp_attention_rejects_mismatches() -> None:
    group = LaneGroup.create(0, 1)
    plan = StepPlan.build([StepSequence(0, 3, np.array([2]))], 1, 4, 0)
    with pytest.raises(ValueError, match="mode="):
        CPAttention(group, plan, "ring")
    other = StepPlan.build([StepSequence(0, 3, np.array([2]))], 2, 4, 0)
    with pytest.raises(ValueError, match="does not match group"):
        CPAttention(group, other)
    attn = CPAttention(group, plan, "pass_q")
    shard = torch.zeros(2, 4, HKV, D)
    with pytest.raises(ValueError, match="owns 3 tokens"):
        attn.forward(shard, shard.clone(), torch.zeros(2, HQ, D), *[torch.zeros(2, HKV, D)] * 2, 1)
    with pytest.raises(ValueError, match="local page 2"):
        attn.forward(shard, shard.clone(), torch.zeros(3, HQ, D), *[torch.zeros(3, HKV, D)] * 2, 1)
    destroyed = LaneGroup.create(0, 1)
    destroyed.destroy()
    with pytest.raises(RuntimeError, match="destroyed"):
        destroyed.all_gather_rows(torch.zeros(1), [1])
