"""RayLaneTransport: lane calls as Ray actor calls, Ray's errors as the channel's."""

from __future__ import annotations

from concurrent.futures import Future
from typing import Any

import ray

from cpkv.coordinator.channel import LaneDeadError, LaneUnreachableError
from cpkv.core.steps import StepPacket

__all__ = ["CompiledRayLaneTransport", "RayLaneTransport"]


class RayLaneTransport:
    """Submits lane calls on the lanes' actor handles; results by ``ray.get``.

    Args:
        lanes: one lane actor handle per CP rank.
    """

    def __init__(self, lanes: list) -> None:
        self.lanes = list(lanes)

    def submit(self, lane: int, method: str, *args: Any) -> ray.ObjectRef:
        return getattr(self.lanes[lane], method).remote(*args)

    def result(self, handle: ray.ObjectRef, timeout: float) -> Any:
        try:
            return ray.get(handle, timeout=timeout)
        except ray.exceptions.GetTimeoutError:
            raise TimeoutError(f"lane call unanswered after {timeout}s") from None
        except ray.exceptions.ActorUnavailableError as e:  # a RayActorError: caught first
            raise LaneUnreachableError(f"{type(e).__name__}: {e}") from None
        # OutOfMemoryError: Ray's memory monitor killed the lane (not a RayActorError).
        except (ray.exceptions.RayActorError, ray.exceptions.OutOfMemoryError) as e:
            raise LaneDeadError(f"{type(e).__name__}: {e}") from None
        except ray.exceptions.RayTaskError as e:
            raise e.as_instanceof_cause() from None

    def share(self, obj: Any) -> ray.ObjectRef:
        """Put ``obj`` in the object store once, for every lane's call to read."""
        return ray.put(obj)

    def kill(self, lane: int) -> None:
        """End a hung lane's process; Ray restarts it (the coordinator then resets it)."""
        ray.kill(self.lanes[lane], no_restart=False)

    def done(self, handles: list[ray.ObjectRef]) -> list[bool]:
        if not handles:
            return []
        ready, _ = ray.wait(handles, num_returns=len(handles), timeout=0)
        ready_set = set(ready)
        return [h in ready_set for h in handles]


class CompiledRayLaneTransport(RayLaneTransport):
    """:class:`RayLaneTransport` whose steps go to every lane through one compiled graph
    (:class:`cpkv.actors.compiled_steps.CompiledSteps`); every other call stays an actor call.
    """

    def __init__(self, lanes: list) -> None:
        from cpkv.actors.compiled_steps import CompiledSteps

        super().__init__(lanes)
        self.steps = CompiledSteps(self.lanes)

    def execute_steps(self, packet: StepPacket) -> Future:
        return self.steps.execute(packet)

    def lane_reset(self, lane: int) -> None:
        self.steps.lane_reset(lane)
