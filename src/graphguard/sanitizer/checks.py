"""The sanitizer's checks, a part of the runner: :class:`Sanitizer`.

``GraphRunner(..., sanitize=True)`` builds one :class:`Sanitizer` for itself and calls it
at each step of its lifecycle (capture, each watched forward, the rebuilt entries,
release); the replay path's run is chosen once, at construction: the kind's own, or
:meth:`Sanitizer.replay` around it. The runner stays a ``GraphRunner`` (a user's subclass
stays itself, its overrides under the checks). The dependency runs one way, runner ->
sanitizer, and only when sanitizing: this package never imports the runner, and with the
sanitizer off none of it is imported.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable, Sequence
from typing import Any, Protocol, TypeVar

import torch

from graphguard import phase, streams
from graphguard._sites import user_site
from graphguard._torch_compat import HAS_STORAGE_ALIAS
from graphguard.errors import (
    BusyStreamError,
    FreedStorageError,
    GraphCaptureError,
    ReboundTensorError,
    SanitizerError,
)
from graphguard.phase import Phase
from graphguard.sanitizer._common import FROM_WEAK, POISON, op_name
from graphguard.sanitizer.arenas import ArenaWatch
from graphguard.sanitizer.names import Binding, runner_names
from graphguard.sanitizer.stale import OutputGuard
from graphguard.sanitizer.storages import (
    CaptureRecorder,
    TrackedStorage,
    bindings_for,
    freed_message,
    rebound_message,
    track,
)
from graphguard.sanitizer.unsafe import WarmupMonitor, as_unsafe_sync, explicit_syncs_raise
from graphguard.workspace import Workspace

logger = logging.getLogger("graphguard")
_R = TypeVar("_R")


def capabilities() -> dict[str, str]:
    """What each check can do on this torch build (logged once when a sanitizer starts).

    Why it exists: the strongest checks lean on private torch APIs; a user debugging a
    hazard must know whether a check is at full strength or degraded, and why.
    """
    return {
        "stale_outputs": (
            "poisoned storages (torch._C._set_storage_data_ptr_access_error_msg)"
            if POISON is not None and HAS_STORAGE_ALIAS
            else "guard subclass (weaker: only torch functions are stopped; private "
            "storage-poisoning API missing on this torch build)"
        ),
        "freed_storage": (
            "freed, resized and moved storages"
            if FROM_WEAK is not None
            else "freed storages only (UntypedStorage._new_with_weak_ptr missing, so "
            "resized or moved storages are not seen)"
        ),
        "sync_debug": (
            "warmups: op list and explicit synchronize() on the warming thread only; "
            "capture: torch.cuda.set_sync_debug_mode('error')"
            if callable(getattr(torch.cuda, "set_sync_debug_mode", None))
            else "op list and explicit synchronize() only (set_sync_debug_mode missing)"
        ),
    }


_logged_caps = False
_caps_lock = threading.Lock()


def forget_capabilities_logged() -> None:
    """Log the capability line again at the next sanitizer start
    (``graphguard._process.reset_process_state``)."""
    global _logged_caps
    with _caps_lock:
        _logged_caps = False


def _log_capabilities_once() -> None:
    global _logged_caps
    with _caps_lock:
        if _logged_caps:
            return
        _logged_caps = True
    logger.info(
        "graphguard sanitizer on (torch %s): %s",
        torch.__version__,
        "; ".join(f"{k}: {v}" for k, v in capabilities().items()),
    )


class SanitizedRunner(Protocol):
    """What the sanitizer reads of the runner it watches (it never imports the runner)."""

    fn: Callable[..., Any]
    label: str
    specs: Any
    static: Any
    options: Any
    door: Any

    @property
    def graph_outputs(self) -> dict[int, list[Any]]: ...


class Sanitizer:
    """Every sanitizer check, as a part of one :class:`~graphguard.GraphRunner`.

    Chosen at construction by ``GraphRunner(..., sanitize=True)`` or
    ``GRAPHGUARD_SANITIZE=1`` (``runner.sanitize``); the runner stays a plain
    ``GraphRunner`` and calls this part at each step of its lifecycle:
    :meth:`capture` around a capture, :meth:`forward` for each warmup and captured
    forward, :meth:`rebuilt` once the replay entries are rebuilt, :meth:`release` when
    the graphs go, :meth:`replay` (chosen once, as the replay path's run) around each
    replay, :meth:`extra_reads` for ``check_weights()``. Off, none of it exists and the
    replay path carries no check at all. Slower on purpose: capture runs every op through
    a dispatch mode; each call checks the replayed graph's external storages (one
    weak-reference lookup each) and the named slots they were reached through (one dict
    or attribute lookup each: for a model, about one per parameter), and re-issues the
    outputs through guarded storages.
    """

    def __init__(self, runner: SanitizedRunner) -> None:
        self.runner = runner
        self.label = runner.label
        self._tracked: dict[int, list[TrackedStorage]] = {}
        self._bindings: dict[int, list[Binding]] = {}
        self._pending: dict[int, tuple[list[TrackedStorage], list[Binding]]] = {}
        self._arenas: list[Workspace] | None = None
        self._warm_streams: dict[int, Any] = {}
        self._calls = 0
        self._outputs = OutputGuard(self.label)
        _log_capabilities_once()

    # ------------------------------------------------------------------ capture

    def capture(self, run: Callable[[], _R]) -> _R:
        """``run()`` (the runner's capture) with recording on; a sanitizer finding is
        raised as itself.

        The lifecycle wraps any failure of a size in :class:`GraphCaptureError`; a
        sanitizer finding (unsafe op, busy stream, aliased arena) is the real
        diagnosis, so it is re-raised unwrapped (the capture error stays reachable as
        its context).
        """
        self._pending.clear()
        self._tracked.clear()
        self._bindings.clear()
        self._arenas = None
        try:
            return run()
        except GraphCaptureError as exc:
            if isinstance(exc.cause, (SanitizerError, BusyStreamError)):
                raise exc.cause from None
            raise

    def _known_arenas(self) -> list[Workspace]:
        """The runner's arenas plus those reachable from the callable (found once)."""
        if self._arenas is None:
            arenas = self.runner.options.workspaces or ()
            self._arenas = [*arenas, *runner_names(self.runner).arenas]
        return self._arenas

    def forward(self, *views: torch.Tensor) -> Any:
        """The user's forward (never a compiled step: its eager kernels are what is
        watched), watched: unsafe ops, streams and arenas in warmups; storages, bindings
        and arenas in capture.

        Only the user's callable runs under the checks; graphguard's own bookkeeping
        around it (input-write detection, output copies) is not inspected.
        """
        runner = self.runner
        specs = runner.specs
        size = int(views[0].shape[specs[0].batch_dim]) if views else 0
        dev = specs[0].device.type
        capturing = phase.is_capturing()
        if not capturing and phase.current_phase() is not Phase.WARMUP:
            return runner.fn(*views)  # e.g. the CPU emulation replaying the body
        when = "the capture" if capturing else "an uncaptured warmup"
        try:
            with contextlib.ExitStack() as stack:
                stack.enter_context(ArenaWatch(self.label, size, when, self._known_arenas()))
                if capturing:
                    names = runner_names(runner)
                    recorder = stack.enter_context(CaptureRecorder(self, size, dev, names))
                    out = runner.fn(*views)
                    tracked = recorder.finish()
                    if not phase.is_profiling():
                        self._pending[size] = (tracked, bindings_for(tracked, names))
                    return out
                stack.enter_context(WarmupMonitor(self, size, dev))
                if dev == "cuda" and torch.cuda.is_available():
                    stack.enter_context(explicit_syncs_raise(self.label, size))
                return runner.fn(*views)
        except RuntimeError as exc:
            converted = as_unsafe_sync(exc, self.label, size, when)
            if converted is exc:
                raise
            raise converted from exc

    def rebuilt(self) -> None:
        """The runner rebuilt its replay entries (a capture kept or dropped graphs): watch
        each graph's external storages and its own outputs from now on."""
        runner = self.runner
        names = runner_names(runner)
        tracked: dict[int, list[TrackedStorage]] = {}
        bindings: dict[int, list[Binding]] = {}
        for size, own in runner.graph_outputs.items():
            # Each graph's own outputs: with shared outputs they are non-owning views
            # whose blocks other graphs reuse, so another size's outputs are not this
            # graph's storages.
            # A size a partial recapture left alone keeps what its capture saw.
            items, slots = self._pending.get(size) or (
                self._tracked.get(size, []),
                self._bindings.get(size, []),
            )
            items = _untaken_rnn_states(list(items), runner.door.taken(size))
            seen = {t.data_ptr for t in items}
            for i, leaf in enumerate(own):
                if not isinstance(leaf, torch.Tensor):
                    continue
                t = track(leaf, None)
                if t is None or t.data_ptr in seen:
                    continue
                seen.add(t.data_ptr)
                t.name = names.by_ptr.get(t.data_ptr, f"static output leaf {i}")
                items.append(t)
            tracked[size] = items
            bindings[size] = list(slots)
        self._tracked = tracked
        self._bindings = bindings
        self._pending.clear()
        counts = {s: len(v) for s, v in sorted(tracked.items())}
        if counts:
            logger.info("%s: sanitizer watches %s external storages per size", self.label, counts)

    def note_stream(self, func: Any, size: int) -> None:
        """Register a stream that ran work during a warmup, so capture checks it is idle."""
        stream = torch.cuda.current_stream(self.runner.specs[0].device)
        key = int(stream.cuda_stream)
        if key in self._warm_streams:
            return
        known = {int(getattr(s, "cuda_stream", -1)) for _, s in streams.known_streams()}
        self._warm_streams[key] = stream  # keep alive: the registry holds it weakly
        if key in known:
            return
        streams.watch_stream(
            stream,
            f"stream {key:#x} (ran {op_name(func)} at {user_site()} during a warmup of "
            f"{self.label} size {size})",
        )

    def release(self) -> None:
        """The runner drops its graphs: outputs still held by the caller are poisoned
        (the pool is freed), and nothing is watched any more."""
        self._outputs.invalidate(f"{self.label}.release() freed the graphs and their memory pool")
        self._tracked = {}
        self._bindings = {}

    # ------------------------------------------------------------------ checks

    def extra_reads(self) -> dict[tuple[int, int | None], set[int]]:
        """Per graph, the storages it was seen using at capture (``check_weights`` reads
        it, beside what provenance reads from the graph itself when it is on)."""
        return {(size, None): {t.data_ptr for t in items} for size, items in self._tracked.items()}

    def watched_storages(self, size: int) -> list[TrackedStorage]:
        """The external storages the size-``size`` graph was seen using at capture."""
        return list(self._tracked.get(size, ()))

    def check_storages(self, sizes: Sequence[int] | None = None) -> None:
        """Raise if a graph's storages changed since capture: :class:`FreedStorageError`
        (freed, resized, moved) or :class:`ReboundTensorError` (a named slot such as
        ``module.weight`` now holds another tensor); ``sizes`` None: every captured size."""
        for size in sorted(self._tracked) if sizes is None else sizes:
            problems = [(t, p) for t in self._tracked.get(size, ()) for p in [t.problem()] if p]
            if problems:
                raise FreedStorageError(freed_message(self.label, size, problems))
            rebound = [b for b in self._bindings.get(size, ()) if b.rebound()]
            if rebound:
                raise ReboundTensorError(
                    rebound_message(self.label, size, rebound), path=rebound[0].path
                )

    # ------------------------------------------------------------------ replay

    def replay(self, run: Callable[[Any], Any]) -> Callable[[Any], Any]:
        """The replay path's run with the checks around the kind's ``run`` (both replay
        paths, ``runner(*inputs)`` and ``replay(n)``, end there): check the graph's
        storages, replay, poison the previous outputs, guard the new ones."""
        check, outputs, options = self.check_storages, self._outputs, self.runner.options

        def checked(e: Any) -> Any:
            size = int(e.size)
            check((size,))
            out = run(e)
            self._calls += 1
            what = f"call #{self._calls} (batch {e.n}, replaying the size-{size} graph)"
            outputs.invalidate(f"{self.label} {what} has since replayed into the same memory")
            if options.copy_outputs:
                return out
            return outputs.guard(out, what)

        return checked


def _untaken_rnn_states(
    items: list[TrackedStorage], taken: list[tuple[int, int]] | None
) -> list[TrackedStorage]:
    """``items`` without cuDNN's RNN dropout state when the graph provably does not take it.

    ``_cudnn_rnn`` is handed torch's per-device cached dropout state on every call, but
    cuDNN reads it only with dropout active (train mode, ``dropout > 0``); torch re-creates
    that buffer after any reseed (``manual_seed``, ``set_state``, ``set_offset``: the
    capture lifecycle's own restore among them). Tracked because the op took it, it was a
    ``FreedStorageError`` for graphs that never read it. Provenance (read at capture under
    the sanitizer) proves from the graph's kernel arguments whether it is taken; only this
    op's state is dropped on that proof: elsewhere a kernel may read through a pointer
    table in device memory, which no kernel argument shows."""
    if taken is None:
        return items
    kept = []
    for t in items:
        if t.name is None and t.op == "aten._cudnn_rnn":
            lo, hi = t.data_ptr, t.data_ptr + t.nbytes
            if not any(a < hi and lo < b for a, b in taken):
                continue
        kept.append(t)
    return kept


__all__ = ["Sanitizer", "capabilities"]
