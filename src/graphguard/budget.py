"""What keeps a lazy runner's graphs within ``Lazy(budget=...)``: with ``evict="lru"`` the
graphs released to make room, least recently replayed first, the ranks of a
tensor-parallel group agreeing on each (:class:`~graphguard.serving.Agreement`); the
``capture_now`` sizes checked on what they took; and the lock every lazy capture holds.
:mod:`graphguard.lazy` says when.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from graphguard.ledger import mib
from graphguard.report import CaptureReport
from graphguard.serving import Door
from graphguard.stats import OVER_BUDGET

capture_lock = threading.RLock()
"""Held by every lazy capture in the process: hold it around a device-wide synchronize
(``torch.cuda.synchronize()``) in a thread other than the serving one, which CUDA forbids
while a capture runs (``with graphguard.lazy.capture_lock: torch.cuda.synchronize()``)."""


class Budget:
    """One lazy runner's budget, through its door. ``agreed(stage, size, ok)``: whether
    every rank is ok (the runner's agreement, or ``ok`` alone); ``warmed``: the lazy
    capture's warmed sizes, where an evicted size goes (its shape ran: captured again
    with no first call); ``refuse(size, status, why)``: the lazy capture's refusal."""

    def __init__(
        self,
        door: Door,
        agreed: Callable[[str, int, bool], bool],
        warmed: dict[int, bool],
        refuse: Callable[[int, str, str], None],
    ) -> None:
        self.door = door
        self.agreed = agreed
        self.warmed = warmed
        self.refuse = refuse

    def make_room(self, size: int) -> int:
        """``Lazy(evict="lru")``: release the least recently replayed graphs until a
        capture of ``size`` is predicted to fit the budget (not when it cannot fit even
        alone: it is refused as before); how many went. Under tensor parallelism the ranks
        agree on each release (one CPU all-reduce), so all release the same graphs: the
        order is the calls' (:meth:`GraphStore.recency
        <graphguard.ladder.store.GraphStore.recency>`), the same on every rank."""
        d, ledger = self.door, self.door.ledger
        victims = [s for s in d.recency() if s != size]  # a look at every capture
        for gone, victim in enumerate([*victims, None]):
            fits = not ledger.over(sum(ledger.predict(size)))
            hopeless = ledger.budget is not None and ledger.predict_alone(size) > ledger.budget
            if self.agreed("evict", size, fits or hopeless or victim is None) or victim is None:
                return gone
            if gone == 0:
                with capture_lock:  # the victims' last replays done before they go
                    d.synchronize()
            d.drop_size(victim, evict=True)
            self.warmed[victim] = True  # its shape ran: captured again, warm
        return len(victims)

    def over_budget(self, size: int, *, keep: bool) -> None:
        """The graphs over the budget after a capture: release the least recently
        replayed other graphs until they are within it (the ranks agreeing on each).
        ``keep``: the new graph stays, so none goes when even all of them would not do
        (the pool keeps its blocks while the new graph holds it): the new graph is dropped
        instead, then this runs again without ``keep``, and the last graph to go takes
        the pool, with what it grew to, along."""
        d, ledger = self.door, self.door.ledger
        mine = ledger.driver.get(size, 0)
        alone = ledger.pool_bytes + mine + ledger.driver_adjust
        vain = keep and ledger.budget is not None and alone > ledger.budget
        victims: list[int] | None = None
        while not self.agreed("evict", size, not ledger.over() or vain or victims == []):
            if victims is None:
                victims = [s for s in d.recency() if s != size]
                continue
            victim = victims.pop(0)
            d.drop_size(victim, evict=True)
            self.warmed[victim] = True

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
                self.refuse(
                    s.size,
                    OVER_BUDGET,
                    f"capture_now size {s.size}'s capture took the graphs to {mib(used)} (pool "
                    f"plus the driver's share) of a {mib(budget)} budget; dropped",
                )


__all__ = ["Budget", "capture_lock"]
