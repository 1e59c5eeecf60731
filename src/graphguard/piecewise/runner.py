"""``PiecewiseRunner``: the ladder (:mod:`graphguard.ladder`) over a split, compiled callable.

Capture compiles ``fn`` once (token dimension dynamic), then runs the capture lifecycle
where "capturing size ``n``" is one forward of the compiled callable on the static
buffers padded to ``n``: every piece it reaches captures its own graph into the shared
pool, split ops run eagerly. Serving is the ladder's ``__call__`` / ``replay(n)``: copy,
pad, run the compiled callable at the padded size (each piece replays), slice outputs.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import torch
from typing_extensions import Unpack

from graphguard import capture as lifecycle
from graphguard import phase
from graphguard._torch_compat import size_oblivious
from graphguard.backend import CudaBackend, Graph, GraphBackend, free_bytes
from graphguard.buffers import flatten
from graphguard.config import CaptureKwargs, CaptureOptions, Mode, check_flag, option_keywords
from graphguard.entries import Entry, copy_into
from graphguard.errors import ConfigError, GraphGuardError
from graphguard.outputs import check_output_leaves, narrow_outputs
from graphguard.phase import Phase
from graphguard.piecewise.compiler import PiecewiseCompiler
from graphguard.piecewise.pieces import (
    CAPTURE,
    EAGER,
    REPLAY,
    PiecewiseGraph,
    Session,
    alone_or_whole,
)
from graphguard.piecewise.split import SplitOp, graph_ops
from graphguard.report import CaptureReport, merged
from graphguard.served import Served
from graphguard.serving import UP_FRONT, Agreement
from graphguard.weights.record import GraphKey

logger = logging.getLogger("graphguard")


class _SizeGraph:
    """What the lifecycle registers per size: replay runs the compiled callable at that
    size (the runner's replay closure for it, held here, so the graph needs no runner)."""

    __slots__ = ("_replay", "size")

    def __init__(self, replay: Callable[[], Any], size: int) -> None:
        self._replay = replay
        self.size = size

    def replay(self) -> None:
        self._replay()


class _PieceCapture:
    """The lifecycle's backend during a piecewise capture: one "capture" = one forward.

    Every piece reached by the forward captures its own graph on the real backend,
    into the pool the lifecycle chose; a failure drops that size from every piece, so
    no size is ever half-captured. Nothing is handed to ``register`` (the outputs would
    pin this size's pool blocks); the ladder's output layout was checked in the body.
    """

    def __init__(self, runner: PiecewiseRunner, inner: GraphBackend) -> None:
        self._runner = runner
        self.inner = inner
        self.name = f"{inner.name}/piecewise"
        self.capture_runs_body = True  # the split ops run eagerly between the pieces

    def synchronize(self) -> None:
        self.inner.synchronize()

    def stream(self) -> contextlib.AbstractContextManager[Any]:
        return self.inner.stream()

    def new_pool(self) -> Any:
        return self.inner.new_pool()

    def reserved_bytes(self) -> int:
        return self.inner.reserved_bytes()

    def free_bytes(self) -> int:
        got = free_bytes(self.inner)
        return 0 if got is None else got

    def empty_cache(self) -> None:
        self.inner.empty_cache()

    def end_captures(self) -> None:
        self.inner.end_captures()

    def capture(
        self,
        body: Callable[[], Any],
        *,
        pool: Any,
        error_mode: str,
        label: Any = None,
        generators: Sequence[torch.Generator] = (),
    ) -> tuple[Graph, Any]:
        size = int(label)
        runner = self._runner
        s = runner.session
        s.backend, s.pool, s.error_mode, s.size = self.inner, pool, error_mode, size
        s.generators = tuple(generators)
        s.only = runner._only.get(size)  # some pieces alone (capture_pieces), else all
        s.state = CAPTURE
        try:
            with self.inner.stream():
                leaves, _ = flatten(body())
            check_output_leaves(leaves, f"{runner.label} (capture at size {size})")
            for piece in runner.pieces:  # provenance: each piece's graph, proven
                graph = piece.graph_at(size)
                if graph is not None and (s.only is None or piece.index in s.only):
                    runner.prove_graph(size, piece.index, graph, ())
            runner._retire_replaced(size)
        except BaseException:
            runner._drop_size(size, served=s.only is not None)
            raise
        finally:
            s.state = EAGER
            s.only = None
        return _SizeGraph(runner._replayer(size), size), None


class PiecewiseRunner(Served):
    """Compile ``fn`` once, split it at ``split_ops``, capture the pieces per size, replay.

    Args:
        fn: the callable (a module or function); inputs positional, the first dimension
            of each (``batch_dims``) is the token dimension.
        example_inputs: a tuple of tensors, one per input (dtype, device, shape apart
            from the token dimension).
        split_ops: ops that run eagerly between the pieces (e.g. attention):
            ``"ns::name"``, ``torch.ops.ns.name`` or a callable.
        fullgraph: passed to ``torch.compile``; True by default, because a graph break
            would run Python eagerly between pieces and could hide a host sync.
        mode: ``"piecewise"`` (the default) or ``"none"``.
        sanitize: ``True`` is refused (the sanitizer watches GraphRunner's graphs only);
            ``None`` and ``False`` run without it (``GRAPHGUARD_SANITIZE`` does not apply).
            Pieces always share the pool: there is no ``share_outputs``.
        options, backend, and every option keyword (each documented on
            :class:`~graphguard.CaptureOptions`): as for :class:`~graphguard.GraphRunner`,
            and one options object serves both runners.

    One compile serves every size on torch >= 2.8 unless the step specializes the token
    count (Python on the size, or ``.reshape``/``.contiguous()`` of a non-contiguous slice
    such as a fused-qkv split: use ``.view``); a recompile is warned about once with the
    failed guard, its line and the fix, and counted in the report (``compiles``).

    Contract: outputs are views into memory the next call overwrites; clone what you
    keep. Replay adds no synchronization; split ops run eagerly on the current stream.
    Capture and serve under the same grad mode (dynamo guards on it). A batch above the
    largest captured size runs ``fn`` eagerly (logged once per size). A runner is not
    thread-safe.
    """

    _kind = "PiecewiseRunner"
    _allowed_modes = (Mode.PIECEWISE, Mode.NONE)

    @option_keywords
    def __init__(
        self,
        fn: Callable[..., Any],
        example_inputs: Sequence[torch.Tensor],
        *,
        split_ops: Sequence[SplitOp],
        mode: Mode | str = Mode.PIECEWISE,
        fullgraph: bool = True,
        sanitize: bool | None = None,
        options: CaptureOptions | None = None,
        backend: GraphBackend | None = None,
        agreement: Agreement | None = None,
        **kwargs: Unpack[CaptureKwargs],
    ) -> None:
        opts = CaptureOptions.merge(options, where=self._kind, **kwargs)
        check_flag("fullgraph", fullgraph)
        if sanitize is not None:
            check_flag("sanitize", sanitize)
        if sanitize:
            raise ConfigError(
                "PiecewiseRunner: sanitize=True is not supported (the sanitizer watches "
                "GraphRunner's whole-callable graphs); sanitize the FULL runner, or use "
                "runner.verify() to compare the pieces with eager"
            )
        self.fullgraph = fullgraph
        self._done: dict[int, None] = {}
        self._only: dict[int, frozenset[int]] = {}  # capture_pieces: size -> pieces
        super().__init__(fn, example_inputs, opts, mode, backend, agreement)
        self.session = Session(name=self.label)
        self.compiler = PiecewiseCompiler(split_ops, name=self.name, session=self.session)
        self._compiled: Callable[..., Any] | None = None

    def _mode_error(self) -> str:
        return (
            f"PiecewiseRunner runs mode 'piecewise' or 'none', got {self.mode.value!r}: use "
            "GraphRunner for FULL graphs, and graphguard.Dispatcher to combine both for "
            "FULL_AND_PIECEWISE"
        )

    # ------------------------------------------------------------------ state

    def _reset_graphs(self) -> None:
        self._done = {}
        self._replayers: dict[int, Callable[[], Any]] = {}
        super()._reset_graphs()

    def _graph_sizes(self) -> list[int]:
        return list(self._done)

    def _drop_graphs(self) -> None:
        for piece in self.pieces:
            piece.drop()

    def _forget_sizes(self, sizes: Sequence[int]) -> list[Any]:
        gone = []
        for size in sizes:
            for piece in self.pieces:
                graph = piece.drop(size)
                if graph is not None:
                    gone.append(graph)
            self._done.pop(size, None)
        return gone

    def graph_reads(self) -> dict[int, set[int]] | None:
        """Per size, the addresses its pieces read without a copy (parameters among them),
        and with provenance every storage the pieces' kernels take."""
        proven = super().graph_reads() or {}
        return {
            size: {ptr for piece in self.pieces for ptr in piece.read_addresses(size)}
            | proven.get(size, set())
            for size in self._done
        }

    def reads_by_graph(self) -> dict[GraphKey, set[int]] | None:
        """Per piece graph ``(size, piece)``, what :meth:`graph_reads` says of its size,
        piece by piece; None without provenance (then a moved tensor recaptures whole
        sizes)."""
        proven = super().reads_by_graph()
        if proven is None:
            return None
        return {
            (size, p.index): set(p.read_addresses(size)) | proven.get((size, p.index), set())
            for p in self.pieces
            for size in p.captured_sizes
            if size in self._done
        }

    @property
    def graph_keys(self) -> tuple[GraphKey, ...]:
        """Every piece graph this runner holds, ``(size, piece)``."""
        return tuple(sorted((s, p.index) for p in self.pieces for s in p.captured_sizes))

    def capture_pieces(self, graphs: Mapping[int, Iterable[int]]) -> CaptureReport:
        """Recapture only the pieces ``graphs[size]`` of each captured size (those that
        read a moved tensor: :func:`graphguard.weights.recapture_moved`); the other piece
        graphs keep serving. The report's ``recaptured_graphs`` are the graphs redone.

        Each size runs its lifecycle as a forward in which the other pieces replay and
        the named ones capture, into a fresh pool of this call (never over the shared
        pool's blocks, where the other pieces' outputs live without an owner); each new
        graph ends by copying its outputs to where its old graph wrote them, which the
        next pieces read (one device copy per output on replay). A size is recaptured
        whole instead (:func:`~graphguard.piecewise.pieces.alone_or_whole` says when),
        and every size when the step compiles again meanwhile."""
        with self._guard.capturing():
            alone, whole = alone_or_whole(self.pieces, graphs, self._done, self._pool)
            reports: list[CaptureReport] = []
            compiles = self.compile_count
            try:
                if alone:
                    self._only = alone
                    try:
                        pool = self._capture_backend().new_pool()
                        reports.append(self._capture_sizes(sorted(alone), UP_FRONT, pool))
                    finally:
                        self._only = {}
            finally:
                if self.compile_count != compiles:  # new pieces: none may replay an old one
                    logger.warning(
                        "%s: the step compiled again while some pieces were recaptured "
                        "(%s); recapturing every size whole",
                        self.name,
                        "; ".join(self.recompile_reasons[-1:]) or "no guard recorded",
                    )
                    alone, whole = {}, list(self._done)
                if whole:  # also when the pieces' run raised: their sizes stay current
                    reports.append(self._capture_sizes(whole, UP_FRONT))
        report = merged(reports, self.mode.value)
        report.recaptured_graphs = [
            (size, p.index)
            for size in sorted({*alone, *whole})
            if size in self._done
            for p in self.pieces
            if p.graph_at(size) is not None and (size in whole or p.index in alone[size])
        ]
        return report

    def _retire_replaced(self, size: int) -> None:
        """The graphs that pieces recaptured alone at ``size`` replaced: destroyed once
        the capture run is over (:meth:`_reap`)."""
        gone = [p.take_replaced(size) for p in self.pieces]
        self._retired.extend(g for g in gone if g is not None)

    def _drop_size(self, size: int, *, served: bool) -> None:
        """A capture of ``size`` failed: every piece forgets its graph of it. ``served``:
        the size served before this run (some pieces were recaptured alone), so its
        graphs are destroyed once the run is over and it now runs eagerly."""
        for piece in self.pieces:
            gone = [piece.drop(size), piece.take_replaced(size)]
            if served:
                self._retired.extend(g for g in gone if g is not None)
        if served:
            self._done.pop(size, None)
            self._provenance.forget([size])

    @property
    def pieces(self) -> list[PiecewiseGraph]:
        """Every piece of the compiled graph(s), in call order."""
        return self.compiler.pieces

    @property
    def compile_count(self) -> int:
        """Graphs dynamo compiled; 1 means one graph serves every size."""
        return self.compiler.compile_count

    # ---------------------------------------------------------------- compile

    def compile(self) -> Callable[..., Any]:
        """Compile ``fn`` (once) with the token dimension dynamic; return the compiled callable.

        Runs one eager forward at the largest size on the static buffers (phase WARMUP).
        ``capture()`` calls it first; call it yourself to inspect the split on any device.
        """
        if self._compiled is not None:
            return self._compiled
        views = self.static.views(self.sizes[-1])
        for v, spec in zip(views, self.specs):
            torch._dynamo.mark_dynamic(v, spec.batch_dim)
        compiled = torch.compile(
            self.fn, backend=self.compiler, fullgraph=self.fullgraph, dynamic=None
        )
        with size_oblivious(), phase.enter(Phase.WARMUP, owner=self.label):
            compiled(*views)
        if not self.compiler.graphs:
            raise GraphGuardError(
                f"{self.name}: torch.compile ran without calling the graphguard backend, so "
                "nothing was split. Usually dynamo's recompile limit for this code object was "
                "reached (torch._dynamo.config.recompile_limit; call torch._dynamo.reset() "
                "between runners of the same function in tests) or the function is skipped."
            )
        if not self.compiler.split_ops:
            ran = graph_ops(self.compiler.graphs[0])
            shown = ", ".join(ran[:15]) + (f" and {len(ran) - 15} more" if len(ran) > 15 else "")
            raise ConfigError(
                f"{self.name}: split op(s) {', '.join(self.compiler.matcher.describe())} never "
                f"ran in the compiled graph, so nothing would run eagerly and the runner would "
                f"capture everything as one piece. Ops that did run: {shown}. Check the "
                "namespace and name ('ns::op', as registered with torch.library), or use "
                "GraphRunner when no op needs to run eagerly."
            )
        self._compiled = compiled
        return compiled

    @property
    def recompile_reasons(self) -> list[str]:
        """The guards whose failure made dynamo compile again (empty: one compile)."""
        return list(self.compiler.recompile_reasons)

    def describe(self) -> str:
        """One line on the split: pieces, split points (op x calls), compiles.

        E.g. ``"step: 3 pieces, split at mylib::attention x2 calls, 1 compile"``.
        """
        if not self.compiler.graphs:
            return (
                f"{self.name}: not compiled yet (split ops "
                f"{', '.join(self.compiler.matcher.describe())})"
            )
        points = ", ".join(f"{op} x{n} calls" for op, n in self.compiler.split_points().items())
        n = self.compile_count
        line = (
            f"{self.name}: {len(self.pieces)} pieces, split at {points or 'nothing'}, "
            f"{n} compile{'s' if n != 1 else ''}"
        )
        if n > 1:
            line += f" ({n - 1} recompile{'s' if n > 2 else ''}: not one graph for every size)"
        return line

    # ---------------------------------------------------------------- capture

    def _capture_backend(self) -> GraphBackend:
        inner = self.backend
        self.session.weak_outputs = isinstance(inner, CudaBackend)
        return _PieceCapture(self, inner)

    def _plan(self) -> lifecycle.CapturePlan:
        def compile_hook(sizes: Sequence[int]) -> None:
            self.compile()

        kw = self._plan_options()
        kw["before_capture"] = [compile_hook, *kw["before_capture"]]
        # The write watch is a TorchDispatchMode: under it dynamo refuses to run the
        # compiled callable ("no compiled frames"), so the warmups here are not watched.
        kw["watch"] = None
        return lifecycle.CapturePlan(
            sizes=sorted(self.sizes, reverse=True),
            warmup=self._warmup_forward,
            body=self._capture_body,
            register=self._register,
            **kw,
        )

    def capture(self) -> CaptureReport:
        """Compile, then run the capture lifecycle; every piece captures at every size.

        Raises :class:`GraphCaptureError` (with ``on_capture_error="raise"``) after
        keeping every size that did capture in full.
        """
        report = super().capture()
        if self.mode is not Mode.NONE:
            report.set_compiles(self.compile_count, self.recompile_reasons)
            logger.info("%s", self.describe())
        return report

    def _forward(self, *views: torch.Tensor) -> Any:
        assert self._compiled is not None
        return self._compiled(*views)

    def _capture_body(self, size: int) -> Callable[[], Any]:
        assert self._compiled is not None

        def body() -> Any:
            return self._observed_forward(size, uncaptured=False)

        return body

    def _register(self, size: int, graph: Graph, result: None) -> None:
        self._done[size] = None

    # ----------------------------------------------------------------- replay

    def _replayer(self, size: int) -> Callable[[], Any]:
        """The replay of one size: the compiled callable on the static views, pieces replaying."""
        fn = self._replayers.get(size)
        if fn is not None:
            return fn
        compiled = self._compiled
        assert compiled is not None
        views = self.static.views(size)
        s = self.session

        def replay() -> Any:
            s.size = size
            s.state = REPLAY
            try:
                return compiled(*views)
            finally:
                s.state = EAGER

        self._replayers[size] = replay
        return replay

    def _entry_parts(self, n: int, size: int) -> dict[str, Any]:
        return {"replay": self._replayer(size), "batch_dims": self._layout.dims}

    def _run(self, e: Entry) -> Any:
        """Refill padded rows if the batch shrank, run the pieces at the padded size,
        slice the batched outputs to the batch."""
        if self._dirty > e.n or self._refill_always:
            copy_into(e.tail_dsts, e.tail_srcs)
        self._dirty = e.n
        out = e.replay()
        if e.n != e.size or self.options.copy_outputs:
            out = self._trim(out, e)
        return out

    def _trim(self, out: Any, e: Entry) -> Any:
        if e.n != e.size:
            out = narrow_outputs(out, e.batch_dims, e.n, self.name)
        if self.options.copy_outputs:
            out = torch.utils._pytree.tree_map_only(torch.Tensor, torch.clone, out)
        return out

    def __repr__(self) -> str:
        return (
            f"PiecewiseRunner({self.name}, mode={self.mode.value}, sizes={len(self.sizes)} up to "
            f"{self.sizes[-1]}, pieces={len(self.pieces)}, captured={len(self._done)})"
        )


__all__ = ["PiecewiseRunner"]
