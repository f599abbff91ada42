"""cp=1 decode at batch 8, the 1B's vocabulary on the tiny model in bf16: decode (logits come
back) against decode_greedy (ids only), through the client's graph; where the difference goes."""
import os, sys, time, statistics, dataclasses
os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"]="0"
import numpy as np, ray, cpkv
from cpkv.models import preset_config
B = int(sys.argv[1]) if len(sys.argv) > 1 else 8
config = dataclasses.replace(preset_config("tiny"), vocab_size=128256, dtype="bfloat16")
c = cpkv.connect(cp_size=1, page_size=64, num_pages_per_lane=256, max_reqs=16, max_context_len=4096,
                 model=config, model_seed=0, dtype=config.dtype, compiled_steps=True)
rids = [f"r{i}" for i in range(B)]
for r in rids: c.prefill(r, np.arange(16))
tok = lambda: np.arange(B) % 100
graph = c._graph; run = graph.run; runs = []
def timed(call, t):
    t0 = time.perf_counter()
    try: return run(call, t)
    finally: runs.append(time.perf_counter() - t0)
graph.run = timed
def med(f, n=60):
    runs.clear(); w = []
    for _ in range(n):
        t0 = time.perf_counter(); f(); w.append(time.perf_counter() - t0)
    return statistics.median(w) * 1e3, statistics.median(runs) * 1e3
for _ in range(10): c.decode(rids, tok()); c.decode_greedy(rids, tok())
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "../../gpu-run/step-timeline"))
import timeline_step  # noqa: E402
from ray import cloudpickle  # noqa: E402

cloudpickle.register_pickle_by_value(timeline_step)  # the actors cannot import it
_stamp_all, _clear = timeline_step._stamp_all, timeline_step._clear
lane = c.lanes[0]
ray.get(lane.__ray_call__.remote(_stamp_all, [("compiled_step", "lane"), ("_step", "step")]))
ray.get(c._coord.__ray_call__.remote(_stamp_all, [("run_step", "run_step"), ("_steps.execute", "queued"), ("_steps._run", "graph"), ("_c.decode", "decode")]))
def _patch_pack(actor):
    import time as _t
    g = next(k.__dict__["run_step"].__globals__ for k in type(actor).__mro__
             if "run_step" in k.__dict__ and "pack" in k.__dict__["run_step"].__globals__)
    st = actor._stamps
    orig = g["pack"]
    import os as _os
    print("coordinator env", _os.environ.get("MALLOC_MMAP_THRESHOLD_"), flush=True)
    def pk(obj):
        t0 = _t.perf_counter()
        try:
            return orig(obj)
        finally:
            st.setdefault("pack", []).append((t0, _t.perf_counter()))
    g["pack"] = pk
    return True
ray.get(c._coord.__ray_call__.remote(_patch_pack))
def legs(name, f):
    ray.get([lane.__ray_call__.remote(_clear), c._coord.__ray_call__.remote(_clear)])
    w, r = med(f, 40)
    la = ray.get(lane.__ray_call__.remote(lambda a: a._stamps))
    co = ray.get(c._coord.__ray_call__.remote(lambda a: a._stamps))
    m = lambda xs: statistics.median(xs) * 1e3
    n = len(la["lane"])
    print(f"{name}: wall {w:.2f} run {r:.2f} coord run_step {m([b-a for a,b in co['run_step']]):.2f} "
          f"lane call {m([b-a for a,b in la['lane']]):.2f} lane _step {m([b-a for a,b in la['step']]):.2f} | "
          f"c->l {m([la['lane'][i][0]-co['graph'][i][0] for i in range(n)]):.2f} "
          f"l->c {m([co['graph'][i][1]-la['lane'][i][1] for i in range(n)]):.2f} "
          f"hand-back {m([co['run_step'][i][1]-co['graph'][i][1] for i in range(n)]):.2f} "
          f"decision {m([co['queued'][i][0]-co['run_step'][i][0] for i in range(n)]):.2f} "
          f"pack {m([b-a for a,b in co['pack']]):.2f} c.decode {m([b-a for a,b in co['decode']]):.2f}")
for rep in range(2):
    legs("greedy", lambda: c.decode_greedy(rids, tok()))
    legs("logits", lambda: c.decode(rids, tok()))
for rep in range(0):
    g = med(lambda: c.decode_greedy(rids, tok()))
    d = med(lambda: c.decode(rids, tok()))
    print(f"batch {B}: greedy {g[0]:.2f} (run {g[1]:.2f}) ms; with logits {d[0]:.2f} (run {d[1]:.2f}) ms")
c.shutdown()
