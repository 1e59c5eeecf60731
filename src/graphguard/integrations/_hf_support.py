"""What the transformers integration can graph token-identically, decided before capture.

Contract: :func:`check` returns every reason a model cannot be graphed (empty: it can).
Each reason is one sentence naming the config field or class, and why a graph would
freeze a decision that eager execution makes on the host (dynamic RoPE rescales on the
longest position, a sliding window shorter than the cache rolls on a host-side length,
MoE routing gathers tokens per expert with host-sized shapes, flash-attention masks read
``mask.all()``). Nothing here allocates device memory: the cache layout is read from a
``StaticCache`` before its lazy tensors exist. Also here: the argument check of
``compile=True`` and :func:`raise_if_weights_moved`, which ``generate`` runs before it
replays graphs that read the weights' capture-time addresses.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import os
import traceback
from collections.abc import Iterator
from typing import Any, NamedTuple

import torch

from graphguard.errors import (
    ConfigError,
    FreedStorageError,
    GraphCaptureError,
    UnsupportedModelError,
)
from graphguard.report import CaptureReport

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
        f"<{hi[0]}.{hi[1]} (its cache and mask APIs differ); install a version in range, "
        'e.g. pip install "graphguard[transformers]"'
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
    if getattr(model, "training", False):
        reasons.append(
            f"{name} is in training mode (dropout is random per call): call model.eval()"
        )
    if not reasons:
        reasons.extend(cache_layer_problems(model, max_cache_len or 2))
    return reasons


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


def weight_addresses(model: Any) -> list[tuple[str, int]]:
    """``(name, data_ptr)`` of every parameter and buffer, in module order."""
    named = [*model.named_parameters(), *model.named_buffers()]
    return [(name, t.data_ptr()) for name, t in named]


def raise_if_weights_moved(model: Any, captured: list[tuple[str, int]]) -> None:
    """Raise :class:`FreedStorageError` when tensors the graphs read moved since capture.

    A graph reads the addresses it was captured with: after ``model.to(...)``,
    ``load_state_dict(..., assign=True)`` or ``module.weight = new`` it would read
    freed or stale memory. In-place updates (``load_state_dict`` by default,
    ``weight.copy_``) keep the addresses and pass. About 150 tensors for a 1B Llama:
    a list compare, tens of microseconds.
    """
    now = weight_addresses(model)
    if now == captured:
        return
    before = dict(captured)
    moved = [name for name, ptr in now if before.get(name) != ptr]
    gone = sorted(set(before) - {name for name, _ in now})
    what = moved[:3] + gone[:3]
    raise FreedStorageError(
        f"generate: {type(model).__name__} tensors the decode graphs were captured "
        f"with moved or were replaced since capture ({', '.join(what)}"
        f"{', ...' if len(moved) + len(gone) > len(what) else ''}; e.g. model.to(...), "
        "load_state_dict(assign=True) or a new module); replaying would read freed or "
        "stale memory. Call recapture(reason='weights replaced') first, or update "
        "weights in place (load_state_dict without assign, weight.copy_(...))"
    )


def with_compiles(report: CaptureReport, step: Any, runner: Any, who: str) -> CaptureReport:
    """``report`` with the compile fields of ``step`` (None: unchanged); warns when dynamo
    compiled nothing, so the graphs hold eager kernels."""
    if step is None:
        return report
    step.fill_report(report)
    if not step.compiles and runner.captured_sizes and not runner.sanitize:
        logger.warning(  # dynamo ran the step eagerly instead (its warning says why)
            "%s: compile=True, but dynamo compiled nothing: the graphs hold eager kernels. "
            "Each GraphedCausalLM(compile='model') compiles the same function, so likely "
            "torch._dynamo.config.recompile_limit (%s) was reached: raise it (or "
            "torch._dynamo.reset()), then recapture()",
            who,
            torch._dynamo.config.recompile_limit,
        )
    return report


_HOST_COPY = "Cannot copy between CPU and CUDA tensors during CUDA graph capture"


def _model_line(exc: BaseException) -> str:
    """`` at file:line, in function: code`` of the deepest frame outside torch and
    graphguard (the model's own line)."""
    skip = (os.path.dirname(torch.__file__), os.path.dirname(os.path.dirname(__file__)))
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if not f.filename.startswith(skip)]
    if not frames:
        return ""
    f = frames[-1]
    return f" at {f.filename}:{f.lineno}, in {f.name}: {f.line}"


@contextlib.contextmanager
def refuse_host_copies(model: Any, runner: Any) -> Iterator[None]:
    """Turn a capture that failed on a host-to-device copy into a refusal.

    Some forwards copy a pageable host tensor to the GPU on every call (Falcon's
    multi-query ``_split_heads`` indexes with a Python list); eager runs it, a CUDA graph
    cannot capture it. That is a property of the model's code, not of one size, so the
    partial ladder is dropped and :class:`UnsupportedModelError` names the source line.
    """
    try:
        yield
    except GraphCaptureError as exc:
        cause = exc.cause or exc.__cause__
        if cause is None or _HOST_COPY not in str(cause):
            raise
        runner.release()
        where = _model_line(cause)
        reason = (
            f"its forward copies a host tensor to the GPU{where}, e.g. an index given as a "
            "Python list, which a CUDA graph cannot capture"
        )
        raise UnsupportedModelError(
            f"GraphedCausalLM cannot graph {type(model).__name__}: {reason}. Nothing is left "
            f"captured; compile=True may capture it (Inductor makes such constants device "
            f"tensors), else {FALLBACK}.",
            reasons=(reason,),
        ) from exc
