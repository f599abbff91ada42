"""Building a step for the lanes out of the core's decisions.

What a :class:`StepRequest` carries: each request's :class:`StepSequence` (its pages, the
token ids to compute and where its K/V starts), the token ids checked against the model's
vocabulary, and whether the step goes to the lanes as one shared object-store copy.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import Any

import numpy as np

from cpkv.core.allocator import CPAllocator, ExtendAllocation
from cpkv.core.steps import StepRequest, StepSequence
from cpkv.core.validate import as_token_array, check_vocab

__all__ = ["decode_sequences", "extend_sequences", "step_tokens", "worth_sharing"]

# Steps at least this large go to the lanes as one object-store copy (see worth_sharing).
_SHARE_MIN_BYTES = 64 << 10


def extend_sequences(
    core: CPAllocator, allocs: list[ExtendAllocation], tokens: Sequence[np.ndarray]
) -> list[StepSequence]:
    """The sequences of a prefill step: each allocation's new tokens on its pages."""
    seqs, start = [], 0
    for alloc, ids in zip(allocs, tokens, strict=True):
        n = len(ids)
        # NOTE: a new request's cached prefix is not recomputed: its step starts after it.
        seqs.append(
            StepSequence(
                alloc.prefix_len,
                alloc.extend_len,
                core.request_pages(alloc.rid),
                ids[n - alloc.extend_len :],
                alloc.rid,
                start + n - alloc.extend_len,
            )
        )
        start += n
    return seqs


def decode_sequences(core: CPAllocator, keys: list[Hashable], token_ids) -> list[StepSequence]:
    """The sequences of a decode step: one token of each request, at its end."""
    ids = np.zeros(len(keys), np.int64) if token_ids is None else token_ids
    seqs = []
    for i, key in enumerate(keys):
        n = core.request_len(key)
        pages = core.request_pages(key)
        seqs.append(StepSequence(n - 1, 1, pages, ids[i : i + 1], key, i))
    return seqs


def step_tokens(rid, tokens, probe, vocab_size: int | None) -> Any:
    """The second line behind the client's check: ids the model has (a bad id would fail
    the lanes' embedding, or assert on a GPU, after the pages were decided). Returns them
    as ``int64`` (no copy when the client sent them so)."""
    if probe is None and tokens is not None and vocab_size is not None:
        tokens = as_token_array(tokens, name=f"token_ids[{rid!r}]")
        check_vocab(tokens, vocab_size, name=f"token_ids[{rid!r}]")
    return tokens


def worth_sharing(step: StepRequest, cp_size: int) -> bool:
    """Whether one object-store copy of ``step`` beats sending it inline to every lane.

    Measured on the 2-core machine: a ``ray.put`` of a small step costs ~1.4 ms in the
    coordinator, while Ray inlines call arguments under 100 KiB at a few µs per KiB.
    """
    if step.probe is not None:
        return True
    if cp_size == 1:
        return False
    nbytes = sum(8 * s.extend_len + 4 * s.pages.shape[0] for s in step.sequences)
    return nbytes >= _SHARE_MIN_BYTES
