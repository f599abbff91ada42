"""Faults on the shared local Ray: lanes and the coordinator killed, hung actors timed out."""

from __future__ import annotations

import time

import numpy as np
import pytest
import ray

import cpkv
from cpkv import (
    CoordinatorUnavailableError,
    KVCapacityWaitError,
    LaneUnavailableError,
    RequestTimeoutError,
)
from cpkv.client import CPKVClient

from .conftest import DEFAULTS

pytestmark = pytest.mark.ray


def wait_for(pred, timeout=30.0, period=0.1):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        value = pred()
        if value:
            return value
        time.sleep(period)
    raise AssertionError("condition not met in time")


def test_killed_lane_fails_only_its_requests_and_comes_back(make_client):
    # The session's pool: Ray restarts the lane, the test waits until it is back and agrees
    # with the mirror, and the next test's reset empties the pool again.
    c = make_client()
    everywhere = c.allocate_extend("plan", np.arange(64))  # owner plan: pages on all 4 lanes
    assert set((everywhere.new_pages % 4).tolist()) == {0, 1, 2, 3}
    # Single-page requests land on the lane with most free pages, one per lane.
    singles = {}
    for i in range(4):
        alloc = c.allocate_extend(f"one{i}", [1000 + i])
        singles[int(alloc.new_pages[0]) % 4] = f"one{i}"
    assert sorted(singles) == [0, 1, 2, 3]
    before = c.stats()
    ray.kill(c.lanes[2], no_restart=False)  # Ray restarts it with an empty shard
    wait_for(lambda: c.stats()["lane_losses"])
    stats = c.stats()
    assert stats["lane_losses"] == [[2, 2]]
    # The lost requests answer LaneUnavailableError naming the lane and themselves.
    for rid in ("plan", singles[2]):
        with pytest.raises(LaneUnavailableError) as info:
            c.allocate_decode([rid])
        assert info.value.lane == 2 and info.value.rids == [rid]
    # The others go on.
    others = [singles[r] for r in (0, 1, 3)]
    c.allocate_decode(others, [5, 6, 7])
    # Their pages on the other lanes were freed: 16 plan pages, 4 a lane.
    assert stats["free"][0] == before["free"][0] + 4
    assert stats["free"][2] == 31  # the lane is back, empty
    # The lane comes back (recovered off the coordinator's lock), is used again and
    # agrees with the mirror.
    wait_for(lambda: c.stats()["lane_states"] == ["up"] * 4)
    again = c.allocate_extend("again", np.arange(5000, 5064))
    assert (again.new_pages % 4 == 2).sum() == 4
    report = c.check()
    assert report["ok"], report
    for rid in ("plan", singles[2]):
        assert c.free(rid) == 0  # acknowledges the loss
    for rid in [*others, "again"]:
        c.free(rid, cache=False)
    end = c.stats()
    assert end["used"] == [0, 0, 0, 0] and end["free"] == [31, 31, 31, 31]
    assert c.check()["ok"]


def test_store_to_a_dead_lane_raises_lane_unavailable(make_client):
    import torch

    c = make_client(fresh=True, cp_size=2)
    alloc = c.allocate_extend("r", np.arange(64))  # pages on both lanes
    ray.kill(c.lanes[1], no_restart=True)  # gone for good: calls to it fail at once
    k = torch.zeros(64, 2, 8)
    with pytest.raises(LaneUnavailableError) as info:
        c.store_kv(alloc.out_cache_loc, k, k)
    assert info.value.lane == 1 and info.value.rids == ["r"]
    assert "r" not in c.live_rids


