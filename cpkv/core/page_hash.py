"""Page identity for the prefix cache: a keyed hash no prompt can be crafted against.

A page's identity is a 64-bit hash of its tokens, chained on every page before
it and on the request's ``cache_salt``. The hash is keyed with a secret drawn
from the OS at random for each coordinator, given only to its own (trusted)
clients, which hash their pages' contents with it (:class:`TokenDigest`):
without the key, two different pages collide with probability 2**-64 whatever
the attacker chose, even one who has read this code (vLLM's CVE-2025-25183 was a
public, unkeyed hash; the one cpkv had before was public and linear).

Construction, per page of ``P`` tokens seen as 32-bit words ``m_i`` (each id is
one word when every id of the page is below 2**32, as vocabulary ids are; otherwise
both halves of every int64 id of that page are words, with keys of their own):

    c = ((k0 + sum_i k_i * m_i) mod 2**64) >> 32     (twice, independent keys: 64 bits)

is strongly universal (Lemire and Kaser, "Strongly universal string hashing is
fast", 2014): for any two different pages and a random key the two halves agree
with probability 2**-32 each. Pages are chained by a running sum ``S`` of the
page hashes seeded with the salt's keyed digest, ``h_j = c_j xor (S_{j-1} * k_chain)``,
so a hash speaks for its whole prefix; the prefix cache additionally matches
along the tree path, so a page is only ever found under its own parent.

The whole thing is two integer matrix products and a cumulative sum: about
0.3 ms for a 128k-token prompt on one core (``benchmarks/bench_core.py``).
"""

from __future__ import annotations

import hashlib
import secrets
from dataclasses import dataclass

import numpy as np

from cpkv.errors import InvalidRequestError

__all__ = ["ChainState", "PageHasher", "TokenDigest"]

_U32 = np.uint64(32)


@dataclass(slots=True, frozen=True)
class ChainState:
    """Where a request's page chain stands: the running sum after its last full page.

    Attributes:
        running: ``S``, the salt's digest plus every full page hash so far (mod 2**64).
    """

    running: int


@dataclass(slots=True, frozen=True, eq=False)
class TokenDigest:
    """New tokens as allocation needs them, hashed on the client's side: 8 bytes a full
    page instead of 8 a token (:meth:`PageHasher.digest`).

    The request held ``offset`` tokens in its partial last page when the client built it;
    ``head`` fills that page, ``contents`` are the keyed contents of the full pages after
    it, ``tail`` the tokens after those. The coordinator chains the contents on the
    request's page chain; a digest built for another offset is refused
    (:class:`cpkv.errors.StaleDigestError`) and the client sends the tokens instead.

    Attributes:
        page_size: tokens per page.
        num_tokens: the new tokens, ``len(head) + page_size * len(contents) + len(tail)``.
        offset: tokens in the request's partial page, in ``[0, page_size)``.
        head: ``int64 [min(num_tokens, (page_size - offset) % page_size)]``.
        contents: ``uint64 [m]`` (:meth:`PageHasher.contents`).
        tail: ``int64 [r]``, ``r < page_size`` (empty when ``head`` is all there is).
    """

    page_size: int
    num_tokens: int
    offset: int
    head: np.ndarray
    contents: np.ndarray
    tail: np.ndarray

    def __post_init__(self) -> None:
        ps, n = self.page_size, self.num_tokens
        ok = (
            isinstance(ps, int)
            and isinstance(n, int)
            and isinstance(self.offset, int)
            and ps >= 1
            and n >= 1
            and 0 <= self.offset < ps
        )
        for name, a, dtype in (
            ("head", self.head, np.int64),
            ("contents", self.contents, np.uint64),
            ("tail", self.tail, np.int64),
        ):
            if not (isinstance(a, np.ndarray) and a.ndim == 1 and a.dtype == dtype):
                raise InvalidRequestError(
                    f"TokenDigest.{name} must be a 1-D {dtype.__name__} array"
                )
        ok = ok and self.head.shape[0] == min(n, (ps - self.offset) % ps)
        ok = ok and self.tail.shape[0] < ps
        ok = ok and n == self.head.shape[0] + ps * self.contents.shape[0] + self.tail.shape[0]
        ok = ok and (self.head.shape[0] < n or self.tail.shape[0] == 0)
        if not ok:
            raise InvalidRequestError(
                f"TokenDigest of {self.num_tokens!r} tokens at offset {self.offset!r} (page "
                f"{self.page_size!r}) does not add up: head {self.head.shape}, contents "
                f"{self.contents.shape}, tail {self.tail.shape}"
            )
        for name, a in (("head", self.head), ("tail", self.tail)):
            if a.size and int(a.min()) < 0:
                raise InvalidRequestError(f"TokenDigest.{name} holds a negative token id")

    @property
    def nbytes(self) -> int:
        return self.head.nbytes + self.contents.nbytes + self.tail.nbytes


