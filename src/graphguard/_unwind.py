"""Recovering from a failed CUDA-graph capture on torch 2.11, the capture sync guard, DOT dumps.

Quarantined here because it leans on torch internals: :func:`abort_capture` unwinds a
capture whose body raised (pool routing, generator capture state) so later captures
and eager RNG still work; :func:`sync_debug_error` makes a host synchronization raise
*before* it reaches CUDA (so the capture ends cleanly); :func:`dump_dot` writes a
captured graph as Graphviz DOT. Every step is feature-detected and logged at DEBUG.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import warnings
from collections.abc import Iterator, Sequence
from typing import Any

import torch

_log = logging.getLogger("graphguard")

# (device, pool the lifecycle passed) -> the fresh pool used instead; see abort_capture.
_POOL_STAND_INS: dict[tuple[torch.device, Any], Any] = {}


def forget_pool_stand_ins() -> None:
    """Forget the stand-ins of unusable pools (:func:`graphguard.reset_process_state`)."""
    _POOL_STAND_INS.clear()


# Graphs of aborted captures, kept alive on purpose (never reset); see abort_capture.
_ABANDONED_GRAPHS: list[Any] = []


def abandoned_graphs() -> int:
    """How many graphs of aborted captures this process keeps alive (see abort_capture)."""
    return len(_ABANDONED_GRAPHS)


def live_pool(device: torch.device, pool: Any) -> Any:
    """``pool``, or the fresh pool standing in for it after it was left unusable."""
    if pool is None or not _POOL_STAND_INS:
        return pool
    try:
        return _POOL_STAND_INS.get((device, pool), pool)
    except TypeError:  # an unhashable handle was never replaced
        return pool


@contextlib.contextmanager
def sync_debug_error() -> Iterator[None]:
    """``torch.cuda.set_sync_debug_mode("error")`` for the block, the previous mode after.

    ``.item()`` reaches ``c10::cuda::memcpy_and_sync``, which calls
    ``warn_or_error_on_sync()`` before ``cudaMemcpyAsync``/``cudaStreamSynchronize``
    (likewise ``stream_synchronize`` and ``device_synchronize``). In "error" mode that
    raises a RuntimeError while the capture is still valid, so ``capture_end`` can run
    its whole unwind instead of throwing on an invalidated capture.

    graphguard's one sync-debug guard, used only around a real capture: the mode is
    process-wide, so a synchronize by another thread during the capture raises too
    (under the default "global" capture mode it would have invalidated the capture
    anyway). A lazy capture while other threads serve runs without it
    (``CapturePlan.sync_guard``): a host sync in its step still fails the capture, as
    CUDA refuses it and the capture is unwound as invalidated. Uncaptured warmups, where
    other threads may synchronize freely, use the sanitizer's thread-local checks instead
    (:mod:`graphguard.sanitizer.unsafe`).
    """
    get = getattr(torch.cuda, "get_sync_debug_mode", None)
    set_ = getattr(torch.cuda, "set_sync_debug_mode", None)
    prev: Any = None
    armed = False
    if callable(get) and callable(set_):
        try:
            prev = get()
            if prev != 2:  # 2 == "error" already
                _quiet_set_sync_debug_mode(set_, "error")
                armed = True
        except Exception as err:  # a missing guard only loses the early error
            _log.debug("capture: sync debug mode not set (%s)", err)
    try:
        yield
    finally:
        if armed:
            try:
                _quiet_set_sync_debug_mode(set_, prev)  # type: ignore[arg-type]
            except Exception as err:
                _log.debug("capture: could not restore sync debug mode %r (%s)", prev, err)


def _quiet_set_sync_debug_mode(set_mode: Any, mode: Any) -> None:
    """``set_mode(mode)`` without torch's "Synchronization debug mode is a prototype
    feature" warning: graphguard arms the mode itself, around its own capture, so the
    notice (a ``TORCH_WARN_ONCE`` in the first call of the process) tells the user nothing.
    """
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Synchronization debug mode is a prototype")
        set_mode(mode)


def abort_capture(
    graph: Any,
    device: torch.device,
    stream: Any,
    pool: Any,
    requested_pool: Any,
    label: Any,
    exc: BaseException,
    generators: Sequence[Any] = (),
) -> None:
    """Unwind a capture whose body raised, so later captures and eager RNG still work.

    ``CUDAGraph::capture_end`` (torch 2.11) runs ``AT_CUDA_CHECK(cudaStreamEndCapture)``
    first and only then erases the capture id, calls the device allocator's
    ``endAllocateToPool``, the pinned-host allocator's ``end_allocate_to_pool`` and each
    generator state's ``capture_epilogue``. On an invalidated capture the check throws
    and all of that is skipped: the pool stays "recording" in both allocators (the next
    ``capture_begin`` into it fails with "beginAllocateToPool: already recording to
    mempool_id") and the default CUDA generator stays in capture mode (eager RNG fails
    with "Offset increment outside graph capture encountered unexpectedly"). ``reset()``
    undoes none of it. Newer torch ends the pool routing even on failure (pytorch#180395)
    and keeps RNG capture state per capture id (no stuck flag).

    Order: (1) ``capture_end``: when the capture is still valid (the sync guard raised
    first) this is the whole, clean unwind. Otherwise (2) end the device pool routing
    by hand; when that succeeds this torch skipped both allocators' end calls, and the
    host side has no Python binding, so the pool cannot be captured into again: later
    captures asked for it get a fresh stand-in pool. (3) One empty capture on a fresh
    private pool runs ``capture_prologue``/``capture_epilogue`` on the default
    generator, clearing its stuck capture flag (seed and offset untouched).

    The aborted graph is never reset or freed: its ``capture_begin`` took a reference
    on the pool, and ``reset`` (torch releases it there after a completed
    ``capture_end``, newer torch after a failed one too) would drop the pool to zero
    users when this was its first capture -- the next ``capture_begin`` into it then
    fails ``TORCH_INTERNAL_ASSERT(use_count > 0)`` until ``empty_cache`` happens to
    free every block. Kept alive it also keeps valid the ``this`` that the host
    allocator's leftover routing filter captured (torch 2.11), and ``reset``'s
    ``clearCublasWorkspacesForStream`` never runs on the shared capture stream. The
    cost is one graph object and one pool reference per failed capture. Every step is
    feature-detected, suppressed and logged at DEBUG.
    """
    tag = f"capture {label!r}" if label is not None else "capture"
    _note_refused_sync(exc)
    _ABANDONED_GRAPHS.append(graph)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "The CUDA Graph is empty" and the like
            graph.capture_end()
    except Exception as err:  # the body's error is the one reported
        _log.debug("%s: capture_end raised on abort (%s); unwinding by hand", tag, err)
    else:
        _log.debug("%s: aborted cleanly (capture_end unwound it; graph kept, not reset)", tag)
        return
    still_capturing = _still_capturing(tag)
    _stand_in_for_unusable_pool(device, pool, requested_pool, tag)
    if still_capturing:
        return
    _settle_generators(device, stream, tag, generators)


def _note_refused_sync(exc: BaseException) -> None:
    """Say in ``exc`` that the sync guard refused a host synchronization before CUDA saw
    it (the capture was ended cleanly)."""
    if "synchronizing CUDA operation" in str(exc) and callable(getattr(exc, "add_note", None)):
        with contextlib.suppress(Exception):
            exc.add_note(  # type: ignore[attr-defined]
                "graphguard: the host synchronization was refused before it reached CUDA "
                "(sync debug mode 'error' during capture), and the capture was ended cleanly."
            )


def _still_capturing(tag: str) -> bool:
    """Whether the capture stream is still capturing after a failed ``capture_end``
    (warned: later captures on it will fail)."""
    still_capturing = False
    with contextlib.suppress(Exception):
        still_capturing = bool(torch.cuda.is_current_stream_capturing())
    if still_capturing:
        _log.warning(
            "%s: the capture stream is still capturing after a failed capture_end; "
            "later captures on it will fail",
            tag,
        )
    return still_capturing


def _stand_in_for_unusable_pool(
    device: torch.device, pool: Any, requested_pool: Any, tag: str
) -> None:
    """End the device pool routing torch left on; when this did, the pool cannot be
    captured into again: later captures asked for ``requested_pool`` get a fresh one."""
    if _end_pool_routing(device, pool):
        stand_in = None
        with contextlib.suppress(Exception):
            stand_in = torch.cuda.graph_pool_handle()
        if stand_in is not None and requested_pool is not None:
            try:
                _POOL_STAND_INS[(device, requested_pool)] = stand_in
            except TypeError:
                stand_in = None
        _log.debug(
            "%s: this torch skipped capture_end's pool unwind; later captures into pool "
            "%r use fresh pool %r (the pinned-host allocator still records into the old one)",
            tag,
            pool,
            stand_in,
        )
    else:
        _log.debug("%s: torch had already ended the pool routing", tag)


def _settle_generators(
    device: torch.device, stream: Any, tag: str, generators: Sequence[Any] = ()
) -> None:
    """Run one empty capture so registered generator states leave capture mode
    (the default generator, and the step's ``generators``, registered with it too).

    ``capture_begin`` registers the default CUDA generator and calls its
    ``capture_prologue``; ``capture_end`` calls ``capture_epilogue``, which clears the
    ``capturing_`` flag an invalidated capture left set (torch 2.11). Seed and offset
    are not changed (the empty graph increments nothing). On newer torch (RNG capture
    state per capture id) this is a harmless empty capture. It uses its own private
    pool (no blocks) and is kept, not reset, so no ``reset`` side effect
    (``clearCublasWorkspacesForStream``) touches the shared capture stream.
    """
    try:
        settle = torch.cuda.CUDAGraph()
        _ABANDONED_GRAPHS.append(settle)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "The CUDA Graph is empty"
            with torch.cuda.device(device), torch.cuda.stream(stream):
                for g in generators:
                    settle.register_generator_state(g)
                settle.capture_begin(capture_error_mode="thread_local")
                settle.capture_end()
        _log.debug("%s: generator capture state settled by an empty capture", tag)
    except Exception as err:
        _log.debug("%s: could not settle generator capture state (%s)", tag, err)


def _end_pool_routing(device: torch.device, pool: Any) -> bool:
    """After a failed capture, stop routing the device allocator into ``pool``.

    True when this ended it, i.e. torch's ``capture_end`` had skipped its pool unwind
    (torch 2.11: it throws at ``cudaStreamEndCapture`` before ``endAllocateToPool``).
    False when there was nothing to end (newer torch ends it even on failure; the call
    then raises "not currently recording", suppressed) or no binding/pool. Never calls
    ``_cuda_releasePool``: torch versions that release the pool on reset would then
    release it twice, and a leaked reference on a shared pool is harmless.
    """
    if pool is None:
        return False
    index = device.index if device.index is not None else torch.cuda.current_device()
    for name in ("_cuda_endAllocateToPool", "_cuda_endAllocateCurrentStreamToPool"):
        end = getattr(torch._C, name, None)
        if not callable(end):
            continue
        try:
            end(index, tuple(pool) if isinstance(pool, list) else pool)
        except Exception as err:
            _log.debug("%s(%s, %r): %s", name, index, pool, err)
            return False
        _log.debug("%s(%s, %r): ended the leftover pool routing", name, index, pool)
        return True
    _log.debug("no endAllocateToPool binding in this torch; pool routing left as is")
    return False


def new_graph(*, keep: bool) -> torch.cuda.CUDAGraph:
    """A graph; ``keep`` keeps the un-instantiated ``cudaGraph_t`` (for DOT dumps)."""
    if keep:
        try:
            return torch.cuda.CUDAGraph(keep_graph=True)
        except TypeError:  # torch without keep_graph
            pass
    return torch.cuda.CUDAGraph()


def dump_dot(graph: torch.cuda.CUDAGraph, path: str) -> None:
    """Write ``graph`` as Graphviz DOT: ``CUDAGraph.debug_dump``, else ``cudaGraphDebugDotPrint``
    through ctypes on ``raw_cuda_graph()`` (seen on torch 2.11: debug_dump wrote nothing)."""
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with contextlib.suppress(Exception):
        graph.debug_dump(path)
    if os.path.exists(path):
        return
    raw = getattr(graph, "raw_cuda_graph", None)
    cudart = _cudart()
    if raw is None or cudart is None:
        _log.warning("no DOT dump of graph %s: this torch exposes no raw graph handle", path)
        return
    rc = cudart.cudaGraphDebugDotPrint(ctypes.c_void_p(raw()), path.encode(), ctypes.c_uint(1))
    if rc != 0:
        _log.warning("cudaGraphDebugDotPrint(%s) returned CUDA error %d", path, rc)


def _cudart() -> Any:
    """The CUDA runtime library torch loaded (found through this process's mappings)."""
    try:
        with open("/proc/self/maps") as maps:
            paths = {line.split()[-1] for line in maps if "libcudart" in line}
        for lib in sorted(paths):
            return ctypes.CDLL(lib)
    except OSError:
        pass
    return None


__all__ = [
    "abandoned_graphs",
    "abort_capture",
    "dump_dot",
    "forget_pool_stand_ins",
    "live_pool",
    "new_graph",
    "sync_debug_error",
]
