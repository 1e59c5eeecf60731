"""Graphs inside a byte budget by eviction (issue 41), on a serving trace.

The reference Llama-1B decode step (bf16, cuDNN decode attention, ``max_size=256``: the
35-size ladder). First the whole ladder is captured up front and its graph bytes read
from the ledger (pool plus the driver's share; the free device memory it held is
recorded beside it), then released. Then, for each budget (a share of those bytes,
``--budgets``, default 25% and 50%) and each policy (``--modes``: ``lru``:
``Lazy(budget=..., evict="lru")``; ``refuse``: the budget alone, a size over it runs
eagerly), a lazy runner serves the same trace: ``--calls`` batches drawn from a skewed,
drifting mix over the ladder (in four phases, each with a hot size: ladder index weights
``1 / (1 + |k - hot|) ** 1.5``; a batch uniform within its size's bucket).

Per run: the hit rate (replays over calls; a size's first call, its warmup, is a miss),
evictions and recaptures, the eager calls by reason, out-of-memory errors (caught and
counted: 0 expected), every 25th output against eager at the padded size, and at ten
checkpoints the ledger against the free device memory the graphs hold (what is not graph
memory handed back first: cached blocks, cuBLAS workspaces), with the worst relative gap.

``GRAPHGUARD_COMMIT=$(git rev-parse --short HEAD) python bench/bench_evict.py --out
bench/results --deadline 150`` writes ``lazy-evict_<gpu>_<date>.json`` (after every run:
a deadline or a crash keeps what was measured) and a PNG. CPU smoke run of the plumbing:
``--device cpu --preset tiny --calls 200``.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import time
from pathlib import Path
from typing import Any

import torch

MIB = float(1 << 20)
PHASES = [1, 4, 2, 6]
"""The hot ladder index of each quarter of the trace (sizes 2, 16, 4, 40 on the 35-size
ladder): small batches mostly, the hot set drifting."""


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize()


def _held(dev: torch.device) -> int:
    """Free device memory after handing back what is not graph memory (0 off CUDA)."""
    if dev.type != "cuda":
        return 0
    from graphguard.backend import drop_blas_workspaces

    gc.collect()
    drop_blas_workspaces()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    return int(torch.cuda.mem_get_info()[0])


def _reserved(dev: torch.device) -> int:
    """The caching allocator's reserve (read after :func:`_held`; 0 off CUDA)."""
    return int(torch.cuda.memory_reserved(dev)) if dev.type == "cuda" else 0


