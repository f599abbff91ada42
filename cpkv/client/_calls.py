"""A client's calls to its coordinator: call ids, the wait (sync or async), Ray's errors as
cpkv's, retries by call id, and greeting a restarted coordinator before the next call.

NOTE: a coordinator call is written once, as a generator that yields ``(ref, what)`` and is
sent the answer (or thrown the error, already cpkv's); :meth:`CoordinatorCalls.run` waits
with ``ray.get``, :meth:`CoordinatorCalls.arun` with ``await``: sync and async twins share
all but the wait.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import pickle
import warnings
from collections.abc import Callable, Generator, Hashable
from typing import Any

from cpkv.actors.wire import PACKED_CALLS, pack, unpack
from cpkv.client._fence import MoveFence
from cpkv.client._requests import LiveRequests
from cpkv.errors import (
    CoordinatorUnavailableError,
    InvalidRequestError,
    LaneUnavailableError,
    LeaseExpiredError,
    RequestTimeoutError,
)
from cpkv.lane_io import actor_death

__all__ = ["Call", "CoordinatorCalls", "retryable"]

logger = logging.getLogger("cpkv.client")

# A coordinator call: yields ``(ref, what)``, is sent the answer, returns the result.
Call = Generator[tuple[Any, str], Any, Any]


class CoordinatorCalls:
    """Sends a client's calls to one coordinator and waits for their answers.

    Args:
        ray: the ``ray`` module.
        coordinator: the coordinator actor handle.
        client_id: the client's id, sent with every call.
        hello_args: what greets the coordinator (and a restart of it).
        timeout_s: seconds before a call fails with RequestTimeoutError.
        call_retries: times a call that timed out is sent again with the same call id.
        requests: the client's live requests: forgotten when an answer says they were lost.
        fence: takes the page moves fenced answers name.
        check_open: raises once the client was shut down.
        greeted: takes a restarted coordinator's greeting (its namespace id, page key).
    """

    def __init__(
        self,
        ray,
        coordinator,
        client_id: str,
        hello_args: tuple,
        *,
        timeout_s: float,
        call_retries: int,
        requests: LiveRequests,
        fence: MoveFence,
        check_open: Callable[[], None],
        greeted: Callable[[dict], None],
    ) -> None:
        self.ray = ray
        self.coord = coordinator
        self.client_id = client_id
        self.hello_args = hello_args
        self.timeout_s = timeout_s
        self.call_retries = call_retries
        self.epoch: str | None = None
        # The coordinator died or restarted under a call: its restart has a new epoch (and
        # key) to take before the next call, or that call would be refused as the old one's.
        self.epoch_stale = False
        self._numbers = itertools.count()
        self._requests = requests
        self._fence = fence
        self._check_open = check_open
        self._greeted = greeted
        self._warned_loop = False

    def hello(self) -> dict:
        """Greet the coordinator and take its epoch; its greeting."""
        hello = self.get(self.coord.hello.remote(*self.hello_args), "hello")
        self.epoch = hello["epoch"]
        return hello

    def run(self, call: Call):
        """Run ``call``, waiting for each answer with ``ray.get``."""
        if not self._warned_loop and _in_event_loop():
            self._warned_loop = True  # once a client: the caller may mean it (a quick call)
            warnings.warn(
                "a blocking cpkv call inside a running event loop stalls the loop for its "
                "round trip; await the *_async twin (allocate_extend_async, "
                "allocate_decode_async, free_async, stats_async) there",
                RuntimeWarning,
                stacklevel=4,
            )
        answer = error = None
        while True:
            try:
                ref, what = call.send(answer) if error is None else call.throw(error)
            except StopIteration as done:
                return done.value
            try:
                answer, error = self.ray.get(ref, timeout=self.timeout_s), None
            except Exception as e:
                answer, error = None, self.translate(e, what)

    async def arun(self, call: Call, pending: tuple[Any, str] | None = None):
        """Run ``call``, awaiting each answer (``pending``: one already asked for).

        Cancelled while it waits, the call is finished in the background before the
        cancellation goes on: it was sent and may take effect, and the client's book must
        record what it did (a request it now holds, one it freed), or the caller's retry
        would allocate again and a cleanup over :attr:`LiveRequests.rids` miss it.
        """
        answer = error = None
        while True:
            if pending is None:
                try:
                    pending = call.send(answer) if error is None else call.throw(error)
                except StopIteration as done:
                    return done.value
            (ref, what), pending = pending, None
            try:
                answer, error = await asyncio.wait_for(ref, timeout=self.timeout_s), None
            except asyncio.CancelledError:
                # NOTE: a continuation cancelled in turn (its loop is closing) ends there.
                if asyncio.current_task() not in _BACKGROUND:
                    _finish_in_background(self.arun(call, (ref, what)), what)
                raise
            except Exception as e:
                answer, error = None, self.translate(e, what)

    def get(self, ref, what: str):
        """One coordinator answer (no call id: status and lease calls)."""
        return self.run(self.answer(ref, what))

    def answer(self, ref, what: str, fenced: bool = False, packed: bool = False) -> Call:
        """The answer to ``ref``: unpacked, its fence taken, an error in it raised."""
        out = yield ref, what
        if packed:  # cpkv.actors.wire
            out = unpack(out)
        return self.unwrap(self._fence.take(out) if fenced else out)

    def call(
        self,
        method: str,
        *args,
        what: str,
        call_id: Hashable | None = None,
        fenced=False,
        retries: int | None = None,
    ) -> Call:
        """One coordinator call named by a call id. A call that times out is sent again with
        the same id (``retries`` times, default ``call_retries``): the coordinator answers a
        repeat with its first answer, so it never takes effect twice.

        Raises:
            RequestTimeoutError: no answer after the retries; its ``call_id`` retries later.
        """
        call_id = self.call_id(call_id)
        retries = self.call_retries if retries is None else retries
        for attempt in range(retries + 1):
            yield from self.greet_if_restarted()
            call = (self.epoch, self.client_id, call_id, *args)
            packed = method in PACKED_CALLS
            self._check_open()
            ref = getattr(self.coord, method).remote(*((pack(call),) if packed else call))
            try:
                return (yield from self.answer(ref, what, fenced, packed))
            except RequestTimeoutError as e:
                if attempt == retries:
                    raise retryable(e, call_id) from None
                logger.info("%s timed out; sending it again as call %r", what, call_id)
        raise AssertionError("unreachable")

    def call_id(self, call_id: Hashable | None = None) -> Hashable:
        """A new call id, or the caller's (to retry a call that timed out, safely)."""
        if call_id is None:
            return (self.client_id, next(self._numbers))
        try:
            hash(call_id)
        except TypeError:
            raise InvalidRequestError(f"call_id={call_id!r} must be hashable") from None
        # The coordinator knows a repeat by equality with the id it got, a copy: an id
        # unequal to its copy (a NaN in it) would run the call again on every retry.
        try:
            same = pickle.loads(pickle.dumps(call_id)) == call_id
        except Exception:
            same = False
        if not same:
            raise InvalidRequestError(
                f"call_id={call_id!r} must equal a copy of itself (no NaN) and be picklable"
            )
        return call_id

    def translate(self, e: Exception, what: str) -> Exception:
        """Ray's timeout and actor errors as cpkv's; anything else unchanged."""
        ray = self.ray
        if isinstance(e, (ray.exceptions.GetTimeoutError, asyncio.TimeoutError)):
            return RequestTimeoutError(f"{what}: no answer within {self.timeout_s}s")
        if isinstance(e, actor_death(ray)):
            self._requests.lose_all()
            self.epoch_stale = True
            return CoordinatorUnavailableError(
                f"{what}: coordinator died ({type(e).__name__})", self._requests.take_lost()
            )
        return e

    def unwrap(self, out):
        """An answer, or the error it holds raised (the requests it lost forgotten)."""
        if isinstance(out, CoordinatorUnavailableError):
            self._requests.lose_all()
            self.epoch_stale = True  # the next call greets the restarted coordinator first
            raise CoordinatorUnavailableError(out.detail, self._requests.take_lost())
        if isinstance(out, (LaneUnavailableError, LeaseExpiredError)):
            self._requests.forget(out.rids)
        if isinstance(out, BaseException):
            raise out
        return out

    def greet_if_restarted(self) -> Call:
        """When a call found the coordinator dead or gone (``epoch_stale``), greet its
        restart and take its epoch, page key and namespace id (it numbers namespaces again,
        in the order its clients greet it); while it is still down this raises
        CoordinatorUnavailableError again. Otherwise nothing."""
        if not self.epoch_stale:
            return
        self._check_open()
        hello = yield self.coord.hello.remote(*self.hello_args), "hello"
        self.epoch = hello["epoch"]
        self._greeted(hello)
        self.epoch_stale = False

    def lane_lost(self, lane: int, what: str, detail: str) -> LaneUnavailableError:
        """A lane call found ``lane`` dead: tell the coordinator, forget our requests lost
        with it; the error to raise."""
        lost = self.get(
            self.coord.report_lane_failure.remote(self.epoch, lane, detail, self.client_id),
            "report_lane_failure",
        )
        self._requests.forget(lost)
        return LaneUnavailableError(lane, lost, f"{what} failed")

    def refresh_fence(self) -> None:
        """Have the coordinator send every page move it decided so far; take them as the
        fence."""
        self._check_open()
        self._fence.merge(self.get(self.coord.lane_fence.remote(), "fence"), waiting=False)


def _in_event_loop() -> bool:
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return False
    return True


# NOTE: the event loop keeps only weak references to its tasks.
_BACKGROUND: set[asyncio.Task] = set()


def _finish_in_background(finish, what: str) -> None:
    """Run a cancelled call's rest as a task of its own; its outcome is only logged."""

    def done(task: asyncio.Task) -> None:
        _BACKGROUND.discard(task)
        if not task.cancelled() and task.exception() is not None:
            logger.debug("%s, finished after its caller was cancelled: %r", what, task.exception())

    task = asyncio.ensure_future(finish)
    _BACKGROUND.add(task)
    task.add_done_callback(done)


def retryable(e: RequestTimeoutError, call_id: Hashable) -> RequestTimeoutError:
    """The timeout of a call that may have taken effect, with the id that retries it safely."""
    return RequestTimeoutError(
        f"{e}; call_id={call_id!r} (pass it as call_id= to retry safely)", call_id
    )
