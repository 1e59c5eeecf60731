"""Graph provenance: what each captured graph reads, proven from the graph itself.

A CUDA graph freezes raw device addresses, and every hazard graphguard exists for is a
graph reading an address whose owner changed. Inferring reads from the module tree misses
what no module lists (a weight transposed at load, a re-created state buffer) and forces
"every graph" answers. So each captured graph's node arguments are read
(:mod:`graphguard._graph_args`) and each candidate address is resolved to an owner with a
sorted-interval search (``torch.searchsorted`` over owner storages, vectorized):

* named owners: the module's parameters and buffers by path, **derived** tensors (plain
  tensor attributes of the module's submodules: ``self.wt = w.t().contiguous()`` in a load
  hook), declared state, static inputs, outputs, workspace arenas;
* graph-pool temporaries (this graph's pool, or another graph pool). A derived attribute
  whose storage lies in this graph's pool is one too: the graph computes it on every
  replay (a legacy ``weight_norm`` pre-hook sets ``module.weight`` inside the captured
  step), so the graph reads its own output, never a stale copy;
* **unknown**: a live allocation outside graph pools that no named owner holds (listed,
  never refused: RNG offsets, a library's cached tensors);
* **unowned**: memory no live tensor holds (a free block of the general pool), or what an
  earlier capture knew as a named owner's storage that no owner holds now (an arena's
  replaced buffer), **proven taken**: an exact word (a whole pointer parameter, a
  memcpy/memset address) or memory that was live as the capture began (the step freed
  it). Under ``sanitize=True`` a graph that takes one is refused when it is captured
  (:class:`~graphguard.errors.FreedStorageError`), before any replay; otherwise it is
  warned about, once per graph, and listed.
* a word inside a struct argument that points into memory freed *before* the capture
  began is **not** proof of a read: launches copy whole structs whose unset fields hold
  stale host-stack bytes (see :mod:`graphguard._graph_args`). Such words are listed as
  unknown, marked ``freed``, and never refused: the sanitizer's promise is no false
  positive.

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
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from graphguard import _graph_args
from graphguard._demangle import OPAQUE, POINTER
from graphguard._graph_args import GraphArgs, Span
from graphguard.arguments import PROVENANCE_ENV, env_switch
from graphguard.audit import Audit, freed_message
from graphguard.errors import FreedStorageError
from graphguard.owners import KINDS, Owner, Owners, bounds, hit_spans, spans_of
from graphguard.weights.record import GraphKey, MovedWeight, held_by

logger = logging.getLogger("graphguard")

KEEP = "keep"
"""``read_args`` for a capture whose graph is kept and read on the first question."""


# ------------------------------------------------------------------ one graph


@dataclass(frozen=True)
class Read:
    """A named owner a graph reads."""

    name: str
    kind: str
    start: int
    nbytes: int
    kernel: str
    """The first node that took it."""
    words: int
    ref: Any = field(default=None, compare=False, repr=False)
    slot: Any = field(default=None, compare=False, repr=False)
    """A derived tensor's place (:attr:`Owner.slot`)."""


@dataclass(frozen=True)
class Word:
    """An address no named owner holds (unknown or unowned)."""

    address: int
    kernel: str
    nbytes: int
    """Bytes of the allocation it points into (0: not known)."""
    last_owner: str | None = None
    """Who held this memory when an earlier capture looked (None: nobody known)."""
    freed: bool = False
    """An unknown word into memory no live tensor holds, not proven taken: undecided
    (:attr:`why`; see the module docstring)."""
    proven: bool = False
    """Proven taken: a pointer by the kernel's types (a whole pointer argument, an operand
    array's entry, a memcpy/memset address), or an opaque word into a storage the
    capture's ops were handed (recorded under the sanitizer)."""
    why: str = ""
    """Why a word that is not proven is not decided either (the kernel and the argument
    form); empty for a proven one."""


