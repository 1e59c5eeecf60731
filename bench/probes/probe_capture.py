"""Where does a ladder capture spend its time beyond a hand-rolled capture of the same sizes?

Reference model at llama-1b shapes (bf16), the default 35-size ladder, kernels warm:
times the pieces the lifecycle adds (``gc.collect``, ``memory_reserved``, the entry
table), a hand-rolled ladder, and graphguard's ladder under ``cProfile`` (top functions
by own time and by cumulative time). Then the decode step with SDPA's cuDNN kernel
allowed, graphed, against today's kernels (ms per step, CUDA events, median).
Writes ``--out`` JSON; prints everything.
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import io
import json
import pstats
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/: its shared helpers

import graphguard as gg
from bench_decode import handrolled_ladder
from graphguard_ref.llama import LlamaConfig, LlamaDecodeModel
from graphguard_ref.llama import ops as llama_ops
from graphguard_ref.timing import isolated_ms


def _us(fn: Any, n: int = 200) -> float:
    fn()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - t0) / n * 1e6


def ladder_runner(model: LlamaDecodeModel, ladder: list[int]) -> gg.GraphRunner:
    """The runner both capture probes time: the reference decode step over ``ladder``."""
    return gg.GraphRunner(
        model.decode_step,
        model.example_inputs(1),
        sizes=ladder,
        fill_values=model.pad_fill_values(),
        before_capture=[model.warm_kernels],
        workspaces=[model.workspace],
        progress=False,
        name="probe",
    )


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, default=Path("probe_capture.json"))
    args = ap.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = True
    cfg = LlamaConfig.preset("llama-1b", max_batch=256, max_context=1024)
    model = LlamaDecodeModel.random(cfg, device=torch.device("cuda"), dtype=torch.bfloat16, seed=0)
    ladder = gg.capture_sizes(cfg.max_batch)
    out: dict[str, Any] = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__}
    with torch.inference_mode():
        model.warm_kernels(ladder)
        for s in ladder:
            model.decode_step(*model.example_inputs(s))
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        gc.collect()
        out["gc_collect_ms"] = (time.perf_counter() - t0) * 1e3
        out["gc_objects"] = len(gc.get_objects())
        out["memory_reserved_us"] = _us(torch.cuda.memory_reserved)
        out["synchronize_us"] = _us(torch.cuda.synchronize)

        runner = ladder_runner(model, ladder)
        runner.capture()
        runs = []
        for _ in range(3):
            runner.release()
            model.workspace.unlock(reason="probe")
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            rep = runner.capture()
            runs.append(time.perf_counter() - t0)
        out["graphguard_s"] = runs
        out["report_total_s"] = rep.total_s
        out["report_sizes_s"] = sum(s.warmup_s + s.capture_s for s in rep.sizes)
        out["report_warmup_s"] = sum(s.warmup_s for s in rep.sizes)
        out["report_capture_s"] = sum(s.capture_s for s in rep.sizes)
        out["report_hooks_s"] = rep.hooks_s
        t0 = time.perf_counter()
        runner._rebuild()
        out["build_entries_ms"] = (time.perf_counter() - t0) * 1e3

        def padded(n: int) -> Any:
            return model.example_inputs(n)

        hr = []
        for _ in range(3):
            s, _pool, graphs = handrolled_ladder(
                model.decode_step, padded, ladder, torch.device("cuda")
            )
            hr.append(s)
            del graphs
        out["handrolled_s"] = hr
        out["ratio_median"] = statistics.median(runs) / statistics.median(hr)

        runner.release()
        model.workspace.unlock(reason="probe")
        prof = cProfile.Profile()
        prof.enable()
        runner.capture()
        prof.disable()
        for key in ("tottime", "cumulative"):
            buf = io.StringIO()
            pstats.Stats(prof, stream=buf).sort_stats(key).print_stats(45)
            out[f"profile_{key}"] = buf.getvalue()
            print(buf.getvalue())
        runner.release()
        model.workspace.unlock(reason="probe")

        # cuDNN attention allowed in the decode op, graphed (hand-rolled), vs today's.
        from torch.nn.attention import SDPBackend, sdpa_kernel

        kernels: dict[str, Any] = {}
        for name, backends in (
            ("model", [SDPBackend.EFFICIENT_ATTENTION, SDPBackend.FLASH_ATTENTION]),
            (
                "cudnn_first",
                [SDPBackend.CUDNN_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH],
            ),
        ):
            llama_ops._SDPA_CHOICE = (sdpa_kernel, backends, backends)
            row = {}
            for b in (1, 16, 64, 256):
                inp = model.example_inputs(b)
                first = time.perf_counter()
                model.decode_step(*inp)
                torch.cuda.synchronize()
                first_ms = (time.perf_counter() - first) * 1e3
                s = torch.cuda.Stream()
                with torch.cuda.stream(s):
                    model.decode_step(*inp)
                torch.cuda.synchronize()
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g, stream=s):
                    o = model.decode_step(*inp)
                eager = model.decode_step(*inp)
                g.replay()
                torch.cuda.synchronize()
                row[b] = {
                    "first_call_ms": first_ms,
                    "graph_ms": isolated_ms(g.replay, 50, warmup=5),
                    "equal_eager": bool(torch.equal(o, eager)),
                }
                del g, o
            kernels[name] = row
            print(name, row, flush=True)
        out["sdpa"] = kernels
    summary = {k: v for k, v in out.items() if not k.startswith("profile")}
    print(json.dumps(summary, indent=1))
    args.out.write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
