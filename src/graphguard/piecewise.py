"""PIECEWISE graphs: ``torch.compile`` once, split at chosen ops, one CUDA graph per piece and size.

Some ops do not graph well for every batch: attention over a ragged prefill batch
reads per-request lengths on the host, picks kernels per shape, or launches a
data-dependent grid. PIECEWISE mode captures everything *between* such ops and runs
the ops themselves eagerly, so a mixed batch still saves most of its launch overhead.

How it works:

1. :class:`PiecewiseRunner` compiles the callable once with ``torch.compile`` and the
   token dimension of every input marked dynamic, so one FX graph serves every size
   (``compile_count`` stays 1; a recompile is logged as a warning).
2. :class:`PiecewiseCompiler` is the ``torch.compile`` backend. It receives the FX
   ``GraphModule``, splits it at every call of a *split op* with
   ``torch.fx.passes.split_module.split_module`` (each split op alone in its own
   submodule), wraps every other submodule (a *piece*) in a :class:`PiecewiseGraph`
   and every split-op submodule in an eager wrapper.
3. The runner drives the capture lifecycle of :mod:`graphguard.capture` (hooks, gc
   frozen, largest size first, warmups each followed by a synchronize, one shared
   pool). "Capturing size ``n``" runs the compiled callable once on the static input
   buffers padded to ``n``; each piece it reaches captures its own graph into the
   shared pool, and the split ops between them run eagerly (in phase WARMUP, so no
   auxiliary-stream work crosses the next piece's capture).
4. Serving, the runner copies the inputs into its static buffers, pads to the next
   captured size and runs the compiled callable: every piece replays its graph for
   that size, the split ops run eagerly on the real (padded) tensors.

Which size a piece replays is decided in one place, the runner, and handed to the
pieces through a shared session object: a piece's inputs need not carry the token
count in an obvious dimension (after a reshape to ``(heads, tokens, dim)``, or a piece
with no token-shaped input), so reading it off shapes would be a guess.

Memory (why the shared pool does not grow with the number of sizes):

* Inputs a piece receives from a split op are fresh eager allocations on every call,
  so each such input is copied into a static buffer owned by the piece (one flat
  buffer per input, sized at the largest size, outside the graph pool). Inputs that
  are the runner's static buffers, parameters, or outputs of other pieces are at the
  same address on every replay of a size and are passed through without a copy
  (checked once per piece and size on the first replay).
* Piece outputs live in the shared pool. On CUDA the pieces keep only *non-owning
  aliases* of them: when the capture forward of a size returns, its outputs are freed
  back to the pool, and the next (smaller) size's graphs reuse those blocks; the
  ladder costs about what its largest size costs, as in FULL mode. This is safe
  because graphs of one pool replay one at a time on one stream, each replays its
  pieces in capture order (a piece's inputs are written by graphs replayed before it
  in the same call), and nothing but a capture into this pool can be handed a pool
  block. The price is the same contract as ``torch.cuda.graph``: outputs are valid
  until the next call of the runner. (With :class:`~graphguard.backend.RecordingBackend`
  on the CPU there is no pool, and the pieces keep their outputs.)

A batch above the largest captured size runs ``fn`` eagerly (no capture outside the
window, ever): a lazy capture while serving is exactly what the capture tripwire
exists to stop, and raising would turn a batch above the largest size into an outage.
The eager run is logged once per size. Inside the compiled callable, a piece asked to
replay a size it has no graph for runs its FX code eagerly.

Capture and serve under the same grad mode (``torch.inference_mode()`` or
``torch.no_grad()``): dynamo guards on it, and a new grad mode compiles a second graph
whose pieces have no graphs (logged as a recompile warning; results stay correct).
"""

from __future__ import annotations

import contextlib
import logging
import operator
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx
from torch.fx.passes.split_module import split_module

