"""The graphs one runner holds, and everything known of each, in one object.

A :class:`GraphStore` keeps the ladder's one pool, the kind's graphs (a
:class:`GraphSet`: FULL graphs, or PIECEWISE pieces), one
:class:`~graphguard.ladder.record.GraphRecord` per captured size, the sizes refused since
the last ``capture()``, the graphs retired but not yet destroyed, and the tables the
replay path reads (one :class:`~graphguard.entries.Entry` per batch size, the padding
tables, the dirty-row mark). Every change of what the runner holds goes through it:

* :meth:`record_run` after every capture run creates or replaces the kept sizes' records and
  marks the sizes that failed;
* :meth:`retire` and :meth:`reap` drop graphs (their records with them);
* :meth:`evict` drops one size to make room under a budget (``Lazy(evict="lru")``),
  chosen by :meth:`recency`;
* :meth:`release` drops everything.

So the ledger (:class:`~graphguard.ledger.GraphLedger`), ``check_weights``, ``audit`` and
``stats()`` read the same records and cannot disagree. The store never imports a runner:
the kind's graphs come in as a :class:`GraphSet`, and it never touches the device except
to destroy graphs (:func:`~graphguard.backend.free_graph`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Protocol

from graphguard.backend import Graph, free_graph
from graphguard.buffers import InputWrites, StaticInputs
from graphguard.entries import Entry, build_entries, copy_into
from graphguard.ladder.record import GraphRecord
from graphguard.ledger import GraphLedger
from graphguard.outputs import OutputLayout
from graphguard.provenance import GraphProvenance, Pending
from graphguard.report import CaptureReport
from graphguard.serving import LAZILY
from graphguard.sizes import PaddingTable
from graphguard.stats import FAILED, ServingCounters
from graphguard.weights.record import GraphKey, WeightRecord


class GraphSet(Protocol):
    """A runner kind's graphs: what the store needs of them."""

    def sizes(self) -> list[int]:
        """The sizes that have a graph (all of their graphs, PIECEWISE)."""
        ...

    def graph_keys(self) -> tuple[GraphKey, ...]:
        """Every graph held, ``(size, piece)`` (piece None: a FULL graph)."""
        ...

    def forget(self, sizes: Sequence[int]) -> list[Graph]:
        """Forget the graphs of ``sizes`` and return them, still alive."""
        ...

    def clear(self) -> None:
        """Destroy every graph now (release, an aborted capture)."""
        ...

    def entry_parts(self, n: int, size: int, dims: list[int | None] | None) -> dict[str, Any]:
        """The kind's fields of the entry of batch ``n`` padded to ``size`` (``replay``,
        the cached outputs); ``dims``: each output leaf's batch dim."""
        ...


