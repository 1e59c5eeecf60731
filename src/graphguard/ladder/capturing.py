"""How a ladder captures: its plan, the observed forwards, the layout probe, and every
capture run (the whole ladder up front, one size lazily, some sizes again), each settled
into the store whatever happens.

:class:`LadderCapture` is the capture half of a :class:`~graphguard.ladder.GraphLadder`:
it runs the capture lifecycle (:mod:`graphguard.capture`) over the runner kind's body and
register (:class:`~graphguard.ladder.kind.GraphKind`) and keeps what one capture
establishes for the ones after it (the grad mode, the autocast policy, the generators,
the cuDNN dropout states the graphs took). It never holds the runner: what it needs of it
comes in at construction.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

from graphguard import capture as lifecycle
from graphguard import phase
from graphguard.autocast import AutocastPolicy, applied
from graphguard.backend import GraphBackend
from graphguard.buffers import StaticInputs, flatten
from graphguard.canary import poisons_arenas
from graphguard.errors import GraphCaptureError
from graphguard.first_call import warm_forward
from graphguard.ladder.kind import GraphKind
from graphguard.ladder.miss import Miss
from graphguard.ladder.reads import GraphReads
from graphguard.ladder.store import GraphStore
from graphguard.lazy_stage import lazy_plan, stage_failed
from graphguard.mode import Mode
from graphguard.options import CaptureOptions
from graphguard.outputs import check_output_leaves
from graphguard.report import CaptureReport
from graphguard.rng import CudnnDropoutStates, rnn_dropout_modules, step_generators
from graphguard.serving import LAZILY, UP_FRONT, CaptureGuard
from graphguard.state import StateSet
from graphguard.weights.record import WeightCheck

logger = logging.getLogger("graphguard")


@dataclasses.dataclass(frozen=True)
class LadderParts:
    """What a :class:`LadderCapture` works on, built by the ladder."""

    label: str
    name: str
    fn: Callable[..., Any]
    options: CaptureOptions
    mode: Mode
    sizes: tuple[int, ...]
    state: StateSet | None
    kind: GraphKind
    store: GraphStore
    static: StaticInputs
    reads: GraphReads
    guard: CaptureGuard
    sanitize: bool
    """The sanitizer's checks are on (the canary then poisons the arenas by default)."""
    warmed: dict[int, bool]
    """Sizes warmed and not captured yet (:attr:`LazyCapture.warmed
    <graphguard.lazy.LazyCapture.warmed>`: the same dict)."""
    backend: Callable[[], GraphBackend]
    """The device backend (made on first use)."""
    forward: Callable[..., Any]
    """The runner's forward on the static views (the kind's, or a mixin's around it)."""
    rebuild: Callable[[int | None], None]
    """Rebuild the replay path's entries and arm what watches them."""


