"""The FULL kind (:class:`~graphguard.ladder.kind.GraphKind`): one CUDA graph of the whole
callable per size, its outputs handed out as cached views (:class:`FullGraphs`), which
:class:`~graphguard.GraphRunner` hands its ladder.

The replay of an entry is ``graph.replay()`` and the cached output views: nothing on it
allocates, synchronizes or logs.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from graphguard._torch_compat import unowned
from graphguard.backend import Captured, Graph, GraphBackend, free_graph
from graphguard.buffers import flatten, immutable_structure, unflatten
from graphguard.compiled import CompiledStep, compiled_capture_sizes
from graphguard.entries import Entry
from graphguard.errors import ConfigError, GraphGuardError
from graphguard.ladder.kind import KindSite, PieceCapture, Prove
from graphguard.outputs import check_output_leaves
from graphguard.report import CaptureReport
from graphguard.serving import CaptureGuard
from graphguard.sizes import Hook
from graphguard.weights.record import GraphKey

logger = logging.getLogger("graphguard")


def _unowned(x: Any) -> Any:
    """A view of a CUDA tensor's memory that does not own it
    (:func:`graphguard._torch_compat.unowned`); anything else is returned as is.

    Once the owning tensor dies its block is free in the graph pool, so the next
    (smaller) capture reuses it, while this graph keeps writing there on every replay.
    Safe because the pool is private (only captures into it reuse its blocks) and outputs
    are valid only until the next call, whichever graph that call replays.
    """
    if not isinstance(x, torch.Tensor) or not x.is_cuda:
        return x
    return unowned(x)


class WholeGraphs:
    """The graphs of a FULL runner, one per size, and each graph's own outputs (the
    store's :class:`~graphguard.ladder.store.GraphSet`).

    With ``share_outputs`` every graph's outputs are handed back to the pool right after
    its capture (kept as unowned views, :func:`_unowned`), so the next capture reuses
    their blocks and no graph copies its outputs anywhere: the ladder's pool is about the
    largest graph's alone (measured 1.007x on the reference model, where copying into the
    largest graph's outputs cost 1.47x). Without it each graph owns its outputs.

    Which output leaves are batched, and along which dim, is the ladder's output layout
    (:mod:`graphguard.outputs`), checked on every forward; this set only keeps the graphs.
    """

    def __init__(self, name: str, share_outputs: bool) -> None:
        self.name = name
        self.share_outputs = share_outputs
        self.graphs: dict[int, Graph] = {}
        self.graph_leaves: dict[int, list[Any]] = {}
        self.out_leaves: list[Any] | None = None
        """The first (largest) graph's output leaves."""
        self.out_spec: Any = None
        self.owner_size = 0
        self._pending_spec: Any = None

    def body(self, size: int, forward: Callable[[], Any]) -> Callable[[], list[Any]]:
        """The work recorded for ``size``: ``forward()``, its outputs flattened."""

        def run() -> list[Any]:
            leaves, spec = flatten(forward())
            if self.out_leaves is None:
                check_output_leaves(leaves, f"{self.name} (capture at size {size})")
            self._pending_spec = spec
            return leaves

        return run

    def register(self, size: int, graph: Graph, leaves: list[Any]) -> None:
        """Keep a successful capture (with ``share_outputs``, its outputs as unowned views)."""
        if self.share_outputs:
            # In place: the lifecycle's reference to this list must not keep them alive.
            leaves[:] = [_unowned(x) for x in leaves]
        self.graph_leaves[size] = leaves
        if self.out_leaves is None:
            self.out_leaves = leaves
            self.out_spec = self._pending_spec
            self.owner_size = size
        elif size == self.owner_size:
            self.out_leaves = leaves  # the reference size recaptured alone
        self.graphs[size] = graph

    def sizes(self) -> list[int]:
        return list(self.graphs)

    def graph_keys(self) -> tuple[GraphKey, ...]:
        return tuple((s, None) for s in sorted(self.graphs))

    def forget(self, sizes: Sequence[int]) -> list[Graph]:
        """Forget the graphs of ``sizes`` (a partial recapture) and return them, still
        alive: they hold the pool while its next capture runs; the output reference stays."""
        gone = []
        for size in sizes:
            graph = self.graphs.pop(size, None)
            if graph is not None:
                gone.append(graph)
            self.graph_leaves.pop(size, None)
        if not self.graphs:
            self.out_leaves = None
        return gone

    def clear(self) -> None:
        """Forget every graph and output (a throwaway capture, release)."""
        for graph in self.graphs.values():
            free_graph(graph)
        self.graphs.clear()
        self.graph_leaves.clear()
        self.out_leaves = None

    def entry_parts(self, n: int, size: int, dims: list[int | None] | None) -> dict[str, Any]:
        base = self.graph_leaves[size]
        dims = dims or [None] * len(base)
        leaves = [x if d is None else x.narrow(d, 0, n) for x, d in zip(base, dims)]
        cached = immutable_structure(self.out_spec)
        return {
            "replay": self.graphs[size].replay,
            "leaves": leaves,
            "batch_dims": dims,
            "output": unflatten(leaves, self.out_spec) if cached else None,
        }


