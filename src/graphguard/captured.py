"""What one capture produced, as the capture lifecycle and every backend see it.

Apart from :mod:`graphguard.backend` (the protocol and the CUDA backend) so that the
CPU emulation (:mod:`graphguard.recording`) returns the same type without importing it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from graphguard._graph_args import GraphArgs


class Graph(Protocol):
    """A captured graph: replay is the only operation the hot path needs."""

    def replay(self) -> None: ...


@dataclass(frozen=True)
class Captured:
    """What one :meth:`GraphBackend.capture` produced: the graph, what the body returned,
    and, when asked (``read_args``), every kernel argument the graph takes
    (:class:`~graphguard._graph_args.GraphArgs`; None: not asked, or not readable).

    Returned, not attached to the graph: what a capture read travels with the capture,
    through the lifecycle's ``register``, to provenance, and nothing is set on torch's
    graph object."""

    graph: Graph
    result: Any
    args: GraphArgs | None = None


__all__ = ["Captured", "Graph"]
