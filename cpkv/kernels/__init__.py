"""Triton kernels for the paged KV cache, each with a plain-torch reference in :mod:`.naive`.

Every launcher validates its inputs (``ValueError`` naming the offending values) and falls back
to the reference when Triton cannot run (CPU tensors without ``TRITON_INTERPRET=1``, or no
Triton), logging that once per kernel on the ``cpkv.kernels`` logger.
"""

from __future__ import annotations

from cpkv.kernels.alloc_extend_slots import alloc_extend_slots
from cpkv.kernels.gather_kv import gather_kv
from cpkv.kernels.get_last_loc import get_last_loc
from cpkv.kernels.merge_attn_states import merge_attn_states
from cpkv.kernels.paged_attention import paged_partial_attention
from cpkv.kernels.store_kv import store_kv
from cpkv.kernels.write_req_to_token import write_req_to_token

__all__ = [
    "alloc_extend_slots",
    "gather_kv",
    "get_last_loc",
    "merge_attn_states",
    "paged_partial_attention",
    "store_kv",
    "write_req_to_token",
]
