"""Shape and numerics of a Llama-family causal LM (Llama, Qwen2, Mistral), without torch.

:class:`ModelConfig` is what the lanes size their KV pools from (:attr:`ModelConfig.kv_shape`)
and what :class:`cpkv.models.LlamaModel` checks its weights against. It reads Hugging Face
configs (a ``PretrainedConfig`` or its dict, or a checkpoint's ``config.json``) without
importing transformers.
"""

from __future__ import annotations

import dataclasses
import json
import math
import numbers
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

__all__ = ["DTYPES", "ROPE_TYPES", "SUPPORTED_MODEL_TYPES", "ModelConfig"]

#: Weight / activation dtypes a model may run in (names as in ``torch.<name>``).
DTYPES = ("float32", "bfloat16", "float16")
#: RoPE variants computed exactly as transformers computes their ``inv_freq``.
ROPE_TYPES = ("default", "linear", "llama3")
#: Hugging Face ``model_type`` values :meth:`ModelConfig.from_hf` accepts.
SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "mistral")

# Per model type: values transformers' config classes default to when a config.json omits them.
_HF_DEFAULTS: dict[str, dict[str, Any]] = {
    "llama": {"max_position_embeddings": 2048, "rms_norm_eps": 1e-6},
    "qwen2": {"max_position_embeddings": 32768, "rms_norm_eps": 1e-6},
    "mistral": {"max_position_embeddings": 4096 * 32, "rms_norm_eps": 1e-6, "sliding_window": 4096},
}
_DEFAULT_ROPE_THETA = 10000.0
# Keys each rope type reads (besides rope_type / rope_theta); anything else is refused.
_ROPE_KEYS = {
    "default": frozenset(),
    "linear": frozenset({"factor"}),
    "llama3": frozenset(
        {"factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"}
    ),
}


def _is_int(value: object) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _is_real(value: object) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def _positive_real(name: str, value: object) -> float:
    if not _is_real(value) or not math.isfinite(float(value)) or float(value) <= 0:
        raise ValueError(f"{name}={value!r} must be a finite number > 0")
    return float(value)


def _dtype_name(value: object) -> str | None:
    """``torch.bfloat16`` / ``"torch.bfloat16"`` / ``"bfloat16"`` -> ``"bfloat16"``."""
    return None if value is None else str(value).removeprefix("torch.")


def _normalize_rope_scaling(
    rope_scaling: object, rope_theta: float, max_position_embeddings: int
) -> dict[str, Any] | None:
    """A validated copy of ``rope_scaling`` (``None`` for plain RoPE), or raise ValueError."""
    if rope_scaling is None:
        return None
    if not isinstance(rope_scaling, Mapping):
        raise ValueError(f"rope_scaling={rope_scaling!r} must be a dict or None")
    params = dict(rope_scaling)
    rope_type = params.pop("rope_type", None)
    legacy_type = params.pop("type", None)
    rope_type = rope_type if rope_type is not None else legacy_type
    rope_type = "default" if rope_type is None else rope_type
    if rope_type not in ROPE_TYPES:
        raise ValueError(f"rope_scaling rope_type={rope_type!r}; supported: {ROPE_TYPES}")
    theta = params.pop("rope_theta", None)
    if theta is not None and (not _is_real(theta) or float(theta) != rope_theta):
        raise ValueError(
            f"rope_scaling rope_theta={theta!r} disagrees with rope_theta={rope_theta!r}"
        )
    partial = params.pop("partial_rotary_factor", None)
    if partial is not None and (not _is_real(partial) or float(partial) != 1.0):
        raise ValueError(f"rope_scaling partial_rotary_factor={partial!r}; only 1.0 is supported")
    unknown = sorted(set(params) - _ROPE_KEYS[rope_type])
    if unknown:
        raise ValueError(f"rope_scaling keys {unknown} are not used by rope_type={rope_type!r}")
    if rope_type == "default":
        return None
    out: dict[str, Any] = {"rope_type": rope_type}
    if "factor" not in params:
        raise ValueError(f"rope_scaling for rope_type={rope_type!r} needs 'factor'")
    out["factor"] = _positive_real("rope_scaling factor", params["factor"])
    if rope_type == "llama3":
        for key in ("low_freq_factor", "high_freq_factor"):
            if key not in params:
                raise ValueError(f"rope_scaling for rope_type='llama3' needs {key!r}")
            out[key] = _positive_real(f"rope_scaling {key}", params[key])
        if out["high_freq_factor"] <= out["low_freq_factor"]:
            raise ValueError(
                f"rope_scaling high_freq_factor={out['high_freq_factor']} must exceed "
                f"low_freq_factor={out['low_freq_factor']}"
            )
        # NOTE: transformers fills a missing original_max_position_embeddings with
        # max_position_embeddings (standardize_rope_params); so do we.
        orig = params.get("original_max_position_embeddings", max_position_embeddings)
        if not _is_int(orig) or orig < 1:
            raise ValueError(
                f"rope_scaling original_max_position_embeddings={orig!r} must be an integer >= 1"
            )
        out["original_max_position_embeddings"] = int(orig)
    return out


