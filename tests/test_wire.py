"""The allocation calls' wire (cpkv.actors.wire) without Ray: what the client packs is what
the coordinator unpacks, answers and errors included."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from cpkv.actors.wire import PACKED_CALLS, pack, unpack
from cpkv.coordinator.coordinator import Coordinator
from cpkv.core.page_hash import PageHasher
from cpkv.core.steps import LaneReply, StepPacket, StepRequest, StepResult, StepSequence
from cpkv.core.validate import RequestKey
from cpkv.errors import KVCapacityWaitError


def test_every_packed_call_is_a_coordinator_call():
    assert all(callable(getattr(Coordinator, name, None)) for name in PACKED_CALLS)


def test_a_digest_call_and_its_answer_survive_the_wire():
    digest = PageHasher(16, b"k" * 16).digest(np.arange(100), 3)
    call = ("epoch", "client", ("client", 1), "rid", digest, None)
    back = unpack(pack(call))
    assert back[:4] == call[:4] and back[5] is None
    assert (back[4].offset, back[4].num_tokens) == (digest.offset, digest.num_tokens)
    np.testing.assert_array_equal(back[4].contents, digest.contents)
    np.testing.assert_array_equal(back[4].head, digest.head)


def test_a_capacity_wait_keeps_its_vectors_through_the_wire():
    error = KVCapacityWaitError(
        "short", required_by_owner=[3, 1], available_by_owner=[1, 1], deficit_by_owner=[2, 0]
    )
    answer, fence = unpack(pack((error, [("e:1", 4), ("e:2", 0)])))
    assert isinstance(answer, KVCapacityWaitError)
    assert (answer.required_by_owner, answer.deficit_by_owner) == ([3, 1], [2, 0])
    assert fence == [("e:1", 4), ("e:2", 0)]


# ----------------------------------------------------------- the step wire's own reducers
def _packet() -> StepPacket:
    seqs = (
        StepSequence(0, 16, np.array([1, 7]), np.arange(16), RequestKey("ns", "r0"), 0),
        StepSequence(64, 1, np.array([3, 4]), np.array([5]), 9, 16),
    )
    moves = ((("gen:1", 4, np.array([], np.int32), np.array([1], np.int32), 2),), None)
    return StepPacket(StepRequest(3, "g1", seqs, "auto", None, True), moves, (("gen:1", 3),), "e")


def test_a_step_packet_crosses_with_every_field_and_array_intact():
    packet = _packet()
    back = unpack(pack(packet))
    assert type(back) is StepPacket and type(back.step) is StepRequest
    assert (back.fences, back.epoch, back.moves[1]) == (packet.fences, packet.epoch, None)
    assert (back.step.step_id, back.step.group, back.step.sample) == (3, "g1", True)
    for got, sent in zip(back.step.sequences, packet.step.sequences, strict=True):
        assert type(got) is StepSequence
        assert (got.prefix_len, got.extend_len, got.rid, got.probe_start) == (
            sent.prefix_len, sent.extend_len, sent.rid, sent.probe_start,
        )  # fmt: skip
        for a, b in ((got.pages, sent.pages), (got.token_ids, sent.token_ids)):
            assert a.dtype == b.dtype and a.shape == b.shape
            np.testing.assert_array_equal(a, b)
        # A sequence's pages are a read-only copy; they stay read-only across the wire.
        assert not got.pages.flags.writeable and got.token_ids.flags.writeable
    assert back.step.sequences[0].rid == RequestKey("ns", "r0")
    gen, seq, taken, released, owner = back.moves[0][0]
    assert (gen, seq, owner, taken.dtype, taken.shape) == ("gen:1", 4, 2, np.int32, (0,))
    np.testing.assert_array_equal(released, [1])


ARRAYS = {
    "int64": np.arange(5),
    "empty-int32": np.zeros(0, np.int32),
    "2d": np.arange(12.0).reshape(3, 4),
    "0d": np.array(7.5),
    "non-contiguous": np.arange(20).reshape(4, 5)[:, ::2],
    "fortran": np.asfortranarray(np.arange(6).reshape(2, 3)),
    "big-endian": np.arange(4, dtype=">i4"),
    "bf16-bits": np.arange(8, dtype=np.uint16),
    "read-only": np.frombuffer(b"\x01\x00\x02\x00", np.int16),
    "objects": np.array([{"a": 1}, None], dtype=object),
    "structured": np.zeros(2, dtype=[("x", "<i4"), ("y", "<f8")]),
    "datetime64": np.array(["2026-12-06", "NaT"], dtype="M8[D]"),
    "timedelta64": np.zeros(2, "m8[s]"),
    "read-only-fortran": np.asfortranarray(np.arange(6).reshape(2, 3)),
}
ARRAYS["read-only-fortran"].flags.writeable = False


@pytest.mark.parametrize("name", list(ARRAYS))
def test_arrays_cross_as_numpy_pickles_them(name):
    a = ARRAYS[name]
    back = unpack(pack({"a": a, "logits": {0: a}}))
    for got in (back["a"], back["logits"][0]):
        assert type(got) is np.ndarray
        assert (got.dtype, got.shape) == (a.dtype, a.shape)
        assert got.flags.writeable == a.flags.writeable
        if a.dtype.hasobject:
            assert got.tolist() == a.tolist()
        else:
            np.testing.assert_array_equal(got, a)


class _LaterSequence(StepSequence):
    """A subclass: not in the wire's table, so pickled the standard way."""

    __slots__ = ()


def test_a_subclass_and_a_lane_reply_with_an_error_cross_as_themselves():
    seq = _LaterSequence(0, 2, np.array([1]), np.array([3, 4]))
    back = unpack(pack(seq))
    assert type(back) is _LaterSequence and back.extend_len == 2
    reply = unpack(pack(LaneReply(error=RuntimeError("lane 1 died"))))
    assert type(reply) is LaneReply and str(reply.error) == "lane 1 died"
    result = StepResult(16, 0.5, 0.0, 0.1, "pass_q", 0, {0: np.arange(3, dtype=np.uint16)})
    value = unpack(pack(LaneReply((("gen", 1), result)))).unwrap()
    assert value[0] == ("gen", 1) and type(value[1]) is StepResult
    assert (value[1].num_tokens, value[1].mode, value[1].logits_dtype) == (16, "pass_q", "float32")
    np.testing.assert_array_equal(value[1].logits[0], [0, 1, 2])


def test_the_wire_never_runs_a_classs_checks_again():
    """A rebuilt StepSequence skips __post_init__ (its fields were checked where it was made):
    the wire must hand every field over as it was, slots included."""
    seq = StepSequence(3, 2, np.array([1]), np.array([3, 4]), "r", 5)
    back = unpack(pack(seq))
    assert [getattr(back, s) is not None for s in StepSequence.__slots__] == [True] * 6
    with pytest.raises(dataclasses.FrozenInstanceError):
        back.extend_len = 9  # still frozen
