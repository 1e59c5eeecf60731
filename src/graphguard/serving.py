"""The door between a runner and its serving-time features: what lazy capture, the
canary, weight updates and stats may ask of the ladder they serve.

Why a door: each serving-time feature needs a few operations of the ladder (capture these
sizes, drop one, replay an entry, run eagerly, read the entries and the padding table,
check the weights). Reached through private attributes, every feature becomes a friend
class: mypy checks none of the calls, and the ladder cannot change without breaking them.
:class:`Door` names the operations, typed; every runner holds one (``runner.door``, a
:class:`graphguard.ladder.door.LadderDoor`), apart from its public face, and hands it to
each feature it builds. Rank agreement comes in the same way, as an :class:`Agreement`
given to the runner at construction (``DistributedGraphRunner`` passes itself), never set
afterwards.

A door is also the extension point for an engine's own serving-time feature: everything
on it is safe to call between replays from the thread that serves the runner, and every
operation that captures or frees graphs takes the runner's :class:`CaptureGuard`.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator, Sequence
from typing import Any, Protocol, runtime_checkable

import torch

from graphguard.buffers import StaticInputs
from graphguard.capture import HOW
from graphguard.entries import Entry
from graphguard.errors import GraphGuardError
from graphguard.ledger import GraphLedger
from graphguard.report import CaptureReport
from graphguard.weights.record import MovedWeight, WeightCheck, Weights
from graphguard.weights.refit import RefitReads

UP_FRONT, LAZILY = HOW


@runtime_checkable
class Door(Protocol):
    """The operations a serving-time feature may use on the ladder it serves, grouped by
    the feature that uses them. An operation no feature uses is not here (a runner's door
    has a few more reads, for engines: ``sizes``, ``serving``, ``graph_keys``,
    ``pad_table``, ``narrows``, ``refusals``, ``specs``, ``state``, ``counters``, ``taken``)."""

    # ---------------------------------------------------------------- every feature

    @property
    def label(self) -> str:
        """The runner in messages, e.g. ``GraphRunner(decode)``."""
        ...

    @property
    def captured_sizes(self) -> tuple[int, ...]:
        """The sizes that have a graph now, ascending."""
        ...

    @property
    def static(self) -> StaticInputs:
        """The static input buffers the graphs read (``static.specs``: the inputs')."""
        ...

    @property
    def entries(self) -> Sequence[Entry | None]:
        """The replay path's entries, indexed by batch size."""
        ...

    def exclusive(self, what: str) -> contextlib.AbstractContextManager[None]:
        """Run ``what`` outside any capture of this runner (:class:`CaptureGuard`)."""
        ...

    # ---------------------------------------------------------------- the canary

    def generators(self) -> list[tuple[str, torch.Generator]]:
        """``(name, generator)`` the graphs register and restore."""
        ...

    def eager(self, *inputs: Any) -> Any:
        """The plain callable on ``inputs``, under the graphs' autocast policy."""
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

    # ---------------------------------------------------------------- lazy capture

    @property
    def ledger(self) -> GraphLedger:
        """What the graphs hold on the device, against the budget."""
        ...

    def missing_size(self, n: int) -> int | None:
        """The ladder size a batch of ``n`` would replay at that has no graph yet: None
        when the runner does not serve, the size is captured or refused, ``n`` is above
        the ladder, or the batch would be padded and its outputs cannot be narrowed."""
        ...

    def capture(self, sizes: Sequence[int], *, how: str) -> CaptureReport:
        """Capture ``sizes`` with the whole lifecycle into the ladder's pool, their old
        graphs (if any) replaced; the other graphs keep serving. ``how`` is
        ``"lazily"`` (one size on first use: no hooks, arenas stay locked) or
        ``"up front"`` (a partial recapture: the hooks run again for these sizes).
        A lazy capture that finds the runner released, or the size captured, by a call
        it waited for captures nothing (a report with no sizes).
        The entries and every per-graph record follow; a
        :class:`~graphguard.errors.GraphCaptureError` keeps the sizes that captured."""
        ...

    def drop_size(self, size: int, *, evict: bool = False) -> None:
        """Drop one size's graph now (its memory back; the last graph takes the pool).
        ``evict``: to make room under the budget (its driver share back, its pool blocks
        kept for the next captures unless it was the pool's last graph), counted in
        ``stats()``; a call that meets it captures it again."""
        ...

    def refuse(self, size: int, status: str, why: str) -> None:
        """Refuse ``size`` (``failed`` or ``over budget``) until the next ``capture()``: its
        batches pad to the next larger size or run eagerly."""
        ...

    def recency(self) -> list[int]:
        """The captured sizes, least recently replayed first (the eviction order)."""
        ...

    def load_rows(self, n: int, inputs: Sequence[Any] | None) -> None:
        """Put a batch of ``n`` in the static buffers as a call would before its replay:
        ``inputs`` copied into the first ``n`` rows (None: the caller wrote them, the
        zero-copy path), every row past them back at its fill value."""
        ...

    def warm_forward(self, size: int) -> tuple[Any, list[str] | None]:
        """One uncaptured forward on the static buffers at ``size`` under the warmup rules
        (phase WARMUP, the graphs' grad mode and autocast policy, the sanitizer's warmup
        checks), watched for undeclared writes when no state is declared: ``(outputs,
        the tensors it wrote outside its inputs, or None when not watched)``. No
        synchronize: the caller's."""
        ...

    def synchronize(self) -> None:
        """Wait for every stream of the device (hold :data:`graphguard.lazy.capture_lock`
        around it when another thread may be capturing)."""
        ...

    def unpad(self, out: Any, inputs: Sequence[Any], rows: Sequence[Any], n: int) -> Any:
        """For ``n`` rows run as a larger padded batch ``rows``: written input rows copied
        back into ``inputs``, outputs narrowed to ``n``."""
        ...

    # ---------------------------------------------------------------- weights

    @property
    def weights(self) -> Weights:
        """The module the weights operations cover (a ConfigError when there is none)."""
        ...

    @property
    def compiled(self) -> bool:
        """The graphs record a compiled step (``compile=True``): Inductor may have baked
        parameters in as constants (``freezing``)."""
        ...

    def check_weights(self) -> WeightCheck:
        """What moved since each graph's capture (no guard taken: the caller holds it)."""
        ...

    def derived_reads(self) -> tuple[tuple[str, ...], list[MovedWeight]]:
        """The derived tensors the graphs read, and those re-created since."""
        ...

    def refit_reads(self) -> RefitReads:
        """Which named storages the graphs read, with the graphs (provenance; None when not
        known), and what each capture saw of the module: what a refit classifies."""
        ...

    def recapture_moved(self, found: WeightCheck, reason: str) -> CaptureReport | None:
        """Capture again the graphs that read what ``found`` says moved (FULL: their sizes;
        PIECEWISE with per-graph reads: their pieces alone), the others serving on; None
        when no graph reads it (the weight records are then taken again)."""
        ...


class Agreement(Protocol):
    """How the ranks of a tensor-parallel group agree on serving-time decisions (one CPU
    collective each). ``DistributedGraphRunner`` implements it; a single process has none."""

    def agree_lazy(self, stage: str, size: int, ok: bool) -> bool:
        """Whether every rank is ok at ``stage`` of lazy size ``size``: to capture it
        (``"start"``), kept it (``"done"``), ran its first call as its warmup
        (``"warm"``), needs no more room for it (``"evict"``)."""
        ...

    def agree_divergence(self, diverged: bool) -> bool:
        """Whether any rank's canary check of this call diverged."""
        ...

    def agree_update(self, stage: str, error: BaseException | None, *, fail: bool = True) -> bool:
        """Whether any rank has a problem with a weight update at ``stage``
        (``"validating"``, ``"checking"``); with ``fail``, raise on every rank naming the
        ranks that have one."""
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
    def holding(self) -> Iterator[None]:
        """Hold the guard for a call that captures on first use and then replays: a
        serving-time method called from another thread meanwhile (an update, a release)
        waits for the whole call, not only its capture."""
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
