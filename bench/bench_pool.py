"""Graph pool of the default capture ladder vs its largest size alone, and the estimate.

For each architecture (``moe``: an MoE block whose shared expert runs on a
``gg.AuxStream``; ``moe_inline``: the same block on one stream; ``gpt2``: a GPT-2-style
stack; ``ref``: the reference Llama model of ``graphguard_ref``) on the GPU, with the
default ladder ``gg.capture_sizes(max_batch)``, in the order an engine does it:

1. ``estimate``: ``runner.estimate_graph_memory()`` before anything is captured;
2. ``ladder``: the whole ladder's real pool (``report.pool_bytes``), its capture seconds,
   and max |graph - eager| at a few batch sizes (ladder sizes and padded ones);
3. ``alone``: the largest size captured alone.

Per arch the summary gives ``ladder_over_alone`` (target <= 1.1: graph outputs are
non-owning views, so the ladder's pool is about its largest graph's) and
``estimate_err`` = estimate / measured - 1 (target within 10%, never under by more than 5%),
where "measured" is the free device memory the ladder's graphs hold (the pool plus the
driver's share outside the allocator, warmups' cached blocks handed back first);
``ledger_err`` is the runner's ledger (``report.pool_bytes + report.driver_bytes``) against
the same, and ``released_share`` what ``release()`` gave back of it.
``--compiled moe,gpt2`` adds the same ladder captured with ``GraphRunner(compile=True)``.

GPU: ``python bench/bench_pool.py --out bench/results/pool.json`` (JSON, and a PNG beside
it when matplotlib imports). CPU check of the code paths: ``BENCH_POOL_DRYRUN=1 python
bench/bench_pool.py --quick --max-batch 16`` (RecordingBackend; every byte count is 0).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import graphguard as gg
from archs import GPT2Stack, MoEBlock
from graphguard.backend import drop_blas_workspaces
from graphguard.runner import GraphRunner

MIB = float(1 << 20)
LADDER_TARGET = 1.1
EST_OVER, EST_UNDER = 0.10, -0.05

# BENCH_POOL_DRYRUN=1: CPU tensors and RecordingBackend, to check the code paths without
# a GPU (every byte count is 0 then).
DRY = os.environ.get("BENCH_POOL_DRYRUN") == "1"


def _fresh() -> None:
    """Hand cached blocks back so each measurement starts from the same allocator state."""
    gc.collect()
    if not DRY:
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


@dataclass
class Arch:
    name: str
    step: Callable[..., Any]
    example: tuple[torch.Tensor, ...]
    fill: tuple[int, ...]
    before_capture: list[Any] = field(default_factory=list)
    workspaces: list[Any] = field(default_factory=list)


def build_arch(name: str, quick: bool, max_batch: int) -> Arch:
    dev = torch.device("cpu" if DRY else "cuda")
    dt = torch.float32 if DRY else torch.bfloat16
    if name in ("moe", "moe_inline"):
        kw: dict[str, Any] = dict(d=256, hidden=256, shared_hidden=512, vocab=4096) if quick else {}
        m = MoEBlock(max_batch=max_batch, device=dev, dtype=dt, use_aux=name == "moe", **kw)
        label = "moe_aux" if name == "moe" else name
        return Arch(label, m.step, m.example_inputs(max_batch), m.pad_fill_values())
    if name == "gpt2":
        kw = dict(d=256, heads=4, n_layers=2, context=64, vocab=4096) if quick else {}
        g = GPT2Stack(max_batch=max_batch, device=dev, dtype=dt, **kw)
        return Arch(name, g.step, g.example_inputs(max_batch), g.pad_fill_values())
    if name == "ref":
        from graphguard_ref import LlamaConfig, LlamaDecodeModel

        preset = "tiny" if quick else "llama-1b"
        cfg = LlamaConfig.preset(preset, max_batch=max_batch, max_context=1024)
        r = LlamaDecodeModel.random(cfg, device=dev, dtype=dt, seed=0)
        return Arch(
            f"ref_{preset}",
            r.decode_step,
            r.example_inputs(max_batch),
            r.pad_fill_values(),
            before_capture=[r.warm_kernels],
            workspaces=[r.workspace],
        )
    raise SystemExit(f"unknown arch {name!r}: use moe, moe_inline, gpt2, ref")


def _runner(a: Arch, sizes: Sequence[int], compile: bool = False) -> GraphRunner:
    if compile:  # each runner compiles the same code: start dynamo's cache empty for each
        torch._dynamo.reset()
    return GraphRunner(
        a.step,
        a.example,
        sizes=list(sizes),
        fill_values=a.fill,
        before_capture=a.before_capture,
        workspaces=a.workspaces,
        progress=False,
        name=a.name,
        compile=compile,
        backend=gg.RecordingBackend() if DRY else None,
    )


def _done(a: Arch, r: GraphRunner) -> None:
    """Release the graphs and unlock the arenas, so the next configuration starts clean."""
    r.release()
    for ws in a.workspaces:
        if getattr(ws, "locked", False):
            ws.unlock(reason="bench: next configuration")
    _fresh()


def _tensors(out: Any) -> list[torch.Tensor]:
    if isinstance(out, torch.Tensor):
        return [out]
    return [t for t in out if isinstance(t, torch.Tensor)]


def check_sizes(ladder: Sequence[int]) -> list[int]:
    """Smallest, a padded size, the middle one and the largest: hits and pads both."""
    mid = ladder[len(ladder) // 2]
    picks = {ladder[0], ladder[-1], mid}
    padded = next((n for n in range(mid + 1, ladder[-1]) if n not in ladder), None)
    if padded is not None:
        picks.add(padded)
    return sorted(picks)


def diffs_vs_eager(a: Arch, r: GraphRunner, sizes: Sequence[int]) -> dict[int, float]:
    """Max |graph - eager| relative to max |eager| per batch size (outputs are views: clone)."""
    out: dict[int, float] = {}
    for n in sizes:
        ins = [t[:n] for t in a.example]
        got = [t.float().clone() for t in _tensors(r(*ins))]
        want = [t.float() for t in _tensors(a.step(*ins))]
        out[n] = max(
            float((g - w).abs().max()) / max(float(w.abs().max()), 1e-6)
            for g, w in zip(got, want, strict=True)
        )
    return out


def _free() -> int:
    """Free device memory, with no cached cuBLAS workspace in the general pool (a capture
    drops those, which would read as graph memory given back)."""
    if DRY:
        return 0
    drop_blas_workspaces()
    _fresh()
    return int(torch.cuda.mem_get_info()[0])


def capture(a: Arch, sizes: Sequence[int], check: Sequence[int], compile: bool) -> dict[str, Any]:
    r = _runner(a, sizes, compile)
    _fresh()
    free0 = _free()
    rep = r.capture()
    # The truth the ledger is checked against: free device memory the graphs hold, the
    # warmups' cached blocks handed back first (the general pool is not graph memory).
    _fresh()
    free1 = _free()
    res: dict[str, Any] = {
        "pool_bytes": rep.pool_bytes,
        "driver_bytes": rep.driver_bytes,
        "ledger_bytes": r.door.ledger.used,
        "measured_bytes": free0 - free1,
        "capture_s": rep.total_s,
        "growth_mib": [[s.size, round(s.pool_growth_bytes / MIB, 2)] for s in rep.sizes[:6]],
        "rel_diff_vs_eager": diffs_vs_eager(a, r, check),
    }
    if compile:
        res.update(compiles=rep.compiles, compile_s=rep.compile_s, recompiles=rep.recompiles)
    _done(a, r)
    res["released_bytes"] = _free() - free1  # what release() (and empty_cache) gave back
    return res


def measure(a: Arch, ladder: list[int], compile: bool = False) -> dict[str, Any]:
    res: dict[str, Any] = {"arch": a.name + ("_compiled" if compile else ""), "compile": compile}
    t0 = time.perf_counter()
    r = _runner(a, ladder, compile)  # the estimate first, as an engine sizing its KV cache
    sizes = list(r.sizes)  # compile=True pads batch 1 to 2: its own ladder
    res["n_sizes"] = len(sizes)
    est_t0 = time.perf_counter()
    res["estimate_bytes"] = r.estimate_graph_memory()
    res["estimate_s"] = time.perf_counter() - est_t0
    _done(a, r)
    del r
    check = check_sizes(sizes)
    res["ladder"] = capture(a, sizes, check, compile)
    res["alone"] = capture(a, [sizes[-1]], [sizes[-1]], compile)
    lad = res["ladder"]
    real = lad["pool_bytes"]
    alone = res["alone"]["pool_bytes"]
    over = real / alone if alone else 0.0
    truth = lad["measured_bytes"]  # pool + the driver's share, from free device memory
    err = res["estimate_bytes"] / truth - 1 if truth else 0.0
    ledger_err = lad["ledger_bytes"] / truth - 1 if truth else 0.0
    res["summary"] = {
        "ladder_mib": real / MIB,
        "alone_mib": alone / MIB,
        "driver_mib": lad["driver_bytes"] / MIB,
        "measured_mib": truth / MIB,
        "ledger_mib": lad["ledger_bytes"] / MIB,
        "estimate_mib": res["estimate_bytes"] / MIB,
        "released_mib": lad["released_bytes"] / MIB,
        "ladder_over_alone": over,
        "estimate_err": err,
        "ledger_err": ledger_err,
        "released_share": lad["released_bytes"] / truth if truth else 0.0,
        "ladder_ok": over <= LADDER_TARGET,
        "estimate_ok": EST_UNDER <= err <= EST_OVER,
        "ledger_ok": abs(ledger_err) <= EST_OVER,
        "capture_s": res["ladder"]["capture_s"],
        "estimate_s": res["estimate_s"],
        "max_rel_diff_vs_eager": max(res["ladder"]["rel_diff_vs_eager"].values()),
    }
    res["seconds"] = time.perf_counter() - t0
    return res


def plot(results: list[dict[str, Any]], path: Path) -> bool:
    """Bars per arch: ladder / alone and estimate / ladder, with the targets as lines."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    ok = [r for r in results if "summary" in r]
    if not ok:
        return False
    fig, ax = plt.subplots(figsize=(max(6.0, 1.4 * len(ok)), 4))
    xs = list(range(len(ok)))
    w = 0.35
    ax.bar([x - w / 2 for x in xs], [r["summary"]["ladder_over_alone"] for r in ok], w,
           label="ladder pool / largest alone")  # fmt: skip
    ax.bar([x + w / 2 for x in xs], [1 + r["summary"]["estimate_err"] for r in ok], w,
           label="estimate / measured graph memory")  # fmt: skip
    ax.axhline(LADDER_TARGET, color="k", ls="--", lw=0.8, label="targets")
    ax.axhline(1 + EST_UNDER, color="k", ls=":", lw=0.8)
    ax.set_xticks(xs, [r["arch"] for r in ok], fontsize=8)
    ax.set_ylabel("ratio")
    ax.set_title("graph pool of gg.capture_sizes(max_batch)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--archs", default="moe,moe_inline,gpt2,ref")
    ap.add_argument("--max-batch", type=int, default=256)
    ap.add_argument("--quick", action="store_true", help="small shapes (ref: the tiny preset)")
    ap.add_argument("--compiled", default="", help="archs to also measure with compile=True")
    ap.add_argument("--out", type=Path, default=Path("bench/results/pool.json"))
    args = ap.parse_args()
    if not torch.cuda.is_available() and not DRY:
        raise SystemExit("bench_pool needs a CUDA GPU (BENCH_POOL_DRYRUN=1 checks it on a CPU)")
    ladder = gg.capture_sizes(args.max_batch)
    meta = {
        "gpu": "dry run (cpu)" if DRY else torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "ladder": ladder,
        "targets": {"ladder_over_alone": LADDER_TARGET, "estimate_err": [EST_UNDER, EST_OVER]},
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
    }
    results: list[dict[str, Any]] = []
    args.out.parent.mkdir(parents=True, exist_ok=True)

    def dump() -> None:
        args.out.write_text(json.dumps({"meta": meta, "results": results}, indent=1))

    runs = [(n, False) for n in args.archs.split(",") if n]
    runs += [(n, True) for n in args.compiled.split(",") if n]
    t0 = time.perf_counter()
    for name, compile in runs:
        try:
            a = build_arch(name, args.quick, args.max_batch)
            print(f"== {a.name}{' compile=True' if compile else ''}", flush=True)
            res = measure(a, ladder, compile)
            print(json.dumps(res["summary"]), flush=True)
            results.append(res)
            del a
        except Exception as exc:  # keep the other architectures' numbers
            traceback.print_exc()
            results.append({"arch": name, "compile": compile, "error": repr(exc)})
        gg.phase.reset()
        _fresh()
        dump()
    meta["total_s"] = time.perf_counter() - t0
    png = args.out.with_suffix(".png")
    if plot(results, png):
        print(f"wrote {png}")
    dump()
    print(f"wrote {args.out} ({meta['total_s']:.1f} s)")
    if any("error" in r for r in results):
        raise SystemExit(1)


if __name__ == "__main__":
    main()
