"""The decision core: page layout, owner plans, page pools, page identity, prefix cache,
request table, capacity (eviction and waits), move journal, the allocator façade over
them, leases and the reply cache. Plain Python and numpy: it imports neither Ray nor
torch, so tests step it directly and any process can hold one."""

from cpkv.core.allocator import CPAllocator, ExtendAllocation
from cpkv.core.config import CPConfig, KVShape
from cpkv.core.owners import (
    OwnerPlan,
    build_in_seq_page_compute_owners,
    build_owner_plan,
    in_seq_page_compute_owner_unavailable_reason,
)
from cpkv.core.prefix_cache import PrefixCache

__all__ = [
    "CPAllocator",
    "CPConfig",
    "ExtendAllocation",
    "KVShape",
    "OwnerPlan",
    "PrefixCache",
    "build_in_seq_page_compute_owners",
    "build_owner_plan",
    "in_seq_page_compute_owner_unavailable_reason",
]
