"""What an allocation sends through Ray (issue 22): a client hashes its tokens' pages with
the coordinator's key and sends 8 bytes a page; a digest made stale by another client of
its namespace is refused and the client sends the ids, so the answer is the same."""

from __future__ import annotations

import numpy as np
import pytest

from cpkv.core.page_hash import TokenDigest

from .conftest import DEFAULTS
from .test_bad_input import CallRecorder

pytestmark = pytest.mark.ray


def test_an_allocation_sends_page_digests_not_token_ids(make_client):
    c = make_client()
    ps = DEFAULTS["page_size"]
    tokens = np.arange(1000, 1000 + 60 * ps + 3)
    real, c._coord = c._coord, CallRecorder(c._coord)
    try:
        first = c.allocate_extend("r", tokens)
        more = c.allocate_extend("r", np.arange(7))  # continues the partial page
    finally:
        recorded, c._coord = c._coord.sent, real
    sent = [args[4] for name, args in recorded if name == "allocate_extend"]
    assert all(isinstance(d, TokenDigest) for d in sent)
    assert sent[0].nbytes < tokens.nbytes // ps + 8 * ps  # 8 bytes a page, plus the tail
    assert (sent[1].offset, sent[1].head.tolist()) == (3, [0])
    assert (first.extend_len, more.prefix_len, more.extend_len) == (len(tokens), len(tokens), 7)
    c.free("r")
    # The pages the digests named are the pages the ids name: a prompt of the same ids hits.
    hit = c.allocate_extend("again", np.concatenate([tokens, np.arange(7), [5]]))
    assert hit.cached_len == (len(tokens) + 7) // ps * ps


def test_a_digest_made_stale_by_a_namespace_peer_falls_back_to_token_ids(make_client, attach):
    pool = make_client()
    a, b = attach(pool, namespace="team"), attach(pool, namespace="team")
    ps = DEFAULTS["page_size"]
    a.allocate_extend("shared", np.arange(6))  # a: 2 tokens in the partial page
    b.allocate_extend("shared", np.arange(6, 11))  # b assumed 0: stale, then ids
    out = a.allocate_extend("shared", np.arange(11, 40))  # a assumed 2, it is 3
    assert (out.prefix_len, out.extend_len) == (11, 29)
    a.free("shared")
    assert b.stats()["num_requests"] == 0
    # Every full page of the 40 ids was cached under its true identity.
    hit = b.allocate_extend("again", np.arange(41))
    assert hit.cached_len == 40 // ps * ps


def test_a_retry_by_call_id_resends_what_was_first_sent(make_client):
    c = make_client()
    first = c.allocate_extend("r", np.arange(10), call_id="x")  # offset moves to 2 after
    again = c.allocate_extend("r", np.arange(10), call_id="x")
    assert again.new_pages.tolist() == first.new_pages.tolist()
    assert c.stats()["extend_allocations"] == 1


def test_after_a_reset_a_reused_rid_is_digested_as_new(make_client):
    c = make_client()
    c.allocate_extend("r", np.arange(7))  # 3 tokens in its partial page
    c.reset()
    real, c._coord = c._coord, CallRecorder(c._coord)
    try:
        again = c.allocate_extend("r", np.arange(7))
    finally:
        recorded, c._coord = c._coord.sent, real
    # One call, digested at offset 0: no stale digest, no second call with the ids.
    sent = [args[4] for name, args in recorded if name == "allocate_extend"]
    assert len(sent) == 1 and isinstance(sent[0], TokenDigest) and sent[0].offset == 0
    assert (again.prefix_len, again.extend_len) == (0, 7)
