"""Decode-step benchmark of the reference model against a plain Llama step, one run, one GPU.

Per batch size B (default 1, 16, 64, 256; llama-1b shapes, bf16, context 1024), median
ms/step from CUDA events after warm-up (``--reps`` back-to-back calls, 5 blocks):

* ``eager``: ``model.decode_step``;
* ``raw_graph``: a hand-rolled ``torch.cuda.graph`` of the reference model per size;
* ``graphguard``: ``GraphRunner`` over the default ladder (35 sizes up to 256);
* ``graphguard_compiled``: ``GraphRunner(..., compile=True)`` (or, on a graphguard without
  that option, ``GraphRunner(CompiledStep(...))``): one Inductor compile for the whole
  ladder; its compile + capture seconds are recorded;
* ``torch_compile``: ``torch.compile(mode="reduce-overhead", dynamic=False)``, one compile
  per B, each B's compile seconds recorded;
* ``plain_graph`` / ``plain_graph_planless``: :class:`PlainLlamaStep` -- a Llama step
  written the straightforward way on the same weights, its own contiguous per-slot KV
  cache, SDPA over the cache rows of the batch -- hand-rolled graph per B, with SDPA's
  default backend choice (cuDNN on the H200) and with the plan-free kernels only
  (memory-efficient/flash/math, the reference model's ``decode_sdpa="planless"``);
* ``floor_ms``: (weight bytes + B * KV bytes of the whole context) / measured copy bandwidth.

Every method's logits are checked against eager on a freshly zeroed cache (bitwise for
graphs of the reference model's eager kernels). Plus: capture time and pool of the ladder
(graphguard vs a hand-rolled capture of the same ladder), the pool of the largest size
alone, and the runner's host dispatch cost over a bare ``CUDAGraph.replay()``.

``--skip-compile`` drops both compiled columns (they take most of the ~4 minutes).
``--device cpu --preset tiny`` is a smoke run of the plumbing without a GPU: graphs are
emulated (graphguard's RecordingBackend; the hand-rolled "graphs" re-run eagerly), the
compiled columns are skipped and times are host wall clock. Writes
``<out>/decode_<gpu>_<date>.json`` (top-level ``summary``) and a PNG plot.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import statistics
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

import torch
import torch._dynamo
import torch.nn.functional as F
from torch import Tensor

import graphguard as gg
from graphguard_ref.llama import LlamaConfig, LlamaDecodeModel
from graphguard_ref.llama.model import LlamaDecoderLayer
from graphguard_ref.llama.ops import apply_rope, sdpa_backends
from graphguard_ref.timing import cuda_ms, idle_host_us, isolated_ms

Inputs = tuple[Tensor, Tensor, Tensor]
Step = Callable[[Tensor, Tensor, Tensor], Tensor]


# --------------------------------------------------------------------------- plain step


class PlainLlamaStep:
    """A Llama-3.2-1B-shaped decode step written the straightforward way: the baseline.

    On the reference model's weights (shared, not copied) but with its own contiguous
    per-slot KV cache ``[slots, kv_heads, ctx, hd]`` per layer: write the new key/value
    at ``(slot, :, position)`` with ``index_put_``, then SDPA over ``cache[:B]`` (row b is
    slot b) with a boolean mask from the positions, built once per step. Grouped-query
    attention as the usual decode layout (the query heads of one KV head on the query
    axis, no repeat of K/V). No workspace, no side stream, no custom op, no fusion beyond
    the q/k/v and gate/up GEMMs the checkpoint layout gives. ``sdpa="planless"`` restricts
    SDPA to the plan-free kernels (never cuDNN); ``"default"`` lets PyTorch pick.
    """

    def __init__(self, model: LlamaDecodeModel, sdpa: str = "default") -> None:
        cfg = model.config
        self.cfg = cfg
        self.layers = [m for m in model.layers if isinstance(m, LlamaDecoderLayer)]
        self.embed, self.norm, self.head = model.embed_tokens, model.norm, model.lm_head
        self.cos, self.sin = model.rope_cos, model.rope_sin
        shape = (cfg.max_batch, cfg.num_kv_heads, cfg.max_context, cfg.head_dim)
        dev, dt = model.device, model.dtype
        self.k = [torch.zeros(shape, device=dev, dtype=dt) for _ in self.layers]
        self.v = [torch.zeros(shape, device=dev, dtype=dt) for _ in self.layers]
        self.ctx = torch.arange(cfg.max_context, device=dev)
        self.sdpa = sdpa

    def reset(self) -> None:
        for cache in (*self.k, *self.v):
            cache.zero_()

    def step(self, tokens: Tensor, positions: Tensor, slots: Tensor) -> Tensor:
        cfg = self.cfg
        b, d, eps = tokens.shape[0], cfg.hidden_size, cfg.rms_norm_eps
        heads, kvh, hd = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        h = F.embedding(tokens, self.embed)
        cos, sin = self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)
        keep = (self.ctx <= positions.view(-1, 1)).view(b, 1, 1, -1)
        for n, layer in enumerate(self.layers):
            x = F.rms_norm(h, (d,), layer.input_norm, eps)
            q, k, v = F.linear(x, layer.qkv_weight).split(
                [cfg.q_size, cfg.kv_size, cfg.kv_size], -1
            )
            q = apply_rope(q.reshape(b, heads, hd), cos, sin)
            self.k[n][slots, :, positions] = apply_rope(k.reshape(b, kvh, hd), cos, sin)
            self.v[n][slots, :, positions] = v.reshape(b, kvh, hd)
            with sdpa_backends() if self.sdpa == "planless" else contextlib.nullcontext():
                o = F.scaled_dot_product_attention(
                    q.view(b, kvh, heads // kvh, hd), self.k[n][:b], self.v[n][:b], attn_mask=keep
                )
            h = h + F.linear(o.reshape(b, cfg.q_size), layer.o_weight)
            x = F.rms_norm(h, (d,), layer.post_norm, eps)
            gate, up = F.linear(x, layer.gate_up_weight).chunk(2, -1)
            h = h + F.linear(F.silu(gate) * up, layer.down_weight)
        return F.linear(F.rms_norm(h, (d,), self.norm, eps), self.head)


# --------------------------------------------------------------------------- helpers


class Replayable(Protocol):
    def replay(self) -> None: ...


class EagerReplay:
    """CPU stand-in for a captured graph: re-runs the step on the static inputs in place."""

    def __init__(self, fn: Step, static: Inputs, out: Tensor) -> None:
        self.fn, self.static, self.out = fn, static, out

    def replay(self) -> None:
        self.out.copy_(self.fn(*self.static))


def sync(cuda: bool) -> None:
    if cuda:
        torch.cuda.synchronize()


def reserved(cuda: bool) -> int:
    return torch.cuda.memory_reserved() if cuda else 0


def handrolled_ladder(
    fn: Step, static_inputs: Callable[[int], Inputs], sizes: list[int], dev: torch.device
) -> tuple[float, int, dict[int, tuple[Replayable, Inputs, Tensor]]]:
    """What engines write by hand: per size (largest first) 1 warmup + sync, capture into
    one shared pool, each graph keeping its own output and static inputs."""
    cuda = dev.type == "cuda"
    graphs: dict[int, tuple[Replayable, Inputs, Tensor]] = {}
    pool = torch.cuda.graph_pool_handle() if cuda else None
    stream = torch.cuda.Stream() if cuda else None
    sync(cuda)
    before = reserved(cuda)
    t0 = time.perf_counter()
    for n in sorted(sizes, reverse=True):
        static = static_inputs(n)
        if not cuda:
            out = fn(*static)
            graphs[n] = (EagerReplay(fn, static, out), static, out)
            continue
        with torch.cuda.stream(stream):  # type: ignore[arg-type]
            fn(*static)
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, pool=pool, stream=stream):
            out = fn(*static)
        graphs[n] = (g, static, out)
    sync(cuda)
    return time.perf_counter() - t0, reserved(cuda) - before, graphs


def copy_bandwidth(dev: torch.device) -> float:
    """Device copy bandwidth in bytes/s (bytes read + written); 2 GiB buffers on a GPU."""
    cuda = dev.type == "cuda"
    n = 1 << (30 if cuda else 26)
    src = torch.empty(n, dtype=torch.uint8, device=dev).random_()
    dst = torch.empty_like(src)
    ms = cuda_ms(lambda: dst.copy_(src), 20 if cuda else 3, cuda=cuda)
    return 2 * n / (ms / 1e3)


def build_compiled_runner(
    model: LlamaDecodeModel, example: Inputs, sizes: list[int], **kw: Any
) -> tuple[Any, str]:
    """``GraphRunner(..., compile=True)``, else ``GraphRunner(CompiledStep(...))``."""
    try:
        return gg.GraphRunner(model.decode_step, example, sizes=sizes, compile=True, **kw), (
            "GraphRunner(compile=True)"
        )
    except (TypeError, ValueError) as exc:  # a graphguard without the option
        first = f"{type(exc).__name__}: {exc}"
    try:
        from graphguard.compiled import CompiledStep
    except ImportError:
        raise RuntimeError(f"no compile option in this graphguard ({first})") from None
    step = CompiledStep(model.decode_step, name="llama.decode_step")
    return gg.GraphRunner(step, example, sizes=sizes, **kw), "GraphRunner(CompiledStep(...))"


def compiled_ladder(max_batch: int) -> list[int]:
    """The compiled runner's ladder: without size 1 where graphguard says so (one compile)."""
    try:
        from graphguard.compiled import compiled_capture_sizes
    except ImportError:
        return gg.capture_sizes(max_batch)
    return compiled_capture_sizes(max_batch)


