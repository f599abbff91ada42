"""A pool's actors: the coordinator, its lanes and the placement group that holds them.

:meth:`Pool.open` attaches to the named coordinator, or creates the pool: one placement-group
bundle per lane, a lane actor in each, pages sized from free memory when asked, then the
coordinator. :meth:`Pool.stop` takes all of it down, from any process.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import time
import uuid
from dataclasses import dataclass

import ray
from ray.util.placement_group import (
    PlacementGroup,
    placement_group,
    placement_group_table,
    remove_placement_group,
)
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from cpkv.actors.ray_env import NAMESPACE, embedded_ray_released, ensure_ray, take_embedded_ray
from cpkv.core.config import CPConfig, KVShape
from cpkv.core.validate import check_float
from cpkv.errors import CoordinatorUnavailableError, InvalidRequestError, RequestTimeoutError

__all__ = ["STRATEGIES", "LaneOptions", "Pool"]

logger = logging.getLogger("cpkv.actors.pool")

STRATEGIES = ("STRICT_PACK", "PACK", "SPREAD", "STRICT_SPREAD")


@dataclass(slots=True)
class LaneOptions:
    """How a new pool's lanes are placed and started.

    Attributes:
        num_gpus_per_lane: GPUs a lane takes (fractional packs lanes on one GPU; 0 runs lanes
            without a GPU); ``None``: 1 where the cluster has at least ``cp_size`` GPUs,
            else an equal share of one (packed: :func:`default_gpus_per_lane`), 0 where it
            has none.
        num_cpus_per_lane: logical CPUs a lane reserves.
        strategy: placement-group strategy, one of :data:`STRATEGIES`.
        start_timeout_s: how long the lanes may take to be placed and started (their
            processes up, torch imported, the model loaded) and the coordinator to answer.
        detached: the actors outlive the creating driver.
        gpu_memory_utilization: size each lane's pages from this fraction of its device's
            memory instead of ``num_pages_per_lane`` (``None``: don't).
        heartbeat_s: the coordinator's lane heartbeat and lease-check period.
        timeout_s: the clients' call timeout: attaching waits this long for the coordinator,
            which waits as long for a dead lane to come back.
        lane_hang_s: a lane silent this long is killed and brought back.
        compiled_steps: steps reach the lanes through a Ray compiled graph, not one actor
            call each (a step's fixed cost, issue 22).
    """

    num_gpus_per_lane: float | None = None
    num_cpus_per_lane: float = 0.25
    strategy: str = "STRICT_PACK"
    start_timeout_s: float = 300.0
    detached: bool = False
    gpu_memory_utilization: float | None = None
    heartbeat_s: float = 1.0
    timeout_s: float = 60.0
    lane_hang_s: float | None = None
    compiled_steps: bool = False

    def __post_init__(self) -> None:
        if self.strategy not in STRATEGIES:
            raise InvalidRequestError(f"strategy={self.strategy!r}; expected one of {STRATEGIES}")
        if self.gpu_memory_utilization is not None and not 0 < self.gpu_memory_utilization <= 1:
            raise InvalidRequestError(
                f"gpu_memory_utilization={self.gpu_memory_utilization!r} must be in (0, 1]"
            )


@dataclass(slots=True)
class Pool:
    """One pool: its coordinator, lanes and (when known) placement group.

    Attributes:
        name: the coordinator's actor name (namespace ``cpkv``; ``None`` when not known).
        coordinator: the coordinator actor handle.
        config: the pool's shape as the coordinator runs it.
        lanes: the lane actor handles, in rank order.
        lane_names: their actor names.
        group_name: the lanes' placement group (``None``: looked up by the lanes' names
            when the pool is stopped, for a pool this process did not create).
        created: this process created the pool (its creator stops it).
        owns_ray: the pool holds a share of the local Ray this process started (the last
            pool to let go, :meth:`release_ray`, stops it).
        model: the model spec of a pool created here (a checkpoint written for it is
            removed with it).
        kv: the lanes' K/V tensors, as the coordinator runs them.
        vocab_size: the pool's model's vocabulary (``None``: no model).
        detached: a pool created here whose actors outlive this driver.
        stopped: :meth:`stop` ran (a second call does nothing).
    """

    name: str | None
    coordinator: object
    config: CPConfig
    lanes: list
    lane_names: list[str]
    group_name: str | None = None
    created: bool = False
    owns_ray: bool = False
    model: object = None
    kv: KVShape | None = None
    vocab_size: int | None = None
    detached: bool = False
    stopped: bool = False

    @classmethod
    def open(
        cls,
        address: str | None,
        name: str,
        config: CPConfig,
        kv: KVShape,
        options: LaneOptions,
        model=None,
    ) -> Pool:
        """Attach to the coordinator ``name``, or create the pool; Ray started when needed.

        Args:
            address: as :func:`cpkv.connect`.
            name: the coordinator's actor name.
            config: the pool's shape (``num_pages_per_lane`` replaced by the measured one
                when ``options.gpu_memory_utilization`` is set).
            kv: each lane's K/V tensors.
            options: how lanes are placed and started.
            model: a :class:`cpkv.models.spec.ModelSpec` every lane loads, or ``None``.

        Returns:
            The pool; ``created`` tells whether this call made it. An attached pool's
            ``config`` is the existing one (the caller compares it).

        Raises:
            InvalidRequestError: a bad strategy or resource amount, or memory for too few pages.
            TimeoutError: the lanes could not be placed or started in time.
        """
        owns_ray = False
        try:  # NOTE: any failure removes the checkpoint written for this pool's lanes
            ensure_ray(address, num_lanes=config.cp_size)
            # NOTE: a client that attached to a cluster leaves it connected; only the embedded
            # Ray started here is stopped, by the last of this process's pools to let go.
            owns_ray = address is None and take_embedded_ray()
            pool = cls.attach(name, options.timeout_s)
            if pool is None:
                pool = cls._create(name, config, kv, options, model, embedded=owns_ray)
            elif model is not None:
                model.remove()  # a checkpoint written for a pool that exists already
        except BaseException:
            if model is not None:
                model.remove()
            if owns_ray:
                embedded_ray_released()
            raise
        pool.owns_ray = owns_ray
        return pool

    def release_ray(self) -> None:
        """Give back this pool's share of the embedded Ray (the last share stops it)."""
        if self.owns_ray:
            self.owns_ray = False
            embedded_ray_released()

    @classmethod
    def attach(cls, name: str, timeout_s: float = 60.0) -> Pool | None:
        """The running pool whose coordinator is ``name``; ``None`` when there is none."""
        try:
            coordinator = ray.get_actor(name, namespace=NAMESPACE)
        except ValueError:
            return None
        return cls._of(name, coordinator, timeout_s)

    @classmethod
    def _of(cls, name: str, coordinator, timeout_s: float, group_name: str | None = None) -> Pool:
        try:
            info = ray.get(coordinator.hello.remote(), timeout=timeout_s)  # no client: no lease
        except ray.exceptions.GetTimeoutError:
            raise RequestTimeoutError(
                f"hello: {name!r} gave no answer within {timeout_s}s"
            ) from None
        except (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError) as e:
            detail = f"hello: coordinator {name!r} died ({type(e).__name__})"
            raise CoordinatorUnavailableError(detail) from None
        return cls(
            name,
            coordinator,
            info["config"],
            info["lanes"],
            info["lane_names"],
            group_name,
            kv=info.get("kv"),
            vocab_size=info.get("vocab_size"),
        )

    @classmethod
    def _create(
        cls,
        name: str,
        config: CPConfig,
        kv: KVShape,
        options: LaneOptions,
        model,
        embedded: bool = False,
    ) -> Pool:
        gpus = options.num_gpus_per_lane
        if gpus is None:
            gpus = default_gpus_per_lane(ray.cluster_resources().get("GPU", 0), config.cp_size)
        # NOTE: unique per creation: two drivers racing to create one pool must not collide
        # on lane names; the loser removes its lanes below.
        names = _Names(f"{name}-{uuid.uuid4().hex[:8]}-")
        sized_later = options.gpu_memory_utilization is not None
        group, lanes = _place_lanes(config, kv, names, gpus, options, model, sized_later, embedded)
        if sized_later:
            try:
                config = _size_from_memory(config, lanes, gpus, options)
            except BaseException:
                _remove(lanes, group)
                raise
        opts: dict = {"name": name, "namespace": NAMESPACE}
        if options.detached:
            opts["lifetime"] = "detached"
        from cpkv.actors.coordinator import CoordinatorActor

        vocab = model.config.vocab_size if model is not None else None
        try:
            coordinator = CoordinatorActor.options(**opts).remote(
                config,
                kv,
                names.lanes(config.cp_size),
                options.heartbeat_s,
                options.timeout_s,
                options.lane_hang_s,
                vocab,
                options.compiled_steps,
            )
        except ValueError:  # the name is taken: another driver's coordinator won the race
            _remove(lanes, group)
            if model is not None:
                model.remove()
            winner = ray.get_actor(name, namespace=NAMESPACE)
            return cls._of(name, winner, options.start_timeout_s)  # its group found at stop
        try:
            # The first answer comes once the coordinator has reset its lanes.
            pool = cls._of(name, coordinator, options.start_timeout_s, names.group)
        except BaseException:  # it died or hung starting: nothing of the pool stays
            with contextlib.suppress(Exception):
                ray.kill(coordinator, no_restart=True)
            _remove(lanes, group)
            raise
        # NOTE: keep the creator's own handles: lanes not detached die with their last one.
        pool.lanes, pool.created, pool.model = lanes, True, model
        pool.detached = options.detached
        return pool

    def stop(self) -> None:
        """Stop the coordinator, its lanes and their placement group (for every client);
        a second call does nothing."""
        if self.stopped or not ray.is_initialized():  # (a call would start a new Ray)
            return
        self.stopped = True
        with contextlib.suppress(Exception):  # already gone
            ray.get(self.coordinator.shutdown.remote(), timeout=5)
        for actor in (self.coordinator, *self.lanes):
            with contextlib.suppress(Exception):
                ray.kill(actor, no_restart=True)
        group = _find_group(self.lane_names, self.group_name)
        if group is not None:
            with contextlib.suppress(Exception):  # removed meanwhile (another stopped it)
                remove_placement_group(group)
        if self.model is not None:
            self.model.remove()
            self.model = None


