"""A Llama-family causal LM in plain torch ops, cut at attention so a context-parallel lane can
run each layer on any subset of token positions.

One layer is ``attention_inputs`` (RMSNorm, q/k/v projections, RoPE at given global positions)
-> attention done by the caller over whatever keys it holds -> ``finish_layer`` (o_proj,
residual, RMSNorm, SwiGLU, residual). Every step but attention is per token, so tokens may be
split across lanes in any grouping (zigzag ranges, cached prefixes) and the layer outputs equal
those of a whole-sequence forward.

Numerics follow transformers' ``LlamaForCausalLM`` (and Qwen2 / Mistral, which differ only in
biases and sliding windows): RMSNorm in fp32 then cast back before the weight product, RoPE
``inv_freq`` computed as transformers computes it for the default / linear / llama3 types, cos
and sin from fp32 frequencies cast to the model dtype, ``rotate_half`` convention, residual
stream and logits in the model dtype (returned as fp32).
"""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from cpkv import kernels
from cpkv.kernels import naive
from cpkv.models.config import ModelConfig
from cpkv.models.weights import (
    IGNORED_SUFFIXES,
    parameter_shapes,
    random_weights,
    read_safetensors_dir,
    torch_dtype,
)

logger = logging.getLogger("cpkv.models")

__all__ = ["AttendFn", "LlamaModel", "rope_inv_freq", "rotate_half"]

#: ``attend(layer, q [T, Hq, D], k [T, Hkv, D], v [T, Hkv, D]) -> attn [T, Hq, D]``.
AttendFn = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def rope_inv_freq(config: ModelConfig) -> torch.Tensor:
    """RoPE inverse frequencies, computed on the CPU in fp32 exactly as transformers does.

    Args:
        config: the architecture (``head_dim``, ``rope_theta``, ``rope_scaling``).

    Returns:
        fp32 CPU ``[head_dim // 2]``.

    NOTE: transformers computes these on the device its rotary module is built on; built under
    a CUDA device context they differ from the CPU values by an ulp, while ``from_pretrained``
    (also with a CUDA ``device_map``) gives the CPU values, bit-equal to these.
    """
    dim, base = config.head_dim, config.rope_theta
    # NOTE: same expression, dtype and device as transformers' rope init functions (fp32 on
    # the CPU), so the frequencies are bit-identical to theirs.
    inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).to(torch.float) / dim))
    scaling = config.rope_scaling
    if scaling is None:
        return inv_freq
    if scaling["rope_type"] == "linear":
        return inv_freq / scaling["factor"]
    # llama3 (transformers' _compute_llama3_parameters).
    factor = scaling["factor"]
    low_freq_factor = scaling["low_freq_factor"]
    high_freq_factor = scaling["high_freq_factor"]
    old_context_len = scaling["original_max_position_embeddings"]
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    inv_freq_llama = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth_factor = (old_context_len / wavelen - low_freq_factor) / (
        high_freq_factor - low_freq_factor
    )
    smoothed_inv_freq = (
        1 - smooth_factor
    ) * inv_freq_llama / factor + smooth_factor * inv_freq_llama
    is_medium_freq = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium_freq, smoothed_inv_freq, inv_freq_llama)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """``[x1, x2] -> [-x2, x1]`` over the last dim (the Llama / GPT-NeoX RoPE pairing).

    Args:
        x: ``[..., D]`` with even ``D``.

    Returns:
        ``[..., D]``.
    """
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _fused(x: torch.Tensor) -> bool:
    """Whether the fused Triton kernels run this tensor's ops: on CUDA (one kernel where
    torch launches ~7 or ~11, which is what a decode step pays per kernel). CPU tensors keep
    torch's ops even under ``TRITON_INTERPRET=1``."""
    return x.is_cuda and kernels.HAS_TRITON


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # NOTE: transformers' LlamaRMSNorm: normalise in fp32, cast back, then scale in the
    # model dtype (not scale-then-cast); the torch formula is the kernel's reference.
    return (kernels.rms_norm if _fused(x) else naive.rms_norm)(x, weight, eps)


