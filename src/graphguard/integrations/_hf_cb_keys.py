"""Graph keys for Hugging Face continuous-batching forward steps, and the internals they need.

HF keys its own graphs by ``(padded query tokens,)`` on the decode fast path and
``(padded query tokens, padded KV read, *max_length_k)`` on the varlen path
(``ContinuousBatchingIOs._get_graph_key``). Everything else the step is handed is
assumed constant, and a Python value outside that tuple is frozen into the graph at its
capture value: the class of bug behind transformers PR #45323 (a stale ``int`` in a graph
key). Here the key is the **whole** call: every Python value in ``batch_data`` (by
value), every tensor (address, shape, stride, dtype), the step's output buffers and the
model runner's own Python flags (``do_sample``, ``return_logprobs``, the logits
processors' ``do_processing``). Two steps with one key hand the forward the same Python
values and the same storages, so a graph replayed for a key can only differ from eager
by what the forward reads from outside its arguments, which the canary watches.

A value that cannot be keyed (a NaN float, an object of a type not listed here) is
refused with :class:`~graphguard.errors.UnsupportedModelError` naming the argument.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from graphguard.errors import UnsupportedModelError

SUPPORTED = ((5, 17), (6, 0))
"""transformers versions accepted: >= 5.17, < 6 (tested: 5.17 on the H200, 5.24 on CPU)."""

RUNNER_ATTRS = (
    "compute_batch",
    "_get_forward_fn",
    "supports_logits_to_keep",
    "pad_inputs",
    "inputs_and_outputs",
    "do_sample",
    "return_logprobs",
    "logit_processor",
)
"""What the integration reads or sets on HF's ``ModelRunner`` (5.17 through 5.24)."""

IO_ATTRS = ("get_cb_kwargs", "use_block_table", "use_cuda_graph_varlen", "compute_stream")
"""What it reads or sets on HF's ``ContinuousBatchingIOs``."""

MANAGER_ATTRS = ("_create_batch_processor", "batch_processor", "continuous_batching_config")
"""What it wraps or reads on HF's ``ContinuousBatchingManager``."""

_SCALARS = (bool, int, str, type(None))


def version_tuple(version: str) -> tuple[int, int]:
    """``"5.17.0.dev0"`` -> ``(5, 17)``."""
    parts = version.split(".")
    return int(parts[0]), int("".join(c for c in parts[1] if c.isdigit()) or 0)


def version_problem(version: str) -> str | None:
    """Why continuous batching under graphguard refuses this transformers version, or None."""
    lo, hi = SUPPORTED
    if lo <= version_tuple(version) < hi:
        return None
    return (
        f"transformers {version} is outside the range graphguard's continuous-batching "
        f"integration supports (>={lo[0]}.{lo[1]},<{hi[0]}.{hi[1]}): the model runner, IO "
        "and graph key it hooks differ; install a version in range or run HF's eager "
        "continuous batching"
    )


def missing_internals(obj: Any, attrs: tuple[str, ...], what: str, version: str) -> str | None:
    """``None`` when ``obj`` has every attribute the integration relies on; else why not."""
    missing = [a for a in attrs if not hasattr(obj, a)]
    if not missing:
        return None
    return (
        f"HF's {what} ({type(obj).__name__}) in transformers {version} has no "
        f"{', '.join(missing)}: an internal this integration hooks changed; nothing was "
        "graphed (run HF's eager continuous batching, or a transformers version in "
        f">={SUPPORTED[0][0]}.{SUPPORTED[0][1]},<{SUPPORTED[1][0]}.{SUPPORTED[1][1]})"
    )


def _sig(x: Any, path: str) -> Any:
    """A hashable stand-in for ``x``: by value for Python scalars, by storage and layout
    for tensors; refused (``UnsupportedModelError``) for what has neither."""
    if isinstance(x, torch.Tensor):
        return ("T", x.data_ptr(), x.shape, x.stride(), x.dtype, x.device)
    if isinstance(x, _SCALARS):
        return (type(x).__name__, x)
    if isinstance(x, float):
        if math.isnan(x):
            raise UnsupportedModelError(
                f"continuous batching step argument {path} is NaN: a Python float the graph "
                "would bake in, and NaN cannot key a graph (NaN != NaN); nothing was captured",
                reasons=(f"{path} is NaN",),
            )
        return ("float", x)
    if isinstance(x, Mapping):
        return ("D", tuple((k, _sig(v, f"{path}[{k!r}]")) for k, v in x.items()))
    if isinstance(x, (list, tuple)):
        return ("L", tuple(_sig(v, f"{path}[{i}]") for i, v in enumerate(x)))
    if type(x).__name__ == "PagedAttentionCache":
        return ("cache", id(x))  # HF's one cache object: its tensors never move
    raise UnsupportedModelError(
        f"continuous batching step argument {path} is a {type(x).__name__}: not a tensor, "
        "Python scalar, list or dict, so graphguard cannot tell whether a graph captured "
        "with it is still valid; nothing was captured. Pass tensors or Python scalars "
        "(each distinct scalar value gets its own graph)",
        reasons=(f"{path}: {type(x).__name__}",),
    )


