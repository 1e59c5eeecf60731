"""The PIECEWISE kind (:class:`~graphguard.ladder.kind.GraphKind`): the pieces of a split,
compiled callable, each captured per size.

"Capturing size ``n``" is one forward of the compiled callable on the static buffers padded
to ``n``: every piece it reaches captures its own graph into the shared pool, split ops run
eagerly. A replay runs the compiled callable at the padded size (each piece replays) and
narrows the outputs to the batch.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from graphguard import phase
from graphguard._torch_compat import size_oblivious
from graphguard.backend import Captured, CudaBackend, Graph, GraphBackend
from graphguard.buffers import StaticInputs, flatten
from graphguard.entries import Entry
from graphguard.errors import ConfigError, GraphGuardError
from graphguard.ladder.kind import KindSite, PieceCapture, Prove
from graphguard.ladder.store import GraphStore
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
from graphguard.serving import CaptureGuard
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


class PieceGraphs:
    """See the module docstring. ``session`` and ``compiler`` exist once the ladder binds
    the kind (its name is known then)."""

    compiled = True
    """The write watch is a TorchDispatchMode: under it dynamo refuses to run the compiled
    callable ("no compiled frames"), so the warmups are not watched."""

    def __init__(self, fn: Callable[..., Any], split_ops: Sequence[SplitOp], fullgraph: bool):
        self.fn = fn
        self.split_ops = split_ops
        self.fullgraph = fullgraph
        self.graphs = _PieceSet(lambda: self.pieces, self._replayer)
        self._compiled: Callable[..., Any] | None = None
        self.copy_outputs = False

    def ladder(self, sizes: tuple[int, ...]) -> tuple[int, ...]:
        return sizes

    def bind(self, site: KindSite) -> None:
        self.label, self.name = site.label, site.name
        self.static: StaticInputs = site.static
        self.store: GraphStore = site.store
        self.copy_outputs = site.copy_outputs
        self._prove: Prove = site.prove
        self.session = Session(name=site.label)
        self.compiler = PiecewiseCompiler(self.split_ops, name=site.name, session=self.session)

    @property
    def pieces(self) -> list[PiecewiseGraph]:
        """Every piece of the compiled graph(s), in call order."""
        return self.compiler.pieces

    # ---------------------------------------------------------------- compile

    def compile(self) -> Callable[..., Any]:
        """Compile ``fn`` once (see :meth:`PiecewiseRunner.compile
        <graphguard.PiecewiseRunner.compile>`)."""
        if self._compiled is not None:
            return self._compiled
        static = self.static
        views = static.views(static.max_size)
        for v, spec in zip(views, static.specs):
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

    def hooks(self) -> list[Hook]:
        def compile_hook(sizes: Sequence[int]) -> None:
            self.compile()

        return [compile_hook]

    # ---------------------------------------------------------------- capture

    def capture_backend(self, inner: GraphBackend) -> GraphBackend:
        self.session.weak_outputs = isinstance(inner, CudaBackend)
        prove = self._prove
        return _PieceCapture(
            inner,
            self.session,
            self.graphs,
            label=self.label,
            pieces=lambda: self.pieces,
            prove=lambda size, piece, captured: prove(size, piece, captured, ()),
            retire=self.store.keep_retired,
        )

    def forward(self, *views: torch.Tensor) -> Any:
        assert self._compiled is not None
        return self._compiled(*views)

    def body(self, size: int, forward: Callable[[], Any]) -> Callable[[], Any]:
        assert self._compiled is not None
        return forward

    def register(self, size: int, captured: Captured) -> None:
        self.graphs.done[size] = None

    def fill_report(self, report: CaptureReport) -> CaptureReport:
        """The compiles (one serves every size unless the step specializes), logged with
        the split (:meth:`describe`)."""
        report.set_compiles(self.compiler.compile_count, list(self.compiler.recompile_reasons))
        logger.info("%s", self.describe())
        return report

    def describe(self) -> str:
        """One line on the split: pieces, split points (op x calls), compiles."""
        compiler = self.compiler
        if not compiler.graphs:
            return (
                f"{self.name}: not compiled yet (split ops "
                f"{', '.join(compiler.matcher.describe())})"
            )
        points = ", ".join(f"{op} x{n} calls" for op, n in compiler.split_points().items())
        n = compiler.compile_count
        line = (
            f"{self.name}: {len(self.pieces)} pieces, split at {points or 'nothing'}, "
            f"{n} compile{'s' if n != 1 else ''}"
        )
        if n > 1:
            line += f" ({n - 1} recompile{'s' if n > 2 else ''}: not one graph for every size)"
        return line

    def extra_reads(self) -> dict[GraphKey, set[int]]:
        """Per piece graph, the addresses of the inputs it reads in place (parameters
        among them): known without provenance, so a moved one names its pieces."""
        done = self.graphs.done
        return {
            (size, p.index): set(p.read_addresses(size))
            for p in self.pieces
            for size in p.captured_sizes
            if size in done
        }

    def capture_pieces(
        self, graphs: Mapping[int, set[int]], capture: PieceCapture, guard: CaptureGuard
    ) -> CaptureReport:
        """Capture the pieces ``graphs`` alone where they can be, their sizes whole where
        not (see :meth:`PiecewiseRunner.capture_pieces
        <graphguard.PiecewiseRunner.capture_pieces>`), ``capture`` running each
        lifecycle."""
        ps = self.graphs
        alone, whole = alone_or_whole(self.pieces, dict(graphs), ps.done, self.store.pool)
        reports: list[CaptureReport] = []
        compiles = self.compiler.compile_count
        with guard.capturing():
            try:
                if alone:
                    ps.only = alone
                    try:
                        reports.append(capture(sorted(alone), alone=True))
                    finally:
                        ps.only = {}
            finally:
                if self.compiler.compile_count != compiles:  # new pieces: none replay an old one
                    logger.warning(
                        "%s: the step compiled again while some pieces were recaptured "
                        "(%s); recapturing every size whole",
                        self.name,
                        "; ".join(self.compiler.recompile_reasons[-1:]) or "no guard recorded",
                    )
                    alone, whole = {}, list(ps.done)
                if whole:  # also when the pieces' run raised: their sizes stay current
                    reports.append(capture(whole, alone=False))
        report = merged(reports, "piecewise")
        report.recaptured_graphs = [
            (size, p.index)
            for size in sorted({*alone, *whole})
            if size in ps.done
            for p in self.pieces
            if p.graph_at(size) is not None and (size in whole or p.index in alone[size])
        ]
        return report

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

    def run(self, e: Entry) -> Any:
        """Run the pieces at the padded size (inputs and padded rows in place), slice the
        batched outputs to the batch."""
        out = e.replay()
        if e.n != e.size or self.copy_outputs:
            out = self._trim(out, e)
        return out

    def _trim(self, out: Any, e: Entry) -> Any:
        if e.n != e.size:
            out = narrow_outputs(out, e.batch_dims, e.n, self.name)
        if self.copy_outputs:
            out = torch.utils._pytree.tree_map_only(torch.Tensor, torch.clone, out)
        return out


__all__ = ["PieceGraphs"]
