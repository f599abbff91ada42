"""cpkv.models against Hugging Face transformers on tiny odd-sized random models (CPU, fp32).

Attention is the test's own: a fp32 softmax over keys selected by global position (causal, and
the sliding window when the config has one), over a contiguous per-layer KV cache or over the
keys of every token group, the way a context-parallel lane sees it.
"""

from __future__ import annotations

import dataclasses
import json
import pickle

import pytest
import torch

from cpkv.models import LlamaModel, ModelConfig, load_model
from cpkv.models.llama import rope_inv_freq
from cpkv.models.weights import parameter_shapes

transformers = pytest.importorskip("transformers")

TOL = 1e-3
SHAPE = dict(
    vocab_size=97,
    hidden_size=72,
    intermediate_size=100,
    num_hidden_layers=3,
    num_attention_heads=6,
    num_key_value_heads=2,
    head_dim=12,
    max_position_embeddings=512,
    rms_norm_eps=1e-5,
    # Wider than the 0.02 default so logits spread out (greedy decoding has no near-ties).
    initializer_range=0.15,
    bos_token_id=None,
    eos_token_id=None,
    pad_token_id=None,
)


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """Largest absolute difference relative to the reference's largest magnitude."""
    return float((out.float() - ref.float()).abs().max() / ref.float().abs().max())


