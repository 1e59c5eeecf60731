"""graphguard: CUDA-graph capture and replay for PyTorch inference engines, safe by construction.

A captured CUDA graph freezes raw device addresses. graphguard packages the lifecycle
that keeps those addresses valid, and makes every way of breaking them loud:

1. kernel warmups at realistic shapes *before* any capture (``before_capture``), so
   workspaces reach their final size first;
2. a device synchronize after every uncaptured warmup forward, and a check that every
   known stream is idle when capture begins;
3. a phase monitor (:mod:`graphguard.phase`) so model code turns auxiliary-stream overlap
   off during uncaptured warmups (:func:`overlap_allowed`);
4. workspace arenas (:class:`Workspace`) that lock after capture;
5. per-size graphs in one shared pool, padding to the next captured size
   (:class:`GraphRunner`).

Quick start::

    import graphguard as gg

    runner = gg.GraphRunner(model.decode_step, (tokens, positions, slots),
                            sizes=gg.capture_sizes(256), fill_values=(0, 0, scratch_slot),
                            before_capture=[model.warm_kernels], workspaces=[arena])
    report = runner.capture()        # lifecycle; progress bar; report.table()
    logits = runner(tokens, positions, slots)   # views valid until the next call

Public API: :class:`GraphRunner`, :func:`capture_sizes`, :class:`Mode`,
:class:`Workspace`, :class:`AuxStream`, :class:`CaptureReport`, the phase queries
(:func:`is_capturing`, :func:`in_graph_preparation`, :func:`overlap_allowed`,
:func:`current_phase`, :class:`Phase`) and the errors in :mod:`graphguard.errors`.
"""

from __future__ import annotations

from graphguard import errors, phase
from graphguard.backend import CudaBackend, GraphBackend, RecordingBackend
from graphguard.config import Mode
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
    "BusyStreamError",
    "CaptureReport",
    "CaptureTripwireError",
    "CaptureUnsafeOpError",
    "ConfigError",
    "CudaBackend",
    "DivergenceError",
    "FreedStorageError",
    "GraphBackend",
    "GraphCaptureError",
    "GraphGuardError",
    "GraphRunner",
    "InputMismatchError",
    "Mode",
    "Phase",
    "ReboundTensorError",
    "RecordingBackend",
    "SanitizerError",
    "SizeReport",
    "StaleOutputError",
    "Workspace",
    "WorkspaceLockedError",
    "__version__",
    "capture_sizes",
    "current_phase",
    "errors",
    "in_graph_preparation",
    "is_capturing",
    "overlap_allowed",
    "phase",
    "verify",
    "watch_stream",
]
