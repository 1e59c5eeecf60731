"""Lazy capture: serve at once, capture each size on first use with the whole lifecycle.

Why: capturing a 35-size ladder before the first request costs start-up time that a
scale-from-zero deployment pays on every cold start, and most ladders are mostly unused.
Where lazy capture exists elsewhere it is one eager warmup and ``torch.cuda.graph``'s own
synchronize: no arena lock, no state restore, no memory budget, no rank agreement.

With ``lazy=True`` a runner's ``capture()`` runs the before-capture stage only: the
``before_capture`` hooks (kernel warmups) and the layout probe's forwards at the ladder's
two largest sizes, each followed by a synchronize, so arenas reach their final size; a
compile (``compile=True``, PIECEWISE) happens there, once; the sizes of ``Lazy.capture_now``
are captured; the arenas lock and the process serves. Then the first call whose batch
pads to a size not captured yet captures that size (:meth:`LazyCapture.capture`):

1. under tensor parallelism, every rank agrees to try it (the runner's
   :class:`~graphguard.serving.Agreement`), so
   no rank warms up collectives that another rank skips;
2. the budget: what the capture is predicted to add (:meth:`GraphLedger.predict
   <graphguard.ledger.GraphLedger.predict>`) against ``Lazy(budget=...)``; over, the
   size is refused ("over budget", logged once with the numbers) and runs eagerly;
3. a device synchronize: work that earlier serving steps left on any stream (an
   ``AuxStream`` kernel still writing a temporary) finishes before the capture stream
   touches a buffer;
4. the lifecycle (:func:`graphguard.capture.run`, through the runner's
   :class:`~graphguard.serving.Door`) for that size alone, into the
   ladder's one pool: declared state snapshotted, warmups each followed by a
   synchronize, every known stream checked idle, the capture, state and generators
   restored; the arenas stay locked, so a warmup that would grow one is a
   ``WorkspaceLockedError`` (a failure, below), never a graph over a moved buffer;
5. the ledger checks what the capture really took; over the budget, the graph is
   dropped at once;
6. under tensor parallelism, every rank agrees it kept the graph, or every rank drops it.

Failure stays local: any ``Exception`` (a capture error, an arena that would have to
grow, an OOM, a busy stream) marks the size failed once (logged once, in ``stats()``,
never retried until ``recapture(reason=...)``, or ``release()`` then ``capture()``), the
batches that pad to it pad to the next larger size, and the call that hit it returns
the eager result. A ``BaseException`` (``KeyboardInterrupt``) propagates with that size
dropped and everything else kept. With the sanitizer on, a sanitizer finding is
raised, as at ``capture()``.

Threads: lazy captures default to ``capture_error_mode="thread_local"`` and do not arm
torch's process-wide sync debug mode, so what other threads do meanwhile (allocate, launch
kernels, synchronize their own streams) is not prohibited: measured on the H200 beside a
thread doing all three. One thing CUDA forbids while any capture runs: a *device-wide*
synchronize (``torch.cuda.synchronize()``) in another thread. CUDA fails that call and
the capture (graphguard then serves the size eagerly, results right); a thread that must
synchronize the device holds :data:`capture_lock` around it, which every lazy capture
holds. A runner still serves one thread: a second thread that calls it while it captures
is refused with a :class:`~graphguard.errors.GraphGuardError`.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time

from graphguard._collector import paused_gc
from graphguard.capture import CapturePlan
from graphguard.errors import (
    GraphCaptureError,
    GraphGuardError,
    SanitizerError,
    first_line,
)
from graphguard.ledger import mib
from graphguard.report import CaptureReport
from graphguard.serving import LAZILY, Agreement, Door
from graphguard.stats import FAILED, OVER_BUDGET

logger = logging.getLogger("graphguard")

capture_lock = threading.RLock()
"""Held by every lazy capture in the process: hold it around a device-wide synchronize
(``torch.cuda.synchronize()``) in a thread other than the serving one, which CUDA forbids
while a capture runs (``with graphguard.lazy.capture_lock: torch.cuda.synchronize()``)."""


class LazyCapture:
    """The lazy half of one ladder: the capture on first use, through its door."""

    def __init__(self, door: Door, agreement: Agreement | None = None) -> None:
        self.door = door
        self.agreement = agreement
        self._lock = threading.Lock()
        self._owner: str | None = None
        self._size: int | None = None  # the size being captured (for a refused thread)

    @property
    def capturing(self) -> str | None:
        """The thread capturing now (``"MainThread"``), or None."""
        return self._owner

    def pad_sizes(self) -> list[int]:
        """The sizes a batch may pad to: the ladder less the refused sizes."""
        refused = self.door.refusals
        return [s for s in self.door.sizes if s not in refused]

    def target(self, n: int) -> int | None:
        """The size a batch of ``n`` would capture now, or None (captured, refused, above
        the ladder, or a padded batch whose outputs cannot be narrowed)."""
        d = self.door
        size = d.pad_table.padded(n) if n > 0 else None
        if size is None or size in d.captured_sizes:
            return None
        return size if size == n or d.narrows else None

    def check_alone(self) -> None:
        """Refuse a call from a second thread while this runner captures lazily on
        another, naming both (before the call waits for anything)."""
        me = threading.current_thread().name
        owner = self._owner
        if owner is not None and owner != me:
            raise self._second_thread(me, owner)

    def _second_thread(self, me: str, owner: str | None) -> GraphGuardError:
        return GraphGuardError(
            f"{self.door.label}: thread {me!r} called the runner while thread "
            f"{owner!r} is capturing size {self._size} lazily; a runner serves one "
            "thread (build one runner per thread, or serialize the calls)"
        )

    def capture(self, size: int) -> bool:
        """Capture ``size`` now with the whole lifecycle (see the module); whether it
        serves. One capture at a time: another thread is refused, naming the first."""
        me = threading.current_thread().name
        if not self._lock.acquire(blocking=False):
            raise self._second_thread(me, self._owner)
        self._owner, self._size = me, size
        try:
            with paused_gc():
                return self._capture(size)
        finally:
            self._owner = self._size = None
            self._lock.release()

    def _agreed(self, stage: str, size: int, ok: bool) -> bool:
        return ok if self.agreement is None else self.agreement.agree_lazy(stage, size, ok)

    def _capture(self, size: int) -> bool:
        t_budget = time.perf_counter()
        ledger = self.door.ledger
        pool, driver = ledger.predict(size)
        why = None
        if ledger.over(pool + driver):
            why = (
                f"capturing size {size} is predicted to add {mib(pool)} of pool and "
                f"{mib(driver)} outside the allocator to {ledger.describe()}"
            )
        if not self._agreed("start", size, why is None):
            self._refuse(size, OVER_BUDGET, why or "over budget on a peer rank")
            return False
        t0 = time.perf_counter()
        err: BaseException | None = None
        report: CaptureReport | None = None
        waited = 0.0
        try:
            with capture_lock:
                waited = time.perf_counter() - t0  # another thread's synchronize under the lock
                report = self.door.capture_sizes([size], how=LAZILY)
            if not report.sizes:  # released (or captured) while this call waited: not ours
                return size in self.door.captured_sizes
        except GraphCaptureError as exc:  # logged by the lifecycle already
            err = exc.cause if exc.cause is not None else exc
            report = exc.report
        except Exception as exc:
            err = exc
            logger.error(
                "%s: lazy capture of size %d failed: %s", self.door.label, size, first_line(exc)
            )
        t_settle = time.perf_counter()
        try:
            return self._settle(size, err, why, t0)
        finally:
            if report is not None:  # the capture's cost by phase, completed (stats())
                report.phases["budget"] = t0 - t_budget
                report.phases["wait"] = report.phases.get("wait", 0.0) + waited
                report.tick("settle", t_settle)
                report.complete(time.perf_counter() - t_budget)

    def _settle(self, size: int, err: BaseException | None, why: str | None, t0: float) -> bool:
        """Steps 5 and 6: the budget checked on what it took, the ranks agreed."""
        d, ledger = self.door, self.door.ledger
        ok = err is None and size in d.captured_sizes
        if ok and ledger.over():
            why = f"size {size}'s capture took the graphs to {ledger.describe()}; dropped"
            d.drop_size(size)
            ok = False
        agreed = self._agreed("done", size, ok)
        if ok and not agreed:
            d.drop_size(size)
        if agreed:
            if logger.isEnabledFor(logging.INFO):  # describe() formats even when not logged
                logger.info(
                    "%s: captured size %d lazily in %.1f ms (%s)",
                    d.label,
                    size,
                    (time.perf_counter() - t0) * 1e3,
                    ledger.describe(),
                )
            return True
        if why is not None:
            self._refuse(size, OVER_BUDGET, why)
        elif err is not None:
            self._refuse(size, FAILED, first_line(err), logged=True)
        else:
            self._refuse(size, FAILED, "a peer rank's lazy capture of this size failed")
        if isinstance(err, SanitizerError):
            raise err
        return False

    def keep_within_budget(self, report: CaptureReport) -> None:
        """``capture_now`` sizes count against the budget as lazy ones do: nothing predicts
        a first graph, so each is checked on what it took, in capture order (largest
        first), and a size that took the graphs over the budget is dropped and refused
        (``over budget``, logged with the numbers that decided). ``capture()`` itself
        succeeds; the batches of a dropped size pad upwards or run eagerly."""
        d, budget = self.door, self.door.ledger.budget
        if budget is None or not d.ledger.over():
            return
        used = 0
        for s in report.sizes:
            if not s.ok or s.size not in d.captured_sizes:
                continue
            used += s.pool_growth_bytes + s.driver_bytes
            if used > budget:
                d.drop_size(s.size)
                self._refuse(
                    s.size,
                    OVER_BUDGET,
                    f"capture_now size {s.size}'s capture took the graphs to {mib(used)} (pool "
                    f"plus the driver's share) of a {mib(budget)} budget; dropped",
                )

    def _refuse(self, size: int, status: str, why: str, *, logged: bool = False) -> None:
        self.door.refuse(size, status, why)
        if not logged:
            logger.warning(
                "%s: size %d is %s and runs eagerly (%s); logged once, until recapture()",
                self.door.label,
                size,
                status,
                why,
            )


def lazy_plan(plan: CapturePlan, size: int, warmed: set[int]) -> CapturePlan:
    """The plan of one lazy capture of ``size``: that size alone, no hooks (the stage ran
    them for the whole ladder), its error raised to :meth:`LazyCapture.capture`, no bar,
    and no process-wide sync debug mode (other threads serve meanwhile; a host sync in
    the step still fails the capture). A size in ``warmed`` (the stage's forwards with
    ``Lazy(warm_shapes=True)``) counts that forward as its first warmup iteration
    (:attr:`CapturePlan.prewarmed <graphguard.capture.CapturePlan.prewarmed>`): once, so
    it leaves ``warmed``; the next stage warms it again."""
    prewarmed = frozenset({size} & warmed)
    warmed.discard(size)
    return dataclasses.replace(
        plan,
        sizes=[size],
        before_capture=(),
        after_capture=(),
        on_capture_error="raise",
        progress=False,
        prewarmed=prewarmed,
        sync_guard=False,
    )


__all__ = ["FAILED", "OVER_BUDGET", "LazyCapture", "capture_lock", "lazy_plan"]
