"""Graph pool of a capture ladder vs its largest size alone, and the estimate, per architecture.

For each architecture (an MoE block with an auxiliary-stream shared expert, a GPT-2-style
stack, and the reference Llama model when importable) on the GPU, with the default
ladder ``gg.capture_sizes(max_batch)``:

- ``ladder``: the pool of the whole ladder as ``GraphRunner`` captures it today (every
  smaller graph copies its outputs into the largest graph's output buffers, which live
  in the pool), with the growth of every size;
- ``alone``: the pool of the largest size captured alone;
- ``estimate``: ``runner.estimate_graph_memory()`` (today's extrapolation) and the
  estimators of :mod:`graphguard.estimate` over the same sampled profiling capture;
- ``external``: the same ladder with the shared output buffers allocated *outside* the
  pool (from the largest size's uncaptured warmup), every graph, the largest included,
  copying into them: the candidate fix. Its total is pool + output buffers.

Run on the GPU machine: ``python bench/bench_pool.py --out bench/results/pool.json``
(writes a PNG beside it when matplotlib is there). ``--quick`` uses small shapes.
"""

from __future__ import annotations

import argparse
import gc
import importlib
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
from graphguard import capture as lifecycle
from graphguard.buffers import flatten
from graphguard.report import CaptureReport
from graphguard.runner import GraphRunner, _GraphSet

try:
    from graphguard import estimate as gg_estimate
except ImportError:  # pragma: no cover - older checkout
    gg_estimate = None  # type: ignore[assignment]

MIB = float(1 << 20)

# BENCH_POOL_DRYRUN=1: CPU tensors and RecordingBackend, to check the code paths without
# a GPU (every byte count is 0 then).
DRY = os.environ.get("BENCH_POOL_DRYRUN") == "1"


def _sync() -> None:
    if not DRY:
        torch.cuda.synchronize()


def _empty() -> None:
    if not DRY:
        torch.cuda.empty_cache()


# --------------------------------------------------------------------------- candidate fix


class ExternalOutputSet(_GraphSet):
    """Shared output buffers allocated outside the graph pool.

    Why: when the largest graph's outputs live in the pool, the second graph's own
    outputs (alive while it copies them over) and its intermediates cannot reuse the
    blocks those outputs split, so the second capture grows the pool. Allocated before
    any capture (from the largest size's warmup output), the buffers split nothing, and
    every graph's pool blocks are all free again when its capture ends.
    """

    def __init__(self, name: str, share_outputs: bool) -> None:
        super().__init__(name, share_outputs)
        self.external_bytes = 0

    def adopt(self, size: int, out: Any) -> None:
        """Allocate the shared buffers like ``out`` (the largest size's warmup output)."""
        if self.out_leaves is not None:
            return
        leaves, spec = flatten(out)
        self.out_leaves = [
            torch.empty_like(x) if isinstance(x, torch.Tensor) else x for x in leaves
        ]
        self.out_spec = spec
        self.owner_size = size
        self.batched = [
            isinstance(x, torch.Tensor) and x.ndim > 0 and x.shape[0] == size for x in leaves
        ]
        self.external_bytes = sum(
            x.untyped_storage().nbytes() for x in self.out_leaves if isinstance(x, torch.Tensor)
        )


class ExternalOutputsRunner(GraphRunner):
    """``GraphRunner`` with :class:`ExternalOutputSet` (what runner.py would do)."""

    def _reset_graphs(self) -> None:
        super()._reset_graphs()
        self._set = ExternalOutputSet(self.name, self.share_outputs)
        self._adopt_into: ExternalOutputSet = self._set

    def _warmup_forward(self, size: int) -> None:
        snap = None if self._refill_always else self.static.snapshot()
        out = self._forward(*self.static.views(size))
        self._adopt_into.adopt(size, out)
        del out
        if snap is not None and self.static.written_since(snap):
            self._refill_always = True


