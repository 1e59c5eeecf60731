"""The capture lifecycle, and what a failed or interrupted capture leaves behind.

The order is the product:

1. The declared ``state`` (:class:`~graphguard.state.StateSet`) is snapshotted (unless
   nothing of the run executes eagerly, :func:`_runs_eagerly`: a CUDA lazy capture whose
   one warmup was the stage's).
2. ``before_capture`` hooks (kernel warmups at realistic shapes) in phase WARMUP, so
   workspaces reach their final size before any graph holds a pointer ("arena growth
   after capture"); then a device synchronize.
3. Garbage collection paused for the loop (restored after; :mod:`graphguard._collector`).
4. Per size, largest first, into one shared pool, on one side stream: ``warmup_iters``
   uncaptured forwards in phase WARMUP (one less at a size the lazy stage or the layout
   probe warmed, :attr:`CapturePlan.prewarmed`), **each followed by a device synchronize**
   ("side-stream work across the capture boundary"); a check that every known stream is
   idle; then the capture in phase CAPTURE. The first warmup of the ladder also looks
   for tensors outside the static inputs that the callable writes (undeclared state).
5. The state restored (also on failure), so capture leaves caches and device-side
   counters exactly as it found them; likewise every generator the step draws from
   (:mod:`graphguard.rng`: registered with every graph, seed and offset put back).
6. Arenas locked (unless this is a profiling capture); the process marked SERVING;
   ``after_capture`` hooks.

Failure semantics. A capture either keeps a consistent set of graphs over *locked*
arenas, or keeps none over arenas as it found them; never a graph over an unlocked
arena. (a) An ``Exception`` while warming up or capturing one size (a shape error, a
host sync, a graphguard error other than :class:`~graphguard.errors.BusyStreamError`)
fails that size only: it is rolled back (never half-registered) and wrapped in a
:class:`~graphguard.errors.GraphCaptureError`; with ``on_capture_error="skip"`` the loop goes on,
with ``"raise"`` it stops. The sizes that did capture are kept, the arenas locked and the
process marked SERVING, then the error is raised (``"raise"``) or the report returned
(``"skip"``). If no size captured, nothing is locked or marked and the caller may simply
call ``capture()`` again. (b) Anything else -- a ``before_capture`` hook that raises, a
``KeyboardInterrupt`` or other ``BaseException`` at any point, a ``BusyStreamError``, a
failure while locking the arenas -- aborts the whole capture: every graph of this run is
dropped (``discard``), arenas this run locked are unlocked, the process phase is left as it
was, and the original exception propagates unchanged; ``capture()`` may be retried. In
every case the transient phase, the capture window and the garbage collector are restored
and the declared state is restored. (c) An ``after_capture`` hook that raises finds the
capture complete (graphs, locked arenas, SERVING); its error propagates and the graphs stay.
``after_capture`` hooks run only when at least one graph was kept.

Autocast: autocast's weight-cast cache is emptied right before and after each capture
(:mod:`graphguard.autocast`), so no graph bakes the address of a cached cast that the
caller's autocast block frees on exit; the graphs keep the caller's autocast policy.

Largest first: the largest graph's intermediates make the pool's blocks, which every
smaller graph then reuses, so the ladder costs little more than its largest member.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from tqdm.auto import tqdm

from graphguard import phase, streams
from graphguard._collector import paused_gc
from graphguard._unwind import abandoned_graphs
from graphguard.autocast import AutocastPolicy, fresh_casts
from graphguard.backend import Captured, GraphBackend
from graphguard.capture_failure import size_error, sync_related
from graphguard.errors import BusyStreamError, GraphCaptureError, first_line
from graphguard.mode import Mode
from graphguard.phase import Phase
from graphguard.report import CaptureReport, SizeReport
from graphguard.rng import GeneratorStates, ReseedCheck, is_default
from graphguard.sizes import Hook
from graphguard.state import StateSet, watch_writes
from graphguard.workspace import Workspace

logger = logging.getLogger("graphguard")


@dataclass(frozen=True)
class CapturePlan:
    """Plain data the capture loop iterates: what to capture and how. Frozen: a variant
    (a lazy size, a recapture, a throwaway estimate) is a new plan made with
    :func:`dataclasses.replace`, never an edit of a runner's plan."""

    name: str
    """Who captures (e.g. ``GraphRunner(decode)``): logs, errors, the capture window."""
    sizes: Sequence[int]
    """Capture order (largest first)."""
    warmup: Callable[[int], Any]
    """One uncaptured forward at a size."""
    body: Callable[[int], Callable[[], Any]]
    """The work to record at a size (a zero-arg callable)."""
    register: Callable[[int, Captured], None]
    """Keep a successful capture (its size, what the backend captured and read)."""
    discard: Callable[[Sequence[int]], None]
    """Drop the graphs :attr:`register` kept during this run, of the sizes given (an
    aborted capture, failure semantics (b): every graph of the run is dropped)."""
    warmup_iters: int = 1
    before_capture: Sequence[Hook] = ()
    after_capture: Sequence[Hook] = ()
    workspaces: Sequence[Workspace] = ()
    capture_error_mode: str = "global"
    on_capture_error: str = "raise"
    profiling: bool = False
    progress: bool = True
    mode: Mode = Mode.FULL
    state: StateSet | None = None
    """Tensors the callable updates in place (caches, counters): snapshotted before the
    hooks and restored after the last capture, also on failure."""
    static_inputs: Sequence[torch.Tensor] = ()
    """The static input buffers (writes to them are not state)."""
    watch: Any = None
    """With no ``state`` declared: the callable whose first warmup is watched for writes
    to tensors outside ``static_inputs`` (named through its attributes in one warning)."""
    generators: Sequence[tuple[str, torch.Generator]] = ()
    """``(name, generator)`` the callable may draw from (:func:`graphguard.rng.step_generators`):
    registered with every graph; their seed and offset restored after capture."""
    poison_arenas: bool = False
    """Fill each arena this run locks with NaN right after the lock (:meth:`Workspace.poison
    <graphguard.workspace.Workspace.poison>`), so a replay that reads scratch it did not
    write diverges; arenas already locked (a lazy capture while serving) are left alone."""
    prewarmed: frozenset[int] = frozenset()
    """Sizes whose first warmup iteration already ran (the lazy stage's forward and its
    synchronize, ``Lazy(warm_shapes=True)``): ``warmup_iters - 1`` warmups here (none: a
    synchronize in their place), unless this run watches its first warmup for undeclared
    writes (no ``state``): :attr:`graphguard.report.SizeReport.prewarmed`."""
    read_args: bool | str = False
    """Have the backend return every kernel argument each graph takes
    (:attr:`Captured.args <graphguard.backend.Captured.args>`), for provenance."""
    sync_guard: bool = True
    """Arm the process-wide sync debug mode around each capture (a host synchronize in
    the step raises before it reaches the device); a lazy capture while other threads
    serve runs without it (:mod:`graphguard.lazy`)."""
    hook_warmed: Callable[[], frozenset[int]] | None = None
    """Asked after the ``before_capture`` hooks: the sizes whose forward a hook ran in phase
    WARMUP to its synchronize (the ladder's layout probe, at the two largest sizes), added
    to :attr:`prewarmed` for this run. The same forward, watched the same way, as the
    warmup it stands for; not running it twice saves two forwards at the largest sizes."""