@dataclass(slots=True)
class _Layer:
    """One decoder layer's weights on the model device; q/k/v and gate/up fused by rows."""

    input_norm: torch.Tensor  # [hidden]
    qkv_weight: torch.Tensor  # [(Hq + 2 Hkv) D, hidden]
    qkv_bias: torch.Tensor | None  # [(Hq + 2 Hkv) D]
    o_weight: torch.Tensor  # [hidden, Hq D]
    o_bias: torch.Tensor | None  # [hidden]
    post_norm: torch.Tensor  # [hidden]
    gate_up_weight: torch.Tensor  # [2 I, hidden]
    gate_up_bias: torch.Tensor | None  # [2 I]
    down_weight: torch.Tensor  # [hidden, I]
    down_bias: torch.Tensor | None  # [hidden]


def _cat_or_none(parts: list[torch.Tensor | None]) -> torch.Tensor | None:
    if parts[0] is None:
        return None
    return torch.cat([p for p in parts if p is not None], dim=0)


def _tie_as_stored(config: ModelConfig, weights: Mapping[str, torch.Tensor]) -> ModelConfig:
    """``config`` untied when it ties the embeddings but the weights hold an ``lm_head`` of
    other values (transformers then keeps the stored head, with a warning)."""
    head, embed = weights.get("lm_head.weight"), weights.get("model.embed_tokens.weight")
    if not config.tie_word_embeddings or head is None or embed is None:
        return config
    if head.shape == embed.shape and torch.equal(head.to(embed.device, embed.dtype), embed):
        return config
    logger.warning(
        "the config ties the embeddings but lm_head.weight differs from them: using the "
        "stored lm_head (tie_word_embeddings=False), as transformers does"
    )
    return config.replace(tie_word_embeddings=False)


