"""Capture-safe auxiliary-stream fork/join, and the idle check before each capture.

Hazard: side-stream work across the capture boundary. Work forked onto a side stream
during an *uncaptured* warmup can still run (and own allocator blocks) when capture
begins; the allocator may then hand that memory to the graph being captured.

* :meth:`AuxStream.fork` runs the branch inline whenever
  :func:`graphguard.phase.overlap_allowed` is false (uncaptured warmups), there is
  no CUDA stream (CPU), or ``torch.compile`` is tracing it; otherwise it forks and joins
  with events (legal in capture).
* :func:`assert_streams_idle` (run by the lifecycle right before each capture) checks
  every live :class:`AuxStream` and every stream passed to :func:`watch_stream`.
  The registry is process-wide (streams are device-wide too) and thread-safe.
"""

from __future__ import annotations

import contextlib
import itertools
import threading
import weakref
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from typing import Any, Protocol

import torch

from graphguard import phase
from graphguard._device import parse_device
from graphguard.errors import BusyStreamError, ConfigError
from graphguard.sizes import is_int
from graphguard.stream_backend import CudaStreamBackend, StreamBackend


class StreamLike(Protocol):
    """What the idle check needs of a stream: ``torch.cuda.Stream`` satisfies it."""

    def query(self) -> bool:
        """True when all work queued on the stream has completed."""
        ...


_CUDA_BACKEND = CudaStreamBackend()
_BACKEND_OPS = [m for m in vars(StreamBackend) if not m.startswith("_")]


def fork_decision(*, overlap_allowed: bool, stream_available: bool) -> bool:
    """Whether a branch should really run on its auxiliary stream (else inline).

    Only when overlap is allowed by the phase (false during uncaptured warmups, so no
    side-stream work can cross the capture boundary) *and* a real stream exists.
    """
    return overlap_allowed and stream_available


# ---------------------------------------------------------------------- registry

# Each entry is (name, alive, getter): alive() returns the registered object or None
# once it is gone; getter() returns the stream or None. The references are weak with no
# callback, and dead entries are dropped whenever an entry is added or the streams are
# listed: a callback would run graphguard code inside the garbage collector, where a
# Ctrl-C (or pytest-xdist's SIGINT to a worker slow to exit) that arrives during a
# collection is raised, then swallowed as "Exception ignored in ... _drop".
# Re-entrant: watch_stream calls unwatch_stream while holding it.
_registry_lock = threading.RLock()
_registry: dict[int, tuple[str, Callable[[], Any], Callable[[], Any]]] = {}
_keys = itertools.count()


def forget_registered() -> None:
    """Forget every registered stream (:func:`graphguard.reset_process_state`)."""
    with _registry_lock:
        _registry.clear()


def _strong(obj: Any) -> Callable[[], Any]:
    return lambda: obj


def _drop_dead() -> None:
    """Remove the entries whose object is gone (call with the lock held)."""
    for key in [k for k, (_, alive, _) in _registry.items() if alive() is None]:
        del _registry[key]


def _add(
    name: str, target: Any, getter_of: Callable[[Callable[[], Any]], Callable[[], Any]]
) -> int:
    """Register ``target`` weakly (strongly if it cannot be); returns the entry's key."""
    ref: Callable[[], Any]
    try:
        ref = weakref.ref(target)
    except TypeError:
        ref = _strong(target)
    with _registry_lock:
        _drop_dead()
        key = next(_keys)
        _registry[key] = (name, ref, getter_of(ref))
        return key


def _is_queryable(stream: Any) -> bool:
    return callable(getattr(stream, "query", None))


