"""GPU: D=64's paired key tiles (128-key softmax steps) with taller query tiles: 128 rows at
8 warps (FA3 runs D=64 at 192 x 128 over several warpgroups), with 2 and 3 stages, and 128
rows at 4 warps; and two GQA heads a program sharing each K/V tile; against the current
config (64 rows, 4 warps), beside SDPA cuDNN and flash in the same process, causal 8k and
32k (32/8 heads, page 64, bf16: bench_attention.py's table). Each arm is timed twice,
interleaved; every output is compared with the current config's and cuDNN's.

    PYTHONPATH=$PWD python3 docs/gpu-run/hopper-attention/12-d64-wide/run.py [T_in_k ...]
"""

import dataclasses
import sys

import torch

sys.path.insert(0, "benchmarks")
import bench_attention as B

import cpkv.kernels as K
import cpkv.kernels.paged_attention_tma as tma

BASE = dict(tma.CONFIGS)
# Changes to the config for D=64; the first arm is the current config.
ARMS = (
    {},
    {"block_m": 128, "num_warps": 8},
    {"block_m": 128, "num_warps": 8, "num_stages": 3},
    {"block_m": 128},
    {"heads_per_program": 2},
)


def run_arm(lane: B.Lane, d: int, arm: dict, rep: int) -> tuple[float, torch.Tensor]:
    """(ms, output) of the current config for ``d`` with the arm's changes."""
    cfg = dataclasses.replace(BASE[d], **arm)
    tma.CONFIGS = {**BASE, d: cfg}
    try:
        out = lane.call(K)[0].float()
        return B.bench_ms(lambda: lane.call(K), rep=rep), out
    finally:
        tma.CONFIGS = BASE


def shape(d: int, t: int) -> None:
    g = torch.Generator(device="cuda").manual_seed(t + d)
    q = torch.randn(t, B.HQ, d, device="cuda", generator=g).to(B.DTYPE)
    k = torch.randn(t, B.HKV, d, device="cuda", generator=g).to(B.DTYPE)
    v = torch.randn(t, B.HKV, d, device="cuda", generator=g).to(B.DTYPE)
    lane = B.make_lane(q, k, v, list(range(t // B.PAGE)), B.PAGE)
    flops = B.causal_flops(t, d=d)
    rep = 40 if t <= 32 << 10 else 15
    sdpa = B.sdpa_fns(q, k, v)
    ref = sdpa["cudnn"][0]()[0].transpose(0, 1).float()  # [T, H, D]
    arms: dict[str, list[float]] = {}
    outs: dict[str, torch.Tensor] = {}
    for _ in range(2):
        arms.setdefault("sdpa cudnn", []).append(B.bench_ms(sdpa["cudnn"][0], rep=rep))
        for arm in ARMS:
            name = "cpkv " + (",".join(f"{k}={v}" for k, v in arm.items()) or "current")
            ms, outs[name] = run_arm(lane, d, arm, rep)
            arms.setdefault(name, []).append(ms)
        arms.setdefault("sdpa flash", []).append(B.bench_ms(sdpa["flash"][0], rep=rep))
    cudnn = min(arms["sdpa cudnn"])
    for name, times in arms.items():
        best = min(times)
        note = ""
        if name.startswith("cpkv"):
            out, first = outs[name], next(iter(outs.values()))
            note = (
                f"max|vs current| {(out - first).abs().max().item():.1e} "
                f"max|vs cudnn| {(out - ref).abs().max().item():.1e}"
            )
        print(
            f"D={d} T={t >> 10}k {name:<40} "
            + " ".join(f"{m:8.3f}" for m in times)
            + f" ms  {flops / best / 1e9:6.0f} TFLOP/s  {cudnn / best:5.3f}x cudnn  {note}",
            flush=True,
        )


def main() -> None:
    print(torch.__version__, __import__("triton").__version__, torch.cuda.get_device_name())
    sizes = [int(a) << 10 for a in sys.argv[1:]] or [8 << 10, 32 << 10]
    for d in (64,):
        for t in sizes:
            shape(d, t)
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