# --------------------------------------------------------------------------- main


def main() -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--preset", default="llama-1b")
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--batches", default="1,16,64,256")
    ap.add_argument("--max-batch", type=int, default=256)
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--compile-budget-s", type=float, default=150.0)
    ap.add_argument("--skip-compile", "--no-compile", action="store_true", dest="skip_compile")
    ap.add_argument("--out", type=Path, default=Path("bench/results"))
    args = ap.parse_args()
    started = time.perf_counter()
    dev = torch.device(args.device)
    cuda = dev.type == "cuda"
    if cuda and not torch.cuda.is_available():
        ap.error("no CUDA device: use --device cpu --preset tiny for a smoke run")
    batches = [int(b) for b in args.batches.split(",")]
    cfg = LlamaConfig.preset(args.preset, max_batch=args.max_batch, max_context=args.context)
    if max(batches) > cfg.max_batch:
        ap.error(f"--batches up to {max(batches)} need --max-batch >= {max(batches)}")
    skip_compile = args.skip_compile or not cuda
    reps = args.reps if cuda else 3
    torch.backends.cuda.matmul.allow_tf32 = True
    dtype = torch.bfloat16 if cuda else torch.float32
    gpu = torch.cuda.get_device_name() if cuda else "cpu"
    model = LlamaDecodeModel.random(cfg, device=dev, dtype=dtype, seed=0)
    result: dict[str, Any] = {
        "gpu": gpu,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "date": time.strftime("%Y-%m-%d"),
        "preset": args.preset,
        "dtype": str(dtype).removeprefix("torch."),
        "max_batch": cfg.max_batch,
        "context": cfg.max_context,
        "params": cfg.num_params,
        "batches": batches,
        "kv_layout": "rows are slots: [slots + 1, kv_heads, ctx, hd], attention over cache[:B]",
        "decode_sdpa": cfg.decode_sdpa,
        "methods": {},
        "seconds": {},
    }
    methods: dict[str, dict[Any, Any]] = result["methods"]
    gen = torch.Generator().manual_seed(0)
    fixed = {b: model.example_inputs(b, generator=gen) for b in batches}

    def ms(fn: Callable[[], Any]) -> dict[str, float]:
        out = {"ms": cuda_ms(fn, reps, cuda=cuda)}
        if cuda:
            out["ms_isolated"] = isolated_ms(fn, reps)
        return out

    def check(
        b: int, run: Callable[[], Tensor], *, reset: Callable[[], None] | None = None
    ) -> dict[str, Any]:
        """``run()`` vs eager, each on a freshly zeroed cache (same state, same inputs)."""
        model.reset_cache()
        want = model.decode_step(*fixed[b]).float()
        (reset or model.reset_cache)()
        got = run().float()
        return {
            "max_abs_diff_vs_eager": float((got - want).abs().max()),
            "bitwise_equal_eager": bool(torch.equal(got, want)),
        }

    def phase_done(name: str, t0: float) -> None:
        result["seconds"][name] = time.perf_counter() - t0
        print(f"[{time.perf_counter() - started:7.1f} s] {name} done", flush=True)

    ladder = gg.capture_sizes(cfg.max_batch)
    backend = None if cuda else gg.RecordingBackend
    with torch.inference_mode():
        model.warm_kernels(ladder)
        sync(cuda)

        # eager
        t0 = time.perf_counter()
        methods["eager"] = {b: ms(lambda b=b: model.decode_step(*fixed[b])) for b in batches}
        phase_done("eager", t0)

        # graphguard, default ladder
        t0 = time.perf_counter()
        runner = gg.GraphRunner(
            model.decode_step,
            fixed[batches[0]],
            sizes=ladder,
            fill_values=model.pad_fill_values(),
            before_capture=[model.warm_kernels],
            workspaces=[model.workspace],
            progress=False,
            name="bench",
            backend=backend() if backend else None,
        )
        estimate = runner.estimate_graph_memory() if cuda else 0
        cold = runner.capture()  # first capture in the process: per-shape first-run costs

        def padded(n: int) -> Inputs:
            tok, pos, slot = model.pad_fill_values()
            return (
                torch.full((n,), tok, dtype=torch.long, device=dev),
                torch.full((n,), pos, dtype=torch.long, device=dev),
                torch.full((n,), slot, dtype=torch.long, device=dev),
            )

        # The same ladder again with every shape's kernels chosen, paired with a
        # hand-rolled capture of it, three rounds. Each capture starts from an emptied
        # allocator cache (recapture's release() empties it; the hand-rolled one is
        # given the same start), because whether the warmups must cudaMalloc their
        # activations again moves a ladder by 0.2-0.4 s on the H200 (probes/probe_capture2.py).
        paired: dict[str, list[float]] = {"graphguard": [], "handrolled": []}
        for _ in range(3 if cuda else 1):
            gc.collect()
            if cuda:
                torch.cuda.empty_cache()
            hr_s, _, hr_graphs = handrolled_ladder(model.decode_step, padded, ladder, dev)
            paired["handrolled"].append(hr_s)
            del hr_graphs
            gc.collect()
            report = runner.recapture(reason="benchmark: warm-kernel capture")
            paired["graphguard"].append(report.total_s)
        methods["graphguard"] = {
            b: {**ms(lambda b=b: runner(*fixed[b])), **check(b, lambda b=b: runner(*fixed[b]))}
            for b in batches
        }
        result["ladder"] = {
            "sizes": ladder,
            "capture_cold_s": cold.total_s,
            "capture_s": statistics.median(paired["graphguard"]),
            "paired_capture_s": paired,
            "handrolled_capture_s": statistics.median(paired["handrolled"]),
            "hooks_s": report.hooks_s,
            "pool_bytes": report.pool_bytes,
            "estimate_bytes": estimate,
            # The estimate is the pool plus the driver's share (graphguard.ledger): against
            # both, as bench_pool.py compares it.
            "graph_bytes": report.pool_bytes + report.driver_bytes,
            "estimate_error": (estimate - report.pool_bytes - report.driver_bytes)
            / max(report.pool_bytes + report.driver_bytes, 1),
            "report": report.to_dict(),
        }
        if cuda:  # dispatch: host time of one call vs a bare replay of the same graph
            b0 = batches[0]
            g0 = runner.graph(runner.padded_size(b0) or b0)
            d = {
                "batch": b0,
                "bare_replay_host_us": idle_host_us(g0.replay),
                "runner_host_us": idle_host_us(lambda: runner(*fixed[b0])),
                "runner_zero_copy_host_us": idle_host_us(lambda: runner.replay(b0)),
                "input_copy_host_us": idle_host_us(
                    lambda: torch._foreach_copy_(runner.static_inputs(b0), list(fixed[b0]))
                ),
                "eager_small_launch_host_us": idle_host_us(lambda: fixed[b0][0].add_(0)),
            }
            d["overhead_us"] = d["runner_host_us"] - d["bare_replay_host_us"]
            result["dispatch"] = d
        runner.release()
        model.workspace.unlock(reason="benchmark: next configuration")
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()
        phase_done("graphguard", t0)

        # largest size alone (pool baseline)
        t0 = time.perf_counter()
        alone = gg.GraphRunner(
            model.decode_step,
            fixed[batches[0]],
            sizes=[cfg.max_batch],
            fill_values=model.pad_fill_values(),
            progress=False,
            name="alone",
            backend=backend() if backend else None,
        )
        result["largest_alone_pool_bytes"] = alone.capture().pool_bytes
        alone.release()
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()
        phase_done("largest_alone", t0)

        # hand-rolled ladder of the reference model (raw torch.cuda.graph), the raw floor
        t0 = time.perf_counter()
        _, hr_pool, graphs = handrolled_ladder(model.decode_step, padded, ladder, dev)
        hr_s = result["ladder"]["handrolled_capture_s"]
        result["handrolled_ladder"] = {"capture_s": hr_s, "pool_bytes": hr_pool}
        raw: dict[Any, Any] = {}
        for b in batches:
            g, static, out = graphs[b]
            for s, x in zip(static, fixed[b]):
                s.copy_(x)

            def replay(g: Replayable = g, out: Tensor = out) -> Tensor:
                g.replay()
                return out

            raw[b] = {**ms(g.replay), **check(b, replay)}
        methods["raw_graph"] = raw
        del graphs, g, static, out
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()
        phase_done("raw_graph", t0)

        # plain Llama step, hand-rolled graph at each B (default SDPA, then the model's)
        for key, sdpa in (("plain_graph", "default"), ("plain_graph_planless", "planless")):
            t0 = time.perf_counter()
            plain = PlainLlamaStep(model, sdpa=sdpa)
            # Its cache has no scratch slot: capture at each B with rows = slots 0..B-1.
            _, _, pgraphs = handrolled_ladder(
                plain.step, lambda n: tuple(x.clone() for x in fixed[n]), batches, dev
            )
            col: dict[Any, Any] = {}
            for b in batches:
                g, static, out = pgraphs[b]
                for s, x in zip(static, fixed[b]):
                    s.copy_(x)

                def preplay(g: Replayable = g, out: Tensor = out) -> Tensor:
                    g.replay()
                    return out

                col[b] = {**ms(g.replay), **check(b, preplay, reset=plain.reset)}
            methods[key] = col
            del plain, pgraphs, g, static, out
            gc.collect()
            if cuda:
                torch.cuda.empty_cache()
            phase_done(key, t0)

        if not skip_compile:
            run_compiled(model, cfg, batches, fixed, ms, check, methods, args, phase_done)

    # bandwidth floor
    bw = copy_bandwidth(dev)
    elem = torch.tensor([], dtype=dtype).element_size()
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    kv_row = 2 * cfg.num_layers * cfg.max_context * cfg.num_kv_heads * cfg.head_dim * elem
    result["bandwidth"] = {"copy_bytes_per_s": bw, "weight_bytes": weight_bytes}
    result["floor_ms"] = {b: (weight_bytes + b * kv_row) / bw * 1e3 for b in batches}
    result["summary"] = summarize(result, ladder, hr_s, hr_pool, gpu)
    result["seconds"]["total"] = time.perf_counter() - started

    args.out.mkdir(parents=True, exist_ok=True)
    tag = f"decode_{gpu.replace(' ', '-')}_{result['date']}"
    path = args.out / f"{tag}.json"
    path.write_text(json.dumps(result, indent=2, default=str) + "\n")
    try:
        plot(result, args.out / f"{tag}.png")
    except ImportError:
        print("matplotlib missing: no plot")
    print(json.dumps(result["summary"], indent=2))
    print_table(result)  # last, so a `| tail` shows it
    print(f"wrote {path} ({result['seconds']['total']:.0f} s)")
    return result


