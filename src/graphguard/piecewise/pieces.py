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

Recapturing some pieces of a size alone (:attr:`Session.only`: a moved weight that only
they read): the other pieces of that size replay their graphs in the same forward, and
each recaptured piece is captured into a fresh pool of its own (never over the shared
pool's blocks, where the other pieces' outputs live without an owner) and ends with a
copy of its outputs into the addresses the old graph wrote, which the next pieces'
graphs read. See :meth:`graphguard.PiecewiseRunner.capture_pieces`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from graphguard import phase
from graphguard._graph_args import GraphArgs
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
    only: frozenset[int] | None = None
    """While capturing: the pieces to capture (the others replay their graph of the size,
    the outputs of a recaptured piece land where its old graph's did); None: every piece."""
    read_args: bool | str = False
    """While capturing: have the backend return each piece graph's kernel arguments."""
    sync_guard: bool = True
    """While capturing: arm the process-wide sync debug mode (not for a lazy capture)."""


def _weak_alias(t: torch.Tensor) -> torch.Tensor:
    """A tensor over ``t``'s memory that does not own it (see the module docstring),
    usable by the next piece's code whatever its inference mode."""
    with torch.inference_mode(False):
        return unowned(t)


class _PieceEntry:
    """One captured graph of a piece at one size, with what replay needs."""

    __slots__ = (
        "aliased",
        "args",
        "dsts",
        "graph",
        "ints",
        "outputs",
        "pool",
        "ptrs",
        "verified",
    )

    def __init__(
        self,
        graph: Graph,
        dsts: list[torch.Tensor],
        ints: tuple[Any, ...],
        outputs: Any,
        ptrs: list[tuple[int, int]],
        pool: Any = None,
        aliased: bool = False,
        args: GraphArgs | None = None,
    ) -> None:
        self.graph = graph
        self.args = args
        """What the capture read of the graph's kernel arguments, until provenance takes it."""
        self.dsts = dsts
        self.ints = ints
        self.outputs = outputs
        self.ptrs = ptrs
        self.verified = False
        self.pool = pool
        """The pool the graph was captured into."""
        self.aliased = aliased
        """Some output shares storage with an input, or memory between its own elements:
        the graph cannot be recaptured alone (its outputs could not be copied back)."""


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
        self._replaced: dict[int, Graph] = {}
        """Size -> the graph a recapture of this piece alone replaced (the runner
        destroys it once the capture run is over)."""

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
            if s.only is not None and self.index not in s.only:
                e = self._entries.get(s.size)
                if e is not None:  # not recaptured: its graph runs, its outputs stay put
                    return self._replay(e, args)
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
        # Recaptured alone: the next pieces' graphs read this piece's outputs where the
        # old graph wrote them, so the new graph copies its outputs there.
        old = self._entries.get(size) if s.only is not None else None
        where = f"piece {self.index} (size {size})"

        def body() -> Any:
            out = module(*static)
            return out if old is None else _into(old.outputs, out, where)

        captured = s.backend.capture(
            body,
            pool=s.pool,
            error_mode=s.error_mode,
            label=(size, self.index),
            generators=s.generators,
            read_args=s.read_args,
            sync_guard=s.sync_guard,
        )
        graph, out = captured.graph, captured.result
        if old is not None:
            kept = old.outputs
            self._replaced[size] = old.graph
        else:
            kept = (
                torch.utils._pytree.tree_map_only(torch.Tensor, _weak_alias, out)
                if s.weak_outputs
                else out
            )
        ints = tuple(args[i] for i in self._int_idx)
        aliased = _aliases(out, static)
        self._entries[size] = _PieceEntry(
            graph, dsts, ints, kept, ptrs, s.pool, aliased, captured.args
        )
        return out

    def graph_at(self, size: int) -> Graph | None:
        """This piece's graph of ``size`` (None: not captured), for provenance."""
        e = self._entries.get(size)
        return e.graph if e is not None else None

    def take_args(self, size: int) -> GraphArgs | None:
        """What the capture of this piece's graph of ``size`` read (once: provenance
        classifies it, and the words are not kept)."""
        e = self._entries.get(size)
        if e is None:
            return None
        args, e.args = e.args, None
        return args

    def pool_at(self, size: int) -> Any:
        """The pool this piece's graph of ``size`` was captured into (None: no graph)."""
        e = self._entries.get(size)
        return e.pool if e is not None else None

    def alone_ok(self, size: int) -> bool:
        """Whether this piece's graph of ``size`` can be recaptured alone: it exists and
        its outputs can be copied back where the old graph wrote them (none shares
        storage with an input or memory between its own elements)."""
        e = self._entries.get(size)
        return e is not None and not e.aliased

    def take_replaced(self, size: int) -> Graph | None:
        """The graph a recapture of this piece alone replaced at ``size`` (once), alive."""
        return self._replaced.pop(size, None)

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
            for g in self._replaced.values():
                free_graph(g)
            self._entries.clear()
            self._replaced.clear()
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