def test_killed_coordinator_restarts_and_reports_requests_lost(make_client):
    c = make_client(fresh=True, cp_size=2)
    c.allocate_extend("x", np.arange(40))
    c.allocate_extend("y", np.arange(100, 140))
    old_epoch = c._epoch
    ray.kill(c._coord, no_restart=False)

    def restarted():  # ray.kill is asynchronous: wait until the new one answers
        try:
            return ray.get(c._coord.epoch.remote(), timeout=5) != old_epoch
        except ray.exceptions.RayError:
            return False

    wait_for(restarted)
    with pytest.raises(CoordinatorUnavailableError) as info:
        c.allocate_decode(["x"])
    assert sorted(info.value.rids) == ["x", "y"]

    def works():
        try:
            return c.allocate_extend("z", np.arange(10))
        except CoordinatorUnavailableError:
            return None

    wait_for(works)
    stats = c.stats()
    assert stats["num_requests"] == 1 and sum(stats["used"]) == 3
    assert c.check()["ok"], "the restarted coordinator must reset the lanes"


@ray.remote
class _HungCoordinator:
    def hello(self, client_id=None, lease_s=None, namespace=None, holder=None):
        from cpkv import CPConfig, KVShape

        return {
            "epoch": "e",
            "config": CPConfig(2, 4, 8),
            "kv": KVShape(),
            "lanes": [],
            "namespace_id": 2,
        }

    def allocate_extend(self, *args):
        time.sleep(30)

    def stats(self):
        time.sleep(30)


def test_a_pool_that_cannot_start_in_time_leaves_nothing_behind(ray_session):
    name = "slow-start"
    opts = {**DEFAULTS, "name": name, "start_timeout_s": 0.3}
    t0 = time.monotonic()
    with pytest.raises(TimeoutError, match=r"0\.3s"):  # lane processes take seconds to start
        cpkv.connect(**opts)
    assert time.monotonic() - t0 < 10
    with pytest.raises(ValueError):  # no coordinator was made
        ray.get_actor(name, namespace="cpkv")
    ours = [
        pg for pg in ray.util.placement_group_table().values() if pg["name"].startswith(f"{name}-")
    ]
    assert ours and all(pg["state"] == "REMOVED" for pg in ours), ours


def test_hung_coordinator_times_out_with_a_clear_error(ray_session):
    actor = _HungCoordinator.options(max_concurrency=4).remote()
    ray.get(actor.hello.remote())  # started: only the hung calls may time out
    client = CPKVClient(actor, timeout_s=0.5)
    t0 = time.monotonic()
    with pytest.raises(RequestTimeoutError, match=r"allocate_extend.*0\.5s"):
        client.allocate_extend("r", [1, 2, 3])
    with pytest.raises(RequestTimeoutError, match="stats"):
        client.stats()
    assert time.monotonic() - t0 < 5
    ray.kill(actor)


def test_a_restarting_lane_stalls_no_caller(make_client):
    """A killed lane is found lost and brought back while every other call answers at once.

    NOTE: how long Ray takes to restart the actor is not ours to set, so the window in which
    the lane is "restarting" may be shorter than one sample here; what a caller sees inside
    that window is pinned deterministically by test_coordinator's
    test_a_restarting_lane_stalls_nobody. Here: the real kill is detected, recorded and
    recovered from, and no call waits for it.
    """
    c = make_client()  # the session's pool: the lane is back at the end (checked below)
    live = {}
    for i in range(8):  # single-page requests spread over the lanes
        alloc = c.allocate_extend(f"one{i}", [100 + i])
        live[f"one{i}"] = int(alloc.new_pages[0]) % 4
    survivors = [rid for rid, lane in live.items() if lane != 3]
    losses_before = len(c.stats()["lane_losses"])
    ray.kill(c.lanes[3], no_restart=False)
    samples = []
    t0 = time.monotonic()
    c.allocate_decode(survivors)  # touches live lanes only, whatever lane 3's state
    samples.append(time.monotonic() - t0)
    saw_restarting, recovered = False, False
    end = time.monotonic() + 20
    while time.monotonic() < end and not recovered:
        t0 = time.monotonic()
        stats = c.stats()
        samples.append(time.monotonic() - t0)
        if stats["restarting_lanes"] == [3] and not saw_restarting:
            saw_restarting = True  # inside the window: a plan needing lane 3 waits
            t0 = time.monotonic()
            try:
                c.allocate_extend("big", np.arange(64))
                c.free("big", cache=False)  # it came back meanwhile
            except KVCapacityWaitError as e:
                assert e.reason == "lane_unavailable" and e.deficit_by_owner[3] > 0
            samples.append(time.monotonic() - t0)
        lost = [lane for lane, _ in stats["lane_losses"][losses_before:]]
        recovered = 3 in lost and stats["lane_states"] == ["up"] * 4
        time.sleep(0.02)
    assert recovered, f"lane 3 not found lost and back: {c.stats()}"
    assert max(samples) < 0.5, (max(samples), saw_restarting)
    c.allocate_decode(survivors)  # the survivors' requests outlived the loss
    c.allocate_extend("big2", np.arange(64))  # pages on every lane, lane 3 included
    assert c.check()["ok"]


