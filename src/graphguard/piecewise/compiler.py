"""The ``torch.compile`` backend that splits the graph at split ops and wraps the pieces.

Dynamo hands :class:`PiecewiseCompiler` one FX graph per compile; it splits it
(:func:`~graphguard.piecewise.split.split_graph`), replaces each piece by a
:class:`~graphguard.piecewise.pieces.PiecewiseGraph` and each split op by an eager
wrapper. More than one compile is a recompile (or a graph break): the first one is
logged as a warning naming the guard that failed, the source line that added it (from
``torch._dynamo.utils.guard_failures``), and the fix; :attr:`recompile_reasons` keeps them.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.fx

from graphguard._torch_compat import GuardFailures
from graphguard.piecewise.pieces import EagerSplit, PiecewiseGraph, Session
from graphguard.piecewise.split import (
    SplitGraph,
    SplitMatcher,
    SplitOp,
    qualified_op_name,
    split_graph,
)

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
        session: Session | None = None,
    ) -> None:
        self.matcher = SplitMatcher(split_ops)
        self.name = name
        self.session = session if session is not None else Session(name=name)
        self.graphs: list[torch.fx.GraphModule] = []
        self.splits: list[SplitGraph] = []
        self.pieces: list[PiecewiseGraph] = []
        self.recompile_reasons: list[str] = []
        """Guard failures dynamo recorded before each recompile (``"guard  # source"``)."""
        self._guard_failures = GuardFailures()

    @property
    def compile_count(self) -> int:
        return len(self.graphs)

    def split_points(self) -> dict[str, int]:
        """Split-op calls per op over every compiled graph (``{"mylib::attention": 2}``)."""
        counts: dict[str, int] = {}
        for gm in self.graphs:
            for node in gm.graph.nodes:
                if self.matcher(node):
                    op = qualified_op_name(node.target) or str(
                        getattr(node.target, "__name__", node.target)
                    )
                    counts[op] = counts.get(op, 0) + 1
        return counts

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
            setattr(sg.module, name, EagerSplit(sg.module.get_submodule(name), self.session))
        self.splits.append(sg)
        split_nodes = sum(1 for n in gm.graph.nodes if self.matcher(n))
        msg = (
            f"{self.name}: graph {len(self.graphs)} split into {len(sg.pieces)} pieces at "
            f"{split_nodes} split-op calls ({', '.join(self.matcher.describe()) or 'none'})"
        )
        if len(self.graphs) > 1:
            reasons = [str(r) for _, r in self._guard_failures.new()]
            self.recompile_reasons.extend(reasons)
            if len(self.graphs) == 2:
                logger.warning("%s", recompile_message(self.name, reasons))
            logger.info("%s (compile number %d)", msg, len(self.graphs))
        else:
            logger.info("%s", msg)
        return sg.module


def _split_reason(reason: str) -> tuple[str, str]:
    """``"0/0: x.size()[0] != 1  # q = q.reshape(T, H, hd)  # file.py:15 in step (...)"``
    -> (the guard, where it came from)."""
    head, _, rest = reason.partition("  # ")
    guard = head.split(": ", 1)[1] if ": " in head[:12] else head
    where = re.sub(r"\s*\([^()]*_dynamo/[^()]*\)\s*$", "", rest)
    return guard.strip(), where.strip()


def recompile_message(name: str, reasons: Sequence[str]) -> str:
    """The warning for a recompile: the failed guard, its source line, and the fix."""
    if not reasons:
        return (
            f"{name}: dynamo compiled the step a second time, but recorded no failed guard "
            "(a graph break with fullgraph=False, or a new code object). Each compile's "
            "pieces are captured separately (more graphs, more pool). Run with "
            "TORCH_LOGS=recompiles,graph_breaks to see why."
        )
    guard, where = _split_reason(reasons[0])
    src = f", added by: {where}" if where else ""
    specialized = "!= 1" in guard or "== 1" in guard or "!= 0" in guard
    global_state = "grad" in guard.lower() or "global_state" in guard.lower()
    fix = (
        "the grad mode (or other global state) differs from the capture's: capture and "
        "serve under the same torch.no_grad() / torch.inference_mode()"
        if global_state
        else "dynamo specialized the token dimension on size 1 (a contiguity check: `.reshape`, "
        "`.contiguous()` or `.flatten` of a non-contiguous tensor such as a slice of a fused "
        "qkv projection). Use `.view(...)` or `.unflatten(...)` on that line instead"
        if specialized
        else "a dimension other than the token dimension changed between sizes, or a value "
        "the step reads was specialized. If that dimension really varies, mark it with "
        "torch._dynamo.mark_dynamic before capture; otherwise keep it fixed"
    )
    more = f" ({len(reasons) - 1} more failed guard(s) recorded)" if len(reasons) > 1 else ""
    return (
        f"{name}: dynamo recompiled the step, so one graph does not serve every size: guard "
        f"`{guard}` failed{src}{more}. {fix}. Each compile's pieces are captured separately "
        "(more graphs, more pool); the capture report counts the compiles."
    )


__all__ = ["PiecewiseCompiler"]
