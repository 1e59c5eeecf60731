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

from graphguard import phase
from graphguard._torch_compat import size_oblivious
from graphguard.arguments import check_flag, check_keywords
from graphguard.backend import Captured, CudaBackend, Graph, GraphBackend
from graphguard.buffers import flatten
from graphguard.entries import Entry
from graphguard.errors import ConfigError, GraphGuardError
from graphguard.keywords import CaptureKwargs, option_keywords, runner_keywords
from graphguard.ladder import Ladder
from graphguard.mode import Mode
from graphguard.options import CaptureOptions
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
from graphguard.serving import UP_FRONT, Agreement
from graphguard.sizes import Hook
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


class _PieceSet:
    """A PIECEWISE runner's graphs (the store's :class:`~graphguard.ladder.store.GraphSet`):
    each piece's graph of each captured size, and each size's replay closure."""

    def __init__(
        self,
        pieces: Callable[[], list[PiecewiseGraph]],
        replayer: Callable[[int], Callable[[], Any]],
    ) -> None:
        self._pieces = pieces
        self._make_replayer = replayer
        self.done: dict[int, None] = {}
        """The sizes every piece captured (in capture order)."""
        self._replayers: dict[int, Callable[[], Any]] = {}
        self.only: dict[int, frozenset[int]] = {}
        """While :meth:`PiecewiseRunner.capture_pieces` runs: size -> the pieces it
        captures alone (the others replay their graph)."""

    def sizes(self) -> list[int]:
        return list(self.done)

    def graph_keys(self) -> tuple[GraphKey, ...]:
        return tuple(
            sorted((s, p.index) for p in self._pieces() for s in p.captured_sizes if s in self.done)
        )

    def forget(self, sizes: Sequence[int]) -> list[Graph]:
        gone = []
        for size in sizes:
            for piece in self._pieces():
                graph = piece.drop(size)
                if graph is not None:
                    gone.append(graph)
            self.done.pop(size, None)
        return gone

    def clear(self) -> None:
        for piece in self._pieces():
            piece.drop()
        self.done.clear()
        self._replayers.clear()

    def replayer(self, size: int) -> Callable[[], Any]:
        fn = self._replayers.get(size)
        if fn is None:
            fn = self._replayers[size] = self._make_replayer(size)
        return fn

    def entry_parts(self, n: int, size: int, dims: list[int | None] | None) -> dict[str, Any]:
        return {"replay": self.replayer(size), "batch_dims": dims}


class _PieceCapture:
    """The lifecycle's backend during a piecewise capture: one "capture" = one forward.

    Every piece reached by the forward captures its own graph on the real backend,
    into the pool the lifecycle chose; a failure drops that size from every piece, so
    no size is ever half-captured. Nothing is handed to ``register`` (the outputs would
    pin this size's pool blocks); the ladder's output layout was checked in the body.
    """

    capture_runs_body = True  # the split ops run eagerly between the pieces

    def __init__(
        self,
        inner: GraphBackend,
        session: Session,
        graphs: _PieceSet,
        *,
        label: str,
        pieces: Callable[[], list[PiecewiseGraph]],
        prove: Callable[[int, int, Captured], None],
        retire: Callable[[list[Graph]], None],
    ) -> None:
        self.inner = inner
        self.name = f"{inner.name}/piecewise"
        self.reads_graphs = inner.reads_graphs
        self._session = session
        self._graphs = graphs
        self._label = label
        self._pieces = pieces
        self._prove = prove
        self._retire = retire

    def synchronize(self) -> None:
        self.inner.synchronize()

    def stream(self) -> contextlib.AbstractContextManager[Any]:
        return self.inner.stream()

    def new_pool(self) -> Any:
        return self.inner.new_pool()

    def reserved_bytes(self) -> int:
        return self.inner.reserved_bytes()

    def free_bytes(self) -> int:
        return self.inner.free_bytes()

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
        read_args: bool | str = False,
        sync_guard: bool = True,
    ) -> Captured:
        size = int(label)
        s = self._session
        s.backend, s.pool, s.error_mode, s.size = self.inner, pool, error_mode, size
        s.generators = tuple(generators)
        s.read_args, s.sync_guard = read_args, sync_guard
        s.only = self._graphs.only.get(size)  # some pieces alone (capture_pieces), else all
        s.state = CAPTURE
        try:
            with self.inner.stream():
                leaves, _ = flatten(body())
            check_output_leaves(leaves, f"{self._label} (capture at size {size})")
            for piece in self._pieces():  # provenance: each piece's graph, proven
                graph = piece.graph_at(size)
                if graph is not None and (s.only is None or piece.index in s.only):
                    self._prove(size, piece.index, Captured(graph, None, piece.take_args(size)))
            self._retire([g for p in self._pieces() if (g := p.take_replaced(size)) is not None])
        except BaseException:
            self._drop_size(size, served=s.only is not None)
            raise
        finally:
            s.state = EAGER
            s.only = None
        return Captured(_SizeGraph(self._graphs.replayer(size), size), None)

    def _drop_size(self, size: int, *, served: bool) -> None:
        """A capture of ``size`` failed: every piece forgets its graph of it. ``served``:
        the size served before this run (some pieces were recaptured alone), so its
        graphs are destroyed once the run is over and it now runs eagerly."""
        gone: list[Graph] = []
        for piece in self._pieces():
            gone += [g for g in (piece.drop(size), piece.take_replaced(size)) if g is not None]
        if served:
            self._retire(gone + self._graphs.forget([size]))


