"""Page identity: keyed, chained, salted; no prompt can be crafted to alias another."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from cpkv import CPAllocator, InvalidRequestError
from cpkv.core.page_hash import PageHasher
from cpkv.errors import StaleDigestError


def hashes(h: PageHasher, tokens, salt=None) -> np.ndarray:
    return h.hash_pages(np.asarray(tokens, dtype=np.int64), h.start(salt))[0]


def test_full_pages_only_and_content_sensitive():
    h = PageHasher(2, key=bytes(32))
    out = hashes(h, [1, 2, 3, 4, 5])
    assert out.dtype == np.uint64 and out.shape == (2,)
    assert out[0] != hashes(h, [2, 1])[0]


def test_chained_on_every_page_before():
    h = PageHasher(4, key=bytes(32))
    a = hashes(h, [1, 2, 3, 4, 9, 9, 9, 9])
    b = hashes(h, [5, 2, 3, 4, 9, 9, 9, 9])
    assert a[1] != b[1]  # same second page, different first page


def test_continuing_a_chain_equals_hashing_at_once():
    h = PageHasher(16)
    tokens = np.random.default_rng(0).integers(0, 1 << 40, size=16 * 37 + 5)
    whole, end = h.hash_pages(tokens, h.start("s"))
    part, mid = h.hash_pages(tokens[: 16 * 11], h.start("s"))
    rest, end2 = h.hash_pages(tokens[16 * 11 :], mid)
    assert np.array_equal(np.concatenate([part, rest]), whole) and end == end2


def test_salt_and_key_change_every_hash():
    tokens = np.arange(64)
    h, other = PageHasher(8), PageHasher(8)
    base = hashes(h, tokens)
    assert not np.intersect1d(base, hashes(h, tokens, salt="tenant-a")).size
    assert not np.intersect1d(hashes(h, tokens, "a"), hashes(h, tokens, b"a")).size
    assert not np.intersect1d(base, hashes(other, tokens)).size  # a key per coordinator


def test_high_token_bits_count():
    h = PageHasher(1, key=bytes(32))
    assert hashes(h, [5])[0] != hashes(h, [5 + (1 << 32)])[0]


def test_old_public_linear_collision_does_not_alias():
    """Prompts crafted to collide under the old public linear hash (sum of
    token * public odd multiplier mod 2**64) share no page now."""
    ps = 4
    rng = np.random.default_rng(0x6370_6B76 + ps)  # the old hash's public multipliers
    m = rng.integers(1, 2**63, size=ps, dtype=np.uint64) | np.uint64(1)
    a = np.array([10, 20, 30, 40], dtype=np.int64)
    # d0*m0 + d1*m1 = 0 mod 2**64 with d0 = m1 * 2**62, d1 = -m0 * 2**62 (mod 2**64):
    # both are multiples of 2**62, so d0 = 2**62 * (m1 mod 4), d1 = 2**62 * (-m0 mod 4).
    d0 = (int(m[1]) % 4) << 62
    d1 = (-int(m[0]) % 4) << 62
    b = a.copy()
    b[0] = (int(a[0]) + d0) % (1 << 64)
    b[1] = (int(a[1]) + d1) % (1 << 64)
    b = b.astype(np.int64) if (b >= 0).all() else b
    old = lambda t: int((t.view(np.uint64) * m).sum(dtype=np.uint64))
    if (b >= 0).all():
        assert old(a) == old(b) and not np.array_equal(a, b)
        alloc = CPAllocator(2, ps, 16, max_reqs=4, max_context_len=64)
        alloc.allocate_extend("victim", np.concatenate([a, [1]]))
        alloc.free("victim")
        got = alloc.allocate_extend("attacker", np.concatenate([b, [1]]))
        assert got.cached_len == 0


def test_salted_requests_share_only_with_their_salt():
    a = CPAllocator(2, 4, 32, max_reqs=8, max_context_len=256)
    prompt = np.arange(40)
    a.allocate_extend("t1", prompt, cache_salt="tenant-1")
    a.free("t1")
    assert a.allocate_extend("t2", prompt, cache_salt="tenant-2").cached_len == 0
    assert a.allocate_extend("none", prompt).cached_len == 0
    assert a.allocate_extend("t1b", prompt, cache_salt="tenant-1").cached_len == 36
    assert a.match_prefix(prompt, cache_salt="tenant-1").size == 10
    with pytest.raises(ValueError, match="cache_salt"):
        a.allocate_extend("t1b", [1, 2], cache_salt="tenant-9")  # fixed at creation
    a.check_invariants()


def test_a_page_hash_depends_only_on_that_page_and_its_parents():
    """One large id elsewhere in the call must not re-key the other pages (issue 19.10)."""
    h = PageHasher(4, key=bytes(32))
    small = [1, 2, 3, 4, 5, 6, 7, 8]
    alone = hashes(h, small)
    with_wide_tail = hashes(h, [*small, 9, 10, 11, 2**40])
    assert np.array_equal(with_wide_tail[:2], alone)
    # and a wide page hashes alike however it is split across calls
    wide = np.array([2**33, 1, 2, 3, 4, 5, 6, 7], dtype=np.int64)
    whole, _ = h.hash_pages(wide, h.start())
    first, mid = h.hash_pages(wide[:4], h.start())
    second, _ = h.hash_pages(wide[4:], mid)
    assert np.array_equal(whole, np.concatenate([first, second]))


def test_cached_prefix_hits_whatever_ids_follow_it():
    a = CPAllocator(2, 4, 64, hash_key=bytes(32))
    prompt = list(range(1, 17))
    a.allocate_extend("a", prompt)
    a.free("a")
    hit = a.allocate_extend("b", [*prompt, 2**40, 3])
    assert hit.cached_len == 16


# ------------------------------------------------------------------ client-side digests (#22)
def _chunked(a: CPAllocator, rid, tokens: np.ndarray, cuts, digest: PageHasher | None) -> None:
    """Extend ``rid`` chunk by chunk: by token ids, or by digests made with ``digest``."""
    held = 0
    for lo, hi in zip([0, *cuts], [*cuts, len(tokens)], strict=True):
        chunk = np.ascontiguousarray(tokens[lo:hi])
        sent = chunk if digest is None else digest.digest(chunk, held % digest.page_size)
        alloc = a.allocate_extend(rid, sent)
        held = alloc.prefix_len + alloc.extend_len


@pytest.mark.parametrize(
    "cuts", [[], [3], [8], [5, 6, 19], [1, 2, 3, 4, 5, 30]], ids=lambda c: f"cuts{c}"
)
@pytest.mark.parametrize("wide", [False, True], ids=["narrow-ids", "wide-ids"])
def test_a_client_digest_caches_the_pages_its_tokens_would(cuts, wide):
    """Pages hashed on the client's side (contents only, chained by the coordinator) are
    the pages the coordinator would hash from the ids: same cache hits, chunk by chunk."""
    key, ps = bytes(range(32)), 4
    tokens = np.random.default_rng(len(cuts)).integers(0, 1 << (40 if wide else 16), size=37)
    client = PageHasher(ps, key)
    by_ids, by_digest = (CPAllocator(2, ps, 32, 4, 1000, hash_key=key) for _ in range(2))
    _chunked(by_ids, "r", tokens, cuts, None)
    _chunked(by_digest, "r", tokens, cuts, client)
    for a in (by_ids, by_digest):
        a.free("r")
    # Every full page is cached under the same identity in both (a prompt of the same ids
    # matches all 9 of them), and nothing else is.
    for a in (by_ids, by_digest):
        assert a.match_prefix(tokens).shape == (9,)
        hit = a.allocate_extend("again", client.digest(tokens, 0))
        assert hit.cached_len == 36
        other = tokens.copy()
        other[17] += 1
        assert a.match_prefix(other).shape == (4,)


def test_a_stale_digest_is_refused_and_changes_nothing():
    key = bytes(32)
    a = CPAllocator(2, 4, 32, 4, 1000, hash_key=key)
    h = PageHasher(4, key)
    a.allocate_extend("r", np.arange(6))  # 2 tokens in its partial page
    before = a.stats()
    with pytest.raises(StaleDigestError, match="built for 0 tokens"):
        a.allocate_extend("r", h.digest(np.arange(6, 16), 0))
    assert a.stats() == before
    assert a.allocate_extend("r", h.digest(np.arange(6, 16), 2)).extend_len == 10


@pytest.mark.parametrize(
    "field,value",
    [("offset", 4), ("num_tokens", 9), ("head", np.arange(3)), ("tail", np.arange(4))],
    ids=lambda v: str(v) if isinstance(v, (int, str)) else f"len{len(v)}",
)
def test_a_digest_that_does_not_add_up_is_refused(field, value):
    d = PageHasher(4, bytes(32)).digest(np.arange(10), 2)  # head 2, one page, tail 0
    with pytest.raises(InvalidRequestError, match="TokenDigest"):
        dataclasses.replace(d, **{field: value})
