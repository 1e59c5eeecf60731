"""Hugging Face weight I/O of the reference Llama model: names, views, streaming load.

Contract: weights are addressed by their Hugging Face names as *views* into the fused
q/k/v and gate/up matrices, so loading copies each checkpoint tensor straight into its
slice and peak host memory is one tensor. A load validates every shape (the error
names the tensor), lists unknown tensors and missing weights, and never downloads.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator, Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from graphguard.errors import ConfigError
from graphguard_ref.llama.config import LlamaConfig, dtype_from_hf

# The model is typed ``Any`` here: model.py imports this module, and weight I/O only
# reads the fused parameters by name.


def read_checkpoint(
    path: str | os.PathLike[str],
    config: LlamaConfig | None = None,
    *,
    dtype: torch.dtype | None = None,
    max_batch: int | None = None,
    max_context: int | None = None,
) -> tuple[LlamaConfig, torch.dtype, Iterator[tuple[str, Tensor]]]:
    """Config, dtype and a lazy ``(name, tensor)`` stream of a local HF Llama directory.

    Every check that needs no weights (package present, directory, config, files)
    runs here, before the caller allocates the model; tensors are read one at a time
    when the iterator is consumed. See :meth:`LlamaDecodeModel.from_pretrained`.
    """
    try:
        from safetensors import safe_open
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise ImportError(
            "LlamaDecodeModel.from_pretrained reads *.safetensors files and needs the "
            "'safetensors' package: pip install 'graphguard-ref[hf]'"
        ) from exc
    directory = Path(path)
    if not directory.is_dir():
        raise FileNotFoundError(
            f"{directory} is not a directory; from_pretrained loads a local Hugging Face "
            "checkpoint directory and never downloads"
        )
    hf_config: dict[str, Any] = {}
    config_file = directory / "config.json"
    if config_file.is_file():
        hf_config = json.loads(config_file.read_text())
    if config is None:
        if not hf_config:
            raise FileNotFoundError(f"{config_file} not found and no config was given")
        config = LlamaConfig.from_hf_config(
            hf_config,
            max_batch=max_batch if max_batch is not None else LlamaConfig.max_batch,
            max_context=max_context,
        )
    else:
        config = replace(
            config,
            max_batch=config.max_batch if max_batch is None else max_batch,
            max_context=config.max_context if max_context is None else max_context,
        )
    if dtype is None:
        dtype = dtype_from_hf(hf_config)
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {directory}")

    def tensors() -> Iterator[tuple[str, Tensor]]:
        for file in files:
            with safe_open(str(file), framework="pt", device="cpu") as handle:
                for key in handle.keys():  # noqa: SIM118 - safe_open is not a dict
                    yield key, handle.get_tensor(key)

    return config, dtype, tensors()


def hf_weight_views(model: Any) -> dict[str, Tensor]:
    """Every weight under its Hugging Face name, as a view into the fused parameters.

    Why views: the loader copies each checkpoint tensor straight into its slice of
    the fused q/k/v and gate/up matrices, and an exporter can read them without a
    copy. ``lm_head.weight`` is absent when embeddings are tied (as HF saves it).
    Clone before saving with ``safetensors`` (the views share storage).
    """
    cfg = model.config
    q, kv, i = cfg.q_size, cfg.kv_size, cfg.intermediate_size
    views: dict[str, Tensor] = {"model.embed_tokens.weight": model.embed_tokens.detach()}
    for n, module in enumerate(model.layers):
        layer: Any = module
        p = f"model.layers.{n}."
        qkv = layer.qkv_weight.detach()
        gate_up = layer.gate_up_weight.detach()
        views[p + "self_attn.q_proj.weight"] = qkv[:q]
        views[p + "self_attn.k_proj.weight"] = qkv[q : q + kv]
        views[p + "self_attn.v_proj.weight"] = qkv[q + kv :]
        views[p + "self_attn.o_proj.weight"] = layer.o_weight.detach()
        views[p + "mlp.gate_proj.weight"] = gate_up[:i]
        views[p + "mlp.up_proj.weight"] = gate_up[i:]
        views[p + "mlp.down_proj.weight"] = layer.down_weight.detach()
        views[p + "input_layernorm.weight"] = layer.input_norm.detach()
        views[p + "post_attention_layernorm.weight"] = layer.post_norm.detach()
    views["model.norm.weight"] = model.norm.detach()
    if not cfg.tie_word_embeddings:
        views["lm_head.weight"] = model.lm_head.detach()
    return views


@torch.no_grad()
def load_hf_weights(
    model: Any, tensors: Mapping[str, Tensor] | Iterator[tuple[str, Tensor]]
) -> None:
    """Copy Hugging Face-named tensors into the model (casting to its device and dtype).

    Raises ``ConfigError`` naming the tensor on a shape mismatch, listing every
    unknown name, and listing every weight the checkpoint did not provide.
    ``lm_head.weight`` in a checkpoint with tied embeddings is ignored (the head is
    the embedding), as are RoPE ``inv_freq`` buffers some exports include.
    """
    targets = model.hf_weight_views()
    items = tensors.items() if isinstance(tensors, Mapping) else tensors
    loaded: set[str] = set()
    unexpected: list[str] = []
    for name, tensor in items:
        target = targets.get(name)
        if target is None:
            tied_head = name == "lm_head.weight" and model.config.tie_word_embeddings
            if not tied_head and not name.endswith("rotary_emb.inv_freq"):
                unexpected.append(name)
            continue
        if tuple(tensor.shape) != tuple(target.shape):
            raise ConfigError(
                f"checkpoint tensor {name!r} has shape {tuple(tensor.shape)}, but the "
                f"config expects {tuple(target.shape)}; does config.json match the weights?"
            )
        target.copy_(tensor)
        loaded.add(name)
    if unexpected:
        raise ConfigError(
            f"checkpoint has {len(unexpected)} tensor(s) this Llama model does not know: "
            f"{', '.join(sorted(unexpected)[:10])}" + (" ..." if len(unexpected) > 10 else "")
        )
    missing = sorted(set(targets) - loaded)
    if missing:
        raise ConfigError(
            f"checkpoint lacks {len(missing)} weight(s): {', '.join(missing[:10])}"
            + (" ..." if len(missing) > 10 else "")
        )


__all__ = ["hf_weight_views", "load_hf_weights", "read_checkpoint"]
