"""Weights under live graphs: update in place, prove the captured addresses, recapture
only what must be.

In lifecycle order this room comes after capture (:mod:`graphguard.capture`) and
serving (:mod:`graphguard.ladder`). A graph reads the raw addresses its parameters and
buffers had at capture, so a loader that re-materialises one (``param.data = new``,
``module.weight = Parameter(...)``, ``.contiguous()``, ``.to()``, a re-created buffer)
leaves the graphs serving the old storage, or freed memory. Three things follow:

* :class:`WeightRecord`, taken at the end of every capture for the graphs it captured
  (each graph keeps its own, so a later capture never hides an older graph's stale
  read): for each name the module
  gives a parameter or buffer (tied names included), its address, shape, stride, dtype
  and storage bytes.
* :meth:`Weights.check`: every name resolved again on the module and compared with each
  graph's record, no replay; each tensor that moved is listed by name with what changed,
  and the graphs that read it (known per graph from provenance, the sanitizer's storage
  list or the pieces' input addresses; without one, every graph).
* :func:`update_weights`: the whole source is checked first (names, shapes, dtypes, tied
  names), then copied into the captured storages with one ``_foreach_copy_`` per device
  pair, under ``no_grad``: every weight changes, or none.

The runners' ``update_weights``, ``check_weights`` and ``recapture(only_moved=True)``
delegate here; a *target* is a runner's door (:class:`graphguard.serving.Door`, typed here
as :class:`~graphguard.weights.update.Refit`). :mod:`.record` holds what each graph's
capture saw and the check (:mod:`.module` the lookups on the live module); :mod:`.update`
the validated, fused copy (:mod:`.validate` what is refused first, :mod:`.settle` how it
ends); :mod:`.refit` the watch and :mod:`.verdict` what it finds.
"""

from __future__ import annotations

from graphguard.weights.record import (
    MovedWeight,
    WeightCheck,
    WeightRecord,
    Weights,
    find_module,
)
from graphguard.weights.update import WeightUpdate, update_weights

__all__ = [
    "MovedWeight",
    "WeightCheck",
    "WeightRecord",
    "WeightUpdate",
    "Weights",
    "find_module",
    "update_weights",
]
