"""Graph provenance: what each captured graph reads, proven from the graph itself.

A CUDA graph freezes raw device addresses, and every hazard graphguard exists for is a
graph reading an address whose owner changed. Inferring reads from the module tree misses
what no module lists (a weight transposed at load, a re-created state buffer) and forces
"every graph" answers. So right after each graph is captured, its nodes' arguments are
read (:mod:`graphguard._graph_args`) and each candidate address is resolved to an owner
with a sorted-interval search (``torch.searchsorted`` over owner storages, vectorized:
tens of thousands of words in milliseconds):

* named owners: the module's parameters and buffers by path, **derived** tensors (plain
  tensor attributes of the module's submodules: ``self.wt = w.t().contiguous()`` in a load
  hook), declared state, static inputs, outputs, workspace arenas;
* graph-pool temporaries (this graph's pool, or another graph pool);
* **unknown**: a live allocation outside graph pools that no named owner holds (listed,
  never refused: RNG offsets, a library's cached tensors);
* **unowned**: memory no live tensor holds (a free block of the general pool), or what an
  earlier capture knew as a named owner's storage that no owner holds now (an arena's
  replaced buffer), **proven taken**: an exact word (a whole pointer parameter, a
  memcpy/memset address) or memory that was live as the capture began (the step freed
  it). Under ``sanitize=True`` a graph that takes one is refused when it is captured
  (:class:`~graphguard.errors.FreedStorageError`), before any replay; otherwise it is
  warned about and listed.
* a word inside a struct argument that points into memory freed *before* the capture
  began is **not** proof of a read: launches copy whole structs whose unset fields hold
  stale host-stack bytes, often an earlier launch's pointers (see
  :mod:`graphguard._graph_args`). Such words are listed as unknown, marked ``freed``,
  and never refused: the sanitizer's promise is no false positive.

Other words (sizes, strides, flags) point nowhere known and are only counted. The result
per graph is :class:`GraphProvenance`; a runner keeps one :class:`Provenance`
(``runner.audit()`` reports it, ``graph_reads()`` and ``check_weights()`` use it). The
replay path gains nothing: reading happens once, after capture.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from graphguard import _graph_args
from graphguard._graph_args import GraphArgs, Span
from graphguard.config import PROVENANCE_ENV, env_switch
from graphguard.errors import FreedStorageError
from graphguard.weights.record import GraphKey, MovedWeight, named_tensors

logger = logging.getLogger("graphguard")

KINDS = ("parameter", "buffer", "state", "static input", "output", "arena", "derived")
"""Named owner kinds, in priority order (a storage two owners share takes the first)."""


# ------------------------------------------------------------------ owners


@dataclass(frozen=True)
class Owner:
    """One named storage a graph may read."""

    name: str
    kind: str
    start: int
    end: int
    ref: Any = field(default=None, compare=False, repr=False)
    """A weak reference to the storage (alive or not, at audit)."""


def _derived(module: torch.nn.Module) -> Iterable[tuple[str, torch.Tensor]]:
    """Plain tensor attributes of every submodule (not parameters or buffers), one level
    into lists, tuples and dicts: tensors derived at load that no module lists."""
    for prefix, sub in module.named_modules():
        for attr, v in vars(sub).items():
            if attr.startswith("__") or attr in ("_parameters", "_buffers", "_modules"):
                continue
            base = f"{prefix}.{attr}" if prefix else attr
            if isinstance(v, torch.Tensor) and not isinstance(v, torch.nn.Parameter):
                yield base, v
            elif isinstance(v, (list, tuple)):
                for i, x in enumerate(v[:64]):
                    if isinstance(x, torch.Tensor):
                        yield f"{base}[{i}]", x
            elif isinstance(v, dict):
                for k, x in list(v.items())[:64]:
                    if isinstance(x, torch.Tensor):
                        yield f"{base}[{k!r}]", x


class Owners:
    """Named owner storages as sorted intervals (one owner per storage)."""

    def __init__(self, owners: Sequence[Owner]) -> None:
        by_start: dict[int, Owner] = {}
        for o in owners:
            if o.end > o.start > 0 and o.start not in by_start:
                by_start[o.start] = o
        self.owners = [by_start[s] for s in sorted(by_start)]
        self.starts = torch.tensor([o.start for o in self.owners], dtype=torch.int64)
        self.ends = torch.tensor([o.end for o in self.owners], dtype=torch.int64)

    @classmethod
    def of(
        cls,
        *,
        module: torch.nn.Module | None,
        state: Any = None,
        static: Sequence[tuple[str, torch.Tensor]] = (),
        outputs: Sequence[Any] = (),
        arenas: Sequence[Any] = (),
    ) -> Owners:
        """Every named storage of a runner, highest priority first (:data:`KINDS`)."""
        found: list[tuple[str, str, torch.Tensor]] = []
        if module is not None:
            params: list[tuple[str, str, torch.Tensor]] = []
            bufs: list[tuple[str, str, torch.Tensor]] = []
            for name, _, _, buffer, _, t in named_tensors(module):
                (bufs if buffer else params).append((name, "buffer" if buffer else "parameter", t))
            found += params + bufs
        if state is not None:
            found += [(n, "state", t) for n, t in zip(state.names, state.tensors)]
        found += [(n, "static input", t) for n, t in static]
        found += [
            (f"output leaf {i}", "output", t)
            for i, t in enumerate(outputs)
            if isinstance(t, torch.Tensor)
        ]
        for i, ws in enumerate(arenas):
            buf = getattr(ws, "buffer", None)
            if isinstance(buf, torch.Tensor):
                found.append((f"arena {getattr(ws, 'name', i)}", "arena", buf))
        if module is not None:  # last: an attribute that views a named storage is that owner
            found += [(n, "derived", t) for n, t in _derived(module)]
        owners = []
        for name, kind, t in found:
            try:
                st = t.untyped_storage()
                start, n = int(st.data_ptr()), int(st.nbytes())
            except (RuntimeError, NotImplementedError):
                continue
            if n > 0 and t.device.type != "meta":
                ref = StorageWeakRef(st)  # type: ignore[no-untyped-call]
                owners.append(Owner(name, kind, start, start + n, ref))
        return cls(owners)

    def hit(self, words: torch.Tensor) -> torch.Tensor:
        """Per word, the index of the owner whose storage holds it, else -1."""
        return _hit(self.starts, self.ends, words)


def _hit(starts: torch.Tensor, ends: torch.Tensor, words: torch.Tensor) -> torch.Tensor:
    if starts.numel() == 0 or words.numel() == 0:
        return torch.full_like(words, -1)
    i = torch.searchsorted(starts, words, right=True) - 1
    j = i.clamp(min=0)
    return torch.where((i >= 0) & (words < ends[j]), j, torch.full_like(j, -1))


def _spans(spans: Sequence[Span]) -> tuple[torch.Tensor, torch.Tensor]:
    s = sorted(spans)
    return (
        torch.tensor([a for a, _ in s], dtype=torch.int64),
        torch.tensor([b for _, b in s], dtype=torch.int64),
    )


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
    """An unknown word into memory no live tensor holds, not proven taken (a struct
    argument's unset bytes, most likely; see the module docstring)."""


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

    @property
    def where(self) -> str:
        return f"size {self.size}" + ("" if self.piece is None else f" piece {self.piece}")


def classify(
    args: GraphArgs, owners: Owners, history: Owners, size: int, piece: int | None
) -> GraphProvenance:
    """Resolve every word of ``args`` (see the module docstring for the rules)."""
    words = args.words
    keep = words > 0
    words, kernel = words[keep], args.kernel[keep]
    exact_w = (
        args.exact[keep].to(torch.int64)
        if args.exact is not None
        else torch.ones_like(words, dtype=torch.int64)
    )
    if words.numel():
        uniq, inverse = torch.unique(words, return_inverse=True)
        first = torch.full(uniq.shape, 1 << 62, dtype=torch.int64).scatter_reduce(
            0, inverse, kernel, "amin"
        )
        exact = torch.zeros(uniq.shape, dtype=torch.int64).scatter_reduce(
            0, inverse, exact_w, "amax"
        )
    else:
        uniq = first = exact = torch.empty(0, dtype=torch.int64)
    name = args.kernels
    reads: list[Read] = []
    unowned: list[Word] = []
    own = owners.hit(uniq)
    if history.owners:  # an arena's replaced buffer, still named by a cached attribute
        was = history.hit(uniq)
        both = torch.nonzero((own >= 0) & (was >= 0)).flatten()
        for o_i, w_i, word, k in zip(
            own[both].tolist(), was[both].tolist(), uniq[both].tolist(), first[both].tolist()
        ):
            o, old = owners.owners[o_i], history.owners[w_i]
            if old.kind == "arena" and o.kind == "derived":
                unowned.append(Word(word, name[k], o.end - o.start, old.name))
    hit = own >= 0
    if bool(hit.any()):
        idx, counts = torch.unique(own[hit], return_counts=True)
        firsts = torch.full((len(owners.owners),), 1 << 62, dtype=torch.int64).scatter_reduce(
            0, own[hit], first[hit], "amin"
        )
        for i, c, k in zip(idx.tolist(), counts.tolist(), firsts[idx].tolist()):
            o = owners.owners[i]
            reads.append(Read(o.name, o.kind, o.start, o.end - o.start, name[k], c, o.ref))
    rest, rest_first, rest_exact = uniq[~hit], first[~hit], exact[~hit]
    temps = 0
    for spans in (args.pool, args.other_pools):
        if spans and rest.numel():
            inside = _hit(*_spans(spans), rest) >= 0
            temps += int(inside.sum())
            rest, rest_first, rest_exact = rest[~inside], rest_first[~inside], rest_exact[~inside]
    # Proof that a word is taken: exact, or memory that was live as the capture began.
    proven = rest_exact > 0
    if args.live_before:
        proven |= _hit(*_spans(args.live_before), rest) >= 0
    last = history.hit(rest)
    unknown: list[Word] = []
    for kind, spans in (("freed", args.freed), ("live", args.live)):
        if not spans or not rest.numel():
            continue
        starts, ends = _spans(spans)
        blocks = _hit(starts, ends, rest)
        inside = blocks >= 0
        if bool(inside.any()):
            b = blocks[inside]
            w_in, k_in, h_in = rest[inside], rest_first[inside], last[inside]
            p_in = proven[inside]
            # One word per allocation: a proven one if any is.
            order = torch.argsort((~p_in).to(torch.int64), stable=True)
            b, w_in, k_in, h_in, p_in = b[order], w_in[order], k_in[order], h_in[order], p_in[order]
            ub, inv = torch.unique(b, return_inverse=True)
            pos = torch.full(ub.shape, 1 << 62, dtype=torch.int64).scatter_reduce(
                0, inv, torch.arange(b.numel(), dtype=torch.int64), "amin"
            )
            # Plain lists: indexing a tensor element costs microseconds, and a graph's
            # words can hit thousands of blocks.
            ws, ks, hs, ps = w_in.tolist(), k_in.tolist(), h_in.tolist(), p_in.tolist()
            lo, hi = starts.tolist(), ends.tolist()
            freed = kind == "freed"
            for blk, j in zip(ub.tolist(), pos.tolist()):
                h = hs[j]
                prev = history.owners[h] if h >= 0 else None
                word = Word(
                    ws[j],
                    name[ks[j]],
                    hi[blk] - lo[blk],
                    prev.name if prev else None,
                    freed=freed and not ps[j],
                )
                # A live allocation an arena's buffer began at (not merely memory it
                # once covered): the replaced buffer itself, kept alive by a cached view.
                replaced = prev is not None and prev.kind == "arena" and lo[blk] == prev.start
                if (freed and ps[j]) or replaced:
                    unowned.append(word)
                else:
                    unknown.append(word)
        keep_rest = ~inside
        rest, rest_first, last = rest[keep_rest], rest_first[keep_rest], last[keep_rest]
        proven = proven[keep_rest]
    # Memory a named owner held, now outside every allocation: unowned when proven taken.
    gone = last >= 0
    for w, k, h, p in zip(
        rest[gone].tolist(), rest_first[gone].tolist(), last[gone].tolist(), proven[gone].tolist()
    ):
        word = Word(w, name[k], 0, history.owners[h].name, freed=not p)
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
    )