def watch_stream(stream: Any, name: str | None = None) -> None:
    """Check ``stream`` for leftover work before every capture, like an :class:`AuxStream`.

    For side streams the model creates itself (``torch.cuda.Stream()``): graphguard
    cannot know of them, so work one still has queued when capture begins (the hazard
    "side-stream work across the capture boundary") would otherwise go unnoticed;
    watched, capture raises :class:`BusyStreamError` naming it instead. ``name``
    (default: the stream's repr) appears in that error. ``torch.cuda.Stream`` objects
    are held for the life of the process (torch never destroys its pooled streams);
    other objects weakly: watch the object you keep alive. Watching the same stream
    again renames it; stop with :func:`unwatch_stream`. The stream must have a
    ``query()`` method. Thread-safe. Prefer :class:`AuxStream` for new code: it is
    watched automatically and runs inline while overlap is unsafe.
    """
    if name is None:
        name = repr(stream)
    if not isinstance(name, str) or not name:
        raise ConfigError(
            f"watch_stream(stream, name): name must be a non-empty string (it names the "
            f"stream in BusyStreamError), got {type(name).__name__} {name!r:.60}"
        )
    if not _is_queryable(stream):
        raise ConfigError(
            f"watch_stream({name!r}): {type(stream).__name__} has no "
            "query() method, so whether it is idle before a capture cannot be checked. "
            "Pass a torch.cuda.Stream (or an object with query() -> bool)."
        )
    handle = _cuda_handle(stream)
    with _registry_lock:
        unwatch_stream(stream)
        if handle is not None:
            # torch.cuda.Stream wrappers must not be weakly referenced: on torch 2.11 a
            # weak reference to one outlived the wrapper and query() on it segfaulted
            # (seen on the H200). CUDA streams come from torch's fixed per-device pool
            # and are never destroyed, so a strong reference per distinct handle costs
            # nothing; re-watching the same handle replaces its entry.
            for key, (_, _, getter) in list(_registry.items()):
                if _cuda_handle(getter()) == handle:
                    del _registry[key]
            held = _strong(stream)
            _registry[next(_keys)] = (name, held, held)
            return
        _add(name, stream, lambda ref: ref)


def unwatch_stream(stream: Any) -> None:
    """Stop checking ``stream`` before captures (no error when it was not watched)."""
    with _registry_lock:
        for key, (_, _, getter) in list(_registry.items()):
            if getter() is stream:
                del _registry[key]


def _cuda_handle(stream: Any) -> tuple[Any, int] | None:
    """(device, raw stream handle) of a torch CUDA stream, else None."""
    raw = getattr(stream, "cuda_stream", None)
    if not isinstance(raw, int):
        return None
    return (getattr(stream, "device", None), raw)


def _register_aux(aux: AuxStream) -> None:
    """Track ``aux`` weakly; its stream is listed once created and while ``aux`` lives."""

    def getter_of(ref: Callable[[], Any]) -> Callable[[], Any]:
        def stream() -> Any:
            owner = ref()
            return None if owner is None else owner.stream

        return stream

    _add(aux.name, aux, getter_of)


def known_streams() -> list[tuple[str, StreamLike]]:
    """Every live known stream, in registration order, with its name.

    That is each stream passed to :func:`watch_stream` while it lives, and the
    stream of each live :class:`AuxStream` once created (on its first fork on a
    device with streams); an ``AuxStream`` that never forked cannot be busy. Streams
    of test or foreign backends without a ``query()`` method are left out.
    """
    with _registry_lock:
        _drop_dead()
        entries = list(_registry.values())
    out: list[tuple[str, StreamLike]] = []
    for name, _, getter in entries:
        stream = getter()
        if stream is not None and _is_queryable(stream):
            out.append((name, stream))
    return out


def busy_streams() -> list[str]:
    """Names of known streams that still have queued work (``query()`` is false).

    Call it outside capture: querying a stream that is being captured invalidates
    the capture.
    """
    busy = []
    for name, stream in known_streams():
        try:
            idle = stream.query()
        except Exception as exc:  # e.g. "invalid resource handle": a stream that is gone
            raise BusyStreamError(
                f"stream {name!r} ({stream!r:.80}) could not be queried, so whether it has "
                f"queued work is unknown: {type(exc).__name__}: {exc}. Was it destroyed or made "
                "in another CUDA context? Stop watching it: "
                "graphguard.streams.unwatch_stream(stream)."
            ) from exc
        if not idle:
            busy.append(name)
    return busy


def assert_streams_idle(where: str) -> None:
    """Raise :class:`BusyStreamError` if any known stream still has queued work.

    The runner calls it right before a capture begins (after synchronizing), with
    ``where`` such as ``"before capturing size 64"``.
    """
    busy = busy_streams()
    if not busy:
        return
    names = ", ".join(repr(n) for n in busy)
    raise BusyStreamError(
        f"{len(busy)} stream(s) still had queued work {where}: {names}. Work left on a "
        "side stream crosses the capture boundary and races the caching allocator: "
        "the memory it still uses can be handed to the graph being captured. "
        "To fix: synchronize the device (torch.cuda.synchronize()) after each "
        "uncaptured warmup and before capture begins, and do not overlap work on "
        "auxiliary streams while graphguard.phase.overlap_allowed() is False "
        "(AuxStream.fork() runs inline then; hand-rolled side streams must check it)."
    )


