"""The client's own checks and loops, without Ray (a plain coordinator behind a fake Ray):
digests after a coordinator restart, backoff, timeouts, generate's partial output."""

from __future__ import annotations

import asyncio
import random
import time
import types
import warnings

import numpy as np
import pytest

import cpkv.client._backoff as backoff_module
from cpkv.errors import CoordinatorUnavailableError, InvalidRequestError, KVCapacityWaitError
from cpkv.results import PrefillResult
from tests.plain_client import PlainCoordinator, patch_ray, plain_client


@pytest.fixture
def coordinator(monkeypatch) -> PlainCoordinator:
    patch_ray(monkeypatch)
    return PlainCoordinator()


@pytest.mark.parametrize("batch", [False, True], ids=["single", "batch"])
def test_the_first_allocation_after_a_restart_digests_with_the_new_key(coordinator, batch):
    """Its pages are cached under the restarted coordinator's key (they were hashed with the
    dead one's: the same prompt never hit them)."""
    c = plain_client(coordinator)
    c.allocate_extend("x", np.arange(10))
    coordinator.restart()
    with pytest.raises(CoordinatorUnavailableError):
        c.allocate_extend("y", np.arange(3))  # finds it gone: the next call greets it
    prompt = np.arange(100, 112)  # three pages of 4
    if batch:
        c.allocate_extend_batch([("a", prompt), ("a2", np.arange(7))])
    else:
        c.allocate_extend("a", prompt)
    c.free("a")
    assert c.allocate_extend("b", prompt).prefix_len == 8


@pytest.fixture
def short_pool(coordinator, monkeypatch):
    """A client whose next 64-token allocation waits for capacity; its sleeps recorded."""
    c = plain_client(coordinator)
    c.allocate_extend("hold", np.arange(200))
    sleeps: list[float] = []
    clock = types.SimpleNamespace(
        monotonic=time.monotonic, sleep=lambda s: (sleeps.append(s), time.sleep(s))
    )
    monkeypatch.setattr(backoff_module, "time", clock)
    return c, sleeps


def test_backoff_never_sleeps_past_its_cap(short_pool):
    c, sleeps = short_pool
    with pytest.raises(KVCapacityWaitError):
        c.allocate_extend_with_backoff(
            "big", np.arange(1000, 1064), deadline_s=0.4, initial_backoff_s=0.01,
            max_backoff_s=0.05, rng=random.Random(1),
        )  # fmt: skip
    assert len(sleeps) > 3 and max(sleeps) <= 0.05


@pytest.mark.parametrize(
    ("kwargs", "named"),
    [
        ({"initial_backoff_s": 0.0}, "initial_backoff_s"),
        ({"initial_backoff_s": 0.2, "max_backoff_s": 0.05}, "max_backoff_s"),
        ({"rng": 7}, "rng"),
    ],
    ids=["zero", "initial-above-max", "rng"],
)
def test_a_backoff_that_would_spin_or_misbehave_is_refused_before_any_call(
    short_pool, kwargs, named
):
    c, sleeps = short_pool
    with pytest.raises(InvalidRequestError, match=named):
        c.allocate_extend_with_backoff("big", np.arange(1000, 1064), deadline_s=0.3, **kwargs)
    assert sleeps == []


@pytest.mark.parametrize("timeout_s", [0, -1.0, float("nan"), "5"])
def test_a_timeout_that_fails_every_call_is_refused(coordinator, timeout_s):
    with pytest.raises(InvalidRequestError, match="timeout_s"):
        plain_client(coordinator, timeout_s=timeout_s)


def test_generate_hands_back_the_ids_made_before_a_step_failed(coordinator, monkeypatch):
    c = plain_client(coordinator)
    asked = []

    def prefill(rid, tokens, **kwargs):
        asked.append(kwargs["deadline_s"])
        return PrefillResult(None, None, [], "pass_q", next_token=7)

    def decode_greedy(rids, tokens, **kwargs):
        asked.append(kwargs["deadline_s"])
        if len(asked) == 3:
            raise KVCapacityWaitError(
                "short", required_by_owner=[1], available_by_owner=[0], deficit_by_owner=[1]
            )
        return np.array([tokens[0] + 1])

    monkeypatch.setattr(c, "prefill", prefill)
    monkeypatch.setattr(c, "decode_greedy", decode_greedy)
    with pytest.raises(KVCapacityWaitError) as info:
        c.generate("r", [1, 2, 3], max_new_tokens=5, deadline_s=0.5)
    assert info.value.generated == [7, 8] and asked == [0.5, 0.5, 0.5]


def test_stats_async_takes_lanes_as_stats_does(coordinator, monkeypatch):
    c = plain_client(coordinator)
    monkeypatch.setattr(c, "lane_info", lambda: [{"lane": 0}, {"lane": 1}])  # no lane actors
    assert asyncio.run(c.stats_async(lanes=True))["lanes"] == [{"lane": 0}, {"lane": 1}]
    assert "lanes" not in asyncio.run(c.stats_async())


def test_a_bool_among_slots_is_refused(coordinator):
    import torch

    c = plain_client(coordinator)
    slots = c.allocate_extend("r", np.arange(8)).out_cache_loc
    kv = torch.ones(3, 2, 8)
    with pytest.raises(InvalidRequestError, match="bools"):
        c.store_kv([True, int(slots[1]), int(slots[2])], kv, kv)


