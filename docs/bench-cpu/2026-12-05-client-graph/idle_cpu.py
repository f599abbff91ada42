# Idle CPU of a compiled graph's loops, per thread (docs/BENCHMARKS.md, 2026-12-05 (2)).
# Run from the repository root: PYTHONPATH=. python docs/bench-cpu/2026-12-05-client-graph/idle_cpu.py
import os, time
os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
import numpy as np, ray, cpkv
from tests.test_lane_attention import qkv
c = cpkv.connect(cp_size=1, page_size=4, num_pages_per_lane=48, num_heads=2, head_dim=8,
                 dtype="float32", compiled_steps=True, heartbeat_s=1.0)
pid = ray.get(c._coord.__ray_call__.remote(lambda a: os.getpid()))
lpid = c.lane_info()[0]["pid"]
def threads(p):
    out = {}
    for t in os.listdir(f"/proc/{p}/task"):
        s = open(f"/proc/{p}/task/{t}/stat").read()
        name = s[s.index("(")+1:s.rindex(")")]
        f = s.rsplit(")", 1)[1].split()
        out[(t, name)] = (int(f[11]) + int(f[12])) / os.sysconf("SC_CLK_TCK")
    return out
def top(p, s=5.0, label=""):
    a = threads(p); time.sleep(s); b = threads(p)
    d = sorted(((b[k] - a.get(k, 0)) / s, k) for k in b)[::-1][:4]
    print(label, "total %.1f%%" % (100 * sum(x for x, _ in d)), [(k[1], "%.0f%%" % (100 * x)) for x, k in d])
me = os.getpid()
time.sleep(2)
top(pid, label="coord, no client graph")
c.prefill("a", np.arange(5), probe=qkv(np.arange(5)))
time.sleep(1)
top(pid, label="coord, client graph")
top(lpid, label="lane")
top(me, label="client")
c.shutdown()