def run_compiled(
    model: LlamaDecodeModel,
    cfg: LlamaConfig,
    batches: list[int],
    fixed: dict[int, Inputs],
    ms: Callable[[Callable[[], Any]], dict[str, float]],
    check: Callable[..., dict[str, Any]],
    methods: dict[str, dict[Any, Any]],
    args: argparse.Namespace,
    phase_done: Callable[[str, float], None],
) -> None:
    """graphguard over the compiled step (one compile, whole ladder), then reduce-overhead."""
    t0 = time.perf_counter()
    comp: dict[Any, Any] = {}
    try:
        torch._dynamo.reset()
        sizes = compiled_ladder(cfg.max_batch)
        start = time.perf_counter()
        runner, how = build_compiled_runner(
            model,
            fixed[batches[0]],
            sizes,
            fill_values=model.pad_fill_values(),
            before_capture=[model.warm_kernels],
            workspaces=[model.workspace],
            progress=False,
            name="bench.compiled",
        )
        report = runner.capture()
        comp["how"] = how
        comp["captured_sizes"] = list(runner.captured_sizes)
        comp["sizes"] = sizes
        comp["compile_and_capture_s"] = time.perf_counter() - start
        comp["capture_report_s"] = report.total_s
        comp["compiles"] = report.compiles
        comp["compile_s"] = report.compile_s
        for b in batches:
            comp[b] = {
                **ms(lambda b=b: runner(*fixed[b])),
                **check(b, lambda b=b: runner(*fixed[b])),
            }
        runner.release()
    except Exception as exc:  # record why, keep the rest of the benchmark
        comp["error"] = f"{type(exc).__name__}: {exc}"[:2000]
        comp["traceback"] = traceback.format_exc()[-4000:]
    methods["graphguard_compiled"] = comp
    model.workspace.unlock(reason="benchmark: next configuration")
    gc.collect()
    torch.cuda.empty_cache()
    phase_done("graphguard_compiled", t0)

    t0 = time.perf_counter()
    ro: dict[Any, Any] = {}
    try:
        torch._dynamo.reset()
        torch._dynamo.config.cache_size_limit = 64
        fn = torch.compile(model.decode_step, mode="reduce-overhead", dynamic=False)
        start = time.perf_counter()
        for b in batches:
            if time.perf_counter() - start > args.compile_budget_s:
                ro[b] = {"skipped": f"compile time budget {args.compile_budget_s} s spent"}
                continue
            t1 = time.perf_counter()
            for _ in range(3):  # compile, cudagraph record, replay
                fn(*fixed[b])
            torch.cuda.synchronize()
            ro[b] = {
                "compile_s": time.perf_counter() - t1,
                **ms(lambda b=b: fn(*fixed[b])),
                **check(b, lambda b=b: fn(*fixed[b]).clone()),
            }
        counters = torch._dynamo.utils.counters
        ro["dynamo"] = {
            "unique_graphs": int(counters["stats"]["unique_graphs"]),
            "graph_breaks": dict(counters["graph_break"]),
            "recompiles_note": "dynamic=False: one compile per batch size is expected",
        }
    except Exception as exc:
        ro["error"] = f"{type(exc).__name__}: {exc}"[:2000]
        ro["traceback"] = traceback.format_exc()[-4000:]
    methods["torch_compile"] = ro
    torch._dynamo.reset()
    gc.collect()
    torch.cuda.empty_cache()
    phase_done("torch_compile", t0)


