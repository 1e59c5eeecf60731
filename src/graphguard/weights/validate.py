"""What is refused before a weight update writes anything, and the proof that lets the
next update skip the full check.

The flags (``on_moved``, ``strict``), a compiled step that froze its parameters, derived
tensors an update would leave stale (no ``refresh``), and a tensor that already moved
(raised with when it was found, so the loader is not blamed for it). A repeated update
skips the full ``check_weights`` before its copy while :func:`still_proven` holds (the
kept copy plan's tensors re-proved unchanged); it is checked again after the copy.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

from graphguard.errors import ConfigError, WeightsMovedError
from graphguard.weights.record import WeightCheck

if TYPE_CHECKING:
    from graphguard.weights.protocols import Refit

ON_MOVED: tuple[str, ...] = ("raise", "recapture")


def check_on_moved(on_moved: str) -> None:
    if on_moved not in ON_MOVED:
        raise ConfigError(
            f"on_moved must be 'raise' or 'recapture', got {on_moved!r}; 'recapture' recaptures "
            "the graphs that read a moved tensor"
        )


def check_moved_before(
    captured: Sequence[Refit], on_moved: str, when: str
) -> list[tuple[Refit, WeightCheck]]:
    """Each runner's check; with ``on_moved="raise"`` a moved tensor raises, saying when."""
    found = [(t, t.check_weights()) for t in captured]
    if on_moved == "raise":
        for _, f in found:
            if f.moved:
                raise WeightsMovedError(
                    f.message() + f"\n({when})", names=tuple(m.name for m in f.moved)
                )
    return found


def still_proven(captured: Sequence[Refit]) -> bool:
    """Whether nothing can have moved since the last update proved it did not: every
    module's tensors are the objects, addresses and shapes its kept copy plan recorded
    (:class:`~graphguard.weights.record.Identity`, microseconds), the runners hold the
    same sizes, and no derived tensor a graph reads was re-created. Then the full
    ``check_weights`` before the copy is skipped (it runs again after the copy, while the
    device copies)."""
    for t in captured:
        room = t.weights
        got, proven = room.cache.get("plan"), room.cache.get("proven")
        if got is None or proven != (id(got), t.label, t.captured_sizes):
            return False
        if not got[2].intact():
            return False
        if t.derived_reads()[1]:
            return False
    return bool(captured)


def remember_proven(captured: Sequence[Refit]) -> None:
    """A check before copying found nothing moved: remember it against the kept plan."""
    for t in captured:
        room = t.weights
        got = room.cache.get("plan")
        if got is not None:
            room.cache["proven"] = (id(got), t.label, t.captured_sizes)


def check_flags(on_moved: str, strict: bool, targets: Sequence[Refit]) -> None:
    check_on_moved(on_moved)
    if not isinstance(strict, bool):
        raise ConfigError(f"strict must be True or False, got {strict!r}")
    _refuse_frozen(targets)


def refuse_stale_derived(targets: Sequence[Refit], refresh: Any) -> None:
    """Refuse, before anything is copied, an update that would leave derived tensors the
    graphs read stale (no ``refresh``); ``refresh`` must be a callable when given."""
    if refresh is not None:
        if not callable(refresh):
            raise ConfigError(
                f"refresh must be a callable that re-derives the derived tensors, got "
                f"{type(refresh).__name__}; e.g. refresh=model.rederive"
            )
        return
    for t in targets:
        derived, _ = t.derived_reads()
        if derived:
            raise ConfigError(
                f"{t.label}: update_weights refused, no weight changed: the captured graphs "
                f"read {len(derived)} tensor(s) that no module lists as a parameter or buffer "
                f"(derived at load): {', '.join(derived[:8])}"
                + (" ..." if len(derived) > 8 else "")
                + ". The update writes parameters and buffers only, so the graphs would "
                "keep serving values derived from the old weights. Pass refresh=callable "
                "that re-derives them after the copy (in place keeps the graphs; at a new "
                "address, on_moved decides), or refresh=lambda: None if they do not depend "
                "on the weights."
            )


def _refuse_frozen(targets: Sequence[Refit]) -> None:
    """Inductor's freezing folds parameters into the compiled code as constants: an
    in-place update would never reach it."""
    for t in targets:
        if t.compiled:
            frozen = getattr(getattr(torch, "_inductor", None), "config", None)
            if frozen is not None and getattr(frozen, "freezing", False):
                raise ConfigError(
                    f"{t.label}: torch._inductor.config.freezing is on, so the compiled step "
                    "baked its parameters in as constants and no in-place update reaches "
                    "them; turn freezing off, or recapture(reason=...) after loading"
                )


__all__ = [
    "ON_MOVED",
    "check_flags",
    "check_moved_before",
    "check_on_moved",
    "refuse_stale_derived",
    "remember_proven",
    "still_proven",
]
