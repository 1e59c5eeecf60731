"""What a captured graph's nodes take as arguments: the raw material of provenance.

On CUDA: every kernel node's argument bytes (``cuGraphKernelNodeGetParams``, each argument
placed at its device-side offset from ``cuFuncGetParamInfo``; or the packed argument block
cuBLAS passes through ``extra``), and the pointers of memcpy and memset nodes, scanned as
aligned 8-byte words; plus the caching allocator's map at that moment (this graph's pool,
other graph pools, live and freed blocks of the general pool) and the live blocks as the
capture began.

Not every word is an argument the kernel reads. A kernel argument that is a struct (ATen's
TensorIterator closures and ``OffsetCalculator``, ``TensorInfo``, cuBLAS's packed block)
is copied whole from the host, and the fields the launch left unset (a 25-dim offset
calculator used for 2 dims) carry whatever the host stack held: often a pointer from an
earlier launch, long since freed. So each word gets a **kind** from the kernel's
parameter layout (``cuFuncGetParamInfo``) and its C++ types (the mangled name,
:mod:`graphguard._demangle`): a **pointer** (a whole 8-byte top-level parameter, an entry
of an operand array ``std::array<char*, N>``, ``TensorInfo``'s data, a memcpy/memset
address), **no pointer** (a scalar, an offset calculator, anything smaller than 8 bytes
or not 8-aligned: dropped here), or **opaque** (inside a closure or a struct whose layout
no name gives). Under the sanitizer the capture also records every storage its ops were
handed (:class:`OpsTook`): an opaque word is a read when it points into one, and, in an
ATen kernel (whose every pointer is a tensor its op was handed or made), not a pointer
when it does not. How provenance decides each word: :func:`graphguard.classification.classify`.
On the CPU (:class:`~graphguard.backend.RecordingBackend`): every storage a recorded body
passed to an op that it did not produce itself (:class:`graphguard.recording.ReadRecorder`,
a dispatch mode around the body).

Why words and not tensors: a CUDA graph freezes raw addresses, and the only complete record
of what it will touch on replay is its nodes' arguments. Reading them needs the graph kept
(``torch.cuda.CUDAGraph(keep_graph=True)``, then ``instantiate()`` at once, so replay is
unchanged) and ``cuda-bindings``; without it, nothing here raises: a one-time log line and
provenance stays off. Which owner each word belongs to is :mod:`graphguard.provenance`.
"""

from __future__ import annotations

import contextlib
import ctypes
import importlib.util
import logging
import operator
import struct
import time
from array import array
from dataclasses import dataclass, field
from itertools import repeat
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from graphguard._demangle import OPAQUE, POINTER, SCALAR, word_kinds

logger = logging.getLogger("graphguard")

Span = tuple[int, int]
"""A byte range ``[start, end)``."""


@dataclass
class GraphArgs:
    """Every candidate address one graph takes, and the allocator's map when it was read."""

    words: torch.Tensor
    """int64: every argument word (CUDA) or read storage's start (CPU)."""
    kernel: torch.Tensor
    """int64, parallel to ``words``: the index in ``kernels`` of the node that took it."""
    kernels: list[str]
    """Each node's kernel name (``memcpy``/``memset`` for those nodes; op names on the CPU)."""
    kind: torch.Tensor | None = None
    """uint8, parallel to ``words``: :data:`~graphguard._demangle.POINTER` or
    :data:`~graphguard._demangle.OPAQUE` (words that are no pointer are not kept; None:
    every word is a pointer, as the CPU records only storages ops took)."""
    from_ops: list[bool] | None = None
    """Per kernel: ATen's own (every pointer it takes is a tensor its op was handed or
    made); None: not known."""
    took: list[Span] | None = None
    """Every storage the capture's ops were handed (recorded under the sanitizer,
    :class:`OpsTook`); None: not recorded."""
    pool: list[Span] = field(default_factory=list)
    """This graph's own pool segments (CPU: storages the body produced): temporaries."""
    other_pools: list[Span] = field(default_factory=list)
    """Segments of other graph pools (another runner's graphs)."""
    freed: list[Span] = field(default_factory=list)
    """Memory no live tensor holds (free blocks of the general pool; CPU: storages read
    and dead by the end of the body)."""
    live: list[Span] = field(default_factory=list)
    """Live allocations outside graph pools (CPU: storages read, alive at the end)."""
    live_before: list[Span] | None = None
    """Live allocations of the general pool as the capture began (None: not taken); a
    freed block that was live then was freed by the captured step itself."""
    nodes: int = 0
    seconds: float = 0.0
    separate: bool = True
    """``seconds`` were spent reading after the capture ended (CUDA), apart from recording
    it; False where reading is interleaved with the recorded body (the CPU emulation)."""


