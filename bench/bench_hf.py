"""Hugging Face causal LM decode: HF eager generate vs HF's static-cache compile vs graphguard
(graphs of HF's eager kernels, and of Inductor-compiled steps).

Llama-3.2-1B-shaped config (hidden 2048, 16 layers, 32 heads, 8 KV heads, intermediate
8192, vocab 128256), random weights, bf16, cache 1024, batches 1, 8, 32 (prompts of 32
tokens, no EOS). ms/token is decode only: (time of a 1 + N token generate - time of a
1-token generate) / N, CUDA events after warmup, median of ``--repeats``. Rows:

- ``hf_eager``: ``model.generate(do_sample=False)`` (dynamic cache, what users get);
- ``hf_compile``: ``model.generate`` over a ``StaticCache`` of 1024, which transformers
  compiles automatically on CUDA (first-call seconds include the compile of that batch
  shape; ``--skip-compile`` leaves it out);
- ``graphguard``: ``GraphedCausalLM`` over ``capture_sizes(32)`` (ladder capture seconds);
- ``graphguard_compile``: ``GraphedCausalLM(..., compile=True)`` over
  ``compiled_capture_sizes(32)`` (batch 1 pads to 2; ``--compile-sizes`` overrides):
  one Inductor compile (no Inductor CUDA graphs) of the decoder block, which serves every
  layer and every size, then graphs of the compiled kernels.
  ``graphguard_compile_capture_s`` is the whole ladder's capture *including* that
  compile (``graphguard_compile_compile_s`` of it), the number to set against
  ``hf_compile_first_call_s`` (HF's compile of one batch shape);
- ``graphguard_compile_model``: the same with ``compile="model"``: the whole model call
  compiled at once (all layers traced; longer compile, inter-layer fusion).

``--cold-cache`` points the Inductor and Triton caches at a fresh folder first, so
compile seconds are first-compile seconds rather than on-disk cache hits. ``--skip``
leaves paths out (e.g. ``--skip hf_eager,graphguard``).

bf16 token agreement of the graphguard paths and HF compile with HF eager is reported
(random bf16 weights have exact top-2 ties, so it is a measurement, not a check).

Both graphguard ladders are captured first. Order: HF eager and both graphguard paths
for every batch, then HF compile for every batch (``--interleave``: all paths per batch,
which is how the "cuBLAS workspace freed after capture" fault was found: HF's
reduce-overhead compile frees torch's cached cuBLAS workspaces). Each path's failure is
caught into its row (``<path>_error``; a failed capture into ``<path>_capture_error``);
after a CUDA error the context is lost, so later GPU paths are recorded as skipped.
Every row is printed when it finishes and ``--out`` is rewritten after each path, so a
crash keeps what ran. With matplotlib, a PNG is written beside ``--out``.
Run: ``python bench/bench_hf.py --out FILE --cold-cache``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "ref" / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from graphguard.integrations import _hf_support
from graphguard.integrations.transformers import TRANSFORMERS_VERSION, GraphedCausalLM

PATHS = ("hf_eager", "graphguard", "graphguard_compile", "graphguard_compile_model", "hf_compile")
COMPILE = {"graphguard_compile": True, "graphguard_compile_model": "model"}
"""``GraphedCausalLM(compile=...)`` of the compiled paths: the decoder block, the model call."""

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
    """The paths of one run, each failure caught into its row."""

    def __init__(
        self,
        model: Any,
        graphed: dict[str, GraphedCausalLM],
        args: Any,
        cache_kw: str,
    ) -> None:
        self.model, self.graphed, self.args, self.cache_kw = model, graphed, args, cache_kw
        self.inputs: dict[int, tuple[Any, Any]] = {}
        self.eager_out: dict[int, Any] = {}
        self.graphed_out: dict[str, dict[int, Any]] = {}
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

    def _graphed(self, path: str, batch: int, row: dict[str, Any]) -> None:
        if path not in self.graphed:
            raise RuntimeError(f"{path} was not captured (see {path}_capture_error)")
        g = self.graphed[path]
        ids, mask = self._inputs(batch)

        def ours(n: int) -> Any:
            return g.generate(ids, mask, max_new_tokens=n)

        row[f"{path}_ms"], out = ms_per_token(ours, self.args.new, self.args.repeats)
        row[f"{path}_replays_size"] = g.runner.padded_size(batch)
        if batch in self.eager_out:
            row[f"{path}_agree_with_hf_eager"] = agreement(
                out, self.eager_out[batch], self.args.prompt
            )
        self.graphed_out.setdefault(path, {})[batch] = out
        if path in COMPILE and batch in self.graphed_out.get("graphguard", {}):
            row[f"{path}_agree_with_graphguard"] = agreement(
                out, self.graphed_out["graphguard"][batch], self.args.prompt
            )

    def graphguard(self, batch: int, row: dict[str, Any]) -> None:
        self._graphed("graphguard", batch, row)

    def graphguard_compile(self, batch: int, row: dict[str, Any]) -> None:
        self._graphed("graphguard_compile", batch, row)

    def graphguard_compile_model(self, batch: int, row: dict[str, Any]) -> None:
        self._graphed("graphguard_compile_model", batch, row)

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


def capture_path(
    path: str, model: Any, batches: list[int], args: Any, graphed: dict[str, GraphedCausalLM]
) -> dict[str, Any]:
    """Build and capture ``path``'s GraphedCausalLM; its capture numbers for the JSON."""
    compile = COMPILE.get(path, False)
    sizes = None
    if compile and args.compile_sizes:
        sizes = [int(s) for s in args.compile_sizes.split(",")]
    t0 = time.perf_counter()
    g = GraphedCausalLM(
        model,
        max_batch=max(batches),
        max_cache_len=args.cache,
        sizes=sizes,
        progress=False,
        compile=compile,
    )
    build_s = time.perf_counter() - t0
    report = g.capture()
    graphed[path] = g
    print(f"{path}: {report.summary()}", flush=True)
    numbers: dict[str, Any] = {
        f"{path}_build_s": build_s,
        f"{path}_capture_s": report.total_s,
        f"{path}_sizes": list(g.captured_sizes),
        f"{path}_pool_bytes": report.pool_bytes,
    }
    if compile:
        numbers[f"{path}_compile_s"] = report.compile_s
        numbers[f"{path}_compiles"] = report.compiles
        numbers[f"{path}_recompiles"] = report.recompiles
    return numbers


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
        "--skip",
        default="",
        help=f"comma-separated paths to leave out, of {','.join(PATHS)}",
    )
    ap.add_argument(
        "--compile-sizes",
        default=None,
        help="capture sizes of graphguard_compile (default: compiled_capture_sizes(max batch))",
    )
    ap.add_argument(
        "--cold-cache",
        action="store_true",
        help="fresh Inductor/Triton cache folders: compile seconds without on-disk cache hits",
    )
    ap.add_argument(
        "--interleave",
        action="store_true",
        help="per batch: every path in turn (default: HF compile last, after every batch)",
    )
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("bench_hf needs a CUDA GPU", file=sys.stderr)
        return 2
    skip = {p for p in args.skip.split(",") if p}
    if skip - set(PATHS):
        print(f"--skip: unknown paths {sorted(skip - set(PATHS))}; of {PATHS}", file=sys.stderr)
        return 2
    if args.skip_compile:
        skip.add("hf_compile")
    paths_run = [p for p in PATHS if p not in skip]
    if args.cold_cache:
        import tempfile

        fresh = tempfile.mkdtemp(prefix="bench_hf_cache_")
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(fresh, "inductor")
        os.environ["TRITON_CACHE_DIR"] = os.path.join(fresh, "triton")
    batches = [int(b) for b in args.batches.split(",")]
    model = build(args.cache)
    cache_kw = _hf_support.cache_kwarg(model) or "cache"
    graphed: dict[str, GraphedCausalLM] = {}
    captures: dict[str, Any] = {}
    cuda_lost: str | None = None
    for path in ("graphguard", *COMPILE):
        if path in paths_run:
            try:
                captures.update(capture_path(path, model, batches, args, graphed))
            except Exception as exc:  # recorded; the other paths still run
                msg = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
                captures[f"{path}_capture_error"] = msg
                print(f"{path} capture failed: {msg}", file=sys.stderr, flush=True)
                if "CUDA error" in str(exc) or type(exc).__name__ == "AcceleratorError":
                    cuda_lost = f"{path} capture: {msg}"
                    break
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
        "cold_cache": args.cold_cache,
        "inductor_cache_dir": os.environ.get("TORCHINDUCTOR_CACHE_DIR"),
        "paths": paths_run,
        **captures,
        "rows": [],
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    paths = Paths(model, graphed, args, cache_kw)
    paths.cuda_lost = cuda_lost
    rows: dict[int, dict[str, Any]] = {}
    plan = (
        [(b, p) for b in batches for p in paths_run]
        if args.interleave
        else [(b, p) for b in batches for p in paths_run if p != "hf_compile"]
        + [(b, "hf_compile") for b in batches if "hf_compile" in paths_run]
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
        ("graphguard_compile_ms", "graphguard GraphedCausalLM(compile=True)"),
        ("graphguard_compile_model_ms", 'graphguard GraphedCausalLM(compile="model")'),
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
