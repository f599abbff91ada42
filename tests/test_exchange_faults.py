"""A lane that dies in the middle of a step, through the public client on the shared local
Ray: its peers, waiting on it in the lanes' exchange (gloo on CPU; the CUDA IPC exchange on a
GPU, where a peer may be left with a stream waiting on an event that will never come), fail
the step within the lane timeout instead of hanging; the lane comes back with new mappings
and the next step is right."""

from __future__ import annotations

import contextlib
import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from cpkv import LaneUnavailableError, StepFailedError

from .conftest import DEFAULTS
from .test_faults import wait_for

pytestmark = pytest.mark.ray

HQ, HKV, D = 4, DEFAULTS["num_heads"], DEFAULTS["head_dim"]


def _probe(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(n, h, D, generator=g) for h in (HQ, HKV, HKV))


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    k, v = (t.repeat_interleave(HQ // HKV, dim=1) for t in (k, v))
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), is_causal=True
    )
    return out.transpose(0, 1)


def test_a_lane_killed_mid_step_fails_its_peers_step_and_the_pool_recovers(make_client):
    c = make_client(fresh=True, cp_size=2)
    n = 24
    warm = _probe(n, 0)
    c.prefill("warm", np.arange(100, 100 + n), probe=warm, mode="pass_kv")  # group built
    c.free("warm", cache=False)
    victim = c.lane_info()[1]["pid"]
    # Stopped, lane 1 takes the step but never runs it: lane 0 runs its half and waits for
    # lane 1 in the exchange, until lane 1 dies.
    os.kill(victim, signal.SIGSTOP)
    try:
        with ThreadPoolExecutor(1) as pool:
            step = pool.submit(c.prefill, "mid", np.arange(n), probe=_probe(n, 1), mode="pass_kv")
            time.sleep(1.0)
            assert not step.done(), "the step finished without lane 1"
            t0 = time.monotonic()
            os.kill(victim, signal.SIGKILL)
            with pytest.raises((StepFailedError, LaneUnavailableError)):
                step.result(timeout=DEFAULTS["timeout_s"] + 30)
            failed_s = time.monotonic() - t0
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(victim, signal.SIGKILL)
    assert failed_s < DEFAULTS["timeout_s"], f"the step hung {failed_s:.1f} s on a dead lane"
    wait_for(lambda: c.stats()["lane_losses"], timeout=60)
    wait_for(lambda: c.stats()["lane_states"] == ["up", "up"], timeout=120)
    assert c.lane_info()[1]["pid"] != victim
    c.free("mid")  # acknowledges the loss; nothing of it is cached
    assert sum(c.stats()["cached"]) == 0
    # A new lane group over the restarted lane: the next step is right.
    q, k, v = _probe(n, 2)
    tokens = np.arange(200, 200 + n)
    res = c.prefill("after", tokens, probe=(q, k, v), mode="pass_kv", deadline_s=120)
    np.testing.assert_allclose(
        np.asarray(res.attention), _sdpa(q, k, v).numpy(), rtol=1e-4, atol=1e-5
    )
    c.free("after", cache=False)
    assert c.check()["ok"]
