import glob

import numpy as np

ev = []
for p in glob.glob("/tmp/trace/*.txt"):
    with open(p) as f:
        for line in f:
            n, t = line.split()
            ev.append((float(t), n))
ev.sort()
# split into steps starting at A_client_send
steps, cur = [], None
for t, n in ev:
    if n == "A_client_send":
        cur = {}
        steps.append(cur)
    if cur is not None and n not in cur:
        cur[n] = t
steps = [s for s in steps if "J_client_results" in s]
order = sorted(
    {n for s in steps for n in s},
    key=lambda n: np.median([s[n] - s["A_client_send"] for s in steps if n in s]),
)
for parity in (0, 1):
    sub = steps[parity::2][-400:]
    print("parity", parity, "n", len(sub))
    prev = None
    for n in order:
        vals = [s[n] - s["A_client_send"] for s in sub if n in s]
        d = np.median([s[n] - s[prev] for s in sub if n in s and prev in s]) * 1e6 if prev else 0
        print(f"  {n:22s} {np.median(vals) * 1e6:8.0f} us  (+{d:6.0f})")
        prev = n