HOW = ("up front", "lazily")
"""How a size came to be captured (:attr:`graphguard.stats.SizeStats.how`): in
``capture()`` or a recapture, or on first use (:mod:`graphguard.lazy`)."""


def _note(exc: BaseException, text: str) -> None:
    add_note = getattr(exc, "add_note", None)  # Python >= 3.11
    if callable(add_note):
        with contextlib.suppress(Exception):
            add_note(text)


def _arena_buffers(plan: CapturePlan) -> list[torch.Tensor]:
    """The declared arenas' buffers: scratch the step is expected to write, not state."""
    out = []
    for ws in plan.workspaces:
        if ws.buffer is not None:
            out.append(ws.buffer)
    return out


def run(
    plan: CapturePlan,
    backend: GraphBackend,
    *,
    pool: Any = None,
    hook_sizes: Sequence[int] | None = None,
    stage: bool = False,
    log: bool = True,
) -> CaptureReport:
    """Execute ``plan`` on ``backend`` and return the report (see the module docstring):
    :meth:`_Run.prepare`, then :meth:`_Run.step` for each size, then :meth:`_Run.finish`.

    ``pool``: the graph pool to capture into (default a new one); ``hook_sizes``: the sizes
    the hooks are called with (default ``plan.sizes``; a lazy runner's whole ladder while
    this run captures part of it); ``stage``: a lazy runner's before-capture stage, which
    locks the arenas and marks the process serving even when no size is captured now
    (the hooks sized them for the whole ladder); ``log``: log the report's summary line.
    """
    run = _Run(plan, backend)
    try:
        with phase.capture_window(plan.name):
            run.prepare(tuple(plan.sizes if hook_sizes is None else hook_sizes))
            pool = pool if pool is not None else backend.new_pool()
            with paused_gc(), _progress(plan) as sizes:
                for size in sizes:
                    if not run.step(size, pool) and plan.on_capture_error == "raise":
                        break
            keeps = bool(run.captured) or stage
            run.finish(lock=keeps and not plan.profiling)
    except BaseException as exc:
        run.unwind(exc)
        raise
    report = run.report
    report.arenas = [ws.info() for ws in plan.workspaces]
    report.abandoned_graphs = abandoned_graphs()
    report.total_s = time.perf_counter() - run.t_start
    if keeps and not plan.profiling:
        phase.set_serving()
        if plan.after_capture:
            report.tick("report")
            for hook in plan.after_capture:
                hook(run.hook_sizes)
            report.tick("after_hooks")
    if log and logger.isEnabledFor(logging.INFO):
        logger.info("%s: %s", plan.name, report.summary())
    report.tick("report")
    if run.first_error is not None and plan.on_capture_error == "raise":
        run.first_error.report = report
        raise run.first_error
    return report


