"""Issue 19 through the public client on the shared local Ray: bad tokens, failed steps that
abort their peers at once, retries by call id, namespaces, and leases under stopped, busy
and hung processes."""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import time

import numpy as np
import pytest
import ray
import torch

import cpkv
from cpkv import InvalidRequestError, LaneUnavailableError, LeaseExpiredError, StepFailedError
from cpkv.models import ModelConfig

from .conftest import CUDA_DEVICES, DEFAULTS
from .test_bad_input import CallRecorder
from .test_faults import wait_for

pytestmark = pytest.mark.ray

VOCAB = 97


@pytest.fixture
def model_client(make_client):
    return make_client(cp_size=2, num_pages_per_lane=40, model=ModelConfig.tiny(), model_seed=3)


# --------------------------------------------------------------------- 19.1, 19.2
def test_a_token_outside_the_vocabulary_is_refused_on_the_callers_side(model_client):
    c = model_client
    assert c.vocab_size == VOCAB
    real, c._coord = c._coord, CallRecorder(c._coord)
    try:
        with pytest.raises(InvalidRequestError, match=r"token_ids\['r'\]\[3\]=97"):
            c.prefill("r", [1, 2, 3, VOCAB])
        with pytest.raises(InvalidRequestError, match="vocabulary"):
            c.decode(["r"], [VOCAB + 1])
        assert c._coord.calls == []
    finally:
        c._coord = real
    # The second line: a caller that skips the client's check is refused by the coordinator.
    out = ray.get(c._coord.prefill.remote(c._epoch, c.client_id, None, "r", np.array([VOCAB])))
    assert isinstance(out, InvalidRequestError)
    assert c.stats()["num_requests"] == 0


def test_a_step_that_fails_on_one_lane_fails_on_all_at_once_and_poisons_nothing(
    make_client, monkeypatch
):
    """A probe one row short fails the lane that owns the last token while its peer waits
    in the exchange: the peer must fail at once (not at the 30 s collective timeout), the
    request is failed, its pages never cached, and the next step runs on a new group."""
    import cpkv.client._args

    # NOTE: the client refuses such a probe itself; let it through to fail on a lane.
    monkeypatch.setattr(cpkv.client._args, "check_probe", lambda *args: None)
    c = make_client(cp_size=2)
    hq, hkv, d = 4, DEFAULTS["num_heads"], DEFAULTS["head_dim"]
    n = 16
    good = tuple(torch.randn(n, h, d) for h in (hq, hkv, hkv))
    c.prefill("warm", np.arange(100, 100 + n), probe=good, mode="pass_kv")  # kernels compiled
    c.free("warm", cache=False)
    probe = (torch.randn(n - 1, hq, d), torch.randn(n - 1, hkv, d), torch.randn(n - 1, hkv, d))
    t0 = time.monotonic()
    with pytest.raises(StepFailedError) as info:
        c.prefill("bad", np.arange(n), probe=probe, mode="pass_kv")
    assert time.monotonic() - t0 < 15, "the peer waited for its collective timeout"
    assert info.value.rid == "bad"
    if CUDA_DEVICES:
        # On a GPU the bad index is a device-side assert: that lane restarts its process
        # (never reused), is found restarted and reset; its requests are lost with it.
        wait_for(lambda: c.stats()["lane_losses"], timeout=120)
        with pytest.raises((StepFailedError, LaneUnavailableError)):
            c.prefill("bad", np.arange(n, n + 4), probe=probe)
    else:
        with pytest.raises(StepFailedError):  # failed until freed
            c.prefill("bad", np.arange(n, n + 4), probe=probe)
        # A batch holding it is refused before anything is allocated: its new rid is not
        # this client's (free would answer "unknown rid" for good).
        rows = tuple(torch.randn(4 + n, h, d) for h in (hq, hkv, hkv))
        batch = [("bad", np.arange(n, n + 4)), ("fresh", np.arange(200, 200 + n))]
        with pytest.raises(StepFailedError) as info:
            c.prefill_batch(batch, probe=rows, mode="pass_kv")
        assert info.value.rid == "bad" and "fresh" not in c.live_rids and "bad" in c.live_rids
        # Its page moves rode in the failed step calls: applied, so no lane was reset.
        assert c.stats()["lane_losses"] == []
    c.free("bad")  # cache=True, but the step wrote nothing: nothing is cached
    assert sum(c.stats()["cached"]) == 0
    assert c.stats()["failed_steps"] >= 1
    # A new lane group, a normal step (deadline: on a GPU the lane may still be restarting).
    res = c.prefill("good", np.arange(n), probe=good, deadline_s=120)
    assert res.allocation.cached_len == 0 and res.attention.shape == (n, hq, d)
    assert c.check()["ok"]


