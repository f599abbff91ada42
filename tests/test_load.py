"""Concurrent clients under pool pressure: waits backed off and served, nothing lost."""

from __future__ import annotations

import random
import threading

import numpy as np
import pytest
import torch

from cpkv import KVCapacityWaitError
from cpkv.tools.workload import kv_for_tokens

pytestmark = pytest.mark.ray

THREADS = 8
CYCLES = 100
MAX_SUFFIX = 80  # tokens after a shared 24-token prefix: up to 26 pages a request


def test_eight_clients_a_hundred_cycles_under_pressure(make_client):
    # The default pool (4 lanes x 31 usable pages of 4 tokens): 8 requests of 7 to 26
    # pages, 16 on average, cannot all fit at once, so waits and evictions must happen.
    c = make_client()
    start = c.stats()
    page_size, lanes = c.config.page_size, c.config.cp_size
    usable = start["free"][0]
    total_free = sum(start["free"])
    prefixes = [np.arange(p * 100, p * 100 + 24) for p in range(3)]
    errors: list[BaseException] = []
    served = [0] * THREADS

    def client_loop(t: int) -> None:
        rng = random.Random(t)
        try:
            for i in range(CYCLES):
                rid = f"t{t}-{i}"
                n = rng.randrange(1, MAX_SUFFIX)
                suffix = np.array([rng.randrange(1000) for _ in range(n)])
                prompt = np.concatenate([prefixes[rng.randrange(3)], suffix])
                alloc = c.allocate_extend_with_backoff(
                    rid, prompt, deadline_s=60, initial_backoff_s=0.001
                )
                pos = np.arange(alloc.prefix_len, alloc.prefix_len + alloc.extend_len)
                k, v = kv_for_tokens(prompt[pos], pos, 2, 8)
                c.store_kv(alloc.out_cache_loc, k, v)
                if i % 10 == 0:  # read back through the lanes, prefix included
                    slots = np.concatenate([alloc.cached_slots, alloc.out_cache_loc])
                    got, _ = c.gather_kv(slots)
                    want, _ = kv_for_tokens(prompt, np.arange(prompt.size), 2, 8)
                    assert torch.equal(got, want), rid
                c.free(rid, cache=rng.random() < 0.7)
                served[t] += 1
        except BaseException as e:  # surfaced below, with the thread's context
            errors.append(e)

    threads = [threading.Thread(target=client_loop, args=(t,)) for t in range(THREADS)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert not errors, errors[:3]
    assert served == [CYCLES] * THREADS
    stats = c.stats()
    assert stats["num_requests"] == 0 and stats["used"] == [0, 0, 0, 0]
    waits = stats["capacity_waits"] - start["capacity_waits"]
    evicted = stats["pages_evicted"] - start["pages_evicted"]
    assert waits > 0 and evicted > 0, (waits, evicted)
    assert sum(stats["free"]) + sum(stats["cached"]) == total_free
    report = c.check()
    assert report["ok"], report
    # Evict the whole cache with one request that needs every page, then free it.
    everything = np.arange(50_000, 50_000 + lanes * usable * page_size)
    c.allocate_extend("all", everything)
    c.free("all", cache=False)
    assert c.stats()["free"] == start["free"]
    with pytest.raises(KVCapacityWaitError):
        c.allocate_extend("too-big", np.arange(lanes * usable * page_size + 1))
