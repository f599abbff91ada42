"""One entry point that turns whatever names a model into a :class:`LlamaModel`."""

from __future__ import annotations

import os
from typing import Any

import torch

from cpkv.models.llama import LlamaModel

__all__ = ["load_model"]


def load_model(
    source: Any,
    device: str | torch.device = "cpu",
    dtype: str | torch.dtype | None = None,
) -> LlamaModel:
    """A :class:`LlamaModel` from a model, a checkpoint directory or a transformers instance.

    Args:
        source: a :class:`LlamaModel` (moved / cast as asked), a path to a Hugging Face
            checkpoint directory (:meth:`LlamaModel.from_dir`), or a transformers
            ``*ForCausalLM`` instance (:meth:`LlamaModel.from_hf`).
        device: where to run.
        dtype: the dtype to run in; ``None`` keeps the source's (the checkpoint config's dtype
            for a directory).

    Returns:
        The model.

    Raises:
        TypeError: ``source`` is none of those.
        FileNotFoundError, ValueError: as the constructor it dispatches to.
    """
    if isinstance(source, LlamaModel):
        return source.to(device=device, dtype=dtype)
    if isinstance(source, (str, os.PathLike)):
        return LlamaModel.from_dir(source, device=device, dtype=dtype)
    if hasattr(source, "config") and callable(getattr(source, "state_dict", None)):
        return LlamaModel.from_hf(source, device=device, dtype=dtype)
    raise TypeError(
        f"cannot load a model from {type(source)!r}: expected a LlamaModel, a checkpoint "
        "directory or a transformers *ForCausalLM instance"
    )
