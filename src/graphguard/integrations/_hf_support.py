"""What the transformers integration refuses, decided before capture.

Contract: :func:`check` returns every reason a model cannot be graphed (empty: it can).
Each reason is one sentence naming the config field, class or tensor, and why a graph
would freeze a decision that eager execution makes on the host (dynamic RoPE rescales on
the longest position, a sliding window shorter than the cache rolls on a host-side
length, MoE routing gathers tokens per expert with host-sized shapes, flash-attention
masks read ``mask.all()``), or why the graphed loop would not produce ``generate``'s
tokens (a generation setting it does not apply: :data:`UNAPPLIED`). Nothing here
allocates device memory: the cache layout is read from a ``StaticCache`` before its lazy
tensors exist. Also here: the argument check of ``compile=True``. What is checked while
running (weights moved, training mode, host copies) is in :mod:`._hf_guards`.
"""

from __future__ import annotations

import inspect
import logging
import math
from collections.abc import Callable
from typing import Any, NamedTuple

from graphguard.errors import ConfigError

logger = logging.getLogger("graphguard")

SUPPORTED_RANGE = ((5, 17), (6, 0))
"""transformers versions accepted: >= 5.17 and < 6.0 (tested: 5.17, 5.18, 5.24)."""

_GRAPHABLE_ATTENTION = ("sdpa", "eager")
_HOST_ROPE = {
    "dynamic": "rescales its frequencies on the host from the longest position seen",
    "longrope": "switches between short and long factors on the host from max(position_ids)",
}
_MOE_FIELDS = ("num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts")

COMPILE_CHOICES = (False, True, "blocks", "model")
"""What ``compile`` takes: off, automatic (the decoder block when it can be compiled alone,
else the whole model call), or either one by name."""

COMPILE_MODES = (None, "default", "max-autotune-no-cudagraphs")
"""Inductor modes ``compile_mode`` takes: those without Inductor's own CUDA graphs."""

FALLBACK = (
    "run it eagerly instead: model.generate(...) (or GraphedCausalLM(..., mode='none'), "
    "the same API without graphs)"
)


class Support(NamedTuple):
    """The answer of :meth:`GraphedCausalLM.supported`: ``ok`` and, when not, why."""

    ok: bool
    reason: str


def version_tuple(version: str) -> tuple[int, int]:
    """``"5.24.0.dev0"`` -> ``(5, 24)``."""
    parts = version.split(".")
    nums: list[int] = []
    for p in parts[:2]:
        digits = "".join(ch for ch in p if ch.isdigit())
        nums.append(int(digits) if digits else 0)
    while len(nums) < 2:
        nums.append(0)
    return nums[0], nums[1]


def version_problem(version: str) -> str | None:
    """Why this transformers version is refused, or None when it is in range."""
    lo, hi = SUPPORTED_RANGE
    if lo <= version_tuple(version) < hi:
        return None
    return (
        f"transformers {version} is outside the supported range >={lo[0]}.{lo[1]},"
        f"<{hi[0]}.{hi[1]} (its cache and mask APIs differ); install a version in range: "
        f'pip install "transformers>={lo[0]}.{lo[1]},<{hi[0]}.{hi[1]}"'
    )


def rope_types(config: Any) -> set[str]:
    """Every RoPE type of the config (``rope_parameters`` may be per layer type)."""
    params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None)
    if not isinstance(params, dict):
        return set()
    if "rope_type" in params or "type" in params:
        return {str(params.get("rope_type", params.get("type")))}
    return {
        str(v.get("rope_type", v.get("type")))
        for v in params.values()
        if isinstance(v, dict) and ("rope_type" in v or "type" in v)
    }


def cache_kwarg(model: Any) -> str | None:
    """The forward's cache argument: ``cache`` (5.2x) or ``past_key_values`` (5.17)."""
    params = inspect.signature(model.forward).parameters
    for name in ("cache", "past_key_values"):
        if name in params:
            return name
    return None


def sliding_window(config: Any) -> int | None:
    """The sliding window that applies to some layer, or None."""
    window = getattr(config, "sliding_window", None)
    if window is None or getattr(config, "use_sliding_window", True) is False:
        return None
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None and not any(
        t in ("sliding_attention", "chunked_attention") for t in layer_types
    ):
        return None
    return int(window)