from graphguard import capture as lifecycle
from graphguard import phase
from graphguard.backend import CudaBackend, Graph, GraphBackend
from graphguard.buffers import (
    InputSpec,
    StaticInputs,
    flatten,
    make_specs,
    raise_input_mismatch,
    unflatten,
)
from graphguard.config import Mode, validate_capture_options
from graphguard.errors import ConfigError, GraphGuardError
from graphguard.phase import Phase
from graphguard.report import CaptureReport
from graphguard.sizes import PaddingTable, resolve_sizes
from graphguard.workspace import Workspace

logger = logging.getLogger("graphguard")

SplitOp = str | torch._ops.OpOverload | torch._ops.OpOverloadPacket | Callable[..., Any]
"""A split op: ``"ns::name"``, ``torch.ops.ns.name`` (any overload), or a Python callable."""

_EAGER, _CAPTURE, _REPLAY = 0, 1, 2
_foreach_copy = torch._foreach_copy_


# ----------------------------------------------------------------------------- session


@dataclass
class _Session:
    """What the runner tells the pieces: run eagerly, capture size ``size``, or replay it."""

    state: int = _EAGER
    size: int = 0
    backend: GraphBackend | None = None
    pool: Any = None
    error_mode: str = "global"
    weak_outputs: bool = False
    owner: str = "piecewise"


# ------------------------------------------------------------------------- split ops


def _op_name(target: Any) -> str | None:
    if isinstance(target, torch._ops.OpOverload):
        return str(target._schema.name)
    if isinstance(target, torch._ops.OpOverloadPacket):
        return str(target._qualified_op_name)
    return None


class SplitMatcher:
    """Decides whether an FX node calls a split op.

    Ops match by qualified name (``"ns::name"``), so a packet, any overload and the
    string all select the same op; dynamo records custom ops as packets, AOT graphs
    as overloads. Other callables (e.g. ``torch.nn.functional.scaled_dot_product_attention``)
    match by identity.
    """

    def __init__(self, split_ops: Sequence[SplitOp]) -> None:
        self.names: set[str] = set()
        self.callables: set[Any] = set()
        for op in split_ops:
            if isinstance(op, str):
                if "::" not in op:
                    raise ConfigError(f"split op {op!r}: give the qualified name 'namespace::op'")
                self.names.add(op.split(".")[0])
                continue
            name = _op_name(op)
            if name is not None:
                self.names.add(name)
            elif callable(op):
                self.callables.add(op)
            else:
                raise ConfigError(f"split op {op!r} is neither an op, its name nor a callable")

    def __call__(self, node: torch.fx.Node) -> bool:
        if node.op != "call_function":
            return False
        name = _op_name(node.target)
        if name is not None:
            return name in self.names
        try:
            return node.target in self.callables
        except TypeError:
            return False

    def describe(self) -> list[str]:
        return sorted(self.names) + sorted(
            getattr(c, "__qualname__", repr(c)) for c in self.callables
        )


@dataclass
class SplitGraph:
    """The result of splitting one FX graph: the parent module and what its children are."""

    module: torch.fx.GraphModule
    """Parent module; calling it runs pieces and split ops in order."""
    pieces: list[str]
    """Submodule names of the pieces (captured), in call order."""
    split_ops: list[str]
    """Submodule names of the split ops (eager), in call order."""
    copied_inputs: dict[str, list[int]] = field(default_factory=dict)
    """Per piece, the positions of inputs produced by split ops (copied into static buffers)."""


