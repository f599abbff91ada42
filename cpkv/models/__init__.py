"""Llama-family causal LMs (Llama, Qwen2, Mistral) in plain torch, cut at attention for the
context-parallel lanes: :class:`ModelConfig`, :class:`LlamaModel`, :func:`load_model`, and
named shapes of random weights (:func:`preset_config`).

Nothing here imports transformers; it reads its configs and checkpoints.
"""

from cpkv.models.config import ModelConfig
from cpkv.models.llama import AttendFn, LlamaModel
from cpkv.models.loading import load_model
from cpkv.models.presets import MODEL_PRESETS, preset_config, small_config

__all__ = [
    "MODEL_PRESETS",
    "AttendFn",
    "LlamaModel",
    "ModelConfig",
    "load_model",
    "preset_config",
    "small_config",
]
