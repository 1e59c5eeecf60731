"""``PiecewiseRunner``: the ladder (:mod:`graphguard.ladder`) over a split, compiled callable.

Capture compiles ``fn`` once (token dimension dynamic), then runs the capture lifecycle
where "capturing size ``n``" is one forward of the compiled callable on the static
buffers padded to ``n``: every piece it reaches captures its own graph into the shared
pool, split ops run eagerly. Serving is the ladder's ``__call__`` / ``replay(n)``: copy,
pad, run the compiled callable at the padded size (each piece replays), slice outputs.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import torch
from typing_extensions import Unpack

from graphguard.arguments import check_flag, check_keywords
from graphguard.backend import GraphBackend
from graphguard.errors import ConfigError
from graphguard.keywords import CaptureKwargs, option_keywords, runner_keywords
from graphguard.ladder import GraphLadder
from graphguard.mode import Mode
from graphguard.options import CaptureOptions
from graphguard.piecewise.compiler import PiecewiseCompiler
from graphguard.piecewise.kind import PieceGraphs
from graphguard.piecewise.pieces import PiecewiseGraph, Session
from graphguard.piecewise.split import SplitOp
from graphguard.report import CaptureReport
from graphguard.serving import Agreement

logger = logging.getLogger("graphguard")


class PiecewiseRunner(GraphLadder):
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
        self._piece_graphs = PieceGraphs(fn, split_ops, fullgraph)
        super().__init__(
            fn, example_inputs, opts, mode, backend, agreement, kind=self._piece_graphs
        )
        self.session: Session = self._piece_graphs.session
        self.compiler: PiecewiseCompiler = self._piece_graphs.compiler

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
        return self._capture_pieces(self._check_pieces(graphs))

    def _check_pieces(self, graphs: Any) -> dict[int, set[int]]:
        """``graphs`` as ``{size: {piece, ...}}``, or a ConfigError naming each size that is
        not captured and each piece index this runner does not have."""
        if not isinstance(graphs, Mapping):
            raise ConfigError(
                f"{self.label}: capture_pieces(graphs) takes a mapping of captured size -> "
                f"piece indices, e.g. {{8: [0, 2]}}; got {type(graphs).__name__} {graphs!r:.60}"
            )
        have = set(self._piece_graphs.graphs.done)
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
        return self._piece_graphs.compile()

    @property
    def recompile_reasons(self) -> list[str]:
        """The guards whose failure made dynamo compile again (empty: one compile)."""
        return list(self.compiler.recompile_reasons)

    def describe(self) -> str:
        """One line on the split: pieces, split points (op x calls), compiles.

        E.g. ``"step: 3 pieces, split at mylib::attention x2 calls, 1 compile"``.
        """
        return self._piece_graphs.describe()

    def __repr__(self) -> str:
        return (
            f"PiecewiseRunner({self.name}, mode={self.mode.value}, sizes={len(self.sizes)} up to "
            f"{self.sizes[-1]}, pieces={len(self.pieces)}, "
            f"captured={len(self._piece_graphs.graphs.done)})"
        )


__all__ = ["PiecewiseRunner"]
