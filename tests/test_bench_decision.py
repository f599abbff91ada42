"""benchmarks/bench_decision.py runs and prints a row per cp (it drives the coordinator in
process, past its remembered calls)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_the_decision_bench_prints_a_row_per_cp():
    out = subprocess.run(
        [
            sys.executable,
            str(ROOT / "benchmarks" / "bench_decision.py"),
            "--cp",
            "1,3",
            "--iters",
            "50",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    ).stdout
    rows = [line.split() for line in out.splitlines() if line.endswith("x")]
    assert [row[0] for row in rows] == ["1", "3"], out
    for row in rows:
        prefill_us, free_us, core_us = map(float, row[1:4])
        assert prefill_us > 0 and free_us > 0 and core_us > 0
        ratio = float(row[4].removesuffix("x"))
        assert ratio == pytest.approx((prefill_us + free_us) / core_us, rel=0.01), row
