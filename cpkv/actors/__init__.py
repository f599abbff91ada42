"""Thin Ray shells over the core: the coordinator, the lanes and the pool that places them."""

from cpkv.actors.coordinator import CoordinatorActor
from cpkv.actors.lane import LaneActor
from cpkv.actors.pool import LaneOptions, Pool

__all__ = ["CoordinatorActor", "LaneActor", "LaneOptions", "Pool"]