def freed_message(label: str, gp: GraphProvenance, *, refused: bool) -> str:
    """What a graph that takes memory no live tensor owns takes, who owned it last, and the
    fix; ``refused``: the graph was destroyed before any replay (the sanitizer), else it
    is kept and serves (a warning)."""
    shown = "\n".join(
        f"  - {w.address:#x} taken by {w.kernel}"
        + (f", last owned by {w.last_owner}" if w.last_owner else ", owner never known")
        for w in gp.unowned[:10]
    )
    more = f"\n  ... and {len(gp.unowned) - 10} more" if len(gp.unowned) > 10 else ""
    fate = (
        "it was refused before any replay"
        if refused
        else "it is kept and serves: its replays read or write that memory"
    )
    return (
        f"{label}: the {gp.where} graph takes {len(gp.unowned)} pointer(s) into memory no live "
        f"tensor owns (freed, or an arena's replaced buffer); {fate}:"
        f"\n{shown}{more}\nTo fix: keep every tensor the step reads alive at one "
        "address from before capture on (size arenas before capture and never grow them "
        "after; do not cache a view of an arena or a weight across a reload); then capture "
        "again."
    )


# ------------------------------------------------------------------ the runner's record


@dataclass(frozen=True)
class Audit:
    """``runner.audit()``: what each graph reads (data; ``print(audit)`` for the table)."""

    runner: str
    enabled: bool
    why: str
    """How provenance was decided (on, off and why)."""
    graphs: tuple[GraphProvenance, ...]
    stale: tuple[tuple[str, str, tuple[GraphKey, ...]], ...] = ()
    """(owner, what changed, graphs reading it): named reads whose owner no longer holds
    the storage the graph took (moved, replaced or freed since capture)."""

    @property
    def derived(self) -> tuple[str, ...]:
        """Derived tensors (no module lists them) that some graph reads."""
        return tuple(sorted({r.name for g in self.graphs for r in g.reads if r.kind == "derived"}))

    @property
    def seconds(self) -> float:
        return sum(g.seconds for g in self.graphs)

    def reading(self, name: str) -> tuple[GraphKey, ...]:
        """The graphs (size, piece) that read owner ``name``."""
        return tuple((g.size, g.piece) for g in self.graphs if any(r.name == name for r in g.reads))

    def table(self) -> str:
        if not self.enabled:
            return f"{self.runner}: provenance off ({self.why})"
        took = f"{self.seconds * 1e3:.1f} ms"
        lines = [f"{self.runner}: {len(self.graphs)} graphs read, {took} ({self.why})"]
        for g in self.graphs:
            kinds: dict[str, int] = {}
            for r in g.reads:
                kinds[r.kind] = kinds.get(r.kind, 0) + 1
            summary = ", ".join(f"{n} {k}" for k, n in kinds.items()) or "no named owner"
            lines.append(
                f"  {g.where}: {g.kernels} nodes, {g.words} words; reads {summary}; "
                f"{g.temporaries} pool words; {len(g.unknown)} unknown; {len(g.unowned)} unowned"
            )
            for r in g.reads:
                if r.kind == "derived":
                    lines.append(f"      derived {r.name} ({r.nbytes} B, first by {r.kernel})")
            for w in g.unknown[:5]:
                where = (
                    "freed memory, not proven read (a struct's unset bytes?)"
                    if w.freed
                    else f"{w.nbytes} B allocation"
                )
                lines.append(f"      unknown {w.address:#x} ({where}, by {w.kernel})")
            for w in g.unowned:
                lines.append(
                    f"      UNOWNED {w.address:#x} by {w.kernel}, last owner {w.last_owner}"
                )
        for name, what, keys in self.stale:
            lines.append(f"  STALE {name}: {what}; read by {_keys(keys)}")
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.table()


