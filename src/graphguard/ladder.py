"""The ladder both runners stand on: static inputs, padding table, per-size entries, replay.

A :class:`Ladder` owns what ``GraphRunner`` (FULL) and ``PiecewiseRunner`` (PIECEWISE)
share: the input specs and static buffers, the padding table, one precomputed
:class:`_Entry` per batch size, ``__call__`` (list index, signature compare, one fused
copy, ``_run``), the zero-copy path (:meth:`Ladder.static_inputs` / :meth:`Ladder.replay`),
the slow path (validation errors, eager fallback logged once per size), ``release`` /
``recapture`` and ``verify``. A subclass supplies the capture plan (``_plan``), what a
size's entry replays (``_entry_parts``) and ``_run``.

Contract: outputs are views into memory the next call overwrites; a runner is not
thread-safe. Static buffers never require grad (their views are made under no_grad).
"""

from __future__ import annotations

import logging
import operator
from collections.abc import Callable, Sequence
from typing import Any

import torch

from graphguard import capture as lifecycle
from graphguard.backend import CudaBackend, GraphBackend
from graphguard.buffers import (
    InputSpec,
    InputWrites,
    StaticInputs,
    flatten,
    make_specs,
    raise_input_mismatch,
)
from graphguard.config import CaptureOptions, Mode
from graphguard.errors import ConfigError, GraphGuardError
from graphguard.outputs import OutputLayout, check_output_leaves, narrow_outputs
from graphguard.report import CaptureReport
from graphguard.sizes import PaddingTable, resolve_sizes
from graphguard.state import StateSet
from graphguard.verify import verify

logger = logging.getLogger("graphguard")

_signature = operator.attrgetter("shape", "dtype", "device")
_foreach_copy = torch._foreach_copy_


class _Entry:
    """Everything the hot path needs for one batch size ``n``, precomputed at capture.

    ``replay`` replays the size-``size`` graph(s); ``leaves``/``output`` are the cached
    output views (FULL) and ``batch_dims`` each output leaf's batch dim (None: returned
    whole; :mod:`graphguard.outputs`). ``writeback`` indexes the inputs the callable
    writes in place, whose first ``n`` rows (``writeback_srcs``) are copied back into the
    caller's tensors after the replay, as eager would have left them.
    """

    __slots__ = (
        "batch_dims",
        "dsts",
        "leaves",
        "n",
        "output",
        "replay",
        "sig",
        "size",
        "tail_dsts",
        "tail_srcs",
        "writeback",
        "writeback_srcs",
    )
    batch_dims: list[int | None]
    dsts: list[torch.Tensor]
    leaves: list[Any]
    n: int
    output: Any
    replay: Callable[[], Any]
    sig: list[Any]
    size: int
    tail_dsts: list[torch.Tensor]
    tail_srcs: list[torch.Tensor]
    writeback: list[int]
    writeback_srcs: list[torch.Tensor]

    def __init__(self, **kw: Any) -> None:
        self.batch_dims = []
        self.leaves = []
        self.output = None
        self.writeback = []
        self.writeback_srcs = []
        for k, v in kw.items():
            setattr(self, k, v)


