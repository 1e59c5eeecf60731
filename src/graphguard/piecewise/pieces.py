"""Pieces: one CUDA graph per piece and size, told what to do by a shared session.

A :class:`PiecewiseGraph` replays its graph for the session's size, captures at it, or
runs its FX code eagerly; :class:`EagerSplit` runs a split op eagerly (in phase WARMUP
while a size is captured, so no auxiliary-stream work crosses the next piece's capture).
The runner alone decides the size: a piece's inputs need not show the token count.

Memory: inputs a piece receives from split ops are fresh allocations, so they are
copied into static buffers the piece owns; other inputs (the runner's static buffers,
parameters, other pieces' outputs) keep their address and are checked once per size.
On CUDA a piece keeps only non-owning aliases of its outputs, so the next smaller size
reuses their pool blocks: safe because graphs of one pool replay one at a time in
capture order, and the price is ``torch.cuda.graph``'s contract (outputs valid until the
next call).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from graphguard import phase
from graphguard._torch_compat import unowned
from graphguard.backend import Graph, GraphBackend, free_graph
from graphguard.entries import copy_into
from graphguard.errors import GraphGuardError
from graphguard.phase import Phase

EAGER, CAPTURE, REPLAY = 0, 1, 2
"""What a :class:`Session` tells its pieces: run eagerly, capture, or replay."""


@dataclass
class Session:
    """What the runner tells the pieces: run eagerly, capture size ``size``, or replay it."""

    state: int = EAGER
    size: int = 0
    backend: GraphBackend | None = None
    pool: Any = None
    error_mode: str = "global"
    weak_outputs: bool = False
    name: str = "piecewise"
    generators: tuple[torch.Generator, ...] = ()


def _weak_alias(t: torch.Tensor) -> torch.Tensor:
    """A tensor over ``t``'s memory that does not own it (see the module docstring),
    usable by the next piece's code whatever its inference mode."""
    with torch.inference_mode(False):
        return unowned(t)


class _PieceEntry:
    """One captured graph of a piece at one size, with what replay needs."""

    __slots__ = ("dsts", "graph", "ints", "outputs", "ptrs", "verified")

    def __init__(
        self,
        graph: Graph,
        dsts: list[torch.Tensor],
        ints: tuple[Any, ...],
        outputs: Any,
        ptrs: list[tuple[int, int]],
    ) -> None:
        self.graph = graph
        self.dsts = dsts
        self.ints = ints
        self.outputs = outputs
        self.ptrs = ptrs
        self.verified = False


