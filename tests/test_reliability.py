"""Issue 19 without Ray: failed steps, safe retries, namespaces, leases that hold, hung lanes.

A coordinator over real lane shards (a local transport) and a stepped clock; lanes whose
steps succeed, fail or never answer are scripted here.
"""

from __future__ import annotations

import time
from concurrent.futures import Future

import numpy as np
import pytest

from cpkv import CPConfig, KVShape
from cpkv.coordinator import coordinator as coordinator_module
from cpkv.coordinator.channel import ChannelClosedError, LaneDeadError, LaneUnreachableError
from cpkv.coordinator.coordinator import Coordinator
from cpkv.core.reply_cache import DROPPED, ReplyCache, _Runs
from cpkv.core.steps import StepResult
from cpkv.errors import (
    CoordinatorUnavailableError,
    InvalidRequestError,
    KVCapacityWaitError,
    LaneUnavailableError,
    LeaseExpiredError,
    StepFailedError,
)
from cpkv.lanes.shard import CACHED, NOT_YET, LaneShard

from .local_lanes import LocalLaneTransport

CFG = CPConfig(cp_size=2, page_size=4, num_pages_per_lane=32, max_reqs=16, max_context_len=512)
KV = KVShape(num_layers=1, num_heads=2, head_dim=8, dtype="float32")
VOCAB = 64


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class StepLanes(LocalLaneTransport):
    """Local lanes that also take steps: each answers ``(status, result)`` futures, failing
    the steps named in ``fail`` and leaving lanes in ``hung`` silent."""

    def __init__(self) -> None:
        super().__init__(CFG.cp_size, CFG.num_pages_per_lane, CFG.page_size, KV)
        self.fail: set[int] = set()  # step ids that fail
        self.hung: set[int] = set()  # lanes that answer nothing
        self.hold: set[int] = set()  # step ids left running until released
        self._held: dict[int, list[tuple[int, Future, Future]]] = {}
        self.killed: list[int] = []
        self.late: set[int] = set()  # lanes whose heartbeats wait for answer_heartbeats()
        self.late_heartbeats: list[tuple[int, Future]] = []
        self.heartbeat_errors: dict[int, BaseException] = {}  # lane: what its heartbeats raise

    def submit(self, lane, method, *args):
        if method == "heartbeat" and lane in self.heartbeat_errors:
            self.calls.append((lane, method))
            future = Future()
            future.set_exception(self.heartbeat_errors[lane])
            return future
        if method == "heartbeat" and lane in self.late:
            self.calls.append((lane, method))
            future = Future()
            self.late_heartbeats.append((lane, future))
            return future
        if lane in self.hung:
            self.calls.append((lane, method))
            # Never answered (a step, as a Ray method of two returns, gives two handles).
            return (Future(), Future()) if method == "step" else Future()
        if method != "step":
            return super().submit(lane, method, *args)
        step = args[0]
        status, result = Future(), Future()
        try:  # the page move riding in the call lands first, as on a lane actor
            if lane in self.dead:
                raise LaneDeadError(f"lane {lane} is dead")
            self.shards[lane].apply_riding(args[1] if len(args) > 1 else None)
        except Exception as e:
            status.set_exception(e)
            result.set_exception(e)
            return status, result
        if step.step_id in self.hold:
            self._held.setdefault(step.step_id, []).append((lane, status, result))
        else:
            self._answer(lane, step.step_id, status, result)
        return status, result  # as a Ray actor method of two returns gives two handles

    def _answer(self, lane: int, step_id: int, status: Future, result: Future) -> None:
        if step_id in self.fail:
            err = RuntimeError(f"lane {lane}: step {step_id} failed")
            status.set_exception(err)
            result.set_exception(err)
        else:
            status.set_result({"step_id": step_id})
            result.set_result(StepResult(0, 0.0, 0.0, 0.0, "pass_q", 0))

    def release(self, step_id: int, fail: bool = False) -> None:
        """Every lane answers the held step ``step_id`` now (``fail``: with an error)."""
        if fail:
            self.fail.add(step_id)
        for lane, status, result in self._held.pop(step_id):
            self._answer(lane, step_id, status, result)

    def answer_heartbeats(self) -> None:
        """Answer the heartbeats held back by ``late`` lanes, as their lanes would have."""
        for lane, future in self.late_heartbeats:
            shard = self.shards[lane]
            future.set_result((shard.incarnation, shard.num_held_pages))
        self.late_heartbeats.clear()

    def kill(self, lane: int) -> None:
        self.killed.append(lane)
        self.hung.discard(lane)
        self.restart(lane)


def make(clock=None, **kwargs) -> tuple[Coordinator, StepLanes]:
    lanes = StepLanes()
    coord = Coordinator(
        CFG,
        KV,
        lanes,
        heartbeat_s=0,
        lane_restart_timeout_s=5,
        clock=clock or Clock(),
        vocab_size=VOCAB,
        **kwargs,
    )
    # Steps need a lane group: these lanes take steps without one.
    coord._ensure_group = lambda: "g"
    coord._group_is_current = lambda group: True
    return coord, lanes


def ok(out):
    if isinstance(out, Exception):
        raise out
    return out


def prefill(coord, client, rid, tokens, call_id=None):
    return ok(coord.prefill(coord.epoch, client, call_id, rid, np.asarray(tokens)))


# ------------------------------------------------------------ failed steps (19.1, 19.2)
def test_a_failed_prefill_never_reaches_the_prefix_cache():
    """The step's pages were decided before it ran; it failed: nothing of it is cached,
    whatever free is told, and the request is failed until freed."""
    coord, lanes = make()
    coord.hello("a")
    prompt = np.arange(1, 33)
    lanes.fail.add(1)
    prefill(coord, "a", "r", prompt)  # the answer comes before the outcome
    with pytest.raises(StepFailedError, match="step 1 failed"):
        ok(coord.allocate_decode(coord.epoch, "a", None, ["r"], [5]))
    assert coord.stats()["failed_steps"] == 1
    ok(coord.free(coord.epoch, "a", None, "r", True))  # acknowledged; caches nothing
    assert coord.stats()["cached"] == [0, 0]
    again = prefill(coord, "a", "r2", prompt)
    assert again["allocations"][0].cached_len == 0  # no hit on pages never written
    assert coord.check()["ok"]