# A stopped pool's placement group gives its resources back asynchronously: measured on the
# 2-core machine, its GPU showed free 0.26 s after stop() returned (a bench sweep's next point
# was refused). Short of that, a pool waits this long for them before it refuses.
_EMBEDDED_RELEASE_S = 3.0


def _embedded_short(bundle: dict, cp_size: int) -> tuple[dict, dict]:
    """What the embedded Ray has free, and what ``cp_size`` lanes of ``bundle`` lack of it
    (empty: they fit), waiting up to :data:`_EMBEDDED_RELEASE_S` for a stopped pool's share."""
    need = {k: v * cp_size for k, v in bundle.items()}
    deadline = time.monotonic() + _EMBEDDED_RELEASE_S
    while True:
        free = ray.available_resources()
        short = {k: v for k, v in need.items() if v > free.get(k, 0.0) + 1e-9}
        if not short or time.monotonic() >= deadline:
            return free, short
        time.sleep(0.05)


@dataclass(frozen=True, slots=True)
class _Names:
    """One creation's actor names: lanes ``{prefix}lane{r}``, placement group
    ``{prefix}lanes`` (namespace ``cpkv``); the coordinator finds its lanes by name."""

    prefix: str

    @property
    def group(self) -> str:
        return f"{self.prefix}lanes"

    def lanes(self, cp_size: int) -> list[str]:
        return [f"{self.prefix}lane{r}" for r in range(cp_size)]


