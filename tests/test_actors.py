"""Coordinator and lanes on the shared local Ray, through the public client only."""

from __future__ import annotations

import asyncio
import math
import threading
import time

import numpy as np
import pytest
import ray
import torch

import cpkv
from cpkv import CPAllocator, InvalidRequestError, KVCapacityWaitError
from cpkv.actors.wire import pack, unpack

from .conftest import CUDA_DEVICES, DEFAULTS, GPUS_PER_LANE, NUM_GPUS

pytestmark = pytest.mark.ray


# The capacity tests' small pool (7 usable pages a lane), on whole logical GPUs where there
# are four: the distinct-GPU test then shares it (a cp=4 pool costs ~8-20 s to start here).
SMALL = {"num_pages_per_lane": 8, "num_gpus_per_lane": 1 if NUM_GPUS >= 4 else GPUS_PER_LANE}


def kv_for(tokens: np.ndarray, positions: np.ndarray, heads=2, dim=8):
    """Deterministic K/V of (token, position), so cached prefixes read back equal."""
    base = torch.as_tensor(tokens * 1000 + positions, dtype=torch.float32)
    grid = torch.arange(heads * dim, dtype=torch.float32).reshape(1, heads, dim)
    k = base[:, None, None] + grid
    return k, -k


def test_owner_plan_pages_reach_their_lanes(make_client):
    c = make_client()
    alloc = c.allocate_extend("r", np.arange(100))
    assert alloc.fallback_reason is None
    owners = alloc.page_owners
    assert (alloc.new_pages % 4 == owners).all()
    report = c.check()
    assert report["ok"], report
    held = [info["held"] for info in c.lane_info()]
    assert held == np.bincount(owners, minlength=4).tolist()
    assert c.stats()["lane_calls"] == 4  # one batched call per lane, none per page


def test_kv_round_trip_through_lanes(make_client):
    c = make_client()
    tokens = np.arange(50, 121)
    alloc = c.allocate_extend("r", tokens)
    k, v = kv_for(tokens, np.arange(tokens.size))
    c.store_kv(alloc.out_cache_loc, k, v)
    k2, v2 = c.gather_kv(alloc.out_cache_loc)
    assert torch.equal(k, k2) and torch.equal(v, v2)
    # Decode slot, written and read alone.
    (slot,) = c.allocate_decode(["r"], [7])
    kd, vd = kv_for(np.array([7]), np.array([tokens.size]))
    c.store_kv([slot], kd, vd)
    assert torch.equal(c.gather_kv([slot])[0], kd)


def test_cached_prefix_reads_back_after_free(make_client):
    c = make_client()
    tokens = np.arange(64)
    a = c.allocate_extend("a", tokens)
    c.store_kv(a.out_cache_loc, *kv_for(tokens, np.arange(64)))
    c.free("a")
    b = c.allocate_extend("b", np.concatenate([tokens, [1, 2, 3]]))
    assert b.cached_len == 64
    prefix_slots = (c_pages := np.asarray(b.new_pages))  # noqa: F841 - new pages only
    cached = np.arange(64)
    # Slots of the cached prefix are the request's first pages, expanded.
    k, _ = kv_for(tokens, cached)
    stats = c.stats()
    assert stats["cached_tokens_hit"] == 64
    pages = a.new_pages  # the same pages, now shared from the cache
    slots = (pages.astype(np.int64)[:, None] * 4 + np.arange(4)).ravel()
    assert torch.equal(c.gather_kv(slots)[0], k)


def test_capacity_error_crosses_ray_intact(make_client):
    c = make_client(**SMALL)  # 7 usable a lane
    c.allocate_extend("hold", np.arange(64))  # 16 pages, 4 a lane
    with pytest.raises(KVCapacityWaitError) as info:
        c.allocate_extend("big", np.arange(1000, 1000 + 64))
    err = info.value
    assert type(err) is KVCapacityWaitError
    assert err.required_by_owner == [4, 4, 4, 4]
    assert err.available_by_owner == [3, 3, 3, 3]
    assert err.deficit_by_owner == [1, 1, 1, 1]
    assert c.check()["ok"]


