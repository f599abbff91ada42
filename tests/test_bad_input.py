"""Bad input through the public client: a ValueError naming the value, state unchanged."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import cpkv
from cpkv import InvalidRequestError
from cpkv.actors.wire import PACKED_CALLS, unpack

pytestmark = pytest.mark.ray


class CallRecorder:
    """Stands in for the coordinator handle and records every remote call: its name in
    ``calls``, its name and positional arguments in ``sent``."""

    def __init__(self, real) -> None:
        self._real = real
        self.calls: list[str] = []
        self.sent: list[tuple[str, tuple]] = []

    def __getattr__(self, name):
        method = getattr(self._real, name)
        recorder = self

        class _Method:
            def remote(self, *args, **kwargs):
                recorder.calls.append(name)
                logical = unpack(args[0]) if name in PACKED_CALLS else args  # as the client made it
                recorder.sent.append((name, logical))
                return method.remote(*args, **kwargs)

        return _Method()


K = torch.zeros(3, 2, 8)
# Figures that move without any decision (moves in flight or sent by the channel's timer,
# slow heartbeats).
VOLATILE = ("pending_lane_calls", "lane_calls", "slow_heartbeats")


def state(stats: dict) -> dict:
    return {k: v for k, v in stats.items() if k not in VOLATILE}


LOCAL = [  # rejected on the caller's side, before any actor call
    ("negative token id", lambda c: c.allocate_extend("n", [1, -2]), "-2"),
    ("float tokens", lambda c: c.allocate_extend("n", [1.5]), "float"),
    ("empty tokens", lambda c: c.allocate_extend("n", []), "empty"),
    ("past max_context_len", lambda c: c.allocate_extend("n", np.arange(4097)), "4097"),
    ("2-d tokens", lambda c: c.allocate_extend("n", [[1, 2]]), "(1, 2)"),
    ("unhashable rid", lambda c: c.allocate_extend(["x"], [1]), "['x']"),
    ("None rid", lambda c: c.allocate_extend(None, [1]), "None"),
    ("float rid", lambda c: c.allocate_extend(1.5, [1]), "1.5"),
    ("tuple rid", lambda c: c.allocate_extend(("a", 1), [1]), "('a', 1)"),
    ("bool rid", lambda c: c.allocate_extend(True, [1]), "True"),
    ("None rid free", lambda c: c.free(None), "None"),
    ("None rid decode", lambda c: c.allocate_decode([None]), "None"),
    ("None rid in batch", lambda c: c.allocate_extend_batch([("a", [1]), (None, [2])]), "None"),
    ("salt not str", lambda c: c.allocate_extend("n", [1], cache_salt=3), "cache_salt=3"),
    ("empty decode", lambda c: c.allocate_decode([]), "no rids"),
    ("decode token count", lambda c: c.allocate_decode(["live"], [1, 2]), "2 token ids"),
    ("negative committed_len", lambda c: c.free("live", committed_len=-1), "-1"),
    ("float committed_len", lambda c: c.free("live", committed_len=1.5), "1.5"),
    ("empty batch", lambda c: c.allocate_extend_batch([]), "empty"),
    ("repeated batch rid", lambda c: c.allocate_extend_batch([("x", [1]), ("x", [2])]), "x"),
    ("repeated decode rid", lambda c: c.allocate_decode(["live", "live"]), "repeated"),
    ("kv wrong dtype", lambda c: c.store_kv([40, 41, 42], K.half(), K.half()), "float16"),
    ("kv wrong shape", lambda c: c.store_kv([40, 41, 42], torch.zeros(3, 2, 4), K), "(3, 2, 4)"),
    ("k/v length vs slots", lambda c: c.store_kv([40, 41], K, K), "(3, 2, 8)"),
    ("kv not a tensor", lambda c: c.store_kv([40, 41, 42], np.zeros((3, 2, 8)), K), "ndarray"),
    ("slot out of range", lambda c: c.store_kv([40, 41, 10**9], K, K), "1000000000"),
    ("negative slot", lambda c: c.gather_kv([-5]), "-5"),
    (
        "uint64 slot past int64",
        lambda c: c.gather_kv(np.array([2**63 + 5], dtype=np.uint64)),
        "9223372036854775813",
    ),
    ("layer out of range", lambda c: c.store_kv([40, 41, 42], K, K, layer=3), "layer=3"),
    ("gather layer out of range", lambda c: c.gather_kv([40], layer=3), "layer=3"),
    ("gather negative layer", lambda c: c.gather_kv([40], layer=-1), "-1"),
    ("gather str layer", lambda c: c.gather_kv([40], layer="0"), "'0'"),
    ("gather bool layer", lambda c: c.gather_kv([40], layer=True), "True"),
    ("str cache flag", lambda c: c.free("live", cache="no"), "cache='no'"),
    ("float slots", lambda c: c.gather_kv([1.0, 2.0]), "float"),
    # issue 19.9: each used to change state, crash, or raise a TypeError
    ("str as decode rids", lambda c: c.allocate_decode("ab"), "list of request ids"),
    ("int as decode rids", lambda c: c.allocate_decode(7), "list of request ids"),
    ("int as batch item", lambda c: c.allocate_extend_batch([7]), "item 0"),
    ("str as batch", lambda c: c.allocate_extend_batch("ab"), "list of (rid"),
    ("bool token ids", lambda c: c.allocate_extend("n", [True, 3]), "bool"),
    ("uint64 id past int64", lambda c: c.allocate_extend("n", [2**64 - 1]), "18446744073709551615"),
    (
        "uint64 array id past int64",
        lambda c: c.allocate_extend("n", np.array([1, 2**63], dtype=np.uint64)),
        "9223372036854775808",
    ),
    (
        "nan deadline",
        lambda c: c.allocate_extend_with_backoff("n", [1], deadline_s=float("nan")),
        "nan",
    ),
    (
        "negative backoff",
        lambda c: c.allocate_extend_with_backoff("n", [1], initial_backoff_s=-1.0),
        "-1.0",
    ),
    ("nan prefill deadline", lambda c: c.prefill("n", [1], deadline_s=float("nan")), "nan"),
    # an adversarial-input review: each was accepted or raised an undocumented error
    (
        "masked token ids",  # its checks skipped the masked -5
        lambda c: c.allocate_extend("n", np.ma.array([1, -5, 3], mask=[0, 1, 0])),
        "masked",
    ),
    ("ragged token ids", lambda c: c.allocate_extend("n", [1, [2, 3]]), "flat"),
    ("k requires grad", lambda c: c.store_kv([40, 41, 42], K.clone().requires_grad_(), K), "grad"),
    ("k on meta", lambda c: c.store_kv([40, 41, 42], K.to("meta"), K), "dense"),
    ("probe not tensors", lambda c: c.prefill("p", [1, 2, 3], probe="garbage"), "probe"),
    (
        "probe of other tokens",
        lambda c: c.prefill("p", [1, 2, 3], probe=(K[:2].repeat(1, 2, 1), K[:2], K[:2])),
        "probe k",
    ),
]
REMOTE = [  # need the coordinator's state: one call, answered with the error
    ("unknown rid free", lambda c: c.free("ghost"), "ghost"),
    ("unknown rid decode", lambda c: c.allocate_decode(["ghost"]), "ghost"),
    ("committed_len too long", lambda c: c.free("live", committed_len=999), "999"),
]


@pytest.fixture
def client(make_client):
    c = make_client()
    c.allocate_extend("live", np.arange(20))
    return c


@pytest.mark.parametrize(("fn", "needle"), [x[1:] for x in LOCAL], ids=[x[0] for x in LOCAL])
def test_rejected_before_any_actor_call(client, fn, needle):
    before = client.stats()
    real = client._coord
    client._coord = recorder = CallRecorder(real)
    try:
        with pytest.raises(ValueError) as info:
            fn(client)
    finally:
        client._coord = real
    assert isinstance(info.value, InvalidRequestError)
    assert needle in str(info.value), str(info.value)
    assert recorder.calls == []
    assert state(client.stats()) == state(before)


@pytest.mark.parametrize(("fn", "needle"), [x[1:] for x in REMOTE], ids=[x[0] for x in REMOTE])
def test_rejected_by_the_coordinator_state_unchanged(client, fn, needle):
    before = client.stats()
    with pytest.raises(InvalidRequestError) as info:
        fn(client)
    assert needle in str(info.value)
    after = client.stats()
    assert state(after) == state(before)
    assert client.check()["ok"]


def test_double_free_and_decode_after_free(client):
    client.free("live")
    before = client.stats()
    with pytest.raises(InvalidRequestError, match="live"):
        client.free("live")
    with pytest.raises(InvalidRequestError, match="live"):
        client.allocate_decode(["live"])
    assert state(client.stats()) == state(before)


def test_a_free_answered_unknown_forgets_the_rid(client):
    """A free whose answer was lost (a timeout) took effect: the next free of the rid is
    answered "unknown" and the client forgets it, instead of holding it for good."""
    from cpkv.errors import UnknownRequestError

    client._run(client._call("free", "live", False, None, what="free"))  # its answer "lost"
    assert "live" in client.live_rids  # as after the timed-out call
    with pytest.raises(UnknownRequestError, match="live"):
        client.free("live")
    assert "live" not in client.live_rids


CONNECT = [
    ("cp_size 0", dict(cp_size=0), "cp_size=0"),
    ("page_size 0", dict(page_size=0), "page_size=0"),
    ("num_pages too small", dict(num_pages_per_lane=1), "num_pages_per_lane=1"),
    ("bad dtype", dict(dtype="int8"), "int8"),
    ("float cp_size", dict(cp_size=2.5), "2.5"),
    ("negative heads", dict(num_heads=-1), "num_heads=-1"),
    ("infinite lease", dict(lease_s=float("inf")), "lease_s=inf"),
    ("zero lease", dict(lease_s=0), "lease_s=0"),
]


@pytest.mark.parametrize(
    ("kwargs", "needle"), [x[1:] for x in CONNECT], ids=[x[0] for x in CONNECT]
)
def test_connect_rejects_bad_sizes_before_starting_anything(kwargs, needle, monkeypatch):
    import cpkv.actors.ray_env as env

    def no_ray(*a, **k):
        raise AssertionError("Ray was touched")

    monkeypatch.setattr(env, "ensure_ray", no_ray)
    monkeypatch.setattr("cpkv.actors.pool.ensure_ray", no_ray)
    with pytest.raises(ValueError, match=needle):
        cpkv.connect(**kwargs)


def test_bad_strategy_and_mismatched_lane_count(make_client):
    with pytest.raises(ValueError, match="BOGUS"):
        make_client(fresh=True, strategy="BOGUS")
    c = make_client()
    with pytest.raises(ValueError, match="exists"):
        cpkv.connect(name=c.name, cp_size=2, page_size=4, num_pages_per_lane=32)
    assert c.stats()["cp_size"] == 4


def test_generate_takes_one_stop_token_or_several():
    from cpkv.client._args import stop_tokens

    assert stop_tokens(None) == frozenset()
    assert stop_tokens(7) == stop_tokens(np.int64(7)) == {7}
    assert stop_tokens([1, 2]) == stop_tokens(np.array([1, 2])) == {1, 2}  # config's lists
    for bad in ("7", [True], [-1], 2.0):
        with pytest.raises(InvalidRequestError, match="eos_token_id"):
            stop_tokens(bad)
