"""``runner.door``: the :class:`~graphguard.serving.Door` a runner's serving-time features
use (lazy capture, the canary, weight updates), apart from the runner's public face.

Why an object of its own: a feature needs operations a user should not see on a runner
(capture these sizes now, drop one, replay an entry as it stands, refuse a size), and a
runner that implements them itself shows them all. The door holds the runner's
:class:`~graphguard.ladder.store.GraphStore` and capture guard, and borrows the runner
kind's behaviour as callables (a :class:`Floor`), so it never reaches into the runner.
Every operation that captures or frees graphs takes the capture guard: capturing marks
the thread as the one capturing; dropping is refused from inside the step and waits for
a capture on another thread (:class:`~graphguard.serving.CaptureGuard`).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from graphguard.backend import GraphBackend
from graphguard.buffers import InputSpec, StaticInputs
from graphguard.capture import HOW
from graphguard.entries import Entry, copy_into
from graphguard.errors import ConfigError
from graphguard.ladder.store import GraphStore
from graphguard.ledger import GraphLedger
from graphguard.outputs import narrow_outputs
from graphguard.report import CaptureReport
from graphguard.serving import CaptureGuard
from graphguard.sizes import PaddingTable, is_int
from graphguard.state import StateSet
from graphguard.stats import ServingCounters
from graphguard.weights.record import GraphKey, MovedWeight, WeightCheck, Weights
from graphguard.weights.refit import RefitReads


@dataclass(frozen=True)
class Floor:
    """What a runner lends its door: its behaviour, as callables."""

    capture: Callable[[Sequence[int], str, float], CaptureReport]
    """Capture sizes into the ladder's pool (``sizes, how, seconds waited``), the guard
    already held."""
    recapture_moved: Callable[[WeightCheck, str], CaptureReport | None]
    run: Callable[[Entry], Any]
    """The kind's replay of an entry whose inputs are in the static buffers."""
    detached: Callable[[tuple[Any, ...], RuntimeError], Any]
    eager: Callable[..., Any]
    generators: Callable[[], list[tuple[str, torch.Generator]]]
    weights: Callable[[], Weights]
    check_weights: Callable[[], WeightCheck]
    derived_reads: Callable[[], tuple[tuple[str, ...], list[MovedWeight]]]
    refit_reads: Callable[[], RefitReads]
    taken: Callable[[int], list[tuple[int, int]] | None]
    backend: Callable[[], GraphBackend]
    compiled: Callable[[], bool]
    rebuild: Callable[[], None]
    """Rebuild the replay path's entries (and what watches them: the canary)."""
    warm: Callable[[int], tuple[Any, list[str] | None]]
    """One watched uncaptured forward at a size, as a warmup (:meth:`LadderDoor.warm_forward`)."""


