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

import contextlib
import copy
from collections.abc import Iterator
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
    rebuilt as plain ``StaticLayer``\\ s (same math, no host-side length). Each layer's
    tensors are allocated from what its attention module computes keys and values with
    (:func:`kv_layouts`: a plain ``k_proj`` / ``v_proj`` and ``head_dim``, agreeing with
    the config), no forward run; for any other attention (fused projections, latent
    attention, quantized weights) by one eager forward of ``max_batch`` dummy tokens,
    which lets the model say what it caches (the counter is then reset and the rows
    zeroed). The forward is what a lazy engine's first token waited for: on the H200, a
    decode-shaped forward at a shape new to the process took 0.13-0.19 s of a 1B Llama's
    time to the first token (``bench/probes/probe_hf_ttft.py``).
    """
    from transformers import StaticCache
    from transformers.cache_utils import StaticLayer

    cache: Any = StaticCache(config=model.config, max_cache_len=max_cache_len)
    for i, layer in enumerate(cache.layers):
        if type(layer) is not StaticLayer:
            cache.layers[i] = StaticLayer(max_cache_len=max_cache_len)
    layouts = kv_layouts(model, len(cache.layers))
    if layouts is not None:
        for layer, (heads, k_dim, v_dim, dtype, device) in zip(cache.layers, layouts):
            # lazy_initialization reads only the shapes' batch, heads and last dim.
            k = torch.empty((max_batch, heads, 0, k_dim), dtype=dtype, device=device)
            v = torch.empty((max_batch, heads, 0, v_dim), dtype=dtype, device=device)
            layer.lazy_initialization(k, v)
        return cache
    device = next(model.parameters()).device
    dummy = torch.zeros((max_batch, 1), dtype=torch.long, device=device)
    with torch.no_grad():
        model(input_ids=dummy, position_ids=dummy, use_cache=True, **{cache_kw: cache})
    for layer in cache.layers:
        layer.keys.zero_()
        layer.values.zero_()
        layer.cumulative_length.zero_()
    return cache


KVLayout = tuple[int, int, int, torch.dtype, torch.device]
"""One cache layer's ``(kv heads, key dim, value dim, dtype, device)``."""


def kv_layouts(model: Any, layers: int) -> list[KVLayout] | None:
    """Per cache layer, what its keys and values are, read from the attention module that
    writes it, or None (then :func:`build_cache` runs the model once to see).

    Only the plain form HF's decoder-only families share: a module with ``layer_idx``,
    ``head_dim`` and ``k_proj`` / ``v_proj`` that are exactly ``nn.Linear`` over floating
    weights of the embeddings' dtype, reshaped to ``(heads, head_dim)``. Every layer
    index ``0..layers-1`` once, and the heads and key dim equal to the config's
    (``num_key_value_heads``, ``head_dim``): two sources that agree. A KV-shared layer,
    a fused or quantized projection, a missing layer: None.
    """
    config: Any = getattr(model, "config", None)
    text: Any = config.get_text_config() if hasattr(config, "get_text_config") else config
    want_heads = getattr(text, "num_key_value_heads", None)
    want_dim = getattr(text, "head_dim", None)
    if want_dim is None and getattr(text, "num_attention_heads", None):
        want_dim = getattr(text, "hidden_size", 0) // text.num_attention_heads
    embed = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    dtype = getattr(getattr(embed, "weight", None), "dtype", None)
    found: dict[int, KVLayout] = {}
    for m in model.modules():
        k, v = getattr(m, "k_proj", None), getattr(m, "v_proj", None)
        if k is None and v is None:
            continue
        idx, dim = getattr(m, "layer_idx", None), getattr(m, "head_dim", None)
        if (
            type(k) is not torch.nn.Linear
            or type(v) is not torch.nn.Linear
            or not isinstance(idx, int)
            or not isinstance(dim, int)
            or dim <= 0
            or idx in found
            or getattr(m, "is_kv_shared_layer", False)
            or getattr(m, "is_cross_attention", False)
        ):
            return None
        kw, vw = k.weight, v.weight
        if (
            kw.dtype != dtype
            or vw.dtype != dtype
            or not kw.is_floating_point()
            or kw.is_meta
            or kw.device != vw.device
            or k.out_features % dim
        ):
            return None
        heads = k.out_features // dim
        if heads != want_heads or dim != want_dim or v.out_features % heads:
            return None
        found[idx] = (heads, dim, v.out_features // heads, dtype, kw.device)
    if sorted(found) != list(range(layers)):
        return None
    return [found[i] for i in range(layers)]


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


@contextlib.contextmanager
def restored(state: StateSet, counters: list[torch.Tensor], device: torch.device) -> Iterator[None]:
    """The cache given back as it was (``state``) when the block ends, even on failure;
    inside the block the write position (``counters``) is 0, so every forward writes the
    columns ``state`` covers."""
    saved = state.snapshot()
    if device.type == "cuda":
        # Forwards may run on a side stream, which does not wait for this one: the
        # clones must be complete before a forward writes column 0.
        torch.cuda.synchronize(device)
    torch._foreach_zero_(counters)
    try:
        yield
    finally:
        state.restore(saved)
