"""Named model shapes of random weights: what ``cpkv demo`` and ``cpkv bench --model`` run."""

from __future__ import annotations

from collections.abc import Callable

from cpkv.models.config import ModelConfig

__all__ = ["MODEL_PRESETS", "preset_config", "small_config"]


def small_config() -> ModelConfig:
    """The demo's model: a small fp32 Llama (hidden 128, 4 layers, 8 query / 2 KV heads of
    16, intermediate 344, vocab 512) that 4 CPU lanes load and run in seconds."""
    return ModelConfig(
        vocab_size=512,
        hidden_size=128,
        intermediate_size=344,
        num_layers=4,
        num_heads=8,
        num_kv_heads=2,
        head_dim=16,
        rope_theta=10000.0,
        max_position_embeddings=4096,
        dtype="float32",
    )


_PRESETS: dict[str, Callable[[], ModelConfig]] = {
    "small": small_config,
    "tiny": ModelConfig.tiny,
    "llama-3.2-1b": ModelConfig.llama_3_2_1b,
}

#: Preset names: ``small`` (:func:`small_config`), ``tiny`` (:meth:`ModelConfig.tiny`),
#: ``llama-3.2-1b`` (:meth:`ModelConfig.llama_3_2_1b`).
MODEL_PRESETS = tuple(_PRESETS)


def preset_config(name: str) -> ModelConfig:
    """The config of preset ``name``.

    Raises:
        ValueError: ``name`` is not one of :data:`MODEL_PRESETS`.
    """
    if name not in _PRESETS:
        raise ValueError(f"model preset {name!r}; expected one of {MODEL_PRESETS}")
    return _PRESETS[name]()