class LadderDoor:
    """A runner's :class:`~graphguard.serving.Door` (see the module docstring)."""

    def __init__(
        self,
        label: str,
        store: GraphStore,
        guard: CaptureGuard,
        floor: Floor,
        *,
        specs: list[InputSpec],
        static: StaticInputs,
        state: StateSet | None,
    ) -> None:
        self._label = label
        self._store = store
        self._guard = guard
        self._floor = floor
        self._specs = specs
        self._static = static
        self._state = state

    # ------------------------------------------------------------------ reading

    @property
    def label(self) -> str:
        return self._label

    @property
    def sizes(self) -> tuple[int, ...]:
        return self._store.ladder

    @property
    def captured_sizes(self) -> tuple[int, ...]:
        return self._store.table.sizes

    @property
    def graph_keys(self) -> tuple[GraphKey, ...]:
        return self._store.graphs.graph_keys()

    @property
    def serving(self) -> bool:
        return self._store.serving

    @property
    def pad_table(self) -> PaddingTable:
        return self._store.pad

    @property
    def entries(self) -> Sequence[Entry | None]:
        return self._store.entries

    @property
    def narrows(self) -> bool:
        return self._store.layout.dims is not None

    @property
    def refusals(self) -> Mapping[int, tuple[str, str]]:
        return self._store.refusals

    @property
    def specs(self) -> list[InputSpec]:
        return self._specs

    @property
    def static(self) -> StaticInputs:
        return self._static

    @property
    def state(self) -> StateSet | None:
        return self._state

    @property
    def ledger(self) -> GraphLedger:
        return self._store.ledger

    @property
    def counters(self) -> ServingCounters:
        return self._store.counters

    @property
    def weights(self) -> Weights:
        return self._floor.weights()

    @property
    def compiled(self) -> bool:
        return self._floor.compiled()

    def exclusive(self, what: str) -> contextlib.AbstractContextManager[None]:
        guard: contextlib.AbstractContextManager[None] = self._guard.exclusive(what)
        return guard

    def generators(self) -> list[tuple[str, torch.Generator]]:
        return self._floor.generators()

    # ------------------------------------------------------------------ capture, drop

    def capture_sizes(self, sizes: Sequence[int], *, how: str) -> CaptureReport:
        t = time.perf_counter()
        wanted = self._on_ladder(sizes, how)
        # Refused from inside the step (a capture nested in the open one), as drop_size is.
        with self._guard.exclusive("capture_sizes()"), self._guard.capturing():
            # From the synchronize on: no device-wide call beside.
            return self._floor.capture(wanted, how, time.perf_counter() - t)

    def drop_size(self, size: int) -> None:
        self._on_ladder([size], None, what="drop_size(size)")
        with self._guard.exclusive("drop_size()"):
            self._let_go(size, evict=False)
            self._floor.rebuild()

    def _on_ladder(
        self, sizes: Any, how: str | None, *, what: str = "capture_sizes(sizes, how=...)"
    ) -> list[int]:
        """``sizes`` checked before anything runs: ints of the ladder (a size off it would
        be captured, hold memory, and never replay: no batch pads to it, ``stats()`` has
        no row for it), and ``how`` one of :data:`graphguard.capture.HOW`."""
        where = f"{self._label}: door.{what}"
        if how is not None and how not in HOW:
            raise ConfigError(f"{where}: how must be one of {list(HOW)}, got {how!r:.40}")
        if is_int(sizes):
            raise ConfigError(
                f"{where} takes a list of sizes, got the int {sizes}; pass [{sizes}] "
                "(drop_size takes one size)"
            )
        if isinstance(sizes, (str, bytes)) or not isinstance(sizes, Sequence):
            raise ConfigError(
                f"{where} takes a list of sizes, got {type(sizes).__name__} {sizes!r:.40}"
            )
        bad = [s for s in sizes if not is_int(s)]
        ladder = self._store.ladder
        off = sorted({s for s in sizes if is_int(s) and s not in ladder})
        if bad or off:
            shown = list(ladder) if len(ladder) <= 12 else f"{ladder[0]}..{ladder[-1]}"
            problem = (
                f"{bad[0]!r:.40} ({type(bad[0]).__name__}) is not an int"
                if bad
                else f"{off[0] if len(off) == 1 else off} {'is' if len(off) == 1 else 'are'} "
                "not on the ladder"
            )
            raise ConfigError(
                f"{where}: {problem}; the ladder (runner.sizes) is {shown} ({len(ladder)} "
                "sizes), and only its sizes are padded to, replayed and counted in stats(): "
                "pick sizes from runner.sizes, or build the runner with sizes=[...] that "
                "include them"
            )
        return list(sizes)

    def evict(self, size: int) -> None:
        with self._guard.exclusive("evict()"):
            self._let_go(size, evict=True)

    def _let_go(self, size: int, *, evict: bool) -> None:
        """Release ``size``'s graphs (evicted: captured again when met; dropped: gone
        until the next stage) and carry what free device memory says came back short of
        what the ledger charged them (:meth:`GraphLedger.released
        <graphguard.ledger.GraphLedger.released>`). When the pool goes with them the cache
        is emptied before the first read too, so what comes back is the pool's alone."""
        store, backend = self._store, self._floor.backend()
        if set(store.graphs.sizes()) <= {size}:
            backend.empty_cache()
        free, pool = backend.free_bytes(), store.ledger.pool_bytes
        rec = store.records.get(size)
        charged = rec.driver_bytes if rec is not None else 0
        if evict:
            emptied = store.evict(size)
        else:
            store.retire([size])
            emptied = store.reap()
        if emptied:  # the pool's last graph took the pool with it
            backend.empty_cache()
            store.ledger.clear()
            charged += pool
        store.ledger.released(charged, backend.free_bytes() - free)

    def recency(self) -> list[int]:
        return self._store.recency()

    def refuse(self, size: int, status: str, why: str) -> None:
        self._store.refuse(size, status, why)
        self._floor.rebuild()

    # ------------------------------------------------------------------ a first call

    def load_rows(self, n: int, inputs: Sequence[Any] | None) -> None:
        static = self._static
        with torch.no_grad():
            if inputs is not None:
                copy_into(static.views(n), list(inputs))
            copy_into(*static.tails(n))
        self._store.dirty = static.max_size  # the step may write rows: the next replay refills

    def warm_forward(self, size: int) -> tuple[Any, list[str] | None]:
        return self._floor.warm(size)

    def synchronize(self) -> None:
        self._floor.backend().synchronize()

    # ------------------------------------------------------------------ replay

    def replay_entry(
        self, e: Entry, inputs: tuple[Any, ...] | None, *, refill: bool = False
    ) -> Any:
        store, run = self._store, self._floor.run
        if refill:
            store.dirty = self._static.max_size
            try:
                return run(e)
            finally:
                store.dirty = self._static.max_size
        out = run(e)
        if inputs is not None and e.writeback:
            store.writes.copy_back([inputs[i] for i in e.writeback], e, self._label)
        return out

    def replay_detached(self, inputs: tuple[Any, ...], exc: RuntimeError) -> Any:
        return self._floor.detached(inputs, exc)

    def eager(self, *inputs: Any) -> Any:
        return self._floor.eager(*inputs)

    def unpad(self, out: Any, inputs: Sequence[Any], rows: Sequence[Any], n: int) -> Any:
        store = self._store
        for i in store.writes.written(self._label) if inputs else []:
            inputs[i].copy_(rows[i].narrow(self._specs[i].batch_dim, 0, n))
        if rows and rows[0].shape[self._specs[0].batch_dim] == n:
            return out  # not padded: nothing to narrow
        return narrow_outputs(out, store.layout.dims, n, self._label)

    # ------------------------------------------------------------------ weights

    def check_weights(self) -> WeightCheck:
        return self._floor.check_weights()

    def derived_reads(self) -> tuple[tuple[str, ...], list[MovedWeight]]:
        return self._floor.derived_reads()

    def refit_reads(self) -> RefitReads:
        return self._floor.refit_reads()

    def taken(self, size: int) -> list[tuple[int, int]] | None:
        return self._floor.taken(size)

    def recapture_moved(self, found: WeightCheck, reason: str) -> CaptureReport | None:
        with self._guard.exclusive("recapture()"):
            return self._floor.recapture_moved(found, reason)


__all__ = ["Floor", "LadderDoor"]