def check(model: Any, max_cache_len: int | None = None) -> list[str]:
    """Every reason ``model`` cannot be graphed token-identically (empty list: it can)."""
    import transformers

    reasons: list[str] = []
    bad_version = version_problem(transformers.__version__)
    if bad_version:
        return [bad_version]
    config = getattr(model, "config", None)
    if config is None or not hasattr(model, "forward"):
        return [f"{type(model).__name__} is not a transformers model (it has no .config)"]
    name = type(model).__name__
    if getattr(config, "is_encoder_decoder", False):
        reasons.append(
            f"{name} is an encoder-decoder model; only decoder-only causal LMs are supported"
        )
    can_generate = getattr(model, "can_generate", None)
    if not callable(can_generate) or not can_generate():
        reasons.append(f"{name} has no language-modeling head that generate() can use")
    kw = cache_kwarg(model)
    params = inspect.signature(model.forward).parameters
    if kw is None or "position_ids" not in params:
        reasons.append(
            f"{name}.forward takes no cache or no position_ids argument, so it cannot "
            "decode over a StaticCache"
        )
    attn = getattr(config, "_attn_implementation", None) or "eager"
    if attn not in _GRAPHABLE_ATTENTION:
        reasons.append(
            f"attention implementation {attn!r}: only 'sdpa' and 'eager' take a prebuilt "
            "4D mask without host-side checks (flash-attention masks read mask.all() on the "
            "host); load the model with attn_implementation='sdpa'"
        )
    for rtype in sorted(rope_types(config) & set(_HOST_ROPE)):
        reasons.append(f"RoPE type {rtype!r} {_HOST_ROPE[rtype]}; a graph would freeze it")
    for field in _MOE_FIELDS:
        value = getattr(config, field, None)
        if isinstance(value, int) and value > 1:
            reasons.append(
                f"mixture of experts ({field}={value}): token routing gathers per-expert "
                "batches whose sizes are read on the host"
            )
            break
    window = sliding_window(config)
    if window is not None and max_cache_len is not None and window < max_cache_len:
        reasons.append(
            f"sliding window {window} < max_cache_len {max_cache_len}: once full, the "
            "window's cache rolls on a host-side length that a graph would freeze; use "
            f"max_cache_len <= {window}"
        )
    if getattr(model, "hf_quantizer", None) is not None:
        reasons.append(f"{name} is quantized; its kernels are not known to be capture-safe")
    device_map = getattr(model, "hf_device_map", None)
    if isinstance(device_map, dict) and len(set(device_map.values())) > 1:
        reasons.append(
            f"{name} is spread over several devices ({sorted(set(device_map.values()))})"
        )
    else:
        reasons.extend(device_problems(model))
    training = [n or name for n, m in model.named_modules() if m.training]
    if training:
        reasons.append(
            f"{name} is in training mode ({', '.join(training[:3])}"
            f"{', ...' if len(training) > 3 else ''}; dropout is random per call): call "
            "model.eval()"
        )
    reasons.extend(generation_problems(getattr(model, "generation_config", None)))
    if not reasons:
        reasons.extend(cache_layer_problems(model, max_cache_len or 2))
    return reasons


def device_problems(model: Any) -> list[str]:
    """Parameters and buffers on several devices, or on ``meta`` (never loaded).

    One CUDA graph runs on one device, and the cache is built on the embeddings'
    device: a split model would fail inside capture with a raw cross-device error.
    """
    first: dict[str, str] = {}
    for pname, t in [*model.named_parameters(), *model.named_buffers()]:
        first.setdefault(str(t.device), pname)
    problems: list[str] = []
    if "meta" in first:
        problems.append(
            f"its tensors are on the meta device (e.g. {first['meta']}): the weights were "
            "never loaded; load them (from_pretrained, or load_state_dict(assign=True))"
        )
    if len(first) > 1:
        where = "; ".join(f"{dev}: {pname}" for dev, pname in sorted(first.items()))
        problems.append(
            f"its parameters and buffers are on several devices ({where}); one CUDA graph "
            "runs on one device: move the whole model there (model.to('cuda')) or load it "
            "without a multi-device device_map"
        )
    return problems


def _number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and not math.isnan(v)


def _set(v: Any) -> bool:
    return v is not None and v != [] and v != ()


def _above(limit: float) -> Callable[[Any], bool]:
    return lambda v: _number(v) and v > limit


def _not(neutral: float) -> Callable[[Any], bool]:
    return lambda v: v is not None and v != neutral


def _cutoff(v: Any) -> bool:
    return _number(v) and 0.0 < v < 1.0


def _true(v: Any) -> bool:
    return v is True


