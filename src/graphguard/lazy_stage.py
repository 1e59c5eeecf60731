"""A lazy runner's stage and plans: what ``capture()`` of a ``lazy=`` runner does when its
one forward fails (:func:`stage_failed`), and the plan of one lazy capture
(:func:`lazy_plan`). :mod:`graphguard.lazy` says what lazy capture is."""

from __future__ import annotations

import dataclasses
import logging

from graphguard.capture import CapturePlan
from graphguard.errors import GraphCaptureError, first_line

logger = logging.getLogger("graphguard")


def stage_failed(label: str, size: int, exc: Exception, *, skip: bool) -> None:
    """A lazy stage's forward (the layout probe's, ``warm_shapes``') that raised: the one
    forward a lazy ``capture()`` runs, so its failure is ``capture()``'s, as a size's is up
    front: raised, nothing kept or locked, and ``capture()`` may run again. Swallowed, it
    left the layout unknown and every padded batch eager for ever, with no word. ``skip``
    (``on_capture_error="skip"``, where a failed size is logged and the others serve):
    logged as an error, and the stage goes on."""
    if skip:
        logger.error(
            "%s: the lazy stage's forward at size %d failed: %s; on_capture_error='skip', "
            "so capture() goes on (with the output layout unknown, only batches equal to a "
            "captured size replay; the others run eagerly)",
            label,
            size,
            first_line(exc),
        )
        return
    err = GraphCaptureError(
        f"{label}: the lazy stage's forward at size {size} failed: {first_line(exc)}. "
        "capture() kept nothing and locked nothing (the runner does not serve); call "
        "capture() again once the step runs (a transient error), or fix the step "
        "(on_capture_error='skip' logs it and serves on)",
        size=size,
        cause=exc,
    )
    err.__cause__ = exc
    raise err


def lazy_plan(plan: CapturePlan, size: int, warmed: dict[int, bool]) -> CapturePlan:
    """The plan of one lazy capture of ``size``: that size alone, no hooks (the stage ran
    them for the whole ladder), its error raised to :meth:`LazyCapture.capture`, no bar,
    and no process-wide sync debug mode (other threads serve meanwhile; a host sync in
    the step still fails the capture). A size in ``warmed`` (:attr:`LazyCapture.warmed`)
    counts that earlier forward as its first warmup iteration
    (:attr:`CapturePlan.prewarmed <graphguard.capture.CapturePlan.prewarmed>`): once, so
    it leaves ``warmed``. A first call was watched for undeclared writes already, so this
    run watches nothing (the stage's forward was not: the capture's first warmup is)."""
    watched = warmed.pop(size, None)
    return dataclasses.replace(
        plan,
        sizes=[size],
        before_capture=(),
        after_capture=(),
        on_capture_error="raise",
        progress=False,
        prewarmed=frozenset() if watched is None else frozenset({size}),
        watch=None if watched else plan.watch,
        sync_guard=False,
    )


__all__ = ["lazy_plan", "stage_failed"]
