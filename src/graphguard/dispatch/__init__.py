"""One place decides which graph runs a batch: FULL, PIECEWISE or eager.

A :class:`BatchKey` describes a step (tokens, requests, one query length or mixed). A
:class:`DispatchPlan` resolves it, in the key's fallback order: a uniform-decode key is
offered to the FULL graphs (captured for batches of exactly ``query_len`` tokens per
request), then relaxed to a tokens-only key offered to the PIECEWISE graphs (the split
ops run eagerly on the real layout), then the batch runs eagerly. Every downgrade is
listed before capture and logged once. A :class:`Dispatcher` runs each batch on the runner
the plan chose; :func:`build_dispatcher` wires both runners for a one-row-per-token step.
"""

from graphguard.dispatch.build import build_dispatcher
from graphguard.dispatch.dispatcher import Dispatcher
from graphguard.dispatch.keys import BatchKey, Decision, PlanRow
from graphguard.dispatch.plan import DispatchPlan

__all__ = ["BatchKey", "Decision", "DispatchPlan", "Dispatcher", "PlanRow", "build_dispatcher"]