def build_hf(kind: str, seed: int = 0, attn: str = "eager", **overrides):
    """A seeded transformers model with random (not unit) norms and random biases."""
    cls_config = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
        "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
    }[kind]
    kwargs = {**SHAPE, **overrides}
    config = cls_config[0](**kwargs, attn_implementation=attn)
    torch.manual_seed(seed)
    model = cls_config[1](config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
            elif name.endswith(".bias"):
                p.normal_(0.0, 0.1)
    return model


def hf_logits(hf, ids: torch.Tensor, offset: int = 0) -> torch.Tensor:
    """transformers' logits ``[T, vocab]`` for one sequence starting at position ``offset``."""
    with torch.no_grad():
        pos = torch.arange(offset, offset + ids.numel())[None]
        return hf(ids[None], position_ids=pos).logits[0].float()


def attention(q, q_pos, k, v, k_pos, scale, window=None):
    """fp32 attention of queries over keys by global position (causal, optional window)."""
    group = q.shape[1] // k.shape[1]
    k = k.float().repeat_interleave(group, dim=1)
    v = v.float().repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.float(), k) * scale
    visible = k_pos[None, :] <= q_pos[:, None]
    if window is not None:
        visible &= k_pos[None, :] > q_pos[:, None] - window
    scores = scores.masked_fill(~visible[None], float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


class ContiguousCache:
    """A per-layer KV cache of one sequence, appended to by each ``step``."""

    def __init__(self, model: LlamaModel) -> None:
        self.model = model
        n = model.config.num_layers
        self.k: list[torch.Tensor | None] = [None] * n
        self.v: list[torch.Tensor | None] = [None] * n
        self.pos = torch.empty(0, dtype=torch.int64)

    def step(self, ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Run ``ids`` at ``positions`` over cache + themselves; returns their logits."""
        m = self.model
        kpos = torch.cat([self.pos, positions])

        def attend(layer, q, k, v):
            if self.k[layer] is not None:
                k = torch.cat([self.k[layer], k])
                v = torch.cat([self.v[layer], v])
            self.k[layer], self.v[layer] = k, v
            return attention(q, positions, k, v, kpos, m.sm_scale, m.config.sliding_window)

        hidden = m.forward(ids, positions, attend)
        self.pos = kpos
        return m.logits(hidden)


def chunked_prefill(model: LlamaModel, ids: torch.Tensor, chunks: list[int], offset: int = 0):
    assert sum(chunks) == ids.numel()
    cache, out, start = ContiguousCache(model), [], 0
    for n in chunks:
        pos = torch.arange(offset + start, offset + start + n)
        out.append(cache.step(ids[start : start + n], pos))
        start += n
    return torch.cat(out), cache


def grouped_forward(model: LlamaModel, ids: torch.Tensor, groups: list[torch.Tensor]):
    """Each layer on every token group separately (own positions), attention global: the way
    CP lanes run a zigzag-split prefill. Returns logits in position order."""
    positions = torch.arange(ids.numel())
    hidden = [model.embed(ids[g]) for g in groups]
    for layer in range(model.config.num_layers):
        qkv = [
            model.attention_inputs(layer, h, positions[g])
            for h, g in zip(hidden, groups, strict=True)
        ]
        k_all = torch.cat([k for _, k, _ in qkv])
        v_all = torch.cat([v for _, _, v in qkv])
        k_pos = torch.cat([positions[g] for g in groups])
        hidden = [
            model.finish_layer(
                layer, h, attention(q, positions[g], k_all, v_all, k_pos, model.sm_scale)
            )
            for h, g, (q, _, _) in zip(hidden, groups, qkv, strict=True)
        ]
    logits = torch.empty(ids.numel(), model.config.vocab_size)
    for h, g in zip(hidden, groups, strict=True):
        logits[g] = model.logits(h)
    return logits


def zigzag_groups(num_tokens: int, cp: int) -> list[torch.Tensor]:
    """Split into 2*cp near-equal segments; group i gets segments i and 2*cp-1-i."""
    bounds = torch.linspace(0, num_tokens, 2 * cp + 1).round().long().tolist()
    seg = [torch.arange(bounds[i], bounds[i + 1]) for i in range(2 * cp)]
    return [torch.cat([seg[i], seg[2 * cp - 1 - i]]) for i in range(cp)]


@pytest.fixture(scope="module")
def llama():
    hf = build_hf("llama")
    return hf, LlamaModel.from_hf(hf)


@pytest.fixture(scope="module")
def prompt():
    return torch.randint(0, SHAPE["vocab_size"], (29,), generator=torch.Generator().manual_seed(7))


# ---------------------------------------------------------------- logits vs transformers


def test_config_and_weights_taken_from_hf(llama):
    hf, model = llama
    c = model.config
    assert (c.num_layers, c.num_heads, c.num_kv_heads, c.head_dim) == (3, 6, 2, 12)
    assert c.dtype == "float32" and model.dtype == torch.float32
    assert c.kv_shape == (3, 2, 12, "float32")
    assert model.sm_scale == pytest.approx(12**-0.5)
    ours, theirs = model.state_dict(), hf.state_dict()
    assert set(ours) == set(theirs)
    for name, t in ours.items():
        assert torch.equal(t, theirs[name]), name


def test_whole_prompt(llama, prompt):
    hf, model = llama
    ref = hf_logits(hf, prompt)
    out = model.logits(model.forward(prompt, torch.arange(prompt.numel()), _full_attend(model)))
    assert out.dtype == torch.float32 and out.shape == ref.shape
    assert rel_err(out, ref) < TOL


def _full_attend(model: LlamaModel, positions: torch.Tensor | None = None):
    def attend(layer, q, k, v):
        pos = torch.arange(q.shape[0]) if positions is None else positions
        return attention(q, pos, k, v, pos, model.sm_scale, model.config.sliding_window)

    return attend


def test_chunked_prefill_uneven_chunks(llama, prompt):
    hf, model = llama
    out, cache = chunked_prefill(model, prompt, [5, 1, 11, 7, 5])
    assert rel_err(out, hf_logits(hf, prompt)) < TOL
    assert cache.k[0].shape == (29, 2, 12)


def test_greedy_decode_matches_logits_and_generate(llama, prompt):
    hf, model = llama
    steps = 6
    ids = prompt[:13]
    logits, cache = chunked_prefill(model, ids, [8, 5])
    seq = ids.tolist()
    for _ in range(steps):
        nxt = int(logits[-1].argmax())
        seq.append(nxt)
        logits = cache.step(torch.tensor([nxt]), torch.tensor([len(seq) - 1]))
        ref = hf_logits(hf, torch.tensor(seq))[-1:]
        assert rel_err(logits, ref) < TOL
    seq.append(int(logits[-1].argmax()))
    with torch.no_grad():
        gen = hf.generate(
            ids[None], max_new_tokens=steps + 1, do_sample=False, attention_mask=None
        )[0]
    assert gen.tolist() == seq


@pytest.mark.parametrize("cp", [2, 4])
def test_zigzag_groups_match(llama, prompt, cp):
    hf, model = llama
    groups = zigzag_groups(prompt.numel(), cp)
    assert sorted(torch.cat(groups).tolist()) == list(range(prompt.numel()))
    assert rel_err(grouped_forward(model, prompt, groups), hf_logits(hf, prompt)) < TOL


def test_shuffled_groups_match(llama, prompt):
    hf, model = llama
    perm = torch.randperm(prompt.numel(), generator=torch.Generator().manual_seed(3))
    groups = [perm[:4], perm[4:17], perm[17:]]  # unsorted positions inside each group
    assert rel_err(grouped_forward(model, prompt, groups), hf_logits(hf, prompt)) < TOL


def test_empty_token_set(llama):
    _, model = llama
    empty = torch.empty(0, dtype=torch.int64)
    hidden = model.embed(empty)
    q, k, v = model.attention_inputs(0, hidden, empty)
    assert q.shape == (0, 6, 12) and k.shape == v.shape == (0, 2, 12)
    out = model.finish_layer(0, hidden, torch.zeros(0, 6, 12))
    assert model.logits(out).shape == (0, 97)


def test_rotary_cache_sees_in_place_changes(llama):
    _, model = llama
    pos = torch.arange(5)
    cos0, _ = model.rotary(pos)
    assert model.rotary(pos)[0] is cos0
    pos += 100
    cos1, _ = model.rotary(pos)
    assert torch.equal(cos1, model.rotary(torch.arange(100, 105))[0])
    assert not torch.equal(cos0, cos1)


def eager_bf16_attend(model: LlamaModel, positions: torch.Tensor):
    """transformers' eager attention step by step (bf16 matmuls, fp32 softmax, additive mask)."""

    def attend(layer, q, k, v):
        group = q.shape[1] // k.shape[1]
        qh = q.transpose(0, 1)[None]
        kh = k.repeat_interleave(group, 1).transpose(0, 1)[None]
        vh = v.repeat_interleave(group, 1).transpose(0, 1)[None]
        scores = torch.matmul(qh, kh.transpose(2, 3)) * model.sm_scale
        hidden = positions[None, :] > positions[:, None]
        mask = torch.zeros(hidden.shape, dtype=q.dtype).masked_fill(
            hidden, torch.finfo(q.dtype).min
        )
        probs = torch.softmax(scores + mask, dim=-1, dtype=torch.float32).to(q.dtype)
        return torch.matmul(probs, vh)[0].transpose(0, 1)

    return attend


def test_bf16_matches_transformers_from_pretrained(tmp_path, prompt):
    # from_pretrained(dtype=bf16) keeps RoPE inv_freq in fp32 (a .to(bf16) would round it).
    build_hf("llama", seed=4).save_pretrained(tmp_path, safe_serialization=True)
    hf = transformers.LlamaForCausalLM.from_pretrained(
        tmp_path, dtype=torch.bfloat16, attn_implementation="eager"
    ).eval()
    assert hf.model.rotary_emb.inv_freq.dtype == torch.float32
    model = LlamaModel.from_dir(tmp_path, dtype="bfloat16")
    assert model.dtype == torch.bfloat16 and model.config.dtype == "bfloat16"
    ref, pos = hf_logits(hf, prompt), torch.arange(prompt.numel())
    cos, sin = hf.model.rotary_emb(torch.zeros(1, dtype=torch.bfloat16), pos[None])
    assert torch.equal(model.rotary(pos)[0], cos[0]) and torch.equal(model.rotary(pos)[1], sin[0])
    # With their attention arithmetic the logits agree to bf16 rounding (bit-equal on x86).
    out = model.logits(model.forward(prompt, pos, eager_bf16_attend(model, pos)))
    assert out.dtype == torch.float32
    assert rel_err(out, ref) < 5e-3
    # fp32 attention (what a partial-attention merge hands back) is cast in; bf16 noise only.
    out32 = model.logits(model.forward(prompt, pos, _full_attend(model)))
    assert rel_err(out32, ref) < 6e-2


# ---------------------------------------------------------------- other families, RoPE


@pytest.mark.parametrize(
    ("kind", "overrides"),
    [
        ("qwen2", {}),
        ("mistral", {"sliding_window": None}),
        ("mistral", {"sliding_window": 7}),
        ("llama", {"attention_bias": True, "mlp_bias": True, "tie_word_embeddings": True}),
    ],
    ids=["qwen2", "mistral", "mistral-window7", "llama-biases-tied"],
)
def test_other_families(prompt, kind, overrides):
    hf = build_hf(kind, seed=1, **overrides)
    model = LlamaModel.from_hf(hf)
    c = model.config
    if kind == "qwen2":
        assert (c.attention_bias, c.o_proj_bias, c.mlp_bias) == (True, False, False)
    if kind == "mistral":
        assert c.sliding_window == overrides["sliding_window"]
    ref = hf_logits(hf, prompt)
    whole = model.logits(model.forward(prompt, torch.arange(prompt.numel()), _full_attend(model)))
    assert rel_err(whole, ref) < TOL
    chunked, _ = chunked_prefill(model, prompt, [9, 3, 17])
    assert rel_err(chunked, ref) < TOL


@pytest.mark.parametrize(
    "rope",
    [
        {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
        {"rope_type": "linear", "factor": 3.0},
    ],
    ids=["llama3", "linear"],
)
def test_scaled_rope(prompt, rope):
    hf = build_hf("llama", seed=2, rope_parameters={**rope, "rope_theta": 5000.0})
    model = LlamaModel.from_hf(hf)
    assert model.config.rope_type == rope["rope_type"]
    assert model.config.rope_theta == 5000.0
    # Bit-identical frequencies (llama3 with original 64: head_dim 12 gives wavelengths in all
    # three bands: kept, smoothed, divided).
    assert torch.equal(rope_inv_freq(model.config), hf.model.rotary_emb.inv_freq)
    offset = 300  # far positions, where the scaling matters
    ref = hf_logits(hf, prompt, offset)
    out, _ = chunked_prefill(model, prompt, [13, 16], offset=offset)
    assert rel_err(out, ref) < TOL


def test_llama_3_2_1b_preset_equals_its_config_json():
    # Llama-3.2-1B's config.json (the legacy rope_scaling + rope_theta layout).
    config_json = {
        "architectures": ["LlamaForCausalLM"],
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": 128000,
        "eos_token_id": 128001,
        "head_dim": 64,
        "hidden_act": "silu",
        "hidden_size": 2048,
        "initializer_range": 0.02,
        "intermediate_size": 8192,
        "max_position_embeddings": 131072,
        "mlp_bias": False,
        "model_type": "llama",
        "num_attention_heads": 32,
        "num_hidden_layers": 16,
        "num_key_value_heads": 8,
        "pretraining_tp": 1,
        "rms_norm_eps": 1e-05,
        "rope_scaling": {
            "factor": 32.0,
            "high_freq_factor": 4.0,
            "low_freq_factor": 1.0,
            "original_max_position_embeddings": 8192,
            "rope_type": "llama3",
        },
        "rope_theta": 500000.0,
        "tie_word_embeddings": True,
        "torch_dtype": "bfloat16",
        "use_cache": True,
        "vocab_size": 128256,
    }
    preset = ModelConfig.llama_3_2_1b()
    assert ModelConfig.from_hf(config_json) == preset
    hf_config = transformers.LlamaConfig(**config_json)
    assert ModelConfig.from_hf(hf_config) == preset
    assert preset.kv_shape == (16, 8, 64, "bfloat16")
    rotary = transformers.models.llama.modeling_llama.LlamaRotaryEmbedding(hf_config)
    assert torch.equal(rope_inv_freq(preset), rotary.inv_freq)
    assert hash(preset) == hash(ModelConfig.llama_3_2_1b())
    assert pickle.loads(pickle.dumps(preset)) == preset  # travels to Ray actors


# ---------------------------------------------------------------- checkpoints


@pytest.mark.parametrize("shard", [None, "20KB"], ids=["single", "sharded"])
def test_from_dir_equals_from_hf(tmp_path, prompt, shard):
    hf = build_hf("llama", seed=5, tie_word_embeddings=True)
    kwargs = {"max_shard_size": shard} if shard else {}
    hf.save_pretrained(tmp_path, safe_serialization=True, **kwargs)
    shards = sorted(p.name for p in tmp_path.glob("*.safetensors"))
    assert (len(shards) > 1) == (shard is not None)
    from_hf, from_dir = LlamaModel.from_hf(hf), LlamaModel.from_dir(tmp_path)
    assert from_dir.config == from_hf.config
    a, b = from_hf.state_dict(), from_dir.state_dict()
    assert set(a) == set(b) and "lm_head.weight" not in b
    assert all(torch.equal(a[n], b[n]) for n in a)
    pos = torch.arange(prompt.numel())
    out = from_dir.logits(from_dir.forward(prompt, pos, _full_attend(from_dir)))
    assert torch.equal(out, from_hf.logits(from_hf.forward(prompt, pos, _full_attend(from_hf))))
    assert rel_err(out, hf_logits(hf, prompt)) < TOL

    half = LlamaModel.from_dir(tmp_path, dtype="bfloat16")
    assert half.dtype == torch.bfloat16 and half.config.dtype == "bfloat16"
    assert load_model(str(tmp_path)).config == from_dir.config
    assert load_model(hf).config == from_hf.config
    assert load_model(from_dir) is from_dir
    assert load_model(from_dir, dtype=torch.float16).dtype == torch.float16


def test_a_legacy_rope_scaling_beside_rope_parameters_wins_as_in_transformers(tmp_path, prompt):
    """transformers 5 writes rope_parameters; a rope_scaling block added to that config (the
    old way to stretch the context) replaces it on load: read the same, or the logits differ."""
    build_hf("llama", seed=3).save_pretrained(tmp_path, safe_serialization=True)
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert "rope_parameters" in cfg
    cfg["rope_scaling"] = {"rope_type": "linear", "factor": 4.0}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    hf = transformers.LlamaForCausalLM.from_pretrained(tmp_path, attn_implementation="eager")
    model = LlamaModel.from_dir(tmp_path)
    assert model.config.rope_scaling == {"rope_type": "linear", "factor": 4.0}
    pos = torch.arange(200, 200 + prompt.numel())  # far enough for the scaling to show
    out = model.logits(model.forward(prompt, pos, _full_attend(model)))
    assert rel_err(out, hf_logits(hf.eval(), prompt, 200)) < TOL


@pytest.mark.parametrize(
    "biases",
    [
        {},
        {"attention_bias": True, "o_proj_bias": True, "mlp_bias": True},
        {"attention_bias": True, "o_proj_bias": False},  # Qwen2's
        {"mlp_bias": True},
    ],
    ids=["none", "all", "qkv-only", "mlp-only"],
)
def test_a_model_handed_to_connect_loads_back_on_the_lanes(biases, prompt):
    from cpkv.models.spec import ModelSpec

    model = LlamaModel.random(ModelConfig.tiny(**biases), seed=0)
    spec = ModelSpec.from_source(model)  # what connect() does; every lane then loads it
    try:
        loaded = spec.load("cpu")
        assert loaded.config == model.config
        pos = torch.arange(prompt.numel())
        want = model.logits(model.forward(prompt, pos, _full_attend(model)))
        assert torch.equal(loaded.logits(loaded.forward(prompt, pos, _full_attend(loaded))), want)
    finally:
        spec.remove()


@pytest.mark.parametrize(
    "biases",
    [
        {"attention_bias": True, "o_proj_bias": False, "mlp_bias": True},
        {"attention_bias": False, "o_proj_bias": True},
    ],
    ids=["qkv-and-mlp", "o-proj-only"],
)
def test_biases_no_config_json_can_say_are_refused_before_the_lanes_start(biases, tmp_path):
    import tempfile

    from cpkv.models.spec import ModelSpec

    model = LlamaModel.random(ModelConfig.tiny(**biases), seed=0)
    tempfile.tempdir = str(tmp_path)  # the checkpoint it began: removed again
    try:
        with pytest.raises(ValueError, match="biases"):
            ModelSpec.from_source(model)
    finally:
        tempfile.tempdir = None
    assert list(tmp_path.iterdir()) == []


def test_a_base_model_without_its_lm_head_is_refused_by_type():
    base = transformers.LlamaModel(transformers.LlamaConfig(**SHAPE))
    with pytest.raises(TypeError, match="ForCausalLM"):
        load_model(base)


def test_from_dir_missing_weights(tmp_path):
    hf = build_hf("llama", seed=5)
    hf.save_pretrained(tmp_path, safe_serialization=True)
    (tmp_path / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError):
        LlamaModel.from_dir(tmp_path)
    with pytest.raises(TypeError):
        load_model(42)


# ---------------------------------------------------------------- validation, random


@pytest.mark.parametrize(
    ("overrides", "named"),
    [
        ({"hidden_size": 0}, "hidden_size"),
        ({"num_layers": 2.5}, "num_layers"),
        ({"vocab_size": True}, "vocab_size"),
        ({"num_heads": 6, "num_kv_heads": 4}, "num_kv_heads"),
        ({"head_dim": 11}, "head_dim"),
        ({"rms_norm_eps": 0.0}, "rms_norm_eps"),
        ({"rope_theta": float("nan")}, "rope_theta"),
        ({"dtype": "float64"}, "dtype"),
        ({"tie_word_embeddings": 1}, "tie_word_embeddings"),
        ({"sliding_window": 0}, "sliding_window"),
        ({"rope_scaling": {"rope_type": "yarn", "factor": 2.0}}, "yarn"),
        ({"rope_scaling": {"rope_type": "linear"}}, "factor"),
        ({"rope_scaling": {"rope_type": "linear", "factor": -2.0}}, "factor"),
        ({"rope_scaling": {"rope_type": "linear", "factor": 2.0, "beta": 1}}, "beta"),
        ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, "low_freq_factor"),
        (
            {
                "rope_scaling": {
                    "rope_type": "llama3",
                    "factor": 8.0,
                    "low_freq_factor": 4.0,
                    "high_freq_factor": 1.0,
                }
            },
            "high_freq_factor",
        ),
        ({"rope_scaling": "llama3"}, "rope_scaling"),
    ],
)
def test_bad_config_raises(overrides, named):
    with pytest.raises(ValueError, match=named):
        ModelConfig.tiny(**overrides)


def test_config_normalisation_and_from_hf_refusals():
    c = ModelConfig.tiny(rope_scaling={"type": "default"})
    assert c.rope_scaling is None and c.rope_type == "default"
    c = ModelConfig.tiny(
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8,
            "low_freq_factor": 1,
            "high_freq_factor": 4,
        }
    )
    assert c.rope_scaling["original_max_position_embeddings"] == c.max_position_embeddings
    assert ModelConfig.tiny(attention_bias=True).o_proj_bias is True
    with pytest.raises(dataclasses.FrozenInstanceError):
        c.hidden_size = 8  # type: ignore[misc]
    with pytest.raises(ValueError, match="model_type"):
        ModelConfig.from_hf(transformers.GPT2Config())
    with pytest.raises(ValueError, match="model_type"):
        ModelConfig.from_hf({"model_type": "gemma"})
    base = {"model_type": "llama", **{k: v for k, v in SHAPE.items() if v is not None}}
    with pytest.raises(ValueError, match="hidden_act"):
        ModelConfig.from_hf({**base, "hidden_act": "gelu"})
    with pytest.raises(ValueError, match="intermediate_size"):
        ModelConfig.from_hf({k: v for k, v in base.items() if k != "intermediate_size"})
    with pytest.raises(ValueError, match="yarn"):
        ModelConfig.from_hf({**base, "rope_scaling": {"rope_type": "yarn", "factor": 2.0}})
    qwen_mixed = {**base, "model_type": "qwen2", "use_sliding_window": True}
    with pytest.raises(ValueError, match="sliding window"):
        ModelConfig.from_hf({**qwen_mixed, "max_window_layers": 1})
    assert ModelConfig.from_hf({**qwen_mixed, "max_window_layers": 0}).sliding_window == 4096
    assert ModelConfig.from_hf({**qwen_mixed, "max_window_layers": 28}).sliding_window is None


def test_a_tied_config_with_another_stored_lm_head_keeps_it_as_transformers_does(tmp_path, prompt):
    """A config that ties the embeddings beside an lm_head.weight of other values: transformers
    keeps the stored head (and warns); taking the embeddings instead gave other logits."""
    from safetensors.torch import load_file, save_file

    hf = build_hf("llama", seed=7, tie_word_embeddings=False)
    hf.save_pretrained(tmp_path, safe_serialization=True)
    cfg = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**cfg, "tie_word_embeddings": True}))
    weights = load_file(tmp_path / "model.safetensors")
    assert not torch.equal(weights["lm_head.weight"], weights["model.embed_tokens.weight"])
    save_file(weights, tmp_path / "model.safetensors", metadata={"format": "pt"})
    model = LlamaModel.from_dir(tmp_path)
    assert model.config.tie_word_embeddings is False
    pos = torch.arange(prompt.numel())
    out = model.logits(model.forward(prompt, pos, _full_attend(model)))
    assert rel_err(out, hf_logits(hf, prompt)) < TOL
    # The same values stored twice are a tie indeed.
    weights["lm_head.weight"] = weights["model.embed_tokens.weight"].clone()
    save_file(weights, tmp_path / "model.safetensors", metadata={"format": "pt"})
    assert LlamaModel.from_dir(tmp_path).config.tie_word_embeddings is True


