"""``graphguard-demo`` on a machine without CUDA: the real lifecycle, recorded, in seconds.

A CPU cannot replay a CUDA graph, and timing eager against eager proves nothing, so the
CPU demo shows what *is* true here: graphguard's capture lifecycle run for real under
:class:`~graphguard.backend.RecordingBackend` (which records each step and replays by
re-running it), in the order the events happened; the decode loop padding every batch to
a captured size with replay equal to eager; and the guard that makes the hazard loud, a
locked arena refusing to grow (:class:`~graphguard.errors.WorkspaceLockedError`). It ends
by saying what a GPU adds.
"""

from __future__ import annotations

import textwrap
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

import graphguard as gg
from graphguard.backend import RecordingBackend
from graphguard.config import Mode
from graphguard.errors import WorkspaceLockedError
from graphguard.phase import in_graph_preparation, is_capturing
from graphguard_ref.demo.common import (
    DemoResult,
    Sequences,
    batch_schedule,
    check_decode_loop,
    routes,
    sanitizer_line,
    write_json,
)
from graphguard_ref.llama import LlamaConfig, LlamaDecodeModel

GPU_ADDS = (
    "What a GPU adds: real CUDA graphs, one replay per step instead of hundreds of kernel "
    "launches (llama-1b decode 1.9-7.6x faster than eager on an H200, docs/benchmarks.md), "
    "the graph pool's memory in the capture report, and the sanitizer's device-side "
    "checks. Run the same command on a machine with CUDA."
)


def lifecycle_lines(events: Sequence[tuple[Any, ...]]) -> list[str]:
    """The recorded capture events up to the first replay, one line per lifecycle stage.

    ``events`` are :class:`RecordingBackend` events plus the demo's own ``("hook",)``
    and ``("warmup", batch)`` notes; each size's warmups and synchronizes are folded
    into the line of the capture that follows them, and the forwards of graphguard's
    output-layout probe (before the hooks' synchronize) into a line of their own; a size
    whose first warmup was the probe's forward says so.
    """
    lines: list[str] = []
    pending: list[str] = []
    hooks_open = False
    for event in events:
        kind = event[0]
        if kind == "replay":
            break
        if kind == "hook":
            lines.append("before_capture hook: model.warm_kernels (sizes the arena while open)")
            hooks_open = True
        elif kind == "warmup":
            pending.append(f"warmup forward (batch {event[1]})")
        elif kind == "synchronize":
            if hooks_open and (not pending or pending[-1] == "synchronize"):
                # The hooks' own synchronize; forwards before it are graphguard's
                # output-layout probe (the last hook: two uncaptured forwards).
                if pending:
                    lines.append("output-layout probe: " + " -> ".join(pending))
                    pending = []
                lines.append("synchronize (the hooks' work done before any capture)")
                hooks_open = False
            else:
                pending.append("synchronize")
        elif kind == "capture_begin":
            pending.append("capture")
        elif kind == "capture_end":
            probed = not any(p.startswith("warmup") for p in pending)
            note = " (its warmup: the probe's forward)" if probed else ""
            lines.append(f"size {event[1]}: " + " -> ".join(pending) + note)
            pending = []
    return lines


