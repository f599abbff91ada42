"""The client's checks of its callers' arguments, on the caller's side before any actor call:
each returns the checked value, passed on as it is."""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass

import numpy as np

from cpkv.core.config import KVShape
from cpkv.core.page_hash import TokenDigest
from cpkv.core.steps import check_mode
from cpkv.core.validate import (
    as_token_array,
    check_distinct,
    check_float,
    check_int,
    check_rid,
    check_rids,
    check_salt,
    check_vocab,
)
from cpkv.errors import InvalidRequestError

__all__ = [
    "RequestChecks",
    "check_free",
    "check_greedy",
    "check_lease",
    "check_probe",
    "check_timeout",
    "num_tokens",
    "stop_tokens",
]


@dataclass(frozen=True)
class RequestChecks:
    """A request's arguments checked against the pool: its context limit, its model's
    vocabulary (``None``: no model) and its K/V shape (a probe's)."""

    max_context_len: int
    vocab_size: int | None
    kv: KVShape

    def tokens(self, rid: Hashable, token_ids, *, step: bool = False) -> np.ndarray:
        """``int64 [n]`` token ids, checked once here and passed on as they are."""
        tokens = as_token_array(token_ids, name=f"token_ids[{rid!r}]")
        if step:
            check_vocab(tokens, self.vocab_size, name=f"token_ids[{rid!r}]")
        if tokens.shape[0] > self.max_context_len:
            raise InvalidRequestError(
                f"rid={rid!r}: {tokens.shape[0]} tokens > max_context_len={self.max_context_len}"
            )
        return tokens

    def extend(
        self, rid, token_ids, cache_salt, *, step: bool = False
    ) -> tuple[Hashable, np.ndarray]:
        """Validate an extend's arguments on the caller's side (before any actor call);
        a step's token ids are also checked against the model's vocabulary."""
        rid = check_rid(rid)
        tokens = self.tokens(rid, token_ids, step=step)
        check_salt(cache_salt)
        return rid, tokens

    def batch(
        self, items, cache_salt, what: str, *, step: bool = False
    ) -> list[tuple[Hashable, np.ndarray]]:
        """A batch's ``(rid, tokens)`` pairs checked on the caller's side."""
        if isinstance(items, (str, bytes)) or not isinstance(items, (list, tuple)):
            raise InvalidRequestError(
                f"{what} takes a list of (rid, token_ids) pairs, got {type(items).__name__}"
            )
        checked = []
        for i, item in enumerate(items):
            if not isinstance(item, (list, tuple)) or len(item) != 2:
                raise InvalidRequestError(f"{what}: item {i} = {item!r:.60} is not (rid, tokens)")
            rid = check_rid(item[0])
            checked.append((rid, self.tokens(rid, item[1], step=step)))
        if not checked:
            raise InvalidRequestError(f"{what} got an empty batch")
        check_distinct([rid for rid, _ in checked], what)
        check_salt(cache_salt)
        return checked

    def decode(
        self, rids: Sequence[Hashable], token_ids, *, step: bool = False
    ) -> tuple[list, np.ndarray | None]:
        """A decode's distinct rids and their token ids (``None`` where none are given)."""
        rids = check_rids(rids)
        if not rids:
            raise InvalidRequestError("allocate_decode got no rids")
        check_distinct(rids, "allocate_decode")
        toks = None if token_ids is None else as_token_array(token_ids)
        if toks is not None and toks.shape[0] != len(rids):
            raise InvalidRequestError(
                f"allocate_decode got {toks.shape[0]} token ids for {len(rids)} rids"
            )
        if step and toks is not None:
            check_vocab(toks, self.vocab_size)
        return rids, toks

    def step(self, mode: str, probe, num_tokens: int) -> str:
        """The step's mode; a step without a probe needs the pool's model, and a probe is
        ``(q, k, v)`` of the step's ``num_tokens`` tokens in the pool's K/V shape."""
        mode = check_mode(mode)
        if probe is None and self.vocab_size is None:
            raise InvalidRequestError(
                "this pool has no model: connect(..., model=...) to prefill and decode"
            )
        if probe is not None:
            check_probe(probe, num_tokens, self.kv)
        return mode


def check_free(rid, cache, committed_len) -> Hashable:
    """A free's rid, once its ``cache`` and ``committed_len`` are checked."""
    rid = check_rid(rid)
    if not isinstance(cache, (bool, np.bool_)):
        raise InvalidRequestError(f"cache={cache!r} must be True or False")
    if committed_len is not None:
        check_int("committed_len", committed_len, minimum=0)
    return rid


def check_timeout(timeout_s: object) -> float:
    """A call timeout: a float > 0."""
    value = check_float("timeout_s", timeout_s)
    if value <= 0:  # every call would time out at once
        raise InvalidRequestError(f"timeout_s={timeout_s!r} must be > 0")
    return value


def check_lease(lease_s: object) -> float | None:
    """A lease: > 0, or ``None`` for none."""
    if lease_s is not None and not check_float("lease_s", lease_s) > 0:
        raise InvalidRequestError(f"lease_s={lease_s!r} must be > 0 or None")
    return lease_s


def num_tokens(tokens) -> int:
    """Tokens of a step's checked ids (an array, or a digest of them)."""
    return int(tokens.num_tokens) if isinstance(tokens, TokenDigest) else len(tokens)


def check_probe(probe, num_tokens: int, kv: KVShape) -> None:
    """Raise unless ``probe`` is ``(q, k, v)``: floating tensors ``[num_tokens, Hq, D]`` and
    ``[num_tokens, num_heads, D]`` (``Hq`` a multiple of the pool's ``num_heads``)."""
    import torch

    if (
        not isinstance(probe, (tuple, list))
        or len(probe) != 3
        or not all(isinstance(t, torch.Tensor) and t.is_floating_point() for t in probe)
    ):
        raise InvalidRequestError(f"probe must be (q, k, v) floating torch tensors: {probe!r:.80}")
    q, k, v = probe
    want = (num_tokens, kv.num_heads, kv.head_dim)
    for name, t in (("k", k), ("v", v)):
        if tuple(t.shape) != want:
            raise InvalidRequestError(f"probe {name} has shape {tuple(t.shape)}, expected {want}")
    if (
        q.ndim != 3
        or (q.shape[0], q.shape[2]) != (num_tokens, kv.head_dim)
        or (q.shape[1] % kv.num_heads)
    ):
        raise InvalidRequestError(
            f"probe q has shape {tuple(q.shape)}, expected [{num_tokens}, a multiple of "
            f"{kv.num_heads}, {kv.head_dim}]"
        )


def check_greedy(greedy: object, probe: object) -> bool:
    """``greedy`` as a bool (a numpy bool too), checked against ``probe``."""
    if not isinstance(greedy, (bool, np.bool_)):
        raise InvalidRequestError(f"greedy={greedy!r} must be True or False")
    if greedy and probe is not None:
        raise InvalidRequestError("greedy=True needs the pool's model, not a probe")
    return bool(greedy)


def stop_tokens(eos_token_id: object) -> frozenset[int]:
    """``generate``'s stop tokens: none, one id or a collection of ids."""
    if eos_token_id is None:
        return frozenset()
    if isinstance(eos_token_id, np.ndarray):
        eos_token_id = eos_token_id.reshape(-1).tolist()
    ids = (
        eos_token_id if isinstance(eos_token_id, (list, tuple, set, frozenset)) else [eos_token_id]
    )
    return frozenset(check_int("eos_token_id", t, minimum=0) for t in ids)
