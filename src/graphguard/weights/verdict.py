"""The refit verdict: after new weights land, every tensor a graph reads is classified.

An update can be wrong in two ways. It can *move* a tensor (re-create it at a new
address: the graphs keep reading the old one), which :meth:`Weights.check
<graphguard.weights.record.Weights.check>` proves from addresses. Or it can *not write* a
tensor the graphs read (routed experts a loader never synced, a ``set_()`` publication
that replaced a storage's owner but not the bytes the graph reads, a scale the loader
forgot): addresses prove nothing then, and the graphs serve old values with no error.

A refit (:class:`~graphguard.weights.refit.Watch`) therefore starts from what the graphs
read (provenance: per graph, by owner; without it, every parameter and buffer of the
module) and, when it ends, puts each of those tensors in one of four classes:

* **moved**: re-created since capture (``check_weights``): recaptured or raised
  (``on_moved``);
* **derived** (a tensor no module lists, made at load): refreshed (written, or
  ``refresh=`` given) or stale;
* **written**: its storage was written during the refit;
* **not written**: it was not. Those among ``expect`` (every parameter, by default) are
  named with the graphs that read them, and raise :class:`~graphguard.errors.
  StaleWeightsError` unless ``strict=False``.

How each class is proven (version counters, checksums, what a copy covered) is the
watch's: :mod:`graphguard.weights.refit`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from graphguard.errors import StaleWeightsError

if TYPE_CHECKING:
    from graphguard.weights.record import GraphKey, MovedWeight, WeightRecord

CHECKED = ("parameter", "buffer", "derived")
"""The kinds of graph reads a refit classifies (state, inputs and arenas are not weights)."""


class NamedReadLike(Protocol):
    """One named storage some graph reads (:class:`graphguard.provenance.NamedRead`)."""

    @property
    def name(self) -> str: ...

    @property
    def kind(self) -> str: ...

    @property
    def start(self) -> int: ...

    @property
    def graphs(self) -> tuple[GraphKey, ...]: ...

    @property
    def slot(self) -> Any: ...


@dataclass(frozen=True)
class RefitReads:
    """What a refit asks of one runner (its door's ``refit_reads()``)."""

    label: str
    named: Mapping[str, NamedReadLike] | None
    """Every named storage a graph reads, with the graphs; None: not known (provenance
    off, or a graph could not be read): every parameter and buffer counts as read by
    every graph."""
    records: tuple[WeightRecord, ...]
    """What the captures saw of the module (who owned each storage then)."""
    graphs: tuple[GraphKey, ...]


@dataclass(frozen=True)
class Unwritten:
    """A tensor the graphs read that the refit did not write."""

    name: str
    kind: str
    graphs: tuple[GraphKey, ...]
    runners: tuple[str, ...]
    expected: bool
    """Named by ``expect`` (default: every parameter): a stale value the graphs serve."""


@dataclass(frozen=True)
class RefitVerdict:
    """Every tensor the graphs read, classified at the end of a refit (module docstring):
    ``moved``, ``derived`` (refreshed or stale), ``written``, ``not_written``."""

    owner: str
    written: tuple[str, ...]
    not_written: tuple[Unwritten, ...]
    moved: tuple[MovedWeight, ...]
    derived: tuple[str, ...]
    """Derived tensors the graphs read."""
    stale_derived: tuple[Unwritten, ...]
    """Derived tensors the graphs read that the refit neither wrote nor refreshed."""
    reads_known: bool
    """Which graph reads what came from the graphs (provenance); else every graph was
    taken to read every parameter and buffer."""
    graphs: int
    how: str
    """``"copy"`` (what a state-dict update copied) or ``"observed"`` (version counters
    and checksums around a loader)."""
    seconds: float = 0.0
    unread: tuple[str, ...] = ()
    """Names of ``expect`` that no graph reads (nothing to prove for them)."""

    @property
    def missing(self) -> tuple[Unwritten, ...]:
        """The expected weights the graphs read that the refit did not write."""
        return tuple(u for u in self.not_written if u.expected)

    @property
    def ok(self) -> bool:
        """Nothing moved, every expected weight the graphs read written, no stale derived."""
        return not (self.moved or self.missing or self.stale_derived)

    def __bool__(self) -> bool:
        return self.ok

    def summary(self) -> str:
        known = "reads from the graphs" if self.reads_known else "reads not known: all"
        return (
            f"{self.owner}: {len(self.written)} written, {len(self.missing)} expected not "
            f"written, {len(self.not_written) - len(self.missing)} other not written, "
            f"{len(self.moved)} moved, {len(self.derived) - len(self.stale_derived)}/"
            f"{len(self.derived)} derived refreshed ({known}, {self.graphs} graphs, "
            f"{self.how}, {self.seconds * 1e3:.2f} ms)"
        )

    def message(self) -> str:
        """What the refit left stale, by name, with the graphs that read it, and the fix."""
        if self.ok:
            return self.summary()
        lines = [self.summary() + ":"]
        for u in (*self.missing, *self.stale_derived)[:20]:
            what = (
                "derived at load, neither written nor refreshed"
                if u.kind == "derived"
                else "not written by the refit"
            )
            lines.append(f"  - {u.name} ({u.kind}): {what}; read by {_where(u.graphs)}")
        more = len(self.missing) + len(self.stale_derived) - 20
        if more > 0:
            lines.append(f"  ... and {more} more")
        for m in self.moved[:10]:
            lines.append(f"  - MOVED {m.name}: {m.change}")
        lines.append(
            "The graphs still serve the old values of these tensors. To fix: write every "
            "weight the graphs read in place (the loader skipped the ones named: routed "
            "experts, a scale, a fused weight?), re-derive derived tensors in place or pass "
            "refresh=; expect=[names] names what this refit is meant to change, "
            "strict=False only reports."
        )
        return "\n".join(lines)

    def raise_if_stale(self) -> None:
        """Raise :class:`~graphguard.errors.StaleWeightsError` naming what was not written."""
        bad = (*self.missing, *self.stale_derived)
        if bad:
            raise StaleWeightsError(self.message(), names=tuple(u.name for u in bad))


def _where(keys: Sequence[GraphKey]) -> str:
    sizes = sorted({s for s, _ in keys})
    pieces = sorted({p for _, p in keys if p is not None})
    text = "size " + ",".join(map(str, sizes[:8])) + ("..." if len(sizes) > 8 else "")
    text += f" piece {','.join(map(str, pieces))}" if pieces else ""
    return f"{text} ({len(keys)} graph{'s' if len(keys) != 1 else ''})"


__all__ = ["CHECKED", "NamedReadLike", "RefitReads", "RefitVerdict", "Unwritten"]