def test_a_lane_that_refuses_a_steps_page_moves_fails_the_step_at_once_and_is_reset(
    make_client,
):
    """A lane whose record left the mirror (here: reset behind the coordinator's back, which no
    heartbeat sees on an empty lane) refuses the page move riding in its step call: it must
    leave the group so its peer fails now, not at the collective timeout, and be reset."""
    c = make_client(cp_size=2)  # the pool of the test above; its lane 1 is reset and back
    hq, hkv, d = 4, DEFAULTS["num_heads"], DEFAULTS["head_dim"]
    n = 16  # 4 pages, drawn in rotation: both lanes take some
    probe = tuple(torch.randn(n, h, d) for h in (hq, hkv, hkv))
    ray.get(c.lanes[1].reset.remote("not-the-coordinators:1"))
    t0 = time.monotonic()
    with pytest.raises((StepFailedError, LaneUnavailableError)):
        c.prefill("refused", np.arange(n), probe=probe, mode="pass_kv")
    assert time.monotonic() - t0 < 15, "the peer waited for its collective timeout"
    wait_for(lambda: c.stats()["lane_losses"])
    assert [lane for lane, _ in c.stats()["lane_losses"]] == [1]
    with contextlib.suppress(StepFailedError, LaneUnavailableError):
        c.free("refused")
    res = c.prefill("after", np.arange(100, 100 + n), probe=probe, deadline_s=60)
    assert res.attention.shape == (n, hq, d)
    assert c.check()["ok"]


# ------------------------------------------------------------------------------ 19.3
def test_a_call_retried_with_its_call_id_takes_effect_once(make_client):
    c = make_client()
    tokens = np.arange(40)
    first = c.allocate_extend("r", tokens, call_id="try-1")
    again = c.allocate_extend("r", tokens, call_id="try-1")  # as after a RequestTimeoutError
    assert again.new_pages.tolist() == first.new_pages.tolist()
    assert c.stats()["extend_allocations"] == 1 and c.live_rids == {"r"}
    with pytest.raises(InvalidRequestError, match="call_id='try-1'"):
        c.allocate_extend("r", tokens[:8], call_id="try-1")
    assert c.free("r", call_id="free-1") == c.free("r", call_id="free-1")
    assert c.stats()["num_requests"] == 0


# ------------------------------------------------------------------------------ 19.4
def test_two_jobs_requests_and_pages_never_meet(make_client, attach):
    a = make_client()
    b = attach(a)  # a namespace of its own
    alloc_a = a.allocate_extend("req-0", np.arange(40))
    b.allocate_extend("req-0", np.arange(100, 108))
    assert a.stats()["num_requests"] == 2
    k = torch.full((40, DEFAULTS["num_heads"], DEFAULTS["head_dim"]), 3.0)
    a.store_kv(alloc_a.out_cache_loc, k, k)
    with pytest.raises(InvalidRequestError, match="namespace"):  # B reads A's K/V
        b.gather_kv(alloc_a.out_cache_loc)
    with pytest.raises(InvalidRequestError, match="namespace"):  # or overwrites it
        b.store_kv(alloc_a.out_cache_loc, k * 0 + 7, k)
    b.free("req-0")  # B's own request
    assert torch.equal(a.gather_kv(alloc_a.out_cache_loc)[0], k)
    a.free("req-0")  # cached now: readable by all, writable by none
    hit = b.allocate_extend("req-1", np.arange(40))
    assert hit.cached_len == 36
    assert torch.equal(b.gather_kv(hit.cached_slots)[0], k[:36])
    with pytest.raises(InvalidRequestError, match="cached") as refused:
        b.store_kv(hit.cached_slots, k[:36] * 0 + 7, k[:36])
    # The lane's own error, as the client's calls raise them (not Ray's wrapper of it).
    assert type(refused.value) is InvalidRequestError
    assert str(refused.value).startswith("lane "), str(refused.value)
    assert a.check()["ok"]


