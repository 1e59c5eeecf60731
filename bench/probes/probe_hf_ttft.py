"""Probe: what the lazy ``GraphedCausalLM`` runs before its first token, on the GPU (issue
41: time to the first token within HF eager's + 0.2 s).

Each variant runs in a fresh process, after what ``bench_lazy.py``'s ``hf`` part runs
first (the bench's HF Llama-1B shape in bf16, one prefill forward of 8 x 32 tokens):

* ``engine``: ``GraphedCausalLM(max_batch=64, max_cache_len=256, lazy=True)`` built,
  ``capture()`` (its wall time and its report's ``total_s``), one ``generate`` of one
  token; and, before anything else in that process, the import of
  ``cuda.bindings.driver`` (what provenance needs);
* ``cache_<form>``: the engine's static cache allocated alone, three ways: ``forward64``
  (what ``build_cache`` does: one eager forward of 64 one-token rows into the
  256-position cache), ``forward1`` (one row into a 2-position cache, then the 64-row
  cache allocated from the shapes it saw), ``eager64`` (``forward64`` with the model's
  attention set to ``eager`` for that forward).

``GRAPHGUARD_COMMIT=<sha> PYTHONPATH=src python3 bench/probes/probe_hf_ttft.py --out
probe-hf-ttft.json``
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
VARIANTS = ("engine", "cache_forward64", "cache_forward1", "cache_eager64")


def _sync() -> None:
    import torch

    torch.cuda.synchronize()


def _cache(model: Any, form: str) -> Any:
    import torch
    from transformers import StaticCache
    from transformers.cache_utils import StaticLayer

    dev = next(model.parameters()).device
    if form in ("forward64", "eager64"):
        cache: Any = StaticCache(config=model.config, max_cache_len=256)
        dummy = torch.zeros((64, 1), dtype=torch.long, device=dev)
        saved = model.config._attn_implementation
        if form == "eager64":
            model.config._attn_implementation = "eager"
        try:
            model(input_ids=dummy, position_ids=dummy, use_cache=True, past_key_values=cache)
        finally:
            model.config._attn_implementation = saved
        return cache
    small: Any = StaticCache(config=model.config, max_cache_len=2)
    dummy = torch.zeros((1, 1), dtype=torch.long, device=dev)
    model(input_ids=dummy, position_ids=dummy, use_cache=True, past_key_values=small)
    cache = StaticCache(config=model.config, max_cache_len=256)
    for i, seen in enumerate(small.layers):
        layer = StaticLayer(max_cache_len=256)
        h, dt = seen.num_heads, seen.keys.dtype
        k = torch.empty((64, h, 0, seen.k_head_dim), dtype=dt, device=dev)
        v = torch.empty((64, h, 0, seen.v_head_dim), dtype=seen.values.dtype, device=dev)
        layer.lazy_initialization(k, v)
        cache.layers[i] = layer
    return cache


def child(variant: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    t = time.perf_counter()
    import torch

    out["import_torch_s"] = time.perf_counter() - t
    if variant == "engine":
        t = time.perf_counter()
        try:
            from cuda.bindings import driver  # type: ignore[import-not-found]  # noqa: F401

            out["import_cuda_bindings_s"] = time.perf_counter() - t
        except ImportError as exc:
            out["import_cuda_bindings_s"] = f"not importable: {exc}"
    sys.path.insert(0, str(ROOT / "bench"))
    sys.path.insert(0, str(ROOT / "src"))
    from bench_hf import build

    model = build(256)
    gen = torch.Generator().manual_seed(8)
    ids = torch.randint(3, model.config.vocab_size, (8, 32), generator=gen).cuda()
    mask = torch.ones_like(ids)
    with torch.inference_mode():
        model(ids, attention_mask=mask)  # the bench's first forward
        _sync()
        if variant == "engine":
            from graphguard.integrations.transformers import GraphedCausalLM

            t = time.perf_counter()
            g = GraphedCausalLM(model, max_batch=64, max_cache_len=256, progress=False, lazy=True)
            _sync()
            out["build_s"] = time.perf_counter() - t
            t = time.perf_counter()
            report = g.capture()
            _sync()
            out["capture_wall_s"] = time.perf_counter() - t
            out["capture_report_s"] = report.total_s
            t = time.perf_counter()
            g.generate(ids, mask, max_new_tokens=1)
            _sync()
            out["first_generate_s"] = time.perf_counter() - t
        else:
            t = time.perf_counter()
            cache = _cache(model, variant.removeprefix("cache_"))
            _sync()
            out["cache_s"] = time.perf_counter() - t
            out["shape"] = list(cache.layers[0].keys.shape)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path)
    ap.add_argument("--child", default=None)
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(args.child)))
        return
    runs: dict[str, list[Any]] = {v: [] for v in VARIANTS}
    for _ in range(args.rounds):
        for v in VARIANTS:
            p = subprocess.run(
                [sys.executable, __file__, "--child", v], capture_output=True, text=True
            )
            last = p.stdout.strip().splitlines()[-1] if p.stdout.strip() else ""
            runs[v].append(json.loads(last) if p.returncode == 0 else p.stderr[-2000:])
            print(v, runs[v][-1], flush=True)
    import torch

    result = {
        "probe": "hf-ttft",
        "commit": os.environ.get("GRAPHGUARD_COMMIT", "unknown"),
        "device": torch.cuda.get_device_name(),
        "rounds": args.rounds,
        "runs": runs,
    }
    if args.out:
        args.out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
