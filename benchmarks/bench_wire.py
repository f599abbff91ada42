"""The step wire (cpkv.actors.wire) against the standard pickle of the same objects.

Every value a step carries through the compiled graphs is pickled once and unpickled once on
each hop (client -> coordinator -> lanes and back). This prints, for the values a step
carries, the median microseconds of ``pickle.dumps`` / ``pickle.loads`` at the highest
protocol (numpy's and the dataclasses' own reducers) beside ``wire.pack`` / ``wire.unpack``,
measured side by side in this one run:

    python benchmarks/bench_wire.py [--iters 5000]
"""

from __future__ import annotations

import argparse
import pickle
import statistics
from collections.abc import Callable

import numpy as np
from _timing import median_seconds  # benchmarks/, the script's own folder

from cpkv.actors.wire import pack, unpack
from cpkv.core.allocator import CPAllocator
from cpkv.core.steps import LaneReply, StepPacket, StepRequest, StepResult, StepSequence

_VOCAB_1B = 128256  # Llama 3.2 1B


def _median_us(fn: Callable[[], object], iters: int) -> float:
    return median_seconds(fn, iters) * 1e6


def _prefill_packet(tokens: int, cp: int) -> StepPacket:
    """A prefill of ``tokens`` new tokens as the coordinator sends it, one move per lane."""
    pages = np.arange(1, -(-tokens // 64) + 1, dtype=np.int32)
    seq = StepSequence(0, tokens, pages, np.arange(tokens, dtype=np.int64), "r0", 0)
    step = StepRequest(7, "abcd1234:g1", (seq,), "auto", None, False)
    move = ("abcd1234abcd1234abcd1234abcd1234:1", 4, pages[:1], np.zeros(0, np.int32), 2)
    fences = tuple(("abcd1234abcd1234abcd1234abcd1234:1", 3) for _ in range(cp))
    return StepPacket(step, tuple((move,) for _ in range(cp)), fences, "abcd1234" * 4)


def _lane_reply(rows: int) -> LaneReply:
    """A lane's answer with ``rows`` bf16 logits rows of the 1B vocabulary."""
    logits = {b: np.zeros(_VOCAB_1B, np.uint16) for b in range(rows)}
    result = StepResult(16, 0.01, 0.0, 0.002, "pass_q", 0, logits, logits_dtype="bfloat16")
    return LaneReply((("abcd1234abcd1234abcd1234abcd1234:1", 5), result))


def _allocation(tokens: int, cp: int):
    """The coordinator's answer to an allocation of ``tokens`` new tokens at ``cp`` lanes."""
    alloc = CPAllocator(cp, 64, num_pages_per_lane=4096, max_reqs=16, max_context_len=1 << 18)
    return alloc.allocate_extend("r0", np.arange(tokens))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--iters", type=int, default=5000)
    args = ap.parse_args(argv)
    cases = {
        "16-token prefill packet, cp 1": _prefill_packet(16, 1),
        "16-token prefill packet, cp 4": _prefill_packet(16, 4),
        "8k-token prefill packet, cp 4": _prefill_packet(8192, 4),
        "lane reply, 1 row of 1B logits": _lane_reply(1),
        "lane reply, 8 rows of 1B logits": _lane_reply(8),
        "allocation answer, 16 tokens, cp 4": _allocation(16, 4),
        "allocation answer, 128k tokens, cp 4": _allocation(131072, 4),
    }
    head = f"{'value':<36} {'bytes':>8} {'pickle':>15} {'wire':>15} {'pickle/wire':>12}"
    print(head + "\n" + " " * 45 + "dumps / loads us  dumps / loads us   dumps / loads")
    for name, obj in cases.items():
        std = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
        ours = pack(obj)
        # Alternating, so a slower moment of the machine falls on both sides alike.
        times = {"pd": [], "pl": [], "wd": [], "wl": []}
        for _ in range(5):
            n = max(args.iters // 5, 1)
            times["pd"].append(
                _median_us(lambda o=obj: pickle.dumps(o, protocol=pickle.HIGHEST_PROTOCOL), n)
            )
            times["wd"].append(_median_us(lambda o=obj: pack(o), n))
            times["pl"].append(_median_us(lambda d=std: pickle.loads(d), n))
            times["wl"].append(_median_us(lambda d=ours: unpack(d), n))
        pd, pl, wd, wl = (statistics.median(times[k]) for k in ("pd", "pl", "wd", "wl"))
        print(
            f"{name:<36} {len(ours):>8} {pd:>7.1f} / {pl:<6.1f} {wd:>7.1f} / {wl:<6.1f}"
            f" {pd / wd:>6.2f}x / {pl / wl:.2f}x"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
