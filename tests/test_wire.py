"""The allocation calls' wire (cpkv.actors.wire) without Ray: what the client packs is what
the coordinator unpacks, answers and errors included."""

from __future__ import annotations

import numpy as np

from cpkv.actors.wire import PACKED_CALLS, pack, unpack
from cpkv.coordinator.coordinator import Coordinator
from cpkv.core.page_hash import PageHasher
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
