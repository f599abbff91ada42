"""A three-node local Ray (head + two workers with logical GPUs) running a tiny bench.

Runs in its own process: the test session's Ray is a single node already.
"""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_spread_bench_on_three_node_local_cluster(tmp_path):
    out = tmp_path / "bench"
    env = {**os.environ, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}
    env.pop("RAY_ADDRESS", None)
    cmd = [
        sys.executable,
        str(ROOT / "cluster" / "local-cluster.py"),
        "--workers",
        "2",
        "--gpus-per-worker",
        "2",
        "--cpus-per-worker",
        "2",
        "--",
        "--lanes",
        "2",  # NOTE: one pool (2,4 took 24 s against 17 alone on the 2-core machine)
        "--context",
        "4k",
        "--requests",
        "3",
        "--page-size",
        "16",
        "--strategy",
        "SPREAD",
        "--num-gpus-per-lane",
        "1",
        "--no-progress",
        "--out",
        str(out),
    ]
    proc = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    data = json.loads((out / "bench.json").read_text())
    rows = data["rows"]
    assert [(r["lanes"], r["context"]) for r in rows] == [(2, 4096)]
    for row in rows:
        # SPREAD over two GPU workers: lanes on both, none on the GPU-less head.
        assert row["nodes"] == 2, row["lane_nodes"]
        assert len(row["lane_nodes"]) == row["lanes"]
        assert row["p50_ms"] > 0 and row["allocs_per_s"] > 0
        assert row["balance_max_over_min"] >= 1.0
    with open(out / "bench.csv") as f:
        assert len(list(csv.DictReader(f))) == 1
    assert (out / "bench.png").stat().st_size > 1000
