"""The reference Llama-style decoder: graphguard's realistic test subject.

Contract: everything here runs eagerly, inside a FULL CUDA graph, and under
``torch.compile`` split at :data:`MIXED_ATTENTION_OP` (PIECEWISE graphs). Layout, and why:

* **KV cache** ``[max_batch + 1, kv_heads, max_context, head_dim]`` per layer, zeros;
  slot ``max_batch`` is the scratch slot padded rows write (padding harmless at the
  lowest level, not special-cased in Python).
* **Rows are slots** in ``decode_step``: row ``b`` attends to ``cache[b]``, so attention
  is SDPA over the view ``cache[:B]`` with a positions mask -- no per-row gather, as
  fast as a plain step over a contiguous per-slot cache.
* **Fused projections** (q/k/v, gate/up: one GEMM each) with residual adds in the GEMM
  epilogue: fewer launches, which matters most eagerly.
* **Workspace arena**: MLP intermediates and the attention mask of ``decode_step`` are
  views into one arena sized by the batch (the "arena growth after capture" hazard).
* **Auxiliary stream**: RoPE cos/sin and the mask depend only on positions and run on
  a side stream beside the embedding ("side-stream work across the capture boundary").
* **Mixed step**: one row per token with its own ``(slot, position)``, so prefill
  chunks, decodes and speculative verifies share one batch without per-request metadata.

Files: ``config`` (shapes, presets, HF config), ``ops`` (custom attention ops, RMSNorm,
RoPE), ``model`` (the decoder), ``weights`` (HF weight I/O).
"""

from __future__ import annotations

from graphguard_ref.llama.config import PRESETS, LlamaConfig, RopeScaling
from graphguard_ref.llama.model import LlamaDecodeModel, LlamaDecoderLayer
from graphguard_ref.llama.ops import (
    DECODE_ATTENTION_OP,
    MIXED_ATTENTION_OP,
    attention,
    causal_decode_mask,
    mixed_attention,
    rope_inv_freq,
    write_kv,
)

__all__ = [
    "DECODE_ATTENTION_OP",
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
    "write_kv",
]
