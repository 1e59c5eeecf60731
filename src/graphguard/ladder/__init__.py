"""The runner's parts, in lifecycle order: what a runner holds (:mod:`.record`,
:mod:`.store`), what a call does (:mod:`.replay`), what the serving-time features may ask
of it (:mod:`.door`), and the ladder that builds them and runs the capture lifecycle
(:mod:`.ladder`). ``GraphRunner`` (FULL) and ``PiecewiseRunner`` (PIECEWISE) stand on
:class:`Ladder`.
"""

from __future__ import annotations

from graphguard.ladder.door import LadderDoor
from graphguard.ladder.ladder import Ladder, check_reason, start_over
from graphguard.ladder.record import GraphRecord
from graphguard.ladder.store import GraphStore

__all__ = ["GraphRecord", "GraphStore", "Ladder", "LadderDoor", "check_reason", "start_over"]
