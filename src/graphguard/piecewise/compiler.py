"""The ``torch.compile`` backend that splits the graph at split ops and wraps the pieces.

Dynamo hands :class:`PiecewiseCompiler` one FX graph per compile; it splits it
(:func:`~graphguard.piecewise.split.split_graph`), replaces each piece by a
:class:`~graphguard.piecewise.pieces.PiecewiseGraph` and each split op by an eager
wrapper. More than one compile (a recompile or a graph break) is logged as a warning.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
import torch.fx

from graphguard.piecewise.pieces import PiecewiseGraph, _EagerSplit, _Session
from graphguard.piecewise.split import SplitGraph, SplitMatcher, SplitOp, split_graph

logger = logging.getLogger("graphguard")


class PiecewiseCompiler:
    """A ``torch.compile`` backend that splits the graph at split ops and wraps the pieces.

    Use it through :class:`PiecewiseRunner`, or alone to inspect the split::

        compiler = PiecewiseCompiler(split_ops=["mylib::attention"])
        compiled = torch.compile(model, backend=compiler, dynamic=True)
        compiled(x)          # pieces run eagerly: no runner, no graphs
        compiler.pieces, compiler.split_ops, compiler.graphs[0]   # what was split

    Attributes:
        graphs: every FX graph dynamo handed over (one per compile; more means a
            recompile or a graph break).
        splits: the :class:`SplitGraph` of each.
        pieces: every :class:`PiecewiseGraph`, in call order.
        compile_count: how many graphs were compiled.
    """

    def __init__(
        self,
        split_ops: Sequence[SplitOp],
        *,
        name: str = "piecewise",
        session: _Session | None = None,
    ) -> None:
        self.matcher = SplitMatcher(split_ops)
        self.name = name
        self.session = session if session is not None else _Session(name=name)
        self.graphs: list[torch.fx.GraphModule] = []
        self.splits: list[SplitGraph] = []
        self.pieces: list[PiecewiseGraph] = []

    @property
    def compile_count(self) -> int:
        return len(self.graphs)

    @property
    def split_ops(self) -> list[str]:
        """Names of the split-op submodules of every compiled graph, in call order."""
        return [n for sg in self.splits for n in sg.split_ops]

    def __call__(
        self, gm: torch.fx.GraphModule, example_inputs: Sequence[Any]
    ) -> Callable[..., Any]:
        self.graphs.append(gm)
        sg = split_graph(gm, self.matcher)
        for name in sg.pieces:
            piece = PiecewiseGraph(
                sg.module.get_submodule(name),
                len(self.pieces),
                sg.copied_inputs[name],
                self.session,
            )
            setattr(sg.module, name, piece)
            self.pieces.append(piece)
        for name in sg.split_ops:
            setattr(sg.module, name, _EagerSplit(sg.module.get_submodule(name), self.session))
        self.splits.append(sg)
        split_nodes = sum(1 for n in gm.graph.nodes if self.matcher(n))
        msg = (
            f"{self.name}: graph {len(self.graphs)} split into {len(sg.pieces)} pieces at "
            f"{split_nodes} split-op calls ({', '.join(self.matcher.describe()) or 'none'})"
        )
        if len(self.graphs) > 1:
            logger.warning(
                "%s; this is compile number %d: a recompile (a guard failed, e.g. a new "
                "dtype or a dimension that is not the token dimension changed) or a graph "
                "break. Graphs of each compile are captured separately.",
                msg,
                len(self.graphs),
            )
        else:
            logger.info("%s", msg)
        return sg.module


@contextlib.contextmanager
def _size_oblivious() -> Iterator[None]:
    """Compile without specializing the token dimension on sizes 0 and 1.

    By default dynamo specializes a dynamic dimension that is 1 at runtime, so a batch
    of 1 token would recompile. ``backed_size_oblivious`` (torch >= 2.8) keeps one
    graph for every size; older versions recompile once for size 1 (logged).
    """
    try:
        import torch.fx.experimental._config as fx_config
    except ImportError:  # pragma: no cover - very old torch
        yield
        return
    if not hasattr(fx_config, "backed_size_oblivious"):
        yield
        return
    with fx_config.patch(backed_size_oblivious=True):  # type: ignore[attr-defined]
        yield


__all__ = ["PiecewiseCompiler"]