def _given(d: Mapping[str, Any], key: str, default: Any) -> Any:
    """``d[key]`` unless it is absent or ``None`` (a JSON null)."""
    value = d.get(key)
    return default if value is None else value


@dataclass(slots=True, frozen=True)
class ModelConfig:
    """Architecture of a Llama-family decoder-only LM (pre-norm, RMSNorm, RoPE, GQA, SwiGLU).

    Attributes:
        vocab_size: Embedding / LM-head rows.
        hidden_size: Residual stream width.
        intermediate_size: SwiGLU inner width.
        num_layers: Decoder layers.
        num_heads: Query heads (``Hq``).
        num_kv_heads: Key/value heads (``Hkv``); divides ``num_heads``.
        head_dim: Per-head width ``D`` (even: RoPE rotates pairs of halves).
        rms_norm_eps: RMSNorm epsilon.
        rope_theta: RoPE base.
        rope_scaling: ``None`` for plain RoPE, or a dict with ``rope_type`` ``"linear"``
            (``factor``) or ``"llama3"`` (``factor``, ``low_freq_factor``,
            ``high_freq_factor``, ``original_max_position_embeddings``). Stored as a validated
            copy; ``{"rope_type": "default"}`` becomes ``None``.
        max_position_embeddings: Longest context the model was configured for.
        tie_word_embeddings: LM head shares the embedding matrix.
        attention_bias: q/k/v projections have biases (Qwen2, Llama with attention_bias).
        mlp_bias: gate/up/down projections have biases.
        dtype: ``"float32"``, ``"bfloat16"`` or ``"float16"``: weights, activations and the
            KV cache.
        o_proj_bias: o_proj has a bias; ``None`` means ``attention_bias`` (Llama's meaning of
            attention_bias: all four projections). Qwen2 sets it False.
        sliding_window: ``None`` for full causal attention; else a query at position ``p``
            sees keys at positions ``p - sliding_window < j <= p`` (transformers' Mistral
            convention). The model runs no attention itself: the attend callback / the lanes
            must honour this.

    Raises:
        ValueError: naming the offending field, for any value out of range (see
            ``__post_init__``).
    """

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = _DEFAULT_ROPE_THETA
    # NOTE: a dict is unhashable; leaving it out of the hash keeps the config hashable
    # (equal configs still hash equal: they agree on every other field). It is a validated
    # private copy: treat it as read-only.
    rope_scaling: dict[str, Any] | None = field(default=None, hash=False)
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    mlp_bias: bool = False
    dtype: str = "bfloat16"
    o_proj_bias: bool | None = None
    sliding_window: int | None = None

    def __post_init__(self) -> None:
        """Validate every field and normalise ``rope_scaling``, ``o_proj_bias``, floats.

        Raises:
            ValueError: a non-integer or non-positive size, ``num_heads % num_kv_heads != 0``,
                an odd ``head_dim``, a non-positive ``rms_norm_eps`` / ``rope_theta``, a
                non-bool flag, an unknown dtype, a bad ``sliding_window``, or a
                ``rope_scaling`` of an unsupported type / with missing, unknown or bad keys.
        """
        for name in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_layers",
            "num_heads",
            "num_kv_heads",
            "head_dim",
            "max_position_embeddings",
        ):
            value = getattr(self, name)
            if not _is_int(value) or value < 1:
                raise ValueError(f"{name}={value!r} must be an integer >= 1")
            object.__setattr__(self, name, int(value))
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads={self.num_heads} must be a multiple of num_kv_heads={self.num_kv_heads}"
            )
        if self.head_dim % 2:
            raise ValueError(f"head_dim={self.head_dim} must be even (RoPE rotates half-pairs)")
        object.__setattr__(self, "rms_norm_eps", _positive_real("rms_norm_eps", self.rms_norm_eps))
        object.__setattr__(self, "rope_theta", _positive_real("rope_theta", self.rope_theta))
        if self.o_proj_bias is None:
            object.__setattr__(self, "o_proj_bias", self.attention_bias)
        for name in ("tie_word_embeddings", "attention_bias", "mlp_bias", "o_proj_bias"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name}={getattr(self, name)!r} must be a bool")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype={self.dtype!r}; expected one of {DTYPES}")
        if self.sliding_window is not None and (
            not _is_int(self.sliding_window) or self.sliding_window < 1
        ):
            raise ValueError(f"sliding_window={self.sliding_window!r} must be None or an int >= 1")
        object.__setattr__(
            self,
            "rope_scaling",
            _normalize_rope_scaling(
                self.rope_scaling, self.rope_theta, self.max_position_embeddings
            ),
        )

    # ---------------------------------------------------------------- derived

    @property
    def kv_shape(self) -> tuple[int, int, int, str]:
        """``(num_layers, num_kv_heads, head_dim, dtype)``: what one token's K (or V) needs
        per layer, in the order of :class:`cpkv.core.config.KVShape`'s fields."""
        return (self.num_layers, self.num_kv_heads, self.head_dim, self.dtype)

    @property
    def rope_type(self) -> str:
        """``"default"``, ``"linear"`` or ``"llama3"``."""
        return "default" if self.rope_scaling is None else self.rope_scaling["rope_type"]

    def replace(self, **changes: Any) -> ModelConfig:
        """A copy with ``changes`` applied (validated again).

        Args:
            **changes: field values to change.

        Returns:
            The new config.

        Raises:
            ValueError: a changed value is invalid; TypeError: an unknown field.
        """
        return dataclasses.replace(self, **changes)

    # ---------------------------------------------------------------- HF configs

    @classmethod
    def from_hf(cls, hf_config: Any) -> ModelConfig:
        """Read a Hugging Face Llama / Qwen2 / Mistral config.

        Args:
            hf_config: a transformers ``PretrainedConfig`` (anything with ``to_dict()``) or
                its dict (e.g. a parsed ``config.json``). Both the v5 ``rope_parameters`` and
                the older ``rope_scaling`` + top-level ``rope_theta`` layouts are read; the
                dtype comes from ``dtype`` or ``torch_dtype`` (``float32`` when unset).

        Returns:
            The config. Qwen2 gets ``attention_bias=True, o_proj_bias=False``; Llama's
            ``attention_bias`` covers o_proj too; Mistral's ``sliding_window`` is kept, and a
            Qwen2 one when ``use_sliding_window`` applies it to every layer.

        Raises:
            ValueError: an unsupported ``model_type`` or ``hidden_act``, a missing size, a
                per-layer RoPE or a Qwen2 sliding window on only some layers, partial rotary
                embeddings, or any value :class:`ModelConfig` rejects.
            TypeError: ``hf_config`` is neither a mapping nor has ``to_dict()``.
        """
        if isinstance(hf_config, Mapping):
            d = dict(hf_config)
        elif callable(getattr(hf_config, "to_dict", None)):
            d = dict(hf_config.to_dict())
        else:
            raise TypeError(f"expected a PretrainedConfig or a dict, got {type(hf_config)!r}")
        model_type = d.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(f"model_type={model_type!r}; supported: {SUPPORTED_MODEL_TYPES}")
        defaults = _HF_DEFAULTS[model_type]

        def need(key: str) -> Any:
            if d.get(key) is None:
                raise ValueError(f"{model_type} config lacks {key!r}")
            return d[key]

        hidden_act = d.get("hidden_act", "silu")
        if hidden_act != "silu":
            raise ValueError(f"hidden_act={hidden_act!r}; only 'silu' (SwiGLU) is supported")
        if d.get("partial_rotary_factor") not in (None, 1, 1.0):
            raise ValueError(
                f"partial_rotary_factor={d['partial_rotary_factor']!r}; only 1.0 is supported"
            )
        hidden_size = need("hidden_size")
        num_heads = need("num_attention_heads")
        # NOTE: `is None`, not `or`: a 0 reaches ModelConfig's checks instead of a default.
        num_kv_heads = _given(d, "num_key_value_heads", num_heads)
        head_dim = d.get("head_dim")
        if head_dim is None:
            if not _is_int(hidden_size) or not _is_int(num_heads) or num_heads < 1:
                raise ValueError(f"hidden_size={hidden_size!r}, num_heads={num_heads!r}")
            head_dim = hidden_size // num_heads
        max_pos = _given(d, "max_position_embeddings", defaults["max_position_embeddings"])

        # NOTE: as transformers reads a config: a legacy rope_scaling block, when given,
        # replaces rope_parameters whole (rope_theta then from the top level or the default).
        rope = d.get("rope_scaling") or d.get("rope_parameters") or {}
        if not isinstance(rope, Mapping):
            raise ValueError(f"rope parameters {rope!r} must be a dict")
        rope = dict(rope)
        if rope and all(isinstance(v, Mapping) or v is None for v in rope.values()):
            raise ValueError(f"per-layer-type RoPE parameters are not supported: {sorted(rope)}")
        rope_theta = rope.pop("rope_theta", None)
        if rope_theta is None:
            rope_theta = _given(d, "rope_theta", _DEFAULT_ROPE_THETA)
        # NOTE: as transformers (standardize_rope_params): a top-level
        # original_max_position_embeddings (Phi-3-style converters) overrides the block's.
        rope_type = rope.get("rope_type", rope.get("type"))
        if rope_type == "llama3" and d.get("original_max_position_embeddings") is not None:
            rope["original_max_position_embeddings"] = d["original_max_position_embeddings"]

        if model_type == "llama":
            attention_bias = d.get("attention_bias", False)
            o_proj_bias = attention_bias
            mlp_bias = d.get("mlp_bias", False)
        elif model_type == "qwen2":
            attention_bias, o_proj_bias, mlp_bias = True, False, False
        else:
            attention_bias, o_proj_bias, mlp_bias = False, False, False

        sliding_window = None
        if model_type == "mistral":
            sliding_window = d.get("sliding_window", defaults["sliding_window"])
        elif (
            model_type == "qwen2"
            and d.get("use_sliding_window")
            and d.get("sliding_window", 4096) is not None  # no window: every layer is full
        ):
            window = d.get("sliding_window", 4096)
            num_layers = need("num_hidden_layers")
            layer_types = d.get("layer_types") or [
                "sliding_attention" if i >= d.get("max_window_layers", 28) else "full_attention"
                for i in range(num_layers)
            ]
            sliding = {t == "sliding_attention" for t in layer_types}
            if sliding == {True, False}:
                raise ValueError(
                    "a sliding window on only some layers (Qwen2 max_window_layers) is not "
                    "supported"
                )
            sliding_window = window if sliding == {True} else None

        dtype = _dtype_name(d.get("dtype") or d.get("torch_dtype")) or "float32"
        return cls(
            vocab_size=need("vocab_size"),
            hidden_size=hidden_size,
            intermediate_size=need("intermediate_size"),
            num_layers=need("num_hidden_layers"),
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            rms_norm_eps=d.get("rms_norm_eps", defaults["rms_norm_eps"]),
            rope_theta=rope_theta,
            rope_scaling=rope or None,
            max_position_embeddings=max_pos,
            tie_word_embeddings=d.get("tie_word_embeddings", False),
            attention_bias=attention_bias,
            mlp_bias=mlp_bias,
            dtype=dtype,
            o_proj_bias=o_proj_bias,
            sliding_window=sliding_window,
        )

    @classmethod
    def from_dir(cls, path: str | os.PathLike[str]) -> ModelConfig:
        """Read ``<path>/config.json`` (a Hugging Face checkpoint directory).

        Args:
            path: the checkpoint directory.

        Returns:
            :meth:`from_hf` of the parsed file.

        Raises:
            FileNotFoundError: no config.json there.
            ValueError: as :meth:`from_hf`, or the file is not a JSON object.
        """
        file = os.path.join(os.fspath(path), "config.json")
        with open(file, encoding="utf-8") as f:
            d = json.load(f)
        if not isinstance(d, dict):
            raise ValueError(f"{file} does not hold a JSON object")
        return cls.from_hf(d)

    # ---------------------------------------------------------------- presets

    @classmethod
    def tiny(cls, **overrides: Any) -> ModelConfig:
        """A small fp32 config with odd sizes for tests and demos.

        vocab 97, hidden 72, intermediate 100, 3 layers, 6 query / 2 KV heads of 12,
        rms_norm_eps 1e-5, rope_theta 10000, 256 positions, untied, fp32.

        Args:
            **overrides: any field to change.

        Returns:
            The config.

        Raises:
            ValueError: an override is invalid; TypeError: an unknown field.
        """
        fields: dict[str, Any] = {
            "vocab_size": 97,
            "hidden_size": 72,
            "intermediate_size": 100,
            "num_layers": 3,
            "num_heads": 6,
            "num_kv_heads": 2,
            "head_dim": 12,
            "rms_norm_eps": 1e-5,
            "rope_theta": 10000.0,
            "max_position_embeddings": 256,
            "tie_word_embeddings": False,
            "dtype": "float32",
        }
        fields.update(overrides)
        return cls(**fields)

    @classmethod
    def llama_3_2_1b(cls) -> ModelConfig:
        """Llama-3.2-1B's shape (its config.json): 16 layers, hidden 2048, 32 query / 8 KV
        heads of 64, intermediate 8192, vocab 128256, rope_theta 500000 with llama3 scaling
        (factor 32, low 1, high 4, original 8192), 131072 positions, tied, bf16.

        Returns:
            The config.
        """
        return cls(
            vocab_size=128256,
            hidden_size=2048,
            intermediate_size=8192,
            num_layers=16,
            num_heads=32,
            num_kv_heads=8,
            head_dim=64,
            rms_norm_eps=1e-5,
            rope_theta=500000.0,
            rope_scaling={
                "rope_type": "llama3",
                "factor": 32.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192,
            },
            max_position_embeddings=131072,
            tie_word_embeddings=True,
            dtype="bfloat16",
        )
