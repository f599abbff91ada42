"""In-sequence page compute owners: which CP rank computes and stores each new page.

The ``n`` new pages of an extend are cut into ``2 * cp_size`` contiguous
segments whose sizes differ by at most one page; lane ``r`` owns segments ``r``
and ``2 * cp_size - 1 - r`` (zigzag), which balances causal-attention work.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from cpkv.core.layout import PageLayout
from cpkv.core.validate import check_int

__all__ = [
    "OwnerPlan",
    "build_in_seq_page_compute_owners",
    "build_owner_plan",
    "in_seq_page_compute_owner_unavailable_reason",
]

REASON_CP_SIZE_1 = "cp_size_1"
REASON_PREFIX_NOT_ALIGNED = "prefix_not_page_aligned"
REASON_EXTEND_TOO_SHORT = "extend_too_short"
REASON_MULTI_BATCH = "multi_batch"

# How the 2 * cp_size segments go to lanes: "zigzag" (lane r: segments r and 2cp-1-r, which
# balances causal attention) or "contiguous" (lane r: segments 2r and 2r+1; the ablation).
SPLITS = ("zigzag", "contiguous")


def _checked(extend_len, extend_prefix_len, page_size, cp_size) -> tuple[int, int, PageLayout]:
    extend_len = check_int("extend_len", extend_len, minimum=0)
    extend_prefix_len = check_int("extend_prefix_len", extend_prefix_len, minimum=0)
    page_size = check_int("page_size", page_size, minimum=1)
    cp_size = check_int("cp_size", cp_size, minimum=1)
    return extend_len, extend_prefix_len, PageLayout(cp_size, page_size)


def _reason(extend_len: int, extend_prefix_len: int, layout: PageLayout) -> str | None:
    if layout.cp_size < 2:
        return REASON_CP_SIZE_1
    if extend_prefix_len % layout.page_size:
        return REASON_PREFIX_NOT_ALIGNED
    if layout.pages_for(extend_len) < 2 * layout.cp_size:
        return REASON_EXTEND_TOO_SHORT
    return None


def in_seq_page_compute_owner_unavailable_reason(
    extend_len: int,
    extend_prefix_len: int,
    page_size: int,
    cp_size: int,
    *,
    multi_batch: bool = False,
) -> str | None:
    """Say why no owner plan exists for this extend, or ``None`` when one does.

    Args:
        extend_len: new tokens of this prefill step.
        extend_prefix_len: tokens already cached before them.
        page_size: tokens per page.
        cp_size: number of CP ranks.
        multi_batch: the step holds more than one request.

    Returns:
        ``multi_batch``, ``cp_size_1``, ``prefix_not_page_aligned``,
        ``extend_too_short``, or ``None``.

    Raises:
        InvalidRequestError (a ValueError): a negative or non-integer length,
            ``page_size < 1`` or ``cp_size < 1``.
    """
    extend_len, extend_prefix_len, layout = _checked(
        extend_len, extend_prefix_len, page_size, cp_size
    )
    if multi_batch:
        return REASON_MULTI_BATCH
    return _reason(extend_len, extend_prefix_len, layout)


def _segment_bounds(num_pages: int, num_segments: int) -> np.ndarray:
    """Page index bounds ``[num_segments + 1]``; the first ``n % S`` segments are one longer."""
    base, extra = divmod(num_pages, num_segments)
    sizes = np.full(num_segments, base, dtype=np.int64)
    sizes[:extra] += 1
    bounds = np.zeros(num_segments + 1, dtype=np.int64)
    np.cumsum(sizes, out=bounds[1:])
    return bounds


def _segment_owners(cp_size: int, split: str) -> np.ndarray:
    lanes = np.arange(cp_size, dtype=np.int32)
    if split == "contiguous":
        return np.repeat(lanes, 2)
    # Segment s is owned by s, then mirrored.
    return np.concatenate([lanes, lanes[::-1]])


def _owners_from_bounds(cp_size: int, bounds: np.ndarray, split: str = "zigzag") -> np.ndarray:
    # One repeat fills all pages without a Python loop.
    return np.repeat(_segment_owners(cp_size, split), np.diff(bounds))


def build_in_seq_page_compute_owners(
    extend_len: int, extend_prefix_len: int, page_size: int, cp_size: int
) -> np.ndarray | None:
    """Return the compute owner of every new page, or ``None`` when unavailable.

    Args: as :func:`in_seq_page_compute_owner_unavailable_reason`.

    Returns:
        ``int32 [ceil(extend_len / page_size)]`` owner lane per new page, in
        sequence order; ``None`` when a reason applies (ask that function why).

    Raises:
        InvalidRequestError (a ValueError): bad arguments, as above.
    """
    extend_len, extend_prefix_len, layout = _checked(
        extend_len, extend_prefix_len, page_size, cp_size
    )
    if _reason(extend_len, extend_prefix_len, layout):
        return None
    num_pages = layout.pages_for(extend_len)
    return _owners_from_bounds(layout.cp_size, _segment_bounds(num_pages, 2 * layout.cp_size))


@dataclass(slots=True, frozen=True)
class OwnerPlan:
    """How one extend's new pages and tokens are split over the lanes.

    Attributes:
        page_owners: ``int32 [num_pages]`` owner lane of each new page.
        segment_bounds: ``int64 [2 * cp_size + 1]`` page bounds of the segments.
        pages_per_lane: ``int64 [cp_size]`` new pages each lane owns.
        lane_token_ranges: per lane, its ``(start, end)`` token ranges relative
            to the first new token (two ranges, zigzag; empty ranges dropped).
    """

    page_owners: np.ndarray
    segment_bounds: np.ndarray
    pages_per_lane: np.ndarray
    lane_token_ranges: tuple[tuple[tuple[int, int], ...], ...]

    @property
    def num_pages(self) -> int:
        return int(self.page_owners.shape[0])


def build_owner_plan(
    extend_len: int, extend_prefix_len: int, page_size: int, cp_size: int, split: str = "zigzag"
) -> OwnerPlan | None:
    """Build the zigzag owner plan with each lane's token ranges, or ``None``.

    ``split="contiguous"`` gives lane ``r`` segments ``2r`` and ``2r + 1`` instead (one
    contiguous range a lane): the ablation that shows why the plan zigzags.

    Raises:
        InvalidRequestError (a ValueError): bad arguments.
    """
    if split not in SPLITS:
        from cpkv.errors import InvalidRequestError

        raise InvalidRequestError(f"split={split!r}; expected one of {SPLITS}")
    extend_len, extend_prefix_len, layout = _checked(
        extend_len, extend_prefix_len, page_size, cp_size
    )
    if _reason(extend_len, extend_prefix_len, layout):
        return None
    page_size, cp_size = layout.page_size, layout.cp_size
    num_pages = layout.pages_for(extend_len)
    bounds = _segment_bounds(num_pages, 2 * cp_size)
    owners = _owners_from_bounds(cp_size, bounds, split)
    seg_owner = _segment_owners(cp_size, split)
    per_lane = np.bincount(seg_owner, weights=np.diff(bounds), minlength=cp_size).astype(np.int64)
    tb = np.minimum(bounds * page_size, extend_len).tolist()
    ranges = tuple(
        tuple(
            (tb[s], tb[s + 1]) for s in np.flatnonzero(seg_owner == r).tolist() if tb[s + 1] > tb[s]
        )
        for r in range(cp_size)
    )
    return OwnerPlan(owners, bounds, per_lane, ranges)
