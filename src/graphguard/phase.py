"""The capture-phase monitor: which part of the graph lifecycle this thread is in.

Model code needs to know whether it is being warmed up, captured or served, because
the right behaviour differs: auxiliary-stream overlap must be *off* during uncaptured
warmups (hazard: side-stream work across the capture boundary), and *on* while
capturing (the graph keeps the parallel branches) and serving.

The state has two layers:

* a process-wide *base* phase, ``EAGER`` until a runner finished capturing, then
  ``SERVING``;
* a per-thread (per-``contextvars`` context) *transient* phase set by the runner for
  the duration of profiling, warmup and capture. A background thread therefore never
  sees another thread's capture as its own.

The tripwire: graphguard captures only inside :func:`capture_window`. Any graphguard
component about to capture calls :func:`check_capture_allowed`, which raises
:class:`~graphguard.errors.CaptureTripwireError` outside the window, naming what tried.
"""

from __future__ import annotations

import contextlib
import contextvars
import enum
import threading
from collections.abc import Iterator
from dataclasses import dataclass

from graphguard.errors import CaptureTripwireError


class Phase(enum.Enum):
    """Where in the graph lifecycle the current thread is."""

    EAGER = "eager"
    """No graphs yet; ordinary eager execution."""
    PROFILING = "profiling"
    """A run made only to measure memory (eager profile run or a throwaway capture)."""
    WARMUP = "warmup"
    """An uncaptured warmup forward of graph construction."""
    CAPTURE = "capture"
    """Inside a CUDA graph capture."""
    SERVING = "serving"
    """Graphs are captured; calls replay them (or run eagerly past the largest size)."""


@dataclass(frozen=True)
class _Transient:
    phase: Phase
    profiling: bool
    owner: str
    first_call: bool = False


_base_lock = threading.Lock()
_base_phase: Phase = Phase.EAGER
_transient: contextvars.ContextVar[_Transient | None] = contextvars.ContextVar(
    "graphguard_phase", default=None
)
_window: contextvars.ContextVar[str | None] = contextvars.ContextVar(
    "graphguard_capture_window", default=None
)


def current_phase() -> Phase:
    """The phase of the calling thread (its transient phase, else the process base)."""
    t = _transient.get()
    return t.phase if t is not None else _base_phase


def is_capturing() -> bool:
    """True while this thread records a CUDA graph (real or profiling capture)."""
    t = _transient.get()
    return t is not None and t.phase is Phase.CAPTURE


def in_graph_preparation() -> bool:
    """True during graph construction: an uncaptured warmup or a capture."""
    t = _transient.get()
    return t is not None and t.phase in (Phase.WARMUP, Phase.CAPTURE)


def overlap_allowed() -> bool:
    """Whether model code may overlap work on auxiliary streams right now.

    False during the uncaptured warmups of graph construction, so no side-stream work
    can still be running when capture begins; true while capturing (the graph keeps
    the parallel branches), while serving, and in plain eager use.
    """
    t = _transient.get()
    return t is None or t.phase is not Phase.WARMUP


def is_profiling() -> bool:
    """True during a memory-measuring run; arenas are not locked after such a capture."""
    t = _transient.get()
    return t is not None and (t.profiling or t.phase is Phase.PROFILING)


def set_serving() -> None:
    """Mark the process as serving (called by the runner once its graphs exist)."""
    global _base_phase
    with _base_lock:
        _base_phase = Phase.SERVING


def reset() -> None:
    """Back to ``EAGER`` with no transient phase or window in this context (for tests)."""
    global _base_phase
    with _base_lock:
        _base_phase = Phase.EAGER
    _transient.set(None)
    _window.set(None)


def is_first_call() -> bool:
    """True during a lazy size's first call (:mod:`graphguard.lazy`): a WARMUP forward on
    a request's own inputs, whose result and writes are the request's. A step that treats
    a warmup as throwaway (sends its state writes to a scratch slot, say) must not here."""
    t = _transient.get()
    return t is not None and t.first_call


@contextlib.contextmanager
def enter(
    phase: Phase, *, owner: str = "graphguard", profiling: bool = False, first_call: bool = False
) -> Iterator[None]:
    """Set this thread's transient phase for the duration of the block (``first_call``:
    a WARMUP that is a lazy size's first call, :func:`is_first_call`)."""
    token = _transient.set(
        _Transient(phase, profiling or phase is Phase.PROFILING, owner, first_call)
    )
    try:
        yield
    finally:
        _transient.reset(token)


@contextlib.contextmanager
def capture_window(owner: str) -> Iterator[None]:
    """Open the window inside which this thread may capture graphs.

    ``owner`` names who opened it (shown in tripwire messages of nested misuse).
    """
    token = _window.set(owner)
    try:
        yield
    finally:
        _window.reset(token)


def capture_window_owner() -> str | None:
    """Who opened this thread's capture window, or None when it is closed."""
    return _window.get()


def check_capture_allowed(what: str) -> None:
    """Raise :class:`CaptureTripwireError` unless this thread is inside a capture window.

    ``what`` names the component and shape that tried to capture; it is the first
    thing the message says.
    """
    if _window.get() is None:
        raise CaptureTripwireError(
            f"{what} tried to capture a CUDA graph outside graphguard's capture window "
            f"(thread {threading.current_thread().name!r}, phase {current_phase().value}). "
            "A capture while serving freezes addresses the allocator and the workspace "
            "arenas may still move. Capture every shape up front with "
            "GraphRunner.capture(), or add this shape to the runner's sizes."
        )


__all__ = [
    "Phase",
    "capture_window",
    "capture_window_owner",
    "check_capture_allowed",
    "current_phase",
    "enter",
    "in_graph_preparation",
    "is_capturing",
    "is_first_call",
    "is_profiling",
    "overlap_allowed",
    "reset",
    "set_serving",
]
