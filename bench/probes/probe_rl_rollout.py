"""Where a rollout's time goes: graphguard's continuous-batching engine against HF's own
graphs, step by step (issue 42: 0.91x of HF's graphs at 0e15d86, not yet explained).

The bench's rollout (``bench_rl_loop``: 0.5B Llama shape, bf16, 64 prompts x 8 samples,
the comparison prompts of ``ROLLOUT_STEP``) on three engines, in one process: graphguard
as the loop runs it (canary every 100 replays, provenance on), graphguard with the canary
and provenance off, and HF's continuous batching with its own graphs (its warmup after the
paged cache is zeroed, as the bench does). HF's ``ContinuousBatchProcessor`` methods are
wrapped with host timers (class attributes, both engines alike): per rollout, the steps
and the host seconds in ``prepare_next_batch``, ``get_model_kwargs``, ``compute_batch``,
``retrieve_device_outputs`` (it waits for the device: the step's GPU time not hidden) and
``update_batch``, plus HF's graph keys met.

``GRAPHGUARD_COMMIT=<sha> PYTHONPATH=src python3 bench/probes/probe_rl_rollout.py --out
probe-rl-rollout.json``
"""

from __future__ import annotations

import argparse
import collections
import functools
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT / "src"))

import bench_rl_loop as rl  # noqa: E402

ex = rl.ex

TIMES: dict[str, float] = collections.defaultdict(float)
COUNTS: dict[str, int] = collections.defaultdict(int)
KEYS: collections.Counter[Any] = collections.Counter()


def timed(name: str, fn: Any) -> Any:
    @functools.wraps(fn)
    def wrapper(*a: Any, **kw: Any) -> Any:
        t = time.perf_counter()
        try:
            return fn(*a, **kw)
        finally:
            TIMES[name] += time.perf_counter() - t
            COUNTS[name] += 1

    return wrapper


def instrument() -> None:
    from transformers.generation.continuous_batching import continuous_api, input_outputs

    proc = continuous_api.ContinuousBatchProcessor
    for name in ("prepare_next_batch", "_generation_step", "update_batch"):
        setattr(proc, name, timed(name, getattr(proc, name)))
    io = input_outputs.ContinuousBatchingIOs
    for name in ("get_model_kwargs", "retrieve_device_outputs", "prepare_batch_update"):
        setattr(io, name, timed(name, getattr(io, name)))
    from transformers.generation.continuous_batching import model_runner

    mr = model_runner.ModelRunner
    mr.compute_batch = timed("compute_batch", mr.compute_batch)
    from graphguard.integrations import _hf_cb_step

    sg = _hf_cb_step.StepGraphs
    sg.compute_batch = timed("compute_batch", sg.compute_batch)
    orig_key = io._get_graph_key

    def key(self: Any) -> Any:
        k = orig_key(self)
        KEYS[k] += 1
        return k

    io._get_graph_key = key


def measure(name: str, run: Any, count: int, out: dict[str, Any]) -> None:
    rows = []
    for i in range(count + 1):
        TIMES.clear()
        COUNTS.clear()
        tokens, seconds = run()
        row = {
            "tokens": tokens,
            "seconds": round(seconds, 4),
            "tok_s": round(tokens / seconds, 1),
            "steps": COUNTS.get("_generation_step", 0),
            "host_ms": {k: round(v * 1e3, 2) for k, v in sorted(TIMES.items())},
        }
        row["per_step_ms"] = {
            k: round(v * 1e3 / max(1, row["steps"]), 3) for k, v in sorted(TIMES.items())
        }
        print(f"{name} {'warm-up' if i == 0 else i}: {json.dumps(row)}", flush=True)
        if i:
            rows.append(row)
    out[name] = rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--count", type=int, default=3)
    ap.add_argument("--preset", default="0.5b")
    ap.add_argument("--device", default="cuda")  # cpu: a smoke run of the graphguard part
    args = ap.parse_args()
    instrument()
    cfg = ex.LoopConfig(
        preset=args.preset,
        device=args.device,
        dtype="bfloat16" if args.device == "cuda" else "float32",
        steps=1,
        prompts=64,
        samples=8,
        prompt_len=(8, 32),
        new_tokens=(8, 24),
        canary_every=100,
        proof_every=10,
        max_batch_tokens=1024,
        num_blocks=512,
        max_graphs=256,
        seed=0,
    )
    result: dict[str, Any] = {
        "probe": "rl-rollout",
        "commit": os.environ.get("GRAPHGUARD_COMMIT", "unknown"),
        "device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
        "torch": torch.__version__,
        "transformers": __import__("transformers").__version__,
    }
    model = ex.build_model(cfg, cfg.seed)
    model.eval()
    import graphguard as gg
    from graphguard.integrations.hf_continuous import GraphedContinuousBatching

    variants = {
        "graphguard": {},
        "graphguard_bare": {"canary": None, "provenance": False},
    }
    for name, kw in variants.items():
        engine = GraphedContinuousBatching(
            model,
            max_graphs=cfg.max_graphs,
            canary=kw.get("canary", gg.Canary(every=cfg.canary_every)),
            provenance=kw.get("provenance", True),
            progress=False,
            backend=None if args.device == "cuda" else gg.RecordingBackend(),
        )

        def run(engine: Any = engine) -> tuple[int, float]:
            ro = ex.rollout(engine, cfg, rl.ROLLOUT_STEP)
            return ro.generated, ro.seconds

        KEYS.clear()
        run()  # first calls and captures
        measure(name, run, args.count, result)
        result[f"{name}_keys"] = {str(k): v for k, v in KEYS.items()}
        result[f"{name}_stats"] = {
            k: v for k, v in engine.stats().items() if k not in ("runner", "per_key")
        }
        engine.close()
        args.out.write_text(json.dumps(result, indent=1, default=str))
    for graphs in (True,) if args.device == "cuda" else ():
        name = "hf_graphs" if graphs else "hf_graphs_off"
        try:
            result[f"{name}_warmup"] = rl.hf_prepare(
                model, cfg, rl.ROLLOUT_STEP, "zeroed", use_cuda_graph=graphs
            )
            KEYS.clear()
            measure(
                name,
                lambda g=graphs: rl.hf_rollout(
                    model, cfg, rl.ROLLOUT_STEP, "zeroed", use_cuda_graph=g
                ),
                args.count,
                result,
            )
            result[f"{name}_keys"] = {str(k): v for k, v in KEYS.items()}
            proc = model._cached_continuous_batching_manager.batch_processor
            result[f"{name}_cb_config"] = {
                k: str(v) for k, v in vars(proc.cb_config).items() if not k.startswith("_")
            }
        finally:
            model.destroy_cached_continuous_batching_manager()
        args.out.write_text(json.dumps(result, indent=1, default=str))
    print(json.dumps({k: v for k, v in result.items() if "keys" not in k}, default=str)[:6000])


if __name__ == "__main__":
    main()
