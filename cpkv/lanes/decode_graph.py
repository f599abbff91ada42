"""DecodeGraphs: a cp=1 lane's decode step recorded in CUDA graphs, one per batch bucket.

An eager decode step of a 1B model launches ~50 small kernels a layer, and the host's launch
cost (~15 ms a step on the H200 box) dwarfs the GPU's ~2 ms. Here the whole step (embedding,
every layer with its K/V write and split-key attention, the LM head and greedy sampling) is
recorded once per batch bucket and replayed: the host copies the step's few integers (tokens,
positions, slots, lengths) and the block table into static device buffers, replays, and
copies back the logits or only the sampled ids.

Rows past the step's batch are padding: token 0 at position 0, written to and read from the
reserved local page (:data:`cpkv.core.layout.RESERVED_LOCAL_PAGE`), never a request's page.

On a CPU lane (and with ``capture=False``) the same static-buffer step runs eagerly, which is
what the CPU tests drive.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from cpkv import kernels
from cpkv.core.layout import RESERVED_LOCAL_PAGE
from cpkv.core.steps import StepSequence
from cpkv.kernels.paged_decode import decode_splits, num_sms
from cpkv.lanes.step import check_sequences
from cpkv.models import LlamaModel

__all__ = ["BATCH_BUCKETS", "DecodeGraphs"]

#: Batch sizes a graph is recorded for; a step takes the smallest bucket that holds it.
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32)

# Rows of the static integer buffer.
_TOKENS, _POSITIONS, _SLOTS, _LENS = range(4)


@dataclass(slots=True)
class _Recorded:
    """One bucket's graph (``None``: run eagerly) and its output tensors."""

    graph: torch.cuda.CUDAGraph | None
    logits: torch.Tensor  # fp32 [bucket, vocab]
    next_ids: torch.Tensor  # int64 [bucket]: greedy samples