class GraphStore:
    """See the module docstring."""

    def __init__(
        self,
        label: str,
        graphs: GraphSet,
        static: StaticInputs,
        *,
        ladder: Sequence[int],
        lazy: bool,
        budget: int | None,
        refill_always: bool,
        output_dims: int | Sequence[int | None] | None = None,
    ) -> None:
        self.label = label
        self._output_dims = output_dims
        self.graphs = graphs
        self.static = static
        self.ladder = tuple(ladder)
        self.lazy = lazy
        self.records: dict[int, GraphRecord] = {}
        """Captured size -> its record: the one place every per-graph fact lives."""
        self.refusals: dict[int, tuple[str, str]] = {}
        """Size -> (``failed`` or ``over budget``, why), until the next ``capture()``."""
        self.ledger = GraphLedger(budget, self.records)
        """The graphs' device memory, read from :attr:`records`."""
        self.counters = ServingCounters(label)
        """Replays and eager calls, which outlive the graphs."""
        self.version = 0
        """Incremented on every change of :attr:`records`: answers derived from them are
        memoized per version."""
        self.pool: Any = None
        """The ladder's one pool (None until a capture makes it, and once the last graph
        that held it is gone)."""
        self.serving = False
        """``capture()`` ran (graphs, or a lazy runner's stage) and ``release()`` did not."""
        self.released = False
        """``release()`` dropped graphs since the last ``capture()`` (for the errors)."""
        self.evicted: set[int] = set()
        """Sizes released to make room (``Lazy(evict="lru")``) and not captured since."""
        self._proven: dict[GraphKey, GraphProvenance | Pending | None] = {}
        self._retired: list[Graph] = []
        self._epoch = 0  # recency: lazy captures so far, and when each size was last seen
        self._seen_at: dict[int, int] = {}  # replayed (or captured)
        self._seen: dict[int, int] = {}  # each size's replays at the last look
        self._refill_default = refill_always
        self.entries: list[Entry | None] = [None]
        self.clear_tables()

    # ------------------------------------------------------------------ tables

    def clear_tables(self) -> None:
        """The replay tables as before any capture; a new output layout and input-write
        record (a new capture establishes both again)."""
        self.counters.harvest(self.entries)
        self.table = PaddingTable(())
        """The captured sizes."""
        self.pad = self.table
        """What a batch pads to (lazy: sizes not captured yet too)."""
        self.entries = [None]
        self.written: list[int] = []
        """The inputs the step writes in place (their rows copied back after a replay)."""
        self.dirty = self.static.max_size
        """Rows past this may hold a larger batch's data: refill before the next replay."""
        self.refill_always = self._refill_default
        """Refill padded rows on every replay (no warmup saw the input writes, or the step
        writes its inputs)."""
        self.layout = OutputLayout(self.label, self._output_dims)
        self.writes = InputWrites(self.static)

    def rebuild(self, added: int | None = None) -> list[Entry | None]:
        """The replay path's entries, one per batch that replays. ``added``: the one size a
        lazy capture just added; when nothing else changed (the sizes a batch pads to, the
        inputs the step writes), only the batches that pad to it get new entries and every
        other entry stays as it was (its counters too): a lazy capture rebuilds a few
        entries, not the ladder's."""
        table = PaddingTable(sorted(self.graphs.sizes()))
        written = self.writes.written(self.label) if table.max_size else []
        self.refill_always = self.refill_always or bool(written)
        batches = self.layout.entry_sizes(self.label, table.sizes)
        if self.lazy:  # pad along the ladder; a size not captured yet: no entry
            pad = PaddingTable([s for s in self.ladder if s not in self.refusals])
            have = set(table.sizes)
            batches = [n for n in batches if pad.padded(n) in have]
        else:
            pad = table
        dims = self.layout.dims

        def parts(n: int, size: int) -> dict[str, Any]:
            return self.graphs.entry_parts(n, size, dims)

        same = pad.sizes == self.pad.sizes and written == self.written
        if added is not None and same and len(self.entries) > 1:
            new = build_entries(
                pad, [n for n in batches if pad.padded(n) == added], self.static, written, parts
            )
            entries = list(self.entries)
            for n, e in enumerate(new):
                if e is not None:
                    entries[n] = e
        else:
            self.counters.harvest(self.entries)
            entries = build_entries(pad, batches, self.static, written, parts)
        self.table, self.pad, self.written, self.entries = table, pad, written, entries
        return entries

    # ------------------------------------------------------------------ graphs

    def held(self) -> list[int]:
        """The sizes that have graphs now."""
        return self.graphs.sizes()

    # ------------------------------------------------------------------ serving flags

    def refill_next(self) -> None:
        """Rows of the static buffers may hold anything now (a capture reset them, a step
        ran on them): the next replay refills every padded row. (The replay path itself
        writes :attr:`dirty` as it goes: a method call there would cost a frame.)"""
        self.dirty = self.static.max_size

    def refill_for(self, e: Entry) -> None:
        """Before replaying ``e`` off the fast path (whose inline copy this is): the padded
        rows refilled when a larger batch's may be left in them."""
        if self.dirty > e.n or self.refill_always:
            copy_into(e.tail_dsts, e.tail_srcs)
        self.dirty = e.n

    def begin_capture(self) -> None:
        """A new ``capture()``: the refusals of the last one are void, nothing is released,
        and the buffers are back at their fill values."""
        self.refusals.clear()
        self.released = False
        self.refill_next()

    def serve_eagerly(self) -> None:
        """``capture()`` of a runner with mode ``none``: it serves, with no graph."""
        self.serving = True

    def pool_for(self, backend: Any) -> tuple[Any, bool]:
        """The ladder's one pool (made by ``backend`` when there is none); whether it is new."""
        if self.pool is not None:
            return self.pool, False
        self.pool = backend.new_pool()
        return self.pool, True

    def after_run(self, ok: bool) -> None:
        """After a capture run: the runner serves when the run succeeded or graphs are
        held; a lazy capture that failed leaves it serving (its stage ran)."""
        self.serving = ok or bool(self.graphs.sizes()) or (self.lazy and self.serving)

    def keep_reads(self, key: GraphKey, reads: GraphProvenance | Pending | None) -> None:
        """What provenance proved a graph just captured reads (a :class:`Pending`: to be
        read on the first question; None: it could not be read); it joins that size's
        record when the run settles."""
        self._proven[key] = reads

    def record_run(
        self, report: CaptureReport, how: str, weights: WeightRecord | None, *, read: bool
    ) -> None:
        """After a capture run: a record for each size it kept (replacing the size's
        record, whose reads of graphs not captured again are kept: a partial recapture of
        some pieces), the sizes that failed refused. ``weights``: what the run saw of the
        module; ``read``: provenance was on, so a kept graph with no staged reads was not
        readable."""
        held = set(self.graphs.sizes())
        calls = self.counters.calls(self.entries)
        proven, self._proven = self._proven, {}
        for size in [s for s in self.records if s not in held]:  # a size the run lost
            self.ledger.dropped(self.records.pop(size).pool_bytes)
        for s in report.sizes:
            if not s.ok:
                if s.size not in held:
                    self.refusals[s.size] = (FAILED, s.error or "")
                continue
            if s.size not in held:
                continue  # dropped again within the run (refused by provenance, discarded)
            old = self.records.get(s.size)
            reads = dict(old.reads) if old is not None else {}
            pending = dict(old.pending) if old is not None else {}
            unread = old.unread if old is not None else False
            mine = {k: v for k, v in proven.items() if k[0] == s.size}
            for key, gp in mine.items():
                reads.pop(key, None)
                pending.pop(key, None)
                if gp is None:
                    unread = True
                elif isinstance(gp, Pending):
                    pending[key] = gp
                else:
                    reads[key] = gp
            if read and not mine:
                unread = True
            self.records[s.size] = GraphRecord(
                size=s.size,
                how=how,
                pool_bytes=(old.pool_bytes if old is not None else 0) + int(s.pool_growth_bytes),
                driver_bytes=int(s.driver_bytes),
                capture_s=s.warmup_s + s.capture_s,
                warmups=s.warmups,
                prewarmed=s.prewarmed,
                phases=report.phases,  # the same dict: a lazy capture completes it later
                calls_at_capture=calls,
                weights=weights,
                reads=reads,
                pending=pending,
                unread=unread,
            )
            self.refusals.pop(s.size, None)
            self.ledger.captured(s.size)
            self._seen_at[s.size] = self._epoch
            if how == LAZILY:
                self.counters.captured(s.size, recaptured=s.size in self.evicted)
            self.evicted.discard(s.size)
        self.version += 1

    def forget_reads(self) -> None:
        """Forget the reads of a run whose graphs were all discarded (an aborted run)."""
        self._proven.clear()

    def retire(self, sizes: Sequence[int]) -> None:
        """Drop ``sizes``' graphs from serving, and their records; :meth:`reap` destroys
        the graphs. Not at once: a private pool whose last graph dies is freed, and the
        next capture into it is a torch internal assert (``use_count > 0``); a recapture
        runs while they hold it. Their pool blocks stay in the pool (the ledger counts
        them as dropped)."""
        self._retired.extend(self.graphs.forget(sizes))
        for size in sizes:
            rec = self.records.pop(size, None)
            if rec is not None:
                self.ledger.dropped(rec.pool_bytes)
        self.version += 1

    def keep_retired(self, graphs: Sequence[Graph]) -> None:
        """Graphs a partial recapture replaced (PIECEWISE pieces captured alone): destroyed
        at the next :meth:`reap`."""
        self._retired.extend(graphs)

    def reap(self) -> bool:
        """Destroy the retired graphs now (their driver memory is back); a pool left
        without graphs is forgotten, so the next capture makes a fresh one. Whether the
        store holds no graph now."""
        for graph in self._retired:
            free_graph(graph)
        self._retired.clear()
        if not self.graphs.sizes():
            self.pool = None
            return True
        return False

    def release(self) -> None:
        """Drop every graph and record, destroy the graphs, forget the refusals and the
        tables (``release()``); no longer serving. :attr:`released` says so from now until
        the next capture when graphs were held or the runner served."""
        self.released = self.released or self.serving or bool(self.graphs.sizes())
        self.serving = False
        self.graphs.clear()
        self._proven.clear()
        for graph in self._retired:
            free_graph(graph)
        self._retired.clear()
        self.pool = None
        self.records.clear()
        self.refusals.clear()
        self.evicted.clear()
        self._seen_at.clear()
        self._seen.clear()
        self.ledger.forget()
        self.clear_tables()
        self.version += 1

    # ------------------------------------------------------------------ eviction

    def recency(self) -> list[int]:
        """The captured sizes, least recently replayed first (ties: fewer replays, then
        the smaller size), for ``Lazy(evict="lru")``.

        Nothing on the replay path: each entry's countdown already counts its replays
        (:attr:`Entry.replays <graphguard.entries.Entry.replays>`). Each call here (every
        lazy capture and first call of a runner that evicts: the slow path) is an epoch: a
        size whose replay count moved since the previous one was used in it. So the order
        is exact between those events, the only moments eviction reads it, and within one
        epoch falls back to the count."""
        self._epoch += 1
        totals = self.counters.replays(self.entries)
        for size in self.records:
            n = totals.get(size, 0)
            if n != self._seen.get(size, 0):
                self._seen_at[size] = self._epoch
            self._seen[size] = n
        return sorted(self.records, key=lambda s: (self._seen_at.get(s, 0), totals.get(s, 0), s))

    def evict(self, size: int) -> bool:
        """Release ``size``'s graph(s) to make room: its record and driver share go, its
        pool blocks stay in the pool (counted as dropped), its entries leave the replay
        tables (their replays kept), and it is captured again when a call meets it.
        Whether the store holds no graph now (the pool went with the last one)."""
        self.retire([size])
        gone = [e for e in self.entries if e is not None and e.size == size]
        self.counters.harvest(gone)
        for e in gone:
            self.entries[e.n] = None
        self.table = PaddingTable(sorted(self.graphs.sizes()))
        self.counters.evictions[size] += 1
        self.evicted.add(size)
        return self.reap()

    def refuse(self, size: int, status: str, why: str) -> None:
        """Refuse ``size`` until the next ``capture()`` (the caller rebuilds the entries)."""
        self.refusals[size] = (status, why)
        self.version += 1

    # ------------------------------------------------------------------ reading

    def weight_records(self) -> dict[int, WeightRecord]:
        """Per captured size, what its capture saw of the weights."""
        return {s: r.weights for s, r in self.records.items() if r.weights is not None}

    def take_weights(self, sizes: Sequence[int], record: WeightRecord) -> None:
        """``record`` is what the graphs of ``sizes`` read now (a check found them
        current: what moved is read by none of them)."""
        for size in sizes:
            rec = self.records.get(size)
            if rec is not None:
                rec.weights = record
        self.version += 1

    @property
    def captured_at(self) -> Mapping[int, int]:
        """Per captured size, the runner's call count when it was captured."""
        return {s: r.calls_at_capture for s, r in self.records.items()}


__all__ = ["GraphSet", "GraphStore"]