def test_backoff_succeeds_once_another_request_frees(make_client):
    c = make_client(**SMALL)
    c.allocate_extend("hold", np.arange(64))
    timer = threading.Timer(0.4, lambda: c.free("hold", cache=False))
    timer.start()
    t0 = time.monotonic()
    alloc = c.allocate_extend_with_backoff("big", np.arange(1000, 1064), deadline_s=20)
    assert time.monotonic() - t0 >= 0.3
    assert alloc.num_new_pages == 16
    timer.join()
    assert c.stats()["capacity_waits"] >= 1


def test_a_step_with_a_deadline_succeeds_once_another_request_frees(make_client):
    """Each retry of a step's capacity wait is a new call: the coordinator answers a repeated
    call id with its first answer, which would be the wait again."""
    c = make_client(**SMALL)
    n, heads, dim = 64, DEFAULTS["num_heads"], DEFAULTS["head_dim"]
    warm = tuple(torch.randn(4, heads, dim) for _ in range(3))
    c.prefill("warm", np.arange(4), probe=warm)  # the lanes' group is up before the wait
    c.free("warm", cache=False)
    c.allocate_extend("hold", np.arange(64))
    probe = tuple(torch.randn(n, heads, dim) for _ in range(3))
    timer = threading.Timer(0.4, lambda: c.free("hold", cache=False))
    timer.start()
    t0 = time.monotonic()
    res = c.prefill("big", np.arange(1000, 1000 + n), probe=probe, deadline_s=20)
    assert time.monotonic() - t0 >= 0.3
    assert res.allocation.num_new_pages == 16
    timer.join()
    c.free("big", cache=False)
    assert c.stats()["capacity_waits"] >= 1 and c.check()["ok"]


def test_backoff_reraises_at_deadline(make_client):
    c = make_client(**SMALL)
    c.allocate_extend("hold", np.arange(64))
    t0 = time.monotonic()
    with pytest.raises(KVCapacityWaitError):
        c.allocate_extend_with_backoff("big", np.arange(1000, 1064), deadline_s=0.5)
    assert 0.4 <= time.monotonic() - t0 < 5


def test_stats_match_the_core(make_client):
    c = make_client()
    core = CPAllocator(4, 4, 32, max_reqs=32, max_context_len=4096)
    steps = [
        ("extend", "a", np.arange(40)),
        ("extend", "b", np.arange(30)),
        ("extend", "a", np.arange(40, 47)),
        ("decode", ["a", "b"], [1, 2]),
        ("free", "b", None),
        ("extend", "c", np.arange(35)),
        ("batch", [("d", np.arange(9)), ("e", np.arange(500, 530))], None),
    ]
    for kind, x, y in steps:
        for target in (c, core):
            if kind == "extend":
                target.allocate_extend(x, y)
            elif kind == "decode":
                target.allocate_decode(x, y)
            elif kind == "free":
                target.free(x)
            else:
                target.allocate_extend_batch(x)
    remote, local = c.stats(), core.stats()
    for key in local:
        assert remote[key] == local[key], key
    assert c.check()["ok"]


