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
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING

import ray

from cpkv.actors.malloc import fix_malloc_thresholds
from cpkv.actors.wire import pack, unpack
from cpkv.core.config import KVShape
from cpkv.core.moves import MovesNotApplied
from cpkv.core.steps import LaneReply, StepPacket, StepRequest, StepResult, superseded

if TYPE_CHECKING:
    from cpkv.lanes.shard import LaneShard

__all__ = ["CompiledLaneActor", "LaneActor"]

# Memory kept free beside the KV pool for activations and the allocator's slack, when the
# pool is sized from free memory (a 128k-token prefill step of a 1B model needs ~2 GiB).
_ACTIVATION_RESERVE_BYTES = 4 << 30

# How long a compiled step waits for the moves its fence names (sent as ordinary calls, they
# may arrive after it); they take milliseconds, so this only bounds a lost move.
_FENCE_WAIT_S = float(os.environ.get("CPKV_FENCE_WAIT_S", "20"))

# The concurrency groups of a lane that serves compiled steps. Ray runs a compiled graph's
# loop in the ``_ray_system`` group, one thread by default; the loop of a graph whose
# coordinator died never ends, and would keep a restarted coordinator's graph from ever
# starting (seen: its first run hung). Measured on the 2-core machine: with three threads, a
# restarted coordinator's graph ran in 0.8 s, and 2000 calls of one caller of mixed sizes
# still ran in order (the moves' sequence numbers depend on that).
_COMPILED_CONCURRENCY_GROUPS = {"_ray_system": 3}