def split_graph(gm: torch.fx.GraphModule, is_split: Callable[[torch.fx.Node], bool]) -> SplitGraph:
    """Split ``gm`` so that each split-op call is alone in a submodule.

    Consecutive non-split nodes form one piece; ``getitem`` on a split op's result
    stays with the split op, so pieces receive tensors, not tuples. A graph without
    split ops is one piece.
    """
    part = 0
    assignment: dict[torch.fx.Node, int] = {}
    split_parts: set[int] = set()
    for node in gm.graph.nodes:
        if node.op in ("placeholder", "output"):
            continue
        src = node.args[0] if node.args else None
        if (
            node.op == "call_function"
            and node.target is operator.getitem
            and isinstance(src, torch.fx.Node)
            and assignment.get(src) in split_parts
        ):
            assignment[node] = assignment[src]
            continue
        if is_split(node):
            part += 1
            assignment[node] = part
            split_parts.add(part)
            part += 1
        else:
            assignment[node] = part
    parent = split_module(gm, gm, lambda n: assignment[n], keep_original_order=True)
    pieces: list[str] = []
    splits: list[str] = []
    copied: dict[str, list[int]] = {}
    for node in parent.graph.nodes:
        if node.op != "call_module":
            continue
        name = str(node.target)
        if int(name.rsplit("_", 1)[-1]) in split_parts:
            splits.append(name)
            continue
        pieces.append(name)
        idx = []
        for i, arg in enumerate(node.args):
            src = arg
            while (
                isinstance(src, torch.fx.Node)
                and src.op == "call_function"
                and src.target is operator.getitem
            ):
                src = src.args[0]
            if (
                isinstance(src, torch.fx.Node)
                and src.op == "call_module"
                and int(str(src.target).rsplit("_", 1)[-1]) in split_parts
            ):
                idx.append(i)
        copied[name] = idx
    return SplitGraph(parent, pieces, splits, copied)


# ---------------------------------------------------------------------------- pieces


def _weak_alias(t: torch.Tensor) -> torch.Tensor:
    """A tensor over ``t``'s memory that does not own it (see the module docstring)."""
    st = t.untyped_storage()
    storage = torch._C._construct_storage_from_data_pointer(st.data_ptr(), t.device, st.nbytes())
    with torch.inference_mode(False), torch.no_grad():
        out = torch.empty(0, dtype=t.dtype, device=t.device)
        out.set_(storage, t.storage_offset(), t.shape, t.stride())
    return out


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
        self, module: torch.nn.Module, index: int, copied_inputs: Sequence[int], session: _Session
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
        if s.state == _REPLAY:
            e = self._entries.get(s.size)
            if e is not None:
                return self._replay(e, args)
        elif s.state == _CAPTURE:
            return self.capture_at(s.size, args)
        return self.module(*args)

    def _replay(self, e: _PieceEntry, args: tuple[Any, ...]) -> Any:
        if e.dsts:
            _foreach_copy(e.dsts, [args[i] for i in self.copied_inputs])
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
            body, pool=s.pool, error_mode=s.error_mode, label=(size, self.index)
        )
        kept = (
            torch.utils._pytree.tree_map_only(torch.Tensor, _weak_alias, out)
            if s.weak_outputs
            else out
        )
        ints = tuple(args[i] for i in self._int_idx)
        self._entries[size] = _PieceEntry(graph, dsts, ints, kept, ptrs)
        return out

    def drop(self, size: int | None = None) -> None:
        """Forget the graph of ``size`` (all sizes when None)."""
        if size is None:
            self._entries.clear()
            self._static_bufs.clear()
            self._retired.clear()
        else:
            self._entries.pop(size, None)

    def extra_repr(self) -> str:
        return (
            f"index={self.index}, copied_inputs={list(self.copied_inputs)}, "
            f"sizes={len(self._entries)}"
        )


class _EagerSplit(torch.nn.Module):
    """A split-op submodule: always eager; in phase WARMUP while a size is being captured.

    WARMUP turns auxiliary-stream overlap off, so nothing the op forks can still be
    running when the next piece's capture begins (seed ``000``).
    """

    def __init__(self, module: torch.nn.Module, session: _Session) -> None:
        super().__init__()
        self.module = module
        self._session = session

    def forward(self, *args: Any) -> Any:
        if self._session.state == _CAPTURE:
            with phase.enter(Phase.WARMUP, owner=self._session.owner):
                return self.module(*args)
        return self.module(*args)


# -------------------------------------------------------------------------- compiler


