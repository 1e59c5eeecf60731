"""What a runner does with a batch that has no graph: the miss policy, one object chosen
at construction.

The replay path (:mod:`graphguard.ladder.replay`) answers a batch whose entry exists
itself; every other call, once its inputs are checked, is handed to the runner's
:class:`Miss`, which decides. :class:`EagerMiss` (every runner without ``lazy=``) runs
it eagerly and counts why; :class:`~graphguard.lazy.LazyCapture` (``lazy=``) runs a
size's first call, or captures the size and replays it (evicting others under a
budget), and hands anything else to its :class:`EagerMiss`. The replay path never asks
which one it holds.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from graphguard.capture import CapturePlan
from graphguard.errors import GraphGuardError
from graphguard.ladder.store import GraphStore
from graphguard.mode import Mode
from graphguard.report import CaptureReport
from graphguard.sizes import PaddingTable
from graphguard.stats import ABOVE

logger = logging.getLogger("graphguard")

RunPlan = Callable[..., CaptureReport]
"""Run a capture plan and record it (``run(plan, **keywords of graphguard.capture.run)``)."""


class Miss(Protocol):
    """A runner's miss policy. The runner calls it:

    1. ``call(n, inputs)``: ``runner(*inputs)`` of a batch of ``n`` with no entry, its
       inputs checked; returns the call's outputs.
    2. ``replay(n)``: ``replay(n)`` of a batch of ``n`` with no entry, its rows in the
       static buffers: ``(True, outputs)``, or ``(False, None)`` when the policy runs no
       such replay (the runner then raises why).
    3. ``prepare(n)``: before the caller writes ``static_inputs(n)`` (a capture resets the
       buffers): make the size's graph now if the policy does; returns the size when the
       next ``replay(n)`` is that size's first call, else None.
    4. ``forget()``: ``release()`` or a new capture: what the policy learnt of the sizes
       is void.
    5. ``capture_up_front(plan, run)``: ``capture()``'s run of the ladder's ``plan``
       through ``run`` (:meth:`LadderCapture.run_plan
       <graphguard.ladder.capturing.LadderCapture.run_plan>`): what is captured before
       the first call, and what is not is the policy's to capture on a miss.
    """

    def call(self, n: int, inputs: Sequence[Any]) -> Any: ...

    def replay(self, n: int) -> tuple[bool, Any]: ...

    def prepare(self, n: int) -> int | None: ...

    def forget(self) -> None: ...

    def capture_up_front(self, plan: CapturePlan, run: RunPlan) -> CaptureReport: ...


class EagerMiss:
    """The default miss policy: run the batch eagerly (the plain callable, no padding),
    counted in ``stats()`` by why and logged once per size."""

    def __init__(
        self,
        name: str,
        mode: Mode,
        sizes: tuple[int, ...],
        store: GraphStore,
        eager: Callable[..., Any],
    ) -> None:
        self.name = name
        self.mode = mode
        self.sizes = sizes
        self.store = store
        self.eager = eager
        self.logged: set[int] = set()

    def call(self, n: int, inputs: Sequence[Any]) -> Any:
        store = self.store
        reason = self.reason(n)
        store.counters.eager_call(n, reason, store.entries, store.captured_at)
        if n not in self.logged:
            self.logged.add(n)
            why = reason
            if reason == ABOVE:
                why = f"it is above the largest size of the ladder, {self.sizes[-1]}"
            logger.info(
                "%s: batch size %d runs eagerly (%s); logged once per size", self.name, n, why
            )
        return self.eager(*inputs)

    def replay(self, n: int) -> tuple[bool, Any]:
        """An eager runner replays only what was captured: ``replay(n)`` raises why."""
        return False, None

    def prepare(self, n: int) -> int | None:
        """Nothing is captured on use: the rows of a captured size, or an error."""
        return None

    def forget(self) -> None:
        """What is logged once stays logged once for the runner's life."""

    def capture_up_front(self, plan: CapturePlan, run: RunPlan) -> CaptureReport:
        """The whole ladder: a batch with no graph then runs eagerly."""
        return run(plan)

    def reason(self, n: int) -> str:
        """Why a batch of ``n`` runs eagerly (:mod:`graphguard.stats` counts by it)."""
        if self.mode is Mode.NONE:
            return "mode is none"
        store = self.store
        size = PaddingTable(self.sizes).padded(n)
        if size is None:
            return ABOVE
        if size in store.refusals and store.pad.padded(n) not in store.table.sizes:
            return f"size {store.refusals[size][0]}"
        if not store.table.sizes:
            return "no size captured"
        return "the output layout is unknown, so only captured sizes replay"


def not_serving(name: str, n: int, released: bool) -> GraphGuardError:
    """The error of a call before ``capture()``, or after ``release()``."""
    if released:
        return GraphGuardError(
            f"{name}: called with batch size {n} after release(), which dropped "
            "every graph and its memory; call runner.capture() to capture again (or "
            "runner.eager(*inputs) to run the callable without graphs)"
        )
    return GraphGuardError(
        f"{name}: called with batch size {n} before capture(); call "
        "runner.capture() first (or build the runner with mode='none')"
    )


__all__ = ["EagerMiss", "Miss", "RunPlan", "not_serving"]
