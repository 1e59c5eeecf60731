"""The replay path a ladder serves with: one :class:`~graphguard.entries.Entry` per batch
size, the fast path, the zero-copy path, and the slow path (errors, eager fallback).

``runner(*inputs)`` is one list index, one C-level compare of every input's (shape, dtype,
device) against what was captured, one countdown decrement (the canary's trigger and the
replay count), one fused copy into the static buffers, then the subclass's ``_run``:
padded rows refilled only when the batch shrank, ``graph.replay()``, cached output views.
Nothing on it allocates, synchronizes, locks or logs. Everything else -- a batch above
the ladder, a size not captured yet (lazy), a mismatched input -- falls to the slow path.

Contract: outputs are views into memory the next call overwrites; a runner serves one
thread. Static buffers never require grad (their views are made under no_grad).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

import torch

from graphguard.autocast import AutocastPolicy, applied
from graphguard.buffers import InputSpec, InputWrites, StaticInputs, raise_input_mismatch
from graphguard.canary import CanaryWatch
from graphguard.config import CaptureOptions, Mode
from graphguard.entries import Entry, build_entries, copy_into, signature
from graphguard.errors import ConfigError, GraphGuardError
from graphguard.outputs import OutputLayout, narrow_outputs
from graphguard.sizes import PaddingTable, is_int
from graphguard.stats import ABOVE, ServingCounters

logger = logging.getLogger("graphguard")


class ReplayPath:
    """The serving half of :class:`~graphguard.ladder.Ladder`: what a call does once the
    entries exist. The ladder (the capture half, a subclass) sets every attribute below."""

    _kind: str
    fn: Callable[..., Any]
    name: str
    label: str
    mode: Mode
    options: CaptureOptions
    specs: list[InputSpec]
    sizes: tuple[int, ...]
    static: StaticInputs
    autocast_policy: AutocastPolicy | None
    _lead_dim: int
    _entries: list[Entry | None]
    _table: PaddingTable  # the captured sizes
    _pad: PaddingTable  # what a batch pads to (lazy: sizes not captured yet too)
    _layout: OutputLayout
    _writes: InputWrites
    _dirty: int  # rows past this may hold a larger batch's data: refill before replay
    _refill_always: bool
    _canary: CanaryWatch | None
    _counters: ServingCounters
    _refused: dict[int, tuple[str, str]]
    _written: list[int]  # the inputs the step writes in place (their rows copied back)
    _captured: bool
    _released: bool
    _eager_logged: set[int]
    _grad_logged: bool

    def _capture_lazily(self, n: int) -> bool:
        """Capture the size a batch of ``n`` pads to, when lazy (the ladder)."""
        return False

    @property
    def lazy(self) -> bool:
        """Whether sizes are captured on first use (``lazy=``, :mod:`graphguard.lazy`)."""
        return self.options.lazy is not None

    @property
    def captured_sizes(self) -> tuple[int, ...]:
        """Sizes that have a graph, ascending."""
        return self._table.sizes

    @property
    def max_size(self) -> int:
        """The largest captured size; batches above it run eagerly."""
        return self._table.max_size

    def padded_size(self, n: int) -> int | None:
        """The captured size a batch of ``n`` replays at, or None when it runs eagerly
        (lazy: the size it replays at once captured, unless that size was refused)."""
        size = self._pad.padded(n)
        return size if size == n or self._layout.dims is not None else None

    def unpad(self, out: Any, inputs: Sequence[Any], rows: Sequence[Any], n: int) -> Any:
        """For ``n`` rows run as a larger padded batch ``rows`` (DistributedGraphRunner's
        "pad"): written input rows copied back into ``inputs``, outputs narrowed to ``n``."""
        for i in self._writes.written(self.name) if self._table.sizes else []:
            inputs[i].copy_(rows[i].narrow(self.specs[i].batch_dim, 0, n))
        return narrow_outputs(out, self._layout.dims, n, self.name)

    def __call__(self, *inputs: Any) -> Any:
        """Run on a batch: replay the graph of the next captured size, or run eagerly.

        Returns views valid until the next call (see the class docstring).
        """
        try:
            e = self._entries[inputs[0].shape[self._lead_dim]]
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
            return self._copy_failed(inputs, exc)
        if e.writeback:
            return self._run_writing(e, inputs)
        return self._run(e)

    def _run_writing(self, e: Entry, inputs: tuple[Any, ...]) -> Any:
        """Replay a step that writes its inputs in place, then copy the written rows
        back into the caller's tensors (stream-ordered, no sync), as eager leaves them."""
        out = self._run(e)
        self._writes.copy_back([inputs[i] for i in e.writeback], e, self.name)
        return out

    def _run(self, e: Entry) -> Any:
        """Refill padded rows if the batch shrank, replay, return outputs (subclasses)."""
        raise NotImplementedError

    def static_inputs(self, n: int) -> list[torch.Tensor]:
        """The zero-copy path, part 1: the static input rows for a batch of ``n`` (up to the
        largest captured size). Write the batch straight into them, then :meth:`replay`."""
        return self._entry(n).dsts

    def replay(self, n: int) -> Any:
        """The zero-copy path, part 2: replay a batch of ``n`` written into
        :meth:`static_inputs` (padded rows refilled when it shrank), outputs as
        :meth:`__call__`. ``n`` is an int from 1 to :attr:`max_size`, never a bool."""
        try:
            e = self._entries[n]
        except (IndexError, TypeError):
            e = None
        if e is None or n is True:  # one identity test; False finds entry 0 (None)
            e = self._entry(n, "replay")
        e.countdown -= 1
        if not e.countdown:
            return self._canary.call(e, None)  # type: ignore[union-attr]
        return self._run(e)

    def _entry(self, n: Any, what: str = "static_inputs") -> Entry:
        """The entry of batch ``n`` (a lazy size captured now), or an error saying why
        there is none (slow path)."""
        if not is_int(n):
            raise ConfigError(
                f"{self.name}: {what}(n) takes a batch size, an int from 1 to "
                f"{self.max_size}, got {type(n).__name__} {n!r:.60}"
            )
        if what == "static_inputs":
            self._capture_lazily(n)  # before the caller writes: a capture resets the buffers
        e = self._entries[n] if 0 < n < len(self._entries) else None
        size = PaddingTable(self.sizes).padded(n) if n > 0 else None
        if e is None and size in self._refused:
            status, why = self._refused[size]
            raise GraphGuardError(
                f"{self.name}: {what}({n}): size {size} is {status} ({why}); runner(*inputs) "
                "runs such a batch eagerly"
            )
        if e is None:
            none = "none (released: call capture() again)" if self._released else None
            raise GraphGuardError(
                f"{self.name}: {what}({n}): no graph for a batch of {n}: captured sizes are "
                f"{list(self.captured_sizes) or none or 'none (call capture() first)'}; "
                f"batches above {self.max_size} must go through runner(*inputs), which runs "
                "them eagerly"
                + (
                    " (lazy: static_inputs(n) or capture_for(n) captures a size, before the "
                    "batch is written)"
                    if self.lazy
                    else ""
                )
            )
        return e

    def _copy_failed(self, inputs: tuple[Any, ...], exc: RuntimeError) -> Any:
        """The fused input copy raised: inputs that require grad are replayed detached."""
        grad = [s.name for s, x in zip(self.specs, inputs) if x.requires_grad]
        if not grad:
            raise_input_mismatch(inputs, self.specs, self.name)  # e.g. a sparse input
            raise exc
        if not self._grad_logged:
            self._grad_logged = True
            logger.warning(
                "%s: inputs %s require grad; a graph has no autograd, so graphguard replays "
                "on detached copies (outputs carry no autograd history). Call under "
                "torch.inference_mode() or pass detached tensors to silence this; logged once",
                self.name,
                grad,
            )
        return self(*(x.detach() for x in inputs))

    def _call_slow(self, inputs: tuple[Any, ...]) -> Any:
        """Validation errors, eager fallback, and the not-captured-yet error."""
        raise_input_mismatch(inputs, self.specs, self.name)
        n = int(inputs[0].shape[self._lead_dim])
        if self.mode is not Mode.NONE and not self._captured and self._released:
            raise GraphGuardError(
                f"{self.name}: called with batch size {n} after release(), which dropped "
                "every graph and its memory; call runner.capture() to capture again (or "
                "runner.eager(*inputs) to run the callable without graphs)"
            )
        if self.mode is not Mode.NONE and not self._captured:
            raise GraphGuardError(
                f"{self.name}: called with batch size {n} before capture(); call "
                "runner.capture() first (or build the runner with mode='none')"
            )
        if self.mode is not Mode.NONE and self._capture_lazily(n):
            return self(*inputs)  # its entry exists now
        reason = self._eager_reason(n)
        self._counters.eager_call(n, reason, self._entries)
        if n not in self._eager_logged:
            self._eager_logged.add(n)
            why = reason
            if reason == ABOVE:
                why = f"it is above the largest size of the ladder, {self.sizes[-1]}"
            logger.info(
                "%s: batch size %d runs eagerly (%s); logged once per size", self.name, n, why
            )
        return self.eager(*inputs)

    def _eager_reason(self, n: int) -> str:
        """Why a batch of ``n`` runs eagerly (:mod:`graphguard.stats` counts by it)."""
        if self.mode is Mode.NONE:
            return "mode is none"
        size = PaddingTable(self.sizes).padded(n)
        if size is None:
            return ABOVE
        if size in self._refused and self._pad.padded(n) not in self._table.sizes:
            return f"size {self._refused[size][0]}"
        if not self._table.sizes:
            return "no size captured"
        return "the output layout is unknown, so only captured sizes replay"

    def eager(self, *inputs: Any) -> Any:
        """The plain ``fn`` on the caller's tensors, under the graphs' autocast policy: no
        padding, no graph, never the compiled code (a batch above the ladder must not cost
        a recompile on tensors unlike the static buffers)."""
        with applied(self.autocast_policy):
            return self.fn(*inputs)

    def capture_for(self, n: int) -> int | None:
        """The size a batch of ``n`` replays at, captured now if it is lazy and not yet
        (for the zero-copy path, before writing :meth:`static_inputs`); None: it runs
        eagerly."""
        self._capture_lazily(n)
        size = self._table.padded(n)
        return size if size is not None and self.padded_size(n) == size else None

    def _graph_sizes(self) -> list[int]:
        """Sizes captured so far, from the subclass's own record (subclasses)."""
        raise NotImplementedError

    def _entry_parts(self, n: int, size: int) -> dict[str, Any]:
        """The kind-specific fields of the entry of batch ``n`` padded to ``size``."""
        raise NotImplementedError

    def _build_entries(self, added: int | None = None) -> None:
        """The replay path's entries, one per batch that replays. ``added``: the one size a
        lazy capture just added; when nothing else changed (the sizes a batch pads to, the
        inputs the step writes), only the batches that pad to it get new entries and every
        other entry stays as it was (its counters too): a lazy capture rebuilds a few
        entries, not the ladder's."""
        table = PaddingTable(sorted(self._graph_sizes()))
        written = self._writes.written(self.name) if table.max_size else []
        self._refill_always = self._refill_always or bool(written)
        batches = self._layout.entry_sizes(self.name, table.sizes)
        if self.lazy:  # pad along the ladder; a size not captured yet: no entry
            pad = PaddingTable([s for s in self.sizes if s not in self._refused])
            have = set(table.sizes)
            batches = [n for n in batches if pad.padded(n) in have]
        else:
            pad = table
        same = pad.sizes == self._pad.sizes and written == self._written
        if added is not None and same and len(self._entries) > 1:
            new = build_entries(
                pad, [n for n in batches if pad.padded(n) == added], self.static, written,
                self._entry_parts,
            )  # fmt: skip
            entries = list(self._entries)
            for n, e in enumerate(new):
                if e is not None:
                    entries[n] = e
        else:
            self._counters.harvest(self._entries)
            entries = build_entries(pad, batches, self.static, written, self._entry_parts)
        self._table, self._pad, self._written, self._entries = table, pad, written, entries
        if self._canary is not None:
            self._canary.arm(self._entries)

    def __repr__(self) -> str:
        return (
            f"{self._kind}({self.name}, mode={self.mode.value}, sizes={len(self.sizes)} up to "
            f"{self.sizes[-1]}, captured={len(self._graph_sizes())})"
        )

    # ------------------------------------------------- the door's replay half

    @property
    def pad_table(self) -> PaddingTable:
        """What a batch pads to now (lazy: the sizes not captured yet included)."""
        return self._pad

    @property
    def entries(self) -> Sequence[Entry | None]:
        """The replay path's entries, indexed by batch size (:mod:`graphguard.entries`)."""
        return self._entries

    @property
    def narrows(self) -> bool:
        """Whether a padded batch's outputs can be narrowed (the output layout is known)."""
        return self._layout.dims is not None

    def replay_entry(
        self, e: Entry, inputs: tuple[Any, ...] | None, *, refill: bool = False
    ) -> Any:
        """Replay entry ``e`` whose inputs are in the static buffers (the door's replay):
        ``inputs`` get the step's in-place writes back (None: the zero-copy path);
        ``refill``: every padded row is refilled before, and again at the next replay."""
        if refill:
            self._dirty = self.static.max_size
            try:
                return self._run(e)
            finally:
                self._dirty = self.static.max_size
        if inputs is not None and e.writeback:
            return self._run_writing(e, inputs)
        return self._run(e)

    def replay_detached(self, inputs: tuple[Any, ...], exc: RuntimeError) -> Any:
        """The call again on detached inputs after the fused copy raised ``exc``."""
        return self._copy_failed(inputs, exc)


__all__ = ["ReplayPath"]
