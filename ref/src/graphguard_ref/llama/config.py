"""Shapes and static limits of the reference Llama decoder, and their Hugging Face translation.

Contract: a :class:`LlamaConfig` is validated when built (every int positive, heads
divisible for grouped-query attention, even head_dim for RoPE) and raises
:class:`graphguard.errors.ConfigError` otherwise; :meth:`LlamaConfig.from_hf_config`
refuses checkpoint features this reference model does not implement instead of
silently computing something else. ``max_batch``/``max_context`` fix the KV cache
size up front, as an engine does.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields, replace
from typing import Any

import torch

from graphguard.errors import ConfigError


@dataclass(frozen=True)
class RopeScaling:
    """Llama-3 frequency-dependent RoPE scaling (HF ``rope_type: "llama3"``).

    Why it is modelled at all: Llama-3.1/3.2 checkpoints were trained with it, so a
    model loaded with :meth:`LlamaDecodeModel.from_pretrained` is only correct with it.
    """

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position: int


@dataclass(frozen=True)
class LlamaConfig:
    """Shapes of a Llama-style decoder plus the engine's static limits.

    ``max_batch`` is the number of live sequence slots in the KV cache (one more,
    the scratch slot, is allocated for padded rows); ``max_context`` the number of
    positions per slot. Both fix the cache size up front, as an engine does.
    """

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float = 500_000.0
    rms_norm_eps: float = 1e-5
    tie_word_embeddings: bool = True
    rope_scaling: RopeScaling | None = None
    max_batch: int = 8
    max_context: int = 1024
    decode_sdpa: str = "cudnn"
    """Decode attention kernels: ``"cudnn"`` (SDPA's cuDNN kernel allowed, the fastest
    at decode shapes; a plan per new batch size, built by the warmups before capture) or
    ``"planless"`` (memory-efficient/flash/math only: no per-shape setup)."""

    def __post_init__(self) -> None:
        if self.decode_sdpa not in ("cudnn", "planless"):
            raise ConfigError(
                f"LlamaConfig.decode_sdpa must be 'cudnn' or 'planless', got {self.decode_sdpa!r}"
            )
        for f in fields(self):
            value = getattr(self, f.name)
            if f.type == "int" and (not isinstance(value, int) or value <= 0):
                raise ConfigError(f"LlamaConfig.{f.name} must be a positive int, got {value!r}")
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(
                f"LlamaConfig: num_heads ({self.num_heads}) must be a multiple of "
                f"num_kv_heads ({self.num_kv_heads}) for grouped-query attention"
            )
        if self.head_dim % 2:
            raise ConfigError(f"LlamaConfig.head_dim must be even for RoPE, got {self.head_dim}")
        if self.rope_theta <= 0 or self.rms_norm_eps <= 0:
            raise ConfigError("LlamaConfig: rope_theta and rms_norm_eps must be positive")

    @property
    def scratch_slot(self) -> int:
        """KV-cache slot index that padded rows use (``max_batch``); never a live sequence."""
        return self.max_batch

    @property
    def q_size(self) -> int:
        """Width of the query projection (``num_heads * head_dim``)."""
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        """Width of the key (and of the value) projection (``num_kv_heads * head_dim``)."""
        return self.num_kv_heads * self.head_dim

    @property
    def num_params(self) -> int:
        """Number of weight elements (tied embeddings counted once)."""
        d, i = self.hidden_size, self.intermediate_size
        per_layer = d * (self.q_size + 2 * self.kv_size) + self.q_size * d + 3 * d * i + 2 * d
        head = 0 if self.tie_word_embeddings else self.vocab_size * d
        return self.vocab_size * d + self.num_layers * per_layer + d + head

    def kv_cache_bytes(self, itemsize: int) -> int:
        """Bytes of the static KV cache (K and V, every layer, ``max_batch`` slots + scratch).

        What decides whether a ``max_batch`` x ``max_context`` fits, before anything is
        allocated (the demo refuses a model that cannot fit with this).
        """
        slots = self.max_batch + 1
        return (
            2
            * self.num_layers
            * slots
            * self.num_kv_heads
            * self.max_context
            * self.head_dim
            * itemsize
        )

    @classmethod
    def preset(cls, name: str, **overrides: Any) -> LlamaConfig:
        """A named configuration (see :data:`PRESETS`), with fields overridden by keyword.

        ``LlamaConfig.preset("llama-1b", max_batch=64)`` is the usual way to size the
        cache for an engine.
        """
        try:
            base = PRESETS[name]
        except KeyError:
            raise ConfigError(
                f"unknown Llama preset {name!r}; choose one of {', '.join(sorted(PRESETS))}"
            ) from None
        return replace(base, **overrides) if overrides else base

    @classmethod
    def from_hf_config(
        cls,
        hf: Mapping[str, Any],
        *,
        max_batch: int = 8,
        max_context: int | None = None,
    ) -> LlamaConfig:
        """Translate a Hugging Face ``config.json`` dict of a Llama model.

        ``max_context`` defaults to ``min(1024, max_position_embeddings)``: the cache is
        allocated for all of it, so the full trained context is rarely what a demo
        wants. Raises ``ConfigError`` for features this reference model does not
        implement (biases, other activations or RoPE types) instead of silently
        computing something else.
        """
        model_type = hf.get("model_type", "llama")
        if model_type != "llama":
            raise ConfigError(
                f"config.json has model_type {model_type!r}; only Llama-architecture "
                "checkpoints are supported"
            )
        if hf.get("attention_bias", False) or hf.get("mlp_bias", False):
            raise ConfigError("config.json asks for projection biases; not supported")
        act = hf.get("hidden_act", "silu")
        if act != "silu":
            raise ConfigError(f"config.json hidden_act is {act!r}; only 'silu' is supported")
        heads = int(hf["num_attention_heads"])
        hidden = int(hf["hidden_size"])
        # transformers>=5 moves rope settings into "rope_parameters".
        rope = dict(hf.get("rope_parameters") or {})
        rope_theta = float(rope.get("rope_theta", hf.get("rope_theta", 10_000.0)))
        scaling_dict = hf.get("rope_scaling") or rope
        rope_type = scaling_dict.get("rope_type", scaling_dict.get("type", "default"))
        scaling: RopeScaling | None
        if rope_type in (None, "default"):
            scaling = None
        elif rope_type == "llama3":
            scaling = RopeScaling(
                factor=float(scaling_dict["factor"]),
                low_freq_factor=float(scaling_dict["low_freq_factor"]),
                high_freq_factor=float(scaling_dict["high_freq_factor"]),
                original_max_position=int(scaling_dict["original_max_position_embeddings"]),
            )
        else:
            raise ConfigError(
                f"config.json RoPE type {rope_type!r} is not supported (only default, llama3)"
            )
        trained_context = int(hf.get("max_position_embeddings", 1024))
        return cls(
            vocab_size=int(hf["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(hf["intermediate_size"]),
            num_layers=int(hf["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=int(hf.get("num_key_value_heads") or heads),
            head_dim=int(hf.get("head_dim") or hidden // heads),
            rope_theta=rope_theta,
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            rope_scaling=scaling,
            max_batch=max_batch,
            max_context=max_context if max_context is not None else min(1024, trained_context),
        )


PRESETS: dict[str, LlamaConfig] = {
    # Runs on a CPU in milliseconds; untied head so the loader's lm_head path is exercised.
    "tiny": LlamaConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        rope_theta=10_000.0,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        max_batch=4,
        max_context=64,
    ),
    # The shapes of meta-llama/Llama-3.2-1B (1.24 B parameters, tied embeddings).
    "llama-1b": LlamaConfig(
        vocab_size=128_256,
        hidden_size=2048,
        intermediate_size=8192,
        num_layers=16,
        num_heads=32,
        num_kv_heads=8,
        head_dim=64,
        rope_theta=500_000.0,
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,
        rope_scaling=RopeScaling(
            factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position=8192
        ),
        max_batch=256,
        max_context=1024,
    ),
}
"""Named configurations for :meth:`LlamaConfig.preset`."""


def dtype_from_hf(hf_config: Mapping[str, Any]) -> torch.dtype:
    """``torch_dtype`` (or transformers>=5 ``dtype``) of a config.json, else float32."""
    name = hf_config.get("torch_dtype") or hf_config.get("dtype") or "float32"
    dtype = getattr(torch, str(name).removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise ConfigError(f"config.json torch_dtype {name!r} is not a torch dtype")
    return dtype


__all__ = ["PRESETS", "LlamaConfig", "RopeScaling", "dtype_from_hf"]
