"""LaneIO: a client's direct K/V reads and writes on the lanes.

``store_kv`` / ``gather_kv`` split global slots by lane and call each lane that holds
some, as the client's namespace, after the page moves of the client's last allocation
(the fence): a lane that has not applied them yet answers ``NOT_YET``; the client then has
the coordinator send the moves still waiting for a step, and asks again.
What it needs of the client (its fence, the coordinator's answers, what to do when a
lane died) comes in as callbacks; the client handles a lane's death, this only reports it.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import numpy as np

from cpkv.core.config import KVShape
from cpkv.core.layout import PageLayout
from cpkv.core.validate import check_int
from cpkv.errors import CPKVError, InvalidRequestError, LaneUnavailableError, RequestTimeoutError

__all__ = ["LaneIO", "actor_death"]

# After one lane refused a call, how long the others' answers are awaited for a death to
# report instead (a dead actor's call fails within milliseconds; the refusal waits no longer).
_DEATH_GRACE_S = 1.0


class LaneIO:
    """K/V reads and writes on the lanes, and lane calls waited for with a timeout.

    Args:
        lanes: the lane actor handles, one per CP rank.
        layout: the pool's page layout (which lane holds a global slot).
        kv: each lane's K/V shape and dtype.
        num_slots: the pool's global slots (``cp_size * num_pages_per_lane * page_size``).
        namespace_id: the client's namespace, sent with every read and write.
        timeout_s: seconds before a lane call fails with RequestTimeoutError.
        fence: per lane, the last page move the client's allocations saw (``None``: none).
        fence_waiting: whether the fence's moves may still wait at the coordinator for a
            step (a write then has them sent first rather than find its lane behind).
        refresh_fence: have the coordinator send every page move it decided so far, and
            take them as the fence.
        unwrap: a lane's answer as the client takes a coordinator's (errors raised).
        lane_lost: lane ``r`` died during ``what``: the client's handling of it, and the
            error to raise.
    """

    def __init__(
        self,
        lanes: list,
        layout: PageLayout,
        kv: KVShape,
        num_slots: int,
        namespace_id: int,
        timeout_s: float,
        *,
        fence: Callable[[], list | None],
        fence_waiting: Callable[[], bool],
        refresh_fence: Callable[[], None],
        unwrap: Callable[[Any], Any],
        lane_lost: Callable[[int, str, str], LaneUnavailableError],
    ) -> None:
        import ray

        self._ray = ray
        self._lanes = lanes
        self._layout = layout
        self._kv = kv
        self._num_slots = num_slots
        self._namespace_id = namespace_id
        self.timeout_s = timeout_s
        self._fence = fence
        self._fence_waiting = fence_waiting
        self._refresh_fence = refresh_fence
        self._unwrap = unwrap
        self._lane_lost = lane_lost

    def set_namespace_id(self, namespace_id: int) -> None:
        """The namespace's id at a restarted coordinator (it numbers them again)."""
        self._namespace_id = namespace_id

    def store_kv(self, slots, k, v, layer: int = 0) -> None:
        """Write K/V of tokens at their global slots (see :meth:`CPKVClient.store_kv`)."""
        slots = self._slots(slots)
        self._check_kv(slots, k, v)
        layer = self._layer(layer)
        calls = {}
        for r, (idx, local) in enumerate(self._layout.split_slots(slots)):
            if idx.size:
                ti = _index(idx)
                calls[r] = (self._lanes[r].store_kv, (local, k[ti], v[ti], layer))
        self._lane_io(calls, "store_kv")

    def gather_kv(self, slots, layer: int = 0):
        """Read back K/V ``[T, heads, head_dim]`` at global slots (CPU tensors)."""
        import torch

        slots = self._slots(slots)
        layer = self._layer(layer)
        parts = self._layout.split_slots(slots)
        calls = {
            r: (self._lanes[r].gather_kv, (local, layer))
            for r, (idx, local) in enumerate(parts)
            if idx.size
        }
        got = self._lane_io(calls, "gather_kv")
        dtype = getattr(torch, self._kv.dtype)
        shape = (slots.shape[0], self._kv.num_heads, self._kv.head_dim)
        k, v = torch.empty(shape, dtype=dtype), torch.empty(shape, dtype=dtype)
        for r, (kr, vr) in got.items():
            ti = _index(parts[r][0])
            k[ti], v[ti] = kr, vr
        return k, v

    def wait_lanes(self, refs: list, what: str, end: float | None = None) -> list:
        """The answers of ``(lane, ref)`` calls, in order, all by one deadline.

        Args:
            end: the ``time.monotonic()`` deadline (default: ``timeout_s`` from now).

        Raises:
            RequestTimeoutError: a lane silent past the deadline.
            LaneUnavailableError: a lane died (as ``lane_lost`` made it).
        """
        ray = self._ray
        if end is None:
            end = time.monotonic() + self.timeout_s
        out, refusal = [], None
        for r, ref in refs:
            try:
                # NOTE: one deadline for all: a timeout each, lanes answering late in turn
                # would hold the caller cp_size times timeout_s (the grace too).
                left = max(0.0, end - time.monotonic())
                out.append(self._unwrap(ray.get(ref, timeout=left)))
            except ray.exceptions.GetTimeoutError:
                if refusal is not None:
                    continue
                raise RequestTimeoutError(
                    f"{what}: lane {r} silent past the {self.timeout_s}s deadline"
                ) from None
            except actor_death(ray) as e:
                raise self._lane_lost(r, what, f"{what}: {type(e).__name__}") from None
            except ray.exceptions.RayTaskError as e:
                # A lane's refusal arrives as Ray's subclass of it, its message behind the
                # lane's traceback: raise the lane's own error, as the coordinator's arrive.
                if not isinstance(e.cause, CPKVError):
                    raise
                # NOTE: a refusal may follow another lane's death (the coordinator freed the
                # lost request's pages here): that death, if among the answers, is the error.
                if refusal is None:
                    refusal = e.cause
                    end = min(end, time.monotonic() + _DEATH_GRACE_S)
        if refusal is not None:
            raise refusal
        return out

    def _layer(self, layer: object) -> int:
        layer = check_int("layer", layer, minimum=0)
        if layer >= self._kv.num_layers:
            raise InvalidRequestError(f"layer={layer} >= num_layers={self._kv.num_layers}")
        return layer

    def _check_kv(self, slots: np.ndarray, k, v) -> None:
        import torch

        want = (slots.shape[0], self._kv.num_heads, self._kv.head_dim)
        dtype = getattr(torch, self._kv.dtype)
        for name, t in (("k", k), ("v", v)):
            if not isinstance(t, torch.Tensor):
                raise InvalidRequestError(f"{name} must be a torch.Tensor, got {type(t)!r}")
            if t.layout != torch.strided or t.device.type == "meta":
                raise InvalidRequestError(f"{name} must be a dense tensor with data, got {t!r:.80}")
            if t.requires_grad:  # the shard's K/V would join the caller's autograd graph
                raise InvalidRequestError(f"{name} requires grad: pass {name}.detach()")
            if tuple(t.shape) != want:
                raise InvalidRequestError(f"{name} has shape {tuple(t.shape)}, expected {want}")
            if t.dtype != dtype:
                raise InvalidRequestError(f"{name} has dtype {t.dtype}, expected {dtype}")

    def _slots(self, slots) -> np.ndarray:
        if isinstance(slots, (list, tuple)) and any(
            isinstance(s, (bool, np.bool_)) for s in slots
        ):  # numpy would take True as slot 1
            raise InvalidRequestError(f"slots must be integers, not bools: {slots!r:.80}")
        arr = np.asarray(slots)
        if arr.ndim != 1 or not np.issubdtype(arr.dtype, np.integer):
            raise InvalidRequestError(f"slots must be 1-D integers, got {arr.dtype} {arr.shape}")
        total = self._num_slots
        # NOTE: the range is checked before the cast: a uint64 past int64 would wrap negative.
        if arr.size and (arr.min() < 0 or arr.max() >= total):
            raise InvalidRequestError(f"slots span [{arr.min()}, {arr.max()}], valid [0, {total})")
        return arr.astype(np.int64, copy=False)

    def _lane_io(self, calls: dict, what: str) -> dict:
        """Run a K/V read or write on each lane, as the client's namespace, after the page
        moves of its last allocation (a lane that has not applied them yet answers
        ``NOT_YET``: the coordinator is asked to send the moves still waiting, then the lane
        asked again, shortly, within ``timeout_s``)."""
        from cpkv.lanes.shard import NOT_YET

        out: dict = {}
        end, pause = time.monotonic() + self.timeout_s, 0.001
        refreshed = False
        if self._fence_waiting():
            # Measured on the 2-core machine (bench_actors, 256 tokens at cp 4): allocation
            # and write took 23.2 ms when the write found its lanes behind, 14-19 ms with
            # this one coordinator round first.
            self._refresh_fence()
            refreshed = True
        while calls:
            fence = self._fence()
            refs = [
                (r, method.remote(*args, self._namespace_id, None if fence is None else fence[r]))
                for r, (method, args) in calls.items()
            ]
            try:
                answers = self.wait_lanes(refs, what, end)
            except InvalidRequestError as e:
                if refreshed or "is free" not in str(e):
                    raise
                # Pages another client of our namespace was given may still be on their way
                # to the lane: wait for every move decided so far, then ask once more.
                self._refresh_fence()
                refreshed = True
                continue
            for (r, _), res in zip(refs, answers, strict=True):
                if not (isinstance(res, str) and res == NOT_YET):
                    out[r] = res
                    del calls[r]
            if calls and not refreshed:
                # The moves behind the fence wait for a step to carry them: have them sent now.
                self._refresh_fence()
                refreshed = True
                continue
            if calls:
                if time.monotonic() > end:
                    raise RequestTimeoutError(
                        f"{what}: lanes {sorted(calls)} did not get their page moves in "
                        f"{self.timeout_s}s"
                    )
                time.sleep(pause)
                pause = min(0.05, pause * 2)
        return out


def actor_death(ray) -> tuple[type[Exception], ...]:
    """What Ray raises for a call on an actor that died (its memory monitor's kill too) or
    is restarting."""
    return (
        ray.exceptions.RayActorError,
        ray.exceptions.ActorUnavailableError,
        ray.exceptions.OutOfMemoryError,
    )


def _index(idx: np.ndarray):
    import torch

    return torch.from_numpy(idx)
