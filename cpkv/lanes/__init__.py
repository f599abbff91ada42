"""One lane's shard of the paged KV pool: page occupancy, KV memory and kernel calls."""

from cpkv.lanes.shard import LaneShard

__all__ = ["LaneShard"]