SHAPE = {k: v for k, v in DEFAULTS.items() if k not in ("heartbeat_s", "timeout_s")}


@ray.remote(num_cpus=0)
class _Job:
    """A prefill job that connects from inside Ray and holds requests."""

    def run(self, name: str, n: int, lease_s: float) -> str:
        import cpkv

        self.client = cpkv.connect("auto", name=name, lease_s=lease_s, **SHAPE)
        for i in range(n):
            self.client.allocate_extend(f"job-{i}", np.arange(10 * i, 10 * i + 10))
        return self.client.client_id


def test_requests_of_a_dead_job_are_freed_when_its_lease_lapses(make_client, attach):
    c = attach(make_client(), lease_s=1.0)  # a client of the session's pool, leased for 1 s
    before = c.stats()  # lease counters run since the pool started
    c.allocate_extend("mine", np.arange(500, 520))
    job = _Job.remote()
    ray.get(job.run.remote(c.name, 3, 1.0))
    assert c.stats()["num_requests"] == 4
    time.sleep(2.5)  # both leases are renewed in the background meanwhile
    stats = c.stats()
    assert stats["num_requests"] == 4 and stats["leases_expired"] == before["leases_expired"]
    ray.kill(job)
    wait_for(lambda: c.stats()["leases_expired"] == before["leases_expired"] + 3, timeout=20)
    stats = c.stats()
    assert stats["num_requests"] == 1
    assert stats["leases_lapsed"] == before["leases_lapsed"] + 1
    c.allocate_decode(["mine"])  # the idle creator kept its request
    assert c.check()["ok"]


def test_attached_client_shutdown_leaves_the_pool(make_client):
    c = make_client()
    other = cpkv.connect(name=c.name, **SHAPE)
    assert not other.owns_pool and c.owns_pool
    other.allocate_extend("theirs", np.arange(30))
    c.allocate_extend("mine", np.arange(100, 110))
    other.shutdown()  # closes its lease: frees its requests, the pool stays
    stats = c.stats()
    assert stats["num_requests"] == 1
    c.allocate_decode(["mine"])
    assert c.check()["ok"]


@ray.remote(num_cpus=0)
class _Creator:
    def create(self, name: str) -> None:
        import cpkv

        cpkv.connect("auto", name=name, detached=True, **SHAPE)


def test_coordinator_restarts_after_its_creator_is_gone(ray_session):
    name = f"detached-{time.monotonic_ns()}"
    creator = _Creator.remote()
    ray.get(creator.create.remote(name))
    ray.kill(creator)  # the owner of everything the coordinator was built from is gone
    time.sleep(0.5)
    client = cpkv.connect(name=name, **SHAPE)
    try:
        client.allocate_extend("r", np.arange(20))
        old = client._epoch
        ray.kill(client._coord, no_restart=False)

        def restarted():
            try:
                return ray.get(client._coord.epoch.remote(), timeout=5) != old
            except ray.exceptions.RayError:
                return False

        wait_for(restarted)
        with pytest.raises(CoordinatorUnavailableError):
            client.allocate_decode(["r"])
        client.allocate_extend("again", np.arange(20))
        assert client.check()["ok"]
    finally:
        client.stop_pool()
    with pytest.raises(ValueError):
        ray.get_actor(name, namespace="cpkv")