def test_config_fields_read_as_transformers_reads_them():
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    base = {"model_type": "llama", **{k: v for k, v in SHAPE.items() if v is not None}}
    # A top-level original_max_position_embeddings (Phi-3-style converters) overrides the
    # llama3 block's, as transformers' standardize_rope_params has it.
    llama3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0}
    llama3 |= {"high_freq_factor": 4.0, "original_max_position_embeddings": 16}
    d = {**base, "rope_theta": 500.0, "original_max_position_embeddings": 8}
    d["rope_scaling"] = llama3
    ours = ModelConfig.from_hf(d)
    assert ours.rope_scaling["original_max_position_embeddings"] == 8
    theirs = transformers.LlamaConfig(**{k: v for k, v in d.items() if k != "model_type"})
    want, _ = ROPE_INIT_FUNCTIONS["llama3"](theirs, "cpu")
    assert torch.equal(rope_inv_freq(ours), want)
    # Qwen2 asking for a sliding window but giving none: every layer is full attention.
    qwen = {**base, "model_type": "qwen2", "use_sliding_window": True, "sliding_window": None}
    assert ModelConfig.from_hf({**qwen, "max_window_layers": 1}).sliding_window is None
    # A 0 (or any value ModelConfig refuses) is refused, not replaced by a default.
    for key, named in [
        ("rope_theta", "rope_theta"),
        ("max_position_embeddings", "max_position_embeddings"),
        ("num_key_value_heads", "num_kv_heads"),
    ]:
        with pytest.raises(ValueError, match=named):
            ModelConfig.from_hf({**base, key: 0})
    # A JSON null is "not given" still.
    assert ModelConfig.from_hf({**base, "num_key_value_heads": None}).num_kv_heads == 6


