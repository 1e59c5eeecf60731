"""``runner.door``: the :class:`~graphguard.serving.Door` a runner's serving-time features
use (lazy capture, the canary, weight updates), apart from the runner's public face.

Why an object of its own: a feature needs operations a user should not see on a runner
(capture these sizes now, drop one, replay an entry as it stands, refuse a size), and a
runner that implements them itself shows them all. The door does each on the parts the
ladder built (the store, the capture half, what the graphs read), so it never reaches
into the runner; of the replay path it is handed four callables. Every operation that
captures or frees graphs takes the capture guard: capturing marks the thread as the one
capturing; dropping is refused from inside the step and waits for a capture on another
thread (:class:`~graphguard.serving.CaptureGuard`).
"""

from __future__ import annotations

import contextlib
import logging
import time
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from graphguard.buffers import InputSpec, StaticInputs, raise_input_mismatch
from graphguard.capture import HOW
from graphguard.entries import Entry, copy_into
from graphguard.errors import ConfigError
from graphguard.ladder.capturing import LadderCapture
from graphguard.ledger import GraphLedger
from graphguard.outputs import narrow_outputs
from graphguard.report import CaptureReport
from graphguard.sizes import PaddingTable, is_int
from graphguard.state import StateSet
from graphguard.stats import ServingCounters
from graphguard.weights.record import GraphKey, MovedWeight, WeightCheck, Weights
from graphguard.weights.refit import RefitReads

logger = logging.getLogger("graphguard")


def _renamed(old: str, new: str) -> None:
    warnings.warn(
        f"graphguard.door.{old} is deprecated: use door.{new}", DeprecationWarning, stacklevel=3
    )


