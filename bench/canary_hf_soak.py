"""No false positive from the replay canary on Hugging Face models: a soak of every-step checks.

Issue 23 asks for no false positive over 10,000 canary checks on three HF families with
``GraphedCausalLM`` in bf16. For each family of ``tests/hf_families.py`` named in
``--families`` (default llama, gpt2, qwen3: three architectures, see below), a tiny
random-weight model is built in bf16 on CUDA and wrapped as
``GraphedCausalLM(model, max_batch=8, max_cache_len=..., canary=gg.Canary(every=1,
on_divergence="warn"))``: every decode replay is also run eagerly (HF's eager kernels at
the real batch, from the same cache state) and compared. ``generate()`` runs at batch sizes
1..8 in turn (left-padded prompts of 1..7 tokens, greedy and sampled alternately, no EOS
stop) until ``--checks`` checks per family have been made, read from
``g.runner.canary_stats()``.

Per family the JSON gives checks and divergences (in total, per captured size and per real
batch: a batch below its size runs eagerly at a shape the graph never saw, where a false
positive would show first), seconds, and the tolerance the checks used with the worst
difference seen (``CanaryStats.max_abs`` / ``max_rel``, and ``max_abs`` over the logits'
atol), so a pass can be judged by its margin, not only its zero.

Tolerance: ``GraphedCausalLM`` gives its canary the model dtype's tolerance
(:func:`graphguard.verify.default_tolerance`, bf16: 2e-2 / 2e-2) unless ``--rtol``/``--atol``
set one: the decode step returns float32 logits that are copies of bf16 ones, and graph
and eager run at the padded size versus the real batch, where a GEMM whose kernel choice
depends on M may move a logit by a bf16 ulp. (The run of 91ebebe reported fp32's 1e-4 here:
the script printed the leaf's default, not the canary's; its max difference was 0 anyway.)
``per_batch`` shows whether divergences sit at the padded batches.

Families: llama (RoPE, GQA, SwiGLU, RMSNorm), gpt2 (learned positions, fused ``c_attn``
Conv1D, LayerNorm, GELU, no GQA) and qwen3 (llama-like with per-head q/k RMSNorm and an
explicit head_dim); ``--families`` takes any of ``tests.hf_families.FAMILIES``.

Run (GPU, < 4 minutes on an H200 for three families):
``GRAPHGUARD_COMMIT=$(git rev-parse HEAD) PYTHONPATH=src:ref/src python3
bench/canary_hf_soak.py --out bench/results``. CPU smoke (RecordingBackend, fp32):
``PYTHONPATH=src:ref/src python3 bench/canary_hf_soak.py --device cpu --checks 50 --out
/tmp/soak``. Writes ``<out>/canary-hf_<gpu>_<date>.json``; exits 1 when a family
diverged or fell short of ``--checks`` (``--budget-s`` per family).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
for p in (ROOT, ROOT / "ref" / "src", ROOT / "src"):  # tests.hf_families, graphguard
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))

from tests import hf_families as F  # noqa: E402

import graphguard as gg  # noqa: E402
from graphguard.integrations.transformers import TRANSFORMERS_VERSION, GraphedCausalLM  # noqa: E402
from graphguard.verify import default_tolerance  # noqa: E402

MAX_BATCH = 8
PROMPT = 7  # longest prompt (tests.hf_families.prompts: rows 1..7 tokens, left-padded)


def _dtype(name: str) -> torch.dtype:
    dtypes = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
    if name not in dtypes:
        raise SystemExit(f"--dtype must be one of {sorted(dtypes)}, got {name!r}")
    return dtypes[name]


def _finite(x: float) -> float | str:
    """JSON without Infinity/NaN: a failed comparison's ``inf`` becomes ``"inf"``."""
    return x if math.isfinite(x) else str(x)


def _totals(g: GraphedCausalLM) -> tuple[int, int]:
    stats = g.runner.canary_stats()
    return sum(s.checks for s in stats.values()), sum(s.divergences for s in stats.values())


