"""``graphguard-demo`` in the engine loop: prefill chunks, decode or speculative verify,
each batch dispatched to FULL graphs, PIECEWISE graphs or eager.

Contract: requests join and finish following the phases; uniform decode/verify steps
replay FULL graphs, mixed steps (some request prefilling) PIECEWISE graphs, through one
:class:`~graphguard.dispatch.Dispatcher` whose resolved plan is printed before capture.
Every step is checked against ``mixed_step`` run eagerly on the same cache state.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

import graphguard as gg
from graphguard.backend import GraphBackend, RecordingBackend
from graphguard.config import Mode
from graphguard_ref.demo.common import DEFAULT_PHASES, DemoResult, batch_schedule, write_json
from graphguard_ref.llama import LlamaConfig, LlamaDecodeModel
from graphguard_ref.serving_loop import (
    EngineScheduler,
    StepBatch,
    build_dispatcher,
    default_max_tokens,
    release,
)
from graphguard_ref.timing import StepTimer

MIXED_BUCKETS = (64, 256)
"""Token counts that split mixed batches in the timing table: PIECEWISE pays on small ones."""


def timing_label(batch: StepBatch) -> str:
    """``decode``/``verify``, or ``mixed<=64``/``mixed<=256``/``mixed>256`` by token count.

    Why buckets: a mode's gain depends on the batch size (graphs save launch overhead,
    which small batches are dominated by), and one average over all mixed batches hid it.
    """
    if batch.label != "mixed":
        return batch.label
    for bound in MIXED_BUCKETS:
        if batch.num_tokens <= bound:
            return f"mixed<={bound}"
    return f"mixed>{MIXED_BUCKETS[-1]}"


def time_batches(
    fn: Callable[[StepBatch], Any], batches: Sequence[StepBatch]
) -> dict[str, list[float]]:
    """Per-step GPU milliseconds (CUDA events), grouped by :func:`timing_label`."""
    timer: StepTimer[str] = StepTimer()
    for b in batches:
        timer.run(timing_label(b), fn, b)
    return timer.results()


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

    Without CUDA (and without ``make_backend``) it says CUDA graphs need a GPU and runs
    the requested mode under :class:`~graphguard.backend.RecordingBackend` (default
    preset tiny), untimed.
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
        if requested is Mode.NONE:
            out(
                "No CUDA device, mode none: the engine loop runs every step eagerly "
                "through the dispatcher (nothing is captured, nothing replays), each "
                "checked against mixed_step called directly; the speed is not measured."
            )
        else:
            out(
                "No CUDA device: CUDA graphs need an NVIDIA GPU. On this CPU the engine loop "
                f"runs mode {requested.value} under the RecordingBackend (it records each "
                "step and replays by re-running it): the dispatch, padding and capture "
                "lifecycle are real, the speed is not. On a GPU the same command times "
                "every kind of step."
            )
        make_backend = RecordingBackend
    preset = preset or ("llama-1b" if dev.type == "cuda" else "tiny")
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
            raise gg.errors.ConfigError(
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
        kinds: dict[str, dict[str, int]] = {}  # batch label -> runner kind -> steps
        ran: dict[str, dict[str, int]] = {}  # the same by timing label (mixed by size)
        for target in batch_schedule(steps, phases, cfg.max_batch):
            sched.set_live(target)
            batch = sched.next_batch(dev)
            if batch is None:  # pragma: no cover - a live request always has work
                continue
            kind = dispatcher.plan.resolve(batch.key).kind
            for table, label in ((kinds, batch.label), (ran, timing_label(batch))):
                per = table.setdefault(label, {})
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
                f"speculative decode ({spec_tokens} n-gram prompt-lookup drafts per request): "
                f"{st.verify_steps} verify rows, {st.accepted}/{st.drafted} drafts accepted "
                f"({100 * st.acceptance:.1f}%), {st.tokens_per_step:.2f} tokens per request per "
                f"verify step, {st.emitted} tokens emitted"
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
                time_batches(fn, recorded[:20])
                timings[label] = time_batches(fn, recorded)
            out(
                f"{'batch':>10} {'steps':>6} {'tokens':>7} {'eager ms':>9} "
                f"{run_mode.value + ' ms':>22} {'speedup':>8}"
            )
            for label in sorted(timings["eager"]):
                e_ms = statistics.median(timings["eager"][label])
                m_ms = statistics.median(timings["mode"][label])
                toks = [b.num_tokens for b in recorded if timing_label(b) == label]
                row = {
                    "batch": label,
                    "steps": len(toks),
                    "mean_tokens": sum(toks) / len(toks),
                    "eager_ms": e_ms,
                    "mode_ms": m_ms,
                    "speedup": e_ms / m_ms,
                    "ran": ran.get(label, {}),
                }
                result.per_kind.append(row)
                out(
                    f"{label:>10} {len(toks):>6} {row['mean_tokens']:>7.1f} {e_ms:>9.3f} "
                    f"{m_ms:>22.3f} {e_ms / m_ms:>7.2f}x"
                )
    release(dispatcher)
    write_json(result, json_path, out)
    return result


__all__ = ["MIXED_BUCKETS", "run_engine_demo", "time_batches", "timing_label"]
