"""``graphguard-demo``: the decode loop (one GraphRunner over ``decode_step``), and the
dispatch to the engine loop (:mod:`graphguard_ref.demo.engine`).

Contract: sequences join and finish (the batch goes 8 -> 1 -> 37 -> 256 by default);
every step pads to the next captured size; each graph step is checked against an eager
step on the same state, then graphs and eager are timed with CUDA events. The process's
first forward (CUDA, cuBLAS, cuDNN start-up) is timed apart from capture. Without CUDA the
CPU demo runs instead (:mod:`graphguard_ref.demo.cpu`: the lifecycle under the
RecordingBackend, padded replays against eager, the locked-arena error).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

import graphguard as gg
from graphguard.config import Mode
from graphguard_ref.demo.common import (
    DEFAULT_PHASES,
    DemoResult,
    Sequences,
    batch_schedule,
    check_decode_loop,
    sanitizer_line,
    time_decode_loop,
    write_json,
)
from graphguard_ref.demo.cpu import run_cpu_demo
from graphguard_ref.demo.engine import run_engine_demo
from graphguard_ref.llama import LlamaConfig, LlamaDecodeModel


def run_demo(
    *,
    preset: str | None = None,
    max_batch: int = 256,
    max_context: int = 1024,
    sizes: Sequence[int] | None = None,
    steps: int = 400,
    phases: Sequence[int] = DEFAULT_PHASES,
    mode: str = "full",
    sanitize: bool = False,
    json_path: Path | None = None,
    out: Callable[[str], None] = print,
    spec_tokens: int = 0,
    engine: bool = False,
    prompt_len: int = 16,
    chunk: int = 32,
    max_tokens: int | None = None,
    full_mixed: bool = False,
) -> DemoResult:
    """Build the model, capture, run the loop, check against eager, print the table.

    The engine loop (:func:`run_engine_demo`) runs when ``mode`` is piecewise or
    full_and_piecewise, ``spec_tokens > 0`` or ``engine`` is set; otherwise the decode loop.
    """
    if uses_engine_loop(mode, spec_tokens, engine):
        return run_engine_demo(
            preset=preset,
            max_batch=max_batch,
            max_context=max_context,
            sizes=sizes,
            steps=steps,
            phases=phases,
            mode=mode,
            spec_tokens=spec_tokens,
            prompt_len=prompt_len,
            chunk=chunk,
            max_tokens=max_tokens,
            full_mixed=full_mixed,
            json_path=json_path,
            out=out,
        )
    if not torch.cuda.is_available():
        return run_cpu_demo(
            max_batch=max_batch,
            max_context=max_context,
            sizes=sizes,
            steps=steps,
            phases=phases,
            sanitize=sanitize,
            json_path=json_path,
            out=out,
            mode=mode,
        )
    preset = preset or "llama-1b"
    device = torch.device("cuda")
    dtype = torch.bfloat16
    cfg = LlamaConfig.preset(preset, max_batch=max_batch, max_context=max_context)
    t0 = time.perf_counter()
    model = LlamaDecodeModel.random(cfg, device=device, dtype=dtype, seed=0)
    out(
        f"model: {preset}, {cfg.num_params / 1e9:.2f} B params, {dtype}, max_batch "
        f"{cfg.max_batch}, context {cfg.max_context}, on {device} "
        f"({time.perf_counter() - t0:.1f} s to build)"
    )
    startup_s = first_forward_s(model)
    out(
        f"start-up: the process's first forward took {startup_s:.2f} s (CUDA, cuBLAS and "
        "cuDNN initialisation, paid once per process, as an engine's profiling step)"
    )
    ladder = list(sizes) if sizes else gg.capture_sizes(cfg.max_batch)
    runner = gg.GraphRunner(
        model.decode_step,
        model.example_inputs(1),
        sizes=ladder,
        mode=mode,
        fill_values=model.pad_fill_values(),
        names=("token_ids", "positions", "slots"),
        before_capture=[model.warm_kernels],
        workspaces=[model.workspace],
        # Capture's forwards write the KV cache only at the scratch slot (the padded
        # rows' fill values), never a live sequence's row: declared, nothing to snapshot.
        state=[],
        sanitize=sanitize,
        name=f"{preset}.decode_step",
    )
    result = DemoResult(
        device=str(device), preset=preset, mode=mode, steps=steps, sanitize=sanitize
    )
    if sanitize:
        out(sanitizer_line(runner))
    with torch.inference_mode():
        report = runner.capture()
        if mode != "none":
            out(report.table())  # one row per size, then the summary line (printed once)
            result.capture = {**report.to_dict(), "startup_s": startup_s}
        schedule = batch_schedule(steps, phases, cfg.max_batch)
        gen = torch.Generator(device=device).manual_seed(1)
        first = torch.randint(0, cfg.vocab_size, (cfg.max_batch,), device=device, generator=gen)

        # 1. correctness: each step on the same state, graph then eager.
        model.reset_cache()
        seqs = Sequences(cfg.max_batch, cfg.max_context, device)
        result.check = check_decode_loop(runner, model.decode_step, schedule, seqs, first)
        c = result.check
        out(
            f"check vs eager over {c['steps']} steps ({c['tokens_checked']} tokens): "
            f"bitwise equal on {c['bitwise_equal_steps']}/{c['steps']} steps, argmax "
            f"agreement {100 * c['argmax_agreement']:.2f}%, max |logit diff| "
            f"{c['max_abs_logit_diff']:.3g}"
        )

        # 2. timing: graph loop, then eager loop, same schedule.
        timings = {}
        seq_args = (cfg.max_batch, cfg.max_context, device)
        for label, fn in (("graphguard", runner), ("eager", model.decode_step)):
            model.reset_cache()
            time_decode_loop(fn, schedule[:20], Sequences(*seq_args), first)
            model.reset_cache()
            timings[label] = time_decode_loop(fn, schedule, Sequences(*seq_args), first)
        out(f"{'batch':>6} {'steps':>6} {'eager ms':>9} {'graph ms':>9} {'speedup':>8}")
        for b in sorted(timings["eager"]):
            e_ms = statistics.median(timings["eager"][b])
            g_ms = statistics.median(timings["graphguard"][b])
            padded = runner.padded_size(b)
            row = {
                "batch": b,
                "padded_to": padded or b,
                "steps": len(timings["eager"][b]),
                "eager_ms": e_ms,
                "graphguard_ms": g_ms,
                "speedup": e_ms / g_ms,
            }
            result.per_batch.append(row)
            out(f"{b:>6} {row['steps']:>6} {e_ms:>9.3f} {g_ms:>9.3f} {e_ms / g_ms:>7.2f}x")
    runner.release()
    write_json(result, json_path, out)
    return result


def first_forward_s(model: LlamaDecodeModel) -> float:
    """Seconds of one eager decode step on a fresh process, the cache zeroed after.

    The first forward initialises CUDA, cuBLAS and cuDNN (seconds on a GPU); timed
    apart, the capture report shows what capture itself costs.
    """
    with torch.inference_mode():
        t0 = time.perf_counter()
        model.decode_step(*model.example_inputs(1))
        if model.device.type == "cuda":
            torch.cuda.synchronize(model.device)
        seconds = time.perf_counter() - t0
    model.reset_cache()
    return seconds


def uses_engine_loop(mode: str | Mode, spec_tokens: int, engine: bool) -> bool:
    """Whether the demo runs the engine loop (mixed_step + Dispatcher) or the decode loop."""
    return engine or spec_tokens > 0 or Mode.parse(mode).has_piecewise


__all__ = ["first_forward_s", "run_demo", "uses_engine_loop"]
