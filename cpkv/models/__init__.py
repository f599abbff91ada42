"""Llama-family causal LMs (Llama, Qwen2, Mistral) in plain torch, cut at attention for the
context-parallel lanes: :class:`ModelConfig`, :class:`LlamaModel`, :func:`load_model`.

Nothing here imports transformers; it reads its configs and checkpoints.
"""

from cpkv.models.config import ModelConfig
from cpkv.models.llama import AttendFn, LlamaModel
from cpkv.models.loading import load_model

__all__ = ["AttendFn", "LlamaModel", "ModelConfig", "load_model"]
