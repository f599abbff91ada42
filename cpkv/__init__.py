"""cpkv: a Ray-distributed context-parallel paged KV-cache manager.

The decision core (owner plans, page pools, prefix cache, allocator) imports
neither Ray nor torch; :func:`connect` starts or attaches to Ray and returns a
plain client.
"""

from cpkv.allocator import CPAllocator, ExtendAllocation
from cpkv.config import CPConfig, KVShape
from cpkv.errors import (
    CoordinatorUnavailableError,
    CPKVError,
    InvalidRequestError,
    KVCapacityWaitError,
    LaneUnavailableError,
    LeaseExpiredError,
    RequestTimeoutError,
    StepFailedError,
)
from cpkv.owners import (
    OwnerPlan,
    build_in_seq_page_compute_owners,
    build_owner_plan,
    in_seq_page_compute_owner_unavailable_reason,
)
from cpkv.prefix_cache import PrefixCache

__all__ = [
    "CPAllocator",
    "CPConfig",
    "CPKVError",
    "CoordinatorUnavailableError",
    "ExtendAllocation",
    "InvalidRequestError",
    "KVCapacityWaitError",
    "KVShape",
    "LaneUnavailableError",
    "LeaseExpiredError",
    "OwnerPlan",
    "PrefixCache",
    "RequestTimeoutError",
    "StepFailedError",
    "build_in_seq_page_compute_owners",
    "build_owner_plan",
    "connect",
    "in_seq_page_compute_owner_unavailable_reason",
]

__version__ = "0.1.0"


def connect(*args, **kwargs):
    """Start or attach to Ray and return a :class:`cpkv.client.CPKVClient` (see there)."""
    from cpkv.client import connect as _connect

    return _connect(*args, **kwargs)
