"""The errors cpkv raises: recoverable capacity pressure, lane and coordinator loss, misuse.

Every error pickles with its type and fields intact, so an error made inside an
actor reaches the caller as the same class with the same attributes.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

__all__ = [
    "CPKVError",
    "CoordinatorUnavailableError",
    "InvalidRequestError",
    "KVCapacityWaitError",
    "LaneUnavailableError",
    "LeaseExpiredError",
    "RequestTimeoutError",
    "StaleDigestError",
    "StepFailedError",
    "UnknownRequestError",
]


class CPKVError(Exception):
    """Base class of every error cpkv raises on purpose."""


class InvalidRequestError(CPKVError, ValueError):
    """Bad input: the message names the offending value; state is unchanged."""


class UnknownRequestError(InvalidRequestError):
    """No live request has this rid (never allocated, or freed already): nothing changed."""


class StaleDigestError(InvalidRequestError):
    """A client's :class:`cpkv.core.page_hash.TokenDigest` was built for another fill of
    the request's partial page (another client of its namespace extended it meanwhile):
    nothing changed; the client sends the tokens themselves instead."""


class KVCapacityWaitError(CPKVError, RuntimeError):
    """Recoverable KV-capacity pressure: back off and retry.

    Nothing stays allocated when this is raised (all-or-nothing across lanes),
    and a request slot taken for the failed step has been released.

    Attributes:
        required_by_owner: pages wanted on each lane, length ``cp_size``.
        available_by_owner: free pages on each lane after eviction.
        deficit_by_owner: ``max(0, required - available)`` per lane.
        reason: ``owner_lane_exhausted`` (owner plan), ``lane_exhausted``
            (rotation fallback or decode), ``lane_unavailable`` (a lane the step
            needs is restarting) or ``request_slots_exhausted``.
    """

    def __init__(
        self,
        message: str,
        *,
        required_by_owner: Sequence[int],
        available_by_owner: Sequence[int],
        deficit_by_owner: Sequence[int],
        reason: str = "owner_lane_exhausted",
    ) -> None:
        self.message = message
        self.required_by_owner = [int(x) for x in required_by_owner]
        self.available_by_owner = [int(x) for x in available_by_owner]
        self.deficit_by_owner = [int(x) for x in deficit_by_owner]
        self.reason = reason
        super().__init__(
            f"{reason}: {message}; required_by_owner={self.required_by_owner} "
            f"available_by_owner={self.available_by_owner} "
            f"deficit_by_owner={self.deficit_by_owner}"
        )

    def __reduce__(self):
        kwargs = {
            "required_by_owner": self.required_by_owner,
            "available_by_owner": self.available_by_owner,
            "deficit_by_owner": self.deficit_by_owner,
            "reason": self.reason,
        }
        return (_rebuild, (KVCapacityWaitError, (self.message,), kwargs))


class LaneUnavailableError(CPKVError, RuntimeError):
    """A lane died: the requests with pages on it are lost.

    Their pages on the other lanes have been freed; the lane comes back with an
    empty shard. Submit the lost requests again from scratch.

    Attributes:
        lane: the CP rank that died.
        rids: the requests lost with it.
    """

    def __init__(self, lane: int, rids: Sequence[Hashable], detail: str = "") -> None:
        self.lane = int(lane)
        self.rids = list(rids)
        self.detail = detail
        extra = f" ({detail})" if detail else ""
        super().__init__(f"lane {self.lane} is unavailable{extra}; lost requests: {self.rids}")

    def __reduce__(self):
        return (_rebuild, (LaneUnavailableError, (self.lane, self.rids, self.detail), {}))


class CoordinatorUnavailableError(CPKVError, RuntimeError):
    """The coordinator died or restarted: every request it held is lost.

    Attributes:
        rids: the caller's requests that were lost (those this client knew of).
    """

    def __init__(self, detail: str, rids: Sequence[Hashable] = ()) -> None:
        self.detail = detail
        self.rids = list(rids)
        super().__init__(f"coordinator unavailable: {detail}; lost requests: {self.rids}")

    def __reduce__(self):
        return (_rebuild, (CoordinatorUnavailableError, (self.detail, self.rids), {}))


class LeaseExpiredError(CPKVError, RuntimeError):
    """This client stopped renewing its lease long enough that it lapsed: the coordinator
    freed the requests it held. The lease is open again; submit them again.

    Attributes:
        rids: the requests that were freed.
    """

    def __init__(self, rids: Sequence[Hashable]) -> None:
        self.rids = list(rids)
        super().__init__(f"this client's lease lapsed; its requests were freed: {self.rids}")

    def __reduce__(self):
        return (_rebuild, (LeaseExpiredError, (self.rids,), {}))


class RequestTimeoutError(CPKVError, TimeoutError):
    """A client call got no answer in time (the actor is hung, dead or overloaded).

    Attributes:
        call_id: the call's id when it was a coordinator call that may have taken effect:
            pass it back (``call_id=err.call_id``) to retry the call safely (a call the
            coordinator already answered gives the same answer, never a second effect).
    """

    def __init__(self, message: str, call_id=None) -> None:
        self.message = message
        self.call_id = call_id
        super().__init__(message)

    def __reduce__(self):
        return (_rebuild, (RequestTimeoutError, (self.message, self.call_id), {}))


class StepFailedError(CPKVError, RuntimeError):
    """A prefill or decode step of this request failed (or was aborted) on the lanes.

    Its K/V from that step on was not written: every later extend, prefill or decode of
    the request raises this error again; :meth:`free` acknowledges it (only pages whose
    K/V was written may enter the prefix cache). Submit the request again.

    Attributes:
        rid: the request.
        detail: what failed, and where.
    """

    def __init__(self, rid: Hashable, detail: str = "") -> None:
        self.rid = rid
        self.detail = detail
        super().__init__(f"a step of request {rid!r} failed: {detail}; free it and submit again")

    def __reduce__(self):
        return (_rebuild, (StepFailedError, (self.rid, self.detail), {}))


def _rebuild(cls, args, kwargs):
    return cls(*args, **kwargs)
