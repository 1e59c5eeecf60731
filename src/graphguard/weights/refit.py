"""The refit's watch: what proves each tensor the graphs read was written (or not)
when new weights land; the verdict it returns is :mod:`graphguard.weights.verdict`.

How "written" is proven. ``update_weights`` with a state dict knows what it copied: a
name is written when a copied destination covers its bytes (no device work). A loader
(``with runner.refit(): loader()``, ``update_weights(callable)``) is observed instead:
each tensor's version counter (torch bumps it on every in-place write through a tensor
that shares it: ``copy_``, ``load_state_dict``, a view's write) and a checksum of its
elements (the sum of its bit patterns as integers, exact: any change of any element
changes it, short of compensating changes such as a permutation) taken when the refit
begins and compared when it ends. The checksum catches writes that bypass version
counters (``param.data.copy_(...)``, ``set_``, a C extension, NCCL), inference tensors
(which have no counter) and views of one packed buffer (whose counter is shared: a write
to ``q`` bumps ``k``'s too). A write of the very bytes that were there is
indistinguishable from no write, and is reported as not written.

Cost. Checksums are taken of what a verdict can turn on (the weights among ``expect``
and derived tensors; another graph-read tensor, a buffer the refit is not meant to
change, is classified by its version counter alone), each storage once, as int64 words:
one read of those bytes when the refit begins, and at its end only of the tensors whose
counter did not prove the write. A loader that writes in place through torch
(``copy_``, ``load_state_dict``, ``_foreach_copy_``) therefore costs its own copy plus
one read of the weights (about 2x a bare copy of a whole model on an H200); an update
from a state dict (``update_weights``) knows what it copied and reads nothing.
"""

from __future__ import annotations

import bisect
import contextlib
import difflib
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from graphguard.errors import ConfigError
from graphguard.weights.record import (
    GraphKey,
    WeightCheck,
    Weights,
    held_by,
)
from graphguard.weights.verdict import (
    CHECKED,
    NamedReadLike,
    RefitReads,
    RefitVerdict,
    Unwritten,
)

_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


# ------------------------------------------------------------------ the watch


@dataclass
class _Entry:
    """One graph-read tensor a refit classifies."""

    name: str
    kind: str
    tensor: torch.Tensor | None
    storage: int
    graphs: list[GraphKey] = field(default_factory=list)
    runners: list[str] = field(default_factory=list)
    expected: bool = False
    slot: Any = None
    version: int | None = None


def _version_of(t: torch.Tensor) -> int | None:
    try:
        return int(t._version)
    except RuntimeError:  # an inference tensor has no version counter
        return None


def _checksum(t: torch.Tensor) -> torch.Tensor | None:
    """The sum of ``t``'s bytes read as integers (int64, wrapping): exact, order-free, no
    temporary the size of ``t`` (None: not a dense tensor of a known element size).

    A contiguous tensor whose bytes are whole aligned 8-byte words is summed as int64
    words: the same proof (any change of any word changes the sum), and a native int64
    reduction: on the H200 1.9 ms over the 1B step's 2.3 GiB against 7.4 ms summing its
    bf16 elements as int16 into int64 (``bench/probes/probe_refit_cost.py``). Other
    tensors sum their elements' bit patterns."""
    it = _INT.get(t.element_size())
    if it is None or t.layout != torch.strided or t.device.type == "meta":
        return None
    if t.numel() == 0:
        return torch.zeros((), dtype=torch.int64, device=t.device)
    t = t.detach()
    if t.is_contiguous() and (t.numel() * t.element_size()) % 8 == 0 and t.data_ptr() % 8 == 0:
        return t.reshape(-1).view(torch.int64).sum()
    return t.view(it).sum(dtype=torch.int64)


def _span(t: torch.Tensor) -> tuple[torch.device, int, int]:
    start = int(t.data_ptr())
    extent = 1 + sum((n - 1) * abs(s) for n, s in zip(t.shape, t.stride()) if n > 0)
    return t.device, start, start + extent * t.element_size()


class Target(Protocol):
    """What a refit needs of one runner (its door)."""

    @property
    def label(self) -> str: ...

    @property
    def weights(self) -> Weights: ...

    def refit_reads(self) -> RefitReads: ...