@dataclass(frozen=True)
class GraphProvenance:
    """What one graph reads, by owner, and the words no owner explains."""

    size: int
    piece: int | None
    kernels: int
    words: int
    reads: tuple[Read, ...]
    unknown: tuple[Word, ...]
    unowned: tuple[Word, ...]
    temporaries: int
    """Words into graph pools (this graph's and other graphs' temporaries)."""
    seconds: float
    """Reading the arguments and classifying them."""
    dismissed: int = 0
    """Opaque words proven not to be pointers the kernel uses: in an ATen kernel, into
    memory no op of the capture was handed; or into memory free as the capture began."""

    @property
    def undecided(self) -> tuple[Word, ...]:
        """Words into memory no live tensor holds that nothing decided (see :attr:`Word.why`)."""
        return tuple(w for w in self.unknown if w.freed)

    @property
    def where(self) -> str:
        return f"size {self.size}" + ("" if self.piece is None else f" piece {self.piece}")


def classify(
    args: GraphArgs, owners: Owners, history: Owners, size: int, piece: int | None
) -> GraphProvenance:
    """Resolve every word of ``args`` (see the module docstring for the rules)."""
    lo, hi = bounds(
        zip(owners.starts.tolist(), owners.ends.tolist()),
        zip(history.starts.tolist(), history.ends.tolist()),
        args.pool,
        args.other_pools,
        args.freed,
        args.live,
    )
    words = args.words
    keep = (words >= max(lo, 1)) & (words < hi)  # no span holds the others: noise
    words, kernel = words[keep], args.kernel[keep]
    kind = (
        args.kind[keep].to(torch.int64)
        if args.kind is not None
        else torch.full_like(words, POINTER, dtype=torch.int64)
    )
    pointer_w = (kind == POINTER).to(torch.int64)
    decidable_w = torch.zeros_like(pointer_w)
    if args.took is not None and args.from_ops is not None and words.numel():
        aten = torch.tensor(args.from_ops, dtype=torch.bool)
        decidable_w = ((kind == OPAQUE) & aten[kernel]).to(torch.int64)
    if words.numel():
        uniq, inverse = torch.unique(words, return_inverse=True)
        first = torch.full(uniq.shape, 1 << 62, dtype=torch.int64).scatter_reduce(
            0, inverse, kernel, "amin"
        )
        pointer = torch.zeros(uniq.shape, dtype=torch.int64).scatter_reduce(
            0, inverse, pointer_w, "amax"
        )
        # Decidable by the ops' record only where every word of it is (ATen, opaque).
        decidable = torch.ones(uniq.shape, dtype=torch.int64).scatter_reduce(
            0, inverse, decidable_w, "amin"
        )
    else:
        uniq = first = pointer = decidable = torch.empty(0, dtype=torch.int64)
    name = args.kernels
    reads: list[Read] = []
    unowned: list[Word] = []
    own = owners.hit(uniq)
    pool = spans_of(args.pool) if args.pool else None
    if pool is not None and owners.derived.numel() and uniq.numel():
        # A derived attribute in this graph's pool: the graph computes it (a temporary).
        made = owners.derived[hit_spans(*pool, owners.starts[owners.derived]) >= 0]
        if made.numel():
            own = torch.where(torch.isin(own, made), torch.full_like(own, -1), own)
    if history.owners:  # an arena's replaced buffer, still named by a cached attribute
        was = history.hit(uniq)
        both = torch.nonzero((own >= 0) & (was >= 0)).flatten()
        for o_i, w_i, word, k in zip(
            own[both].tolist(), was[both].tolist(), uniq[both].tolist(), first[both].tolist()
        ):
            o, old = owners.owners[o_i], history.owners[w_i]
            if old.kind == "arena" and o.kind == "derived":
                unowned.append(Word(word, name[k], o.end - o.start, old.name, proven=True))
    hit = own >= 0
    if bool(hit.any()):
        idx, counts = torch.unique(own[hit], return_counts=True)
        firsts = torch.full((len(owners.owners),), 1 << 62, dtype=torch.int64).scatter_reduce(
            0, own[hit], first[hit], "amin"
        )
        for i, c, k in zip(idx.tolist(), counts.tolist(), firsts[idx].tolist()):
            o = owners.owners[i]
            reads.append(Read(o.name, o.kind, o.start, o.end - o.start, name[k], c, o.ref, o.slot))
    rest, rest_first = uniq[~hit], first[~hit]
    rest_ptr, rest_dec = pointer[~hit], decidable[~hit]
    temps = 0
    for table in (pool, spans_of(args.other_pools) if args.other_pools else None):
        if table is not None and rest.numel():
            inside = hit_spans(*table, rest) >= 0
            temps += int(inside.sum())
            out = ~inside
            rest, rest_first, rest_ptr, rest_dec = (
                rest[out],
                rest_first[out],
                rest_ptr[out],
                rest_dec[out],
            )
    # Every word left is decided here: proven a pointer (by the kernel's types, or by the
    # ops' record), proven not one (dismissed), or named undecided with why.
    proven = rest_ptr > 0
    dismissed = 0
    if args.took is not None and rest.numel():
        took = (
            hit_spans(*spans_of(args.took), rest) >= 0
            if args.took
            else torch.zeros(rest.shape, dtype=torch.bool)
        )
        proven |= took
        drop = ~proven & (rest_dec > 0)  # ATen's opaque word into memory no op was handed
        if bool(drop.any()):
            dismissed += int(drop.sum())
            out = ~drop
            rest, rest_first, proven = rest[out], rest_first[out], proven[out]
    then = (
        hit_spans(*spans_of(args.live_before), rest) >= 0
        if args.live_before
        else torch.zeros(rest.shape, dtype=torch.bool)
    )
    last = history.hit(rest)
    unknown: list[Word] = []
    recorded = args.took is not None
    for kind_name, spans in (("freed", args.freed), ("live", args.live)):
        if not spans or not rest.numel():
            continue
        starts, ends = spans_of(spans)
        blocks = hit_spans(starts, ends, rest)
        inside = blocks >= 0
        if bool(inside.any()):
            b = blocks[inside]
            w_in, k_in, h_in = rest[inside], rest_first[inside], last[inside]
            p_in, t_in = proven[inside], then[inside]
            # One word per allocation: a proven one if any is.
            order = torch.argsort((~p_in).to(torch.int64), stable=True)
            b, w_in, k_in, h_in = b[order], w_in[order], k_in[order], h_in[order]
            p_in, t_in = p_in[order], t_in[order]
            ub, inv = torch.unique(b, return_inverse=True)
            pos = torch.full(ub.shape, 1 << 62, dtype=torch.int64).scatter_reduce(
                0, inv, torch.arange(b.numel(), dtype=torch.int64), "amin"
            )
            # Plain lists: indexing a tensor element costs microseconds.
            ws, ks, hs, ps = w_in.tolist(), k_in.tolist(), h_in.tolist(), p_in.tolist()
            ts = t_in.tolist()
            blo, bhi = starts.tolist(), ends.tolist()
            freed = kind_name == "freed"
            for blk, j in zip(ub.tolist(), pos.tolist()):
                h = hs[j]
                prev = history.owners[h] if h >= 0 else None
                # A live allocation an arena's buffer began at (not merely memory it
                # once covered): the replaced buffer itself, kept alive by a cached view.
                replaced = prev is not None and prev.kind == "arena" and blo[blk] == prev.start
                if freed and not ps[j] and args.live_before is not None and not ts[j]:
                    dismissed += 1  # free as the capture began: no launch in it took it
                    continue
                word = Word(
                    ws[j],
                    name[ks[j]],
                    bhi[blk] - blo[blk],
                    prev.name if prev else None,
                    freed=freed and not ps[j] and not replaced,
                    proven=bool(ps[j]) or replaced,
                    why="" if ps[j] or replaced else undecided_why(name[ks[j]], recorded),
                )
                if (freed and ps[j]) or replaced:
                    unowned.append(word)
                else:
                    unknown.append(word)
        keep_rest = ~inside
        rest, rest_first, last = rest[keep_rest], rest_first[keep_rest], last[keep_rest]
        proven, then = proven[keep_rest], then[keep_rest]
    # Memory a named owner held, now outside every allocation: unowned when proven taken.
    gone = last >= 0
    for w, k, h, p in zip(
        rest[gone].tolist(), rest_first[gone].tolist(), last[gone].tolist(), proven[gone].tolist()
    ):
        why = "" if p else undecided_why(name[k], recorded)
        word = Word(w, name[k], 0, history.owners[h].name, freed=not p, proven=bool(p), why=why)
        (unowned if p else unknown).append(word)
    return GraphProvenance(
        size=size,
        piece=piece,
        kernels=len(name),
        words=int(args.words.numel()),
        reads=tuple(sorted(reads, key=lambda r: (KINDS.index(r.kind), r.name))),
        unknown=tuple(unknown),
        unowned=tuple(unowned),
        temporaries=temps,
        seconds=args.seconds,
        dismissed=dismissed,
    )


