"""GPU: decode steps of a 1B-class Llama through cpkv against transformers' decode, in one run.

Llama-3.2-1B's shape with random bf16 weights (seed 0, alike in transformers and on the
lanes), ``--batch`` prompts of each ``--contexts`` length, greedy decode:

* transformers (``attn_implementation="sdpa"``, its dynamic cache, eager): ms per decode step
  at batch 1 and at ``--batch``, and the reference logits of the first step;
* one cp=1 lane in this process (no Ray): a decode step through the lane's recorded CUDA
  graphs against the lane's eager path, same shard, same steps (the graphs' ablation);
* cpkv through the client at each ``--cps`` (cp > 1: lanes packed on the one GPU, eager):
  ms per ``decode_greedy`` step (ids only come back) and per ``decode`` step (logits come
  back), tokens/s, and the first step's logits against transformers' (max relative error,
  top-1).

Usage: python benchmarks/bench_decode_gpu.py [--contexts 4096,32768] [--batch 8] [--cps 1,2]
    [--steps 30] [--json PATH]
Without CUDA it prints why and exits 0.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time

import numpy as np
import torch

PAGE = 64


def _decoded(batches: list[int], steps: int) -> int:
    """Tokens a request may gain in one run: per batch size, warm-up, timed greedy and timed
    logits steps (and the first step)."""
    return len(batches) * (2 * steps + 8) + 16


def _compare(got: np.ndarray, want: np.ndarray) -> dict:
    rel = float(np.abs(got - want).max() / np.abs(want).max())
    return {"max_rel_err": rel, "top1_equal": int(np.argmax(got)) == int(np.argmax(want))}


def _median_ms(fn, steps: int) -> float:
    out = []
    for _ in range(steps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        out.append(time.perf_counter() - t0)
    return statistics.median(out) * 1e3


def hf_decode(config, prompts: np.ndarray, batches: list[int], steps: int) -> dict:
    """transformers' eager decode: ms per step per batch size, and the first step's logits of
    the full batch (rows = prompts) with the token each prompt's prefill picked."""
    import tempfile

    import transformers

    from cpkv.models import LlamaModel
    from cpkv.models.spec import save_checkpoint

    with tempfile.TemporaryDirectory() as path:
        save_checkpoint(LlamaModel.random(config, seed=0, device="cpu"), path)
        model = transformers.LlamaForCausalLM.from_pretrained(
            path, dtype=torch.bfloat16, attn_implementation="sdpa"
        )
    model = model.to("cuda").eval()
    out: dict = {}
    with torch.no_grad():
        for b in batches:
            ids = torch.as_tensor(prompts[:b], device="cuda")
            res = model(ids, use_cache=True, logits_to_keep=1)
            cache, nxt = res.past_key_values, res.logits[:, -1].argmax(-1)
            first = model(nxt[:, None], past_key_values=cache, use_cache=True)
            if b == max(batches):
                out["first_tokens"] = nxt.cpu().numpy()
                out["first_logits"] = first.logits[:, -1].float().cpu().numpy()
            state = {"cache": first.past_key_values, "nxt": first.logits[:, -1].argmax(-1)}

            def step(state=state):
                r = model(state["nxt"][:, None], past_key_values=state["cache"], use_cache=True)
                state["cache"], state["nxt"] = r.past_key_values, r.logits[:, -1].argmax(-1)

            for _ in range(3):
                step()
            out[b] = _median_ms(step, steps)
            del cache, state, res, first
            torch.cuda.empty_cache()
    model.to("cpu")
    torch.cuda.empty_cache()
    return out