def expected_names(module: torch.nn.Module, expect: Iterable[str] | None) -> set[str]:
    """``expect`` checked against ``module`` (every name must be a parameter or buffer of
    it); None: every parameter name."""
    names = {n for n, _ in module.named_parameters(remove_duplicate=False)}
    if expect is None:
        return names
    known = names | {n for n, _ in module.named_buffers(remove_duplicate=False)}
    if isinstance(expect, str):
        raise ConfigError(f"expect= takes names (a list), got the string {expect!r}")
    given = set(expect)
    odd = [n for n in given if not isinstance(n, str)]
    if odd:  # refused here: the hints below would compare them as names
        raise ConfigError(
            f"refit: expect= takes names (str), as the module names its parameters and "
            f"buffers; got {odd[0]!r:.40} ({type(odd[0]).__name__})"
        )
    unknown = sorted(given - known)
    if unknown:
        hints = []
        for n in unknown[:10]:
            close = difflib.get_close_matches(n, known, 1)
            hints.append(n + (f" (did you mean {close[0]!r}?)" if close else ""))
        raise ConfigError(
            f"refit: expect= names {len(unknown)} tensor(s) the module does not have: "
            + ", ".join(hints)
        )
    return given


class Watch:
    """What one refit watches (see the module docstring): every tensor the graphs of
    ``targets`` read, taken when the refit begins; with ``observe``, each one's version
    counter and checksum too. :meth:`verdict` classifies them when it ends."""

    def __init__(
        self,
        targets: Sequence[Target],
        *,
        expect: Iterable[str] | None,
        observe: bool,
        reads: Sequence[RefitReads] | None = None,
    ) -> None:
        self.t0 = time.perf_counter()
        self.observe = observe
        self.labels = [t.label for t in targets]
        self.entries: list[_Entry] = []
        self.reads_known = True
        self.unread: list[str] = []
        self.graph_count = 0
        expect = list(expect) if expect is not None and not isinstance(expect, str) else expect
        by_module: dict[int, dict[str, _Entry]] = {}
        for i, t in enumerate(targets):
            got = reads[i] if reads is not None else t.refit_reads()
            module = t.weights.module
            mine = by_module.setdefault(id(module), {})
            wanted = expected_names(module, expect)
            self.graph_count += len(got.graphs)
            self._add(mine, got, wanted)
            read = set(mine)
            self.unread += sorted(wanted - read)
            for e in mine.values():
                e.expected = e.expected or e.name in wanted
        self.entries = [e for m in by_module.values() for e in m.values()]
        self.sums: list[torch.Tensor | None] = []
        if observe:
            # Only what a verdict can turn on: a weight among expect, or a derived
            # tensor. Another tensor the graphs read (a buffer the refit is not meant to
            # change) is classified by its version counter alone: reported, never raised.
            self.sums = _checksums(
                [e.tensor if (e.expected or e.kind == "derived") else None for e in self.entries]
            )

    def _add(self, mine: dict[str, _Entry], reads: RefitReads, wanted: set[str]) -> None:
        by_storage: dict[int, list[Any]] = {}
        slots: dict[str, Any] = {}
        for rec in reads.records:
            for s in rec.slots:
                if s.name not in slots:
                    slots[s.name] = s
                    by_storage.setdefault(s.storage_ptr, []).append(s)
        if reads.named is None:
            self.reads_known = False
            for s in slots.values():
                kind = "buffer" if s.buffer else "parameter"
                self._entry(mine, s.name, kind, s.ref(), s.storage_ptr, reads.graphs, reads.label)
            return
        for r in reads.named.values():
            if r.kind not in CHECKED:
                continue
            if r.kind == "derived":
                t = held_by(r.slot) if r.slot is not None else None
                e = self._entry(mine, r.name, "derived", t, r.start, r.graphs, reads.label)
                e.slot = r.slot
                continue
            for s in by_storage.get(r.start, ()):
                kind = "buffer" if s.buffer else "parameter"
                self._entry(mine, s.name, kind, s.ref(), s.storage_ptr, r.graphs, reads.label)

    def _entry(
        self,
        mine: dict[str, _Entry],
        name: str,
        kind: str,
        t: torch.Tensor | None,
        storage: int,
        graphs: Sequence[GraphKey],
        label: str,
    ) -> _Entry:
        e = mine.get(name)
        if e is None:
            e = mine[name] = _Entry(name, kind, t, storage)
            if t is not None and self.observe:
                e.version = _version_of(t)
        e.graphs.extend(graphs)
        e.runners.append(label)
        return e

    def verdict(
        self,
        found: Sequence[WeightCheck],
        *,
        copied: Sequence[Any] = (),
        refreshed: bool = False,
    ) -> RefitVerdict:
        """Classify every entry: ``found`` are the runners' checks after the refit (what
        moved); ``copied``: the copy plans an update applied (what it wrote, when not
        observing); ``refreshed``: ``refresh=`` was given (derived tensors count as
        re-derived, in place or not: the caller says so)."""
        moved_by_name = {m.name: m for f in found for m in f.moved}
        written_spans = _covered(copied) if not self.observe else None
        same = {n for p in copied for n in getattr(p, "same", ())}
        changed = self._changed() if self.observe else {}
        written: list[str] = []
        not_written: list[Unwritten] = []
        stale_derived: list[Unwritten] = []
        derived: list[str] = []
        for i, e in enumerate(self.entries):
            if e.kind == "derived":
                derived.append(e.name)
            if e.name in moved_by_name:
                continue
            if self.observe:
                wrote = changed.get(i, True)
            elif e.name in same:
                wrote = True
            else:
                wrote = e.tensor is not None and _inside(e.tensor, written_spans or {})
            graphs = _keys(e.graphs)
            if wrote:
                written.append(e.name)
            elif e.kind == "derived":
                if not refreshed:
                    stale_derived.append(Unwritten(e.name, e.kind, graphs, _once(e.runners), True))
            else:
                not_written.append(Unwritten(e.name, e.kind, graphs, _once(e.runners), e.expected))
        return RefitVerdict(
            owner=" / ".join(self.labels),
            written=tuple(written),
            not_written=tuple(not_written),
            moved=tuple(moved_by_name.values()),
            derived=tuple(sorted(derived)),
            stale_derived=tuple(stale_derived),
            reads_known=self.reads_known,
            graphs=self.graph_count,
            how="observed" if self.observe else "copy",
            seconds=time.perf_counter() - self.t0,
            unread=tuple(self.unread),
        )

    def _changed(self) -> dict[int, bool]:
        """Per entry index: written (version counter moved, for a tensor that shares its
        counter with no other view watched) or its checksum changed."""
        views: dict[tuple[Any, int], set[tuple[int, Any, Any]]] = {}
        for e in self.entries:
            t = e.tensor
            if t is not None:
                key = (t.device, e.storage)
                views.setdefault(key, set()).add((t.data_ptr(), tuple(t.shape), t.stride()))
        out: dict[int, bool] = {}
        need: list[int] = []
        for i, e in enumerate(self.entries):
            t = e.tensor
            if t is None:
                out[i] = False
                continue
            shared = len(views.get((t.device, e.storage), ())) > 1
            now = _version_of(t)
            if e.version is not None and now is not None and now != e.version and not shared:
                out[i] = True
            elif self.sums[i] is None and _checksum_known(e):
                # Not summed when the refit began (neither expected nor derived): its
                # version counter decides (a write outside torch is not looked for).
                out[i] = e.version is not None and now is not None and now != e.version
            else:
                need.append(i)
        if not need:
            return out
        after = _checksums([self.entries[i].tensor for i in need])
        by_dev: dict[torch.device, list[tuple[int, torch.Tensor, torch.Tensor]]] = {}
        for i, a in zip(need, after):
            b = self.sums[i]
            if a is None or b is None:  # nothing to compare: not provable, never raised
                out[i] = True
            else:
                by_dev.setdefault(a.device, []).append((i, a, b))
        for items in by_dev.values():
            ends = torch.stack([a for _, a, _ in items])
            starts = torch.stack([b for _, _, b in items])
            for (i, _, _), d in zip(items, torch.ne(ends, starts).tolist()):
                out[i] = bool(d)
        return out