def test_a_step_still_running_after_its_rid_was_freed_and_reused_settles_on_its_own_request():
    """Steps are tracked by request, not by rid: the old request's step finishing after a new
    request took its rid neither marks the new one's K/V written (its pages would be cached
    before its own step ran, then hit by a later prompt after that step failed) nor fails it."""
    coord, lanes = make()
    coord.hello("a")
    prompt = np.arange(1, 17)
    lanes.hold.update({1, 2})
    prefill(coord, "a", "r", prompt)  # step 1, still running
    ok(coord.free(coord.epoch, "a", None, "r", True))  # nothing of step 1 is known written
    prefill(coord, "a", "r", prompt)  # step 2: another request of the same name
    lanes.release(1)  # the freed request's step succeeds
    ok(coord.free(coord.epoch, "a", None, "r", True))  # step 2 still running: caches nothing
    lanes.release(2, fail=True)
    assert coord.stats()["cached"] == [0, 0]
    hit = ok(coord.allocate_extend(coord.epoch, "a", None, "probe", prompt))
    assert hit.cached_len == 0  # no hit on K/V that no step wrote
    assert coord.check()["ok"]


def test_a_freed_requests_failed_step_does_not_fail_the_request_that_reused_its_rid():
    coord, lanes = make()
    coord.hello("a")
    lanes.hold.add(1)
    prefill(coord, "a", "r", np.arange(1, 9))  # step 1, still running
    ok(coord.free(coord.epoch, "a", None, "r", False))
    prefill(coord, "a", "r", np.arange(1, 9))  # step 2 succeeds at once
    lanes.release(1, fail=True)
    slots = ok(coord.allocate_decode(coord.epoch, "a", None, ["r"], [5]))
    assert len(slots) == 1 and coord.stats()["failed_steps"] == 1
    assert coord._core.request_len(coord._namespaces.key("a", "r")) == 9