def _find_group(lane_names: list[str], name: str | None = None) -> PlacementGroup | None:
    """The live placement group ``name``, or named with the lanes ``lane_names`` (one
    :class:`_Names`), whichever Ray namespace created it (the table lists them all; a
    lookup by name sees only the caller's)."""
    from ray._raylet import PlacementGroupID

    for group_id, info in placement_group_table().items():
        group = info.get("name") or ""
        if info.get("state") == "REMOVED" or not group.endswith("lanes"):
            continue
        names = _Names(group.removesuffix("lanes"))
        if group == name or names.lanes(len(lane_names)) == list(lane_names):
            return PlacementGroup(PlacementGroupID(bytes.fromhex(group_id)))
    return None


def _place_lanes(
    config: CPConfig,
    kv: KVShape,
    names: _Names,
    num_gpus_per_lane: float,
    options: LaneOptions,
    model,
    sized_later: bool,
    embedded: bool = False,
) -> tuple[object, list]:
    """Reserve one bundle per lane and start a lane actor in each; wait until all started.

    Args:
        embedded: the Ray is the local one this process started: nothing will add room, so
            bundles that do not fit what is free fail at once instead of at the timeout.

    Raises:
        InvalidRequestError: a bad resource amount, or more than the embedded Ray has free.
        TimeoutError: the cluster cannot fit the bundles, or the lanes did not start, in time.
        ray.exceptions.RayActorError: a lane failed to start (its constructor raised).
    """
    from cpkv.actors.lane import CompiledLaneActor, LaneActor

    timeout_s = options.start_timeout_s
    # NOTE: checked before the placement group exists: Ray's own refusal of an amount comes
    # at the lanes' .options(), after the group is reserved.
    cpus = _resource_amount("num_cpus_per_lane", options.num_cpus_per_lane)
    num_gpus_per_lane = _resource_amount("num_gpus_per_lane", num_gpus_per_lane)
    if num_gpus_per_lane > 1 and num_gpus_per_lane != int(num_gpus_per_lane):
        raise InvalidRequestError(
            f"num_gpus_per_lane={num_gpus_per_lane}: above 1 it must be whole"
        )
    bundle = {"CPU": cpus, "GPU": num_gpus_per_lane}
    bundle = {k: v for k, v in bundle.items() if v > 0} or {"CPU": 0.01}
    if embedded:
        free, short = _embedded_short(bundle, config.cp_size)
        if short:
            raise InvalidRequestError(
                f"{config.cp_size} lanes of {bundle} need {short}; this process's local Ray "
                f"has { ({k: free.get(k, 0.0) for k in short}) } free (another pool holds the "
                "rest): stop it first, pass num_gpus_per_lane=, or start Ray with more"
            )
    pg = placement_group(
        [dict(bundle) for _ in range(config.cp_size)],
        strategy=options.strategy,
        name=names.group,
        lifetime="detached" if options.detached else None,
    )
    deadline = time.monotonic() + timeout_s
    try:
        ray.get(pg.ready(), timeout=timeout_s)
    except ray.exceptions.GetTimeoutError:
        remove_placement_group(pg)
        raise TimeoutError(
            f"placement group of {config.cp_size} x {bundle} ({options.strategy}) not ready "
            f"after {timeout_s}s; cluster resources: {ray.cluster_resources()}"
        ) from None
    lanes = []
    num_pages = None if sized_later else config.num_pages_per_lane
    try:  # the group is reserved: any failure here gives it back
        for r, lane_name in enumerate(names.lanes(config.cp_size)):
            opts = dict(
                num_cpus=cpus,
                num_gpus=num_gpus_per_lane,
                name=lane_name,
                namespace=NAMESPACE,
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    placement_group=pg, placement_group_bundle_index=r
                ),
            )
            if options.detached:
                opts["lifetime"] = "detached"
            lane_type = CompiledLaneActor if options.compiled_steps else LaneActor
            lanes.append(
                lane_type.options(**opts).remote(
                    r, config.cp_size, num_pages, config.page_size, kv, model
                )
            )
    except BaseException:
        _remove(lanes, pg)
        raise
    # NOTE: wait here, not in the coordinator: a cold lane (a new process importing torch,
    # loading weights) can take tens of seconds on a busy machine, longer than a request's
    # timeout, and a lane that cannot start says why here instead of as a dead lane later.
    try:
        infos = ray.get(
            [lane.info.remote() for lane in lanes],
            timeout=max(0.1, deadline - time.monotonic()),
        )
    except ray.exceptions.GetTimeoutError:
        _remove(lanes, pg)
        raise TimeoutError(f"{config.cp_size} lanes not started after {timeout_s}s") from None
    except Exception:
        _remove(lanes, pg)
        raise
    for ranks, gpu in _shared_gpus(infos):
        logger.warning(
            "lanes %s share one GPU (%s): packed lanes are for tests and development. "
            "Measured on an H100 (Llama-3.2-1B shape), four lanes packed on it took 41-53 ms "
            "a decode step at a context of a few pages, against 3.7 ms at cp_size=1 "
            "(docs/BENCHMARKS.md, 2026-12-07 (5)); give each lane a GPU of its own for "
            "cp > 1 to pay off.",
            ranks,
            gpu,
        )
    return pg, lanes


