"""LaneWorker: one lane's model weights, its collective group and its step loop.

The lane actor holds a worker beside its shard. A step (one Ray call per lane,
all lanes in parallel) carries the same :class:`cpkv.core.steps.StepRequest` to every
lane; each derives its share with :class:`StepPlan`, runs every layer for its own
tokens, writes their K/V into its shard in place and attends through
:class:`CPAttention`, exchanging with the other lanes over torch.distributed,
never through the driver, and answers a :class:`cpkv.core.steps.StepResult`.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import numpy as np
import torch

from cpkv.core.steps import StepRequest, StepResult
from cpkv.lanes.attention import CPAttention
from cpkv.lanes.clock import StreamClock
from cpkv.lanes.comm import LaneGroup, free_port
from cpkv.lanes.decode_graph import DecodeGraphs
from cpkv.lanes.shard import LaneShard
from cpkv.lanes.step import StepPlan

__all__ = ["LaneGroupError", "LaneWorker"]

logger = logging.getLogger("cpkv.worker")

# Seconds between a device error and this process's exit: long enough for the failed
# step's error to reach its callers, short enough that no later step runs on the
# broken context (the lane runs one call at a time).
_EXIT_DELAY_S = 0.5
# What a device error leaves behind, never freed (see LaneWorker.step).
_KEPT_UNTIL_EXIT: list = []


def _is_device_error(e: BaseException) -> bool:
    """A CUDA error (a device-side assert, an illegal address): the context is unusable."""
    accel = getattr(torch, "AcceleratorError", None)
    if accel is not None and isinstance(e, accel):
        return True
    return isinstance(e, RuntimeError) and "CUDA error" in str(e)


def _exit_soon(lane: int, e: BaseException) -> None:
    """End this process shortly: Ray restarts the lane, the coordinator resets it."""
    import os
    import threading

    logger.error("lane %d: device error, restarting the process: %s", lane, e)
    threading.Timer(_EXIT_DELAY_S, os._exit, (70,)).start()


class LaneGroupError(RuntimeError):
    """The step expects a lane group this lane does not have (it is being rebuilt)."""


class LaneWorker:
    """Weights, group and step loop of one lane.

    Args:
        lane: this lane's CP rank.
        cp_size: number of lanes.
        device: where the weights and the shard live.
        model: the lane's model (a :class:`cpkv.models.LlamaModel`), or ``None`` for a
            pool that only stores K/V (probe steps still run).
        decode_graphs: run a cp=1 lane's decode steps through
            :class:`~cpkv.lanes.decode_graph.DecodeGraphs` (recorded CUDA graphs on a GPU);
            ``False`` keeps them on the general eager path (the benchmarks' ablation).
    """

    def __init__(
        self,
        lane: int,
        cp_size: int,
        device: torch.device,
        model: Any = None,
        *,
        decode_graphs: bool = True,
    ) -> None:
        self.lane = lane
        self.cp_size = cp_size
        self.device = device
        self.model = model
        self.group: LaneGroup | None = None
        self.group_id: str | None = None
        self._last_step = -1
        self._attention_clock = StreamClock()
        # Decode steps of a cp=1 lane run through recorded graphs (CUDA) or the same static-
        # buffer step eagerly (CPU); cp > 1 decode exchanges between lanes and runs eagerly.
        self._use_decode_graphs = decode_graphs and cp_size == 1 and model is not None
        self._decode_graphs: DecodeGraphs | None = None

    def drop_decode_graphs(self) -> None:
        """Forget the decode graphs (and the shard tensors they hold): the shard is replaced."""
        self._decode_graphs = None

    # ------------------------------------------------------------------ group
    def rendezvous_address(self) -> tuple[str, int]:
        """``(host, port)`` where this lane, as rank 0, can serve a new group's rendezvous."""
        import ray

        host = ray.util.get_node_ip_address() if ray.is_initialized() else "127.0.0.1"
        return host, free_port(host)

    def init_group(
        self, group_id: str, host: str, port: int, backend: str, timeout_s: float
    ) -> str:
        """Leave the old group, join ``group_id`` (blocks until every lane joined)."""
        self.destroy_group()
        self.group = LaneGroup.create(
            self.lane,
            self.cp_size,
            host,
            port,
            backend,
            timeout_s,
            device=self.device if backend in ("nccl", "cuda_ipc") else None,
        )
        self.group_id = group_id
        self._last_step = -1
        return group_id

    def destroy_group(self) -> None:
        if self.group is not None:
            self.group.destroy()
            if self.group.device_stuck:
                # NOTE: a CUDA IPC wait on a lane that died with its write queued never ends
                # (measured on the H200, docs/gpu-run/ipc): this process's stream is stuck for
                # good, so it exits (Ray restarts the lane; the coordinator resets it) 0.5 s
                # later, once the failed step's error has gone out.
                import os
                import threading

                logger.error("lane %d: stream stuck on a dead lane's event: restarting", self.lane)
                threading.Timer(0.5, os._exit, (71,)).start()
        self.group, self.group_id = None, None

    def leave_group(self) -> None:
        """Leave the group after a step failed here, or could not start (its page moves were
        refused): peers blocked in a collective with this lane fail now ("connection
        closed") instead of at the group's timeout, and every lane then refuses steps of
        this group until the coordinator builds a new one."""
        try:
            self.destroy_group()
        except Exception:
            logger.exception("lane %d: leaving the lane group failed", self.lane)
            self.group, self.group_id = None, None

    # ------------------------------------------------------------------- step
    def step(self, shard: LaneShard, step: StepRequest) -> StepResult:
        """Run one step on this lane; a collective over the lane group.

        Returns:
            This lane's :class:`StepResult`: the logits of the sequences whose last new
            token it computed (probe steps: the attention outputs of its tokens), and its
            timings.

        Raises:
            LaneGroupError: the step was made for another group.
        """
        if self.group is None or step.group != self.group_id:
            raise LaneGroupError(
                f"lane {self.lane}: step {step.step_id} expects group {step.group!r}, "
                f"lane has {self.group_id!r}"
            )
        try:
            # NOTE: steps reach every lane in one order (one sender submits them), so a step
            # older than the last one run means a reordering bug, not a retry; it fails here,
            # leaving the group, so the peers fail at once instead of at the group's timeout.
            assert step.step_id > self._last_step, (step.step_id, self._last_step)
            self._last_step = step.step_id
            return self._run(shard, step)
        except BaseException as e:
            device = _is_device_error(e)
            logger.warning(
                "lane %d: step %d failed (%s): leaving the lane group",
                self.lane,
                step.step_id,
                type(e).__name__,
            )
            if device:
                # The CUDA context is unusable (a device-side assert): touch nothing on it;
                # the process exits, which its peers see as a lane that left.
                # NOTE: nothing that maps a peer's memory may be freed on a broken context:
                # its deleter calls CUDA, which throws inside a destructor and aborts the
                # process before the step's error goes out (seen on the H200). The group
                # and the failed frames are kept until the exit.
                _KEPT_UNTIL_EXIT.append((self.group, e, e.__traceback__))
                self.group, self.group_id = None, None
                _exit_soon(self.lane, e)
                raise RuntimeError(f"lane {self.lane}: CUDA error in step: {e}") from None
            self.leave_group()
            raise

    def _run(self, shard: LaneShard, step: StepRequest) -> StepResult:
        self.group.take_wait_seconds()  # drop what measure() or an earlier failure left
        self._attention_clock.take()
        t0 = time.perf_counter()
        if self._use_decode_graphs and step.probe is None and DecodeGraphs.accepts(step.sequences):
            return self._graph_decode(shard, step, t0)
        plan = StepPlan.build(step.sequences, self.cp_size, shard.page_size, self.lane)
        attn = CPAttention(self.group, plan, step.mode)
        logits, next_tokens, out, tokens, logits_dtype = {}, {}, None, None, "float32"
        if attn.idle:
            # Another lane holds every page of this step (a short prompt, say) and runs it
            # alone: no token here, nothing to exchange, so no layer (nor probe copy) either.
            attn.skip()
            if step.probe is not None:
                out, tokens = torch.empty((0, *step.probe[0].shape[1:])), plan.my_tokens
        elif step.probe is not None:
            out = self._probe(shard, plan, attn, step.probe, step.probe_rows)
            tokens = plan.my_tokens
        else:
            logits, next_tokens, logits_dtype = self._forward(shard, plan, attn, step)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return StepResult(
            num_tokens=int(plan.num_mine),
            compute_s=time.perf_counter() - t0,
            wait_s=self.group.take_wait_seconds(),
            attention_s=self._attention_clock.take(),
            mode=attn.last_mode,
            exchange_bytes=int(attn.total_exchange_bytes),
            logits=logits,
            out=out,
            tokens=tokens,
            next_tokens=next_tokens,
            logits_dtype=logits_dtype,
        )

    def _graph_decode(self, shard: LaneShard, step: StepRequest, t0: float) -> StepResult:
        """A cp=1 decode step through the recorded graph of its batch bucket."""
        graphs = self._decode_graphs
        if graphs is None or graphs.k_cache[0] is not shard.k[0]:
            # NOTE: graphs write the shard's tensors in place; a re-sized shard needs new ones.
            self._decode_graphs = graphs = DecodeGraphs(
                self.model, shard.k, shard.v, capture=self.device.type == "cuda"
            )
        logits, ids = graphs.run(step.sequences, sample=step.sample)
        n = len(step.sequences)
        rows, dtype = (None, "float32") if logits is None else host_logits(logits, self.model.dtype)
        return StepResult(
            num_tokens=n,
            compute_s=time.perf_counter() - t0,
            wait_s=0.0,
            attention_s=0.0,
            mode="pass_q",
            exchange_bytes=0,
            logits={} if rows is None else {b: rows[b] for b in range(n)},
            next_tokens={b: int(ids[b]) for b in range(n)} if step.sample else {},
            graph=graphs.capture,
            logits_dtype=dtype,
        )

    def _probe(
        self, shard: LaneShard, plan: StepPlan, attn: CPAttention, probe, rows: np.ndarray
    ) -> torch.Tensor:
        dev, dtype = self.device, shard.k[0].dtype
        # Copy once, then pick this lane's rows on the device (host indexing of a 32k-token
        # probe costs more than the attention).
        q, k, v = (t.to(dev, non_blocking=True) for t in probe)
        mine = torch.from_numpy(rows[plan.my_tokens]).to(dev)
        q, k, v = (t[mine].to(dtype) for t in (q, k, v))  # the shard's dtype, as a model's
        with self._attention_clock.timed(dev):
            o = attn.forward(shard.k[0], shard.v[0], q, k, v, q.shape[-1] ** -0.5)
        return o.float().cpu()

    def _forward(
        self, shard: LaneShard, plan: StepPlan, attn: CPAttention, step: StepRequest
    ) -> tuple[dict[int, np.ndarray], dict[int, int], str]:
        """Every layer for this lane's tokens; ``(logits, next_tokens, logits_dtype)`` of the
        sequences whose last new token it computed: rows as :func:`host_logits` makes them,
        or for a sampling step only their argmax (taken on the device, so no logits cross to
        the host)."""
        model = self.model
        if model is None:
            raise ValueError("this pool has no model: connect(..., model=...) to prefill")
        dev = self.device
        ids = step.token_ids
        mine = np.ascontiguousarray(plan.my_tokens)
        tokens = torch.from_numpy(ids[mine]).to(dev)
        positions = torch.from_numpy(np.array(plan.my_positions, dtype=np.int64)).to(dev)
        hidden = model.embed(tokens)
        for layer in range(model.config.num_layers):
            q, k, v = model.attention_inputs(layer, hidden, positions)
            with self._attention_clock.timed(dev):
                o = attn.forward(shard.k[layer], shard.v[layer], q, k, v, model.sm_scale)
            hidden = model.finish_layer(layer, hidden, o)
        last = [b for b in range(plan.num_requests) if int(plan.last_token_owner[b]) == self.lane]
        if not last:
            return {}, {}, "float32"
        rows = torch.as_tensor([int(plan.last_token_index[b]) for b in last], device=dev)
        logits = model.logits(hidden[rows])
        if step.sample:
            ids = logits.argmax(dim=-1).tolist()
            return {}, {b: ids[i] for i, b in enumerate(last)}, "float32"
        rows_np, dtype = host_logits(logits, model.dtype)
        return {b: rows_np[i] for i, b in enumerate(last)}, {}, dtype


def host_logits(logits: torch.Tensor, model_dtype: torch.dtype) -> tuple[np.ndarray, str]:
    """Logits rows copied to the host in the dtype the model computed them in.

    Args:
        logits: fp32 ``[B, vocab]`` on the lane's device, cast up from ``model_dtype``.
        model_dtype: the model's dtype.

    Returns:
        ``(rows, dtype)`` for :class:`StepResult` (``logits`` and ``logits_dtype``): fp16 and
        bf16 rows hold the same values in half the bytes (bf16 as its ``uint16`` bits).
    """
    if model_dtype == torch.bfloat16:
        bits = logits.to(torch.bfloat16).view(torch.int16).cpu().numpy()
        return bits.view(np.uint16), "bfloat16"
    if model_dtype == torch.float16:
        return logits.to(torch.float16).cpu().numpy(), "float16"
    return logits.float().cpu().numpy(), "float32"