@contextlib.contextmanager
def _progress(plan: CapturePlan) -> Iterator[Iterator[int]]:
    """The sizes in capture order, behind a tqdm bar (``plan.progress``; else no bar)."""
    if not plan.progress:
        yield iter(plan.sizes)
        return
    bar = tqdm(
        plan.sizes,
        desc=f"capturing {plan.name}",
        unit="graph",
        leave=False,
    )
    with contextlib.closing(bar):

        def sizes() -> Iterator[int]:
            for size in bar:
                bar.set_postfix(size=size)
                yield size

        yield sizes()


class _Run:
    """One execution of a plan: what it snapshotted, captured and failed, and the three
    phases :func:`run` strings together (and :meth:`unwind` when it cannot finish)."""

    def __init__(self, plan: CapturePlan, backend: GraphBackend) -> None:
        self.plan, self.backend = plan, backend
        self.prewarmed = plan.prewarmed  # and the hooks' forwards (CapturePlan.hook_warmed)
        self.t_start = time.perf_counter()
        self.report = CaptureReport(
            mode=plan.mode.value, backend=backend.name, profiling=plan.profiling
        )
        self.report.generators = [name for name, _ in plan.generators]
        self.captured: list[int] = []
        self.first_error: GraphCaptureError | None = None
        self.hook_sizes: tuple[int, ...] = tuple(plan.sizes)
        self.rng_snap: GeneratorStates | None = GeneratorStates([g for _, g in plan.generators])
        # The default generator is registered by capture_begin itself.
        self.generators = [g for _, g in plan.generators if not is_default(g)]
        self.reseeds = ReseedCheck(plan.generators)
        self.watching = plan.state is None and plan.watch is not None and plan.warmup_iters > 0
        # Nothing eager, nothing to restore: see _runs_eagerly.
        self.snap = plan.state.snapshot() if plan.state and _runs_eagerly(plan, backend) else None
        if self.snap is not None:
            backend.synchronize()  # the clones land before any warmup (on a side stream) writes
        self.report.tick("snapshot", self.t_start)

    def prepare(self, hook_sizes: tuple[int, ...]) -> None:
        """Steps 1-2: the ``before_capture`` hooks in phase WARMUP, then a synchronize."""
        plan, self.hook_sizes = self.plan, hook_sizes
        self.report.autocast = AutocastPolicy.current().describe()
        if not plan.before_capture:
            return
        t0 = time.perf_counter()
        try:
            with self.report.phase("hooks"):
                with phase.enter(Phase.WARMUP, owner=plan.name, profiling=plan.profiling):
                    for hook in plan.before_capture:
                        hook(hook_sizes)
                self.backend.synchronize()
                if plan.hook_warmed is not None:
                    self.prewarmed = plan.prewarmed | plan.hook_warmed()
        except BaseException as exc:
            _note(
                exc,
                f"graphguard: a before_capture hook of {plan.name} failed; nothing "
                "was captured or locked, and capture() may be called again.",
            )
            raise
        self.report.hooks_s = time.perf_counter() - t0

    def step(self, size: int, pool: Any) -> bool:
        """Step 4 for one size: warmups (each followed by a synchronize), the idle-stream
        check, the capture into ``pool``; whether it was kept. An ``Exception`` fails this
        size alone (rolled back, recorded as the run's error); a :class:`BusyStreamError`
        or a ``BaseException`` aborts the run. A size in :attr:`CapturePlan.prewarmed`
        runs one warmup less (none left: still a synchronize before the idle check)."""
        entry = SizeReport(size=size)
        self.report.sizes.append(entry)
        try:
            t0 = time.perf_counter()
            self._warm(size, entry)
            t1 = time.perf_counter()
            with self.report.phase("idle_check"):
                streams.assert_streams_idle(f"{self.plan.name}: before capturing size {size}")
                phase.check_capture_allowed(f"{self.plan.name} (size {size})")
            captured = self._capture(size, pool, entry)
            entry.warmup_s, entry.capture_s = t1 - t0, time.perf_counter() - t1
            with self.report.phase("register"):
                self.plan.register(size, captured)
            self.captured.append(size)
            return True
        except BusyStreamError:
            raise
        except Exception as exc:
            err = size_error(self.plan.name, size, exc, entry)
            logger.error("%s", err)
            self.first_error = self.first_error or err
            self.report.tick("failure")  # from the last phase through the rollback and its log
            return False

    def _warm(self, size: int, entry: SizeReport) -> None:
        """The warmups of ``size`` (one less when :attr:`CapturePlan.prewarmed` has it;
        none left: the synchronize that stands for the skipped one's)."""
        plan, backend, report = self.plan, self.backend, self.report
        left = plan.warmup_iters
        entry.prewarmed = left > 0 and size in self.prewarmed and not self.watching
        left -= int(entry.prewarmed)
        if left:
            with report.phase("warmup"), backend.stream():
                for _ in range(left):
                    self._warmup(size)
                    entry.warmups += 1
            return
        report.phases.setdefault("warmup", 0.0)  # none ran: the phase is there, at 0.0
        if entry.prewarmed:
            with report.phase("sync_before_capture"):
                backend.synchronize()  # the skipped warmup's: nothing crosses into the capture

    def _capture(self, size: int, pool: Any, entry: SizeReport) -> Captured:
        """The capture of ``size`` in phase CAPTURE, with the memory it took (the pool's
        growth; the driver's share: free memory taken that the allocator did not reserve,
        the instantiated graph) measured around it."""
        plan, backend, report = self.plan, self.backend, self.report
        with report.phase("memory_probe"):
            reserved, free = backend.reserved_bytes(), backend.free_bytes()
        try:
            with (
                report.phase("capture"),
                phase.enter(Phase.CAPTURE, owner=plan.name, profiling=plan.profiling),
                fresh_casts(),
            ):
                captured = backend.capture(
                    plan.body(size),
                    pool=pool,
                    error_mode=plan.capture_error_mode,
                    label=size,
                    generators=self.generators,
                    read_args=plan.read_args,
                    sync_guard=plan.sync_guard,
                )
        finally:
            with report.phase("memory_probe"):
                entry.pool_growth_bytes = backend.reserved_bytes() - reserved
        if captured.args is not None and captured.args.separate:  # read after capture_end
            report.move(captured.args.seconds, "capture", "provenance_read")
        with report.phase("memory_probe"):
            entry.driver_bytes = max(0, free - backend.free_bytes() - entry.pool_growth_bytes)
        return captured

    def _warmup(self, size: int) -> None:
        """One uncaptured forward in phase WARMUP (the run's first one watched for
        undeclared state writes), then the reseed check and a device synchronize."""
        plan = self.plan
        with phase.enter(Phase.WARMUP, owner=plan.name, profiling=plan.profiling):
            if self.watching:
                self.watching = False
                scratch = [*plan.static_inputs, *_arena_buffers(plan)]
                with watch_writes(plan.name, plan.watch, scratch) as seen:
                    plan.warmup(size)
                self.report.state_writes = seen
            else:
                plan.warmup(size)
        self.reseeds.check(f"{plan.name} (warmup at size {size})")
        self.backend.synchronize()

    def finish(self, *, lock: bool) -> None:
        """Steps 5-6: the captures ended, the state and generators restored, the arenas
        locked (``lock``)."""
        report = self.report
        report.tick("lifecycle")  # the loop's end: progress bar closed, collector resumed
        self.backend.end_captures()
        report.tick("end")
        report.pool_bytes = sum(s.pool_growth_bytes for s in report.sizes)
        report.driver_bytes = sum(s.driver_bytes for s in report.sizes)
        if self.snap is not None and self.plan.state is not None:
            restoring, self.snap = self.snap, None
            self.plan.state.restore(restoring)
        if self.rng_snap is not None:
            rng_restoring, self.rng_snap = self.rng_snap, None
            rng_restoring.restore()
        report.tick("restore")
        if lock:
            _lock(self.plan)
            report.tick("lock")

    def unwind(self, exc: BaseException) -> None:
        """Failure semantics (b): restore what is left to restore, drop this run's graphs;
        the original exception is the one the caller re-raises."""
        plan = self.plan
        with contextlib.suppress(Exception):  # the capture's own error is the one raised
            self.backend.end_captures()
        if self.rng_snap is not None:
            try:
                self.rng_snap.restore()
            except Exception as err:  # the capture's own error is the one raised
                logger.error("%s: could not restore the generators' states: %s", plan.name, err)
        if self.snap is not None and plan.state is not None:
            try:
                plan.state.restore(self.snap)
            except Exception as err:  # the capture's own error is the one raised
                logger.error("%s: could not restore the declared state: %s", plan.name, err)
        _abort(plan, self.captured, exc)


