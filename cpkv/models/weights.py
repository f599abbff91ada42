"""Weights of a Llama-family LM under their Hugging Face names: expected shapes, seeded random
weights, and reading a safetensors checkpoint directory (one file or an indexed shard set)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from cpkv.models.config import ModelConfig

__all__ = [
    "IGNORED_SUFFIXES",
    "TORCH_DTYPES",
    "parameter_shapes",
    "random_weights",
    "read_safetensors_dir",
    "torch_dtype",
]

#: ``ModelConfig.dtype`` name -> torch dtype.
TORCH_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}
#: Checkpoint entries that hold no weights (old checkpoints saved RoPE buffers).
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def torch_dtype(dtype: str | torch.dtype) -> torch.dtype:
    """``"bfloat16"`` / ``torch.bfloat16`` -> ``torch.bfloat16``.

    Args:
        dtype: a name in :data:`TORCH_DTYPES` (``"torch."`` prefix allowed) or a torch dtype.

    Returns:
        The torch dtype.

    Raises:
        ValueError: not one of float32 / bfloat16 / float16.
    """
    if isinstance(dtype, torch.dtype):
        if dtype not in TORCH_DTYPES.values():
            raise ValueError(f"dtype={dtype}; expected one of {tuple(TORCH_DTYPES)}")
        return dtype
    name = str(dtype).removeprefix("torch.")
    if name not in TORCH_DTYPES:
        raise ValueError(f"dtype={dtype!r}; expected one of {tuple(TORCH_DTYPES)}")
    return TORCH_DTYPES[name]


def parameter_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every parameter a checkpoint of ``config`` holds, by Hugging Face name, in a fixed order.

    Args:
        config: the architecture.

    Returns:
        ``{name: shape}``; ``lm_head.weight`` only when embeddings are untied; biases only when
        the config has them.
    """
    h, hd = config.hidden_size, config.head_dim
    q_out, kv_out = config.num_heads * hd, config.num_kv_heads * hd
    inter = config.intermediate_size
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (config.vocab_size, h)}
    for i in range(config.num_layers):
        p = f"model.layers.{i}."
        shapes[p + "input_layernorm.weight"] = (h,)
        for name, out in (("q_proj", q_out), ("k_proj", kv_out), ("v_proj", kv_out)):
            shapes[f"{p}self_attn.{name}.weight"] = (out, h)
            if config.attention_bias:
                shapes[f"{p}self_attn.{name}.bias"] = (out,)
        shapes[p + "self_attn.o_proj.weight"] = (h, q_out)
        if config.o_proj_bias:
            shapes[p + "self_attn.o_proj.bias"] = (h,)
        shapes[p + "post_attention_layernorm.weight"] = (h,)
        for name, shape in (
            ("gate_proj", (inter, h)),
            ("up_proj", (inter, h)),
            ("down_proj", (h, inter)),
        ):
            shapes[f"{p}mlp.{name}.weight"] = shape
            if config.mlp_bias:
                shapes[f"{p}mlp.{name}.bias"] = (shape[0],)
    shapes["model.norm.weight"] = (h,)
    if not config.tie_word_embeddings:
        shapes["lm_head.weight"] = (config.vocab_size, h)
    return shapes


def random_weights(
    config: ModelConfig,
    seed: int,
    *,
    std: float = 0.02,
    dtype: str | torch.dtype = torch.float32,
) -> dict[str, torch.Tensor]:
    """Deterministic random weights for ``config``, drawn on the CPU in fp32.

    Matrices, embeddings and biases are ``N(0, std^2)``; RMSNorm weights are ones. The values
    depend only on ``(config shapes, seed, std)``, not on the device the model later runs on.

    Args:
        config: the architecture.
        seed: the generator seed.
        std: the normal's standard deviation.
        dtype: each tensor is cast to this right after it is drawn (the fp32 draw is the same
            whatever the dtype; only one fp32 tensor exists at a time).

    Returns:
        ``{name: CPU tensor}`` in :func:`parameter_shapes` order.

    Raises:
        ValueError: an unsupported dtype.
    """
    target = torch_dtype(dtype)
    gen = torch.Generator(device="cpu").manual_seed(int(seed))
    out: dict[str, torch.Tensor] = {}
    for name, shape in parameter_shapes(config).items():
        if name.endswith("norm.weight"):
            out[name] = torch.ones(shape, dtype=target)
        else:
            drawn = torch.empty(shape, dtype=torch.float32).normal_(0.0, std, generator=gen)
            out[name] = drawn.to(target)
    return out


def _checkpoint_files(directory: Path) -> list[Path]:
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        with open(index, encoding="utf-8") as f:
            data = json.load(f)
        weight_map = data.get("weight_map") if isinstance(data, dict) else None
        if not isinstance(weight_map, dict) or not weight_map:
            raise ValueError(f"{index} has no weight_map")
        names = set(weight_map.values())
        bad = sorted(repr(n) for n in names if not isinstance(n, str) or not n)
        if bad:
            raise ValueError(f"{index} names shards that are not file names: {bad}")
        files = [directory / name for name in sorted(names)]
        missing = [str(f) for f in files if not f.is_file()]
        if missing:
            raise FileNotFoundError(f"{index} names missing shards: {missing}")
        return files
    # NOTE: as transformers: model.safetensors when it is there (beside it may lie another
    # format's weights, an adapter's or a consolidated copy), else every shard there.
    single = directory / "model.safetensors"
    if single.is_file():
        return [single]
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {directory}")
    return files


def read_safetensors_dir(
    path: str | os.PathLike[str], dtype: str | torch.dtype | None = None
) -> dict[str, torch.Tensor]:
    """Every tensor of a safetensors checkpoint directory, on the CPU.

    The shards are those ``model.safetensors.index.json`` names when it exists, else
    ``model.safetensors`` when it exists, else every ``*.safetensors`` file there. Entries in
    :data:`IGNORED_SUFFIXES` are skipped.

    Args:
        path: the checkpoint directory.
        dtype: cast each floating tensor to this as it is read (keeps peak memory at one copy);
            ``None`` keeps the stored dtypes.

    Returns:
        ``{name: CPU tensor}``.

    Raises:
        FileNotFoundError: no shards, or the index names a missing one.
        ValueError: a name appears in two shards, or a bad index / dtype.
    """
    from safetensors import safe_open

    target = None if dtype is None else torch_dtype(dtype)
    out: dict[str, torch.Tensor] = {}
    for file in _checkpoint_files(Path(os.fspath(path))):
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open has keys(), not iteration
                if name.endswith(IGNORED_SUFFIXES):
                    continue
                if name in out:
                    raise ValueError(f"{name} appears in more than one shard (again in {file})")
                t = f.get_tensor(name)
                if target is not None and t.is_floating_point():
                    t = t.to(target)
                out[name] = t
    return out
