"""Decode-step benchmark on the reference model: eager, hand-rolled graphs, graphguard,
torch.compile(mode="reduce-overhead"), all in one run on one GPU.

Per batch size B: median ms/step from CUDA events after warm-up (``--reps`` repeats),
each method's logits checked against eager. Plus: capture time and graph pool of the
whole default ladder (graphguard vs a hand-rolled capture of the same ladder, each
graph keeping its own output), the pool of the largest size alone, the runner's
host-side dispatch cost over a bare ``CUDAGraph.replay()`` of the same graph, and the
memory-bandwidth floor (weight + KV bytes / measured copy bandwidth).

Writes ``<out>/decode_<gpu>_<date>.json`` (with a top-level ``summary``) and a PNG plot.
"""

from __future__ import annotations

import argparse
import gc
import json
import time
import traceback
from pathlib import Path
from typing import Any

import torch
import torch._dynamo

import graphguard as gg
from graphguard_ref.llama import LlamaConfig, LlamaDecodeModel
from graphguard_ref.timing import cuda_ms, idle_host_us, isolated_ms

Inputs = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


def copy_bandwidth() -> float:
    """Device copy bandwidth in bytes/s (bytes read + written), 2 GiB buffers."""
    a = torch.empty(1 << 30, dtype=torch.uint8, device="cuda").random_()
    b = torch.empty_like(a)
    ms = cuda_ms(lambda: b.copy_(a), 20)
    return 2 * (1 << 30) / (ms / 1e3)


def handrolled_ladder(
    model: LlamaDecodeModel, sizes: list[int]
) -> tuple[float, int, dict[int, tuple[torch.cuda.CUDAGraph, Inputs, torch.Tensor]]]:
    """What engines write by hand: per size (largest first) 1 warmup + sync, capture into
    one shared pool, each graph keeping its own output."""
    graphs: dict[int, tuple[torch.cuda.CUDAGraph, Inputs, torch.Tensor]] = {}
    pool = torch.cuda.graph_pool_handle()
    stream = torch.cuda.Stream()
    fill = model.pad_fill_values()
    torch.cuda.synchronize()
    before = torch.cuda.memory_reserved()
    t0 = time.perf_counter()
    for n in sorted(sizes, reverse=True):
        static = tuple(torch.full((n,), f, dtype=torch.long, device="cuda") for f in fill)
        with torch.cuda.stream(stream):
            model.decode_step(*static)
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, pool=pool, stream=stream):
            out = model.decode_step(*static)
        graphs[n] = (g, static, out)  # type: ignore[assignment]
    torch.cuda.synchronize()
    return time.perf_counter() - t0, torch.cuda.memory_reserved() - before, graphs