UNAPPLIED: dict[str, tuple[Callable[[Any], bool], str]] = {
    # generation modes other than greedy / multinomial sampling
    "num_beams": (_above(1), "beam search"),
    "num_beam_groups": (_above(1), "group beam search"),
    "diversity_penalty": (_above(0), "group beam search"),
    "constraints": (_set, "constrained beam search"),
    "force_words_ids": (_set, "constrained beam search"),
    "penalty_alpha": (_above(0), "contrastive search"),
    "dola_layers": (_set, "DoLa decoding"),
    "prompt_lookup_num_tokens": (_set, "assisted generation (prompt lookup)"),
    "assistant_early_exit": (_set, "assisted generation (early exit)"),
    "use_mtp": (_true, "multi-token prediction"),
    "num_return_sequences": (_above(1), "several sequences per prompt"),
    # stopping rules other than EOS and the length
    "max_time": (_set, "a wall-clock stop"),
    "stop_strings": (_set, "stop strings"),
    "min_length": (_above(0), "a minimum length (EOS suppressed until then)"),
    "min_new_tokens": (_above(0), "a minimum length (EOS suppressed until then)"),
    # logits processors
    "repetition_penalty": (_not(1.0), "a logits processor"),
    "no_repeat_ngram_size": (_above(0), "a logits processor"),
    "bad_words_ids": (_set, "a logits processor"),
    "sequence_bias": (_set, "a logits processor"),
    "guidance_scale": (_not(1.0), "classifier-free guidance"),
    "forced_bos_token_id": (_set, "a logits processor"),
    "forced_eos_token_id": (_set, "a logits processor"),
    "remove_invalid_values": (_true, "a logits processor"),
    "exponential_decay_length_penalty": (_set, "a logits processor"),
    "suppress_tokens": (_set, "a logits processor"),
    "begin_suppress_tokens": (_set, "a logits processor"),
    "renormalize_logits": (_true, "a logits processor"),
    "watermarking_config": (_set, "watermarking"),
    "token_healing": (_true, "token healing"),
    # sampling warpers besides temperature, top-k, top-p and min-p
    "top_h": (_set, "a sampling warper"),
    "typical_p": (lambda v: _number(v) and v < 1.0, "a sampling warper"),
    "epsilon_cutoff": (_cutoff, "a sampling warper"),
    "eta_cutoff": (_cutoff, "a sampling warper"),
}
"""Generation settings ``model.generate`` would act on and ``GraphedCausalLM.generate``
does not apply, each with when it is active (HF's own conditions in
``_get_logits_processor`` / ``get_generation_mode``) and what it is."""


def unapplied(values: dict[str, Any]) -> list[str]:
    """``name=value (what)`` for every active setting of :data:`UNAPPLIED` in ``values``."""
    out = []
    for key, (active, what) in UNAPPLIED.items():
        value = values.get(key)
        try:
            on = active(value)
        except TypeError:  # a value of a type HF's own check would reject
            on = True
        if on:
            out.append(f"{key}={value!r} ({what})")
    return out


def generation_problems(gen: Any) -> list[str]:
    """Why ``model.generation_config`` would make ``generate`` differ from HF's."""
    if gen is None:
        return []
    active = unapplied({k: getattr(gen, k, None) for k in UNAPPLIED})
    if not active:
        return []
    return [
        f"model.generation_config enables what GraphedCausalLM.generate does not apply "
        f"({', '.join(active)}), so its tokens would differ from model.generate's; reset "
        f"them (e.g. model.generation_config.{active[0].split('=')[0]} = None) or use "
        "model.generate"
    ]


def cache_layer_problems(model: Any, max_cache_len: int) -> list[str]:
    """Cache layers that are not plain device-counter ``StaticLayer``\\ s (lazy: no memory)."""
    from transformers import StaticCache
    from transformers.cache_utils import StaticLayer, StaticSlidingWindowLayer

    try:
        cache: Any = StaticCache(config=model.config, max_cache_len=max_cache_len)
    except Exception as exc:  # a config StaticCache cannot express
        return [f"transformers cannot build a StaticCache for it ({type(exc).__name__}: {exc})"]
    problems: list[str] = []
    for i, layer in enumerate(cache.layers):
        kind = type(layer)
        if kind is StaticLayer:
            continue
        if kind is StaticSlidingWindowLayer and layer.max_cache_len >= max_cache_len:
            continue  # window >= cache: it never rolls (rebuilt as a StaticLayer)
        problems.append(
            f"cache layer {i} is a {kind.__name__} (a hybrid, linear-attention or rolling "
            "layer keeps host-side state that a graph would freeze)"
        )
        break
    return problems


def check_compile_args(compile: Any, compile_mode: Any) -> None:
    """``compile`` one of :data:`COMPILE_CHOICES`; ``compile_mode`` one of
    :data:`COMPILE_MODES`, only with compile."""
    if not (isinstance(compile, bool) or (isinstance(compile, str) and compile in COMPILE_CHOICES)):
        raise ConfigError(
            f"GraphedCausalLM: compile must be one of {COMPILE_CHOICES}, got {compile!r}"
        )
    if compile_mode not in COMPILE_MODES:
        raise ConfigError(
            f"GraphedCausalLM: compile_mode={compile_mode!r} is not one of {COMPILE_MODES}; "
            "modes that record Inductor's own CUDA graphs ('reduce-overhead', "
            "'max-autotune') cannot run inside graphguard's graphs"
        )
    if compile_mode is not None and not compile:
        raise ConfigError(f"GraphedCausalLM: compile_mode={compile_mode!r} needs compile=True")
