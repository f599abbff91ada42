"""GPU: the TMA kernel with two key tiles a softmax step over fully visible pages
(``TmaConfig.pair_tiles``: at page 64 a tile is the page, so this is how D=64 gets 128-key
steps: one row max and one output rescale per 128 keys), alone and with 3 stages, beside
SDPA cuDNN and flash in the same process, at causal 8k, 32k and 128k, D 64 and 128 (32/8
heads, page 64, bf16: bench_attention.py's table). Each arm is timed twice, interleaved, so
a drift of the card shows; every output is compared with the current config's and cuDNN's.

    PYTHONPATH=$PWD python3 docs/gpu-run/hopper-attention/11-pair-tiles/run.py [T_in_k ...]
"""

import dataclasses
import sys

import torch

sys.path.insert(0, "benchmarks")
import bench_attention as B

import cpkv.kernels as K
import cpkv.kernels.paged_attention_tma as tma

BASE = dict(tma.CONFIGS)
# (pair_tiles, num_stages or None: the config's); the first is the current config
ARMS = ((False, None), (True, None), (True, 3))


def run_arm(
    lane: B.Lane, d: int, arm: tuple[bool, int | None], rep: int
) -> tuple[float, torch.Tensor]:
    """(ms, output) of the current config for ``d`` with the arm's options."""
    pairs, stages = arm
    cfg = dataclasses.replace(BASE[d], pair_tiles=pairs, num_stages=stages or BASE[d].num_stages)
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
            name = f"cpkv pairs={int(arm[0])} s={arm[1] or '-'}"
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
            f"D={d} T={t >> 10}k {name:<20} "
            + " ".join(f"{m:8.3f}" for m in times)
            + f" ms  {flops / best / 1e9:6.0f} TFLOP/s  {cudnn / best:5.3f}x cudnn  {note}",
            flush=True,
        )


def main() -> None:
    print(torch.__version__, __import__("triton").__version__, torch.cuda.get_device_name())
    sizes = [int(a) << 10 for a in sys.argv[1:]] or [8 << 10, 32 << 10, 128 << 10]
    for d in (64, 128):
        for t in sizes:
            shape(d, t)
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