class Ladder:
    """Base of :class:`~graphguard.GraphRunner` and :class:`~graphguard.PiecewiseRunner`.

    Not built directly: the subclasses document the arguments. ``options`` is the
    validated :class:`~graphguard.CaptureOptions`; ``backend`` the device backend (None:
    a CudaBackend on the inputs' device, made on first use).
    """

    _kind = "Ladder"
    """The runner's class name in messages (``GraphRunner(decode)``)."""
    _allowed_modes: tuple[Mode, ...] = (Mode.FULL, Mode.NONE)

    def __init__(
        self,
        fn: Callable[..., Any],
        example_inputs: Sequence[torch.Tensor],
        options: CaptureOptions,
        backend: GraphBackend | None,
    ) -> None:
        self.options = options
        self.fn = fn
        self.name = options.name or getattr(fn, "__qualname__", None) or type(fn).__name__
        self.label = f"{self._kind}({self.name})"
        self.mode = options.run_mode
        if self.mode not in self._allowed_modes:
            raise ConfigError(self._mode_error())
        self.specs: list[InputSpec] = make_specs(
            example_inputs,
            batch_dims=options.batch_dims,
            fill_values=options.fill_values,
            names=options.names,
        )
        self.sizes = resolve_sizes(
            options.sizes, options.max_size, int(example_inputs[0].shape[self.specs[0].batch_dim])
        )
        self.copy_outputs = options.copy_outputs
        self.workspaces = list(options.workspaces)
        self.state: StateSet | None = StateSet.of(options.state) or None
        self._backend = backend
        self.static = StaticInputs(self.specs, self.sizes[-1])
        self._lead_dim = self.specs[0].batch_dim
        self.report: CaptureReport | None = None
        self._eager_logged: set[int] = set()
        self._grad_logged = False
        self._reset_graphs()

    def _mode_error(self) -> str:
        allowed = " or ".join(repr(m.value) for m in self._allowed_modes)
        return f"{self.label}: runs mode {allowed}, got {self.mode.value!r}"

    # ----------------------------------------------------------- options (read-only)

    @property
    def warmup_iters(self) -> int:
        return self.options.warmup_iters

    @property
    def capture_error_mode(self) -> str:
        return self.options.capture_error_mode

    @property
    def on_capture_error(self) -> str:
        return self.options.on_capture_error

    @property
    def progress(self) -> bool:
        return self.options.progress

    # ------------------------------------------------------------------ state

    def _reset_graphs(self) -> None:
        self._table = PaddingTable(())
        self._entries: list[_Entry | None] = [None]
        self._dirty = self.static.max_size
        # Without a warmup only version counters see input writes, so padded rows are
        # refilled on every call (one small fused copy) to never drift.
        self._refill_always = self.options.warmup_iters == 0
        self._captured = False
        self._layout = OutputLayout(self.label)
        self._writes = InputWrites(self.static)

    @property
    def backend(self) -> GraphBackend:
        """The device backend (created on first use: a CudaBackend on the inputs' device)."""
        if self._backend is None:
            dev = self.specs[0].device
            if dev.type != "cuda":
                raise ConfigError(
                    f"{self.name}: CUDA graphs need CUDA tensors, but the example inputs are on "
                    f"{dev}. Use mode='none' to run eagerly through the same API, or "
                    "backend=graphguard.RecordingBackend() to emulate capture on the CPU."
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
        size = self._table.padded(n)
        return size if size == n or self._layout.dims is not None else None

    # ---------------------------------------------------------------- capture

    def _plan(self) -> lifecycle.CapturePlan:
        """The capture plan of this runner (subclasses)."""
        raise NotImplementedError

    def _graph_sizes(self) -> list[int]:
        """Sizes captured so far, from the subclass's own record (subclasses)."""
        raise NotImplementedError

    def _entry_parts(self, n: int, size: int) -> dict[str, Any]:
        """The kind-specific fields of the entry of batch ``n`` padded to ``size``."""
        raise NotImplementedError

    def _drop_graphs(self) -> None:
        """Forget graphs held outside the entries (subclasses; called by release)."""

    def _plan_options(self) -> dict[str, Any]:
        """The CapturePlan fields that come straight from the options."""
        o = self.options
        return {
            "name": self.label,
            "warmup_iters": o.warmup_iters,
            "before_capture": [*o.before_capture, self._probe_layout],
            "after_capture": list(o.after_capture),
            "workspaces": self.workspaces,
            "capture_error_mode": o.capture_error_mode,
            "on_capture_error": o.on_capture_error,
            "progress": o.progress,
            "mode": self.mode,
            "state": self.state,
            "discard": self._discard,
            "static_inputs": self.static.buffers,
            # Declared state (even state=[]) means the user knows: no write watch.
            "watch": self.fn if self.options.state is None else None,
        }

    def _discard(self) -> None:
        """Drop the graphs of an aborted capture (the lifecycle calls it)."""
        self._drop_graphs()
        self._reset_graphs()

    def _capture_backend(self) -> GraphBackend:
        return self.backend

    def capture(self) -> CaptureReport:
        """Run the capture lifecycle (see :mod:`graphguard.capture`) and return its report.

        Raises :class:`GraphCaptureError` (with ``on_capture_error="raise"``) after
        keeping every size that did capture; the runner is consistent either way. A
        capture that kept no graph (a hook raised, an interrupt) may simply be retried.
        """
        if self._graph_sizes():
            raise GraphGuardError(
                f"{self.name}: already captured {list(self.captured_sizes)}; call "
                "recapture(reason=...) to drop the graphs and capture again on purpose"
            )
        if self.mode is Mode.NONE:
            self._captured = True
            self.report = CaptureReport(mode=self.mode.value, backend="none")
            logger.info("%s: mode none, every call runs eagerly", self.name)
            return self.report
        plan = self._plan()
        try:
            self.report = lifecycle.run(plan, self._capture_backend())
        except BaseException:
            self._build_entries()
            self._captured = bool(self._graph_sizes())
            raise
        self._captured = True
        self._build_entries()
        return self.report

    def recapture(self, *, reason: str) -> CaptureReport:
        """Drop every graph, unlock the arenas on purpose, and capture again.

        For deliberate changes (weights reloaded, a config changed). ``reason`` is logged
        and required, so a recapture never happens by accident.
        """
        if not reason or not isinstance(reason, str):
            raise ConfigError("recapture needs a reason, e.g. recapture(reason='weights reloaded')")
        logger.warning("%s: recapturing (%s)", self.name, reason)
        self.release()
        for ws in self.workspaces:
            ws.unlock(reason=reason)
        return self.capture()

    def release(self) -> None:
        """Drop every graph and hand its pool memory back to the driver.

        Calls fail until capture() runs. Outputs the caller still holds need not keep
        their memory alive (GraphRunner's shared outputs and the pieces' outputs are
        non-owning views into the pool): after release they may point at freed memory.
        Clone what must outlive the graphs.
        """
        had_graphs = bool(self._graph_sizes())
        if self._backend is not None and had_graphs:
            self._backend.synchronize()
        self._drop_graphs()
        self._reset_graphs()
        if self._backend is not None and had_graphs:
            self._backend.empty_cache()

    def verify(self, **kwargs: Any) -> Any:
        """Replay every captured size on fresh inputs and compare with eager.

        See :func:`graphguard.verify` for the arguments and the report.
        """
        return verify(self, **kwargs)

    def _forward(self, *views: torch.Tensor) -> Any:
        """The forward warmups and captures run (the sanitizer overrides it)."""
        return self.fn(*views)

    def _observed_forward(self, size: int, *, uncaptured: bool) -> Any:
        """One forward on the static buffers at ``size``: which inputs it writes
        (:class:`~graphguard.buffers.InputWrites`) and whether its outputs fit the layout
        (:class:`~graphguard.outputs.OutputLayout`, raises when not)."""
        token = self._writes.before(contents=uncaptured)
        out = self._forward(*self.static.views(size))
        self._writes.after(token)
        self._layout.observe(size, out)
        return out

    def _probe_layout(self, sizes: Sequence[int]) -> None:
        """The last ``before_capture`` hook: :meth:`OutputLayout.probe`, then refill."""
        self._layout.probe(sizes, lambda size: self._observed_forward(size, uncaptured=True))
        self.static.reset()

    def _warmup_forward(self, size: int) -> None:
        out = self._observed_forward(size, uncaptured=True)
        check_output_leaves(flatten(out)[0], f"{self.label} (warmup at size {size})")

    def unpad(self, out: Any, inputs: Sequence[Any], rows: Sequence[Any], n: int) -> Any:
        """For ``n`` rows run as a larger padded batch ``rows`` (DistributedGraphRunner's
        "pad"): written input rows copied back into ``inputs``, outputs narrowed to ``n``."""
        for i in self._writes.written(self.name) if self._table.sizes else []:
            inputs[i].copy_(rows[i].narrow(self.specs[i].batch_dim, 0, n))
        return narrow_outputs(out, self._layout.dims, n, self.name)

    def _build_entries(self) -> None:
        self._table = PaddingTable(sorted(self._graph_sizes()))
        top = self._table.max_size
        written = self._writes.written(self.name) if top else []
        self._refill_always = self._refill_always or bool(written)
        # Twice as long as needed, the upper half None: a negative n (replay(-1)) lands
        # on None and takes the slow path instead of wrapping around to the largest size.
        self._entries = [None] * (2 * top + 2)
        for n in self._layout.entry_sizes(self.name, self._table.sizes):
            size = self._table.padded(n)
            assert size is not None
            # Input views made under no_grad: copying an input that requires grad into
            # them raises before writing (instead of making the static buffers part of an
            # autograd graph). Output views are not: a replay writes their base in place.
            with torch.no_grad():
                views = self.static.views(n)
                tail_dsts, tail_srcs = self.static.tails(n)
            self._entries[n] = _Entry(
                n=n,
                size=size,
                sig=[_signature(v) for v in views],
                dsts=views,
                tail_dsts=tail_dsts,
                tail_srcs=tail_srcs,
                writeback=written,
                writeback_srcs=[views[i] for i in written],
                **self._entry_parts(n, size),
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
        try:
            _foreach_copy(e.dsts, inputs)
        except RuntimeError as exc:
            return self._copy_failed(inputs, exc)
        if e.writeback:
            return self._run_writing(e, inputs)
        return self._run(e)

    def _run_writing(self, e: _Entry, inputs: tuple[Any, ...]) -> Any:
        """Replay a step that writes its inputs in place, then copy the written rows
        back into the caller's tensors (stream-ordered, no sync), as eager leaves them."""
        out = self._run(e)
        self._writes.copy_back([inputs[i] for i in e.writeback], e, self.name)
        return out

    def _run(self, e: _Entry) -> Any:
        """Refill padded rows if the batch shrank, replay, return outputs (subclasses)."""
        raise NotImplementedError

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

        Same output contract as :meth:`__call__`. ``n`` is an int from 1 to
        :attr:`max_size` (a bool counts as the int it is, like any Python index).
        """
        try:
            e = self._entries[n]
        except (IndexError, TypeError):
            e = None
        if e is None:
            e = self._entry(n)
        return self._run(e)

    def _entry(self, n: Any) -> _Entry:
        """The entry of batch ``n``, or an error saying why there is none (slow path)."""
        if not isinstance(n, int) or isinstance(n, bool):
            raise ConfigError(
                f"{self.name}: a batch size must be an int, got {n!r} ({type(n).__name__})"
            )
        e = self._entries[n] if 0 < n <= self._table.max_size else None
        if e is None:
            raise GraphGuardError(
                f"{self.name}: no graph for a batch of {n}: captured sizes are "
                f"{list(self.captured_sizes) or 'none (call capture() first)'}; batches above "
                f"{self.max_size} must go through runner(*inputs), which runs them eagerly"
            )
        return e

    def _copy_failed(self, inputs: tuple[Any, ...], exc: RuntimeError) -> Any:
        """The fused input copy raised: inputs that require grad are replayed detached."""
        grad = [s.name for s, x in zip(self.specs, inputs) if x.requires_grad]
        if not grad:
            raise exc
        if not self._grad_logged:
            self._grad_logged = True
            logger.warning(
                "%s: inputs %s require grad; a graph has no autograd, so graphguard replays "
                "on detached copies (outputs carry no autograd history). Call under "
                "torch.inference_mode() or pass detached tensors to silence this; logged once",
                self.name,
                grad,
            )
        return self(*(x.detach() for x in inputs))

    def _call_slow(self, inputs: tuple[Any, ...]) -> Any:
        """Validation errors, eager fallback, and the not-captured-yet error."""
        raise_input_mismatch(inputs, self.specs, self.name)
        n = int(inputs[0].shape[self._lead_dim])
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
            elif n <= self._table.max_size:
                why = "the output layout is unknown, so only captured sizes replay"
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
            f"{self._kind}({self.name}, mode={self.mode.value}, sizes={len(self.sizes)} up to "
            f"{self.sizes[-1]}, captured={len(self._graph_sizes())})"
        )


__all__ = ["Ladder"]
