"""The runner's parts, in lifecycle order: what a runner holds (:mod:`.record`,
:mod:`.store`), how its kind captures and replays (:mod:`.kind`; the FULL kind:
:mod:`.full`), how it captures (:mod:`.capturing`), what a call does (:mod:`.replay`)
and what a batch with no graph runs (:mod:`.miss`), what the serving-time features may
ask of it (:mod:`.door`), and the :class:`GraphLadder` that builds them
(:mod:`.ladder`). ``GraphRunner`` (FULL) and ``PiecewiseRunner`` (PIECEWISE) are a
:class:`GraphLadder` with their kind.
"""

from __future__ import annotations

from graphguard.ladder.door import LadderDoor
from graphguard.ladder.ladder import GraphLadder, Ladder, check_reason, start_over
from graphguard.ladder.record import GraphRecord
from graphguard.ladder.store import GraphStore

__all__ = [
    "GraphLadder",
    "GraphRecord",
    "GraphStore",
    "Ladder",
    "LadderDoor",
    "check_reason",
    "start_over",
]
