"""Probe: where ``update_weights`` and ``with runner.refit():`` spend their time on the
reference Llama-1B step (issue 40's cost targets), and how fast an exact checksum of the
model's 2.3 GiB can be on this GPU.

Prints and writes ``$OUT/refit-cost.json``: the bare fused copy, ``update_weights`` and
the refit context (medians of synchronized wall times), a cProfile of 20 updates and of
20 refits (cumulative, top entries), and per checksum form (int16 sum to int64, int32
view, int64 view) the device milliseconds over every parameter (CUDA events).

``PYTHONPATH=src:ref/src python3 bench/probes/probe_refit_cost.py --out $OUT``
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

import graphguard as gg
from graphguard_ref.llama import LlamaConfig, LlamaDecodeModel

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench_provenance import runner


def wall(fn: Any, reps: int = 20) -> float:
    ts = []
    for _ in range(reps):
        torch.cuda.synchronize()
        t = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        ts.append(time.perf_counter() - t)
    return statistics.median(ts) * 1e3


def profile(fn: Any, reps: int = 20) -> str:
    pr = cProfile.Profile()
    pr.enable()
    for _ in range(reps):
        fn()
    torch.cuda.synchronize()
    pr.disable()
    s = io.StringIO()
    pstats.Stats(pr, stream=s).sort_stats("cumtime").print_stats(30)
    return s.getvalue()


def device_ms(fn: Any, reps: int = 10) -> float:
    fn()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    ts = []
    for _ in range(reps):
        a.record()
        fn()
        b.record()
        b.synchronize()
        ts.append(a.elapsed_time(b))
    return statistics.median(ts)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    torch.manual_seed(0)
    cfg = LlamaConfig.preset("llama-1b")
    model = LlamaDecodeModel(cfg, device="cuda", dtype=torch.bfloat16)
    r = runner(model, gg.capture_sizes(256))  # the bench's runner of the 1B step
    with torch.inference_mode():
        r.capture()
    named = list(model.named_parameters())
    src = {k: v.detach().clone() for k, v in named}
    dsts, srcs = [p for _, p in named], [src[k] for k, _ in named]

    def bare() -> None:
        with torch.no_grad():
            torch._foreach_copy_(dsts, srcs)

    def update() -> None:
        r.update_weights(src)

    def refit() -> None:
        with r.refit(), torch.no_grad():
            torch._foreach_copy_(dsts, srcs)

    r.check_weights()  # the graphs read once
    update()
    out: dict[str, Any] = {"tensors": len(dsts), "bytes": sum(t.nbytes for t in dsts)}
    for _ in range(2):
        for name, fn in (("bare", bare), ("update", update), ("refit", refit)):
            out.setdefault("ms", {}).setdefault(name, []).append(wall(fn))
    print(json.dumps(out["ms"]), flush=True)
    out["profile_update"] = profile(update)
    out["profile_refit"] = profile(refit)
    print(out["profile_update"][:5000])
    print(out["profile_refit"][:5000])
    forms = {
        "int16_sum_int64": lambda t: t.view(torch.int16).sum(dtype=torch.int64),
        "int32_view_sum_int64": lambda t: t.view(torch.int32).sum(dtype=torch.int64),
        "int64_view_sum": lambda t: t.view(torch.int64).sum(),
        "bf16_float_sum": lambda t: t.sum(dtype=torch.float32),
    }
    sums: dict[str, float] = {}
    for fname, f in forms.items():
        try:

            def run(f: Any = f) -> None:
                for t in dsts:
                    f(t.detach())

            sums[fname] = device_ms(run)
        except RuntimeError as exc:
            sums[fname] = float("nan")
            print(fname, "failed:", exc)
    sums["bare_copy_device_ms"] = device_ms(bare)
    out["checksum_device_ms"] = sums
    print(json.dumps(sums), flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "refit-cost.json").write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
