"""StreamClock: the time a lane's device spends in chosen sections, without host syncs."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager

import torch

__all__ = ["StreamClock"]


class StreamClock:
    """Adds up the time spent in the sections it times.

    On a CUDA device it times the current stream with events (no host sync; read once the step
    has synchronised): from what came before a section to what comes after it, so a collective
    counts as the stream's idle time whatever the backend (NCCL's stream dependency, or gloo's
    copies through the host), and a kernel as its run time. On the CPU, wall time.
    """

    __slots__ = ("_events", "_host_s", "_spare")

    def __init__(self) -> None:
        self._host_s = 0.0
        self._events: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
        # Pairs read by take(), recorded again by later sections: a step times two sections a
        # layer, and a CUDA event's create and destroy (one each a section otherwise, the
        # destroys after the step's compute time, on its answer's path) cost host time.
        self._spare: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []

    @contextmanager
    def timed(self, device: torch.device) -> Iterator[None]:
        """Time the enclosed work on ``device``."""
        if device.type != "cuda":
            t0 = time.perf_counter()
            yield
            self._host_s += time.perf_counter() - t0
            return
        if self._spare:
            start, end = self._spare.pop()
        else:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        yield
        end.record()
        self._events.append((start, end))

    def take(self) -> float:
        """Seconds timed since the last call (waits for the recorded events), then reset."""
        total = self._host_s
        for start, end in self._events:
            end.synchronize()
            total += start.elapsed_time(end) / 1e3
        self._spare.extend(self._events)
        self._host_s, self._events = 0.0, []
        return total