class DecodeGraphs:
    """Decode steps of one cp=1 lane through recorded graphs.

    Args:
        model: the lane's :class:`cpkv.models.LlamaModel`.
        k_cache, v_cache: the shard's per-layer K and V, ``[P, page_size, Hkv, D]`` each (the
            graphs read and write these tensors in place: a new shard needs new graphs).
        capture: record CUDA graphs (a CUDA device); ``False`` runs the same step eagerly.

    NOTE: one step at a time (the lane runs one call at a time): the static buffers and the
    outputs are shared by every replay.
    """

    def __init__(
        self,
        model: LlamaModel,
        k_cache: Sequence[torch.Tensor],
        v_cache: Sequence[torch.Tensor],
        *,
        capture: bool,
    ) -> None:
        self.model = model
        self.k_cache, self.v_cache = list(k_cache), list(v_cache)
        self.device = self.k_cache[0].device
        self.capture = capture
        self.num_pages, self.page_size = self.k_cache[0].shape[:2]
        max_batch = BATCH_BUCKETS[-1]
        # NOTE: a cp=1 sequence holds at most every page of the shard but the reserved one.
        self._table = torch.zeros(
            (max_batch, self.num_pages), dtype=torch.int32, device=self.device
        )
        self._ints = torch.zeros((4, max_batch), dtype=torch.int64, device=self.device)
        # Host staging, pinned and filled from the front: a step's [4, bucket] and [bucket,
        # width] blocks are contiguous there, so their copies to the device run async.
        pin = self.device.type == "cuda"
        self._host_table = torch.zeros(self._table.numel(), dtype=torch.int32, pin_memory=pin)
        self._host_ints = torch.zeros(self._ints.numel(), dtype=torch.int64, pin_memory=pin)
        self._recorded: dict[int, _Recorded] = {}
        self._pool = None
        hkv, sms = self.k_cache[0].shape[2], num_sms(self.device)
        self._splits = {b: decode_splits(b, hkv, sms) for b in BATCH_BUCKETS}

    @staticmethod
    def accepts(sequences: Sequence[StepSequence]) -> bool:
        """Whether a step of these sequences is a decode step a graph can run (one new token
        each, at most the largest bucket, token ids given)."""
        return 1 <= len(sequences) <= BATCH_BUCKETS[-1] and all(
            s.extend_len == 1 and s.token_ids is not None for s in sequences
        )

    @property
    def num_recorded(self) -> int:
        """Buckets recorded so far (graphs, or eager steps when not capturing)."""
        return len(self._recorded)

    # ------------------------------------------------------------------- step
    def run(
        self, sequences: Sequence[StepSequence], *, sample: bool
    ) -> tuple[np.ndarray | None, np.ndarray]:
        """One decode step of ``sequences`` (see :meth:`accepts`).

        Args:
            sequences: the step's requests, each with one new token, its pages (global ids,
                local at cp=1) covering ``prefix_len + 1`` positions.
            sample: return only the greedy samples (no logits leave the device).

        Returns:
            ``(logits, next_ids)``: fp32 ``[B, vocab]`` on the device (``None`` when
            ``sample``; a view of the graph's output, valid until the next step) and int64
            ``[B]`` greedy next tokens on the host.

        Raises:
            ValueError: not a decode step (see :meth:`accepts`), or pages the step plan would
                refuse (a wrong count, the reserved page, one page twice) or past the shard.
        """
        if not self.accepts(sequences):
            raise ValueError(
                f"a decode graph runs 1 to {BATCH_BUCKETS[-1]} sequences of one new token each, "
                f"with their token ids; got {len(sequences)}"
            )
        pages = check_sequences(sequences, 1, self.page_size)
        if int(pages.max()) >= self.num_pages:
            raise ValueError(
                f"page id {int(pages.max())} is past the shard's {self.num_pages} pages"
            )
        b = len(sequences)
        bucket = next(n for n in BATCH_BUCKETS if n >= b)
        ints, table, width = self._fill(sequences, bucket)
        # NOTE: the host buffers are rewritten only by the next step's _fill, after this
        # step's results were read back (a sync), so the async copies are done by then.
        self._ints[:, :bucket].copy_(ints, non_blocking=True)
        self._table[:bucket, :width].copy_(table, non_blocking=True)
        rec = self._recorded.get(bucket)
        if rec is None:
            rec = self._recorded[bucket] = self._record(bucket)
        elif rec.graph is not None:
            rec.graph.replay()
        else:
            rec.logits, rec.next_ids = self._forward(bucket)
        ids = rec.next_ids[:b].cpu().numpy()
        return (None if sample else rec.logits[:b]), ids

    def _fill(
        self, sequences: Sequence[StepSequence], bucket: int
    ) -> tuple[torch.Tensor, torch.Tensor, int]:
        """Write the step's integers into the front of the pinned host buffers.

        Returns:
            ``(ints [4, bucket], table [bucket, width], width)``: contiguous host views.
        """
        ps = self.page_size
        # NOTE: checked pages: sequence i has exactly prefix_len // ps + 1 of them.
        width = max(s.pages.shape[0] for s in sequences)
        ints_t = self._host_ints[: 4 * bucket].view(4, bucket)
        table_t = self._host_table[: bucket * width].view(bucket, width)
        ints, table = ints_t.numpy(), table_t.numpy()
        ints[:] = 0
        ints[_LENS] = 1  # padding rows: one key, on the reserved page
        table[:, 0] = RESERVED_LOCAL_PAGE
        for i, s in enumerate(sequences):
            pos = s.prefix_len
            table[i, : s.pages.shape[0]] = s.pages
            ints[_TOKENS, i] = s.token_ids[0]
            ints[_POSITIONS, i] = pos
            ints[_SLOTS, i] = int(s.pages[pos // ps]) * ps + pos % ps
            ints[_LENS, i] = pos + 1
        return ints_t, table_t, width

    def _forward(self, bucket: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The step on the static buffers (what a graph records)."""
        model = self.model
        tokens = self._ints[_TOKENS, :bucket]
        positions = self._ints[_POSITIONS, :bucket]
        slots = self._ints[_SLOTS, :bucket]
        lens = self._ints[_LENS, :bucket]
        table = self._table[:bucket]
        splits = self._splits[bucket]
        hidden = model.embed(tokens)
        for layer, (k_cache, v_cache) in enumerate(zip(self.k_cache, self.v_cache, strict=True)):
            q, k, v = model.attention_inputs(layer, hidden, positions)
            kernels.store_kv(k, v, k_cache, v_cache, slots)
            o = kernels.paged_decode_attention(
                q, k_cache, v_cache, table, lens, model.sm_scale, num_splits=splits
            )
            hidden = model.finish_layer(layer, hidden, o)
        logits = model.logits(hidden)
        return logits, logits.argmax(dim=-1)

    def _record(self, bucket: int) -> _Recorded:
        """Run the step once and, when capturing, record it (the buffers already hold this
        step's inputs, so the first run is this step's answer)."""
        if not self.capture:
            logits, ids = self._forward(bucket)
            return _Recorded(None, logits, ids)
        # Warm on a side stream first: Triton compiles and cuBLAS picks its kernels outside
        # the capture, which may not allocate or synchronise.
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            self._forward(bucket)
        torch.cuda.current_stream(self.device).wait_stream(side)
        # NOTE: the model keeps the last RoPE tables by positions tensor; the graph must compute
        # its own from the static buffer inside the capture (each _forward slices a new
        # positions view, so this only makes the rule explicit), and no table of the graph's
        # pool may stay referenced outside it (dropped again after the capture).
        self.model.forget_rotary()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            logits, ids = self._forward(bucket)
        self._pool = graph.pool()
        self.model.forget_rotary()
        graph.replay()  # the capture only recorded: this step's answer comes from a replay
        return _Recorded(graph, logits, ids)
