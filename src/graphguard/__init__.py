"""graphguard: CUDA-graph capture and replay for PyTorch inference steps, safe by construction.

A captured graph freezes raw device addresses; graphguard runs the capture lifecycle that
keeps them valid (kernel warmups before capture, a synchronize after every warmup,
arenas locked after capture, one shared pool, largest size first) and turns every way of
breaking them into an error.

Quick start::

    import graphguard as gg

    runner = gg.GraphRunner(model.decode_step, (tokens, positions, slots),
                            sizes=gg.capture_sizes(256), fill_values=(0, 0, scratch_slot),
                            before_capture=[model.warm_kernels], workspaces=[arena])
    report = runner.capture()        # lifecycle; progress bar; report.table()
    logits = runner(tokens, positions, slots)   # views valid until the next call

Runners: :class:`GraphRunner` (FULL: one graph per size), :class:`PiecewiseRunner`
(graphs between eager split ops), :class:`DistributedGraphRunner` (ranks in lockstep);
:class:`CaptureOptions` holds their shared arguments. :class:`Dispatcher` runs each
:class:`BatchKey` on what the :class:`DispatchPlan` decided; :func:`build_dispatcher` wires
all three for a step whose inputs are one row per token. :func:`verify` compares
graphs with eager. Errors live in :mod:`graphguard.errors`.
"""

from __future__ import annotations

from graphguard import (
    errors,
    phase,
    sanitizer,  # registers the sanitizing runner (sanitize=True)
)
from graphguard.backend import CudaBackend, GraphBackend, RecordingBackend
from graphguard.config import CaptureOptions, Mode
from graphguard.dispatch import BatchKey, Dispatcher, DispatchPlan, build_dispatcher
from graphguard.distributed import DistributedGraphRunner
from graphguard.errors import (
    ArenaStreamAliasError,
    BusyStreamError,
    CaptureTripwireError,
    CaptureUnsafeOpError,
    ConfigError,
    DivergenceError,
    FreedStorageError,
    GraphCaptureError,
    GraphGuardError,
    InputMismatchError,
    ReboundTensorError,
    SanitizerError,
    StaleOutputError,
    WorkspaceLockedError,
)
from graphguard.phase import (
    Phase,
    current_phase,
    in_graph_preparation,
    is_capturing,
    overlap_allowed,
)
from graphguard.piecewise import PiecewiseRunner
from graphguard.report import CaptureReport, SizeReport
from graphguard.runner import GraphRunner
from graphguard.sizes import capture_sizes
from graphguard.streams import AuxStream, watch_stream
from graphguard.verify import verify
from graphguard.workspace import Workspace

__version__ = "0.1.0"

__all__ = [
    "ArenaStreamAliasError",
    "AuxStream",
    "BatchKey",
    "BusyStreamError",
    "CaptureOptions",
    "CaptureReport",
    "CaptureTripwireError",
    "CaptureUnsafeOpError",
    "ConfigError",
    "CudaBackend",
    "DispatchPlan",
    "Dispatcher",
    "DistributedGraphRunner",
    "DivergenceError",
    "FreedStorageError",
    "GraphBackend",
    "GraphCaptureError",
    "GraphGuardError",
    "GraphRunner",
    "InputMismatchError",
    "Mode",
    "Phase",
    "PiecewiseRunner",
    "ReboundTensorError",
    "RecordingBackend",
    "SanitizerError",
    "SizeReport",
    "StaleOutputError",
    "Workspace",
    "WorkspaceLockedError",
    "__version__",
    "build_dispatcher",
    "capture_sizes",
    "current_phase",
    "errors",
    "in_graph_preparation",
    "is_capturing",
    "overlap_allowed",
    "phase",
    "sanitizer",
    "verify",
    "watch_stream",
]
