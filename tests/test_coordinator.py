"""The coordinator without Ray: plain lane shards behind a local transport, a stepped clock."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading
import time
from concurrent.futures import Future
from pathlib import Path

import numpy as np
import pytest

from cpkv import CPConfig, KVShape
from cpkv.coordinator import channel as channel_module
from cpkv.coordinator.coordinator import Coordinator
from cpkv.errors import KVCapacityWaitError, LaneUnavailableError, LeaseExpiredError

from .local_lanes import LocalLaneTransport

CFG = CPConfig(cp_size=4, page_size=4, num_pages_per_lane=32, max_reqs=16, max_context_len=512)
KV = KVShape(num_layers=1, num_heads=2, head_dim=8, dtype="float32")


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def make(transport=None, clock=None) -> tuple[Coordinator, LocalLaneTransport]:
    transport = transport or LocalLaneTransport(4, 32, 4, KV)
    coord = Coordinator(
        CFG, KV, transport, heartbeat_s=0, lane_restart_timeout_s=5, clock=clock or Clock()
    )
    return coord, transport


def call(coord, op, *args, client="c"):
    out = getattr(coord, op)(coord.epoch, client, None, *args)
    if isinstance(out, Exception):
        raise out
    return out


def assert_lanes_agree(coord: Coordinator) -> None:
    report = coord.check()
    assert report["ok"], report
    stats = coord.stats()
    assert stats["mirror_mismatches"] == 0
    assert stats["lane_losses"] == []


def test_request_ids_reused_after_free_keep_lanes_exact():
    coord, transport = make()
    rng = np.random.default_rng(0)
    shared = rng.integers(0, 100, size=24)
    for step in range(30):
        rid = ("req-0", "req-1", 7)[step % 3]
        tokens = np.concatenate([shared, rng.integers(0, 100, size=int(rng.integers(1, 30)))])
        call(coord, "allocate_extend", rid, tokens)
        call(coord, "allocate_decode", [rid], [int(step)])
        call(coord, "free", rid, bool(step % 2), None)
        assert_lanes_agree(coord)
    assert coord.stats()["cached_tokens_hit"] > 0
    stats = coord.stats()
    assert sum(s.num_applied for s in transport.shards) == stats["lane_moves"]
    assert stats["lane_calls"] < stats["lane_moves"]  # moves wait and travel together


def test_a_lost_move_is_detected_and_the_lane_reset():
    coord, transport = make()
    call(coord, "allocate_extend", "a", np.arange(40))
    assert coord.check()["ok"]
    real_submit = transport.submit
    dropped = []

    def drop_one_apply(lane, method, *args):
        if method == "apply_moves" and lane == 1 and not dropped:
            dropped.append(args[0])  # the moves never arrive
            return real_submit(lane, "heartbeat")
        return real_submit(lane, method, *args)

    transport.submit = drop_one_apply
    call(coord, "allocate_extend", "b", np.arange(100, 140))  # moves on every lane
    coord.lane_fence()  # sends them (lane 1's are lost)
    call(coord, "allocate_extend", "c", np.arange(200, 240))  # lane 1 sees a gap
    coord.check()  # waits for the lanes; the refused move is noticed on the next call
    with pytest.raises(LaneUnavailableError):
        call(coord, "allocate_decode", ["b"])
    assert [lane for lane, _ in coord.stats()["lane_losses"]] == [1]
    assert coord.wait_recovered(5)
    assert coord.check()["ok"]


def _answer_later(future: Future, submit, wait=None, *wait_args) -> None:
    """In a thread: ``wait(*wait_args)``, then the lane call ``submit()``, its answer given to
    ``future``."""

    def later():
        if wait is not None:
            wait(*wait_args)
        try:
            future.set_result(submit().result())
        except Exception as e:
            future.set_exception(e)

    threading.Thread(target=later, daemon=True).start()


class BlockingResetTransport(LocalLaneTransport):
    """Lane resets of ``lane`` wait for ``release`` (a slow Ray restart)."""

    def __init__(self, *args, lane: int) -> None:
        super().__init__(*args)
        self.blocked_lane = lane
        self.release = threading.Event()
        self.blocking = False

    def submit(self, lane, method, *args):
        if not (self.blocking and lane == self.blocked_lane and method == "reset"):
            return super().submit(lane, method, *args)
        future: Future = Future()  # answered once released; submitting never blocks
        call = LocalLaneTransport.submit
        _answer_later(future, lambda: call(self, lane, method, *args), self.release.wait, 10)
        return future


class LateResetTransport(LocalLaneTransport):
    """The first reset of ``lane`` lands only after a later reset of it (a recovery's call
    overtaken by a pool reset's)."""

    def __init__(self, *args, lane: int) -> None:
        super().__init__(*args)
        self.late_lane = lane
        self.armed = False
        self._held: tuple | None = None

    def submit(self, lane, method, *args):
        if not (self.armed and lane == self.late_lane and method == "reset"):
            return super().submit(lane, method, *args)
        if self._held is None:
            self._held = (Future(), args)
            return self._held[0]
        out = super().submit(lane, method, *args)
        self.armed = False
        late, late_args = self._held  # lands after the later reset was applied
        _answer_later(late, lambda: LocalLaneTransport.submit(self, lane, method, *late_args))
        return out


def test_a_recoverys_reset_overtaken_by_a_pool_reset_leaves_the_lane_in_the_new_generation():
    transport = LateResetTransport(4, 32, 4, KV, lane=2)
    coord, _ = make(transport)
    resets = transport.calls.count((2, "reset"))
    transport.armed = True
    transport.restart(2)  # a new incarnation: the heartbeat starts its recovery
    coord.heartbeat_once()
    coord.reset()  # a new generation for every lane, while lane 2's first reset is held
    assert coord.wait_recovered(5)
    # The overtaken recovery stopped at its refused reset (no retries until its deadline).
    assert transport.calls.count((2, "reset")) == resets + 2
    assert transport.shards[2].generation == coord._channel.generation(2)
    call(coord, "allocate_extend", "r", np.arange(64))
    assert_lanes_agree(coord)


class FailingResetTransport(LocalLaneTransport):
    """Resets of ``lane`` fail ``times`` times with ``error`` (then run), once armed."""

    def __init__(self, *args, lane: int, error: type[Exception], times: int) -> None:
        super().__init__(*args)
        self.lane, self.error, self.left = lane, error, 0
        self.times = times

    def submit(self, lane, method, *args):
        if lane == self.lane and method == "reset" and self.left > 0:
            self.left -= 1
            future: Future = Future()
            future.set_exception(self.error(f"lane {lane}: reset refused"))
            return future
        return super().submit(lane, method, *args)


@pytest.mark.parametrize(
    ("error", "back"),
    [(channel_module.LaneUnreachableError, True), (channel_module.LaneDeadError, False)],
    ids=["unreachable-while-restarting", "dead-each-time"],
)
def test_a_lane_unreachable_while_it_restarts_comes_back_one_that_keeps_dying_does_not(error, back):
    """Ray answers a call to an actor it is restarting with ActorUnavailableError, several
    times over seconds (measured: three in 5.3 s); that is one death, not several."""
    transport = FailingResetTransport(4, 32, 4, KV, lane=1, error=error, times=8)
    coord, _ = make(transport)
    transport.left = transport.times
    transport.restart(1)  # a new incarnation: the heartbeat finds the lane lost
    coord.heartbeat_once()  # finds it lost and starts its recovery
    coord.wait_recovered(10)
    assert coord.lane_states()[1] == ("up" if back else "dead")
    assert transport.left == (0 if back else transport.times - 5)


def test_ray_transport_names_an_unreachable_lane_apart_from_a_dead_one(monkeypatch):
    import ray

    from cpkv.actors.transport import RayLaneTransport

    transport = RayLaneTransport([])
    for raised, expected in [
        (ray.exceptions.ActorUnavailableError("restarting", None), "LaneUnreachableError"),
        (ray.exceptions.ActorDiedError(), "LaneDeadError"),
        (ray.exceptions.OutOfMemoryError("killed: the node ran low on memory"), "LaneDeadError"),
    ]:

        def get(*_args, raised=raised, **_kwargs):
            raise raised

        monkeypatch.setattr(ray, "get", get)
        with pytest.raises(channel_module.LaneDeadError) as info:
            transport.result(object(), 1.0)
        assert type(info.value).__name__ == expected


def test_a_restarting_lane_stalls_nobody():
    transport = BlockingResetTransport(4, 32, 4, KV, lane=2)
    coord, _ = make(transport)
    rng = np.random.default_rng(1)
    live = {}
    for i in range(6):  # single-page requests, one lane each
        alloc = call(coord, "allocate_extend", f"one{i}", rng.integers(0, 9, size=3))
        live[f"one{i}"] = int(alloc.new_pages[0]) % 4
    transport.blocking = True
    transport.restart(2)  # a new incarnation: the heartbeat sees it and fails the lane
    coord.heartbeat_once()
    assert coord.lane_states()[2] == "restarting"
    t0 = time.monotonic()
    stats = coord.stats()
    assert stats["restarting_lanes"] == [2]
    report = coord.check()
    assert not report["ok"] and "lane 2: restarting" in report["problems"]
    survivors = [rid for rid, lane in live.items() if lane != 2]
    call(coord, "allocate_decode", survivors, list(range(len(survivors))))
    with pytest.raises(KVCapacityWaitError) as info:  # an owner plan needs lane 2
        call(coord, "allocate_extend", "big", np.arange(64))
    assert info.value.reason == "lane_unavailable" and info.value.deficit_by_owner[2] > 0
    lost = [rid for rid, lane in live.items() if lane == 2]
    for rid in lost:
        with pytest.raises(LaneUnavailableError):
            call(coord, "allocate_decode", [rid])
        with pytest.raises(LaneUnavailableError) as info:  # a step says so by the caller's id
            call(coord, "decode", [rid], np.array([5]))
        assert info.value.rids == [rid]
    assert time.monotonic() - t0 < 0.5  # nobody waited for the restart
    transport.release.set()
    assert coord.wait_recovered(5)
    assert coord.lane_states() == ["up"] * 4
    call(coord, "allocate_extend", "big", np.arange(64))
    assert coord.check()["ok"]


def test_lapsed_lease_frees_its_requests_and_says_so():
    clock = Clock()
    coord, _ = make(clock=clock)
    coord.hello("job", 10.0)
    coord.hello("idle", 10.0)
    call(coord, "allocate_extend", "j1", np.arange(30), client="job")
    call(coord, "allocate_extend", "j2", np.arange(50, 90), client="job")
    call(coord, "allocate_extend", "i1", np.arange(200, 230), client="idle")
    used = sum(coord.stats()["used"])
    for _ in range(5):  # the idle client renews (its keeper thread would), the job is silent
        clock.now += 4.0
        assert coord.renew_lease("idle")
        coord.expire_leases()
    stats = coord.stats()
    assert stats["leases_expired"] == 2 and stats["leases_lapsed"] == 1
    assert stats["num_requests"] == 1 and sum(stats["used"]) < used
    with pytest.raises(LeaseExpiredError) as info:  # told once, then the lease is open again
        call(coord, "allocate_decode", ["j1"], client="job")
    assert sorted(info.value.rids) == ["j1", "j2"]
    call(coord, "allocate_extend", "j3", np.arange(7), client="job")
    assert coord.close_lease("job") == 1  # a clean shutdown frees what is left
    assert coord.stats()["num_requests"] == 1
    assert coord.check()["ok"]


def test_calls_from_another_epoch_are_refused():
    coord, _ = make()
    out = coord.allocate_extend("old-epoch", "c", None, "r", np.arange(4))
    assert type(out).__name__ == "CoordinatorUnavailableError"
    assert coord.stats()["num_requests"] == 0


def test_the_coordinator_process_never_imports_torch():
    """The coordinator (and its actor's module) picks the lanes' backend, builds their group
    and sends a step without torch (lanes that answer from plain values, in a fresh
    interpreter)."""
    code = textwrap.dedent(
        """
        import sys
        from concurrent.futures import Future

        import numpy as np

        import cpkv.actors.coordinator  # the coordinator actor's process imports its shell
        from cpkv import CPConfig, KVShape
        from cpkv.coordinator import Coordinator

        ANSWERS = {
            "reset": "incarnation",
            "info": {"device": "cpu"},
            "rendezvous_address": ("127.0.0.1", 1),
            "init_group": None,
            "apply_moves": 0,
        }

        class PlainLanes:
            def submit(self, lane, method, *args):
                done = Future()
                if method == "step":
                    done.set_result({"step_id": args[0].step_id})
                    return done, done
                done.set_result(ANSWERS[method])
                return done

            def result(self, handle, timeout):
                return handle.result(timeout)

            def done(self, handles):
                return [h.done() for h in handles]

        kv = KVShape(1, 2, 8, "float32")
        coord = Coordinator(CPConfig(2, 4, 8), kv, PlainLanes(), heartbeat_s=0)
        out = coord.prefill(coord.epoch, None, None, "r", np.arange(6), probe=())
        assert isinstance(out, dict) and len(out["lanes"]) == 2, out
        assert "torch" not in sys.modules
        """
    )
    root = str(Path(__file__).resolve().parents[1])
    env = {**os.environ, "PYTHONPATH": root}
    subprocess.run([sys.executable, "-c", code], check=True, env=env, timeout=120)


def test_a_lane_found_lost_is_failed_at_the_coordinators_next_call():
    """The supervisor only records a lane it finds restarted (it never calls into the
    coordinator); the coordinator fails the lane's requests at its next call."""
    coord, transport = make()
    call(coord, "allocate_extend", "a", np.arange(40))  # pages on every lane
    transport.restart(1)
    assert not coord._supervisor.probe(1, 5)
    assert (
        coord._core.has_request(coord._namespaces.key("c", "a")) and coord.lane_states()[1] == "up"
    )
    assert coord.stats()["lane_losses"] == [[1, 1]]  # stats() is a call: it settles
    assert not coord._core.has_request(coord._namespaces.key("c", "a"))
    assert coord.wait_recovered(5)
    report = coord.check()
    assert report["ok"], report


def test_allocations_and_frees_cost_no_lane_call_until_something_needs_their_moves(
    monkeypatch,
):
    monkeypatch.setattr(channel_module, "FLUSH_AFTER_S", 60.0)  # no timer in this test
    coord, transport = make()
    call(coord, "allocate_extend", "a", np.arange(64))  # 16 pages: 4 on every lane
    call(coord, "free", "a", False, None)
    call(coord, "allocate_extend", "b", np.arange(100, 164))  # the same pages again
    stats = coord.stats()
    assert stats["lane_moves_by_op"] == {"extend": 8, "free": 4}
    assert stats["lane_calls"] == 0 and all(s.num_applied == 0 for s in transport.shards)
    assert_lanes_agree(coord)  # check() sends what waits before comparing counts: one call
    assert coord.stats()["lane_calls"] == 4  # ... a lane
    assert [s.num_applied for s in transport.shards] == [3, 3, 3, 3]
