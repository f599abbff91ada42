"""Validated configuration of a CP KV pool and of the KV tensors a lane holds."""

from __future__ import annotations

from dataclasses import dataclass

from cpkv.core.validate import check_int

__all__ = ["CPConfig", "KVShape"]

_DTYPES = ("float16", "bfloat16", "float32")


@dataclass(slots=True, frozen=True)
class CPConfig:
    """Shape of the paged pool shared by ``cp_size`` lanes.

    Args:
        cp_size: number of CP ranks (= lanes), >= 1.
        page_size: token slots per page, >= 1.
        num_pages_per_lane: pages in each lane's shard, local page 0 included
            (it is reserved as the padding target), so >= 2.
        max_reqs: rows of the request table (concurrent requests).
        max_context_len: most tokens one request may hold.
        owner_split: ``zigzag`` (default) or ``contiguous`` (an ablation: one range a lane).
    """

    cp_size: int
    page_size: int
    num_pages_per_lane: int
    max_reqs: int = 256
    max_context_len: int = 1 << 20
    owner_split: str = "zigzag"

    def __post_init__(self) -> None:
        check_int("cp_size", self.cp_size, minimum=1)
        check_int("page_size", self.page_size, minimum=1)
        check_int("num_pages_per_lane", self.num_pages_per_lane, minimum=2)
        check_int("max_reqs", self.max_reqs, minimum=1)
        check_int("max_context_len", self.max_context_len, minimum=1)
        if self.owner_split not in ("zigzag", "contiguous"):
            from cpkv.errors import InvalidRequestError

            raise InvalidRequestError(
                f"owner_split={self.owner_split!r}; expected 'zigzag' or 'contiguous'"
            )
        # NOTE: global page ids are int32; keep them representable.
        total = self.cp_size * self.num_pages_per_lane
        if total >= 2**31:
            from cpkv.errors import InvalidRequestError

            raise InvalidRequestError(
                f"cp_size * num_pages_per_lane = {total} does not fit int32 page ids"
            )

    @property
    def num_usable_pages_per_lane(self) -> int:
        """Pages a lane can hand out (all but the reserved page 0)."""
        return self.num_pages_per_lane - 1


@dataclass(slots=True, frozen=True)
class KVShape:
    """The K/V tensors of one lane: per layer ``[pages, page_size, num_heads, head_dim]``."""

    num_layers: int = 1
    num_heads: int = 8
    head_dim: int = 128
    dtype: str = "bfloat16"

    def __post_init__(self) -> None:
        check_int("num_layers", self.num_layers, minimum=1)
        check_int("num_heads", self.num_heads, minimum=1)
        check_int("head_dim", self.head_dim, minimum=1)
        if self.dtype not in _DTYPES:
            from cpkv.errors import InvalidRequestError

            raise InvalidRequestError(f"dtype={self.dtype!r}; expected one of {_DTYPES}")