def _checksum_known(e: _Entry) -> bool:
    """Whether an entry not summed at the start was left out on purpose (not expected, not
    derived), as opposed to a tensor no checksum can be taken of."""
    return not e.expected and e.kind != "derived"


def _checksums(tensors: Sequence[torch.Tensor | None]) -> list[torch.Tensor | None]:
    """:func:`_checksum` of each (on its device, queued; read when compared; a tensor
    given twice, as tied names give it, summed once), after the device finished what was
    queued before: a loader's writes on another stream land first, and the next ones
    cannot overtake the sums."""
    devices = {t.device for t in tensors if t is not None and t.device.type == "cuda"}
    for dev in devices:
        torch.cuda.synchronize(dev)
    done: dict[tuple[Any, ...], torch.Tensor | None] = {}
    out: list[torch.Tensor | None] = []
    with torch.no_grad():
        for t in tensors:
            if t is None:
                out.append(None)
                continue
            key = (t.device, t.data_ptr(), t.dtype, tuple(t.shape), t.stride())
            if key not in done:
                done[key] = _checksum(t)
            out.append(done[key])
    for dev in devices:
        torch.cuda.synchronize(dev)
    return out


def _covered(plans: Sequence[Any]) -> dict[torch.device, list[tuple[int, int]]]:
    """Per device, the sorted byte spans an update's copies wrote."""
    spans: dict[torch.device, list[tuple[int, int]]] = {}
    for p in plans:
        for d in p.dsts:
            dev, lo, hi = _span(d)
            spans.setdefault(dev, []).append((lo, hi))
    return {dev: sorted(s) for dev, s in spans.items()}