def lane_ablation(config, prompts: np.ndarray, batches: list[int], steps: int) -> dict:
    """One cp=1 lane in-process: decode step time through graphs and eagerly."""
    from cpkv.core.config import KVShape
    from cpkv.lanes.shard import LaneShard
    from cpkv.lanes.worker import LaneWorker
    from cpkv.models import LlamaModel

    model = LlamaModel.random(config, seed=0, device="cuda")
    n_seq, ctx = prompts.shape
    per = -(-(ctx + _decoded(batches, steps)) // PAGE)
    kv = KVShape(config.num_layers, config.num_kv_heads, config.head_dim, config.dtype)
    shard = LaneShard(0, n_seq * per + 1, PAGE, kv, "cuda")
    pages = [np.arange(1 + r * per, 1 + (r + 1) * per, dtype=np.int32) for r in range(n_seq)]
    out = {}
    for graphs in (True, False):
        worker = LaneWorker(0, 1, torch.device("cuda"), model, decode_graphs=graphs)
        worker.init_group("g", "127.0.0.1", 0, "gloo", 60.0)
        for b, ms in _lane_steps(worker, shard, pages, prompts, batches, steps).items():
            out[("graph" if graphs else "eager", b)] = ms
    del shard, model
    torch.cuda.empty_cache()
    return out


def _lane_steps(worker, shard, pages, prompts, batches: list[int], steps: int) -> dict:
    """Prefill every prompt on the lane, then time decode steps per batch size."""
    from cpkv.core.steps import StepRequest, StepSequence

    ids = iter(range(1, 10**9))
    n_seq, ctx = prompts.shape
    lens = [ctx] * n_seq
    ps = shard.page_size

    def upto(r: int, n: int) -> np.ndarray:  # the pages holding n tokens
        return pages[r][: -(-n // ps)]

    seqs = [StepSequence(0, ctx, upto(r, ctx), prompts[r]) for r in range(n_seq)]
    worker.step(shard, StepRequest(next(ids), "g", tuple(seqs)))
    out = {}
    for b in batches:

        def step(b=b):
            s = [StepSequence(lens[r], 1, upto(r, lens[r] + 1), np.array([7])) for r in range(b)]
            worker.step(shard, StepRequest(next(ids), "g", tuple(s), sample=True))
            for r in range(b):
                lens[r] += 1

        step()
        out[b] = _median_ms(step, steps)
    return out


def cpkv_decode(config, cp: int, prompts: np.ndarray, hf: dict, batches: list, steps: int):
    import cpkv
    from cpkv.core.layout import PageLayout
    from cpkv.models.spec import ModelSpec

    n_seq, ctx = prompts.shape
    layout = PageLayout(cp, PAGE)
    room = ctx + _decoded(batches, steps)
    per_seq = layout.pages_for(room)
    client = cpkv.connect(
        cp_size=cp,
        page_size=PAGE,
        num_pages_per_lane=layout.pages_per_lane_for(per_seq) * n_seq + 16,
        max_reqs=n_seq + 2,
        max_context_len=room,
        model=ModelSpec(config, seed=0),
        name=f"bench-decode-{cp}-{ctx}",
        timeout_s=600,
    )
    try:
        rids = [f"r{i}" for i in range(n_seq)]
        client.prefill_batch(list(zip(rids, prompts, strict=True)))
        first = client.decode(rids, hf["first_tokens"])
        errs = [_compare(first[i], hf["first_logits"][i]) for i in range(n_seq)]
        row = {
            "cp": cp,
            "max_rel_err": max(e["max_rel_err"] for e in errs),
            "top1_equal": all(e["top1_equal"] for e in errs),
        }
        nxt = np.argmax(first, axis=-1)
        for b in batches:
            state = {"nxt": nxt[:b]}

            def greedy(b=b, state=state):
                state["nxt"] = client.decode_greedy(rids[:b], state["nxt"])

            def logits(b=b, state=state):
                state["nxt"] = np.argmax(client.decode(rids[:b], state["nxt"]), axis=-1)

            for _ in range(3):
                greedy()
            row[f"greedy_ms_b{b}"] = _median_ms(greedy, steps)
            row[f"logits_ms_b{b}"] = _median_ms(logits, max(5, steps // 3))
        return row
    finally:
        client.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--contexts", default="4096,32768")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--cps", default="1,2")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--json", help="write results here")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("bench_decode_gpu: no CUDA device; nothing to measure")
        return
    import transformers

    from cpkv.models import ModelConfig

    config = ModelConfig.llama_3_2_1b()
    batches = sorted({1, args.batch})
    cps = [int(c) for c in args.cps.split(",")]
    print(
        f"{torch.cuda.get_device_name()}, torch {torch.__version__}, transformers "
        f"{transformers.__version__}, python {platform.python_version()}; Llama-3.2-1B shape, "
        f"random bf16 weights, page {PAGE}; medians of {args.steps} steps in this run"
    )
    rng = np.random.default_rng(0)
    results = []
    for ctx in [int(c) for c in args.contexts.split(",")]:
        prompts = rng.integers(0, config.vocab_size, size=(args.batch, ctx))
        hf = hf_decode(config, prompts, batches, args.steps)
        lane = lane_ablation(config, prompts, batches, args.steps)
        rows = [cpkv_decode(config, cp, prompts, hf, batches, args.steps) for cp in cps]
        print(f"\n-- context {ctx} tokens")
        for b in batches:
            g, e = lane[("graph", b)], lane[("eager", b)]
            print(
                f"batch {b}: transformers {hf[b]:.2f} ms/step ({b / hf[b] * 1e3:.0f} tok/s); "
                f"lane in-process: graph {g:.2f} ms, eager {e:.2f} ms ({e / g:.1f}x)"
            )
            for r in rows:
                gm, lm = r[f"greedy_ms_b{b}"], r[f"logits_ms_b{b}"]
                print(
                    f"  cpkv cp={r['cp']}: decode_greedy {gm:.2f} ms/step ({b / gm * 1e3:.0f} "
                    f"tok/s, {gm / hf[b]:.2f}x transformers), decode with logits {lm:.2f} ms"
                )
        for r in rows:
            print(
                f"cp={r['cp']} first step's logits vs transformers: max rel err "
                f"{r['max_rel_err']:.3g}, top-1 equal {r['top1_equal']}"
            )
        results.append(
            {
                "context": ctx,
                "transformers_ms": {str(b): hf[b] for b in batches},
                "lane_ms": {f"{k}_b{b}": v for (k, b), v in lane.items()},
                "cpkv": rows,
            }
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
