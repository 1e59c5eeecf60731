"""``GraphRunner``: one callable, a ladder of batch sizes, one CUDA graph per size.

The replay path (``runner(*inputs)``) is: one list index to find the entry for the
batch size, one C-level comparison of every input's (shape, dtype, device) against
what was captured, one fused copy of all inputs into the static buffers, a refill of
padded rows only when the batch shrank, ``graph.replay()``, and cached output views.
Nothing on it allocates, synchronizes or logs.
"""

from __future__ import annotations

import logging
import operator
import os
from collections.abc import Callable, Sequence
from typing import Any

import torch

from graphguard import capture as lifecycle
from graphguard.backend import CudaBackend, Graph, GraphBackend
from graphguard.buffers import (
    StaticInputs,
    flatten,
    immutable_structure,
    make_specs,
    raise_input_mismatch,
    unflatten,
)
from graphguard.config import Mode, validate_capture_options
from graphguard.errors import ConfigError, GraphGuardError
from graphguard.report import CaptureReport
from graphguard.sizes import PaddingTable, resolve_sizes, validate_sample_sizes, validate_sizes
from graphguard.state import StateSet
from graphguard.verify import verify
from graphguard.workspace import Workspace

logger = logging.getLogger("graphguard")

_signature = operator.attrgetter("shape", "dtype", "device")


def sanitize_enabled(flag: bool | None) -> bool:
    """The sanitize switch: an explicit flag wins, else ``GRAPHGUARD_SANITIZE=1``."""
    if flag is not None:
        return bool(flag)
    return os.environ.get("GRAPHGUARD_SANITIZE", "").strip().lower() in ("1", "true", "yes", "on")


_foreach_copy = torch._foreach_copy_


class _Entry:
    """Everything the hot path needs for one batch size ``n``, precomputed at capture."""

    __slots__ = ("dsts", "leaves", "n", "output", "replay", "sig", "size", "tail_dsts", "tail_srcs")
    dsts: list[torch.Tensor]
    leaves: list[Any]
    n: int
    output: Any
    replay: Callable[[], None]
    sig: list[Any]
    size: int
    tail_dsts: list[torch.Tensor]
    tail_srcs: list[torch.Tensor]

    def __init__(self, **kw: Any) -> None:
        for k, v in kw.items():
            setattr(self, k, v)


class _GraphSet:
    """The graphs of one capture and their outputs.

    With ``share_outputs`` the first (largest) graph's outputs are the static output
    buffers, and every smaller graph copies its outputs into their leading rows inside
    the graph, so its own output blocks return to the pool for the next capture: the
    ladder's pool stays close to the largest graph's alone.
    """

    def __init__(self, name: str, share_outputs: bool) -> None:
        self.name = name
        self.share_outputs = share_outputs
        self.graphs: dict[int, Graph] = {}
        self.graph_leaves: dict[int, list[Any]] = {}
        self.out_leaves: list[Any] | None = None
        self.out_spec: Any = None
        self.batched: list[bool] = []
        self.owner_size = 0
        self._pending_spec: Any = None

    def body(
        self, size: int, views: Sequence[torch.Tensor], forward: Callable[..., Any]
    ) -> Callable[[], list[Any]]:
        """The work recorded for ``size``: the forward plus, for smaller sizes, the copy-out."""

        def run() -> list[Any]:
            leaves, spec = flatten(forward(*views))
            owner = self.out_leaves
            if owner is None:
                self._pending_spec = spec
                return leaves
            self._check(size, leaves, spec)
            if not self.share_outputs:
                return leaves
            shared: list[Any] = []
            for mine, big, batched in zip(leaves, owner, self.batched):
                if isinstance(mine, torch.Tensor):
                    dst = big.narrow(0, 0, size) if batched else big
                    dst.copy_(mine)
                    shared.append(dst)
                else:
                    shared.append(mine)
            return shared

        return run

    def _check(self, size: int, leaves: list[Any], spec: Any) -> None:
        assert self.out_leaves is not None
        if spec != self.out_spec:
            raise GraphGuardError(
                f"{self.name}: at size {size} the output structure is {spec}, but at size "
                f"{self.owner_size} it was {self.out_spec}; return the same structure "
                "at every batch size"
            )
        for i, (mine, big, batched) in enumerate(zip(leaves, self.out_leaves, self.batched)):
            if not isinstance(big, torch.Tensor):
                continue
            want = (size, *big.shape[1:]) if batched else tuple(big.shape)
            if tuple(mine.shape) != want or mine.dtype != big.dtype:
                raise GraphGuardError(
                    f"{self.name}: output leaf {i} is {mine.dtype} {tuple(mine.shape)} at size "
                    f"{size}, expected {big.dtype} {want} (at size {self.owner_size} it was "
                    f"{tuple(big.shape)}). graphguard slices outputs along dim 0 by the batch "
                    "size; other dims must not depend on it"
                )

    def register(self, size: int, graph: Graph, leaves: list[Any]) -> None:
        """Keep a successful capture."""
        if self.out_leaves is None:
            self.out_leaves = leaves
            self.out_spec = self._pending_spec
            self.owner_size = size
            self.batched = [
                isinstance(x, torch.Tensor) and x.ndim > 0 and x.shape[0] == size for x in leaves
            ]
        elif not self.share_outputs:
            self.graph_leaves[size] = leaves
        self.graphs[size] = graph