# ---------------------------------------------------------------------- fork/join

_branch = threading.local()


def current_branch() -> str | None:
    """The name of the :class:`AuxStream` whose :meth:`~AuxStream.fork` block this thread
    is in (inline or overlapped), or ``None`` on the main stream (also inside
    :meth:`Branch.on_main`). The sanitizer uses it to tell streams apart on the CPU and
    in the inline warmups, where every branch runs on one stream."""
    name: str | None = getattr(_branch, "name", None)
    return name


@contextlib.contextmanager
def _in_branch(name: str | None) -> Iterator[None]:
    prev = getattr(_branch, "name", None)
    _branch.name = name
    try:
        yield
    finally:
        _branch.name = prev


class Branch:
    """The handle a :meth:`AuxStream.fork` block gets.

    ``overlapped`` tells whether the block really ran on the auxiliary stream;
    ``stream`` is that stream (``None`` inline).
    """

    __slots__ = ("_backend", "_main", "_overlapped", "_stream")

    def __init__(self, *, overlapped: bool, stream: Any, main: Any, backend: StreamBackend) -> None:
        self._overlapped = overlapped
        self._stream = stream
        self._main = main
        self._backend = backend

    @property
    def overlapped(self) -> bool:
        """True when the branch ran on the auxiliary stream, false when it ran inline."""
        return self._overlapped

    @property
    def stream(self) -> Any:
        """The auxiliary stream the branch ran on, or ``None`` when it ran inline."""
        return self._stream

    def on_main(self) -> AbstractContextManager[Any]:
        """Run part of the block on the caller's stream, concurrently with the branch.

        The fork joins on exit, so work issued *after* the ``with`` block waits for the
        branch; main-stream work that should overlap it goes inside the block, under
        ``with br.on_main():``. Inline (no overlap) this is a no-op.
        """
        if not self._overlapped:
            return _in_branch(None)
        return _on_main(self._backend.use_stream(self._main))

    def keep(self, *tensors: torch.Tensor) -> None:
        """Declare tensors made on the aux stream that the caller reads after the join.

        Why: the caching allocator ties a block to the stream that allocated it. When
        such a tensor is later freed by main-stream code, the allocator would at once
        hand the block to the next auxiliary-stream allocation, racing main-stream
        kernels still queued to read it. ``record_stream(main)`` makes the allocator
        wait for the main stream's queued work before reusing it. No-op inline.
        """
        _check_tensors("keep", tensors)
        if not self._overlapped:
            return
        for tensor in tensors:
            self._backend.record_stream(tensor, self._main)


def _check_tensors(what: str, args: tuple[Any, ...]) -> None:
    """Refuse non-tensors at once: inline (the warmups) they would pass unnoticed."""
    for i, t in enumerate(args):
        if not isinstance(t, torch.Tensor):
            raise ConfigError(
                f"{what}(*tensors): argument {i} is {type(t).__name__} {t!r:.60}, not a "
                "tensor; pass the tensors the branch reads (fork) or makes (keep)"
            )


@contextlib.contextmanager
def _on_main(use: AbstractContextManager[Any]) -> Iterator[Any]:
    with use as stream, _in_branch(None):
        yield stream


