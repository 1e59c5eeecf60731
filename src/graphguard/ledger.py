"""The graph-memory ledger: what a runner's graphs hold on the device, counted whole.

Why a ledger: a graph holds two kinds of memory. Its pool blocks are the caching
allocator's (``report.pool_bytes``, the reserved growth of each capture); its instantiated
executable is the driver's, outside the allocator, and shows only as free device memory
that went missing (measured on the H200: 40 MiB for the 35-size Llama-1B ladder, 31% on
top of its 128 MiB pool). A budget that counts the pool alone is exceeded by a third
without anyone noticing. The lifecycle measures both around every capture
(:attr:`graphguard.report.SizeReport.driver_bytes`); the ledger keeps them per size,
gives the driver's share back when a graph is dropped, and predicts what the next lazy
capture would add, so a capture that would break the budget does not happen.

The prediction, and why it is only that: the driver's share is about one graph's nodes,
the same kernels at every batch size, so the next graph is predicted at the largest
share seen. The pool is shared, largest graph first: a size at or below the largest
captured into it (:attr:`GraphLedger.covered`, kept when that graph is dropped: its
blocks stay) reuses its blocks (predicted 0), a larger one is predicted from a pool's
fixed part plus bytes per row, once two pools' sizes tell them apart
(:meth:`GraphLedger._pool_at`). With nothing to predict from (nothing captured yet, or one
size only) the prediction errs low, so a capture is also checked after it ran: one that
went over is dropped at once (its driver share returns; its pool blocks stay for the next
captures, and stay counted).

Eviction (``Lazy(evict="lru")``) reads the same numbers: releasing a graph gives back
its driver share only, while the pool lives; when the last graph goes, the pool goes with
it, and what a capture into a fresh pool would take is predicted from the bytes per row
and driver share learned before (:meth:`GraphLedger.predict_alone`). The driver does not
always hand a destroyed graph's share back at once (measured on the H200: 34 of 44 MiB
for a 35-size ladder), and free memory moves in 2 MiB pages (a graph measured at 0 may
free a page another one was charged for), and a released pool may keep a segment mapped,
so each eviction or drop measures what came back (when the pool goes with it, after emptying the
cache before and after, so that what comes back is the pool's alone) and the difference
from what it was charged, its driver share and then the pool, is carried
(:attr:`GraphLedger.driver_adjust`): the ledger follows free device memory across any
number of evictions.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Protocol

_MIB = float(1 << 20)


def mib(n: int) -> str:
    """``12.3 MiB``: how every budget message writes bytes."""
    return f"{n / _MIB:.1f} MiB"


class Held(Protocol):
    """What the ledger reads of one captured size (a
    :class:`~graphguard.ladder.record.GraphRecord`)."""

    pool_bytes: int
    driver_bytes: int


class GraphLedger:
    """The graphs' device memory: per captured size the pool growth and the driver's share
    its capture took (read from the runner's one record per size, never kept twice), plus
    the pool blocks of graphs dropped since, which the pool keeps for later captures."""

    def __init__(self, budget: int | None, held: Mapping[int, Held]) -> None:
        self.budget = budget
        """Bytes the graphs may hold, pool plus driver (None: no budget)."""
        self._held = held
        self.dropped_pool = 0
        """Pool growth of graphs dropped or replaced since: the pool keeps those blocks."""
        self.covered = 0
        """The largest size captured into the live pool: its blocks serve every size up
        to it, whether or not its graph is still held (0: no pool)."""
        self.driver_adjust = 0
        """What evictions and drops gave back short of what they were charged, their
        driver shares and, when the last graph took the pool along, the pool (the
        driver's own cache, a segment left mapped), less what came back beyond it (pages
        charged to another graph); may be negative. Named for the driver, where it was
        first seen; kept for compatibility (``stats().driver_adjust_bytes``)."""
        # Learned, for a capture into a fresh pool: the pool's bytes per row at the largest
        # size captured (the most rows to spread its fixed part, the cuBLAS workspace,
        # over), the smallest first capture into a fresh pool (with the first: the fixed
        # part and the bytes per row apart), and the largest driver share.
        self._rows, self._per_row, self._driver = 0, 0.0, 0
        self._fresh: tuple[int, int] | None = None

    def captured(self, size: int) -> None:
        """A graph of ``size`` was captured into the live pool and recorded."""
        if not self.covered and (self._fresh is None or size < self._fresh[0]):
            self._fresh = (size, self.pool_bytes)  # the first into a fresh pool
        self.covered = max(self.covered, size)
        if self.covered >= self._rows:
            self._rows, self._per_row = self.covered, self.pool_bytes / self.covered
        self._driver = max(self._driver, self.driver.get(size, 0))

    def dropped(self, pool_bytes: int) -> None:
        """A graph was dropped or replaced: its driver share is back (it left the records),
        its pool blocks are not."""
        self.dropped_pool += pool_bytes

    def released(self, charged: int, returned: int) -> None:
        """A graph was evicted or dropped and destroyed (with the pool, when it was the
        last), for which the ledger counted ``charged`` bytes, and free device memory grew
        by ``returned``: the difference is carried in :attr:`driver_adjust`."""
        self.driver_adjust += charged - returned

    def clear(self) -> None:
        """Every graph released and the cache emptied: nothing is held (what was learned
        for predictions is kept: the same step fills the next pool)."""
        self.dropped_pool = 0
        self.covered = 0

    def forget(self) -> None:
        """:meth:`clear`, and forget what was learned (``release()``: a new stage)."""
        self.clear()
        self._rows, self._per_row, self._driver = 0, 0.0, 0
        self._fresh = None
        self.driver_adjust = 0

    @property
    def pool(self) -> dict[int, int]:
        """Size -> pool growth of its capture."""
        return {size: h.pool_bytes for size, h in self._held.items()}

    @property
    def driver(self) -> dict[int, int]:
        """Size -> the driver's share of its live graph(s)."""
        return {size: h.driver_bytes for size, h in self._held.items()}

    @property
    def pool_bytes(self) -> int:
        """The pool's reserved bytes, dropped graphs' blocks included."""
        return sum(h.pool_bytes for h in self._held.values()) + self.dropped_pool

    @property
    def driver_bytes(self) -> int:
        return sum(h.driver_bytes for h in self._held.values())

    @property
    def used(self) -> int:
        """Everything the graphs hold now: the pool plus the driver's share (of the live
        graphs, and what it kept of evicted ones: :attr:`driver_adjust`)."""
        return max(0, self.pool_bytes + self.driver_bytes + self.driver_adjust)

    def predict(self, size: int) -> tuple[int, int]:
        """``(pool growth, driver share)`` a capture of ``size`` is expected to add."""
        driver = max((h.driver_bytes for h in self._held.values()), default=self._driver)
        covered = max(self.covered, max(self._held, default=0))
        if covered and size <= covered:
            return 0, driver
        return max(0, round(self._pool_at(size)) - self.pool_bytes), driver

    def predict_alone(self, size: int) -> int:
        """What ``size`` would take captured into a fresh pool, every other graph gone:
        pool plus driver (see :meth:`_pool_at`; 0 when nothing was learned)."""
        driver = max((h.driver_bytes for h in self._held.values()), default=self._driver)
        return round(self._pool_at(size)) + driver

    def _pool_at(self, size: int) -> float:
        """A pool holding a graph of ``size``. A pool is a fixed part (on CUDA the cuBLAS
        workspace the pool holds, 32 MiB on Hopper) plus bytes per row: once two pools'
        sizes tell them apart (the smallest first capture into a fresh pool and the
        largest size captured), that line. Before, what is sure: a pool for more rows is
        no smaller than one known for fewer (below every size known, the smallest one's
        bytes per row), and the capture is checked after it ran: one size per ladder is
        captured on that, never refused on a guess that spreads the fixed part over a
        few rows and calls every larger size hopeless."""
        if self._fresh is not None and self._rows > self._fresh[0]:
            small, small_bytes = self._fresh
            per_row = (self._per_row * self._rows - small_bytes) / (self._rows - small)
            if per_row > 0:
                return small_bytes + per_row * (size - small)
        known = [(self._rows, self._per_row * self._rows)] if self._rows else []
        if self._fresh is not None:
            known.append(self._fresh)
        if self.covered:
            known.append((self.covered, self.pool_bytes))
        below = [b for rows, b in known if rows <= size]
        if below:
            return float(max(below))
        if known:
            rows, b = min(known)
            return b * size / rows
        return 0.0

    def over(self, extra: int = 0) -> bool:
        """Whether ``used + extra`` is above the budget."""
        return self.budget is not None and self.used + extra > self.budget

    def describe(self, *, budget: bool = True) -> str:
        """``pool 12.0 MiB + driver 3.1 MiB = 15.1 MiB of a 64.0 MiB budget`` (``budget``
        False: without the budget, for a message that states its own total against it)."""
        adj = self.driver_adjust
        kept = f" {'+' if adj > 0 else '-'} {mib(abs(adj))} kept after evictions" if adj else ""
        line = (
            f"pool {mib(self.pool_bytes)} + driver {mib(self.driver_bytes)}{kept} = "
            f"{mib(self.used)}"
        )
        shown = budget and self.budget is not None
        return line + (f" of a {mib(self.budget or 0)} budget" if shown else "")


__all__ = ["GraphLedger", "Held", "mib"]