def _ms(methods: dict[str, Any], key: str, b: int) -> float | None:
    entry = methods.get(key, {}).get(b)
    return float(entry["ms"]) if isinstance(entry, dict) and "ms" in entry else None


def summarize(
    result: dict[str, Any], ladder: list[int], hr_s: float, hr_pool: int, gpu: str
) -> dict[str, Any]:
    methods, batches = result["methods"], result["batches"]
    floor = result["floor_ms"]
    m, r = methods["graphguard"], methods["raw_graph"]

    def vs(plain: str) -> dict[str, dict[int, float]]:
        return {
            key: {b: _ms(methods, key, b) / p for b in batches if (p := _ms(methods, plain, b))}
            for key in ("raw_graph", "graphguard", "graphguard_compiled", "torch_compile")
            if all(_ms(methods, key, b) is not None for b in batches)
        }

    ratios = vs("plain_graph")
    ro = methods.get("torch_compile", {})
    ro_compile = [v["compile_s"] for v in ro.values() if isinstance(v, dict) and "compile_s" in v]
    comp = methods.get("graphguard_compiled", {})
    summary: dict[str, Any] = {
        "gpu": gpu,
        "date": result["date"],
        "torch": result["torch"],
        "ms_per_step": {
            key: {b: _ms(methods, key, b) for b in batches} for key in methods if key != "eager"
        }
        | {"eager": {b: _ms(methods, "eager", b) for b in batches}, "floor": floor},
        "vs_plain_step": ratios,
        "vs_plain_step_planless": vs("plain_graph_planless"),
        "ref_graph_vs_plain_max_ratio": max(ratios.get("raw_graph", {0: float("nan")}).values()),
        "b1_vs_floor": {
            key: v / floor[batches[0]]
            for key in methods
            if (v := _ms(methods, key, batches[0])) is not None
        },
        "graph_vs_raw_max_ratio": max(m[b]["ms"] / r[b]["ms"] for b in batches),
        "graph_bitwise_equal_eager": all(m[b]["bitwise_equal_eager"] for b in batches)
        and all(r[b]["bitwise_equal_eager"] for b in batches),
        "speedup_vs_eager_b1": methods["eager"][batches[0]]["ms"] / m[batches[0]]["ms"],
        "dispatch_overhead_us": result.get("dispatch", {}).get("overhead_us"),
        "ladder_sizes": len(ladder),
        "ladder_capture_s": result["ladder"]["capture_cold_s"],
        "ladder_capture_warm_s": result["ladder"]["capture_s"],
        "handrolled_ladder_capture_s": hr_s,
        "ladder_vs_handrolled_ratio": result["ladder"]["capture_s"] / max(hr_s, 1e-9),
        "pool_ratio_ladder_vs_largest": result["ladder"]["pool_bytes"]
        / max(result["largest_alone_pool_bytes"], 1),
        "pool_ratio_handrolled_vs_largest": hr_pool / max(result["largest_alone_pool_bytes"], 1),
        "estimate_error": result["ladder"]["estimate_error"],
        "compiled_ladder_compile_and_capture_s": comp.get("compile_and_capture_s"),
        "compiled_ladder_compiles": comp.get("compiles"),
        "reduce_overhead_compile_s_per_size": statistics.median(ro_compile) if ro_compile else None,
    }
    if ro_compile and comp.get("compile_and_capture_s") is not None:
        summary["compiled_ladder_vs_one_reduce_overhead_compile"] = comp[
            "compile_and_capture_s"
        ] / statistics.median(ro_compile)
    return summary


