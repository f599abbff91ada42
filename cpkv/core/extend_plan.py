"""Where a prefill step's new pages go: each request's cached prefix, lengths and owner plan,
and the owners of a whole batch (plans where they apply, a rotation for the rest)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from cpkv.core.layout import PageLayout
from cpkv.core.owners import (
    OwnerPlan,
    build_owner_plan,
    in_seq_page_compute_owner_unavailable_reason,
)
from cpkv.core.prefix_cache import PrefixMatch

__all__ = ["ExtendPlan", "batch_owners", "plan_extend"]

_EMPTY_I32 = np.empty(0, dtype=np.int32)

# ``rotation(num_pages, reserved)``: owners of pages drawn in rotation, ``reserved`` pages a
# lane already promised (see LaneCapacity.rotation_owners).
_Rotation = Callable[[int, np.ndarray], np.ndarray]


@dataclass(slots=True, frozen=True)
class ExtendPlan:
    """One request's share of a prefill step.

    Attributes:
        match: the cached prefix a new request reuses; ``None`` for a request that continues.
        prefix_len: tokens held before the step's new ones.
        extend_len: new tokens to compute.
        num_new_pages: pages the step adds.
        plan: the zigzag owner plan, ``None`` when the pages go in rotation.
        reason: why no owner plan applies, ``None`` when one does.
    """

    match: PrefixMatch | None
    prefix_len: int
    extend_len: int
    num_new_pages: int
    plan: OwnerPlan | None
    reason: str | None


def plan_extend(
    layout: PageLayout,
    owner_split: str,
    match: PrefixMatch | None,
    prefix_len: int,
    extend_len: int,
) -> ExtendPlan:
    """Plan one request's step: an owner plan when it qualifies, else the reason it does not.

    NOTE: each sequence of a batch is planned alone, so ``multi_batch`` is never a reason.
    """
    ps, cp = layout.page_size, layout.cp_size
    reason = in_seq_page_compute_owner_unavailable_reason(extend_len, prefix_len, ps, cp)
    plan = None if reason else build_owner_plan(extend_len, prefix_len, ps, cp, owner_split)
    num_new = layout.pages_for(prefix_len + extend_len) - layout.pages_for(prefix_len)
    assert plan is None or plan.num_pages == num_new, (plan.num_pages, num_new)
    return ExtendPlan(match, prefix_len, extend_len, num_new, plan, reason)


def batch_owners(plans: Sequence[ExtendPlan], cp_size: int, rotation: _Rotation) -> np.ndarray:
    """Owners of a batch's new pages, in item order: plans where they exist, the rest in
    rotation over what the planned pages leave.

    Returns:
        ``int32 [sum of num_new_pages]`` owner lane per new page.
    """
    planned = np.zeros(cp_size, dtype=np.int64)
    rotated = 0
    for p in plans:
        if p.plan is not None:
            planned += p.plan.pages_per_lane
        else:
            rotated += p.num_new_pages
    rotation_owners = rotation(rotated, planned)
    parts, taken = [], 0
    for p in plans:
        if p.plan is not None:
            parts.append(p.plan.page_owners)
        else:
            parts.append(rotation_owners[taken : taken + p.num_new_pages])
            taken += p.num_new_pages
    if not parts:
        return _EMPTY_I32
    owners = parts[0] if len(parts) == 1 else np.concatenate(parts)
    return owners.astype(np.int32, copy=False)
