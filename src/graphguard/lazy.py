"""Lazy capture: serve at once; the first call at a size is its warmup, the next captures it.

With ``lazy=True`` a runner's ``capture()`` runs the before-capture stage only: the
``before_capture`` hooks (kernel warmups) and the layout probe's forwards at the ladder's
two largest sizes, each followed by a synchronize, so arenas reach their final size (with
``output_batch_dims`` declared, none: or the largest size's alone, when there are
``workspaces`` to size or a compile to run; then the first request is the first forward); a
compile (``compile=True``, PIECEWISE) happens there, once; the sizes of ``Lazy.capture_now``
are captured; the arenas lock and the process serves. Then a call whose batch pads to a
size not captured yet:

* **the size's first call** (:meth:`LazyCapture.first_call`) is that size's warmup, run
  uncaptured on the caller's own inputs under the lifecycle's warmup rules
  (:mod:`graphguard.first_call` says which); its result is the request's, as a replay's
  would be. Under tensor parallelism every rank runs it in the same call and agrees it
  succeeded;
* **the next call** captures the size (:meth:`LazyCapture.capture`) with no eager forward
  (the first call was its first warmup iteration,
  :attr:`CapturePlan.prewarmed <graphguard.capture.CapturePlan.prewarmed>`), then replays.

A size the stage warmed (``Lazy(warm_shapes=True)``), a size evicted and met again, and
any size of a runner with ``warmup_iters=0`` skip the eager first call and are captured on
the call that meets them. The capture itself:

1. under tensor parallelism, every rank agrees to try it (the runner's
   :class:`~graphguard.serving.Agreement`), so
   no rank warms up collectives that another rank skips;
2. the budget: what the capture is predicted to add (:meth:`GraphLedger.predict
   <graphguard.ledger.GraphLedger.predict>`) against ``Lazy(budget=...)``; with
   ``evict="lru"`` the least recently replayed graphs are released first until it fits
   (:meth:`Budget.make_room <graphguard.budget.Budget.make_room>`); over, the size is
   refused ("over budget", logged once with the total it would reach against the
   budget) and runs eagerly;
3. a device synchronize: work that earlier serving steps left on any stream (an
   ``AuxStream`` kernel still writing a temporary) finishes before the capture stream
   touches a buffer;
4. the lifecycle (:func:`graphguard.capture.run`, through the runner's
   :class:`~graphguard.serving.Door`) for that size alone, into the
   ladder's one pool: declared state snapshotted when anything runs eagerly, the warmups
   left each followed by a synchronize, every known stream checked idle, the capture,
   state and generators restored; the arenas stay locked, so a warmup that would grow one
   is a ``WorkspaceLockedError`` (a failure, below), never a graph over a moved buffer;
5. the ledger checks what the capture really took; over the budget, other graphs are
   evicted (``evict="lru"``) or the new graph is dropped at once;
6. under tensor parallelism, every rank agrees it kept the graph, or every rank drops it.

Failure stays local: any ``Exception`` in a capture (a capture error, an arena that would
have to grow, an OOM, a busy stream) marks the size failed once (logged once, in
``stats()``, never retried until ``recapture(reason=...)``, or ``release()`` then
``capture()``), the batches that pad to it pad to the next larger size, and the call that
hit it returns the eager result. A ``BaseException`` (``KeyboardInterrupt``) propagates
with that size dropped and everything else kept. A first call that raises is the
request's own forward failing, as it would eagerly: the error propagates and leaves
nothing behind (the size is neither warmed nor refused: its next call is its first call
again); one whose step reseeded a generator returns its result and refuses the size. A
stage forward that raises fails ``capture()`` itself (:func:`stage_failed`).
With the sanitizer on, a sanitizer finding is raised, as at ``capture()``.

Threads: lazy captures default to ``capture_error_mode="thread_local"`` and do not arm
torch's process-wide sync debug mode, so what other threads do meanwhile (allocate, launch
kernels, synchronize their own streams) is not prohibited. One thing CUDA forbids while
any capture runs: a *device-wide*
synchronize (``torch.cuda.synchronize()``) in another thread. CUDA fails that call and
the capture (graphguard then serves the size eagerly, results right); a thread that must
synchronize the device holds :data:`capture_lock` around it, which every lazy capture,
first call's synchronize and eviction holds. A runner still serves one thread: a second
thread that calls it while it captures or runs a first call is refused with a
:class:`~graphguard.errors.GraphGuardError`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from graphguard._collector import paused_gc
from graphguard.budget import Budget, capture_lock
from graphguard.capture import CapturePlan
from graphguard.entries import copy_into
from graphguard.errors import (
    GraphCaptureError,
    GraphGuardError,
    SanitizerError,
    first_line,
)
from graphguard.first_call import Draws, warm_forward
from graphguard.lazy_stage import lazy_plan, stage_failed
from graphguard.ledger import mib
from graphguard.report import CaptureReport
from graphguard.serving import LAZILY, Agreement, CaptureGuard, Door
from graphguard.stats import FAILED, OVER_BUDGET, ServingCounters

logger = logging.getLogger("graphguard")


@dataclass(frozen=True)
class LazyCalls:
    """What a lazy ladder lends its :class:`LazyCapture` for the calls that meet a size
    with no graph: its capture guard (held from a capture through its replay), its
    public call and zero-copy replay (which find the new graph), and its eager miss
    policy for the batches no graph will serve."""

    guard: CaptureGuard
    call: Callable[..., Any]
    """``runner(*inputs)``."""
    replay: Callable[[int], Any]
    """``runner.replay(n)``."""
    eager: Callable[[int, Sequence[Any]], Any]
    """A batch no lazy graph serves: the runner's eager miss policy's call
    (:meth:`EagerMiss.call <graphguard.ladder.miss.EagerMiss.call>`)."""


class LazyCapture:
    """The lazy half of one ladder: first calls, captures and evictions, through its door;
    the runner's miss policy (:class:`~graphguard.ladder.miss.Miss`) when ``lazy=``.

    ``first_calls``: a size's first call runs eagerly as its warmup (every runner with
    ``warmup_iters >= 1``); ``evict``: ``Lazy(evict="lru")``; ``judge``: the canary's
    verdict (``CanaryWatch.judge(report, declared)``) on the undeclared writes a first call
    was watched for, ``declared`` the ``state=`` option; ``counters``: the runner's;
    ``warmed``: shared with the runner's capture half; ``capture_now``: the sizes
    ``capture()`` captures (``Lazy.capture_now``)."""

    def __init__(
        self,
        door: Door,
        agreement: Agreement | None,
        calls: LazyCalls,
        *,
        first_calls: bool = True,
        evict: bool = False,
        judge: Callable[[CaptureReport, Any], None] | None = None,
        declared: Any = None,
        counters: ServingCounters | None = None,
        warmed: dict[int, bool] | None = None,
        capture_now: Sequence[int] = (),
    ) -> None:
        self.door = door
        self.counters = counters if counters is not None else ServingCounters(door.label)
        self.capture_now = sorted(capture_now, reverse=True)
        self.agreement = agreement
        self.calls = calls
        self.first_calls = first_calls
        self.evict = evict
        self.judge = judge
        self.declared = declared
        self.warmed: dict[int, bool] = warmed if warmed is not None else {}
        """Sizes whose first warmup iteration ran and whose capture has not counted it yet:
        size -> whether it was watched for undeclared writes (a first call, or a size
        captured before an eviction: True) or not (the stage's, ``warm_shapes``: False)."""
        self._lock = threading.Lock()
        self._owner: str | None = None
        self._size: int | None = None  # the size being captured (for a refused thread)
        self._doing = "capturing"  # or running the first call of it
        self._report: CaptureReport | None = None  # the last lazy capture's, for the canary
        self._status: dict[int, str] = {}  # the status of a size this refused, until read
        self.budget = Budget(door, self._agreed, self.warmed, self._refuse)
        """What keeps the graphs within ``Lazy(budget=...)``: evictions and drops."""

    def capture_up_front(
        self, plan: CapturePlan, run: Callable[..., CaptureReport]
    ) -> CaptureReport:
        """The before-capture stage over the whole ladder and the ``capture_now`` sizes
        (see the module), kept within the budget (:meth:`Budget.keep_within_budget
        <graphguard.budget.Budget.keep_within_budget>`)."""
        staged = dataclasses.replace(plan, sizes=self.capture_now)
        report = run(staged, hook_sizes=plan.sizes, stage=True)
        self.budget.keep_within_budget(report)
        return report

    def forget(self) -> None:
        """A new stage: nothing is warmed (``release()``, a recapture)."""
        self.warmed.clear()
        self._status.clear()

    def pending(self, n: int) -> int | None:
        """The size a batch of ``n`` pads to when its next call is that size's first call
        (run eagerly as its warmup), else None."""
        size = self.target(n) if self.first_calls else None
        return size if size is not None and size not in self.warmed else None

    # ------------------------------------------------------------------ the calls

    def call(self, n: int, inputs: Sequence[Any]) -> Any:
        """``runner(*inputs)`` of a batch of ``n`` whose size has no graph: its first call
        (the size's warmup, eagerly), or its capture and replay, the guard held from the
        capture through the replay: another thread's update or release waits for the
        whole call (the capture alone would let it land between the two). A batch no
        graph serves (above the ladder, refused, failed) runs eagerly."""
        calls = self.calls
        self.check_alone()  # a second thread is refused, not made to wait
        with calls.guard.holding():
            size = self.pending(n)
            if size is not None:
                return self._judged(self.first_call(size, n, inputs))
            if self.capture_met(n):
                return calls.call(*inputs)  # its entry exists now
        return calls.eager(n, inputs)

    def replay(self, n: int) -> tuple[bool, Any]:
        """``replay(n)`` of a size with no graph, its rows already in the static buffers
        (``static_inputs(n)`` of a size waiting for its first call): that first call, or
        the capture (the rows kept across it: a capture resets the buffers) and replay;
        refused or failed, the plain step on the rows. ``(False, None)``: no lazy size."""
        calls, d = self.calls, self.door
        size = self.target(n)
        if size is None:
            return False, None
        self.check_alone()
        with calls.guard.holding():
            if self.pending(n) is not None:
                return True, self._judged(self.first_call(size, n, None))
            rows = [v.clone() for v in d.static.views(n)]
            try:
                captured = self.capture_met(n)
            finally:
                with torch.no_grad():
                    copy_into(d.static.views(n), rows)
            if captured:
                return True, calls.replay(n)
            status = self._status.pop(size, FAILED)
            self.counters.eager_call(n, f"size {status}", d.entries, {})
            return True, d.eager(*d.static.views(n))

    def prepare(self, n: int) -> int | None:
        """Before the caller writes ``static_inputs(n)``: the size it pads to captured now
        (unless it waits for its first call); the size when the next ``replay(n)`` is that
        first call, else None."""
        self.capture_met(n)
        return self.pending(n)

    def capture_met(self, n: int) -> bool:
        """Capture the size a batch of ``n`` pads to if not captured and not waiting for
        its first call; whether it serves. The canary judges the capture (refusing:
        raised)."""
        size = self.target(n)
        if size is None or self.pending(n) is not None or not self.capture(size):
            return False
        if self.judge is not None and self._report is not None:
            self.judge(self._report, self.declared)
        return True

    def _judged(self, ran: tuple[Any, list[str] | None]) -> Any:
        """A first call's result for the caller, its watched writes judged first (the
        canary refuses undeclared writes as ``capture()`` does: raised)."""
        out, seen = ran
        if self.judge is not None and seen is not None:
            report = CaptureReport(mode="lazy first call", backend=self.door.label)
            report.state_writes = seen
            self.judge(report, self.declared)
        return out

    @property
    def capturing(self) -> str | None:
        """The thread capturing now (``"MainThread"``), or None."""
        return self._owner

    def target(self, n: int) -> int | None:
        """The size a batch of ``n`` would capture now, or None (not serving, captured,
        refused, above the ladder, or a padded batch whose outputs cannot be narrowed)."""
        return self.door.missing_size(n)

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
            f"{owner!r} is {self._doing} size {self._size} lazily; a runner serves one "
            "thread (build one runner per thread, or serialize the calls)"
        )

    def capture(self, size: int) -> bool:
        """Capture ``size`` now with the whole lifecycle (see the module); whether it
        serves. One capture at a time: another thread is refused, naming the first."""
        with self._alone(size, "capturing"), paused_gc():
            return self._capture(size)

    @contextlib.contextmanager
    def _alone(self, size: int, doing: str) -> Iterator[None]:
        """This thread alone ``doing`` ``size`` (capturing, running its first call):
        another thread meanwhile is refused, naming this one."""
        me = threading.current_thread().name
        if not self._lock.acquire(blocking=False):
            raise self._second_thread(me, self._owner)
        self._owner, self._size, self._doing = me, size, doing
        try:
            yield
        finally:
            self._owner = self._size = None
            self._lock.release()

    # ------------------------------------------------------------------ a first call

    def first_call(
        self, size: int, n: int, inputs: Sequence[torch.Tensor] | None
    ) -> tuple[Any, list[str] | None]:
        """Run a batch of ``n`` eagerly at ``size`` as that size's warmup (see the module):
        ``(its outputs narrowed to n, the undeclared writes it was watched for or None)``.
        ``inputs`` None: the zero-copy path, the rows already in the static buffers.

        A forward that raises is the request's own error, as eagerly: it propagates and
        leaves nothing behind (the size is not warmed, so its next call is its first call
        again). A step that reseeded a generator gets its result, and the size is refused
        (failed): a graph could not replay the reseed."""
        with self._alone(size, "running the first call of"):
            return self._first_call(size, n, inputs)

    def _first_call(
        self, size: int, n: int, inputs: Sequence[torch.Tensor] | None
    ) -> tuple[Any, list[str] | None]:
        d = self.door
        t0 = time.perf_counter()
        if self.evict:
            d.recency()  # a look between captures: recency's epochs are finer
        d.load_rows(n, inputs)
        draws = Draws(d.generators())
        try:
            t1 = time.perf_counter()
            out, seen = d.warm_forward(size)
            t2 = time.perf_counter()
            with capture_lock:  # a device-wide synchronize (see the module)
                d.synchronize()
            t3 = time.perf_counter()
        except Exception:
            draws.rewind()
            self._agreed("warm", size, False)  # every rank fails this call
            raise
        except BaseException:
            draws.rewind()
            raise
        reseeded = draws.check(f"{d.label} (first call at size {size})")
        draws.rewind()
        if not self._agreed("warm", size, reseeded is None):
            if reseeded is None:
                raise GraphGuardError(
                    f"{d.label}: the first call at size {size} failed on a peer rank, so it "
                    "fails on every rank (the ranks run the same calls); nothing was kept"
                )
            self._refuse(size, FAILED, f"its first call: {reseeded}")
        else:
            self.warmed[size] = True
        rows = d.static.views(size)
        got = d.unpad(out, list(inputs) if inputs is not None else [], rows, n)
        t4 = time.perf_counter()
        self.counters.first_call(
            n, size, {"rows": t1 - t0, "forward": t2 - t1, "sync": t3 - t2, "after": t4 - t3}
        )
        return got, seen

    # ------------------------------------------------------------------ eviction

    def _agreed(self, stage: str, size: int, ok: bool) -> bool:
        return ok if self.agreement is None else self.agreement.agree_lazy(stage, size, ok)

    def _capture(self, size: int) -> bool:
        t_budget = time.perf_counter()
        ledger = self.door.ledger
        if self.evict:
            with capture_lock:
                self.budget.make_room(size)
        pool, driver = ledger.predict(size)
        why = None
        if ledger.over(pool + driver):  # the total it would reach, never what is held now
            why = (
                f"capturing size {size} would take the graphs to "
                f"{mib(ledger.used + pool + driver)} of a {mib(ledger.budget or 0)} budget "
                f"(predicted: {mib(pool)} of pool and {mib(driver)} outside the allocator, "
                f"on top of {ledger.describe(budget=False)} held now)"
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
                report = self.door.capture([size], how=LAZILY)
            if not report.sizes:  # released (or captured) while this call waited: not ours
                return size in self.door.captured_sizes
            self._report = report
        except GraphCaptureError as exc:  # logged by the lifecycle already
            err = exc.cause if exc.cause is not None else exc
            report = self._report = exc.report
        except Exception as exc:
            err = exc
            logger.error(
                "%s: lazy capture of size %d failed: %s", self.door.label, size, first_line(exc)
            )
        t_settle = time.perf_counter()
        try:
            return self._keep_or_refuse(size, err, why, t0)
        finally:
            if report is not None:  # the capture's cost by phase, completed (stats())
                report.phases["budget"] = t0 - t_budget
                report.phases["wait"] = report.phases.get("wait", 0.0) + waited
                report.tick("settle", t_settle)
                report.complete(time.perf_counter() - t_budget)

    def _keep_or_refuse(
        self, size: int, err: BaseException | None, why: str | None, t0: float
    ) -> bool:
        """Steps 5 and 6: the budget checked on what it took, the ranks agreed."""
        d, ledger = self.door, self.door.ledger
        ok = err is None and size in d.captured_sizes
        if self.evict:  # on every rank: the ranks agree on each release
            with capture_lock:
                self.budget.over_budget(size, keep=True)
        if ok and ledger.over():
            why = f"size {size}'s capture took the graphs to {ledger.describe()}; dropped"
            d.drop_size(size)
            ok = False
        if self.evict:  # the pool keeps what the dropped graph grew it by: the rest go
            with capture_lock:
                self.budget.over_budget(size, keep=False)
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

    def _refuse(self, size: int, status: str, why: str, *, logged: bool = False) -> None:
        self.door.refuse(size, status, why)
        self._status[size] = status
        if not logged:
            logger.warning(
                "%s: size %d is %s and runs eagerly (%s); logged once, until recapture()",
                self.door.label,
                size,
                status,
                why,
            )


__all__ = [
    "FAILED",
    "OVER_BUDGET",
    "LazyCalls",
    "LazyCapture",
    "capture_lock",
    "lazy_plan",
    "stage_failed",
    "warm_forward",
]
