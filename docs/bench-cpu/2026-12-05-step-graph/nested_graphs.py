import os, time, statistics
os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
import numpy as np, ray
from ray.dag import InputNode, MultiOutputNode

@ray.remote(num_cpus=0)
class Lane:
    def step(self, x):
        return np.zeros(128256, np.float32) if x == "big" else x

@ray.remote(num_cpus=0, max_concurrency=4)
class Coord:
    def __init__(self, lanes):
        self.lanes = lanes
        self.dag = None
    def build(self):
        with InputNode() as inp:
            out = MultiOutputNode([l.step.bind(inp) for l in self.lanes])
        self.dag = out.experimental_compile()
        return True
    def step(self, x):
        refs = self.dag.execute(x)
        return refs.get() if not isinstance(refs, list) else [r.get() for r in refs]
    def step_plain(self, x):
        return ray.get([l.step.remote(x) for l in self.lanes])
    def ping(self):
        return 1

ray.init(include_dashboard=False, num_cpus=2)
lanes = [Lane.remote() for _ in range(1)]
c = Coord.remote(lanes)
ray.get(c.build.remote())
print("inner built", ray.get(c.step.remote("a")))
with InputNode() as inp:
    outer = c.step.bind(inp)
outer = outer.experimental_compile()
print("outer compiled")
print(outer.execute("hi").get())
def med(f, n=200):
    ts = []
    for _ in range(n):
        t = time.perf_counter(); f(); ts.append(time.perf_counter() - t)
    return statistics.median(ts) * 1e3
for arg in ("x", "big"):
    print(arg, "outer compiled, inner compiled %.3f ms" % med(lambda: outer.execute(arg).get()))
    print(arg, "ordinary call, inner compiled %.3f ms" % med(lambda: ray.get(c.step.remote(arg))))
    print(arg, "ordinary call, inner plain %.3f ms" % med(lambda: ray.get(c.step_plain.remote(arg))))
print("ping %.3f" % med(lambda: ray.get(c.ping.remote())))
outer.teardown()
ray.shutdown()
