"""``cpkv demo``: a Llama on the lanes under pool pressure, every request's logits checked.

The in-process runs use the session's local Ray (the demo must neither start nor stop it);
one run goes through the command line in its own process, to see what the terminal shows.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from cpkv.models.presets import small_config
from cpkv.tools.demo import DemoConfig, Reference, rel_err, run
from tests.conftest import GPUS_PER_LANE, LANE_ENV

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.ray
def test_demo_under_pressure_checks_every_request(quiet_ray):
    lines: list[str] = []
    # NOTE: a longer step deadline than the CLI's: on 2 shared cores a step can take most
    # of 0.5 s, and requeued requests then multiply the work (pressure still happens).
    cfg = DemoConfig(
        num_prompts=8,
        workers=3,
        deadline_s=2.0,
        progress=False,
        num_gpus_per_lane=GPUS_PER_LANE,
        seed=3,
    )
    res = run(cfg, out=lines.append)
    text = "\n".join(lines)
    assert res.exit_code == 0, text
    assert quiet_ray.is_initialized()  # the session's Ray is left running
    # Every request served, its last chunk and each decode step checked.
    assert res.served == res.num_prompts == 8
    assert res.requests_checked == 8
    assert res.checks >= 8 * (1 + cfg.decode_tokens)
    assert res.mismatches == 0 and res.max_rel_err < res.tolerance == 1e-3
    # Pressure and prefix reuse really happened.
    assert res.stats["pages_evicted"] > 0, text
    assert res.stats["capacity_waits"] > 0, text
    assert res.cached_tokens > 0 and res.stats["cached_tokens_hit"] > 0, text
    assert res.accounting_exact
    # The per-lane table: every lane computed prefill tokens and took compute time.
    assert len(res.lane_tokens) == 4 and min(res.lane_tokens) > 0
    assert sum(res.lane_tokens) == res.tokens_prefilled
    assert min(res.lane_seconds) > 0 and res.tokens_per_s > 0
    assert text.splitlines()[-1].startswith("OK in ")
    for word in ("logits checked", "pressure", "accounting           exact", "tokens/s"):
        assert word in text


@pytest.mark.ray
def test_demo_fails_against_a_wrong_reference(quiet_ray):
    lines: list[str] = []
    cfg = DemoConfig(
        cp_size=2,
        num_prompts=2,
        workers=2,
        decode_tokens=1,
        progress=False,
        num_gpus_per_lane=GPUS_PER_LANE,
        reference_seed=1,  # other weights than the lanes'
    )
    res = run(cfg, out=lines.append)
    assert res.exit_code == 1
    assert res.served == 2 and res.accounting_exact  # the pool itself was fine
    assert res.mismatches == res.checks >= 2 * 2
    assert lines[-1].startswith("FAILED in ")
    assert any(line.startswith("failed: demo") for line in lines)


def test_reference_attends_causally_with_gqa():
    """The reference's SDPA path equals a naive causal softmax attention with repeated KV."""
    import torch

    from cpkv.models import LlamaModel

    ref = Reference(LlamaModel.random(small_config(), seed=0))
    q = torch.randn(7, 8, 16)
    k, v = torch.randn(7, 2, 16), torch.randn(7, 2, 16)
    got = ref._attend(0, q, k, v)
    kk, vv = k.repeat_interleave(4, dim=1), v.repeat_interleave(4, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, kk) * 16**-0.5
    scores = scores.masked_fill(torch.ones(7, 7, dtype=torch.bool).triu(1), float("-inf"))
    want = torch.einsum("hqk,khd->qhd", scores.softmax(-1), vv)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    # Last-token logits of a prefix equal those of the whole forward's row.
    tokens = np.arange(11) * 7 % 512
    assert rel_err(ref.last_logits(tokens[:5]), ref.last_logits(tokens[:5])) == 0.0
    assert rel_err(ref.last_logits(tokens), ref.last_logits(tokens[:5])) > 1e-3


def test_cli_demo_terminal_shows_only_cpkv_output():
    """``cpkv demo`` in its own process: stdout is the report, stderr is empty without the
    progress bar (no Ray warnings, no lane log lines, no Python warnings).

    NOTE: not marked ``ray``: the demo starts a Ray of its own (``address="local"``), not the
    shared one, so the test runs on another worker, beside the shared Ray's tests."""
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env.update(LANE_ENV)  # as the session's lanes (see tests/conftest.py)
    cmd = [
        sys.executable,
        "-m",
        "cpkv",
        "demo",
        "--cp-size",
        "2",
        "--prompts",
        "4",
        "--workers",
        "2",
        "--decode-tokens",
        "2",
        "--no-progress",
    ]
    proc = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stderr == "", proc.stderr
    lines = proc.stdout.splitlines()
    header = "lane device used cached free held tokens step s"
    assert lines[0].split() == header.split()
    assert lines[-1].startswith("OK in ")
    known = (
        "lane",
        "----",
        "   0",
        "   1",
        "requests served",
        "tokens prefilled",
        "logits checked",
        "allocations",
        "pressure",
        "accounting",
        "throughput",
        "OK in",
    )
    assert all(line == "" or line.startswith(known) for line in lines), proc.stdout
