"""LaneActor: one CP rank's shard served as a Ray actor (one per GPU, or a fraction)."""

from __future__ import annotations

import os

import numpy as np
import ray

from cpkv.config import KVShape
from cpkv.lanes.shard import LaneShard


@ray.remote(max_restarts=-1, max_task_retries=0)
class LaneActor:
    """Delegates to :class:`cpkv.lanes.LaneShard`; a restart brings an empty shard."""

    def __init__(
        self, lane: int, num_pages: int, page_size: int, kv: KVShape, device: str | None = None
    ) -> None:
        import torch

        if device is None:
            # Ray sets CUDA_VISIBLE_DEVICES to this actor's GPUs; logical GPUs on a
            # machine without CUDA leave torch on the CPU.
            device = "cuda" if torch.cuda.is_available() and ray.get_gpu_ids() else "cpu"
        self._shard = LaneShard(lane, num_pages, page_size, kv, device)

    def apply(self, generation: str, seq: int, taken: np.ndarray, released: np.ndarray) -> int:
        return self._shard.apply(generation, seq, taken, released)

    def reset(self, generation: str) -> str:
        return self._shard.reset(generation)

    def heartbeat(self) -> tuple[str, int]:
        """``(incarnation, pages held)``; ordered after every earlier coordinator call."""
        return self._shard.incarnation, self._shard.num_held_pages

    def store_kv(self, local_slots, k, v, layer: int = 0) -> int:
        return self._shard.store_kv(local_slots, k, v, layer)

    def gather_kv(self, local_slots, layer: int = 0):
        return self._shard.gather_kv(local_slots, layer)

    def ping(self) -> None:
        """A no-op round trip (the benchmark's baseline)."""

    def info(self) -> dict:
        ctx = ray.get_runtime_context()
        return {
            **self._shard.counts(),
            "node_id": ctx.get_node_id(),
            "pid": os.getpid(),
            "device": str(self._shard.device),
            "gpu_ids": [str(g) for g in ray.get_gpu_ids()],
            "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES", ""),
        }