class PiecewiseCompiler:
    """A ``torch.compile`` backend that splits the graph at split ops and wraps the pieces.

    Use it through :class:`PiecewiseRunner`, or alone to inspect the split::

        compiler = PiecewiseCompiler(split_ops=["mylib::attention"])
        compiled = torch.compile(model, backend=compiler, dynamic=True)
        compiled(x)          # pieces run eagerly: no runner, no graphs
        compiler.pieces, compiler.split_ops, compiler.graphs[0]   # what was split

    Attributes:
        graphs: every FX graph dynamo handed over (one per compile; more means a
            recompile or a graph break).
        splits: the :class:`SplitGraph` of each.
        pieces: every :class:`PiecewiseGraph`, in call order.
        compile_count: how many graphs were compiled.
    """

    def __init__(
        self,
        split_ops: Sequence[SplitOp],
        *,
        name: str = "piecewise",
        session: _Session | None = None,
    ) -> None:
        self.matcher = SplitMatcher(split_ops)
        self.name = name
        self.session = session if session is not None else _Session(owner=name)
        self.graphs: list[torch.fx.GraphModule] = []
        self.splits: list[SplitGraph] = []
        self.pieces: list[PiecewiseGraph] = []

    @property
    def compile_count(self) -> int:
        return len(self.graphs)

    @property
    def split_ops(self) -> list[str]:
        """Names of the split-op submodules of every compiled graph, in call order."""
        return [n for sg in self.splits for n in sg.split_ops]

    def __call__(
        self, gm: torch.fx.GraphModule, example_inputs: Sequence[Any]
    ) -> Callable[..., Any]:
        self.graphs.append(gm)
        sg = split_graph(gm, self.matcher)
        for name in sg.pieces:
            piece = PiecewiseGraph(
                sg.module.get_submodule(name),
                len(self.pieces),
                sg.copied_inputs[name],
                self.session,
            )
            setattr(sg.module, name, piece)
            self.pieces.append(piece)
        for name in sg.split_ops:
            setattr(sg.module, name, _EagerSplit(sg.module.get_submodule(name), self.session))
        self.splits.append(sg)
        split_nodes = sum(1 for n in gm.graph.nodes if self.matcher(n))
        msg = (
            f"{self.name}: graph {len(self.graphs)} split into {len(sg.pieces)} pieces at "
            f"{split_nodes} split-op calls ({', '.join(self.matcher.describe()) or 'none'})"
        )
        if len(self.graphs) > 1:
            logger.warning(
                "%s; this is compile number %d: a recompile (a guard failed, e.g. a new "
                "dtype or a dimension that is not the token dimension changed) or a graph "
                "break. Graphs of each compile are captured separately.",
                msg,
                len(self.graphs),
            )
        else:
            logger.info("%s", msg)
        return sg.module


# ---------------------------------------------------------------------------- runner


@contextlib.contextmanager
def _size_oblivious() -> Iterator[None]:
    """Compile without specializing the token dimension on sizes 0 and 1.

    By default dynamo specializes a dynamic dimension that is 1 at runtime, so a batch
    of 1 token would recompile. ``backed_size_oblivious`` (torch >= 2.8) keeps one
    graph for every size; older versions recompile once for size 1 (logged).
    """
    try:
        import torch.fx.experimental._config as fx_config
    except ImportError:  # pragma: no cover - very old torch
        yield
        return
    if not hasattr(fx_config, "backed_size_oblivious"):
        yield
        return
    with fx_config.patch(backed_size_oblivious=True):  # type: ignore[attr-defined]
        yield


class _Entry:
    """Everything the hot path needs for one batch size ``n``."""

    __slots__ = ("dsts", "n", "sig", "size", "tail_dsts", "tail_srcs", "views")

    def __init__(self, **kw: Any) -> None:
        for k, v in kw.items():
            setattr(self, k, v)


