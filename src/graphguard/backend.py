"""The small protocol between the capture lifecycle and the device.

The lifecycle (warmup, synchronize, capture, largest first, one pool) is the product;
keeping the device behind one small protocol lets the same loop run against real CUDA graphs
and against :class:`RecordingBackend`, which emulates capture and replay on the CPU
and records every synchronize, capture begin/end and replay (:mod:`graphguard.recording`,
re-exported here). CI proves the lifecycle order with it on machines without a GPU.

We drive ``torch.cuda.CUDAGraph.capture_begin/capture_end`` directly instead of the
``torch.cuda.graph`` context manager because that one runs
``torch.cuda.empty_cache()`` on every entry (and ``gc.collect()`` under
``force_cudagraph_gc``): ``empty_cache`` hands cached blocks back to the driver only for
the next warmup to ``cudaMalloc`` them again. The lifecycle pauses the collector for the
whole loop instead.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch

from graphguard import _graph_args, streams
from graphguard._unwind import abort_capture, dump_dot, live_pool, new_graph, sync_debug_error
from graphguard.captured import Captured, Graph
from graphguard.errors import ConfigError
from graphguard.recording import RecordingBackend
from graphguard.rng import register_all


class GraphBackend(Protocol):
    """What the capture lifecycle needs from a device. Every member is declared here and
    read directly (never probed): a backend that lacks one is refused when a runner is
    built (:func:`check_backend`), naming what to add."""

    name: str

    @property
    def capture_runs_body(self) -> bool:
        """False when :meth:`capture` only records the body's kernels, never runs them
        (CUDA): a run with no eager forward then writes no state, and the lifecycle skips
        its snapshot (:func:`graphguard.capture.run`). True for an emulation that runs
        the body. A class attribute does."""

    @property
    def reads_graphs(self) -> str | None:
        """``"cuda"`` or ``"cpu"`` when :meth:`capture` can return the graph's kernel
        arguments (``read_args=True``, for :mod:`graphguard.provenance`); None when it
        cannot. A class attribute does."""

    def synchronize(self) -> None:
        """Wait for all work on the device, every stream."""

    def stream(self) -> contextlib.AbstractContextManager[Any]:
        """The side stream warmups and captures run on, as a context manager."""

    def new_pool(self) -> Any:
        """A fresh memory pool handle that several graphs can share."""

    def capture(
        self,
        body: Callable[[], Any],
        *,
        pool: Any,
        error_mode: str,
        label: Any = None,
        generators: Sequence[torch.Generator] = (),
        read_args: bool | str = False,
        sync_guard: bool = True,
    ) -> Captured:
        """Capture ``body()`` into a graph allocating from ``pool``.

        ``label`` names the capture (the size) for recording and error messages.
        ``generators`` are registered with the graph before the capture begins, so its
        replays draw from them like eager calls (:mod:`graphguard.rng`). ``read_args``:
        also return every kernel argument the graph takes (provenance). ``sync_guard``:
        arm the process-wide sync debug mode for the capture, so a host synchronize in
        the body raises before it reaches the device (False for a lazy capture while
        other threads serve: the mode would make their own synchronizes raise).

        On failure the capture is ended (the stream leaves capture mode) and the error
        propagates; no graph is returned.
        """

    def reserved_bytes(self) -> int:
        """Bytes the allocator holds from the driver (pool growth is read from this)."""

    def empty_cache(self) -> None:
        """Hand cached, unused blocks back to the driver (after a throwaway capture)."""

    def free_bytes(self) -> int:
        """Free device memory as the driver sees it (``cudaMemGetInfo``). Read around each
        capture: what a graph takes outside the allocator (its instantiation) shows only
        here, never in :meth:`reserved_bytes`."""

    def end_captures(self) -> None:
        """The lifecycle's last capture of this run is done (also after a failure).

        For a backend that keeps state across one run's captures (CUDA: the cuBLAS
        workspaces owned by the graph pool); a no-op where there is none.
        """


_MEMBERS = (
    "name",
    "capture_runs_body",
    "reads_graphs",
    "synchronize",
    "stream",
    "new_pool",
    "capture",
    "reserved_bytes",
    "empty_cache",
    "free_bytes",
    "end_captures",
)


def check_backend(backend: object, where: str) -> None:
    """Refuse, when a runner is built, a backend that lacks a member of
    :class:`GraphBackend` (a backend written for graphguard 0.3 or earlier), naming each
    one, instead of failing in the middle of a capture."""
    missing = [m for m in _MEMBERS if not hasattr(backend, m)]
    if missing:
        raise ConfigError(
            f"{where}: backend {type(backend).__name__} lacks {', '.join(missing)} of "
            "graphguard.backend.GraphBackend; add them (0.4 declares every member: "
            "capture_runs_body = True for a backend whose capture runs the body, "
            "reads_graphs = None when it cannot read a graph, free_bytes() -> free device "
            "bytes, and capture(...) returns graphguard.backend.Captured(graph, result))"
        )


_CAPTURE_STREAMS: dict[torch.device, torch.cuda.Stream] = {}


def forget_capture_streams() -> None:
    """Forget the per-device capture streams (:func:`graphguard.reset_process_state`)."""
    _CAPTURE_STREAMS.clear()


class CudaBackend:
    """Real CUDA graphs on one device, captured on one side stream into shared pools."""

    name = "cuda"
    capture_runs_body = False  # a capture records kernels; nothing of the body runs
    reads_graphs = "cuda"
    """Provenance can read this backend's graphs (:mod:`graphguard._graph_args`)."""

    def __init__(
        self,
        device: torch.device | str | int | None = None,
        *,
        debug_dump_dir: str | None = None,
    ) -> None:
        """``debug_dump_dir``: write each captured graph as Graphviz DOT there
        (``graph_<label>.dot``, via ``CUDAGraph.debug_dump``), to inspect what was
        captured -- e.g. that auxiliary-stream branches stayed parallel."""
        self.debug_dump_dir = debug_dump_dir
        if not torch.cuda.is_available():
            raise ConfigError(
                "CudaBackend needs a CUDA device, but torch.cuda.is_available() is False "
                f"(torch {torch.__version__}); on a CPU-only machine build the runner with "
                "mode='none', or use graphguard.backend.RecordingBackend in tests."
            )
        dev = (
            torch.device("cuda", torch.cuda.current_device())
            if device is None
            else (
                torch.device(device)
                if not isinstance(device, int)
                else torch.device("cuda", device)
            )
        )
        if dev.index is None:
            dev = torch.device("cuda", torch.cuda.current_device())
        self.device = dev
        # One capture stream per device, shared by every backend: torch hands out
        # streams round-robin from a pool of 32, so a new stream per runner soon aliases
        # an AuxStream's stream (the graph then loses its parallel branches).
        stream = _CAPTURE_STREAMS.get(dev)
        if stream is None:
            stream = torch.cuda.Stream(device=dev)  # type: ignore[no-untyped-call]
            _CAPTURE_STREAMS[dev] = stream
            streams.watch_stream(stream, f"capture stream ({dev})")
        self._stream = stream

    @property
    def capture_stream(self) -> torch.cuda.Stream:
        """The side stream every warmup and capture of this backend runs on."""
        return self._stream

    def synchronize(self) -> None:
        torch.cuda.synchronize(self.device)

    def stream(self) -> contextlib.AbstractContextManager[Any]:
        return torch.cuda.stream(self._stream)

    def new_pool(self) -> Any:
        return torch.cuda.graph_pool_handle()

    def capture(
        self,
        body: Callable[[], Any],
        *,
        pool: Any,
        error_mode: str,
        label: Any = None,
        generators: Sequence[torch.Generator] = (),
        read_args: bool | str = False,
        sync_guard: bool = True,
    ) -> Captured:
        # Provenance reads the graph's nodes after capture_end (now, or on the first
        # question): keep the cudaGraph_t, and instantiate right after (as capture_end
        # does without keep_graph), so the first replay costs what it always did and the
        # driver's share is measured here.
        bindings = bool(read_args) and _graph_args.driver() is not None
        read = bindings and read_args is True
        keep = self.debug_dump_dir is not None or bindings
        graph = new_graph(keep=keep)
        if self.debug_dump_dir is not None:
            graph.enable_debug_mode()
        requested_pool = pool
        # A pool an earlier failed capture left unusable (see graphguard._unwind.abort_capture) is
        # replaced, transparently to the lifecycle, by the fresh pool standing in for it.
        pool = live_pool(self.device, pool)
        with torch.cuda.device(self.device), torch.cuda.stream(self._stream):
            # The pool's graphs must own their cuBLAS workspaces (see drop_blas_workspaces):
            # dropped before every capture, so each capture allocates what it needs inside
            # the pool. Not only before the first into a pool: a warmup between two
            # captures may create a workspace the earlier ones did not need (cuBLASLt's,
            # on the first split-K GEMM at a small size) in the general pool, where
            # end_captures would free it under the graph (found by provenance on the H200:
            # the size-1 graph of the reference step took such a 1 MiB block). The block
            # an earlier capture's workspace held is free inside the pool, so the next
            # capture's workspace reuses it: still about one per stream per pool.
            drop_blas_workspaces()
            # Before capture_begin (torch asserts it): capture_begin runs each registered
            # state's capture prologue, every replay() its replay prologue.
            register_all(graph, generators, f"capture {label!r}")
            # What was live as the capture began: a block the step frees inside the
            # capture is told from one freed long before (see graphguard._graph_args).
            before = _graph_args.live_spans(self.device) if read else None
            # And, read now, what the capture's ops are handed: an opaque word (inside a
            # closure or a struct) is decided by it (see graphguard._graph_args).
            ops = _graph_args.OpsTook() if read else None
            graph.capture_begin(pool=pool, capture_error_mode=error_mode)
            try:
                # A host sync (.item(), .cpu(), synchronize) raises in PyTorch *before*
                # the illegal CUDA call, so the capture stays valid and ends cleanly.
                with (
                    sync_debug_error() if sync_guard else contextlib.nullcontext(),
                    ops if ops is not None else contextlib.nullcontext(),
                ):
                    result = body()
            except BaseException as exc:
                # Leave capture mode so the stream, allocator and RNG are usable again;
                # the body's error is the one worth reporting.
                abort_capture(
                    graph, self.device, self._stream, pool, requested_pool, label, exc, generators
                )
                with contextlib.suppress(Exception):  # the body's error is the one reported
                    drop_blas_workspaces()
                raise
            graph.capture_end()
            took = ops.took() if ops is not None else None
            args = _graph_args.read_cuda(graph, self.device, before, took=took) if read else None
            if keep:
                with contextlib.suppress(RuntimeError):  # a torch without keep_graph
                    graph.instantiate()
        if self.debug_dump_dir is not None:
            dump_dot(graph, os.path.join(self.debug_dump_dir, f"graph_{label}.dot"))
        return Captured(graph, result, args)

    def end_captures(self) -> None:
        """The lifecycle's last capture is done: forget the pool-owned cuBLAS workspaces,
        so eager GEMMs after it allocate their own instead of writing into a pool block."""
        drop_blas_workspaces()

    def reserved_bytes(self) -> int:
        # torch.cuda.memory_reserved flattens every allocator statistic into a new dict
        # (~150 us); the lifecycle asks twice per size, so read the nested dict instead.
        try:
            stats = torch.cuda.memory.memory_stats_as_nested_dict(self.device)
            return int(stats["reserved_bytes"]["all"]["current"])
        except (KeyError, TypeError, AttributeError):  # pragma: no cover - other torch layouts
            return int(torch.cuda.memory_reserved(self.device))

    def empty_cache(self) -> None:
        torch.cuda.empty_cache()

    def free_bytes(self) -> int:
        return int(torch.cuda.mem_get_info(self.device)[0])


