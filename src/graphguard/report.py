"""The capture report: what each size cost, as data (JSON) and as a readable table.

An engine sizes its KV cache from free memory, so the graph pool is the number that
matters most after correctness; capture time decides cold-start latency.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any

_GIB = float(1 << 30)
_MIB = float(1 << 20)


@dataclass
class SizeReport:
    """One captured (or failed) size."""

    size: int
    warmup_s: float = 0.0
    capture_s: float = 0.0
    pool_growth_bytes: int = 0
    driver_bytes: int = 0
    """Device memory the capture took outside the caching allocator (the instantiated
    graph): free memory before less after, less the pool growth. 0 when not measured."""
    ok: bool = True
    error: str | None = None
    warmups: int = 0
    """Uncaptured warmup forwards run right before this capture (``warmup_iters``, less
    one when :attr:`prewarmed`)."""
    prewarmed: bool = False
    """This size's first warmup iteration had run already, so it was not run again here:
    a lazy capture's was the before-capture stage's forward (``Lazy(warm_shapes=True)``),
    an up-front capture's the output-layout probe's (the two largest sizes, unless the
    first warmup is watched for undeclared writes): ``warmup_s``
    is then the remaining iterations' only (0 with ``warmup_iters=1``), and a device
    synchronize still precedes the capture (:mod:`graphguard.lazy`)."""


@dataclass
class CaptureReport:
    """Everything one ``GraphRunner.capture()`` did, in capture order (largest first)."""

    mode: str
    backend: str
    sizes: list[SizeReport] = field(default_factory=list)
    hooks_s: float = 0.0
    total_s: float = 0.0
    pool_bytes: int = 0
    driver_bytes: int = 0
    """The sizes' :attr:`SizeReport.driver_bytes` summed: graph memory ``pool_bytes`` misses."""
    profiling: bool = False
    arenas: list[dict[str, Any]] = field(default_factory=list)
    compiles: int = 0
    """``torch.compile`` graphs behind the capture (0: the step was not compiled)."""
    recompiles: list[str] = field(default_factory=list)
    """The failed guards that made dynamo compile more than once (see the warning)."""
    compile_s: float = 0.0
    """Seconds spent compiling (inside the first forward: the output-layout probe's)."""
    autocast: str = "off"
    """The autocast policy the graphs keep (``"cuda bfloat16"``; :mod:`graphguard.autocast`)."""
    generators: list[str] = field(default_factory=list)
    """The generators registered with every graph (``default``, ``generators[0]``, ``gen``)."""
    state_writes: list[str] | None = None
    """The tensors outside the inputs the first warmup wrote, by name, with no ``state=``
    declared (``None``: not watched: state declared, ``warmup_iters=0``, a compiled step)."""
    phases: dict[str, float] = field(default_factory=dict)
    """Seconds by phase of this run, summed over its sizes, contiguous from the run's start
    to its end (each phase ends where the next begins, so nothing between two named phases
    goes unattributed): ``snapshot`` (state and generators saved), ``lifecycle`` (the
    capture window, the garbage-collector pause, the progress bar, the loop between
    sizes), ``hooks``, ``warmup`` (uncaptured forwards, each with its synchronize; 0.0
    when a lazy capture's warmup was the stage's, :attr:`SizeReport.prewarmed`),
    ``sync_before_capture`` (the synchronize that then stands for the skipped warmup's),
    ``idle_check``, ``memory_probe`` (free and reserved memory read around each capture,
    for the ledger), ``capture`` (``capture_begin``, the recorded forward, ``capture_end``
    and instantiation), ``provenance_read`` (reading the graph's kernel arguments, with
    ``provenance=True``; apart from ``capture``), ``register`` (keeping the graph; with
    provenance, classifying what it reads), ``end`` (cuBLAS workspaces handed back),
    ``restore``, ``lock``, ``report`` (the report's arena list and summary),
    ``after_hooks``. A capture while serving adds the runner's ``wait`` (for another
    thread's serving-time call, and a lazy capture's :data:`~graphguard.lazy.capture_lock`),
    ``plan``, ``sync``, ``reset`` and ``bookkeeping`` (entries, ledger, weight record);
    a lazy one also ``budget``, ``settle``, ``total`` (what the call that met the size
    waited) and ``other``: ``total`` less every named phase (what no phase covers: entering
    and leaving the context managers between them; a collection would show here, but the
    collector is paused for the whole lazy capture). :attr:`graphguard.stats.SizeStats.phases_ms`
    shows them in milliseconds."""
    abandoned_graphs: int = 0
    """Graphs of failed CUDA captures this process keeps alive on purpose (freeing one
    can break its pool; see ``graphguard._unwind``), counted over the whole process at
    the end of this capture: one graph and one pool reference each, never reclaimed, so
    a count that keeps growing means captures keep failing. (Data only: a process-wide
    number would repeat in every later summary line.)"""
    recaptured_graphs: list[tuple[int, int | None]] = field(default_factory=list)
    """A partial recapture (``recapture(only_moved=True)``, ``update_weights(...,
    on_moved="recapture")``): the graphs it captured anew, ``(size, piece)`` (piece None:
    a FULL graph). Empty for any other capture."""
    graphs_total: int = 0
    """A partial recapture: the graphs the runner held when it began (FULL: one per
    size; PIECEWISE: one per piece and size), so ``len(recaptured_graphs)`` of this many
    were redone. 0 for any other capture."""

    def __post_init__(self) -> None:
        self._cursor = time.perf_counter()  # where the last tick ended (not a field)

    def tick(self, phase: str, since: float | None = None) -> float:
        """Add the seconds from ``since`` (default: where the previous tick ended) to now
        to ``phase``; return now."""
        now = time.perf_counter()
        start = self._cursor if since is None else since
        self.phases[phase] = self.phases.get(phase, 0.0) + (now - start)
        self._cursor = now
        return now

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Time the block as phase ``name`` (also when it raises). The seconds since the
        previous phase ended go to ``lifecycle`` (the loop's own work between phases), so
        the phases stay contiguous: every second of a run is in exactly one."""
        self.tick("lifecycle")
        try:
            yield
        finally:
            self.tick(name)

    def move(self, seconds: float, source: str, dest: str) -> None:
        """Reattribute ``seconds`` of ``source`` to ``dest`` (work one tick measured
        together that the phases tell apart, e.g. provenance reading inside a capture)."""
        if seconds > 0:
            self.phases[source] = self.phases.get(source, 0.0) - seconds
            self.phases[dest] = self.phases.get(dest, 0.0) + seconds

    def complete(self, total: float) -> None:
        """Close a lazy capture's accounting: ``total`` seconds, and ``other`` = ``total``
        less every named phase (the named phases never overlap, so it is not negative)."""
        named = sum(v for k, v in self.phases.items() if k not in ("total", "other"))
        self.phases["total"] = total
        self.phases["other"] = total - named

    def set_compiles(
        self, compiles: int, recompiles: Sequence[str], compile_s: float = 0.0
    ) -> None:
        """Record what compiling cost (cumulative over the compiler's life, so a recapture
        that recompiled shows it); the one place every compiling runner fills these."""
        self.compiles = compiles
        self.recompiles = list(recompiles)
        self.compile_s = compile_s

    @property
    def captured(self) -> list[int]:
        """Sizes that have a graph, ascending."""
        return sorted(s.size for s in self.sizes if s.ok)

    @property
    def failed(self) -> list[int]:
        """Sizes whose capture failed, ascending."""
        return sorted(s.size for s in self.sizes if not s.ok)

    def summary(self) -> str:
        """One line: ``captured N graphs in X s, graph pool Y GiB``."""
        line = (
            f"captured {len(self.captured)} graphs in {self.total_s:.2f} s, "
            f"graph pool {self.pool_bytes / _GIB:.3f} GiB"
        )
        if self.driver_bytes:
            line += f" + {self.driver_bytes / _MIB:.1f} MiB outside the allocator"
        if self.failed:
            line += f"; {len(self.failed)} failed (sizes {self.failed}), they run eagerly"
        if self.compile_s:
            line += f" (compiling {self.compile_s:.1f} s)"
        if self.compiles > 1:
            line += f"; {self.compiles} compiles ({self.compiles - 1} extra: see the warning)"
        if self.profiling:
            line += " [profiling capture: arenas left unlocked]"
        if self.graphs_total:
            line += f"; recaptured {len(self.recaptured_graphs)} of {self.graphs_total} graphs"
        return line

    def to_dict(self) -> dict[str, Any]:
        """Plain data for JSON."""
        d = asdict(self)
        d["captured"] = self.captured
        d["failed"] = self.failed
        d["summary"] = self.summary()
        return d

    def table(self) -> str:
        """A fixed-width table, one row per size, then the summary line."""
        rows = [
            f"{'size':>6} {'warmup ms':>10} {'capture ms':>11} {'pool +MiB':>10} "
            f"{'driver MiB':>10}  status"
        ]
        for s in self.sizes:
            status = "ok" if s.ok else f"FAILED: {s.error}"
            rows.append(
                f"{s.size:>6} {s.warmup_s * 1e3:>10.2f} {s.capture_s * 1e3:>11.2f} "
                f"{s.pool_growth_bytes / _MIB:>10.2f} {s.driver_bytes / _MIB:>10.2f}  {status}"
            )
        for a in self.arenas:
            rows.append(
                f"arena {a.get('name')!r}: {int(a.get('nbytes', 0)) / _MIB:.2f} MiB"
                f"{' (locked)' if a.get('locked') else ''}"
            )
        rows.append(self.summary())
        return "\n".join(rows)

    def __str__(self) -> str:
        return self.table()


def merged(reports: Sequence[CaptureReport], mode: str) -> CaptureReport:
    """One report of several capture runs of one runner (their sizes, in run order;
    memory and seconds summed; the other fields of the last run)."""
    if not reports:
        return CaptureReport(mode=mode, backend="none")
    if len(reports) == 1:
        return reports[0]
    out = replace(reports[-1], sizes=[s for r in reports for s in r.sizes])
    out.phases = {}
    for r in reports:
        for k, v in r.phases.items():
            out.phases[k] = out.phases.get(k, 0.0) + v
    for name in ("hooks_s", "total_s", "pool_bytes", "driver_bytes"):
        setattr(out, name, sum(getattr(r, name) for r in reports))
    return out


@dataclass
class SizeCheck:
    """One size of :func:`verify`: how far the replay is from eager."""

    size: int
    dtype: str
    max_abs: float
    max_rel: float
    rtol: float
    atol: float
    ok: bool
    worst_leaf: int = 0
    note: str = ""
    batch: int = 0
    """The batch size ``make_inputs(size)`` gave (it pads to ``graph``)."""
    graph: int = 0
    """The captured size whose graph replayed."""


@dataclass
class VerifyReport:
    """Every size :func:`verify` checked, as data (:meth:`to_dict`) and a :meth:`table`."""

    runner: str
    sizes: list[SizeCheck] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return all(s.ok for s in self.sizes)

    @property
    def failed(self) -> list[int]:
        return [s.size for s in self.sizes if not s.ok]

    def table(self) -> str:
        head = f"verify {self.runner}: {len(self.sizes)} size(s), " + (
            "all match eager" if self.ok else f"{len(self.failed)} diverge {self.failed}"
        )
        rows = [
            f"{'size':>6} {'batch':>6} {'graph':>6}  {'dtype':<9} {'max_abs':>10} "
            f"{'max_rel':>10} {'rtol':>8} {'atol':>8}  ok"
        ]
        for s in self.sizes:
            rows.append(
                f"{s.size:>6} {s.batch:>6} {s.graph:>6}  {s.dtype:<9} {s.max_abs:>10.3e} "
                f"{s.max_rel:>10.3e} "
                f"{s.rtol:>8.1e} {s.atol:>8.1e}  {'yes' if s.ok else 'NO'}"
                + (f"  ({s.note})" if s.note else "")
            )
        return "\n".join([head, *rows])

    def to_dict(self) -> dict[str, Any]:
        return {
            "runner": self.runner,
            "ok": self.ok,
            "failed": self.failed,
            "sizes": [asdict(s) for s in self.sizes],
        }

    def __str__(self) -> str:
        return self.table()


__all__ = ["CaptureReport", "SizeCheck", "SizeReport", "VerifyReport", "merged"]
