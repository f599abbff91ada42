"""``cpkv bench --prefill``: a tiny run on the session's Ray writes its JSON, CSV and PNG."""

from __future__ import annotations

import csv
import json
import math

import numpy as np
import pytest

from cpkv.tools.bench import PREFILL_FIELDS, PrefillBenchConfig, prefill_points
from tests.conftest import GPUS_PER_LANE

CONTEXT = 389  # odd: a partial last page; 25 pages of 16, enough for an owner plan at cp 2


def test_points_run_cp1_once_and_both_splits_above():
    cfg = PrefillBenchConfig(lanes=[1, 2, 4], contexts=[1024, 2048])
    per_context = [(1, "none"), (2, "zigzag"), (2, "contiguous"), (4, "zigzag"), (4, "contiguous")]
    assert prefill_points(cfg) == [
        (cp, ctx, split) for ctx in (1024, 2048) for cp, split in per_context
    ]


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["bench", "--requests", "0"], "--requests: 0 must be >= 1"),
        (["bench", "--lanes", ","], "names no lane count"),
        (["bench", "--lanes", "1,0"], "--lanes: 0 must be >= 1"),
        (["bench", "--concurrency", "0"], "--concurrency: 0 must be >= 1"),
        (["bench", "--prefill", "--link-gbps", "0"], "--link-gbps: 0.0 must be a finite"),
        (["bench", "--prefill", "--model", "nosuchpreset"], "not a checkpoint directory or a"),
        (["demo", "--cp-size", "0"], "--cp-size: 0 must be >= 1"),
        (["demo", "--page-size", "0"], "--page-size: 0 must be >= 1"),
        (["demo", "--pages-per-lane", "0"], "--pages-per-lane: 0 must be >= 2"),
        (["demo", "--model", "/no/such/dir"], "not a checkpoint directory"),
    ],
    ids=lambda x: " ".join(x) if isinstance(x, list) else None,
)
def test_the_command_refuses_sizes_it_would_replace_or_fail_on_late(argv, says, capsys):
    """0 quietly became a default (``args.requests or 8``), or the run failed after it ran
    (a division by a 0 link rate, percentiles of no latencies) or deep inside (a layout
    of 0 lanes, a preset name read as a path): refused as the arguments are read."""
    from cpkv.tools.cli import main

    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 2 and says in capsys.readouterr().err


