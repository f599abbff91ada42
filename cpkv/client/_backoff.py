"""Retrying a call that waits for KV capacity, with jittered exponential backoff."""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from typing import TypeVar

from cpkv.core.validate import check_float
from cpkv.errors import InvalidRequestError, KVCapacityWaitError

__all__ = ["with_backoff"]

_T = TypeVar("_T")
# The least backoff between capacity-wait retries (10k calls a second at most).
_MIN_BACKOFF_S = 1e-4


def with_backoff(
    fn: Callable[[], _T],
    *,
    deadline_s: float,
    initial_backoff_s: float = 0.005,
    max_backoff_s: float = 0.5,
    rng: random.Random | None = None,
) -> _T:
    """``fn()``, called again on KVCapacityWaitError with jittered exponential backoff until
    ``deadline_s`` has passed (then the last one is raised)."""
    deadline_s = check_float("deadline_s", deadline_s)
    # NOTE: > 0: a 0 backoff retried against the coordinator in a hot loop.
    initial_backoff_s = check_float("initial_backoff_s", initial_backoff_s, minimum=_MIN_BACKOFF_S)
    max_backoff_s = check_float("max_backoff_s", max_backoff_s, minimum=initial_backoff_s)
    if rng is not None and not isinstance(rng, random.Random):
        raise InvalidRequestError(f"rng={rng!r} must be a random.Random or None")
    rng = rng or random.Random()
    end = time.monotonic() + deadline_s
    backoff = initial_backoff_s
    while True:
        try:
            return fn()
        except KVCapacityWaitError:
            left = end - time.monotonic()
            if left <= 0:
                raise
            # Jitter keeps many waiting callers from retrying in lockstep; never past the cap.
            time.sleep(min(left, max_backoff_s, backoff * (0.5 + rng.random())))
            backoff = min(max_backoff_s, backoff * 2)
