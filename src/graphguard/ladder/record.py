"""One record per captured size: every fact graphguard keeps about a size's graph(s).

Why one record: a captured graph is described by several facts that features read
(the memory its capture took for the ledger and the budget, what its capture saw of the
weights for ``check_weights``, what provenance proved it reads for ``audit`` and partial
recapture, how and when it was captured for ``stats()``). Kept in parallel dictionaries,
every capture, drop, release and partial recapture has to update each of them, and a
site that updates a subset leaves them disagreeing. Here they hang from one
:class:`GraphRecord`, which :class:`~graphguard.ladder.store.GraphStore` alone creates,
replaces and drops; every feature reads it.

Per size, not per graph: a size is what a capture run keeps or fails, what the ledger and
the budget count, and what a batch pads to. A PIECEWISE runner holds one graph per piece
at each size; their reads are kept per graph inside the size's record
(:attr:`GraphRecord.reads`, keyed ``(size, piece)``), so a partial recapture of some pieces
replaces those pieces' reads and nothing else.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from graphguard.provenance import GraphProvenance, Pending
from graphguard.weights.record import GraphKey, WeightRecord


@dataclass
class GraphRecord:
    """What is known of one captured size's graph(s), from its latest capture."""

    size: int
    how: str
    """``up front`` (``capture()``, a recapture) or ``lazily`` (on first use)."""
    pool_bytes: int
    """The pool growth its captures took (kept across a recapture of the same size: the
    blocks stay in the pool)."""
    driver_bytes: int
    """The driver's share of its live graph(s), outside the caching allocator."""
    capture_s: float
    """Warmups plus capture of its latest capture, in seconds."""
    warmups: int
    """Uncaptured warmup forwards its latest capture ran."""
    prewarmed: bool
    """Its latest capture counted an earlier forward as its first warmup."""
    phases: dict[str, float]
    """The cost by phase of the capture run that made it (shared by the sizes of one run;
    a lazy capture's own)."""
    calls_at_capture: int
    """The runner's call count when it was captured (``stats()``'s unused-size warning)."""
    weights: WeightRecord | None = None
    """What its capture saw of the module's parameters and buffers (None: no module)."""
    reads: dict[GraphKey, GraphProvenance] = field(default_factory=dict)
    """Per graph, what provenance proved it reads (empty: provenance off, or not read
    yet)."""
    pending: dict[GraphKey, Pending] = field(default_factory=dict)
    """Per graph captured with provenance on and not read yet: what its capture saw, read
    on the first question (:meth:`graphguard.provenance.Provenance.resolve`)."""
    unread: bool = False
    """Provenance was on and some graph of this size could not be read: which tensors it
    reads is not known, so a moved tensor recaptures it."""


__all__ = ["GraphRecord"]