def _shared_gpus(infos: list[dict]) -> list[tuple[list[int], str]]:
    """``(ranks, gpu)`` of each physical GPU two or more CUDA lanes share, from the lanes'
    ``info()`` (lanes on CPU, logical GPUs included, share nothing)."""
    by_gpu: dict[tuple[str | None, tuple[str, ...]], list[int]] = {}
    for rank, info in enumerate(infos):
        if str(info.get("device", "")).startswith("cuda"):
            gpu = (info.get("node_id"), tuple(info.get("gpu_ids", ())))
            by_gpu.setdefault(gpu, []).append(rank)
    return [
        (ranks, f"node {str(node)[:8]}, GPU {','.join(ids) or '?'}")
        for (node, ids), ranks in by_gpu.items()
        if len(ranks) > 1
    ]


def _size_from_memory(
    config: CPConfig, lanes: list, num_gpus_per_lane: float, options: LaneOptions
) -> CPConfig:
    """``config`` with the pages the smallest lane's free memory holds."""
    infos = ray.get([lane.info.remote() for lane in lanes], timeout=options.start_timeout_s)
    shares = memory_shares(infos, num_gpus_per_lane)
    caps = ray.get(
        [
            lane.kv_capacity.remote(options.gpu_memory_utilization, share)
            for lane, share in zip(lanes, shares, strict=True)
        ],
        timeout=options.start_timeout_s,
    )
    if min(caps) < 2:
        raise InvalidRequestError(
            f"gpu_memory_utilization={options.gpu_memory_utilization} leaves room for "
            f"{min(caps)} pages on the smallest lane (per lane: {caps})"
        )
    return dataclasses.replace(config, num_pages_per_lane=min(caps))