# --------------------------------------------------------------- cuda-bindings

_DRIVER: Any = None
_TRIED = False
_LOGGED: set[str] = set()


def log_once(key: str, msg: str, *args: Any) -> None:
    if key not in _LOGGED:
        _LOGGED.add(key)
        logger.warning(msg, *args)


def available() -> bool:
    """Whether ``cuda.bindings`` is there to import, without importing it (the import took
    36 ms on the H200 host: a lazy runner's stage, which captures nothing, need not pay it
    before the first token). :func:`driver` imports it at the first capture that keeps a
    graph; an install found here that then fails to import leaves those graphs unread
    (logged once), never an error."""
    if _TRIED:
        return _DRIVER is not None
    try:
        return importlib.util.find_spec("cuda.bindings") is not None
    except (ImportError, ValueError):
        return False


def driver() -> Any | None:
    """``cuda.bindings.driver``, or None (logged once: provenance then stays off)."""
    global _DRIVER, _TRIED
    if not _TRIED:
        _TRIED = True
        try:
            from cuda.bindings import driver as d  # type: ignore[import-not-found]

            _DRIVER = d
        except Exception as exc:  # ImportError, or a broken install
            log_once(
                "bindings",
                "graphguard: graph provenance is off: cuda-bindings is not importable (%s); "
                "which graph reads what is inferred from the module tree as before. "
                "pip install graphguard[cuda] (cuda-bindings) to read "
                "every captured kernel's arguments.",
                exc,
            )
    return _DRIVER


