"""The reference model's kernels: two attention custom ops, the KV write, RMSNorm, RoPE.

Contract: every function here is CUDA-graph capturable (no host sync, no ``.item()``,
no value-dependent shapes). KV caches are ``[slots, num_kv_heads, max_context, head_dim]``
(head-major, as SDPA reads them). Decode attention needs no gather: **rows are slots**,
row ``b`` attends to ``cache[b]``, so the batch's keys are the view ``cache[:B]``. The
attentions are ``torch.library`` custom ops in the ``graphguard_ref::`` namespace, so
``torch.compile`` treats them as opaque split points: :data:`MIXED_ATTENTION_OP` is the
split op of PIECEWISE graphs. Grouped-query attention needs no ``repeat_interleave``:
with one query token per row, the query heads that share a KV head are laid out as the
query-length axis (``q.view(B, kvh, group, hd)``).
On torch < 2.4 (no ``torch.library.custom_op``) the plain functions are used.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Sequence
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import Tensor

from graphguard_ref.llama.config import LlamaConfig


def register_op(
    qualname: str,
    impl: Callable[..., Tensor],
    fake: Callable[..., Tensor],
    *,
    schema: str,
    mutates_args: Sequence[str] = (),
) -> Callable[..., Tensor]:
    """Register ``impl`` as the custom op ``qualname`` once per process; return the callable.

    Why once: re-importing this module (``importlib.reload``, two copies on ``sys.path``)
    must not fail on a duplicate registration, so an existing op of the same name is
    reused. ``fake`` is the shape-only kernel tracing uses. Without
    ``torch.library.custom_op`` (torch < 2.4) ``impl`` itself is returned.
    """
    custom_op = getattr(torch.library, "custom_op", None)
    if custom_op is None:
        return impl
    namespace, name = qualname.split("::")
    try:
        existing = getattr(getattr(torch.ops, namespace), name)
    except (AttributeError, RuntimeError):
        existing = None
    if existing is not None:
        return cast(Callable[..., Tensor], existing.default)
    op = custom_op(qualname, impl, mutates_args=tuple(mutates_args), schema=schema)
    op.register_fake(fake)
    return cast(Callable[..., Tensor], op)


# --------------------------------------------------------------------------- attention


def sdpa_backends(*, cudnn: bool = False) -> contextlib.AbstractContextManager[Any]:
    """The SDPA kernels the reference model's attention may use (CUDA only).

    Without ``cudnn``: memory-efficient, flash or math -- no per-shape setup, which the
    mixed and prefill attention need (every token count is a new shape). With it,
    cuDNN first: at decode shapes on the H200 it is 1.14-1.37x faster per decode step
    (``bench/probes/probe_capture.py``), but builds an execution plan per new batch size
    (50-75 ms each, and ~0.9 s to load cuDNN the first time), paid by the uncaptured
    warmups before capture, never by a replay.
    """
    if _SDPA_CHOICE is None:  # torch < 2.3: the default choice
        return contextlib.nullcontext()
    kernel, backends, with_cudnn = _SDPA_CHOICE
    return cast(contextlib.AbstractContextManager[Any], kernel(with_cudnn if cudnn else backends))


try:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    _PLANLESS = [SDPBackend.EFFICIENT_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.MATH]
    _SDPA_CHOICE: tuple[Any, list[Any], list[Any]] | None = (
        sdpa_kernel,
        _PLANLESS,
        [SDPBackend.CUDNN_ATTENTION, *_PLANLESS],
    )
except ImportError:
    _SDPA_CHOICE = None


def write_kv(cache: Tensor, slots: Tensor, positions: Tensor, x: Tensor) -> None:
    """Write ``x[b]`` (``[B, num_kv_heads, head_dim]``) at ``cache[slots[b], :, positions[b]]``.

    One ``index_put_`` (no gather, no host sync); rows sharing a ``(slot, position)``
    (padded rows on the scratch slot) race, which only the scratch slot may suffer.
    """
    cache[slots, :, positions] = x


def _gqa_sdpa(
    q: Tensor, keys: Tensor, values: Tensor, mask: Tensor | None, *, cudnn: bool = False
) -> Tensor:
    """SDPA of ``q`` [rows, heads, hd] over per-row ``keys``/``values`` [rows, kvh, ctx, hd].

    GQA as [rows, kvh, group, hd]: the group's query heads play the query-length axis.
    """
    rows, num_heads, head_dim = q.shape
    num_kv_heads = keys.shape[1]
    qg = q.reshape(rows, num_kv_heads, num_heads // num_kv_heads, head_dim)
    with sdpa_backends(cudnn=cudnn) if q.is_cuda else contextlib.nullcontext():
        out = F.scaled_dot_product_attention(qg, keys, values, attn_mask=mask)
    # Some SDPA backends return a transposed layout; reshape copies only then, and
    # .contiguous() (a no-op otherwise) keeps real strides equal to the fake kernel's.
    return out.reshape(rows, num_heads, head_dim).contiguous()


def _decode_attention_impl(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    positions: Tensor,
    mask: Tensor | None,
    cudnn: bool = False,
) -> Tensor:
    batch = q.shape[0]
    if mask is None:
        mask = causal_decode_mask(positions, k_cache.shape[2], q.dtype)
    # Rows are slots: the batch's keys are the first B slots, a view (no gather, no copy).
    k, v = k_cache[:batch], v_cache[:batch]
    return _gqa_sdpa(q, k, v, mask, cudnn=cudnn)


def _decode_attention_fake(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    positions: Tensor,
    mask: Tensor | None,
    cudnn: bool = False,
) -> Tensor:
    return q.new_empty(q.shape)


DECODE_ATTENTION_OP = "graphguard_ref::decode_attention"
"""Qualified name of the one-token-per-row decode attention op."""

_attention_op = register_op(
    DECODE_ATTENTION_OP,
    _decode_attention_impl,
    _decode_attention_fake,
    schema=(
        "(Tensor q, Tensor k_cache, Tensor v_cache, Tensor positions, Tensor? mask, "
        "bool cudnn=False) -> Tensor"
    ),
)


def attention(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    positions: Tensor,
    mask: Tensor | None = None,
    *,
    cudnn: bool = False,
) -> Tensor:
    """Decode attention of one new token per row over its own slot, positions 0..p.

    Rows are slots: row ``b`` attends to ``cache[b, :, 0..positions[b]]``, so the keys
    of the whole batch are the view ``cache[:B]`` and nothing is gathered (a per-row
    ``index_select`` of the cache cost 1.3x-2.6x a decode step at llama-1b shapes).

    Args:
        q: ``[B, num_heads, head_dim]`` queries (RoPE applied), ``B <= slots``.
        k_cache, v_cache: ``[slots, num_kv_heads, max_context, head_dim]``; this step's
            key/value must already be written at ``[b, :, positions[b]]``.
        positions: ``[B]`` int64; row ``b`` attends to positions ``0..positions[b]``.
        mask: optional precomputed additive mask from :func:`causal_decode_mask`
            (the model builds it once per step instead of once per layer).
        cudnn: let SDPA use its cuDNN kernel (see :func:`sdpa_backends`).

    Returns a new ``[B, num_heads, head_dim]`` tensor in ``q``'s dtype. Registered as
    the custom op ``graphguard_ref::decode_attention`` (no mutation, fake kernel for
    tracing) so ``torch.compile`` can split the graph here and keeps this SDPA backend.
    """
    return _attention_op(q, k_cache, v_cache, positions, mask, cudnn)


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
    write_kv(k_cache, slots, positions, k)
    write_kv(v_cache, slots, positions, v)
    # Tokens are not slots here (a prefill chunk is many tokens of one slot): gather
    # each token's slot, [T, kvh, ctx, hd], contiguous in the head-major layout.
    keys = k_cache.index_select(0, slots)
    values = v_cache.index_select(0, slots)
    return _gqa_sdpa(q, keys, values, mask)


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

_mixed_attention_op = register_op(
    MIXED_ATTENTION_OP,
    _mixed_attention_impl,
    _mixed_attention_fake,
    schema=(
        "(Tensor q, Tensor k, Tensor v, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor slots, "
        "Tensor positions, Tensor mask) -> Tensor"
    ),
    mutates_args=("k_cache", "v_cache"),
)


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
    ``cache[slots[t], :, positions[t]]`` and it attends to ``cache[slots[t], :, 0..positions[t]]``
    inclusive. A request's prefill chunk is simply consecutive tokens with the same slot
    and consecutive positions, so ragged query lengths (prefill chunks, decodes,
    speculative verifies of ``1 + k`` tokens) need no per-request metadata: the slot
    id per token *is* the sequence id, and the causal mask per token does the rest.

    Args:
        q: ``[T, num_heads, head_dim]`` queries (RoPE applied).
        k, v: ``[T, num_kv_heads, head_dim]`` this step's keys (RoPE applied) and values.
        k_cache, v_cache: ``[slots, num_kv_heads, max_context, head_dim]``; written in place.
        slots, positions: ``[T]`` int64. Live tokens have distinct ``(slot, position)``
            pairs; padded tokens all use ``(scratch slot, 0)``.
        mask: the additive ``[T, 1, 1, max_context]`` mask of :func:`causal_decode_mask`.

    Returns a new ``[T, num_heads, head_dim]`` tensor. Registered as the custom op
    ``graphguard_ref::mixed_attention`` (mutates the caches; fake kernel for tracing):
    the split point of PIECEWISE graphs. It is capturable too (no host sync, fixed
    shapes), so a FULL graph may contain it. Reference-model simplicity over speed: each
    token gathers its slot's whole cache (``O(T * max_context)`` memory); the decode
    step's :func:`attention` needs no gather because its rows are slots.
    """
    return _mixed_attention_op(q, k, v, k_cache, v_cache, slots, positions, mask)


# --------------------------------------------------------------------------- building blocks

_rms_norm_fn = getattr(F, "rms_norm", None)


def is_compiling() -> bool:
    """True while torch.compile traces (constant-folded by Dynamo, free in eager)."""
    return bool(torch.compiler.is_compiling())


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """RMSNorm with HF Llama numerics (normalise in fp32, scale in the model dtype)."""
    if _rms_norm_fn is not None:
        return cast(Tensor, _rms_norm_fn(x, (x.shape[-1],), weight, eps))
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
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


__all__ = [
    "DECODE_ATTENTION_OP",
    "MIXED_ATTENTION_OP",
    "apply_rope",
    "attention",
    "causal_decode_mask",
    "is_compiling",
    "mixed_attention",
    "register_op",
    "rms_norm",
    "rope_inv_freq",
    "sdpa_backends",
    "write_kv",
]
