import dataclasses
import os
import sys
import time

os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
import numpy as np

import cpkv
from cpkv.models import preset_config

model, dur, cp = sys.argv[1], float(sys.argv[2]), int(sys.argv[3])
gpus = float(sys.argv[4]) if len(sys.argv) > 4 else None
config = preset_config(model)
if model == "tiny":
    config = dataclasses.replace(config, vocab_size=128256, dtype="bfloat16")
client = cpkv.connect(
    None,
    cp_size=cp,
    page_size=64,
    num_pages_per_lane=256,
    max_reqs=16,
    max_context_len=4096,
    model=config,
    model_seed=0,
    dtype=config.dtype,
    name=f"loop-{time.time_ns()}",
    compiled_steps=True,
    step_graph=True,
    num_gpus_per_lane=gpus,
)
prompt = np.random.default_rng(0).integers(0, config.vocab_size, size=16)
rid = 0


def one(g):
    global rid
    rid += 1
    t0 = time.perf_counter()
    res = client.prefill(rid, prompt, greedy=g)
    dt = time.perf_counter() - t0
    client.free(rid, cache=False)
    return dt - max(res.lane_seconds)


for _ in range(300):
    one(False)
end = time.time() + dur
fl, fg = [], []
while time.time() < end:
    fl.append(one(False))
    fg.append(one(True))
print(
    "n", len(fl), "fixed logits ms", np.median(fl) * 1e3, "greedy", np.median(fg) * 1e3, flush=True
)
client.shutdown()