def _keys(keys: Sequence[GraphKey]) -> str:
    return ", ".join(f"{s}" if p is None else f"{s}/piece {p}" for s, p in keys)


class Provenance:
    """A runner's provenance: whether its captures are read, what each graph read turned
    into (:meth:`take`, one :class:`GraphProvenance` per graph, which the runner keeps on
    that graph's record), and the questions asked of those records afterwards.

    The owners history (who held which memory when an earlier capture looked) is the one
    thing kept here across graphs: it names the last owner of memory a later graph takes."""

    def __init__(self, label: str, option: bool | None, *, strict: bool = False) -> None:
        self.label = label
        self.option = option
        self.strict = strict
        """Refuse a graph taking a pointer no live tensor owns (the runner's ``sanitize``);
        otherwise it is warned about (once per graph) and listed in :meth:`audit`."""
        self._history: dict[int, Owner] = {}
        self._history_table: Owners | None = None
        """``_history`` as sorted intervals, rebuilt only when an owner is new."""
        self._memo: dict[Any, Any] = {}
        """Answers of :meth:`reads`, :meth:`graph_reads` and :meth:`derived` for one version
        of the records (``check_weights()`` asks on every call; read-only)."""
        self._memo_version = -1
        self._why = "no capture yet"
        self.on = False

    def decide(self, reads_graphs: str | None, backend_name: str) -> bool:
        """Whether this runner's captures are read (``provenance`` option; what the
        backend can read, :attr:`GraphBackend.reads_graphs
        <graphguard.backend.GraphBackend.reads_graphs>`)."""
        option = self.option
        if option is None and env_switch(PROVENANCE_ENV, "provenance"):
            option = True
        if option is False:
            self.on, self._why = False, "provenance=False"
        elif reads_graphs == "cuda" and option:
            self.on = _graph_args.driver() is not None
            self._why = "CUDA graphs, cuda-bindings" if self.on else "cuda-bindings not importable"
        elif reads_graphs == "cpu" and option:
            self.on, self._why = True, "RecordingBackend reads, provenance=True"
        else:
            self.on = False
            self._why = (
                "provenance=True turns it on"
                if reads_graphs in ("cpu", "cuda")
                else f"backend {backend_name!r} cannot read graphs"
            )
        return self.on

    def take(
        self, size: int, piece: int | None, args: GraphArgs | None, owners: Owners
    ) -> GraphProvenance | None:
        """Classify the graph just captured (``args``: what its capture read; None: it
        could not be read). Raise :class:`FreedStorageError` when it takes a pointer into
        memory no live tensor owns and ``strict`` (the caller drops the graph); otherwise
        warn about it (this graph is new: once per graph)."""
        if args is None:
            return None
        if self._history_table is None:
            self._history_table = Owners(list(self._history.values()))
        gp = classify(args, owners, self._history_table, size, piece)
        for o in owners.owners:
            if o.kind != "output" and self._history.get(o.start) != o:
                self._history[o.start] = o
                self._history_table = None
        if len(self._history) > 20000:  # bounded: the oldest go first
            for k in list(self._history)[:5000]:
                del self._history[k]
        if gp.unowned and self.strict:
            raise FreedStorageError(freed_message(self.label, gp, refused=True))
        if gp.unowned:
            logger.warning(
                "%s (warned once per graph; with sanitize=True it is refused at capture)",
                freed_message(self.label, gp, refused=False),
            )
        return gp

    def _memo_for(self, version: int) -> dict[Any, Any]:
        if version != self._memo_version:
            self._memo.clear()
            self._memo_version = version
        return self._memo

    def reads(self, records: Mapping[int, Reads], version: int) -> dict[int, set[int]] | None:
        """Per captured size, the storage addresses its graph(s) read; None when
        provenance is off or some captured graph could not be read."""
        if not self.on or any(r.unread for r in records.values()):
            return None
        memo = self._memo_for(version)
        got: dict[int, set[int]] | None = memo.get("reads")
        if got is None:
            got = {
                size: {r.start for gp in rec.reads.values() for r in gp.reads}
                for size, rec in records.items()
            }
            memo["reads"] = got
        return got

    def graph_reads(
        self, records: Mapping[int, Reads], version: int
    ) -> dict[GraphKey, set[int]] | None:
        """Per graph (size, piece), the storage addresses it reads; None as for
        :meth:`reads`. A PIECEWISE runner's pieces apart: what lets a moved tensor
        recapture only the pieces that read it."""
        if not self.on or any(r.unread for r in records.values()):
            return None
        memo = self._memo_for(version)
        got: dict[GraphKey, set[int]] | None = memo.get("graph_reads")
        if got is None:
            got = {
                key: {r.start for r in gp.reads}
                for rec in records.values()
                for key, gp in rec.reads.items()
            }
            memo["graph_reads"] = got
        return got

    def derived(
        self, module: torch.nn.Module | None, records: Mapping[int, Reads], version: int
    ) -> tuple[tuple[str, ...], list[MovedWeight]]:
        """The derived tensors the graphs read, and, graph by graph, those whose attribute
        no longer holds the storage that graph took (each with the graphs reading the old
        one): a graph captured after a derived tensor was re-created reads the new one and
        is not named."""
        if not self.on or module is None:
            return (), []
        memo = self._memo_for(version)
        taken: dict[str, dict[GraphKey, tuple[int, int]]] | None = memo.get("derived")
        if taken is None:
            taken = {}
            for rec in records.values():
                for key, gp in rec.reads.items():
                    for r in gp.reads:
                        if r.kind == "derived":
                            taken.setdefault(r.name, {})[key] = (r.start, r.nbytes)
            memo["derived"] = taken
        if not taken:
            return (), []
        now = {n: t for n, t in _derived(module)}
        moved = []
        for name, by_graph in taken.items():
            t = now.get(name)
            ptr = int(t.untyped_storage().data_ptr()) if isinstance(t, torch.Tensor) else None
            stale = {k: v for k, v in by_graph.items() if v[0] != ptr}
            if not stale:
                continue
            start = next(iter(stale.values()))[0]
            what = (
                "no longer a tensor attribute of the module"
                if ptr is None
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

    def audit(self, records: Mapping[int, Reads], now: Owners, freed: Sequence[Span] = ()) -> Audit:
        """The records, with every named read checked against the owners ``now``, and every
        unnamed allocation a graph took (live when it was captured) against ``freed``, the
        allocator's free blocks now: one freed since is memory the graph still writes or
        reads that no tensor holds (a library's workspace dropped under it, say)."""
        by_name = {o.name: o for o in now.owners}
        stale: dict[str, tuple[str, list[GraphKey]]] = {}
        free_starts, free_ends = _spans(freed) if freed else (None, None)
        graphs = [gp for rec in records.values() for gp in rec.reads.values()]
        graphs.sort(key=lambda gp: (gp.size, -1 if gp.piece is None else gp.piece))
        for gp in graphs:
            key = (gp.size, gp.piece)
            live = [w for w in gp.unknown if not w.freed]
            if live and free_starts is not None and free_ends is not None:
                addrs = torch.tensor([w.address for w in live], dtype=torch.int64)
                gone = (_hit(free_starts, free_ends, addrs) >= 0).tolist()
                for w, g in zip(live, gone):
                    if g:
                        name = f"unnamed {w.nbytes} B allocation at {w.address:#x} ({w.kernel})"
                        what = "freed since capture: the graph still takes its address"
                        stale.setdefault(name, (what, []))[1].append(key)
            for r in gp.reads:
                if r.kind == "output":
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
            stale=tuple((n, w, tuple(k)) for n, (w, k) in stale.items()),
        )


class Reads(Protocol):
    """What provenance reads of one captured size's record (a
    :class:`~graphguard.ladder.record.GraphRecord`): each of its graphs' provenance, and
    whether one of them could not be read."""

    @property
    def reads(self) -> Mapping[GraphKey, GraphProvenance]: ...

    @property
    def unread(self) -> bool: ...


def _sorted(keys: Iterable[GraphKey]) -> tuple[GraphKey, ...]:
    return tuple(sorted(set(keys), key=lambda k: (k[0], -1 if k[1] is None else k[1])))


__all__ = [
    "KINDS",
    "Audit",
    "GraphKey",
    "GraphProvenance",
    "Owner",
    "Owners",
    "Provenance",
    "Read",
    "Reads",
    "Word",
    "classify",
]
