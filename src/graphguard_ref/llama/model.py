"""A Llama-style decode model with a static KV cache, written the way an engine writes one.

Why this exists: graphguard has to be shown, tested and benchmarked against a decode
step that looks like production code — hundreds of small kernels, a KV cache written
in place, a shared scratch arena whose size grows with the batch, and a side branch on
an auxiliary stream — not against a toy callable. Everything here is CUDA-graph
capturable: no host synchronisation, no ``.item()``, no data-dependent shapes and no
Python branching on tensor values, so the same code runs eagerly, inside a full CUDA
graph, and under ``torch.compile`` split at the attention op (piecewise graphs).

Layout decisions, and why:

* **KV cache**: per layer ``k_cache``/``v_cache`` of shape
  ``[max_batch + 1, max_context, n_kv_heads, head_dim]``, allocated once (zeros, so
  masked-out positions can never inject NaN through ``0 * garbage``). Slot index
  ``max_batch`` is a *scratch slot*: padded rows of a batch point there, so padding
  never writes into a live sequence — padding is made harmless at the lowest level
  instead of by special cases in Python.
* **Attention**: gather the rows' slots (``index_select`` → ``[B, ctx, kvh, hd]``), then
  one ``scaled_dot_product_attention`` with an additive mask ``pos <= position``.
  Grouped-query attention without ``repeat_interleave`` or ``enable_gqa``: with one
  query token per row, the ``group`` query heads that share a KV head are laid out as
  the *query-length* axis (``q.view(B, kvh, group, hd)``), which is exactly GQA and
  works on every torch version. It is a ``torch.library`` custom op so
  ``torch.compile`` treats it as an opaque split point.
* **Fused projections**: q/k/v and gate/up are stored concatenated (one GEMM each);
  residual adds ride in the GEMM epilogue (``addmm``). Fewer launches matters most
  in eager mode, where the CPU is the bottleneck.
* **Workspace arena** (:class:`graphguard.workspace.Workspace`): the MLP intermediates
  (``[B, 2*I]`` gate/up and ``[B, I]`` activation) and the attention mask
  (``[B, ctx]``) are views into one arena, reused by every layer. Its size scales with
  the batch, so the arena must be warmed at the largest batch before capture
  (:meth:`LlamaDecodeModel.warm_kernels`), which is precisely seed ``002``.
* **Auxiliary stream** (:class:`graphguard.streams.AuxStream`): the RoPE cos/sin
  gather and the attention mask depend only on ``positions``, so they run on a side
  stream while the main stream does the embedding lookup and the first RMSNorm —
  a real fork/join like the one of seed ``000``.
* **Mixed prefill+decode step** (:meth:`LlamaDecodeModel.mixed_step`): one row per
  *token* with its own ``(slot, position)``, so prefill chunks, decodes and
  speculative verifies (``1 + k`` tokens per request) share one batch with ragged
  query lengths and no per-request metadata. Its attention is the custom op
  ``graphguard_ref::mixed_attention`` (writes the step's K/V, then attends causally per
  token), the split point of PIECEWISE graphs; the rest is plain out-of-place torch
  that ``torch.compile`` traces whole. :meth:`~LlamaDecodeModel.decode_step` is untouched.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from graphguard.streams import AuxStream
from graphguard.workspace import Workspace

# --------------------------------------------------------------------------- config


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

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if f.type == "int" and (not isinstance(value, int) or value <= 0):
                raise ValueError(f"LlamaConfig.{f.name} must be a positive int, got {value!r}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"LlamaConfig: num_heads ({self.num_heads}) must be a multiple of "
                f"num_kv_heads ({self.num_kv_heads}) for grouped-query attention"
            )
        if self.head_dim % 2:
            raise ValueError(f"LlamaConfig.head_dim must be even for RoPE, got {self.head_dim}")
        if self.rope_theta <= 0 or self.rms_norm_eps <= 0:
            raise ValueError("LlamaConfig: rope_theta and rms_norm_eps must be positive")

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

    @classmethod
    def preset(cls, name: str, **overrides: Any) -> LlamaConfig:
        """A named configuration (see :data:`PRESETS`), with fields overridden by keyword.

        ``LlamaConfig.preset("llama-1b", max_batch=64)`` is the usual way to size the
        cache for an engine.
        """
        try:
            base = PRESETS[name]
        except KeyError:
            raise ValueError(
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
        wants. Raises ``ValueError`` for features this reference model does not
        implement (biases, other activations or RoPE types) instead of silently
        computing something else.
        """
        model_type = hf.get("model_type", "llama")
        if model_type != "llama":
            raise ValueError(
                f"config.json has model_type {model_type!r}; only Llama-architecture "
                "checkpoints are supported"
            )
        if hf.get("attention_bias", False) or hf.get("mlp_bias", False):
            raise ValueError("config.json asks for projection biases; not supported")
        act = hf.get("hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"config.json hidden_act is {act!r}; only 'silu' is supported")
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
            raise ValueError(
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


# --------------------------------------------------------------------------- attention


def _sdpa_backends() -> contextlib.AbstractContextManager[Any]:
    """Memory-efficient, flash or math SDPA -- never cuDNN for this attention.

    cuDNN attention builds an execution plan for every new shape: 54 ms per new batch
    size on the H200 (``bench/probe_first_run.py``) against 0.2 ms once warm, which made
    capturing the 35-size ladder cost ~3 s cold. The memory-efficient kernel is as fast
    at these decode shapes (0.1-0.2 ms) and needs no per-shape plan.
    """
    if _SDPA_CHOICE is None:  # torch < 2.3: the default choice
        return contextlib.nullcontext()
    kernel, backends = _SDPA_CHOICE
    return cast(contextlib.AbstractContextManager[Any], kernel(backends))


try:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    _SDPA_CHOICE: tuple[Any, list[Any]] | None = (
        sdpa_kernel,
        [SDPBackend.EFFICIENT_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.MATH],
    )
except ImportError:
    _SDPA_CHOICE = None


def _decode_attention_impl(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    slots: Tensor,
    positions: Tensor,
    mask: Tensor | None,
) -> Tensor:
    batch, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    if mask is None:
        mask = causal_decode_mask(positions, k_cache.shape[1], q.dtype)
    # [B, ctx, kvh, hd] -> [B, kvh, ctx, hd]: a strided view, no second copy.
    k = k_cache.index_select(0, slots).transpose(1, 2)
    v = v_cache.index_select(0, slots).transpose(1, 2)
    # GQA as [B, kvh, group, hd]: the group's query heads play the query-length axis.
    qg = q.reshape(batch, num_kv_heads, num_heads // num_kv_heads, head_dim)
    with _sdpa_backends() if q.is_cuda else contextlib.nullcontext():
        out = F.scaled_dot_product_attention(qg, k, v, attn_mask=mask)
    # Some SDPA backends return a transposed layout; reshape copies only then, and
    # .contiguous() (a no-op otherwise) keeps real strides equal to the fake kernel's.
    return out.reshape(batch, num_heads, head_dim).contiguous()


def _decode_attention_fake(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    slots: Tensor,
    positions: Tensor,
    mask: Tensor | None,
) -> Tensor:
    return q.new_empty(q.shape)


_OP_NAME = "graphguard_ref::decode_attention"
_OP_SCHEMA = (
    "(Tensor q, Tensor k_cache, Tensor v_cache, Tensor slots, Tensor positions, "
    "Tensor? mask) -> Tensor"
)


def _register_attention_op() -> Callable[..., Tensor]:
    """Register the custom op once per process (torch>=2.4), else use the plain function.

    Re-importing this module (``importlib.reload``, two copies on ``sys.path``) must not
    fail on a duplicate registration, so an existing op of the same name is reused.
    """
    custom_op = getattr(torch.library, "custom_op", None)
    if custom_op is None:
        return _decode_attention_impl
    namespace, name = _OP_NAME.split("::")
    try:
        existing = getattr(getattr(torch.ops, namespace), name)
    except (AttributeError, RuntimeError):
        existing = None
    if existing is not None:
        return cast(Callable[..., Tensor], existing.default)
    op = custom_op(_OP_NAME, _decode_attention_impl, mutates_args=(), schema=_OP_SCHEMA)
    op.register_fake(_decode_attention_fake)
    return cast(Callable[..., Tensor], op)


_attention_op = _register_attention_op()


def attention(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    slots: Tensor,
    positions: Tensor,
    mask: Tensor | None = None,
) -> Tensor:
    """Decode attention of one new token per row over its slot's cache, positions 0..p.

    Args:
        q: ``[B, num_heads, head_dim]`` queries (RoPE applied).
        k_cache, v_cache: ``[slots, max_context, num_kv_heads, head_dim]``; this step's
            key/value must already be written at ``[slots[b], positions[b]]``.
        slots, positions: ``[B]`` int64; row ``b`` attends to
            ``cache[slots[b], 0..positions[b]]`` inclusive.
        mask: optional precomputed additive mask from :func:`causal_decode_mask`
            (the model builds it once per step instead of once per layer).

    Returns a new ``[B, num_heads, head_dim]`` tensor in ``q``'s dtype. Registered as
    the custom op ``graphguard_ref::decode_attention`` (no mutation, fake kernel for
    tracing) so ``torch.compile`` can split the graph here.
    """
    return _attention_op(q, k_cache, v_cache, slots, positions, mask)


def causal_decode_mask(positions: Tensor, max_context: int, dtype: torch.dtype) -> Tensor:
    """Additive ``[B, 1, 1, max_context]`` mask: 0 where ``pos <= positions[b]``, else -inf.

    Additive in the model dtype rather than boolean because SDPA's fused kernels take
    it as is; a boolean mask would be converted (a kernel and an allocation) per layer.
    Every row keeps position 0, so no row is ever fully masked (no NaN).
    """
    ctx = torch.arange(max_context, device=positions.device)
    drop = ctx > positions.view(-1, 1, 1, 1)
    mask = torch.zeros(drop.shape, dtype=dtype, device=positions.device)
    return mask.masked_fill_(drop, float("-inf"))


# --------------------------------------------------------------------------- mixed attention


def _mixed_attention_impl(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    slots: Tensor,
    positions: Tensor,
    mask: Tensor,
) -> Tensor:
    # Write every token's key/value first, so a prefill chunk's later tokens see its
    # earlier ones (causality comes from the per-token mask, not from write order).
    k_cache.index_put_((slots, positions), k)
    v_cache.index_put_((slots, positions), v)
    return _decode_attention_impl(q, k_cache, v_cache, slots, positions, mask)


def _mixed_attention_fake(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    slots: Tensor,
    positions: Tensor,
    mask: Tensor,
) -> Tensor:
    return q.new_empty(q.shape)


MIXED_ATTENTION_OP = "graphguard_ref::mixed_attention"
"""Qualified name of the mixed-batch attention op: the split op of PIECEWISE graphs."""

_MIXED_OP_SCHEMA = (
    "(Tensor q, Tensor k, Tensor v, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor slots, "
    "Tensor positions, Tensor mask) -> Tensor"
)


def _register_mixed_attention_op() -> Callable[..., Tensor]:
    """Register ``graphguard_ref::mixed_attention`` once per process (reused on reload)."""
    custom_op = getattr(torch.library, "custom_op", None)
    if custom_op is None:
        return _mixed_attention_impl
    namespace, name = MIXED_ATTENTION_OP.split("::")
    try:
        existing = getattr(getattr(torch.ops, namespace), name)
    except (AttributeError, RuntimeError):
        existing = None
    if existing is not None:
        return cast(Callable[..., Tensor], existing.default)
    op = custom_op(
        MIXED_ATTENTION_OP,
        _mixed_attention_impl,
        mutates_args=("k_cache", "v_cache"),
        schema=_MIXED_OP_SCHEMA,
    )
    op.register_fake(_mixed_attention_fake)
    return cast(Callable[..., Tensor], op)


_mixed_attention_op = _register_mixed_attention_op()


def mixed_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    slots: Tensor,
    positions: Tensor,
    mask: Tensor,
) -> Tensor:
    """Attention of a mixed batch: write each token's K/V, then attend causally per token.

    One row per *token*, not per request: token ``t`` belongs to the sequence in KV
    slot ``slots[t]`` at position ``positions[t]``. Its key/value are written at
    ``cache[slots[t], positions[t]]`` and it attends to ``cache[slots[t], 0..positions[t]]``
    inclusive. A request's prefill chunk is simply consecutive tokens with the same slot
    and consecutive positions, so ragged query lengths (prefill chunks, decodes,
    speculative verifies of ``1 + k`` tokens) need no per-request metadata: the slot
    id per token *is* the sequence id, and the causal mask per token does the rest.

    Args:
        q: ``[T, num_heads, head_dim]`` queries (RoPE applied).
        k, v: ``[T, num_kv_heads, head_dim]`` this step's keys (RoPE applied) and values.
        k_cache, v_cache: ``[slots, max_context, num_kv_heads, head_dim]``; written in place.
        slots, positions: ``[T]`` int64. Live tokens have distinct ``(slot, position)``
            pairs; padded tokens all use ``(scratch slot, 0)``.
        mask: the additive ``[T, 1, 1, max_context]`` mask of :func:`causal_decode_mask`.

    Returns a new ``[T, num_heads, head_dim]`` tensor. Registered as the custom op
    ``graphguard_ref::mixed_attention`` (mutates the caches; fake kernel for tracing):
    the split point of PIECEWISE graphs. It is capturable too (no host sync, fixed
    shapes), so a FULL graph may contain it. Reference-model simplicity over speed: each
    token gathers its slot's whole cache (``O(T * max_context)`` memory), as
    :func:`attention` does per row.
    """
    return _mixed_attention_op(q, k, v, k_cache, v_cache, slots, positions, mask)


# --------------------------------------------------------------------------- building blocks


_rms_norm_fn = getattr(F, "rms_norm", None)


def _is_compiling() -> bool:
    """True while torch.compile traces (constant-folded by Dynamo, free in eager)."""
    return bool(torch.compiler.is_compiling())


def _rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """RMSNorm with HF Llama numerics (normalise in fp32, scale in the model dtype)."""
    if _rms_norm_fn is not None:
        return cast(Tensor, _rms_norm_fn(x, (x.shape[-1],), weight, eps))
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def _apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """HF "rotate_half" RoPE: ``x*cos + rotate_half(x)*sin`` (cos/sin broadcast over heads)."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return torch.addcmul(x * cos, rotated, sin)


def rope_inv_freq(config: LlamaConfig) -> Tensor:
    """The float32 RoPE inverse frequencies, Llama-3 scaling applied when configured."""
    hd = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, hd, 2, dtype=torch.int64).float() / hd))
    s = config.rope_scaling
    if s is None:
        return inv_freq
    low_freq_wavelen = s.original_max_position / s.low_freq_factor
    high_freq_wavelen = s.original_max_position / s.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / s.factor, inv_freq)
    smooth = (s.original_max_position / wavelen - s.low_freq_factor) / (
        s.high_freq_factor - s.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled
    medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(medium, smoothed, scaled)


def _weight(shape: tuple[int, ...], device: torch.device, dtype: torch.dtype) -> nn.Parameter:
    # Inference only: no autograd graph, so decode_step needs no no_grad/inference_mode
    # (which would otherwise break torch.compile traces and graph capture symmetry).
    return nn.Parameter(torch.empty(shape, device=device, dtype=dtype), requires_grad=False)


class LlamaDecoderLayer(nn.Module):
    """One decoder layer's fused weights and its static KV cache."""

    k_cache: Tensor
    v_cache: Tensor

    def __init__(self, config: LlamaConfig, device: torch.device, dtype: torch.dtype) -> None:
        super().__init__()
        d, i = config.hidden_size, config.intermediate_size
        self.input_norm = _weight((d,), device, dtype)
        self.qkv_weight = _weight((config.q_size + 2 * config.kv_size, d), device, dtype)
        self.o_weight = _weight((d, config.q_size), device, dtype)
        self.post_norm = _weight((d,), device, dtype)
        self.gate_up_weight = _weight((2 * i, d), device, dtype)
        self.down_weight = _weight((d, i), device, dtype)
        cache_shape = (
            config.max_batch + 1,
            config.max_context,
            config.num_kv_heads,
            config.head_dim,
        )
        # Not persistent: the cache is runtime state, not part of a checkpoint.
        self.register_buffer(
            "k_cache", torch.zeros(cache_shape, device=device, dtype=dtype), persistent=False
        )
        self.register_buffer(
            "v_cache", torch.zeros(cache_shape, device=device, dtype=dtype), persistent=False
        )


# --------------------------------------------------------------------------- model


class LlamaDecodeModel(nn.Module):
    """Llama-style decoder that decodes one token per row against a static KV cache.

    Args:
        config: shapes and static limits.
        device, dtype: where and in which precision weights, cache and activations live.
        seed: seeds the random weights (std 0.02, norms 1, as HF initialises Llama).
            ``None`` leaves the weights uninitialised: only for loaders that
            overwrite every weight immediately (:meth:`from_pretrained`).
        overlap: run the RoPE/mask branch on an auxiliary stream (CUDA only; it still
            runs inline whenever ``graphguard.phase.overlap_allowed()`` is false).
        workspace: the scratch arena to draw per-step buffers from; pass the runner's
            arena to share one, else the model creates its own (:attr:`workspace`).

    Random weights are generated on ``device`` by a device generator, so the same seed
    gives the same weights on the same device type (CPU and CUDA weights differ).
    """

    def __init__(
        self,
        config: LlamaConfig,
        *,
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,
        seed: int | None = 0,
        overlap: bool = True,
        workspace: Workspace | None = None,
    ) -> None:
        super().__init__()
        dev = torch.device(device)
        if dev.type == "cuda" and dev.index is None:
            dev = torch.device("cuda", torch.cuda.current_device())
        self.config = config
        self.device = dev
        self.dtype = dtype
        self.overlap = overlap
        d = config.hidden_size
        self.embed_tokens = _weight((config.vocab_size, d), dev, dtype)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, dev, dtype) for _ in range(config.num_layers)
        )
        self.norm = _weight((d,), dev, dtype)
        self.lm_head = (
            self.embed_tokens
            if config.tie_word_embeddings
            else _weight((config.vocab_size, d), dev, dtype)
        )
        # RoPE table for every position of the context, gathered by position per step.
        freqs = torch.outer(
            torch.arange(config.max_context, dtype=torch.float32), rope_inv_freq(config)
        )
        angles = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("rope_cos", angles.cos().to(dev, dtype), persistent=False)
        self.register_buffer("rope_sin", angles.sin().to(dev, dtype), persistent=False)
        self.register_buffer(
            "_ctx_range",
            torch.arange(config.max_context, device=dev).view(1, 1, 1, -1),
            persistent=False,
        )
        self.register_buffer("_mask_keep", torch.zeros((), device=dev, dtype=dtype), False)
        self.register_buffer(
            "_mask_drop", torch.full((), float("-inf"), device=dev, dtype=dtype), False
        )
        self.workspace = workspace if workspace is not None else Workspace("llama.decode", dev)
        self.aux_stream = AuxStream("llama.rope_mask", dev)
        if seed is not None:
            self._init_random(seed)

    rope_cos: Tensor
    rope_sin: Tensor
    _ctx_range: Tensor
    _mask_keep: Tensor
    _mask_drop: Tensor

    # ------------------------------------------------------------------ construction

    @classmethod
    def random(
        cls,
        config: LlamaConfig,
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,
        seed: int = 0,
        *,
        overlap: bool = True,
        workspace: Workspace | None = None,
    ) -> LlamaDecodeModel:
        """Seeded random weights made directly on ``device`` (no host copy of 1.2 B params)."""
        return cls(
            config, device=device, dtype=dtype, seed=seed, overlap=overlap, workspace=workspace
        )

    @torch.no_grad()
    def _init_random(self, seed: int) -> None:
        """std-0.02 matrices and unit norms: activations and logits stay non-degenerate."""
        gen = torch.Generator(device=self.device)
        gen.manual_seed(seed)
        for p in self.parameters():  # a tied head is listed once
            if p.dim() == 1:
                p.fill_(1.0)
            else:
                p.normal_(0.0, 0.02, generator=gen)

    @classmethod
    def from_pretrained(
        cls,
        path: str | os.PathLike[str],
        config: LlamaConfig | None = None,
        *,
        device: torch.device | str = "cpu",
        dtype: torch.dtype | None = None,
        max_batch: int | None = None,
        max_context: int | None = None,
        overlap: bool = True,
        workspace: Workspace | None = None,
    ) -> LlamaDecodeModel:
        """Load a local Hugging Face-format Llama directory (``config.json`` + ``*.safetensors``).

        Never downloads: ``path`` must be a directory on disk. ``config`` defaults to
        the one in ``config.json``; ``max_batch``/``max_context`` override the cache
        limits; ``dtype`` defaults to ``config.json``'s ``torch_dtype`` (else float32).
        Tensors stream file by file into the preallocated weights, so peak host memory
        is one tensor, not the checkpoint. Every shape is validated (errors name the
        tensor), every expected tensor must be present and unknown ones are refused.
        """
        try:
            from safetensors import safe_open
        except ImportError as exc:  # pragma: no cover - depends on the environment
            raise ImportError(
                "LlamaDecodeModel.from_pretrained reads *.safetensors files and needs the "
                "'safetensors' package: pip install 'graphguard[hf]'"
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
            dtype = _dtype_from_hf(hf_config)
        files = sorted(directory.glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(f"no *.safetensors files in {directory}")
        model = cls(
            config, device=device, dtype=dtype, seed=None, overlap=overlap, workspace=workspace
        )

        def tensors() -> Iterator[tuple[str, Tensor]]:
            for file in files:
                with safe_open(str(file), framework="pt", device="cpu") as handle:
                    for key in handle.keys():  # noqa: SIM118 - safe_open is not a dict
                        yield key, handle.get_tensor(key)

        model.load_hf_weights(tensors())
        return model

    def hf_weight_views(self) -> dict[str, Tensor]:
        """Every weight under its Hugging Face name, as a view into the fused parameters.

        Why views: the loader copies each checkpoint tensor straight into its slice of
        the fused q/k/v and gate/up matrices, and an exporter can read them without a
        copy. ``lm_head.weight`` is absent when embeddings are tied (as HF saves it).
        Clone before saving with ``safetensors`` (the views share storage).
        """
        cfg = self.config
        q, kv, i = cfg.q_size, cfg.kv_size, cfg.intermediate_size
        views: dict[str, Tensor] = {"model.embed_tokens.weight": self.embed_tokens.detach()}
        for n, module in enumerate(self.layers):
            layer = cast(LlamaDecoderLayer, module)
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
        views["model.norm.weight"] = self.norm.detach()
        if not cfg.tie_word_embeddings:
            views["lm_head.weight"] = self.lm_head.detach()
        return views

    @torch.no_grad()
    def load_hf_weights(self, tensors: Mapping[str, Tensor] | Iterator[tuple[str, Tensor]]) -> None:
        """Copy Hugging Face-named tensors into the model (casting to its device and dtype).

        Raises ``ValueError`` naming the tensor on a shape mismatch, listing every
        unknown name, and listing every weight the checkpoint did not provide.
        ``lm_head.weight`` in a checkpoint with tied embeddings is ignored (the head is
        the embedding), as are RoPE ``inv_freq`` buffers some exports include.
        """
        targets = self.hf_weight_views()
        items = tensors.items() if isinstance(tensors, Mapping) else tensors
        loaded: set[str] = set()
        unexpected: list[str] = []
        for name, tensor in items:
            target = targets.get(name)
            if target is None:
                tied_head = name == "lm_head.weight" and self.config.tie_word_embeddings
                if not tied_head and not name.endswith("rotary_emb.inv_freq"):
                    unexpected.append(name)
                continue
            if tuple(tensor.shape) != tuple(target.shape):
                raise ValueError(
                    f"checkpoint tensor {name!r} has shape {tuple(tensor.shape)}, but the "
                    f"config expects {tuple(target.shape)}; does config.json match the weights?"
                )
            target.copy_(tensor)
            loaded.add(name)
        if unexpected:
            raise ValueError(
                f"checkpoint has {len(unexpected)} tensor(s) this Llama model does not know: "
                f"{', '.join(sorted(unexpected)[:10])}" + (" ..." if len(unexpected) > 10 else "")
            )
        missing = sorted(set(targets) - loaded)
        if missing:
            raise ValueError(
                f"checkpoint lacks {len(missing)} weight(s): {', '.join(missing[:10])}"
                + (" ..." if len(missing) > 10 else "")
            )

    # ------------------------------------------------------------------ decode

    @property
    def scratch_slot(self) -> int:
        """The KV-cache slot padded rows use (``config.max_batch``)."""
        return self.config.max_batch

    def forward(self, token_ids: Tensor, positions: Tensor, slots: Tensor) -> Tensor:
        """Same as :meth:`decode_step`."""
        return self.decode_step(token_ids, positions, slots)

    def decode_step(self, token_ids: Tensor, positions: Tensor, slots: Tensor) -> Tensor:
        """Decode one token per row and return its logits ``[B, vocab]`` in the model dtype.

        Row ``b`` feeds ``token_ids[b]`` at ``positions[b]`` of the sequence in KV slot
        ``slots[b]``: its key/value are written at ``cache[slots[b], positions[b]]`` and
        it attends to ``cache[slots[b], 0..positions[b]]``. All inputs are ``[B]`` int64
        on the model's device.

        Caller guarantees: live rows have distinct slots ``< max_batch`` and
        ``positions < max_context`` (out-of-range indices are a device-side assert, not
        a host check, because a check would synchronise). Padded rows use
        :meth:`pad_fill_values` (scratch slot), which may be shared by any number of
        rows. Graph-capturable: no host sync, no value-dependent shapes or branches;
        per-step scratch (MLP intermediates, mask) comes from :attr:`workspace`, so the
        arena must already be large enough for ``B`` when this runs inside a capture.
        Under ``torch.compile`` the auxiliary branch runs inline, and the arena must
        already be warm (its growth is host code that Dynamo does not trace).
        """
        cfg = self.config
        batch = token_ids.shape[0]
        inter = cfg.intermediate_size
        dtype = self.dtype
        gate_up, act, mask = self.workspace.get(
            ((batch, 2 * inter), dtype),
            ((batch, inter), dtype),
            ((batch, 1, 1, cfg.max_context), dtype),
        )
        layers = [cast(LlamaDecoderLayer, m) for m in self.layers]
        h, x, cos, sin = self._prologue(token_ids, positions, mask, layers[0])

        q_heads, kv_heads, hd = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        qk_width = cfg.q_size + cfg.kv_size
        gate, up = gate_up[:, :inter], gate_up[:, inter:]
        for n, layer in enumerate(layers):
            if n:
                x = _rms_norm(h, layer.input_norm, cfg.rms_norm_eps)
            qkv = F.linear(x, layer.qkv_weight)
            # RoPE once over q and k heads together (one set of kernels, not two).
            qk = _apply_rope(qkv[:, :qk_width].view(batch, q_heads + kv_heads, hd), cos, sin)
            k = qk[:, q_heads:]
            v = qkv[:, qk_width:].view(batch, kv_heads, hd)
            layer.k_cache.index_put_((slots, positions), k)
            layer.v_cache.index_put_((slots, positions), v)
            out = attention(qk[:, :q_heads], layer.k_cache, layer.v_cache, slots, positions, mask)
            h = torch.addmm(h, out.reshape(batch, cfg.q_size), layer.o_weight.t())
            x = _rms_norm(h, layer.post_norm, cfg.rms_norm_eps)
            torch.mm(x, layer.gate_up_weight.t(), out=gate_up)
            torch.ops.aten.silu.out(gate, out=act)
            act.mul_(up)
            h = torch.addmm(h, act, layer.down_weight.t())
        return F.linear(_rms_norm(h, self.norm, cfg.rms_norm_eps), self.lm_head)

    def _positional(self, positions: Tensor, mask: Tensor) -> tuple[Tensor, Tensor]:
        """RoPE cos/sin rows ``[B, 1, hd]`` and the additive mask (into ``mask``) of a step.

        Depends only on ``positions`` and is shared by every layer, which is why it is
        the auxiliary-stream branch of :meth:`decode_step`.
        """
        cos = self.rope_cos.index_select(0, positions).unsqueeze(1)
        sin = self.rope_sin.index_select(0, positions).unsqueeze(1)
        keep = self._ctx_range <= positions.view(-1, 1, 1, 1)
        torch.where(keep, self._mask_keep, self._mask_drop, out=mask)
        return cos, sin

    def mixed_step(self, token_ids: Tensor, positions: Tensor, slots: Tensor) -> Tensor:
        """Run one engine step over ``T`` tokens of any mix of requests; logits ``[T, vocab]``.

        Token ``t`` feeds ``token_ids[t]`` at ``positions[t]`` of the sequence in KV slot
        ``slots[t]`` (all ``[T]`` int64 on the model's device). A batch is any
        concatenation of per-request runs of consecutive positions:

        * a prefill chunk: ``L`` tokens, positions ``p..p+L-1`` of one slot;
        * a decode: one token at position ``p`` (uniform decode: every request so);
        * a speculative verify: ``1 + k`` tokens (the last accepted token and ``k``
          drafts) at ``p..p+k``; row ``i``'s logits score the token after position
          ``p+i``, so one step verifies every draft.

        Every token writes its key/value at ``cache[slots[t], positions[t]]`` and attends
        to ``cache[slots[t], 0..positions[t]]``, so tokens of one request attend to the
        request's earlier tokens in the same batch (written in the same step) and to its
        cached past. Order of the requests in the batch does not matter.

        **Logits for every token** (``[T, vocab]``), not only each request's last: a
        verify step needs all ``1 + k`` rows, and per-token outputs keep every tensor of
        the step on the token dimension, which is what padding to a captured size and
        trimming back rely on. A caller that only samples the last token of a prefill
        chunk picks its rows (the extra head GEMM rows are the price of simplicity).

        Attention is :func:`mixed_attention` (custom op ``graphguard_ref::mixed_attention``,
        :data:`MIXED_ATTENTION_OP`), the split point of PIECEWISE graphs; everything else
        is plain out-of-place torch (no workspace arena, no auxiliary stream, no ``out=``)
        so ``torch.compile`` traces it whole with a dynamic token dimension. The step is
        also capturable as one FULL graph. Padded tokens take :meth:`pad_fill_values`
        (token 0, position 0, the scratch slot): they write only the scratch slot and
        attend only to it, so they cannot change a live sequence or a live row.

        Caller guarantees: live tokens have slots ``< max_batch``, positions
        ``< max_context``, distinct ``(slot, position)`` pairs, and each request's
        positions ``0..p-1`` already cached. :meth:`decode_step` is unchanged and remains
        the one-token-per-row step with the workspace arena and the auxiliary stream.
        """
        cfg = self.config
        num_tokens = token_ids.shape[0]
        q_heads, kv_heads, hd = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        qk_width = cfg.q_size + cfg.kv_size
        inter = cfg.intermediate_size
        cos = self.rope_cos.index_select(0, positions).unsqueeze(1)
        sin = self.rope_sin.index_select(0, positions).unsqueeze(1)
        keep = self._ctx_range <= positions.view(-1, 1, 1, 1)
        mask = torch.where(keep, self._mask_keep, self._mask_drop)
        h = F.embedding(token_ids, self.embed_tokens)
        for module in self.layers:
            layer = cast(LlamaDecoderLayer, module)
            x = _rms_norm(h, layer.input_norm, cfg.rms_norm_eps)
            qkv = F.linear(x, layer.qkv_weight)
            qk = _apply_rope(qkv[:, :qk_width].view(num_tokens, q_heads + kv_heads, hd), cos, sin)
            v = qkv[:, qk_width:].view(num_tokens, kv_heads, hd)
            out = mixed_attention(
                qk[:, :q_heads],
                qk[:, q_heads:],
                v,
                layer.k_cache,
                layer.v_cache,
                slots,
                positions,
                mask,
            )
            h = torch.addmm(h, out.reshape(num_tokens, cfg.q_size), layer.o_weight.t())
            x = _rms_norm(h, layer.post_norm, cfg.rms_norm_eps)
            gate_up = F.linear(x, layer.gate_up_weight)
            act = F.silu(gate_up[:, :inter]) * gate_up[:, inter:]
            h = torch.addmm(h, act, layer.down_weight.t())
        return F.linear(_rms_norm(h, self.norm, cfg.rms_norm_eps), self.lm_head)

    # ------------------------------------------------------------------ engine helpers

    @torch.no_grad()
    def _prologue(
        self, token_ids: Tensor, positions: Tensor, mask: Tensor, first: LlamaDecoderLayer
    ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """Embedding + first RMSNorm (main stream) alongside RoPE cos/sin + mask (aux).

        Dynamo cannot trace stream switches or the phase monitor; a compiled step runs
        the branch inline (overlap is a CUDA-graph/eager feature of this model).
        """
        eps = self.config.rms_norm_eps
        if self.overlap and not _is_compiling():
            with self.aux_stream.fork(positions, mask) as branch:
                cos, sin = self._positional(positions, mask)
                branch.keep(cos, sin)
                # Concurrently on the caller's stream (the capture stream while
                # capturing): embedding and the first RMSNorm, issued before the join.
                with branch.on_main():
                    h = F.embedding(token_ids, self.embed_tokens)
                    x = _rms_norm(h, first.input_norm, eps)
        else:
            cos, sin = self._positional(positions, mask)
            h = F.embedding(token_ids, self.embed_tokens)
            x = _rms_norm(h, first.input_norm, eps)
        return h, x, cos, sin

    def warm_kernels(self, sizes: Sequence[int]) -> None:
        """Run :meth:`decode_step` at the largest of ``sizes`` and at ``max_batch``.

        Meant as the runner's ``before_capture`` hook (``before_capture=[model.warm_kernels]``):
        it brings every lazily sized resource — the workspace arena above all — to its
        final size *before* any graph captures an address (seed ``002``). The arena's
        need grows with the batch, so the largest batch sizes it for all; warming
        ``config.max_batch`` too means eager fallback up to the cache's capacity never
        needs a bigger arena once it is locked. Per-shape kernel selection for the other
        sizes happens in the runner's own warmup forward before each capture, so running
        every size here would only pay each shape's first-run cost twice.
        Positions are spread over the whole context (realistic mask and gather), and
        every row uses the scratch slot, so no live sequence's cache is touched.
        """
        wanted = [int(s) for s in sizes]
        if any(s <= 0 for s in wanted):
            raise ValueError(f"warm_kernels sizes must be positive, got {list(sizes)}")
        batches = sorted({max(wanted, default=1), self.config.max_batch}, reverse=True)
        for batch in batches:
            positions = (
                torch.linspace(0, self.config.max_context - 1, batch, device=self.device)
                .round()
                .long()
            )
            tokens = torch.arange(batch, device=self.device) % self.config.vocab_size
            slots = torch.full((batch,), self.scratch_slot, dtype=torch.long, device=self.device)
            self.decode_step(tokens, positions, slots)

    def example_inputs(
        self, batch: int, *, generator: torch.Generator | None = None
    ) -> tuple[Tensor, Tensor, Tensor]:
        """Realistic ``(token_ids, positions, slots)`` for ``batch`` live rows.

        Slots are distinct and ``< max_batch``, positions anywhere in the context. Drawn
        on the CPU (``generator`` must be a CPU generator, for reproducibility across
        devices) and moved to the model's device.
        """
        cfg = self.config
        if not 0 < batch <= cfg.max_batch:
            raise ValueError(
                f"example_inputs: batch must be in 1..max_batch={cfg.max_batch}, got {batch}"
            )
        tokens = torch.randint(0, cfg.vocab_size, (batch,), generator=generator)
        positions = torch.randint(0, cfg.max_context, (batch,), generator=generator)
        slots = torch.randperm(cfg.max_batch, generator=generator)[:batch]
        return tokens.to(self.device), positions.to(self.device), slots.to(self.device)

    def pad_fill_values(self) -> tuple[int, int, int]:
        """Fill values of padded rows, in :meth:`decode_step` argument order.

        ``(token_id 0, position 0, scratch slot)``: a padded row writes only the
        scratch slot at position 0 and attends to that single position, so it can
        neither corrupt nor read a live sequence and never produces NaN. Pass as the
        runner's ``fill_values``.
        """
        return (0, 0, self.scratch_slot)

    def reset_cache(self) -> None:
        """Zero every KV slot in place (addresses kept, so captured graphs stay valid)."""
        for module in self.layers:
            layer = cast(LlamaDecoderLayer, module)
            layer.k_cache.zero_()
            layer.v_cache.zero_()


def _dtype_from_hf(hf_config: Mapping[str, Any]) -> torch.dtype:
    """``torch_dtype`` (or transformers>=5 ``dtype``) of a config.json, else float32."""
    name = hf_config.get("torch_dtype") or hf_config.get("dtype") or "float32"
    dtype = getattr(torch, str(name).removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"config.json torch_dtype {name!r} is not a torch dtype")
    return dtype


__all__ = [
    "MIXED_ATTENTION_OP",
    "PRESETS",
    "LlamaConfig",
    "LlamaDecodeModel",
    "LlamaDecoderLayer",
    "RopeScaling",
    "attention",
    "causal_decode_mask",
    "mixed_attention",
    "rope_inv_freq",
]