class LadderCapture:
    """See the module docstring."""

    def __init__(self, parts: LadderParts) -> None:
        self.parts = parts
        self.reset()

    def reset(self) -> None:
        """What one capture (up front) establishes and ``release()`` forgets."""
        self.generator_list: list[tuple[str, torch.Generator]] | None = None
        self.autocast: AutocastPolicy | None = None  # the graphs' (eager runs under it)
        self.grad_mode = (False, False)
        self.parts.warmed.clear()  # a new stage warms again
        self.probed: frozenset[int] = frozenset()  # the layout probe's, in this run
        self.last: CaptureReport | None = None  # the last capture run's report
        self.rnn_states: dict[int, torch.Tensor] = {}
        """cuDNN dropout states the graphs took, held (rng.CudnnDropoutStates)."""

    def backend(self) -> GraphBackend:
        """The backend the lifecycle captures with (the kind's, around the device's)."""
        return self.parts.kind.capture_backend(self.parts.backend())

    def watch(self) -> Any:
        """The callable whose first warmup is watched for undeclared state writes (None:
        not watched: declared state, or a kind whose forward the watch cannot run under)."""
        p = self.parts
        return p.fn if p.options.state is None and not p.kind.compiled else None

    def generators(self) -> list[tuple[str, torch.Generator]]:
        """``(name, generator)`` the graphs register and restore (:mod:`graphguard.rng`):
        found by walking the callable at ``capture()`` (a walk over a large model takes
        milliseconds) and kept for the lazy captures and canary checks after it; a
        generator the step starts drawing from later is not registered, and the capture
        that meets it fails (that size runs eagerly): pass it in ``generators=``."""
        p = self.parts
        if self.generator_list is None or not p.store.serving:
            self.generator_list = step_generators(
                p.fn, p.options.generators or (), p.static.specs[0].device
            )
        return self.generator_list

    def warm_forward(self, size: int) -> tuple[Any, list[str] | None]:
        """The door's warm forward (:func:`graphguard.lazy.warm_forward`) at ``size``."""
        p = self.parts
        arenas = [ws.buffer for ws in p.options.workspaces or () if ws.buffer is not None]
        return warm_forward(
            p.label,
            lambda: self.observed_forward(size, uncaptured=True),
            modes=(*self.grad_mode, self.autocast),
            watch=self.watch(),
            scratch=[*p.static.buffers, *arenas],
        )

    @contextlib.contextmanager
    def capture_mode(self) -> Iterator[None]:
        """The grad and inference mode of the capture (they are per thread), for work on
        the graphs' tensors from any thread; the caller's own before any capture."""
        if not self.parts.store.serving or self.parts.mode is Mode.NONE:
            yield
            return
        inference, grad = self.grad_mode
        with torch.inference_mode(inference), torch.set_grad_enabled(grad):
            yield

    # ------------------------------------------------------------------ the plan

    def plan(self) -> lifecycle.CapturePlan:
        """This runner's capture plan: the kind's body and register around the ladder's
        forwards, the options' fields, the layout probe as the last hook."""
        p = self.parts
        o, kind = p.options, p.kind
        return lifecycle.CapturePlan(
            name=p.label,
            sizes=sorted(p.sizes, reverse=True),
            warmup=self.warmup_forward,
            body=lambda size: kind.body(size, self.capture_forward(size)),
            register=kind.register,
            warmup_iters=o.warmup_iters if o.warmup_iters is not None else 1,
            before_capture=[*kind.hooks(), *(o.before_capture or ()), self.probe_layout],
            # The probe's forwards as first warmups (lazily: only through warm_shapes).
            hook_warmed=(lambda: self.probed) if o.lazy is None or o.lazy.warm_shapes else None,
            after_capture=list(o.after_capture or ()),
            workspaces=list(o.workspaces or ()),
            capture_error_mode=o.capture_error_mode or "global",
            on_capture_error=o.on_capture_error or "raise",
            progress=bool(o.progress),
            mode=p.mode,
            state=p.state,
            discard=self.discard,
            static_inputs=p.static.buffers,
            # Declared state (even state=[]) means the user knows: no write watch.
            watch=self.watch(),
            generators=self.generators(),
            # NaN in the arenas at their lock; a lazy runner locks them at its stage, and
            # its later captures (serving already) never poison.
            poison_arenas=poisons_arenas(o.canary, p.sanitize)
            and not (o.lazy is not None and p.store.serving),
        )

    def discard(self, sizes: Sequence[int]) -> None:
        """Drop the graphs an aborted run captured (the lifecycle calls it)."""
        self.parts.store.retire(sizes)
        self.parts.store.forget_reads()

    def observed_forward(self, size: int, *, uncaptured: bool) -> Any:
        """One forward on the static buffers at ``size``, its input writes and output
        layout observed (:class:`~graphguard.buffers.InputWrites`, ``OutputLayout``)."""
        store = self.parts.store
        token = store.writes.before(contents=uncaptured)
        out = self.parts.forward(*self.parts.static.views(size))
        store.writes.after(token)
        store.layout.observe(size, out)
        return out

    def warmup_forward(self, size: int) -> None:
        out = self.observed_forward(size, uncaptured=True)
        check_output_leaves(flatten(out)[0], f"{self.parts.label} (warmup at size {size})")

    def capture_forward(self, size: int) -> Callable[[], Any]:
        """The forward a capture of ``size`` records, watched like a warmup's (the CPU
        emulation's replays re-run it unwatched)."""
        views = self.parts.static.views(size)
        self.parts.reads.before_capture()  # after the warmups, before the capture begins
        forward = self.parts.forward

        def observed() -> Any:
            if phase.is_capturing():
                return self.observed_forward(size, uncaptured=False)
            return forward(*views)

        return observed

    def probe_layout(self, sizes: Sequence[int]) -> None:
        """The last ``before_capture`` hook: :meth:`OutputLayout.probe`, each forward
        synchronized like a warmup (up front, it is one: ``CapturePlan.hook_warmed``). A
        lazy stage with ``output_batch_dims`` declared runs none, or the largest size's
        alone when ``workspaces`` or a compile need a forward before the arenas lock."""
        p = self.parts
        backend = self.backend()
        ran: set[int] = set()  # sizes whose forward ran to its synchronize
        failed: list[tuple[int, Exception]] = []

        def forward(size: int) -> Any:
            try:
                out = self.observed_forward(size, uncaptured=True)
            except Exception as exc:
                failed.append((size, exc))
                raise
            backend.synchronize()
            ran.add(size)
            return out

        layout, lazy = p.store.layout, p.options.lazy
        stage = lazy is not None and not p.store.serving
        if lazy is not None and not lazy.warm_shapes and layout.declared is not None:
            # Declared: nothing to learn. A forward at the largest size only where the
            # stage must size arenas or compile; otherwise a size's first call warms it.
            needed = bool(p.options.workspaces or p.kind.hooks()) or p.kind.compiled
            layout.reset()
            layout.run(sorted(sizes)[-1:] if needed else [], forward)
        else:
            layout.probe(sizes, forward)
        skip = p.options.on_capture_error == "skip"
        if stage and failed:  # the stage's forward is the only one capture() runs
            stage_failed(p.label, *failed[0], skip=skip)
        if lazy is not None and lazy.warm_shapes and stage:
            ran |= self._warm_shapes(sizes, backend, skip)
            for size in (ran & set(sizes)) - set(lazy.capture_now):
                p.warmed[size] = False  # warmed by the stage, not watched
        self.probed = frozenset(ran)
        p.static.reset()

    def _warm_shapes(self, sizes: Sequence[int], backend: GraphBackend, skip: bool) -> set[int]:
        """Each shape's first-run work at the stage (the two largest ran in the probe),
        each forward that size's first warmup iteration at its lazy capture (of a
        capture_now size: at the stage's capture, CapturePlan.hook_warmed)."""
        ran: set[int] = set()
        for size in sorted(set(sizes) - set(sorted(sizes)[-2:]), reverse=True):
            try:
                self.warmup_forward(size)
            except Exception as exc:
                stage_failed(self.parts.label, size, exc, skip=skip)
                continue
            backend.synchronize()
            ran.add(size)
        return ran

    # ------------------------------------------------------------------ capture runs

    def capture_ladder(self, miss: Miss) -> CaptureReport:
        """``capture()``'s run (the guard held, nothing captured): what the miss policy
        captures up front (the whole ladder, or a lazy runner's stage), on the fill values
        (a batch left in the buffers would make the hooks' and warmups' writes land
        outside the state the fills name)."""
        p = self.parts
        p.store.begin_capture()
        plan = self.plan()
        self.autocast = AutocastPolicy.current()
        p.static.reset()
        return miss.capture_up_front(plan, self.run_plan)

    def run_plan(
        self, plan: lifecycle.CapturePlan, how: str = UP_FRONT, pool: Any = None, **run: Any
    ) -> CaptureReport:
        """Run ``plan`` into ``pool``, else the ladder's (``run``: :func:`graphguard.capture.run`'s
        keywords); then, whatever happens (the sizes that captured serve), record it in the
        store: a record for each size kept, the failed sizes refused, the entries rebuilt."""
        p = self.parts
        backend, store = self.backend(), p.store
        ladder_pool, new = store.pool_for(backend)
        if new:
            # A partial recapture re-enters the capture's grad mode (tensors it made then
            # may be inference tensors; dynamo guards on the mode).
            self.grad_mode = (torch.is_inference_mode_enabled(), torch.is_grad_enabled())
        pool = ladder_pool if pool is None else pool
        read = p.reads.provenance.decide(backend.reads_graphs, backend.name)
        plan = dataclasses.replace(plan, read_args=read)
        report: CaptureReport | None = None
        ok = False
        try:
            with p.guard.capturing(), self._hold_rnn_states(backend):
                report = lifecycle.run(plan, backend, pool=pool, **run)
            ok = True
            return report
        except GraphCaptureError as exc:
            report = exc.report  # the sizes before the failing one were kept
            raise
        finally:
            t = time.perf_counter()
            store.reap()  # the graphs this run replaced: the pool has its new ones now
            if report is not None:
                self.last = report
                kept = any(s.ok for s in report.sizes)
                weights = p.reads.record_weights() if kept else None
                store.record_run(report, how, weights, read=bool(read))
            p.rebuild(plan.sizes[0] if how == LAZILY and ok else None)
            if report is not None:
                report.tick("bookkeeping", t)
            store.after_run(ok)

    def capture_sizes(
        self, sizes: Sequence[int], how: str, pool: Any = None, waited: float = 0.0
    ) -> CaptureReport:
        """Capture ``sizes`` with the whole per-size lifecycle into ``pool`` (None: the
        ladder's; PIECEWISE pieces captured alone go into a pool of their own, nothing
        retired), on the fill values, under the capture's grad mode and autocast policy
        (lazy: ``lazy_plan``). ``waited``: seconds spent waiting for another thread."""
        p = self.parts
        store = p.store
        if how == LAZILY and (not store.serving or set(sizes) <= set(store.held())):
            # Released, or captured by the call this one waited for: nothing to do.
            return CaptureReport(mode=p.mode.value, backend=self.backend().name)
        t0 = time.perf_counter()
        plan = self.plan()
        if how == LAZILY:
            (size,) = sizes
            plan = lazy_plan(plan, size, p.warmed)
            run: dict[str, Any] = {"hook_sizes": p.sizes, "log": False}
        else:
            store.retire(sizes if pool is None else ())
            plan, run = dataclasses.replace(plan, sizes=sorted(sizes, reverse=True)), {}
        t1 = time.perf_counter()
        self.backend().synchronize()  # what the last serving step left runs out
        t2 = time.perf_counter()
        p.static.reset()
        store.refill_next()
        before = {"wait": waited, "plan": t1 - t0, "sync": t2 - t1}
        before["reset"] = time.perf_counter() - t2
        try:
            with self.capture_mode(), applied(self.autocast):
                return self.run_plan(plan, how, pool, **run)
        finally:
            if self.last is not None:
                self.last.phases.update(before)

    def again(self, sizes: Sequence[int], *, alone: bool) -> CaptureReport:
        """Capture ``sizes`` again (:class:`~graphguard.ladder.kind.PieceCapture`): alone,
        into a fresh pool of this call; else into the ladder's, their graphs replaced."""
        pool = self.backend().new_pool() if alone else None
        return self.capture_sizes(sizes, UP_FRONT, pool)

    def capture_pieces(self, graphs: dict[int, set[int]]) -> CaptureReport:
        """Capture again only the pieces ``graphs[size]`` of each size (the kind's
        :meth:`~graphguard.ladder.kind.GraphKind.capture_pieces`)."""
        p = self.parts
        with p.guard.exclusive("capture_pieces()"):
            total = len(p.store.graphs.graph_keys())
            report = p.kind.capture_pieces(graphs, self.again, p.guard)
        report.graphs_total = total
        return report

    def recapture_moved(self, found: WeightCheck, reason: str) -> CaptureReport | None:
        """Capture again the graphs that read a moved storage, into the same pool with
        the whole lifecycle; the others keep serving. Sizes whole, or with per-graph reads
        on a PIECEWISE runner only the pieces that read it (:meth:`capture_pieces`).
        Returns the report (``recaptured_graphs`` of ``graphs_total``), or None when no
        graph reads a moved tensor (the weight records are then taken again)."""
        p = self.parts
        store = p.store
        if not found.moved or not found.sizes:
            if found.moved:
                logger.info(
                    "%s: %d tensors moved, but no graph reads them", p.name, len(found.moved)
                )
            store.take_weights(store.held(), p.reads.weights().take())
            return None
        keys = store.graphs.graph_keys()
        why = (
            f"{reason}: {', '.join(m.name for m in found.moved[:4])}"
            + (f" and {len(found.moved) - 4} more" if len(found.moved) > 4 else "")
            + (
                ""
                if found.reads_known
                else "; which graph reads what is not known (provenance off), so every size"
            )
        )
        # The other graphs read none of what moved (reads known): their records move on too.
        rest = [s for s in store.held() if s not in found.sizes]
        store.take_weights(rest, p.reads.weights().take())
        pieces = found.by_piece()
        if pieces is not None:
            logger.warning(
                "%s: recapturing the %d of %d piece graphs that read it, sizes %s (%s)",
                p.name,
                len(found.graphs),
                len(keys),
                list(found.sizes),
                why,
            )
            report = self.capture_pieces(pieces)
        else:
            logger.warning("%s: recapturing sizes %s (%s)", p.name, list(found.sizes), why)
            with p.guard.capturing():
                report = self.capture_sizes(found.sizes, UP_FRONT)
            redone = set(found.sizes)
            report.recaptured_graphs = [k for k in store.graphs.graph_keys() if k[0] in redone]
        report.graphs_total = len(keys)
        return report

    def _hold_rnn_states(self, backend: Any) -> contextlib.AbstractContextManager[Any]:
        """Around a CUDA capture run of a step with a cuDNN RNN running dropout: hold the
        dropout state each ``_cudnn_rnn`` call is handed, so torch re-creating its cached
        one (after any reseed) never frees memory a graph reads
        (:class:`~graphguard.rng.CudnnDropoutStates`). Nothing otherwise."""
        if backend.reads_graphs != "cuda" or not rnn_dropout_modules(self.parts.reads.module()):
            return contextlib.nullcontext()
        return CudnnDropoutStates(self.rnn_states)


__all__ = ["LadderCapture", "LadderParts"]
