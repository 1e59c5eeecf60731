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

The face, in lifecycle order:

* build: :class:`GraphRunner` (FULL: one graph per size), :class:`PiecewiseRunner`
  (graphs between eager split ops), :class:`DistributedGraphRunner` (ranks in lockstep),
  their shared :class:`CaptureOptions` (with the feature objects :class:`Canary` and
  :class:`Lazy`), :class:`Mode`, :func:`capture_sizes`,
  :class:`StateSet` (what ``state=`` declares), :class:`CompiledStep`;
* model code: :class:`Workspace`, :class:`AuxStream`, :func:`watch_stream`,
  :func:`overlap_allowed`, :func:`is_capturing` (the rest of the phase monitor in
  :mod:`graphguard.phase`);
* serve: :class:`Dispatcher` runs each :class:`BatchKey` on what its plan decided;
  :func:`build_dispatcher` wires it for a step whose inputs are one row per token;
* check: :class:`CaptureReport`, :func:`verify`; the sanitizer (``sanitize=True``,
  :mod:`graphguard.sanitizer`, loaded only then); :class:`RecordingBackend` runs the
  lifecycle on a CPU; :func:`reset_process_state` clears graphguard's process-wide
  registries between tests.

Every error is in :mod:`graphguard.errors` (``gg.errors.ConfigError``); the backends are
in :mod:`graphguard.backend`. The names that left the top level in 0.2 are served from
their homes only since 0.3 (``CHANGELOG.md`` lists them).
"""

from __future__ import annotations

from graphguard import errors, phase
from graphguard._process import reset_process_state
from graphguard.backend import RecordingBackend
from graphguard.compiled import CompiledStep
from graphguard.config import Canary, CaptureOptions, Lazy, Mode
from graphguard.dispatch import BatchKey, Dispatcher, build_dispatcher
from graphguard.distributed import DistributedGraphRunner
from graphguard.phase import is_capturing, overlap_allowed
from graphguard.piecewise import PiecewiseRunner
from graphguard.report import CaptureReport
from graphguard.runner import GraphRunner
from graphguard.sizes import capture_sizes
from graphguard.state import StateSet
from graphguard.streams import AuxStream, watch_stream
from graphguard.verify import verify
from graphguard.workspace import Workspace

__version__ = "0.4.0"

__all__ = [
    "AuxStream",
    "BatchKey",
    "Canary",
    "CaptureOptions",
    "CaptureReport",
    "CompiledStep",
    "Dispatcher",
    "DistributedGraphRunner",
    "GraphRunner",
    "Lazy",
    "Mode",
    "PiecewiseRunner",
    "RecordingBackend",
    "StateSet",
    "Workspace",
    "__version__",
    "build_dispatcher",
    "capture_sizes",
    "errors",
    "is_capturing",
    "overlap_allowed",
    "phase",
    "reset_process_state",
    "verify",
    "watch_stream",
]
