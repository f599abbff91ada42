"""LaneActor: one CP rank served as a Ray actor (one per GPU, or a fraction).

A thin shell: the shard (:class:`cpkv.lanes.LaneShard`: KV memory and page
record) and the worker (:class:`cpkv.lanes.worker.LaneWorker`: weights, lane
group, step loop) hold the logic. A restart brings an empty shard and a worker
without a group; the coordinator resets the shard and rebuilds the group.

NOTE: torch (and the lanes' modules, which import it) is imported in the actor's methods
only: the coordinator's process imports this package and must stay without torch.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

import numpy as np
import ray

from cpkv.core.config import KVShape
from cpkv.core.moves import MovesNotApplied
from cpkv.core.steps import StepRequest, StepResult

if TYPE_CHECKING:
    from cpkv.lanes.shard import LaneShard

__all__ = ["LaneActor"]

# Memory kept free beside the KV pool for activations and the allocator's slack, when the
# pool is sized from free memory (a 128k-token prefill step of a 1B model needs ~2 GiB).
_ACTIVATION_RESERVE_BYTES = 4 << 30


@ray.remote(max_restarts=-1, max_task_retries=0)
class LaneActor:
    """Delegates to a :class:`LaneShard` and a :class:`LaneWorker`.

    Args:
        lane: this lane's CP rank.
        cp_size: number of lanes.
        num_pages: pages in the shard, or ``None`` when the pool is sized later from
            free memory (:meth:`kv_capacity`, then :meth:`reset` with the size).
        page_size: tokens per page.
        kv: the K/V tensors' layers, heads, head_dim and dtype.
        model: a :class:`cpkv.models.spec.ModelSpec` to load on this lane's device.
        device: override the device (default: the GPU Ray gave this actor, else CPU).
    """

    def __init__(
        self,
        lane: int,
        cp_size: int,
        num_pages: int | None,
        page_size: int,
        kv: KVShape,
        model=None,
        device: str | None = None,
    ) -> None:
        import torch

        from cpkv.lanes.worker import LaneWorker

        if device is None:
            # Ray sets CUDA_VISIBLE_DEVICES to this actor's GPUs; logical GPUs on a
            # machine without CUDA leave torch on the CPU.
            device = "cuda" if torch.cuda.is_available() and ray.get_gpu_ids() else "cpu"
        self._lane, self._page_size, self._kv = lane, page_size, kv
        self._device = torch.device(device)
        self._shard: LaneShard | None = None
        if num_pages:
            self._shard = self._new_shard(num_pages)
        loaded = model.load(self._device) if model is not None else None
        self._worker = LaneWorker(lane, cp_size, self._device, loaded)

    # ---------------------------------------------------------------- pages
    def apply(
        self,
        generation: str,
        seq: int,
        taken: np.ndarray,
        released: np.ndarray,
        owner: int = 0,
        cached: np.ndarray | None = None,
    ) -> int:
        return self._shard.apply(generation, seq, taken, released, owner, cached)

    def reset(self, generation: str, num_pages: int | None = None) -> str:
        """Empty the shard (allocating it at ``num_pages`` first if it has another size)."""
        if num_pages is not None and (self._shard is None or self._shard.num_pages != num_pages):
            self._worker.drop_decode_graphs()  # they hold the old shard's tensors
            self._shard = None  # free the old tensors before taking new ones
            self._shard = self._new_shard(num_pages)
        return self._shard.reset(generation)

    def _new_shard(self, num_pages: int) -> LaneShard:
        from cpkv.lanes.shard import LaneShard

        return LaneShard(self._lane, num_pages, self._page_size, self._kv, self._device)

    def heartbeat(self) -> tuple[str, int]:
        """``(incarnation, pages held)``; ordered after every earlier coordinator call."""
        return self._shard.incarnation, self._shard.num_held_pages

    def kv_capacity(self, memory_utilization: float, share: float = 1.0) -> int:
        """Pages this lane can hold: its ``share`` of ``memory_utilization`` of its device's
        memory left after what is in use (the weights), less an activation reserve (free
        host memory for a CPU lane). Lanes packed on one GPU each pass their fraction."""
        import torch

        kv = self._kv
        itemsize = torch.empty(0, dtype=getattr(torch, kv.dtype)).element_size()
        page_bytes = 2 * kv.num_layers * self._page_size * kv.num_heads * kv.head_dim * itemsize
        if self._device.type == "cuda":
            free, total = torch.cuda.mem_get_info(self._device)
            budget = (total * memory_utilization - (total - free)) * share
        else:
            budget = _available_host_memory() * memory_utilization * share
        return max(0, int((budget - _ACTIVATION_RESERVE_BYTES * share) // page_bytes))

    # ------------------------------------------------------------------ K/V
    def store_kv(self, local_slots, k, v, layer: int = 0, owner=None, fence=None):
        return self._shard.store_kv(local_slots, k, v, layer, owner, fence)

    def gather_kv(self, local_slots, layer: int = 0, owner=None, fence=None):
        return self._shard.gather_kv(local_slots, layer, owner, fence)

    # ----------------------------------------------------------------- steps
    def rendezvous_address(self) -> tuple[str, int]:
        return self._worker.rendezvous_address()

    def init_group(self, group_id: str, host: str, port: int, backend: str, timeout_s: float):
        return self._worker.init_group(group_id, host, port, backend, timeout_s)

    @ray.method(num_returns=2)
    def step(self, step: StepRequest, moves: tuple | None = None) -> tuple[dict, StepResult]:
        """``(status, result)``: the coordinator reads the small status (did the step write
        its K/V?), the client the result. A step that fails raises through both. ``moves``:
        the page move that rode with the step (``apply``'s arguments), applied first; one the
        shard refuses raises :class:`~cpkv.core.moves.MovesNotApplied` and the step does not
        run."""
        if moves is not None:
            try:
                if self._shard is None:  # restarted without a size: never reset since
                    raise MovesNotApplied(f"lane {self._lane} has no shard")
                self._shard.apply_riding(moves)
            except MovesNotApplied:
                # NOTE: the step will not run here: its peers must not wait in its collectives,
                # nor pair this lane's next step with this one.
                self._worker.leave_group()
                raise
        out = self._worker.step(self._shard, step)
        return {"step_id": step.step_id, "lane": self._lane}, out

    # ---------------------------------------------------------------- status
    def ping(self) -> None:
        """A no-op round trip (the benchmark's baseline)."""

    def info(self) -> dict:
        ctx = ray.get_runtime_context()
        counts = self._shard.counts() if self._shard is not None else {"lane": self._lane}
        return {
            **counts,
            "node_id": ctx.get_node_id(),
            "pid": os.getpid(),
            "device": str(self._device),
            "gpu_ids": [str(g) for g in ray.get_gpu_ids()],
            "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES", ""),
            "group": self._worker.group_id,
            "has_model": self._worker.model is not None,
        }


def _available_host_memory() -> int:
    """``MemAvailable`` of this machine in bytes (Linux), else a conservative 1 GiB."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 1 << 30
