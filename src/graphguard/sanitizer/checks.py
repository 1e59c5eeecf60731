"""The sanitizer's checks, mixed into a runner class: :class:`Sanitizing`.

``GraphRunner(..., sanitize=True)`` builds ``sanitizing(type(self))``: the runner's own
class with :class:`Sanitizing` first in its bases, made once per class. The mixin
overrides the runner's capture hooks (``capture``, ``_forward``, ``_rebuild``,
``_run``, ``release``) and nothing on the plain runner's replay path. The dependency runs
one way, runner -> sanitizer, and only when sanitizing: this package never imports the
runner, and with the sanitizer off none of it is imported. A user's subclass of
``GraphRunner`` is sanitized the same way (its overrides sit below the checks).
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Sequence
from typing import Any, TypeVar

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


class Sanitizing:
    """Every sanitizer check, for a :class:`~graphguard.GraphRunner` class to mix in.

    Mixed in by ``GraphRunner(..., sanitize=True)`` or ``GRAPHGUARD_SANITIZE=1``
    (:func:`sanitizing`); a separate class so the plain runner's replay path carries no
    check at all. It reads the runner's attributes (``fn``, ``specs``, ``options``,
    ``_set``) and calls the runner's own hooks through ``super()``. Slower on purpose:
    capture runs every op through a dispatch mode; each call checks the replayed
    graph's external storages (one weak-reference lookup each) and the named slots
    they were reached through (one dict or attribute lookup each: for a model, about
    one per parameter), and re-issues the outputs through guarded storages.
    """

    # The runner's attributes this mixin reads (it never imports the runner).
    fn: Any
    name: str
    label: str
    specs: Any
    options: Any
    graph_outputs: dict[int, list[Any]]
    door: Any

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._tracked: dict[int, list[TrackedStorage]] = {}
        self._bindings: dict[int, list[Binding]] = {}
        self._pending: dict[int, tuple[list[TrackedStorage], list[Binding]]] = {}
        self._arenas: list[Workspace] | None = None
        self._warm_streams: dict[int, Any] = {}
        self._calls = 0
        self._outputs = OutputGuard(self.label)
        _log_capabilities_once()

    # ------------------------------------------------------------------ capture

    def capture(self) -> Any:
        """Capture with recording on; a sanitizer finding is raised as itself.

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
            return super().capture()  # type: ignore[misc]
        except GraphCaptureError as exc:
            if isinstance(exc.cause, (SanitizerError, BusyStreamError)):
                raise exc.cause from None
            raise

    def _known_arenas(self) -> list[Workspace]:
        """The runner's arenas plus those reachable from the callable (found once)."""
        if self._arenas is None:
            self._arenas = [*(self.options.workspaces or ()), *runner_names(self).arenas]
        return self._arenas

    def _forward(self, *views: torch.Tensor) -> Any:
        """The user's forward, watched: unsafe ops, streams and arenas in warmups;
        storages, bindings and arenas in capture.

        Only the user's callable runs under the checks; graphguard's own bookkeeping
        around it (input-write detection, output copies) is not inspected.
        """
        size = int(views[0].shape[self.specs[0].batch_dim]) if views else 0
        dev = self.specs[0].device.type
        capturing = phase.is_capturing()
        if not capturing and phase.current_phase() is not Phase.WARMUP:
            return self.fn(*views)  # e.g. the CPU emulation replaying the body
        when = "the capture" if capturing else "an uncaptured warmup"
        try:
            with contextlib.ExitStack() as stack:
                stack.enter_context(ArenaWatch(self.label, size, when, self._known_arenas()))
                if capturing:
                    names = runner_names(self)
                    recorder = stack.enter_context(CaptureRecorder(self, size, dev, names))
                    out = self.fn(*views)
                    tracked = recorder.finish()
                    if not phase.is_profiling():
                        self._pending[size] = (tracked, bindings_for(tracked, names))
                    return out
                stack.enter_context(WarmupMonitor(self, size, dev))
                if dev == "cuda" and torch.cuda.is_available():
                    stack.enter_context(explicit_syncs_raise(self.label, size))
                return self.fn(*views)
        except RuntimeError as exc:
            converted = as_unsafe_sync(exc, self.label, size, when)
            if converted is exc:
                raise
            raise converted from exc

    def _rebuild(self, added: int | None = None) -> None:
        super()._rebuild(added)  # type: ignore[misc]
        names = runner_names(self)
        tracked: dict[int, list[TrackedStorage]] = {}
        bindings: dict[int, list[Binding]] = {}
        for size, own in self.graph_outputs.items():
            # Each graph's own outputs: with shared outputs they are non-owning views
            # whose blocks other graphs reuse, so another size's outputs are not this
            # graph's storages.
            # A size a partial recapture left alone keeps what its capture saw.
            items, slots = self._pending.get(size) or (
                self._tracked.get(size, []),
                self._bindings.get(size, []),
            )
            items = _untaken_rnn_states(list(items), self.door.taken(size))
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

    def _note_stream(self, func: Any, size: int) -> None:
        """Register a stream that ran work during a warmup, so capture checks it is idle."""
        stream = torch.cuda.current_stream(self.specs[0].device)
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
        """Drop the graphs; outputs still held by the caller are poisoned (pool freed)."""
        self._outputs.invalidate(f"{self.label}.release() freed the graphs and their memory pool")
        super().release()  # type: ignore[misc]
        self._tracked = {}
        self._bindings = {}

    # ------------------------------------------------------------------ checks

    def _extra_reads(self) -> dict[tuple[int, int | None], set[int]]:
        """Per graph, the storages it was seen using at capture (``check_weights`` reads
        it, beside what provenance reads from the graph itself when it is on)."""
        return {(size, None): {t.data_ptr for t in items} for size, items in self._tracked.items()}

    def watched_storages(self, size: int) -> list[TrackedStorage]:
        """The external storages the size-``size`` graph was seen using at capture."""
        return list(self._tracked.get(size, ()))

    def check_storages(self, sizes: Sequence[int] | None = None) -> None:
        """Raise if a graph's storages changed since capture: :class:`FreedStorageError`
        (freed, resized, moved) or :class:`ReboundTensorError` (a named slot such as
        ``module.weight`` now holds another tensor).

        Runs automatically before each replay (for the replayed size); call it with no
        argument to check every captured size, e.g. after reloading weights.
        """
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

    def _run(self, e: Any) -> Any:
        """Both replay paths (``runner(*inputs)`` and ``replay(n)``) end here: check the
        graph's storages, replay, poison the previous outputs, guard the new ones."""
        size = int(e.size)
        self.check_storages((size,))
        out = super()._run(e)  # type: ignore[misc]
        self._calls += 1
        what = f"call #{self._calls} (batch {e.n}, replaying the size-{size} graph)"
        self._outputs.invalidate(f"{self.label} {what} has since replayed into the same memory")
        if self.options.copy_outputs:
            return out
        return self._outputs.guard(out, what)


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


_C = TypeVar("_C", bound=type)
_SANITIZING: dict[type, type] = {}
_SANITIZING_LOCK = threading.Lock()


def sanitizing(cls: _C) -> _C:
    """``cls`` with :class:`Sanitizing` mixed in first (made once per class; a class that
    already has the checks is returned as is). ``GraphRunner`` becomes
    ``SanitizingGraphRunner``, a user's ``MyRunner`` becomes ``SanitizingMyRunner``."""
    if issubclass(cls, Sanitizing):
        return cls
    with _SANITIZING_LOCK:
        made = _SANITIZING.get(cls)
        if made is None:
            made = type(
                f"Sanitizing{cls.__name__}",
                (Sanitizing, cls),
                {"__module__": cls.__module__, "__doc__": cls.__doc__},
            )
            _SANITIZING[cls] = made
    return made  # type: ignore[return-value]


__all__ = ["Sanitizing", "capabilities", "sanitizing"]
