"""The door between a runner and its serving-time features: what lazy capture, the
canary, weight updates and stats may ask of the ladder they serve.

Why a door: each serving-time feature needs a few operations of the ladder (capture these
sizes, drop one, replay an entry, run eagerly, read the entries and the padding table).
Reached through private attributes, every feature becomes a friend class: mypy checks
none of the calls, and the ladder cannot change without breaking them. :class:`Door` names
the operations, typed; a runner implements it (its public ``capture_sizes``,
``drop_size``, ``replay_entry``, ...) and hands itself, typed as a door, to each feature
it builds. Rank agreement comes in the same way, as an :class:`Agreement` given to the
runner at construction (``DistributedGraphRunner`` passes itself), never set afterwards.

A door is also the extension point for an engine's own serving-time feature: everything
on it is safe to call between replays from the thread that serves the runner.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator, Sequence
from typing import Any, Protocol

import torch

from graphguard.buffers import InputSpec, StaticInputs
from graphguard.capture import HOW
from graphguard.entries import Entry
from graphguard.errors import GraphGuardError
from graphguard.ledger import GraphLedger
from graphguard.report import CaptureReport
from graphguard.sizes import PaddingTable
from graphguard.state import StateSet

UP_FRONT, LAZILY = HOW


class Door(Protocol):
    """The operations a serving-time feature may use on the ladder it serves."""

    @property
    def label(self) -> str:
        """The runner in messages, e.g. ``GraphRunner(decode)``."""
        ...

    @property
    def sizes(self) -> tuple[int, ...]:
        """The ladder: every size a batch may pad to, captured or not, ascending."""
        ...

    @property
    def captured_sizes(self) -> tuple[int, ...]:
        """The sizes that have a graph now, ascending."""
        ...

    @property
    def pad_table(self) -> PaddingTable:
        """What a batch pads to now (lazy: sizes not captured yet included)."""
        ...

    @property
    def entries(self) -> Sequence[Entry | None]:
        """The replay path's entries, indexed by batch size."""
        ...

    @property
    def narrows(self) -> bool:
        """Whether a padded batch's outputs can be narrowed (the output layout is known),
        so a batch may replay a larger size."""
        ...

    @property
    def specs(self) -> list[InputSpec]:
        """The inputs' specs (names, dtypes, batch dims)."""
        ...

    @property
    def static(self) -> StaticInputs:
        """The static input buffers the graphs read."""
        ...

    @property
    def state(self) -> StateSet | None:
        """The declared state (``state=``)."""
        ...

    @property
    def ledger(self) -> GraphLedger:
        """What the graphs hold on the device, against the budget."""
        ...

    def generators(self) -> list[tuple[str, torch.Generator]]:
        """``(name, generator)`` the graphs register and restore."""
        ...

    def capture_sizes(self, sizes: Sequence[int], *, how: str) -> CaptureReport:
        """Capture ``sizes`` with the whole lifecycle into the ladder's pool, their old
        graphs (if any) replaced; the other graphs keep serving. ``how`` is
        ``"lazily"`` (one size on first use: no hooks, arenas stay locked) or
        ``"up front"`` (a partial recapture: the hooks run again for these sizes).
        A lazy capture that finds the runner released, or the size captured, by a call
        it waited for captures nothing (a report with no sizes).
        The entries, the ledger and the weight record follow; a
        :class:`~graphguard.errors.GraphCaptureError` keeps the sizes that captured."""
        ...

    def drop_size(self, size: int) -> None:
        """Drop one size's graph now (its memory back; the last graph takes the pool)."""
        ...

    def rebuild_entries(self) -> None:
        """Rebuild the replay path's entries (after the sizes a batch may pad to changed)."""
        ...

    def replay_entry(
        self, e: Entry, inputs: tuple[Any, ...] | None, *, refill: bool = False
    ) -> Any:
        """Replay entry ``e`` whose inputs are already in the static buffers: the
        caller's ``inputs`` get the step's in-place writes back (None: the zero-copy
        path); ``refill``: every padded row is refilled before and after."""
        ...

    def replay_detached(self, inputs: tuple[Any, ...], exc: RuntimeError) -> Any:
        """The call again on detached inputs, after the fused copy raised ``exc`` (inputs
        that require grad); re-raises when that is not why."""
        ...

    def eager(self, *inputs: Any) -> Any:
        """The plain callable on ``inputs``, under the graphs' autocast policy."""
        ...


class Agreement(Protocol):
    """How the ranks of a tensor-parallel group agree on serving-time decisions (one CPU
    all-reduce each). ``DistributedGraphRunner`` implements it; a single process has none."""

    def agree_lazy(self, stage: str, size: int, ok: bool) -> bool:
        """Whether every rank is ok to capture (``stage`` ``"start"``) or kept
        (``"done"``) lazy size ``size``."""
        ...

    def agree_divergence(self, diverged: bool) -> bool:
        """Whether any rank's canary check of this call diverged."""
        ...


class CaptureGuard:
    """Nothing device-wide inside an open capture, by one rule for every runner method that
    synchronizes the device, frees graphs or changes what they read (``release``,
    ``capture``, ``recapture``, ``update_weights``, ``check_weights``, ``verify``):

    * called from inside the step while this runner captures it (the same thread), it is
      refused with a :class:`~graphguard.errors.GraphGuardError`: it would synchronize or
      free memory inside the capture, which breaks it;
    * called from another thread, it waits until the capture is done, then runs (a
      capture up front, a lazy capture or a partial recapture alike).

    The replay path takes no lock: only captures and these methods do.
    """

    def __init__(self, label: str) -> None:
        self.label = label
        self._lock = threading.RLock()
        self._thread: int | None = None  # the thread inside a capture

    @contextlib.contextmanager
    def exclusive(self, what: str) -> Iterator[None]:
        """Run ``what`` (a method's name, for the error) outside any capture."""
        if self._thread == threading.get_ident():
            raise GraphGuardError(
                f"{self.label}: {what} was called from inside the step while this runner is "
                "capturing it; a capture records the step alone, and a device synchronize "
                f"or a freed graph would break it. Call {what} between steps"
            )
        with self._lock:
            yield

    @contextlib.contextmanager
    def capturing(self) -> Iterator[None]:
        """Mark this thread as the one capturing, for the capture's duration."""
        with self._lock:
            outer, self._thread = self._thread, threading.get_ident()
            try:
                yield
            finally:
                self._thread = outer


__all__ = ["LAZILY", "UP_FRONT", "Agreement", "CaptureGuard", "Door"]
