"""One place decides which graph runs a batch: FULL, PIECEWISE or eager.

:mod:`.plan`: the keys and the policy (resolved at call time from the padding tables, the
report); :mod:`.dispatcher`: the :class:`Dispatcher` that obeys it, and
:func:`build_dispatcher`, which wires both runners for a one-row-per-token step.
"""

from graphguard.dispatch.dispatcher import Dispatcher, build_dispatcher
from graphguard.dispatch.plan import BatchKey, Decision, DispatchPlan, PlanRow

__all__ = ["BatchKey", "Decision", "DispatchPlan", "Dispatcher", "PlanRow", "build_dispatcher"]
