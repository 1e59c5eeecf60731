"""The CPU emulation of the device: capture records the lifecycle and runs the body
(recording what it reads, for provenance: :class:`ReadRecorder`), replay runs it again
and writes into the captured outputs.

It implements :class:`graphguard.backend.GraphBackend`, so the same capture loop runs
against it and against real CUDA graphs; CI proves the lifecycle order with it on
machines without a GPU.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode

from graphguard._graph_args import GraphArgs, Span, storage_span
from graphguard.autocast import AutocastPolicy
from graphguard.captured import Captured


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
            recorder = ReadRecorder() if read_args else None
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


# --------------------------------------------------------------- what a body reads


class ReadRecorder(TorchDispatchMode):
    """Around a recorded body (:class:`~graphguard.backend.RecordingBackend`): every
    storage an op takes that the body did not produce, with the op that took it first;
    storages the body produced are its "pool". Weak references only: nothing is kept alive."""

    def __init__(self) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.t0 = time.perf_counter()
        self.ops: list[str] = []
        self.reads: dict[int, tuple[Span, int, StorageWeakRef]] = {}
        self.made: dict[int, Span] = {}

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None
    ) -> Any:
        kwargs = kwargs or {}
        op = len(self.ops)
        self.ops.append(str(getattr(func, "__name__", func)))
        for t in torch.utils._pytree.tree_leaves((args, kwargs)):
            if isinstance(t, torch.Tensor):
                got = storage_span(t)
                if got is not None and got[1][0] not in self.made:
                    st, span = got
                    if span[0] not in self.reads:
                        self.reads[span[0]] = (span, op, StorageWeakRef(st))  # type: ignore[no-untyped-call]
        out = func(*args, **kwargs)
        for t in torch.utils._pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor):
                got = storage_span(t)
                if got is not None and got[1][0] not in self.reads:
                    self.made[got[1][0]] = got[1]
        return out

    def finish(self) -> GraphArgs:
        starts = sorted(self.reads)
        freed = [self.reads[s][0] for s in starts if self.reads[s][2].expired()]  # type: ignore[no-untyped-call]
        live = [self.reads[s][0] for s in starts if not self.reads[s][2].expired()]  # type: ignore[no-untyped-call]
        return GraphArgs(
            words=torch.tensor(starts, dtype=torch.int64),
            kernel=torch.tensor([self.reads[s][1] for s in starts], dtype=torch.int64),
            kernels=self.ops,
            pool=sorted(self.made.values()),
            freed=freed,
            live=live,
            nodes=len(self.ops),
            seconds=time.perf_counter() - self.t0,
            separate=False,
        )


__all__ = ["ReadRecorder", "RecordingBackend"]