def test_a_checkpoint_dir_reads_model_safetensors_before_other_files_and_refuses_bad_indexes(
    tmp_path,
):
    from safetensors.torch import save_file

    from cpkv.models.weights import read_safetensors_dir

    save_file({"a": torch.ones(2)}, tmp_path / "model.safetensors")
    save_file({"b": torch.ones(2)}, tmp_path / "consolidated.safetensors")  # another format's
    assert set(read_safetensors_dir(tmp_path)) == {"a"}
    (tmp_path / "model.safetensors").unlink()
    assert set(read_safetensors_dir(tmp_path)) == {"b"}
    index = tmp_path / "model.safetensors.index.json"
    for text, match in [
        ("[]", "no weight_map"),
        ('{"weight_map": {"b": null}}', "not file names"),
    ]:
        index.write_text(text)
        with pytest.raises(ValueError, match=match):
            read_safetensors_dir(tmp_path)


def test_a_model_the_spec_refuses_leaves_no_checkpoint_directory(tmp_path, monkeypatch):
    import tempfile

    from cpkv.models.spec import ModelSpec

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    windowed = LlamaModel.random(ModelConfig.tiny(sliding_window=8), seed=0)
    with pytest.raises(ValueError, match="sliding"):
        ModelSpec.from_source(windowed)
    assert list(tmp_path.iterdir()) == []


