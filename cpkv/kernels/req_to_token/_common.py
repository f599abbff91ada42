"""What only the ``req_to_token`` kernels share: the table check, per-request batches, counts."""

from __future__ import annotations

from collections.abc import Iterator

import torch

from cpkv.kernels._common import INT_DTYPES, check_tensor

# NOTE: CUDA caps grid axes 1 and 2 at 65535 programs; launchers that put requests on axis 1
# launch in chunks of at most this many requests.
MAX_GRID_Y = 65535


def request_chunks(
    bs: int, *per_request: torch.Tensor
) -> Iterator[tuple[int, tuple[torch.Tensor, ...]]]:
    """Split per-request tensors (requests on the last dim) into launches of <= MAX_GRID_Y.

    Yields:
        (requests in the chunk, the tensors sliced to it); the common single chunk is the
        tensors themselves, so the hot path pays for no slicing.
    """
    if bs <= MAX_GRID_Y:
        yield bs, per_request
        return
    for r0 in range(0, bs, MAX_GRID_Y):
        r1 = min(bs, r0 + MAX_GRID_Y)
        yield r1 - r0, tuple(t[..., r0:r1] for t in per_request)


def check_table(kernel: str, req_to_token: object) -> torch.Tensor:
    """Check a ``req_to_token`` table: 2-D, int32/int64, rows with unit column stride.

    Raises:
        ValueError: naming the offending shape, dtype or strides.
    """
    t = check_tensor(kernel, "req_to_token", req_to_token, ndim=2, dtypes=INT_DTYPES)
    if t.shape[1] > 1 and t.stride(1) != 1:
        raise ValueError(
            f"{kernel}: req_to_token rows must be contiguous, got shape {tuple(t.shape)} "
            f"with strides {t.stride()}"
        )
    return t


def check_same_len(kernel: str, **tensors: torch.Tensor) -> int:
    """Check that all given 1-D tensors have one length; return it.

    Raises:
        ValueError: listing each tensor's shape when they differ.
    """
    lens = {t.shape[0] for t in tensors.values()}
    if len(lens) > 1:
        listing = ", ".join(f"{name} has shape {tuple(t.shape)}" for name, t in tensors.items())
        raise ValueError(f"{kernel}: per-request tensors must have one length, got {listing}")
    return next(iter(lens))


def check_count(kernel: str, name: str, count: int, total: int, what: str) -> None:
    """Check that ``name`` holds as many elements as the lengths ``what`` sum to.

    Raises:
        ValueError: naming both numbers.
    """
    if count != total:
        raise ValueError(f"{kernel}: {name} has {count} elements but {what} sum to {total}")
