"""The runner kind as a part: how one kind of runner captures and replays its graphs.

:class:`~graphguard.ladder.GraphLadder` runs one capture lifecycle and one replay path for
every kind; what FULL (:class:`graphguard.ladder.full.FullGraphs`) and PIECEWISE
(:class:`graphguard.piecewise.kind.PieceGraphs`) differ in is a :class:`GraphKind` handed
to it at construction. The ladder never branches on kind.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from graphguard.backend import Captured, GraphBackend
from graphguard.buffers import StaticInputs
from graphguard.entries import Entry
from graphguard.ladder.store import GraphSet, GraphStore
from graphguard.report import CaptureReport
from graphguard.serving import CaptureGuard
from graphguard.sizes import Hook
from graphguard.weights.record import GraphKey

Prove = Callable[[int, "int | None", Captured, Sequence[Any]], None]
"""Provenance's proof of a graph just captured: ``(size, piece, captured, outputs)``
(:meth:`GraphReads.prove <graphguard.ladder.reads.GraphReads.prove>`); raises to refuse it."""


@dataclass(frozen=True)
class KindSite:
    """What the ladder built that a kind works on (given once, :meth:`GraphKind.bind`)."""

    label: str
    name: str
    sizes: tuple[int, ...]
    static: StaticInputs
    store: GraphStore
    prove: Prove
    copy_outputs: bool


class PieceCapture(Protocol):
    """Capture ``sizes`` again with the whole lifecycle (:meth:`GraphKind.capture_pieces`),
    the capture guard held: ``alone``, into a fresh pool of this call with nothing retired
    (pieces captured alone); else into the ladder's pool, their old graphs replaced."""

    def __call__(self, sizes: Sequence[int], *, alone: bool) -> CaptureReport: ...


class GraphKind(Protocol):
    """How one kind captures and replays. The ladder calls, in this order:

    1. ``ladder(sizes)``: at construction, the sizes this kind captures, from the
       resolved ones (FULL with ``compile=True`` pads batch 1 to 2).
    2. ``graphs``: the kind's graphs (a :class:`~graphguard.ladder.store.GraphSet`), which
       the ladder's store holds and drops.
    3. ``bind(site)``: once, the static buffers, the store and provenance's proof
       (:class:`KindSite`).
    4. ``hooks()``: ``before_capture`` hooks the kind runs before the user's (a compile).
    5. ``capture_backend(inner)``: the backend the lifecycle captures with (PIECEWISE
       wraps the device's: one "capture" is one forward in which every piece captures).
    6. ``forward(*views)``: the forward every warmup and capture runs (``compiled``: it
       runs compiled code, where Inductor may fold weights and under which the write
       watch, a dispatch mode, cannot run).
    7. ``body(size, forward)`` then ``register(size, captured)``: what a capture at
       ``size`` records around the observed ``forward``, and keeping it.
    8. ``run(entry)``: replay an entry whose inputs and padded rows are in place; its
       outputs (the replay path calls it on every replay: nothing else on it).
    9. ``fill_report(report)``: what the kind adds to ``capture()``'s report (the
       compiles), and says of it.

    For the weights: ``extra_reads()`` (storages each graph reads that provenance may not
    name) and ``capture_pieces(graphs, capture, guard)`` (only the pieces that read a
    moved tensor; a kind without pieces refuses).
    """

    @property
    def graphs(self) -> GraphSet: ...

    @property
    def compiled(self) -> bool: ...

    def ladder(self, sizes: tuple[int, ...]) -> tuple[int, ...]: ...

    def bind(self, site: KindSite) -> None: ...

    def hooks(self) -> list[Hook]: ...

    def capture_backend(self, inner: GraphBackend) -> GraphBackend: ...

    def forward(self, *views: torch.Tensor) -> Any: ...

    def body(self, size: int, forward: Callable[[], Any]) -> Callable[[], Any]: ...

    def register(self, size: int, captured: Captured) -> None: ...

    def run(self, e: Entry) -> Any: ...

    def fill_report(self, report: CaptureReport) -> CaptureReport: ...

    def extra_reads(self) -> dict[GraphKey, set[int]]: ...

    def capture_pieces(
        self, graphs: Mapping[int, set[int]], capture: PieceCapture, guard: CaptureGuard
    ) -> CaptureReport: ...


__all__ = ["GraphKind", "KindSite", "PieceCapture", "Prove"]
