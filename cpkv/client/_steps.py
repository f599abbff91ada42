"""A client's steps: sent to its coordinator (through the client's step graph when it has
one, capacity waits retried with backoff), and their results waited for from the lanes in
lane order (a dead lane reported, a failed step's error raised, its first lane named)."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Hashable

from cpkv.actors.step_graph import GraphUnavailable, StepGraph
from cpkv.client._backoff import with_backoff
from cpkv.client._calls import Call, CoordinatorCalls, retryable
from cpkv.coordinator.channel import LaneDeadError, StepAborted
from cpkv.core.steps import LaneReply, StepResult
from cpkv.errors import (
    KVCapacityWaitError,
    LaneUnavailableError,
    RequestTimeoutError,
    StepFailedError,
)
from cpkv.lane_io import actor_death
from cpkv.results import PrefillResult, prefill_results

__all__ = ["StepCalls", "wait_step"]

logger = logging.getLogger("cpkv.client")

# A lane call found a lane dead: ``(lane, what, detail)`` to the error to raise.
LaneLost = Callable[[int, str, str], LaneUnavailableError]


class StepCalls:
    """Sends a client's steps and waits for their lanes' results.

    Args:
        rpc: the client's coordinator calls.
        graph: the client's step graph to the coordinator (``None``: ordinary calls only).
    """

    def __init__(self, rpc: CoordinatorCalls, graph: StepGraph | None) -> None:
        self._rpc = rpc
        self.graph = graph  # NOTE: its one owner: a client that drops it drops it here

    def send(
        self, method: str, *args, call_id: Hashable, deadline_s: float | None = None
    ) -> tuple[dict, Hashable]:
        """Send a step to the coordinator (capacity waits retried with backoff until
        ``deadline_s``).

        Returns:
            Its answer (the allocations and the lanes' result handles) and the call id that
            got it: a capacity wait took no effect, so each retry is a new call (the
            coordinator answers a repeated call id with its first answer, the wait).
        """
        ids: list[Hashable | None] = [call_id]

        def once():
            if ids[-1] is None:  # numbered when sent, not before the backoff's sleep
                ids[-1] = self._rpc.call_id()
            try:
                return self._rpc.run(self._call(method, *args, call_id=ids[-1]))
            except KVCapacityWaitError:
                ids.append(None)
                raise

        out = once() if deadline_s is None else with_backoff(once, deadline_s=deadline_s)
        return out, ids[-1]

    def _call(self, method: str, *args, call_id: Hashable) -> Call:
        """A step through the client's step graph when it takes it, else (or for the retries
        after its timeout) as an ordinary call with the same call id."""
        rpc = self._rpc
        retries = rpc.call_retries
        yield from rpc.greet_if_restarted()
        if self.graph is not None:
            call = (method, rpc.epoch, rpc.client_id, call_id, *args)
            try:
                out = self.graph.run(call, rpc.timeout_s)
            except GraphUnavailable:
                pass
            except TimeoutError:
                e = RequestTimeoutError(f"{method}: no answer within {rpc.timeout_s}s")
                if retries == 0:
                    raise retryable(e, call_id) from None
                logger.info("%s timed out; sending it again as call %r", method, call_id)
                retries -= 1
            else:  # NOTE: outside the try: an answer may be a RequestTimeoutError (a TimeoutError)
                return rpc.unwrap(out)
        return (yield from rpc.call(method, *args, what=method, call_id=call_id, retries=retries))

    def wait(
        self, handles: list, what: str, rids: list, call_id: Hashable = None
    ) -> list[StepResult]:
        """Every lane's step result, in lane order (see :func:`wait_step`)."""
        rpc = self._rpc
        return wait_step(rpc.ray, handles, what, rids, call_id, rpc.timeout_s, rpc.lane_lost)

    def results(
        self, out: dict, what: str, rids: list, call_id: Hashable = None
    ) -> list[PrefillResult]:
        """A prefill step's results: each request's allocation with its lanes' outputs."""
        results = self.wait(out["lanes"], what, rids, call_id)
        return prefill_results(out["allocations"], results)


def wait_step(
    ray,
    handles: list,
    what: str,
    rids: list,
    call_id: Hashable,
    timeout_s: float,
    lane_lost: LaneLost,
) -> list[StepResult]:
    """Every lane's step result, in lane order. A dead lane is reported at once; a lane
    whose step failed made the others fail it too (it left the lane group), but for a
    solo step (every page on that lane), which the others skipped.

    Raises:
        LaneUnavailableError: a lane died (its requests are lost).
        StepFailedError: the step failed on a lane (its requests are failed).
        RequestTimeoutError: lanes silent past ``timeout_s`` (``call_id`` waits again).
    """
    if all(isinstance(h, LaneReply) for h in handles):  # compiled: answered already
        return _step_outcome(dict(enumerate(handles)), [], what, rids, lane_lost)
    index = {ref: r for r, ref in enumerate(handles)}
    remaining, results, errors = list(handles), {}, []
    end = time.monotonic() + timeout_s
    while remaining:
        ready, remaining = ray.wait(
            remaining, num_returns=1, timeout=max(0.0, end - time.monotonic())
        )
        if not ready:
            lanes = sorted(index[ref] for ref in remaining)
            raise RequestTimeoutError(
                f"{what}: lanes {lanes} silent for {timeout_s}s; call_id={call_id!r} "
                "(pass it as call_id= to wait for this step again)",
                call_id,
            )
        for ref in ready:
            r = index[ref]
            try:
                results[r] = ray.get(ref)
            except actor_death(ray):
                raise lane_lost(r, what, f"{what}: lane died") from None
            except ray.exceptions.RayTaskError as e:
                errors.append((r, e.as_instanceof_cause()))
    return _step_outcome(results, errors, what, rids, lane_lost)


def _step_outcome(
    results: dict,
    errors: list[tuple[int, BaseException]],
    what: str,
    rids: list,
    lane_lost: LaneLost,
) -> list[StepResult]:
    """The lanes' results in lane order, or the step's error (``results`` may hold
    :class:`LaneReply` values: a compiled step's answers, errors included)."""
    for r in sorted(results):
        reply = results[r]
        if not isinstance(reply, LaneReply):
            continue
        if isinstance(reply.error, LaneDeadError):
            raise lane_lost(r, what, f"{what}: lane died ({reply.error})") from None
        if reply.error is not None:
            errors.append((r, reply.error))
        results[r] = reply.value
    if errors:
        lane, cause = min(errors, key=_aborted_last)  # the first to fail; the rest with it
        detail = f"lane {lane}: {type(cause).__name__}: {str(cause)[:300]}"
        raise StepFailedError(rids[0] if len(rids) == 1 else tuple(rids), detail) from cause
    return [results[r] for r in range(len(results))]


def _aborted_last(error: tuple[int, BaseException]) -> tuple[bool, int]:
    """Sort key of a step's lane errors: a lane's own failure before the lanes it aborted."""
    return isinstance(error[1], StepAborted), error[0]
