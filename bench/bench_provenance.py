"""Graph provenance cost (issue 30) on the reference Llama-1B decode step.

* A 35-size ladder (``capture_sizes(256)``) captured with provenance off, then on: the
  capture time each way, the reading and classifying time per graph (``audit()``'s
  seconds), ``audit()`` itself, and words and kernels per graph. Target: at most 1 s in
  all for the ladder.
* A lazy size: one size captured on first use with provenance on (target <= 30 ms of
  reading).
* ``check_weights()`` with provenance (target <= 1 ms).

Writes ``<out>/provenance_<gpu>_<date>.json``. Run on the GPU machine:
``PYTHONPATH=src:ref/src python3 bench/bench_provenance.py --out bench/results``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import time
from pathlib import Path
from typing import Any

import torch

import graphguard as gg
from graphguard_ref.llama import LlamaConfig, LlamaDecodeModel


def runner(model: LlamaDecodeModel, sizes: list[int], **kw: Any) -> gg.GraphRunner:
    return gg.GraphRunner(
        model.decode_step,
        model.example_inputs(1),
        sizes=sizes,
        fill_values=model.pad_fill_values(),
        before_capture=[model.warm_kernels],
        workspaces=[model.workspace],
        state=[],
        progress=False,
        **kw,
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", default="bench/results")
    ap.add_argument("--max-size", type=int, default=256)
    args = ap.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = True
    sizes = gg.capture_sizes(args.max_size)
    cfg = LlamaConfig.preset("llama-1b", max_batch=args.max_size, max_context=512)
    model = LlamaDecodeModel.random(cfg, device="cuda", dtype=torch.bfloat16, seed=0)
    with torch.inference_mode():
        model.warm_kernels(sizes)
    result: dict[str, Any] = {
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "sizes": len(sizes),
    }
    capture_s = {}
    for on in (False, True):
        r = runner(model, sizes, provenance=on, name=f"prov_{on}")
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        with torch.inference_mode():
            r.capture()
        capture_s[on] = time.perf_counter() - t0
        if on:
            t0 = time.perf_counter()
            audit = r.audit()
            audit_s = time.perf_counter() - t0
            per_graph = [g.seconds for g in audit.graphs]
            checks = []
            for _ in range(50):
                t0 = time.perf_counter()
                ok = r.check_weights().ok
                checks.append(time.perf_counter() - t0)
            result["ladder"] = {
                "capture_off_s": capture_s[False],
                "capture_on_s": capture_s[True],
                "reading_total_s": sum(per_graph),
                "reading_max_ms": max(per_graph) * 1e3,
                "reading_median_ms": statistics.median(per_graph) * 1e3,
                "audit_s": audit_s,
                "words_max": max(g.words for g in audit.graphs),
                "kernels_max": max(g.kernels for g in audit.graphs),
                "unknown": sum(len(g.unknown) for g in audit.graphs),
                "unowned": sum(len(g.unowned) for g in audit.graphs),
                "check_ms_median": statistics.median(checks) * 1e3,
                "check_ok": ok,
            }
            print(audit.table().splitlines()[0])
            print(json.dumps(result["ladder"], indent=1))
        r.release()
    lazy = runner(model, sizes, provenance=True, lazy=gg.Lazy(capture_now=[1]), name="lazy")
    with torch.inference_mode():
        lazy.capture()
        t0 = time.perf_counter()
        lazy(*model.example_inputs(8))
        first_call_s = time.perf_counter() - t0
    graphs = [g for g in lazy.audit().graphs if g.size == 8]
    result["lazy"] = {
        "first_call_s": first_call_s,
        "reading_ms": graphs[0].seconds * 1e3 if graphs else None,
    }
    print(json.dumps(result["lazy"]))
    lazy.release()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    gpu = torch.cuda.get_device_name().replace(" ", "_").lower()
    path = out / f"provenance_{gpu}_{datetime.date.today()}.json"
    path.write_text(json.dumps(result, indent=1))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
