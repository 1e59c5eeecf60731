"""Per-graph classification: every address a captured graph's nodes take, decided.

The words of a graph's node arguments (:mod:`graphguard._graph_args`) are resolved to
owners with a sorted-interval search (``torch.searchsorted`` over owner storages,
vectorized):

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

The result per graph is :class:`GraphProvenance`; when graphs are read, and what a runner
keeps across them, is :mod:`graphguard.provenance`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from graphguard._demangle import OPAQUE, POINTER
from graphguard._graph_args import GraphArgs, Span
from graphguard.owners import KINDS, Owners, bounds, hit_spans, spans_of


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


@dataclass(frozen=True)
class Candidates:
    """Distinct addresses a graph takes, still to be decided, with what is known of each
    (parallel tensors, one entry per address)."""

    address: torch.Tensor
    first: torch.Tensor
    """The first node that took it (an index into the graph's kernel names)."""
    pointer: torch.Tensor
    """1 where some word of it is a pointer by the kernel's types."""
    decidable: torch.Tensor
    """1 where every word of it is an ATen kernel's opaque word: the ops' record decides."""

    def keep(self, which: torch.Tensor) -> Candidates:
        return Candidates(
            self.address[which], self.first[which], self.pointer[which], self.decidable[which]
        )


@dataclass(frozen=True)
class Unnamed:
    """Addresses no named owner or graph pool explains, each proven taken or not (parallel
    tensors, one entry per address)."""

    address: torch.Tensor
    first: torch.Tensor
    proven: torch.Tensor
    """Proven taken: a pointer by the kernel's types or by the ops' record."""
    then: torch.Tensor
    """Inside memory that was live as the capture began."""
    last: torch.Tensor
    """The history owner that last held it (an index, -1: none)."""

    def keep(self, which: torch.Tensor) -> Unnamed:
        return Unnamed(
            self.address[which],
            self.first[which],
            self.proven[which],
            self.then[which],
            self.last[which],
        )


def classify(
    args: GraphArgs, owners: Owners, history: Owners, size: int, piece: int | None
) -> GraphProvenance:
    """Resolve every word of ``args`` (see the module docstring for the rules)."""
    names = args.kernels
    pool = spans_of(args.pool) if args.pool else None
    words = _distinct_words(args, owners, history)
    own = _named_owner(words.address, owners, pool)
    unowned = _replaced_arena_buffers(words, own, owners, history, names)
    reads = _named_reads(words, own, owners, names)
    rest, temporaries = _outside_graph_pools(words.keep(own < 0), pool, args.other_pools)
    # Every word left is decided here: proven a pointer (by the kernel's types, or by the
    # ops' record), proven not one (dismissed), or named undecided with why.
    unnamed, dismissed = _proven_by_record(rest, args, history)
    unknown: list[Word] = []
    for freed, spans in ((True, args.freed), (False, args.live)):
        unnamed, found, taken, free_then = _in_allocations(unnamed, spans, freed, args, history)
        unknown += found
        unowned += taken
        dismissed += free_then
    found, taken = _in_memory_of_gone_owners(unnamed, args, history)
    return GraphProvenance(
        size=size,
        piece=piece,
        kernels=len(names),
        words=int(args.words.numel()),
        reads=tuple(sorted(reads, key=lambda r: (KINDS.index(r.kind), r.name))),
        unknown=tuple(unknown + found),
        unowned=tuple(unowned + taken),
        temporaries=temporaries,
        seconds=args.seconds,
        dismissed=dismissed,
    )


def _distinct_words(args: GraphArgs, owners: Owners, history: Owners) -> Candidates:
    """The distinct words some owner, pool or allocation could hold (the others are noise:
    no span holds them), each with its first node and what its kernels' types say."""
    lo, hi = bounds(
        zip(owners.starts.tolist(), owners.ends.tolist()),
        zip(history.starts.tolist(), history.ends.tolist()),
        args.pool,
        args.other_pools,
        args.freed,
        args.live,
    )
    words = args.words
    keep = (words >= max(lo, 1)) & (words < hi)
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
    if not words.numel():
        empty = torch.empty(0, dtype=torch.int64)
        return Candidates(empty, empty, empty, empty)
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
    return Candidates(uniq, first, pointer, decidable)


def _named_owner(
    words: torch.Tensor, owners: Owners, pool: tuple[torch.Tensor, torch.Tensor] | None
) -> torch.Tensor:
    """Each word's named owner (an index into ``owners.owners``, -1: none). A derived
    attribute in this graph's pool is none: the graph computes it (a temporary)."""
    own = owners.hit(words)
    if pool is not None and owners.derived.numel() and words.numel():
        made = owners.derived[hit_spans(*pool, owners.starts[owners.derived]) >= 0]
        if made.numel():
            own = torch.where(torch.isin(own, made), torch.full_like(own, -1), own)
    return own


def _replaced_arena_buffers(
    words: Candidates, own: torch.Tensor, owners: Owners, history: Owners, names: Sequence[str]
) -> list[Word]:
    """Words into an arena's replaced buffer, still named by a cached (derived) attribute:
    unowned, proven taken."""
    if not history.owners:
        return []
    was = history.hit(words.address)
    both = torch.nonzero((own >= 0) & (was >= 0)).flatten()
    unowned: list[Word] = []
    for o_i, w_i, word, k in zip(
        own[both].tolist(),
        was[both].tolist(),
        words.address[both].tolist(),
        words.first[both].tolist(),
    ):
        o, old = owners.owners[o_i], history.owners[w_i]
        if old.kind == "arena" and o.kind == "derived":
            unowned.append(Word(word, names[k], o.end - o.start, old.name, proven=True))
    return unowned


def _named_reads(
    words: Candidates, own: torch.Tensor, owners: Owners, names: Sequence[str]
) -> list[Read]:
    """One :class:`Read` per named owner the words fall in: its first node, its words."""
    hit = own >= 0
    if not bool(hit.any()):
        return []
    idx, counts = torch.unique(own[hit], return_counts=True)
    firsts = torch.full((len(owners.owners),), 1 << 62, dtype=torch.int64).scatter_reduce(
        0, own[hit], words.first[hit], "amin"
    )
    reads: list[Read] = []
    for i, c, k in zip(idx.tolist(), counts.tolist(), firsts[idx].tolist()):
        o = owners.owners[i]
        reads.append(Read(o.name, o.kind, o.start, o.end - o.start, names[k], c, o.ref, o.slot))
    return reads


def _outside_graph_pools(
    rest: Candidates,
    pool: tuple[torch.Tensor, torch.Tensor] | None,
    other_pools: Sequence[Span] | None,
) -> tuple[Candidates, int]:
    """The words outside this graph's pool and every other graph pool, and how many were
    inside (temporaries)."""
    temporaries = 0
    for table in (pool, spans_of(other_pools) if other_pools else None):
        if table is not None and rest.address.numel():
            inside = hit_spans(*table, rest.address) >= 0
            temporaries += int(inside.sum())
            rest = rest.keep(~inside)
    return rest, temporaries


def _proven_by_record(rest: Candidates, args: GraphArgs, history: Owners) -> tuple[Unnamed, int]:
    """Each word proven taken (a pointer by the kernel's types, or inside a storage the
    capture's ops were handed), and those dismissed: an ATen kernel's opaque word into
    memory no op was handed. With what was live as the capture began and who last held
    each word's memory."""
    address, first = rest.address, rest.first
    proven = rest.pointer > 0
    dismissed = 0
    if args.took is not None and address.numel():
        took = (
            hit_spans(*spans_of(args.took), address) >= 0
            if args.took
            else torch.zeros(address.shape, dtype=torch.bool)
        )
        proven |= took
        drop = ~proven & (rest.decidable > 0)
        if bool(drop.any()):
            dismissed += int(drop.sum())
            out = ~drop
            address, first, proven = address[out], first[out], proven[out]
    then = (
        hit_spans(*spans_of(args.live_before), address) >= 0
        if args.live_before
        else torch.zeros(address.shape, dtype=torch.bool)
    )
    return Unnamed(address, first, proven, then, history.hit(address)), dismissed


def _in_allocations(
    rest: Unnamed, spans: Sequence[Span] | None, freed: bool, args: GraphArgs, history: Owners
) -> tuple[Unnamed, list[Word], list[Word], int]:
    """The words inside ``spans`` (the allocator's free blocks when ``freed``, else its live
    allocations) decided, one word per allocation: the words left, the unknown, the
    unowned, and how many were dismissed (free as the capture began)."""
    if not spans or not rest.address.numel():
        return rest, [], [], 0
    starts, ends = spans_of(spans)
    blocks = hit_spans(starts, ends, rest.address)
    inside = blocks >= 0
    unknown: list[Word] = []
    unowned: list[Word] = []
    dismissed = 0
    if bool(inside.any()):
        unknown, unowned, dismissed = _one_word_per_allocation(
            rest.keep(inside), blocks[inside], (starts, ends), freed, args, history
        )
    return rest.keep(~inside), unknown, unowned, dismissed


def _one_word_per_allocation(
    words: Unnamed,
    blocks: torch.Tensor,
    spans: tuple[torch.Tensor, torch.Tensor],
    freed: bool,
    args: GraphArgs,
    history: Owners,
) -> tuple[list[Word], list[Word], int]:
    """The words of each allocation ``blocks`` names, one per allocation (a proven one if
    any is), as unknown or unowned words; and how many were free as the capture began."""
    # One word per allocation: a proven one if any is.
    order = torch.argsort((~words.proven).to(torch.int64), stable=True)
    b, words = blocks[order], words.keep(order)
    ub, inv = torch.unique(b, return_inverse=True)
    pos = torch.full(ub.shape, 1 << 62, dtype=torch.int64).scatter_reduce(
        0, inv, torch.arange(b.numel(), dtype=torch.int64), "amin"
    )
    # Plain lists: indexing a tensor element costs microseconds.
    ws, ks, hs = words.address.tolist(), words.first.tolist(), words.last.tolist()
    ps, ts = words.proven.tolist(), words.then.tolist()
    blo, bhi = spans[0].tolist(), spans[1].tolist()
    names, recorded = args.kernels, args.took is not None
    unknown: list[Word] = []
    unowned: list[Word] = []
    dismissed = 0
    for blk, j in zip(ub.tolist(), pos.tolist()):
        h = hs[j]
        prev = history.owners[h] if h >= 0 else None
        # A live allocation an arena's buffer began at (not merely memory it once
        # covered): the replaced buffer itself, kept alive by a cached view.
        replaced = prev is not None and prev.kind == "arena" and blo[blk] == prev.start
        if freed and not ps[j] and args.live_before is not None and not ts[j]:
            dismissed += 1  # free as the capture began: no launch in it took it
            continue
        word = Word(
            ws[j],
            names[ks[j]],
            bhi[blk] - blo[blk],
            prev.name if prev else None,
            freed=freed and not ps[j] and not replaced,
            proven=bool(ps[j]) or replaced,
            why="" if ps[j] or replaced else undecided_why(names[ks[j]], recorded),
        )
        if (freed and ps[j]) or replaced:
            unowned.append(word)
        else:
            unknown.append(word)
    return unknown, unowned, dismissed


def _in_memory_of_gone_owners(
    rest: Unnamed, args: GraphArgs, history: Owners
) -> tuple[list[Word], list[Word]]:
    """Memory a named owner held, now outside every allocation: unowned when proven taken,
    else unknown (undecided); the unknown and the unowned."""
    names, recorded = args.kernels, args.took is not None
    unknown: list[Word] = []
    unowned: list[Word] = []
    gone = rest.last >= 0
    for w, k, h, p in zip(
        rest.address[gone].tolist(),
        rest.first[gone].tolist(),
        rest.last[gone].tolist(),
        rest.proven[gone].tolist(),
    ):
        why = "" if p else undecided_why(names[k], recorded)
        word = Word(w, names[k], 0, history.owners[h].name, freed=not p, proven=bool(p), why=why)
        (unowned if p else unknown).append(word)
    return unknown, unowned


def undecided_why(kernel: str, recorded: bool) -> str:
    """Why an opaque word of ``kernel`` is not decided (see the module docstring)."""
    if not kernel.startswith("_Z"):
        form = "inside a parameter block whose layout the kernel's name does not give"
    else:
        form = "inside a closure or struct argument whose layout the kernel's types do not give"
    if recorded:
        return f"{form}; a library's kernel, so not every pointer it takes is an op's tensor"
    return f"{form}; the capture's ops were not recorded (sanitize=True records them)"