def run_cpu_demo(
    *,
    max_batch: int = 8,
    max_context: int = 64,
    sizes: Sequence[int] | None = None,
    steps: int = 48,
    phases: Sequence[int] = (8, 1, 5, 3),
    sanitize: bool = False,
    json_path: Path | None = None,
    out: Callable[[str], None] = print,
    mode: str = "full",
) -> DemoResult:
    """The decode demo on a CPU: lifecycle, padded replays vs eager, the locked-arena error.

    ``mode="none"`` is honoured: the runner captures nothing and calls the step eagerly,
    so the demo says so, checks the runner's eager calls against eager, and skips what
    needs a capture (the lifecycle and the locked-arena error)."""
    graphs = Mode.parse(mode) is not Mode.NONE
    if graphs:
        out(
            "No CUDA device: CUDA graphs need an NVIDIA GPU. On this CPU the demo runs "
            "graphguard's real capture lifecycle under the RecordingBackend (it records each "
            "step and replays by re-running it): the order, the padding and the guards are "
            "real, the speed is not."
        )
    else:
        out(
            "No CUDA device, mode none: nothing is captured; the runner calls the decode "
            "step eagerly at every batch size (no lifecycle, no padding, no replay), and "
            "each step is checked against the model called directly."
        )
    cfg = LlamaConfig.preset("tiny", max_batch=max_batch, max_context=max_context)
    t0 = time.perf_counter()
    model = LlamaDecodeModel.random(cfg, device=torch.device("cpu"), dtype=torch.float32, seed=0)
    out(
        f"model: tiny, {cfg.num_params / 1e6:.2f} M params, float32, max_batch {max_batch}, "
        f"context {max_context}, on cpu ({time.perf_counter() - t0:.2f} s to build)"
    )
    backend = RecordingBackend()
    ladder = sorted(sizes) if sizes else gg.capture_sizes(max_batch)

    def step(tokens: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        if in_graph_preparation() and not is_capturing():
            backend.events.append(("warmup", tokens.shape[0]))
        return model.decode_step(tokens, positions, slots)

    def warm(hook_sizes: Sequence[int]) -> None:
        backend.events.append(("hook",))
        model.warm_kernels(hook_sizes)

    runner = gg.GraphRunner(
        step,
        model.example_inputs(1),
        sizes=ladder,
        mode=mode,
        fill_values=model.pad_fill_values(),
        names=("token_ids", "positions", "slots"),
        before_capture=[warm],
        workspaces=[model.workspace],
        # Capture's forwards write the KV cache only at the scratch slot (the fill
        # values), never a live row: nothing to snapshot.
        state=[],
        sanitize=sanitize,
        progress=False,
        name="tiny.decode_step",
        backend=backend,
    )
    result = DemoResult(
        device="cpu", preset="tiny", mode=Mode.parse(mode).value, steps=steps, sanitize=sanitize
    )
    if sanitize:
        out(sanitizer_line(runner))
    with torch.inference_mode():
        report = runner.capture()
        if graphs:
            lifecycle = lifecycle_lines(backend.events)
            result.capture = {**report.to_dict(), "lifecycle": lifecycle}
            out(f"1. capture of sizes {sorted(ladder, reverse=True)}, in the order it ran:")
            for line in lifecycle:
                out(f"   {line}")
            arena = model.workspace
            out(
                f"   arena {arena.name!r} locked at {arena.nbytes} bytes "
                f"(locked: {arena.locked}); {len(report.captured)} sizes captured"
            )
        else:
            out("1. mode none: no capture ran (no size captured, no graph to replay)")

        schedule = batch_schedule(steps, phases, max_batch)
        gen = torch.Generator().manual_seed(1)
        first = torch.randint(0, cfg.vocab_size, (max_batch,), generator=gen)
        model.reset_cache()
        seqs = Sequences(max_batch, max_context, torch.device("cpu"))
        result.check = check_decode_loop(runner, model.decode_step, schedule, seqs, first)
        c = result.check
        batches = " -> ".join(map(str, dict.fromkeys(schedule)))
        agreement = (
            f"on {c['bitwise_equal_steps']}/{c['steps']} steps, max |logit diff| "
            f"{c['max_abs_logit_diff']:.2g}, argmax agreement "
            f"{100 * c['argmax_agreement']:.2f}%"
        )
        if graphs:
            out(
                f"2. decode loop, {c['steps']} steps through batches {batches}, each run as "
                f"{routes(runner, list(dict.fromkeys(schedule)))}: replay bitwise equal "
                f"to eager {agreement} (a padded batch runs the larger size's matmuls, "
                "whose float sums may differ in the last bits). On a CPU a replay re-runs "
                "the step, so this checks padding, static buffers and output views."
            )
        else:
            out(
                f"2. decode loop, {c['steps']} steps through batches {batches}, unpadded: "
                f"the runner's eager calls (mode none) bitwise equal to the model's "
                f"{agreement}."
            )
    runner.release()
    if graphs:
        result.check["locked_arena_error"] = _locked_arena_error(cfg, ladder, out)
    else:
        out("3. the locked-arena error needs a capture: not shown in mode none")
    out(GPU_ADDS)
    write_json(result, json_path, out)
    return result


def _locked_arena_error(cfg: LlamaConfig, ladder: Sequence[int], out: Callable[[str], None]) -> str:
    """Capture without the kernel-warmup hook, then run a batch the capture never saw.

    The arena was sized by the capture's own warmups only (largest captured size); the
    bigger eager batch asks it for more, and the locked arena refuses by name.
    """
    small = [s for s in ladder if s < cfg.max_batch] or [1]
    model = LlamaDecodeModel.random(cfg, device=torch.device("cpu"), dtype=torch.float32, seed=0)
    runner = gg.GraphRunner(
        model.decode_step,
        model.example_inputs(1),
        sizes=small,
        fill_values=model.pad_fill_values(),
        workspaces=[model.workspace],
        state=[],
        progress=False,
        name="tiny.decode_step (no warmup hook)",
        backend=RecordingBackend(),
    )
    message = "no error: the arena did not need to grow"
    with torch.inference_mode():
        runner.capture()
        out(
            f"3. the same capture of sizes {sorted(small, reverse=True)} without the "
            f"before_capture hook, then the model's step at batch {cfg.max_batch}, a shape "
            "no warmup ran:"
        )
        try:
            model.decode_step(*model.example_inputs(cfg.max_batch))
        except WorkspaceLockedError as exc:
            message = f"{type(exc).__name__}: {exc}"
    runner.release()
    for line in textwrap.wrap(message, 96, break_on_hyphens=False, break_long_words=False):
        out(f"   {line}")
    return message


__all__ = ["GPU_ADDS", "lifecycle_lines", "run_cpu_demo"]
