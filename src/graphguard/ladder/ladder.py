"""The ladder every runner stands on: construction, capture, release, recapture, and the
serving-time surface (weights, audit, stats, the canary's table, verify).

A runner is composed of parts, each in its own file of this package:

* :class:`~graphguard.ladder.store.GraphStore`: the graphs it holds, one
  :class:`~graphguard.ladder.record.GraphRecord` per captured size, the refusals and the
  replay tables;
* :class:`~graphguard.ladder.replay.ReplayPath` (the base): what a call does;
* :class:`~graphguard.ladder.door.LadderDoor` (``runner.door``): the operations the
  serving-time features use (lazy capture, the canary, weight updates);
* this class: it builds them, runs the capture lifecycle (:mod:`graphguard.capture`) over
  the kind's plan, and answers the serving-time calls, each a few lines that ask the room
  that does the work.

A runner kind (``GraphRunner``: FULL; ``PiecewiseRunner``: PIECEWISE) supplies its graphs
(``_graph_set``), what a capture records at a size (``_body``), what it keeps of one
(``_register``) and ``_run``. Every serving-time method that synchronizes the device,
frees graphs or changes what they read runs under the capture guard
(:class:`~graphguard.serving.CaptureGuard`): refused from inside the step while a capture
is open, waited for from another thread.

Contract: outputs are views into memory the next call overwrites; a runner is not
thread-safe. Static buffers never require grad (their views are made under no_grad).
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
from graphguard.backend import Captured, CudaBackend, GraphBackend, check_backend
from graphguard.buffers import StaticInputs, flatten, make_specs
from graphguard.canary import CanaryStats, CanaryWatch, poisons_arenas
from graphguard.config import CaptureOptions, KeywordsChecked, Mode, check_flag
from graphguard.errors import ConfigError, GraphCaptureError, GraphGuardError
from graphguard.ladder.door import Floor, LadderDoor
from graphguard.ladder.miss import EagerMiss, Miss
from graphguard.ladder.moved import MovedMembers
from graphguard.ladder.reads import GraphReads
from graphguard.ladder.replay import ReplayPath
from graphguard.ladder.store import GraphSet, GraphStore
from graphguard.lazy import LazyCalls, LazyCapture, lazy_plan, stage_failed, warm_forward
from graphguard.outputs import check_output_leaves
from graphguard.provenance import Audit, Provenance
from graphguard.report import CaptureReport
from graphguard.rng import CudnnDropoutStates, rnn_dropout_modules, step_generators
from graphguard.serving import LAZILY, UP_FRONT, Agreement, CaptureGuard
from graphguard.sizes import Hook, resolve_sizes
from graphguard.state import StateSet
from graphguard.stats import ServingStats, serving_stats
from graphguard.verify import verify
from graphguard.weights.record import (
    GraphKey,
    WeightCheck,
)
from graphguard.weights.refit import RefitContext
from graphguard.weights.update import WeightUpdate, refit, update_weights

logger = logging.getLogger("graphguard")


class Ladder(ReplayPath, MovedMembers, metaclass=KeywordsChecked):
    """Base of :class:`~graphguard.GraphRunner` and :class:`~graphguard.PiecewiseRunner`
    (which document the arguments). ``options`` is resolved here into ``self.options``, read
    only as ``self.options.<field>``; ``backend`` None is a CudaBackend made on first use."""

    _allowed_modes: tuple[Mode, ...] = (Mode.FULL, Mode.NONE)
    _mode_hint = ""
    """What to use for a mode this kind does not run (the kind's error message)."""
    sanitize = False
    """Whether the sanitizer's checks are mixed in (``GraphRunner(sanitize=True)``)."""

    def __init__(
        self,
        fn: Callable[..., Any],
        example_inputs: Sequence[torch.Tensor],
        options: CaptureOptions,
        mode: Mode | str,
        backend: GraphBackend | None,
        agreement: Agreement | None = None,
    ) -> None:
        name = options.name or getattr(fn, "__qualname__", None) or type(fn).__name__
        self.options: CaptureOptions = options.resolved(name=name)
        """What this runner runs with: the caller's options, the defaults filled in."""
        self.fn = fn
        self.name: str = name
        self.label = f"{self._kind}({self.name})"
        self.mode = Mode.parse(mode)
        if self.mode not in self._allowed_modes:
            raise ConfigError(self._mode_hint)
        o = self.options
        assert o.batch_dims is not None and o.fill_values is not None  # resolved above
        self.specs = make_specs(
            example_inputs, batch_dims=o.batch_dims, fill_values=o.fill_values, names=o.names
        )
        example = int(example_inputs[0].shape[self.specs[0].batch_dim])
        self.sizes = self._ladder(resolve_sizes(o.sizes, o.max_size, example))
        self.state: StateSet | None = StateSet.of(o.state) or None
        if backend is not None:
            check_backend(backend, self.label)
        self._backend = backend
        self.static = StaticInputs(self.specs, self.sizes[-1])
        self.report: CaptureReport | None = None
        """The last ``capture()``'s report."""
        lazy = o.lazy
        if lazy is not None:
            lazy.check_sizes(self.label, self.sizes)
        self._guard = CaptureGuard(self.label)
        self._store = GraphStore(
            self.label,
            self._graph_set(),
            self.static,
            ladder=self.sizes,
            lazy=lazy is not None,
            budget=lazy.budget if lazy is not None else None,
            # No warmup: only version counters see input writes; refill padded rows always.
            refill_always=o.warmup_iters == 0,
            output_dims=o.output_batch_dims,
        )
        self.door = LadderDoor(
            self.label,
            self._store,
            self._guard,
            Floor(
                capture=self._capture_some,
                recapture_moved=self._recapture_moved,
                run=self._refill_and_run,
                detached=self._copy_failed,
                eager=self.eager,
                generators=self._generators,
                weights=lambda: self._reads.room(),
                check_weights=self._check_weights,
                derived_reads=lambda: self._reads.derived(),
                refit_reads=lambda: self._reads.refit_reads(),
                taken=lambda size: self._reads.taken(size),
                backend=self._capture_backend,
                compiled=self._runs_compiled,
                rebuild=self._rebuild,
                warm=self._warm_forward,
            ),
            specs=self.specs,
            static=self.static,
            state=self.state,
        )
        """The operations the serving-time features use (:class:`graphguard.serving.Door`):
        the extension point for an engine's own serving-time feature."""
        self._canary = (
            CanaryWatch(self.door, o.canary, self.sanitize, agreement)
            if o.canary is not None
            else None
        )
        eager = EagerMiss(self.name, self.mode, self.sizes, self._store, self.eager)
        calls = LazyCalls(self._guard, self.__call__, self.replay, eager.call)
        judge = self._canary.judge if self._canary is not None else None
        self._lazy = None if lazy is None else LazyCapture.of(self.door, agreement, calls, o, judge)
        miss: Miss = eager if self._lazy is None or self.mode is Mode.NONE else self._lazy
        # What each graph reads; the sanitizer refuses a graph over memory no one owns.
        self._reads = GraphReads(
            self.label,
            self._store,
            Provenance(self.label, o.provenance, strict=self.sanitize, device=self.specs[0].device),
            fn=fn,
            weights=o.weights,
            state=self.state,
            static=[(s.name, b) for s, b in zip(self.specs, self.static.buffers)],
            arenas=o.workspaces or (),
        )
        self._start_replay_path(self._store, self._canary, miss, self._run)
        self._reset_capture_state()

    def _reset_capture_state(self) -> None:
        """What one capture (up front) establishes and ``release()`` forgets."""
        self._generator_list: list[tuple[str, torch.Generator]] | None = None
        self._autocast: AutocastPolicy | None = None  # the graphs' (eager runs under it)
        self._grad_mode = (False, False)
        if self._lazy is not None:
            self._lazy.forget()  # a new stage warms again
        self._probed: frozenset[int] = frozenset()  # the layout probe's, in this run
        self._last: CaptureReport | None = None  # the last capture run's report
        self._rnn_states: dict[int, torch.Tensor] = {}
        """cuDNN dropout states the graphs took, held (rng.CudnnDropoutStates)."""

    # ------------------------------------------------------------------ the kind

    def _ladder(self, sizes: tuple[int, ...]) -> tuple[int, ...]:
        """The ladder this kind captures, from the resolved ``sizes`` (GraphRunner with
        ``compile=True`` pads batch 1 to 2)."""
        return sizes

    def _graph_set(self) -> GraphSet:
        """This kind's graphs (made once, at construction)."""
        raise NotImplementedError

    def _body(self, size: int, forward: Callable[[], Any]) -> Callable[[], Any]:
        """What a capture at ``size`` records, around ``forward`` (the observed forward)."""
        raise NotImplementedError

    def _register(self, size: int, captured: Captured) -> None:
        """Keep a capture of ``size`` (after :meth:`_prove` for a FULL graph)."""
        raise NotImplementedError

    def _forward(self, *views: torch.Tensor) -> Any:
        """The forward warmups and captures run (a compiled step's, for those kinds)."""
        return self.fn(*views)

    def _watch(self) -> Any:
        """The callable whose first warmup is watched for undeclared state writes (None:
        not watched: declared state, or a step the watch cannot run under)."""
        return self.fn if self.options.state is None else None

    def _kind_hooks(self) -> list[Hook]:
        """``before_capture`` hooks this kind runs before the user's (a compile)."""
        return []

    def _runs_compiled(self) -> bool:
        """Whether warmups and captures run compiled code (Inductor may fold weights)."""
        return False

    def _capture_backend(self) -> GraphBackend:
        """The backend the lifecycle captures with (PIECEWISE wraps the device's)."""
        return self.backend

    def _extra_reads(self) -> dict[GraphKey, set[int]]:
        """Storage addresses graphs are known to read without provenance (the sanitizer's
        tracked storages, the pieces' in-place inputs), per graph."""
        return {}

    # ------------------------------------------------------------------ state

    @property
    def backend(self) -> GraphBackend:
        """The device backend (created on first use: a CudaBackend on the inputs' device)."""
        if self._backend is None:
            dev = self.specs[0].device
            if dev.type != "cuda":
                raise ConfigError(
                    f"{self.name}: CUDA graphs need CUDA tensors, but the example inputs are on "
                    f"{dev}. Use mode='none' to run eagerly through the same API, or "
                    "backend=graphguard.RecordingBackend() to emulate capture on the CPU."
                )
            self._backend = made = CudaBackend(dev)
            return made
        return self._backend

    @property
    def serving(self) -> bool:
        """``capture()`` ran (graphs, or a lazy runner's stage) and ``release()`` did not."""
        return self._store.serving

    @property
    def lazy(self) -> bool:
        """Whether sizes are captured on first use (``lazy=``, :mod:`graphguard.lazy`)."""
        return self._lazy is not None

    def eager(self, *inputs: Any) -> Any:
        """The plain ``fn`` on the caller's tensors, under the graphs' autocast policy: no
        padding, no graph, never the compiled code (a batch above the ladder must not cost
        a recompile on tensors unlike the static buffers)."""
        with applied(self._autocast):
            return self.fn(*inputs)

    def _generators(self) -> list[tuple[str, torch.Generator]]:
        """``(name, generator)`` the graphs register and restore (:mod:`graphguard.rng`):
        found by walking the callable at ``capture()`` (a walk over a large model takes
        milliseconds) and kept for the lazy captures and canary checks after it; a
        generator the step starts drawing from later is not registered, and the capture
        that meets it fails (that size runs eagerly): pass it in ``generators=``."""
        if self._generator_list is None or not self._store.serving:
            self._generator_list = step_generators(
                self.fn, self.options.generators or (), self.specs[0].device
            )
        return self._generator_list

    def _rebuild(self, added: int | None = None) -> None:
        """Rebuild the replay path's entries (:meth:`GraphStore.rebuild
        <graphguard.ladder.store.GraphStore.rebuild>`), and arm the canary on them."""
        entries = self._store.rebuild(added)
        if self._canary is not None:
            self._canary.arm(entries)

    def _warm_forward(self, size: int) -> tuple[Any, list[str] | None]:
        """The door's warm forward (:func:`graphguard.lazy.warm_forward`) at ``size``."""
        arenas = [ws.buffer for ws in self.options.workspaces or () if ws.buffer is not None]
        return warm_forward(
            self.label,
            lambda: self._observed_forward(size, uncaptured=True),
            modes=(*self._grad_mode, self._autocast),
            watch=self._watch(),
            scratch=[*self.static.buffers, *arenas],
        )

    # ------------------------------------------------------------------ the plan

    def _plan(self) -> lifecycle.CapturePlan:
        """This runner's capture plan: the kind's body and register around the ladder's
        forwards, the options' fields, the layout probe as the last hook."""
        o = self.options
        return lifecycle.CapturePlan(
            name=self.label,
            sizes=sorted(self.sizes, reverse=True),
            warmup=self._warmup_forward,
            body=lambda size: self._body(size, self._capture_forward(size)),
            register=self._register,
            warmup_iters=o.warmup_iters if o.warmup_iters is not None else 1,
            before_capture=[*self._kind_hooks(), *(o.before_capture or ()), self._probe_layout],
            # The probe's forwards as first warmups (lazily: only through warm_shapes).
            hook_warmed=(lambda: self._probed) if o.lazy is None or o.lazy.warm_shapes else None,
            after_capture=list(o.after_capture or ()),
            workspaces=list(o.workspaces or ()),
            capture_error_mode=o.capture_error_mode or "global",
            on_capture_error=o.on_capture_error or "raise",
            progress=bool(o.progress),
            mode=self.mode,
            state=self.state,
            discard=self._discard,
            static_inputs=self.static.buffers,
            # Declared state (even state=[]) means the user knows: no write watch.
            watch=self._watch(),
            generators=self._generators(),
            # NaN in the arenas at their lock; a lazy runner locks them at its stage, and
            # its later captures (serving already) never poison.
            poison_arenas=poisons_arenas(o.canary, self.sanitize)
            and not (self._lazy is not None and self._store.serving),
        )

    def _discard(self, sizes: Sequence[int]) -> None:
        """Drop the graphs an aborted run captured (the lifecycle calls it)."""
        self._store.retire(sizes)
        self._store.unstage()

    def _observed_forward(self, size: int, *, uncaptured: bool) -> Any:
        """One forward on the static buffers at ``size``, its input writes and output
        layout observed (:class:`~graphguard.buffers.InputWrites`, ``OutputLayout``)."""
        store = self._store
        token = store.writes.before(contents=uncaptured)
        out = self._forward(*self.static.views(size))
        store.writes.after(token)
        store.layout.observe(size, out)
        return out

    def _warmup_forward(self, size: int) -> None:
        out = self._observed_forward(size, uncaptured=True)
        check_output_leaves(flatten(out)[0], f"{self.label} (warmup at size {size})")

    def _capture_forward(self, size: int) -> Callable[[], Any]:
        """The forward a capture of ``size`` records, watched like a warmup's (the CPU
        emulation's replays re-run it unwatched)."""
        views = self.static.views(size)
        self._reads.before_capture()  # after the warmups, before the capture begins

        def forward() -> Any:
            if phase.is_capturing():
                return self._observed_forward(size, uncaptured=False)
            return self._forward(*views)

        return forward

    def _probe_layout(self, sizes: Sequence[int]) -> None:
        """The last ``before_capture`` hook: :meth:`OutputLayout.probe`, each forward
        synchronized like a warmup (up front, it is one: ``CapturePlan.hook_warmed``). A
        lazy stage with ``output_batch_dims`` declared runs none, or the largest size's
        alone when ``workspaces`` or a compile need a forward before the arenas lock."""
        backend = self._capture_backend()
        ran: set[int] = set()  # sizes whose forward ran to its synchronize
        failed: list[tuple[int, Exception]] = []

        def forward(size: int) -> Any:
            try:
                out = self._observed_forward(size, uncaptured=True)
            except Exception as exc:
                failed.append((size, exc))
                raise
            backend.synchronize()
            ran.add(size)
            return out

        layout, lazy = self._store.layout, self.options.lazy
        stage = lazy is not None and not self._store.serving
        if lazy is not None and not lazy.warm_shapes and layout.declared is not None:
            # Declared: nothing to learn. A forward at the largest size only where the
            # stage must size arenas or compile; otherwise a size's first call warms it.
            needed = bool(self.options.workspaces or self._kind_hooks()) or self._runs_compiled()
            layout.reset()
            layout.run(sorted(sizes)[-1:] if needed else [], forward)
        else:
            layout.probe(sizes, forward)
        skip = self.options.on_capture_error == "skip"
        if stage and failed:  # the stage's forward is the only one capture() runs
            stage_failed(self.label, *failed[0], skip=skip)
        if lazy is not None and lazy.warm_shapes and stage:
            # Each shape's first-run work at the stage (the two largest ran in the probe),
            # each forward that size's first warmup iteration at its lazy capture (of a
            # capture_now size: at the stage's capture, CapturePlan.hook_warmed).
            for size in sorted(set(sizes) - set(sorted(sizes)[-2:]), reverse=True):
                try:
                    self._warmup_forward(size)
                except Exception as exc:
                    stage_failed(self.label, size, exc, skip=skip)
                    continue
                backend.synchronize()
                ran.add(size)
            if self._lazy is not None:
                self._lazy.stage_warmed((ran & set(sizes)) - set(lazy.capture_now))
        self._probed = frozenset(ran)
        self.static.reset()

    def _prove(
        self, size: int, piece: int | None, captured: Captured, outputs: Sequence[Any]
    ) -> None:
        """Stage what a just-captured graph reads (:meth:`GraphReads.prove
        <graphguard.ladder.reads.GraphReads.prove>`)."""
        self._reads.prove(size, piece, captured, outputs)

    # ------------------------------------------------------------------ capture

    def capture(self) -> CaptureReport:
        """Run the capture lifecycle (:mod:`graphguard.capture`) and return its report.

        A :class:`GraphCaptureError` (``on_capture_error="raise"``) keeps every size that
        did capture; one that kept no graph (a hook raised, an interrupt) may be retried.
        A lazy runner (``lazy=``) runs the before-capture stage and its ``capture_now``
        sizes here, and the other sizes on first use.
        """
        with self._guard.exclusive("capture()"):
            store = self._store
            if store.held():
                raise GraphGuardError(
                    f"{self.name}: already captured {list(self.captured_sizes)}; call "
                    "recapture(reason=...) to drop the graphs and capture again on purpose"
                )
            if self.mode is Mode.NONE:
                store.serving = True
                self.report = CaptureReport(mode=self.mode.value, backend="none")
                logger.info("%s: mode none, every call runs eagerly", self.name)
                return self.report
            store.refusals.clear()
            plan, lazy = self._plan(), self.options.lazy
            self._autocast = AutocastPolicy.current()
            store.released = False
            # The fill values, not a batch an earlier capture's calls left in the buffers:
            # the hooks' and warmups' writes stay inside the state the fills name.
            self.static.reset()
            store.dirty = self.static.max_size
            if lazy is None:
                self.report = self._run_plan(plan)
            else:  # the before-capture stage over the whole ladder, and capture_now
                now = sorted(lazy.capture_now, reverse=True)
                staged = dataclasses.replace(plan, sizes=now)
                self.report = self._run_plan(staged, hook_sizes=plan.sizes, stage=True)
                if self._lazy is not None:
                    self._lazy.keep_within_budget(self.report)
            if self._canary is not None:
                self._canary.judge(self.report, self.options.state, fresh=True)
            return self.report

    def _run_plan(
        self, plan: lifecycle.CapturePlan, how: str = UP_FRONT, pool: Any = None, **run: Any
    ) -> CaptureReport:
        """Run ``plan`` into ``pool``, else the ladder's (``run``: :func:`graphguard.capture.run`'s
        keywords); then, whatever happens (the sizes that captured serve), settle the
        store: a record for each size kept, the failed sizes refused, the entries rebuilt."""
        backend, store = self._capture_backend(), self._store
        if store.pool is None:
            store.pool = backend.new_pool()
            # A partial recapture re-enters the capture's grad mode (tensors it made then
            # may be inference tensors; dynamo guards on the mode).
            self._grad_mode = (torch.is_inference_mode_enabled(), torch.is_grad_enabled())
        pool = store.pool if pool is None else pool
        read = self._reads.provenance.decide(backend.reads_graphs, backend.name)
        plan = dataclasses.replace(plan, read_args=read)
        report: CaptureReport | None = None
        ok = False
        try:
            with self._guard.capturing(), self._hold_rnn_states(backend):
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
                self._last = report
                kept = any(s.ok for s in report.sizes)
                store.settle(report, how, self._reads.take() if kept else None, read=bool(read))
            self._rebuild(plan.sizes[0] if how == LAZILY and ok else None)
            if report is not None:
                report.tick("bookkeeping", t)
            # A lazy capture that failed leaves the runner serving (the stage ran).
            store.serving = ok or bool(store.held()) or (store.lazy and store.serving)

    def _capture_some(self, sizes: Sequence[int], how: str, waited: float = 0.0) -> CaptureReport:
        """The door's capture (its guard held): ``sizes`` with the whole per-size
        lifecycle, on the fill values (a batch left in the buffers would make the warmups
        write state rows it names), under the capture's grad mode and autocast policy
        (lazy: ``lazy_plan``). ``waited``: seconds spent waiting for another thread."""
        return self._capture_into(sizes, how, None, waited)

    def _capture_into(
        self, sizes: Sequence[int], how: str, pool: Any, waited: float = 0.0
    ) -> CaptureReport:
        """:meth:`_capture_some` into ``pool`` (None: the ladder's; PIECEWISE pieces
        captured alone go into a pool of their own, nothing retired)."""
        store = self._store
        if how == LAZILY and (not store.serving or set(sizes) <= set(store.held())):
            # Released, or captured by the call this one waited for: nothing to do.
            return CaptureReport(mode=self.mode.value, backend=self._capture_backend().name)
        t0 = time.perf_counter()
        plan = self._plan()
        if how == LAZILY:
            (size,) = sizes
            plan = lazy_plan(plan, size, self._lazy.warmed if self._lazy is not None else {})
            run: dict[str, Any] = {"hook_sizes": self.sizes, "log": False}
        else:
            store.retire(sizes if pool is None else ())
            plan, run = dataclasses.replace(plan, sizes=sorted(sizes, reverse=True)), {}
        t1 = time.perf_counter()
        self._capture_backend().synchronize()  # what the last serving step left runs out
        t2 = time.perf_counter()
        self.static.reset()
        store.dirty = self.static.max_size
        before = {"wait": waited, "plan": t1 - t0, "sync": t2 - t1}
        before["reset"] = time.perf_counter() - t2
        try:
            with self._capture_mode(), applied(self._autocast):
                return self._run_plan(plan, how, pool, **run)
        finally:
            if self._last is not None:
                self._last.phases.update(before)

    def _hold_rnn_states(self, backend: Any) -> contextlib.AbstractContextManager[Any]:
        """Around a CUDA capture run of a step with a cuDNN RNN running dropout: hold the
        dropout state each ``_cudnn_rnn`` call is handed, so torch re-creating its cached
        one (after any reseed) never frees memory a graph reads
        (:class:`~graphguard.rng.CudnnDropoutStates`). Nothing otherwise."""
        if backend.reads_graphs != "cuda" or not rnn_dropout_modules(self._reads.module()):
            return contextlib.nullcontext()
        return CudnnDropoutStates(self._rnn_states)

    def release(self) -> None:
        """Drop every graph and hand its pool memory back; calls fail until capture().
        Outputs still held are non-owning views into the pool and may then point at freed
        memory: clone what must outlive the graphs."""
        with self._guard.exclusive("release()"):
            self._release()

    def _release(self) -> None:
        store = self._store
        had_graphs = bool(store.held())
        if self._backend is not None and had_graphs:
            self._backend.synchronize()
        serving = store.serving and self.mode is not Mode.NONE
        store.release()
        store.released = had_graphs or serving or store.released
        self._reset_capture_state()
        if self._backend is not None and had_graphs:
            self._backend.empty_cache()

    def recapture(self, *, reason: str, only_moved: bool = False) -> CaptureReport:
        """Drop every graph, unlock the arenas on purpose, and capture again (weights
        reloaded, a config changed); ``reason`` is required and logged, so it never happens
        by accident. It also retries the sizes whose capture failed or was refused.
        ``only_moved=True``: only the graphs that read a moved parameter or buffer
        (:meth:`check_weights`), into the same pool, arenas still locked; with provenance
        a PIECEWISE runner recaptures only the pieces that read it. The report lists those
        sizes (none: nothing moved), and counts the graphs redone (``recaptured_graphs``
        of ``graphs_total``)."""
        check_flag("only_moved", only_moved)
        if only_moved:
            check_reason(reason)
            with self._guard.exclusive("recapture()"):
                partial = self._recapture_moved(self._check_weights(), reason)
            return partial or CaptureReport(mode=self.mode.value, backend="none")
        with self._capture_mode():  # from any thread: the graphs' mode, not the caller's
            start_over(self, reason)
            return self.capture()

    def _recapture_moved(self, found: WeightCheck, reason: str) -> CaptureReport | None:
        """Capture again the graphs that read a moved storage, into the same pool with
        the whole lifecycle; the others keep serving. Sizes whole, or with per-graph reads
        on a PIECEWISE runner only the pieces that read it (:meth:`_capture_pieces`).
        Returns the report (``recaptured_graphs`` of ``graphs_total``), or None when no
        graph reads a moved tensor (the weight records are then taken again)."""
        store = self._store
        if not found.moved or not found.sizes:
            if found.moved:
                logger.info(
                    "%s: %d tensors moved, but no graph reads them", self.name, len(found.moved)
                )
            store.take_weights(store.held(), self._reads.room().take())
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
        store.take_weights(rest, self._reads.room().take())
        pieces = found.by_piece()
        if pieces is not None:
            logger.warning(
                "%s: recapturing the %d of %d piece graphs that read it, sizes %s (%s)",
                self.name,
                len(found.graphs),
                len(keys),
                list(found.sizes),
                why,
            )
            report = self._capture_pieces(pieces)
        else:
            logger.warning("%s: recapturing sizes %s (%s)", self.name, list(found.sizes), why)
            with self._guard.capturing():
                report = self._capture_some(found.sizes, UP_FRONT)
            redone = set(found.sizes)
            report.recaptured_graphs = [k for k in store.graphs.graph_keys() if k[0] in redone]
        report.graphs_total = len(keys)
        return report

    def _capture_pieces(self, graphs: dict[int, set[int]]) -> CaptureReport:
        """Capture again only the pieces ``graphs[size]`` of each size (PIECEWISE)."""
        raise GraphGuardError(f"{self.label}: this runner has no pieces to capture alone")

    # ------------------------------------------------------------------ weights

    def update_weights(
        self,
        source: Any,
        *,
        on_moved: str = "raise",
        strict: bool = True,
        refresh: Callable[[], Any] | None = None,
    ) -> WeightUpdate:
        """Load new weights (a state dict, a module alike, or a loader) into the captured
        storages in place, all or nothing, then :meth:`check_weights`; ``on_moved`` is
        ``"raise"`` or ``"recapture"``. ``refresh``: called after the copy to re-derive the
        tensors graphs read that no module lists (provenance's "derived" reads); an update
        that would leave such tensors stale is refused without it. ``.refit`` of the
        result: :meth:`refit`'s verdict. See :func:`graphguard.weights.update_weights`."""
        return update_weights(
            [self.door], source, on_moved=on_moved, strict=strict, refresh=refresh
        )

    def refit(
        self,
        *,
        expect: Sequence[str] | None = None,
        strict: bool = True,
        on_moved: str = "raise",
        refresh: Callable[[], Any] | None = None,
    ) -> RefitContext:
        """``with runner.refit() as r: my_loader(model)``: on exit every tensor the graphs
        read is classified (``r.verdict``: moved, derived, written, not written); a graph-read
        weight among ``expect`` (default: every parameter) the loader did not write raises
        ``StaleWeightsError`` naming the graphs unless ``strict=False``; a moved one raises
        or is recaptured (``on_moved``). See :func:`graphguard.weights.update.refit`."""
        return refit([self.door], expect=expect, strict=strict, on_moved=on_moved, refresh=refresh)

    def check_weights(self) -> WeightCheck:
        """Prove without replaying that every parameter and buffer each graph read at its
        capture is still the live tensor at the address, shape, stride and dtype that
        graph recorded (a ``WeightCheck``: true when nothing moved, ``.moved`` names each
        one with the sizes that read it; ``.raise_if_moved()``)."""
        with self._guard.exclusive("check_weights()"):
            return self._check_weights()

    def _check_weights(self) -> WeightCheck:
        return self._reads.check(self._extra_reads(), none=self.mode is Mode.NONE)

    # ------------------------------------------------------------------ serving surface

    def audit(self) -> Audit:
        """What each graph (size; each piece) reads, by owner name and kind, and the words
        no owner explains: unknown (live, unnamed) and unowned (freed), with the kernel
        that took each; named reads whose owner moved since, and unnamed allocations a
        graph took that the allocator has freed since (CUDA), are listed as stale
        (:class:`~graphguard.provenance.Audit`; ``print(runner.audit())`` for the table).
        Each rank of a tensor-parallel group audits its own graphs (no collective)."""
        with self._guard.exclusive("audit()"):
            return self._reads.audit(self._capture_backend().reads_graphs, self.specs[0].device)

    def stats(self) -> ServingStats:
        """Per size and in total: replays, eager calls and why, how and when each size was
        captured, graph memory against the budget, and the warnings so far
        (:mod:`graphguard.stats`; ``print(runner.stats())`` for the table)."""
        store = self._store
        return serving_stats(
            self.label,
            self.sizes,
            lazy=store.lazy,
            serving=store.serving,
            captured=store.records,
            refused=store.refusals,
            counters=store.counters,
            ledger=store.ledger,
            entries=store.entries,
            warmed=self._lazy.warmed if self._lazy is not None else (),
            evicted=store.evicted,
        )

    def canary_stats(self) -> dict[int, CanaryStats]:
        """Per captured size, what the canary saw (checks, divergences, the last report,
        whether it is served eagerly); ``{}`` without ``canary=`` (:mod:`graphguard.canary`)."""
        return self._canary.stats_table() if self._canary is not None else {}

    def verify(self, **kwargs: Any) -> Any:
        """Replay every captured size on fresh inputs and compare with eager
        (:func:`graphguard.verify`), under the grad and inference mode the graphs were
        captured in (they are per thread: a monitor thread's differ from the serving
        thread's). It replays the runner, so from another thread during a lazy capture it
        is refused as a second caller (``docs/serving.md``)."""
        if self._lazy is not None:
            self._lazy.check_alone()
        with self._guard.exclusive("verify()"), self._capture_mode():
            return verify(self, **kwargs)

    @contextlib.contextmanager
    def _capture_mode(self) -> Iterator[None]:
        """The grad and inference mode of the capture (they are per thread), for work on
        the graphs' tensors from any thread; the caller's own before any capture."""
        if not self._store.serving or self.mode is Mode.NONE:
            yield
            return
        inference, grad = self._grad_mode
        with torch.inference_mode(inference), torch.set_grad_enabled(grad):
            yield


def check_reason(reason: object) -> None:
    """A recapture is never an accident: it names why."""
    if not reason or not isinstance(reason, str):
        raise ConfigError("recapture needs a reason, e.g. recapture(reason='weights reloaded')")


def start_over(runner: Ladder, reason: str) -> None:
    """The first half of every full recapture (this runner's and a distributed one's):
    drop every graph and unlock the arenas on purpose, logged with ``reason``."""
    check_reason(reason)
    with runner.door.exclusive("recapture()"):
        logger.warning("%s: recapturing (%s)", runner.name, reason)
        runner.release()
        for ws in runner.options.workspaces or ():
            ws.unlock(reason=reason)


__all__ = ["Ladder", "check_reason", "start_over"]