def test_a_step_that_cannot_be_sent_fails_its_request_and_sends_its_moves_as_its_callers(
    monkeypatch,
):
    """Putting the step in the object store fails after its pages were decided: the request
    is failed (its K/V never written, so nothing of it is cached, and a retry of the call
    answers the same), and its page moves go out at once, numbered in order and owned by
    the caller's namespace (not by whoever calls next)."""
    coord, lanes = make()
    ns_a = coord.hello("a")["namespace_id"]
    coord.hello("b")
    monkeypatch.setattr(coordinator_module, "worth_sharing", lambda step, cp: True)
    failures = iter([MemoryError("object store full")])

    def share(obj):
        for error in failures:
            raise error
        return obj

    lanes.share = share
    prompt = np.arange(1, 33)
    with pytest.raises(StepFailedError, match="could not be sent: MemoryError"):
        prefill(coord, "a", "r", prompt, call_id=1)
    with pytest.raises(StepFailedError, match="could not be sent"):  # the retry: the same
        prefill(coord, "a", "r", prompt, call_id=1)
    ok(coord.allocate_extend(coord.epoch, "b", None, "other", np.arange(100, 104)))
    assert coord.check()["ok"]  # every move decided so far applied on the lanes
    pages = coord._core.request_pages(coord._namespaces.key("a", "r"))
    assert [int(lanes.shards[p % 2]._owner[p // 2]) for p in pages] == [ns_a] * len(pages)
    ok(coord.free(coord.epoch, "a", None, "r", True))
    assert coord.stats()["cached"] == [0, 0]
    hit = prefill(coord, "b", "r2", np.append(prompt, 7))
    assert hit["allocations"][0].cached_len == 0
    assert coord.stats()["lane_losses"] == []
    assert coord.check()["ok"]


def test_a_successful_prefill_is_cached_and_a_failed_decode_is_not_repeated():
    coord, lanes = make()
    coord.hello("a")
    prompt = np.arange(1, 33)
    prefill(coord, "a", "r", prompt)
    lanes.fail.add(2)
    ok(coord.decode(coord.epoch, "a", None, ["r"], np.array([7])))
    # The retry of the failed decode is refused: its length must not grow twice.
    with pytest.raises(StepFailedError):
        ok(coord.decode(coord.epoch, "a", None, ["r"], np.array([7])))
    assert coord._core.request_len(coord._namespaces.key("a", "r")) == 33
    ok(coord.free(coord.epoch, "a", None, "r", True))
    # The prefill's 32 tokens were written: their full pages are cached, the decode's not.
    assert sum(coord.stats()["cached"]) == 8
    hit = prefill(coord, "a", "r2", np.append(prompt, 9))
    assert hit["allocations"][0].cached_len == 32


def test_a_step_with_a_token_outside_the_vocabulary_is_refused_before_any_decision():
    coord, _ = make()
    before = coord.stats()
    out = coord.prefill(coord.epoch, "a", None, "r", np.array([1, 2, VOCAB]))
    assert isinstance(out, InvalidRequestError) and str(VOCAB) in str(out)
    out = coord.decode(coord.epoch, "a", None, ["r"], np.array([VOCAB + 5]))
    assert isinstance(out, InvalidRequestError)
    assert coord.stats()["num_requests"] == before["num_requests"] == 0


def test_misuse_that_skips_the_client_is_answered_as_an_invalid_request():
    """The coordinator's calls answer values (never raise): arguments only the client checks
    are refused there too, before they reach a decision."""
    coord, lanes = make()
    lanes.hold.add(1)
    prefill(coord, "a", "r", np.arange(1, 9))  # its step in flight
    bad = [
        coord.free(coord.epoch, "a", None, "r", True, "3"),
        coord.allocate_extend(coord.epoch, "a", None, "n", [1, 2**63]),
        coord.prefill(coord.epoch, "a", None, "n", [1, 2**64]),
        coord.allocate_extend(coord.epoch, "a", None, "n", [1, "x"]),
        coord.decode(coord.epoch, "a", None, ["r"], None),  # a step with no token ids
        coord.allocate_extend(coord.epoch, "a", None, "n", np.array([1, 2**64], dtype=object)),
        coord.prefill(coord.epoch, "a", None, "n", np.array(["1", "x"])),
        coord.free(coord.epoch, "a", None, "r", "no"),
    ]
    for out in bad:
        assert isinstance(out, InvalidRequestError), out
    lanes.release(1)
    assert coord.stats()["num_requests"] == 1
    assert coord._core.request_len(coord._namespaces.key("a", "r")) == 8


# --------------------------------------------------------------- safe retries (19.3)
def test_a_repeated_call_id_takes_effect_once_and_only_for_its_own_call():
    coord, _ = make()
    tokens = np.arange(1, 41)
    first = ok(coord.allocate_extend(coord.epoch, "a", 7, "r", tokens))
    again = ok(coord.allocate_extend(coord.epoch, "a", 7, "r", tokens))
    assert again is first and coord._core.request_len(coord._namespaces.key("a", "r")) == 40
    # The same call id with other arguments is refused, not answered with A's allocation.
    other = coord.allocate_extend(coord.epoch, "a", 7, "r", tokens[:5])
    assert isinstance(other, InvalidRequestError) and "call_id=7" in str(other)
    # Another client's call id 7 is another call.
    theirs = ok(coord.allocate_extend(coord.epoch, "b", 7, "r", tokens))
    assert theirs is not first and coord.stats()["num_requests"] == 2
    # A retried free frees once.
    assert ok(coord.free(coord.epoch, "a", 8, "r", True)) == ok(
        coord.free(coord.epoch, "a", 8, "r", True)
    )


def test_replies_are_bounded_in_bytes_and_a_dropped_reply_is_never_rerun():
    cache = ReplyCache(100, max_bytes=1000)
    for i in range(5):
        cache.put(i, f"r{i}", tag="t", nbytes=400)
    assert cache.nbytes <= 1000 and len(cache) == 5
    assert cache.get(0) is DROPPED and cache.get(4) == "r4"
    coord, _ = make()
    coord._replies = ReplyCache(100, max_bytes=1)
    ok(prefill(coord, "a", "r", np.arange(1, 9), call_id=1))
    out = coord.prefill(coord.epoch, "a", 1, "r", np.arange(1, 9))
    assert isinstance(out, InvalidRequestError) and "no longer kept" in str(out)
    assert coord._core.request_len(coord._namespaces.key("a", "r")) == 8


def test_past_the_count_bound_a_numbered_key_is_known_forgotten_and_a_new_one_is_not():
    cache = ReplyCache(2, numbered=lambda key: key if isinstance(key, tuple) else None)
    for n in (1, 2, 3):
        cache.put(("a", n), n)
    cache.put("plain", 0)  # an unnumbered key: forgotten for good once dropped
    assert ("a", 1) not in cache and ("a", 2) not in cache
    assert cache.is_forgotten(("a", 1)) and cache.is_forgotten(("a", 2))
    assert not cache.is_forgotten(("a", 3)) and not cache.is_forgotten(("a", 4))
    assert not cache.is_forgotten(("b", 1)) and not cache.is_forgotten("other")
    # A number that comes late (a client's other thread), after later ones were forgotten,
    # was never answered: it is new.
    cache.put(("a", 7), 7)
    for n in (8, 9):
        cache.put(("a", n), n)
    assert cache.is_forgotten(("a", 7)) and cache.is_forgotten(("a", 3))
    assert not cache.is_forgotten(("a", 5))
    cache.forget_stream("a")
    assert not cache.is_forgotten(("a", 1))


def test_forgotten_numbers_are_kept_as_runs_whatever_their_order():
    rng = np.random.default_rng(0)
    for _ in range(50):
        runs, seen = _Runs(), set()
        for n in rng.permutation(40)[: rng.integers(0, 40)]:
            runs.add(int(n))
            seen.add(int(n))
        assert [n for n in range(-1, 42) if n in runs] == sorted(seen)
        assert len(runs) == sum(1 for n in seen if n - 1 not in seen)  # one run a gap


def test_a_clients_retry_older_than_the_remembered_calls_is_refused_not_run_again(monkeypatch):
    monkeypatch.setattr(coordinator_module, "_MAX_REMEMBERED_CALLS", 8)
    coord, _ = make()
    first = ("a", 0)  # the ids a client makes: (client id, n)
    ok(coord.allocate_extend(coord.epoch, "a", first, "r", np.arange(1, 11)))
    for n in range(1, 20, 2):  # its later calls, and another client's, push it out
        ok(coord.allocate_extend(coord.epoch, "a", ("a", n), "x", [1]))
        ok(coord.free(coord.epoch, "a", ("a", n + 1), "x", False))
        coord.free(coord.epoch, "b", ("b", n), "ghost", False)  # answered (an error)
    late = coord.allocate_extend(coord.epoch, "a", first, "r", np.arange(1, 11))
    assert isinstance(late, InvalidRequestError) and "no longer kept" in str(late)
    assert coord._core.request_len(coord._namespaces.key("a", "r")) == 10  # not extended twice
    # Its retry with token ids (after a stale digest) is numbered alike.
    tokens_id = ("tokens", ("a", 1))
    ok(coord.allocate_extend(coord.epoch, "a", tokens_id, "t", [1]))
    for n in range(2, 12, 2):
        ok(coord.allocate_extend(coord.epoch, "a", ("tokens", ("a", n)), "y", [1]))
        ok(coord.free(coord.epoch, "a", ("tokens", ("a", n + 1)), "y", False))
    late = coord.allocate_extend(coord.epoch, "a", tokens_id, "t", [1])
    assert isinstance(late, InvalidRequestError)
    assert coord._core.request_len(coord._namespaces.key("a", "t")) == 1
    # A client that closed its lease sends nothing more: what was kept of it goes.
    coord.close_lease("a")
    assert not coord._replies.is_forgotten(("a", first))


def _walked_put(replies: dict, key, reply, nbytes: int, capacity: int, max_bytes: int) -> None:
    """The byte bound as a walk over every kept reply, oldest first (the reference); a
    reply over the bound by itself is dropped at once, the others kept."""
    replies.pop(key, None)
    replies[key] = (reply, nbytes) if nbytes <= max_bytes else (DROPPED, 0)
    while len(replies) > capacity:
        del replies[next(iter(replies))]
    total = sum(size for _, size in replies.values())
    for k, (_, size) in list(replies.items()):
        if total <= max_bytes:
            break
        if size:
            replies[k] = (DROPPED, 0)
            total -= size


def test_the_byte_bound_drops_the_oldest_sized_replies_as_a_walk_would():
    rng = np.random.default_rng(7)
    cache, walked = ReplyCache(16, max_bytes=1000), {}
    for i in range(2000):
        key = int(rng.integers(0, 40))  # repeats re-put a key, as a retried call id would
        nbytes = int(rng.choice([0, 0, 100, 300, 1200]))
        cache.put(key, f"r{i}", tag="t", nbytes=nbytes)
        _walked_put(walked, key, f"r{i}", nbytes, 16, 1000)
        assert {k: cache.get(k) for k in walked} == {k: r for k, (r, _) in walked.items()}
        assert cache.nbytes == sum(size for _, size in walked.values()) <= 1000
        assert len(cache) == len(walked) <= 16


# ---------------------------------------------------------------- namespaces (19.4)
def test_two_clients_requests_of_one_name_never_meet():
    coord, _ = make()
    for client in ("a", "b"):
        coord.hello(client)
    ok(coord.allocate_extend(coord.epoch, "a", None, "req-0", np.arange(1, 21)))
    ok(coord.allocate_extend(coord.epoch, "b", None, "req-0", np.arange(1, 9)))
    assert coord.stats()["num_requests"] == 2
    ok(coord.free(coord.epoch, "b", None, "req-0", False))
    assert coord._core.request_len(coord._namespaces.key("a", "req-0")) == 20
    with pytest.raises(InvalidRequestError, match="req-0"):
        ok(coord.free(coord.epoch, "b", None, "req-0", False))
    # Clients of one named namespace share their requests on purpose.
    coord.hello("driver", namespace="job")
    coord.hello("actor", namespace="job")
    ok(coord.allocate_extend(coord.epoch, "driver", None, "x", np.arange(1, 5)))
    ok(coord.allocate_extend(coord.epoch, "actor", None, "x", np.arange(5, 9)))
    assert coord._core.request_len(coord._namespaces.key("driver", "x")) == 8


def test_lanes_let_a_namespace_write_only_its_pages_and_read_cached_ones():
    shard = LaneShard(0, 8, 2, KV, "cpu")
    shard.reset("g")
    shard.apply("g", 1, np.array([1, 2], np.int32), np.empty(0, np.int32), owner=5)
    shard.apply("g", 2, np.array([3], np.int32), np.empty(0, np.int32), owner=6)
    k = v = np.zeros((1, 2, 8), np.float32)
    import torch

    k = v = torch.from_numpy(k)
    assert shard.store_kv(np.array([2]), k, v, owner=5) == 1  # page 1: ours
    with pytest.raises(InvalidRequestError, match="another namespace"):
        shard.store_kv(np.array([6]), k, v, owner=5)  # page 3: namespace 6's
    with pytest.raises(InvalidRequestError, match="another namespace"):
        shard.gather_kv(np.array([6]), owner=5)
    with pytest.raises(InvalidRequestError, match="free"):
        shard.store_kv(np.array([10]), k, v, owner=5)  # page 5: nobody's
    shard.apply("g", 3, np.empty(0, np.int32), np.empty(0, np.int32), 0, np.array([3], np.int32))
    assert shard._owner[3] == CACHED
    with pytest.raises(InvalidRequestError, match="cached"):
        shard.store_kv(np.array([6]), k, v, owner=6)  # cached pages are read-only
    shard.gather_kv(np.array([6]), owner=5)  # and readable
    for outside in (np.array([2, 16]), np.array([1])):  # past the shard, the reserved page
        with pytest.raises(InvalidRequestError, match="local slots span"):
            shard.gather_kv(outside, owner=5)
        with pytest.raises(InvalidRequestError, match="local slots span"):
            shard.gather_kv(outside)
    # A fence ahead of the moves applied: not yet (the caller asks again).
    assert shard.store_kv(np.array([2]), k, v, owner=5, fence=("g", 9)) == NOT_YET
    assert shard.store_kv(np.array([2]), k, v, owner=5, fence=("g", 3)) == 1
    # Namespace ids count up for the coordinator's life (one a client): past int32 too.
    big = 2**31 + 5
    shard.apply("g", 4, np.array([4], np.int32), np.empty(0, np.int32), owner=big)
    assert shard.store_kv(np.array([8]), k, v, owner=big) == 1
    with pytest.raises(InvalidRequestError, match="another namespace"):
        shard.store_kv(np.array([8]), k, v, owner=5)


def test_a_fence_of_a_generation_the_lane_has_not_reached_waits():
    """A fence of a later generation (its reset still on the way, or a restarted lane with
    none yet) is NOT_YET, not a misleading "page is free"; one of a generation the lane left
    falls to the namespace check (a client's fence covers all its requests: one made since by
    a step lives in the new generation)."""
    import torch

    g1, g2 = "e:g1", "e:g2"
    none = np.empty(0, np.int32)
    ones = torch.ones(1, 2, 8)
    fresh = LaneShard(0, 8, 4, KV, "cpu")
    assert fresh.store_kv(np.array([4]), ones, ones, owner=5, fence=(g2, 1)) == NOT_YET
    shard = LaneShard(0, 8, 4, KV, "cpu")
    shard.reset(g1)
    assert shard.store_kv(np.array([4]), ones, ones, owner=5, fence=(g2, 1)) == NOT_YET
    shard.reset(g2)
    shard.apply(g2, 1, np.array([1], np.int32), none, 5)
    assert shard.store_kv(np.array([4]), ones, ones, owner=5, fence=(g1, 3)) == 1
    with pytest.raises(InvalidRequestError, match="another namespace"):
        shard.store_kv(np.array([4]), ones, ones, owner=6, fence=(g1, 3))


@pytest.mark.parametrize(
    ("taken", "released", "cached", "match"),
    [
        ([4, 4], [], None, "twice"),
        ([], [1, 1], None, "twice"),
        ([-1], [], None, "outside"),
        ([8], [], None, "outside"),
        ([0], [], None, "outside"),
        ([2, 4], [1], None, "taking held"),  # page 2 is held: the release of 1 went first
        ([4], [3], None, "releasing free"),
        ([], [], [5], "caching free"),
    ],
    ids=["take-twice", "release-twice", "negative", "past-end", "reserved", "held",
         "release-free", "cache-free"],
)  # fmt: skip
def test_a_move_the_record_contradicts_is_refused_whole(taken, released, cached, match):
    shard = LaneShard(0, 8, 2, KV, "cpu")
    shard.reset("g")
    shard.apply("g", 1, np.array([1, 2], np.int32), np.empty(0, np.int32), owner=5)
    before = (shard._held.copy(), shard._owner.copy(), shard.num_held_pages)
    as_pages = [None if c is None else np.array(c, np.int32) for c in (taken, released, cached)]
    with pytest.raises(AssertionError, match=match):
        shard.apply("g", 2, as_pages[0], as_pages[1], 5, as_pages[2])
    assert (shard._held == before[0]).all() and (shard._owner == before[1]).all()
    # Nothing of it was applied: the same move, corrected, still goes in as move 2.
    shard.apply("g", 2, np.array([2, 3], np.int32), np.array([2], np.int32), owner=5)
    assert shard.num_held_pages == before[2] + 1


def test_moves_carry_the_owner_and_the_pages_that_went_to_the_cache():
    coord, lanes = make()
    coord.hello("a")
    alloc = ok(coord.allocate_extend(coord.epoch, "a", None, "r", np.arange(1, 17)))
    ns = coord.hello("a")["namespace_id"]
    pages = alloc.new_pages
    assert coord.check()["ok"]  # waits for the moves (heartbeats are ordered after them)
    for p in pages:
        assert lanes.shards[p % 2]._owner[p // 2] == ns
    ok(coord.free(coord.epoch, "a", None, "r", True))
    assert coord.check()["ok"]
    for p in pages:
        assert lanes.shards[p % 2]._owner[p // 2] == CACHED


# -------------------------------------------------------------------- leases (19.6, 8)
def test_a_lapse_is_told_to_the_client_even_after_its_renewer_said_hello():
    clock = Clock()
    coord, _ = make(clock)
    coord.hello("a", 1.0)
    ok(coord.allocate_extend(coord.epoch, "a", None, "r", np.arange(1, 9)))
    clock.now += 2.0
    assert coord.expire_leases() == 1
    assert not coord.renew_lease("a")
    coord.hello("a", 1.0)  # what the renewer does when its renewal is refused
    with pytest.raises(LeaseExpiredError) as info:
        ok(coord.allocate_decode(coord.epoch, "a", None, ["r"], [3]))
    assert info.value.rids == ["r"]


def test_a_shared_request_lives_until_the_last_client_that_extended_it_lapses():
    """A driver creates a request and its actor continues it (one namespace): the driver's
    lapse must not free it under the actor, whose next chunk would silently start a new
    request at position 0; it goes when the actor lapses too."""
    clock = Clock()
    coord, _ = make(clock)
    coord.hello("driver", 1.0, namespace="job")
    coord.hello("actor", 1.0, namespace="job")
    prefill(coord, "driver", "x", np.arange(1, 17))
    prefill(coord, "actor", "x", np.arange(17, 33))
    clock.now += 0.9
    coord.renew_lease("actor")  # the driver has died
    clock.now += 0.5
    assert coord.expire_leases() == 0
    chunk = prefill(coord, "actor", "x", np.arange(33, 41))["allocations"][0]
    assert (chunk.prefix_len, chunk.extend_len) == (32, 8)
    with pytest.raises(LeaseExpiredError) as info:  # told, with nothing freed
        prefill(coord, "driver", "y", [1])
    assert info.value.rids == []
    clock.now += 2.0
    assert coord.expire_leases() == 1  # the actor's lapse frees it
    assert coord.stats()["num_requests"] == 0
    assert coord.check()["ok"]


def test_a_client_that_only_decodes_a_shared_request_holds_it():
    """The driver prefilled it, its actor carries it on: the driver's lapse must not free it
    under the live, decoding actor (README: a request another live client extended stays)."""
    clock = Clock()
    coord, _ = make(clock)
    coord.hello("driver", 1.0, namespace="job")
    coord.hello("actor", 1.0, namespace="job")
    prefill(coord, "driver", "x", np.arange(1, 17))
    ok(coord.decode(coord.epoch, "actor", None, ["x"], [5]))
    ok(coord.allocate_decode(coord.epoch, "actor", None, ["x"], [5]))
    clock.now += 0.9
    coord.renew_lease("actor")  # the driver has died
    clock.now += 0.5
    assert coord.expire_leases() == 0
    ok(coord.decode(coord.epoch, "actor", None, ["x"], [5]))


def test_a_call_id_repeated_with_other_arguments_is_told_apart_and_a_retry_is_not():
    coord, _ = make()
    e = coord.epoch
    first = ok(coord.allocate_extend(e, "a", 1, "r", np.array([1, 2, 3])))
    again = coord.allocate_extend(e, "a", 1, "r", np.array([1.9, 2.5, 3.7]))  # truncate alike
    assert again is not first and isinstance(again, InvalidRequestError)
    assert coord.allocate_extend(e, "a", 1, "r", [1, 2, 3]) is first  # ids as a list
    ok(coord.allocate_extend(e, "a", 2, "s", range(1, 9)))
    ok(coord.allocate_extend(e, "a", 2, "s", np.arange(1, 9, dtype=np.int32)))
    ok(coord.allocate_extend(e, "a", 3, np.int64(7), [1, 2]))
    ok(coord.allocate_extend(e, "a", 3, 7, [1, 2]))  # the rid the core keys it as


def test_a_reply_too_big_to_keep_drops_itself_not_the_others():
    cache = ReplyCache(16, max_bytes=100)
    cache.put("a", "small", nbytes=10)
    cache.put("b", "huge", nbytes=1000)
    assert cache.get("a") == "small" and cache.get("b") is DROPPED
    assert cache.nbytes == 10


def test_a_quiet_lease_of_a_live_process_is_kept_and_of_a_stopped_one_lapses():
    clock = Clock()
    alive = {"busy": True, "stopped": False}
    coord, _ = make(clock, liveness=lambda holder: alive[holder["name"]])
    for name in alive:
        coord.hello(name, 1.0, holder={"name": name})
        ok(coord.allocate_extend(coord.epoch, name, None, "r", np.arange(1, 9)))
    clock.now += 1.5
    assert coord.expire_leases() == 1  # the stopped client's request only
    stats = coord.stats()
    assert stats["leases_kept_alive"] == 1 and stats["num_requests"] == 1
    assert coord._core.has_request(coord._namespaces.key("busy", "r"))


# ------------------------------------------------------------------ hung lanes (19.7)
def test_a_hung_lane_is_killed_and_reset_and_renewals_never_wait_for_it():
    coord, lanes = make(lane_hang_s=0.3)
    coord.hello("idle", 5.0)
    ok(coord.allocate_extend(coord.epoch, "idle", None, "r", np.arange(1, 3)))
    lanes.hung.add(1)
    import time

    end = time.monotonic() + 5
    while not lanes.killed and time.monotonic() < end:
        assert coord.renew_lease("idle")  # never waits for the lane
        coord.heartbeat_once()
    assert lanes.killed == [1]
    assert coord.wait_recovered(5)
    stats = coord.stats()
    assert stats["hung_lanes"] == 1 and stats["lane_states"] == ["up", "up"]
    assert coord.check()["ok"]


def test_a_lane_that_answers_every_heartbeat_late_but_within_the_hang_time_is_kept():
    """Hung means a heartbeat unanswered for ``lane_hang_s``: one answered after a round
    stopped waiting for it (at half of it) is read at the next round, not dropped, and the
    hang clock does not run between rounds."""
    import time

    coord, lanes = make(lane_hang_s=1.0)
    coord.hello("c", 60.0)
    ok(coord.allocate_extend(coord.epoch, "c", None, "r", np.arange(1, 33)))  # both lanes
    lanes.late.add(1)
    for _ in range(4):
        coord.heartbeat_once()  # waits up to 0.5 s for lane 1, then moves on
        time.sleep(0.2)
        lanes.answer_heartbeats()  # ~0.7 s after it was sent
    stats = coord.stats()
    assert lanes.killed == [] and stats["hung_lanes"] == 0 and stats["lane_losses"] == []
    assert stats["slow_heartbeats"] >= 2
    # An unanswered heartbeat is read again, never stacked behind by another.
    sent = sum(1 for lane, method in lanes.calls if (lane, method) == (1, "heartbeat"))
    assert 2 <= sent <= 3, sent
    lanes.late.clear()
    assert coord.check()["ok"]


def test_a_lane_whose_heartbeats_go_unanswered_for_the_hang_time_is_killed():
    import time

    coord, lanes = make(lane_hang_s=0.4)
    lanes.late.add(1)
    end = time.monotonic() + 5
    while not lanes.killed and time.monotonic() < end:
        coord.heartbeat_once()
    assert lanes.killed == [1] and coord.stats()["hung_lanes"] == 1


def test_a_heartbeat_error_on_one_lane_leaves_the_round_reading_the_others():
    """An error that is neither a death nor a timeout (a Ray error the transport does not
    map) is logged and counted; the lanes after it are still read, so a dead one is seen."""
    coord, lanes = make()
    coord.hello("c", 60.0)
    ok(coord.allocate_extend(coord.epoch, "c", None, "r", np.arange(1, 33)))
    assert coord.check()["ok"]
    lanes.heartbeat_errors[0] = RuntimeError("ObjectLostError")
    lanes.dead.add(1)
    coord.heartbeat_once()
    stats = coord.stats()
    assert stats["lane_losses"] == [[1, 1]] and stats["heartbeat_errors"] == 1
    assert stats["lane_states"][0] == "up"


def test_an_unreachable_lane_is_not_taken_for_dead_by_the_heartbeat():
    """Ray's "unavailable, may be available later": the lane keeps its requests; had it
    restarted, its next answer names another incarnation."""
    coord, lanes = make()
    coord.hello("c", 60.0)
    ok(coord.allocate_extend(coord.epoch, "c", None, "r", np.arange(1, 33)))
    lanes.heartbeat_errors[1] = LaneUnreachableError("lane 1 is unreachable")
    coord.heartbeat_once()
    assert coord.stats()["lane_losses"] == []
    del lanes.heartbeat_errors[1]
    lanes.kill(1)  # it restarted meanwhile
    lanes.restart(1)
    coord.heartbeat_once()
    assert coord.stats()["lane_losses"] == [[1, 1]]


def test_stats_count_a_step_that_failed_without_another_call():
    coord, lanes = make()
    coord.hello("a")
    lanes.fail.add(1)
    prefill(coord, "a", "r", np.arange(1, 33))  # every lane answers step 1 with an error
    stats = coord.stats()
    assert (stats["failed_steps"], stats["steps_in_flight"]) == (1, 0)


def test_a_call_after_shutdown_takes_no_lane_for_lost():
    """Moves flushed after shutdown fail as the channel's (closed), not as lane failures."""
    coord, _ = make()
    coord.hello("c", 60.0)
    ok(coord.allocate_extend(coord.epoch, "c", None, "r", np.arange(1, 33)))
    ok(coord.free(coord.epoch, "c", None, "r", False))  # its moves wait for a flush
    coord.shutdown()
    assert not coord.check()["ok"]
    stats = coord.stats()
    assert stats["lane_losses"] == [] and stats["lane_states"] == ["up", "up"]


def test_shutdown_ends_a_recovery_in_flight_and_later_lane_calls_fail_at_once():
    """A lane Ray is still restarting (its reset answers "unreachable"): shutdown() does not
    leave the recovery retrying until lane_restart_timeout_s."""
    import time

    class Restarting(StepLanes):
        restarting = False

        def submit(self, lane, method, *args):
            if self.restarting and lane == 1 and method == "reset":
                future = Future()
                future.set_exception(LaneUnreachableError("restarting"))
                return future
            return super().submit(lane, method, *args)

    coord = Coordinator(CFG, KV, Restarting(), heartbeat_s=0.05, lane_restart_timeout_s=30)
    coord._transport.restarting = True
    coord._transport.restart(1)  # another incarnation: the heartbeat finds lane 1 lost
    end = time.monotonic() + 5
    while coord.stats()["lane_states"][1] != "restarting" and time.monotonic() < end:
        time.sleep(0.02)
    t0 = time.monotonic()
    coord.shutdown()
    assert time.monotonic() - t0 < 1.5
    threads = [*coord._threads, *coord._supervisor._threads, coord._channel._sender]
    assert threads[1].name == "cpkv-recover-1"
    assert not [t.name for t in threads if t.is_alive()]
    with pytest.raises(ChannelClosedError):
        coord._channel.call(0, "heartbeat", timeout=5)


def _lanes_restarting(coord) -> KVCapacityWaitError:
    return coord._supervisor.unavailable("lanes [1] are restarting; no step can run")


def test_a_step_retried_while_a_lane_restarts_gets_its_first_answer():
    """A repeat of an answered step gets that answer, not a lane_unavailable wait: a wait
    means "nothing happened", so the caller's backoff would send the step again, anew."""
    coord, _lanes = make()
    coord.hello("a")
    first = prefill(coord, "a", "r", np.arange(1, 5), call_id="X")
    coord._ensure_group = lambda: _lanes_restarting(coord)
    again = prefill(coord, "a", "r", np.arange(1, 5), call_id="X")
    assert again["allocations"] == first["allocations"]
    assert coord._core.request_len(coord._namespaces.key("a", "r")) == 4
    with pytest.raises(KVCapacityWaitError, match="lane_unavailable"):  # a new call waits
        prefill(coord, "a", "r", [5], call_id="Y")


def test_a_step_whose_reply_goes_between_its_check_and_its_call_waits():
    """Seen answered, then pushed out of the remembered replies by other calls before its
    call ran: no group was read for it, so it waits (it raised AssertionError)."""
    coord, _lanes = make()
    coord.hello("a")
    prefill(coord, "a", "r", np.arange(1, 5), call_id="X")
    call = coord._call

    def evicted_first(epoch, client_id, call_id, *args, **kwargs):
        coord._replies._replies.pop((client_id, call_id))  # as the count bound would
        return call(epoch, client_id, call_id, *args, **kwargs)

    coord._call = evicted_first
    with pytest.raises(KVCapacityWaitError, match="lane_unavailable"):
        prefill(coord, "a", "r", np.arange(1, 5), call_id="X")
    assert coord._core.request_len(coord._namespaces.key("a", "r")) == 4


def test_a_step_whose_group_was_dropped_meanwhile_waits_and_fails_nothing():
    """The group read before the call's own settle (which may find a lane lost or another
    step failed, dropping it): the lanes left it, so a step sent for it would fail requests
    that had nothing to do with either."""
    coord, _lanes = make()
    coord.hello("a")
    prefill(coord, "a", "r", np.arange(1, 5))
    coord._group_is_current = lambda group: False
    before = coord.stats()
    with pytest.raises(KVCapacityWaitError, match="lane group changed"):
        ok(coord.decode(coord.epoch, "a", None, ["r"], np.array([7])))
    assert coord.stats()["used"] == before["used"] and not coord._steps.failed
    coord._group_is_current = lambda group: True
    ok(coord.decode(coord.epoch, "a", None, ["r"], np.array([7])))  # the next one runs


def test_a_failed_or_lost_request_says_so_while_lanes_restart():
    """A step of a request that failed, or was lost with a lane, answers that (not a wait
    for the lanes: waiting would never help it); a new request waits."""
    coord, lanes = make()
    coord.hello("a")
    lanes.fail.add(1)
    prefill(coord, "a", "failed", np.arange(1, 9))
    prefill(coord, "a", "lost", np.arange(1, 33))  # pages on both lanes
    restarting = KVCapacityWaitError(
        "lane_unavailable",
        required_by_owner=[0, 0],
        available_by_owner=[0, 0],
        deficit_by_owner=[0, 0],
        reason="lane_unavailable",
    )
    coord._ensure_group = lambda: restarting
    with coord._lock:
        coord._core.drop_lane(1)
    with pytest.raises(StepFailedError):
        prefill(coord, "a", "failed", [3])
    with pytest.raises(LaneUnavailableError):
        ok(coord.decode(coord.epoch, "a", None, ["lost"], np.array([7])))
    with pytest.raises(KVCapacityWaitError, match="lane_unavailable"):
        prefill(coord, "a", "new", [3])


def test_a_decode_step_of_an_unknown_rid_says_so_while_a_lane_is_down():
    """The lanes' state is no answer to a rid that does not exist: not a wait for them."""
    from cpkv.errors import UnknownRequestError

    lanes = StepLanes()
    coord = Coordinator(
        CFG, KV, lanes, heartbeat_s=0, lane_restart_timeout_s=5, clock=Clock(), vocab_size=VOCAB
    )
    coord.hello("a")
    e = coord.epoch
    assert not isinstance(coord.allocate_extend(e, "a", None, "r", np.arange(1, 10)), Exception)
    assert coord.free(e, "a", None, "r", False) > 0
    lanes.dead.add(1)  # for good
    coord.heartbeat_once()
    coord.wait_recovered(5)
    assert coord.lane_states()[1] != "up"
    for rid in ("r", "never-allocated"):  # freed, and never there
        answer = coord.decode(e, "a", None, [rid], [3])
        assert isinstance(answer, UnknownRequestError) and repr(rid) in str(answer), answer


def test_two_lanes_lost_in_one_round_both_come_back_and_stay():
    """Dropping the first lost lane's requests released their pages on the second, as a move
    numbered in that lane's new generation: reset empty, it refused the move and was lost
    again once back, with the request allocated on it meanwhile."""
    coord, lanes = make()
    coord.hello("a")
    ok(coord.allocate_extend(coord.epoch, "a", None, "r", np.arange(1, 33)))  # both lanes
    lanes.kill(0)
    lanes.kill(1)
    coord.heartbeat_once()  # both found lost in the same round: one settle
    assert coord.wait_recovered(5)
    coord.stats()
    ok(coord.allocate_extend(coord.epoch, "a", None, "new", np.arange(100, 132)))
    time.sleep(0.1)  # the moves go with the heartbeat; a refused one is seen after
    coord.heartbeat_once()
    coord.wait_recovered(5)
    stats = coord.stats()
    assert [lane for lane, _ in stats["lane_losses"]] == [0, 1], stats["lane_losses"]
    assert stats["lane_states"] == ["up", "up"] and coord.check()["ok"]
    ok(coord.allocate_decode(coord.epoch, "a", None, ["new"], [5]))


@pytest.mark.parametrize("outcome", ["failed", "done", "running"])
def test_a_retried_step_gets_the_first_answer_and_leaves_it_as_it_was(outcome):
    """Lanes whose step handles are futures (the plain transports): a retry resolved the
    first answer's result futures again (raising the step's error, or waiting for it) and
    rewrote the first caller's answer."""
    coord, lanes = make()
    coord.hello("a")
    {"failed": lanes.fail, "running": lanes.hold, "done": set()}[outcome].add(1)
    first = coord.prefill(coord.epoch, "a", "X", "r", np.arange(1, 9))
    handles = list(first["lanes"])
    again = coord.prefill(coord.epoch, "a", "X", "r", np.arange(1, 9))
    assert isinstance(again, dict) and again["lanes"] == handles
    assert first["lanes"] == handles
    if outcome == "running":
        lanes.release(1)


def test_a_step_racing_shutdown_is_answered_not_raised():
    coord, _ = make()
    coord.hello("a")
    coord.shutdown()
    for _ in range(2):  # and its retry
        out = coord.prefill(coord.epoch, "a", "X", "r", np.arange(1, 9))
        assert isinstance(out, CoordinatorUnavailableError), out


def test_a_closed_client_and_its_empty_namespace_are_forgotten():
    """A coordinator outlives many short clients (a Ray task per request): each closed one
    is forgotten, and its namespace's id once nothing lives in it; a namespace another client
    or a request still uses keeps its id, and a forgotten one that comes back gets a new id."""
    coord, lanes = make()
    first = coord.hello("c0", lease_s=60)["namespace_id"]
    coord.close_lease("c0")
    for i in range(1, 50):
        coord.hello(f"c{i}", lease_s=60)
        ok(coord.allocate_extend(coord.epoch, f"c{i}", None, "r", np.arange(1, 9)))
        coord.close_lease(f"c{i}")
    assert not coord._namespaces._of_client and not coord._namespaces._ids
    assert coord.check()["ok"] and coord._core.num_requests == 0

    shared = coord.hello("a", lease_s=60, namespace="job")["namespace_id"]
    assert shared > first  # never reused
    coord.hello("b", lease_s=60, namespace="job")
    ok(coord.allocate_extend(coord.epoch, "a", None, "r", np.arange(1, 9)))
    coord.close_lease("a")  # "b" is still in "job"
    assert coord.hello("b", lease_s=60, namespace="job")["namespace_id"] == shared
    ok(coord.allocate_extend(coord.epoch, "b", None, "r", np.arange(1, 13)))  # a's request
    coord.hello("nolease", namespace="solo")  # no lease: its request outlives its close
    ok(coord.allocate_extend(coord.epoch, "nolease", None, "s", np.arange(1, 9)))
    solo = coord.hello("nolease", namespace="solo")["namespace_id"]
    coord.close_lease("nolease")
    assert coord.hello("again", namespace="solo")["namespace_id"] == solo  # "s" lives in it
    pages = coord._core.request_pages(coord._namespaces.key("again", "s"))
    assert coord.check()["ok"]  # the moves applied
    assert [int(lanes.shards[p % 2]._owner[p // 2]) for p in pages] == [solo] * len(pages)
    late = ok(coord.allocate_extend(coord.epoch, "a", None, "late", np.arange(1, 5)))
    assert late.rid == "late"  # a call of "a" that raced its close lands in "job" still
    assert coord.check()["ok"]
    pages = coord._core.request_pages(coord._namespaces.key("b", "late"))
    assert [int(lanes.shards[p % 2]._owner[p // 2]) for p in pages] == [shared] * len(pages)
    assert ok(coord.free(coord.epoch, "b", None, "late", False)) >= 0  # job's to free
    coord.close_lease("b")
    assert list(coord._namespaces._ids) == ["solo"]
    assert coord.hello("b2", namespace="job")["namespace_id"] > solo
    assert coord.check()["ok"]


def test_a_quiet_lease_of_a_live_process_lapses_after_ten_periods_of_silence():
    """A client whose close never arrived, in a process that lives on, does not hold its
    pages for good: the liveness probe keeps its lease for ten lease periods at most (and at
    least 30 s, for short leases)."""
    clock = Clock()
    coord, _ = make(clock, liveness=lambda holder: True)
    coord.hello("gone", 5.0, holder={"pid": 1})
    ok(coord.allocate_extend(coord.epoch, "gone", None, "r", np.arange(1, 9)))
    for _ in range(9):
        clock.now += 5.0
        assert coord.expire_leases() == 0  # probed alive: kept
    clock.now += 5.0
    assert coord.expire_leases() == 1
    stats = coord.stats()
    assert stats["leases_kept_alive"] == 9 and stats["num_requests"] == 0
    # A short lease is kept for 30 s.
    coord.hello("short", 0.5, holder={"pid": 3})
    ok(coord.allocate_extend(coord.epoch, "short", None, "r", np.arange(1, 9)))
    clock.now += 29.0
    assert coord.expire_leases() == 0
    clock.now += 1.5
    assert coord.expire_leases() == 1
    # A renewal starts the count again.
    coord.hello("busy", 5.0, holder={"pid": 2})
    ok(coord.allocate_extend(coord.epoch, "busy", None, "r", np.arange(1, 9)))
    for n in range(25):
        clock.now += 5.0
        if n % 5 == 4:
            coord.renew_lease("busy")
        assert coord.expire_leases() == 0


def test_the_lane_losses_listed_are_the_last_ones_and_keep_no_request_ids(monkeypatch):
    monkeypatch.setattr(coordinator_module, "_MAX_LANE_LOSSES_KEPT", 3)
    coord, lanes = make()
    coord.hello("c", 60.0)
    for n in range(5):
        ok(coord.allocate_extend(coord.epoch, "c", None, f"r{n}", np.arange(1, 9)))
        lanes.kill(n % 2)
        lanes.restart(n % 2)
        coord.heartbeat_once()
        assert coord.wait_recovered(5)
    assert coord.stats()["lane_losses"] == [[0, 1], [1, 1], [0, 1]]
    assert all(type(num_lost) is int for _, num_lost in coord._losses)
