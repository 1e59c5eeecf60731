"""The decode engine's static cache, allocated without running the model (issue 41: a lazy
engine's time to the first token), on the CPU.

``build_cache`` reads each layer's key/value layout from the attention module that writes
it (``kv_layouts``) when the module is HF's plain form and agrees with the config, and
otherwise lets one eager forward say what the model caches. For every family here the
two give the same cache: layer for layer, the same shapes, dtypes and devices.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

pytest.importorskip("transformers")

from graphguard.integrations import _hf_cache, _hf_support
from graphguard.integrations.transformers import GraphedCausalLM
from tests import hf_families as F

FUSED = {"phi3", "gpt2", "GPTNeoX", "Falcon", "GPTJ", "CodeGen", "GPTBigCode", "OPT"}
"""Families whose keys and values come from a fused or differently named projection:
the forward says what they cache."""


def _model(name: str, **kw: Any) -> Any:
    return F.model(name, **kw) if name in F.FAMILIES else F.other_model(name)


def _by_forward(model: Any, rows: int, length: int) -> Any:
    real = _hf_cache.kv_layouts
    _hf_cache.kv_layouts = lambda m, n: None  # type: ignore[assignment]
    try:
        return _hf_cache.build_cache(model, rows, length, _hf_support.cache_kwarg(model) or "cache")
    finally:
        _hf_cache.kv_layouts = real  # type: ignore[assignment]


def _layout(cache: Any) -> list[Any]:
    return [
        (tuple(x.keys.shape), tuple(x.values.shape), x.keys.dtype, x.values.dtype, x.keys.device)
        for x in cache.layers
    ]


@pytest.mark.parametrize(
    "name", [*F.FAMILIES, *F.OTHER_FAMILIES.split(",")], ids=lambda n: str(n).lower()
)
def test_the_cache_read_from_the_attention_modules_equals_the_forwards(name: str) -> None:
    model = _model(name)
    if not GraphedCausalLM.supported(model, max_cache_len=16).ok:
        pytest.skip(f"{name}: not graphed (GraphedCausalLM.supported says why)")
    layers = len(_by_forward(model, 1, 2).layers)
    read = _hf_cache.kv_layouts(model, layers)
    assert (read is None) == (name in FUSED), name
    cache = _hf_cache.build_cache(model, 4, 16, _hf_support.cache_kwarg(model) or "cache")
    want = _by_forward(model, 4, 16)
    assert _layout(cache) == _layout(want)
    for layer in cache.layers:  # zeros, the write position 0, HF's static addresses
        assert not layer.keys.any() and not layer.values.any()
        assert int(layer.cumulative_length) == 0 and layer.is_initialized


@pytest.mark.parametrize(
    ("overrides", "why"),
    [
        ({"head_dim": 32}, "a head_dim unlike hidden_size / heads"),
        ({"dtype": torch.bfloat16}, "bf16 weights"),
    ],
)
def test_a_layout_unlike_the_defaults_is_read_right(overrides: dict[str, Any], why: str) -> None:
    model = F.model("llama", **overrides)
    layers = model.config.num_hidden_layers
    assert _hf_cache.kv_layouts(model, layers) is not None, why
    assert _layout(_hf_cache.build_cache(model, 3, 8, "past_key_values")) == _layout(
        _by_forward(model, 3, 8)
    )


def test_anything_the_modules_and_the_config_disagree_on_runs_the_model() -> None:
    """Two sources that must agree: a config whose head count differs from what k_proj
    computes, a quantized-looking projection, a layer no module writes: each reads None."""
    model = F.model("llama")
    layers = model.config.num_hidden_layers
    model.config.num_key_value_heads = 4  # k_proj still computes 2 heads
    assert _hf_cache.kv_layouts(model, layers) is None
    model = F.model("llama")

    class Packed(torch.nn.Linear):  # what a quantization library swaps in
        pass

    attn = model.model.layers[0].self_attn
    k = attn.k_proj
    attn.k_proj = Packed(k.in_features, k.out_features)
    assert _hf_cache.kv_layouts(model, layers) is None
    attn.k_proj = k
    assert _hf_cache.kv_layouts(model, layers + 1) is None  # a cache layer nobody writes
    assert _hf_cache.kv_layouts(model, layers) is not None


def test_building_the_engine_runs_no_forward_for_a_plain_family() -> None:
    model = F.model("llama")
    calls: list[int] = []
    hook = model.register_forward_pre_hook(lambda m, a: calls.append(1))
    try:
        GraphedCausalLM(model, max_batch=4, max_cache_len=16, mode="none", progress=False)
    finally:
        hook.remove()
    assert calls == []
