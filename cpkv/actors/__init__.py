"""Thin Ray shells over the core: the coordinator, the lanes and their placement."""

from cpkv.actors.coordinator import CoordinatorActor
from cpkv.actors.lane import LaneActor
from cpkv.actors.placement import LanePlacement, place_lanes

__all__ = ["CoordinatorActor", "LaneActor", "LanePlacement", "place_lanes"]
