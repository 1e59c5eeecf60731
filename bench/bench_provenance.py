"""Graph provenance cost (issue 30) on the reference Llama-1B decode step.

* A 35-size ladder (``capture_sizes(256)``) captured with provenance off, then on: the
  capture time each way, the reading and classifying time per graph (``audit()``'s
  seconds), ``audit()`` itself, and words and kernels per graph. Target: at most 1 s in
  all for the ladder.
* A lazy size: one size captured (at its second call) with provenance on (target <= 30 ms of
  reading).
* ``check_weights()`` with provenance (target <= 1 ms).

Writes ``<out>/provenance_<gpu>_<date>.json``. Run on the GPU machine:
``PYTHONPATH=src:ref/src python3 bench/bench_provenance.py --out bench/results``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
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


def replay_ms(r: gg.GraphRunner, inputs: tuple[torch.Tensor, ...], reps: int = 200) -> float:
    """Median CUDA-event time of one ``runner(*inputs)`` call, after warm-up."""
    for _ in range(20):
        r(*inputs)
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        r(*inputs)
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def plot(result: dict[str, Any], path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    per = result["ladder"]["reading_ms_per_size"]
    a.bar([str(k) for k in per], list(per.values()))
    a.set_xlabel("graph (batch size)")
    a.set_ylabel("reading + classifying (ms)")
    a.set_title(f"provenance per graph, total {result['ladder']['reading_total_s']:.2f} s")
    a.tick_params(axis="x", labelrotation=90, labelsize=6)
    rep = result["replay_ms"]
    xs = list(rep["off"])
    w = 0.4
    b.bar([i - w / 2 for i in range(len(xs))], [rep["off"][x] for x in xs], w, label="off")
    b.bar([i + w / 2 for i in range(len(xs))], [rep["on"][x] for x in xs], w, label="on")
    b.set_xticks(range(len(xs)), xs)
    b.set_xlabel("batch")
    b.set_ylabel("runner(*inputs), ms (median)")
    b.set_title("replay with provenance off / on")
    b.legend()
    fig.suptitle(f"graph provenance, reference Llama-1B bf16, {result['gpu']} ({result['commit']})")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", default="bench/results")
    ap.add_argument("--max-size", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = True
    sizes = gg.capture_sizes(args.max_size)
    cfg = LlamaConfig.preset("llama-1b", max_batch=args.max_size, max_context=512)
    model = LlamaDecodeModel.random(cfg, device="cuda", dtype=torch.bfloat16, seed=0)
    with torch.inference_mode():
        model.warm_kernels(sizes)
        warm = runner(model, sizes, provenance=False, name="warm")  # first-run work, untimed
        warm.capture()
        warm.release()
    result: dict[str, Any] = {
        "commit": os.environ.get("GRAPHGUARD_COMMIT", "unknown"),
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "date": str(datetime.date.today()),
        "sizes": len(sizes),
    }
    # The ladder captured off and on, interleaved, `rounds` times each: medians.
    capture_s: dict[bool, list[float]] = {False: [], True: []}
    kept: dict[bool, gg.GraphRunner] = {}
    for rnd in range(args.rounds):
        for on in (False, True):
            r = runner(model, sizes, provenance=on, name=f"prov_{on}")
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            with torch.inference_mode():
                r.capture()
            capture_s[on].append(time.perf_counter() - t0)
            if rnd == args.rounds - 1:
                kept[on] = r
            else:
                r.release()
    r = kept[True]
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
        "capture_off_s": statistics.median(capture_s[False]),
        "capture_on_s": statistics.median(capture_s[True]),
        "capture_runs_s": {"off": capture_s[False], "on": capture_s[True]},
        "reading_total_s": sum(per_graph),
        "reading_max_ms": max(per_graph) * 1e3,
        "reading_median_ms": statistics.median(per_graph) * 1e3,
        "reading_ms_per_size": {g.size: round(g.seconds * 1e3, 3) for g in audit.graphs},
        "audit_s": audit_s,
        "words_max": max(g.words for g in audit.graphs),
        "kernels_max": max(g.kernels for g in audit.graphs),
        "unknown": sum(len(g.unknown) for g in audit.graphs),
        "unknown_freed_not_proven": sum(1 for g in audit.graphs for w in g.unknown if w.freed),
        "unowned": sum(len(g.unowned) for g in audit.graphs),
        "check_ms_median": statistics.median(checks) * 1e3,
        "check_ok": ok,
    }
    print(audit.table().splitlines()[0])
    print(json.dumps(result["ladder"], indent=1))
    # Replay unchanged: the same sizes' graphs, provenance off and on, checked equal.
    rep: dict[str, dict[int, float]] = {"off": {}, "on": {}}
    with torch.inference_mode():
        for n in (1, 8, 64, args.max_size):
            ins = model.example_inputs(n, generator=torch.Generator().manual_seed(n))
            eager = model.decode_step(*ins)
            a, b = kept[False](*ins), kept[True](*ins)
            torch.testing.assert_close(a, b, rtol=0, atol=0)  # the same kernels
            torch.testing.assert_close(a, eager, rtol=2e-2, atol=2e-2)  # bf16 vs eager
            rep["off"][n] = replay_ms(kept[False], ins)
            rep["on"][n] = replay_ms(kept[True], ins)
    result["replay_ms"] = rep
    print(json.dumps(rep))
    for x in kept.values():
        x.release()
    lazy = runner(model, sizes, provenance=True, lazy=gg.Lazy(capture_now=[1]), name="lazy")
    with torch.inference_mode():
        lazy.capture()
        lazy(*model.example_inputs(8))  # size 8's first call: its warmup, eagerly
        t0 = time.perf_counter()
        lazy(*model.example_inputs(8))  # its capture (with provenance) and replay
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
    gpu = torch.cuda.get_device_name().replace(" ", "-")
    path = out / f"provenance_{gpu}_{datetime.date.today()}.json"
    path.write_text(json.dumps(result, indent=1))
    plot(result, path.with_suffix(".png"))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
