"""The decode runner's options for :class:`~graphguard.integrations.transformers.
GraphedCausalLM`: what it reads, what it sets itself (refused when passed, saying what
to pass instead), and the sizes it captures.

The decode step runs over the rows ``[0, n)`` of one ``StaticCache`` of ``max_batch``
rows, so every capture size is at most ``max_batch``; its inputs are one row per
sequence, padded rows hold token 0 at position 0 with finite attention, and its state is
the static cache (what capture and ``verify()`` restore).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from graphguard import Canary, CaptureOptions, capture_sizes
from graphguard.compiled import compiled_capture_sizes
from graphguard.errors import ConfigError
from graphguard.integrations import _hf_support as support
from graphguard.sizes import validate_sizes
from graphguard.state import StateSet
from graphguard.verify import default_tolerance

SET_HERE = {
    "max_size": "pass max_batch= (the rows of the one StaticCache; the ladder's top)",
    "batch_dims": "the decode inputs are one row per sequence along dim 0",
    "fill_values": "padded rows hold token 0 at position 0 with finite attention",
    "names": "the decode inputs are input_ids, position_ids and kv_valid",
    "state": "the decode runner's state is the static cache (g.cache_state)",
    "weights": "update_weights()/check_weights() cover the model, by its HF names",
    "output_batch_dims": "the decode step returns float32 logits [batch, vocab]",
}
"""Options of the decode runner that GraphedCausalLM sets itself, and why."""


def decode_sizes(
    opts: CaptureOptions,
    max_batch: int,
    max_cache_len: int,
    stop_check_every: int,
    compile: bool | str,
    compile_mode: str | None,
) -> tuple[list[int], int]:
    """The capture sizes and the warmup count of the decode runner, after refusing an
    option set here (:data:`SET_HERE`), a bad count or compile argument, and a size
    above ``max_batch``."""
    for key, fix in SET_HERE.items():
        if getattr(opts, key) is not None:
            raise ConfigError(f"GraphedCausalLM sets {key}= itself: {fix}")
    warmup_iters = 1 if opts.warmup_iters is None else opts.warmup_iters
    for arg, value, low in (
        ("max_batch", max_batch, 1),
        ("max_cache_len", max_cache_len, 2),
        ("stop_check_every", stop_check_every, 1),
        ("warmup_iters", warmup_iters, 1),  # warmups pin capture's writes to column 0
    ):
        if not isinstance(value, int) or isinstance(value, bool) or value < low:
            raise ConfigError(f"GraphedCausalLM: {arg} must be an int >= {low}, got {value!r}")
    support.check_compile_args(compile, compile_mode)
    if opts.sizes is not None:
        ladder = list(validate_sizes(opts.sizes))
    else:
        ladder = compiled_capture_sizes(max_batch) if compile else capture_sizes(max_batch)
    if ladder[-1] > max_batch:
        raise ConfigError(
            f"GraphedCausalLM: capture size {ladder[-1]} > max_batch {max_batch}; the "
            "size-n graph uses cache rows [0, n), so every size must be <= max_batch"
        )
    return ladder, warmup_iters


def decode_options(
    opts: CaptureOptions,
    model: Any,
    *,
    ladder: list[int],
    warmup_iters: int,
    state: StateSet,
    dtype: torch.dtype,
    compile: bool | str,
) -> CaptureOptions:
    """``opts`` with what the decode runner sets itself (:data:`SET_HERE`), and a canary
    without a tolerance checking at the model dtype's."""
    return dataclasses.replace(
        opts,
        sizes=ladder,
        fill_values=(0, 0, True),  # padded rows: token 0 at position 0, finite attention
        names=("input_ids", "position_ids", "kv_valid"),
        warmup_iters=warmup_iters,
        name=opts.name or f"{type(model).__name__}.decode",
        # Capture's cache writes are restored by the runner. Declared state also
        # turns off the runner's write watch, a dispatch mode under which dynamo
        # would not compile.
        state=state,
        weights=model,  # update_weights / check_weights: the HF names
        canary=_at_model_tolerance(opts.canary, dtype),
        # Logits [n, V]: known, so a lazy stage runs no forward to learn it (the
        # time to the first token). A compile must happen at the stage: probed.
        output_batch_dims=None if compile else 0,
    )


def _at_model_tolerance(canary: Canary | None, dtype: torch.dtype) -> Canary | None:
    """The logits are float32 copies of the model's dtype: checked at float32's
    tolerance, a padded batch's one-ulp bf16 difference would read as a bug."""
    if canary is not None and canary.rtol is None and canary.atol is None:
        rtol, atol = default_tolerance(dtype)
        return dataclasses.replace(canary, rtol=rtol, atol=atol)
    return canary


__all__ = ["SET_HERE", "decode_options", "decode_sizes"]
