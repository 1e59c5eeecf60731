"""The ladder every runner is: one concrete class that builds the runner's parts, runs
the capture lifecycle through them and answers the serving-time calls.

A runner is composed of parts, each in its own file of this package (the package
docstring lists them in lifecycle order): its kind (:class:`~graphguard.ladder.kind.GraphKind`),
the store, the capture runs, the miss policy, the replay path (the base) and the door.

Every serving-time method that synchronizes the device, frees graphs or changes what they
read runs under the capture guard (:class:`~graphguard.serving.CaptureGuard`): refused
from inside the step while a capture is open, waited for from another thread.

Contract: outputs are views into memory the next call overwrites; a runner is not
thread-safe. Static buffers never require grad (their views are made under no_grad).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, cast

import torch

from graphguard.arguments import check_flag
from graphguard.autocast import applied
from graphguard.backend import CudaBackend, GraphBackend, check_backend
from graphguard.buffers import StaticInputs, make_specs
from graphguard.canary import CanaryStats, CanaryWatch
from graphguard.entries import Entry
from graphguard.errors import ConfigError, GraphGuardError
from graphguard.ladder.capturing import LadderCapture, LadderParts
from graphguard.ladder.door import LadderDoor
from graphguard.ladder.kind import GraphKind, KindSite
from graphguard.ladder.miss import EagerMiss, Miss
from graphguard.ladder.moved import MovedMembers
from graphguard.ladder.reads import GraphReads
from graphguard.ladder.replay import ReplayPath
from graphguard.ladder.restart import check_reason, start_over
from graphguard.ladder.store import GraphStore
from graphguard.lazy import LazyCalls, LazyCapture
from graphguard.mode import Mode
from graphguard.options import CaptureOptions
from graphguard.provenance import Audit, Provenance
from graphguard.report import CaptureReport
from graphguard.serving import Agreement, CaptureGuard
from graphguard.sizes import resolve_sizes
from graphguard.state import StateSet
from graphguard.stats import ServingStats, serving_stats
from graphguard.verify import verify
from graphguard.weights.record import GraphKey, WeightCheck
from graphguard.weights.refit import RefitContext
from graphguard.weights.update import WeightUpdate, refit, update_weights

if TYPE_CHECKING:
    from graphguard.sanitizer.checks import SanitizedRunner, Sanitizer
    from graphguard.sanitizer.storages import TrackedStorage

logger = logging.getLogger("graphguard")


class GraphLadder(ReplayPath, MovedMembers):
    """The runner :class:`~graphguard.GraphRunner` and :class:`~graphguard.PiecewiseRunner`
    are (they document the arguments and hand in their ``kind``). ``options`` is resolved
    here into ``self.options``, read only as ``self.options.<field>``; ``backend`` None is
    a CudaBackend made on first use."""

    _kind = "GraphLadder"
    """The runner's class name in messages (``GraphRunner(decode)``)."""
    _allowed_modes: tuple[Mode, ...] = (Mode.FULL, Mode.NONE)
    _mode_hint = ""
    """What to use for a mode this kind does not run (the kind's error message)."""
    _sanitizer: Sanitizer | None = None
    """The sanitizer part (``sanitize=True``, GraphRunner's): told of each capture,
    forward, rebuild, replay and release."""
    sanitize = False
    """Whether the sanitizer's checks are on (``GraphRunner(sanitize=True)``)."""

    def __init__(
        self,
        fn: Callable[..., Any],
        example_inputs: Sequence[torch.Tensor],
        options: CaptureOptions,
        mode: Mode | str,
        backend: GraphBackend | None,
        agreement: Agreement | None = None,
        *,
        kind: GraphKind,
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
        self.sizes = kind.ladder(resolve_sizes(o.sizes, o.max_size, example))
        self.state: StateSet | None = StateSet.of(o.state) or None
        if backend is not None:
            check_backend(backend, self.label)
        self._backend = backend
        self.static = StaticInputs(self.specs, self.sizes[-1])
        self.report: CaptureReport | None = None
        """The last ``capture()``'s report."""
        if o.lazy is not None:
            o.lazy.check_sizes(self.label, self.sizes)
        if self.sanitize:
            from graphguard.sanitizer.checks import Sanitizer  # the one place it is loaded

            # Only GraphRunner turns it on (PiecewiseRunner refuses sanitize=True), and the
            # sanitizer reads its graph_outputs once captures exist.
            self._sanitizer = Sanitizer(cast("SanitizedRunner", self))
        self._build(kind, agreement)

    def _build(self, kind: GraphKind, agreement: Agreement | None) -> None:
        """The parts, each given what it works on (see the module docstring)."""
        o, lazy = self.options, self.options.lazy
        self._guard = CaptureGuard(self.label)
        self._store = store = GraphStore(
            self.label,
            kind.graphs,
            self.static,
            ladder=self.sizes,
            lazy=lazy is not None,
            budget=lazy.budget if lazy is not None else None,
            # No warmup: only version counters see input writes; refill padded rows always.
            refill_always=o.warmup_iters == 0,
            output_dims=o.output_batch_dims,
        )
        # What each graph reads; the sanitizer refuses a graph over memory no one owns.
        self._reads = reads = GraphReads(
            self.label,
            store,
            Provenance(self.label, o.provenance, strict=self.sanitize, device=self.specs[0].device),
            fn=self.fn,
            weights=o.weights,
            state=self.state,
            static=[(s.name, b) for s, b in zip(self.specs, self.static.buffers)],
            arenas=o.workspaces or (),
        )
        kind.bind(
            KindSite(
                label=self.label,
                name=self.name,
                sizes=self.sizes,
                static=self.static,
                store=store,
                prove=reads.prove,
                copy_outputs=bool(o.copy_outputs),
            )
        )
        self._warmed: dict[int, bool] = {}
        self._capturer = self._capture_half(kind)
        self._graph_kind = kind
        run = self._replay_run()
        self.door = LadderDoor(
            self._capturer,
            call=self.__call__,
            run=run,
            eager=self.eager,
            check_weights=self._check_weights,
        )
        """The operations the serving-time features use (:class:`graphguard.serving.Door`):
        the extension point for an engine's own serving-time feature."""
        self._canary = (
            CanaryWatch(self.door, o.canary, self.sanitize, agreement, state=self.state)
            if o.canary is not None
            else None
        )
        self._miss = self._miss_policy(agreement)
        ReplayPath.__init__(self, store, self._canary, self._miss, run)

    def _capture_half(self, kind: GraphKind) -> LadderCapture:
        """The capture runs, given the parts they work on and the runner's forward and
        rebuild (which a subclass may wrap: the sanitizer's checks)."""
        return LadderCapture(
            LadderParts(
                label=self.label,
                name=self.name,
                fn=self.fn,
                options=self.options,
                mode=self.mode,
                sizes=self.sizes,
                state=self.state,
                kind=kind,
                store=self._store,
                static=self.static,
                reads=self._reads,
                guard=self._guard,
                sanitize=self.sanitize,
                warmed=self._warmed,
                backend=lambda: self.backend,
                forward=self._forward,
                rebuild=self._rebuild,
            )
        )

    def _miss_policy(self, agreement: Agreement | None) -> Miss:
        """Eager, or lazy capture (``lazy=``) falling back to eager."""
        o = self.options
        eager = EagerMiss(self.name, self.mode, self.sizes, self._store, self.eager)
        if o.lazy is None or self.mode is Mode.NONE:
            self._lazy: LazyCapture | None = None
            return eager
        calls = LazyCalls(self._guard, self.__call__, self.replay, eager.call)
        judge = self._canary.judge if self._canary is not None else None
        self._lazy = LazyCapture(
            self.door,
            agreement,
            calls,
            first_calls=o.warmup_iters != 0,
            evict=o.lazy.evict is not None,
            judge=judge,
            declared=o.state,
            counters=self._store.counters,
            warmed=self._warmed,
            capture_now=o.lazy.capture_now,
        )
        return self._lazy

    def _replay_run(self) -> Callable[[Entry], Any]:
        """What the replay path calls per replay, chosen once: the kind's ``run`` (or a
        subclass's ``_run`` override), inside the sanitizer's checks when it is on."""
        run = self._graph_kind.run if type(self)._run is GraphLadder._run else self._run
        return run if self._sanitizer is None else self._sanitizer.replay(run)

    # ------------------------------------------------------------------ the kind, as a runner

    def _run(self, e: Entry) -> Any:
        """Replay entry ``e`` (inputs and padded rows in place): the kind's run."""
        return self._graph_kind.run(e)

    def _forward(self, *views: torch.Tensor) -> Any:
        """The forward warmups and captures run: the kind's, or, with the sanitizer, the
        user's eager forward watched by it."""
        if self._sanitizer is not None:
            return self._sanitizer.forward(*views)
        return self._graph_kind.forward(*views)

    def _extra_reads(self) -> dict[GraphKey, set[int]]:
        """Storage addresses graphs are known to read without provenance, per graph (the
        kind's: the pieces' in-place inputs; the sanitizer's tracked storages)."""
        reads = self._graph_kind.extra_reads()
        if self._sanitizer is not None:
            for key, addrs in self._sanitizer.extra_reads().items():
                reads.setdefault(key, set()).update(addrs)
        return reads

    def _rebuild(self, added: int | None = None) -> None:
        """Rebuild the replay path's entries (:meth:`GraphStore.rebuild
        <graphguard.ladder.store.GraphStore.rebuild>`), and arm the canary (and the
        sanitizer's watch) on them."""
        entries = self._store.rebuild(added)
        if self._canary is not None:
            self._canary.arm(entries)
        if self._sanitizer is not None:
            self._sanitizer.rebuilt()

    def _capture_pieces(self, graphs: dict[int, set[int]]) -> CaptureReport:
        """Capture again only the pieces ``graphs[size]`` of each size (PIECEWISE)."""
        return self._capturer.capture_pieces(graphs)

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
        return self.options.lazy is not None

    def eager(self, *inputs: Any) -> Any:
        """The plain ``fn`` on the caller's tensors, under the graphs' autocast policy: no
        padding, no graph, never the compiled code (a batch above the ladder must not cost
        a recompile on tensors unlike the static buffers)."""
        with applied(self._capturer.autocast):
            return self.fn(*inputs)

    # ------------------------------------------------------------------ capture

    def capture(self) -> CaptureReport:
        """Run the capture lifecycle (:mod:`graphguard.capture`) and return its report.

        A :class:`GraphCaptureError` (``on_capture_error="raise"``) keeps every size that
        did capture; one that kept no graph (a hook raised, an interrupt) may be retried.
        A lazy runner (``lazy=``) runs the before-capture stage and its ``capture_now``
        sizes here, and the other sizes on first use. A compiled step (``compile=True``,
        PIECEWISE) compiles first; the report gives the compiles, their seconds and any
        recompile reasons.
        """
        with self._guard.exclusive("capture()"):
            store = self._store
            if store.held():
                raise GraphGuardError(
                    f"{self.name}: already captured {list(self.captured_sizes)}; call "
                    "recapture(reason=...) to drop the graphs and capture again on purpose"
                )
            if self.mode is Mode.NONE:
                store.serve_eagerly()
                self.report = CaptureReport(mode=self.mode.value, backend="none")
                logger.info("%s: mode none, every call runs eagerly", self.name)
                return self.report
            self.report = report = (
                self._capture_ladder()
                if self._sanitizer is None
                else self._sanitizer.capture(self._capture_ladder)
            )
            if self._canary is not None:
                self._canary.judge(report, self.options.state, fresh=True)
            return self._graph_kind.fill_report(report)

    def check_storages(self, sizes: Sequence[int] | None = None) -> None:
        """Raise if a graph's storages changed since capture: ``FreedStorageError`` (freed,
        resized, moved) or ``ReboundTensorError`` (a named slot such as ``module.weight``
        now holds another tensor). Runs automatically before each replay (for the replayed
        size); call it with no argument to check every captured size, e.g. after reloading
        weights. Needs ``sanitize=True``."""
        self._sanitizer_or_raise("check_storages()").check_storages(sizes)

    def watched_storages(self, size: int) -> list[TrackedStorage]:
        """The external storages the size-``size`` graph was seen using at capture.
        Needs ``sanitize=True`` (GraphRunner's)."""
        return self._sanitizer_or_raise("watched_storages()").watched_storages(size)

    def _sanitizer_or_raise(self, what: str) -> Sanitizer:
        if self._sanitizer is None:
            raise ConfigError(
                f"{self.label}: {what} asks the sanitizer, which is off; build the runner "
                "with sanitize=True (or set GRAPHGUARD_SANITIZE=1)"
            )
        return self._sanitizer

    def _capture_ladder(self) -> CaptureReport:
        return self._capturer.capture_ladder(self._miss)

    def release(self) -> None:
        """Drop every graph and hand its pool memory back; calls fail until capture().
        Outputs still held are non-owning views into the pool and may then point at freed
        memory: clone what must outlive the graphs."""
        with self._guard.exclusive("release()"):
            self._release()

    def _release(self) -> None:
        if self._sanitizer is not None:
            self._sanitizer.release()
        store = self._store
        had_graphs = bool(store.held())
        if self._backend is not None and had_graphs:
            self._backend.synchronize()
        store.release()
        self._capturer.reset()
        self._miss.forget()
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
                partial = self._capturer.recapture_moved(self._check_weights(), reason)
            return partial or CaptureReport(mode=self.mode.value, backend="none")
        with self._capturer.capture_mode():  # from any thread: the graphs' mode, not the caller's
            start_over(self, reason)
            return self.capture()

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
            backend = self._capturer.backend()
            return self._reads.audit(backend.reads_graphs, self.specs[0].device)

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
            warmed=self._warmed,
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
        with self._guard.exclusive("verify()"), self._capturer.capture_mode():
            return verify(self, **kwargs)


Ladder = GraphLadder
"""The 0.4 name of :class:`GraphLadder` (importable for one more release)."""

__all__ = ["GraphLadder", "Ladder", "check_reason", "start_over"]
