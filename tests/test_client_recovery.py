"""The client's recovery paths, without Ray (``tests/plain_client.py``): the call after a
coordinator died reaches its restart, a retry by the call id a timeout handed back asks the
same thing, and a call id that would not be recognised as a repeat is refused."""

from __future__ import annotations

import numpy as np
import pytest

from cpkv.errors import CoordinatorUnavailableError, InvalidRequestError, RequestTimeoutError
from tests.plain_client import PlainCoordinator, patch_ray, plain_client


@pytest.fixture
def coordinator(monkeypatch) -> PlainCoordinator:
    patch_ray(monkeypatch)
    return PlainCoordinator()


def test_the_call_after_a_coordinator_died_under_one_reaches_its_restart(coordinator):
    c = plain_client(coordinator)
    c.allocate_extend("x", np.arange(10))
    coordinator.dead = True
    with pytest.raises(CoordinatorUnavailableError) as info:
        c.allocate_extend("y", np.arange(10))
    assert info.value.rids == ["x"]
    with pytest.raises(CoordinatorUnavailableError):  # still down: said again, nothing lost
        c.allocate_decode(["x"])
    coordinator.restart()  # Ray restarted it: a new epoch
    alloc = c.allocate_extend("z", np.arange(10))  # not refused as the old epoch's
    assert alloc.rid == "z" and alloc.extend_len == 10
    assert c.check()["ok"]


def test_a_retry_by_the_call_id_of_a_stale_digest_fallback_sends_the_ids(coordinator):
    """Another client of the namespace extended the request: the digest went stale and the
    ids went under ("tokens", call id); that answer lost, the timeout hands that id back."""
    a = plain_client(coordinator, namespace="job", call_retries=0)
    b = plain_client(coordinator, namespace="job", call_retries=0)
    a.allocate_extend("r", np.arange(6))  # a holds 6: the next chunk digests at offset 2
    b.allocate_extend("r", np.arange(6, 7))  # now 7
    coordinator.lose = lambda name, args: name == "allocate_extend" and args[2][:1] == ("tokens",)
    tokens = np.arange(7, 12)
    with pytest.raises(RequestTimeoutError) as info:
        a.allocate_extend("r", tokens)
    coordinator.lose = None
    assert info.value.call_id[0] == "tokens"
    alloc = a.allocate_extend("r", tokens, call_id=info.value.call_id)  # its first answer
    assert (alloc.prefix_len, alloc.extend_len) == (7, 5)
    assert a.stats()["num_requests"] == 1 and a.check()["ok"]


@pytest.mark.parametrize(
    "call_id", [float("nan"), ("job", float("nan")), ("job", [1])], ids=["nan", "nan-in", "list"]
)
def test_a_call_id_that_would_not_match_its_repeat_is_refused_before_any_call(coordinator, call_id):
    c = plain_client(coordinator)
    with pytest.raises(InvalidRequestError, match="call_id"):
        c.allocate_extend("r", np.arange(8), call_id=call_id)
    assert c.stats()["num_requests"] == 0
