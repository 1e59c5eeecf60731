"""Graph provenance: what each captured graph reads, proven from the graph itself.

A CUDA graph freezes raw device addresses, and every hazard graphguard exists for is a
graph reading an address whose owner changed. Inferring reads from the module tree misses
what no module lists (a weight transposed at load, a re-created state buffer) and forces
"every graph" answers. So each captured graph's node arguments are read
(:mod:`graphguard._graph_args`) and each word is resolved to an owner, or decided
unknown or unowned (:mod:`graphguard.classification` has the rules, per graph).

**What is read when.** At capture, only what cannot be known later: the owners the
capture saw (one table per capture run, plus each graph's outputs) and, for a CUDA
graph, the graph itself (kept, ``keep_graph=True``: its nodes never change after capture,
so reading them later reads what the capture recorded). The nodes, the allocator's map
and the classification wait for the first question (``audit()``, ``check_weights()``, a
refit, ``update_weights``), which reads every graph not read yet against one allocator
map. Under the sanitizer everything is read at capture, with the allocator's map as the
capture began, because refusing a graph must happen before its first replay. Read later,
a word into memory freed since the capture is judged as it is now (memory no tensor owns
now), and a struct word into memory the step freed is only unknown (the proof that it
was live as the capture began is the sanitizer's).

The result per graph is :class:`GraphProvenance`, kept on that graph's record; a runner
keeps one :class:`Provenance` (``runner.audit()`` reports it, ``check_weights()`` and the
refit use it). The replay path gains nothing.
"""

from __future__ import annotations

import itertools
import logging
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from graphguard import _graph_args
from graphguard._graph_args import GraphArgs, Span
from graphguard.arguments import PROVENANCE_ENV, env_switch
from graphguard.audit import Audit, freed_message
from graphguard.classification import GraphProvenance, Read, Word, classify, undecided_why
from graphguard.errors import FreedStorageError
from graphguard.owners import KINDS, Owner, Owners
from graphguard.staleness import in_graph_order, stale_now
from graphguard.weights.record import GraphKey, MovedWeight, held_by

logger = logging.getLogger("graphguard")

KEEP = "keep"
"""``read_args`` for a capture whose graph is kept and read on the first question."""


# ------------------------------------------------------------------ a graph not read yet


@dataclass
class Pending:
    """A graph captured with provenance on, not read yet: what its capture saw, kept for
    the first question (see the module docstring: what is read when)."""

    key: GraphKey
    seq: int
    """Capture order: graphs are read in it, so each names the owners earlier ones saw."""
    owners: Owners
    args: GraphArgs | None
    """What the capture recorded (the CPU emulation), else None."""
    graph: Any
    """The kept CUDA graph, read on the first question (None: nothing to read)."""
    reused: bool = False
    """``owners`` is an earlier run's table, re-proved unchanged rather than walked again:
    a word no owner explains is looked up again in a fresh walk when the graph is read
    (an attribute made since that walk)."""


class Reads(Protocol):
    """What provenance reads of one captured size's record (a
    :class:`~graphguard.ladder.record.GraphRecord`): each of its graphs' provenance, the
    graphs not read yet, and whether one of them could not be read."""

    @property
    def reads(self) -> dict[GraphKey, GraphProvenance]: ...

    @property
    def pending(self) -> dict[GraphKey, Pending]: ...

    unread: bool


@dataclass(frozen=True)
class NamedRead:
    """One named storage some graph reads, with the graphs that read it."""

    name: str
    kind: str
    start: int
    nbytes: int
    graphs: tuple[GraphKey, ...]
    slot: Any = field(default=None, compare=False, repr=False)


# ------------------------------------------------------------------ the runner's record


