"""Hugging Face causal LM decode: HF eager generate vs HF's static-cache compile vs graphguard.

Llama-3.2-1B-shaped config (hidden 2048, 16 layers, 32 heads, 8 KV heads, intermediate
8192, vocab 128256), random weights, bf16, cache 1024, batches 1, 8, 32 (prompts of 32
tokens, no EOS). ms/token is decode only: (time of a 1 + N token generate - time of a
1-token generate) / N, CUDA events after warmup, median of ``--repeats``. Rows:

- ``hf_eager``: ``model.generate(do_sample=False)`` (dynamic cache, what users get);
- ``hf_compile``: ``model.generate`` over a ``StaticCache`` of 1024, which transformers
  compiles automatically on CUDA (first-call seconds include the compile of that batch
  shape; ``--skip-compile`` leaves it out);
- ``graphguard``: ``GraphedCausalLM`` over ``capture_sizes(32)`` (ladder capture seconds).

bf16 token agreement of graphguard and HF compile with HF eager is reported (random bf16
weights have exact top-2 ties, so it is a measurement, not a check). Writes ``--out``
JSON and, with matplotlib, a PNG beside it. Run: ``python bench/bench_hf.py --out FILE``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from graphguard.integrations import _hf_support
from graphguard.integrations.transformers import TRANSFORMERS_VERSION, GraphedCausalLM

LLAMA_1B = {
    "hidden_size": 2048,
    "num_hidden_layers": 16,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "intermediate_size": 8192,
    "vocab_size": 128256,
    "max_position_embeddings": 131072,
    "tie_word_embeddings": True,
    "rope_theta": 500000.0,
    "bos_token_id": 1,
    "eos_token_id": None,
    "pad_token_id": 0,
}


def build(cache_len: int) -> Any:
    import transformers as tf

    cfg = tf.LlamaConfig(**LLAMA_1B)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = tf.LlamaForCausalLM(cfg)
    model = model.to(torch.bfloat16).eval()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    assert GraphedCausalLM.supported(model, max_cache_len=cache_len).ok
    return model


def timed(fn: Any) -> tuple[float, Any]:
    """Milliseconds of ``fn()`` on the GPU (CUDA events), and its result."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()  # type: ignore[no-untyped-call]
    out = fn()
    end.record()  # type: ignore[no-untyped-call]
    torch.cuda.synchronize()
    return start.elapsed_time(end), out  # type: ignore[no-untyped-call]


def ms_per_token(gen: Any, new: int, repeats: int) -> tuple[float, Any]:
    """Decode ms/token: median over repeats of (T(1 + new) - T(1)) / new."""
    gen(1 + new)  # warm
    samples = []
    out = None
    for _ in range(repeats):
        t_long, out = timed(lambda: gen(1 + new))
        t_one, _ = timed(lambda: gen(1))
        samples.append((t_long - t_one) / new)
    return statistics.median(samples), out


def agreement(a: Any, b: Any, prompt: int) -> float:
    return float((a[:, prompt:] == b[:, prompt:]).float().mean().item())


def bench_batch(model: Any, g: GraphedCausalLM, batch: int, args: Any, cache_kw: str) -> dict:
    """One batch size: the three paths, ms/token, first-call and agreement numbers."""
    from transformers import StaticCache

    gen = torch.Generator().manual_seed(batch)
    ids = torch.randint(3, LLAMA_1B["vocab_size"], (batch, args.prompt), generator=gen).cuda()
    mask = torch.ones_like(ids)
    row: dict[str, Any] = {"batch": batch}

    def hf(n: int) -> Any:
        return model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=n)

    def ours(n: int) -> Any:
        return g.generate(ids, mask, max_new_tokens=n)

    row["hf_eager_ms"], eager_out = ms_per_token(hf, args.new, args.repeats)
    row["graphguard_ms"], ours_out = ms_per_token(ours, args.new, args.repeats)
    row["graphguard_agree_with_hf_eager"] = agreement(ours_out, eager_out, args.prompt)
    if args.skip_compile:
        return row
    cache = StaticCache(config=model.config, max_cache_len=args.cache)

    def hfc(n: int) -> Any:
        cache.reset()
        return model.generate(
            ids, attention_mask=mask, do_sample=False, max_new_tokens=n, **{cache_kw: cache}
        )

    t1 = time.perf_counter()
    hfc(1 + args.new)
    torch.cuda.synchronize()
    row["hf_compile_first_call_s"] = time.perf_counter() - t1
    row["hf_compile_ms"], comp_out = ms_per_token(hfc, args.new, args.repeats)
    row["hf_compile_agree_with_hf_eager"] = agreement(comp_out, eager_out, args.prompt)
    return row


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="JSON path (a PNG is written beside it)")
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--cache", type=int, default=1024)
    ap.add_argument("--prompt", type=int, default=32)
    ap.add_argument("--new", type=int, default=64, help="decode tokens timed per run")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--skip-compile", action="store_true", help="leave out HF's compile path")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("bench_hf needs a CUDA GPU", file=sys.stderr)
        return 2
    batches = [int(b) for b in args.batches.split(",")]
    model = build(args.cache)
    cache_kw = _hf_support.cache_kwarg(model) or "cache"
    t0 = time.perf_counter()
    g = GraphedCausalLM(model, max_batch=max(batches), max_cache_len=args.cache, progress=False)
    build_s = time.perf_counter() - t0
    report = g.capture()
    rows = []
    for batch in batches:
        rows.append(bench_batch(model, g, batch, args, cache_kw))
        print(json.dumps(rows[-1]), flush=True)
    result = {
        "bench": "hf",
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "transformers": TRANSFORMERS_VERSION,
        "config": "Llama-3.2-1B shape, random weights, bf16, sdpa",
        "cache_len": args.cache,
        "prompt_len": args.prompt,
        "decode_tokens": args.new,
        "graphguard_build_s": build_s,
        "graphguard_capture_s": report.total_s,
        "graphguard_sizes": list(g.captured_sizes),
        "graphguard_pool_bytes": report.pool_bytes,
        "rows": rows,
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    print(f"capture of {list(g.captured_sizes)}: {report.total_s:.2f} s; wrote {out}")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return 0
    fig, ax = plt.subplots(figsize=(6, 4))
    for key, label in (
        ("hf_eager_ms", "HF eager generate"),
        ("hf_compile_ms", "HF generate + static-cache compile"),
        ("graphguard_ms", "graphguard GraphedCausalLM"),
    ):
        pts = [(r["batch"], r[key]) for r in rows if key in r]
        if pts:
            ax.plot(*zip(*pts), marker="o", label=label)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("batch")
    ax.set_ylabel("decode ms/token")
    ax.set_title(f"Llama-1B shape, bf16, cache {args.cache}, {result['gpu']}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out.with_suffix(".png"), dpi=120)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