COLUMNS = {
    "eager": "eager",
    "raw_graph": "hand-rolled graph, reference model",
    "graphguard": "graphguard",
    "graphguard_compiled": "graphguard, compiled step",
    "torch_compile": 'torch.compile("reduce-overhead")',
    "plain_graph": "plain Llama step, hand-rolled graph",
    "plain_graph_planless": "plain step, plan-free SDPA kernels",
}


def print_table(result: dict[str, Any]) -> None:
    methods = result["methods"]
    keys = [k for k in COLUMNS if k in methods]
    short = {
        "raw_graph": "raw",
        "graphguard_compiled": "gg+comp",
        "torch_compile": "red-ovh",
        "plain_graph": "plain",
        "plain_graph_planless": "plain(nocudnn)",
    }
    print(
        f"{'B':>5} " + " ".join(f"{short.get(k, k):>10}" for k in keys) + f" {'floor':>8}  ms/step"
    )
    for b in result["batches"]:
        cells = []
        for k in keys:
            v = _ms(methods, k, b)
            cells.append(f"{v:>10.3f}" if v is not None else f"{'-':>10}")
        print(f"{b:>5} " + " ".join(cells) + f" {result['floor_ms'][b]:>8.3f}")


def plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    batches = result["batches"]
    fig, ax = plt.subplots(figsize=(7.5, 4.8))
    for key, label in COLUMNS.items():
        pts = [(b, v) for b in batches if (v := _ms(result["methods"], key, b)) is not None]
        if pts:
            style = "--" if key.startswith("plain") else "-"
            ax.plot(*zip(*pts), style, marker="o", label=label)
    ax.plot(batches, [result["floor_ms"][b] for b in batches], "k:", label="bandwidth floor")
    ax.set_xscale("log", base=2)
    ax.set_xlabel(f"batch size (decode, context {result['context']})")
    ax.set_ylabel("ms / step")
    ax.set_title(
        f"{result['preset']} {result['dtype']} on {result['gpu']}, torch {result['torch']}"
    )
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
