"""The replay path of a runner: one :class:`~graphguard.entries.Entry` per batch size, the
fast path, the zero-copy path, and the slow path (errors, eager fallback).

``runner(*inputs)`` is one list index into the store's entries, one C-level compare of
every input's (shape, dtype, device) against what was captured, one countdown decrement
(the canary's trigger and the replay count), one fused copy into the static buffers, the
padded rows refilled only when the batch shrank, then the kind's ``_run``:
``graph.replay()`` and cached output views. Nothing on it allocates, synchronizes, locks
or logs. Everything else -- a batch above the ladder, a size not captured yet (lazy), a
mismatched input -- falls to the slow path.

Contract: outputs are views into memory the next call overwrites; a runner serves one
thread. Static buffers never require grad (their views are made under no_grad).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch

from graphguard.buffers import InputSpec, StaticInputs, raise_input_mismatch
from graphguard.canary import CanaryWatch
from graphguard.entries import Entry, copy_into, signature
from graphguard.errors import ConfigError, GraphGuardError
from graphguard.ladder.miss import Miss, not_serving
from graphguard.ladder.store import GraphStore
from graphguard.mode import Mode
from graphguard.serving import Door
from graphguard.sizes import PaddingTable, is_int

logger = logging.getLogger("graphguard")


class ReplayPath:
    """The serving half of a runner (:class:`~graphguard.ladder.Ladder`, the capture half,
    builds it): what a call does once the store holds entries. A batch with no entry goes
    to the runner's miss policy (:class:`~graphguard.ladder.miss.Miss`), which decides."""

    _kind = "Ladder"
    """The runner's class name in messages (``GraphRunner(decode)``)."""
    fn: Callable[..., Any]
    name: str
    mode: Mode
    specs: list[InputSpec]
    sizes: tuple[int, ...]
    static: StaticInputs

    door: Door
    """The runner's door (a replay whose input copy raised goes through it)."""

    def __init__(
        self,
        store: GraphStore,
        canary: CanaryWatch | None,
        miss: Miss,
        run: Callable[[Entry], Any],
    ) -> None:
        """Everything the replay path reads: the store's tables, the canary its countdown
        triggers, the miss policy, and ``run``, the runner kind's replay of an entry whose
        inputs and padded rows are in place (``graph.replay()`` and the output views)."""
        self._store = store
        self._canary = canary
        self._miss = miss
        self._run = run
        self._lead_dim = self.specs[0].batch_dim

    @property
    def captured_sizes(self) -> tuple[int, ...]:
        """Sizes that have a graph, ascending."""
        return self._store.table.sizes

    @property
    def max_size(self) -> int:
        """The largest captured size; batches above it run eagerly."""
        return self._store.table.max_size

    def padded_size(self, n: int) -> int | None:
        """The captured size a batch of ``n`` replays at, or None when it runs eagerly
        (lazy: the size it replays at once captured, unless that size was refused)."""
        store = self._store
        size = store.pad.padded(n)
        return size if size == n or store.layout.dims is not None else None

    def __call__(self, *inputs: Any) -> Any:
        """Run on a batch: replay the graph of the next captured size, or run eagerly.

        Returns views valid until the next call (see the class docstring).
        """
        store = self._store
        try:
            e = store.entries[inputs[0].shape[self._lead_dim]]
            ok = e is not None and list(map(signature, inputs)) == e.sig
        except (IndexError, AttributeError, TypeError, RuntimeError):  # RuntimeError: nested
            ok = False
        if not ok:
            return self._call_slow(inputs)
        assert e is not None
        e.countdown -= 1
        if not e.countdown:  # the canary's call (graphguard.canary); never without one
            return self._canary.call(e, inputs)  # type: ignore[union-attr]
        try:
            copy_into(e.dsts, inputs)
        except RuntimeError as exc:
            return self.door.replay_detached(inputs, exc)
        if store.dirty > e.n or store.refill_always:  # a larger batch's rows are left
            copy_into(e.tail_dsts, e.tail_srcs)
        store.dirty = e.n
        if e.writeback:
            out = self._run(e)
            store.writes.copy_back([inputs[i] for i in e.writeback], e, self.name)
            return out
        return self._run(e)

    def _refill_and_run(self, e: Entry) -> Any:
        """The replay of an entry whose inputs are in the static buffers: padded rows
        refilled when the batch shrank, then the kind's ``_run``."""
        store = self._store
        if store.dirty > e.n or store.refill_always:
            copy_into(e.tail_dsts, e.tail_srcs)
        store.dirty = e.n
        return self._run(e)

    def static_inputs(self, n: int) -> list[torch.Tensor]:
        """The zero-copy path, part 1: the static input rows for a batch of ``n`` (up to the
        largest captured size). Write the batch straight into them, then :meth:`replay`.
        Lazy: a size not captured is captured here, before the batch is written (a
        capture resets the buffers), unless it waits for its first call: then the rows
        are returned and the next :meth:`replay` is that first call."""
        if is_int(n) and self._miss.prepare(n) is not None:  # before the caller writes
            with torch.no_grad():  # as an entry's: a copy of a grad input raises
                return self.static.views(n)
        return self._entry(n).dsts

    def replay(self, n: int) -> Any:
        """The zero-copy path, part 2: replay a batch of ``n`` written into
        :meth:`static_inputs` (padded rows refilled when it shrank), outputs as
        :meth:`__call__`. ``n`` is an int from 1 to :attr:`max_size`, never a bool."""
        try:
            e = self._store.entries[n]
        except (IndexError, TypeError):
            e = None
        if e is None or n is True:  # one identity test; False finds entry 0 (None)
            return self._replay_slow(n)
        e.countdown -= 1
        if not e.countdown:
            return self._canary.call(e, None)  # type: ignore[union-attr]
        return self._refill_and_run(e)

    def _replay_slow(self, n: Any) -> Any:
        """``replay(n)`` with no entry: a lazy size's first call or capture, else the
        error saying why."""
        if is_int(n) and self.mode is not Mode.NONE:
            done, out = self._miss.replay(n)
            if done:
                return out
        e = self._entry(n, "replay")
        e.countdown -= 1
        if not e.countdown:
            return self._canary.call(e, None)  # type: ignore[union-attr]
        return self._refill_and_run(e)

    def _entry(self, n: Any, what: str = "static_inputs") -> Entry:
        """The entry of batch ``n`` (a lazy size captured now), or an error saying why
        there is none (slow path)."""
        if not is_int(n):
            raise ConfigError(
                f"{self.name}: {what}(n) takes a batch size, an int from 1 to "
                f"{self.max_size}, got {type(n).__name__} {n!r:.60}"
            )
        store = self._store
        e = store.entries[n] if 0 < n < len(store.entries) else None
        size = PaddingTable(self.sizes).padded(n) if n > 0 else None
        if e is None and size in store.refusals:
            status, why = store.refusals[size]
            raise GraphGuardError(
                f"{self.name}: {what}({n}): size {size} is {status} ({why}); runner(*inputs) "
                "runs such a batch eagerly"
            )
        if e is None:
            none = "none (released: call capture() again)" if store.released else None
            raise GraphGuardError(
                f"{self.name}: {what}({n}): no graph for a batch of {n}: captured sizes are "
                f"{list(self.captured_sizes) or none or 'none (call capture() first)'}; "
                f"batches above {self.max_size} must go through runner(*inputs), which runs "
                "them eagerly"
                + (
                    " (lazy: write the batch into static_inputs(n), or call capture_for(n) "
                    "first: replay(n) then runs the size's first call, or captures it)"
                    if store.lazy
                    else ""
                )
            )
        return e

    def _call_slow(self, inputs: tuple[Any, ...]) -> Any:
        """Validation errors and the not-captured-yet error; every other batch with no
        entry is the miss policy's."""
        raise_input_mismatch(inputs, self.specs, self.name)
        n = int(inputs[0].shape[self._lead_dim])
        store = self._store
        if self.mode is not Mode.NONE and not store.serving:
            raise not_serving(self.name, n, store.released)
        return self._miss.call(n, inputs)

    def capture_for(self, n: int) -> int | None:
        """The size a batch of ``n`` replays at, captured now if it is lazy and not yet
        (for the zero-copy path, before writing :meth:`static_inputs`; a size waiting for
        its first call is not captured: the next :meth:`replay` runs that call); None: it
        runs eagerly."""
        pending = self._miss.prepare(n)
        if pending is not None:
            return pending
        size = self._store.table.padded(n)
        return size if size is not None and self.padded_size(n) == size else None

    def __repr__(self) -> str:
        return (
            f"{self._kind}({self.name}, mode={self.mode.value}, sizes={len(self.sizes)} up to "
            f"{self.sizes[-1]}, captured={len(self._store.held())})"
        )


__all__ = ["ReplayPath"]
