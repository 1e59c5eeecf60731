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
weights have exact top-2 ties, so it is a measurement, not a check).

Order: HF eager and graphguard for every batch first, then HF compile for every batch
(``--interleave``: the three per batch, which is how the "cuBLAS workspace freed after
capture" fault was found: HF's reduce-overhead compile frees torch's cached cuBLAS
workspaces). Each path's failure is caught into its row (``<path>_error``); after a CUDA
error the context is lost, so later GPU paths are recorded as skipped. Every row is
printed when it finishes and ``--out`` is rewritten after each path, so a crash keeps
what ran. With matplotlib, a PNG is written beside ``--out``.
Run: ``python bench/bench_hf.py --out FILE``.
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


class Paths:
    """The three paths of one run, each failure caught into its row."""

    def __init__(self, model: Any, g: GraphedCausalLM, args: Any, cache_kw: str) -> None:
        self.model, self.g, self.args, self.cache_kw = model, g, args, cache_kw
        self.inputs: dict[int, tuple[Any, Any]] = {}
        self.eager_out: dict[int, Any] = {}
        self.cuda_lost: str | None = None  # set by the first CUDA error: the context is gone

    def _inputs(self, batch: int) -> tuple[Any, Any]:
        if batch not in self.inputs:
            gen = torch.Generator().manual_seed(batch)
            shape = (batch, self.args.prompt)
            ids = torch.randint(3, LLAMA_1B["vocab_size"], shape, generator=gen).cuda()
            self.inputs[batch] = (ids, torch.ones_like(ids))
        return self.inputs[batch]

    def run(self, path: str, row: dict[str, Any]) -> None:
        """Fill ``row`` with ``path``'s numbers, or ``<path>_error``."""
        if self.cuda_lost is not None:
            row[f"{path}_error"] = f"skipped: CUDA context lost ({self.cuda_lost})"
            return
        try:
            getattr(self, path)(row["batch"], row)
        except Exception as exc:  # recorded, the bench goes on with the other paths
            msg = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
            row[f"{path}_error"] = msg
            print(f"batch {row['batch']} {path} failed: {msg}", file=sys.stderr, flush=True)
            if "CUDA error" in str(exc) or type(exc).__name__ == "AcceleratorError":
                self.cuda_lost = f"{path} at batch {row['batch']}: {msg}"

    def hf_eager(self, batch: int, row: dict[str, Any]) -> None:
        ids, mask = self._inputs(batch)

        def hf(n: int) -> Any:
            return self.model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=n)

        row["hf_eager_ms"], self.eager_out[batch] = ms_per_token(
            hf, self.args.new, self.args.repeats
        )

    def graphguard(self, batch: int, row: dict[str, Any]) -> None:
        ids, mask = self._inputs(batch)

        def ours(n: int) -> Any:
            return self.g.generate(ids, mask, max_new_tokens=n)

        row["graphguard_ms"], out = ms_per_token(ours, self.args.new, self.args.repeats)
        if batch in self.eager_out:
            row["graphguard_agree_with_hf_eager"] = agreement(
                out, self.eager_out[batch], self.args.prompt
            )

    def hf_compile(self, batch: int, row: dict[str, Any]) -> None:
        from transformers import StaticCache

        ids, mask = self._inputs(batch)
        cache = StaticCache(config=self.model.config, max_cache_len=self.args.cache)

        def hfc(n: int) -> Any:
            cache.reset()
            return self.model.generate(
                ids,
                attention_mask=mask,
                do_sample=False,
                max_new_tokens=n,
                **{self.cache_kw: cache},
            )

        t1 = time.perf_counter()
        hfc(1 + self.args.new)
        torch.cuda.synchronize()
        row["hf_compile_first_call_s"] = time.perf_counter() - t1
        row["hf_compile_ms"], out = ms_per_token(hfc, self.args.new, self.args.repeats)
        if batch in self.eager_out:
            row["hf_compile_agree_with_hf_eager"] = agreement(
                out, self.eager_out[batch], self.args.prompt
            )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="JSON path (a PNG is written beside it)")
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--cache", type=int, default=1024)
    ap.add_argument("--prompt", type=int, default=32)
    ap.add_argument("--new", type=int, default=64, help="decode tokens timed per run")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--skip-compile", action="store_true", help="leave out HF's compile path")
    ap.add_argument(
        "--interleave",
        action="store_true",
        help="per batch: HF eager, graphguard, HF compile (default: HF compile last)",
    )
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
    print(f"capture of {list(g.captured_sizes)}: {report.total_s:.2f} s", flush=True)
    result: dict[str, Any] = {
        "bench": "hf",
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "transformers": TRANSFORMERS_VERSION,
        "config": "Llama-3.2-1B shape, random weights, bf16, sdpa",
        "cache_len": args.cache,
        "prompt_len": args.prompt,
        "decode_tokens": args.new,
        "order": "interleaved" if args.interleave else "hf_compile last",
        "graphguard_build_s": build_s,
        "graphguard_capture_s": report.total_s,
        "graphguard_sizes": list(g.captured_sizes),
        "graphguard_pool_bytes": report.pool_bytes,
        "rows": [],
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    paths = Paths(model, g, args, cache_kw)
    rows: dict[int, dict[str, Any]] = {}
    first = ["hf_eager", "graphguard"] + ([] if args.skip_compile else ["hf_compile"])
    plan = (
        [(b, p) for b in batches for p in first]
        if args.interleave
        else [(b, p) for b in batches for p in first if p != "hf_compile"]
        + [(b, "hf_compile") for b in batches if "hf_compile" in first]
    )
    for batch, path in plan:
        row = rows.setdefault(batch, {"batch": batch})
        paths.run(path, row)
        print(json.dumps({"path": path, **row}), flush=True)
        result["rows"] = [rows[b] for b in batches if b in rows]
        out.write_text(json.dumps(result, indent=2))
    print(f"wrote {out}", flush=True)
    rows_out: list[dict[str, Any]] = result["rows"]
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
        pts = [(r["batch"], r[key]) for r in rows_out if key in r]
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
