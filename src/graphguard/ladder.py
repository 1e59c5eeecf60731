"""The ladder both runners stand on: static inputs, padding table, per-size entries, replay.

What ``GraphRunner`` (FULL) and ``PiecewiseRunner`` (PIECEWISE) share: ``__call__`` over
one :class:`~graphguard.entries.Entry` per batch size, the zero-copy path, the slow path
(errors, eager fallback), capture and release. A subclass supplies the capture plan
(``_plan``), what an entry replays (``_entry_parts``) and ``_run``. The replay path is
:class:`~graphguard.replay.ReplayPath` (the base); the serving-time surface (weights,
stats, verify, recapture) is :class:`~graphguard.served.Served` (the subclass). The
serving-time features (lazy capture, the canary, weights, stats) are built here and
reach the ladder only as a :class:`~graphguard.serving.Door`, which it implements.

Contract: outputs are views into memory the next call overwrites; a runner is not
thread-safe. Static buffers never require grad (their views are made under no_grad).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from graphguard import _graph_args
from graphguard import capture as lifecycle
from graphguard.autocast import AutocastPolicy, applied
from graphguard.backend import CudaBackend, GraphBackend, free_graph
from graphguard.buffers import (
    InputSpec,
    InputWrites,
    StaticInputs,
    flatten,
    make_specs,
)
from graphguard.canary import CanaryWatch, poisons_arenas
from graphguard.config import CaptureOptions, KeywordsChecked, Mode
from graphguard.entries import Entry
from graphguard.errors import ConfigError, GraphCaptureError, GraphGuardError
from graphguard.lazy import LazyCapture, lazy_plan
from graphguard.ledger import GraphLedger
from graphguard.outputs import OutputLayout, check_output_leaves
from graphguard.provenance import Provenance
from graphguard.replay import ReplayPath
from graphguard.report import CaptureReport
from graphguard.rng import step_generators
from graphguard.serving import LAZILY, UP_FRONT, Agreement, CaptureGuard
from graphguard.sizes import PaddingTable, resolve_sizes
from graphguard.state import StateSet
from graphguard.stats import ServingCounters
from graphguard.weights.record import Weights, find_module

logger = logging.getLogger("graphguard")


class Ladder(ReplayPath, metaclass=KeywordsChecked):
    """Base of :class:`~graphguard.GraphRunner` and :class:`~graphguard.PiecewiseRunner`
    (which document the arguments). ``options`` is resolved here into ``self.options``, read
    only as ``self.options.<field>``; ``backend`` None is a CudaBackend made on first use."""

    _kind = "Ladder"
    """The runner's class name in messages (``GraphRunner(decode)``)."""
    _allowed_modes: tuple[Mode, ...] = (Mode.FULL, Mode.NONE)
    _released = False  # release() dropped graphs since the last capture (for the errors)
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
            raise ConfigError(self._mode_error())
        o = self.options
        assert o.batch_dims is not None and o.fill_values is not None  # resolved above
        self.specs: list[InputSpec] = make_specs(
            example_inputs,
            batch_dims=o.batch_dims,
            fill_values=o.fill_values,
            names=o.names,
        )
        self.sizes = resolve_sizes(
            o.sizes, o.max_size, int(example_inputs[0].shape[self.specs[0].batch_dim])
        )
        self.state: StateSet | None = StateSet.of(o.state) or None
        self._backend = backend
        self.static = StaticInputs(self.specs, self.sizes[-1])
        self._lead_dim = self.specs[0].batch_dim
        self.report: CaptureReport | None = None
        self._eager_logged: set[int] = set()
        self._grad_logged = False
        self._weights: Weights | None = None
        self._refused: dict[int, tuple[str, str]] = {}  # size -> (status, why): one record
        self._guard = CaptureGuard(self.label)
        # The serving-time features reach this runner through its door (graphguard.serving).
        self._canary = (
            CanaryWatch(self, o.canary, self.sanitize, agreement) if o.canary is not None else None
        )
        lazy = o.lazy
        self._lazy = LazyCapture(self, self._refused, agreement) if lazy else None
        if lazy is not None:
            lazy.check_sizes(self.label, self.sizes)
        self.ledger = GraphLedger(lazy.budget if lazy is not None else None)
        """What the graphs hold on the device, pool and driver (:mod:`graphguard.ledger`)."""
        self._counters = ServingCounters(self.label)
        self._entries: list[Entry | None] = [None]
        self._retired: list[Any] = []
        self._last: CaptureReport | None = None  # the last capture run's report
        # What each graph reads; the sanitizer refuses a graph over memory no one owns.
        self._provenance = Provenance(self.label, o.provenance, strict=self.sanitize)
        self._reset_graphs()

    def _mode_error(self) -> str:
        """Why ``self.mode`` is not one this runner runs (each subclass names the right one)."""
        raise NotImplementedError

    # ------------------------------------------------------------------ state

    def _reset_graphs(self) -> None:
        self._counters.harvest(self._entries)
        self._table = PaddingTable(())
        self._pad = self._table  # what a batch pads to (lazy: sizes not captured yet too)
        self._entries = [None]
        self._written: list[int] = []
        self._generators: list[tuple[str, torch.Generator]] | None = None
        self._dirty = self.static.max_size
        # No warmup: only version counters see input writes; refill padded rows every call.
        self._refill_always = self.options.warmup_iters == 0
        self._captured = False
        self.autocast_policy: AutocastPolicy | None = None  # the graphs' (eager runs under it)
        self._pool: Any = None  # the ladder's one pool: a partial recapture goes back into it
        self._grad_mode = (False, False)
        self._layout = OutputLayout(self.label)
        self._writes = InputWrites(self.static)
        self._provenance.clear()
        self._warmed: set[int] = set()  # the stage's forwards not yet a lazy capture's warmup
        self._probed: frozenset[int] = frozenset()  # the layout probe's, in this run

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
            self._backend = CudaBackend(dev)
        return self._backend

    @property
    def serving(self) -> bool:
        """``capture()`` ran (graphs, or a lazy runner's stage) and ``release()`` did not."""
        return self._captured

    def _capture_lazily(self, n: int) -> bool:
        """Capture the size a batch of ``n`` pads to if lazy and not captured yet; whether
        it now serves. The canary judges it, and its refusal is raised as capture()'s."""
        lazy = self._lazy
        size = lazy.target(n) if lazy is not None and self._captured else None
        if size is None or lazy is None or not lazy.capture(size):
            return False
        if self._canary is not None and self._last is not None:
            self._canary.judge(self._last, self.options.state)
        return True

    # ---------------------------------------------------------------- capture

    def _plan(self) -> lifecycle.CapturePlan:
        """The capture plan of this runner (subclasses)."""
        raise NotImplementedError

    def _drop_graphs(self) -> None:
        """Forget graphs held outside the entries (subclasses; called by release)."""

    def _plan_options(self) -> dict[str, Any]:
        """The CapturePlan fields that come straight from the options."""
        o = self.options
        return {
            "name": self.label,
            "warmup_iters": o.warmup_iters,
            "before_capture": [*(o.before_capture or ()), self._probe_layout],
            # The probe's forwards as first warmups (lazily: only through warm_shapes).
            "hook_warmed": (lambda: self._probed) if self._lazy is None else None,
            "after_capture": list(o.after_capture or ()),
            "workspaces": list(o.workspaces or ()),
            "capture_error_mode": o.capture_error_mode,
            "on_capture_error": o.on_capture_error,
            "progress": o.progress,
            "mode": self.mode,
            "state": self.state,
            "discard": self._discard,
            "static_inputs": self.static.buffers,
            # Declared state (even state=[]) means the user knows: no write watch.
            "watch": self.fn if self.options.state is None else None,
            "generators": self.generators(),
            # NaN in the arenas at their lock; a lazy runner locks them at its stage, and
            # its later captures (serving already) never poison.
            "poison_arenas": poisons_arenas(o.canary, self.sanitize)
            and not (self._lazy is not None and self._captured),
        }

    def exclusive(self, what: str) -> contextlib.AbstractContextManager[None]:
        """Run a method that synchronizes the device, frees graphs or changes what they
        read outside any capture of this runner (:meth:`CaptureGuard.exclusive
        <graphguard.serving.CaptureGuard.exclusive>`: refused from inside the step,
        waited for from another thread)."""
        guard: contextlib.AbstractContextManager[None] = self._guard.exclusive(what)
        return guard

    def generators(self) -> list[tuple[str, torch.Generator]]:
        """``(name, generator)`` the graphs register and restore (:mod:`graphguard.rng`):
        found by walking the callable at ``capture()`` (a walk over a large model takes
        milliseconds) and kept for the lazy captures and canary checks after it; a
        generator the step starts drawing from later is not registered, and the capture
        that meets it fails (that size runs eagerly): pass it in ``generators=``."""
        if self._generators is None or not self._captured:
            self._generators = step_generators(
                self.fn, self.options.generators or (), self.specs[0].device
            )
        return self._generators

    def _discard(self) -> None:
        """Drop the graphs of an aborted capture (the lifecycle calls it)."""
        self._drop_graphs()
        self._reset_graphs()

    def _capture_backend(self) -> GraphBackend:
        return self.backend

    def capture(self) -> CaptureReport:
        """Run the capture lifecycle (:mod:`graphguard.capture`) and return its report.

        A :class:`GraphCaptureError` (``on_capture_error="raise"``) keeps every size that
        did capture; one that kept no graph (a hook raised, an interrupt) may be retried.
        A lazy runner (``lazy=``) runs the before-capture stage and its ``capture_now``
        sizes here, and the other sizes on first use.
        """
        with self.exclusive("capture()"):
            if self._graph_sizes():
                raise GraphGuardError(
                    f"{self.name}: already captured {list(self.captured_sizes)}; call "
                    "recapture(reason=...) to drop the graphs and capture again on purpose"
                )
            if self.mode is Mode.NONE:
                self._captured = True
                self.report = CaptureReport(mode=self.mode.value, backend="none")
                logger.info("%s: mode none, every call runs eagerly", self.name)
                return self.report
            self._refused.clear()
            plan, lazy = self._plan(), self.options.lazy
            self.autocast_policy = AutocastPolicy.current()
            self._released = False
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
        keywords); rebuild the entries and take the weight record of the sizes it
        captured whatever happens (the sizes that captured serve); count what it took,
        and record the sizes that failed."""
        backend = self._capture_backend()
        if self._pool is None:
            self._pool = backend.new_pool()
            # A partial recapture re-enters the capture's grad mode (tensors it made then
            # may be inference tensors; dynamo guards on the mode).
            self._grad_mode = (torch.is_inference_mode_enabled(), torch.is_grad_enabled())
        pool = self._pool if pool is None else pool
        report: CaptureReport | None = None
        ok = False
        try:
            read = self._provenance.decide(self.backend)
            with self._guard.capturing(), _graph_args.reading(read):
                report = lifecycle.run(plan, backend, pool=pool, **run)
            ok = True
            return report
        except GraphCaptureError as exc:
            report = exc.report  # the sizes before the failing one were kept
            raise
        finally:
            t = time.perf_counter()
            self._reap()  # the graphs this run replaced: the pool has its new ones now
            if report is not None:
                self._settle(report, how)
            added = plan.sizes[0] if how == LAZILY and ok else None
            self._build_entries(added)
            if report is not None:
                report.tick("bookkeeping", t)
            # A lazy capture that failed leaves the runner serving (the stage ran).
            self._captured = ok or bool(self._graph_sizes()) or (self.lazy and self._captured)

    def _settle(self, report: CaptureReport, how: str) -> None:
        """After a capture run: the ledger, the counters, the failed sizes, and the
        weight record of each size it captured (older graphs keep their own)."""
        self._last = report
        self.ledger.record(report.sizes)
        self._counters.captured(report, how, self._entries)
        have = set(self._graph_sizes())
        for s in report.sizes:
            if not s.ok and s.size not in have:
                self._refused[s.size] = ("failed", s.error or "")
        kept = [s.size for s in report.sizes if s.ok and s.size in have]
        if kept and isinstance(self._find_weights(), torch.nn.Module):
            self.weights.take(kept)

    # ------------------------------------------------- the door's capture half

    def capture_sizes(self, sizes: Sequence[int], *, how: str) -> CaptureReport:
        """Capture ``sizes`` into the ladder's pool with the whole per-size lifecycle
        (:meth:`graphguard.serving.Door.capture_sizes`); the other graphs keep serving."""
        t = time.perf_counter()
        with self._guard.capturing():  # from the synchronize on: no device-wide call beside
            return self._capture_sizes(sizes, how, waited=time.perf_counter() - t)

    def _capture_sizes(
        self, sizes: Sequence[int], how: str, pool: Any = None, waited: float = 0.0
    ) -> CaptureReport:
        """The door's capture: ``sizes`` with the whole per-size lifecycle, on the fill
        values (a batch left in the buffers would make the warmups write state rows it
        names), under the capture's grad mode and autocast policy (lazy: ``lazy_plan``).
        ``pool``: some pieces alone (``PiecewiseRunner.capture_pieces``), nothing retired;
        ``waited``: seconds spent waiting for another thread."""
        if how == LAZILY and (not self._captured or set(sizes) <= set(self._graph_sizes())):
            # Released, or captured by the call this one waited for: nothing to do.
            return CaptureReport(mode=self.mode.value, backend=self._capture_backend().name)
        t0 = time.perf_counter()
        before: dict[str, float] = {}
        plan = self._plan()
        if how == LAZILY:
            (size,) = sizes
            plan = lazy_plan(plan, size, self._warmed, discard=lambda: self._retire([size]))
            run: dict[str, Any] = {"hook_sizes": self.sizes, "log": False}
        else:
            self._retire(sizes if pool is None else ())
            plan, run = dataclasses.replace(plan, sizes=sorted(sizes, reverse=True)), {}
        t1 = time.perf_counter()
        self._capture_backend().synchronize()  # what the last serving step left runs out
        t2 = time.perf_counter()
        self.static.reset()
        self._dirty = self.static.max_size
        before = {"wait": waited, "plan": t1 - t0, "sync": t2 - t1}
        before["reset"] = time.perf_counter() - t2
        inference, grad = self._grad_mode
        try:
            with (
                torch.inference_mode(inference),
                torch.set_grad_enabled(grad),
                applied(self.autocast_policy),
            ):
                return self._run_plan(plan, how, pool, **run)
        finally:
            if self._last is not None:
                self._last.phases.update(before)

    def _forget_sizes(self, sizes: Sequence[int]) -> list[Any]:
        """Drop the graphs of ``sizes`` only and return them alive (subclasses)."""
        raise NotImplementedError

    def _retire(self, sizes: Sequence[int]) -> None:
        """Drop ``sizes``' graphs from serving; :meth:`_reap` destroys them. Not at once:
        a private pool whose last graph dies is freed, and the next capture into it is a
        torch internal assert (``use_count > 0``); a recapture runs while they hold it."""
        self._retired.extend(self._forget_sizes(sizes))
        self._provenance.forget(sizes)

    def _reap(self) -> None:
        """Destroy the retired graphs now (their driver memory is back); a pool left
        without graphs is forgotten, so the next capture makes a fresh one."""
        for graph in self._retired:
            free_graph(graph)
        self._retired.clear()
        if not self._graph_sizes():
            self._pool = None

    # ---------------------------------------------------------------- weights

    def _find_weights(self) -> Any:
        module = self.options.weights
        return module if module is not None else find_module(self.fn)

    @property
    def weights(self) -> Weights:
        """The module :meth:`update_weights` and :meth:`check_weights` cover, and what
        each graph recorded of it (:class:`~graphguard.weights.record.Weights`)."""
        if self._weights is None:
            self._weights = Weights.of(self.label, self._find_weights(), self.fn)
        return self._weights

    def release(self) -> None:
        """Drop every graph and hand its pool memory back; calls fail until capture().
        Outputs still held are non-owning views into the pool and may then point at freed
        memory: clone what must outlive the graphs."""
        with self.exclusive("release()"):
            self._release()

    def _release(self) -> None:
        had_graphs = bool(self._graph_sizes())
        if self._backend is not None and had_graphs:
            self._backend.synchronize()
        was_serving = self._captured and self.mode is not Mode.NONE
        self._drop_graphs()
        self._reap()
        self._reset_graphs()
        self._released = had_graphs or was_serving or self._released
        if self._weights is not None:
            self._weights.clear()
        self._refused.clear()
        if self._backend is not None and had_graphs:
            self._backend.empty_cache()
        self.ledger.clear()

    def rebuild_entries(self) -> None:
        """Rebuild the replay path's entries (the sizes a batch may pad to changed)."""
        self._build_entries()

    def drop_size(self, size: int) -> None:
        """Drop one size's graph now (a lazy capture over budget or refused by a peer);
        the pool's last graph takes the pool with it."""
        self._retire([size])
        self._reap()
        if self._weights is not None:
            self._weights.forget([size])
        if self._graph_sizes():
            self.ledger.forget(size)
        else:
            self._capture_backend().empty_cache()
            self.ledger.clear()
        self._build_entries()

    def _forward(self, *views: torch.Tensor) -> Any:
        """The forward warmups and captures run (the sanitizer overrides it)."""
        return self.fn(*views)

    def _observed_forward(self, size: int, *, uncaptured: bool) -> Any:
        """One forward on the static buffers at ``size``, its input writes and output
        layout observed (:class:`~graphguard.buffers.InputWrites`, ``OutputLayout``)."""
        token = self._writes.before(contents=uncaptured)
        out = self._forward(*self.static.views(size))
        self._writes.after(token)
        self._layout.observe(size, out)
        return out

    def _probe_layout(self, sizes: Sequence[int]) -> None:
        """The last ``before_capture`` hook: :meth:`OutputLayout.probe`, each forward
        synchronized like a warmup (up front, it is one: ``CapturePlan.hook_warmed``)."""
        backend = self._capture_backend()
        ran: set[int] = set()  # sizes whose forward ran to its synchronize

        def forward(size: int) -> Any:
            out = self._observed_forward(size, uncaptured=True)
            backend.synchronize()
            ran.add(size)
            return out

        self._layout.probe(sizes, forward)
        self._probed = frozenset(ran)
        lazy = self.options.lazy
        if lazy is not None and lazy.warm_shapes and not self._captured:
            # Each shape's first-run work at the stage (the two largest ran in the probe),
            # each forward that size's first warmup iteration at its lazy capture.
            for size in sorted(set(sizes) - set(sorted(sizes)[-2:]), reverse=True):
                self._warmup_forward(size)
                backend.synchronize()
                ran.add(size)
            self._warmed = ran & set(sizes)
        self.static.reset()

    def _warmup_forward(self, size: int) -> None:
        out = self._observed_forward(size, uncaptured=True)
        check_output_leaves(flatten(out)[0], f"{self.label} (warmup at size {size})")


__all__ = ["Ladder"]
