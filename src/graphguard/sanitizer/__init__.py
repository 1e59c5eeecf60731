"""The sanitizer: opt-in checks that turn CUDA-graph memory hazards into immediate errors.

``GraphRunner(..., sanitize=True)`` (or ``GRAPHGUARD_SANITIZE=1``) builds the runner with
:class:`Sanitizing` mixed in (:mod:`.checks`; ``SanitizingGraphRunner`` for a plain
``GraphRunner``), which adds, one module per check:

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
runs one way: the runner imports :func:`.checks.sanitizing` where it chooses its class;
nothing here imports the runner.
"""

from __future__ import annotations

from graphguard.sanitizer.checks import Sanitizing, capabilities, sanitizing
from graphguard.sanitizer.stale import GuardedOutput
from graphguard.sanitizer.storages import TrackedStorage
from graphguard.verify import SizeCheck, VerifyReport, default_tolerance, verify

__all__ = [
    "GuardedOutput",
    "Sanitizing",
    "SizeCheck",
    "TrackedStorage",
    "VerifyReport",
    "capabilities",
    "default_tolerance",
    "sanitizing",
    "verify",
]
