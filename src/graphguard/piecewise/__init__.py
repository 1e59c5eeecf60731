"""PIECEWISE graphs: ``torch.compile`` once, split at chosen ops, one CUDA graph per piece and size.

Ops that do not graph well for every batch (attention over a ragged prefill batch) run
eagerly; everything between them is captured, so a mixed batch still saves most of its
launch overhead. :class:`PiecewiseRunner` has the whole ladder API of
:class:`~graphguard.GraphRunner` (``__call__``, ``static_inputs``/``replay``,
``release``/``recapture``, ``verify``).

Modules: :mod:`.split` (FX split at split ops), :mod:`.pieces` (a graph per piece and
size), :mod:`.compiler` (the ``torch.compile`` backend), :mod:`.runner` (the runner).
"""

from __future__ import annotations

from graphguard.piecewise.compiler import PiecewiseCompiler
from graphguard.piecewise.pieces import PiecewiseGraph
from graphguard.piecewise.runner import PiecewiseRunner
from graphguard.piecewise.split import SplitGraph, SplitMatcher, SplitOp, split_graph

__all__ = [
    "PiecewiseCompiler",
    "PiecewiseGraph",
    "PiecewiseRunner",
    "SplitGraph",
    "SplitMatcher",
    "SplitOp",
    "split_graph",
]