class FullGraphs:
    """The FULL kind (:class:`~graphguard.ladder.kind.GraphKind`): one graph of the whole
    callable per size, its outputs handed out as cached views; with ``compile``, the
    graphs record an Inductor-compiled step (:class:`graphguard.compiled.CompiledStep`)."""

    def __init__(
        self, fn: Callable[..., Any], *, share_outputs: bool, compile: bool, sizes_given: bool
    ) -> None:
        self.fn = fn
        self.compile = compile
        self.sizes_given = sizes_given
        self.graphs = WholeGraphs("", share_outputs)
        self.compiled_step: CompiledStep | None = None
        self.copy_outputs = False
        self.label = ""
        self._prove: Prove | None = None

    @property
    def compiled(self) -> bool:
        return self.compiled_step is not None

    def ladder(self, sizes: tuple[int, ...]) -> tuple[int, ...]:
        """``compile=True`` without ``sizes``: Inductor guards ``2 <= size`` on
        batch-broadcast steps, so size 1 would compile a second graph; batch 1 pads to 2
        (one compile for the ladder)."""
        if self.compile and not self.sizes_given:
            return tuple(compiled_capture_sizes(sizes[-1]))
        return sizes

    def bind(self, site: KindSite) -> None:
        """``compile=True``: compile once for the ladder (see :mod:`graphguard.compiled`)."""
        self.label = site.label
        self.graphs.name = site.name
        self.copy_outputs = site.copy_outputs
        self._prove = site.prove
        if self.compile and 1 in site.sizes and len(site.sizes) > 1:
            logger.info(
                "%s: compile=True with size 1 in sizes: a step that broadcasts batch-sized "
                "inputs gets Inductor's `size >= 2` guard, and size 1 compiles a second graph "
                "(report.compiles says). Leave sizes=None for compiled_capture_sizes(), which "
                "pads batch 1 to 2.",
                site.label,
            )
        if not self.compile:
            return
        if isinstance(self.fn, CompiledStep):
            raise ConfigError(
                f"{site.label}: compile=True, but fn is already a CompiledStep(...); pass the "
                "plain step with compile=True, or the compiled one with compile=False"
            )
        self.compiled_step = CompiledStep(
            self.fn, batch_dims=[s.batch_dim for s in site.static.specs], name=site.name
        )

    def hooks(self) -> list[Hook]:
        return []

    def capture_backend(self, inner: GraphBackend) -> GraphBackend:
        return inner

    def forward(self, *views: torch.Tensor) -> Any:
        step = self.compiled_step
        return self.fn(*views) if step is None else step(*views)

    def body(self, size: int, forward: Callable[[], Any]) -> Callable[[], Any]:
        return self.graphs.body(size, forward)

    def register(self, size: int, captured: Captured) -> None:
        """Keep a capture, once provenance has proven what it reads (a graph refused there
        is destroyed: it fails its size like any capture error)."""
        assert self._prove is not None  # bound at construction
        try:
            self._prove(size, None, captured, captured.result)
        except BaseException:
            free_graph(captured.graph)
            raise
        self.graphs.register(size, captured.graph, captured.result)

    def run(self, e: Entry) -> Any:
        """Both replay paths end here (inputs and padded rows in place): replay, hand out
        the output views."""
        e.replay()
        out = e.output
        if out is None:
            out = unflatten(e.leaves, self.graphs.out_spec)
        if self.copy_outputs:
            out = torch.utils._pytree.tree_map_only(torch.Tensor, torch.clone, out)
        return out

    def fill_report(self, report: CaptureReport) -> CaptureReport:
        """With ``compile=True``: the compiles, their seconds and any recompile reasons."""
        step = self.compiled_step
        return report if step is None else step.fill_report(report)

    def extra_reads(self) -> dict[GraphKey, set[int]]:
        return {}

    def capture_pieces(
        self, graphs: Mapping[int, set[int]], capture: PieceCapture, guard: CaptureGuard
    ) -> CaptureReport:
        raise GraphGuardError(f"{self.label}: this runner has no pieces to capture alone")


__all__ = ["FullGraphs", "WholeGraphs"]