_Tensor, _None = torch.Tensor, type(None)


def _fast(x: Any) -> Any:
    """:func:`_sig` for the exact types HF's steps are handed (the per-step path): the
    same values, without building an argument path per element (only an error needs
    one). Anything else raises ``TypeError``, and the whole key is taken by :func:`_sig`
    (which is the reference: it gives the same value, or refuses naming the argument)."""
    t = type(x)
    if t is _Tensor:
        return ("T", x.data_ptr(), x.shape, x.stride(), x.dtype, x.device)
    if t is dict:
        return ("D", tuple([(k, _fast(v)) for k, v in x.items()]))
    if t is list or t is tuple:
        return ("L", tuple([_fast(v) for v in x]))
    if t is int or t is bool or t is str or t is _None:
        return (t.__name__, x)
    if t is float and x == x:  # not NaN
        return ("float", x)
    if t.__name__ == "PagedAttentionCache":
        return ("cache", id(x))
    raise TypeError(t.__name__)


def signature(
    batch_data: Mapping[str, Any], buffers: list[torch.Tensor], flags: tuple[Any, ...]
) -> tuple[Any, ...]:
    """The full key of one forward step (see the module docstring): every argument in
    ``batch_data``, the step's output ``buffers`` and the model runner's ``flags``."""
    try:
        return (_fast(batch_data), _fast(buffers), flags)
    except TypeError:
        return (_sig(batch_data, "batch_data"), _sig(buffers, "outputs"), flags)


def scalars(batch_data: Mapping[str, Any]) -> dict[str, Any]:
    """The Python values among the step's arguments (what a graph bakes in), for messages."""
    out: dict[str, Any] = {}
    for k, v in batch_data.items():
        if isinstance(v, (*_SCALARS, float)) and v is not None:
            out[k] = v
        elif isinstance(v, Mapping) and all(isinstance(x, (int, float)) for x in v.values()):
            out[k] = dict(v)
    return out


@dataclass
class StepKey:
    """One graph's key: the full signature, plus what a person reads in stats and logs."""

    sig: tuple[Any, ...]
    path: str
    """``"decode"`` (HF's block-table fast path) or ``"varlen"``."""
    q_tokens: int
    kv_read: int
    hf_key: tuple[int, ...]
    """What HF's own graph cache would key this step by."""
    baked: dict[str, Any] = field(default_factory=dict)
    """Python values of the step's arguments (each part of ``sig``)."""

    def __str__(self) -> str:
        baked = " ".join(f"{k}={v}" for k, v in self.baked.items())
        return f"{self.path} q={self.q_tokens} kv={self.kv_read} {baked}".strip()


def step_key(
    batch_data: Mapping[str, Any], sig: tuple[Any, ...], hf_key: tuple[int, ...]
) -> StepKey:
    """What a person reads about a step whose :func:`signature` is ``sig`` (built once
    per new key, never on the per-step path)."""
    block = batch_data.get("block_table")
    reads = batch_data.get("read_index") or []
    kv = int(reads[0].shape[-1]) if reads and isinstance(reads[0], torch.Tensor) else 0
    ids = batch_data.get("input_ids")
    q = int(ids.shape[-1]) if isinstance(ids, torch.Tensor) else 0
    return StepKey(
        sig=sig,
        path="decode" if block is not None else "varlen",
        q_tokens=q,
        kv_read=kv,
        hf_key=hf_key,
        baked=scalars(batch_data),
    )


__all__ = [
    "IO_ATTRS",
    "MANAGER_ATTRS",
    "RUNNER_ATTRS",
    "SUPPORTED",
    "StepKey",
    "missing_internals",
    "scalars",
    "signature",
    "step_key",
    "version_problem",
    "version_tuple",
]
