"""Kernels on sglang's ``req_to_token`` table (``[max_reqs, max_context_len]`` token slots, one
row per request), each with a plain-torch reference in :mod:`.naive`.

No cpkv path calls these: the lanes attend through page tables the step plan builds
(:class:`cpkv.kernels.PagedKVTable`), not through a per-token table. They serve an engine that
keeps sglang's token table. Validation and fallback behave as in :mod:`cpkv.kernels`.
"""

from __future__ import annotations

from cpkv.kernels.req_to_token.alloc_extend_slots import alloc_extend_slots
from cpkv.kernels.req_to_token.get_last_loc import get_last_loc
from cpkv.kernels.req_to_token.write_req_to_token import write_req_to_token

__all__ = ["alloc_extend_slots", "get_last_loc", "write_req_to_token"]