def alone_or_whole(
    pieces: Sequence[PiecewiseGraph],
    graphs: Mapping[int, Iterable[int]],
    captured: Collection[int],
    shared_pool: Any,
) -> tuple[dict[int, frozenset[int]], list[int]]:
    """Split a recapture of the pieces ``graphs[size]`` into the sizes whose named
    pieces can be recaptured alone (size -> pieces) and the sizes recaptured whole: every
    piece of it named, none left in ``shared_pool`` (whose memory the new graphs' copies
    write into), or a named piece whose output shares storage with an input. Sizes not
    ``captured``, and pieces without a graph of the size, are left out."""
    alone: dict[int, frozenset[int]] = {}
    whole: list[int] = []
    by_index = {p.index: p for p in pieces}
    for size, named in sorted(graphs.items()):
        if size not in captured:
            continue
        have = {p.index for p in pieces if p.graph_at(size) is not None}
        want = frozenset(named) & have
        if not want:
            continue
        stays = [i for i in have - want if by_index[i].pool_at(size) == shared_pool]
        if stays and all(by_index[i].alone_ok(size) for i in want):
            alone[size] = want
        else:
            whole.append(size)
    return alone, whole


def _into(old: Any, new: Any, where: str) -> Any:
    """Copy the leaves of ``new`` into the tensors of ``old`` (the same structure and
    layout), inside the capture: the recaptured graph writes where its old one did.
    Returns ``old``."""
    old_leaves, old_spec = torch.utils._pytree.tree_flatten(old)
    new_leaves, new_spec = torch.utils._pytree.tree_flatten(new)
    problems = [] if old_spec == new_spec else ["the output structure changed"]
    for i, (o, n) in enumerate(zip(old_leaves, new_leaves)):
        if isinstance(o, torch.Tensor) != isinstance(n, torch.Tensor):
            problems.append(f"output {i} is a tensor in one capture and not the other")
        elif isinstance(o, torch.Tensor) and (
            o.dtype != n.dtype or o.shape != n.shape or o.device != n.device
        ):
            problems.append(
                f"output {i}: {o.dtype} {list(o.shape)} before, {n.dtype} {list(n.shape)} now"
            )
        elif not isinstance(o, torch.Tensor) and o != n:
            problems.append(f"output {i}: {o!r} before, {n!r} now")
    if problems:
        raise GraphGuardError(
            f"{where}: recaptured alone, its outputs must match the old graph's (the next "
            f"pieces read them where it wrote them), but {'; '.join(problems)}; recapture "
            "every size whole: runner.recapture(reason=...)"
        )
    with torch.no_grad():
        for o, n in zip(old_leaves, new_leaves):
            if isinstance(o, torch.Tensor) and n.data_ptr() != o.data_ptr():
                o.copy_(n)
    return old


def _aliases(out: Any, args: Sequence[Any]) -> bool:
    """Whether an output of ``out`` shares storage with a tensor of ``args`` (empty
    storages, all at address 0, share nothing), or has elements that share memory (an
    ``expand``: nothing can be copied into it)."""
    inputs = {0}
    for a in args:
        if isinstance(a, torch.Tensor):
            with contextlib.suppress(RuntimeError, NotImplementedError):
                inputs.add(int(a.untyped_storage().data_ptr()))
    overlap = getattr(torch._C, "_debug_has_internal_overlap", None)
    for t in torch.utils._pytree.tree_leaves(out):
        if isinstance(t, torch.Tensor):
            try:
                ptr = int(t.untyped_storage().data_ptr())
            except (RuntimeError, NotImplementedError):
                return True
            if ptr and ptr in inputs:
                return True
            if callable(overlap) and overlap(t) == 1:
                return True
    return False


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


__all__ = ["PiecewiseGraph", "alone_or_whole"]
