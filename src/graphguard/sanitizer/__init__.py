"""The sanitizer: opt-in checks that turn CUDA-graph memory hazards into immediate errors.

``GraphRunner(..., sanitize=True)`` (or ``GRAPHGUARD_SANITIZE=1``) builds the runner with
a :class:`Sanitizer` part (:mod:`.checks`; the runner stays a ``GraphRunner``,
``runner.sanitize`` says it is on), which adds, one module per check:

* :mod:`.storages` -- freed, resized, moved or rebound storages a graph uses
  (:class:`~graphguard.errors.FreedStorageError`, :class:`~graphguard.errors.ReboundTensorError`);
* :mod:`.stale` -- outputs read after a later replay overwrote them
  (:class:`~graphguard.errors.StaleOutputError`);
* :mod:`.unsafe` -- host syncs and host reads of device values in warmups and capture
  (:class:`~graphguard.errors.CaptureUnsafeOpError`), on the warming thread only;
* :mod:`.arenas` -- one arena handed out on two streams in one step
  (:class:`~graphguard.errors.ArenaStreamAliasError`);
* busy side streams at capture (:class:`~graphguard.errors.BusyStreamError`): streams
  seen in warmups are watched by :func:`graphguard.streams.watch_stream`.

Graph-vs-eager comparison lives in :mod:`graphguard.verify` (re-exported here).
When sanitizing is off none of this package is imported (``import graphguard`` does not
load it) and the replay path is the plain :meth:`GraphRunner.__call__`. The dependency
runs one way: the runner imports :class:`.checks.Sanitizer` where it chooses its parts;
nothing here imports the runner.
"""

from __future__ import annotations

import warnings
from typing import Any

from graphguard.sanitizer.checks import Sanitizer, capabilities
from graphguard.sanitizer.stale import GuardedOutput
from graphguard.sanitizer.storages import TrackedStorage
from graphguard.verify import SizeCheck, VerifyReport, default_tolerance, verify


def _unchanged(cls: Any) -> Any:
    return cls


def __getattr__(name: str) -> Any:
    """``Sanitizing`` and ``sanitizing``, the mixin and the class factory of 0.4:
    deprecated, since the sanitizer is a part (:class:`Sanitizer`) and a sanitized runner
    is a plain ``GraphRunner``."""
    if name == "Sanitizing":
        warnings.warn(
            "graphguard.sanitizer.Sanitizing is deprecated: the sanitizer is a part of the "
            "runner, graphguard.sanitizer.Sanitizer, and a sanitized runner is a plain "
            "GraphRunner (isinstance(runner, Sanitizing) no longer holds); test "
            "runner.sanitize instead",
            DeprecationWarning,
            stacklevel=2,
        )
        return Sanitizer
    if name == "sanitizing":
        warnings.warn(
            "graphguard.sanitizer.sanitizing(cls) is deprecated and returns cls unchanged: "
            "build the runner with sanitize=True (graphguard.GraphRunner(..., "
            "sanitize=True)) to get the sanitizer's checks",
            DeprecationWarning,
            stacklevel=2,
        )
        return _unchanged
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "GuardedOutput",
    "Sanitizer",
    "SizeCheck",
    "TrackedStorage",
    "VerifyReport",
    "capabilities",
    "default_tolerance",
    "verify",
]
