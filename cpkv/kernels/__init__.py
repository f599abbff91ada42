"""Triton kernels for the paged KV cache, each with a plain-torch reference in :mod:`.naive`.

Every launcher validates its inputs (``ValueError`` naming the offending values) and falls back
to the reference when Triton cannot run (CPU tensors without ``TRITON_INTERPRET=1``, or no
Triton), logging that once per kernel on the ``cpkv.kernels`` logger.

These are the kernels the lanes call; the kernels on sglang's ``req_to_token`` table live in
:mod:`cpkv.kernels.req_to_token`.
"""

from __future__ import annotations

from cpkv.kernels._common import HAS_TRITON
from cpkv.kernels.gather_kv import gather_kv
from cpkv.kernels.merge_attn_states import merge_attn_states
from cpkv.kernels.page_table import PagedKVTable
from cpkv.kernels.paged_attention import paged_partial_attention
from cpkv.kernels.paged_decode import paged_decode_attention
from cpkv.kernels.rms_norm import rms_norm
from cpkv.kernels.rope import rope_qkv
from cpkv.kernels.store_kv import store_kv

__all__ = [
    "HAS_TRITON",
    "PagedKVTable",
    "gather_kv",
    "merge_attn_states",
    "paged_decode_attention",
    "paged_partial_attention",
    "rms_norm",
    "rope_qkv",
    "store_kv",
]