def default_gpus_per_lane(num_gpus: float, cp_size: int) -> float:
    """A lane's GPUs when the caller names none: a whole one where there are enough, else an
    equal share of one GPU, as many lanes to a GPU as the lanes need (a share must fit on one
    GPU: 3 GPUs at cp 4 give 0.5 a lane, not 0.75, which only three GPUs could hold), and 0
    (CPU lanes) without GPUs."""
    if num_gpus >= cp_size:
        return 1.0
    whole = int(num_gpus)
    if whole < 1:
        return 0.0 if num_gpus <= 0 else num_gpus / cp_size
    return 1.0 / math.ceil(cp_size / whole)


def memory_shares(infos: list[dict], num_gpus_per_lane: float) -> list[float]:
    """Each lane's share of its device's memory: its GPU fraction on a GPU, and on a host
    (CPU lanes, logical GPUs or none) one part of as many as that node has CPU lanes."""
    on_cpu = [not info["device"].startswith("cuda") for info in infos]
    per_node: dict[str, int] = {}
    for info, cpu in zip(infos, on_cpu, strict=True):
        if cpu:
            per_node[info["node_id"]] = per_node.get(info["node_id"], 0) + 1
    gpu_share = min(1.0, num_gpus_per_lane) if num_gpus_per_lane else 1.0
    return [
        1.0 / per_node[info["node_id"]] if cpu else gpu_share
        for info, cpu in zip(infos, on_cpu, strict=True)
    ]


def _remove(lanes: list, group) -> None:
    for lane in lanes:
        ray.kill(lane, no_restart=True)
    remove_placement_group(group)


def _resource_amount(name: str, value: object) -> float:
    """A lane's share of a Ray resource: a finite number, 0 or at least 0.0001 (Ray's unit).

    Raises:
        InvalidRequestError: anything else (Ray would refuse it only once the lanes' placement
            group is reserved).
    """
    amount = check_float(name, value)
    if 0 < amount < 1e-4:
        raise InvalidRequestError(f"{name}={value!r}: Ray's smallest share is 0.0001")
    return amount