def _inside(t: torch.Tensor, spans: Mapping[torch.device, list[tuple[int, int]]]) -> bool:
    """Whether a copied span covers all of ``t``'s bytes (the spans of one update's
    destinations never overlap, so the one starting last at or before ``t`` decides)."""
    dev, lo, hi = _span(t)
    got = spans.get(dev, ())
    i = bisect.bisect_right(got, (lo, 1 << 63)) - 1
    return i >= 0 and got[i][0] <= lo and hi <= got[i][1]


def _keys(keys: Iterable[GraphKey]) -> tuple[GraphKey, ...]:
    return tuple(sorted(set(keys), key=lambda k: (k[0], -1 if k[1] is None else k[1])))


def _once(labels: Iterable[str]) -> tuple[str, ...]:
    return tuple(dict.fromkeys(labels))


# ------------------------------------------------------------------ the context


class Settle(Protocol):
    """How a refit ends (:func:`graphguard.weights.update.settle`): moved tensors raised
    or recaptured, stale ones raised; what was recaptured, per runner label."""

    def __call__(self, verdict: RefitVerdict, found: Sequence[Any]) -> Any: ...


class RefitContext(contextlib.AbstractContextManager["RefitContext"]):
    """``with runner.refit(expect=..., strict=...) as r: loader(model)``: on exit every
    tensor the graphs read is classified (:class:`RefitVerdict`, ``r.verdict``); see the
    module docstring and :meth:`graphguard.GraphRunner.refit`.

    ``begin`` runs on entry (takes the runners' guards, checks what already moved, makes
    the :class:`Watch`); ``end(error)`` on exit returns the verdict or raises."""

    def __init__(
        self,
        begin: Callable[[], Watch],
        end: Callable[[Watch, BaseException | None], Any],
        release: Callable[[], None],
    ) -> None:
        self._begin, self._end, self._release = begin, end, release
        self._watch: Watch | None = None
        self.verdict: RefitVerdict | None = None
        """The verdict, once the block has ended (None before, or when it raised)."""
        self.update: Any = None
        """What the refit's end did (a :class:`~graphguard.weights.WeightUpdate`)."""

    def __enter__(self) -> RefitContext:
        try:
            self._watch = self._begin()
        except BaseException:
            self._release()
            raise
        return self

    def __exit__(self, et: Any, ev: Any, tb: Any) -> None:
        watch, self._watch = self._watch, None
        try:
            if watch is not None:
                self.update = self._end(watch, ev)
                self.verdict = getattr(self.update, "refit", None)
        finally:
            self._release()


__all__ = [
    "CHECKED",
    "NamedReadLike",
    "RefitContext",
    "RefitReads",
    "RefitVerdict",
    "Unwritten",
    "Watch",
    "expected_names",
]