@pytest.mark.ray
def test_tiny_prefill_bench_writes_rows_csv_and_plot(quiet_ray, tmp_path, capsys):
    from cpkv.tools.cli import main

    out = tmp_path / "bench"
    argv = ["bench", "--prefill", "--lanes", "1,2", "--context", str(CONTEXT)]
    argv += ["--requests", "2", "--page-size", "16", "--model", "tiny", "--no-progress"]
    argv += ["--num-gpus-per-lane", str(GPUS_PER_LANE), "--out", str(out)]
    assert main(argv) == 0
    assert quiet_ray.is_initialized()  # the session's Ray is left running

    data = json.loads((out / "bench_prefill.json").read_text())
    rows = data["rows"]
    assert [(r["lanes"], r["context"], r["split"]) for r in rows] == [
        (1, CONTEXT, "none"),
        (2, CONTEXT, "zigzag"),
        (2, CONTEXT, "contiguous"),
    ]
    for r in rows:
        assert r["requests"] == 2 and r["page_size"] == 16
        assert r["prefill_ms_p50"] >= r["prefill_ms_min"] > 0
        assert r["tokens_per_s"] > 0
        assert len(r["lane_ms"]) == len(r["work_share"]) == r["lanes"]
        assert all(x > 0 for x in r["lane_ms"])
        # Own work: the step minus the time in collectives (none at cp 1).
        assert len(r["lane_busy_ms"]) == r["lanes"]
        assert all(0 < b <= s for b, s in zip(r["lane_busy_ms"], r["lane_ms"], strict=True))
        if r["lanes"] == 1:
            assert r["lane_busy_ms"] == r["lane_ms"]
        for key in ("imbalance", "busy_imbalance", "work_imbalance"):
            assert math.isfinite(r[key]) and r[key] >= 1.0, (key, r)
        assert r["mode"] in ("pass_q", "pass_kv")
        assert r["model"] == "tiny" and r["dtype"] == "float32"
    by_split = {r["split"]: r for r in rows}
    # cp 1 has no plan; at cp 2 the plan splits 25 pages into 4 segments of 7, 6, 6, 6.
    assert by_split["none"]["fallback"] == "cp_size_1"
    assert by_split["zigzag"]["fallback"] == by_split["contiguous"]["fallback"] == ""
    # The planned causal work: zigzag balances it (up to the odd segment and the partial
    # last page: 1.055 here), contiguous gives the last lane the most (1.43 here).
    assert by_split["zigzag"]["work_imbalance"] < 1.1
    assert by_split["contiguous"]["work_imbalance"] > 1.3
    assert np.argmax(by_split["contiguous"]["work_share"]) == 1
    if by_split["zigzag"]["lane_cpu_ms"]:  # CPU lanes on this node
        assert math.isfinite(by_split["zigzag"]["cpu_imbalance"])

    # What CP buys: overhead against cp 1 (the same run), the critical path, the exchange, and
    # the one-GPU-per-lane projection (critical path + busiest lane's bytes at the link rate).
    one = by_split["none"]
    assert one["overhead_vs_cp1"] == 1.0 and one["exchange_bytes"] == 0
    assert one["critical_path_ms"] == max(one["lane_busy_ms"])
    assert one["projected_ms"] == pytest.approx(one["prefill_ms_p50"])  # cp 1 onto itself
    fixed = one["prefill_ms_p50"] - one["critical_path_ms"]  # client and Ray round trip
    link = 450e9
    for r in (by_split["zigzag"], by_split["contiguous"]):
        assert r["link_gb_per_s"] == 450.0
        assert r["overhead_vs_cp1"] == pytest.approx(r["prefill_ms_p50"] / one["prefill_ms_p50"])
        assert r["critical_path_ms"] == max(r["lane_busy_ms"])
        # tiny: 3 layers, 6/2 heads of 12, fp32; a fresh prefill takes pass_kv: each lane
        # receives the other's K/V rows (K and V, 2 heads of 12 fp32), every layer.
        tokens = np.asarray(r["lane_tokens"])
        assert tokens.sum() == CONTEXT
        if r["mode"] == "pass_kv":
            want = 3 * (CONTEXT - tokens) * 2 * 2 * 12 * 4
            assert r["exchange_bytes_max_lane"] == want.max()
            assert r["exchange_bytes"] == want.sum()
        assert r["exchange_ms"] == max(r["lane_wait_ms"]) > 0
        assert r["projected_ms"] == pytest.approx(
            r["critical_path_ms"] + r["exchange_bytes_max_lane"] / link * 1e3 + fixed
        )
        assert r["projected_speedup"] == pytest.approx(one["prefill_ms_p50"] / r["projected_ms"])
        assert 0 < r["critical_path_est_ms"] <= one["lane_busy_ms"][0]
    assert (out / "bench_prefill.png").stat().st_size > 0

    with open(out / "bench_prefill.csv", newline="") as f:
        reader = csv.DictReader(f)
        assert reader.fieldnames == PREFILL_FIELDS
        csv_rows = list(reader)
    assert [(r["lanes"], r["split"]) for r in csv_rows] == [
        ("1", "none"),
        ("2", "zigzag"),
        ("2", "contiguous"),
    ]
    assert json.loads(csv_rows[2]["lane_ms"]) == by_split["contiguous"]["lane_ms"]
    assert all(math.isfinite(float(r["imbalance"])) for r in csv_rows)

    png = (out / "bench_prefill.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000
    printed = capsys.readouterr().out
    assert "zigzag" in printed and "contiguous" in printed
    assert "PROJECTED, not measured" in printed