def unowned_alias(t: torch.Tensor) -> torch.Tensor:
    """A view of ``t``'s memory that does not own it (what CUDA graph trees and vLLM do with
    graph outputs): once ``t`` dies the block is free in the graph pool, and the next
    (smaller) capture reuses it, while this graph keeps writing there on replay."""
    st = t.untyped_storage()
    alias_storage = torch._C._construct_storage_from_data_pointer(
        st.data_ptr(), t.device, st.nbytes()
    )
    out = torch.empty((0,), dtype=t.dtype, device=t.device)
    return out.set_(alias_storage, t.storage_offset(), t.size(), t.stride())


class UnownedOutputSet(_GraphSet):
    """Each graph keeps its own outputs, as unowned aliases: no copy, no shared buffer, and
    every output block returns to the pool for the next capture. Outputs stay valid until
    the next call (any size's replay may overwrite them), as the runner's contract says."""

    def __init__(self, name: str, share_outputs: bool) -> None:
        super().__init__(name, False)

    def register(self, size: int, graph: Any, leaves: list[Any]) -> None:
        # In place: the lifecycle's own reference to this list must not keep them alive.
        for i, x in enumerate(leaves):
            if isinstance(x, torch.Tensor):
                leaves[i] = unowned_alias(x)
        super().register(size, graph, leaves)


class UnownedOutputsRunner(GraphRunner):
    """``GraphRunner`` with :class:`UnownedOutputSet` (what runner.py would do)."""

    def _reset_graphs(self) -> None:
        super()._reset_graphs()
        self._set = UnownedOutputSet(self.name, False)


def profile_capture(runner: GraphRunner, sample: Sequence[int]) -> tuple[CaptureReport, int]:
    """What ``estimate_graph_memory`` runs (a profiling capture of ``sample`` into a
    throwaway pool), returning the report and the external output bytes."""
    external = isinstance(runner, ExternalOutputsRunner)
    throwaway: _GraphSet = (
        ExternalOutputSet(runner.name, True)
        if external
        else UnownedOutputSet(runner.name, False)
        if isinstance(runner, UnownedOutputsRunner)
        else _GraphSet(runner.name, True)
    )
    if external:
        assert isinstance(throwaway, ExternalOutputSet)
        runner._adopt_into = throwaway
    plan = lifecycle.CapturePlan(
        name=f"GraphRunner({runner.name}) profile",
        sizes=sorted(sample, reverse=True),
        warmup=runner._warmup_forward,
        body=lambda size: throwaway.body(size, runner.static.views(size), runner._forward),
        register=throwaway.register,
        warmup_iters=runner.warmup_iters,
        before_capture=runner.options.before_capture,
        workspaces=runner.workspaces,
        on_capture_error="raise",
        progress=False,
        profiling=True,
    )
    try:
        report = lifecycle.run(plan, runner.backend)
    finally:
        if external:
            assert isinstance(runner, ExternalOutputsRunner)
            runner._adopt_into = runner._set
    ext = getattr(throwaway, "external_bytes", 0)
    throwaway.graphs.clear()
    throwaway.out_leaves = None
    _sync()
    _empty()
    return report, int(ext)


