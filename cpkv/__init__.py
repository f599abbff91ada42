"""cpkv: a Ray-distributed context-parallel paged KV-cache manager.

The decision core (owner plans, page pools, prefix cache, allocator) imports
neither Ray nor torch; :func:`connect` starts or attaches to Ray and returns a
plain client.
"""

from cpkv.core import (
    CPAllocator,
    CPConfig,
    ExtendAllocation,
    KVShape,
    OwnerPlan,
    PrefixCache,
    build_in_seq_page_compute_owners,
    build_owner_plan,
    in_seq_page_compute_owner_unavailable_reason,
)
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
