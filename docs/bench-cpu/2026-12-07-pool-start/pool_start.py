"""How long a pool takes to start: ``cpkv.connect`` of a cp=2 tiny-model pool, four times in
one local Ray (the first start after ``ray.init`` apart), the first prefill, and shutdown.

    PYTHONPATH=<tree> python docs/bench-cpu/2026-12-07-pool-start/pool_start.py
"""

import os
import statistics
import time

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")

import numpy as np
import ray

import cpkv
from cpkv.models import preset_config

ray.init(include_dashboard=False, num_cpus=8, num_gpus=0, log_to_driver=False)
connects = []
for i in range(5):
    t0 = time.perf_counter()
    c = cpkv.connect(
        cp_size=2, page_size=16, num_pages_per_lane=64, max_reqs=8, max_context_len=512,
        model=preset_config("tiny"), model_seed=0,
    )  # fmt: skip
    t1 = time.perf_counter()
    c.prefill("a", np.arange(20))
    t2 = time.perf_counter()
    c.shutdown()
    connects.append(t1 - t0)
    print(f"start {i}: connect {t1 - t0:.2f} s, first prefill {t2 - t1:.2f} s", flush=True)
print(f"{cpkv.__file__}: connect median of starts 1-4 {statistics.median(connects[1:]):.2f} s")
ray.shutdown()
