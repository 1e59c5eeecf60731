"""What a ``GraphedContinuousBatching.generate_batch`` call hands HF: checked prompts, and
requests with a generation length each.

Why the prompts are checked here. HF's engine takes the prompts as they come: a token id
past the vocabulary fails inside the step (on a GPU, a device-side assert that takes the
CUDA context with it), a float id is truncated (``6.5`` runs as ``6``), an empty prompt
comes back FAILED or generated from no context (by version: 5.24 generates), and a
tensor of prompts fails on HF's ``if not inputs``
with torch's "Boolean value of Tensor with more than one value is ambiguous". Each is
refused here, before any engine, key or graph exists, with a
:class:`~graphguard.errors.ConfigError` that names the argument, the request, the value and
what to pass. (Any exception a step still raises is kept local by
:mod:`._hf_cb_step`: its key is forgotten, nothing is replayed from it.)

Why requests of their own lengths. HF's ``generate_batch`` takes one ``max_new_tokens``
for every prompt; RL rollouts (and ``transformers serve``) have a budget per request.
:func:`generate_each` drives HF's manager as ``generate_batch`` does, one ``add_request``
per prompt with its ``max_new_tokens``.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from typing import Any

import torch

from graphguard.errors import ConfigError


def vocabulary(model: Any) -> int:
    """How many token ids ``model`` embeds (its input embedding's rows, else the config's
    ``vocab_size``): ids must lie in ``[0, vocabulary)``."""
    get = getattr(model, "get_input_embeddings", None)
    emb = get() if callable(get) else None
    rows = getattr(emb, "num_embeddings", None)
    if isinstance(rows, int):
        return rows
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else None
    return int((config or model.config).vocab_size)


def _token(x: Any, where: str, vocab: int, fix: str) -> int:
    if isinstance(x, torch.Tensor):
        if x.dim() != 0:
            raise ConfigError(f"{where} is a {x.dim()}-D tensor, not a token id; {fix}")
        if x.dtype == torch.bool or x.dtype.is_floating_point or x.dtype.is_complex:
            raise ConfigError(f"{where} is a {x.dtype} tensor {x.item()!r}; {fix}")
        x = x.item()
    if isinstance(x, (bool, float)) or not hasattr(x, "__index__"):
        raise ConfigError(f"{where} is {x!r:.40} ({type(x).__name__}), not an int; {fix}")
    t = operator.index(x)
    if not 0 <= t < vocab:
        raise ConfigError(f"{where} is {t}, outside the vocabulary [0, {vocab}); {fix}")
    return t


def check_prompts(inputs: Any, vocab: int, where: str) -> list[list[int]]:
    """``inputs`` as lists of Python ints, each prompt non-empty and every id in
    ``[0, vocab)``; else a :class:`ConfigError` naming ``inputs[i][j]``, the value and what
    to pass. Accepts a list or tuple of prompts, each a list or tuple of ints (numpy ints
    too) or a 1-D integer tensor."""
    fix = (
        f"pass a list of prompts, each a non-empty list of int token ids in [0, {vocab}) "
        "(or a 1-D integer tensor); nothing was run"
    )
    if isinstance(inputs, torch.Tensor) or hasattr(inputs, "__array__"):
        dtype = getattr(inputs, "dtype", "?")
        raise ConfigError(
            f"{where}: inputs is a {type(inputs).__name__} of {dtype} (shape "
            f"{tuple(getattr(inputs, 'shape', ()))}), not a list of prompts; {fix} (e.g. "
            "[row[mask].tolist() for row, mask in zip(ids, attention_mask.bool())])"
        )
    if not isinstance(inputs, (list, tuple)):
        raise ConfigError(f"{where}: inputs is a {type(inputs).__name__}; {fix}")
    out: list[list[int]] = []
    for i, prompt in enumerate(inputs):
        at = f"{where}: inputs[{i}]"
        if isinstance(prompt, torch.Tensor):
            if prompt.dim() != 1:
                raise ConfigError(f"{at} is a {prompt.dim()}-D tensor; {fix}")
            if prompt.dtype == torch.bool or not _integer(prompt.dtype):
                raise ConfigError(f"{at} is a {prompt.dtype} tensor; {fix}")
            ids = prompt.tolist()
        elif isinstance(prompt, (list, tuple)) or hasattr(prompt, "__array__"):
            ids = list(prompt)
        else:
            raise ConfigError(f"{at} is a {type(prompt).__name__}, not a list of ids; {fix}")
        if not ids:
            raise ConfigError(
                f"{at} is empty: a request needs at least one prompt token (HF's engine "
                f"fails it or generates from no context, by version); {fix}"
            )
        out.append([_token(x, f"{at}[{j}]", vocab, fix) for j, x in enumerate(ids)])
    return out


def _integer(dtype: torch.dtype) -> bool:
    return not (dtype.is_floating_point or dtype.is_complex or dtype == torch.bool)


def check_new_tokens(new_tokens: Any, n: int, where: str) -> list[int] | None:
    """``max_new_tokens`` for ``n`` requests: one int >= 1 for all (None returned: HF's
    own form), or one per request, ``n`` ints >= 1 (the list). Both forms refuse the same
    values: HF takes an int below 1 and returns every request finished and empty, while
    still running forward steps."""
    fix = f"pass one int >= 1 for every request ({n}), or one int for all"
    if isinstance(new_tokens, int) and not isinstance(new_tokens, bool):
        if new_tokens < 1:
            raise ConfigError(f"{where}: max_new_tokens is {new_tokens!r:.40}; {fix}")
        return None
    if isinstance(new_tokens, torch.Tensor):
        new_tokens = new_tokens.tolist()
    if not isinstance(new_tokens, Sequence) or isinstance(new_tokens, str):
        raise ConfigError(f"{where}: max_new_tokens is {new_tokens!r:.40}; {fix}")
    if len(new_tokens) != n:
        raise ConfigError(f"{where}: max_new_tokens has {len(new_tokens)} values; {fix}")
    out = []
    for i, v in enumerate(new_tokens):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ConfigError(f"{where}: max_new_tokens[{i}] is {v!r:.40}; {fix}")
        out.append(v)
    return out


def generate_each(
    model: Any,
    prompts: list[list[int]],
    new_tokens: list[int],
    *,
    generation_config: Any,
    continuous_batching_config: Any,
    warmup: bool,
    record_timestamps: bool = False,
) -> dict[str, Any]:
    """HF's ``generate_batch`` loop with one ``max_new_tokens`` per request: the model's
    (persistent) manager, one ``add_request`` each, results in input order (children of
    ``num_return_sequences`` after their parent, as HF orders them). A request HF did not
    return is left out (the caller counts it missing)."""
    from transformers.generation.continuous_batching.utils import WorkloadHints

    gen = generation_config if generation_config is not None else model.generation_config
    copies = getattr(gen, "num_return_sequences", None) or 1
    hints = WorkloadHints(
        max_prompt_length=max(len(p) for p in prompts),
        max_generated_length=max(new_tokens),
        num_requests=len(prompts) * copies,
    )
    results: dict[str, Any] = {}
    with model.continuous_batching_context_manager(
        generation_config=generation_config,
        continuous_batching_config=continuous_batching_config,
        block=True,
        timeout=5,
        persistent_manager=True,
        warmup=warmup,
        workload_hints=hints,
    ) as manager:
        ids = [
            manager.add_request(p, max_new_tokens=n, record_timestamps=record_timestamps)
            for p, n in zip(prompts, new_tokens)
        ]
        wanted = [
            rid
            for parent in ids
            if parent is not None
            for rid in (*(f"{parent}__child#{c}" for c in range(copies - 1)), parent)
        ]
        while len(results) < len(wanted):
            r = manager.get_result(timeout=1)
            if r is not None:
                if r.is_finished():
                    results[r.request_id] = r
            elif not manager.is_running():
                break
    return {rid: results[rid] for rid in wanted if rid in results}


__all__ = ["check_new_tokens", "check_prompts", "generate_each", "vocabulary"]
