"""GPU, with halves.patch applied: the TMA kernel's tilings at causal 32k (32/8 heads, page 64,
bf16) beside SDPA cuDNN: the current config, two query halves a program (q by descriptor), and
the halves under Triton's warp specialisation (one loop, every tile masked). Each variant's
output is compared with the current config's.

    git apply docs/gpu-run/hopper-attention/9-halves-ws/halves.patch
    PYTHONPATH=$PWD python3 docs/gpu-run/hopper-attention/9-halves-ws/run.py
"""

import sys
import time

import torch

sys.path.insert(0, "benchmarks")
import bench_attention as B

import cpkv.kernels as K
import cpkv.kernels.paged_attention_tma as tma

print(torch.__version__, __import__("triton").__version__, torch.cuda.get_device_name(), flush=True)
C = tma.TmaConfig
base = dict(tma.CONFIGS)
variants = {
    128: [
        ("base", base[128]),
        ("halves M128 N64 s3", C(128, 64, 1, 4, 3, halves=True)),
        ("halves+ws M128 N64 s3", C(128, 64, 1, 4, 3, warp_specialize=True, halves=True)),
        ("halves+ws M128 N128 s2", C(128, 128, 1, 4, 2, warp_specialize=True, halves=True)),
    ],
    64: [
        ("base", base[64]),
        ("halves M128 N128 s2", C(128, 128, 1, 4, 2, halves=True)),
        ("halves+ws M128 N128 s2", C(128, 128, 1, 4, 2, warp_specialize=True, halves=True)),
        ("halves+ws M128 N64 s2", C(128, 64, 1, 4, 2, warp_specialize=True, halves=True)),
    ],
}
t = 32 << 10
for d, vs in variants.items():
    g = torch.Generator(device="cuda").manual_seed(t)
    q = torch.randn(t, B.HQ, d, device="cuda", generator=g).to(B.DTYPE)
    k = torch.randn(t, B.HKV, d, device="cuda", generator=g).to(B.DTYPE)
    v = torch.randn(t, B.HKV, d, device="cuda", generator=g).to(B.DTYPE)
    lane = B.make_lane(q, k, v, list(range(t // B.PAGE)), B.PAGE)
    flops = B.causal_flops(t, d=d)
    ref = None
    for name, cfg in vs:
        tma.CONFIGS = {**base, d: cfg}
        try:
            t0 = time.time()
            out, _ = lane.call(K)
            torch.cuda.synchronize()
            comp = time.time() - t0
            err = float("nan") if ref is None else (out - ref).abs().max().item()
            if ref is None:
                ref = out.clone()
            ms = B.bench_ms(lambda lane=lane: lane.call(K), rep=40)
            print(
                f"D={d} {name:<24} {ms:8.3f} ms {flops / ms / 1e9:6.0f} TFLOP/s  "
                f"max|diff vs base| {err:.1e}  (first call {comp:.1f} s)",
                flush=True,
            )
        except Exception as exc:
            msg = str(exc).strip().splitlines()
            print(
                f"D={d} {name:<24} FAILED {type(exc).__name__}: {msg[-1][:200] if msg else ''}",
                flush=True,
            )
        finally:
            tma.CONFIGS = base
    for sname, (fn, _) in B.sdpa_fns(q, k, v).items():
        if sname != "cudnn":
            continue
        ms = B.bench_ms(fn, rep=40)
        print(f"D={d} sdpa {sname:<19} {ms:8.3f} ms {flops / ms / 1e9:6.0f} TFLOP/s", flush=True)
    del q, k, v, lane, ref
    torch.cuda.empty_cache()