class AuxStream:
    """A named auxiliary stream with a capture-safe :meth:`fork`.

    The stream is created lazily by the first :meth:`fork` on a device that has
    streams — even one that runs inline because overlap is off — so constructing an
    ``AuxStream`` never initializes CUDA, and the stream already exists before the
    first capture: graphguard's lifecycle always runs uncaptured warmups (inline) before
    capturing, and creating a stream while a graph is being captured is best avoided.

    Args:
        name: shown by :func:`busy_streams` and in :class:`BusyStreamError`.
        device: ``None`` means ``"cuda"`` when CUDA is available, else ``"cpu"`` (then
            every fork runs inline).
        priority: CUDA stream priority (lower is higher priority).
        backend: the stream operations; the default drives ``torch.cuda``. Tests pass
            a fake.
    """

    def __init__(
        self,
        name: str = "aux",
        device: torch.device | str | None = None,
        *,
        priority: int = 0,
        backend: StreamBackend | None = None,
    ) -> None:
        if not isinstance(name, str) or not name:
            raise ConfigError(
                "AuxStream(name=...) must be a non-empty string (it names the stream in "
                f"BusyStreamError and the sanitizer), got {type(name).__name__} {name!r:.60}"
            )
        if not is_int(priority):
            raise ConfigError(
                f"AuxStream {name!r}: priority must be an int (a CUDA stream priority: 0 is "
                f"the default, lower is higher, e.g. -1), got {type(priority).__name__} "
                f"{priority!r:.60}"
            )
        missing = [m for m in _BACKEND_OPS if not callable(getattr(backend, m, None))]
        if backend is not None and missing:
            raise ConfigError(f"AuxStream {name!r}: backend lacks {missing} (a StreamBackend)")
        self.name: str = name
        self.device: torch.device = parse_device(f"AuxStream {name!r}", device)
        self.priority: int = priority
        self._backend: StreamBackend = backend if backend is not None else _CUDA_BACKEND
        self._stream: Any = None
        self._lock = threading.Lock()
        _register_aux(self)

    @property
    def stream(self) -> Any:
        """The underlying stream, or ``None`` before the first fork on a device with streams."""
        return self._stream

    def _get_stream(self) -> Any:
        stream = self._stream
        if stream is None:
            with self._lock:
                if self._stream is None:
                    self._stream = self._backend.new_stream(self.device, self.priority)
                stream = self._stream
        return stream

    @contextlib.contextmanager
    def fork(self, *inputs: torch.Tensor) -> Iterator[Branch]:
        """Run the block on the auxiliary stream, joined back to the caller's stream on exit.

        ``inputs`` are tensors made on the caller's stream that the block reads. Why
        ``record_stream(aux)`` on them: if the caller drops its last reference while
        the branch still has kernels queued, the allocator would hand the block to a
        new main-stream tensor at once; recording the aux use makes it wait for them.
        Pass workspace views the branch uses here too.

        Fork: an event recorded on the caller's stream, which the aux stream waits on,
        so the branch sees everything queued before. Join (also when the block
        raises): an event recorded on the aux stream, which the caller's stream waits
        on, so later work sees the branch's results and a capture never ends with an
        unjoined side stream. Neither blocks the host, and both are legal while
        capturing a CUDA graph (the graph gets parallel branches).

        Inline (``overlapped=False``) when :func:`graphguard.phase.overlap_allowed`
        is false — the uncaptured warmups of graph construction — without CUDA, or
        while ``torch.compile`` traces the block (``torch.compiler.is_compiling()``).
        """
        backend = self._backend
        _check_tensors(f"AuxStream {self.name!r}: fork", inputs)
        if torch.compiler.is_compiling():
            # Dynamo cannot trace record_stream or event waits, and a fork decided by the
            # phase would recompile between warmup and capture: compiled code runs inline.
            yield Branch(overlapped=False, stream=None, main=None, backend=backend)
            return
        available = backend.available(self.device)
        if available and self._stream is None:
            self._get_stream()  # outside capture, during the inline warmups (see class doc)
        overlap = fork_decision(overlap_allowed=phase.overlap_allowed(), stream_available=available)
        if not overlap:
            with _in_branch(self.name):
                yield Branch(overlapped=False, stream=None, main=None, backend=backend)
            return
        aux = self._get_stream()
        main = backend.current_stream(self.device)
        backend.wait_event(aux, backend.record_event(main))
        for tensor in inputs:
            backend.record_stream(tensor, aux)
        branch = Branch(overlapped=True, stream=aux, main=main, backend=backend)
        try:
            with backend.use_stream(aux), _in_branch(self.name):
                yield branch
        finally:
            backend.wait_event(main, backend.record_event(aux))

    def __repr__(self) -> str:
        return f"AuxStream({self.name!r}, device={str(self.device)!r})"


__all__ = [
    "AuxStream",
    "Branch",
    "StreamLike",
    "assert_streams_idle",
    "busy_streams",
    "current_branch",
    "forget_registered",
    "fork_decision",
    "known_streams",
    "unwatch_stream",
    "watch_stream",
]