def undecided_why(kernel: str, recorded: bool) -> str:
    """Why an opaque word of ``kernel`` is not decided (see the module docstring)."""
    if not kernel.startswith("_Z"):
        form = "inside a parameter block whose layout the kernel's name does not give"
    else:
        form = "inside a closure or struct argument whose layout the kernel's types do not give"
    if recorded:
        return f"{form}; a library's kernel, so not every pointer it takes is an op's tensor"
    return f"{form}; the capture's ops were not recorded (sanitize=True records them)"


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
                n: NamedRead(n, r.kind, r.start, r.nbytes, _sorted(keys), r.slot)
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
            graphs = _sorted(stale)
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
        by_name = {o.name: o for o in now.owners}
        stale: dict[str, tuple[str, list[GraphKey]]] = {}
        _, moved_derived = self.derived(records, version)
        for m in moved_derived:
            stale[m.name] = (m.change, list(m.graphs))
        free_starts, free_ends = spans_of(freed) if freed else (None, None)
        undecided: dict[str, tuple[str, list[GraphKey]]] = {}
        for gp in graphs:
            key = (gp.size, gp.piece)
            for w in gp.unowned:  # proven taken, freed (or replaced) when it was read
                name = w.last_owner or f"unnamed memory at {w.address:#x} ({w.kernel})"
                what = "freed before the graph was read: the graph still takes its address"
                stale.setdefault(name, (what, []))[1].append(key)
            for w in gp.undecided:
                name = f"unnamed memory at {w.address:#x} ({w.kernel})"
                undecided.setdefault(name, (f"freed when the graph was read; {w.why}", []))[
                    1
                ].append(key)
            live = [w for w in gp.unknown if not w.freed]
            if live and free_starts is not None and free_ends is not None:
                addrs = torch.tensor([w.address for w in live], dtype=torch.int64)
                gone = (hit_spans(free_starts, free_ends, addrs) >= 0).tolist()
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
        return Audit(
            runner=self.label,
            enabled=self.on,
            why=self._why,
            graphs=tuple(graphs),
            stale=tuple((n, w, _sorted(k)) for n, (w, k) in stale.items()),
            undecided=tuple((n, w, _sorted(k)) for n, (w, k) in undecided.items()),
        )


def _sorted(keys: Iterable[GraphKey]) -> tuple[GraphKey, ...]:
    return tuple(sorted(set(keys), key=lambda k: (k[0], -1 if k[1] is None else k[1])))


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
]
