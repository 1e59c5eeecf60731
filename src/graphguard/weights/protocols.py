"""What a weight update needs of the runners and of the ranks: a runner's door
(:class:`Refit`), how moved graphs are captured again (:data:`Recapture`), and the rank
agreement (:class:`Agreeing`). Typed here so :mod:`graphguard.weights` imports no runner.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

from graphguard.weights.record import WeightCheck

if TYPE_CHECKING:
    from graphguard.weights.record import MovedWeight, Weights
    from graphguard.weights.verdict import RefitReads


class Refit(Protocol):
    """What an update needs of one runner: its door (:class:`graphguard.serving.Door`)."""

    @property
    def label(self) -> str: ...

    @property
    def captured_sizes(self) -> tuple[int, ...]: ...

    @property
    def weights(self) -> Weights: ...

    @property
    def compiled(self) -> bool: ...

    def exclusive(self, what: str) -> contextlib.AbstractContextManager[None]: ...

    def check_weights(self) -> WeightCheck: ...

    def derived_reads(self) -> tuple[tuple[str, ...], list[MovedWeight]]: ...

    def recapture_moved(self, found: WeightCheck, reason: str) -> Any: ...

    def refit_reads(self) -> RefitReads: ...


Recapture = Callable[[Refit, WeightCheck, str], Any]
"""How the graphs that read a moved tensor are captured again: ``(door, found, reason) ->
report`` (default: the door's own partial recapture, :meth:`Door.recapture_moved
<graphguard.serving.Door.recapture_moved>`)."""


class Agreeing(Protocol):
    """The rank agreement an update uses (:class:`graphguard.serving.Agreement`)."""

    def agree_update(
        self, stage: str, error: BaseException | None, *, fail: bool = True
    ) -> bool: ...


__all__ = ["Agreeing", "Recapture", "Refit"]