class _SizeGraph:
    """What the lifecycle registers per size: replay runs the compiled callable at that size."""

    __slots__ = ("_runner", "size")

    def __init__(self, runner: PiecewiseRunner, size: int) -> None:
        self._runner = runner
        self.size = size

    def replay(self) -> None:
        self._runner._run(self.size, self._runner.static.views(self.size))


class _PieceCapture:
    """The lifecycle's backend during a piecewise capture: one "capture" = one forward.

    Every piece reached by the forward captures its own graph on the real backend,
    into the pool the lifecycle chose; a failure drops that size from every piece, so
    no size is ever half-captured.
    """

    def __init__(self, runner: PiecewiseRunner, inner: GraphBackend) -> None:
        self._runner = runner
        self.inner = inner
        self.name = f"{inner.name}/piecewise"

    def synchronize(self) -> None:
        self.inner.synchronize()

    def stream(self) -> contextlib.AbstractContextManager[Any]:
        return self.inner.stream()

    def new_pool(self) -> Any:
        return self.inner.new_pool()

    def reserved_bytes(self) -> int:
        return self.inner.reserved_bytes()

    def empty_cache(self) -> None:
        self.inner.empty_cache()

    def capture(
        self, body: Callable[[], Any], *, pool: Any, error_mode: str, label: Any = None
    ) -> tuple[Graph, Any]:
        size = int(label)
        s = self._runner.session
        s.backend, s.pool, s.error_mode, s.size = self.inner, pool, error_mode, size
        s.state = _CAPTURE
        try:
            with self.inner.stream():
                body()
        except BaseException:
            for piece in self._runner.pieces:
                piece.drop(size)
            raise
        finally:
            s.state = _EAGER
        # The forward's outputs are not kept: they would pin this size's pool blocks.
        return _SizeGraph(self._runner, size), None


