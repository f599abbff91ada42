import sys
import time

import numpy as np

from cpkv.actors.wire import pack, unpack
from cpkv.core.steps import LaneReply, StepResult

if sys.argv[1] == "fix":
    from cpkv.actors.malloc import fix_malloc_thresholds

    print("fixed", fix_malloc_thresholds())
row = np.random.default_rng(0).integers(0, 65535, 128256).astype(np.uint16)
ans = {
    "lanes": [
        LaneReply(
            StepResult(16, 0.0, 0.0, 0.0, "auto", 0, logits={0: row}, logits_dtype="bfloat16")
        )
    ]
}
b = pack(ans)
ts = []
keep = None
for _ in range(3000):
    raw = bytes(bytearray(b))  # a fresh bytes, as a channel read makes
    t0 = time.perf_counter()
    out = unpack(raw)
    res = out["lanes"][0].value
    from cpkv.results import widen_logits

    w = widen_logits(res.logits[0], "bfloat16")
    ts.append(time.perf_counter() - t0)
    keep = w  # the user holds the last result until the next step
    del raw, out, res
print(sys.argv[1], "unpack+widen us median", round(np.median(ts[500:]) * 1e6, 1))