def main() -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--preset", default="llama-1b")
    ap.add_argument("--batches", default="1,4,16,64,256")
    ap.add_argument("--max-batch", type=int, default=256)
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--compile-budget-s", type=float, default=240.0)
    ap.add_argument("--no-compile", action="store_true")
    ap.add_argument("--out", type=Path, default=Path("bench/results"))
    args = ap.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    torch.backends.cuda.matmul.allow_tf32 = True
    dev = torch.device("cuda")
    gpu = torch.cuda.get_device_name()
    cfg = LlamaConfig.preset(args.preset, max_batch=args.max_batch, max_context=args.context)
    model = LlamaDecodeModel.random(cfg, device=dev, dtype=torch.bfloat16, seed=0)
    result: dict[str, Any] = {
        "gpu": gpu,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "date": time.strftime("%Y-%m-%d"),
        "preset": args.preset,
        "dtype": "bfloat16",
        "max_batch": cfg.max_batch,
        "context": cfg.max_context,
        "params": cfg.num_params,
        "batches": batches,
        "methods": {},
    }
    gen = torch.Generator(device=dev).manual_seed(0)

    def inputs(b: int) -> Inputs:
        tok = torch.randint(0, cfg.vocab_size, (b,), device=dev, generator=gen)
        pos = torch.randint(0, cfg.max_context, (b,), device=dev, generator=gen)
        slots = torch.randperm(cfg.max_batch, device=dev, generator=gen)[:b]
        return tok, pos, slots

    fixed = {b: inputs(b) for b in batches}
    with torch.inference_mode():
        model.warm_kernels(gg.capture_sizes(cfg.max_batch))
        torch.cuda.synchronize()
        ref = {b: model.decode_step(*fixed[b]).float() for b in batches}

        def check(b: int, out: torch.Tensor) -> float:
            return float((out.float() - ref[b]).abs().max())

        # eager
        eager = {}
        for b in batches:
            step = lambda b=b: model.decode_step(*fixed[b])  # noqa: E731
            eager[b] = {"ms": cuda_ms(step, args.reps), "ms_isolated": isolated_ms(step, args.reps)}
        result["methods"]["eager"] = eager

        # graphguard, default ladder
        ladder = gg.capture_sizes(cfg.max_batch)
        runner = gg.GraphRunner(
            model.decode_step,
            fixed[batches[0]],
            sizes=ladder,
            fill_values=model.pad_fill_values(),
            before_capture=[model.warm_kernels],
            workspaces=[model.workspace],
            progress=False,
            name="bench",
        )
        estimate = runner.estimate_graph_memory()
        cold = runner.capture()  # first capture in the process: per-shape first-run costs
        # The same ladder again with every shape's kernels already chosen, to compare
        # with the hand-rolled capture below, which also runs on warm kernels.
        report = runner.recapture(reason="benchmark: warm-kernel capture")
        ggm = {}
        for b in batches:
            step = lambda b=b: runner(*fixed[b])  # noqa: E731
            ggm[b] = {
                "ms": cuda_ms(step, args.reps),
                "ms_isolated": isolated_ms(step, args.reps),
                "max_abs_diff_vs_eager": check(b, runner(*fixed[b])),
            }
        result["methods"]["graphguard"] = ggm
        result["ladder"] = {
            "sizes": ladder,
            "capture_cold_s": cold.total_s,
            "capture_s": report.total_s,
            "hooks_s": report.hooks_s,
            "pool_bytes": report.pool_bytes,
            "estimate_bytes": estimate,
            "estimate_error": (estimate - report.pool_bytes) / max(report.pool_bytes, 1),
            "report": report.to_dict(),
        }
        # dispatch overhead on this model: host time of one call vs bare replay of same graph
        b0 = batches[0]
        g0 = runner.graph(runner.padded_size(b0) or b0)
        result["dispatch"] = {
            "batch": b0,
            "bare_replay_host_us": idle_host_us(g0.replay),
            "runner_host_us": idle_host_us(lambda: runner(*fixed[b0])),
            "runner_zero_copy_host_us": idle_host_us(lambda: runner.replay(b0)),
            "input_copy_host_us": idle_host_us(
                lambda: torch._foreach_copy_(runner.static_inputs(b0), list(fixed[b0]))
            ),
            "eager_small_launch_host_us": idle_host_us(lambda: fixed[b0][0].add_(0)),
        }
        result["dispatch"]["overhead_us"] = (
            result["dispatch"]["runner_host_us"] - result["dispatch"]["bare_replay_host_us"]
        )
        runner.release()
        model.workspace.unlock(reason="benchmark: next configuration")
        gc.collect()
        torch.cuda.empty_cache()

        # largest size alone (pool baseline)
        alone = gg.GraphRunner(
            model.decode_step,
            fixed[batches[0]],
            sizes=[cfg.max_batch],
            fill_values=model.pad_fill_values(),
            progress=False,
            name="alone",
        )
        result["largest_alone_pool_bytes"] = alone.capture().pool_bytes
        alone.release()
        gc.collect()
        torch.cuda.empty_cache()

        # hand-rolled ladder (raw torch.cuda.graph), also the raw-graph floor per B
        hr_s, hr_pool, graphs = handrolled_ladder(model, ladder)
        result["handrolled_ladder"] = {"capture_s": hr_s, "pool_bytes": hr_pool}
        raw = {}
        for b in batches:
            g, static, out = graphs[b]
            for s, x in zip(static, fixed[b]):
                s.copy_(x)
            raw[b] = {
                "ms": cuda_ms(g.replay, args.reps),
                "ms_isolated": isolated_ms(g.replay, args.reps),
            }
            g.replay()
            raw[b]["max_abs_diff_vs_eager"] = check(b, out)
        result["methods"]["raw_graph"] = raw
        del graphs
        gc.collect()
        torch.cuda.empty_cache()

        # torch.compile(mode="reduce-overhead")
        if not args.no_compile:
            comp: dict[Any, Any] = {}
            try:
                torch._dynamo.reset()
                torch._dynamo.config.cache_size_limit = 64
                fn = torch.compile(model.decode_step, mode="reduce-overhead", dynamic=False)
                start = time.perf_counter()
                for b in batches:
                    if time.perf_counter() - start > args.compile_budget_s:
                        comp[b] = {
                            "skipped": f"compile time budget {args.compile_budget_s} s spent"
                        }
                        continue
                    t0 = time.perf_counter()
                    for _ in range(3):  # compile, cudagraph record, replay
                        fn(*fixed[b])
                    torch.cuda.synchronize()
                    comp[b] = {
                        "first_calls_s": time.perf_counter() - t0,
                        "ms": cuda_ms(lambda b=b: fn(*fixed[b]), args.reps),
                        "max_abs_diff_vs_eager": check(b, fn(*fixed[b]).clone()),
                    }
                counters = torch._dynamo.utils.counters
                comp["dynamo"] = {
                    "unique_graphs": int(counters["stats"]["unique_graphs"]),
                    "graph_breaks": dict(counters["graph_break"]),
                    "recompiles_note": "dynamic=False: one compile per batch size is expected",
                }
            except Exception as exc:  # record why, keep the rest of the benchmark
                comp["error"] = f"{type(exc).__name__}: {exc}"[:2000]
                comp["traceback"] = traceback.format_exc()[-4000:]
            result["methods"]["torch_compile"] = comp

    # bandwidth floor
    bw = copy_bandwidth()
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    kv_row = 2 * cfg.num_layers * cfg.max_context * cfg.num_kv_heads * cfg.head_dim * 2
    result["bandwidth"] = {"copy_bytes_per_s": bw, "weight_bytes": weight_bytes}
    result["floor_ms"] = {b: (weight_bytes + b * kv_row) / bw * 1e3 for b in batches}

    e, r, m = (result["methods"][k] for k in ("eager", "raw_graph", "graphguard"))
    result["summary"] = {
        "gpu": gpu,
        "date": result["date"],
        "torch": torch.__version__,
        "graph_vs_raw_max_ratio": max(m[b]["ms"] / r[b]["ms"] for b in batches),
        "graph_vs_raw_max_ratio_isolated": max(
            m[b]["ms_isolated"] / r[b]["ms_isolated"] for b in batches
        ),
        "speedup_vs_eager_b1": e[batches[0]]["ms"] / m[batches[0]]["ms"],
        "dispatch_overhead_us": result["dispatch"]["overhead_us"],
        "ladder_sizes": len(ladder),
        "ladder_capture_s": result["ladder"]["capture_cold_s"],
        "ladder_capture_warm_s": result["ladder"]["capture_s"],
        "handrolled_ladder_capture_s": hr_s,
        "ladder_vs_handrolled_ratio": result["ladder"]["capture_s"] / hr_s,
        "pool_ratio_ladder_vs_largest": result["ladder"]["pool_bytes"]
        / max(result["largest_alone_pool_bytes"], 1),
        "pool_ratio_handrolled_vs_largest": hr_pool / max(result["largest_alone_pool_bytes"], 1),
        "estimate_error": result["ladder"]["estimate_error"],
    }
    args.out.mkdir(parents=True, exist_ok=True)
    tag = f"decode_{gpu.replace(' ', '-')}_{result['date']}"
    path = args.out / f"{tag}.json"
    path.write_text(json.dumps(result, indent=2, default=str) + "\n")
    try:
        plot(result, args.out / f"{tag}.png")
    except ImportError:
        print("matplotlib missing: no plot")
    print(
        f"{'B':>5} {'eager':>8} {'raw':>8} {'graphguard':>10} {'compile':>8} {'floor':>7}"
        "  (ms/step)"
    )
    comp_m = result["methods"].get("torch_compile", {})
    for b in batches:
        c = (
            comp_m.get(b, {}).get("ms", float("nan"))
            if isinstance(comp_m.get(b), dict)
            else float("nan")
        )
        print(
            f"{b:>5} {e[b]['ms']:>8.3f} {r[b]['ms']:>8.3f} {m[b]['ms']:>10.3f} {c:>8.3f} "
            f"{result['floor_ms'][b]:>7.3f}"
        )
    print(json.dumps(result["summary"], indent=2))
    print(f"wrote {path}")
    return result


def plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    batches = result["batches"]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    names = {
        "eager": "eager",
        "raw_graph": "hand-rolled torch.cuda.graph",
        "graphguard": "graphguard",
        "torch_compile": 'torch.compile("reduce-overhead")',
    }
    for key, label in names.items():
        data = result["methods"].get(key, {})
        pts = [
            (b, data[b]["ms"]) for b in batches if isinstance(data.get(b), dict) and "ms" in data[b]
        ]
        if pts:
            ax.plot(*zip(*pts), marker="o", label=label)
    ax.plot(batches, [result["floor_ms"][b] for b in batches], "k--", label="bandwidth floor")
    ax.set_xscale("log", base=2)
    ax.set_xlabel(f"batch size (decode, context {result['context']})")
    ax.set_ylabel("ms / step")
    ax.set_title(f"{result['preset']} bf16 on {result['gpu']}, torch {result['torch']}")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