class _Layout:
    """One kernel's parameter layout, asked of the driver once per ``CUfunction``: its
    name, each parameter's ``(offset, size)``, and what every node of that kernel reuses
    (the padded block length, which bytes a parameter covers, each word's kind)."""

    __slots__ = ("covered", "end", "from_ops", "kinds", "name", "offsets", "params", "width")

    def __init__(self, name: str, params: list[tuple[int, int]]) -> None:
        self.name = name
        self.params = params
        self.offsets = [o for o, _ in params]
        self.end = max((o + n for o, n in params), default=0)
        self.width = -(-self.end // 8) * 8
        cover = bytearray(self.width)
        for off, size in params:
            cover[off : off + size] = b"\xff" * size
        self.covered = int.from_bytes(cover, "little")
        """A mask of the bytes some parameter covers: the gaps between parameters of a
        packed block (padding, never initialized) read as zero, as the slow path's do."""
        self.kinds, self.from_ops = word_kinds(name, params, self.width)


_LAYOUTS: dict[int, _Layout] = {}
"""CUfunction handle -> its :class:`_Layout` (asked once per kernel)."""

_END, _BUFFER_POINTER, _BUFFER_SIZE = 0, 1, 2  # CU_LAUNCH_PARAM_* (cuda.h: (void*)0x00..02)


def _ok(d: Any, what: str, result: Any) -> Any:
    """The values of a cuda-bindings call ``(CUresult, *values)``; raise on an error."""
    err = result[0] if isinstance(result, tuple) else result
    if err != d.CUresult.CUDA_SUCCESS:
        raise RuntimeError(f"{what} returned {err!r}")
    values = result[1:] if isinstance(result, tuple) else ()
    return values[0] if len(values) == 1 else values


def _layout(d: Any, func: Any) -> _Layout:
    key = int(func)
    got = _LAYOUTS.get(key)
    if got is None:
        name = f"kernel@{key:#x}"
        with contextlib.suppress(Exception):
            raw = _ok(d, "cuFuncGetName", d.cuFuncGetName(func))
            name = raw.decode(errors="replace") if isinstance(raw, bytes) else str(raw)
        params: list[tuple[int, int]] = []
        for i in range(4096):  # cuFuncGetParamInfo fails past the last parameter
            r = d.cuFuncGetParamInfo(func, i)
            if r[0] != d.CUresult.CUDA_SUCCESS:
                break
            params.append((int(r[1]), int(r[2])))
        got = _LAYOUTS[key] = _Layout(name, params)
    return got


def _kernel_bytes(d: Any, p: Any) -> tuple[_Layout, bytes, bytes]:
    """One kernel node's layout, its device-side argument block (each argument at its
    offset), and per 8-byte word its kind (:func:`graphguard._demangle.word_kinds`).

    Fast path: the driver keeps a node's arguments in one block, each at its offset
    (``kernelParams[i] == base + offset[i]``); then the block is read once and the gaps
    between parameters masked to zero. Checked per node; otherwise each argument is read
    on its own."""
    func = p.func
    if int(func) == 0 and int(p.kern) != 0:  # a library-managed CUkernel
        func = _ok(d, "cuKernelGetFunction", d.cuKernelGetFunction(p.kern))
    lay = _layout(d, func)
    kp = int(p.kernelParams or 0)
    params = lay.params
    if kp and params:
        ptrs = array("Q", ctypes.string_at(kp, 8 * len(params)))
        base = ptrs[0]
        packed = lay.offsets[0] == 0 and base > 0
        if packed and all(map(operator.eq, map(operator.sub, ptrs, lay.offsets), repeat(base))):
            raw = int.from_bytes(ctypes.string_at(base, lay.end), "little") & lay.covered
            return lay, raw.to_bytes(lay.width, "little"), lay.kinds
        buf = bytearray(lay.width)
        for (off, size), ptr in zip(params, ptrs):
            if ptr and size:
                buf[off : off + size] = ctypes.string_at(ptr, size)
        return lay, bytes(buf), lay.kinds
    ex = int(p.extra or 0)
    block, nbytes = 0, 0
    for i in range(16):  # {BUFFER_POINTER, ptr, BUFFER_SIZE, &size, END}
        (key,) = struct.unpack("<Q", ctypes.string_at(ex + 16 * i, 8)) if ex else (_END,)
        if key == _END:
            break
        (val,) = struct.unpack("<Q", ctypes.string_at(ex + 16 * i + 8, 8))
        if key == _BUFFER_POINTER:
            block = val
        elif key == _BUFFER_SIZE and val:
            (nbytes,) = struct.unpack("<Q", ctypes.string_at(val, 8))
    if block and nbytes:  # one packed struct (cuBLAS's): every word in it is opaque
        n = nbytes - nbytes % 8
        return lay, ctypes.string_at(block, n), bytes([OPAQUE]) * (n // 8)
    return lay, b"", b""


def node_bytes(raw_graph: int) -> tuple[list[str], list[bytes], list[bytes], list[bool], int]:
    """Every node of the ``cudaGraph_t`` ``raw_graph`` (child graphs included): per
    kernel/memcpy/memset node its name, argument bytes (8-byte aligned), one byte per word
    (its kind, see the module docstring) and whether it is ATen's own kernel; and how many
    nodes there were. The one
    function that speaks the driver API: a traceback from a
    new driver or bindings version points here. Two driver calls per kernel node (its
    type, its parameters) and one per kernel for its layout (cached)."""
    d = driver()
    if d is None:
        raise RuntimeError("cuda-bindings is not importable")
    t = d.CUgraphNodeType
    kernel_t, memcpy_t = t.CU_GRAPH_NODE_TYPE_KERNEL, t.CU_GRAPH_NODE_TYPE_MEMCPY
    memset_t, child_t = t.CU_GRAPH_NODE_TYPE_MEMSET, t.CU_GRAPH_NODE_TYPE_GRAPH
    get_type, get_kernel = d.cuGraphNodeGetType, d.cuGraphKernelNodeGetParams
    success = d.CUresult.CUDA_SUCCESS
    names: list[str] = []
    blobs: list[bytes] = []
    exacts: list[bytes] = []
    aten: list[bool] = []
    total = 0
    stack = [d.CUgraph(raw_graph)]
    while stack:
        g = stack.pop()
        _, count = _ok(d, "cuGraphGetNodes(count)", d.cuGraphGetNodes(g, 0))
        nodes, count = _ok(d, "cuGraphGetNodes", d.cuGraphGetNodes(g, count))
        total += int(count)
        for node in list(nodes)[: int(count)]:
            got = get_type(node)
            if got[0] != success:
                raise RuntimeError(f"cuGraphNodeGetType returned {got[0]!r}")
            kind = got[1]
            if kind == kernel_t:
                p = _ok(d, "cuGraphKernelNodeGetParams", get_kernel(node))
                lay, blob, exact = _kernel_bytes(d, p)
                name, ours = lay.name, lay.from_ops
            elif kind == memcpy_t:
                p = _ok(d, "cuGraphMemcpyNodeGetParams", d.cuGraphMemcpyNodeGetParams(node))
                name, blob = "memcpy", struct.pack("<2Q", int(p.srcDevice), int(p.dstDevice))
                exact, ours = bytes([POINTER, POINTER]), False
            elif kind == memset_t:
                p = _ok(d, "cuGraphMemsetNodeGetParams", d.cuGraphMemsetNodeGetParams(node))
                name, blob = "memset", struct.pack("<Q", int(p.dst))
                exact, ours = bytes([POINTER]), False
            elif kind == child_t:
                stack.append(
                    _ok(d, "cuGraphChildGraphNodeGetGraph", d.cuGraphChildGraphNodeGetGraph(node))
                )
                continue
            else:
                continue
            names.append(name)
            blobs.append(blob)
            exacts.append(exact)
            aten.append(ours)
    return names, blobs, exacts, aten, total


class AllocatorMap:
    """The caching allocator's map of one device at one moment
    (``torch.cuda.memory_snapshot``, read once): every graph pool's segments, and the
    general pool's live and free blocks. One map serves every graph read at that moment
    (the snapshot is the costly part: a Python dict per block)."""

    def __init__(self, device: torch.device) -> None:
        index = device.index if device.index is not None else torch.cuda.current_device()
        self.pools: dict[tuple[int, ...], list[Span]] = {}
        self.freed: list[Span] = []
        self.live: list[Span] = []
        for seg in torch.cuda.memory_snapshot():  # type: ignore[no-untyped-call]
            if seg.get("device", index) != index:
                continue
            start = int(seg["address"])
            pid = tuple(seg.get("segment_pool_id") or (0, 0))
            if pid != (0, 0):
                self.pools.setdefault(pid, []).append((start, start + int(seg["total_size"])))
                continue
            addr = start
            for b in seg.get("blocks", ()):
                size = int(b["size"])
                a = int(b.get("address", addr))
                (self.freed if b.get("state") == "inactive" else self.live).append((a, a + size))
                addr = a + size

    def spans(self, pool_id: Any) -> tuple[list[Span], list[Span], list[Span], list[Span]]:
        """(this pool, other graph pools, freed, live) for a graph of pool ``pool_id``."""
        mine = tuple(pool_id) if pool_id is not None else None
        pool = list(self.pools.get(mine, ())) if mine is not None else []
        other = [s for pid, spans in self.pools.items() if pid != mine for s in spans]
        return pool, other, self.freed, self.live


def live_spans(device: torch.device) -> list[Span]:
    """Live blocks of the general pool on ``device`` now (taken as a capture begins)."""
    return AllocatorMap(device).live


def allocator_map(device: torch.device, pool_id: Any) -> tuple[list[Span], ...]:
    """(this pool, other graph pools, freed, live) spans of the caching allocator on
    ``device`` now (``torch.cuda.memory_snapshot``)."""
    return AllocatorMap(device).spans(pool_id)


def read_cuda(
    graph: Any,
    device: torch.device,
    live_before: list[Span] | None = None,
    amap: AllocatorMap | None = None,
    took: list[Span] | None = None,
) -> GraphArgs | None:
    """Read a CUDA graph kept with ``keep_graph=True`` (``live_before``: :func:`live_spans`
    as its capture began, when read right after it; ``amap``: the allocator's map to
    classify against, shared by the graphs read together, else taken now; ``took``: what
    the capture's ops were handed, :class:`OpsTook`); None, logged once, when it cannot be
    read (no bindings, a torch without ``raw_cuda_graph``, a driver error, a graph
    destroyed since): provenance then does not know this graph, and says so. A graph's
    nodes do not change after its capture, so reading them later reads what the capture
    recorded. Words that are no pointer (:data:`~graphguard._demangle.SCALAR`) are not
    kept."""
    if driver() is None:
        return None
    t0 = time.perf_counter()
    try:
        names, blobs, kinds, aten, nodes = node_bytes(int(graph.raw_cuda_graph()))
        pool, other, freed, live = (amap or AllocatorMap(device)).spans(graph.pool())
    except Exception as exc:
        log_once(
            "read",
            "graphguard: could not read a captured graph's kernel arguments (%s: %s); "
            "provenance does not know the graphs this happens to (see "
            "graphguard._graph_args.node_bytes)",
            type(exc).__name__,
            exc,
        )
        return None
    counts = [len(b) // 8 for b in blobs]
    joined = b"".join(blobs)
    words = (
        torch.frombuffer(bytearray(joined), dtype=torch.int64)
        if joined
        else torch.empty(0, dtype=torch.int64)
    )
    kernel = torch.repeat_interleave(
        torch.arange(len(names), dtype=torch.int64), torch.tensor(counts, dtype=torch.int64)
    )
    flags = b"".join(kinds)
    kind = (
        torch.frombuffer(bytearray(flags), dtype=torch.uint8)
        if flags
        else torch.empty(0, dtype=torch.uint8)
    )
    some = kind != SCALAR
    return GraphArgs(
        words=words[some],
        kernel=kernel[some],
        kind=kind[some],
        from_ops=aten,
        took=took,
        live_before=live_before,
        kernels=names,
        pool=pool,
        other_pools=other,
        freed=freed,
        live=live,
        nodes=nodes,
        seconds=time.perf_counter() - t0,
    )


def storage_span(t: torch.Tensor) -> tuple[Any, Span] | None:
    """``t``'s storage and its byte span (at least one byte); None when it has none."""
    try:
        st = t.untyped_storage()
        ptr = int(st.data_ptr())
        return st, (ptr, ptr + max(int(st.nbytes()), 1))
    except (RuntimeError, NotImplementedError):
        return None


class OpsTook(TorchDispatchMode):
    """Around a CUDA capture under the sanitizer: the storage of every tensor an op was
    handed (:attr:`GraphArgs.took`), the capture's own record of what its kernels may take.
    An opaque word (inside a closure or a struct) is then decided: a read when it points
    into one of these; in an ATen kernel, no pointer the kernel uses when it does not.
    Host-side only; under the sanitizer, which reads each graph at capture."""

    def __init__(self) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.spans: dict[int, int] = {}

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None
    ) -> Any:
        for t in torch.utils._pytree.tree_leaves((args, kwargs)):
            if isinstance(t, torch.Tensor) and t.device.type == "cuda":
                got = storage_span(t)
                if got is not None:
                    lo, hi = got[1]
                    if self.spans.get(lo, 0) < hi:
                        self.spans[lo] = hi
        return func(*args, **(kwargs or {}))

    def took(self) -> list[Span]:
        return sorted(self.spans.items())


__all__ = [
    "AllocatorMap",
    "GraphArgs",
    "OpsTook",
    "allocator_map",
    "driver",
    "live_spans",
    "node_bytes",
    "read_cuda",
    "storage_span",
]
