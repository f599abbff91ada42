"""The coordinator as plain Python: the allocator's owner behind calls, leases and a reply
cache, the lanes' moves and their health. The Ray actor (cpkv.actors.coordinator) only
wraps it."""

from cpkv.coordinator.coordinator import Coordinator

__all__ = ["Coordinator"]
