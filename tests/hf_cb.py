"""Continuous-batching helpers shared by tests/test_hf_continuous.py, the GPU tests and
bench/bench_hf_continuous.py: a ``ContinuousBatchingConfig`` spelt for the installed
transformers (5.17 names the page ``block_size``, 5.2x ``page_size``) and a run of
requests with per-request generation lengths through HF's manager."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any


def cb_config(*, page: int = 16, **kw: Any) -> Any:
    """``ContinuousBatchingConfig(**kw)`` with the page size under the installed name."""
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    fields = getattr(ContinuousBatchingConfig, "__dataclass_fields__", {})
    kw["page_size" if "page_size" in fields else "block_size"] = page
    return ContinuousBatchingConfig(**kw)


def run_requests(
    model: Any,
    prompts: Sequence[Sequence[int]],
    new_tokens: Sequence[int],
    *,
    generation_config: Any,
    continuous_batching_config: Any,
    timeout: float = 600.0,
    warmup: bool = True,
    persistent: bool = False,
) -> dict[str, Any]:
    """Every request through one HF manager (``model.continuous_batching_context_manager``),
    each with its own ``max_new_tokens``. Returns ``tokens`` (per request, in order),
    ``ttft_s`` (first token time less the request's creation time), ``wall_s`` and
    ``output_tokens``. ``persistent``: HF keeps the engine (cache, graphs) for the next run."""
    with model.continuous_batching_context_manager(
        generation_config=generation_config,
        continuous_batching_config=continuous_batching_config,
        block=True,
        timeout=30,
        warmup=warmup,
        persistent_manager=persistent,
    ) as manager:
        t0 = time.perf_counter()
        ids = [
            manager.add_request(list(p), max_new_tokens=int(n), record_timestamps=True)
            for p, n in zip(prompts, new_tokens)
        ]
        results: dict[str, Any] = {}
        deadline = t0 + timeout
        while len(results) < len(ids) and time.perf_counter() < deadline:
            r = manager.get_result(timeout=1)
            if r is not None and r.is_finished():
                results[r.request_id] = r
            elif r is None and not manager.is_running():
                break
        wall = time.perf_counter() - t0
    missing = [i for i in ids if i not in results]
    errors = [results[i].error for i in ids if i in results and results[i].error]
    if missing or errors:
        raise RuntimeError(f"{len(missing)} requests missing, errors: {errors[:3]}")
    ordered = [results[i] for i in ids]
    ttft = [(r.timestamps[0] - r.created_time) if r.timestamps else float("nan") for r in ordered]
    toks = [list(r.generated_tokens) for r in ordered]
    return {
        "tokens": toks,
        "ttft_s": ttft,
        "wall_s": wall,
        "output_tokens": sum(len(t) for t in toks),
    }
