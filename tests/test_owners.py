"""Owner plans: a hand-checked table, properties, reasons and bad arguments."""

from __future__ import annotations

import numpy as np
import pytest

from cpkv import (
    InvalidRequestError,
    build_in_seq_page_compute_owners,
    build_owner_plan,
    in_seq_page_compute_owner_unavailable_reason,
)

# (extend_len, prefix_len, page_size, cp_size) -> owners, checked by hand:
# n pages in 2*cp segments, the first n % (2cp) one page longer; lane r owns
# segments r and 2cp-1-r.
TABLE = [
    ((16, 0, 4, 2), [0, 1, 1, 0]),  # 4 pages, 4 segments of 1
    ((20, 0, 4, 2), [0, 0, 1, 1, 0]),  # 5 pages: sizes 2,1,1,1
    ((40, 8, 4, 2), [0, 0, 0, 1, 1, 1, 1, 1, 0, 0]),  # 10 pages: 3,3,2,2
    ((37, 0, 4, 2), [0, 0, 0, 1, 1, 1, 1, 1, 0, 0]),  # last page partial
    ((6, 0, 1, 3), [0, 1, 2, 2, 1, 0]),
    ((7, 0, 1, 3), [0, 0, 1, 2, 2, 1, 0]),
    ((13, 0, 1, 3), [0, 0, 0, 1, 1, 2, 2, 2, 2, 1, 1, 0, 0]),  # sizes 3,2,2,2,2,2
]


@pytest.mark.parametrize(
    ("args", "want"), TABLE, ids=[f"ext{a[0]}-pre{a[1]}-ps{a[2]}-cp{a[3]}" for a, _ in TABLE]
)
def test_owner_table(args, want):
    got = build_in_seq_page_compute_owners(*args)
    assert got.dtype == np.int32
    assert got.tolist() == want


REASONS = [
    ((100, 0, 4, 1), "cp_size_1"),
    ((100, 2, 4, 2), "prefix_not_page_aligned"),
    ((12, 0, 4, 2), "extend_too_short"),  # 3 pages < 2*cp
    ((13, 0, 4, 2), None),  # 4 pages, the last partial
    ((0, 0, 4, 2), "extend_too_short"),
    ((16, 0, 4, 2), None),
]


@pytest.mark.parametrize(("args", "want"), REASONS, ids=[str(w) for _, w in REASONS])
def test_reasons(args, want):
    assert in_seq_page_compute_owner_unavailable_reason(*args) == want
    owners = build_in_seq_page_compute_owners(*args)
    assert (owners is None) == (want is not None)


def test_multi_batch_reason_wins():
    assert in_seq_page_compute_owner_unavailable_reason(64, 0, 4, 2, multi_batch=True) == (
        "multi_batch"
    )


BAD = [
    (-1, 0, 4, 2),
    (10, -4, 4, 2),
    (10, 0, 0, 2),
    (10, 0, 4, 0),
    (10.0, 0, 4, 2),
    (10, 0, 4, True),
    ("10", 0, 4, 2),
]


@pytest.mark.parametrize("args", BAD, ids=[repr(a) for a in BAD])
def test_bad_arguments_raise_value_error(args):
    with pytest.raises(ValueError) as info:
        build_in_seq_page_compute_owners(*args)
    assert isinstance(info.value, InvalidRequestError)
    with pytest.raises(ValueError):
        in_seq_page_compute_owner_unavailable_reason(*args)


@pytest.mark.parametrize("cp_size", [2, 3, 4, 8])
@pytest.mark.parametrize("num_pages", [16, 17, 23, 64, 1001])
@pytest.mark.parametrize("page_size", [1, 7, 64])
def test_plan_properties(cp_size, num_pages, page_size):
    if num_pages < 2 * cp_size:
        pytest.skip("too short for a plan")
    extend_len = num_pages * page_size - (page_size // 2)  # last page partial
    plan = build_owner_plan(extend_len, 3 * page_size, page_size, cp_size)
    owners = plan.page_owners
    assert owners.shape == (num_pages,)
    # Segment sizes differ by at most one page, longer ones first.
    sizes = np.diff(plan.segment_bounds)
    assert sizes.max() - sizes.min() <= 1
    assert (np.diff(sizes) <= 0).all()
    # Zigzag: segment s and its mirror 2cp-1-s share an owner; owners are contiguous runs.
    seg_owner = [int(owners[b]) for b in plan.segment_bounds[:-1]]
    assert seg_owner == [*range(cp_size), *reversed(range(cp_size))]
    # Every page owned once; lanes balanced within 2 pages (two segments each).
    counts = np.bincount(owners, minlength=cp_size)
    assert counts.sum() == num_pages
    assert counts.max() - counts.min() <= 2
    assert counts.tolist() == plan.pages_per_lane.tolist()
    # Token ranges tile the extend exactly and match the page owners.
    covered = np.full(extend_len, -1)
    for lane, ranges in enumerate(plan.lane_token_ranges):
        for start, end in ranges:
            assert (covered[start:end] == -1).all()
            covered[start:end] = lane
    assert (covered == np.repeat(owners, page_size)[:extend_len]).all()


def test_huge_extend_is_vectorised():
    owners = build_in_seq_page_compute_owners(1 << 20, 0, 64, 8)
    assert owners.shape == (16384,)
    assert np.bincount(owners).tolist() == [2048] * 8