class GraphRunner:
    """Capture ``fn`` as CUDA graphs for a ladder of batch sizes and replay them.

    Args:
        fn: the callable to capture, taking the inputs positionally and returning a
            tensor or a tuple / namedtuple / dict / dataclass of tensors.
        example_inputs: one tensor per input; they give dtype, device and the shape
            apart from the batch dimension (their batch size does not matter, their
            values are not used).
        sizes: capture sizes (any order, distinct, positive); default
            ``capture_sizes(max_size)``.
        max_size: the largest batch to capture when ``sizes`` is not given (default:
            the example inputs' batch size).
        mode: ``"full"`` (one graph per size) or ``"none"`` (everything eager through
            the same API).
        batch_dims: the batch dimension of each input (one int for all, or a list).
        fill_values: what padded rows hold, per input: make them harmless (token 0,
            position 0, a scratch KV slot). Static buffers hold these values during
            warmup and capture too.
        names: input names for error messages.
        warmup_iters: uncaptured forwards per size before its capture, each followed by a
            device synchronize.
        before_capture: hooks ``hook(sizes)`` run in phase WARMUP before the first capture,
            e.g. kernel warmups at realistic shapes so workspaces reach their final size.
        after_capture: hooks ``hook(sizes)`` run once every graph exists.
        workspaces: arenas to lock after a (non-profiling) capture.
        copy_outputs: return owned clones instead of views into graph memory.
        share_outputs: smaller graphs copy their outputs into the largest graph's output
            buffers, so the pool holds one set of outputs instead of one per size.
        capture_error_mode: passed to ``CUDAGraph.capture_begin`` (``"global"``,
            ``"thread_local"`` or ``"relaxed"``).
        on_capture_error: ``"raise"`` (stop at the first failing size, keep the graphs
            that exist, then raise :class:`GraphCaptureError`) or ``"skip"`` (log it,
            capture the remaining sizes, return the report).
        progress: show a tqdm bar while capturing.
        backend: the device backend (default :class:`CudaBackend` on the inputs' device).
        name: shown in logs, the progress bar and errors.
        state: tensors the callable updates in place (KV cache, position counters): a
            dict, list, module or object (see :class:`~graphguard.state.StateSet`).
            Capture and ``verify()`` leave them exactly as they found them.
        sanitize: turn on the sanitizer (:mod:`graphguard.sanitizer`); ``None`` reads the
            ``GRAPHGUARD_SANITIZE`` environment variable. Off, the replay path is exactly
            the fast path: the sanitizing runner is a subclass, chosen at construction.

    Contract: outputs are views into memory the next call overwrites (like
    ``torch.cuda.graph``); clone what you keep, or pass ``copy_outputs=True``. Replay is
    ordered on the current stream like any kernel launch and adds no synchronization.
    A runner is not thread-safe: call it from one thread.
    """

    def __new__(cls, *args: Any, sanitize: bool | None = None, **kwargs: Any) -> GraphRunner:
        """Build a :class:`~graphguard.sanitizer.SanitizingGraphRunner` when sanitizing."""
        if cls is GraphRunner and sanitize_enabled(sanitize):
            from graphguard.sanitizer import SanitizingGraphRunner

            cls = SanitizingGraphRunner
        return super().__new__(cls)

    def __init__(
        self,
        fn: Callable[..., Any],
        example_inputs: Sequence[torch.Tensor],
        *,
        sizes: Sequence[int] | None = None,
        max_size: int | None = None,
        mode: Mode | str = Mode.FULL,
        batch_dims: int | Sequence[int] = 0,
        fill_values: int | float | bool | Sequence[int | float | bool] = 0,
        names: Sequence[str] | None = None,
        warmup_iters: int = 1,
        before_capture: Sequence[lifecycle.Hook] = (),
        after_capture: Sequence[lifecycle.Hook] = (),
        workspaces: Sequence[Workspace] = (),
        copy_outputs: bool = False,
        share_outputs: bool = True,
        capture_error_mode: str = "global",
        on_capture_error: str = "raise",
        progress: bool = True,
        backend: GraphBackend | None = None,
        name: str | None = None,
        sanitize: bool | None = None,
        state: Any = None,
    ) -> None:
        self.sanitize = sanitize_enabled(sanitize)
        self.fn = fn
        self.name = name or getattr(fn, "__qualname__", None) or type(fn).__name__
        self.mode = Mode.parse(mode)
        if self.mode.has_piecewise:
            raise ConfigError(
                f"GraphRunner runs whole-callable graphs (mode 'full' or 'none'); mode "
                f"{self.mode.value!r} needs graphguard.piecewise"
            )
        self.specs = make_specs(
            example_inputs, batch_dims=batch_dims, fill_values=fill_values, names=names
        )
        self.sizes = resolve_sizes(
            sizes, max_size, int(example_inputs[0].shape[self.specs[0].batch_dim])
        )
        validate_capture_options(
            warmup_iters=warmup_iters,
            on_capture_error=on_capture_error,
            capture_error_mode=capture_error_mode,
            before_capture=before_capture,
            after_capture=after_capture,
            workspaces=workspaces,
            copy_outputs=copy_outputs,
            share_outputs=share_outputs,
            progress=progress,
        )
        self.warmup_iters = warmup_iters
        self.state: StateSet | None = StateSet.of(state) or None
        self.before_capture = list(before_capture)
        self.after_capture = list(after_capture)
        self.workspaces = list(workspaces)
        self.copy_outputs = copy_outputs
        self.share_outputs = share_outputs
        self.capture_error_mode = capture_error_mode
        self.on_capture_error = on_capture_error
        self.progress = progress
        self._backend = backend
        self.static = StaticInputs(self.specs, self.sizes[-1])
        self._lead_dim = self.specs[0].batch_dim
        self.report: CaptureReport | None = None
        self._eager_logged: set[int] = set()
        self._reset_graphs()

    # ------------------------------------------------------------------ state

    def _reset_graphs(self) -> None:
        self._set = _GraphSet(self.name, self.share_outputs)
        self._table = PaddingTable(())
        self._entries: list[_Entry | None] = [None]
        self._dirty = self.static.max_size
        # Without a warmup nothing detects a callable writing its inputs in place, so
        # padded rows are refilled on every call (one small fused copy) to never drift.
        self._refill_always = self.warmup_iters == 0
        self._captured = False

    @property
    def backend(self) -> GraphBackend:
        """The device backend (created on first use: a CudaBackend on the inputs' device)."""
        if self._backend is None:
            dev = self.specs[0].device
            if dev.type != "cuda":
                raise ConfigError(
                    f"{self.name}: CUDA graphs need CUDA tensors, but the example inputs are on "
                    f"{dev}. Use mode='none' to run eagerly through the same API."
                )
            self._backend = CudaBackend(dev)
        return self._backend

    @property
    def captured_sizes(self) -> tuple[int, ...]:
        """Sizes that have a graph, ascending."""
        return self._table.sizes

    @property
    def max_size(self) -> int:
        """The largest captured size; batches above it run eagerly."""
        return self._table.max_size

    def padded_size(self, n: int) -> int | None:
        """The captured size a batch of ``n`` replays at, or None when it runs eagerly."""
        return self._table.padded(n)

    def graph(self, size: int) -> Graph:
        """The captured graph of ``size`` (for benchmarks and debugging; replaying it
        directly skips the input copy and padding)."""
        try:
            return self._set.graphs[size]
        except KeyError:
            raise GraphGuardError(
                f"{self.name}: no graph of size {size}; captured {list(self.captured_sizes)}"
            ) from None

    # ---------------------------------------------------------------- capture

    def capture(self) -> CaptureReport:
        """Run the capture lifecycle (see :mod:`graphguard.capture`) and return its report.

        Raises :class:`GraphCaptureError` (with ``on_capture_error="raise"``) after
        keeping every size that did capture; the runner is consistent either way. A
        capture that kept no graph (a hook raised, an interrupt) may simply be retried.
        """
        if self._set.graphs:
            raise GraphGuardError(
                f"{self.name}: already captured {list(self.captured_sizes)}; call "
                "recapture(reason=...) to drop the graphs and capture again on purpose"
            )
        if self.mode is Mode.NONE:
            self._captured = True
            self.report = CaptureReport(mode=self.mode.value, backend="none")
            logger.info("%s: mode none, every call runs eagerly", self.name)
            return self.report
        plan = lifecycle.CapturePlan(
            owner=f"GraphRunner({self.name})",
            sizes=sorted(self.sizes, reverse=True),
            warmup=self._warmup_forward,
            body=lambda size: self._set.body(size, self.static.views(size), self._forward),
            register=self._set.register,
            warmup_iters=self.warmup_iters,
            before_capture=self.before_capture,
            after_capture=self.after_capture,
            workspaces=self.workspaces,
            error_mode=self.capture_error_mode,
            on_error=self.on_capture_error,
            progress=self.progress,
            mode=self.mode.value,
            discard=self._reset_graphs,
            state=self.state,
            static_inputs=self.static.buffers,
            watch=self.fn,
        )
        try:
            self.report = lifecycle.run(plan, self.backend)
        except BaseException:
            self._build_entries()
            self._captured = bool(self._set.graphs)
            raise
        self._captured = True
        self._build_entries()
        return self.report

    def recapture(self, *, reason: str) -> CaptureReport:
        """Drop every graph, unlock the arenas on purpose, and capture again.

        For deliberate changes (weights reloaded, a config changed). ``reason`` is logged
        and required, so a recapture never happens by accident.
        """
        if not reason:
            raise ConfigError("recapture needs a reason, e.g. recapture(reason='weights reloaded')")
        logger.warning("%s: recapturing (%s)", self.name, reason)
        self.release()
        for ws in self.workspaces:
            ws.unlock(reason=reason)
        return self.capture()

    def release(self) -> None:
        """Drop every graph and hand its pool memory back to the driver.

        Calls then fail until capture() runs. Outputs the caller still holds keep their
        blocks alive (the allocator frees a private pool only once nothing uses it).
        """
        had_graphs = bool(self._set.graphs)
        if self._backend is not None and had_graphs:
            self._backend.synchronize()
        self._reset_graphs()
        if self._backend is not None and had_graphs:
            self._backend.empty_cache()

    def estimate_graph_memory(self, sample_sizes: Sequence[int] | None = None) -> int:
        """Estimate the graph pool of the whole ladder without keeping any graph.

        For an engine that sizes its KV cache from free memory *before* capturing: the
        ``before_capture`` hooks run (so arenas reach their size), then the largest size
        and a few smaller ones are captured into a throwaway pool as a profiling capture
        (arenas stay unlocked, the process stays out of SERVING), released, and the
        cached blocks handed back to the driver. The estimate is the largest graph's pool
        plus, for every other size, the mean growth the sampled smaller sizes caused.
        """
        validate_sample_sizes(sample_sizes, self.sizes)
        if self.mode is Mode.NONE:
            return 0
        desc = sorted(self.sizes, reverse=True)
        if sample_sizes is None:
            rest = desc[1:]
            picks = {rest[0], rest[len(rest) // 2], rest[-1]} if rest else set()
            sample = [desc[0], *sorted(picks, reverse=True)]  # largest, second, middle, smallest
        else:
            sample = sorted(set(validate_sizes(sample_sizes)) | {desc[0]}, reverse=True)
        throwaway = _GraphSet(self.name, self.share_outputs)
        plan = lifecycle.CapturePlan(
            owner=f"GraphRunner({self.name}) estimate",
            sizes=sample,
            warmup=self._warmup_forward,
            body=lambda size: throwaway.body(size, self.static.views(size), self._forward),
            register=throwaway.register,
            warmup_iters=self.warmup_iters,
            before_capture=self.before_capture,
            workspaces=self.workspaces,
            error_mode=self.capture_error_mode,
            on_error="raise",
            progress=False,
            profiling=True,
            mode=self.mode.value,
            state=self.state,
        )
        report = lifecycle.run(plan, self.backend)
        throwaway.graphs.clear()
        throwaway.out_leaves = None
        self.backend.synchronize()
        self.backend.empty_cache()
        # With shared outputs only the first two captures allocate fresh blocks (the
        # largest graph's, then the second graph's own outputs while the largest's are
        # alive); later sizes reuse freed blocks. So: the first two measured, the rest
        # extrapolated from the growth of the sampled smaller sizes.
        growth = [s.pool_growth_bytes for s in report.sizes]
        head = sum(growth[:2])
        tail = growth[2:]
        per_size = sum(tail) / len(tail) if tail else 0.0
        estimate = int(head + per_size * max(0, len(desc) - min(2, len(growth))))
        largest = growth[0]
        logger.info(
            "%s: estimated graph pool %.3f GiB for %d sizes (largest %.3f GiB, sampled %s)",
            self.name,
            estimate / 2**30,
            len(desc),
            largest / 2**30,
            sample,
        )
        return estimate

    def verify(self, **kwargs: Any) -> Any:
        """Replay every captured size on fresh inputs and compare with eager.

        See :func:`graphguard.verify.verify` for the arguments and the report.
        """
        return verify(self, **kwargs)

    def _warmup_forward(self, size: int) -> None:
        snap = None if self._refill_always else self.static.snapshot()
        self._forward(*self.static.views(size))
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

    def _forward(self, *views: torch.Tensor) -> Any:
        """The captured forward (the sanitizer overrides it to watch storages)."""
        return self.fn(*views)

    def _build_entries(self) -> None:
        gs = self._set
        self._table = PaddingTable(sorted(gs.graphs))
        self._entries = [None] * (self._table.max_size + 1)
        if gs.out_leaves is None:
            return
        cache_output = immutable_structure(gs.out_spec)
        for n in range(1, self._table.max_size + 1):
            size = self._table.padded(n)
            assert size is not None
            base = gs.graph_leaves.get(size, gs.out_leaves)
            leaves = [x.narrow(0, 0, n) if batched else x for x, batched in zip(base, gs.batched)]
            views = self.static.views(n)
            tail_dsts, tail_srcs = self.static.tails(n)
            self._entries[n] = _Entry(
                n=n,
                size=size,
                sig=[_signature(v) for v in views],
                dsts=views,
                tail_dsts=tail_dsts,
                tail_srcs=tail_srcs,
                replay=gs.graphs[size].replay,
                leaves=leaves,
                output=unflatten(leaves, gs.out_spec) if cache_output else None,
            )

    # ----------------------------------------------------------------- replay

    def __call__(self, *inputs: Any) -> Any:
        """Run on a batch: replay the graph of the next captured size, or run eagerly.

        Returns views valid until the next call (see the class docstring).
        """
        try:
            e = self._entries[inputs[0].shape[self._lead_dim]]
            ok = e is not None and list(map(_signature, inputs)) == e.sig
        except (IndexError, AttributeError, TypeError):
            ok = False
        if not ok:
            return self._call_slow(inputs)
        assert e is not None
        _foreach_copy(e.dsts, inputs)
        return self._run(e)

    def static_inputs(self, n: int) -> list[torch.Tensor]:
        """The zero-copy path, part 1: the static input rows for a batch of ``n``.

        Write the batch straight into these views (as engines with persistent input
        buffers do), then call :meth:`replay`; no input copy is made. Only for ``n`` up
        to the largest captured size.
        """
        return self._entry(n).dsts

    def replay(self, n: int) -> Any:
        """The zero-copy path, part 2: replay for a batch of ``n`` already written into
        :meth:`static_inputs`; padded rows are refilled when the batch shrank.

        Same output contract as :meth:`__call__`.
        """
        try:
            e = self._entries[n]
        except (IndexError, TypeError):
            e = None
        if e is None:
            e = self._entry(n)
        return self._run(e)

    def _run(self, e: _Entry) -> Any:
        """Shared tail of both replay paths: refill padded rows if the batch shrank,
        replay, hand out the output views."""
        if self._dirty > e.n or self._refill_always:
            _foreach_copy(e.tail_dsts, e.tail_srcs)
        self._dirty = e.n
        e.replay()
        out = e.output
        if out is None:
            out = unflatten(e.leaves, self._set.out_spec)
        if self.copy_outputs:
            out = torch.utils._pytree.tree_map_only(torch.Tensor, torch.clone, out)
        return out

    def _entry(self, n: int) -> _Entry:
        e = self._entries[n] if 0 < n < len(self._entries) else None
        if e is None:
            raise GraphGuardError(
                f"{self.name}: no graph for a batch of {n}: captured sizes are "
                f"{list(self.captured_sizes) or 'none (call capture() first)'}; batches above "
                f"{self.max_size} must go through runner(*inputs), which runs them eagerly"
            )
        return e

    def _call_slow(self, inputs: tuple[Any, ...]) -> Any:
        """Validation errors, eager fallback, and the not-captured-yet error."""
        raise_input_mismatch(inputs, self.specs, f"{self.name}")
        n = int(inputs[0].shape[self.specs[0].batch_dim])
        if self.mode is not Mode.NONE and not self._captured:
            raise GraphGuardError(
                f"{self.name}: called with batch size {n} before capture(); call "
                "runner.capture() first (or build the runner with mode='none')"
            )
        if n not in self._eager_logged:
            self._eager_logged.add(n)
            if self.mode is Mode.NONE:
                why = "mode is none"
            elif not self._table.sizes:
                why = "no size captured"
            else:
                why = f"it is above the largest captured size {self._table.max_size}"
            logger.info(
                "%s: batch size %d runs eagerly (%s); logged once per size", self.name, n, why
            )
        return self.eager(*inputs)

    def eager(self, *inputs: Any) -> Any:
        """Run the callable eagerly on the caller's tensors (no padding, no graph)."""
        return self.fn(*inputs)

    def __repr__(self) -> str:
        return (
            f"GraphRunner({self.name}, mode={self.mode.value}, sizes={len(self.sizes)} up to "
            f"{self.sizes[-1]}, captured={len(self._set.graphs)})"
        )


__all__ = ["GraphRunner"]
