"""StreamClock: the lanes' section timer (attention time, time in collectives)."""

from __future__ import annotations

import time

import pytest
import torch

from cpkv.lanes.clock import StreamClock


def test_host_sections_add_up_and_take_resets() -> None:
    clock = StreamClock()
    for _ in range(3):
        with clock.timed(torch.device("cpu")):
            time.sleep(0.02)
    assert 0.06 <= clock.take() < 1.0
    assert clock.take() == 0.0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_sections_time_the_stream_and_reuse_their_events() -> None:
    dev = torch.device("cuda")
    clock = StreamClock()
    cycles = 20_000_000  # ~10 ms of GPU time on current GPUs
    torch.cuda._sleep(cycles)  # the first launch pays for warm-up
    outer = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    rounds = []
    for _ in range(2):
        outer[0].record()
        for _ in range(4):  # back to back: the sections fill the outer span
            with clock.timed(dev):
                torch.cuda._sleep(cycles)
        outer[1].record()
        outer[1].synchronize()
        span = outer[0].elapsed_time(outer[1]) / 1e3
        rounds.append({id(e) for pair in clock._events for e in pair})
        assert clock.take() == pytest.approx(span, rel=0.05)
    # Four pairs, created once: the second round recorded the first round's events again.
    assert len(rounds[0]) == 8 and rounds[1] == rounds[0]
    assert clock.take() == 0.0
