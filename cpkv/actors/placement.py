"""Placement of the lanes: one placement-group bundle per lane."""

from __future__ import annotations

import time
from dataclasses import dataclass

import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from cpkv.actors.ray_env import NAMESPACE
from cpkv.core.config import CPConfig, KVShape
from cpkv.errors import InvalidRequestError

__all__ = ["STRATEGIES", "LanePlacement", "place_lanes"]

STRATEGIES = ("STRICT_PACK", "PACK", "SPREAD", "STRICT_SPREAD")


@dataclass(slots=True)
class LanePlacement:
    """The lanes' actors and the placement group that holds them."""

    lanes: list
    placement_group: object
    lane_names: list[str]

    def remove(self) -> None:
        for lane in self.lanes:
            ray.kill(lane, no_restart=True)
        remove_placement_group(self.placement_group)


def place_lanes(
    config: CPConfig,
    kv: KVShape,
    *,
    num_gpus_per_lane: float = 1.0,
    num_cpus_per_lane: float = 0.25,
    strategy: str = "STRICT_PACK",
    timeout_s: float = 60.0,
    name_prefix: str,
    detached: bool = False,
    model=None,
    sized_later: bool = False,
) -> LanePlacement:
    """Reserve one bundle per lane and start a lane actor in each.

    Args:
        config: pool shape; ``cp_size`` lanes are placed.
        kv: KV tensor shape of each lane.
        num_gpus_per_lane: GPUs a lane takes (fractional packs lanes on one GPU;
            0 runs lanes without a GPU).
        num_cpus_per_lane: logical CPUs a lane reserves.
        strategy: placement-group strategy, one of :data:`STRATEGIES`.
        timeout_s: how long to wait for the bundles and for every lane to have started
            (its process up, torch imported, the model loaded).
        name_prefix: the lane actors are named ``{prefix}lane{r}`` (namespace ``cpkv``) and
            the placement group ``{prefix}lanes``; the coordinator finds them by name.
        detached: outlive the creating driver.
        model: a :class:`cpkv.models.spec.ModelSpec` every lane loads.
        sized_later: create the lanes without a shard (sized from free memory later).

    Raises:
        InvalidRequestError: a bad strategy or resource amount.
        TimeoutError: the cluster cannot fit the bundles, or the lanes did not start, in time.
        ray.exceptions.RayActorError: a lane failed to start (its constructor raised).
    """
    from cpkv.actors.lane import LaneActor

    if strategy not in STRATEGIES:
        raise InvalidRequestError(f"strategy={strategy!r}; expected one of {STRATEGIES}")
    if num_gpus_per_lane < 0 or num_cpus_per_lane < 0:
        raise InvalidRequestError(
            f"num_gpus_per_lane={num_gpus_per_lane}, num_cpus_per_lane={num_cpus_per_lane} "
            "must be >= 0"
        )
    if num_gpus_per_lane > 1 and num_gpus_per_lane != int(num_gpus_per_lane):
        raise InvalidRequestError(
            f"num_gpus_per_lane={num_gpus_per_lane}: above 1 it must be whole"
        )
    bundle = {"CPU": num_cpus_per_lane, "GPU": num_gpus_per_lane}
    bundle = {k: v for k, v in bundle.items() if v > 0} or {"CPU": 0.01}
    pg = placement_group(
        [dict(bundle) for _ in range(config.cp_size)],
        strategy=strategy,
        name=f"{name_prefix}lanes",
        lifetime="detached" if detached else None,
    )
    deadline = time.monotonic() + timeout_s
    try:
        ray.get(pg.ready(), timeout=timeout_s)
    except ray.exceptions.GetTimeoutError:
        remove_placement_group(pg)
        raise TimeoutError(
            f"placement group of {config.cp_size} x {bundle} ({strategy}) not ready after "
            f"{timeout_s}s; cluster resources: {ray.cluster_resources()}"
        ) from None
    lanes, names = [], []
    for r in range(config.cp_size):
        names.append(f"{name_prefix}lane{r}")
        opts = dict(
            num_cpus=num_cpus_per_lane,
            num_gpus=num_gpus_per_lane,
            name=names[-1],
            namespace=NAMESPACE,
            scheduling_strategy=PlacementGroupSchedulingStrategy(
                placement_group=pg, placement_group_bundle_index=r
            ),
        )
        if detached:
            opts["lifetime"] = "detached"
        num_pages = None if sized_later else config.num_pages_per_lane
        lanes.append(
            LaneActor.options(**opts).remote(
                r, config.cp_size, num_pages, config.page_size, kv, model
            )
        )
    placement = LanePlacement(lanes, pg, names)
    # NOTE: wait here, not in the coordinator: a cold lane (a new process importing torch,
    # loading weights) can take tens of seconds on a busy machine, longer than a request's
    # timeout, and a lane that cannot start says why here instead of as a dead lane later.
    try:
        ray.get(
            [lane.info.remote() for lane in lanes],
            timeout=max(0.1, deadline - time.monotonic()),
        )
    except ray.exceptions.GetTimeoutError:
        placement.remove()
        raise TimeoutError(f"{config.cp_size} lanes not started after {timeout_s}s") from None
    except Exception:
        placement.remove()
        raise
    return placement
