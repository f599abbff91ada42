"""A client's steps through a compiled graph to the coordinator (``cpkv.actors.StepGraph``).

Without Ray: the coordinator's graph slots (granted, given back, lost with a lease that
closed or lapsed holding one; given back by a build that failed after its claim). Through
Ray: steps go through the graph and answer as ordinary calls do; a client refused a slot
sends them as ordinary calls; a step that times out in the graph is retried by its call id;
a restarted coordinator gets a new graph; and a client process that exits, cleanly or not,
never takes the coordinator with it.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest

from cpkv.core.graph_slots import GraphSlots
from tests.test_compiled_steps import wait_for
from tests.test_reliability import Clock, make, ok

ROOT = str(Path(__file__).resolve().parents[1])


# ---------------------------------------------------------------------- slots
def test_slots_are_granted_once_per_client_up_to_the_limit():
    slots = GraphSlots(2)
    assert slots.claim("a") and slots.claim("a")  # a holder is granted again
    assert slots.claim("b")
    assert not slots.claim("c")
    assert slots.release("a") and not slots.release("a")
    assert slots.claim("c")
    assert (slots.num_held, slots.num_free, slots.num_lost) == (2, 0, 0)


def test_a_slot_abandoned_by_its_holder_is_lost_for_good():
    slots = GraphSlots(2)
    slots.claim("a")
    slots.claim("b")
    assert slots.abandon("a") and not slots.abandon("a")
    assert (slots.num_held, slots.num_free, slots.num_lost) == (1, 0, 1)
    assert not slots.claim("c")  # the dead graph's thread is never free again
    assert slots.release("b") and slots.claim("c")
    with pytest.raises(ValueError, match="num_slots=-1"):
        GraphSlots(-1)


def test_a_slot_lost_with_a_lapsed_lease_comes_back_when_its_graph_is_torn_down():
    """A client only paused past its lease: its slot was counted lost (its loop held a
    thread), and its teardown after it resumed ends that loop: the slot is free again."""
    slots = GraphSlots(2)
    slots.claim("paused")
    assert slots.abandon("paused") and slots.num_lost == 1
    assert slots.release("paused") and (slots.num_lost, slots.num_free) == (0, 2)
    assert not slots.release("paused")  # once


def test_a_lease_closed_or_lapsed_holding_a_slot_loses_it_and_a_released_one_does_not():
    clock = Clock()
    coord, _ = make(clock, step_graphs=3)
    assert coord.hello("a", 1.0)["step_graph"]
    for client in ("a", "b", "c"):
        coord.hello(client, 1.0)
        assert coord.claim_step_graph(client)
    assert not coord.claim_step_graph("d")
    assert coord.release_step_graph("a")
    coord.close_lease("a")  # given back first: a clean shutdown
    coord.close_lease("b")  # still held: its graph was never torn down
    coord.renew_lease("a")
    clock.now += 2.0
    assert coord.expire_leases() == 0  # "c" lapses (it held no requests)
    stats = coord.stats()
    assert (stats["step_graphs"], stats["step_graphs_lost"]) == (0, 2)
    assert coord.claim_step_graph("d") and not coord.claim_step_graph("e")
    ok(coord.allocate_extend(coord.epoch, "d", None, "r", np.arange(1, 9)))  # no other change


def test_a_build_that_fails_after_its_claim_gives_the_slot_back(monkeypatch):
    """The claim comes first; a graph that cannot be compiled, or whose coordinator loop does
    not answer its first run, holds no loop: its slot goes back at once (a client that died
    before building again would otherwise take it with it, lost for good)."""
    import types

    import ray

    import cpkv.actors.step_graph as step_graph

    slots = GraphSlots(1)
    torn_down = []

    class NoLoop:  # the coordinator's loop never answers the first run
        def execute(self, _data):
            return types.SimpleNamespace(get=lambda timeout=None: _raise(TimeoutError("no loop")))

        def teardown(self):
            torn_down.append(self)

    def method(fn):
        return types.SimpleNamespace(remote=fn, bind=lambda *_args: None)

    coordinator = types.SimpleNamespace(
        claim_step_graph=method(slots.claim),
        release_step_graph=method(slots.release),
        run_step=method(None),
    )
    monkeypatch.setattr(ray, "get", lambda value, timeout=None: value)  # the fake answers values
    for compile_graph in (lambda _node: NoLoop(), lambda _node: _raise(RuntimeError("compile"))):
        monkeypatch.setattr(step_graph, "compile_unowned", compile_graph)
        graph = step_graph.StepGraph(coordinator, "c1", build_timeout_s=0.1)
        try:
            with pytest.raises(step_graph.GraphUnavailable, match="not built"):
                graph.run(("decode",), 1.0)
            assert slots.num_held == 0 and slots.claim("c2")  # free for another client
            slots.release("c2")
            slots.abandon("c1")  # its lease lapses: nothing of it is lost
            assert slots.num_lost == 0 and slots.num_free == 1
        finally:
            graph.close()  # while ray.get is the fake (its exit hook would start a Ray)
    assert len(torn_down) == 1  # the graph that was compiled, not the one that was not


def _raise(error: BaseException):
    raise error


def test_a_graph_dropped_without_close_leaves_no_exit_hook(monkeypatch):
    """A client dropped without shutdown() drops its graph: its exit hook goes with it (a
    long-lived process making a client per task kept one hook for each)."""
    import gc
    import types

    import cpkv.actors.step_graph as step_graph

    hooks: list = []
    fake = types.SimpleNamespace(register=hooks.append, unregister=hooks.remove)
    monkeypatch.setattr(step_graph, "atexit", fake)
    coordinator = types.SimpleNamespace(run_step=types.SimpleNamespace(bind=lambda *_a: None))
    for _ in range(5):
        step_graph.StepGraph(coordinator, "c1", build_timeout_s=0.1)
        gc.collect()
    assert hooks == []


def test_a_coordinator_without_slots_grants_none():
    coord, _ = make()
    assert not coord.hello("a", 1.0)["step_graph"]
    assert not coord.claim_step_graph("a")


# ------------------------------------------------------------------ through Ray
@pytest.mark.ray
def test_steps_go_through_the_graph_and_answer_as_ordinary_calls(make_client):
    from tests.test_lane_attention import close, qkv, reference

    c = make_client(cp_size=2, num_pages_per_lane=48, compiled_steps=True)
    graph = c._graph
    assert graph is not None
    steps_before = graph.num_steps
    prompt = np.arange(45) % 200
    res = c.prefill("a", prompt, probe=qkv(prompt))
    close(res.attention, reference(prompt, 0))
    out = c.decode(["a"], [7], probe=qkv(np.array([7]), len(prompt)))
    close(out, reference(np.concatenate([prompt, [7]]), len(prompt)))
    import torch

    items = [("b", prompt[:20]), ("c", prompt[:9])]
    probes = [qkv(toks) for _, toks in items]
    batch = c.prefill_batch(items, probe=tuple(torch.cat([p[i] for p in probes]) for i in range(3)))
    for (_, toks), res in zip(items, batch, strict=True):
        close(res.attention, reference(toks, 0))
    assert graph.num_steps == steps_before + 3
    assert c.stats()["step_graphs"] >= 1
    # A call id is one call whichever road it takes: the repeat answers the first answer.
    first = c.prefill("d", prompt[:5], probe=qkv(prompt[:5]), call_id="once")
    again = c.prefill("d", prompt[:5], probe=qkv(prompt[:5]), call_id="once")
    assert again.allocation.seq == first.allocation.seq
    assert np.array_equal(again.allocation.out_cache_loc, first.allocation.out_cache_loc)
    # Errors come back as the ordinary call raises them.
    from cpkv.errors import InvalidRequestError

    with pytest.raises(InvalidRequestError, match="call_id='once'"):
        c.decode(["d"], [1], probe=qkv(np.array([1]), 5), call_id="once")
    assert c.check()["ok"], c.check()


@pytest.mark.ray
def test_a_timeout_answered_by_the_coordinator_is_raised_not_sent_again(make_client, monkeypatch):
    """The coordinator answers a step whose lanes stayed silent with a RequestTimeoutError
    value: the client raises it (a TimeoutError, unlike the graph's own timeout, which sends
    the step again as an ordinary call)."""
    from cpkv.errors import RequestTimeoutError
    from tests.test_lane_attention import qkv

    c = make_client(cp_size=2, num_pages_per_lane=48, compiled_steps=True)
    answer = RequestTimeoutError("prefill: lanes silent for 60s", "the-call")
    monkeypatch.setattr(c._graph, "run", lambda call, timeout_s: answer)
    with pytest.raises(RequestTimeoutError, match="lanes silent") as info:
        c.prefill("a", np.arange(5), probe=qkv(np.arange(5)))
    assert info.value.call_id == "the-call"
    assert c.stats()["num_requests"] == 0  # never sent as an ordinary call


@pytest.mark.ray
def test_a_client_refused_a_slot_sends_its_steps_as_ordinary_calls(make_client):
    import ray

    from tests.test_lane_attention import close, qkv, reference

    c = make_client(fresh=True, cp_size=1, num_pages_per_lane=48, compiled_steps=True)
    prompt = np.arange(21) % 200
    c.prefill("warm", prompt, probe=qkv(prompt))  # this client's graph takes a slot
    for i in range(8):  # others take the rest
        ray.get(c._coord.claim_step_graph.remote(f"other-{i}"))
    d = make_client(fresh=False, name=c.name, cp_size=1, num_pages_per_lane=48)
    res = d.prefill("a", prompt, probe=qkv(prompt))
    close(res.attention, reference(prompt, 0))
    assert d._graph is not None and d._graph.num_steps == 0 and d._graph.num_fallbacks >= 1
    for i in range(8):
        ray.get(c._coord.release_step_graph.remote(f"other-{i}"))
    d._graph._retry_at = 0.0  # the test does not wait out the retry delay
    d.prefill("b", prompt, probe=qkv(prompt))
    assert d._graph.num_steps == 1


@pytest.mark.ray
def test_a_step_that_times_out_in_the_graph_is_answered_by_its_call_id(make_client):
    from cpkv.errors import RequestTimeoutError
    from tests.test_lane_attention import close, qkv, reference

    c = make_client(fresh=True, cp_size=1, num_pages_per_lane=48, compiled_steps=True)
    prompt = np.arange(21) % 200
    c.prefill("warm", prompt, probe=qkv(prompt))
    c.timeout_s, c.call_retries = 2.0, 0
    pid = c.lane_info()[0]["pid"]
    os.kill(pid, signal.SIGSTOP)
    try:
        with pytest.raises(RequestTimeoutError) as info:
            c.prefill("a", prompt, probe=qkv(prompt))
    finally:
        os.kill(pid, signal.SIGCONT)
    call_id = info.value.call_id
    assert call_id is not None
    c.timeout_s = 60.0
    res = c.prefill("a", prompt, probe=qkv(prompt), call_id=call_id)
    close(res.attention, reference(prompt, 0))
    # The abandoned graph is torn down in the background; a later step builds a new one.
    builds = c._graph.num_builds

    def rebuilt():
        c.prefill("b", prompt, probe=qkv(prompt))
        c.free("b")
        return c._graph.num_builds > builds

    wait_for(rebuilt, timeout=60)
    assert c.stats()["num_requests"] == 2 and c.check()["ok"]


@pytest.mark.ray
def test_a_restarted_coordinator_gets_the_clients_graph_again(make_client):
    import ray

    from cpkv.errors import CoordinatorUnavailableError
    from tests.test_lane_attention import qkv

    c = make_client(fresh=True, cp_size=1, num_pages_per_lane=48, compiled_steps=True)
    prompt = np.arange(21) % 200
    c.prefill("a", prompt, probe=qkv(prompt))
    epoch = c.stats()["epoch"]
    assert c._graph.num_builds == 1
    ray.kill(c._coord, no_restart=False)

    # NOTE: ray.kill returns before the actor is gone: a step sent at once may still be
    # answered by it (seen on the H100 box, where a step through the graph takes ~3 ms).
    wait_for(lambda: ray.get(c._coord.epoch.remote(), timeout=5) != epoch)
    with pytest.raises(CoordinatorUnavailableError):
        c.prefill("b", prompt, probe=qkv(prompt))
    n = iter(range(1000))

    def through_the_graph() -> bool:
        c._graph._retry_at = 0.0  # the test does not wait out the retry delay
        before = c._graph.num_steps
        c.prefill(f"r{next(n)}", prompt, probe=qkv(prompt))
        return c._graph.num_steps > before

    wait_for(through_the_graph)
    stats = c.stats()
    assert stats["epoch"] != epoch and stats["step_graphs"] == 1
    assert c._graph.num_builds == 2


_CHILD = textwrap.dedent(
    """
    import json, os, sys
    import numpy as np
    import cpkv
    from tests.test_lane_attention import qkv

    address, name, opts, how = sys.argv[1:]
    c = cpkv.connect(address, name=name, lease_s=1.0, **json.loads(opts))
    prompt = np.arange(9)
    c.prefill("x", prompt, probe=qkv(prompt))
    assert c._graph.num_steps == 1
    if how == "crash":
        os._exit(0)
    # "exit": leave without shutdown(); the interpreter's exit runs Ray's shutdown
    """
)


@pytest.mark.ray
def test_a_client_process_that_exits_never_takes_the_coordinator_with_it(make_client):
    """Ray's shutdown would kill every actor of a graph the process still holds; the
    client's graph is torn down first (a clean exit gives its slot back) or, if the process
    dies, its slot is lost when its lease lapses and the coordinator goes on."""
    import ray

    from tests.conftest import DEFAULTS

    opts = {**DEFAULTS, "cp_size": 1, "num_pages_per_lane": 48, "compiled_steps": True}
    c = make_client(fresh=True, **opts)
    del opts["heartbeat_s"], opts["num_gpus_per_lane"]
    epoch = c.stats()["epoch"]
    address = ray.get_runtime_context().gcs_address
    path = os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p)
    env = {**os.environ, "PYTHONPATH": path, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}
    for how in ("exit", "crash"):
        subprocess.run(
            [sys.executable, "-c", _CHILD, address, c.name, json.dumps(opts), how],
            check=True,
            env=env,
            timeout=180,
            cwd=ROOT,
        )
        stats = c.stats()
        assert stats["epoch"] == epoch and stats["dead_lanes"] == []
    assert c.stats()["step_graphs_lost"] == 0  # the clean exit gave its slot back
    wait_for(lambda: c.stats()["step_graphs_lost"] == 1, timeout=60)  # the crash's lease
    from tests.test_lane_attention import close, qkv, reference

    prompt = np.arange(13) % 200
    close(c.prefill("after", prompt, probe=qkv(prompt)).attention, reference(prompt, 0))
    assert c._graph.num_steps >= 1


def _cpu_share(pids: list[int], seconds: float) -> float:
    """Cores the processes ``pids`` used together over ``seconds`` (from /proc)."""

    def used() -> float:
        total = 0
        for pid in pids:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            total += int(fields[11]) + int(fields[12])
        return total / os.sysconf("SC_CLK_TCK")

    start = used()
    time.sleep(seconds)
    return (used() - start) / seconds


@pytest.mark.ray
def test_idle_graphs_are_torn_down_so_their_loops_stop_spinning_and_come_back(make_client):
    """A graph's loop polls for its next input; after IDLE_TEARDOWN_S without a step the
    lanes' graph and the client's are torn down, and the next step builds both again."""
    import ray

    from tests.test_lane_attention import close, qkv, reference

    c = make_client(fresh=True, cp_size=1, num_pages_per_lane=48, compiled_steps=True)
    # NOTE: both graphs' idle time cut from IDLE_TEARDOWN_S (10 s) to 3 s before their first
    # step (each reads it when it next waits): the mechanism is under test, not the constant.
    c._graph.idle_s = 3.0
    ray.get(c._coord.__ray_call__.remote(_set_idle_s, 3.0))
    prompt = np.arange(21) % 200
    c.prefill("a", prompt, probe=qkv(prompt))
    pids = [
        ray.get(c._coord.__ray_call__.remote(lambda actor: os.getpid())),
        c.lane_info()[0]["pid"],
    ]
    busy = _cpu_share(pids, 1.0)
    wait_for(
        lambda: c._graph.num_idle_teardowns == 1 and c.stats()["compiled_graph_idle_teardowns"],
        timeout=60,
    )
    # Its loop ended, so the slot went back: a client that dies idle takes none with it.
    wait_for(lambda: c.stats()["step_graphs"] == 0, timeout=10)
    idle = _cpu_share(pids, 2.0)
    assert idle < 0.25, (busy, idle)  # cores, coordinator and lane together
    builds = (c._graph.num_builds, c.stats()["compiled_graph_builds"])
    res = c.prefill("b", prompt, probe=qkv(prompt))
    close(res.attention, reference(prompt, 0))
    assert (c._graph.num_builds, c.stats()["compiled_graph_builds"]) == (
        builds[0] + 1,
        builds[1] + 1,
    )
    assert c._graph.num_steps == 2 and c.stats()["step_graphs"] == 1  # its slot was kept


def _set_idle_s(actor, seconds: float) -> None:
    actor._steps._idle_s = seconds


@pytest.mark.ray
def test_a_dropped_client_gives_its_slot_back(make_client):
    import gc

    from tests.test_lane_attention import qkv

    c = make_client(fresh=True, cp_size=1, num_pages_per_lane=48, compiled_steps=True)
    d = make_client(name=c.name, cp_size=1, num_pages_per_lane=48)
    d.prefill("a", np.arange(5), probe=qkv(np.arange(5)))
    assert c.stats()["step_graphs"] == 1
    d._graph = None  # the client's other parts stay with the fixture, which shuts it down
    gc.collect()
    wait_for(lambda: c.stats()["step_graphs"] == 0, timeout=30)
    assert c.stats()["step_graphs_lost"] == 0
