"""ModelSpec: how every lane gets the same weights without shipping them through Ray.

A spec travels to each lane actor (and again when Ray restarts one), so it holds
small things only, never an object in Ray's object store (a restart must not
depend on one, ray-project/ray#53727): a checkpoint directory each lane reads,
or a seed each lane draws the same random weights from. A model instance handed
to :func:`cpkv.connect` is written to a checkpoint directory first.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from typing import Any

from cpkv.models.config import ModelConfig

__all__ = ["ModelSpec", "save_checkpoint"]


@dataclass(slots=True, frozen=True)
class ModelSpec:
    """Where a lane loads its model from: a checkpoint ``path`` or a random ``seed``.

    Attributes:
        config: the architecture (gives the KV shape: layers, KV heads, head_dim, dtype).
        path: a checkpoint directory (``config.json`` + ``*.safetensors``) every lane can read.
        seed: random weights drawn from this seed (:meth:`LlamaModel.random`).
        owns_path: ``path`` was written for this pool (a model instance) and is removed with it.
    """

    config: ModelConfig
    path: str | None = None
    seed: int | None = None
    owns_path: bool = False

    def __post_init__(self) -> None:
        if (self.path is None) == (self.seed is None):
            raise ValueError(
                f"ModelSpec needs exactly one of path and seed; got path={self.path!r}, "
                f"seed={self.seed!r}"
            )
        if self.config.sliding_window is not None:
            raise ValueError(
                f"sliding_window={self.config.sliding_window}: the lanes attend over the whole "
                "sequence; sliding-window models are not supported"
            )

    @classmethod
    def from_source(cls, source: Any, *, seed: int | None = None) -> ModelSpec:
        """A spec for ``source``.

        Args:
            source: a :class:`ModelSpec`, a :class:`ModelConfig` (random weights from
                ``seed``, default 0), a checkpoint directory, a :class:`LlamaModel`, or a
                transformers ``*ForCausalLM`` instance (written to a temporary checkpoint
                directory: on a cluster of several machines pass a shared directory instead).
            seed: the seed for a :class:`ModelConfig` source.

        Raises:
            TypeError: an unsupported source. ValueError: an unsupported config.
        """
        from cpkv.models.llama import LlamaModel

        if isinstance(source, ModelSpec):
            return source
        if isinstance(source, ModelConfig):
            return cls(source, seed=0 if seed is None else int(seed))
        if isinstance(source, (str, os.PathLike)):
            path = os.path.abspath(os.fspath(source))
            return cls(ModelConfig.from_dir(path), path=path)
        if not isinstance(source, LlamaModel):
            if not (hasattr(source, "config") and callable(getattr(source, "state_dict", None))):
                raise TypeError(
                    f"model={type(source).__name__}: expected a transformers *ForCausalLM, a "
                    "cpkv LlamaModel, a ModelConfig or a checkpoint directory"
                )
            source = LlamaModel.from_hf(source, device="cpu")
        path = tempfile.mkdtemp(prefix="cpkv-model-")
        try:  # a model the spec refuses (a sliding window, say) leaves no directory behind
            spec = cls(source.config, path=path, owns_path=True)
            save_checkpoint(source, path)
        except BaseException:
            shutil.rmtree(path, ignore_errors=True)
            raise
        return spec

    def load(self, device: Any):
        """The model on ``device`` (a :class:`cpkv.models.LlamaModel`)."""
        from cpkv.models.llama import LlamaModel

        if self.path is not None:
            return LlamaModel.from_dir(self.path, device=device, dtype=self.config.dtype)
        return LlamaModel.random(self.config, self.seed, device=device)

    def remove(self) -> None:
        """Delete the checkpoint written for this pool (nothing for a user's directory)."""
        if self.owns_path and self.path is not None:
            import shutil

            shutil.rmtree(self.path, ignore_errors=True)

    @property
    def kv_shape(self) -> tuple[int, int, int, str]:
        """``(num_layers, num_kv_heads, head_dim, dtype)`` of the KV pool this model needs."""
        return self.config.kv_shape


def hf_config_dict(config: ModelConfig) -> dict:
    """``config`` as a Hugging Face ``config.json`` (Llama, or Qwen2 when only q/k/v have
    biases); :meth:`ModelConfig.from_dir` reads it back equal.

    Raises:
        ValueError: biases neither family's config can say (Llama: o_proj's with q/k/v's;
            Qwen2: q/k/v's alone), which the lanes could not load back.
    """
    qkv_only = config.attention_bias and not config.o_proj_bias
    if config.o_proj_bias != config.attention_bias and not (qkv_only and not config.mlp_bias):
        raise ValueError(
            f"attention_bias={config.attention_bias}, o_proj_bias={config.o_proj_bias}, "
            f"mlp_bias={config.mlp_bias}: no Llama or Qwen2 config.json says these biases"
        )
    out = {
        "model_type": "qwen2" if qkv_only else "llama",
        "architectures": ["Qwen2ForCausalLM" if qkv_only else "LlamaForCausalLM"],
        "vocab_size": config.vocab_size,
        "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size,
        "num_hidden_layers": config.num_layers,
        "num_attention_heads": config.num_heads,
        "num_key_value_heads": config.num_kv_heads,
        "head_dim": config.head_dim,
        "rms_norm_eps": config.rms_norm_eps,
        "rope_theta": config.rope_theta,
        "rope_scaling": config.rope_scaling,
        "max_position_embeddings": config.max_position_embeddings,
        "tie_word_embeddings": config.tie_word_embeddings,
        "hidden_act": "silu",
        "torch_dtype": config.dtype,
    }
    if not qkv_only:
        out["attention_bias"] = config.attention_bias
        out["mlp_bias"] = config.mlp_bias
    return out


def save_checkpoint(model: Any, path: str | os.PathLike[str]) -> None:
    """Write a :class:`LlamaModel` as ``config.json`` + ``model.safetensors`` in ``path``."""
    from safetensors.torch import save_file

    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(hf_config_dict(model.config), f, indent=1)
    tensors = {k: v.detach().to("cpu").contiguous() for k, v in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        tensors.pop("lm_head.weight", None)
    save_file(tensors, os.path.join(path, "model.safetensors"))