def test_from_dir_config_json(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "mistral", **SHAPE}))
    c = ModelConfig.from_dir(tmp_path)
    assert c.sliding_window == 4096 and c.dtype == "float32" and c.num_kv_heads == 2


def test_bad_weights_raise():
    config = ModelConfig.tiny()
    weights = LlamaModel.random(config, seed=0).state_dict()
    missing = {k: v for k, v in weights.items() if k != "model.layers.1.mlp.up_proj.weight"}
    with pytest.raises(ValueError, match=r"missing \['model.layers.1.mlp.up_proj.weight'\]"):
        LlamaModel(config, missing)
    with pytest.raises(ValueError, match="unexpected"):
        LlamaModel(
            config, {**weights, "model.layers.9.mlp.up_proj.weight": weights["lm_head.weight"]}
        )
    with pytest.raises(ValueError, match="wrong shapes"):
        LlamaModel(config, {**weights, "model.norm.weight": torch.ones(71)})
    model = LlamaModel(config, weights)
    with pytest.raises(ValueError, match="layer"):
        model.attention_inputs(3, torch.zeros(2, 72), torch.arange(2))
    with pytest.raises(ValueError, match="positions"):
        model.attention_inputs(0, torch.zeros(2, 72), torch.arange(3))
    with pytest.raises(ValueError, match="attn"):
        model.finish_layer(0, torch.zeros(2, 72), torch.zeros(2, 2, 12))