def soak(
    family: str, args: argparse.Namespace, device: torch.device, dtype: torch.dtype
) -> dict[str, Any]:
    """One family: build, capture, generate until ``args.checks`` checks; the row."""
    cuda = device.type == "cuda"
    model = F.model(family, seed=0, dtype=dtype, device=str(device))
    model.generation_config.eos_token_id = None  # no early stop: a fixed number of steps
    canary = gg.Canary(every=1, on_divergence="warn", rtol=args.rtol, atol=args.atol)
    t0 = time.perf_counter()
    g = GraphedCausalLM(
        model,
        max_batch=MAX_BATCH,
        max_cache_len=args.max_cache_len,
        progress=False,
        backend=None if cuda else gg.RecordingBackend(),
        canary=canary,
    )
    g.capture()
    capture_s = time.perf_counter() - t0
    # The tolerances the checks apply: per leaf dtype, unless --rtol/--atol override them.
    # The step's output is float32 logits whatever the model dtype (GraphedCausalLM._decode
    # returns ``out.logits[:, -1, :].float()``); the state is the cache's dtype.
    logits_dtype = torch.float32
    cache_dtype = g.cache.layers[0].keys.dtype

    used = g.runner.options.canary  # GraphedCausalLM sets the model dtype's tolerance

    def tol(dt: torch.dtype) -> dict[str, float]:
        r0, a0 = default_tolerance(dt)
        return {
            "rtol": used.rtol if used.rtol is not None else r0,
            "atol": used.atol if used.atol is not None else a0,
        }

    by_batch: dict[int, dict[str, int]] = {
        b: {"checks": 0, "divergences": 0} for b in range(1, MAX_BATCH + 1)
    }
    calls = 0
    # Checks per call: its new tokens - 1 (the first comes from the eager prefill). At most
    # what the cache holds, and few enough that every batch 1..8 gets calls.
    per_call = min(args.max_cache_len - PROMPT, -(-args.checks // MAX_BATCH) + 1)
    start = time.perf_counter()
    checks, divergences = _totals(g)
    gen = torch.Generator(device=device.type).manual_seed(0)
    while checks < args.checks:
        if time.perf_counter() - start > args.budget_s:
            print(f"  {family}: stopped at the {args.budget_s:.0f} s budget", flush=True)
            break
        batch = 1 + calls % MAX_BATCH
        ids, mask = F.prompts(batch, seed=calls, longest=PROMPT)
        new = min(per_call, args.checks - checks + 1)  # the last call lands on --checks
        sample = calls % 2 == 1  # alternate greedy and sampled tokens: more varied inputs
        kw: dict[str, Any] = (
            {"do_sample": True, "temperature": 1.0, "top_k": None, "top_p": None, "generator": gen}
            if sample
            else {"do_sample": False}
        )
        g.generate(ids.to(device), mask.to(device), max_new_tokens=new, **kw)
        calls += 1
        now, div = _totals(g)
        by_batch[batch]["checks"] += now - checks
        by_batch[batch]["divergences"] += div - divergences
        checks, divergences = now, div
    if cuda:
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    stats = g.runner.canary_stats()
    per_size = {
        str(size): {
            "checks": s.checks,
            "divergences": s.divergences,
            "max_abs": _finite(s.max_abs),
            "max_rel": _finite(s.max_rel),
            "last": s.last.table() if s.last is not None else None,
        }
        for size, s in stats.items()
    }
    max_abs = max((s.max_abs for s in stats.values()), default=0.0)
    max_rel = max((s.max_rel for s in stats.values()), default=0.0)
    logits_tol = tol(logits_dtype)
    row: dict[str, Any] = {
        "family": family,
        "model": type(model).__name__,
        "dtype": str(dtype).removeprefix("torch."),
        "sizes": list(g.captured_sizes),
        "max_cache_len": args.max_cache_len,
        "checks": checks,
        "divergences": divergences,
        "ok": divergences == 0 and checks >= args.checks,
        "generate_calls": calls,
        "seconds": seconds,
        "ms_per_check": seconds * 1e3 / max(checks, 1),
        "capture_s": capture_s,
        "tolerance": {
            "logits (float32 leaf)": logits_tol,
            f"cache state ({str(cache_dtype).removeprefix('torch.')})": tol(cache_dtype),
            "overridden": args.rtol is not None or args.atol is not None,
        },
        "max_abs": _finite(max_abs),
        "max_rel": _finite(max_rel),
        # A check passes when |graph - eager| <= atol + rtol * |eager| per element. <= 1:
        # every difference was within the logits' atol alone, whatever the magnitudes;
        # > 1 with no divergence: the rtol term carried it (max_rel is |d| / (|eager| +
        # atol), large near zero logits, so it is not the share of the tolerance used).
        "max_abs_over_logits_atol": _finite(max_abs / logits_tol["atol"])
        if logits_tol["atol"]
        else None,
        "per_size": per_size,
        "per_batch": {str(b): v for b, v in by_batch.items()},
    }
    g.release()
    del g, model
    if cuda:
        torch.cuda.empty_cache()
    return row


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n")[0], formatter_class=argparse.RawTextHelpFormatter
    )
    ap.add_argument("--families", default="llama,gpt2,qwen3")
    ap.add_argument("--checks", type=int, default=10_000, help="canary checks per family")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default=None, help="bf16 (default on CUDA), fp16, fp32 (CPU)")
    ap.add_argument("--max-cache-len", type=int, default=64)
    ap.add_argument("--rtol", type=float, default=None, help="override the per-dtype rtol")
    ap.add_argument("--atol", type=float, default=None, help="override the per-dtype atol")
    ap.add_argument("--budget-s", type=float, default=150.0, help="seconds per family at most")
    ap.add_argument("--out", type=Path, default=Path("bench/results"))
    args = ap.parse_args()
    families = [f for f in args.families.split(",") if f]
    unknown = sorted(set(families) - set(F.FAMILIES))
    if unknown or not families:
        ap.error(f"--families: {unknown or families} not among {list(F.FAMILIES)}")
    if args.checks < 1:
        ap.error(f"--checks must be >= 1, got {args.checks}")
    if args.max_cache_len < PROMPT + 2:
        ap.error(f"--max-cache-len must be >= {PROMPT + 2} (prompt {PROMPT} + 2 tokens)")
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    if cuda and not torch.cuda.is_available():
        ap.error("--device cuda but CUDA is not available; use --device cpu for the smoke run")
    dtype = _dtype(args.dtype or ("bf16" if cuda else "fp32"))
    result: dict[str, Any] = {
        "commit": os.environ.get("GRAPHGUARD_COMMIT", "unknown"),
        "gpu": torch.cuda.get_device_name() if cuda else "cpu",
        "torch": torch.__version__,
        "transformers": TRANSFORMERS_VERSION,
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "target_checks": args.checks,
        "canary": "Canary(every=1, on_divergence='warn')"
        + (
            f", rtol={args.rtol}, atol={args.atol}"
            if (args.rtol, args.atol) != (None, None)
            else ""
        ),
        "batches": f"1..{MAX_BATCH} in turn, prompts of 1..{PROMPT} tokens, greedy/sampled",
        "tf32_matmul": torch.backends.cuda.matmul.allow_tf32 if cuda else None,
        "families": {},
    }
    t0 = time.perf_counter()
    with torch.no_grad():
        for family in families:
            row = soak(family, args, device, dtype)
            result["families"][family] = row
            print(
                f"{family}: {row['checks']} checks, {row['divergences']} divergences, "
                f"{row['seconds']:.1f} s ({row['ms_per_check']:.2f} ms/check), max_abs "
                f"{row['max_abs']}, max_rel {row['max_rel']} (logits rtol "
                f"{row['tolerance']['logits (float32 leaf)']['rtol']})",
                flush=True,
            )
    result["total_s"] = time.perf_counter() - t0
    result["ok"] = all(r["ok"] for r in result["families"].values())
    args.out.mkdir(parents=True, exist_ok=True)
    gpu = result["gpu"].replace(" ", "-")
    path = args.out / f"canary-hf_{gpu}_{time.strftime('%Y-%m-%d')}.json"
    path.write_text(json.dumps(result, indent=2))
    print(f"wrote {path} (ok={result['ok']}, {result['total_s']:.1f} s)")
    sys.exit(0 if result["ok"] else 1)


if __name__ == "__main__":
    main()
