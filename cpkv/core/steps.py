"""What a step tells the lanes: the same message for every lane, from which each derives
its own share (torch-free, so the coordinator builds it without torch)."""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass

import numpy as np

__all__ = ["MODES", "StepInput", "StepSequence"]

MODES = ("auto", "pass_q", "pass_kv")


@dataclass(slots=True, frozen=True)
class StepSequence:
    """One request's part of a step.

    Attributes:
        rid: the request (for messages only).
        prefix_len: tokens it held before the step (its new tokens start at this position).
        extend_len: new tokens.
        pages: ``int32`` global page ids of the whole sequence after the step.
        token_ids: ``int64 [extend_len]`` the new tokens.
        probe_start: row of the step's probe tensors holding this sequence's first new token.
    """

    rid: Hashable
    prefix_len: int
    extend_len: int
    pages: np.ndarray
    token_ids: np.ndarray
    probe_start: int = 0


@dataclass(slots=True, frozen=True)
class StepInput:
    """A prefill or decode step: one Ray call per lane carries this same object.

    Attributes:
        step_id: the coordinator's step counter (lanes check they run steps in order).
        group: the lane group's generation the step expects (rebuilt after a lane restart).
        sequences: the step's requests, in order.
        mode: ``auto``, ``pass_q`` or ``pass_kv`` (attention exchange).
        probe: for tests and benchmarks without a model: ``(q, k, v)``, ``[R, Hq, D]``,
            ``[R, Hkv, D]``, ``[R, Hkv, D]``, rows as the caller gave tokens (a sequence's new
            tokens from its ``probe_start``); each lane attends its own tokens (layer 0) and
            returns their outputs.
    """

    step_id: int
    group: str
    sequences: tuple[StepSequence, ...]
    mode: str = "auto"
    probe: tuple | None = None

    def __post_init__(self) -> None:
        assert self.mode in MODES, self.mode