def test_generate_after_a_timed_out_step_resumes_with_that_steps_call_id(monkeypatch):
    """A decode step answered after the client's timeout was sent: the coordinator appended
    its input id. ``decode_greedy`` with ``e.call_id`` takes that step's answer, as
    ``generate`` documents; a new call would append the last id a second time."""
    import concurrent.futures as cf

    import ray

    import tests.test_reliability as reliability
    from cpkv.core.steps import StepResult
    from cpkv.errors import RequestTimeoutError

    class GreedyLanes(reliability.StepLanes):
        def _answer(self, lane, step_id, status, result) -> None:
            status.set_result({"step_id": step_id})
            nxt = {0: 10 + step_id} if lane == 0 else {}
            result.set_result(StepResult(0, 0.0, 0.0, 0.0, "pass_q", 0, next_tokens=nxt))

    patch_ray(monkeypatch)
    plain_get = ray.get

    def get(ref, timeout=None):
        return ref.result(timeout) if isinstance(ref, cf.Future) else plain_get(ref, timeout)

    def wait(refs, num_returns=1, timeout=None):
        done, _ = cf.wait(refs, timeout=timeout, return_when=cf.FIRST_COMPLETED)
        ready = [r for r in refs if r in done][:num_returns]
        return ready, [r for r in refs if r not in ready]

    monkeypatch.setattr(ray, "get", get)
    monkeypatch.setattr(ray, "wait", wait)
    monkeypatch.setattr(reliability, "StepLanes", GreedyLanes)
    coordinator = PlainCoordinator()
    coordinator.core, lanes = reliability.make()
    c = plain_client(coordinator, timeout_s=0.5, call_retries=0)
    lanes.hold.add(3)  # the second decode step runs past the client's timeout
    prompt = np.arange(1, 9)
    with pytest.raises(RequestTimeoutError) as info:
        c.generate("r", prompt, max_new_tokens=5)
    e = info.value
    assert e.generated == [11, 12]  # the prefill's id and the first decode's
    lanes.release(3)
    assert list(c.decode_greedy(["r"], [e.generated[-1]], call_id=e.call_id)) == [13]
    held = coordinator.core._core.request_len(coordinator.core._namespaces.key(c.client_id, "r"))
    assert held == len(prompt) + len(e.generated)  # the last id went in once


def test_a_timeout_set_on_a_live_client_is_checked_and_reaches_its_lane_calls(coordinator):
    """``timeout_s`` and ``call_retries`` set after connect are checked as connect checks them,
    and the timeout governs every call after, the lanes' K/V reads and writes included."""
    c = plain_client(coordinator)
    for bad in (0, -1.0, float("nan"), "3"):
        with pytest.raises(InvalidRequestError, match="timeout_s"):
            c.timeout_s = bad
    for bad in (-1, 1.5):
        with pytest.raises(InvalidRequestError, match="call_retries"):
            c.call_retries = bad
    c.timeout_s, c.call_retries = 2.5, 3
    assert c.timeout_s == c._io.timeout_s == 2.5 and c.call_retries == 3


def test_a_cancelled_async_call_is_finished_in_the_background_and_recorded(coordinator):
    """A serving framework cancels the task of an aborted request: the call was sent and took
    effect at the coordinator, so the client finishes it in the background and records it
    (a retry of the operation then does not allocate twice, and a cleanup over live_rids
    frees it); the caller still sees its cancellation."""
    c = plain_client(coordinator, timeout_s=5.0)

    async def cancelled(coro) -> None:
        task = asyncio.create_task(coro)
        await asyncio.sleep(0.05)  # sent; its answer on the way
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await asyncio.sleep(0.4)  # the answer arrives

    async def main() -> None:
        coordinator.delays["allocate_extend"] = 0.2
        await cancelled(c.allocate_extend_async("r", np.arange(10)))
        assert c.live_rids == {"r"} and c._requests.held["r"] == 10
        coordinator.delays["free"] = 0.2
        await cancelled(c.free_async("r"))
        assert c.live_rids == set()
        assert coordinator.core._core.num_requests == 0

    asyncio.run(main())


def test_a_blocking_call_inside_a_running_event_loop_warns_once(coordinator):
    c = plain_client(coordinator)

    async def main() -> None:
        with pytest.warns(RuntimeWarning, match="allocate_extend_async"):
            c.allocate_extend("r", np.arange(4))
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            c.free("r")  # once a client

    asyncio.run(main())
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        c.allocate_extend("s", np.arange(4))  # no loop: no warning


def test_a_background_finish_cancelled_by_its_loop_closing_ends_there(coordinator):
    """asyncio.run cancels what is left when its coroutine returns: the cancelled call's
    background finish ends then (it once scheduled yet another, left pending and kept)."""
    import cpkv.client._calls as calls_module

    c = plain_client(coordinator, timeout_s=5.0)
    coordinator.delays["allocate_extend"] = 1.0

    async def main() -> None:
        task = asyncio.create_task(c.allocate_extend_async("r", np.arange(10)))
        await asyncio.sleep(0.05)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(main())
    assert not calls_module._BACKGROUND