class LlamaModel:
    """Llama / Qwen2 / Mistral causal LM weights with per-layer entry points for CP lanes.

    All methods take and return tensors on :attr:`device`; token axes are flat ``[T, ...]``
    (no batch dim: concatenate sequences, attention keeps them apart). Nothing here records
    autograd state (weights do not require grad).

    Args:
        config: the architecture; ``config.dtype`` is the dtype weights are cast to.
        weights: ``{Hugging Face name: tensor}`` as a ``*ForCausalLM.state_dict()`` holds them
            (``lm_head.weight`` may be absent when embeddings are tied; one that differs
            from the embeddings unties them, as transformers does, and :attr:`config` says
            so; ``*rotary_emb.inv_freq`` buffers are ignored). Any device / floating dtype.
        device: where the weights live and the computation runs.

    Raises:
        ValueError: missing, unexpected or wrongly shaped weights (all of them named).
    """

    __slots__ = (
        "_config",
        "_device",
        "_dtype",
        "_embed",
        "_inv_freq",
        "_layers",
        "_lm_head",
        "_norm",
        "_rope_cache",
    )

    def __init__(
        self,
        config: ModelConfig,
        weights: Mapping[str, torch.Tensor],
        device: str | torch.device = "cpu",
    ) -> None:
        config = _tie_as_stored(config, weights)
        self._config = config
        self._device = torch.device(device)
        self._dtype = torch_dtype(config.dtype)
        expected = parameter_shapes(config)
        problems: list[str] = []
        missing = [n for n in expected if n not in weights]
        if missing:
            problems.append(f"missing {missing}")
        allowed_extra = {"lm_head.weight"} if config.tie_word_embeddings else set()
        unexpected = [
            n
            for n in weights
            if n not in expected and n not in allowed_extra and not n.endswith(IGNORED_SUFFIXES)
        ]
        if unexpected:
            problems.append(f"unexpected {unexpected}")
        bad_shape = [
            f"{n}: {tuple(weights[n].shape)} != {shape}"
            for n, shape in expected.items()
            if n in weights and tuple(weights[n].shape) != shape
        ]
        if bad_shape:
            problems.append(f"wrong shapes {bad_shape}")
        not_float = [n for n in expected if n in weights and not weights[n].is_floating_point()]
        if not_float:
            problems.append(f"not floating point {not_float}")
        if problems:
            raise ValueError("weights do not match the config: " + "; ".join(problems))

        def get(name: str) -> torch.Tensor:
            return weights[name].detach().to(device=self._device, dtype=self._dtype)

        def opt(name: str) -> torch.Tensor | None:
            return get(name) if name in expected else None

        self._embed = get("model.embed_tokens.weight")
        self._layers: list[_Layer] = []
        for i in range(config.num_layers):
            a, m = f"model.layers.{i}.self_attn.", f"model.layers.{i}.mlp."
            self._layers.append(
                _Layer(
                    input_norm=get(f"model.layers.{i}.input_layernorm.weight"),
                    qkv_weight=torch.cat([get(a + f"{p}_proj.weight") for p in "qkv"], dim=0),
                    qkv_bias=_cat_or_none([opt(a + f"{p}_proj.bias") for p in "qkv"]),
                    o_weight=get(a + "o_proj.weight"),
                    o_bias=opt(a + "o_proj.bias"),
                    post_norm=get(f"model.layers.{i}.post_attention_layernorm.weight"),
                    gate_up_weight=torch.cat(
                        [get(m + "gate_proj.weight"), get(m + "up_proj.weight")], dim=0
                    ),
                    gate_up_bias=_cat_or_none([opt(m + "gate_proj.bias"), opt(m + "up_proj.bias")]),
                    down_weight=get(m + "down_proj.weight"),
                    down_bias=opt(m + "down_proj.bias"),
                )
            )
        self._norm = get("model.norm.weight")
        # NOTE: tied embeddings share one tensor; lm_head is never a separate copy then.
        self._lm_head = self._embed if config.tie_word_embeddings else get("lm_head.weight")
        self._inv_freq = rope_inv_freq(config).to(self._device)
        # (positions tensor, its _version, cos, sin) of the last rotary() call.
        self._rope_cache: tuple[torch.Tensor, int, torch.Tensor, torch.Tensor] | None = None

    # ---------------------------------------------------------------- constructors

    @classmethod
    def from_hf(
        cls,
        model: Any,
        device: str | torch.device | None = None,
        dtype: str | torch.dtype | None = None,
    ) -> LlamaModel:
        """Take a transformers ``LlamaForCausalLM`` / ``Qwen2ForCausalLM`` /
        ``MistralForCausalLM`` instance's config and weights.

        Args:
            model: the instance (anything with ``.config`` and ``.state_dict()``).
            device: where to run; ``None``: where the instance's embeddings are.
            dtype: the dtype to run in; ``None``: the instance's embedding dtype.

        Returns:
            The model. NOTE: weights already on ``device`` in ``dtype`` (norms, embeddings) are
            shared with the instance, not copied.

        Raises:
            TypeError: not a ``*ForCausalLM`` (a base model's weights lack the ``model.``
                prefix and its LM head).
            ValueError: an unsupported config or dtype, or weights that do not match it.
        """
        config = ModelConfig.from_hf(model.config)
        state = model.state_dict()
        embed = state.get("model.embed_tokens.weight")
        if embed is None:
            raise TypeError(
                f"model={type(model).__name__}: expected a *ForCausalLM (its weights named "
                "model.embed_tokens.weight, ...), not a base model without its LM head"
            )
        target = torch_dtype(dtype if dtype is not None else embed.dtype)
        config = config.replace(dtype=str(target).removeprefix("torch."))
        return cls(config, state, embed.device if device is None else device)

    @classmethod
    def from_dir(
        cls,
        path: str | os.PathLike[str],
        device: str | torch.device = "cpu",
        dtype: str | torch.dtype | None = None,
    ) -> LlamaModel:
        """Load a Hugging Face checkpoint directory: ``config.json`` plus one or several
        ``*.safetensors`` (an indexed shard set when ``model.safetensors.index.json`` exists).

        Args:
            path: the directory.
            device: where to run.
            dtype: the dtype to run in; ``None``: the config's ``dtype`` / ``torch_dtype``
                (float32 when it names none).

        Returns:
            The model.

        Raises:
            FileNotFoundError: no config.json or no weights.
            ValueError: an unsupported config, or weights that do not match it.
        """
        config = ModelConfig.from_dir(path)
        if dtype is not None:
            config = config.replace(dtype=str(torch_dtype(dtype)).removeprefix("torch."))
        weights = read_safetensors_dir(path, dtype=config.dtype)
        return cls(config, weights, device)

    @classmethod
    def random(
        cls, config: ModelConfig, seed: int = 0, device: str | torch.device = "cpu"
    ) -> LlamaModel:
        """Random weights from ``seed`` (drawn on the CPU in fp32, N(0, 0.02^2) matrices,
        embeddings and biases, unit norms), then cast to ``config.dtype`` and moved.

        Args:
            config: the architecture.
            seed: the generator seed; equal seeds give equal weights on every device.
            device: where to run.

        Returns:
            The model.
        """
        return cls(config, random_weights(config, seed, dtype=config.dtype), device)

    def to(
        self, device: str | torch.device | None = None, dtype: str | torch.dtype | None = None
    ) -> LlamaModel:
        """This model on another device and/or dtype (``self`` when nothing changes).

        Args:
            device: the target device; ``None`` keeps the current one.
            dtype: the target dtype; ``None`` keeps the current one.

        Returns:
            A model (weights copied only where they change).
        """
        new_device = self._device if device is None else torch.device(device)
        new_dtype = self._dtype if dtype is None else torch_dtype(dtype)
        if new_device == self._device and new_dtype == self._dtype:
            return self
        config = self._config.replace(dtype=str(new_dtype).removeprefix("torch."))
        return LlamaModel(config, self.state_dict(), new_device)

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The weights under their Hugging Face names (views into the fused tensors).

        Returns:
            ``{name: tensor}`` with exactly the names :func:`parameter_shapes` lists.
        """
        c = self._config
        q_out, kv_out = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
        out: dict[str, torch.Tensor] = {"model.embed_tokens.weight": self._embed}
        for i, layer in enumerate(self._layers):
            p = f"model.layers.{i}."
            out[p + "input_layernorm.weight"] = layer.input_norm
            qkv = layer.qkv_weight.split([q_out, kv_out, kv_out], dim=0)
            qkv_b = None
            if layer.qkv_bias is not None:
                qkv_b = layer.qkv_bias.split([q_out, kv_out, kv_out])
            for j, name in enumerate("qkv"):
                out[f"{p}self_attn.{name}_proj.weight"] = qkv[j]
                if qkv_b is not None:
                    out[f"{p}self_attn.{name}_proj.bias"] = qkv_b[j]
            out[p + "self_attn.o_proj.weight"] = layer.o_weight
            if layer.o_bias is not None:
                out[p + "self_attn.o_proj.bias"] = layer.o_bias
            out[p + "post_attention_layernorm.weight"] = layer.post_norm
            gate, up = layer.gate_up_weight.chunk(2, dim=0)
            out[p + "mlp.gate_proj.weight"], out[p + "mlp.up_proj.weight"] = gate, up
            if layer.gate_up_bias is not None:
                gate_b, up_b = layer.gate_up_bias.chunk(2, dim=0)
                out[p + "mlp.gate_proj.bias"], out[p + "mlp.up_proj.bias"] = gate_b, up_b
            out[p + "mlp.down_proj.weight"] = layer.down_weight
            if layer.down_bias is not None:
                out[p + "mlp.down_proj.bias"] = layer.down_bias
        out["model.norm.weight"] = self._norm
        if not c.tie_word_embeddings:
            out["lm_head.weight"] = self._lm_head
        return out

    # ---------------------------------------------------------------- properties

    @property
    def config(self) -> ModelConfig:
        """The architecture (its ``dtype`` is the dtype the weights are in)."""
        return self._config

    @property
    def device(self) -> torch.device:
        """Where the weights live."""
        return self._device

    @property
    def dtype(self) -> torch.dtype:
        """The weight / activation dtype."""
        return self._dtype

    @property
    def sm_scale(self) -> float:
        """The attention softmax scale, ``head_dim ** -0.5``."""
        return self._config.head_dim**-0.5

    def __repr__(self) -> str:
        return f"LlamaModel({self._config!r}, device={self._device})"

    # ---------------------------------------------------------------- checks

    def _check_layer(self, layer: int) -> _Layer:
        if isinstance(layer, bool) or not isinstance(layer, int):
            raise ValueError(f"layer={layer!r} must be an int")
        if not 0 <= layer < self._config.num_layers:
            raise ValueError(f"layer={layer} out of range [0, {self._config.num_layers})")
        return self._layers[layer]

    def _check_hidden(self, hidden: torch.Tensor) -> torch.Tensor:
        if hidden.dim() != 2 or hidden.shape[1] != self._config.hidden_size:
            raise ValueError(
                f"hidden has shape {tuple(hidden.shape)}; expected [T, {self._config.hidden_size}]"
            )
        return hidden.to(self._dtype)

    @staticmethod
    def _check_tokens(name: str, t: torch.Tensor, num_tokens: int | None = None) -> None:
        if t.dim() != 1:
            raise ValueError(f"{name} must be 1-D, got shape {tuple(t.shape)}")
        if t.dtype.is_floating_point or t.dtype == torch.bool:
            raise ValueError(f"{name} must hold integers, got {t.dtype}")
        if num_tokens is not None and t.shape[0] != num_tokens:
            raise ValueError(f"{name} has {t.shape[0]} entries for {num_tokens} tokens")

    # ---------------------------------------------------------------- pieces

    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        """Token embeddings.

        Args:
            token_ids: ``int [T]`` ids in ``[0, vocab_size)`` (not checked: that would sync).

        Returns:
            ``[T, hidden]`` in the model dtype.

        Raises:
            ValueError: ``token_ids`` is not a 1-D integer tensor.
        """
        self._check_tokens("token_ids", token_ids)
        return F.embedding(token_ids, self._embed)

    def rotary(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """RoPE cos and sin at ``positions``, as transformers' rotary embedding computes them
        (fp32 ``position * inv_freq``, duplicated halves, cos/sin in fp32, cast to the model
        dtype).

        Args:
            positions: ``int64 [T]`` global positions, any order.

        Returns:
            ``(cos, sin)``, each ``[T, head_dim]`` in the model dtype. The last result is kept
            and returned again for the same, unmodified ``positions`` tensor (every layer of a
            step asks for the same positions).

        Raises:
            ValueError: ``positions`` is not a 1-D integer tensor.
        """
        cached = self._rope_cache
        # NOTE: the cache holds a reference to ``positions``, so its id cannot be reused while
        # cached; ``_version`` changes on any in-place write, so a hit is the same values.
        if cached is not None and cached[0] is positions and cached[1] == positions._version:
            return cached[2], cached[3]
        self._check_tokens("positions", positions)
        # transformers: (inv_freq[:, None] @ pos[None, :].float()).T; a K=1 matmul is this
        # elementwise product (one fp32 rounding), here without the batch dim.
        freqs = positions.to(torch.float32)[:, None] * self._inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos().to(self._dtype), emb.sin().to(self._dtype)
        self._rope_cache = (positions, positions._version, cos, sin)
        return cos, sin

    def forget_rotary(self) -> None:
        """Drop the kept RoPE tables (a CUDA graph must compute its own from its buffers)."""
        self._rope_cache = None

    def attention_inputs(
        self, layer: int, hidden: torch.Tensor, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The queries, keys and values one layer's attention needs for these tokens.

        Input RMSNorm, q/k/v projections (with biases when the config has them) and RoPE at
        each token's global position.

        Args:
            layer: the layer index.
            hidden: ``[T, hidden]`` residual stream entering the layer (cast to the model dtype).
            positions: ``int64 [T]`` global position of each token; need not be contiguous
                or sorted (zigzag ranges, tokens of several sequences).

        Returns:
            ``(q [T, Hq, D], k [T, Hkv, D], v [T, Hkv, D])``, contiguous, in the model dtype;
            ``q`` and ``k`` rotated. Attend with :attr:`sm_scale`; query head ``h`` reads KV
            head ``h // (Hq // Hkv)``.

        Raises:
            ValueError: a bad layer index or shapes.
        """
        w = self._check_layer(layer)
        hidden = self._check_hidden(hidden)
        self._check_tokens("positions", positions, hidden.shape[0])
        c = self._config
        x = _rms_norm(hidden, w.input_norm, c.rms_norm_eps)
        qkv = F.linear(x, w.qkv_weight, w.qkv_bias)
        cos, sin = self.rotary(positions)
        # The torch formula (transformers' apply_rotary_pos_emb) is the kernel's reference.
        rope = kernels.rope_qkv if _fused(qkv) else naive.rope_qkv
        return rope(qkv, cos, sin, c.num_heads, c.num_kv_heads)

    def finish_layer(self, layer: int, hidden: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        """The rest of a layer once attention is done: o_proj + residual, post-attention
        RMSNorm, SwiGLU MLP + residual.

        Args:
            layer: the layer index.
            hidden: ``[T, hidden]`` the residual stream that entered the layer.
            attn: ``[T, Hq, D]`` attention output per query head (any float dtype, e.g. fp32
                from a partial-attention merge; cast to the model dtype).

        Returns:
            ``[T, hidden]`` the residual stream leaving the layer, in the model dtype.

        Raises:
            ValueError: a bad layer index or shapes.
        """
        w = self._check_layer(layer)
        hidden = self._check_hidden(hidden)
        c = self._config
        t = hidden.shape[0]
        if tuple(attn.shape) != (t, c.num_heads, c.head_dim):
            raise ValueError(
                f"attn has shape {tuple(attn.shape)}; expected {(t, c.num_heads, c.head_dim)}"
            )
        a = attn.to(self._dtype).reshape(t, c.num_heads * c.head_dim)
        hidden = hidden + F.linear(a, w.o_weight, w.o_bias)
        x = _rms_norm(hidden, w.post_norm, c.rms_norm_eps)
        gate, up = F.linear(x, w.gate_up_weight, w.gate_up_bias).chunk(2, dim=-1)
        return hidden + F.linear(F.silu(gate) * up, w.down_weight, w.down_bias)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Final RMSNorm and LM head.

        Args:
            hidden: ``[T, hidden]`` the residual stream after the last layer.

        Returns:
            fp32 ``[T, vocab]`` (computed in the model dtype, as transformers does, then cast).

        Raises:
            ValueError: a bad shape.
        """
        hidden = self._check_hidden(hidden)
        x = _rms_norm(hidden, self._norm, self._config.rms_norm_eps)
        return F.linear(x, self._lm_head).to(torch.float32)

    def forward(
        self, token_ids: torch.Tensor, positions: torch.Tensor, attend: AttendFn
    ) -> torch.Tensor:
        """Every layer for these tokens, attention by ``attend``.

        Args:
            token_ids: ``int [T]``.
            positions: ``int64 [T]`` global positions.
            attend: ``attend(layer, q [T, Hq, D], k [T, Hkv, D], v [T, Hkv, D]) -> [T, Hq, D]``;
                it owns the KV cache and the mask (causal by position, and
                ``config.sliding_window`` when set), and attends with :attr:`sm_scale`.

        Returns:
            ``[T, hidden]`` the residual stream after the last layer (feed :meth:`logits`).

        Raises:
            ValueError: bad shapes.
        """
        hidden = self.embed(token_ids)
        self._check_tokens("positions", positions, token_ids.shape[0])
        for layer in range(self._config.num_layers):
            q, k, v = self.attention_inputs(layer, hidden, positions)
            hidden = self.finish_layer(layer, hidden, attend(layer, q, k, v))
        return hidden
