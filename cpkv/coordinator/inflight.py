"""Steps in flight, and what their outcomes leave known of each request's K/V.

The coordinator decides a step and sends it; until every lane answered it, the request's
K/V is known written only as far as its earlier steps wrote. :class:`InflightSteps` keeps
the dispatched steps, each request's :class:`_Track` (written length, steps in flight) and
the requests whose step failed (with how far their K/V was written before it): a free
caches no more than that, and a later step of a failed request is refused.

NOTE: :class:`InflightSteps` has no lock of its own: the coordinator's lock guards it, and
the coordinator makes a new one at every reset (with its new core).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Hashable
from concurrent.futures import Future
from dataclasses import dataclass

from cpkv.coordinator.channel import LaneChannel, StepHandles
from cpkv.core.steps import StepRequest
from cpkv.core.validate import user_rid
from cpkv.errors import StepFailedError

__all__ = ["InflightSteps"]

# The coordinator's log: step failures are logged where they always were.
logger = logging.getLogger("cpkv.coordinator.coordinator")


@dataclass(slots=True)
class _Track:
    """A request's K/V as its steps on the lanes left it.

    Attributes:
        written: tokens whose K/V a successful step (or the cached prefix) wrote.
        inflight: steps of the request dispatched and not yet answered.
    """

    written: int
    inflight: int = 0


@dataclass(slots=True)
class _InflightStep:
    """A step dispatched to every lane whose outcome is not known yet."""

    step_id: int
    # (request key, its length once the step wrote, the request's track). NOTE: the track
    # names the request instance: a rid freed and allocated again while this step ran is
    # another request, which this step's outcome must not touch.
    lengths: list[tuple[Hashable, int, _Track]]
    # per lane, the future of (status handle, result handle): a Future or StepHandles
    handles: list[Future | StepHandles]


class InflightSteps:
    """The dispatched steps not yet settled, the requests' tracks and their failures.

    Args:
        channel: the line to the lanes (asked whether a step's lanes are done, and how).
        has_request: whether the core still holds a request (a freed one is not failed).
        drop_group: called once per failed step (its lanes left their group).
    """

    def __init__(
        self,
        channel: LaneChannel,
        has_request: Callable[[Hashable], bool],
        drop_group: Callable[[], None],
    ) -> None:
        self._channel = channel
        self._has_request = has_request
        self._drop_group = drop_group
        self._tracks: dict[Hashable, _Track] = {}
        # request key -> (why it failed, tokens of its K/V known written)
        self.failed: dict[Hashable, tuple[str, int]] = {}
        self._steps: dict[int, _InflightStep] = {}
        self.num_failed_steps = 0

    def __len__(self) -> int:
        """Steps dispatched and not yet settled."""
        return len(self._steps)

    def track(self, step: StepRequest, handles: list) -> None:
        """Remember a dispatched step until every lane has answered it."""
        lengths = []
        for s in step.sequences:
            track = self._tracks.get(s.rid)
            if track is None:
                track = self._tracks[s.rid] = _Track(written=s.prefix_len)
            track.inflight += 1
            lengths.append((s.rid, s.seq_len, track))
        self._steps[step.step_id] = _InflightStep(step.step_id, lengths, handles)

    def settle(self) -> None:
        """Take in the outcome of every step whose lanes have all answered, or one of which
        failed: a success makes its K/V written, a failure marks its requests failed and
        the lane group stale (the failing lane left it, and the others too but for a solo
        step, which they skipped: they leave it when the next is built). NOTE: any lane's
        failure fails the step, a solo step's too (the death of a lane that skipped it): the
        client reads every lane's answer and says so to its caller, and the two must agree.
        Never blocks."""
        if not self._steps:
            return
        channel = self._channel
        for sid in sorted(self._steps):
            st = self._steps[sid]
            if not all(f.done() for f in st.handles):
                continue
            error: BaseException | None = next(
                (f.exception() for f in st.handles if f.exception() is not None), None
            )
            statuses = [] if error is not None else [f.result()[0] for f in st.handles]
            done = channel.done(statuses) if statuses else []
            for handle, is_done in zip(statuses, done, strict=True):
                if is_done and error is None:
                    try:
                        channel.outcome(handle, 0.0)
                    except Exception as e:  # the lane's own error, or its death
                        error = e
            if error is None and not all(done):
                continue
            del self._steps[sid]
            if error is None:
                for _key, length, track in st.lengths:
                    track.written = max(track.written, length)
                    track.inflight -= 1
                continue
            self.num_failed_steps += 1
            self._drop_group()  # the failing lane left the group: build a new one
            detail = f"step {sid} failed: {type(error).__name__}: {str(error)[:300]}"
            logger.warning("%s; its requests are marked failed", detail)
            for key, _length, track in st.lengths:
                if self._tracks.get(key) is track:  # not freed (nor its rid reused) since
                    del self._tracks[key]
                    if self._has_request(key):
                        self.failed[key] = (detail, track.written)

    def unsent(self, step: StepRequest, error: BaseException) -> StepFailedError:
        """A decided step that could not be sent: its requests are failed as far as their
        K/V was written before it; the error to answer."""
        detail = f"step {step.step_id} could not be sent: {type(error).__name__}: {error}"
        logger.warning("%s; its requests are marked failed", detail)
        for s in step.sequences:
            track = self._tracks.get(s.rid)
            self.failed[s.rid] = (detail, s.prefix_len if track is None else track.written)
        rids = [user_rid(s.rid) for s in step.sequences]
        return StepFailedError(rids[0] if len(rids) == 1 else tuple(rids), detail)

    def check_not_failed(self, key: Hashable) -> None:
        failed = self.failed.get(key)
        if failed is not None:
            raise StepFailedError(user_rid(key), failed[0])

    def written_len(self, key: Hashable) -> int | None:
        """Tokens of ``key`` whose K/V is known written; ``None`` when nothing limits it."""
        failed = self.failed.get(key)
        if failed is not None:
            return failed[1]
        track = self._tracks.get(key)
        if track is not None and track.inflight:
            return track.written
        return None

    def client_writes(self, key: Hashable) -> None:
        """A plain allocation: the client writes this K/V itself (nothing to wait for)."""
        track = self._tracks.get(key)
        if track is not None and not track.inflight:
            del self._tracks[key]

    def forget(self, key: Hashable) -> None:
        """The request is gone (freed or lost): nothing of it is tracked any more."""
        self._tracks.pop(key, None)
        self.failed.pop(key, None)
