"""A pool of its own per lazily captured size (``Lazy(evict="lru")``), and the one pool
their cuBLAS workspaces share.

Why: a ladder's graphs share one private pool, which is the cheapest way to hold them
(the pool is as large as its largest graph, not the sum), but a graph in it owns no
bytes: evicting it returns its driver share only, the pool keeps every block while any
graph holds it, and recaptures after evictions grow it where the ledger cannot say whose
growth it is (measured on the H200: the ledger constant at 37.7 MB while the graphs held
42 -> 52 MB, and LRU hitting no more often than refusing). A graph in a pool of its own
owns exactly that pool: ``CUDAGraph.reset`` releases it (torch's ``releasePool``: no graph
uses it, so it is freeable) and ``empty_cache`` hands its blocks back to the driver
(``release_cached_blocks`` walks the freeable pools), so an eviction returns what the
graph's capture measured, and the next capture of the size gets a fresh pool (a pool id
whose graphs all went cannot be captured into again: a torch internal assert).

The cost: per-graph pools hold the sum of the graphs' intermediates, not the largest. And
every pool would hold a cuBLAS workspace (32 MiB on Hopper, allocated inside the capture
so that no graph bakes a block torch may free: :func:`graphguard.backend.drop_blas_workspaces`)
if nothing else did. :class:`BlasWorkspaces` makes them once, inside one
``torch.cuda.MemPool`` of the runner's that lives until ``release()``, on the capture
stream, right before each capture: every graph bakes those blocks, which nothing but
another workspace can take (torch frees a workspace it forgets into that pool, where only
the next workspace allocation finds it), and graphs never run at once. The ledger counts
that pool once (:attr:`GraphLedger.fixed <graphguard.ledger.GraphLedger.fixed>`). A
workspace a capture needs that was not made beforehand is allocated in its own pool, as
before (correct; that graph then costs one more workspace). Where torch has no
``MemPool`` (older than 2.6) or the backend is not a :class:`~graphguard.backend.CudaBackend`
(the CPU emulation), each pool holds its own.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

from graphguard.backend import (
    CudaBackend,
    GraphBackend,
    drop_blas_workspaces,
    make_blas_workspaces,
)


class BlasWorkspaces:
    """The runner's pool of cuBLAS workspaces for its own-pool graphs (see the module)."""

    def __init__(self) -> None:
        self.pool: Any = None
        """The ``torch.cuda.MemPool`` (None: not made, or not possible here)."""
        self.bytes = 0
        """What making it reserved (counted once in the ledger)."""

    def ensure(self, backend: GraphBackend) -> int:
        """Make the pool and its workspaces once, on a CUDA backend with ``MemPool``;
        the bytes it added (0 when it exists or cannot be made)."""
        if (
            self.pool is not None
            or not isinstance(backend, CudaBackend)
            or not hasattr(torch.cuda, "MemPool")
            or not hasattr(torch.cuda, "use_mem_pool")
        ):
            return 0
        backend.synchronize()
        before = backend.reserved_bytes()
        pool = torch.cuda.MemPool()
        make_blas_workspaces(pool, backend.device, backend.capture_stream)
        drop_blas_workspaces()  # eager GEMMs allocate their own, as after every capture
        backend.synchronize()
        self.pool = pool
        self.bytes = max(0, backend.reserved_bytes() - before)
        return self.bytes

    @contextlib.contextmanager
    def installed(self, backend: GraphBackend) -> Iterator[None]:
        """Captures through ``backend`` make their workspaces in this pool meanwhile (only
        this runner's own-pool captures: a backend shared with another runner is put back
        as it was)."""
        if self.pool is None or not isinstance(backend, CudaBackend):
            yield
            return
        old = backend.blas_pool
        backend.blas_pool = self.pool
        try:
            yield
        finally:
            backend.blas_pool = old

    def release(self) -> None:
        """Forget the pool (``release()``: every graph that baked its blocks is gone);
        torch frees it when the last reference goes, the next ``empty_cache`` returns it."""
        self.pool = None
        self.bytes = 0


__all__ = ["BlasWorkspaces"]
