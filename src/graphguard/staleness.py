"""What the graphs read, checked against now: the ``stale`` and ``undecided`` lists of
:class:`~graphguard.audit.Audit`.

A graph keeps taking the addresses it was captured with. A named read is stale when its
owner no longer holds that storage (freed, replaced, moved); an unnamed allocation a graph
takes is stale when it was freed since and the graph is proven to take it, and undecided
when nothing proves it does (see :mod:`graphguard.classification`).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch

from graphguard._graph_args import Span
from graphguard.classification import GraphProvenance
from graphguard.owners import Owner, Owners, hit_spans, spans_of
from graphguard.weights.record import GraphKey, MovedWeight

Findings = dict[str, tuple[str, list[GraphKey]]]
"""By name: what is wrong with it, and the graphs that read it."""

Listed = tuple[tuple[str, str, tuple[GraphKey, ...]], ...]
"""``(name, what, graphs)`` rows, the graphs in graph order."""


def in_graph_order(keys: Iterable[GraphKey]) -> tuple[GraphKey, ...]:
    """Distinct graphs by size, then piece (a whole graph first)."""
    return tuple(sorted(set(keys), key=lambda k: (k[0], -1 if k[1] is None else k[1])))


def stale_now(
    graphs: Sequence[GraphProvenance],
    moved_derived: Sequence[MovedWeight],
    now: Owners,
    freed: Sequence[Span] = (),
) -> tuple[Listed, Listed]:
    """The stale and the undecided reads of ``graphs``: every named read checked against
    the owners ``now`` (the derived ones already checked where their slot is:
    ``moved_derived``), and every unnamed allocation a graph took (live when it was read)
    against ``freed``, the allocator's free blocks now: one freed since is memory the graph
    still writes or reads that no tensor holds (a library's workspace dropped under it)."""
    by_name = {o.name: o for o in now.owners}
    stale: Findings = {}
    for m in moved_derived:
        stale[m.name] = (m.change, list(m.graphs))
    free = spans_of(freed) if freed else None
    undecided: Findings = {}
    for gp in graphs:
        key = (gp.size, gp.piece)
        _note_freed_when_read(gp, key, stale, undecided)
        if free is not None:
            _note_freed_since_read(gp, key, free, stale, undecided)
        _note_moved_reads(gp, key, by_name, stale)
    return _listed(stale), _listed(undecided)


def _listed(found: Findings) -> Listed:
    return tuple((n, w, in_graph_order(k)) for n, (w, k) in found.items())


def _note_freed_when_read(
    gp: GraphProvenance, key: GraphKey, stale: Findings, undecided: Findings
) -> None:
    """Memory no tensor held when the graph was read: stale where the graph is proven to
    take it (freed or replaced), undecided where nothing decides."""
    for w in gp.unowned:
        name = w.last_owner or f"unnamed memory at {w.address:#x} ({w.kernel})"
        what = "freed before the graph was read: the graph still takes its address"
        stale.setdefault(name, (what, []))[1].append(key)
    for w in gp.undecided:
        name = f"unnamed memory at {w.address:#x} ({w.kernel})"
        undecided.setdefault(name, (f"freed when the graph was read; {w.why}", []))[1].append(key)


def _note_freed_since_read(
    gp: GraphProvenance,
    key: GraphKey,
    free: tuple[torch.Tensor, torch.Tensor],
    stale: Findings,
    undecided: Findings,
) -> None:
    """Unnamed allocations live when the graph was read, inside a free block now."""
    live = [w for w in gp.unknown if not w.freed]
    if not live:
        return
    addrs = torch.tensor([w.address for w in live], dtype=torch.int64)
    gone = (hit_spans(*free, addrs) >= 0).tolist()
    for w, g in zip(live, gone):
        if not g:
            continue
        name = f"unnamed {w.nbytes} B allocation at {w.address:#x} ({w.kernel})"
        if w.proven:
            what = "freed since capture: the graph still takes its address"
            stale.setdefault(name, (what, []))[1].append(key)
        else:
            what = f"freed since the graph was read; {w.why}"
            undecided.setdefault(name, (what, []))[1].append(key)


def _note_moved_reads(
    gp: GraphProvenance, key: GraphKey, by_name: dict[str, Owner], stale: Findings
) -> None:
    """Named reads (outputs and derived tensors aside) whose owner no longer holds the
    storage the graph reads."""
    for r in gp.reads:
        if r.kind in ("output", "derived"):
            continue
        cur = by_name.get(r.name)
        if cur is not None and cur.start == r.start:
            continue
        dead = r.ref is not None and r.ref.expired()
        what = (
            "freed"
            if dead
            else "replaced or moved; the graph reads the old storage"
            if cur is not None
            else "no longer held by its owner"
        )
        stale.setdefault(r.name, (what, []))[1].append(key)