class LadderDoor:
    """A runner's :class:`~graphguard.serving.Door` (see the module docstring): each
    operation is done here, on the parts the ladder built (its store, capture, reads);
    of the runner it is handed its call, its eager run, the kind's replay of an entry and
    its weight check."""

    def __init__(
        self,
        capture: LadderCapture,
        *,
        call: Callable[..., Any],
        run: Callable[[Entry], Any],
        eager: Callable[..., Any],
        check_weights: Callable[[], WeightCheck],
    ) -> None:
        self._capture = capture
        parts = capture.parts
        self._store = parts.store
        self._guard = parts.guard
        self._reads = parts.reads
        self._static = parts.static
        self._call = call
        self._run = run
        """What the replay path calls per replay (the kind's run, or a subclass's around it)."""
        self._grad_logged = False
        self.eager = eager
        self.check_weights = check_weights

    # ------------------------------------------------------------------ reading

    @property
    def label(self) -> str:
        return self._store.label

    @property
    def captured_sizes(self) -> tuple[int, ...]:
        return self._store.table.sizes

    @property
    def static(self) -> StaticInputs:
        return self._static

    @property
    def entries(self) -> Sequence[Entry | None]:
        return self._store.entries

    def exclusive(self, what: str) -> contextlib.AbstractContextManager[None]:
        guard: contextlib.AbstractContextManager[None] = self._guard.exclusive(what)
        return guard

    # ------------------------------------------------------------------ the canary

    def generators(self) -> list[tuple[str, torch.Generator]]:
        return self._capture.generators()

    def replay_entry(
        self, e: Entry, inputs: tuple[Any, ...] | None, *, refill: bool = False
    ) -> Any:
        store, run = self._store, self._refilled_run
        if refill:
            store.refill_next()
            try:
                return run(e)
            finally:
                store.refill_next()
        out = run(e)
        if inputs is not None and e.writeback:
            store.writes.copy_back([inputs[i] for i in e.writeback], e, self.label)
        return out

    def _refilled_run(self, e: Entry) -> Any:
        self._store.refill_for(e)
        return self._run(e)

    def replay_detached(self, inputs: tuple[Any, ...], exc: RuntimeError) -> Any:
        specs, name = self._static.specs, self._capture.parts.name
        grad = [s.name for s, x in zip(specs, inputs) if x.requires_grad]
        if not grad:
            raise_input_mismatch(inputs, specs, name)  # e.g. a sparse input
            raise exc
        if not self._grad_logged:
            self._grad_logged = True
            logger.warning(
                "%s: inputs %s require grad; a graph has no autograd, so graphguard replays "
                "on detached copies (outputs carry no autograd history). Call under "
                "torch.inference_mode() or pass detached tensors to silence this; logged once",
                name,
                grad,
            )
        return self._call(*(x.detach() for x in inputs))

    # ------------------------------------------------------------------ lazy capture

    @property
    def ledger(self) -> GraphLedger:
        return self._store.ledger

    def missing_size(self, n: int) -> int | None:
        store = self._store
        size = store.pad.padded(n) if n > 0 and store.serving else None
        if size is None or size in store.table.sizes:
            return None
        return size if size == n or store.layout.dims is not None else None

    def capture(self, sizes: Sequence[int], *, how: str) -> CaptureReport:
        t = time.perf_counter()
        wanted = self._on_ladder(sizes, how)
        # Refused from inside the step (a capture nested in the open one), as drop_size is.
        with self._guard.exclusive("door.capture()"), self._guard.capturing():
            # From the synchronize on: no device-wide call beside.
            return self._capture.capture_sizes(wanted, how, None, time.perf_counter() - t)

    def drop_size(self, size: int, *, evict: bool = False) -> None:
        if evict:
            with self._guard.exclusive("evict()"):
                self._release_size(size, evict=True)
            return
        self._on_ladder([size], None, what="drop_size(size)")
        with self._guard.exclusive("drop_size()"):
            self._release_size(size, evict=False)
            self._capture.parts.rebuild(None)

    def refuse(self, size: int, status: str, why: str) -> None:
        self._store.refuse(size, status, why)
        self._capture.parts.rebuild(None)

    def recency(self) -> list[int]:
        return self._store.recency()

    def load_rows(self, n: int, inputs: Sequence[Any] | None) -> None:
        static = self._static
        with torch.no_grad():
            if inputs is not None:
                copy_into(static.views(n), list(inputs))
            copy_into(*static.tails(n))
        self._store.refill_next()  # the step may write rows: the next replay refills

    def warm_forward(self, size: int) -> tuple[Any, list[str] | None]:
        return self._capture.warm_forward(size)

    def synchronize(self) -> None:
        self._capture.backend().synchronize()

    def unpad(self, out: Any, inputs: Sequence[Any], rows: Sequence[Any], n: int) -> Any:
        store, specs = self._store, self._static.specs
        for i in store.writes.written(self.label) if inputs else []:
            inputs[i].copy_(rows[i].narrow(specs[i].batch_dim, 0, n))
        if rows and rows[0].shape[specs[0].batch_dim] == n:
            return out  # not padded: nothing to narrow
        return narrow_outputs(out, store.layout.dims, n, self.label)

    # ------------------------------------------------------------------ weights

    @property
    def weights(self) -> Weights:
        return self._reads.weights()

    @property
    def compiled(self) -> bool:
        return self._capture.parts.kind.compiled

    def derived_reads(self) -> tuple[tuple[str, ...], list[MovedWeight]]:
        return self._reads.derived()

    def refit_reads(self) -> RefitReads:
        return self._reads.refit_reads()

    def recapture_moved(self, found: WeightCheck, reason: str) -> CaptureReport | None:
        with self._guard.exclusive("recapture()"):
            return self._capture.recapture_moved(found, reason)

    # ------------------------------------------------------------------ beyond the Door

    @property
    def sizes(self) -> tuple[int, ...]:
        """The ladder: every size a batch may pad to, captured or not, ascending."""
        return self._store.ladder

    @property
    def serving(self) -> bool:
        """``capture()`` ran (graphs, or a lazy runner's stage) and ``release()`` did not."""
        return self._store.serving

    @property
    def graph_keys(self) -> tuple[GraphKey, ...]:
        """Every graph held, ``(size, piece)`` (piece None: a FULL graph)."""
        return self._store.graphs.graph_keys()

    @property
    def pad_table(self) -> PaddingTable:
        """What a batch pads to now (lazy: sizes not captured yet included)."""
        return self._store.pad

    @property
    def narrows(self) -> bool:
        """Whether a padded batch's outputs can be narrowed (the output layout is known)."""
        return self._store.layout.dims is not None

    @property
    def refusals(self) -> Mapping[int, tuple[str, str]]:
        """Sizes refused since the last ``capture()``: size -> (status, why)."""
        return self._store.refusals

    @property
    def specs(self) -> list[InputSpec]:
        """The inputs' specs (``static.specs``)."""
        return self._static.specs

    @property
    def state(self) -> StateSet | None:
        """The declared state (``state=``)."""
        return self._capture.parts.state

    @property
    def counters(self) -> ServingCounters:
        """The runner's serving counts (replays, eager calls, warmup calls, evictions)."""
        return self._store.counters

    def taken(self, size: int) -> list[tuple[int, int]] | None:
        """What the graphs of ``size`` take, as provenance read them (spans of the named
        storages, one byte per unnamed word); None when not read."""
        taken: list[tuple[int, int]] | None = self._reads.taken(size)
        return taken

    def capture_sizes(self, sizes: Sequence[int], *, how: str) -> CaptureReport:
        """Deprecated spelling of ``capture(sizes, how=...)`` (``graphguard.capture_sizes``
        is the ladder of sizes, not this)."""
        _renamed("capture_sizes(sizes, how=...)", "capture(sizes, how=...)")
        return self.capture(sizes, how=how)

    def evict(self, size: int) -> None:
        """Deprecated spelling of ``drop_size(size, evict=True)``."""
        _renamed("evict(size)", "drop_size(size, evict=True)")
        self.drop_size(size, evict=True)

    def _on_ladder(
        self, sizes: Any, how: str | None, *, what: str = "capture(sizes, how=...)"
    ) -> list[int]:
        """``sizes`` checked before anything runs: ints of the ladder (a size off it would
        be captured, hold memory, and never replay: no batch pads to it, ``stats()`` has
        no row for it), and ``how`` one of :data:`graphguard.capture.HOW`."""
        where = f"{self.label}: door.{what}"
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

    def _release_size(self, size: int, *, evict: bool) -> None:
        """Release ``size``'s graphs (evicted: captured again when met; dropped: gone
        until the next stage) and carry what free device memory says came back short of
        what the ledger charged them (:meth:`GraphLedger.released
        <graphguard.ledger.GraphLedger.released>`). When the pool goes with them the cache
        is emptied before the first read too, so what comes back is the pool's alone."""
        store, backend = self._store, self._capture.backend()
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


__all__ = ["LadderDoor"]
