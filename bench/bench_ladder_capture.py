"""The whole ladder captured warm: graphguard against the hand-rolled loop (issue 31).

Reference Llama-1B decode step, bf16, the 35-size ladder of ``capture_sizes(256)``, every
shape's kernels chosen beforehand (captured warm). Rounds interleave the hand-rolled loop
(:func:`bench_decode.handrolled_ladder`: per size 1 warmup + synchronize, capture into one
shared pool) and graphguard's ``capture()`` of the same ladder on a new runner, each from
an emptied allocator cache, each side's graphs released outside the timing. The runner
has no ``before_capture`` hook here (the stage's warmups are the lifecycle's step 1, which
the hand-rolled loop has no counterpart for; timed apart as ``stage_s``). Reported: paired
medians, their ratio (goal <= 1.05), and graphguard's time by phase summed over the
ladder, so the gap has names.

Writes ``<out>/ladder-capture_<gpu>_<date>.json``. On the GPU machine:
``PYTHONPATH=src:ref/src python3 bench/bench_ladder_capture.py --out $OUT``.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import graphguard as gg
from bench_decode import handrolled_ladder
from graphguard_ref.llama import LlamaConfig, LlamaDecodeModel


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", type=Path, default=Path("bench/results"))
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = True
    cfg = LlamaConfig.preset("llama-1b", max_batch=256, max_context=1024)
    model = LlamaDecodeModel.random(cfg, device=torch.device("cuda"), dtype=torch.bfloat16, seed=0)
    ladder = gg.capture_sizes(cfg.max_batch)
    dev = torch.device("cuda")
    result: dict[str, Any] = {
        "commit": os.environ.get("GRAPHGUARD_COMMIT", "unknown"),
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "date": str(datetime.date.today()),
        "sizes": len(ladder),
    }

    def padded(n: int) -> tuple[torch.Tensor, ...]:
        return model.example_inputs(n, generator=torch.Generator().manual_seed(n))

    with torch.inference_mode():
        t0 = time.perf_counter()
        model.warm_kernels(ladder)
        for s in ladder:
            model.decode_step(*padded(s))
        torch.cuda.synchronize()
        result["stage_s"] = time.perf_counter() - t0

        def build() -> gg.GraphRunner:
            return gg.GraphRunner(
                model.decode_step,
                model.example_inputs(1),
                sizes=ladder,
                fill_values=model.pad_fill_values(),
                workspaces=[model.workspace],
                progress=False,
                name="ladder",
            )

        first = build()
        first.capture()  # the first capture: untimed
        first.release()
        del first
        paired: dict[str, list[float]] = {"graphguard": [], "handrolled": []}
        phases: list[dict[str, float]] = []
        runner: gg.GraphRunner | None = None
        for _ in range(args.rounds):
            # Each side from an emptied allocator cache, its graphs released untimed.
            gc.collect()
            torch.cuda.empty_cache()
            hr_s, _, graphs = handrolled_ladder(model.decode_step, padded, ladder, dev)
            paired["handrolled"].append(hr_s)
            del graphs
            if runner is not None:
                runner.release()
            gc.collect()
            torch.cuda.empty_cache()
            runner = build()
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            report = runner.capture()
            torch.cuda.synchronize()
            paired["graphguard"].append(time.perf_counter() - t0)
            phases.append(dict(report.phases))
        assert runner is not None
        # Checked against eager: every size a batch pads to replays what eager computes.
        for n in (1, 3, 64, 200, 256):
            ins = padded(n)
            want = model.decode_step(*ins)
            torch.testing.assert_close(runner(*ins), want, rtol=2e-2, atol=2e-2)
    gg_s, hr_s = statistics.median(paired["graphguard"]), statistics.median(paired["handrolled"])
    keys = sorted({k for p in phases for k in p})
    result.update(
        {
            "paired_s": paired,
            "graphguard_s": gg_s,
            "handrolled_s": hr_s,
            "ratio": gg_s / hr_s,
            "ratio_per_round": [g / h for g, h in zip(paired["graphguard"], paired["handrolled"])],
            "goal": {"ratio_at_most": 1.05, "met": gg_s / hr_s <= 1.05},
            "phases_ms_median": {
                k: round(statistics.median(p.get(k, 0.0) for p in phases) * 1e3, 3) for k in keys
            },
            "checked_against_eager": [1, 3, 64, 200, 256],
        }
    )
    runner.release()
    print(json.dumps(result, indent=1))
    args.out.mkdir(parents=True, exist_ok=True)
    gpu = torch.cuda.get_device_name().replace(" ", "-")
    path = args.out / f"ladder-capture_{gpu}_{datetime.date.today()}.json"
    path.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
