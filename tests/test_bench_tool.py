"""``cpkv bench``'s own arithmetic and Ray handling, without Ray: a fake client and a fake Ray.

The Ray runs of the tool are in ``tests/test_bench_prefill.py`` and
``tests/test_cluster_bench.py``.
"""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

import cpkv
from cpkv.actors import ray_env
from cpkv.errors import KVCapacityWaitError
from cpkv.tools import bench


class _Alloc:
    new_pages = np.arange(4, dtype=np.int32)


class _FakeClient:
    """Allocations that wait ``waits`` refusals of ``refusal_s`` each, or raise for ``broken``."""

    def __init__(self, waits: int = 0, refusal_s: float = 0.0, broken: str = "") -> None:
        self.waits, self.refusal_s, self.broken = waits, refusal_s, broken
        self.tries: dict[str, int] = {}
        self.flushed = False
        self.lock = threading.Lock()

    def lane_info(self):
        return [{"node_id": "n"}]

    def ping_lanes(self):
        pass

    def allocate_extend(self, rid, prompt):
        if rid == self.broken:
            raise RuntimeError("lane died")
        with self.lock:
            k = self.tries[rid] = self.tries.get(rid, 0) + 1
        if k <= self.waits:
            time.sleep(self.refusal_s)
            raise KVCapacityWaitError(
                "full", required_by_owner=[1], available_by_owner=[0], deficit_by_owner=[1]
            )
        return _Alloc()

    def free(self, rid, cache=True):
        pass

    def check(self):
        self.flushed = True  # check() sends the page moves still waiting
        return {"ok": True, "problems": []}

    def stats(self):
        n = len(self.tries)
        return {
            "extend_allocations": n,
            "pages_allocated": 4 * n,
            "pages_evicted": 0,
            "capacity_waits": n * self.waits,
            "lane_calls": 2 * n if self.flushed else n,
            "fallbacks_by_reason": {},
        }

    def shutdown(self):
        pass


def _point(monkeypatch, client: _FakeClient, concurrency: int = 1) -> dict:
    monkeypatch.setattr(cpkv, "connect", lambda *a, **k: client)
    return bench._point(bench.BenchConfig(requests=4, concurrency=concurrency), 1, 256)


def test_latency_counts_the_capacity_waits_and_calls_count_the_flushed_moves(monkeypatch):
    row = _point(monkeypatch, _FakeClient(waits=2, refusal_s=0.02))
    # Two refusals of 20 ms before each allocation: part of the request's latency.
    assert row["p50_ms"] >= 40 and row["capacity_waits"] == 8
    # Counted after check() flushed the last moves: 1 call + 2 lane calls an allocation.
    assert row["actor_calls_per_alloc"] == 3.0


def test_a_failed_allocation_fails_the_point(monkeypatch):
    with pytest.raises(RuntimeError, match="lane died"):
        _point(monkeypatch, _FakeClient(broken="b1"), concurrency=2)


def _prefill_row(cp: int, p50: float, busy: list[float], attn: list[float]) -> dict:
    return {
        "lanes": cp,
        "context": 2048,
        "split": "none" if cp == 1 else "zigzag",
        "prefill_ms_p50": p50,
        "lane_busy_ms": busy,
        "lane_attention_ms": attn,
        "work_share": [1.0] * cp,
        "lane_tokens": [2048 / cp] * cp,
        "exchange_bytes_max_lane": 0 if cp == 1 else 450_000_000,
    }


def test_projection_finds_the_cp1_row_whatever_the_order_of_lanes():
    """``--lanes 2,1`` runs cp 2 first; its projection needs cp 1's critical path."""
    rows = [
        _prefill_row(2, 80.0, [40.0, 41.0], [20.0, 21.0]),
        _prefill_row(1, 100.0, [90.0], [50.0]),
    ]
    bench.add_projection(rows, 450.0)
    two, one = rows
    assert one["projected_ms"] == pytest.approx(100.0)  # cp 1 projects onto itself
    assert two["overhead_vs_cp1"] == pytest.approx(0.8)
    # 41 ms busiest lane + 1 ms of exchange at 450 GB/s + cp 1's 10 ms outside its lane.
    assert two["projected_ms"] == pytest.approx(52.0)


@pytest.fixture
def fake_ray(monkeypatch):
    import ray

    state = {"up": False, "inits": [], "shutdowns": 0}

    def init(**kwargs):
        state["up"] = True
        state["inits"].append(kwargs)

    def shutdown():
        state["up"] = False
        state["shutdowns"] += 1

    monkeypatch.setattr(ray, "init", init)
    monkeypatch.setattr(ray, "shutdown", shutdown)
    monkeypatch.setattr(ray, "is_initialized", lambda: state["up"])
    monkeypatch.setattr(ray_env._Embedded, "running", False)
    monkeypatch.setattr(ray_env._Embedded, "users", 0)
    return state


def test_a_tools_quiet_ray_outlives_the_pools_of_its_run(fake_ray):
    """Each point's pool takes a share of the embedded Ray and gives it back at its shutdown:
    the tool's own share keeps the one quiet Ray up for every point, stopped at the end."""
    with ray_env.tool_ray(None, num_lanes=4):
        for _ in range(3):  # what Pool.create and the client's shutdown do for each point
            ray_env.ensure_ray(None, num_lanes=2)
            assert ray_env.take_embedded_ray()
            assert not ray_env.embedded_ray_released()
        assert fake_ray["up"]
    assert [kw["log_to_driver"] for kw in fake_ray["inits"]] == [False]
    assert fake_ray["shutdowns"] == 1 and not fake_ray["up"]
