"""``graphguard demo``: a decode loop whose batch size changes, graphs vs eager.

Two loops:

* the **decode loop** (``--mode full|none`` without ``--spec-tokens``/``--engine``):
  sequences join and finish (the batch goes 8 -> 1 -> 37 -> 256 by default), every step
  pads to the next captured size of one :class:`GraphRunner` over ``decode_step``;
* the **engine loop** (``--mode piecewise|full_and_piecewise``, or any mode with
  ``--spec-tokens K`` or ``--engine``): requests join with prompts that prefill in
  chunks, then decode (or verify ``K`` draft tokens per step), over
  ``LlamaDecodeModel.mixed_step``. Uniform decode/verify steps replay FULL graphs, mixed
  steps (some request prefilling) PIECEWISE graphs, through one
  :class:`~graphguard.dispatch.Dispatcher`; the resolved plan is printed before capture.

Both check each graph step against an eager step on the same state and time graphs vs
eager (CUDA events). On a machine without CUDA the demo says so and runs eagerly.
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
from graphguard.backend import GraphBackend
from graphguard.config import Mode
from graphguard.dispatch import DispatchPlan
from graphguard.engine import (
    EngineScheduler,
    StepBatch,
    build_dispatcher,
    default_max_tokens,
    release,
)
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
    loop: str = "decode"
    requested_mode: str | None = None
    spec_tokens: int = 0
    plan: dict[str, Any] | None = None
    dispatch: dict[str, dict[str, int]] = field(default_factory=dict)
    spec: dict[str, Any] = field(default_factory=dict)
    per_kind: list[dict[str, Any]] = field(default_factory=list)


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


def uses_engine_loop(mode: str | Mode, spec_tokens: int, engine: bool) -> bool:
    """Whether the demo runs the engine loop (mixed_step + Dispatcher) or the decode loop."""
    return engine or spec_tokens > 0 or Mode.parse(mode).has_piecewise


# ------------------------------------------------------------------------- engine loop


def _write_json(result: DemoResult, json_path: Path | None, out: Callable[[str], None]) -> None:
    if json_path is None:
        return
    json_path.parent.mkdir(parents=True, exist_ok=True)
    json_path.write_text(json.dumps(result.__dict__, indent=2, default=str) + "\n")
    out(f"wrote {json_path}")


def _time_batches(
    fn: Callable[[StepBatch], Any], batches: Sequence[StepBatch]
) -> dict[str, list[float]]:
    """Per-step GPU-timeline milliseconds (CUDA events), grouped by batch label."""
    marks: list[tuple[str, Any, Any]] = []
    for b in batches:
        start = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
        end = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
        start.record()
        fn(b)
        end.record()
        marks.append((b.label, start, end))
    torch.cuda.synchronize()
    out: dict[str, list[float]] = {}
    for label, s, e in marks:
        out.setdefault(label, []).append(s.elapsed_time(e))
    return out


def run_engine_demo(
    *,
    preset: str | None = None,
    max_batch: int = 256,
    max_context: int = 1024,
    sizes: Sequence[int] | None = None,
    steps: int = 400,
    phases: Sequence[int] = DEFAULT_PHASES,
    mode: str | Mode = Mode.FULL_AND_PIECEWISE,
    spec_tokens: int = 0,
    prompt_len: int = 16,
    chunk: int = 32,
    max_tokens: int | None = None,
    full_mixed: bool = False,
    json_path: Path | None = None,
    out: Callable[[str], None] = print,
    device: torch.device | str | None = None,
    dtype: torch.dtype | None = None,
    make_backend: Callable[[], GraphBackend] | None = None,
    timing: bool | None = None,
    seed: int = 0,
) -> DemoResult:
    """The engine loop in one mode: prefill chunks, decode / verify, FULL vs PIECEWISE.

    Requests join and finish following ``phases`` (live request counts, as the decode
    loop's batch sizes); each joins with a prompt of ``1..2*prompt_len`` tokens,
    prefilled ``chunk`` tokens per step, then emits tokens greedily, verifying
    ``spec_tokens`` prompt-lookup drafts per step when ``spec_tokens > 0``. Uniform steps
    (every request decoding) have key ``decode(reqs, q=1+K)``; steps with a prefill chunk
    are mixed. ``sizes`` are the PIECEWISE capture sizes; their multiples of ``1+K`` up to
    ``max_batch*(1+K)`` the FULL ones (defaults: the ladders).

    Without CUDA (and without ``make_backend``) it says CUDA graphs need a GPU, prints
    the requested mode's plan, and runs the loop in mode none on the tiny preset.
    ``device``, ``dtype`` and ``make_backend`` (e.g. ``RecordingBackend``) let tests run
    every mode's plumbing on a CPU. Every step is checked against ``mixed_step`` run
    eagerly on the same cache state.
    """
    requested = Mode.parse(mode)
    run_mode = requested
    cuda = torch.cuda.is_available()
    if device is None:
        device = "cuda" if cuda else "cpu"
    dev = torch.device(device)
    if dev.type != "cuda" and make_backend is None:
        out(
            "No CUDA device: CUDA graphs need a GPU. Running the same engine loop eagerly "
            f"on the 'tiny' preset (mode none); the plan of mode {requested.value} is shown "
            "for reference."
        )
        preset, run_mode = "tiny", Mode.NONE
    preset = preset or "llama-1b"
    if dtype is None:
        dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    q = 1 + spec_tokens
    cfg = LlamaConfig.preset(preset, max_batch=max_batch, max_context=max_context)
    budget = (
        max_tokens if max_tokens is not None else default_max_tokens(max_batch, spec_tokens, chunk)
    )
    if sizes:
        pw_sizes = sorted(sizes)
        full_sizes = [s for s in pw_sizes if s % q == 0 and s <= max_batch * q]
        if not full_sizes and run_mode.has_full:
            raise gg.ConfigError(
                f"--sizes {pw_sizes}: no size is a multiple of q={q} up to max_batch*q; "
                "FULL graphs need whole requests"
            )
    else:
        pw_sizes = gg.capture_sizes(budget)
        full_sizes = gg.capture_sizes(max_batch * q, multiple_of=q)
    t0 = time.perf_counter()
    model = LlamaDecodeModel.random(cfg, device=dev, dtype=dtype, seed=seed)
    out(
        f"model: {preset}, {cfg.num_params / 1e9:.2f} B params, {dtype}, max_batch "
        f"{cfg.max_batch}, context {cfg.max_context}, on {dev} "
        f"({time.perf_counter() - t0:.1f} s to build); engine loop: spec tokens {spec_tokens} "
        f"(q={q}), prompts 1..{2 * prompt_len}, chunk {chunk}, max_tokens {budget}"
    )
    if run_mode is not requested:
        shown = DispatchPlan(
            requested,
            max_tokens=budget,
            full_sizes=full_sizes if requested.has_full else None,
            piecewise_sizes=pw_sizes if requested.has_piecewise else None,
            query_len=q,
            full_mixed=full_mixed,
            name="mixed_step",
        )
        out(shown.table())
    result = DemoResult(
        device=str(dev),
        preset=preset,
        mode=run_mode.value,
        steps=steps,
        loop="engine",
        requested_mode=requested.value,
        spec_tokens=spec_tokens,
    )
    with torch.inference_mode():
        dispatcher = build_dispatcher(
            model,
            run_mode,
            max_tokens=budget,
            query_len=q,
            full_sizes=full_sizes if run_mode.has_full else None,
            piecewise_sizes=pw_sizes if run_mode.has_piecewise else None,
            full_mixed=full_mixed,
            make_backend=make_backend,
            progress=dev.type == "cuda",
        )
        out(dispatcher.plan.table())
        t0 = time.perf_counter()
        reports = dispatcher.capture()
        capture_s = time.perf_counter() - t0
        capture: dict[str, Any] = {"total_s": capture_s}
        for kind, report in reports.items():
            out(f"{kind}: {report.summary()}")
            capture[kind] = report.to_dict()
        if dispatcher.piecewise is not None:
            out(str(getattr(dispatcher.piecewise, "describe", lambda: "")()))
        result.capture = capture if reports else None
        result.plan = dispatcher.plan.to_dict()

        # 1. correctness: every step through the dispatcher, then eagerly on the same state.
        model.reset_cache()
        sched = EngineScheduler(
            max_batch=cfg.max_batch,
            max_context=cfg.max_context,
            max_tokens=budget,
            vocab=cfg.vocab_size,
            spec_tokens=spec_tokens,
            prompt_len=prompt_len,
            chunk=chunk,
            max_new=max(8, cfg.max_context // 4),
            seed=seed,
        )
        recorded: list[StepBatch] = []
        worst, agree, total, bitwise = 0.0, 0, 0, 0
        kinds: dict[str, dict[str, int]] = {}
        for target in batch_schedule(steps, phases, cfg.max_batch):
            sched.set_live(target)
            batch = sched.next_batch(dev)
            if batch is None:  # pragma: no cover - a live request always has work
                continue
            kind = dispatcher.plan.resolve(batch.key).kind
            per = kinds.setdefault(batch.label, {})
            per[kind] = per.get(kind, 0) + 1
            g = dispatcher(batch.key, *batch.inputs).float().clone()
            e = model.mixed_step(*batch.inputs).float()
            worst = max(worst, float((g - e).abs().max()))
            bitwise += int(torch.equal(g, e))
            greedy = g.argmax(-1)
            agree += int((greedy == e.argmax(-1)).sum())
            total += batch.num_tokens
            sched.commit(batch, greedy.tolist())
            recorded.append(batch)
        result.dispatch = kinds
        result.spec = sched.stats.to_dict()
        result.check = {
            "steps": len(recorded),
            "max_abs_logit_diff": worst,
            "argmax_agreement": agree / max(total, 1),
            "tokens_checked": total,
            "bitwise_equal_steps": bitwise,
            "requests_finished": len(sched.finished),
        }
        out(
            "steps by batch kind -> what ran: "
            + "; ".join(
                f"{label}: " + ", ".join(f"{k} {v}" for k, v in sorted(per.items()))
                for label, per in sorted(kinds.items())
            )
        )
        if spec_tokens:
            st = sched.stats
            out(
                f"speculative decode: {st.verify_steps} verify rows, {st.accepted}/{st.drafted} "
                f"drafts accepted ({100 * st.acceptance:.1f}%), {st.emitted} tokens emitted"
            )
        out(
            f"check vs eager over {len(recorded)} steps ({total} tokens): argmax agreement "
            f"{100 * agree / max(total, 1):.2f}%, max |logit diff| {worst:.3g}, bitwise equal "
            f"on {bitwise}/{len(recorded)} steps"
        )

        # 2. timing: the same batches (teacher-forced), dispatcher then eager.
        if timing is None:
            timing = dev.type == "cuda"
        if timing:
            timings = {}
            runs: tuple[tuple[str, Callable[[StepBatch], Any]], ...] = (
                ("mode", lambda b: dispatcher(b.key, *b.inputs)),
                ("eager", lambda b: model.mixed_step(*b.inputs)),
            )
            for label, fn in runs:
                _time_batches(fn, recorded[:20])
                timings[label] = _time_batches(fn, recorded)
            out(
                f"{'batch':>7} {'steps':>6} {'tokens':>7} {'eager ms':>9} "
                f"{run_mode.value + ' ms':>22} {'speedup':>8}"
            )
            for label in sorted(timings["eager"]):
                e_ms = statistics.median(timings["eager"][label])
                m_ms = statistics.median(timings["mode"][label])
                toks = [b.num_tokens for b in recorded if b.label == label]
                row = {
                    "batch": label,
                    "steps": len(toks),
                    "mean_tokens": sum(toks) / len(toks),
                    "eager_ms": e_ms,
                    "mode_ms": m_ms,
                    "speedup": e_ms / m_ms,
                    "ran": kinds.get(label, {}),
                }
                result.per_kind.append(row)
                out(
                    f"{label:>7} {len(toks):>6} {row['mean_tokens']:>7.1f} {e_ms:>9.3f} "
                    f"{m_ms:>22.3f} {e_ms / m_ms:>7.2f}x"
                )
    release(dispatcher)
    _write_json(result, json_path, out)
    return result


__all__ = ["DemoResult", "batch_schedule", "run_demo", "run_engine_demo", "uses_engine_loop"]
