"""One ``StaticCache`` of ``max_batch`` rows, viewed as a cache of its first ``n`` rows.

A graph freezes addresses, so the size-``n`` graph must read and write rows ``[0, n)``
of *the* cache, never a copy. :class:`RowViews` hands out, per batch size, a shallow
copy of the cache whose layers hold ``keys[:n]`` / ``values[:n]`` (views into the same
storage) and share the layer's 0-d device counter ``cumulative_length`` (the write
position every row shares; each layer advances its own). Every size gets views, the
largest included, and their dim 0 is marked dynamic: a compiled decode step sees the
same kind of input at every size (the full tensors carry HF's ``mark_static_address``,
which would make the largest size a graph of its own). Only attributes present in
transformers 5.17 through 5.24 are used: ``Cache.layers``, and per ``StaticLayer``
``keys``, ``values``, ``cumulative_length``, ``max_cache_len`` and ``batch_size``.

:func:`cache_state` is the state capture and ``verify()`` restore: warmup forwards really
write the cache. The decode step resets the counter to 0 before every warmup forward, so
warmups and (emulated) captures touch only cache columns 0 and 1 of each row plus the
counter; a :class:`graphguard.state.StateSet` over exactly those views (the runner's
``state=``) clones them before capture and copies them back in place after, so every
address stays valid and a cache of gigabytes costs two columns to keep.
"""

from __future__ import annotations

import copy
from typing import Any

import torch

from graphguard.state import StateSet

TOUCHED_COLUMNS = 3
"""Cache columns a capture can write: 0 (every warmup zeroes the write position first),
and on the CPU emulation, whose captures run the step, 1 and 2: the two largest sizes'
first warmup is the layout probe's forward (column 0), so their captures run back to back
at write positions 1 and 2 (a CUDA capture records the write and runs nothing)."""


def build_cache(model: Any, max_batch: int, max_cache_len: int, cache_kw: str) -> Any:
    """A ``StaticCache`` with ``max_batch`` rows, sized by the model itself.

    Layers with a sliding window at least as long as the cache never roll, so they are
    rebuilt as plain ``StaticLayer``\\ s (same math, no host-side length). The lazy
    tensors are allocated by one eager forward of ``max_batch`` dummy tokens (the model
    knows its head counts and dims better than any config field), then the counter is
    reset and the rows are zeroed.
    """
    from transformers import StaticCache
    from transformers.cache_utils import StaticLayer

    cache: Any = StaticCache(config=model.config, max_cache_len=max_cache_len)
    for i, layer in enumerate(cache.layers):
        if type(layer) is not StaticLayer:
            cache.layers[i] = StaticLayer(max_cache_len=max_cache_len)
    device = next(model.parameters()).device
    dummy = torch.zeros((max_batch, 1), dtype=torch.long, device=device)
    with torch.no_grad():
        model(input_ids=dummy, position_ids=dummy, use_cache=True, **{cache_kw: cache})
    for layer in cache.layers:
        layer.keys.zero_()
        layer.values.zero_()
        layer.cumulative_length.zero_()
    return cache


def counters(cache: Any) -> list[torch.Tensor]:
    """Each layer's write position (0-d device tensors, equal in value)."""
    return [layer.cumulative_length for layer in cache.layers]


class RowViews:
    """Caches over the first ``n`` rows of one ``StaticCache``, built once per ``n``."""

    def __init__(self, cache: Any) -> None:
        self.cache = cache
        self.max_batch = int(cache.layers[0].keys.shape[0])
        self._views: dict[int, Any] = {}

    def __call__(self, n: int) -> Any:
        """The cache of rows ``[0, n)``: same storage, same counter."""
        view = self._views.get(n)
        if view is None:
            view = copy.copy(self.cache)
            view.layers = [self._layer(layer, n) for layer in self.cache.layers]
            self._views[n] = view
        return view

    @staticmethod
    def _layer(layer: Any, n: int) -> Any:
        rows = copy.copy(layer)  # shares cumulative_length: one write position
        rows.keys = layer.keys.narrow(0, 0, n)
        rows.values = layer.values.narrow(0, 0, n)
        # One compile for every size: the batch dim is symbolic (no-op when eager).
        torch._dynamo.maybe_mark_dynamic(rows.keys, 0)
        torch._dynamo.maybe_mark_dynamic(rows.values, 0)
        rows.batch_size = n
        return rows


def cache_state(cache: Any) -> StateSet:
    """The counters and columns ``0..TOUCHED_COLUMNS-1`` of every layer, as a StateSet.

    Views into the cache's storage (built once: the cache's tensors are never rebound),
    named like ``layers.3.keys[:2]`` in the runner's messages.
    """
    named: dict[str, torch.Tensor] = {}
    for i, layer in enumerate(cache.layers):
        named[f"layers.{i}.cumulative_length"] = layer.cumulative_length
        for kind in ("keys", "values"):
            cols = getattr(layer, kind).narrow(2, 0, TOUCHED_COLUMNS)
            named[f"layers.{i}.{kind}[:, :, :{TOUCHED_COLUMNS}]"] = cols
    return StateSet(named)