def test_repeated_call_id_allocates_nothing_twice(make_client):
    c = make_client()
    coord = c._coord  # a retry after a lost reply resends the same call id
    ray = c._ray
    tokens = np.arange(40)
    call = (c._epoch, c.client_id, ("retry", 1), "r", tokens, None)
    # (answer, lanes' move fence), packed (cpkv.actors.wire)
    first, _ = unpack(ray.get(coord.allocate_extend.remote(pack(call))))
    again, _ = unpack(ray.get(coord.allocate_extend.remote(pack(call))))
    assert again.new_pages.tolist() == first.new_pages.tolist()
    assert c.stats()["extend_allocations"] == 1
    # A lane move repeated with the same (generation, seq) changes nothing either.
    assert c.check()["ok"]  # its heartbeats come behind the moves: the lanes have them now
    lane = c.lanes[0]
    info = ray.get(lane.info.remote())
    gen, seq, held = info["generation"], info["last_seq"], info["held"]
    assert seq >= 1
    page = np.array([30], dtype=np.int32)
    empty = np.empty(0, np.int32)
    move = lambda gen, seq: ((gen, seq, page, empty),)  # a batch of one move
    assert ray.get(lane.apply_moves.remote(move(gen, seq))) == held  # remembered answer
    assert ray.get(lane.heartbeat.remote())[1] == held
    with pytest.raises(Exception, match="expected"):  # a gap is refused, not applied
        ray.get(lane.apply_moves.remote(move(gen, seq + 2)))
    with pytest.raises(Exception, match="generation"):
        ray.get(lane.apply_moves.remote(move("stale:1", seq + 1)))
    assert ray.get(lane.heartbeat.remote())[1] == held
    assert c.check()["ok"]


@pytest.mark.skipif(NUM_GPUS < 4, reason="needs 4 (logical) GPUs")
def test_lanes_get_distinct_logical_gpus(make_client):
    c = make_client(**SMALL)  # one whole GPU a lane (NUM_GPUS >= 4 here)
    infos = c.lane_info()
    gpus = [tuple(i["gpu_ids"]) for i in infos]
    assert len(set(gpus)) == 4 and all(len(g) == 1 for g in gpus)
    assert len({i["node_id"] for i in infos}) == 1  # STRICT_PACK


def test_fractional_gpus_pack_lanes(make_client):
    c = make_client()  # the session's pool: fractional lanes (a pool start costs ~8 s)
    fraction = DEFAULTS["num_gpus_per_lane"]
    assert 0 < fraction < 1
    gpus = {g for i in c.lane_info() for g in i["gpu_ids"]}
    assert len(gpus) <= math.ceil(4 * fraction)  # four lanes share what four fractions fill


@pytest.mark.skipif(not CUDA_DEVICES, reason="needs a CUDA device")
def test_lane_shards_are_cuda_tensors_on_a_gpu(make_client):
    c = make_client()
    assert all(i["device"].startswith("cuda") for i in c.lane_info())
    tokens = np.arange(300)
    alloc = c.allocate_extend("g", tokens)
    k, v = kv_for(tokens, np.arange(300))
    c.store_kv(alloc.out_cache_loc, k, v)
    k2, v2 = c.gather_kv(alloc.out_cache_loc)
    assert torch.equal(k, k2) and torch.equal(v, v2)


def test_async_twins(make_client):
    c = make_client()

    async def go():
        a = await c.allocate_extend_async("x", np.arange(20))
        slots = await c.allocate_decode_async(["x"], [3])
        freed = await c.free_async("x", cache=False)
        return a, slots, freed, await c.stats_async()

    a, slots, freed, stats = asyncio.run(go())
    assert a.extend_len == 20 and slots.shape == (1,) and freed == 6
    assert stats["used"] == [0, 0, 0, 0]


def test_attach_to_named_coordinator(make_client, attach):
    c = make_client()
    c.allocate_extend("r", np.arange(10))
    other = attach(c)
    assert other.stats()["num_requests"] == 1
    assert other.lanes == c.lanes and not other.owns_pool
    with pytest.raises(InvalidRequestError, match="exists"):
        cpkv.connect(name=c.name, cp_size=2, page_size=4, num_pages_per_lane=32)


def test_metrics_gauges_take_the_stats(ray_session):
    from cpkv.actors.coordinator import _Metrics

    m = _Metrics()
    assert m._pages is not None, "ray.util.metrics unavailable"
    stats = {
        "free": [3, 4],
        "used": [1, 0],
        "cached": [0, 2],
        "capacity_waits": 2,
        "pages_evicted": 5,
    }
    m.update(stats)
    m.update({**stats, "capacity_waits": 3})
    assert m._last == {"capacity_waits": 3, "pages_evicted": 5}


