"""A step's decision in the coordinator, in process: no Ray, lanes that answer at once.

Drives :class:`cpkv.coordinator.Coordinator` with a compiled-style transport whose lanes
answer every step before it returns, so the time is the coordinator's own: the call's
bookkeeping (call ids, leases, remembered replies), the allocation, the step's sequences
and packet, and the hand-back of the lanes' answers. Past the coordinator's remembered
calls (1024), as a long-running client is; the prefill and its free are timed apart, beside
the allocator alone (:class:`cpkv.CPAllocator`'s ``allocate_extend`` and ``free`` of the
same prompt), the decision core the coordinator wraps.

    python benchmarks/bench_decision.py [--cp 1,4] [--tokens 16] [--iters 3000] [--greedy 1]
"""

from __future__ import annotations

import argparse
import statistics
import time
from concurrent.futures import Future
from typing import Any

import numpy as np

from cpkv import CPAllocator
from cpkv.coordinator.coordinator import Coordinator
from cpkv.core.config import CPConfig, KVShape
from cpkv.core.steps import LaneReply, StepPacket, StepResult

_VOCAB = 128256  # the 1B's: the remembered replies count a logits row a step


class _InstantLanes:
    """Every lane call answers at once; a step's answer is each lane's ``(status, result)``."""

    _ANSWERS = {"info": {"device": "cpu"}, "rendezvous_address": ("127.0.0.1", 0)}

    def submit(self, lane: int, method: str, *args: Any) -> Future:
        future: Future = Future()
        future.set_result(self._ANSWERS.get(method))
        return future

    def result(self, handle: Future, timeout: float) -> Any:
        return handle.result(timeout=timeout)

    def done(self, handles: list[Future]) -> list[bool]:
        return [h.done() for h in handles]

    def execute_steps(self, packet: StepPacket) -> Future:
        result = StepResult(16, 0.0, 0.0, 0.0, "pass_q", 0)
        future: Future = Future()
        future.set_result([LaneReply(({"ok": True}, result)) for _ in packet.fences])
        return future


def _point(cp: int, tokens: int, iters: int, greedy: bool) -> tuple[float, float]:
    coord = Coordinator(
        CPConfig(cp, 64, 256, max_reqs=16, max_context_len=4096),
        KVShape(16, 8, 64),
        _InstantLanes(),
        heartbeat_s=0,
        vocab_size=_VOCAB,
        step_graphs=1,
    )
    prompt = np.random.default_rng(0).integers(0, _VOCAB, size=tokens)
    prefills, frees = [], []
    for rid in range(1200 + iters):  # 1200 untimed: the remembered calls fill up first
        t0 = time.perf_counter()
        out = coord.prefill(coord.epoch, "c", rid, rid, prompt, sample=greedy)
        t1 = time.perf_counter()
        freed = coord.free(coord.epoch, "c", ("free", rid), rid, False)
        t2 = time.perf_counter()
        assert isinstance(out, dict) and not isinstance(freed, Exception), (out, freed)
        if rid >= 1200:
            prefills.append(t1 - t0)
            frees.append(t2 - t1)
    coord.shutdown()
    return statistics.median(prefills), statistics.median(frees)


def _allocator_cycle(cp: int, tokens: int, iters: int) -> float:
    alloc = CPAllocator(cp, 64, num_pages_per_lane=256, max_reqs=16, max_context_len=4096)
    prompt = np.random.default_rng(0).integers(0, _VOCAB, size=tokens)
    times = []
    for i in range(200 + iters):
        t0 = time.perf_counter()
        alloc.allocate_extend(i, prompt)
        alloc.free(i, cache=False)
        if i >= 200:
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--cp", default="1,4", help="comma-separated cp sizes")
    parser.add_argument("--tokens", type=int, default=16)
    parser.add_argument("--iters", type=int, default=3000)
    parser.add_argument("--greedy", type=int, default=1, help="1: sampled steps (ids only)")
    args = parser.parse_args()
    print(f"{args.tokens}-token prefill and its free, medians of {args.iters} (us)")
    print("cp  prefill  free  allocator alone (allocate+free)  coordinator / allocator")
    for cp in (int(c) for c in args.cp.split(",")):
        prefill_s, free_s = _point(cp, args.tokens, args.iters, bool(args.greedy))
        core_s = _allocator_cycle(cp, args.tokens, args.iters)
        ratio = (prefill_s + free_s) / core_s
        us = (prefill_s * 1e6, free_s * 1e6, core_s * 1e6)
        print(f"{cp:>2}  {us[0]:7.1f}  {us[1]:5.1f}  {us[2]:31.1f}  {ratio:22.2f}x")


if __name__ == "__main__":
    main()
