"""The model called over one ``StaticCache``: the decode step the graphs capture, and the
eager prefill before it.

Warmup and capture take the same path. The decode step passes explicit ``position_ids``
and a 4D mask it builds on the device (``valid & (arange(L) <= write position)``: bitwise
what ``generate`` builds for a static cache), which every mask helper returns unchanged,
so transformers' ``is_tracing()`` branches are never reached; no torch function is patched.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Iterator, Sequence
from typing import Any

import torch

from graphguard.integrations import _hf_support as support
from graphguard.integrations._hf_cache import (
    RowViews,
    build_cache,
    cache_state,
    counters,
    restored,
)
from graphguard.state import StateSet


class StaticDecode:
    """One ``StaticCache`` of ``max_batch`` rows and the model calls over its first ``n``
    rows (views built up front for ``sizes``: capture and replays only look them up)."""

    def __init__(
        self, model: Any, max_batch: int, max_cache_len: int, sizes: Sequence[int]
    ) -> None:
        config = model.config
        self.model = model
        self.cache_kw = support.cache_kwarg(model) or "cache"
        self.sdpa = (getattr(config, "_attn_implementation", None) or "eager") == "sdpa"
        self.extra: dict[str, Any] = {"use_cache": True}
        if "logits_to_keep" in inspect.signature(model.forward).parameters:
            self.extra["logits_to_keep"] = 1  # as generate passes it (same lm_head GEMM)
        embed = model.get_input_embeddings().weight
        self.device = embed.device
        self.dtype = embed.dtype  # eager masks are in the embeddings' dtype, as HF builds them
        self.cache = build_cache(model, max_batch, max_cache_len, self.cache_kw)
        self.rows = RowViews(self.cache)
        for n in sizes:
            self.rows(n)
        self.counters = counters(self.cache)
        """The write position every row shares (one 0-d counter per layer)."""
        self.state: StateSet = cache_state(self.cache)
        """What capture and ``verify()`` restore: the counters and the cache columns a
        capture writes (the runner's ``state=``)."""
        self._arange = torch.arange(max_cache_len, device=self.device)
        self._zero = torch.zeros((), dtype=self.dtype, device=self.device)
        self._min = torch.finfo(self.dtype).min

    def decode(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        kv_valid: torch.Tensor,
        rows: Any,
    ) -> torch.Tensor:
        """The model call over the row views ``rows`` (what ``compile=True`` compiles).

        ``kv_valid[b, k]``: cache position ``k`` of row ``b`` is not left padding. The mask
        adds causality from the shared write position, on the device. Inputs are tensors
        with a batch dim and ``rows``, whose tensors have a dynamic dim 0: one compile.
        """
        allowed = kv_valid[:, None, None, :] & (self._arange <= self.counters[0])
        mask = allowed if self.sdpa else torch.where(allowed, self._zero, self._min)
        out = self.model(
            input_ids=input_ids,
            position_ids=position_ids,
            attention_mask=mask,
            **{self.cache_kw: rows},
            **self.extra,
        )
        logits: torch.Tensor = out.logits[:, -1, :].float()
        return logits

    def eager(
        self, input_ids: torch.Tensor, position_ids: torch.Tensor, kv_valid: torch.Tensor
    ) -> torch.Tensor:
        """:meth:`decode` over cache rows ``[0, n)``, uncompiled, without autograd."""
        rows = self.rows(int(input_ids.shape[0]))
        with torch.no_grad():
            return self.decode(input_ids, position_ids, kv_valid, rows)

    def prefill(self, ids: torch.Tensor, mask2d: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The prompts run eagerly into cache rows ``[0, B)`` from write position 0: the
        float32 logits of each row's last position, and each row's positions."""
        positions = (mask2d.cumsum(-1) - 1).masked_fill(mask2d == 0, 0)
        torch._foreach_zero_(self.counters)
        out = self.model(
            input_ids=ids,
            attention_mask=mask2d,
            position_ids=positions,
            **{self.cache_kw: self.rows(ids.shape[0])},
            **self.extra,
        )
        return out.logits[:, -1, :].float(), positions

    @contextlib.contextmanager
    def restored(self) -> Iterator[None]:
        """The cache given back as it was when the block ends (:func:`._hf_cache.restored`)."""
        with restored(self.state, self.counters, self.device):
            yield


__all__ = ["StaticDecode"]
