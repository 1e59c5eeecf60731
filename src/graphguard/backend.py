"""The small protocol between the capture lifecycle and the device.

The lifecycle (warmup, synchronize, capture, largest first, one pool) is the product;
keeping the device behind one small protocol lets the same loop run against real CUDA graphs
and against :class:`RecordingBackend`, which emulates capture and replay on the CPU
and records every synchronize, capture begin/end and replay. CI proves the lifecycle
order with it on machines without a GPU.

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
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from graphguard import _graph_args, streams
from graphguard._graph_args import GraphArgs
from graphguard._unwind import abort_capture, dump_dot, live_pool, new_graph, sync_debug_error
from graphguard.autocast import AutocastPolicy
from graphguard.errors import ConfigError
from graphguard.rng import register_all


class Graph(Protocol):
    """A captured graph: replay is the only operation the hot path needs."""

    def replay(self) -> None: ...


@dataclass(frozen=True)
class Captured:
    """What one :meth:`GraphBackend.capture` produced: the graph, what the body returned,
    and, when asked (``read_args``), every kernel argument the graph takes
    (:class:`~graphguard._graph_args.GraphArgs`; None: not asked, or not readable).

    Returned, not attached to the graph: what a capture read travels with the capture,
    through the lifecycle's ``register``, to provenance, and nothing is set on torch's
    graph object."""

    graph: Graph
    result: Any
    args: GraphArgs | None = None


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


class _RecordedGraph:
    """CPU emulation of a graph: replay re-runs the body and writes into the captured outputs.

    The body re-runs under the autocast policy of its capture, as a real graph's kernels
    keep the dtypes they were recorded with."""

    __slots__ = (
        "_autocast",
        "_backend",
        "_body",
        "_outputs",
        "driver",
        "pool",
        "size",
    )

    def __init__(
        self,
        backend: RecordingBackend,
        body: Callable[[], Any],
        outputs: Any,
        size: Any,
        pool: Any = None,
        driver: int = 0,
    ):
        self._backend = backend
        self._body = body
        self._outputs = outputs
        self.size = size
        self._autocast = AutocastPolicy.current()
        self.pool = pool
        self.driver = driver
        """Emulated driver bytes this graph holds outside the allocator (until reset)."""

    def reset(self) -> None:
        """Give back the emulated driver memory, like ``CUDAGraph.reset``."""
        if self.driver or self.pool is not None:
            self._backend._graph_freed(self)
            self.driver = 0
            self.pool = None

    def replay(self) -> None:
        self._backend.events.append(("replay", self.size))
        with self._autocast.applied():
            fresh = self._body()
        old_leaves = torch.utils._pytree.tree_leaves(self._outputs)
        new_leaves = torch.utils._pytree.tree_leaves(fresh)
        for old, new in zip(old_leaves, new_leaves):
            if (
                isinstance(old, torch.Tensor)
                and old is not new
                and old.data_ptr() != new.data_ptr()
            ):
                _write_recorded(old, new)


def _has_internal_overlap(t: torch.Tensor) -> bool:
    """Some element of ``t`` shares its memory with another (an ``expand``, stride 0)."""
    check = getattr(torch._C, "_debug_has_internal_overlap", None)
    if callable(check):
        return bool(check(t) == 1)  # 0: no, 1: yes, 2: too hard to tell (copy_ accepts)
    return any(st == 0 and n > 1 for n, st in zip(t.shape, t.stride()))


def _write_recorded(old: torch.Tensor, new: torch.Tensor) -> None:
    """Write a replay's fresh output into the captured output ``old``.

    A captured output that is a view whose elements share memory (``h.unsqueeze(1)
    .expand(-1, 3, -1)``: stride 0) cannot be the target of ``copy_`` ("more than one
    element of the written-to tensor refers to a single memory location"). A CUDA graph
    never writes through such a view: its kernels wrote the underlying storage before
    the view was taken. So the emulation does the same: it writes every element of
    ``new`` to the storage location ``old``'s element maps to (duplicates carry one
    value, as the fresh output is the same view of its own storage)."""
    if not _has_internal_overlap(old):
        old.copy_(new)
        return
    storage = old.untyped_storage()
    n = storage.nbytes() // old.element_size()
    flat = torch.as_strided(old, (n,), (1,), 0)  # the whole storage, each element once
    where = torch.as_strided(
        torch.arange(n, device=old.device), old.shape, old.stride(), old.storage_offset()
    )
    with torch.no_grad():
        flat.index_put_((where.reshape(-1),), new.detach().to(old.dtype).expand_as(old).reshape(-1))


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


class RecordingBackend:
    """Emulates capture/replay on the CPU and records the lifecycle as events.

    Events are tuples: ``("synchronize",)``, ``("register_generator", label, generator)``
    (one per generator, before its capture begins), ``("capture_begin", label)``,
    ``("capture_end", label)``, ``("capture_abort", label)``, ``("replay", label)``.
    The label is what the lifecycle passed to :meth:`capture` (the size).
    Replay re-runs the captured body, so results on the CPU equal what a real graph
    would produce for the static buffers -- padding and output views can be tested; a
    replay draws from the generators' current states, as a CUDA replay of registered
    generators does.
    """

    name = "recording"
    capture_runs_body = True  # the emulated capture runs the body eagerly
    reads_graphs = "cpu"
    """Provenance can record what this backend's graphs read (with ``provenance=True``)."""

    def __init__(
        self,
        *,
        graph_bytes: Callable[[Any], tuple[int, int]] | None = None,
        device_bytes: int = 1 << 40,
    ) -> None:
        """``graph_bytes(label) -> (pool_bytes, driver_bytes)`` emulates device memory: a
        capture grows its pool to ``pool_bytes`` (blocks are shared: only what the pool
        lacks is new) and holds ``driver_bytes`` outside the allocator until the graph is
        reset; :meth:`free_bytes` is ``device_bytes`` less both. Default: no memory."""
        self.events: list[tuple[Any, ...]] = []
        self.fail_on: set[Any] = set()
        self.graph_bytes = graph_bytes
        self.device_bytes = device_bytes
        self._pools: dict[Any, list[int]] = {}  # pool -> [reserved bytes, live graphs]
        self._driver = 0

    def synchronize(self) -> None:
        self.events.append(("synchronize",))

    def stream(self) -> contextlib.AbstractContextManager[Any]:
        return contextlib.nullcontext()

    def new_pool(self) -> Any:
        return ("recording-pool", len(self.events))

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
        for g in generators:
            self.events.append(("register_generator", label, g))
        self.events.append(("capture_begin", label))
        try:
            if label in self.fail_on:
                raise RuntimeError(f"emulated capture failure at {label}")
            recorder = _graph_args.ReadRecorder() if read_args else None
            if recorder is None:
                result = body()
            else:  # what the emulated graph reads: every storage its ops take
                with recorder:
                    result = body()
        except BaseException:
            self.events.append(("capture_abort", label))
            raise
        self.events.append(("capture_end", label))
        driver = 0
        if self.graph_bytes is not None:
            need, driver = self.graph_bytes(label)
            held = self._pools.setdefault(pool, [0, 0])
            held[0] = max(held[0], int(need))
            held[1] += 1
            self._driver += int(driver)
        kept = pool if self.graph_bytes is not None else None
        graph = _RecordedGraph(self, body, result, label, kept, int(driver))
        return Captured(graph, result, recorder.finish() if recorder is not None else None)

    def _graph_freed(self, graph: _RecordedGraph) -> None:
        self._driver -= graph.driver
        held = self._pools.get(graph.pool)
        if held is not None:
            held[1] -= 1

    def reserved_bytes(self) -> int:
        return sum(held[0] for held in self._pools.values())

    def free_bytes(self) -> int:
        return self.device_bytes - self.reserved_bytes() - self._driver

    def empty_cache(self) -> None:
        self.events.append(("empty_cache",))
        for pool in [p for p, held in self._pools.items() if held[1] <= 0]:
            del self._pools[pool]  # a pool without graphs goes back to the "driver"

    def end_captures(self) -> None:
        """Nothing outlives a run on the CPU (not recorded: not a device event)."""

    def names(self) -> list[str]:
        """The event kinds in order (handy for asserting the lifecycle)."""
        return [e[0] for e in self.events]


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