def test_request_ids_reused_after_free(make_client):
    """A job naming its requests req-0, req-1, ... per step reuses ids after free."""
    c = make_client()
    rng = np.random.default_rng(5)
    prefix = rng.integers(0, 50, size=16)
    for step in range(12):
        for i in range(2):
            rid = f"req-{i}"
            c.allocate_extend(rid, np.concatenate([prefix, rng.integers(0, 50, size=9)]))
            c.allocate_decode([rid], [step])
            c.free(rid, cache=bool((step + i) % 2))
    stats = c.stats()
    assert stats["lane_losses"] == [] and stats["mirror_mismatches"] == 0
    assert stats["cached_tokens_hit"] > 0
    report = c.check()
    assert report["ok"], report


def test_two_clients_extend_one_rid_at_once(make_client, attach):
    # Clients share request ids only inside one namespace (issue 19.4).
    pool = make_client()
    c, other = attach(pool, namespace="job"), attach(pool, namespace="job")
    c.allocate_extend("shared", np.arange(8))
    errors = []

    def extend(client, base):
        try:
            for i in range(10):
                client.allocate_extend("shared", np.arange(base + 3 * i, base + 3 * i + 3))
        except Exception as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=extend, args=(cl, b)) for cl, b in ((c, 100), (other, 900))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    c.allocate_decode(["shared"])  # 8 + 2 * 30 + 1 tokens, serialised one call at a time
    stats = c.stats()
    assert stats["num_requests"] == 1
    assert sum(stats["used"]) == -(-(8 + 60 + 1) // 4)
    assert c.check()["ok"]


def test_cache_salt_separates_tenants(make_client):
    c = make_client()
    prompt = np.arange(40)
    c.allocate_extend("a", prompt, cache_salt="tenant-a")
    c.free("a")
    assert c.allocate_extend("b", prompt, cache_salt="tenant-b").cached_len == 0
    assert c.allocate_extend("a2", prompt, cache_salt="tenant-a").cached_len == 36
    assert c.check()["ok"]


def _heap_faults(actor) -> int:
    from tests.test_malloc import faults_per_big_alloc

    return faults_per_big_alloc()


def test_the_pools_actors_keep_big_buffers_in_the_heap(make_client):
    # A step's answer then pickles into reused heap, not freshly faulted pages
    # (cpkv.actors.malloc): glibc's default would map and fault a 40 MB buffer every time.
    c = make_client()
    for faults in ray.get([a.__ray_call__.remote(_heap_faults) for a in (c._coord, *c.lanes)]):
        assert faults < 100, faults


def test_lanes_sharing_a_gpu_are_named_and_cpu_lanes_are_not():
    from cpkv.actors.pool import _shared_gpus

    def lane(device, node="n1", gpus=("0",)):
        return {"device": device, "node_id": node, "gpu_ids": list(gpus)}

    infos = [lane("cuda:0"), lane("cuda:0", gpus=("1",)), lane("cuda:0"), lane("cuda:0", "n2")]
    assert _shared_gpus(infos) == [([0, 2], "node n1, GPU 0")]
    assert _shared_gpus([lane("cpu"), lane("cpu")]) == []  # logical GPUs on a CPU machine
    assert _shared_gpus([lane("cuda:0", gpus=("0",)), lane("cuda:0", gpus=("1",))]) == []


def test_a_check_waiting_on_a_hung_lane_never_holds_the_status_threads():
    """check() waits for every lane's count (a hung lane: up to lane_restart_timeout_s); in
    the two-thread status group two checks held stats() and the clients' lane_fence()."""
    from cpkv.actors.coordinator import CoordinatorActor

    groups = CoordinatorActor.__ray_metadata__.method_meta.concurrency_group_for_methods
    assert groups["stats"] == groups["lane_fence"] == "status"
    assert groups["check"] not in ("status", "lease")