class PiecewiseGraph(torch.nn.Module):
    """One piece of a split graph: replays its graph for the session's size, else runs eagerly.

    Contract: while replaying, inputs that come from split ops are copied into this
    piece's static buffers; every other tensor input must be at the address it had at
    capture (the runner's static buffers, parameters, other pieces' outputs); the
    first replay of each size checks that. Outputs are graph memory, overwritten by
    the next replay.
    """

    def __init__(
        self, module: torch.nn.Module, index: int, copied_inputs: Sequence[int], session: Session
    ) -> None:
        super().__init__()
        self.module = module
        self.index = index
        self.copied_inputs = tuple(copied_inputs)
        self._session = session
        self._entries: dict[int, _PieceEntry] = {}
        self._static_bufs: dict[int, torch.Tensor] = {}
        self._retired: list[torch.Tensor] = []
        self._int_idx: tuple[int, ...] | None = None

    @property
    def captured_sizes(self) -> tuple[int, ...]:
        """Sizes this piece has a graph for, ascending."""
        return tuple(sorted(self._entries))

    def forward(self, *args: Any) -> Any:
        s = self._session
        if s.state == REPLAY:
            e = self._entries.get(s.size)
            if e is not None:
                return self._replay(e, args)
        elif s.state == CAPTURE:
            return self.capture_at(s.size, args)
        return self.module(*args)

    def _replay(self, e: _PieceEntry, args: tuple[Any, ...]) -> Any:
        if e.dsts:
            copy_into(e.dsts, [args[i] for i in self.copied_inputs])
        if e.ints and tuple(args[i] for i in self._int_idx or ()) != e.ints:
            raise GraphGuardError(
                f"piece {self.index}: integer inputs {tuple(args[i] for i in self._int_idx or ())} "
                f"differ from {e.ints} captured at size {self._session.size}; the graph of a size "
                "must see the same symbolic sizes on every call"
            )
        if not e.verified:
            self._verify(e, args)
        e.graph.replay()
        return e.outputs

    def _verify(self, e: _PieceEntry, args: tuple[Any, ...]) -> None:
        moved = [
            f"input {i}: captured at 0x{ptr:x}, now at 0x{args[i].data_ptr():x}"
            for i, ptr in e.ptrs
            if args[i].data_ptr() != ptr
        ]
        if moved:
            raise GraphGuardError(
                f"piece {self.index} (size {self._session.size}): inputs passed through without a "
                "copy moved since capture, so the graph would read stale memory:\n  - "
                + "\n  - ".join(moved)
                + "\nCall the compiled callable through PiecewiseRunner (its static buffers "
                "keep input addresses fixed) and do not replace parameters after capture."
            )
        e.verified = True

    def _static_view(self, i: int, x: torch.Tensor) -> torch.Tensor:
        buf = self._static_bufs.get(i)
        if buf is None or buf.numel() < x.numel() or buf.dtype != x.dtype or buf.device != x.device:
            if buf is not None:
                self._retired.append(buf)  # graphs of earlier sizes still read it
            buf = torch.empty(x.numel(), dtype=x.dtype, device=x.device)
            self._static_bufs[i] = buf
        return buf[: x.numel()].view(x.shape)

    def capture_at(self, size: int, args: Sequence[Any]) -> Any:
        """Capture this piece at ``size`` on ``args`` and return its (captured) outputs.

        Only inside graphguard's capture window (the tripwire raises otherwise).
        """
        phase.check_capture_allowed(f"piecewise piece {self.index} (size {size})")
        s = self._session
        if s.backend is None:
            raise GraphGuardError(
                f"piece {self.index}: no graph backend; capture through PiecewiseRunner.capture()"
            )
        if self._int_idx is None:
            self._int_idx = tuple(i for i, a in enumerate(args) if isinstance(a, int))
        static = list(args)
        dsts: list[torch.Tensor] = []
        for i in self.copied_inputs:
            x = args[i]
            if isinstance(x, torch.Tensor):
                view = self._static_view(i, x)
                view.copy_(x)
                static[i] = view
                dsts.append(view)
        copied = set(self.copied_inputs)
        ptrs = [
            (i, a.data_ptr())
            for i, a in enumerate(args)
            if isinstance(a, torch.Tensor) and i not in copied
        ]
        module = self.module

        def body() -> Any:
            return module(*static)

        graph, out = s.backend.capture(
            body,
            pool=s.pool,
            error_mode=s.error_mode,
            label=(size, self.index),
            generators=s.generators,
        )
        kept = (
            torch.utils._pytree.tree_map_only(torch.Tensor, _weak_alias, out)
            if s.weak_outputs
            else out
        )
        ints = tuple(args[i] for i in self._int_idx)
        self._entries[size] = _PieceEntry(graph, dsts, ints, kept, ptrs)
        return out

    def graph_at(self, size: int) -> Graph | None:
        """This piece's graph of ``size`` (None: not captured), for provenance."""
        e = self._entries.get(size)
        return e.graph if e is not None else None

    def read_addresses(self, size: int) -> list[int]:
        """The addresses of the inputs the size-``size`` graph reads in place (not copied)."""
        e = self._entries.get(size)
        return [ptr for _, ptr in e.ptrs] if e is not None else []

    def drop(self, size: int | None = None) -> Graph | None:
        """Forget the graph of ``size`` and return it, still alive (the ladder destroys it
        once the pool's next capture holds the pool); None: every size, destroyed now."""
        if size is None:
            for e in self._entries.values():
                free_graph(e.graph)
            self._entries.clear()
            self._static_bufs.clear()
            self._retired.clear()
            return None
        gone = self._entries.pop(size, None)
        return gone.graph if gone is not None else None

    def extra_repr(self) -> str:
        return (
            f"index={self.index}, copied_inputs={list(self.copied_inputs)}, "
            f"sizes={len(self._entries)}"
        )


class EagerSplit(torch.nn.Module):
    """A split-op submodule: always eager; in phase WARMUP while a size is being captured.

    WARMUP turns auxiliary-stream overlap off, so nothing the op forks can still be
    running when the next piece's capture begins (side-stream work across the capture
    boundary).
    """

    def __init__(self, module: torch.nn.Module, session: Session) -> None:
        super().__init__()
        self.module = module
        self._session = session

    def forward(self, *args: Any) -> Any:
        if self._session.state == CAPTURE:
            with phase.enter(Phase.WARMUP, owner=self._session.name):
                return self.module(*args)
        return self.module(*args)


__all__ = ["PiecewiseGraph"]