class PageHasher:
    """Keyed, chained 64-bit page hashes for one page size.

    Args:
        page_size: tokens per page.
        key: 32+ bytes of secret; ``None`` draws one from the OS (one per coordinator).
    """

    def __init__(self, page_size: int, key: bytes | None = None) -> None:
        assert page_size >= 1, page_size
        self.page_size = page_size
        self._key = secrets.token_bytes(32) if key is None else bytes(key)
        assert len(self._key) >= 16, "key too short"
        seed = hashlib.blake2b(self._key, digest_size=64, person=b"cpkv-page-keys").digest()
        rng = np.random.Generator(np.random.PCG64(int.from_bytes(seed, "little")))
        draw = lambda *shape: rng.integers(0, 2**64, size=shape, dtype=np.uint64)
        # A multiplier per 32-bit word and an additive key, for each 32-bit half of the
        # hash; ids below 2**32 (one word each) and larger ids (two) have separate keys.
        self._mult_narrow, self._add_narrow = draw(page_size, 2), draw(2)
        self._mult_wide, self._add_wide = draw(2 * page_size, 2), draw(2)
        self._chain = rng.integers(0, 2**64, dtype=np.uint64, endpoint=False) | np.uint64(1)

    def start(self, cache_salt: str | bytes | None = None) -> ChainState:
        """The chain state of a new request: the keyed digest of its ``cache_salt``.

        Requests share cached pages only when their salts are equal (``None`` is its own salt).
        """
        if cache_salt is None:
            data = b"\x00"
        elif isinstance(cache_salt, str):
            data = b"\x01" + cache_salt.encode()
        else:
            data = b"\x02" + bytes(cache_salt)
        digest = hashlib.blake2b(data, digest_size=8, key=self._key[:64]).digest()
        return ChainState(int.from_bytes(digest, "little"))

    @property
    def key(self) -> bytes:
        """The secret, for the coordinator's own clients only (trusted code, see the README's
        threat model): they hash page contents on their side with it."""
        return self._key

    def digest(self, tokens: np.ndarray, offset: int) -> TokenDigest:
        """What allocation needs of new ``tokens`` for a request holding ``offset`` tokens
        in its partial page (see :class:`TokenDigest`).

        Args:
            tokens: ``int64 [n]`` contiguous, ``n >= 1``.
            offset: tokens in the request's partial page, in ``[0, page_size)``.
        """
        ps, n = self.page_size, int(tokens.shape[0])
        h = min(n, (ps - offset) % ps)
        body = tokens[h:]
        full = (body.shape[0] // ps) * ps
        return TokenDigest(
            ps, n, offset, tokens[:h].copy(), self.contents(body), body[full:].copy()
        )

    def hash_pages(self, tokens: np.ndarray, state: ChainState) -> tuple[np.ndarray, ChainState]:
        """Hash the full pages of ``tokens`` that follow a chain at ``state``.

        Args:
            tokens: ``int64 [n]`` ids starting at a page boundary; a partial last page is
                ignored (hash it once it is full).
            state: the chain after the previous full page (:meth:`start` for the first).

        Returns:
            ``(uint64 [n // page_size] hashes, the chain state after them)``.
        """
        return self.chain(self.contents(tokens), state)

    def contents(self, tokens: np.ndarray) -> np.ndarray:
        """The keyed content of each full page of ``tokens`` (no chain: a page's own ids).

        Args:
            tokens: ``int64 [n]`` contiguous ids starting at a page boundary; a partial
                last page is ignored.

        Returns:
            ``uint64 [n // page_size]``.
        """
        ps = self.page_size
        n = tokens.shape[0] // ps
        if n == 0:
            return np.empty(0, dtype=np.uint64)
        assert tokens.dtype == np.int64 and tokens.flags.c_contiguous, tokens.dtype
        body = tokens[: n * ps]
        # NOTE: uint64 matmul wraps mod 2**64, which is what the universal hash needs.
        # A page's words depend on its own ids only (never on the rest of the call), so
        # its identity is the same whichever tokens share the call.
        pages = body.view(np.uint64).reshape(n, ps)
        if int(body.max()) < 2**32:  # 0.2 ms for 128k tokens instead of 0.5
            sums = pages @ self._mult_narrow
            sums += self._add_narrow
        else:
            wide = pages.max(axis=1) >= np.uint64(2**32)
            sums = np.empty((n, 2), dtype=np.uint64)
            narrow = ~wide
            sums[narrow] = pages[narrow] @ self._mult_narrow + self._add_narrow
            words = body.view(np.uint32).reshape(n, 2 * ps)[wide].astype(np.uint64)
            sums[wide] = words @ self._mult_wide + self._add_wide
        return (sums[:, 0] >> _U32) << _U32 | (sums[:, 1] >> _U32)

    def chain(self, contents: np.ndarray, state: ChainState) -> tuple[np.ndarray, ChainState]:
        """Chain page contents after ``state``: each hash speaks for its whole prefix.

        Args:
            contents: ``uint64 [n]`` from :meth:`contents`.
            state: the chain after the previous full page.

        Returns:
            ``(uint64 [n] hashes, the chain state after them)``.
        """
        n = contents.shape[0]
        if n == 0:
            return np.empty(0, dtype=np.uint64), state
        running = np.cumsum(contents, dtype=np.uint64)
        running += np.uint64(state.running)
        prev = np.empty(n, dtype=np.uint64)
        prev[0] = state.running
        prev[1:] = running[:-1]
        hashes = contents ^ (prev * self._chain)
        return hashes, ChainState(int(running[-1]))
