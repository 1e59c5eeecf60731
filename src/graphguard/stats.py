"""Serving statistics: what each size did after capture, as data and as one table.

Why: the slow failures of graphs in serving raise nothing. A captured size that traffic
never reaches holds memory for nothing; batches above the ladder run eagerly at a
fraction of the speed, logged once and then invisible (vLLM #54677). ``runner.stats()``
shows both, per size, and the runner warns once when either becomes a pattern.

The replay path counts nothing new: an entry's canary countdown is already decremented
on every call, so it is the replay count (:attr:`graphguard.entries.Entry.replays`);
eager calls are counted on the slow path they already take, and the warnings are
checked there, at the 64th, 128th, 256th ... eager call, and by ``stats()``.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, Protocol

from graphguard.entries import Entry
from graphguard.ledger import GraphLedger, mib

logger = logging.getLogger("graphguard")

EAGER_SHARE = 0.05
"""Warn once when more than this share of calls ran eagerly above the ladder ..."""
MIN_CALLS = 1000
"""... after at least this many calls."""
UNUSED_AFTER = 10_000
"""Warn once when a captured size has not been replayed in this many calls since its
capture (it holds graph memory for traffic that does not come)."""

FAILED = "failed"
"""The status of a size whose capture raised (its batches pad upwards or run eagerly)."""
OVER_BUDGET = "over budget"
"""The status of a lazy size refused by ``Lazy(budget=...)``."""

ABOVE = "above the ladder"
"""The eager reason of a batch larger than the largest size (the one the warning is about)."""
FIRST_CALL = "first call: the size's warmup"
"""The eager reason of a lazy size's first call, run eagerly as its warmup
(:mod:`graphguard.lazy`); the next call at that size captures it."""


@dataclass
class SizeStats:
    """One size of the ladder."""

    size: int
    status: str
    """``captured``; ``pending`` (lazy, serving: its first call runs it eagerly as its
    warmup); ``warmed`` (lazy: its first warmup ran, at its first call or the stage:
    captured by the next call that pads to it); ``evicted`` (lazy: released to make room
    under the budget, captured again by the next call that pads to it); ``not captured``
    (before ``capture()``, after ``release()``, or a size of an up-front ladder that has no
    graph: calls raise or run eagerly); ``failed`` (its capture or first call raised: the
    batches that pad to it run on the next larger graph or eagerly); ``over budget``
    (lazy: not captured, it would exceed ``Lazy(budget=...)``)."""
    replays: int = 0
    """Calls replayed at this size since the runner was built: its hits (a canary-served
    eager call of a demoted size included: ``canary_stats()`` tells them apart)."""
    warmup_calls: int = 0
    """Lazy: calls at this size run eagerly as its warmup, on the caller's inputs (one per
    stage: its first call)."""
    evictions: int = 0
    """Lazy with ``evict="lru"``: times its graph was released to make room."""
    recaptures: int = 0
    """Lazy: times it was captured again after an eviction."""
    how: str | None = None
    """``up front`` (in ``capture()``) or ``lazily`` (on first use)."""
    capture_s: float = 0.0
    """Warmups plus capture of its latest capture, in seconds (what its first call cost)."""
    pool_bytes: int = 0
    driver_bytes: int = 0
    note: str | None = None
    """Why it failed or was not captured."""
    phases_ms: dict[str, float] = field(default_factory=dict)
    """Its latest capture's cost by phase, in milliseconds (:attr:`CaptureReport.phases
    <graphguard.report.CaptureReport.phases>`): a lazy capture's own, with ``total``
    (what the call that met the size waited) and ``other`` (``total`` less the named
    phases); for sizes captured up front, the phases of the whole ``capture()`` run."""
    warmups: int = 0
    """Uncaptured warmup forwards its latest capture ran right before it."""
    first_call_ms: dict[str, float] = field(default_factory=dict)
    """Lazy: its latest first call by phase, in milliseconds: ``rows`` (the batch copied
    into the static buffers, and eviction's look at recency), ``forward`` (the eager
    forward's launch, in phase WARMUP), ``sync`` (the device-wide synchronize: the
    forward's device time), ``after`` (its outputs narrowed to the batch). What the
    lifecycle adds to an eager call is ``rows`` and ``after`` plus the call's dispatch."""
    prewarmed: bool = False
    """Its capture counted an earlier forward at this size as its first warmup iteration
    (lazily: its first call's, run eagerly on the caller's inputs, or the stage's with
    ``Lazy(warm_shapes=True)``, or, after an eviction, its earlier capture's; up front: the
    output-layout probe's, at the two largest sizes), so ``warmups`` is
    ``warmup_iters - 1`` and ``phases_ms["warmup"]`` is 0.0 with the default
    ``warmup_iters=1`` (:attr:`graphguard.report.SizeReport.prewarmed`)."""


@dataclass
class ServingStats:
    """``runner.stats()``: per size and in total, what serving did (see the module)."""

    name: str
    lazy: bool
    calls: int
    replays: int
    eager_calls: int
    eager_reasons: dict[str, int]
    """Eager calls by reason (``above the ladder``, ``failed size``, ``over budget``, ...)."""
    eager_batches: dict[int, int]
    """Eager calls by batch size."""
    sizes: list[SizeStats]
    budget: int | None
    pool_bytes: int
    driver_bytes: int
    warnings: list[str] = field(default_factory=list)
    evictions: int = 0
    """Graphs released to make room under the budget (``Lazy(evict="lru")``)."""
    driver_adjust_bytes: int = 0
    """What evictions and drops did not give back of what they were charged (the driver's
    share of each graph; a released pool's segments left mapped), net of page rounding
    (:attr:`GraphLedger.driver_adjust <graphguard.ledger.GraphLedger.driver_adjust>`),
    counted against the budget."""

    @property
    def hit_rate(self) -> float:
        """The share of calls that replayed a graph (0.0 before any call)."""
        return self.replays / self.calls if self.calls else 0.0

    def size(self, n: int) -> SizeStats:
        """The row of size ``n`` (KeyError if ``n`` is not on the ladder)."""
        for s in self.sizes:
            if s.size == n:
                return s
        raise KeyError(f"{self.name}: {n} is not a size of the ladder")

    def to_dict(self) -> dict[str, Any]:
        """Plain data for JSON."""
        return asdict(self)

    def table(self) -> str:
        """One screen: the sizes that were captured, failed or refused (pending sizes
        summed in one line), eager traffic, memory, warnings."""
        rows = [
            f"{self.name}: {self.calls} calls, {self.replays} replayed, {self.eager_calls} eager"
            + (" (lazy capture)" if self.lazy else "")
        ]
        rows.append(
            f"{'size':>6} {'status':<12} {'replays':>9} {'how':<9} {'capture ms':>10} "
            f"{'pool MiB':>9} {'drv MiB':>8}  note"
        )
        pending = [s.size for s in self.sizes if s.status == "pending"]
        for s in self.sizes:
            if s.status == "pending":
                continue
            note = s.note or ("first warmup before its capture" if s.prewarmed else "")
            if s.evictions:
                note = f"evicted {s.evictions}x, recaptured {s.recaptures}x; {note}".rstrip("; ")
            rows.append(
                f"{s.size:>6} {s.status:<12} {s.replays:>9} {s.how or '-':<9} "
                f"{s.capture_s * 1e3:>10.1f} {s.pool_bytes / 2**20:>9.1f} "
                f"{s.driver_bytes / 2**20:>8.1f}  {note}"
            )
        if pending:
            rows.append(f"pending (first call: its warmup; then captured): {_short(pending)}")
        if self.eager_reasons:
            rows.append(
                "eager: "
                + ", ".join(f"{n} {why}" for why, n in sorted(self.eager_reasons.items()))
                + f"; batches {_short(sorted(self.eager_batches))}"
            )
        used = f"graph memory: pool {mib(self.pool_bytes)} + driver {mib(self.driver_bytes)}"
        if self.driver_adjust_bytes:
            adj = self.driver_adjust_bytes
            used += f" {'+' if adj > 0 else '-'} {mib(abs(adj))} kept after evictions"
        if self.budget is not None:
            used += f" of a {mib(self.budget)} budget"
        if self.evictions:
            used += f"; {self.evictions} evictions, {self.hit_rate:.1%} of calls replayed"
        rows.append(used)
        rows.extend(f"warning: {w}" for w in self.warnings)
        return "\n".join(rows)

    def __str__(self) -> str:
        return self.table()


def _short(values: Sequence[int]) -> str:
    shown = ", ".join(map(str, values[:12]))
    return f"[{shown}{', ...' if len(values) > 12 else ''}] ({len(values)})"


class ServingCounters:
    """The runner's running counts that outlive its graphs: replays of entries since
    replaced, eager calls by batch and reason; and the warnings, once. What each captured
    size's capture took lives on its record (:class:`~graphguard.ladder.record.GraphRecord`)."""

    def __init__(self, label: str) -> None:
        self.label = label
        self.replays_before: Counter[int] = Counter()
        self.eager: Counter[tuple[int, str]] = Counter()
        self.eager_total = 0
        self.warned: set[str] = set()
        self.warnings: list[str] = []
        self.warmup_calls: Counter[int] = Counter()
        """Per size, lazy first calls run eagerly as its warmup."""
        self.first_call_phases: dict[int, dict[str, float]] = {}
        """Per size, its latest first call's phases (seconds)."""
        self.evictions: Counter[int] = Counter()
        """Per size, graphs released to make room under the budget."""
        self.recaptures: Counter[int] = Counter()
        """Per size, lazy captures after an eviction."""

    def first_call(self, n: int, size: int, phases: dict[str, float] | None = None) -> None:
        """A batch of ``n`` ran eagerly as the warmup of ``size`` (its first call), its
        ``phases`` in seconds (the rows copied in, the forward launched, the synchronize,
        the output narrowed)."""
        if phases is not None:
            self.first_call_phases[size] = phases
        self.warmup_calls[size] += 1
        self.eager[(n, FIRST_CALL)] += 1
        self.eager_total += 1

    def captured(self, size: int, *, recaptured: bool) -> None:
        """A lazy capture of ``size`` was kept (``recaptured``: after an eviction)."""
        if recaptured:
            self.recaptures[size] += 1

    def harvest(self, entries: Iterable[Entry | None]) -> None:
        """Entries about to be replaced: keep their replay counts."""
        for e in entries:
            if e is not None and e.replays:
                self.replays_before[e.size] += e.replays

    def replays(self, entries: Iterable[Entry | None]) -> Counter[int]:
        """Replays per size, the live entries' and the replaced ones'."""
        out = Counter(self.replays_before)
        for e in entries:
            if e is not None and e.replays:
                out[e.size] += e.replays
        return out

    def calls(self, entries: Iterable[Entry | None]) -> int:
        return sum(self.replays(entries).values()) + self.eager_total

    def eager_call(
        self, n: int, reason: str, entries: Sequence[Entry | None], captured_at: Mapping[int, int]
    ) -> None:
        """One eager call (the slow path); the warnings are looked at on powers of two."""
        self.eager[(n, reason)] += 1
        self.eager_total += 1
        if self.eager_total >= 64 and not self.eager_total & (self.eager_total - 1):
            self.check(entries, captured_at)

    def check(self, entries: Sequence[Entry | None], captured_at: Mapping[int, int]) -> list[str]:
        """Log each warning that newly applies, once; return every warning so far.
        ``captured_at``: each captured size's call count when it was captured."""
        replays = self.replays(entries)
        calls = sum(replays.values()) + self.eager_total
        above = sum(c for (_, why), c in self.eager.items() if why == ABOVE)
        if calls >= MIN_CALLS and above > EAGER_SHARE * calls:
            largest = max(n for (n, why) in self.eager if why == ABOVE)
            self._warn(
                "eager",
                f"{above} of {calls} calls ({above / calls:.0%}) ran eagerly above the "
                f"largest size, batches up to {largest}: raise max_size (or add sizes) "
                "to serve them from graphs",
            )
        for size, at in sorted(captured_at.items()):
            if not replays.get(size) and calls - at >= UNUSED_AFTER:
                self._warn(
                    f"unused {size}",
                    f"size {size} has not been replayed in {calls - at} calls since its "
                    "capture: its graph holds memory for traffic that does not come (drop "
                    "it from sizes, or use lazy=True)",
                )
        return list(self.warnings)

    def _warn(self, key: str, text: str) -> None:
        if key in self.warned:
            return
        self.warned.add(key)
        self.warnings.append(text)
        logger.warning("%s: %s (warned once)", self.label, text)


class CapturedSize(Protocol):
    """What :func:`serving_stats` reads of one captured size (a
    :class:`~graphguard.ladder.record.GraphRecord`)."""

    how: str
    capture_s: float
    pool_bytes: int
    driver_bytes: int
    phases: dict[str, float]
    warmups: int
    prewarmed: bool
    calls_at_capture: int


def serving_stats(
    name: str,
    ladder: Sequence[int],
    *,
    lazy: bool,
    serving: bool,
    captured: Mapping[int, CapturedSize],
    refused: Mapping[int, tuple[str, str]],
    counters: ServingCounters,
    ledger: GraphLedger,
    entries: Sequence[Entry | None],
    warmed: Collection[int] = (),
    evicted: Collection[int] = (),
) -> ServingStats:
    """Assemble :class:`ServingStats` of a ladder (``captured``: each captured size's record;
    ``refused``: size -> (status, why); ``warmed``, ``evicted``: lazy sizes whose next call
    captures them). A lazy size is ``pending`` only while the runner serves (calls would
    warm or capture it); before ``capture()`` and after ``release()`` it is ``not
    captured`` (calls raise)."""
    replays = counters.replays(entries)
    rows = []
    for size in ladder:
        rec = captured.get(size)
        status, note = ("pending" if lazy and serving else "not captured"), None
        if rec is not None:
            status = "captured"
        elif size in refused:
            status, note = refused[size]
        elif lazy and serving and size in evicted:
            status = "evicted"
        elif lazy and serving and size in warmed:
            status = "warmed"
        rows.append(
            SizeStats(
                size=size,
                status=status,
                replays=replays.get(size, 0),
                how=rec.how if rec is not None else None,
                capture_s=rec.capture_s if rec is not None else 0.0,
                pool_bytes=rec.pool_bytes if rec is not None else 0,
                driver_bytes=rec.driver_bytes if rec is not None else 0,
                note=note,
                phases_ms={k: round(v * 1e3, 3) for k, v in rec.phases.items()}
                if rec is not None
                else {},
                warmups=rec.warmups if rec is not None else 0,
                prewarmed=rec.prewarmed if rec is not None else False,
                warmup_calls=counters.warmup_calls[size],
                first_call_ms={
                    k: round(v * 1e3, 3)
                    for k, v in counters.first_call_phases.get(size, {}).items()
                },
                evictions=counters.evictions[size],
                recaptures=counters.recaptures[size],
            )
        )
    reasons: Counter[str] = Counter()
    batches: Counter[int] = Counter()
    for (n, why), c in counters.eager.items():
        reasons[why] += c
        batches[n] += c
    at = {size: rec.calls_at_capture for size, rec in captured.items()}
    return ServingStats(
        name=name,
        lazy=lazy,
        calls=sum(replays.values()) + counters.eager_total,
        replays=sum(replays.values()),
        eager_calls=counters.eager_total,
        eager_reasons=dict(reasons),
        eager_batches=dict(sorted(batches.items())),
        sizes=rows,
        budget=ledger.budget,
        pool_bytes=ledger.pool_bytes,
        driver_bytes=ledger.driver_bytes,
        warnings=counters.check(entries, at),
        evictions=sum(counters.evictions.values()),
        driver_adjust_bytes=ledger.driver_adjust,
    )


__all__ = [
    "ABOVE",
    "EAGER_SHARE",
    "FAILED",
    "FIRST_CALL",
    "MIN_CALLS",
    "OVER_BUDGET",
    "UNUSED_AFTER",
    "CapturedSize",
    "ServingCounters",
    "ServingStats",
    "SizeStats",
    "serving_stats",
]
