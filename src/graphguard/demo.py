"""``graphguard demo``: a decode loop whose batch size changes, graphs vs eager.

Sequences join and finish (the batch goes 8 -> 1 -> 37 -> 256 by default), every step
pads to the next captured size, and each graph step is checked against an eager step
on the same state. The timing table is per batch size: eager ms/step, graphguard
ms/step, speedup. On a machine without CUDA it says so and runs the loop eagerly.
"""

from __future__ import annotations

import json
import logging
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

import graphguard as gg
from graphguard.models import LlamaConfig, LlamaDecodeModel

logger = logging.getLogger("graphguard.demo")

DEFAULT_PHASES = (8, 1, 37, 256)


def batch_schedule(steps: int, phases: Sequence[int], max_batch: int) -> list[int]:
    """``steps`` batch sizes: equal segments of each phase value, capped at ``max_batch``."""
    if steps < 1 or not phases:
        raise gg.ConfigError("the demo needs at least one step and one batch size")
    per = max(1, steps // len(phases))
    out: list[int] = []
    for i in range(steps):
        out.append(min(max_batch, phases[min(i // per, len(phases) - 1)]))
    return out


class Sequences:
    """Slot bookkeeping: rows 0..b-1 are live sequences at their own positions.

    A batch shrinking finishes the sequences past it; growing starts new ones at
    position 0; a sequence reaching the context end restarts (a new request).
    """

    def __init__(self, max_batch: int, max_context: int, device: torch.device) -> None:
        self.max_context = max_context
        self.device = device
        self.positions = torch.zeros(max_batch, dtype=torch.long, device=device)
        self.slots = torch.arange(max_batch, dtype=torch.long, device=device)
        self.live = 0

    def step_inputs(self, b: int) -> tuple[torch.Tensor, torch.Tensor]:
        if b > self.live:
            self.positions[self.live : b] = 0
        self.live = b
        pos = self.positions[:b].clone()
        self.positions[:b] = (self.positions[:b] + 1) % self.max_context
        return pos, self.slots[:b]


@dataclass
class DemoResult:
    device: str
    preset: str
    mode: str
    steps: int
    capture: dict[str, Any] | None = None
    per_batch: list[dict[str, float]] = field(default_factory=list)
    check: dict[str, Any] = field(default_factory=dict)


def _time_loop(
    step: Callable[..., torch.Tensor],
    schedule: Sequence[int],
    seqs: Sequences,
    first_tokens: torch.Tensor,
) -> dict[int, list[float]]:
    """Per-step GPU-timeline milliseconds (CUDA events), grouped by batch size."""
    tokens = first_tokens
    marks: list[tuple[int, Any, Any]] = []
    for b in schedule:
        pos, slots = seqs.step_inputs(b)
        tok = (
            tokens[:b]
            if tokens.shape[0] >= b
            else torch.cat([tokens, first_tokens[tokens.shape[0] : b]])
        )
        start = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
        end = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
        start.record()
        logits = step(tok, pos, slots)
        end.record()
        tokens = logits.argmax(-1)
        marks.append((b, start, end))
    torch.cuda.synchronize()
    out: dict[int, list[float]] = {}
    for b, s, e in marks:
        out.setdefault(b, []).append(s.elapsed_time(e))
    return out


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
) -> DemoResult:
    """Build the model, capture, run the loop, check against eager, print the table."""
    cuda = torch.cuda.is_available()
    if not cuda:
        out(
            "No CUDA device: CUDA graphs need a GPU. Running the same decode loop eagerly "
            "on the 'tiny' preset (mode none) so you can see the API work."
        )
        preset, mode = "tiny", "none"
    preset = preset or "llama-1b"
    device = torch.device("cuda" if cuda else "cpu")
    dtype = torch.bfloat16 if cuda else torch.float32
    cfg = LlamaConfig.preset(preset, max_batch=max_batch, max_context=max_context)
    t0 = time.perf_counter()
    model = LlamaDecodeModel.random(cfg, device=device, dtype=dtype, seed=0)
    out(
        f"model: {preset}, {cfg.num_params / 1e9:.2f} B params, {dtype}, max_batch "
        f"{cfg.max_batch}, context {cfg.max_context}, on {device} "
        f"({time.perf_counter() - t0:.1f} s to build)"
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
        sanitize=sanitize,
        name=f"{preset}.decode_step",
    )
    result = DemoResult(device=str(device), preset=preset, mode=mode, steps=steps)
    with torch.inference_mode():
        report = runner.capture()
        if mode != "none":
            out(report.table())
            result.capture = report.to_dict()
        schedule = batch_schedule(steps, phases, cfg.max_batch)
        gen = torch.Generator(device=device).manual_seed(1)
        first = torch.randint(0, cfg.vocab_size, (cfg.max_batch,), device=device, generator=gen)

        # 1. correctness: each step on the same state, graph then eager.
        model.reset_cache()
        seqs = Sequences(cfg.max_batch, cfg.max_context, device)
        tokens = first
        worst, agree, total = 0.0, 0, 0
        for b in schedule:
            pos, slots = seqs.step_inputs(b)
            tok = (
                tokens[:b]
                if tokens.shape[0] >= b
                else torch.cat([tokens, first[tokens.shape[0] : b]])
            )
            g = runner(tok, pos, slots).float()
            e = model.decode_step(tok, pos, slots).float()
            worst = max(worst, float((g - e).abs().max()))
            agree += int((g.argmax(-1) == e.argmax(-1)).sum())
            total += b
            tokens = g.argmax(-1)
        result.check = {
            "steps": len(schedule),
            "max_abs_logit_diff": worst,
            "argmax_agreement": agree / total,
            "tokens_checked": total,
        }
        out(
            f"check vs eager over {len(schedule)} steps ({total} tokens): argmax agreement "
            f"{100 * agree / total:.2f}%, max |logit diff| {worst:.3g}"
        )

        # 2. timing: graph loop, then eager loop, same schedule.
        if cuda:
            timings = {}
            for label, fn in (("graphguard", runner), ("eager", model.decode_step)):
                model.reset_cache()
                _time_loop(
                    fn, schedule[:20], Sequences(cfg.max_batch, cfg.max_context, device), first
                )
                model.reset_cache()
                timings[label] = _time_loop(
                    fn, schedule, Sequences(cfg.max_batch, cfg.max_context, device), first
                )
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
        if report.sizes:
            out(report.summary())
    if json_path is not None:
        json_path.parent.mkdir(parents=True, exist_ok=True)
        json_path.write_text(json.dumps(result.__dict__, indent=2, default=str) + "\n")
        out(f"wrote {json_path}")
    runner.release()
    return result


__all__ = ["DemoResult", "batch_schedule", "run_demo"]