def _runs_eagerly(plan: CapturePlan, backend: GraphBackend) -> bool:
    """Whether a run of ``plan`` executes the step eagerly: a ``before_capture`` hook, a
    warmup, or a backend whose capture runs the body (the CPU emulation, PIECEWISE's
    eager ops between pieces). A CUDA capture only records kernels, so a lazy capture
    whose one warmup was the stage's (``Lazy(warm_shapes=True)``) writes no state: its
    snapshot, the synchronize after it and the restore are skipped (about 1.3 ms of a
    20 ms Hugging Face 1B capture on the H200)."""
    if plan.before_capture or backend.capture_runs_body:
        return True
    return any(plan.warmup_iters > int(size in plan.prewarmed) for size in plan.sizes)


def _lock(plan: CapturePlan) -> None:
    """Lock every arena, or none: a failure part-way unlocks the ones this call locked.
    With ``poison_arenas``, the arenas this call locked are then poisoned, before any
    replay; one that was locked already may be in use by graphs serving now (a lazy
    capture, another runner sharing it), and a fill would race their replays."""
    done: list[Workspace] = []
    try:
        for ws in plan.workspaces:
            was = ws.locked
            ws.lock()
            if not was:
                done.append(ws)
        if plan.poison_arenas:
            for ws in done:
                ws.poison()
    except BaseException:
        for ws in done:
            with contextlib.suppress(Exception):
                ws.unlock(reason=f"{plan.name}: capture aborted while locking the arenas")
        raise


def _abort(plan: CapturePlan, captured: list[int], exc: BaseException) -> None:
    """Undo a capture that cannot finish: drop the graphs it registered."""
    if not captured:
        return
    plan.discard(list(captured))
    logger.warning(
        "%s: capture aborted by %s; dropped the %d graph(s) it had captured (%s); the "
        "arenas stay unlocked and capture() may be called again",
        plan.name,
        first_line(exc),
        len(captured),
        captured,
    )


__all__ = ["HOW", "CapturePlan", "paused_gc", "run", "sync_related"]
