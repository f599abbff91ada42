"""The client's recovery paths, without Ray (``tests/plain_client.py``): the call after a
coordinator died reaches its restart, a retry by the call id a timeout handed back asks the
same thing, a call id that would not be recognised as a repeat is refused, lane calls time
out by one deadline, clients keep their namespaces' pages apart across a restart, and a
client dropped without shutdown frees its requests."""

from __future__ import annotations

import numpy as np
import pytest

from cpkv.errors import CoordinatorUnavailableError, InvalidRequestError, RequestTimeoutError
from tests.plain_client import PlainCoordinator, patch_ray, plain_client


@pytest.fixture
def coordinator(monkeypatch) -> PlainCoordinator:
    patch_ray(monkeypatch)
    return PlainCoordinator()


def test_the_call_after_a_coordinator_died_under_one_reaches_its_restart(coordinator):
    c = plain_client(coordinator)
    c.allocate_extend("x", np.arange(10))
    coordinator.dead = True
    with pytest.raises(CoordinatorUnavailableError) as info:
        c.allocate_extend("y", np.arange(10))
    assert info.value.rids == ["x"]
    with pytest.raises(CoordinatorUnavailableError):  # still down: said again, nothing lost
        c.allocate_decode(["x"])
    coordinator.restart()  # Ray restarted it: a new epoch
    alloc = c.allocate_extend("z", np.arange(10))  # not refused as the old epoch's
    assert alloc.rid == "z" and alloc.extend_len == 10
    assert c.check()["ok"]


def test_a_retry_by_the_call_id_of_a_stale_digest_fallback_sends_the_ids(coordinator):
    """Another client of the namespace extended the request: the digest went stale and the
    ids went under ("tokens", call id); that answer lost, the timeout hands that id back."""
    a = plain_client(coordinator, namespace="job", call_retries=0)
    b = plain_client(coordinator, namespace="job", call_retries=0)
    a.allocate_extend("r", np.arange(6))  # a holds 6: the next chunk digests at offset 2
    b.allocate_extend("r", np.arange(6, 7))  # now 7
    coordinator.lose = lambda name, args: name == "allocate_extend" and args[2][:1] == ("tokens",)
    tokens = np.arange(7, 12)
    with pytest.raises(RequestTimeoutError) as info:
        a.allocate_extend("r", tokens)
    coordinator.lose = None
    assert info.value.call_id[0] == "tokens"
    alloc = a.allocate_extend("r", tokens, call_id=info.value.call_id)  # its first answer
    assert (alloc.prefix_len, alloc.extend_len) == (7, 5)
    assert a.stats()["num_requests"] == 1 and a.check()["ok"]


@pytest.mark.parametrize(
    "call_id", [float("nan"), ("job", float("nan")), ("job", [1])], ids=["nan", "nan-in", "list"]
)
def test_a_call_id_that_would_not_match_its_repeat_is_refused_before_any_call(coordinator, call_id):
    c = plain_client(coordinator)
    with pytest.raises(InvalidRequestError, match="call_id"):
        c.allocate_extend("r", np.arange(8), call_id=call_id)
    assert c.stats()["num_requests"] == 0


def test_lanes_answering_late_in_turn_time_out_by_one_deadline(monkeypatch):
    """Each lane within ``timeout_s`` of the one before, all of them past it: a timeout a
    lane would have waited ``cp_size`` times as long."""
    import time

    import ray

    from cpkv.core.layout import PageLayout
    from cpkv.lane_io import LaneIO
    from tests.plain_client import KV

    start = time.monotonic()

    def get(answer_at: float, timeout: float | None = None) -> str:
        wait = answer_at - time.monotonic()
        if timeout is not None and wait > timeout:
            time.sleep(timeout)
            raise ray.exceptions.GetTimeoutError("late")
        time.sleep(max(0.0, wait))
        return "ok"

    monkeypatch.setattr(ray, "get", get)
    io = LaneIO(
        [None] * 3, PageLayout(3, 4), KV, 3 * 32 * 4, 1, 0.5,
        fence=lambda: None, fence_waiting=lambda: False, refresh_fence=lambda: None,
        unwrap=lambda x: x, lane_lost=None,
    )  # fmt: skip
    refs = [(r, start + 0.3 * (r + 1)) for r in range(3)]  # lane r answers at 0.3 (r + 1) s
    with pytest.raises(RequestTimeoutError, match="lane 1"):
        io.wait_lanes(refs, "lane_info")
    assert io.wait_lanes([(0, time.monotonic() + 0.05)], "ping") == ["ok"]  # a new deadline


