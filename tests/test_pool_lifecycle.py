"""A pool's actors and placement group: nothing stays behind a failed start, a dropped
creator or a second shutdown, and an attach must name the pool that exists."""

from __future__ import annotations

import gc
import os
import subprocess
import sys
import textwrap
import time
import uuid

import pytest
import ray
from ray.util.placement_group import placement_group_table

import cpkv
from cpkv import InvalidRequestError
from cpkv.actors.pool import Pool
from cpkv.errors import RequestTimeoutError

from .conftest import DEFAULTS

pytestmark = pytest.mark.ray

ONE_LANE = {**DEFAULTS, "cp_size": 1}


def _groups(name: str) -> list[str]:
    """States of the placement groups of the pool named ``name``."""
    return [
        info["state"]
        for info in placement_group_table().values()
        if (info.get("name") or "").startswith(f"{name}-")
    ]


def _wait(check, timeout: float = 10.0) -> None:
    end = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < end, "timed out"
        time.sleep(0.05)


def test_a_coordinator_that_never_answers_at_start_leaves_no_lane_or_group(
    ray_session, monkeypatch
):
    def no_answer(cls, name, coordinator, timeout_s, group_name=None):
        raise RequestTimeoutError(f"hello: {name!r} gave no answer within {timeout_s}s")

    monkeypatch.setattr(Pool, "_of", classmethod(no_answer))
    name = f"nostart-{uuid.uuid4().hex[:8]}"
    with pytest.raises(RequestTimeoutError):
        cpkv.connect(**{**ONE_LANE, "name": name})
    _wait(lambda: set(_groups(name)) <= {"REMOVED"})
    monkeypatch.undo()
    _wait(lambda: Pool.attach(name) is None)  # the coordinator was killed: its name is free


@pytest.mark.parametrize(
    "amounts",
    [
        {"num_cpus_per_lane": float("nan")},
        {"num_gpus_per_lane": float("inf")},
        {"num_cpus_per_lane": 1e-5},
        {"num_gpus_per_lane": "0.5"},
        {"num_cpus_per_lane": -1},
    ],
    ids=["nan-cpus", "inf-gpus", "below-ray-unit", "str", "negative"],
)
def test_a_bad_lane_resource_amount_is_refused_before_any_group_is_reserved(ray_session, amounts):
    name = f"badamount-{uuid.uuid4().hex[:8]}"
    with pytest.raises(InvalidRequestError, match="per_lane"):
        cpkv.connect(**{**ONE_LANE, "name": name, **amounts})
    assert _groups(name) == []  # Ray refused such amounts only once the group was reserved
    assert Pool.attach(name) is None


def test_a_second_shutdown_and_a_with_block_after_shutdown_do_nothing(ray_session):
    name = f"twice-{uuid.uuid4().hex[:8]}"
    with cpkv.connect(**{**ONE_LANE, "name": name}) as client:
        client.shutdown()
    client.shutdown()
    assert ray.is_initialized()  # the session's Ray, neither stopped nor started anew
    _wait(lambda: set(_groups(name)) <= {"REMOVED"})


def test_a_dropped_creator_removes_its_placement_group(ray_session):
    name = f"dropped-{uuid.uuid4().hex[:8]}"
    client = cpkv.connect(**{**ONE_LANE, "name": name})
    assert _groups(name) == ["CREATED"]
    del client
    gc.collect()
    _wait(lambda: set(_groups(name)) <= {"REMOVED"})


def test_attaching_with_another_kv_shape_is_refused(make_client):
    client = make_client()
    with pytest.raises(InvalidRequestError, match="head_dim=16"):
        cpkv.connect(**{**DEFAULTS, "name": client.name, "head_dim": 16})
    assert client.check()["ok"]


EMBEDDED = textwrap.dedent(
    """
    import ray, cpkv
    from cpkv import InvalidRequestError

    shape = dict(cp_size=1, page_size=4, num_pages_per_lane=8, num_heads=2, head_dim=8,
                 dtype="float32", max_context_len=64)
    a = cpkv.connect(name="a", **shape)
    try:  # the local Ray was sized for the first pool: said at once, not at a timeout
        cpkv.connect(name="b", start_timeout_s=120, **shape)
    except InvalidRequestError as e:
        print("full:", "another pool holds the rest" in str(e))
    b = cpkv.connect(name="b", num_gpus_per_lane=0, **shape)
    a.shutdown()
    print("ray after a:", ray.is_initialized(), b.stats()["num_requests"])
    # At once on the share a's group gives back (asynchronously: refused before).
    c = cpkv.connect(name="c", **shape)
    print("next pool on a's share:", c.stats()["num_requests"] == 0)
    c.shutdown()
    b.shutdown()
    print("ray after b:", ray.is_initialized())
    b.shutdown()  # a second time: does not start a Ray to stop the pool in again
    print("ray after b again:", ray.is_initialized())
    for call in (lambda: b.free("x"), b.stats, lambda: b.gather_kv([0])):
        try:  # refused at once, not a new local Ray and Ray's "Can't find actor"
            call()
        except InvalidRequestError as e:
            print("used after shutdown:", "shut down" in str(e), ray.is_initialized())
    """
)


def test_two_pools_on_the_embedded_ray_and_the_last_one_stops_it(tmp_path):
    script = tmp_path / "embedded.py"
    script.write_text(EMBEDDED)
    out = subprocess.run(
        [sys.executable, str(script)],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"},
    )
    assert out.returncode == 0, out.stderr[-2000:]
    lines = [line for line in out.stdout.splitlines() if ":" in line]
    assert lines == [
        "full: True",
        "ray after a: True 0",
        "next pool on a's share: True",
        "ray after b: False",
        "ray after b again: False",
        *["used after shutdown: True False"] * 3,
    ], out.stdout


def test_lanes_on_one_host_split_its_memory_and_packed_gpu_lanes_their_gpu():
    """``gpu_memory_utilization`` sizes each lane from its share: CPU lanes (logical GPUs or
    none) each took the whole fraction of the host, together several times its memory."""
    from cpkv.actors.pool import memory_shares

    def lane(node: str, device: str) -> dict:
        return {"node_id": node, "device": device}

    cpu = [lane("a", "cpu"), lane("a", "cpu"), lane("a", "cpu"), lane("b", "cpu")]
    assert memory_shares(cpu, 1.0) == [1 / 3, 1 / 3, 1 / 3, 1.0]
    assert memory_shares(cpu, 0.0) == [1 / 3, 1 / 3, 1 / 3, 1.0]
    packed = [lane("a", "cuda:0")] * 4
    assert memory_shares(packed, 0.25) == [0.25] * 4
    assert memory_shares([lane("a", "cuda:0"), lane("b", "cuda:0")], 1.0) == [1.0, 1.0]


def test_the_default_gpu_share_fits_on_the_gpus_there_are():
    from cpkv.actors.pool import default_gpus_per_lane

    assert default_gpus_per_lane(8, 4) == 1.0
    assert default_gpus_per_lane(1, 4) == 0.25  # the one GPU of a development box
    assert default_gpus_per_lane(2, 4) == 0.5
    assert default_gpus_per_lane(3, 4) == 0.5  # 0.75 a lane: only three would fit
    assert default_gpus_per_lane(3, 8) == 1 / 3
    assert default_gpus_per_lane(0, 4) == 0.0
    assert default_gpus_per_lane(0.5, 2) == 0.25  # a fractional GPU lent to the cluster