class _Lane:
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
        fix_malloc_thresholds()  # before the actor allocates its step buffers
        import torch

        from cpkv.lanes.worker import LaneWorker

        if device is None:
            # Ray sets CUDA_VISIBLE_DEVICES to this actor's GPUs; logical GPUs on a
            # machine without CUDA leave torch on the CPU.
            device = "cuda" if torch.cuda.is_available() and ray.get_gpu_ids() else "cpu"
        self._lane, self._page_size, self._kv = lane, page_size, kv
        # NOTE: a compiled step runs on Ray's graph thread, beside this actor's own: one
        # lock orders them (the shard and the worker see one call at a time, as before), and
        # its condition wakes a step waiting for its fence when a move is applied.
        self._turn = threading.Condition()
        self._graph_epoch: str | None = None
        self._device = torch.device(device)
        self._shard: LaneShard | None = None
        if num_pages:
            self._shard = self._new_shard(num_pages)
        loaded = model.load(self._device) if model is not None else None
        self._worker = LaneWorker(lane, cp_size, self._device, loaded)

    # ---------------------------------------------------------------- pages
    def apply_moves(self, moves: tuple[tuple, ...]) -> int:
        """Apply page moves in order (see :meth:`LaneShard.apply_moves`)."""
        with self._turn:
            try:
                return self._shard.apply_moves(moves)
            finally:
                self._turn.notify_all()

    def reset(self, generation: str, num_pages: int | None = None) -> str:
        """Empty the shard (allocating it at ``num_pages`` first if it has another size)."""
        with self._turn:
            try:
                return self._reset(generation, num_pages)
            finally:
                self._turn.notify_all()

    def _reset(self, generation: str, num_pages: int | None) -> str:
        if num_pages is not None and (self._shard is None or self._shard.num_pages != num_pages):
            self._worker.drop_decode_graphs()  # they hold the old shard's tensors
            self._shard = None  # free the old tensors before taking new ones
            self._shard = self._new_shard(num_pages)
        return self._shard.reset(generation)

    def _new_shard(self, num_pages: int) -> LaneShard:
        from cpkv.lanes.shard import LaneShard

        return LaneShard(self._lane, num_pages, self._page_size, self._kv, self._device)

    def heartbeat(self, fence: tuple[str, int] | None = None) -> tuple[str | None, int | None]:
        """``(incarnation, pages held)``; ordered after every earlier coordinator call. The
        count is ``None`` while a move through ``fence`` (``(generation, seq)``) is still to
        come (one riding in a compiled step, which does not travel behind this call).

        NOTE: the count is the one right after the fence's move, which is what the
        coordinator's mirror held when it sent this: moves decided later may have come first,
        riding in a compiled step (a lane counting them too was taken for a divergence)."""
        with self._turn:
            shard = self._shard
            if shard is None:  # restarted, not yet reset (sized from memory): a new lane
                return None, None
            if fence is None or self._never_applied(fence):
                return shard.incarnation, shard.num_held_pages
            if not self._applied(fence)():
                return shard.incarnation, None
            return shard.incarnation, shard.num_held_at(fence[1])

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
        with self._turn:
            return self._shard.store_kv(local_slots, k, v, layer, owner, fence)

    def gather_kv(self, local_slots, layer: int = 0, owner=None, fence=None):
        with self._turn:
            return self._shard.gather_kv(local_slots, layer, owner, fence)

    # ----------------------------------------------------------------- steps
    def rendezvous_address(self) -> tuple[str, int]:
        return self._worker.rendezvous_address()

    def init_group(self, group_id: str, host: str, port: int, backend: str, timeout_s: float):
        with self._turn:
            try:
                return self._worker.init_group(group_id, host, port, backend, timeout_s)
            finally:
                self._turn.notify_all()

    @ray.method(num_returns=2)
    def step(self, step: StepRequest, moves: tuple | None = None) -> tuple[dict, StepResult]:
        """``(status, result)``: the coordinator reads the small status (did the step write
        its K/V?), the client the result. A step that fails raises through both. ``moves``:
        the page moves that rode with the step (each ``apply``'s arguments), applied first;
        one the shard refuses raises :class:`~cpkv.core.moves.MovesNotApplied` and the step does not
        run."""
        with self._turn:
            return self._step(step, moves)

    def compiled_step(self, packet: StepPacket) -> LaneReply | None:
        """:meth:`step` as a compiled graph runs it: the packet holds every lane's move and
        fence; the answer is this lane's ``(status, result)`` or its error, as a value (an
        exception would end the graph's run for every lane). It first waits until the moves
        before its fence, sent as ordinary calls, are applied here."""
        if packet.step is None:  # a warm-up: whose graph this lane serves
            self._graph_epoch = packet.epoch
            return None
        # NOTE: ``packet`` must own its arrays (see compiled_step_packed): nothing the lane
        # keeps may pin a graph's shared buffer (the coordinator could not send an eleventh
        # step).
        try:
            with self._turn:
                self._wait_for_fence(packet.fences[self._lane], packet.step.group)
                return LaneReply(self._step(packet.step, packet.moves[self._lane]))
        except BaseException as e:
            return LaneReply(error=e)

    def compiled_step_packed(self, data: bytes) -> bytes:
        """:meth:`compiled_step` as the lanes' graph runs it: the packet and the answer packed
        (:mod:`cpkv.actors.wire`; one pickle each way instead of Ray's, and an unpacked
        packet owns its arrays)."""
        reply = self.compiled_step(unpack(data))
        try:
            out = pack(reply)
            if reply is not None and reply.error is not None:
                # NOTE: an error that pickles but cannot be rebuilt (an __init__ of other
                # arguments than it passes on) would fail the reader: the graph's, whole.
                unpack(out)
            return out
        except Exception as e:  # an error value that will not travel: say so instead
            bad = None if reply is None else reply.error
            what = "answer" if bad is None else f"{type(bad).__name__}: {bad}"
            error = RuntimeError(f"lane {self._lane}: {what} (unpicklable: {e})")
            return pack(LaneReply(error=error))

    def _applied(self, fence: tuple[str, int]) -> Callable[[], bool]:
        """Whether the shard has applied every move through ``fence``."""
        generation, seq = fence

        def applied() -> bool:
            shard = self._shard
            return shard is not None and shard.generation == generation and shard.last_seq >= seq

        return applied

    def _never_applied(self, fence: tuple[str, int]) -> bool:
        """Whether the moves of ``fence`` can no longer come: the shard is in a generation
        that is neither the fence's nor an earlier one of its coordinator (whose reset to the
        fence's may still be on its way)."""
        shard = self._shard
        at = None if shard is None else shard.generation
        return at is not None and at != fence[0] and not superseded(at, fence[0])

    def _wait_for_fence(self, fence: tuple[str, int], group: str) -> None:
        """Wait until the moves through ``fence`` are applied and the lane has joined
        ``group`` (its ``init_group`` call, too, may come after the step), or neither can
        happen: the shard is in another coordinator's generation, or a later group replaced
        the step's (it then fails as a stale step)."""
        generation, seq = fence
        applied = self._applied(fence)
        worker = self._worker

        def ready() -> bool:
            if self._never_applied(fence):
                return True
            joined = worker.group_id == group or superseded(group, worker.group_id)
            return joined and applied()

        if not self._turn.wait_for(ready, _FENCE_WAIT_S) or not applied():
            self._leave_step_group(group)
            at = None if self._shard is None else (self._shard.generation, self._shard.last_seq)
            raise MovesNotApplied(
                f"lane {self._lane}: moves through {seq} of {generation!r} and group {group!r} "
                f"not here (waited up to {_FENCE_WAIT_S}s; the shard is at {at}, the lane in "
                f"group {worker.group_id!r})"
            )

    def _leave_step_group(self, group: str) -> None:
        """A step of ``group`` will not run here: leave the group, so its peers do not wait
        for this lane in its collectives. NOTE: only the step's own group: a stale step (a
        reset, or another coordinator, moved the lane to a later group since) leaves the
        lane's current group alone."""
        if self._worker.group_id == group:
            self._worker.leave_group()

    def _step(self, step: StepRequest, moves: tuple | None) -> tuple[dict, StepResult]:
        if moves is not None:
            try:
                if self._shard is None:  # restarted without a size: never reset since
                    raise MovesNotApplied(f"lane {self._lane} has no shard")
                self._shard.apply_riding(moves)
            except MovesNotApplied:
                # NOTE: the step will not run here: its peers must not wait in its collectives,
                # nor pair this lane's next step with this one.
                self._leave_step_group(step.group)
                raise
            finally:
                self._turn.notify_all()
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
            "graph_epoch": self._graph_epoch,
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


LaneActor = ray.remote(max_restarts=-1, max_task_retries=0)(_Lane)
#: The same lane for a pool whose steps come through a compiled graph.
CompiledLaneActor = ray.remote(
    max_restarts=-1, max_task_retries=0, concurrency_groups=_COMPILED_CONCURRENCY_GROUPS
)(_Lane)
