"""CP attention on the lanes (local Ray, gloo): one step call per lane, exchange inside.

Each step carries probe q/k/v (a deterministic function of token and position, so a
cached prefix holds exactly what a recomputation would); every lane attends its own
tokens with the K/V it holds and the exchange. The outputs must equal a single-device
fp32 SDPA over the whole sequence, and the shards must hold exactly each token's K/V.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

pytestmark = pytest.mark.ray

HQ, HKV, D, PS = 4, 2, 8, 4
_GEN = torch.Generator().manual_seed(0)
_TOK = {n: torch.randn(200, (HQ + 2 * HKV) * D, generator=_GEN) for n in ("t",)}["t"]
_POS = torch.randn(512, (HQ + 2 * HKV) * D, generator=_GEN)


def qkv(tokens: np.ndarray, start: int = 0) -> tuple[torch.Tensor, ...]:
    """q ``[T, HQ, D]``, k and v ``[T, HKV, D]`` of tokens at positions ``start...``."""
    x = _TOK[torch.as_tensor(tokens)] + _POS[start : start + len(tokens)]
    q, k, v = x.split([HQ * D, HKV * D, HKV * D], dim=1)
    return q.reshape(-1, HQ, D), k.reshape(-1, HKV, D), v.reshape(-1, HKV, D)


def reference(seq: np.ndarray, first: int) -> torch.Tensor:
    """SDPA of positions ``first..`` of ``seq`` over the whole causal sequence (fp32)."""
    q, k, v = qkv(seq)
    k, v = (t.repeat_interleave(HQ // HKV, dim=1) for t in (k, v))
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), is_causal=True
    ).transpose(0, 1)
    return out[first:]


def check_kv(client, alloc, seq: np.ndarray) -> None:
    """The shards hold exactly the step's tokens' K/V at their slots."""
    _, k, v = qkv(seq)
    got_k, got_v = client.gather_kv(alloc.out_cache_loc)
    new = slice(alloc.prefix_len, alloc.prefix_len + alloc.extend_len)
    assert torch.equal(got_k, k[new]) and torch.equal(got_v, v[new])


def close(got: np.ndarray, want: torch.Tensor) -> None:
    np.testing.assert_allclose(got, want.numpy(), rtol=1e-4, atol=1e-5)


def pool(make_client, cp: int):
    """A pool of ``cp`` lanes: 48 pages a lane hold these tests at cp 1; at cp 4 the session's
    default pool (32 pages a lane) holds them too, and is running already (a cp=4 pool costs
    ~10 s to start on 2 cores)."""
    return make_client() if cp == 4 else make_client(cp_size=cp, num_pages_per_lane=48)


@pytest.mark.parametrize("cp", [1, 2, 3, 4], ids=lambda c: f"cp{c}")
def test_probe_attention_equals_sdpa(make_client, cp):
    c = pool(make_client, cp)
    assert c.config.cp_size == cp
    rng = np.random.default_rng(cp)
    for mode in ("pass_q", "pass_kv", "auto"):
        c.reset()
        # A whole prompt: 37 tokens (not a multiple of the page, nor of 2 * cp).
        prompt = rng.integers(0, 200, size=37)
        res = c.prefill("whole", prompt, mode=mode, probe=qkv(prompt))
        close(res.attention, reference(prompt, 0))
        check_kv(c, res.allocation, prompt)
        assert cp == 1 or res.mode == mode or mode == "auto"
        # Bytes each lane took from the others: none at cp 1, some on every lane otherwise.
        assert len(res.lane_exchange_bytes) == cp
        assert all((b > 0) == (cp > 1) for b in res.lane_exchange_bytes), res.lane_exchange_bytes
        # A cached prefix whose pages sit on whichever lanes computed them.
        c.free("whole")
        longer = np.concatenate([prompt[:32], rng.integers(0, 200, size=13)])
        res = c.prefill("reuse", longer, mode=mode, probe=qkv(longer))
        assert res.allocation.prefix_len == 32
        close(res.attention, reference(longer, 32))
        check_kv(c, res.allocation, longer)
        # A chunked continuation whose prefix ends mid-page.
        chunks = [rng.integers(0, 200, size=n) for n in (30, 25, 3)]
        seq = np.empty(0, dtype=np.int64)
        for i, chunk in enumerate(chunks):
            res = c.prefill("chunked", chunk, mode=mode, probe=qkv(chunk, len(seq)))
            first = len(seq)
            seq = np.concatenate([seq, chunk])
            close(res.attention, reference(seq, first))
            check_kv(c, res.allocation, seq)
            assert res.allocation.prefix_len == first, i
        # A batch: a long new prompt (its own plan), a short one (a lane sees none of it),
        # and a continuation of the chunked request.
        items = [
            ("b-long", rng.integers(0, 200, size=41)),
            ("b-short", rng.integers(0, 200, size=3)),
        ]
        more = rng.integers(0, 200, size=6)
        probes = [qkv(t) for _, t in items] + [qkv(more, len(seq))]
        probe = tuple(torch.cat([p[i] for p in probes]) for i in range(3))
        results = c.prefill_batch([*items, ("chunked", more)], mode=mode, probe=probe)
        for (_, toks), res in zip(items, results[:2], strict=True):
            close(res.attention, reference(toks, 0))
            check_kv(c, res.allocation, toks)
        first = len(seq)
        seq = np.concatenate([seq, more])
        close(results[2].attention, reference(seq, first))
        # Decode: one query per request, every lane's pages merged.
        nxt = rng.integers(0, 200, size=2)
        sequences = {"chunked": seq, "b-long": items[0][1]}
        rows = [qkv(nxt[i : i + 1], len(s)) for i, s in enumerate(sequences.values())]
        probe = tuple(torch.cat([r[i] for r in rows]) for i in range(3))
        out = c.decode(list(sequences), nxt, mode=mode, probe=probe)
        for i, s in enumerate(sequences.values()):
            close(out[i : i + 1], reference(np.concatenate([s, nxt[i : i + 1]]), len(s)))
        # A prompt within one page: at cp > 1 its lane attends alone, the others skip it.
        tiny = rng.integers(0, 200, size=3)
        res = c.prefill("tiny", tiny, mode=mode, probe=qkv(tiny))
        close(res.attention, reference(tiny, 0))
        assert sum(res.lane_exchange_bytes) == 0
        report = c.check()
        assert report["ok"], report


def test_step_calls_are_one_per_lane_and_kv_never_crosses_the_driver(make_client):
    c = pool(make_client, 4)
    prompt = np.arange(64) % 200
    before = c.stats()["lane_moves_by_op"].get("prefill", 0)
    riding_before = c.stats()["moves_in_step_calls"]
    res = c.prefill("r", prompt, probe=qkv(prompt))
    assert len(res.lane_seconds) == 4  # one step result per lane, all in one round
    # Each lane's time splits into its parts: attention holds the collectives' time.
    for total, attn, wait in zip(
        res.lane_seconds, res.lane_attention_seconds, res.lane_wait_seconds, strict=True
    ):
        assert 0 < wait < attn < total
    assert c.stats()["lane_moves_by_op"].get("prefill", 0) - before == 4  # page moves
    assert c.stats()["moves_in_step_calls"] - riding_before == 4  # ... riding in the steps
    assert res.allocation.page_owners is not None  # the zigzag plan