class Provenance:
    """A runner's provenance: whether its captures are read, what each graph read turned
    into (:meth:`take` at capture, :meth:`resolve` on the first question; one
    :class:`GraphProvenance` per graph, kept on that graph's record), and the questions
    asked of those records afterwards.

    The owners history (who held which memory when an earlier graph was read) is the one
    thing kept here across graphs: it names the last owner of memory a later graph takes."""

    def __init__(
        self,
        label: str,
        option: bool | None,
        *,
        strict: bool = False,
        device: torch.device | None = None,
    ) -> None:
        self.label = label
        self.option = option
        self.strict = strict
        """Read at capture and refuse a graph taking a pointer no live tensor owns (the
        runner's ``sanitize``); otherwise read on the first question and warn about it
        (once per graph), listed in :meth:`audit`."""
        self.device = device
        self._history: dict[int, Owner] = {}
        self._history_table: Owners | None = None
        """``_history`` as sorted intervals, rebuilt only when an owner is new."""
        self._memo: dict[Any, Any] = {}
        """Answers for one version of the records (``check_weights()`` asks on every call;
        read-only)."""
        self._memo_key: Any = None
        self._generation = 0
        """Bumped whenever graphs were read (their records gained reads)."""
        self._seq = itertools.count()
        self._run_owners: Owners | None = None
        self._run_reused = False
        self._last_owners: Owners | None = None
        self._build: Callable[[], Owners] | None = None
        self._why = "no capture yet"
        self._reads: str | None = None
        self.on = False

    def decide(self, reads_graphs: str | None, backend_name: str) -> bool | str:
        """Whether this run's captures are read (``provenance`` option; the environment
        for a runner that left it unset; what the backend can read,
        :attr:`GraphBackend.reads_graphs <graphguard.backend.GraphBackend.reads_graphs>`),
        as the capture's ``read_args``: False, True (read at capture: the sanitizer, the
        CPU emulation) or :data:`KEEP` (keep the graph, read on the first question).
        Called once per capture run: the run's owners are taken again."""
        self._run_owners = None
        option = self.option
        if option is None and os.environ.get(PROVENANCE_ENV, "").strip():
            option = env_switch(PROVENANCE_ENV, "provenance")
        self._reads = reads_graphs
        if option is False:
            self.on, self._why = False, "provenance=False"
        elif reads_graphs == "cuda":
            # Not imported here (the first capture does): driver() only to log its absence.
            self.on = _graph_args.available() or _graph_args.driver() is not None
            how = "read at capture (sanitize)" if self.strict else "read on first use"
            why = "on by default" if option is None else "provenance=True"
            self._why = (
                f"CUDA graphs, cuda-bindings, {why}, {how}"
                if self.on
                else "cuda-bindings not importable (pip install graphguard[cuda])"
            )
        elif reads_graphs == "cpu" and option:
            self.on, self._why = True, "RecordingBackend reads, provenance=True"
        else:
            self.on = False
            self._why = (
                "the CPU emulation reads only with provenance=True"
                if reads_graphs == "cpu"
                else f"backend {backend_name!r} cannot read graphs"
            )
        if not self.on:
            return False
        return True if self.strict or reads_graphs != "cuda" else KEEP

    def saw(self, owners: Owners) -> None:
        """``owners`` held their memory as a capture began (the sanitizer's walk just before
        it): a graph that then takes memory one of them dropped names it as the last owner,
        as memory an earlier graph's owners held is named. Only memory with no history yet:
        what an earlier graph saw there (an arena's old buffer) still decides."""
        for o in owners.owners:
            if o.kind != "output" and o.start not in self._history:
                self._history[o.start] = o
                self._history_table = None

    def run_owners(
        self, build: Callable[[], Owners], still: Callable[[Owners], bool] | None = None
    ) -> Owners:
        """The owners of this capture run: built once per run (a walk of the module), or
        the last run's when ``still(last)`` re-proves it (every tensor it names the same
        object at the same address: a lazy size's capture then walks nothing). Under the
        sanitizer every run walks (its graphs are judged at capture, with nothing later)."""
        if self._run_owners is None:
            last = self._last_owners
            self._build = build
            if last is not None and not self.strict and still is not None and still(last):
                self._run_owners, self._run_reused = last, True
            else:
                self._run_owners, self._run_reused = build(), False
            self._last_owners = self._run_owners
        return self._run_owners

    def take(
        self, size: int, piece: int | None, args: GraphArgs | None, graph: Any, owners: Owners
    ) -> GraphProvenance | Pending:
        """What the graph just captured turns into: under ``strict``, classified now
        (``args`` read at capture; a graph taking a pointer into memory no live tensor
        owns raises :class:`FreedStorageError`, and the caller drops it); otherwise a
        :class:`Pending` read on the first question (:meth:`resolve`)."""
        key = (size, piece)
        if not self.strict:
            keep = graph if args is None else None
            return Pending(key, next(self._seq), owners, args, keep, self._run_reused)
        gp = self._classify(key, args, owners, refuse=True)
        return gp if gp is not None else Pending(key, next(self._seq), owners, None, None)

    def _classify(
        self, key: GraphKey, args: GraphArgs | None, owners: Owners, *, refuse: bool
    ) -> GraphProvenance | None:
        if args is None:
            return None
        if self._history_table is None:
            self._history_table = Owners(list(self._history.values()))
        gp = classify(args, owners, self._history_table, key[0], key[1])
        for o in owners.owners:
            if o.kind != "output" and self._history.get(o.start) != o:
                self._history[o.start] = o
                self._history_table = None
        if len(self._history) > 20000:  # bounded: the oldest go first
            for k in list(self._history)[:5000]:
                del self._history[k]
        if (gp.unowned or gp.undecided) and refuse:
            raise FreedStorageError(freed_message(self.label, gp, refused=True))
        if gp.undecided:
            logger.info(
                "%s: the %s graph takes %d word(s) into freed memory that nothing decides "
                "(listed in audit().undecided), e.g. %#x by %s: %s",
                self.label,
                gp.where,
                len(gp.undecided),
                gp.undecided[0].address,
                gp.undecided[0].kernel[:120],
                gp.undecided[0].why,
            )
        if gp.unowned:
            logger.warning(
                "%s (found when this graph was first read after its capture; warned once "
                "per graph; with sanitize=True it is refused at capture)",
                freed_message(self.label, gp, refused=False),
            )
        return gp

    def resolve(self, records: Mapping[int, Reads]) -> bool:
        """Read every graph not read yet, in capture order, against one allocator map;
        each joins its record (one that cannot be read marks the record ``unread``).
        Whether any was read."""
        pending = sorted(
            ((p, rec) for rec in records.values() for p in rec.pending.values()),
            key=lambda pr: pr[0].seq,
        )
        if not pending:
            return False
        amap: _graph_args.AllocatorMap | None = None
        fresh: Owners | None = None
        for p, rec in pending:
            args = p.args
            if args is None and p.graph is not None and self._reads == "cuda":
                device = self.device or torch.device("cuda")
                if amap is None:
                    amap = _graph_args.AllocatorMap(device)
                args = _graph_args.read_cuda(p.graph, device, amap=amap)
            owners = p.owners
            if p.reused and args is not None and self._build is not None:
                # An earlier run's table: a word it cannot explain may be an attribute
                # made since that walk (a derived tensor); walk once now and look again.
                probe = classify(args, owners, Owners([]), p.key[0], p.key[1])
                if probe.unknown or probe.unowned:
                    if fresh is None:
                        fresh = self._build()
                    owners = owners.adding(fresh)
            gp = self._classify(p.key, args, owners, refuse=False)
            del rec.pending[p.key]
            if gp is None:
                rec.unread = True
            else:
                rec.reads[p.key] = gp
        self._generation += 1
        return True

    def _memo_for(self, records: Mapping[int, Reads], version: int) -> dict[Any, Any]:
        self.resolve(records)
        key = (version, self._generation)
        if key != self._memo_key:
            self._memo.clear()
            self._memo_key = key
        return self._memo

    def graphs(self, records: Mapping[int, Reads], version: int) -> list[GraphProvenance]:
        """Every graph's provenance (read now if not yet), by size then piece."""
        memo = self._memo_for(records, version)
        got: list[GraphProvenance] | None = memo.get("graphs")
        if got is None:
            got = [gp for rec in records.values() for gp in rec.reads.values()]
            got.sort(key=lambda gp: (gp.size, -1 if gp.piece is None else gp.piece))
            memo["graphs"] = got
        return got

    def reads(self, records: Mapping[int, Reads], version: int) -> dict[int, set[int]] | None:
        """Per captured size, the storage addresses its graph(s) read; None when
        provenance is off or some captured graph could not be read."""
        per_graph = self.graph_reads(records, version)
        if per_graph is None:
            return None
        memo = self._memo_for(records, version)
        got: dict[int, set[int]] | None = memo.get("reads")
        if got is None:
            got = {}
            for (size, _), addrs in per_graph.items():
                got.setdefault(size, set()).update(addrs)
            memo["reads"] = got
        return got

    def graph_reads(
        self, records: Mapping[int, Reads], version: int
    ) -> dict[GraphKey, set[int]] | None:
        """Per graph (size, piece), the storage addresses it reads; None as for
        :meth:`reads`. A PIECEWISE runner's pieces apart: what lets a moved tensor
        recapture only the pieces that read it."""
        if not self.on:
            return None
        memo = self._memo_for(records, version)
        if any(r.unread for r in records.values()):
            return None
        got: dict[GraphKey, set[int]] | None = memo.get("graph_reads")
        if got is None:
            got = {
                (gp.size, gp.piece): {r.start for r in gp.reads}
                for gp in self.graphs(records, version)
            }
            memo["graph_reads"] = got
        return got

    def taken(self, records: Mapping[int, Reads], size: int) -> list[Span] | None:
        """What the graphs of ``size`` take, as read (nothing is read here): the spans of
        the named storages they read and, one byte each, the unnamed words; None when not
        read (provenance off, or not yet: the sanitizer reads at capture)."""
        rec = records.get(size)
        if not self.on or rec is None or rec.unread or rec.pending:
            return None
        spans: list[Span] = []
        for gp in rec.reads.values():
            spans += [(r.start, r.start + r.nbytes) for r in gp.reads]
            spans += [(w.address, w.address + 1) for w in (*gp.unknown, *gp.unowned)]
        return spans

    def named(self, records: Mapping[int, Reads], version: int) -> dict[str, NamedRead] | None:
        """Every named storage some graph reads (outputs aside), with the graphs that read
        it; None when not known (provenance off, a graph not readable)."""
        if self.graph_reads(records, version) is None:
            return None
        memo = self._memo_for(records, version)
        got: dict[str, NamedRead] | None = memo.get("named")
        if got is None:
            by: dict[str, tuple[Read, list[GraphKey]]] = {}
            for gp in self.graphs(records, version):
                for r in gp.reads:
                    if r.kind != "output":
                        by.setdefault(r.name, (r, []))[1].append((gp.size, gp.piece))
            got = {
                n: NamedRead(n, r.kind, r.start, r.nbytes, in_graph_order(keys), r.slot)
                for n, (r, keys) in by.items()
            }
            memo["named"] = got
        return got

    def derived(
        self, records: Mapping[int, Reads], version: int
    ) -> tuple[tuple[str, ...], list[MovedWeight]]:
        """The derived tensors the graphs read, and, graph by graph, those whose attribute
        no longer holds the storage that graph took (each with the graphs reading the old
        one): a graph captured after a derived tensor was re-created reads the new one and
        is not named. Each name is looked up where it lives (its slot), not by a walk."""
        if not self.on:
            return (), []
        memo = self._memo_for(records, version)
        taken: dict[str, tuple[Any, dict[GraphKey, tuple[int, int]]]] | None = memo.get("derived")
        if taken is None:
            taken = {}
            for gp in self.graphs(records, version):
                for r in gp.reads:
                    if r.kind == "derived":
                        entry = taken.setdefault(r.name, (r.slot, {}))
                        entry[1][(gp.size, gp.piece)] = (r.start, r.nbytes)
            memo["derived"] = taken
        if not taken:
            return (), []
        moved = []
        for name, (slot, by_graph) in taken.items():
            t = held_by(slot) if slot is not None else None
            ptr = int(t.untyped_storage().data_ptr()) if t is not None else None
            stale = {k: v for k, v in by_graph.items() if v[0] != ptr}
            if not stale:
                continue
            start = next(iter(stale.values()))[0]
            what = (
                "no longer a tensor attribute of the module"
                if ptr is None or t is None
                else f"derived tensor re-created ({start:#x} -> {ptr:#x})"
            )
            graphs = in_graph_order(stale)
            # Only the storage's size is known of a derived tensor's layout.
            relaid = t is None or any(
                int(t.untyped_storage().nbytes()) != n for _, n in stale.values()
            )
            sizes = tuple(sorted({k[0] for k in graphs}))
            moved.append(MovedWeight(name, what, sizes, graphs, relaid))
        return tuple(sorted(taken)), moved

    def audit(
        self,
        records: Mapping[int, Reads],
        now: Owners,
        freed: Sequence[Span] = (),
        version: int = -1,
    ) -> Audit:
        """The records, with every named read checked against the owners ``now`` (a
        derived one where its slot is, as :meth:`derived` checks it), and every unnamed
        allocation a graph took (live when it was read) against ``freed``, the
        allocator's free blocks now: one freed since is memory the graph still writes or
        reads that no tensor holds (a library's workspace dropped under it, say)."""
        graphs = self.graphs(records, version) if self.on or records else []
        _, moved_derived = self.derived(records, version)
        stale, undecided = stale_now(graphs, moved_derived, now, freed)
        return Audit(
            runner=self.label,
            enabled=self.on,
            why=self._why,
            graphs=tuple(graphs),
            stale=stale,
            undecided=undecided,
        )


__all__ = [
    "KEEP",
    "KINDS",
    "Audit",
    "GraphKey",
    "GraphProvenance",
    "NamedRead",
    "Owner",
    "Owners",
    "Pending",
    "Provenance",
    "Read",
    "Reads",
    "Word",
    "classify",
    "held_by",
    "undecided_why",
]
