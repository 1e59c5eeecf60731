"""Graph provenance and the refit verdict (issues 30, 40) on the reference Llama-1B step.

Four measurements in one process, each paired with its baseline in the same run:

* **Ladder**: the 35-size ladder (``capture_sizes(256)``) captured with provenance off and
  on by default (graphs kept, read on the first question), alternately (ABBA) ``--rounds``
  times: capture seconds each way, the paired difference (goal: at most 10% of the off
  capture). Then the first question (``check_weights()`` reading all 35 graphs), the
  steady ``check_weights()`` (goal: at most 1 ms), ``audit()``, what the graphs read.
* **Replay** unchanged: the same sizes off and on, checked bitwise and against eager.
* **Lazy sizes**: two lazy runners (off, on) capturing the same sizes on first use,
  alternately: the first call's wall time, and the capture phases provenance adds to
  (goal: at most 2 ms a lazy size); then reading each new graph (its first question).
* **Refit**: ``update_weights`` of the whole 2.3 GiB model from a device state dict (the
  verdict included) against a bare ``torch._foreach_copy_`` of the same pairs, alternately
  (goal: at most 1.2x), and against the same copy in ``update_weights``' own form by hand
  (``copy_`` per tensor of at least 1 MiB, a device memcpy, and one ``_foreach_copy_`` for
  the rest: the ratio that is graphguard's overhead alone); and ``with runner.refit():``
  around the bare foreach copy (version counters and checksums). The graphs then equal
  eager bitwise at the captured size.

Host-side costs are ``perf_counter`` around a synchronized call (the device idle before
it); replay is CUDA events. The JSON is rewritten after each part (a run cut short keeps
what it measured); ``--deadline`` seconds bound the whole run (default 170). Writes
``<out>/provenance_<gpu>_<date>.json`` and a PNG beside it. On the GPU machine:
``GRAPHGUARD_COMMIT=$(git rev-parse --short HEAD) PYTHONPATH=src:ref/src python3
bench/bench_provenance.py --out bench/results``.
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
from graphguard.weights.plan import MEMCPY_BYTES
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
        options=gg.CaptureOptions(weights=model),
        **kw,
    )


def wall(fn: Any) -> float:
    """Seconds of ``fn()`` from an idle device to an idle device."""
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - t0


def replay_ms(r: gg.GraphRunner, inputs: tuple[torch.Tensor, ...], reps: int = 100) -> float:
    """Median CUDA-event time of one ``runner(*inputs)`` call, after warm-up."""
    for _ in range(10):
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


def med(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


class Out:
    """The result, rewritten after every part."""

    def __init__(self, out: str) -> None:
        gpu = torch.cuda.get_device_name()
        self.path = Path(out) / f"provenance_{gpu.replace(' ', '-')}_{datetime.date.today()}.json"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.data: dict[str, Any] = {
            "commit": os.environ.get("GRAPHGUARD_COMMIT", "unknown"),
            "gpu": gpu,
            "torch": torch.__version__,
            "date": str(datetime.date.today()),
        }

    def put(self, key: str, value: Any) -> None:
        self.data[key] = value
        self.path.write_text(json.dumps(self.data, indent=1, default=str))
        print(f"[{key}] {json.dumps(value, default=str)[:1500]}", flush=True)


def ladder_part(model: LlamaDecodeModel, sizes: list[int], rounds: int, out: Out) -> Any:
    """Off and on alternately (ABBA): capture seconds, paired differences."""
    runs: dict[str, list[float]] = {"off": [], "on": []}
    kept: dict[str, gg.GraphRunner] = {}
    order = [("off", "on"), ("on", "off")]
    for rnd in range(rounds):
        for kind in order[rnd % 2]:
            r = runner(model, sizes, provenance=False if kind == "off" else None, name=kind)
            with torch.inference_mode():
                runs[kind].append(wall(r.capture))
            if rnd == rounds - 1:
                kept[kind] = r
            else:
                r.release()
        print(f"ladder round {rnd}: off {runs['off'][-1]:.3f} s, on {runs['on'][-1]:.3f} s")
    diffs = [b - a for a, b in zip(runs["off"], runs["on"])]
    on = kept["on"]
    first = wall(on.check_weights)  # the first question reads every graph
    checks = [wall(on.check_weights) for _ in range(50)]
    audit_s = wall(on.audit)
    audit = on.audit()
    print(audit.table())
    reads = [g.seconds for g in audit.graphs]
    off_s = med(runs["off"])
    out.put(
        "ladder",
        {
            "sizes": len(sizes),
            "capture_off_s": off_s,
            "capture_on_s": med(runs["on"]),
            "capture_runs_s": runs,
            "paired_on_minus_off_s": diffs,
            "overhead_fraction": med(diffs) / off_s,
            "goal_fraction": 0.10,
            "why": audit.why,
            "first_check_s": first,
            "first_check_reads_graphs": len(audit.graphs),
            "read_ms_per_graph_median": med(reads) * 1e3,
            "read_ms_per_graph_max": max(reads) * 1e3,
            "check_ms_median": med(checks) * 1e3,
            "check_ms_goal": 1.0,
            "audit_s": audit_s,
            "named_reads_max": max(len(g.reads) for g in audit.graphs),
            "words_max": max(g.words for g in audit.graphs),
            "kernels_max": max(g.kernels for g in audit.graphs),
            "unknown": sum(len(g.unknown) for g in audit.graphs),
            "unowned": sum(len(g.unowned) for g in audit.graphs),
            "stale": len(audit.stale),
            "check_ok": on.check_weights().ok,
        },
    )
    return kept


def replay_part(model: LlamaDecodeModel, kept: dict[str, gg.GraphRunner], out: Out) -> None:
    rep: dict[str, dict[int, float]] = {"off": {}, "on": {}}
    top = max(kept["on"].sizes)
    with torch.inference_mode():
        for n in sorted({min(n, top) for n in (1, 8, 64, 256)}):
            ins = model.example_inputs(n, generator=torch.Generator().manual_seed(n))
            model.reset_cache()
            eager = model.decode_step(*ins).clone()
            model.reset_cache()
            a = kept["off"](*ins).clone()
            model.reset_cache()
            b = kept["on"](*ins).clone()
            assert torch.equal(a, b), f"batch {n}: off and on graphs differ"
            torch.testing.assert_close(a, eager, rtol=2e-2, atol=2e-2)  # bf16 vs eager
            rep["off"][n] = replay_ms(kept["off"], ins)
            rep["on"][n] = replay_ms(kept["on"], ins)
    out.put("replay_ms", rep)


def lazy_part(model: LlamaDecodeModel, sizes: list[int], lazy_sizes: list[int], out: Out) -> None:
    """Two lazy runners, the same sizes captured at their second call (the first is the
    size's warmup), alternately; the timed call is the capture and its replay."""
    runners = {
        kind: runner(
            model,
            sizes,
            provenance=False if kind == "off" else None,
            lazy=gg.Lazy(capture_now=[1]),
            name=f"lazy-{kind}",
        )
        for kind in ("off", "on")
    }
    with torch.inference_mode():
        for r in runners.values():
            r.capture()
        first: dict[str, dict[int, float]] = {"off": {}, "on": {}}
        phases: dict[str, dict[int, dict[str, float]]] = {"off": {}, "on": {}}
        read_ms: dict[int, float] = {}
        for i, n in enumerate(lazy_sizes):
            ins = model.example_inputs(n, generator=torch.Generator().manual_seed(n))
            for kind in ("off", "on") if i % 2 == 0 else ("on", "off"):
                r = runners[kind]
                r(*ins)  # the size's first call: its warmup, eagerly (graphguard.lazy)
                first[kind][n] = wall(lambda r=r, ins=ins: r(*ins)) * 1e3  # its capture
                rec = r._store.records.get(n)
                if rec is not None:
                    phases[kind][n] = {k: v * 1e3 for k, v in rec.phases.items()}
            on = runners["on"]
            read_ms[n] = wall(on.check_weights) * 1e3  # reads the new graph
        steady = med([wall(runners["on"].check_weights) * 1e3 for _ in range(20)])
    diffs = [first["on"][n] - first["off"][n] for n in lazy_sizes]
    added = {
        n: sum(
            phases["on"].get(n, {}).get(k, 0.0) - phases["off"].get(n, {}).get(k, 0.0)
            for k in ("capture", "register", "bookkeeping")
        )
        for n in lazy_sizes
    }
    out.put(
        "lazy",
        {
            "sizes": lazy_sizes,
            "first_call_ms": first,
            "paired_on_minus_off_ms": diffs,
            "median_on_minus_off_ms": med(diffs),
            "capture_phases_added_ms": added,
            "median_capture_phases_added_ms": med(list(added.values())),
            "goal_ms": 2.0,
            "first_question_ms": read_ms,
            "steady_check_ms": steady,
            "read_on_first_question_ms_median": med(list(read_ms.values())) - steady,
            "phases_ms": phases,
        },
    )
    for r in runners.values():
        r.release()


def refit_part(model: LlamaDecodeModel, on: gg.GraphRunner, reps: int, out: Out) -> None:
    """``update_weights`` (and a refit around a bare copy) against the bare copy."""
    named = list(model.named_parameters())  # tied names once, as an update copies them
    src = {k: v.detach().clone() for k, v in named}
    g = torch.Generator(device="cuda").manual_seed(7)
    for t in src.values():
        t.add_(torch.randn(t.shape, device="cuda", dtype=t.dtype, generator=g), alpha=1e-3)
    dsts = [p for _, p in named]
    srcs = [src[k] for k, _ in named]
    nbytes = sum(t.nbytes for t in dsts)

    def bare() -> None:
        with torch.no_grad():
            torch._foreach_copy_(dsts, srcs)

    big = [i for i, d in enumerate(dsts) if d.nbytes >= MEMCPY_BYTES]
    small = [i for i in range(len(dsts)) if i not in set(big)]
    small_dsts, small_srcs = [dsts[i] for i in small], [srcs[i] for i in small]

    def bare_split() -> None:  # update_weights' own copy form, by hand
        with torch.no_grad():
            for i in big:
                dsts[i].copy_(srcs[i])
            torch._foreach_copy_(small_dsts, small_srcs)

    phases: list[dict[str, float]] = []

    def update() -> None:
        phases.append(on.update_weights(src).phases)

    def refit() -> None:
        with on.refit(), torch.no_grad():
            torch._foreach_copy_(dsts, srcs)

    fns = {"bare": bare, "bare_split": bare_split, "update_weights": update, "refit": refit}
    times: dict[str, list[float]] = {k: [] for k in fns}
    with torch.inference_mode(False):
        update()  # the plan is validated once and kept
        for i in range(reps):
            for kind in list(fns) if i % 2 == 0 else list(fns)[::-1]:
                times[kind].append(wall(fns[kind]) * 1e3)
        up = on.update_weights(src)
    verdict = up.refit
    assert verdict is not None and verdict.ok, verdict.message() if verdict else "no verdict"
    assert all(torch.equal(p, src[k]) for k, p in named)
    with torch.inference_mode():
        ins = model.example_inputs(8, generator=torch.Generator().manual_seed(8))
        model.reset_cache()
        want = model.decode_step(*ins).clone()
        model.reset_cache()
        got = on(*ins).clone()
    assert torch.equal(got, want), "after the updates, the graph differs from eager"
    b, bs, u, f = (med(times[k]) for k in ("bare", "bare_split", "update_weights", "refit"))
    out.put(
        "refit",
        {
            "bytes": nbytes,
            "tensors": len(dsts),
            "ms_median": {
                "bare_foreach_copy": b,
                "bare_split_copy": bs,
                "update_weights": u,
                "refit_context": f,
            },
            "bare_split_rule": (
                f"copy_ per tensor of >= {MEMCPY_BYTES} bytes (a device-to-device memcpy), "
                "one _foreach_copy_ for the rest: update_weights' own copy form"
            ),
            "ms_runs": times,
            "update_phases_ms_median": {
                k: med([p[k] * 1e3 for p in phases[1:]]) for k in phases[-1]
            },
            "update_over_bare": u / b,
            "update_over_bare_split": u / bs,
            "refit_over_bare": f / b,
            "goal_update_over_bare": 1.2,
            "verdict": verdict.summary(),
            "written": len(verdict.written),
            "graph_equals_eager_after": True,
        },
    )


def plot(data: dict[str, Any], path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    ladder = data.get("ladder")
    if ladder:
        ax = axes[0]
        runs = ladder["capture_runs_s"]
        ax.plot(runs["off"], "o-", label="provenance off")
        ax.plot(runs["on"], "s-", label="on (default: read on first use)")
        ax.set_xlabel("round")
        ax.set_ylabel(f"{ladder['sizes']}-size ladder capture (s)")
        ax.set_title(
            f"overhead {ladder['overhead_fraction'] * 100:.1f}% (goal 10%); first check "
            f"{ladder['first_check_s'] * 1e3:.0f} ms",
            fontsize=9,
        )
        ax.legend(fontsize=8)
    lazy = data.get("lazy")
    if lazy:
        ax = axes[1]
        xs = lazy["sizes"]
        ax.plot(xs, [lazy["first_call_ms"]["off"][n] for n in xs], "o-", label="off")
        ax.plot(xs, [lazy["first_call_ms"]["on"][n] for n in xs], "s-", label="on")
        ax.plot(xs, [lazy["first_question_ms"][n] for n in xs], "^-", label="first check (read)")
        ax.set_xlabel("lazy size")
        ax.set_ylabel("ms")
        ax.set_title(
            f"lazy first call: +{lazy['median_on_minus_off_ms']:.2f} ms (goal 2)", fontsize=9
        )
        ax.legend(fontsize=8)
    refit = data.get("refit")
    if refit:
        ax = axes[2]
        ms = refit["ms_median"]
        ax.bar(list(ms), list(ms.values()))
        ax.set_ylabel("ms (median)")
        ax.set_title(
            f"{refit['bytes'] / 2**30:.2f} GiB update: {refit['update_over_bare']:.2f}x bare "
            f"foreach (goal 1.2x), {refit['update_over_bare_split']:.2f}x bare split",
            fontsize=9,
        )
        ax.tick_params(axis="x", labelsize=8)
    fig.suptitle(
        f"graph provenance and refit, reference Llama-1B bf16, {data['gpu']} ({data['commit']})"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", default="bench/results")
    ap.add_argument("--max-size", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--lazy-sizes", default="2,4,8,16,24,32,48,64")
    ap.add_argument("--refit-reps", type=int, default=20)
    ap.add_argument("--deadline", type=float, default=170.0, help="seconds for the whole run")
    args = ap.parse_args()
    t_start = time.perf_counter()

    def left() -> float:
        return args.deadline - (time.perf_counter() - t_start)

    torch.backends.cuda.matmul.allow_tf32 = True
    sizes = gg.capture_sizes(args.max_size)
    out = Out(args.out)
    cfg = LlamaConfig.preset("llama-1b", max_batch=args.max_size, max_context=512)
    model = LlamaDecodeModel.random(cfg, device="cuda", dtype=torch.bfloat16, seed=0)
    with torch.inference_mode():
        model.warm_kernels(sizes)
        warm = runner(model, sizes, provenance=False, name="warm")  # first-run work, untimed
        warm.capture()
        warm.release()
    print(f"setup {time.perf_counter() - t_start:.1f} s", flush=True)
    kept = ladder_part(model, sizes, args.rounds, out)
    if left() > 60:
        replay_part(model, kept, out)
    kept["off"].release()
    if left() > 40:
        refit_part(model, kept["on"], args.refit_reps, out)
    kept["on"].release()
    if left() > 30:
        lazy = [int(s) for s in args.lazy_sizes.split(",") if int(s) in sizes]
        lazy_part(model, sizes, lazy, out)
    out.put("seconds", time.perf_counter() - t_start)
    plot(out.data, out.path.with_suffix(".png"))
    print(f"wrote {out.path}")


if __name__ == "__main__":
    main()
