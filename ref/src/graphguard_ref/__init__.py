"""graphguard's reference application: a Llama-style model, its tensor-parallel shard,
a small serving loop, and the ``graphguard-demo`` command.

It uses graphguard the way a real engine would (a workspace arena, an auxiliary stream,
a kernel-warmup hook, a dispatcher over FULL and PIECEWISE graphs), so the library is
shown, tested and benchmarked against realistic steps. The dependency runs one way:
``graphguard_ref`` imports ``graphguard``; the library never imports this package.

Modules: ``llama`` (the model), ``tp`` (its tensor-parallel shard), ``batches`` (a
step's batch and key), ``serving_loop`` (scheduler, dispatcher wiring), ``demo``
(``graphguard-demo``), ``timing`` (the one CUDA-event timer), ``cli`` (the command).
It is its own distribution (``ref/pyproject.toml``, ``graphguard-ref``): installing the
library installs no model and no demo.
"""

from __future__ import annotations

from graphguard_ref.llama import (
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
