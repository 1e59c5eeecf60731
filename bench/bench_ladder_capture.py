"""The whole ladder captured warm: graphguard against the hand-rolled loop (issue 31).

Reference Llama-1B decode step, bf16, the 35-size ladder of ``capture_sizes(256)``, every
shape's kernels chosen beforehand (captured warm). Rounds interleave the hand-rolled loop
(:func:`bench_decode.handrolled_ladder`: per size 1 warmup + synchronize, capture into one
shared pool) and graphguard's ``capture()`` of the same ladder on a new runner, each from
an emptied allocator cache, each side's graphs released outside the timing, the order
alternating between rounds. The runner
has no ``before_capture`` hook here (the stage's warmups are the lifecycle's step 1, which
the hand-rolled loop has no counterpart for; timed apart as ``stage_s``). Reported: paired
medians, their ratio (goal <= 1.05), and graphguard's time by phase summed over the
ladder, so the gap has names.

Writes ``<out>/ladder-capture[-<tag>]_<gpu>_<date>.json`` and a PNG beside it. On the GPU machine:
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
    ap.add_argument("--tag", default="", help="added to the output file's name")
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

        def by_hand() -> None:
            hr_s, _, graphs = handrolled_ladder(model.decode_step, padded, ladder, dev)
            paired["handrolled"].append(hr_s)
            del graphs

        def graphguard() -> None:
            nonlocal runner
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

        for i in range(args.rounds):
            # Each side from an emptied allocator cache, its graphs released untimed; the
            # order alternates between rounds (the first of a pair meets a colder host).
            for side in (by_hand, graphguard) if i % 2 == 0 else (graphguard, by_hand):
                gc.collect()
                torch.cuda.empty_cache()
                side()
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
    tag = f"-{args.tag}" if args.tag else ""
    path = args.out / f"ladder-capture{tag}_{gpu}_{datetime.date.today()}.json"
    path.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {path}")
    if plot(result, path.with_suffix(".png")):
        print(f"wrote {path.with_suffix('.png')}")


def plot(result: dict[str, Any], path: Path) -> bool:
    """Per round: the two sides' seconds, and their ratio against the goal."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    paired = result["paired_s"]
    rounds = range(1, len(paired["graphguard"]) + 1)
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 3.4))
    a.bar([r - 0.2 for r in rounds], paired["handrolled"], 0.4, label="hand-rolled loop")
    a.bar([r + 0.2 for r in rounds], paired["graphguard"], 0.4, label="graphguard capture()")
    a.set_xlabel("round")
    a.set_ylabel("seconds, 35 sizes captured warm")
    a.legend(fontsize=7)
    b.plot(list(rounds), result["ratio_per_round"], "o-", label="graphguard / hand-rolled")
    b.axhline(result["goal"]["ratio_at_most"], color="grey", ls=":", label="goal 1.05")
    b.axhline(result["ratio"], color="C1", lw=0.8, label=f"ratio of medians {result['ratio']:.3f}")
    b.set_xlabel("round")
    b.legend(fontsize=7)
    fig.suptitle(f"whole ladder captured warm, {result['gpu']}, commit {result['commit'][:8]}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


if __name__ == "__main__":
    main()