class PiecewiseRunner(Ladder):
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
    _mode_hint = (
        "PiecewiseRunner runs mode 'piecewise' or 'none': use GraphRunner for FULL graphs, "
        "and graphguard.build_dispatcher to combine both for FULL_AND_PIECEWISE"
    )

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
        check_keywords(type(self).__name__, kwargs, runner_keywords(PiecewiseRunner.__init__))
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
        super().__init__(fn, example_inputs, opts, mode, backend, agreement)
        self.session = Session(name=self.label)
        self.compiler = PiecewiseCompiler(split_ops, name=self.name, session=self.session)
        self._compiled: Callable[..., Any] | None = None

    # ------------------------------------------------------------------ the kind

    def _graph_set(self) -> _PieceSet:
        self._pieces = _PieceSet(lambda: self.pieces, self._replayer)
        return self._pieces

    def _extra_reads(self) -> dict[GraphKey, set[int]]:
        """Per piece graph, the addresses of the inputs it reads in place (parameters
        among them): known without provenance, so a moved one names its pieces."""
        done = self._pieces.done
        return {
            (size, p.index): set(p.read_addresses(size))
            for p in self.pieces
            for size in p.captured_sizes
            if size in done
        }

    def _capture_pieces(self, graphs: dict[int, set[int]]) -> CaptureReport:
        return self.capture_pieces(graphs)

    def capture_pieces(self, graphs: Mapping[int, Iterable[int]]) -> CaptureReport:
        """Recapture only the pieces ``graphs[size]`` of each captured size (those that
        read a moved tensor: ``recapture(only_moved=True)`` and ``update_weights`` call it
        with provenance on); the other piece graphs keep serving. The report's
        ``recaptured_graphs`` are the graphs redone, of ``graphs_total`` held.

        Each size runs its lifecycle as a forward in which the other pieces replay and
        the named ones capture, into a fresh pool of this call (never over the shared
        pool's blocks, where the other pieces' outputs live without an owner); each new
        graph ends by copying its outputs to where its old graph wrote them, which the
        next pieces read (one device copy per output on replay). A size is recaptured
        whole instead (:func:`~graphguard.piecewise.pieces.alone_or_whole` says when),
        and every size when the step compiles again meanwhile."""
        wanted = self._check_pieces(graphs)
        with self.door.exclusive("capture_pieces()"):
            total = len(self._pieces.graph_keys())
            report = self._redo(wanted)
        report.graphs_total = total
        return report

    def _check_pieces(self, graphs: Any) -> dict[int, set[int]]:
        """``graphs`` as ``{size: {piece, ...}}``, or a ConfigError naming each size that is
        not captured and each piece index this runner does not have."""
        if not isinstance(graphs, Mapping):
            raise ConfigError(
                f"{self.label}: capture_pieces(graphs) takes a mapping of captured size -> "
                f"piece indices, e.g. {{8: [0, 2]}}; got {type(graphs).__name__} {graphs!r:.60}"
            )
        have = set(self._pieces.done)
        indices = {p.index for p in self.pieces}
        problems: list[str] = []
        out: dict[int, set[int]] = {}
        for size, named in graphs.items():
            try:
                pieces = {int(i) for i in named}
            except (TypeError, ValueError):
                problems.append(f"size {size!r}: pieces must be ints, got {named!r:.60}")
                continue
            if size not in have:
                problems.append(f"size {size!r} is not captured (captured: {sorted(have)})")
            bad = sorted(pieces - indices)
            if bad:
                problems.append(
                    f"size {size!r}: no piece {bad} (this runner has pieces {sorted(indices)})"
                )
            if not pieces:
                problems.append(f"size {size!r}: no piece named")
            out[size] = pieces
        if problems:
            raise ConfigError(
                f"{self.label}: capture_pieces refused, nothing captured:\n  - "
                + "\n  - ".join(problems)
            )
        return out

    def _redo(self, graphs: dict[int, set[int]]) -> CaptureReport:
        """Capture the pieces ``graphs`` alone where they can be, their sizes whole where
        not (see :meth:`capture_pieces`)."""
        ps = self._pieces
        alone, whole = alone_or_whole(self.pieces, graphs, ps.done, self._store.pool)
        reports: list[CaptureReport] = []
        compiles = self.compile_count
        with self._guard.capturing():
            try:
                if alone:
                    ps.only = alone
                    try:
                        pool = self._capture_backend().new_pool()
                        reports.append(self._capture_into(sorted(alone), UP_FRONT, pool))
                    finally:
                        ps.only = {}
            finally:
                if self.compile_count != compiles:  # new pieces: none may replay an old one
                    logger.warning(
                        "%s: the step compiled again while some pieces were recaptured "
                        "(%s); recapturing every size whole",
                        self.name,
                        "; ".join(self.recompile_reasons[-1:]) or "no guard recorded",
                    )
                    alone, whole = {}, list(ps.done)
                if whole:  # also when the pieces' run raised: their sizes stay current
                    reports.append(self._capture_some(whole, UP_FRONT))
        report = merged(reports, self.mode.value)
        report.recaptured_graphs = [
            (size, p.index)
            for size in sorted({*alone, *whole})
            if size in ps.done
            for p in self.pieces
            if p.graph_at(size) is not None and (size in whole or p.index in alone[size])
        ]
        return report

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
        return _PieceCapture(
            inner,
            self.session,
            self._pieces,
            label=self.label,
            pieces=lambda: self.pieces,
            prove=lambda size, piece, captured: self._prove(size, piece, captured, ()),
            retire=self._store.keep_retired,
        )

    def _kind_hooks(self) -> list[Hook]:
        def compile_hook(sizes: Sequence[int]) -> None:
            self.compile()

        return [compile_hook]

    def _watch(self) -> Any:
        # The write watch is a TorchDispatchMode: under it dynamo refuses to run the
        # compiled callable ("no compiled frames"), so the warmups here are not watched.
        return None

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

    def _body(self, size: int, forward: Callable[[], Any]) -> Callable[[], Any]:
        assert self._compiled is not None
        return forward

    def _register(self, size: int, captured: Captured) -> None:
        self._pieces.done[size] = None

    # ----------------------------------------------------------------- replay

    def _replayer(self, size: int) -> Callable[[], Any]:
        """The replay of one size: the compiled callable on the static views, pieces replaying."""
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

        return replay

    def _run(self, e: Entry) -> Any:
        """Run the pieces at the padded size (inputs and padded rows in place), slice the
        batched outputs to the batch."""
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
            f"{self.sizes[-1]}, pieces={len(self.pieces)}, captured={len(self._pieces.done)})"
        )


__all__ = ["PiecewiseRunner"]