def test_random_is_deterministic_per_seed():
    config = ModelConfig.tiny(attention_bias=True, mlp_bias=True, tie_word_embeddings=True)
    a = LlamaModel.random(config, seed=11).state_dict()
    b = LlamaModel.random(config, seed=11).state_dict()
    c = LlamaModel.random(config, seed=12).state_dict()
    assert set(a) == set(parameter_shapes(config))
    assert all(torch.equal(a[n], b[n]) for n in a)
    assert not torch.equal(
        a["model.layers.0.self_attn.q_proj.weight"], c["model.layers.0.self_attn.q_proj.weight"]
    )
    std = float(a["model.layers.0.mlp.gate_proj.weight"].std())
    assert 0.015 < std < 0.025
    assert torch.equal(a["model.norm.weight"], torch.ones(72))
    half = LlamaModel.random(config.replace(dtype="bfloat16"), seed=11)
    assert torch.equal(
        half.state_dict()["model.embed_tokens.weight"], a["model.embed_tokens.weight"].bfloat16()
    )


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_bf16_on_cuda_with_the_fused_kernels_matches_transformers(tmp_path, prompt, monkeypatch):
    """On CUDA the model normalises and rotates with its fused kernels: with the same SDPA
    attention, its logits equal transformers' to bf16 noise, and its own unfused path's."""
    import torch.nn.functional as F

    from cpkv.models import llama as llama_mod

    build_hf("llama", seed=4).save_pretrained(tmp_path, safe_serialization=True)
    hf = transformers.LlamaForCausalLM.from_pretrained(
        tmp_path, dtype=torch.bfloat16, attn_implementation="sdpa"
    )
    hf = hf.to("cuda").eval()
    model = LlamaModel.from_dir(tmp_path, dtype="bfloat16", device="cuda")
    ids, pos = prompt.cuda(), torch.arange(prompt.numel(), device="cuda")

    def sdpa(layer, q, k, v):
        qh, kh, vh = (x.transpose(0, 1)[None] for x in (q, k, v))
        o = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, enable_gqa=True)
        return o[0].transpose(0, 1)

    with torch.no_grad():
        ref = hf(ids[None]).logits[0].float()
    fused = model.logits(model.forward(ids, pos, sdpa))
    # bf16 noise through the layers (0.024 measured on the H200; the unfused path's own error
    # against transformers is of the same size): the bound of the fp32-attention case above.
    assert rel_err(fused, ref) < 6e-2
    monkeypatch.setattr(llama_mod, "_fused", lambda x: False)
    model.forget_rotary()
    unfused = model.logits(model.forward(ids, pos, sdpa))
    assert rel_err(fused, unfused) < 6e-2
