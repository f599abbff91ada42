"""Context-parallel attention over the lanes' paged KV shards, with two exchange modes.

Per layer and step, each lane holds the queries, keys and values of the step tokens it owns
(``plan.my_tokens``), and its shard holds the K/V of every position whose page lives on it.
:meth:`CPAttention.forward` first writes the lane's new K/V into its own shard (once, in place,
by the owner), then exchanges and attends:

``pass_q``
    All-gather the step's queries; every lane attends **all** of them to **its** pages (cached
    prefix and this step's tokens alike: after step 1 every lane's pages are complete, because a
    page only holds tokens its lane owns); an all-to-all returns each query's partial output and
    LSE to its owner, which merges the ``cp_size`` partials. Two collectives.

``pass_kv``
    All-gather the step's new K and V (one collective, K and V packed); each lane lays every
    request's new K/V out in position order as pages of a temporary and attends its **own**
    queries to them with the same paged kernel. Keys of the cached prefix (positions
    ``< prefix_len``) are spread over the lanes' shards and are *not* gathered: when any request
    has history, a pass-Q round restricted to the history pages and to the queries of requests
    with history follows (two more collectives), and the owner merges new-key and history
    partials. Without history the whole exchange is one all-gather.

``auto``
    Per step, estimate each mode's exchange time as ``n_collectives * latency + bytes /
    bandwidth`` and take the smaller (ties: ``pass_q``). The link numbers come from
    :meth:`LaneGroup.measure` (one probe per group, agreed by all lanes); bytes are those the
    busiest lane receives (see :func:`exchange_costs`). Both modes move the same attention work
    overall, so compute is not modelled. In practice: a fresh prefill (no history) with GQA
    takes ``pass_kv`` (``2 * Hkv`` K/V rows instead of ``Hq`` query rows plus ``Hq * (D + 1)``
    fp32 partials, and one collective instead of two); a step whose requests all have history
    takes ``pass_q`` (pass_kv would do the same history round *plus* the K/V gather); decode
    (one token per request, long history) takes ``pass_q``.

A solo step (``plan.solo_lane``: every page of the step on one lane, as for a prompt that
fits one page at ``cp_size > 1`` and its first decodes): that lane holds every key and computes
every token, so it attends alone with no exchange, as one lane does; the other lanes skip the
step (``idle``).

One lane and no cached prefix (a cp=1 prefill of new requests, or a solo step's): each
request's keys are its own new tokens, contiguous and in order, so the lane attends them with
torch SDPA where they are (the call transformers makes; cuDNN on Hopper) after writing them to
its shard; every other step reads the shard through the paged kernel.

Every lane must construct the attention with the same mode and call ``forward`` at the same
points with the same dtypes and head shapes: the exchanges are collectives, and ``auto`` relies
on every lane computing the same decision from the same global plan and agreed link numbers.
Lanes owning no token of a step that is not solo still take part in every collective.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from cpkv import kernels
from cpkv.core.steps import MODES, check_mode
from cpkv.lanes.comm import LaneGroup
from cpkv.lanes.step import PageTable, QExchange, StepPlan

__all__ = ["MODES", "CPAttention", "exchange_costs", "lane_exchange_bytes"]


def _exchange_cost(
    n_collectives: int, rows: int, row_bytes: int, cp: int, latency_s: float, bytes_per_s: float
) -> tuple[float, int]:
    received = (cp - 1) * rows * row_bytes
    return n_collectives * latency_s + (received / bytes_per_s if received else 0.0), received


def exchange_costs(
    plan: StepPlan,
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
    q_bytes: int,
    kv_bytes: int,
    latency_s: float,
    bytes_per_s: float,
) -> dict[str, float]:
    """Estimated exchange time of each mode for this step (seconds, equal on every lane).

    Bytes are per lane, as the busiest lane receives them: an all-gather of rows padded to the
    largest lane's count ``m`` brings ``(cp - 1) * m`` rows from the others, and the all-to-all
    returning partials brings the busiest owner ``(cp - 1) * m`` rows too. With ``T`` tokens
    balanced over lanes this is ``(cp - 1) / cp * T`` rows, the same factor for both modes, so
    the comparison is the plain one of ``T * Hq * D * q_bytes + T * Hq * (D + 1) * 4`` (pass_q)
    against ``2 * T * Hkv * D * kv_bytes`` (pass_kv) plus its history pass-Q round.

    Args:
        plan: the step's plan.
        num_q_heads, num_kv_heads, head_dim: ``Hq``, ``Hkv``, ``D``.
        q_bytes, kv_bytes: element sizes of the queries and of the new K/V.
        latency_s: per-collective latency.
        bytes_per_s: bytes per second one lane receives in an all-gather.

    Returns:
        ``{"pass_q": seconds, "pass_kv": seconds}``; 0 for both at ``cp_size == 1`` and for a
        solo step (``plan.solo_lane``: nothing is exchanged).
    """
    cp = plan.cp_size
    if cp == 1 or plan.solo_lane >= 0:
        return {"pass_q": 0.0, "pass_kv": 0.0}
    hq, hkv, d = num_q_heads, num_kv_heads, head_dim
    q_row, partial_row = hq * d * q_bytes, hq * (d + 1) * 4
    top = int(plan.lane_counts.max())
    pass_q = _exchange_cost(2, top, q_row + partial_row, cp, latency_s, bytes_per_s)[0]
    pass_kv = _exchange_cost(1, top, 2 * hkv * d * kv_bytes, cp, latency_s, bytes_per_s)[0]
    if plan.history is not None:
        top_h = int(plan.history.counts.max())
        pass_kv += _exchange_cost(2, top_h, q_row + partial_row, cp, latency_s, bytes_per_s)[0]
    return {"pass_q": pass_q, "pass_kv": pass_kv}


def lane_exchange_bytes(
    plan: StepPlan,
    mode: str,
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
    q_bytes: int,
    kv_bytes: int,
) -> int:
    """Payload bytes one lane receives from the others in one :meth:`CPAttention.forward` (one
    layer) of ``mode``: what that call counts as ``exchange_bytes``, from the plan alone.

    Args:
        plan: the step's plan for this lane.
        mode: the mode that ran (``pass_q`` or ``pass_kv``; not ``auto``).
        num_q_heads, num_kv_heads, head_dim: ``Hq``, ``Hkv``, ``D``.
        q_bytes, kv_bytes: element sizes of the queries and of the new K/V.

    Returns:
        Bytes (0 at ``cp_size == 1`` and for a solo step). A step of ``L`` layers moves ``L``
        times this per lane.
    """
    if mode not in ("pass_q", "pass_kv"):
        raise ValueError(f"mode={mode!r} must be the mode that ran: 'pass_q' or 'pass_kv'")
    cp, me = plan.cp_size, plan.lane
    if cp == 1 or plan.solo_lane >= 0:  # one lane holds the whole step: nothing to exchange
        return 0
    hq, hkv, d = num_q_heads, num_kv_heads, head_dim

    def q_round(x: QExchange) -> int:
        m = int(x.counts[me])
        return (int(x.counts.sum()) - m) * hq * d * q_bytes + (cp - 1) * m * hq * (d + 1) * 4

    if mode == "pass_q":
        return q_round(plan.pass_q)
    counts = plan.lane_counts
    total = (int(counts.sum()) - int(counts[me])) * 2 * hkv * d * kv_bytes
    return total + (q_round(plan.history) if plan.history is not None else 0)


@dataclass(slots=True)
class _DeviceExchange:
    counts: list[int]
    sorted_to_gathered: torch.Tensor | None  # None: the identity (no reordering copy)
    gathered_to_sorted: torch.Tensor | None  # None: the identity
    positions: torch.Tensor
    cu_q: torch.Tensor
    max_q_len: int  # the longest request's subset tokens (the kernel launches without a sync)
    my_rows: torch.Tensor | None  # None: all of this lane's tokens
    pages: kernels.PagedKVTable


class _DevicePlan:
    """The plan's arrays on one device, each copied there on its first use and kept for the
    step's other layers: a route reads only its own (SDPA on one lane only the slots), and
    each copy is a host-to-device transfer in the step."""

    __slots__ = ("_device", "_made", "_plan")

    def __init__(self, plan: StepPlan, device: torch.device) -> None:
        self._plan, self._device = plan, device
        self._made: dict[str, object] = {}

    def _get(self, name: str, make: Callable[[StepPlan, torch.device], Any]) -> Any:
        if name not in self._made:
            self._made[name] = make(self._plan, self._device)
        return self._made[name]

    @property
    def my_local_slots(self) -> torch.Tensor:
        return self._get("my_local_slots", lambda p, d: _t(p.my_local_slots, d))

    @property
    def my_positions(self) -> torch.Tensor:
        return self._get("my_positions", lambda p, d: _t(p.my_positions, d))

    @property
    def my_cu_q(self) -> torch.Tensor:
        return self._get("my_cu_q", lambda p, d: _t(p.my_cu_q, d))

    @property
    def my_max_q_len(self) -> int:
        return _max_len(self._plan.my_cu_q)  # host-side, nothing to copy

    @property
    def pass_q(self) -> _DeviceExchange:
        return self._get("pass_q", lambda p, d: _exchange(p.pass_q, p.num_mine, d))

    @property
    def history(self) -> _DeviceExchange | None:
        if self._plan.history is None:
            return None
        return self._get("history", lambda p, d: _exchange(p.history, p.num_mine, d))

    @property
    def new_pages(self) -> kernels.PagedKVTable:
        return self._get("new_pages", lambda p, d: _table(p.new_pages, d))

    @property
    def new_rows(self) -> torch.Tensor:
        return self._get("new_rows", lambda p, d: _t(p.new_rows, d))


def _t(a: np.ndarray, device: torch.device) -> torch.Tensor:
    return torch.from_numpy(np.array(a, copy=True)).to(device)  # plan arrays are read-only


def _perm(a: np.ndarray, device: torch.device) -> torch.Tensor | None:
    """A permutation on the device, or ``None`` for the identity (cp=1, one request)."""
    return None if np.array_equal(a, np.arange(a.shape[0])) else _t(a, device)


def _max_len(cu: np.ndarray) -> int:
    return int(np.diff(cu).max()) if cu.shape[0] > 1 else 0


def _rows(x: torch.Tensor, index: torch.Tensor | None) -> torch.Tensor:
    return x if index is None else x.index_select(0, index)


def _table(t: PageTable, device: torch.device) -> kernels.PagedKVTable:
    return kernels.PagedKVTable(
        _t(t.page_table, device),
        _t(t.page_pos, device),
        _t(t.page_len, device),
        _t(t.cu_pages, device),
    )


def _exchange(x: QExchange, n_mine: int, device: torch.device) -> _DeviceExchange:
    all_mine = x.my_rows.shape[0] == n_mine
    return _DeviceExchange(
        counts=[int(c) for c in x.counts],
        sorted_to_gathered=_perm(x.sorted_to_gathered, device),
        gathered_to_sorted=_perm(x.gathered_to_sorted, device),
        positions=_t(x.positions, device),
        cu_q=_t(x.cu_q, device),
        max_q_len=_max_len(x.cu_q),
        my_rows=None if all_mine else _t(x.my_rows, device),
        pages=_table(x.pages, device),
    )


class CPAttention:
    """One step's CP attention for one lane (reused across the layers of that step).

    Args:
        group: the lanes' group; ``group.rank`` must be ``plan.lane`` and ``group.world_size``
            ``plan.cp_size``.
        plan: the step's plan, built for this lane.
        mode: ``"pass_q"``, ``"pass_kv"`` or ``"auto"`` (the same on every lane).

    Attributes:
        last_mode: the mode the last :meth:`forward` ran (``None`` before the first); on a
            solo step the mode asked for (``pass_q`` under ``auto``), nothing exchanged.
        solo: every page of the step lies on one lane (``cp_size > 1``): no exchange.
        idle: a solo step held by another lane: this lane has no token and no key of it.
        last_costs: ``auto``'s estimates ``{"pass_q": s, "pass_kv": s}`` for the last call, or
            ``None`` when the mode was fixed.
        exchange_bytes: payload bytes this lane received from the other lanes in the last
            call (all collectives; all-gather padding not counted).
        total_exchange_bytes: the same over every call (a step's layers).

    Raises:
        ValueError: unknown mode, or a plan that does not match the group.
    """

    def __init__(self, group: LaneGroup, plan: StepPlan, mode: str = "auto") -> None:
        check_mode(mode)
        if group.world_size != plan.cp_size or group.rank != plan.lane:
            raise ValueError(
                f"plan for lane {plan.lane} of cp_size={plan.cp_size} does not match group rank "
                f"{group.rank} of world_size={group.world_size}"
            )
        self.group = group
        self.plan = plan
        self.mode = mode
        self.last_mode: str | None = None
        self.last_costs: dict[str, float] | None = None
        self.exchange_bytes = 0
        self.total_exchange_bytes = 0
        self._device_plans: dict[torch.device, _DevicePlan] = {}
        self._auto: dict[tuple[int, ...], tuple[str, dict[str, float]]] = {}
        # Every page of the step on one lane (a short prompt or decode): that lane holds every
        # key and computes every token, so it attends alone and no lane exchanges anything.
        # NOTE: every lane derives this from the same global pages, so all skip the
        # collectives (measure() included) together.
        self.solo = plan.cp_size > 1 and plan.solo_lane >= 0
        # ... and the other lanes have nothing to do in this step.
        self.idle = self.solo and plan.solo_lane != plan.lane
        # One lane and no cached prefix: each request's keys are exactly its new tokens, in
        # order, so torch SDPA attends them where they are (cuDNN on Hopper); the paged kernel
        # serves every other step.
        self._dense = plan.solo_lane == plan.lane and not plan.prefix_lens.any()
        self._dense_bounds = [int(c) for c in plan.cu_tokens]

    # --- setup ---

    def _device_plan(self, device: torch.device) -> _DevicePlan:
        dp = self._device_plans.get(device)
        if dp is None:
            dp = self._device_plans[device] = _DevicePlan(self.plan, device)
        return dp

    def _check(
        self,
        k_shard: torch.Tensor,
        v_shard: torch.Tensor,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
    ) -> None:
        n = self.plan.num_mine
        if q.ndim != 3 or k.ndim != 3 or v.ndim != 3:
            raise ValueError(
                f"q, k, v must be [tokens, heads, dim], got {tuple(q.shape)}, {tuple(k.shape)}, "
                f"{tuple(v.shape)}"
            )
        if q.shape[0] != n or k.shape[0] != n or v.shape[0] != n:
            raise ValueError(
                f"lane {self.plan.lane} owns {n} tokens of the step but got q {tuple(q.shape)}, "
                f"k {tuple(k.shape)}, v {tuple(v.shape)}"
            )
        if k.shape != v.shape or q.shape[2] != k.shape[2] or q.shape[1] % k.shape[1]:
            raise ValueError(
                f"need k.shape == v.shape, one head dim and Hq % Hkv == 0; got q "
                f"{tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}"
            )
        if k_shard.ndim != 4 or k_shard.shape[1] != self.plan.page_size:
            raise ValueError(
                f"k_shard must be [pages, page_size={self.plan.page_size}, Hkv, D], got "
                f"{tuple(k_shard.shape)}"
            )
        if k_shard.shape[2:] != k.shape[1:]:
            raise ValueError(
                f"k_shard {tuple(k_shard.shape)} does not hold k rows {tuple(k.shape[1:])}"
            )
        if self.plan.max_local_page >= k_shard.shape[0]:
            raise ValueError(
                f"the plan names local page {self.plan.max_local_page} but the shard has "
                f"{k_shard.shape[0]} pages"
            )

    # --- decision ---

    def _decide(self, q: torch.Tensor, k: torch.Tensor) -> str:
        if self.mode != "auto" or self.solo:
            self.last_costs = None
            return self._fixed_mode()
        key = (q.shape[1], k.shape[1], q.shape[2], q.element_size(), k.element_size())
        if key not in self._auto:
            # NOTE: measure() is a collective, run on every lane's first auto call (same point
            # everywhere); the costs use only global plan data and the agreed link numbers, so
            # every lane picks the same mode and the collectives below match.
            link = self.group.measure()
            costs = exchange_costs(self.plan, *key, link["latency_s"], link["bytes_per_s"])
            choice = "pass_kv" if costs["pass_kv"] < costs["pass_q"] else "pass_q"
            self._auto[key] = (choice, costs)
        choice, costs = self._auto[key]
        self.last_costs = dict(costs)
        return choice

    def _fixed_mode(self) -> str:
        # A solo step exchanges nothing whatever the mode: it reports the mode asked for,
        # pass_q under auto (as one lane does).
        return "pass_q" if self.mode == "auto" else self.mode

    def skip(self) -> None:
        """Record an idle lane's step (see ``idle``) without running :meth:`forward`: the
        mode the step ran, no bytes exchanged."""
        assert self.idle, "only a lane with no part in a solo step may skip it"
        self.last_mode, self.last_costs, self.exchange_bytes = self._fixed_mode(), None, 0

    # --- exchanges ---

    def _attend(
        self,
        q: torch.Tensor,
        q_pos: torch.Tensor,
        cu_q: torch.Tensor,
        max_q_len: int,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        pages: kernels.PagedKVTable,
        sm_scale: float,
        out_dtype: torch.dtype = torch.float32,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if q.shape[0] == 0 or pages.num_pages == 0:  # nothing visible: the empty partial
            out = torch.zeros(q.shape, dtype=out_dtype, device=q.device)
            return out, torch.full(q.shape[:2], float("-inf"), device=q.device)
        return kernels.paged_partial_attention(
            q,
            q_pos,
            cu_q,
            k_cache,
            v_cache,
            pages,
            sm_scale,
            # NOTE: from the host plan, so the launch reads nothing back (a sync per layer
            # would let the GPU drain while the host queues the next layer's kernels).
            max_q_len=max_q_len,
            out_dtype=out_dtype,
        )

    def _pass_q_round(
        self,
        x: _DeviceExchange,
        q: torch.Tensor,
        k_shard: torch.Tensor,
        v_shard: torch.Tensor,
        sm_scale: float,
        out_dtype: torch.dtype = torch.float32,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Partials of this lane's subset queries from every lane: ``[cp, m, Hq, D]``, ``[cp,
        m, Hq]`` (``m = counts[lane]``, rows in ``my_rows`` order). At cp_size 1 and on a solo
        step the one partial comes in ``out_dtype`` (nothing to gather, pack or merge);
        exchanged partials are fp32."""
        g = self.group
        cp, me = g.world_size, g.rank
        _, hq, d = q.shape
        rows = _rows(q, x.my_rows)
        # A solo step's queries are all this lane's: the other lanes skip the round.
        gathered = rows if self.solo else g.all_gather_rows(rows.contiguous(), x.counts)
        q_sorted = _rows(gathered, x.sorted_to_gathered)
        one = cp == 1 or self.solo
        out, lse = self._attend(
            q_sorted, x.positions, x.cu_q, x.max_q_len, k_shard, v_shard, x.pages, sm_scale,
            out_dtype if one else torch.float32,
        )  # fmt: skip
        if one:  # nothing to exchange: no packing, no copies
            return _rows(out, x.gathered_to_sorted)[None], _rows(lse, x.gathered_to_sorted)[None]
        n = q_sorted.shape[0]
        # out and lse travel together: one fp32 row of Hq * (D + 1) per query.
        packed = torch.cat([out.reshape(n, hq * d), lse.float()], dim=1)
        packed = _rows(packed, x.gathered_to_sorted)  # back to rank-major
        m = x.counts[me]
        recv = g.all_to_all_rows(list(packed.split(x.counts)), [m] * cp)
        parts = torch.stack(recv)  # [cp, m, Hq * (D + 1)]
        self.exchange_bytes += (sum(x.counts) - m) * rows.shape[1:].numel() * q.element_size()
        self.exchange_bytes += (cp - 1) * m * hq * (d + 1) * 4
        return parts[..., : hq * d].reshape(cp, m, hq, d), parts[..., hq * d :]

    def _pass_kv(
        self,
        dp: _DevicePlan,
        k_shard: torch.Tensor,
        v_shard: torch.Tensor,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        sm_scale: float,
    ) -> torch.Tensor:
        g, plan = self.group, self.plan
        counts = [int(c) for c in plan.lane_counts]
        _, hkv, d = k.shape
        kv = torch.stack([k, v], dim=1)  # [n_mine, 2, Hkv, D]: one gather for K and V
        gathered = g.all_gather_rows(kv, counts)  # [T, 2, Hkv, D] rank-major
        self.exchange_bytes += (
            (sum(counts) - counts[g.rank]) * kv.shape[1:].numel() * kv.element_size()
        )
        ps = plan.page_size
        n_new = dp.new_pages.num_pages
        # NOTE: zeros, not empty: the kernel may read a page's slots past page_len (masked out),
        # and garbage there could be NaN.
        tmp = k.new_zeros((2, n_new * ps, hkv, d))
        tmp.index_copy_(1, dp.new_rows, gathered.transpose(0, 1))
        k_tmp, v_tmp = tmp[0].view(n_new, ps, hkv, d), tmp[1].view(n_new, ps, hkv, d)
        out_new, lse_new = self._attend(
            q, dp.my_positions, dp.my_cu_q, dp.my_max_q_len, k_tmp, v_tmp, dp.new_pages, sm_scale
        )
        if dp.history is None:
            return out_new
        outs_h, lses_h = self._pass_q_round(dp.history, q, k_shard, v_shard, sm_scale)
        if dp.history.my_rows is not None:  # some of my tokens have no history: -inf parts
            cp, n = outs_h.shape[0], q.shape[0]
            full_o = outs_h.new_zeros((cp, n, *outs_h.shape[2:]))
            full_l = lses_h.new_full((cp, n, lses_h.shape[2]), float("-inf"))
            full_o[:, dp.history.my_rows] = outs_h
            full_l[:, dp.history.my_rows] = lses_h
            outs_h, lses_h = full_o, full_l
        outs = torch.cat([out_new[None], outs_h])
        lses = torch.cat([lse_new[None], lses_h])
        return kernels.merge_attn_states(outs, lses)[0]

    def _dense_attention(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sm_scale: float
    ) -> torch.Tensor:
        """Causal SDPA of each request's new tokens over themselves (see ``_dense``), in
        ``q``'s dtype: the same call transformers makes (GQA in SDPA, no mask)."""
        outs = []
        bounds = self._dense_bounds
        for t0, t1 in itertools.pairwise(bounds):
            qb, kb, vb = (x[t0:t1].transpose(0, 1)[None] for x in (q, k, v))  # [1, H, T, D]
            o = F.scaled_dot_product_attention(
                qb, kb, vb, is_causal=True, scale=sm_scale, enable_gqa=True
            )
            outs.append(o[0].transpose(0, 1))
        return outs[0] if len(outs) == 1 else torch.cat(outs)

    # --- entry point ---

    def forward(
        self,
        k_shard: torch.Tensor,
        v_shard: torch.Tensor,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        sm_scale: float,
    ) -> torch.Tensor:
        """Store this lane's new K/V, exchange, and return its tokens' attention output.

        A collective: every lane of the group calls it for the same step and layer (but
        for a step whose pages all lie on one lane, ``plan.solo_lane``: that lane attends
        alone, the others return at once, and nothing is exchanged).

        Args:
            k_shard, v_shard: ``[P, page_size, Hkv, D]`` this lane's shard for the layer
                (written in place at ``plan.my_local_slots``).
            q: ``[n_mine, Hq, D]`` queries of this lane's tokens (``plan.my_tokens`` order).
            k, v: ``[n_mine, Hkv, D]`` their keys and values, dtype of the shard.
            sm_scale: softmax scale.

        Returns:
            ``[n_mine, Hq, D]``: causal attention of each of this lane's tokens over its whole
            sequence (cached prefix and this step's tokens up to its position); fp32, or the
            dtype of ``q`` at cp_size 1 with ``pass_q`` and on a solo step (one partial,
            nothing to merge).

        Raises:
            ValueError: shapes that do not match the plan or each other, a shard too small for
                the plan's pages; the kernels' own checks.
        """
        self._check(k_shard, v_shard, q, k, v)
        self.exchange_bytes = 0
        if self.idle:  # another lane holds this whole step (num_mine is 0)
            self.skip()
            return q.new_empty(q.shape)
        dp = self._device_plan(q.device)
        # (1) the owner writes its tokens' K/V once, in place; after this every lane's pages
        # hold all their keys up to this step, since a page holds only its own lane's tokens.
        kernels.store_kv(k.contiguous(), v.contiguous(), k_shard, v_shard, dp.my_local_slots)
        # (2) exchange and attend.
        out = self._exchange_and_attend(dp, k_shard, v_shard, q, k, v, sm_scale)
        self.total_exchange_bytes += self.exchange_bytes
        return out

    __call__ = forward

    def _exchange_and_attend(
        self,
        dp: _DevicePlan,
        k_shard: torch.Tensor,
        v_shard: torch.Tensor,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        sm_scale: float,
    ) -> torch.Tensor:
        mode = self._decide(q, k)
        self.last_mode = mode
        if self._dense:
            return self._dense_attention(q, k, v, sm_scale)
        if mode == "pass_kv" and not self.solo:  # a solo step's keys are all in its shard
            return self._pass_kv(dp, k_shard, v_shard, q, k, v, sm_scale)
        # At cp_size 1 and on a solo step the one partial is the whole attention: it comes
        # in q's dtype.
        outs, lses = self._pass_q_round(dp.pass_q, q, k_shard, v_shard, sm_scale, q.dtype)
        if outs.shape[0] == 1:
            return outs[0]
        return kernels.merge_attn_states(outs, lses)[0]
