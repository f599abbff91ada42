"""Synthetic prefill workloads shared by the demo, the benchmarks and the load tests."""

from __future__ import annotations

import numpy as np

__all__ = ["kv_for_tokens", "shared_prefix_prompts"]


def shared_prefix_prompts(
    num_prompts: int,
    *,
    num_prefixes: int = 3,
    prefix_len: int = 256,
    suffix_lens: tuple[int, int] = (200, 900),
    vocab: int = 1000,
    seed: int = 0,
    odd_lengths: bool = False,
) -> list[np.ndarray]:
    """Prompts that start with one of a few shared prefixes (int64 token ids).

    Args:
        num_prompts: how many prompts; prompt ``i`` starts with prefix ``i % num_prefixes``.
        num_prefixes: distinct shared prefixes.
        prefix_len: tokens of each prefix.
        suffix_lens: ``[low, high)`` of each prompt's own random suffix length.
        vocab: token ids are drawn from ``[0, vocab)``.
        seed: the generator seed (equal seeds give equal prompts).
        odd_lengths: make every prompt's length odd (a suffix one token shorter when needed),
            so prompts end mid-page for any even page size.

    Returns:
        ``num_prompts`` int64 arrays.
    """
    rng = np.random.default_rng(seed)
    prefixes = [
        rng.integers(0, vocab, size=prefix_len, dtype=np.int64) for _ in range(num_prefixes)
    ]
    out = []
    for i in range(num_prompts):
        suffix = rng.integers(0, vocab, size=int(rng.integers(*suffix_lens)), dtype=np.int64)
        if odd_lengths and (prefix_len + suffix.size) % 2 == 0:
            suffix = suffix[:-1] if suffix.size else rng.integers(0, vocab, 1, dtype=np.int64)
        out.append(np.concatenate([prefixes[i % num_prefixes], suffix]))
    return out


def kv_for_tokens(
    tokens: np.ndarray, positions: np.ndarray, num_heads: int, head_dim: int, dtype: str = "float32"
):
    """Deterministic K/V ``[T, heads, head_dim]`` of (token, position).

    The same token at the same position always gets the same K/V, so a prefix
    served from the cache must read back equal to what a fresh prefill writes.
    """
    import torch

    base = torch.as_tensor((tokens % 4096) * 8 + (positions % 8), dtype=torch.float32)
    grid = torch.arange(num_heads * head_dim, dtype=torch.float32).reshape(1, num_heads, head_dim)
    k = (base[:, None, None] * 0.001 + grid * 0.01).to(getattr(torch, dtype))
    return k, -k
