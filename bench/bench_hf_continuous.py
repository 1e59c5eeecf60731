"""HF continuous batching: eager vs HF's own CUDA graphs vs graphguard (issue 32).

Llama-3.2-1B-shaped config (hidden 2048, 16 layers, 32 heads, 8 KV heads, intermediate
8192, vocab 128256), random weights, bf16, ``--attn`` (default ``sdpa``). Workload (seeded):
``--requests`` (64) requests, prompts uniform in [16, 512] tokens, generation lengths
uniform in [16, 256] (per request, through the manager API: ``add_request(...,
max_new_tokens=n)``), no EOS. Paths, each on its own persistent HF engine of the same
``ContinuousBatchingConfig`` (page 256, ``--num-blocks``, ``--max-batch-tokens``, HF's
default padding intervals), destroyed before the next path:

- ``hf_eager``: ``use_cuda_graph=False``;
- ``hf_graphs``: ``use_cuda_graph=True`` (HF captures lazily per padded (q, kv) key);
- ``graphguard``: ``GraphedContinuousBatching`` (a graph per full step key, lazily).

Each path runs the workload twice: ``first`` (HF's warmup and every capture included)
and ``warm`` (the same engine again). Per run: output tokens/s (generated tokens / wall
seconds from the first ``add_request`` to the last result), time to first token per
request (first token's timestamp less the request's creation; mean, p50, p90). Graph
memory: device memory in use after the first run less the eager path's (both hold the
same paged cache), and graphguard's own ledger (``stats()["graph_bytes"]``). Greedy
agreement with ``hf_eager`` per request (bf16: random weights have near ties, so it is a
measurement: requests identical, and the mean fraction of tokens before the first
difference). JSON to ``--out`` (rewritten after each path); a PNG beside it with
matplotlib. About 2-3 minutes on an H200.

Run: ``PYTHONPATH=src:ref/src python bench/bench_hf_continuous.py --out
bench/results/hf-continuous_NVIDIA-H200_<date>.json``.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT))

import transformers  # noqa: E402
from tests.hf_cb import cb_config, run_requests  # noqa: E402
from transformers import GenerationConfig  # noqa: E402

from graphguard.integrations.hf_continuous import GraphedContinuousBatching  # noqa: E402

PATHS = ("hf_eager", "hf_graphs", "graphguard")


def build_model(attn: str) -> Any:
    cfg = transformers.LlamaConfig(
        hidden_size=2048,
        intermediate_size=8192,
        num_hidden_layers=16,
        num_attention_heads=32,
        num_key_value_heads=8,
        vocab_size=128256,
        max_position_embeddings=4096,
        rope_theta=500000.0,
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    cfg._attn_implementation = attn
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = transformers.AutoModelForCausalLM.from_config(cfg)
    return model.to(torch.bfloat16).eval()


def workload(n: int, seed: int) -> tuple[list[list[int]], list[int]]:
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(16, 513, (n,), generator=g).tolist()
    news = torch.randint(16, 257, (n,), generator=g).tolist()
    prompts = [torch.randint(3, 128000, (k,), generator=g).tolist() for k in lens]
    return prompts, news


def used_bytes() -> int:
    torch.cuda.synchronize()
    gc.collect()
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info()
    return total - free


def summary(run: dict[str, Any]) -> dict[str, Any]:
    ttft = sorted(t for t in run["ttft_s"] if t == t)
    q = lambda p: ttft[min(len(ttft) - 1, int(p * len(ttft)))] if ttft else None  # noqa: E731
    return {
        "wall_s": run["wall_s"],
        "output_tokens": run["output_tokens"],
        "tokens_per_s": run["output_tokens"] / run["wall_s"],
        "ttft_mean_s": statistics.fmean(ttft) if ttft else None,
        "ttft_p50_s": q(0.5),
        "ttft_p90_s": q(0.9),
    }


def agreement(tokens: list[list[int]], ref: list[list[int]]) -> dict[str, Any]:
    same, prefix = 0, []
    for a, b in zip(tokens, ref):
        same += a == b
        k = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        prefix.append(k / max(1, len(b)))
    return {"identical": same, "of": len(ref), "mean_prefix_fraction": statistics.fmean(prefix)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--attn", default="sdpa")
    ap.add_argument("--num-blocks", type=int, default=512)
    ap.add_argument("--max-batch-tokens", type=int, default=1024)
    ap.add_argument("--max-graphs", type=int, default=256)
    ap.add_argument("--skip", default="", help="comma-separated paths to leave out")
    args = ap.parse_args()
    skip = {s for s in args.skip.split(",") if s}

    model = build_model(args.attn)
    prompts, news = workload(args.requests, args.seed)
    gen = GenerationConfig(
        max_new_tokens=max(news), do_sample=False, eos_token_id=-1, pad_token_id=0
    )
    result: dict[str, Any] = {
        "commit": os.environ.get("GRAPHGUARD_COMMIT", "unknown"),
        "date": time.strftime("%Y-%m-%d"),
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "attn": args.attn,
        "requests": args.requests,
        "prompt_tokens": sum(map(len, prompts)),
        "max_new_tokens": news,
        "num_blocks": args.num_blocks,
        "max_batch_tokens": args.max_batch_tokens,
        "paths": {},
    }
    base = used_bytes()
    ref_tokens: list[list[int]] | None = None

    def save() -> None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2))

    for path in PATHS:
        if path in skip:
            continue
        row: dict[str, Any] = {}
        result["paths"][path] = row
        cfg = cb_config(
            page=256,
            num_blocks=args.num_blocks,
            max_batch_tokens=args.max_batch_tokens,
            use_cuda_graph=path == "hf_graphs",
            use_async_batching=False,
        )
        kw = {"generation_config": gen, "continuous_batching_config": cfg, "persistent": True}
        cb = None
        try:
            if path == "graphguard":
                cb = GraphedContinuousBatching(model, max_graphs=args.max_graphs, progress=False)
                ctx = cb.installed()
            else:
                import contextlib

                ctx = contextlib.nullcontext()
            with ctx:
                for run_name in ("first", "warm"):
                    t = time.perf_counter()
                    run = run_requests(model, prompts, news, **kw)
                    row[run_name] = summary(run)
                    row[run_name]["call_s"] = time.perf_counter() - t
                    if run_name == "first":
                        row["memory_after_first_bytes"] = used_bytes() - base
                        if path == "hf_eager":
                            ref_tokens = run["tokens"]
                        elif ref_tokens is not None:
                            row["agreement_with_hf_eager"] = agreement(run["tokens"], ref_tokens)
                    print(path, run_name, json.dumps(row[run_name]), flush=True)
            if cb is not None:
                st = cb.stats()
                row["graphguard_graph_bytes"] = st["graph_bytes"]
                row["graphguard_keys"] = st["keys"]
                row["graphguard_captured"] = st["captured"]
                row["graphguard_eager_table_full"] = st["eager_table_full"]
                print(st["runner"], flush=True)
        except Exception as exc:  # one path's failure is its row, the others still run
            row["error"] = f"{type(exc).__name__}: {exc}"
            print(path, "failed:", row["error"], flush=True)
        finally:
            if cb is not None:
                cb.close()
            else:
                model.destroy_cached_continuous_batching_manager()
        save()

    eager = result["paths"].get("hf_eager", {}).get("memory_after_first_bytes")
    for path in ("hf_graphs", "graphguard"):
        row = result["paths"].get(path, {})
        if eager is not None and "memory_after_first_bytes" in row:
            row["graph_memory_bytes_vs_eager"] = row["memory_after_first_bytes"] - eager
    save()
    print(json.dumps(result["paths"], indent=1))
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    names = [p for p in PATHS if "first" in result["paths"].get(p, {})]
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for i, run_name in enumerate(("first", "warm")):
        vals = [result["paths"][p][run_name]["tokens_per_s"] for p in names]
        axes[0].bar([j + 0.4 * i for j in range(len(names))], vals, width=0.4, label=run_name)
        ttft = [result["paths"][p][run_name]["ttft_p50_s"] or 0 for p in names]
        axes[1].bar([j + 0.4 * i for j in range(len(names))], ttft, width=0.4, label=run_name)
    for ax, title in zip(axes, ("output tokens/s", "TTFT p50 (s)")):
        ax.set_xticks([j + 0.2 for j in range(len(names))], names)
        ax.set_title(title)
        ax.legend()
    fig.suptitle(
        f"HF continuous batching, Llama-1B shape bf16, {args.requests} requests "
        f"({result['device']}, transformers {result['transformers']})"
    )
    fig.tight_layout()
    fig.savefig(args.out.with_suffix(".png"), dpi=120)


if __name__ == "__main__":
    main()
