"""Throughput cost of the replay canary on the reference 1B decode, one run, one GPU.

Per batch B (default 1, 16, 64; llama-1b shapes, bf16), ms per call of ``--reps``
back-to-back calls (CUDA events), median over ``--blocks`` blocks, for:

* ``none``: ``GraphRunner`` without a canary;
* ``every_1000`` / ``every_100``: the same ladder with ``canary=Canary(every=N)``
  (``state=[]``: the decode step's K/V writes are idempotent, so nothing is cloned).

The configurations take turns block by block (drift hits all alike), and ``--reps`` is
a multiple of N, so each block holds exactly ``reps / N`` checks. ``cost_pct`` is
``(ms / ms_none - 1) * 100``. Each checked call's own cost (one eager step, one
comparison with a host sync) is ``check_ms``: the block's extra time over the checks in
it. ``--device cpu --preset tiny`` is a smoke run of the plumbing (RecordingBackend,
host wall time). Writes ``<out>/canary_<gpu>_<date>.json``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

import torch

import graphguard as gg
from graphguard_ref.llama import LlamaConfig, LlamaDecodeModel


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", default="llama-1b")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--batches", default="1,16,64")
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--reps", type=int, default=2000)
    ap.add_argument("--blocks", type=int, default=5)
    ap.add_argument("--every", default="1000,100")
    ap.add_argument("--out", type=Path, default=Path("bench/results"))
    args = ap.parse_args()
    dev = torch.device(args.device)
    cuda = dev.type == "cuda"
    batches = [int(b) for b in args.batches.split(",")]
    everies = [int(n) for n in args.every.split(",")]
    bad = [n for n in everies if args.reps % n]
    if bad:
        ap.error(f"--reps {args.reps} must be a multiple of every N ({bad})")
    cfg = LlamaConfig.preset(args.preset, max_batch=max(batches), max_context=args.context)
    dtype = torch.bfloat16 if cuda else torch.float32
    model = LlamaDecodeModel.random(cfg, device=dev, dtype=dtype, seed=0)
    gen = torch.Generator().manual_seed(0)
    fixed = {b: model.example_inputs(b, generator=gen) for b in batches}

    def build(canary: gg.Canary | None, name: str) -> gg.GraphRunner:
        r = gg.GraphRunner(
            model.decode_step,
            fixed[batches[0]],
            sizes=sorted(set(batches)),
            fill_values=model.pad_fill_values(),
            before_capture=[model.warm_kernels],
            workspaces=[model.workspace],
            progress=False,
            state=[],
            canary=canary,
            name=name,
            backend=None if cuda else gg.RecordingBackend(),
        )
        r.capture()
        return r

    def timed(fn: Any, reps: int) -> float:
        if not cuda:
            t0 = time.perf_counter()
            for _ in range(reps):
                fn()
            return (time.perf_counter() - t0) * 1e3 / reps
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(reps):
            fn()
        end.record()
        end.synchronize()
        return float(start.elapsed_time(end)) / reps

    result: dict[str, Any] = {
        "gpu": torch.cuda.get_device_name() if cuda else "cpu",
        "torch": torch.__version__,
        "date": time.strftime("%Y-%m-%d"),
        "preset": args.preset,
        "dtype": str(dtype).removeprefix("torch."),
        "context": args.context,
        "reps": args.reps,
        "blocks": args.blocks,
        "state": "[] (idempotent K/V writes: nothing cloned)",
        "batches": {},
    }
    with torch.inference_mode():
        model.warm_kernels(batches)
        runners = {"none": build(None, "none")}
        for n in everies:
            runners[f"every_{n}"] = build(gg.Canary(every=n, on_divergence="raise"), f"c{n}")
        for b in batches:
            x = fixed[b]
            for r in runners.values():  # warm: one full period of each, eager included
                for _ in range(max(everies)):
                    r(*x)
            times: dict[str, list[float]] = {k: [] for k in runners}
            for _ in range(args.blocks):
                for k, r in runners.items():
                    times[k].append(timed(lambda r=r, x=x: r(*x), args.reps))
            base = statistics.median(times["none"])
            row: dict[str, Any] = {"none": {"ms": base}}
            for n in everies:
                ms = statistics.median(times[f"every_{n}"])
                checks = args.reps // n
                row[f"every_{n}"] = {
                    "ms": ms,
                    "cost_pct": (ms / base - 1) * 100,
                    "checks_per_block": checks,
                    "check_ms": (ms - base) * args.reps / checks,
                }
            stats = runners[f"every_{everies[0]}"].canary_stats()
            row["divergences"] = sum(s.divergences for s in stats.values())
            result["batches"][str(b)] = row
            print(f"B={b}: " + json.dumps(row), flush=True)
        for r in runners.values():
            r.release()
    args.out.mkdir(parents=True, exist_ok=True)
    gpu = result["gpu"].replace(" ", "-")
    path = args.out / f"canary_{gpu}_{result['date']}.json"
    path.write_text(json.dumps(result, indent=2))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