def free_graph(graph: Any) -> None:
    """Destroy a graph now (``CUDAGraph.reset``) instead of whenever the last reference
    dies: its instantiated executable is driver memory the allocator never sees, and an
    output view or a user's ``runner.graph(n)`` would otherwise keep it alive after
    ``release()``."""
    reset = getattr(graph, "reset", None)
    if callable(reset):
        reset()


def drop_blas_workspaces() -> None:
    """Make torch forget its cached cuBLAS/cuBLASLt workspaces (every handle and stream).

    Hazard: "cuBLAS workspace freed after capture". torch keeps one workspace per (cuBLAS
    handle, stream), allocated on first use from the caching allocator, and a captured
    GEMM bakes its address. Allocated by a warmup, it lives in the general pool and only
    torch's map keeps it: ``torch.compile(mode="reduce-overhead")`` clears that map
    before and after each of its recordings, and ``CUDAGraph.reset`` (torch 2.11) clears
    it for its capture stream, which every graphguard graph shares. The block is then
    reused by other tensors or, after ``empty_cache``, unmapped: replays corrupt memory
    or fault with "an illegal memory access". Dropped right before every
    ``capture_begin``, each workspace a capture uses is allocated inside it, in the
    graph's private pool, which lives as long as the graph; dropped again after the
    last ``capture_end``, eager work never uses a pool block (cudagraph trees do the
    same). Cost: about one workspace (32 MiB on Hopper) per pool (each capture's reuses
    the block the previous one freed), and the next eager GEMM re-allocates its own.
    """
    clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
    if callable(clear):
        clear()


__all__ = [
    "Captured",
    "CudaBackend",
    "Graph",
    "GraphBackend",
    "RecordingBackend",
    "check_backend",
    "drop_blas_workspaces",
    "forget_capture_streams",
    "free_graph",
]