def default_sample(ladder: Sequence[int]) -> list[int]:
    """The sizes today's ``estimate_graph_memory`` samples: largest, second, middle, smallest."""
    desc = sorted(ladder, reverse=True)
    rest = desc[1:]
    picks = {rest[0], rest[len(rest) // 2], rest[-1]} if rest else set()
    return [desc[0], *sorted(picks, reverse=True)]


def today_formula(growth: Sequence[int], n_sizes: int) -> int:
    """Today's extrapolation in runner.estimate_graph_memory (for the record)."""
    head = sum(growth[:2])
    tail = growth[2:]
    per = sum(tail) / len(tail) if tail else 0.0
    return int(head + per * max(0, n_sizes - min(2, len(growth))))


# --------------------------------------------------------------------------- architectures


@dataclass
class Arch:
    name: str
    step: Callable[..., Any]
    example: tuple[torch.Tensor, ...]
    fill: tuple[int, ...]
    max_batch: int
    before_capture: list[Any] = field(default_factory=list)
    workspaces: list[Any] = field(default_factory=list)
    cleanup: Callable[[], None] = lambda: None


def _find_ref() -> Any:
    for mod in (
        "graphguard_ref",
        "graphguard_ref.llama",
        "graphguard_ref.models.llama",
        "graphguard_ref.models",
        "graphguard.models.llama",
        "graphguard.models",
    ):
        try:
            m = importlib.import_module(mod)
        except ImportError:
            continue
        if hasattr(m, "LlamaDecodeModel") and hasattr(m, "LlamaConfig"):
            return m
    return None


def build_archs(names: Sequence[str], quick: bool, max_batch: int) -> list[Callable[[], Arch]]:
    dev = torch.device("cpu" if DRY else "cuda")
    dt = torch.float32 if DRY else torch.bfloat16
    out: list[Callable[[], Arch]] = []

    def moe(use_aux: bool) -> Callable[[], Arch]:
        def make() -> Arch:
            kw: dict[str, Any] = (
                dict(d=256, hidden=256, shared_hidden=512, vocab=4096) if quick else {}
            )
            m = MoEBlock(max_batch=max_batch, device=dev, dtype=dt, use_aux=use_aux, **kw)
            return Arch(
                "moe_aux" if use_aux else "moe_inline",
                m.step,
                m.example_inputs(max_batch),
                m.pad_fill_values(),
                max_batch,
            )

        return make

    def gpt2() -> Arch:
        kw: dict[str, Any] = (
            dict(d=256, heads=4, n_layers=2, context=64, vocab=4096) if quick else {}
        )
        m = GPT2Stack(max_batch=max_batch, device=dev, dtype=dt, **kw)
        return Arch("gpt2", m.step, m.example_inputs(max_batch), m.pad_fill_values(), max_batch)

    def ref() -> Arch:
        mod = _find_ref()
        if mod is None:
            raise RuntimeError(
                "reference model not importable (graphguard_ref / graphguard.models)"
            )
        preset = "tiny" if quick else "llama-1b"
        cfg = mod.LlamaConfig.preset(preset, max_batch=max_batch, max_context=1024)
        m = mod.LlamaDecodeModel.random(cfg, device=dev, dtype=dt, seed=0)
        return Arch(
            f"ref_{preset}",
            m.decode_step,
            m.example_inputs(max_batch),
            m.pad_fill_values(),
            max_batch,
            before_capture=[m.warm_kernels],
            workspaces=[m.workspace],
        )

    table = {"moe": moe(True), "moe_inline": moe(False), "gpt2": gpt2, "ref": ref}
    for n in names:
        out.append(table[n])
    return out


# --------------------------------------------------------------------------- measurement


def _fresh() -> None:
    gc.collect()
    _sync()
    _empty()


def _runner(cls: type[GraphRunner], a: Arch, sizes: Sequence[int]) -> GraphRunner:
    return cls(
        a.step,
        a.example,
        sizes=list(sizes),
        fill_values=a.fill,
        before_capture=a.before_capture,
        workspaces=a.workspaces,
        progress=False,
        name=a.name,
        backend=gg.RecordingBackend() if DRY else None,
    )


def _unlock(a: Arch) -> None:
    for ws in a.workspaces:
        if getattr(ws, "locked", False):
            ws.unlock(reason="bench: next configuration")


def pool_segments() -> dict[str, dict[str, float]]:
    """The graph pools' segments by (stream, small/large): where the pool's bytes are."""
    if DRY:
        return {}
    out: dict[str, dict[str, float]] = {}
    for seg in torch.cuda.memory_snapshot():
        pool = tuple(seg.get("segment_pool_id", (0, 0)))
        if pool == (0, 0):
            continue
        key = f"stream {seg.get('stream', 0):#x} {seg.get('segment_type', '?')}"
        d = out.setdefault(key, {"segments": 0, "mib": 0.0, "active_mib": 0.0})
        d["segments"] += 1
        d["mib"] += seg["total_size"] / MIB
        d["active_mib"] += seg.get("active_size", 0) / MIB
    return out


def _ladder(cls: type[GraphRunner], a: Arch, sizes: Sequence[int]) -> dict[str, Any]:
    r = _runner(cls, a, sizes)
    rep = r.capture()
    segments = pool_segments()
    ext = int(getattr(r._set, "external_bytes", 0))
    # correctness: the smallest and a middle size against eager
    errs = {}
    for n in sorted({1, sizes[len(sizes) // 2], sizes[-1]}):
        ins = [t[:n] for t in a.example]
        got = r(*ins).float()
        want = a.step(*ins).float()
        errs[n] = float((got - want).abs().max())
    res = {
        "pool_bytes": rep.pool_bytes,
        "external_output_bytes": ext,
        "total_bytes": rep.pool_bytes + ext,
        "growth_mib": [[s.size, round(s.pool_growth_bytes / MIB, 2)] for s in rep.sizes],
        "capture_s": rep.total_s,
        "max_abs_diff_vs_eager": errs,
        "pool_segments": segments,
    }
    r.release()
    _unlock(a)
    del r
    _fresh()
    return res


def _profile(
    cls: type[GraphRunner], a: Arch, ladder: Sequence[int], sample: Sequence[int]
) -> dict[str, Any]:
    r = _runner(cls, a, ladder)
    rep, ext = profile_capture(r, sample)
    growth = [s.pool_growth_bytes for s in rep.sizes]
    res: dict[str, Any] = {
        "sample": [s.size for s in rep.sizes],
        "growth_mib": [round(g / MIB, 2) for g in growth],
        "external_output_bytes": ext,
        "today_formula_bytes": today_formula(growth, len(ladder)) + ext,
    }
    if gg_estimate is not None:
        res["estimate_bytes"] = gg_estimate.estimate_pool_bytes(
            [(s.size, s.pool_growth_bytes) for s in rep.sizes], ladder, external_output_bytes=ext
        )
    _unlock(a)
    del r
    _fresh()
    return res


def measure_unowned(a: Arch, ladder: list[int]) -> dict[str, Any]:
    """The unowned-outputs candidate against the largest size alone (today's runner)."""
    res: dict[str, Any] = {"arch": a.name, "max_batch": a.max_batch, "n_sizes": len(ladder)}
    t0 = time.perf_counter()
    res["alone"] = _ladder(GraphRunner, a, [ladder[-1]])
    res["unowned"] = _ladder(UnownedOutputsRunner, a, ladder)
    res["unowned_alone"] = _ladder(UnownedOutputsRunner, a, [ladder[-1]])
    res["profile_unowned"] = _profile(UnownedOutputsRunner, a, ladder, default_sample(ladder))
    alone = max(res["alone"]["pool_bytes"], 1)
    real = res["unowned"]["pool_bytes"]
    res["summary"] = {
        "alone_mib": alone / MIB,
        "unowned_mib": real / MIB,
        "unowned_over_alone": real / alone,
        "unowned_alone_mib": res["unowned_alone"]["pool_bytes"] / MIB,
        "estimate_new_err_unowned": (res["profile_unowned"].get("estimate_bytes", 0) - real)
        / max(real, 1),
    }
    res["seconds"] = time.perf_counter() - t0
    return res


def measure(a: Arch, ladder: list[int]) -> dict[str, Any]:
    res: dict[str, Any] = {"arch": a.name, "max_batch": a.max_batch, "n_sizes": len(ladder)}
    t0 = time.perf_counter()
    # today's runner: its own estimate first (as an engine would), then the ladder
    r = _runner(GraphRunner, a, ladder)
    res["estimate_today_bytes"] = r.estimate_graph_memory()
    _unlock(a)
    del r
    _fresh()
    res["ladder"] = _ladder(GraphRunner, a, ladder)
    res["alone"] = _ladder(GraphRunner, a, [ladder[-1]])
    res["profile_today"] = _profile(GraphRunner, a, ladder, default_sample(ladder))
    res["external"] = _ladder(ExternalOutputsRunner, a, ladder)
    res["external_alone"] = _ladder(ExternalOutputsRunner, a, [ladder[-1]])
    res["profile_external"] = _profile(ExternalOutputsRunner, a, ladder, default_sample(ladder))
    res["profile_external_full"] = _profile(ExternalOutputsRunner, a, ladder, ladder)
    alone = max(res["alone"]["pool_bytes"], 1)
    real = res["ladder"]["pool_bytes"]
    ext_real = res["external"]["total_bytes"]
    res["summary"] = {
        "alone_mib": alone / MIB,
        "ladder_mib": real / MIB,
        "ladder_over_alone": real / alone,
        "estimate_today_err": (res["estimate_today_bytes"] - real) / max(real, 1),
        "external_total_mib": ext_real / MIB,
        "external_over_alone": ext_real / alone,
        "external_alone_total_mib": res["external_alone"]["total_bytes"] / MIB,
    }
    pe = res["profile_external"]
    if "estimate_bytes" in pe:
        res["summary"]["estimate_new_err_external"] = (pe["estimate_bytes"] - ext_real) / max(
            ext_real, 1
        )
    pt = res["profile_today"]
    if "estimate_bytes" in pt:
        res["summary"]["estimate_new_err_today"] = (pt["estimate_bytes"] - real) / max(real, 1)
    res["seconds"] = time.perf_counter() - t0
    return res


# --------------------------------------------------------------------------- compiled steps


def _ms(fn: Callable[[], Any], reps: int = 30) -> float:
    """ms per call of ``fn`` over ``reps`` back-to-back calls (CUDA events), median of 3."""
    times = []
    for _ in range(3):
        fn()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(reps):
            fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / reps)
    return sorted(times)[1]


def measure_compiled(
    a: Arch, ladder: list[int], batches: Sequence[int], reduce_overhead: bool
) -> dict[str, Any]:
    """One compile for the ladder: compiles, compile + capture seconds, ms/step vs graphs
    of eager kernels, max |diff| vs eager; optionally reduce-overhead's one-size compile."""
    from graphguard.compiled import compile_step

    torch._dynamo.reset()
    res: dict[str, Any] = {"arch": a.name, "ladder": ladder}
    compiled = compile_step(a.step, name=a.name)
    t0 = time.perf_counter()
    rc = _runner(GraphRunner, a, ladder)
    rc.fn = compiled
    rep = rc.capture()
    res["compile_and_capture_s"] = time.perf_counter() - t0
    res["capture_report_s"] = rep.total_s
    res["compiles"] = compiled.compiles
    res["recompile_reasons"] = compiled.recompile_reasons[:5]
    _unlock(a)
    re_ = _runner(GraphRunner, a, ladder)
    t0 = time.perf_counter()
    re_.capture()
    res["eager_kernels_capture_s"] = time.perf_counter() - t0
    res["ms"] = {}
    for b in batches:
        ins = [t[:b] for t in a.example]
        want = a.step(*ins).float()
        res["ms"][b] = {
            "graph_of_compiled": _ms(lambda ins=ins: rc(*ins)),
            "graph_of_eager_kernels": _ms(lambda ins=ins: re_(*ins)),
            "max_abs_diff_compiled_vs_eager": float((rc(*ins).float() - want).abs().max()),
        }
    res["compiles_after_serving"] = compiled.compiles
    rc.release()
    re_.release()
    _unlock(a)
    _fresh()
    if reduce_overhead:
        b = ladder[-1]
        ins = [t[:b].clone() for t in a.example]
        torch._dynamo.reset()
        try:
            ro = torch.compile(a.step, mode="reduce-overhead", dynamic=False)
            t0 = time.perf_counter()
            for _ in range(3):
                ro(*ins)
            torch.cuda.synchronize()
            res["reduce_overhead_one_size_compile_s"] = time.perf_counter() - t0
            res["reduce_overhead_ms"] = {b: _ms(lambda: ro(*ins))}
        except Exception as exc:
            res["reduce_overhead_error"] = repr(exc)
        torch._dynamo.reset()
        _fresh()
    return res


def sanitized_compiled_check() -> dict[str, Any]:
    """A compiled step under the sanitizer: does it capture, verify, and compile?"""
    from graphguard.compiled import compile_step

    torch._dynamo.reset()
    dev = torch.device("cuda")
    w = torch.randn(64, 64, device=dev) * 0.1

    def step(x: torch.Tensor) -> torch.Tensor:
        return torch.relu(x @ w) + x

    c = compile_step(step)
    r = GraphRunner(
        c, (torch.randn(8, 64, device=dev),), sizes=[1, 2, 4, 8], progress=False, sanitize=True
    )
    r.capture()
    x = torch.randn(3, 64, device=dev)
    diff = float((r(x) - step(x)).abs().max())
    r.verify()
    out = {"compiles": c.compiles, "max_abs_diff": diff, "runner": type(r).__name__}
    r.release()
    return out


def plot(results: list[dict[str, Any]], path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    ok = [r for r in results if "ladder_over_alone" in r.get("summary", {})]
    if not ok:
        return
    fig, ax = plt.subplots(figsize=(8, 4))
    xs = range(len(ok))
    w = 0.2
    ax.bar(
        [x - 1.5 * w for x in xs],
        [r["summary"]["ladder_over_alone"] for r in ok],
        w,
        label="ladder today / alone",
    )
    ax.bar(
        [x - 0.5 * w for x in xs],
        [r["summary"]["external_over_alone"] for r in ok],
        w,
        label="ladder, outputs outside pool / alone",
    )
    ax.bar(
        [x + 0.5 * w for x in xs],
        [1 + r["summary"]["estimate_today_err"] for r in ok],
        w,
        label="estimate today / real",
    )
    ax.bar(
        [x + 1.5 * w for x in xs],
        [1 + r["summary"].get("estimate_new_err_external", 0.0) for r in ok],
        w,
        label="new estimate / real (outside pool)",
    )
    ax.axhline(1.1, color="k", ls="--", lw=0.8)
    ax.set_xticks(list(xs), [r["arch"] for r in ok])
    ax.set_ylabel("ratio")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def plot_combined(today: Path, unowned: Path, out: Path) -> dict[str, Any]:
    """One chart (and a summary) from a full run and an ``--unowned-only`` run.

    The largest-alone baseline is the full run's (captured after the auxiliary stream's
    cuBLAS workspace existed; the unowned run's first capture also holds that 32 MiB).
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    full = {r["arch"]: r for r in json.loads(today.read_text())["results"] if "summary" in r}
    new = {r["arch"]: r for r in json.loads(unowned.read_text())["results"] if "summary" in r}
    rows: dict[str, dict[str, float]] = {}
    for arch, r in full.items():
        if arch not in new:
            continue
        alone = r["alone"]["pool_bytes"]
        u = new[arch]
        real_u = u["unowned"]["pool_bytes"]
        rows[arch] = {
            "alone_mib": alone / MIB,
            "ladder_today_over_alone": r["ladder"]["pool_bytes"] / alone,
            "outputs_outside_pool_over_alone": r["external"]["total_bytes"] / alone,
            "unowned_outputs_over_alone": real_u / alone,
            "estimate_today_over_real": r["estimate_today_bytes"] / r["ladder"]["pool_bytes"],
            "estimate_sum_over_real_unowned": u["profile_unowned"]["estimate_bytes"] / real_u,
        }
    keys = list(next(iter(rows.values())).keys())[1:]
    fig, ax = plt.subplots(figsize=(9, 4))
    w = 0.8 / len(keys)
    for k, key in enumerate(keys):
        xs = [i + (k - (len(keys) - 1) / 2) * w for i in range(len(rows))]
        ax.bar(xs, [v[key] for v in rows.values()], w, label=key.replace("_", " "))
    ax.axhline(1.1, color="k", ls="--", lw=0.8)
    ax.set_xticks(range(len(rows)), list(rows))
    ax.set_ylabel("ratio")
    ax.set_title("graph pool of the 35-size ladder (max batch 256), H200")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--archs", default="moe,moe_inline,gpt2,ref")
    ap.add_argument("--max-batch", type=int, default=256)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument(
        "--record-stream-reuse",
        action="store_true",
        help="also rerun the MoE block with graph_capture_record_stream_reuse",
    )
    ap.add_argument("--out", type=Path, default=Path("bench/results/pool.json"))
    ap.add_argument(
        "--compiled",
        default="",
        help="comma list of archs to run the compiled-step section on instead",
    )
    ap.add_argument("--compiled-max-batch", type=int, default=64)
    ap.add_argument(
        "--compiled-from-2",
        action="store_true",
        help="compiled ladder without size 1 (batch 1 pads to 2)",
    )
    ap.add_argument("--skip-sanitized", action="store_true")
    ap.add_argument(
        "--reduce-overhead",
        action="store_true",
        help="also time reduce-overhead's compile of the largest size (ref only)",
    )
    ap.add_argument(
        "--unowned-only",
        action="store_true",
        help="measure only the unowned-outputs candidate (and the largest alone)",
    )
    ap.add_argument(
        "--plot-from",
        nargs=2,
        type=Path,
        metavar=("FULL_JSON", "UNOWNED_JSON"),
        help="no GPU: write the combined chart to --out (.png) and print it",
    )
    args = ap.parse_args()
    if args.plot_from:
        rows = plot_combined(*args.plot_from, args.out.with_suffix(".png"))
        print(json.dumps(rows, indent=1))
        return
    if not torch.cuda.is_available() and not DRY:
        raise SystemExit("bench_pool needs a CUDA GPU (BENCH_POOL_DRYRUN=1 checks it on a CPU)")
    ladder = gg.capture_sizes(args.max_batch)
    meta = {
        "gpu": "dry run (cpu)" if DRY else torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "ladder": ladder,
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
    }
    results: list[dict[str, Any]] = []
    args.out.parent.mkdir(parents=True, exist_ok=True)

    def dump() -> None:
        args.out.write_text(json.dumps({"meta": meta, "results": results}, indent=1))

    if args.compiled:
        cl = gg.capture_sizes(args.compiled_max_batch)
        if args.compiled_from_2:  # batch 1 pads to 2: no 0/1 specialization, one compile
            cl = [s for s in cl if s > 1]
        meta["ladder"] = cl
        try:
            if not args.skip_sanitized:
                results.append({"sanitized_compiled": sanitized_compiled_check()})
                print(results[-1], flush=True)
        except Exception as exc:
            traceback.print_exc()
            results.append({"sanitized_compiled": {"error": repr(exc)}})
        dump()
        for make in build_archs(args.compiled.split(","), args.quick, args.compiled_max_batch):
            try:
                a = make()
                print(f"== compiled {a.name}", flush=True)
                res = measure_compiled(
                    a,
                    cl,
                    [1, 16, cl[-1]],
                    reduce_overhead=a.name.startswith("ref") and args.reduce_overhead,
                )
                print(json.dumps(res, indent=1), flush=True)
                results.append(res)
            except Exception as exc:
                traceback.print_exc()
                results.append({"compiled_error": repr(exc)})
            gg.phase.reset()
            _fresh()
            dump()
        print(f"wrote {args.out}")
        return
    makers = build_archs(args.archs.split(","), args.quick, args.max_batch)
    if args.record_stream_reuse:
        makers.append(lambda: _with_reuse(build_archs(["moe"], args.quick, args.max_batch)[0]))
    for make in makers:
        try:
            a = make()
            print(f"== {a.name}", flush=True)
            if args.unowned_only:
                res = measure_unowned(a, ladder)
                print(json.dumps(res["summary"]), flush=True)
                print("unowned growth MiB:", res["unowned"]["growth_mib"][:6], flush=True)
                print("diffs:", res["unowned"]["max_abs_diff_vs_eager"], flush=True)
                print("profile_unowned:", res["profile_unowned"], flush=True)
            else:
                res = measure(a, ladder)
                print(json.dumps(res["summary"]), flush=True)
                print("ladder growth MiB:", res["ladder"]["growth_mib"][:6], flush=True)
                print("external growth MiB:", res["external"]["growth_mib"][:6], flush=True)
                print("profile_today:", res["profile_today"], flush=True)
                print("profile_external:", res["profile_external"], flush=True)
            results.append(res)
            a.cleanup()
            del a
        except Exception as exc:  # keep the other architectures' numbers
            traceback.print_exc()
            results.append({"arch": getattr(make, "__name__", "?"), "error": repr(exc)})
        gg.phase.reset()
        _fresh()
        dump()
    plot(results, args.out.with_suffix(".png"))
    dump()
    print(f"wrote {args.out}")


def _with_reuse(make: Callable[[], Arch]) -> Arch:
    """The MoE block with the allocator reusing record_stream'd blocks during capture."""
    torch.cuda.memory._set_allocator_settings("graph_capture_record_stream_reuse:True")
    a = make()
    a.name += "_record_stream_reuse"
    return a


if __name__ == "__main__":
    main()
