"""The capture lifecycle. The order is the product:

1. ``before_capture`` hooks (kernel warmups at realistic shapes) in phase WARMUP, so
   workspaces reach their final size before any graph holds a pointer (seed ``002``);
   then a device synchronize.
2. ``gc`` collected once and frozen for the loop (restored after).
3. Per size, largest first, into one shared pool, on one side stream:
   ``warmup_iters`` uncaptured forwards in phase WARMUP, **each followed by a device
   synchronize** (auxiliary-stream work must not cross the capture boundary, seed
   ``000``); a check that every known stream is idle; then the capture in phase
   CAPTURE. A failed size is rolled back and reported, never half-registered.
4. Arenas locked (unless this is a profiling capture); the process marked SERVING;
   ``after_capture`` hooks.

Largest first: the largest graph's intermediates make the pool's blocks, which every
smaller graph then reuses, so the ladder costs little more than its largest member.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from tqdm.auto import tqdm

from graphguard import phase, streams
from graphguard.backend import Graph, GraphBackend
from graphguard.config import Mode
from graphguard.errors import BusyStreamError, GraphCaptureError
from graphguard.phase import Phase
from graphguard.report import CaptureReport, SizeReport
from graphguard.workspace import Workspace

logger = logging.getLogger("graphguard")

Hook = Callable[[Sequence[int]], Any]


@dataclass
class CapturePlan:
    """Plain data the capture loop iterates: what to capture and how."""

    name: str
    """Who captures (e.g. ``GraphRunner(decode)``): logs, errors, the capture window."""
    sizes: Sequence[int]
    """Capture order (largest first)."""
    warmup: Callable[[int], Any]
    """One uncaptured forward at a size."""
    body: Callable[[int], Callable[[], Any]]
    """The work to record at a size (a zero-arg callable)."""
    register: Callable[[int, Graph, Any], None]
    """Keep a successful capture (size, graph, body result)."""
    warmup_iters: int = 1
    before_capture: Sequence[Hook] = ()
    after_capture: Sequence[Hook] = ()
    workspaces: Sequence[Workspace] = ()
    capture_error_mode: str = "global"
    on_capture_error: str = "raise"
    profiling: bool = False
    progress: bool = True
    mode: Mode = Mode.FULL
    state: Any = None
    """Tensors capture must leave as it found them (a ``graphguard.state.StateSet``)."""
    pool: Any = None
    extra: dict[str, Any] = field(default_factory=dict)


@contextlib.contextmanager
def frozen_gc() -> Iterator[None]:
    """Collect once, then freeze the collector for the block.

    A collection in the middle of a 50-size capture loop costs time for nothing (every
    object is alive); freezing moves today's objects out of the collector's reach.
    """
    was_enabled = gc.isenabled()
    gc.collect()
    gc.freeze()
    gc.disable()
    try:
        yield
    finally:
        gc.unfreeze()
        if was_enabled:
            gc.enable()


def _describe(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"


def run(plan: CapturePlan, backend: GraphBackend) -> CaptureReport:
    """Execute ``plan`` on ``backend`` and return the report (see the module docstring)."""
    report = CaptureReport(mode=plan.mode.value, backend=backend.name, profiling=plan.profiling)
    t_start = time.perf_counter()
    first_error: GraphCaptureError | None = None
    with phase.capture_window(plan.name):
        if plan.before_capture:
            t0 = time.perf_counter()
            with phase.enter(Phase.WARMUP, owner=plan.name, profiling=plan.profiling):
                for hook in plan.before_capture:
                    hook(tuple(plan.sizes))
            backend.synchronize()
            report.hooks_s = time.perf_counter() - t0
        pool = plan.pool if plan.pool is not None else backend.new_pool()
        bar = tqdm(
            plan.sizes,
            desc=f"capturing {plan.name}",
            unit="graph",
            disable=not plan.progress,
            leave=False,
        )
        with frozen_gc():
            for size in bar:
                bar.set_postfix(size=size)
                entry = SizeReport(size=size)
                report.sizes.append(entry)
                reserved: int | None = None
                try:
                    t0 = time.perf_counter()
                    with backend.stream():
                        for _ in range(plan.warmup_iters):
                            with phase.enter(
                                Phase.WARMUP, owner=plan.name, profiling=plan.profiling
                            ):
                                plan.warmup(size)
                            backend.synchronize()
                    t1 = time.perf_counter()
                    streams.assert_streams_idle(f"{plan.name}: before capturing size {size}")
                    phase.check_capture_allowed(f"{plan.name} (size {size})")
                    reserved = backend.reserved_bytes()
                    with phase.enter(Phase.CAPTURE, owner=plan.name, profiling=plan.profiling):
                        graph, result = backend.capture(
                            plan.body(size),
                            pool=pool,
                            error_mode=plan.capture_error_mode,
                            label=size,
                        )
                    entry.capture_s = time.perf_counter() - t1
                    entry.warmup_s = t1 - t0
                    entry.pool_growth_bytes = backend.reserved_bytes() - reserved
                    plan.register(size, graph, result)
                except BusyStreamError:
                    raise
                except Exception as exc:
                    if reserved is not None:
                        entry.pool_growth_bytes = backend.reserved_bytes() - reserved
                    entry.ok = False
                    entry.error = _describe(exc)
                    err = GraphCaptureError(
                        f"{plan.name}: capturing size {size} failed: {entry.error}. "
                        "The callable must not synchronize the host (.item(), .cpu(), "
                        "print of a device tensor, torch.cuda.synchronize), branch on tensor "
                        "values, or allocate outside the capture stream. Sizes that did "
                        f"capture still replay; size {size} and the batches padding to it "
                        "run on the next larger graph or eagerly.",
                        size=size,
                        cause=exc,
                    )
                    err.__cause__ = exc
                    logger.error("%s", err)
                    if first_error is None:
                        first_error = err
                    if plan.on_capture_error == "raise":
                        break
        bar.close()
    report.pool_bytes = sum(s.pool_growth_bytes for s in report.sizes)
    if not plan.profiling:
        for ws in plan.workspaces:
            ws.lock()
    report.arenas = [ws.info() for ws in plan.workspaces]
    report.total_s = time.perf_counter() - t_start
    if not plan.profiling:
        phase.set_serving()
        for hook in plan.after_capture:
            hook(tuple(plan.sizes))
    logger.info("%s: %s", plan.name, report.summary())
    if first_error is not None and plan.on_capture_error == "raise":
        raise first_error
    return report


__all__ = ["CapturePlan", "frozen_gc", "run"]