class PiecewiseRunner:
    """Compile ``fn`` once, split it at ``split_ops``, capture the pieces per size, replay.

    Args:
        fn: the callable (a module or function); inputs positional, the first dimension
            of each (``batch_dims``) is the token dimension.
        example_inputs: one tensor per input (dtype, device, shape apart from the token
            dimension).
        split_ops: ops that run eagerly between the pieces (e.g. attention):
            ``"ns::name"``, ``torch.ops.ns.name`` or a callable.
        sizes: token counts to capture (default ``capture_sizes(max_size)``).
        max_size: the largest size when ``sizes`` is not given (default: the example
            inputs' token count).
        mode: ``"piecewise"``, or ``"none"`` for everything eager through the same API.
        batch_dims, fill_values, names: as for :class:`~graphguard.runner.GraphRunner`.
        warmup_iters: uncaptured forwards per size before its capture, each followed by
            a device synchronize.
        before_capture, after_capture, workspaces: as for GraphRunner.
        copy_outputs: return owned clones instead of views into graph memory.
        capture_error_mode, on_capture_error, progress, backend, name: as for GraphRunner.
        fullgraph: passed to ``torch.compile``; True by default, because a graph break
            would run Python eagerly between pieces and could hide a host sync.

    Contract: outputs are views into memory the next call overwrites; clone what you
    keep. Replay adds no synchronization; split ops run eagerly on the current stream.
    A runner is not thread-safe.
    """

    def __init__(
        self,
        fn: Callable[..., Any],
        example_inputs: Sequence[torch.Tensor],
        *,
        split_ops: Sequence[SplitOp],
        sizes: Sequence[int] | None = None,
        max_size: int | None = None,
        mode: Mode | str = Mode.PIECEWISE,
        batch_dims: int | Sequence[int] = 0,
        fill_values: int | float | bool | Sequence[int | float | bool] = 0,
        names: Sequence[str] | None = None,
        warmup_iters: int = 1,
        before_capture: Sequence[lifecycle.Hook] = (),
        after_capture: Sequence[lifecycle.Hook] = (),
        workspaces: Sequence[Workspace] = (),
        copy_outputs: bool = False,
        capture_error_mode: str = "global",
        on_capture_error: str = "raise",
        progress: bool = True,
        backend: GraphBackend | None = None,
        name: str | None = None,
        fullgraph: bool = True,
    ) -> None:
        self.fn = fn
        self.name = name or getattr(fn, "__qualname__", None) or type(fn).__name__
        self.mode = Mode.parse(mode)
        if self.mode not in (Mode.PIECEWISE, Mode.NONE):
            raise ConfigError(
                f"PiecewiseRunner runs mode 'piecewise' or 'none', got {self.mode.value!r}: use "
                "GraphRunner for FULL graphs, and graphguard.dispatch.Dispatcher to combine both "
                "for FULL_AND_PIECEWISE"
            )
        self.specs: list[InputSpec] = make_specs(
            example_inputs, batch_dims=batch_dims, fill_values=fill_values, names=names
        )
        self.sizes = resolve_sizes(
            sizes, max_size, int(example_inputs[0].shape[self.specs[0].batch_dim])
        )
        validate_capture_options(
            warmup_iters=warmup_iters,
            on_capture_error=on_capture_error,
            capture_error_mode=capture_error_mode,
        )
        self.warmup_iters = warmup_iters
        self.before_capture = list(before_capture)
        self.after_capture = list(after_capture)
        self.workspaces = list(workspaces)
        self.copy_outputs = copy_outputs
        self.capture_error_mode = capture_error_mode
        self.on_capture_error = on_capture_error
        self.progress = progress
        self.fullgraph = fullgraph
        self._backend = backend
        self.session = _Session(owner=f"PiecewiseRunner({self.name})")
        self.compiler = PiecewiseCompiler(split_ops, name=self.name, session=self.session)
        self.static = StaticInputs(self.specs, self.sizes[-1])
        self._lead_dim = self.specs[0].batch_dim
        self._compiled: Callable[..., Any] | None = None
        self.report: CaptureReport | None = None
        self._eager_logged: set[int] = set()
        self._reset_graphs()

    # ------------------------------------------------------------------ state

    def _reset_graphs(self) -> None:
        self._captured_sizes: set[int] = set()
        self._table = PaddingTable(())
        self._entries: list[_Entry | None] = [None]
        self._dirty = self.static.max_size
        self._refill_always = False
        self._captured = False

    @property
    def backend(self) -> GraphBackend:
        """The device backend (created on first use: a CudaBackend on the inputs' device)."""
        if self._backend is None:
            dev = self.specs[0].device
            if dev.type != "cuda":
                raise ConfigError(
                    f"{self.name}: CUDA graphs need CUDA tensors, but the example inputs are on "
                    f"{dev}. Use mode='none' to run eagerly, or RecordingBackend in tests."
                )
            self._backend = CudaBackend(dev)
        return self._backend

    @property
    def pieces(self) -> list[PiecewiseGraph]:
        """Every piece of the compiled graph(s), in call order."""
        return self.compiler.pieces

    @property
    def compile_count(self) -> int:
        """Graphs dynamo compiled; 1 means one graph serves every size."""
        return self.compiler.compile_count

    @property
    def captured_sizes(self) -> tuple[int, ...]:
        """Sizes that have piece graphs, ascending."""
        return self._table.sizes

    @property
    def max_size(self) -> int:
        """The largest captured size; larger batches run the pieces eagerly."""
        return self._table.max_size

    def padded_size(self, n: int) -> int | None:
        """The captured size a batch of ``n`` tokens replays at, or None when it runs eagerly."""
        return self._table.padded(n)

    # ---------------------------------------------------------------- compile

    def compile(self) -> Callable[..., Any]:
        """Compile ``fn`` (once) with the token dimension dynamic; return the compiled callable.

        Runs one eager forward at the largest size on the static buffers (phase WARMUP).
        ``capture()`` calls it first; call it yourself to inspect the split on any device.
        """
        if self._compiled is not None:
            return self._compiled
        views = self.static.views(self.sizes[-1])
        for v, spec in zip(views, self.specs):
            torch._dynamo.mark_dynamic(v, spec.batch_dim)
        compiled = torch.compile(
            self.fn, backend=self.compiler, fullgraph=self.fullgraph, dynamic=None
        )
        with _size_oblivious(), phase.enter(Phase.WARMUP, owner=self.session.owner):
            compiled(*views)
        if not self.compiler.graphs:
            raise GraphGuardError(
                f"{self.name}: torch.compile ran without calling the graphguard backend, so "
                "nothing was split. Usually dynamo's recompile limit for this code object was "
                "reached (torch._dynamo.config.recompile_limit; call torch._dynamo.reset() "
                "between runners of the same function in tests) or the function is skipped."
            )
        self._compiled = compiled
        return compiled

    def describe(self) -> str:
        """One line on the split: pieces, split-op calls, compiles."""
        if not self.compiler.graphs:
            return f"{self.name}: not compiled yet"
        return (
            f"{self.name}: {len(self.pieces)} pieces, {len(self.compiler.split_ops)} eager "
            f"split-op calls ({', '.join(self.compiler.matcher.describe())}), "
            f"{self.compile_count} compile(s)"
        )

    # ---------------------------------------------------------------- capture

    def capture(self) -> CaptureReport:
        """Compile, then run the capture lifecycle; every piece captures at every size.

        Raises :class:`GraphCaptureError` (with ``on_capture_error="raise"``) after
        keeping every size that did capture in full.
        """
        if self._captured:
            raise GraphGuardError(
                f"{self.name}: already captured {list(self.captured_sizes)}; call release() "
                "and capture() again to recapture on purpose"
            )
        if self.mode is Mode.NONE:
            self._captured = True
            self.report = CaptureReport(mode=self.mode.value, backend="none")
            logger.info("%s: mode none, every call runs eagerly", self.name)
            return self.report
        inner = self.backend
        self.session.weak_outputs = isinstance(inner, CudaBackend)

        def compile_hook(sizes: Sequence[int]) -> None:
            self.compile()

        plan = lifecycle.CapturePlan(
            owner=self.session.owner,
            sizes=sorted(self.sizes, reverse=True),
            warmup=self._warmup_forward,
            body=self._capture_body,
            register=self._register,
            warmup_iters=self.warmup_iters,
            before_capture=[compile_hook, *self.before_capture],
            after_capture=self.after_capture,
            workspaces=self.workspaces,
            error_mode=self.capture_error_mode,
            on_error=self.on_capture_error,
            progress=self.progress,
            mode=self.mode.value,
        )
        try:
            self.report = lifecycle.run(plan, _PieceCapture(self, inner))
        finally:
            self._captured = True
            self._build_entries()
        logger.info("%s", self.describe())
        return self.report

    def release(self) -> None:
        """Drop every piece graph and static piece buffer; calls fail until capture() runs."""
        if self._backend is not None and self._captured_sizes:
            self._backend.synchronize()
        for piece in self.pieces:
            piece.drop()
        self._reset_graphs()

    def _warmup_forward(self, size: int) -> None:
        assert self._compiled is not None
        snap = None if self._refill_always else self.static.snapshot()
        self._compiled(*self.static.views(size))
        if snap is not None:
            written = self.static.written_since(snap)
            if written:
                self._refill_always = True
                logger.info(
                    "%s: the callable writes its inputs %s in place; padded rows are refilled "
                    "on every call",
                    self.name,
                    written,
                )

    def _capture_body(self, size: int) -> Callable[[], Any]:
        compiled = self._compiled
        assert compiled is not None
        views = self.static.views(size)

        def body() -> Any:
            return compiled(*views)

        return body

    def _register(self, size: int, graph: Graph, result: Any) -> None:
        self._captured_sizes.add(size)

    def _build_entries(self) -> None:
        self._table = PaddingTable(sorted(self._captured_sizes))
        self._entries = [None] * (self._table.max_size + 1)
        views_at = {s: self.static.views(s) for s in self._captured_sizes}
        for n in range(1, self._table.max_size + 1):
            size = self._table.padded(n)
            assert size is not None
            dsts = self.static.views(n)
            tail_dsts, tail_srcs = self.static.tails(n)
            self._entries[n] = _Entry(
                n=n,
                size=size,
                sig=[(v.shape, v.dtype, v.device) for v in dsts],
                dsts=dsts,
                tail_dsts=tail_dsts,
                tail_srcs=tail_srcs,
                views=views_at[size],
            )

    # ----------------------------------------------------------------- replay

    def _run(self, size: int, views: Sequence[torch.Tensor]) -> Any:
        assert self._compiled is not None
        s = self.session
        s.size = size
        s.state = _REPLAY
        try:
            return self._compiled(*views)
        finally:
            s.state = _EAGER

    def __call__(self, *inputs: Any) -> Any:
        """Run a batch: pad to the next captured size and replay the pieces, or run eagerly.

        Returns views valid until the next call (see the class docstring).
        """
        try:
            e = self._entries[inputs[0].shape[self._lead_dim]]
            ok = e is not None and [(x.shape, x.dtype, x.device) for x in inputs] == e.sig
        except (IndexError, AttributeError, TypeError):
            ok = False
        if not ok:
            return self._call_slow(inputs)
        assert e is not None
        _foreach_copy(e.dsts, inputs)
        if self._dirty > e.n or self._refill_always:
            _foreach_copy(e.tail_dsts, e.tail_srcs)
        self._dirty = e.n
        out = self._run(e.size, e.views)
        if e.n != e.size or self.copy_outputs:
            out = self._trim(out, e.n, e.size)
        return out

    def _trim(self, out: Any, n: int, size: int) -> Any:
        leaves, spec = flatten(out)
        trimmed = [
            x.narrow(0, 0, n)
            if isinstance(x, torch.Tensor) and x.ndim > 0 and x.shape[0] == size
            else x
            for x in leaves
        ]
        if self.copy_outputs:
            trimmed = [x.clone() if isinstance(x, torch.Tensor) else x for x in trimmed]
        return unflatten(trimmed, spec)

    def _call_slow(self, inputs: tuple[Any, ...]) -> Any:
        """Validation errors, eager runs, and the not-captured-yet error."""
        raise_input_mismatch(inputs, self.specs, self.name)
        n = int(inputs[0].shape[self._lead_dim])
        if self.mode is not Mode.NONE and not self._captured:
            raise GraphGuardError(
                f"{self.name}: called with {n} tokens before capture(); call runner.capture() "
                "first (or build the runner with mode='none')"
            )
        if n not in self._eager_logged:
            self._eager_logged.add(n)
            if self.mode is Mode.NONE:
                why = "mode is none"
            elif not self._table.sizes:
                why = "no size captured"
            else:
                why = f"it is above the largest captured size {self._table.max_size}"
            logger.info("%s: %d tokens run eagerly (%s); logged once per size", self.name, n, why)
        return self.eager(*inputs)

    def eager(self, *inputs: Any) -> Any:
        """Run ``fn`` eagerly on the caller's tensors (no padding, no graphs, no dynamo).

        Not the compiled callable: the caller's tensors may differ from the static
        buffers in ways dynamo guards on (inference tensors, strides), and a batch above
        the largest size must not cost a recompile. The split graph runs the same ops.
        """
        return self.fn(*inputs)

    def __repr__(self) -> str:
        return (
            f"PiecewiseRunner({self.name}, mode={self.mode.value}, sizes={len(self.sizes)} up to "
            f"{self.sizes[-1]}, pieces={len(self.pieces)}, captured={len(self._captured_sizes)})"
        )


__all__ = [
    "PiecewiseCompiler",
    "PiecewiseGraph",
    "PiecewiseRunner",
    "SplitGraph",
    "SplitMatcher",
    "SplitOp",
    "split_graph",
]