def test_clients_greeting_a_restarted_coordinator_in_another_order_keep_to_their_pages(
    coordinator,
):
    """A restarted coordinator numbers namespaces again as clients greet it: each client
    takes its new id, so the lanes still tell their pages apart."""
    import torch

    from tests.plain_client import KV

    a, b = plain_client(coordinator), plain_client(coordinator)

    def kv(n: int):
        return torch.ones(n, KV.num_heads, KV.head_dim), torch.ones(n, KV.num_heads, KV.head_dim)

    coordinator.restart()
    for client, rid in ((b, "rb"), (a, "ra")):  # b greets the new coordinator first
        with pytest.raises(CoordinatorUnavailableError):
            client.allocate_extend(rid, np.arange(8))
    mine, theirs = a.allocate_extend("ra", np.arange(8)), b.allocate_extend("rb", np.arange(8))
    a.store_kv(mine.out_cache_loc, *kv(8))
    with pytest.raises(InvalidRequestError, match="another namespace"):
        a.store_kv(theirs.out_cache_loc, *kv(8))


def test_a_client_dropped_without_shutdown_frees_its_requests(coordinator):
    """Its process lives on (a pooled Ray worker, say), so its lease would never lapse: the
    coordinator keeps a live process's lease. Dropped, it is closed as shutdown closes it."""
    import gc
    import time

    c = plain_client(coordinator, lease_s=0.3)
    c.allocate_extend("r", np.arange(8))
    core = coordinator.core
    assert core.stats()["num_requests"] == 1
    del c
    gc.collect()
    deadline = time.monotonic() + 10
    while core.stats()["num_requests"]:
        assert time.monotonic() < deadline, "the dropped client's request is still held"
        time.sleep(0.02)


@pytest.mark.parametrize(
    ("dead", "cp"), [(True, 2), (False, 2), (False, 4)], ids=["death", "slow", "slow-cp4"]
)
def test_a_refusal_behind_another_lanes_death_reports_the_death(monkeypatch, dead, cp):
    """A write to both lanes just after lane 1 died: the coordinator freed the lost request's
    pages on lane 0 first, whose refusal ('on a page that is free') hid lane 1's death (seen
    in CI). Lanes merely slow after a refusal hold it no longer than one grace, all of them
    together."""
    import time

    import ray

    from cpkv.core.layout import PageLayout
    from cpkv.errors import LaneUnavailableError
    from cpkv.lane_io import _DEATH_GRACE_S, LaneIO
    from tests.plain_client import KV

    refused = InvalidRequestError("lane 0: local slot 4 is on a page that is free")

    def get(answer, timeout: float | None = None):
        if answer == "refused":
            raise ray.exceptions.RayTaskError("store_kv", "traceback", refused)
        if dead:
            raise ray.exceptions.ActorDiedError()
        time.sleep(timeout)
        raise ray.exceptions.GetTimeoutError("late")

    def lane_lost(lane: int, what: str, why: str) -> Exception:
        return LaneUnavailableError(lane, ["r"], why)

    monkeypatch.setattr(ray, "get", get)
    io = LaneIO(
        [None] * cp, PageLayout(cp, 4), KV, cp * 32 * 4, 1, 30.0,
        fence=lambda: None, fence_waiting=lambda: False, refresh_fence=lambda: None,
        unwrap=lambda x: x, lane_lost=lane_lost,
    )  # fmt: skip
    t0 = time.monotonic()
    with pytest.raises(LaneUnavailableError if dead else InvalidRequestError):
        io.wait_lanes([(0, "refused")] + [(r, f"lane {r}") for r in range(1, cp)], "store_kv")
    assert time.monotonic() - t0 < _DEATH_GRACE_S + 0.5
