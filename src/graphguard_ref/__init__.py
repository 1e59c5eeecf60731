"""Reference models for the demo, the tests and the benchmarks.

They use graphguard the way a real engine would (a workspace arena, an auxiliary
stream, a kernel-warmup hook), so the library is exercised against realistic decode
steps rather than toy callables.
"""

from __future__ import annotations

from graphguard.models.llama import (
    MIXED_ATTENTION_OP,
    PRESETS,
    LlamaConfig,
    LlamaDecodeModel,
    RopeScaling,
    attention,
    mixed_attention,
)

__all__ = [
    "MIXED_ATTENTION_OP",
    "PRESETS",
    "LlamaConfig",
    "LlamaDecodeModel",
    "RopeScaling",
    "attention",
    "mixed_attention",
]
