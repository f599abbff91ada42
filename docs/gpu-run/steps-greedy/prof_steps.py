"""Greedy 16-token prefills through the client's graph in a loop, for py-spy to sample the
client, coordinator and lane processes (run4.sh): prints READY when warm, then the medians.

    python3 docs/gpu-run/steps-greedy/prof_steps.py [cp] [seconds] [model]
"""

import os
import sys
import time

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")

import numpy as np
import ray
import torch

import cpkv
from cpkv.models import preset_config

cp = int(sys.argv[1]) if len(sys.argv) > 1 else 1
seconds = float(sys.argv[2]) if len(sys.argv) > 2 else 30.0
model = sys.argv[3] if len(sys.argv) > 3 else "tiny"
gpus = None if torch.cuda.is_available() else 8  # logical GPUs on a CPU machine
ray.init(include_dashboard=False, num_cpus=8, num_gpus=gpus, log_to_driver=False)
config = preset_config(model)
client = cpkv.connect(
    cp_size=cp, page_size=64, num_pages_per_lane=256, max_reqs=16, max_context_len=4096,
    num_gpus_per_lane=0.25, model=config, model_seed=0, dtype=config.dtype,
    name="prof", compiled_steps=True, step_graph=True,
)  # fmt: skip
prompt = np.random.default_rng(0).integers(0, config.vocab_size, size=16)
n = 0
for _ in range(20):
    client.prefill(n, prompt, greedy=True)
    client.free(n, cache=False)
    n += 1
print("READY", flush=True)
end, walls = time.time() + seconds, []
while time.time() < end:
    t0 = time.perf_counter()
    res = client.prefill(n, prompt, greedy=True)
    walls.append((time.perf_counter() - t0, max(res.lane_seconds)))
    client.free(n, cache=False)
    n += 1
w = np.array(walls)
wall_ms, fixed_ms = np.median(w[:, 0]) * 1e3, np.median(w[:, 0] - w[:, 1]) * 1e3
print(f"steps {len(w)}: wall {wall_ms:.3f} ms, fixed {fixed_ms:.3f} ms")
client.shutdown()
ray.shutdown()
