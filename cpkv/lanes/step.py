"""The per-step plan every lane derives identically from the step's requests (SPMD).

A step is a batch of requests, each extending its sequence by ``extend_len`` tokens after
``prefix_len`` tokens it already holds (a prefill chunk, or a decode step with ``extend_len ==
1``). From the requests' global page ids alone, every lane computes the same global arrays: each
step token's request, position, compute owner and local slot, which lane owns which tokens, and
the rank-major orders the exchanges use. ``lane`` only selects this lane's views (its tokens and
its page tables), so no metadata ever travels between lanes.

Layout (see docs "Vocabulary"): global page ``g`` lives on lane ``g % cp_size`` as local page
``g // cp_size``; a token at position ``p`` of a sequence sits in that sequence's page
``pages[p // page_size]`` at offset ``p % page_size``; its compute owner is the lane of that page.
"""

from __future__ import annotations

import numbers
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from cpkv.core.steps import StepSequence

__all__ = ["PageTable", "QExchange", "StepPlan", "check_sequences"]


def _int(name: str, value: object, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ValueError(f"{name}={value!r} must be an integer")
    if int(value) < minimum:
        raise ValueError(f"{name}={int(value)} must be >= {minimum}")
    return int(value)


def _cumsum0(counts: np.ndarray) -> np.ndarray:
    """Exclusive-then-total cumsum: ``[0, c0, c0 + c1, ...]`` as int64 ``[len + 1]``."""
    out = np.zeros(counts.shape[0] + 1, dtype=np.int64)
    np.cumsum(counts, out=out[1:])
    return out


def _readonly(a: np.ndarray) -> np.ndarray:
    a.setflags(write=False)
    return a


def check_sequences(requests: Sequence[StepSequence], cp_size: int, page_size: int) -> np.ndarray:
    """Check a step's requests against the layout; their pages, concatenated.

    Returns:
        ``int64 [sum of page counts]`` the requests' global page ids, in batch order.

    Raises:
        ValueError: no requests, a request whose page count is not ``ceil(seq_len /
            page_size)``, a reserved page (local page 0, i.e. ``g < cp_size``), a page twice
            in one request, or a page the step writes (from a request's ``prefix_len`` on)
            that another request holds too. Full pages of a prefix are only read: requests
            that hit one cached prefix share them.
    """
    cp, ps = cp_size, page_size
    if len(requests) == 0:
        raise ValueError("a step needs at least one request, got none")
    for b, r in enumerate(requests):
        if not isinstance(r, StepSequence):
            raise ValueError(f"requests[{b}] is {type(r).__name__}, not StepSequence")
        want = -(-r.seq_len // ps)
        if r.pages.shape[0] != want:
            raise ValueError(
                f"requests[{b}]: prefix_len={r.prefix_len} + extend_len={r.extend_len} "
                f"needs {want} pages of page_size={ps}, got {r.pages.shape[0]}"
            )
    pages = np.concatenate([r.pages for r in requests]).astype(np.int64)
    reserved = pages[pages < cp]
    if reserved.size:
        raise ValueError(
            f"page ids {sorted(set(reserved.tolist()))} are local page 0 of their lane "
            f"(reserved) with cp_size={cp}"
        )
    uniq, seen = np.unique(pages, return_counts=True)
    shared = uniq[seen > 1]
    if shared.size:  # only cached prefix pages may be shared, by different requests
        held = [r.pages.shape[0] for r in requests]
        owner = np.repeat(np.arange(len(requests)), held)
        _, per_request = np.unique(pages * len(requests) + owner, return_counts=True)
        written = np.concatenate([r.pages[r.prefix_len // ps :] for r in requests])
        bad = shared[np.isin(shared, written)]
        if bad.size or bool((per_request > 1).any()):
            twice = bad if bad.size else shared
            raise ValueError(f"page ids {twice.tolist()} appear more than once in the step")
    return pages


@dataclass(slots=True, frozen=True, eq=False)
class PageTable:
    """One lane's pages grouped by request, in the CSR form ``paged_partial_attention`` takes.

    Attributes:
        page_table: ``int32 [N]`` local page ids (in a lane's shard, or in a temporary).
        page_pos: ``int64 [N]`` global position of each page's slot 0.
        page_len: ``int32 [N]`` valid slots of each page, in ``[1, page_size]``.
        cu_pages: ``int64 [B + 1]`` page offsets per request.
    """

    page_table: np.ndarray
    page_pos: np.ndarray
    page_len: np.ndarray
    cu_pages: np.ndarray

    @property
    def num_pages(self) -> int:
        return int(self.page_table.shape[0])


@dataclass(slots=True, frozen=True, eq=False)
class QExchange:
    """One pass-Q round over a subset of the step's tokens (all of them, or those with history).

    The owners all-gather their subset queries rank-major (lane 0's rows, then lane 1's, ...);
    every lane sorts them into step-token order (grouped by request, as the kernel wants),
    attends with ``pages``, puts the partials back in rank-major order and all-to-alls each
    lane its rows; the owner then merges ``cp_size`` partials per query.

    Attributes:
        counts: ``int64 [cp_size]`` subset tokens each lane owns.
        sorted_to_gathered: ``int64 [n]`` for each subset token in step order, its gathered row.
        gathered_to_sorted: ``int64 [n]`` the inverse permutation.
        positions: ``int64 [n]`` positions of the subset tokens in step order.
        cu_q: ``int64 [B + 1]`` subset token offsets per request (step order).
        my_rows: ``int64 [counts[lane]]`` which of this lane's tokens (rows of ``my_tokens``)
            are in the subset, ascending.
        pages: this lane's pages the subset queries attend to.
    """

    counts: np.ndarray
    sorted_to_gathered: np.ndarray
    gathered_to_sorted: np.ndarray
    positions: np.ndarray
    cu_q: np.ndarray
    my_rows: np.ndarray
    pages: PageTable

    @property
    def num_tokens(self) -> int:
        return int(self.positions.shape[0])


@dataclass(slots=True, frozen=True, eq=False)
class StepPlan:
    """Everything a lane needs to run one step's CP attention; identical on every lane but for
    the ``my_*`` views and page tables, which ``lane`` selects. Build with :meth:`build`.

    Global arrays (``T`` step tokens, concatenated over requests in order, positions ascending
    within a request; ``B`` requests):

    Attributes:
        cp_size, page_size, lane: the layout and the lane whose views these are.
        prefix_lens, extend_lens, seq_lens: ``int64 [B]``.
        cu_tokens: ``int64 [B + 1]`` step-token offsets per request.
        token_request: ``int32 [T]`` request index of each step token.
        token_position: ``int64 [T]`` position of each step token in its sequence.
        token_owner: ``int32 [T]`` compute owner lane of each step token.
        token_local_slot: ``int64 [T]`` local slot of each step token in its owner's shard.
        lane_tokens: per lane, ``int64`` indices of the step tokens it owns, ascending.
        lane_counts: ``int64 [cp_size]`` tokens each lane owns.
        gather_order: ``int64 [T]`` step token of each row of a rank-major all-gather
            (``concat(lane_tokens)``).
        last_token_owner: ``int32 [B]`` lane that computes each request's last token (its
            logits).
        last_token_index: ``int64 [B]`` that token's row in its owner's ``my_tokens``.
        solo_lane: the lane holding every page of the step (so every key and every new token
            of it), or -1 when the pages lie on several lanes; 0 at ``cp_size == 1``. A short
            prompt or decode at ``cp_size > 1`` often fits one lane: it needs no exchange.

    This lane's views:

    Attributes:
        my_tokens: ``int64 [n_mine]`` = ``lane_tokens[lane]``.
        my_positions: ``int64 [n_mine]`` their positions.
        my_local_slots: ``int64 [n_mine]`` their local slots in this lane's shard.
        my_cu_q: ``int64 [B + 1]`` offsets of this lane's tokens per request.
        all_pages: this lane's pages per request, keys at positions ``< seq_len``.
        history_pages: this lane's pages per request holding keys at positions ``<
            prefix_len``, ``page_len`` cut at ``prefix_len`` (a partial head page).
        max_local_page: largest local page id this lane's tables name (0 when none).

    Exchanges:

    Attributes:
        pass_q: the pass-Q round over all step tokens with ``all_pages``.
        history: the pass-Q round over the tokens of requests with ``prefix_len > 0`` with
            ``history_pages`` (pass-KV's history part), or ``None`` when no request has history.
        new_pages: pass-KV's temporary: the step's new K/V of each request laid out in position
            order as pages (request ``b`` takes ``ceil(extend_len[b] / page_size)`` pages
            starting at position ``prefix_len[b]``); ``page_table`` indexes the temporary.
        new_rows: ``int64 [T]`` row of the temporary (``page * page_size + offset``) for each
            row of a rank-major all-gather of the step's new K/V.
    """

    cp_size: int
    page_size: int
    lane: int
    prefix_lens: np.ndarray
    extend_lens: np.ndarray
    seq_lens: np.ndarray
    cu_tokens: np.ndarray
    token_request: np.ndarray
    token_position: np.ndarray
    token_owner: np.ndarray
    token_local_slot: np.ndarray
    lane_tokens: tuple[np.ndarray, ...]
    lane_counts: np.ndarray
    gather_order: np.ndarray
    last_token_owner: np.ndarray
    last_token_index: np.ndarray
    solo_lane: int
    my_tokens: np.ndarray
    my_positions: np.ndarray
    my_local_slots: np.ndarray
    my_cu_q: np.ndarray
    all_pages: PageTable
    history_pages: PageTable
    max_local_page: int
    pass_q: QExchange
    history: QExchange | None
    new_pages: PageTable
    new_rows: np.ndarray

    @property
    def num_requests(self) -> int:
        return int(self.prefix_lens.shape[0])

    @property
    def num_tokens(self) -> int:
        """``T``: the step's new tokens over all requests and lanes."""
        return int(self.token_position.shape[0])

    @property
    def num_mine(self) -> int:
        """Step tokens this lane owns."""
        return int(self.my_tokens.shape[0])

    @property
    def num_history_tokens(self) -> int:
        """Step tokens whose request has a cached prefix (0 when no request has one)."""
        return 0 if self.history is None else self.history.num_tokens

    @staticmethod
    def build(
        requests: Sequence[StepSequence], cp_size: int, page_size: int, lane: int
    ) -> StepPlan:
        """Derive the step's plan; every lane gets the same global arrays.

        Args:
            requests: the step's requests, in batch order (at least one).
            cp_size: number of lanes.
            page_size: tokens per page.
            lane: the lane whose views to select, in ``[0, cp_size)``.

        Returns:
            The plan (pure numpy).

        Raises:
            ValueError: bad ``cp_size`` / ``page_size`` / ``lane``, no requests, a request
                whose page count is not ``ceil(seq_len / page_size)``, a reserved page (local
                page 0, i.e. ``g < cp_size``), or a page id used twice in the step.
        """
        cp = _int("cp_size", cp_size, 1)
        ps = _int("page_size", page_size, 1)
        lane = _int("lane", lane, 0)
        if lane >= cp:
            raise ValueError(f"lane={lane} must be < cp_size={cp}")
        pages = check_sequences(requests, cp, ps)
        nb = len(requests)
        prefix = np.array([r.prefix_len for r in requests], dtype=np.int64)
        ext = np.array([r.extend_len for r in requests], dtype=np.int64)
        seq = prefix + ext

        # --- step tokens ---
        cu_tokens = _cumsum0(ext)
        t = int(cu_tokens[-1])
        token_request = np.repeat(np.arange(nb, dtype=np.int32), ext)
        token_position = (
            prefix[token_request] + np.arange(t, dtype=np.int64) - cu_tokens[token_request]
        )
        n_seq_pages = -(-seq // ps)
        cu_seq_pages = _cumsum0(n_seq_pages)
        token_page = pages[cu_seq_pages[token_request] + token_position // ps]
        token_owner = (token_page % cp).astype(np.int32)
        token_local_slot = (token_page // cp) * ps + token_position % ps

        # --- ownership, rank-major order ---
        # NOTE: a stable sort by owner keeps each lane's tokens ascending, so concat(lane_tokens)
        # is exactly the row order of a rank-major all-gather of per-lane ascending rows.
        gather_order = np.argsort(token_owner, kind="stable").astype(np.int64)
        lane_counts = np.bincount(token_owner, minlength=cp).astype(np.int64)
        lane_starts = _cumsum0(lane_counts)
        lane_tokens = tuple(
            _readonly(gather_order[lane_starts[r] : lane_starts[r + 1]]) for r in range(cp)
        )
        rank_in_owner = np.empty(t, dtype=np.int64)
        rank_in_owner[gather_order] = (
            np.arange(t, dtype=np.int64) - lane_starts[token_owner[gather_order]]
        )
        last = cu_tokens[1:] - 1
        last_token_owner = token_owner[last]
        last_token_index = rank_in_owner[last]

        my_tokens = lane_tokens[lane]
        my_cu_q = _cumsum0(np.bincount(token_request[my_tokens], minlength=nb))

        # --- this lane's pages ---
        page_req = np.repeat(np.arange(nb, dtype=np.int64), n_seq_pages)
        page_pos = (np.arange(pages.shape[0], dtype=np.int64) - cu_seq_pages[page_req]) * ps
        page_lane = pages % cp
        mine = page_lane == lane
        local = pages // cp
        # NOTE: every request has a page (extend_len >= 1), so page_lane is never empty.
        solo_lane = int(page_lane[0]) if page_lane.min() == page_lane.max() else -1

        def table(sel: np.ndarray, limit: np.ndarray) -> PageTable:
            return PageTable(
                page_table=_readonly(local[sel].astype(np.int32)),
                page_pos=_readonly(page_pos[sel]),
                page_len=_readonly(
                    np.minimum(ps, limit[page_req[sel]] - page_pos[sel]).astype(np.int32)
                ),
                cu_pages=_readonly(_cumsum0(np.bincount(page_req[sel], minlength=nb))),
            )

        all_pages = table(mine, seq)
        history_pages = table(mine & (page_pos < prefix[page_req]), prefix)
        max_local_page = int(local[mine].max()) if bool(mine.any()) else 0

        # --- exchanges ---
        def exchange(subset: np.ndarray, my_rows: np.ndarray, tab: PageTable) -> QExchange:
            # subset: ascending step-token indices; gathered rows are its tokens by owner.
            g2s = np.argsort(token_owner[subset], kind="stable").astype(np.int64)
            s2g = np.empty_like(g2s)
            s2g[g2s] = np.arange(g2s.shape[0], dtype=np.int64)
            return QExchange(
                counts=_readonly(np.bincount(token_owner[subset], minlength=cp).astype(np.int64)),
                sorted_to_gathered=_readonly(s2g),
                gathered_to_sorted=_readonly(g2s),
                positions=_readonly(token_position[subset]),
                cu_q=_readonly(_cumsum0(np.bincount(token_request[subset], minlength=nb))),
                my_rows=_readonly(my_rows.astype(np.int64)),
                pages=tab,
            )

        n_mine = my_tokens.shape[0]
        pass_q = exchange(np.arange(t, dtype=np.int64), np.arange(n_mine), all_pages)
        has_hist = prefix > 0
        history = None
        if bool(has_hist.any()):
            subset = np.flatnonzero(has_hist[token_request]).astype(np.int64)
            my_rows = np.flatnonzero(has_hist[token_request[my_tokens]])
            history = exchange(subset, my_rows, history_pages)

        # --- pass-KV temporary: each request's new tokens as pages from prefix_len ---
        n_new_pages = -(-ext // ps)
        cu_new = _cumsum0(n_new_pages)
        new_req = np.repeat(np.arange(nb, dtype=np.int64), n_new_pages)
        new_idx = np.arange(int(cu_new[-1]), dtype=np.int64) - cu_new[new_req]
        new_pages = PageTable(
            page_table=_readonly(np.arange(int(cu_new[-1]), dtype=np.int32)),
            page_pos=_readonly(prefix[new_req] + new_idx * ps),
            page_len=_readonly(np.minimum(ps, ext[new_req] - new_idx * ps).astype(np.int32)),
            cu_pages=_readonly(cu_new),
        )
        # j-th new token of request b -> row cu_new[b] * ps + j (pages are consecutive).
        token_new_row = cu_new[token_request] * ps + (token_position - prefix[token_request])
        new_rows = token_new_row[gather_order]

        return StepPlan(
            cp_size=cp,
            page_size=ps,
            lane=lane,
            prefix_lens=_readonly(prefix),
            extend_lens=_readonly(ext),
            seq_lens=_readonly(seq),
            cu_tokens=_readonly(cu_tokens),
            token_request=_readonly(token_request),
            token_position=_readonly(token_position),
            token_owner=_readonly(token_owner),
            token_local_slot=_readonly(token_local_slot),
            lane_tokens=lane_tokens,
            lane_counts=_readonly(lane_counts),
            gather_order=_readonly(gather_order),
            last_token_owner=_readonly(last_token_owner),
            last_token_index=_readonly(last_token_index),
            solo_lane=solo_lane,
            my_tokens=my_tokens,
            my_positions=_readonly(token_position[my_tokens]),
            my_local_slots=_readonly(token_local_slot[my_tokens]),
            my_cu_q=_readonly(my_cu_q),
            all_pages=all_pages,
            history_pages=history_pages,
            max_local_page=max_local_page,
            pass_q=pass_q,
            history=history,
            new_pages=new_pages,
            new_rows=_readonly(new_rows),
        )
