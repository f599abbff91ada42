"""A Llama prefilled and decoded across the lanes equals transformers' own forward.

Tiny random configs with odd sizes, fp32, CPU lanes on a local Ray (gloo).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

pytestmark = pytest.mark.ray

transformers = pytest.importorskip("transformers")

VOCAB = 97

# NOTE: ``cp`` is module-scoped so that pytest orders the tests by it: each pool (one a cp,
# a model on every lane) then starts once, not again after the session's pool cache evicted it.


@pytest.fixture(scope="session")
def hf_llama():
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=60,
        intermediate_size=100,
        num_hidden_layers=3,
        num_attention_heads=6,
        num_key_value_heads=2,
        head_dim=10,
        max_position_embeddings=1024,
        rope_theta=500.0,
        attn_implementation="eager",
    )
    return transformers.LlamaForCausalLM(config).float().eval()


def hf_logits(model, tokens) -> np.ndarray:
    with torch.no_grad():
        return model(torch.as_tensor(np.asarray(tokens))[None]).logits[0, -1].float().numpy()


def assert_close(got: np.ndarray, want: np.ndarray) -> None:
    rel = np.abs(got - want).max() / np.abs(want).max()
    assert rel < 1e-3, rel


@pytest.mark.parametrize("cp", [1, 2, 3, 4], ids=lambda c: f"cp{c}", scope="module")
def test_prefill_chunks_prefix_reuse_and_decode_equal_transformers(make_client, hf_llama, cp):
    c = make_client(cp_size=cp, num_pages_per_lane=40, model=hf_llama)
    rng = np.random.default_rng(cp)
    prompt = rng.integers(0, VOCAB, size=45)
    res = c.prefill("whole", prompt, mode="pass_kv")
    assert res.logits.shape == (VOCAB,) and res.logits.dtype == np.float32
    assert_close(res.logits, hf_logits(hf_llama, prompt))
    assert (cp == 1) == (res.allocation.page_owners is None)
    # pass_kv, no prefix: in every layer each lane receives the others' new K/V (fp32).
    cfg = hf_llama.config
    kv_row = 2 * cfg.num_key_value_heads * cfg.head_dim * 4
    want = cfg.num_hidden_layers * (cp - 1) * len(prompt) * kv_row
    assert sum(res.lane_exchange_bytes) == want, res.lane_exchange_bytes
    # Chunked prefill: each chunk's last-token logits.
    seq = np.empty(0, dtype=np.int64)
    for n in (13, 9, 11):
        chunk = rng.integers(0, VOCAB, size=n)
        seq = np.concatenate([seq, chunk])
        assert_close(c.prefill("chunked", chunk).logits, hf_logits(hf_llama, seq))
    # A new request reusing the cached prefix of a freed one.
    c.free("whole")
    shared = np.concatenate([prompt[:24], rng.integers(0, VOCAB, size=10)])
    res = c.prefill("reuse", shared)
    assert res.allocation.prefix_len == 24 and res.allocation.cached_len == 24
    assert_close(res.logits, hf_logits(hf_llama, shared))
    # Two more on the same cached prefix, in one step: requests share its pages (read-only).
    batch = [
        (f"reuse{i}", np.concatenate([prompt[:24], rng.integers(0, VOCAB, size=5 + i)]))
        for i in (2, 3)
    ]
    for (_, tokens), res in zip(batch, c.prefill_batch(batch), strict=True):
        assert res.allocation.cached_len == 24
        assert_close(res.logits, hf_logits(hf_llama, tokens))
    # Decode several steps, three requests at once (two of them on shared pages).
    seqs = {"chunked": seq, "reuse": shared, batch[0][0]: batch[0][1]}
    for _ in range(3):
        nxt = [int(np.argmax(hf_logits(hf_llama, s))) for s in seqs.values()]
        got = c.decode(list(seqs), nxt)
        seqs = {
            rid: np.concatenate([s, [t]]) for (rid, s), t in zip(seqs.items(), nxt, strict=True)
        }
        for row, s in zip(got, seqs.values(), strict=True):
            assert_close(row, hf_logits(hf_llama, s))
    # A prompt within one page: one lane holds the whole step (at cp > 1 the others skip it,
    # nothing is exchanged), then its decodes, until the sequence spans two pages.
    tiny = rng.integers(0, VOCAB, size=3)
    res = c.prefill("tiny", tiny)
    assert_close(res.logits, hf_logits(hf_llama, tiny))
    assert sum(res.lane_exchange_bytes) == 0
    assert sum(s > 0 for s in res.lane_attention_seconds) == 1
    for _ in range(2):
        nxt = int(np.argmax(hf_logits(hf_llama, tiny)))
        (row,) = c.decode(["tiny"], [nxt])
        tiny = np.concatenate([tiny, [nxt]])
        assert_close(row, hf_logits(hf_llama, tiny))
    report = c.check()
    assert report["ok"], report


@pytest.mark.parametrize("cp", [2, 3], ids=lambda c: f"cp{c}", scope="module")
def test_generate_equals_transformers_greedy(make_client, hf_llama, cp):
    c = make_client(cp_size=cp, num_pages_per_lane=40, model=hf_llama)
    prompt = np.random.default_rng(7).integers(0, VOCAB, size=21)
    got = c.generate("g", prompt, max_new_tokens=8)
    with torch.no_grad():
        want = hf_llama.generate(
            torch.as_tensor(prompt)[None],
            max_new_tokens=8,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )[0, len(prompt) :].tolist()
    assert got == want
    c.free("g")
    # Stop tokens as transformers' generation_config gives them: a list (Llama 3's is).
    stop = [want[2], *(t for t in range(VOCAB) if t not in want)][:2]
    first = want.index(want[2])  # stops at the first stop token it produces
    assert c.generate("s", prompt, max_new_tokens=8, eos_token_id=stop) == want[: first + 1]
    c.free("s")


@pytest.mark.parametrize("cp", [1, 3], ids=lambda c: f"cp{c}", scope="module")
def test_a_greedy_prefill_answers_the_argmax_of_transformers_logits(make_client, hf_llama, cp):
    from cpkv import InvalidRequestError

    c = make_client(cp_size=cp, num_pages_per_lane=40, model=hf_llama)
    rng = np.random.default_rng(11 + cp)
    prompt = rng.integers(0, VOCAB, size=33)
    res = c.prefill("greedy", prompt, greedy=True)
    assert res.logits is None and res.next_token == int(np.argmax(hf_logits(hf_llama, prompt)))
    chunk = rng.integers(0, VOCAB, size=7)  # a later chunk: its last token is elsewhere
    res = c.prefill("greedy", chunk, greedy=True)
    whole = np.concatenate([prompt, chunk])
    assert res.next_token == int(np.argmax(hf_logits(hf_llama, whole)))
    plain = c.prefill("plain", prompt)
    assert plain.next_token is None and plain.logits is not None
    # A batch: each request's token from whichever lane computed its last token.
    batch = {f"b{i}": rng.integers(0, VOCAB, size=n) for i, n in enumerate((5, 19, 12))}
    got = c.prefill_batch(list(batch.items()), greedy=np.True_)  # a numpy bool as free's
    assert [r.next_token for r in got] == [
        int(np.argmax(hf_logits(hf_llama, toks))) for toks in batch.values()
    ]
    assert all(r.logits is None for r in got)
    for rid in batch:
        c.free(rid)
    for bad, match in (({"greedy": 1}, "greedy=1"), ({"greedy": True, "probe": ()}, "probe")):
        with pytest.raises(InvalidRequestError, match=match):
            c.prefill("bad", prompt, **bad)
        with pytest.raises(InvalidRequestError, match=match):
            c.prefill_batch([("bad", prompt)], **bad)
    assert c.stats()["num_requests"] == 2  # refused on the caller's side: nothing allocated
    c.free("greedy")
    c.free("plain")


def test_a_pool_without_a_model_refuses_prefill(make_client):
    from cpkv import InvalidRequestError

    c = make_client()
    with pytest.raises((InvalidRequestError, ValueError), match="model"):
        c.prefill("r", np.arange(10))