def trace(ladder: list[int], calls: int, seed: int) -> list[int]:
    """``calls`` batch sizes: per quarter, a ladder index drawn with weights
    ``1 / (1 + |k - hot|) ** 1.5``, then a batch uniform within that size's bucket."""
    rng = random.Random(seed)
    out = []
    for i in range(calls):
        hot = PHASES[min(len(PHASES) - 1, i * len(PHASES) // calls)]
        weights = [1.0 / (1 + abs(k - hot)) ** 1.5 for k in range(len(ladder))]
        k = rng.choices(range(len(ladder)), weights)[0]
        low = ladder[k - 1] + 1 if k else 1
        out.append(rng.randint(low, ladder[k]))
    return out


def _model(args: Any) -> tuple[Any, torch.device]:
    from graphguard_ref.llama import LlamaConfig, LlamaDecodeModel

    dev = torch.device(args.device)
    cfg = LlamaConfig.preset(
        args.preset, max_batch=args.max_size, max_context=1024, decode_sdpa=args.decode_sdpa
    )
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    return LlamaDecodeModel.random(cfg, device=dev, dtype=dtype, seed=0), dev


def _emulated(label: Any) -> tuple[int, int]:
    return (1 << 20) + int(label) * (32 << 10), 256 << 10


def _runner(model: Any, dev: torch.device, args: Any, **kw: Any) -> Any:
    import graphguard as gg

    return gg.GraphRunner(
        model.decode_step,
        model.example_inputs(2),
        fill_values=model.pad_fill_values(),
        before_capture=[model.warm_kernels],
        workspaces=[model.workspace],
        state=[],  # the decode step's K/V writes are idempotent
        progress=False,
        # Off CUDA, memory emulated: a fixed MiB per pool plus 32 KiB a row, 256 KiB a graph.
        backend=None if dev.type == "cuda" else gg.RecordingBackend(graph_bytes=_emulated),
        **kw,
        options=gg.CaptureOptions(max_size=args.max_size),
    )


def load_kernels(model: Any, dev: torch.device, args: Any) -> dict[str, Any]:
    """One eager forward at every batch size the trace will run (each size of the trace
    and each ladder size), before anything is measured. Why: CUDA loads a kernel's module
    on its first launch (lazy loading, the default), and that device memory is held for
    the process; an eager call at a shape met first on the trace would otherwise show up
    as graph memory in the free-memory measurement (at 0535d75 the first run's gap grew
    from 10% to 28% over the trace while no graph was captured or evicted). The runs
    measure graph memory, not the kernels serving needs with or without graphs."""
    from graphguard import capture_sizes

    ladder = capture_sizes(args.max_size)
    sizes = sorted({*trace(ladder, args.calls, args.seed), *ladder})
    free0 = _held(dev)
    t = time.perf_counter()
    for b in sizes:
        model.decode_step(*model.example_inputs(b))
    _sync(dev)
    return {
        "sizes": len(sizes),
        "seconds": round(time.perf_counter() - t, 2),
        "device_bytes": free0 - _held(dev),
    }


def full_ladder(model: Any, dev: torch.device, args: Any) -> dict[str, Any]:
    """The whole ladder up front: its graph bytes by the ledger and by free memory."""
    free0 = _held(dev)
    runner = _runner(model, dev, args, name="full")
    t = time.perf_counter()
    runner.capture()
    out = {
        "capture_s": round(time.perf_counter() - t, 3),
        "sizes": len(runner.captured_sizes),
        "ledger_bytes": runner.door.ledger.used,
        "pool_bytes": runner.door.ledger.pool_bytes,
        "driver_bytes": runner.door.ledger.driver_bytes,
        "measured_bytes": free0 - _held(dev),
    }
    runner.release()
    return out


def serve(model: Any, dev: torch.device, args: Any, budget: int, mode: str) -> dict[str, Any]:
    """One run of the trace on a lazy runner with ``budget`` (see the module)."""
    import graphguard as gg

    lazy = gg.Lazy(budget=budget, evict="lru" if mode == "lru" else None)
    runner = _runner(model, dev, args, lazy=lazy, name=f"{mode}-{budget >> 20}MiB")
    runner.capture()
    ladder = list(runner.sizes)
    batches = trace(ladder, args.calls, args.seed)
    gen = torch.Generator().manual_seed(args.seed)
    pool = {b: model.example_inputs(b, generator=gen) for b in sorted(set(batches))}
    free0 = _held(dev)
    reserved0 = _reserved(dev)
    checks = max(1, args.calls // 10)
    timeline: list[dict[str, Any]] = []
    hits: list[int] = []
    oom = wrong = 0
    worst = 0.0
    t0 = time.perf_counter()
    for i, b in enumerate(batches):
        entries = runner.door.entries  # short until a size at or above b is captured
        hit = b < len(entries) and entries[b] is not None
        try:
            y = runner(*pool[b])
        except torch.OutOfMemoryError:
            oom += 1
            continue
        hits.append(int(hit))
        if i % 25 == 0:  # a replay or a first call: eager at the padded size; else at b
            size = runner.padded_size(b) or b
            fills = model.pad_fill_values()
            padded = [
                torch.cat([x, torch.full((size - b,), f, dtype=x.dtype, device=x.device)])
                for x, f in zip(pool[b], fills)
            ]
            wants = [model.decode_step(*padded)[:b], model.decode_step(*pool[b])]
            worst = max(worst, min(float((y.float() - w.float()).abs().max()) for w in wants))
            wrong += int(not any(torch.equal(y, w) for w in wants))
            wants = []
        y = None  # not held across a checkpoint's measurement
        if (i + 1) % checks == 0:
            ledger = runner.door.ledger.used
            held = free0 - _held(dev)
            timeline.append(
                {
                    "call": i + 1,
                    "ledger_bytes": ledger,
                    "measured_bytes": held,
                    "gap": round(abs(ledger - held) / held, 4) if held else None,
                    # the ledger's parts and the allocator's reserve: where a gap sits
                    "ledger_pool_bytes": runner.door.ledger.pool_bytes,
                    "ledger_driver_bytes": runner.door.ledger.driver_bytes,
                    "driver_adjust_bytes": runner.door.ledger.driver_adjust,
                    "reserved_bytes": _reserved(dev) - reserved0,
                    "hit_rate": round(sum(hits[-checks:]) / max(1, len(hits[-checks:])), 4),
                    "evictions": runner.stats().evictions,
                }
            )
            print(f"  {mode} {budget / MIB:.0f} MiB: {timeline[-1]}", flush=True)
    _sync(dev)
    wall = time.perf_counter() - t0
    st = runner.stats()
    gaps = [c["gap"] for c in timeline if c["gap"] is not None]
    out = {
        "mode": mode,
        "budget_bytes": budget,
        "calls": len(batches),
        "hit_rate": st.hit_rate,
        "replays": st.replays,
        "eager_calls": st.eager_calls,
        "eager_reasons": st.eager_reasons,
        "evictions": st.evictions,
        "recaptures": sum(s.recaptures for s in st.sizes),
        "captured_at_end": list(runner.captured_sizes),
        "over_budget_sizes": [s.size for s in st.sizes if s.status == "over budget"],
        "failed_sizes": {s.size: s.note for s in st.sizes if s.status == "failed"},
        "oom_errors": oom,
        "outputs_checked": len(range(0, len(batches), 25)),
        "outputs_not_bitwise": wrong,
        "worst_abs_diff": worst,
        "ledger_vs_measured_max_gap": max(gaps) if gaps else None,
        "within_5_percent": bool(gaps) and max(gaps) <= 0.05,
        "driver_adjust_bytes": st.driver_adjust_bytes,
        "max_ledger_bytes": max((c["ledger_bytes"] for c in timeline), default=0),
        "wall_s": round(wall, 2),
        "ms_per_call": round(wall * 1e3 / len(batches), 3),
        "timeline": timeline,
        "per_size": {
            s.size: {
                "status": s.status,
                "replays": s.replays,
                "warmup_calls": s.warmup_calls,
                "evictions": s.evictions,
                "recaptures": s.recaptures,
            }
            for s in st.sizes
            if s.replays or s.warmup_calls or s.status != "pending"
        },
    }
    runner.release()
    return out


def plot(result: dict[str, Any], path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    runs = result.get("runs", [])
    if not runs:
        return False
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(12, 3.8))
    for i, run in enumerate(r for r in runs if r.get("mode") == "lru"):
        tl = run["timeline"]
        xs = [c["call"] for c in tl]
        share = run["budget_bytes"] / result["full_ladder"]["ledger_bytes"]
        ax.plot(xs, [c["ledger_bytes"] / MIB for c in tl], "o-", color=f"C{i}", ms=3,
                label=f"ledger, budget {share:.0%}")  # fmt: skip
        ax.plot(xs, [c["measured_bytes"] / MIB for c in tl], "x--", color=f"C{i}", ms=4,
                label="measured (free memory)")  # fmt: skip
        ax.axhline(run["budget_bytes"] / MIB, color=f"C{i}", lw=0.8, ls=":")
    ax.set_xlabel("call")
    ax.set_ylabel("graph memory, MiB")
    ax.set_title("evict='lru': the graphs' memory on the trace", fontsize=9)
    ax.legend(fontsize=6)
    labels = [
        f"{r['mode']}\n{r['budget_bytes'] / result['full_ladder']['ledger_bytes']:.0%}"
        for r in runs
    ]
    bars = bx.bar(range(len(runs)), [r["hit_rate"] for r in runs])
    for bar, r in zip(bars, runs):
        bx.annotate(f"{r['evictions']} ev.", (bar.get_x() + 0.1, bar.get_height()), fontsize=7)
    bx.set_xticks(range(len(runs)), labels, fontsize=7)
    bx.set_ylim(0, 1)
    bx.set_ylabel("hit rate (replays / calls)")
    bx.set_title("the same trace: evict vs refuse, by budget", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--preset", default="llama-1b")
    ap.add_argument("--max-size", type=int, default=256)
    ap.add_argument("--decode-sdpa", default="cudnn")
    ap.add_argument("--calls", type=int, default=1200)
    ap.add_argument("--budgets", default="0.25,0.5", help="shares of the full ladder's bytes")
    ap.add_argument("--modes", default="lru,refuse")
    ap.add_argument("--seed", type=int, default=41)
    ap.add_argument("--deadline", type=float, default=None, help="seconds: no run starts after")
    ap.add_argument("--out", type=Path, default=Path("bench/results"))
    args = ap.parse_args()
    t_start = time.perf_counter()
    dev = torch.device(args.device)
    gpu = torch.cuda.get_device_name().replace(" ", "-") if dev.type == "cuda" else "cpu"
    args.out.mkdir(parents=True, exist_ok=True)
    stem = f"lazy-evict_{gpu}_{time.strftime('%Y-%m-%d')}"
    path = args.out / f"{stem}.json"
    result: dict[str, Any] = {
        "meta": {
            "gpu": gpu,
            "torch": torch.__version__,
            "date": time.strftime("%Y-%m-%d %H:%M:%S"),
            "commit": os.environ.get("GRAPHGUARD_COMMIT", "unknown"),
            "preset": args.preset,
            "max_size": args.max_size,
            "calls": args.calls,
            "phases_hot_index": PHASES,
            "seed": args.seed,
        },
        "runs": [],
        "skipped": [],
    }
    with torch.inference_mode():
        model, dev = _model(args)
        model.decode_step(*model.example_inputs(2))  # the process's first forward
        model.warm_kernels([args.max_size])  # the arena at its final size: not graph memory
        _sync(dev)
        result["meta"]["kernels_loaded"] = load_kernels(model, dev, args)
        result["full_ladder"] = full = full_ladder(model, dev, args)
        print(f"full ladder: {full}", flush=True)
        path.write_text(json.dumps(result, indent=1, default=str))
        for share in (float(x) for x in args.budgets.split(",")):
            for mode in args.modes.split(","):
                if args.deadline is not None and time.perf_counter() - t_start > args.deadline:
                    result["skipped"].append(f"{mode} {share}")
                    print(f"{mode} at {share:.0%}: skipped, past --deadline", flush=True)
                    continue
                budget = int(share * full["ledger_bytes"])
                print(f"{mode} at {share:.0%} ({budget / MIB:.1f} MiB):", flush=True)
                run = serve(model, dev, args, budget, mode)
                run["budget_share"] = share
                result["runs"].append(run)
                shown = {k: v for k, v in run.items() if k not in ("timeline", "per_size")}
                print(f"  {json.dumps(shown, default=str)}", flush=True)
                result["meta"]["wall_s"] = round(time.perf_counter() - t_start, 1)
                path.write_text(json.dumps(result, indent=1, default=str))
    result["summary"] = {
        f"{r['mode']}@{r['budget_share']:.0%}": {
            "hit_rate": round(r["hit_rate"], 4),
            "evictions": r["evictions"],
            "oom_errors": r["oom_errors"],
            "ledger_vs_measured_max_gap": r["ledger_vs_measured_max_gap"],
            "within_5_percent": r["within_5_percent"],
            "outputs_not_bitwise": r["outputs_not_bitwise"],
        }
        for r in result["runs"]
    }
    result["meta"]["wall_s"] = round(time.perf_counter() - t_start, 1)
    path.write_text(json.dumps(result, indent=1, default=str))
    print("summary: " + json.dumps(result["summary"]), flush=True)
    if plot(result, args.out / f"{stem}.png"):
        print(f"wrote {args.out / (stem + '.png')}")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