# ------------------------------------------------------------------------- 19.6, 19.8
@ray.remote(num_cpus=0)
class _Job:
    """A job holding a client of its own (a lease of 1 s)."""

    def __init__(self, name: str) -> None:
        shape = {k: DEFAULTS[k] for k in ("cp_size", "page_size", "num_pages_per_lane")}
        shape.update(max_reqs=DEFAULTS["max_reqs"], max_context_len=DEFAULTS["max_context_len"])
        self.c = cpkv.connect("auto", name=name, lease_s=1.0, timeout_s=30.0, **shape)

    def pid(self) -> int:
        return os.getpid()

    def extend(self, rid: str) -> int:
        return self.c.allocate_extend(rid, np.arange(8)).extend_len

    def decode(self, rid: str):
        try:
            return self.c.allocate_decode([rid]).tolist()
        except LeaseExpiredError as e:
            return ("lapsed", e.rids)

    def busy(self, seconds: float) -> None:
        """Hold the interpreter: the lease renewer thread gets no turn."""
        sys.setswitchinterval(seconds + 5)
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            pass
        sys.setswitchinterval(0.005)


def test_a_stopped_client_is_told_its_lease_lapsed(make_client):
    c = make_client()
    expired = c.stats()["leases_expired"]  # counted since the pool started
    job = _Job.remote(c.name)
    assert ray.get(job.extend.remote("r")) == 8
    pid = ray.get(job.pid.remote())
    os.kill(pid, signal.SIGSTOP)
    try:
        wait_for(lambda: c.stats()["leases_expired"] == expired + 1, timeout=20)
    finally:
        os.kill(pid, signal.SIGCONT)
    time.sleep(1.0)  # its renewer wakes first, finds the lease gone and says hello
    assert ray.get(job.decode.remote("r")) == ("lapsed", ["r"])
    ray.kill(job)


def test_a_busy_client_keeps_its_requests(make_client):
    c = make_client()
    before = c.stats()  # lease counters run since the pool started
    job = _Job.remote(c.name)
    ray.get(job.extend.remote("r"))
    ray.get(job.busy.remote(3.0))  # three leases long without a renewal
    got = ray.get(job.decode.remote("r"))
    assert isinstance(got, list) and len(got) == 1, got  # a slot, not a lapse
    stats = c.stats()
    assert stats["leases_expired"] == before["leases_expired"]
    assert stats["leases_kept_alive"] > before["leases_kept_alive"]
    ray.kill(job)


# ------------------------------------------------------------------------------ 19.7
def test_a_hung_lane_is_reset_and_no_idle_client_loses_its_lease(make_client):
    c = make_client(fresh=True, heartbeat_s=0.2, lease_s=1.5, lane_hang_s=2.0, cp_size=2)
    info = c.lane_info()
    idle_lane = int(c.allocate_extend("idle", np.arange(3)).new_pages[0] % 2)  # one page
    hung = 1 - idle_lane
    pid = info[hung]["pid"]
    os.kill(pid, signal.SIGSTOP)
    try:
        for i in range(40):  # moves to the hung lane pile up meanwhile
            c.allocate_extend(f"x{i}", np.arange(4))
            c.free(f"x{i}", cache=False)
        wait_for(lambda: c.stats()["hung_lanes"] == 1, timeout=30)
    finally:
        with contextlib.suppress(ProcessLookupError):  # killed as hung: Ray restarted it
            os.kill(pid, signal.SIGCONT)
    wait_for(lambda: c.stats()["lane_states"] == ["up", "up"], timeout=60)
    stats = c.stats()
    assert stats["leases_expired"] == 0  # the idle client's lease held throughout
    c.allocate_decode(["idle"])
    assert c.check()["ok"]


def test_clients_of_one_namespace_write_each_others_pages(make_client, attach):
    pool = make_client()
    a, b = attach(pool, namespace="team"), attach(pool, namespace="team")
    alloc = a.allocate_extend("shared", np.arange(24))
    k = torch.full((24, DEFAULTS["num_heads"], DEFAULTS["head_dim"]), 5.0)
    b.store_kv(alloc.out_cache_loc, k, k)  # b saw none of a's page moves
    assert torch.equal(a.gather_kv(alloc.out_cache_loc)[0], k)
    b.free("shared")
    assert a.stats()["num_requests"] == 0
