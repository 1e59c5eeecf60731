"""How every weight change ends (an update, a refit): the ranks agree on what moved and
on the verdict, moved graphs are captured again or raise, and what was done comes back as
a :class:`WeightUpdate`.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from graphguard.errors import WeightsMovedError
from graphguard.weights.record import GraphKey, MovedWeight, WeightCheck

if TYPE_CHECKING:
    from graphguard.weights.protocols import Agreeing, Recapture, Refit
    from graphguard.weights.verdict import RefitVerdict


@dataclass(frozen=True)
class WeightUpdate:
    """What :meth:`update_weights` (or a refit) did."""

    copied: tuple[str, ...]
    """Names whose values were copied into the captured storages (tied: the first name)."""
    bytes: int
    """Bytes copied (each tied storage once)."""
    seconds: float
    """Wall time of the whole call (validation, copies, device synchronize, checks)."""
    ignored: tuple[str, ...] = ()
    """Source names not in the module (``strict=False`` only)."""
    missing: tuple[str, ...] = ()
    """Module names the source did not give (``strict=False`` only; non-persistent
    buffers are never required)."""
    loaded_by_callable: bool = False
    """The source was a callable that loaded in place (graphguard then observed it)."""
    moved: tuple[MovedWeight, ...] = ()
    """What had moved (by the loader, or before the call) and was recaptured."""
    recaptured: dict[str, tuple[int, ...]] = dataclasses.field(default_factory=dict)
    """Per runner label (``GraphRunner(step)``), the sizes recaptured (``on_moved="recapture"``)."""
    recaptured_graphs: dict[str, tuple[GraphKey, ...]] = dataclasses.field(default_factory=dict)
    """Per runner label, the graphs recaptured, ``(size, piece)`` (piece None: a FULL
    graph): with provenance a PIECEWISE runner redoes only the pieces that read what moved."""
    graphs_total: dict[str, int] = dataclasses.field(default_factory=dict)
    """Per runner label that recaptured, the graphs it held (FULL: one per size;
    PIECEWISE: one per piece and size)."""
    refit: RefitVerdict | None = None
    """Every tensor the graphs read, classified (None: no graph captured yet)."""
    versions_checked: tuple[str, ...] = ()
    """Names of the module whose version counters were read just before and just after
    the copy was launched (a weight sync: every name whose tensor the copy writes, tied
    names included); empty when not counted (``update_weights``, inference tensors)."""
    versions_unchanged: tuple[str, ...] = ()
    """Of :attr:`versions_checked`, those whose counter did not advance by the writes the
    copy makes to it: not written by this call."""
    phases: dict[str, float] = dataclasses.field(default_factory=dict)
    """Where :attr:`seconds` went (``update_weights``): ``validate`` (host work before the
    copy is launched: the source checked, the kept plan and the module's tensors
    re-proved), ``launch`` (a device synchronize, then the fused copies launched),
    ``check`` (the graphs' reads checked and the verdict, on the host while the device
    copies), ``wait`` (the rest of the copy), ``settle`` (after it: what moved, the
    verdict applied). Only ``validate``, ``settle`` and any ``check`` longer than the
    copy add to the bare copy's time."""

    def summary(self) -> str:
        text = (
            f"updated {len(self.copied)} tensors ({self.bytes / 2**20:.1f} MiB) in "
            f"{self.seconds * 1e3:.2f} ms"
        )
        if self.recaptured:
            text += "; recaptured " + ", ".join(
                f"{k} {list(v)}"
                + (
                    f" ({len(self.recaptured_graphs.get(k, ()))} of {self.graphs_total[k]} graphs)"
                    if k in self.graphs_total
                    else ""
                )
                for k, v in self.recaptured.items()
            )
        if self.refit is not None and not self.refit.ok:
            text += f"; NOT OK: {len(self.refit.missing)} expected weight(s) not written"
        return text


def settle(
    found: Sequence[tuple[Refit, WeightCheck]],
    verdict: RefitVerdict | None,
    *,
    on_moved: str,
    strict: bool,
    agreement: Agreeing | None,
    recapture: Recapture | None,
    around_recapture: Callable[[], contextlib.AbstractContextManager[Any]] | None,
    reason: str,
) -> WeightUpdate:
    """The end of every refit: the ranks agree on what moved (it raises on every rank, or
    every rank recaptures: ``on_moved``), then on the verdict (a weight left stale on any
    rank raises on every rank with ``strict``, before any recapture: recapturing would
    not write a stale value). What was recaptured, as a :class:`WeightUpdate`."""
    moved = [m for _, f in found for m in f.moved]
    err = next(
        (
            WeightsMovedError(
                f.message() + "\n(The loader moved them; the graphs still read the old storage.)",
                names=tuple(m.name for m in f.moved),
            )
            for _, f in found
            if f.moved
        ),
        None,
    )
    if agreement is not None:
        redo = agreement.agree_update("checking", err, fail=on_moved == "raise")
    elif err is not None and on_moved == "raise":
        raise err
    else:
        redo = err is not None
    stale: BaseException | None = None
    if verdict is not None and strict:
        try:
            verdict.raise_if_stale()
        except Exception as exc:
            stale = exc
    if agreement is not None and strict:
        agreement.agree_update("verdict", stale)
    elif stale is not None:
        raise stale
    recaptured: dict[str, tuple[int, ...]] = {}
    graphs: dict[str, tuple[Any, ...]] = {}
    total: dict[str, int] = {}
    for t, f in found if redo else ():
        if not f.moved and agreement is None:
            continue
        with around_recapture() if around_recapture is not None else contextlib.nullcontext():
            why = reason + ("" if f.moved else " on a peer rank")
            report = (recapture or _own_recapture)(t, f, why)
        if report is not None:
            recaptured[t.label] = tuple(sorted({k[0] for k in report.recaptured_graphs}))
            graphs[t.label] = tuple(report.recaptured_graphs)
            total[t.label] = report.graphs_total
    return WeightUpdate(
        copied=(),
        bytes=0,
        seconds=0.0,
        moved=tuple(moved),
        recaptured=recaptured,
        recaptured_graphs=graphs,
        graphs_total=total,
        refit=verdict,
    )


def _own_recapture(target: Refit, found: WeightCheck, reason: str) -> Any:
    return target.recapture_moved(found, reason)


__all__ = ["WeightUpdate", "settle"]
